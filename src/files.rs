//! Session files as MCP resources: `ironcell://session/<session>/<path>`.
//!
//! The host reads these files on the client's behalf, outside the sandbox, while the sandboxed
//! code controls what is in the directory. So a path is refused unless, after opening, the file
//! really lies inside the session's directory: `..`, absolute paths and symlinks pointing out
//! (even a symlinked parent directory, or one swapped in between check and open) are refused.

use std::io::Read;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Component, Path, PathBuf};
use std::time::SystemTime;

use serde::Serialize;

pub const URI_PREFIX: &str = "ironcell://session/";
/// Largest file served through `resources/read`.
pub const MAX_READ_BYTES: u64 = 16 * 1024 * 1024;

/// A file a run created or changed, as linked from its result.
#[derive(Debug, Clone, Serialize)]
pub struct FileRef {
    pub path: String,
    pub uri: String,
    pub size: u64,
    pub mime: &'static str,
}

pub fn session_uri(session: &str, rel: &str) -> String {
    format!("{URI_PREFIX}{session}/{rel}")
}

/// Splits a session-file URI into (session, relative path).
pub fn parse_uri(uri: &str) -> Option<(&str, &str)> {
    let rest = uri.strip_prefix(URI_PREFIX)?;
    let (session, rel) = rest.split_once('/')?;
    (!session.is_empty() && !rel.is_empty()).then_some((session, rel))
}

pub fn mime_for(path: &str) -> &'static str {
    let ext = Path::new(path)
        .extension()
        .and_then(|e| e.to_str())
        .map(str::to_ascii_lowercase)
        .unwrap_or_default();
    match ext.as_str() {
        "txt" | "log" | "out" => "text/plain",
        "md" => "text/markdown",
        "csv" => "text/csv",
        "tsv" => "text/tab-separated-values",
        "json" => "application/json",
        "jsonl" | "ndjson" => "application/x-ndjson",
        "html" | "htm" => "text/html",
        "xml" => "application/xml",
        "yaml" | "yml" => "application/yaml",
        "py" => "text/x-python",
        "svg" => "image/svg+xml",
        "png" => "image/png",
        "jpg" | "jpeg" => "image/jpeg",
        "gif" => "image/gif",
        "webp" => "image/webp",
        "pdf" => "application/pdf",
        "zip" => "application/zip",
        "gz" => "application/gzip",
        "parquet" => "application/vnd.apache.parquet",
        "db" | "sqlite" => "application/vnd.sqlite3",
        _ => "application/octet-stream",
    }
}

pub fn is_text_mime(mime: &str) -> bool {
    mime.starts_with("text/")
        || matches!(
            mime,
            "application/json"
                | "application/x-ndjson"
                | "application/xml"
                | "application/yaml"
                | "image/svg+xml"
        )
}

/// A relative path with only normal components, or an explanation.
fn checked_relative(rel: &str) -> Result<PathBuf, String> {
    let p = Path::new(rel);
    if rel.contains('\0') || p.is_absolute() {
        return Err(format!("{rel:?} is not a path inside the session"));
    }
    if p.components().any(|c| !matches!(c, Component::Normal(_))) {
        return Err(format!(
            "{rel:?} leaves the session directory; it is refused"
        ));
    }
    Ok(p.to_path_buf())
}

/// Reads `rel` beneath `root`, refusing anything that resolves outside it.
pub fn read_within(root: &Path, rel: &str) -> Result<Vec<u8>, String> {
    let rel = checked_relative(rel)?;
    let root =
        std::fs::canonicalize(root).map_err(|_| "this session has no files yet".to_string())?;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(root.join(&rel))
        .map_err(|e| format!("cannot open {}: {e}", rel.display()))?;
    // Where the opened file really is (a symlinked parent or a swap after the check shows here).
    use std::os::fd::AsRawFd;
    let real = std::fs::read_link(format!("/proc/self/fd/{}", file.as_raw_fd()))
        .map_err(|e| format!("cannot resolve {}: {e}", rel.display()))?;
    if !real.starts_with(&root) {
        return Err(format!(
            "{} leaves the session directory; it is refused",
            rel.display()
        ));
    }
    let meta = file.metadata().map_err(|e| e.to_string())?;
    if !meta.is_file() {
        return Err(format!("{} is not a regular file", rel.display()));
    }
    if meta.len() > MAX_READ_BYTES {
        return Err(format!(
            "{} is {} bytes; resources are served up to {MAX_READ_BYTES} bytes (read it in run_python instead)",
            rel.display(),
            meta.len()
        ));
    }
    let mut buf = Vec::with_capacity(meta.len() as usize);
    file.take(MAX_READ_BYTES)
        .read_to_end(&mut buf)
        .map_err(|e| e.to_string())?;
    Ok(buf)
}

/// Regular files beneath `root` (relative paths, sizes, mtimes), at most `limit`, sorted.
pub fn list(root: &Path, limit: usize) -> Vec<(String, u64, SystemTime)> {
    let mut out = Vec::new();
    let mut pending = vec![PathBuf::new()];
    while let Some(dir) = pending.pop() {
        let Ok(entries) = std::fs::read_dir(root.join(&dir)) else {
            continue;
        };
        for entry in entries.flatten() {
            let rel = dir.join(entry.file_name());
            let Ok(meta) = entry.path().symlink_metadata() else {
                continue;
            };
            if meta.is_dir() {
                pending.push(rel);
            } else if meta.is_file() {
                if let Some(s) = rel.to_str() {
                    out.push((
                        s.to_string(),
                        meta.len(),
                        meta.modified().unwrap_or(SystemTime::UNIX_EPOCH),
                    ));
                }
                if out.len() >= limit {
                    out.sort();
                    return out;
                }
            }
        }
    }
    out.sort();
    out
}

/// Files a run created or changed (modified at or after `since`), leaving out hidden paths
/// (ironcell's own `.ironcell/`, caches such as `.cache/matplotlib`).
pub fn changed_since(root: &Path, session: &str, since: SystemTime, limit: usize) -> Vec<FileRef> {
    list(root, 10_000)
        .into_iter()
        .filter(|(rel, _, mtime)| *mtime >= since && !rel.starts_with('.') && !rel.contains("/."))
        .take(limit)
        .map(|(rel, size, _)| FileRef {
            uri: session_uri(session, &rel),
            mime: mime_for(&rel),
            path: rel,
            size,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn root(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("ironcell-files-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(d.join("sub")).unwrap();
        d
    }

    #[test]
    fn files_inside_are_served() {
        let r = root("in");
        std::fs::write(r.join("sub/a.csv"), "x,y\n").unwrap();
        assert_eq!(read_within(&r, "sub/a.csv").unwrap(), b"x,y\n");
        assert_eq!(
            parse_uri(&session_uri("s1", "sub/a.csv")),
            Some(("s1", "sub/a.csv"))
        );
        assert_eq!(mime_for("sub/a.csv"), "text/csv");
    }

    #[test]
    fn escapes_are_refused() {
        let r = root("out");
        std::os::unix::fs::symlink("/etc/passwd", r.join("link")).unwrap();
        std::os::unix::fs::symlink("/etc", r.join("etcdir")).unwrap();
        for bad in [
            "../x",
            "/etc/passwd",
            "link",
            "etcdir/passwd",
            "sub/../../x",
            "a\0b",
        ] {
            assert!(read_within(&r, bad).is_err(), "{bad}");
        }
    }
}
