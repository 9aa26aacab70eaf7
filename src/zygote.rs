//! The zygote: a clean, exec'd, single-threaded process that holds a warm CPython and forks one
//! worker per session.
//!
//! Why a separate exec'd process rather than forking the host: a fork copies the parent's whole
//! memory, including its initial stack with the environment block, and a worker can read its own
//! memory with ctypes. The host holds the user's environment and the tokens of proxied servers,
//! so workers must descend from a process that never had them. The host starts the zygote by
//! exec'ing its own binary with `env_clear()` and a short allow-list ([`zygote_environment`]).
//!
//! Protocol on the control socket (`SOCK_SEQPACKET`, one JSON message per packet, fd 3 in the
//! zygote): the host sends [`ZygoteRequest::Spawn`] with the worker's end of a fresh session
//! socketpair attached by `SCM_RIGHTS`; the zygote forks, the child becomes the worker
//! ([`crate::worker`]), and the zygote answers [`ZygoteEvent::Spawned`] with the pid. The zygote
//! reaps its children and reports each exit ([`ZygoteEvent::Exited`]), because the host is not
//! their parent and cannot `waitpid` them. Both ends use `PR_SET_PDEATHSIG`: when the host dies
//! the zygote dies, and when the zygote dies every worker dies.

use std::collections::HashMap;
use std::ffi::CString;
use std::fmt;
use std::io::{IoSlice, IoSliceMut};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::lock;

use anyhow::{Context, anyhow, bail};
use nix::sys::socket::{
    AddressFamily, ControlMessage, ControlMessageOwned, MsgFlags, SockFlag, SockType, recvmsg,
    sendmsg, socketpair,
};
use serde::{Deserialize, Serialize};
use tokio::sync::oneshot;

use crate::pybridge::_ironcell_bridge;

/// The fd number the zygote finds its control socket on.
pub const CONTROL_FD: RawFd = 3;

/// The hidden subcommand that turns the binary into a zygote.
pub const ZYGOTE_SUBCOMMAND: &str = "__zygote";

/// Largest control message. Specs and events are small JSON objects.
const MAX_CONTROL_MESSAGE: usize = 64 * 1024;

/// Modules every worker finds already imported (a fork shares them, so they cost nothing per
/// session). Missing ones are skipped.
const WARM_IMPORTS: &[&str] = &[
    "asyncio",
    "base64",
    "collections",
    "csv",
    "dataclasses",
    "datetime",
    "decimal",
    "fractions",
    "functools",
    "hashlib",
    "inspect",
    "io",
    "itertools",
    "json",
    "math",
    "pathlib",
    "pprint",
    "random",
    "re",
    "statistics",
    "string",
    "struct",
    "textwrap",
    "time",
    "typing",
    "urllib.parse",
    "uuid",
];

const RUNNER_SOURCE: &str = include_str!("../python/_ironcell_runner.py");
const MCP_MODULE_SOURCE: &str = include_str!("../python/mcp/__init__.py");

/// What a worker needs to know about its session. Sent by the host, applied by the worker.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct WorkerSpec {
    pub session: String,
    /// The session's scratch directory: cwd, HOME and TMPDIR of the worker.
    pub scratch: PathBuf,
    /// The worker's whole environment. Nothing else from any process reaches it.
    pub env: Vec<(String, String)>,
    /// The lockdown the worker applies to itself before it runs anything.
    pub sandbox: crate::sandbox::SandboxPlan,
    /// The proxied MCP servers the session can call (names and descriptions only; no secrets).
    pub mcp_servers: Vec<serde_json::Value>,
    /// Inline images are downscaled to fit this many bytes.
    pub image_budget_bytes: u64,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum ZygoteRequest {
    Spawn { id: u64, spec: WorkerSpec },
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum ZygoteEvent {
    /// CPython is initialized and warm; the zygote accepts spawn requests.
    Ready {
        python_paths: Vec<PathBuf>,
        python_version: String,
        prefix: String,
        warm_ms: f64,
    },
    Spawned {
        id: u64,
        pid: i32,
    },
    SpawnFailed {
        id: u64,
        message: String,
    },
    Exited {
        pid: i32,
        status: ExitInfo,
    },
}

/// How a worker process ended, as reported by the zygote's `waitpid`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ExitInfo {
    Code(i32),
    Signal(i32),
}

impl fmt::Display for ExitInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            ExitInfo::Code(c) => write!(f, "exited with status {c}"),
            ExitInfo::Signal(s) => {
                let name = nix::sys::signal::Signal::try_from(s)
                    .map(|s| s.as_str().to_string())
                    .unwrap_or_else(|_| format!("signal {s}"));
                write!(f, "was killed by {name}")
            }
        }
    }
}

/// The environment the zygote is exec'd with: nothing from the host but these fixed values.
pub fn zygote_environment() -> Vec<(&'static str, &'static str)> {
    vec![
        ("PATH", "/usr/local/bin:/usr/bin:/bin"),
        ("LANG", "C.UTF-8"),
        ("LC_ALL", "C.UTF-8"),
        ("PYTHONDONTWRITEBYTECODE", "1"),
        ("PYTHONNOUSERSITE", "1"),
        ("PYTHONIOENCODING", "utf-8"),
        // Must be set before numpy/OpenBLAS load: the zygote forks, so it must stay 1 thread.
        ("OPENBLAS_NUM_THREADS", "1"),
        ("OMP_NUM_THREADS", "1"),
        ("MKL_NUM_THREADS", "1"),
        ("MPLBACKEND", "Agg"),
    ]
}

// ---------------------------------------------------------------------------------------------
// The zygote process
// ---------------------------------------------------------------------------------------------

/// Entry point of the `__zygote` subcommand. Never returns while the host lives.
pub fn run_zygote_process(preload: &[String]) -> anyhow::Result<()> {
    // SAFETY: the host placed the control socket at fd 3 before exec; nothing else owns it.
    let ctl = unsafe { OwnedFd::from_raw_fd(CONTROL_FD) };
    set_parent_death_signal()?;
    let started = std::time::Instant::now();
    pyo3::append_to_inittab!(_ironcell_bridge);
    pyo3::Python::initialize();
    pyo3::Python::attach(|py| -> anyhow::Result<()> {
        let (version, prefix, python_paths) = warm_up_interpreter(py, preload)?;
        let ready = ZygoteEvent::Ready {
            python_version: version,
            prefix,
            python_paths,
            warm_ms: started.elapsed().as_secs_f64() * 1000.0,
        };
        send_event(ctl.as_raw_fd(), &ready)?;
        serve_spawn_requests(py, &ctl)
    })
}

fn set_parent_death_signal() -> anyhow::Result<()> {
    // SAFETY: prctl with integer arguments only.
    let rc = unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error()).context("prctl(PR_SET_PDEATHSIG)");
    }
    Ok(())
}

/// Directories of the Python installation a worker must read: stdlib, lib-dynload and
/// site-packages (from sysconfig and sys.path), not the whole prefix (which is /usr on Debian).
const PYTHON_PATHS_SOURCE: &str = r#"
import os, sys, sysconfig
paths = set()
for key in ("stdlib", "platstdlib", "purelib", "platlib"):
    p = sysconfig.get_paths().get(key)
    if p:
        paths.add(p)
for p in sys.path:
    if p and os.path.isabs(p):
        paths.add(p)
result = sorted(os.path.realpath(p) for p in paths if os.path.isdir(p))
"#;

type InterpreterFacts = (String, String, Vec<PathBuf>);

fn warm_up_interpreter(
    py: pyo3::Python<'_>,
    preload: &[String],
) -> anyhow::Result<InterpreterFacts> {
    use pyo3::prelude::*;
    use pyo3::types::PyModule;
    let source = CString::new(RUNNER_SOURCE)?;
    let runner = PyModule::from_code(py, &source, c"_ironcell_runner.py", c"_ironcell_runner")
        .map_err(|e| anyhow!("loading the cell runner: {e}"))?;
    let sys = py.import("sys").map_err(|e| anyhow!("{e}"))?;
    sys.getattr("modules")
        .and_then(|m| m.set_item("_ironcell_runner", &runner))
        .map_err(|e| anyhow!("{e}"))?;
    let source = CString::new(MCP_MODULE_SOURCE)?;
    let mcp = PyModule::from_code(py, &source, c"<ironcell>/mcp/__init__.py", c"mcp")
        .map_err(|e| anyhow!("loading the mcp module: {e}"))?;
    sys.getattr("modules")
        .and_then(|m| m.set_item("mcp", &mcp))
        .map_err(|e| anyhow!("{e}"))?;
    for name in preload
        .iter()
        .map(String::as_str)
        .filter(|n| !n.trim().is_empty())
    {
        match py.import(name.trim()) {
            Ok(_) => tracing::info!(module = name, "preloaded"),
            Err(e) => tracing::warn!(module = name, error = %e, "preload skipped"),
        }
    }
    for name in WARM_IMPORTS {
        if let Err(e) = py.import(*name) {
            tracing::debug!(module = name, error = %e, "warm import skipped");
        }
    }
    // Move everything imported so far into the permanent generation: a forked worker's garbage
    // collections then never touch (and so never copy) the zygote's pages.
    let gc = py.import("gc").map_err(|e| anyhow!("{e}"))?;
    gc.call_method0("collect").map_err(|e| anyhow!("{e}"))?;
    gc.call_method0("freeze").map_err(|e| anyhow!("{e}"))?;
    let version: String = sys
        .getattr("version")
        .and_then(|v| v.extract())
        .map_err(|e| anyhow!("{e}"))?;
    let prefix: String = sys
        .getattr("prefix")
        .and_then(|v| v.extract())
        .map_err(|e| anyhow!("{e}"))?;
    let version = version
        .split_whitespace()
        .next()
        .unwrap_or_default()
        .to_string();
    let globals = pyo3::types::PyDict::new(py);
    let source = CString::new(PYTHON_PATHS_SOURCE)?;
    py.run(&source, Some(&globals), None)
        .map_err(|e| anyhow!("{e}"))?;
    let paths: Vec<String> = globals
        .get_item("result")
        .map_err(|e| anyhow!("{e}"))?
        .map(|v| v.extract())
        .transpose()
        .map_err(|e| anyhow!("{e}"))?
        .unwrap_or_default();
    Ok((
        version,
        prefix,
        paths.into_iter().map(PathBuf::from).collect(),
    ))
}

fn serve_spawn_requests(py: pyo3::Python<'_>, ctl: &OwnedFd) -> anyhow::Result<()> {
    use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
    use nix::sys::signal::{SigSet, Signal};
    use nix::sys::signalfd::{SfdFlags, SignalFd};

    // SIGCHLD arrives through a signalfd so the loop stays single-threaded and synchronous.
    let mut mask = SigSet::empty();
    mask.add(Signal::SIGCHLD);
    mask.thread_block()?;
    let sfd = SignalFd::with_flags(&mask, SfdFlags::SFD_NONBLOCK | SfdFlags::SFD_CLOEXEC)?;
    loop {
        let mut fds = [
            PollFd::new(ctl_borrow(ctl), PollFlags::POLLIN),
            PollFd::new(sfd_borrow(&sfd), PollFlags::POLLIN),
        ];
        match poll(&mut fds, PollTimeout::NONE) {
            Ok(_) => {}
            Err(nix::errno::Errno::EINTR) => continue,
            Err(e) => return Err(e.into()),
        }
        let ctl_ready = fds[0].any().unwrap_or(false);
        let sig_ready = fds[1].any().unwrap_or(false);
        if sig_ready {
            while let Ok(Some(_)) = sfd.read_signal() {}
            report_exited_children(ctl.as_raw_fd())?;
        }
        if ctl_ready {
            let Some((msg, fds)) = recv_message(ctl.as_raw_fd())? else {
                // The host closed the control socket: it is gone or shutting down.
                return Ok(());
            };
            let request: ZygoteRequest = serde_json::from_slice(&msg)?;
            match request {
                ZygoteRequest::Spawn { id, spec } => {
                    let mut fds = fds.into_iter();
                    let Some(session_fd) = fds.next() else {
                        let message = "spawn request carried no session socket".to_string();
                        send_event(ctl.as_raw_fd(), &ZygoteEvent::SpawnFailed { id, message })?;
                        continue;
                    };
                    drop(fds);
                    let event = fork_worker(py, id, spec, session_fd, &mask);
                    send_event(ctl.as_raw_fd(), &event)?;
                }
            }
        }
    }
}

fn ctl_borrow(fd: &OwnedFd) -> std::os::fd::BorrowedFd<'_> {
    use std::os::fd::AsFd;
    fd.as_fd()
}

fn sfd_borrow(fd: &nix::sys::signalfd::SignalFd) -> std::os::fd::BorrowedFd<'_> {
    use std::os::fd::AsFd;
    fd.as_fd()
}

fn fork_worker(
    py: pyo3::Python<'_>,
    id: u64,
    spec: WorkerSpec,
    session_fd: OwnedFd,
    blocked: &nix::sys::signal::SigSet,
) -> ZygoteEvent {
    // SAFETY: the zygote is single-threaded and holds the GIL, so fork copies a consistent
    // interpreter; PyOS_BeforeFork/AfterFork_* take and reset CPython's internal locks and run
    // the `os.register_at_fork` hooks (e.g. `random` reseeds in the child).
    unsafe { pyo3::ffi::PyOS_BeforeFork() };
    // SAFETY: plain fork(2); the child only runs code that is safe after fork of a
    // single-threaded process.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        // SAFETY: in the child, right after fork, with the GIL held by this (only) thread.
        unsafe { pyo3::ffi::PyOS_AfterFork_Child() };
        let _ = blocked.thread_unblock();
        crate::worker::run_worker_process(py, spec, session_fd);
    }
    // SAFETY: in the parent, after fork, with the GIL held.
    unsafe { pyo3::ffi::PyOS_AfterFork_Parent() };
    drop(session_fd);
    if pid < 0 {
        let message = format!("fork failed: {}", std::io::Error::last_os_error());
        return ZygoteEvent::SpawnFailed { id, message };
    }
    ZygoteEvent::Spawned { id, pid }
}

fn report_exited_children(ctl: RawFd) -> anyhow::Result<()> {
    use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
    loop {
        match waitpid(None, Some(WaitPidFlag::WNOHANG)) {
            Ok(WaitStatus::Exited(pid, code)) => {
                let event = ZygoteEvent::Exited {
                    pid: pid.as_raw(),
                    status: ExitInfo::Code(code),
                };
                send_event(ctl, &event)?;
            }
            Ok(WaitStatus::Signaled(pid, sig, _)) => {
                let status = ExitInfo::Signal(sig as i32);
                send_event(
                    ctl,
                    &ZygoteEvent::Exited {
                        pid: pid.as_raw(),
                        status,
                    },
                )?;
            }
            Ok(WaitStatus::StillAlive) | Err(nix::errno::Errno::ECHILD) => return Ok(()),
            Ok(_) => continue,
            Err(nix::errno::Errno::EINTR) => continue,
            Err(e) => return Err(e.into()),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Control-socket messages (both sides)
// ---------------------------------------------------------------------------------------------

fn send_event(ctl: RawFd, event: &ZygoteEvent) -> anyhow::Result<()> {
    send_message(ctl, &serde_json::to_vec(event)?, None)
}

fn send_message(fd: RawFd, body: &[u8], pass_fd: Option<RawFd>) -> anyhow::Result<()> {
    let iov = [IoSlice::new(body)];
    let fds;
    let cmsgs: Vec<ControlMessage<'_>> = match pass_fd {
        Some(f) => {
            fds = [f];
            vec![ControlMessage::ScmRights(&fds)]
        }
        None => Vec::new(),
    };
    loop {
        match sendmsg::<()>(fd, &iov, &cmsgs, MsgFlags::MSG_NOSIGNAL, None) {
            Ok(_) => return Ok(()),
            Err(nix::errno::Errno::EINTR) => continue,
            Err(e) => return Err(e).context("sending on the zygote control socket"),
        }
    }
}

/// Receives one packet and any fds passed with it. `Ok(None)` when the peer has closed.
fn recv_message(fd: RawFd) -> anyhow::Result<Option<(Vec<u8>, Vec<OwnedFd>)>> {
    let mut buf = vec![0u8; MAX_CONTROL_MESSAGE];
    let mut cmsg = nix::cmsg_space!([RawFd; 4]);
    loop {
        let mut iov = [IoSliceMut::new(&mut buf)];
        let msg = match recvmsg::<()>(fd, &mut iov, Some(&mut cmsg), MsgFlags::MSG_CMSG_CLOEXEC) {
            Ok(m) => m,
            Err(nix::errno::Errno::EINTR) => continue,
            Err(e) => return Err(e).context("receiving on the zygote control socket"),
        };
        let mut fds = Vec::new();
        for c in msg.cmsgs()? {
            if let ControlMessageOwned::ScmRights(raw) = c {
                // SAFETY: the kernel just installed these fds in this process for us.
                fds.extend(raw.into_iter().map(|r| unsafe { OwnedFd::from_raw_fd(r) }));
            }
        }
        let n = msg.bytes;
        if n == 0 && fds.is_empty() {
            return Ok(None);
        }
        buf.truncate(n);
        return Ok(Some((buf, fds)));
    }
}

// ---------------------------------------------------------------------------------------------
// The host's handle on the zygote
// ---------------------------------------------------------------------------------------------

/// What the zygote reported once it was warm.
#[derive(Debug, Clone, Serialize)]
pub struct ZygoteInfo {
    pub python_version: String,
    pub prefix: String,
    pub python_paths: Vec<PathBuf>,
    pub warm_ms: f64,
}

/// A worker the zygote forked for the host: its pid, the host's end of its session socket, and
/// a receiver that yields its exit status once the zygote reaped it.
pub struct SpawnedWorker {
    pub pid: i32,
    pub socket: std::os::unix::net::UnixStream,
    pub exit: oneshot::Receiver<ExitInfo>,
}

type SpawnReply = anyhow::Result<(i32, oneshot::Receiver<ExitInfo>)>;

struct Shared {
    pending: Mutex<HashMap<u64, oneshot::Sender<SpawnReply>>>,
    exits: Mutex<HashMap<i32, oneshot::Sender<ExitInfo>>>,
    info: Mutex<Option<Result<ZygoteInfo, String>>>,
    ready: tokio::sync::Notify,
    dead: AtomicBool,
}

/// The host's handle on one running zygote process. Dropping it kills the zygote, and with it
/// (parent-death signal) every worker.
pub struct Zygote {
    child: Mutex<Child>,
    ctl: OwnedFd,
    shared: Arc<Shared>,
    next_id: AtomicU64,
}

impl Zygote {
    /// Exec's `exe` as a zygote with a cleared environment. Returns at once; the interpreter
    /// warms up in the background and spawn requests queue until it is ready.
    pub fn start(exe: &Path, preload: &[String]) -> anyhow::Result<Zygote> {
        let (host_end, zygote_end) = socketpair(
            AddressFamily::Unix,
            SockType::SeqPacket,
            None,
            SockFlag::SOCK_CLOEXEC,
        )
        .context("socketpair for the zygote")?;
        let zygote_raw = zygote_end.as_raw_fd();
        // The zygote's stdout must never be ours: ours is the MCP stream.
        let stderr_dup = std::io::stderr().as_raw_fd();
        // SAFETY: dup of our own stderr fd; the result is owned by the OwnedFd below.
        let out = unsafe { libc::fcntl(stderr_dup, libc::F_DUPFD_CLOEXEC, 3) };
        if out < 0 {
            return Err(std::io::Error::last_os_error()).context("dup stderr for the zygote");
        }
        // SAFETY: `out` is a fresh fd we own.
        let out = unsafe { OwnedFd::from_raw_fd(out) };
        let mut cmd = Command::new(exe);
        cmd.arg(ZYGOTE_SUBCOMMAND);
        if !preload.is_empty() {
            cmd.arg("--preload").arg(preload.join(","));
        }
        cmd.env_clear()
            .envs(zygote_environment())
            .stdin(Stdio::null())
            .stdout(Stdio::from(out))
            .stderr(Stdio::inherit())
            .current_dir("/");
        // SAFETY: between fork and exec only async-signal-safe calls (dup2, fcntl, prctl).
        unsafe {
            cmd.pre_exec(move || {
                if zygote_raw == CONTROL_FD {
                    let flags = libc::fcntl(CONTROL_FD, libc::F_GETFD);
                    if flags < 0
                        || libc::fcntl(CONTROL_FD, libc::F_SETFD, flags & !libc::FD_CLOEXEC) < 0
                    {
                        return Err(std::io::Error::last_os_error());
                    }
                } else if libc::dup2(zygote_raw, CONTROL_FD) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = cmd
            .spawn()
            .with_context(|| format!("starting the zygote ({})", exe.display()))?;
        drop(zygote_end);
        let shared = Arc::new(Shared {
            pending: Mutex::new(HashMap::new()),
            exits: Mutex::new(HashMap::new()),
            info: Mutex::new(None),
            ready: tokio::sync::Notify::new(),
            dead: AtomicBool::new(false),
        });
        let reader_fd = nix::unistd::dup(&host_end).context("dup control socket")?;
        let reader_shared = shared.clone();
        std::thread::Builder::new()
            .name("zygote-events".into())
            .spawn(move || read_zygote_events(reader_fd, reader_shared))
            .context("starting the zygote event thread")?;
        Ok(Zygote {
            child: Mutex::new(child),
            ctl: host_end,
            shared,
            next_id: AtomicU64::new(1),
        })
    }

    /// Whether the zygote process has gone away (it then cannot spawn anything).
    pub fn is_dead(&self) -> bool {
        self.shared.dead.load(Ordering::SeqCst)
    }

    /// Waits until the interpreter is warm; returns what the zygote reported.
    pub async fn ready(&self) -> anyhow::Result<ZygoteInfo> {
        loop {
            let notified = self.shared.ready.notified();
            if let Some(state) = lock(&self.shared.info).clone() {
                return state.map_err(|e| anyhow!(e));
            }
            notified.await;
        }
    }

    /// Forks a worker for `spec`.
    pub async fn spawn_worker(&self, spec: WorkerSpec) -> anyhow::Result<SpawnedWorker> {
        if self.is_dead() {
            bail!("the zygote process is not running");
        }
        let (host_sock, worker_sock) = std::os::unix::net::UnixStream::pair()?;
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        lock(&self.shared.pending).insert(id, tx);
        let body = serde_json::to_vec(&ZygoteRequest::Spawn { id, spec })?;
        let sent = send_message(self.ctl.as_raw_fd(), &body, Some(worker_sock.as_raw_fd()));
        drop(worker_sock);
        if let Err(e) = sent {
            lock(&self.shared.pending).remove(&id);
            return Err(e);
        }
        let (pid, exit) = rx
            .await
            .map_err(|_| anyhow!("the zygote exited during a spawn"))??;
        Ok(SpawnedWorker {
            pid,
            socket: host_sock,
            exit,
        })
    }

    /// Kills the zygote (and, through their parent-death signal, all of its workers).
    pub fn kill(&self) {
        let mut child = lock(&self.child);
        let _ = child.kill();
        let _ = child.wait();
    }

    pub fn pid(&self) -> u32 {
        lock(&self.child).id()
    }
}

impl Drop for Zygote {
    fn drop(&mut self) {
        self.kill();
    }
}

fn read_zygote_events(fd: OwnedFd, shared: Arc<Shared>) {
    let raw = fd.as_raw_fd();
    loop {
        let msg = match recv_message(raw) {
            Ok(Some((msg, _fds))) => msg,
            Ok(None) => break,
            Err(e) => {
                tracing::error!(error = %e, "zygote control socket failed");
                break;
            }
        };
        let event: ZygoteEvent = match serde_json::from_slice(&msg) {
            Ok(e) => e,
            Err(e) => {
                tracing::error!(error = %e, "undecodable zygote event");
                continue;
            }
        };
        match event {
            ZygoteEvent::Ready {
                python_version,
                prefix,
                python_paths,
                warm_ms,
            } => {
                tracing::info!(%python_version, %prefix, warm_ms, "zygote ready");
                *lock(&shared.info) = Some(Ok(ZygoteInfo {
                    python_version,
                    prefix,
                    python_paths,
                    warm_ms,
                }));
                shared.ready.notify_waiters();
            }
            ZygoteEvent::Spawned { id, pid } => {
                // Register the exit slot before anyone can see the pid, so an early exit is
                // never lost (the zygote always reports Spawned before that child's Exited).
                let (tx, rx) = oneshot::channel();
                lock(&shared.exits).insert(pid, tx);
                if let Some(waiter) = lock(&shared.pending).remove(&id) {
                    let _ = waiter.send(Ok((pid, rx)));
                }
            }
            ZygoteEvent::SpawnFailed { id, message } => {
                if let Some(waiter) = lock(&shared.pending).remove(&id) {
                    let _ = waiter.send(Err(anyhow!(message)));
                }
            }
            ZygoteEvent::Exited { pid, status } => {
                tracing::debug!(pid, %status, "worker exited");
                if let Some(tx) = lock(&shared.exits).remove(&pid) {
                    let _ = tx.send(status);
                }
            }
        }
    }
    shared.dead.store(true, Ordering::SeqCst);
    {
        let mut info = lock(&shared.info);
        if info.is_none() {
            *info = Some(Err(
                "the zygote exited before CPython was ready (see the log above)".into(),
            ));
        }
    }
    shared.ready.notify_waiters();
    for (_, waiter) in lock(&shared.pending).drain() {
        let _ = waiter.send(Err(anyhow!("the zygote process exited")));
    }
    // Dropping the senders tells every waiter its worker's status is unknowable now.
    lock(&shared.exits).clear();
    drop(fd);
}
