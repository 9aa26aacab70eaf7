//! Sessions: the table of named sessions, each with at most one live worker, and the run loop
//! that feeds a cell to a worker and turns what comes back into a [`RunRecord`].
//!
//! The host enforces what a worker cannot enforce on itself: the wall-clock timeout (SIGINT
//! first, so the session survives; SIGKILL after a grace period), cancellation, the output cap,
//! the cap on live sessions, and the idle TTL. A worker that dies for any reason is reported
//! once, in the result of the run it died in or, if it died between runs, in the next one.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::lock;
use std::time::{Duration, Instant};

use futures::StreamExt;
use nix::sys::signal::Signal;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

use crate::config::Settings;
use crate::frame::{self, CellStatus, FromWorker, PyErrorInfo, ToWorker, Violation, WorkerFrame};
use crate::host_fs::{self, Usage};
use crate::output::{RunRecord, RunStatus, StreamCollector, spill_location};
use crate::proxy::{CallSummary, Proxy};
use crate::sandbox::Sandbox;
use crate::zygote::{ExitInfo, WorkerSpec, Zygote, ZygoteInfo};
use std::os::fd::AsFd;

mod live;
use live::{LiveWorker, Liveness, Outgoing, SendError};

/// How long a new worker may take to report `ready`.
const WORKER_READY_TIMEOUT: Duration = Duration::from_secs(15);
/// How often a running cell's scratch dir is measured against the quota.
const QUOTA_CHECK_EVERY: Duration = Duration::from_millis(500);
/// How often idle sessions with a live worker are measured against the scratch quota (a thread
/// the code left running keeps writing after its run returned).
const IDLE_QUOTA_CHECK_EVERY: Duration = Duration::from_secs(2);
/// How often the quota watch looks for sessions due a measurement.
const QUOTA_WATCH_TICK: Duration = Duration::from_millis(100);
/// A session's next measurement waits at least this many times as long as its last one took, so
/// measuring a huge tree uses at most about a tenth of one core.
const QUOTA_WALK_SPACING: u32 = 10;

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
    /// The quota watch's verdict: `Some(why)` once it measured the directory over quota. Set
    /// by the background measurement (never on a run's path), acted on by whoever holds
    /// `state`: the running cell's loop, the next run, or the watch itself if the session idles.
    over_quota: tokio::sync::watch::Sender<Option<String>>,
    /// Bumped whenever the directory is emptied, so a measurement that started before cannot
    /// condemn the fresh directory.
    generation: AtomicU64,
    /// When the quota watch next measures this session.
    next_quota_check: Mutex<Instant>,
    /// How long its last measurement took (the walk's cost grows with the files).
    last_quota_walk: Mutex<Duration>,
}

impl Session {
    /// A session with no worker yet, its scratch directory at `scratch`.
    fn new(name: String, scratch: PathBuf) -> Session {
        Session {
            name,
            scratch,
            state: tokio::sync::Mutex::new(SessionState {
                worker: None,
                pending_notice: None,
            }),
            last_used: Mutex::new(Instant::now()),
            over_quota: tokio::sync::watch::Sender::new(None),
            generation: AtomicU64::new(0),
            next_quota_check: Mutex::new(Instant::now()),
            last_quota_walk: Mutex::new(Duration::ZERO),
        }
    }
}

impl Session {
    /// Schedules a quota measurement within [`QUOTA_CHECK_EVERY`] (a run is starting), or
    /// [`QUOTA_WALK_SPACING`] times the last walk if that is longer.
    fn measure_soon(&self) {
        let spacing = *lock(&self.last_quota_walk) * QUOTA_WALK_SPACING;
        let soon = Instant::now() + QUOTA_CHECK_EVERY.max(spacing);
        let mut next = lock(&self.next_quota_check);
        if *next > soon {
            *next = soon;
        }
    }
}

/// The session table and everything needed to give a session a worker.
pub struct SessionManager {
    settings: Settings,
    sandbox: Sandbox,
    proxy: Arc<Proxy>,
    /// `save_memory`/`load_memory` from Python (`memory.*` bridge requests).
    memory: Arc<crate::memory::MemoryStore>,
    /// Local Python tools (`tools.*` requests, and the tools session's read grants); set once
    /// by the server.
    local_tools: std::sync::OnceLock<Arc<crate::local_tools::LocalTools>>,
    /// The interpreter chosen at start (or why none could be): every zygote runs it.
    python: Result<crate::python::Interpreter, crate::python::PythonError>,
    zygote: Mutex<Option<Arc<Zygote>>>,
    sessions: Mutex<HashMap<String, Arc<Session>>>,
    /// One permit per possible live worker (IRONCELL_MAX_SESSIONS); each live worker holds one.
    session_slots: Arc<Semaphore>,
    run_counter: AtomicU64,
    /// How long the last workers took to lock themselves down, in microseconds.
    recent_lockdown_us: Mutex<Vec<u64>>,
    root: PathBuf,
    /// Which files each run created or changed, without walking the session each time.
    changes: Arc<crate::files::ChangeTracker>,
    /// matplotlib's font cache, built once per server (see [`SessionManager::build_font_cache`])
    /// and given to every worker read-only as `MPLCONFIGDIR`; `None` until built, or without
    /// matplotlib.
    font_cache: Mutex<Option<PathBuf>>,
    /// Whether the font-cache builder's worker is alive (it holds no session slot, but it is a
    /// live worker all the same, and `system://info` counts it).
    font_cache_building: std::sync::atomic::AtomicBool,
}

/// The shared font cache's directory inside `sessions-<pid>` ('@' is never in a session name).
const FONT_CACHE_DIR: &str = "@font-cache";
/// Where the font cache is built (by a worker that runs only ironcell's own code).
const FONT_CACHE_BUILD_DIR: &str = "@font-cache-build";
/// Where the last built font cache is kept for the next server, inside the state dir.
const FONT_CACHE_KEPT_DIR: &str = "font-cache";
/// What the font-cache builder runs: import matplotlib's font manager with `MPLCONFIGDIR` set
/// to its own directory (which holds the previous server's cache, if any: matplotlib keeps it
/// if it is current and rebuilds it otherwise). Nothing else runs in that worker.
const FONT_CACHE_BUILD_CODE: &str = "import importlib.util\n\
if importlib.util.find_spec('matplotlib') is None:\n    r = 'absent'\n\
else:\n    import matplotlib, matplotlib.font_manager\n    r = matplotlib.get_cachedir()\n\
r";

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
            settings.approval,
        ));
        let python =
            crate::python::choose(&crate::python::ProcessLookup(settings.python.as_deref()));
        let zygote = match &python {
            Ok(interpreter) => {
                tracing::info!(
                    python = %interpreter.executable.display(),
                    chosen_by = %interpreter.source,
                    "starting the zygote"
                );
                Some(Arc::new(Zygote::start(
                    interpreter,
                    &settings.preload,
                    &crate::cli::log_filter(),
                )?))
            }
            Err(e) => {
                tracing::error!("{e}");
                None
            }
        };
        let session_slots = Arc::new(Semaphore::new(settings.max_sessions as usize));
        crate::config::report_not_applicable_variables(&settings);
        let memory = Arc::new(crate::memory::MemoryStore::new(&state_dir));
        let manager = Arc::new(SessionManager {
            settings,
            sandbox,
            proxy,
            memory,
            local_tools: std::sync::OnceLock::new(),
            python,
            zygote: Mutex::new(zygote),
            sessions: Mutex::new(HashMap::new()),
            session_slots,
            recent_lockdown_us: Mutex::new(Vec::new()),
            run_counter: AtomicU64::new(0),
            root,
            changes: Arc::new(crate::files::ChangeTracker::new()),
            font_cache: Mutex::new(None),
            font_cache_building: std::sync::atomic::AtomicBool::new(false),
        });
        enforce_scratch_quotas_periodically(&manager);
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let m = manager.clone();
            runtime.spawn(async move { m.build_font_cache().await });
        }
        Ok(manager)
    }

    pub fn settings(&self) -> &Settings {
        &self.settings
    }

    pub fn sandbox(&self) -> &Sandbox {
        &self.sandbox
    }

    /// The state directory in use (the configured one, or the private fallback).
    pub fn state_dir(&self) -> &Path {
        self.root.parent().unwrap_or(&self.root)
    }

    /// Connects the local Python tools (done once, by the server).
    pub fn set_local_tools(&self, tools: Arc<crate::local_tools::LocalTools>) {
        let _ = self.local_tools.set(tools);
    }

    pub fn local_tools(&self) -> Option<Arc<crate::local_tools::LocalTools>> {
        self.local_tools.get().cloned()
    }

    pub fn proxy(&self) -> &Arc<Proxy> {
        &self.proxy
    }

    /// Waits for the interpreter to be warm and returns what it reported.
    pub async fn python_info(&self) -> anyhow::Result<ZygoteInfo> {
        let z = self.current_zygote()?;
        z.ready().await
    }

    /// How many workers are alive (for tests and `system://info`).
    pub fn live_worker_count(&self) -> usize {
        let builder = self.font_cache_building.load(Ordering::SeqCst) as usize;
        (self.settings.max_sessions as usize).saturating_sub(self.session_slots.available_permits())
            + builder
    }

    /// Median lockdown time of the most recent workers, in milliseconds.
    pub fn median_lockdown_ms(&self) -> Option<f64> {
        let mut v = lock(&self.recent_lockdown_us).clone();
        v.sort_unstable();
        v.get(v.len() / 2).map(|us| *us as f64 / 1000.0)
    }

    /// Files of every session: (session, relative path, size), at most `limit`. The walks run
    /// off the async runtime and stop after a bounded number of entries.
    pub async fn session_files(&self, limit: usize) -> Vec<(String, String, u64)> {
        let sessions: Vec<(String, PathBuf)> = lock(&self.sessions)
            .values()
            .map(|s| (s.name.clone(), s.scratch.clone()))
            .collect();
        let walked = tokio::task::spawn_blocking(move || {
            let mut out = Vec::new();
            for (name, dir) in sessions {
                let listing = crate::files::list(&dir, limit.saturating_sub(out.len()));
                if let Some(why) = listing.incomplete {
                    tracing::warn!(session = %name, "listing session files: {why}");
                }
                for (rel, size, _) in listing.files {
                    out.push((name.clone(), rel, size));
                }
            }
            out
        })
        .await;
        walked.unwrap_or_else(|e| {
            tracing::error!(error = %e, "listing session files failed");
            Vec::new()
        })
    }

    /// Reads a file of a session (off the async runtime), refusing paths that leave its
    /// directory or pass through a symlink.
    pub async fn read_session_file(&self, session: &str, rel: &str) -> Result<Vec<u8>, String> {
        let dir = lock(&self.sessions)
            .get(session)
            .map(|s| s.scratch.clone())
            .ok_or_else(|| format!("no session {session:?}"))?;
        let rel = rel.to_string();
        tokio::task::spawn_blocking(move || crate::files::read_within(&dir, &rel))
            .await
            .unwrap_or_else(|e| Err(format!("reading the file failed: {e}")))
    }

    pub fn session_count(&self) -> usize {
        lock(&self.sessions).len()
    }

    /// The interpreter in use, or why there is none.
    pub fn interpreter(&self) -> Result<&crate::python::Interpreter, &crate::python::PythonError> {
        self.python.as_ref()
    }

    fn current_zygote(&self) -> anyhow::Result<Arc<Zygote>> {
        let python = self.python.as_ref().map_err(|e| anyhow::anyhow!("{e}"))?;
        let mut z = lock(&self.zygote);
        match z.as_ref() {
            Some(live) if !live.is_dead() => Ok(live.clone()),
            _ => {
                if z.is_some() {
                    tracing::warn!("the zygote is gone; starting a new one");
                }
                let fresh = Arc::new(Zygote::start(
                    python,
                    &self.settings.preload,
                    &crate::cli::log_filter(),
                )?);
                *z = Some(fresh.clone());
                Ok(fresh)
            }
        }
    }

    /// Stops the proxied servers, kills the zygote (and so every worker) and removes all
    /// scratch directories.
    pub async fn shutdown(&self) {
        let _ = tokio::time::timeout(Duration::from_secs(1), self.proxy.shutdown()).await;
        if let Some(z) = lock(&self.zygote).as_ref() {
            z.kill();
        }
        remove_scratch(self.root.clone()).await;
    }

    fn session(&self, name: &str) -> Arc<Session> {
        let mut table = lock(&self.sessions);
        table
            .entry(name.to_string())
            .or_insert_with(|| Arc::new(Session::new(name.to_string(), self.root.join(name))))
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
                w.kill().await;
            }
            state.pending_notice = None;
            let removal = self.empty_scratch(&session).await;
            notices.push(if removal.is_complete() {
                "session reset: fresh interpreter, empty working directory".into()
            } else {
                format!(
                    "session reset: fresh interpreter, but the working directory is NOT empty: {}",
                    removal.summary()
                )
            });
        }
        self.enforce_quota_while_idle(&session, &mut state).await;
        if let Some(mut w) = state.worker.take() {
            // A dead zygote took every worker with it, even if its last reports are in flight.
            let zygote_dead = lock(&self.zygote).as_ref().is_none_or(|z| z.is_dead());
            match w.liveness() {
                Liveness::Alive if !zygote_dead => state.worker = Some(w),
                Liveness::Exited(status) => {
                    state.pending_notice = Some(format!(
                        "this session's worker {status} while idle; variables and imports were lost (files are kept)"
                    ));
                }
                Liveness::Alive | Liveness::ZygoteGone => {
                    state.pending_notice = Some(
                        "this session's state was lost: the Python zygote (the process that starts every worker) died, and its workers with it; this run uses a fresh worker from a new zygote (variables and imports start fresh, files are kept)".into(),
                    );
                }
            }
        }
        session.measure_soon();
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
        link_outputs(
            &mut record,
            &session,
            &self.changes,
            outcome.images,
            started_wall,
        )
        .await;
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
        // The slot is taken before the (slow) spawn, so concurrent calls cannot all pass the cap.
        // The live worker holds it; whatever ends the worker gives it back.
        let slot = loop {
            match self.session_slots.clone().try_acquire_owned() {
                Ok(slot) => break slot,
                Err(_) => self.evict_one_idle_session(&session.name).await?,
            }
        };
        self.spawn_worker_in_slot(session, slot).await
    }

    async fn spawn_worker_in_slot(
        &self,
        session: &Session,
        slot: tokio::sync::OwnedSemaphorePermit,
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
        let mut sandbox = self
            .sandbox
            .plan_for(&session.scratch, &python.python_paths);
        if let (Some(tools), Some(fs)) = (self.local_tools.get(), sandbox.filesystem.as_mut()) {
            fs.read_only.extend(tools.read_grants_for(&session.name));
        }
        let mut env = worker_environment(&session.name, &session.scratch);
        let font_cache = lock(&self.font_cache).clone();
        if let Some(dir) = font_cache.filter(|d| *d != session.scratch) {
            if let Some(fs) = sandbox.filesystem.as_mut() {
                fs.read_only.push(dir.clone());
            }
            env.push(("MPLCONFIGDIR".into(), dir.display().to_string()));
        } else if session.name == FONT_CACHE_BUILD_DIR {
            env.push(("MPLCONFIGDIR".into(), session.scratch.display().to_string()));
        }
        let spec = WorkerSpec {
            session: session.name.clone(),
            scratch: session.scratch.clone(),
            env,
            sandbox,
            mcp_servers: self.proxy.server_summaries(),
            image_budget_bytes: self.settings.image_budget,
        };
        let spawn_started = Instant::now();
        let spawned = zygote
            .spawn_worker(spec)
            .await
            .map_err(|e| RunRefusal::WorkerStart(format!("{e:#}")))?;
        let forked_ms = spawn_started.elapsed().as_secs_f64() * 1000.0;
        let mut worker = LiveWorker::new(spawned, slot, self.settings.image_budget)
            .map_err(|e| RunRefusal::WorkerStart(e.to_string()))?;
        let budget = worker.image_budget_bytes;
        let ready = tokio::time::timeout(WORKER_READY_TIMEOUT, async {
            loop {
                let f = match worker.frames.next().await {
                    Some(Ok(f)) => f,
                    Some(Err(e)) => {
                        return Err(oversized_frame(&e).map_or_else(|| e.to_string(), |v| v.to_string()));
                    }
                    None => return Err("the worker exited during setup".into()),
                };
                match frame::decode_worker_frame(&f, budget) {
                    Ok(WorkerFrame::Message(FromWorker::Ready {
                        missing_layers,
                        lockdown_us,
                        ..
                    })) => {
                        let mut recent = lock(&self.recent_lockdown_us);
                        if recent.len() >= 64 {
                            recent.remove(0);
                        }
                        recent.push(lockdown_us);
                        return Ok(missing_layers);
                    }
                    Ok(WorkerFrame::Message(FromWorker::Fatal { message })) => return Err(message),
                    Ok(WorkerFrame::Stdout(b)) | Ok(WorkerFrame::Stderr(b)) => {
                        let shown = &b[..b.len().min(2048)];
                        tracing::warn!(output = %String::from_utf8_lossy(shown), "worker wrote during setup");
                    }
                    Ok(WorkerFrame::Message(_)) => {
                        return Err(Violation("a message other than `ready` during setup".into()).to_string());
                    }
                    Err(v) => return Err(v.to_string()),
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
                w.kill().await;
            }
            let had_files = s.scratch.exists();
            self.empty_scratch(&s).await;
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

        let run = ToWorker::Run {
            id: run_no,
            code: code.to_string(),
        };
        match frame::json_body(&run).map(|body| worker.send(body)) {
            Ok(Ok(())) | Ok(Err(SendError::Gone)) => {} // a gone worker shows as the socket's end
            Ok(Err(SendError::NotReading)) => {
                if let Some(w) = state.worker.take() {
                    w.kill().await;
                }
                let why = "the worker stopped reading its session socket and was killed";
                return CellOutcome::lost(
                    stdout,
                    stderr,
                    RunStatus::Crashed,
                    why.into(),
                    Some(why.into()),
                );
            }
            Err(e) => {
                let why = format!("the cell could not be encoded: {e}");
                return CellOutcome::lost(stdout, stderr, RunStatus::Crashed, why, None);
            }
        }

        let deadline = tokio::time::Instant::now() + timeout;
        let mut stopping: Option<(RunStatus, tokio::time::Instant)> = None;
        // Summaries of the proxied calls this cell made; their answers go straight to the
        // worker's writer, so the loop below never waits on the worker's socket.
        let (summaries_tx, mut summaries_rx) =
            tokio::sync::mpsc::unbounded_channel::<CallSummary>();
        // The quota is measured in the background; its verdict wakes this loop.
        let mut quota_verdict_rx = session.over_quota.subscribe();
        quota_verdict_rx.mark_changed();
        let cell_started = tokio::time::Instant::now();
        let mut progress_tick =
            tokio::time::interval_at(cell_started + PROGRESS_EVERY, PROGRESS_EVERY);
        while let Some(worker) = state.worker.as_mut() {
            let wake_at = stopping.map(|(_, kill_at)| kill_at).unwrap_or(deadline);
            let event = tokio::select! {
                next = worker.frames.next() => CellEvent::Frame(next),
                _ = tokio::time::sleep_until(wake_at) => CellEvent::Wake,
                Some(call) = summaries_rx.recv() => CellEvent::Call(call),
                _ = progress_tick.tick(), if progress.is_some() => CellEvent::Progress,
                Ok(()) = quota_verdict_rx.changed() => CellEvent::QuotaCheck,
                _ = cancel.cancelled(), if stopping.is_none() => CellEvent::Cancel,
            };
            match event {
                CellEvent::Frame(Some(Ok(f))) => {
                    let message = match frame::decode_worker_frame(&f, worker.image_budget_bytes) {
                        Ok(WorkerFrame::Stdout(b)) => {
                            stdout.push(b);
                            None
                        }
                        Ok(WorkerFrame::Stderr(b)) => {
                            stderr.push(b);
                            None
                        }
                        Ok(WorkerFrame::Message(m)) => Some(m),
                        Err(v) => return end_for_violation(state, stdout, stderr, v).await,
                    };
                    match message {
                        None => {}
                        Some(FromWorker::Request { id, method, params }) => {
                            let Some(slot) = worker.request_slot() else {
                                let v = Violation(format!(
                                    "more than {} bridge requests open at once",
                                    frame::MAX_INFLIGHT_REQUESTS
                                ));
                                return end_for_violation(state, stdout, stderr, v).await;
                            };
                            // Proxied calls run concurrently; an answer may outlive this cell.
                            let proxy = self.proxy.clone();
                            let session_name = session.name.clone();
                            let memory = self.memory.clone();
                            let local_tools = self.local_tools.get().cloned();
                            let from = session.name.clone();
                            let summaries = summaries_tx.clone();
                            let answers = worker.answers();
                            tokio::spawn(async move {
                                let (payload, summary) = match method.strip_prefix("memory.") {
                                    // The host does the file I/O, off the async runtime.
                                    Some(op) => {
                                        let op = op.to_string();
                                        let answer = tokio::task::spawn_blocking(move || {
                                            memory.handle(&op, &params)
                                        })
                                        .await
                                        .unwrap_or_else(|e| {
                                            serde_json::json!({"error": {"kind": "unavailable", "message": e.to_string()}})
                                        });
                                        (answer, None)
                                    }
                                    None => match method.strip_prefix("tools.") {
                                        Some(op) => {
                                            let answer = crate::local_tools::handle_request(
                                                local_tools,
                                                from,
                                                op.to_string(),
                                                params,
                                            );
                                            (answer.await, None)
                                        }
                                        None => proxy.handle(&session_name, &method, &params).await,
                                    },
                                };
                                if let Some(call) = summary {
                                    let _ = summaries.send(call);
                                }
                                match frame::json_body(&ToWorker::Response { id, payload }) {
                                    Ok(body) => {
                                        let _ = answers
                                            .send(Outgoing {
                                                body,
                                                _slot: Some(slot),
                                            })
                                            .await;
                                    }
                                    Err(e) => {
                                        tracing::warn!(error = %e, "encoding an answer failed")
                                    }
                                }
                            });
                        }
                        Some(FromWorker::Done { id, .. }) if id != run_no => {
                            let v = Violation(format!(
                                "a `done` frame for run {id} while run {run_no} is running"
                            ));
                            return end_for_violation(state, stdout, stderr, v).await;
                        }
                        Some(FromWorker::Done {
                            status,
                            result,
                            error,
                            exit_code,
                            images,
                            ..
                        }) => {
                            // Calls answered before `done` were summarized before their answer.
                            while let Ok(call) = summaries_rx.try_recv() {
                                calls.push(call);
                            }
                            let status = match (stopping, status) {
                                (Some((RunStatus::OutputLimit, _)), _) => RunStatus::OutputLimit,
                                (Some((reason, _)), CellStatus::Interrupted) => reason,
                                (_, CellStatus::Ok) => RunStatus::Ok,
                                (_, CellStatus::Error) | (_, CellStatus::Interrupted) => {
                                    RunStatus::Error
                                }
                                (_, CellStatus::Exit) => RunStatus::Exit,
                            };
                            let error = if matches!(
                                status,
                                RunStatus::Timeout | RunStatus::Cancelled | RunStatus::OutputLimit
                            ) {
                                None
                            } else {
                                error
                            };
                            let mut done = CellOutcome::finished(
                                stdout, stderr, status, result, error, exit_code,
                            );
                            // Only images that really are files in the session are linked.
                            done.images = images
                                .into_iter()
                                .filter(|img| is_regular_file_beneath(&session.scratch, &img.path))
                                .collect();
                            return done;
                        }
                        Some(other) => {
                            let what = match other {
                                FromWorker::Ready { .. } => "ready",
                                _ => "fatal",
                            };
                            let v = Violation(format!("a `{what}` message in the middle of a run"));
                            return end_for_violation(state, stdout, stderr, v).await;
                        }
                    }
                    if stopping.is_none() && stdout.total() + stderr.total() > s.max_output_bytes {
                        worker.signal(Signal::SIGINT);
                        stopping = Some((
                            RunStatus::OutputLimit,
                            tokio::time::Instant::now() + s.interrupt_grace,
                        ));
                    }
                }
                CellEvent::Frame(Some(Err(e))) if oversized_frame(&e).is_some() => {
                    let v = oversized_frame(&e).unwrap_or_else(|| Violation(e.to_string()));
                    return end_for_violation(state, stdout, stderr, v).await;
                }
                CellEvent::Frame(_) => {
                    // The worker is gone mid-cell.
                    let Some(w) = state.worker.take() else { break };
                    let exit = w.wait_exit().await;
                    let why = exit.map(|e| e.to_string()).unwrap_or_else(|| {
                        "ended (its exit status is unknown: the zygote that reports it is gone)"
                            .into()
                    });
                    let status = match stopping {
                        Some((reason, _)) => reason,
                        None => RunStatus::Crashed,
                    };
                    let reason = crash_reason(exit);
                    return CellOutcome::lost(
                        stdout,
                        stderr,
                        status,
                        format!("the worker process {why}{reason}"),
                        Some(why),
                    );
                }
                CellEvent::Wake => match stopping {
                    None => {
                        worker.signal(Signal::SIGINT);
                        stopping = Some((
                            RunStatus::Timeout,
                            tokio::time::Instant::now() + s.interrupt_grace,
                        ));
                    }
                    Some((reason, _)) => {
                        let Some(w) = state.worker.take() else { break };
                        w.kill().await;
                        let why = format!(
                            "did not stop within {:.1} s of an interrupt and was killed",
                            s.interrupt_grace.as_secs_f64()
                        );
                        return CellOutcome::lost(
                            stdout,
                            stderr,
                            reason,
                            format!("the worker {why}"),
                            Some(why),
                        );
                    }
                },
                CellEvent::Call(call) => calls.push(call),
                CellEvent::Progress => {
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
                }
                CellEvent::QuotaCheck => {
                    let verdict = quota_verdict_rx.borrow_and_update().clone();
                    if let Some(over) = verdict {
                        let Some(w) = state.worker.take() else { break };
                        w.kill().await;
                        let removal = self.empty_scratch(session).await;
                        let why = format!("killed: {over}; {}", removal_outcome(&removal));
                        return CellOutcome::lost(
                            stdout,
                            stderr,
                            RunStatus::ScratchQuota,
                            why.clone(),
                            Some(why),
                        );
                    }
                }
                CellEvent::Cancel => {
                    worker.signal(Signal::SIGINT);
                    stopping = Some((
                        RunStatus::Cancelled,
                        tokio::time::Instant::now() + s.interrupt_grace,
                    ));
                }
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

/// What woke a running cell's loop.
enum CellEvent {
    Frame(Option<std::io::Result<bytes::BytesMut>>),
    Wake,
    Call(CallSummary),
    Progress,
    QuotaCheck,
    Cancel,
}

/// A read error that is the worker's doing: a frame header claiming more than the cap.
fn oversized_frame(e: &std::io::Error) -> Option<Violation> {
    (e.kind() == std::io::ErrorKind::InvalidData)
        .then(|| Violation(format!("a frame the host cannot accept ({e})")))
}

/// Kills a worker that broke the session protocol and reports it as this run's outcome.
async fn end_for_violation(
    state: &mut SessionState,
    stdout: StreamCollector,
    stderr: StreamCollector,
    v: Violation,
) -> CellOutcome {
    tracing::warn!(error = %v, "killing a worker that broke the session protocol");
    let exit = match state.worker.take() {
        Some(w) => w.kill().await,
        None => None,
    };
    let how = exit.map(|e| format!(" ({e})")).unwrap_or_default();
    let mut outcome = CellOutcome::lost(
        stdout,
        stderr,
        RunStatus::Crashed,
        format!("{v}; the worker was killed{how}"),
        Some(format!("{v}; it was killed")),
    );
    if let Some(e) = outcome.record.error.as_mut() {
        e.kind = "ProtocolViolation".into();
    }
    outcome
}

/// Whether `rel` names a regular file beneath the session directory `root`, reached without
/// following any symlink (an image path the worker named is linked only then).
fn is_regular_file_beneath(root: &Path, rel: &str) -> bool {
    use nix::fcntl::OFlag;
    let Ok(dir) = host_fs::open_session_dir(root) else {
        return false;
    };
    host_fs::open_beneath(
        dir.as_fd(),
        Path::new(rel),
        OFlag::O_PATH | OFlag::O_CLOEXEC,
        nix::sys::stat::Mode::empty(),
    )
    .and_then(|f| nix::sys::stat::fstat(&f).map_err(std::io::Error::from))
    .is_ok_and(|st| host_fs::is_regular(&st))
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
async fn link_outputs(
    record: &mut RunRecord,
    session: &Session,
    changes: &Arc<crate::files::ChangeTracker>,
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
    let (dir, name, changes) = (
        session.scratch.clone(),
        session.name.clone(),
        changes.clone(),
    );
    let listed = tokio::task::spawn_blocking(move || changes.changed(&name, &dir, since, 50))
        .await
        .unwrap_or_else(|e| crate::files::Changes {
            files: Vec::new(),
            incomplete: Some(format!("the listing failed: {e}")),
            method: "none",
        });
    tracing::debug!(session = %session.name, method = listed.method, "listed the run's files");
    let (files, incomplete) = (listed.files, listed.incomplete);
    if let Some(why) = incomplete {
        record.notices.push(format!(
            "the list of changed files may be incomplete: {why}"
        ));
    }
    record.files = files
        .into_iter()
        .filter(|f| !shown.contains(&f.path))
        .collect();
}

/// Measures a session directory against `quota`, off the async runtime (the walk stops just
/// past the quota, so its cost is bounded by it: every entry counts at least 4 KiB).
async fn scratch_usage(dir: PathBuf, quota: u64) -> Usage {
    let measured = tokio::task::spawn_blocking(move || match host_fs::open_session_dir(&dir) {
        Ok(fd) => host_fs::usage(fd.as_fd(), quota),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Usage::Measured {
            bytes: 0,
            entries: 0,
        },
        Err(e) => Usage::Unmeasurable(format!("{}: {e}", dir.display())),
    })
    .await;
    measured.unwrap_or_else(|e| Usage::Unmeasurable(e.to_string()))
}

/// Why a session directory is over its quota, if it is. A directory that cannot be measured
/// (e.g. the code made one unreadable) counts as over: an unknown size is not a small one.
fn quota_verdict(usage: Usage, quota: u64) -> Option<String> {
    match usage {
        Usage::Measured { .. } => None,
        Usage::Over { entries, .. } => Some(format!(
            "the session directory grew past its quota ({} MiB; counted: {entries} files and directories, each at least {} KiB)",
            quota >> 20,
            host_fs::BYTES_PER_INODE >> 10
        )),
        Usage::Unmeasurable(why) => Some(format!(
            "the session directory could not be measured against its quota ({} MiB): {why}",
            quota >> 20
        )),
    }
}

/// Says what became of a session's files after a removal.
fn removal_outcome(removal: &host_fs::Removal) -> String {
    if removal.is_complete() {
        "its files were removed".into()
    } else {
        format!("removing its files failed: {}", removal.summary())
    }
}

/// Removes a directory tree off the async runtime, fd-relative and without following
/// symlinks, and logs what could not be removed.
async fn remove_scratch(dir: PathBuf) -> host_fs::Removal {
    let shown = dir.display().to_string();
    let removal = tokio::task::spawn_blocking(move || host_fs::remove_tree(&dir))
        .await
        .unwrap_or_else(|e| host_fs::Removal {
            removed: 0,
            failures: vec![format!("the removal failed: {e}")],
        });
    if !removal.is_complete() {
        tracing::warn!(dir = %shown, "{}", removal.summary());
    }
    removal
}

/// Runs the quota watch (and drains the change tracker's queue) for as long as the manager
/// exists (only inside a tokio runtime).
fn enforce_scratch_quotas_periodically(manager: &Arc<SessionManager>) {
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return;
    };
    let weak = Arc::downgrade(manager);
    runtime.spawn(async move {
        let mut tick = tokio::time::interval(QUOTA_WATCH_TICK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let Some(manager) = weak.upgrade() else { break };
            manager.changes.drain();
            manager.enforce_scratch_quotas().await;
        }
    });
}

impl SessionManager {
    /// The quota watch: measures every session with a live worker that is due (a running one
    /// every [`QUOTA_CHECK_EVERY`], an idle one every [`IDLE_QUOTA_CHECK_EVERY`], never sooner
    /// than [`QUOTA_WALK_SPACING`] times its last walk), off the async runtime and off every
    /// run's path. A directory over quota gets its verdict; an idle session is then stopped
    /// here, a running one by its cell loop, which the verdict wakes.
    pub async fn enforce_scratch_quotas(&self) {
        let quota = self.sandbox.scratch_quota_bytes();
        let sessions: Vec<Arc<Session>> = lock(&self.sessions).values().cloned().collect();
        for s in sessions {
            let busy = match s.state.try_lock() {
                Ok(st) if st.worker.is_none() => continue, // nothing writes to it
                Ok(_) => false,
                Err(_) => true, // a run holds it, so it has a worker
            };
            if *lock(&s.next_quota_check) > Instant::now() {
                continue;
            }
            let generation = s.generation.load(Ordering::SeqCst);
            let started = Instant::now();
            let usage = scratch_usage(s.scratch.clone(), quota).await;
            let every = if busy {
                QUOTA_CHECK_EVERY
            } else {
                IDLE_QUOTA_CHECK_EVERY
            };
            let took = started.elapsed();
            *lock(&s.last_quota_walk) = took;
            *lock(&s.next_quota_check) = Instant::now() + every.max(took * QUOTA_WALK_SPACING);
            let Some(over) = quota_verdict(usage, quota) else {
                continue;
            };
            // Emptied while it was measured: the new directory is measured next time. (The
            // check runs under the verdict's lock, which emptying takes to bump the generation.)
            let published = s.over_quota.send_if_modified(|v| {
                let current = s.generation.load(Ordering::SeqCst) == generation;
                if current {
                    *v = Some(over);
                }
                current
            });
            if !published {
                continue;
            }
            if let Ok(mut state) = s.state.try_lock() {
                self.enforce_quota_while_idle(&s, &mut state).await;
            }
        }
    }

    /// Acts on the quota watch's verdict between runs: kills the session's worker, removes the
    /// files, and leaves the reason for the session's next run. Cheap when there is none.
    async fn enforce_quota_while_idle(&self, session: &Session, state: &mut SessionState) {
        let Some(over) = session.over_quota.borrow().clone() else {
            return;
        };
        if let Some(w) = state.worker.take() {
            w.kill().await; // returns its session slot
        }
        let removal = self.empty_scratch(session).await;
        tracing::warn!(session = %session.name, "worker killed between runs: {over}");
        state.pending_notice = Some(format!(
            "this session's worker was killed between runs: {over} (code left running after a run kept writing); variables and imports were lost, {}",
            removal_outcome(&removal)
        ));
    }

    /// Removes everything in a session's directory; a quota verdict about the old contents
    /// and the change tracker's watches go with it.
    async fn empty_scratch(&self, session: &Session) -> host_fs::Removal {
        let clear = |v: &mut Option<String>| {
            session.generation.fetch_add(1, Ordering::SeqCst);
            *v = None;
        };
        session.over_quota.send_modify(clear);
        self.changes.forget(&session.name);
        let removal = remove_scratch(session.scratch.clone()).await;
        session.over_quota.send_modify(clear);
        removal
    }
}

impl SessionManager {
    /// Builds matplotlib's font cache once for this server, so a new session's first plot does
    /// not spend a second rebuilding it in its own HOME. A worker (sandboxed like any other, but
    /// running only [`FONT_CACHE_BUILD_CODE`]) builds it in a directory of its own, seeded with
    /// the previous server's cache; the host then moves the `fontlist-*.json` files it finds
    /// (regular files only, no symlinks) into `sessions-<pid>/@font-cache`, which every later
    /// worker reads as `MPLCONFIGDIR` (read-only by Landlock), and keeps a copy in the state dir.
    /// Without matplotlib, or if anything fails, workers simply keep their own caches.
    async fn build_font_cache(self: &Arc<Self>) {
        let build = self.root.join(FONT_CACHE_BUILD_DIR);
        let kept = self.state_dir().join(FONT_CACHE_KEPT_DIR);
        let seeded = {
            let (build, kept) = (build.clone(), kept.clone());
            tokio::task::spawn_blocking(move || {
                std::fs::create_dir_all(&build)?;
                set_private(&build);
                for (name, data) in font_cache_files(&kept) {
                    std::fs::write(build.join(name), data)?;
                }
                std::io::Result::Ok(())
            })
            .await
        };
        if !matches!(seeded, Ok(Ok(()))) {
            tracing::debug!("cannot prepare the font cache build: {seeded:?}");
            return;
        }
        // A slot of its own: the builder never takes a session's place under the cap (it is one
        // worker more for about a second, once per server).
        let Ok(slot) = Arc::new(Semaphore::new(1)).try_acquire_owned() else {
            return;
        };
        let session = Session::new(FONT_CACHE_BUILD_DIR.into(), build.clone());
        self.font_cache_building.store(true, Ordering::SeqCst);
        let worker = match self.spawn_worker_in_slot(&session, slot).await {
            Ok(w) => w,
            Err(e) => {
                self.font_cache_building.store(false, Ordering::SeqCst);
                tracing::debug!("no font cache: {e}");
                return;
            }
        };
        let mut state = session.state.lock().await;
        state.worker = Some(worker);
        let started = Instant::now();
        let outcome = self
            .drive_cell(
                &session,
                &mut state,
                Cell {
                    run_no: 0,
                    code: FONT_CACHE_BUILD_CODE,
                    timeout: Duration::from_secs(120),
                    cancel: CancellationToken::new(),
                    progress: None,
                },
            )
            .await;
        if let Some(w) = state.worker.take() {
            w.kill().await;
        }
        self.font_cache_building.store(false, Ordering::SeqCst);
        let result = outcome.record.result.unwrap_or_default();
        let published = if outcome.record.status != RunStatus::Ok || result.contains("absent") {
            tracing::debug!(%result, status = ?outcome.record.status, "no shared font cache");
            None
        } else {
            let (root, build) = (self.root.clone(), build.clone());
            tokio::task::spawn_blocking(move || publish_font_cache(&root, &build, &kept))
                .await
                .ok()
                .flatten()
        };
        remove_scratch(build).await;
        if let Some(dir) = published {
            tracing::info!(
                dir = %dir.display(),
                ms = started.elapsed().as_millis() as u64,
                "matplotlib's font cache is shared by new sessions"
            );
            *lock(&self.font_cache) = Some(dir);
        }
    }
}

/// The `fontlist-*.json` regular files directly in `dir` (no symlinks), with their contents.
fn font_cache_files(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let Ok(fd) = host_fs::open_session_dir(dir) else {
        return Vec::new();
    };
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for e in entries.flatten() {
        let Some(name) = e.file_name().to_str().map(str::to_string) else {
            continue;
        };
        if !(name.starts_with("fontlist-") && name.ends_with(".json")) {
            continue;
        }
        if let Ok(data) = host_fs::read_regular_file(fd.as_fd(), Path::new(&name), 64 << 20) {
            out.push((name, data));
        }
    }
    out
}

/// Copies the font cache the builder made into `root/@font-cache` (and the state dir, for the
/// next server); returns the shared directory if it holds a font list.
fn publish_font_cache(root: &Path, build: &Path, kept: &Path) -> Option<PathBuf> {
    let files = font_cache_files(build);
    if files.is_empty() {
        return None;
    }
    let shared = root.join(FONT_CACHE_DIR);
    let staging = root.join(format!("{FONT_CACHE_DIR}.new"));
    let _ = host_fs::remove_tree(&staging);
    std::fs::create_dir(&staging).ok()?;
    set_private(&staging);
    for (name, data) in &files {
        std::fs::write(staging.join(name), data).ok()?;
    }
    std::fs::rename(&staging, &shared).ok()?;
    if std::fs::create_dir_all(kept).is_ok() {
        set_private(kept);
        for (name, data) in &files {
            let tmp = kept.join(format!(".{name}.{}", std::process::id()));
            if std::fs::write(&tmp, data).is_ok() {
                let _ = std::fs::rename(&tmp, kept.join(name));
            }
        }
    }
    Some(shared)
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
            let removal = host_fs::remove_tree(&entry.path());
            if !removal.is_complete() {
                tracing::warn!(dir = %entry.path().display(), "{}", removal.summary());
            }
        }
    }
}

/// Makes a directory the host created private (0700), without following a symlink.
fn set_private(dir: &Path) {
    let opened = nix::fcntl::open(
        dir,
        nix::fcntl::OFlag::O_RDONLY
            | nix::fcntl::OFlag::O_DIRECTORY
            | nix::fcntl::OFlag::O_NOFOLLOW
            | nix::fcntl::OFlag::O_CLOEXEC,
        nix::sys::stat::Mode::empty(),
    );
    let result = opened.and_then(|fd| {
        nix::sys::stat::fchmod(&fd, nix::sys::stat::Mode::from_bits_truncate(0o700))
    });
    if let Err(e) = result {
        tracing::warn!(dir = %dir.display(), error = %e, "cannot make the directory private");
    }
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
