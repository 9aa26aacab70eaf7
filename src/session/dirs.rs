//! The sessions' directories on the host: their files, listed and read for the client, and the
//! directories of servers that died, removed at start.

use super::*;

impl SessionManager {
    /// Files of every session: (session, relative path, size), at most `limit`. The walks run
    /// off the async runtime and stop after a bounded number of entries.
    pub async fn session_files(&self, limit: usize) -> Vec<(String, String, u64)> {
        let mut sessions: Vec<(String, PathBuf)> = lock(&self.sessions)
            .values()
            .map(|s| (s.name.clone(), s.scratch.clone()))
            .collect();
        sessions.sort();
        let walked = tokio::task::spawn_blocking(move || {
            // Each session gets an equal share first, so one with many files cannot push the
            // others out; what the small ones leave goes to the others, in name order.
            let share = (limit / sessions.len().max(1)).max(1);
            let mut listed: Vec<_> = sessions
                .iter()
                .map(|(name, dir)| {
                    let listing = crate::files::list(dir, share);
                    if let Some(why) = listing.incomplete {
                        tracing::debug!(session = %name, "listing session files: {why}");
                    }
                    listing.files
                })
                .collect();
            let mut room = limit.saturating_sub(listed.iter().map(Vec::len).sum());
            for ((name, dir), files) in sessions.iter().zip(listed.iter_mut()) {
                if room == 0 {
                    break;
                }
                if files.len() < share {
                    continue; // listed whole
                }
                let listing = crate::files::list(dir, files.len() + room);
                room += files.len();
                *files = listing.files;
                room -= files.len();
                if let Some(why) = listing.incomplete {
                    tracing::warn!(session = %name, "listing session files: {why}");
                }
            }
            sessions
                .into_iter()
                .zip(listed)
                .flat_map(|((name, _), files)| {
                    files
                        .into_iter()
                        .map(move |(rel, size, _)| (name.clone(), rel, size))
                })
                .take(limit)
                .collect()
        })
        .await;
        walked.unwrap_or_else(|e| {
            tracing::error!(error = %e, "listing session files failed");
            Vec::new()
        })
    }

    /// Reads a file of a session (off the async runtime), refusing paths that leave its
    /// directory or pass through a symlink.
    pub async fn read_session_file(&self, session: &str, rel: &str) -> Result<Vec<u8>, String> {
        let dir = lock(&self.sessions)
            .get(session)
            .map(|s| s.scratch.clone())
            .ok_or_else(|| format!("no session {session:?}"))?;
        let rel = rel.to_string();
        tokio::task::spawn_blocking(move || crate::files::read_within(&dir, &rel))
            .await
            .unwrap_or_else(|e| Err(format!("reading the file failed: {e}")))
    }
}

/// Removes `sessions-<pid>` directories left by ironcell servers that died without cleaning
/// up (e.g. SIGKILL), so their files do not pile up.
pub(super) fn remove_sessions_of_dead_servers(state_dir: &Path) {
    let Ok(entries) = std::fs::read_dir(state_dir) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix("sessions-"))
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        if !Path::new(&format!("/proc/{pid}")).exists() {
            tracing::info!(dir = %entry.path().display(), "removing sessions of a server that is gone");
            let removal = host_fs::remove_tree(&entry.path());
            if !removal.is_complete() {
                tracing::warn!(dir = %entry.path().display(), "{}", removal.summary());
            }
        }
    }
}

/// Makes a directory the host created private (0700), without following a symlink.
pub(super) fn set_private(dir: &Path) {
    let opened = nix::fcntl::open(
        dir,
        nix::fcntl::OFlag::O_RDONLY
            | nix::fcntl::OFlag::O_DIRECTORY
            | nix::fcntl::OFlag::O_NOFOLLOW
            | nix::fcntl::OFlag::O_CLOEXEC,
        nix::sys::stat::Mode::empty(),
    );
    let result = opened.and_then(|fd| {
        nix::sys::stat::fchmod(&fd, nix::sys::stat::Mode::from_bits_truncate(0o700))
    });
    if let Err(e) = result {
        tracing::warn!(dir = %dir.display(), error = %e, "cannot make the directory private");
    }
}
