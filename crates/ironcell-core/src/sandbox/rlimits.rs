//! Resource limits of a worker. The host adds what rlimits cannot do (wall clock, output size,
//! scratch quota, number of sessions).
//!
//! Memory: RLIMIT_DATA bounds the heap and private mappings (a Python `MemoryError`), and
//! RLIMIT_AS bounds everything mapped, shared anonymous memory included, which RLIMIT_DATA does
//! not count (SECURITY.md #48). RLIMIT_AS is the data limit plus a headroom for what reserves
//! address space without using memory (thread stacks, malloc arenas), because at the data limit
//! alone a few threads would exhaust it. memfd, whose pages belong to no mapping, is refused by
//! seccomp.
//!
//! Locked memory (SECURITY.md #127): none. Locking one 4 KiB page of a large page-cache folio
//! (`mlock`, `MAP_LOCKED`) kept the whole 2 MiB folio from being reclaimed, uncounted: 4 MiB
//! locked held 2.1 GiB (the inherited limit, 8 MiB, allowed twice that). Python workloads do not
//! lock memory.
//!
//! Pending signals and POSIX timers (SECURITY.md #120): RLIMIT_SIGPENDING, see
//! [`SIGNALS_PENDING`].
//!
//! Threads (SECURITY.md #49, #153): RLIMIT_NPROC, which the kernel checks against the tasks
//! (threads) of the real uid *in the caller's user namespace* (since Linux 5.14), and never for
//! real uid 0. A worker in a user namespace of its own (the private `/tmp`) is the only task
//! there, so its cap is exactly its own: 1 + the policy's `threads`, whatever other sessions
//! hold, and the sum over workers is bounded by the number of live workers. (The cap was once
//! the machine's task count + `threads` there too, which counted the machine but bound only the
//! worker: each new session could start as many threads as the whole machine ran, and seven
//! sessions in a row took every pid.) A worker without one shares the count of its uid with
//! every process of that uid, so one session's threads would come out of every other's room:
//! there the cap is the machine's tasks at its start + `threads` for every worker that may live
//! at once (the sum stays bounded), and the host's memory watch kills a worker running more
//! than its own `threads` (see `src/session/resident.rs`). A root worker is capped by a pids cgroup instead when one is writable (see [`super::cgroup`]).

use rlimit::Resource;
use serde::{Deserialize, Serialize};

/// The limits applied to one worker, in the units the kernel uses.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerLimits {
    /// RLIMIT_CPU soft limit over the worker's life; the hard limit is 5 s higher so SIGXCPU
    /// arrives (and is reported) before SIGKILL.
    pub cpu_seconds: u64,
    /// RLIMIT_DATA: heap, private anonymous mappings and thread stacks.
    pub memory_bytes: u64,
    /// RLIMIT_AS: every mapping, shared ones included (`memory_bytes` plus headroom).
    pub address_space_bytes: u64,
    /// RLIMIT_FSIZE: the largest file the worker can write.
    pub file_size_bytes: u64,
    /// RLIMIT_NOFILE.
    pub open_files: u64,
    /// Threads the worker may add (RLIMIT_NPROC for a non-root worker; the pids cgroup's
    /// `pids.max` for a root one).
    pub threads: u64,
    /// Workers that may live at once (sessions and spares): where the uid's count is shared
    /// ([`TaskCount::SharedWithUid`]), RLIMIT_NPROC leaves room for all of them, and the host's
    /// watch holds each to `threads` (SECURITY.md #153).
    #[serde(default = "one")]
    pub workers: u64,
}

fn one() -> u64 {
    1
}

/// How the kernel counts the worker's tasks for RLIMIT_NPROC.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TaskCount {
    /// In a user namespace of the worker's own: only its own tasks.
    OwnUserNamespace,
    /// Every task of the worker's uid on the machine, of which there are at most `tasks_now`
    /// (read by [`tasks_on_machine`] before `/proc` was hidden).
    SharedWithUid { tasks_now: u64 },
}

/// Applies `limits` (and no core dumps) to the current process.
pub fn apply_worker_limits(limits: &WorkerLimits, count: TaskCount) -> std::io::Result<()> {
    Resource::CORE.set(0, 0)?;
    Resource::CPU.set(limits.cpu_seconds, limits.cpu_seconds + 5)?;
    Resource::DATA.set(limits.memory_bytes, limits.memory_bytes)?;
    Resource::AS.set(limits.address_space_bytes, limits.address_space_bytes)?;
    Resource::FSIZE.set(limits.file_size_bytes, limits.file_size_bytes)?;
    Resource::NOFILE.set(limits.open_files, limits.open_files)?;
    let nproc = match count {
        TaskCount::OwnUserNamespace => thread_rlimit(limits.threads, 1),
        TaskCount::SharedWithUid { tasks_now } => thread_rlimit(
            limits.threads.saturating_mul(limits.workers.max(1)),
            tasks_now,
        ),
    };
    // Never above the hard limit, which only CAP_SYS_RESOURCE may raise: with hundreds of
    // sessions the sum passed it and every new worker failed with EPERM (a lower cap only
    // narrows; for real uid 0 the kernel never checks it).
    let (_, hard_nproc) = Resource::NPROC.get()?;
    let nproc = nproc.min(hard_nproc);
    Resource::NPROC.set(nproc, nproc)?;
    Resource::MEMLOCK.set(0, 0)?;
    let (_, hard) = Resource::SIGPENDING.get()?;
    let pending = SIGNALS_PENDING.min(hard);
    Resource::SIGPENDING.set(pending, pending)?;
    Ok(())
}

/// RLIMIT_SIGPENDING of a worker. Each POSIX timer and each queued real-time signal is charged
/// to a count the kernel keeps per uid (shared with the host and every other process of that
/// uid) and checked against the creating task's limit, by default ~1/2 of the machine's thread
/// maximum. Left there, one worker's `timer_create` loop took the whole uid's budget
/// (SECURITY.md #120). Python's own timers (`setitimer`, `time.sleep`) are not charged.
pub const SIGNALS_PENDING: u64 = 1024;

/// RLIMIT_NPROC for a worker that may add `threads` threads while `tasks_now` tasks exist.
/// The kernel compares it with the uid's task count, which is at most the machine's.
pub fn thread_rlimit(threads: u64, tasks_now: u64) -> u64 {
    tasks_now.saturating_add(threads)
}

/// Tasks (threads) on the machine now: the denominator of `/proc/loadavg`'s fourth field.
pub fn tasks_on_machine() -> std::io::Result<u64> {
    let text = std::fs::read_to_string("/proc/loadavg")?;
    parse_loadavg_tasks(&text).ok_or_else(|| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("unexpected /proc/loadavg: {text:?}"),
        )
    })
}

fn parse_loadavg_tasks(text: &str) -> Option<u64> {
    text.split_whitespace()
        .nth(3)?
        .split('/')
        .nth(1)?
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_task_count_is_read_from_loadavg() {
        assert_eq!(parse_loadavg_tasks("0.08 0.68 0.60 1/91 8112\n"), Some(91));
        assert_eq!(parse_loadavg_tasks("garbage"), None);
        assert!(tasks_on_machine().unwrap() >= 1);
        assert_eq!(thread_rlimit(256, 91), 347);
    }
}
