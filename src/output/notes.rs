//! The notes under a failed run: what the sandbox refused (network, a path outside the grants, a
//! process, a system call), a session at its memory limit, a module the interpreter lacks, each
//! with the way out. Read from the run's error and stderr, never at length.

use std::path::PathBuf;

use super::{RunRecord, RunStatus};

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
    let mut notes = Vec::new();
    if let Some(n) = fixed_limits_note(&text, ctx) {
        notes.push(n);
    }
    notes.extend(refusal_notes(&text, children_refused.as_deref()));
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

/// The start of the runner's refusal of a change of the memory limits (`FIXED_MEMORY_LIMITS`
/// in python/_ironcell_runner.py).
const FIXED_MEMORY_LIMITS: &str =
    "the sandbox fixes this session's memory limits (RLIMIT_AS and RLIMIT_DATA)";

/// A cell that tried to change its own memory limits (`resource.setrlimit`/`prlimit` on
/// `RLIMIT_AS` or `RLIMIT_DATA`, lowering too: SECURITY.md #239, #260): where they come from.
fn fixed_limits_note(text: &str, ctx: &NoteContext) -> Option<String> {
    if !text.contains(FIXED_MEMORY_LIMITS) {
        return None;
    }
    let limit = match ctx.memory_limit >> 20 {
        0 => String::new(),
        mib => format!(" ({mib} MiB)"),
    };
    Some(format!(
        "a session cannot change its own memory limits, not even lower them: the sandbox \
         refuses setrlimit and prlimit on RLIMIT_AS and RLIMIT_DATA. The session's memory \
         limit{limit} is the server's setting (--memory-limit / MCP_BRIDGE_MEMORY_LIMIT, or \
         memory_mib in the policy); code that only caps itself can skip the call, and \
         resource.getrlimit reads the limits"
    ))
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

#[cfg(test)]
mod tests {
    use super::super::SessionState;
    use super::*;
    use crate::frame::PyErrorInfo;

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
    fn a_refused_change_of_the_memory_limits_names_the_setting_and_nothing_else() {
        let why = "the sandbox fixes this session's memory limits (RLIMIT_AS and RLIMIT_DATA): \
                   they cannot be changed from inside the session, lowered or raised";
        for (kind, message) in [
            ("ValueError", why.to_string()),
            ("PermissionError", format!("[Errno 1] {why}")),
        ] {
            let n = notes(kind, &message, "", "");
            assert!(
                n.contains("cannot change its own memory limits, not even lower them"),
                "{n}"
            );
            assert!(
                n.contains("memory limit (1024 MiB) is the server's setting"),
                "{n}"
            );
            assert!(
                n.contains("MCP_BRIDGE_MEMORY_LIMIT") && !n.contains("system-call filter"),
                "{n}"
            );
        }
        // CPython's own words for another limit are left alone.
        let n = notes("ValueError", "not allowed to raise maximum limit", "", "");
        assert!(!n.contains("memory limits"), "{n}");
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
}
