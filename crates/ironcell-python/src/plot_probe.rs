//! The plot probe: a child the zygote forks once, after the matplotlib warm-up, to learn which
//! pages a worker's first plot writes, and the write-ahead of those pages in a worker
//! (`ironcell_core::prefault`). Trusted code only (matplotlib, as in the warm-up), reaped by the
//! zygote itself, never reported as a worker.

use std::io::Write;
use std::os::fd::{AsFd, FromRawFd, OwnedFd, RawFd};

use anyhow::{Context, anyhow};
use pyo3::prelude::*;

use crate::heap_holes::release_heap_reserve;

/// The pages a first plot writes, as the zygote's probe found them ([`probe_plot_pages`]);
/// workers inherit them with the fork.
pub(crate) static PLOT_PAGES: std::sync::OnceLock<ironcell_core::prefault::PageRuns> =
    std::sync::OnceLock::new();

/// How long the probe may take to draw its figure and read its pages.
const PROBE_DEADLINE: std::time::Duration = std::time::Duration::from_secs(20);

/// Forks a probe that draws the warm-up's figure once more and reports which pages of its
/// private writable mappings it wrote (`ironcell_core::prefault`): the pages a worker's first
/// plot would copy one fault at a time. Runs on the zygote's only thread, right before it
/// serves forks again; the probe is trusted code (matplotlib, as in the warm-up), never a
/// worker's, and is reaped here, so the zygote's loop never reports it as a worker.
pub(crate) fn probe_plot_pages(
    py: Python<'_>,
) -> anyhow::Result<ironcell_core::prefault::PageRuns> {
    use ironcell_core::prefault::{PageRuns, private_writable_ranges};
    if ironcell_core::sandbox::sys::threads_of_this_process() != Some(1) {
        return Err(anyhow!("the zygote has more than one thread"));
    }
    if !ironcell_core::prefault::populate_supported() {
        return Err(anyhow!(
            "this kernel has no MADV_POPULATE_WRITE (Linux 5.14)"
        ));
    }
    let ranges = private_writable_ranges().context("reading /proc/self/maps")?;
    let (read, write) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)?;
    // SAFETY: getpid(2) cannot fail.
    let zygote = unsafe { libc::getpid() };
    // SAFETY: as in `worker::fork`: single-threaded, with the GIL held.
    unsafe { pyo3::ffi::PyOS_BeforeFork() };
    // SAFETY: plain fork(2); the child runs Python (with the GIL this thread holds) and exits.
    let pid = unsafe { libc::fork() };
    // Read at once: the calls below (a close among them) may change errno.
    let fork_error = (pid < 0).then(std::io::Error::last_os_error);
    if pid == 0 {
        // SAFETY: in the child, right after fork, with the GIL held by this (only) thread.
        unsafe { pyo3::ffi::PyOS_AfterFork_Child() };
        drop(read);
        // Never back into the zygote's loop: a panic ends the probe too.
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let write = detach_probe(zygote, write)?;
            probe_child(py, &ranges, write)
        }));
        let code = match outcome {
            Ok(Ok(())) => 0,
            Ok(Err(e)) => {
                let _ = writeln!(std::io::stderr(), "ironcell plot probe: {e:#}");
                1
            }
            Err(_) => 1,
        };
        // SAFETY: ends the probe without running the zygote's exit handlers.
        unsafe { libc::_exit(code) };
    }
    // SAFETY: in the parent, after fork, with the GIL held.
    unsafe { pyo3::ffi::PyOS_AfterFork_Parent() };
    drop(write);
    if let Some(e) = fork_error {
        return Err(e).context("fork");
    }
    let got = read_until_eof(&read, PROBE_DEADLINE);
    if got.is_err() {
        // SAFETY: our own child, not reaped yet.
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }
    let status = reap_probe(pid)?;
    let bytes = got?;
    if !libc::WIFEXITED(status) || libc::WEXITSTATUS(status) != 0 {
        return Err(anyhow!("the probe failed (wait status {status:#x})"));
    }
    PageRuns::from_bytes(&bytes).ok_or_else(|| anyhow!("the probe's page list is malformed"))
}

/// A probe the zygote gave up waiting for (killed, but not gone yet): its end is not a worker's,
/// and the zygote's loop does not report it to the host.
pub(crate) static UNREAPED_PROBE: std::sync::atomic::AtomicI32 =
    std::sync::atomic::AtomicI32::new(0);

/// Waits for the probe for at most a second after its pipe closed or it was killed; a probe
/// that is still there then is left to the zygote's loop, which reaps it without a word.
fn reap_probe(pid: libc::pid_t) -> anyhow::Result<libc::c_int> {
    let until = std::time::Instant::now() + std::time::Duration::from_secs(1);
    loop {
        let mut status = 0;
        // SAFETY: waitpid(2) on our own child with a valid out-pointer.
        let rc = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
        if rc == pid {
            return Ok(status);
        }
        if rc < 0 && nix::errno::Errno::last() != nix::errno::Errno::EINTR {
            return Err(std::io::Error::last_os_error()).context("waiting for the probe");
        }
        if std::time::Instant::now() >= until {
            // SAFETY: our own child, not reaped yet.
            unsafe { libc::kill(pid, libc::SIGKILL) };
            UNREAPED_PROBE.store(pid, std::sync::atomic::Ordering::Relaxed);
            return Err(anyhow!("the probe did not end"));
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

/// The probe child sheds what it does not need of the zygote, as a worker does: it dies with
/// the zygote (and gives up if the zygote is already gone), ends itself past the deadline, keeps
/// no descriptor but its pipe, moved to fd 3 (the host must see the control socket close when
/// the zygote dies), and gets 4 KiB pages like a worker (#132), so its list names the pages a
/// worker writes.
fn detach_probe(zygote: libc::pid_t, pipe: OwnedFd) -> anyhow::Result<OwnedFd> {
    crate::worker::die_with_zygote(nix::unistd::Pid::from_raw(zygote))?;
    // SAFETY: alarm with an integer argument only.
    unsafe { libc::alarm(PROBE_DEADLINE.as_secs() as libc::c_uint) };
    let _ = nix::sys::prctl::set_thp_disable(true);
    crate::worker::move_fd_to(pipe, PROBE_PIPE_FD)?;
    crate::worker::close_fds_from(PROBE_PIPE_FD + 1)?;
    // SAFETY: fd 3 now holds the pipe (dup2 above), and nothing else in this process owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(PROBE_PIPE_FD) })
}

/// Where the probe keeps its pipe: the first number after stdio, like a worker's socket.
const PROBE_PIPE_FD: RawFd = 3;

/// The probe child's work: what a worker does first, the figure, then its own page map.
fn probe_child(
    py: Python<'_>,
    ranges: &[std::ops::Range<usize>],
    write: OwnedFd,
) -> anyhow::Result<()> {
    let runner = py
        .import("sys")
        .and_then(|sys| sys.getattr("modules")?.get_item("_ironcell_runner"))
        .map_err(|e| anyhow!("{e}"))?;
    runner
        .call_method0("worker_after_fork")
        .and_then(|_| {
            release_heap_reserve();
            runner.call_method0("zygote_probe_plot")
        })
        .map_err(|e| anyhow!("drawing: {e}"))?;
    let runs = ironcell_core::prefault::exclusive_pages(ranges).context("reading pagemap")?;
    std::fs::File::from(write)
        .write_all(&runs.to_bytes())
        .context("writing the page list")
}

/// Reads `fd` to its end, for at most `deadline`.
fn read_until_eof(fd: &OwnedFd, deadline: std::time::Duration) -> anyhow::Result<Vec<u8>> {
    use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
    let until = std::time::Instant::now() + deadline;
    let mut out = Vec::new();
    let mut buf = [0u8; 16 * 1024];
    loop {
        let left = until.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            return Err(anyhow!("the probe took over {}s", deadline.as_secs()));
        }
        let ms = PollTimeout::try_from(left.as_millis().min(60_000) as i32 + 1)
            .unwrap_or(PollTimeout::MAX);
        let mut fds = [PollFd::new(fd.as_fd(), PollFlags::POLLIN)];
        match poll(&mut fds, ms) {
            Ok(0) | Err(nix::errno::Errno::EINTR) => continue,
            Ok(_) => {}
            Err(e) => return Err(e.into()),
        }
        match nix::unistd::read(fd, &mut buf) {
            Ok(0) => return Ok(out),
            Ok(n) => out.extend_from_slice(&buf[..n]),
            Err(nix::errno::Errno::EINTR | nix::errno::Errno::EAGAIN) => {}
            Err(e) => return Err(e.into()),
        }
        if out.len() > 16 * ironcell_core::prefault::MAX_PAGES {
            return Err(anyhow!("the probe's page list is too long"));
        }
    }
}

/// In a worker, before its first cell that looks like a plot: writes ahead the pages the
/// zygote's probe plot wrote (`ironcell_core::prefault`). Once per process; returns the pages
/// written, 0 when there is nothing to write (no matplotlib, or the probe failed).
pub(crate) fn write_plot_pages_ahead() -> usize {
    static DONE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if DONE.swap(true, std::sync::atomic::Ordering::Relaxed) {
        return 0;
    }
    let pages = match PLOT_PAGES.get() {
        Some(runs) => ironcell_core::prefault::populate_for_writing(runs).pages,
        None => 0,
    };
    // After the pages are written: freeing writes the chunk headers, which are among them.
    release_heap_reserve();
    pages
}
