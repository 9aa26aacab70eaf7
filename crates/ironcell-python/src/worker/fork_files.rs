//! A fork's copy of its parent's files (step 2 of `fork.rs`'s list; SECURITY.md #295, #300,
//! #304): the tree of the parent's directory, and the deleted files the parent held open, each
//! byte counted against the room the host measured the files against.

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::ffi::CString;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use anyhow::{Context, anyhow};
use nix::fcntl::{AtFlags, OFlag};
use nix::sys::stat::{FileStat, Mode};

use ironcell_core::fork_remap::{self, Remap};

/// Deepest directory nesting copied (the quota's walk bounds it too).
const MAX_DEPTH: usize = 64;

/// What is left of the bytes the host let the copy write (`ForkOrder::copy_limit_bytes`): the
/// room it measured the parent's files against, before the order and again before the
/// go-ahead. The parent, narrowed to its own directory, can still grow its files while the copy
/// runs: `ftruncate` is free, and a signal handler of its code runs while it idles (SECURITY.md
/// #300: four 4 KiB files grown to 60 MiB each once the copy had begun, 242 MiB copied under a
/// 64 MiB quota). The copy stops past the room and the fork fails, as one refused up front.
pub(super) struct CopyBudget {
    left: u64,
    limit: u64,
}

impl CopyBudget {
    pub(super) fn of(limit: Option<u64>) -> CopyBudget {
        let limit = limit.unwrap_or(u64::MAX);
        CopyBudget { left: limit, limit }
    }

    /// How many bytes to ask one copy call for: one past what is left, so a file grown past
    /// the room is seen (at most a GiB at a time).
    fn ask(&self) -> usize {
        self.left.saturating_add(1).min(1 << 30) as usize
    }

    /// Counts `n` bytes copied; an error once they pass the room.
    fn take(&mut self, n: usize, src: &Path) -> anyhow::Result<()> {
        match self.left.checked_sub(n as u64) {
            Some(left) => {
                self.left = left;
                Ok(())
            }
            None => Err(anyhow!(
                "the parent's files grew past the {} MiB they were measured to fit in while \
                 the fork copied them ({} among them): the fork is refused",
                self.limit >> 20,
                src.display()
            )),
        }
    }
}

/// Copies the tree `from` into the existing directory `to`: directories, regular files (their
/// bytes, mode bits 0o777) and symlinks (as links), never following one; the host's own
/// `.ironcell` folder (run spills) stays behind. Records each copied file's (device, inode) →
/// its copy, for re-opening inherited descriptors.
pub(super) fn copy_tree(
    from: &Path,
    to: &Path,
    (copied, notes, budget): (
        &mut HashMap<(u64, u64), PathBuf>,
        &mut Vec<String>,
        &mut CopyBudget,
    ),
    depth: usize,
) -> anyhow::Result<()> {
    if depth > MAX_DEPTH {
        notes.push(format!(
            "folders nested deeper than {MAX_DEPTH} were not copied"
        ));
        return Ok(());
    }
    let dir = nix::dir::Dir::open(
        from,
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .with_context(|| format!("opening {}", from.display()))?;
    let names: Vec<CString> = {
        let mut dir = dir;
        dir.iter()
            .filter_map(Result::ok)
            .map(|e| e.file_name().to_owned())
            .filter(|n| n.as_bytes() != b"." && n.as_bytes() != b"..")
            .collect()
    };
    for name in names {
        if depth == 0 && name.as_bytes() == b".ironcell" {
            continue;
        }
        let os_name = std::ffi::OsStr::from_bytes(name.as_bytes());
        let (src, dst) = (from.join(os_name), to.join(os_name));
        let st: FileStat =
            match nix::sys::stat::fstatat(nix::fcntl::AT_FDCWD, &src, AtFlags::AT_SYMLINK_NOFOLLOW)
            {
                Ok(st) => st,
                Err(_) => continue,
            };
        match st.st_mode & libc::S_IFMT {
            libc::S_IFDIR => {
                nix::unistd::mkdir(&dst, Mode::from_bits_truncate(0o700))?;
                copy_tree(
                    &src,
                    &dst,
                    (&mut *copied, &mut *notes, &mut *budget),
                    depth + 1,
                )?;
            }
            libc::S_IFREG => {
                copy_file(&src, &dst, st.st_mode & 0o777, budget)?;
                copied.insert((st.st_dev, st.st_ino), dst);
            }
            libc::S_IFLNK => {
                if let Ok(target) = nix::fcntl::readlink(&src) {
                    let _ = nix::unistd::symlinkat(target.as_os_str(), nix::fcntl::AT_FDCWD, &dst);
                }
            }
            _ => {}
        }
    }
    Ok(())
}

/// Copies one file (see [`copy_contents`]). Never more than `budget` leaves.
fn copy_file(src: &Path, dst: &Path, mode: u32, budget: &mut CopyBudget) -> anyhow::Result<()> {
    let from = nix::fcntl::open(
        src,
        OFlag::O_RDONLY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .with_context(|| format!("opening {}", src.display()))?;
    let to = nix::fcntl::open(
        dst,
        OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        Mode::from_bits_truncate(mode),
    )
    .with_context(|| format!("creating {}", dst.display()))?;
    copy_contents(from.as_raw_fd(), to.as_raw_fd(), budget, src)
}

/// Copies the bytes of the file open on `from`, from its start (its own offset untouched), to
/// `to` at `to`'s offset: `copy_file_range`, which the kernel answers with a reflink where the
/// filesystem can (it tries `remap_file_range` first: XFS, btrfs, bcachefs, NFS 4.2) and an
/// in-kernel copy elsewhere; reads and writes where it refuses (across filesystems on older
/// kernels, or a filesystem without it). Never more than `budget` leaves; `src` names the file
/// in errors.
pub(super) fn copy_contents(
    from: RawFd,
    to: RawFd,
    budget: &mut CopyBudget,
    src: &Path,
) -> anyhow::Result<()> {
    let mut offset: libc::loff_t = 0;
    loop {
        // SAFETY: copy_file_range(2) between two open descriptors, from `offset` (a local the
        // call advances) to `to`'s own offset (a null pointer).
        let n = unsafe {
            libc::copy_file_range(from, &mut offset, to, std::ptr::null_mut(), budget.ask(), 0)
        };
        match n {
            0 => return Ok(()),
            n if n > 0 => budget.take(n as usize, src)?,
            _ => match nix::errno::Errno::last() {
                nix::errno::Errno::EINTR => {}
                // Not here: the bytes instead, from where it stopped.
                nix::errno::Errno::EXDEV
                | nix::errno::Errno::EINVAL
                | nix::errno::Errno::ENOSYS
                | nix::errno::Errno::EOPNOTSUPP => break,
                e => {
                    return Err(e).with_context(|| format!("copying {}", src.display()));
                }
            },
        }
    }
    // SAFETY: the caller keeps `from` open for this call; the borrow ends with it.
    let from = unsafe { std::os::fd::BorrowedFd::borrow_raw(from) };
    // SAFETY: as above, for `to`.
    let to = unsafe { std::os::fd::BorrowedFd::borrow_raw(to) };
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = match nix::sys::uio::pread(from, &mut buf, offset) {
            Ok(0) => return Ok(()),
            Ok(n) => n,
            Err(nix::errno::Errno::EINTR) => continue,
            Err(e) => return Err(e).with_context(|| format!("reading {}", src.display())),
        };
        budget.take(n, src)?;
        let mut rest = &buf[..n];
        while !rest.is_empty() {
            match nix::unistd::write(to, rest) {
                Ok(w) => rest = &rest[w..],
                Err(nix::errno::Errno::EINTR) => {}
                Err(e) => return Err(e).context("writing the copy"),
            }
        }
        offset += n as libc::loff_t;
    }
}

/// Reads the runs of memory to move onto the copies that the host sends right after its
/// go-ahead byte (SECURITY.md #305; `ironcell_core::fork_remap`).
pub(super) fn read_the_runs_to_remap(socket: RawFd) -> anyhow::Result<Vec<Remap>> {
    let mut count = [0u8; 4];
    read_exactly(socket, &mut count)?;
    let len = fork_remap::records_len(count)
        .ok_or_else(|| anyhow!("the host sent more runs to map than it may"))?;
    let mut records = vec![0u8; len];
    read_exactly(socket, &mut records)?;
    Ok(fork_remap::decode(&records))
}

fn read_exactly(fd: RawFd, buf: &mut [u8]) -> anyhow::Result<()> {
    let mut got = 0;
    while got < buf.len() {
        let rest = &mut buf[got..];
        // SAFETY: read(2) into the unfilled rest of a buffer this function borrows mutably.
        let n = unsafe { libc::read(fd, rest.as_mut_ptr().cast(), rest.len()) };
        match n {
            0 => anyhow::bail!("the host closed the fork's socket"),
            n if n > 0 => got += n as usize,
            _ if nix::errno::Errno::last() == nix::errno::Errno::EINTR => {}
            _ => return Err(std::io::Error::last_os_error()).context("reading the runs to map"),
        }
    }
    Ok(())
}

/// Maps each run whose file B copied (`copies`: the directory's, then the deleted files') onto
/// B's copy: the same address (`MAP_FIXED`, which replaces the run on the parent's file), the
/// same protection and file offset, private. Runs of other files (the Python installation, a
/// read-only grant, a shared folder) stay. Returns how many were moved; an error fails the fork
/// (a run half-moved is never served).
pub(super) fn remap_onto_copies(
    runs: &[Remap],
    copies: [&HashMap<(u64, u64), PathBuf>; 2],
) -> anyhow::Result<usize> {
    let mut opened: HashMap<(u64, u64), OwnedFd> = HashMap::new();
    let mut moved = 0;
    for r in runs {
        let key = (libc::makedev(r.major as u32, r.minor as u32), r.inode);
        let Some(path) = copies.iter().find_map(|c| c.get(&key)) else {
            continue;
        };
        let fd = match opened.entry(key) {
            Entry::Occupied(file) => file.get().as_raw_fd(),
            Entry::Vacant(slot) => {
                let file = nix::fcntl::open(
                    path,
                    OFlag::O_RDONLY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
                    Mode::empty(),
                )
                .with_context(|| format!("opening {} to map it", path.display()))?;
                slot.insert(file).as_raw_fd()
            }
        };
        // SAFETY: mmap(2) over a run of this process's own memory that maps the same bytes of
        // the parent's file (the host read it while this process ran nothing): the run is
        // replaced by the same bytes of this session's copy; nothing here holds a reference
        // into it that the bytes changing would break.
        let at = unsafe {
            libc::mmap(
                r.start as *mut libc::c_void,
                r.len as usize,
                r.prot as i32,
                libc::MAP_PRIVATE | libc::MAP_FIXED,
                fd,
                r.offset as libc::off_t,
            )
        };
        if at == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error()).with_context(|| {
                format!("mapping {} again on this session's copy", path.display())
            });
        }
        moved += 1;
    }
    Ok(moved)
}
