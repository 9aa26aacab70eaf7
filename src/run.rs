//! What a run is asked ([`RunRequest`]), why it may be refused ([`RunRefusal`]) and what a
//! running cell reports ([`Progress`]): shared by the server, jobs, the local tools and the
//! sessions that run it.

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
    /// Start `session` as a fork of this one (docs/ARCHITECTURE.md, "Forking a session").
    pub fork_from: Option<String>,
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

/// Why a call was refused before any code ran. Shown to the model as an `isError` result.
#[derive(Debug, thiserror::Error)]
pub enum RunRefusal {
    #[error("invalid session name {0:?}: use 1-64 letters, digits, '-', '_' or '.'")]
    InvalidSession(String),
    #[error(
        "code is {size} bytes; the limit is {limit} bytes (IRONCELL_MAX_CODE). Split it, or write data to a file in an earlier run"
    )]
    CodeTooLarge { size: usize, limit: u64 },
    #[error(
        "all {0} sessions are busy running code; wait for one to finish, or reuse a session name"
    )]
    Busy(u32),
    #[error("could not start a Python worker: {0}")]
    WorkerStart(String),
    #[error("{0}")]
    SandboxUnavailable(crate::sandbox::Unenforceable),
    #[error("cannot fork: {0}")]
    Fork(String),
    #[error("cancelled before it started (it was waiting for the session's previous run to end)")]
    Cancelled,
}
