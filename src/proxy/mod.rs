//! The proxy: the user's other MCP servers, discoverable and callable from sandboxed Python.
//!
//! The host owns every connection to a proxied server (and every secret in their `env`). A
//! worker's `mcp` module sends `request` frames — `servers`, `tools`, `search`, `call` — and
//! [`Proxy::handle`] answers them. Names from Python are only ever lookup keys into the
//! configuration: they never reach a command line, and nothing from a tool argument is expanded.

pub mod config;
pub mod search;
pub mod upstream;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use serde_json::{Value, json};

use self::config::{ConfigProblem, LoadedConfig, SkippedServer};
use self::upstream::Upstream;

/// Largest proxied result handed to a worker (a frame must stay well under the frame limit).
pub const MAX_RESULT_BYTES: usize = 32 * 1024 * 1024;

/// Why a proxied request failed; `kind` becomes the Python exception class.
#[derive(Debug, Clone)]
pub struct ProxyError {
    /// `unknown_server`, `unknown_tool`, `unavailable`, or `bad_request`.
    pub kind: &'static str,
    pub message: String,
}

impl ProxyError {
    pub fn unavailable(message: String) -> Self {
        ProxyError {
            kind: "unavailable",
            message,
        }
    }
    pub fn unknown_tool(message: String) -> Self {
        ProxyError {
            kind: "unknown_tool",
            message,
        }
    }
    fn bad_request(message: String) -> Self {
        ProxyError {
            kind: "bad_request",
            message,
        }
    }
}

/// One proxied call, for the run record (`upstream_calls`).
#[derive(Debug, Clone, serde::Serialize)]
pub struct CallSummary {
    pub server: String,
    pub tool: String,
    pub ok: bool,
    pub duration_ms: f64,
}

pub struct Proxy {
    upstreams: BTreeMap<String, Arc<Upstream>>,
    problems: Vec<ConfigProblem>,
    /// Configured servers that cannot run here, with the reason (shown, never started).
    skipped: Vec<SkippedServer>,
    sources: Vec<String>,
    call_timeout: Duration,
}

impl Proxy {
    pub fn new(config: LoadedConfig, startup_timeout: Duration, call_timeout: Duration) -> Proxy {
        for p in &config.problems {
            tracing::warn!("MCP server configuration: {p}");
        }
        let upstreams = config
            .servers
            .into_iter()
            .map(|(name, c)| (name, Arc::new(Upstream::new(c, startup_timeout))))
            .collect();
        Proxy {
            upstreams,
            problems: config.problems,
            skipped: config.skipped,
            sources: config.sources,
            call_timeout,
        }
    }

    /// Names and descriptions, for workers (no commands, no env); servers that cannot run
    /// here come last with `"available": false` and the reason.
    pub fn server_summaries(&self) -> Vec<Value> {
        self.upstreams
            .values()
            .map(|u| json!({"name": u.config.name, "description": u.config.description}))
            .chain(self.skipped.iter().map(|s| {
                json!({"name": s.name, "description": null, "available": false, "reason": s.reason})
            }))
            .collect()
    }

    /// Configured servers that cannot run here, and why.
    pub fn skipped(&self) -> &[SkippedServer] {
        &self.skipped
    }

    /// For `system://info`: servers, whether running, where they came from, what was wrong.
    pub async fn describe(&self) -> Value {
        let mut servers = Vec::new();
        for u in self.upstreams.values() {
            servers.push(json!({
                "name": u.config.name,
                "description": u.config.description,
                "command": u.config.command,
                "source": u.config.source,
                "running": u.is_running().await,
            }));
        }
        json!({
            "servers": servers,
            "sources": self.sources,
            "skipped": self.skipped,
            "problems": self.problems.iter().map(|p| p.to_string()).collect::<Vec<_>>(),
        })
    }

    fn upstream(&self, name: &str) -> Result<&Arc<Upstream>, ProxyError> {
        self.upstreams.get(name).ok_or_else(|| ProxyError {
            kind: "unknown_server",
            message: format!(
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

    pub async fn tools_json(&self, server: &str) -> Result<Value, ProxyError> {
        let catalog = self.upstream(server)?.tools().await?;
        serde_json::to_value(&catalog.tools).map_err(|e| ProxyError::unavailable(e.to_string()))
    }

    pub async fn search(&self, query: &str, limit: usize) -> Value {
        let fetches = self
            .upstreams
            .values()
            .map(|u| async move { (u.config.name.clone(), u.tools().await) });
        let mut catalogs = Vec::new();
        for (name, tools) in futures::future::join_all(fetches).await {
            match tools {
                Ok(c) => catalogs.push(c),
                Err(e) => {
                    tracing::warn!(server = %name, error = %e.message, "left out of the search")
                }
            }
        }
        json!(search::search(
            catalogs.iter().flat_map(|c| c.index.iter()),
            query,
            limit
        ))
    }

    pub async fn call(
        &self,
        server: &str,
        tool: &str,
        arguments: Value,
    ) -> Result<Value, ProxyError> {
        let Value::Object(args) = arguments else {
            return Err(ProxyError::bad_request(
                "tool arguments must be a dict".into(),
            ));
        };
        let result = self
            .upstream(server)?
            .call(tool, args, self.call_timeout)
            .await?;
        let size = serde_json::to_string(&result).map(|s| s.len()).unwrap_or(0);
        if size > MAX_RESULT_BYTES {
            return Err(ProxyError::unavailable(format!(
                "{server}.{tool} returned {size} bytes; the limit for a proxied result is {MAX_RESULT_BYTES}"
            )));
        }
        Ok(result)
    }

    /// Answers one `request` frame from a worker: the payload for the `response` frame, and a
    /// summary when it was a tool call.
    pub async fn handle(&self, method: &str, params: &Value) -> (Value, Option<CallSummary>) {
        let started = std::time::Instant::now();
        let s = |k: &str| {
            params
                .get(k)
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_string()
        };
        let mut summary = None;
        let outcome = match method {
            "servers" => Ok(json!(self.server_summaries())),
            "tools" => self.tools_json(&s("server")).await,
            "search" => {
                let limit = params
                    .get("limit")
                    .and_then(Value::as_u64)
                    .unwrap_or(5)
                    .clamp(1, 100) as usize;
                Ok(self.search(&s("query"), limit).await)
            }
            "call" => {
                let (server, tool) = (s("server"), s("tool"));
                let args = params
                    .get("arguments")
                    .cloned()
                    .unwrap_or_else(|| json!({}));
                let r = self.call(&server, &tool, args).await;
                let ok = r
                    .as_ref()
                    .map(|v| v.get("isError") != Some(&Value::Bool(true)))
                    .unwrap_or(false);
                summary = Some(CallSummary {
                    server,
                    tool,
                    ok,
                    duration_ms: (started.elapsed().as_secs_f64() * 1e6).round() / 1000.0,
                });
                r
            }
            other => Err(ProxyError::bad_request(format!(
                "unknown bridge method {other:?}"
            ))),
        };
        let payload = match outcome {
            Ok(result) => json!({"result": result}),
            Err(e) => json!({"error": {"kind": e.kind, "message": e.message}}),
        };
        (payload, summary)
    }

    pub async fn shutdown(&self) {
        for u in self.upstreams.values() {
            u.stop().await;
        }
    }
}
