//! The MCP surface: the `run_python` and `run_python_job` tools (plus any local `@tool`
//! functions), the `system://info` and `ironcell://manual` resources and the session files,
//! and tasks for runs that outlive the wait budget.
//!
//! Kept deliberately small, because every byte of `tools/list` sits in the model's context on
//! every turn (budget: about 300 tokens at bytes/4). Errors in the user's code, and bad
//! arguments ([`arguments`]), are `isError: true` results the model can read and act on, never
//! JSON-RPC errors.

mod arguments;
#[cfg(test)]
mod handler_tests;

pub use self::arguments::parse_run_arguments;
use self::arguments::{JobAction, parse_job_arguments};

use std::borrow::Cow;
use std::sync::Arc;
use std::time::Duration;

use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, CancelTaskParams, ContentBlock,
    CreateTaskResult, DetailedTask, GetTaskParams, GetTaskResult, Implementation,
    InputRequiredResult, JsonObject, ListResourcesResult, ListToolsResult, PaginatedRequestParams,
    ProgressNotificationParam, ProtocolVersion, ReadResourceRequestParams, ReadResourceResponse,
    ReadResourceResult, Resource, ResourceContents, ServerCapabilities, ServerConfig, Task,
    TaskPayload, Tool, ToolAnnotations, UpdateTaskParams,
};
use rmcp::service::RequestContext;
use rmcp::{ErrorData as McpError, RoleServer, ServerHandler};
use serde_json::{Value, json};

use crate::jobs::{Job, Jobs};
use crate::proxy::approval::{self, Asker};
use crate::session::SessionManager;

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
    /// `@tool` functions from `--tools` files and `save_tool` (none unless in use).
    local_tools: Arc<crate::local_tools::LocalTools>,
    /// Runs at once, when limited (a principal's share under `serve --http`).
    run_slots: Option<(Arc<tokio::sync::Semaphore>, u32)>,
}

impl IroncellServer {
    pub fn new(sessions: Arc<SessionManager>) -> Self {
        let default_timeout = sessions.settings().default_timeout.as_secs_f64();
        let proxies = !sessions.proxy().server_summaries().is_empty();
        let tools = Arc::new(vec![run_python_tool(default_timeout, proxies), job_tool()]);
        let audit =
            crate::audit::AuditLog::new(sessions.state_dir(), sessions.settings().audit_max_bytes);
        let audit = Arc::new(audit);
        sessions.proxy().set_audit(audit.clone());
        let local_tools = crate::local_tools::LocalTools::start(&sessions);
        IroncellServer {
            sessions,
            jobs: Arc::new(Jobs::with_audit(audit)),
            tools,
            local_tools,
            run_slots: None,
        }
    }

    /// At most `runs` of this server's runs at once; one more is refused, not queued.
    pub fn with_run_limit(mut self, runs: u32) -> Self {
        self.run_slots = Some((Arc::new(tokio::sync::Semaphore::new(runs as usize)), runs));
        self
    }

    /// Runs going on now (background jobs included), when runs are limited (`serve --http`).
    pub fn runs_in_progress(&self) -> usize {
        self.run_slots.as_ref().map_or(0, |(s, n)| {
            (*n as usize).saturating_sub(s.available_permits())
        })
    }

    /// Waits for `job` up to `limit`, sending progress notifications if the client asked for
    /// them. Returns the run's tool result; or, for a 2026-07-28 client that can answer (`ask`
    /// holds the digest of the call that waits), the run's approval questions as an
    /// `input_required` result; or `Running` if it is still going (it then goes on in the
    /// background).
    async fn await_job(
        &self,
        job: &Arc<Job>,
        limit: Duration,
        context: &RequestContext<RoleServer>,
        ask: Option<&str>,
    ) -> Waited {
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
        let relay = self.sessions.proxy().relay();
        let questions = async {
            match ask {
                Some(call) => relay.next_questions(&job.session, &job.id, call).await,
                None => std::future::pending().await,
            }
        };
        let outcome = tokio::select! {
            o = job.wait(limit) => Ok(o),
            q = questions => Err(q),
            _ = context.ct.cancelled() => {
                // notifications/cancelled: interrupt (then kill after the grace period).
                job.cancel.cancel();
                Ok(job.wait(self.sessions.settings().interrupt_grace + Duration::from_secs(5)).await)
            }
        };
        if let Some(task) = forward {
            task.abort();
        }
        match outcome {
            Ok(Some(outcome)) => {
                self.jobs.remove(&job.id);
                Waited::Finished(self.outcome_result(&outcome))
            }
            Ok(None) => {
                job.detached
                    .store(true, std::sync::atomic::Ordering::SeqCst);
                Waited::Running
            }
            Err(questions) => {
                // Until the client retries, the run is a background job like any other.
                job.detached
                    .store(true, std::sync::atomic::Ordering::SeqCst);
                Waited::Ask(questions)
            }
        }
    }

    fn outcome_result(&self, outcome: &crate::jobs::Outcome) -> CallToolResult {
        match &**outcome {
            Ok(record) => run_result(record, self.sessions.settings().output_mode),
            Err(refusal) => error_result(refusal.to_string()),
        }
    }

    /// Runs code; a run that outlives the wait budget becomes a task (for a client that
    /// declared the tasks extension) or a background job (for the others).
    async fn call_run_python(
        &self,
        request: &CallToolRequestParams,
        context: &RequestContext<RoleServer>,
    ) -> CallToolResponse {
        let run = match parse_run_arguments(request.arguments.as_ref()) {
            Ok(r) => r,
            Err(message) => return error_result(message).into(),
        };
        if crate::local_tools::is_reserved_session(&run.session) {
            return error_result(format!(
                "session {:?} is reserved for the local Python tools; use another name",
                run.session
            ))
            .into();
        }
        if let Some(id) = self.jobs.running_in(&run.session) {
            let how = if offers_tasks(context) {
                format!("poll it with tasks/get (taskId {id:?}), cancel it with tasks/cancel")
            } else {
                format!(
                    "wait for it with {JOB_TOOL_NAME}(job={id:?}), cancel it with action=\"cancel\""
                )
            };
            return error_result(format!(
                "session {:?} is busy with background job {id}; {how}, or use another session",
                run.session
            ))
            .into();
        }
        let hold = match &self.run_slots {
            None => None,
            Some((slots, limit)) => match slots.clone().try_acquire_owned() {
                Ok(permit) => Some(permit),
                Err(_) => {
                    return error_result(format!(
                        "{limit} runs of yours are going already, the most at once \
                         (IRONCELL_PRINCIPAL_MAX_RUNS); wait for one to end ({JOB_TOOL_NAME}), \
                         or cancel one"
                    ))
                    .into();
                }
            },
        };
        // Approval questions for this session's proxied calls go to this client, in its era.
        self.sessions
            .proxy()
            .set_asker(&run.session, asker_for(context));
        let job = self.jobs.start(self.sessions.clone(), run, hold);
        self.answer_for_job(&job, request, context).await
    }

    /// The answer of a `tools/call` that waits for `job` (a new run, a retry that answered
    /// approval questions, or `run_python_job`): its result, its questions, a task, or the
    /// still-running result.
    async fn answer_for_job(
        &self,
        job: &Arc<Job>,
        request: &CallToolRequestParams,
        context: &RequestContext<RoleServer>,
    ) -> CallToolResponse {
        let budget = self.sessions.settings().wait_budget;
        let ask = can_answer_input_required(context)
            .then(|| approval::call_digest(&request.name, request.arguments.as_ref()));
        match self.await_job(job, budget, context, ask.as_deref()).await {
            Waited::Finished(result) => result.into(),
            Waited::Ask(questions) => CallToolResponse::InputRequired(questions),
            Waited::Running if offers_tasks(context) => {
                CallToolResponse::Task(CreateTaskResult::new(task_of(job)))
            }
            Waited::Running => running_result(job).into(),
        }
    }

    /// A retry after `input_required`: delivers the user's answers to the run's waiting calls,
    /// then waits for the run as the first call did.
    async fn resume_after_input(
        &self,
        token: &str,
        request: &CallToolRequestParams,
        context: &RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, McpError> {
        let call = approval::call_digest(&request.name, request.arguments.as_ref());
        let relay = self.sessions.proxy().relay();
        let job_id = relay
            .answer(token, &call, request.input_responses.as_ref())
            .map_err(|message| McpError::invalid_params(message, None))?;
        let Some(job) = self.jobs.get(&job_id) else {
            return Err(McpError::invalid_params(
                format!(
                    "the run that asked ({job_id}) is gone; call the tool again without requestState"
                ),
                None,
            ));
        };
        Ok(self.answer_for_job(&job, request, context).await)
    }

    async fn call_job_tool(
        &self,
        request: &CallToolRequestParams,
        context: &RequestContext<RoleServer>,
    ) -> CallToolResponse {
        let args = match parse_job_arguments(request.arguments.as_ref()) {
            Ok(args) => args,
            Err(message) => return error_result(message).into(),
        };
        let id = &args.job;
        let Some(job) = self.jobs.get(id) else {
            let known = self.jobs.ids();
            return error_result(format!(
                "no job {id:?} (finished jobs are kept until read, or an hour); known: {}",
                if known.is_empty() {
                    "none".to_string()
                } else {
                    known.join(", ")
                }
            ))
            .into();
        };
        let budget = self.sessions.settings().wait_budget;
        let wait = args.wait.map_or(budget, |w| w.min(budget));
        // A run waiting for approval shows its questions to whoever waits for it.
        let ask = can_answer_input_required(context)
            .then(|| approval::call_digest(&request.name, request.arguments.as_ref()));
        let ask = ask.as_deref();
        let waited = match args.action {
            JobAction::Wait => self.await_job(&job, wait, context, ask).await,
            JobAction::Poll => self.await_job(&job, Duration::ZERO, context, ask).await,
            JobAction::Cancel => {
                job.cancel.cancel();
                let grace = self.sessions.settings().interrupt_grace + Duration::from_secs(5);
                self.await_job(&job, grace, context, None).await
            }
        };
        match waited {
            Waited::Finished(result) => result.into(),
            Waited::Ask(questions) => CallToolResponse::InputRequired(questions),
            Waited::Running => running_result(&job).into(),
        }
    }

    fn task_job(&self, task_id: &str) -> Result<Arc<Job>, McpError> {
        self.jobs.get(task_id).ok_or_else(|| {
            McpError::invalid_params(
                format!(
                    "no task {task_id:?} (finished tasks are kept for an hour); known: {}",
                    self.jobs.ids().join(", ")
                ),
                None,
            )
        })
    }
}

/// The protocol versions ironcell serves, oldest first.
pub const SUPPORTED_VERSIONS: &[ProtocolVersion] = &[
    ProtocolVersion::V_2024_11_05,
    ProtocolVersion::V_2025_03_26,
    ProtocolVersion::V_2025_06_18,
    ProtocolVersion::V_2025_11_25,
    ProtocolVersion::V_2026_07_28,
];

/// Whether a still-running call may be answered with a task: the request is in the 2026-07-28
/// era and declared the `io.modelcontextprotocol/tasks` extension.
fn offers_tasks(context: &RequestContext<RoleServer>) -> bool {
    let modern = context
        .protocol_version()
        .is_some_and(|v| !v.has_initialize());
    modern
        && context
            .client_capabilities()
            .is_some_and(|c| c.supports_tasks())
}

/// What waiting for a job came to.
enum Waited {
    Finished(CallToolResult),
    /// The run needs the user's approval: the questions, for a 2026-07-28 client.
    Ask(InputRequiredResult),
    Running,
}

/// Whether the client can answer approval questions as `input_required` results: the request is
/// in the 2026-07-28 era and its `_meta` declares form elicitation.
fn can_answer_input_required(context: &RequestContext<RoleServer>) -> bool {
    let modern = context
        .protocol_version()
        .is_some_and(|v| !v.has_initialize());
    modern
        && context
            .client_capabilities()
            .is_some_and(|c| elicits_forms(&c))
}

/// Whether capabilities declare form elicitation (an `elicitation` capability naming neither
/// mode means form, as the specification says).
fn elicits_forms(c: &rmcp::model::ClientCapabilities) -> bool {
    c.elicitation
        .as_ref()
        .is_some_and(|e| e.form.is_some() || e.url.is_none())
}

/// How the user of the client behind `context` can be asked to approve a proxied call: an
/// `elicitation/create` request in the handshake era, `input_required` results in 2026-07-28,
/// or not at all.
fn asker_for(context: &RequestContext<RoleServer>) -> Option<Asker> {
    let modern = context
        .protocol_version()
        .is_some_and(|v| !v.has_initialize());
    if modern {
        can_answer_input_required(context).then_some(Asker::Relay)
    } else {
        context
            .peer
            .supported_elicitation_modes()
            .contains(&rmcp::service::ElicitationMode::Form)
            .then(|| Asker::Elicit(context.peer.clone()))
    }
}

/// The task view of a job.
fn task_of(job: &Job) -> Task {
    use crate::jobs::FINISHED_JOB_TTL;
    let created = job.created_at;
    let updated = job.finished_after().map_or_else(chrono::Utc::now, |d| {
        created + chrono::Duration::from_std(d).unwrap_or_default()
    });
    let stamp =
        |t: chrono::DateTime<chrono::Utc>| t.to_rfc3339_opts(chrono::SecondsFormat::Millis, true);
    let p = job.progress.borrow().clone();
    let ran_for = job
        .finished_after()
        .unwrap_or_else(|| job.started.elapsed());
    let mut message = format!(
        "run_python in session {:?}, {:.0} s",
        job.session,
        ran_for.as_secs_f64()
    );
    if job.outcome().is_none() && !p.recent_output.is_empty() {
        message.push_str("; newest output:\n");
        message.push_str(&p.recent_output);
    }
    Task::new(
        job.id.clone(),
        rmcp::model::TaskStatus::Working,
        stamp(created),
        stamp(updated),
    )
    .with_status_message(message)
    .with_ttl_ms(u64::try_from(FINISHED_JOB_TTL.as_millis()).unwrap_or(u64::MAX))
    .with_poll_interval_ms(1000)
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
    // Only its open-world default would be untrue: it never reaches outside ironcell.
    Tool::new(
        JOB_TOOL_NAME,
        "Get a backgrounded run_python result: wait (default), poll or cancel.",
        Arc::new(schema),
    )
    .with_title("Python job")
    .with_annotations(ToolAnnotations::new().open_world(false))
}

/// The published shape of `run_python`'s `structuredContent`: a finished run's record, or a
/// still-running job. Only the fields every result has are pinned; the record carries more
/// (duration, session state, truncation, images, files, upstream calls), and extra fields are
/// allowed so it can grow without breaking clients. Kept small: it is in every `tools/list`.
fn output_schema() -> JsonObject {
    let schema = json!({
        "type": "object",
        "properties": {
            "status": {"type": "string"},
            "stdout": {"type": "string"},
            "result": {"type": ["string", "null"]},
            "error": {"type": ["object", "null"]}
        },
        "required": ["status"]
    });
    match schema {
        Value::Object(m) => m,
        _ => JsonObject::new(),
    }
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

/// `run_python`. Annotations are honest: it writes files and state (not read-only), may
/// overwrite or delete session files (destructive), a repeated call runs again (not
/// idempotent), and it reaches outside only through proxied servers (open-world only when
/// some are configured).
fn run_python_tool(default_timeout_s: f64, proxies: bool) -> Tool {
    let description = "Run Python in a persistent sandboxed session (no network): variables \
and files persist (fork_from copies them), the last expression's value is returned, top-level \
await works. Call the \
user's other MCP servers in code: await runtime.search_tool_docs('query'), await \
mcp_<server>.<tool>(**args). Manual: ironcell://manual";
    let schema = json!({
        "type": "object",
        "properties": {
            "code": {"type": "string"},
            "session": {"type": "string", "description": "Session name (default \"default\")"},
            "timeout_s": {"type": "number", "description": format!("Seconds allowed (default {default_timeout_s:.0})")},
            "reset": {"type": "boolean", "description": "Restart the session first"},
            "servers": {"type": "array", "items": {"type": "string"}, "description": "MCP servers to pre-start"},
            "fork_from": {"type": "string"}
        },
        "required": ["code"]
    });
    let schema: JsonObject = match schema {
        Value::Object(m) => m,
        _ => JsonObject::new(),
    };
    let annotations = ToolAnnotations::new()
        .read_only(false)
        .destructive(true)
        .idempotent(false)
        .open_world(proxies);
    Tool::new(TOOL_NAME, description, Arc::new(schema))
        .with_title("Run Python")
        .with_annotations(annotations)
        .with_raw_output_schema(Arc::new(output_schema()))
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

/// What `initialize` and `server/discover` answer: the capabilities (`tools.listChanged` when
/// the tool list can change) and the server's name and instructions.
pub fn server_config(tool_list_changes: bool) -> ServerConfig {
    let capabilities = ServerCapabilities::builder().enable_tools();
    let capabilities = if tool_list_changes {
        capabilities.enable_tool_list_changed()
    } else {
        capabilities
    };
    ServerConfig::new(capabilities.enable_resources().enable_tasks().build())
        .with_server_info(Implementation::new("ironcell", env!("CARGO_PKG_VERSION")))
        .with_instructions(
            "ironcell runs Python in kernel-sandboxed sessions via the run_python tool. \
             Read system://info for the interpreter, limits and sandbox in force.",
        )
}

fn error_result(message: impl Into<String>) -> CallToolResult {
    CallToolResult::error(vec![ContentBlock::text(format!(
        "error: {}",
        message.into()
    ))])
}

impl ServerHandler for IroncellServer {
    fn get_info(&self) -> ServerConfig {
        // Only servers whose tool list can change say so (local tools in use).
        server_config(self.local_tools.advertises_list_changed())
    }

    /// Both eras: 2026-07-28 (`server/discover`, per-request `_meta`, no handshake) and the
    /// `initialize` ones up to 2025-11-25. `server/discover` (rmcp's default answer) lists
    /// these; a request naming another version gets `-32022` with this list.
    fn supported_protocol_versions(&self) -> Cow<'static, [ProtocolVersion]> {
        Cow::Borrowed(SUPPORTED_VERSIONS)
    }

    /// `tasks/get`: a run that outlived the wait budget, by its job id. While one of its proxied
    /// calls waits for approval, the task is `input_required` with the question.
    async fn get_task(
        &self,
        request: GetTaskParams,
        _context: RequestContext<RoleServer>,
    ) -> Result<GetTaskResult, McpError> {
        let job = self.task_job(&request.task_id)?;
        let task = task_of(&job);
        let relay = self.sessions.proxy().relay();
        let payload = match job.outcome() {
            None => match relay.task_questions(&job.session, &job.id) {
                Some(input_requests) => TaskPayload::InputRequired { input_requests },
                None => TaskPayload::Working,
            },
            Some(_) if job.cancel.is_cancelled() => TaskPayload::Cancelled,
            Some(outcome) => {
                let result = serde_json::to_value(self.outcome_result(&outcome))
                    .map_err(|e| McpError::internal_error(e.to_string(), None))?;
                match result {
                    Value::Object(result) => TaskPayload::Completed { result },
                    _ => return Err(McpError::internal_error("result is not an object", None)),
                }
            }
        };
        Ok(GetTaskResult::new(DetailedTask::new(task, payload)))
    }

    /// `tasks/cancel`: interrupt the run (SIGINT, then SIGKILL after the grace period).
    async fn cancel_task(
        &self,
        request: CancelTaskParams,
        _context: RequestContext<RoleServer>,
    ) -> Result<(), McpError> {
        let job = self.task_job(&request.task_id)?;
        if job.outcome().is_none() {
            job.cancel.cancel();
        }
        Ok(())
    }

    /// `tasks/update`: the user's answers to the approval questions `tasks/get` showed.
    async fn update_task(
        &self,
        request: UpdateTaskParams,
        _context: RequestContext<RoleServer>,
    ) -> Result<(), McpError> {
        let job = self.task_job(&request.task_id)?;
        self.sessions
            .proxy()
            .relay()
            .answer_task(&job.id, &request.input_responses)
            .map_err(|message| McpError::invalid_params(message, None))
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, McpError> {
        self.local_tools.attach_peer(context.peer.clone());
        let mut tools = (*self.tools).clone();
        tools.extend(self.local_tools.listed_tools().await);
        Ok(ListToolsResult::with_all_items(tools))
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, McpError> {
        let ours = matches!(request.name.as_ref(), TOOL_NAME | JOB_TOOL_NAME);
        if let (true, Some(token)) = (ours, request.request_state.as_deref()) {
            // A retry after input_required: the same call, with the user's answers.
            return self.resume_after_input(token, &request, &context).await;
        }
        let result = match request.name.as_ref() {
            TOOL_NAME => self.call_run_python(&request, &context).await,
            JOB_TOOL_NAME => self.call_job_tool(&request, &context).await,
            other => {
                self.local_tools.attach_peer(context.peer.clone());
                let args = request.arguments.as_ref();
                match self.local_tools.call(other, args, context.ct.clone()).await {
                    Some(result) => result.into(),
                    None => error_result(format!(
                        "unknown tool {other:?}; the tools are {TOOL_NAME} and {JOB_TOOL_NAME}"
                    ))
                    .into(),
                }
            }
        };
        Ok(result)
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
                .read_session_file(&session, &rel)
                .await
                .map_err(|e| McpError::resource_not_found(e, Some(json!({"uri": request.uri}))))?;
            let mime = crate::files::mime_for(&rel);
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
                Some(json!({"uri": request.uri})),
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

    #[test]
    fn the_tool_list_fits_the_token_budget() {
        let tools = vec![run_python_tool(30.0, true), job_tool()];
        // What a model is given of each tool (Claude's tool definitions, for one, carry only
        // these): about 300 tokens at bytes/4, so the two tools cost little of every context.
        let seen_by_model: Vec<Value> = tools
            .iter()
            .map(|t| json!({"name": t.name, "description": t.description, "input_schema": t.input_schema}))
            .collect();
        let model_bytes = serde_json::to_string(&seen_by_model).unwrap().len();
        assert!(
            model_bytes / 4 <= 300,
            "the model-facing part of tools/list is {model_bytes} bytes (~{} tokens)",
            model_bytes / 4
        );
        // The whole answer adds what the protocol asks each tool to carry for clients: a title,
        // honest annotations, and run_python's output schema.
        let bytes = serde_json::to_string(&ListToolsResult::with_all_items(tools))
            .unwrap()
            .len();
        assert!(
            bytes / 4 <= 375,
            "tools/list is {bytes} bytes (~{} tokens)",
            bytes / 4
        );
    }
}
