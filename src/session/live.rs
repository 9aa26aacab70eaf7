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
use futures::{SinkExt, StreamExt};
use nix::sys::signal::Signal;
use tokio::net::unix::OwnedReadHalf;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, oneshot};
use tokio_util::codec::{FramedRead, FramedWrite, LengthDelimitedCodec};
use tokio_util::sync::CancellationToken;

use crate::frame::{self, MAX_INFLIGHT_REQUESTS};
use crate::zygote::{ExitInfo, SpawnedWorker, WorkerProcess};

/// How long to wait for the zygote's report after a worker's socket closed or it was killed.
const EXIT_REPORT_TIMEOUT: Duration = Duration::from_secs(2);

/// Frames queued for the writer: every possible answer, plus a few control frames (`run`).
const OUTBOX_FRAMES: usize = MAX_INFLIGHT_REQUESTS + 4;

/// A frame on its way to the worker. `_slot` is the bridge-request slot its answer used, freed
/// when the writer takes the frame; `_turn`, a turn the answer holds until it is written (the
/// worker's turn for blocking work: see [`LiveWorker::blocking_turn`]).
pub(super) struct Outgoing {
    pub body: Bytes,
    pub _slot: Option<OwnedSemaphorePermit>,
    pub _turn: Option<OwnedSemaphorePermit>,
    /// A descriptor passed with the frame (`SCM_RIGHTS`): a fork's session socket.
    pub pass_fd: Option<std::os::fd::OwnedFd>,
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
        tokio::spawn(write_frames_to_worker(
            FramedWrite::new(write, frame::host_codec()),
            queued,
        ));
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
            own_tasks: None,
            outbox,
            exit: Some(exit),
            requests: Arc::new(Semaphore::new(MAX_INFLIGHT_REQUESTS)),
            _session_slot: session_slot,
            gone: CancellationToken::new(),
            tools_turn: Arc::new(Semaphore::new(1)),
            blocking_turn: Arc::new(Semaphore::new(1)),
            request_values: Arc::new(Semaphore::new(frame::MAX_OPEN_REQUEST_VALUES)),
        })
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
        self.send_passing(body, None)
    }

    /// Queues a frame with a descriptor passed along (a fork's session socket).
    pub fn send_passing(
        &self,
        body: Bytes,
        pass_fd: Option<std::os::fd::OwnedFd>,
    ) -> Result<(), SendError> {
        self.outbox
            .try_send(Outgoing {
                body,
                _slot: None,
                _turn: None,
                pass_fd,
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

    /// After the socket closed: how did the process end? (Killed if it still runs.)
    pub async fn wait_exit(mut self) -> Option<ExitInfo> {
        let rx = self.exit.take()?;
        match tokio::time::timeout(EXIT_REPORT_TIMEOUT, rx).await {
            Ok(Ok(status)) => Some(status),
            Ok(Err(_)) => None, // the zygote went away: no report will come
            Err(_) => {
                // No report in time: make sure, then give up waiting.
                self.process.signal(Signal::SIGKILL);
                None
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

/// The writer task: sends queued frames in order until the queue closes or the socket breaks.
/// Writes one frame (length prefix and body) with `fd` passed on its first byte, after what
/// the sink holds. The socket is non-blocking: each write waits until it is writable.
async fn send_frame_passing(
    sink: &mut FramedWrite<tokio::net::unix::OwnedWriteHalf, LengthDelimitedCodec>,
    body: &[u8],
    fd: std::os::fd::OwnedFd,
) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    SinkExt::<Bytes>::flush(sink).await?;
    let mut bytes = (body.len() as u32).to_be_bytes().to_vec();
    bytes.extend_from_slice(body);
    let stream: &tokio::net::UnixStream = sink.get_ref().as_ref();
    let mut sent = 0;
    let fds = [fd.as_raw_fd()];
    while sent < bytes.len() {
        stream.writable().await?;
        let cmsgs = if sent == 0 {
            vec![nix::sys::socket::ControlMessage::ScmRights(&fds)]
        } else {
            Vec::new()
        };
        let iov = [std::io::IoSlice::new(&bytes[sent..])];
        let tried = stream.try_io(tokio::io::Interest::WRITABLE, || {
            nix::sys::socket::sendmsg::<()>(
                stream.as_raw_fd(),
                &iov,
                &cmsgs,
                nix::sys::socket::MsgFlags::MSG_NOSIGNAL,
                None,
            )
            .map_err(std::io::Error::from)
        });
        match tried {
            Ok(n) => sent += n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

async fn write_frames_to_worker(
    mut sink: FramedWrite<tokio::net::unix::OwnedWriteHalf, LengthDelimitedCodec>,
    mut queued: mpsc::Receiver<Outgoing>,
) {
    while let Some(Outgoing {
        body,
        _slot: slot,
        _turn: turn,
        pass_fd,
    }) = queued.recv().await
    {
        // The request slot frees as its answer leaves the queue, before the write: the worker
        // cannot see the answer (and reuse the slot) before the host counts the slot free, and
        // the queue still holds at most one answer per slot.
        drop(slot);
        if let Some(fd) = pass_fd {
            if let Err(e) = send_frame_passing(&mut sink, &body, fd).await {
                tracing::debug!(error = %e, "writing to a worker failed; it is gone");
                break;
            }
            continue;
        }
        if let Err(e) = sink.send(body).await {
            tracing::debug!(error = %e, "writing to a worker failed; it is gone");
            break;
        }
        drop(turn);
    }
}
