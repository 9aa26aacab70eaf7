//! What a run produced and how it is shown: the output collector (head and tail inline, the
//! whole spilled to a file), the run record that becomes `structuredContent`, and the three
//! text renderings (compact, TOON, JSON).

use std::collections::VecDeque;
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::Serialize;
use serde_json::{Map, Value};

use crate::config::OutputMode;
use crate::frame::PyErrorInfo;

mod notes;

pub use self::notes::{NoteContext, may_need_notes, sandbox_notes};

/// How a run ended, from the host's point of view.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RunStatus {
    /// The cell ran to the end.
    Ok,
    /// The cell raised; `error` says what.
    Error,
    /// The cell raised `SystemExit`; the session is kept.
    Exit,
    /// The wall-clock limit ran out.
    Timeout,
    /// The client cancelled the call.
    Cancelled,
    /// The worker process died (signal, `os._exit`, resource kill).
    Crashed,
    /// The cell wrote more than the output limit.
    OutputLimit,
    /// The session directory outgrew its quota; the worker was killed and the files removed.
    ScratchQuota,
}

/// Where a stream was cut, and where its whole text is.
#[derive(Debug, Clone, Serialize)]
pub struct Truncation {
    pub total_bytes: u64,
    pub shown_bytes: u64,
    /// Path of the saved output, relative to the session's working directory.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub file: Option<String>,
    /// The saved output as an MCP resource.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub uri: Option<String>,
    /// True when even the saved file stops short (the output limit was hit).
    pub file_complete: bool,
    /// Why the whole output could not be saved, if it could not.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub file_error: Option<String>,
}

/// What became of the session's Python state in a run (`session_state` of the record).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SessionState {
    /// The session's first run: a fresh worker.
    New,
    /// Variables and imports of earlier runs survive.
    Kept,
    /// A fresh worker started for this run; the earlier state was lost (a notice says why).
    Restarted,
    /// The worker is gone; the next run starts fresh.
    Lost,
    /// The session's first run, in a fork of another session (`fork_from`): its variables,
    /// imports and files are the parent's as its last run left them.
    Forked,
}

/// The full record of one run: `structuredContent` of the tool result.
#[derive(Debug, Clone, Serialize)]
pub struct RunRecord {
    pub session: String,
    pub status: RunStatus,
    pub stdout: String,
    pub stderr: String,
    pub result: Option<String>,
    pub error: Option<PyErrorInfo>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i64>,
    pub duration_ms: f64,
    pub session_state: SessionState,
    /// The sessions this one was forked from, nearest first (empty: not a fork).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub lineage: Vec<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub notices: Vec<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stdout_truncated: Option<Truncation>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stderr_truncated: Option<Truncation>,
    /// Calls the code made to proxied MCP servers.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub upstream_calls: Vec<ironcell_core::bridge::CallSummary>,
    /// Proxied calls past the first [`crate::proxy::MAX_CALL_SUMMARIES`] of the run: counted, not
    /// recorded one by one.
    #[serde(skip_serializing_if = "is_zero")]
    pub upstream_calls_omitted: u64,
    /// Proxied calls that never got past their look-up (no such server or tool): counted only.
    #[serde(skip_serializing_if = "is_zero")]
    pub upstream_lookups_failed: u64,
    /// Figures and images the run produced (shown inline, full size linked).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub images: Vec<ImageRef>,
    /// Files the run created or changed in the session directory (linked as resources).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub files: Vec<crate::files::FileRef>,
    /// Inline image data (base64, mime), sent as image content; not part of the record.
    #[serde(skip)]
    pub inline_images: Vec<(String, String)>,
}

/// An image of a run, as listed in the record.
#[derive(Debug, Clone, Serialize)]
pub struct ImageRef {
    pub path: String,
    pub uri: String,
    pub mime: String,
    pub bytes: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub width: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub height: Option<u32>,
    /// Whether a (possibly downscaled) copy is in the result itself.
    pub inline: bool,
}

impl RunRecord {
    /// Whether the MCP result should carry `isError: true`.
    pub fn is_error(&self) -> bool {
        match self.status {
            RunStatus::Ok => false,
            RunStatus::Exit => self.exit_code.unwrap_or(0) != 0,
            _ => true,
        }
    }

    /// The text block for the model in `mode`.
    pub fn render(&self, mode: OutputMode) -> String {
        match mode {
            OutputMode::Compact => self.render_compact(),
            OutputMode::Json => {
                serde_json::to_string(&self.sparse_value()).unwrap_or_else(|e| e.to_string())
            }
            OutputMode::Toon => encode_toon(&self.sparse_value()),
        }
    }

    /// The record without empty fields: what text modes show.
    fn sparse_value(&self) -> Value {
        let mut v = serde_json::to_value(self).unwrap_or(Value::Null);
        if let Value::Object(map) = &mut v {
            map.retain(|_, v| !matches!(v, Value::Null) && v != &Value::String(String::new()));
        }
        v
    }

    fn render_compact(&self) -> String {
        let mut out = String::new();
        let mut push = |s: &str| {
            if !out.is_empty() && !out.ends_with('\n') {
                out.push('\n');
            }
            out.push_str(s);
        };
        for n in &self.notices {
            push(&format!("[note] {n}"));
        }
        if !self.stdout.is_empty() {
            push(self.stdout.trim_end_matches('\n'));
        }
        if let Some(t) = &self.stdout_truncated {
            push(&truncation_line("stdout", t));
        }
        if !self.stderr.is_empty() {
            push("[stderr]");
            push(self.stderr.trim_end_matches('\n'));
        }
        if let Some(t) = &self.stderr_truncated {
            push(&truncation_line("stderr", t));
        }
        if let Some(r) = &self.result {
            push(&format!("=> {r}"));
        }
        // Other statuses explain themselves in the status line below.
        if let (Some(e), RunStatus::Error) = (&self.error, self.status) {
            let tb = e.traceback.trim_end_matches('\n');
            if tb.is_empty() {
                push(&format!("{}: {}", e.kind, e.message));
            } else {
                push(tb);
            }
        }
        match self.status {
            RunStatus::Ok | RunStatus::Error => {}
            _ => push(&format!("[{}]", self.status_line())),
        }
        if out.is_empty() {
            out.push_str("(no output)");
        }
        out
    }

    /// One line that says how a non-ordinary run ended and what became of the session.
    pub fn status_line(&self) -> String {
        let state = match self.session_state {
            SessionState::Kept => "session kept",
            SessionState::Lost => "session lost: the next run starts a fresh worker",
            SessionState::New => "in a new session",
            SessionState::Restarted => "in a restarted session",
            SessionState::Forked => "in a new fork",
        };
        let what = match self.status {
            RunStatus::Ok => "ok".to_string(),
            RunStatus::Error => "error".to_string(),
            RunStatus::Exit => format!("SystemExit({})", self.exit_code.unwrap_or(0)),
            RunStatus::Timeout => format!("timeout after {:.1} s", self.duration_ms / 1000.0),
            RunStatus::Cancelled => "cancelled by the client".to_string(),
            RunStatus::Crashed => match &self.error {
                Some(e) => format!("worker crashed: {}", e.message),
                None => "worker crashed".to_string(),
            },
            RunStatus::OutputLimit => "stopped: output limit reached".to_string(),
            RunStatus::ScratchQuota => "killed: scratch quota exceeded".to_string(),
        };
        format!("{what}; {state}")
    }
}

// ---------------------------------------------------------------------------------------------
// Notes on refusals: a failure the sandbox caused says so, with the way out, in the result the
// model reads (docs/SECURITY.md keeps the why of each refusal). Read from the run's error and
// stderr, which the worker wrote: the worst a worker can do with them is earn itself a note it
// could have printed anyway.
// ---------------------------------------------------------------------------------------------

/// The data segment of process `pid` (`VmData` of `/proc/<pid>/status`: what RLIMIT_DATA, the
/// memory limit, counts), in bytes. The file's first line is the worker's chosen name, so it is
/// read as bytes.
pub fn data_segment_bytes(pid: i32) -> Option<u64> {
    let status = std::fs::read(format!("/proc/{pid}/status")).ok()?;
    crate::sandbox::rlimits::status_kib(&status, b"VmData").map(|k| k << 10)
}

fn truncation_line(stream: &str, t: &Truncation) -> String {
    let omitted = t.total_bytes.saturating_sub(t.shown_bytes);
    if let Some(why) = &t.file_error {
        return format!(
            "[{stream} truncated: {omitted} of {} bytes omitted above; the whole output was not saved: {why}]",
            t.total_bytes
        );
    }
    match &t.file {
        Some(f) if t.file_complete => format!(
            "[{stream} truncated: {omitted} of {} bytes omitted above; the whole output is in {f}]",
            t.total_bytes
        ),
        Some(f) => format!(
            "[{stream} truncated: {omitted} of {}+ bytes omitted above; the first part is in {f}]",
            t.total_bytes
        ),
        None => format!(
            "[{stream} truncated: {omitted} of {} bytes omitted above]",
            t.total_bytes
        ),
    }
}

/// Collects one stream of a run: a head and a tail for the result, and — once the stream
/// outgrows what is shown inline — the whole stream in a spill file, up to `spill_cap` bytes.
pub struct StreamCollector {
    head: Vec<u8>,
    tail: VecDeque<u8>,
    head_cap: usize,
    tail_cap: usize,
    total: u64,
    spill_cap: u64,
    spill_target: SpillTarget,
    spill_display: String,
    spill: Option<File>,
    spilled: u64,
    spill_error: Option<String>,
}

impl StreamCollector {
    /// `spill_target` is where the whole stream goes if it is cut; `spill_display` is how the
    /// result names it for the model.
    pub fn new(
        inline_bytes: u64,
        spill_cap: u64,
        spill_target: SpillTarget,
        spill_display: String,
    ) -> Self {
        let inline = inline_bytes as usize;
        StreamCollector {
            head: Vec::new(),
            tail: VecDeque::new(),
            head_cap: inline - inline / 4,
            tail_cap: inline / 4,
            total: 0,
            spill_cap,
            spill_target,
            spill_display,
            spill: None,
            spilled: 0,
            spill_error: None,
        }
    }

    pub fn total(&self) -> u64 {
        self.total
    }

    /// The newest few lines so far (for progress notifications and job polls).
    pub fn recent_lines(&self, max_lines: usize) -> String {
        let bytes: Vec<u8> = if self.tail.is_empty() {
            self.head[self.head.len().saturating_sub(2048)..].to_vec()
        } else {
            let skip = self.tail.len().saturating_sub(2048);
            self.tail.iter().skip(skip).copied().collect()
        };
        let text = String::from_utf8_lossy(&bytes);
        let lines: Vec<&str> = text.trim_end_matches('\n').lines().collect();
        lines[lines.len().saturating_sub(max_lines)..].join("\n")
    }

    pub fn push(&mut self, bytes: &[u8]) {
        if self.total + bytes.len() as u64 > (self.head_cap + self.tail_cap) as u64 {
            // Called before head/tail change: the first time, they still hold every earlier byte.
            self.spill_bytes(bytes);
        }
        self.total += bytes.len() as u64;
        let room = self.head_cap.saturating_sub(self.head.len());
        let (to_head, rest) = bytes.split_at(room.min(bytes.len()));
        self.head.extend_from_slice(to_head);
        if !rest.is_empty() {
            let rest = &rest[rest.len().saturating_sub(self.tail_cap)..];
            self.tail.extend(rest);
            let excess = self.tail.len().saturating_sub(self.tail_cap);
            self.tail.drain(..excess);
        }
    }

    fn spill_bytes(&mut self, newest: &[u8]) {
        if self.spill_error.is_some() {
            return;
        }
        if self.spill.is_none() {
            let mut f = match self.spill_target.create() {
                Ok(f) => f,
                Err(e) => {
                    let why = format!(
                        "{} could not be created ({e}); if the code put something at that path, remove it",
                        self.spill_display
                    );
                    tracing::warn!(error = %why, "cannot save output");
                    self.spill_error = Some(why);
                    return;
                }
            };
            let (a, b) = self.tail.as_slices();
            if let Err(e) = [&self.head[..], a, b]
                .iter()
                .try_for_each(|part| f.write_all(part))
            {
                self.spill_error = Some(format!("writing {} failed: {e}", self.spill_display));
                return;
            }
            self.spilled = (self.head.len() + self.tail.len()) as u64;
            self.spill = Some(f);
        }
        let Some(f) = self.spill.as_mut() else { return };
        let room = self.spill_cap.saturating_sub(self.spilled) as usize;
        let chunk = &newest[..room.min(newest.len())];
        if !chunk.is_empty() {
            if let Err(e) = f.write_all(chunk) {
                self.spill_error = Some(format!("writing {} failed: {e}", self.spill_display));
            }
            self.spilled += chunk.len() as u64;
        }
    }

    /// The text to show inline and, if cut, where and how much.
    pub fn finish(self) -> (String, Option<Truncation>) {
        let inline_fits = self.total <= (self.head_cap + self.tail_cap) as u64;
        if inline_fits {
            let mut all = self.head;
            all.extend(self.tail);
            return (String::from_utf8_lossy(&all).into_owned(), None);
        }
        let tail: Vec<u8> = self.tail.into_iter().collect();
        let text = format!(
            "{}\n[... output cut here ...]\n{}",
            String::from_utf8_lossy(&self.head),
            String::from_utf8_lossy(&tail)
        );
        let shown = (self.head.len() + tail.len()) as u64;
        let file_error = self.spill_error;
        let file = (file_error.is_none() && self.spill.is_some()).then_some(self.spill_display);
        let file_complete = file.is_some() && self.spilled == self.total;
        (
            text,
            Some(Truncation {
                total_bytes: self.total,
                shown_bytes: shown,
                file,
                uri: None,
                file_complete,
                file_error,
            }),
        )
    }
}

/// Where a stream's spill file goes: `<session dir>/.ironcell/<file_name>`.
///
/// The session directory is the worker's: the file is created fd-relative, without following a
/// symlink and only if nothing exists at that path ([`crate::host_fs::create_new_file`]), so a
/// symlink or file the code planted there makes the spill fail (the output is still shown, with
/// a note) and never makes the host write elsewhere.
#[derive(Debug, Clone)]
pub struct SpillTarget {
    session_dir: PathBuf,
    file_name: String,
}

/// The directory of spill files inside a session directory.
pub const SPILL_DIR: &str = ".ironcell";

impl SpillTarget {
    fn create(&self) -> std::io::Result<File> {
        use std::os::fd::AsFd;
        let dir = crate::host_fs::open_session_dir(&self.session_dir)?;
        crate::host_fs::create_new_file(dir.as_fd(), SPILL_DIR, &self.file_name)
    }
}

/// `dir/.ironcell/run-N-stream.txt`, and its display form relative to the session.
pub fn spill_location(scratch: &Path, run: u64, stream: &str) -> (SpillTarget, String) {
    let file_name = format!("run-{run}-{stream}.txt");
    let rel = format!("{SPILL_DIR}/{file_name}");
    (
        SpillTarget {
            session_dir: scratch.to_path_buf(),
            file_name,
        },
        rel,
    )
}

// ---------------------------------------------------------------------------------------------
// TOON (Token-Oriented Object Notation): indentation for objects, `key[N]: a,b` for arrays of
// primitives, `- ` items for other arrays, strings quoted only when they must be.
// ---------------------------------------------------------------------------------------------

/// Encodes a JSON value as TOON.
pub fn encode_toon(v: &Value) -> String {
    let mut out = String::new();
    match v {
        Value::Object(map) => toon_object(map, 0, &mut out),
        other => out.push_str(&toon_primitive(other)),
    }
    while out.ends_with('\n') {
        out.pop();
    }
    out
}

fn toon_object(map: &Map<String, Value>, depth: usize, out: &mut String) {
    let pad = "  ".repeat(depth);
    for (k, v) in map {
        let key = toon_key(k);
        match v {
            Value::Object(inner) if inner.is_empty() => out.push_str(&format!("{pad}{key}:\n")),
            Value::Object(inner) => {
                out.push_str(&format!("{pad}{key}:\n"));
                toon_object(inner, depth + 1, out);
            }
            Value::Array(items) if items.iter().all(is_primitive) => {
                let joined: Vec<String> = items.iter().map(toon_primitive).collect();
                out.push_str(&format!(
                    "{pad}{key}[{}]: {}\n",
                    items.len(),
                    joined.join(",")
                ));
            }
            Value::Array(items) => {
                out.push_str(&format!("{pad}{key}[{}]:\n", items.len()));
                for item in items {
                    match item {
                        Value::Object(m) => {
                            let mut inner = String::new();
                            toon_object(m, depth + 2, &mut inner);
                            let trimmed = inner.trim_start();
                            out.push_str(&format!("{pad}  - {trimmed}"));
                        }
                        other => out.push_str(&format!("{pad}  - {}\n", toon_primitive(other))),
                    }
                }
            }
            other => out.push_str(&format!("{pad}{key}: {}\n", toon_primitive(other))),
        }
    }
}

fn is_primitive(v: &Value) -> bool {
    !matches!(v, Value::Array(_) | Value::Object(_))
}

fn toon_key(k: &str) -> String {
    let plain = !k.is_empty()
        && k.chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '.')
        && !k.starts_with(|c: char| c.is_ascii_digit());
    if plain { k.to_string() } else { quote(k) }
}

fn toon_primitive(v: &Value) -> String {
    match v {
        Value::Null => "null".into(),
        Value::Bool(b) => b.to_string(),
        Value::Number(n) => n.to_string(),
        Value::String(s) => {
            let needs_quotes = s.is_empty()
                || s.trim() != s
                || s.contains([':', ',', '"', '\\', '[', ']', '{', '}', '#'])
                || s.chars().any(char::is_control)
                || s.starts_with("- ")
                || matches!(s.as_str(), "true" | "false" | "null")
                || s.parse::<f64>().is_ok();
            if needs_quotes { quote(s) } else { s.clone() }
        }
        other => other.to_string(),
    }
}

fn quote(s: &str) -> String {
    let mut q = String::with_capacity(s.len() + 2);
    q.push('"');
    for c in s.chars() {
        match c {
            '"' => q.push_str("\\\""),
            '\\' => q.push_str("\\\\"),
            '\n' => q.push_str("\\n"),
            '\r' => q.push_str("\\r"),
            '\t' => q.push_str("\\t"),
            c if c.is_control() => q.push_str(&format!("\\u{:04x}", c as u32)),
            c => q.push(c),
        }
    }
    q.push('"');
    q
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn session_states_keep_their_wire_names() {
        let states = [
            (SessionState::New, "new"),
            (SessionState::Kept, "kept"),
            (SessionState::Restarted, "restarted"),
            (SessionState::Lost, "lost"),
            (SessionState::Forked, "forked"),
        ];
        for (state, wire) in states {
            assert_eq!(serde_json::to_value(state).unwrap(), json!(wire));
        }
    }

    #[test]
    fn toon_quotes_only_what_would_be_ambiguous() {
        let v = json!({
            "status": "ok",
            "stdout": "hi\nthere",
            "result": "42",
            "duration_ms": 1.5,
            "notices": ["a", "b c"],
            "error": {"type": "ValueError", "message": "bad: x"}
        });
        let t = encode_toon(&v);
        assert!(t.contains("status: ok\n"), "{t}");
        assert!(t.contains("stdout: \"hi\\nthere\"\n"), "{t}");
        assert!(t.contains("result: \"42\"\n"), "{t}");
        assert!(t.contains("notices[2]: a,b c\n"), "{t}");
        assert!(
            t.contains("error:\n  type: ValueError\n  message: \"bad: x\""),
            "{t}"
        );
    }

    fn collector(dir: &Path, inline: u64, cap: u64) -> StreamCollector {
        let (p, d) = spill_location(dir, 1, "stdout");
        StreamCollector::new(inline, cap, p, d)
    }

    #[test]
    fn small_output_stays_inline_and_whole() {
        let dir = std::env::temp_dir().join(format!("ironcell-out-{}", std::process::id()));
        let mut c = collector(&dir, 64, 1 << 20);
        c.push(b"hello ");
        c.push(b"world");
        let (text, cut) = c.finish();
        assert_eq!(text, "hello world");
        assert!(cut.is_none());
    }

    #[test]
    fn large_output_keeps_head_and_tail_and_spills_every_byte() {
        let dir = std::env::temp_dir().join(format!("ironcell-spill-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut c = collector(&dir, 64, 1 << 20);
        let mut expected = Vec::new();
        for i in 0..500 {
            let line = format!("line {i}\n");
            expected.extend_from_slice(line.as_bytes());
            c.push(line.as_bytes());
        }
        let (text, cut) = c.finish();
        let cut = cut.unwrap();
        assert!(text.starts_with("line 0\n"), "{text}");
        assert!(text.ends_with("line 499\n"), "{text}");
        assert_eq!(cut.total_bytes, expected.len() as u64);
        assert!(cut.file_complete);
        let saved = std::fs::read(dir.join(cut.file.unwrap())).unwrap();
        assert_eq!(saved, expected);
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn one_huge_write_spills_only_up_to_the_cap() {
        let dir = std::env::temp_dir().join(format!("ironcell-cap-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut c = collector(&dir, 64, 1000);
        c.push(&[b'x'; 10]);
        c.push(&vec![b'y'; 5000]);
        let (_, cut) = c.finish();
        let cut = cut.unwrap();
        assert_eq!(cut.total_bytes, 5010);
        assert!(!cut.file_complete);
        let saved = std::fs::read(dir.join(cut.file.unwrap())).unwrap();
        assert_eq!(saved.len(), 1000);
        assert_eq!(&saved[..10], b"xxxxxxxxxx");
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn a_symlink_planted_at_the_spill_path_is_not_followed_and_the_output_still_shows() {
        let dir = std::env::temp_dir().join(format!("ironcell-plant-{}", std::process::id()));
        let victim = std::env::temp_dir().join(format!("ironcell-victim-{}", std::process::id()));
        std::fs::create_dir_all(dir.join(SPILL_DIR)).unwrap();
        std::fs::write(&victim, "host file").unwrap();
        std::os::unix::fs::symlink(&victim, dir.join(".ironcell/run-1-stdout.txt")).unwrap();
        let mut c = collector(&dir, 64, 1 << 20);
        for i in 0..100 {
            c.push(format!("line {i}\n").as_bytes());
        }
        let (text, cut) = c.finish();
        let cut = cut.unwrap();
        assert!(
            text.starts_with("line 0\n") && text.ends_with("line 99\n"),
            "{text}"
        );
        assert!(cut.file.is_none() && !cut.file_complete);
        let why = cut.file_error.clone().unwrap();
        assert!(
            why.contains(".ironcell/run-1-stdout.txt could not be created"),
            "{why}"
        );
        assert!(truncation_line("stdout", &cut).contains("was not saved"));
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "host file");
        let _ = std::fs::remove_dir_all(dir);
        let _ = std::fs::remove_file(victim);
    }
}
