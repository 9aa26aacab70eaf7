//! Applying a [`SandboxPlan`] to the calling process: the steps in the order the sandbox's
//! module doc ([`super`]) gives, each failing with a [`LayerError`] that names its layer.

use std::io;
use std::os::fd::OwnedFd;
use std::path::PathBuf;

use super::landlock::LandlockError;
use super::seccomp::SeccompError;
use super::{
    SandboxMode, SandboxPlan, cgroup, epoll_gate, landlock, private_tmp, rlimits, seccomp, sys,
};

/// A lockdown step that could not be applied, with the system's answer.
///
/// Each message is whole (its cause's text in it, not chained through `source`): the worker
/// reports a failed start with `{:#}`, which would print a chained cause twice.
#[derive(Debug, thiserror::Error)]
pub enum LayerError {
    /// Joining a pids cgroup of its own (root workers' thread cap) under `parent`.
    #[error("{} ({error})", parent.display())]
    PidsCgroup { parent: PathBuf, error: io::Error },
    /// Joining a memory cgroup of its own under `parent` (where huge pages are then allowed).
    #[error("{} ({error})", parent.display())]
    MemoryCgroup { parent: PathBuf, error: io::Error },
    /// Mounting the empty `/proc` (in a namespace of its own).
    #[error("{0}")]
    EmptyProc(io::Error),
    #[error("{0}")]
    Capabilities(io::Error),
    #[error("{0}")]
    NoNewPrivs(io::Error),
    #[error("{0}")]
    NotDumpable(io::Error),
    #[error("{0}")]
    IgnoreSigxfsz(io::Error),
    #[error("{0}")]
    HugePagesOff(io::Error),
    #[error("{0}")]
    HugePagesOn(io::Error),
    /// Counting the machine's tasks, for RLIMIT_NPROC shared with the uid.
    #[error("reading /proc/loadavg: {0}")]
    TaskCount(io::Error),
    #[error("{0}")]
    Rlimits(io::Error),
    #[error("{0}")]
    Landlock(LandlockError),
    #[error("not available on this kernel")]
    LandlockUnavailable,
    #[error("{0}")]
    EpollGate(io::Error),
    #[error("{0}")]
    Seccomp(SeccompError),
    #[error("not available on this kernel")]
    SeccompUnavailable,
}

impl LayerError {
    /// The layer's name, as `doctor`, the logs and a best-effort result's notes show it.
    pub fn layer(&self) -> &'static str {
        match self {
            LayerError::PidsCgroup { .. } => "pids cgroup",
            LayerError::MemoryCgroup { .. } => "memory cgroup",
            LayerError::EmptyProc(_) => "empty /proc",
            LayerError::Capabilities(_) => "capabilities",
            LayerError::NoNewPrivs(_) => "no_new_privs",
            LayerError::NotDumpable(_) => "non-dumpable",
            LayerError::IgnoreSigxfsz(_) => "SIGXFSZ",
            LayerError::HugePagesOff(_) => "huge pages off",
            LayerError::HugePagesOn(_) => "huge pages on",
            LayerError::TaskCount(_) | LayerError::Rlimits(_) => "rlimits",
            LayerError::Landlock(_) | LayerError::LandlockUnavailable => "landlock",
            LayerError::EpollGate(_) => "epoll gate",
            LayerError::Seccomp(_) | LayerError::SeccompUnavailable => "seccomp",
        }
    }
}

/// The lockdown stopped (enforce mode): the step that failed. The worker exits with it, having
/// run nothing.
#[derive(Debug, thiserror::Error)]
#[error("sandbox layer {} could not be applied: {error}", error.layer())]
pub struct LockdownError {
    pub error: LayerError,
}

/// Whether this worker may fork children, given the namespace it actually got: the plan allows
/// it, `/dev/shm` is its session directory, and its tasks are capped with its children's (its
/// pids cgroup, or RLIMIT_NPROC in its own user namespace). The lockdown adds the last
/// condition: Landlock applied, with its signal scope.
pub fn children_in_this_worker(plan: &SandboxPlan, namespace: &private_tmp::PrivateTmp) -> bool {
    plan.children
        && namespace.private_dev_shm()
        && (plan.pids_cgroup_parent.is_some() || namespace.in_own_user_namespace())
        && plan.filesystem.as_ref().is_some_and(|g| g.abi >= 6)
}

/// Applies `plan` to the calling process, which must have exactly one thread. Returns the
/// layers that were skipped (best-effort mode only); in enforce mode any failure is an error.
pub fn apply_lockdown_to_current_process(plan: &SandboxPlan) -> Result<Vec<String>, LockdownError> {
    let no_namespace = private_tmp::PrivateTmp::Fallback {
        reason: String::new(),
        allowed: Vec::new(),
        namespace: None,
        dev_shm: false,
    };
    apply_lockdown_with_compiled_filters(plan, None, &no_namespace, None)
}

/// Where the listener of a counting [`epoll_gate`] goes: called once, before the main seccomp
/// program (which refuses `sendmsg`) is installed.
pub type EpollListenerHandOver<'a> = &'a mut dyn FnMut(OwnedFd) -> std::io::Result<()>;

/// The steps taken so far: in best-effort mode, the layers skipped ("layer: why").
struct Steps<'p> {
    plan: &'p SandboxPlan,
    missing: Vec<String>,
}

impl Steps<'_> {
    /// `Ok(true)` when the step held; `Ok(false)` when it failed in best-effort mode (the layer
    /// is then listed as missing); the error in enforce mode.
    fn step(&mut self, result: Result<(), LayerError>) -> Result<bool, LockdownError> {
        match result {
            Ok(()) => Ok(true),
            Err(e) if self.plan.mode == SandboxMode::BestEffort => {
                self.missing.push(format!("{}: {e}", e.layer()));
                Ok(false)
            }
            Err(error) => Err(LockdownError { error }),
        }
    }
}

/// [`apply_lockdown_to_current_process`] with the seccomp programs compiled beforehand (by the
/// zygote, once): the same filters, installed here by the worker itself; `None` compiles them
/// now.
/// `namespace` is what [`private_tmp::mount_session_dir_over_tmp`] gave the worker: in a
/// namespace of its own, `/proc` is hidden and the thread cap counts only its own tasks.
/// `epoll_listener`: who counts the process's epoll watches ([`epoll_gate`]); `None` refuses
/// epoll instead.
pub fn apply_lockdown_with_compiled_filters(
    plan: &SandboxPlan,
    compiled: Option<&seccomp::CompiledWorkerFilters>,
    namespace: &private_tmp::PrivateTmp,
    epoll_listener: Option<EpollListenerHandOver<'_>>,
) -> Result<Vec<String>, LockdownError> {
    let mut steps = Steps {
        plan,
        missing: Vec::new(),
    };
    let in_memory_group = cgroup_steps(&mut steps, namespace)?;
    let proc_view = process_steps(&mut steps, namespace)?;
    let landlocked = match &plan.filesystem {
        Some(grants) => {
            let mut grants = grants.clone();
            if proc_view {
                grants
                    .read_only
                    .push(PathBuf::from(private_tmp::PROC_MEMINFO));
            }
            steps.step(
                landlock::install_filesystem_landlock_rules_on_current_thread(&grants)
                    .map_err(LayerError::Landlock),
            )?
        }
        None => steps.step(Err(LayerError::LandlockUnavailable))?,
    };
    // Huge pages back on (step 3 turned them off) only in a memory group of its own, which
    // charges them whole, and once Landlock keeps the worker from that group's files: as
    // root without capabilities it could still write them (they are root's, 0644).
    if in_memory_group && landlocked {
        steps.step(sys::allow_transparent_huge_pages().map_err(LayerError::HugePagesOn))?;
    }
    // Without Landlock's signal scope in force, a child's signals are fenced only by pid rules
    // (best-effort mode gets here with Landlock missing): no children then.
    let processes = if children_in_this_worker(plan, namespace) && landlocked {
        seccomp::Processes::WithChildren
    } else {
        seccomp::Processes::Alone {
            own_pid: std::process::id(),
        }
    };
    if plan.seccomp {
        // The gate first: the main program refuses `seccomp` and `sendmsg`.
        let counted = epoll_listener.is_some();
        steps.step(
            epoll_gate::install_on_current_thread(counted)
                .and_then(|gate| match (gate, epoll_listener) {
                    (epoll_gate::EpollGate::Counted(fd), Some(hand_over)) => hand_over(fd),
                    _ => Ok(()),
                })
                .map_err(LayerError::EpollGate),
        )?;
        let filtered = steps.step(
            match compiled {
                Some(c) => seccomp::install_programs_on_current_thread(&c.for_processes(processes)),
                None => seccomp::build_filters(processes)
                    .and_then(|p| seccomp::install_programs_on_current_thread(&p)),
            }
            .map_err(LayerError::Seccomp),
        )?;
        if !filtered {
            steps.step(rlimits::drop_fork_headroom().map_err(LayerError::Rlimits))?;
        }
    } else {
        steps.step(Err(LayerError::SeccompUnavailable))?;
    }
    Ok(steps.missing)
}

/// Step 0 of the order in [`super`], as root: a pids group of its own, then, where the worker
/// may fork, a memory group of its own. Returns whether it joined the memory group (huge pages
/// may come back on once Landlock is in force).
fn cgroup_steps(
    steps: &mut Steps<'_>,
    namespace: &private_tmp::PrivateTmp,
) -> Result<bool, LockdownError> {
    let plan = steps.plan;
    if let Some(parent) = &plan.pids_cgroup_parent {
        steps.step(
            cgroup::join_new_pids_group(parent, std::process::id(), plan.limits.threads).map_err(
                |error| LayerError::PidsCgroup {
                    parent: parent.clone(),
                    error,
                },
            ),
        )?;
    }
    // Only where it may fork (what huge pages make faster), and in a pids group too.
    Ok(match (&plan.memory_cgroup, &plan.pids_cgroup_parent) {
        (Some(groups), Some(_)) if children_in_this_worker(plan, namespace) => {
            steps.step(groups.join(std::process::id()).map_err(|error| {
                LayerError::MemoryCgroup {
                    parent: groups.parent.clone(),
                    error,
                }
            }))?
        }
        _ => false,
    })
}

/// Steps 1-4 of the order in [`super`]: the empty `/proc`, capabilities, `no_new_privs`, not
/// dumpable, SIGXFSZ, huge pages, malloc arenas and rlimits. Returns whether the worker got
/// its own `/proc/meminfo` view (Landlock then grants it).
fn process_steps(
    steps: &mut Steps<'_>,
    namespace: &private_tmp::PrivateTmp,
) -> Result<bool, LockdownError> {
    let plan = steps.plan;
    // Read before `/proc` is hidden.
    let task_count = if namespace.in_own_user_namespace() {
        Ok(rlimits::TaskCount::OwnUserNamespace)
    } else {
        rlimits::tasks_on_machine()
            .map(|tasks_now| rlimits::TaskCount::SharedWithUid { tasks_now })
            .map_err(LayerError::TaskCount)
    };
    let mut proc_view = false;
    steps.step(
        private_tmp::hide_other_processes(
            namespace,
            &plan.granted_paths(),
            plan.limits.memory_bytes,
        )
        .map(|view| proc_view = view)
        .map_err(LayerError::EmptyProc),
    )?;
    steps.step(sys::drop_all_capabilities().map_err(LayerError::Capabilities))?;
    steps.step(sys::set_no_new_privs().map_err(LayerError::NoNewPrivs))?;
    steps.step(sys::set_not_dumpable().map_err(LayerError::NotDumpable))?;
    steps.step(sys::ignore_sigxfsz().map_err(LayerError::IgnoreSigxfsz))?;
    steps.step(sys::disable_transparent_huge_pages().map_err(LayerError::HugePagesOff))?;
    sys::limit_malloc_arenas(2);
    // The hard memory limits leave room for the host to raise a fork's (SECURITY.md #239)
    // where sessions may fork; taken back below if the filter that keeps the worker from using
    // it is not installed.
    let headroom = plan.seccomp && children_in_this_worker(plan, namespace);
    steps.step(task_count.and_then(|count| {
        rlimits::apply_worker_limits(&plan.limits, count, headroom).map_err(LayerError::Rlimits)
    }))?;
    Ok(proc_view)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_step_names_its_layer_and_the_systems_answer() {
        let e = LockdownError {
            error: LayerError::Capabilities(io::Error::from_raw_os_error(libc::EPERM)),
        };
        assert_eq!(
            e.to_string(),
            "sandbox layer capabilities could not be applied: Operation not permitted (os error 1)"
        );
        let e = LayerError::PidsCgroup {
            parent: PathBuf::from("/sys/fs/cgroup/pids/ironcell"),
            error: io::Error::from_raw_os_error(libc::EACCES),
        };
        assert_eq!(
            format!("{}: {e}", e.layer()),
            "pids cgroup: /sys/fs/cgroup/pids/ironcell (Permission denied (os error 13))"
        );
        let e = LayerError::TaskCount(io::Error::from_raw_os_error(libc::ENOENT));
        assert_eq!(e.layer(), "rlimits");
        assert!(e.to_string().starts_with("reading /proc/loadavg: "), "{e}");
        // Whole messages: nothing is chained, so `{:#}` (the worker's report) says it once.
        let e = anyhow::Error::new(LockdownError {
            error: LayerError::SeccompUnavailable,
        });
        assert_eq!(
            format!("{e:#}"),
            "sandbox layer seccomp could not be applied: not available on this kernel"
        );
    }
}
