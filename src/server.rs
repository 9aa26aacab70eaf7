//! The MCP surface: one tool, `run_python`, and the `system://info` resource.
//!
//! Kept deliberately small, because every byte of `tools/list` sits in the model's context on
//! every turn (budget: about 300 tokens at bytes/4). Errors in the user's code, and bad
//! arguments, are `isError: true` results the model can read and act on, never JSON-RPC errors.

use std::sync::Arc;
use std::time::Duration;

use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock, DiscoverRequestMethod,
    DiscoverResult, Implementation, JsonObject, ListResourcesResult, ListToolsResult,
    PaginatedRequestParams, ReadResourceRequestParams, ReadResourceResponse, ReadResourceResult,
    Resource, ResourceContents, ServerCapabilities, ServerConfig, Tool,
};
use rmcp::service::RequestContext;
use rmcp::{ErrorData as McpError, RoleServer, ServerHandler};
use serde_json::{Value, json};

use crate::session::{RunRequest, SessionManager};

pub const TOOL_NAME: &str = "run_python";
pub const SYSTEM_INFO_URI: &str = "system://info";
pub const MANUAL_URI: &str = "ironcell://manual";
const MANUAL: &str = include_str!("../python/MANUAL.md");

/// The rmcp handler. Cheap to clone; all state lives in the [`SessionManager`].
#[derive(Clone)]
pub struct IroncellServer {
    sessions: Arc<SessionManager>,
    tool: Arc<Tool>,
}

impl IroncellServer {
    pub fn new(sessions: Arc<SessionManager>) -> Self {
        let default_timeout = sessions.settings().default_timeout.as_secs_f64();
        let tool = Arc::new(run_python_tool(default_timeout));
        IroncellServer { sessions, tool }
    }

    pub fn sessions(&self) -> &Arc<SessionManager> {
        &self.sessions
    }
}

fn run_python_tool(default_timeout_s: f64) -> Tool {
    let description = "Run Python 3 in a persistent sandboxed session (no network). Variables \
and files persist per session; the last expression's value is returned; top-level await works. \
The user's other MCP servers are callable from the code: await runtime.search_tool_docs('query'), \
await mcp_<server>.<tool>(**args) (or *_sync). Manual: resource ironcell://manual.";
    let schema = json!({
        "type": "object",
        "properties": {
            "code": {"type": "string", "description": "Python source to run"},
            "session": {"type": "string", "description": "Session name (default \"default\")"},
            "timeout_s": {"type": "number", "description": format!("Wall-clock limit in seconds (default {default_timeout_s:.0})")},
            "reset": {"type": "boolean", "description": "Start the session over first"},
            "servers": {"type": "array", "items": {"type": "string"}, "description": "MCP servers to pre-start"}
        },
        "required": ["code"]
    });
    let schema: JsonObject = match schema {
        Value::Object(m) => m,
        _ => JsonObject::new(),
    };
    Tool::new(TOOL_NAME, description, Arc::new(schema))
}

/// Turns `run_python` arguments into a request, or says exactly what is wrong with them.
pub fn parse_run_arguments(args: Option<&JsonObject>) -> Result<RunRequest, String> {
    let empty = JsonObject::new();
    let args = args.unwrap_or(&empty);
    const KNOWN: &[&str] = &["code", "session", "timeout_s", "reset", "servers"];
    if let Some(unknown) = args.keys().find(|k| !KNOWN.contains(&k.as_str())) {
        return Err(format!(
            "unknown argument {unknown:?}; run_python takes {}",
            KNOWN.join(", ")
        ));
    }
    let code = match args.get("code") {
        Some(Value::String(s)) => s.clone(),
        Some(other) => {
            return Err(format!(
                "`code` must be a string of Python source, got {}",
                type_name(other)
            ));
        }
        None => return Err("missing required argument `code` (a string of Python source)".into()),
    };
    let session = match args.get("session") {
        None | Some(Value::Null) => "default".to_string(),
        Some(Value::String(s)) => s.clone(),
        Some(other) => {
            return Err(format!(
                "`session` must be a string, got {}",
                type_name(other)
            ));
        }
    };
    let timeout = match args.get("timeout_s") {
        None | Some(Value::Null) => None,
        Some(Value::Number(n)) => match n.as_f64() {
            Some(t) if t.is_finite() && t > 0.0 && t <= 1e6 => Some(Duration::from_secs_f64(t)),
            _ => {
                return Err(format!(
                    "`timeout_s` must be a positive number of seconds, got {n}"
                ));
            }
        },
        Some(other) => {
            return Err(format!(
                "`timeout_s` must be a number of seconds, got {}",
                type_name(other)
            ));
        }
    };
    let reset = match args.get("reset") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(other) => {
            return Err(format!(
                "`reset` must be true or false, got {}",
                type_name(other)
            ));
        }
    };
    let servers = match args.get("servers") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(items)) => {
            let mut names = Vec::new();
            for item in items {
                match item {
                    Value::String(s) => names.push(s.clone()),
                    other => {
                        return Err(format!(
                            "`servers` must be a list of server names, got an item that is {}",
                            type_name(other)
                        ));
                    }
                }
            }
            names
        }
        Some(other) => {
            return Err(format!(
                "`servers` must be a list of server names, got {}",
                type_name(other)
            ));
        }
    };
    Ok(RunRequest {
        code,
        session,
        timeout,
        reset,
        servers,
    })
}

fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// The content blocks of a run's result: the text, then images inline, then links to the
/// full-size images, the files the run created, and any output that was cut.
fn result_content(
    record: &crate::output::RunRecord,
    mode: crate::config::OutputMode,
) -> Vec<ContentBlock> {
    let mut content = vec![ContentBlock::text(record.render(mode))];
    for (data, mime) in &record.inline_images {
        content.push(ContentBlock::image(data.clone(), mime.clone()));
    }
    let link = |uri: &str, name: &str, mime: &str, size: u64, what: &str| {
        let mut r = Resource::new(uri, name)
            .with_mime_type(mime)
            .with_description(what);
        r.size = Some(size);
        ContentBlock::resource_link(r)
    };
    for img in &record.images {
        content.push(link(
            &img.uri,
            &img.path,
            &img.mime,
            img.bytes,
            "full-size image",
        ));
    }
    for f in &record.files {
        content.push(link(
            &f.uri,
            &f.path,
            f.mime,
            f.size,
            "file written by this run",
        ));
    }
    for (stream, cut) in [
        ("stdout", &record.stdout_truncated),
        ("stderr", &record.stderr_truncated),
    ] {
        if let Some(c) = cut
            && let (Some(uri), Some(file)) = (&c.uri, &c.file)
        {
            content.push(link(
                uri,
                file,
                "text/plain",
                c.total_bytes,
                &format!("the whole {stream} of this run"),
            ));
        }
    }
    content
}

fn error_result(message: impl Into<String>) -> CallToolResult {
    CallToolResult::error(vec![ContentBlock::text(format!(
        "error: {}",
        message.into()
    ))])
}

impl ServerHandler for IroncellServer {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(
            ServerCapabilities::builder()
                .enable_tools()
                .enable_resources()
                .build(),
        )
        .with_server_info(Implementation::new("ironcell", env!("CARGO_PKG_VERSION")))
        .with_instructions(
            "ironcell runs Python in kernel-sandboxed sessions via the run_python tool. \
                 Read system://info for the interpreter, limits and sandbox in force.",
        )
    }

    /// SDK 2.x clients probe with `server/discover` first and fall back to `initialize` on an
    /// error; answering at once (rather than not at all) saves them a 10 s stall. Sessions are
    /// stateful, so ironcell asks for the `initialize` lifecycle: "method not found".
    async fn discover(
        &self,
        _context: RequestContext<RoleServer>,
    ) -> Result<DiscoverResult, McpError> {
        Err(McpError::method_not_found::<DiscoverRequestMethod>())
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, McpError> {
        Ok(ListToolsResult::with_all_items(vec![(*self.tool).clone()]))
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, McpError> {
        if request.name != TOOL_NAME {
            return Ok(error_result(format!(
                "unknown tool {:?}; the only tool is {TOOL_NAME}",
                request.name
            ))
            .into());
        }
        let run = match parse_run_arguments(request.arguments.as_ref()) {
            Ok(r) => r,
            Err(message) => return Ok(error_result(message).into()),
        };
        let record = match self.sessions.run(run, context.ct.clone()).await {
            Ok(record) => record,
            Err(refusal) => return Ok(error_result(refusal.to_string()).into()),
        };
        let content = result_content(&record, self.sessions.settings().output_mode);
        let mut result = if record.is_error() {
            CallToolResult::error(content)
        } else {
            CallToolResult::success(content)
        };
        result.structured_content = serde_json::to_value(&record).ok();
        Ok(result.into())
    }

    async fn list_resources(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListResourcesResult, McpError> {
        let info = Resource::new(SYSTEM_INFO_URI, "system-info")
            .with_description(
                "OS, CPU, memory, Python, session limits and sandbox of this ironcell",
            )
            .with_mime_type("application/json");
        let manual = Resource::new(MANUAL_URI, "manual")
            .with_description("How to use run_python and the in-sandbox mcp API")
            .with_mime_type("text/markdown");
        let mut all = vec![info, manual];
        for (session, rel, size) in self.sessions.session_files(500) {
            let uri = crate::files::session_uri(&session, &rel);
            let mut r = Resource::new(uri, format!("{session}/{rel}"))
                .with_mime_type(crate::files::mime_for(&rel));
            r.size = Some(size);
            all.push(r);
        }
        Ok(ListResourcesResult::with_all_items(all))
    }

    async fn read_resource(
        &self,
        request: ReadResourceRequestParams,
        _context: RequestContext<RoleServer>,
    ) -> Result<ReadResourceResponse, McpError> {
        if let Some((session, rel)) = crate::files::parse_uri(&request.uri) {
            let bytes = self
                .sessions
                .read_session_file(session, rel)
                .map_err(|e| McpError::resource_not_found(e, None))?;
            let mime = crate::files::mime_for(rel);
            let contents = match String::from_utf8(bytes) {
                Ok(text)
                    if crate::files::is_text_mime(mime) || mime == "application/octet-stream" =>
                {
                    ResourceContents::text(text, request.uri.clone()).with_mime_type(
                        if mime == "application/octet-stream" {
                            "text/plain"
                        } else {
                            mime
                        },
                    )
                }
                Ok(text) => {
                    use base64::Engine;
                    ResourceContents::blob(
                        base64::engine::general_purpose::STANDARD.encode(text),
                        request.uri.clone(),
                    )
                    .with_mime_type(mime)
                }
                Err(e) => {
                    use base64::Engine;
                    ResourceContents::blob(
                        base64::engine::general_purpose::STANDARD.encode(e.into_bytes()),
                        request.uri.clone(),
                    )
                    .with_mime_type(mime)
                }
            };
            return Ok(ReadResourceResult::new(vec![contents]).into());
        }
        if request.uri == MANUAL_URI {
            let contents =
                ResourceContents::text(MANUAL, MANUAL_URI).with_mime_type("text/markdown");
            return Ok(ReadResourceResult::new(vec![contents]).into());
        }
        if request.uri != SYSTEM_INFO_URI {
            return Err(McpError::resource_not_found(
                format!(
                    "no resource {:?}; available: {SYSTEM_INFO_URI}, {MANUAL_URI}",
                    request.uri
                ),
                None,
            ));
        }
        let info = crate::system_info::collect(&self.sessions).await;
        let text = serde_json::to_string_pretty(&info).unwrap_or_default();
        let contents =
            ResourceContents::text(text, SYSTEM_INFO_URI).with_mime_type("application/json");
        Ok(ReadResourceResult::new(vec![contents]).into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(v: Value) -> JsonObject {
        match v {
            Value::Object(m) => m,
            _ => unreachable!(),
        }
    }

    #[test]
    fn arguments_get_defaults() {
        let r = parse_run_arguments(Some(&args(json!({"code": "1+1"})))).unwrap();
        assert_eq!(r.session, "default");
        assert!(r.timeout.is_none());
        assert!(!r.reset);
    }

    #[test]
    fn wrong_argument_types_say_what_was_expected() {
        let cases = [
            (json!({}), "missing required argument `code`"),
            (json!({"code": 5}), "`code` must be a string"),
            (
                json!({"code": "x", "session": 3}),
                "`session` must be a string",
            ),
            (
                json!({"code": "x", "timeout_s": "10"}),
                "`timeout_s` must be a number",
            ),
            (json!({"code": "x", "timeout_s": -1}), "positive number"),
            (
                json!({"code": "x", "reset": "yes"}),
                "`reset` must be true or false",
            ),
            (json!({"code": "x", "cod": "y"}), "unknown argument \"cod\""),
        ];
        for (input, expected) in cases {
            let err = parse_run_arguments(Some(&args(input.clone()))).unwrap_err();
            assert!(err.contains(expected), "{input} -> {err}");
        }
    }

    #[test]
    fn the_tool_list_fits_the_token_budget() {
        let tools = ListToolsResult::with_all_items(vec![run_python_tool(30.0)]);
        let bytes = serde_json::to_string(&tools).unwrap().len();
        assert!(
            bytes / 4 <= 300,
            "tools/list is {bytes} bytes (~{} tokens)",
            bytes / 4
        );
    }
}
