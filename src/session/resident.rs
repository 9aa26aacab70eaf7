//! The memory watch: the memory limit enforced on what a worker holds, not only on what its
//! rlimits count.
//!
//! `RLIMIT_DATA` (the memory limit) counts private writable mappings that are not stacks. Memory
//! written and then made read-only with `mprotect`, or mapped `MAP_GROWSDOWN`, leaves that count
//! while it stays resident, so a worker could hold up to `RLIMIT_AS` (the limit plus 2 GiB of
//! headroom) that way (SECURITY.md #130). So every live worker's anonymous memory and page
//! tables (`RssAnon` + `VmSwap` + `VmPTE` from `/proc/<pid>/status`, readable for a
//! non-dumpable process too) are read, and a worker holding more than the limit, plus
//! [`SLACK_BYTES`], plus the zygote's own such memory (which a fresh worker shares and counts
//! as its own), is killed; its exit report says
//! why, in the run it ended or in the next run's notice.
//!
//! Memory only grows through the worker's own page faults and system calls, which cost it CPU
//! time: a worker whose process CPU clock has not moved since its last reading is not read
//! again, except once every [`RESYNC_EVERY`]. The readings run on a blocking thread (a worker
//! holding its own `mmap_lock` must not stall the async runtime).

use super::*;
use crate::sandbox::memcg;
use crate::zygote::WorkerProcess;
use quota::WorkerMark;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::Path;
use std::sync::LazyLock;

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

/// Memory process `pid` holds that the watch counts (anonymous, resident and swapped out, and
/// its page tables), in bytes; `None` if no thread of it has a memory map any more (it is gone,
/// or a zombie waiting to be reaped).
///
/// A process whose main thread ended while others live (the raw `exit` system call ends one
/// thread) shows no memory counters in `/proc/<pid>/status`: the leader has let go of the
/// memory map its threads still share. So the counters are read from the first of its threads
/// that shows them (SECURITY.md #133: a worker whose main thread exited held 1.2 GB under a
/// 256 MiB limit, unseen). The tasks are listed only then. The files are read as bytes: their
/// first line is the thread's name, which the worker sets (`PR_SET_NAME`) and the kernel
/// passes on unescaped, so it need not be UTF-8 (#134).
fn anonymous_bytes(pid: i32) -> Option<u64> {
    held_by(pid).map(|(bytes, _)| bytes)
}

/// [`anonymous_bytes`] and the number of threads of process `pid` (its `Threads` line, 0 when
/// the status shows none).
fn held_by(pid: i32) -> Option<(u64, u64)> {
    let status = std::fs::read(format!("/proc/{pid}/status")).ok()?;
    let threads = threads_in(&status).unwrap_or(0);
    if let Some(bytes) = anonymous_bytes_in(&status) {
        return Some((bytes, threads));
    }
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .ok()?
        .filter_map(Result::ok)
        .find_map(|task| {
            let status = std::fs::read(task.path().join("status")).ok()?;
            anonymous_bytes_in(&status)
        })
        .map(|bytes| (bytes, threads))
}

/// The most processes [`descendants`] lists: a session's task cap is far below it.
const MAX_DESCENDANTS: usize = 4096;

/// Every process of worker `worker`'s session but the worker: its descendants, and the orphans
/// the zygote adopted (a grandchild whose parent ended) that are still in the worker's process
/// group, with theirs (SECURITY.md #159). Read by the host only: the pids and groups are the
/// kernel's, never the worker's word.
pub(crate) fn session_children(worker: i32, zygote: i32) -> Vec<i32> {
    session_children_among(worker, &zygote_children(zygote))
}

/// The zygote's children (its workers and the orphans it adopted) with their process groups.
/// The memory watch lists them once per look, not once per worker: with 60 idle sessions the
/// per-worker listing read ~3,600 `/proc/<pid>/stat` files every 100 ms, ~0.4 s of the host's
/// CPU per second, taken from the calls of the moment on a 2-CPU machine.
fn zygote_children(zygote: i32) -> Vec<(i32, Option<i32>)> {
    descendants_to_depth(zygote, 1)
        .into_iter()
        .map(|child| (child, group_of(child)))
        .collect()
}

/// [`session_children`], given the zygote's children and their groups ([`zygote_children`]).
fn session_children_among(worker: i32, zygote_children: &[(i32, Option<i32>)]) -> Vec<i32> {
    let mut found = descendants(worker);
    for &(orphan, group) in zygote_children {
        if orphan != worker && found.len() < MAX_DESCENDANTS && group == Some(worker) {
            found.push(orphan);
            found.extend(descendants(orphan));
        }
    }
    found.truncate(MAX_DESCENDANTS);
    found
}

/// The fields of `/proc/<pid>/stat` after the command name (which the process chooses, so they
/// are read after its last `)`): state, parent, process group, session.
pub(super) fn stat_fields(pid: i32) -> Option<Vec<String>> {
    stat_fields_at(Path::new(&format!("/proc/{pid}/stat")))
}

/// [`stat_fields`] of a `stat` file (a process's, or one thread's under `task/`).
fn stat_fields_at(path: &Path) -> Option<Vec<String>> {
    let stat = std::fs::read(path).ok()?;
    let end = stat.iter().rposition(|&b| b == b')')?;
    let rest = std::str::from_utf8(&stat[end + 1..]).ok()?;
    Some(
        rest.split_ascii_whitespace()
            .take(4)
            .map(str::to_string)
            .collect(),
    )
}

/// The process group of `pid`.
fn group_of(pid: i32) -> Option<i32> {
    stat_fields(pid)?.get(2)?.parse().ok()
}

/// The state letter of `pid` (`Z` for a zombie).
fn state_of(pid: i32) -> Option<char> {
    stat_fields(pid)?.first()?.chars().next()
}

/// Whether process `pid` has ended: it is gone, or a zombie waiting to be reaped. Its `stat`
/// shows its main thread's state, and a process whose main thread ended (the raw `exit` call
/// ends one thread) while others run shows `Z` as well, and runs on: it has ended only when no
/// thread of it shows another state (SECURITY.md #299: such a child of a session kept the
/// parent's pre-fork domain beside a fork, escaped the kill of a run's children and the sweep
/// of orphans, and outlived the server).
pub(crate) fn has_ended(pid: i32) -> bool {
    match state_of(pid) {
        None => true,
        Some('Z' | 'X') => !a_thread_runs(pid),
        Some(_) => false,
    }
}

/// Whether a thread of process `pid` is neither a zombie nor dead (`/proc/<pid>/task/*/stat`,
/// read past each thread's name, which the process chooses).
fn a_thread_runs(pid: i32) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return false;
    };
    tasks
        .filter_map(Result::ok)
        .take(MAX_DESCENDANTS)
        .any(|task| {
            stat_fields_at(&task.path().join("stat"))
                .and_then(|f| f.first()?.chars().next())
                .is_some_and(|s| s != 'Z' && s != 'X')
        })
}

/// Every live descendant of process `pid` (its children, theirs, ...), found through each
/// task's `/proc/<pid>/task/<tid>/children`.
pub(crate) fn descendants(pid: i32) -> Vec<i32> {
    descendants_to_depth(pid, usize::MAX)
}

pub(super) fn descendants_to_depth(pid: i32, depth: usize) -> Vec<i32> {
    let mut found = Vec::new();
    let mut queue = vec![(pid, 0)];
    while let Some((p, level)) = queue.pop() {
        if level >= depth {
            continue;
        }
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{p}/task")) else {
            continue;
        };
        for task in tasks.filter_map(Result::ok) {
            let Ok(text) = std::fs::read_to_string(task.path().join("children")) else {
                continue;
            };
            for child in text.split_ascii_whitespace().filter_map(|c| c.parse().ok()) {
                if found.len() >= MAX_DESCENDANTS {
                    return found;
                }
                found.push(child);
                queue.push((child, level + 1));
            }
        }
    }
    found
}

/// SIGKILLs every process of worker `pid`'s session but the worker ([`session_children`]): a
/// timed-out, cancelled or over-output run's children die with the run (SECURITY.md #159).
/// Rounds until none is left (a child forking while it is killed; the task cap bounds them).
/// On a blocking thread; the run awaits it before it ends, so no round of it reaches the
/// children of the session's next run.
pub(crate) fn kill_children_of(pid: i32, zygote: i32) -> tokio::task::JoinHandle<()> {
    tokio::task::spawn_blocking(move || {
        for _ in 0..64 {
            // A killed child stays a zombie until its parent reaps it: not one to wait for.
            let children: Vec<i32> = session_children(pid, zygote)
                .into_iter()
                .filter(|&c| !has_ended(c))
                .collect();
            if children.is_empty() {
                return;
            }
            for child in children {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(child),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    })
}

/// The zygote's children that are not live workers (orphans it adopted, a fork under way, a
/// worker before the host knew it), with their process groups; SIGKILLs on the way those that
/// belong to no live worker: a session's child that left its worker's process group
/// (`setpgid(0, 0)`, which forked sessions need: SECURITY.md #194) and was orphaned is adopted
/// by the zygote outside every worker's group, where nothing would count or end it. Spared: the
/// orphans of a live worker's group (counted as its), the zygote's own children before they
/// made their session (its session) or right after (a session leader, not yet reported), and a
/// fork under way (`fork::FORKING`).
///
/// The live workers themselves are not read: each leads its own group (a spawned worker calls
/// `setsid`, a fork `setpgid(0, 0)` before it is adopted; a worker the host just learned of may
/// still be in the zygote's), so none is in another's group, and each is watched as a worker.
/// With 100 idle sessions, reading every child's `stat` here and again for the counting cost
/// the host ~2% of a CPU.
fn sweep_zygote_children(zygote: &crate::zygote::Zygote) -> Vec<(i32, Option<i32>)> {
    // Forks under way first, then the live workers: a fork is listed live before it leaves
    // `FORKING`, so it is always in one of the two.
    let forking = lock(&super::fork::FORKING).clone();
    let live: Vec<i32> = zygote
        .live_workers()
        .iter()
        .map(WorkerProcess::pid)
        .collect();
    let zygote = zygote.pid();
    let zygote_session = stat_fields(zygote).and_then(|f| f.get(3)?.parse::<i32>().ok());
    let mut others = Vec::new();
    for child in descendants_to_depth(zygote, 1) {
        if live.contains(&child) {
            continue;
        }
        let Some(fields) = stat_fields(child) else {
            continue;
        };
        let field = |i: usize| fields.get(i).and_then(|f| f.parse::<i32>().ok());
        let (group, session) = (field(2), field(3));
        others.push((child, group));
        let spared = group.is_some_and(|g| live.contains(&g))
            || session.is_none()
            || session == zygote_session
            || session == Some(child)
            || session.is_some_and(|s| forking.contains(&s))
            || (fields.first().is_some_and(|s| s == "Z") && has_ended(child));
        if !spared {
            tracing::warn!(
                pid = child,
                "killing a session's process that left its worker's group"
            );
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(child),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
    }
    others
}

/// Workers found without a process of their session at their last walk, with their CPU clock
/// then (taken before the walk), by pid: a worker makes a process only by running (its process
/// CPU clock moves), and no other process can join its group, so while its clock stands still
/// it has none but the orphans of its group the zygote lists, and its children are not walked
/// again. A walk reads `/proc/<pid>/task/*/children` of each of its threads: every 100 ms for
/// every idle session, it was ~5% of a CPU with 100 sessions, taken from the calls of the
/// moment.
static CHILDLESS: LazyLock<Mutex<HashMap<i32, (WorkerProcess, WorkerMark)>>> =
    LazyLock::new(Default::default);

/// Whether `worker`, as `now` reads it, has not run since a walk found it without children.
fn still_childless(worker: &WorkerProcess, now: Option<&WorkerMark>) -> bool {
    let Some(now) = now else { return false };
    lock(&CHILDLESS)
        .get(&worker.pid())
        .is_some_and(|(w, then)| w.is(worker) && now.unchanged_since(then))
}

/// Each worker's own `/proc/<pid>/smaps_rollup`, opened by the worker before its lockdown and
/// handed over during its setup ([`keep_memory_counters`]), by pid; kept while it lives.
static COUNTERS: LazyLock<Mutex<HashMap<i32, Arc<std::fs::File>>>> =
    LazyLock::new(Default::default);

/// Keeps the memory counters worker `pid` sent during its setup (SECURITY.md #241): a
/// non-dumpable process's `smaps_rollup` can be opened only by itself or with
/// `CAP_SYS_PTRACE`, which a host running as a user lacks, but a descriptor opened by the
/// process reads it for anyone holding it. Accepted only if the kernel names it
/// `/proc/<pid>/smaps_rollup` of that very worker on a proc filesystem: the worker cannot pass
/// another process's counters for its own. Anything else is dropped, and the worker is read by
/// its `status` as before.
pub(super) fn keep_memory_counters(pid: i32, fds: Vec<OwnedFd>) {
    let Some(fd) = fds.into_iter().next() else {
        tracing::warn!(
            pid,
            "a worker's memory counters came without their descriptor"
        );
        return;
    };
    let on_proc = nix::sys::statfs::fstatfs(&fd)
        .is_ok_and(|s| s.filesystem_type() == nix::sys::statfs::PROC_SUPER_MAGIC);
    let named = std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd()))
        .is_ok_and(|p| p == Path::new(&format!("/proc/{pid}/smaps_rollup")));
    if !(on_proc && named) {
        tracing::warn!(
            pid,
            "a worker's memory counters are not its smaps_rollup: not used"
        );
        return;
    }
    lock(&COUNTERS).insert(pid, Arc::new(std::fs::File::from(fd)));
}

/// The `smaps_rollup` text of `pid`: by path, or where that is refused (a non-dumpable worker,
/// read by a host running as a user) through the descriptor it handed over.
fn rollup_of(pid: i32) -> Option<Vec<u8>> {
    if let Ok(text) = std::fs::read(format!("/proc/{pid}/smaps_rollup")) {
        return Some(text);
    }
    let file = lock(&COUNTERS).get(&pid).cloned()?;
    read_from_start(&file)
}

/// The whole text of a `/proc` file, read from offset 0 (the kernel makes it anew each time).
fn read_from_start(file: &std::fs::File) -> Option<Vec<u8>> {
    use std::os::unix::fs::FileExt;
    let mut text = vec![0; 4096];
    let mut filled = 0;
    loop {
        if filled == text.len() {
            text.resize(filled * 2, 0);
        }
        match file.read_at(&mut text[filled..], filled as u64) {
            Ok(0) => break,
            Ok(n) => filled += n,
            Err(_) => return None,
        }
    }
    text.truncate(filled);
    Some(text)
}

/// What a worker's child holds, in bytes: its proportional share of anonymous memory, resident
/// and swapped (`Pss_Anon` + `SwapPss` of `/proc/<pid>/smaps_rollup`, so pages it shares with
/// its siblings count once among them), and its page tables. Readable for a dumpable process
/// (a worker's children and forks make themselves so), and for a worker through the
/// descriptor it handed over ([`rollup_of`]). Where neither works, the full `RssAnon` counts.
///
/// A child whose main thread ended while its other threads live shows no counters in its own
/// `status`, nor a `smaps_rollup` (the leader let go of the memory map): it counts whole, read
/// through the first of its threads that shows them, as a worker is ([`held_by`]; SECURITY.md
/// #298: four such children held 758 MiB under a 256 MiB limit, unseen).
fn child_holds(pid: i32) -> Option<(u64, u64)> {
    let status = std::fs::read(format!("/proc/{pid}/status")).ok()?;
    let threads = threads_in(&status).unwrap_or(0);
    let Some(full) = anonymous_bytes_in(&status) else {
        return held_by(pid);
    };
    let Some(rollup) = rollup_of(pid) else {
        return Some((full, threads));
    };
    let field = crate::sandbox::rlimits::status_kib;
    let Some(pss) = field(&rollup, b"Pss_Anon") else {
        return Some((full, threads));
    };
    let swap = field(&rollup, b"SwapPss").unwrap_or(0);
    let tables = field(&status, b"VmPTE").unwrap_or(0);
    Some(((pss + swap + tables) << 10, threads))
}

/// What worker `pid` and its descendants hold together: the worker's [`held_by`], or its
/// [`child_holds`] where it shares pages copy-on-write (a forked session's worker, with the
/// session it was forked from, SECURITY.md #197; a worker with children, with them: a fork's
/// middle process is a whole copy of it, and a worker holding most of its limit was killed
/// while it forked, #197), plus each child's [`child_holds`], and their threads.
///
/// Where it shares, and `allowed` is given, [`group_bound`] comes first: when that upper bound
/// is within `allowed`, so is what the shares add up to, and it is returned instead (the
/// verdict is the same; the value is then no more than a bound). Its proportional shares are
/// read only when it could be past `allowed` (SECURITY.md #290).
fn group_holds(
    pid: i32,
    forked: bool,
    children: &[i32],
    allowed: Option<u64>,
) -> Option<(u64, u64)> {
    let shares = forked || !children.is_empty();
    if shares
        && let Some(allowed) = allowed
        && let Some((bound, threads)) = group_bound(pid, children)
        && within(bound, children.len() + 1, allowed)
    {
        return Some((bound, threads));
    }
    let own = if shares {
        child_holds(pid).or_else(|| held_by(pid))
    } else {
        held_by(pid)
    };
    let (mut bytes, mut threads) = own?;
    let mut middle_discount = if is_forking(pid) { bytes } else { 0 };
    for &child in children {
        if runs_in_the_memory_of(pid, child) {
            continue; // counted with the worker's own
        }
        if let Some((mut b, t)) = child_holds(child) {
            // Where `kcmp` cannot tell (a user's host, non-dumpable workers), a fork's middle
            // process shows the worker's own memory: one direct child, while the worker forks,
            // is counted less the worker's own bytes (SECURITY.md #261).
            if middle_discount > 0 && parent_of(child) == Some(pid) {
                let off = b.min(middle_discount);
                b -= off;
                middle_discount = 0;
            }
            bytes = bytes.saturating_add(b);
            threads = threads.saturating_add(t);
        }
    }
    Some((bytes, threads))
}

/// The workers the host has asked to fork and whose answer it awaits ([`Forking`]).
static FORKING: Mutex<Vec<i32>> = Mutex::new(Vec::new());

/// While held, worker `pid` is forking: its `vfork` middle process may live (SECURITY.md #261).
pub(super) struct Forking(i32);

impl Forking {
    pub(super) fn start(pid: i32) -> Forking {
        lock(&FORKING).push(pid);
        Forking(pid)
    }
}

impl Drop for Forking {
    fn drop(&mut self) {
        let mut forking = lock(&FORKING);
        if let Some(i) = forking.iter().position(|&p| p == self.0) {
            forking.swap_remove(i);
        }
    }
}

fn is_forking(pid: i32) -> bool {
    lock(&FORKING).contains(&pid)
}

/// The parent pid of process `pid` (`/proc/<pid>/stat` field 4, after the command's `)`).
fn parent_of(pid: i32) -> Option<i32> {
    let stat = std::fs::read(format!("/proc/{pid}/stat")).ok()?;
    let at = stat.iter().rposition(|&b| b == b')')?;
    let rest = std::str::from_utf8(&stat[at + 1..]).ok()?;
    rest.split_whitespace().nth(1)?.parse().ok()
}

/// What a forked worker's memory limits were last fitted to: the bytes it shares
/// ([`fit_fork_memory_limits`]), and its minor page faults then.
#[derive(Clone, Copy)]
struct Fit {
    shared: u64,
    faults: u64,
}

/// Each forked worker's last [`Fit`], by pid.
static FITTED: LazyLock<Mutex<HashMap<i32, Fit>>> = LazyLock::new(Default::default);

/// Page faults (4 KiB each: a copy-on-write fault copies 4 KiB even of a huge page, and where
/// huge pages are on, in a memory group, the kernel charges them whole) after which a fork's
/// limits are fitted again before its next cell: its sharing changes only by rewriting or
/// touching pages, each a fault, so fewer than 16 MiB of them since the last fit moved it by
/// less than the memory watch's slack, and the ~20 ms per GiB of `smaps_rollup` is spared.
const REFIT_AFTER_FAULTS: u64 = (16 << 20) / 4096;

/// Fits the memory limits of the fork `pid` (ready and verified) to what it shares with its
/// parent. Its soft RLIMIT_DATA and RLIMIT_AS are its parent's and count every page it maps, so
/// a fork of a session holding 400 of 500 MiB had ~100 MiB of its own, while this watch counts
/// it by its share (SECURITY.md #239). Here, at its `ready`, the part not charged to it is taken
/// as half its resident anonymous memory (read from `status`, cheap: a fork shares all of it
/// with its parent at least, so at most half is charged to it; `smaps_rollup` costs ~20 ms per
/// GiB, which the fork's first result does not wait for); before a later cell it is read
/// exactly if the fork faulted in pages since ([`fit_fork_memory_before_cell`]).
pub(super) async fn fit_fork_memory_at_ready(pid: i32, sandbox: &crate::sandbox::Sandbox) {
    let read = move || {
        let status = std::fs::read(format!("/proc/{pid}/status")).ok()?;
        Some((crate::sandbox::rlimits::status_kib(&status, b"RssAnon")? << 10) / 2)
    };
    fit_fork_memory(pid, sandbox, read).await;
}

/// Fits the memory limits of the forked worker `pid` to what it shares now, before a cell: a
/// cell that rewrote the pages it inherited made them its own, and its next one may not take
/// that room again. Only once it faulted in [`REFIT_AFTER_FAULTS`] pages since the last fit
/// (`/proc/<pid>/stat`, cheap), and while it shares anything (sharing grows only with forks of
/// its own, which only tightens its limits).
pub(super) async fn fit_fork_memory_before_cell(pid: i32, sandbox: &crate::sandbox::Sandbox) {
    let Some(last) = lock(&FITTED).get(&pid).copied() else {
        return;
    };
    let faulted = minor_faults(pid).map(|now| now.saturating_sub(last.faults));
    if last.shared == 0 || faulted.is_some_and(|f| f < REFIT_AFTER_FAULTS) {
        return;
    }
    fit_fork_memory(pid, sandbox, move || shared_bytes(pid)).await;
}

/// Reads what `pid` shares with `read` (on a blocking thread) and fits its limits to it.
async fn fit_fork_memory(
    pid: i32,
    sandbox: &crate::sandbox::Sandbox,
    read: impl FnOnce() -> Option<u64> + Send + 'static,
) {
    let (memory, address_space) = (sandbox.memory_bytes, sandbox.address_space_bytes());
    let fitted = tokio::task::spawn_blocking(move || {
        // Faults counted first: any the reading misses are counted again next time.
        let faults = minor_faults(pid).unwrap_or(0);
        let shared = read().ok_or("its memory counters cannot be read (it is gone)")?;
        crate::sandbox::rlimits::fit_fork_memory_limits(pid, memory, address_space, shared)
            .map(|f| (Fit { shared, faults }, f))
            .map_err(|e| e.to_string())
    })
    .await
    .unwrap_or_else(|e| Err(e.to_string()));
    match fitted {
        Ok((fit, f)) => {
            lock(&FITTED).insert(pid, fit);
            tracing::debug!(
                pid,
                shared_mib = fit.shared >> 20,
                data_mib = f.data_bytes >> 20,
                address_space_mib = f.address_space_bytes >> 20,
                "a fork's memory limits, fitted to what it shares"
            );
        }
        Err(error) => tracing::warn!(pid, %error, "a fork's memory limits stay as they were"),
    }
}

/// An upper bound of [`group_holds`] from the processes' `status` alone: each one's whole
/// anonymous memory, swap and page tables, however many processes share its pages, and the
/// same threads. Reading a `status` costs the same whatever the process holds; the
/// proportional shares of `smaps_rollup` ([`child_holds`]) walk every page a process maps, and
/// a page shared by several processes one 4 KiB at a time even where a 2 MiB page maps it: ~1.5
/// ms of the host's CPU for a fork of a session holding 12 M ints, each time the watch reads it.
fn group_bound(pid: i32, children: &[i32]) -> Option<(u64, u64)> {
    let (mut bytes, mut threads) = held_by(pid)?;
    for &child in children {
        if runs_in_the_memory_of(pid, child) {
            continue;
        }
        // Counted where [`child_holds`] counts it: a process that shows its counters, in its
        // own `status` or in a thread's (its main thread ended: #298).
        if let Some((b, t)) = held_by(child) {
            bytes = bytes.saturating_add(b);
            threads = threads.saturating_add(t);
        }
    }
    Some((bytes, threads))
}

/// Whether `bound`, the `status` counters of `processes` processes added up, shows their
/// memory within `allowed` for certain. The kernel keeps those counters per CPU and may show
/// them short by up to one batch per CPU each (`percpu_counter_batch`, max(32, 2 x CPUs) pages)
/// where `smaps_rollup` counts page by page: that much is added for each of the two counters
/// (`RssAnon`, `VmSwap`) of each process.
fn within(bound: u64, processes: usize, allowed: u64) -> bool {
    // SAFETY: sysconf(3) with a valid name; no pointers.
    let cpus = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_CONF) }.max(1) as u64;
    let lag = 32u64.max(2 * cpus) * cpus * 4096 * 2;
    bound.saturating_add(lag.saturating_mul(processes as u64)) <= allowed
}

/// The minor page faults of process `pid` (its threads' together: `minflt`, the tenth field
/// of `/proc/<pid>/stat`, the eighth after the command name).
fn minor_faults(pid: i32) -> Option<u64> {
    let stat = std::fs::read(format!("/proc/{pid}/stat")).ok()?;
    let end = stat.iter().rposition(|&b| b == b')')?;
    std::str::from_utf8(&stat[end + 1..])
        .ok()?
        .split_ascii_whitespace()
        .nth(7)?
        .parse()
        .ok()
}

/// The part of the anonymous memory `pid` maps that is not charged to it because other
/// processes map it too: resident (`Anonymous` - `Pss_Anon`) and swapped (`Swap` - `SwapPss`)
/// of its `smaps_rollup`, readable for a dumpable process (a fork is, #197).
fn shared_bytes(pid: i32) -> Option<u64> {
    let rollup = std::fs::read(format!("/proc/{pid}/smaps_rollup")).ok()?;
    let kib = |name: &[u8]| crate::sandbox::rlimits::status_kib(&rollup, name);
    let resident = kib(b"Anonymous")?.saturating_sub(kib(b"Pss_Anon")?);
    let swapped = kib(b"Swap")
        .unwrap_or(0)
        .saturating_sub(kib(b"SwapPss").unwrap_or(0));
    Some((resident + swapped) << 10)
}

/// Whether process `child` runs in process `pid`'s memory (a `vfork` child: a fork's middle
/// process, SECURITY.md #233), by `kcmp(KCMP_VM)`: its `smaps_rollup` is the worker's own, which
/// would count twice (a parent holding 400 of 500 MiB was killed mid-fork). Where the kernel
/// does not say (no `kcmp`, or a worker the host may not inspect), it counts as any child.
fn runs_in_the_memory_of(pid: i32, child: i32) -> bool {
    const KCMP_VM: libc::c_long = 1;
    // SAFETY: kcmp(2) with integer arguments only.
    unsafe { libc::syscall(libc::SYS_kcmp, pid, child, KCMP_VM, 0, 0) == 0 }
}

/// The `Threads:` count of a `/proc/<pid>/status` text.
fn threads_in(status: &[u8]) -> Option<u64> {
    status.split(|&b| b == b'\n').find_map(|line| {
        let rest = line.strip_prefix(b"Threads:")?;
        std::str::from_utf8(rest).ok()?.trim().parse().ok()
    })
}

/// `RssAnon` + `VmSwap` + `VmPTE` of a `/proc/<pid>/status` text (each in kB; a kernel thread
/// or a zombie has none). Page tables count because a worker can make them without an rlimit
/// counting them: 4 KiB mappings 1 GiB apart need a page-table page each (#128: ~0.5 GB per
/// session); an honest worker's are a few MiB.
fn anonymous_bytes_in(status: &[u8]) -> Option<u64> {
    let field = |name: &[u8]| crate::sandbox::rlimits::status_kib(status, name);
    let resident = field(b"RssAnon")?;
    let extra = field(b"VmSwap").unwrap_or(0) + field(b"VmPTE").unwrap_or(0);
    Some((resident + extra) << 10)
}

/// The most anonymous memory a worker may hold, given the zygote's own.
fn allowed_bytes(limit: u64, zygote_anonymous: u64) -> u64 {
    limit
        .saturating_add(SLACK_BYTES)
        .saturating_add(zygote_anonymous)
}

/// One live worker in one look of the memory watch.
struct Look {
    worker: WorkerProcess,
    /// Its own memory is due a reading (its clock moved, or a resync is due).
    due: bool,
    /// Its session's processes are to be listed (see [`CHILDLESS`]).
    walk: bool,
    /// Its CPU clock, read before anything else of it this look.
    mark: Option<WorkerMark>,
}

/// What one worker and its session's processes hold, as one look read it.
struct Held {
    worker: WorkerProcess,
    bytes: u64,
    threads: u64,
    /// Its memory group waits at its limit: the index of that group in the look's list.
    at_limit: Option<usize>,
}

/// The blocking part of one look: sweeps the zygote's children (where workers may have
/// children), reads the zygote's own anonymous memory and what each worker whose [`Look`] says
/// so holds with its session's processes; notes the workers found without any in [`CHILDLESS`].
/// Every worker whose memory group waits at its limit is read, whatever its clock says: its
/// tasks sleep there until the watch ends one ([`memcg::groups_at_limit`]).
fn read_workers(
    zygote: &crate::zygote::Zygote,
    looks: Vec<Look>,
    (children_possible, limit): (bool, u64),
    memory_groups: Option<&std::path::Path>,
) -> (u64, Vec<Held>, Vec<memcg::AtLimit>) {
    let others = if children_possible {
        sweep_zygote_children(zygote)
    } else {
        Vec::new()
    };
    let at_limit = memory_groups
        .map(memcg::groups_at_limit)
        .unwrap_or_default();
    let base = anonymous_bytes(zygote.pid()).unwrap_or(0);
    let allowed = allowed_bytes(limit, base);
    let mut childless = Vec::new();
    let held = looks
        .into_iter()
        .filter_map(|look| {
            let pid = look.worker.pid();
            let group = at_limit.iter().position(|g| g.pids.contains(&pid));
            // An orphan in its group (its child's child, whose parent ended) is found without
            // the worker running: it is walked then whatever its clock says.
            let orphaned = others.iter().any(|&(_, group)| group == Some(pid));
            let walk = look.walk || orphaned || group.is_some();
            let children = if walk {
                session_children_among(pid, &others)
            } else {
                Vec::new()
            };
            if walk {
                let mark = look.mark.filter(|_| children.is_empty());
                childless.push((look.worker.clone(), mark));
            }
            if !look.due && children.is_empty() && group.is_none() {
                return None;
            }
            // A group at its limit ends its member that holds the most: those are compared
            // by their shares ([`ends_at_group_limit`]).
            let allowed = Some(allowed).filter(|_| group.is_none());
            let (bytes, threads) = group_holds(pid, look.worker.is_forked(), &children, allowed)?;
            Some(Held {
                worker: look.worker,
                bytes,
                threads,
                at_limit: group,
            })
        })
        .collect();
    let mut known = lock(&CHILDLESS);
    for (worker, mark) in childless {
        match mark {
            Some(mark) => known.insert(worker.pid(), (worker, mark)),
            None => known.remove(&worker.pid()),
        };
    }
    (base, held, at_limit)
}

/// The workers to end because their memory group waits at its limit: in each such group, the
/// one whose session's processes hold the most, unless one of them is past its own limit
/// (the watch ends those anyway). Each with the group's usage.
fn ends_at_group_limit(
    held: &[Held],
    at_limit: &[memcg::AtLimit],
    allowed: u64,
) -> Vec<(usize, u64)> {
    (0..at_limit.len())
        .filter_map(|g| {
            let members = || {
                held.iter()
                    .enumerate()
                    .filter(move |(_, h)| h.at_limit == Some(g))
            };
            if members().any(|(_, h)| h.bytes > allowed) {
                return None;
            }
            let (i, _) = members().max_by_key(|(_, h)| h.bytes)?;
            Some((i, at_limit[g].usage_bytes))
        })
        .collect()
}

impl SessionManager {
    /// [`kill_children_of`] the worker `pid` of this manager's zygote: done when the returned
    /// task is.
    pub(super) fn kill_children_of(&self, pid: i32) -> Option<tokio::task::JoinHandle<()>> {
        let zygote = lock(&self.zygote).as_ref()?.pid();
        Some(kill_children_of(pid, zygote))
    }

    /// One look: reads every live worker that is due (see the module's doc) and kills those
    /// past the limit.
    ///
    /// Long on purpose: one tick in order (which workers are due, their reading on a blocking
    /// thread, then the verdicts); the due list and the marks are state the steps share.
    pub(super) async fn watch_memory(&self) {
        let Some(zygote) = lock(&self.zygote).clone() else {
            return;
        };
        let live = zygote.live_workers();
        // Workers have children only where the sandbox lets them fork: elsewhere no walk (a
        // thread storm's thousands of tasks would each be read every tick).
        let tmp =
            crate::sandbox::private_tmp::host_status(self.settings.private_tmp, self.state_dir());
        let children_possible = self.sandbox.children(&tmp).is_ok();
        let looks: Vec<Look> = {
            let mut marks = lock(&self.memory_marks);
            marks.retain(|pid, _| live.iter().any(|w| w.pid() == *pid));
            {
                // A list taken under the locks: a worker is listed before its counters or its
                // fitted limits can be kept.
                let (mut counters, mut fitted) = (lock(&COUNTERS), lock(&FITTED));
                let now = zygote.live_workers();
                counters.retain(|pid, _| now.iter().any(|w| w.pid() == *pid));
                fitted.retain(|pid, _| now.iter().any(|w| w.pid() == *pid && w.is_forked()));
                lock(&CHILDLESS).retain(|_, (w, _)| now.iter().any(|n| n.is(w)));
            }
            live.into_iter()
                .map(|worker| {
                    let pid = worker.pid();
                    // A clock that cannot be read is no reason to skip a live worker.
                    let now = WorkerMark::now(pid);
                    let due = match &now {
                        None => {
                            marks.remove(&pid);
                            true
                        }
                        Some(now) => marks.get(&pid).is_none_or(|last| {
                            !now.unchanged_since(last) || last.at.elapsed() >= RESYNC_EVERY
                        }),
                    };
                    if let (true, Some(now)) = (due, now) {
                        marks.insert(pid, now);
                    }
                    // A worker with children is read every tick: their work does not move its
                    // clock. Which ones have any is found on the blocking thread.
                    Look {
                        walk: children_possible && !still_childless(&worker, now.as_ref()),
                        worker,
                        due,
                        mark: now,
                    }
                })
                .collect()
        };
        // Workers join memory groups only where they may have children.
        let memory_groups = (self.sandbox.memory_groups())
            .filter(|_| children_possible)
            .map(|g| g.parent);
        if !children_possible && looks.iter().all(|l| !l.due) {
            return;
        }
        let sweep = zygote.clone();
        let limit = self.sandbox.memory_bytes;
        let read = tokio::task::spawn_blocking(move || {
            read_workers(
                &sweep,
                looks,
                (children_possible, limit),
                memory_groups.as_deref(),
            )
        })
        .await;
        let Ok((base, held, at_limit)) = read else {
            return;
        };
        let allowed = allowed_bytes(limit, base);
        for (i, usage) in ends_at_group_limit(&held, &at_limit, allowed) {
            let why = ExitInfo::OverMemory {
                held_mib: usage >> 20,
                limit_mib: limit >> 20,
            };
            if zygote.kill_for_memory(&held[i].worker, why) {
                tracing::warn!(
                    pid = held[i].worker.pid(),
                    group_mib = usage >> 20,
                    "killed a worker whose memory group reached its limit"
                );
            }
        }
        // A worker's own tasks: its main thread plus the policy's threads, as RLIMIT_NPROC in a
        // user namespace of its own counts them. Only where the uid's count is shared can a
        // worker get past it; here it is killed (SECURITY.md #153).
        let max_threads = self.sandbox.policy.limits.threads.saturating_add(1);
        for Held {
            worker,
            bytes,
            threads,
            ..
        } in held
        {
            if threads > max_threads {
                let why = ExitInfo::OverThreads {
                    threads,
                    limit: max_threads - 1,
                };
                if zygote.kill_for_memory(&worker, why) {
                    tracing::warn!(
                        pid = worker.pid(),
                        threads,
                        "killed a worker running more threads than its session may"
                    );
                }
                continue;
            }
            if bytes <= allowed {
                continue;
            }
            let why = ExitInfo::OverMemory {
                held_mib: bytes >> 20,
                limit_mib: limit >> 20,
            };
            if zygote.kill_for_memory(&worker, why) {
                tracing::warn!(
                    pid = worker.pid(),
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
    fn a_forking_worker_is_known_until_its_answer_and_its_parent_is_read_from_stat() {
        assert_eq!(
            parent_of(std::process::id() as i32),
            Some(nix::unistd::getppid().as_raw())
        );
        let pid = i32::MAX - 7;
        assert!(!is_forking(pid));
        let forking = Forking::start(pid);
        assert!(is_forking(pid));
        drop(forking);
        assert!(!is_forking(pid));
    }

    #[test]
    fn the_watch_counts_anonymous_memory_swap_and_page_tables() {
        let status = b"Name:\tpy\xff\xfe\nVmRSS:\t  900 kB\nVmPTE:\t  8 kB\nRssAnon:\t  700 kB\nRssFile:\t 200 kB\nVmSwap:\t  24 kB\n";
        // A name that is not UTF-8 (the worker chooses it) does not hide the counters.
        assert_eq!(anonymous_bytes_in(status), Some(732 << 10));
        assert_eq!(anonymous_bytes_in(b"RssAnon:\t5 kB\n"), Some(5 << 10));
        assert_eq!(anonymous_bytes_in(b"Name:\tkthreadd\n"), None);
        // A field that merely starts like it is not it.
        assert_eq!(anonymous_bytes_in(b"RssAnonX:\t5 kB\n"), None);
    }

    #[test]
    fn a_group_within_its_limit_by_its_whole_counters_is_not_read_share_by_share() {
        // Two processes sharing their pages copy-on-write (a parent and its fork), both asleep.
        // Each says its pid in one write: `print` under PYTHONUNBUFFERED=1 writes the number and
        // the newline apart, and the two lines could interleave.
        let mut parent = std::process::Command::new("python3")
            .args([
                "-c",
                "import os, sys, time\nblock = bytearray(32 << 20)\nfor i in range(0, len(block), 4096): block[i] = 1\nos.fork()\nos.write(1, b'%d\\n' % os.getpid())\ntime.sleep(60)",
            ])
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut lines =
            std::io::BufRead::lines(std::io::BufReader::new(parent.stdout.take().unwrap()));
        let mut pids: Vec<i32> = (0..2)
            .map(|_| lines.next().unwrap().unwrap().trim().parse().unwrap())
            .collect();
        pids.retain(|&p| p != parent.id() as i32);
        let (pid, child) = (parent.id() as i32, pids[0]);
        let (bound, threads) = group_bound(pid, &[child]).unwrap();
        let (shares, share_threads) = group_holds(pid, false, &[child], None).unwrap();
        assert_eq!(threads, share_threads);
        // 32 MiB counted once per process by their counters, once among the two by their shares.
        assert!(bound >= shares + (24 << 20), "{bound} {shares}");
        assert_eq!(
            group_holds(pid, false, &[child], Some(u64::MAX)),
            Some((bound, threads)),
            "far within the limit: the counters, not the shares"
        );
        let (near, _) = group_holds(pid, false, &[child], Some(bound)).unwrap();
        assert!(
            near < bound - (24 << 20),
            "{near} {bound}: the counters could lag behind"
        );
        assert!(!within(bound, 1, bound) && within(bound, 1, bound + (1 << 30)));
        let _ = parent.kill();
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(child),
            nix::sys::signal::Signal::SIGKILL,
        );
        let _ = parent.wait();
    }

    #[test]
    fn this_process_reads_as_holding_what_it_touched() {
        // An absolute bound, not a difference: other tests allocate and free meanwhile.
        let block = std::hint::black_box(vec![1u8; 128 << 20]);
        let held = anonymous_bytes(std::process::id() as i32).unwrap();
        assert!(held >= 128 << 20, "{held}");
        drop(std::hint::black_box(block));
        assert_eq!(anonymous_bytes(i32::MAX), None);
    }

    #[test]
    fn a_process_whose_main_thread_exited_is_read_through_its_other_threads() {
        // A child whose main thread ends with the raw exit call, leaving a thread that holds
        // 64 MiB: its own status shows no counters, its thread's do.
        let script = "import ctypes, threading, time\n\
                      keep = bytearray(64 << 20)\n\
                      for i in range(0, len(keep), 4096): keep[i] = 1\n\
                      threading.Thread(target=time.sleep, args=(30,)).start()\n\
                      ctypes.CDLL(None).syscall(60, 0)\n";
        let Ok(mut child) = std::process::Command::new("python3")
            .args(["-c", script])
            .spawn()
        else {
            eprintln!("skipped: no python3");
            return;
        };
        let pid = child.id() as i32;
        let leader_gone = || {
            std::fs::read_to_string(format!("/proc/{pid}/status")).is_ok_and(|s| {
                s.contains("State:\tZ") && anonymous_bytes_in(s.as_bytes()).is_none()
            })
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        while !leader_gone() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        assert!(leader_gone(), "the child's main thread did not exit");
        let held = anonymous_bytes(pid);
        // Its `Z` is its main thread's: it runs on (SECURITY.md #299).
        let ended_while_leaderless = has_ended(pid);
        let _ = child.kill();
        // Killed and not reaped: a zombie, ended.
        let deadline = Instant::now() + Duration::from_secs(20);
        while !has_ended(pid) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        let ended_once_killed = has_ended(pid);
        let reaped = child.wait();
        let held = held.unwrap_or(0);
        assert!(held >= 64 << 20, "{held}");
        assert!(!ended_while_leaderless && ended_once_killed && reaped.is_ok());
        assert!(has_ended(pid) && has_ended(i32::MAX));
    }

    #[test]
    fn a_child_whose_main_thread_exited_counts_with_its_worker() {
        // A process (the worker) forks a child whose main thread ends with the raw exit call,
        // leaving a thread that holds 64 MiB: the child's own status shows no counters, and it
        // was counted as holding nothing (SECURITY.md #298).
        let script = "import ctypes, os, threading, time\n\
                      r, w = os.pipe()\n\
                      if os.fork() == 0:\n\
                      \x20   keep = bytearray(64 << 20)\n\
                      \x20   for i in range(0, len(keep), 4096): keep[i] = 1\n\
                      \x20   threading.Thread(target=time.sleep, args=(30,)).start()\n\
                      \x20   os.write(w, b'%d\\n' % os.getpid())\n\
                      \x20   ctypes.CDLL(None).syscall(60, 0)\n\
                      os.write(1, os.read(r, 64))\n\
                      time.sleep(30)\n";
        let Ok(mut worker) = std::process::Command::new("python3")
            .args(["-c", script])
            .stdout(std::process::Stdio::piped())
            .spawn()
        else {
            eprintln!("skipped: no python3");
            return;
        };
        let mut lines =
            std::io::BufRead::lines(std::io::BufReader::new(worker.stdout.take().unwrap()));
        let child: i32 = lines.next().unwrap().unwrap().trim().parse().unwrap();
        let pid = worker.id() as i32;
        let leader_gone = || {
            std::fs::read_to_string(format!("/proc/{child}/status")).is_ok_and(|s| {
                s.contains("State:\tZ") && anonymous_bytes_in(s.as_bytes()).is_none()
            })
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        while !leader_gone() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        let gone = leader_gone();
        let holds = group_holds(pid, false, &[child], None);
        let bound = group_bound(pid, &[child]);
        let kid = child_holds(child);
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(child),
            nix::sys::signal::Signal::SIGKILL,
        );
        let _ = worker.kill();
        let _ = worker.wait();
        assert!(gone, "the child's main thread did not exit");
        let (own, _) = held_by(pid).unwrap_or((0, 0));
        assert!(kid.is_some_and(|(b, t)| b >= 64 << 20 && t == 2), "{kid:?}");
        for (what, got) in [("shares", holds), ("counters", bound)] {
            let (bytes, threads) = got.unwrap();
            assert!(
                bytes >= 64 << 20,
                "{what}: {bytes} ({own} the worker's own)"
            );
            assert!(threads >= 3, "{what}: {threads} threads");
        }
    }

    #[test]
    fn only_a_workers_own_smaps_rollup_is_kept_as_its_counters_and_it_reads_live() {
        let me = std::process::id() as i32;
        let open = |path: &str| -> Vec<OwnedFd> { vec![std::fs::File::open(path).unwrap().into()] };
        // Another process's counters (for the worker `1`, this process's), another /proc
        // file, or a file that is not on /proc, are not kept.
        keep_memory_counters(1, open("/proc/self/smaps_rollup"));
        assert!(!lock(&COUNTERS).contains_key(&1));
        keep_memory_counters(me, open("/proc/self/status"));
        assert!(!lock(&COUNTERS).contains_key(&me));
        let fake = std::env::temp_dir().join(format!("smaps_rollup-{me}"));
        std::fs::write(&fake, "Pss_Anon: 1 kB\n").unwrap();
        keep_memory_counters(me, open(fake.to_str().unwrap()));
        assert!(!lock(&COUNTERS).contains_key(&me));
        keep_memory_counters(me, Vec::new());
        assert!(!lock(&COUNTERS).contains_key(&me));
        // Its own, opened by itself, is; each read is anew: 64 MiB touched since shows.
        keep_memory_counters(me, open("/proc/self/smaps_rollup"));
        let file = lock(&COUNTERS)
            .remove(&me)
            .expect("its own counters are kept");
        let pss = || {
            let text = read_from_start(&file).unwrap();
            crate::sandbox::rlimits::status_kib(&text, b"Pss_Anon").unwrap() << 10
        };
        let before = pss();
        let block = std::hint::black_box(vec![1u8; 64 << 20]);
        let after = pss();
        drop(std::hint::black_box(block));
        let _ = std::fs::remove_file(fake);
        assert!(after >= 64 << 20 && after > before, "{before} -> {after}");
    }

    #[test]
    fn minor_faults_are_read_past_the_command_name() {
        let me = std::process::id() as i32;
        let before = minor_faults(me).unwrap();
        let block = std::hint::black_box(vec![1u8; 16 << 20]);
        let after = minor_faults(me).unwrap();
        drop(std::hint::black_box(block));
        assert!(after >= before + 4000, "{before} -> {after}");
        assert_eq!(minor_faults(i32::MAX), None);
    }

    #[test]
    fn a_worker_may_hold_the_limit_the_slack_and_the_zygotes_share() {
        assert_eq!(allowed_bytes(1 << 30, 50 << 20), (1 << 30) + (114 << 20));
        assert_eq!(allowed_bytes(u64::MAX, 1), u64::MAX);
    }
}
