//! ironcell: an MCP server that runs Python in persistent, kernel-sandboxed sessions.
//!
//! Three processes, three places in the repository:
//!
//! - the **host** (this crate): speaks MCP on stdio, owns sessions, output, files, jobs and the
//!   proxy to the user's other MCP servers. It never forks a worker and never runs Python; it
//!   links no libpython, so it always starts and can say what is wrong with an interpreter.
//! - the **zygote** and the **workers** (crates/ironcell-python): the user's own interpreter,
//!   exec'd with `-I` and a clean environment, loads ironcell's extension module (embedded in
//!   this binary) and forks one worker per session; a worker locks itself down and runs cells.
//! - what they share (crates/ironcell-core): the contracts between the processes
//!   ([`ironcell_core::control`], [`frame`]) and the [`sandbox`] a worker applies to itself.
//!
//! Dependencies run one way: host → core, python → core; core depends on neither.
//!
//! # Layout of the host
//!
//! - [`cli`]: the command line (`serve`, `exec`, `demo`, `doctor`, `setup`, `policy`, `audit`).
//! - [`config`]: settings, their flags and environment variables, duration and size parsing.
//! - [`python`]: which interpreter runs the code, and the errors that name the fix.
//! - [`zygote`]: starting the zygote (the interpreter plus the embedded extension) and the
//!   host's handle on it: spawn requests, exits, readiness.
//! - [`server`]: the rmcp `ServerHandler`: the tools and the `system://info` resource.
//! - [`run`]: what a run is asked (`RunRequest`), why it may be refused, what it reports.
//! - [`stdio`]: the stdio transport: bounded lines, an answer for every malformed one.
//! - [`http`]: `serve --http`: Streamable HTTP at `/mcp`, bearer-token authentication, and a
//!   world of sessions per principal.
//! - [`session`]: the session table, timeouts, cancellation, caps, spare workers (the pool), the
//!   per-cell run loop, the scratch quota and the shared font cache.
//! - [`output`]: output collection (head, tail, spill file), the run record and its renderings.
//! - [`jobs`]: background runs (`run_python_job`, the tasks extension).
//! - [`files`], [`host_fs`]: session files, read and written fd-relative, refusing symlinks.
//! - [`local_tools`]: `@tool` functions from `--tools` files and `save_tool`, as MCP tools run
//!   in a sandboxed tools session.
//! - [`memory`]: `save_memory`/`load_memory` values, stored by the host per user.
//! - [`proxy`]: the user's other MCP servers: config, upstream clients, rules, search.
//! - [`router`]: where a worker's bridge requests go (parsed once into
//!   [`ironcell_core::bridge::Request`]): the proxy, memory, local tools, change tracking,
//!   packages, a session file's times.
//! - [`epoll_gate`]: each session's epoll additions, counted against its share of the uid's
//!   watches (the worker's seccomp user-notification listener).
//! - [`audit`]: the audit log of runs and proxied calls.
//! - [`packages`]: `%pip install` in a cell: host-side resolution with pip, wheels checked and
//!   unpacked into a content-addressed store, linked read-only into the session's worker.
//! - [`setup`]: `ironcell setup`, which writes or merges MCP client configs, and WSL2 detection.
//! - [`doctor`]: `ironcell doctor`, which shows the interpreter and each sandbox layer.
//! - [`demo`]: `ironcell demo`, a scripted MCP session against ironcell itself, for a person.
//! - [`system_info`]: what `system://info` reports.
//! - `python/`: the boot script, the cell runner and the in-sandbox `mcp` module, embedded.

/// `s` cut to at most `max_chars` characters, with "…" in place of the rest when cut.
pub(crate) fn clip_chars(s: &str, max_chars: usize) -> String {
    match s.char_indices().nth(max_chars) {
        None => s.to_string(),
        Some((end, _)) => format!("{}…", &s[..end]),
    }
}

/// Locks a mutex, carrying on with the data if another thread panicked while holding it: the
/// tables guarded this way (sessions, jobs, pending spawns) stay consistent between statements.
pub(crate) fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

pub(crate) mod audit;
pub mod cli;
pub(crate) mod config;
pub(crate) mod demo;
pub(crate) mod doctor;
pub(crate) mod dup_keys;
pub(crate) mod epoll_gate;
pub(crate) mod files;
pub(crate) use ironcell_core::{frame, sandbox};
pub(crate) mod host_fs;
pub(crate) mod http;
pub(crate) mod jobs;
pub(crate) mod local_tools;
pub(crate) mod memory;
pub(crate) mod output;
pub(crate) mod packages;
pub(crate) mod proxy;
pub(crate) mod python;
pub(crate) mod router;
pub(crate) mod run;
pub(crate) mod server;
pub(crate) mod session;
pub(crate) mod setup;
pub(crate) mod stdio;
pub(crate) mod system_info;
pub(crate) mod zygote;
