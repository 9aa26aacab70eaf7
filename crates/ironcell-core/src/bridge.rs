//! The bridge contract: what a worker's `mcp` module may ask the host (a `request` frame's
//! `method` and `params`), how the host says no, and the summaries it keeps of proxied calls.
//!
//! Types only, no policy: the host parses a request once, at the edge ([`Request::parse`]),
//! and hands the typed request to the code for its kind (the host's router); the worker crate
//! builds its own error answers from [`BridgeError`]. The Python side (`python/mcp`) is checked
//! against [`ErrorKind::ALL`] and [`Method::ALL`] by this module's tests, so the copies cannot
//! drift.
//!
//! Parsing is lenient in the way the host always was: a missing or mistyped name reads as `""`
//! (answered "no such server/tool"), so a bad field is refused by the code that owns it, with
//! its own message. Only a memory key that is not a string is refused here.

use serde_json::{Value, json};

/// The `kind` of a request's error answer (`{"error": {"kind", "message"}}`), which the
/// in-sandbox `mcp` module turns into its exception class ([`ErrorKind::python_exception`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorKind {
    /// No configured server of that name.
    UnknownServer,
    /// The server has no tool of that name.
    UnknownTool,
    /// The server (or the store) could not be reached or failed.
    Unavailable,
    /// The request itself was wrong.
    BadRequest,
    /// The configuration's rules hide the tool.
    Denied,
    /// The user did not approve the call.
    Declined,
    /// The call needed approval that could not be asked for (or a tool raised).
    Refused,
}

impl ErrorKind {
    pub const ALL: [ErrorKind; 7] = [
        ErrorKind::UnknownServer,
        ErrorKind::UnknownTool,
        ErrorKind::Unavailable,
        ErrorKind::BadRequest,
        ErrorKind::Denied,
        ErrorKind::Declined,
        ErrorKind::Refused,
    ];

    /// Its name on the wire.
    pub fn wire_name(self) -> &'static str {
        match self {
            ErrorKind::UnknownServer => "unknown_server",
            ErrorKind::UnknownTool => "unknown_tool",
            ErrorKind::Unavailable => "unavailable",
            ErrorKind::BadRequest => "bad_request",
            ErrorKind::Denied => "denied",
            ErrorKind::Declined => "declined",
            ErrorKind::Refused => "refused",
        }
    }

    /// The exception class the `mcp` module raises for it (its `_ERRORS` table).
    pub fn python_exception(self) -> &'static str {
        match self {
            ErrorKind::UnknownServer => "ServerNotFoundError",
            ErrorKind::UnknownTool => "ToolNotFoundError",
            ErrorKind::Unavailable => "ServerUnavailableError",
            ErrorKind::BadRequest => "_BadRequest",
            ErrorKind::Denied | ErrorKind::Declined | ErrorKind::Refused => "ToolError",
        }
    }
}

/// Why a request failed: `kind` becomes the Python exception class, `message` its text.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct BridgeError {
    pub kind: ErrorKind,
    pub message: String,
}

impl BridgeError {
    pub fn new(kind: ErrorKind, message: String) -> Self {
        BridgeError { kind, message }
    }
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Unavailable, message.into())
    }
    pub fn unknown_tool(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::UnknownTool, message.into())
    }
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::BadRequest, message.into())
    }

    /// The answer's payload: `{"error": {"kind", "message"}}`.
    pub fn payload(&self) -> Value {
        json!({"error": {"kind": self.kind, "message": self.message}})
    }
}

/// The payload of a request's answer: `{"result": …}` or the error's.
pub fn answer_payload(answer: Result<Value, BridgeError>) -> Value {
    match answer {
        Ok(result) => json!({ "result": result }),
        Err(e) => e.payload(),
    }
}

/// A `memory.<op>` request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemoryOp {
    Save,
    Load,
    Delete,
    List,
}

/// A `tools.<op>` request (the local tools).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolsOp {
    /// The tools session answers a call the host made (only it may).
    Result,
    /// The tools session answers with the catalog it loaded (only it may).
    Catalog,
    /// The tools a session can call.
    List,
    /// A call of one tool.
    Call,
    /// `save_tool`.
    Save,
    /// Deletes a saved tool.
    Delete,
}

/// A request's `method`, by its wire name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Method {
    /// `servers`: the configured servers and their state.
    Servers,
    /// `tools`: one server's tools (or one of them).
    Tools,
    /// `search`: tools matching a query, across servers.
    Search,
    /// `call`: a call of one server's tool.
    Call,
    /// `memory.<op>`.
    Memory(MemoryOp),
    /// `tools.<op>`.
    LocalTools(ToolsOp),
    /// `files.changed`: what the change tracker saw the session change since its last listing.
    ChangedFiles,
    /// `packages.install`: `%pip install` in a cell (the host's package store).
    PackagesInstall,
    /// `files.set_times`: a file's times, set by the host (the sandbox refuses `utime`).
    SetTimes,
    /// `session.fork`: `mcp.fork(name)`, a fork of this session made when its run ends.
    SessionFork,
}

const MEMORY_OPS: [(&str, MemoryOp); 4] = [
    ("save", MemoryOp::Save),
    ("load", MemoryOp::Load),
    ("delete", MemoryOp::Delete),
    ("list", MemoryOp::List),
];
const TOOLS_OPS: [(&str, ToolsOp); 6] = [
    ("result", ToolsOp::Result),
    ("catalog", ToolsOp::Catalog),
    ("list", ToolsOp::List),
    ("call", ToolsOp::Call),
    ("save", ToolsOp::Save),
    ("delete", ToolsOp::Delete),
];

impl Method {
    /// Every method, each once.
    pub const ALL: [Method; 18] = [
        Method::Servers,
        Method::Tools,
        Method::Search,
        Method::Call,
        Method::Memory(MemoryOp::Save),
        Method::Memory(MemoryOp::Load),
        Method::Memory(MemoryOp::Delete),
        Method::Memory(MemoryOp::List),
        Method::LocalTools(ToolsOp::Result),
        Method::LocalTools(ToolsOp::Catalog),
        Method::LocalTools(ToolsOp::List),
        Method::LocalTools(ToolsOp::Call),
        Method::LocalTools(ToolsOp::Save),
        Method::LocalTools(ToolsOp::Delete),
        Method::ChangedFiles,
        Method::PackagesInstall,
        Method::SetTimes,
        Method::SessionFork,
    ];

    /// Its name on the wire.
    pub fn wire_name(self) -> String {
        fn op_name<T: PartialEq + Copy>(ops: &[(&'static str, T)], op: T) -> &'static str {
            ops.iter().find(|(_, o)| *o == op).map_or("", |(n, _)| n)
        }
        match self {
            Method::Servers => "servers".into(),
            Method::Tools => "tools".into(),
            Method::Search => "search".into(),
            Method::Call => "call".into(),
            Method::Memory(op) => format!("memory.{}", op_name(&MEMORY_OPS, op)),
            Method::LocalTools(op) => format!("tools.{}", op_name(&TOOLS_OPS, op)),
            Method::ChangedFiles => "files.changed".into(),
            Method::PackagesInstall => "packages.install".into(),
            Method::SetTimes => "files.set_times".into(),
            Method::SessionFork => "session.fork".into(),
        }
    }

    /// Reads a method name; an unknown one is a bad request that names it.
    pub fn parse(method: &str) -> Result<Method, BridgeError> {
        fn op<T: Copy>(ops: &[(&str, T)], name: &str, what: &str) -> Result<T, BridgeError> {
            ops.iter()
                .find(|(n, _)| *n == name)
                .map(|(_, o)| *o)
                .ok_or_else(|| BridgeError::bad_request(format!("unknown {what} {name:?}")))
        }
        if let Some(name) = method.strip_prefix("memory.") {
            return op(&MEMORY_OPS, name, "memory operation").map(Method::Memory);
        }
        if let Some(name) = method.strip_prefix("tools.") {
            return op(&TOOLS_OPS, name, "tools operation").map(Method::LocalTools);
        }
        match method {
            "servers" => Ok(Method::Servers),
            "tools" => Ok(Method::Tools),
            "search" => Ok(Method::Search),
            "call" => Ok(Method::Call),
            "files.changed" => Ok(Method::ChangedFiles),
            "packages.install" => Ok(Method::PackagesInstall),
            "files.set_times" => Ok(Method::SetTimes),
            "session.fork" => Ok(Method::SessionFork),
            _ => Err(BridgeError::bad_request(format!(
                "unknown bridge method {method:?}"
            ))),
        }
    }
}

/// A request to the proxy (the user's other MCP servers).
#[derive(Debug, Clone, PartialEq)]
pub enum ProxyRequest {
    Servers,
    /// One server's tools, or the one named `tool`.
    Tools {
        server: String,
        tool: Option<String>,
    },
    /// `limit` as sent (the proxy clamps it).
    Search {
        query: String,
        limit: Option<u64>,
    },
    /// `arguments` as sent (the proxy refuses anything but an object).
    Call {
        server: String,
        tool: String,
        arguments: Value,
    },
}

/// A request to the memory store.
#[derive(Debug, Clone, PartialEq)]
pub enum MemoryRequest {
    /// `metadata` as sent (the store refuses anything but an object or null).
    Save {
        key: String,
        value: Value,
        metadata: Value,
    },
    Load {
        key: String,
    },
    Delete {
        key: String,
    },
    List,
}

/// A request to the local tools.
#[derive(Debug, Clone, PartialEq)]
pub enum ToolsRequest {
    /// The tools session's answer under `token` (`tools.result` or `tools.catalog`): the
    /// whole `params` object is the answer.
    Answer {
        op: ToolsOp,
        token: String,
        answer: Value,
    },
    List,
    Call {
        name: String,
        arguments: Value,
    },
    /// Each `None` when not a string.
    Save {
        name: Option<String>,
        source: Option<String>,
    },
    Delete {
        name: String,
    },
}

/// One request from a worker, parsed.
#[derive(Debug, Clone, PartialEq)]
pub enum Request {
    Proxy(ProxyRequest),
    Memory(MemoryRequest),
    Tools(ToolsRequest),
    ChangedFiles,
    /// `packages.install`: its parameters (`requirements`, `source`) whole, read and refused
    /// field by field by the package store, which owns them.
    PackagesInstall(Value),
    /// `files.set_times`: `os.utime` of a file in the session directory, which the sandbox
    /// refuses (by path it would reach any file of the uid, SECURITY.md #46): the host sets the
    /// times of that regular file, fd-relative and refusing symlinks (SECURITY.md #202).
    SetTimes {
        /// Relative to the session directory, checked by [`crate::frame::session_relative_path`].
        path: String,
        atime_ns: i64,
        mtime_ns: i64,
    },
    /// `session.fork`: `mcp.fork(name)`, this session forked into the new session `name` as
    /// its run leaves it (the name is checked by the session manager, which owns names).
    Fork {
        name: String,
    },
}

fn take_string(params: &mut Value, key: &str) -> Option<String> {
    match params.get_mut(key).map(Value::take) {
        Some(Value::String(s)) => Some(s),
        _ => None,
    }
}

fn take(params: &mut Value, key: &str) -> Option<Value> {
    params.as_object_mut()?.remove(key)
}

impl Request {
    /// Parses a request frame's `method` and `params` (an object; the frame's decoder checked
    /// that), taking the values out of `params`.
    pub fn parse(method: &str, params: Value) -> Result<Request, BridgeError> {
        let method = Method::parse(method)?;
        Self::from_params(method, params)
    }

    fn from_params(method: Method, mut p: Value) -> Result<Request, BridgeError> {
        let string = |p: &mut Value, k| take_string(p, k).unwrap_or_default();
        let memory_key = |p: &mut Value| {
            take_string(p, "key")
                .ok_or_else(|| BridgeError::bad_request("a memory key must be a string"))
        };
        Ok(match method {
            Method::Servers => Request::Proxy(ProxyRequest::Servers),
            Method::Tools => Request::Proxy(ProxyRequest::Tools {
                server: string(&mut p, "server"),
                tool: take_string(&mut p, "tool"),
            }),
            Method::Search => Request::Proxy(ProxyRequest::Search {
                query: string(&mut p, "query"),
                limit: p.get("limit").and_then(Value::as_u64),
            }),
            Method::Call => Request::Proxy(ProxyRequest::Call {
                server: string(&mut p, "server"),
                tool: string(&mut p, "tool"),
                arguments: take(&mut p, "arguments").unwrap_or_else(|| json!({})),
            }),
            Method::Memory(MemoryOp::Save) => Request::Memory(MemoryRequest::Save {
                key: memory_key(&mut p)?,
                value: take(&mut p, "value").unwrap_or(Value::Null),
                metadata: take(&mut p, "metadata").unwrap_or(Value::Null),
            }),
            Method::Memory(MemoryOp::Load) => Request::Memory(MemoryRequest::Load {
                key: memory_key(&mut p)?,
            }),
            Method::Memory(MemoryOp::Delete) => Request::Memory(MemoryRequest::Delete {
                key: memory_key(&mut p)?,
            }),
            Method::Memory(MemoryOp::List) => Request::Memory(MemoryRequest::List),
            Method::LocalTools(op @ (ToolsOp::Result | ToolsOp::Catalog)) => {
                let token = p.get("token").and_then(Value::as_str).unwrap_or("");
                Request::Tools(ToolsRequest::Answer {
                    op,
                    token: token.to_string(),
                    answer: p,
                })
            }
            Method::LocalTools(ToolsOp::List) => Request::Tools(ToolsRequest::List),
            Method::LocalTools(ToolsOp::Call) => Request::Tools(ToolsRequest::Call {
                name: string(&mut p, "name"),
                arguments: take(&mut p, "arguments").unwrap_or_else(|| json!({})),
            }),
            Method::LocalTools(ToolsOp::Save) => Request::Tools(ToolsRequest::Save {
                name: take_string(&mut p, "name"),
                source: take_string(&mut p, "source"),
            }),
            Method::LocalTools(ToolsOp::Delete) => Request::Tools(ToolsRequest::Delete {
                name: string(&mut p, "name"),
            }),
            Method::ChangedFiles => Request::ChangedFiles,
            Method::PackagesInstall => Request::PackagesInstall(p),
            Method::SetTimes => {
                let path = take_string(&mut p, "path").unwrap_or_default();
                crate::frame::session_relative_path(&path)
                    .map_err(|v| BridgeError::bad_request(v.to_string()))?;
                let time = |k: &str| {
                    p.get(k).and_then(Value::as_i64).ok_or_else(|| {
                        BridgeError::bad_request(format!("`{k}` must be an integer (ns)"))
                    })
                };
                Request::SetTimes {
                    atime_ns: time("atime_ns")?,
                    mtime_ns: time("mtime_ns")?,
                    path,
                }
            }
            Method::SessionFork => Request::Fork {
                name: take_string(&mut p, "name").ok_or_else(|| {
                    BridgeError::bad_request("a fork's session name must be a string")
                })?,
            },
        })
    }
}

/// How one proxied call ended, as the run record and the audit log show it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum CallOutcome {
    Ok,
    /// The tool answered `isError`.
    ToolError,
    /// Transport, unknown tool, unavailable server, …
    Failed,
    /// The configuration's rules.
    Denied,
    /// The user said no.
    Declined,
    /// Approval was needed and could not be had.
    Refused,
    /// The call ended without an answer: its worker went away (or the host stopped waiting)
    /// while it was in flight. It may have run upstream.
    Abandoned,
}

impl CallOutcome {
    /// How a call that got `answer` ended.
    pub fn of(answer: &Result<Value, BridgeError>) -> CallOutcome {
        match answer {
            Ok(v) if v.get("isError") == Some(&Value::Bool(true)) => CallOutcome::ToolError,
            Ok(_) => CallOutcome::Ok,
            Err(e) => match e.kind {
                ErrorKind::Denied => CallOutcome::Denied,
                ErrorKind::Declined => CallOutcome::Declined,
                ErrorKind::Refused => CallOutcome::Refused,
                _ => CallOutcome::Failed,
            },
        }
    }
}

/// One proxied call, for the run record (`upstream_calls`) and the audit log. Everything in it
/// comes from the worker's request, so the host caps each field.
#[derive(Debug, Clone, serde::Serialize)]
pub struct CallSummary {
    pub server: String,
    pub tool: String,
    pub ok: bool,
    pub outcome: CallOutcome,
    pub duration_ms: f64,
    /// The names of the arguments; their values only where the server's `auditArguments` is on.
    pub argument_keys: Vec<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub arguments: Option<Value>,
    /// The call never got past its look-up (no such server or tool, a malformed request): the
    /// audit counts these instead of listing them, so a flood of them cannot fill it.
    #[serde(skip)]
    pub lookup_failed: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_method_reads_back_from_its_wire_name() {
        for m in Method::ALL {
            assert_eq!(Method::parse(&m.wire_name()), Ok(m), "{m:?}");
        }
        let names: std::collections::BTreeSet<String> =
            Method::ALL.iter().map(|m| m.wire_name()).collect();
        assert_eq!(names.len(), Method::ALL.len());
    }

    #[test]
    fn an_unknown_method_is_a_bad_request_that_names_it() {
        let cases = [
            ("memory.wipe", "unknown memory operation \"wipe\""),
            ("tools.run", "unknown tools operation \"run\""),
            ("memory", "unknown bridge method \"memory\""),
            ("Servers", "unknown bridge method \"Servers\""),
            ("files.list", "unknown bridge method \"files.list\""),
        ];
        for (wire, message) in cases {
            let e = Method::parse(wire).unwrap_err();
            assert_eq!(
                e.payload(),
                json!({"error": {"kind": "bad_request", "message": message}})
            );
        }
    }

    #[test]
    fn error_kinds_serialize_as_their_wire_names() {
        for k in ErrorKind::ALL {
            assert_eq!(serde_json::to_value(k).unwrap(), json!(k.wire_name()));
        }
    }

    #[test]
    fn params_are_parsed_leniently_as_the_host_always_read_them() {
        let call = Request::parse("call", json!({"server": 7, "tool": "t"})).unwrap();
        assert_eq!(
            call,
            Request::Proxy(ProxyRequest::Call {
                server: String::new(),
                tool: "t".into(),
                arguments: json!({})
            })
        );
        let search = Request::parse("search", json!({"query": "q", "limit": -1})).unwrap();
        assert_eq!(
            search,
            Request::Proxy(ProxyRequest::Search {
                query: "q".into(),
                limit: None
            })
        );
        assert_eq!(
            Request::parse("session.fork", json!({"name": "b"})).unwrap(),
            Request::Fork { name: "b".into() }
        );
        let e = Request::parse("session.fork", json!({"name": ["b"]})).unwrap_err();
        assert_eq!(e.kind, ErrorKind::BadRequest);
        let e = Request::parse("memory.load", json!({"key": 1})).unwrap_err();
        assert_eq!(e, BridgeError::bad_request("a memory key must be a string"));
        let answer = json!({"token": "t1", "envelope": {"ok": true}});
        assert_eq!(
            Request::parse("tools.result", answer.clone()).unwrap(),
            Request::Tools(ToolsRequest::Answer {
                op: ToolsOp::Result,
                token: "t1".into(),
                answer
            })
        );
    }

    /// The `mcp` module's `_ERRORS` maps exactly the kinds the host sends, each to its class.
    #[test]
    fn the_python_error_table_matches_the_error_kinds() {
        let module = include_str!("../../../python/mcp/__init__.py");
        let table = module
            .split("_ERRORS = {")
            .nth(1)
            .and_then(|rest| rest.split('}').next())
            .expect("python/mcp/__init__.py defines _ERRORS = {...}");
        let python: std::collections::BTreeMap<&str, &str> = table
            .lines()
            .map(str::trim)
            .filter(|l| l.starts_with('"'))
            .filter_map(|l| {
                let (k, v) = l.split_once(':')?;
                Some((k.trim().trim_matches('"'), v.trim().trim_end_matches(',')))
            })
            .collect();
        let rust: std::collections::BTreeMap<&str, &str> = ErrorKind::ALL
            .iter()
            .map(|k| (k.wire_name(), k.python_exception()))
            .collect();
        assert_eq!(python, rust);
    }

    /// Every method the Python side sends is one the host reads, and the host reads no method
    /// the Python side never sends.
    #[test]
    fn the_python_side_sends_exactly_the_methods_of_the_contract() {
        let sources = [
            include_str!("../../../python/mcp/__init__.py"),
            include_str!("../../../python/_ironcell_runner.py"),
        ];
        let mut sent = std::collections::BTreeSet::new();
        for src in sources {
            for call in ["_request_sync(\"", "_request_async(\"", ".request(\""] {
                for piece in src.split(call).skip(1) {
                    match piece.split('"').next() {
                        // `"memory." + op`: the ops are read from `_memory`'s callers below.
                        Some("memory.") | None => {}
                        Some(name) => {
                            sent.insert(name.to_string());
                        }
                    }
                }
            }
            // `_memory(op, …)` sends "memory." + op: its callers name the op.
            for piece in src.split("_memory(\"").skip(1) {
                if let Some(op) = piece.split('"').next() {
                    sent.insert(format!("memory.{op}"));
                }
            }
        }
        for name in &sent {
            assert!(Method::parse(name).is_ok(), "Python sends unknown {name:?}");
        }
        let contract: std::collections::BTreeSet<String> =
            Method::ALL.iter().map(|m| m.wire_name()).collect();
        assert_eq!(sent, contract);
    }
}
