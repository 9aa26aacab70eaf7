//! Session files as MCP resources: `ironcell://session/<session>/<path>`.
//!
//! The host reads these files on the client's behalf, outside the sandbox, while the sandboxed
//! code controls what is in the directory. So every lookup goes through [`crate::host_fs`]:
//! fd-relative, refusing `..`, absolute paths and symlinks at every step (even a symlinked parent
//! directory, or one swapped in between a listing and a read), and serving regular files only.

use std::os::fd::AsFd;
use std::path::{Component, Path, PathBuf};
use std::time::SystemTime;

use serde::Serialize;

use crate::host_fs;

mod changes;
pub use changes::{ChangeTracker, Changes};

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

/// What a path segment of a session-file URI escapes: controls, space, `%`, the characters
/// RFC 3986 reserves for queries and fragments (`?`, `#`) or forbids in a path, and (by
/// `utf8_percent_encode`) every byte beyond ASCII. A file named `q?x=1.txt`, `h#f.txt` or with a
/// newline or a right-to-left override in its name is then one URI a client reads back as that
/// file, and shows as what it is.
const SEGMENT: &percent_encoding::AsciiSet = &percent_encoding::CONTROLS
    .add(b' ')
    .add(b'"')
    .add(b'#')
    .add(b'%')
    .add(b'<')
    .add(b'>')
    .add(b'?')
    .add(b'[')
    .add(b'\\')
    .add(b']')
    .add(b'^')
    .add(b'`')
    .add(b'{')
    .add(b'|')
    .add(b'}');
/// The session name is one segment: a `/` in it is escaped too.
const SESSION: &percent_encoding::AsciiSet = &SEGMENT.add(b'/');

pub fn session_uri(session: &str, rel: &str) -> String {
    use percent_encoding::utf8_percent_encode as enc;
    let mut uri = format!("{URI_PREFIX}{}", enc(session, SESSION));
    for segment in rel.split('/') {
        uri.push('/');
        uri.extend(enc(segment, SEGMENT));
    }
    uri
}

/// Splits a session-file URI into (session, relative path), percent-decoded; `None` if either is
/// empty or does not decode to UTF-8. What the path may hold is checked by the lookup.
pub fn parse_uri(uri: &str) -> Option<(String, String)> {
    let rest = uri.strip_prefix(URI_PREFIX)?;
    let (session, rel) = rest.split_once('/')?;
    let decode = |s: &str| {
        percent_encoding::percent_decode_str(s)
            .decode_utf8()
            .ok()
            .map(|s| s.into_owned())
    };
    let (session, rel) = (decode(session)?, decode(rel)?);
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

/// Reads `rel` beneath the session directory `root`, following no symlink at any step (so
/// nothing outside the session can be reached, however the worker rearranges its directory).
pub fn read_within(root: &Path, rel: &str) -> Result<Vec<u8>, String> {
    let rel = checked_relative(rel)?;
    let dir =
        host_fs::open_session_dir(root).map_err(|_| "this session has no files yet".to_string())?;
    host_fs::read_regular_file(dir.as_fd(), &rel, MAX_READ_BYTES).map_err(|e| match e {
        host_fs::ReadError::Open(err) if err.raw_os_error() == Some(libc::ELOOP) => format!(
            "{} is or passes through a symlink; session files are served only by their real path",
            rel.display()
        ),
        host_fs::ReadError::Open(err) if err.raw_os_error() == Some(libc::EXDEV) => format!(
            "{} leaves the session directory; it is refused",
            rel.display()
        ),
        host_fs::ReadError::TooLarge { size, max } => format!(
            "{} is {size} bytes; resources are served up to {max} bytes (read it in run_python instead)",
            rel.display()
        ),
        other => format!("{}: {other}", rel.display()),
    })
}

/// Entries a listing looks at before it stops.
pub const MAX_LISTED_ENTRIES: usize = 20_000;

/// What [`list`] found.
#[derive(Debug, Default)]
pub struct Listing {
    /// Regular files: relative path, size, mtime; sorted.
    pub files: Vec<(String, u64, SystemTime)>,
    /// Why the listing is incomplete, if it is.
    pub incomplete: Option<String>,
}

struct Lister {
    files: Vec<(String, u64, SystemTime)>,
    limit: usize,
    seen: usize,
    skip_hidden: bool,
    since: Option<SystemTime>,
    incomplete: Option<String>,
    /// Files left out because their names are not UTF-8.
    unlisted: usize,
}

/// What a listing says of files it left out because their names are not UTF-8 (a URI and a
/// reported path are text): they exist, count against the quota, and can be renamed.
pub fn unlisted_names_note(count: Option<usize>) -> String {
    let which = match count {
        Some(1) => "1 file whose name is not UTF-8 is".to_string(),
        Some(n) => format!("{n} files whose names are not UTF-8 are"),
        None => "files whose names are not UTF-8 are".to_string(),
    };
    format!(
        "{which} left out (they still count against the scratch quota); give them UTF-8 names, \
         e.g. os.rename(b'name\\xff.txt', 'name.txt')"
    )
}

impl host_fs::Visitor for Lister {
    fn entry(&mut self, e: &host_fs::Entry<'_>) -> host_fs::Step {
        self.seen += 1;
        if self.seen > MAX_LISTED_ENTRIES {
            self.incomplete = Some(format!(
                "the listing stopped after {MAX_LISTED_ENTRIES} entries"
            ));
            return host_fs::Step::Stop;
        }
        if self.skip_hidden && e.name.to_bytes().starts_with(b".") {
            return host_fs::Step::Skip;
        }
        if !host_fs::is_regular(e.stat) {
            return host_fs::Step::Descend;
        }
        let mtime = mtime_of(e.stat);
        if self.since.is_some_and(|since| mtime < since) {
            return host_fs::Step::Descend;
        }
        // Paths past PATH_MAX could not be read back through resources/read anyway.
        if e.relative_path_len() >= libc::PATH_MAX as usize {
            return host_fs::Step::Descend;
        }
        match e.relative_path() {
            Some(rel) => self.files.push((rel, e.stat.st_size.max(0) as u64, mtime)),
            None => self.unlisted += 1,
        }
        if self.files.len() >= self.limit {
            return host_fs::Step::Stop;
        }
        host_fs::Step::Descend
    }

    fn unreadable(&mut self, path: String, error: std::io::Error) -> host_fs::Step {
        tracing::debug!(%path, %error, "a session directory could not be listed");
        host_fs::Step::Descend
    }
}

/// The modification time in a `stat`.
fn mtime_of(st: &nix::sys::stat::FileStat) -> SystemTime {
    SystemTime::UNIX_EPOCH
        .checked_add(std::time::Duration::new(
            st.st_mtime.max(0) as u64,
            st.st_mtime_nsec.clamp(0, 999_999_999) as u32,
        ))
        .unwrap_or(SystemTime::UNIX_EPOCH)
}

fn walk_files(root: &Path, limit: usize, skip_hidden: bool, since: Option<SystemTime>) -> Listing {
    let Ok(dir) = host_fs::open_session_dir(root) else {
        return Listing::default();
    };
    let mut lister = Lister {
        files: Vec::new(),
        limit,
        seen: 0,
        skip_hidden,
        since,
        incomplete: None,
        unlisted: 0,
    };
    if let Err(e) = host_fs::walk(dir.as_fd(), &mut lister) {
        lister.incomplete = Some(format!("the listing stopped: {e}"));
    }
    if lister.unlisted > 0 && lister.incomplete.is_none() {
        lister.incomplete = Some(unlisted_names_note(Some(lister.unlisted)));
    }
    lister.files.sort();
    Listing {
        files: lister.files,
        incomplete: lister.incomplete,
    }
}

/// Regular files beneath the session directory `root` (relative paths, sizes, mtimes), at most
/// `limit`, sorted. The walk holds a directory fd at every step and never follows a symlink, so
/// a directory swapped for a symlink mid-walk cannot bring a host path into the listing.
pub fn list(root: &Path, limit: usize) -> Listing {
    walk_files(root, limit, false, None)
}

/// Files a run created or changed (modified at or after `since`), leaving out hidden paths
/// (ironcell's own `.ironcell/`, caches such as `.cache/matplotlib`).
pub fn changed_since(
    root: &Path,
    session: &str,
    since: SystemTime,
    limit: usize,
) -> (Vec<FileRef>, Option<String>) {
    let listing = walk_files(root, limit, true, Some(since));
    let refs = listing
        .files
        .into_iter()
        .map(|(rel, size, _)| FileRef {
            uri: session_uri(session, &rel),
            mime: mime_for(&rel),
            path: rel,
            size,
        })
        .collect();
    (refs, listing.incomplete)
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
    fn uris_escape_what_would_change_their_meaning_and_read_back_as_the_same_file() {
        for (name, uri) in [
            ("q?x=1.txt", "ironcell://session/s/q%3Fx=1.txt"),
            ("h#frag.txt", "ironcell://session/s/h%23frag.txt"),
            ("a\nb.txt", "ironcell://session/s/a%0Ab.txt"),
            (
                "pct%2F..%2Fetc.txt",
                "ironcell://session/s/pct%252F..%252Fetc.txt",
            ),
            (
                "sub/\u{202e}txt.exe",
                "ironcell://session/s/sub/%E2%80%AEtxt.exe",
            ),
            ("with space.csv", "ironcell://session/s/with%20space.csv"),
        ] {
            assert_eq!(session_uri("s", name), uri);
            assert_eq!(parse_uri(uri), Some(("s".into(), name.into())), "{uri}");
        }
        // Names a client wrote without escaping still read back; a bad escape is no file.
        assert_eq!(
            parse_uri("ironcell://session/s/100%.txt"),
            Some(("s".into(), "100%.txt".into()))
        );
        assert_eq!(parse_uri("ironcell://session/s/%FF.txt"), None);
        assert_eq!(
            parse_uri(&session_uri("a/b", "x")),
            Some(("a/b".into(), "x".into()))
        );
    }

    #[test]
    fn files_inside_are_served() {
        let r = root("in");
        std::fs::write(r.join("sub/a.csv"), "x,y\n").unwrap();
        assert_eq!(read_within(&r, "sub/a.csv").unwrap(), b"x,y\n");
        assert_eq!(
            parse_uri(&session_uri("s1", "sub/a.csv")),
            Some(("s1".into(), "sub/a.csv".into()))
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
