//! Giving a session a worker: a slot under the cap, the spawn request, the `ready` handshake.

use super::*;

impl SessionManager {
    /// Reserves a worker slot (evicting an idle session if all are taken), then hands the
    /// session a pre-forked spare if one fits for its first cell, `first_code`, or spawns a
    /// worker for it.
    pub(super) async fn spawn_worker(
        &self,
        session: &Session,
        first_code: &str,
    ) -> Result<LiveWorker, RunRefusal> {
        // The slot is taken before the (slow) spawn, so concurrent calls cannot all pass the cap.
        // The live worker holds it; whatever ends the worker gives it back.
        let slot = loop {
            match self.session_slots.clone().try_acquire_owned() {
                Ok(slot) => break slot,
                Err(_) => self.evict_one_idle_session(&session.name).await?,
            }
        };
        let slot = match self.take_spare(session, slot, first_code) {
            Ok(mut worker) => {
                let linked = self
                    .packages
                    .attach(&session.name, worker.packages_view.as_deref());
                if let Some(bind) = worker.bind.as_mut() {
                    bind.packages_linked = linked;
                }
                return Ok(worker);
            }
            Err(slot) => slot,
        };
        let _starting = self.pool.session_worker_starts();
        let worker = self
            .spawn_worker_in_slot(Some(&session.name), &session.scratch, slot)
            .await?;
        self.packages
            .attach(&session.name, worker.packages_view.as_deref());
        Ok(worker)
    }

    /// Spawns a worker for the session `name` (`None`: a spare of the pool, which learns its
    /// session later) in the directory `scratch`, and waits for its `ready`.
    ///
    /// Long on purpose: the spawn request, then the `ready` handshake's outcomes one by one (each
    /// ends in its own refusal), in the order they can happen.
    pub(super) async fn spawn_worker_in_slot(
        &self,
        name: Option<&str>,
        scratch: &Path,
        slot: tokio::sync::OwnedSemaphorePermit,
    ) -> Result<LiveWorker, RunRefusal> {
        // A session's worker takes directories made ahead; a spare makes its own (it is forked
        // off any session's path, and taking the stock would make the pool refill it after each
        // spare, beside the next session).
        let (packages_view, forks_area) = self.worker_dirs(scratch, name.is_some())?;
        let zygote = self
            .current_zygote()
            .map_err(|e| RunRefusal::WorkerStart(format!("{e:#}")))?;
        let python = zygote
            .ready()
            .await
            .map_err(|e| RunRefusal::WorkerStart(format!("{e:#}")))?;
        let mut sandbox = self.sandbox.plan_for(scratch, &python.python_paths);
        if let (Some(tools), Some(fs), Some(name)) =
            (self.router.local_tools(), sandbox.filesystem.as_mut(), name)
        {
            fs.read_only.extend(tools.read_grants_for(name));
        }
        let mut env = worker_environment(name.unwrap_or(""), scratch);
        let font_cache = lock(&self.font_cache.dir).clone();
        if let Some(dir) = font_cache.filter(|d| d != scratch) {
            if let Some(fs) = sandbox.filesystem.as_mut() {
                fs.read_only.push(dir.clone());
            }
            env.push(("MPLCONFIGDIR".into(), dir.display().to_string()));
        } else if name == Some(FONT_CACHE_BUILD_DIR) {
            env.push(("MPLCONFIGDIR".into(), scratch.display().to_string()));
        }
        // `%pip install`: an empty directory the worker may only read, on its `sys.path`; the
        // host links the session's packages into it (Landlock grants are fixed at lockdown,
        // which a spare does before it knows its session).
        if let Some(view) = &packages_view {
            if let Some(fs) = sandbox.filesystem.as_mut() {
                fs.read_only.push(view.dir.clone());
            }
            env.push((
                "IRONCELL_PACKAGES_DIR".into(),
                view.dir.display().to_string(),
            ));
        }
        // Where this worker's forks of its session will live: granted now, since Landlock
        // grants are fixed at lockdown (docs/ARCHITECTURE.md, "Forking a session").
        if let (Some(area), Some(fs)) = (&forks_area, sandbox.filesystem.as_mut()) {
            fs.read_write.push(area.clone());
        }
        let spec = WorkerSpec {
            session: name.unwrap_or("").to_string(),
            scratch: scratch.to_path_buf(),
            env,
            sandbox,
            mcp_servers: self.proxy.server_summaries(),
            image_budget_bytes: self.settings.image_budget,
            forks_area: forks_area.clone(),
        };
        let spawn_started = Instant::now();
        let spawned = zygote
            .spawn_worker(spec)
            .await
            .map_err(|e| RunRefusal::WorkerStart(format!("{e:#}")))?;
        let forked_ms = spawn_started.elapsed().as_secs_f64() * 1000.0;
        let mut worker = LiveWorker::new(spawned, slot, self.settings.image_budget)
            .map_err(|e| RunRefusal::WorkerStart(e.to_string()))?;
        worker.packages_view = packages_view;
        worker.forks_area = forks_area;
        let budget = worker.image_budget_bytes;
        let max_frame = frame::max_worker_frame_bytes(budget);
        let pid = worker.pid();
        let ready = tokio::time::timeout(WORKER_READY_TIMEOUT, async {
            let mut gate_listener = false;
            let mut counters = false;
            loop {
                let (f, fds) = match worker.next_setup_frame(max_frame).await {
                    Ok(Some(f)) => f,
                    Ok(None) => return Err("the worker exited during setup".into()),
                    Err(e) => return Err(e.to_string()),
                };
                match frame::decode_worker_frame(&f, budget) {
                    Ok(WorkerFrame::Message(FromWorker::EpollListener {})) if !gate_listener => {
                        gate_listener = true;
                        let Some(listener) = fds.into_iter().next() else {
                            return Err(Violation("`epoll_listener` without its descriptor".into()).to_string());
                        };
                        crate::epoll_gate::supervise(listener, pid, Arc::downgrade(&zygote)).map_err(|e| e.to_string())?;
                    }
                    Ok(WorkerFrame::Message(FromWorker::OutputPipes {})) if worker.output_pipes.is_none() => {
                        let pipes = leftover::OutputPipes::from_worker(fds).map_err(|e| Violation(e).to_string())?;
                        worker.output_pipes = Some(pipes);
                    }
                    Ok(WorkerFrame::Message(FromWorker::MemoryCounters {})) if !counters => {
                        counters = true;
                        resident::keep_memory_counters(pid, fds);
                    }
                    Ok(WorkerFrame::Message(FromWorker::Ready {
                        missing_layers,
                        lockdown_us,
                        ..
                    })) => {
                        // A real worker always passes its two pipes first: one without is refused.
                        if worker.output_pipes.is_none() {
                            return Err(Violation("`ready` before the worker's output pipes".into()).to_string());
                        }
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
                worker.own_tasks = Some(fork_guard::tasks_of(worker.pid()));
                tracing::debug!(
                    session = %name.unwrap_or("(spare)"),
                    pid = worker.pid(),
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
}

/// The whole environment of a worker: fixed values and the session's own directories.
///
/// The zygote runs its BLAS on one thread (it forks, so it must stay single-threaded); a worker's
/// libraries size their thread pools to the CPUs the host may use (numpy's OpenBLAS, OpenMP,
/// MKL read these when they load in the worker; one the zygote preloaded keeps its one thread),
/// numexpr's to one.
pub(super) fn worker_environment(session: &str, scratch: &Path) -> Vec<(String, String)> {
    // Asked once: the standard library reads the cgroup's CPU quota from several files each
    // time, ~0.1 ms on every worker's spawn.
    static CPUS: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    let cpus = CPUS.get_or_init(|| {
        std::thread::available_parallelism()
            .map_or(1, |n| n.get())
            .to_string()
    });
    let mut env: Vec<(String, String)> = crate::zygote::zygote_environment()
        .into_iter()
        .map(|(k, v)| match k {
            "OPENBLAS_NUM_THREADS" | "OMP_NUM_THREADS" | "MKL_NUM_THREADS" => {
                (k.to_string(), cpus.clone())
            }
            _ => (k.to_string(), v.to_string()),
        })
        .collect();
    env.push(("TERM".to_string(), "dumb".to_string()));
    // numexpr (which pandas imports) starts its thread pool at import and keeps it across a
    // fork (OpenBLAS stops its own), which would make every pandas session unforkable
    // (fork_guard.rs): one thread, as pandas' `eval` is rarely the bottleneck.
    env.push(("NUMEXPR_NUM_THREADS".to_string(), "1".to_string()));
    // pyarrow's bundled jemalloc (pandas 3 imports pyarrow) starts a background purging thread
    // at its first allocation, with the same effect: it purges inline instead.
    env.push((
        "JE_ARROW_MALLOC_CONF".to_string(),
        "background_thread:false".to_string(),
    ));
    env.extend(session_environment(session, scratch));
    env
}

/// The variables that name the session and its directory (what a spare learns at hand-off).
pub(super) fn session_environment(session: &str, scratch: &Path) -> Vec<(String, String)> {
    let dir = scratch.display().to_string();
    vec![
        ("HOME".to_string(), dir.clone()),
        ("TMPDIR".to_string(), dir.clone()),
        // polars' streaming engine spills under /var/tmp unless told (it reads no TMPDIR).
        ("POLARS_OOC_SPILL_DIR".to_string(), dir.clone()),
        ("PWD".to_string(), dir),
        ("IRONCELL_SESSION".to_string(), session.to_string()),
    ]
}
