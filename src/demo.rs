//! `ironcell demo`: a scripted MCP session against ironcell itself, printed for a person.
//!
//! It starts `ironcell serve` as a child process and talks to it with rmcp's client over stdio,
//! exactly as an MCP client such as Claude Desktop would, so what it shows is what a model gets.

use std::time::Instant;

use anyhow::Context;
use rmcp::ServiceExt;
use rmcp::model::{CallToolRequestParams, JsonObject, ReadResourceRequestParams, ResourceContents};
use rmcp::transport::TokioChildProcess;
use serde_json::{Value, json};

use crate::config::Settings;

const CELLS: &[(&str, &str, Option<f64>)] = &[
    (
        "Output and the value of the last expression",
        "print('hello from a sandboxed worker')\n6 * 7",
        None,
    ),
    (
        "State persists between calls in a session",
        "import math\nradius = 2\narea = math.pi * radius ** 2",
        None,
    ),
    (
        "... so the next call sees it",
        "f'area of a circle of radius {radius}: {area:.3f}'",
        None,
    ),
    (
        "Errors come back as a short traceback",
        "def ratio(a, b):\n    return a / b\n\nratio(1, 0)",
        None,
    ),
    (
        "A run past its time limit is interrupted",
        "import time\nprint('sleeping...')\ntime.sleep(60)",
        Some(1.0),
    ),
    ("... and the session survives it", "radius * 10", None),
    (
        "Top-level await works",
        "import asyncio\nawait asyncio.sleep(0.01)\n'awaited'",
        None,
    ),
    (
        "The sandbox holds: no host files, no network",
        "import socket\nfor probe in (lambda: open('/etc/passwd'), lambda: socket.create_connection(('127.0.0.1', 22))):\n    try:\n        probe()\n    except OSError as e:\n        print(type(e).__name__ + ':', e.strerror)",
        None,
    ),
    (
        "Your other MCP servers are callable from the code",
        "servers = await runtime.discovered_servers(detailed=True)\nservers or 'none configured yet (see the next steps below)'",
        None,
    ),
];

/// What to do after the demo: the commands README.md's "First things to try" explains.
const NEXT_STEPS: &str = "Next steps:
  target/release/ironcell setup --dry-run     what `setup` would write into your MCP client's config
  target/release/ironcell doctor              what the sandbox enforces on this machine
  MCP_BRIDGE_CONFIG=examples/hello-server/servers.json target/release/ironcell exec \\
      'await mcp_hello.greet(name=\"you\")'    code calling another MCP server (examples/hello-server)
README.md has the rest.";

/// `ironcell demo`: a short session driven as an MCP client would.
///
/// Long on purpose: the demo's script, one call after another as the user sees them.
pub async fn run(settings: Settings) -> anyhow::Result<()> {
    let exe = std::env::current_exe()?;
    let mut cmd = tokio::process::Command::new(exe);
    cmd.arg("serve");
    cmd.env("MCP_BRIDGE_OUTPUT_MODE", "compact");
    if let Some(dir) = &settings.state_dir {
        cmd.env("MCP_BRIDGE_STATE_DIR", dir);
    }
    let started = Instant::now();
    let client =
        ().serve(TokioChildProcess::new(cmd)?)
            .await
            .context("connecting to ironcell serve")?;
    let handshake_ms = started.elapsed().as_secs_f64() * 1000.0;
    let info = client.peer_info().and_then(|i| {
        i.server_info
            .as_ref()
            .map(|s| format!("{} {}", s.name, s.version))
    });
    println!(
        "Connected to {} over stdio in {handshake_ms:.0} ms.",
        info.unwrap_or_default()
    );
    let tools = client.list_all_tools().await?;
    let listed: Vec<&str> = tools.iter().map(|t| t.name.as_ref()).collect();
    println!("Tools: {}\n", listed.join(", "));

    for (title, code, timeout) in CELLS {
        let mut args = JsonObject::new();
        args.insert("code".into(), Value::String(code.to_string()));
        if let Some(t) = timeout {
            args.insert("timeout_s".into(), json!(t));
        }
        println!("── {title}");
        for line in code.lines() {
            println!("   >>> {line}");
        }
        let t0 = Instant::now();
        let result = client
            .call_tool(CallToolRequestParams::new("run_python").with_arguments(args))
            .await?;
        let ms = t0.elapsed().as_secs_f64() * 1000.0;
        let images = result
            .content
            .iter()
            .filter(|c| c.as_image().is_some())
            .count();
        if images > 0 {
            println!("   [{images} image(s) attached]");
        }
        let flag = if result.is_error == Some(true) {
            "isError"
        } else {
            "ok"
        };
        for c in &result.content {
            if let Some(t) = c.as_text() {
                for line in t.text.lines() {
                    println!("   {line}");
                }
            }
        }
        println!("   ({flag}, {ms:.1} ms round trip)\n");
    }

    let info = client
        .read_resource(ReadResourceRequestParams::new("system://info"))
        .await?;
    if let Some(ResourceContents::TextResourceContents { text, .. }) = info.contents.first() {
        let v: Value = serde_json::from_str(text).unwrap_or(Value::Null);
        println!(
            "system://info: Python {} on {} (kernel {}), {} sessions max, default timeout {} s",
            v["python"]["version"].as_str().unwrap_or("?"),
            v["os"].as_str().unwrap_or("?"),
            v["kernel"].as_str().unwrap_or("?"),
            v["limits"]["max_sessions"],
            v["limits"]["default_timeout_s"],
        );
    }
    client.cancel().await.ok();
    println!("\n{NEXT_STEPS}");
    Ok(())
}
