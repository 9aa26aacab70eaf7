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
//! Pending signals and POSIX timers (SECURITY.md #120): RLIMIT_SIGPENDING, see
//! [`SIGNALS_PENDING`].
//!
//! Threads (SECURITY.md #49): RLIMIT_NPROC, which the kernel checks per real uid against every
//! task (thread) of that uid on the machine, and never for real uid 0. So for a non-root
//! worker the cap is set to the tasks on the machine at start (an upper bound of the uid's own)
//! plus the policy's `threads`; a root worker is capped by a pids cgroup instead when one is
//! writable (see [`super::cgroup`]).

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
}

/// Applies `limits` (and no core dumps) to the current process.
pub fn apply_worker_limits(limits: &WorkerLimits) -> std::io::Result<()> {
    Resource::CORE.set(0, 0)?;
    Resource::CPU.set(limits.cpu_seconds, limits.cpu_seconds + 5)?;
    Resource::DATA.set(limits.memory_bytes, limits.memory_bytes)?;
    Resource::AS.set(limits.address_space_bytes, limits.address_space_bytes)?;
    Resource::FSIZE.set(limits.file_size_bytes, limits.file_size_bytes)?;
    Resource::NOFILE.set(limits.open_files, limits.open_files)?;
    let nproc = thread_rlimit(limits.threads, tasks_on_machine()?);
    Resource::NPROC.set(nproc, nproc)?;
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

/// The most descriptors one `SCM_RIGHTS` message carries (the kernel's `SCM_MAX_FD`).
const SCM_MAX_FD: u64 = 253;
/// Room for descriptors that the uid's other processes have in flight (passing one is brief).
const IN_FLIGHT_MARGIN: u64 = 64;

/// The host's own descriptor limit, as it matters for passing a new worker its socket.
///
/// The kernel refuses an `SCM_RIGHTS` message (`ETOOMANYREFS`) while the descriptors the
/// sender's uid has in flight exceed the *sender's* soft RLIMIT_NOFILE, unless the sender has
/// CAP_SYS_RESOURCE or CAP_SYS_ADMIN. A worker of the same uid can send descriptors to itself
/// and never read them, bringing that count to its own limit plus one message; with the host's
/// soft limit at the common 1024 no new worker could then be started (SECURITY.md #117).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostDescriptors {
    pub soft: u64,
    pub hard: u64,
    /// What the soft limit must reach: the workers' `open_files` plus one message and a margin.
    pub needed: u64,
    /// The host holds CAP_SYS_RESOURCE or CAP_SYS_ADMIN, so the kernel does not apply the check.
    pub exempt: bool,
}

impl HostDescriptors {
    pub fn enough(&self) -> bool {
        self.exempt || self.soft >= self.needed
    }

    pub fn describe(&self) -> String {
        if self.exempt {
            format!(
                "soft limit {}; the host holds CAP_SYS_RESOURCE, which the kernel's descriptors-in-flight check exempts",
                self.soft
            )
        } else if self.enough() {
            format!(
                "soft limit {} (hard {}), at least the {} that workers' descriptors in flight can reach",
                self.soft, self.hard, self.needed
            )
        } else {
            format!(
                "TOO LOW: soft limit {} (hard {}); a worker can put enough descriptors in flight for this uid that no new worker can be started. Raise the hard limit (`ulimit -Hn`, systemd `LimitNOFILE=`, docker `--ulimit nofile=`) to at least {}, or lower the policy's limits.open_files to at most {}",
                self.soft,
                self.hard,
                self.needed,
                self.soft.saturating_sub(SCM_MAX_FD + IN_FLIGHT_MARGIN)
            )
        }
    }
}

/// Raises this process's soft RLIMIT_NOFILE to its hard limit (what Go and systemd services do
/// by default) and says whether that is enough for workers whose limit is `worker_open_files`.
/// The zygote and workers inherit the raised limit; workers lower theirs at lockdown.
pub fn raise_host_descriptors(worker_open_files: u64) -> std::io::Result<HostDescriptors> {
    let soft = rlimit::increase_nofile_limit(u64::MAX)?;
    let (_, hard) = Resource::NOFILE.get()?;
    Ok(HostDescriptors {
        soft,
        hard,
        needed: worker_open_files
            .saturating_add(SCM_MAX_FD)
            .saturating_add(IN_FLIGHT_MARGIN),
        exempt: holds_resource_capability(),
    })
}

/// CAP_SYS_RESOURCE (24) or CAP_SYS_ADMIN (21) in this process's effective set.
fn holds_resource_capability() -> bool {
    let Ok(status) = std::fs::read_to_string("/proc/self/status") else {
        return false;
    };
    status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        .is_some_and(|caps| caps & ((1 << 24) | (1 << 21)) != 0)
}

/// RLIMIT_NPROC for a worker that may add `threads` threads while `tasks_now` tasks exist.
/// The kernel compares it with the uid's task count, which is at most the machine's.
pub fn thread_rlimit(threads: u64, tasks_now: u64) -> u64 {
    tasks_now.saturating_add(threads)
}

/// Tasks (threads) on the machine now: the denominator of `/proc/loadavg`'s fourth field.
fn tasks_on_machine() -> std::io::Result<u64> {
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
