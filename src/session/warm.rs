//! Waking the worker a request will run on as soon as its line arrives, before it is parsed
//! (docs/PERFORMANCE.md, "After idle"): after an idle pause the code a cell runs has gone cold
//! on both sides, and the worker's part ran only after the host's; now it runs on the other
//! CPU while the host parses the request and runs the handler.

use memchr::memmem;

use std::time::Duration;

use super::{SessionManager, valid_session_name};
use crate::lock;

/// A session used more recently than this is not warmed: its code is still in the caches (back
/// to back, a warm call's whole round trip is ~0.3 ms), and the wake-up would only cost.
const WARM_AFTER_IDLE: Duration = Duration::from_millis(2);

impl SessionManager {
    /// Called with each line the client sends, before it is parsed: for a `tools/call`, tells
    /// the worker it will most likely run on that a run is coming ([`super::LiveWorker::warm`]):
    /// the named session's worker if it waits between cells, or, for a session without a
    /// worker, the spare a new session takes. A guess from the raw bytes, used for nothing
    /// else: a wrong guess warms a worker for nothing. Never waits: a session whose state is
    /// held (a cell runs, a worker is being set up) is left alone.
    pub fn warm_for_request(&self, line: &[u8]) {
        if memmem::find(line, b"\"tools/call\"").is_none() {
            return;
        }
        let name = session_named_in(line).unwrap_or("default");
        let session = lock(&self.sessions).get(name).cloned();
        if let Some(session) = session {
            if lock(&session.last_used).elapsed() < WARM_AFTER_IDLE {
                return;
            }
            let Ok(state) = session.state.try_lock() else {
                return;
            };
            if let Some(worker) = &state.worker {
                worker.warm();
                return;
            }
        }
        self.pool.warm_next_spare();
    }
}

/// The value of the first `"session"` key in a raw JSON line, if it is a plain string that is a
/// valid session name (no escapes: a valid name needs none).
fn session_named_in(line: &[u8]) -> Option<&str> {
    const KEY: &[u8] = b"\"session\"";
    let at = memmem::find(line, KEY)? + KEY.len();
    let rest = line[at..].trim_ascii_start().strip_prefix(b":")?;
    let rest = rest.trim_ascii_start().strip_prefix(b"\"")?;
    let end = memchr::memchr(b'"', &rest[..rest.len().min(65)])?;
    let name = std::str::from_utf8(&rest[..end]).ok()?;
    valid_session_name(name).then_some(name)
}

#[cfg(test)]
mod tests {
    use super::session_named_in;

    #[test]
    fn the_session_is_read_from_the_raw_line_when_it_is_a_plain_valid_name() {
        let call = |args: &str| {
            format!(
                r#"{{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{{"name":"run_python","arguments":{args}}}}}"#
            )
        };
        let named = |args: &str| session_named_in(call(args).as_bytes()).map(str::to_owned);
        assert_eq!(
            named(r#"{"code":"1","session":"s-1.a_b"}"#).as_deref(),
            Some("s-1.a_b")
        );
        assert_eq!(
            named(r#"{"session" : "x", "code":"1"}"#).as_deref(),
            Some("x")
        );
        assert_eq!(named(r#"{"code":"print(\"session\")"}"#), None);
        assert_eq!(named(r#"{"code":"1","session":null}"#), None);
        assert_eq!(named(r#"{"code":"1","session":"a/b"}"#), None);
        assert_eq!(named(r#"{"code":"1","session":"a\"b"}"#), None);
        assert_eq!(
            named(&format!(r#"{{"session":"{}"}}"#, "a".repeat(65))),
            None
        );
        assert_eq!(
            named(&format!(r#"{{"session":"{}"}}"#, "a".repeat(64))).map(|n| n.len()),
            Some(64)
        );
        assert_eq!(session_named_in(br#"{"session":"#), None);
    }
}
