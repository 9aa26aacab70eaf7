//! The attacks a locked-down child makes, each one raw syscall (or a few) through libc, and
//! what must come of it. Numbers are docs/SECURITY.md's attack catalogue.
//!
//! Each attack also has a *control*: what it does in the same child without the lockdown. The
//! control proves that the refusal comes from the sandbox, not from file modes or the
//! environment (a world-writable target dir, a world-readable-and-writable target file, a
//! listener anyone can reach).

use std::ffi::CString;

use crate::syscalls::{
    broken, check, close, connect_inet, connect_unix, errno, exec, map_untouched, new_socket,
    on_a_pipe, open, open_and_close, write_read_list_remove_in_scratch,
};

/// What an attack came to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// The forbidden thing happened (or, for a positive control, the allowed thing worked).
    Done,
    /// The decisive call failed with this errno.
    Refused(i32),
    /// Something else went wrong (a setup step failed, data read back differs, ...).
    Broken(String),
}

impl Outcome {
    pub fn encode(&self) -> String {
        match self {
            Outcome::Done => "done".into(),
            Outcome::Refused(e) => format!("errno {e}"),
            Outcome::Broken(why) => format!("broken {}", why.replace(['\t', '\n'], " ")),
        }
    }

    pub fn decode(s: &str) -> Outcome {
        if s == "done" {
            Outcome::Done
        } else if let Some(n) = s.strip_prefix("errno ").and_then(|n| n.parse().ok()) {
            Outcome::Refused(n)
        } else {
            Outcome::Broken(s.strip_prefix("broken ").unwrap_or(s).to_string())
        }
    }

    pub fn describe(&self) -> String {
        match self {
            Outcome::Done => "it succeeded".into(),
            Outcome::Refused(e) => format!("{} ({e})", nix::errno::Errno::from_raw(*e)),
            Outcome::Broken(why) => format!("broken: {why}"),
        }
    }
}

/// What must come of an attack.
#[derive(Debug, Clone, Copy)]
pub enum Expect {
    Done,
    /// Refused with one of these errnos.
    Refused(&'static [i32]),
    /// Not run (e.g. a successful `execve` would replace the reporting child).
    NotRun,
    /// Done when the child runs as uid 0, otherwise not asserted (file modes decide).
    DoneAsRoot,
    /// Done when the child has the parent's uid, otherwise not asserted.
    DoneAsParentsUser,
    /// Done when the child is root holding this capability (containers often withhold some),
    /// otherwise not asserted.
    DoneAsRootWithCapability(u32),
}

/// Paths, names and limits the attacks aim at, made by the parent before the fork.
pub struct Targets {
    /// A world-readable-and-writable host file outside every grant; holds [`VICTIM_TEXT`].
    pub victim: CString,
    /// A file the attack tries to create in a world-writable host dir outside every grant.
    pub new_host_file: CString,
    pub scratch: CString,
    pub scratch_file: CString,
    pub scratch_link: CString,
    pub scratch_hard_link: CString,
    pub scratch_script: CString,
    pub scratch_big: CString,
    /// A pathname unix socket the parent listens on (mode 0777).
    pub unix_path: CString,
    /// An abstract unix socket name the parent listens on (without the leading NUL).
    pub abstract_name: Vec<u8>,
    pub tcp_port: u16,
    pub udp_port: u16,
    /// RLIMIT_FSIZE of the plan.
    pub file_size_bytes: u64,
    /// RLIMIT_NOFILE of the plan.
    pub open_files: u64,
    /// RLIMIT_DATA of the plan.
    pub memory_bytes: u64,
    /// RLIMIT_AS of the plan.
    pub address_space_bytes: u64,
}

pub const VICTIM_TEXT: &str = "secret";
pub const VICTIM_MODE: u32 = 0o666;

pub struct Attack {
    /// Starts with the catalogue number it implements.
    pub name: &'static str,
    pub run: fn(&Targets) -> Outcome,
    /// Under the lockdown.
    pub locked: Expect,
    /// Without the lockdown, in an otherwise identical child.
    pub control: Expect,
}

const CAP_SYS_RESOURCE: u32 = 24;
const EACCES: &[i32] = &[libc::EACCES];
const EPERM: &[i32] = &[libc::EPERM];

/// Every attack run in one locked-down child, in order. The `execve` attacks are last: if one
/// succeeded, the child's program would be gone and the parent would see the report end early.
pub const ATTACKS: &[Attack] = &[
    Attack {
        name: "01_read_etc_passwd",
        run: |_| open_and_close(c"/etc/passwd", libc::O_RDONLY),
        locked: Expect::Refused(EACCES),
        control: Expect::Done,
    },
    Attack {
        name: "03_list_the_root_directory",
        run: |_| open_and_close(c"/", libc::O_RDONLY | libc::O_DIRECTORY),
        locked: Expect::Refused(EACCES),
        control: Expect::Done,
    },
    Attack {
        name: "04_read_a_host_file_through_a_symlink_in_the_scratch_dir",
        run: |t| {
            // SAFETY: valid C strings.
            if unsafe { libc::symlink(t.victim.as_ptr(), t.scratch_link.as_ptr()) } != 0 {
                return broken("symlink in the scratch dir");
            }
            open_and_close(&t.scratch_link, libc::O_RDONLY)
        },
        locked: Expect::Refused(EACCES),
        control: Expect::Done,
    },
    Attack {
        name: "05_hard_link_a_host_file_into_the_scratch_dir",
        // SAFETY: valid C strings.
        run: |t| check(unsafe { libc::link(t.victim.as_ptr(), t.scratch_hard_link.as_ptr()) }),
        locked: Expect::Refused(&[libc::EXDEV, libc::EACCES]),
        control: Expect::Done,
    },
    Attack {
        name: "06_read_proc_self_environ",
        run: |_| open_and_close(c"/proc/self/environ", libc::O_RDONLY),
        locked: Expect::Refused(EACCES),
        // A child that changed its uid is not dumpable, so its /proc files belong to root.
        control: Expect::DoneAsParentsUser,
    },
    Attack {
        name: "06_read_the_parents_environ",
        run: |_| {
            // SAFETY: getppid cannot fail.
            let path = format!("/proc/{}/environ", unsafe { libc::getppid() });
            match CString::new(path) {
                Ok(p) => open_and_close(&p, libc::O_RDONLY),
                Err(e) => broken(&e.to_string()),
            }
        },
        locked: Expect::Refused(EACCES),
        control: Expect::DoneAsParentsUser,
    },
    Attack {
        name: "07_read_a_world_readable_host_file_outside_the_grants",
        run: |t| open_and_close(&t.victim, libc::O_RDONLY),
        locked: Expect::Refused(EACCES),
        control: Expect::Done,
    },
    Attack {
        name: "08_open_a_world_writable_host_file_for_writing",
        run: |t| open_and_close(&t.victim, libc::O_WRONLY),
        locked: Expect::Refused(EACCES),
        control: Expect::Done,
    },
    Attack {
        name: "08_create_a_file_in_a_world_writable_host_dir",
        run: |t| {
            open_and_close(
                &t.new_host_file,
                libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL,
            )
        },
        locked: Expect::Refused(EACCES),
        control: Expect::Done,
    },
    Attack {
        name: "08_open_etc_passwd_for_writing",
        run: |_| open_and_close(c"/etc/passwd", libc::O_WRONLY),
        locked: Expect::Refused(EACCES),
        control: Expect::DoneAsRoot,
    },
    Attack {
        name: "08_open_a_read_only_grant_for_writing",
        run: |_| open_and_close(c"/etc/ld.so.cache", libc::O_WRONLY),
        locked: Expect::Refused(EACCES),
        control: Expect::DoneAsRoot,
    },
    Attack {
        name: "09_positive_read_a_read_only_grant",
        run: |_| {
            let fd = match open(c"/etc/ld.so.cache", libc::O_RDONLY) {
                Ok(fd) => fd,
                Err(e) => return Outcome::Refused(e),
            };
            let mut byte = [0u8; 1];
            // SAFETY: reading one byte into a valid buffer from our own fd.
            let n = unsafe { libc::read(fd, byte.as_mut_ptr().cast(), 1) };
            close(fd);
            if n == 1 {
                Outcome::Done
            } else {
                broken("read of /etc/ld.so.cache")
            }
        },
        locked: Expect::Done,
        control: Expect::Done,
    },
    Attack {
        name: "09_positive_write_read_back_list_and_remove_in_the_scratch_dir",
        run: write_read_list_remove_in_scratch,
        locked: Expect::Done,
        control: Expect::Done,
    },
    Attack {
        name: "11_a_file_past_the_size_limit_is_efbig_not_a_death",
        run: |t| {
            let fd = match open(&t.scratch_big, libc::O_WRONLY | libc::O_CREAT) {
                Ok(fd) => fd,
                Err(e) => return broken(&format!("creating the file: errno {e}")),
            };
            // One byte just past RLIMIT_FSIZE (a sparse file: nothing is really written).
            let offset = t.file_size_bytes as libc::off_t;
            // SAFETY: writing one byte from a valid buffer to our own fd.
            let rc = unsafe { libc::pwrite(fd, b"x".as_ptr().cast(), 1, offset) };
            let outcome = if rc == 1 {
                Outcome::Done
            } else {
                Outcome::Refused(errno())
            };
            close(fd);
            // SAFETY: valid C string.
            unsafe { libc::unlink(t.scratch_big.as_ptr()) };
            outcome
        },
        locked: Expect::Refused(&[libc::EFBIG]),
        control: Expect::Done,
    },
    Attack {
        name: "12_tcp_connect_to_a_loopback_listener",
        run: |t| connect_inet(libc::SOCK_STREAM, t.tcp_port),
        locked: Expect::Refused(EPERM),
        control: Expect::Done,
    },
    Attack {
        name: "13_udp_sendto_a_loopback_port",
        run: |t| connect_inet(libc::SOCK_DGRAM, t.udp_port),
        locked: Expect::Refused(EPERM),
        control: Expect::Done,
    },
    Attack {
        name: "14_connect_to_a_pathname_unix_socket",
        run: |t| connect_unix(t.unix_path.as_bytes(), false),
        locked: Expect::Refused(EPERM),
        control: Expect::Done,
    },
    Attack {
        name: "15_connect_to_an_abstract_unix_socket",
        run: |t| connect_unix(&t.abstract_name, true),
        locked: Expect::Refused(EPERM),
        control: Expect::Done,
    },
    Attack {
        name: "16_open_a_netlink_socket",
        run: |_| new_socket(libc::AF_NETLINK, libc::SOCK_RAW, libc::NETLINK_ROUTE),
        locked: Expect::Refused(EPERM),
        control: Expect::Done,
    },
    Attack {
        name: "16_open_a_packet_socket",
        run: |_| new_socket(libc::AF_PACKET, libc::SOCK_RAW, 0),
        locked: Expect::Refused(EPERM),
        control: Expect::DoneAsRoot,
    },
    Attack {
        name: "19_fork",
        run: |_| {
            // SAFETY: the grandchild (if any) only calls _exit.
            match unsafe { libc::fork() } {
                // SAFETY: ends the grandchild at once.
                0 => unsafe { libc::_exit(0) },
                -1 => Outcome::Refused(errno()),
                pid => {
                    let mut status = 0;
                    // SAFETY: waiting for our own child.
                    unsafe { libc::waitpid(pid, &mut status, 0) };
                    Outcome::Done
                }
            }
        },
        locked: Expect::Refused(EPERM),
        control: Expect::Done,
    },
    Attack {
        name: "20_signal_the_parent",
        // SAFETY: signal 0 only checks permission.
        run: |_| check(unsafe { libc::kill(nix::unistd::getppid().as_raw(), 0) }),
        locked: Expect::Refused(EPERM),
        control: Expect::DoneAsParentsUser,
    },
    Attack {
        name: "20_signal_every_process",
        // SAFETY: signal 0 only checks permission.
        run: |_| check(unsafe { libc::kill(-1, 0) }),
        locked: Expect::Refused(EPERM),
        control: Expect::DoneAsRoot,
    },
    Attack {
        name: "21_prlimit_on_the_parent",
        run: |_| {
            let mut old = libc::rlimit {
                rlim_cur: 0,
                rlim_max: 0,
            };
            // SAFETY: reads the parent's limit into a valid struct; sets nothing.
            check(unsafe {
                libc::prlimit(
                    nix::unistd::getppid().as_raw(),
                    libc::RLIMIT_NOFILE,
                    std::ptr::null(),
                    &mut old,
                )
            })
        },
        locked: Expect::Refused(EPERM),
        control: Expect::DoneAsParentsUser,
    },
    Attack {
        name: "21_raise_its_own_hard_limit",
        run: |_| {
            // Lower the hard limit by one (anyone may), then raise it back (needs
            // CAP_SYS_RESOURCE): works whatever the starting limit, even at `nr_open`.
            let mut lim = libc::rlimit {
                rlim_cur: 0,
                rlim_max: 0,
            };
            // SAFETY: valid struct pointers.
            if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
                return broken("getrlimit");
            }
            let high = lim.rlim_max;
            lim.rlim_max = high - 1;
            lim.rlim_cur = lim.rlim_cur.min(lim.rlim_max);
            // SAFETY: valid struct pointer.
            if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) } != 0 {
                return broken("lowering the hard limit");
            }
            lim.rlim_max = high;
            // SAFETY: valid struct pointer.
            check(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) })
        },
        locked: Expect::Refused(EPERM),
        control: Expect::DoneAsRootWithCapability(CAP_SYS_RESOURCE),
    },
    Attack {
        name: "23_change_identity",
        // SAFETY: setuid to one's own uid changes nothing when allowed.
        run: |_| check(unsafe { libc::setuid(nix::unistd::getuid().as_raw()) }),
        locked: Expect::Refused(EPERM),
        control: Expect::Done,
    },
    Attack {
        name: "24_ioctl_tiocsti",
        // A pipe, never a terminal: without the sandbox this is ENOTTY, never an injection.
        run: |_| {
            on_a_pipe(|fd| {
                let c = b'x';
                // SAFETY: TIOCSTI reads one byte from a valid pointer.
                unsafe { libc::ioctl(fd, libc::TIOCSTI, &c) }
            })
        },
        locked: Expect::Refused(EPERM),
        control: Expect::Refused(&[libc::ENOTTY]),
    },
    Attack {
        name: "46_chmod_a_host_file_setuid",
        // SAFETY: valid C string.
        run: |t| check(unsafe { libc::chmod(t.victim.as_ptr(), 0o4777) }),
        locked: Expect::Refused(EPERM),
        control: Expect::DoneAsRoot,
    },
    Attack {
        name: "46_fchmod_a_scratch_file",
        run: |t| {
            let fd = match open(&t.scratch_file, libc::O_WRONLY | libc::O_CREAT) {
                Ok(fd) => fd,
                Err(e) => return broken(&format!("creating a scratch file: errno {e}")),
            };
            // SAFETY: our own fd.
            let outcome = check(unsafe { libc::fchmod(fd, 0o4755) });
            close(fd);
            outcome
        },
        locked: Expect::Refused(EPERM),
        control: Expect::Done,
    },
    Attack {
        name: "46_fchmod_through_a_read_only_fd_of_a_granted_file",
        run: |_| {
            let fd = match open(c"/etc/ld.so.cache", libc::O_RDONLY) {
                Ok(fd) => fd,
                Err(e) => return broken(&format!("opening a read-only grant: errno {e}")),
            };
            let mut st = std::mem::MaybeUninit::<libc::stat>::uninit();
            // SAFETY: fstat fills a valid stat buffer.
            if unsafe { libc::fstat(fd, st.as_mut_ptr()) } != 0 {
                close(fd);
                return broken("fstat");
            }
            // SAFETY: fstat succeeded, so the buffer is initialised.
            let mode = unsafe { st.assume_init() }.st_mode & 0o7777;
            // The same mode it has: the call is what is refused, not the change.
            // SAFETY: our own fd.
            let outcome = check(unsafe { libc::fchmod(fd, mode) });
            close(fd);
            outcome
        },
        locked: Expect::Refused(EPERM),
        control: Expect::NotRun,
    },
    Attack {
        name: "46_set_the_times_of_a_host_file",
        run: |t| {
            // SAFETY: valid C string; NULL times means "now".
            check(unsafe {
                libc::utimensat(libc::AT_FDCWD, t.victim.as_ptr(), std::ptr::null(), 0)
            })
        },
        locked: Expect::Refused(EPERM),
        control: Expect::Done,
    },
    Attack {
        // A write to a host file by path (#8); seccomp refuses `truncate` on every Landlock ABI
        // (ABI 3 is the first to mediate it).
        name: "08_truncate_a_world_writable_host_file_by_path",
        run: |t| {
            // SAFETY: valid C string; the victim's own length, so nothing changes even if allowed.
            check(unsafe { libc::truncate(t.victim.as_ptr(), VICTIM_TEXT.len() as libc::off_t) })
        },
        locked: Expect::Refused(EPERM),
        control: Expect::Done,
    },
    Attack {
        name: "47_fcntl_f_setown_to_the_parent",
        run: |_| {
            let parent = nix::unistd::getppid().as_raw();
            // SAFETY: fcntl on a pipe fd we own, integer arguments only.
            on_a_pipe(|fd| unsafe { libc::fcntl(fd, libc::F_SETOWN, parent) })
        },
        locked: Expect::Refused(EPERM),
        control: Expect::Done,
    },
    Attack {
        name: "47_fcntl_set_o_async",
        // SAFETY: fcntl on a pipe fd we own, integer arguments only.
        run: |_| on_a_pipe(|fd| unsafe { libc::fcntl(fd, libc::F_SETFL, libc::O_ASYNC) }),
        locked: Expect::Refused(EPERM),
        control: Expect::Done,
    },
    Attack {
        name: "47_positive_fcntl_set_o_nonblock",
        // SAFETY: fcntl on a pipe fd we own, integer arguments only.
        run: |_| on_a_pipe(|fd| unsafe { libc::fcntl(fd, libc::F_SETFL, libc::O_NONBLOCK) }),
        locked: Expect::Done,
        control: Expect::Done,
    },
    Attack {
        name: "48_memfd_create",
        run: |_| {
            // SAFETY: valid C string.
            let fd = unsafe { libc::memfd_create(c"x".as_ptr(), 0) };
            if fd < 0 {
                return Outcome::Refused(errno());
            }
            close(fd);
            Outcome::Done
        },
        locked: Expect::Refused(EPERM),
        control: Expect::Done,
    },
    Attack {
        name: "48_map_shared_anonymous_memory_past_the_address_space_limit",
        run: |t| map_untouched(t.address_space_bytes + (64 << 20), libc::MAP_SHARED),
        locked: Expect::Refused(&[libc::EPERM]),
        control: Expect::Done,
    },
    Attack {
        name: "28_map_private_memory_past_the_data_limit",
        run: |t| map_untouched(t.memory_bytes + (64 << 20), libc::MAP_PRIVATE),
        locked: Expect::Refused(&[libc::ENOMEM]),
        control: Expect::Done,
    },
    Attack {
        name: "30_open_files_until_emfile_within_the_limit",
        run: |t| {
            let mut opened = Vec::new();
            let outcome = loop {
                // SAFETY: duplicating stdin; failures are the point.
                let fd = unsafe { libc::dup(0) };
                if fd < 0 {
                    break Outcome::Refused(errno());
                }
                opened.push(fd);
                if opened.len() as u64 > t.open_files {
                    break Outcome::Done;
                }
            };
            for fd in opened {
                close(fd);
            }
            outcome
        },
        locked: Expect::Refused(&[libc::EMFILE]),
        control: Expect::NotRun,
    },
    Attack {
        name: "10_exec_a_script_written_in_the_scratch_dir",
        run: |t| {
            let fd = match open(&t.scratch_script, libc::O_WRONLY | libc::O_CREAT) {
                Ok(fd) => fd,
                Err(e) => return broken(&format!("writing the script: errno {e}")),
            };
            let text = b"#!/bin/sh\nexit 42\n";
            // SAFETY: writing from a valid buffer to our own fd.
            let n = unsafe { libc::write(fd, text.as_ptr().cast(), text.len()) };
            close(fd);
            if n != text.len() as isize {
                return broken("writing the script");
            }
            exec(&t.scratch_script)
        },
        locked: Expect::Refused(&[libc::EPERM, libc::EACCES]),
        control: Expect::NotRun,
    },
    Attack {
        name: "19_execve_bin_sh",
        run: |_| exec(c"/bin/sh"),
        locked: Expect::Refused(EPERM),
        control: Expect::NotRun,
    },
];

/// A syscall that seccomp's kill-list answers by ending the process (SIGSYS). The arguments
/// are harmless (a pid that does not exist, a null pointer, no flags), so the control child
/// shows the call returns normally without the filter: the death comes from the filter.
pub struct Killer {
    pub name: &'static str,
    pub run: fn(),
}

/// `syscall(2)` with up to six arguments.
fn raw(nr: libc::c_long, args: [libc::c_long; 6]) {
    // SAFETY: every caller passes harmless arguments (null pointers, invalid ids, zero flags).
    unsafe { libc::syscall(nr, args[0], args[1], args[2], args[3], args[4], args[5]) };
}

/// A pid that no process has (above `pid_max`'s ceiling of 2^22).
const NO_SUCH_PID: libc::c_long = (1 << 22) + 7;

pub const KILLERS: &[Killer] = &[
    Killer {
        name: "22_ptrace_attach",
        run: || {
            raw(
                libc::SYS_ptrace,
                [libc::PTRACE_ATTACH as _, NO_SUCH_PID, 0, 0, 0, 0],
            )
        },
    },
    Killer {
        name: "22_process_vm_readv",
        run: || raw(libc::SYS_process_vm_readv, [NO_SUCH_PID, 0, 0, 0, 0, 0]),
    },
    Killer {
        name: "23_unshare",
        run: || raw(libc::SYS_unshare, [0; 6]),
    },
    Killer {
        name: "23_keyctl",
        run: || raw(libc::SYS_keyctl, [-1, 0, 0, 0, 0, 0]),
    },
    Killer {
        name: "23_bpf",
        run: || raw(libc::SYS_bpf, [-1, 0, 0, 0, 0, 0]),
    },
    Killer {
        name: "23_perf_event_open",
        run: || raw(libc::SYS_perf_event_open, [0, -1, -1, -1, 0, 0]),
    },
    Killer {
        name: "23_userfaultfd",
        run: || raw(libc::SYS_userfaultfd, [-1, 0, 0, 0, 0, 0]),
    },
    Killer {
        name: "23_io_uring_setup",
        run: || raw(libc::SYS_io_uring_setup, [0; 6]),
    },
    Killer {
        name: "23_mount",
        run: || raw(libc::SYS_mount, [0; 6]),
    },
    Killer {
        name: "56_umount2",
        run: || raw(libc::SYS_umount2, [0; 6]),
    },
    Killer {
        name: "23_pidfd_open",
        run: || raw(libc::SYS_pidfd_open, [NO_SUCH_PID, 0, 0, 0, 0, 0]),
    },
];
