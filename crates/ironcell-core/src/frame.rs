//! The framing shared by the host and a worker on a session socket.
//!
//! Every frame is a big-endian `u32` length, then one kind byte, then the payload:
//! `J` carries a JSON control message ([`ToWorker`] or [`FromWorker`]), `O` and `E` carry raw
//! bytes the worker wrote to its fd 1 and fd 2. Output travels as bytes, not JSON strings, so a
//! UTF-8 sequence split across two reads is joined again by the host instead of being mangled.

use std::io::{self, Read, Write};

use serde::{Deserialize, Serialize};

/// Largest frame a worker accepts from the host. Code is capped well below this by the host.
pub const MAX_FRAME_BYTES: usize = 64 * 1024 * 1024;

/// Largest frame the host accepts from a worker, before the inline images of a `done` frame
/// (see [`max_worker_frame_bytes`]): a bridge request's arguments, or a `done` frame's text.
pub const MAX_WORKER_FRAME_BYTES: usize = 16 * 1024 * 1024;
/// Longest `result` repr (in characters) in a `done` frame: the runner cuts at 20,000 and adds
/// a short "... [N more characters]" note.
pub const MAX_RESULT_CHARS: usize = 20_000 + 200;
/// Longest error message or traceback (in characters) in a `done` frame; the worker cuts both
/// at [`ERROR_FIELD_CUT_CHARS`].
pub const MAX_ERROR_FIELD_CHARS: usize = 2 * ERROR_FIELD_CUT_CHARS;
/// Where the worker cuts an error message or traceback before sending it.
pub const ERROR_FIELD_CUT_CHARS: usize = 16 * 1024;
/// Longest exception type name, bridge method name, mime type or best-effort layer note.
pub const MAX_NAME_CHARS: usize = 256;
/// Most images one `done` frame may carry (the runner sends at most 8).
pub const MAX_IMAGES: usize = 16;
/// Longest image path, in bytes (Linux's PATH_MAX).
pub const MAX_PATH_BYTES: usize = 4096;
/// Most bridge requests a worker may have waiting for an answer at once. The worker's bridge
/// queues calls beyond this itself; a worker that sends more anyway breaks the protocol.
pub const MAX_INFLIGHT_REQUESTS: usize = 64;
/// Most JSON values one message from a worker may hold. Parsed, a value costs the host tens of
/// bytes however short its text (`0,` is two bytes), so a frame's byte cap alone let one 22 MB
/// request of zeros take ~750 MB of the host's memory.
pub const MAX_MESSAGE_VALUES: usize = 1_000_000;
/// Most JSON values the open bridge requests of one worker may hold in all (the host keeps each
/// request's parameters until it is answered).
pub const MAX_OPEN_REQUEST_VALUES: usize = 1_000_000;
/// Image types a `done` frame may name (what the runner detects by suffix or renders).
pub const IMAGE_MIME_TYPES: &[&str] = &["image/png", "image/jpeg", "image/gif", "image/webp"];

pub const KIND_JSON: u8 = b'J';
pub const KIND_STDOUT: u8 = b'O';
pub const KIND_STDERR: u8 = b'E';

/// Messages the host sends to a worker.
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum ToWorker {
    /// Run a cell of Python in the session's namespace.
    Run {
        id: u64,
        code: String,
        /// Set on a pre-forked spare's first cell only: the session it now serves.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        bind: Option<Binding>,
    },
    /// The answer to a [`FromWorker::Request`]: `{"result": ...}` or
    /// `{"error": {"kind", "message"}}`.
    Response { id: u64, payload: serde_json::Value },
    /// Fork this session into a new one (sent between cells, with the new session's socket
    /// attached by `SCM_RIGHTS`). The worker answers [`FromWorker::Forked`]; the fork says
    /// `ready` on its own socket.
    Fork(ForkOrder),
    /// A request for this worker is on its way (the host has just read a line naming its
    /// session, or one that may take this spare): it may bring the code a cell runs back into
    /// its caches meanwhile. Carries nothing, asks for no answer, and the host never waits on
    /// it; sent between cells only, when the worker has read all it was sent ([`WARM_FRAME`]).
    Warm,
}

/// The whole `warm` frame on the wire (length, kind, payload): the host writes it in one
/// non-blocking `send` on the stdin-reading path, without the writer task.
pub const WARM_FRAME: &[u8] = b"\0\0\0\x0eJ{\"op\":\"warm\"}";

/// Where each side of a fork lives afterwards (docs/ARCHITECTURE.md, "Forking a session"). The
/// host made every directory; each is beneath the worker's forks area, which its Landlock
/// domain grants, and each side narrows its domain to its own two.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ForkOrder {
    /// The parent's session directory (its current path) and its next forks area.
    pub parent_dir: std::path::PathBuf,
    pub parent_forks: std::path::PathBuf,
    /// The new session's directory (empty: the fork copies the parent's files into it) and its
    /// forks area.
    pub child_dir: std::path::PathBuf,
    pub child_forks: std::path::PathBuf,
    /// Variables that name the new session (`HOME`, `TMPDIR`, `PWD`, `IRONCELL_SESSION`).
    pub env: Vec<(String, String)>,
    /// The most bytes the fork may copy: the room the host checked the parent's files against
    /// (a session's scratch quota, and the disk above its free-space floor). The parent can
    /// still grow a file while the copy runs (a signal handler of its own, SECURITY.md #300):
    /// the copy stops there and the fork fails. `None`: no limit.
    #[serde(default)]
    pub copy_limit_bytes: Option<u64>,
}

/// What a pre-forked spare learns when the host hands it to a session: the host has renamed
/// the spare's directory to `scratch` (the same directory, so the worker's cwd, its Landlock
/// grants and its private `/tmp` are unchanged), and `env` names the session.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Binding {
    /// Variables to set (`HOME`, `TMPDIR`, `PWD`, `IRONCELL_SESSION`).
    pub env: Vec<(String, String)>,
    /// The directory's path from now on.
    pub scratch: std::path::PathBuf,
    /// Whether the host linked packages an earlier worker of the session installed into this
    /// worker's package directory: only then must it refresh its import caches (~50 us of a
    /// new session's first run after an idle pause otherwise).
    #[serde(default = "linked_unless_told")]
    pub packages_linked: bool,
}

fn linked_unless_told() -> bool {
    true
}

/// How a cell ended, as the worker saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CellStatus {
    Ok,
    Error,
    Interrupted,
    Exit,
}

/// A Python exception, summarized for the model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PyErrorInfo {
    #[serde(rename = "type")]
    pub kind: String,
    pub message: String,
    pub traceback: String,
}

/// Messages a worker sends to the host.
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum FromWorker {
    /// The worker finished its lockdown and accepts code.
    Ready {
        pid: i32,
        /// Sandbox layers skipped (best-effort mode only).
        #[serde(default)]
        missing_layers: Vec<String>,
        /// How long the lockdown took (reported in `system://info` and by the benchmark).
        #[serde(default)]
        lockdown_us: u64,
        /// A forked session's notes for its first result (what did not come along).
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        notes: Vec<String>,
    },
    /// The worker could not set itself up and is about to exit.
    Fatal { message: String },
    /// During setup only, before `ready`: the listener of the worker's epoll gate travels with
    /// this frame (`SCM_RIGHTS`); the host counts the session's epoll watches through it
    /// (`sandbox::epoll_gate`).
    EpollListener {},
    /// During setup only, before `ready`: the worker's own `/proc/self/smaps_rollup`, opened
    /// before its `/proc` is hidden, travels with this frame (`SCM_RIGHTS`): the memory watch
    /// reads its share (PSS) through it, which a host running as a user cannot open by path
    /// in the non-dumpable worker (SECURITY.md #241).
    MemoryCounters {},
    /// During setup only, before `ready`: the read ends of the worker's fd 1 and fd 2 pipes
    /// travel with this frame (`SCM_RIGHTS`, stdout's then stderr's): once the worker is gone,
    /// the host reads what it wrote last and its pump never forwarded (SECURITY.md #277).
    OutputPipes {},
    /// A call from the in-sandbox `mcp` module to the host (and through it to a proxied MCP
    /// server): `servers`, `tools`, `search` or `call`.
    Request {
        id: u64,
        method: String,
        params: serde_json::Value,
    },
    /// The parent's answer to [`ToWorker::Fork`]: `None` once the fork is made and the parent
    /// narrowed to its own directory, else why not.
    Forked { error: Option<String> },
    /// A cell finished. Everything it wrote was sent before this frame.
    Done {
        id: u64,
        status: CellStatus,
        result: Option<String>,
        error: Option<PyErrorInfo>,
        exit_code: Option<i64>,
        /// Figures the cell left open and images it wrote, downscaled by the worker.
        #[serde(default)]
        images: Vec<CellImage>,
    },
}

/// An image a cell produced. `data` (base64) is the inline copy within the byte budget, if any.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CellImage {
    /// Relative to the session directory.
    pub path: String,
    pub mime: String,
    pub bytes: u64,
    #[serde(default)]
    pub width: Option<u32>,
    #[serde(default)]
    pub height: Option<u32>,
    #[serde(default)]
    pub data: Option<String>,
}

/// Largest frame the host reads from a worker whose inline images are capped at
/// `image_budget_bytes` each (base64 adds a third).
pub fn max_worker_frame_bytes(image_budget_bytes: u64) -> usize {
    let images = usize::try_from(image_budget_bytes)
        .unwrap_or(usize::MAX)
        .saturating_mul(MAX_IMAGES)
        .saturating_mul(4)
        / 3;
    MAX_WORKER_FRAME_BYTES.saturating_add(images)
}

/// A worker broke the session protocol: the host kills it and reports this message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("protocol violation: {0}")]
pub struct Violation(pub String);

fn violation<T>(message: impl Into<String>) -> Result<T, Violation> {
    Err(Violation(message.into()))
}

/// One frame from a worker, decoded and checked against every stateless cap.
#[derive(Debug)]
pub enum WorkerFrame<'a> {
    Stdout(&'a [u8]),
    Stderr(&'a [u8]),
    Message(FromWorker),
}

/// Decodes a frame body (kind byte + payload) read from a worker's session socket.
///
/// The worker is the attacker here: everything it sends is checked before the host acts on
/// it. What needs the session's state (the run id, the number of open requests) is checked by
/// the caller.
pub fn decode_worker_frame(
    body: &[u8],
    image_budget_bytes: u64,
) -> Result<WorkerFrame<'_>, Violation> {
    let Some((&kind, payload)) = body.split_first() else {
        return violation("an empty frame");
    };
    match kind {
        KIND_STDOUT => Ok(WorkerFrame::Stdout(payload)),
        KIND_STDERR => Ok(WorkerFrame::Stderr(payload)),
        KIND_JSON => {
            let values = json_values(payload);
            if values > MAX_MESSAGE_VALUES {
                return violation(format!(
                    "a control frame of about {values} JSON values (at most {MAX_MESSAGE_VALUES})"
                ));
            }
            let msg: FromWorker = serde_json::from_slice(payload).or_else(|e| {
                violation(format!("a control frame that is not a valid message ({e})"))
            })?;
            validate_from_worker(&msg, image_budget_bytes)?;
            Ok(WorkerFrame::Message(msg))
        }
        other => violation(format!("a frame of unknown kind {other:#04x}")),
    }
}

/// About how many JSON values `text` holds, counted without parsing it: one, plus one per
/// comma and per opening bracket outside strings (exact for well-formed arrays and objects of
/// scalars; an object's keys are not counted).
pub fn json_values(text: &[u8]) -> usize {
    let (mut count, mut in_string, mut escaped) = (1usize, false, false);
    for &b in text {
        if in_string {
            match b {
                _ if escaped => escaped = false,
                b'\\' => escaped = true,
                b'"' => in_string = false,
                _ => {}
            }
        } else {
            match b {
                b'"' => in_string = true,
                b',' | b'[' | b'{' => count += 1,
                _ => {}
            }
        }
    }
    count
}

/// Checks every field of a worker's message against its cap.
pub fn validate_from_worker(msg: &FromWorker, image_budget_bytes: u64) -> Result<(), Violation> {
    match msg {
        FromWorker::Ready {
            missing_layers,
            notes,
            ..
        } => {
            if notes.len() > 8 {
                return violation(format!("`ready` lists {} notes", notes.len()));
            }
            for n in notes {
                cap_chars("a fork's note", n, 4 * MAX_NAME_CHARS)?;
            }
            if missing_layers.len() > 64 {
                return violation(format!(
                    "`ready` lists {} missing layers",
                    missing_layers.len()
                ));
            }
            for l in missing_layers {
                cap_chars("a missing-layer note", l, 4 * MAX_NAME_CHARS)?;
            }
            Ok(())
        }
        FromWorker::Fatal { message } => {
            cap_chars("a fatal message", message, MAX_ERROR_FIELD_CHARS)
        }
        FromWorker::EpollListener {}
        | FromWorker::MemoryCounters {}
        | FromWorker::OutputPipes {} => Ok(()),
        FromWorker::Forked { error } => match error {
            Some(e) => cap_chars("a fork's error", e, MAX_ERROR_FIELD_CHARS),
            None => Ok(()),
        },
        FromWorker::Request { method, params, .. } => {
            if method.is_empty()
                || method.len() > 64
                || !method.split('.').all(|part| {
                    !part.is_empty() && part.bytes().all(|b| b.is_ascii_lowercase() || b == b'_')
                })
            {
                return violation(format!(
                    "a bridge request with an invalid method name {:?}",
                    method.chars().take(80).collect::<String>()
                ));
            }
            if !params.is_object() {
                return violation(format!(
                    "bridge request {method:?} whose params are not an object"
                ));
            }
            Ok(())
        }
        FromWorker::Done {
            result,
            error,
            images,
            ..
        } => {
            if let Some(r) = result {
                cap_chars("the result", r, MAX_RESULT_CHARS)?;
            }
            if let Some(e) = error {
                cap_chars("the error type", &e.kind, MAX_NAME_CHARS)?;
                cap_chars("the error message", &e.message, MAX_ERROR_FIELD_CHARS)?;
                cap_chars("the traceback", &e.traceback, MAX_ERROR_FIELD_CHARS)?;
            }
            if images.len() > MAX_IMAGES {
                return violation(format!(
                    "`done` carries {} images; the limit is {MAX_IMAGES}",
                    images.len()
                ));
            }
            for img in images {
                validate_image(img, image_budget_bytes)?;
            }
            Ok(())
        }
    }
}

fn cap_chars(what: &str, text: &str, limit: usize) -> Result<(), Violation> {
    // Bytes bound characters from above, so the exact count is only needed near the limit.
    if text.len() > limit && text.chars().count() > limit {
        return violation(format!(
            "{what} is {} characters; the limit is {limit}",
            text.chars().count()
        ));
    }
    Ok(())
}

fn validate_image(img: &CellImage, image_budget_bytes: u64) -> Result<(), Violation> {
    session_relative_path(&img.path)?;
    if !IMAGE_MIME_TYPES.contains(&img.mime.as_str()) {
        return violation(format!(
            "an image of type {:?} (expected one of {})",
            img.mime.chars().take(MAX_NAME_CHARS).collect::<String>(),
            IMAGE_MIME_TYPES.join(", ")
        ));
    }
    if let Some(data) = &img.data {
        let budget = usize::try_from(image_budget_bytes).unwrap_or(usize::MAX);
        let limit = budget.saturating_add(2) / 3 * 4 + 4;
        if data.len() > limit {
            return violation(format!(
                "inline image {:?} is {} base64 bytes; the budget (IRONCELL_IMAGE_BUDGET) allows {limit}",
                img.path,
                data.len()
            ));
        }
        use base64::Engine;
        if base64::engine::general_purpose::STANDARD
            .decode(data)
            .is_err()
        {
            return violation(format!("inline image {:?} is not valid base64", img.path));
        }
    }
    Ok(())
}

/// Checks, by its text alone, that `path` names something inside a session directory: relative,
/// no `..` or `.` step, no empty step, no control characters, at most PATH_MAX bytes. (Whether
/// it exists as a regular file, and not through a symlink, is for the filesystem to say.)
pub fn session_relative_path(path: &str) -> Result<&str, Violation> {
    let bad = |why: &str| {
        violation(format!(
            "path {:?} {why}",
            path.chars().take(200).collect::<String>()
        ))
    };
    if path.is_empty() {
        return bad("is empty");
    }
    if path.len() > MAX_PATH_BYTES {
        return bad("is longer than PATH_MAX");
    }
    if path.starts_with('/') {
        return bad("is absolute; paths must be relative to the session directory");
    }
    if path.chars().any(char::is_control) {
        return bad("contains control characters");
    }
    for step in path.split('/') {
        match step {
            "" => return bad("has an empty step"),
            "." | ".." => return bad("has a `.` or `..` step; paths must stay inside the session"),
            _ => {}
        }
    }
    Ok(path)
}

/// Writes one frame to a blocking writer (the worker side), header and payload in one
/// `writev` where the socket takes it whole: a header sent on its own would wake the host's
/// reader once for the header and again for the rest.
pub fn write_frame(w: &mut impl Write, kind: u8, payload: &[u8]) -> io::Result<()> {
    let len = u32::try_from(payload.len() + 1)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "frame too large"))?;
    let mut header = [0u8; 5];
    header[..4].copy_from_slice(&len.to_be_bytes());
    header[4] = kind;
    let written = loop {
        match w.write_vectored(&[io::IoSlice::new(&header), io::IoSlice::new(payload)]) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => break n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        }
    };
    // A partial write (a full socket buffer) goes on with plain writes.
    if written < header.len() {
        w.write_all(&header[written..])?;
        w.write_all(payload)?;
    } else {
        w.write_all(&payload[written - header.len()..])?;
    }
    w.flush()
}

/// Reads one frame from a blocking reader (the worker side). `Ok(None)` on a clean EOF.
pub fn read_frame(r: &mut impl Read) -> io::Result<Option<(u8, Vec<u8>)>> {
    let mut len = [0u8; 4];
    match r.read_exact(&mut len) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    let len = u32::from_be_bytes(len) as usize;
    if len == 0 || len > MAX_FRAME_BYTES {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("bad frame length {len}"),
        ));
    }
    let mut buf = vec![0u8; len];
    r.read_exact(&mut buf)?;
    let kind = buf.remove(0);
    Ok(Some((kind, buf)))
}

/// Encodes a JSON control frame body (kind byte + JSON); the host's writer adds the length.
#[cfg(feature = "host")]
pub fn json_body<T: Serialize>(msg: &T) -> io::Result<bytes::Bytes> {
    let mut body = vec![KIND_JSON];
    serde_json::to_writer(&mut body, msg)?;
    Ok(body.into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_values_are_counted_without_parsing_and_strings_count_once() {
        assert_eq!(json_values(b"[0,0,0]"), 4);
        assert_eq!(json_values(br#"{"a":1,"b":[2,3]}"#), 5);
        assert_eq!(json_values(br#"{"s":"a,b,[c{\",d"}"#), 2);
        assert_eq!(json_values(b"7"), 1);
        let zeros = format!(
            "{{\"op\":\"request\",\"id\":1,\"method\":\"memory.list\",\"params\":{{\"p\":[{}0]}}}}",
            "0,".repeat(MAX_MESSAGE_VALUES)
        );
        let mut frame = vec![KIND_JSON];
        frame.extend_from_slice(zeros.as_bytes());
        let err = decode_worker_frame(&frame, 0).unwrap_err();
        assert!(err.0.contains("JSON values"), "{err}");
    }

    #[test]
    fn the_warm_frame_is_a_whole_frame_of_the_warm_order() {
        let (kind, body) = read_frame(&mut &WARM_FRAME[..]).unwrap().unwrap();
        assert_eq!(kind, KIND_JSON);
        assert!(matches!(serde_json::from_slice(&body), Ok(ToWorker::Warm)));
        assert_eq!(
            read_frame(&mut &WARM_FRAME[..WARM_FRAME.len() - 1])
                .ok()
                .flatten(),
            None
        );
    }

    #[test]
    fn a_frame_written_by_the_worker_reads_back_whole() {
        let mut buf = Vec::new();
        write_frame(&mut buf, KIND_STDOUT, b"hello\n").unwrap();
        write_frame(
            &mut buf,
            KIND_JSON,
            br#"{"op":"ready","pid":7,"missing_layers":[]}"#,
        )
        .unwrap();
        let mut r = &buf[..];
        assert_eq!(
            read_frame(&mut r).unwrap(),
            Some((KIND_STDOUT, b"hello\n".to_vec()))
        );
        let (kind, body) = read_frame(&mut r).unwrap().unwrap();
        assert_eq!(kind, KIND_JSON);
        let msg: FromWorker = serde_json::from_slice(&body).unwrap();
        assert!(matches!(msg, FromWorker::Ready { pid: 7, .. }));
        assert_eq!(read_frame(&mut r).unwrap(), None);
    }

    /// A writer that takes at most `limit` bytes per call, like a full socket.
    struct Trickle {
        out: Vec<u8>,
        limit: usize,
        calls: usize,
    }

    impl Write for Trickle {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            self.calls += 1;
            let n = buf.len().min(self.limit);
            self.out.extend_from_slice(&buf[..n]);
            Ok(n)
        }
        fn write_vectored(&mut self, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
            self.calls += 1;
            let mut n = 0;
            for b in bufs {
                let take = b.len().min(self.limit - n);
                self.out.extend_from_slice(&b[..take]);
                n += take;
            }
            Ok(n)
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_frame_goes_out_in_one_write_and_survives_partial_writes() {
        let body = b"{\"op\":\"done\"}".repeat(40);
        let mut whole = Trickle {
            out: Vec::new(),
            limit: usize::MAX,
            calls: 0,
        };
        write_frame(&mut whole, KIND_JSON, &body).unwrap();
        assert_eq!(whole.calls, 1, "header and body in one system call");
        for limit in [1, 3, 5, 6, 100] {
            let mut slow = Trickle {
                out: Vec::new(),
                limit,
                calls: 0,
            };
            write_frame(&mut slow, KIND_JSON, &body).unwrap();
            assert_eq!(slow.out, whole.out, "limit {limit}");
            assert_eq!(
                read_frame(&mut &slow.out[..]).unwrap(),
                Some((KIND_JSON, body.clone()))
            );
        }
    }

    #[test]
    fn an_oversized_length_is_rejected_not_allocated() {
        let mut buf = ((MAX_FRAME_BYTES + 2) as u32).to_be_bytes().to_vec();
        buf.push(KIND_JSON);
        assert!(read_frame(&mut &buf[..]).is_err());
    }

    fn done(result: Option<String>, images: Vec<CellImage>) -> FromWorker {
        FromWorker::Done {
            id: 1,
            status: CellStatus::Ok,
            result,
            error: None,
            exit_code: None,
            images,
        }
    }

    fn image(path: &str, data: Option<String>) -> CellImage {
        CellImage {
            path: path.into(),
            mime: "image/png".into(),
            bytes: 10,
            width: None,
            height: None,
            data,
        }
    }

    #[test]
    fn paths_outside_the_session_are_refused_by_their_text() {
        for ok in [
            "a.png",
            "sub/dir/b.png",
            ".ironcell/figures/run-1-figure-1.png",
            "..a.png",
        ] {
            assert!(session_relative_path(ok).is_ok(), "{ok}");
        }
        let long = "a/".repeat(3000);
        for bad in [
            "",
            "/etc/passwd",
            "../x.png",
            "a/../../x",
            "./a",
            "a//b",
            "a/\n.png",
            &long,
        ] {
            assert!(session_relative_path(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn a_forks_answer_and_notes_past_their_caps_are_violations() {
        let long = "x".repeat(MAX_ERROR_FIELD_CHARS + 1);
        let forked = FromWorker::Forked { error: Some(long) };
        assert!(validate_from_worker(&forked, 0).is_err());
        assert!(validate_from_worker(&FromWorker::Forked { error: None }, 0).is_ok());
        let ready = |notes: Vec<String>| FromWorker::Ready {
            pid: 1,
            missing_layers: Vec::new(),
            lockdown_us: 0,
            notes,
        };
        assert!(validate_from_worker(&ready(vec!["ok".into(); 8]), 0).is_ok());
        assert!(validate_from_worker(&ready(vec!["ok".into(); 9]), 0).is_err());
        assert!(validate_from_worker(&ready(vec!["y".repeat(4 * MAX_NAME_CHARS + 1)]), 0).is_err());
        // The order the host sends reads back as one.
        let order = ToWorker::Fork(ForkOrder {
            parent_dir: "/s/a".into(),
            parent_forks: "/s/@forks-1/@next-1".into(),
            child_dir: "/s/@forks-1/b-1".into(),
            child_forks: "/s/@forks-1/@forks-1".into(),
            env: vec![("HOME".into(), "/s/@forks-1/b-1".into())],
            copy_limit_bytes: Some(1 << 30),
        });
        let json = serde_json::to_string(&order).unwrap();
        assert!(json.starts_with(r#"{"op":"fork","#), "{json}");
        let back: ToWorker = serde_json::from_str(&json).unwrap();
        assert!(
            matches!(back, ToWorker::Fork(o) if o.child_dir == std::path::Path::new("/s/@forks-1/b-1"))
        );
    }

    #[test]
    fn a_done_frame_past_any_cap_is_a_violation() {
        let budget = 1000;
        assert!(validate_from_worker(&done(Some("x".repeat(20_000)), vec![]), budget).is_ok());
        let e = validate_from_worker(&done(Some("x".repeat(1 << 20)), vec![]), budget).unwrap_err();
        assert!(
            e.to_string()
                .starts_with("protocol violation: the result is 1048576 characters")
        );
        let many = vec![image("a.png", None); MAX_IMAGES + 1];
        assert!(validate_from_worker(&done(None, many), budget).is_err());
        let big = Some("A".repeat(4000));
        assert!(validate_from_worker(&done(None, vec![image("a.png", big)]), budget).is_err());
        let fits = Some("QUFB".repeat(250)); // 1000 bytes of base64 for 750 bytes of data
        assert!(validate_from_worker(&done(None, vec![image("a.png", fits)]), budget).is_ok());
        let junk = Some("!!!!".into());
        assert!(validate_from_worker(&done(None, vec![image("a.png", junk)]), budget).is_err());
        let outside = vec![image("/home/u/.ssh/id_rsa", None)];
        assert!(validate_from_worker(&done(None, outside), budget).is_err());
        let mut odd = image("a.png", None);
        odd.mime = "text/html".into();
        assert!(validate_from_worker(&done(None, vec![odd]), budget).is_err());
    }

    #[test]
    fn garbage_unknown_kinds_and_bad_requests_are_violations() {
        assert!(decode_worker_frame(b"", 0).is_err());
        assert!(decode_worker_frame(b"Xabc", 0).is_err());
        assert!(decode_worker_frame(b"J{not json", 0).is_err());
        assert!(decode_worker_frame(br#"J{"op":"launch"}"#, 0).is_err());
        assert!(
            decode_worker_frame(
                br#"J{"op":"request","id":1,"method":"../x","params":{}}"#,
                0
            )
            .is_err()
        );
        assert!(
            decode_worker_frame(
                br#"J{"op":"request","id":1,"method":"call","params":[]}"#,
                0
            )
            .is_err()
        );
        assert!(matches!(
            decode_worker_frame(
                br#"J{"op":"request","id":1,"method":"call","params":{}}"#,
                0
            ),
            Ok(WorkerFrame::Message(FromWorker::Request { id: 1, .. }))
        ));
        assert!(matches!(
            decode_worker_frame(b"Ohi", 0),
            Ok(WorkerFrame::Stdout(b"hi"))
        ));
    }

    use proptest::prelude::*;

    fn any_image() -> impl Strategy<Value = CellImage> {
        (
            "[a-z./]{0,12}",
            prop::sample::select(vec!["image/png", "image/gif", "text/plain"]),
            any::<u64>(),
            proptest::option::of(any::<u32>()),
            proptest::option::of("[A-Za-z0-9+/=!]{0,64}"),
        )
            .prop_map(|(path, mime, bytes, width, data)| CellImage {
                path,
                mime: mime.into(),
                bytes,
                width,
                height: width,
                data,
            })
    }

    fn any_message() -> impl Strategy<Value = FromWorker> {
        let text = || proptest::option::of(".{0,40}");
        prop_oneof![
            (
                any::<i32>(),
                prop::collection::vec(".{0,20}", 0..3),
                any::<u64>()
            )
                .prop_map(|(pid, missing_layers, lockdown_us)| FromWorker::Ready {
                    pid,
                    missing_layers,
                    lockdown_us,
                    notes: Vec::new(),
                }),
            ".{0,60}".prop_map(|message| FromWorker::Fatal { message }),
            (any::<u64>(), "[a-z_/.]{0,10}", any::<bool>()).prop_map(|(id, method, obj)| {
                let params = if obj {
                    serde_json::json!({"q": method})
                } else {
                    serde_json::json!([1])
                };
                FromWorker::Request { id, method, params }
            }),
            (
                any::<u64>(),
                prop::sample::select(vec![
                    CellStatus::Ok,
                    CellStatus::Error,
                    CellStatus::Interrupted,
                    CellStatus::Exit
                ]),
                text(),
                proptest::option::of((".{0,10}", ".{0,40}", ".{0,40}")),
                proptest::option::of(any::<i64>()),
                prop::collection::vec(any_image(), 0..4),
            )
                .prop_map(|(id, status, result, error, exit_code, images)| {
                    FromWorker::Done {
                        id,
                        status,
                        result,
                        error: error.map(|(kind, message, traceback)| PyErrorInfo {
                            kind,
                            message,
                            traceback,
                        }),
                        exit_code,
                        images,
                    }
                }),
        ]
    }

    proptest! {
        /// Any byte string is either a clean error or a frame; never a panic, never a frame
        /// longer than the input, never an allocation of what a forged length claims.
        #[test]
        fn reading_arbitrary_bytes_never_panics(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
            let mut r = &bytes[..];
            let mut frames = 0;
            while let Ok(Some((_, payload))) = read_frame(&mut r) {
                prop_assert!(payload.len() < bytes.len());
                frames += 1;
                prop_assert!(frames <= bytes.len());
            }
        }

        /// Any frame body decodes or is a violation, never a panic.
        #[test]
        fn decoding_arbitrary_bodies_never_panics(kind in any::<u8>(), payload in prop::collection::vec(any::<u8>(), 0..256)) {
            let mut body = vec![kind];
            body.extend(&payload);
            match decode_worker_frame(&body, 1024) {
                Ok(WorkerFrame::Stdout(b)) | Ok(WorkerFrame::Stderr(b)) => prop_assert_eq!(b, &payload[..]),
                Ok(WorkerFrame::Message(_)) => prop_assert_eq!(kind, KIND_JSON),
                Err(v) => prop_assert!(v.to_string().starts_with("protocol violation: ")),
            }
        }

        /// Any JSON text in a control frame is parsed without panicking.
        #[test]
        fn decoding_arbitrary_json_never_panics(text in r#"\{"op":"(ready|fatal|request|done)"(,"[a-z_]{1,8}":("[^"\\]{0,8}"|-?[0-9]{1,20}|\[\]|\{\}|null|true))*\}"#) {
            let mut body = vec![KIND_JSON];
            body.extend(text.as_bytes());
            let _ = decode_worker_frame(&body, 1024);
        }

        /// Every message a worker can produce survives the wire, and the host's verdict on it
        /// does not change in transit; accepted images always name a path inside the session.
        #[test]
        fn every_message_round_trips_and_accepted_paths_stay_inside(msg in any_message()) {
            // The host's `json_body`, spelled out: it needs the `host` feature, which
            // `cargo test -p ironcell-core` alone does not turn on.
            let mut body = vec![KIND_JSON];
            serde_json::to_writer(&mut body, &msg).unwrap();
            let mut wire = Vec::new();
            write_frame(&mut wire, body[0], &body[1..]).unwrap();
            let (kind, payload) = read_frame(&mut &wire[..]).unwrap().unwrap();
            let mut again = vec![kind];
            again.extend(payload);
            let verdict = validate_from_worker(&msg, 1024).is_ok();
            match decode_worker_frame(&again, 1024) {
                Ok(WorkerFrame::Message(m)) => {
                    prop_assert!(verdict);
                    prop_assert_eq!(format!("{m:?}"), format!("{msg:?}"));
                    if let FromWorker::Done { images, .. } = m {
                        for img in images {
                            prop_assert!(!img.path.starts_with('/'));
                            prop_assert!(!img.path.split('/').any(|s| s == ".." || s.is_empty()));
                        }
                    }
                }
                Ok(_) => prop_assert!(false, "a control message decoded as output"),
                Err(_) => prop_assert!(!verdict),
            }
        }
    }
}
