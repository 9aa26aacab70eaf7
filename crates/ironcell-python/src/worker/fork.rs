//! Forking a live session (docs/ARCHITECTURE.md, "Forking a session"; SECURITY.md #193-#199).
//!
//! The host sends `fork` between cells, with the new session's socket attached. The worker (A)
//! makes a middle process M with `vfork` (it shares A's memory), M makes B with glibc's `fork`
//! and exits at once: B is orphaned, and the zygote, the child subreaper, adopts it, so B is
//! the zygote's child like any worker (the zygote reaps it and reports its exit) and outlives
//! A. glibc's `fork` takes the allocator's locks around the fork, and A holds its own (pump,
//! socket, inbox) across it, so B's copy of A's heap is consistent although A has other
//! threads; Python's are handled by `PyOS_*Fork*`.
//!
//! B then, while it has one thread and before any Python runs in it:
//! 1. puts its own socket on fd 3, leaves A's process group (`setpgid(0, 0)`), waits to be
//!    the zygote's child and dies with the zygote, says so (one byte); then waits for the
//!    host's one-byte go-ahead,
//!    which comes once A is narrowed and the host found nothing of A's code left running in A
//!    (no thread or process it did not have at its `ready`: one would keep A's pre-fork
//!    domain, which reaches B's directory; the socket closes instead and B ends);
//! 2. copies A's files into its own directory (`copy_file_range`: a reflink where the filesystem
//!    can, an in-kernel copy elsewhere);
//! 3. narrows its Landlock domain to its own directory and forks area (one layer, with the
//!    signal scope: it cannot signal A);
//! 4. puts its own pipes and wake-up pipe on the descriptor numbers A's objects use,
//!    re-opens inherited files of A's directory on its copies, closes every other descriptor;
//!
//! and only then, once the host's second byte says B is in its own pids group (as root), runs
//! `PyOS_AfterFork_Child` (so A's `os.register_at_fork` hooks run narrowed and in B's group, and
//! a thread or process one starts is too), and
//! 5. renames itself to its session (environment, cwd), restarts the reader and pump threads,
//!    and says `ready` on its socket, then serves cells in the same loop A did.
//!
//! A meanwhile reaps M and narrows its own domain to its directory and its next forks area
//! (then runs its `after_in_parent` hooks), so neither reaches the other's files from then on.

use std::collections::HashMap;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use anyhow::{Context, anyhow};
use nix::fcntl::OFlag;
use nix::sys::stat::Mode;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use ironcell_core::frame::{ForkOrder, FromWorker};
use ironcell_core::sandbox::landlock::FilesystemGrants;

use super::fork_files::{
    CopyBudget, copy_contents, copy_tree, read_the_runs_to_remap, remap_onto_copies,
};
use super::inbox::Inbox;
use super::output_pump::OutputPump;
use super::{SESSION_FD, send_json};

/// Set between a session fork and the new session's own setup: the `pthread_atfork` child
/// handler then leaves the children's parent-death signal and signal-scope layer out (the new
/// session sets up its own).
pub(super) static FORKING_A_SESSION: AtomicBool = AtomicBool::new(false);

/// What this worker needs to fork: its filesystem grants (read-only ones, and the read-write
/// ones that are not its directory or forks area, which a fork keeps), and the zygote's pid.
pub(super) struct Forkable {
    pub grants: FilesystemGrants,
    /// Read-write grants other than the session's directory and forks area.
    pub shared_rw: Vec<PathBuf>,
    pub zygote: nix::unistd::Pid,
}

/// Set at lockdown where this worker may fork sessions (`None`: it may not, and why).
pub(super) static FORKABLE: Mutex<Option<Result<Forkable, String>>> = Mutex::new(None);

/// The worker's side of one `fork` order. In A it answers `forked` and returns; in B it returns
/// once B serves its own session (the loop continues in B with B's descriptors).
///
/// Long on purpose: the two forks and what each of A, M and B does right after them, in one
/// place, because what may run in each process between `fork` and `PyOS_AfterFork_*` depends on
/// the order (SECURITY.md #226).
pub(super) fn fork_session(
    py: Python<'_>,
    runner: &Bound<'_, PyModule>,
    order: ForkOrder,
    inbox: &Inbox,
    pump: &OutputPump,
    writer: &Arc<Mutex<std::os::unix::net::UnixStream>>,
) -> anyhow::Result<()> {
    // Its socket, then the read and write ends of its stdout and stderr pipes, which the host
    // made (it keeps its own read ends: SECURITY.md #277).
    let Ok([socket, pipes @ ..]) = <[OwnedFd; 5]>::try_from(super::inbox::take_passed_fds()) else {
        return answer(
            writer,
            Some("the fork order came without its socket and pipes".into()),
        );
    };
    let (zygote, grants, shared_rw) = match &*crate::lock(&FORKABLE) {
        Some(Ok(f)) => (f.zygote, f.grants.clone(), f.shared_rw.clone()),
        Some(Err(why)) => return answer(writer, Some(why.clone())),
        None => return answer(writer, Some("this worker cannot fork".into())),
    };
    let started = std::time::Instant::now();
    // Held across the fork: B's copies of these locks are then unlocked when B drops them.
    let pump_held = pump.hold()?;
    let writer_held = crate::lock(writer);
    let inbox_held = inbox.hold();
    FORKING_A_SESSION.store(true, Ordering::Relaxed);
    // SAFETY: the GIL is held by this thread; PyOS_BeforeFork takes CPython's fork locks.
    unsafe { pyo3::ffi::PyOS_BeforeFork() };
    // A: M's pid (or -1); B: 0. M, which shares A's memory, made B and ended.
    let middle = fork_through_a_middle();
    if middle == 0 {
        drop((pump_held, writer_held, inbox_held));
        let fds = (inbox.descriptors(), pump.descriptors());
        let socket_copy = fds.0[0];
        // Steps 1-4 run no Python (the interpreter still believes A's threads exist; nothing
        // here touches a Python object): the parent's `os.register_at_fork` hooks run in
        // `PyOS_AfterFork_Child` only once B is narrowed, so a thread one starts is too.
        let setup = become_the_fork(&order, (socket, pipes), fds, (&grants, &shared_rw), zygote)
            .and_then(|notes| {
                // The host's second byte: B is in its own pids group now (as root), so the
                // parent's `after_in_child` hooks, and any process one starts, run there
                // (SECURITY.md #234).
                wait_for_the_hosts_go(SESSION_FD)?;
                // SAFETY: in B, with the GIL held by this (only) thread, before any Python runs.
                unsafe { pyo3::ffi::PyOS_AfterFork_Child() };
                // The runner's own hook (for a session's children) put /dev/null on fd 3.
                dup_onto(socket_copy, SESSION_FD)?;
                // Calls through the bridge the parent still waited for: their answers go to it.
                let mut notes = notes;
                let open = crate::bridge::fail_all(
                    "made by the parent session before the fork; its answer goes to the parent",
                );
                if open > 0 {
                    notes.push(format!(
                        "{open} call(s) through the bridge the parent had not had answered fail here (their answers go to the parent)"
                    ));
                }
                bind_the_fork(py, runner, &order)?;
                Ok(notes)
            });
        FORKING_A_SESSION.store(false, Ordering::Relaxed);
        return match setup {
            Ok(notes) => {
                super::WORKER_PID.store(std::process::id(), Ordering::Relaxed);
                inbox.restart_reader_after_fork()?;
                pump.restart_after_fork()?;
                send_json(
                    writer,
                    &FromWorker::Ready {
                        pid: std::process::id() as i32,
                        missing_layers: Vec::new(),
                        lockdown_us: started.elapsed().as_micros() as u64,
                        notes,
                    },
                )
            }
            Err(e) => {
                let _ = send_json(
                    writer,
                    &FromWorker::Fatal {
                        message: format!("{e:#}"),
                    },
                );
                // SAFETY: B ends here, running none of A's destructors.
                unsafe { libc::_exit(70) }
            }
        };
    }
    let fork_error = (middle < 0).then(std::io::Error::last_os_error);
    FORKING_A_SESSION.store(false, Ordering::Relaxed);
    drop((pump_held, writer_held, inbox_held));
    drop((socket, pipes));
    // A's `after_in_parent` hooks run once A is narrowed too (a thread one starts is).
    let error = narrow_the_parent(middle, fork_error, &order, (&grants, &shared_rw));
    // SAFETY: in A, after fork, with the GIL held.
    unsafe { pyo3::ffi::PyOS_AfterFork_Parent() };
    answer(writer, error)
}

/// Forks B through a middle process M that ends at once, so the zygote (the child subreaper)
/// adopts B: returns M's pid (or -1) in A and 0 in B. M is a `vfork` child: it shares A's
/// memory and runs glibc's `fork` on it (its at-fork handlers and allocator locks, as A's
/// main thread would), so B is copied once and M's end frees nothing. Two plain forks copied
/// A's page tables twice and tore M's copy down before B was adopted: with 512 MiB resident,
/// ~25 ms each on this machine. Signals are blocked while M lives (it runs on A's stack).
fn fork_through_a_middle() -> libc::pid_t {
    let all = nix::sys::signal::SigSet::all();
    let mut before = nix::sys::signal::SigSet::empty();
    let _ = nix::sys::signal::pthread_sigmask(
        nix::sys::signal::SigmaskHow::SIG_SETMASK,
        Some(&all),
        Some(&mut before),
    );
    let mut pid = vfork_then_fork();
    if pid == -libc::ENOSYS || pid == -libc::EPERM {
        pid = fork_twice();
    } else if pid < 0 {
        nix::errno::Errno::set_raw(-pid);
        pid = -1;
    }
    if pid == 0 {
        reregister_rseq();
    }
    let _ = nix::sys::signal::pthread_sigmask(
        nix::sys::signal::SigmaskHow::SIG_SETMASK,
        Some(&before),
        None,
    );
    pid
}

/// Two plain forks (A → M → B, M exits at once): where `vfork` is not available.
fn fork_twice() -> libc::pid_t {
    // SAFETY: glibc's fork(2); the child runs only the code below.
    let middle = unsafe { libc::fork() };
    if middle == 0 {
        // SAFETY: fork(2) in M, single-threaded.
        let b = unsafe { libc::fork() };
        if b != 0 {
            // SAFETY: M ends at once, running nothing of the parent's.
            unsafe { libc::_exit(if b > 0 { 0 } else { 1 }) };
        }
    }
    middle
}

#[cfg(target_arch = "x86_64")]
unsafe extern "C" {
    /// vfork(2), then in the child (M) glibc's fork(3) and exit_group: M's status is 0 once B is
    /// made. Returns M's pid or -errno in A, 0 in B. In assembly: M runs on A's stack, below
    /// the return address of this function, which it must not touch (a compiled caller of
    /// vfork could keep a value in a stack slot M overwrites).
    fn ironcell_vfork_then_fork() -> libc::c_long;
}

#[cfg(target_arch = "x86_64")]
std::arch::global_asm!(
    ".pushsection .text.ironcell_vfork_then_fork,\"ax\",@progbits",
    ".globl ironcell_vfork_then_fork",
    ".hidden ironcell_vfork_then_fork",
    ".type ironcell_vfork_then_fork,@function",
    "ironcell_vfork_then_fork:",
    "mov eax, 58", // vfork: A waits here until M exits
    "syscall",
    "test rax, rax",
    "jnz 2f",
    // M: glibc's fork, with the stack aligned for a call below A's return address.
    "sub rsp, 8",
    "call {fork}@PLT",
    "add rsp, 8",
    "test eax, eax",
    "jz 2f", // B returns 0
    "xor edi, edi",
    "test eax, eax",
    "setl dil", // M: exit 1 if fork failed, else 0
    "mov eax, 231", // exit_group
    "syscall",
    "ud2",
    "2:",
    "ret",
    ".size ironcell_vfork_then_fork, .-ironcell_vfork_then_fork",
    ".popsection",
    fork = sym libc::fork,
);

#[cfg(target_arch = "x86_64")]
fn vfork_then_fork() -> libc::pid_t {
    // SAFETY: the routine above; in B it returns 0 like fork(2) in a child.
    unsafe { ironcell_vfork_then_fork() as libc::pid_t }
}

#[cfg(not(target_arch = "x86_64"))]
fn vfork_then_fork() -> libc::pid_t {
    -libc::ENOSYS
}

/// In B: its thread's restartable-sequences area registered again. The kernel drops the
/// registration of a `CLONE_VM` child (M), and B inherits M's, so glibc's (`__rseq_offset`
/// from the thread pointer, `__rseq_size`) is registered anew, as glibc does for a thread.
fn reregister_rseq() {
    #[cfg(target_arch = "x86_64")]
    {
        let symbol = |name: &std::ffi::CStr| {
            // SAFETY: dlsym(3) of one of glibc's exported variables (2.35 and later; else null).
            unsafe { libc::dlsym(libc::RTLD_DEFAULT, name.as_ptr()) }
        };
        let (offset, size) = (symbol(c"__rseq_offset"), symbol(c"__rseq_size"));
        if offset.is_null() || size.is_null() {
            return;
        }
        // SAFETY: glibc's `ptrdiff_t __rseq_offset`.
        let offset = unsafe { *(offset as *const isize) };
        // SAFETY: glibc's `unsigned int __rseq_size`.
        let size = unsafe { *(size as *const u32) };
        if size == 0 {
            return;
        }
        let tp: usize;
        // SAFETY: reads the thread pointer (the TCB's self pointer at %fs:0 on x86_64).
        unsafe { std::arch::asm!("mov {}, fs:0", out(reg) tp, options(nostack, readonly)) };
        const RSEQ_SIG: u32 = 0x5305_3053;
        // SAFETY: rseq(2) registering this thread's area, which glibc laid out in its TCB.
        unsafe {
            libc::syscall(
                libc::SYS_rseq,
                tp.wrapping_add_signed(offset),
                size.max(32),
                0,
                RSEQ_SIG,
            )
        };
    }
}

/// A's side after the fork: reaps M, then keeps its directory and its next forks area and loses
/// the new session's. Returns why it failed, if it did.
fn narrow_the_parent(
    middle: libc::pid_t,
    fork_error: Option<std::io::Error>,
    order: &ForkOrder,
    (grants, shared_rw): (&FilesystemGrants, &[PathBuf]),
) -> Option<String> {
    if let Some(e) = fork_error {
        return Some(format!("fork failed: {e}"));
    }
    let mut status = 0;
    // SAFETY: waitpid(2) of M, this process's child, with a valid out-pointer.
    while unsafe { libc::waitpid(middle, &mut status, 0) } < 0
        && nix::errno::Errno::last() == nix::errno::Errno::EINTR
    {}
    if !libc::WIFEXITED(status) || libc::WEXITSTATUS(status) != 0 {
        return Some("the second fork failed".into());
    }
    let mine = narrowed(grants, shared_rw, &order.parent_dir, &order.parent_forks);
    ironcell_core::sandbox::landlock::narrow_for_a_fork(&mine)
        .err()
        .map(|e| format!("this session could not narrow its sandbox: {e}"))
}

fn answer(
    writer: &Arc<Mutex<std::os::unix::net::UnixStream>>,
    error: Option<String>,
) -> anyhow::Result<()> {
    send_json(writer, &FromWorker::Forked { error })
}

/// The grants of one side of a fork: the same read-only ones, read-write beneath its own
/// directory and forks area and the shared read-write grants.
fn narrowed(
    grants: &FilesystemGrants,
    shared_rw: &[PathBuf],
    dir: &Path,
    forks: &Path,
) -> FilesystemGrants {
    let mut mine = grants.clone();
    mine.read_write = vec![dir.to_path_buf(), forks.to_path_buf()];
    mine.read_write.extend(shared_rw.iter().cloned());
    mine
}

/// B's setup, steps 1-4 of the module's list: no Python runs in them. Returns notes for B's
/// first result.
fn become_the_fork(
    order: &ForkOrder,
    (socket, pipes): (OwnedFd, [OwnedFd; 4]),
    fds: ([RawFd; 4], [RawFd; 2]),
    (grants, shared_rw): (&FilesystemGrants, &[PathBuf]),
    zygote: nix::unistd::Pid,
) -> anyhow::Result<Vec<String>> {
    // Its own socket on fd 3 first, where the writer writes: a failure from here on is told to
    // the host on it, never on A's socket.
    super::move_fd_to(socket, SESSION_FD)?;
    // Step 1: a process group of its own, then wait to be the zygote's (M ends at once).
    nix::unistd::setpgid(nix::unistd::Pid::from_raw(0), nix::unistd::Pid::from_raw(0))
        .context("setpgid(0, 0)")?;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
    while nix::unistd::getppid() != zygote {
        if std::time::Instant::now() > deadline {
            anyhow::bail!("the fork was not adopted by the zygote");
        }
        std::thread::sleep(std::time::Duration::from_micros(50));
    }
    super::die_with_zygote(zygote)?;
    // SAFETY: prctl(2) with integer arguments: dumpable, so the host reads its memory counters.
    unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 1, 0, 0, 0) };
    // One byte to the host: B is out of A's group and the zygote's. Then the host's word to go
    // on (one byte): it has checked that A, now narrowed, runs nothing it started before (a
    // thread of it would still reach this directory). The socket closed instead: the fork was
    // refused, and B ends.
    // SAFETY: write(2) of one byte from a static, on fd 3 (B's socket).
    if unsafe { libc::write(SESSION_FD, b"b".as_ptr().cast(), 1) } != 1 {
        return Err(std::io::Error::last_os_error()).context("telling the host");
    }
    wait_for_the_hosts_go(SESSION_FD)?;
    let runs = read_the_runs_to_remap(SESSION_FD)?;

    // Step 2: the files, into a directory that must still be empty: anything in it was put
    // there by the parent after the host made it (a hard link to one of the parent's files
    // would let the two sides write one inode), and the fork is refused.
    let planted = std::fs::read_dir(&order.child_dir)
        .context("listing the fork's directory")?
        .next()
        .is_some();
    if planted {
        anyhow::bail!("the fork's directory was not empty when the fork began");
    }
    let mut copied = HashMap::new();
    let mut notes = Vec::new();
    let mut budget = CopyBudget::of(order.copy_limit_bytes);
    copy_tree(
        &order.parent_dir,
        &order.child_dir,
        (&mut copied, &mut notes, &mut budget),
        0,
    )
    .context("copying the session's files")?;

    // Step 3: the sandbox, narrowed to this session's own directory and forks area.
    let mine = narrowed(grants, shared_rw, &order.child_dir, &order.child_forks);
    ironcell_core::sandbox::landlock::narrow_for_a_fork(&mine)
        .map_err(|e| anyhow!("narrowing the fork's sandbox: {e}"))?;

    // Step 4: descriptors (the socket is on fd 3 already, where the writer and bridge write).
    let mut keep: Vec<RawFd> = vec![SESSION_FD];
    let mut copies = Copies {
        copied: &copied,
        dir: &order.child_dir,
        budget: &mut budget,
        carried: HashMap::new(),
        names_tried: 0,
    };
    let counts = replace_descriptors(&mut copies, fds, pipes, &mut keep)
        .context("carrying the parent's open files over")?;
    notes.extend(notes_on_descriptors(&counts));
    // Then its memory that maps the parent's files privately, onto its copies (SECURITY.md
    // #305), before the deleted files' copies lose their names.
    let moved = remap_onto_copies(&runs, [&copied, &copies.carried]);
    for copy in copies.carried.values() {
        nix::unistd::unlink(copy).context("unlinking a copy of a file the parent deleted")?;
    }
    if moved? > 0 {
        notes.push(
            "memory that mapped the parent's files privately (mmap ACCESS_COPY, numpy memmap \
             mode='c', pyarrow.memory_map) now maps this session's copies; pages it had \
             written stay as they were"
                .into(),
        );
    }
    Ok(notes)
}

/// What B's first result says of the descriptors it inherited.
fn notes_on_descriptors(counts: &Carried) -> Vec<String> {
    let mut notes = Vec::new();
    if counts.reopened > 0 {
        notes.push(format!(
            "{} open file(s) of the parent session now read and write this session's copies",
            counts.reopened
        ));
    }
    if counts.copied > 0 {
        notes.push(format!(
            "{} open file(s) the parent session had deleted (tempfile.TemporaryFile and the like) are this session's own copies, as they were at the fork",
            counts.copied
        ));
    }
    if counts.closed > 0 {
        notes.push(format!(
            "{} descriptor(s) of the parent session (pipes, sockets, files open for writing elsewhere) were closed here; objects that used them raise OSError",
            counts.closed
        ));
    }
    notes
}

/// Step 5: the session's name, environment and cwd, and a clear `/tmp` refusal.
fn bind_the_fork(
    py: Python<'_>,
    runner: &Bound<'_, PyModule>,
    order: &ForkOrder,
) -> anyhow::Result<()> {
    let env = PyDict::new(py);
    for (k, v) in &order.env {
        env.set_item(k, v).map_err(|e| anyhow!("{e}"))?;
    }
    runner
        .call_method1(
            "became_a_fork",
            (env, order.child_dir.display().to_string()),
        )
        .map_err(|e| anyhow!("binding the fork to its session: {e}"))?;
    Ok(())
}

/// Blocks until the host sends B one byte on its socket (the go-ahead, then the word that B is
/// in its own pids group); an error once it closed.
fn wait_for_the_hosts_go(socket: RawFd) -> anyhow::Result<()> {
    let mut byte = 0u8;
    loop {
        // SAFETY: read(2) of one byte into a local, on a descriptor B owns.
        let n = unsafe { libc::read(socket, (&raw mut byte).cast(), 1) };
        match n {
            1 => return Ok(()),
            0 => anyhow::bail!("the host refused the fork"),
            _ if nix::errno::Errno::last() == nix::errno::Errno::EINTR => {}
            _ => return Err(std::io::Error::last_os_error()).context("waiting for the host"),
        }
    }
}

/// Points B's pipes and wake-up pipe at fresh ones under the numbers A's objects use, puts the
/// session socket on the inbox's numbers too, re-opens inherited files of A's directory on B's
/// copies, puts B's own copies in place of deleted files A held open, and closes every other
/// descriptor from 3 up ([`fate_of_a_descriptor`]).
fn replace_descriptors(
    copies: &mut Copies<'_>,
    (inbox_fds, pump_fds): ([RawFd; 4], [RawFd; 2]),
    [out_r, out_w, err_r, err_w]: [OwnedFd; 4],
    keep: &mut Vec<RawFd>,
) -> anyhow::Result<Carried> {
    // The socket, on the inbox's copy and the reader thread's copy.
    for fd in [inbox_fds[0], inbox_fds[1]] {
        if fd >= 0 {
            dup_onto(SESSION_FD, fd)?;
            keep.push(fd);
        }
    }
    let (kick_r, kick_w) = nix::unistd::pipe2(OFlag::O_CLOEXEC)?;
    dup_onto(kick_r.as_raw_fd(), inbox_fds[2])?;
    dup_onto(kick_w.as_raw_fd(), inbox_fds[3])?;
    keep.extend([inbox_fds[2], inbox_fds[3]]);
    // The pipes the host made, whose read ends it keeps too.
    for ((r, w), (pump_fd, out)) in [(out_r, out_w), (err_r, err_w)].into_iter().zip(
        pump_fds
            .into_iter()
            .zip([libc::STDOUT_FILENO, libc::STDERR_FILENO]),
    ) {
        dup_onto(r.as_raw_fd(), pump_fd)?;
        dup_onto(w.as_raw_fd(), out)?;
        keep.push(pump_fd);
    }
    drop((kick_r, kick_w));
    let mut counts = Carried::default();
    for fd in open_descriptors_from(3) {
        if keep.contains(&fd) {
            continue;
        }
        match fate_of_a_descriptor(fd, copies)? {
            Fate::Reopened => counts.reopened += 1,
            Fate::Copied => counts.copied += 1,
            Fate::Kept => {}
            Fate::Closed => {
                // SAFETY: closes a descriptor this process inherited from A and does not keep.
                unsafe { libc::close(fd) };
                counts.closed += 1;
            }
        }
    }
    counts.closed += close_above_the_limit(keep);
    Ok(counts)
}

/// What B does with one descriptor it inherited from A (step 4), and what the copy needs for
/// it: A's files copied ((device, inode) → B's copy), B's directory, and the copy's room.
struct Copies<'a> {
    copied: &'a HashMap<(u64, u64), PathBuf>,
    dir: &'a Path,
    budget: &'a mut CopyBudget,
    /// Deleted files A held open ((device, inode) → B's copy, unlinked at the end of step 4).
    carried: HashMap<(u64, u64), PathBuf>,
    names_tried: usize,
}

/// How many inherited descriptors B re-opened on its copies, copied (files A had deleted), and
/// closed.
#[derive(Default)]
struct Carried {
    reopened: usize,
    copied: usize,
    closed: usize,
}

enum Fate {
    Reopened,
    Copied,
    Kept,
    Closed,
}

/// One inherited descriptor: a file of A's directory is re-opened on B's copy; a file no longer
/// in any directory (A deleted it: `tempfile.TemporaryFile()`, or open then `os.remove`) that
/// can still be written (by A through its own descriptor) becomes B's own copy of it
/// ([`copy_an_unlinked_file`]: B kept A's and read A's later writes through it, SECURITY.md
/// #304); a device or a file elsewhere (the Python installation, a read-only grant, a folder
/// the user shares) is kept when only read; anything else is closed. An error fails the fork
/// (the copy went past its room).
fn fate_of_a_descriptor(fd: RawFd, copies: &mut Copies<'_>) -> anyhow::Result<Fate> {
    // SAFETY: fstat(2) into a zeroed stat buffer for an open descriptor.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::fstat(fd, &mut st) } != 0 {
        return Ok(Fate::Closed);
    }
    let kind = st.st_mode & libc::S_IFMT;
    // SAFETY: fcntl(2) F_GETFL on an open descriptor.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    let read_only = flags & libc::O_ACCMODE == libc::O_RDONLY;
    if kind == libc::S_IFCHR {
        return Ok(Fate::Kept);
    }
    if kind != libc::S_IFREG {
        return Ok(Fate::Closed);
    }
    if let Some(copy) = copies.copied.get(&(st.st_dev, st.st_ino)) {
        return Ok(match reopen_on(fd, copy) {
            Ok(()) => Fate::Reopened,
            Err(_) => Fate::Closed,
        });
    }
    if st.st_nlink == 0 && !sealed_against_writes(fd) {
        let key = (st.st_dev, st.st_ino);
        if !copies.carried.contains_key(&key) {
            let readable =
                flags & libc::O_PATH == 0 && (read_only || flags & libc::O_ACCMODE == libc::O_RDWR);
            if !readable {
                return Ok(Fate::Closed);
            }
            let copy = copy_an_unlinked_file(fd, copies)?;
            copies.carried.insert(key, copy);
        }
        return Ok(match reopen_on(fd, &copies.carried[&key]) {
            Ok(()) => Fate::Copied,
            Err(_) => Fate::Closed,
        });
    }
    Ok(if read_only { Fate::Kept } else { Fate::Closed })
}

/// Whether no one can write the file any more: a memfd sealed against writes (the zygote's
/// extension module is one). Such a file is kept, not copied.
fn sealed_against_writes(fd: RawFd) -> bool {
    // SAFETY: fcntl(2) F_GET_SEALS on an open descriptor (EINVAL where the file has no seals).
    let seals = unsafe { libc::fcntl(fd, libc::F_GET_SEALS) };
    seals >= 0 && seals & (libc::F_SEAL_WRITE | libc::F_SEAL_FUTURE_WRITE) != 0
}

/// B's own copy of the deleted file A held open on `fd`: a file in B's directory with the bytes
/// the file holds now, counted against the copy's room, which every descriptor B inherited on
/// that file is then re-opened on (so two of them still share it, each with its own offset and
/// mode), and which step 4 unlinks once they are and its mappings moved (#305). Named `.ironcell-deleted-N`,
/// the first such name free (A's copied files may hold some). An error (past the room, a failed
/// read) fails the fork.
fn copy_an_unlinked_file(fd: RawFd, copies: &mut Copies<'_>) -> anyhow::Result<PathBuf> {
    let (path, copy) = loop {
        let path = copies
            .dir
            .join(format!(".ironcell-deleted-{}", copies.names_tried));
        copies.names_tried += 1;
        match nix::fcntl::open(
            &path,
            OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
            Mode::from_bits_truncate(0o600),
        ) {
            Ok(copy) => break (path, copy),
            Err(nix::errno::Errno::EEXIST) if copies.names_tried < 1024 => {}
            Err(e) => return Err(e).context("making a copy of a file the parent deleted"),
        }
    };
    let named = Path::new("a file the parent deleted");
    if let Err(e) = copy_contents(fd, copy.as_raw_fd(), copies.budget, named) {
        let _ = nix::unistd::unlink(&path);
        return Err(e);
    }
    Ok(path)
}

/// Closes every descriptor from the polled range's end ([`descriptor_limit`]) up but those in
/// `keep` (SECURITY.md #250): A could lower its soft `RLIMIT_NOFILE` before the fork to hide
/// descriptors above it (an epoll instance, a pipe into A) from the poll. Returns how many.
fn close_above_the_limit(keep: &[RawFd]) -> usize {
    let first = descriptor_limit();
    let mut kept: Vec<RawFd> = keep.iter().copied().filter(|&fd| fd >= first).collect();
    kept.sort_unstable();
    kept.dedup();
    // Counted for the note with one poll up to the hard limit (no descriptor can be above it).
    let hard = nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE)
        .map(|(_, hard)| hard.min(1 << 16) as RawFd)
        .unwrap_or(first);
    let closed = open_descriptors_in(first, hard)
        .into_iter()
        .filter(|fd| !kept.contains(fd))
        .count();
    let mut from = first as u32;
    for end in kept.into_iter().map(|fd| fd as u32).chain([u32::MAX]) {
        if end > from {
            // SAFETY: close_range(2) over numbers this process does not keep.
            unsafe { libc::syscall(libc::SYS_close_range, from, end - 1, 0u32) };
        }
        from = end.saturating_add(1);
    }
    closed
}

/// The end of the range [`open_descriptors_from`] polls: the soft `RLIMIT_NOFILE`, at most 65,536.
fn descriptor_limit() -> RawFd {
    nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE)
        .map(|(soft, _)| soft.min(1 << 16) as RawFd)
        .unwrap_or(1024)
}

/// The descriptors open in this process from `first` up: one `poll` over every number below
/// the descriptor limit, which marks the numbers with nothing open `POLLNVAL` (one call instead
/// of one `fcntl` per number: 1,021 calls at the default limit).
fn open_descriptors_from(first: RawFd) -> Vec<RawFd> {
    open_descriptors_in(first, descriptor_limit())
}

/// The descriptors open in `first..limit`, found as [`open_descriptors_from`] finds them.
fn open_descriptors_in(first: RawFd, limit: RawFd) -> Vec<RawFd> {
    let mut polled: Vec<libc::pollfd> = (first..limit)
        .map(|fd| libc::pollfd {
            fd,
            events: 0,
            revents: 0,
        })
        .collect();
    // SAFETY: poll(2) over a buffer of `polled.len()` entries this function owns, no waiting.
    let n = unsafe { libc::poll(polled.as_mut_ptr(), polled.len() as libc::nfds_t, 0) };
    if n < 0 {
        let open = |fd: RawFd| {
            // SAFETY: fcntl(2) F_GETFD on a descriptor number: EBADF when none is open there.
            unsafe { libc::fcntl(fd, libc::F_GETFD) >= 0 }
        };
        return (first..limit).filter(|&fd| open(fd)).collect();
    }
    polled
        .iter()
        .filter(|p| p.revents & libc::POLLNVAL == 0)
        .map(|p| p.fd)
        .collect()
}

/// Opens `path` as `fd` was opened (access mode, append), at the same offset, on `fd`'s number.
fn reopen_on(fd: RawFd, path: &Path) -> anyhow::Result<()> {
    // SAFETY: fcntl(2) F_GETFL on an open descriptor.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    let keep = flags & (libc::O_ACCMODE | libc::O_APPEND);
    let new = nix::fcntl::open(
        path,
        OFlag::from_bits_truncate(keep) | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        Mode::empty(),
    )?;
    put_in_place_of(new, fd)
}

/// Puts `new` on `fd`'s number, at `fd`'s offset, with `fd`'s own close-on-exec flag.
fn put_in_place_of(new: OwnedFd, fd: RawFd) -> anyhow::Result<()> {
    // SAFETY: lseek(2) asking the offset only.
    let offset = unsafe { libc::lseek(fd, 0, libc::SEEK_CUR) };
    if offset > 0 {
        // SAFETY: lseek(2) on a descriptor the caller just opened.
        unsafe { libc::lseek(new.as_raw_fd(), offset, libc::SEEK_SET) };
    }
    // SAFETY: fcntl(2) F_GETFD on an open descriptor.
    let cloexec = unsafe { libc::fcntl(fd, libc::F_GETFD) } & libc::FD_CLOEXEC != 0;
    dup_onto(new.as_raw_fd(), fd)?;
    if !cloexec {
        // SAFETY: clears FD_CLOEXEC, which dup_onto set, on a descriptor this process owns.
        unsafe { libc::fcntl(fd, libc::F_SETFD, 0) };
    }
    Ok(())
}

/// `dup3(from, to, O_CLOEXEC)`, unless they are the same number.
fn dup_onto(from: RawFd, to: RawFd) -> anyhow::Result<()> {
    if from == to {
        return Ok(());
    }
    // SAFETY: dup3(2) onto a descriptor number this process controls; errno read at once.
    if unsafe { libc::dup3(from, to, libc::O_CLOEXEC) } < 0 {
        return Err(std::io::Error::last_os_error()).with_context(|| format!("dup3 onto fd {to}"));
    }
    Ok(())
}
