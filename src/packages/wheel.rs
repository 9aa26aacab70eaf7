//! Checking and unpacking one wheel, in the host, before any of it can reach a worker.
//!
//! A wheel is a zip file the internet sent: every entry is hostile input. Before anything is
//! written, the whole central directory is read and refused if any entry escapes (`../`, an
//! absolute path, a backslash, an empty or `.` component), is not a plain file or directory (a
//! symlink, a device, a FIFO), is encrypted, appears twice, or the archive would unpack to more
//! than the limits allow (a zip bomb: sizes as declared, and each entry's bytes are cut at its
//! declared size, so a lying header cannot write more). Then every file is decompressed while
//! its hash is computed and checked against the wheel's `RECORD`, which must list every file
//! exactly once with a hash and size that match (a RECORD that lies is refused). Names that
//! would shadow the standard library, `mcp` or ironcell's own modules, and `.pth` files (which
//! run code at start-up in a site directory), are refused. Nothing is ever executed.
//!
//! Files are written with `O_EXCL` into a fresh private staging directory (the caller moves it
//! into the store), mode 0444.

use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::io::{Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use base64::Engine;
use sha2::Digest;

/// Bounds on what one wheel may unpack to.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub max_entries: usize,
    /// Sum of the files' sizes.
    pub max_unpacked_bytes: u64,
    /// Largest size-to-compressed-size ratio of an entry over 1 MiB.
    pub max_ratio: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_entries: 100_000,
            max_unpacked_bytes: 4 << 30,
            max_ratio: 500,
        }
    }
}

/// What a checked wheel unpacked to.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize, PartialEq, Eq)]
pub struct Unpacked {
    /// The distribution's name and version, from its `.dist-info` directory.
    pub name: String,
    pub version: String,
    pub files: usize,
    pub bytes: u64,
    /// Top-level import names it provides (directories and modules at its root).
    pub top_level: Vec<String>,
}

/// Modules no wheel may provide at the top of a session's `sys.path`: ironcell's own and those
/// that change every later import or start-up.
const RESERVED: &[&str] = &[
    "mcp",
    "_ironcell_bridge",
    "_ironcell_runner",
    "_ironcell_boot",
    "ironcell",
    "sitecustomize",
    "usercustomize",
    "__main__",
];

/// Python 3.10's `sys.stdlib_module_names`, for interpreters older than that (3.9), which do
/// not list their own.
pub const STDLIB_FALLBACK: &str = include_str!("stdlib_names.txt");

/// Refuses `wheel` (at `path`) or unpacks it into `dest` (which must not exist yet).
/// `stdlib` names the interpreter's standard modules.
pub fn unpack(
    path: &Path,
    dest: &Path,
    stdlib: &BTreeSet<String>,
    limits: Limits,
) -> Result<Unpacked, String> {
    let file = File::open(path).map_err(|e| format!("opening {}: {e}", path.display()))?;
    let mut zip = zip::ZipArchive::new(std::io::BufReader::new(file))
        .map_err(|e| format!("it is not a readable zip file: {e}"))?;
    let plan = plan(&mut zip, stdlib, limits)?;
    std::fs::create_dir(dest).map_err(|e| format!("creating {}: {e}", dest.display()))?;
    let mut made_dirs = BTreeSet::new();
    let mut bytes = 0u64;
    let mut files = 0usize;
    for entry in &plan.entries {
        let Some(target) = &entry.target else {
            continue;
        };
        if entry.is_dir {
            make_dirs(dest, target, &mut made_dirs)?;
            continue;
        }
        if let Some((parent, _)) = target.rsplit_once('/') {
            make_dirs(dest, parent, &mut made_dirs)?;
        }
        let mut zf = zip
            .by_index(entry.index)
            .map_err(|e| format!("reading {:?}: {e}", entry.name))?;
        let out_path = dest.join(target);
        let mut out = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o444)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&out_path)
            .map_err(|e| format!("writing {target:?}: {e}"))?;
        let digest = copy_hashed(&mut zf, &mut out, entry.size, &entry.name, entry.algorithm)?;
        if let Some(expected) = &entry.digest
            && &digest != expected
        {
            return Err(format!(
                "{:?} does not match the hash its RECORD gives (the wheel's RECORD lies, or the file was changed)",
                entry.name
            ));
        }
        bytes += entry.size;
        files += 1;
    }
    Ok(Unpacked {
        name: plan.name,
        version: plan.version,
        files,
        bytes,
        top_level: plan.top_level.into_iter().collect(),
    })
}

fn make_dirs(dest: &Path, rel: &str, made: &mut BTreeSet<String>) -> Result<(), String> {
    let mut at = String::new();
    for part in rel.split('/') {
        if !at.is_empty() {
            at.push('/');
        }
        at.push_str(part);
        if made.insert(at.clone()) {
            std::fs::create_dir(dest.join(&at)).map_err(|e| format!("creating {at:?}: {e}"))?;
        }
    }
    Ok(())
}

/// Decompresses `from` into `to`, refusing more bytes than `size` (what the entry declared) or
/// fewer; returns the digest of what was written.
fn copy_hashed(
    from: &mut impl Read,
    to: &mut File,
    size: u64,
    name: &str,
    algorithm: Algorithm,
) -> Result<Vec<u8>, String> {
    let mut hasher = Hasher::new(algorithm);
    let mut limited = from.take(size + 1);
    let mut buf = vec![0u8; 64 << 10];
    let mut total = 0u64;
    loop {
        let n = limited
            .read(&mut buf)
            .map_err(|e| format!("decompressing {name:?}: {e}"))?;
        if n == 0 {
            break;
        }
        total += n as u64;
        if total > size {
            return Err(format!(
                "{name:?} unpacks to more bytes than its zip header declares (a zip bomb or a corrupt wheel)"
            ));
        }
        hasher.update(&buf[..n]);
        to.write_all(&buf[..n])
            .map_err(|e| format!("writing {name:?}: {e}"))?;
    }
    if total != size {
        return Err(format!(
            "{name:?} unpacks to {total} bytes, not the {size} its zip header declares"
        ));
    }
    Ok(hasher.finish())
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Algorithm {
    Sha256,
    Sha384,
    Sha512,
}

enum Hasher {
    Sha256(sha2::Sha256),
    Sha384(sha2::Sha384),
    Sha512(sha2::Sha512),
}

impl Hasher {
    fn new(a: Algorithm) -> Hasher {
        match a {
            Algorithm::Sha256 => Hasher::Sha256(sha2::Sha256::new()),
            Algorithm::Sha384 => Hasher::Sha384(sha2::Sha384::new()),
            Algorithm::Sha512 => Hasher::Sha512(sha2::Sha512::new()),
        }
    }
    fn update(&mut self, b: &[u8]) {
        match self {
            Hasher::Sha256(h) => h.update(b),
            Hasher::Sha384(h) => h.update(b),
            Hasher::Sha512(h) => h.update(b),
        }
    }
    fn finish(self) -> Vec<u8> {
        match self {
            Hasher::Sha256(h) => h.finalize().to_vec(),
            Hasher::Sha384(h) => h.finalize().to_vec(),
            Hasher::Sha512(h) => h.finalize().to_vec(),
        }
    }
}

/// One zip entry, checked, and where it goes.
struct Entry {
    index: usize,
    name: String,
    is_dir: bool,
    size: u64,
    /// Relative path under the destination; `None`: not installed (`.data/scripts` etc.).
    target: Option<String>,
    /// From RECORD (`None` only for RECORD itself and its signatures).
    digest: Option<Vec<u8>>,
    algorithm: Algorithm,
}

struct Plan {
    name: String,
    version: String,
    entries: Vec<Entry>,
    top_level: BTreeSet<String>,
}

/// Reads and checks the whole central directory and RECORD; writes nothing.
///
/// Long on purpose: one pass over the entries, then the `.dist-info` and RECORD checks against
/// what that pass saw (names, sizes, directories); each check is a few lines over shared state.
fn plan<R: Read + std::io::Seek>(
    zip: &mut zip::ZipArchive<R>,
    stdlib: &BTreeSet<String>,
    limits: Limits,
) -> Result<Plan, String> {
    if zip.len() > limits.max_entries {
        return Err(format!(
            "it has {} entries, more than the {} a wheel may have here",
            zip.len(),
            limits.max_entries
        ));
    }
    struct Raw {
        index: usize,
        name: String,
        is_dir: bool,
        size: u64,
    }
    let mut raws = Vec::with_capacity(zip.len());
    let mut seen = BTreeSet::new();
    let mut declared = 0u64;
    for index in 0..zip.len() {
        let zf = zip
            .by_index_raw(index)
            .map_err(|e| format!("reading entry {index}: {e}"))?;
        let name = std::str::from_utf8(zf.name_raw())
            .map_err(|_| format!("entry {index} has a name that is not UTF-8"))?
            .to_string();
        let is_dir = name.ends_with('/');
        let clean = name.strip_suffix('/').unwrap_or(&name);
        check_name(clean).map_err(|why| format!("entry {:?} {why}", shown(&name)))?;
        if zf.encrypted() {
            return Err(format!("entry {:?} is encrypted", shown(&name)));
        }
        let kind = zf.unix_mode().map(|m| m & libc::S_IFMT);
        match kind {
            None | Some(0) => {}
            Some(libc::S_IFREG) if !is_dir => {}
            Some(libc::S_IFDIR) if is_dir => {}
            Some(libc::S_IFLNK) => {
                return Err(format!(
                    "entry {:?} is a symbolic link (a wheel may hold only files and directories)",
                    shown(&name)
                ));
            }
            Some(_) => {
                return Err(format!(
                    "entry {:?} is not a plain file or directory (a device, FIFO, socket or hard link)",
                    shown(&name)
                ));
            }
        }
        if zf.is_symlink() {
            return Err(format!("entry {:?} is a symbolic link", shown(&name)));
        }
        if !seen.insert(clean.to_string()) {
            return Err(format!("entry {:?} appears twice", shown(&name)));
        }
        let size = if is_dir { 0 } else { zf.size() };
        if size > (1 << 20) && size / zf.compressed_size().max(1) > limits.max_ratio {
            return Err(format!(
                "entry {:?} is compressed more than {}:1 ({} bytes from {}): refused as a zip bomb",
                shown(&name),
                limits.max_ratio,
                size,
                zf.compressed_size()
            ));
        }
        declared = declared.saturating_add(size);
        if declared > limits.max_unpacked_bytes {
            return Err(format!(
                "it unpacks to more than {} bytes, the package store's whole budget (--packages-budget, IRONCELL_PACKAGES_BUDGET)",
                limits.max_unpacked_bytes
            ));
        }
        raws.push(Raw {
            index,
            name,
            is_dir,
            size,
        });
    }
    // A path that is both a file and a directory's parent.
    for r in raws.iter().filter(|r| !r.is_dir) {
        let prefix = format!("{}/", r.name);
        if raws.iter().any(|o| o.name.starts_with(&prefix)) {
            return Err(format!(
                "entry {:?} is a file and a directory",
                shown(&r.name)
            ));
        }
    }
    // The one .dist-info directory at the root.
    let mut dist_infos: BTreeSet<&str> = raws
        .iter()
        .filter_map(|r| r.name.split('/').next())
        .filter(|top| top.ends_with(".dist-info"))
        .collect();
    let dist_info = match (dist_infos.pop_first(), dist_infos.is_empty()) {
        (Some(d), true) => d.to_string(),
        (None, _) => return Err("it has no .dist-info directory (not a wheel)".into()),
        (Some(_), false) => return Err("it has more than one .dist-info directory".into()),
    };
    let stem = dist_info.trim_end_matches(".dist-info");
    let (name, version) = stem
        .rsplit_once('-')
        .map(|(n, v)| (n.to_string(), v.to_string()))
        .ok_or_else(|| format!("its {dist_info:?} is not named NAME-VERSION.dist-info"))?;
    let data_dir = format!("{stem}.data");
    let record_name = format!("{dist_info}/RECORD");
    let record_index = raws
        .iter()
        .find(|r| r.name == record_name)
        .map(|r| r.index)
        .ok_or_else(|| format!("it has no {record_name}"))?;
    let record_text = {
        let mut zf = zip
            .by_index(record_index)
            .map_err(|e| format!("reading RECORD: {e}"))?;
        let mut text = String::new();
        zf.by_ref()
            .take(32 << 20)
            .read_to_string(&mut text)
            .map_err(|e| format!("reading RECORD: {e}"))?;
        text
    };
    let mut record = parse_record(&record_text)?;
    let mut entries = Vec::with_capacity(raws.len());
    let mut top_level = BTreeSet::new();
    for r in raws {
        let clean = r.name.strip_suffix('/').unwrap_or(&r.name).to_string();
        let unsigned = clean == record_name
            || clean == format!("{dist_info}/RECORD.jws")
            || clean == format!("{dist_info}/RECORD.p7s");
        let (digest, algorithm) = if r.is_dir || unsigned {
            record.remove(&clean);
            (None, Algorithm::Sha256)
        } else {
            match record.remove(&clean) {
                Some((algorithm, digest, size)) => {
                    if size.is_some_and(|s| s != r.size) {
                        return Err(format!(
                            "RECORD gives {:?} a size other than its own (the RECORD lies)",
                            shown(&clean)
                        ));
                    }
                    (Some(digest), algorithm)
                }
                None => {
                    return Err(format!(
                        "{:?} is not listed with a hash in the wheel's RECORD",
                        shown(&clean)
                    ));
                }
            }
        };
        let target = install_path(&clean, &data_dir);
        if let Some(t) = &target {
            if t.rsplit('/').next().is_some_and(|f| f.ends_with(".pth")) {
                return Err(format!(
                    "it contains the .pth file {:?}: such files run code whenever Python starts, and are refused",
                    shown(t)
                ));
            }
            let top = t.split('/').next().unwrap_or(t);
            if !top.ends_with(".dist-info") && top != "__pycache__" {
                let module = top.split('.').next().unwrap_or(top);
                if module.is_empty() {
                    return Err(format!("{:?} is not an importable name", shown(t)));
                }
                if stdlib.contains(module) || RESERVED.contains(&module) {
                    return Err(format!(
                        "it provides the module {module:?}, which would shadow {} in the session",
                        if RESERVED.contains(&module) {
                            "ironcell's own module or Python's start-up"
                        } else {
                            "the standard library's module of that name"
                        }
                    ));
                }
                top_level.insert(module.to_string());
            }
        }
        entries.push(Entry {
            index: r.index,
            name: clean,
            is_dir: r.is_dir,
            size: r.size,
            target,
            digest,
            algorithm,
        });
    }
    if let Some(missing) = record.keys().next() {
        return Err(format!(
            "its RECORD lists {:?}, which the wheel does not contain (the RECORD lies)",
            shown(missing)
        ));
    }
    Ok(Plan {
        name,
        version,
        entries,
        top_level,
    })
}

/// Where an archive path is installed: the root as is, `.data/purelib|platlib/` at the root,
/// the rest of `.data/` (scripts, headers, data) not at all.
fn install_path(path: &str, data_dir: &str) -> Option<String> {
    match path.strip_prefix(data_dir) {
        None => Some(path.to_string()),
        Some("") => None,
        Some(rest) => {
            let rest = rest.strip_prefix('/')?;
            let (scheme, inner) = rest.split_once('/')?;
            matches!(scheme, "purelib" | "platlib").then(|| inner.to_string())
        }
    }
}

/// An archive path that stays beneath the destination: relative, `/`-separated, no empty,
/// `.` or `..` component, no backslash, no control character, of a sane length.
fn check_name(name: &str) -> Result<(), &'static str> {
    if name.is_empty() || name.len() > 1024 {
        return Err("has an empty or over-long name");
    }
    if name.starts_with('/') {
        return Err("has an absolute path");
    }
    if name.contains('\\') {
        return Err("has a backslash in its name");
    }
    if name.chars().any(char::is_control) {
        return Err("has a control character in its name");
    }
    for part in name.split('/') {
        match part {
            "" | "." => return Err("has an empty or `.` path component"),
            ".." => return Err("escapes the directory it is unpacked in (`..`)"),
            p if p.len() > 255 => return Err("has a path component over 255 bytes"),
            _ => {}
        }
    }
    Ok(())
}

/// RECORD: `path,algorithm=urlsafe-base64-digest,size` per line (CSV).
type Record = BTreeMap<String, (Algorithm, Vec<u8>, Option<u64>)>;

fn parse_record(text: &str) -> Result<Record, String> {
    let mut out = BTreeMap::new();
    for (n, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let fields = csv_fields(line).ok_or_else(|| format!("RECORD line {} is not CSV", n + 1))?;
        let [path, hash, size] = fields.as_slice() else {
            return Err(format!("RECORD line {} does not have 3 fields", n + 1));
        };
        if hash.is_empty() {
            // Only RECORD itself (and its signatures) may have no hash; checked by the caller,
            // which finds such an entry missing from this map.
            continue;
        }
        let (alg, b64) = hash
            .split_once('=')
            .ok_or_else(|| format!("RECORD line {} has an unreadable hash", n + 1))?;
        let algorithm = match alg {
            "sha256" => Algorithm::Sha256,
            "sha384" => Algorithm::Sha384,
            "sha512" => Algorithm::Sha512,
            other => {
                return Err(format!(
                    "RECORD uses the hash {:?}; only sha256, sha384 and sha512 are accepted",
                    shown(other)
                ));
            }
        };
        let digest = base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(b64.trim_end_matches('='))
            .map_err(|_| format!("RECORD line {} has an unreadable hash", n + 1))?;
        let size = if size.is_empty() {
            None
        } else {
            Some(
                size.parse::<u64>()
                    .map_err(|_| format!("RECORD line {} has an unreadable size", n + 1))?,
            )
        };
        if out
            .insert(path.clone(), (algorithm, digest, size))
            .is_some()
        {
            return Err(format!("RECORD lists {:?} twice", shown(path)));
        }
    }
    Ok(out)
}

/// The fields of one CSV line (RFC 4180 quoting).
fn csv_fields(line: &str) -> Option<Vec<String>> {
    let mut out = Vec::new();
    let mut field = String::new();
    let mut chars = line.chars().peekable();
    let mut quoted = false;
    let mut at_start = true;
    while let Some(c) = chars.next() {
        match (quoted, c) {
            (false, '"') if at_start => quoted = true,
            (true, '"') if chars.peek() == Some(&'"') => {
                chars.next();
                field.push('"');
            }
            (true, '"') => quoted = false,
            (false, ',') => {
                out.push(std::mem::take(&mut field));
                at_start = true;
                continue;
            }
            (_, c) => field.push(c),
        }
        at_start = false;
    }
    if quoted {
        return None;
    }
    out.push(field);
    Some(out)
}

/// Text from a wheel as it may be shown: escaped, and cut.
fn shown(s: &str) -> String {
    crate::clip_chars(&crate::proxy::approval::escaped_text(s), 200)
}

/// The SHA-256 of a file, hex.
pub fn file_sha256(path: &Path) -> Result<String, String> {
    let mut f = File::open(path).map_err(|e| format!("opening {}: {e}", path.display()))?;
    let mut h = sha2::Sha256::new();
    let mut buf = vec![0u8; 256 << 10];
    loop {
        let n = f
            .read(&mut buf)
            .map_err(|e| format!("reading {}: {e}", path.display()))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(hex(&h.finalize()))
}

pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use zip::write::SimpleFileOptions;

    fn digest(data: &[u8]) -> String {
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(sha2::Sha256::digest(data))
    }

    /// A wheel of `files` (path, bytes), with a RECORD that tells the truth unless `record` is
    /// given.
    fn wheel(dir: &Path, files: &[(&str, &[u8])], record: Option<String>) -> std::path::PathBuf {
        let path = dir.join("demo-1.0-py3-none-any.whl");
        let mut w = zip::ZipWriter::new(File::create(&path).unwrap_or_else(|e| panic!("{e}")));
        let opts = SimpleFileOptions::default();
        let mut rec = String::new();
        let mut all: Vec<(&str, &[u8])> = files.to_vec();
        all.push(("demo-1.0.dist-info/METADATA", b"Name: demo\nVersion: 1.0\n"));
        for (p, data) in &all {
            w.start_file(*p, opts).unwrap_or_else(|e| panic!("{e}"));
            w.write_all(data).unwrap_or_else(|e| panic!("{e}"));
            rec.push_str(&format!("{p},sha256={},{}\n", digest(data), data.len()));
        }
        rec.push_str("demo-1.0.dist-info/RECORD,,\n");
        w.start_file("demo-1.0.dist-info/RECORD", opts)
            .unwrap_or_else(|e| panic!("{e}"));
        w.write_all(record.unwrap_or(rec).as_bytes())
            .unwrap_or_else(|e| panic!("{e}"));
        w.finish().unwrap_or_else(|e| panic!("{e}"));
        path
    }

    fn stdlib() -> BTreeSet<String> {
        STDLIB_FALLBACK
            .split_whitespace()
            .map(str::to_string)
            .collect()
    }

    fn try_unpack(files: &[(&str, &[u8])], record: Option<String>) -> Result<Unpacked, String> {
        let dir = std::env::temp_dir().join(format!(
            "ironcell-wheel-test-{}-{}",
            std::process::id(),
            rand_suffix()
        ));
        std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{e}"));
        let w = wheel(&dir, files, record);
        let out = unpack(&w, &dir.join("out"), &stdlib(), Limits::default());
        let _ = std::process::Command::new("chmod")
            .args(["-R", "u+w"])
            .arg(&dir)
            .status();
        let _ = std::fs::remove_dir_all(&dir);
        out
    }

    fn rand_suffix() -> u64 {
        use std::sync::atomic::{AtomicU64, Ordering};
        static N: AtomicU64 = AtomicU64::new(0);
        N.fetch_add(1, Ordering::Relaxed)
    }

    #[test]
    fn a_good_wheel_unpacks_with_its_names() {
        let u = try_unpack(
            &[
                ("demo/__init__.py", b"x = 1\n"),
                ("demo_ext.cpython-311-x86_64-linux-gnu.so", b"\x7fELF"),
                ("demo-1.0.data/purelib/extra.py", b"y = 2\n"),
                ("demo-1.0.data/scripts/demo", b"#!python\n"),
            ],
            None,
        )
        .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!((u.name.as_str(), u.version.as_str()), ("demo", "1.0"));
        assert_eq!(u.top_level, vec!["demo", "demo_ext", "extra"]);
        // METADATA, demo/__init__.py, the .so, extra.py and RECORD; not the script.
        assert_eq!(u.files, 5);
    }

    #[test]
    fn escaping_names_are_refused() {
        for bad in [
            "../evil.py",
            "/etc/evil.py",
            "demo/../../x.py",
            "a\\b.py",
            "a//b.py",
        ] {
            let e = try_unpack(&[(bad, b"x")], None).err();
            assert!(e.is_some(), "{bad} was accepted");
        }
    }

    #[test]
    fn shadowing_names_and_pth_files_are_refused() {
        for (bad, why) in [
            ("os.py", "standard library"),
            ("json/__init__.py", "standard library"),
            ("mcp/__init__.py", "ironcell"),
            ("sitecustomize.py", "start-up"),
            ("evil.pth", ".pth"),
        ] {
            let e = try_unpack(&[(bad, b"x")], None).err().unwrap_or_default();
            assert!(e.contains(why), "{bad}: {e}");
        }
    }

    #[test]
    fn a_record_that_lies_is_refused() {
        let lie = format!(
            "demo/__init__.py,sha256={},6\ndemo-1.0.dist-info/METADATA,sha256={},24\ndemo-1.0.dist-info/RECORD,,\n",
            digest(b"other\n"),
            digest(b"Name: demo\nVersion: 1.0\n")
        );
        let e = try_unpack(&[("demo/__init__.py", b"x = 1\n")], Some(lie))
            .err()
            .unwrap_or_default();
        assert!(e.contains("RECORD"), "{e}");
        // A file missing from RECORD.
        let partial = format!(
            "demo-1.0.dist-info/METADATA,sha256={},24\ndemo-1.0.dist-info/RECORD,,\n",
            digest(b"Name: demo\nVersion: 1.0\n")
        );
        let e = try_unpack(&[("demo/__init__.py", b"x = 1\n")], Some(partial))
            .err()
            .unwrap_or_default();
        assert!(e.contains("not listed"), "{e}");
        // RECORD naming a file the wheel lacks.
        let extra = format!(
            "ghost.py,sha256={},1\ndemo-1.0.dist-info/METADATA,sha256={},24\ndemo-1.0.dist-info/RECORD,,\n",
            digest(b"x"),
            digest(b"Name: demo\nVersion: 1.0\n")
        );
        let e = try_unpack(&[], Some(extra)).err().unwrap_or_default();
        assert!(e.contains("does not contain"), "{e}");
    }

    #[test]
    fn record_csv_quoting() {
        assert_eq!(
            csv_fields(r#""a,b.py",sha256=x,3"#),
            Some(vec!["a,b.py".into(), "sha256=x".into(), "3".into()])
        );
        assert_eq!(csv_fields(r#""open"#), None);
    }
}
