//! Which files a run created or changed, without walking the whole session directory.
//!
//! Walking a session of 100,000 files after every run costs more than the run. Instead, one
//! inotify instance (for all sessions) watches every non-hidden directory of each session for
//! files created, moved in, written, closed after writing, or touched; at the end of a run only
//! those names are looked at. The kernel queues these events at the moment of the change, so
//! everything the run did before it reported `done` is in the queue when the host lists.
//!
//! The events are only hints. Each named path is opened beneath the session directory the same
//! way as everywhere else ([`host_fs::open_beneath`]: no symlink, no `..`), and listed only if
//! it is a regular file modified since the run started, so a worker that games the events can at
//! most hide its own files from its own result. Whenever the events cannot be trusted to be
//! complete, the next listing walks the tree instead (and re-registers the watches):
//! - the kernel's event queue overflowed (all sessions);
//! - a watched directory was moved (the paths recorded for its watches are stale);
//! - more names piled up than [`MAX_PENDING`].
//!
//! A session with more than [`MAX_WATCHED_DIRS`] directories, or on a host out of inotify
//! watches, is no longer watched: its listings walk the tree as before, bounded by
//! [`super::MAX_LISTED_ENTRIES`], and say so when the bound cut them short. Watches are per
//! user (`fs.inotify.max_user_watches`, shared with every other program of the user, and for a
//! root server with every root process), so the server as a whole also stops at a quarter of
//! that budget ([`host_watch_budget`]): a session whose directories would pass it is not
//! watched either. Without that cap 50 sessions of 4,095 directories each took 192,514 of
//! the user's 192,530 watches (SECURITY.md #123).
//!
//! The scratch quota does not rely on any of this: it is measured by walking (see
//! `session.rs`), because a missed event must never let a session grow past it.

use std::collections::{HashMap, HashSet};
use std::ffi::CString;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::path::Path;
use std::sync::Mutex;
use std::time::SystemTime;

use nix::fcntl::OFlag;
use nix::sys::stat::Mode;

use super::{FileRef, mime_for, mtime_of, session_uri};
use crate::host_fs;
use crate::lock;

/// Directories watched per session before it falls back to walking.
pub const MAX_WATCHED_DIRS: usize = 4096;
/// Changed names remembered per session between two listings before the next one walks.
pub const MAX_PENDING: usize = 20_000;

const WATCH_MASK: u32 = libc::IN_CREATE
    | libc::IN_MOVED_TO
    | libc::IN_MODIFY
    | libc::IN_CLOSE_WRITE
    | libc::IN_ATTRIB
    | libc::IN_MOVE_SELF
    | libc::IN_ONLYDIR
    | libc::IN_EXCL_UNLINK;

/// One session's watches and what they reported since its last listing.
#[derive(Default)]
struct Tracked {
    wds: HashSet<i32>,
    /// Files (relative paths) named by events.
    touched: HashSet<String>,
    /// Directories created or moved in: walked whole at the next listing.
    new_dirs: HashSet<String>,
    /// Why the next listing must walk the tree (and re-register every watch).
    rescan: Option<&'static str>,
    /// Why this session is not watched at all any more.
    untracked: Option<String>,
    /// The host is renaming the session's directory (a spare handed to its session): the
    /// root's own move event is expected, and harmless (every path here is relative to it).
    root_moving: bool,
    /// An event named a file whose name is not UTF-8 (left out of listings; the next one says so).
    unlisted_names: bool,
}

struct Inner {
    /// Watch descriptor → (session, directory relative to the session directory, "" for it).
    dirs: HashMap<i32, (String, String)>,
    sessions: HashMap<String, Tracked>,
}

/// The inotify instance shared by all sessions of a server.
pub struct ChangeTracker {
    fd: Option<OwnedFd>,
    inner: Mutex<Inner>,
    /// Watches this server may hold across all its sessions.
    max_watches: usize,
}

/// The watches a server may hold across its sessions: a quarter of the user's
/// `fs.inotify.max_user_watches` (8,192 on old kernels, more with memory on newer ones).
pub fn host_watch_budget() -> usize {
    std::fs::read_to_string("/proc/sys/fs/inotify/max_user_watches")
        .ok()
        .and_then(|s| s.trim().parse::<usize>().ok())
        .unwrap_or(8192)
        / 4
}

/// What a listing found.
pub struct Changes {
    pub files: Vec<FileRef>,
    /// Why the list may be incomplete, if it may.
    pub incomplete: Option<String>,
    /// How the list was made: "events" or "walk" (for logs and tests).
    pub method: &'static str,
}

/// Whether a proper ancestor of the relative path `rel` is in `dirs`: one lookup per level of
/// `rel` (not one comparison per directory: a session can create tens of thousands).
fn beneath_any(rel: &str, dirs: &HashSet<String>) -> bool {
    rel.match_indices('/')
        .any(|(i, _)| dirs.contains(&rel[..i]))
}

fn hidden(rel: &str) -> bool {
    rel.split('/').any(|c| c.starts_with('.'))
}

fn join(dir: &str, name: &str) -> String {
    if dir.is_empty() {
        name.to_string()
    } else {
        format!("{dir}/{name}")
    }
}

impl Default for ChangeTracker {
    fn default() -> Self {
        Self::new()
    }
}

impl ChangeTracker {
    pub fn new() -> ChangeTracker {
        Self::with_max_watches(host_watch_budget())
    }

    pub fn with_max_watches(max_watches: usize) -> ChangeTracker {
        // SAFETY: inotify_init1 has no preconditions; a non-negative result is a new fd we own.
        let raw = unsafe { libc::inotify_init1(libc::IN_NONBLOCK | libc::IN_CLOEXEC) };
        let fd = if raw >= 0 {
            // SAFETY: `raw` was just returned by inotify_init1 and is owned by nobody else.
            Some(unsafe { OwnedFd::from_raw_fd(raw) })
        } else {
            tracing::warn!(
                error = %std::io::Error::last_os_error(),
                "inotify is unavailable: every run's file listing walks its session directory"
            );
            None
        };
        ChangeTracker {
            fd,
            inner: Mutex::new(Inner {
                dirs: HashMap::new(),
                sessions: HashMap::new(),
            }),
            max_watches,
        }
    }

    /// Reads every queued event and files it under its session. Cheap; call it often enough
    /// that the kernel's queue does not overflow.
    /// Skipped while a listing holds the tracker (the events wait in the kernel's queue): the
    /// quota watch calls it on the async runtime, and a listing can take a while.
    pub fn drain(&self) {
        if let Ok(mut inner) = self.inner.try_lock() {
            self.drain_locked(&mut inner);
        }
    }

    fn drain_locked(&self, inner: &mut Inner) {
        let Some(fd) = self.fd.as_ref() else { return };
        // On the stack: every run's listing drains (an event is at most 272 bytes).
        let mut buf = [0u8; 8192];
        loop {
            let n = match nix::unistd::read(fd.as_fd(), &mut buf) {
                Ok(0) | Err(_) => return, // EAGAIN: drained
                Ok(n) => n,
            };
            let mut at = 0;
            let head = std::mem::size_of::<libc::inotify_event>();
            while at + head <= n {
                // SAFETY: the kernel wrote whole events; read_unaligned copes with alignment.
                let ev: libc::inotify_event = unsafe {
                    std::ptr::read_unaligned(buf[at..].as_ptr().cast::<libc::inotify_event>())
                };
                let name_end = (at + head + ev.len as usize).min(n);
                let raw_name = &buf[at + head..name_end];
                let name = raw_name.split(|b| *b == 0).next().unwrap_or_default();
                at = name_end;
                Self::file_event(inner, ev.wd, ev.mask, name);
            }
        }
    }

    fn file_event(inner: &mut Inner, wd: i32, mask: u32, name: &[u8]) {
        if mask & libc::IN_Q_OVERFLOW != 0 {
            for t in inner.sessions.values_mut() {
                t.rescan = Some("too many changes at once for the change queue");
            }
            return;
        }
        if mask & libc::IN_IGNORED != 0 {
            if let Some(t) = inner
                .dirs
                .remove(&wd)
                .and_then(|(session, _)| inner.sessions.get_mut(&session))
            {
                t.wds.remove(&wd);
            }
            return;
        }
        let Some((session, dir)) = inner.dirs.get(&wd) else {
            return;
        };
        let Some(t) = inner.sessions.get_mut(session) else {
            return;
        };
        if mask & libc::IN_MOVE_SELF != 0 {
            if dir.is_empty() && std::mem::take(&mut t.root_moving) {
                return;
            }
            t.rescan = Some("a directory was moved");
            return;
        }
        let Ok(name) = std::str::from_utf8(name) else {
            // Not listable (paths are reported as UTF-8); the next listing says so.
            t.unlisted_names |= !name.starts_with(b".");
            return;
        };
        if name.is_empty() || name.starts_with('.') {
            return;
        }
        let rel = join(dir, name);
        if mask & libc::IN_ISDIR != 0 {
            if mask & (libc::IN_CREATE | libc::IN_MOVED_TO) != 0 {
                t.new_dirs.insert(rel);
            }
        } else {
            t.touched.insert(rel);
        }
        if t.touched.len() + t.new_dirs.len() > MAX_PENDING {
            t.touched.clear();
            t.new_dirs.clear();
            t.rescan = Some("too many changes to follow one by one");
        }
    }

    /// Stops watching a session (its directory is being removed); the next listing starts over.
    pub fn forget(&self, session: &str) {
        let mut inner = lock(&self.inner);
        self.drain_locked(&mut inner);
        if let Some(t) = inner.sessions.remove(session) {
            for wd in t.wds {
                inner.dirs.remove(&wd);
                if let Some(fd) = self.fd.as_ref() {
                    // SAFETY: plain syscall on our own inotify fd; a stale wd just fails.
                    unsafe { libc::inotify_rm_watch(fd.as_raw_fd(), wd) };
                }
            }
        }
    }

    /// Moves what is known of `from` to the session `to`, whose directory the host is about to
    /// rename from `from`'s (a spare handed to its session), so the new session's first listing
    /// reads events instead of walking. Whatever was known of `to` is dropped.
    pub fn rename(&self, from: &str, to: &str) {
        self.forget(to);
        let mut guard = lock(&self.inner);
        self.drain_locked(&mut guard);
        let Inner { dirs, sessions } = &mut *guard;
        let Some(mut t) = sessions.remove(from) else {
            return;
        };
        for wd in &t.wds {
            if let Some((session, _)) = dirs.get_mut(wd) {
                *session = to.to_string();
            }
        }
        t.root_moving = true;
        sessions.insert(to.to_string(), t);
    }

    /// The listing of a run that changed nothing the watches saw, if that is known without
    /// touching the file system: the session is watched, no event named anything since its
    /// last listing, and nothing asks for a walk. Never blocks: `None` when another listing
    /// holds the tracker (or anything is pending), and the caller lists the slow way.
    pub fn unchanged(&self, session: &str) -> Option<Changes> {
        self.fd.as_ref()?;
        let mut guard = self.inner.try_lock().ok()?;
        self.drain_locked(&mut guard);
        let t = guard.sessions.get(session)?;
        let quiet = t.rescan.is_none()
            && t.untracked.is_none()
            && !t.unlisted_names
            && t.touched.is_empty()
            && t.new_dirs.is_empty()
            && !t.wds.is_empty();
        quiet.then_some(Changes {
            files: Vec::new(),
            incomplete: None,
            method: "events",
        })
    }

    /// What the events named since the session's last listing — files, and directories
    /// created or moved in (their contents unnamed) — if the events are known to be complete
    /// (the session is watched and nothing asks for a walk); at most `limit` names, else
    /// `None`. Leaves them pending for the listing. For a worker's image search in a large
    /// session, so its cost does not grow with the session's size.
    pub fn pending(&self, session: &str, limit: usize) -> Option<(Vec<String>, Vec<String>)> {
        self.fd.as_ref()?;
        let mut guard = lock(&self.inner);
        self.pending_locked(&mut guard, session, limit)
    }

    /// [`Self::pending`] if nothing else holds the tracker (never blocks); `Err` if it is held.
    #[allow(clippy::type_complexity)]
    pub fn try_pending(
        &self,
        session: &str,
        limit: usize,
    ) -> Result<Option<(Vec<String>, Vec<String>)>, ()> {
        if self.fd.is_none() {
            return Ok(None);
        }
        let mut guard = self.inner.try_lock().map_err(|_| ())?;
        Ok(self.pending_locked(&mut guard, session, limit))
    }

    fn pending_locked(
        &self,
        guard: &mut Inner,
        session: &str,
        limit: usize,
    ) -> Option<(Vec<String>, Vec<String>)> {
        self.drain_locked(guard);
        let t = guard.sessions.get(session)?;
        let complete = t.rescan.is_none() && t.untracked.is_none() && !t.wds.is_empty();
        if !complete || t.touched.len() + t.new_dirs.len() > limit {
            return None;
        }
        Some((
            t.touched.iter().cloned().collect(),
            t.new_dirs.iter().cloned().collect(),
        ))
    }

    /// Regular files beneath `root` (the directory of `session`) created or changed at or after
    /// `since`, at most `limit`, leaving out hidden paths. Blocking: run it off the runtime.
    ///
    /// Long on purpose: the tracker's answer and the walk it falls back to share their bounds and
    /// their result; split, each half would need the other's state.
    pub fn changed(&self, session: &str, root: &Path, since: SystemTime, limit: usize) -> Changes {
        let Some(fd) = self.fd.as_ref() else {
            return walk_listing(root, session, since, limit);
        };
        let mut guard = lock(&self.inner);
        self.drain_locked(&mut guard);
        let Inner { dirs, sessions } = &mut *guard;
        let t = sessions
            .entry(session.to_string())
            .or_insert_with(|| Tracked {
                rescan: Some("first listing"),
                ..Tracked::default()
            });
        if t.untracked.is_some() {
            drop(guard);
            return walk_listing(root, session, since, limit);
        }
        let Ok(root_fd) = host_fs::open_session_dir(root) else {
            return Changes {
                files: Vec::new(),
                incomplete: None,
                method: "walk",
            };
        };
        let mut reg = Registrar {
            inotify: fd.as_fd(),
            session,
            since,
            limit,
            files: Vec::new(),
            added: Vec::new(),
            failed: None,
            unlisted: 0,
            watched: t.wds.len(),
            host_watched: dirs.len(),
            host_cap: self.max_watches,
        };
        let method;
        if let Some(why) = t.rescan.take() {
            tracing::debug!(%session, why, "listing changed files by walking the session");
            method = "walk";
            t.touched.clear();
            t.new_dirs.clear();
            let old = std::mem::take(&mut t.wds);
            reg.watched = 0;
            reg.host_watched = dirs.len().saturating_sub(old.len());
            reg.watch_dir(root_fd.as_fd(), "");
            reg.walk(root_fd.as_fd(), "");
            // Watches of directories no longer reachable by a plain path are dropped.
            let kept: HashSet<i32> = reg.added.iter().map(|(wd, _)| *wd).collect();
            for wd in old.difference(&kept) {
                dirs.remove(wd);
                // SAFETY: plain syscall on our own inotify fd.
                unsafe { libc::inotify_rm_watch(fd.as_raw_fd(), *wd) };
            }
        } else {
            method = "events";
            let touched = std::mem::take(&mut t.touched);
            let new_dirs = std::mem::take(&mut t.new_dirs);
            for dir in &new_dirs {
                if hidden(dir) || beneath_any(dir, &new_dirs) {
                    continue; // an ancestor is walked (and watched) whole
                }
                if let Ok(d) = host_fs::open_beneath(
                    root_fd.as_fd(),
                    Path::new(dir),
                    OFlag::O_RDONLY | OFlag::O_DIRECTORY,
                    Mode::empty(),
                ) {
                    reg.watch_dir(d.as_fd(), dir);
                    reg.walk(d.as_fd(), dir);
                }
            }
            for rel in touched {
                if hidden(&rel) || beneath_any(&rel, &new_dirs) {
                    continue;
                }
                reg.consider_path(root_fd.as_fd(), &rel);
            }
        }
        let Registrar {
            files,
            added,
            failed,
            unlisted,
            ..
        } = reg;
        let unlisted_by_events = std::mem::take(&mut t.unlisted_names);
        for (wd, _) in &added {
            t.wds.insert(*wd);
        }
        if let Some(why) = failed {
            t.untracked = Some(why.clone());
            let wds = std::mem::take(&mut t.wds);
            for wd in wds {
                dirs.remove(&wd);
                // SAFETY: plain syscall on our own inotify fd.
                unsafe { libc::inotify_rm_watch(fd.as_raw_fd(), wd) };
            }
            tracing::info!(%session, "no longer watching the session for changes: {why}");
            drop(guard);
            return walk_listing(root, session, since, limit);
        }
        for (wd, dir) in added {
            dirs.insert(wd, (session.to_string(), dir));
        }
        let mut files = files;
        files.sort_by(|a, b| a.path.cmp(&b.path));
        files.dedup_by(|a, b| a.path == b.path);
        files.truncate(limit);
        let incomplete = if unlisted > 0 {
            Some(super::unlisted_names_note(Some(unlisted)))
        } else {
            unlisted_by_events.then(|| super::unlisted_names_note(None))
        };
        Changes {
            files,
            incomplete,
            method,
        }
    }
}

/// Adds watches for the directories of a (sub)tree and collects its changed files.
struct Registrar<'a> {
    inotify: BorrowedFd<'a>,
    session: &'a str,
    since: SystemTime,
    limit: usize,
    files: Vec<FileRef>,
    added: Vec<(i32, String)>,
    failed: Option<String>,
    /// Changed files left out because their names are not UTF-8.
    unlisted: usize,
    watched: usize,
    /// Watches of every session of the server, this one's so far included, and their cap.
    host_watched: usize,
    host_cap: usize,
}

impl Registrar<'_> {
    /// Watches the directory open at `dir` (whose path beneath the session is `rel`). The
    /// watch is added through `/proc/self/fd`, so it lands on exactly the inode the host opened
    /// without following a symlink, whatever the path now names.
    fn watch_dir(&mut self, dir: BorrowedFd<'_>, rel: &str) {
        if self.failed.is_some() {
            return;
        }
        if self.watched >= MAX_WATCHED_DIRS {
            self.failed = Some(format!("it has more than {MAX_WATCHED_DIRS} directories"));
            return;
        }
        if self.host_watched >= self.host_cap {
            self.failed = Some(format!(
                "the server's sessions already hold its {} watches (a quarter of the user's fs.inotify.max_user_watches)",
                self.host_cap
            ));
            return;
        }
        let Ok(path) = CString::new(format!("/proc/self/fd/{}", dir.as_raw_fd())) else {
            return;
        };
        // SAFETY: plain syscall with a valid NUL-terminated path.
        let wd =
            unsafe { libc::inotify_add_watch(self.inotify.as_raw_fd(), path.as_ptr(), WATCH_MASK) };
        if wd < 0 {
            let e = std::io::Error::last_os_error();
            if matches!(e.raw_os_error(), Some(libc::ENOSPC | libc::ENOMEM)) {
                self.failed = Some(format!("the host is out of inotify watches ({e})"));
            }
            return; // e.g. the directory vanished: nothing to watch
        }
        self.watched += 1;
        self.host_watched += 1;
        self.added.push((wd, rel.to_string()));
    }

    /// Walks the tree open at `dir` (path `rel`), watching every non-hidden directory before
    /// it is listed (so nothing created in it is missed) and collecting changed files.
    fn walk(&mut self, dir: BorrowedFd<'_>, rel: &str) {
        let mut v = WalkVisitor {
            reg: self,
            base: rel,
        };
        if let Err(e) = host_fs::walk(dir, &mut v) {
            tracing::debug!(error = %e, "a changed-files walk stopped");
        }
    }

    fn consider(&mut self, rel: String, st: &nix::sys::stat::FileStat) {
        if self.files.len() >= self.limit.saturating_mul(4).max(self.limit) {
            return;
        }
        if host_fs::is_regular(st) && mtime_of(st) >= self.since {
            self.files.push(FileRef {
                uri: session_uri(self.session, &rel),
                mime: mime_for(&rel),
                size: st.st_size.max(0) as u64,
                path: rel,
            });
        }
    }

    fn consider_path(&mut self, root: BorrowedFd<'_>, rel: &str) {
        if rel.len() >= libc::PATH_MAX as usize {
            return;
        }
        let Ok(f) = host_fs::open_beneath(
            root,
            Path::new(rel),
            OFlag::O_PATH | OFlag::O_CLOEXEC,
            Mode::empty(),
        ) else {
            return; // gone, or reached only through a symlink
        };
        if let Ok(st) = nix::sys::stat::fstat(&f) {
            self.consider(rel.to_string(), &st);
        }
    }
}

struct WalkVisitor<'r, 'a> {
    reg: &'r mut Registrar<'a>,
    base: &'r str,
}

impl host_fs::Visitor for WalkVisitor<'_, '_> {
    fn entry(&mut self, e: &host_fs::Entry<'_>) -> host_fs::Step {
        if e.name.to_bytes().starts_with(b".") {
            return host_fs::Step::Skip;
        }
        let Some(rel) = e.relative_path().map(|r| join(self.base, &r)) else {
            if host_fs::is_regular(e.stat) && mtime_of(e.stat) >= self.reg.since {
                self.reg.unlisted += 1;
            }
            return host_fs::Step::Skip;
        };
        if host_fs::is_dir(e.stat) {
            if let Ok(d) = host_fs::open_beneath(
                e.parent,
                Path::new(e.name.to_str().unwrap_or_default()),
                OFlag::O_RDONLY | OFlag::O_DIRECTORY,
                Mode::empty(),
            ) {
                self.reg.watch_dir(d.as_fd(), &rel);
            }
            if self.reg.failed.is_some() {
                return host_fs::Step::Stop;
            }
            return host_fs::Step::Descend;
        }
        if rel.len() < libc::PATH_MAX as usize {
            self.reg.consider(rel, e.stat);
        }
        host_fs::Step::Descend
    }
}

/// The listing by walking (no inotify, or the session is not watched), bounded as before.
fn walk_listing(root: &Path, session: &str, since: SystemTime, limit: usize) -> Changes {
    let (files, incomplete) = super::changed_since(root, session, since, limit);
    Changes {
        files,
        incomplete,
        method: "walk",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Session `name` beneath `base` with `dirs` subdirectories, each holding one file.
    fn session_with_dirs(base: &Path, name: &str, dirs: usize) -> std::path::PathBuf {
        let root = base.join(name);
        for i in 0..dirs {
            std::fs::create_dir_all(root.join(format!("d{i}"))).unwrap();
            std::fs::write(root.join(format!("d{i}/f.txt")), "x").unwrap();
        }
        root
    }

    #[test]
    fn the_servers_watches_stop_at_its_cap_and_a_session_past_it_is_listed_by_walking() {
        let base = std::env::temp_dir().join(format!("ironcell-watch-cap-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        let since = SystemTime::UNIX_EPOCH;
        let tracker = ChangeTracker::with_max_watches(6);
        let a = session_with_dirs(&base, "a", 3); // 4 watches with its root
        let b = session_with_dirs(&base, "b", 3); // would make 8
        let first = tracker.changed("a", &a, since, 100);
        assert_eq!((first.method, first.files.len()), ("walk", 3));
        let listed = tracker.changed("b", &b, since, 100);
        assert_eq!((listed.method, listed.files.len()), ("walk", 3));
        assert_eq!(
            lock(&tracker.inner).dirs.len(),
            4,
            "b's watches were given back"
        );
        std::fs::write(b.join("d0/new.txt"), "y").unwrap();
        let again = tracker.changed("b", &b, since, 100);
        assert_eq!((again.method, again.files.len()), ("walk", 4));
        // a stays watched: its next listing reads events.
        std::fs::write(a.join("d1/new.txt"), "y").unwrap();
        let events = tracker.changed(
            "a",
            &a,
            SystemTime::now() - std::time::Duration::from_secs(5),
            100,
        );
        assert_eq!(events.method, "events");
        assert!(events.files.iter().any(|f| f.uri.ends_with("d1/new.txt")));
        std::fs::remove_dir_all(&base).unwrap();
    }

    #[test]
    fn a_path_is_beneath_a_new_directory_only_through_whole_names() {
        let dirs: HashSet<String> = ["a", "x/y"].map(String::from).into();
        assert!(beneath_any("a/f", &dirs));
        assert!(beneath_any("a/b/c/f", &dirs));
        assert!(beneath_any("x/y/f", &dirs));
        assert!(
            !beneath_any("a", &dirs),
            "a directory is not beneath itself"
        );
        assert!(!beneath_any("ab/f", &dirs));
        assert!(!beneath_any("x/f", &dirs));
        assert!(!beneath_any("x/yz/f", &dirs));
        assert!(!beneath_any("f", &dirs));
    }
}
