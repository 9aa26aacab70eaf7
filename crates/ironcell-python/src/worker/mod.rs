//! The worker: the child the zygote forks for one session. It runs agent code.
//!
//! The order of [`run_worker_process`] is the security argument, so it is spelled out here.
//! Everything up to "serve" happens while the worker has exactly one thread, because the kernel
//! applies Landlock and seccomp per thread and a thread started earlier would escape them.
//!
//! The steps, in the numbering of docs/ARCHITECTURE.md ("The lockdown, in order"), the one
//! list of them:
//!
//! - before: [`fork`], in the zygote (single-threaded, GIL held, CPython's fork hooks run); the
//!   child remembers the zygote's pid, taken before the fork, and puts back the two hooks the
//!   zygote may have quieted (`zygote_quiet_fork_hooks` in python/_ironcell_runner.py).
//! - Step 1: keep only the session socket (moved to fd 3) and close every other inherited fd.
//! - Step 2: point fd 1 and fd 2 at fresh pipes, so `print`, `os.write(1, ..)` and C
//!   extensions all land in this session's output and can never reach the host's MCP stream.
//! - Step 3: `setsid` (own session, no terminal) and a parent-death signal (the worker dies
//!   with the zygote, which dies with the host).
//! - Steps 4–5: enter the scratch directory and replace the environment with the session's
//!   fixed one; mount the scratch directory over `/tmp` in a private mount namespace where the
//!   kernel allows ([`ironcell_core::sandbox::private_tmp`]).
//! - Steps 6–13: lock down: the pids cgroup, an empty `/proc`, capabilities, no_new_privs,
//!   non-dumpable, rlimits, Landlock, seccomp
//!   ([`ironcell_core::sandbox::apply_lockdown_to_current_process`]).
//! - after: only now start the reader and output pump threads, say `ready` (the host takes
//!   the threads then as ironcell's own), and serve `run` frames.

mod fork;
mod fork_files;
mod inbox;
mod output_pump;
mod runner_calls;

pub(crate) use inbox::{MainWait, Waited, reader_needed};

use std::io::Write;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex};

use anyhow::{Context, anyhow};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use ironcell_core::control::{WorkerSpec, ZygoteEvent};
use ironcell_core::frame::{self, CellStatus, FromWorker, KIND_JSON, PyErrorInfo};

use runner_calls::RunnerCall;
pub(crate) use runner_calls::prime_runner_calls_in_zygote;

/// The fd the session socket lives on inside a worker.
const SESSION_FD: RawFd = 3;

/// In a child the worker forked: dumpable, so the host (same uid) may read its memory counters
/// in `smaps_rollup` and count its share (SECURITY.md #159); seccomp allows exactly this prctl.
/// A child forked from its parent's main thread also dies with its parent (`PR_SET_PDEATHSIG`:
/// the kernel signals on the forking *thread's* end, and a main thread lasts as long as its
/// process), so it cannot outlive a session whose host was killed outright; children forked
/// from other threads die with the session's process group (SECURITY.md #159).
///
/// And it enters a Landlock domain of its own, nested in its parent's and scoped for signals
/// (no filesystem rule: its view stays its parent's): its parent can still signal it, it can
/// signal neither its parent nor its siblings (SECURITY.md #158). Past Landlock's 16 layers the
/// kernel refuses (E2BIG) and the child keeps its parent's domain, still inside the session.
extern "C" fn child_readable_by_the_host() {
    // SAFETY: prctl(2) with integer arguments only.
    unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 1, 0, 0, 0) };
    if fork::FORKING_A_SESSION.load(std::sync::atomic::Ordering::Relaxed) {
        return; // a forked session: it sets up its own (worker/fork.rs)
    }
    if FORKED_FROM_MAIN_THREAD.load(std::sync::atomic::Ordering::Relaxed) {
        // SAFETY: as above.
        unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) };
    }
    /// `struct landlock_ruleset_attr` (ABI 6): handled fs and net accesses, scopes.
    #[repr(C)]
    struct RulesetAttr {
        handled_access_fs: u64,
        handled_access_net: u64,
        scoped: u64,
    }
    const LANDLOCK_SCOPE_SIGNAL: u64 = 1 << 1;
    let attr = RulesetAttr {
        handled_access_fs: 0,
        handled_access_net: 0,
        scoped: LANDLOCK_SCOPE_SIGNAL,
    };
    // SAFETY: landlock_create_ruleset(2) reads `attr` (valid, its size given); the fd it
    // returns is only used below and closed.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_landlock_create_ruleset,
            &attr as *const RulesetAttr,
            std::mem::size_of::<RulesetAttr>(),
            0,
        )
    };
    if fd >= 0 {
        // SAFETY: landlock_restrict_self(2) on the ruleset fd just made (no_new_privs is set).
        unsafe { libc::syscall(libc::SYS_landlock_restrict_self, fd, 0) };
        // SAFETY: closes the fd made above.
        unsafe { libc::close(fd as libc::c_int) };
    }
}

/// Set in the parent right before each fork: whether its main thread is forking.
static FORKED_FROM_MAIN_THREAD: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(false);

extern "C" fn note_the_forking_thread() {
    let main = nix::unistd::gettid() == nix::unistd::getpid();
    FORKED_FROM_MAIN_THREAD.store(main, std::sync::atomic::Ordering::Relaxed);
}

/// The worker's own pid (its children have others), set when it starts.
static WORKER_PID: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

/// `os._exit` in a session (the runner puts it there): in the worker itself, what it wrote to
/// fd 1 and fd 2 is forwarded first, so that none of it dies with the pump; in a child of it,
/// the plain `_exit`.
pub(crate) fn exit_after_output(py: Python<'_>, status: i32) -> ! {
    if std::process::id() == WORKER_PID.load(std::sync::atomic::Ordering::Relaxed) {
        py.detach(output_pump::forward_everything_before_exit);
    }
    // SAFETY: what `os._exit` does: ends the process at once, running no destructors.
    unsafe { libc::_exit(status) }
}

/// Exit status of a worker that could not set itself up.
const EXIT_SETUP_FAILED: i32 = 70;

/// Step 0, in the zygote: forks the worker for one spawn request. The child goes straight to
/// [`run_worker_process`] and never returns; the parent answers the host with the pid.
pub fn fork(
    py: pyo3::Python<'_>,
    id: u64,
    spec: WorkerSpec,
    session_fd: OwnedFd,
    blocked: &nix::sys::signal::SigSet,
) -> ZygoteEvent {
    // The after-fork hooks the zygote may have quieted are safe to skip only in a fork from a
    // single-threaded zygote; it checked when it quieted them, and this checks again, every
    // fork (reading /proc/self/stat into a stack buffer: no allocation, no Python).
    if ironcell_core::sandbox::sys::threads_of_this_process() != Some(1) {
        put_back_all_fork_hooks(py);
    }
    // SAFETY: the zygote is single-threaded and holds the GIL, so fork copies a consistent
    // interpreter; PyOS_BeforeFork/AfterFork_* take and reset CPython's internal locks and run
    // the `os.register_at_fork` hooks (e.g. `random` reseeds in the child).
    unsafe { pyo3::ffi::PyOS_BeforeFork() };
    // Taken before the fork: the child compares its parent with it after asking for the
    // parent-death signal (if the zygote died in between, the child was already reparented).
    let zygote = nix::unistd::getpid();
    // SAFETY: plain fork(2); the child only runs code that is safe after fork of a
    // single-threaded process.
    let pid = unsafe { libc::fork() };
    // Read at once: the calls below (a close among them) may change errno.
    let fork_error = (pid < 0).then(std::io::Error::last_os_error);
    if pid == 0 {
        // The worker's own frees need no clearing (crate::scrub).
        crate::scrub::scrubbing(false);
        // SAFETY: in the child, right after fork, with the GIL held by this (only) thread.
        unsafe { pyo3::ffi::PyOS_AfterFork_Child() };
        let _ = blocked.thread_unblock();
        run_worker_process(py, spec, session_fd, zygote);
    }
    // SAFETY: in the parent, after fork, with the GIL held.
    unsafe { pyo3::ffi::PyOS_AfterFork_Parent() };
    drop(session_fd);
    if let Some(e) = fork_error {
        let message = format!("fork failed: {e}");
        return ZygoteEvent::SpawnFailed { id, message };
    }
    ZygoteEvent::Spawned { id, pid }
}

/// Puts every quieted after-fork hook back in the zygote (python/_ironcell_runner.py's
/// `zygote_restore_fork_hooks`): the next forks run them all. Says so once, when there were any.
fn put_back_all_fork_hooks(py: Python<'_>) {
    let restored = imported_module(py, "_ironcell_runner")
        .ok_or_else(|| anyhow!("the cell runner is missing from sys.modules"))
        .and_then(|r| {
            r.call_method0("zygote_restore_fork_hooks")
                .and_then(|n| n.extract::<usize>())
                .map_err(|e| anyhow!("{e}"))
        });
    match restored {
        Ok(0) => {}
        Ok(_) => {
            tracing::warn!("the zygote has more than one thread: workers run every after-fork hook")
        }
        Err(e) => tracing::error!(error = %e, "could not put the after-fork hooks back"),
    }
}

/// Runs in the freshly forked child with the GIL held. Never returns.
pub fn run_worker_process(
    py: Python<'_>,
    spec: WorkerSpec,
    session_fd: OwnedFd,
    zygote: nix::unistd::Pid,
) -> ! {
    WORKER_PID.store(std::process::id(), std::sync::atomic::Ordering::Relaxed);
    let code = match serve_session(py, spec, session_fd, zygote) {
        Ok(()) => 0,
        Err(e) => {
            // fd 3 may or may not be a usable socket at this point; try to tell the host.
            // SAFETY: fd 3 is owned by this process for the rest of its (short) life.
            let mut sock = unsafe { UnixStream::from_raw_fd(SESSION_FD) };
            let msg = FromWorker::Fatal {
                message: format!("{e:#}"),
            };
            if let Ok(body) = serde_json::to_vec(&msg) {
                let _ = frame::write_frame(&mut sock, KIND_JSON, &body);
            }
            std::mem::forget(sock);
            let _ = writeln!(std::io::stderr(), "ironcell worker: {e:#}");
            EXIT_SETUP_FAILED
        }
    };
    flush_python_streams(py);
    // SAFETY: _exit skips the zygote's inherited atexit handlers and destructors, which belong
    // to the zygote, not to this child.
    unsafe { libc::_exit(code) }
}

/// Hands the epoll gate's listener to the host (a frame with the descriptor attached), then
/// closes this process's copy: code in the session must never answer its own calls.
fn send_epoll_listener(listener: OwnedFd) -> std::io::Result<()> {
    send_setup_frame(&FromWorker::EpollListener {}, &[listener.as_raw_fd()])
        .map_err(std::io::Error::other)
    // `listener` is closed here: no code in the session may answer its own calls.
}

/// One setup frame with descriptors attached, before the lockdown (seccomp then refuses
/// `sendmsg`): one small frame on a fresh socket goes out whole, the descriptors with it.
fn send_setup_frame(msg: &FromWorker, fds: &[RawFd]) -> anyhow::Result<()> {
    let body = serde_json::to_vec(msg)?;
    let mut bytes = Vec::with_capacity(body.len() + 5);
    frame::write_frame(&mut bytes, KIND_JSON, &body)?;
    ironcell_core::control::send_message(SESSION_FD, &bytes, fds)
}

/// Hands the host this process's own memory counters, `/proc/self/smaps_rollup` opened now
/// (before its `/proc` is hidden, by this process, which may always read its own), then closes
/// its copy: the host reads the worker's share of memory through it, which it cannot open by
/// path once the worker is non-dumpable (SECURITY.md #241). Nothing else of the worker is
/// readable through it.
fn send_memory_counters() -> anyhow::Result<()> {
    let counters = std::fs::File::open("/proc/self/smaps_rollup")
        .context("opening /proc/self/smaps_rollup")?;
    send_setup_frame(&FromWorker::MemoryCounters {}, &[counters.as_raw_fd()])
}

/// Hands the host a copy of the read end of each output pipe (the worker keeps its own for its
/// pump): the host reads them only once the worker is gone.
fn send_output_pipes(stdout: &OwnedFd, stderr: &OwnedFd) -> anyhow::Result<()> {
    send_setup_frame(
        &FromWorker::OutputPipes {},
        &[stdout.as_raw_fd(), stderr.as_raw_fd()],
    )
}

/// Long on purpose: the worker's setup steps 0b-6 in the order the lockdown needs them (each a
/// few lines; docs/ARCHITECTURE.md, "The lockdown, in order", lists the same steps), then its
/// serve loop; split up, that order would no longer be read in one place.
fn serve_session(
    py: Python<'_>,
    spec: WorkerSpec,
    session_fd: OwnedFd,
    zygote: nix::unistd::Pid,
) -> anyhow::Result<()> {
    // Step 0b: the after-fork hooks the zygote quieted go back (see `zygote_quiet_fork_hooks`
    // in python/_ironcell_runner.py), before any code could start a thread or fork.
    imported_module(py, "_ironcell_runner")
        .ok_or_else(|| anyhow!("the cell runner is missing from sys.modules"))?
        .call_method0(RunnerCall::WorkerAfterFork.name(py))
        .map_err(|e| anyhow!("restoring the after-fork hooks: {e}"))?;

    // Step 1: the session socket on fd 3, nothing else.
    move_fd_to(session_fd, SESSION_FD)?;
    close_fds_from(SESSION_FD + 1)?;

    // Step 2: capture fd 1 and fd 2.
    let (stdout_r, stdout_w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)?;
    let (stderr_r, stderr_w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)?;
    move_fd_to(stdout_w, libc::STDOUT_FILENO)?;
    move_fd_to(stderr_w, libc::STDERR_FILENO)?;
    // Step 2b: the host gets its own read ends, to read what this worker printed last if it
    // dies before its pump forwarded it (SECURITY.md #277). Now: seccomp refuses `sendmsg`.
    send_output_pipes(&stdout_r, &stderr_r)?;

    // Step 3: own session; die with the zygote.
    nix::unistd::setsid().context("setsid")?;
    die_with_zygote(zygote)?;
    // Step 3b: its memory counters to the host, from the host's `/proc` (before step 4b's
    // namespace); only where it may fork (a worker without children is read by `status`).
    if spec.sandbox.children {
        send_memory_counters()?;
    }

    // Step 4: scratch directory and environment.
    std::env::set_current_dir(&spec.scratch)
        .with_context(|| format!("entering scratch dir {}", spec.scratch.display()))?;
    let runner = imported_module(py, "_ironcell_runner")
        .ok_or_else(|| anyhow!("the cell runner is missing from sys.modules"))?;
    let env = PyDict::new(py);
    for (k, v) in &spec.env {
        env.set_item(k, v).map_err(|e| anyhow!("{e}"))?;
    }
    // Step 4b: the session dir over /tmp in a private mount namespace (or the fallback); must
    // precede the lockdown, which forbids mounts (ironcell_core::sandbox::private_tmp explains).
    let private_tmp = ironcell_core::sandbox::private_tmp::mount_session_dir_over_tmp(
        spec.sandbox.private_tmp,
        &spec.scratch,
        &spec.sandbox,
    );
    let servers = serde_json::to_string(&spec.mcp_servers)?;
    // A dict, not JSON: decoding it would run the json module's Python code in every worker.
    let options = PyDict::new(py);
    options
        .set_item("image_budget", spec.image_budget_bytes)
        .and_then(|()| {
            let tmp = serde_json::to_value(&private_tmp).unwrap_or_default();
            options.set_item("private_tmp", json_to_python(py, &tmp)?)
        })
        .and_then(|()| {
            let children =
                ironcell_core::sandbox::children_in_this_worker(&spec.sandbox, &private_tmp);
            options.set_item("children", children)
        })
        .map_err(|e| anyhow!("{e}"))?;
    runner
        .call_method1(RunnerCall::PrepareWorker.name(py), (env, servers, options))
        .map_err(|e| anyhow!("preparing the interpreter: {e}"))?;

    // Step 5: the kernel sandbox. In enforce mode a failure ends the worker here.
    let lockdown_started = std::time::Instant::now();
    let missing_layers = ironcell_core::sandbox::apply_lockdown_with_compiled_filters(
        &spec.sandbox,
        crate::zygote::compiled_filters(),
        &private_tmp,
        Some(&mut send_epoll_listener),
    )
    .map_err(|e| anyhow!(e))?;
    let lockdown_us = lockdown_started.elapsed().as_micros() as u64;
    // Huge pages on (a memory group of its own, #271): Python's large blocks ask for them, as
    // numpy's arrays do (#276), and so do pymalloc's arenas once the worker holds many (#283).
    // Before any thread: the wrapper goes in with none running.
    if spec.sandbox.memory_cgroup.is_some()
        && ironcell_core::sandbox::sys::transparent_huge_pages_on()
    {
        crate::large_blocks::advise_huge_pages_on_large_blocks();
        crate::arenas::advise_huge_pages_past_many_arenas();
    }
    *crate::lock(&fork::FORKABLE) = Some(forkable(&spec, &private_tmp, zygote));
    if ironcell_core::sandbox::children_in_this_worker(&spec.sandbox, &private_tmp) {
        // SAFETY: registers a handler that runs in the child after fork(3), where it makes
        // one prctl(2) call, which is async-signal-safe.
        unsafe {
            libc::pthread_atfork(
                Some(note_the_forking_thread),
                None,
                Some(child_readable_by_the_host),
            )
        };
    }

    // Step 6: threads and code only from here on.
    // SAFETY: fd 3 is the session socket; from here this UnixStream owns it.
    let sock = unsafe { UnixStream::from_raw_fd(SESSION_FD) };
    let mut inbox = inbox::Inbox::start(&sock)?;
    let writer = Arc::new(Mutex::new(sock));
    // Every thread of ironcell's own starts before `ready`: the host takes the worker's threads
    // then as its own, and refuses to fork a session while it runs any other (fork_guard.rs).
    let pump = output_pump::OutputPump::start(stdout_r, stderr_r, writer.clone())?;
    send_json(
        &writer,
        &FromWorker::Ready {
            pid: std::process::id() as i32,
            missing_layers,
            lockdown_us,
            notes: Vec::new(),
        },
    )?;

    // Between cells this thread reads the socket itself; while a cell runs, the reader thread
    // does, so answers to the `mcp` module's requests reach whoever waits for them (a blocked
    // call, or an asyncio future). See [`inbox`].
    crate::bridge::connect(writer.clone());

    loop {
        // The inbox moves into the GIL-free closure and back (it is Send, not Sync).
        let (next, back) = py.detach(move || {
            let next = inbox.next_run();
            (next, inbox)
        });
        inbox = back;
        let (id, code, bind, fork) = match next {
            Some(inbox::Next::Run(run)) => (run.id, run.code, run.bind, run.fork),
            Some(inbox::Next::Warm { run_waiting }) => {
                // A run is on its way: the runner brings the code a cell runs back into the
                // caches meanwhile (`warm`, SECURITY.md #265). A failure is a colder run.
                let _ = runner.call_method1(RunnerCall::Warm.name(py), (run_waiting,));
                continue;
            }
            None => return Ok(()), // the host closed the session
        };
        if let Some(order) = fork {
            // In the fork, this returns serving the new session on the same loop.
            fork::fork_session(py, &runner, order, &inbox, &pump, &writer)?;
            continue;
        }
        if let Some(bind) = bind {
            bind_session(py, &runner, bind)?;
        }
        let done = run_cell(&runner, id, &code);
        // Everything the cell wrote is in the pipes now; send it before `done`. Without the
        // GIL, so the bridge's reader thread can hand out answers while this write waits.
        py.detach(|| pump.drain_then(|| send_json(&writer, &done)))?;
    }
}

/// Whether this worker may fork sessions (SECURITY.md #193): where it may fork children and
/// was given a forks area; else why not, for the host's refusal.
fn forkable(
    spec: &WorkerSpec,
    private_tmp: &ironcell_core::sandbox::private_tmp::PrivateTmp,
    zygote: nix::unistd::Pid,
) -> Result<fork::Forkable, String> {
    if !ironcell_core::sandbox::children_in_this_worker(&spec.sandbox, private_tmp) {
        return Err("this session's worker may not fork (it needs Landlock ABI 6 or later and a mount namespace of its own: `ironcell doctor` says which is missing)".into());
    }
    let (Some(grants), Some(forks)) = (&spec.sandbox.filesystem, &spec.forks_area) else {
        return Err("this session's worker was started without a forks area".into());
    };
    let shared_rw = grants
        .read_write
        .iter()
        .filter(|p| **p != spec.scratch && *p != forks)
        .cloned()
        .collect();
    Ok(fork::Forkable {
        grants: grants.clone(),
        shared_rw,
        zygote,
    })
}

/// A pre-forked spare's hand-off to its session (see [`frame::Binding`]). A failure ends the
/// worker: it would otherwise run the session's code under the spare's paths.
fn bind_session(
    py: Python<'_>,
    runner: &Bound<'_, PyModule>,
    bind: frame::Binding,
) -> anyhow::Result<()> {
    let env = PyDict::new(py);
    for (k, v) in &bind.env {
        env.set_item(k, v).map_err(|e| anyhow!("{e}"))?;
    }
    runner
        .call_method1(
            RunnerCall::BindSession.name(py),
            (
                env,
                bind.scratch.display().to_string(),
                bind.packages_linked,
            ),
        )
        .map_err(|e| anyhow!("binding the spare worker to its session: {e}"))?;
    Ok(())
}

/// Blocks every signal the calling thread may block, for ironcell's own reader and output-pump
/// threads: SIGINT goes to the main thread, where it becomes a KeyboardInterrupt, and
/// (SECURITY.md #311) a handler the session's code installs (ctypes can install a
/// native one) then never runs on them. In a forked session's parent they keep its pre-fork
/// Landlock domain, which reaches the fork's directory; a signal sent to one of them with
/// `tgkill` stays pending, and a process-wide one goes to another thread. glibc leaves its own
/// two signals deliverable, and the seccomp filter refuses a handler for them.
pub(crate) fn block_signals_on_this_thread() {
    let _ = nix::sys::signal::SigSet::all().thread_block();
}

fn run_cell(runner: &Bound<'_, PyModule>, id: u64, code: &str) -> FromWorker {
    // A SIGINT that arrived between cells must not interrupt this one.
    // SAFETY: called with the GIL held.
    if unsafe { pyo3::ffi::PyErr_CheckSignals() } != 0 {
        // SAFETY: with the GIL held, the pending KeyboardInterrupt is cleared right away.
        unsafe { pyo3::ffi::PyErr_Clear() };
    }
    let outcome = runner.call_method1(RunnerCall::RunCell.name(runner.py()), (code, id));
    // A child the cell forked never comes back to the worker's loop, which is its parent's
    // (the runner already ends it at the end of the cell; this is for any other way back).
    if std::process::id() != WORKER_PID.load(std::sync::atomic::Ordering::Relaxed) {
        // SAFETY: ends this child at once, without running the parent's destructors.
        unsafe { libc::_exit(1) };
    }
    match outcome.and_then(|d| d.cast_into::<PyDict>().map_err(PyErr::from)) {
        // The runner flushed `sys.stdout` and `sys.stderr` as it returned.
        Ok(d) => done_from_dict(id, &d),
        Err(e) => {
            flush_python_streams(runner.py());
            runner_error(id, e)
        }
    }
}

/// The `done` of a cell whose runner itself failed.
fn runner_error(id: u64, e: PyErr) -> FromWorker {
    FromWorker::Done {
        id,
        status: CellStatus::Error,
        result: None,
        error: Some(PyErrorInfo {
            kind: "RunnerError".into(),
            message: e.to_string(),
            traceback: String::new(),
        }),
        exit_code: None,
        images: Vec::new(),
    }
}

fn done_from_dict(id: u64, d: &Bound<'_, PyDict>) -> FromWorker {
    let get_str = |k: &str| -> Option<String> {
        d.get_item(k)
            .ok()
            .flatten()
            .and_then(|v| v.extract::<String>().ok())
    };
    let status = match get_str("status").as_deref() {
        Some("ok") => CellStatus::Ok,
        Some("interrupted") => CellStatus::Interrupted,
        Some("exit") => CellStatus::Exit,
        _ => CellStatus::Error,
    };
    let error = d.get_item("error").ok().flatten().and_then(|e| {
        let e = e.cast_into::<PyDict>().ok()?;
        let field = |k: &str| -> String {
            e.get_item(k)
                .ok()
                .flatten()
                .and_then(|v| v.extract().ok())
                .unwrap_or_default()
        };
        Some(PyErrorInfo {
            kind: field("type"),
            message: field("message"),
            traceback: field("traceback"),
        })
    });
    let exit_code = d
        .get_item("exit_code")
        .ok()
        .flatten()
        .and_then(|v| v.extract::<i64>().ok());
    // Most cells make no image: an empty list skips the JSON round trip (the `json` module's
    // Python code on every run's path).
    let images = d
        .get_item("images")
        .ok()
        .flatten()
        .filter(|v| v.len().is_ok_and(|n| n > 0))
        .and_then(|v| {
            let json = v
                .py()
                .import("json")
                .ok()?
                .call_method1("dumps", (v,))
                .ok()?;
            serde_json::from_str::<Vec<ironcell_core::frame::CellImage>>(
                &json.extract::<String>().ok()?,
            )
            .ok()
        })
        .unwrap_or_default();
    FromWorker::Done {
        id,
        status,
        result: get_str("result").map(|r| cut_chars(r, frame::MAX_RESULT_CHARS)),
        error: error.map(|e| PyErrorInfo {
            kind: cut_chars(e.kind, frame::MAX_NAME_CHARS),
            message: cut_chars(e.message, frame::ERROR_FIELD_CUT_CHARS),
            traceback: cut_chars(e.traceback, frame::ERROR_FIELD_CUT_CHARS),
        }),
        exit_code,
        images: images_the_host_accepts(images),
    }
}

/// Cuts `text` to `limit` characters, saying how much was left out (the host refuses longer).
fn cut_chars(text: String, limit: usize) -> String {
    if text.len() <= limit || text.chars().count() <= limit {
        return text;
    }
    let total = text.chars().count();
    let note = format!("... [{} more characters]", total - (limit - 64));
    let mut cut: String = text.chars().take(limit - 64).collect();
    cut.push_str(&note);
    cut
}

/// Leaves out images the host would refuse (odd names, too many), so an honest worker never
/// breaks the protocol because of a file name.
fn images_the_host_accepts(
    images: Vec<ironcell_core::frame::CellImage>,
) -> Vec<ironcell_core::frame::CellImage> {
    images
        .into_iter()
        .filter(|img| {
            frame::session_relative_path(&img.path).is_ok()
                && frame::IMAGE_MIME_TYPES.contains(&img.mime.as_str())
        })
        .take(frame::MAX_IMAGES)
        .collect()
}

fn send_json(writer: &Mutex<UnixStream>, msg: &FromWorker) -> anyhow::Result<()> {
    let body = serde_json::to_vec(msg)?;
    let mut w = writer
        .lock()
        .map_err(|_| anyhow!("session socket lock poisoned"))?;
    frame::write_frame(&mut *w, KIND_JSON, &body).context("writing to the host")
}

fn flush_python_streams(py: Python<'_>) {
    for name in [c"stdout", c"stderr"] {
        // SAFETY: GIL held; PySys_GetObject returns a borrowed reference (or NULL), no error.
        let stream = unsafe { pyo3::ffi::PySys_GetObject(name.as_ptr()) };
        // SAFETY: that borrowed reference (or NULL), used while the GIL is held.
        let stream = unsafe { Bound::from_borrowed_ptr_or_opt(py, stream) };
        if let Some(stream) = stream {
            let _ = stream.call_method0("flush");
        }
    }
}

/// A module from `sys.modules`, without the import machinery (`py.import` goes through
/// `__import__`, whose Python-level lookups copy pages in a fresh worker).
fn imported_module<'py>(py: Python<'py>, name: &str) -> Option<Bound<'py, PyModule>> {
    let name = pyo3::types::PyString::new(py, name);
    // SAFETY: GIL held; PyImport_GetModule returns a new reference, or NULL (with an error set
    // only if the lookup itself failed, which is cleared).
    let module = unsafe { pyo3::ffi::PyImport_GetModule(name.as_ptr()) };
    // SAFETY: that new reference (or NULL), owned from here on.
    let module = unsafe { Bound::from_owned_ptr_or_opt(py, module) };
    if module.is_none() {
        let _ = PyErr::take(py);
    }
    module.and_then(|m| m.cast_into::<PyModule>().ok())
}

/// A JSON value as the equivalent Python object (dict, list, str, int, float, bool, None).
fn json_to_python<'py>(py: Python<'py>, value: &serde_json::Value) -> PyResult<Bound<'py, PyAny>> {
    use pyo3::IntoPyObjectExt;
    use serde_json::Value;
    match value {
        Value::Null => Ok(py.None().into_bound(py)),
        Value::Bool(b) => b.into_bound_py_any(py),
        Value::Number(n) => match (n.as_i64(), n.as_u64()) {
            (Some(i), _) => i.into_bound_py_any(py),
            (None, Some(u)) => u.into_bound_py_any(py),
            _ => n.as_f64().unwrap_or(f64::NAN).into_bound_py_any(py),
        },
        Value::String(s) => s.into_bound_py_any(py),
        Value::Array(items) => {
            let list = pyo3::types::PyList::empty(py);
            for item in items {
                list.append(json_to_python(py, item)?)?;
            }
            Ok(list.into_any())
        }
        Value::Object(map) => {
            let dict = PyDict::new(py);
            for (k, v) in map {
                dict.set_item(k, json_to_python(py, v)?)?;
            }
            Ok(dict.into_any())
        }
    }
}

/// Has the kernel SIGKILL this process when the zygote, its parent, exits, and fails if the
/// zygote is already gone (the signal would then never come).
pub(crate) fn die_with_zygote(zygote: nix::unistd::Pid) -> anyhow::Result<()> {
    nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGKILL)
        .context("prctl(PR_SET_PDEATHSIG)")?;
    if nix::unistd::getppid() != zygote {
        anyhow::bail!("the zygote exited while its child started");
    }
    Ok(())
}

/// Moves `fd` to the number `target` (which must be free or hold something we may replace).
pub(crate) fn move_fd_to(fd: OwnedFd, target: RawFd) -> anyhow::Result<()> {
    let raw = fd.as_raw_fd();
    if raw == target {
        // Keep it, but make sure it survives (it arrived with O_CLOEXEC).
        std::mem::forget(fd);
        return Ok(());
    }
    // SAFETY: dup2 onto a descriptor number this process controls; errno checked at once.
    if unsafe { libc::dup2(raw, target) } < 0 {
        return Err(std::io::Error::last_os_error())
            .with_context(|| format!("dup2 onto fd {target}"));
    }
    drop(fd);
    Ok(())
}

/// Closes every descriptor numbered `first` or higher.
pub(crate) fn close_fds_from(first: RawFd) -> anyhow::Result<()> {
    // SAFETY: close_range(2) with integer arguments; errno checked at once.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_close_range,
            first as libc::c_uint,
            libc::c_uint::MAX,
            0,
        )
    };
    if rc == 0 {
        return Ok(());
    }
    // close_range needs Linux 5.9; older kernels close one by one up to the fd limit.
    let max = nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE)
        .map(|(soft, _)| soft.min(1 << 16) as RawFd)
        .unwrap_or(1024);
    for fd in first..max {
        // SAFETY: closing descriptors this process owns; EBADF for unused numbers is fine.
        unsafe { libc::close(fd) };
    }
    Ok(())
}
