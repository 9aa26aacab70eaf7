//! One proxied MCP server: an rmcp client over a child process, started on first use, restarted
//! after a crash, with its tool list cached until the server says it changed.
//!
//! Each server is spoken to in its own era: ironcell probes with `server/discover` first and, if
//! the server answers, uses 2026-07-28 (no handshake, the version and ironcell's identity in every
//! request's `_meta`); a server that answers the probe with an error (an older server's "method
//! not found") gets the `initialize` handshake on the same connection. The era each server
//! speaks is recorded and shown in `system://info`.
//!
//! Tool-list changes: an old-era server notifies on its own; a 2026-07-28 server only on a
//! `subscriptions/listen` stream, which ironcell opens when the server says its tool list can
//! change (if that stream cannot be had, the list is fetched anew for every use). A 2026-07-28
//! list also says how long it may be cached (`ttlMs`); ironcell keeps it no longer.

use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use rmcp::model::{
    CallToolRequestParams, ClientCapabilities, ClientConfig, Implementation, ProtocolVersion, Tool,
};
use rmcp::service::{
    ClientLifecycleMode, ClientServiceExt, NotificationContext, Peer, RunningService,
};
use rmcp::transport::TokioChildProcess;
use rmcp::{ClientHandler, RoleClient};
use tokio::io::AsyncBufReadExt;

use super::ProxyError;
use super::config::ServerConfig;

/// Host variables a server child inherits (what the MCP SDKs' stdio clients pass), before the
/// entry's own `env` is added. Nothing else of ironcell's environment reaches it.
const INHERITED_VARS: &[&str] = &[
    "HOME", "LOGNAME", "PATH", "SHELL", "TERM", "USER", "LANG", "LC_ALL", "TMPDIR",
];

/// Notices `tools/list_changed` from the server.
struct Handler {
    stale: Arc<AtomicBool>,
}

impl ClientHandler for Handler {
    /// Who ironcell is to the servers it proxies. The version here is the one a legacy
    /// `initialize` asks for; the modern era is negotiated by `server/discover`.
    fn get_info(&self) -> ClientConfig {
        let mut info = ClientConfig::default();
        info.protocol_version = ProtocolVersion::LATEST_WITH_INITIALIZE;
        info.capabilities = ClientCapabilities::default();
        info.client_info = Implementation::new("ironcell", env!("CARGO_PKG_VERSION"));
        info
    }

    async fn on_tool_list_changed(&self, _context: NotificationContext<RoleClient>) {
        self.stale.store(true, Ordering::SeqCst);
    }
}

/// A server's tool list, and the same tools indexed for search.
pub struct ToolCatalog {
    pub tools: Vec<Tool>,
    pub index: Vec<super::search::Indexed>,
    /// When the server's `ttlMs` runs out (2026-07-28 servers; none for older ones).
    expires: Option<std::time::Instant>,
}

struct Connection {
    service: RunningService<RoleClient, Handler>,
    tools: Option<Arc<ToolCatalog>>,
    stale: Arc<AtomicBool>,
    /// Set when no notice of tool-list changes can arrive (a 2026-07-28 server whose
    /// `subscriptions/listen` stream failed or ended): the list is never cached.
    blind: Arc<AtomicBool>,
    /// The `subscriptions/listen` stream of a 2026-07-28 server, ended with the connection.
    _listener: Option<AbortOnDrop>,
}

struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// For a 2026-07-28 server whose tool list can change: a task that marks the cached list stale
/// on each `notifications/tools/list_changed` of its `subscriptions/listen` stream. When the
/// stream cannot be opened, or ends, it sets `blind` (every use lists the tools anew).
fn listen_for_tool_changes(
    name: &str,
    peer: Peer<RoleClient>,
    stale: Arc<AtomicBool>,
    blind: Arc<AtomicBool>,
) -> Option<AbortOnDrop> {
    use rmcp::model::{ServerNotification, SubscriptionFilter};
    let info = peer.peer_info()?;
    let changes = info
        .capabilities
        .tools
        .as_ref()
        .and_then(|t| t.list_changed)
        .unwrap_or(false);
    if info.protocol_version.has_initialize() || !changes {
        return None;
    }
    let name = name.to_string();
    Some(AbortOnDrop(tokio::spawn(async move {
        let filter = SubscriptionFilter::builder().tools_list_changed().build();
        let mut sub = match peer.listen(filter).await {
            Ok(sub) => sub,
            Err(e) => {
                tracing::info!(server = %name, error = %e, "no subscriptions/listen stream; its tool list is fetched for every use");
                blind.store(true, Ordering::SeqCst);
                return;
            }
        };
        loop {
            match sub.next().await {
                Ok(Some(ServerNotification::ToolListChangedNotification(_))) => {
                    stale.store(true, Ordering::SeqCst);
                }
                Ok(Some(_)) => {}
                Ok(None) | Err(_) => break,
            }
        }
        // Nothing tells us about changes any more.
        blind.store(true, Ordering::SeqCst);
    })))
}

impl Connection {
    /// The server exited, or its transport is gone.
    fn is_closed(&self) -> bool {
        self.service.is_closed() || self.service.peer().is_transport_closed()
    }
}

/// How ironcell starts a conversation with a proxied server: probe with `server/discover`
/// for the 2026-07-28 era, fall back to the `initialize` handshake when the server answers the
/// probe with an error.
fn lifecycle() -> ClientLifecycleMode {
    ClientLifecycleMode::Auto {
        preferred_versions: vec![ProtocolVersion::V_2026_07_28],
        legacy_version: Some(ProtocolVersion::LATEST_WITH_INITIALIZE),
    }
}

pub struct Upstream {
    pub config: ServerConfig,
    startup_timeout: Duration,
    conn: tokio::sync::Mutex<Option<Connection>>,
    /// The protocol version the server spoke at its last start (kept after it stops).
    protocol_version: std::sync::Mutex<Option<ProtocolVersion>>,
}

impl Upstream {
    pub fn new(config: ServerConfig, startup_timeout: Duration) -> Upstream {
        Upstream {
            config,
            startup_timeout,
            conn: tokio::sync::Mutex::new(None),
            protocol_version: std::sync::Mutex::new(None),
        }
    }

    fn name(&self) -> &str {
        &self.config.name
    }

    /// Starts the server if it is not running (or has died), and returns a handle for calls.
    async fn peer(&self) -> Result<Peer<RoleClient>, ProxyError> {
        let mut conn = self.conn.lock().await;
        if let Some(c) = conn.as_ref() {
            if !c.is_closed() {
                return Ok(c.service.peer().clone());
            }
            tracing::warn!(server = self.name(), "server exited; restarting it");
        }
        let started = self.start().await?;
        let peer = started.service.peer().clone();
        *conn = Some(started);
        Ok(peer)
    }

    async fn start(&self) -> Result<Connection, ProxyError> {
        let c = &self.config;
        let mut cmd = tokio::process::Command::new(&c.command);
        cmd.args(&c.args).env_clear().kill_on_drop(true);
        for var in INHERITED_VARS {
            if let Ok(v) = std::env::var(var) {
                cmd.env(var, v);
            }
        }
        cmd.envs(&c.env);
        if let Some(dir) = &c.cwd {
            cmd.current_dir(dir);
        }
        // SAFETY: prctl is async-signal-safe; the child dies with ironcell.
        unsafe {
            cmd.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let (transport, stderr) = TokioChildProcess::builder(cmd)
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| {
                ProxyError::unavailable(format!(
                    "cannot start server {:?} ({}): {e}",
                    c.name, c.command
                ))
            })?;
        if let Some(stderr) = stderr {
            let name = c.name.clone();
            tokio::spawn(async move {
                let mut lines = tokio::io::BufReader::new(stderr).lines();
                while let Ok(Some(line)) = lines.next_line().await {
                    tracing::info!(server = %name, "{line}");
                }
            });
        }
        let stale = Arc::new(AtomicBool::new(false));
        let handler = Handler {
            stale: stale.clone(),
        };
        let start = handler.serve_with_lifecycle(transport, lifecycle());
        let service = match tokio::time::timeout(self.startup_timeout, start).await {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => {
                return Err(ProxyError::unavailable(format!(
                    "server {:?} failed to start: {e} (its log lines are in ironcell's stderr)",
                    c.name
                )));
            }
            Err(_) => {
                return Err(ProxyError::unavailable(format!(
                    "server {:?} did not finish starting within {} s (MCP_BRIDGE_STARTUP_TIMEOUT)",
                    c.name,
                    self.startup_timeout.as_secs_f64()
                )));
            }
        };
        let version = service
            .peer()
            .peer_info()
            .map(|i| i.protocol_version.clone());
        tracing::info!(
            server = %c.name,
            protocol_version = %version.as_ref().map(ToString::to_string).unwrap_or_default(),
            "proxied server started"
        );
        *crate::lock(&self.protocol_version) = version;
        let blind = Arc::new(AtomicBool::new(false));
        let listener = listen_for_tool_changes(
            &c.name,
            service.peer().clone(),
            stale.clone(),
            blind.clone(),
        );
        Ok(Connection {
            service,
            tools: None,
            stale,
            blind,
            _listener: listener,
        })
    }

    /// Begins starting the server without waiting (the `servers` argument of run_python).
    pub fn prestart(self: &Arc<Self>) {
        let me = self.clone();
        tokio::spawn(async move {
            if let Err(e) = me.peer().await {
                tracing::warn!(server = me.name(), error = %e.message, "pre-start failed");
            }
        });
    }

    /// The server's tools, from the cache unless it announced a change.
    pub async fn tools(&self) -> Result<Arc<ToolCatalog>, ProxyError> {
        let peer = self.peer().await?;
        {
            let conn = self.conn.lock().await;
            let fresh = |c: &Connection, t: &ToolCatalog| {
                !c.stale.load(Ordering::SeqCst)
                    && !c.blind.load(Ordering::SeqCst)
                    && t.expires.is_none_or(|e| std::time::Instant::now() < e)
            };
            if let Some(c) = conn.as_ref()
                && let Some(t) = c.tools.as_ref().filter(|t| fresh(c, t))
            {
                return Ok(t.clone());
            }
        }
        let listed = peer.list_all_tools_with_cache_hint().await.map_err(|e| {
            ProxyError::unavailable(format!(
                "listing the tools of {:?} failed: {e}",
                self.name()
            ))
        })?;
        let expires = listed
            .ttl_ms
            .map(|ms| std::time::Instant::now() + Duration::from_millis(ms));
        let tools = listed.items;
        let index = tools
            .iter()
            .map(|t| {
                super::search::Indexed::new(
                    self.name(),
                    &t.name,
                    t.description.as_deref().unwrap_or(""),
                )
            })
            .collect();
        let tools = Arc::new(ToolCatalog {
            tools,
            index,
            expires,
        });
        let mut conn = self.conn.lock().await;
        if let Some(c) = conn.as_mut() {
            c.stale.store(false, Ordering::SeqCst);
            c.tools = Some(tools.clone());
        }
        Ok(tools)
    }

    /// Calls a tool; returns the whole `CallToolResult` as JSON.
    pub async fn call(
        &self,
        tool: &str,
        arguments: serde_json::Map<String, serde_json::Value>,
        timeout: Duration,
    ) -> Result<serde_json::Value, ProxyError> {
        let catalog = self.tools().await?;
        if !catalog.tools.iter().any(|t| t.name == tool) {
            let names: Vec<&str> = catalog.tools.iter().map(|t| t.name.as_ref()).collect();
            return Err(ProxyError::unknown_tool(format!(
                "server {:?} has no tool {tool:?}; it has: {}",
                self.name(),
                names.join(", ")
            )));
        }
        let peer = self.peer().await?;
        let params = CallToolRequestParams::new(tool.to_string()).with_arguments(arguments);
        match tokio::time::timeout(timeout, peer.call_tool(params)).await {
            Ok(Ok(result)) => serde_json::to_value(result)
                .map_err(|e| ProxyError::unavailable(format!("unreadable result: {e}"))),
            Ok(Err(e)) => {
                let exited = matches!(e, rmcp::service::ServiceError::TransportClosed)
                    || self
                        .conn
                        .lock()
                        .await
                        .as_ref()
                        .is_none_or(Connection::is_closed);
                if exited {
                    // Forget the dead connection so the next use starts the server again.
                    self.stop().await;
                    Err(ProxyError::unavailable(format!(
                        "server {:?} exited during the call to {tool:?} ({e}); it restarts on next use",
                        self.name()
                    )))
                } else {
                    Err(ProxyError::unavailable(format!(
                        "calling {tool:?} on {:?} failed: {e}",
                        self.name()
                    )))
                }
            }
            Err(_) => {
                // A server that does not answer in time is restarted: it may be wedged.
                self.stop().await;
                Err(ProxyError::unavailable(format!(
                    "server {:?} did not answer {tool:?} within {} s; it was restarted",
                    self.name(),
                    timeout.as_secs_f64()
                )))
            }
        }
    }

    /// The protocol version the server spoke at its last start, if it has started.
    pub fn protocol_version(&self) -> Option<ProtocolVersion> {
        crate::lock(&self.protocol_version).clone()
    }

    pub async fn is_running(&self) -> bool {
        self.conn
            .lock()
            .await
            .as_ref()
            .is_some_and(|c| !c.is_closed())
    }

    pub async fn stop(&self) {
        if let Some(c) = self.conn.lock().await.take() {
            let _ = c.service.cancel().await;
        }
    }
}
