//! The sandbox: what confines a worker, and in which order it is applied.
//!
//! The host decides (from the policy, the kernel's abilities and the operator's settings) a
//! [`SandboxPlan`] per worker; the worker applies it to itself with
//! [`apply_lockdown_to_current_process`] while it still has a single thread, because Landlock
//! and seccomp bind the calling thread and the threads it creates later, never earlier ones.
//!
//! Order, and why:
//! 0. a root worker joins a pids cgroup of its own (its thread cap: the kernel never applies
//!    RLIMIT_NPROC to root) — first, while it still has the privilege to;
//! 1. drop every capability — so root's CAP_SYS_ADMIN/CAP_PERFMON cannot reach around Landlock
//!    (e.g. `/proc/<pid>/environ` of the host);
//! 2. `no_new_privs` — required by seccomp for an unprivileged process, and no exec can regain
//!    privileges;
//! 3. not dumpable — no core files, no same-uid ptrace or `/proc/<pid>/mem` of the worker;
//!    transparent huge pages off — a 2 MiB page cut down to 4 KiB would stay whole, past
//!    every limit (SECURITY.md #132); a root worker in a memory cgroup of its own ([`memcg`],
//!    joined at step 0) turns them back on once Landlock (step 5) keeps it from its cgroup's
//!    files: the group charges them whole;
//! 4. rlimits (and SIGXFSZ ignored, so a too-large file is an `OSError`, not a death; and at
//!    most two malloc arenas, so threads do not spend RLIMIT_AS on reserved arenas);
//! 5. Landlock — the filesystem view (and TCP, scopes on newer ABIs);
//! 6. seccomp — last, because it would forbid the syscalls the steps above use; one program,
//!    which refuses `seccomp` itself, so no later filter can be stacked on it (#131).
//!
//! Fail closed: in `enforce` mode a layer that cannot be applied is an error and the worker
//! exits without running anything; only `best-effort` continues, and then says what is missing.

pub mod cgroup;
pub mod epoll_gate;
pub mod landlock;
mod lockdown;
pub mod memcg;
pub mod policy;
pub mod private_tmp;
pub mod rlimits;
pub mod seccomp;
pub mod sys;

use std::path::{Path, PathBuf};

use clap::ValueEnum;
use serde::{Deserialize, Serialize};

pub use self::lockdown::{
    EpollListenerHandOver, LayerError, LockdownError, apply_lockdown_to_current_process,
    apply_lockdown_with_compiled_filters, children_in_this_worker,
};

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

/// Whether root workers get a pids cgroup of their own, their thread cap (see [`cgroup`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum CgroupsMode {
    /// Where the host has a writable cgroup v1 pids hierarchy (root only).
    #[default]
    Auto,
    /// Never: root workers' threads are then not capped (the no-cgroup fallback).
    Off,
}

/// Everything a worker needs to lock itself down. Built by the host, applied by the worker.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SandboxPlan {
    pub mode: SandboxMode,
    /// `None` when this kernel has no Landlock (only possible in best-effort mode).
    pub filesystem: Option<FilesystemGrants>,
    pub limits: WorkerLimits,
    pub seccomp: bool,
    /// Where a root worker makes its pids cgroup (its thread cap); `None`: RLIMIT_NPROC.
    #[serde(default)]
    pub pids_cgroup_parent: Option<PathBuf>,
    /// The memory cgroup a root worker makes and joins, and in which it may then have
    /// transparent huge pages ([`memcg`]); `None`: huge pages off.
    #[serde(default)]
    pub memory_cgroup: Option<memcg::MemoryGroups>,
    /// Whether the worker tries a private mount namespace with its session dir over `/tmp`.
    #[serde(default)]
    pub private_tmp: private_tmp::PrivateTmpMode,
    /// Whether the worker may `fork` children of its own, if its namespace turns out as
    /// [`Sandbox::children`] requires (see [`children_in_this_worker`]).
    #[serde(default)]
    pub children: bool,
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
    /// Where root workers make their pids cgroups (see [`cgroup`]); `None` when not root, when
    /// no writable pids hierarchy exists, or when cgroups are off.
    pub pids_cgroup_parent: Option<PathBuf>,
    /// Where root workers make their memory cgroups ([`memcg`]): `None` where they cannot
    /// (then huge pages are off in every worker).
    pub memory_cgroup_parent: Option<PathBuf>,
    /// Whether session files are memory (a state directory on tmpfs): a memory cgroup's limit
    /// then includes the scratch quota.
    pub files_in_memory: bool,
    /// The operator's choice (`--cgroups`, IRONCELL_CGROUPS); see [`Sandbox::set_cgroups`].
    pub cgroups: CgroupsMode,
    /// Whether workers run as real uid 0, for which the kernel ignores RLIMIT_NPROC.
    pub root_workers: bool,
    /// Private `/tmp` per session (see [`private_tmp`]); set from the settings.
    pub private_tmp: private_tmp::PrivateTmpMode,
    /// Workers that may live at once (sessions and spares); see [`WorkerLimits::workers`].
    pub max_workers: u64,
}

/// Why the workers of this host may not fork children ([`Sandbox::children`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ChildrenRefusal {
    #[error(
        "this kernel's Landlock (ABI {abi}) cannot keep a child's signals inside its session \
         (ABI 6, Linux 6.12+, can)"
    )]
    LandlockAbi { abi: i32 },
    /// `tmp`: what workers get for `/tmp` ([`private_tmp::PrivateTmp::describe`]).
    #[error("sessions have no private /dev/shm ({tmp})")]
    NoPrivateDevShm { tmp: String },
    #[error("nothing would cap a session's processes")]
    NoTaskCap,
}

/// Enforce mode on a host that lacks a layer: `run_python` refuses ([`Sandbox::preflight`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "the sandbox cannot be enforced on this host, so no code runs. Missing: {}. \
     To run with weaker isolation anyway, start ironcell with --sandbox best-effort \
     (IRONCELL_SANDBOX=best-effort); `ironcell doctor` shows every layer.",
    missing.join("; ")
)]
pub struct Unenforceable {
    /// Each missing layer, with what to do about it ([`Sandbox::missing_layers`]).
    pub missing: Vec<String>,
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
            pids_cgroup_parent: cgroup::pids_parent_for_workers(),
            memory_cgroup_parent: cgroup::pids_parent_for_workers()
                .and(memcg::memory_parent_for_workers()),
            files_in_memory: false,
            cgroups: CgroupsMode::Auto,
            root_workers: nix::unistd::getuid().is_root(),
            private_tmp: private_tmp::PrivateTmpMode::Auto,
            max_workers: 1,
        }
    }

    /// RLIMIT_AS of a worker: the memory limit plus the policy's headroom.
    pub fn address_space_bytes(&self) -> u64 {
        self.memory_bytes
            .saturating_add(self.policy.limits.address_space_headroom_mib << 20)
    }

    /// `off` proves (and lets operators choose) the no-cgroup fallback.
    pub fn set_cgroups(&mut self, mode: CgroupsMode) {
        self.cgroups = mode;
        self.pids_cgroup_parent = match mode {
            CgroupsMode::Auto => cgroup::pids_parent_for_workers(),
            CgroupsMode::Off => None,
        };
        self.memory_cgroup_parent = self
            .pids_cgroup_parent
            .as_ref()
            .and(memcg::memory_parent_for_workers());
    }

    /// The memory cgroups root workers join, with one session's limit: the memory limit plus
    /// [`memcg::SLACK_BYTES`], plus the scratch quota where session files are memory.
    /// `None` also where a grant lets workers write beneath the groups (they could raise
    /// their own limit).
    pub fn memory_groups(&self) -> Option<memcg::MemoryGroups> {
        let parent = self.memory_cgroup_parent.clone()?;
        let fs = &self.policy.filesystem;
        if fs
            .read_write
            .iter()
            .chain(&fs.allow_write)
            .any(|g| parent.starts_with(g))
        {
            return None;
        }
        let files = if self.files_in_memory {
            self.scratch_quota_bytes()
        } else {
            0
        };
        Some(memcg::MemoryGroups {
            parent,
            limit_bytes: self
                .memory_bytes
                .saturating_add(memcg::SLACK_BYTES)
                .saturating_add(files),
        })
    }

    /// Where this server's workers make their cgroups: what the host removes as they go.
    pub fn worker_groups(&self) -> cgroup::WorkerGroups {
        cgroup::WorkerGroups {
            pids: self.pids_cgroup_parent.clone(),
            memory: self.memory_groups(),
        }
    }

    /// How a worker's transparent huge pages are kept from holding memory no limit counts
    /// (SECURITY.md #132, #271), for `doctor` and `system://info`: in a memory cgroup only
    /// where sessions may fork (`children`), which huge pages make faster.
    pub fn huge_pages_layer(&self, children: bool) -> String {
        match self.memory_groups().filter(|_| children) {
            Some(g) => format!(
                "memory cgroup v1 per session and its forks ({} MiB each, under {}): huge pages \
                 on, charged whole",
                g.limit_bytes >> 20,
                g.parent.display()
            ),
            None => "prctl(PR_SET_THP_DISABLE): huge pages off".into(),
        }
    }

    /// `Ok` when a worker may `fork` children of its own (never `exec`), else why not, with the
    /// fix (SECURITY.md #158-#160). Children need what confines them as it confines the worker:
    /// Landlock's signal scope (ABI 6), which keeps their signals and the worker's inside the
    /// worker's own domain, so `kill` and `tgkill` need no pid rule that would name the parent
    /// in a child; a private `/dev/shm` (the session directory), so their semaphores and shared
    /// memory reach no other session and count against the scratch quota; and a task cap that
    /// counts them (a pids cgroup, or RLIMIT_NPROC in the worker's own user namespace).
    pub fn children(&self, tmp: &private_tmp::PrivateTmp) -> Result<(), ChildrenRefusal> {
        if self.landlock_abi < 6 {
            return Err(ChildrenRefusal::LandlockAbi {
                abi: self.landlock_abi,
            });
        }
        if !tmp.private_dev_shm() {
            return Err(ChildrenRefusal::NoPrivateDevShm {
                tmp: tmp.describe(),
            });
        }
        if self.pids_cgroup_parent.is_none() && (self.root_workers || !tmp.in_own_user_namespace())
        {
            return Err(ChildrenRefusal::NoTaskCap);
        }
        Ok(())
    }

    /// Why nothing caps a worker's threads, with the fix, when [`Sandbox::thread_cap_layer`]
    /// is `None`.
    pub fn no_thread_cap_reason(&self) -> &'static str {
        match self.cgroups {
            CgroupsMode::Off => {
                "workers run as root, which RLIMIT_NPROC never binds, and IRONCELL_CGROUPS=off \
                 (--cgroups off) keeps them out of a pids cgroup (unset it, or run ironcell as a \
                 normal user)"
            }
            CgroupsMode::Auto => {
                "workers run as root, which RLIMIT_NPROC never binds, and no writable pids \
                 cgroup exists (run ironcell as a normal user, or as root with the cgroup v1 \
                 pids hierarchy mounted and writable)"
            }
        }
    }

    /// What caps a worker's threads on this host, or `None` when nothing does. `tmp` is what
    /// workers get for `/tmp` ([`private_tmp::host_status`]): in a user namespace of its own a
    /// worker's RLIMIT_NPROC counts only its own tasks.
    pub fn thread_cap_layer(&self, tmp: &private_tmp::PrivateTmp) -> Option<String> {
        let n = self.policy.limits.threads;
        if let Some(parent) = &self.pids_cgroup_parent {
            Some(format!(
                "pids cgroup v1 (pids.max {n}, under {})",
                parent.display()
            ))
        } else if !self.root_workers && tmp.in_own_user_namespace() {
            Some(format!(
                "RLIMIT_NPROC in the worker's own user namespace ({n} per session)"
            ))
        } else if !self.root_workers {
            Some(format!(
                "RLIMIT_NPROC shared by the uid ({n} per worker more than the tasks at worker start) + host watch ({n} per session)"
            ))
        } else {
            None
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

    /// `Err` when `run_python` must refuse (enforce mode with a missing layer).
    pub fn preflight(&self) -> Result<(), Unenforceable> {
        let missing = self.missing_layers();
        if missing.is_empty() || self.mode == SandboxMode::BestEffort {
            return Ok(());
        }
        Err(Unenforceable { missing })
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
        let children = self.landlock_abi >= 6
            && self.seccomp_available
            && self.private_tmp == private_tmp::PrivateTmpMode::Auto
            && (self.pids_cgroup_parent.is_some() || !self.root_workers);
        SandboxPlan {
            mode: self.mode,
            filesystem,
            limits: WorkerLimits {
                cpu_seconds: l.cpu_seconds,
                memory_bytes: self.memory_bytes,
                address_space_bytes: self.address_space_bytes(),
                file_size_bytes: l.file_size_mib << 20,
                open_files: l.open_files,
                threads: l.threads,
                workers: self.max_workers,
            },
            seccomp: self.seccomp_available,
            pids_cgroup_parent: self.pids_cgroup_parent.clone(),
            // Only where sessions may fork: joining costs each worker ~0.26 ms (#271).
            memory_cgroup: children.then(|| self.memory_groups()).flatten(),
            private_tmp: self.private_tmp,
            children,
        }
    }

    pub fn scratch_quota_bytes(&self) -> u64 {
        self.policy.limits.scratch_quota_mib << 20
    }

    /// Which layer provides each protection on this host (for `doctor` and `system://info`),
    /// given what workers get for `/tmp` ([`private_tmp::host_status`]).
    ///
    /// Long on purpose: the table `doctor` prints, one row per protection with its layers.
    pub fn protections(&self, tmp: &private_tmp::PrivateTmp) -> Vec<Protection> {
        let abi = self.landlock_abi;
        let ll = |since: i32| (abi >= since).then(|| format!("landlock (ABI {abi})"));
        let children = self.children(tmp).is_ok();
        let sc = |what: &str| self.seccomp_available.then(|| format!("seccomp ({what})"));
        let rows: Vec<(&'static str, Vec<Option<String>>)> = vec![
            (
                "files: only Python, system libraries and the session dir",
                vec![ll(1)],
            ),
            (
                "no truncate of files outside the session dir",
                vec![
                    ll(3),
                    sc("truncate refused; open with O_TRUNC only for writing; no openat2"),
                ],
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
                vec![
                    ll(6),
                    sc(if children {
                        "kill/tgkill left to the signal scope (the session's own processes); fcntl F_SETOWN, F_SETSIG, F_SETLEASE, F_NOTIFY and O_ASYNC refused"
                    } else {
                        "kill/tgkill only on itself; fcntl F_SETOWN, F_SETSIG, F_SETLEASE, F_NOTIFY and O_ASYNC refused"
                    }),
                ],
            ),
            (
                "no reading other processes by pid (session, group, priority, CPU clock)",
                vec![sc(
                    "getsid, getpgid, getpriority, sched_get*, get_robust_list and CPU clocks only on itself; no PI futexes",
                )],
            ),
            (
                "no chmod or chown of any file; utime only of session files, by the host",
                vec![sc("metadata calls refused, by path and by fd")],
            ),
            (
                "no device ioctls (e.g. TIOCSTI)",
                vec![ll(5), sc("ioctl allow-list")],
            ),
            (
                "no exec; child processes only inside the session",
                if children {
                    vec![
                        sc("execve refused; clone only as fork; pid calls only on the caller"),
                        ll(6).map(|l| format!("{l} signal scope")),
                        Some("host: children capped, counted and killed with the session".into()),
                    ]
                } else {
                    vec![sc("fork/clone/execve refused")]
                },
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
                "no uncounted shared memory: mmap(-1, n), memfd",
                vec![
                    Some(format!(
                        "RLIMIT_AS ({} MiB: memory + headroom)",
                        self.address_space_bytes() >> 20
                    )),
                    sc("shared anonymous mmap and memfd_create refused"),
                ],
            ),
            (
                "no BPF programs of its own: seccomp, socket filters",
                vec![sc("seccomp() and SO_ATTACH_* refused")],
            ),
            (
                "no uncounted huge pages (2 MiB kept for 4 KiB)",
                vec![Some(self.huge_pages_layer(children))],
            ),
            (
                "memory the data limit misses (mprotect, MAP_GROWSDOWN)",
                vec![Some("host memory watch (RssAnon + VmSwap + VmPTE)".into())],
            ),
            ("threads capped", vec![self.thread_cap_layer(tmp)]),
            (
                "no other process visible in /proc or /sys",
                vec![
                    tmp.own_namespace()
                        .map(|_| "mount namespace (empty, read-only /proc and /sys)".to_string()),
                ],
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

impl SandboxPlan {
    /// Every path the plan grants, read-only or read-write.
    pub fn granted_paths(&self) -> Vec<&Path> {
        self.filesystem
            .iter()
            .flat_map(|g| {
                g.read_only
                    .iter()
                    .chain(&g.read_write)
                    .chain(&g.read_write_files)
            })
            .map(PathBuf::as_path)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::CString;
    use std::os::unix::fs::PermissionsExt;

    /// Runs `attack` in a forked child after the real lockdown; the child's exit code is the
    /// number of the first check that failed (0: all held).
    fn in_locked_down_child(scratch: &Path, attack: impl FnOnce() -> i32) -> i32 {
        let sandbox = Sandbox::new(
            Policy::load("default").unwrap(),
            SandboxMode::Enforce,
            None,
            None,
        );
        let plan = sandbox.plan_for(scratch, &[]);
        // Compiled before the fork, installed after it: what the zygote and its workers do.
        let compiled = seccomp::CompiledWorkerFilters::compile().unwrap();
        // SAFETY: the child only runs the lockdown and the attack, then _exit()s.
        match unsafe { libc::fork() } {
            0 => {
                let none = private_tmp::PrivateTmp::Fallback {
                    reason: String::new(),
                    allowed: Vec::new(),
                    namespace: None,
                    dev_shm: false,
                };
                let code =
                    match apply_lockdown_with_compiled_filters(&plan, Some(&compiled), &none, None)
                    {
                        Ok(_) => attack(),
                        Err(_) => 100,
                    };
                // SAFETY: ends the child without running the parent's atexit handlers.
                unsafe { libc::_exit(code) }
            }
            pid if pid > 0 => {
                let mut status = 0;
                // SAFETY: waiting for our own child.
                unsafe { libc::waitpid(pid, &mut status, 0) };
                assert!(libc::WIFEXITED(status), "child status {status:#x}");
                libc::WEXITSTATUS(status)
            }
            _ => panic!("fork failed: {}", std::io::Error::last_os_error()),
        }
    }

    fn errno() -> i32 {
        std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
    }

    #[test]
    fn a_locked_down_process_cannot_chmod_open_connect_exec_or_signal_out() {
        if sys::landlock_abi_of_kernel() < 1 || !sys::seccomp_available() {
            eprintln!("skipped: this kernel has no Landlock or seccomp");
            return;
        }
        let dir = std::env::temp_dir().join(format!("ironcell-lockdown-{}", std::process::id()));
        let scratch = dir.join("scratch");
        std::fs::create_dir_all(&scratch).unwrap();
        let victim = dir.join("victim");
        std::fs::write(&victim, "secret").unwrap();
        std::fs::set_permissions(&victim, std::fs::Permissions::from_mode(0o600)).unwrap();
        let victim_c = CString::new(victim.to_str().unwrap()).unwrap();
        let scratch_file = CString::new(scratch.join("f").to_str().unwrap()).unwrap();

        let failed_check = in_locked_down_child(&scratch, || {
            // SAFETY (all calls below): plain syscalls with valid C strings and integers.
            unsafe {
                if libc::chmod(victim_c.as_ptr(), 0o644) == 0 || errno() != libc::EPERM {
                    return 1;
                }
                let fd = libc::open(victim_c.as_ptr(), libc::O_RDONLY);
                if fd >= 0 || errno() != libc::EACCES {
                    return 2;
                }
                if libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0) >= 0 || errno() != libc::EPERM
                {
                    return 3;
                }
                let sh = CString::new("/bin/sh").unwrap();
                let argv = [sh.as_ptr(), std::ptr::null()];
                let envp = [std::ptr::null()];
                if libc::execve(sh.as_ptr(), argv.as_ptr(), envp.as_ptr()) == 0
                    || errno() != libc::EPERM
                {
                    return 4;
                }
                let mut fds = [0; 2];
                if libc::pipe(fds.as_mut_ptr()) != 0 {
                    return 5;
                }
                if libc::fcntl(fds[0], libc::F_SETOWN, libc::getppid()) == 0
                    || errno() != libc::EPERM
                {
                    return 6;
                }
                if libc::fcntl(fds[0], libc::F_SETFL, libc::O_ASYNC) == 0 || errno() != libc::EPERM
                {
                    return 7;
                }
                if libc::fcntl(fds[0], libc::F_SETFL, libc::O_NONBLOCK) != 0 {
                    return 8;
                }
                // The session dir still works, but even its files' modes cannot change.
                let f = libc::open(scratch_file.as_ptr(), libc::O_CREAT | libc::O_WRONLY, 0o600);
                if f < 0 || libc::write(f, b"x".as_ptr().cast(), 1) != 1 {
                    return 9;
                }
                if libc::fchmod(f, 0o4755) == 0 || errno() != libc::EPERM {
                    return 10;
                }
                if libc::kill(libc::getppid(), 0) == 0 || errno() != libc::EPERM {
                    return 11;
                }
                if libc::getsid(libc::getppid()) >= 0 || errno() != libc::EPERM {
                    return 12;
                }
                if libc::getsid(0) < 0 {
                    return 13;
                }
            }
            0
        });
        let mode = std::fs::metadata(&victim).unwrap().permissions().mode() & 0o7777;
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(
            failed_check, 0,
            "check {failed_check} did not hold (100: lockdown failed)"
        );
        assert_eq!(mode, 0o600);
    }
}
