//! Sessions: the table of named sessions, each with at most one live worker, and the run loop
//! that feeds a cell to a worker and turns what comes back into a [`RunRecord`].
//!
//! The host enforces what a worker cannot enforce on itself: the wall-clock timeout (SIGINT
//! first, so the session survives; SIGKILL after a grace period), cancellation, the output cap,
//! the cap on live sessions, and the idle TTL. A worker that dies for any reason is reported
//! once, in the result of the run it died in or, if it died between runs, in the next one.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use crate::lock;
use std::time::{Duration, Instant};

use futures::{SinkExt, StreamExt};
use nix::sys::signal::Signal;
use tokio::sync::oneshot;
use tokio_util::codec::{Framed, LengthDelimitedCodec};
use tokio_util::sync::CancellationToken;

use crate::config::Settings;
use crate::frame::{
    self, CellStatus, FromWorker, KIND_JSON, KIND_STDERR, KIND_STDOUT, PyErrorInfo, ToWorker,
};
use crate::output::{RunRecord, RunStatus, StreamCollector, spill_location};
use crate::proxy::{CallSummary, Proxy};
use crate::sandbox::Sandbox;
use crate::zygote::{ExitInfo, WorkerSpec, Zygote, ZygoteInfo};

/// How long a new worker may take to report `ready`.
const WORKER_READY_TIMEOUT: Duration = Duration::from_secs(15);
/// How often a running cell's scratch dir is measured against the quota.
const QUOTA_CHECK_EVERY: Duration = Duration::from_millis(500);
/// How long to wait for the zygote's report after a worker's socket closed.
const EXIT_REPORT_TIMEOUT: Duration = Duration::from_secs(2);

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
    SandboxUnavailable(String),
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

/// How often a running cell reports progress.
const PROGRESS_EVERY: Duration = Duration::from_secs(1);

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

struct LiveWorker {
    pid: i32,
    /// Sandbox layers this worker runs without (best-effort mode only).
    missing_layers: Vec<String>,
    io: Framed<tokio::net::UnixStream, LengthDelimitedCodec>,
    exit: oneshot::Receiver<ExitInfo>,
}

impl LiveWorker {
    /// The worker's exit status if the zygote has already reported it.
    fn exited(&mut self) -> Option<ExitInfo> {
        self.exit.try_recv().ok()
    }

    fn signal(&self, sig: Signal) {
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.pid), sig);
    }

    /// Kills the worker and waits (briefly) for the zygote to confirm.
    async fn kill(mut self) -> Option<ExitInfo> {
        if let Some(status) = self.exited() {
            return Some(status);
        }
        self.signal(Signal::SIGKILL);
        tokio::time::timeout(EXIT_REPORT_TIMEOUT, self.exit)
            .await
            .ok()?
            .ok()
    }

    /// After the socket closed: how did the process end?
    async fn wait_exit(self) -> Option<ExitInfo> {
        tokio::time::timeout(EXIT_REPORT_TIMEOUT, self.exit)
            .await
            .ok()?
            .ok()
    }
}

struct SessionState {
    worker: Option<LiveWorker>,
    /// Told to the model in the next run of this session (why its state was lost).
    pending_notice: Option<String>,
}

/// A named session: a scratch directory and at most one worker process.
pub struct Session {
    name: String,
    scratch: PathBuf,
    state: tokio::sync::Mutex<SessionState>,
    last_used: Mutex<Instant>,
}

/// The session table and everything needed to give a session a worker.
pub struct SessionManager {
    settings: Settings,
    sandbox: Sandbox,
    proxy: Arc<Proxy>,
    exe: PathBuf,
    zygote: Mutex<Arc<Zygote>>,
    sessions: Mutex<HashMap<String, Arc<Session>>>,
    live_workers: AtomicUsize,
    run_counter: AtomicU64,
    /// How long the last workers took to lock themselves down, in microseconds.
    recent_lockdown_us: Mutex<Vec<u64>>,
    root: PathBuf,
}

/// Session names become directory names, so only a safe alphabet is accepted.
pub fn valid_session_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        && name != "."
        && name != ".."
}

impl SessionManager {
    /// Starts the zygote (it warms up in the background) and prepares this server's directory
    /// of session scratch dirs.
    pub fn start(settings: Settings, exe: PathBuf) -> anyhow::Result<Arc<SessionManager>> {
        let state_dir = settings.prepare_state_dir()?;
        remove_sessions_of_dead_servers(&state_dir);
        let root = state_dir.join(format!("sessions-{}", std::process::id()));
        std::fs::create_dir_all(&root)
            .map_err(|e| anyhow::anyhow!("creating {}: {e}", root.display()))?;
        set_private(&root);
        let sandbox = settings.sandbox()?;
        if let Err(refusal) = sandbox.preflight() {
            tracing::error!("{refusal}");
        }
        let cwd = std::env::current_dir().unwrap_or_else(|_| PathBuf::from("/"));
        let servers =
            crate::proxy::config::load(&crate::proxy::config::ProcessEnv, &cwd, Some(&exe));
        let proxy = Arc::new(Proxy::new(
            servers,
            settings.startup_timeout,
            settings.call_timeout,
        ));
        let zygote = Zygote::start(&exe, &settings.preload)?;
        Ok(Arc::new(SessionManager {
            settings,
            sandbox,
            proxy,
            exe,
            zygote: Mutex::new(Arc::new(zygote)),
            sessions: Mutex::new(HashMap::new()),
            live_workers: AtomicUsize::new(0),
            recent_lockdown_us: Mutex::new(Vec::new()),
            run_counter: AtomicU64::new(0),
            root,
        }))
    }

    pub fn settings(&self) -> &Settings {
        &self.settings
    }

    pub fn sandbox(&self) -> &Sandbox {
        &self.sandbox
    }

    pub fn proxy(&self) -> &Arc<Proxy> {
        &self.proxy
    }

    /// Waits for the interpreter to be warm and returns what it reported.
    pub async fn python_info(&self) -> anyhow::Result<ZygoteInfo> {
        let z = self.current_zygote()?;
        z.ready().await
    }

    /// Pids of the zygote and all live workers (for tests and `system://info`).
    pub fn live_worker_count(&self) -> usize {
        self.live_workers.load(Ordering::SeqCst)
    }

    /// Median lockdown time of the most recent workers, in milliseconds.
    pub fn median_lockdown_ms(&self) -> Option<f64> {
        let mut v = lock(&self.recent_lockdown_us).clone();
        v.sort_unstable();
        v.get(v.len() / 2).map(|us| *us as f64 / 1000.0)
    }

    /// Files of every session: (session, relative path, size), at most `limit`.
    pub fn session_files(&self, limit: usize) -> Vec<(String, String, u64)> {
        let sessions: Vec<(String, PathBuf)> = lock(&self.sessions)
            .values()
            .map(|s| (s.name.clone(), s.scratch.clone()))
            .collect();
        let mut out = Vec::new();
        for (name, dir) in sessions {
            for (rel, size, _) in crate::files::list(&dir, limit.saturating_sub(out.len())) {
                out.push((name.clone(), rel, size));
            }
        }
        out
    }

    /// Reads a file of a session, refusing paths that leave its directory.
    pub fn read_session_file(&self, session: &str, rel: &str) -> Result<Vec<u8>, String> {
        let dir = lock(&self.sessions)
            .get(session)
            .map(|s| s.scratch.clone())
            .ok_or_else(|| format!("no session {session:?}"))?;
        crate::files::read_within(&dir, rel)
    }

    pub fn session_count(&self) -> usize {
        lock(&self.sessions).len()
    }

    fn current_zygote(&self) -> anyhow::Result<Arc<Zygote>> {
        let mut z = lock(&self.zygote);
        if z.is_dead() {
            tracing::warn!("the zygote is gone; starting a new one");
            *z = Arc::new(Zygote::start(&self.exe, &self.settings.preload)?);
        }
        Ok(z.clone())
    }

    /// Stops the proxied servers, kills the zygote (and so every worker) and removes all
    /// scratch directories.
    pub async fn shutdown(&self) {
        let _ = tokio::time::timeout(Duration::from_secs(1), self.proxy.shutdown()).await;
        lock(&self.zygote).kill();
        let _ = std::fs::remove_dir_all(&self.root);
    }

    fn session(&self, name: &str) -> Arc<Session> {
        let mut table = lock(&self.sessions);
        table
            .entry(name.to_string())
            .or_insert_with(|| {
                Arc::new(Session {
                    name: name.to_string(),
                    scratch: self.root.join(name),
                    state: tokio::sync::Mutex::new(SessionState {
                        worker: None,
                        pending_notice: None,
                    }),
                    last_used: Mutex::new(Instant::now()),
                })
            })
            .clone()
    }

    /// Runs one cell. `cancel` fires when the client cancels the call.
    pub async fn run(
        &self,
        req: RunRequest,
        cancel: CancellationToken,
    ) -> Result<RunRecord, RunRefusal> {
        if !valid_session_name(&req.session) {
            return Err(RunRefusal::InvalidSession(req.session));
        }
        if req.code.len() as u64 > self.settings.max_code_bytes {
            return Err(RunRefusal::CodeTooLarge {
                size: req.code.len(),
                limit: self.settings.max_code_bytes,
            });
        }
        self.sandbox
            .preflight()
            .map_err(RunRefusal::SandboxUnavailable)?;
        let mut notices = Vec::new();
        let unknown = self.proxy.prestart(&req.servers);
        if !unknown.is_empty() {
            notices.push(format!(
                "not configured, so not started: {} (runtime.discovered_servers() lists what is)",
                unknown.join(", ")
            ));
        }
        let timeout = match req.timeout {
            Some(t) if t > self.settings.max_timeout => {
                notices.push(format!(
                    "timeout_s {:.0} is above the maximum; using {:.0} s (MCP_BRIDGE_MAX_TIMEOUT)",
                    t.as_secs_f64(),
                    self.settings.max_timeout.as_secs_f64()
                ));
                self.settings.max_timeout
            }
            Some(t) => t,
            None => self.settings.default_timeout,
        };
        let session = self.session(&req.session);
        let mut state = session.state.lock().await;
        *lock(&session.last_used) = Instant::now();

        if req.reset {
            if let Some(w) = state.worker.take() {
                self.live_workers.fetch_sub(1, Ordering::SeqCst);
                w.kill().await;
            }
            state.pending_notice = None;
            let _ = std::fs::remove_dir_all(&session.scratch);
            notices.push("session reset: fresh interpreter, empty working directory".into());
        }
        if let Some(mut w) = state.worker.take() {
            match w.exited() {
                Some(status) => {
                    self.live_workers.fetch_sub(1, Ordering::SeqCst);
                    state.pending_notice = Some(format!(
                        "this session's worker {status} while idle; variables and imports were lost (files are kept)"
                    ));
                }
                None => state.worker = Some(w),
            }
        }
        let mut session_state = "kept";
        if state.worker.is_none() {
            if let Some(n) = state.pending_notice.take() {
                notices.push(n);
            }
            let w = self.spawn_worker(&session).await?;
            state.worker = Some(w);
            session_state = "restarted";
            if notices.is_empty() {
                session_state = "new";
            }
        }
        if let Some(w) = state
            .worker
            .as_ref()
            .filter(|w| !w.missing_layers.is_empty())
        {
            notices.push(format!(
                "sandbox is best-effort; running WITHOUT: {}",
                w.missing_layers.join("; ")
            ));
        }
        let run_no = self.run_counter.fetch_add(1, Ordering::Relaxed) + 1;
        let started = Instant::now();
        // Coarse file timestamps can trail the clock a little; look back a few milliseconds.
        let started_wall = std::time::SystemTime::now() - Duration::from_millis(20);
        let outcome = self
            .drive_cell(
                &session,
                &mut state,
                Cell {
                    run_no,
                    code: &req.code,
                    timeout,
                    cancel,
                    progress: req.progress.as_ref(),
                },
            )
            .await;
        *lock(&session.last_used) = Instant::now();

        let mut record = outcome.record;
        record.session = session.name.clone();
        link_outputs(&mut record, &session, outcome.images, started_wall);
        record.duration_ms = started.elapsed().as_secs_f64() * 1000.0;
        record.session_state = if outcome.worker_lost {
            "lost"
        } else {
            session_state
        };
        notices.append(&mut record.notices);
        record.notices = notices;
        if outcome.worker_lost {
            state.pending_notice = Some(format!(
                "this session's previous worker was lost ({}); variables and imports start fresh (files are kept)",
                outcome.loss_reason.unwrap_or_else(|| "it stopped".into())
            ));
        }
        Ok(record)
    }

    /// Reserves a worker slot (evicting an idle session if all are taken), then spawns.
    async fn spawn_worker(&self, session: &Session) -> Result<LiveWorker, RunRefusal> {
        let max = self.settings.max_sessions as usize;
        // The slot is taken before the (slow) spawn, so concurrent calls cannot all pass the cap.
        while self
            .live_workers
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                (n < max).then_some(n + 1)
            })
            .is_err()
        {
            self.evict_one_idle_session(&session.name).await?;
        }
        let spawned = self.spawn_worker_in_reserved_slot(session).await;
        if spawned.is_err() {
            self.live_workers.fetch_sub(1, Ordering::SeqCst);
        }
        spawned
    }

    async fn spawn_worker_in_reserved_slot(
        &self,
        session: &Session,
    ) -> Result<LiveWorker, RunRefusal> {
        std::fs::create_dir_all(&session.scratch).map_err(|e| {
            RunRefusal::WorkerStart(format!("creating {}: {e}", session.scratch.display()))
        })?;
        set_private(&session.scratch);
        let zygote = self
            .current_zygote()
            .map_err(|e| RunRefusal::WorkerStart(format!("{e:#}")))?;
        let python = zygote
            .ready()
            .await
            .map_err(|e| RunRefusal::WorkerStart(format!("{e:#}")))?;
        let spec = WorkerSpec {
            session: session.name.clone(),
            scratch: session.scratch.clone(),
            env: worker_environment(&session.name, &session.scratch),
            sandbox: self
                .sandbox
                .plan_for(&session.scratch, &python.python_paths),
            mcp_servers: self.proxy.server_summaries(),
            image_budget_bytes: self.settings.image_budget,
        };
        let spawn_started = Instant::now();
        let spawned = zygote
            .spawn_worker(spec)
            .await
            .map_err(|e| RunRefusal::WorkerStart(format!("{e:#}")))?;
        let forked_ms = spawn_started.elapsed().as_secs_f64() * 1000.0;
        spawned
            .socket
            .set_nonblocking(true)
            .map_err(|e| RunRefusal::WorkerStart(e.to_string()))?;
        let socket = tokio::net::UnixStream::from_std(spawned.socket)
            .map_err(|e| RunRefusal::WorkerStart(e.to_string()))?;
        let mut worker = LiveWorker {
            pid: spawned.pid,
            missing_layers: Vec::new(),
            io: Framed::new(socket, frame::host_codec()),
            exit: spawned.exit,
        };
        let ready = tokio::time::timeout(WORKER_READY_TIMEOUT, async {
            loop {
                match worker.io.next().await {
                    Some(Ok(f)) if f.first() == Some(&KIND_JSON) => {
                        match serde_json::from_slice::<FromWorker>(&f[1..]) {
                            Ok(FromWorker::Ready {
                                missing_layers,
                                lockdown_us,
                                ..
                            }) => {
                                let mut recent = lock(&self.recent_lockdown_us);
                                if recent.len() >= 64 {
                                    recent.remove(0);
                                }
                                recent.push(lockdown_us);
                                return Ok(missing_layers);
                            }
                            Ok(FromWorker::Fatal { message }) => return Err(message),
                            _ => continue,
                        }
                    }
                    Some(Ok(f)) => {
                        tracing::warn!(output = %String::from_utf8_lossy(&f[1..]), "worker wrote during setup");
                    }
                    Some(Err(e)) => return Err(e.to_string()),
                    None => return Err("the worker exited during setup".into()),
                }
            }
        })
        .await;
        match ready {
            Ok(Ok(missing_layers)) => {
                worker.missing_layers = missing_layers;
                tracing::debug!(
                    session = %session.name,
                    pid = worker.pid,
                    forked_ms,
                    ready_ms = spawn_started.elapsed().as_secs_f64() * 1000.0,
                    "worker ready"
                );
                Ok(worker)
            }
            Ok(Err(message)) => {
                let status = worker.kill().await;
                let status = status.map(|s| format!(" ({s})")).unwrap_or_default();
                Err(RunRefusal::WorkerStart(format!("{message}{status}")))
            }
            Err(_) => {
                worker.kill().await;
                Err(RunRefusal::WorkerStart(format!(
                    "the worker did not become ready within {} s",
                    WORKER_READY_TIMEOUT.as_secs()
                )))
            }
        }
    }

    /// Makes room for one more worker by stopping the least recently used idle session.
    async fn evict_one_idle_session(&self, except: &str) -> Result<(), RunRefusal> {
        let mut candidates: Vec<Arc<Session>> = lock(&self.sessions)
            .values()
            .filter(|s| s.name != except)
            .cloned()
            .collect();
        candidates.sort_by_key(|s| *lock(&s.last_used));
        for s in candidates {
            let Ok(mut st) = s.state.try_lock() else {
                continue;
            };
            if let Some(w) = st.worker.take() {
                self.live_workers.fetch_sub(1, Ordering::SeqCst);
                w.kill().await;
                st.pending_notice = Some(format!(
                    "this session was stopped to make room for another (at most {} live sessions, IRONCELL_MAX_SESSIONS); variables were lost, files are kept",
                    self.settings.max_sessions
                ));
                tracing::info!(session = %s.name, "evicted idle session");
                return Ok(());
            }
        }
        Err(RunRefusal::Busy(self.settings.max_sessions))
    }

    /// Stops the workers of sessions idle longer than the TTL and deletes their files.
    pub async fn expire_idle_sessions(&self) {
        let ttl = self.settings.session_ttl;
        let idle: Vec<Arc<Session>> = lock(&self.sessions)
            .values()
            .filter(|s| lock(&s.last_used).elapsed() >= ttl)
            .cloned()
            .collect();
        for s in idle {
            let Ok(mut st) = s.state.try_lock() else {
                continue;
            };
            let had_worker = st.worker.is_some();
            if let Some(w) = st.worker.take() {
                self.live_workers.fetch_sub(1, Ordering::SeqCst);
                w.kill().await;
            }
            let had_files = s.scratch.exists();
            let _ = std::fs::remove_dir_all(&s.scratch);
            if had_worker || had_files {
                st.pending_notice = Some(format!(
                    "this session expired after {} s idle (IRONCELL_SESSION_TTL); variables and files were discarded",
                    ttl.as_secs()
                ));
                tracing::info!(session = %s.name, "session expired");
            }
        }
    }

    /// Feeds one cell to the session's worker and collects everything until it is done, dead,
    /// or killed.
    /// [`Self::drive_cell_inner`], with the proxied calls the cell made added to its record.
    async fn drive_cell(
        &self,
        session: &Session,
        state: &mut SessionState,
        cell: Cell<'_>,
    ) -> CellOutcome {
        let mut calls = Vec::new();
        let mut outcome = self
            .drive_cell_inner(session, state, cell, &mut calls)
            .await;
        outcome.record.upstream_calls = calls;
        outcome
    }

    /// Feeds one cell to the session's worker and collects everything until it is done, dead,
    /// or killed.
    async fn drive_cell_inner(
        &self,
        session: &Session,
        state: &mut SessionState,
        cell: Cell<'_>,
        calls: &mut Vec<CallSummary>,
    ) -> CellOutcome {
        let Cell {
            run_no,
            code,
            timeout,
            cancel,
            progress,
        } = cell;
        let s = &self.settings;
        let (p, d) = spill_location(&session.scratch, run_no, "stdout");
        let mut stdout = StreamCollector::new(s.inline_output_bytes, s.max_output_bytes, p, d);
        let (p, d) = spill_location(&session.scratch, run_no, "stderr");
        let mut stderr = StreamCollector::new(s.inline_output_bytes, s.max_output_bytes, p, d);
        let Some(worker) = state.worker.as_mut() else {
            return CellOutcome::lost(stdout, stderr, RunStatus::Crashed, "no worker".into(), None);
        };

        let sent = match frame::json_body(&ToWorker::Run {
            id: run_no,
            code: code.to_string(),
        }) {
            Ok(body) => worker.io.send(body).await.map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        };
        if let Err(e) = sent {
            tracing::warn!(error = %e, "sending a cell failed");
        }

        let deadline = tokio::time::Instant::now() + timeout;
        let mut stopping: Option<(RunStatus, tokio::time::Instant)> = None;
        let quota = self.sandbox.scratch_quota_bytes();
        let (answers_tx, mut answers_rx) =
            tokio::sync::mpsc::unbounded_channel::<(u64, serde_json::Value, Option<CallSummary>)>();
        let mut quota_check = tokio::time::interval(QUOTA_CHECK_EVERY);
        let cell_started = tokio::time::Instant::now();
        let mut progress_tick =
            tokio::time::interval_at(cell_started + PROGRESS_EVERY, PROGRESS_EVERY);
        quota_check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        loop {
            let wake_at = stopping.map(|(_, kill_at)| kill_at).unwrap_or(deadline);
            tokio::select! {
                next = worker.io.next() => match next {
                    Some(Ok(f)) => {
                        let (kind, body) = match f.split_first() { Some((k, b)) => (*k, b), None => continue };
                        match kind {
                            KIND_STDOUT => stdout.push(body),
                            KIND_STDERR => stderr.push(body),
                            KIND_JSON => match serde_json::from_slice::<FromWorker>(body) {
                                Ok(FromWorker::Request { id, method, params }) => {
                                    // Proxied calls run concurrently; answers come back below.
                                    let proxy = self.proxy.clone();
                                    let tx = answers_tx.clone();
                                    tokio::spawn(async move {
                                        let (payload, summary) = proxy.handle(&method, &params).await;
                                        let _ = tx.send((id, payload, summary));
                                    });
                                }
                                Ok(FromWorker::Done { status, result, error, exit_code, images, .. }) => {
                                    let status = match (stopping, status) {
                                        (Some((RunStatus::OutputLimit, _)), _) => RunStatus::OutputLimit,
                                        (Some((reason, _)), CellStatus::Interrupted) => reason,
                                        (_, CellStatus::Ok) => RunStatus::Ok,
                                        (_, CellStatus::Error) | (_, CellStatus::Interrupted) => RunStatus::Error,
                                        (_, CellStatus::Exit) => RunStatus::Exit,
                                    };
                                    let error = if matches!(status, RunStatus::Timeout | RunStatus::Cancelled | RunStatus::OutputLimit) {
                                        None
                                    } else {
                                        error
                                    };
                                    let mut done = CellOutcome::finished(stdout, stderr, status, result, error, exit_code);
                                    done.images = images;
                                    return done;
                                }
                                _ => {}
                            },
                            _ => {}
                        }
                        if stopping.is_none() && stdout.total() + stderr.total() > s.max_output_bytes {
                            worker.signal(Signal::SIGINT);
                            stopping = Some((RunStatus::OutputLimit, tokio::time::Instant::now() + s.interrupt_grace));
                        }
                    }
                    Some(Err(_)) | None => {
                        // The worker is gone mid-cell.
                        let Some(w) = state.worker.take() else { break };
                        self.live_workers.fetch_sub(1, Ordering::SeqCst);
                        let exit = w.wait_exit().await;
                        let why = exit.map(|e| e.to_string()).unwrap_or_else(|| "ended".into());
                        let status = match stopping { Some((reason, _)) => reason, None => RunStatus::Crashed };
                        let reason = crash_reason(exit);
                        return CellOutcome::lost(stdout, stderr, status, format!("the worker process {why}{reason}"), Some(why));
                    }
                },
                _ = tokio::time::sleep_until(wake_at) => {
                    match stopping {
                        None => {
                            worker.signal(Signal::SIGINT);
                            stopping = Some((RunStatus::Timeout, tokio::time::Instant::now() + s.interrupt_grace));
                        }
                        Some((reason, _)) => {
                            let Some(w) = state.worker.take() else { break };
                            self.live_workers.fetch_sub(1, Ordering::SeqCst);
                            let exit = w.kill().await;
                            let why = format!(
                                "did not stop within {:.1} s of an interrupt and was killed",
                                s.interrupt_grace.as_secs_f64()
                            );
                            let _ = exit;
                            return CellOutcome::lost(stdout, stderr, reason, format!("the worker {why}"), Some(why));
                        }
                    }
                },
                Some((id, payload, summary)) = answers_rx.recv() => {
                    calls.extend(summary);
                    if let Ok(body) = frame::json_body(&ToWorker::Response { id, payload })
                        && let Err(e) = worker.io.send(body).await {
                            tracing::warn!(error = %e, "answering a proxied call failed");
                        }
                },
                _ = progress_tick.tick(), if progress.is_some() => {
                    if let Some(p) = progress {
                        let recent = [stdout.recent_lines(5), stderr.recent_lines(3)]
                            .into_iter()
                            .filter(|t| !t.is_empty())
                            .collect::<Vec<_>>()
                            .join("\n[stderr] ");
                        p.send_replace(Progress {
                            elapsed_s: cell_started.elapsed().as_secs_f64(),
                            stdout_bytes: stdout.total(),
                            stderr_bytes: stderr.total(),
                            recent_output: recent,
                        });
                    }
                },
                _ = quota_check.tick() => {
                    let used = directory_size(&session.scratch, quota + 1);
                    if used > quota {
                        let Some(w) = state.worker.take() else { break };
                        self.live_workers.fetch_sub(1, Ordering::SeqCst);
                        w.kill().await;
                        let _ = std::fs::remove_dir_all(&session.scratch);
                        let why = format!(
                            "killed: the session directory grew past its quota ({} MiB); its files were removed",
                            quota >> 20
                        );
                        return CellOutcome::lost(stdout, stderr, RunStatus::ScratchQuota, why.clone(), Some(why));
                    }
                },
                _ = cancel.cancelled(), if stopping.is_none() => {
                    worker.signal(Signal::SIGINT);
                    stopping = Some((RunStatus::Cancelled, tokio::time::Instant::now() + s.interrupt_grace));
                },
            }
        }
        CellOutcome::lost(
            stdout,
            stderr,
            RunStatus::Crashed,
            "the worker vanished".into(),
            None,
        )
    }
}

fn crash_reason(exit: Option<ExitInfo>) -> &'static str {
    match exit {
        Some(ExitInfo::Signal(s)) if s == libc::SIGSEGV || s == libc::SIGBUS => {
            " (a crash in native code, e.g. ctypes or a C extension)"
        }
        Some(ExitInfo::Signal(s)) if s == libc::SIGKILL => {
            " (killed: out of memory or by the supervisor)"
        }
        Some(ExitInfo::Signal(s)) if s == libc::SIGXCPU => " (CPU time limit)",
        Some(ExitInfo::Signal(s)) if s == libc::SIGSYS => {
            " (a forbidden system call: the sandbox's seccomp filter ended it)"
        }
        Some(ExitInfo::Code(_)) => " (os._exit() or a fatal interpreter error)",
        _ => "",
    }
}

/// One cell to run, with its limits and listeners.
struct Cell<'a> {
    run_no: u64,
    code: &'a str,
    timeout: Duration,
    cancel: CancellationToken,
    progress: Option<&'a tokio::sync::watch::Sender<Progress>>,
}

struct CellOutcome {
    record: RunRecord,
    images: Vec<crate::frame::CellImage>,
    worker_lost: bool,
    loss_reason: Option<String>,
}

impl CellOutcome {
    fn base(stdout: StreamCollector, stderr: StreamCollector, status: RunStatus) -> RunRecord {
        let (out, out_cut) = stdout.finish();
        let (err, err_cut) = stderr.finish();
        RunRecord {
            session: String::new(),
            status,
            stdout: out,
            stderr: err,
            result: None,
            error: None,
            exit_code: None,
            duration_ms: 0.0,
            session_state: "kept",
            notices: Vec::new(),
            stdout_truncated: out_cut,
            stderr_truncated: err_cut,
            upstream_calls: Vec::new(),
            images: Vec::new(),
            files: Vec::new(),
            inline_images: Vec::new(),
        }
    }

    fn finished(
        stdout: StreamCollector,
        stderr: StreamCollector,
        status: RunStatus,
        result: Option<String>,
        error: Option<PyErrorInfo>,
        exit_code: Option<i64>,
    ) -> CellOutcome {
        let mut record = Self::base(stdout, stderr, status);
        record.result = result;
        record.error = error;
        record.exit_code = exit_code;
        CellOutcome {
            record,
            images: Vec::new(),
            worker_lost: false,
            loss_reason: None,
        }
    }

    fn lost(
        stdout: StreamCollector,
        stderr: StreamCollector,
        status: RunStatus,
        message: String,
        reason: Option<String>,
    ) -> CellOutcome {
        let mut record = Self::base(stdout, stderr, status);
        if status == RunStatus::Crashed {
            record.error = Some(PyErrorInfo {
                kind: "WorkerCrashed".into(),
                message,
                traceback: String::new(),
            });
        } else {
            record.notices.push(message);
        }
        CellOutcome {
            record,
            images: Vec::new(),
            worker_lost: true,
            loss_reason: reason,
        }
    }
}

/// The whole environment of a worker: fixed values and the session's own directories.
fn worker_environment(session: &str, scratch: &Path) -> Vec<(String, String)> {
    let dir = scratch.display().to_string();
    let mut env: Vec<(String, String)> = crate::zygote::zygote_environment()
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    env.extend([
        ("HOME".to_string(), dir.clone()),
        ("TMPDIR".to_string(), dir.clone()),
        ("PWD".to_string(), dir),
        ("TERM".to_string(), "dumb".to_string()),
        ("IRONCELL_SESSION".to_string(), session.to_string()),
    ]);
    env
}

/// Adds resource URIs for the spilled output, the run's images (inline copies kept aside for
/// image content) and the files it created or changed.
fn link_outputs(
    record: &mut RunRecord,
    session: &Session,
    images: Vec<crate::frame::CellImage>,
    since: std::time::SystemTime,
) {
    use crate::files::session_uri;
    for cut in [
        record.stdout_truncated.as_mut(),
        record.stderr_truncated.as_mut(),
    ]
    .into_iter()
    .flatten()
    {
        cut.uri = cut.file.as_deref().map(|f| session_uri(&session.name, f));
    }
    for img in images {
        let inline = img.data.is_some();
        if let Some(data) = img.data {
            record.inline_images.push((data, img.mime.clone()));
        }
        record.images.push(crate::output::ImageRef {
            uri: session_uri(&session.name, &img.path),
            path: img.path,
            mime: img.mime,
            bytes: img.bytes,
            width: img.width,
            height: img.height,
            inline,
        });
    }
    let shown: std::collections::HashSet<String> =
        record.images.iter().map(|i| i.path.clone()).collect();
    record.files = crate::files::changed_since(&session.scratch, &session.name, since, 50)
        .into_iter()
        .filter(|f| !shown.contains(&f.path))
        .collect();
}

/// Bytes used beneath `dir`, counting at most up to `stop_at` (the walk ends there).
fn directory_size(dir: &Path, stop_at: u64) -> u64 {
    let mut total = 0u64;
    let mut pending = vec![dir.to_path_buf()];
    while let Some(d) = pending.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for entry in entries.flatten() {
            let Ok(meta) = entry.metadata() else { continue };
            if meta.is_dir() {
                pending.push(entry.path());
            } else {
                use std::os::unix::fs::MetadataExt;
                // Allocated blocks (sparse files count as what they use), plus an inode's worth.
                total += meta.blocks() * 512 + 4096;
            }
            if total > stop_at {
                return total;
            }
        }
    }
    total
}

/// Removes `sessions-<pid>` directories left by ironcell servers that died without cleaning
/// up (e.g. SIGKILL), so their files do not pile up.
fn remove_sessions_of_dead_servers(state_dir: &Path) {
    let Ok(entries) = std::fs::read_dir(state_dir) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix("sessions-"))
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        if !Path::new(&format!("/proc/{pid}")).exists() {
            tracing::info!(dir = %entry.path().display(), "removing sessions of a server that is gone");
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

fn set_private(dir: &Path) {
    use std::os::unix::fs::PermissionsExt;
    let _ = std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn session_names_cannot_escape_the_state_dir() {
        for ok in ["default", "a-b_c.d", "S1"] {
            assert!(valid_session_name(ok), "{ok}");
        }
        for bad in ["", ".", "..", "../x", "a/b", "a b", "é", &"x".repeat(65)] {
            assert!(!valid_session_name(bad), "{bad}");
        }
    }
}
