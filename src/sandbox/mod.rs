//! The sandbox: what confines a worker, and in which order it is applied.
//!
//! The host decides (from the policy, the kernel's abilities and the operator's settings) a
//! [`SandboxPlan`] per worker; the worker applies it to itself with
//! [`apply_lockdown_to_current_process`] while it still has a single thread, because Landlock
//! and seccomp bind the calling thread and the threads it creates later, never earlier ones.
//!
//! Order, and why:
//! 1. drop every capability — so root's CAP_SYS_ADMIN/CAP_PERFMON cannot reach around Landlock
//!    (e.g. `/proc/<pid>/environ` of the host);
//! 2. `no_new_privs` — required by seccomp for an unprivileged process, and no exec can regain
//!    privileges;
//! 3. not dumpable — no core files, no same-uid ptrace or `/proc/<pid>/mem` of the worker;
//! 4. rlimits (and SIGXFSZ ignored, so a too-large file is an `OSError`, not a death);
//! 5. Landlock — the filesystem view (and TCP, scopes on newer ABIs);
//! 6. seccomp — last, because it would forbid the syscalls the steps above use.
//!
//! Fail closed: in `enforce` mode a layer that cannot be applied is an error and the worker
//! exits without running anything; only `best-effort` continues, and then says what is missing.

pub mod landlock;
pub mod policy;
pub mod rlimits;
pub mod seccomp;
pub mod sys;

use std::path::{Path, PathBuf};

use clap::ValueEnum;
use serde::{Deserialize, Serialize};

use self::landlock::FilesystemGrants;
use self::policy::Policy;
use self::rlimits::WorkerLimits;

/// What to do when a layer cannot be applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum SandboxMode {
    /// Refuse to run code unless every layer is in force (the default).
    Enforce,
    /// Run with whatever layers this host supports, and say which are missing in every result.
    BestEffort,
}

/// Everything a worker needs to lock itself down. Built by the host, applied by the worker.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SandboxPlan {
    pub mode: SandboxMode,
    /// `None` when this kernel has no Landlock (only possible in best-effort mode).
    pub filesystem: Option<FilesystemGrants>,
    pub limits: WorkerLimits,
    pub seccomp: bool,
}

/// The host's view of the sandbox: policy, kernel abilities and the operator's choices.
#[derive(Debug, Clone)]
pub struct Sandbox {
    pub policy: Policy,
    pub mode: SandboxMode,
    pub kernel_landlock_abi: i32,
    /// The ABI actually used: the kernel's, or lower if capped for testing.
    pub landlock_abi: i32,
    pub landlock_abi_cap: Option<i32>,
    pub seccomp_available: bool,
    pub memory_bytes: u64,
}

/// One protection a user relies on and the layers that provide it on this host.
#[derive(Debug, Clone, Serialize)]
pub struct Protection {
    pub protection: &'static str,
    pub layers: Vec<String>,
}

/// The newest Landlock ABI this build knows how to use.
pub const NEWEST_KNOWN_LANDLOCK_ABI: i32 = 7;

impl Sandbox {
    pub fn new(
        policy: Policy,
        mode: SandboxMode,
        abi_cap: Option<i32>,
        memory_override: Option<u64>,
    ) -> Sandbox {
        let kernel = sys::landlock_abi_of_kernel();
        let mut abi = kernel.min(NEWEST_KNOWN_LANDLOCK_ABI);
        if let Some(cap) = abi_cap {
            abi = abi.min(cap.max(0));
        }
        let memory_bytes = memory_override.unwrap_or(policy.limits.memory_mib << 20);
        Sandbox {
            policy,
            mode,
            kernel_landlock_abi: kernel,
            landlock_abi: abi,
            landlock_abi_cap: abi_cap,
            seccomp_available: sys::seccomp_available(),
            memory_bytes,
        }
    }

    /// Layers that cannot be applied on this host, each with what to do about it.
    pub fn missing_layers(&self) -> Vec<String> {
        let mut missing = Vec::new();
        if self.landlock_abi < 1 {
            missing.push(if self.kernel_landlock_abi < 1 {
                "Landlock (the filesystem sandbox): this kernel has no Landlock or it is disabled; use Linux 5.13+ with `lsm=...,landlock` on the kernel command line".to_string()
            } else {
                "Landlock (the filesystem sandbox): disabled by the Landlock ABI cap".to_string()
            });
        }
        if !self.seccomp_available {
            missing.push(
                "seccomp (the syscall filter): this kernel lacks CONFIG_SECCOMP_FILTER".to_string(),
            );
        }
        missing
    }

    /// `Err(message)` when `run_python` must refuse (enforce mode with a missing layer).
    pub fn preflight(&self) -> Result<(), String> {
        let missing = self.missing_layers();
        if missing.is_empty() || self.mode == SandboxMode::BestEffort {
            return Ok(());
        }
        Err(format!(
            "the sandbox cannot be enforced on this host, so no code runs. Missing: {}. \
             To run with weaker isolation anyway, start ironcell with --sandbox best-effort \
             (IRONCELL_SANDBOX=best-effort); `ironcell doctor` shows every layer.",
            missing.join("; ")
        ))
    }

    /// The plan for one worker of a session whose scratch dir is `scratch`.
    pub fn plan_for(&self, scratch: &Path, python_paths: &[PathBuf]) -> SandboxPlan {
        let filesystem = (self.landlock_abi >= 1).then(|| {
            let mut read_only = Vec::new();
            if self.policy.filesystem.python_environment {
                read_only.extend(python_paths.iter().filter(|p| p.exists()).cloned());
            }
            read_only.extend(self.policy.existing_read_only());
            read_only.extend(self.policy.filesystem.allow_read.iter().cloned());
            read_only.sort();
            read_only.dedup();
            let mut read_write = vec![scratch.to_path_buf()];
            read_write.extend(self.policy.filesystem.read_write.iter().cloned());
            read_write.extend(self.policy.filesystem.allow_write.iter().cloned());
            FilesystemGrants {
                abi: self.landlock_abi,
                read_only,
                read_write,
                read_write_files: vec![PathBuf::from("/dev/null")],
            }
        });
        let l = &self.policy.limits;
        SandboxPlan {
            mode: self.mode,
            filesystem,
            limits: WorkerLimits {
                cpu_seconds: l.cpu_seconds,
                memory_bytes: self.memory_bytes,
                file_size_bytes: l.file_size_mib << 20,
                open_files: l.open_files,
            },
            seccomp: self.seccomp_available,
        }
    }

    pub fn scratch_quota_bytes(&self) -> u64 {
        self.policy.limits.scratch_quota_mib << 20
    }

    /// Which layer provides each protection on this host (for `doctor` and `system://info`).
    pub fn protections(&self) -> Vec<Protection> {
        let abi = self.landlock_abi;
        let ll = |since: i32| (abi >= since).then(|| format!("landlock (ABI {abi})"));
        let sc = |what: &str| self.seccomp_available.then(|| format!("seccomp ({what})"));
        let rows: Vec<(&'static str, Vec<Option<String>>)> = vec![
            (
                "files: only Python, system libraries and the session dir",
                vec![ll(1)],
            ),
            (
                "no truncate of files outside the session dir",
                vec![ll(3), sc("truncate refused")],
            ),
            (
                "no TCP connect or bind",
                vec![ll(4), sc("socket() refused")],
            ),
            (
                "no UDP, raw, netlink or unix-path sockets",
                vec![sc("socket() refused")],
            ),
            (
                "no abstract unix socket connects",
                vec![ll(6), sc("socket() refused")],
            ),
            (
                "no signals to other processes",
                vec![ll(6), sc("kill/tgkill only on itself")],
            ),
            (
                "no device ioctls (e.g. TIOCSTI)",
                vec![ll(5), sc("ioctl allow-list")],
            ),
            (
                "no new processes or exec",
                vec![sc("fork/clone/execve refused")],
            ),
            (
                "no ptrace, bpf, namespaces, mounts, keys, io_uring",
                vec![sc("kill-list")],
            ),
            (
                "no capabilities, no new privileges",
                vec![Some("capset + no_new_privs".into())],
            ),
            (
                "CPU, memory, file size, open files",
                vec![Some("rlimits".into())],
            ),
            (
                "wall time, output size, scratch quota, session count",
                vec![Some("host supervisor".into())],
            ),
        ];
        rows.into_iter()
            .map(|(protection, layers)| Protection {
                protection,
                layers: layers.into_iter().flatten().collect(),
            })
            .collect()
    }
}

/// Applies `plan` to the calling process, which must have exactly one thread. Returns the
/// layers that were skipped (best-effort mode only); in enforce mode any failure is an error.
pub fn apply_lockdown_to_current_process(plan: &SandboxPlan) -> Result<Vec<String>, String> {
    let mut missing = Vec::new();
    let mut step = |name: &str, result: Result<(), String>| -> Result<(), String> {
        match result {
            Ok(()) => Ok(()),
            Err(e) if plan.mode == SandboxMode::BestEffort => {
                missing.push(format!("{name}: {e}"));
                Ok(())
            }
            Err(e) => Err(format!("sandbox layer {name} could not be applied: {e}")),
        }
    };
    step(
        "capabilities",
        sys::drop_all_capabilities().map_err(|e| e.to_string()),
    )?;
    step(
        "no_new_privs",
        sys::set_no_new_privs().map_err(|e| e.to_string()),
    )?;
    step(
        "non-dumpable",
        sys::set_not_dumpable().map_err(|e| e.to_string()),
    )?;
    step("SIGXFSZ", sys::ignore_sigxfsz().map_err(|e| e.to_string()))?;
    step(
        "rlimits",
        rlimits::apply_worker_limits(&plan.limits).map_err(|e| e.to_string()),
    )?;
    match &plan.filesystem {
        Some(grants) => step(
            "landlock",
            landlock::install_filesystem_landlock_rules_on_current_thread(grants)
                .map_err(|e| e.to_string()),
        )?,
        None => step("landlock", Err("not available on this kernel".into()))?,
    }
    if plan.seccomp {
        step(
            "seccomp",
            seccomp::install_syscall_filter_on_current_thread(std::process::id())
                .map_err(|e| e.to_string()),
        )?;
    } else {
        step("seccomp", Err("not available on this kernel".into()))?;
    }
    Ok(missing)
}
