//! Resource limits of a worker. The host adds what rlimits cannot do (wall clock, output size,
//! scratch quota, number of sessions).

use rlimit::Resource;
use serde::{Deserialize, Serialize};

/// The limits applied to one worker, in the units the kernel uses.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerLimits {
    /// RLIMIT_CPU soft limit over the worker's life; the hard limit is 5 s higher so SIGXCPU
    /// arrives (and is reported) before SIGKILL.
    pub cpu_seconds: u64,
    /// RLIMIT_DATA: heap, anonymous mappings and thread stacks. Not RLIMIT_AS, under which
    /// OpenBLAS aborts on import.
    pub memory_bytes: u64,
    /// RLIMIT_FSIZE: the largest file the worker can write.
    pub file_size_bytes: u64,
    /// RLIMIT_NOFILE.
    pub open_files: u64,
}

/// Applies `limits` (and no core dumps) to the current process.
pub fn apply_worker_limits(limits: &WorkerLimits) -> std::io::Result<()> {
    Resource::CORE.set(0, 0)?;
    Resource::CPU.set(limits.cpu_seconds, limits.cpu_seconds + 5)?;
    Resource::DATA.set(limits.memory_bytes, limits.memory_bytes)?;
    Resource::FSIZE.set(limits.file_size_bytes, limits.file_size_bytes)?;
    Resource::NOFILE.set(limits.open_files, limits.open_files)?;
    Ok(())
}
