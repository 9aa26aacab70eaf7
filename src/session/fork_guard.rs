//! What a fork must not leave behind (docs/SECURITY.md #225, #226).
//!
//! Landlock narrows only the thread that asks, and its later children. So when the parent (A)
//! narrows after a fork, a thread or a process its code started before keeps A's pre-fork
//! domain, which grants the forks area the new session's (B's) directory is made in. The host
//! therefore takes A's threads at its `ready` (before any of its session's code ran) as
//! ironcell's own, by thread id and start time, never by the names the worker gives them; once
//! A has narrowed, it lets B go on (B copies nothing before) only if A has no other thread, no
//! live child or orphan of its group, and its line of forks no other process outside a worker's
//! group. And a fork the host gives up on (its `ready` did not come, the call was cancelled, it
//! failed a check) is SIGKILLed with its process group, found by the kernel's word: the
//! zygote's child in the parent's Unix session that holds the fork's socket.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use super::resident::{descendants_to_depth, has_ended, session_children, stat_fields};
use crate::zygote::{WorkerProcess, Zygote};

/// A worker's threads as the host saw them: (thread id, start time in clock ticks since boot),
/// so a thread id the kernel hands out again is a new thread.
pub(super) type Tasks = BTreeSet<(i32, u64)>;

/// The most threads read of one process (a session's task cap is far below it).
const MAX_TASKS: usize = 4096;
/// The most names a refusal lists.
const MAX_NAMED: usize = 4;

/// Clock ticks since boot now (`/proc/uptime`, to its hundredth of a second), rounded down.
pub(super) fn boot_ticks_now() -> u64 {
    // SAFETY: sysconf(3) with a valid name.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    std::fs::read_to_string("/proc/uptime")
        .ok()
        .and_then(|t| t.split_whitespace().next()?.parse::<f64>().ok())
        .map_or(0, |secs| ((secs - 0.02).max(0.0) * hz) as u64)
}

/// When process `pid` started, in clock ticks since boot (`/proc/<pid>/stat` field 22).
pub(super) fn start_ticks_of(pid: i32) -> Option<u64> {
    let stat = std::fs::read(format!("/proc/{pid}/stat")).ok()?;
    let end = stat.iter().rposition(|&b| b == b')')?;
    let rest = std::str::from_utf8(&stat[end + 1..]).ok()?;
    rest.split_ascii_whitespace().nth(19)?.parse().ok()
}

/// The threads of process `pid` now (empty if it is gone).
pub(super) fn tasks_of(pid: i32) -> Tasks {
    let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return Tasks::new();
    };
    dir.filter_map(Result::ok)
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .take(MAX_TASKS)
        .filter_map(|tid| Some((tid, start_ticks(&format!("/proc/{pid}/task/{tid}/stat"))?)))
        .collect()
}

/// Field 22 of a `stat` file (start time), read after the name's last `)`: the worker sets the
/// name.
fn start_ticks(path: &str) -> Option<u64> {
    let stat = std::fs::read(path).ok()?;
    let end = stat.iter().rposition(|&b| b == b')')?;
    let rest = std::str::from_utf8(&stat[end + 1..]).ok()?;
    rest.split_ascii_whitespace().nth(19)?.parse().ok()
}

/// A task's or process's name (`comm`, which the worker sets: shown only as printable ASCII,
/// 15 characters at most).
fn name_of(path: &str) -> String {
    let raw = std::fs::read(path).unwrap_or_default();
    let name: String = raw
        .iter()
        .take(15)
        .take_while(|&&b| b != b'\n')
        .map(|&b| {
            if b.is_ascii_alphanumeric() || b"-_.:/@+".contains(&b) {
                b as char
            } else {
                '?'
            }
        })
        .collect();
    if name.is_empty() { "?".into() } else { name }
}

/// Whether `pid` runs: not gone, and not a zombie, whose `Z` a process whose main thread ended
/// shows too while its other threads run on with the parent's domain (SECURITY.md #299).
fn alive(pid: i32) -> bool {
    !has_ended(pid)
}

/// What one fork's checks need to know of its line.
#[derive(Clone)]
pub(super) struct Line {
    pub zygote: i32,
    /// The Unix session of the line (the first worker's pid: no worker may `setsid`).
    pub sid: i32,
    /// The inode of the fork's socket, which the fork holds on fd 3.
    pub socket_ino: u64,
}

impl Line {
    /// The zygote's children in this line that belong to no live worker: neither a worker nor
    /// in a worker's group, with the sockets each holds, read once ([`Strays`] sorts them).
    pub(super) fn strays_now(&self, zygote: &Zygote) -> Strays {
        // The forks under way first, then the live workers: a fork is listed live before it
        // leaves the forks under way, so it is always in one of the two. Read the other way
        // round, a fork taken between the reads was in neither, and a fork of another parent
        // of the line was refused for it ("1 child process").
        let under_way = crate::lock(&UNDER_WAY).clone();
        let live = &live_pids(zygote)[..];
        let found = descendants_to_depth(self.zygote, 1)
            .into_iter()
            .filter(|&p| !live.contains(&p) && alive(p))
            .filter(|&p| {
                let f = stat_fields(p).unwrap_or_default();
                let field = |i: usize| f.get(i).and_then(|v| v.parse::<i32>().ok());
                field(3) == Some(self.sid) && !field(2).is_some_and(|g| live.contains(&g))
            })
            .map(|p| (p, sockets_held(p)))
            .collect();
        Strays {
            found,
            under_way,
            socket_ino: self.socket_ino,
        }
    }

    /// Once the parent `pid` has narrowed: why B must not go on, if it must not. `own` is the
    /// parent's threads at its `ready` (`None`: never taken, so none is known to be its own).
    /// `strays` is read once the parent has narrowed.
    pub(super) fn check_parent(
        &self,
        session: &str,
        pid: i32,
        own: Option<&Tasks>,
        strays: &Strays,
    ) -> Result<(), String> {
        let Some(own) = own else {
            return Err(format!(
                "session {session:?}'s threads were not recorded when its worker started; \
                 reset it and fork again"
            ));
        };
        let threads: Vec<String> = tasks_of(pid)
            .difference(own)
            .map(|&(tid, _)| name_of(&format!("/proc/{pid}/task/{tid}/comm")))
            .collect();
        // B is in its own group by now (it said so), so only one process may hold its socket.
        let mut children: Vec<i32> = session_children(pid, self.zygote);
        children.extend(strays.others());
        children.extend(strays.holding_the_socket().into_iter().skip(1));
        children.retain(|&c| alive(c));
        children.sort_unstable();
        children.dedup();
        if threads.is_empty() && children.is_empty() {
            return Self::fork_process(strays).map_or_else(
                || {
                    Err(format!(
                        "session {session:?}'s fork was not found: fork again"
                    ))
                },
                |fork| no_shared_file_mappings(session, fork, self.zygote),
            );
        }
        tracing::debug!(pid, ?children, ?own, now = ?tasks_of(pid), "a fork refused");
        let names = |list: Vec<String>| {
            let more = list.len().saturating_sub(MAX_NAMED);
            let mut shown = list
                .into_iter()
                .take(MAX_NAMED)
                .collect::<Vec<_>>()
                .join(", ");
            if more > 0 {
                shown.push_str(&format!(", {more} more"));
            }
            shown
        };
        let mut parts = Vec::new();
        if !threads.is_empty() {
            let n = threads.len();
            parts.push(format!(
                "{n} thread{} of its own code ({})",
                if n == 1 { "" } else { "s" },
                names(threads)
            ));
        }
        if !children.is_empty() {
            let n = children.len();
            let shown = children
                .iter()
                .map(|c| name_of(&format!("/proc/{c}/comm")))
                .collect();
            parts.push(format!(
                "{n} child process{} ({})",
                if n == 1 { "" } else { "es" },
                names(shown)
            ));
        }
        Err(format!(
            "session {session:?} has {}; a fork copies only the thread that runs cells, and these \
             would keep the parent's wider sandbox, which reaches the fork's files: end them \
             (pool.close(); pool.join(), stop the thread, wait for the process) and fork again \
             (some libraries start threads at import and keep them, polars among them: fork \
             the session before that import)",
            parts.join(" and ")
        ))
    }

    /// The fork's process, by the kernel's word (the one zygote's child of this line, outside
    /// every live worker's group, holding the fork's socket), once it said it left the
    /// parent's group; `None` unless there is exactly one.
    pub(super) fn fork_process(strays: &Strays) -> Option<i32> {
        match strays.holding_the_socket()[..] {
            [pid] => Some(pid),
            _ => None,
        }
    }

    /// SIGKILLs the fork's process and its group: the zygote's children in this line, outside
    /// every live worker's group, that hold the fork's socket. Returns how many it signalled.
    pub(super) fn end_fork(&self, zygote: &Zygote) -> usize {
        let found = self.strays_now(zygote).holding_the_socket();
        for &pid in &found {
            let leads = stat_fields(pid).and_then(|f| f.get(2)?.parse::<i32>().ok()) == Some(pid);
            if leads {
                let _ = nix::sys::signal::killpg(
                    nix::unistd::Pid::from_raw(pid),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
        found.len()
    }
}

/// The zygote's children of one line that belong to no live worker ([`Line::strays_now`]),
/// with the sockets each holds (`None`: its descriptors cannot be read).
pub(super) struct Strays {
    found: Vec<(i32, Option<Vec<u64>>)>,
    /// The socket inodes of the forks under way when they were read.
    under_way: Vec<u64>,
    /// This fork's socket.
    socket_ino: u64,
}

impl Strays {
    /// Those holding this fork's socket (and those whose descriptors cannot be read).
    fn holding_the_socket(&self) -> Vec<i32> {
        self.kept(|held| held.contains(&self.socket_ino))
    }

    /// Those holding no socket of a fork under way (another fork of the line is one), and
    /// those whose descriptors cannot be read.
    fn others(&self) -> Vec<i32> {
        self.kept(|held| !held.iter().any(|i| self.under_way.contains(i)))
    }

    fn kept(&self, keep: impl Fn(&[u64]) -> bool) -> Vec<i32> {
        self.found
            .iter()
            .filter(|(_, held)| held.as_deref().is_none_or(&keep))
            .map(|&(pid, _)| pid)
            .collect()
    }
}

/// The socket inodes of the forks under way (each fork's [`EndUnlessTaken`] lists its own).
static UNDER_WAY: std::sync::Mutex<Vec<u64>> = std::sync::Mutex::new(Vec::new());

/// Refuses a fork whose memory maps a file shared (`MAP_SHARED`, as `mmap.mmap(f.fileno(), n)`
/// does) that the zygote does not: the mapping is inherited, on the parent's file, so each side
/// would write the other's file and see its later writes (SECURITY.md #301). The zygote's own
/// (glibc's `gconv-modules.cache`, read-only) are files no session may open for writing.
/// Read from the fork's `/proc/<pid>/maps` (it made itself dumpable) while it runs none of the
/// session's code: what it maps then is what it inherited. Unreadable: refused.
fn no_shared_file_mappings(session: &str, fork: i32, zygote: i32) -> Result<(), String> {
    let theirs = shared_file_mappings(fork)
        .map_err(|e| format!("session {session:?}'s fork's memory cannot be read: {e}"))?;
    let ours = shared_file_mappings(zygote).unwrap_or_default();
    let shared = theirs.iter().filter(|m| !ours.contains(m)).count();
    if shared == 0 {
        return Ok(());
    }
    Err(format!(
        "session {session:?} maps {shared} file(s) shared (mmap; multiprocessing's pools, locks \
         and shared values do too), which the fork would share with it, each side writing the \
         other's: close them (m.close(), del pool) and fork again, or reset the session"
    ))
}

/// The (device, inode) of each file process `pid` maps shared (`s` in its `/proc/<pid>/maps`),
/// read as bytes: the path that ends a line is the process's to name.
fn shared_file_mappings(pid: i32) -> std::io::Result<Vec<(Vec<u8>, Vec<u8>)>> {
    let maps = std::fs::read(format!("/proc/{pid}/maps"))?;
    Ok(maps
        .split(|&b| b == b'\n')
        .filter_map(|line| {
            let mut fields = line.split(|&b| b == b' ').filter(|f| !f.is_empty());
            let perms = fields.nth(1)?;
            let (device, inode) = (fields.nth(1)?, fields.next()?);
            (perms.get(3) == Some(&b's') && inode != b"0")
                .then(|| (device.to_vec(), inode.to_vec()))
        })
        .collect())
}

/// The inodes of the sockets process `pid` holds (`None`: its descriptors cannot be read).
fn sockets_held(pid: i32) -> Option<Vec<u64>> {
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?;
    Some(
        fds.filter_map(Result::ok)
            .take(MAX_TASKS)
            .filter_map(|fd| {
                let link = std::fs::read_link(fd.path()).ok()?;
                let link = link.to_str()?;
                link.strip_prefix("socket:[")?
                    .strip_suffix(']')?
                    .parse()
                    .ok()
            })
            .collect(),
    )
}

/// The pids of the zygote's live workers.
pub(super) fn live_pids(zygote: &Zygote) -> Vec<i32> {
    zygote
        .live_workers()
        .iter()
        .map(WorkerProcess::pid)
        .collect()
}

/// Ends the fork when dropped, unless [`EndUnlessTaken::taken`] (its live worker's handle ends
/// it from then on): every way the host gives up on a fork (a refusal, an error, its `ready`
/// not coming, the call cancelled, which drops the wait) goes through here.
pub(super) struct EndUnlessTaken {
    pub line: Line,
    pub zygote: Arc<Zygote>,
    /// Set when the host gives up: the exchange with the fork, on its blocking thread, sends
    /// no go-ahead after it.
    pub given_up: Arc<AtomicBool>,
    armed: bool,
}

impl EndUnlessTaken {
    pub(super) fn new(line: Line, zygote: Arc<Zygote>) -> EndUnlessTaken {
        crate::lock(&UNDER_WAY).push(line.socket_ino);
        EndUnlessTaken {
            line,
            zygote,
            given_up: Arc::default(),
            armed: true,
        }
    }

    pub(super) fn taken(mut self) {
        self.armed = false;
    }
}

impl Drop for EndUnlessTaken {
    fn drop(&mut self) {
        let mut under_way = crate::lock(&UNDER_WAY);
        if let Some(i) = under_way.iter().position(|&i| i == self.line.socket_ino) {
            under_way.swap_remove(i);
        }
        drop(under_way);
        if self.armed {
            self.given_up.store(true, Ordering::SeqCst);
            let ended = self.line.end_fork(&self.zygote);
            tracing::debug!(ended, "a fork the host gave up on was killed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_thread_started_after_the_record_is_found_and_one_that_ended_is_not() {
        let me = std::process::id() as i32;
        let before = tasks_of(me);
        assert!(before.iter().any(|&(tid, _)| tid == me), "{before:?}");
        let (tid_tx, tid_rx) = std::sync::mpsc::channel::<i32>();
        let (stop_tx, stop_rx) = std::sync::mpsc::channel::<()>();
        let t = std::thread::Builder::new()
            .name("odd\u{1b}[31mname".into())
            .spawn(move || {
                let _ = tid_tx.send(nix::unistd::gettid().as_raw());
                stop_rx.recv()
            })
            .unwrap();
        let tid = tid_rx.recv().unwrap();
        let now = tasks_of(me);
        assert!(now.difference(&before).any(|&(t, _)| t == tid), "{now:?}");
        assert_eq!(
            name_of(&format!("/proc/{me}/task/{tid}/comm")),
            "odd??31mname"
        );
        drop(stop_tx);
        let _ = t.join();
        assert!(!tasks_of(me).iter().any(|&(t, _)| t == tid));
    }
}
