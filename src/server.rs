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
    PaginatedRequestParams, ProgressNotificationParam, ReadResourceRequestParams,
    ReadResourceResponse, ReadResourceResult, Resource, ResourceContents, ServerCapabilities,
    ServerConfig, Tool,
};
use rmcp::service::RequestContext;
use rmcp::{ErrorData as McpError, RoleServer, ServerHandler};
use serde_json::{Value, json};

use crate::jobs::{Job, Jobs};
use crate::session::{RunRequest, SessionManager};

pub const TOOL_NAME: &str = "run_python";
pub const JOB_TOOL_NAME: &str = "run_python_job";
pub const SYSTEM_INFO_URI: &str = "system://info";
pub const MANUAL_URI: &str = "ironcell://manual";
const MANUAL: &str = include_str!("../python/MANUAL.md");

/// The rmcp handler. Cheap to clone; all state lives in the [`SessionManager`].
#[derive(Clone)]
pub struct IroncellServer {
    sessions: Arc<SessionManager>,
    jobs: Arc<Jobs>,
    tools: Arc<Vec<Tool>>,
}

impl IroncellServer {
    pub fn new(sessions: Arc<SessionManager>) -> Self {
        let default_timeout = sessions.settings().default_timeout.as_secs_f64();
        let tools = Arc::new(vec![run_python_tool(default_timeout), job_tool()]);
        let audit = crate::audit::AuditLog::new(
            &sessions.settings().resolved_state_dir(),
            sessions.settings().audit_max_bytes,
        );
        IroncellServer {
            sessions,
            jobs: Arc::new(Jobs::with_audit(Arc::new(audit))),
            tools,
        }
    }

    /// Waits for `job` up to `limit`, sending progress notifications if the client asked for
    /// them; returns the tool result (the run's, or "still running").
    async fn await_job(
        &self,
        job: &Arc<Job>,
        limit: Duration,
        context: &RequestContext<RoleServer>,
    ) -> CallToolResult {
        let forward = context.meta.get_progress_token().map(|token| {
            let mut rx = job.progress.clone();
            let peer = context.peer.clone();
            tokio::spawn(async move {
                while rx.changed().await.is_ok() {
                    let p = rx.borrow_and_update().clone();
                    let mut message = format!("running for {:.0} s", p.elapsed_s);
                    if !p.recent_output.is_empty() {
                        message.push('\n');
                        message.push_str(&p.recent_output);
                    }
                    let note = ProgressNotificationParam::new(token.clone(), p.elapsed_s)
                        .with_message(message);
                    if peer.notify_progress(note).await.is_err() {
                        break;
                    }
                }
            })
        });
        let outcome = tokio::select! {
            o = job.wait(limit) => o,
            _ = context.ct.cancelled() => {
                // notifications/cancelled: interrupt (then kill after the grace period).
                job.cancel.cancel();
                job.wait(self.sessions.settings().interrupt_grace + Duration::from_secs(5)).await
            }
        };
        if let Some(task) = forward {
            task.abort();
        }
        match outcome {
            Some(outcome) => {
                self.jobs.remove(&job.id);
                match &*outcome {
                    Ok(record) => run_result(record, self.sessions.settings().output_mode),
                    Err(refusal) => error_result(refusal.clone()),
                }
            }
            None => {
                job.detached
                    .store(true, std::sync::atomic::Ordering::SeqCst);
                running_result(job)
            }
        }
    }

    async fn call_run_python(
        &self,
        args: Option<&JsonObject>,
        context: &RequestContext<RoleServer>,
    ) -> CallToolResult {
        let run = match parse_run_arguments(args) {
            Ok(r) => r,
            Err(message) => return error_result(message),
        };
        if let Some(id) = self.jobs.running_in(&run.session) {
            return error_result(format!(
                "session {:?} is busy with background job {id}; wait for it with {JOB_TOOL_NAME}(job={id:?}), cancel it with action=\"cancel\", or use another session",
                run.session
            ));
        }
        let budget = self.sessions.settings().wait_budget;
        // Approval questions for proxied calls go to the client that asked for this run.
        self.sessions.proxy().attach_client(context.peer.clone());
        let job = self.jobs.start(self.sessions.clone(), run);
        self.await_job(&job, budget, context).await
    }

    async fn call_job_tool(
        &self,
        args: Option<&JsonObject>,
        context: &RequestContext<RoleServer>,
    ) -> CallToolResult {
        let empty = JsonObject::new();
        let args = args.unwrap_or(&empty);
        let Some(id) = args.get("job").and_then(Value::as_str) else {
            return error_result("missing required argument `job` (the id a running result named)");
        };
        let Some(job) = self.jobs.get(id) else {
            let known = self.jobs.ids();
            return error_result(format!(
                "no job {id:?} (finished jobs are kept until read, or an hour); known: {}",
                if known.is_empty() {
                    "none".to_string()
                } else {
                    known.join(", ")
                }
            ));
        };
        let budget = self.sessions.settings().wait_budget;
        let wait = match args.get("wait_s") {
            None | Some(Value::Null) => budget,
            Some(Value::Number(n)) => match n.as_f64() {
                Some(t) if t.is_finite() && t >= 0.0 => Duration::from_secs_f64(t).min(budget),
                _ => return error_result("`wait_s` must be a non-negative number of seconds"),
            },
            Some(_) => return error_result("`wait_s` must be a number of seconds"),
        };
        match args.get("action").and_then(Value::as_str).unwrap_or("wait") {
            "wait" => self.await_job(&job, wait, context).await,
            "poll" => self.await_job(&job, Duration::ZERO, context).await,
            "cancel" => {
                job.cancel.cancel();
                let grace = self.sessions.settings().interrupt_grace + Duration::from_secs(5);
                self.await_job(&job, grace, context).await
            }
            other => error_result(format!(
                "unknown action {other:?}; use \"wait\", \"poll\" or \"cancel\""
            )),
        }
    }

    pub fn sessions(&self) -> &Arc<SessionManager> {
        &self.sessions
    }
}

fn job_tool() -> Tool {
    let schema = json!({
        "type": "object",
        "properties": {
            "job": {"type": "string"},
            "action": {"type": "string", "enum": ["wait", "poll", "cancel"]},
            "wait_s": {"type": "number"}
        },
        "required": ["job"]
    });
    let schema: JsonObject = match schema {
        Value::Object(m) => m,
        _ => JsonObject::new(),
    };
    Tool::new(
        JOB_TOOL_NAME,
        "Result of a run_python call that went on as a background job: wait (default), poll or cancel.",
        Arc::new(schema),
    )
}

/// The tool result of a finished run.
fn run_result(
    record: &crate::output::RunRecord,
    mode: crate::config::OutputMode,
) -> CallToolResult {
    let content = result_content(record, mode);
    let mut result = if record.is_error() {
        CallToolResult::error(content)
    } else {
        CallToolResult::success(content)
    };
    result.structured_content = serde_json::to_value(record).ok();
    result
}

/// The tool result of a run that is still going: which job, how to get its outcome, and its
/// newest output.
fn running_result(job: &Job) -> CallToolResult {
    let p = job.progress.borrow().clone();
    let elapsed = job.started.elapsed().as_secs_f64();
    let mut text = format!(
        "[running] still running after {elapsed:.0} s as background job {id} (session {session:?}). \
         Get its result with {JOB_TOOL_NAME}(job={id:?}) (waits), check with action=\"poll\", stop it with action=\"cancel\".",
        id = job.id,
        session = job.session
    );
    if !p.recent_output.is_empty() {
        text.push_str("\nNewest output:\n");
        text.push_str(&p.recent_output);
    }
    let mut result = CallToolResult::success(vec![ContentBlock::text(text)]);
    result.structured_content = Some(json!({
        "status": "running",
        "job": job.id,
        "session": job.session,
        "elapsed_s": elapsed,
        "stdout_bytes": p.stdout_bytes,
        "stderr_bytes": p.stderr_bytes,
        "recent_output": p.recent_output,
    }));
    result
}

fn run_python_tool(default_timeout_s: f64) -> Tool {
    let description = "Run Python 3 in a persistent sandboxed session (no network): variables \
and files persist, the last expression's value is returned, top-level await works. Call the \
user's other MCP servers from the code: await runtime.search_tool_docs('query'), await \
mcp_<server>.<tool>(**args). Manual: ironcell://manual";
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
        progress: None,
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
        Ok(ListToolsResult::with_all_items((*self.tools).clone()))
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, McpError> {
        let result = match request.name.as_ref() {
            TOOL_NAME => {
                self.call_run_python(request.arguments.as_ref(), &context)
                    .await
            }
            JOB_TOOL_NAME => {
                self.call_job_tool(request.arguments.as_ref(), &context)
                    .await
            }
            other => error_result(format!(
                "unknown tool {other:?}; the tools are {TOOL_NAME} and {JOB_TOOL_NAME}"
            )),
        };
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
        for (session, rel, size) in self.sessions.session_files(500).await {
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
                .await
                .map_err(|e| McpError::resource_not_found(e, None))?;
            let mime = crate::files::mime_for(rel);
            let text_like = crate::files::is_text_mime(mime) || mime == "application/octet-stream";
            let contents = match (text_like, String::from_utf8(bytes)) {
                (true, Ok(text)) => {
                    let mime = if mime == "application/octet-stream" {
                        "text/plain"
                    } else {
                        mime
                    };
                    ResourceContents::text(text, request.uri.clone()).with_mime_type(mime)
                }
                (_, decoded) => {
                    use base64::Engine;
                    let bytes = decoded
                        .map(String::into_bytes)
                        .unwrap_or_else(|e| e.into_bytes());
                    let blob = base64::engine::general_purpose::STANDARD.encode(bytes);
                    ResourceContents::blob(blob, request.uri.clone()).with_mime_type(mime)
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
        let tools = ListToolsResult::with_all_items(vec![run_python_tool(30.0), job_tool()]);
        let bytes = serde_json::to_string(&tools).unwrap().len();
        assert!(
            bytes / 4 <= 300,
            "tools/list is {bytes} bytes (~{} tokens)",
            bytes / 4
        );
    }
}
