//! `ironcell setup`: puts ironcell into the config of the user's MCP client, for where it runs.
//!
//! - Linux: Claude Code (`~/.claude.json` for the user scope, `./.mcp.json` for a project; the
//!   equivalent `claude mcp add` line is printed too) and Claude Desktop for Linux
//!   (`~/.config/Claude/claude_desktop_config.json`) where it is installed.
//! - WSL2: the Windows-side Claude Desktop config (`%APPDATA%\Claude\…`, reached under
//!   `/mnt/c`), started with `wsl.exe -d <distro> --exec …`: settings travel as flags, because
//!   the Windows side's `env` does not cross `wsl.exe` unless named in `WSLENV`, and a conda env
//!   is entered by the conda executable's absolute path, because `bash -lc` does not run the
//!   `conda init` block of `.bashrc`.
//! - Docker (macOS): the `docker run -i --rm --init …` entry is printed for Claude Desktop's
//!   config; the user's folders become `-v` mounts plus grants.
//!
//! Files are changed by [`splice`]: only ironcell's entry is replaced or inserted, every other
//! byte stays as it was, and a timestamped backup is left beside the file. `--dry-run` prints
//! the diff; in a terminal the diff is shown and confirmed before writing.

pub mod splice;
mod write;
pub mod wsl;

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context, anyhow, bail};
use clap::{Args, ValueEnum};
use serde_json::{Value, json};

use crate::config::Settings;

/// Which MCP client to configure.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Client {
    /// Claude Code (and the Claude Desktop app's Code tab, which uses Claude Code's servers).
    ClaudeCode,
    /// Claude Desktop: on Linux its own config; under WSL2 the Windows side's.
    ClaudeDesktop,
    /// Print the Docker command line for Claude Desktop on macOS (or any Docker host).
    Docker,
}

/// Claude Code's config scopes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Scope {
    /// `~/.claude.json`: every project of this user.
    User,
    /// `./.mcp.json`: this project only (check it in to share it).
    Project,
}

#[derive(Debug, Clone, Args)]
pub struct SetupArgs {
    /// Client to configure (repeatable): claude-code, claude-desktop, docker. Default: the
    /// clients found here (under WSL2: the Windows side's Claude Desktop).
    #[arg(long = "client", value_enum)]
    pub clients: Vec<Client>,
    /// Claude Code's scope: user (~/.claude.json) or project (./.mcp.json).
    #[arg(long, value_enum, default_value = "user")]
    pub scope: Scope,
    /// Write this config file instead of the client's usual one.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// The name of ironcell's entry in the config.
    #[arg(long, default_value = "ironcell")]
    pub name: String,
    /// Start ironcell inside this conda environment (through the conda executable's absolute
    /// path and `conda run --no-capture-output`, so no `.bashrc` is needed).
    #[arg(long, conflicts_with = "venv", value_name = "NAME")]
    pub conda_env: Option<String>,
    /// Start ironcell with this virtual environment active (VIRTUAL_ENV set, its bin first on
    /// PATH).
    #[arg(long, value_name = "DIR")]
    pub venv: Option<PathBuf>,
    /// WSL2: the distro Windows should start ironcell in (default: this one).
    #[arg(long)]
    pub distro: Option<String>,
    /// WSL2: the Windows user whose Claude Desktop to configure (default: the only one with
    /// Claude, or %USERNAME%).
    #[arg(long)]
    pub windows_user: Option<String>,
    /// Docker: the image to run.
    #[arg(long, default_value = "ironcell")]
    pub image: String,
    /// The ironcell executable the client should start (default: this one; one inside a cargo
    /// build tree is first installed to ~/.local/bin/ironcell, see --no-install).
    #[arg(long, value_name = "PATH")]
    pub ironcell: Option<PathBuf>,
    /// Configure this binary where it is even when it is inside a cargo build tree (`target/`).
    /// Without it, such a binary is copied to ~/.local/bin/ironcell first and that copy is
    /// configured, so the client's config survives `cargo clean`, a rebuild that fails, and a
    /// moved or deleted clone (run setup again after rebuilding to update the copy).
    #[arg(long)]
    pub no_install: bool,
    /// Replace an existing ironcell entry instead of merging with it. By default the settings
    /// an existing entry has and this run does not give (its flags after `serve`, its `env`)
    /// are kept, and named.
    #[arg(long)]
    pub replace: bool,
    /// Show the change as a diff and write nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// Write without asking, even in a terminal.
    #[arg(long, short = 'y')]
    pub yes: bool,
    /// Testing: probe this directory as if it were `/` (a fake `/proc` and `/mnt/c`).
    #[arg(long, hide = true, env = "IRONCELL_PROBE_ROOT")]
    pub probe_root: Option<PathBuf>,
}

/// How the client starts ironcell: a command and its arguments.
#[derive(Debug, Clone)]
struct Launch {
    command: String,
    args: Vec<String>,
}

/// One client config to write (or print).
struct Target {
    label: String,
    path: Option<PathBuf>,
    entry: Value,
    /// What to tell the user after writing: where to look, how to check.
    check: String,
    /// The entry starts the ironcell of this machine (not a Docker image).
    runs_here: bool,
}

/// `ironcell setup`.
pub fn run(args: SetupArgs, settings: &Settings) -> anyhow::Result<ExitCode> {
    let root = args
        .probe_root
        .clone()
        .unwrap_or_else(|| PathBuf::from("/"));
    let wsl = wsl::detect(&root, std::env::var("WSL_DISTRO_NAME").ok());
    let home = std::env::var_os("HOME")
        .filter(|h| !h.is_empty())
        .map(PathBuf::from);
    let mut clients = args.clients.clone();
    if clients.is_empty() {
        clients = found_clients(wsl.is_some(), home.as_deref());
        if clients.is_empty() {
            bail!(
                "found no MCP client to configure here (no Claude Code, no Claude Desktop). Choose one: \
                 `ironcell setup --client claude-code` (writes ~/.claude.json), `--client claude-desktop`, \
                 or `--client docker` (prints the Docker command line for macOS)"
            );
        }
    }
    let settings_flags = explicit_setting_flags(wsl.as_ref())?;
    let (exe, install) = executable(&args, home.as_deref())?;
    let mut targets = Vec::new();
    for client in clients {
        targets.push(target_for(
            client,
            &args,
            settings,
            &settings_flags,
            wsl.as_ref(),
            home.as_deref(),
            &exe,
        )?);
    }
    let interactive = std::io::stdin().is_terminal() && !args.yes && !args.dry_run;
    if let Some(from) = install.filter(|_| targets.iter().any(|t| t.path.is_some() && t.runs_here))
    {
        if args.dry_run {
            println!(
                "dry run: would install {} as {} (the binary the config below starts)\n",
                from.display(),
                exe.display()
            );
        } else {
            install_binary(&from, &exe)?;
            println!(
                "installed {} as {}: the client's config starts that copy, so it survives `cargo clean` and a moved clone. After rebuilding, run setup again to update it (or give --no-install to configure the build's binary itself).\n",
                from.display(),
                exe.display()
            );
        }
    }
    for t in targets {
        write::apply(&t, &args, interactive)?;
    }
    Ok(ExitCode::SUCCESS)
}

/// The ironcell binary the client should start, and the build's binary to install there first
/// if it is to be installed: `--ironcell` as given; else this binary, unless it lives in a
/// cargo build tree (a `target/` dir, marked by cargo's `CACHEDIR.TAG`), which `cargo clean`
/// or a rebuild would take from under the client: then its copy in `~/.local/bin`.
fn executable(args: &SetupArgs, home: Option<&Path>) -> anyhow::Result<(PathBuf, Option<PathBuf>)> {
    if let Some(p) = &args.ironcell {
        let exe =
            std::fs::canonicalize(p).with_context(|| format!("--ironcell {}", p.display()))?;
        return Ok((exe, None));
    }
    let exe = std::env::current_exe().context("finding ironcell's own executable")?;
    if args.no_install || !in_build_tree(&exe) {
        return Ok((exe, None));
    }
    let home = home.ok_or_else(|| {
        anyhow!(
            "HOME is not set, so this build's binary ({}) cannot be installed to ~/.local/bin; give --ironcell PATH (an installed copy) or --no-install",
            exe.display()
        )
    })?;
    Ok((home.join(".local/bin/ironcell"), Some(exe)))
}

/// Whether `exe` is a binary cargo built in place: `<target>/<profile>/ironcell` with cargo's
/// `CACHEDIR.TAG` in `<target>`.
fn in_build_tree(exe: &Path) -> bool {
    exe.parent()
        .and_then(Path::parent)
        .is_some_and(|target| target.join("CACHEDIR.TAG").is_file())
}

/// Copies `from` to `to` (mode 755) through a temporary file and a rename: a client running
/// the old copy keeps it until it restarts.
fn install_binary(from: &Path, to: &Path) -> anyhow::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let dir = to
        .parent()
        .ok_or_else(|| anyhow!("{} has no parent folder", to.display()))?;
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let tmp = dir.join(format!(".ironcell.install-{}", std::process::id()));
    let copied = std::fs::copy(from, &tmp)
        .and_then(|_| std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o755)))
        .and_then(|()| std::fs::rename(&tmp, to));
    if let Err(e) = copied {
        let _ = std::fs::remove_file(&tmp);
        bail!(
            "cannot install {} as {}: {e}. Give --ironcell PATH (an installed copy) or --no-install",
            from.display(),
            to.display()
        );
    }
    Ok(())
}

/// The clients installed here.
fn found_clients(under_wsl: bool, home: Option<&Path>) -> Vec<Client> {
    if under_wsl {
        return vec![Client::ClaudeDesktop];
    }
    let mut out = Vec::new();
    let claude_on_path = std::env::var_os("PATH")
        .is_some_and(|p| std::env::split_paths(&p).any(|d| d.join("claude").is_file()));
    if claude_on_path
        || home.is_some_and(|h| h.join(".claude.json").exists() || h.join(".claude").is_dir())
    {
        out.push(Client::ClaudeCode);
    }
    if linux_claude_desktop_config(home).is_some_and(|p| p.parent().is_some_and(Path::is_dir)) {
        out.push(Client::ClaudeDesktop);
    }
    out
}

fn linux_claude_desktop_config(home: Option<&Path>) -> Option<PathBuf> {
    let base = std::env::var_os("XDG_CONFIG_HOME")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .or_else(|| home.map(|h| h.join(".config")))?;
    Some(base.join("Claude/claude_desktop_config.json"))
}

/// The settings given on this command line (not defaults, not environment), as `serve` flags
/// for the client's command line; paths made absolute (the client starts ironcell elsewhere).
fn explicit_setting_flags(wsl: Option<&wsl::Wsl>) -> anyhow::Result<Vec<(String, String)>> {
    use clap::{CommandFactory, parser::ValueSource};
    let matches = crate::cli::Cli::command()
        .try_get_matches_from(std::env::args_os())
        .context("re-reading the command line")?;
    let Some(("setup", sub)) = matches.subcommand() else {
        return Ok(Vec::new());
    };
    let defs = <Settings as clap::Args>::augment_args(clap::Command::new("settings"));
    let mut out = Vec::new();
    for arg in defs.get_arguments() {
        let id = arg.get_id().as_str();
        let (Some(long), Some(ValueSource::CommandLine)) = (arg.get_long(), sub.value_source(id))
        else {
            continue;
        };
        let Some(raw) = sub.get_raw(id) else { continue };
        for v in raw {
            let v = v.to_string_lossy().into_owned();
            let v = match id {
                "allow_read" | "allow_write" | "state_dir" | "tools" => absolute(&v, wsl)?,
                "python" => {
                    // Checked now, not at the client's next start; links kept (a venv's).
                    use crate::python::{ProcessLookup, choose, setting_path};
                    let p = setting_path(Path::new(&v), &ProcessLookup(None));
                    choose(&ProcessLookup(Some(&p))).with_context(|| format!("--python {v}"))?;
                    p.display().to_string()
                }
                "policy" if v != "default" && v != "strict" => absolute(&v, wsl)?,
                _ => v,
            };
            out.push((long.to_string(), v));
        }
    }
    Ok(out)
}

/// `p` as an absolute path (a Windows path under WSL2 becomes its `/mnt/<drive>` path).
fn absolute(p: &str, wsl: Option<&wsl::Wsl>) -> anyhow::Result<String> {
    if let Some(w) = wsl
        && let Some(linux) = w.linux_path_of(p)
    {
        return Ok(linux.display().to_string());
    }
    let path = Path::new(p);
    let abs = if path.is_absolute() {
        path.to_path_buf()
    } else {
        std::env::current_dir()?.join(path)
    };
    Ok(std::fs::canonicalize(&abs)
        .unwrap_or(abs)
        .display()
        .to_string())
}

/// What `setup` writes for `client`: the file, the entry and the note to show.
///
/// Long on purpose: the client's cases (Docker, WSL, each client's own place and form), each a
/// few lines, in the order they are decided.
fn target_for(
    client: Client,
    args: &SetupArgs,
    settings: &Settings,
    flags: &[(String, String)],
    wsl: Option<&wsl::Wsl>,
    home: Option<&Path>,
    exe: &Path,
) -> anyhow::Result<Target> {
    let check = "Check it: restart the client, then run `ironcell doctor` in a terminal (it shows every sandbox layer and exits non-zero if code would be refused), and read the `system://info` resource in the client (or ask Claude to run `print(6*7)` with ironcell).";
    if client == Client::Docker {
        return Ok(docker_target(args, settings, flags));
    }
    // ironcell runs here: check what the flags name before a client trips over it.
    settings
        .sandbox()
        .context("the settings given to setup do not work here")?;
    let launch = local_launch(args, flags, exe)?;
    match (client, wsl) {
        (Client::ClaudeDesktop, Some(w)) => {
            let distro = args
                .distro
                .clone()
                .or_else(|| w.distro.clone())
                .ok_or_else(|| anyhow!("cannot tell this WSL distro's name ($WSL_DISTRO_NAME is unset); give it with --distro"))?;
            let path = match &args.config {
                Some(p) => p.clone(),
                None => w
                    .claude_desktop_config(args.windows_user.as_deref())
                    .map_err(|e| anyhow!(e))?,
            };
            let mut wsl_args = vec![
                "-d".to_string(),
                distro,
                "--exec".to_string(),
                launch.command,
            ];
            wsl_args.extend(launch.args);
            Ok(Target {
                label: "Claude Desktop on Windows (through WSL2)".into(),
                path: Some(path),
                entry: json!({"command": "wsl.exe", "args": wsl_args}),
                check: format!(
                    "{check} The other servers in this Windows-side config are offered to ironcell's Python too; `ironcell doctor` lists any it cannot start from WSL and why."
                ),
                runs_here: true,
            })
        }
        (Client::ClaudeDesktop, None) => {
            let path = match &args.config {
                Some(p) => p.clone(),
                None => linux_claude_desktop_config(home).ok_or_else(|| {
                    anyhow!("HOME is not set; give the config file with --config")
                })?,
            };
            Ok(Target {
                label: "Claude Desktop (Linux)".into(),
                path: Some(path),
                entry: json!({"command": launch.command, "args": launch.args}),
                check: check.into(),
                runs_here: true,
            })
        }
        (Client::ClaudeCode, _) => {
            let path = match (&args.config, args.scope) {
                (Some(p), _) => p.clone(),
                (None, Scope::Project) => std::env::current_dir()?.join(".mcp.json"),
                (None, Scope::User) => home
                    .ok_or_else(|| anyhow!("HOME is not set; give the config file with --config"))?
                    .join(".claude.json"),
            };
            let scope = match args.scope {
                Scope::User => "user",
                Scope::Project => "project",
            };
            let mut line = vec![
                "claude",
                "mcp",
                "add",
                "--scope",
                scope,
                &args.name,
                "--",
                &launch.command,
            ];
            line.extend(launch.args.iter().map(String::as_str));
            let line: Vec<String> = line.into_iter().map(shell_quote).collect();
            Ok(Target {
                label: format!("Claude Code ({scope} scope)"),
                path: Some(path),
                entry: json!({"type": "stdio", "command": launch.command, "args": launch.args, "env": {}}),
                check: format!(
                    "The same, with Claude Code's own command: {}\nCheck it: `claude mcp list` shows {} as connected; `ironcell doctor` shows every sandbox layer; the `system://info` resource (`@ironcell:system://info` in Claude Code) shows what is in force.",
                    line.join(" "),
                    args.name
                ),
                runs_here: true,
            })
        }
        (Client::Docker, _) => unreachable!("handled above"),
    }
}

/// The command that starts ironcell on this machine: itself, optionally inside a conda env or
/// a venv, with the settings as flags.
fn local_launch(
    args: &SetupArgs,
    flags: &[(String, String)],
    exe: &Path,
) -> anyhow::Result<Launch> {
    let exe = exe.display().to_string();
    let mut serve = vec![exe.clone(), "serve".to_string()];
    for (long, v) in flags {
        serve.push(format!("--{long}"));
        serve.push(v.clone());
    }
    if let Some(env) = &args.conda_env {
        let conda = find_conda().ok_or_else(|| {
            anyhow!("cannot find the conda executable (not in $CONDA_EXE, on PATH, or in ~/miniconda3, ~/miniforge3, ~/anaconda3, /opt/conda); set CONDA_EXE, or use --venv")
        })?;
        let mut a = vec![
            "run".into(),
            "--no-capture-output".into(),
            "-n".into(),
            env.clone(),
        ];
        a.extend(serve);
        return Ok(Launch {
            command: conda.display().to_string(),
            args: a,
        });
    }
    if let Some(venv) = &args.venv {
        let venv =
            std::fs::canonicalize(venv).with_context(|| format!("--venv {}", venv.display()))?;
        if !venv.join("bin/python").exists() {
            bail!(
                "--venv {}: no bin/python there; give the folder made by `python -m venv`",
                venv.display()
            );
        }
        // The venv's bin first, then the PATH setup runs with (the user's shell's: nvm's `npx`,
        // ~/.local/bin, …), which the servers ironcell proxies are started with.
        let bin = venv.join("bin");
        let mut path = vec![bin.clone()];
        let current =
            std::env::var_os("PATH").unwrap_or_else(|| "/usr/local/bin:/usr/bin:/bin".into());
        path.extend(std::env::split_paths(&current).filter(|d| *d != bin));
        let path = std::env::join_paths(path).context("--venv: the PATH to give the client")?;
        let mut a = vec![
            format!("VIRTUAL_ENV={}", venv.display()),
            format!("PATH={}", path.to_string_lossy()),
        ];
        a.extend(serve);
        return Ok(Launch {
            command: "/usr/bin/env".into(),
            args: a,
        });
    }
    let command = serve.remove(0);
    Ok(Launch {
        command,
        args: serve,
    })
}

fn find_conda() -> Option<PathBuf> {
    if let Some(c) = std::env::var_os("CONDA_EXE")
        .map(PathBuf::from)
        .filter(|p| p.is_file())
    {
        return Some(c);
    }
    if let Some(p) = std::env::var_os("PATH")
        && let Some(found) = std::env::split_paths(&p)
            .map(|d| d.join("conda"))
            .find(|c| c.is_file())
    {
        return Some(found);
    }
    let home = std::env::var_os("HOME").map(PathBuf::from)?;
    ["miniconda3", "miniforge3", "mambaforge", "anaconda3"]
        .iter()
        .map(|d| home.join(d).join("bin/conda"))
        .chain([PathBuf::from("/opt/conda/bin/conda")])
        .find(|c| c.is_file())
}

/// The Docker entry: `-i --rm --init`, a read-only (`--allow-read`) or read-write
/// (`--allow-write`) mount per folder of the user's at `/data/<name>`, granted to code there.
fn docker_target(args: &SetupArgs, settings: &Settings, flags: &[(String, String)]) -> Target {
    let mut docker: Vec<String> = ["run", "-i", "--rm", "--init"].map(String::from).to_vec();
    let mut grants = Vec::new();
    let mut used = Vec::new();
    for (dirs, ro, flag) in [
        (&settings.allow_read, true, "--allow-read"),
        (&settings.allow_write, false, "--allow-write"),
    ] {
        for d in dirs {
            let base = d
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_else(|| "folder".into());
            let mut inside = format!("/data/{base}");
            let mut n = 2;
            while used.contains(&inside) {
                inside = format!("/data/{base}-{n}");
                n += 1;
            }
            used.push(inside.clone());
            docker.push("-v".into());
            docker.push(format!(
                "{}:{inside}{}",
                d.display(),
                if ro { ":ro" } else { "" }
            ));
            grants.push(flag.to_string());
            grants.push(inside);
        }
    }
    docker.push(args.image.clone());
    docker.push("serve".into());
    for (long, v) in flags {
        if long != "allow-read" && long != "allow-write" {
            docker.push(format!("--{long}"));
            docker.push(v.clone());
        }
    }
    docker.extend(grants);
    let shown: Vec<String> = std::iter::once("docker".to_string())
        .chain(docker.iter().cloned())
        .map(|a| shell_quote(&a))
        .collect();
    Target {
        label: "Claude Desktop on macOS (Docker)".into(),
        path: args.config.clone(),
        entry: json!({"command": "docker", "args": docker}),
        check: format!(
            "Put the entry above under \"mcpServers\" in ~/Library/Application Support/Claude/claude_desktop_config.json (Claude menu → Settings → Developer → Edit Config).\n\
             First check the container can sandbox: docker run --rm {} doctor\n\
             The command Claude Desktop will run: {}\n\
             Settings reach the container as flags after `serve` (or as `-e NAME=value` before the image; Claude's \"env\" only reaches the docker CLI). Check it worked with the `system://info` resource.",
            shell_quote(&args.image),
            shown.join(" ")
        ),
        runs_here: false,
    }
}

fn shell_quote(s: &str) -> String {
    if !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./:=@%+,".contains(c))
    {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', "'\\''"))
    }
}
