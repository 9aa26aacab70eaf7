//! The command line. `serve` is the default; `exec` and `demo` are for people trying it out.

use std::io::Read;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

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
    Serve,
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
    /// Internal: the clean, forking interpreter process. Started by ironcell itself.
    #[command(name = crate::zygote::ZYGOTE_SUBCOMMAND, hide = true)]
    Zygote,
}

/// Parses the command line and runs the chosen command.
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Some(Command::Zygote) = cli.command {
        init_logging(&cli.log_level);
        return match crate::zygote::run_zygote_process(&cli.settings.preload) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("ironcell zygote: {e:#}");
                ExitCode::from(70)
            }
        };
    }
    init_logging(&cli.log_level);
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
            None | Some(Command::Serve) => serve(cli.settings).await.map(|_| ExitCode::SUCCESS),
            Some(Command::Exec { code }) => exec(cli.settings, code).await,
            Some(Command::Demo) => crate::demo::run(cli.settings)
                .await
                .map(|_| ExitCode::SUCCESS),
            Some(Command::Doctor) => crate::doctor::run(cli.settings).await,
            Some(Command::Zygote) => Ok(ExitCode::SUCCESS),
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

fn init_logging(level: &str) {
    let filter = std::env::var("RUST_LOG")
        .ok()
        .unwrap_or_else(|| format!("ironcell={level},rmcp=warn"));
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
    let sessions = SessionManager::start(settings, own_executable()?)?;
    let expiry = tokio::spawn(expire_sessions_periodically(sessions.clone()));
    let server = IroncellServer::new(sessions.clone());
    let mut sigterm = signal(SignalKind::terminate())?;
    let mut sigint = signal(SignalKind::interrupt())?;
    let outcome = async {
        let transport =
            crate::stdio::StdioTransport::new(tokio::io::stdin(), tokio::io::stdout(), max_line);
        let running = server.serve(transport).await.context("MCP handshake")?;
        tokio::select! {
            quit = running.waiting() => { tracing::info!(?quit, "client disconnected"); }
            _ = sigterm.recv() => tracing::info!("SIGTERM: shutting down"),
            _ = sigint.recv() => tracing::info!("SIGINT: shutting down"),
        }
        anyhow::Ok(())
    }
    .await;
    expiry.abort();
    sessions.shutdown().await;
    outcome
}

async fn expire_sessions_periodically(sessions: Arc<SessionManager>) {
    let ttl = sessions.settings().session_ttl;
    let every = (ttl / 4).clamp(
        std::time::Duration::from_secs(1),
        std::time::Duration::from_secs(60),
    );
    let mut tick = tokio::time::interval(every);
    loop {
        tick.tick().await;
        sessions.expire_idle_sessions().await;
    }
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
