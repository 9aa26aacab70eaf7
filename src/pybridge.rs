//! The native half of the in-sandbox `mcp` module (`_ironcell_bridge`), registered with
//! `append_to_inittab!` before the zygote's interpreter starts.
//!
//! Python code calls `request(method, params_json)` (blocking, GIL released) or
//! `submit(method, params_json, callback)` (the callback runs on the worker's reader thread with
//! the answer; `mcp` turns it into an asyncio future with `call_soon_threadsafe`). Requests
//! travel to the host as `request` frames on the session socket; the host's answer arrives as a
//! `response` frame, which the worker's reader thread hands to [`resolve`].

use std::collections::HashMap;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use pyo3::exceptions::{PyConnectionError, PyValueError};
use pyo3::prelude::*;

use crate::frame::{self, FromWorker, KIND_JSON};

enum Waiter {
    Blocking(mpsc::Sender<String>),
    Callback(Py<PyAny>),
}

struct Bridge {
    writer: Arc<Mutex<UnixStream>>,
    pending: Mutex<HashMap<u64, Waiter>>,
    next_id: AtomicU64,
}

static BRIDGE: OnceLock<Bridge> = OnceLock::new();

/// Connects the bridge to the worker's session socket. Called once per worker.
pub fn connect(writer: Arc<Mutex<UnixStream>>) {
    let _ = BRIDGE.set(Bridge {
        writer,
        pending: Mutex::new(HashMap::new()),
        next_id: AtomicU64::new(1),
    });
}

/// Delivers the host's answer (a JSON object with `result` or `error`) to whoever waits for it.
pub fn resolve(id: u64, payload: String) {
    let Some(bridge) = BRIDGE.get() else { return };
    let waiter = bridge.pending.lock().ok().and_then(|mut p| p.remove(&id));
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
}

/// Fails every waiting request (the host went away).
pub fn fail_all(reason: &str) {
    let Some(bridge) = BRIDGE.get() else { return };
    let waiters: Vec<(u64, Waiter)> = match bridge.pending.lock() {
        Ok(mut p) => p.drain().collect(),
        Err(_) => return,
    };
    let payload =
        serde_json::json!({"error": {"kind": "unavailable", "message": reason}}).to_string();
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

fn send(method: &str, params_json: &str, waiter: Waiter) -> PyResult<u64> {
    let bridge = BRIDGE
        .get()
        .ok_or_else(|| PyConnectionError::new_err("the mcp bridge is not connected"))?;
    let params: serde_json::Value = serde_json::from_str(params_json)
        .map_err(|e| PyValueError::new_err(format!("arguments are not JSON-serializable: {e}")))?;
    let id = bridge.next_id.fetch_add(1, Ordering::Relaxed);
    if let Ok(mut p) = bridge.pending.lock() {
        p.insert(id, waiter);
    }
    let msg = FromWorker::Request {
        id,
        method: method.to_string(),
        params,
    };
    let body = serde_json::to_vec(&msg).map_err(|e| PyValueError::new_err(e.to_string()))?;
    let sent = bridge
        .writer
        .lock()
        .map_err(|_| PyConnectionError::new_err("session socket lock poisoned"))
        .and_then(|mut w| {
            frame::write_frame(&mut *w, KIND_JSON, &body)
                .map_err(|e| PyConnectionError::new_err(e.to_string()))
        });
    if let Err(e) = sent {
        if let Ok(mut p) = bridge.pending.lock() {
            p.remove(&id);
        }
        return Err(e);
    }
    Ok(id)
}

#[pymodule]
pub mod _ironcell_bridge {
    use super::*;

    /// Sends a request to the host and blocks (without the GIL) until it answers. A
    /// KeyboardInterrupt (timeout or cancel) ends the wait.
    #[pyfunction]
    fn request(py: Python<'_>, method: &str, params_json: &str) -> PyResult<String> {
        let (tx, mut rx) = mpsc::channel();
        let id = send(method, params_json, Waiter::Blocking(tx))?;
        loop {
            // The receiver moves into the GIL-free closure and back (it is Send, not Sync).
            let (waited, back) =
                py.detach(move || (rx.recv_timeout(Duration::from_millis(50)), rx));
            rx = back;
            match waited {
                Ok(payload) => return Ok(payload),
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    if let Err(e) = py.check_signals() {
                        if let Some(b) = BRIDGE.get()
                            && let Ok(mut p) = b.pending.lock()
                        {
                            p.remove(&id);
                        }
                        return Err(e);
                    }
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    return Err(PyConnectionError::new_err("the ironcell host went away"));
                }
            }
        }
    }

    /// Sends a request; `callback(payload)` is called on the bridge thread with the answer.
    #[pyfunction]
    fn submit(method: &str, params_json: &str, callback: Py<PyAny>) -> PyResult<()> {
        send(method, params_json, Waiter::Callback(callback)).map(|_| ())
    }
}
