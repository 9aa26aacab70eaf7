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
use crate::router::Router;
pub use crate::run::{Progress, RunRefusal, RunRequest};
use crate::sandbox::Sandbox;
use crate::zygote::{ExitInfo, WorkerSpec, Zygote, ZygoteInfo};
use std::os::fd::AsFd;

mod cell;
mod dirs;
mod font_cache;
mod fork;
mod fork_guard;
mod fork_queue;
mod idle;
mod leftover;
mod live;
mod outcome;
mod pool;
mod pool_dirs;
mod quota;
mod resident;
pub(crate) use resident::has_ended;
mod spawn;
mod warm;
use cell::Cell;
use dirs::{remove_sessions_of_dead_servers, set_private};
use font_cache::FONT_CACHE_BUILD_DIR;
use live::{FrameOrExit, LiveWorker, Liveness, Outgoing, SendError};
use outcome::link_outputs;
use quota::{enforce_scratch_quotas_periodically, guard_free_disk_periodically, remove_scratch};

/// How long a new worker may take to report `ready`.
const WORKER_READY_TIMEOUT: Duration = Duration::from_secs(15);
/// The longest the work a server starts with (the font cache, then the pool) waits for the
/// first run's answer (see `Pool::after_first_answer`).
const STARTUP_WORK_DEFER: Duration = Duration::from_secs(1);
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
/// An idle session whose worker has not run since its last measurement is not walked again
/// (see `quota.rs`), except once in this long.
const QUOTA_RESYNC_EVERY: Duration = Duration::from_secs(60);

/// How often a running cell reports progress.
const PROGRESS_EVERY: Duration = Duration::from_secs(1);

struct SessionState {
    worker: Option<LiveWorker>,
    /// Told to the model in the next run of this session (why its state was lost).
    pending_notice: Option<String>,
    /// A new fork's notes for its first result (what its parent's descriptors became).
    fork_notes: Option<Vec<String>>,
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
    /// Its worker's CPU time when its last measurement began (see `quota.rs`).
    quota_mark: Mutex<Option<quota::WorkerMark>>,
    /// Its idle worker's CPU time at the free-disk guard's last two looks, older first: a
    /// worker whose clock has not moved since the older one wrote nothing since (see
    /// `SessionManager::guard_free_disk`).
    disk_marks: Mutex<[Option<quota::WorkerMark>; 2]>,
    /// The sessions it was forked from, nearest first (empty: not a fork).
    lineage: Mutex<Vec<String>>,
    /// The forks its running cell asked for with `mcp.fork`, made when the run ends.
    queued_forks: Mutex<Vec<String>>,
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
                fork_notes: None,
            }),
            last_used: Mutex::new(Instant::now()),
            over_quota: tokio::sync::watch::Sender::new(None),
            generation: AtomicU64::new(0),
            next_quota_check: Mutex::new(Instant::now()),
            last_quota_walk: Mutex::new(Duration::ZERO),
            quota_mark: Mutex::new(None),
            disk_marks: Mutex::new([None, None]),
            lineage: Mutex::new(Vec::new()),
            queued_forks: Mutex::new(Vec::new()),
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
    /// Where workers' bridge requests go (the proxy, memory, local tools, change tracking,
    /// package installs).
    router: Arc<Router>,
    /// `%pip install`: the package store, each session's installs, the workers' views.
    packages: Arc<crate::packages::Packages>,
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
    /// The free-disk guard's state (see [`quota::DiskGuard`]).
    disk_guard: quota::DiskGuard,
    /// Which files each run created or changed, without walking the session each time.
    changes: Arc<crate::files::ChangeTracker>,
    /// matplotlib's font cache, built once per server (see [`font_cache::FontCache`]).
    font_cache: font_cache::FontCache,
    /// Pre-forked spare workers (see [`pool`]).
    pool: pool::Pool,
    /// The memory watch's last reading of each live worker's CPU clock (see [`resident`]).
    memory_marks: Mutex<HashMap<i32, quota::WorkerMark>>,
    /// The root of the cancellation tree: every background task of the manager (quota watch,
    /// font cache, pool, idle expiry) and every job stops when it fires.
    stop: CancellationToken,
    /// The background tasks, so shutdown can wait for them to end.
    tasks: tokio_util::task::TaskTracker,
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
    ///
    /// Long on purpose: the manager's construction, field by field, and the background tasks it
    /// starts.
    pub fn start(settings: Settings, exe: PathBuf) -> anyhow::Result<Arc<SessionManager>> {
        let state_dir = settings.prepare_state_dir()?;
        if let Some(fs) = crate::config::memory_backed_state_dir(&state_dir) {
            tracing::warn!(
                "{}",
                crate::config::memory_backed_state_dir_warning(&state_dir, fs)
            );
        }
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
                    &sandbox.worker_groups(),
                    &state_dir.join(crate::zygote::CODE_CACHE_DIR),
                )?))
            }
            Err(e) => {
                tracing::error!("{e}");
                None
            }
        };
        let session_slots = Arc::new(Semaphore::new(settings.max_sessions as usize));
        let pool_size = settings.pool_size as usize;
        let plot_spare = settings.plot_spare && settings.warm_plots;
        crate::config::report_not_applicable_variables(&settings);
        let changes = Arc::new(crate::files::ChangeTracker::new());
        let packages = Arc::new(crate::packages::Packages::new(
            &state_dir,
            settings.packages,
            settings.packages_allow.clone(),
            settings.packages_budget,
            python.as_ref().ok().map(|i| i.executable.clone()),
        ));
        let router = Arc::new(Router::new(
            proxy.clone(),
            Arc::new(crate::memory::MemoryStore::new(&state_dir)),
            packages.clone(),
            changes.clone(),
        ));
        let manager = Arc::new(SessionManager {
            packages,
            settings,
            sandbox,
            proxy,
            router,
            python,
            zygote: Mutex::new(zygote),
            sessions: Mutex::new(HashMap::new()),
            session_slots,
            recent_lockdown_us: Mutex::new(Vec::new()),
            run_counter: AtomicU64::new(0),
            root,
            disk_guard: quota::DiskGuard::default(),
            changes,
            font_cache: font_cache::FontCache::default(),
            pool: pool::Pool::new(pool_size, plot_spare),
            memory_marks: Mutex::new(HashMap::new()),
            stop: CancellationToken::new(),
            tasks: tokio_util::task::TaskTracker::new(),
        });
        let forks: std::sync::Weak<SessionManager> = Arc::downgrade(&manager);
        manager.router.set_forks(forks);
        if tokio::runtime::Handle::try_current().is_ok() {
            enforce_scratch_quotas_periodically(&manager);
            guard_free_disk_periodically(&manager);
            resident::watch_memory_periodically(&manager);
            let m = manager.clone();
            manager.spawn_until_stopped(async move {
                m.pool.after_first_answer(STARTUP_WORK_DEFER).await;
                m.build_font_cache().await;
                m.font_cache.settled.send_replace(true);
            });
        }
        Ok(manager)
    }

    /// Runs `task` in the background until it ends or the manager stops; shutdown waits for it.
    fn spawn_until_stopped(&self, task: impl Future<Output = ()> + Send + 'static) {
        let stop = self.stop.clone();
        self.tasks.spawn(async move {
            tokio::select! {
                _ = stop.cancelled() => {}
                _ = task => {}
            }
        });
    }

    /// Starts what a long-running server does in the background: the pool of spare workers
    /// (once the font cache is settled, so spares get it) and the expiry of idle sessions.
    pub fn start_background_work(self: &Arc<Self>) {
        if self.pool.size() > 0 {
            let m = self.clone();
            let stop = self.stop.child_token();
            self.spawn_until_stopped(async move {
                let _ = m
                    .font_cache
                    .settled
                    .subscribe()
                    .wait_for(|settled| *settled)
                    .await;
                m.keep_pool_filled(stop).await;
            });
        }
        let m = self.clone();
        self.spawn_until_stopped(async move { m.expire_idle_sessions_periodically().await });
    }

    /// A token that fires when the manager shuts down (jobs run under one).
    pub fn stop_token(&self) -> CancellationToken {
        self.stop.child_token()
    }

    /// The pids of the spare workers waiting in the pool, each with whether it is the plot
    /// spare.
    pub fn spare_pids(&self) -> Vec<(i32, bool)> {
        self.pool.pids()
    }

    /// Whether the pool keeps a plot spare: `IRONCELL_PLOT_SPARE`, with the pool and
    /// `IRONCELL_WARM_PLOTS` on, once the shared font cache is published (never without
    /// matplotlib).
    pub fn plot_spare_kept(&self) -> bool {
        self.pool.has_plot_place() && lock(&self.font_cache.dir).is_some()
    }

    pub fn settings(&self) -> &Settings {
        &self.settings
    }

    /// `%pip install`: the package store and each session's installs.
    pub fn packages(&self) -> &crate::packages::Packages {
        &self.packages
    }

    pub fn sandbox(&self) -> &Sandbox {
        &self.sandbox
    }

    /// The state directory in use (the configured one, or the private fallback).
    pub fn state_dir(&self) -> &Path {
        self.root.parent().unwrap_or(&self.root)
    }

    pub fn local_tools(&self) -> Option<Arc<crate::local_tools::LocalTools>> {
        self.router.local_tools().cloned()
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
        let builder = self.font_cache.building.load(Ordering::SeqCst) as usize;
        (self.settings.max_sessions as usize).saturating_sub(self.session_slots.available_permits())
            + builder
    }

    /// Median lockdown time of the most recent workers, in milliseconds.
    pub fn median_lockdown_ms(&self) -> Option<f64> {
        let mut v = lock(&self.recent_lockdown_us).clone();
        v.sort_unstable();
        v.get(v.len() / 2).map(|us| *us as f64 / 1000.0)
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
                    &self.sandbox.worker_groups(),
                    &self.state_dir().join(crate::zygote::CODE_CACHE_DIR),
                )?);
                // Workers given the shared font cache expect pyplot imported: ask again before
                // any spawn request reaches the new zygote (its report is only logged).
                if let Some(dir) = lock(&self.font_cache.dir)
                    .as_ref()
                    .filter(|_| self.settings.warm_plots)
                {
                    let _ = fresh.warm_plots(dir);
                }
                *z = Some(fresh.clone());
                Ok(fresh)
            }
        }
    }

    /// Stops the proxied servers, kills the zygote (and so every worker) and removes all
    /// scratch directories.
    pub async fn shutdown(&self) {
        self.stop.cancel();
        self.tasks.close();
        self.pool.clear();
        let _ = tokio::time::timeout(Duration::from_secs(1), self.proxy.shutdown()).await;
        if let Some(z) = lock(&self.zygote).as_ref() {
            z.kill();
        }
        // Every task ends at its next await once cancelled; a blocking walk may take longer.
        let _ = tokio::time::timeout(Duration::from_secs(1), self.tasks.wait()).await;
        remove_scratch(self.root.clone()).await;
        self.packages.shut_down();
    }

    fn session(&self, name: &str) -> Arc<Session> {
        let mut table = lock(&self.sessions);
        table
            .entry(name.to_string())
            .or_insert_with(|| Arc::new(Session::new(name.to_string(), self.root.join(name))))
            .clone()
    }

    /// Runs one cell. `cancel` fires when the client cancels the call.
    ///
    /// Long on purpose: the run's steps in the order they happen (refuse, take the session, give
    /// it a worker, feed the cell, keep or drop the worker, link the outputs), under one lock guard
    /// of the session that each step reads.
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
        let session = match &req.fork_from {
            Some(from) => self.fork_session(from, &req.session, &cancel).await?,
            None => self.session(&req.session),
        };
        // Read before the lock: a free-disk stop from here on skips this session (its lock is
        // taken), so this run acts on it (see `guard_free_disk`).
        let disk_stops_seen = self.disk_guard.stops.borrow().0;
        // A run cancelled while it waits for the session (the client's cancel, or the worker
        // that asked for a local tool's run gone) leaves the queue: it never runs later.
        let mut state = tokio::select! {
            biased;
            () = cancel.cancelled() => return Err(RunRefusal::Cancelled),
            state = session.state.lock() => state,
        };
        if cancel.is_cancelled() {
            return Err(RunRefusal::Cancelled);
        }
        *lock(&session.last_used) = Instant::now();

        if req.reset {
            if let Some(w) = state.worker.take() {
                w.kill().await;
            }
            state.pending_notice = None;
            let removal = self.empty_scratch(&session).await;
            self.packages.forget(&session.name);
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
        let mut session_state = crate::output::SessionState::Kept;
        if let Some(mut notes) = state.fork_notes.take() {
            session_state = crate::output::SessionState::Forked;
            // Said in the text the model reads too, not only in the record's `lineage`.
            let lineage = lock(&session.lineage).clone();
            if let Some(parent) = lineage.first() {
                notices.push(format!(
                    "session {:?} is a fork of {parent:?} (lineage: {}): it starts as that session's copy at the end of its last run; the two are independent from here on",
                    session.name,
                    lineage.join(" <- ")
                ));
            }
            notices.append(&mut notes);
        }
        if state.worker.is_none() {
            if let Some(n) = state.pending_notice.take() {
                notices.push(n);
            }
            let w = self.spawn_worker(&session, &req.code).await?;
            state.worker = Some(w);
            // A fresh interpreter from the zygote (a reset, a lost worker): no longer a fork.
            lock(&session.lineage).clear();
            session_state = crate::output::SessionState::Restarted;
            if notices.is_empty() {
                session_state = crate::output::SessionState::New;
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
                    cancel: cancel.clone(),
                    progress: req.progress.as_ref(),
                    disk_stops_seen,
                },
            )
            .await;
        *lock(&session.last_used) = Instant::now();

        let mut record = outcome.record;
        record.session = session.name.clone();
        record.lineage = lock(&session.lineage).clone();
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
            crate::output::SessionState::Lost
        } else {
            session_state
        };
        notices.append(&mut record.notices);
        record.notices = notices;
        if crate::output::may_need_notes(&record) {
            let pid = state.worker.as_ref().filter(|_| record.error.is_some());
            let ctx = self.note_context(pid.map(LiveWorker::pid)).await;
            let notes = crate::output::sandbox_notes(&record, &ctx);
            record.notices.extend(notes);
        }
        // A free-disk stop after the cell ended (its loop no longer listens) still stops this
        // worker, before the session is let go.
        let stop = self.disk_guard.stops.borrow().clone();
        if stop.0 != disk_stops_seen
            && let Some(w) = state.worker.take()
        {
            w.kill().await; // returns its session slot
            state.pending_notice = Some(format!(
                "this session's worker was stopped after its last run: {}; variables and imports were lost",
                stop.1
            ));
        }
        if outcome.worker_lost {
            state.pending_notice = Some(format!(
                "this session's previous worker was lost ({}); variables and imports start fresh (files are kept)",
                outcome.loss_reason.unwrap_or_else(|| "it stopped".into())
            ));
        }
        let queued = std::mem::take(&mut *lock(&session.queued_forks));
        if !queued.is_empty() {
            let notes = self
                .make_queued_forks(&session, state, queued, &cancel)
                .await;
            record.notices.extend(notes);
        }
        self.pool.run_answered();
        Ok(record)
    }

    /// What the notes on a failed run name: the interpreter, the memory limit and what the
    /// worker `pid` holds of it (read on a blocking thread, as the memory watch reads).
    async fn note_context(&self, pid: Option<i32>) -> crate::output::NoteContext {
        let zygote = lock(&self.zygote).clone();
        let version = match zygote {
            Some(z) => tokio::time::timeout(Duration::from_millis(100), z.ready())
                .await
                .ok()
                .and_then(Result::ok)
                .map(|info| info.python_version),
            None => None,
        };
        let held = match pid {
            Some(pid) => {
                tokio::task::spawn_blocking(move || crate::output::data_segment_bytes(pid))
                    .await
                    .ok()
                    .flatten()
            }
            None => None,
        };
        let tmp =
            crate::sandbox::private_tmp::host_status(self.settings.private_tmp, self.state_dir());
        crate::output::NoteContext {
            python: self.python.as_ref().ok().map(|p| p.executable.clone()),
            python_version: version,
            memory_limit: self.sandbox.memory_bytes,
            memory_held: held,
            children_refused: self.sandbox.children(&tmp).err(),
            packages: self.settings.packages != crate::packages::PackagesMode::Off,
        }
    }
}

/// The local tools run their cells in sessions of this manager.
impl crate::local_tools::ToolSessions for SessionManager {
    fn settings(&self) -> &Settings {
        &self.settings
    }

    fn state_dir(&self) -> &Path {
        SessionManager::state_dir(self)
    }

    fn set_local_tools(&self, tools: Arc<crate::local_tools::LocalTools>) {
        self.router.set_local_tools(tools);
    }

    fn local_tools(&self) -> Option<Arc<crate::local_tools::LocalTools>> {
        self.router.local_tools().cloned()
    }

    fn run(
        &self,
        request: RunRequest,
        cancel: CancellationToken,
    ) -> futures::future::BoxFuture<'_, Result<RunRecord, RunRefusal>> {
        Box::pin(SessionManager::run(self, request, cancel))
    }

    fn stop_idle_worker<'a>(&'a self, session: &'a str) -> futures::future::BoxFuture<'a, ()> {
        Box::pin(SessionManager::stop_idle_worker(self, session))
    }

    fn audit(&self) -> Option<Arc<crate::audit::AuditLog>> {
        self.proxy.audit().cloned()
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
