//! What a run is asked ([`RunRequest`]) and what a running cell reports ([`Progress`]): shared
//! by the server, jobs, the local tools and the sessions that run it.

use std::time::Duration;

/// One `run_python` call, validated by the server.
#[derive(Debug, Clone)]
pub struct RunRequest {
    pub code: String,
    pub session: String,
    pub timeout: Option<Duration>,
    pub reset: bool,
    /// Proxied servers to start before the code runs (they start on first use anyway).
    pub servers: Vec<String>,
    /// Where to report progress while the cell runs, if anyone listens.
    pub progress: Option<tokio::sync::watch::Sender<Progress>>,
}

/// What a running cell has done so far: sent as progress notifications and shown by job polls.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Progress {
    pub elapsed_s: f64,
    pub stdout_bytes: u64,
    pub stderr_bytes: u64,
    /// The newest lines of output.
    pub recent_output: String,
}
