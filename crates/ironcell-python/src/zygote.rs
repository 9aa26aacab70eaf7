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
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};

use anyhow::{Context, anyhow};
use ironcell_core::control::{
    CONTROL_FD, ExitInfo, ZygoteEvent, ZygoteRequest, recv_message, send_event,
};
use pyo3::prelude::*;

use crate::heap_holes::{
    PLOT_HEAP_RESERVE, fill_malloc_holes, fill_pymalloc_holes, reserve_malloc_heap,
};
use crate::plot_probe::{PLOT_PAGES, UNREAPED_PROBE, probe_plot_pages};

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
    install_glibcs_thread_signal_handler();
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

/// Has glibc install its handler of SIGSETXID (which `setuid` and the like send to every other
/// thread) here, before any fork: glibc does it at a process's first `pthread_create`, which in
/// a worker comes after its seccomp filter refuses a handler for that signal (SECURITY.md #311),
/// and a worker's `os.setuid` was then killed by it instead of raising PermissionError. One
/// thread that returns at once, joined: the zygote stays single-threaded.
fn install_glibcs_thread_signal_handler() {
    if let Ok(t) = std::thread::Builder::new().spawn(|| {}) {
        let _ = t.join();
    }
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
    crate::worker::prime_runner_calls_in_zygote(runner.as_any());
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
        crate::worker::prime_runner_calls_in_zygote(runner.as_any());
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
    // The libraries imported so far (the plot warm-up merges the ones it loads).
    merge_library_mappings();
    // No huge-page collapse here: it took ~120 ms; the heap is collapsed after the matplotlib
    // warm-up.
    tracing::debug!(
        ms = started.elapsed().as_secs_f64() * 1000.0,
        "the zygote finished its warm-up"
    );
}

/// Long on purpose: the zygote's one single-threaded loop (poll on the control socket and the
/// SIGCHLD signalfd, then one arm per request kind), kept whole so every path through it is
/// seen to clear the request buffer and reap its children.
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
            let used = msg.len();
            let request = serde_json::from_slice::<ZygoteRequest>(msg);
            // Cleared before the fork, and only the bytes this packet wrote (the rest is still
            // zero from the last clear): the pages the packet landed on are already the
            // zygote's own (it just wrote them), so clearing them costs no copy, and no worker
            // inherits the request's text. Cleared after the fork, the whole buffer (16 pages,
            // shared with the worker just forked) was copied again after every fork.
            crate::scrub::clear_used(&mut buf, used);
            let request = request?;
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
    ironcell_core::control::send_message(ctl, &serde_json::to_vec(event)?, &[pidfd.as_raw_fd()])
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
        crate::worker::prime_runner_calls_in_zygote(runner.as_any());
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
        merge_library_mappings();
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

/// Joins each library's RELRO to its data mapping (`library_maps`): fewer mappings for every
/// later fork to duplicate. Logs what it did.
fn merge_library_mappings() {
    let done = ironcell_core::library_maps::merge_library_mappings();
    tracing::debug!(
        before = done.before,
        after = done.after,
        ranges = done.ranges,
        refused = ?done.refused,
        "library mappings merged"
    );
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
