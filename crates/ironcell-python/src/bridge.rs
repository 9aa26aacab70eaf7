//! The native half of the in-sandbox `mcp` module (`_ironcell_bridge`, the module this
//! extension defines; the boot script loads it into the zygote before anything else).
//!
//! Python code calls `request(method, params_json)` (blocking, GIL released) or
//! `submit(method, params_json, callback)` (the callback runs on the worker's reader thread with
//! the answer; `mcp` turns it into an asyncio future with `call_soon_threadsafe`). Requests
//! travel to the host as `request` frames on the session socket; the host's answer arrives as a
//! `response` frame, which the worker's reader thread hands to [`resolve`]. At most
//! [`MAX_INFLIGHT_REQUESTS`] requests are open at once; further ones queue in the worker.

use std::collections::{HashMap, HashSet, VecDeque};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use pyo3::exceptions::{PyConnectionError, PyValueError};
use pyo3::prelude::*;

use ironcell_core::bridge::BridgeError;
use ironcell_core::frame::{self, FromWorker, KIND_JSON, MAX_INFLIGHT_REQUESTS};

enum Waiter {
    Blocking(mpsc::Sender<String>),
    Callback(Py<PyAny>),
}

struct Bridge {
    writer: Arc<Mutex<UnixStream>>,
    pending: Mutex<Pending>,
    next_id: AtomicU64,
}

/// Requests in flight. At most [`MAX_INFLIGHT_REQUESTS`] are sent and unanswered at once (the
/// host holds the worker to that); more wait here, in order, and go out as answers come in. So
/// `asyncio.gather` over hundreds of calls just works, at the pace of the upstream.
/// Generic in who waits, so its bookkeeping is tested without an interpreter.
struct Pending<W = Waiter> {
    waiters: HashMap<u64, W>,
    /// Sent and not yet answered (even if their waiter gave up): what the host counts.
    open: HashSet<u64>,
    queued: VecDeque<(u64, Vec<u8>)>,
}

static BRIDGE: OnceLock<Bridge> = OnceLock::new();

impl<W> Default for Pending<W> {
    fn default() -> Self {
        Pending {
            waiters: HashMap::new(),
            open: HashSet::new(),
            queued: VecDeque::new(),
        }
    }
}

impl<W> Pending<W> {
    /// Takes request `id`: `Some(body)` to send now (a slot is free and nothing waits before
    /// it), else `None` (queued, in order).
    fn admit(&mut self, id: u64, body: Vec<u8>, waiter: W) -> Option<Vec<u8>> {
        self.waiters.insert(id, waiter);
        if self.open.len() < MAX_INFLIGHT_REQUESTS && self.queued.is_empty() {
            self.open.insert(id);
            Some(body)
        } else {
            self.queued.push_back((id, body));
            None
        }
    }

    /// The host answered `id`: its waiter (if it still waits), and the next queued request
    /// whose caller still waits, to send in the slot the answer freed.
    fn settle(&mut self, id: u64) -> (Option<W>, Option<(u64, Vec<u8>)>) {
        let waiter = self.waiters.remove(&id);
        let mut next = None;
        if self.open.remove(&id) {
            while let Some((qid, body)) = self.queued.pop_front() {
                if self.waiters.contains_key(&qid) {
                    self.open.insert(qid);
                    next = Some((qid, body));
                    break;
                }
            }
        }
        (waiter, next)
    }

    /// The caller of `id` gave up: a queued request is dropped; a sent one stays open (the
    /// host counts it) until its answer comes.
    fn abandon(&mut self, id: u64) {
        self.waiters.remove(&id);
        self.queued.retain(|(qid, _)| *qid != id);
    }
}

/// The `request` frame's JSON for call `id` (what the host decodes with
/// `ironcell_core::frame::decode_worker_frame`), or why `params_json` cannot go.
fn request_body(id: u64, method: &str, params_json: &str) -> Result<Vec<u8>, String> {
    let params: serde_json::Value = serde_json::from_str(params_json)
        .map_err(|e| format!("arguments are not JSON-serializable: {e}"))?;
    let msg = FromWorker::Request {
        id,
        method: method.to_string(),
        params,
    };
    serde_json::to_vec(&msg).map_err(|e| e.to_string())
}

impl Bridge {
    fn pending(&self) -> MutexGuard<'_, Pending> {
        crate::lock(&self.pending)
    }

    /// Writes one request frame. Called without the GIL: the write can wait on the host.
    fn write(&self, body: &[u8]) -> std::io::Result<()> {
        // Its answer must be read even if the main thread is busy running a cell.
        crate::worker::reader_needed();
        let mut w = crate::lock(&self.writer);
        frame::write_frame(&mut *w, KIND_JSON, body)
    }
}

/// Whether a request was sent and not yet answered.
pub fn has_open_requests() -> bool {
    BRIDGE.get().is_some_and(|b| !b.pending().open.is_empty())
}

/// Connects the bridge to the worker's session socket. Called once per worker.
pub fn connect(writer: Arc<Mutex<UnixStream>>) {
    let _ = BRIDGE.set(Bridge {
        writer,
        pending: Mutex::new(Pending::default()),
        next_id: AtomicU64::new(1),
    });
}

/// Delivers the host's answer (a JSON object with `result` or `error`) to whoever waits for it,
/// and sends the next queued request in the slot it frees. Runs on the reader thread.
pub fn resolve(id: u64, payload: String) {
    let Some(bridge) = BRIDGE.get() else { return };
    let (waiter, next) = bridge.pending().settle(id);
    match waiter {
        Some(Waiter::Blocking(tx)) => {
            let _ = tx.send(payload);
        }
        Some(Waiter::Callback(cb)) => Python::attach(|py| {
            if let Err(e) = cb.call1(py, (payload,)) {
                e.print(py);
            }
        }),
        None => {}
    }
    if let Some((qid, body)) = next
        && let Err(e) = bridge.write(&body)
    {
        let msg = format!("sending a queued call to the ironcell host failed: {e}");
        resolve_with_error(qid, &msg);
    }
}

fn resolve_with_error(id: u64, message: &str) {
    resolve(id, BridgeError::unavailable(message).payload().to_string());
}

/// Fails every waiting request (the host went away; in a fork, the parent's). Returns how many
/// were sent or queued and not answered.
pub fn fail_all(reason: &str) -> usize {
    let Some(bridge) = BRIDGE.get() else { return 0 };
    let (open, waiters): (usize, Vec<(u64, Waiter)>) = {
        let mut p = bridge.pending();
        let open = p.open.len() + p.queued.len();
        p.open.clear();
        p.queued.clear();
        (open, p.waiters.drain().collect())
    };
    let payload = BridgeError::unavailable(reason).payload().to_string();
    for (_, w) in waiters {
        match w {
            Waiter::Blocking(tx) => {
                let _ = tx.send(payload.clone());
            }
            Waiter::Callback(cb) => Python::attach(|py| {
                let _ = cb.call1(py, (payload.clone(),));
            }),
        }
    }
    open
}

/// Forgets a request whose caller gave up (KeyboardInterrupt). One already sent stays open
/// until the host answers it, since the host still counts it.
fn abandon(id: u64) {
    if let Some(b) = BRIDGE.get() {
        b.pending().abandon(id);
    }
}

fn send(py: Python<'_>, method: &str, params_json: &str, waiter: Waiter) -> PyResult<u64> {
    let bridge = BRIDGE
        .get()
        .ok_or_else(|| PyConnectionError::new_err("the mcp bridge is not connected"))?;
    let id = bridge.next_id.fetch_add(1, Ordering::Relaxed);
    let body = request_body(id, method, params_json).map_err(PyValueError::new_err)?;
    let send_now = bridge.pending().admit(id, body, waiter);
    if let Some(body) = send_now {
        // Without the GIL: while this write waits for the host, the reader thread must be able
        // to run answer callbacks, or neither side would read.
        let sent = py.detach(|| bridge.write(&body));
        if let Err(e) = sent {
            let mut p = bridge.pending();
            p.waiters.remove(&id);
            p.open.remove(&id);
            return Err(PyConnectionError::new_err(format!(
                "sending to the ironcell host failed: {e}"
            )));
        }
    }
    Ok(id)
}

/// The extension module: the zygote's entry point and the worker's bridge to the host.
#[pymodule]
pub mod _ironcell_bridge {
    use super::*;

    #[pymodule_export]
    use crate::zygote::zygote_main;

    /// Sends a request to the host and blocks (without the GIL) until it answers. A
    /// KeyboardInterrupt (timeout or cancel) ends the wait.
    #[pyfunction]
    fn request(py: Python<'_>, method: &str, params_json: &str) -> PyResult<String> {
        use crate::worker::{MainWait, Waited};
        const STEP: Duration = Duration::from_millis(50);
        let (tx, mut rx) = mpsc::channel();
        // The cell's own thread with nobody reading the socket (or a thread that already
        // reads it) reads its answer itself; any other thread waits for the reader's hand-off.
        // Claimed before the request goes out: its answer must find a reader.
        let mut reading = MainWait::claim();
        let id = send(py, method, params_json, Waiter::Blocking(tx))?;
        loop {
            // Both move into the GIL-free closure and back (Send, not Sync).
            let (waited, back) = py.detach(move || {
                let waited = match &reading {
                    Some(wait) => wait.wait(&rx, STEP),
                    None => match rx.recv_timeout(STEP) {
                        Ok(payload) => Waited::Answer(payload),
                        Err(mpsc::RecvTimeoutError::Timeout) => Waited::Nothing,
                        Err(mpsc::RecvTimeoutError::Disconnected) => Waited::Closed,
                    },
                };
                (waited, (reading, rx))
            });
            (reading, rx) = back;
            match waited {
                Waited::Answer(payload) => return Ok(payload),
                Waited::Nothing => {
                    if let Err(e) = py.check_signals() {
                        abandon(id);
                        return Err(e);
                    }
                }
                // Every waiter, this one included, was told why, unless the bridge itself is
                // gone.
                Waited::Closed => {
                    return rx
                        .try_recv()
                        .map_err(|_| PyConnectionError::new_err("the ironcell host went away"));
                }
            }
        }
    }

    /// Before a worker's first cell that looks like a plot: writes ahead, without the GIL, the
    /// pages a first plot copies (`ironcell_core::prefault`). Returns how many; 0 after the
    /// first call, or with nothing to write.
    #[pyfunction]
    fn write_plot_pages_ahead(py: Python<'_>) -> usize {
        py.detach(crate::plot_probe::write_plot_pages_ahead)
    }

    /// Whether a cell looks like a first plot (`ironcell_core::prefault::PLOT_WORDS`; the host
    /// decides by the same words which spare a new session takes).
    #[pyfunction]
    fn looks_like_a_plot(code: &str) -> bool {
        ironcell_core::prefault::looks_like_a_plot(code)
    }

    /// `os._exit` in a worker: what it wrote to fd 1 and fd 2 reaches the host first
    /// (`worker::exit_after_output`).
    #[pyfunction]
    fn exit_after_output(py: Python<'_>, status: i32) {
        crate::worker::exit_after_output(py, status)
    }

    /// Sends a request; `callback(payload)` is called on the bridge thread with the answer.
    #[pyfunction]
    fn submit(
        py: Python<'_>,
        method: &str,
        params_json: &str,
        callback: Py<PyAny>,
    ) -> PyResult<()> {
        send(py, method, params_json, Waiter::Callback(callback)).map(|_| ())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ironcell_core::bridge::{Method, ProxyRequest, Request};
    use ironcell_core::frame::{WorkerFrame, decode_worker_frame, read_frame, write_frame};
    use serde_json::json;

    /// What the host makes of a request this side sends: framed, read, decoded and parsed as
    /// the session's reader does.
    fn as_the_host_reads_it(id: u64, method: &str, params_json: &str) -> (u64, Request) {
        let body = request_body(id, method, params_json).unwrap();
        let mut wire = Vec::new();
        write_frame(&mut wire, KIND_JSON, &body).unwrap();
        let (kind, payload) = read_frame(&mut wire.as_slice()).unwrap().unwrap();
        let framed = [&[kind][..], &payload].concat();
        match decode_worker_frame(&framed, 0).unwrap() {
            WorkerFrame::Message(FromWorker::Request { id, method, params }) => {
                (id, Request::parse(&method, params).unwrap())
            }
            _ => panic!("not a request frame"),
        }
    }

    #[test]
    fn a_request_reaches_the_host_as_the_typed_request_of_the_contract() {
        let (id, request) = as_the_host_reads_it(
            7,
            "call",
            r#"{"server": "files", "tool": "read", "arguments": {"path": "a.txt", "n": [1, 2]}}"#,
        );
        assert_eq!(id, 7);
        assert_eq!(
            request,
            Request::Proxy(ProxyRequest::Call {
                server: "files".into(),
                tool: "read".into(),
                arguments: json!({"path": "a.txt", "n": [1, 2]}),
            })
        );
        // Every method of the contract, by the name this side sends, is one the host knows.
        for method in Method::ALL {
            let name = method.wire_name();
            let body = request_body(1, &name, "{}").unwrap();
            let sent: serde_json::Value = serde_json::from_slice(&body).unwrap();
            assert_eq!(sent["method"], json!(name));
            assert_eq!(Method::parse(&name).unwrap(), method);
        }
    }

    #[test]
    fn arguments_that_are_not_json_are_refused_before_anything_is_sent() {
        let e = request_body(1, "call", "{\"server\": ").unwrap_err();
        assert!(
            e.starts_with("arguments are not JSON-serializable: "),
            "{e}"
        );
    }

    /// A waiter as a blocking `request` has one (a `Waiter` can hold a Python callback, which
    /// needs an interpreter to drop).
    type Pending = super::Pending<mpsc::Sender<String>>;

    fn waiter() -> (mpsc::Sender<String>, mpsc::Receiver<String>) {
        mpsc::channel()
    }

    /// Answers `id` and tells its waiter, if it still waits, as `resolve` does.
    fn answer(p: &mut Pending, id: u64) -> Option<(u64, Vec<u8>)> {
        let (w, next) = p.settle(id);
        if let Some(tx) = w {
            let _ = tx.send(format!("answer {id}"));
        }
        next
    }

    #[test]
    fn at_most_the_inflight_limit_is_open_and_the_rest_go_out_in_order() {
        let mut p = Pending::default();
        let max = MAX_INFLIGHT_REQUESTS as u64;
        let mut receivers = Vec::new();
        for id in 1..=max + 3 {
            let (w, rx) = waiter();
            receivers.push(rx);
            let now = p.admit(id, id.to_le_bytes().to_vec(), w);
            assert_eq!(now.is_some(), id <= max, "request {id}");
        }
        assert_eq!(p.open.len(), MAX_INFLIGHT_REQUESTS);
        // An answer frees a slot for the oldest queued request, body and all.
        assert_eq!(
            answer(&mut p, 1),
            Some((max + 1, (max + 1).to_le_bytes().to_vec()))
        );
        assert_eq!(receivers[0].try_recv().unwrap(), "answer 1");
        // A queued request whose caller gave up is never sent.
        p.abandon(max + 2);
        assert_eq!(answer(&mut p, 2).map(|(id, _)| id), Some(max + 3));
        // A sent one whose caller gave up keeps its slot until the host answers it.
        p.abandon(3);
        assert!(p.open.contains(&3));
        assert_eq!(answer(&mut p, 3), None);
        assert!(!p.open.contains(&3));
        assert!(
            receivers[2].try_recv().is_err(),
            "nobody waits for 3 any more"
        );
        assert!(p.open.len() <= MAX_INFLIGHT_REQUESTS);
        assert!(p.queued.is_empty());
    }

    #[test]
    fn an_answer_to_no_open_request_frees_no_slot() {
        let mut p = Pending::default();
        for id in 1..=MAX_INFLIGHT_REQUESTS as u64 + 1 {
            p.admit(id, Vec::new(), waiter().0);
        }
        // Not sent yet (queued), or never asked: neither frees a slot for the queue.
        assert!(answer(&mut p, MAX_INFLIGHT_REQUESTS as u64 + 1).is_none());
        assert!(answer(&mut p, 999_999).is_none());
        assert_eq!(p.open.len(), MAX_INFLIGHT_REQUESTS);
    }
}
