//! Directories made ahead for new workers, so a burst of new sessions does not wait for them.
//!
//! Each worker needs three directories the host makes before it locks down (Landlock grants
//! are fixed then): its session's directory, its view of the session's packages and its forks
//! area. A `mkdir` is the most expensive file system call the host makes for a worker: on an
//! ext4 without a journal (as here), each one walks the block group's recently freed inodes
//! (0.1-0.6 ms measured), and in a burst of 20 new sessions made inline on the async runtime
//! they were a third of the host's CPU samples. With the pool on, the host keeps up to
//! [`DIR_STOCK`] sets made ahead (at most one per session it may hold): one set at a time on a
//! blocking thread, when the pool refills (before its spares: the pool is full only with the
//! stock), and never while a worker is being started for a session (a refill does not compete
//! with a burst). A session's new worker takes its set with one `rename` (the session's
//! directory) and nothing else; past the stock, and for a spare (forked off any session's
//! path), they are made as before.
//!
//! The stock holds nothing of a worker's: its directories live in the host's own directories
//! (`sessions-<pid>/@dir-N` and `@forks-N`, `packages/views-<pid>/wN`), which no worker can
//! reach, and a session's directory takes the stocked one's place only where it has none
//! (`RENAME_NOREPLACE`): a session that kept its files keeps its directory.

use std::os::unix::fs::DirBuilderExt;

use crate::packages::View;

use super::*;

/// How many sets of directories are kept made: enough for a burst of two dozen new sessions
/// (72 empty directories, ~300 KiB of disk).
const DIR_STOCK: usize = 24;
/// After making a directory failed, how long the refill waits before trying again.
const STOCK_BACKOFF: Duration = Duration::from_secs(2);

/// A worker's grants beside its session's directory, made ahead.
struct Grants {
    view: Option<View>,
    forks_area: Option<PathBuf>,
}

/// The stock; empty and never refilled without a pool.
#[derive(Default)]
pub(super) struct DirStock {
    /// Empty private directories (0700) in the sessions' root, `@dir-N`.
    scratches: Mutex<Vec<PathBuf>>,
    grants: Mutex<Vec<Grants>>,
    next: AtomicU64,
    /// When making a set last failed: the refill waits [`STOCK_BACKOFF`] before it tries again.
    failed_at: Mutex<Option<Instant>>,
}

impl DirStock {
    fn full(&self, kept: usize) -> bool {
        lock(&self.scratches).len() >= kept && lock(&self.grants).len() >= kept
    }
}

impl SessionManager {
    /// How many sets the pool keeps: [`DIR_STOCK`], at most one per session the server may
    /// hold, none without a pool.
    fn dirs_kept(&self) -> usize {
        if self.pool.size() == 0 {
            return 0;
        }
        DIR_STOCK.min(self.settings.max_sessions as usize)
    }

    /// How many whole sets of a new worker's directories wait made ahead, of how many the pool
    /// keeps (for `system://info`).
    pub fn dirs_made_ahead(&self) -> (usize, usize) {
        let dirs = &self.pool.dirs;
        let ready = lock(&dirs.scratches).len().min(lock(&dirs.grants).len());
        (ready, self.dirs_kept())
    }

    /// The directories of a worker about to be spawned in `scratch`: that directory (made, or
    /// a stocked one renamed to it, unless it exists), its packages view and its forks area
    /// (each `None` where this server gives none); from the stock only if `from_stock`.
    pub(super) fn worker_dirs(
        &self,
        scratch: &Path,
        from_stock: bool,
    ) -> Result<(Option<Arc<View>>, Option<PathBuf>), RunRefusal> {
        let stocked = from_stock
            .then(|| lock(&self.pool.dirs.scratches).pop())
            .flatten();
        let placed = stocked.and_then(|dir| match rename_no_replace(&dir, scratch) {
            Ok(()) => Some(()),
            // The session has its directory (files it kept): the stocked one waits for the
            // next worker.
            Err(nix::errno::Errno::EEXIST) => {
                lock(&self.pool.dirs.scratches).push(dir);
                None
            }
            Err(e) => {
                tracing::warn!(from = %dir.display(), to = %scratch.display(), error = %e, "cannot use a directory made ahead");
                None
            }
        });
        if placed.is_none() {
            std::fs::create_dir_all(scratch).map_err(|e| {
                RunRefusal::WorkerStart(format!("creating {}: {e}", scratch.display()))
            })?;
            set_private(scratch);
        }
        let grants = from_stock
            .then(|| lock(&self.pool.dirs.grants).pop())
            .flatten();
        if placed.is_some() || grants.is_some() {
            self.pool.dirs_taken();
        }
        let Grants { view, forks_area } = grants.unwrap_or_else(|| self.make_grants());
        Ok((view.map(Arc::new), forks_area))
    }

    fn make_grants(&self) -> Grants {
        Grants {
            view: self.packages.new_view(),
            forks_area: self.new_forks_area(),
        }
    }

    /// Makes one more set for the stock (blocking: on a blocking thread).
    fn stock_one(&self) -> Result<(), String> {
        let kept = self.dirs_kept();
        if lock(&self.pool.dirs.scratches).len() < kept {
            let n = self.pool.dirs.next.fetch_add(1, Ordering::Relaxed);
            let dir = self.root.join(format!("@dir-{n}"));
            std::fs::DirBuilder::new()
                .mode(0o700)
                .create(&dir)
                .map_err(|e| format!("creating {}: {e}", dir.display()))?;
            set_private(&dir);
            lock(&self.pool.dirs.scratches).push(dir);
        }
        if lock(&self.pool.dirs.grants).len() < kept {
            let grants = self.make_grants();
            lock(&self.pool.dirs.grants).push(grants);
        }
        Ok(())
    }

    /// Fills the stock, one set at a time off the async runtime, stopping as soon as a worker
    /// is being started for a session (the pool's refill calls it first, once no worker is).
    pub(super) async fn top_up_dirs(self: &Arc<Self>) {
        if lock(&self.pool.dirs.failed_at).is_some_and(|t| t.elapsed() < STOCK_BACKOFF) {
            return;
        }
        let kept = self.dirs_kept();
        if self.pool.dirs.full(kept) {
            return;
        }
        self.pool.after_a_burst().await;
        while !self.pool.dirs.full(kept) && !self.pool.session_workers_starting() {
            let m = self.clone();
            match tokio::task::spawn_blocking(move || m.stock_one()).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    tracing::warn!("cannot make a worker's directories ahead: {e}");
                    *lock(&self.pool.dirs.failed_at) = Some(Instant::now());
                    return;
                }
                Err(_) => return,
            }
        }
    }
}

/// Renames `from` to `to` unless `to` exists (both in the host's own directory).
fn rename_no_replace(from: &Path, to: &Path) -> nix::Result<()> {
    use nix::fcntl::{AT_FDCWD, RenameFlags, renameat2};
    renameat2(AT_FDCWD, from, AT_FDCWD, to, RenameFlags::RENAME_NOREPLACE)
}
