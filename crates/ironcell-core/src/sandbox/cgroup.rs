//! The thread cap of a root worker: a pids cgroup of its own (SECURITY.md #49).
//!
//! The kernel never applies RLIMIT_NPROC to real uid 0, with or without capabilities, so a
//! root worker that starts thousands of small-stack threads is stopped only by a cgroup's
//! `pids.max`. Where the cgroup v1 pids hierarchy is writable (root, outside a container that
//! hides it), each worker, still holding its capabilities, makes `ironcell/w<pid>` beneath the
//! server's own pids cgroup (so a limit set on the server's service still covers its workers),
//! writes `pids.max` and moves itself in. The host removes a worker's group when the zygote
//! reports that worker reaped ([`remove_group_of`]), those of its live workers when it kills
//! the zygote, as they exit ([`remove_groups_once_empty`]), and the groups of workers that are
//! gone without a report (a zygote that died took its workers along) whenever it starts a zygote
//! ([`remove_groups_of_gone_workers`]). A worker does neither: a scan of the parent in every new
//! worker cost a `stat` of `/proc/<pid>` per live worker, ~0.2 ms of each worker's start with
//! 200 sessions (`perf`, bursts of 20).
//!
//! cgroup v2 is not used yet: a v2 controller can only be enabled below a group with no
//! processes, which needs the server to move itself first (and, for a non-root user, systemd
//! delegation). Without a writable pids hierarchy a root worker's threads are not capped, and
//! `doctor` and `system://info` say so.

use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

const V1_PIDS_ROOT: &str = "/sys/fs/cgroup/pids";

/// Where a server's workers make their cgroups (as root): the host removes each worker's as it
/// is reaped.
#[derive(Debug, Clone, Default)]
pub struct WorkerGroups {
    pub pids: Option<PathBuf>,
    pub memory: Option<super::memcg::MemoryGroups>,
}

/// Where workers of this server put their pids groups, when the host can use cgroups.
/// `None` when not root (RLIMIT_NPROC applies then) or no writable v1 pids hierarchy exists.
pub fn pids_parent_for_workers() -> Option<PathBuf> {
    if !nix::unistd::geteuid().is_root() {
        return None;
    }
    v1_parent_for_workers(V1_PIDS_ROOT, "pids")
}

/// `<root>/<this process's group of `controller`>/ironcell`, where this process may make groups
/// (root, a v1 hierarchy of that controller mounted at `root` and writable).
pub(super) fn v1_parent_for_workers(root: &str, controller: &str) -> Option<PathBuf> {
    let own = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let rel = v1_path(&own, controller)?;
    let base = Path::new(root).join(rel.trim_start_matches('/'));
    if !base.join("cgroup.procs").exists() {
        return None;
    }
    nix::unistd::access(&base, nix::unistd::AccessFlags::W_OK).ok()?;
    Some(base.join("ironcell"))
}

/// The pids controller's path in `/proc/self/cgroup` (v1 lines look like `5:pids:/user.slice`).
fn v1_pids_path(proc_cgroup: &str) -> Option<String> {
    v1_path(proc_cgroup, "pids")
}

/// A v1 controller's path in a `/proc/<pid>/cgroup` text.
pub(super) fn v1_path(proc_cgroup: &str, controller: &str) -> Option<String> {
    proc_cgroup.lines().find_map(|line| {
        let mut parts = line.splitn(3, ':');
        let (_id, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        controllers
            .split(',')
            .any(|c| c == controller)
            .then(|| path.to_string())
    })
}

/// Moves the calling process into a new pids group beneath `parent` that allows at most
/// `max_tasks` tasks (the process and its threads). Needs the privileges the worker still has
/// before its lockdown drops them.
pub fn join_new_pids_group(parent: &Path, pid: u32, max_tasks: u64) -> io::Result<()> {
    join_new_group(parent, pid, &[("pids.max", &max_tasks.to_string())])
}

/// Moves the calling process into the group `w<pid>` beneath `parent` (made if missing), with
/// each `(file, value)` of `settings` written first, in order.
pub(super) fn join_new_group(parent: &Path, pid: u32, settings: &[(&str, &str)]) -> io::Result<()> {
    std::fs::create_dir_all(parent)?;
    let dir = parent.join(format!("w{pid}"));
    // The host's cleanup may remove an empty group between creating and joining it (a reused
    // pid whose earlier worker's exit is being reported): a file of a removed group is gone
    // (NotFound), or, opened just before, refuses the write (ENODEV).
    let mut last = None;
    for _ in 0..3 {
        match try_join(&dir, pid, settings) {
            Ok(()) => return Ok(()),
            Err(e)
                if e.kind() == io::ErrorKind::NotFound
                    || e.raw_os_error() == Some(libc::ENODEV) =>
            {
                last = Some(e)
            }
            Err(e) => return Err(e),
        }
    }
    Err(last.unwrap_or_else(|| io::Error::other("could not join the cgroup")))
}

fn try_join(dir: &Path, pid: u32, settings: &[(&str, &str)]) -> io::Result<()> {
    match std::fs::create_dir(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(e),
    }
    for (file, value) in settings {
        std::fs::write(dir.join(file), value)?;
    }
    // A worker joins before it starts any other thread, so moving the calling thread moves the
    // whole process, and every thread it starts later is created in the group. A thread moving
    // itself ("0" in `tasks`) skips the system-wide lock a whole-process move takes, whose first
    // taker after a quiet spell waits for an RCU grace period: ~13 ms median per worker here for
    // `cgroup.procs` when workers start 50 ms apart, ~0.06 ms back to back. (Upstream's "cgroup:
    // Optimize single thread migration"; a kernel without it takes the lock either way.) A
    // process with more threads, or whose threads cannot be counted, is moved whole.
    if super::sys::threads_of_this_process() == Some(1) {
        std::fs::write(dir.join("tasks"), "0")
    } else {
        std::fs::write(dir.join("cgroup.procs"), pid.to_string())
    }
}

/// Moves process `pid` (a forked session's worker, still in its parent's group) into a new
/// pids group of its own beneath `parent`, capped at `max_tasks`: each session counts its own
/// tasks (SECURITY.md #196). Done by the host, which may write the hierarchy.
pub fn move_into_new_pids_group(parent: &Path, pid: i32, max_tasks: u64) -> io::Result<()> {
    let dir = parent.join(format!("w{pid}"));
    match std::fs::create_dir(&dir) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(e),
    }
    std::fs::write(dir.join("pids.max"), max_tasks.to_string())?;
    std::fs::write(dir.join("cgroup.procs"), pid.to_string())
}

/// Keeps the kernel's cgroup lock ready for a move about to come (a fork's, once the parent's
/// page tables are copied: ~15 ms at 512 MiB) until `stop` is set, `most` at the longest: every
/// [`READY_EVERY`] the calling thread is put back into the pids group it is in (its own tid
/// written to that group's `tasks`, which changes nothing). Taking that system-wide lock after a
/// quiet spell first waits for an RCU grace period (moves 8.5 ms median, up to 34 ms, here),
/// and it stays quick for about one grace period after it is let go, so a move while it is
/// kept ready takes 0.2-0.3 ms (each re-adding ~0.13 ms). Blocks: run it on a thread of its own.
pub fn keep_the_move_lock_ready(stop: &AtomicBool, most: Duration) -> io::Result<()> {
    let own = std::fs::read_to_string("/proc/thread-self/cgroup")?;
    let rel = v1_pids_path(&own).ok_or_else(|| io::Error::other("no v1 pids group"))?;
    let tasks = Path::new(V1_PIDS_ROOT)
        .join(rel.trim_start_matches('/'))
        .join("tasks");
    let tid = nix::unistd::gettid().as_raw().to_string();
    let deadline = Instant::now() + most;
    while !stop.load(Ordering::Relaxed) && Instant::now() < deadline {
        std::fs::write(&tasks, &tid)?;
        std::thread::sleep(READY_EVERY);
    }
    Ok(())
}

/// How often [`keep_the_move_lock_ready`] takes the lock: well within a grace period here.
const READY_EVERY: Duration = Duration::from_millis(3);

/// Removes the pids group of worker `pid` once it is gone (the zygote reaped it). The kernel
/// refuses (EBUSY) to remove a group that still has tasks, so a pid already reused by a new
/// worker in that group can never lose its cap; one reused before it joins finds the group gone
/// and makes it again. Returns `false` only for that refusal: the group still has tasks.
pub fn remove_group_of(parent: &Path, pid: i32) -> bool {
    remove_group_of_name(parent, &format!("w{pid}"))
}

/// [`remove_group_of`] by the group's name.
pub(super) fn remove_group_of_name(parent: &Path, name: &str) -> bool {
    let dir = parent.join(name);
    match std::fs::remove_dir(&dir) {
        Ok(()) => true,
        Err(e) if e.kind() == io::ErrorKind::NotFound => true,
        Err(e) if e.raw_os_error() == Some(libc::EBUSY) => false,
        Err(e) => {
            tracing::debug!(dir = %dir.display(), error = %e, "cgroup not removed");
            true
        }
    }
}

/// Removes the groups of `pids`, workers of this server that are exiting (their zygote was
/// killed), as each empties ([`remove_group_of`], again while it still has tasks). Gives up
/// after `patience`; a group left then is removed by the next server's start.
pub fn remove_groups_once_empty(parent: &Path, mut pids: Vec<i32>, patience: Duration) {
    let deadline = Instant::now() + patience;
    loop {
        pids.retain(|&pid| !remove_group_of(parent, pid));
        if pids.is_empty() || Instant::now() >= deadline {
            return;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// `rmdir` on the groups of workers whose pid no longer exists (a cheap check that spares an
/// `rmdir` attempt on each live group): what workers left behind without a reported exit.
/// Another server's live workers may share `parent`; their groups are never empty, and the
/// kernel refuses to remove a group that has tasks.
pub fn remove_groups_of_gone_workers(parent: &Path) {
    let Ok(entries) = std::fs::read_dir(parent) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix('w'))
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        if !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = std::fs::remove_dir(entry.path());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeping_the_move_lock_ready_moves_nothing_and_stops_when_told() {
        let before = std::fs::read_to_string("/proc/thread-self/cgroup").unwrap();
        let stop = std::sync::Arc::new(AtomicBool::new(false));
        let stopper = {
            let stop = stop.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(30));
                stop.store(true, Ordering::Relaxed);
            })
        };
        let started = Instant::now();
        let kept = keep_the_move_lock_ready(&stop, Duration::from_secs(60));
        stopper.join().unwrap();
        // Stopped by the flag, long before `most` (a write waits one grace period at most).
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "{:?}",
            started.elapsed()
        );
        if pids_parent_for_workers().is_some() {
            assert!(kept.is_ok(), "{kept:?}");
        }
        assert_eq!(
            std::fs::read_to_string("/proc/thread-self/cgroup").unwrap(),
            before
        );
    }

    #[test]
    fn the_pids_line_is_found_among_v1_and_v2_lines() {
        let text = "12:memory:/x\n5:pids:/user.slice/u\n0::/init.scope\n";
        assert_eq!(v1_pids_path(text).as_deref(), Some("/user.slice/u"));
        assert_eq!(v1_pids_path("3:cpu,pids:/\n").as_deref(), Some("/"));
        assert_eq!(v1_pids_path("0::/init.scope\n"), None);
    }
}
