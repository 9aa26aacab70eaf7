//! Forking a live session (`run_python` with `fork_from`): the host's side. The worker's is
//! crates/ironcell-python/src/worker/fork.rs; docs/ARCHITECTURE.md, "Forking a session", has
//! the whole picture and SECURITY.md #193-#199 the argument.
//!
//! Every worker that may fork is granted, at lockdown, a *forks area*: an empty directory the
//! host made (`@forks-N`, mode 0555, so the worker cannot write in it itself; `fchmod` and
//! `chmod` are refused by its filter). Landlock grants are fixed at lockdown, so a fork's
//! directory must lie beneath a grant its parent already holds. For a fork the host makes three
//! directories in the parent's area (the child's directory, the child's forks area, the
//! parent's next forks area); the worker forks, and each side narrows its domain to its own
//! two. Each fork thus costs each side one Landlock layer of the kernel's 16.

use std::io::Write;
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::sync::atomic::AtomicU64;

use super::*;
use ironcell_core::fork_remap;

/// Numbers the forks areas of this server (their names only).
static FORKS_AREAS: AtomicU64 = AtomicU64::new(0);

/// The most Landlock layers a forked session's domain may hold: each fork adds one to both
/// sides, the kernel allows 16, and a session's own children take one more each.
pub(super) const MAX_FORK_LAYERS: u32 = 12;

/// How long a fork may take to say `ready` (it copies the parent's files first).
const FORK_READY_TIMEOUT: Duration = Duration::from_secs(120);
/// How long a fork may take to say it left its parent's group (no code of the session's runs
/// before).
const FORK_HELLO_TIMEOUT: Duration = Duration::from_secs(30);

/// Lineages with a fork under way (their Unix session ids: a fork stays in its parent's
/// session): the orphan sweep spares their fork, which is the zygote's child in a group of its
/// own before the host knows it (`resident.rs`).
pub(super) static FORKING: Mutex<Vec<i32>> = Mutex::new(Vec::new());

/// A fork ordered under the parent's lock and answered by the parent: what is left to do
/// without that lock ([`SessionManager::finish_fork`]).
pub(super) struct Ordered {
    pub(super) to: String,
    slot: tokio::sync::OwnedSemaphorePermit,
    /// The fork's Landlock layers.
    layers: u32,
    /// The fork's lineage, its parent first.
    lineage: Vec<String>,
    packages_view: Option<Arc<crate::packages::View>>,
    child_dir: PathBuf,
    child_forks: PathBuf,
    host_sock: std::os::unix::net::UnixStream,
    /// The host's read ends of the pipes it made for the fork's fd 1 and fd 2.
    output_pipes: leftover::OutputPipes,
    lineage_sid: i32,
    ordered_at: u64,
    started: Instant,
    answered_ms: f64,
    /// Moves the fork's process (by the kernel's word) into its own pids group (as root).
    grouping: Option<tokio::task::JoinHandle<Option<i32>>>,
    /// Keeps the orphan sweep off the fork until it is taken (or refused).
    _forking: NotForking,
    /// Ends the fork's process unless it is taken (SECURITY.md #225).
    ending: fork_guard::EndUnlessTaken,
    /// Removes the fork's directories unless it is taken (after `ending`: its process first).
    dirs: ForkDirs,
}

/// What a fork needs of its parent, read under the parent's lock.
struct Parent {
    pid: i32,
    forks_area: PathBuf,
    layers: u32,
    dir: PathBuf,
    lineage: Vec<String>,
    packages_view: Option<Arc<crate::packages::View>>,
}

impl SessionManager {
    /// Each forked session and its lineage (nearest parent first), by name.
    pub fn forked_sessions(&self) -> Vec<(String, Vec<String>)> {
        let mut forks: Vec<(String, Vec<String>)> = lock(&self.sessions)
            .values()
            .filter_map(|s| {
                let lineage = lock(&s.lineage).clone();
                (!lineage.is_empty()).then(|| (s.name.clone(), lineage))
            })
            .collect();
        forks.sort();
        forks
    }

    /// How many forks a line of forks may hold.
    pub fn max_fork_depth(&self) -> u32 {
        MAX_FORK_LAYERS - 1
    }

    /// A new forks area for a worker about to be spawned, where sessions can fork here (`None`
    /// elsewhere: a fork is then refused with the reason).
    pub(super) fn new_forks_area(&self) -> Option<PathBuf> {
        let tmp =
            crate::sandbox::private_tmp::host_status(self.settings.private_tmp, self.state_dir());
        self.sandbox.children(&tmp).ok()?;
        let n = FORKS_AREAS.fetch_add(1, Ordering::Relaxed);
        let dir = self.root.join(format!("@forks-{n}"));
        match std::fs::DirBuilder::new().mode(0o555).create(&dir) {
            Ok(()) => Some(dir),
            Err(e) => {
                tracing::warn!(dir = %dir.display(), error = %e, "cannot make a forks area");
                None
            }
        }
    }

    /// Makes session `to` a fork of session `from` as `from`'s last run left it, with a live
    /// worker, or says why not. The notes for its first result wait in its state.
    pub(super) async fn fork_session(
        &self,
        from: &str,
        to: &str,
        cancel: &CancellationToken,
    ) -> Result<Arc<Session>, RunRefusal> {
        if !valid_session_name(from) {
            return Err(RunRefusal::InvalidSession(from.to_string()));
        }
        self.fork_name_refusal(from, to)?;
        let Some(parent) = lock(&self.sessions).get(from).cloned() else {
            return Err(RunRefusal::Fork(format!(
                "there is no session {from:?} (run code in it first)"
            )));
        };
        // The parent's lock: its running cell ends first, and it runs nothing while it forks.
        let mut state = parent.state.lock().await;
        let ordered = self.order_fork(&parent, &mut state, to, cancel).await?;
        drop(state);
        self.finish_fork(ordered, cancel).await
    }

    /// Refuses `to` as the name of a fork of `from`: not a name, the parent's own, a session's
    /// or one a running cell asked for with `mcp.fork`.
    pub(super) fn fork_name_refusal(&self, from: &str, to: &str) -> Result<(), RunRefusal> {
        let refuse = |why: String| Err(RunRefusal::Fork(why));
        if !valid_session_name(to) {
            return Err(RunRefusal::InvalidSession(to.to_string()));
        }
        if from == to {
            return refuse(format!("session {to:?} cannot be a fork of itself"));
        }
        let table = lock(&self.sessions);
        if table.contains_key(to) {
            return refuse(format!(
                "session {to:?} exists already; fork into a new session name"
            ));
        }
        if let Some(other) = table
            .values()
            .find(|s| lock(&s.queued_forks).iter().any(|n| n == to))
        {
            return refuse(format!(
                "session {to:?} is the name of a fork that session {:?} asked for with mcp.fork \
                 (made when its run ends); fork into another name",
                other.name
            ));
        }
        Ok(())
    }

    /// Why sessions cannot fork here, for a worker with no forks area.
    pub(super) fn cannot_fork_here(&self) -> String {
        let tmp =
            crate::sandbox::private_tmp::host_status(self.settings.private_tmp, self.state_dir());
        let why = self.sandbox.children(&tmp).err().map_or_else(
            || "its worker started before forking was possible; reset it first".into(),
            |e| e.to_string(),
        );
        format!("sessions cannot fork here: {why}")
    }

    /// Refuses one more fork of `from`, whose worker holds `layers` Landlock layers and has
    /// `ancestors` sessions above it.
    pub(super) fn depth_refusal(from: &str, layers: u32, ancestors: usize) -> Option<String> {
        (layers + 1 > MAX_FORK_LAYERS).then(|| {
            let most = MAX_FORK_LAYERS - 1;
            let forks = layers - 1;
            if forks as usize == ancestors {
                format!(
                    "session {from:?} is {forks} forks deep; a line of forks holds at most {most} \
                     (each fork takes a Landlock layer on both sides, and the kernel allows 16)"
                )
            } else {
                format!(
                    "session {from:?} has taken part in {forks} forks (its own, and its \
                     ancestors' before it was forked) and a session takes part in at most \
                     {most}: each fork takes a Landlock layer from its parent as well as from the \
                     fork, and the kernel allows 16; fork one of its forks instead, or reset it \
                     for a fresh worker"
                )
            }
        })
    }

    /// The refusal of a fork past the live-session cap.
    pub(super) fn cap_refusal(&self) -> String {
        format!(
            "all {} live-session slots are taken (IRONCELL_MAX_SESSIONS); end or reset a \
             session, or raise the cap",
            self.settings.max_sessions
        )
    }

    /// The part of a fork that needs the parent's lock (`state`): the checks in the order a
    /// fork could fail them, the directories, the order, and the parent's answer.
    ///
    /// Long on purpose: each step ends in its own refusal.
    pub(super) async fn order_fork(
        &self,
        parent: &Session,
        state: &mut SessionState,
        to: &str,
        cancel: &CancellationToken,
    ) -> Result<Ordered, RunRefusal> {
        let started_at = Instant::now();
        let from = parent.name.as_str();
        let refuse = |why: String| Err(RunRefusal::Fork(why));
        let alive = state
            .worker
            .as_mut()
            .is_some_and(|w| matches!(w.liveness(), Liveness::Alive));
        let Some(worker) = state.worker.as_mut().filter(|_| alive) else {
            return refuse(format!(
                "session {from:?} has no live Python process (its state is gone); run code in it first"
            ));
        };
        let Some(forks_area) = worker.forks_area.clone() else {
            return refuse(self.cannot_fork_here());
        };
        let ancestors = lock(&parent.lineage).len();
        if let Some(why) = Self::depth_refusal(from, worker.landlock_layers, ancestors) {
            return refuse(why);
        }
        let Ok(slot) = self.session_slots.clone().try_acquire_owned() else {
            return refuse(self.cap_refusal());
        };
        let p = Parent {
            pid: worker.pid(),
            forks_area,
            layers: worker.landlock_layers,
            dir: parent.scratch.clone(),
            lineage: lock(&parent.lineage).clone(),
            packages_view: worker.packages_view.clone(),
        };
        let copy_limit = self
            .fork_fits_on_disk(&p.dir)
            .await
            .map_err(RunRefusal::Fork)?;
        let checked_ms = started_at.elapsed().as_secs_f64() * 1000.0;
        let (child_dir, child_forks, parent_forks) = make_fork_dirs(&p.forks_area, to)
            .map_err(|e| RunRefusal::Fork(format!("making the fork's directories: {e}")))?;
        // From here on, a fork that is not made takes its directories with it.
        let mut dirs = ForkDirs {
            area: p.forks_area.clone(),
            made: vec![child_dir.clone(), child_forks.clone(), parent_forks.clone()],
        };
        let (host_sock, child_sock) = std::os::unix::net::UnixStream::pair()
            .map_err(|e| RunRefusal::Fork(format!("making the fork's socket: {e}")))?;
        // The fork's fd 1 and fd 2 pipes, made here (seccomp keeps a worker from passing
        // descriptors): the host keeps its own read ends (SECURITY.md #277).
        let (output_pipes, pipe_ends) = leftover::OutputPipes::for_a_fork()
            .map_err(|e| RunRefusal::Fork(format!("making the fork's output pipes: {e}")))?;
        let order = ToWorker::Fork(frame::ForkOrder {
            parent_dir: p.dir.clone(),
            parent_forks: parent_forks.clone(),
            child_dir: child_dir.clone(),
            child_forks: child_forks.clone(),
            env: spawn::session_environment(to, &child_dir),
            copy_limit_bytes: Some(copy_limit),
        });
        let body = frame::json_body(&order)
            .map_err(|e| RunRefusal::Fork(format!("encoding the fork order: {e}")))?;
        // The lineage's session id (the first worker's pid: no worker may `setsid`), and when the
        // order went out: the fork's process is checked against both.
        let lineage_sid = resident::stat_fields(p.pid)
            .and_then(|f| f.get(3)?.parse::<i32>().ok())
            .ok_or_else(|| RunRefusal::Fork(format!("session {from:?}'s worker is gone")))?;
        let ordered_at = fork_guard::boot_ticks_now();
        let started = Instant::now();
        let zygote = self
            .current_zygote()
            .map_err(|e| RunRefusal::Fork(format!("{e:#}")))?;
        let socket_ino = nix::sys::stat::fstat(&child_sock).map_or(0, |st| st.st_ino);
        lock(&FORKING).push(lineage_sid);
        let forking = NotForking(lineage_sid);
        // From here on, giving up on the fork (any return, or the call dropped) ends it.
        let line = fork_guard::Line {
            zygote: zygote.pid(),
            sid: lineage_sid,
            socket_ino,
        };
        let ending = fork_guard::EndUnlessTaken::new(line, zygote.clone());
        // The fork's move into its own pids group (as root) comes once the parent's page tables
        // are copied; the kernel's cgroup lock is kept ready until then, so the move does not
        // wait for it (`keep_the_move_lock_ready`: ~8.5 ms median, up to 34 ms, saved).
        let lock_ready = KeepReady::default();
        if self.pids_group().is_some() {
            let stop = lock_ready.0.clone();
            tokio::task::spawn_blocking(move || {
                let most = FORK_HELLO_TIMEOUT.min(Duration::from_secs(5));
                if let Err(e) = crate::sandbox::cgroup::keep_the_move_lock_ready(&stop, most) {
                    tracing::debug!(error = %e, "the cgroup lock is not kept ready for a fork");
                }
            });
        }
        let mut passed = vec![OwnedFd::from(child_sock)];
        passed.extend(pipe_ends);
        if worker.send_passing(body, passed).is_err() {
            return refuse(format!("session {from:?}'s worker is not reading"));
        }
        let parent_ms;
        let parent_forking = super::resident::Forking::start(worker.pid());
        let answered = parent_answer(worker, from).await;
        drop(parent_forking);
        match answered {
            Ok(()) => {
                parent_ms = started.elapsed().as_secs_f64() * 1000.0;
                // The parent's next forks area now, made or not.
                dirs.made.retain(|d| *d != parent_forks);
                worker.forks_area = Some(parent_forks);
                worker.landlock_layers = p.layers + 1;
            }
            Err(why) => {
                // A parent that failed to narrow keeps the fork's directory in reach: it goes.
                if let Some(w) = state.worker.take() {
                    w.kill().await;
                }
                state.pending_notice = Some(format!(
                    "this session's worker was stopped after a failed fork: {why}"
                ));
                return refuse(why);
            }
        }
        // B says it is out of the parent's group; the parent, narrowed now, must run nothing it
        // started before (SECURITY.md #226) for B to go on. Under the parent's lock: a next
        // fork of it would be a child of its own meanwhile.
        let (line, z, given_up) = (ending.line.clone(), zygote.clone(), ending.given_up.clone());
        let (from_name, own_tasks) = (from.to_string(), worker.own_tasks.clone());
        let parent_pid = p.pid;
        let group = self.pids_group();
        let room = self.copy_room(&p.dir);
        let parent_dir = p.dir.clone();
        let runtime = tokio::runtime::Handle::current();
        let (hello_ms, host_sock, grouping) = blocking_unless_cancelled(cancel, move || {
            read_byte(&host_sock, FORK_HELLO_TIMEOUT, "say it started")?;
            drop(lock_ready);
            let hello_ms = started.elapsed().as_secs_f64() * 1000.0;
            // Its own pids group (as root), on a thread of its own while the host checks the
            // parent and the fork sets itself up. Chosen by the kernel's word; `finish_fork`
            // waits for it and checks it is the process that says ready.
            // Read once for both: the parent answered, so it has narrowed.
            let strays = line.strays_now(&z);
            let grouping = fork_guard::Line::fork_process(&strays).map(|pid| {
                runtime.spawn_blocking(move || group.is_none_or(|g| g.move_in(pid)).then_some(pid))
            });
            line.check_parent(&from_name, parent_pid, own_tasks.as_ref(), &strays)?;
            room.check()?;
            if given_up.load(Ordering::SeqCst) {
                return Err("the fork was given up".to_string());
            }
            // With the go-ahead, the runs of the fork's memory to move onto its copies (#305).
            let fork = fork_guard::Line::fork_process(&strays);
            let go = fork_remap::go_ahead(fork, line.zygote, &parent_dir)
                .map_err(|e| format!("session {from_name:?} cannot fork: {e}"))?;
            // Written within the hello's time: a fork that does not read is not waited for.
            let _ = host_sock.set_write_timeout(Some(FORK_HELLO_TIMEOUT));
            (&host_sock)
                .write_all(&go)
                .map_err(|e| format!("the fork ended before it began: {e}"))?;
            let _ = host_sock.set_write_timeout(None);
            Ok((hello_ms, host_sock, grouping))
        })
        .await?;
        tracing::debug!(
            checked_ms,
            parent_ms,
            hello_ms,
            go_ms = started.elapsed().as_secs_f64() * 1000.0,
            "a fork's go-ahead"
        );
        let mut lineage = vec![from.to_string()];
        lineage.extend(p.lineage);
        Ok(Ordered {
            to: to.to_string(),
            slot,
            layers: p.layers + 1,
            lineage,
            packages_view: p.packages_view,
            child_dir,
            child_forks,
            host_sock,
            output_pipes,
            lineage_sid,
            ordered_at,
            started,
            answered_ms: started.elapsed().as_secs_f64() * 1000.0,
            grouping,
            _forking: forking,
            ending,
            dirs,
        })
    }

    /// The rest of a fork, without the parent's lock: the fork's `ready`, its process checked
    /// and taken, its pids group, and the new session in the table.
    pub(super) async fn finish_fork(
        &self,
        o: Ordered,
        cancel: &CancellationToken,
    ) -> Result<Arc<Session>, RunRefusal> {
        let to = o.to.as_str();
        let zygote = self
            .current_zygote()
            .map_err(|e| RunRefusal::Fork(format!("{e:#}")))?;
        let budget = self.settings.image_budget;
        // The fork's move into its own pids group (as root) ends before B runs any Python: the
        // second byte tells B so, and only then does it run the parent's `after_in_child` hooks
        // (a process one starts is then counted and killed with B, not A: SECURITY.md #234).
        let grouped = match o.grouping {
            Some(moving) => moving.await.ok().flatten(),
            None => None,
        };
        let sock = o.host_sock;
        let (pid, notes, host_sock) = blocking_unless_cancelled(cancel, move || {
            (&sock)
                .write_all(b"m")
                .map_err(|e| format!("the fork ended before it ran Python: {e}"))?;
            let (pid, notes) = read_ready(&sock, budget, FORK_READY_TIMEOUT)?;
            Ok((pid, notes, sock))
        })
        .await?;
        let ready_ms = o.started.elapsed().as_secs_f64() * 1000.0;
        let pidfd =
            verified_fork(pid, o.lineage_sid, o.ordered_at, &zygote).map_err(RunRefusal::Fork)?;
        let verified_ms = o.started.elapsed().as_secs_f64() * 1000.0;
        let (process, exit) = zygote
            .adopt(pid, pidfd)
            .map_err(|e| RunRefusal::Fork(format!("{e:#}")))?;
        self.group_and_fit(pid, grouped).await;
        let grouped_ms = o.started.elapsed().as_secs_f64() * 1000.0;
        let spawned = crate::zygote::SpawnedWorker {
            process,
            socket: host_sock,
            exit,
        };
        let mut live = LiveWorker::new(spawned, o.slot, budget)
            .map_err(|e| RunRefusal::Fork(format!("taking the fork: {e}")))?;
        o.ending.taken();
        let mut dirs = o.dirs;
        dirs.made.clear();
        live.own_tasks = Some(fork_guard::tasks_of(pid));
        live.output_pipes = Some(o.output_pipes);
        live.forks_area = Some(o.child_forks);
        live.landlock_layers = o.layers;
        live.packages_view = o.packages_view;
        let from = o.lineage[0].clone();
        let session = Arc::new(Session::new(to.to_string(), o.child_dir));
        *lock(&session.lineage) = o.lineage;
        {
            let mut state = session.state.lock().await;
            state.worker = Some(live);
            state.fork_notes = Some(notes);
        }
        {
            let mut table = lock(&self.sessions);
            if table.contains_key(to) {
                return Err(RunRefusal::Fork(format!(
                    "session {to:?} was made meanwhile"
                )));
            }
            table.insert(to.to_string(), session.clone());
        }
        tracing::debug!(
            from,
            to,
            pid,
            answered_ms = o.answered_ms,
            ready_ms,
            verified_ms,
            grouped_ms,
            taken_ms = o.started.elapsed().as_secs_f64() * 1000.0,
            "session forked"
        );
        Ok(session)
    }

    /// Fits the fork's memory limits, and moves `pid` into its own pids group (as root) if the
    /// process moved before (`grouped`) was another ([`verified_fork`] refused that one).
    async fn group_and_fit(&self, pid: i32, grouped: Option<i32>) {
        resident::fit_fork_memory_at_ready(pid, &self.sandbox).await;
        if grouped != Some(pid)
            && let Some(group) = self.pids_group()
        {
            group.move_in(pid);
        }
        // It stays in its parent's memory group, whose limit grows by a session's (#271).
        if let Some(groups) = self.sandbox.memory_groups()
            && let Err(e) = crate::sandbox::memcg::fork_joined(&groups, pid)
        {
            tracing::warn!(pid, error = %e, "a fork's memory group keeps its limit");
        }
    }

    /// Where a fork's own pids group is made (as root), with its cap.
    fn pids_group(&self) -> Option<PidsGroup> {
        let parent = self.sandbox.pids_cgroup_parent.clone()?;
        let max = self.sandbox.policy.limits.threads.saturating_add(1);
        Some(PidsGroup { parent, max })
    }

    /// Refuses a fork whose copy of `dir` would not fit the scratch quota or the disk; else the
    /// room it fits in ([`CopyRoom::check`]).
    pub(super) async fn fork_fits_on_disk(&self, dir: &Path) -> Result<u64, String> {
        let room = self.copy_room(dir);
        tokio::task::spawn_blocking(move || room.check())
            .await
            .map_err(|e| e.to_string())?
    }

    /// What [`CopyRoom::check`] needs to measure a copy of `dir`.
    fn copy_room(&self, dir: &Path) -> CopyRoom {
        CopyRoom {
            dir: dir.to_path_buf(),
            quota: self.sandbox.scratch_quota_bytes(),
            disk: self.root.clone(),
            floor: self.settings.min_free_disk_bytes,
        }
    }
}

/// A parent's directory measured as a fork would copy it, against a session's quota and the
/// free-disk floor: before the fork is ordered, and again once the parent is checked to run
/// nothing of its own (a thread of it could have grown a sparse file in between: #295).
struct CopyRoom {
    dir: PathBuf,
    quota: u64,
    disk: PathBuf,
    floor: u64,
}

impl CopyRoom {
    /// The room the copy fits in (the quota, and the disk above its floor): the fork copies no
    /// more, as the parent's files can still grow while it copies (SECURITY.md #300).
    fn check(&self) -> Result<u64, String> {
        let fd = host_fs::open_session_dir(&self.dir).map_err(|e| e.to_string())?;
        let used = match host_fs::copy_size(fd.as_fd(), self.quota) {
            Usage::Measured { bytes, .. } => bytes,
            Usage::Over { bytes, .. } => {
                return Err(format!(
                    "a copy of the session's files takes over {} MiB (a sparse file is copied \
                     at its length), past a session's quota of {} MiB",
                    bytes >> 20,
                    self.quota >> 20
                ));
            }
            Usage::Unmeasurable(why) => return Err(format!("its files cannot be measured: {why}")),
        };
        let free = super::quota::free_bytes_on(&self.disk);
        if free.is_some_and(|free| free < used.saturating_add(self.floor)) {
            return Err(format!(
                "copying its files ({} MiB) would leave less than {} MiB free on the state \
                 directory's disk (IRONCELL_MIN_FREE_DISK)",
                used >> 20,
                self.floor >> 20
            ));
        }
        Ok(free.map_or(self.quota, |free| {
            self.quota.min(free.saturating_sub(self.floor))
        }))
    }
}

/// The directories made for a fork in its parent's forks area (`area`, 0555), removed when it
/// is dropped: a fork refused or given up on leaves nothing behind (dropped after the fork's
/// process was killed, which may still be writing into its directory for a moment: retried).
struct ForkDirs {
    area: PathBuf,
    made: Vec<PathBuf>,
}

impl Drop for ForkDirs {
    fn drop(&mut self) {
        if self.made.is_empty() {
            return;
        }
        // A user's host cannot unlink in its 0555 area: writable for the moment it takes.
        let _ = std::fs::set_permissions(&self.area, std::fs::Permissions::from_mode(0o755));
        for dir in &self.made {
            for attempt in 0..3 {
                host_fs::remove_tree(dir);
                if std::fs::symlink_metadata(dir).is_err() {
                    break;
                }
                if attempt < 2 {
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
        }
        let _ = std::fs::set_permissions(&self.area, std::fs::Permissions::from_mode(0o555));
    }
}

/// A fork's own pids group: made in `parent`, capped at `max` tasks.
struct PidsGroup {
    parent: PathBuf,
    max: u64,
}

impl PidsGroup {
    /// Moves process `pid` into a new group of its own; false (logged) if it could not.
    fn move_in(&self, pid: i32) -> bool {
        let started = Instant::now();
        let moved = crate::sandbox::cgroup::move_into_new_pids_group(&self.parent, pid, self.max);
        if let Err(e) = &moved {
            // Gone already (a refused fork): its exit may have been reported before the group
            // was made, which is then removed here.
            crate::sandbox::cgroup::remove_group_of(&self.parent, pid);
            tracing::warn!(pid, error = %e, "a fork stays in its parent's pids group");
        }
        let ms = started.elapsed().as_secs_f64() * 1000.0;
        tracing::debug!(pid, ms, "a fork moved into its own pids group");
        moved.is_ok()
    }
}

/// Takes the worker's pid off [`FORKING`] when the fork is done, however it ends.
struct NotForking(i32);

impl Drop for NotForking {
    fn drop(&mut self) {
        let mut forking = lock(&FORKING);
        if let Some(i) = forking.iter().position(|&p| p == self.0) {
            forking.swap_remove(i);
        }
    }
}

/// Stops [`crate::sandbox::cgroup::keep_the_move_lock_ready`] when dropped: the fork is there to
/// be moved, or given up on.
#[derive(Default)]
struct KeepReady(Arc<std::sync::atomic::AtomicBool>);

impl Drop for KeepReady {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// Makes the fork's directories in the parent's forks area (0555: made writable for the
/// moment it takes, then checked to hold only them): the child's directory (0700), its forks
/// area and the parent's next one (0555). Their names are unpredictable, so nothing the parent
/// made beforehand is taken for them.
fn make_fork_dirs(area: &Path, to: &str) -> std::io::Result<(PathBuf, PathBuf, PathBuf)> {
    let tag: u64 = rand_tag();
    let child = area.join(format!("{to}-{tag:016x}"));
    let child_forks = area.join(format!("@forks-{tag:016x}"));
    let parent_forks = area.join(format!("@next-{tag:016x}"));
    std::fs::set_permissions(area, std::fs::Permissions::from_mode(0o755))?;
    let made = (|| {
        std::fs::DirBuilder::new().mode(0o700).create(&child)?;
        std::fs::DirBuilder::new()
            .mode(0o555)
            .create(&child_forks)?;
        std::fs::DirBuilder::new().mode(0o555).create(&parent_forks)
    })();
    std::fs::set_permissions(area, std::fs::Permissions::from_mode(0o555))?;
    made?;
    // Each area serves one fork (the parent moves on to its next area), so anything else in it
    // is what the parent slipped in while it was writable: it goes.
    let ours = [&child, &child_forks, &parent_forks];
    for entry in std::fs::read_dir(area)?.flatten() {
        let path = entry.path();
        if !ours.contains(&&path) {
            let _ = host_fs::remove_tree(&path);
        }
    }
    Ok((child, child_forks, parent_forks))
}

/// 64 unpredictable bits (the kernel's random pool).
fn rand_tag() -> u64 {
    let mut buf = [0u8; 8];
    if nix::errno::Errno::result(
        // SAFETY: getrandom(2) into a local buffer of the length given.
        unsafe { libc::getrandom(buf.as_mut_ptr().cast(), buf.len(), 0) },
    )
    .is_err()
    {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        return t ^ u64::from(std::process::id());
    }
    u64::from_ne_bytes(buf)
}

/// Waits (30 s at most) for the parent's `forked` answer, or until the zygote reports the
/// parent gone: the fork holds a copy of the parent's socket until the host's go-ahead, so a
/// parent that dies after the fork (in an `os.register_at_fork` hook of its own, say) never
/// reads as closed. Its output is logged, requests its threads send meanwhile are answered
/// with an error.
async fn parent_answer(worker: &mut LiveWorker, from: &str) -> Result<(), String> {
    let budget = worker.image_budget_bytes;
    let ended = |how: Option<ExitInfo>| {
        let how = how.map_or_else(String::new, |status| format!(" (it {status})"));
        format!(
            "session {from:?}'s worker ended during the fork{how}, before it answered; code of \
             the session's own may have ended it (an os.register_at_fork hook runs in the \
             fork's parent then); its next run starts afresh"
        )
    };
    let wait = async {
        loop {
            let f = match worker.next_frame_or_exit().await {
                FrameOrExit::Frame(Some(Ok(f))) => f,
                FrameOrExit::Frame(_) => return Err(ended(None)),
                FrameOrExit::Exited(how) => return Err(ended(how)),
            };
            match frame::decode_worker_frame(&f, budget) {
                Ok(WorkerFrame::Message(FromWorker::Forked { error: None })) => return Ok(()),
                Ok(WorkerFrame::Message(FromWorker::Forked { error: Some(e) })) => return Err(e),
                Ok(WorkerFrame::Stdout(_)) | Ok(WorkerFrame::Stderr(_)) => {}
                Ok(WorkerFrame::Message(FromWorker::Request { id, .. })) => {
                    let payload = serde_json::json!({"error": {"kind": "busy",
                        "message": "the session is being forked; try again"}});
                    if let Ok(body) = frame::json_body(&ToWorker::Response { id, payload }) {
                        let _ = worker.send(body);
                    }
                }
                Ok(WorkerFrame::Message(_)) => {
                    return Err("the parent's worker sent something other than `forked`".into());
                }
                Err(v) => return Err(v.to_string()),
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(30), wait)
        .await
        .unwrap_or_else(|_| Err("the parent's worker did not answer the fork within 30 s".into()))
}

/// Runs `f` on a blocking thread; returns at once, `Cancelled`, if `cancel` fires first (the
/// caller's [`fork_guard::EndUnlessTaken`] then ends the fork, which ends `f`'s reads).
async fn blocking_unless_cancelled<T: Send + 'static>(
    cancel: &CancellationToken,
    f: impl FnOnce() -> Result<T, String> + Send + 'static,
) -> Result<T, RunRefusal> {
    tokio::select! {
        done = tokio::task::spawn_blocking(f) => done
            .map_err(|e| RunRefusal::Fork(e.to_string()))?
            .map_err(RunRefusal::Fork),
        () = cancel.cancelled() => Err(RunRefusal::Cancelled),
    }
}

/// Reads one byte of the fork's (blocking, `timeout` at most); `what` names what it tells.
fn read_byte(
    mut sock: &std::os::unix::net::UnixStream,
    timeout: Duration,
    what: &str,
) -> Result<(), String> {
    use std::io::Read;
    let _ = sock.set_read_timeout(Some(timeout));
    let mut byte = [0u8; 1];
    sock.read_exact(&mut byte)
        .map_err(|e| format!("the fork did not {what}: {e}"))
}

/// Reads the fork's first frame (blocking, on its own socket, `timeout` at most): `ready` with
/// its pid and notes, or why it failed.
fn read_ready(
    sock: &std::os::unix::net::UnixStream,
    budget: u64,
    timeout: Duration,
) -> Result<(i32, Vec<String>), String> {
    use std::io::Read;
    let _ = sock.set_read_timeout(Some(timeout));
    let why = |e: std::io::Error| match e.kind() {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => format!(
            "the fork did not say ready within {} s: code in an os.register_at_fork hook of \
             the parent's may not have returned",
            timeout.as_secs_f64()
        ),
        std::io::ErrorKind::UnexpectedEof => "the fork ended before it was ready".into(),
        _ => format!("the fork did not become ready: {e}"),
    };
    let mut sock = sock;
    let mut len = [0u8; 4];
    sock.read_exact(&mut len).map_err(why)?;
    let len = u32::from_be_bytes(len) as usize;
    if len > frame::max_worker_frame_bytes(budget) {
        return Err("the fork's first frame is too large".into());
    }
    let mut body = vec![0u8; len];
    sock.read_exact(&mut body).map_err(why)?;
    let _ = sock.set_read_timeout(None);
    match frame::decode_worker_frame(&body, budget) {
        Ok(WorkerFrame::Message(FromWorker::Ready { pid, notes, .. })) => Ok((pid, notes)),
        Ok(WorkerFrame::Message(FromWorker::Fatal { message })) => Err(message),
        Ok(_) => Err("the fork sent something other than `ready`".into()),
        Err(v) => Err(v.to_string()),
    }
}

/// The fork's process, checked by the kernel's word, never the worker's: `pid` must be the
/// zygote's child, lead its own process group, be in the parent's Unix session (`lineage_sid`,
/// which only the lineage's processes can be: no worker may `setsid`), have started after the
/// fork was ordered (`ordered_at`, in clock ticks since boot) and be no worker yet. Checked
/// again after its pidfd is open, so the pidfd is that very process.
fn verified_fork(
    pid: i32,
    lineage_sid: i32,
    ordered_at: u64,
    zygote: &crate::zygote::Zygote,
) -> Result<OwnedFd, String> {
    let check = || -> Result<(), String> {
        let fields = resident::stat_fields(pid).ok_or("the fork's process is gone")?;
        let field = |i: usize| fields.get(i).and_then(|f| f.parse::<i32>().ok());
        let (ppid, group, sid) = (field(1), field(2), field(3));
        if ppid != Some(zygote.pid()) || group != Some(pid) || sid != Some(lineage_sid) {
            return Err(format!(
                "process {pid} is not a fork of this session (parent {ppid:?}, group {group:?}, session {sid:?})"
            ));
        }
        if fork_guard::start_ticks_of(pid).is_none_or(|t| t < ordered_at) {
            return Err(format!("process {pid} is older than the fork"));
        }
        if zygote.live_workers().iter().any(|w| w.pid() == pid) {
            return Err(format!("process {pid} is a worker already"));
        }
        Ok(())
    };
    check()?;
    // SAFETY: pidfd_open(2) with integer arguments; the fd it returns is owned below.
    let raw = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if raw < 0 {
        return Err(format!(
            "cannot open the fork's process: {}",
            std::io::Error::last_os_error()
        ));
    }
    // SAFETY: a fresh fd nothing else owns.
    let pidfd = unsafe { OwnedFd::from_raw_fd(raw as i32) };
    check()?;
    Ok(pidfd)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fork_that_never_says_ready_is_told_why() {
        let (host, fork) = std::os::unix::net::UnixStream::pair().unwrap();
        let why = read_ready(&host, 1 << 20, Duration::from_millis(50)).unwrap_err();
        assert!(
            why.starts_with(
                "the fork did not say ready within 0.05 s: code in an os.register_at_fork hook"
            ),
            "{why}"
        );
        drop(fork);
        let why = read_ready(&host, 1 << 20, Duration::from_millis(50)).unwrap_err();
        assert_eq!(why, "the fork ended before it was ready");
    }
}
