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
//! - The main thread asks for the socket when a cell ends ([`Inbox::next_run`]): it writes a
//!   byte to the kick pipe, which wakes the reader thread from `poll`, and the reader gives the
//!   socket back. A `run` that the reader read in the meantime is queued for the main thread.
//! - When the main thread reads a `run`, it gives the socket to the reader before running it.
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
    Main,
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
    fn set_owner(&self, owner: Owner) {
        let mut st = crate::lock(&self.state);
        if st.owner != Owner::Closed {
            st.owner = owner;
        }
        drop(st);
        self.changed.notify_all();
    }

    fn close(&self) {
        crate::lock(&self.state).owner = Owner::Closed;
        self.changed.notify_all();
        crate::bridge::fail_all("the ironcell host closed the session");
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
    /// session. The socket belongs to the reader thread again when this returns a cell.
    pub fn next_run(&mut self) -> Option<RunOrder> {
        let shared = &*self.shared;
        {
            let mut st = crate::lock(&shared.state);
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
                        st.owner = Owner::Reader;
                        drop(st);
                        shared.changed.notify_all();
                    }
                    return Some(run);
                }
                match st.owner {
                    Owner::Main => break,
                    Owner::Closed => return None,
                    Owner::Reader => {
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
                    shared.set_owner(Owner::Reader);
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
                    Owner::Main => {
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
