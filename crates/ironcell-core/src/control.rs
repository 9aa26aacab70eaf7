//! The contract between the host and the zygote: the control socket's messages, and the
//! [`WorkerSpec`] a worker is forked with. No logic beyond encoding, decoding and sending.
//!
//! The control socket is a `SOCK_SEQPACKET` pair, one JSON message per packet, fd 3 in the
//! zygote. The host sends [`ZygoteRequest::Spawn`] with the worker's end of a fresh session
//! socketpair attached by `SCM_RIGHTS`; the zygote forks, and answers
//! [`ZygoteEvent::Spawned`] with the pid (or [`ZygoteEvent::SpawnFailed`]). The zygote reaps
//! its children and reports each exit ([`ZygoteEvent::Exited`]), because the host is not their
//! parent and cannot `waitpid` them. Once matplotlib's shared font cache is built, the host may
//! send [`ZygoteRequest::WarmPlots`]: the zygote imports matplotlib between two forks and answers
//! [`ZygoteEvent::PlotsWarmed`]; spawn requests sent after it wait until it is done.

use std::fmt;
use std::io::IoSlice;
use std::os::fd::{FromRawFd, OwnedFd, RawFd};
use std::path::PathBuf;

use anyhow::Context;
use nix::sys::socket::{ControlMessage, MsgFlags, sendmsg};
use serde::{Deserialize, Serialize};

/// The fd number the zygote finds its control socket on.
pub const CONTROL_FD: RawFd = 3;

/// The fd number the zygote finds ironcell's Python extension on (a sealed memfd).
pub const EXTENSION_FD: RawFd = 4;

/// The fd number the zygote reads its boot script from (a sealed memfd), so the script is not
/// on its command line.
pub const BOOT_FD: RawFd = 5;

/// Largest control message. Specs and events are small JSON objects.
pub const MAX_CONTROL_MESSAGE: usize = 64 * 1024;

/// What a worker needs to know about its session. Sent by the host, applied by the worker.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct WorkerSpec {
    pub session: String,
    /// The session's scratch directory: cwd, HOME and TMPDIR of the worker.
    pub scratch: PathBuf,
    /// The worker's whole environment. Nothing else from any process reaches it.
    pub env: Vec<(String, String)>,
    /// The lockdown the worker applies to itself before it runs anything.
    pub sandbox: crate::sandbox::SandboxPlan,
    /// The proxied MCP servers the session can call (names and descriptions only; no secrets).
    pub mcp_servers: Vec<serde_json::Value>,
    /// Inline images are downscaled to fit this many bytes.
    pub image_budget_bytes: u64,
    /// Where this worker's forks of its session will live (granted read-write, made read-only
    /// for the worker itself by its mode bits): `None` where sessions cannot fork.
    #[serde(default)]
    pub forks_area: Option<PathBuf>,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum ZygoteRequest {
    Spawn {
        id: u64,
        spec: Box<WorkerSpec>,
    },
    /// Import matplotlib, pyplot (Agg) and the font manager with `MPLCONFIGDIR` set to the
    /// shared font cache, draw one figure, and `gc.freeze()` again: every worker forked
    /// afterwards starts with all of it, so its first plot costs what a warm one does.
    WarmPlots {
        font_cache_dir: PathBuf,
    },
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum ZygoteEvent {
    /// CPython is initialized and warm; the zygote accepts spawn requests.
    Ready {
        /// Every directory a worker must read to run this interpreter and its packages: stdlib,
        /// lib-dynload, each site-packages and `sys.path` entry, and the directories of the
        /// shared libraries the interpreter has loaded. Granted read-only by Landlock.
        python_paths: Vec<PathBuf>,
        python_version: String,
        prefix: String,
        #[serde(default)]
        base_prefix: String,
        #[serde(default)]
        executable: String,
        #[serde(default)]
        site_packages: Vec<PathBuf>,
        warm_ms: f64,
    },
    /// The interpreter cannot host ironcell (too old, free-threaded, the extension did not load,
    /// warm-up failed). Sent by the boot script or the zygote instead of `Ready`; it then exits.
    Failed {
        message: String,
    },
    Spawned {
        id: u64,
        pid: i32,
    },
    SpawnFailed {
        id: u64,
        message: String,
    },
    Exited {
        pid: i32,
        status: ExitInfo,
    },
    /// The answer to [`ZygoteRequest::WarmPlots`].
    PlotsWarmed {
        /// Whether `matplotlib.pyplot` is now imported in the zygote.
        pyplot: bool,
        /// What the warm-up did, or why it did nothing (no matplotlib, an import error).
        message: String,
        /// How long the zygote spent on it (spawn requests waited that long at most).
        ms: f64,
    },
}

/// How a worker process ended, as reported by the zygote's `waitpid`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ExitInfo {
    Code(i32),
    Signal(i32),
    /// Killed by the host's memory watch (never sent by the zygote): the worker held `held_mib`
    /// of anonymous memory (resident and swapped) and page tables, past what its memory limit
    /// of `limit_mib` allows.
    OverMemory {
        held_mib: u64,
        limit_mib: u64,
    },
    /// Killed by the host's watch (never sent by the zygote) for running `threads` tasks, past
    /// the session's `limit` (where the uid's RLIMIT_NPROC count is shared; SECURITY.md #153).
    OverThreads {
        threads: u64,
        limit: u64,
    },
}

impl fmt::Display for ExitInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            ExitInfo::Code(c) => write!(f, "exited with status {c}"),
            ExitInfo::Signal(s) => {
                let name = match nix::sys::signal::Signal::try_from(s) {
                    Ok(sig) => sig.as_str().to_string(),
                    Err(_) if (libc::SIGRTMIN()..=libc::SIGRTMAX()).contains(&s) => {
                        format!("SIGRTMIN+{}", s - libc::SIGRTMIN())
                    }
                    Err(_) => format!("signal {s}"),
                };
                write!(f, "was killed by {name}")
            }
            ExitInfo::OverMemory {
                held_mib,
                limit_mib,
            } => write!(
                f,
                "was killed for holding {held_mib} MiB of memory, past the memory limit of \
                 {limit_mib} MiB (--memory-limit or MCP_BRIDGE_MEMORY_LIMIT raises it)"
            ),
            ExitInfo::OverThreads { threads, limit } => write!(
                f,
                "was killed for running {threads} threads, past the session's limit of {limit} \
                 (`limits.threads` in a policy file raises it)"
            ),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Sending and receiving (both sides)
// ---------------------------------------------------------------------------------------------

pub fn send_event(ctl: RawFd, event: &ZygoteEvent) -> anyhow::Result<()> {
    send_message(ctl, &serde_json::to_vec(event)?, &[])
}

pub fn send_message(fd: RawFd, body: &[u8], pass_fds: &[RawFd]) -> anyhow::Result<()> {
    if body.len() > MAX_CONTROL_MESSAGE {
        // The receiver's buffer is this large: a longer packet would arrive cut off.
        anyhow::bail!(
            "a control message of {} bytes is over the {MAX_CONTROL_MESSAGE}-byte limit (a very \
             large environment or list of proxied servers?)",
            body.len()
        );
    }
    let iov = [IoSlice::new(body)];
    let cmsgs: Vec<ControlMessage<'_>> = if pass_fds.is_empty() {
        Vec::new()
    } else {
        vec![ControlMessage::ScmRights(pass_fds)]
    };
    loop {
        match sendmsg::<()>(fd, &iov, &cmsgs, MsgFlags::MSG_NOSIGNAL, None) {
            Ok(_) => return Ok(()),
            Err(nix::errno::Errno::EINTR) => continue,
            Err(e) => return Err(e).context("sending on the zygote control socket"),
        }
    }
}

/// Receives one packet and any fds passed with it into `buf`, which is kept for the next call
/// (grown to [`MAX_CONTROL_MESSAGE`] once, zeroed only then). `Ok(None)` when the peer has
/// closed.
///
/// One buffer for all calls, not a fresh 64 KiB one per packet: a zeroed fresh allocation
/// writes all its 16 pages. In the zygote those writes come right after a fork, into pages it
/// still shares with that worker, so each would be copied, and the worker would keep the old
/// copies as its own memory (measured: ~16 of the ~30 pages the zygote wrote per fork).
pub fn recv_message(fd: RawFd, buf: &mut Vec<u8>) -> anyhow::Result<Option<(&[u8], Vec<OwnedFd>)>> {
    if buf.len() < MAX_CONTROL_MESSAGE {
        buf.resize(MAX_CONTROL_MESSAGE, 0);
    }
    let (n, fds, flags) =
        recv_with_fds(fd, buf).context("receiving on the zygote control socket")?;
    if flags & libc::MSG_TRUNC != 0 {
        anyhow::bail!("a control message over {MAX_CONTROL_MESSAGE} bytes arrived cut off");
    }
    if flags & libc::MSG_CTRUNC != 0 {
        // The kernel dropped fds it could not install (this process is at its open-files
        // limit, or more came than the eight expected). The packet is whole, and the caller
        // sees what is missing: a spawn request without its socket is refused, a worker
        // whose pidfd is missing is signalled by pid.
        tracing::warn!(
            received = fds.len(),
            "file descriptors passed with a control message were dropped (out of file \
             descriptors? raise `ulimit -n`)"
        );
    }
    if n == 0 && fds.is_empty() {
        return Ok(None);
    }
    Ok(Some((&buf[..n], fds)))
}

/// One `recvmsg(2)` into `buf` with room for eight passed fds (`MSG_CMSG_CLOEXEC`), retried on
/// `EINTR`: the bytes read, the fds the kernel installed for us, and the message flags
/// (`MSG_TRUNC`, `MSG_CTRUNC`). Not nix's `recvmsg`: its control messages are an error when the
/// kernel had to drop fds (`MSG_CTRUNC`), and the ones it did install would then be left open
/// in this process, nobody's.
pub fn recv_with_fds(
    fd: RawFd,
    buf: &mut [u8],
) -> std::io::Result<(usize, Vec<OwnedFd>, libc::c_int)> {
    let mut control = [0u64; 8];
    // SAFETY: CMSG_SPACE only computes a size.
    let space = unsafe { libc::CMSG_SPACE(8 * std::mem::size_of::<RawFd>() as u32) } as usize;
    debug_assert!(space <= std::mem::size_of_val(&control));
    loop {
        let mut iov = libc::iovec {
            iov_base: buf.as_mut_ptr().cast(),
            iov_len: buf.len(),
        };
        // SAFETY: an all-zero msghdr is a valid empty one; its pointers are set below.
        let mut hdr: libc::msghdr = unsafe { std::mem::zeroed() };
        hdr.msg_iov = &mut iov;
        hdr.msg_iovlen = 1;
        hdr.msg_control = control.as_mut_ptr().cast();
        hdr.msg_controllen = space as _;
        // SAFETY: `hdr` points at `buf` and `control`, both live and as long as it says.
        let n = unsafe { libc::recvmsg(fd, &mut hdr, libc::MSG_CMSG_CLOEXEC) };
        if n < 0 {
            let err = std::io::Error::last_os_error();
            if err.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(err);
        }
        let mut fds = Vec::new();
        // The kernel filled `control` and set `msg_controllen`; the CMSG_* macros walk only
        // within it, and an SCM_RIGHTS message's data is that many fds just installed in this
        // process for us (read unaligned: the buffer promises no alignment to C).
        // SAFETY: the first header within `control`, or null.
        let mut c = unsafe { libc::CMSG_FIRSTHDR(&hdr) };
        while !c.is_null() {
            // SAFETY: a non-null header the CMSG_* macros found within `control`.
            let cmsg = unsafe { &*c };
            if cmsg.cmsg_level == libc::SOL_SOCKET && cmsg.cmsg_type == libc::SCM_RIGHTS {
                // SAFETY: the data of that header, within `control`.
                let data = unsafe { libc::CMSG_DATA(c) }.cast::<RawFd>();
                // SAFETY: arithmetic only.
                let header = unsafe { libc::CMSG_LEN(0) } as usize;
                let len = (cmsg.cmsg_len as usize).saturating_sub(header);
                for i in 0..len / std::mem::size_of::<RawFd>() {
                    // SAFETY: the i-th fd of the message's data, within it.
                    let fd = unsafe { data.wrapping_add(i).read_unaligned() };
                    // SAFETY: an fd the kernel just installed in this process for us alone.
                    fds.push(unsafe { OwnedFd::from_raw_fd(fd) });
                }
            }
            // SAFETY: the header after `c` within `control`, or null.
            c = unsafe { libc::CMSG_NXTHDR(&hdr, c) };
        }
        return Ok((n as usize, fds, hdr.msg_flags));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nix::sys::socket::{AddressFamily, SockFlag, SockType, socketpair};
    use std::os::fd::AsRawFd;

    /// A connected pair of sockets of the control socket's kind.
    fn control_pair() -> (OwnedFd, OwnedFd) {
        socketpair(
            AddressFamily::Unix,
            SockType::SeqPacket,
            None,
            SockFlag::SOCK_CLOEXEC,
        )
        .unwrap()
    }

    #[test]
    fn an_exit_by_any_signal_is_named() {
        assert_eq!(ExitInfo::Signal(9).to_string(), "was killed by SIGKILL");
        let rt = libc::SIGRTMIN() + 2;
        assert_eq!(ExitInfo::Signal(rt).to_string(), "was killed by SIGRTMIN+2");
        assert_eq!(ExitInfo::Signal(99).to_string(), "was killed by signal 99");
    }

    #[test]
    fn packets_and_fds_arrive_in_one_reused_buffer() {
        let (a, b) = control_pair();
        let passed = std::fs::File::open("/dev/null").unwrap();
        send_message(a.as_raw_fd(), b"{\"first\":1}", &[passed.as_raw_fd()]).unwrap();
        send_message(a.as_raw_fd(), b"2", &[]).unwrap();

        let mut buf = Vec::new();
        let (msg, fds) = recv_message(b.as_raw_fd(), &mut buf).unwrap().unwrap();
        assert_eq!(msg, b"{\"first\":1}");
        assert_eq!(fds.len(), 1);
        let at = buf.as_ptr();
        let (msg, fds) = recv_message(b.as_raw_fd(), &mut buf).unwrap().unwrap();
        assert_eq!(msg, b"2");
        assert!(fds.is_empty());
        // The second packet landed where the first did: no new (zeroed) allocation per packet.
        assert_eq!(buf.as_ptr(), at);
        assert_eq!(buf.len(), MAX_CONTROL_MESSAGE);

        // Longer than the receiver's buffer: refused by the sender, not cut off on arrival.
        let err = send_message(a.as_raw_fd(), &vec![b'x'; MAX_CONTROL_MESSAGE + 1], &[]);
        assert!(err.unwrap_err().to_string().contains("limit"));

        drop(a);
        assert!(recv_message(b.as_raw_fd(), &mut buf).unwrap().is_none());
    }

    #[test]
    fn fds_past_the_space_for_them_are_dropped_and_the_packet_still_arrives() {
        let (a, b) = control_pair();
        let files: Vec<_> = (0..10)
            .map(|_| std::fs::File::open("/dev/null").unwrap())
            .collect();
        let raw: Vec<RawFd> = files.iter().map(|f| f.as_raw_fd()).collect();
        let body = b"{\"ten\":10}";
        sendmsg::<()>(
            a.as_raw_fd(),
            &[IoSlice::new(body)],
            &[ControlMessage::ScmRights(&raw)],
            MsgFlags::empty(),
            None,
        )
        .unwrap();
        let mut buf = Vec::new();
        let (msg, fds) = recv_message(b.as_raw_fd(), &mut buf).unwrap().unwrap();
        assert_eq!(msg, body);
        // Only what fit arrived; every fd that did is a working one, closed on exec.
        assert_eq!(fds.len(), 8);
        for fd in &fds {
            let flags = nix::fcntl::fcntl(fd, nix::fcntl::FcntlArg::F_GETFD).unwrap();
            assert_ne!(flags & libc::FD_CLOEXEC, 0);
        }
    }
}
