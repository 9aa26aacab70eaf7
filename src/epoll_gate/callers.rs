//! Whose share an epoll addition comes out of: the session (live worker) the calling process
//! belongs to, found from the kernel's word only.
//!
//! One listener serves a whole lineage: a fork runs its parent's seccomp filter, so the
//! additions of a session, of its forks and of all their children wait on the listener of the
//! lineage's first worker (a fork may not install a gate of its own: a session allowed
//! `seccomp()` could answer its own notifications). The notification names the calling thread
//! (in the host's pid namespace); `/proc/<tid>/status` gives its process, parent and process
//! group. The caller belongs to live worker `W` when
//! - it is `W` (`Tgid`), or is in `W`'s process group (each worker leads its own group; a fork
//!   leaves its parent's with `setpgid(0, 0)`, the only `setpgid` the filter allows, so a
//!   process is in `W`'s group only if it is `W` or descends from `W`), or
//! - its parent is `W` or in `W`'s group (a child that left the group with `setpgid(0, 0)`).
//!
//! Nothing else is looked for: a process two generations below a group it left, or an orphan
//! outside every live worker's group (which the memory watch kills within a tick), maps to no
//! session and its additions are refused (fail closed).
//!
//! Pid reuse: the live workers are taken (with their pidfds) before anything is read, and the
//! chosen one is checked not to have ended after, so its pid and group were its own throughout;
//! the caller's parent is read again after the parent's own status (a parent that ended in
//! between has had its children reparented to the zygote); and the caller's notification must
//! still be valid (`SECCOMP_IOCTL_NOTIF_ID_VALID`) after every read, so the calling thread
//! lived throughout and its id named it.

/// What `/proc/<tid>/status` says of a task: its process, that process's parent and group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Task {
    pub tgid: i32,
    pub parent: i32,
    pub group: i32,
}

/// Parses `/proc/<tid>/status`. The first line (`Name:`) is the worker's to set; the kernel
/// escapes newlines in it, so a key is only ever found at a line's start.
pub(super) fn parse_status(text: &[u8]) -> Option<Task> {
    let mut tgid = None;
    let mut parent = None;
    let mut group = None;
    for line in text.split(|&b| b == b'\n').skip(1) {
        let Some(tab) = line.iter().position(|&b| b == b'\t') else {
            continue;
        };
        let first = || -> Option<i32> {
            let value = std::str::from_utf8(&line[tab + 1..]).ok()?;
            value.split_ascii_whitespace().next()?.parse().ok()
        };
        match &line[..tab] {
            b"Tgid:" => tgid = first(),
            b"PPid:" => parent = first(),
            // In the pid namespace of the `/proc` read, the first: the host's own.
            b"NSpgid:" => group = first(),
            _ => {}
        }
    }
    Some(Task {
        tgid: tgid.filter(|&p| p > 0)?,
        parent: parent.filter(|&p| p >= 0)?,
        group: group.filter(|&p| p > 0)?,
    })
}

/// [`parse_status`] of task `tid` (any thread's id: `/proc` answers for threads it does not
/// list).
pub(super) fn task(tid: i32) -> Option<Task> {
    if tid <= 0 {
        return None;
    }
    parse_status(&std::fs::read(format!("/proc/{tid}/status")).ok()?)
}

/// The live worker (by pid, among those `is_worker` accepts) whose session process `tid`
/// belongs to, read through `read` (`/proc`, or a test's table). `None`: no live worker's.
/// The caller still checks that the worker has not ended and that the call is still valid.
pub(super) fn owner(
    tid: i32,
    is_worker: impl Fn(i32) -> bool,
    read: impl Fn(i32) -> Option<Task>,
) -> Option<i32> {
    // A worker's main thread: thread and process ids are one number space, so a live worker's
    // pid names no other thread (the usual caller, read without a look at `/proc`).
    if is_worker(tid) {
        return Some(tid);
    }
    let caller = read(tid)?;
    if is_worker(caller.tgid) {
        return Some(caller.tgid);
    }
    if is_worker(caller.group) {
        return Some(caller.group);
    }
    if caller.parent <= 1 {
        return None;
    }
    let parent = read(caller.parent)?;
    let found = [caller.parent, parent.group]
        .into_iter()
        .find(|&p| is_worker(p))?;
    // The parent read above was the caller's parent only if the caller's parent has not
    // changed since: a parent that ends first has its children reparented to the zygote.
    (read(tid)?.parent == caller.parent).then_some(found)
}

/// The fields of `/proc/<pid>/stat` after the command name (which the process chooses, so
/// they are read after its last `)`): state, and then process group and Unix session.
fn stat(pid: i32) -> Option<(u8, i32, i32)> {
    let text = std::fs::read(format!("/proc/{pid}/stat")).ok()?;
    let end = text.iter().rposition(|&b| b == b')')?;
    let rest = std::str::from_utf8(&text[end + 1..]).ok()?;
    let mut fields = rest.split_ascii_whitespace();
    let state = *fields.next()?.as_bytes().first()?;
    let _parent = fields.next()?;
    let group = fields.next()?.parse().ok()?;
    let session = fields.next()?.parse().ok()?;
    Some((state, group, session))
}

/// Whether a process of lineage `first` (its Unix session: no worker may `setsid`) left every
/// live worker's group and outlived its parent: adopted by the zygote, it is neither a worker
/// nor in a worker's group, and may hold epoll instances a session that ended counted. The
/// memory watch kills such a process within a tick (SECURITY.md #194); until then, the share
/// it may hold watches of is kept.
pub(super) fn escaped_processes_left(
    zygote: i32,
    first: i32,
    is_worker: impl Fn(i32) -> bool,
) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{zygote}/task")) else {
        return false;
    };
    tasks
        .filter_map(Result::ok)
        .filter_map(|task| std::fs::read_to_string(task.path().join("children")).ok())
        .flat_map(|text| {
            text.split_ascii_whitespace()
                .filter_map(|c| c.parse::<i32>().ok())
                .collect::<Vec<_>>()
        })
        .filter(|&child| !is_worker(child))
        .filter_map(|child| Some((child, stat(child)?)))
        .any(|(child, (state, group, session))| {
            // A `Z` whose other threads run is a process that runs (SECURITY.md #299).
            session == first
                && !is_worker(group)
                && (state != b'Z' || !crate::session::has_ended(child))
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn status_fields_are_found_at_line_starts_only() {
        let text =
            b"Name:\tx\\nTgid:\t1\nUmask:\t0022\nState:\tS (sleeping)\nTgid:\t42\nNgid:\t0\n\
Pid:\t43\nPPid:\t7\nTracerPid:\t0\nNStgid:\t42\t1\nNSpid:\t43\t2\nNSpgid:\t40\t1\nNSsid:\t40\t1\n";
        assert_eq!(
            parse_status(text),
            Some(Task {
                tgid: 42,
                parent: 7,
                group: 40
            })
        );
        // A name is one line: whatever it holds is not a field.
        let named = b"Name:\tTgid:\t9\nPPid:\t7\nNSpgid:\t40\n";
        assert_eq!(parse_status(named), None);
    }

    #[test]
    fn this_process_and_its_children_are_read_as_the_kernel_says() {
        let me = std::process::id() as i32;
        let mine = task(me).expect("our own status");
        assert_eq!(mine.tgid, me);
        // A thread's id reads as its process.
        let (tx, rx) = std::sync::mpsc::channel();
        let keep = std::thread::spawn(move || {
            tx.send(nix::unistd::gettid().as_raw()).unwrap();
            std::thread::sleep(std::time::Duration::from_millis(300));
        });
        let tid = rx.recv().unwrap();
        assert_eq!(task(tid).map(|t| t.tgid), Some(me));
        keep.join().unwrap();
        // A child in a group of its own still names us as its parent.
        use std::os::unix::process::CommandExt;
        let mut child = std::process::Command::new("sleep")
            .arg("5")
            .process_group(0)
            .spawn()
            .unwrap();
        let pid = child.id() as i32;
        let read = task(pid).unwrap();
        assert_eq!((read.tgid, read.parent, read.group), (pid, me, pid));
        assert_eq!(owner(pid, |p| p == me, task), Some(me));
        assert_eq!(owner(pid, |p| p == pid, task), Some(pid));
        assert_eq!(owner(pid, |_| false, task), None);
        child.kill().unwrap();
        child.wait().unwrap();
    }

    #[test]
    fn a_process_of_the_lineage_outside_every_workers_group_is_found() {
        // This process plays the zygote; its child leads a Unix session (the lineage's first
        // worker) and its own group.
        use std::os::unix::process::CommandExt;
        let mut command = std::process::Command::new("sleep");
        command.arg("5");
        // SAFETY: setsid(2) only, between fork and exec.
        unsafe {
            command.pre_exec(|| {
                nix::unistd::setsid()?;
                Ok(())
            })
        };
        let mut child = command.spawn().unwrap();
        let pid = child.id() as i32;
        let me = std::process::id() as i32;
        let mut found = false;
        for _ in 0..100 {
            // Until exec'd after setsid, the child is still in our session.
            found = escaped_processes_left(me, pid, |_| false);
            if found {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        assert!(found, "the child outside every worker's group");
        assert!(!escaped_processes_left(me, pid, |p| p == pid), "a worker");
        assert!(
            !escaped_processes_left(me, pid + 1, |_| false),
            "another lineage"
        );
        child.kill().unwrap();
        child.wait().unwrap();
    }

    /// A table of tasks: pid → (parent, group).
    fn table(rows: &[(i32, i32, i32)]) -> impl Fn(i32) -> Option<Task> + '_ {
        let map: HashMap<i32, (i32, i32)> = rows.iter().map(|&(p, a, g)| (p, (a, g))).collect();
        move |pid| {
            map.get(&pid).map(|&(parent, group)| Task {
                tgid: pid,
                parent,
                group,
            })
        }
    }

    #[test]
    fn a_caller_maps_to_its_worker_its_group_or_its_parents_and_nothing_further() {
        // zygote 10; worker A 100 (its group); fork B 200 (its own group, the zygote's child);
        // A's child 101 in A's group; B's child 201 that left B's group; its child 202 (in
        // 201's group); an orphan 300 that left its group; B before `ready` (400, unknown).
        let rows = [
            (100, 10, 100),
            (101, 100, 100),
            (200, 10, 200),
            (201, 200, 201),
            (202, 201, 201),
            (300, 10, 300),
            (400, 10, 400),
        ];
        let read = table(&rows);
        let live = |p: i32| p == 100 || p == 200;
        assert_eq!(owner(100, live, &read), Some(100));
        assert_eq!(
            owner(100, live, |_| None),
            Some(100),
            "a worker's main thread"
        );
        assert_eq!(owner(101, live, &read), Some(100));
        assert_eq!(owner(200, live, &read), Some(200));
        assert_eq!(owner(201, live, &read), Some(200));
        for unmapped in [202, 300, 400, 999] {
            assert_eq!(owner(unmapped, live, &read), None, "{unmapped}");
        }
        // Once B is gone, its child maps to no one (never to A).
        assert_eq!(owner(201, |p| p == 100, &read), None);
    }
}
