//! Who reads the session socket: the main thread while no cell runs, a reader thread while one
//! does.
//!
//! Answers to the `mcp` module's requests must be read while a cell runs (the cell may be
//! blocked waiting for one), so a reader thread exists. But a `run` frame read by that thread
//! would then have to wake the main thread too: one more cross-CPU wake-up on every run's path,
//! the costliest step of a warm round trip on a small machine. So between cells the main thread
//! reads the socket itself, and it hands the socket to the reader thread when a cell starts:
//!
//! - The socket has one owner at a time ([`Owner`], under a mutex); only the owner reads.
//! - The main thread keeps the socket while a cell runs, until the cell (or a thread it started)
//!   sends the host a request ([`reader_needed`], called by the bridge before it writes one):
//!   only answers to requests arrive while a cell runs, so only then must someone else read. A
//!   cell that asks nothing costs no hand-over at all.
//! - When a cell ends and the reader thread has the socket, the main thread asks for it back
//!   ([`Inbox::next_run`]): it writes a byte to the kick pipe, which wakes the reader thread from
//!   `poll`, and the reader gives the socket back. A `run` that the reader read in the meantime
//!   is queued for the main thread.
//!
//! - A blocking request made by the main thread itself (a cell calling `mcp_x.tool_sync()`)
//!   while nobody reads ([`Owner::MainBusy`]) is waited for by the main thread reading the
//!   socket ([`MainWait`]), so its answer wakes the thread that waits for it instead of the
//!   reader thread, which would then have to wake it. It hands the socket to the reader thread
//!   when it has its answer and other requests are still open (a thread the cell started, an
//!   `asyncio` call), and gives it back otherwise.
//!
//! Frames are dispatched the same way whoever reads them: `run` to the main thread, `response`
//! to the bridge (whose waiters may be Python threads the cell left running).

use std::collections::VecDeque;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use anyhow::Context;
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};

use ironcell_core::frame::{self, KIND_JSON, ToWorker};

/// A cell to run.
pub struct RunOrder {
    pub id: u64,
    pub code: String,
    pub bind: Option<frame::Binding>,
    /// A fork of this session instead of a cell (`code` is empty); its socket came with it.
    pub fork: Option<frame::ForkOrder>,
}

/// What the main thread does next.
pub enum Next {
    /// Boxed: the order is large.
    Run(Box<RunOrder>),
    /// A `warm` frame: a run is on its way ([`ToWorker::Warm`]).
    Warm {
        /// More is already waiting to be read (this thread woke after the host sent the run:
        /// no CPU was free meanwhile): a warm-up would only delay that run.
        run_waiting: bool,
    },
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Owner {
    /// The main thread, waiting for a frame (between cells).
    Main,
    /// The main thread, running a cell: nobody reads until a request makes it [`Owner::Reader`].
    MainBusy,
    /// The main thread, in a blocking request of its own during a cell: it reads until its
    /// answer arrives ([`MainWait`]).
    MainWaiting,
    Reader,
    /// The host closed the socket (or it broke): nobody reads any more.
    Closed,
}

struct State {
    owner: Owner,
    /// `run` frames the reader thread read, in order.
    queued: VecDeque<RunOrder>,
    /// The main thread asked for the socket (a stale kick must not take it from a cell).
    main_wants: bool,
}

struct Shared {
    state: Mutex<State>,
    changed: Condvar,
    kick_r: OwnedFd,
    kick_w: OwnedFd,
    /// The thread that runs cells (and calls [`Inbox::next_run`]).
    main: std::thread::ThreadId,
    /// The reader thread, once it runs (a forked session's is a new one).
    reader: Mutex<Option<std::thread::ThreadId>>,
    /// The reader thread's own copy of the socket (a forked session puts its socket there).
    reader_fd: std::sync::atomic::AtomicI32,
    /// The socket, for the main thread's reads (between cells, and in a [`MainWait`]).
    sock: UnixStream,
}

impl Shared {
    fn close(&self) {
        crate::lock(&self.state).owner = Owner::Closed;
        self.changed.notify_all();
        crate::bridge::fail_all("the ironcell host closed the session");
    }
}

/// The inbox of this process (a worker has one), for [`reader_needed`].
static SHARED: std::sync::OnceLock<Arc<Shared>> = std::sync::OnceLock::new();

/// Called before a request goes to the host: its answer must be read even while the main thread
/// runs a cell, so the reader thread takes the socket then (between cells the main thread reads
/// it, answers included).
pub fn reader_needed() {
    let Some(shared) = SHARED.get() else { return };
    let mut st = crate::lock(&shared.state);
    if st.owner == Owner::MainBusy {
        st.owner = Owner::Reader;
        drop(st);
        shared.changed.notify_all();
    }
}

/// The main thread's side.
pub struct Inbox {
    shared: Arc<Shared>,
}

/// What one frame from the host was.
enum Frame {
    /// Boxed: the order is large, and most frames are answers.
    Run(Box<RunOrder>),
    Warm,
    Other,
    Closed,
}

impl Inbox {
    /// Starts the reader thread (owning nothing yet: the main thread reads first). Call only
    /// after the lockdown: the thread must inherit it.
    pub fn start(sock: &UnixStream) -> anyhow::Result<Inbox> {
        let (kick_r, kick_w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)
            .context("creating the reader's wake-up pipe")?;
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                owner: Owner::Main,
                queued: VecDeque::new(),
                main_wants: false,
            }),
            changed: Condvar::new(),
            kick_r,
            kick_w,
            main: std::thread::current().id(),
            reader: Mutex::new(None),
            reader_fd: std::sync::atomic::AtomicI32::new(-1),
            sock: sock.try_clone().context("cloning the session socket")?,
        });
        let _ = SHARED.set(shared.clone());
        let inbox = Inbox { shared };
        inbox.start_reader()?;
        Ok(inbox)
    }

    /// Starts the reader thread on a copy of the socket.
    fn start_reader(&self) -> anyhow::Result<()> {
        let reader = self
            .shared
            .sock
            .try_clone()
            .context("cloning the session socket")?;
        use std::os::fd::AsRawFd;
        self.shared
            .reader_fd
            .store(reader.as_raw_fd(), std::sync::atomic::Ordering::Relaxed);
        let thread_shared = self.shared.clone();
        std::thread::Builder::new()
            .name("session-reader".into())
            .spawn(move || read_while_a_cell_runs(&thread_shared, reader))
            .context("starting the session reader thread")?;
        Ok(())
    }

    /// For a fork: the descriptors this inbox reads and wakes through (the socket, the reader
    /// thread's copy of it, the wake-up pipe's ends), which the new session replaces with its
    /// own under the same numbers.
    pub(super) fn descriptors(&self) -> [std::os::fd::RawFd; 4] {
        use std::os::fd::AsRawFd;
        let s = &self.shared;
        [
            s.sock.as_raw_fd(),
            s.reader_fd.load(std::sync::atomic::Ordering::Relaxed),
            s.kick_r.as_raw_fd(),
            s.kick_w.as_raw_fd(),
        ]
    }

    /// For a fork: holds the inbox's lock across it, so the new session's copy is unlocked.
    pub(super) fn hold(&self) -> Held<'_> {
        Held(crate::lock(&self.shared.state))
    }

    /// In a forked session, whose descriptors are its own now ([`Inbox::descriptors`]): a new
    /// reader thread (the parent's did not come along) reading its own copy of the socket.
    pub(super) fn restart_reader_after_fork(&self) -> anyhow::Result<()> {
        let old = self
            .shared
            .reader_fd
            .load(std::sync::atomic::Ordering::Relaxed);
        self.start_reader()?;
        if old >= 0 {
            // SAFETY: the old reader's copy, whose thread did not survive the fork.
            unsafe { libc::close(old) };
        }
        Ok(())
    }
}

/// The inbox's lock, held across a fork.
pub(super) struct Held<'a>(#[allow(dead_code)] std::sync::MutexGuard<'a, State>);

impl Inbox {
    /// Blocks (call it without the GIL) until the host sends the next cell, reading the socket
    /// itself once the reader thread has given it back; `None` once the host closed the
    /// session. When this returns a cell, the main thread holds the socket without reading it
    /// ([`Owner::MainBusy`]) until a request needs the reader thread. A `warm` frame read
    /// between cells returns [`Next::Warm`], the socket staying the main thread's; one that the
    /// reader thread reads (it came during a cell) is dropped.
    pub fn next_run(&mut self) -> Option<Next> {
        let shared = &*self.shared;
        {
            let mut st = crate::lock(&shared.state);
            if st.owner == Owner::MainBusy {
                st.owner = Owner::Main;
            }
            if st.owner == Owner::Reader {
                st.main_wants = true;
                drop(st);
                kick(&shared.kick_w);
                st = crate::lock(&shared.state);
            }
            loop {
                if let Some(run) = st.queued.pop_front() {
                    st.main_wants = false;
                    if st.owner == Owner::Main {
                        busy(shared, st);
                    }
                    return Some(Next::Run(Box::new(run)));
                }
                match st.owner {
                    Owner::Main => break,
                    Owner::Closed => return None,
                    Owner::Reader | Owner::MainBusy | Owner::MainWaiting => {
                        st = shared
                            .changed
                            .wait(st)
                            .unwrap_or_else(|poisoned| poisoned.into_inner())
                    }
                }
            }
        }
        loop {
            wait_readable(&shared.sock);
            match read_one(&shared.sock) {
                Frame::Run(run) => {
                    let st = crate::lock(&shared.state);
                    if st.owner == Owner::Main {
                        busy(shared, st);
                    }
                    return Some(Next::Run(run));
                }
                Frame::Warm => {
                    return Some(Next::Warm {
                        run_waiting: readable_now(&shared.sock),
                    });
                }
                Frame::Other => {}
                Frame::Closed => {
                    shared.close();
                    return None;
                }
            }
        }
    }
}

/// The main thread reading the socket while it waits for the answer to a blocking request of
/// its own (see the module docs), under [`Owner::MainWaiting`]; dropping it gives the socket to
/// the reader thread if requests are still open, else back to [`Owner::MainBusy`]. Nested: the
/// thread that already reads (the main thread in such a wait, or the reader thread) doing the
/// same for a blocking request made inside an answer's callback; the owner does not change.
pub struct MainWait {
    shared: Arc<Shared>,
    /// Claimed inside another wait's dispatch (an answer's callback that makes a blocking call
    /// of its own): the outer wait keeps the socket when this one ends.
    nested: bool,
}

/// What [`MainWait::wait`] saw.
pub enum Waited {
    Answer(String),
    /// Nothing yet (time to check for signals).
    Nothing,
    /// The host closed the session (every waiter was told so).
    Closed,
}

impl MainWait {
    /// `Some` if the calling thread is the main thread and nobody reads the socket, or if this
    /// thread already reads it (an outer call's wait, or the reader thread running an answer's
    /// callback): it then reads it itself until [`MainWait`] is dropped. Call before sending
    /// the request (its answer must find a reader).
    pub fn claim() -> Option<MainWait> {
        let shared = SHARED.get()?;
        let me = std::thread::current().id();
        let mut st = crate::lock(&shared.state);
        let nested = match st.owner {
            Owner::MainBusy if me == shared.main => false,
            // This thread already reads (for an outer call, or as the reader thread running an
            // answer's callback): waiting for another reader here would wait forever.
            Owner::MainWaiting if me == shared.main => true,
            Owner::Reader if *crate::lock(&shared.reader) == Some(me) => true,
            _ => return None,
        };
        if !nested {
            st.owner = Owner::MainWaiting;
        }
        Some(MainWait {
            shared: shared.clone(),
            nested,
        })
    }

    /// Reads and dispatches frames for up to `limit`, until `rx` holds an answer. Call it
    /// without the GIL.
    pub fn wait(&self, rx: &std::sync::mpsc::Receiver<String>, limit: Duration) -> Waited {
        let deadline = std::time::Instant::now() + limit;
        loop {
            if let Ok(payload) = rx.try_recv() {
                return Waited::Answer(payload);
            }
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return Waited::Nothing;
            }
            let mut fds = [PollFd::new(self.shared.sock.as_fd(), PollFlags::POLLIN)];
            let ms = u16::try_from(left.as_millis().max(1)).unwrap_or(u16::MAX);
            match poll(&mut fds, PollTimeout::from(ms)) {
                Ok(0) => return Waited::Nothing,
                Ok(_) => {}
                // A signal: let the caller look at it (KeyboardInterrupt).
                Err(nix::errno::Errno::EINTR) => return Waited::Nothing,
                Err(_) => {
                    self.shared.close();
                    return Waited::Closed;
                }
            }
            match read_one(&self.shared.sock) {
                Frame::Run(run) => {
                    // Not sent during a cell; kept for the next `next_run` all the same.
                    crate::lock(&self.shared.state).queued.push_back(*run);
                }
                Frame::Warm | Frame::Other => {}
                Frame::Closed => {
                    self.shared.close();
                    return Waited::Closed;
                }
            }
        }
    }
}

impl Drop for MainWait {
    fn drop(&mut self) {
        if self.nested {
            return; // the outer wait (or the reader thread) still reads
        }
        let st = crate::lock(&self.shared.state);
        if st.owner == Owner::MainWaiting {
            busy(&self.shared, st); // unless the host closed the socket meanwhile
        }
    }
}

/// The main thread is about to run a cell, or back from a [`MainWait`]: it keeps the socket
/// unread, unless a request is still waiting for its answer (a thread asked between cells, or
/// during the wait, while the main thread read the answers itself): then the reader thread
/// takes it now. Checked under the state lock, and
/// the bridge marks a request open before [`reader_needed`], so no answer is left unread.
fn busy(shared: &Shared, mut st: std::sync::MutexGuard<'_, State>) {
    if crate::bridge::has_open_requests() {
        st.owner = Owner::Reader;
        drop(st);
        shared.changed.notify_all();
    } else {
        // No wake-up: the reader thread waits for Owner::Reader either way.
        st.owner = Owner::MainBusy;
    }
}

/// Body of the reader thread: reads and dispatches frames whenever it owns the socket.
fn read_while_a_cell_runs(shared: &Shared, sock: UnixStream) {
    super::block_signals_on_this_thread();
    *crate::lock(&shared.reader) = Some(std::thread::current().id());
    loop {
        {
            let mut st = crate::lock(&shared.state);
            loop {
                match st.owner {
                    Owner::Reader => break,
                    Owner::Closed => return,
                    Owner::Main | Owner::MainBusy | Owner::MainWaiting => {
                        st = shared
                            .changed
                            .wait(st)
                            .unwrap_or_else(|poisoned| poisoned.into_inner())
                    }
                }
            }
        }
        let mut fds = [
            PollFd::new(sock.as_fd(), PollFlags::POLLIN),
            PollFd::new(shared.kick_r.as_fd(), PollFlags::POLLIN),
        ];
        match poll(&mut fds, PollTimeout::NONE) {
            Ok(_) | Err(nix::errno::Errno::EINTR) => {}
            Err(_) => return shared.close(),
        }
        let ready = |fd: &PollFd<'_>| fd.revents().is_some_and(|r| !r.is_empty());
        let (frame_waiting, kicked) = (ready(&fds[0]), ready(&fds[1]));
        if frame_waiting {
            match read_one(&sock) {
                Frame::Run(run) => {
                    crate::lock(&shared.state).queued.push_back(*run);
                    shared.changed.notify_all();
                }
                Frame::Warm | Frame::Other => {}
                Frame::Closed => return shared.close(),
            }
        }
        if kicked {
            take_kick(&shared.kick_r);
            let mut st = crate::lock(&shared.state);
            if st.main_wants && st.owner == Owner::Reader {
                st.main_wants = false;
                st.owner = Owner::Main;
                drop(st);
                shared.changed.notify_all();
            }
        }
    }
}

/// Reads one frame and hands a bridge answer to its waiter.
fn read_one(sock: &UnixStream) -> Frame {
    match frame::read_frame(&mut FdReader(sock)) {
        Ok(Some((KIND_JSON, body))) => match serde_json::from_slice::<ToWorker>(&body) {
            Ok(ToWorker::Run { id, code, bind }) => Frame::Run(Box::new(RunOrder {
                id,
                code,
                bind,
                fork: None,
            })),
            Ok(ToWorker::Fork(order)) => Frame::Run(Box::new(RunOrder {
                id: 0,
                code: String::new(),
                bind: None,
                fork: Some(order),
            })),
            Ok(ToWorker::Warm) => Frame::Warm,
            Ok(ToWorker::Response { id, payload }) => {
                crate::bridge::resolve(id, payload.to_string());
                Frame::Other
            }
            Err(e) => {
                tracing::warn!(error = %e, "ignoring an undecodable frame");
                Frame::Other
            }
        },
        Ok(Some(_)) => Frame::Other,
        Ok(None) | Err(_) => Frame::Closed,
    }
}

/// Waits in `poll` until `sock` has something to read (or hung up), rather than in a blocking
/// `recv`: a thread blocked in `recv` on a Unix socket is also woken each time the host reads
/// what this worker wrote (the kernel wakes the socket's waiters when its send buffer frees),
/// so the `done` of every run woke the idle main thread once more, for nothing, while the host
/// was writing the answer; `poll` sleeps through those wake-ups (it is woken for input only).
fn wait_readable(sock: &UnixStream) {
    loop {
        let mut fds = [PollFd::new(sock.as_fd(), PollFlags::POLLIN)];
        match poll(&mut fds, PollTimeout::NONE) {
            Err(nix::errno::Errno::EINTR) => continue,
            _ => return,
        }
    }
}

/// Whether `sock` has something to read right now.
fn readable_now(sock: &UnixStream) -> bool {
    let mut fds = [PollFd::new(sock.as_fd(), PollFlags::POLLIN)];
    matches!(poll(&mut fds, PollTimeout::ZERO), Ok(n) if n > 0)
}

/// Descriptors the host passed with a frame (a fork's socket and pipes), for
/// [`take_passed_fds`]. Only the last frame's are kept: the host passes them with each `fork`,
/// and the worker asks for them right after.
static PASSED: Mutex<Vec<OwnedFd>> = Mutex::new(Vec::new());

/// The descriptors the host passed with the last frame that had any (a fork's socket, then its
/// output pipes' ends).
pub(super) fn take_passed_fds() -> Vec<OwnedFd> {
    std::mem::take(&mut *crate::lock(&PASSED))
}

/// Reads the session socket with `recvmsg`, so a descriptor the host passes (a fork's socket)
/// is kept, not dropped by a plain `read`.
struct FdReader<'a>(&'a UnixStream);

impl std::io::Read for FdReader<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        use std::os::fd::AsRawFd;
        let (n, fds, _) = ironcell_core::control::recv_with_fds(self.0.as_raw_fd(), buf)?;
        if !fds.is_empty() {
            *crate::lock(&PASSED) = fds;
        }
        Ok(n)
    }
}

fn kick(fd: &OwnedFd) {
    let _ = nix::unistd::write(fd, &[1]);
}

/// Takes one kick's byte (`poll` saw it, so the read does not block). A kick left over from a
/// request the main thread no longer needs wakes the reader once more, to no effect.
fn take_kick(fd: &OwnedFd) {
    let mut byte = [0u8; 1];
    let _ = nix::unistd::read(fd, &mut byte);
}
