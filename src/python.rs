//! Which Python runs the code: the user's own interpreter, chosen when ironcell starts.
//!
//! First match wins: `--python` / `IRONCELL_PYTHON` (an interpreter, a venv directory or an
//! environment prefix), `VIRTUAL_ENV`, `CONDA_PREFIX` (set by `conda run` and `conda activate`),
//! `python3` on `PATH`, then the usual system locations. A venv runs as `python` in the venv
//! would (its base interpreter, the venv's site-packages); a conda env or any prefix uses its own
//! stdlib and site-packages. The zygote is exec'd with `-I`, so no user site and no `PYTHON*`
//! variable reaches it.
//!
//! Only file-system facts are checked here (this runs before anything is exec'd, and never runs
//! Python except to see through a launcher script such as a pyenv shim). What the interpreter
//! itself must satisfy — CPython 3.9+, not free-threaded, able to load the extension — is
//! checked by the boot script in the interpreter, which reports a named failure the host passes
//! on (python/_ironcell_boot.py).

use std::fmt;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use serde::Serialize;

/// How the interpreter was chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Source {
    /// `--python` or `IRONCELL_PYTHON`.
    Setting,
    VirtualEnv,
    CondaPrefix,
    Path,
    System,
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Source::Setting => "--python / IRONCELL_PYTHON",
            Source::VirtualEnv => "VIRTUAL_ENV",
            Source::CondaPrefix => "CONDA_PREFIX",
            Source::Path => "python3 on PATH",
            Source::System => "system default",
        })
    }
}

/// What kind of thing the choice named.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    Interpreter,
    Venv,
    Prefix,
}

/// The chosen interpreter: what to exec as the zygote, and why this one.
#[derive(Debug, Clone, Serialize)]
pub struct Interpreter {
    /// What to exec (inside a venv: the venv's `bin/python`, so the venv applies).
    pub executable: PathBuf,
    /// What was given or found, before resolution (a venv dir, a prefix, a path).
    pub given: PathBuf,
    pub source: Source,
    pub kind: Kind,
}

/// Why no usable interpreter could be chosen. Every message names the path and the fix.
#[derive(Debug, Clone, thiserror::Error)]
pub enum PythonError {
    #[error(
        "no Python found: {tried}. Install CPython 3.9 or newer (Debian/Ubuntu: `apt install python3`), or name one with --python PATH / IRONCELL_PYTHON (an interpreter, a venv or a conda env prefix)"
    )]
    NotFound { tried: String },
    #[error(
        "{source_} names {path}, which does not exist. Give an interpreter path, a venv directory or an environment prefix (e.g. --python ~/miniconda3/envs/NAME)"
    )]
    Missing { path: PathBuf, source_: Source },
    #[error(
        "{source_} names the directory {path}, which is neither a venv (no pyvenv.cfg) nor an environment prefix (no bin/python3). Give an interpreter path, a venv made by `python -m venv`, or a conda env prefix"
    )]
    NotAnEnvironment { path: PathBuf, source_: Source },
    #[error(
        "the venv {venv} is broken: its interpreter {link} points to {target}, which is gone (pyvenv.cfg says home = {home}). Recreate it: `python3 -m venv --clear {venv}` (then reinstall its packages), or choose another with --python"
    )]
    VenvBaseGone {
        venv: PathBuf,
        link: PathBuf,
        target: String,
        home: String,
    },
    #[error(
        "{path} is not readable and executable by the user ironcell runs as ({user}): {reason}. Interpreters under another user's home (e.g. pyenv under /root) are private to that user: choose one this user can read with --python, or make it readable (`chmod -R a+rX` on its prefix)"
    )]
    Unreadable {
        path: PathBuf,
        user: String,
        reason: String,
    },
    #[error(
        "{path} is a launcher script and asking it for the real interpreter failed: {reason}. Give the interpreter itself with --python (e.g. the output of `python3 -c 'import sys; print(sys.executable)'`)"
    )]
    Launcher { path: PathBuf, reason: String },
}

/// Where the choice comes from: the setting and the process environment.
pub trait Lookup {
    fn setting(&self) -> Option<PathBuf>;
    fn var(&self, name: &str) -> Option<String>;
}

/// The real process: `--python` from the settings, everything else from the environment.
pub struct ProcessLookup<'a>(pub Option<&'a Path>);

impl Lookup for ProcessLookup<'_> {
    fn setting(&self) -> Option<PathBuf> {
        self.0.map(Path::to_path_buf)
    }
    fn var(&self, name: &str) -> Option<String> {
        std::env::var(name).ok().filter(|v| !v.trim().is_empty())
    }
}

/// Interpreters tried, in order, when nothing names one and `python3` is not on PATH.
const SYSTEM_CANDIDATES: &[&str] = &[
    "/usr/bin/python3",
    "/usr/local/bin/python3",
    "/usr/bin/python3.15",
    "/usr/bin/python3.14",
    "/usr/bin/python3.13",
    "/usr/bin/python3.12",
    "/usr/bin/python3.11",
    "/usr/bin/python3.10",
    "/usr/bin/python3.9",
];

/// Chooses the interpreter (first match wins; see the module docs).
pub fn choose(lookup: &dyn Lookup) -> Result<Interpreter, PythonError> {
    if let Some(p) = lookup.setting() {
        return resolve(setting_path(&p, lookup), Source::Setting);
    }
    if let Some(v) = lookup.var("VIRTUAL_ENV") {
        return resolve(PathBuf::from(v), Source::VirtualEnv);
    }
    if let Some(v) = lookup.var("CONDA_PREFIX") {
        return resolve(PathBuf::from(v), Source::CondaPrefix);
    }
    let mut tried = Vec::new();
    if let Some(found) = lookup.var("PATH").and_then(|p| find_on_path(&p, "python3")) {
        return resolve(found, Source::Path);
    }
    tried.push("python3 on PATH".to_string());
    for candidate in SYSTEM_CANDIDATES {
        let p = Path::new(candidate);
        if p.exists() {
            return resolve(p.to_path_buf(), Source::System);
        }
    }
    tried.push(SYSTEM_CANDIDATES.join(", "));
    Err(PythonError::NotFound {
        tried: format!("looked for {}", tried.join("; then ")),
    })
}

/// `--python` as an absolute path, links kept (a venv's `bin/python` is a link to its base
/// interpreter, and must stay the venv's): `~` expanded, a bare name such as `python3.12` that
/// is not in the current directory found on PATH, anything else taken from the current
/// directory. The zygote runs elsewhere (`/`), and `setup` writes it into a client's config.
pub fn setting_path(p: &Path, lookup: &dyn Lookup) -> PathBuf {
    let p = expand_home(p, lookup);
    if p.is_absolute() {
        return p;
    }
    let bare = p.components().count() == 1 && !p.starts_with(".");
    if bare
        && std::fs::symlink_metadata(&p).is_err()
        && let Some(found) = lookup
            .var("PATH")
            .and_then(|path| find_on_path(&path, &p.to_string_lossy()))
    {
        return found;
    }
    std::path::absolute(&p).unwrap_or(p)
}

/// `~/x` as `$HOME/x`.
pub fn expand_home(p: &Path, lookup: &dyn Lookup) -> PathBuf {
    match (p.strip_prefix("~"), lookup.var("HOME")) {
        (Ok(rest), Some(home)) => Path::new(&home).join(rest),
        _ => p.to_path_buf(),
    }
}

fn find_on_path(path: &str, name: &str) -> Option<PathBuf> {
    std::env::split_paths(path)
        .filter(|d| d.is_absolute())
        .map(|d| d.join(name))
        .find(|p| {
            std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
}

/// Turns what was named into the executable to run, checking what can be checked without
/// running it.
fn resolve(given: PathBuf, source: Source) -> Result<Interpreter, PythonError> {
    let meta = match std::fs::metadata(&given) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => {
            return Err(unreadable(&given, &e.to_string()));
        }
        Err(_) => {
            // A dangling venv interpreter is the common way a venv breaks: say so.
            if let Some(venv) = venv_of_interpreter(&given) {
                return Err(venv_base_gone(&venv, &given));
            }
            return Err(PythonError::Missing {
                path: given,
                source_: source,
            });
        }
    };
    let (executable, kind) = if meta.is_dir() {
        if given.join("pyvenv.cfg").is_file() {
            let exe = ["bin/python3", "bin/python"]
                .iter()
                .map(|n| given.join(n))
                .find(|p| p.symlink_metadata().is_ok())
                .unwrap_or_else(|| given.join("bin/python3"));
            if std::fs::metadata(&exe).is_err() {
                return Err(venv_base_gone(&given, &exe));
            }
            (exe, Kind::Venv)
        } else {
            match ["bin/python3", "bin/python"]
                .iter()
                .map(|n| given.join(n))
                .find(|p| p.is_file())
            {
                Some(exe) => (exe, Kind::Prefix),
                None => {
                    return Err(PythonError::NotAnEnvironment {
                        path: given,
                        source_: source,
                    });
                }
            }
        }
    } else {
        let kind = if venv_of_interpreter(&given).is_some() {
            Kind::Venv
        } else {
            Kind::Interpreter
        };
        (given.clone(), kind)
    };
    check_executable(&executable)?;
    let executable = if is_script(&executable) {
        real_interpreter_behind(&executable)?
    } else {
        executable
    };
    Ok(Interpreter {
        executable,
        given,
        source,
        kind,
    })
}

/// `DIR` when `path` is `DIR/bin/python*` and `DIR/pyvenv.cfg` exists.
fn venv_of_interpreter(path: &Path) -> Option<PathBuf> {
    let bin = path.parent()?;
    let dir = bin.parent()?;
    (bin.file_name()? == "bin" && dir.join("pyvenv.cfg").is_file()).then(|| dir.to_path_buf())
}

fn venv_base_gone(venv: &Path, link: &Path) -> PythonError {
    let home = std::fs::read_to_string(venv.join("pyvenv.cfg"))
        .ok()
        .and_then(|cfg| {
            cfg.lines()
                .filter_map(|l| l.split_once('='))
                .find(|(k, _)| k.trim() == "home")
                .map(|(_, v)| v.trim().to_string())
        })
        .unwrap_or_else(|| "(not set)".into());
    let target = std::fs::read_link(link)
        .map(|t| t.display().to_string())
        .unwrap_or_else(|_| "nothing".into());
    PythonError::VenvBaseGone {
        venv: venv.to_path_buf(),
        link: link.to_path_buf(),
        target,
        home,
    }
}

fn current_user() -> String {
    let uid = nix::unistd::getuid();
    match nix::unistd::User::from_uid(uid) {
        Ok(Some(u)) => format!("{} (uid {uid})", u.name),
        _ => format!("uid {uid}"),
    }
}

fn unreadable(path: &Path, reason: &str) -> PythonError {
    PythonError::Unreadable {
        path: path.to_path_buf(),
        user: current_user(),
        reason: reason.to_string(),
    }
}

/// The user ironcell runs as must be able to execute the interpreter and read what it loads
/// next to it (its prefix's lib/). Checked with the kernel's own rules (`faccessat`).
fn check_executable(exe: &Path) -> Result<(), PythonError> {
    use nix::unistd::{AccessFlags, access};
    let real = std::fs::canonicalize(exe).map_err(|e| unreadable(exe, &e.to_string()))?;
    access(&real, AccessFlags::X_OK | AccessFlags::R_OK)
        .map_err(|e| unreadable(&real, &format!("{} ({e})", real.display())))?;
    if let Some(prefix) = real.parent().and_then(Path::parent) {
        let lib = prefix.join("lib");
        if lib.is_dir() {
            access(&lib, AccessFlags::X_OK | AccessFlags::R_OK)
                .map_err(|e| unreadable(&lib, &format!("{} ({e})", lib.display())))?;
        }
    }
    Ok(())
}

fn is_script(exe: &Path) -> bool {
    use std::io::Read;
    let mut head = [0u8; 2];
    std::fs::File::open(exe)
        .and_then(|mut f| f.read_exact(&mut head))
        .is_ok()
        && head.as_slice() == b"#!"
}

/// A launcher script (a pyenv or asdf shim) picks the interpreter from the user's environment:
/// ask it, with that environment, which executable it runs.
fn real_interpreter_behind(script: &Path) -> Result<PathBuf, PythonError> {
    let out = std::process::Command::new(script)
        .args(["-I", "-c", "import sys; sys.stdout.write(sys.executable)"])
        .stdin(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .output()
        .map_err(|e| PythonError::Launcher {
            path: script.to_path_buf(),
            reason: e.to_string(),
        })?;
    let printed = PathBuf::from(std::ffi::OsStr::from_bytes(out.stdout.trim_ascii()));
    if !out.status.success() || !printed.is_absolute() {
        let stderr = String::from_utf8_lossy(&out.stderr);
        return Err(PythonError::Launcher {
            path: script.to_path_buf(),
            reason: format!(
                "{} {}",
                out.status,
                stderr.lines().last().unwrap_or_default().trim()
            ),
        });
    }
    check_executable(&printed)?;
    Ok(printed)
}

/// The read-only grants the zygote reported, minus anything too broad to grant: the root, or a
/// top-level directory such as `/usr` or `/lib` (the policy names system library directories
/// itself). The zygote is trusted (it has run no user code yet), but a grant of `/` would undo
/// the sandbox, so it is refused here too.
pub fn readable_grants(paths: Vec<PathBuf>) -> Vec<PathBuf> {
    paths
        .into_iter()
        .filter(|p| {
            const BROAD: &[&str] = &[
                "/usr/lib", "/usr/lib64", "/usr/local", "/usr/local/lib", "/usr/share",
                "/usr/bin", "/usr/sbin", "/usr/include", "/opt", "/var/lib", "/etc",
            ];
            let depth = p.components().count();
            let in_home = p.starts_with("/home") || p.starts_with("/root");
            let ok = p.is_absolute()
                && depth >= 3
                && !(in_home && depth < 4)
                && !BROAD.iter().any(|b| p == Path::new(b));
            if !ok {
                tracing::warn!(path = %p.display(), "not granting a top-level directory to workers");
            }
            ok
        })
        .collect()
}

/// Adds the fix to a failure the boot script or the zygote reported.
pub fn explain_boot_failure(python: &Interpreter, message: &str, stderr_tail: &str) -> String {
    let mut text = format!(
        "the Python interpreter {} (chosen by {}) cannot run sessions: {message}",
        python.executable.display(),
        python.source
    );
    if message.contains("undefined symbol") {
        text.push_str(
            ". This interpreter does not export the C API to extension modules (a static build \
             without -export-dynamic). Use a shared build: pyenv: \
             `PYTHON_CONFIGURE_OPTS=--enable-shared pyenv install VERSION`; Debian/Ubuntu: \
             `apt install python3`",
        );
    }
    let tail = stderr_tail.trim();
    if !tail.is_empty() {
        text.push_str(&format!(". Its last words on stderr: {tail}"));
        if tail.contains("Unknown option: -I") {
            // Python 2 (and 3 before 3.4) has no isolated mode.
            text.push_str(
                ". This is Python 2 or an early Python 3: ironcell needs CPython 3.9 or newer; \
                 name one with --python (IRONCELL_PYTHON)",
            );
        }
        if tail.contains("platform independent libraries") || tail.contains("encodings") {
            text.push_str(&format!(
                ". Its standard library is not readable by the user ironcell runs as ({}); choose an interpreter this user can read with --python",
                current_user()
            ));
        }
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Fake {
        setting: Option<PathBuf>,
        vars: Vec<(&'static str, String)>,
    }

    impl Lookup for Fake {
        fn setting(&self) -> Option<PathBuf> {
            self.setting.clone()
        }
        fn var(&self, name: &str) -> Option<String> {
            self.vars
                .iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| v.clone())
        }
    }

    fn fake_prefix(root: &Path) -> PathBuf {
        let bin = root.join("bin");
        std::fs::create_dir_all(&bin).unwrap_or_default();
        // A real ELF interpreter, so no launcher probing happens: link to this test binary.
        let me = std::env::current_exe().unwrap_or_default();
        let _ = std::os::unix::fs::symlink(me, bin.join("python3"));
        root.to_path_buf()
    }

    fn tmp(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("ironcell-python-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap_or_default();
        d
    }

    #[test]
    fn first_match_wins_setting_then_virtual_env_then_conda() {
        let a = fake_prefix(&tmp("a"));
        let b = fake_prefix(&tmp("b"));
        let lookup = Fake {
            setting: None,
            vars: vec![
                ("VIRTUAL_ENV", a.display().to_string()),
                ("CONDA_PREFIX", b.display().to_string()),
            ],
        };
        let chosen = choose(&lookup).map_err(|e| e.to_string());
        assert_eq!(chosen.as_ref().map(|i| i.source), Ok(Source::VirtualEnv));
        let lookup = Fake {
            setting: Some(b.clone()),
            ..lookup
        };
        let chosen = choose(&lookup).map_err(|e| e.to_string());
        assert_eq!(chosen.as_ref().map(|i| i.source), Ok(Source::Setting));
        assert_eq!(
            chosen.map(|i| i.executable),
            Ok(b.join("bin/python3")),
            "a prefix resolves to its bin/python3"
        );
    }

    #[test]
    fn a_relative_setting_becomes_absolute_and_a_bare_name_is_found_on_path() {
        let bin = fake_prefix(&tmp("onpath")).join("bin");
        let lookup = Fake {
            setting: None,
            vars: vec![
                ("PATH", bin.display().to_string()),
                ("HOME", "/home/u".into()),
            ],
        };
        assert_eq!(
            setting_path(Path::new("python3"), &lookup),
            bin.join("python3")
        );
        let cwd = std::env::current_dir().unwrap_or_default();
        assert_eq!(
            setting_path(Path::new("env/bin/python"), &lookup),
            cwd.join("env/bin/python")
        );
        assert_eq!(
            setting_path(Path::new("./python3"), &lookup),
            cwd.join("python3")
        );
        assert_eq!(
            setting_path(Path::new("~/venv"), &lookup),
            Path::new("/home/u/venv")
        );
        // Links are kept: a venv's interpreter must stay the venv's.
        assert_eq!(
            setting_path(&bin.join("python3"), &lookup),
            bin.join("python3")
        );
    }

    #[test]
    fn python_2_is_named_as_too_old() {
        let python = Interpreter {
            executable: PathBuf::from("/usr/bin/python2"),
            given: PathBuf::from("/usr/bin/python2"),
            source: Source::Setting,
            kind: Kind::Interpreter,
        };
        let text = explain_boot_failure(&python, "it exited", "Unknown option: -I\nusage: ...");
        assert!(text.contains("needs CPython 3.9 or newer"), "{text}");
    }

    #[test]
    fn a_broken_venv_names_its_base_and_the_fix() {
        let v = tmp("venv");
        std::fs::create_dir_all(v.join("bin")).unwrap_or_default();
        std::fs::write(v.join("pyvenv.cfg"), "home = /nonexistent/bin\n").unwrap_or_default();
        let _ = std::os::unix::fs::symlink("/nonexistent/bin/python3", v.join("bin/python3"));
        let lookup = Fake {
            setting: Some(v.clone()),
            vars: vec![],
        };
        let err = choose(&lookup).map(|_| ()).unwrap_err().to_string();
        assert!(err.contains("/nonexistent/bin"), "{err}");
        assert!(err.contains("python3 -m venv --clear"), "{err}");
    }

    #[test]
    fn a_directory_that_is_no_environment_is_refused_with_the_fix() {
        let d = tmp("empty");
        let lookup = Fake {
            setting: Some(d),
            vars: vec![],
        };
        let err = choose(&lookup).map(|_| ()).unwrap_err().to_string();
        assert!(err.contains("neither a venv"), "{err}");
    }

    #[test]
    fn grants_never_include_the_root_or_top_level_directories() {
        let kept = readable_grants(vec![
            PathBuf::from("/"),
            PathBuf::from("/usr"),
            PathBuf::from("/usr/lib"),
            PathBuf::from("/home/ann"),
            PathBuf::from("/opt/conda/lib"),
        ]);
        assert_eq!(kept, vec![PathBuf::from("/opt/conda/lib")]);
    }
}
