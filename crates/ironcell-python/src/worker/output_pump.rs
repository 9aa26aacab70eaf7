//! Forwards what the worker writes to fd 1 and fd 2 to the host as `O`/`E` frames.
//!
//! A thread (not the cell's thread) reads the pipes, so a cell that writes more than a pipe
//! holds never blocks on itself. At the end of a cell the main thread takes the pump's lock and
//! drains whatever is left before it sends `done`: the host then knows it has every byte the
//! cell wrote, in order per stream.

use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex};

use anyhow::{Context, anyhow};
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};

use ironcell_core::frame::{self, KIND_STDERR, KIND_STDOUT};

const CHUNK: usize = 64 * 1024;

/// The worker's pump, for [`forward_everything_before_exit`].
static RUNNING: Mutex<Option<Arc<Inner>>> = Mutex::new(None);

/// Before `os._exit` in the worker itself: forwards what is still in the pipes, then keeps the
/// pump's lock until the process is gone. The pump reads a chunk, then sends it: an exit
/// between the two would lose that chunk (the host reads what is left in the pipes, not what a
/// dead pump held: SECURITY.md #277).
pub(crate) fn forward_everything_before_exit() {
    let Some(inner) = crate::lock(&RUNNING).clone() else {
        return;
    };
    let Ok(mut buf) = inner.lock.lock() else {
        return;
    };
    let _ = inner.forward_available(&mut buf);
    // Held until the exit: the pump reads nothing more it could not send.
    std::mem::forget(buf);
}

pub struct OutputPump {
    inner: Arc<Inner>,
}

struct Inner {
    /// Held while reading-and-forwarding, so the drain at the end of a cell cannot interleave;
    /// it guards the one read buffer of this worker (see [`ReadBuffer`]).
    lock: Mutex<ReadBuffer>,
    stdout: OwnedFd,
    stderr: OwnedFd,
    writer: Arc<Mutex<UnixStream>>,
}

impl OutputPump {
    pub fn start(
        stdout: OwnedFd,
        stderr: OwnedFd,
        writer: Arc<Mutex<UnixStream>>,
    ) -> anyhow::Result<OutputPump> {
        for fd in [&stdout, &stderr] {
            let flags = nix::fcntl::fcntl(fd, nix::fcntl::FcntlArg::F_GETFL)?;
            let flags =
                nix::fcntl::OFlag::from_bits_truncate(flags) | nix::fcntl::OFlag::O_NONBLOCK;
            nix::fcntl::fcntl(fd, nix::fcntl::FcntlArg::F_SETFL(flags))?;
        }
        let inner = Arc::new(Inner {
            lock: Mutex::new(ReadBuffer::default()),
            stdout,
            stderr,
            writer,
        });
        *crate::lock(&RUNNING) = Some(inner.clone());
        let pump = OutputPump { inner };
        pump.start_thread()?;
        Ok(pump)
    }

    fn start_thread(&self) -> anyhow::Result<()> {
        let thread_inner = self.inner.clone();
        std::thread::Builder::new()
            .name("output-pump".into())
            .spawn(move || thread_inner.pump_forever())
            .context("starting the output pump thread")?;
        Ok(())
    }

    /// For a fork: the read ends of the pipes it pumps, which the new session replaces with its
    /// own under the same numbers.
    pub(super) fn descriptors(&self) -> [std::os::fd::RawFd; 2] {
        use std::os::fd::AsRawFd;
        [self.inner.stdout.as_raw_fd(), self.inner.stderr.as_raw_fd()]
    }

    /// For a fork: holds the pump's lock across it (the pump thread takes it, then the socket's,
    /// as this does), so the new session's copy is unlocked.
    pub(super) fn hold(&self) -> anyhow::Result<std::sync::MutexGuard<'_, impl Sized>> {
        self.inner
            .lock
            .lock()
            .map_err(|_| anyhow!("output pump lock poisoned"))
    }

    /// In a forked session, whose pipes are its own now: a new pump thread (the parent's did
    /// not come along).
    pub(super) fn restart_after_fork(&self) -> anyhow::Result<()> {
        for fd in [&self.inner.stdout, &self.inner.stderr] {
            let flags = nix::fcntl::fcntl(fd, nix::fcntl::FcntlArg::F_GETFL)?;
            let flags =
                nix::fcntl::OFlag::from_bits_truncate(flags) | nix::fcntl::OFlag::O_NONBLOCK;
            nix::fcntl::fcntl(fd, nix::fcntl::FcntlArg::F_SETFL(flags))?;
        }
        self.start_thread()
    }

    /// Forwards everything still buffered in the pipes, then runs `then` before any newer output
    /// can be forwarded.
    pub fn drain_then<T>(&self, then: impl FnOnce() -> anyhow::Result<T>) -> anyhow::Result<T> {
        let mut buf = self
            .inner
            .lock
            .lock()
            .map_err(|_| anyhow!("output pump lock poisoned"))?;
        self.inner.forward_available(&mut buf)?;
        then()
    }
}

impl Inner {
    fn pump_forever(&self) {
        super::block_signals_on_this_thread();
        loop {
            let mut fds = [
                PollFd::new(self.stdout.as_fd(), PollFlags::POLLIN),
                PollFd::new(self.stderr.as_fd(), PollFlags::POLLIN),
            ];
            match poll(&mut fds, PollTimeout::NONE) {
                Ok(_) | Err(nix::errno::Errno::EINTR) => {}
                Err(_) => return,
            }
            let Ok(mut buf) = self.lock.lock() else {
                return;
            };
            if self.forward_available(&mut buf).is_err() {
                // The host is gone; the worker's main loop will notice and exit.
                return;
            }
        }
    }

    fn forward_available(&self, buf: &mut ReadBuffer) -> anyhow::Result<()> {
        for (fd, kind) in [(&self.stdout, KIND_STDOUT), (&self.stderr, KIND_STDERR)] {
            loop {
                match buf.read(fd) {
                    Ok([]) => break,
                    Ok(data) => {
                        let mut w = self
                            .writer
                            .lock()
                            .map_err(|_| anyhow!("socket lock poisoned"))?;
                        frame::write_frame(&mut *w, kind, data)?;
                    }
                    Err(nix::errno::Errno::EAGAIN) => break,
                    Err(nix::errno::Errno::EINTR) => continue,
                    Err(e) => return Err(e.into()),
                }
            }
        }
        Ok(())
    }
}

/// The worker's one buffer for reading its pipes, allocated on first use and kept: not zeroed
/// (a read writes only what it returns), so an idle worker's memory holds no 64 KiB of zeros
/// and a short print touches one page of it, not sixteen.
#[derive(Default)]
struct ReadBuffer(Vec<u8>);

impl ReadBuffer {
    /// One `read(2)` of at most [`CHUNK`] bytes; the bytes read (empty at end of file).
    fn read(&mut self, fd: &OwnedFd) -> nix::Result<&[u8]> {
        use std::os::fd::AsRawFd;
        if self.0.capacity() < CHUNK {
            self.0 = Vec::with_capacity(CHUNK);
        }
        // SAFETY: the kernel writes at most CHUNK bytes into the vector's spare capacity, which
        // is at least CHUNK bytes long; only the `n` bytes it reports are read back.
        let n = unsafe { libc::read(fd.as_raw_fd(), self.0.as_mut_ptr().cast(), CHUNK) };
        if n < 0 {
            return Err(nix::errno::Errno::last());
        }
        // SAFETY: `n <= CHUNK <= capacity`, and read(2) initialized those `n` bytes.
        Ok(unsafe { std::slice::from_raw_parts(self.0.as_ptr(), n as usize) })
    }
}
