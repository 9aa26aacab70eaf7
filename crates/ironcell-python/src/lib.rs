//! ironcell's Python side: a CPython extension module (`_ironcell_bridge`, stable ABI, 3.9+)
//! that the host embeds in its binary and hands to the user's own interpreter.
//!
//! The host never loads Python. It exec's the chosen interpreter as the *zygote* with
//! `python -I -c <boot>`, the control socket on fd 3 and this extension (a sealed memfd) on
//! fd 4; the boot script (python/_ironcell_boot.py) loads it and calls
//! [`zygote::zygote_main`]. From there on, everything in this crate runs in processes that hold
//! a Python interpreter:
//!
//! - [`zygote`]: warm-up, the spawn loop, fork, reaping; `heap_holes` (its heap readied for
//!   forks) and `plot_probe` (the pages a first plot writes).
//! - [`worker`]: the child after fork, in lockdown order: descriptors, private `/tmp`, the
//!   sandbox, output capture, then the frame loop that runs cells.
//! - [`bridge`]: the native half of the in-sandbox `mcp` module.
//!
//! Built as a `cdylib` with pyo3's `abi3-py39` and `extension-module` features: one build
//! serves every CPython from 3.9 on, and links no libpython (the interpreter provides it).

pub mod arenas;
pub mod bridge;
mod code_cache;
mod heap_holes;
mod large_blocks;
mod plot_probe;
pub mod scrub;
pub mod worker;
pub mod zygote;

#[global_allocator]
static ALLOCATOR: scrub::ScrubOnFree = scrub::ScrubOnFree;

/// Locks a mutex, carrying on with the data if another thread panicked while holding it.
pub(crate) fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}
