//! The memory watch: the memory limit enforced on what a worker holds, not only on what its
//! rlimits count.
//!
//! `RLIMIT_DATA` (the memory limit) counts private writable mappings that are not stacks. Memory
//! written and then made read-only with `mprotect`, or mapped `MAP_GROWSDOWN`, leaves that count
//! while it stays resident, so a worker could hold up to `RLIMIT_AS` (the limit plus 2 GiB of
//! headroom) that way (SECURITY.md #130). So every live worker's anonymous memory (`RssAnon` +
//! `VmSwap` from `/proc/<pid>/status`, readable for a non-dumpable process too) is read, and a
//! worker holding more than the limit, plus [`SLACK_BYTES`], plus the zygote's own anonymous
//! memory (which a fresh worker shares and counts as its own), is killed; its exit report says
//! why, in the run it ended or in the next run's notice.
//!
//! Memory only grows through the worker's own page faults and system calls, which cost it CPU
//! time: a worker whose process CPU clock has not moved since its last reading is not read
//! again, except once every [`RESYNC_EVERY`]. The readings run on a blocking thread (a worker
//! holding its own `mmap_lock` must not stall the async runtime).

use super::*;
use quota::WorkerMark;

/// How often the watch looks for workers due a reading.
const WATCH_TICK: Duration = Duration::from_millis(100);
/// A worker whose CPU clock has not moved is read again after this long anyway.
const RESYNC_EVERY: Duration = Duration::from_secs(1);
/// Anonymous memory a worker may hold past the memory limit (and the zygote's share) before it
/// is killed: its main stack and the anonymous copies of libraries' relocated read-only data,
/// which an honest worker has and no rlimit counts as data.
const SLACK_BYTES: u64 = 64 << 20;

/// Runs the memory watch until the manager stops.
pub(super) fn watch_memory_periodically(manager: &Arc<SessionManager>) {
    let weak = Arc::downgrade(manager);
    manager.spawn_until_stopped(async move {
        let mut tick = tokio::time::interval(WATCH_TICK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let Some(manager) = weak.upgrade() else { break };
            manager.watch_memory().await;
        }
    });
}

/// Anonymous memory of process `pid` (resident and swapped out), in bytes; `None` if it is gone.
fn anonymous_bytes(pid: i32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    anonymous_bytes_in(&status)
}

/// `RssAnon` + `VmSwap` of a `/proc/<pid>/status` text (both in kB; a kernel thread or a
/// zombie has neither).
fn anonymous_bytes_in(status: &str) -> Option<u64> {
    let field = |name: &str| {
        status.lines().find_map(|line| {
            let rest = line.strip_prefix(name)?.strip_prefix(':')?;
            rest.trim().strip_suffix("kB")?.trim().parse::<u64>().ok()
        })
    };
    let resident = field("RssAnon")?;
    Some((resident + field("VmSwap").unwrap_or(0)) << 10)
}

/// The most anonymous memory a worker may hold, given the zygote's own.
fn allowed_bytes(limit: u64, zygote_anonymous: u64) -> u64 {
    limit
        .saturating_add(SLACK_BYTES)
        .saturating_add(zygote_anonymous)
}

impl SessionManager {
    /// One look: reads every live worker that is due (see the module's doc) and kills those
    /// past the limit.
    pub(super) async fn watch_memory(&self) {
        let Some(zygote) = lock(&self.zygote).clone() else {
            return;
        };
        let live = zygote.live_workers();
        let due: Vec<i32> = {
            let mut marks = lock(&self.memory_marks);
            marks.retain(|pid, _| live.contains(pid));
            live.iter()
                .filter_map(|&pid| {
                    let now = WorkerMark::now(pid)?;
                    let due = marks.get(&pid).is_none_or(|last| {
                        !now.unchanged_since(last) || last.at.elapsed() >= RESYNC_EVERY
                    });
                    due.then(|| {
                        marks.insert(pid, now);
                        pid
                    })
                })
                .collect()
        };
        if due.is_empty() {
            return;
        }
        let zygote_pid = zygote.pid();
        let read = tokio::task::spawn_blocking(move || {
            let base = anonymous_bytes(zygote_pid).unwrap_or(0);
            let held: Vec<(i32, u64)> = due
                .into_iter()
                .filter_map(|pid| Some((pid, anonymous_bytes(pid)?)))
                .collect();
            (base, held)
        })
        .await;
        let Ok((base, held)) = read else { return };
        let limit = self.sandbox.memory_bytes;
        let allowed = allowed_bytes(limit, base);
        for (pid, bytes) in held {
            if bytes <= allowed {
                continue;
            }
            let why = ExitInfo::OverMemory {
                held_mib: bytes >> 20,
                limit_mib: limit >> 20,
            };
            if zygote.kill_for_memory(pid, why) {
                tracing::warn!(
                    pid,
                    held_mib = bytes >> 20,
                    allowed_mib = allowed >> 20,
                    "killed a worker holding more memory than its limit allows"
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn anonymous_memory_is_resident_plus_swapped() {
        let status = "Name:\tpython3\nVmRSS:\t  900 kB\nRssAnon:\t  700 kB\nRssFile:\t 200 kB\nVmSwap:\t  24 kB\n";
        assert_eq!(anonymous_bytes_in(status), Some(724 << 10));
        assert_eq!(anonymous_bytes_in("RssAnon:\t5 kB\n"), Some(5 << 10));
        assert_eq!(anonymous_bytes_in("Name:\tkthreadd\n"), None);
        // A field that merely starts like it is not it.
        assert_eq!(anonymous_bytes_in("RssAnonX:\t5 kB\n"), None);
    }

    #[test]
    fn this_process_reads_as_holding_what_it_touched() {
        let before = anonymous_bytes(std::process::id() as i32).unwrap();
        let block = std::hint::black_box(vec![1u8; 64 << 20]);
        let after = anonymous_bytes(std::process::id() as i32).unwrap();
        assert!(after >= before + (60 << 20), "{before} -> {after}");
        drop(std::hint::black_box(block));
        assert_eq!(anonymous_bytes(i32::MAX), None);
    }

    #[test]
    fn a_worker_may_hold_the_limit_the_slack_and_the_zygotes_share() {
        assert_eq!(allowed_bytes(1 << 30, 50 << 20), (1 << 30) + (114 << 20));
        assert_eq!(allowed_bytes(u64::MAX, 1), u64::MAX);
    }
}
