//! The content-addressed wheel store and the per-worker views that link into it.
//!
//! ```text
//! <state>/packages/store/<sha256 of the wheel>/entry.json   what it is (name, version, file, size)
//! <state>/packages/store/<sha256 of the wheel>/files/…      the checked, unpacked wheel (0444)
//! <state>/packages/tmp/<pid>-<n>/                            staging, renamed into the store
//! <state>/packages/views-<pid>/<n>/                          one worker's installed packages
//! ```
//!
//! An entry is unpacked into a private staging directory and renamed into place, so a reader
//! sees a whole entry or none; two installs of one wheel race only to that rename, and the
//! loser's copy is discarded (the content is the same by construction). A worker never sees
//! the store: each worker gets an empty view directory at spawn, granted read-only by Landlock
//! (rules cannot be added after a worker locked itself down, and spares lock down before they
//! know their session), and the host fills it with hard links to the store's files when its
//! session installs something. Hard links, not symlinks: a symlink would need the store itself
//! granted, which would show every session every other session's packages.
//!
//! An entry is in use while any of its files has another link (a live view); `prune` removes
//! only entries no view uses.

use std::collections::BTreeSet;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use super::wheel::{self, Unpacked};

/// What the store knows of one wheel.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize, PartialEq, Eq)]
pub struct StoreEntry {
    pub sha256: String,
    pub filename: String,
    #[serde(flatten)]
    pub unpacked: Unpacked,
    /// RFC 3339.
    pub added: String,
}

pub struct Store {
    root: PathBuf,
    budget: u64,
    next: AtomicU64,
    /// Held while entries are added, linked or removed in this process.
    lock: std::sync::Mutex<()>,
}

impl Store {
    /// The store under `state_dir` (made if missing), with staging and views left by servers
    /// that are gone removed.
    pub fn open(state_dir: &Path, budget: u64) -> Result<Store, String> {
        let root = state_dir.join("packages");
        for d in ["store", "tmp"] {
            std::fs::create_dir_all(root.join(d))
                .map_err(|e| format!("creating {}: {e}", root.join(d).display()))?;
        }
        let store = Store {
            root,
            budget,
            next: AtomicU64::new(0),
            lock: std::sync::Mutex::new(()),
        };
        store.remove_leftovers();
        Ok(store)
    }

    /// For the command line: the store as it is, made or cleaned of nothing.
    pub fn at(state_dir: &Path, budget: u64) -> Store {
        Store {
            root: state_dir.join("packages"),
            budget,
            next: AtomicU64::new(0),
            lock: std::sync::Mutex::new(()),
        }
    }

    pub fn budget(&self) -> u64 {
        self.budget
    }

    /// Staging directories and views of ironcell servers that are no longer running.
    fn remove_leftovers(&self) {
        let dead = |pid: &str| {
            pid.parse::<i32>().is_ok_and(|p| {
                p != std::process::id() as i32 && !Path::new(&format!("/proc/{p}")).exists()
            })
        };
        if let Ok(rd) = std::fs::read_dir(self.root.join("tmp")) {
            for e in rd.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                if name.split('-').next().is_some_and(dead) {
                    remove_tree(&e.path());
                }
            }
        }
        if let Ok(rd) = std::fs::read_dir(&self.root) {
            for e in rd.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                if name.strip_prefix("views-").is_some_and(dead) {
                    remove_tree(&e.path());
                }
            }
        }
    }

    /// A fresh private staging directory (removed when dropped).
    pub fn staging(&self) -> Result<Staging, String> {
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        let dir = self
            .root
            .join("tmp")
            .join(format!("{}-{n}", std::process::id()));
        std::fs::create_dir(&dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
        set_mode(&dir, 0o700);
        Ok(Staging(dir))
    }

    fn entry_dir(&self, sha256: &str) -> PathBuf {
        self.root.join("store").join(sha256)
    }

    /// The entry of the wheel with this SHA-256, if the store has it.
    pub fn get(&self, sha256: &str) -> Option<StoreEntry> {
        if sha256.len() != 64 || !sha256.bytes().all(|b| b.is_ascii_hexdigit()) {
            return None;
        }
        let text = std::fs::read_to_string(self.entry_dir(sha256).join("entry.json")).ok()?;
        serde_json::from_str::<StoreEntry>(&text)
            .ok()
            .filter(|e| e.sha256 == sha256)
    }

    /// Checks and unpacks the wheel at `wheel_path` (whose SHA-256 the caller verified) into
    /// the store, unless it is there already.
    pub fn add(
        &self,
        wheel_path: &Path,
        sha256: &str,
        filename: &str,
        stdlib: &BTreeSet<String>,
    ) -> Result<StoreEntry, String> {
        if let Some(e) = self.get(sha256) {
            return Ok(e);
        }
        let staging = self.staging()?;
        let limits = wheel::Limits {
            max_unpacked_bytes: self.budget,
            ..wheel::Limits::default()
        };
        let unpacked = wheel::unpack(wheel_path, &staging.0.join("files"), stdlib, limits)
            .map_err(|why| format!("{filename} was refused: {why}"))?;
        let entry = StoreEntry {
            sha256: sha256.to_string(),
            filename: filename.to_string(),
            unpacked,
            added: chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
        };
        let json = serde_json::to_string_pretty(&entry).map_err(|e| e.to_string())?;
        std::fs::write(staging.0.join("entry.json"), json)
            .map_err(|e| format!("writing the store entry: {e}"))?;
        let _held = crate::lock(&self.lock);
        self.make_room(entry.unpacked.bytes)?;
        let dest = self.entry_dir(sha256);
        set_mode(&staging.0, 0o755);
        match std::fs::rename(&staging.0, &dest) {
            Ok(()) => {}
            // Another install of the same wheel won the race: same content, keep theirs.
            Err(_) if self.get(sha256).is_some() => {}
            Err(e) => return Err(format!("moving {filename} into the store: {e}")),
        }
        Ok(entry)
    }

    /// Every entry, oldest first.
    pub fn entries(&self) -> Vec<StoreEntry> {
        let mut out: Vec<StoreEntry> = std::fs::read_dir(self.root.join("store"))
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| self.get(&e.file_name().to_string_lossy()))
            .collect();
        out.sort_by(|a, b| a.added.cmp(&b.added));
        out
    }

    /// Every entry, with whether a view uses it.
    pub fn list(&self) -> Vec<(StoreEntry, bool)> {
        self.entries()
            .into_iter()
            .map(|e| {
                let used = in_use(&self.entry_dir(&e.sha256).join("files"));
                (e, used)
            })
            .collect()
    }

    /// Bytes the store's entries unpack to.
    pub fn size(&self) -> u64 {
        self.entries().iter().map(|e| e.unpacked.bytes).sum()
    }

    pub fn path(&self) -> &Path {
        &self.root
    }

    /// Removes unused entries (all of them with `all`, else only as many, oldest first, as
    /// bring the store under `target` bytes). Returns (entries removed, bytes freed).
    pub fn prune(&self, target: Option<u64>) -> (usize, u64) {
        let entries = self.list();
        let mut size: u64 = entries.iter().map(|(e, _)| e.unpacked.bytes).sum();
        let (mut removed, mut freed) = (0, 0);
        for (e, used) in entries {
            if target.is_some_and(|t| size <= t) {
                break;
            }
            if used {
                continue;
            }
            remove_tree(&self.entry_dir(&e.sha256));
            size = size.saturating_sub(e.unpacked.bytes);
            removed += 1;
            freed += e.unpacked.bytes;
        }
        (removed, freed)
    }

    /// Frees room for `bytes` more by pruning unused entries, or says the store is full.
    fn make_room(&self, bytes: u64) -> Result<(), String> {
        let target = self.budget.saturating_sub(bytes);
        if self.size() > target {
            self.prune(Some(target));
        }
        let size = self.size();
        if size.saturating_add(bytes) > self.budget {
            return Err(format!(
                "the package store is full: it holds {} MiB in use by sessions, and this needs {} MiB more than its budget of {} MiB allows. Free it with `ironcell packages prune` once those sessions end, or raise --packages-budget (IRONCELL_PACKAGES_BUDGET)",
                size >> 20,
                (size + bytes).saturating_sub(self.budget).div_ceil(1 << 20),
                self.budget >> 20
            ));
        }
        Ok(())
    }

    /// Links the entry's files into `view` (directories made, files hard-linked).
    pub fn link(&self, entry: &StoreEntry, view: &Path) -> Result<(), String> {
        let _held = crate::lock(&self.lock);
        let files = self.entry_dir(&entry.sha256).join("files");
        link_tree(&files, view, &entry.filename)
    }

    /// A new, empty view directory for one worker.
    pub fn new_view(&self) -> Result<View, String> {
        let parent = self.root.join(format!("views-{}", std::process::id()));
        std::fs::create_dir_all(&parent)
            .map_err(|e| format!("creating {}: {e}", parent.display()))?;
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        let dir = parent.join(format!("w{n}"));
        std::fs::create_dir(&dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
        set_mode(&dir, 0o755);
        Ok(View { dir })
    }

    /// Removes every view of this server (at shutdown).
    pub fn remove_views(&self) {
        remove_tree(&self.root.join(format!("views-{}", std::process::id())));
    }
}

/// A staging directory, removed (whatever is left of it) when dropped.
pub struct Staging(pub PathBuf);

impl Drop for Staging {
    fn drop(&mut self) {
        if self.0.exists() {
            remove_tree(&self.0);
        }
    }
}

/// One worker's view of its session's packages: a directory the worker may only read.
#[derive(Debug)]
pub struct View {
    pub dir: PathBuf,
}

impl Drop for View {
    fn drop(&mut self) {
        let dir = std::mem::take(&mut self.dir);
        // Unlinking a large view takes a while: off the async runtime where there is one.
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => {
                rt.spawn_blocking(move || remove_tree(&dir));
            }
            Err(_) => remove_tree(&dir),
        }
    }
}

/// Hard-links every file under `src` to the same place under `dst`, making directories.
/// A file already there is fine if it is the same file (the same wheel linked twice);
/// another file of that name is a conflict between two packages.
fn link_tree(src: &Path, dst: &Path, what: &str) -> Result<(), String> {
    let rd = std::fs::read_dir(src).map_err(|e| format!("reading {}: {e}", src.display()))?;
    for e in rd {
        let e = e.map_err(|e| format!("reading {}: {e}", src.display()))?;
        let (from, to) = (e.path(), dst.join(e.file_name()));
        let meta = std::fs::symlink_metadata(&from).map_err(|e| e.to_string())?;
        if meta.is_dir() {
            match std::fs::symlink_metadata(&to) {
                Ok(m) if m.is_dir() => {}
                Ok(_) => {
                    return Err(format!(
                        "{what} has a directory {:?} where another package has a file",
                        e.file_name()
                    ));
                }
                Err(_) => {
                    std::fs::create_dir(&to).map_err(|e| format!("linking {what}: {e}"))?;
                    set_mode(&to, 0o755);
                }
            }
            link_tree(&from, &to, what)?;
        } else if meta.is_file() {
            match std::fs::hard_link(&from, &to) {
                Ok(()) => {}
                Err(err) if err.kind() == std::io::ErrorKind::AlreadyExists => {
                    let there = std::fs::symlink_metadata(&to).map_err(|e| e.to_string())?;
                    if (there.dev(), there.ino()) != (meta.dev(), meta.ino()) {
                        return Err(format!(
                            "{what} has a file {:?} that another package installed in this session already provides",
                            to.strip_prefix(dst).unwrap_or(&to)
                        ));
                    }
                }
                Err(err) => return Err(format!("linking {what} into the session: {err}")),
            }
        }
    }
    Ok(())
}

/// Whether any file under `dir` has more than one link (a view uses it).
fn in_use(dir: &Path) -> bool {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return false;
    };
    for e in rd.flatten() {
        let Ok(m) = std::fs::symlink_metadata(e.path()) else {
            continue;
        };
        if m.is_dir() {
            if in_use(&e.path()) {
                return true;
            }
        } else if m.nlink() > 1 {
            return true;
        }
    }
    false
}

fn set_mode(p: &Path, mode: u32) {
    use std::os::unix::fs::PermissionsExt;
    let _ = std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode));
}

/// Removes a tree the host made (files 0444 in directories it owns).
fn remove_tree(p: &Path) {
    if let Err(e) = std::fs::remove_dir_all(p)
        && e.kind() != std::io::ErrorKind::NotFound
    {
        tracing::warn!(path = %p.display(), error = %e, "removing a package directory failed");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn linking_twice_is_fine_and_a_foreign_file_is_a_conflict() {
        let base = std::env::temp_dir().join(format!("ironcell-store-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        let (a, b, view) = (base.join("a"), base.join("b"), base.join("view"));
        for d in [&a.join("pkg"), &b.join("pkg"), &view] {
            std::fs::create_dir_all(d).unwrap_or_else(|e| panic!("{e}"));
        }
        std::fs::write(a.join("pkg/x.py"), "1").unwrap_or_else(|e| panic!("{e}"));
        std::fs::write(b.join("pkg/x.py"), "2").unwrap_or_else(|e| panic!("{e}"));
        assert!(!in_use(&a));
        link_tree(&a, &view, "a").unwrap_or_else(|e| panic!("{e}"));
        link_tree(&a, &view, "a").unwrap_or_else(|e| panic!("{e}"));
        assert!(in_use(&a));
        let e = link_tree(&b, &view, "b").err().unwrap_or_default();
        assert!(e.contains("already provides"), "{e}");
        let _ = std::fs::remove_dir_all(&base);
    }
}
