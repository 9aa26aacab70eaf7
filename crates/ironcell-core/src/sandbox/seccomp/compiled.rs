//! The worker's program compiled once, by the zygote: a new worker only writes its pid in.

use seccompiler::BpfProgram;

use super::{Processes, SeccompError, build_filters, build_worker_filters, cpu_clock};

/// A pid no process can have (the kernel's PID_MAX_LIMIT is 2^22), compiled where the worker's
/// own pid goes; [`CompiledWorkerFilters::for_pid`] writes the real one in.
const PID_PLACEHOLDER: u32 = 0x7e1d_0c3b;

/// The worker's filter program(s) compiled once (by the zygote, before it forks), so a new worker
/// only writes its pid into them and installs them. The policy is the one of
/// [`build_worker_filters`]: [`CompiledWorkerFilters::compile`] proves that the programs depend
/// on the pid only at the instructions it patches, by compiling them for two pids and comparing.
#[derive(Debug, Clone)]
pub struct CompiledWorkerFilters {
    programs: Vec<BpfProgram>,
    /// The program of a worker that may have children ([`Processes::WithChildren`]): it names
    /// no pid, so it needs no patching.
    with_children: Vec<BpfProgram>,
    /// (program, instruction, what it compares with) of every comparison with a value that
    /// follows from the worker's own pid.
    pub(super) pid_sites: Vec<(usize, usize, FromPid)>,
}

/// A constant of the filter that follows from the worker's pid.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum FromPid {
    /// The pid itself.
    Pid,
    /// One of its CPU clocks ([`cpu_clock`] of this kind).
    CpuClock(u32),
}

impl FromPid {
    const ALL: [FromPid; 7] = [
        FromPid::Pid,
        FromPid::CpuClock(0),
        FromPid::CpuClock(1),
        FromPid::CpuClock(2),
        FromPid::CpuClock(4),
        FromPid::CpuClock(5),
        FromPid::CpuClock(6),
    ];

    fn of(self, pid: u32) -> u32 {
        match self {
            FromPid::Pid => pid,
            FromPid::CpuClock(kind) => cpu_clock(pid, kind),
        }
    }
}

impl CompiledWorkerFilters {
    pub fn compile() -> Result<CompiledWorkerFilters, SeccompError> {
        let programs = build_worker_filters(PID_PLACEHOLDER)?;
        let other = build_worker_filters(PID_PLACEHOLDER ^ 0x5a5)?;
        let mut pid_sites = Vec::new();
        let same_shape = programs.len() == other.len()
            && programs.iter().zip(&other).all(|(a, b)| a.len() == b.len());
        if !same_shape {
            return Err(SeccompError::PidTemplate);
        }
        for (p, (a, b)) in programs.iter().zip(&other).enumerate() {
            for (i, (x, y)) in a.iter().zip(b).enumerate() {
                if x == y {
                    continue;
                }
                let same_jumps = x.code == y.code && x.jt == y.jt && x.jf == y.jf;
                let from_pid = FromPid::ALL
                    .into_iter()
                    .find(|d| x.k == d.of(PID_PLACEHOLDER) && y.k == d.of(PID_PLACEHOLDER ^ 0x5a5));
                match from_pid {
                    Some(d) if same_jumps => pid_sites.push((p, i, d)),
                    _ => return Err(SeccompError::PidTemplate),
                }
            }
        }
        if pid_sites.is_empty() {
            return Err(SeccompError::PidTemplate);
        }
        Ok(CompiledWorkerFilters {
            programs,
            pid_sites,
            with_children: build_filters(Processes::WithChildren)?,
        })
    }

    /// The programs for the process `own_pid`, in installation order; equal to
    /// `build_worker_filters(own_pid)`.
    pub fn for_processes(&self, processes: Processes) -> Vec<BpfProgram> {
        match processes {
            Processes::Alone { own_pid } => self.for_pid(own_pid),
            Processes::WithChildren => self.with_children.clone(),
        }
    }

    pub fn for_pid(&self, own_pid: u32) -> Vec<BpfProgram> {
        let mut programs = self.programs.clone();
        for &(p, i, d) in &self.pid_sites {
            programs[p][i].k = d.of(own_pid);
        }
        programs
    }
}
