//! The host's side of the epoll gate (`ironcell_core::sandbox::epoll_gate`): every
//! `epoll_ctl(EPOLL_CTL_ADD)` a session makes — its worker or any of its children — waits here,
//! is counted, and goes on or gets `ENOSPC`.
//!
//! A watch is kernel memory from `fs.epoll.max_user_watches`, a budget the uid shares with the
//! host's own runtime and every other program of the user; the kernel gives no process a share
//! of its own (SECURITY.md #115, #200). So the host keeps the shares:
//! - a session may add [`PER_SESSION`] watches over its worker's life (an addition counts
//!   whether or not it succeeds, so the count never falls below what the session holds);
//! - all sessions together hold at most a quarter of `max_user_watches` (as the change tracker
//!   holds at most a quarter of the inotify watches, SECURITY.md #123);
//! - a session's share comes back when every process using its filter is gone (the listener
//!   reports a hang-up): only then are all its epoll instances, and so its watches, freed.
//!
//! The listener is read only after `poll` reports a waiting call, and the kernel counts one
//! pending receive per call it queues (a call that vanishes leaves its count, so the next
//! receive answers `ENOENT` at once): a receive never waits for the worker.

use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::Mutex;
use std::sync::OnceLock;

use tokio::io::Interest;
use tokio::io::unix::AsyncFd;

/// Watches one session may add over its worker's life. polars adds one per process (its
/// runtime's waker); an asyncio loop on epoll adds one per descriptor it waits on.
pub const PER_SESSION: u64 = 4096;

/// What all sessions together may hold, and hold now.
struct Shared {
    cap: u64,
    held: Mutex<u64>,
}

fn shared() -> &'static Shared {
    static SHARED: OnceLock<Shared> = OnceLock::new();
    SHARED.get_or_init(|| {
        let machine = std::fs::read_to_string("/proc/sys/fs/epoll/max_user_watches")
            .ok()
            .and_then(|s| s.trim().parse::<u64>().ok())
            .unwrap_or(0);
        Shared {
            cap: machine / 4,
            held: Mutex::new(0),
        }
    })
}

/// How many watches the sessions hold and may hold (for `system://info`).
pub fn usage() -> (u64, u64) {
    let s = shared();
    (*crate::lock(&s.held), s.cap)
}

/// A session's share: what it reserved from [`Shared`], given back on drop.
struct Share {
    taken: u64,
}

impl Share {
    /// One more watch, if the session and the server have room.
    fn take_one(&mut self) -> bool {
        if self.taken >= PER_SESSION {
            return false;
        }
        let s = shared();
        let mut held = crate::lock(&s.held);
        if *held >= s.cap {
            return false;
        }
        *held += 1;
        self.taken += 1;
        true
    }
}

impl Drop for Share {
    fn drop(&mut self) {
        let mut held = crate::lock(&shared().held);
        *held = held.saturating_sub(self.taken);
    }
}

/// Whether `fd` is a seccomp listener (the worker is the attacker: it could send anything).
fn is_seccomp_listener(fd: RawFd) -> bool {
    std::fs::read_link(format!("/proc/self/fd/{fd}"))
        .is_ok_and(|target| target.as_os_str() == "anon_inode:seccomp notify")
}

/// Answers the session's additions on `listener` until every process using its filter is gone.
/// Refuses a descriptor that is not a seccomp listener.
pub fn supervise(listener: OwnedFd, session_pid: i32) -> std::io::Result<()> {
    if !is_seccomp_listener(listener.as_raw_fd()) {
        return Err(std::io::Error::other(
            "the worker sent a descriptor that is not its epoll gate's listener",
        ));
    }
    // SAFETY: an OwnedFd's descriptor stays open and the same until the AsyncFd drops it.
    let listener = unsafe { AsyncFd::register_with_interest(listener, Interest::READABLE) }
        .map_err(|e| std::io::Error::other(e.to_string()))?;
    tokio::spawn(async move {
        let mut share = Share { taken: 0 };
        let mut refused = 0u64;
        loop {
            let Ok(mut guard) = listener.readable().await else {
                break;
            };
            match waiting(listener.get_ref().as_raw_fd()) {
                Waiting::Call => {}
                Waiting::Nothing => {
                    guard.clear_ready();
                    continue;
                }
                Waiting::Gone => break,
            }
            let fd = listener.get_ref().as_raw_fd();
            let Some(id) = receive(fd) else { continue };
            let allowed = share.take_one();
            if !allowed {
                refused += 1;
                if refused == 1 {
                    tracing::info!(
                        pid = session_pid,
                        added = share.taken,
                        "a session's epoll additions are refused: its share is used up"
                    );
                }
            }
            respond(fd, id, allowed);
        }
        drop(share);
    });
    Ok(())
}

enum Waiting {
    Call,
    Nothing,
    Gone,
}

/// What `poll` says of the listener right now.
fn waiting(fd: RawFd) -> Waiting {
    let mut pfd = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd, a zero timeout.
    let n = unsafe { libc::poll(&mut pfd, 1, 0) };
    if n < 0 {
        return Waiting::Gone;
    }
    if pfd.revents & libc::POLLIN != 0 {
        Waiting::Call
    } else if pfd.revents & (libc::POLLHUP | libc::POLLERR | libc::POLLNVAL) != 0 {
        Waiting::Gone
    } else {
        Waiting::Nothing
    }
}

/// The id of the waiting call, or `None` if it vanished (its thread was killed).
fn receive(fd: RawFd) -> Option<u64> {
    // SAFETY: the kernel requires a zeroed struct; all-zero is a valid seccomp_notif.
    let mut notif: libc::seccomp_notif = unsafe { std::mem::zeroed() };
    // SAFETY: `fd` is a seccomp listener and `notif` a writable struct of the size the ioctl
    // number encodes.
    let r = unsafe { libc::ioctl(fd, libc::SECCOMP_IOCTL_NOTIF_RECV as _, &mut notif) };
    (r == 0).then_some(notif.id)
}

/// Lets the call go on, or answers it `ENOSPC` (what the kernel answers at
/// `max_user_watches`). A call that vanished meanwhile makes this fail; nothing to do then.
fn respond(fd: RawFd, id: u64, allowed: bool) {
    let resp = libc::seccomp_notif_resp {
        id,
        val: 0,
        error: if allowed { 0 } else { -libc::ENOSPC },
        flags: if allowed {
            libc::SECCOMP_USER_NOTIF_FLAG_CONTINUE as u32
        } else {
            0
        },
    };
    // SAFETY: `fd` is a seccomp listener and `resp` a valid response struct.
    unsafe { libc::ioctl(fd, libc::SECCOMP_IOCTL_NOTIF_SEND as _, &resp) };
}
