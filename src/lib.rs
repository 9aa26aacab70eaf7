//! ironcell: an MCP server that runs Python in persistent, kernel-sandboxed sessions.
//!
//! The host speaks MCP on stdio and never runs untrusted code. It exec's its own binary once as
//! a *zygote* with a clean environment; the zygote initializes CPython (embedded with pyo3),
//! warms it up, and forks one *worker* per session. Workers talk to the host over their own
//! socketpair with length-prefixed frames; their fd 1 and 2 are captured, so nothing they write
//! can reach the MCP stream.
//!
//! # Layout
//!
//! - [`cli`]: the command line (`serve`, `exec`, `demo`, `doctor`) and what each command does.
//! - [`config`]: settings, their flags and environment variables, duration and size parsing.
//! - [`server`]: the rmcp `ServerHandler`: the `run_python` tool and the `system://info` resource.
//! - [`session`]: the session table, timeouts, cancellation, caps, and the per-cell run loop.
//! - [`stdio`]: the stdio transport: bounded lines, an answer for every malformed one.
//! - [`output`]: output collection (head, tail, spill file), the run record and its renderings.
//! - [`zygote`]: the clean, exec'd, single-threaded forker, and the host's handle on it.
//! - [`worker`]: the child side: setup order, output capture, the frame loop.
//! - [`sandbox`]: policy files, Landlock, seccomp, rlimits, and the lockdown order.
//! - [`setup`]: `ironcell setup`, which writes or merges MCP client configs, and WSL2 detection.
//! - [`doctor`]: `ironcell doctor`, which shows each sandbox layer on this host.
//! - [`frame`]: the framing and messages on a session socket.
//! - [`host_fs`]: fd-relative, symlink-refusing file operations in session directories.
//! - [`local_tools`]: `@tool` functions from `--tools` files and `save_tool`, as MCP tools run
//!   in a sandboxed tools session.
//! - [`memory`]: `save_memory`/`load_memory` values, stored by the host per user.
//! - [`system_info`]: what `system://info` reports.
//! - `python/_ironcell_runner.py`: the notebook-style cell runner, embedded in the binary.

/// Locks a mutex, carrying on with the data if another thread panicked while holding it: the
/// tables guarded this way (sessions, jobs, pending spawns) stay consistent between statements.
pub(crate) fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

pub mod audit;
pub mod cli;
pub mod config;
pub mod demo;
pub mod doctor;
pub mod files;
pub mod frame;
pub mod host_fs;
pub mod jobs;
pub mod local_tools;
pub mod memory;
pub mod output;
pub mod proxy;
pub mod pybridge;
pub mod sandbox;
pub mod server;
pub mod session;
pub mod setup;
pub mod stdio;
pub mod system_info;
pub mod worker;
pub mod zygote;
