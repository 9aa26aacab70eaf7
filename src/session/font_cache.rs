//! matplotlib's font cache, built once per server and shared read-only.

use super::cell::Cell;
use super::quota::remove_scratch;
use super::*;

/// The shared font cache's directory inside `sessions-<pid>` ('@' is never in a session name).
pub(super) const FONT_CACHE_DIR: &str = "@font-cache";
/// Where the font cache is built (by a worker that runs only ironcell's own code).
pub(super) const FONT_CACHE_BUILD_DIR: &str = "@font-cache-build";
/// Where the last built font cache is kept for the next server, inside the state dir.
pub(super) const FONT_CACHE_KEPT_DIR: &str = "font-cache";
/// What the font-cache builder runs: import matplotlib's font manager with `MPLCONFIGDIR` set
/// to its own directory (which holds the previous server's cache, if any: matplotlib keeps it
/// if it is current and rebuilds it otherwise). Nothing else runs in that worker.
pub(super) const FONT_CACHE_BUILD_CODE: &str = "import importlib.util\n\
if importlib.util.find_spec('matplotlib') is None:\n    r = 'absent'\n\
else:\n    import matplotlib, matplotlib.font_manager\n    r = matplotlib.get_cachedir()\n\
r";

/// matplotlib's font cache, built once per server (see [`SessionManager::build_font_cache`])
/// and given to every worker read-only as `MPLCONFIGDIR`.
pub(super) struct FontCache {
    /// `None` until built, or without matplotlib.
    pub(super) dir: Mutex<Option<PathBuf>>,
    /// Whether the builder's worker is alive (it holds no session slot, but it is a live worker
    /// all the same, and `system://info` counts it).
    pub(super) building: std::sync::atomic::AtomicBool,
    /// Set once the cache is built or known to be unneeded (spares wait for it).
    pub(super) settled: tokio::sync::watch::Sender<bool>,
}

impl Default for FontCache {
    fn default() -> Self {
        FontCache {
            dir: Mutex::new(None),
            building: std::sync::atomic::AtomicBool::new(false),
            settled: tokio::sync::watch::Sender::new(false),
        }
    }
}

impl SessionManager {
    /// Builds matplotlib's font cache once for this server, so a new session's first plot does
    /// not spend a second rebuilding it in its own HOME. A worker (sandboxed like any other, but
    /// running only [`FONT_CACHE_BUILD_CODE`]) builds it in a directory of its own, seeded with
    /// the previous server's cache; the host then moves the `fontlist-*.json` files it finds
    /// (regular files only, no symlinks) into `sessions-<pid>/@font-cache`, which every later
    /// worker reads as `MPLCONFIGDIR` (read-only by Landlock), and keeps a copy in the state dir.
    /// Without matplotlib, or if anything fails, workers simply keep their own caches.
    ///
    /// Long on purpose: the build's steps in order (a worker of its own, the cache, the copy, the
    /// zygote warmed), each ending the build on failure.
    pub(super) async fn build_font_cache(self: &Arc<Self>) {
        let build = self.root.join(FONT_CACHE_BUILD_DIR);
        let kept = self.state_dir().join(FONT_CACHE_KEPT_DIR);
        let seeded = {
            let (build, kept) = (build.clone(), kept.clone());
            tokio::task::spawn_blocking(move || {
                std::fs::create_dir_all(&build)?;
                set_private(&build);
                for (name, data) in font_cache_files(&kept) {
                    std::fs::write(build.join(name), data)?;
                }
                std::io::Result::Ok(())
            })
            .await
        };
        if !matches!(seeded, Ok(Ok(()))) {
            tracing::debug!("cannot prepare the font cache build: {seeded:?}");
            return;
        }
        // A slot of its own: the builder never takes a session's place under the cap (it is one
        // worker more for about a second, once per server).
        let Ok(slot) = Arc::new(Semaphore::new(1)).try_acquire_owned() else {
            return;
        };
        let session = Session::new(FONT_CACHE_BUILD_DIR.into(), build.clone());
        self.font_cache.building.store(true, Ordering::SeqCst);
        let worker = match self
            .spawn_worker_in_slot(Some(FONT_CACHE_BUILD_DIR), &session.scratch, slot)
            .await
        {
            Ok(w) => w,
            Err(e) => {
                self.font_cache.building.store(false, Ordering::SeqCst);
                tracing::debug!("no font cache: {e}");
                return;
            }
        };
        let mut state = session.state.lock().await;
        state.worker = Some(worker);
        let started = Instant::now();
        let disk_stops_seen = self.disk_guard.stops.borrow().0;
        let outcome = self
            .drive_cell(
                &session,
                &mut state,
                Cell {
                    run_no: 0,
                    code: FONT_CACHE_BUILD_CODE,
                    timeout: Duration::from_secs(120),
                    cancel: CancellationToken::new(),
                    progress: None,
                    disk_stops_seen,
                },
            )
            .await;
        if let Some(w) = state.worker.take() {
            w.kill().await;
        }
        self.font_cache.building.store(false, Ordering::SeqCst);
        let result = outcome.record.result.unwrap_or_default();
        let published = if outcome.record.status != RunStatus::Ok || result.contains("absent") {
            tracing::debug!(%result, status = ?outcome.record.status, "no shared font cache");
            None
        } else {
            let (root, build) = (self.root.clone(), build.clone());
            tokio::task::spawn_blocking(move || publish_font_cache(&root, &build, &kept))
                .await
                .ok()
                .flatten()
        };
        remove_scratch(build).await;
        if let Some(dir) = published {
            tracing::info!(
                dir = %dir.display(),
                ms = started.elapsed().as_millis() as u64,
                "matplotlib's font cache is shared by new sessions"
            );
            if self.settings.warm_plots {
                self.warm_zygote_for_plots(&dir).await;
            }
            // Only now: a worker given the shared cache also finds pyplot imported (and the
            // spare pool, which waits for this, is filled from the warmed zygote).
            *lock(&self.font_cache.dir) = Some(dir);
        }
    }

    /// Has the zygote import matplotlib and pyplot with the shared font cache (see
    /// [`crate::zygote::Zygote::warm_plots`]) and waits for it. Spawn requests wait in the
    /// zygote meanwhile (a few hundred milliseconds, once per server; the first session is
    /// usually forked before the font cache is built). A failure only means sessions import
    /// matplotlib themselves.
    async fn warm_zygote_for_plots(&self, font_cache: &Path) {
        let asked = self.current_zygote().and_then(|z| z.warm_plots(font_cache));
        let answer = match asked {
            Ok(rx) => tokio::time::timeout(Duration::from_secs(120), rx).await,
            Err(e) => {
                tracing::warn!("matplotlib is not preloaded for new sessions: {e:#}");
                return;
            }
        };
        match answer {
            Ok(Ok(w)) if w.pyplot => tracing::info!(
                ms = w.ms,
                message = %w.message,
                "new sessions start with matplotlib.pyplot imported"
            ),
            Ok(Ok(w)) => tracing::warn!(
                message = %w.message,
                "matplotlib is not preloaded for new sessions"
            ),
            Ok(Err(_)) => tracing::warn!("the zygote exited while it imported matplotlib"),
            Err(_) => tracing::warn!("the zygote took over 120 s to import matplotlib"),
        }
    }
}

/// The `fontlist-*.json` regular files directly in `dir` (no symlinks), with their contents.
pub(super) fn font_cache_files(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let Ok(fd) = host_fs::open_session_dir(dir) else {
        return Vec::new();
    };
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for e in entries.flatten() {
        let Some(name) = e.file_name().to_str().map(str::to_string) else {
            continue;
        };
        if !(name.starts_with("fontlist-") && name.ends_with(".json")) {
            continue;
        }
        if let Ok(data) = host_fs::read_regular_file(fd.as_fd(), Path::new(&name), 64 << 20) {
            out.push((name, data));
        }
    }
    out
}

/// Copies the font cache the builder made into `root/@font-cache` (and the state dir, for the
/// next server); returns the shared directory if it holds a font list.
pub(super) fn publish_font_cache(root: &Path, build: &Path, kept: &Path) -> Option<PathBuf> {
    let files = font_cache_files(build);
    if files.is_empty() {
        return None;
    }
    let shared = root.join(FONT_CACHE_DIR);
    let staging = root.join(format!("{FONT_CACHE_DIR}.new"));
    let _ = host_fs::remove_tree(&staging);
    std::fs::create_dir(&staging).ok()?;
    set_private(&staging);
    for (name, data) in &files {
        std::fs::write(staging.join(name), data).ok()?;
    }
    std::fs::rename(&staging, &shared).ok()?;
    if std::fs::create_dir_all(kept).is_ok() {
        set_private(kept);
        for (name, data) in &files {
            let tmp = kept.join(format!(".{name}.{}", std::process::id()));
            if std::fs::write(&tmp, data).is_ok() {
                let _ = std::fs::rename(&tmp, kept.join(name));
            }
        }
    }
    Some(shared)
}
