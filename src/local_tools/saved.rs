//! Saved tools on disk: `<state dir>/tools/<name>.py`, each with the session that owns it, and
//! `ironcell saved-tools`.

use super::*;

/// `ironcell saved-tools …`: the user's own hand on the saved tools.
#[derive(Debug, clap::Subcommand)]
pub enum SavedToolsAction {
    /// List the saved tools and the session that owns each.
    List,
    /// Delete a saved tool, whichever session saved it (a running server drops it from its
    /// list at its next save or delete, or when it restarts).
    Delete {
        /// The tool's name.
        name: String,
    },
}

/// Runs `ironcell saved-tools` on the state directory `state_dir`: what to print, or the error.
pub fn saved_tools_command(state_dir: &Path, action: &SavedToolsAction) -> Result<String, String> {
    let dir = state_dir.join("tools");
    match action {
        SavedToolsAction::List => {
            let mut out = String::new();
            for file in sorted_saved_tool_files(&dir) {
                let name = saved_stem(&file).to_string();
                let owner = owner_of(&dir, &name).map_or_else(
                    || "(no owner: saved before tools had owners)".to_string(),
                    |o| format!("session {}", crate::proxy::approval::escaped_string(&o)),
                );
                out.push_str(&format!("{name}\t{owner}\n"));
            }
            if out.is_empty() {
                out = format!("no saved tools in {}\n", dir.display());
            }
            Ok(out)
        }
        SavedToolsAction::Delete { name } => {
            if !valid_tool_name(name) {
                return Err(format!("{name:?} is not a saved tool's name"));
            }
            let _saving = lock(&SAVING);
            std::fs::remove_file(dir.join(format!("{name}.py")))
                .map_err(|e| format!("no saved tool {name:?} in {}: {e}", dir.display()))?;
            let _ = std::fs::remove_file(owner_file(&dir, name));
            Ok(format!("Tool {name:?} deleted.\n"))
        }
    }
}

/// Held across a save or delete, so two sessions saving one name cannot interleave their
/// owner and tool files.
pub(super) static SAVING: Mutex<()> = Mutex::new(());

/// The file that names the session which saved the tool `name` (its owner).
pub(super) fn owner_file(dir: &Path, name: &str) -> PathBuf {
    dir.join(format!(".{name}.owner"))
}

/// The session that saved `name`, if known (a tool saved before owners were kept has none,
/// and no session may replace or delete it: only the user can, by removing its file).
pub(super) fn owner_of(dir: &Path, name: &str) -> Option<String> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let mut text = String::new();
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(owner_file(dir, name))
        .ok()?
        .take(4096)
        .read_to_string(&mut text)
        .ok()?;
    Some(text)
}

/// The saved tool files (`<identifier>.py`, regular files) of `dir`.
/// The saved tools files, in name order (the order they are listed in).
pub(super) fn sorted_saved_tool_files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = saved_tool_files(dir).collect();
    files.sort();
    files
}

pub(super) fn saved_tool_files(dir: &Path) -> impl Iterator<Item = PathBuf> {
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let name = e.file_name();
            let stem = name.to_str()?.strip_suffix(".py")?;
            let regular = e.file_type().ok()?.is_file();
            (regular && valid_tool_name(stem)).then(|| e.path())
        })
}

/// Writes `name` in `dir` (created private if missing) through a fresh temporary file that is
/// renamed over it, so a reader never sees half a file and a planted symlink is never followed.
pub(super) fn write_saved_tool(dir: &Path, name: &str, bytes: &[u8]) -> std::io::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)?;
    let meta = std::fs::symlink_metadata(dir)?;
    if !meta.is_dir() {
        return Err(std::io::Error::other(format!(
            "{} is not a directory",
            dir.display()
        )));
    }
    crate::host_fs::replace_file_privately(dir, name, bytes)
}
