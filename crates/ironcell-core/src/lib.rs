//! What the host and the Python side of ironcell share: the contract between the processes and
//! the sandbox a worker applies to itself.
//!
//! - [`control`]: host ↔ zygote messages and the [`control::WorkerSpec`] a worker is forked with.
//! - [`frame`]: host ↔ worker framing and messages on a session socket; [`bridge`]: what a
//!   worker's `mcp` module may ask the host in a `request` frame, and how the host says no.
//! - [`arenas`] and [`hugepages`]: the zygote's heap laid out so a fork copies fewer page-table
//!   entries; [`library_maps`]: its libraries in fewer mappings for a fork to duplicate;
//!   [`prefault`]: a worker's first plot takes its copy-on-write faults ahead, in bulk.
//! - [`sandbox`]: policy files, Landlock, seccomp, rlimits, the private `/tmp`, and the lockdown
//!   order. The host plans; the worker applies.
//!
//! This crate loads no Python. The host links it, and so does `ironcell-python`, the extension
//! module the zygote loads into the user's interpreter.

pub mod arenas;
pub mod bridge;
pub mod control;
pub mod fork_remap;
pub mod frame;
pub mod hugepages;
pub mod library_maps;
pub mod prefault;
// The sandbox module documents its unsafe blocks its own way (its lints are set there).
#[allow(
    clippy::undocumented_unsafe_blocks,
    clippy::multiple_unsafe_ops_per_block
)]
pub mod sandbox;
