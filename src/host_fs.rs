//! File operations the host performs in directories the worker can write.
//!
//! A session directory belongs to the sandboxed code: anything in it — a symlink where the host
//! will create a file, a directory swapped for a symlink between two calls, a tree deeper than
//! `PATH_MAX`, a directory with mode 000, a FIFO or a file carrying a lease — is hostile input.
//! So the host never hands a path string under a session directory to the kernel. It opens the
//! session directory itself (its parent, `sessions-<pid>`, is the host's own and the worker
//! cannot write it), and every step below is relative to a directory fd it holds:
//!
//! - one-shot opens use `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS)`;
//!   kernels before 5.6 (no `openat2`) get the same guarantee one component at a time with
//!   `O_NOFOLLOW | O_DIRECTORY`;
//! - files the host writes are created with `O_CREAT | O_EXCL | O_NOFOLLOW`, so the host never
//!   opens a file the worker made (nor one of its symlinks) for writing, and no lease can sit
//!   on a file before the host holds it open for writing (which then rules out read leases);
//! - files the host reads are opened `O_NONBLOCK` (a worker's lease or FIFO cannot stall the
//!   open) and refused unless they are regular files;
//! - walks ([`walk`]) descend with `openat(O_DIRECTORY | O_NOFOLLOW)` from the parent's fd and
//!   read each directory through its own fd, so no path is ever re-resolved, and they keep at
//!   most [`MAX_OPEN_DIRS`] directories open: deeper trees are walked by returning through
//!   `..` of the child's fd, checked against the device and inode recorded on the way down.
//!
//! Everything here blocks; async callers run it on `spawn_blocking`.

use std::ffi::{CStr, CString, OsStr};
use std::fs::File;
use std::io::{self, Read};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path};
use std::sync::atomic::{AtomicBool, Ordering};

use nix::dir::Dir;
use nix::errno::Errno;
use nix::fcntl::{AtFlags, OFlag, OpenHow, ResolveFlag};
use nix::sys::stat::{FileStat, Mode, SFlag};
use nix::unistd::UnlinkatFlags;

/// Directories a walk keeps open at once; deeper levels are reopened through `..`.
pub const MAX_OPEN_DIRS: usize = 64;

/// Set once `openat2` answered ENOSYS: this kernel is older than 5.6.
static NO_OPENAT2: AtomicBool = AtomicBool::new(false);

fn io_err(e: Errno) -> io::Error {
    io::Error::from_raw_os_error(e as i32)
}

fn cstring(name: &OsStr) -> io::Result<CString> {
    CString::new(name.as_bytes()).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))
}

/// Opens a session directory the host created: its parent by path (the host's own directory,
/// which the worker cannot write), the directory itself with `O_NOFOLLOW | O_DIRECTORY`.
pub fn open_session_dir(path: &Path) -> io::Result<OwnedFd> {
    let (parent, name) = split_parent(path)?;
    let parent = nix::fcntl::open(
        parent,
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .map_err(io_err)?;
    open_subdir(parent.as_fd(), &cstring(name)?)
}

fn split_parent(path: &Path) -> io::Result<(&Path, &OsStr)> {
    match (path.parent(), path.file_name()) {
        (Some(p), Some(n)) => Ok((
            if p.as_os_str().is_empty() {
                Path::new(".")
            } else {
                p
            },
            n,
        )),
        _ => Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{} has no parent directory", path.display()),
        )),
    }
}

/// Opens `name`, a directory entry of `parent`, as a directory without following a symlink.
fn open_subdir(parent: BorrowedFd<'_>, name: &CStr) -> io::Result<OwnedFd> {
    nix::fcntl::openat(
        parent,
        name,
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .map_err(io_err)
}

/// The components of a relative path, refusing anything but plain names.
fn plain_components(rel: &Path) -> io::Result<Vec<CString>> {
    let mut out = Vec::new();
    for c in rel.components() {
        match c {
            Component::Normal(n) => out.push(cstring(n)?),
            _ => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("{} is not a plain relative path", rel.display()),
                ));
            }
        }
    }
    if out.is_empty() {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "empty path"));
    }
    Ok(out)
}

/// Opens `rel` beneath `dir` with `flags`, following no symlink at any step and never leaving
/// `dir`: `openat2` where the kernel has it, one `O_NOFOLLOW` component at a time otherwise.
/// A symlink anywhere on the way fails with `ELOOP` (or `ENOTDIR` for a parent component).
pub fn open_beneath(
    dir: BorrowedFd<'_>,
    rel: &Path,
    flags: OFlag,
    mode: Mode,
) -> io::Result<OwnedFd> {
    let parts = plain_components(rel)?;
    if !NO_OPENAT2.load(Ordering::Relaxed) {
        let how = OpenHow::new()
            .flags(flags | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC)
            .mode(mode)
            .resolve(
                ResolveFlag::RESOLVE_BENEATH
                    | ResolveFlag::RESOLVE_NO_SYMLINKS
                    | ResolveFlag::RESOLVE_NO_MAGICLINKS,
            );
        match nix::fcntl::openat2(dir, rel, how) {
            Err(Errno::ENOSYS) => {
                tracing::info!(
                    "openat2 is unavailable (kernel < 5.6): opening one component at a time"
                );
                NO_OPENAT2.store(true, Ordering::Relaxed);
            }
            other => return other.map_err(io_err),
        }
    }
    open_beneath_per_component(dir, &parts, flags, mode)
}

/// [`open_beneath`] for kernels without `openat2`.
fn open_beneath_per_component(
    dir: BorrowedFd<'_>,
    parts: &[CString],
    flags: OFlag,
    mode: Mode,
) -> io::Result<OwnedFd> {
    let Some((last, parents)) = parts.split_last() else {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "empty path"));
    };
    let mut held: Option<OwnedFd> = None;
    for p in parents {
        let at = held.as_ref().map(|f| f.as_fd()).unwrap_or(dir);
        held = Some(open_subdir(at, p)?);
    }
    let at = held.as_ref().map(|f| f.as_fd()).unwrap_or(dir);
    nix::fcntl::openat(
        at,
        last.as_c_str(),
        flags | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        mode,
    )
    .map_err(io_err)
}

/// Creates `subdir/name` beneath `dir` for writing (mode 0600), creating `subdir` (mode 0700) if
/// it is missing. Refuses to open anything that already exists, symlinks included, so whatever
/// the worker planted there, the host writes only to a file it created itself.
pub fn create_new_file(dir: BorrowedFd<'_>, subdir: &str, name: &str) -> io::Result<File> {
    let sub = cstring(OsStr::new(subdir))?;
    match nix::sys::stat::mkdirat(dir, sub.as_c_str(), Mode::from_bits_truncate(0o700)) {
        Ok(()) | Err(Errno::EEXIST) => {}
        Err(e) => return Err(io_err(e)),
    }
    let sub = open_beneath(
        dir,
        Path::new(subdir),
        OFlag::O_RDONLY | OFlag::O_DIRECTORY,
        Mode::empty(),
    )?;
    let fd = nix::fcntl::openat(
        sub.as_fd(),
        cstring(OsStr::new(name))?.as_c_str(),
        OFlag::O_WRONLY
            | OFlag::O_CREAT
            | OFlag::O_EXCL
            | OFlag::O_NOFOLLOW
            | OFlag::O_NONBLOCK
            | OFlag::O_NOCTTY
            | OFlag::O_CLOEXEC,
        Mode::from_bits_truncate(0o600),
    )
    .map_err(io_err)?;
    Ok(File::from(fd))
}

/// Why a file could not be served.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    #[error("cannot open it: {0}")]
    Open(io::Error),
    #[error("it is not a regular file")]
    NotRegular,
    #[error("it is {size} bytes; at most {max} bytes are served")]
    TooLarge { size: u64, max: u64 },
    #[error("reading it failed: {0}")]
    Read(io::Error),
}

/// Writes `dir/name` (a directory of the host's own: the state dir, never a session's) through a
/// fresh private temporary file (0600, `O_NOFOLLOW`, created new) that is synced and renamed
/// over it, so a reader never sees half a file and a planted symlink is never followed.
pub fn replace_file_privately(dir: &Path, name: &str, bytes: &[u8]) -> io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let tmp = dir.join(format!(".{name}.{}.tmp", std::process::id()));
    let _ = std::fs::remove_file(&tmp);
    let written = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&tmp)
        .and_then(|mut f| f.write_all(bytes).and_then(|()| f.sync_all()));
    written
        .and_then(|()| std::fs::rename(&tmp, dir.join(name)))
        .inspect_err(|_| {
            let _ = std::fs::remove_file(&tmp);
        })
}

/// Reads the regular file `rel` beneath `dir`, at most `max` bytes, without following a symlink
/// and without waiting on a lease or a FIFO.
pub fn read_regular_file(dir: BorrowedFd<'_>, rel: &Path, max: u64) -> Result<Vec<u8>, ReadError> {
    let fd = open_beneath(
        dir,
        rel,
        OFlag::O_RDONLY | OFlag::O_NONBLOCK | OFlag::O_NOCTTY,
        Mode::empty(),
    )
    .map_err(ReadError::Open)?;
    let st = nix::sys::stat::fstat(&fd).map_err(|e| ReadError::Open(io_err(e)))?;
    if SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT != SFlag::S_IFREG {
        return Err(ReadError::NotRegular);
    }
    let size = st.st_size as u64;
    if size > max {
        return Err(ReadError::TooLarge { size, max });
    }
    let mut buf = Vec::with_capacity(size as usize);
    // The file may grow after fstat: never read more than the cap.
    File::from(fd)
        .take(max)
        .read_to_end(&mut buf)
        .map_err(ReadError::Read)?;
    Ok(buf)
}

fn file_type(st: &FileStat) -> SFlag {
    SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT
}

pub fn is_dir(st: &FileStat) -> bool {
    file_type(st) == SFlag::S_IFDIR
}

pub fn is_regular(st: &FileStat) -> bool {
    file_type(st) == SFlag::S_IFREG
}

/// What a walk does with an entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Go on; for a directory, walk into it.
    Descend,
    /// Go on, but do not walk into this directory.
    Skip,
    /// End the walk now.
    Stop,
}

/// One entry met by a walk.
pub struct Entry<'a> {
    /// The directory holding the entry.
    pub parent: BorrowedFd<'a>,
    pub name: &'a CStr,
    /// `lstat` of the entry (a symlink is reported as a symlink, never followed).
    pub stat: &'a FileStat,
    /// Names of the directories from the walk's root down to `parent`.
    pub ancestors: &'a [CString],
}

impl Entry<'_> {
    /// The entry's path relative to the walk's root, or `None` if it is not UTF-8.
    pub fn relative_path(&self) -> Option<String> {
        let mut s = String::new();
        for n in self
            .ancestors
            .iter()
            .map(|c| c.as_c_str())
            .chain([self.name])
        {
            if !s.is_empty() {
                s.push('/');
            }
            s.push_str(n.to_str().ok()?);
        }
        Some(s)
    }

    /// Total bytes of the relative path (without building it).
    pub fn relative_path_len(&self) -> usize {
        self.ancestors
            .iter()
            .map(|c| c.as_bytes().len() + 1)
            .sum::<usize>()
            + self.name.to_bytes().len()
    }
}

/// What a walk calls back. Errors in directories it cannot open or read go to
/// [`Visitor::unreadable`]; the walk itself only fails when the tree changed under it in a way
/// it cannot follow safely.
pub trait Visitor {
    /// Called for each entry of a directory after the directory was read whole.
    fn entry(&mut self, entry: &Entry<'_>) -> Step;

    /// Called after every entry beneath the directory `name` (in `parent`) was visited.
    fn leave_dir(&mut self, _parent: BorrowedFd<'_>, _name: &CStr, _ancestors: &[CString]) -> Step {
        Step::Descend
    }

    /// A directory that cannot be opened or listed. `fix` is true when the walk may try again
    /// after [`Visitor::fix_permissions`] said it fixed something.
    fn unreadable(&mut self, _path: String, _error: io::Error) -> Step {
        Step::Descend
    }

    /// Whether to give directories the host owns back `u+rwx` when they cannot be opened
    /// (cleanup does; measuring does not touch the worker's files).
    fn fix_permissions(&self) -> bool {
        false
    }
}

/// Why a walk ended early.
#[derive(Debug, thiserror::Error)]
pub enum WalkError {
    #[error("cannot open the directory to walk: {0}")]
    Root(io::Error),
    #[error("the tree changed while it was walked (a directory was moved)")]
    Changed,
}

struct Frame {
    fd: Option<OwnedFd>,
    id: (u64, u64),
    name: CString,
    subdirs: Vec<CString>,
}

fn dev_ino(st: &FileStat) -> (u64, u64) {
    (st.st_dev, st.st_ino)
}

fn path_of(ancestors: &[CString], name: &CStr) -> String {
    let mut parts: Vec<String> = ancestors
        .iter()
        .map(|c| c.to_string_lossy().into_owned())
        .collect();
    parts.push(name.to_string_lossy().into_owned());
    parts.join("/")
}

/// Gives the directory `name` in `parent` (which must really be a directory, not a symlink)
/// mode `u+rwx`, and opens it.
fn open_subdir_fixing_permissions(parent: BorrowedFd<'_>, name: &CStr) -> io::Result<OwnedFd> {
    match open_subdir(parent, name) {
        Err(e) if e.raw_os_error() == Some(libc::EACCES) => {}
        other => return other,
    }
    // O_PATH needs no permission on the directory itself, and O_DIRECTORY|O_NOFOLLOW makes
    // sure it is a directory: the chmod below goes to exactly this inode.
    let pinned = nix::fcntl::openat(
        parent,
        name,
        OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .map_err(io_err)?;
    chmod_pinned(&pinned)?;
    open_subdir(pinned.as_fd(), c".")
}

/// `chmod u+rwx` of the directory behind an `O_PATH` fd (`fchmod` refuses `O_PATH` fds; the
/// `/proc/self/fd` link names exactly the pinned inode).
fn chmod_pinned(pinned: &OwnedFd) -> io::Result<()> {
    let st = nix::sys::stat::fstat(pinned).map_err(io_err)?;
    let mode = Mode::from_bits_truncate((st.st_mode & 0o7777) | 0o700);
    let link = format!("/proc/self/fd/{}", pinned.as_raw_fd());
    nix::sys::stat::fchmodat(
        nix::fcntl::AT_FDCWD,
        link.as_str(),
        mode,
        nix::sys::stat::FchmodatFlags::FollowSymlink,
    )
    .map_err(io_err)
}

/// `fchmod u+rwx` of an open directory, if it lacks any of those bits.
fn ensure_owner_rwx(fd: BorrowedFd<'_>, st: &FileStat) -> io::Result<()> {
    if st.st_mode & 0o700 == 0o700 {
        return Ok(());
    }
    nix::sys::stat::fchmod(fd, Mode::from_bits_truncate((st.st_mode & 0o7777) | 0o700))
        .map_err(io_err)
}

/// A listing of `dir` on an open file description of its own, so reading it leaves `dir`'s
/// offset alone. Read as it goes (`getdents` fills a small buffer at a time): a directory of a
/// million names is never held whole in the host's memory (SECURITY.md #141).
fn open_listing(dir: BorrowedFd<'_>) -> io::Result<Dir> {
    Dir::openat(
        dir,
        c".",
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .map_err(io_err)
}

/// Whether `dir` has no entries (an unreadable one counts as not empty).
fn is_empty_dir(dir: BorrowedFd<'_>) -> bool {
    let Ok(mut listing) = open_listing(dir) else {
        return false;
    };
    listing.iter().all(|e| {
        e.is_ok_and(|e| {
            let name = e.file_name();
            name == c"." || name == c".."
        })
    })
}

/// Walks the tree beneath `root` depth-first, calling `v` for every entry, without following a
/// symlink, without re-resolving a path, and with at most [`MAX_OPEN_DIRS`] directories open
/// whatever the depth.
///
/// Long on purpose: the descent's stack of open directories is one piece of state, bounded in
/// one place ([`MAX_OPEN_DIRS`]), which a split would pass around.
pub fn walk(root: BorrowedFd<'_>, v: &mut impl Visitor) -> Result<(), WalkError> {
    let root = root.try_clone_to_owned().map_err(WalkError::Root)?;
    let st = nix::sys::stat::fstat(&root).map_err(|e| WalkError::Root(io_err(e)))?;
    if v.fix_permissions() {
        let _ = ensure_owner_rwx(root.as_fd(), &st);
    }
    let mut stack = vec![Frame {
        fd: Some(root),
        id: dev_ino(&st),
        name: CString::default(),
        subdirs: Vec::new(),
    }];
    let mut names: Vec<CString> = Vec::new(); // names of stack[1..], for paths
    let mut lowest_open = 1; // index of the shallowest open frame below the root
    if visit_frame(&mut stack, &names, v) == Step::Stop {
        return Ok(());
    }
    loop {
        let depth = stack.len();
        let Some(top) = stack.last_mut() else {
            return Ok(());
        };
        if let Some(name) = top.subdirs.pop() {
            let Some(parent) = top.fd.as_ref() else {
                return Err(WalkError::Changed);
            };
            let opened = if v.fix_permissions() {
                open_subdir_fixing_permissions(parent.as_fd(), &name)
            } else {
                open_subdir(parent.as_fd(), &name)
            };
            let fd = match opened {
                Ok(fd) => fd,
                // Gone, or no longer a directory (swapped for a file or a symlink since it
                // was listed): nothing to walk into here.
                Err(e)
                    if matches!(
                        e.raw_os_error(),
                        Some(libc::ENOENT | libc::ENOTDIR | libc::ELOOP)
                    ) =>
                {
                    continue;
                }
                Err(e) => {
                    if v.unreadable(path_of(&names, &name), e) == Step::Stop {
                        return Ok(());
                    }
                    continue;
                }
            };
            let st = match nix::sys::stat::fstat(&fd) {
                Ok(st) => st,
                Err(e) => {
                    if v.unreadable(path_of(&names, &name), io_err(e)) == Step::Stop {
                        return Ok(());
                    }
                    continue;
                }
            };
            if v.fix_permissions() {
                let _ = ensure_owner_rwx(fd.as_fd(), &st);
            }
            // Keep at most MAX_OPEN_DIRS open: close the shallowest one still open (not the
            // root, which is needed to finish); it is reopened through `..` on the way back.
            // Open frames are always the root plus a contiguous run ending at the top.
            if depth - lowest_open >= MAX_OPEN_DIRS {
                if let Some(f) = stack.get_mut(lowest_open) {
                    f.fd = None;
                }
                lowest_open += 1;
            }
            names.push(name.clone());
            stack.push(Frame {
                fd: Some(fd),
                id: dev_ino(&st),
                name,
                subdirs: Vec::new(),
            });
            if visit_frame(&mut stack, &names, v) == Step::Stop {
                return Ok(());
            }
        } else {
            if depth == 1 {
                return Ok(());
            }
            let Some(child) = stack.pop() else {
                return Ok(());
            };
            names.pop();
            let Some(parent) = stack.last_mut() else {
                return Ok(());
            };
            if parent.fd.is_none() {
                let Some(child_fd) = child.fd.as_ref() else {
                    return Err(WalkError::Changed);
                };
                let up = open_subdir(child_fd.as_fd(), c"..").map_err(|_| WalkError::Changed)?;
                let st = nix::sys::stat::fstat(&up).map_err(|_| WalkError::Changed)?;
                if dev_ino(&st) != parent.id {
                    return Err(WalkError::Changed);
                }
                parent.fd = Some(up);
                lowest_open = depth - 2;
            }
            drop(child.fd);
            let Some(parent_fd) = parent.fd.as_ref() else {
                return Err(WalkError::Changed);
            };
            if v.leave_dir(parent_fd.as_fd(), &child.name, &names) == Step::Stop {
                return Ok(());
            }
        }
    }
}

/// Lists the top frame's directory, reports each entry, and queues the subdirectories to enter.
fn visit_frame(stack: &mut [Frame], names: &[CString], v: &mut impl Visitor) -> Step {
    let Some(top) = stack.last_mut() else {
        return Step::Stop;
    };
    let Some(fd) = top.fd.as_ref() else {
        return Step::Stop;
    };
    let here = |top: &Frame| {
        if names.is_empty() {
            ".".to_string()
        } else {
            path_of(&names[..names.len() - 1], &top.name)
        }
    };
    let mut listing = match open_listing(fd.as_fd()) {
        Ok(l) => l,
        Err(e) => return v.unreadable(here(top), e),
    };
    // Each entry is visited as it is read: a visitor's stop (a quota or listing cap) ends the
    // reading too, and only the subdirectories' names are kept.
    for entry in listing.iter() {
        let entry = match entry {
            Ok(e) => e,
            Err(e) => return v.unreadable(here(top), io_err(e)),
        };
        let name = entry.file_name();
        if name == c"." || name == c".." {
            continue;
        }
        let st = match nix::sys::stat::fstatat(fd, name, AtFlags::AT_SYMLINK_NOFOLLOW) {
            Ok(st) => st,
            Err(Errno::ENOENT) => continue, // removed since it was listed
            Err(e) => return v.unreadable(here(top), io_err(e)),
        };
        let step = v.entry(&Entry {
            parent: fd.as_fd(),
            name,
            stat: &st,
            ancestors: names,
        });
        match step {
            Step::Stop => return Step::Stop,
            Step::Descend if is_dir(&st) => top.subdirs.push(name.to_owned()),
            _ => {}
        }
    }
    // Popped from the end: reverse so directories are entered in listing order.
    top.subdirs.reverse();
    Step::Descend
}

/// What a removal could not remove.
#[derive(Debug, Default)]
pub struct Removal {
    pub removed: u64,
    /// Paths (relative to the removed directory) and why they are still there.
    pub failures: Vec<String>,
}

impl Removal {
    pub fn is_complete(&self) -> bool {
        self.failures.is_empty()
    }

    /// A sentence for a notice or a log line, naming up to a few failures.
    pub fn summary(&self) -> String {
        let shown: Vec<&str> = self.failures.iter().take(3).map(String::as_str).collect();
        let more = self.failures.len().saturating_sub(shown.len());
        let more = if more > 0 {
            format!(" and {more} more")
        } else {
            String::new()
        };
        format!(
            "{} could not be removed: {}{more}",
            if self.failures.len() == 1 {
                "1 entry"
            } else {
                "some entries"
            },
            shown.join("; ")
        )
    }
}

struct Remover {
    report: Removal,
}

impl Visitor for Remover {
    fn entry(&mut self, e: &Entry<'_>) -> Step {
        if is_dir(e.stat) {
            return Step::Descend;
        }
        match nix::unistd::unlinkat(e.parent, e.name, UnlinkatFlags::NoRemoveDir) {
            Ok(()) | Err(Errno::ENOENT) => self.report.removed += 1,
            Err(err) => self.failures_push(path_of(e.ancestors, e.name), err),
        }
        Step::Descend
    }

    fn leave_dir(&mut self, parent: BorrowedFd<'_>, name: &CStr, ancestors: &[CString]) -> Step {
        match nix::unistd::unlinkat(parent, name, UnlinkatFlags::RemoveDir) {
            Ok(()) | Err(Errno::ENOENT) => self.report.removed += 1,
            Err(err) => self.failures_push(path_of(ancestors, name), err),
        }
        Step::Descend
    }

    fn unreadable(&mut self, path: String, error: io::Error) -> Step {
        self.report.failures.push(format!("{path}: {error}"));
        Step::Descend
    }

    fn fix_permissions(&self) -> bool {
        true
    }
}

impl Remover {
    fn failures_push(&mut self, path: String, err: Errno) {
        // A directory whose contents could not go fails with ENOTEMPTY: its contents are
        // already named, so only the first cause is kept.
        if err != Errno::ENOTEMPTY || self.report.failures.is_empty() {
            self.report
                .failures
                .push(format!("{path}: {}", io_err(err)));
        }
    }
}

/// Removes everything beneath the directory `dir` (not `dir` itself), fixing the permissions of
/// directories on the way, and says what could not be removed.
pub fn remove_contents(dir: BorrowedFd<'_>) -> Removal {
    let mut r = Remover {
        report: Removal::default(),
    };
    // One more pass picks up what a still-running writer added during the first.
    for _ in 0..2 {
        r.report.failures.clear();
        match walk(dir, &mut r) {
            Ok(()) => {}
            Err(e) => r.report.failures.push(e.to_string()),
        }
        if r.report.is_complete() && is_empty_dir(dir) {
            break;
        }
    }
    if r.report.is_complete() && !is_empty_dir(dir) {
        r.report
            .failures
            .push("entries kept appearing while they were removed".into());
    }
    r.report
}

/// Removes the directory `path` and everything beneath it. `path`'s parent must be a directory
/// the worker cannot write (the state dir, `sessions-<pid>`); everything below is fd-relative.
/// A missing directory is a complete removal.
pub fn remove_tree(path: &Path) -> Removal {
    let mut report = Removal::default();
    let (parent_path, name) = match split_parent(path) {
        Ok(x) => x,
        Err(e) => {
            report.failures.push(e.to_string());
            return report;
        }
    };
    let parent = match nix::fcntl::open(
        parent_path,
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
        Mode::empty(),
    ) {
        Ok(fd) => fd,
        Err(Errno::ENOENT) => return report,
        Err(e) => {
            report
                .failures
                .push(format!("{}: {}", parent_path.display(), io_err(e)));
            return report;
        }
    };
    let Ok(name) = cstring(name) else {
        report
            .failures
            .push(format!("{}: invalid name", path.display()));
        return report;
    };
    let dir = match open_subdir_fixing_permissions(parent.as_fd(), &name) {
        Ok(fd) => fd,
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => return report,
        Err(e) => {
            report.failures.push(format!("{}: {e}", path.display()));
            return report;
        }
    };
    report = remove_contents(dir.as_fd());
    drop(dir);
    match nix::unistd::unlinkat(parent.as_fd(), name.as_c_str(), UnlinkatFlags::RemoveDir) {
        Ok(()) | Err(Errno::ENOENT) => {}
        Err(e) if report.is_complete() => {
            report
                .failures
                .push(format!("{}: {}", path.display(), io_err(e)))
        }
        Err(_) => {}
    }
    report
}

/// How a measurement ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Usage {
    /// Bytes used (every entry counts its allocated blocks plus one 4 KiB block for the inode),
    /// and entries counted.
    Measured { bytes: u64, entries: u64 },
    /// The walk stopped once it had counted past the limit it was given.
    Over { bytes: u64, entries: u64 },
    /// A directory could not be listed, so the usage is not known.
    Unmeasurable(String),
}

struct Sizer {
    bytes: u64,
    entries: u64,
    stop_at: u64,
    unreadable: Option<String>,
    /// Count a regular file at its length where that is more than its blocks ([`copy_size`]).
    by_length: bool,
}

/// Each inode counts at least this much, so empty files and directories use up the quota too.
pub const BYTES_PER_INODE: u64 = 4096;

impl Visitor for Sizer {
    fn entry(&mut self, e: &Entry<'_>) -> Step {
        self.entries += 1;
        let mut held = (e.stat.st_blocks as u64).saturating_mul(512);
        if self.by_length && e.stat.st_mode & libc::S_IFMT == libc::S_IFREG {
            held = held.max(e.stat.st_size as u64);
        }
        self.bytes = self
            .bytes
            .saturating_add(held)
            .saturating_add(BYTES_PER_INODE);
        if self.bytes > self.stop_at {
            Step::Stop
        } else {
            Step::Descend
        }
    }

    fn unreadable(&mut self, path: String, error: io::Error) -> Step {
        self.unreadable = Some(format!("{path}: {error}"));
        Step::Stop
    }
}

/// Measures the tree beneath `dir`, stopping once past `stop_at` bytes.
pub fn usage(dir: BorrowedFd<'_>, stop_at: u64) -> Usage {
    measure(dir, stop_at, false)
}

/// What a copy of the tree beneath `dir` takes: [`usage`], each regular file counted at least
/// at its length, since a copy writes a sparse file's holes as zeros (SECURITY.md #295).
pub fn copy_size(dir: BorrowedFd<'_>, stop_at: u64) -> Usage {
    measure(dir, stop_at, true)
}

fn measure(dir: BorrowedFd<'_>, stop_at: u64, by_length: bool) -> Usage {
    let mut s = Sizer {
        bytes: 0,
        entries: 0,
        stop_at,
        unreadable: None,
        by_length,
    };
    if let Err(e) = walk(dir, &mut s) {
        return Usage::Unmeasurable(e.to_string());
    }
    match s.unreadable {
        Some(why) => Usage::Unmeasurable(why),
        None if s.bytes > stop_at => Usage::Over {
            bytes: s.bytes,
            entries: s.entries,
        },
        None => Usage::Measured {
            bytes: s.bytes,
            entries: s.entries,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;
    use std::path::PathBuf;

    fn scratch(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("ironcell-hostfs-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(d.join("a/b")).unwrap();
        d
    }

    fn both_ways(f: impl Fn()) {
        f();
        NO_OPENAT2.store(true, Ordering::Relaxed);
        f();
        NO_OPENAT2.store(false, Ordering::Relaxed);
    }

    #[test]
    fn a_symlink_at_any_step_is_refused() {
        let d = scratch("steps");
        let outside = scratch("steps-outside");
        std::fs::write(outside.join("secret"), "s").unwrap();
        std::fs::create_dir(outside.join("b")).unwrap();
        std::fs::write(outside.join("b/secret"), "s").unwrap();
        std::fs::write(d.join("a/b/ok"), "fine").unwrap();
        symlink(&outside, d.join("first")).unwrap(); // first component
        symlink(outside.join("b"), d.join("a/middle")).unwrap(); // middle component
        symlink(outside.join("secret"), d.join("a/b/last")).unwrap(); // last component
        symlink("ok", d.join("a/b/relative")).unwrap(); // even one that stays inside
        let root = open_session_dir(&d).unwrap();
        both_ways(|| {
            assert_eq!(
                read_regular_file(root.as_fd(), Path::new("a/b/ok"), 100).unwrap(),
                b"fine"
            );
            for bad in [
                "first/secret",
                "a/middle/secret",
                "a/b/last",
                "a/b/relative",
                "../x",
                "a/../../x",
                "/etc/passwd",
            ] {
                assert!(
                    read_regular_file(root.as_fd(), Path::new(bad), 100).is_err(),
                    "{bad} was followed"
                );
            }
        });
        let _ = std::fs::remove_dir_all(&d);
        let _ = std::fs::remove_dir_all(&outside);
    }

    #[test]
    fn creating_never_opens_what_is_already_there() {
        let d = scratch("create");
        let outside = scratch("create-outside");
        let victim = outside.join("victim");
        std::fs::write(&victim, "unchanged").unwrap();
        std::fs::create_dir(d.join(".ironcell")).unwrap();
        symlink(&victim, d.join(".ironcell/run-1-stdout.txt")).unwrap();
        std::fs::write(d.join(".ironcell/run-2-stdout.txt"), "worker's").unwrap();
        let root = open_session_dir(&d).unwrap();
        both_ways(|| {
            assert!(create_new_file(root.as_fd(), ".ironcell", "run-1-stdout.txt").is_err());
            assert!(create_new_file(root.as_fd(), ".ironcell", "run-2-stdout.txt").is_err());
        });
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "unchanged");
        // The directory itself swapped for a symlink to a host directory.
        std::fs::rename(d.join(".ironcell"), d.join("old")).unwrap();
        symlink(&outside, d.join(".ironcell")).unwrap();
        both_ways(|| {
            assert!(create_new_file(root.as_fd(), ".ironcell", "run-3-stdout.txt").is_err());
        });
        assert!(!outside.join("run-3-stdout.txt").exists());
        std::fs::remove_file(d.join(".ironcell")).unwrap();
        use std::io::Write;
        let mut f = create_new_file(root.as_fd(), ".ironcell", "run-3-stdout.txt").unwrap();
        f.write_all(b"spilled").unwrap();
        assert_eq!(
            std::fs::read(d.join(".ironcell/run-3-stdout.txt")).unwrap(),
            b"spilled"
        );
        let _ = std::fs::remove_dir_all(&d);
        let _ = std::fs::remove_dir_all(&outside);
    }

    #[test]
    fn fifos_are_refused_without_blocking() {
        let d = scratch("fifo");
        nix::unistd::mkfifo(&d.join("pipe"), Mode::from_bits_truncate(0o600)).unwrap();
        let root = open_session_dir(&d).unwrap();
        assert!(matches!(
            read_regular_file(root.as_fd(), Path::new("pipe"), 100),
            Err(ReadError::NotRegular)
        ));
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn walks_do_not_follow_symlinks_and_count_directories() {
        let d = scratch("walk");
        symlink("/", d.join("a/root")).unwrap();
        symlink("/etc", d.join("etc")).unwrap();
        for i in 0..10 {
            std::fs::create_dir(d.join(format!("a/b/d{i}"))).unwrap();
        }
        let root = open_session_dir(&d).unwrap();
        match usage(root.as_fd(), u64::MAX) {
            // a, a/b, 2 symlinks, 10 directories
            Usage::Measured { entries, bytes } => {
                assert_eq!(entries, 14);
                assert!(bytes >= 14 * BYTES_PER_INODE);
            }
            other => panic!("{other:?}"),
        }
        let r = remove_contents(root.as_fd());
        assert!(r.is_complete(), "{:?}", r.failures);
        assert_eq!(std::fs::read_dir(&d).unwrap().count(), 0);
        assert!(Path::new("/etc/passwd").exists());
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn trees_deeper_than_path_max_and_the_open_dir_budget_are_walked_and_removed() {
        let d = scratch("deep");
        let long = "x".repeat(200);
        let levels = 3 * MAX_OPEN_DIRS; // 192 levels of 201 bytes: ~38 KiB of path
        let mut fd = open_session_dir(&d).unwrap();
        for i in 0..levels {
            let name = CString::new(format!("{long}{i}")).unwrap();
            nix::sys::stat::mkdirat(fd.as_fd(), name.as_c_str(), Mode::from_bits_truncate(0o700))
                .unwrap();
            let f = nix::fcntl::openat(
                fd.as_fd(),
                name.as_c_str(),
                OFlag::O_RDONLY | OFlag::O_DIRECTORY,
                Mode::empty(),
            )
            .unwrap();
            if i % 50 == 0 {
                let file = nix::fcntl::openat(
                    f.as_fd(),
                    c"f",
                    OFlag::O_WRONLY | OFlag::O_CREAT,
                    Mode::from_bits_truncate(0o600),
                )
                .unwrap();
                nix::unistd::write(&file, b"data").unwrap();
            }
            fd = f;
        }
        // The deepest directory: no permissions at all.
        nix::sys::stat::fchmod(fd.as_fd(), Mode::empty()).unwrap();
        drop(fd);
        let root = open_session_dir(&d).unwrap();
        let am_root = nix::unistd::geteuid().is_root();
        match usage(root.as_fd(), u64::MAX) {
            Usage::Measured { entries, .. } => {
                assert!(am_root, "a mode-000 directory was measured without root");
                assert_eq!(entries, levels as u64 + 4 + 2); // + 4 files + a, a/b
            }
            Usage::Unmeasurable(why) => assert!(!am_root, "{why}"),
            other => panic!("{other:?}"),
        }
        let r = remove_contents(root.as_fd());
        assert!(r.is_complete(), "{:?}", r.failures);
        assert_eq!(std::fs::read_dir(&d).unwrap().count(), 0);
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn a_missing_tree_is_removed_and_a_present_one_goes_whole() {
        let d = scratch("tree");
        std::fs::write(d.join("a/b/f"), "x").unwrap();
        assert!(remove_tree(&d).is_complete());
        assert!(!d.exists());
        assert!(remove_tree(&d).is_complete());
    }
}

#[cfg(test)]
mod timing {
    /// `IRONCELL_TIME_DIR=/some/tree cargo test --release -- --ignored time_a_walk --nocapture`
    #[test]
    #[ignore]
    fn time_a_walk() {
        use std::os::fd::AsFd;
        let Some(dir) = std::env::var_os("IRONCELL_TIME_DIR") else {
            return;
        };
        let fd = super::open_session_dir(std::path::Path::new(&dir)).unwrap();
        let t = std::time::Instant::now();
        let u = super::usage(fd.as_fd(), u64::MAX);
        eprintln!("{u:?} in {:?}", t.elapsed());
    }
}
