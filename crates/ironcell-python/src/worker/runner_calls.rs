//! The runner's functions a worker calls from Rust, by interned name, looked up once in the
//! zygote so that a worker's calls copy no page of CPython's type attribute cache.
//!
//! Every attribute lookup on a module goes through that cache (4,096 entries in the
//! interpreter's state, keyed by the type's version and the name's *address*). A name made
//! fresh per call, as `call_method1("run_cell", ..)` makes it, never matches an entry: each
//! call replaces one, in a page of its own, and lowers the old name's reference count, often in
//! another. With the names interned (the very objects that key the runner's module dict) and
//! each looked up in the zygote after its last dry run ([`prime_runner_calls_in_zygote`]), a worker's calls
//! find their entries filled. Measured on Debian's 3.11 (docs/PERFORMANCE.md, "The zygote and
//! the fork"): these calls were 7 of the ~20 entries an idle session's worker wrote.

use pyo3::prelude::*;
use pyo3::types::PyString;

/// A function of `python/_ironcell_runner.py` the worker calls.
#[derive(Clone, Copy)]
pub(crate) enum RunnerCall {
    WorkerAfterFork,
    PrepareWorker,
    Warm,
    BindSession,
    RunCell,
}

impl RunnerCall {
    const ALL: [RunnerCall; 5] = [
        RunnerCall::WorkerAfterFork,
        RunnerCall::PrepareWorker,
        RunnerCall::Warm,
        RunnerCall::BindSession,
        RunnerCall::RunCell,
    ];

    /// The function's name, interned once per process (in the zygote, before any fork).
    pub(crate) fn name<'py>(self, py: Python<'py>) -> &'py Bound<'py, PyString> {
        match self {
            RunnerCall::WorkerAfterFork => pyo3::intern!(py, "worker_after_fork"),
            RunnerCall::PrepareWorker => pyo3::intern!(py, "prepare_worker"),
            RunnerCall::Warm => pyo3::intern!(py, "warm"),
            RunnerCall::BindSession => pyo3::intern!(py, "bind_session"),
            RunnerCall::RunCell => pyo3::intern!(py, "run_cell"),
        }
    }
}

/// In the zygote, after each dry run of a worker's paths and before it freezes its heap: interns
/// every name and looks each up on the runner, which fills the type cache's entries workers
/// will hit. A failure only leaves workers a few pages colder.
pub(crate) fn prime_runner_calls_in_zygote(runner: &Bound<'_, PyAny>) {
    for call in RunnerCall::ALL {
        let _ = runner.getattr(call.name(runner.py()));
    }
}
