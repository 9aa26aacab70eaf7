//! The audit trail: one JSON line per run in `<state dir>/audit.jsonl`, and `ironcell audit`.
//!
//! A line holds when and where a run happened, a hash and the first lines of its code, how it
//! ended, which limits it hit, and every proxied call it made (server, tool, argument names —
//! values only where that server's `auditArguments` is on —, outcome, duration). A proxied
//! call that ends when its run is over (a thread, a late answer), or past a run's first
//! [`crate::proxy::MAX_CALL_SUMMARIES`], gets a line of its own; calls that failed their
//! look-up are counted, not listed. Runs of local tools (`--tools` and saved) say who called
//! them (`cause`). A line is at most [`MAX_LINE_BYTES`]: a run whose calls do not fit continues
//! on further lines.
//!
//! When the file passes `IRONCELL_AUDIT_MAX` it is folded into one older file, `audit.jsonl.1`,
//! of at most that size and [`MAX_KEPT_LINES`] lines, kept fairly: each session keeps its newest
//! lines up to an equal share, so a session that writes much loses its own old lines, never
//! another session's. The log lives in the state directory, outside every session directory,
//! so no worker can write to it. `ironcell audit` escapes every character of what it prints
//! that is not printable text (terminal escapes, bidi controls, line separators).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::Value;
use sha2::Digest;

use crate::output::{RunRecord, RunStatus};

const FILE: &str = "audit.jsonl";
const OLD_FILE: &str = "audit.jsonl.1";
/// Lines and characters of code kept in a line (the hash identifies the whole).
const CODE_HEAD_LINES: usize = 3;
const CODE_HEAD_CHARS: usize = 300;
/// Longest line of the log, in bytes.
pub const MAX_LINE_BYTES: usize = 64 << 10;
/// Most lines the older file keeps.
pub const MAX_KEPT_LINES: usize = 100_000;
/// Longest refusal message kept.
const MAX_REFUSED_CHARS: usize = 2000;

/// One run, as recorded.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct AuditEntry {
    /// RFC 3339, UTC.
    pub time: String,
    /// Whose session it is, under `serve --http` (the token's principal).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub principal: Option<String>,
    pub session: String,
    pub code_sha256: String,
    pub code_head: String,
    pub code_bytes: usize,
    /// A run status (`ok`, `error`, `timeout`, …) or `refused` when no code ran.
    pub status: String,
    pub duration_ms: f64,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub limits_hit: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refused: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub upstream_calls: Vec<Value>,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub upstream_calls_omitted: u64,
    /// Proxied calls that never got past their look-up (no such server or tool): counted only.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub upstream_lookups_failed: u64,
    /// Who caused this run or call where that is not the session's own `run_python`: the
    /// client or a session calling a local tool, a call that ended after its run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cause: Option<Value>,
    /// A package install (`%pip install`): what was asked, decided and installed, with hashes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub packages: Option<Value>,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

impl AuditEntry {
    /// The line for a run of `code` in `session` that ended as `outcome`.
    pub fn new<E: std::fmt::Display>(
        session: &str,
        code: &str,
        outcome: &Result<RunRecord, E>,
    ) -> AuditEntry {
        let head: String = code
            .lines()
            .take(CODE_HEAD_LINES)
            .collect::<Vec<_>>()
            .join("\n")
            .chars()
            .take(CODE_HEAD_CHARS)
            .collect();
        let mut e = AuditEntry {
            time: chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
            principal: None,
            session: session.to_string(),
            // One string, not one per byte (32 `format!` calls were ~10% of the host's
            // instructions per warm call under callgrind).
            code_sha256: base16ct::lower::encode_string(&sha2::Sha256::digest(code.as_bytes())),
            code_head: head,
            code_bytes: code.len(),
            status: "refused".into(),
            duration_ms: 0.0,
            limits_hit: Vec::new(),
            refused: None,
            upstream_calls: Vec::new(),
            upstream_calls_omitted: 0,
            upstream_lookups_failed: 0,
            cause: None,
            packages: None,
        };
        match outcome {
            Ok(r) => {
                e.status = serde_json::to_value(r.status)
                    .ok()
                    .and_then(|v| v.as_str().map(str::to_string))
                    .unwrap_or_default();
                e.duration_ms = r.duration_ms;
                e.limits_hit = limits_hit(r);
                e.upstream_calls = r
                    .upstream_calls
                    .iter()
                    .filter_map(|c| serde_json::to_value(c).ok())
                    .collect();
                e.upstream_calls_omitted = r.upstream_calls_omitted;
                e.upstream_lookups_failed = r.upstream_lookups_failed;
            }
            Err(why) => e.refused = Some(crate::clip_chars(&why.to_string(), MAX_REFUSED_CHARS)),
        }
        e
    }

    /// The line of one proxied call that ended outside its run's record: after the run ended
    /// (`run`: its number in the session), past the run's summaries, or outside any run.
    pub fn call_alone(
        session: &str,
        run: Option<u64>,
        call: &ironcell_core::bridge::CallSummary,
    ) -> AuditEntry {
        let mut e = AuditEntry::new(session, "", &Err::<RunRecord, _>(""));
        e.code_sha256 = String::new();
        e.refused = None;
        e.status = "proxied_call".into();
        e.duration_ms = call.duration_ms;
        e.upstream_calls = serde_json::to_value(call).ok().into_iter().collect();
        e.cause = Some(match run {
            Some(run) => {
                serde_json::json!({"run": run, "note": "the call ended outside its run's record (after the run, or past its first calls)"})
            }
            None => serde_json::json!({"note": "made outside any run"}),
        });
        e
    }

    /// This entry as lines of at most [`MAX_LINE_BYTES`]: the calls that do not fit go on
    /// further lines (`status` `proxied_calls`) of the same run.
    fn lines(&self) -> Vec<String> {
        let size = |e: &AuditEntry| serde_json::to_string(e).map_or(usize::MAX, |l| l.len());
        let mut out = Vec::new();
        let mut current = self.clone();
        current.upstream_calls.clear();
        for call in &self.upstream_calls {
            current.upstream_calls.push(call.clone());
            if current.upstream_calls.len() > 1 && size(&current) > MAX_LINE_BYTES {
                current.upstream_calls.pop();
                out.push(std::mem::replace(&mut current, self.continuation()));
                current.upstream_calls.push(call.clone());
            }
        }
        out.push(current);
        out.iter()
            .map(|e| serde_json::to_string(e).unwrap_or_default())
            .collect()
    }

    /// A line that lists more of this run's calls.
    fn continuation(&self) -> AuditEntry {
        AuditEntry {
            time: self.time.clone(),
            principal: self.principal.clone(),
            session: self.session.clone(),
            code_sha256: self.code_sha256.clone(),
            code_head: String::new(),
            code_bytes: self.code_bytes,
            status: "proxied_calls".into(),
            duration_ms: 0.0,
            limits_hit: Vec::new(),
            refused: None,
            upstream_calls: Vec::new(),
            upstream_calls_omitted: 0,
            upstream_lookups_failed: 0,
            cause: Some(serde_json::json!({"continues": "the line before, of the same run"})),
            packages: None,
        }
    }
}

fn limits_hit(r: &RunRecord) -> Vec<String> {
    let mut hit = Vec::new();
    match r.status {
        RunStatus::Timeout => hit.push("wall_timeout".to_string()),
        RunStatus::OutputLimit => hit.push("output_limit".to_string()),
        RunStatus::ScratchQuota => hit.push("scratch_quota".to_string()),
        _ => {}
    }
    if let Some(err) = &r.error {
        let kind = match err.kind.as_str() {
            "MemoryError" => Some("memory"),
            "RecursionError" => Some("recursion"),
            _ => None,
        };
        hit.extend(kind.map(str::to_string));
    }
    let text = r.notices.join(" ").to_lowercase();
    for (needle, name) in [
        ("cpu", "cpu_time"),
        ("memory", "memory"),
        ("signal", "signal"),
    ] {
        if r.status == RunStatus::Crashed && text.contains(needle) && !hit.iter().any(|h| h == name)
        {
            hit.push(name.to_string());
        }
    }
    if r.stdout_truncated.is_some() || r.stderr_truncated.is_some() {
        hit.push("inline_output".to_string());
    }
    hit
}

/// The audit log of one state directory.
pub struct AuditLog {
    dir: PathBuf,
    max_bytes: u64,
    /// The file lines are appended to, kept open between runs (a line then costs one
    /// `stat` and one `write`), with its inode.
    open: Mutex<Option<(std::fs::File, u64)>>,
    /// The principal every line is stamped with, under `serve --http`.
    principal: std::sync::OnceLock<String>,
}

impl AuditLog {
    pub fn new(state_dir: &Path, max_bytes: u64) -> AuditLog {
        AuditLog {
            dir: state_dir.to_path_buf(),
            max_bytes: max_bytes.max(4096),
            open: Mutex::new(None),
            principal: std::sync::OnceLock::new(),
        }
    }

    /// Stamps every line appended from now on with `principal`.
    pub fn set_principal(&self, principal: &str) {
        let _ = self.principal.set(principal.to_string());
    }

    pub fn path(&self) -> PathBuf {
        self.dir.join(FILE)
    }

    /// Appends one line (rotating first if the file would pass the size limit). Failures are
    /// logged, never fatal: a run's result does not depend on its audit line. Quick enough for
    /// the async runtime: a line goes to a file kept open, in the host's own state directory.
    pub fn append(&self, entry: &AuditEntry) {
        let stamped;
        let entry = match self.principal.get() {
            Some(p) if entry.principal.is_none() => {
                stamped = AuditEntry {
                    principal: Some(p.clone()),
                    ..entry.clone()
                };
                &stamped
            }
            _ => entry,
        };
        let mut open = crate::lock(&self.open);
        for line in entry.lines() {
            if let Err(e) = self.append_line(&mut open, &(line + "\n")) {
                *open = None;
                tracing::warn!(file = %self.path().display(), error = %e, "audit line could not be written");
            }
        }
    }

    fn append_line(
        &self,
        open: &mut Option<(std::fs::File, u64)>,
        line: &str,
    ) -> std::io::Result<()> {
        use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
        let path = self.path();
        // The path, not the open file, is what rotates (another server sharing this state
        // directory may have rotated it, or someone removed it).
        let current = std::fs::symlink_metadata(&path).ok();
        let size = current.as_ref().map_or(0, |m| m.len());
        if size > 0 && size + line.len() as u64 > self.max_bytes {
            self.fold()?;
            *open = None;
        } else if open.as_ref().map(|(_, ino)| *ino) != current.as_ref().map(|m| m.ino()) {
            *open = None;
        }
        let (f, _) = match open {
            Some(kept) => kept,
            None => {
                std::fs::create_dir_all(&self.dir)?;
                let f = std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .mode(0o600)
                    .custom_flags(libc::O_NOFOLLOW)
                    .open(&path)?;
                let ino = f.metadata()?.ino();
                open.insert((f, ino))
            }
        };
        f.write_all(line.as_bytes())
    }

    /// Folds the current file into the older one, keeping of both at most `max_bytes` and
    /// [`MAX_KEPT_LINES`] lines, shared fairly between sessions ([`fair_keep`]), and starts a
    /// new current file.
    fn fold(&self) -> std::io::Result<()> {
        #[derive(Deserialize)]
        struct Key {
            #[serde(default)]
            session: String,
        }
        let mut lines: Vec<(String, String)> = Vec::new();
        for name in [OLD_FILE, FILE] {
            let text = match std::fs::read(self.dir.join(name)) {
                Ok(b) => String::from_utf8_lossy(&b).into_owned(),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => return Err(e),
            };
            for line in text.lines().filter(|l| !l.trim().is_empty()) {
                let session = serde_json::from_str::<Key>(line)
                    .map(|k| k.session)
                    .unwrap_or_default();
                // The tools sessions (one per saved file) share one share: saving many tools
                // does not buy more of the history.
                let key = if crate::local_tools::is_reserved_session(&session) {
                    "ironcell.tools".to_string()
                } else {
                    session
                };
                lines.push((key, line.to_string()));
            }
        }
        let by_bytes = fair_keep(
            &lines
                .iter()
                .map(|(s, l)| (s.as_str(), l.len() as u64 + 1))
                .collect::<Vec<_>>(),
            self.max_bytes,
        );
        let kept: Vec<&(String, String)> = lines
            .iter()
            .zip(by_bytes)
            .filter_map(|(l, keep)| keep.then_some(l))
            .collect();
        let by_count = fair_keep(
            &kept
                .iter()
                .map(|(s, _)| (s.as_str(), 1))
                .collect::<Vec<_>>(),
            MAX_KEPT_LINES as u64,
        );
        let mut text = String::new();
        for ((_, line), keep) in kept.iter().zip(by_count) {
            if keep {
                text.push_str(line);
                text.push('\n');
            }
        }
        crate::host_fs::replace_file_privately(&self.dir, OLD_FILE, text.as_bytes())?;
        match std::fs::remove_file(self.path()) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        }
    }

    /// Every entry, oldest first (the rotated file, then the current one). Lines that do not
    /// parse are skipped and counted.
    pub fn read_all(&self) -> (Vec<AuditEntry>, usize) {
        let mut entries = Vec::new();
        let mut bad = 0;
        for name in [OLD_FILE, FILE] {
            let Ok(text) = std::fs::read_to_string(self.dir.join(name)) else {
                continue;
            };
            for line in text.lines().filter(|l| !l.trim().is_empty()) {
                match serde_json::from_str(line) {
                    Ok(e) => entries.push(e),
                    Err(_) => bad += 1,
                }
            }
        }
        (entries, bad)
    }
}

/// Which of `items` (oldest first, each a key and a weight) to keep so that their weights sum
/// to at most `budget`, shared fairly between keys: each key keeps its newest items up to a
/// common cap, the largest cap that fits (keys under it keep all they have). A key that writes
/// much loses its own oldest items first, never another key's.
pub fn fair_keep(items: &[(&str, u64)], budget: u64) -> Vec<bool> {
    let mut totals: std::collections::HashMap<&str, u64> = std::collections::HashMap::new();
    for (k, w) in items {
        *totals.entry(k).or_default() += w;
    }
    let fits = |cap: u64| totals.values().map(|t| (*t).min(cap)).sum::<u64>() <= budget;
    let most = totals.values().copied().max().unwrap_or(0);
    let cap = if fits(most) {
        most
    } else {
        let (mut lo, mut hi) = (0u64, most);
        while lo < hi {
            let mid = lo + (hi - lo).div_ceil(2);
            if fits(mid) { lo = mid } else { hi = mid - 1 }
        }
        lo
    };
    let mut used: std::collections::HashMap<&str, u64> = std::collections::HashMap::new();
    let mut keep = vec![false; items.len()];
    for (i, (k, w)) in items.iter().enumerate().rev() {
        let u = used.entry(k).or_default();
        if *u + w <= cap {
            *u += w;
            keep[i] = true;
        } else {
            // Newest first: once a key's share is full, its older items go.
            *u = cap;
        }
    }
    keep
}

/// `--since`: an RFC 3339 time, or a duration ago (`90m`, `2h`, `1d`).
pub fn parse_since(s: &str) -> Result<chrono::DateTime<chrono::Utc>, String> {
    if let Ok(t) = chrono::DateTime::parse_from_rfc3339(s) {
        return Ok(t.with_timezone(&chrono::Utc));
    }
    let ago = match s.strip_suffix('d') {
        Some(days) => days
            .trim()
            .parse::<f64>()
            .ok()
            .filter(|d| d.is_finite() && *d >= 0.0)
            .map(|d| Duration::from_secs_f64(d * 86_400.0))
            .ok_or_else(|| format!("{s:?} is not a number of days"))?,
        None => crate::config::parse_duration(s).map_err(|e| {
            format!("{e}; --since takes an RFC 3339 time (2026-11-30T18:00:00Z) or a duration ago (90m, 2h, 1d)")
        })?,
    };
    let ago = chrono::Duration::from_std(ago).map_err(|e| e.to_string())?;
    Ok(chrono::Utc::now() - ago)
}

/// What `ironcell audit` prints.
pub fn render(
    log: &AuditLog,
    session: Option<&str>,
    since: Option<chrono::DateTime<chrono::Utc>>,
    json: bool,
) -> String {
    let (entries, bad) = log.read_all();
    let chosen: Vec<&AuditEntry> = entries
        .iter()
        .filter(|e| session.is_none_or(|s| e.session == s))
        .filter(|e| {
            since.is_none_or(|t| {
                chrono::DateTime::parse_from_rfc3339(&e.time)
                    .map(|et| et.with_timezone(&chrono::Utc) >= t)
                    .unwrap_or(true)
            })
        })
        .collect();
    let mut out = String::new();
    if json {
        for e in &chosen {
            out.push_str(&ascii_json(&serde_json::to_string(e).unwrap_or_default()));
            out.push('\n');
        }
        return out;
    }
    if chosen.is_empty() {
        out.push_str(&format!("no runs recorded in {}\n", log.path().display()));
    } else {
        out.push_str(&format!(
            "{:<24} {:<14} {:<13} {:>9}  {:<30} code\n",
            "time", "session", "status", "ms", "proxied calls"
        ));
        for e in &chosen {
            let calls: Vec<String> = e
                .upstream_calls
                .iter()
                .map(|c| {
                    let s = |k: &str| shown(c.get(k).and_then(Value::as_str).unwrap_or("?"));
                    let outcome = s("outcome");
                    if outcome == "ok" {
                        format!("{}.{}", s("server"), s("tool"))
                    } else {
                        format!("{}.{}:{outcome}", s("server"), s("tool"))
                    }
                })
                .collect();
            let mut status = e.status.clone();
            if !e.limits_hit.is_empty() {
                status = format!("{status}*");
            }
            let first_line = shown(e.code_head.lines().next().unwrap_or(""));
            let status = shown(&status);
            out.push_str(&format!(
                "{:<24} {:<14} {:<13} {:>9.1}  {:<30} {}\n",
                e.time.get(..23).unwrap_or(&e.time),
                clip(&shown(&e.session), 14),
                status,
                e.duration_ms,
                clip(&calls.join(","), 30),
                clip(&first_line, 60),
            ));
        }
        out.push_str(&format!(
            "{} run(s); * = a limit was hit (see --json); log: {}\n",
            chosen.len(),
            log.path().display()
        ));
    }
    if bad > 0 {
        out.push_str(&format!("{bad} unreadable line(s) skipped\n"));
    }
    out
}

/// Text from the log as `ironcell audit` prints it: every character that is not printable
/// ASCII as a `\u{…}` escape, so nothing in a line (written by sandboxed code) can move the
/// cursor, erase a line, reorder text or draw a line of its own.
fn shown(s: &str) -> String {
    crate::proxy::approval::escaped_text(s)
}

/// A JSON text with every character outside printable ASCII written as a JSON `\uXXXX`
/// escape (still the same JSON), for `--json` output read on a terminal.
fn ascii_json(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if (' '..='~').contains(&c) {
            out.push(c);
        } else {
            let mut units = [0u16; 2];
            for u in c.encode_utf16(&mut units) {
                out.push_str(&format!("\\u{u:04x}"));
            }
        }
    }
    out
}

fn clip(s: &str, n: usize) -> String {
    if s.chars().count() <= n {
        s.to_string()
    } else {
        crate::clip_chars(s, n - 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(session: &str, code: &str) -> AuditEntry {
        AuditEntry::new(session, code, &Err::<RunRecord, _>("refused for the test"))
    }

    #[test]
    fn lines_are_appended_read_back_and_rotated_by_size() {
        let dir = std::env::temp_dir().join(format!("ironcell-audit-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let log = AuditLog::new(&dir, 4096);
        for i in 0..40 {
            log.append(&entry(
                &format!("s{i}"),
                &format!("print({i})\n# {}", "x".repeat(50)),
            ));
        }
        let (all, bad) = log.read_all();
        assert_eq!(bad, 0);
        assert!(dir.join(OLD_FILE).exists(), "the log was rotated");
        assert!(std::fs::metadata(log.path()).map(|m| m.len()).unwrap_or(0) <= 4096);
        assert_eq!(all.last().map(|e| e.session.as_str()), Some("s39"));
        assert!(all.len() < 40, "only one older file is kept");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_log_rotated_or_removed_by_someone_else_is_followed_not_written_behind() {
        let dir = std::env::temp_dir().join(format!("ironcell-audit-moved-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let log = AuditLog::new(&dir, 1 << 20);
        log.append(&entry("before", "1"));
        // Another server sharing the state directory rotated it; then someone removed both.
        std::fs::rename(log.path(), dir.join(OLD_FILE)).unwrap_or_else(|e| panic!("{e}"));
        log.append(&entry("after-rotation", "2"));
        let current = std::fs::read_to_string(log.path()).unwrap_or_default();
        assert!(
            current.contains("after-rotation") && !current.contains("before"),
            "{current}"
        );
        std::fs::remove_dir_all(&dir).unwrap_or_else(|e| panic!("{e}"));
        log.append(&entry("after-removal", "3"));
        let current = std::fs::read_to_string(log.path()).unwrap_or_default();
        assert!(current.contains("after-removal"), "{current}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn an_entry_keeps_a_hash_and_the_head_of_the_code_only() {
        let code = "a = 1\nb = 2\nc = 3\nsecret_line = 4\n";
        let e = entry("s", code);
        assert_eq!(e.code_head, "a = 1\nb = 2\nc = 3");
        assert_eq!(
            e.code_sha256,
            "b28f4d33c426da0f5b12c42f6abe7a9328f99d08afc3f0892eae7dd24c7ad3fd"
        );
        assert_eq!(e.status, "refused");
    }

    #[test]
    fn history_is_shared_fairly_so_one_session_cannot_flush_the_others() {
        let dir = std::env::temp_dir().join(format!("ironcell-audit-fair-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let log = AuditLog::new(&dir, 16 << 10);
        log.append(&entry("victim", "print('mine')"));
        for i in 0..2000 {
            log.append(&entry("flooder", &format!("# {i} {}", "z".repeat(200))));
        }
        let (all, _) = log.read_all();
        assert!(
            all.iter().any(|e| e.session == "victim"),
            "the victim's line is kept"
        );
        let flooder = all.iter().filter(|e| e.session == "flooder").count();
        assert!((10..2000).contains(&flooder), "{flooder}");
        let size: u64 = [FILE, OLD_FILE]
            .iter()
            .map(|f| std::fs::metadata(dir.join(f)).map_or(0, |m| m.len()))
            .sum();
        assert!(size <= 2 * (16 << 10), "{size}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn fair_keep_gives_each_key_an_equal_share_of_its_newest_items() {
        let items = [("a", 5), ("b", 5), ("b", 5), ("b", 5), ("c", 1)];
        assert_eq!(fair_keep(&items, 100), vec![true; 5]);
        // Budget 11: the cap is 5, so a keeps its one, b its newest, c its one.
        assert_eq!(fair_keep(&items, 11), vec![true, false, false, true, true]);
    }

    #[test]
    fn a_line_is_bounded_and_a_run_of_many_calls_continues_on_more_lines() {
        let mut e = entry("s", "x");
        e.upstream_calls = (0..400)
            .map(|i| serde_json::json!({"server": "s", "tool": format!("t{i}"), "arguments": "a".repeat(1000)}))
            .collect();
        let lines = e.lines();
        assert!(lines.len() > 1);
        assert!(lines.iter().all(|l| l.len() <= MAX_LINE_BYTES));
        let listed: usize = lines
            .iter()
            .map(|l| {
                serde_json::from_str::<AuditEntry>(l)
                    .map(|e| e.upstream_calls.len())
                    .unwrap_or(0)
            })
            .sum();
        assert_eq!(listed, 400, "every call is listed once");
    }

    #[test]
    fn what_audit_prints_is_escaped() {
        assert_eq!(
            shown("a\u{1b}[2K\u{202e}\r\u{2028}b"),
            "a\\u{1b}[2K\\u{202e}\\r\\u{2028}b"
        );
        let json = ascii_json("{\"a\":\"\u{202e}\u{1f600}\"}");
        assert_eq!(json, "{\"a\":\"\\u202e\\ud83d\\ude00\"}");
        assert_eq!(
            serde_json::from_str::<Value>(&json).ok(),
            Some(serde_json::json!({"a": "\u{202e}\u{1f600}"}))
        );
    }

    #[test]
    fn since_takes_times_and_durations() {
        assert!(parse_since("2026-11-30T18:00:00Z").is_ok());
        let hour_ago = parse_since("1h").unwrap_or_else(|e| panic!("{e}"));
        let now = chrono::Utc::now();
        assert!((now - hour_ago).num_minutes() >= 59);
        assert!(parse_since("1d").is_ok());
        assert!(parse_since("yesterday").is_err());
    }
}
