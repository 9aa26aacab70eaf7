//! A private `/tmp` per session: agents write to `/tmp` by habit, so inside a session `/tmp` is
//! the session's own directory, and nothing written there reaches the host's `/tmp` or another
//! session's.
//!
//! How: the worker, while it still has one thread and before any other lockdown step, enters a
//! mount namespace of its own and bind-mounts its session directory over `/tmp`:
//!
//! 1. as root, `unshare(CLONE_NEWNS)`; as anyone else (or if that is refused),
//!    `unshare(CLONE_NEWUSER | CLONE_NEWNS)` with a user namespace that maps only the worker's
//!    own uid and gid (never 0 for a non-root worker), `setgroups` denied;
//! 2. every mount made a slave of the host's (`MS_REC | MS_SLAVE` on `/`): the bind below can
//!    never propagate back into the host's namespace, while a volume the host unmounts leaves
//!    every worker and spare too (SECURITY.md #154; a private copy kept it mounted, readable
//!    through its grant and busy, until the server exited). Propagation reaches only mounts the
//!    host shares (systemd makes `/` shared);
//! 3. `mount(session_dir, "/tmp", MS_BIND)`.
//!
//! In the same namespace the lockdown later mounts an empty, read-only tmpfs over `/proc`
//! ([`hide_other_processes`]): Landlock refuses opening `/proc` but not `stat`, so
//! `os.stat('/proc/<pid>')` listed every process on the machine with its owner (SECURITY.md
//! #155). Without a namespace (the fallback) `/proc` stays the host's, unreadable but stat-able.
//!
//! This must come before Landlock (which forbids mount changes once applied) and before the
//! capabilities are dropped (a new user namespace grants a full set inside it; the lockdown then
//! drops them all, and seccomp kills any later `unshare`/`mount`). Landlock rules are bound to
//! inodes, so the session directory's read-write rule covers it under `/tmp` as well.
//!
//! Where the kernel refuses (user namespaces disabled, Ubuntu's AppArmor restriction on them,
//! Docker's default seccomp profile, no CAP_SYS_ADMIN), or where the session directories are
//! themselves beneath `/tmp` (a bind over `/tmp` would hide their real paths), the worker falls
//! back: `/tmp` stays the host's and unreachable (Landlock), `TMPDIR` and `tempfile` point at the
//! session directory, and the in-sandbox runner answers `/tmp` paths with a `PermissionError`
//! that says why and what to use instead. `doctor` and `system://info` say which is in force;
//! `IRONCELL_PRIVATE_TMP=off` forces the fallback.

use std::ffi::{CStr, CString};
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::OnceLock;

use clap::ValueEnum;
use serde::{Deserialize, Serialize};

/// The operator's choice.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum PrivateTmpMode {
    /// A private mount namespace with the session directory over `/tmp` where the kernel
    /// allows it; the fallback elsewhere.
    #[default]
    Auto,
    /// Always the fallback: `/tmp` refused with an explanation, `TMPDIR` is the session dir.
    Off,
}

/// What a worker (or this host) gets.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "mechanism", rename_all = "snake_case")]
pub enum PrivateTmp {
    /// `/tmp` is the session directory, bind-mounted in the worker's own mount namespace.
    Namespace {
        /// Which namespace: a plain mount namespace (root) or a user + mount namespace.
        how: String,
        /// Whether the session directory is over `/dev/shm` too, where POSIX semaphores and
        /// shared memory live (`sem_open`, `shm_open`, multiprocessing's locks and heaps): a
        /// worker's children then share them with it and with nothing else (SECURITY.md #160).
        #[serde(default)]
        dev_shm: bool,
    },
    /// No private mount namespace: `/tmp` is refused; `TMPDIR`/`tempfile` use the session dir.
    Fallback {
        reason: String,
        /// Paths beneath `/tmp` the sandbox still grants (the session dir when the state dir is
        /// there, granted folders): the refusal leaves them alone.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        allowed: Vec<String>,
        /// The worker's own namespace, when it has one without the bind (the session
        /// directories are beneath `/tmp`): `/proc` is still hidden and the thread cap its own.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        namespace: Option<String>,
        /// In that namespace, whether `/dev/shm` is the session directory (as with
        /// [`PrivateTmp::Namespace`]: a bind there hides nothing beneath `/tmp`).
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        dev_shm: bool,
    },
}

impl PrivateTmp {
    pub fn is_namespace(&self) -> bool {
        matches!(self, PrivateTmp::Namespace { .. })
    }

    /// Which namespace of its own the worker is in, with or without the bind over `/tmp`.
    pub fn own_namespace(&self) -> Option<&str> {
        match self {
            PrivateTmp::Namespace { how, .. } => Some(how),
            PrivateTmp::Fallback { namespace, .. } => namespace.as_deref(),
        }
    }

    /// The worker made a user namespace of its own (a non-root worker, or root where a plain
    /// mount namespace was refused): RLIMIT_NPROC then counts only its own tasks.
    pub fn in_own_user_namespace(&self) -> bool {
        self.own_namespace()
            .is_some_and(|how| how.starts_with(USER_NAMESPACE))
    }

    /// Whether `/dev/shm` is the session directory (see [`PrivateTmp::Namespace`]).
    pub fn private_dev_shm(&self) -> bool {
        matches!(
            self,
            PrivateTmp::Namespace { dev_shm: true, .. }
                | PrivateTmp::Fallback { dev_shm: true, .. }
        )
    }

    /// One line for `doctor`, the log and `system://info`.
    pub fn describe(&self) -> String {
        match self {
            PrivateTmp::Namespace { how, .. } => format!(
                "private per session: the session directory is mounted over /tmp in the worker's own {how}"
            ),
            PrivateTmp::Fallback {
                reason,
                namespace: None,
                ..
            } => format!(
                "fallback: /tmp is refused inside sessions, TMPDIR and tempfile use the session directory ({reason})"
            ),
            PrivateTmp::Fallback {
                reason,
                namespace: Some(how),
                ..
            } => format!(
                "fallback: /tmp is refused inside sessions, TMPDIR and tempfile use the session directory ({reason}); workers still get their own {how}"
            ),
        }
    }
}

const PATH_TMP: &CStr = c"/tmp";
const PATH_DEV_SHM: &CStr = c"/dev/shm";
const PATH_PROC: &CStr = c"/proc";
const PATH_SYS: &CStr = c"/sys";
const USER_NAMESPACE: &str = "user and mount namespace (mapping only its own uid and gid)";
const PATH_ROOT: &CStr = c"/";
const PATH_SETGROUPS: &CStr = c"/proc/self/setgroups";
const PATH_UID_MAP: &CStr = c"/proc/self/uid_map";
const PATH_GID_MAP: &CStr = c"/proc/self/gid_map";

/// Everything the namespace steps need, prepared in advance so that the steps themselves only
/// make raw system calls (the host probe runs them in a child forked from a threaded process).
struct Prepared {
    source: CString,
    uid_map: CString,
    gid_map: CString,
    is_root: bool,
    /// `MS_REC` on the bind: the host probe binds `/tmp` over itself, and a mount someone made
    /// beneath the host's `/tmp` (a chroot's `/proc`, a FUSE mount) is locked in a user
    /// namespace, so a plain bind of it is refused (EINVAL) although a worker's bind of its
    /// session directory would succeed. Workers bind without it.
    recursive: bool,
    /// Whether to bind `source` over `/tmp` at all (not when the session directories are
    /// beneath it: the namespace is still entered, for `/proc` and the thread cap).
    bind_tmp: bool,
}

impl Prepared {
    fn new(source: &Path, recursive: bool, bind_tmp: bool) -> io::Result<Prepared> {
        // SAFETY: geteuid/getegid cannot fail.
        let (uid, gid) = unsafe { (libc::geteuid(), libc::getegid()) };
        Ok(Prepared {
            source: CString::new(source.as_os_str().as_bytes())
                .map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?,
            uid_map: CString::new(format!("{uid} {uid} 1\n"))
                .map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?,
            gid_map: CString::new(format!("{gid} {gid} 1\n"))
                .map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?,
            is_root: uid == 0,
            recursive,
            bind_tmp,
        })
    }
}

/// A failed step: which one, and the kernel's answer.
#[derive(Debug, Clone, Copy)]
struct StepError {
    step: u8,
    errno: i32,
}

const STEPS: [&str; 7] = [
    "unshare(CLONE_NEWUSER | CLONE_NEWNS)",
    "writing /proc/self/setgroups",
    "writing /proc/self/uid_map",
    "writing /proc/self/gid_map",
    "making mounts slaves of the host's",
    "bind-mounting the session directory over /tmp",
    "mounting an empty tmpfs over /proc",
];

impl StepError {
    fn last_os(step: u8) -> StepError {
        StepError {
            step,
            errno: io::Error::last_os_error()
                .raw_os_error()
                .unwrap_or(libc::EIO),
        }
    }

    fn reason(self) -> String {
        let step = STEPS.get(self.step as usize).copied().unwrap_or("a step");
        let err = io::Error::from_raw_os_error(self.errno);
        let hint = if self.step == 0 {
            ": user namespaces are disabled or restricted on this host (e.g. the sysctl \
             user.max_user_namespaces=0 or kernel.unprivileged_userns_clone=0, Ubuntu's AppArmor \
             restriction, or Docker's default seccomp profile)"
        } else {
            ""
        };
        format!("{step} was refused: {err}{hint}")
    }
}

/// Writes `data` to a `/proc/self` file with raw calls only.
fn write_proc_file(path: &CStr, data: &CStr, step: u8) -> Result<(), StepError> {
    // SAFETY: open(2) with a NUL-terminated path; the fd is closed below.
    let fd = unsafe { libc::open(path.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC) };
    if fd < 0 {
        return Err(StepError::last_os(step));
    }
    let bytes = data.to_bytes();
    // SAFETY: write(2) of a buffer we own, to the fd opened above.
    let n = unsafe { libc::write(fd, bytes.as_ptr().cast(), bytes.len()) };
    let err = (n != bytes.len() as isize).then(|| StepError::last_os(step));
    // SAFETY: closing the fd opened above.
    unsafe { libc::close(fd) };
    err.map_or(Ok(()), Err)
}

/// Steps 1-3 on the calling process, which must have exactly one thread. Returns which kind of
/// namespace it entered.
/// Enters the namespace and makes the binds: which namespace, and whether `/dev/shm` is the
/// session directory too (a host without a `/dev/shm` directory keeps the rest).
fn enter_namespace_and_mount(p: &Prepared) -> Result<(&'static str, bool), StepError> {
    let mut how = "mount namespace";
    // SAFETY: unshare(2) with flag arguments only.
    let plain = p.is_root && unsafe { libc::unshare(libc::CLONE_NEWNS) } == 0;
    if !plain {
        how = USER_NAMESPACE;
        // SAFETY: unshare(2) with flag arguments only.
        if unsafe { libc::unshare(libc::CLONE_NEWUSER | libc::CLONE_NEWNS) } != 0 {
            return Err(StepError::last_os(0));
        }
        write_proc_file(PATH_SETGROUPS, c"deny", 1)?;
        write_proc_file(PATH_UID_MAP, &p.uid_map, 2)?;
        write_proc_file(PATH_GID_MAP, &p.gid_map, 3)?;
    }
    // SAFETY: mount(2) changing propagation only; NULL source/type/data are allowed for it.
    let rc = unsafe {
        libc::mount(
            std::ptr::null(),
            PATH_ROOT.as_ptr(),
            std::ptr::null(),
            libc::MS_REC | libc::MS_SLAVE,
            std::ptr::null(),
        )
    };
    if rc != 0 {
        return Err(StepError::last_os(4));
    }
    let flags = if p.recursive {
        libc::MS_BIND | libc::MS_REC
    } else {
        libc::MS_BIND
    };
    if p.bind_tmp && !bind(&p.source, PATH_TMP, flags) {
        return Err(StepError::last_os(5));
    }
    // `false` where there is no `/dev/shm` to bind over.
    Ok((how, bind(&p.source, PATH_DEV_SHM, flags)))
}

/// `mount(source, target, MS_BIND | ..)`; whether it succeeded (errno says why not).
fn bind(source: &CStr, target: &CStr, flags: libc::c_ulong) -> bool {
    // SAFETY: mount(2) of a bind; both paths are NUL-terminated and outlive the call.
    let rc = unsafe {
        libc::mount(
            source.as_ptr(),
            target.as_ptr(),
            std::ptr::null(),
            flags,
            std::ptr::null(),
        )
    };
    rc == 0
}

/// Why a private `/tmp` cannot be used for a worker with these filesystem grants, if it cannot
/// (a bind over `/tmp` hides every real path beneath it).
fn paths_beneath_tmp(session_dir: &Path, other_grants: &[&Path]) -> Option<String> {
    let tmp = Path::new("/tmp");
    if session_dir.starts_with(tmp) {
        return Some(format!(
            "the session directories are beneath /tmp ({}); set MCP_BRIDGE_STATE_DIR to a directory outside /tmp for a private /tmp",
            session_dir.parent().unwrap_or(session_dir).display()
        ));
    }
    other_grants
        .iter()
        .find(|g| g.starts_with(tmp))
        .map(|g| format!("the sandbox grants a path beneath /tmp ({})", g.display()))
}

/// Gives the calling worker its private `/tmp` (or says why not). Call it in the worker while it
/// has one thread, after entering the session directory and before the lockdown.
pub fn mount_session_dir_over_tmp(
    mode: PrivateTmpMode,
    session_dir: &Path,
    plan: &super::SandboxPlan,
) -> PrivateTmp {
    let grants: Vec<&Path> = plan
        .filesystem
        .iter()
        .flat_map(|g| g.read_only.iter().chain(&g.read_write))
        .map(|p| p.as_path())
        .filter(|p| *p != session_dir)
        .collect();
    let fallback = |reason: String, namespace: Option<(&str, bool)>| PrivateTmp::Fallback {
        reason,
        allowed: std::iter::once(session_dir)
            .chain(grants.iter().copied())
            .filter(|p| p.starts_with("/tmp"))
            .map(|p| p.display().to_string())
            .collect(),
        namespace: namespace.map(|(how, _)| how.to_string()),
        dev_shm: namespace.is_some_and(|(_, shm)| shm),
    };
    if mode == PrivateTmpMode::Off {
        return fallback("turned off by IRONCELL_PRIVATE_TMP=off".into(), None);
    }
    let beneath_tmp = paths_beneath_tmp(session_dir, &grants);
    let prepared = match Prepared::new(session_dir, false, beneath_tmp.is_none()) {
        Ok(p) => p,
        Err(e) => return fallback(format!("unusable session path: {e}"), None),
    };
    match (enter_namespace_and_mount(&prepared), beneath_tmp) {
        (Ok((how, dev_shm)), None) => PrivateTmp::Namespace {
            how: how.into(),
            dev_shm,
        },
        (Ok((how, dev_shm)), Some(reason)) => fallback(reason, Some((how, dev_shm))),
        (Err(e), _) => fallback(e.reason(), None),
    }
}

/// Mounts an empty, read-only tmpfs over `/proc` in the worker's own mount namespace, so no
/// other process can be found there by `stat`, `readlink` or a walk (SECURITY.md #155). Called by
/// the lockdown after the pids cgroup join (which reads `/proc/self/stat`) and before the
/// capabilities are dropped (the mount needs CAP_SYS_ADMIN in the namespace). Nothing of the
/// host's `/proc` is readable afterwards: Landlock grants none of it anyway.
///
/// `/sys` gets the same, unless a grant lies beneath it: its pids cgroup directories are named
/// after workers' pids (`w<pid>`), so `stat` of a guessed one told a live worker's pid.
///
/// The `/proc` it leaves holds one file, `meminfo`, which states the session's memory limit as
/// the machine's memory: libraries size their caches and out-of-core budgets from it (polars'
/// streaming engine, psutil), and with no answer they assumed none and spilled every batch to
/// disk. Returns whether that view is in place (the lockdown then grants reading it).
pub fn hide_other_processes(
    private_tmp: &PrivateTmp,
    grants: &[&Path],
    memory_bytes: u64,
) -> io::Result<bool> {
    if private_tmp.own_namespace().is_none() {
        return Ok(false);
    }
    let errno = |e: StepError| io::Error::from_raw_os_error(e.errno);
    let mut view = false;
    if !grants.iter().any(|g| g.starts_with("/proc")) {
        mount_proc_view(memory_bytes)?;
        view = true;
    }
    if !grants.iter().any(|g| g.starts_with("/sys")) {
        mount_empty(PATH_SYS).map_err(errno)?;
    }
    Ok(view)
}

/// Where the session's view of its memory is, inside its own `/proc`.
pub const PROC_MEMINFO: &str = "/proc/meminfo";

/// A tmpfs over `/proc` holding only `meminfo` (see [`hide_other_processes`]), then made
/// read-only.
fn mount_proc_view(memory_bytes: u64) -> io::Result<()> {
    let flags = libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC;
    // SAFETY: mount(2) of a new tmpfs; every string is NUL-terminated and outlives the call.
    let rc = unsafe {
        libc::mount(
            c"none".as_ptr(),
            PATH_PROC.as_ptr(),
            c"tmpfs".as_ptr(),
            flags,
            c"mode=0555,size=8k,nr_inodes=2".as_ptr().cast(),
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    let kib = memory_bytes / 1024;
    let meminfo = format!(
        "MemTotal:       {kib:>8} kB\nMemFree:        {kib:>8} kB\nMemAvailable:   {kib:>8} kB\n\
         Buffers:               0 kB\nCached:                0 kB\nSwapCached:            0 kB\n\
         SwapTotal:             0 kB\nSwapFree:              0 kB\nShmem:                 0 kB\n\
         Active:                0 kB\nInactive:              0 kB\nSReclaimable:          0 kB\n"
    );
    std::fs::write(PROC_MEMINFO, meminfo)?;
    std::fs::set_permissions(
        PROC_MEMINFO,
        std::os::unix::fs::PermissionsExt::from_mode(0o444),
    )?;
    // SAFETY: remounts the tmpfs just mounted read-only; the path is NUL-terminated.
    let rc = unsafe {
        libc::mount(
            std::ptr::null(),
            PATH_PROC.as_ptr(),
            std::ptr::null(),
            flags | libc::MS_REMOUNT | libc::MS_RDONLY,
            std::ptr::null(),
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// An empty, read-only tmpfs over `path`, with raw calls only (the host probe makes it too).
fn mount_empty(path: &CStr) -> Result<(), StepError> {
    let flags = libc::MS_RDONLY | libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC;
    // SAFETY: mount(2) of a new tmpfs; every string is NUL-terminated and outlives the call.
    let rc = unsafe {
        libc::mount(
            c"none".as_ptr(),
            path.as_ptr(),
            c"tmpfs".as_ptr(),
            flags,
            c"mode=0555,size=4k,nr_inodes=1".as_ptr().cast(),
        )
    };
    if rc != 0 {
        return Err(StepError::last_os(6));
    }
    Ok(())
}

/// What workers of this host will get, found once by trying the same steps in a short-lived
/// child (bind-mounting `/tmp` over itself). For `doctor` and `system://info`.
pub fn host_status(mode: PrivateTmpMode, state_dir: &Path) -> PrivateTmp {
    let fallback = |reason: String, namespace: Option<(&str, bool)>| PrivateTmp::Fallback {
        reason,
        allowed: Vec::new(),
        namespace: namespace.map(|(how, _)| how.to_string()),
        dev_shm: namespace.is_some_and(|(_, shm)| shm),
    };
    if mode == PrivateTmpMode::Off {
        return fallback("turned off by IRONCELL_PRIVATE_TMP=off".into(), None);
    }
    static PROBE: OnceLock<Result<(&'static str, bool), String>> = OnceLock::new();
    let probed = PROBE.get_or_init(probe_in_child);
    match (probed, paths_beneath_tmp(&state_dir.join("sessions"), &[])) {
        (Ok((how, dev_shm)), None) => PrivateTmp::Namespace {
            how: (*how).to_string(),
            dev_shm: *dev_shm,
        },
        (Ok((how, dev_shm)), Some(reason)) => fallback(reason, Some((*how, *dev_shm))),
        (Err(reason), _) => fallback(reason.clone(), None),
    }
}

/// Forks a child that runs the namespace steps and reports the outcome through a pipe.
fn probe_in_child() -> Result<(&'static str, bool), String> {
    let prepared = Prepared::new(Path::new("/tmp"), true, true).map_err(|e| e.to_string())?;
    let (read_end, write_end) =
        nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(|e| e.to_string())?;
    use std::os::fd::AsRawFd;
    let wfd = write_end.as_raw_fd();
    // SAFETY: the child only makes raw system calls (unshare, open, write, mount, _exit) with
    // data prepared before the fork, which is what a child of a threaded process may do.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(io::Error::last_os_error().to_string());
    }
    if pid == 0 {
        let msg: [u8; 6] = match enter_namespace_and_mount(&prepared)
            .and_then(|how| mount_empty(PATH_PROC).map(|()| how))
        {
            Ok(("mount namespace", shm)) => [0, 0, u8::from(shm), 0, 0, 0],
            Ok((_, shm)) => [0, 1, u8::from(shm), 0, 0, 0],
            Err(e) => {
                let b = e.errno.to_le_bytes();
                [1, e.step, b[0], b[1], b[2], b[3]]
            }
        };
        // SAFETY: write(2) to the pipe, then _exit(2) without running any destructor.
        unsafe {
            libc::write(wfd, msg.as_ptr().cast(), msg.len());
            libc::_exit(0)
        }
    }
    drop(write_end);
    let mut msg = [0u8; 6];
    let mut file = std::fs::File::from(read_end);
    let read = io::Read::read_exact(&mut file, &mut msg);
    let _ = nix::sys::wait::waitpid(nix::unistd::Pid::from_raw(pid), None);
    read.map_err(|e| format!("the probe child did not report: {e}"))?;
    match msg {
        [0, 0, shm, ..] => Ok(("mount namespace", shm == 1)),
        [0, _, shm, ..] => Ok((USER_NAMESPACE, shm == 1)),
        [_, step, a, b, c, d] => Err(StepError {
            step,
            errno: i32::from_le_bytes([a, b, c, d]),
        }
        .reason()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn session_dirs_beneath_tmp_fall_back_with_a_reason() {
        let r = paths_beneath_tmp(Path::new("/tmp/state/sessions-1/s"), &[]).unwrap();
        assert!(r.contains("MCP_BRIDGE_STATE_DIR"), "{r}");
        let r = paths_beneath_tmp(
            Path::new("/var/state/s"),
            &[Path::new("/usr"), Path::new("/tmp/project")],
        )
        .unwrap();
        assert!(r.contains("/tmp/project"), "{r}");
        assert!(paths_beneath_tmp(Path::new("/var/state/s"), &[Path::new("/tmpx")]).is_none());
    }

    #[test]
    fn the_forced_fallback_says_so() {
        let s = host_status(PrivateTmpMode::Off, Path::new("/var/x"));
        assert!(!s.is_namespace());
        assert!(s.describe().contains("IRONCELL_PRIVATE_TMP=off"));
    }
}
