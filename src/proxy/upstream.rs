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
//! change. A 2026-07-28 list also says how long it may be considered fresh (`ttlMs`).
//!
//! What each use needs from the list (see [`Need`]): showing or searching the tools needs a
//! fresh list (within its `ttlMs`, no change announced since); calling a tool the last list
//! named needs only that no change was announced since, so a proxied call normally costs no
//! `tools/list` at all. Callers that do need a new list share one fetch in flight.

use std::process::Stdio;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use futures::FutureExt;
use futures::future::{BoxFuture, Shared};

use rmcp::model::{
    CallToolRequestParams, ClientCapabilities, ClientConfig, Implementation, ProtocolVersion, Tool,
};
use rmcp::service::{
    ClientLifecycleMode, ClientServiceExt, NotificationContext, Peer, RunningService,
};
use rmcp::transport::TokioChildProcess;
use rmcp::{ClientHandler, RoleClient};

use super::config::ServerConfig;
use ironcell_core::bridge::BridgeError;

/// Host variables a server child inherits (what the MCP SDKs' stdio clients pass), before the
/// entry's own `env` is added. Nothing else of ironcell's environment reaches it.
const INHERITED_VARS: &[&str] = &[
    "HOME", "LOGNAME", "PATH", "SHELL", "TERM", "USER", "LANG", "LC_ALL", "TMPDIR",
];

/// Notices `tools/list_changed` from the server.
struct Handler {
    tools: Arc<ToolState>,
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
        self.tools.changed();
    }
}

/// Longest line of a proxied server's stderr that ironcell logs.
const MAX_SERVER_LOG_LINE: usize = 16 << 10;
/// Lines of a server's stderr kept for error messages, whatever the log level: the last ones
/// are what says why a server did not start (a missing package, a bad token).
const STDERR_TAIL_LINES: usize = 20;
/// Longest line kept in that tail (longer ones are cut, with "…").
const STDERR_TAIL_LINE_CHARS: usize = 300;

/// The last lines a server wrote to stderr (of its latest start), bounded in lines and length.
#[derive(Default)]
pub struct StderrTail(std::sync::Mutex<std::collections::VecDeque<String>>);

impl StderrTail {
    fn push(&self, line: &str) {
        let mut tail = crate::lock(&self.0);
        if tail.len() == STDERR_TAIL_LINES {
            tail.pop_front();
        }
        tail.push_back(crate::clip_chars(line.trim_end(), STDERR_TAIL_LINE_CHARS));
    }

    fn clear(&self) {
        crate::lock(&self.0).clear();
    }

    /// For an error message: the last lines, indented, or that there were none.
    pub fn describe(&self) -> String {
        let tail = crate::lock(&self.0);
        if tail.is_empty() {
            return "it wrote nothing to stderr".into();
        }
        let lines: Vec<String> = tail.iter().map(|l| format!("  | {l}")).collect();
        format!("the last lines of its stderr:\n{}", lines.join("\n"))
    }
}

/// Logs a proxied server's stderr line by line until it closes, and keeps its last lines in
/// `tail`. A server may log what a worker sent it, so a line is as long as the worker likes: at
/// most [`MAX_SERVER_LOG_LINE`] bytes of one are kept, and a longer one is skipped (and said
/// so). Reading never stops early: a server whose stderr nobody drained would block, or fail,
/// writing to it.
async fn log_server_stderr(
    name: String,
    mut stderr: impl tokio::io::AsyncRead + Unpin,
    tail: Arc<StderrTail>,
) {
    use tokio::io::AsyncReadExt;
    let mut buf = vec![0u8; 8192];
    let mut line: Vec<u8> = Vec::new();
    let mut too_long = false;
    let skipped = format!("(a log line longer than {MAX_SERVER_LOG_LINE} bytes, skipped)");
    while let Ok(n @ 1..) = stderr.read(&mut buf).await {
        for piece in buf[..n].split_inclusive(|&b| b == b'\n') {
            let (body, ends) = match piece.strip_suffix(b"\n") {
                Some(body) => (body, true),
                None => (piece, false),
            };
            if !too_long && line.len() + body.len() > MAX_SERVER_LOG_LINE {
                too_long = true;
                line = Vec::new();
            }
            if !too_long {
                line.extend_from_slice(body);
            }
            if ends {
                if too_long {
                    tracing::info!(server = %name, "{skipped}");
                    tail.push(&skipped);
                } else {
                    let text = String::from_utf8_lossy(&line);
                    tracing::info!(server = %name, "{text}");
                    tail.push(&text);
                }
                line.clear();
                too_long = false;
            }
        }
    }
    if !line.is_empty() {
        tail.push(&String::from_utf8_lossy(&line));
    }
}

/// The transport to a proxied server, which keeps a slow server's late answers from failing
/// its start.
///
/// While the server starts, rmcp sends one request at a time (the `server/discover` probe,
/// then `initialize` when the probe is refused or left unanswered for 10 s) and takes the next
/// answer as the one to its latest request: a slow server's late answer to the probe (a cold
/// `npx` cache) failed the start with "uncorrelated error response". Here an answer to a
/// request given up on, or to no request at all, is dropped (and logged) before rmcp sees it;
/// so is an answer to a given-up request after the start. A late probe answer that says the
/// server speaks 2026-07-28 is kept: if that server then refuses `initialize` (as a server of
/// that era may), rmcp is given the probe's answer in the form of an `initialize` result of
/// version 2026-07-28 (which rmcp takes as a server without the handshake, as it is), and the
/// `notifications/initialized` that follows is not sent.
struct Correlated<T> {
    inner: T,
    name: String,
    /// Set until the start completes.
    starting: Arc<AtomicBool>,
    /// The start's latest request (and whether it is the probe), until answered.
    awaited: Option<(rmcp::model::RequestId, bool)>,
    /// Start requests replaced by a later one before they were answered (a handful at most).
    abandoned: Vec<(rmcp::model::RequestId, bool)>,
    /// A late answer to the probe that names 2026-07-28.
    late_discover: Option<rmcp::model::DiscoverResult>,
    /// The start went on with that late answer: the handshake's notification is not sent.
    discovered_late: bool,
}

impl<T> Correlated<T> {
    fn new(inner: T, name: &str, starting: Arc<AtomicBool>) -> Correlated<T> {
        Correlated {
            inner,
            name: name.to_string(),
            starting,
            awaited: None,
            abandoned: Vec::new(),
            late_discover: None,
            discovered_late: false,
        }
    }
}

/// A response's `id` answers request `request` (`"1"` answers `1`, as rmcp allows).
fn answers(request: &rmcp::model::RequestId, response: &rmcp::model::RequestId) -> bool {
    use rmcp::model::NumberOrString;
    request == response
        || matches!((request, response), (NumberOrString::Number(n), NumberOrString::String(s))
            if s.parse::<i64>().ok() == Some(*n))
}

impl<T: rmcp::transport::Transport<RoleClient>> rmcp::transport::Transport<RoleClient>
    for Correlated<T>
{
    type Error = T::Error;

    fn send(
        &mut self,
        item: rmcp::service::TxJsonRpcMessage<RoleClient>,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send + 'static {
        use rmcp::model::{ClientNotification, ClientRequest, JsonRpcMessage};
        if self.starting.load(Ordering::SeqCst) {
            match &item {
                JsonRpcMessage::Request(r) => {
                    let probe = matches!(r.request, ClientRequest::DiscoverRequest(_));
                    if let Some(given_up) = self.awaited.replace((r.id.clone(), probe)) {
                        self.abandoned.push(given_up);
                    }
                }
                JsonRpcMessage::Notification(n)
                    if self.discovered_late
                        && matches!(
                            n.notification,
                            ClientNotification::InitializedNotification(_)
                        ) =>
                {
                    return futures::future::Either::Right(futures::future::ready(Ok(())));
                }
                _ => {}
            }
        }
        futures::future::Either::Left(self.inner.send(item))
    }

    fn receive(
        &mut self,
    ) -> impl Future<Output = Option<rmcp::service::RxJsonRpcMessage<RoleClient>>> + Send {
        use rmcp::model::{JsonRpcMessage, ServerResult};
        async move {
            loop {
                // Cancel-safe as the inner transport is: nothing is decided before it answers.
                let message = self.inner.receive().await?;
                let id = match &message {
                    JsonRpcMessage::Response(r) => Some(r.id.clone()),
                    JsonRpcMessage::Error(e) => e.id.clone(),
                    _ => None,
                };
                let Some(id) = id else {
                    return Some(message);
                };
                if let Some(i) = self.abandoned.iter().position(|(a, _)| answers(a, &id)) {
                    let (_, probe) = self.abandoned.swap_remove(i);
                    if probe
                        && let JsonRpcMessage::Response(r) = &message
                        && let ServerResult::DiscoverResult(d) = &r.result
                        && d.supported_versions
                            .contains(&ProtocolVersion::V_2026_07_28)
                    {
                        self.late_discover = Some(d.clone());
                    }
                    tracing::info!(server = %self.name, %id, "a late answer to a request of the start that was given up on; ignored");
                    continue;
                }
                if !self.starting.load(Ordering::SeqCst) {
                    return Some(message);
                }
                let Some((_, probe)) = self.awaited.take_if(|(a, _)| answers(a, &id)) else {
                    tracing::warn!(server = %self.name, %id, "an answer to no request of the start; ignored");
                    continue;
                };
                if !probe
                    && matches!(message, JsonRpcMessage::Error(_))
                    && let Some(d) = self.late_discover.take()
                {
                    tracing::info!(server = %self.name, "it refused initialize after its late answer to server/discover: using 2026-07-28, as that answer said");
                    self.discovered_late = true;
                    let mut result = rmcp::model::InitializeResult::new(d.capabilities.clone());
                    result.protocol_version = ProtocolVersion::V_2026_07_28;
                    result.server_info = d
                        .server_info()
                        .unwrap_or_else(|| Implementation::new(self.name.clone(), ""));
                    result.instructions = d.instructions.clone();
                    result.meta = d.meta.clone();
                    return Some(JsonRpcMessage::response(
                        ServerResult::InitializeResult(result),
                        id,
                    ));
                }
                return Some(message);
            }
        }
    }

    fn close(&mut self) -> impl Future<Output = Result<(), Self::Error>> + Send {
        self.inner.close()
    }
}

/// A start that failed, in words: rmcp's "both failed" says why each step did.
fn start_error(e: &rmcp::service::ClientInitializeError) -> String {
    use rmcp::service::ClientInitializeError as E;
    match e {
        E::LegacyFallbackFailed { discover, fallback } => {
            format!("server/discover: {discover}; then initialize: {fallback}")
        }
        other => other.to_string(),
    }
}

/// A server's tool list, and the same tools indexed for search.
pub struct ToolCatalog {
    pub tools: Vec<Tool>,
    pub index: Vec<super::search::Indexed>,
    /// When the server's `ttlMs` runs out (2026-07-28 servers; none for older ones).
    expires: Option<Instant>,
    /// [`ToolState::changes`] when the fetch of this list began: a change announced after that
    /// makes the list out of date.
    changes_at: u64,
}

impl ToolCatalog {
    pub fn tool(&self, name: &str) -> Option<&Tool> {
        self.tools.iter().find(|t| t.name == name)
    }
}

/// What a use of the tool list needs from it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Need {
    /// Showing or searching the tools: the list must be fresh, i.e. no change announced since
    /// it was fetched, within its `ttlMs`, and change notices can still arrive.
    Fresh,
    /// Calling a tool: the last list's entry for it is enough unless a change was announced
    /// since. Why the `ttlMs` is not consulted here: the 2026-07-28 spec (server/utilities/
    /// caching, SEP-2549) makes `ttlMs` a hint of how long "the client MAY consider the result
    /// fresh"; at 0 the result "SHOULD be considered immediately stale. The client MAY re-fetch
    /// every time the result is needed" (a permission, not a duty), and "caching is
    /// complementary to change notifications". A `tools/call` does not need the list: the
    /// server checks the name itself and answers an unknown one with an error. ironcell reads
    /// the entry only for the tool's annotations, which its rules already take on the server's
    /// word (the spec calls annotations untrusted hints), so an entry the server itself sent
    /// earlier is what a re-fetch would give up to the server's honesty. Re-listing 1,000
    /// tools per call, as the Python SDK's default `ttlMs: 0` would have it, cost ~100 ms of
    /// the server's time per call and serialized every call behind those lists.
    Call,
}

/// The tool list of one connection: the last one fetched, the fetch in flight, and the count
/// of change notices (old-era notifications and the `subscriptions/listen` stream alike).
struct ToolState {
    changes: AtomicU64,
    /// Set when no notice of tool-list changes can arrive (a 2026-07-28 server whose
    /// `subscriptions/listen` stream failed or ended): the list is never fresh for [`Need::Fresh`].
    blind: AtomicBool,
    cache: std::sync::Mutex<ToolCache>,
}

type Listing = Shared<BoxFuture<'static, Result<Arc<ToolCatalog>, BridgeError>>>;

#[derive(Default)]
struct ToolCache {
    last: Option<Arc<ToolCatalog>>,
    /// The one `tools/list` in flight (single-flight: every caller that needs a new list
    /// awaits this same future), with the change count it began at.
    fetching: Option<(u64, Listing)>,
}

impl ToolState {
    fn new() -> ToolState {
        ToolState {
            changes: AtomicU64::new(0),
            blind: AtomicBool::new(false),
            cache: std::sync::Mutex::new(ToolCache::default()),
        }
    }

    /// The server announced a change (or a call showed the list is out of date).
    fn changed(&self) {
        self.changes.fetch_add(1, Ordering::SeqCst);
    }

    /// The last list, if it is good enough for `need`.
    fn cached(&self, need: Need) -> Option<Arc<ToolCatalog>> {
        let last = crate::lock(&self.cache).last.clone()?;
        if last.changes_at != self.changes.load(Ordering::SeqCst) {
            return None;
        }
        match need {
            Need::Call => Some(last),
            Need::Fresh => self.is_fresh(&last).then_some(last),
        }
    }

    /// Within its `ttlMs` (if it has one), and changes would be heard of.
    fn is_fresh(&self, catalog: &ToolCatalog) -> bool {
        !self.blind.load(Ordering::SeqCst) && catalog.expires.is_none_or(|e| Instant::now() < e)
    }
}

struct Connection {
    service: RunningService<RoleClient, Handler>,
    tools: Arc<ToolState>,
    /// The `subscriptions/listen` stream of a 2026-07-28 server, ended with the connection.
    _listener: Option<AbortOnDrop>,
}

/// A running connection as one use sees it (taken under the connection lock, used without it).
#[derive(Clone)]
struct Live {
    peer: Peer<RoleClient>,
    tools: Arc<ToolState>,
}

struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// For a 2026-07-28 server whose tool list can change: a task that marks the cached list stale
/// on each `notifications/tools/list_changed` of its `subscriptions/listen` stream. When the
/// stream cannot be opened, or ends, it sets `blind` (every listing fetches the tools anew).
fn listen_for_tool_changes(
    name: &str,
    peer: Peer<RoleClient>,
    tools: Arc<ToolState>,
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
                tracing::info!(server = %name, error = %e, "no subscriptions/listen stream; its tool list is fetched for every listing");
                tools.blind.store(true, Ordering::SeqCst);
                return;
            }
        };
        loop {
            match sub.next().await {
                Ok(Some(ServerNotification::ToolListChangedNotification(_))) => tools.changed(),
                Ok(Some(_)) => {}
                Ok(None) | Err(_) => break,
            }
        }
        // Nothing tells us about changes any more.
        tools.blind.store(true, Ordering::SeqCst);
    })))
}

impl Connection {
    fn live(&self) -> Live {
        Live {
            peer: self.service.peer().clone(),
            tools: self.tools.clone(),
        }
    }

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

/// A tool found for a call: its entry (annotations for the rules) and the connection to call it on.
pub struct Resolved {
    live: Live,
    pub entry: Tool,
}

/// One `tools/list` (all pages), indexed for search and kept as the connection's last list
/// unless a newer one is already there.
async fn list_tools(
    name: String,
    peer: Peer<RoleClient>,
    state: Weak<ToolState>,
    changes_at: u64,
) -> Result<Arc<ToolCatalog>, BridgeError> {
    let listed = peer.list_all_tools_with_cache_hint().await;
    // Weak: the state holds this future while it is in flight; the connection may be gone.
    let state = state.upgrade().ok_or_else(|| {
        BridgeError::unavailable(format!(
            "server {name:?} stopped while its tools were listed"
        ))
    })?;
    let mut cache = crate::lock(&state.cache);
    if cache
        .fetching
        .as_ref()
        .is_some_and(|(at, _)| *at == changes_at)
    {
        cache.fetching = None;
    }
    let listed = listed.map_err(|e| {
        BridgeError::unavailable(format!("listing the tools of {name:?} failed: {e}"))
    })?;
    let expires = listed
        .ttl_ms
        .map(|ms| Instant::now() + Duration::from_millis(ms));
    let index = listed
        .items
        .iter()
        .map(|t| {
            super::search::Indexed::new(&name, &t.name, t.description.as_deref().unwrap_or(""))
        })
        .collect();
    let catalog = Arc::new(ToolCatalog {
        tools: listed.items,
        index,
        expires,
        changes_at,
    });
    if cache
        .last
        .as_ref()
        .is_none_or(|l| l.changes_at <= changes_at)
    {
        cache.last = Some(catalog.clone());
    }
    Ok(catalog)
}

/// How long a server that let a call overrun has to answer a ping before it counts as wedged.
const PING_TIMEOUT: Duration = Duration::from_secs(5);

pub struct Upstream {
    pub config: ServerConfig,
    startup_timeout: Duration,
    conn: tokio::sync::Mutex<Option<Connection>>,
    /// The protocol version the server spoke at its last start (kept after it stops).
    protocol_version: std::sync::Mutex<Option<ProtocolVersion>>,
    /// The last lines of its stderr since its latest start.
    stderr_tail: Arc<StderrTail>,
}

impl Upstream {
    pub fn new(config: ServerConfig, startup_timeout: Duration) -> Upstream {
        Upstream {
            config,
            startup_timeout,
            conn: tokio::sync::Mutex::new(None),
            protocol_version: std::sync::Mutex::new(None),
            stderr_tail: Arc::new(StderrTail::default()),
        }
    }

    fn name(&self) -> &str {
        &self.config.name
    }

    /// Starts the server if it is not running (or has died), and returns a handle for calls.
    /// The lock is held only to look (and, once, across a start): calls run without it.
    async fn live(&self) -> Result<Live, BridgeError> {
        let mut conn = self.conn.lock().await;
        if let Some(c) = conn.as_ref() {
            if !c.is_closed() {
                return Ok(c.live());
            }
            tracing::warn!(server = self.name(), "server exited; restarting it");
        }
        let started = self.start().await?;
        let live = started.live();
        *conn = Some(started);
        Ok(live)
    }

    /// Starts the server's process and connects to it in its era.
    ///
    /// Long on purpose: the child process, then the handshake in its era, with the stderr kept for
    /// the error of each way the start can fail.
    async fn start(&self) -> Result<Connection, BridgeError> {
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
        // SAFETY: between fork and exec the closure makes one async-signal-safe call (prctl);
        // the child dies with ironcell.
        unsafe {
            cmd.pre_exec(|| {
                nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGKILL)?;
                Ok(())
            })
        };
        let (transport, stderr) = TokioChildProcess::builder(cmd)
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| {
                BridgeError::unavailable(format!(
                    "cannot start server {:?} ({}): {e}",
                    c.name, c.command
                ))
            })?;
        self.stderr_tail.clear();
        let reader = stderr.map(|stderr| {
            let name = c.name.clone();
            tokio::spawn(log_server_stderr(name, stderr, self.stderr_tail.clone()))
        });
        let tools = Arc::new(ToolState::new());
        let handler = Handler {
            tools: tools.clone(),
        };
        let starting = Arc::new(AtomicBool::new(true));
        let transport = Correlated::new(transport, &c.name, starting.clone());
        let start = handler.serve_with_lifecycle(transport, lifecycle());
        let failed = match tokio::time::timeout(self.startup_timeout, start).await {
            Ok(Ok(service)) => Ok(service),
            Ok(Err(e)) => Err(format!("failed to start: {}", start_error(&e))),
            Err(_) => Err(format!(
                "did not finish starting within {} s (MCP_BRIDGE_STARTUP_TIMEOUT)",
                self.startup_timeout.as_secs_f64()
            )),
        };
        let service = match failed {
            Ok(service) => service,
            Err(why) => {
                // The transport is gone, so the child is being killed: its stderr ends soon
                // (a grandchild holding it open gets at most a second).
                if let Some(reader) = reader {
                    let _ = tokio::time::timeout(Duration::from_secs(1), reader).await;
                }
                return Err(BridgeError::unavailable(format!(
                    "server {:?} {why}; {}",
                    c.name,
                    self.stderr_tail.describe()
                )));
            }
        };
        starting.store(false, Ordering::SeqCst);
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
        let listener = listen_for_tool_changes(&c.name, service.peer().clone(), tools.clone());
        Ok(Connection {
            service,
            tools,
            _listener: listener,
        })
    }

    /// Begins starting the server without waiting (the `servers` argument of run_python).
    pub fn prestart(self: &Arc<Self>) {
        let me = self.clone();
        tokio::spawn(async move {
            if let Err(e) = me.live().await {
                tracing::warn!(server = me.name(), error = %e.message, "pre-start failed");
            }
        });
    }

    /// The server's tools, from the cache when it is fresh (see [`Need::Fresh`]).
    pub async fn tools(&self) -> Result<Arc<ToolCatalog>, BridgeError> {
        let live = self.live().await?;
        match live.tools.cached(Need::Fresh) {
            Some(t) => Ok(t),
            None => self.fetch(&live).await,
        }
    }

    /// The entry of `tool` for a call, and the connection to make it on: from the last list
    /// unless a change was announced since (see [`Need::Call`]); a name that list lacks is
    /// looked up in a new one (the tools may have changed without notice) unless the list is
    /// still fresh, before it is called unknown. At most one `tools/list` per call, shared
    /// with every concurrent caller.
    pub async fn resolve(&self, tool: &str) -> Result<Resolved, BridgeError> {
        let live = self.live().await?;
        let catalog = match live.tools.cached(Need::Call) {
            Some(c) if c.tool(tool).is_some() || live.tools.is_fresh(&c) => c,
            _ => self.fetch(&live).await?,
        };
        let Some(entry) = catalog.tool(tool).cloned() else {
            // The tools code may see: a hidden one is not named here either.
            let names: Vec<&str> = catalog
                .tools
                .iter()
                .filter(|t| !self.config.rules.hides(self.name(), t))
                .map(|t| t.name.as_ref())
                .collect();
            return Err(BridgeError::unknown_tool(format!(
                "server {:?} has no tool {tool:?}; it has: {}",
                self.name(),
                names.join(", ")
            )));
        };
        Ok(Resolved { live, entry })
    }

    /// A new tool list: joins the fetch in flight when it began after the last announced
    /// change, starts one otherwise. The fetch runs for whoever awaits it; a caller that goes
    /// away does not cancel it for the others.
    fn fetch(&self, live: &Live) -> Listing {
        let state = &live.tools;
        let mut cache = crate::lock(&state.cache);
        let changes = state.changes.load(Ordering::SeqCst);
        if let Some((at, listing)) = &cache.fetching
            && *at == changes
        {
            return listing.clone();
        }
        let listing = list_tools(
            self.name().to_string(),
            live.peer.clone(),
            Arc::downgrade(state),
            changes,
        )
        .boxed()
        .shared();
        cache.fetching = Some((changes, listing.clone()));
        listing
    }

    /// Calls a tool (resolved by [`Upstream::resolve`]); returns the whole `CallToolResult` as
    /// JSON.
    pub async fn call(
        &self,
        resolved: Resolved,
        arguments: serde_json::Map<String, serde_json::Value>,
        timeout: Duration,
    ) -> Result<serde_json::Value, BridgeError> {
        let Resolved { live, entry } = resolved;
        let tool: &str = &entry.name;
        let params = CallToolRequestParams::new(tool.to_string()).with_arguments(arguments);
        match tokio::time::timeout(timeout, live.peer.call_tool(params)).await {
            Ok(Ok(result)) => serde_json::to_value(result)
                .map_err(|e| BridgeError::unavailable(format!("unreadable result: {e}"))),
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
                    Err(BridgeError::unavailable(format!(
                        "server {:?} exited during the call to {tool:?} ({e}); it restarts on next use; {}",
                        self.name(),
                        self.stderr_tail.describe()
                    )))
                } else {
                    if matches!(e, rmcp::service::ServiceError::McpError(_)) {
                        // The server refused the request itself (e.g. it no longer has the
                        // tool): the list this call went by may be out of date.
                        live.tools.changed();
                    }
                    Err(BridgeError::unavailable(format!(
                        "calling {tool:?} on {:?} failed: {e}",
                        self.name()
                    )))
                }
            }
            Err(_) => {
                // Dropping the call sent `notifications/cancelled` for it. Other sessions may be
                // using this server, so it is restarted only if it does not answer a ping
                // either: wedged for everyone, not just slow on this call.
                let ping = live
                    .peer
                    .send_request(rmcp::model::ClientRequest::PingRequest(
                        rmcp::model::PingRequest {
                            method: Default::default(),
                            extensions: Default::default(),
                        },
                    ));
                if matches!(tokio::time::timeout(PING_TIMEOUT, ping).await, Ok(Ok(_))) {
                    return Err(BridgeError::unavailable(format!(
                        "server {:?} did not answer {tool:?} within {} s; the call was cancelled (the server was sent notifications/cancelled, and keeps running for its other callers)",
                        self.name(),
                        timeout.as_secs_f64()
                    )));
                }
                self.stop().await;
                Err(BridgeError::unavailable(format!(
                    "server {:?} did not answer {tool:?} within {} s, nor a ping within {} s; it was restarted",
                    self.name(),
                    timeout.as_secs_f64(),
                    PING_TIMEOUT.as_secs()
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

    /// Forgets the connection and ends it. The lock is released before the (possibly slow)
    /// shutdown, so other callers start a new server instead of waiting for the old one to go.
    pub async fn stop(&self) {
        let taken = self.conn.lock().await.take();
        if let Some(c) = taken {
            let _ = c.service.cancel().await;
        }
    }
}
