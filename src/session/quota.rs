//! The scratch quota: background measurement of session directories, and emptying them.
//!
//! Measuring walks the whole tree (a `stat` per entry: ~0.2 s of CPU for 100,000 files), so the
//! watch walks only directories that can have changed. Only a session's worker writes to its
//! directory (the host adds its spill files only while a run is going on), and writing, by any
//! means (`write`, `mmap` of a sparse file, `fallocate`, ...), costs that process CPU time: so
//! an idle session whose worker has used no CPU since its last walk began is not walked again
//! (a read of the worker's process CPU clock instead). It is still walked every
//! [`QUOTA_RESYNC_EVERY`], in case anything else grew the tree.

use super::*;
use std::collections::HashSet;

/// What a session's last measurement saw of its worker, taken just before its walk began.
#[derive(Debug, Clone, Copy)]
pub(super) struct WorkerMark {
    pid: i32,
    /// CPU time of the whole process (every thread, live or exited), in nanoseconds.
    cpu_ns: u64,
    pub(super) at: Instant,
}

impl WorkerMark {
    /// The worker `pid` as it is now; `None` if its CPU clock cannot be read (it is gone).
    pub(super) fn now(pid: i32) -> Option<WorkerMark> {
        Some(WorkerMark {
            pid,
            cpu_ns: process_cpu_ns(pid)?,
            at: Instant::now(),
        })
    }

    /// The same worker, and it has not run since `self` was taken.
    pub(super) fn unchanged_since(&self, earlier: &WorkerMark) -> bool {
        self.pid == earlier.pid && self.cpu_ns == earlier.cpu_ns
    }
}

impl Session {
    /// For the free-disk guard: reads this session's idle worker's CPU clock, keeps it as the
    /// newer of its two marks, and says whether the worker ran since the older one (or is new
    /// to the guard). `false` with no idle worker: none, or a run holds the session (a running
    /// cell is stopped through `disk_guard.stops` instead).
    fn idle_worker_ran_since_the_look_before_last(&self) -> bool {
        let pid = match self.state.try_lock() {
            Ok(st) => st.worker.as_ref().map(|w| w.pid()),
            Err(_) => None,
        };
        let mut marks = lock(&self.disk_marks);
        let Some(now) = pid.and_then(WorkerMark::now) else {
            *marks = [None, None];
            return false;
        };
        let ran = !marks[0].is_some_and(|older| now.unchanged_since(&older));
        *marks = [marks[1].or(Some(now)), Some(now)];
        ran
    }
}

/// The CPU time process `pid` has used, in nanoseconds (its process CPU clock: exact, not in
/// clock ticks, and readable for any process in our pid namespace, whoever owns it).
fn process_cpu_ns(pid: i32) -> Option<u64> {
    let mut clock: libc::clockid_t = 0;
    // SAFETY: writes the clock id to a local; returns an error number instead of setting errno.
    if unsafe { libc::clock_getcpuclockid(pid, &mut clock) } != 0 {
        return None;
    }
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: writes the time to a local.
    if unsafe { libc::clock_gettime(clock, &mut ts) } != 0 {
        return None;
    }
    Some((ts.tv_sec as u64).saturating_mul(1_000_000_000) + ts.tv_nsec as u64)
}

/// Measures a session directory against `quota`, off the async runtime (the walk stops just
/// past the quota, so its cost is bounded by it: every entry counts at least 4 KiB).
pub(super) async fn scratch_usage(dir: PathBuf, quota: u64) -> Usage {
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
pub(super) fn quota_verdict(usage: Usage, quota: u64) -> Option<String> {
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
pub(super) fn removal_outcome(removal: &host_fs::Removal) -> String {
    if removal.is_complete() {
        "its files were removed".into()
    } else {
        format!("removing its files failed: {}", removal.summary())
    }
}

/// How much further free space must fall, under the floor, before the free-disk guard stops the
/// workers again; and how far above the floor it must come back before the next fall under the
/// floor counts as a new crossing (a disk hovering at the floor does not stop them each time).
const DISK_STOP_STEP: u64 = 64 << 20;

/// What the free-disk guard knows of the state dir's disk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum DiskWatch {
    /// Not read yet.
    Unread,
    /// Clear of the floor: the next fall under it is a crossing, which stops the workers.
    Armed,
    /// Under the floor, or less than a step above it, since a stop (or since a first look that
    /// found the disk under the floor): the most free space seen since then.
    Low { most: u64 },
}

/// The free-disk guard's state (see [`SessionManager::guard_free_disk`]).
pub(super) struct DiskGuard {
    /// Its stop events: a count, and why the last one happened; a running cell stops its worker
    /// when the count moves.
    pub(super) stops: tokio::sync::watch::Sender<(u64, String)>,
    /// What it knows of the state dir's disk.
    pub(super) watch: Mutex<DiskWatch>,
    /// When it last stopped only some workers, and last stopped them all.
    pub(super) stops_done: Mutex<DiskStops>,
}

impl Default for DiskGuard {
    fn default() -> Self {
        DiskGuard {
            stops: tokio::sync::watch::Sender::new((0, String::new())),
            watch: Mutex::new(DiskWatch::Unread),
            stops_done: Mutex::new(DiskStops::default()),
        }
    }
}

impl DiskWatch {
    /// The guard's state after reading `free` bytes free against `floor`, and whether the
    /// workers must be stopped now.
    pub(super) fn next(self, free: u64, floor: u64) -> (DiskWatch, bool) {
        if free >= floor.saturating_add(DISK_STOP_STEP) {
            return (DiskWatch::Armed, false);
        }
        match self {
            DiskWatch::Unread if free >= floor => (DiskWatch::Armed, false),
            DiskWatch::Unread => (DiskWatch::Low { most: free }, false),
            DiskWatch::Armed if free >= floor => (DiskWatch::Armed, false),
            DiskWatch::Armed => (DiskWatch::Low { most: free }, true),
            DiskWatch::Low { most } if free < floor && free + DISK_STOP_STEP <= most => {
                (DiskWatch::Low { most: free }, true)
            }
            DiskWatch::Low { most } => (
                DiskWatch::Low {
                    most: most.max(free),
                },
                false,
            ),
        }
    }
}

/// After the free-disk guard stopped the workers that were writing, how long it waits for the
/// disk to come back above the floor before it stops every worker.
const ESCALATE_AFTER: Duration = Duration::from_secs(2);
/// The free-disk guard stops every session's worker at most once in this long.
const STOP_EVERYONE_EVERY: Duration = Duration::from_secs(600);

/// Which workers the free-disk guard stops at one look.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum StopScope {
    Nobody,
    /// Running cells' workers, and idle workers that ran since the guard's look before last.
    Writers,
    Everyone,
}

/// When the free-disk guard last stopped workers.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct DiskStops {
    /// Its last stop of the writers, while the disk has not come back above the floor since.
    writers_at: Option<Instant>,
    /// Its last stop of every worker.
    everyone_at: Option<Instant>,
}

impl DiskStops {
    /// Whom to stop at a look that found `free` bytes free against `floor`, where `crossing`
    /// is [`DiskWatch::next`]'s verdict.
    pub(super) fn scope(
        &mut self,
        crossing: bool,
        free: u64,
        floor: u64,
        now: Instant,
    ) -> StopScope {
        if crossing {
            self.writers_at = Some(now);
            return StopScope::Writers;
        }
        if free >= floor {
            self.writers_at = None;
            return StopScope::Nobody;
        }
        match self.writers_at {
            Some(at) if now.duration_since(at) >= ESCALATE_AFTER => {
                self.writers_at = None;
                if self
                    .everyone_at
                    .is_none_or(|e| now.duration_since(e) >= STOP_EVERYONE_EVERY)
                {
                    self.everyone_at = Some(now);
                    StopScope::Everyone
                } else {
                    tracing::info!(
                        "the disk stays under IRONCELL_MIN_FREE_DISK after the writing workers \
                         were stopped; every worker was stopped less than {} minutes ago, so the \
                         others keep running",
                        STOP_EVERYONE_EVERY.as_secs() / 60
                    );
                    StopScope::Nobody
                }
            }
            _ => StopScope::Nobody,
        }
    }
}

/// Removes a directory tree off the async runtime, fd-relative and without following
/// symlinks, and logs what could not be removed.
pub(super) async fn remove_scratch(dir: PathBuf) -> host_fs::Removal {
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

/// Runs the quota watch (and drains the change tracker's queue) until the manager stops.
pub(super) fn enforce_scratch_quotas_periodically(manager: &Arc<SessionManager>) {
    let weak = Arc::downgrade(manager);
    manager.spawn_until_stopped(async move {
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

/// How often the free-disk guard looks, far from the floor and within [`GUARD_NEAR`] of it.
/// Blocks can be taken at up to ~7 GiB/s (red-team pass 22: sparse files' holes read into the
/// page cache, then written through a mapping): a look every 100 ms lets ~0.7 GiB through, one
/// every 20 ms ~140 MiB; and 1 GiB of margin is crossed in no less than ~140 ms, so the guard
/// is on the short tick before a fill reaches the floor.
const GUARD_TICK: Duration = Duration::from_millis(100);
const GUARD_TICK_NEAR: Duration = Duration::from_millis(20);
const GUARD_NEAR: u64 = 1 << 30;

/// Runs the free-disk guard on its own task until the manager stops. Not on the quota watch's:
/// a walk of a session's directory takes as long as the session makes it (125,000 directories:
/// 2.5-16 s), and a guard that waited for it did not look at the disk meanwhile (red-team pass
/// 22: a session that saw the walk start filled the disk 6.6 GiB under the floor).
pub(super) fn guard_free_disk_periodically(manager: &Arc<SessionManager>) {
    let floor = manager.settings.min_free_disk_bytes;
    if floor == 0 {
        return; // the guard is off
    }
    let weak = Arc::downgrade(manager);
    manager.spawn_until_stopped(async move {
        loop {
            let Some(manager) = weak.upgrade() else { break };
            let free = manager.guard_free_disk().await;
            drop(manager);
            let near = free.is_some_and(|f| f < floor.saturating_add(GUARD_NEAR));
            tokio::time::sleep(if near { GUARD_TICK_NEAR } else { GUARD_TICK }).await;
        }
    });
}

impl SessionManager {
    /// The quota watch: measures every session with a live worker that is due (a running one
    /// every [`QUOTA_CHECK_EVERY`], an idle one every [`IDLE_QUOTA_CHECK_EVERY`] if its worker
    /// ran since its last walk, never sooner than [`QUOTA_WALK_SPACING`] times its last walk),
    /// off the async runtime and off every run's path. A directory over quota gets its verdict;
    /// an idle session is then stopped here, a running one by its cell loop, which the verdict
    /// wakes.
    pub async fn enforce_scratch_quotas(&self) {
        let quota = self.sandbox.scratch_quota_bytes();
        let sessions: Vec<Arc<Session>> = lock(&self.sessions).values().cloned().collect();
        for s in sessions {
            let (busy, idle_worker) = match s.state.try_lock() {
                Ok(st) => match st.worker.as_ref() {
                    None => continue, // nothing writes to it
                    Some(w) => (false, Some(w.pid())),
                },
                Err(_) => (true, None), // a run holds it, so it has a worker
            };
            if *lock(&s.next_quota_check) > Instant::now() {
                continue;
            }
            let every = if busy {
                QUOTA_CHECK_EVERY
            } else {
                IDLE_QUOTA_CHECK_EVERY
            };
            // Taken before the walk: whatever the worker does from here on shows next time.
            let mark = idle_worker.and_then(WorkerMark::now);
            if let (Some(now), Some(last)) = (mark, *lock(&s.quota_mark))
                && now.unchanged_since(&last)
                && last.at.elapsed() < QUOTA_RESYNC_EVERY
            {
                *lock(&s.next_quota_check) = Instant::now() + every;
                continue;
            }
            let generation = s.generation.load(Ordering::SeqCst);
            let started = Instant::now();
            let usage = scratch_usage(s.scratch.clone(), quota).await;
            let took = started.elapsed();
            if let Usage::Measured { bytes, entries } | Usage::Over { bytes, entries } = &usage {
                tracing::debug!(
                    session = %s.name,
                    entries,
                    mib = bytes >> 20,
                    took_ms = took.as_secs_f64() * 1000.0,
                    busy,
                    "measured the session directory against its quota"
                );
            }
            *lock(&s.quota_mark) = match usage {
                Usage::Measured { .. } => mark,
                _ => None,
            };
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

    /// Free bytes on the state dir's disk (`None` when the disk cannot be asked). Asked off the
    /// async runtime: a state dir on a hung network file system must not stall it.
    pub(super) async fn free_disk_bytes(&self) -> Option<u64> {
        let root = self.root.clone();
        tokio::task::spawn_blocking(move || free_bytes_on(&root))
            .await
            .ok()
            .flatten()
    }

    /// The free-disk guard, one look ([`guard_free_disk_periodically`] says how often), while
    /// any session has a worker; returns the free space it read, if it read it. The
    /// scratch quota counts the names in a session's directory, so space a worker holds in
    /// files it deleted but kept open or mapped shows nowhere but in the disk's free space.
    /// When free space falls under the floor, and again each time it falls a further
    /// [`DISK_STOP_STEP`] below the most seen since the last stop (a new crossing only once
    /// the disk has come back a step above the floor: see [`DiskWatch`]), the guard stops the
    /// workers that can have taken the space: every running cell's (by its loop, woken by
    /// `disk_guard.stops`) and every idle worker whose CPU clock moved since the guard's look before
    /// last (a write costs CPU time; a worker that ran nothing wrote nothing). Files are kept;
    /// a stop gives back what the worker held. If the disk is still under the floor
    /// [`ESCALATE_AFTER`] later, the space was taken before (or by something else): it stops
    /// every worker, at most once per [`STOP_EVERYONE_EVERY`], so a session that fills and
    /// frees the disk over and over cannot stop the idle sessions each time. Runs are never
    /// refused: named files within the quotas may keep the disk under the floor, and one
    /// session must not lock the others out by that.
    ///
    /// Long on purpose: one look of the guard, in order (free space, the crossing, who wrote, whom
    /// to stop, the stop), each step using the one before.
    pub(super) async fn guard_free_disk(&self) -> Option<u64> {
        let sessions: Vec<Arc<Session>> = lock(&self.sessions).values().cloned().collect();
        let any_worker = sessions.iter().any(|s| match s.state.try_lock() {
            Ok(st) => st.worker.is_some(),
            Err(_) => true,
        });
        // Near the floor it keeps looking with no worker left too: the stop gives space back
        // after it, and the guard must see that before the next worker can take it again. And
        // it looks once at start, worker or not, so a disk already under the floor then is not
        // taken for a crossing later.
        let watch = *lock(&self.disk_guard.watch);
        if !any_worker && watch == DiskWatch::Armed {
            return None;
        }
        let free = self.free_disk_bytes().await?;
        // Read after the free space: a write that the next look finds is after this look's
        // clock readings, so it shows against the older of the two marks.
        let wrote: HashSet<String> = sessions
            .iter()
            .filter(|s| s.idle_worker_ran_since_the_look_before_last())
            .map(|s| s.name.clone())
            .collect();
        let floor = self.settings.min_free_disk_bytes;
        let stop = {
            let mut watch = lock(&self.disk_guard.watch);
            let (next, stop) = watch.next(free, floor);
            if *watch == DiskWatch::Unread && free < floor {
                tracing::warn!(
                    "the disk holding ironcell's state dir ({}) has {} MiB free, under the {} MiB \
                     it keeps free (IRONCELL_MIN_FREE_DISK): session workers are stopped if it \
                     falls another {} MiB",
                    self.root.display(),
                    free >> 20,
                    floor >> 20,
                    DISK_STOP_STEP >> 20
                );
            }
            *watch = next;
            stop
        };
        let scope = lock(&self.disk_guard.stops_done).scope(stop, free, floor, Instant::now());
        let (whom, targets) = match scope {
            StopScope::Nobody => return Some(free),
            StopScope::Writers => (
                "the workers that were running or writing as it fell were stopped",
                Some(&wrote),
            ),
            StopScope::Everyone => (
                "it stayed there after the workers that were writing were stopped, so every \
                 session's worker was stopped",
                None,
            ),
        };
        let why = format!(
            "the disk holding ironcell's state dir ({}) has {} MiB free, under the {} MiB it keeps \
             free (IRONCELL_MIN_FREE_DISK): {whom}, which frees space held in files code deleted \
             but kept open (files were kept). If it stays low, free some disk space (a run with \
             reset=true clears a session's files)",
            self.root.display(),
            free >> 20,
            floor >> 20
        );
        tracing::warn!(stopped_idle = targets.map(|t| t.len()), "{why}");
        for s in sessions {
            if targets.is_some_and(|t| !t.contains(&s.name)) {
                continue;
            }
            let Ok(mut state) = s.state.try_lock() else {
                continue; // a run holds it: the run stops the worker (the count moves below)
            };
            if let Some(w) = state.worker.take() {
                w.kill().await; // returns its session slot
                state.pending_notice = Some(format!(
                    "this session's worker was stopped between runs: {why}; variables and imports were lost"
                ));
            }
        }
        // After the idle ones: a run that took its session meanwhile read the count before
        // (`run` reads it before the lock), so it sees this move and stops its own worker.
        self.disk_guard.stops.send_modify(|(n, w)| {
            *n += 1;
            w.clone_from(&why);
        });
        Some(free)
    }

    /// Acts on the quota watch's verdict between runs: kills the session's worker, removes the
    /// files, and leaves the reason for the session's next run. Cheap when there is none.
    pub(super) async fn enforce_quota_while_idle(
        &self,
        session: &Session,
        state: &mut SessionState,
    ) {
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
    pub(super) async fn empty_scratch(&self, session: &Session) -> host_fs::Removal {
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

/// The bytes free to an unprivileged writer on the filesystem holding `path` (blocking).
pub(super) fn free_bytes_on(path: &std::path::Path) -> Option<u64> {
    let st = nix::sys::statvfs::statvfs(path).ok()?;
    Some((st.blocks_available() as u64).saturating_mul(st.fragment_size() as u64))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn thread_cpu() -> Duration {
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: writes the time to a local.
        let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
        assert_eq!(rc, 0);
        Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
    }

    const MIB: u64 = 1 << 20;

    /// Feeds the guard a series of free-space readings (MiB) against a 1,000 MiB floor and
    /// returns the readings at which it stopped the workers.
    fn stops(readings: &[u64]) -> Vec<u64> {
        let mut watch = DiskWatch::Unread;
        let mut at = Vec::new();
        for &free in readings {
            let (next, stop) = watch.next(free * MIB, 1000 * MIB);
            if stop {
                at.push(free);
            }
            watch = next;
        }
        at
    }

    #[test]
    fn the_disk_guard_stops_on_a_crossing_and_each_further_step_down() {
        assert_eq!(
            stops(&[2000, 990, 960, 930, 920, 880, 850]),
            [990, 920, 850]
        );
        // Space given back after a stop moves the reference up, so taking it again stops again.
        assert_eq!(stops(&[2000, 990, 950, 1030, 960]), [990, 960]);
        assert_eq!(stops(&[2000, 900, 1200, 990]), [900, 990]);
    }

    #[test]
    fn a_disk_hovering_at_the_floor_stops_the_workers_once() {
        assert_eq!(stops(&[2000, 990, 1040, 990, 1050, 995, 1010, 999]), [990]);
        // Coming back a whole step above the floor re-arms it.
        assert_eq!(stops(&[2000, 990, 1064, 999]), [990, 999]);
    }

    #[test]
    fn a_disk_under_the_floor_at_the_first_look_is_no_crossing() {
        assert_eq!(stops(&[900, 880, 850, 830]), [830]);
        assert_eq!(
            stops(&[1010, 990]),
            [990],
            "above the floor at first: armed"
        );
        assert_eq!(stops(&[]), [] as [u64; 0]);
    }

    /// The scopes of a run of looks, `step` apart: (free MiB, a crossing).
    fn scopes(step: Duration, looks: &[(u64, bool)]) -> Vec<StopScope> {
        let (mut done, start) = (DiskStops::default(), Instant::now());
        looks
            .iter()
            .enumerate()
            .map(|(i, &(free, crossing))| {
                done.scope(crossing, free << 20, 1000 << 20, start + step * i as u32)
            })
            .collect()
    }

    #[test]
    fn the_disk_guard_stops_the_writers_first_and_everyone_only_if_the_disk_stays_low() {
        use StopScope::*;
        let s = Duration::from_secs(1);
        // Given back by the writers' stop: nobody else is stopped.
        assert_eq!(
            scopes(
                s,
                &[(900, true), (900, false), (1100, false), (1100, false)]
            ),
            [Writers, Nobody, Nobody, Nobody]
        );
        // Still low ESCALATE_AFTER later: everyone, once.
        assert_eq!(
            scopes(
                s,
                &[
                    (900, true),
                    (900, false),
                    (900, false),
                    (900, false),
                    (900, false)
                ]
            ),
            [Writers, Nobody, Everyone, Nobody, Nobody]
        );
    }

    #[test]
    fn the_disk_guard_stops_everyone_at_most_once_per_period() {
        use StopScope::*;
        // A session that takes the space, is stopped, frees it and takes it again, every
        // 4 s: the idle sessions are stopped at the first round, not at the next ones.
        let rounds = (STOP_EVERYONE_EVERY.as_secs() / 4 - 1) as usize;
        let mut looks = Vec::new();
        for _ in 0..rounds {
            looks.extend([(900, true), (900, false), (900, false), (1100, false)]);
        }
        let got = scopes(Duration::from_secs(1), &looks);
        assert_eq!(got.iter().filter(|&&x| x == Everyone).count(), 1);
        assert_eq!(got.iter().filter(|&&x| x == Writers).count(), rounds);
        // The period over, everyone again.
        looks.extend([(1100, false); 8]);
        looks.extend([(900, true), (900, false), (900, false)]);
        let got = scopes(Duration::from_secs(1), &looks);
        assert_eq!(got.iter().filter(|&&x| x == Everyone).count(), 2);
    }

    #[test]
    fn a_process_cpu_clock_counts_threads_that_already_exited_and_ends_with_the_process() {
        let me = std::process::id() as i32;
        let before = process_cpu_ns(me).unwrap();
        std::thread::spawn(|| {
            let start = thread_cpu();
            while thread_cpu() - start < Duration::from_millis(20) {
                std::hint::spin_loop();
            }
        })
        .join()
        .unwrap();
        let after = process_cpu_ns(me).unwrap();
        assert!(after >= before + 20_000_000, "{before} -> {after}");
        let mark = WorkerMark::now(me).unwrap();
        assert!(!WorkerMark::now(me).unwrap().unchanged_since(&WorkerMark {
            cpu_ns: mark.cpu_ns - 1,
            ..mark
        }));
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id() as i32;
        child.wait().unwrap();
        assert!(
            process_cpu_ns(pid).is_none(),
            "a reaped process has no clock"
        );
    }
}
