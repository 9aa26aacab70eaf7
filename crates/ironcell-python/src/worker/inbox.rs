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
//! Frames are dispatched the same way whoever reads them: `run` to the main thread, `response`
//! to the bridge (whose waiters may be Python threads the cell left running).

use std::collections::VecDeque;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Condvar, Mutex};

use anyhow::Context;
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};

use ironcell_core::frame::{self, KIND_JSON, ToWorker};

/// A cell to run.
pub struct RunOrder {
    pub id: u64,
    pub code: String,
    pub bind: Option<frame::Binding>,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Owner {
    /// The main thread, waiting for a frame (between cells).
    Main,
    /// The main thread, running a cell: nobody reads until a request makes it [`Owner::Reader`].
    MainBusy,
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
    sock: UnixStream,
}

/// What one frame from the host was.
enum Frame {
    Run(RunOrder),
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
        });
        let _ = SHARED.set(shared.clone());
        let reader = sock.try_clone().context("cloning the session socket")?;
        let thread_shared = shared.clone();
        std::thread::Builder::new()
            .name("session-reader".into())
            .spawn(move || read_while_a_cell_runs(&thread_shared, reader))
            .context("starting the session reader thread")?;
        Ok(Inbox {
            shared,
            sock: sock.try_clone().context("cloning the session socket")?,
        })
    }

    /// Blocks (call it without the GIL) until the host sends the next cell, reading the socket
    /// itself once the reader thread has given it back; `None` once the host closed the
    /// session. When this returns a cell, the main thread holds the socket without reading it
    /// ([`Owner::MainBusy`]) until a request needs the reader thread.
    pub fn next_run(&mut self) -> Option<RunOrder> {
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
                    return Some(run);
                }
                match st.owner {
                    Owner::Main => break,
                    Owner::Closed => return None,
                    Owner::Reader | Owner::MainBusy => {
                        st = shared
                            .changed
                            .wait(st)
                            .unwrap_or_else(|poisoned| poisoned.into_inner())
                    }
                }
            }
        }
        loop {
            match read_one(&mut self.sock) {
                Frame::Run(run) => {
                    let st = crate::lock(&shared.state);
                    if st.owner == Owner::Main {
                        busy(shared, st);
                    }
                    return Some(run);
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

/// The main thread is about to run a cell: it keeps the socket unread, unless a request is
/// still waiting for its answer (a thread asked between cells, when the main thread read the
/// answers itself): then the reader thread takes it now. Checked under the state lock, and
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
fn read_while_a_cell_runs(shared: &Shared, mut sock: UnixStream) {
    super::block_sigint_on_this_thread();
    loop {
        {
            let mut st = crate::lock(&shared.state);
            loop {
                match st.owner {
                    Owner::Reader => break,
                    Owner::Closed => return,
                    Owner::Main | Owner::MainBusy => {
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
            match read_one(&mut sock) {
                Frame::Run(run) => {
                    crate::lock(&shared.state).queued.push_back(run);
                    shared.changed.notify_all();
                }
                Frame::Other => {}
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
fn read_one(sock: &mut UnixStream) -> Frame {
    match frame::read_frame(sock) {
        Ok(Some((KIND_JSON, body))) => match serde_json::from_slice::<ToWorker>(&body) {
            Ok(ToWorker::Run { id, code, bind }) => Frame::Run(RunOrder { id, code, bind }),
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

fn kick(fd: &OwnedFd) {
    let _ = nix::unistd::write(fd, &[1]);
}

/// Takes one kick's byte (`poll` saw it, so the read does not block). A kick left over from a
/// request the main thread no longer needs wakes the reader once more, to no effect.
fn take_kick(fd: &OwnedFd) {
    let mut byte = [0u8; 1];
    let _ = nix::unistd::read(fd, &mut byte);
}
