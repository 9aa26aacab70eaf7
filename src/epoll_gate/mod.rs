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
//! - one listener serves a lineage (a session and its forks run one filter), and each caller is
//!   mapped to its own session ([`callers`]): a fork has a share of its own, and a caller that
//!   maps to no live session is refused (SECURITY.md #205, #245);
//! - a session's share comes back once its worker has ended and its process group is empty
//!   (the zygote SIGKILLs the group at the worker's end; what left the group is killed by the
//!   memory watch once orphaned), and every share of the lineage when the listener reports
//!   that every process using its filter is gone.
//!
//! The listener is read only after `poll` reports a waiting call, and the kernel counts one
//! pending receive per call it queues (a call that vanishes leaves its count, so the next
//! receive answers `ENOENT` at once): a receive never waits for the worker.

mod callers;

use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::OnceLock;
use std::sync::{Mutex, Weak};
use std::time::Duration;

use tokio::io::Interest;
use tokio::io::unix::AsyncFd;

use crate::zygote::{WorkerProcess, Zygote};

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
#[derive(Default)]
struct Share {
    taken: u64,
    refused: u64,
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

/// How often a lineage looks for shares whose session has ended.
const RELEASE_TICK: Duration = Duration::from_millis(200);

/// The shares of one listener's lineage: the first session's and its forks', by worker (its
/// pidfd, not merely its pid; a lineage has a few workers, so a list).
struct Lineage {
    zygote: Weak<Zygote>,
    first: i32,
    shares: Vec<(WorkerProcess, Share)>,
    /// Additions refused because their caller mapped to no live session.
    unmapped: u64,
}

impl Lineage {
    fn live_workers(&self) -> Vec<WorkerProcess> {
        self.zygote
            .upgrade()
            .map(|z| z.live_workers())
            .unwrap_or_default()
    }

    /// Whether call `id` of thread `tid` may go on: counted against its session's share, or
    /// refused if it maps to none. `None`: the call is gone (nothing to answer or count).
    fn answer(&mut self, fd: RawFd, id: u64, tid: i32) -> Option<bool> {
        let live = self.live_workers();
        let owner = callers::owner(tid, |p| live.iter().any(|w| w.pid() == p), callers::task)
            .and_then(|pid| live.into_iter().find(|w| w.pid() == pid))
            .filter(|w| !w.has_ended());
        // Every read is done: the call still waiting means the thread `tid` named lived
        // throughout (callers.rs).
        if !id_valid(fd, id) {
            return None;
        }
        let Some(worker) = owner else {
            self.unmapped += 1;
            if self.unmapped == 1 {
                tracing::warn!(
                    lineage = self.first,
                    caller = tid,
                    "an epoll addition from a process of no live session is refused (ENOSPC)"
                );
            }
            return Some(false);
        };
        let pid = worker.pid();
        let index = match self.shares.iter().position(|(w, _)| w.is(&worker)) {
            Some(i) => i,
            None => {
                self.shares.push((worker, Share::default()));
                self.shares.len() - 1
            }
        };
        let share = &mut self.shares[index].1;
        let allowed = share.take_one();
        if !allowed {
            share.refused += 1;
            if share.refused == 1 {
                tracing::info!(
                    pid,
                    lineage = self.first,
                    added = share.taken,
                    "a session's epoll additions are refused: its share is used up"
                );
            }
        }
        Some(allowed)
    }

    /// Gives back the shares of sessions that have ended: the worker gone, no process left in
    /// its group and none of the lineage outside every live worker's group (every epoll
    /// instance it or its children held is closed then).
    fn release_ended(&mut self) {
        if self.shares.is_empty() {
            return;
        }
        let live = self.live_workers();
        let ended =
            |worker: &WorkerProcess| worker.has_ended() || !live.iter().any(|w| w.is(worker));
        if !self.shares.iter().any(|(w, _)| ended(w)) {
            return;
        }
        let is_worker = |p: i32| live.iter().any(|w| w.pid() == p);
        // What left an ended worker's group and outlived it (an orphan the zygote adopted) may
        // still hold its epoll instances: no share of the lineage comes back until it is gone.
        let zygote = self.zygote.upgrade().map(|z| z.pid());
        if zygote.is_some_and(|z| callers::escaped_processes_left(z, self.first, is_worker)) {
            return;
        }
        self.shares.retain(|(worker, _)| {
            if !ended(worker) {
                return true;
            }
            let pid = worker.pid();
            // Its pid is a newer worker's: its group is gone (the pid was free).
            let reused = live.iter().any(|w| w.pid() == pid && !w.is(worker));
            // No process in group `pid` (ESRCH); EPERM or success: one is left.
            let group_gone = nix::sys::signal::killpg(nix::unistd::Pid::from_raw(pid), None)
                == Err(nix::errno::Errno::ESRCH);
            !(reused || group_gone)
        });
    }
}

/// Whether `fd` is a seccomp listener (the worker is the attacker: it could send anything).
fn is_seccomp_listener(fd: RawFd) -> bool {
    std::fs::read_link(format!("/proc/self/fd/{fd}"))
        .is_ok_and(|target| target.as_os_str() == "anon_inode:seccomp notify")
}

/// Answers the additions of worker `first_pid`'s lineage (its session, its forks and their
/// children) on `listener` until every process using its filter is gone. `zygote` lists the
/// live workers the callers are mapped to. Refuses a descriptor that is not a seccomp listener.
pub fn supervise(listener: OwnedFd, first_pid: i32, zygote: Weak<Zygote>) -> std::io::Result<()> {
    if !is_seccomp_listener(listener.as_raw_fd()) {
        return Err(std::io::Error::other(
            "the worker sent a descriptor that is not its epoll gate's listener",
        ));
    }
    // SAFETY: an OwnedFd's descriptor stays open and the same until the AsyncFd drops it.
    let listener = unsafe { AsyncFd::register_with_interest(listener, Interest::READABLE) }
        .map_err(|e| std::io::Error::other(e.to_string()))?;
    tokio::spawn(async move {
        let mut lineage = Lineage {
            zygote,
            first: first_pid,
            shares: Vec::new(),
            unmapped: 0,
        };
        let mut tick = tokio::time::interval(RELEASE_TICK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let fd = listener.get_ref().as_raw_fd();
        loop {
            tokio::select! {
                ready = listener.readable() => {
                    let Ok(mut guard) = ready else { break };
                    match waiting(fd) {
                        Waiting::Call => {}
                        Waiting::Nothing => {
                            guard.clear_ready();
                            continue;
                        }
                        Waiting::Gone => break,
                    }
                    let Some((id, tid)) = receive(fd) else { continue };
                    if let Some(allowed) = lineage.answer(fd, id, tid) {
                        respond(fd, id, allowed);
                    }
                }
                // Only while a session holds a share: a lineage that never added a watch (most)
                // sets no timer, which woke the host 5 times a second per session.
                _ = tick.tick(), if !lineage.shares.is_empty() => lineage.release_ended(),
            }
        }
        // Every process using the filter is gone: every share of the lineage comes back.
        drop(lineage);
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

/// The id of the waiting call and its thread's id (in the host's pid namespace), or `None` if
/// it vanished (its thread was killed).
fn receive(fd: RawFd) -> Option<(u64, i32)> {
    // SAFETY: the kernel requires a zeroed struct; all-zero is a valid seccomp_notif.
    let mut notif: libc::seccomp_notif = unsafe { std::mem::zeroed() };
    // SAFETY: `fd` is a seccomp listener and `notif` a writable struct of the size the ioctl
    // number encodes.
    let r = unsafe { libc::ioctl(fd, libc::SECCOMP_IOCTL_NOTIF_RECV as _, &mut notif) };
    (r == 0).then_some((notif.id, notif.pid as i32))
}

/// Whether call `id` is still waiting on the listener (its thread alive, in the call).
fn id_valid(fd: RawFd, id: u64) -> bool {
    // SAFETY: `fd` is a seccomp listener and `id` a readable u64, as the ioctl number encodes.
    unsafe { libc::ioctl(fd, libc::SECCOMP_IOCTL_NOTIF_ID_VALID as _, &id) == 0 }
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
