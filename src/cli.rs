//! The command line. `serve` is the default; `exec` and `demo` are for people trying it out.

use std::io::Read;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand};
use tokio_util::sync::CancellationToken;

use crate::config::Settings;
use crate::server::IroncellServer;
use crate::session::{RunRequest, SessionManager};

/// ironcell: run Python for an AI client, in persistent sandboxed sessions, over MCP (stdio).
///
/// Without a subcommand it serves MCP on stdin/stdout, which is what an MCP client such as
/// Claude Desktop starts it for. Logs go to stderr (MCP_BRIDGE_LOG_LEVEL or RUST_LOG).
#[derive(Debug, Parser)]
#[command(name = "ironcell", version, propagate_version = true)]
pub struct Cli {
    #[command(subcommand)]
    command: Option<Command>,

    #[command(flatten)]
    settings: Settings,

    /// Log level for stderr: error, warn, info, debug, trace.
    #[arg(
        long,
        global = true,
        env = "MCP_BRIDGE_LOG_LEVEL",
        default_value = "warn"
    )]
    log_level: String,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Serve MCP on stdin/stdout (the default). Configure your MCP client to start this.
    /// With `--http ADDR:PORT`: serve MCP Streamable HTTP at `/mcp` for a team, each principal
    /// (bearer token) with sessions of its own.
    Serve(Box<crate::http::ServeArgs>),
    /// Run Python once in a fresh worker and print the result, e.g. `ironcell exec 'print(6*7)'`.
    /// Reads the code from stdin when CODE is `-`. Exits 1 if the code failed.
    Exec {
        /// Python source, or `-` to read it from stdin.
        code: String,
    },
    /// Start ironcell as an MCP server, connect to it as a client, and show a short scripted
    /// session: output, state that persists, an error, a timeout, and what the server reports.
    Demo,
    /// Show, layer by layer, what the sandbox enforces on this host, and prove it by locking
    /// down a test worker. Exits non-zero if `serve` would refuse to run code.
    Doctor,
    /// Show the audit trail: one line per run (session, status, proxied calls, code), newest
    /// last, from `<state dir>/audit.jsonl`.
    Audit {
        /// Only runs of this session.
        #[arg(long)]
        session: Option<String>,
        /// Only runs since this time: RFC 3339 (2026-11-30T18:00:00Z) or a duration ago (2h, 1d).
        #[arg(long, value_parser = crate::audit::parse_since)]
        since: Option<chrono::DateTime<chrono::Utc>>,
        /// Print the entries as JSON lines instead of a table.
        #[arg(long)]
        json: bool,
        /// The audit of this principal of `serve --http` (its own file, in its directory).
        #[arg(long)]
        principal: Option<String>,
    },
    /// Write (or merge into) the config of your MCP client so it starts ironcell: Claude Code,
    /// Claude Desktop on Linux, Claude Desktop on Windows through WSL2, or print the Docker
    /// command line (macOS). Settings given here (`--allow-read DIR`, `--timeout 60s`, ...) are
    /// passed on as flags. `--dry-run` shows the change as a diff.
    Setup(Box<crate::setup::SetupArgs>),
    /// The sandbox policy: `ironcell policy show` prints the effective policy (the policy file
    /// merged over its base, plus `--allow-read`/`--allow-write` grants).
    Policy {
        #[command(subcommand)]
        action: PolicyAction,
    },
    /// The tools sessions saved with `save_tool`: `ironcell saved-tools list` shows each with
    /// the session that owns it; `ironcell saved-tools delete NAME` removes one whatever its
    /// owner (a session may only replace or delete its own).
    SavedTools {
        #[command(subcommand)]
        action: crate::local_tools::SavedToolsAction,
    },
    /// The store of wheels installed by `%pip install` in sessions: `ironcell packages list`
    /// shows each with its size and whether a live session uses it; `ironcell packages prune`
    /// removes those none uses.
    Packages {
        #[command(subcommand)]
        action: crate::packages::PackagesAction,
    },
}

#[derive(Debug, Subcommand)]
enum PolicyAction {
    /// Print the effective policy as a policy file.
    Show,
}

/// The environment variable a refused value was read from, when it was not given as a flag:
/// clap's message names only the flag (`--cgroups`), which the user never typed.
fn env_var_behind(e: &clap::Error) -> Option<String> {
    use clap::CommandFactory;
    use clap::error::{ContextKind, ContextValue, ErrorKind};
    if !matches!(
        e.kind(),
        ErrorKind::InvalidValue | ErrorKind::ValueValidation
    ) {
        return None;
    }
    let Some(ContextValue::String(arg)) = e.get(ContextKind::InvalidArg) else {
        return None;
    };
    let long = arg.split_whitespace().next()?.strip_prefix("--")?;
    let given = std::env::args_os()
        .filter_map(|a| a.into_string().ok())
        .any(|a| a == format!("--{long}") || a.starts_with(&format!("--{long}=")));
    if given {
        return None;
    }
    let cmd = Cli::command();
    let var = cmd
        .get_arguments()
        .find(|a| a.get_long() == Some(long))?
        .get_env()?;
    std::env::var_os(var).map(|_| var.to_string_lossy().into_owned())
}

/// The host holds ~6 descriptors per session (its socket, pidfd, output pipes' read ends, ...),
/// so the usual soft limit of 1,024 runs out at ~160 sessions of the 4,096 `--max-sessions`
/// allows: the soft limit goes up to the hard one, as Go's runtime does, but not past 65,536
/// (on kernels before 5.9 a worker closes its inherited descriptors one by one up to it).
/// Workers set their own limits in their lockdown.
fn raise_open_file_limit() {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    if let Ok((soft, hard)) = getrlimit(Resource::RLIMIT_NOFILE) {
        let wanted = hard.min(1 << 16);
        if soft < wanted
            && let Err(e) = setrlimit(Resource::RLIMIT_NOFILE, wanted, hard)
        {
            tracing::debug!(error = %e, soft, "the open-file limit stays");
        }
    }
}

/// Parses the command line and runs the chosen command.
///
/// Long on purpose: one short arm per subcommand.
pub fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            let var = env_var_behind(&e);
            let _ = e.print();
            if let Some(var) = var {
                eprintln!(
                    "The value comes from the environment variable {var}: fix or unset it where \
                     ironcell is started (your MCP client's config, or the shell)."
                );
            }
            return ExitCode::from(u8::try_from(e.exit_code()).unwrap_or(2));
        }
    };
    init_logging(&cli.log_level);
    if matches!(
        cli.command,
        Some(
            Command::Audit { .. }
                | Command::Setup(_)
                | Command::Policy { .. }
                | Command::Packages { .. }
        )
    ) {
        // Printing commands end quietly when their reader does (`ironcell audit | head`),
        // as other command-line tools do, rather than panic on EPIPE. Not `serve`: its
        // stdout is the MCP stream, and a client gone is handled (workers stopped) there.
        // SAFETY: at start, before any thread; restores the default disposition.
        unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    }
    raise_open_file_limit();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("ironcell: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let outcome = runtime.block_on(async move {
        match cli.command {
            None => serve(cli.settings).await.map(|_| ExitCode::SUCCESS),
            Some(Command::Serve(args)) if args.http.is_some() => {
                crate::http::serve(cli.settings, *args, own_executable()?)
                    .await
                    .map(|_| ExitCode::SUCCESS)
            }
            Some(Command::Serve(args)) => match crate::http::check_stdio_flags(&args) {
                Ok(()) => serve(cli.settings).await.map(|_| ExitCode::SUCCESS),
                Err(e) => Err(e),
            },
            Some(Command::Exec { code }) => exec(cli.settings, code).await,
            Some(Command::Demo) => crate::demo::run(cli.settings)
                .await
                .map(|_| ExitCode::SUCCESS),
            Some(Command::Doctor) => crate::doctor::run(cli.settings).await,
            Some(Command::Audit {
                session,
                since,
                json,
                principal,
            }) => {
                // The same directory `serve` writes to, fallback included.
                let mut dir = cli
                    .settings
                    .prepare_state_dir()
                    .unwrap_or_else(|_| cli.settings.resolved_state_dir());
                if let Some(p) = principal {
                    dir = crate::http::principals::principal_dir(&dir, &p);
                }
                let log = crate::audit::AuditLog::new(&dir, cli.settings.audit_max_bytes);
                print!(
                    "{}",
                    crate::audit::render(&log, session.as_deref(), since, json)
                );
                Ok(ExitCode::SUCCESS)
            }
            Some(Command::SavedTools { action }) => {
                let dir = cli
                    .settings
                    .prepare_state_dir()
                    .unwrap_or_else(|_| cli.settings.resolved_state_dir());
                match crate::local_tools::saved_tools_command(&dir, &action) {
                    Ok(text) => {
                        print!("{text}");
                        Ok(ExitCode::SUCCESS)
                    }
                    Err(e) => {
                        eprintln!("ironcell: {e}");
                        Ok(ExitCode::FAILURE)
                    }
                }
            }
            Some(Command::Packages { action }) => {
                let dir = cli
                    .settings
                    .prepare_state_dir()
                    .unwrap_or_else(|_| cli.settings.resolved_state_dir());
                print!(
                    "{}",
                    crate::packages::packages_command(&dir, cli.settings.packages_budget, &action)
                );
                Ok(ExitCode::SUCCESS)
            }
            Some(Command::Setup(args)) => crate::setup::run(*args, &cli.settings),
            Some(Command::Policy {
                action: PolicyAction::Show,
            }) => show_policy(&cli.settings),
        }
    });
    // Don't wait for the blocking stdin reader thread: exit now that the work is done.
    runtime.shutdown_background();
    match outcome {
        Ok(code) => code,
        Err(e) => {
            eprintln!("ironcell: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// The log filter in force, which the zygote (a separate process with a cleared environment)
/// is given too.
static LOG_FILTER: std::sync::OnceLock<String> = std::sync::OnceLock::new();

pub(crate) fn log_filter() -> String {
    LOG_FILTER
        .get()
        .cloned()
        .unwrap_or_else(|| "ironcell=info".into())
}

fn init_logging(level: &str) {
    let filter = std::env::var("RUST_LOG")
        .ok()
        .unwrap_or_else(|| format!("ironcell={level},rmcp=warn"));
    let _ = LOG_FILTER.set(filter.clone());
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .try_init();
}

fn own_executable() -> anyhow::Result<PathBuf> {
    std::env::current_exe().context("finding ironcell's own executable")
}

/// `ironcell serve`: MCP on stdio until the client closes stdin or sends SIGTERM.
pub async fn serve(settings: Settings) -> anyhow::Result<()> {
    use rmcp::ServiceExt;
    use tokio::signal::unix::{SignalKind, signal};

    // One line carries one request: room for the largest `code` after JSON escaping.
    let max_line = usize::try_from(settings.max_code_bytes.saturating_mul(8))
        .unwrap_or(usize::MAX)
        .max(crate::stdio::DEFAULT_MAX_LINE_BYTES);
    let sessions = match SessionManager::start(settings, own_executable()?) {
        Ok(s) => s,
        Err(e) => return answer_requests_with_startup_error(e).await,
    };
    sessions.start_background_work();
    let server = IroncellServer::new(sessions.clone());
    let mut sigterm = signal(SignalKind::terminate())?;
    let mut sigint = signal(SignalKind::interrupt())?;
    let outcome = async {
        let (stdin, stdout) = crate::stdio::std_streams();
        let warm = sessions.clone();
        let transport = crate::stdio::StdioTransport::new(stdin, stdout, max_line)
            .with_line_hook(Box::new(move |line| warm.warm_for_request(line)));
        let running = server.serve(transport).await.context("MCP handshake")?;
        tokio::select! {
            quit = running.waiting() => { tracing::info!(?quit, "client disconnected"); }
            _ = sigterm.recv() => tracing::info!("SIGTERM: shutting down"),
            _ = sigint.recv() => tracing::info!("SIGINT: shutting down"),
        }
        anyhow::Ok(())
    }
    .await;
    sessions.shutdown().await;
    outcome
}

/// `ironcell exec`: one cell in a fresh worker, the result printed as the model would see it.
async fn exec(settings: Settings, code: String) -> anyhow::Result<ExitCode> {
    let code = if code == "-" {
        let mut s = String::new();
        std::io::stdin()
            .read_to_string(&mut s)
            .context("reading code from stdin")?;
        s
    } else {
        code
    };
    let mode = settings.output_mode;
    let sessions = SessionManager::start(settings, own_executable()?)?;
    let request = RunRequest {
        code,
        session: "exec".into(),
        timeout: None,
        reset: false,
        servers: Vec::new(),
        progress: None,
        fork_from: None,
    };
    let outcome = sessions.run(request, CancellationToken::new()).await;
    sessions.shutdown().await;
    match outcome {
        Ok(record) => {
            println!("{}", record.render(mode));
            Ok(if record.is_error() {
                ExitCode::FAILURE
            } else {
                ExitCode::SUCCESS
            })
        }
        Err(refusal) => Err(anyhow::anyhow!(refusal)),
    }
}

/// `ironcell policy show`.
fn show_policy(settings: &Settings) -> anyhow::Result<ExitCode> {
    let sandbox = settings.sandbox()?;
    println!(
        "# effective ironcell sandbox policy, from {}",
        sandbox.policy.source
    );
    println!(
        "# (--allow-read/--allow-write grants included; a file with some of these keys is merged over its base)"
    );
    print!("{}", sandbox.policy.to_toml());
    Ok(ExitCode::SUCCESS)
}

/// When `serve` cannot start (no usable state dir, a bad policy, no Python): say so on stderr
/// and answer every request the client sends with a JSON-RPC error carrying the same message,
/// so the client shows the reason instead of "connection closed". Ends at EOF.
async fn answer_requests_with_startup_error(error: anyhow::Error) -> anyhow::Result<()> {
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt};
    let message = format!("ironcell cannot start: {error:#}");
    eprintln!("{message}");
    let mut lines = tokio::io::BufReader::new(tokio::io::stdin()).lines();
    let mut stdout = tokio::io::stdout();
    while let Ok(Some(line)) = lines.next_line().await {
        let Ok(msg) = serde_json::from_str::<serde_json::Value>(&line) else {
            continue;
        };
        let (Some(id), true) = (msg.get("id"), msg.get("method").is_some()) else {
            continue; // notifications and responses get no answer
        };
        let answer = serde_json::json!({
            "jsonrpc": "2.0",
            "id": id,
            "error": {"code": -32603, "message": message},
        });
        let mut out = answer.to_string();
        out.push('\n');
        if stdout.write_all(out.as_bytes()).await.is_err() || stdout.flush().await.is_err() {
            break;
        }
    }
    Err(error)
}
