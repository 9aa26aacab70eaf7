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
#[derive(Default)]
struct Pending {
    waiters: HashMap<u64, Waiter>,
    /// Sent and not yet answered (even if their waiter gave up): what the host counts.
    open: HashSet<u64>,
    queued: VecDeque<(u64, Vec<u8>)>,
}

static BRIDGE: OnceLock<Bridge> = OnceLock::new();

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
    let (waiter, next) = {
        let mut p = bridge.pending();
        let waiter = p.waiters.remove(&id);
        let mut next = None;
        if p.open.remove(&id) {
            while let Some((qid, body)) = p.queued.pop_front() {
                if p.waiters.contains_key(&qid) {
                    p.open.insert(qid);
                    next = Some((qid, body));
                    break;
                }
            }
        }
        (waiter, next)
    };
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

/// Fails every waiting request (the host went away).
pub fn fail_all(reason: &str) {
    let Some(bridge) = BRIDGE.get() else { return };
    let waiters: Vec<(u64, Waiter)> = {
        let mut p = bridge.pending();
        p.open.clear();
        p.queued.clear();
        p.waiters.drain().collect()
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
}

/// Forgets a request whose caller gave up (KeyboardInterrupt). One already sent stays open
/// until the host answers it, since the host still counts it.
fn abandon(id: u64) {
    if let Some(b) = BRIDGE.get() {
        let mut p = b.pending();
        p.waiters.remove(&id);
        p.queued.retain(|(qid, _)| *qid != id);
    }
}

fn send(py: Python<'_>, method: &str, params_json: &str, waiter: Waiter) -> PyResult<u64> {
    let bridge = BRIDGE
        .get()
        .ok_or_else(|| PyConnectionError::new_err("the mcp bridge is not connected"))?;
    let params: serde_json::Value = serde_json::from_str(params_json)
        .map_err(|e| PyValueError::new_err(format!("arguments are not JSON-serializable: {e}")))?;
    let id = bridge.next_id.fetch_add(1, Ordering::Relaxed);
    let msg = FromWorker::Request {
        id,
        method: method.to_string(),
        params,
    };
    let body = serde_json::to_vec(&msg).map_err(|e| PyValueError::new_err(e.to_string()))?;
    let send_now = {
        let mut p = bridge.pending();
        p.waiters.insert(id, waiter);
        if p.open.len() < MAX_INFLIGHT_REQUESTS && p.queued.is_empty() {
            p.open.insert(id);
            Some(body)
        } else {
            p.queued.push_back((id, body));
            None
        }
    };
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
        py.detach(crate::zygote::write_plot_pages_ahead)
    }

    /// Whether a cell looks like a first plot (`ironcell_core::prefault::PLOT_WORDS`; the host
    /// decides by the same words which spare a new session takes).
    #[pyfunction]
    fn looks_like_a_plot(code: &str) -> bool {
        ironcell_core::prefault::looks_like_a_plot(code)
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
