//! The filesystem (and, from ABI 4, TCP; from ABI 6, abstract-socket and signal scoping) part of
//! the lockdown, with the `landlock` crate.
//!
//! The ruleset handles every access right of the chosen ABI, so anything not granted below is
//! denied: read-only beneath the Python installation and the system libraries, read-write
//! beneath the session's scratch directory, `/dev/null` for reading and writing, nothing else.
//! The ABI is the kernel's, or lower when capped (to prove on one kernel what older kernels
//! get); it is never higher than the kernel's, so the ruleset is always fully enforced.

use std::os::fd::AsFd;
use std::path::PathBuf;

use landlock::{
    ABI, Access, AccessFs, AccessNet, BitFlags, CompatLevel, Compatible, PathBeneath, PathFd,
    Ruleset, RulesetAttr, RulesetCreatedAttr, RulesetStatus, Scope,
};
use serde::{Deserialize, Serialize};

/// What Landlock grants a worker.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FilesystemGrants {
    /// Landlock ABI to use (1..=7). Never above the kernel's.
    pub abi: i32,
    pub read_only: Vec<PathBuf>,
    pub read_write: Vec<PathBuf>,
    /// Single files readable and writable (e.g. `/dev/null`).
    pub read_write_files: Vec<PathBuf>,
}

#[derive(Debug, thiserror::Error)]
pub enum LandlockError {
    #[error("Landlock ABI {0} requested, which this build does not know")]
    UnknownAbi(i32),
    #[error("cannot open {path} for a Landlock rule: {source}")]
    Path {
        path: String,
        source: landlock::PathFdError,
    },
    #[error("{0}")]
    Ruleset(#[from] landlock::RulesetError),
    #[error("the kernel did not fully enforce the Landlock ruleset ({0:?})")]
    NotEnforced(RulesetStatus),
}

fn abi_from(v: i32) -> Result<ABI, LandlockError> {
    match v {
        1 => Ok(ABI::V1),
        2 => Ok(ABI::V2),
        3 => Ok(ABI::V3),
        4 => Ok(ABI::V4),
        5 => Ok(ABI::V5),
        6 => Ok(ABI::V6),
        7 => Ok(ABI::V7),
        other => Err(LandlockError::UnknownAbi(other)),
    }
}

/// Restricts the calling thread (which must be the process's only thread) to `grants`.
pub fn install_filesystem_landlock_rules_on_current_thread(
    grants: &FilesystemGrants,
) -> Result<(), LandlockError> {
    restrict(grants, true)
}

/// A forked session's narrower layer (SECURITY.md #193), nested in the domain it inherited:
/// the same handled rights and scopes, the same read-only grants, and read-write only beneath
/// `grants.read_write` (its own directory and forks area). `no_new_privs` is already set, and
/// the seccomp filter lets `prctl` set nothing here, so it is not asked again. The 17th layer
/// fails (E2BIG): the fork is then refused.
pub fn narrow_for_a_fork(grants: &FilesystemGrants) -> Result<(), LandlockError> {
    restrict(grants, false)
}

fn restrict(grants: &FilesystemGrants, no_new_privs: bool) -> Result<(), LandlockError> {
    let abi = abi_from(grants.abi)?;
    let mut ruleset = Ruleset::default()
        .set_compatibility(CompatLevel::HardRequirement)
        .handle_access(AccessFs::from_all(abi))?;
    if abi >= ABI::V4 {
        // Handled and never granted: no TCP bind or connect at all.
        ruleset = ruleset.handle_access(AccessNet::BindTcp | AccessNet::ConnectTcp)?;
    }
    if abi >= ABI::V6 {
        ruleset = ruleset.scope(Scope::AbstractUnixSocket | Scope::Signal)?;
    }
    let mut created = ruleset.create()?;
    let read: BitFlags<AccessFs> = AccessFs::from_read(abi);
    // Everything but executing files and making device nodes, sockets and FIFOs.
    let write_dir: BitFlags<AccessFs> = AccessFs::from_all(abi)
        & !(AccessFs::Execute
            | AccessFs::MakeChar
            | AccessFs::MakeBlock
            | AccessFs::MakeSock
            | AccessFs::MakeFifo);
    let file_rw: BitFlags<AccessFs> = AccessFs::from_file(abi) & !AccessFs::Execute;
    for (paths, access) in [
        (&grants.read_only, read),
        (&grants.read_write, write_dir),
        (&grants.read_write_files, file_rw),
    ] {
        for path in paths {
            let fd = PathFd::new(path).map_err(|source| LandlockError::Path {
                path: path.display().to_string(),
                source,
            })?;
            // A rule on a regular file may only carry file rights. Asked of the open fd: a
            // second lookup of the path costs a walk of every component (per grant, per worker).
            let is_dir = nix::sys::stat::fstat(fd.as_fd())
                .is_ok_and(|st| st.st_mode & libc::S_IFMT == libc::S_IFDIR);
            let access = if is_dir {
                access
            } else {
                access & AccessFs::from_file(abi)
            };
            created = created.add_rule(PathBeneath::new(fd, access))?;
        }
    }
    let status = created.no_new_privs(no_new_privs).restrict_self()?;
    if status.ruleset != RulesetStatus::FullyEnforced {
        return Err(LandlockError::NotEnforced(status.ruleset));
    }
    Ok(())
}
