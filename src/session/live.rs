//! The host's handle on one live worker process.
//!
//! The worker is the attacker, so the handle is built so that no path can forget it:
//! - Dropping a [`LiveWorker`] SIGKILLs the process unless the zygote already reported its exit
//!   (the zygote reaps it and reports the status). Every early return, panic or `?` therefore
//!   ends the worker instead of leaving it running outside every limit.
//! - The handle holds the session slot (a permit of the manager's semaphore), so the cap on
//!   live sessions is given back exactly once, when the worker is gone.
//! - Frames to the worker go through a bounded queue to a writer task. The cell loop never
//!   awaits a write, so a worker that stops reading its socket cannot stall timeouts, cancels
//!   or output collection; the queue is bounded because open bridge requests are (each queued
//!   answer holds its request slot).
//! - The work a worker's bridge requests started is cancelled when the handle goes
//!   ([`LiveWorker::gone`]): a worker that queued requests and died leaves nothing running.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;
use nix::sys::signal::Signal;
use tokio::net::unix::OwnedReadHalf;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, oneshot};
use tokio_util::codec::{FramedRead, LengthDelimitedCodec};
use tokio_util::sync::CancellationToken;

use crate::frame::{self, MAX_INFLIGHT_REQUESTS};
use crate::zygote::{ExitInfo, SpawnedWorker, WorkerProcess};

/// How long to wait for the zygote's report after a worker's socket closed or it was killed,
/// before it is SIGKILLed to make sure.
const EXIT_REPORT_TIMEOUT: Duration = Duration::from_secs(2);
/// How much longer the report is waited for then: the zygote reaps between its steps, and one
/// step can take seconds under load (importing matplotlib for the plots' warm-up took over 3 s
/// beside two busy loops, and a worker the memory watch killed then was reported "ended, its
/// exit status unknown" instead of over its memory limit). A zygote that is gone answers at once.
const EXIT_REPORT_PATIENCE: Duration = Duration::from_secs(30);

/// Frames queued for the writer: every possible answer, plus a few control frames (`run`).
const OUTBOX_FRAMES: usize = MAX_INFLIGHT_REQUESTS + 4;

/// A frame on its way to the worker. `_slot` is the bridge-request slot its answer used, freed
/// when the writer takes the frame; `_turn`, a turn the answer holds until it is written (the
/// worker's turn for blocking work: see [`LiveWorker::blocking_turn`]).
pub(super) struct Outgoing {
    pub body: Bytes,
    pub _slot: Option<OwnedSemaphorePermit>,
    pub _turn: Option<OwnedSemaphorePermit>,
    /// Descriptors passed with the frame (`SCM_RIGHTS`): a fork's session socket and pipes.
    pub pass_fds: Vec<std::os::fd::OwnedFd>,
}

/// What is known about whether the worker still runs.
pub(super) enum Liveness {
    Alive,
    Exited(ExitInfo),
    /// The zygote is gone, so nobody can report (or reap) the worker any more; it died with
    /// the zygote through its parent-death signal.
    ZygoteGone,
}

/// What [`LiveWorker::next_frame_or_exit`] got first.
pub(super) enum FrameOrExit {
    /// A frame, an error reading one, or `None` at the end of the stream.
    Frame(Option<std::io::Result<bytes::BytesMut>>),
    /// The zygote reported the worker's end (`None`: the zygote is gone, so no report comes).
    Exited(Option<ExitInfo>),
}

/// Why a frame could not be queued for the worker.
pub(super) enum SendError {
    /// The queue is full: the worker has stopped reading its socket.
    NotReading,
    /// The writer task ended: the socket is broken, the worker is gone.
    Gone,
}

pub(super) struct LiveWorker {
    /// The process, and what signals reach it through (its pidfd where the kernel has them).
    process: WorkerProcess,
    /// Sandbox layers this worker runs without (best-effort mode only).
    pub missing_layers: Vec<String>,
    pub frames: FramedRead<OwnedReadHalf, LengthDelimitedCodec>,
    pub image_budget_bytes: u64,
    /// A pre-forked spare's session, sent with its first `run` (see [`frame::Binding`]).
    pub bind: Option<frame::Binding>,
    /// Its read-only directory of the session's installed packages (`%pip install`), removed
    /// when the last holder lets go.
    pub packages_view: Option<Arc<crate::packages::View>>,
    /// Where this worker's forks of its session live (its Landlock grant; see
    /// docs/ARCHITECTURE.md, "Forking a session"); `None` where it cannot fork.
    pub forks_area: Option<std::path::PathBuf>,
    /// Landlock layers its domain holds (1 from its lockdown, one more per fork on its line).
    pub landlock_layers: u32,
    /// The host's own read ends of its stdout and stderr pipes, passed with its `ready`: what
    /// is left in them is read once the worker is gone (`leftover.rs`).
    pub output_pipes: Option<super::leftover::OutputPipes>,
    /// Its threads at its `ready`, ironcell's own: a fork is refused while it runs others
    /// (`fork_guard.rs`).
    pub own_tasks: Option<super::fork_guard::Tasks>,
    outbox: mpsc::Sender<Outgoing>,
    /// `None` once the zygote's report was taken (or can no longer come).
    exit: Option<oneshot::Receiver<ExitInfo>>,
    /// Slots for bridge requests waiting for their answer.
    requests: Arc<Semaphore>,
    /// This worker's place under the cap on live sessions.
    _session_slot: OwnedSemaphorePermit,
    /// Cancelled when the host lets go of the worker: the work its bridge requests started
    /// (a proxied call, a local tool's run, a wait for the tools catalog) ends with it.
    gone: CancellationToken,
    /// One local-tools request (a call, list, save or delete) at a time per worker: the tools
    /// sessions run one call at a time for everyone, so a worker's requests wait here, not
    /// ahead of other sessions' and the client's own calls in their queue.
    tools_turn: Arc<Semaphore>,
    /// One bridge request doing blocking work (memory file I/O, a wait for the change tracker)
    /// at a time per worker, from its start until its answer is written to the socket: a
    /// worker that stops reading holds one such answer on the host, not one per slot.
    blocking_turn: Arc<Semaphore>,
    /// JSON values the open bridge requests may hold in all ([`frame::MAX_OPEN_REQUEST_VALUES`]).
    request_values: Arc<Semaphore>,
    /// The socket's sending side as the writer task and [`LiveWorker::warm`] share it.
    wire: Arc<std::sync::Mutex<Wire>>,
}

/// What the writer task and [`LiveWorker::warm`] must agree on to write whole frames: each
/// write is one non-blocking `send` made under this lock.
#[derive(Default)]
struct Wire {
    /// The writer task has sent part of a frame (the socket was full): nothing may go between.
    mid_frame: bool,
    /// The rest of a `warm` frame whose `send` was cut short (a small send into a Unix socket
    /// goes whole or not at all, so this stays empty): the writer sends it first.
    warm_rest: Vec<u8>,
}

impl LiveWorker {
    /// Wraps a freshly spawned worker. Must be called inside the tokio runtime.
    pub fn new(
        spawned: SpawnedWorker,
        session_slot: OwnedSemaphorePermit,
        image_budget_bytes: u64,
    ) -> std::io::Result<LiveWorker> {
        let SpawnedWorker {
            process,
            socket,
            exit,
        } = spawned;
        // From here on, an error return drops `guard`, which kills the worker.
        let mut guard = KillOnDrop(Some(process.clone()));
        socket.set_nonblocking(true)?;
        let socket = tokio::net::UnixStream::from_std(socket)?;
        let (read, write) = socket.into_split();
        let reader = LengthDelimitedCodec::builder()
            .length_field_length(4)
            .big_endian()
            .max_frame_length(frame::max_worker_frame_bytes(image_budget_bytes))
            .new_codec();
        let (outbox, queued) = mpsc::channel(OUTBOX_FRAMES);
        let wire = Arc::new(std::sync::Mutex::new(Wire::default()));
        tokio::spawn(write_frames_to_worker(write, wire.clone(), queued));
        guard.0 = None;
        Ok(LiveWorker {
            process,
            missing_layers: Vec::new(),
            frames: FramedRead::new(read, reader),
            image_budget_bytes,
            bind: None,
            packages_view: None,
            forks_area: None,
            landlock_layers: 1,
            output_pipes: None,
            own_tasks: None,
            outbox,
            exit: Some(exit),
            requests: Arc::new(Semaphore::new(MAX_INFLIGHT_REQUESTS)),
            _session_slot: session_slot,
            gone: CancellationToken::new(),
            tools_turn: Arc::new(Semaphore::new(1)),
            blocking_turn: Arc::new(Semaphore::new(1)),
            request_values: Arc::new(Semaphore::new(frame::MAX_OPEN_REQUEST_VALUES)),
            wire,
        })
    }

    /// Tells the worker, waiting between cells, that a request for it is on its way (the
    /// client's line was just read): it brings the code a cell runs back into its caches while
    /// the host parses the request, runs the handler and sends the `run` (docs/PERFORMANCE.md,
    /// "After idle"). Call it only while holding the session's state (no cell runs). One
    /// non-blocking `send` of [`frame::WARM_FRAME`], and only when the worker has read every
    /// byte sent to it before (the socket's send queue is empty): a worker that stops reading
    /// holds one of these at most. Nothing is sent while the writer task is in the middle of a
    /// frame, and nothing is waited for.
    pub fn warm(&self) {
        use std::os::fd::AsRawFd;
        let mut wire = crate::lock(&self.wire);
        if wire.mid_frame || !wire.warm_rest.is_empty() {
            return;
        }
        let sock: &tokio::net::UnixStream = self.frames.get_ref().as_ref();
        let mut unread: libc::c_int = 0;
        // SAFETY: SIOCOUTQ writes one int: the bytes sent on this socket its peer has not read.
        if unsafe { libc::ioctl(sock.as_raw_fd(), libc::TIOCOUTQ, &mut unread) } != 0 || unread != 0
        {
            return;
        }
        let wanted = frame::WARM_FRAME;
        // SAFETY: a plain send(2) of a static buffer on the socket this handle owns.
        let sent = unsafe {
            libc::send(
                sock.as_raw_fd(),
                wanted.as_ptr().cast(),
                wanted.len(),
                libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
            )
        };
        let Ok(sent) = usize::try_from(sent) else {
            return; // a full socket (EAGAIN) or a gone worker: the run finds out
        };
        wire.warm_rest = wanted[sent.min(wanted.len())..].to_vec();
    }

    pub fn pid(&self) -> i32 {
        self.process.pid()
    }

    /// A forked session's worker (see [`WorkerProcess::is_forked`]).
    pub fn is_forked(&self) -> bool {
        self.process.is_forked()
    }

    /// Cancelled when this handle is dropped (the worker is killed or gone).
    pub fn gone(&self) -> CancellationToken {
        self.gone.clone()
    }

    /// Room for a request of `values` JSON values among the open ones; `None` if there is none
    /// now.
    pub fn request_values(&self, values: usize) -> Option<OwnedSemaphorePermit> {
        let n = u32::try_from(values).ok()?;
        self.request_values.clone().try_acquire_many_owned(n).ok()
    }

    /// This worker's turn for local-tools requests (see the field).
    pub fn tools_turn(&self) -> Arc<Semaphore> {
        self.tools_turn.clone()
    }

    /// This worker's turn for bridge requests doing blocking work (see the field).
    pub fn blocking_turn(&self) -> Arc<Semaphore> {
        self.blocking_turn.clone()
    }

    /// Moves the worker under another cap (a spare of the pool becoming a session's worker);
    /// the place it held is given back.
    pub fn move_to_slot(&mut self, slot: OwnedSemaphorePermit) {
        self._session_slot = slot;
    }

    /// Whether the worker's end of the session socket is closed (it died, even if nobody has
    /// reported it yet); a worker that merely wrote something is not "closed".
    pub fn hung_up(&self) -> bool {
        use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
        use std::os::fd::AsFd;
        let sock: &tokio::net::UnixStream = self.frames.get_ref().as_ref();
        let mut fds = [PollFd::new(sock.as_fd(), PollFlags::POLLIN)];
        match poll(&mut fds, PollTimeout::ZERO) {
            Ok(0) => false,
            Ok(_) => fds[0]
                .revents()
                .is_some_and(|r| r.intersects(PollFlags::POLLHUP | PollFlags::POLLERR)),
            Err(_) => true,
        }
    }

    /// Whether the worker still runs, as far as the zygote has told.
    pub fn liveness(&mut self) -> Liveness {
        let Some(rx) = self.exit.as_mut() else {
            return Liveness::ZygoteGone;
        };
        match rx.try_recv() {
            Ok(status) => {
                self.exit = None;
                Liveness::Exited(status)
            }
            Err(oneshot::error::TryRecvError::Empty) => Liveness::Alive,
            Err(oneshot::error::TryRecvError::Closed) => {
                self.exit = None;
                Liveness::ZygoteGone
            }
        }
    }

    /// The worker's next frame, or the zygote's report that it ended, whichever comes first: a
    /// worker whose socket another process still holds (a fork of it before the host's
    /// go-ahead) never reads as closed. The report stays known to [`LiveWorker::liveness`].
    pub async fn next_frame_or_exit(&mut self) -> FrameOrExit {
        let Some(rx) = self.exit.as_mut() else {
            return FrameOrExit::Frame(self.frames.next().await);
        };
        let exited = tokio::select! {
            biased;
            frame = self.frames.next() => return FrameOrExit::Frame(frame),
            exited = rx => exited.ok(),
        };
        self.exit = exited.map(|status| {
            let (tx, rx) = oneshot::channel();
            let _ = tx.send(status);
            rx
        });
        FrameOrExit::Exited(exited)
    }

    pub fn signal(&self, sig: Signal) {
        if self.exit.is_some() {
            self.process.signal(sig);
        }
    }

    /// During setup, before `ready` only: the next whole frame, read with `recvmsg` so that a
    /// descriptor sent with it (the epoll gate's listener) is received, and never a byte past
    /// it, so the frame reader takes over where this stops. Descriptors come back owned (a
    /// frame that should carry none has them closed by the caller dropping them).
    pub async fn next_setup_frame(
        &mut self,
        max_frame: usize,
    ) -> std::io::Result<Option<(bytes::BytesMut, Vec<std::os::fd::OwnedFd>)>> {
        let mut header = [0u8; 4];
        let mut fds = Vec::new();
        if !self.recv_exact(&mut header, &mut fds).await? {
            return Ok(None);
        }
        let len = u32::from_be_bytes(header) as usize;
        if len > max_frame {
            return Err(std::io::Error::other(format!(
                "a setup frame of {len} bytes (at most {max_frame})"
            )));
        }
        let mut body = bytes::BytesMut::zeroed(len);
        if !self.recv_exact(&mut body, &mut fds).await? {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        Ok(Some((body, fds)))
    }

    /// Fills `buf` from the socket with `recvmsg`, collecting descriptors; `false` at a clean
    /// end of stream before the first byte.
    async fn recv_exact(
        &mut self,
        buf: &mut [u8],
        fds: &mut Vec<std::os::fd::OwnedFd>,
    ) -> std::io::Result<bool> {
        use std::os::fd::AsRawFd;
        let sock: &tokio::net::UnixStream = self.frames.get_ref().as_ref();
        let mut filled = 0;
        while filled < buf.len() {
            sock.readable().await?;
            let got = sock.try_io(tokio::io::Interest::READABLE, || {
                let (n, received, _) =
                    ironcell_core::control::recv_with_fds(sock.as_raw_fd(), &mut buf[filled..])?;
                fds.extend(received);
                Ok(n)
            });
            match got {
                Ok(0) if filled == 0 => return Ok(false),
                Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
                Ok(n) => filled += n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
                Err(e) => return Err(e),
            }
        }
        Ok(true)
    }

    /// Queues a frame for the worker without waiting.
    pub fn send(&self, body: Bytes) -> Result<(), SendError> {
        self.send_passing(body, Vec::new())
    }

    /// Queues a frame with descriptors passed along (a fork's session socket and pipes).
    pub fn send_passing(
        &self,
        body: Bytes,
        pass_fds: Vec<std::os::fd::OwnedFd>,
    ) -> Result<(), SendError> {
        self.outbox
            .try_send(Outgoing {
                body,
                _slot: None,
                _turn: None,
                pass_fds,
            })
            .map_err(|e| match e {
                mpsc::error::TrySendError::Full(_) => SendError::NotReading,
                mpsc::error::TrySendError::Closed(_) => SendError::Gone,
            })
    }

    /// A slot for one more open bridge request, if the worker is within its limit.
    pub fn request_slot(&self) -> Option<OwnedSemaphorePermit> {
        self.requests.clone().try_acquire_owned().ok()
    }

    /// Where a proxied call's answer goes (it may outlive the cell that asked).
    pub fn answers(&self) -> mpsc::Sender<Outgoing> {
        self.outbox.clone()
    }

    /// Kills the worker and waits (briefly) for the zygote to confirm it was reaped.
    pub async fn kill(mut self) -> Option<ExitInfo> {
        match self.liveness() {
            Liveness::Exited(status) => return Some(status),
            Liveness::ZygoteGone => return None,
            Liveness::Alive => {}
        }
        self.signal(Signal::SIGKILL);
        self.wait_exit().await
    }

    /// Kills the worker, waits (briefly) for its reaping, then takes the frames it had sent
    /// that were not read yet, at most `max_bytes` of them: they are all in the socket by then
    /// (a worker's children do not hold it), so none is waited for.
    pub async fn kill_then_unread_frames(
        mut self,
        max_bytes: u64,
    ) -> (Option<ExitInfo>, Vec<bytes::BytesMut>) {
        use futures::FutureExt;
        let exit = match self.liveness() {
            Liveness::Exited(status) => Some(status),
            Liveness::ZygoteGone => None,
            Liveness::Alive => {
                self.signal(Signal::SIGKILL);
                self.wait_exit_here().await
            }
        };
        let (mut frames, mut taken) = (Vec::new(), 0u64);
        while taken < max_bytes {
            match self.frames.next().now_or_never() {
                Some(Some(Ok(f))) => {
                    taken += f.len() as u64;
                    frames.push(f);
                }
                _ => break,
            }
        }
        (exit, frames)
    }

    /// After the socket closed: how did the process end? (Killed if it still runs.)
    pub async fn wait_exit(mut self) -> Option<ExitInfo> {
        self.wait_exit_here().await
    }

    async fn wait_exit_here(&mut self) -> Option<ExitInfo> {
        let mut rx = self.exit.take()?;
        match tokio::time::timeout(EXIT_REPORT_TIMEOUT, &mut rx).await {
            Ok(Ok(status)) => Some(status),
            Ok(Err(_)) => None, // the zygote went away: no report will come
            Err(_) => {
                // No report in time: make sure, then wait for the busy zygote's word.
                self.process.signal(Signal::SIGKILL);
                let late = tokio::time::timeout(EXIT_REPORT_PATIENCE, rx).await;
                late.ok().and_then(Result::ok)
            }
        }
    }
}

impl Drop for LiveWorker {
    fn drop(&mut self) {
        self.gone.cancel();
        // Only a worker whose exit was not reported can still run; one the zygote reaped must
        // not be signalled (its pid may belong to someone else by now).
        if let Some(rx) = self.exit.as_mut()
            && matches!(rx.try_recv(), Err(oneshot::error::TryRecvError::Empty))
        {
            tracing::debug!(pid = self.pid(), "killing a worker the host let go of");
            self.process.signal(Signal::SIGKILL);
        }
    }
}

/// Kills a worker on drop unless disarmed: covers the steps between spawn and a full handle.
struct KillOnDrop(Option<WorkerProcess>);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        if let Some(process) = self.0.take() {
            process.signal(Signal::SIGKILL);
        }
    }
}

/// The writer task: sends queued frames in order until the queue closes or the socket breaks,
/// each as length prefix and body, descriptors passed with its first byte.
async fn write_frames_to_worker(
    write: tokio::net::unix::OwnedWriteHalf,
    wire: Arc<std::sync::Mutex<Wire>>,
    mut queued: mpsc::Receiver<Outgoing>,
) {
    let stream: &tokio::net::UnixStream = write.as_ref();
    while let Some(Outgoing {
        body,
        _slot: slot,
        _turn: turn,
        pass_fds,
    }) = queued.recv().await
    {
        // The request slot frees as its answer leaves the queue, before the write: the worker
        // cannot see the answer (and reuse the slot) before the host counts the slot free, and
        // the queue still holds at most one answer per slot.
        drop(slot);
        if body.len() > frame::MAX_FRAME_BYTES {
            tracing::warn!(
                bytes = body.len(),
                "a frame too large for a worker was dropped"
            );
            break;
        }
        let mut bytes = Vec::with_capacity(4 + body.len());
        bytes.extend_from_slice(&(body.len() as u32).to_be_bytes());
        bytes.extend_from_slice(&body);
        if let Err(e) = write_whole(stream, &wire, &bytes, &pass_fds).await {
            tracing::debug!(error = %e, "writing to a worker failed; it is gone");
            break;
        }
        drop(turn);
    }
}

/// Writes `bytes` whole (after the rest of a `warm` frame, if one was cut short), each `send`
/// under the wire's lock, marking the wire mid-frame until the last byte is out. The socket
/// is non-blocking: each write waits until it is writable.
async fn write_whole(
    stream: &tokio::net::UnixStream,
    wire: &std::sync::Mutex<Wire>,
    bytes: &[u8],
    pass_fds: &[std::os::fd::OwnedFd],
) -> std::io::Result<()> {
    use nix::sys::socket::{ControlMessage, MsgFlags, sendmsg};
    use std::os::fd::AsRawFd;
    let fds: Vec<std::os::fd::RawFd> = pass_fds.iter().map(|fd| fd.as_raw_fd()).collect();
    let mut sent = 0;
    while sent < bytes.len() {
        stream.writable().await?;
        let tried = stream.try_io(tokio::io::Interest::WRITABLE, || {
            let mut w = crate::lock(wire);
            let rest = std::mem::take(&mut w.warm_rest);
            let (chunk, from_rest) = if rest.is_empty() {
                (&bytes[sent..], false)
            } else {
                (&rest[..], true)
            };
            let cmsgs: Vec<ControlMessage<'_>> = if !fds.is_empty() && sent == 0 && !from_rest {
                vec![ControlMessage::ScmRights(&fds)]
            } else {
                Vec::new()
            };
            let iov = [std::io::IoSlice::new(chunk)];
            let n = sendmsg::<()>(
                stream.as_raw_fd(),
                &iov,
                &cmsgs,
                MsgFlags::MSG_NOSIGNAL,
                None,
            );
            let n = match n {
                Ok(n) => n,
                Err(e) => {
                    if from_rest {
                        w.warm_rest = rest;
                    }
                    return Err(std::io::Error::from(e));
                }
            };
            if from_rest {
                w.warm_rest = rest[n..].to_vec();
            } else {
                sent += n;
                w.mid_frame = sent < bytes.len();
            }
            Ok(())
        });
        match tried {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}
