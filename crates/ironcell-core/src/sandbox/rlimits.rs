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
//! A forked session (SECURITY.md #239) starts with its parent's limits, and both count the
//! mappings it inherited, shared copy-on-write: a fork of a session holding 400 of 500 MiB had
//! ~100 MiB of its own. So where sessions may fork, the hard limits of both are twice the soft
//! ones ([`FORK_HEADROOM`]), the seccomp filter refuses every change of them from inside, and the
//! host fits a fork's soft limits to what it shares ([`fit_fork_memory_limits`]), never past
//! the hard ones, so they stop it where the memory watch, which counts its proportional share,
//! would.
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

/// How many times its soft memory limits (RLIMIT_DATA, RLIMIT_AS) a worker's hard ones are
/// where sessions may fork: the room the host may give a fork for what it inherited.
pub const FORK_HEADROOM: u64 = 2;

/// Applies `limits` (and no core dumps) to the current process. `fork_headroom`: the hard
/// memory limits are [`FORK_HEADROOM`] times the soft ones, for the host to raise a fork's soft
/// limits into; only where the seccomp filter will refuse the worker every change of them.
pub fn apply_worker_limits(
    limits: &WorkerLimits,
    count: TaskCount,
    fork_headroom: bool,
) -> std::io::Result<()> {
    let hard = |soft: u64| match fork_headroom {
        true => soft.saturating_mul(FORK_HEADROOM),
        false => soft,
    };
    Resource::CORE.set(0, 0)?;
    Resource::CPU.set(limits.cpu_seconds, limits.cpu_seconds + 5)?;
    Resource::DATA.set(limits.memory_bytes, hard(limits.memory_bytes))?;
    Resource::AS.set(limits.address_space_bytes, hard(limits.address_space_bytes))?;
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

/// Takes the headroom of [`apply_worker_limits`] back (hard = soft): for a worker whose seccomp
/// filter could not be installed (best-effort mode), which could otherwise raise its own soft
/// limits into it.
pub fn drop_fork_headroom() -> std::io::Result<()> {
    for resource in [Resource::DATA, Resource::AS] {
        let (soft, _) = resource.get()?;
        resource.set(soft, soft)?;
    }
    Ok(())
}

/// A fork's soft memory limits after [`fit_fork_memory_limits`], in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fitted {
    pub data_bytes: u64,
    pub address_space_bytes: u64,
}

/// Sets the soft RLIMIT_DATA and RLIMIT_AS of the fork `pid` to `memory_bytes` and
/// `address_space_bytes` plus `shared_bytes`, the part of the memory it maps that is not
/// charged to it because other processes map it too (its parent, copy-on-write): so the
/// rlimits, which count every page it maps, stop it where the memory watch, which counts its
/// proportional share, would (SECURITY.md #239). Raised or lowered, never past its hard limits,
/// which the host cannot raise (that takes `CAP_SYS_RESOURCE`): a soft limit up to the hard one
/// is every same-uid process's to set, and lowering is always allowed.
pub fn fit_fork_memory_limits(
    pid: i32,
    memory_bytes: u64,
    address_space_bytes: u64,
    shared_bytes: u64,
) -> std::io::Result<Fitted> {
    Ok(Fitted {
        data_bytes: set_soft(
            pid,
            Resource::DATA,
            memory_bytes.saturating_add(shared_bytes),
        )?,
        address_space_bytes: set_soft(
            pid,
            Resource::AS,
            address_space_bytes.saturating_add(shared_bytes),
        )?,
    })
}

/// Sets `pid`'s soft `resource` limit to `want` capped by its hard one; returns it.
fn set_soft(pid: i32, resource: Resource, want: u64) -> std::io::Result<u64> {
    let (mut soft, mut hard) = (0, 0);
    rlimit::prlimit(pid, resource, None, Some((&mut soft, &mut hard)))?;
    let new = want.min(hard);
    if new != soft {
        rlimit::prlimit(pid, resource, Some((new, hard)), None)?;
    }
    Ok(new)
}

/// A `Name:  <n> kB` field of a `/proc/<pid>/status` or `smaps_rollup` text (read as bytes: its first line is a
/// name the process chose, not necessarily UTF-8).
pub fn status_kib(status: &[u8], name: &[u8]) -> Option<u64> {
    status.split(|&b| b == b'\n').find_map(|line| {
        let rest = line.strip_prefix(name)?.strip_prefix(b":")?;
        let text = std::str::from_utf8(rest).ok()?;
        text.trim().strip_suffix("kB")?.trim().parse().ok()
    })
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

    #[test]
    fn status_fields_are_read_by_their_whole_name() {
        let status = b"Name:\tpy\xff\nVmSize:\t  900 kB\nVmData:\t 700 kB\nVmDataX:\t1 kB\n";
        assert_eq!(status_kib(status, b"VmData"), Some(700));
        assert_eq!(status_kib(status, b"VmSize"), Some(900));
        assert_eq!(status_kib(status, b"VmPTE"), None);
    }

    #[test]
    fn a_childs_soft_limits_are_fitted_to_what_it_shares_never_past_the_hard_ones() {
        // A child with RLIMIT_DATA 64 MiB soft and 1 GiB hard, RLIMIT_AS 8 GiB soft, 16 GiB
        // hard: raised by what it shares, lowered again, capped by the hard limits.
        let mut pipe = [0; 2];
        // SAFETY: pipe(2) into a local array.
        assert_eq!(unsafe { libc::pipe(pipe.as_mut_ptr()) }, 0);
        // SAFETY: the child only sets its limits, reports and waits to be killed.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            let ok = Resource::DATA.set(64 << 20, 1 << 30).is_ok()
                && Resource::AS.set(8 << 30, 16 << 30).is_ok();
            // SAFETY: writes one byte to the pipe, then sleeps until killed.
            unsafe {
                libc::write(pipe[1], [u8::from(ok)].as_ptr().cast(), 1);
                libc::pause();
                libc::_exit(0)
            }
        }
        let mut byte = [0u8];
        // SAFETY: reads one byte from our pipe.
        unsafe { libc::read(pipe[0], byte.as_mut_ptr().cast(), 1) };
        let data = |pid| {
            let (mut soft, mut hard) = (0, 0);
            rlimit::prlimit(pid, Resource::DATA, None, Some((&mut soft, &mut hard)))
                .map(|_| (soft, hard))
        };
        let raised = fit_fork_memory_limits(pid, 64 << 20, 8 << 30, 100 << 20);
        let after_raise = data(pid);
        let lowered = fit_fork_memory_limits(pid, 64 << 20, 8 << 30, 0);
        let after_lower = data(pid);
        let capped = fit_fork_memory_limits(pid, 2 << 30, 8 << 30, 9 << 30);
        // SAFETY: ends and reaps our own child.
        unsafe {
            libc::kill(pid, libc::SIGKILL);
            libc::waitpid(pid, std::ptr::null_mut(), 0);
        }
        assert_eq!(byte[0], 1, "the child could not set its limits");
        let fitted = |d: u64, a: u64| Fitted {
            data_bytes: d,
            address_space_bytes: a,
        };
        assert_eq!(raised.unwrap(), fitted(164 << 20, (8 << 30) + (100 << 20)));
        assert_eq!(after_raise.unwrap(), (164 << 20, 1 << 30));
        assert_eq!(lowered.unwrap(), fitted(64 << 20, 8 << 30));
        assert_eq!(after_lower.unwrap(), (64 << 20, 1 << 30));
        assert_eq!(capped.unwrap(), fitted(1 << 30, 16 << 30));
        assert!(fit_fork_memory_limits(i32::MAX, 1, 1, 1).is_err());
    }
}
