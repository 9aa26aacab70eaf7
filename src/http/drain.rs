//! The graceful drain of `serve --http` on SIGTERM, for load balancers and Kubernetes.
//!
//! From the signal on:
//! 1. `/healthz` answers 503, so a balancer's health check (or a readiness probe) stops sending
//!    this replica new traffic;
//! 2. a request that would start new work here (`initialize`, a new protocol session; or a
//!    `tools/call` of anything but `run_python_job`, a new run) is answered 503 with
//!    `Retry-After`, before anything runs: a balancer that retries on 503 (deploy/haproxy)
//!    sends it to another replica, where the client's session is new. Everything that finishes
//!    work already started here is still served: requests in flight, job polls and cancels,
//!    `tasks/*`, listings, closing a protocol session;
//! 3. once no run is going on (background jobs included) and no request is in flight, or when
//!    the grace period (`--drain-grace`) is over, the server stops: runs still going are
//!    stopped with their workers. A second signal stops at once.
//!
//! The body of a `POST /mcp` is read here only while draining, bounded like rmcp bounds it.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::extract::Request;
use axum::http::{HeaderValue, Method, StatusCode, header};
use axum::response::{IntoResponse, Response};
use futures::StreamExt;

/// Whether the server is draining, and how many `/mcp` requests are in flight.
#[derive(Default)]
pub struct Drain {
    draining: AtomicBool,
    in_flight: AtomicUsize,
}

/// One `/mcp` request in flight, until its response body has been sent (or dropped).
pub struct InFlight(Arc<Drain>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Drain {
    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst)
    }

    pub fn start(&self) {
        self.draining.store(true, Ordering::SeqCst);
    }

    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::SeqCst)
    }

    /// Counts a request in flight until the returned guard is dropped.
    pub fn enter(self: &Arc<Self>) -> InFlight {
        self.in_flight.fetch_add(1, Ordering::SeqCst);
        InFlight(self.clone())
    }
}

/// `response` with `guard` held until its body has been sent: a streamed (SSE) answer counts
/// as in flight until its last event. Any other answer is whole already (and keeps its
/// `Content-Length`): the guard ends here, and the server's graceful end sends it.
pub fn hold_until_sent(response: Response, guard: InFlight) -> Response {
    let streamed = response
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|t| t.as_bytes().starts_with(b"text/event-stream"));
    if !streamed {
        return response;
    }
    let (parts, body) = response.into_parts();
    let stream = body.into_data_stream().map(move |chunk| {
        let _held = &guard;
        chunk
    });
    Response::from_parts(parts, Body::from_stream(stream))
}

/// While draining: the request unchanged if it finishes work already started here, or the 503
/// that sends it elsewhere. Its body is read (at most `max_body` bytes) to tell which.
pub async fn screen(req: Request, max_body: usize) -> Result<Request, Response> {
    if req.method() != Method::POST {
        return Ok(req);
    }
    let (parts, body) = req.into_parts();
    let bytes: Bytes = match axum::body::to_bytes(body, max_body).await {
        Ok(b) => b,
        Err(_) => return Err(refusal(None)),
    };
    if let Some(id) = starts_work(&bytes) {
        tracing::info!("draining: refused new work with 503 (a balancer retries it elsewhere)");
        return Err(refusal(Some(id)));
    }
    Ok(Request::from_parts(parts, Body::from(bytes)))
}

/// The JSON-RPC id of a request that would start new work here (`Value::Null` if it has none),
/// or `None` if it only finishes work already started (or is not JSON-RPC at all: rmcp answers
/// that as usual).
fn starts_work(body: &[u8]) -> Option<serde_json::Value> {
    #[derive(serde::Deserialize)]
    struct Message {
        #[serde(default)]
        id: serde_json::Value,
        method: Option<String>,
        #[serde(default)]
        params: Option<Params>,
    }
    #[derive(serde::Deserialize)]
    struct Params {
        name: Option<String>,
    }
    let msg: Message = serde_json::from_slice(body).ok()?;
    let new_work = match msg.method.as_deref()? {
        "initialize" => true,
        "tools/call" => {
            msg.params.and_then(|p| p.name).as_deref() != Some(crate::server::JOB_TOOL_NAME)
        }
        _ => false,
    };
    new_work.then_some(msg.id)
}

/// 503 with `Retry-After` and a JSON-RPC error a client can show.
pub fn refusal(id: Option<serde_json::Value>) -> Response {
    let body = serde_json::json!({
        "jsonrpc": "2.0",
        "id": id.unwrap_or(serde_json::Value::Null),
        "error": {
            "code": -32000,
            "message": "this ironcell server is shutting down and takes no new runs or sessions; \
                        send the request again (behind a load balancer it goes to another \
                        replica, where your session is new)",
        },
    });
    let mut response = (
        StatusCode::SERVICE_UNAVAILABLE,
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response();
    response
        .headers_mut()
        .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    response
}

/// Resolves when the server should stop: at the first signal the drain starts; then once
/// drained, at the grace's end (runs still going are stopped first, and their answers get a
/// moment to leave) or at a second signal. `stop` is then cancelled (rmcp's sessions end).
pub async fn on_signal(
    drain: Arc<Drain>,
    worlds: Arc<super::principals::Worlds>,
    grace: Duration,
    stop: tokio_util::sync::CancellationToken,
    (mut sigterm, mut sigint): (tokio::signal::unix::Signal, tokio::signal::unix::Signal),
) {
    tokio::select! {
        _ = sigterm.recv() => {}
        _ = sigint.recv() => {}
    }
    drain.start();
    tracing::warn!(
        runs = worlds.runs_in_progress(),
        "draining: /healthz answers 503, new runs and sessions get 503; runs going on may \
         finish within {grace:?} (a second signal stops at once)"
    );
    let again = async move {
        tokio::select! {
            _ = sigterm.recv() => {}
            _ = sigint.recv() => {}
        }
    };
    let left = wait_until_drained(&drain, grace, || worlds.runs_in_progress(), again).await;
    if left > 0 {
        worlds.stop_runs().await;
        let flushed = async {
            while drain.in_flight() > 0 {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        };
        let _ = tokio::time::timeout(Duration::from_secs(5), flushed).await;
    }
    stop.cancel();
}

/// Waits until nothing is left to finish (`busy` returns 0 runs and no request is in flight),
/// the `grace` is over, or `again` (a second signal) resolves. Returns the runs and requests
/// left (0 when drained).
pub async fn wait_until_drained(
    drain: &Drain,
    grace: Duration,
    busy: impl Fn() -> usize,
    again: impl std::future::Future<Output = ()>,
) -> usize {
    let deadline = Instant::now() + grace;
    tokio::pin!(again);
    loop {
        let (runs, requests) = (busy(), drain.in_flight());
        if runs == 0 && requests == 0 {
            tracing::warn!("drained: no run or request left; stopping");
            return 0;
        }
        if Instant::now() >= deadline {
            tracing::warn!(
                runs,
                requests,
                "the drain's grace period is over: stopping what is still going"
            );
            return runs + requests;
        }
        tokio::select! {
            _ = &mut again => {
                tracing::warn!(runs, requests, "a second signal: stopping now");
                return runs + requests;
            }
            _ = tokio::time::sleep(Duration::from_millis(100)) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_new_sessions_and_new_runs_count_as_new_work() {
        let new = [
            r#"{"jsonrpc":"2.0","id":1,"method":"initialize","params":{}}"#,
            r#"{"jsonrpc":"2.0","id":"a","method":"tools/call","params":{"name":"run_python"}}"#,
            r#"{"jsonrpc":"2.0","id":2,"method":"tools/call","params":{"name":"a_saved_tool"}}"#,
        ];
        for body in new {
            assert!(starts_work(body.as_bytes()).is_some(), "{body}");
        }
        assert_eq!(starts_work(new[1].as_bytes()), Some(serde_json::json!("a")));
        let finishing = [
            r#"{"jsonrpc":"2.0","id":3,"method":"tools/call","params":{"name":"run_python_job"}}"#,
            r#"{"jsonrpc":"2.0","id":4,"method":"tasks/get","params":{"taskId":"job-1"}}"#,
            r#"{"jsonrpc":"2.0","id":5,"method":"tools/list"}"#,
            r#"{"jsonrpc":"2.0","method":"notifications/initialized"}"#,
            "not json",
            "[]",
        ];
        for body in finishing {
            assert!(starts_work(body.as_bytes()).is_none(), "{body}");
        }
    }
}
