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

/// What the host knows that the notes name.
#[derive(Debug, Clone, Default)]
pub struct NoteContext {
    /// The interpreter sessions run in (`--python`), and its version.
    pub python: Option<PathBuf>,
    pub python_version: Option<String>,
    /// The memory limit (RLIMIT_DATA) and what the worker's data segment holds after the run
    /// (`VmData`, what that limit counts); `None` when the worker is gone or was not read.
    pub memory_limit: u64,
    pub memory_held: Option<u64>,
    /// Why sessions may not fork children here (`Sandbox::children`); `None`: they may.
    pub children_refused: Option<crate::sandbox::ChildrenRefusal>,
    /// Whether `%pip install` may install packages for the session (`--packages` is not off).
    pub packages: bool,
}

/// How much of the error and stderr the notes look at (twice this, at the end, where the
/// innermost frame and the last message are): the inline output is cut shorter than that
/// anyway, and the worker's text is never scanned at length.
const NOTE_SCAN_BYTES: usize = 64 * 1024;
/// At most this many notes per run.
const MAX_NOTES: usize = 3;
/// A session holding this share of its memory limit (in 1/100) after a failure is "at its limit".
const AT_LIMIT_PERCENT: u64 = 80;

/// Whether a run has anything the notes could be about: an error, or something on stderr, in a
/// run that ended in Python (a crash, timeout or stop says why in its status line).
pub fn may_need_notes(record: &RunRecord) -> bool {
    matches!(
        record.status,
        RunStatus::Ok | RunStatus::Error | RunStatus::Exit
    ) && (record.error.is_some() || !record.stderr.is_empty())
}

/// The notes for a run: what the sandbox refused (network, a path outside the grants, a process,
/// a system call), a session at its memory limit, a module the interpreter lacks. Each says
/// what was refused and the way out; at most [`MAX_NOTES`], each kind once.
pub fn sandbox_notes(record: &RunRecord, ctx: &NoteContext) -> Vec<String> {
    let mut text = String::new();
    if let Some(e) = &record.error {
        for part in [&e.kind, &e.message, &e.traceback] {
            text.push_str(tail_of(part));
            text.push('\n');
        }
    }
    text.push_str(tail_of(&record.stderr));
    let error_kind = record.error.as_ref().map(|e| e.kind.as_str());
    let error_message = record.error.as_ref().map_or("", |e| e.message.as_str());
    let children_refused = ctx.children_refused.as_ref().map(ToString::to_string);
    let mut notes = refusal_notes(&text, children_refused.as_deref());
    if let Some(n) = memory_note(&text, error_kind, ctx) {
        notes.push(n);
    }
    if let Some(n) = module_note(error_kind, error_message, ctx) {
        notes.push(n);
    }
    notes.truncate(MAX_NOTES);
    notes
}

/// `s` if short, else its last 2 x [`NOTE_SCAN_BYTES`].
fn tail_of(s: &str) -> &str {
    if s.len() <= 2 * NOTE_SCAN_BYTES {
        return s;
    }
    let mut start = s.len() - 2 * NOTE_SCAN_BYTES;
    while !s.is_char_boundary(start) {
        start += 1;
    }
    &s[start..]
}

const EPERM: &str = "Operation not permitted";
const EACCES: &str = "Permission denied";

/// Messages that name a failed name lookup (glibc's gai_strerror, urllib3, requests, curl,
/// reqwest/hyper, Go): without a network every lookup fails, and "temporary" is misleading.
const NO_NETWORK_WORDS: &[&str] = &[
    "Temporary failure in name resolution",
    "Name or service not known",
    "No address associated with hostname",
    "nodename nor servname provided",
    "getaddrinfo failed",
    "NameResolutionError",
    "Failed to resolve",
    "failed to lookup address information",
    "Could not resolve host",
    "dns error",
];
/// Words of a traceback through networking code, for a refused `socket()`.
const NETWORK_WORDS: &[&str] = &[
    "socket",
    "urlopen",
    "urllib",
    "http.client",
    "requests.",
    "httpx",
    "aiohttp",
    "create_connection",
    "open_connection",
    "getaddrinfo",
];
/// Child processes: fork, process pools and their semaphores.
const FORK_WORDS: &[&str] = &[
    "multiprocessing",
    "SemLock",
    "ProcessPool",
    "concurrent/futures/process",
    "joblib",
    "loky",
    "os.fork",
    "fork()",
];
/// Running programs.
const EXEC_WORDS: &[&str] = &[
    "subprocess",
    "os.system",
    "os.exec",
    "execv",
    "posix_spawn",
    "os.spawn",
    "Popen",
    "os.popen",
];
const METADATA_WORDS: &[&str] = &["chmod", "chown", "utime", "copystat", "copymode"];

fn any_of(text: &str, words: &[&str]) -> bool {
    words.iter().any(|w| text.contains(w))
}

/// The notes that explain the sandbox's refusals found in a run's output.
///
/// Long on purpose: one short rule per kind of refusal (network, files, processes, …), each
/// with its note.
fn refusal_notes(text: &str, children_refused: Option<&str>) -> Vec<String> {
    let mut notes = Vec::new();
    let eperm = text.contains(EPERM);
    let eacces = text.contains(EACCES);
    let refused = eperm || eacces;
    let mut explained = false;
    if any_of(text, NO_NETWORK_WORDS) || (refused && any_of(text, NETWORK_WORDS)) {
        notes.push(
            "this session has no network (the sandbox refuses sockets and name lookups; \
             retrying will not help): fetch data through a proxied MCP server \
             (`await runtime.discovered_servers()` lists them), or ask the user to put the file \
             in a folder ironcell can read (--allow-read DIR)"
                .to_string(),
        );
        explained = true;
    }
    let child_failed = text.contains("joblib will operate in serial mode")
        || (refused || text.contains("Function not implemented")) && any_of(text, FORK_WORDS);
    if child_failed && let Some(why) = children_refused {
        notes.push(format!(
            "the sandbox refused a child process (fork, or a process pool's shared semaphore) \
             because {why}: multiprocessing, ProcessPoolExecutor and joblib's processes do not \
             run here (joblib falls back to one process); use threads (ThreadPoolExecutor, \
             joblib's prefer=\"threads\")"
        ));
        explained = true;
    } else if child_failed {
        notes.push(
            "the sandbox refuses exec: a session's child processes are forked (multiprocessing's \
             default start method here, which joblib and ProcessPoolExecutor use); the 'spawn' \
             and 'forkserver' start methods exec a new interpreter and fail: use \
             multiprocessing.get_context('fork'), or threads"
                .to_string(),
        );
        explained = true;
    } else if refused && any_of(text, EXEC_WORDS) {
        notes.push(
            "the sandbox refuses to start programs (subprocess, os.system, exec): do the work \
             in Python here, or through a proxied MCP server that offers it"
                .to_string(),
        );
        explained = true;
    }
    if text.contains("has previously been poisoned") || text.contains("PoisonError") {
        notes.push(
            "a library's internal state broke in an earlier failure of this session (see its \
             first error, often a sandbox refusal); it stays broken until the session restarts: \
             run with reset=true (a fresh interpreter and an empty directory)"
                .to_string(),
        );
    }
    if explained {
        return notes;
    }
    // The host's /proc and /sys are out of sight (empty, or refused): a read there fails with
    // ENOENT or EACCES, and psutil says its own process does not exist.
    let missing = text.contains("No such file or directory");
    if let Some(p) = system_path(text)
        .filter(|_| eacces || missing)
        .or_else(|| text.contains("NoSuchProcess").then(|| "/proc".to_string()))
    {
        notes.push(format!(
            "'{p}' is out of reach: sessions see none of the host's /proc and /sys, so code that \
             reads them (psutil, /proc/self/...) fails here as written (no grant or reset \
             changes that)"
        ));
        return notes;
    }
    if eacces && !text.contains("is not available in this session") {
        let what = match refused_path(text) {
            Some(p) => format!("access to {p} was refused by the sandbox"),
            None => "\"Permission denied\" here is the sandbox refusing a path".to_string(),
        };
        notes.push(format!(
            "{what}: a session may use only its own directory, the Python installation and \
             folders the user granted when starting ironcell (--allow-read DIR, --allow-write \
             DIR); work on a copy in the session directory, or ask the user to grant the folder"
        ));
    } else if eperm && any_of(text, METADATA_WORDS) {
        notes.push(
            "the sandbox refuses changing a file's mode, owner or times (chmod, chown, utime); \
             the data can still be read and written, and shutil.copy/copy2/copytree skip that \
             step"
                .to_string(),
        );
    } else if eperm {
        notes.push(
            "\"Operation not permitted\" here is the sandbox's system-call filter (or Landlock), \
             which refuses network sockets, starting programs, signals to other processes \
             than the session's own and file mode changes; code that needs one of them cannot \
             run here as written"
                .to_string(),
        );
    }
    notes
}

/// The first quoted path under /proc or /sys in `text` (at most 200 bytes), as Python and C
/// libraries quote a file they failed to open.
fn system_path(text: &str) -> Option<String> {
    ["'/proc", "\"/proc", "'/sys", "\"/sys"]
        .iter()
        .filter_map(|start| {
            let at = text.find(start)?;
            let quote = &start[..1];
            let rest = &text[at + 1..];
            let path = &rest[..rest.find(quote)?];
            let whole = path == "/proc"
                || path == "/sys"
                || path.starts_with("/proc/")
                || path.starts_with("/sys/");
            let ok = whole && path.len() <= 200 && !path.chars().any(char::is_control);
            ok.then(|| (at, path.to_string()))
        })
        .min()
        .map(|(_, p)| p)
}

/// The path a "Permission denied" names, as Python (`Permission denied: '/p'`) or a C library
/// (`"/p": Permission denied`, `'/p': Permission denied`) writes it; quoted, at most 200 bytes.
fn refused_path(text: &str) -> Option<String> {
    let quoted_at_start = |s: &str| -> Option<String> {
        let q = s.chars().next().filter(|c| *c == '\'' || *c == '"')?;
        let rest = &s[1..];
        let end = rest.find(q)?;
        Some(rest[..end].to_string())
    };
    let quoted_at_end = |s: &str| -> Option<String> {
        let q = s.chars().last().filter(|c| *c == '\'' || *c == '"')?;
        let body = &s[..s.len() - 1];
        let start = body.rfind(q)?;
        Some(body[start + 1..].to_string())
    };
    for (at, _) in text.match_indices(EACCES) {
        let after = &text[at + EACCES.len()..];
        let before = text[..at].trim_end_matches([':', ' ']);
        let found = after
            .strip_prefix(": ")
            .and_then(quoted_at_start)
            .or_else(|| quoted_at_end(before));
        let shown =
            |p: &String| !p.is_empty() && p.len() <= 200 && !p.chars().any(char::is_control);
        if let Some(p) = found.filter(shown) {
            return Some(format!("'{p}'"));
        }
    }
    None
}

const MEMORY_WORDS: &[&str] = &[
    "MemoryError",
    "Cannot allocate memory",
    "Unable to allocate",
    "bad_alloc",
    "out of memory",
    "Out of memory",
    "memory allocation failed",
];

fn memory_note(text: &str, error_kind: Option<&str>, ctx: &NoteContext) -> Option<String> {
    let limit = ctx.memory_limit;
    let mib = |b: u64| b >> 20;
    let at_limit = match ctx.memory_held {
        Some(held) if limit > 0 => {
            held.saturating_mul(100) >= limit.saturating_mul(AT_LIMIT_PERCENT)
        }
        _ => false,
    };
    let failed_for_memory = error_kind == Some("MemoryError") || any_of(text, MEMORY_WORDS);
    match (failed_for_memory, at_limit, ctx.memory_held) {
        // Any failure while the session holds (nearly) all of its memory: later cells fail in
        // ways that do not look like memory (a MemoryError inside the parser, an import error).
        (_, true, Some(held)) if error_kind.is_some() => Some(format!(
            "this session holds {} MiB of its {} MiB memory limit, so its cells fail in odd \
             ways until memory is freed: `del` large variables (then `import gc; gc.collect()`), \
             or run with reset=true (a fresh interpreter and an empty directory)",
            mib(held),
            mib(limit)
        )),
        (true, _, held) if limit > 0 => Some(format!(
            "the cell needed more memory than this session's limit ({} MiB{}): work in chunks \
             (e.g. read_csv(chunksize=...), smaller dtypes), or the user can raise it \
             (--memory-limit / MCP_BRIDGE_MEMORY_LIMIT)",
            mib(limit),
            held.map(|h| format!("; it holds {} MiB now", mib(h)))
                .unwrap_or_default()
        )),
        _ => None,
    }
}

/// Import names whose package on PyPI is named otherwise.
const PIP_NAMES: &[(&str, &str)] = &[
    ("sklearn", "scikit-learn"),
    ("skimage", "scikit-image"),
    ("cv2", "opencv-python-headless"),
    ("PIL", "pillow"),
    ("yaml", "pyyaml"),
    ("bs4", "beautifulsoup4"),
    ("dateutil", "python-dateutil"),
    ("docx", "python-docx"),
    ("pptx", "python-pptx"),
    ("dotenv", "python-dotenv"),
    ("fitz", "pymupdf"),
    ("Crypto", "pycryptodome"),
    ("jwt", "pyjwt"),
    ("attr", "attrs"),
    ("serial", "pyserial"),
];

fn module_note(error_kind: Option<&str>, message: &str, ctx: &NoteContext) -> Option<String> {
    if !matches!(error_kind, Some("ModuleNotFoundError" | "ImportError")) {
        return None;
    }
    let quoted_after = |prefix: &str| -> Option<&str> {
        let rest = &message[message.find(prefix)? + prefix.len()..];
        let name = &rest[..rest.find('\'')?];
        let valid = !name.is_empty()
            && name.len() <= 64
            && name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
            && !name.starts_with(|c: char| c.is_ascii_digit());
        valid.then_some(name)
    };
    // A dotted name is a submodule of something installed: not a package to add.
    let name = quoted_after("No module named '")
        .or_else(|| quoted_after("Missing optional dependency '"))?;
    let package = PIP_NAMES
        .iter()
        .find(|(import, _)| *import == name)
        .map_or(name, |(_, pip)| pip);
    let python = ctx
        .python
        .as_ref()
        .map_or_else(|| "python3".to_string(), |p| p.display().to_string());
    let version = ctx
        .python_version
        .as_ref()
        .map(|v| format!(" (Python {v})"))
        .unwrap_or_default();
    // A distribution's own Python refuses pip (PEP 668): its packages come from the system's
    // package manager.
    let how = if python.starts_with("/usr/bin/") {
        let deb = package.to_ascii_lowercase().replace('_', "-");
        format!("with the system's package manager (e.g. `apt install python3-{deb}`)")
    } else {
        format!("into that environment (`{python} -m pip install {package}`)")
    };
    let pip = if ctx.packages {
        format!(
            "`%pip install {package}` in a cell installs it for this session (the user is asked), or "
        )
    } else {
        String::new()
    };
    Some(format!(
        "'{name}' is not installed in this session's interpreter, {python}{version}: {pip}the \
         user can install it {how}, or start ironcell with --python pointing at an environment \
         that has it; then import it again"
    ))
}

/// The data segment of process `pid` (`VmData` of `/proc/<pid>/status`: what RLIMIT_DATA, the
/// memory limit, counts), in bytes. The file's first line is the worker's chosen name, so it is
/// read as bytes.
pub fn data_segment_bytes(pid: i32) -> Option<u64> {
    let status = std::fs::read(format!("/proc/{pid}/status")).ok()?;
    status.split(|&b| b == b'\n').find_map(|line| {
        let rest = line.strip_prefix(b"VmData:")?;
        let kb = std::str::from_utf8(rest).ok()?.trim().strip_suffix("kB")?;
        kb.trim().parse::<u64>().ok().map(|k| k << 10)
    })
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

    fn failed(kind: &str, message: &str, traceback: &str, stderr: &str) -> RunRecord {
        RunRecord {
            session: "s".into(),
            status: RunStatus::Error,
            stdout: String::new(),
            stderr: stderr.to_string(),
            result: None,
            error: (!kind.is_empty()).then(|| PyErrorInfo {
                kind: kind.into(),
                message: message.into(),
                traceback: traceback.into(),
            }),
            exit_code: None,
            duration_ms: 0.0,
            session_state: SessionState::Kept,
            lineage: Vec::new(),
            notices: Vec::new(),
            stdout_truncated: None,
            stderr_truncated: None,
            upstream_calls: Vec::new(),
            upstream_calls_omitted: 0,
            upstream_lookups_failed: 0,
            images: Vec::new(),
            files: Vec::new(),
            inline_images: Vec::new(),
        }
    }

    fn ctx() -> NoteContext {
        NoteContext {
            python: Some(PathBuf::from("/opt/env/bin/python")),
            python_version: Some("3.12.1".into()),
            memory_limit: 1 << 30,
            memory_held: Some(100 << 20),
            children_refused: Some(crate::sandbox::ChildrenRefusal::LandlockAbi { abi: 4 }),
            packages: true,
        }
    }

    fn notes(kind: &str, message: &str, traceback: &str, stderr: &str) -> String {
        sandbox_notes(&failed(kind, message, traceback, stderr), &ctx()).join("\n")
    }

    #[test]
    fn a_refused_path_is_named_in_pythons_words_and_a_c_librarys() {
        let n = notes(
            "PermissionError",
            "[Errno 13] Permission denied: '/etc/shadow'",
            "",
            "",
        );
        assert!(n.contains("access to '/etc/shadow' was refused"), "{n}");
        assert!(n.contains("--allow-read DIR"), "{n}");
        let n = notes(
            "IOException",
            "IO Error: Cannot open file \"/proc/self/cgroup\": Permission denied",
            "",
            "",
        );
        assert!(n.contains("'/proc/self/cgroup' is out of reach"), "{n}");
        assert!(
            n.contains("none of the host's /proc") && !n.contains("--allow-read"),
            "{n}"
        );
        // An empty /proc answers ENOENT; psutil then finds no process of its own.
        let n = notes(
            "FileNotFoundError",
            "[Errno 2] No such file or directory: '/proc/meminfo'",
            "",
            "",
        );
        assert!(n.contains("'/proc/meminfo' is out of reach"), "{n}");
        let n = notes(
            "PermissionError",
            "[Errno 13] Permission denied: '/sys'",
            "",
            "",
        );
        assert!(n.contains("'/sys' is out of reach"), "{n}");
        let n = notes("NoSuchProcess", "process PID not found (pid=3)", "", "");
        assert!(n.contains("none of the host's /proc"), "{n}");
        // Not a system path: '/process.txt', '/system'.
        let n = notes(
            "FileNotFoundError",
            "[Errno 2] No such file or directory: '/process.txt'",
            "",
            "",
        );
        assert!(n.is_empty(), "{n}");
        let n = notes(
            "PermissionError",
            "[Errno 13] Permission denied: '/system'",
            "",
            "",
        );
        assert!(n.contains("access to '/system' was refused"), "{n}");
        // Without a path it still says what "Permission denied" means here.
        let n = notes("OSError", "Permission denied", "", "");
        assert!(
            n.contains("\"Permission denied\" here is the sandbox"),
            "{n}"
        );
        // The private-/tmp guard explains itself already.
        let n = notes(
            "PermissionError",
            "[Errno 13] /tmp is not available in this session (no namespace); use the session directory instead: '/tmp/x'",
            "",
            "",
        );
        assert!(n.is_empty(), "{n}");
    }

    #[test]
    fn no_network_is_said_for_lookups_and_refused_sockets_alike() {
        for (kind, message, tb) in [
            (
                "URLError",
                "<urlopen error [Errno -3] Temporary failure in name resolution>",
                "",
            ),
            (
                "ConnectionError",
                "HTTPSConnectionPool(host='x', port=443): Failed to resolve 'x'",
                "",
            ),
            (
                "PermissionError",
                "[Errno 1] Operation not permitted",
                "  File \"/usr/lib/python3.11/socket.py\", line 232, in __init__\n",
            ),
        ] {
            let n = notes(kind, message, tb, "");
            assert!(n.contains("this session has no network"), "{message}: {n}");
            assert!(!n.contains("system-call filter"), "one note, not two: {n}");
        }
    }

    #[test]
    fn processes_programs_and_mode_changes_get_their_own_notes() {
        let n = notes(
            "PermissionError",
            "[Errno 13] Permission denied",
            "  File \"/usr/lib/python3.11/multiprocessing/synchronize.py\", line 57, in __init__\n",
            "",
        );
        assert!(
            n.contains("refused a child process") && !n.contains("access to"),
            "{n}"
        );
        assert!(n.contains("because this kernel's Landlock (ABI 4)"), "{n}");
        // Where sessions fork, a pool that fails is one that asked to exec.
        let mut allowed = ctx();
        allowed.children_refused = None;
        let spawn = failed(
            "PermissionError",
            "[Errno 1] Operation not permitted",
            "  File \"/usr/lib/python3.11/multiprocessing/popen_spawn_posix.py\", line 62, in _launch\n",
            "",
        );
        let n = sandbox_notes(&spawn, &allowed).join("\n");
        assert!(
            n.contains("refuses exec") && n.contains("get_context('fork')"),
            "{n}"
        );
        // joblib's warning on stderr, in a run that otherwise succeeded.
        let mut r = failed(
            "",
            "",
            "",
            "UserWarning: [Errno 13] Permission denied.  joblib will operate in serial mode\n",
        );
        r.status = RunStatus::Ok;
        assert!(sandbox_notes(&r, &ctx()).join(" ").contains("threads"));
        let n = notes(
            "PermissionError",
            "[Errno 1] Operation not permitted",
            "  File \"/usr/lib/python3.11/subprocess.py\", line 1, in _execute_child\n",
            "",
        );
        assert!(n.contains("refuses to start programs"), "{n}");
        let n = notes(
            "PermissionError",
            "[Errno 1] Operation not permitted: 'f.txt'",
            "    os.chmod('f.txt', 0o600)\n",
            "",
        );
        assert!(n.contains("mode, owner or times"), "{n}");
        let n = notes(
            "PanicException",
            "called `Result::unwrap()` on an `Err` value: Os { code: 1, kind: PermissionDenied, message: \"Operation not permitted\" }",
            "",
            "",
        );
        assert!(n.contains("system-call filter"), "{n}");
        let n = notes(
            "PanicException",
            "LazyLock instance has previously been poisoned",
            "",
            "",
        );
        assert!(n.contains("reset=true"), "{n}");
    }

    #[test]
    fn memory_notes_tell_a_session_at_its_limit_from_a_cell_that_asked_too_much() {
        let r = failed("MemoryError", "", "", "");
        let mut c = ctx();
        let n = sandbox_notes(&r, &c).join(" ");
        assert!(
            n.contains(
                "needed more memory than this session's limit (1024 MiB; it holds 100 MiB now)"
            ),
            "{n}"
        );
        c.memory_held = Some(1000 << 20);
        let n = sandbox_notes(&r, &c).join(" ");
        assert!(
            n.contains("holds 1000 MiB of its 1024 MiB memory limit"),
            "{n}"
        );
        // At the limit, any failure says so; below it, an ordinary error says nothing.
        let other = failed("SyntaxError", "invalid syntax", "", "");
        assert!(
            sandbox_notes(&other, &c)
                .join(" ")
                .contains("of its 1024 MiB")
        );
        assert!(sandbox_notes(&other, &ctx()).is_empty());
    }

    #[test]
    fn a_missing_module_names_the_interpreter_and_the_package_to_install() {
        let n = notes("ModuleNotFoundError", "No module named 'sklearn'", "", "");
        assert!(n.contains("'sklearn' is not installed in this session's interpreter, /opt/env/bin/python (Python 3.12.1)"), "{n}");
        assert!(
            n.contains("`/opt/env/bin/python -m pip install scikit-learn`"),
            "{n}"
        );
        assert!(
            n.contains("`%pip install scikit-learn` in a cell installs it for this session"),
            "{n}"
        );
        let n = notes(
            "ImportError",
            "Missing optional dependency 'openpyxl'.  Use pip or conda to install openpyxl.",
            "",
            "",
        );
        assert!(n.contains("pip install openpyxl"), "{n}");
        let mut c = ctx();
        c.python = Some(PathBuf::from("/usr/bin/python3"));
        let n = sandbox_notes(
            &failed("ModuleNotFoundError", "No module named 'yaml'", "", ""),
            &c,
        )
        .join(" ");
        assert!(n.contains("apt install python3-pyyaml"), "{n}");
        // A submodule of something installed, or a name that is not one: no note.
        assert!(notes("ModuleNotFoundError", "No module named 'numpy.foo'", "", "").is_empty());
        assert!(
            notes(
                "ModuleNotFoundError",
                "No module named 'a b; rm -rf'",
                "",
                ""
            )
            .is_empty()
        );
    }

    #[test]
    fn ordinary_errors_get_no_note_and_a_huge_stderr_is_read_by_its_tail() {
        assert!(notes("ZeroDivisionError", "division by zero", "", "").is_empty());
        assert!(
            notes(
                "FileNotFoundError",
                "[Errno 2] No such file or directory: 'x'",
                "",
                ""
            )
            .is_empty()
        );
        let big = format!(
            "{}\nsocket.gaierror: [Errno -3] Temporary failure in name resolution\n",
            "x".repeat(1 << 20)
        );
        assert!(notes("", "", "", &big).contains("no network"));
        let big = format!(
            "Temporary failure in name resolution\n{}",
            "é".repeat(1 << 19)
        );
        assert!(notes("", "", "", &big).is_empty(), "only the tail is read");
    }

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
