//! The only raw libc calls of the sandbox. Each `unsafe` block is one call, and its errno is
//! turned into an `io::Error` on the next line.

use std::io;

/// Landlock ABI version the running kernel supports (0: none, or disabled at boot).
pub fn landlock_abi_of_kernel() -> i32 {
    const LANDLOCK_CREATE_RULESET_VERSION: libc::c_ulong = 1;
    // SAFETY: landlock_create_ruleset(NULL, 0, VERSION) only returns a number.
    let v = unsafe {
        libc::syscall(
            libc::SYS_landlock_create_ruleset,
            std::ptr::null::<libc::c_void>(),
            0usize,
            LANDLOCK_CREATE_RULESET_VERSION,
        )
    };
    if v < 0 { 0 } else { v as i32 }
}

/// Whether this kernel can install seccomp filters.
pub fn seccomp_available() -> bool {
    // SAFETY: PR_GET_SECCOMP has no pointer arguments.
    let rc = unsafe { libc::prctl(libc::PR_GET_SECCOMP, 0, 0, 0, 0) };
    rc >= 0
}

/// Empties the effective, permitted, inheritable and ambient capability sets, and the bounding
/// set where the process may change it.
pub fn drop_all_capabilities() -> io::Result<()> {
    #[repr(C)]
    struct CapHeader {
        version: u32,
        pid: libc::c_int,
    }
    #[repr(C)]
    #[derive(Clone, Copy)]
    struct CapData {
        effective: u32,
        permitted: u32,
        inheritable: u32,
    }
    const LINUX_CAPABILITY_VERSION_3: u32 = 0x2008_0522;
    // SAFETY: PR_CAP_AMBIENT_CLEAR_ALL has no pointer arguments.
    let rc = unsafe {
        libc::prctl(
            libc::PR_CAP_AMBIENT,
            libc::PR_CAP_AMBIENT_CLEAR_ALL,
            0,
            0,
            0,
        )
    };
    if rc != 0 {
        let e = io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EINVAL) {
            return Err(e);
        }
    }
    for cap in 0..64 {
        // SAFETY: PR_CAPBSET_DROP takes a capability number.
        let rc = unsafe { libc::prctl(libc::PR_CAPBSET_DROP, cap, 0, 0, 0) };
        if rc != 0 {
            // EINVAL: no such capability on this kernel (they are numbered without gaps, so
            // none after it either); EPERM: not ours to drop (an unprivileged process has none
            // to lose, and no_new_privs stops it gaining any).
            let e = io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::EINVAL) => break,
                Some(libc::EPERM) => {}
                _ => return Err(e),
            }
        }
    }
    let mut header = CapHeader {
        version: LINUX_CAPABILITY_VERSION_3,
        pid: 0,
    };
    let data = [CapData {
        effective: 0,
        permitted: 0,
        inheritable: 0,
    }; 2];
    // SAFETY: capset with a valid v3 header and two data words, as the ABI requires.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_capset,
            &mut header as *mut CapHeader,
            data.as_ptr(),
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// `PR_SET_NO_NEW_PRIVS`: no exec can ever grant privileges again (and seccomp needs it).
pub fn set_no_new_privs() -> io::Result<()> {
    // SAFETY: integer arguments only.
    let rc = unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// `PR_SET_CHILD_SUBREAPER`: a descendant whose parent ends is re-parented to this process
/// rather than to the machine's init (the zygote: it reaps a worker's orphans).
pub fn become_child_subreaper() -> io::Result<()> {
    nix::sys::prctl::set_child_subreaper(true).map_err(io::Error::from)
}

/// Not dumpable: no core files, and same-uid processes cannot ptrace it or read its memory.
pub fn set_not_dumpable() -> io::Result<()> {
    // SAFETY: integer arguments only.
    let rc = unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// `PR_SET_THP_DISABLE`: no transparent huge page is ever allocated for this process (inherited
/// by its threads; only `PR_SET_THP_DISABLE` clears it, which the worker's seccomp filter does
/// not allow). A 2 MiB page touched and then unmapped but for its first 4 KiB stays whole until
/// memory pressure splits it, while RssAnon and both rlimits count 4 KiB (SECURITY.md #132).
/// Huge pages already mapped (the zygote's collapsed heap, shared) stay as they are.
pub fn disable_transparent_huge_pages() -> io::Result<()> {
    // SAFETY: integer arguments only.
    let rc = unsafe { libc::prctl(libc::PR_SET_THP_DISABLE, 1, 0, 0, 0) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// `PR_SET_THP_DISABLE` cleared: the worker may have transparent huge pages again (the zygote
/// set the flag for itself, and a worker inherits it). Only for a worker in a memory cgroup of
/// its own that cannot reach that group's files (SECURITY.md #271).
pub fn allow_transparent_huge_pages() -> io::Result<()> {
    // SAFETY: integer arguments only.
    let rc = unsafe { libc::prctl(libc::PR_SET_THP_DISABLE, 0, 0, 0, 0) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Whether transparent huge pages are on for this process (`PR_GET_THP_DISABLE` says 0): in a
/// worker, only in a memory group of its own once Landlock is in force (SECURITY.md #271).
pub fn transparent_huge_pages_on() -> bool {
    // SAFETY: integer arguments only; reads the process's flag.
    unsafe { libc::prctl(libc::PR_GET_THP_DISABLE, 0, 0, 0, 0) == 0 }
}

/// Ignore SIGXFSZ so that exceeding RLIMIT_FSIZE makes `write` fail with EFBIG (a Python
/// `OSError`) instead of killing the worker. Embedded CPython does not do this itself.
pub fn ignore_sigxfsz() -> io::Result<()> {
    // SAFETY: installing SIG_IGN for a signal number.
    let prev = unsafe { libc::signal(libc::SIGXFSZ, libc::SIG_IGN) };
    if prev == libc::SIG_ERR {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// At most `n` glibc malloc arenas. Each arena reserves 64 MiB of address space, and glibc
/// makes up to eight per core for threads that allocate at once: under RLIMIT_AS that
/// reservation, not memory, would stop a thread pool. No effect with another libc.
pub fn limit_malloc_arenas(n: i32) {
    #[cfg(target_env = "gnu")]
    // SAFETY: mallopt takes two integers; it only changes a malloc tuning parameter.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, n);
    }
    #[cfg(not(target_env = "gnu"))]
    let _ = n;
}

/// This process's number of threads (field 20 of `/proc/self/stat`), read into a stack buffer:
/// no heap allocation, so the zygote can ask before every fork (a page it writes between forks
/// is a private copy in the worker forked before). `None` if it cannot be read.
pub fn threads_of_this_process() -> Option<u64> {
    use nix::fcntl::{OFlag, open};
    // A `CStr` path is passed to open(2) as it is (a `Path` would be copied).
    let fd = open(
        c"/proc/self/stat",
        OFlag::O_RDONLY | OFlag::O_CLOEXEC,
        nix::sys::stat::Mode::empty(),
    )
    .ok()?;
    let mut buf = [0u8; 1024];
    let n = nix::unistd::read(&fd, &mut buf).ok()?;
    num_threads_field(&buf[..n])
}

/// Field 20 (`num_threads`) of a `/proc/<pid>/stat` line.
fn num_threads_field(stat: &[u8]) -> Option<u64> {
    // The command name (field 2) may hold spaces and parentheses; after its last `)` come
    // fields 3 (state) onward, so field 20 is the 18th.
    let rest = stat.get(stat.iter().rposition(|&b| b == b')')? + 2..)?;
    let field = rest.split(|&b| b == b' ').nth(17)?;
    std::str::from_utf8(field).ok()?.parse().ok()
}

#[cfg(test)]
mod tests {
    #[test]
    fn reads_num_threads_from_a_stat_line() {
        let line = b"4242 (a) b (c)) S 1 4242 4242 0 -1 4194560 500 0 0 0 3 1 0 0 20 0 7 0 \
                     123 456 789 18446744073709551615\n";
        assert_eq!(super::num_threads_field(line), Some(7));
        assert_eq!(super::num_threads_field(b"4242 (cut"), None);
        assert!(super::threads_of_this_process().is_some_and(|n| n >= 1));
    }
}
