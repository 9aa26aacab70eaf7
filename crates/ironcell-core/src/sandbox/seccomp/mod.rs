//! The system-call part of the lockdown, with `seccompiler`.
//!
//! Three filters, as if stacked: the kernel runs all of them and the most severe verdict wins;
//! between two errno verdicts, the filter installed last wins. So:
//!
//! 1. **allow-list** (installed first): the syscalls ordinary Python needs — taken from an
//!    strace census of stdlib, asyncio, threads, sqlite3 and numpy/pandas workloads — and
//!    nothing else. Anything unknown gets `ENOSYS`, so libc and CPython fall back or raise
//!    cleanly. Being default-deny, it also rejects x32 syscall numbers, which a default-allow
//!    filter would miss.
//! 2. **refusals** (installed second): calls that must fail with `EPERM`, so Python raises a
//!    readable `PermissionError`: new processes, `socket()`, signals or rlimits aimed at another
//!    process, identity changes, `TIOCSTI`, file metadata changes (`chmod`, `chown`, `utime`
//!    and their fd forms), `memfd_create`, the old `epoll_create`, the `fcntl` commands that signal on
//!    the worker's behalf (`F_SETOWN`, `F_SETOWN_EX`, `F_SETSIG`, `F_SETLEASE`, `F_NOTIFY`,
//!    `O_ASYNC`), raising a socket's buffer sizes (`SO_SNDBUF`, `SO_RCVBUF`), `sendmsg`
//!    (descriptors in flight) and shared anonymous mappings.
//! 3. **kill-list** (installed last): calls with no business in a sandbox and a history of
//!    kernel exploits end the process at once.
//!
//! Between the allow-list and the refusals sits a fourth, small one, **unsupported**: calls
//! answered `EOPNOTSUPP`, as a filesystem without the feature would answer, so libc takes its
//! slower portable path. Only `fallocate` mode 0: the kernel allocates blocks at 10+ GiB/s
//! without a page written, faster than the free-disk guard can look (SECURITY.md #144), and
//! glibc's `posix_fallocate` then writes a byte per block instead (0.4-0.7 GiB/s).
//!
//! The four are installed as **one** program ([`merge_stacked`]): the kill-list's, then the
//! refusals', the unsupported calls' and the allow-list's instructions, each earlier program's
//! "allow" turned into a jump to the next. The kernel converts and JIT-compiles every filter a
//! worker installs, and runs every installed filter on every system call; one program costs
//! one of each, with exactly the verdicts of the four stacked (a unit test compares them on
//! every system call).
//!
//! These rules do not depend on the kernel's Landlock ABI: they are what provides the
//! no-network, no-signals-out and no-device-ioctl protections on kernels whose Landlock cannot,
//! and the no-metadata-change protection on every kernel (no Landlock ABI mediates it).

mod compiled;
mod program;

use std::collections::BTreeMap;

use seccompiler::{
    BpfProgram, SeccompCmpArgLen as Len, SeccompCmpOp as Op, SeccompCondition as Cond, SeccompRule,
    TargetArch,
};

pub use self::compiled::CompiledWorkerFilters;
use self::program::searched_program;
pub use self::program::{merge_stacked, stacked_worker_filters};

#[derive(Debug, thiserror::Error)]
pub enum SeccompError {
    #[error("building the seccomp filter: {0}")]
    Build(#[from] seccompiler::BackendError),
    #[error("installing the seccomp filter: {0}")]
    Install(#[from] seccompiler::Error),
    #[error("seccomp filters are only built for x86_64 and aarch64")]
    UnsupportedArch,
    #[error("the compiled seccomp filters depend on the pid in an unexpected way")]
    PidTemplate,
    #[error("merging the seccomp filters into one program: {0}")]
    Merge(&'static str),
}

fn arch() -> Result<TargetArch, SeccompError> {
    if cfg!(target_arch = "x86_64") {
        Ok(TargetArch::x86_64)
    } else if cfg!(target_arch = "aarch64") {
        Ok(TargetArch::aarch64)
    } else {
        Err(SeccompError::UnsupportedArch)
    }
}

type Rules = BTreeMap<i64, Vec<SeccompRule>>;

/// Which processes a worker's pid-aware rules let a call name (SECURITY.md #158).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Processes {
    /// No children (fork refused): calls name the worker by 0 or by its pid, and signals go
    /// only to that pid. For kernels whose Landlock cannot scope signals (ABI < 6).
    Alone { own_pid: u32 },
    /// The worker may `fork` (never `exec`) children of its own. A child keeps the filter, so
    /// a rule holding the worker's pid would name the *parent* there (a child lowered its
    /// parent's `RLIMIT_NOFILE` through `prlimit64`): every pid-reading or -acting call names
    /// only the caller, by 0, and `kill`/`tgkill` take any pid, fenced by Landlock's signal
    /// scope (ABI 6+), which confines signals to the worker's own domain: itself and its
    /// children, never another session or the host.
    WithChildren,
}

impl Processes {
    /// The pids a call may name for "the caller": 0, and the worker's pid when it is alone.
    fn selves(self) -> Vec<u32> {
        match self {
            Processes::Alone { own_pid } => vec![0, own_pid],
            Processes::WithChildren => vec![0],
        }
    }
}

/// glibc's `fork()` (and CPython's `os.fork`): `clone(CLONE_CHILD_SETTID | CLONE_CHILD_CLEARTID
/// | SIGCHLD)`, nothing shared, no namespace. The one process-making clone a worker with
/// children may make.
pub const FORK_FLAGS: u64 =
    (libc::CLONE_CHILD_SETTID | libc::CLONE_CHILD_CLEARTID | libc::SIGCHLD) as u64;

fn always(rules: &mut Rules, syscalls: &[libc::c_long]) {
    for &nr in syscalls {
        rules.insert(nr, Vec::new());
    }
}

fn when(rules: &mut Rules, nr: libc::c_long, conds: Vec<Cond>) -> Result<(), SeccompError> {
    rules.entry(nr).or_default().push(SeccompRule::new(conds)?);
    Ok(())
}

fn arg32(index: u8, op: Op, value: u64) -> Result<Cond, SeccompError> {
    Ok(Cond::new(index, Len::Dword, op, value)?)
}

/// Syscalls allowed without conditions, grouped by why.
#[rustfmt::skip]
const ALLOWED: &[libc::c_long] = &[
    // Files and directories (Landlock decides which paths). Not `splice` or `sendfile`: one
    // byte spliced into a pipe or a socket holds a reference to its whole page-cache folio (2
    // MiB from a huge-page mapping of a sparse file), which no limit counts and which outlives
    // the file's name (SECURITY.md #122); `shutil.copyfile` and `socket.sendfile` fall back to
    // reads and writes. Not `openat2`: its flags are in a struct the filter cannot read, so an
    // `O_TRUNC` in them could not be checked (see [`OPEN_TRUNCATES_WITHOUT_WRITE`]); glibc and
    // CPython open with `openat`, and `openat2` gets ENOSYS. The path forms of the xattr reads
    // are in [`UNSUPPORTED`].
    libc::SYS_read, libc::SYS_write, libc::SYS_readv, libc::SYS_writev, libc::SYS_pread64,
    libc::SYS_pwrite64, libc::SYS_preadv, libc::SYS_pwritev, libc::SYS_preadv2, libc::SYS_pwritev2,
    libc::SYS_lseek, libc::SYS_close, libc::SYS_close_range, libc::SYS_openat,
    libc::SYS_newfstatat, libc::SYS_fstat, libc::SYS_statx, libc::SYS_statfs, libc::SYS_fstatfs,
    libc::SYS_faccessat, libc::SYS_faccessat2, libc::SYS_readlinkat, libc::SYS_getdents64,
    libc::SYS_getcwd, libc::SYS_chdir, libc::SYS_fchdir, libc::SYS_mkdirat, libc::SYS_renameat,
    libc::SYS_renameat2, libc::SYS_unlinkat, libc::SYS_symlinkat, libc::SYS_linkat,
    libc::SYS_fsync, libc::SYS_fdatasync, libc::SYS_ftruncate, libc::SYS_fallocate, libc::SYS_flock,
    libc::SYS_dup, libc::SYS_dup3, libc::SYS_pipe2, libc::SYS_copy_file_range,
    libc::SYS_fadvise64, libc::SYS_fgetxattr, libc::SYS_flistxattr, libc::SYS_umask,
    // Memory (PROT_EXEC is needed to load extension modules).
    libc::SYS_mmap, libc::SYS_mprotect, libc::SYS_munmap, libc::SYS_mremap, libc::SYS_madvise,
    libc::SYS_brk, libc::SYS_msync, libc::SYS_mincore, libc::SYS_mbind, libc::SYS_get_mempolicy,
    libc::SYS_set_mempolicy, libc::SYS_mlock, libc::SYS_munlock, libc::SYS_membarrier,
    // Threads, futexes, signals to itself (Python threads, ThreadPoolExecutor, asyncio.to_thread).
    // futex: only its commands without priority inheritance (`allow_list`, FUTEX_ALLOWED).
    libc::SYS_set_robust_list, libc::SYS_get_robust_list, libc::SYS_rseq,
    libc::SYS_set_tid_address, libc::SYS_rt_sigaction, libc::SYS_rt_sigprocmask,
    libc::SYS_rt_sigreturn, libc::SYS_sigaltstack, libc::SYS_rt_sigtimedwait,
    libc::SYS_rt_sigsuspend, libc::SYS_rt_sigpending, libc::SYS_sched_yield,
    libc::SYS_sched_getparam, libc::SYS_sched_getscheduler,
    libc::SYS_sched_get_priority_max, libc::SYS_sched_get_priority_min, libc::SYS_exit,
    libc::SYS_exit_group, libc::SYS_kill, libc::SYS_tgkill, libc::SYS_clone, libc::SYS_prlimit64,
    // Waiting for its own children (the kernel lets no process wait for another's).
    libc::SYS_wait4, libc::SYS_waitid,
    // Identity and system facts (read-only).
    libc::SYS_getpid, libc::SYS_gettid, libc::SYS_getppid, libc::SYS_getuid, libc::SYS_geteuid,
    libc::SYS_getgid, libc::SYS_getegid, libc::SYS_getresuid, libc::SYS_getresgid,
    libc::SYS_getgroups, libc::SYS_getpgid, libc::SYS_getsid, libc::SYS_getrandom,
    libc::SYS_uname, libc::SYS_sysinfo, libc::SYS_getpriority, libc::SYS_getrusage,
    libc::SYS_getrlimit, libc::SYS_setrlimit, libc::SYS_times,
    // Time.
    libc::SYS_clock_gettime, libc::SYS_clock_getres, libc::SYS_clock_nanosleep,
    libc::SYS_nanosleep, libc::SYS_gettimeofday, libc::SYS_setitimer, libc::SYS_getitimer,
    libc::SYS_timer_create, libc::SYS_timer_settime, libc::SYS_timer_gettime,
    libc::SYS_timer_delete, libc::SYS_timerfd_create, libc::SYS_timerfd_settime,
    libc::SYS_timerfd_gettime,
    // Event loops (asyncio's selector and self-pipe socketpair; the session socket). epoll's
    // watches are kernel memory from a budget the whole uid shares (SECURITY.md #115): the
    // epoll gate, a program of its own installed before this one, has the host count every
    // `EPOLL_CTL_ADD`, or refuses `epoll_create1` where no host counts (`epoll_gate.rs`).
    libc::SYS_epoll_create1, libc::SYS_eventfd2, libc::SYS_epoll_ctl, libc::SYS_epoll_pwait,
    libc::SYS_epoll_pwait2, libc::SYS_ppoll, libc::SYS_pselect6, libc::SYS_sendto,
    libc::SYS_recvfrom, libc::SYS_recvmsg, libc::SYS_getsockname,
    libc::SYS_getpeername, libc::SYS_getsockopt, libc::SYS_setsockopt, libc::SYS_shutdown,
];

/// x86_64 keeps the old path-based calls; glibc and CPython still use some of them.
#[cfg(target_arch = "x86_64")]
#[rustfmt::skip]
const ALLOWED_LEGACY: &[libc::c_long] = &[
    libc::SYS_open, libc::SYS_stat, libc::SYS_lstat, libc::SYS_access, libc::SYS_readlink,
    libc::SYS_mkdir, libc::SYS_rmdir, libc::SYS_rename, libc::SYS_unlink, libc::SYS_symlink,
    libc::SYS_link, libc::SYS_dup2,
    libc::SYS_pipe, libc::SYS_poll, libc::SYS_select, libc::SYS_epoll_wait,
    libc::SYS_getdents, libc::SYS_time, libc::SYS_arch_prctl,
    libc::SYS_alarm, libc::SYS_pause, libc::SYS_getpgrp,
    libc::SYS_eventfd, libc::SYS_signalfd4,
];
#[cfg(not(target_arch = "x86_64"))]
const ALLOWED_LEGACY: &[libc::c_long] = &[];

/// Always refused with EPERM.
#[rustfmt::skip]
const REFUSED: &[libc::c_long] = &[
    libc::SYS_socket, libc::SYS_connect, libc::SYS_bind, libc::SYS_listen, libc::SYS_accept,
    libc::SYS_accept4, libc::SYS_execve, libc::SYS_execveat, libc::SYS_setpriority,
    libc::SYS_chroot, libc::SYS_setuid, libc::SYS_setgid, libc::SYS_setreuid, libc::SYS_setregid,
    libc::SYS_setresuid, libc::SYS_setresgid, libc::SYS_setgroups, libc::SYS_setsid,
    libc::SYS_tkill, libc::SYS_truncate, libc::SYS_mknodat,
    libc::SYS_sched_setaffinity, libc::SYS_sched_setscheduler, libc::SYS_capset,
    // File metadata (SECURITY.md #46). Landlock does not mediate mode, owner or times, so by
    // path these reach any file the uid owns (a root worker made a copy of a binary setuid;
    // a user's worker made `~/.ssh/id_rsa` world-readable). The fd forms are refused too: an fd
    // opened read-only through a read-only grant (the Python installation, owned by root or by
    // the user who made the venv) would still let `fchmod` change that file's mode. Python's
    // own file handling does not need them; `shutil.copy`/`copy2`/`copytree` raise
    // PermissionError at the copymode step (`shutil.copyfile` works) and `tarfile` logs and
    // skips the mode, owner and times of extracted members.
    libc::SYS_fchmod, libc::SYS_fchmodat, FCHMODAT2, libc::SYS_fchown, libc::SYS_fchownat,
    libc::SYS_utimensat,
    // Shared memory the memory limit cannot count (SECURITY.md #48): a memfd's pages belong to
    // no mapping, so neither RLIMIT_DATA nor RLIMIT_AS sees them. Nothing in a Python workload
    // needs one.
    libc::SYS_memfd_create,
    // Descriptors in flight (SECURITY.md #117, #121): `SCM_RIGHTS` messages a worker sends to
    // itself and never reads count against a budget of its uid, which the kernel checks
    // against the *sender's* RLIMIT_NOFILE before it copies the message in: threads faulting
    // on evicted pages inside that window put 20,000+ descriptors in flight, and the host could
    // then hand no new worker its socket (ETOOMANYREFS). `sendmsg` is the only call that
    // carries them (`sendmmsg` is not allowed); Python's sockets send with `send`/`sendto`.
    libc::SYS_sendmsg,
    // BPF programs of the worker's own (SECURITY.md #131): every seccomp filter is a program
    // the kernel converts and JIT-compiles into executable kernel memory that no rlimit counts,
    // kept until the last thread it binds ends, and each new thread may stack filters anew.
    // 200 threads stacked ~700,000 one-instruction filters (4.7 GB, 2.9 GB of it vmalloc), and
    // freeing them all when the worker ended deadlocked a 6.18 kernel's BPF allocator: no
    // process on the machine could install a filter again until a reboot. The worker's own
    // filter is a single program, installed before these refusals are in force; the
    // `prctl(PR_SET_SECCOMP)` form is not on the prctl allow-list (ENOSYS).
    libc::SYS_seccomp,
];
/// `fchmodat2` (Linux 6.6) has the same number on every architecture; not every libc target
/// names it.
const FCHMODAT2: libc::c_long = 452;
#[cfg(target_arch = "x86_64")]
#[rustfmt::skip]
const REFUSED_LEGACY: &[libc::c_long] = &[
    libc::SYS_fork, libc::SYS_vfork, libc::SYS_mknod, libc::SYS_epoll_create,
    // The legacy metadata calls (#46).
    libc::SYS_chmod, libc::SYS_chown, libc::SYS_lchown, libc::SYS_utime, libc::SYS_utimes,
    libc::SYS_futimesat,
];
#[cfg(not(target_arch = "x86_64"))]
const REFUSED_LEGACY: &[libc::c_long] = &[];

#[cfg(target_arch = "x86_64")]
fn is_vfork(nr: libc::c_long) -> bool {
    nr == libc::SYS_vfork
}
#[cfg(not(target_arch = "x86_64"))]
fn is_vfork(_: libc::c_long) -> bool {
    false
}

/// End the process: debugging, other processes' memory, kernel attack surface, namespaces,
/// mounts, keys, modules.
#[rustfmt::skip]
const KILLED: &[libc::c_long] = &[
    libc::SYS_ptrace, libc::SYS_process_vm_readv, libc::SYS_process_vm_writev, libc::SYS_bpf,
    libc::SYS_perf_event_open, libc::SYS_userfaultfd, libc::SYS_keyctl, libc::SYS_add_key,
    libc::SYS_request_key, libc::SYS_unshare, libc::SYS_setns, libc::SYS_mount, libc::SYS_umount2,
    libc::SYS_pivot_root, libc::SYS_fsopen, libc::SYS_fsmount, libc::SYS_fsconfig,
    libc::SYS_fspick, libc::SYS_move_mount, libc::SYS_open_tree, libc::SYS_mount_setattr,
    libc::SYS_io_uring_setup, libc::SYS_io_uring_enter, libc::SYS_io_uring_register,
    libc::SYS_kexec_load, libc::SYS_kexec_file_load, libc::SYS_init_module,
    libc::SYS_finit_module, libc::SYS_delete_module, libc::SYS_reboot, libc::SYS_swapon,
    libc::SYS_swapoff, libc::SYS_acct, libc::SYS_quotactl, libc::SYS_name_to_handle_at,
    libc::SYS_open_by_handle_at, libc::SYS_syslog, libc::SYS_settimeofday,
    libc::SYS_clock_settime, libc::SYS_clock_adjtime, libc::SYS_adjtimex, libc::SYS_sethostname,
    libc::SYS_setdomainname, libc::SYS_pidfd_open, libc::SYS_pidfd_getfd,
    libc::SYS_pidfd_send_signal, libc::SYS_process_madvise, libc::SYS_kcmp,
    libc::SYS_lookup_dcookie, libc::SYS_personality, libc::SYS_vhangup,
];
#[cfg(target_arch = "x86_64")]
const KILLED_LEGACY: &[libc::c_long] = &[
    libc::SYS_iopl,
    libc::SYS_ioperm,
    libc::SYS_uselib,
    libc::SYS_modify_ldt,
];
#[cfg(not(target_arch = "x86_64"))]
const KILLED_LEGACY: &[libc::c_long] = &[];

// The request constants are `c_ulong` on some targets and `c_int` on others.
#[allow(clippy::unnecessary_cast)]
/// ioctl requests a Python program legitimately makes: terminal queries from `isatty()` and
/// `os.get_terminal_size()`, and close-on-exec / non-blocking toggles.
const IOCTL_ALLOWED: &[u64] = &[
    libc::TCGETS as u64,
    libc::TIOCGWINSZ as u64,
    libc::TIOCGPGRP as u64,
    libc::FIOCLEX as u64,
    libc::FIONCLEX as u64,
    libc::FIONBIO as u64,
    libc::FIONREAD as u64,
];

#[allow(clippy::unnecessary_cast)]
/// `fcntl` commands Python makes: descriptor flags and duplication (`os.set_inheritable`,
/// `os.set_blocking`, `dup`), record locks for sqlite3 (classic and open-file-description), the
/// pipe size. `F_SETFL` is listed separately: allowed only without `O_ASYNC`.
const FCNTL_ALLOWED: &[u64] = &[
    libc::F_DUPFD as u64,
    libc::F_DUPFD_CLOEXEC as u64,
    libc::F_GETFD as u64,
    libc::F_SETFD as u64,
    libc::F_GETFL as u64,
    libc::F_GETLK as u64,
    libc::F_SETLK as u64,
    libc::F_SETLKW as u64,
    libc::F_OFD_GETLK as u64,
    libc::F_OFD_SETLK as u64,
    libc::F_OFD_SETLKW as u64,
    libc::F_GETPIPE_SZ as u64,
];

/// Linux's values on every architecture (`uapi/asm-generic/fcntl.h`); not every libc target
/// names them.
const F_SETSIG: u64 = 10;
const F_SETOWN_EX: u64 = 15;

#[allow(clippy::unnecessary_cast)]
/// `fcntl` commands that make the kernel signal or notify on the worker's behalf (SECURITY.md
/// #47): with an owner set by `F_SETOWN`/`F_SETOWN_EX`, `O_ASYNC` I/O, leases and directory
/// notifications send a signal (chosen by `F_SETSIG`) to any process the uid may signal. Only
/// Landlock's signal scope (ABI 6) covers that, so seccomp refuses them on every ABI.
const FCNTL_REFUSED: &[u64] = &[
    libc::F_SETOWN as u64,
    F_SETOWN_EX,
    F_SETSIG,
    libc::F_SETLEASE as u64,
    libc::F_NOTIFY as u64,
];

/// `SOL_SOCKET` options refused with EPERM on every socket:
/// - the buffer sizes (`SO_SNDBUF`, `SO_RCVBUF` and their `*FORCE` forms, which need
///   CAP_NET_ADMIN anyway). A socket's queued data is kernel memory that no rlimit of the
///   worker counts; raised to the host's `net.core.wmem_max` (4 MiB on some machines, more on
///   hosts tuned for networking), 510 socketpairs held ~8 GB (SECURITY.md #112). At the
///   defaults a worker's 1,024 descriptors hold ~0.3 GB at most (see its residual risks);
/// - socket filters (`SO_ATTACH_FILTER`, `SO_ATTACH_BPF` and the two reuseport forms): a
///   classic filter on a `socketpair` is converted and JIT-compiled like a seccomp filter, and
///   can be made and replaced at will (SECURITY.md #131).
const SOCKOPT_REFUSED: &[u64] = &[
    libc::SO_SNDBUF as u64,
    libc::SO_RCVBUF as u64,
    libc::SO_SNDBUFFORCE as u64,
    libc::SO_RCVBUFFORCE as u64,
    libc::SO_ATTACH_FILTER as u64,
    libc::SO_ATTACH_BPF as u64,
    libc::SO_ATTACH_REUSEPORT_CBPF as u64,
    libc::SO_ATTACH_REUSEPORT_EBPF as u64,
];

/// prctl options user code may use; the rest (e.g. making itself dumpable again) get ENOSYS.
const PRCTL_ALLOWED: &[u64] = &[
    libc::PR_SET_NAME as u64,
    libc::PR_GET_NAME as u64,
    libc::PR_GET_DUMPABLE as u64,
    libc::PR_GET_SECCOMP as u64,
    libc::PR_GET_NO_NEW_PRIVS as u64,
    libc::PR_CAPBSET_READ as u64,
    libc::PR_GET_PDEATHSIG as u64,
    0x5356_4d41, // PR_SET_VMA: glibc names anonymous mappings
    // One-way and already set; harmless.
    libc::PR_SET_NO_NEW_PRIVS as u64,
    // Read-only: the lockdown set it (SECURITY.md #132), and only PR_SET_THP_DISABLE could
    // clear it.
    libc::PR_GET_THP_DISABLE as u64,
];

/// The allow-list: the calls ordinary Python makes, some only with the arguments it uses.
///
/// Long on purpose: the policy's table, one rule per call or group, read top to bottom.
#[allow(clippy::unnecessary_cast)]
fn allow_list(processes: Processes) -> Result<Rules, SeccompError> {
    let mut rules = Rules::new();
    // sched_getaffinity of another process (SECURITY.md #140) gets ENOSYS rather than EPERM:
    // glibc's `pthread_getattr_np` asks it for the calling thread by its id, and takes ENOSYS
    // (only) as "no affinity to report", so a worker's other threads still get their
    // attributes. The worker itself is 0 or (alone) its pid.
    for value in processes.selves() {
        when(
            &mut rules,
            libc::SYS_sched_getaffinity,
            vec![arg32(0, Op::Eq, u64::from(value))?],
        )?;
    }
    // futex without its priority-inheritance commands (SECURITY.md #142): LOCK_PI, TRYLOCK_PI
    // and the rest look up, machine-wide, the thread id written in the futex word (ESRCH for an
    // id nobody has, EPERM for a live one: a cell swept pids 1-20,000 and found every process
    // and thread). They get ENOSYS, which glibc takes as "no PI mutexes" (`pthread_mutex_init`
    // of a PTHREAD_PRIO_INHERIT mutex then fails with ENOTSUP); CPython and Rust use none.
    for &cmd in FUTEX_ALLOWED {
        when(
            &mut rules,
            libc::SYS_futex,
            vec![arg32(1, Op::MaskedEq(FUTEX_CMD_MASK), cmd)?],
        )?;
    }
    always(&mut rules, ALLOWED);
    always(&mut rules, ALLOWED_LEGACY);
    // The refused calls pass this filter so that the refusals filter's EPERM (a readable
    // PermissionError) is the answer, rather than ENOSYS.
    always(&mut rules, REFUSED);
    always(&mut rules, REFUSED_LEGACY);
    always(&mut rules, UNSUPPORTED);
    // Refused but for `setpgid(0, 0)` with children: the refusals filter decides.
    always(&mut rules, &[libc::SYS_setpgid]);
    for &cmd in IOCTL_ALLOWED {
        when(&mut rules, libc::SYS_ioctl, vec![arg32(1, Op::Eq, cmd)?])?;
    }
    // TIOCSTI is listed so the refusals filter can answer EPERM (SECURITY.md #24).
    when(
        &mut rules,
        libc::SYS_ioctl,
        vec![arg32(1, Op::Eq, libc::TIOCSTI as u64)?],
    )?;
    for &opt in PRCTL_ALLOWED {
        when(&mut rules, libc::SYS_prctl, vec![arg32(0, Op::Eq, opt)?])?;
    }
    // A worker's child makes itself dumpable (the worker's `pthread_atfork` handler), so the
    // host can read its `smaps_rollup` and count its share of memory (SECURITY.md #159): its
    // memory map is the worker's, made in the host's user namespace, where only a dumpable
    // process's is readable by the same uid. Nothing in the sandbox can read `/proc`, and core
    // files stay off (RLIMIT_CORE 0).
    // And a child forked from its parent's main thread asks to die with it (PR_SET_PDEATHSIG,
    // SIGKILL only): a signal to itself, on its parent's end.
    // And it puts itself in a Landlock domain of its own, nested in the worker's, scoped for
    // signals: its parent (and the worker) can still signal it, it cannot signal them or its
    // siblings (SECURITY.md #158). No rule is added, so no filesystem right can change.
    if processes == Processes::WithChildren {
        // And a forked session (SECURITY.md #193) narrows its Landlock domain to its own
        // directory, with rules: a new layer can only take rights away.
        always(
            &mut rules,
            &[
                libc::SYS_landlock_create_ruleset,
                libc::SYS_landlock_add_rule,
                libc::SYS_landlock_restrict_self,
            ],
        );
        for (option, value) in [
            (libc::PR_SET_DUMPABLE, 1),
            (libc::PR_SET_PDEATHSIG, libc::SIGKILL),
        ] {
            when(
                &mut rules,
                libc::SYS_prctl,
                vec![
                    arg32(0, Op::Eq, option as u64)?,
                    arg32(1, Op::Eq, value as u64)?,
                ],
            )?;
        }
    }
    // The refused commands (and F_SETFL with O_ASYNC) pass here so that the refusals filter
    // answers EPERM; any other command gets ENOSYS.
    for &cmd in FCNTL_ALLOWED.iter().chain(FCNTL_REFUSED) {
        when(&mut rules, libc::SYS_fcntl, vec![arg32(1, Op::Eq, cmd)?])?;
    }
    when(
        &mut rules,
        libc::SYS_fcntl,
        vec![arg32(1, Op::Eq, libc::F_SETFL as u64)?],
    )?;
    // socketpair(AF_UNIX, ...) only: asyncio's self-pipe and multiprocessing-free IPC.
    when(
        &mut rules,
        libc::SYS_socketpair,
        vec![arg32(0, Op::Eq, libc::AF_UNIX as u64)?],
    )?;
    Ok(rules)
}

/// The refusals: calls answered EPERM, some only with the arguments that reach out.
///
/// Long on purpose: the policy's table, one rule per call or group, read top to bottom.
#[allow(clippy::unnecessary_cast)]
fn refusals(processes: Processes) -> Result<Rules, SeccompError> {
    let mut rules = Rules::new();
    // "Not the caller": every condition true for a pid argument none of `selves` matches.
    let not_self = |index: u8| -> Result<Vec<Cond>, SeccompError> {
        processes
            .selves()
            .into_iter()
            .map(|pid| arg32(index, Op::Ne, u64::from(pid)))
            .collect()
    };
    always(&mut rules, REFUSED);
    // `vfork` only where the worker may have children: a forked session is made through one
    // (worker/fork.rs; SECURITY.md #233). Its child shares the caller's memory, not its thread
    // group: the host sees it as the worker's child, as it sees a fork's.
    let vfork_allowed =
        |nr: &&libc::c_long| processes != Processes::WithChildren || !is_vfork(**nr);
    let legacy: Vec<libc::c_long> = REFUSED_LEGACY
        .iter()
        .filter(vfork_allowed)
        .copied()
        .collect();
    always(&mut rules, &legacy);
    // A process group of its own is refused, except `setpgid(0, 0)` where sessions may fork:
    // a forked session leaves its parent's group, so a kill of one group never ends the other
    // (SECURITY.md #194). A child that leaves its worker's group the same way is still its
    // descendant; orphaned, the host kills it (`resident::kill_escaped_orphans`).
    match processes {
        Processes::WithChildren => {
            when(&mut rules, libc::SYS_setpgid, vec![arg32(0, Op::Ne, 0)?])?;
            when(&mut rules, libc::SYS_setpgid, vec![arg32(1, Op::Ne, 0)?])?;
        }
        Processes::Alone { .. } => always(&mut rules, &[libc::SYS_setpgid]),
    }
    // clone without CLONE_THREAD is fork(): refused, except glibc's plain fork when the worker
    // may have children. Threads are allowed, and only threads that share everything a pthread
    // shares: a thread without CLONE_FILES gets its own copy of the descriptor table, another
    // 1,024 descriptors (and the sockets and pipes they keep alive) per thread (red-team pass
    // 18: 6.9 GB of queued socket data under a 256 MiB limit).
    for flag in [
        libc::CLONE_THREAD,
        libc::CLONE_VM,
        libc::CLONE_FS,
        libc::CLONE_FILES,
        libc::CLONE_SIGHAND,
    ] {
        let flag = flag as u64;
        let mut conds = vec![arg32(0, Op::MaskedEq(flag), 0)?];
        if processes == Processes::WithChildren {
            conds.push(arg32(0, Op::Ne, FORK_FLAGS)?);
        }
        when(&mut rules, libc::SYS_clone, conds)?;
    }
    // fallocate(2) only punches holes (PUNCH_HOLE|KEEP_SIZE gives blocks back): with
    // FALLOC_FL_KEEP_SIZE (and with ZERO_RANGE, INSERT_RANGE...) ext4 and tmpfs take disk
    // blocks without checking RLIMIT_FSIZE, since the size does not change (red-team pass 18:
    // 2 GiB under a 256 MiB file limit in 4 ms, or the disk taken below the free-disk floor in
    // one call, before the guard's next look). Mode 0 is answered by [`unsupported`].
    when(
        &mut rules,
        libc::SYS_fallocate,
        vec![
            arg32(1, Op::Ne, 0)?,
            arg32(1, Op::Ne, FALLOCATE_PUNCH_HOLE)?,
        ],
    )?;
    // An open that truncates without asking to write (SECURITY.md #151): the kernel truncates
    // on `O_TRUNC` whatever the access mode, and Landlock before ABI 3 checks only the access
    // mode, so `open(path, O_RDONLY | O_TRUNC)` emptied any file the worker may read (the
    // Python installation, system libraries, an `--allow-read` folder) that its uid owns.
    // Access mode 3 (neither read nor write: an fd for ioctls only) asks Landlock for no right
    // at all, so it is refused with or without `O_TRUNC`. Every ABI, for one answer everywhere.
    for (nr, flags_arg) in OPENS {
        for (mask, value) in OPEN_TRUNCATES_WITHOUT_WRITE {
            when(
                &mut rules,
                *nr,
                vec![arg32(*flags_arg, Op::MaskedEq(mask), value)?],
            )?;
        }
    }
    // A handler for glibc's two internal signals (SIGCANCEL 32, SIGSETXID 33), which glibc's
    // `pthread_sigmask` never lets a thread block (SECURITY.md #311): ironcell's own reader and
    // output-pump threads block every other signal, so no handler of the session's code runs on
    // them (in a forked session's parent they keep its pre-fork Landlock domain). glibc's
    // `sigaction` refuses these two numbers too; reading the handler stays allowed.
    for signal in [32u64, 33] {
        when(
            &mut rules,
            libc::SYS_rt_sigaction,
            vec![
                arg32(0, Op::Eq, signal)?,
                Cond::new(1, Len::Qword, Op::Ne, 0)?,
            ],
        )?;
    }
    // Signals only to itself when alone (with children, Landlock's signal scope fences them:
    // see [`Processes::WithChildren`]); rlimits only its own (0 means "self" for prlimit64).
    if let Processes::Alone { own_pid } = processes {
        let pid = u64::from(own_pid);
        when(&mut rules, libc::SYS_kill, vec![arg32(0, Op::Ne, pid)?])?;
        when(&mut rules, libc::SYS_tgkill, vec![arg32(0, Op::Ne, pid)?])?;
    }
    when(&mut rules, libc::SYS_prlimit64, not_self(0)?)?;
    // The memory limits are the host's to change (SECURITY.md #239): where sessions fork, the
    // hard limits leave room for the host to raise a fork's soft ones, which any process may
    // raise up to its hard ones. The filter cannot read the new value (it is behind a pointer),
    // so every change of RLIMIT_DATA or RLIMIT_AS is refused, lowering too; reading them
    // (`prlimit64` with no new limit, glibc's `getrlimit`) stays allowed. The pointer is
    // compared whole: one whose low 32 bits are 0 is not NULL.
    for resource in [libc::RLIMIT_DATA, libc::RLIMIT_AS] {
        let resource = resource as u64;
        when(
            &mut rules,
            libc::SYS_setrlimit,
            vec![arg32(0, Op::Eq, resource)?],
        )?;
        when(
            &mut rules,
            libc::SYS_prlimit64,
            vec![
                arg32(1, Op::Eq, resource)?,
                Cond::new(2, Len::Qword, Op::Ne, 0)?,
            ],
        )?;
    }
    // Other processes, read by pid (SECURITY.md #140): each of these answered for any pid on
    // the machine (a worker listed all 117 processes with their sessions, process groups and
    // CPU time, other sessions' workers among them). Only 0 (the caller) and, alone, its own
    // pid pass (its main thread's id is its pid).
    for nr in PID_READERS {
        when(&mut rules, *nr, not_self(0)?)?;
    }
    // getpriority(which, who): a process (PRIO_PROCESS) or process group (PRIO_PGRP; the
    // worker leads its own) by id, or every process of a user (PRIO_USER; 0: the caller's).
    when(&mut rules, libc::SYS_getpriority, not_self(1)?)?;
    when(
        &mut rules,
        libc::SYS_getpriority,
        vec![
            arg32(0, Op::Eq, libc::PRIO_USER as u64)?,
            arg32(1, Op::Ne, 0)?,
        ],
    )?;
    // A negative clock id names a process's or thread's CPU clock by pid (or a clock device
    // by descriptor): only the caller's own pass, as 0 or as its pid. Other threads of the
    // worker cannot be named (their ids are not known here); `time.thread_time()` and
    // `time.process_time()` use the static ids.
    for nr in CLOCK_USERS {
        let mut conds = vec![arg32(0, Op::MaskedEq(NEGATIVE), NEGATIVE)?];
        for clock in processes.selves().into_iter().flat_map(own_cpu_clocks) {
            conds.push(arg32(0, Op::Ne, u64::from(clock))?);
        }
        when(&mut rules, *nr, conds)?;
    }
    when(
        &mut rules,
        libc::SYS_ioctl,
        vec![arg32(1, Op::Eq, libc::TIOCSTI as u64)?],
    )?;
    for &cmd in FCNTL_REFUSED {
        when(&mut rules, libc::SYS_fcntl, vec![arg32(1, Op::Eq, cmd)?])?;
    }
    for &opt in SOCKOPT_REFUSED {
        when(
            &mut rules,
            libc::SYS_setsockopt,
            vec![
                arg32(1, Op::Eq, libc::SOL_SOCKET as u64)?,
                arg32(2, Op::Eq, opt)?,
            ],
        )?;
    }
    // Shared anonymous mappings (SECURITY.md #129): their pages live in a hidden shmem file
    // that any leftover page of the mapping keeps whole, so `mmap(-1, 1 GiB, MAP_SHARED)`,
    // touched and shrunk to 4 KiB, held 1 GiB that neither RLIMIT_AS nor RLIMIT_DATA counts.
    // The runner makes Python's `mmap.mmap(-1, n)` private; a worker's children share memory
    // through files in its private `/dev/shm` (its session directory), which the scratch quota
    // counts.
    let anonymous_type = (libc::MAP_ANONYMOUS | 0x0f) as u64;
    for shared in [libc::MAP_SHARED, libc::MAP_SHARED_VALIDATE] {
        when(
            &mut rules,
            libc::SYS_mmap,
            vec![arg32(
                3,
                Op::MaskedEq(anonymous_type),
                (libc::MAP_ANONYMOUS | shared) as u64,
            )?],
        )?;
    }
    // The flags word is an unsigned int in the kernel (`setfl(fd, filp, (u32)arg)`).
    let o_async = libc::O_ASYNC as u64;
    when(
        &mut rules,
        libc::SYS_fcntl,
        vec![
            arg32(1, Op::Eq, libc::F_SETFL as u64)?,
            arg32(2, Op::MaskedEq(o_async), o_async)?,
        ],
    )?;
    Ok(rules)
}

/// The open calls and the index of their flags argument.
#[cfg(target_arch = "x86_64")]
const OPENS: &[(libc::c_long, u8)] = &[(libc::SYS_openat, 2), (libc::SYS_open, 1)];
#[cfg(not(target_arch = "x86_64"))]
const OPENS: &[(libc::c_long, u8)] = &[(libc::SYS_openat, 2)];

/// (mask, value) pairs of open flags refused: read-only with `O_TRUNC`, and access mode 3.
#[allow(clippy::unnecessary_cast)]
pub const OPEN_TRUNCATES_WITHOUT_WRITE: [(u64, u64); 2] = [
    (
        (libc::O_ACCMODE | libc::O_TRUNC) as u64,
        (libc::O_RDONLY | libc::O_TRUNC) as u64,
    ),
    (libc::O_ACCMODE as u64, libc::O_ACCMODE as u64),
];

/// Answered `EOPNOTSUPP` whatever their arguments: the path forms of the extended-attribute
/// reads (SECURITY.md #152). Landlock does not mediate them, so by path they returned the
/// xattrs of any file on the host (browsers store a download's URL, tokens included, in
/// `user.xdg.origin.url`). EOPNOTSUPP is what a filesystem without xattrs answers: `shutil.copy2`
/// and `copytree` skip the xattr step on it. The descriptor forms stay, on files Landlock let the
/// worker open.
#[rustfmt::skip]
const UNSUPPORTED: &[libc::c_long] = &[
    libc::SYS_getxattr, libc::SYS_lgetxattr, libc::SYS_listxattr, libc::SYS_llistxattr,
];

/// Calls answered `EOPNOTSUPP` (installed between the allow-list and the refusals, so a
/// refusal's EPERM wins over it): libc falls back to its portable path, as on a filesystem that
/// lacks the feature.
fn unsupported() -> Result<Rules, SeccompError> {
    let mut rules = Rules::new();
    always(&mut rules, UNSUPPORTED);
    // fallocate mode 0 is held to RLIMIT_FSIZE per file, but over many files (O_TMPFILE ones
    // have no name for the scratch quota to count) it took blocks at 10-65 GiB/s with no page
    // written, 2-12 GiB below the free-disk floor before the guard's next look (red-team pass
    // 21, SECURITY.md #144). Answered EOPNOTSUPP, glibc's `posix_fallocate` (Python's
    // `os.posix_fallocate`, SQLite) writes one byte per block instead: the same blocks, through
    // the page cache and its dirty-page throttling, at 0.4-0.7 GiB/s.
    when(&mut rules, libc::SYS_fallocate, vec![arg32(1, Op::Eq, 0)?])?;
    Ok(rules)
}

/// The one fallocate mode a worker may use natively: it frees blocks and allocates none.
#[allow(clippy::unnecessary_cast)]
const FALLOCATE_PUNCH_HOLE: u64 = (libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE) as u64;

/// futex commands a worker may use: wait, wake, requeue, wake-op and the bitset forms; not
/// FUTEX_FD (gone since 2.6.26) nor any priority-inheritance command (6-8, 11-13).
const FUTEX_ALLOWED: &[u64] = &[
    libc::FUTEX_WAIT as u64,
    libc::FUTEX_WAKE as u64,
    libc::FUTEX_REQUEUE as u64,
    libc::FUTEX_CMP_REQUEUE as u64,
    libc::FUTEX_WAKE_OP as u64,
    libc::FUTEX_WAIT_BITSET as u64,
    libc::FUTEX_WAKE_BITSET as u64,
];

/// The kernel's `FUTEX_CMD_MASK`: a futex op without its private and clock flags.
const FUTEX_CMD_MASK: u64 =
    !((libc::FUTEX_PRIVATE_FLAG | libc::FUTEX_CLOCK_REALTIME) as u32) as u64;

/// Calls whose first argument is a pid they read (SECURITY.md #140).
const PID_READERS: &[libc::c_long] = &[
    libc::SYS_getsid,
    libc::SYS_getpgid,
    libc::SYS_sched_getparam,
    libc::SYS_sched_getscheduler,
    libc::SYS_get_robust_list,
];

/// Calls whose first argument is a clock id.
const CLOCK_USERS: &[libc::c_long] = &[
    libc::SYS_clock_gettime,
    libc::SYS_clock_getres,
    libc::SYS_clock_nanosleep,
    libc::SYS_timer_create,
];

/// The sign bit of a 32-bit argument.
const NEGATIVE: u64 = 0x8000_0000;

/// The CPU clocks that name the process `pid` or its main thread, as the kernel encodes them
/// (`~pid << 3 | kind`; kinds 0-2: profiling, virtual, scheduler time; +4: the thread's).
/// `pid` 0 is the caller.
fn own_cpu_clocks(pid: u32) -> [u32; 6] {
    [0, 1, 2, 4, 5, 6].map(|kind| cpu_clock(pid, kind))
}

fn cpu_clock(pid: u32, kind: u32) -> u32 {
    (!pid << 3) | kind
}

fn kill_list() -> Rules {
    let mut rules = Rules::new();
    always(&mut rules, KILLED);
    always(&mut rules, KILLED_LEGACY);
    rules
}

/// The worker's filter: one program with the verdicts of the four of
/// [`stacked_worker_filters`] (a unit test compares them on every system call), laid out by
/// [`searched_program`].
pub fn build_worker_filters(own_pid: u32) -> Result<Vec<BpfProgram>, SeccompError> {
    build_filters(Processes::Alone { own_pid })
}

/// [`build_worker_filters`] for either kind of worker.
pub fn build_filters(processes: Processes) -> Result<Vec<BpfProgram>, SeccompError> {
    Ok(vec![searched_program(processes)?])
}

/// Installs the worker's filters on the calling thread (which must be the only thread;
/// `no_new_privs` must already be set).
pub fn install_syscall_filter_on_current_thread(own_pid: u32) -> Result<(), SeccompError> {
    install_programs_on_current_thread(&build_worker_filters(own_pid)?)
}

/// Installs the worker's already compiled program on the calling thread. There must be exactly
/// one: the policy refuses `seccomp` itself (#131), so a second program would be refused.
pub fn install_programs_on_current_thread(programs: &[BpfProgram]) -> Result<(), SeccompError> {
    let [program] = programs else {
        return Err(SeccompError::Merge(
            "the worker's filter must be one program (seccomp refuses a second)",
        ));
    };
    seccompiler::apply_filter(program)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::compiled::FromPid;
    use super::*;

    #[test]
    fn the_filters_compile_well_under_the_bpf_limit() {
        let programs = build_worker_filters(1234).unwrap();
        assert_eq!(programs.len(), 1);
        for p in &programs {
            assert!(p.len() < 4096, "{} instructions", p.len());
        }
    }

    /// A classic-BPF interpreter for what seccompiler emits, over one `seccomp_data`.
    fn run(program: &BpfProgram, nr: u32, arch: u32, args: [u64; 6]) -> u32 {
        let word = |offset: u32| -> u32 {
            match offset {
                0 => nr,
                4 => arch,
                o if (16..64).contains(&o) && o % 4 == 0 => {
                    let arg = args[((o - 16) / 8) as usize];
                    if (o - 16) % 8 == 0 {
                        arg as u32
                    } else {
                        (arg >> 32) as u32
                    }
                }
                o => panic!("load at offset {o}"),
            }
        };
        let (mut acc, mut pc) = (0u32, 0usize);
        loop {
            let ins = &program[pc];
            pc += 1;
            let jump = |taken: bool| usize::from(if taken { ins.jt } else { ins.jf });
            match ins.code {
                0x20 => acc = word(ins.k),
                0x54 => acc &= ins.k,
                0x05 => pc += ins.k as usize,
                0x15 => pc += jump(acc == ins.k),
                0x25 => pc += jump(acc > ins.k),
                0x35 => pc += jump(acc >= ins.k),
                0x45 => pc += jump(acc & ins.k != 0),
                0x06 => return ins.k,
                code => panic!("opcode {code:#x}"),
            }
        }
    }

    /// The flags glibc's `pthread_create` passes to clone (sysdeps/unix/sysv/linux/createthread.c).
    #[allow(clippy::unnecessary_cast)]
    const PTHREAD_CLONE_FLAGS: u64 = (libc::CLONE_VM
        | libc::CLONE_FS
        | libc::CLONE_FILES
        | libc::CLONE_SIGHAND
        | libc::CLONE_THREAD
        | libc::CLONE_SYSVSEM
        | libc::CLONE_SETTLS
        | libc::CLONE_PARENT_SETTID
        | libc::CLONE_CHILD_CLEARTID) as u64;

    /// What the kernel answers with `programs` installed in order.
    fn stacked(programs: &[BpfProgram], nr: u32, arch: u32, args: [u64; 6]) -> u32 {
        let mut verdict = libc::SECCOMP_RET_ALLOW;
        for p in programs {
            let v = run(p, nr, arch, args);
            let rank = |v: u32| (v & libc::SECCOMP_RET_ACTION_FULL) as i32;
            if rank(v) <= rank(verdict) {
                verdict = v;
            }
        }
        verdict
    }

    #[test]
    #[allow(clippy::unnecessary_cast)]
    fn the_merged_filter_answers_every_call_as_the_four_stacked_do() {
        merged_equals_stacked(Processes::Alone { own_pid: 4321 });
    }

    #[test]
    fn with_children_the_merged_filter_answers_every_call_as_the_four_stacked_do() {
        merged_equals_stacked(Processes::WithChildren);
    }

    #[allow(clippy::unnecessary_cast)]
    fn merged_equals_stacked(processes: Processes) {
        let pid = 4321u32;
        let four = stacked_worker_filters(processes).unwrap();
        let merged = build_filters(processes).unwrap();
        assert_eq!(merged.len(), 1);
        let merged = &merged[0];
        assert!(
            merged.len() * 3 < four.iter().map(Vec::len).sum::<usize>() * 2,
            "{} instructions, {:?} stacked",
            merged.len(),
            four.iter().map(Vec::len).collect::<Vec<_>>()
        );
        let arch = run(&four[0], 0, 0, [0; 6]); // wrong arch: killed
        assert_eq!(arch, libc::SECCOMP_RET_KILL_PROCESS);
        let native = four[0][1].k;
        // Every value a rule compares with, its neighbours, and the same with high bits set.
        let mut values: Vec<u64> = vec![0, 1, 2, u64::from(pid), u64::from(pid) + 1, 0xffff_ffff];
        values.extend(IOCTL_ALLOWED.iter().copied());
        values.extend(FCNTL_ALLOWED.iter().copied());
        values.extend(FCNTL_REFUSED.iter().copied());
        values.extend(PRCTL_ALLOWED.iter().copied());
        values.extend(
            own_cpu_clocks(0)
                .into_iter()
                .chain(own_cpu_clocks(pid))
                .chain(own_cpu_clocks(pid + 1))
                .map(u64::from),
        );
        values.extend((0..=13u64).flat_map(|cmd| {
            let private = cmd | libc::FUTEX_PRIVATE_FLAG as u64;
            [cmd, private, private | libc::FUTEX_CLOCK_REALTIME as u64]
        }));
        values.extend([
            NEGATIVE,
            libc::PRIO_USER as u64,
            libc::TIOCSTI as u64,
            libc::F_SETFL as u64,
            libc::O_ASYNC as u64,
            (libc::O_ASYNC | libc::O_NONBLOCK) as u64,
            libc::O_NONBLOCK as u64,
            libc::CLONE_THREAD as u64,
            (libc::CLONE_THREAD | libc::CLONE_VM) as u64,
            libc::CLONE_VM as u64,
            PTHREAD_CLONE_FLAGS,
            PTHREAD_CLONE_FLAGS & !(libc::CLONE_FILES as u64),
            FORK_FLAGS,
            FORK_FLAGS | libc::CLONE_NEWUSER as u64,
            libc::SIGCHLD as u64,
            libc::AF_UNIX as u64,
            libc::AF_INET as u64,
            libc::FALLOC_FL_KEEP_SIZE as u64,
            FALLOCATE_PUNCH_HOLE,
            libc::FALLOC_FL_ZERO_RANGE as u64,
        ]);
        values.extend(OPEN_FLAGS_SEEN);
        let more: Vec<u64> = values
            .iter()
            .flat_map(|&v| [v.wrapping_add(1), v | (1 << 32)])
            .collect();
        values.extend(more);
        values.sort_unstable();
        values.dedup();
        // The third argument: fcntl's flags and setsockopt's option names.
        let mut thirds = vec![0, libc::O_ASYNC as u64, libc::O_NONBLOCK as u64];
        thirds.extend(SOCKOPT_REFUSED.iter().copied());
        thirds.push(libc::SO_KEEPALIVE as u64);
        thirds.extend(OPEN_FLAGS_SEEN);
        let conditional: Vec<i64> = allow_list(processes)
            .unwrap()
            .into_iter()
            .chain(unsupported().unwrap())
            .chain(refusals(processes).unwrap())
            .filter(|(_, rules)| !rules.is_empty())
            .map(|(nr, _)| nr)
            .collect();
        let mut checked = 0u64;
        for nr in (0..1024u32).chain([0x4000_0000, 0x4000_0001, 0x4000_0000 | 59, u32::MAX]) {
            for a in [native, native ^ 1] {
                if conditional.contains(&i64::from(nr)) {
                    for &x in &values {
                        for &y in &values {
                            for &z in &thirds {
                                let args = [x, y, z, 0, 0, 0];
                                assert_eq!(
                                    run(merged, nr, a, args),
                                    stacked(&four, nr, a, args),
                                    "nr {nr} arch {a:#x} args {args:?}"
                                );
                                checked += 1;
                            }
                        }
                    }
                } else {
                    for args in [[0; 6], [u64::from(pid), 1, 2, 3, 4, 5], [u64::MAX; 6]] {
                        assert_eq!(
                            run(merged, nr, a, args),
                            stacked(&four, nr, a, args),
                            "nr {nr} arch {a:#x} args {args:?}"
                        );
                        checked += 1;
                    }
                }
            }
        }
        // The loop above leaves arguments 3-5 at 0; mmap's rule reads its fourth (the flags).
        let mut flags: Vec<u64> = vec![0, u64::MAX];
        for shared in [
            0,
            libc::MAP_SHARED,
            libc::MAP_PRIVATE,
            libc::MAP_SHARED_VALIDATE,
        ] {
            for extra in [
                0,
                libc::MAP_ANONYMOUS,
                libc::MAP_ANONYMOUS | libc::MAP_FIXED,
            ] {
                let f = (shared | extra) as u64;
                flags.extend([f, f | 0x0c, f | (1 << 32), f | 0x10_0000]);
            }
        }
        for &f in &flags {
            for a in [native, native ^ 1] {
                let args = [0, 4096, 3, f, u64::MAX, 0];
                let nr = libc::SYS_mmap as u32;
                assert_eq!(
                    run(merged, nr, a, args),
                    stacked(&four, nr, a, args),
                    "mmap arch {a:#x} flags {f:#x}"
                );
                checked += 1;
            }
        }
        assert!(checked > 100_000, "{checked}");
        let ok = libc::SECCOMP_RET_ALLOW;
        let eperm = libc::SECCOMP_RET_ERRNO | libc::EPERM as u32;
        let enosys = libc::SECCOMP_RET_ERRNO | libc::ENOSYS as u32;
        let nr = |n: libc::c_long| n as u32;
        assert_eq!(run(merged, nr(libc::SYS_read), native, [0; 6]), ok);
        assert_eq!(
            run(merged, nr(libc::SYS_socket), native, [2, 1, 0, 0, 0, 0]),
            eperm
        );
        let kill_one = run(merged, nr(libc::SYS_kill), native, [1, 9, 0, 0, 0, 0]);
        let kill_self = run(
            merged,
            nr(libc::SYS_kill),
            native,
            [u64::from(pid), 9, 0, 0, 0, 0],
        );
        assert_eq!(kill_self, ok);
        // Alone: signals only to itself; with children, Landlock's scope is the fence.
        let fenced = if processes == Processes::WithChildren {
            ok
        } else {
            eperm
        };
        assert_eq!(kill_one, fenced);
        if processes == Processes::WithChildren {
            // The rest of its verdicts:
            // with_children_fork_is_allowed_and_every_pid_rule_names_only_the_caller.
            return;
        }
        assert_eq!(
            run(merged, nr(libc::SYS_ptrace), native, [0; 6]),
            libc::SECCOMP_RET_KILL_PROCESS
        );
        assert_eq!(run(merged, 1000, native, [0; 6]), enosys);
        // Threads as glibc's pthread_create makes them; not without their own descriptor table
        // (#143), nor a fork.
        let clone = |flags: u64| run(merged, nr(libc::SYS_clone), native, [flags, 0, 0, 0, 0, 0]);
        assert_eq!(clone(PTHREAD_CLONE_FLAGS), ok);
        for missing in [
            libc::CLONE_THREAD,
            libc::CLONE_VM,
            libc::CLONE_FS,
            libc::CLONE_FILES,
            libc::CLONE_SIGHAND,
        ] {
            assert_eq!(
                clone(PTHREAD_CLONE_FLAGS & !(missing as u64)),
                eperm,
                "{missing:#x}"
            );
        }
        // fallocate only to punch a hole; mode 0 (posix_fallocate) answered EOPNOTSUPP, so
        // glibc writes the blocks instead (#144).
        let fallocate = |mode: u64| {
            run(
                merged,
                nr(libc::SYS_fallocate),
                native,
                [3, mode, 0, 1 << 30, 0, 0],
            )
        };
        let eopnotsupp = libc::SECCOMP_RET_ERRNO | libc::EOPNOTSUPP as u32;
        assert_eq!(fallocate(0), eopnotsupp);
        assert_eq!(fallocate(1 << 32), eopnotsupp, "the mode is a 32-bit int");
        assert_eq!(fallocate(FALLOCATE_PUNCH_HOLE), ok);
        for mode in [
            libc::FALLOC_FL_KEEP_SIZE,
            libc::FALLOC_FL_ZERO_RANGE,
            libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE,
            libc::FALLOC_FL_INSERT_RANGE,
            libc::FALLOC_FL_COLLAPSE_RANGE,
            libc::FALLOC_FL_UNSHARE_RANGE,
        ] {
            assert_eq!(fallocate(mode as u64), eperm, "{mode:#x}");
        }
        // No BPF program of the worker's own (#131): seccomp refused, its prctl form unknown,
        // socket filters refused, other socket options allowed.
        let call = |n: libc::c_long, args: [u64; 6]| run(merged, nr(n), native, args);
        assert_eq!(call(libc::SYS_seccomp, [1, 0, 0, 0, 0, 0]), eperm);
        assert_eq!(
            call(
                libc::SYS_prctl,
                [libc::PR_SET_SECCOMP as u64, 2, 0, 0, 0, 0]
            ),
            enosys
        );
        let sockopt = |opt: libc::c_int| {
            call(
                libc::SYS_setsockopt,
                [3, libc::SOL_SOCKET as u64, opt as u64, 0, 4, 0],
            )
        };
        for opt in [
            libc::SO_ATTACH_FILTER,
            libc::SO_ATTACH_BPF,
            libc::SO_ATTACH_REUSEPORT_CBPF,
            libc::SO_ATTACH_REUSEPORT_EBPF,
        ] {
            assert_eq!(sockopt(opt), eperm, "option {opt}");
        }
        assert_eq!(sockopt(libc::SO_KEEPALIVE), ok);
        // futex: waits and wakes, private or not, with either clock; no priority inheritance
        // (#142), whose commands look up another process's thread by id.
        let futex = |op: u64| call(libc::SYS_futex, [0, op, 0, 0, 0, 0]);
        let private = libc::FUTEX_PRIVATE_FLAG as u64;
        for &cmd in FUTEX_ALLOWED {
            assert_eq!(futex(cmd), ok, "futex {cmd}");
            assert_eq!(futex(cmd | private), ok, "futex {cmd}");
            let realtime = libc::FUTEX_CLOCK_REALTIME as u64;
            assert_eq!(futex(cmd | private | realtime), ok, "futex {cmd}");
        }
        for cmd in [2, 6, 7, 8, 11, 12, 13, 14] {
            assert_eq!(futex(cmd), enosys, "futex {cmd}");
            assert_eq!(futex(cmd | private), enosys, "futex {cmd}");
        }
        // Other processes cannot be read by pid (#140); the worker itself can, as 0 or as its
        // pid, and so can its own CPU clocks and every static clock.
        let me = u64::from(pid);
        let affinity = |who: u64| call(libc::SYS_sched_getaffinity, [who, 128, 0, 0, 0, 0]);
        assert_eq!((affinity(0), affinity(me)), (ok, ok));
        assert_eq!((affinity(1), affinity(me + 1)), (enosys, enosys));
        for n in PID_READERS {
            assert_eq!(call(*n, [0, 0, 0, 0, 0, 0]), ok, "{n}");
            assert_eq!(call(*n, [me, 0, 0, 0, 0, 0]), ok, "{n}");
            assert_eq!(call(*n, [1, 0, 0, 0, 0, 0]), eperm, "{n}");
            assert_eq!(call(*n, [me + 1, 0, 0, 0, 0, 0]), eperm, "{n}");
        }
        let prio = |which: u64, who: u64| call(libc::SYS_getpriority, [which, who, 0, 0, 0, 0]);
        let (process, group, user) = (
            libc::PRIO_PROCESS as u64,
            libc::PRIO_PGRP as u64,
            libc::PRIO_USER as u64,
        );
        assert_eq!(prio(process, 0), ok);
        assert_eq!(prio(process, me), ok);
        assert_eq!(prio(group, me), ok);
        assert_eq!(prio(user, 0), ok);
        assert_eq!(prio(process, 1), eperm);
        assert_eq!(prio(group, 1), eperm);
        assert_eq!(prio(user, me), eperm);
        for n in CLOCK_USERS {
            for clock in [0, 1, 2, 3, 7, 11] {
                assert_eq!(call(*n, [clock, 0, 0, 0, 0, 0]), ok, "{n} {clock}");
            }
            for clock in own_cpu_clocks(0).into_iter().chain(own_cpu_clocks(pid)) {
                assert_eq!(call(*n, [u64::from(clock), 0, 0, 0, 0, 0]), ok, "{n}");
            }
            // Another process's clocks, another thread's, and a clock device's (fd 3).
            for other in own_cpu_clocks(1).into_iter().chain(own_cpu_clocks(pid + 1)) {
                assert_eq!(call(*n, [u64::from(other), 0, 0, 0, 0, 0]), eperm, "{n}");
            }
            assert_eq!(
                call(*n, [u64::from((!3u32 << 3) | 3), 0, 0, 0, 0, 0]),
                eperm
            );
        }
        // The lockdown turned huge pages off (#132); the code may read that, not undo it.
        let prctl = |op: libc::c_int| call(libc::SYS_prctl, [op as u64, 0, 0, 0, 0, 0]);
        assert_eq!(prctl(libc::PR_GET_THP_DISABLE), ok);
        assert_eq!(prctl(libc::PR_SET_THP_DISABLE), enosys);
        // An open truncates only with write access asked for (#151); openat2's flags cannot be
        // read, so it is unknown; xattrs by path are unsupported, by fd allowed (#152).
        let openat = |flags: libc::c_int| {
            call(
                libc::SYS_openat,
                [libc::AT_FDCWD as u64, 0x1000, flags as u64, 0o644, 0, 0],
            )
        };
        let (rd, wr, rw, t) = (libc::O_RDONLY, libc::O_WRONLY, libc::O_RDWR, libc::O_TRUNC);
        for ok_flags in [
            rd,
            wr,
            rw,
            wr | t,
            rw | t,
            rd | libc::O_CREAT,
            wr | t | libc::O_CREAT,
        ] {
            assert_eq!(openat(ok_flags), ok, "{ok_flags:#o}");
            assert_eq!(openat(ok_flags | libc::O_CLOEXEC), ok, "{ok_flags:#o}");
        }
        for bad in [
            rd | t,
            rd | t | libc::O_CREAT | libc::O_CLOEXEC,
            3,
            3 | t,
            3 | libc::O_CLOEXEC,
        ] {
            assert_eq!(openat(bad), eperm, "{bad:#o}");
        }
        #[cfg(target_arch = "x86_64")]
        {
            let open =
                |flags: libc::c_int| call(libc::SYS_open, [0x1000, flags as u64, 0, 0, 0, 0]);
            assert_eq!(open(rd | t), eperm);
            assert_eq!(open(3), eperm);
            assert_eq!(open(wr | t), ok);
            assert_eq!(open(rd), ok);
        }
        assert_eq!(call(libc::SYS_openat2, [0; 6]), enosys);
        for n in UNSUPPORTED {
            assert_eq!(call(*n, [0x1000, 0x2000, 0, 64, 0, 0]), eopnotsupp, "{n}");
        }
        assert_eq!(call(libc::SYS_fgetxattr, [3, 0x2000, 0, 64, 0, 0]), ok);
        assert_eq!(call(libc::SYS_flistxattr, [3, 0, 0, 0, 0, 0]), ok);
    }

    /// Open flags the comparison of the merged and stacked filters tries (#151).
    #[allow(clippy::unnecessary_cast)]
    const OPEN_FLAGS_SEEN: [u64; 8] = [
        libc::O_TRUNC as u64,
        (libc::O_TRUNC | libc::O_WRONLY) as u64,
        (libc::O_TRUNC | libc::O_RDWR) as u64,
        (libc::O_TRUNC | libc::O_ACCMODE) as u64,
        libc::O_ACCMODE as u64,
        (libc::O_TRUNC | libc::O_CREAT | libc::O_CLOEXEC) as u64,
        (libc::O_RDONLY | libc::O_CLOEXEC) as u64,
        (libc::O_WRONLY | libc::O_CREAT | libc::O_CLOEXEC) as u64,
    ];

    #[test]
    #[allow(clippy::unnecessary_cast)]
    fn with_children_fork_is_allowed_and_every_pid_rule_names_only_the_caller() {
        let native = run(
            &stacked_worker_filters(Processes::WithChildren).unwrap()[0],
            0,
            0,
            [0; 6],
        );
        assert_eq!(native, libc::SECCOMP_RET_KILL_PROCESS);
        let four = stacked_worker_filters(Processes::WithChildren).unwrap();
        let arch = four[0][1].k;
        let with = &build_filters(Processes::WithChildren).unwrap()[0];
        let alone = &build_worker_filters(4321).unwrap()[0];
        let nr = |n: libc::c_long| n as u32;
        let ok = libc::SECCOMP_RET_ALLOW;
        let eperm = libc::SECCOMP_RET_ERRNO | libc::EPERM as u32;
        let call = |p: &BpfProgram, n: libc::c_long, args: [u64; 6]| run(p, nr(n), arch, args);
        // glibc's fork, exactly; any other process-making clone is refused; threads as before.
        assert_eq!(call(with, libc::SYS_clone, [FORK_FLAGS, 0, 0, 0, 0, 0]), ok);
        assert_eq!(
            call(alone, libc::SYS_clone, [FORK_FLAGS, 0, 0, 0, 0, 0]),
            eperm
        );
        for other in [
            FORK_FLAGS | libc::CLONE_NEWUSER as u64,
            FORK_FLAGS | libc::CLONE_PARENT as u64,
            FORK_FLAGS | libc::CLONE_VM as u64,
            (libc::CLONE_VM | libc::CLONE_VFORK | libc::SIGCHLD) as u64,
            libc::SIGCHLD as u64,
        ] {
            assert_eq!(
                call(with, libc::SYS_clone, [other, 0, 0, 0, 0, 0]),
                eperm,
                "{other:#x}"
            );
        }
        assert_eq!(
            call(with, libc::SYS_clone, [PTHREAD_CLONE_FLAGS, 0, 0, 0, 0, 0]),
            ok
        );
        #[cfg(target_arch = "x86_64")]
        {
            assert_eq!(call(with, libc::SYS_fork, [0; 6]), eperm);
            // A forked session is made through vfork (worker/fork.rs): only with children.
            assert_eq!(call(with, libc::SYS_vfork, [0; 6]), ok);
            assert_eq!(call(alone, libc::SYS_vfork, [0; 6]), eperm);
        }
        for n in [libc::SYS_execve, libc::SYS_execveat, libc::SYS_setsid] {
            assert_eq!(call(with, n, [0; 6]), eperm, "{n}");
        }
        // A group of its own (a forked session), and no other: not another's, not joining one.
        assert_eq!(call(with, libc::SYS_setpgid, [0; 6]), ok);
        assert_eq!(call(alone, libc::SYS_setpgid, [0; 6]), eperm);
        for args in [[4321, 0], [0, 4321], [4321, 4321]] {
            let args = [args[0], args[1], 0, 0, 0, 0];
            assert_eq!(call(with, libc::SYS_setpgid, args), eperm, "{args:?}");
        }
        // A rule holding a pid would name the parent in a child: only 0 passes.
        assert_eq!(call(with, libc::SYS_prlimit64, [0, 7, 0, 0, 0, 0]), ok);
        assert_eq!(
            call(with, libc::SYS_prlimit64, [4321, 7, 0, 0, 0, 0]),
            eperm
        );
        assert_eq!(call(alone, libc::SYS_prlimit64, [4321, 7, 0, 0, 0, 0]), ok);
        // The memory limits are read, never set (SECURITY.md #239), by either call, whatever
        // the high bits of the resource or the pointer's low ones.
        for p in [with, alone] {
            for resource in [libc::RLIMIT_DATA as u64, libc::RLIMIT_AS as u64] {
                for high in [0, 1 << 32] {
                    let r = resource | high;
                    assert_eq!(call(p, libc::SYS_prlimit64, [0, r, 0, 0x7000, 0, 0]), ok);
                    for new in [0x7000, 0x7f00_0000_0000, 1 << 32] {
                        let args = [0, r, new, 0, 0, 0];
                        assert_eq!(call(p, libc::SYS_prlimit64, args), eperm, "{args:?}");
                    }
                    let args = [r, 0x7000, 0, 0, 0, 0];
                    assert_eq!(call(p, libc::SYS_setrlimit, args), eperm, "{args:?}");
                    assert_eq!(call(p, libc::SYS_getrlimit, args), ok, "{args:?}");
                }
            }
            // Other limits stay the worker's own to lower (or raise up to the hard limit).
            let nofile = libc::RLIMIT_NOFILE as u64;
            assert_eq!(
                call(p, libc::SYS_prlimit64, [0, nofile, 0x7000, 0, 0, 0]),
                ok
            );
            assert_eq!(
                call(p, libc::SYS_setrlimit, [nofile, 0x7000, 0, 0, 0, 0]),
                ok
            );
        }
        for n in PID_READERS {
            assert_eq!(call(with, *n, [0; 6]), ok, "{n}");
            assert_eq!(call(with, *n, [4321, 0, 0, 0, 0, 0]), eperm, "{n}");
        }
        assert_eq!(
            call(with, libc::SYS_getpriority, [0, 4321, 0, 0, 0, 0]),
            eperm
        );
        assert_eq!(call(with, libc::SYS_getpriority, [0, 0, 0, 0, 0, 0]), ok);
        let enosys = libc::SECCOMP_RET_ERRNO | libc::ENOSYS as u32;
        assert_eq!(
            call(with, libc::SYS_sched_getaffinity, [0, 0, 0, 0, 0, 0]),
            ok
        );
        assert_eq!(
            call(with, libc::SYS_sched_getaffinity, [4321, 0, 0, 0, 0, 0]),
            enosys
        );
        for kind in [0, 1, 2, 4, 5, 6] {
            let own = u64::from(cpu_clock(0, kind));
            let named = u64::from(cpu_clock(4321, kind));
            assert_eq!(
                call(with, libc::SYS_clock_gettime, [own, 0, 0, 0, 0, 0]),
                ok
            );
            assert_eq!(
                call(with, libc::SYS_clock_gettime, [named, 0, 0, 0, 0, 0]),
                eperm
            );
        }
        // Signals: any pid, fenced by Landlock's signal scope; waiting for its children.
        assert_eq!(call(with, libc::SYS_kill, [4322, 15, 0, 0, 0, 0]), ok);
        assert_eq!(call(with, libc::SYS_tgkill, [4322, 4322, 15, 0, 0, 0]), ok);
        assert_eq!(call(alone, libc::SYS_kill, [4322, 15, 0, 0, 0, 0]), eperm);
        assert_eq!(call(with, libc::SYS_wait4, [u64::MAX, 0, 0, 0, 0, 0]), ok);
        // A handler for glibc's internal signals is refused, reading one is not (#311).
        let action = 0x7f00_0000_1000u64;
        for p in [with, alone] {
            for internal in [32, 33] {
                let new = [internal, action, 0, 8, 0, 0];
                assert_eq!(call(p, libc::SYS_rt_sigaction, new), eperm);
                let read = [internal, 0, action, 8, 0, 0];
                assert_eq!(call(p, libc::SYS_rt_sigaction, read), ok);
            }
            let usr1 = [libc::SIGUSR1 as u64, action, 0, 8, 0, 0];
            assert_eq!(call(p, libc::SYS_rt_sigaction, usr1), ok);
        }
        let dumpable = |p: &BpfProgram, v: u64| {
            call(
                p,
                libc::SYS_prctl,
                [libc::PR_SET_DUMPABLE as u64, v, 0, 0, 0, 0],
            )
        };
        assert_eq!(dumpable(with, 1), ok);
        assert_eq!(dumpable(with, 0), enosys);
        assert_eq!(dumpable(with, 2), enosys);
        assert_eq!(dumpable(alone, 1), enosys);
        for n in [
            libc::SYS_landlock_create_ruleset,
            libc::SYS_landlock_add_rule,
            libc::SYS_landlock_restrict_self,
        ] {
            assert_eq!(call(with, n, [0; 6]), ok);
            assert_eq!(call(alone, n, [0; 6]), enosys);
        }
        let deathsig = |v: u64| {
            call(
                with,
                libc::SYS_prctl,
                [libc::PR_SET_PDEATHSIG as u64, v, 0, 0, 0, 0],
            )
        };
        assert_eq!(deathsig(libc::SIGKILL as u64), ok);
        assert_eq!(deathsig(libc::SIGUSR1 as u64), enosys);
        assert_eq!(call(with, libc::SYS_waitid, [0; 6]), ok);
        // The pid-free program needs no patching.
        let compiled = CompiledWorkerFilters::compile().unwrap();
        assert_eq!(
            compiled.for_processes(Processes::WithChildren),
            build_filters(Processes::WithChildren).unwrap()
        );
    }

    #[test]
    fn a_merge_that_would_change_a_verdict_is_refused() {
        let four = stacked_worker_filters(Processes::Alone { own_pid: 1 }).unwrap();
        // Kill-list installed first, then the ENOSYS allow-list: the kill-list's kills would be
        // answered ENOSYS by a merge; it must refuse.
        let wrong = vec![four[3].clone(), four[0].clone()];
        assert!(merge_stacked(&wrong).is_err());
        // EPERM refusals before an allow-list whose verdict is as severe: fine (later wins).
        assert!(merge_stacked(&four).is_ok());
    }

    #[test]
    fn the_programs_compiled_once_are_the_ones_compiled_for_each_pid() {
        let compiled = CompiledWorkerFilters::compile().unwrap();
        // kill, tgkill, prlimit64, sched_getaffinity, the five pid readers and getpriority compare an argument
        // with the worker's pid; the four clock calls with its six CPU clocks.
        let pids = |d: FromPid| compiled.pid_sites.iter().filter(|s| s.2 == d).count();
        assert_eq!(pids(FromPid::Pid), 10, "{:?}", compiled.pid_sites);
        for kind in [0, 1, 2, 4, 5, 6] {
            assert_eq!(pids(FromPid::CpuClock(kind)), 4, "{:?}", compiled.pid_sites);
        }
        assert_eq!(compiled.pid_sites.len(), 34);
        for pid in [1, 2, 1234, 65_535, 4_194_304] {
            assert_eq!(
                compiled.for_pid(pid),
                build_worker_filters(pid).unwrap(),
                "pid {pid}"
            );
        }
    }

    #[test]
    fn nothing_is_both_allowed_unconditionally_and_killed() {
        for nr in KILLED.iter().chain(KILLED_LEGACY) {
            assert!(
                !ALLOWED.contains(nr) && !ALLOWED_LEGACY.contains(nr),
                "syscall {nr}"
            );
        }
        let allowed = allow_list(Processes::Alone { own_pid: 1234 }).unwrap();
        for nr in REFUSED.iter().chain(REFUSED_LEGACY) {
            assert!(
                allowed.contains_key(nr),
                "refused {nr} must pass the allow-list"
            );
        }
    }
}
