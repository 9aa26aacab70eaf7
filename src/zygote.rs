//! The host's handle on the zygote: the user's own interpreter, exec'd with `-I` and a clean
//! environment, holding a warm CPython and forking one worker per session.
//!
//! Why a separate exec'd process rather than forking the host: a fork copies the parent's whole
//! memory, including its initial stack with the environment block, and a worker can read its own
//! memory with ctypes. The host holds the user's environment and the tokens of proxied servers,
//! so workers must descend from a process that never had them. The host exec's the chosen
//! interpreter ([`crate::python`]) with `env_clear()` and a short allow-list
//! ([`zygote_environment`]), the control socket on fd 3 and ironcell's Python extension —
//! embedded in this binary, handed over as a sealed memfd — on fd 4. The boot script
//! (python/_ironcell_boot.py) loads it; the zygote's own code is in crates/ironcell-python.
//!
//! The control messages are in [`ironcell_core::control`]. The host never runs Python and
//! links no libpython: it always starts, and can say what is wrong with an interpreter.

use std::collections::HashMap;
use std::io::Write;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use anyhow::{Context, anyhow, bail};
use nix::sys::socket::{AddressFamily, SockFlag, SockType, socketpair};
use serde::Serialize;
use tokio::sync::oneshot;

pub use ironcell_core::control::{
    BOOT_FD, CONTROL_FD, EXTENSION_FD, ExitInfo, WorkerSpec, ZygoteEvent, ZygoteRequest,
};
use ironcell_core::control::{recv_message, send_message};

use crate::lock;
use crate::python::Interpreter;

/// ironcell's Python extension (crates/ironcell-python), built and copied here by build.rs.
static EXTENSION: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/libironcell_python.so"));

/// The script the zygote interpreter runs: load the extension from fd 4, call `zygote_main`.
const BOOT_SOURCE: &str = include_str!("../python/_ironcell_boot.py");

/// The state dir's subdirectory where the zygote keeps the runner's and the `mcp` module's
/// compiled code between starts (`code_cache.rs` in ironcell-python; SECURITY.md #211).
pub const CODE_CACHE_DIR: &str = "code-cache";

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

/// `bytes` in a sealed memfd (no write, grow, shrink or re-seal), its offset back at the start:
/// how the extension (loaded from `/proc/self/fd/4`) and the boot script reach the zygote.
/// Nothing is written to disk, and nobody can change either after the seal.
fn sealed_memfd(name: &std::ffi::CStr, bytes: &[u8]) -> anyhow::Result<OwnedFd> {
    use nix::sys::memfd::{MFdFlags, memfd_create};
    use std::io::Seek;
    let fd = memfd_create(name, MFdFlags::MFD_CLOEXEC | MFdFlags::MFD_ALLOW_SEALING)
        .with_context(|| format!("memfd_create for {name:?}"))?;
    let mut file = std::fs::File::from(fd);
    file.write_all(bytes)
        .and_then(|()| file.rewind())
        .with_context(|| format!("writing {name:?} to its memfd"))?;
    // F_SEAL_FUTURE_WRITE (Linux 5.1) first: it forbids every later write and writable mapping,
    // which is all we need: the memfd was never mapped and nobody else holds it yet.
    // F_SEAL_WRITE adds a check for pages with extra references, and the kernel gives up with
    // EBUSY after ~150 ms when page-cache batches or compaction hold one (seen on a loaded CI
    // machine). Kernels before 5.1 reject the unknown seal with EINVAL: they get F_SEAL_WRITE,
    // retried a few times on EBUSY.
    let base = libc::F_SEAL_SEAL | libc::F_SEAL_SHRINK | libc::F_SEAL_GROW;
    let add_seals = |write_seal: libc::c_int| {
        // SAFETY: fcntl on an fd we own, integer arguments only.
        if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, base | write_seal) } == 0 {
            Ok(())
        } else {
            Err(std::io::Error::last_os_error())
        }
    };
    let mut sealed = add_seals(libc::F_SEAL_FUTURE_WRITE);
    if sealed
        .as_ref()
        .is_err_and(|e| e.raw_os_error() == Some(libc::EINVAL))
    {
        sealed = add_seals(libc::F_SEAL_WRITE);
        for _ in 0..4 {
            if !sealed
                .as_ref()
                .is_err_and(|e| e.raw_os_error() == Some(libc::EBUSY))
            {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
            sealed = add_seals(libc::F_SEAL_WRITE);
        }
    }
    sealed.with_context(|| format!("sealing {name:?}"))?;
    Ok(OwnedFd::from(file))
}

/// What `python -I -c` runs: read the boot script from [`BOOT_FD`], close it, run it (the
/// script itself would fill the zygote's command line in `ps`). Valid in any Python, so even a
/// far too old one gets the boot script's own message.
const BOOT_LOADER: &str =
    "import os;_b=os.read(5,1<<20);os.close(5);exec(compile(_b,'ironcell-boot','exec'))";

// ---------------------------------------------------------------------------------------------
// The host's handle on the zygote
// ---------------------------------------------------------------------------------------------

/// What the zygote reported once it was warm.
#[derive(Debug, Clone, Serialize)]
pub struct ZygoteInfo {
    pub python_version: String,
    pub prefix: String,
    pub base_prefix: String,
    pub executable: String,
    pub site_packages: Vec<PathBuf>,
    pub python_paths: Vec<PathBuf>,
    pub warm_ms: f64,
}

/// A worker the zygote forked for the host: its process, the host's end of its session socket, and
/// a receiver that yields its exit status once the zygote reaped it.
pub struct SpawnedWorker {
    pub process: WorkerProcess,
    pub socket: std::os::unix::net::UnixStream,
    pub exit: oneshot::Receiver<ExitInfo>,
}

/// What signals reach a worker through: its pidfd, which the zygote opened before it could
/// reap the worker, so a signal never reaches another process that got the pid after the
/// worker was reaped (`ESRCH` then); its pid where the kernel has no pidfds.
#[derive(Debug, Clone)]
pub struct WorkerProcess {
    pid: i32,
    pidfd: Option<Arc<OwnedFd>>,
    /// A forked session's worker ([`Zygote::adopt`]): its memory is counted by its share
    /// (PSS), since much of it is shared copy-on-write with the session it was forked from.
    forked: bool,
}

impl WorkerProcess {
    pub fn pid(&self) -> i32 {
        self.pid
    }

    pub fn is_forked(&self) -> bool {
        self.forked
    }

    /// Whether it has ended (its pidfd is readable); `false` without a pidfd.
    pub fn has_ended(&self) -> bool {
        let Some(fd) = &self.pidfd else { return false };
        let mut fds = [nix::poll::PollFd::new(
            std::os::fd::AsFd::as_fd(&**fd),
            nix::poll::PollFlags::POLLIN,
        )];
        nix::poll::poll(&mut fds, nix::poll::PollTimeout::ZERO).is_ok_and(|n| n > 0)
    }

    /// The same process handle (its pidfd), not merely the same pid.
    pub(crate) fn is(&self, other: &WorkerProcess) -> bool {
        self.pid == other.pid
            && match (&self.pidfd, &other.pidfd) {
                (Some(a), Some(b)) => Arc::ptr_eq(a, b),
                (None, None) => true,
                _ => false,
            }
    }

    /// Sends `sig`; whether it was delivered (false once the worker is gone).
    pub fn signal(&self, sig: nix::sys::signal::Signal) -> bool {
        match &self.pidfd {
            Some(fd) => {
                // SAFETY: pidfd_send_signal(2) on a pidfd we own, with no siginfo.
                let rc = unsafe {
                    libc::syscall(
                        libc::SYS_pidfd_send_signal,
                        fd.as_raw_fd(),
                        sig as libc::c_int,
                        std::ptr::null::<libc::siginfo_t>(),
                        0,
                    )
                };
                rc == 0
            }
            None => nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.pid), sig).is_ok(),
        }
    }
}

type SpawnReply = anyhow::Result<(WorkerProcess, oneshot::Receiver<ExitInfo>)>;

/// What the zygote reported after a [`ZygoteRequest::WarmPlots`].
#[derive(Debug, Clone)]
pub struct PlotWarmUp {
    /// Whether `matplotlib.pyplot` is imported in the zygote now (so in every later worker).
    pub pyplot: bool,
    pub message: String,
    /// How long the zygote spent on it, spawn requests waiting.
    pub ms: f64,
}

struct Shared {
    pending: Mutex<HashMap<u64, oneshot::Sender<SpawnReply>>>,
    exits: Mutex<HashMap<i32, (oneshot::Sender<ExitInfo>, WorkerProcess)>>,
    /// Workers the memory watch killed ([`Zygote::kill_for_memory`]), with what their exit
    /// report becomes.
    over_memory: Mutex<HashMap<i32, ExitInfo>>,
    /// Who waits for the answers to `warm_plots` requests, in the order they were sent.
    plot_warm_ups: Mutex<std::collections::VecDeque<oneshot::Sender<PlotWarmUp>>>,
    info: Mutex<Option<Result<ZygoteInfo, String>>>,
    ready: tokio::sync::Notify,
    dead: AtomicBool,
    /// The interpreter this zygote runs, for error messages.
    python: Interpreter,
    /// Where root workers make their pids cgroups: each one's group is removed when the zygote
    /// reports it reaped.
    pids_groups: Option<PathBuf>,
    /// Where root workers make their memory cgroups (one per lineage: SECURITY.md #271).
    memory_groups: Option<crate::sandbox::memcg::MemoryGroups>,
    /// The last lines the zygote wrote to stderr (passed on to ours as they come): what an
    /// interpreter that dies before it is ready has to say.
    stderr_tail: Mutex<String>,
}

/// How much of the zygote's stderr is kept for error messages.
const STDERR_TAIL_BYTES: usize = 2048;

/// Copies the zygote's stderr to ours, line by line, keeping the tail.
fn forward_stderr(from: std::process::ChildStderr, shared: Arc<Shared>) {
    use std::io::BufRead;
    let mut reader = std::io::BufReader::new(from);
    let mut line = Vec::new();
    loop {
        line.clear();
        match reader.read_until(b'\n', &mut line) {
            Ok(0) | Err(_) => return,
            Ok(_) => {
                let _ = std::io::stderr().write_all(&line);
                let mut tail = lock(&shared.stderr_tail);
                tail.push_str(&String::from_utf8_lossy(&line));
                if tail.len() > STDERR_TAIL_BYTES {
                    let mut cut = tail.len() - STDERR_TAIL_BYTES;
                    while !tail.is_char_boundary(cut) {
                        cut += 1;
                    }
                    tail.drain(..cut);
                }
            }
        }
    }
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
    /// Exec's the chosen interpreter as a zygote with a cleared environment. Returns at once; the interpreter
    /// warms up in the background and spawn requests queue until it is ready.
    ///
    /// Long on purpose: the exec's preparation in order (socket, memfds, stderr, environment,
    /// descriptors), each of which the child needs.
    pub fn start(
        python: &Interpreter,
        preload: &[String],
        log_filter: &str,
        groups: &crate::sandbox::cgroup::WorkerGroups,
        code_cache: &Path,
    ) -> anyhow::Result<Zygote> {
        let (host_end, zygote_end) = socketpair(
            AddressFamily::Unix,
            SockType::SeqPacket,
            None,
            SockFlag::SOCK_CLOEXEC,
        )
        .context("socketpair for the zygote")?;
        let extension = sealed_memfd(c"ironcell-python", EXTENSION)?;
        let boot = sealed_memfd(c"ironcell-boot", BOOT_SOURCE.as_bytes())?;
        let zygote_raw = zygote_end.as_raw_fd();
        let extension_raw = extension.as_raw_fd();
        let boot_raw = boot.as_raw_fd();
        // The zygote's stdout must never be ours: ours is the MCP stream.
        let stderr_dup = std::io::stderr().as_raw_fd();
        // SAFETY: dup of our own stderr fd; the result is owned by the OwnedFd below.
        let out = unsafe { libc::fcntl(stderr_dup, libc::F_DUPFD_CLOEXEC, 3) };
        if out < 0 {
            return Err(std::io::Error::last_os_error()).context("dup stderr for the zygote");
        }
        // SAFETY: `out` is a fresh fd we own.
        let out = unsafe { OwnedFd::from_raw_fd(out) };
        let mut cmd = Command::new(&python.executable);
        cmd.arg("-I")
            .arg("-c")
            .arg(BOOT_LOADER)
            .arg(preload.join(","))
            .arg(log_filter)
            .arg(code_cache)
            .env_clear()
            .envs(zygote_environment())
            .stdin(Stdio::null())
            .stdout(Stdio::from(out))
            .stderr(Stdio::piped())
            .current_dir("/");
        let fds = [zygote_raw, extension_raw, boot_raw];
        // SAFETY: between fork and exec the closure makes only async-signal-safe calls
        // (fcntl, dup2, prctl) and allocates nothing.
        unsafe { cmd.pre_exec(move || place_zygote_fds(fds)) };
        let mut child = cmd
            .spawn()
            .with_context(|| format!("starting the zygote ({})", python.executable.display()))?;
        drop(extension);
        drop(boot);
        drop(zygote_end);
        let shared = Arc::new(Shared {
            pending: Mutex::new(HashMap::new()),
            exits: Mutex::new(HashMap::new()),
            over_memory: Mutex::new(HashMap::new()),
            plot_warm_ups: Mutex::new(std::collections::VecDeque::new()),
            info: Mutex::new(None),
            ready: tokio::sync::Notify::new(),
            dead: AtomicBool::new(false),
            python: python.clone(),
            pids_groups: groups.pids.clone(),
            memory_groups: groups.memory.clone(),
            stderr_tail: Mutex::new(String::new()),
        });
        if let Some(stderr) = child.stderr.take() {
            let stderr_shared = shared.clone();
            std::thread::Builder::new()
                .name("zygote-stderr".into())
                .spawn(move || forward_stderr(stderr, stderr_shared))
                .context("starting the zygote stderr thread")?;
        }
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

    /// Whether the zygote process has gone away (it then cannot spawn anything, and its
    /// workers are dying). Asks the process itself too: it has exited (and sent its workers
    /// their parent-death signal) before the event thread may have read the end of its socket,
    /// and a spare handed to a session in between would die under the session's first cell.
    pub fn is_dead(&self) -> bool {
        if self.shared.dead.load(Ordering::SeqCst) {
            return true;
        }
        // waitpid(WNOHANG) (the status is kept once reaped): the zygote is our child and
        // nothing else reaps it; an error (no such child) means it is gone as well.
        lock(&self.child)
            .try_wait()
            .map_or(true, |status| status.is_some())
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
        let body = serde_json::to_vec(&ZygoteRequest::Spawn {
            id,
            spec: Box::new(spec),
        })?;
        let sent = send_message(self.ctl.as_raw_fd(), &body, &[worker_sock.as_raw_fd()]);
        drop(worker_sock);
        if let Err(e) = sent {
            lock(&self.shared.pending).remove(&id);
            return Err(e);
        }
        let (process, exit) = rx
            .await
            .map_err(|_| anyhow!("the zygote exited during a spawn"))??;
        Ok(SpawnedWorker {
            process,
            socket: host_sock,
            exit,
        })
    }

    /// Asks the zygote to import matplotlib and pyplot with `font_cache_dir` (the shared font
    /// cache) as `MPLCONFIGDIR` and freeze them, so every worker forked after it starts with
    /// them. Returns once the request is sent; the receiver yields the zygote's report (an error
    /// if the zygote dies first). The zygote handles requests in order, so spawn requests sent
    /// after this one are forked from the warmed interpreter; they wait while it warms up.
    pub fn warm_plots(
        &self,
        font_cache_dir: &std::path::Path,
    ) -> anyhow::Result<oneshot::Receiver<PlotWarmUp>> {
        if self.is_dead() {
            bail!("the zygote process is not running");
        }
        let body = serde_json::to_vec(&ZygoteRequest::WarmPlots {
            font_cache_dir: font_cache_dir.to_path_buf(),
        })?;
        let (tx, rx) = oneshot::channel();
        // Queued before the send: the reader thread may see the answer before send returns.
        let mut waiting = lock(&self.shared.plot_warm_ups);
        waiting.push_back(tx);
        if let Err(e) = send_message(self.ctl.as_raw_fd(), &body, &[]) {
            waiting.pop_back();
            return Err(e);
        }
        Ok(rx)
    }

    /// The zygote's process id.
    pub fn pid(&self) -> i32 {
        lock(&self.child).id() as i32
    }

    /// Takes process `pid`, whose `pidfd` the caller opened after checking that it is a forked
    /// session's worker (the zygote's child, leading its own process group:
    /// `session::fork`), as one of this zygote's workers: listed as live, its exit reported
    /// to the returned receiver once the zygote reaps it (it is the zygote's child).
    pub fn adopt(
        &self,
        pid: i32,
        pidfd: OwnedFd,
    ) -> anyhow::Result<(WorkerProcess, oneshot::Receiver<ExitInfo>)> {
        let process = WorkerProcess {
            pid,
            pidfd: Some(Arc::new(pidfd)),
            forked: true,
        };
        let (tx, rx) = oneshot::channel();
        let mut exits = lock(&self.shared.exits);
        if exits.contains_key(&pid) {
            bail!("process {pid} is a worker already");
        }
        exits.insert(pid, (tx, process.clone()));
        drop(exits);
        if process.has_ended() {
            // Reaped before it was listed: its report found no one and will not come again.
            lock(&self.shared.exits).remove(&pid);
            bail!("the fork ended before the host took it");
        }
        Ok((process, rx))
    }

    /// The workers this zygote forked and has not reported gone (spares included).
    pub fn live_workers(&self) -> Vec<WorkerProcess> {
        lock(&self.shared.exits)
            .values()
            .map(|(_, process)| process.clone())
            .collect()
    }

    /// SIGKILLs `worker` for holding too much memory, if the zygote still lists that very
    /// process as live (checked under the lock its exit report takes, and by its pidfd, so
    /// neither a worker already reported gone nor a newer one that got its pid is hit); its
    /// exit report then says why. Returns whether it was signalled.
    pub fn kill_for_memory(&self, worker: &WorkerProcess, why: ExitInfo) -> bool {
        let exits = lock(&self.shared.exits);
        let Some((_, listed)) = exits.get(&worker.pid) else {
            return false;
        };
        if !listed.is(worker) {
            return false;
        }
        lock(&self.shared.over_memory).insert(worker.pid, why);
        worker.signal(nix::sys::signal::Signal::SIGKILL)
    }

    /// Kills the zygote (and, through their parent-death signal, all of its workers), then
    /// removes the pids groups of the workers it had not reported gone, as they exit (waiting a
    /// second at most: what is left then, the next server's start removes).
    pub fn kill(&self) {
        // Taken first: once the zygote is gone, the event thread forgets its workers.
        let live: Vec<i32> = lock(&self.shared.exits).keys().copied().collect();
        // Their children first (SECURITY.md #159): each worker leads the process group its
        // children cannot leave, and once the zygote is gone no one would reap the workers'
        // orphans or kill their groups. Not yet reported gone, a worker's pid is its own.
        for &pid in &live {
            let _ = nix::sys::signal::killpg(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
        let mut child = lock(&self.child);
        let _ = child.kill();
        let _ = child.wait();
        drop(child);
        let parents = [
            self.shared.pids_groups.as_deref(),
            self.shared
                .memory_groups
                .as_ref()
                .map(|g| g.parent.as_path()),
        ];
        for parent in parents.into_iter().flatten() {
            crate::sandbox::cgroup::remove_groups_once_empty(
                parent,
                live.clone(),
                std::time::Duration::from_secs(1),
            );
        }
    }
}

impl Drop for Zygote {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The host's reader of the zygote's control socket: spawn answers, exits, warm-up reports.
///
/// Long on purpose: the reader thread's loop over the zygote's events, one short arm per event.
fn read_zygote_events(fd: OwnedFd, shared: Arc<Shared>) {
    // Workers of an earlier zygote (or server) that died took theirs along unreported.
    if let Some(parent) = &shared.pids_groups {
        crate::sandbox::cgroup::remove_groups_of_gone_workers(parent);
    }
    if let Some(groups) = &shared.memory_groups {
        crate::sandbox::memcg::remove_groups_of_gone_workers(&groups.parent);
    }
    let raw = fd.as_raw_fd();
    let mut buf = Vec::new();
    loop {
        let (msg, mut fds) = match recv_message(raw, &mut buf) {
            Ok(Some((msg, fds))) => (msg, fds),
            Ok(None) => break,
            Err(e) => {
                tracing::error!(error = %e, "zygote control socket failed");
                break;
            }
        };
        let event: ZygoteEvent = match serde_json::from_slice(msg) {
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
                base_prefix,
                executable,
                site_packages,
                python_paths,
                warm_ms,
            } => {
                tracing::info!(%python_version, %prefix, warm_ms, "zygote ready");
                *lock(&shared.info) = Some(Ok(ZygoteInfo {
                    python_version,
                    prefix,
                    base_prefix,
                    executable,
                    site_packages,
                    python_paths: crate::python::readable_grants(python_paths),
                    warm_ms,
                }));
                shared.ready.notify_waiters();
            }
            ZygoteEvent::Failed { message } => {
                tracing::error!(%message, "the zygote cannot run this interpreter");
                let tail = lock(&shared.stderr_tail).clone();
                let text = crate::python::explain_boot_failure(&shared.python, &message, &tail);
                *lock(&shared.info) = Some(Err(text));
                shared.ready.notify_waiters();
            }
            ZygoteEvent::Spawned { id, pid } => {
                // Register the exit slot before anyone can see the pid, so an early exit is
                // never lost (the zygote always reports Spawned before that child's Exited).
                let (tx, rx) = oneshot::channel();
                let process = WorkerProcess {
                    pid,
                    pidfd: (!fds.is_empty()).then(|| Arc::new(fds.swap_remove(0))),
                    forked: false,
                };
                lock(&shared.exits).insert(pid, (tx, process.clone()));
                if let Some(waiter) = lock(&shared.pending).remove(&id) {
                    let _ = waiter.send(Ok((process, rx)));
                }
            }
            ZygoteEvent::SpawnFailed { id, message } => {
                if let Some(waiter) = lock(&shared.pending).remove(&id) {
                    let _ = waiter.send(Err(anyhow!(message)));
                }
            }
            ZygoteEvent::Exited { pid, status } => {
                tracing::debug!(pid, %status, "worker exited");
                if let Some(parent) = &shared.pids_groups
                    && !crate::sandbox::cgroup::remove_group_of(parent, pid)
                {
                    remove_group_once_empty(parent.clone(), pid);
                }
                // Killed by the kernel's OOM killer in its memory group (a machine-wide OOM:
                // at the group's own limit the memory watch ends it, SECURITY.md #274-#275)?
                let oom_peak = (shared.memory_groups.as_ref())
                    .and_then(|g| crate::sandbox::memcg::worker_gone(g, pid).map(|p| (p, g)));
                let killed_for = lock(&shared.over_memory).remove(&pid).or_else(|| {
                    oom_peak.map(|(peak, g)| ExitInfo::OverMemory {
                        held_mib: peak >> 20,
                        limit_mib: g.limit_bytes >> 20,
                    })
                });
                let status = match killed_for {
                    Some(why) if status == ExitInfo::Signal(libc::SIGKILL) => why,
                    _ => status,
                };
                if let Some((tx, _)) = lock(&shared.exits).remove(&pid) {
                    let _ = tx.send(status);
                }
            }
            ZygoteEvent::PlotsWarmed {
                pyplot,
                message,
                ms,
            } => {
                let report = PlotWarmUp {
                    pyplot,
                    message,
                    ms,
                };
                if let Some(waiter) = lock(&shared.plot_warm_ups).pop_front() {
                    let _ = waiter.send(report);
                }
            }
        }
    }
    shared.dead.store(true, Ordering::SeqCst);
    {
        let mut info = lock(&shared.info);
        if info.is_none() {
            // Give the stderr thread a moment to catch the interpreter's last words.
            std::thread::sleep(std::time::Duration::from_millis(50));
            let tail = lock(&shared.stderr_tail).clone();
            *info = Some(Err(crate::python::explain_boot_failure(
                &shared.python,
                "it exited before it was ready",
                &tail,
            )));
        }
    }
    shared.ready.notify_waiters();
    for (_, waiter) in lock(&shared.pending).drain() {
        let _ = waiter.send(Err(anyhow!("the zygote process exited")));
    }
    // Dropping the senders tells every waiter its worker's status is unknowable now.
    lock(&shared.exits).clear();
    lock(&shared.plot_warm_ups).clear();
    drop(fd);
}

/// How long a reaped worker's pids group is waited for to empty (its last tasks being killed).
const GROUP_PATIENCE: std::time::Duration = std::time::Duration::from_secs(10);

/// Removes the pids group of reaped worker `pid` once it is empty, off the events thread: at its
/// exit report it still held tasks (a fork of it not yet in a group of its own, a child of its
/// session being killed), which the host is ending. One left after [`GROUP_PATIENCE`], the next
/// zygote's start removes. Rare (a worker reaped mid-fork or mid-kill), so a thread each.
fn remove_group_once_empty(parent: PathBuf, pid: i32) {
    tracing::debug!(pid, "pids group not removed yet: it still has tasks");
    let removing = move || {
        crate::sandbox::cgroup::remove_groups_once_empty(&parent, vec![pid], GROUP_PATIENCE)
    };
    if let Err(e) = std::thread::Builder::new()
        .name("pids-group".into())
        .spawn(removing)
    {
        tracing::debug!(pid, "pids group left to the next zygote's start: {e}");
    }
}

/// In the zygote's child between fork and exec (async-signal-safe calls only): moves the
/// control socket, the extension and the boot script out of the way first (any may already sit
/// on 3, 4 or 5), then onto 3, 4 and 5 (dup2 leaves the copies without FD_CLOEXEC, so they
/// survive exec), and asks for SIGKILL when the host dies.
fn place_zygote_fds(fds: [RawFd; 3]) -> std::io::Result<()> {
    let targets = [CONTROL_FD, EXTENSION_FD, BOOT_FD];
    let mut moved = [-1; 3];
    for (m, fd) in moved.iter_mut().zip(fds) {
        // SAFETY: fcntl(F_DUPFD_CLOEXEC) on a descriptor this process holds open.
        *m = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 10) };
        if *m < 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    for (fd, target) in moved.into_iter().zip(targets) {
        // SAFETY: dup2 of a descriptor this process holds onto a fixed number it hands to the
        // interpreter it is about to exec.
        if unsafe { libc::dup2(fd, target) } < 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGKILL)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    #[test]
    fn a_signal_reaches_the_pidfds_process_never_another_that_got_its_pid() {
        let mut gone = Command::new("sleep").arg("100").spawn().unwrap();
        // SAFETY: pidfd_open(2) of our own child; the fd is owned below.
        let raw = unsafe { libc::syscall(libc::SYS_pidfd_open, gone.id() as i32, 0) };
        if raw < 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::ENOSYS) {
            eprintln!("skipped: this kernel has no pidfds (before 5.3)");
            gone.kill().unwrap();
            gone.wait().unwrap();
            return;
        }
        assert!(raw >= 0, "{}", std::io::Error::last_os_error());
        // SAFETY: a fresh fd nothing else owns.
        let pidfd = Arc::new(unsafe { OwnedFd::from_raw_fd(raw as i32) });
        let live = WorkerProcess {
            pid: gone.id() as i32,
            pidfd: Some(pidfd.clone()),
            forked: false,
        };
        assert!(live.signal(nix::sys::signal::Signal::SIGKILL));
        gone.wait().unwrap();
        // As if the kernel had given the reaped worker's pid to another process.
        let mut other = Command::new("sleep").arg("100").spawn().unwrap();
        let stale = WorkerProcess {
            pid: other.id() as i32,
            pidfd: Some(pidfd),
            forked: false,
        };
        assert!(!stale.signal(nix::sys::signal::Signal::SIGKILL));
        std::thread::sleep(std::time::Duration::from_millis(50));
        assert!(
            other.try_wait().unwrap().is_none(),
            "the other process was hit"
        );
        other.kill().unwrap();
        other.wait().unwrap();
    }

    #[test]
    fn a_sealed_memfd_holds_its_bytes_and_refuses_every_change() {
        let fd = sealed_memfd(c"ironcell-test", b"print('hi')\n").unwrap();
        let mut file = std::fs::File::from(fd);
        let mut text = String::new();
        file.read_to_string(&mut text).unwrap();
        assert_eq!(text, "print('hi')\n");
        // No write, no growth, no shrink, no new seal, no shared writable mapping.
        assert!(file.write_all(b"x").is_err());
        assert!(file.set_len(1).is_err());
        assert!(file.set_len(100).is_err());
        // SAFETY: fcntl on an fd we own.
        let sealed = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, 0) };
        assert_ne!(sealed, 0);
        // SAFETY: a fresh mapping of an fd we own; it must fail (nothing to unmap).
        let map = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                12,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        assert_eq!(
            map,
            libc::MAP_FAILED,
            "a shared writable mapping of a sealed memfd"
        );
        // Through /proc as well: a fresh open for writing gets no write access either.
        let again = std::fs::OpenOptions::new()
            .write(true)
            .open(format!("/proc/self/fd/{}", file.as_raw_fd()));
        if let Ok(mut again) = again {
            assert!(again.write_all(b"y").is_err());
        }
    }
}
