//! `ironcell doctor`: what the sandbox would enforce on this host, layer by layer, proven by
//! locking down a real worker and reading its `/proc/<pid>/status` from outside.

use std::process::ExitCode;
use std::time::Instant;

use tokio_util::sync::CancellationToken;

use crate::config::Settings;
use crate::sandbox::SandboxMode;
use crate::session::{RunRequest, SessionManager};

/// `ironcell doctor`: the interpreter and each sandbox layer, and whether `run_python` works.
///
/// Long on purpose: the report, printed top to bottom in the order the user reads it; each
/// section is a few lines of printing, and splitting it would scatter the page's layout.
pub async fn run(settings: Settings) -> anyhow::Result<ExitCode> {
    let sandbox = settings.sandbox()?;
    // `ok`: run_python runs code here (what serve does); `gaps`: protections nothing provides.
    let mut ok = true;
    let mut gaps = Vec::new();
    println!("ironcell {} doctor", env!("CARGO_PKG_VERSION"));
    println!(
        "kernel        {} {}",
        sysinfo::System::kernel_long_version().unwrap_or_default(),
        std::env::consts::ARCH
    );
    println!(
        "policy        {} — {} [{}]",
        sandbox.policy.name, sandbox.policy.description, sandbox.policy.source
    );
    println!(
        "mode          {}",
        match sandbox.mode {
            SandboxMode::Enforce => "enforce (refuse to run unless every layer is in force)",
            SandboxMode::BestEffort => "best-effort (run with the layers available, and say so)",
        }
    );
    let cap = sandbox
        .landlock_abi_cap
        .map(|c| format!(", capped at {c}"))
        .unwrap_or_default();
    println!(
        "landlock      kernel ABI {}; using ABI {}{cap}",
        sandbox.kernel_landlock_abi, sandbox.landlock_abi
    );
    println!(
        "seccomp       {}",
        if sandbox.seccomp_available {
            "available"
        } else {
            "NOT available"
        }
    );
    println!(
        "limits        cpu {} s, memory {} MiB (address space {} MiB), file size {} MiB, open files {}, threads {}, scratch {} MiB",
        sandbox.policy.limits.cpu_seconds,
        sandbox.memory_bytes >> 20,
        sandbox.address_space_bytes() >> 20,
        sandbox.policy.limits.file_size_mib,
        sandbox.policy.limits.open_files,
        sandbox.policy.limits.threads,
        sandbox.policy.limits.scratch_quota_mib
    );
    let tmp = crate::sandbox::private_tmp::host_status(
        settings.private_tmp,
        &settings.resolved_state_dir(),
    );
    println!(
        "thread cap    {}",
        sandbox
            .thread_cap_layer(&tmp)
            .unwrap_or_else(|| format!("NONE: {}", sandbox.no_thread_cap_reason()))
    );
    // The state dir serve would use: the configured one, or its fallback (and /tmp follows it).
    let state_dir = match settings.prepare_state_dir_explained() {
        Ok(d) => {
            match crate::config::memory_backed_state_dir(&d.path) {
                Some(fs) => println!(
                    "state dir     WARNING: {}",
                    crate::config::memory_backed_state_dir_warning(&d.path, fs)
                ),
                None => println!("state dir     {}", d.path.display()),
            }
            if let Some(why) = &d.fallback_because {
                println!(
                    "  FALLBACK    {why}: serve uses the private directory above instead (session files and memories are lost at reboot). Fix: set MCP_BRIDGE_STATE_DIR to a directory this user can write"
                );
            }
            d.path
        }
        Err(e) => {
            println!("state dir     NONE usable: {e}");
            settings.resolved_state_dir()
        }
    };
    // The state dir decides /tmp (beneath /tmp: no bind), so it is looked at again here.
    let tmp = crate::sandbox::private_tmp::host_status(settings.private_tmp, &state_dir);
    println!("/tmp          {}", tmp.describe());
    match sandbox.children(&tmp) {
        Ok(()) => println!(
            "children      fork (never exec): process pools run; capped, counted and killed with their session"
        ),
        Err(why) => println!(
            "children      refused ({why}): multiprocessing and joblib's processes fail; threads work"
        ),
    }
    let protections = sandbox.protections(&tmp);
    let width = protections
        .iter()
        .map(|p| p.protection.chars().count())
        .max()
        .unwrap_or(0)
        + 2;
    println!("\n{:<w$}provided by", "protection", w = width + 2);
    for p in protections {
        let by = if p.layers.is_empty() {
            "NOTHING on this host".to_string()
        } else {
            p.layers.join(" + ")
        };
        if p.layers.is_empty() {
            gaps.push(p.protection);
        }
        println!("  {:<width$}{by}", p.protection);
    }
    let refusal = sandbox.preflight().err();

    let sessions = SessionManager::start(settings, std::env::current_exe()?)?;
    match sessions.interpreter() {
        Ok(i) => println!(
            "\npython        {} (chosen by {}: {})",
            i.executable.display(),
            i.source,
            i.given.display()
        ),
        Err(_) => println!("\npython        none chosen"),
    }
    match sessions.python_info().await {
        Ok(info) => {
            println!(
                "  version     {}, warm in {:.0} ms\n  prefix      {}{}\n  executable  {}",
                info.python_version,
                info.warm_ms,
                info.prefix,
                if info.base_prefix != info.prefix {
                    format!(" (a venv of {})", info.base_prefix)
                } else {
                    String::new()
                },
                info.executable
            );
            for p in &info.site_packages {
                println!("  site-pkgs   {}", p.display());
            }
            for p in &info.python_paths {
                println!("  read-only   {}", p.display());
            }
        }
        Err(e) => {
            ok = false;
            println!("  NOT usable: {e:#}");
        }
    }
    for p in sandbox.policy.existing_read_only() {
        println!("  read-only   {}", p.display());
    }
    let fs = &sandbox.policy.filesystem;
    for p in &fs.allow_read {
        println!("  read-only   {} (granted)", p.display());
    }
    for p in fs.read_write.iter().chain(&fs.allow_write) {
        println!("  read-write  {} (granted)", p.display());
    }

    let config_ok = report_mcp_servers(&sessions).await;
    report_local_tools(&sessions).await;

    if let Some(r) = &refusal {
        println!("\nverdict       run_python would REFUSE: {r}");
        sessions.shutdown().await;
        return Ok(ExitCode::FAILURE);
    }
    let started = Instant::now();
    let probe = RunRequest {
        code: "import os\nos.getpid()".into(),
        session: "doctor".into(),
        timeout: None,
        reset: false,
        servers: Vec::new(),
        progress: None,
        fork_from: None,
    };
    match sessions.run(probe, CancellationToken::new()).await {
        Ok(record) if !record.is_error() => {
            let pid = record.result.clone().unwrap_or_default();
            let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
            let field = |name: &str| {
                status
                    .lines()
                    .find(|l| l.starts_with(name))
                    .map(|l| l[name.len()..].trim().to_string())
                    .unwrap_or_else(|| "?".into())
            };
            println!(
                "\ntest worker   pid {pid} locked down and ran code in {:.0} ms: NoNewPrivs {}, Seccomp {}, CapEff {}, THP_enabled {}",
                started.elapsed().as_secs_f64() * 1000.0,
                field("NoNewPrivs:"),
                field("Seccomp:"),
                field("CapEff:"),
                field("THP_enabled:")
            );
            for n in &record.notices {
                println!("  note        {n}");
            }
        }
        Ok(record) => {
            ok = false;
            println!(
                "\ntest worker   FAILED: {}",
                record.render(crate::config::OutputMode::Compact)
            );
        }
        Err(e) => {
            ok = false;
            println!("\ntest worker   FAILED: {e}");
        }
    }
    sessions.shutdown().await;
    if !config_ok {
        println!(
            "\nverdict       NOT ready: an MCP server configuration it reads is broken (see \"mcp config\" above); code runs, but the servers it names are missing"
        );
        return Ok(ExitCode::FAILURE);
    }
    if ok && gaps.is_empty() {
        println!("\nverdict       ready: run_python runs code with every layer above in force");
        Ok(ExitCode::SUCCESS)
    } else if ok {
        // serve runs code here, so this is not a failure; the gaps are the host's, named above.
        println!(
            "\nverdict       ready, with a gap: run_python runs code, but nothing on this host provides: {} (see above)",
            gaps.join("; ")
        );
        Ok(ExitCode::SUCCESS)
    } else {
        println!("\nverdict       NOT ready (see above)");
        Ok(ExitCode::FAILURE)
    }
}

/// The MCP server configuration serve reads, and each server started as a first call would
/// start it. `false` when a configuration is broken (something in it was not loaded).
async fn report_mcp_servers(sessions: &SessionManager) -> bool {
    let proxy = sessions.proxy();
    let described = proxy.describe().await;
    let sources: Vec<&str> = described["sources"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(serde_json::Value::as_str)
        .collect();
    if sources.is_empty() {
        println!(
            "\nmcp config    none found (MCP_BRIDGE_CONFIG, ./mcp_bridge_config.json, ~/.config/mcp-bridge/config.json, Claude Desktop's config): code sees no other MCP servers"
        );
    } else {
        println!("\nmcp config    {}", sources.join(", "));
    }
    let breaking = proxy.breaking_problems();
    for p in &breaking {
        println!("  BROKEN      {p}");
    }
    for p in described["problems"].as_array().into_iter().flatten() {
        if let Some(p) = p.as_str().filter(|p| !breaking.iter().any(|b| b == p)) {
            println!("  warning     {p}");
        }
    }
    for s in proxy.skipped() {
        println!("  skipped     {:?} from {}: {}", s.name, s.source, s.reason);
    }
    let names = proxy.server_names();
    if !names.is_empty() {
        println!(
            "  starting {} server(s) as a first call would (up to {} s each)…",
            names.len(),
            sessions.settings().startup_timeout.as_secs_f64()
        );
    }
    let starts = names
        .iter()
        .map(|n| async move { (n, proxy.tools_json(n).await) });
    for (name, listed) in futures::future::join_all(starts).await {
        match listed {
            Ok(tools) => println!(
                "  server      {name:?}: started, {} tools",
                tools.as_array().map_or(0, Vec::len)
            ),
            Err(e) => println!("  server      {name:?}: FAILED: {}", e.message),
        }
    }
    breaking.is_empty()
}

/// The `--tools` files and saved tools, loaded in a sandboxed tools session as serve does.
async fn report_local_tools(sessions: &std::sync::Arc<SessionManager>) {
    let tools = crate::local_tools::LocalTools::start(sessions);
    let d = tools.describe().await;
    let loaded: Vec<&str> = d["loaded"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(serde_json::Value::as_str)
        .collect();
    let failed: Vec<&str> = d["failed"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(serde_json::Value::as_str)
        .collect();
    if loaded.is_empty() && failed.is_empty() {
        println!("\nlocal tools   none (--tools / IRONCELL_TOOLS, save_tool)");
        return;
    }
    println!(
        "\nlocal tools   {} loaded: {}",
        loaded.len(),
        loaded.join(", ")
    );
    for f in failed {
        println!("  FAILED      {f}");
    }
}
