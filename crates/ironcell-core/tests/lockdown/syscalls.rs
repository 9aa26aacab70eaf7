//! The raw system calls the attacks of [`crate::attacks`] are made of (through libc, no std
//! wrapper that could retry or hide an errno), and the thread cap's probes.

use std::ffi::CStr;

use crate::attacks::{Outcome, Targets};

pub fn errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

pub fn broken(why: &str) -> Outcome {
    Outcome::Broken(format!("{why} (errno {})", errno()))
}

pub fn check(rc: libc::c_int) -> Outcome {
    if rc == 0 {
        Outcome::Done
    } else {
        Outcome::Refused(errno())
    }
}

pub fn open(path: &CStr, flags: libc::c_int) -> Result<libc::c_int, i32> {
    // SAFETY: valid C string; the mode is used only with O_CREAT.
    let fd = unsafe {
        libc::open(
            path.as_ptr(),
            flags | libc::O_CLOEXEC,
            0o755 as libc::c_uint,
        )
    };
    if fd < 0 { Err(errno()) } else { Ok(fd) }
}

pub fn close(fd: libc::c_int) {
    // SAFETY: closing our own fd.
    unsafe { libc::close(fd) };
}

pub fn open_and_close(path: &CStr, flags: libc::c_int) -> Outcome {
    match open(path, flags) {
        Ok(fd) => {
            close(fd);
            Outcome::Done
        }
        Err(e) => Outcome::Refused(e),
    }
}

pub fn on_a_pipe(op: impl FnOnce(libc::c_int) -> libc::c_int) -> Outcome {
    let mut fds = [0; 2];
    // SAFETY: valid array of two ints.
    if unsafe { libc::pipe(fds.as_mut_ptr()) } != 0 {
        return broken("pipe");
    }
    let rc = op(fds[0]);
    let outcome = if rc >= 0 {
        Outcome::Done
    } else {
        Outcome::Refused(errno())
    };
    close(fds[0]);
    close(fds[1]);
    outcome
}

pub fn new_socket(domain: libc::c_int, ty: libc::c_int, protocol: libc::c_int) -> Outcome {
    // SAFETY: integer arguments only.
    let fd = unsafe { libc::socket(domain, ty | libc::SOCK_CLOEXEC, protocol) };
    if fd < 0 {
        return Outcome::Refused(errno());
    }
    close(fd);
    Outcome::Done
}

/// socket() then connect() to 127.0.0.1:`port` (and, for UDP, one datagram).
pub fn connect_inet(ty: libc::c_int, port: u16) -> Outcome {
    // SAFETY: integer arguments only.
    let fd = unsafe { libc::socket(libc::AF_INET, ty | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Outcome::Refused(errno());
    }
    let addr = libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: port.to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from(std::net::Ipv4Addr::LOCALHOST).to_be(),
        },
        sin_zero: [0; 8],
    };
    // SAFETY: a valid sockaddr_in and its size.
    let rc = unsafe {
        libc::connect(
            fd,
            (&addr as *const libc::sockaddr_in).cast(),
            std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
        )
    };
    let mut outcome = if rc == 0 {
        Outcome::Done
    } else {
        Outcome::Refused(errno())
    };
    if outcome == Outcome::Done && ty == libc::SOCK_DGRAM {
        // SAFETY: sending from a valid buffer on a connected socket.
        if unsafe { libc::send(fd, b"x".as_ptr().cast(), 1, 0) } != 1 {
            outcome = Outcome::Refused(errno());
        }
    }
    close(fd);
    outcome
}

/// socket(AF_UNIX) then connect() to a path, or to an abstract name.
pub fn connect_unix(name: &[u8], is_abstract: bool) -> Outcome {
    // SAFETY: integer arguments only.
    let fd = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Outcome::Refused(errno());
    }
    // SAFETY: sockaddr_un is plain data; all zeroes is a valid value.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    let start = usize::from(is_abstract);
    if start + name.len() >= addr.sun_path.len() {
        close(fd);
        return Outcome::Broken("socket name too long".into());
    }
    for (i, b) in name.iter().enumerate() {
        addr.sun_path[start + i] = *b as libc::c_char;
    }
    let len =
        std::mem::size_of::<libc::sa_family_t>() + start + name.len() + usize::from(!is_abstract);
    // SAFETY: a valid sockaddr_un and the length of its used part.
    let rc = unsafe {
        libc::connect(
            fd,
            (&addr as *const libc::sockaddr_un).cast(),
            len as libc::socklen_t,
        )
    };
    let outcome = if rc == 0 {
        Outcome::Done
    } else {
        Outcome::Refused(errno())
    };
    close(fd);
    outcome
}

/// Maps `bytes` of anonymous memory without touching it (the limit is checked at mmap time).
pub fn map_untouched(bytes: u64, sharing: libc::c_int) -> Outcome {
    // SAFETY: a fresh anonymous mapping, unmapped at once, never accessed.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            bytes as usize,
            libc::PROT_READ | libc::PROT_WRITE,
            sharing | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Outcome::Refused(errno());
    }
    // SAFETY: unmapping exactly what was mapped.
    unsafe { libc::munmap(p, bytes as usize) };
    Outcome::Done
}

pub fn exec(path: &CStr) -> Outcome {
    let argv = [
        path.as_ptr(),
        c"-c".as_ptr(),
        c"exit 42".as_ptr(),
        std::ptr::null(),
    ];
    let envp = [std::ptr::null()];
    // SAFETY: null-terminated argv and envp of valid C strings. On success this process
    // becomes the program, which exits 42 (the parent sees the report end early).
    unsafe { libc::execve(path.as_ptr(), argv.as_ptr(), envp.as_ptr()) };
    Outcome::Refused(errno())
}

/// The positive control of catalogue #9: ordinary file work inside the session dir.
pub fn write_read_list_remove_in_scratch(t: &Targets) -> Outcome {
    let text = b"hello from the sandbox";
    let fd = match open(
        &t.scratch_file,
        libc::O_WRONLY | libc::O_CREAT | libc::O_TRUNC,
    ) {
        Ok(fd) => fd,
        Err(e) => return Outcome::Refused(e),
    };
    // SAFETY: writing from a valid buffer to our own fd.
    let n = unsafe { libc::write(fd, text.as_ptr().cast(), text.len()) };
    close(fd);
    if n != text.len() as isize {
        return broken("writing the scratch file");
    }
    let fd = match open(&t.scratch_file, libc::O_RDONLY) {
        Ok(fd) => fd,
        Err(e) => return Outcome::Refused(e),
    };
    let mut back = [0u8; 64];
    // SAFETY: reading into a valid buffer from our own fd.
    let n = unsafe { libc::read(fd, back.as_mut_ptr().cast(), back.len()) };
    close(fd);
    if n < 0 || back[..n as usize] != text[..] {
        return broken("reading the scratch file back");
    }
    // List the scratch dir and find the file.
    // SAFETY: valid C string.
    let dir = unsafe { libc::opendir(t.scratch.as_ptr()) };
    if dir.is_null() {
        return Outcome::Refused(errno());
    }
    let wanted = t
        .scratch_file
        .as_bytes()
        .rsplit(|b| *b == b'/')
        .next()
        .unwrap_or(b"");
    let mut found = false;
    loop {
        // SAFETY: dir is an open DIR stream.
        let entry = unsafe { libc::readdir(dir) };
        if entry.is_null() {
            break;
        }
        // SAFETY: readdir returned a valid dirent.
        let entry = unsafe { &*entry };
        // SAFETY: its d_name is NUL-terminated.
        let name = unsafe { CStr::from_ptr(entry.d_name.as_ptr()) };
        found |= name.to_bytes() == wanted;
    }
    // SAFETY: closing the stream we opened.
    unsafe { libc::closedir(dir) };
    if !found {
        return Outcome::Broken("the new file is missing from the listing".into());
    }
    // SAFETY: valid C string.
    if unsafe { libc::unlink(t.scratch_file.as_ptr()) } != 0 {
        return Outcome::Refused(errno());
    }
    Outcome::Done
}

extern "C" fn park_forever(_: *mut libc::c_void) -> *mut libc::c_void {
    loop {
        // SAFETY: pause only waits for a signal; the child's _exit ends every thread.
        unsafe { libc::pause() };
    }
}

/// Catalogue #29/#49: starts threads with small (64 KiB) stacks, each parked for good, until
/// one is refused or `max` run. Returns how many started and the refusal's errno.
pub fn start_threads(max: u64) -> (u64, Option<i32>) {
    let mut attr = std::mem::MaybeUninit::<libc::pthread_attr_t>::uninit();
    // SAFETY: initialising an attribute object we own.
    let rc = unsafe { libc::pthread_attr_init(attr.as_mut_ptr()) };
    if rc != 0 {
        return (0, Some(rc));
    }
    // SAFETY: pthread_attr_init succeeded; 64 KiB is above PTHREAD_STACK_MIN.
    unsafe { libc::pthread_attr_setstacksize(attr.as_mut_ptr(), 64 << 10) };
    for started in 0..max {
        let mut thread: libc::pthread_t = 0;
        // SAFETY: a valid attribute object and a thread function that never returns.
        let rc = unsafe {
            libc::pthread_create(
                &mut thread,
                attr.as_ptr(),
                park_forever,
                std::ptr::null_mut(),
            )
        };
        if rc != 0 {
            return (started, Some(rc));
        }
    }
    (max, None)
}

/// RLIMIT_NPROC of this process (`RLIM_INFINITY` when there is none).
pub fn nproc_limit() -> u64 {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: valid struct pointer.
    unsafe { libc::getrlimit(libc::RLIMIT_NPROC, &mut lim) };
    lim.rlim_cur
}
