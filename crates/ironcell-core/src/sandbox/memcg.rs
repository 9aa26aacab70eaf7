//! Transparent huge pages for root workers, counted whole: a memory cgroup per session lineage
//! (SECURITY.md #271-#274).
//!
//! A fork of a session holding 512 MiB in 4 KiB pages copies 131,072 page-table entries
//! (~14 ms here); in 2 MiB pages, 256 (~0.8 ms). Workers refuse huge pages elsewhere
//! (`PR_SET_THP_DISABLE`, #132): a huge page unmapped but for 4 KiB stays whole while RssAnon
//! and the rlimits count 4 KiB. A memory cgroup charges a huge page whole, and the kernel's
//! deferred-split shrinker is cgroup-aware: at the group's limit, reclaim splits such pages and
//! frees their unmapped parts (3,000 cut-down pages under a 256 MiB group: 2,942 split, the
//! group never past its limit, no OOM kill). So where the host can give each worker a v1
//! memory group of its own (root, a writable `memory` hierarchy), the worker joins
//! `ironcell/w<pid>` beneath the server's own memory group before its lockdown and keeps huge
//! pages once Landlock is in force; everywhere else huge pages stay off.
//!
//! One group per lineage, not per session: a page stays charged to the group of the process
//! that allocated it, so after `fork_from` the pages a parent rewrites are charged to it twice
//! (its new copy, and the original its fork keeps), and a session forked k times could be
//! charged k times its size. The forks of a session stay in its group, whose limit is one
//! session's ([`MemoryGroups::limit_bytes`]) per live member; the host raises it when a fork
//! joins ([`fork_joined`]) and lowers it, or removes the group, as members are reaped
//! ([`worker_gone`]).
//!
//! The limit: the memory limit (which RLIMIT_DATA already holds a worker's private memory to)
//! plus [`SLACK_BYTES`] for page tables and kernel memory; plus the scratch quota when the
//! state directory is on tmpfs (session files are then memory charged to the writer). Page
//! cache is reclaimable and is reclaimed within the group.

use std::collections::HashMap;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{LazyLock, Mutex};

use serde::{Deserialize, Serialize};

const V1_MEMORY_ROOT: &str = "/sys/fs/cgroup/memory";

/// Room in a group beyond the memory limit: page tables, kernel memory, dirty page cache.
pub const SLACK_BYTES: u64 = 128 << 20;

/// Where root workers make their memory groups, and each session's share of a group's limit.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryGroups {
    pub parent: PathBuf,
    pub limit_bytes: u64,
}

/// Where workers of this server make their memory groups: `None` when not root or when no
/// writable v1 memory hierarchy exists.
pub fn memory_parent_for_workers() -> Option<PathBuf> {
    if !nix::unistd::geteuid().is_root() {
        return None;
    }
    super::cgroup::v1_parent_for_workers(V1_MEMORY_ROOT, "memory")
}

impl MemoryGroups {
    /// Moves the calling worker (one thread, capabilities still held) into a new memory group
    /// `w<pid>` limited to [`MemoryGroups::limit_bytes`]. A group of that name that still holds
    /// processes (a lineage whose first worker had this pid, not yet renamed by the host) is
    /// refused rather than shared: its limit is that lineage's.
    pub fn join(&self, pid: u32) -> io::Result<()> {
        let dir = self.parent.join(format!("w{pid}"));
        if let Ok(procs) = std::fs::read_to_string(dir.join("cgroup.procs"))
            && !procs.trim().is_empty()
        {
            return Err(io::Error::other(format!(
                "{} still holds another session's processes",
                dir.display()
            )));
        }
        let limit = self.limit_bytes.to_string();
        let settings = [
            ("memory.limit_in_bytes", limit.as_str()),
            // No kernel OOM kill in the group: a task that would take it past its limit waits
            // there, and the host's memory watch ends the session ([`groups_at_limit`]).
            ("memory.oom_control", "1"),
        ];
        super::cgroup::join_new_group(&self.parent, pid, &settings)
    }
}

/// A worker's memory group whose tasks wait at its limit, as the host's memory watch finds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AtLimit {
    /// The processes in the group: its session's worker (or a lineage's workers) and their
    /// children.
    pub pids: Vec<i32>,
    /// What the group holds, as the kernel charges it.
    pub usage_bytes: u64,
}

/// The groups beneath `parent` whose tasks wait at the group's limit (`under_oom`).
///
/// Workers' groups turn the kernel's OOM killer off (`oom_kill_disable`, SECURITY.md #275).
/// With it on, the kernel chose whom to kill: the largest process in the group, often one of
/// the session's children, killed silently while the session ran on (four children growing to
/// 0.4 times the limit each at once: the run ended "ok", test_children's `latehog`). With it
/// off, a task that would take the group past its limit, after reclaim (which splits cut-down
/// huge pages first), sleeps until memory is freed or it is killed; the watch reads this every
/// tick and ends the session whose processes hold the most, with the over-memory error a user
/// sees for any other way past the limit.
pub fn groups_at_limit(parent: &Path) -> Vec<AtLimit> {
    let Ok(entries) = std::fs::read_dir(parent) else {
        return Vec::new();
    };
    entries
        .flatten()
        // The parent also holds its own ~25 control files: `file_type` comes with the listing,
        // where opening `<file>/memory.oom_control` cost a failed path walk each, every tick.
        .filter(|entry| entry.file_type().is_ok_and(|t| t.is_dir()))
        .filter_map(|entry| {
            let dir = entry.path();
            let control = std::fs::read_to_string(dir.join("memory.oom_control")).ok()?;
            if field(&control, "under_oom") != Some(1) {
                return None;
            }
            let procs = std::fs::read_to_string(dir.join("cgroup.procs")).ok()?;
            Some(AtLimit {
                pids: procs
                    .lines()
                    .filter_map(|l| l.trim().parse().ok())
                    .collect(),
                usage_bytes: read_u64(&dir.join("memory.usage_in_bytes")).unwrap_or(0),
            })
        })
        .collect()
}

/// The host's view of the groups that hold forks: members (the first worker while it lives,
/// and each live fork) per group name, and the group of each live fork.
#[derive(Default)]
struct Lineages {
    members: HashMap<String, u64>,
    group_of_fork: HashMap<i32, String>,
    /// `oom_kill` of each group when last read.
    oom_kills: HashMap<String, u64>,
    /// Groups whose last member went while they still held tasks, by name: removed once empty.
    unjoined: HashMap<String, PathBuf>,
    renamed: u64,
}

static LINEAGES: LazyLock<Mutex<Lineages>> = LazyLock::new(Default::default);

fn lineages() -> std::sync::MutexGuard<'static, Lineages> {
    LINEAGES.lock().unwrap_or_else(|e| e.into_inner())
}

/// The fork `pid` (still in its parent's memory group, as forked) is a new member of that
/// group: its limit grows by one session's. The group is read from the fork's own
/// `/proc/<pid>/cgroup`, not assumed from its lineage, under the same lock as
/// [`worker_gone`]'s renaming. Once per fork: a second call for the same pid (a move retried)
/// changes nothing.
///
/// A group still named `w<pid>` holds its first worker; a renamed one (`l…`) does not. Its
/// count starts there: a group whose first worker was reaped while this fork copied its files
/// (before it said `ready`) was renamed with no member, so the fork is its only one
/// (SECURITY.md #294).
pub fn fork_joined(groups: &MemoryGroups, pid: i32) -> io::Result<()> {
    let mut l = lineages();
    if l.group_of_fork.contains_key(&pid) {
        return Ok(());
    }
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup"))?;
    let rel = super::cgroup::v1_path(&text, "memory")
        .ok_or_else(|| io::Error::other("the fork is in no v1 memory group"))?;
    let path = Path::new(V1_MEMORY_ROOT).join(rel.trim_start_matches('/'));
    let name = match path.parent() {
        Some(p) if p == groups.parent => path.file_name().and_then(|n| n.to_str()),
        _ => None,
    }
    .ok_or_else(|| io::Error::other(format!("{} is not a session's group", path.display())))?
    .to_string();
    let first_lives = u64::from(name.starts_with('w'));
    let members = l.members.entry(name.clone()).or_insert(first_lives);
    *members += 1;
    let limit = groups.limit_bytes.saturating_mul(*members);
    l.group_of_fork.insert(pid, name);
    std::fs::write(path.join("memory.limit_in_bytes"), limit.to_string())
}

/// Worker `pid` was reaped: its group loses a member, and is removed with its last one (a
/// first worker whose forks live on, or whose fork has not joined yet, leaves its group
/// renamed, so that a new worker given its pid makes a group of its own). Returns the group's peak usage if the kernel's OOM killer
/// acted in that group since the last look: off in the group (#275), it acts there only in a
/// machine-wide OOM, and the worker is reported as over its memory limit.
pub fn worker_gone(groups: &MemoryGroups, pid: i32) -> Option<u64> {
    let mut l = lineages();
    let peak = member_gone(&mut l, groups, pid);
    remove_groups_left_with_no_member(&mut l);
    peak
}

/// [`worker_gone`] for the group of `pid`.
fn member_gone(l: &mut Lineages, groups: &MemoryGroups, pid: i32) -> Option<u64> {
    let (name, first) = match l.group_of_fork.remove(&pid) {
        Some(name) => (name, false),
        None => (format!("w{pid}"), true),
    };
    let dir = groups.parent.join(&name);
    let kills = oom_kills(&dir);
    let seen = l.oom_kills.get(&name).copied().unwrap_or(0);
    let killed = kills.is_some_and(|k| k > seen);
    let peak = killed
        .then(|| read_u64(&dir.join("memory.max_usage_in_bytes")))
        .flatten();
    let killed = killed.then_some(peak.unwrap_or(0));
    let left = match l.members.get_mut(&name) {
        Some(m) => {
            *m = m.saturating_sub(1);
            *m
        }
        None => 0,
    };
    if left == 0 {
        l.members.remove(&name);
        l.oom_kills.remove(&name);
        if super::cgroup::remove_group_of_name(&groups.parent, &name) {
            return killed;
        }
        // Still holding tasks: a fork that has not said `ready` yet (it joins as the only
        // member: [`fork_joined`]), or children on their way out. Removed once empty.
        tracing::debug!(group = %dir.display(), "memory group not removed: it still has tasks");
        l.members.insert(name.clone(), 0);
        l.unjoined.insert(name.clone(), dir.clone());
    } else if let Err(e) = std::fs::write(
        dir.join("memory.limit_in_bytes"),
        groups.limit_bytes.saturating_mul(left).to_string(),
    ) {
        // EBUSY: the members left hold more than that right now; the group keeps its limit.
        tracing::debug!(group = %dir.display(), error = %e, "memory group limit not lowered");
    }
    if let Some(k) = kills {
        l.oom_kills.insert(name.clone(), k);
    }
    if first {
        rename_group_of_gone_first_worker(l, groups, pid, name);
    }
    killed
}

/// A first worker gone while its group still holds tasks leaves the group renamed (`l…`), so
/// that a new worker given its pid makes a group of its own and a fork joining later does not
/// count it ([`fork_joined`]). Its bookkeeping follows the new name.
fn rename_group_of_gone_first_worker(
    l: &mut Lineages,
    groups: &MemoryGroups,
    pid: i32,
    name: String,
) {
    l.renamed += 1;
    let new = format!("l{pid}.{}", l.renamed);
    let new_dir = groups.parent.join(&new);
    if let Err(e) = std::fs::rename(groups.parent.join(&name), &new_dir) {
        tracing::warn!(group = %name, error = %e, "memory group not renamed");
        return;
    }
    for g in l.group_of_fork.values_mut().filter(|g| **g == name) {
        *g = new.clone();
    }
    if let Some(m) = l.members.remove(&name) {
        l.members.insert(new.clone(), m);
    }
    if let Some(k) = l.oom_kills.remove(&name) {
        l.oom_kills.insert(new.clone(), k);
    }
    if l.unjoined.remove(&name).is_some() {
        l.unjoined.insert(new, new_dir);
    }
}

/// Removes the groups left with no member, once they are empty (a fork that never became a
/// session, killed before its `ready`, never joined its group), rather than at the next
/// zygote's start; a group a fork joined meanwhile goes with its members instead.
fn remove_groups_left_with_no_member(l: &mut Lineages) {
    let Lineages {
        members,
        unjoined,
        oom_kills,
        ..
    } = l;
    unjoined.retain(|name, dir| {
        if members.get(name).is_some_and(|m| *m > 0) {
            return false;
        }
        let gone = match std::fs::remove_dir(dir) {
            Ok(()) => true,
            Err(e) => e.kind() == io::ErrorKind::NotFound,
        };
        if gone {
            members.remove(name);
            oom_kills.remove(name);
        }
        !gone
    });
}

/// Removes the groups left by workers that are gone without a report (a zygote that died took
/// its workers along): `rmdir` on every `w<pid>` whose pid no longer exists and every renamed
/// lineage group; the kernel refuses those that still hold tasks.
pub fn remove_groups_of_gone_workers(parent: &Path) {
    super::cgroup::remove_groups_of_gone_workers(parent);
    let Ok(entries) = std::fs::read_dir(parent) else {
        return;
    };
    for entry in entries.flatten() {
        if entry
            .file_name()
            .to_str()
            .is_some_and(|n| n.starts_with('l'))
        {
            let _ = std::fs::remove_dir(entry.path());
        }
    }
}

/// The `oom_kill` count of a v1 memory group's `memory.oom_control`.
fn oom_kills(dir: &Path) -> Option<u64> {
    let text = std::fs::read_to_string(dir.join("memory.oom_control")).ok()?;
    oom_kill_field(&text)
}

fn oom_kill_field(text: &str) -> Option<u64> {
    field(text, "oom_kill")
}

/// The value of `name` in a `memory.oom_control` text (lines of "name value").
fn field(text: &str, name: &str) -> Option<u64> {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
        .and_then(|n| n.trim().parse().ok())
}

fn read_u64(path: &Path) -> Option<u64> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_oom_kill_count_is_read_from_oom_control() {
        let text = "oom_kill_disable 0\nunder_oom 0\noom_kill 3\n";
        assert_eq!(oom_kill_field(text), Some(3));
        assert_eq!(oom_kill_field("oom_kill_disable 0\n"), None);
        assert_eq!(field(text, "under_oom"), Some(0));
        assert_eq!(
            field("oom_kill_disable 1\nunder_oom 1\n", "under_oom"),
            Some(1)
        );
    }

    /// A test's groups beneath the server's parent, each session's room 64 MiB; `None` without
    /// a writable v1 memory hierarchy (not root).
    fn test_groups(tag: &str) -> Option<MemoryGroups> {
        let Some(parent) = memory_parent_for_workers() else {
            eprintln!("skipped: no writable v1 memory hierarchy");
            return None;
        };
        Some(MemoryGroups {
            parent: parent.join(format!("unit-{tag}-{}", std::process::id())),
            limit_bytes: 64 << 20,
        })
    }

    /// A first worker (a child that joins its group) and its fork (a grandchild, in the same
    /// group), both waiting to be killed; their pids and the group.
    fn first_worker_and_its_fork(groups: &MemoryGroups) -> (i32, i32, PathBuf) {
        // SAFETY: the child only joins the group, forks once and waits to be killed.
        let first = match unsafe { libc::fork() } {
            0 => {
                let code = if groups.join(std::process::id()).is_ok() {
                    0
                } else {
                    1
                };
                // SAFETY: as above.
                unsafe {
                    if libc::fork() == 0 {
                        libc::pause();
                    }
                    libc::pause();
                    libc::_exit(code)
                }
            }
            pid => pid,
        };
        let dir = groups.parent.join(format!("w{first}"));
        let procs = || std::fs::read_to_string(dir.join("cgroup.procs")).unwrap_or_default();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while procs().lines().count() < 2 && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        let fork: i32 = procs()
            .lines()
            .filter_map(|l| l.parse().ok())
            .find(|&p| p != first)
            .expect("the first worker's fork is in its group");
        (first, fork, dir)
    }

    fn kill_and_reap(pid: i32) {
        // SAFETY: signalling and reaping a process this test made.
        unsafe {
            libc::kill(pid, libc::SIGKILL);
            libc::waitpid(pid, std::ptr::null_mut(), 0)
        };
    }

    /// The group holding `pid`'s fork once `dir` was renamed, and waits for it to empty after
    /// the fork is killed (re-parented to init, not to this test: killed here, reaped there).
    fn renamed_group(groups: &MemoryGroups) -> PathBuf {
        std::fs::read_dir(&groups.parent)
            .unwrap()
            .flatten()
            .map(|e| e.path())
            .find(|p| p.join("cgroup.procs").exists())
            .expect("the lineage's group, renamed")
    }

    fn kill_fork_and_wait_until_empty(fork: i32, group: &Path) {
        // SAFETY: signalling a process this test made.
        unsafe { libc::kill(fork, libc::SIGKILL) };
        let held = || std::fs::read_to_string(group.join("cgroup.procs")).unwrap_or_default();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while !held().trim().is_empty() && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
    }

    /// SECURITY.md #294: the first worker reaped while its fork copies its files, before the
    /// fork is verified and joins: the fork is the group's one member, with one session's room
    /// (the group once kept two, and stayed after the fork, counting a member it no longer had).
    #[test]
    fn a_fork_joining_after_its_first_worker_was_reaped_gets_one_sessions_room() {
        let Some(groups) = test_groups("late") else {
            return;
        };
        let (first, fork, dir) = first_worker_and_its_fork(&groups);
        kill_and_reap(first);
        assert_eq!(worker_gone(&groups, first), None);
        assert!(
            !dir.exists(),
            "renamed: a new worker given its pid makes its own"
        );
        let renamed = renamed_group(&groups);
        fork_joined(&groups, fork).unwrap();
        assert_eq!(
            read_u64(&renamed.join("memory.limit_in_bytes")),
            Some(64 << 20)
        );
        kill_fork_and_wait_until_empty(fork, &renamed);
        assert_eq!(worker_gone(&groups, fork), None);
        assert!(!renamed.exists(), "removed with its only member");
        std::fs::remove_dir(&groups.parent).unwrap();
    }

    /// The same, with a fork that dies before it is verified (never joins): its group goes
    /// once it is empty, at the next worker reaped, not at the next zygote's start.
    #[test]
    fn a_group_left_by_a_fork_that_never_joined_is_removed_once_empty() {
        let Some(groups) = test_groups("never") else {
            return;
        };
        let (first, fork, _) = first_worker_and_its_fork(&groups);
        kill_and_reap(first);
        assert_eq!(worker_gone(&groups, first), None);
        let renamed = renamed_group(&groups);
        kill_fork_and_wait_until_empty(fork, &renamed);
        assert_eq!(worker_gone(&groups, fork), None);
        assert!(!renamed.exists(), "removed once empty");
        std::fs::remove_dir(&groups.parent).unwrap();
    }

    /// As root with a writable hierarchy: a group per worker, grown per fork, renamed when its
    /// first worker goes before its fork, removed with its last member.
    #[test]
    fn a_lineage_group_grows_with_forks_and_goes_with_its_last_member() {
        let Some(groups) = test_groups("grow") else {
            return;
        };
        let (first, fork, dir) = first_worker_and_its_fork(&groups);
        let control = std::fs::read_to_string(dir.join("memory.oom_control")).unwrap();
        assert_eq!(field(&control, "oom_kill_disable"), Some(1), "{control}");
        fork_joined(&groups, fork).unwrap();
        assert_eq!(
            read_u64(&dir.join("memory.limit_in_bytes")),
            Some(128 << 20)
        );
        kill_and_reap(first);
        assert_eq!(worker_gone(&groups, first), None);
        assert!(!dir.exists(), "renamed while its fork lives");
        let renamed = renamed_group(&groups);
        assert_eq!(
            read_u64(&renamed.join("memory.limit_in_bytes")),
            Some(64 << 20)
        );
        kill_fork_and_wait_until_empty(fork, &renamed);
        assert_eq!(worker_gone(&groups, fork), None);
        assert!(!renamed.exists(), "removed with its last member");
        std::fs::remove_dir(&groups.parent).unwrap();
    }
}
