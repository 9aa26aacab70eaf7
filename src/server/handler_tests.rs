//! The handler, driven in-process: the real [`IroncellServer`] on one end of a
//! `tokio::io::duplex`, rmcp's own client on the other. No child ironcell, no stdio.
//!
//! Tests that need no Python point `--python` at a path that does not exist, so no zygote
//! starts; the one that runs code uses /usr/bin/python3 and the real sandbox.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use clap::Parser;
use rmcp::model::{
    CallToolRequestParams, CallToolResult, ErrorCode, ReadResourceRequestParams, ResourceContents,
};
use rmcp::service::{RunningService, ServiceError};
use rmcp::{RoleClient, ServiceExt};
use serde_json::{Value, json};

use super::{IroncellServer, JOB_TOOL_NAME, MANUAL_URI, SYSTEM_INFO_URI, TOOL_NAME};
use crate::config::Settings;
use crate::session::SessionManager;

/// The flags a test starts the server with, parsed as the command line would be.
#[derive(Parser)]
struct Flags {
    #[command(flatten)]
    settings: Settings,
}

/// A server and a client talking MCP over an in-memory pipe, and the state dir they use.
struct Pair {
    client: RunningService<RoleClient, ()>,
    sessions: Arc<SessionManager>,
    state_dir: PathBuf,
}

impl Pair {
    async fn start(test: &str, python: &str) -> Pair {
        let state_dir =
            std::env::temp_dir().join(format!("ironcell-handler-{}-{test}", std::process::id()));
        let _ = std::fs::remove_dir_all(&state_dir);
        let args = [
            "ironcell",
            "--state-dir",
            state_dir.to_str().unwrap(),
            "--python",
            python,
        ];
        let settings = Flags::try_parse_from(args).unwrap().settings;
        let exe = std::env::current_exe().unwrap();
        let sessions = SessionManager::start(settings, exe).unwrap();
        let server = IroncellServer::new(sessions.clone());
        let (server_end, client_end) = tokio::io::duplex(64 * 1024);
        tokio::spawn(async move {
            if let Ok(running) = server.serve(server_end).await {
                let _ = running.waiting().await;
            }
        });
        let client = ().serve(client_end).await.unwrap();
        Pair {
            client,
            sessions,
            state_dir,
        }
    }

    /// A server with no interpreter: everything but running code works.
    async fn without_python(test: &str) -> Pair {
        Pair::start(test, "/nonexistent/ironcell-test/python3").await
    }

    async fn call(&self, tool: &str, args: Value) -> CallToolResult {
        let Value::Object(args) = args else {
            panic!("arguments must be an object: {args}")
        };
        self.client
            .call_tool(CallToolRequestParams::new(tool.to_string()).with_arguments(args))
            .await
            .unwrap()
    }

    async fn read(&self, uri: &str) -> Result<Vec<ResourceContents>, ServiceError> {
        self.client
            .read_resource(ReadResourceRequestParams::new(uri))
            .await
            .map(|r| r.contents)
    }

    async fn stop(self) {
        let _ = self.client.cancel().await;
        self.sessions.shutdown().await;
        let _ = std::fs::remove_dir_all(&self.state_dir);
    }
}

fn text_of(result: &CallToolResult) -> String {
    result
        .content
        .iter()
        .filter_map(|c| c.as_text().map(|t| t.text.clone()))
        .collect::<Vec<_>>()
        .join("\n")
}

fn text_contents(contents: &[ResourceContents]) -> &str {
    match contents {
        [ResourceContents::TextResourceContents { text, .. }] => text,
        other => panic!("expected one text content, got {other:?}"),
    }
}

fn mcp_error(outcome: Result<Vec<ResourceContents>, ServiceError>) -> rmcp::ErrorData {
    match outcome {
        Err(ServiceError::McpError(e)) => e,
        other => panic!("expected an MCP error, got {other:?}"),
    }
}

#[tokio::test]
async fn tools_list_over_the_wire_fits_the_token_budget() {
    let pair = Pair::without_python("budget").await;
    let listed = pair.client.list_tools(None).await.unwrap();
    let names: Vec<&str> = listed.tools.iter().map(|t| t.name.as_ref()).collect();
    assert_eq!(names, [TOOL_NAME, JOB_TOOL_NAME]);
    // The estimate tests/e2e uses: compact JSON of the result, bytes / 4.
    let bytes = serde_json::to_string(&listed).unwrap().len();
    assert!(bytes / 4 <= 375, "tools/list is {bytes} bytes");
    // Every argument the schema advertises is one run_python accepts, and no more.
    let schema = &listed.tools[0].input_schema;
    let advertised: Vec<&str> = schema["properties"]
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    assert_eq!(advertised, super::arguments::RUN_ARGUMENTS);
    assert_eq!(schema["required"], json!(["code"]));
    pair.stop().await;
}

#[tokio::test]
async fn bad_run_python_arguments_are_error_results_that_name_the_fix() {
    let pair = Pair::without_python("arguments").await;
    let cases = [
        (json!({}), "missing required argument `code`"),
        (
            json!({"code": 5}),
            "`code` must be a string of Python source, got a number",
        ),
        (json!({"code": null}), "`code` must be a string"),
        (
            json!({"code": "1", "session": 3}),
            "`session` must be a string, got a number",
        ),
        (
            json!({"code": "1", "timeout_s": "ten"}),
            "`timeout_s` must be a number of seconds, got a string",
        ),
        (
            json!({"code": "1", "timeout_s": -1}),
            "`timeout_s` must be a positive number of seconds",
        ),
        (
            json!({"code": "1", "timeout_s": 1e7}),
            "`timeout_s` must be a positive number of seconds (at most 1000000)",
        ),
        (
            json!({"code": "1", "reset": "please"}),
            "`reset` must be true or false, got a string",
        ),
        (
            json!({"code": "1", "servers": "github"}),
            "`servers` must be a list of server names, got a string",
        ),
        (
            json!({"code": "1", "servers": ["github", 3]}),
            "`servers` must be a list of server names, got an array",
        ),
        (
            json!({"code": "1", "cod": "y"}),
            "unknown argument \"cod\"; run_python takes code, session, timeout_s, reset, servers",
        ),
        // Checked when the run starts, before any interpreter is needed.
        (
            json!({"code": "1", "session": "../../etc"}),
            "invalid session name \"../../etc\": use 1-64 letters, digits",
        ),
    ];
    for (args, expected) in cases {
        let result = pair.call(TOOL_NAME, args.clone()).await;
        let text = text_of(&result);
        assert_eq!(result.is_error, Some(true), "{args} -> {text}");
        assert!(text.contains(expected), "{args} -> {text}");
    }
    let unknown = pair.call("no_such_tool", json!({})).await;
    assert_eq!(unknown.is_error, Some(true));
    assert!(text_of(&unknown).contains("the tools are run_python and run_python_job"));
    pair.stop().await;
}

#[tokio::test]
async fn bad_run_python_job_arguments_are_error_results_that_name_the_fix() {
    let pair = Pair::without_python("job-arguments").await;
    let cases = [
        (json!({}), "missing required argument `job`"),
        (
            json!({"job": 7}),
            "`job` must be a string (the id a running result named), got a number",
        ),
        (
            json!({"job": "j1", "wait_s": "soon"}),
            "`wait_s` must be a number of seconds, got a string",
        ),
        (
            json!({"job": "j1", "action": "stop"}),
            "unknown action \"stop\"; use \"wait\", \"poll\" or \"cancel\"",
        ),
        (
            json!({"job": "j1"}),
            "no job \"j1\" (finished jobs are kept until read, or an hour); known: none",
        ),
    ];
    for (args, expected) in cases {
        let result = pair.call(JOB_TOOL_NAME, args.clone()).await;
        let text = text_of(&result);
        assert_eq!(result.is_error, Some(true), "{args} -> {text}");
        assert!(text.contains(expected), "{args} -> {text}");
    }
    pair.stop().await;
}

#[tokio::test]
async fn resources_resolve_or_say_what_exists() {
    let pair = Pair::without_python("resources").await;
    let listed = pair.client.list_resources(None).await.unwrap();
    let uris: Vec<&str> = listed.resources.iter().map(|r| r.uri.as_str()).collect();
    assert_eq!(uris, [SYSTEM_INFO_URI, MANUAL_URI]);

    let info: Value =
        serde_json::from_str(text_contents(&pair.read(SYSTEM_INFO_URI).await.unwrap())).unwrap();
    assert_eq!(info["ironcell"], env!("CARGO_PKG_VERSION"));
    // No interpreter: system://info says which one it could not use, instead of failing.
    let why = info["python"]["error"].as_str().unwrap_or_default();
    assert!(why.contains("/nonexistent/ironcell-test/python3"), "{info}");

    let manual = pair.read(MANUAL_URI).await.unwrap();
    assert!(text_contents(&manual).contains("run_python"));

    let missing = mcp_error(pair.read("system://nope").await);
    assert_eq!(missing.code, ErrorCode::RESOURCE_NOT_FOUND);
    assert!(
        missing
            .message
            .contains("no resource \"system://nope\"; available: system://info, ironcell://manual"),
        "{missing:?}"
    );
    let no_session = mcp_error(pair.read("ironcell://session/ghost/out.txt").await);
    assert_eq!(no_session.code, ErrorCode::RESOURCE_NOT_FOUND);
    assert!(
        no_session.message.contains("no session \"ghost\""),
        "{no_session:?}"
    );
    pair.stop().await;
}

#[tokio::test]
async fn a_run_reports_its_session_state_and_its_files_resolve_as_resources() {
    let python = "/usr/bin/python3";
    assert!(
        Path::new(python).exists(),
        "this test runs code with {python}; install python3"
    );
    let pair = Pair::start("run", python).await;
    let first = pair
        .call(
            TOOL_NAME,
            json!({"code": "open('out.txt', 'w').write('hello')\nx = 41\nx + 1"}),
        )
        .await;
    let record = first.structured_content.clone().unwrap_or_default();
    assert_eq!(record["status"], "ok", "{}", text_of(&first));
    assert_eq!(record["result"], "42");
    assert_eq!(record["session_state"], "new");
    let second = pair.call(TOOL_NAME, json!({"code": "x"})).await;
    let record = second.structured_content.clone().unwrap_or_default();
    assert_eq!(record["session_state"], "kept", "{}", text_of(&second));
    assert_eq!(record["result"], "41");

    let uri = crate::files::session_uri("default", "out.txt");
    let listed = pair.client.list_resources(None).await.unwrap();
    assert!(
        listed.resources.iter().any(|r| r.uri == uri),
        "{:?}",
        listed.resources
    );
    assert_eq!(text_contents(&pair.read(&uri).await.unwrap()), "hello");
    let escape = mcp_error(
        pair.read("ironcell://session/default/../../../etc/passwd")
            .await,
    );
    assert_eq!(escape.code, ErrorCode::RESOURCE_NOT_FOUND);
    let absent = mcp_error(pair.read("ironcell://session/default/absent.txt").await);
    assert_eq!(absent.code, ErrorCode::RESOURCE_NOT_FOUND);
    pair.stop().await;
}
