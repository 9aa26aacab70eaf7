//! The runner's and the `mcp` module's compiled code, kept between server starts.
//!
//! Both are embedded in the binary as source; compiling them took ~25 ms of every server's start
//! (~2x a `python3 -c` on a quiet machine). The zygote keeps the code objects it compiled,
//! `marshal`led, in a directory the host names (`<state dir>/code-cache`), and loads them from
//! there at the next start instead (~0.5 ms).
//!
//! A cache file is code the zygote runs, so it is read only when nothing but this user could
//! have written it: the directory and the file owned by the zygote's user, neither writable by
//! group or others, the file opened without following a symlink, a regular file of bounded size.
//! Workers cannot write there (their Landlock grants name their own session directory, never
//! the state dir itself; SECURITY.md #211). Each file is named by a SHA-256 of the source, the
//! interpreter's version and bytecode magic number and the module's name, and carries a SHA-256
//! of its own bytes (a torn or truncated file compiles afresh). Any failure, reading or writing,
//! falls back to compiling from source, as before the cache.

use std::ffi::CStr;
use std::io::{Read, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::Path;

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyModule};
use sha2::{Digest, Sha256};

/// A module's cache files not written for this long are removed when it writes a new one.
const STALE_AFTER: std::time::Duration = std::time::Duration::from_secs(30 * 24 * 3600);

/// A cache file is refused beyond this size (the two modules' code is ~200 KiB together).
const MAX_FILE_BYTES: u64 = 8 << 20;

/// Runs `source` as module `name` (registered in `sys.modules`, `__file__` = `file_name`), as
/// `PyModule::from_code` does, with its code object from `cache_dir` when a valid one is there,
/// else compiled and written there for the next start.
pub(crate) fn module_from_code<'py>(
    py: Python<'py>,
    source: &CStr,
    file_name: &CStr,
    name: &CStr,
    cache_dir: Option<&Path>,
) -> PyResult<Bound<'py, PyModule>> {
    let key = cache_dir.and_then(|dir| {
        let key = cache_key(py, source, name).ok()?;
        Some(dir.join(format!("{}-{key}.marshal", name.to_string_lossy())))
    });
    let cached = key.as_deref().and_then(|path| match load(py, path) {
        Ok(code) => code,
        Err(e) => {
            tracing::debug!(path = %path.display(), error = %e, "compiled code not taken from the cache");
            None
        }
    });
    let code = match cached {
        Some(code) => code,
        None => {
            // SAFETY: both strings are NUL-terminated; the result is checked before use.
            let code = unsafe {
                pyo3::ffi::Py_CompileString(
                    source.as_ptr(),
                    file_name.as_ptr(),
                    pyo3::ffi::Py_file_input,
                )
            };
            // SAFETY: a new reference or NULL with an exception set, as the call documents.
            let code = unsafe { Bound::from_owned_ptr_or_err(py, code)? };
            if let Some(path) = key.as_deref()
                && let Err(e) = store(py, path, &code)
            {
                tracing::debug!(path = %path.display(), error = %e, "compiled code not cached");
            }
            code
        }
    };
    // SAFETY: `code` is a code object (compiled above or checked in `load`), the names
    // NUL-terminated.
    let module = unsafe {
        pyo3::ffi::PyImport_ExecCodeModuleEx(name.as_ptr(), code.as_ptr(), file_name.as_ptr())
    };
    // SAFETY: a new reference or NULL with an exception set, as the call documents.
    let module = unsafe { Bound::from_owned_ptr_or_err(py, module)? };
    Ok(module.cast_into()?)
}

/// SHA-256 of what the compiled code depends on: the source, the module's name, the
/// interpreter's full version, its bytecode magic number and its optimization level.
fn cache_key(py: Python<'_>, source: &CStr, name: &CStr) -> PyResult<String> {
    let sys = py.import("sys")?;
    let version: String = sys.getattr("version")?.extract()?;
    let optimize: i64 = sys.getattr("flags")?.getattr("optimize")?.extract()?;
    let magic: Vec<u8> = py
        .import("importlib.util")?
        .getattr("MAGIC_NUMBER")?
        .extract()?;
    let mut h = Sha256::new();
    for part in [
        source.to_bytes(),
        name.to_bytes(),
        version.as_bytes(),
        &magic,
        &optimize.to_le_bytes(),
    ] {
        h.update((part.len() as u64).to_le_bytes());
        h.update(part);
    }
    Ok(hex(&h.finalize()[..16]))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Owned by this process's user and writable by nobody else.
fn trusted(meta: &std::fs::Metadata) -> bool {
    // SAFETY: geteuid cannot fail.
    meta.uid() == unsafe { libc::geteuid() } && meta.mode() & 0o022 == 0
}

/// The code object in `path`, `None` when there is no such file; an error when one is there
/// but not to be trusted or not intact.
fn load<'py>(py: Python<'py>, path: &Path) -> anyhow::Result<Option<Bound<'py, PyAny>>> {
    let dir = path.parent().unwrap_or(Path::new("/"));
    match std::fs::symlink_metadata(dir) {
        Ok(meta) if meta.is_dir() && trusted(&meta) => {}
        Ok(_) => anyhow::bail!("{} is not a directory of this user's alone", dir.display()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e.into()),
    }
    let file = match std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)
    {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e.into()),
    };
    let meta = file.metadata()?;
    anyhow::ensure!(
        meta.is_file() && trusted(&meta) && meta.len() <= MAX_FILE_BYTES,
        "not a regular file of this user's alone, under {MAX_FILE_BYTES} bytes"
    );
    let mut bytes = Vec::with_capacity(meta.len() as usize);
    file.take(MAX_FILE_BYTES).read_to_end(&mut bytes)?;
    anyhow::ensure!(bytes.len() > 32, "too short");
    let (digest, payload) = bytes.split_at(32);
    anyhow::ensure!(
        Sha256::digest(payload).as_slice() == digest,
        "its checksum does not match"
    );
    let code = py
        .import("marshal")?
        .call_method1("loads", (PyBytes::new(py, payload),))?;
    let code_type = py.import("types")?.getattr("CodeType")?;
    anyhow::ensure!(code.is_instance(&code_type)?, "not a code object");
    Ok(Some(code))
}

/// Writes `code` to `path` (a new file renamed over the old, so a reader never sees half of
/// one), making the directory (0700) if needed and removing the module's cache files older
/// than [`STALE_AFTER`] (another version's; another interpreter's stay while it is used).
fn store(py: Python<'_>, path: &Path, code: &Bound<'_, PyAny>) -> anyhow::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("/"));
    match std::fs::DirBuilder::new().mode(0o700).create(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(e.into()),
    }
    let meta = std::fs::symlink_metadata(dir)?;
    anyhow::ensure!(
        meta.is_dir() && trusted(&meta),
        "{} is not a directory of this user's alone",
        dir.display()
    );
    let payload: Vec<u8> = py
        .import("marshal")?
        .call_method1("dumps", (code,))?
        .extract()?;
    let file_name = path.file_name().and_then(|n| n.to_str()).unwrap_or("code");
    let prefix = file_name.split('-').next().unwrap_or(file_name).to_owned() + "-";
    let tmp = dir.join(format!(".{file_name}.{}.tmp", std::process::id()));
    let written = (|| -> std::io::Result<()> {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&tmp)?;
        f.write_all(&Sha256::digest(&payload))?;
        f.write_all(&payload)?;
        std::fs::rename(&tmp, path)
    })();
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written?;
    for entry in std::fs::read_dir(dir)?.flatten() {
        let n = entry.file_name();
        let n = n.to_string_lossy();
        let stale = entry
            .metadata()
            .and_then(|m| m.modified())
            .is_ok_and(|t| t.elapsed().is_ok_and(|age| age > STALE_AFTER));
        if stale && n.starts_with(&prefix) && n.ends_with(".marshal") && *n != *file_name {
            let _ = std::fs::remove_file(entry.path());
        }
    }
    Ok(())
}
