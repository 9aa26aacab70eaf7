//! The proxy: the user's other MCP servers, discoverable and callable from sandboxed Python.
//!
//! The host owns every connection to a proxied server (and every secret in their `env`). A
//! worker's `mcp` module sends `request` frames — `servers`, `tools`, `search`, `call` — and
//! [`Proxy::handle`] answers them. Names from Python are only ever lookup keys into the
//! configuration: they never reach a command line, and nothing from a tool argument is expanded.
//!
//! [`rules`] decides which tools code may see and call; [`approval`] asks the user before the
//! calls that need it, in the client's era; [`upstream`] speaks to each server in its own era.

pub mod approval;
mod asking;
pub mod config;
pub mod rules;
pub mod search;
pub mod upstream;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use ironcell_core::bridge::{BridgeError, ErrorKind, ProxyRequest};
use serde_json::{Value, json};

pub use ironcell_core::bridge::{CallOutcome, CallSummary};

use self::approval::{Asker, Relay};
use self::asking::{Asked, Declines};
use self::config::{ConfigProblem, LoadedConfig, SkippedServer};
use self::rules::{ApprovalMode, Hints, Verdict};
use self::upstream::Upstream;

/// Largest proxied result handed to a worker (a frame must stay well under the frame limit).
pub const MAX_RESULT_BYTES: usize = 32 * 1024 * 1024;

/// Most proxied calls of one run recorded one by one (`upstream_calls`); the rest are counted.
pub const MAX_CALL_SUMMARIES: usize = 1000;
/// Longest server or tool name, argument name, kept in a call's summary (the worker chose them).
const MAX_SUMMARY_NAME_CHARS: usize = 128;

/// Longest server or tool name a worker may send (MCP tool names are at most 128 characters):
/// error messages repeat the name, and must not grow with it.
const MAX_NAME_BYTES: usize = 1024;
/// Most argument names kept in a call's summary.
const MAX_SUMMARY_KEYS: usize = 32;
/// Largest argument values kept in a call's summary (as JSON) where `auditArguments` is on.
const MAX_AUDITED_ARGUMENT_BYTES: usize = 4096;

/// Where the summaries of one run's proxied calls go: the run's channel while the run lasts
/// (its record and audit line list them), and the audit log, as a line of its own, for a call
/// that ends when the run is over or past the run's [`MAX_CALL_SUMMARIES`]. So every proxied
/// call is audited exactly once, whenever it ends (SECURITY.md #170).
#[derive(Clone)]
pub struct CallSink {
    /// The run of the session the calls belong to (its number in the session).
    pub run: u64,
    pub summaries: tokio::sync::mpsc::Sender<CallSummary>,
    /// Calls that failed their look-up, counted for the run.
    pub lookups_failed: Arc<std::sync::atomic::AtomicU64>,
    /// Calls past the run's [`MAX_CALL_SUMMARIES`]: each audited on a line of its own if it
    /// reached the server (or the user), counted only if the host refused it.
    pub omitted: Arc<std::sync::atomic::AtomicU64>,
}

/// A call's summary until it is delivered: delivered as `Abandoned` if the call is dropped
/// midway (its worker went away), so no call that may have run goes unaudited.
struct Recording<'a> {
    proxy: &'a Proxy,
    session: &'a str,
    sink: Option<&'a CallSink>,
    started: std::time::Instant,
    summary: Option<CallSummary>,
}

impl Recording<'_> {
    fn finish(&mut self, outcome: CallOutcome, lookup_failed: bool) {
        if let Some(mut s) = self.summary.take() {
            s.outcome = outcome;
            s.ok = outcome == CallOutcome::Ok;
            s.lookup_failed = lookup_failed;
            s.duration_ms = (self.started.elapsed().as_secs_f64() * 1e6).round() / 1000.0;
            self.proxy.deliver(self.session, self.sink, s);
        }
    }
}

impl Drop for Recording<'_> {
    fn drop(&mut self) {
        self.finish(CallOutcome::Abandoned, false);
    }
}

/// A call's arguments as the audit keeps them: whole up to [`MAX_AUDITED_ARGUMENT_BYTES`] of
/// JSON, otherwise only their size.
fn audited_arguments(args: &Value) -> Value {
    let bytes = serde_json::to_vec(args).map_or(0, |v| v.len());
    if bytes <= MAX_AUDITED_ARGUMENT_BYTES {
        return args.clone();
    }
    Value::String(format!(
        "({bytes} bytes of arguments; the audit keeps at most {MAX_AUDITED_ARGUMENT_BYTES})"
    ))
}

pub struct Proxy {
    upstreams: BTreeMap<String, Arc<Upstream>>,
    /// Servers named in the configuration whose entry is broken: name → what is wrong.
    broken: BTreeMap<String, String>,
    /// Servers whose last start (or tool listing) failed: name → why. Cleared on success.
    failures: std::sync::Mutex<BTreeMap<String, String>>,
    problems: Vec<ConfigProblem>,
    /// Configured servers that cannot run here, with the reason (shown, never started).
    skipped: Vec<SkippedServer>,
    sources: Vec<String>,
    call_timeout: Duration,
    approval: ApprovalMode,
    /// Per session: how to ask the user about its runs' calls (none: the client cannot ask).
    askers: std::sync::Mutex<BTreeMap<String, Asker>>,
    /// Approval questions on their way to a 2026-07-28 client.
    relay: Relay,
    /// Where calls that end outside a run's record are audited (set by the server).
    audit: std::sync::OnceLock<Arc<crate::audit::AuditLog>>,
    /// Per session: its declined questions, so code cannot turn the user's dialog into a flood.
    declines: std::sync::Mutex<BTreeMap<String, Declines>>,
    /// Per session: held while one of its questions is open (one question at a time).
    asking: std::sync::Mutex<BTreeMap<String, Arc<tokio::sync::Mutex<()>>>>,
    /// Per (server, session): calls in flight, so one session cannot hold all of a server.
    in_flight: std::sync::Mutex<BTreeMap<(String, String), Arc<tokio::sync::Semaphore>>>,
}

/// Most calls one session may have in flight on one server; the server's other callers keep
/// the rest of its capacity.
pub const MAX_CALLS_PER_SESSION: usize = 64;

impl Proxy {
    pub fn new(
        config: LoadedConfig,
        startup_timeout: Duration,
        call_timeout: Duration,
        approval: ApprovalMode,
    ) -> Proxy {
        for p in &config.problems {
            tracing::warn!("MCP server configuration: {p}");
        }
        let upstreams: BTreeMap<String, Arc<Upstream>> = config
            .servers
            .into_iter()
            .map(|(name, c)| (name, Arc::new(Upstream::new(c, startup_timeout))))
            .collect();
        let mut broken = BTreeMap::new();
        for p in &config.problems {
            if let Some(name) = &p.server
                && !upstreams.contains_key(name)
            {
                broken.entry(name.clone()).or_insert_with(|| {
                    format!("its configuration is broken and it was not loaded: {p}")
                });
            }
        }
        Proxy {
            upstreams,
            broken,
            failures: std::sync::Mutex::new(BTreeMap::new()),
            problems: config.problems,
            skipped: config.skipped,
            sources: config.sources,
            call_timeout,
            approval,
            askers: std::sync::Mutex::new(BTreeMap::new()),
            relay: Relay::default(),
            audit: std::sync::OnceLock::new(),
            declines: std::sync::Mutex::new(BTreeMap::new()),
            asking: std::sync::Mutex::new(BTreeMap::new()),
            in_flight: std::sync::Mutex::new(BTreeMap::new()),
        }
    }

    /// Where proxied calls that end outside a run's record are audited (the first log set wins).
    pub fn set_audit(&self, log: Arc<crate::audit::AuditLog>) {
        let _ = self.audit.set(log);
    }

    /// The audit log, once the server has set it.
    pub fn audit(&self) -> Option<&Arc<crate::audit::AuditLog>> {
        self.audit.get()
    }

    /// Delivers one call's summary: counted if its look-up failed, into its run's record while
    /// the run lasts, otherwise audited on a line of its own.
    fn deliver(&self, session: &str, sink: Option<&CallSink>, summary: CallSummary) {
        if summary.lookup_failed {
            if let Some(sink) = sink {
                sink.lookups_failed
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
            return;
        }
        let summary = match sink {
            Some(sink) => match sink.summaries.try_send(summary) {
                Ok(()) => return,
                Err(tokio::sync::mpsc::error::TrySendError::Full(s)) => {
                    sink.omitted
                        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    // Past the run's list, calls the host refused without asking anyone or
                    // reaching the server are counted only: a loop of them is cheap to make
                    // and would otherwise be a line each.
                    if matches!(
                        s.outcome,
                        CallOutcome::Denied | CallOutcome::Refused | CallOutcome::Declined
                    ) {
                        return;
                    }
                    s
                }
                Err(tokio::sync::mpsc::error::TrySendError::Closed(s)) => s,
            },
            None => summary,
        };
        if let Some(log) = self.audit.get() {
            let entry =
                crate::audit::AuditEntry::call_alone(session, sink.map(|s| s.run), &summary);
            log.append(&entry);
        }
    }

    /// Sets how the user is asked about calls made by runs of `session` (set by each call that
    /// starts a run there; `None` when its client cannot ask).
    pub fn set_asker(&self, session: &str, asker: Option<Asker>) {
        let mut askers = crate::lock(&self.askers);
        match asker {
            Some(a) => askers.insert(session.to_string(), a),
            None => askers.remove(session),
        };
    }

    /// The approval questions on their way to a 2026-07-28 client.
    pub fn relay(&self) -> &Relay {
        &self.relay
    }

    /// Names and descriptions, for workers (no commands, no env), with `error` for each server
    /// that is configured but unusable: a broken entry, a failed start, or one that cannot run
    /// here (`skipped`).
    pub fn server_summaries(&self) -> Vec<Value> {
        let failures = crate::lock(&self.failures).clone();
        let mut out: Vec<Value> = self
            .upstreams
            .values()
            .map(|u| {
                let mut s = json!({"name": u.config.name, "description": u.config.description});
                if let Some(why) = failures.get(&u.config.name) {
                    s["error"] = json!(why);
                }
                s
            })
            .collect();
        // `config_broken`: the `mcp` module's proxy for it fails at once, naming the fix.
        for (name, why) in &self.broken {
            out.push(
                json!({"name": name, "description": null, "error": why, "config_broken": true}),
            );
        }
        for s in &self.skipped {
            out.push(json!({"name": s.name, "description": null, "error": s.reason}));
        }
        for (source, why) in self.unreadable_sources() {
            out.push(
                json!({"name": source, "description": "an MCP server configuration",
                             "error": why, "config_broken": true}),
            );
        }
        out
    }

    /// Configuration sources that could not be read as a whole (a trailing comma), with what
    /// the model is told: their servers are missing, and why.
    fn unreadable_sources(&self) -> Vec<(&str, String)> {
        self.problems
            .iter()
            .filter(|p| p.server.is_none())
            .map(|p| {
                (
                    p.source.as_str(),
                    format!("its configuration is broken, so servers it names may be missing: {p}. Fix it and restart ironcell"),
                )
            })
            .collect()
    }

    /// The configuration problems that left something out (a source or an entry not loaded),
    /// as opposed to warnings about an entry that loaded: `doctor` is not ready while any.
    pub fn breaking_problems(&self) -> Vec<String> {
        self.problems
            .iter()
            .filter(|p| {
                p.server
                    .as_ref()
                    .is_none_or(|s| !self.upstreams.contains_key(s))
            })
            .map(ToString::to_string)
            .collect()
    }

    /// Every configured server that can be started here.
    pub fn server_names(&self) -> Vec<String> {
        self.upstreams.keys().cloned().collect()
    }

    /// Configured servers that cannot run here, and why.
    pub fn skipped(&self) -> &[SkippedServer] {
        &self.skipped
    }

    /// Servers that cannot be used right now, and why (for discovery and search answers).
    pub fn unavailable(&self) -> Vec<Value> {
        let failures = crate::lock(&self.failures).clone();
        failures
            .iter()
            .chain(&self.broken)
            .map(|(name, why)| json!({"server": name, "error": why}))
            .chain(
                self.skipped
                    .iter()
                    .map(|s| json!({"server": s.name, "error": s.reason})),
            )
            .chain(
                self.unreadable_sources()
                    .into_iter()
                    .map(|(source, why)| json!({"server": source, "error": why})),
            )
            .collect()
    }

    /// The server's tool catalog, remembering whether it could be had.
    async fn catalog(&self, server: &str) -> Result<Arc<upstream::ToolCatalog>, BridgeError> {
        let upstream = self.upstream(server)?;
        self.note_failure(server, upstream.tools().await)
    }

    /// Remembers whether the last use of `server` failed (shown by `servers()` and search).
    fn note_failure<T>(
        &self,
        server: &str,
        result: Result<T, BridgeError>,
    ) -> Result<T, BridgeError> {
        let mut failures = crate::lock(&self.failures);
        match &result {
            Ok(_) => {
                failures.remove(server);
            }
            Err(e) if e.kind == ErrorKind::Unavailable => {
                failures.insert(server.to_string(), e.message.clone());
            }
            // An unknown tool: the server answered.
            Err(_) => {
                failures.remove(server);
            }
        }
        result
    }

    /// For `system://info`: servers, whether running, where they came from, what was wrong.
    pub async fn describe(&self) -> Value {
        let failures = crate::lock(&self.failures).clone();
        let mut servers = Vec::new();
        for u in self.upstreams.values() {
            let version = u.protocol_version();
            servers.push(json!({
                "name": u.config.name,
                "description": u.config.description,
                "command": u.config.command,
                "source": u.config.source,
                "running": u.is_running().await,
                // The era it speaks (known once it has started): "2026-07-28" for
                // server/discover, a handshake version for initialize.
                "protocol_version": version.as_ref().map(ToString::to_string),
                "era": version.map(|v| if v.has_initialize() { "initialize" } else { "discover" }),
                "rules": u.config.rules,
                // Why its last start or listing failed (with its last stderr lines), if it did.
                "error": failures.get(&u.config.name),
            }));
        }
        json!({
            "servers": servers,
            "approval": self.approval,
            "sources": self.sources,
            "skipped": self.skipped,
            "problems": self.problems.iter().map(|p| p.to_string()).collect::<Vec<_>>(),
        })
    }

    fn upstream(&self, name: &str) -> Result<&Arc<Upstream>, BridgeError> {
        if let Some(why) = self.broken.get(name) {
            return Err(BridgeError::unavailable(format!(
                "MCP server {name:?} is unavailable: {why}"
            )));
        }
        self.upstreams.get(name).ok_or_else(|| {
            BridgeError::new(
                ErrorKind::UnknownServer,
                format!(
                    "no MCP server {name:?}; configured: {}",
                    if self.upstreams.is_empty() {
                        "(none; see MCP_BRIDGE_CONFIG)".to_string()
                    } else {
                        self.upstreams
                            .keys()
                            .cloned()
                            .collect::<Vec<_>>()
                            .join(", ")
                    }
                ),
            )
        })
    }

    /// Starts the named servers in the background (unknown names are reported back).
    pub fn prestart(&self, names: &[String]) -> Vec<String> {
        let mut unknown = Vec::new();
        for n in names {
            match self.upstreams.get(n) {
                Some(u) => u.prestart(),
                None => unknown.push(n.clone()),
            }
        }
        unknown
    }

    /// The tools code may see: what the server lists, minus what the rules deny. Each keeps
    /// its annotations (`readOnlyHint`, `destructiveHint`, …) so code can read them too.
    pub async fn tools_json(&self, server: &str) -> Result<Value, BridgeError> {
        let upstream = self.upstream(server)?;
        let catalog = self.catalog(server).await?;
        let visible: Vec<&rmcp::model::Tool> = catalog
            .tools
            .iter()
            .filter(|t| !upstream.config.rules.hides(server, t))
            .collect();
        serde_json::to_value(&visible).map_err(|e| BridgeError::unavailable(e.to_string()))
    }

    /// One tool as code may see it, or the error a call of it would get: unknown, or hidden
    /// by a rule (named). What `mcp_<server>.<tool>` asks for a name its list lacks.
    pub async fn tool_json(&self, server: &str, tool: &str) -> Result<Value, BridgeError> {
        let (_, resolved, _) = self.resolve_visible(server, tool).await?;
        serde_json::to_value(&resolved.entry).map_err(|e| BridgeError::unavailable(e.to_string()))
    }

    /// `tool` of `server` as code may reach it, and why its call needs approval if it does (a
    /// hidden tool is the error a call gets). A name the patterns hide is refused before it is
    /// looked up, so the answer does not say whether the server has it.
    async fn resolve_visible(
        &self,
        server: &str,
        tool: &str,
    ) -> Result<(&Upstream, upstream::Resolved, Option<String>), BridgeError> {
        let upstream = self.upstream(server)?;
        let denied = |why: &str| {
            BridgeError::new(
                ErrorKind::Denied,
                format!("{why} (in {}); code cannot call it", upstream.config.source),
            )
        };
        if let Some(why) = upstream.config.rules.hides_name(server, tool) {
            return Err(denied(&why));
        }
        let resolved = match self.note_failure(server, upstream.resolve(tool).await) {
            // On a readOnly server, a missing name is answered as a hidden one is (#149).
            Err(e) if e.kind == ErrorKind::UnknownTool && upstream.config.rules.read_only => {
                return Err(denied(&rules::read_only_denial(server, tool)));
            }
            other => other?,
        };
        match upstream
            .config
            .rules
            .verdict(server, tool, Hints::of(&resolved.entry))
        {
            Verdict::Denied(why) => Err(denied(&why)),
            Verdict::NeedsApproval(why) => Ok((upstream, resolved, Some(why))),
            Verdict::Allowed => Ok((upstream, resolved, None)),
        }
    }

    pub async fn search(&self, query: &str, limit: usize) -> Value {
        let fetches = self
            .upstreams
            .values()
            .map(|u| async move { (u, self.catalog(&u.config.name).await) });
        let mut catalogs = Vec::new();
        for (u, tools) in futures::future::join_all(fetches).await {
            match tools {
                Ok(c) => catalogs.push((u, c)),
                Err(e) => {
                    tracing::warn!(server = %u.config.name, error = %e.message, "left out of the search")
                }
            }
        }
        let visible = catalogs.iter().flat_map(|(u, c)| {
            c.tools
                .iter()
                .zip(c.index.iter())
                .filter(|(t, _)| !u.config.rules.hides(&u.config.name, t))
                .map(|(_, i)| i)
        });
        let hits = search::search(visible, query, limit);
        json!({"results": hits, "unavailable": self.unavailable()})
    }

    /// Calls a tool if the rules allow it and, where it needs approval, the user approved. An
    /// approved call is passed on exactly as it was shown: its canonical form.
    pub async fn call(
        &self,
        session: &str,
        run: Option<u64>,
        server: &str,
        tool: &str,
        arguments: Value,
    ) -> Result<Value, BridgeError> {
        let Value::Object(args) = arguments else {
            return Err(BridgeError::bad_request("tool arguments must be a dict"));
        };
        let (upstream, resolved, approval) = self.resolve_visible(server, tool).await?;
        let args = match approval {
            Some(why) => {
                let args = approval::canonical_map(&args);
                let declared = declared_arguments(&resolved.entry);
                let asked = Asked {
                    session,
                    run,
                    server,
                    tool,
                    args: &args,
                    declared: declared.as_deref(),
                };
                self.approve(&asked, &why, &upstream.config.source).await?;
                args
            }
            None => args,
        };
        let _slot = self.call_slot(server, session).await;
        let result = upstream.call(resolved, args, self.call_timeout).await?;
        let size = serde_json::to_string(&result).map(|s| s.len()).unwrap_or(0);
        if size > MAX_RESULT_BYTES {
            return Err(BridgeError::unavailable(format!(
                "{server}.{tool} returned {size} bytes; the limit for a proxied result is {MAX_RESULT_BYTES}"
            )));
        }
        Ok(result)
    }

    /// One of the [`MAX_CALLS_PER_SESSION`] places `session` has on `server` (waits for one).
    async fn call_slot(
        &self,
        server: &str,
        session: &str,
    ) -> Option<tokio::sync::OwnedSemaphorePermit> {
        let places = {
            let mut map = crate::lock(&self.in_flight);
            // An entry only the map holds has no call in flight.
            map.retain(|_, p| Arc::strong_count(p) > 1);
            map.entry((server.to_string(), session.to_string()))
                .or_insert_with(|| Arc::new(tokio::sync::Semaphore::new(MAX_CALLS_PER_SESSION)))
                .clone()
        };
        places.acquire_owned().await.ok()
    }

    /// Answers one request from a worker of `session` (known to the host, never taken from the
    /// frame). A tool call's summary goes to `sink` (the run's record) or, when the run is over,
    /// to the audit log, once, however the call ends.
    pub async fn handle(
        &self,
        session: &str,
        request: ProxyRequest,
        sink: Option<&CallSink>,
    ) -> Result<Value, BridgeError> {
        match request {
            ProxyRequest::Servers => Ok(json!(self.server_summaries())),
            ProxyRequest::Tools { server, tool } => {
                names_fit(&server, tool.as_deref().unwrap_or(""))?;
                match tool {
                    Some(tool) => self.tool_json(&server, &tool).await,
                    None => self.tools_json(&server).await,
                }
            }
            ProxyRequest::Search { query, limit } => {
                let limit = limit.unwrap_or(5).clamp(1, 100) as usize;
                search::check_query(&query).map_err(BridgeError::bad_request)?;
                Ok(self.search(&query, limit).await)
            }
            ProxyRequest::Call {
                server,
                tool,
                arguments,
            } => {
                self.handle_call(session, sink, server, tool, arguments)
                    .await
            }
        }
    }

    /// A worker's call of a proxied tool, recorded however it ends.
    async fn handle_call(
        &self,
        session: &str,
        sink: Option<&CallSink>,
        server: String,
        tool: String,
        args: Value,
    ) -> Result<Value, BridgeError> {
        let argument_keys = match &args {
            Value::Object(m) => m
                .keys()
                .take(MAX_SUMMARY_KEYS)
                .map(|k| crate::clip_chars(k, MAX_SUMMARY_NAME_CHARS))
                .collect(),
            _ => Vec::new(),
        };
        let audit_values = self
            .upstreams
            .get(&server)
            .is_some_and(|u| u.config.rules.audit_arguments);
        let arguments = audit_values.then(|| audited_arguments(&args));
        let mut recording = Recording {
            proxy: self,
            session,
            sink,
            started: std::time::Instant::now(),
            summary: Some(CallSummary {
                server: crate::clip_chars(&server, MAX_SUMMARY_NAME_CHARS),
                tool: crate::clip_chars(&tool, MAX_SUMMARY_NAME_CHARS),
                ok: false,
                outcome: CallOutcome::Abandoned,
                duration_ms: 0.0,
                argument_keys,
                arguments,
                lookup_failed: false,
            }),
        };
        let r = match names_fit(&server, &tool) {
            Ok(()) => {
                self.call(session, sink.map(|s| s.run), &server, &tool, args)
                    .await
            }
            Err(e) => Err(e),
        };
        let lookup_failed = r.as_ref().err().is_some_and(|e| {
            matches!(
                e.kind,
                ErrorKind::UnknownServer | ErrorKind::UnknownTool | ErrorKind::BadRequest
            )
        });
        recording.finish(CallOutcome::of(&r), lookup_failed);
        r
    }

    pub async fn shutdown(&self) {
        for u in self.upstreams.values() {
            u.stop().await;
        }
    }
}

/// The argument names a tool's `inputSchema` declares (`properties`), if it declares any.
fn declared_arguments(tool: &rmcp::model::Tool) -> Option<Vec<String>> {
    tool.input_schema
        .get("properties")
        .and_then(Value::as_object)
        .map(|p| p.keys().cloned().collect())
}

/// Server and tool names longer than [`MAX_NAME_BYTES`] are refused before anything looks them
/// up or repeats them in an error.
fn names_fit(server: &str, tool: &str) -> Result<(), BridgeError> {
    for (k, v) in [("server", server), ("tool", tool)] {
        if v.len() > MAX_NAME_BYTES {
            return Err(BridgeError::bad_request(format!(
                "a {k} name is at most {MAX_NAME_BYTES} bytes"
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The worker chooses a call's server, tool and argument names: a call that fails its
    /// look-up is counted for its run, not listed, and its error does not echo the name.
    #[tokio::test]
    async fn a_failed_look_up_is_counted_not_listed_whatever_the_worker_sent() {
        let proxy = Proxy::new(
            config::LoadedConfig::default(),
            Duration::from_secs(1),
            Duration::from_secs(1),
            ApprovalMode::default(),
        );
        let (tx, mut rx) = tokio::sync::mpsc::channel(4);
        let sink = CallSink {
            run: 1,
            summaries: tx,
            lookups_failed: Arc::new(std::sync::atomic::AtomicU64::new(0)),
            omitted: Arc::new(std::sync::atomic::AtomicU64::new(0)),
        };
        let arguments: serde_json::Map<String, Value> = (0..1000)
            .map(|i| (format!("{}{i}", "k".repeat(500)), json!("v".repeat(1000))))
            .collect();
        let request = ProxyRequest::Call {
            server: "S".repeat(1_000_000),
            tool: "t".repeat(10_000),
            arguments: Value::Object(arguments),
        };
        let e = proxy.handle("s", request, Some(&sink)).await.unwrap_err();
        assert_eq!(e.kind, ErrorKind::BadRequest, "{e}");
        let message = e.message;
        assert!(
            message.len() < 100,
            "the name is not echoed: {message:.200}"
        );
        let request = ProxyRequest::Call {
            server: "nope".into(),
            tool: "t".into(),
            arguments: json!({}),
        };
        let e = proxy.handle("s", request, Some(&sink)).await.unwrap_err();
        assert_eq!(e.kind, ErrorKind::UnknownServer, "{e}");
        assert!(rx.try_recv().is_err(), "failed look-ups are not listed");
        assert_eq!(
            sink.lookups_failed
                .load(std::sync::atomic::Ordering::Relaxed),
            2
        );
    }

    /// A call past the run's list, or after the run, is audited on a line of its own when it
    /// reached the server; one the host refused past the list is counted only.
    #[test]
    fn calls_outside_the_runs_list_are_audited_alone_or_counted() {
        let dir = std::env::temp_dir().join(format!("ironcell-deliver-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let proxy = Proxy::new(
            config::LoadedConfig::default(),
            Duration::from_secs(1),
            Duration::from_secs(1),
            ApprovalMode::default(),
        );
        let log = Arc::new(crate::audit::AuditLog::new(&dir, 1 << 20));
        proxy.set_audit(log.clone());
        let (tx, mut rx) = tokio::sync::mpsc::channel(1);
        let sink = CallSink {
            run: 7,
            summaries: tx,
            lookups_failed: Arc::new(std::sync::atomic::AtomicU64::new(0)),
            omitted: Arc::new(std::sync::atomic::AtomicU64::new(0)),
        };
        let call = |tool: &str, outcome| CallSummary {
            server: "s".into(),
            tool: tool.into(),
            ok: outcome == CallOutcome::Ok,
            outcome,
            duration_ms: 1.0,
            argument_keys: Vec::new(),
            arguments: None,
            lookup_failed: false,
        };
        proxy.deliver("a", Some(&sink), call("listed", CallOutcome::Ok));
        proxy.deliver("a", Some(&sink), call("past-ok", CallOutcome::Ok));
        proxy.deliver("a", Some(&sink), call("past-denied", CallOutcome::Denied));
        rx.close();
        proxy.deliver("a", Some(&sink), call("after", CallOutcome::Abandoned));
        let listed: Vec<String> = std::iter::from_fn(|| rx.try_recv().ok())
            .map(|c| c.tool)
            .collect();
        assert_eq!(listed, ["listed"]);
        let (lines, _) = log.read_all();
        let alone: Vec<(String, Value)> = lines
            .iter()
            .map(|e| {
                (
                    e.upstream_calls[0]["tool"]
                        .as_str()
                        .unwrap_or("")
                        .to_string(),
                    e.cause.clone().unwrap_or_default()["run"].clone(),
                )
            })
            .collect();
        assert_eq!(
            alone,
            [
                ("past-ok".to_string(), json!(7)),
                ("after".to_string(), json!(7))
            ]
        );
        assert_eq!(sink.omitted.load(std::sync::atomic::Ordering::Relaxed), 2);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn audited_arguments_are_kept_whole_only_when_small() {
        let small = json!({"path": "/data/a.csv"});
        assert_eq!(audited_arguments(&small), small);
        let big = json!({"text": "x".repeat(MAX_AUDITED_ARGUMENT_BYTES)});
        let kept = audited_arguments(&big);
        let note = kept.as_str().expect("a note instead of the values");
        assert!(
            note.contains(&format!(
                "{} bytes",
                serde_json::to_vec(&big).unwrap().len()
            )),
            "{note}"
        );
    }
}
