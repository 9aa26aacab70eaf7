//! The epoll gate: epoll for the session, with its watches counted by the host.
//!
//! Every `epoll_ctl(EPOLL_CTL_ADD)` takes one watch from `fs.epoll.max_user_watches`, a budget
//! the whole uid shares (the host's own runtime included), in kernel memory no rlimit counts;
//! a watch is keyed by (file, descriptor number), so descriptors `dup2`'d over each other and
//! registered in many instances took all 5.5 million (SECURITY.md #115). The kernel offers no
//! per-process bound, so the host keeps one: a second, tiny seccomp program answers every
//! `EPOLL_CTL_ADD` with `SECCOMP_RET_USER_NOTIF`, and the listener of that program goes to the
//! host, which counts each addition against the session's share and lets the call go on
//! (`SECCOMP_USER_NOTIF_FLAG_CONTINUE`, Linux 5.5) or answers `ENOSPC`, the kernel's own answer
//! at `max_user_watches` (SECURITY.md #200). Only the operation number, a plain register, is
//! read: nothing the worker could change between the check and the call.
//!
//! The gate is installed before the worker's main program, which refuses `seccomp` itself; a
//! session's children inherit it, so their additions reach the same listener. Where no host
//! will listen (an older kernel, the lockdown tests), the gate refuses `epoll_create1` with
//! `EPERM` instead, as the worker's filter did before, and asyncio runs on `poll`.

use std::os::fd::{FromRawFd, OwnedFd};

/// What the gate does in this process.
#[derive(Debug)]
pub enum EpollGate {
    /// Every `EPOLL_CTL_ADD` waits for the host, which holds this listener.
    Counted(OwnedFd),
    /// `epoll_create1` is refused (`EPERM`).
    Refused,
}

#[cfg(target_arch = "x86_64")]
const AUDIT_ARCH: u32 = 0xC000_003E;
#[cfg(target_arch = "aarch64")]
const AUDIT_ARCH: u32 = 0xC000_00B7;

/// Offsets in `struct seccomp_data`: the call number, the architecture, the low 32 bits of the
/// second argument (both architectures are little-endian; the kernel reads `op` as an `int`).
const NR: u32 = 0;
const ARCH: u32 = 4;
const ARG1_LOW: u32 = 16 + 8;

fn stmt(code: u32, k: u32) -> libc::sock_filter {
    libc::sock_filter {
        code: code as u16,
        jt: 0,
        jf: 0,
        k,
    }
}

fn jeq(k: u32, jt: u8, jf: u8) -> libc::sock_filter {
    libc::sock_filter {
        code: (libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K) as u16,
        jt,
        jf,
        k,
    }
}

fn load(offset: u32) -> libc::sock_filter {
    stmt(libc::BPF_LD | libc::BPF_W | libc::BPF_ABS, offset)
}

fn ret(action: u32) -> libc::sock_filter {
    stmt(libc::BPF_RET | libc::BPF_K, action)
}

/// `EPOLL_CTL_ADD` → ask the host; everything else → allow (the main program decides).
fn counting_program() -> Vec<libc::sock_filter> {
    vec![
        load(ARCH),
        jeq(AUDIT_ARCH, 0, 4), // another architecture: the main program kills it
        load(NR),
        jeq(libc::SYS_epoll_ctl as u32, 0, 2),
        load(ARG1_LOW),
        jeq(libc::EPOLL_CTL_ADD as u32, 1, 0),
        ret(libc::SECCOMP_RET_ALLOW),
        ret(libc::SECCOMP_RET_USER_NOTIF),
    ]
}

/// `epoll_create1` → `EPERM`; everything else → allow.
fn refusing_program() -> Vec<libc::sock_filter> {
    vec![
        load(ARCH),
        jeq(AUDIT_ARCH, 0, 2),
        load(NR),
        jeq(libc::SYS_epoll_create1 as u32, 1, 0),
        ret(libc::SECCOMP_RET_ALLOW),
        ret(libc::SECCOMP_RET_ERRNO | libc::EPERM as u32),
    ]
}

fn install(program: &[libc::sock_filter], flags: libc::c_ulong) -> std::io::Result<libc::c_long> {
    let prog = libc::sock_fprog {
        len: program.len() as u16,
        filter: program.as_ptr() as *mut libc::sock_filter,
    };
    // SAFETY: `prog` points at `program`, which outlives the call; the kernel copies it.
    let r = unsafe {
        libc::syscall(
            libc::SYS_seccomp,
            libc::SECCOMP_SET_MODE_FILTER,
            flags,
            &prog as *const libc::sock_fprog,
        )
    };
    if r < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

/// Whether this kernel lets a listener continue a call (`SECCOMP_USER_NOTIF_FLAG_CONTINUE`,
/// Linux 5.5): without it the host could only answer for the kernel, never let it run.
pub fn kernel_can_continue_calls() -> bool {
    // SAFETY: `uname` fills the zeroed struct it is given; nothing else is touched.
    let mut uts: libc::utsname = unsafe { std::mem::zeroed() };
    // SAFETY: `uts` is a valid, writable utsname.
    if unsafe { libc::uname(&mut uts) } != 0 {
        return false;
    }
    let release: String = uts
        .release
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8 as char)
        .collect();
    let mut parts = release
        .split(|c: char| !c.is_ascii_digit())
        .map(|p| p.parse::<u32>().unwrap_or(0));
    let (major, minor) = (parts.next().unwrap_or(0), parts.next().unwrap_or(0));
    (major, minor) >= (5, 5)
}

/// Installs the gate on the calling thread (which must be the process's only one, with
/// `no_new_privs` set): counting when `counted` and the kernel can, refusing otherwise.
pub fn install_on_current_thread(counted: bool) -> std::io::Result<EpollGate> {
    if counted && kernel_can_continue_calls() {
        let flags = libc::SECCOMP_FILTER_FLAG_NEW_LISTENER as libc::c_ulong;
        if let Ok(fd) = install(&counting_program(), flags) {
            // SAFETY: the kernel just returned this descriptor to us; nothing else owns it.
            return Ok(EpollGate::Counted(unsafe {
                OwnedFd::from_raw_fd(fd as libc::c_int)
            }));
        }
    }
    install(&refusing_program(), 0)?;
    Ok(EpollGate::Refused)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_programs_jump_only_forward_inside_themselves() {
        for program in [counting_program(), refusing_program()] {
            for (i, insn) in program.iter().enumerate() {
                if insn.code == (libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K) as u16 {
                    assert!(i + 1 + (insn.jt.max(insn.jf) as usize) < program.len());
                }
            }
            assert_eq!(
                program.last().unwrap().code,
                (libc::BPF_RET | libc::BPF_K) as u16
            );
        }
    }
}
