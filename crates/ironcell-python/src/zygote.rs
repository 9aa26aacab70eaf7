//! The zygote: the user's own interpreter, exec'd by the host with `-I` and a clean
//! environment, holding a warm CPython and forking one worker per session.
//!
//! The host starts `python -I -c <boot>` (python/_ironcell_boot.py) with the control socket on
//! fd 3 and this extension on fd 4; the boot script loads the extension and calls
//! [`zygote_main`], which never returns while the host lives. Why a separate exec'd process
//! rather than a fork of the host: a fork copies the parent's whole memory, including the
//! environment block, and a worker can read its own memory with ctypes. The host holds the
//! user's environment and the tokens of proxied servers, so workers descend from a process that
//! never had them.
//!
//! The messages on the control socket are in [`ironcell_core::control`]. Both ends use
//! `PR_SET_PDEATHSIG`: when the host dies the zygote dies, and when the zygote dies every worker
//! dies.

use std::ffi::CString;
use std::io::Write;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};

use anyhow::{Context, anyhow};
use ironcell_core::control::{
    CONTROL_FD, ExitInfo, ZygoteEvent, ZygoteRequest, recv_message, send_event,
};
use pyo3::prelude::*;

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

const RUNNER_SOURCE: &str = include_str!("../../../python/_ironcell_runner.py");
const MCP_MODULE_SOURCE: &str = include_str!("../../../python/mcp/__init__.py");

/// Runs the zygote: warms the interpreter, reports `Ready` (or `Failed`), then forks a worker
/// for each spawn request until the host closes the control socket. Called by the boot script
/// with the GIL held; never returns while the host lives.
#[pyfunction]
#[pyo3(signature = (preload, log_filter, code_cache=None))]
pub fn zygote_main(
    py: Python<'_>,
    preload: Vec<String>,
    log_filter: String,
    code_cache: Option<PathBuf>,
) -> PyResult<()> {
    init_logging(&log_filter);
    run(py, &preload, code_cache.as_deref())
        .map_err(|e| pyo3::exceptions::PyRuntimeError::new_err(format!("{e:#}")))
}

fn run(py: Python<'_>, preload: &[String], code_cache: Option<&Path>) -> anyhow::Result<()> {
    // SAFETY: the host placed the control socket at fd 3 before exec; nothing else owns it.
    let ctl = unsafe { OwnedFd::from_raw_fd(CONTROL_FD) };
    set_parent_death_signal()?;
    // Before the warm-up allocates the zygote's heap: its arenas then fill whole 2 MiB ranges,
    // which the collapse after the plot warm-up makes huge pages.
    let chunked_arenas = crate::arenas::install();
    tracing::debug!(chunked_arenas, "pymalloc arenas in 2 MiB chunks");
    let started = std::time::Instant::now();
    let ready = match warm_up_interpreter(py, preload, code_cache) {
        Ok(facts) => ZygoteEvent::Ready {
            python_version: facts.version,
            prefix: facts.prefix,
            base_prefix: facts.base_prefix,
            executable: facts.executable,
            site_packages: facts.site_packages,
            python_paths: facts.python_paths,
            warm_ms: started.elapsed().as_secs_f64() * 1000.0,
        },
        Err(e) => {
            let message = format!("warming up the interpreter failed: {e:#}");
            send_event(ctl.as_raw_fd(), &ZygoteEvent::Failed { message })?;
            return Err(e);
        }
    };
    // The seccomp programs are the same for every worker but for its pid: compile them once
    // here; each worker writes its pid in and installs them itself, after the fork.
    match ironcell_core::sandbox::seccomp::CompiledWorkerFilters::compile() {
        Ok(c) => {
            let _ = COMPILED_FILTERS.set(c);
        }
        Err(e) => tracing::debug!(error = %e, "seccomp filters are compiled by each worker"),
    }
    send_event(ctl.as_raw_fd(), &ready)?;
    serve_spawn_requests(py, &ctl)
}

/// The workers' seccomp programs, compiled once by the zygote (a fork inherits them).
static COMPILED_FILTERS: std::sync::OnceLock<
    ironcell_core::sandbox::seccomp::CompiledWorkerFilters,
> = std::sync::OnceLock::new();

/// What [`run`] compiled, if it could (a worker compiles its own otherwise).
pub(crate) fn compiled_filters()
-> Option<&'static ironcell_core::sandbox::seccomp::CompiledWorkerFilters> {
    COMPILED_FILTERS.get()
}

/// Logs go to stderr (the host's stderr; never the MCP stream), filtered as the host says.
fn init_logging(filter: &str) {
    let filter = tracing_subscriber::EnvFilter::try_new(filter)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("ironcell_python=info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .try_init();
}

/// The zygote dies with the host, and adopts every orphan beneath it: a worker's grandchild
/// whose parent ended comes back to the zygote (not to the machine's init), which reaps it;
/// it stays in its worker's process group, by which the host finds and kills it
/// (SECURITY.md #159).
fn set_parent_death_signal() -> anyhow::Result<()> {
    nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGKILL)
        .context("prctl(PR_SET_PDEATHSIG)")?;
    ironcell_core::sandbox::sys::become_child_subreaper().context("PR_SET_CHILD_SUBREAPER")?;
    Ok(())
}

/// What the worker must read of this interpreter, as JSON: stdlib, lib-dynload, every
/// site-packages and `sys.path` directory, and the directories of the shared libraries loaded so
/// far plus `LIBDIR` (a conda env's or pyenv build's own `lib/`, where its extension modules'
/// libraries live) — not the whole prefix (which is /usr on Debian). Directories near the root
/// (`/`, `/lib`, `/usr`) are never taken from the loaded-library list: the policy names the
/// system library directories itself.
const PYTHON_FACTS_SOURCE: &str = r#"
import json, os, site, sys, sysconfig
paths = set()
for key in ("stdlib", "platstdlib", "purelib", "platlib"):
    p = sysconfig.get_paths().get(key)
    if p:
        paths.add(p)
for p in sys.path:
    if p and os.path.isabs(p):
        paths.add(p)
libs = set()
libdir = sysconfig.get_config_var("LIBDIR")
if libdir:
    libs.add(libdir)
try:
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(None, 5)
            if len(fields) == 6:
                name = fields[5].strip()
                if name.startswith("/") and ".so" in name and os.path.isfile(name):
                    libs.add(os.path.dirname(name))
except OSError:
    pass
for d in libs:
    real = os.path.realpath(d)
    if real.count("/") >= 2 and os.path.isdir(real):
        paths.add(real)
try:
    site_packages = list(site.getsitepackages())
except AttributeError:
    site_packages = []
result = json.dumps({
    "version": sys.version.split()[0],
    "prefix": sys.prefix,
    "base_prefix": getattr(sys, "base_prefix", sys.prefix),
    "executable": sys.executable,
    "site_packages": [p for p in site_packages if os.path.isdir(p)],
    "python_paths": sorted(set(os.path.realpath(p) for p in paths if os.path.isdir(p))),
})
"#;

#[derive(serde::Deserialize)]
struct InterpreterFacts {
    version: String,
    prefix: String,
    base_prefix: String,
    executable: String,
    site_packages: Vec<PathBuf>,
    python_paths: Vec<PathBuf>,
}

fn warm_up_interpreter(
    py: Python<'_>,
    preload: &[String],
    code_cache: Option<&Path>,
) -> anyhow::Result<InterpreterFacts> {
    let sys = py.import("sys").map_err(|e| anyhow!("{e}"))?;
    // `-I` ignores PYTHONDONTWRITEBYTECODE: say it here, so no worker writes `__pycache__`.
    sys.setattr("dont_write_bytecode", true)
        .map_err(|e| anyhow!("{e}"))?;
    let source = CString::new(RUNNER_SOURCE)?;
    let runner = crate::code_cache::module_from_code(
        py,
        &source,
        c"_ironcell_runner.py",
        c"_ironcell_runner",
        code_cache,
    )
    .map_err(|e| anyhow!("loading the cell runner: {e}"))?;
    sys.getattr("modules")
        .and_then(|m| m.set_item("_ironcell_runner", &runner))
        .map_err(|e| anyhow!("{e}"))?;
    let source = CString::new(MCP_MODULE_SOURCE)?;
    let mcp = crate::code_cache::module_from_code(
        py,
        &source,
        c"<ironcell>/mcp/__init__.py",
        c"mcp",
        code_cache,
    )
    .map_err(|e| anyhow!("loading the mcp module: {e}"))?;
    sys.getattr("modules")
        .and_then(|m| m.set_item("mcp", &mcp))
        .map_err(|e| anyhow!("{e}"))?;
    for name in preload.iter().map(|n| n.trim()).filter(|n| !n.is_empty()) {
        match py.import(name) {
            Ok(_) => tracing::info!(module = name, "preloaded"),
            Err(e) => tracing::warn!(module = name, error = %e, "preload skipped"),
        }
    }
    let globals = pyo3::types::PyDict::new(py);
    let source = CString::new(PYTHON_FACTS_SOURCE)?;
    py.run(&source, Some(&globals), None)
        .map_err(|e| anyhow!("{e}"))?;
    let facts: String = globals
        .get_item("result")
        .map_err(|e| anyhow!("{e}"))?
        .ok_or_else(|| anyhow!("the interpreter facts script set no result"))?
        .extract()
        .map_err(|e| anyhow!("{e}"))?;
    let facts: InterpreterFacts =
        serde_json::from_str(&facts).context("decoding the interpreter facts")?;
    // The session-independent part of every worker's setup, once, here.
    runner
        .call_method0("zygote_prepare")
        .map_err(|e| anyhow!("preparing the cell runner: {e}"))?;
    // With matplotlib preloaded, also build its font list here (and select Agg), so a new
    // session's first plot costs what a warm one does. Not by default: it makes the zygote, and
    // so every fork, larger.
    if preload.iter().any(|m| m.trim().starts_with("matplotlib")) {
        match runner.call_method0("zygote_warm_up") {
            Ok(done) => tracing::info!(result = %done, "zygote warm-up"),
            Err(e) => tracing::warn!(error = %e, "zygote warm-up step failed"),
        }
    }
    // The rest ([`finish_warm_up`]) waits until the zygote has reported ready and had a quiet
    // moment: a server's first session is forked first, with the after-fork hooks quieted as
    // in every later fork.
    quiet_fork_hooks(&runner);
    Ok(facts)
}

/// How long the zygote waits for a request before it finishes its warm-up ([`finish_warm_up`]):
/// a client's first run usually follows its `initialize` within milliseconds, and its worker is
/// forked first.
const QUIET_BEFORE_WARM_UP: std::time::Duration = std::time::Duration::from_millis(50);

/// The part of the warm-up that a worker can do without: the modules every worker finds
/// imported ([`WARM_IMPORTS`]), the worker's code paths run again (the imports evicted what the
/// first dry runs left in the type cache), then the heap frozen and its holes filled, so
/// workers forked from then on share those pages. Done once, after the zygote reported ready,
/// once no request came for [`QUIET_BEFORE_WARM_UP`] or right after its second fork: the
/// server's first run does not wait for it. The worker forked before it imports what it uses
/// itself and holds more private memory (usually the first session's: the pool fills after the
/// first answer).
fn finish_warm_up(py: Python<'_>) {
    let started = std::time::Instant::now();
    // The after-fork hooks run as usual while other Python runs (see `quiet_fork_hooks`).
    let runner = py
        .import("sys")
        .and_then(|sys| sys.getattr("modules"))
        .and_then(|m| m.get_item("_ironcell_runner"));
    if let Ok(runner) = &runner {
        let _ = runner.call_method0("zygote_restore_fork_hooks");
    }
    for name in WARM_IMPORTS {
        if let Err(e) = py.import(*name) {
            tracing::debug!(module = name, error = %e, "warm import skipped");
        }
    }
    let done = (|| -> PyResult<()> {
        let runner = runner?;
        // The last code the zygote runs before it freezes (see `_warm_worker_paths`).
        runner.call_method0("zygote_warm_paths")?;
        // Move everything imported so far into the permanent generation: a forked worker's
        // garbage collections then never touch (and so never copy) the zygote's pages.
        let gc = py.import("gc")?;
        gc.call_method0("collect")?;
        quiet_fork_hooks(&runner);
        gc.call_method0("freeze")?;
        Ok(())
    })();
    if let Err(e) = done {
        tracing::warn!(error = %e, "the zygote's warm-up did not finish");
    }
    fill_pymalloc_holes(py);
    fill_malloc_holes();
    // No huge-page collapse here: it took ~120 ms; the heap is collapsed after the matplotlib
    // warm-up.
    tracing::debug!(
        ms = started.elapsed().as_secs_f64() * 1000.0,
        "the zygote finished its warm-up"
    );
}

fn serve_spawn_requests(py: pyo3::Python<'_>, ctl: &OwnedFd) -> anyhow::Result<()> {
    use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
    use nix::sys::signal::{SigSet, Signal};
    use nix::sys::signalfd::{SfdFlags, SignalFd};

    // From the first request on, nothing one worker was told outlives it in the zygote's heap
    // (crate::scrub): each request's decoded copies are cleared when freed, its buffer below.
    crate::scrub::scrubbing(true);

    // SIGCHLD arrives through a signalfd so the loop stays single-threaded and synchronous.
    let mut mask = SigSet::empty();
    mask.add(Signal::SIGCHLD);
    mask.thread_block()?;
    let sfd = SignalFd::with_flags(&mask, SfdFlags::SFD_NONBLOCK | SfdFlags::SFD_CLOEXEC)?;
    // Every request is received into this one buffer (see `recv_message`).
    let mut buf = Vec::new();
    let mut warm = false;
    let mut forks = 0u32;
    loop {
        let mut fds = [
            PollFd::new(ctl_borrow(ctl), PollFlags::POLLIN),
            PollFd::new(sfd_borrow(&sfd), PollFlags::POLLIN),
        ];
        let wait = if warm {
            PollTimeout::NONE
        } else {
            PollTimeout::try_from(QUIET_BEFORE_WARM_UP).unwrap_or(PollTimeout::ZERO)
        };
        match poll(&mut fds, wait) {
            Ok(0) => {
                finish_warm_up(py);
                warm = true;
                continue;
            }
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
            let Some((msg, fds)) = recv_message(ctl.as_raw_fd(), &mut buf)? else {
                // The host closed the control socket: it is gone or shutting down.
                return Ok(());
            };
            let request: ZygoteRequest = serde_json::from_slice(msg)?;
            match request {
                ZygoteRequest::Spawn { id, spec } => {
                    let mut fds = fds.into_iter();
                    let Some(session_fd) = fds.next() else {
                        let message = "spawn request carried no session socket".to_string();
                        send_event(ctl.as_raw_fd(), &ZygoteEvent::SpawnFailed { id, message })?;
                        continue;
                    };
                    drop(fds);
                    let event = crate::worker::fork(py, id, *spec, session_fd, &mask);
                    send_spawn_event(ctl.as_raw_fd(), &event)?;
                    // At most the first worker (the first session's) is forked before the
                    // warm-up, which then follows the second fork (the font cache's builder,
                    // forked after the first answer): the spares come from the warm zygote, and
                    // the first session's cell does not share the CPUs with the warm-up.
                    forks += 1;
                    if forks >= 2 && !std::mem::replace(&mut warm, true) {
                        finish_warm_up(py);
                    }
                }
                ZygoteRequest::WarmPlots { font_cache_dir } => {
                    drop(fds);
                    if !std::mem::replace(&mut warm, true) {
                        finish_warm_up(py);
                    }
                    let event = warm_plots_between_forks(py, &font_cache_dir);
                    send_event(ctl.as_raw_fd(), &event)?;
                }
            }
            crate::scrub::clear(&mut buf);
        }
    }
}

/// Sends the outcome of a spawn request; a `Spawned` worker's pidfd goes with it, so the host
/// signals that process and no other: this zygote reaps its children only in its own loop, so
/// the pid cannot have been reaped (and given to another process) before `pidfd_open`. Kernels
/// without pidfds (before 5.3) send the event alone, and the host signals by pid.
fn send_spawn_event(ctl: RawFd, event: &ZygoteEvent) -> anyhow::Result<()> {
    let ZygoteEvent::Spawned { pid, .. } = event else {
        return send_event(ctl, event);
    };
    // SAFETY: pidfd_open(2) takes a pid and flags and returns a new fd or -1.
    let raw = unsafe { libc::syscall(libc::SYS_pidfd_open, *pid, 0) };
    if raw < 0 {
        return send_event(ctl, event);
    }
    // SAFETY: the fd was just returned to us and nothing else owns it.
    let pidfd = unsafe { OwnedFd::from_raw_fd(raw as RawFd) };
    ironcell_core::control::send_message(ctl, &serde_json::to_vec(event)?, Some(pidfd.as_raw_fd()))
}

/// Imports matplotlib and pyplot into the zygote (python/_ironcell_runner.py's
/// `zygote_warm_up`, with the shared font cache as `MPLCONFIGDIR`), then freezes the new objects
/// like the boot's own, so later workers share those pages too. Runs on the zygote's only
/// thread, between two forks: spawn requests wait meanwhile (a few hundred milliseconds, once
/// per zygote). A failure is reported, never fatal: workers then import matplotlib themselves.
fn warm_plots_between_forks(py: Python<'_>, font_cache_dir: &std::path::Path) -> ZygoteEvent {
    let started = std::time::Instant::now();
    let outcome = (|| -> PyResult<String> {
        let runner = py
            .import("sys")?
            .getattr("modules")?
            .get_item("_ironcell_runner")?;
        // The after-fork hooks run as usual while the warm-up runs (it might fork, or start a
        // thread); `quiet_fork_hooks` below quiets them again if the zygote is still alone.
        runner.call_method0("zygote_restore_fork_hooks")?;
        let message = runner
            .call_method1("zygote_warm_up", (font_cache_dir.to_string_lossy(),))?
            .str()?
            .to_string();
        let gc = py.import("gc")?;
        gc.call_method0("collect")?;
        quiet_fork_hooks(&runner);
        gc.call_method0("freeze")?;
        fill_pymalloc_holes(py);
        fill_malloc_holes();
        log_collapse(ironcell_core::hugepages::collapse_anonymous_memory());
        // From here on no fault of the zygote's allocates a huge page (the collapse marked only
        // the ranges it looked at; with huge pages `always`, the reserve's chunk headers below
        // or later heap growth would each fill in 2 MiB). Its collapsed pages stay huge.
        if let Err(e) = ironcell_core::sandbox::sys::disable_transparent_huge_pages() {
            tracing::debug!(error = %e, "huge pages stay on in the zygote");
        }
        reserve_malloc_heap(PLOT_HEAP_RESERVE);
        // Last: the probe must see the heap as the workers will inherit it.
        let probe_started = std::time::Instant::now();
        let probe = probe_plot_pages(py);
        let noted = match &probe {
            Ok(runs) => format!(
                "; a first plot's {} pages ({} runs, probed in {:.0} ms) are written ahead in a worker",
                runs.pages(),
                runs.runs().len(),
                probe_started.elapsed().as_secs_f64() * 1000.0
            ),
            Err(e) => format!("; plot pages not probed: {e:#}"),
        };
        if let Ok(runs) = probe {
            let _ = PLOT_PAGES.set(runs);
        }
        Ok(message + &noted)
    })();
    let message = outcome.unwrap_or_else(|e| format!("matplotlib warm-up failed: {e}"));
    let pyplot = py
        .import("sys")
        .and_then(|sys| sys.getattr("modules"))
        .and_then(|m| m.contains("matplotlib.pyplot"))
        .unwrap_or(false);
    let ms = started.elapsed().as_secs_f64() * 1000.0;
    let threads = ironcell_core::sandbox::sys::threads_of_this_process().unwrap_or(0);
    if threads > 1 {
        // fork copies only this thread; a lock another thread holds would stay held in workers.
        tracing::error!(threads, "the matplotlib warm-up left threads in the zygote");
    }
    tracing::info!(pyplot, ms, %message, "zygote warmed for plots");
    ZygoteEvent::PlotsWarmed {
        pyplot,
        message,
        ms,
    }
}

/// The pages a first plot writes, as the zygote's probe found them ([`probe_plot_pages`]);
/// workers inherit them with the fork.
static PLOT_PAGES: std::sync::OnceLock<ironcell_core::prefault::PageRuns> =
    std::sync::OnceLock::new();

/// How long the probe may take to draw its figure and read its pages.
const PROBE_DEADLINE: std::time::Duration = std::time::Duration::from_secs(20);

/// Forks a probe that draws the warm-up's figure once more and reports which pages of its
/// private writable mappings it wrote (`ironcell_core::prefault`): the pages a worker's first
/// plot would copy one fault at a time. Runs on the zygote's only thread, right before it
/// serves forks again; the probe is trusted code (matplotlib, as in the warm-up), never a
/// worker's, and is reaped here, so the zygote's loop never reports it as a worker.
fn probe_plot_pages(py: Python<'_>) -> anyhow::Result<ironcell_core::prefault::PageRuns> {
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
static UNREAPED_PROBE: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(0);

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

/// Lets workers skip CPython's after-fork hooks of `threading` and `logging` before 3.12
/// (python/_ironcell_runner.py's `zygote_quiet_fork_hooks` says why, when, and what each worker
/// still does of them). Called right before the zygote freezes its heap and forks again, with
/// none quieted (at boot, and after the plot warm-up, which put them back first); only while it
/// has one thread. Every fork checks again (`worker::fork`).
fn quiet_fork_hooks(runner: &Bound<'_, PyAny>) {
    let threads = ironcell_core::sandbox::sys::threads_of_this_process().unwrap_or(0);
    if threads != 1 {
        tracing::debug!(threads, "after-fork hooks left as they are");
        return;
    }
    match runner
        .call_method0("zygote_quiet_fork_hooks")
        .and_then(|done| done.str().map(|s| s.to_string()))
    {
        Ok(done) => tracing::debug!(threads, %done, "after-fork hooks"),
        Err(e) => tracing::warn!(error = %e, "could not set up the after-fork hooks"),
    }
}

/// Logs what [`ironcell_core::hugepages::collapse_anonymous_memory`] did.
fn log_collapse(done: ironcell_core::hugepages::Collapsed) {
    let (arenas, chunks) = crate::arenas::stats();
    tracing::debug!(
        arenas,
        chunks,
        ranges = done.ranges,
        sparse = done.sparse,
        huge_mib = done.bytes >> 20,
        refused = ?done.refused,
        "the zygote's heap in huge pages (fewer page-table entries per fork)"
    );
}

/// Fills the free chunks ("holes") of the zygote's malloc heap with allocations it never frees,
/// so that a worker's own allocations come from fresh memory at the heap's end instead.
///
/// Why: after a fork every page is shared copy-on-write, and a worker's first write to a page
/// copies it. An allocation served from a hole writes into a page the zygote also uses (the
/// chunk header and the data), so each small allocation a worker makes (a lock after fork, a
/// dict's table, a `Vec`) can cost it a whole private 4 KiB page; the plot warm-up leaves
/// hundreds of such holes scattered over its heap. Filled here, once the zygote's own
/// warm-up is done, a worker's allocations are packed into new pages instead (measured: an idle
/// session's private `[heap]` pages ~1 MiB -> ~0.4 MiB with plots warmed). The filled chunks are
/// memory the zygote already held; only sizes served from the heap are used (never `mmap`ed
/// ones), and the loop is bounded.
///
/// glibc only: `mallinfo2` gives the size of the top chunk (`keepcost`, main arena), which
/// shrinks exactly when an allocation no longer finds a hole of its size. The zygote is
/// single-threaded, so the main arena is the only one.
pub(crate) fn fill_malloc_holes() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        /// Sizes tried, largest first (below the default 128 KiB `mmap` threshold): big holes
        /// are used up by big blocks, the small size classes (and glibc's per-size caches) last.
        const LARGE: [usize; 5] = [64 << 10, 16 << 10, 4 << 10, 2 << 10, 1 << 10];
        /// At most this many blocks in all (a few thousand holes are usual after a warm-up).
        const MAX_BLOCKS: usize = 200_000;
        fn holes(info: &libc::mallinfo2) -> usize {
            info.fordblks.saturating_sub(info.keepcost)
        }
        let started = std::time::Instant::now();
        // SAFETY: mallinfo2 only reads the allocator's statistics.
        let before = unsafe { libc::mallinfo2() };
        if holes(&before) == 0 {
            return;
        }
        let mut blocks = 0usize;
        let sizes = LARGE.iter().copied().chain((16..=1008).rev().step_by(16));
        'sizes: for size in sizes {
            loop {
                if blocks >= MAX_BLOCKS {
                    break 'sizes;
                }
                // SAFETY: as above.
                let info = unsafe { libc::mallinfo2() };
                // SAFETY: a plain allocation, never freed if it fills a hole.
                // `black_box`: an allocation nothing uses may otherwise be optimized away.
                let p = std::hint::black_box(unsafe { libc::malloc(size) });
                if p.is_null() {
                    break 'sizes;
                }
                blocks += 1;
                // SAFETY: as above.
                let after = unsafe { libc::mallinfo2() };
                if after.hblks > info.hblks || after.keepcost < info.keepcost {
                    // Served by mmap (a raised threshold) or taken from the top chunk: no hole
                    // of this size is left. Give it back (so nothing grows fork after fork).
                    // SAFETY: `p` came from malloc above and is not used elsewhere.
                    unsafe { libc::free(p) };
                    blocks -= 1;
                    continue 'sizes;
                }
                if holes(&after) == 0 {
                    break 'sizes;
                }
            }
        }
        // SAFETY: as above.
        let after = unsafe { libc::mallinfo2() };
        tracing::debug!(
            blocks,
            holes_before = holes(&before),
            holes_after = holes(&after),
            us = started.elapsed().as_micros() as u64,
            "filled the zygote's malloc holes"
        );
    }
}

/// How much heap [`reserve_malloc_heap`] holds for a first plot: a new session's first plot
/// grew the heap by ~2.8 MiB (Debian's 3.11, matplotlib 3.6), which a warm session reuses.
const PLOT_HEAP_RESERVE: usize = 4 << 20;

/// The blocks [`reserve_malloc_heap`] holds (addresses), freed by [`release_heap_reserve`].
static HEAP_RESERVE: std::sync::OnceLock<Vec<usize>> = std::sync::OnceLock::new();

/// Holds `bytes` of the zygote's malloc heap, mapped but untouched (one chunk header per block
/// written), for the allocations of a worker's first plot: contiguous blocks allocated here and
/// freed only in a child that is about to plot ([`release_heap_reserve`]: the probe, and a
/// worker right after it wrote a first plot's pages ahead), where they coalesce into one free
/// chunk, kept off the heap's top (so glibc does not give it back) by one more block that is
/// never freed.
///
/// Why: the hole filling above sends a worker's allocations to the heap's top, and a first plot
/// (its image buffers, its temporary arrays) grew the heap there by ~700 pages, each one a fault
/// of its own in the middle of the plot, where a warm session reuses the memory its first plot
/// freed. Inside the heap as the zygote leaves it, those pages are the probe's too: it writes
/// them, finds them its own, and lists them with the copy-on-write pages, so a worker's first
/// plot takes them ahead in bulk (`ironcell_core::prefault`). Held (not freed) in the zygote,
/// no allocation of the zygote's own lands in them, and a worker that never plots never frees
/// them, writes them, or holds them as private memory.
///
/// glibc only, and only from the heap (`brk`): a block served by `mmap` is given back and the
/// reserve is smaller or not made. Called after the huge-page collapse, with huge pages off for
/// the zygote (`PR_SET_THP_DISABLE`): a fault on a chunk header would otherwise fill in a whole
/// 2 MiB where transparent huge pages are `always`.
fn reserve_malloc_heap(bytes: usize) {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        /// Below glibc's smallest `mmap` threshold (128 KiB) and above its per-size caches.
        const BLOCK: usize = 120 << 10;
        let mut blocks: Vec<usize> = Vec::with_capacity(bytes / BLOCK + 2);
        let mut contiguous = true;
        while blocks.len() <= bytes / BLOCK {
            // SAFETY: mallinfo2 only reads the allocator's statistics.
            let before = unsafe { libc::mallinfo2() };
            // SAFETY: a plain allocation, held for the process's life (or freed by a child).
            let p = unsafe { libc::malloc(BLOCK) };
            if p.is_null() {
                break;
            }
            // SAFETY: as above.
            let after = unsafe { libc::mallinfo2() };
            if after.hblks > before.hblks {
                // SAFETY: `p` came from malloc above and is not used elsewhere.
                unsafe { libc::free(p) };
                break;
            }
            if let Some(&last) = blocks.last() {
                // Each block right above the last (one chunk header between them, 64-bit).
                contiguous &= (p as usize).wrapping_sub(last) == BLOCK + 16;
            }
            blocks.push(p as usize);
        }
        // The last block is the fence: never freed, it keeps the chunk below off the top.
        blocks.pop();
        let reserved = blocks.len() * BLOCK;
        if HEAP_RESERVE.set(blocks).is_err() {
            tracing::warn!("the heap reserve for a first plot was made twice");
        }
        tracing::debug!(
            reserved,
            contiguous,
            "held part of the zygote's malloc heap for a first plot"
        );
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    let _ = bytes;
}

/// In a child of the zygote about to plot for the first time (the probe, or a worker that just
/// wrote a first plot's pages ahead): frees the blocks [`reserve_malloc_heap`] held, so the
/// plot's allocations come from them. Once per process.
fn release_heap_reserve() {
    static DONE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if DONE.swap(true, std::sync::atomic::Ordering::Relaxed) {
        return;
    }
    for &p in HEAP_RESERVE.get().map(Vec::as_slice).unwrap_or_default() {
        // SAFETY: each came from malloc in the zygote, which never used or freed it; this
        // process inherited the heap with it and frees it once (`DONE`).
        unsafe { libc::free(p as *mut libc::c_void) };
    }
}

/// Fills the free blocks of pymalloc's partly used pools with allocations the zygote never
/// frees, so that a worker's new Python objects are packed into fresh pools instead of being
/// scattered over the zygote's pages.
///
/// Why: CPython serves a small object (512 bytes or less) from a partly used pool of its size
/// class when there is one, and the zygote's warm-up and `gc.collect()` leave thousands of free
/// blocks spread over its frozen heap (Debian's 3.11: ~3,500 at boot, ~7,700 more after the plot
/// warm-up). After a fork each of them sits in a page the worker shares with the zygote, so a
/// worker that allocates an object there copies a whole 4 KiB page for it: every dict, string and frame object a fresh worker makes (its setup, its
/// first cells) can cost a private page. With those blocks taken here, a worker's allocations
/// start new pools, 4 KiB of which hold dozens of objects. The taken blocks are memory the zygote
/// already holds (a free block is only unlinked, never written), so the zygote does not grow.
///
/// The counts come from `sys._debugmallocstats()` ("avail blocks" per size class are the free
/// blocks of pools in use), read from a memfd that stands in for fd 2 meanwhile. An interpreter
/// without pymalloc (`PYTHONMALLOC=malloc`, debug builds) prints no such table: nothing is done.
pub(crate) fn fill_pymalloc_holes(py: Python<'_>) {
    /// At most this many blocks in all.
    const MAX_BLOCKS: usize = 1_000_000;
    let started = std::time::Instant::now();
    let mut blocks = 0usize;
    let mut found = [0usize; 2];
    // A second look takes the blocks freed while the first round ran (its own temporaries).
    for seen in &mut found {
        let avail = match pymalloc_free_blocks(py) {
            Ok(avail) => avail,
            Err(e) => {
                tracing::debug!(error = %e, "pymalloc's statistics are not available");
                return;
            }
        };
        *seen = avail.iter().map(|&(_, n)| n).sum();
        for (size, n) in avail {
            for _ in 0..n.min(MAX_BLOCKS - blocks) {
                // SAFETY: the GIL is held (`py`); the block is never freed and never used.
                // `black_box`: an allocation nothing uses may otherwise be optimized away.
                let p = std::hint::black_box(unsafe { pyo3::ffi::PyObject_Malloc(size) });
                if p.is_null() {
                    return;
                }
                blocks += 1;
            }
        }
    }
    tracing::debug!(
        blocks,
        free_blocks = found[0],
        second_look = found[1],
        us = started.elapsed().as_micros() as u64,
        "filled the zygote's pymalloc holes"
    );
}

/// pymalloc's free blocks in partly used pools, as (block size, count) per size class, from
/// the table `sys._debugmallocstats()` writes to the C `stderr` (fd 2, swapped for a memfd).
fn pymalloc_free_blocks(py: Python<'_>) -> anyhow::Result<Vec<(usize, usize)>> {
    use std::io::{Read, Seek};
    // SAFETY: memfd_create with a static name; the result is checked and owned at once.
    let raw = unsafe { libc::memfd_create(c"ironcell-mallocstats".as_ptr(), libc::MFD_CLOEXEC) };
    if raw < 0 {
        return Err(std::io::Error::last_os_error()).context("memfd_create");
    }
    // SAFETY: `raw` is a fresh descriptor this function owns.
    let mut stats = unsafe { std::fs::File::from_raw_fd(raw) };
    // SAFETY: the zygote is single-threaded, so nothing else writes to fd 2 while it points at
    // the memfd; the saved copy is put back (and closed) before this returns.
    let saved = unsafe { libc::fcntl(libc::STDERR_FILENO, libc::F_DUPFD_CLOEXEC, 10) };
    if saved < 0 {
        return Err(std::io::Error::last_os_error()).context("saving fd 2");
    }
    // SAFETY: as above.
    unsafe { libc::dup2(stats.as_raw_fd(), libc::STDERR_FILENO) };
    let printed = py
        .import("sys")
        .and_then(|sys| sys.call_method0("_debugmallocstats"))
        .map(drop);
    // SAFETY: as above.
    unsafe { libc::dup2(saved, libc::STDERR_FILENO) };
    // SAFETY: the copy of stderr made above, ours, unused from here on.
    unsafe { libc::close(saved) };
    printed.map_err(|e| anyhow!("sys._debugmallocstats(): {e}"))?;
    let mut text = String::new();
    stats.rewind()?;
    stats.read_to_string(&mut text)?;
    Ok(parse_pymalloc_free_blocks(&text))
}

/// The size-class rows of `sys._debugmallocstats()`: `class size num-pools in-use avail`.
fn parse_pymalloc_free_blocks(text: &str) -> Vec<(usize, usize)> {
    text.lines()
        .filter_map(|line| {
            let cols: Vec<usize> = line
                .split_whitespace()
                .map(str::parse)
                .collect::<Result<_, _>>()
                .ok()?;
            match cols[..] {
                [_class, size, _pools, _in_use, avail] if (1..=512).contains(&size) => {
                    Some((size, avail))
                }
                _ => None,
            }
        })
        .collect()
}

fn ctl_borrow(fd: &OwnedFd) -> std::os::fd::BorrowedFd<'_> {
    use std::os::fd::AsFd;
    fd.as_fd()
}

fn sfd_borrow(fd: &nix::sys::signalfd::SignalFd) -> std::os::fd::BorrowedFd<'_> {
    use std::os::fd::AsFd;
    fd.as_fd()
}

/// Reaps every child that has ended and reports it to the host. Uses `waitpid(2)` directly:
/// nix decodes the status into its `Signal` enum and answers EINVAL, after the child is already
/// reaped, for a worker killed by a real-time signal, which a worker can arrange (SECURITY.md
/// #118). A status this zygote cannot classify is reported as it is, never treated as an error.
///
/// A worker's children die with it (SECURITY.md #159): they are in its process group, which
/// they cannot leave (`setsid` and `setpgid` are refused), and the group is SIGKILLed while the
/// ended worker is still a zombie, so its pid, the group's id, cannot have been reused.
fn report_exited_children(ctl: RawFd) -> anyhow::Result<()> {
    loop {
        // SAFETY: an all-zero siginfo_t is valid; waitid(2) writes into it.
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        // SAFETY: waitid(2) peeking (WNOWAIT) with a valid out-pointer.
        let rc = unsafe {
            libc::waitid(
                libc::P_ALL,
                0,
                &mut info,
                libc::WEXITED | libc::WNOHANG | libc::WNOWAIT,
            )
        };
        if rc < 0 {
            match nix::errno::Errno::last() {
                nix::errno::Errno::EINTR => continue,
                nix::errno::Errno::ECHILD => return Ok(()),
                e => return Err(e.into()),
            }
        }
        // SAFETY: waitid filled `info` (si_pid is 0 when no child has ended).
        let ended = unsafe { info.si_pid() };
        if ended == 0 {
            return Ok(());
        }
        let probe = UNREAPED_PROBE.load(std::sync::atomic::Ordering::Relaxed);
        if ended != probe {
            // SAFETY: kill(2) of the process group the unreaped worker leads.
            unsafe { libc::kill(-ended, libc::SIGKILL) };
        }
        let mut raw = 0;
        // SAFETY: waitpid(2) of that child with a valid out-pointer to a local integer.
        let pid = unsafe { libc::waitpid(ended, &mut raw, libc::WNOHANG) };
        if pid <= 0 {
            match nix::errno::Errno::last() {
                nix::errno::Errno::EINTR => continue,
                _ if pid == 0 => continue,
                nix::errno::Errno::ECHILD => return Ok(()),
                e => return Err(e.into()),
            }
        }
        if pid == probe {
            continue; // the plot probe, not a worker
        }
        let status = if libc::WIFEXITED(raw) {
            ExitInfo::Code(libc::WEXITSTATUS(raw))
        } else if libc::WIFSIGNALED(raw) {
            ExitInfo::Signal(libc::WTERMSIG(raw))
        } else {
            // Without WUNTRACED/WCONTINUED only ended children are reported; nothing to say.
            continue;
        };
        send_event(ctl, &ZygoteEvent::Exited { pid, status })?;
    }
}
