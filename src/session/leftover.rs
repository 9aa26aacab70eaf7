//! What a worker printed just before it died: the bytes still in its fd 1 and fd 2 pipes.
//!
//! A worker's output pump reads its pipes and forwards what it reads as `O`/`E` frames. When the
//! worker dies outright (`os._exit`, a crash in native code, the host's kill over its memory or
//! time limit), whatever its pump had not read yet would die with the pipes' only reader. So
//! the worker hands the host a duplicate of each pipe's read end with its `ready`
//! ([`OutputPipes::from_worker`]), and the host reads what is left once the worker is gone
//! ([`OutputPipes::read_left`]): never while it lives, never blocking, never more than
//! [`LEFTOVER_CAP`] per stream (SECURITY.md #277).
//!
//! The worker is the attacker, so the descriptors are checked (exactly two, both FIFOs) and not
//! read through the description the worker shares: the host opens each pipe anew through its
//! own `/proc/self/fd`, a description of its own that is non-blocking whatever the worker (or a
//! child of it, which may still hold either end) does to its flags.

use std::io::Read;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::OpenOptionsExt;

use crate::frame;
use crate::output::StreamCollector;

/// The most read from one stream of a dead worker: a pipe holds 64 KiB unless its writer grew
/// it (`F_SETPIPE_SZ`, up to `/proc/sys/fs/pipe-max-size`, 1 MiB by default), and a child of the
/// worker may still be writing into it.
pub(super) const LEFTOVER_CAP: u64 = 1 << 20;

/// The host's own read ends of a worker's stdout and stderr pipes.
#[derive(Debug)]
pub(super) struct OutputPipes {
    stdout: std::fs::File,
    stderr: std::fs::File,
}

impl OutputPipes {
    /// Takes the descriptors a worker passed at setup (`output_pipes`): exactly two FIFOs, stdout's then
    /// stderr's, each opened anew (non-blocking, read-only) on the same pipe; the worker's
    /// copies are closed. An error names what was wrong (the caller refuses the worker).
    pub(super) fn from_worker(fds: Vec<OwnedFd>) -> Result<OutputPipes, String> {
        let [stdout, stderr]: [OwnedFd; 2] = fds.try_into().map_err(|fds: Vec<OwnedFd>| {
            format!(
                "the output pipes came as {} descriptors, not 2 (a host out of descriptors drops \
                 them: raise `ulimit -n`)",
                fds.len()
            )
        })?;
        Ok(OutputPipes {
            stdout: reopened_pipe(&stdout, "stdout")?,
            stderr: reopened_pipe(&stderr, "stderr")?,
        })
    }

    /// For a forked session, which cannot pass descriptors (seccomp refuses `sendmsg`): two
    /// pipes made by the host, its own read ends, and the four ends the fork gets with its
    /// order (stdout's read and write ends, then stderr's).
    pub(super) fn for_a_fork() -> std::io::Result<(OutputPipes, [OwnedFd; 4])> {
        let (out_r, out_w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)?;
        let (err_r, err_w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)?;
        let pipes = OutputPipes {
            stdout: reopened_pipe(&out_r, "stdout").map_err(std::io::Error::other)?,
            stderr: reopened_pipe(&err_r, "stderr").map_err(std::io::Error::other)?,
        };
        Ok((pipes, [out_r, out_w, err_r, err_w]))
    }

    /// What is left in the pipes, at most `cap_out` bytes of stdout and `cap_err` of stderr
    /// (each at most [`LEFTOVER_CAP`]). Call it only once the worker is gone. Never blocks: it
    /// stops at an empty pipe even while another process still holds the write end.
    pub(super) fn read_left(&self, cap_out: u64, cap_err: u64) -> (Vec<u8>, Vec<u8>) {
        (
            read_available(&self.stdout, cap_out.min(LEFTOVER_CAP)),
            read_available(&self.stderr, cap_err.min(LEFTOVER_CAP)),
        )
    }
}

/// Appends to a run's stdout and stderr, in order, the output frames a killed worker had sent
/// that the host had not read, then what is left in its pipes (`pipes`: only once it is gone),
/// at most `room` bytes in all. Other frames are dropped: the run is over.
pub(super) fn append(
    frames: Vec<bytes::BytesMut>,
    pipes: Option<&OutputPipes>,
    [stdout, stderr]: [&mut StreamCollector; 2],
    mut room: u64,
) {
    for f in frames {
        let (to, bytes) = match f.split_first() {
            Some((&frame::KIND_STDOUT, b)) => (&mut *stdout, b),
            Some((&frame::KIND_STDERR, b)) => (&mut *stderr, b),
            _ => continue,
        };
        let taken = &bytes[..bytes.len().min(room as usize)];
        to.push(taken);
        room -= taken.len() as u64;
    }
    let Some(pipes) = pipes else { return };
    let (out, _) = pipes.read_left(room, 0);
    stdout.push(&out);
    room -= out.len() as u64;
    let (_, err) = pipes.read_left(0, room);
    stderr.push(&err);
}

/// `fd` checked to be a FIFO, then opened again through `/proc/self/fd` (the same pipe, a
/// description of the host's own) and checked to be the same one.
fn reopened_pipe(fd: &OwnedFd, stream: &str) -> Result<std::fs::File, String> {
    let wrong = |what: String| format!("the {stream} pipe passed at setup {what}");
    let passed = nix::sys::stat::fstat(fd).map_err(|e| wrong(format!("cannot be read ({e})")))?;
    if passed.st_mode & libc::S_IFMT != libc::S_IFIFO {
        return Err(wrong(format!(
            "is not a pipe (file type {:o})",
            passed.st_mode & libc::S_IFMT
        )));
    }
    // Opening a FIFO for reading with O_NONBLOCK never waits for a writer.
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(format!("/proc/self/fd/{}", fd.as_raw_fd()))
        .map_err(|e| wrong(format!("cannot be opened again ({e})")))?;
    let opened = nix::sys::stat::fstat(&file).map_err(|e| wrong(format!("({e})")))?;
    if (opened.st_dev, opened.st_ino) != (passed.st_dev, passed.st_ino)
        || opened.st_mode & libc::S_IFMT != libc::S_IFIFO
    {
        return Err(wrong("changed while it was opened again".into()));
    }
    Ok(file)
}

/// Reads `file` (non-blocking) until it is empty, at its end, or `cap` bytes were read.
fn read_available(mut file: &std::fs::File, cap: u64) -> Vec<u8> {
    let mut out = Vec::new();
    let mut chunk = vec![0u8; 64 * 1024];
    while (out.len() as u64) < cap {
        let want = chunk.len().min((cap - out.len() as u64) as usize);
        match file.read(&mut chunk[..want]) {
            Ok(0) => break,
            Ok(n) => out.extend_from_slice(&chunk[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(_) => break, // empty with a writer left (EAGAIN), or anything else
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::fd::AsFd;

    fn pipe() -> (OwnedFd, OwnedFd) {
        nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).unwrap()
    }

    #[test]
    fn two_pipes_are_taken_and_what_is_left_in_them_is_read_without_blocking() {
        let ((out_r, out_w), (err_r, err_w)) = (pipe(), pipe());
        nix::unistd::write(&out_w, b"step 2 done\n").unwrap();
        nix::unistd::write(&err_w, b"warning\n").unwrap();
        let pipes = OutputPipes::from_worker(vec![out_r, err_r]).unwrap();
        // The write ends are still open (a child of the worker may hold them): the read stops
        // at the empty pipe instead of waiting.
        assert_eq!(
            pipes.read_left(LEFTOVER_CAP, LEFTOVER_CAP),
            (b"step 2 done\n".to_vec(), b"warning\n".to_vec())
        );
        nix::unistd::write(&out_w, b"later").unwrap();
        drop((out_w, err_w));
        assert_eq!(pipes.read_left(3, 3), (b"lat".to_vec(), Vec::new()));
    }

    #[test]
    fn the_worker_cannot_make_the_hosts_read_block_by_clearing_o_nonblock() {
        let ((out_r, out_w), (err_r, _err_w)) = (pipe(), pipe());
        let worker_copy = out_r.try_clone().unwrap();
        let pipes = OutputPipes::from_worker(vec![out_r, err_r]).unwrap();
        // The worker's own description is blocking (as a hostile cell may make it).
        let flags = nix::fcntl::fcntl(&worker_copy, nix::fcntl::FcntlArg::F_GETFL).unwrap();
        assert_eq!(flags & libc::O_NONBLOCK, 0);
        nix::unistd::write(&out_w, b"x").unwrap();
        assert_eq!(pipes.read_left(10, 10), (b"x".to_vec(), Vec::new()));
    }

    #[test]
    fn no_more_than_the_cap_is_read_and_the_rest_stays_in_the_pipe() {
        let ((out_r, out_w), (err_r, _err_w)) = (pipe(), pipe());
        // Grown past the cap where this process may (root: CAP_SYS_RESOURCE), else to the
        // unprivileged maximum (1 MiB by default).
        // SAFETY: fcntl(2) with integer arguments on a pipe this test owns.
        let two_mib = unsafe { libc::fcntl(out_w.as_raw_fd(), libc::F_SETPIPE_SZ, 2 << 20) };
        let size = if two_mib > 0 {
            two_mib as usize
        } else {
            // SAFETY: as above.
            unsafe { libc::fcntl(out_w.as_raw_fd(), libc::F_SETPIPE_SZ, 1 << 20) as usize }
        };
        let mut w = std::fs::File::from(out_w);
        w.write_all(&vec![b'a'; size]).unwrap();
        let pipes = OutputPipes::from_worker(vec![out_r, err_r]).unwrap();
        let (out, err) = pipes.read_left(1000, 1000);
        assert_eq!((out.len(), err.len()), (1000, 0));
        let (out, _) = pipes.read_left(LEFTOVER_CAP * 4, 0);
        assert_eq!(out.len(), (size - 1000).min(LEFTOVER_CAP as usize));
        if two_mib > 0 {
            let (out, _) = pipes.read_left(LEFTOVER_CAP * 4, 0);
            assert_eq!(
                out.len(),
                size - 1000 - LEFTOVER_CAP as usize,
                "the rest stayed"
            );
        }
    }

    #[test]
    fn anything_but_exactly_two_pipes_is_refused() {
        let (a, _aw) = pipe();
        let (b, _bw) = pipe();
        let (c, _cw) = pipe();
        let why = OutputPipes::from_worker(vec![a, b, c]).unwrap_err();
        assert!(why.contains("came as 3 descriptors"), "{why}");
        let (a, _aw) = pipe();
        let why = OutputPipes::from_worker(vec![a]).unwrap_err();
        assert!(why.contains("came as 1 descriptors"), "{why}");
        assert!(OutputPipes::from_worker(Vec::new()).is_err());

        let file: OwnedFd = std::fs::File::open(std::env::current_exe().unwrap())
            .unwrap()
            .into();
        let (b, _bw) = pipe();
        let why = OutputPipes::from_worker(vec![file, b]).unwrap_err();
        assert!(
            why.starts_with("the stdout pipe passed at setup is not a pipe"),
            "{why}"
        );

        let (sock, _other) = std::os::unix::net::UnixStream::pair().unwrap();
        let (a, _aw) = pipe();
        let why = OutputPipes::from_worker(vec![a, OwnedFd::from(sock)]).unwrap_err();
        assert!(
            why.starts_with("the stderr pipe passed at setup is not a pipe"),
            "{why}"
        );

        let dev_null: OwnedFd = std::fs::File::open("/dev/null").unwrap().into();
        let (a, _aw) = pipe();
        assert!(OutputPipes::from_worker(vec![a, dev_null]).is_err());
    }

    #[test]
    fn a_pipes_write_end_is_a_pipe_too_and_reads_nothing_of_the_workers() {
        // A worker may pass write ends: they are FIFOs, opened again for reading they read the
        // same pipe, so it gets back only what it wrote into it itself.
        let ((_out_r, out_w), (_err_r, err_w)) = (pipe(), pipe());
        let out_copy = out_w.as_fd().try_clone_to_owned().unwrap();
        let pipes = OutputPipes::from_worker(vec![out_w, err_w]).unwrap();
        nix::unistd::write(&out_copy, b"own").unwrap();
        assert_eq!(pipes.read_left(10, 10), (b"own".to_vec(), Vec::new()));
    }
}
