//! Pre-forked spare workers, so a new session does not wait for a fork and a lockdown.
//!
//! A spare is an ordinary worker, forked and locked down before anyone asks for it, in a
//! directory of its own, `sessions-<pid>/@spare-N` ('@' is never in a session name). Nothing
//! about it depends on the session it will serve: its Landlock grants, its private `/tmp` and
//! its cwd all name that directory (by inode, once applied). When a new session needs a worker,
//! the host renames the spare's directory to the session's name, moves the spare under the
//! session cap, and sends the variables that name the session with its first cell
//! ([`crate::frame::Binding`]). The sandbox argument is unchanged: a spare is locked down before
//! it says `ready`, and it runs nothing until it is handed code.
//!
//! Spares do not count against `IRONCELL_MAX_SESSIONS` (they hold places of their own, up to
//! `IRONCELL_POOL_SIZE`), cost memory while they wait, and are reported in `system://info`.
//! A spare is handed only to a session without files (a new one, or one whose directory is
//! empty): a session with files keeps its own directory and gets a fresh fork.
//!
//! With plots warm in the zygote, one more spare (`IRONCELL_PLOT_SPARE`) has also written a
//! first plot's pages ahead (`ironcell_core::prefault`) in its warm-up cell: a new session whose
//! first cell looks like a plot takes it, so that cell does not spend the ~3,000 page copies
//! itself. Any other session leaves it waiting (it holds ~12 MiB of private memory, which an
//! idle session that never plots should not carry) and takes a plain spare or a fresh fork.

use std::sync::atomic::{AtomicBool, AtomicUsize};

use tokio::sync::{Notify, OwnedSemaphorePermit};

use super::cell::Cell;
use super::quota::remove_scratch;
use super::*;

/// A spare's first cell: an import and a call, like most first cells. It leaves no name in the
/// session's namespace (not even `_`: its last statement is not an expression). The zygote's dry
/// runs run it too (`_SPARE_WARM_UP_CELL` in python/_ironcell_runner.py), so that what it looks
/// up is in CPython's type cache before any fork.
const WARM_UP_CELL: &str =
    "import os as _ironcell_warm_up\n_ironcell_warm_up.getpid()\ndel _ironcell_warm_up";
/// The plot spare's: the same, with a word that makes the runner write a first plot's pages
/// ahead before it runs ([`ironcell_core::prefault::looks_like_a_plot`]).
const PLOT_WARM_UP_CELL: &str = "import os as _ironcell_warm_up\n_ironcell_warm_up.getpid()\n\
del _ironcell_warm_up  # matplotlib: a first plot's pages are written ahead";

/// After a spare failed to start, how long the pool waits before trying again.
const REFILL_BACKOFF: Duration = Duration::from_secs(2);
/// After a spare was taken, the refill waits for the session's run to answer, or this long:
/// forking and locking down the next spare competes for the CPU with that answer.
const REFILL_DELAY: Duration = Duration::from_millis(50);
/// And once it answered, this much more: `run` returns before the server has serialized and
/// written the answer, and a fork started at that moment takes a CPU from it.
const AFTER_ANSWER: Duration = Duration::from_millis(3);
/// The longest a refill waits for the workers being started for sessions to be ready.
const MAX_REFILL_DEFER: Duration = Duration::from_secs(1);

/// A locked-down worker waiting for a session.
pub(super) struct Spare {
    worker: LiveWorker,
    /// Its directory's name, `@spare-N` (also its name in the change tracker).
    name: String,
    scratch: PathBuf,
    /// The font cache it was given (`MPLCONFIGDIR`); a spare from before the shared cache was
    /// published is not handed out.
    font_cache: Option<PathBuf>,
    /// The plot spare: a first plot's pages written ahead ([`PLOT_WARM_UP_CELL`]).
    plots: bool,
}

pub(super) struct Pool {
    size: usize,
    spares: Mutex<Vec<Spare>>,
    /// One place per spare, waiting or starting.
    places: Arc<Semaphore>,
    /// The plot spare's place: one permit, or none when there is no plot spare.
    plot_place: Arc<Semaphore>,
    has_plot_place: bool,
    /// Wakes the refill task at once: a spare was found dead.
    wanted: Notify,
    /// Wakes the refill task after a spare was taken: it refills once a run answered
    /// ([`Pool::run_answered`]) or after [`REFILL_DELAY`].
    taken: Notify,
    /// A run ended (see [`Pool::run_answered`]).
    answered: Notify,
    /// Whether a run has ended yet (see [`Pool::after_first_answer`]).
    answered_once: tokio::sync::watch::Sender<bool>,
    /// Workers being forked for sessions that found no spare (a burst past the pool), and the
    /// wake-up when the last of them is ready: a refill waits for them (see
    /// [`Pool::until_no_session_worker_starts`]).
    starting: AtomicUsize,
    all_started: Notify,
    /// Whether a worker was started for a session since the refill last looked.
    started_since: AtomicBool,
    next_id: AtomicU64,
    /// Directories made ahead for new workers (see [`super::pool_dirs`]).
    pub(super) dirs: super::pool_dirs::DirStock,
}

/// Counts one worker being started for a session while it lives ([`Pool::session_worker_starts`]).
pub(super) struct Starting<'a>(&'a Pool);

impl Drop for Starting<'_> {
    fn drop(&mut self) {
        if self.0.starting.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.0.all_started.notify_waiters();
        }
    }
}

impl Pool {
    /// `size` plain spares, and the plot spare if `plot_spare` (never without a pool).
    pub(super) fn new(size: usize, plot_spare: bool) -> Pool {
        Pool {
            size,
            spares: Mutex::new(Vec::new()),
            places: Arc::new(Semaphore::new(size)),
            plot_place: Arc::new(Semaphore::new(usize::from(plot_spare && size > 0))),
            has_plot_place: plot_spare && size > 0,
            wanted: Notify::new(),
            taken: Notify::new(),
            answered: Notify::new(),
            answered_once: tokio::sync::watch::Sender::new(false),
            starting: AtomicUsize::new(0),
            all_started: Notify::new(),
            started_since: AtomicBool::new(false),
            next_id: AtomicU64::new(0),
            dirs: Default::default(),
        }
    }

    /// The pids of the waiting spares, and whether each is the plot spare.
    pub(super) fn pids(&self) -> Vec<(i32, bool)> {
        lock(&self.spares)
            .iter()
            .map(|s| (s.worker.pid(), s.plots))
            .collect()
    }

    /// Takes the waiting spares for which `unusable` says so out of the pool.
    fn remove_where(&self, unusable: impl FnMut(&mut Spare) -> bool) -> Vec<Spare> {
        lock(&self.spares).extract_if(.., unusable).collect()
    }

    /// The most recent waiting spare for a new session: for one whose first cell looks like a
    /// plot, the plot spare if it waits, else a plain one; for any other, a plain one only.
    fn pop(&self, plots: bool) -> Option<Spare> {
        let mut spares = lock(&self.spares);
        let at = match spares.iter().rposition(|s| s.plots) {
            Some(at) if plots => at,
            _ => spares.iter().rposition(|s| !s.plots)?,
        };
        Some(spares.remove(at))
    }

    /// Tells the spare a new session would take next (a plain one) that a run is coming
    /// ([`LiveWorker::warm`], from `warm.rs`).
    pub(super) fn warm_next_spare(&self) {
        if let Some(spare) = lock(&self.spares).iter().rev().find(|s| !s.plots) {
            spare.worker.warm();
        }
    }

    pub(super) fn size(&self) -> usize {
        self.size
    }

    pub(super) fn has_plot_place(&self) -> bool {
        self.has_plot_place
    }

    /// A run ended: a refill waiting for the CPU to be free of the answer may go ahead.
    pub(super) fn run_answered(&self) {
        self.answered.notify_waiters();
        self.answered_once
            .send_if_modified(|once| !std::mem::replace(once, true));
    }

    /// Returns once the server's first run has been answered (and [`AFTER_ANSWER`] more, for
    /// the answer to be written), or after `at_most`: the work a server starts with (matplotlib's
    /// font cache, then the pool) waits until then, so a client's first run gets the zygote and
    /// the CPUs to itself (that work forked a worker ahead of the first session's and built the
    /// font cache beside its first cell).
    pub(super) async fn after_first_answer(&self, at_most: Duration) {
        let mut once = self.answered_once.subscribe();
        let _ = tokio::time::timeout(at_most, async {
            let _ = once.wait_for(|answered| *answered).await;
            tokio::time::sleep(AFTER_ANSWER).await;
        })
        .await;
    }

    /// A worker is being started for a session (no spare fitted), until the guard drops.
    pub(super) fn session_worker_starts(&self) -> Starting<'_> {
        self.starting.fetch_add(1, Ordering::AcqRel);
        self.started_since.store(true, Ordering::Release);
        Starting(self)
    }

    /// After workers were started for sessions (a burst past the pool), waits for one more run
    /// to answer (and [`AFTER_ANSWER`]), at most [`REFILL_DELAY`]: the last sessions of a burst
    /// answer after their workers are ready, and work made then would take a CPU from them.
    pub(super) async fn after_a_burst(&self) {
        if self.started_since.swap(false, Ordering::AcqRel) {
            let _ = tokio::time::timeout(REFILL_DELAY, async {
                self.answered.notified().await;
                tokio::time::sleep(AFTER_ANSWER).await;
            })
            .await;
        }
    }

    /// A worker took directories made ahead: the refill tops the stock up (as after a spare
    /// was taken).
    pub(super) fn dirs_taken(&self) {
        self.taken.notify_one();
    }

    /// Whether a worker is being started for a session.
    pub(super) fn session_workers_starting(&self) -> bool {
        self.starting.load(Ordering::Acquire) > 0
    }

    /// Waits while workers are being started for sessions, at most [`MAX_REFILL_DEFER`]. In a
    /// burst past the pool, a spare forked meanwhile would take the CPU from the sessions that
    /// are waiting for theirs (the zygote forks one at a time); it is forked after them.
    async fn until_no_session_worker_starts(&self) {
        let deadline = tokio::time::Instant::now() + MAX_REFILL_DEFER;
        loop {
            let done = self.all_started.notified();
            tokio::pin!(done);
            done.as_mut().enable();
            if self.starting.load(Ordering::Acquire) == 0 {
                return;
            }
            if tokio::time::timeout_at(deadline, done).await.is_err() {
                return;
            }
        }
    }

    /// Kills every waiting spare.
    pub(super) fn clear(&self) {
        lock(&self.spares).clear();
    }
}

impl SessionManager {
    /// Hands `session` a waiting spare, if one fits: the session has no files, no extra grants
    /// (the local tools session has some), and the spare is alive and current; the plot spare
    /// only if `first_code` looks like a plot ([`Pool::pop`]). Gives `slot` back if not.
    pub(super) fn take_spare(
        &self,
        session: &Session,
        slot: OwnedSemaphorePermit,
        first_code: &str,
    ) -> Result<LiveWorker, OwnedSemaphorePermit> {
        if self.pool.size == 0 || session.name.starts_with('@') {
            return Err(slot);
        }
        if let Some(tools) = self.router.local_tools()
            && !tools.read_grants_for(&session.name).is_empty()
        {
            return Err(slot);
        }
        // Only a directory without files is replaced (rmdir refuses anything else).
        match std::fs::remove_dir(&session.scratch) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(_) => return Err(slot),
        }
        let font_cache = lock(&self.font_cache.dir).clone();
        let zygote_dead = lock(&self.zygote).as_ref().is_none_or(|z| z.is_dead());
        // Every waiting spare is checked, not only the one handed out: a dead plot spare would
        // otherwise hold its place until a session that plots came by.
        let unusable = self.pool.remove_where(|spare| {
            !matches!(spare.worker.liveness(), Liveness::Alive)
                || zygote_dead
                || spare.worker.hung_up()
                || spare.font_cache != font_cache
        });
        for Spare {
            worker,
            scratch,
            name,
            ..
        } in unusable
        {
            tracing::debug!(pid = worker.pid(), "discarding a spare");
            self.pool.wanted.notify_one();
            drop(worker); // kills it
            self.changes.forget(&name);
            tokio::spawn(remove_scratch(scratch));
        }
        let plots = ironcell_core::prefault::looks_like_a_plot(first_code);
        let Some(mut spare) = self.pool.pop(plots) else {
            self.pool.wanted.notify_one();
            return Err(slot);
        };
        // Renaming a directory within sessions-<pid>: both names are the host's own, and
        // the spare has run only the host's warm-up cell, which writes no file, so its
        // directory holds nothing of the worker's. The change tracker's watches follow the
        // directory (they are on its inode).
        self.changes.rename(&spare.name, &session.name);
        if let Err(e) = std::fs::rename(&spare.scratch, &session.scratch) {
            tracing::warn!(from = %spare.scratch.display(), to = %session.scratch.display(), error = %e, "cannot hand a spare its session's directory");
            self.changes.forget(&session.name);
            return Err(slot);
        }
        spare.worker.move_to_slot(slot);
        self.pool.taken.notify_one();
        spare.worker.bind = Some(hand_off(&session.name, &session.scratch));
        tracing::debug!(session = %session.name, pid = spare.worker.pid(), plots = spare.plots, "session takes a spare");
        Ok(spare.worker)
    }

    /// Keeps the pool full until the server shuts down: the directories made ahead first
    /// ([`super::pool_dirs`]), then one spare at a time, again whenever one was found dead, or
    /// soon after one (or a set of directories) was taken (not while its first answer is on the
    /// way: on a small machine the fork would delay it).
    pub(super) async fn keep_pool_filled(self: Arc<Self>, stop: CancellationToken) {
        loop {
            let mut pause = Duration::from_secs(3600);
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = self.pool.until_no_session_worker_starts() => {}
            }
            self.top_up_dirs().await;
            if let Some((place, plots)) = self.free_place() {
                match self.start_spare(place, plots).await {
                    Ok(()) => continue,
                    Err(e) => {
                        tracing::warn!("cannot start a spare worker: {e}");
                        pause = REFILL_BACKOFF;
                    }
                }
            }
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = self.pool.wanted.notified() => {}
                _ = self.pool.taken.notified() => {
                    tokio::select! {
                        _ = stop.cancelled() => return,
                        _ = async {
                            self.pool.answered.notified().await;
                            tokio::time::sleep(AFTER_ANSWER).await;
                        } => {}
                        _ = tokio::time::sleep(REFILL_DELAY) => {}
                    }
                }
                _ = tokio::time::sleep(pause) => {}
            }
        }
    }

    /// A place for the next spare: a plain one first (most sessions take those), then the plot
    /// spare's, once the shared font cache is published (plots are warm from then on).
    fn free_place(&self) -> Option<(OwnedSemaphorePermit, bool)> {
        if let Ok(place) = self.pool.places.clone().try_acquire_owned() {
            return Some((place, false));
        }
        if lock(&self.font_cache.dir).is_none() {
            return None;
        }
        let place = self.pool.plot_place.clone().try_acquire_owned().ok()?;
        Some((place, true))
    }

    /// Runs a first cell in a fresh spare, bound to its own directory the way a session's first
    /// run binds it, so the session that takes the spare does not pay for a worker's first cell:
    /// the runner's first compile and exec, the hand-off's code, and the pages they touch (each
    /// a copy-on-write fault after the fork: a session's first run took ~41 of them without
    /// this, ~8 with it).
    async fn warm_up(
        &self,
        name: &str,
        scratch: &Path,
        mut worker: LiveWorker,
        code: &str,
    ) -> Result<LiveWorker, RunRefusal> {
        let spare = Session::new(name.into(), scratch.to_path_buf());
        let mut state = spare.state.lock().await;
        worker.bind = Some(hand_off(name, scratch));
        state.worker = Some(worker);
        let disk_stops_seen = self.disk_guard.stops.borrow().0;
        let outcome = self
            .drive_cell(
                &spare,
                &mut state,
                Cell {
                    run_no: 0,
                    code,
                    timeout: Duration::from_secs(10),
                    cancel: self.stop.child_token(),
                    progress: None,
                    disk_stops_seen,
                },
            )
            .await;
        match state.worker.take() {
            Some(worker) if outcome.record.status == RunStatus::Ok => Ok(worker),
            _ => Err(RunRefusal::WorkerStart(format!(
                "a spare's warm-up cell ended {:?}",
                outcome.record.status
            ))),
        }
    }

    async fn start_spare(
        &self,
        place: OwnedSemaphorePermit,
        plots: bool,
    ) -> Result<(), RunRefusal> {
        let n = self.pool.next_id.fetch_add(1, Ordering::Relaxed);
        let name = format!("@spare-{n}");
        let scratch = self.root.join(&name);
        let font_cache = lock(&self.font_cache.dir).clone();
        let worker = self.spawn_worker_in_slot(None, &scratch, place).await?;
        let code = if plots {
            PLOT_WARM_UP_CELL
        } else {
            WARM_UP_CELL
        };
        let worker = self.warm_up(&name, &scratch, worker, code).await?;
        // The session's first listing then reads events instead of walking (and watching).
        let (changes, watched, dir) = (self.changes.clone(), name.clone(), scratch.clone());
        let _ = tokio::task::spawn_blocking(move || {
            changes.changed(&watched, &dir, std::time::SystemTime::now(), 0)
        })
        .await;
        lock(&self.pool.spares).push(Spare {
            worker,
            name,
            scratch,
            font_cache,
            plots,
        });
        Ok(())
    }
}

/// What a spare's first `run` carries to bind it to the session `name` in `scratch`: the
/// variables that name them ([`frame::Binding`]).
fn hand_off(name: &str, scratch: &Path) -> frame::Binding {
    frame::Binding {
        env: super::spawn::session_environment(name, scratch),
        scratch: scratch.to_path_buf(),
        packages_linked: false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whether `wait` is done after `after` of (paused, auto-advancing) time.
    async fn done_after(wait: &tokio::task::JoinHandle<()>, after: Duration) -> bool {
        tokio::time::sleep(after).await;
        tokio::task::yield_now().await;
        wait.is_finished()
    }

    #[tokio::test(start_paused = true)]
    async fn the_refill_waits_for_session_workers_being_started_and_goes_when_they_are() {
        let pool = Arc::new(Pool::new(2, false));
        let first = pool.session_worker_starts();
        let second = pool.session_worker_starts();
        let p = pool.clone();
        let wait = tokio::spawn(async move { p.until_no_session_worker_starts().await });
        assert!(!done_after(&wait, Duration::from_millis(300)).await);
        drop(first);
        assert!(
            !done_after(&wait, Duration::from_millis(300)).await,
            "one is still starting"
        );
        drop(second);
        assert!(
            done_after(&wait, Duration::from_millis(1)).await,
            "the last one is ready"
        );
        // Nothing starting: no wait at all.
        let started = tokio::time::Instant::now();
        pool.until_no_session_worker_starts().await;
        assert_eq!(started.elapsed(), Duration::ZERO);
    }

    #[test]
    fn the_zygote_rehearses_the_spare_warm_up_cell_as_it_is() {
        let runner = include_str!("../../python/_ironcell_runner.py");
        let line = format!("_SPARE_WARM_UP_CELL = {WARM_UP_CELL:?}");
        assert!(runner.contains(&line), "the runner lacks `{line}`");
    }

    #[tokio::test(start_paused = true)]
    async fn the_refill_waits_at_most_its_cap() {
        let pool = Pool::new(2, false);
        let _stuck = pool.session_worker_starts();
        let started = tokio::time::Instant::now();
        pool.until_no_session_worker_starts().await;
        assert_eq!(started.elapsed(), MAX_REFILL_DEFER);
    }
}
