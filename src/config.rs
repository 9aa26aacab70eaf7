//! Settings: command-line flags, each with an environment variable (the bridge's names where the
//! meaning carries over, `IRONCELL_*` otherwise), and the parsers for durations and sizes.

use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::{Args, ValueEnum};

/// How the text block of a result is written for the model. `structuredContent` always carries
/// the full record regardless.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum OutputMode {
    /// Plain text: output, then `=> value`, then any error. Fewest tokens.
    Compact,
    /// Token-Oriented Object Notation of the record.
    Toon,
    /// The record as one JSON object.
    Json,
}

/// Settings shared by `serve`, `exec` and `demo`.
#[derive(Debug, Clone, Args)]
pub struct Settings {
    /// Text format of results: compact, toon or json.
    #[arg(
        long,
        global = true,
        env = "MCP_BRIDGE_OUTPUT_MODE",
        value_enum,
        default_value = "compact",
        ignore_case = true
    )]
    pub output_mode: OutputMode,

    /// Default wall-clock limit of one run (`30`, `30s`, `2m`, `500ms`).
    #[arg(long = "timeout", global = true, env = "MCP_BRIDGE_TIMEOUT", default_value = "30s", value_parser = parse_duration)]
    pub default_timeout: Duration,

    /// Largest timeout a call may ask for; larger requests are clamped and told so.
    #[arg(long = "max-timeout", global = true, env = "MCP_BRIDGE_MAX_TIMEOUT", default_value = "300s", value_parser = parse_duration)]
    pub max_timeout: Duration,

    /// After a timeout or cancel interrupts a run, how long it may take to stop before the
    /// worker is killed (its session's state is then lost).
    #[arg(long, global = true, env = "IRONCELL_INTERRUPT_GRACE", default_value = "2s", value_parser = parse_duration)]
    pub interrupt_grace: Duration,

    /// How long a call waits for its run before answering "still running" with a background
    /// job id (Claude Desktop gives up on a tool call after about 60 s).
    #[arg(long, global = true, env = "IRONCELL_WAIT_BUDGET", default_value = "45s", value_parser = parse_duration)]
    pub wait_budget: Duration,

    /// Most sessions with a live worker at once. A new session past the cap evicts the least
    /// recently used idle one; if all are busy the call is refused.
    #[arg(long, global = true, env = "IRONCELL_MAX_SESSIONS", default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub max_sessions: u32,

    /// Spare workers kept forked and locked down, so a new session starts without waiting for
    /// one (0 disables the pool). Each waiting spare costs a few MiB; they do not count against
    /// IRONCELL_MAX_SESSIONS.
    #[arg(long, global = true, env = "IRONCELL_POOL_SIZE", default_value_t = 2, value_parser = clap::value_parser!(u32).range(0..=64))]
    pub pool_size: u32,

    /// Idle time after which a session's worker and files are discarded.
    #[arg(long, global = true, env = "IRONCELL_SESSION_TTL", default_value = "30m", value_parser = parse_duration)]
    pub session_ttl: Duration,

    /// Largest `code` accepted, in bytes (`1m`, `256k`).
    #[arg(long, global = true, env = "IRONCELL_MAX_CODE", default_value = "1m", value_parser = parse_size)]
    pub max_code_bytes: u64,

    /// Output kept inline in a result (head and tail); the rest is saved to a file.
    #[arg(long, global = true, env = "IRONCELL_INLINE_OUTPUT", default_value = "16k", value_parser = parse_size)]
    pub inline_output_bytes: u64,

    /// Output one run may produce in all; past it the run is stopped ("output limit").
    #[arg(long, global = true, env = "IRONCELL_MAX_OUTPUT", default_value = "32m", value_parser = parse_size)]
    pub max_output_bytes: u64,

    /// `enforce` refuses to run code unless every sandbox layer is in force; `best-effort` runs
    /// with what this kernel supports and says what is missing in every result.
    #[arg(
        long,
        global = true,
        env = "IRONCELL_SANDBOX",
        value_enum,
        default_value = "enforce",
        ignore_case = true
    )]
    pub sandbox: crate::sandbox::SandboxMode,

    /// Sandbox policy: `default`, `strict`, or a path to a policy TOML file.
    #[arg(
        long,
        global = true,
        global = true,
        env = "IRONCELL_POLICY",
        default_value = "default"
    )]
    pub policy: String,

    /// Memory limit per worker (`512m`, `2g`); overrides the policy's `limits.memory_mib`.
    #[arg(long, global = true, env = "MCP_BRIDGE_MEMORY_LIMIT", value_parser = parse_memory_limit)]
    pub memory_limit: Option<u64>,

    /// Use at most this Landlock ABI even if the kernel has a newer one (testing what older
    /// kernels get: 1 = Linux 5.13, 3 = 6.2/WSL2, 4 = 6.7).
    #[arg(long, global = true, env = "IRONCELL_LANDLOCK_ABI_MAX", value_parser = clap::value_parser!(i32).range(0..=7))]
    pub landlock_abi_max: Option<i32>,

    /// Byte budget of each image shown inline (larger ones are downscaled; the full file is
    /// linked as a resource).
    #[arg(long, global = true, env = "IRONCELL_IMAGE_BUDGET", default_value = "256k", value_parser = parse_size)]
    pub image_budget: u64,

    /// The Python that runs the code: an interpreter, a venv directory or an environment prefix
    /// (e.g. `~/miniconda3/envs/data`). Default: `VIRTUAL_ENV`, then `CONDA_PREFIX`, then
    /// `python3` on PATH, then the system's.
    #[arg(long, global = true, env = "IRONCELL_PYTHON", value_name = "PATH")]
    pub python: Option<PathBuf>,

    /// Extra modules the zygote imports once so every session starts with them loaded, e.g.
    /// `numpy,pandas,matplotlib.pyplot` (comma-separated; missing ones are skipped). Faster
    /// first use, at the cost of a larger zygote and slightly slower forks.
    #[arg(long, global = true, env = "IRONCELL_PRELOAD", value_delimiter = ',')]
    pub preload: Vec<String>,

    /// Once matplotlib's shared font cache is built, import matplotlib and pyplot (Agg) into
    /// the zygote, so a new session's first plot costs what a warm one does (`off`: a smaller
    /// zygote, and each session imports matplotlib itself). Nothing happens without matplotlib.
    #[arg(
        long,
        global = true,
        env = "IRONCELL_WARM_PLOTS",
        default_value = "on",
        value_parser = clap::builder::BoolishValueParser::new(),
        action = clap::ArgAction::Set,
        value_name = "on|off",
        hide_possible_values = true
    )]
    pub warm_plots: bool,

    /// With plots warm (IRONCELL_WARM_PLOTS) and the pool on, keep one more spare whose first
    /// plot's pages are already written (~12 MiB of private memory while it waits): a new
    /// session whose first cell plots takes it and does not spend that time itself (`off`:
    /// that session writes them before its first cell).
    #[arg(
        long,
        global = true,
        env = "IRONCELL_PLOT_SPARE",
        default_value = "on",
        value_parser = clap::builder::BoolishValueParser::new(),
        action = clap::ArgAction::Set,
        value_name = "on|off",
        hide_possible_values = true
    )]
    pub plot_spare: bool,

    /// How long a proxied MCP server may take to start and answer `initialize`.
    #[arg(long, global = true, env = "MCP_BRIDGE_STARTUP_TIMEOUT", default_value = "30s", value_parser = parse_duration)]
    pub startup_timeout: Duration,

    /// How long one proxied tool call may take before it fails: it is cancelled (`notifications/cancelled`);
    /// its server is restarted only if it does not answer a ping either.
    #[arg(long, global = true, env = "IRONCELL_CALL_TIMEOUT", default_value = "120s", value_parser = parse_duration)]
    pub call_timeout: Duration,

    /// What to do with proxied calls that need approval (tools annotated `destructiveHint`,
    /// or listed under a server's `confirm`): `ask` the user through the client (refused where
    /// the client cannot ask), `allow` them, or `deny` them.
    #[arg(
        long,
        global = true,
        env = "IRONCELL_APPROVAL",
        value_enum,
        default_value = "ask",
        ignore_case = true
    )]
    pub approval: crate::proxy::rules::ApprovalMode,

    /// `%pip install` in a cell (and `mcp.install`): `ask` the user each time (unless every
    /// package matches --packages-allow), or `off` (refused). The host installs wheels only,
    /// for that session only; the sandbox never gets a network.
    #[arg(
        long,
        global = true,
        env = "IRONCELL_PACKAGES",
        value_enum,
        default_value = "ask",
        ignore_case = true
    )]
    pub packages: crate::packages::PackagesMode,

    /// Packages installed without asking when every one (dependencies included) matches one of
    /// these patterns (`numpy`, `pandas*`; comma-separated).
    #[arg(
        long,
        global = true,
        env = "IRONCELL_PACKAGES_ALLOW",
        value_delimiter = ',',
        value_name = "PATTERN"
    )]
    pub packages_allow: Vec<String>,

    /// Size budget of the package store (`<state dir>/packages`): wheels no live session uses
    /// are removed to make room; `ironcell packages list|prune` show and free it. Counted apart
    /// from the sessions' scratch quota.
    #[arg(long, global = true, env = "IRONCELL_PACKAGES_BUDGET", default_value = "4g", value_parser = parse_size)]
    pub packages_budget: u64,

    /// Free space kept on the disk of the state dir (`256m`; `0` turns the guard off). When free
    /// space falls under it (and again each time it falls a further 64 MiB), the workers that
    /// were running or writing are stopped, which frees what they held (files deleted but kept
    /// open or mapped, which no quota sees; session files are kept); if it is still under 2 s
    /// later, every session's worker is (at most once per 10 minutes). Runs are never refused.
    #[arg(long, global = true, env = "IRONCELL_MIN_FREE_DISK", default_value = "256m", value_parser = parse_size_or_zero)]
    pub min_free_disk_bytes: u64,

    /// Largest audit log before it is rotated (one older file is kept).
    #[arg(long, global = true, env = "IRONCELL_AUDIT_MAX", default_value = "10m", value_parser = parse_size)]
    pub audit_max_bytes: u64,

    /// Accepted for compatibility with the container-based bridge; not applicable here.
    #[arg(long, global = true, env = "MCP_BRIDGE_RUNTIME", hide = true)]
    pub container_runtime: Option<String>,

    /// Accepted for compatibility with the container-based bridge; not applicable here.
    #[arg(long, global = true, env = "MCP_BRIDGE_IMAGE", hide = true)]
    pub container_image: Option<String>,

    /// `/tmp` inside a session: `auto` mounts the session directory over it in a private mount
    /// namespace where the kernel allows; `off` forces the fallback (`/tmp` refused, TMPDIR used).
    #[arg(
        long,
        global = true,
        env = "IRONCELL_PRIVATE_TMP",
        value_enum,
        default_value = "auto",
        ignore_case = true
    )]
    pub private_tmp: crate::sandbox::private_tmp::PrivateTmpMode,

    /// Root workers' thread cap: `auto` puts each in a pids cgroup of its own where the host
    /// has a writable cgroup v1 pids hierarchy; `off` never does (their threads are then not
    /// capped). Workers of a normal user are capped by RLIMIT_NPROC either way.
    #[arg(
        long,
        global = true,
        env = "IRONCELL_CGROUPS",
        value_enum,
        default_value = "auto",
        ignore_case = true
    )]
    pub cgroups: crate::sandbox::CgroupsMode,

    /// Where session scratch directories live (default: $XDG_STATE_HOME/ironcell or
    /// ~/.local/state/ironcell). If it cannot be written, a private directory under
    /// $XDG_RUNTIME_DIR or the temp dir is used instead, with a warning.
    #[arg(long, global = true, env = "MCP_BRIDGE_STATE_DIR")]
    pub state_dir: Option<PathBuf>,

    /// Let code read this folder (or file) of yours. Repeatable; the environment variable takes
    /// a `:`-separated list. Adds to the policy's `filesystem.allow_read`.
    #[arg(
        long = "allow-read",
        global = true,
        env = "IRONCELL_ALLOW_READ",
        value_delimiter = ':',
        value_name = "DIR"
    )]
    pub allow_read: Vec<PathBuf>,

    /// Python tools: a `.py` file or a folder of them whose `@tool` functions (from `mcp import
    /// tool`) become MCP tools, each call run in a sandboxed worker. Repeatable; the
    /// environment variable takes a `:`-separated list.
    #[arg(
        long = "tools",
        global = true,
        env = "IRONCELL_TOOLS",
        value_delimiter = ':',
        value_name = "PATH"
    )]
    pub tools: Vec<PathBuf>,

    /// Let code read and write this folder of yours. Repeatable; the environment variable
    /// takes a `:`-separated list. Adds to the policy's `filesystem.allow_write`.
    #[arg(
        long = "allow-write",
        global = true,
        env = "IRONCELL_ALLOW_WRITE",
        value_delimiter = ':',
        value_name = "DIR"
    )]
    pub allow_write: Vec<PathBuf>,
}

/// The state directory in use, and whether it is the one configured.
#[derive(Debug, Clone, serde::Serialize)]
pub struct StateDir {
    pub path: PathBuf,
    /// The one configured (or the default): `path` unless it was unusable.
    pub wanted: PathBuf,
    /// Set when `path` is the private fallback: `wanted` and why it could not be used.
    pub fallback_because: Option<String>,
}

/// Why no state directory could be used: names every path tried and the fix.
#[derive(Debug, thiserror::Error)]
#[error("no usable state directory: {tried}. Fix: {fix}")]
pub struct StateDirError {
    pub tried: String,
    pub fix: String,
}

impl Settings {
    /// Loads the policy file and probes the kernel: the sandbox this server will apply.
    pub fn sandbox(&self) -> Result<crate::sandbox::Sandbox, crate::sandbox::policy::PolicyError> {
        // A path set in a client's config reaches ironcell with its `~` unexpanded.
        let lookup = crate::python::ProcessLookup(None);
        let policy_path = crate::python::expand_home(Path::new(&self.policy), &lookup);
        let mut policy = crate::sandbox::policy::Policy::load(&policy_path.to_string_lossy())?;
        policy.add_grants(
            &self.allow_read,
            &self.allow_write,
            &[self.resolved_state_dir(), fallback_state_dir()],
        )?;
        let mut sandbox = crate::sandbox::Sandbox::new(
            policy,
            self.sandbox,
            self.landlock_abi_max,
            self.memory_limit,
        );
        sandbox.private_tmp = self.private_tmp;
        // Sessions, plain spares and the plot spare (src/session/pool.rs).
        sandbox.max_workers = u64::from(self.max_sessions) + u64::from(self.pool_size) + 1;
        sandbox.set_cgroups(self.cgroups);
        sandbox.files_in_memory = memory_backed_state_dir(&self.resolved_state_dir()).is_some();
        Ok(sandbox)
    }

    /// The state directory to use, resolved from the flag, XDG, HOME, or /tmp.
    pub fn resolved_state_dir(&self) -> PathBuf {
        if let Some(d) = &self.state_dir {
            return d.clone();
        }
        if let Some(x) = std::env::var_os("XDG_STATE_HOME").filter(|v| !v.is_empty()) {
            return PathBuf::from(x).join("ironcell");
        }
        if let Some(h) = std::env::var_os("HOME").filter(|v| !v.is_empty()) {
            return PathBuf::from(h).join(".local/state/ironcell");
        }
        PathBuf::from(format!("/tmp/ironcell-{}", nix::unistd::getuid()))
    }
}

/// Variables of the container-based bridge that mean nothing here, and why. They are accepted
/// (never a startup error) and reported once in the log and in `system://info`.
const NOT_APPLICABLE: &[(&str, &str)] = &[
    ("MCP_BRIDGE_RUNTIME", "ironcell uses no container runtime"),
    (
        "MCP_BRIDGE_IMAGE",
        "ironcell uses no container image; it embeds the Python it was built for",
    ),
    (
        "MCP_BRIDGE_PIDS",
        "workers cannot start processes at all (seccomp refuses fork and exec)",
    ),
    (
        "MCP_BRIDGE_CPUS",
        "there is no CPU quota; the policy's limits.cpu_seconds bounds CPU time",
    ),
    (
        "MCP_BRIDGE_CONTAINER_USER",
        "workers run as the user that runs ironcell",
    ),
    (
        "MCP_BRIDGE_RUNTIME_IDLE_TIMEOUT",
        "there is no container to stop; idle sessions end after IRONCELL_SESSION_TTL",
    ),
    (
        "MCP_BRIDGE_ALLOW_SELF_SERVER",
        "ironcell never proxies itself",
    ),
    (
        "MCP_BRIDGE_MEMORY",
        "ironcell's memory limit is MCP_BRIDGE_MEMORY_LIMIT (or --memory-limit)",
    ),
];

/// `(variable, value, why it is ignored)` for each bridge variable set that does not apply here.
pub fn not_applicable_variables(s: &Settings) -> Vec<(String, String, String)> {
    NOT_APPLICABLE
        .iter()
        .filter_map(|(name, why)| {
            let value = match *name {
                "MCP_BRIDGE_RUNTIME" => s.container_runtime.clone(),
                "MCP_BRIDGE_IMAGE" => s.container_image.clone(),
                _ => std::env::var(name).ok(),
            }?;
            Some((name.to_string(), value, why.to_string()))
        })
        .collect()
}

/// Logs, once at start, each bridge variable that is set but does not apply here.
pub fn report_not_applicable_variables(s: &Settings) {
    for (name, value, why) in not_applicable_variables(s) {
        tracing::warn!("{name}={value:?} is ignored: {why}");
    }
}

/// Why a state directory at `path` would keep the sessions' files in memory: `Some("tmpfs")`
/// (or `"ramfs"`) when it is on such a file system. Session files there are memory that the
/// memory watch does not count, bounded only by the scratch quota and the file system's size
/// (SECURITY.md #135).
pub fn memory_backed_state_dir(path: &Path) -> Option<&'static str> {
    /// ramfs's magic number (`linux/magic.h`); nix names tmpfs's but not this one.
    const RAMFS_MAGIC: nix::sys::statfs::FsType = nix::sys::statfs::FsType(0x8584_58f6);
    let fs = nix::sys::statfs::statfs(path).ok()?.filesystem_type();
    if fs == nix::sys::statfs::TMPFS_MAGIC {
        Some("tmpfs")
    } else if fs == RAMFS_MAGIC {
        Some("ramfs")
    } else {
        None
    }
}

/// What to tell the operator about a state dir on a memory-backed file system.
pub fn memory_backed_state_dir_warning(path: &Path, fs: &str) -> String {
    format!(
        "the state directory {} is on {fs}: the sessions' files are memory there, which the \
         memory limit does not count (only the scratch quota and the file system's size bound \
         them); set MCP_BRIDGE_STATE_DIR to a directory on a disk (e.g. ~/.local/state/ironcell)",
        path.display()
    )
}

/// The private directory used when the configured state dir cannot be written:
/// `$XDG_RUNTIME_DIR/ironcell`, else `<temp dir>/ironcell-<uid>`.
pub fn fallback_state_dir() -> PathBuf {
    if let Some(x) = std::env::var_os("XDG_RUNTIME_DIR").filter(|v| !v.is_empty()) {
        return PathBuf::from(x).join("ironcell");
    }
    std::env::temp_dir().join(format!("ironcell-{}", nix::unistd::getuid()))
}

impl Settings {
    /// The state directory, created and checked: the configured one if this user can write
    /// it; otherwise a private (mode 700, owned by this user, not a symlink) directory under
    /// `$XDG_RUNTIME_DIR` or the temp dir, with a warning that names the path and the fix.
    pub fn prepare_state_dir(&self) -> Result<PathBuf, StateDirError> {
        self.prepare_state_dir_explained().map(|d| d.path)
    }

    /// [`Settings::prepare_state_dir`], saying whether the directory is the fallback and why
    /// (what `doctor` and `system://info` report).
    pub fn prepare_state_dir_explained(&self) -> Result<StateDir, StateDirError> {
        let wanted = self.resolved_state_dir();
        let mut tried = Vec::new();
        match usable_dir(&wanted, false) {
            Ok(()) => {
                return Ok(StateDir {
                    path: wanted.clone(),
                    wanted,
                    fallback_because: None,
                });
            }
            Err(e) => tried.push(format!("{} ({e})", wanted.display())),
        }
        let fallback = fallback_state_dir();
        let mut candidate = Some(fallback.clone());
        while let Some(dir) = candidate.take() {
            match usable_dir(&dir, true) {
                Ok(()) => {
                    let why = tried.first().cloned().unwrap_or_else(|| "unusable".into());
                    tracing::warn!(
                        "state dir {why}; using the private directory {} instead (session files are lost at reboot). Fix: set MCP_BRIDGE_STATE_DIR to a directory this user can write",
                        dir.display()
                    );
                    return Ok(StateDir {
                        path: dir,
                        wanted,
                        fallback_because: Some(why),
                    });
                }
                Err(e) => tried.push(format!("{} ({e})", dir.display())),
            }
            // Someone else may hold the fixed name (a shared /tmp): then a fresh unique one.
            if dir == fallback
                && let Some(parent) = fallback.parent()
            {
                let template = parent.join(format!("ironcell-{}-XXXXXX", nix::unistd::getuid()));
                candidate = nix::unistd::mkdtemp(&template).ok();
            }
        }
        let user = format!("uid {}", nix::unistd::getuid());
        let fix = if self.state_dir.is_some() {
            format!(
                "make MCP_BRIDGE_STATE_DIR (or --state-dir) a directory this user ({user}) can \
                 write, or unset it"
            )
        } else {
            format!(
                "set MCP_BRIDGE_STATE_DIR (or --state-dir) to a directory this user ({user}) can \
                 write, or make HOME writable"
            )
        };
        Err(StateDirError {
            tried: tried.join("; "),
            fix,
        })
    }
}

/// Creates `dir` if needed and checks that this user can create entries in it. A `private`
/// directory (a fallback in a shared place) must also be a real directory, owned by this user,
/// with no access for others; a fresh one is made with mode 700.
fn usable_dir(dir: &std::path::Path, private: bool) -> Result<(), String> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
    if private {
        match std::fs::DirBuilder::new().mode(0o700).create(dir) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(e.to_string()),
        }
        let meta = std::fs::symlink_metadata(dir).map_err(|e| e.to_string())?;
        if !meta.is_dir() {
            return Err("exists and is not a directory (or is a symlink)".into());
        }
        if meta.uid() != nix::unistd::getuid().as_raw() {
            return Err(format!("is owned by uid {}, not by this user", meta.uid()));
        }
        if meta.mode() & 0o077 != 0 {
            std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
                .map_err(|e| format!("cannot make it private: {e}"))?;
        }
    } else {
        std::fs::create_dir_all(dir).map_err(|e| e.to_string())?;
    }
    // Writable for real (root ignores mode bits; a read-only mount does not).
    let probe = dir.join(format!(".ironcell-probe-{}", std::process::id()));
    std::fs::create_dir(&probe).map_err(|e| format!("cannot create entries: {e}"))?;
    let _ = std::fs::remove_dir(&probe);
    Ok(())
}

/// Parses `30`, `30s`, `1.5s`, `500ms`, `2m`, `1h` (a bare number means seconds).
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let t = s.trim().to_ascii_lowercase();
    let (num, scale) = if let Some(n) = t.strip_suffix("ms") {
        (n, 0.001)
    } else if let Some(n) = t.strip_suffix('s') {
        (n, 1.0)
    } else if let Some(n) = t.strip_suffix('m') {
        (n, 60.0)
    } else if let Some(n) = t.strip_suffix('h') {
        (n, 3600.0)
    } else {
        (t.as_str(), 1.0)
    };
    let v: f64 = num
        .trim()
        .parse()
        .map_err(|_| format!("{s:?} is not a duration (try 30, 30s, 500ms, 2m)"))?;
    if !v.is_finite() || v <= 0.0 || v * scale > 86_400.0 * 7.0 {
        return Err(format!(
            "{s:?} is out of range (more than 0, at most a week)"
        ));
    }
    Ok(Duration::from_secs_f64(v * scale))
}

/// A memory limit: at least what the policy allows (64 MiB; a worker needs ~30 MiB to start
/// Python, and fails at setup below it).
pub fn parse_memory_limit(s: &str) -> Result<u64, String> {
    let v = parse_size(s)?;
    if v < 64 << 20 {
        return Err(format!(
            "{s:?} is too small: a worker needs at least 64m (64 MiB)"
        ));
    }
    Ok(v)
}

/// A size where `0` means "off" (`IRONCELL_MIN_FREE_DISK=0`).
pub fn parse_size_or_zero(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let unit = t.trim_start_matches(|c: char| c.is_ascii_digit() || c == '.');
    if t[..t.len() - unit.len()].parse::<f64>() == Ok(0.0) {
        parse_size(&format!("1{unit}"))?; // the unit must still be one
        return Ok(0);
    }
    parse_size(s)
}

/// Parses `1024`, `512k`, `512m`, `2g` (also `kb`/`mib`/`gib`; binary units).
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim().to_ascii_lowercase();
    let digits_end = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(digits_end);
    let scale: u64 = match unit.trim() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        other => return Err(format!("{s:?}: unknown unit {other:?} (use k, m or g)")),
    };
    let v: f64 = num
        .parse()
        .map_err(|_| format!("{s:?} is not a size (try 512m, 2g)"))?;
    if !v.is_finite() || v <= 0.0 {
        return Err(format!("{s:?} must be more than 0"));
    }
    Ok((v * scale as f64) as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_accept_the_bridge_spellings() {
        assert_eq!(parse_duration("30").unwrap(), Duration::from_secs(30));
        assert_eq!(parse_duration("30s").unwrap(), Duration::from_secs(30));
        assert_eq!(parse_duration("500ms").unwrap(), Duration::from_millis(500));
        assert_eq!(parse_duration("2m").unwrap(), Duration::from_secs(120));
        assert_eq!(
            parse_duration(" 1.5S ").unwrap(),
            Duration::from_millis(1500)
        );
        assert!(parse_duration("0").is_err());
        assert!(parse_duration("soon").is_err());
        assert!(parse_duration("-3s").is_err());
    }

    #[test]
    fn sizes_use_binary_units() {
        assert_eq!(parse_size("512m").unwrap(), 512 << 20);
        assert_eq!(parse_size("2g").unwrap(), 2 << 30);
        assert_eq!(parse_size("16k").unwrap(), 16 << 10);
        assert_eq!(parse_size("100").unwrap(), 100);
        assert!(parse_size("12 parsecs").is_err());
        assert!(parse_size("0").is_err());
        assert_eq!(parse_size_or_zero("0").unwrap(), 0);
        assert_eq!(parse_size_or_zero("0m").unwrap(), 0);
        assert_eq!(parse_size_or_zero("64m").unwrap(), 64 << 20);
        assert!(parse_size_or_zero("0 parsecs").is_err());
        assert!(parse_size_or_zero("").is_err());
    }
}
