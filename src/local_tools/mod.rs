//! Local Python tools: functions marked `@tool` in the files named with `--tools` (and those
//! saved with `save_tool(func)` from a session) become MCP tools.
//!
//! The host never runs Python. A dedicated tools session ([`TOOLS_SESSION`]), an ordinary worker
//! with every sandbox layer plus a read-only grant for the tools files, imports them, turns type
//! hints into JSON schemas (`tools.catalog`), and runs each call (`tools.result`): the host only
//! generates a one-line cell that names what to do, and reads the answer from a bridge request
//! of that session, never from printed text. Answers are accepted only from the session the host
//! asked, only for a token it is waiting for, and are size-capped; schemas are checked before
//! they are listed. Saved tools are files the host writes in `<state dir>/tools/` (names
//! validated, sizes and counts capped). They are code a session wrote, so they load and run in a
//! session of their own ([`SAVED_TOOLS_SESSION`]), readable only there: never in the interpreter
//! that holds the user's tools files (and their read grant), where a saved tool could read those
//! files or replace the user's tools. A saved tool named like a file tool is not listed.
//!
//! Code in `run_python` reaches the tools with `from mcp import tools; tools.<name>(...)`
//! (`tools.call` requests), which run in the tool's session too.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use rmcp::model::{CallToolResult, ContentBlock, JsonObject, Tool};
use rmcp::{Peer, RoleServer};
use serde::Serialize;
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

use crate::lock;
use crate::output::{RunRecord, RunStatus};
use crate::run::{RunRefusal, RunRequest};
use ironcell_core::bridge::{BridgeError, ErrorKind, ToolsRequest};

mod load;
mod requests;
mod results;
mod saved;
use load::*;
pub use requests::handle_request;
use results::*;
use saved::*;
pub use saved::{SavedToolsAction, saved_tools_command};

/// The reserved session whose worker loads and runs the tools of the `--tools` files.
pub const TOOLS_SESSION: &str = "ironcell.tools";
/// The reserved name of the saved tools' sessions: each file saved with `save_tool` loads and
/// runs in a session of its own, `ironcell.saved-tools.<hash of its name>` ([`saved_session`]),
/// granted only that file, so no saved tool's code runs beside another's (SECURITY.md #137).
pub const SAVED_TOOLS_SESSION: &str = "ironcell.saved-tools";

/// The session that loads and runs the saved tools file `<stem>.py`: the reserved prefix and
/// 16 hex digits of the stem's SHA-256 (a tool name has up to 64 characters; a session name
/// too, prefix included).
pub fn saved_session(stem: &str) -> String {
    use sha2::Digest;
    let digest = sha2::Sha256::digest(stem.as_bytes());
    let hex: String = digest[..8].iter().map(|b| format!("{b:02x}")).collect();
    format!("{SAVED_TOOLS_SESSION}.{hex}")
}

/// Where a tool comes from, which decides the session that loads and runs it: the host's own
/// knowledge (which session it asked), never what a worker says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Home {
    Files,
    Saved,
}

impl Home {
    fn origin(self) -> &'static str {
        match self {
            Home::Files => "file",
            Home::Saved => "saved",
        }
    }
}
/// Names the MCP surface already uses.
const RESERVED_NAMES: &[&str] = &["run_python", "run_python_job"];
/// Most tools listed (from files and saved together).
const MAX_TOOLS: usize = 256;
/// Largest schema (input or output) of one tool, as JSON.
const MAX_SCHEMA_BYTES: usize = 64 << 10;
/// Longest tool description, in characters.
const MAX_DESCRIPTION_CHARS: usize = 8 << 10;
/// Longest description of a saved tool (code wrote it, and every later conversation's
/// `tools/list` carries it).
const MAX_SAVED_DESCRIPTION_CHARS: usize = 1024;
/// The prefix of ironcell's own tools: no local tool's name may start with it.
const RESERVED_PREFIX: &str = "run_python";
/// Least time between two `tools/list_changed` notifications (saves in between are coalesced).
const LIST_CHANGED_EVERY: Duration = Duration::from_secs(1);
/// Largest saved tool source.
pub const MAX_SAVED_TOOL_BYTES: usize = 64 << 10;
/// Most saved tools.
const MAX_SAVED_TOOLS: usize = 256;
/// Largest answer (a tool's value, or the catalog) the tools session may send.
const MAX_ANSWER_BYTES: usize = 8 << 20;
/// Most load errors kept (one per broken file or tool).
const MAX_LOAD_ERRORS: usize = 64;
/// How long a failed load (e.g. a tools file that hangs at import) is kept before the next try,
/// so one bad file does not stall every `tools/list`.
const RETRY_FAILED_LOAD: Duration = Duration::from_secs(60);
/// How long `tools/list` waits for the tools to load before answering without them.
const CATALOG_WAIT: Duration = Duration::from_secs(60);
/// How long one saved file's load may run: the import alarm (python/mcp's `IMPORT_SECONDS`,
/// 10 s) and some room. A file that turns the alarm off is stopped here, not at the run timeout.
const SAVED_LOAD_TIMEOUT: Duration = Duration::from_secs(15);
/// How long one listing of the saved tools may spend loading files; files not reached are
/// loaded by the next listing (files already loaded, and unchanged since, are not loaded again).
const SAVED_LOAD_BUDGET: Duration = Duration::from_secs(45);

/// A tools file (or tool) that could not be loaded: reported, and the others still load.
#[derive(Debug, Clone, Serialize)]
pub struct LoadError {
    pub file: String,
    pub line: Option<u64>,
    pub reason: String,
}

impl std::fmt::Display for LoadError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.line {
            Some(line) => write!(f, "{}:{line}: {}", self.file, self.reason),
            None => write!(f, "{}: {}", self.file, self.reason),
        }
    }
}

/// One tool as listed.
#[derive(Debug, Clone)]
struct LocalTool {
    name: String,
    description: String,
    input_schema: JsonObject,
    output_schema: Option<JsonObject>,
    /// Its saved file (`None` for the files' tools), known to the host from which file's
    /// session listed it, never from what a worker says. Where it comes from and the session
    /// it runs in follow from it.
    saved_file: Option<PathBuf>,
}

impl LocalTool {
    /// From `--tools` or `save_tool`.
    fn home(&self) -> Home {
        match self.saved_file {
            Some(_) => Home::Saved,
            None => Home::Files,
        }
    }

    /// The session it loads and runs in: the tools session, or its saved file's own.
    fn session(&self) -> String {
        session_of(self.saved_file.as_deref())
    }
}

/// The name of a saved tools file's one tool: the file's stem (`save_tool` writes it so).
fn saved_stem(file: &Path) -> &str {
    file.file_stem()
        .and_then(|s| s.to_str())
        .unwrap_or_default()
}

/// The session that loads and runs the tools of `saved_file`, or the files' tools.
fn session_of(saved_file: Option<&Path>) -> String {
    match saved_file {
        Some(file) => saved_session(saved_stem(file)),
        None => TOOLS_SESSION.to_string(),
    }
}

#[derive(Debug, Default)]
struct Catalog {
    generation: u64,
    /// The generation of the files' tools it was made with (0: none).
    files_generation: u64,
    /// The tools session could not load anything: tried again after [`RETRY_FAILED_LOAD`].
    load_failed: bool,
    loaded_at: Option<std::time::Instant>,
    tools: Vec<LocalTool>,
    errors: Vec<LoadError>,
}

/// One saved file's listing: its tool (or why it has none), for the file as it was then.
#[derive(Debug, Clone)]
struct SavedFileLoad {
    key: FileKey,
    tools: Vec<LocalTool>,
    errors: Vec<LoadError>,
}

/// Identifies one version of a file: device, inode, size and modification time (`lstat`).
type FileKey = (u64, u64, u64, i64, i64);

fn file_key(path: &Path) -> Option<FileKey> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::symlink_metadata(path).ok()?;
    Some((m.dev(), m.ino(), m.size(), m.mtime(), m.mtime_nsec()))
}

/// The local tools of this server.
pub struct LocalTools {
    sessions: Weak<dyn ToolSessions>,
    /// The `--tools` files and folders, resolved to real paths.
    paths: Vec<PathBuf>,
    /// `--tools` entries that cannot be used, with why.
    path_errors: Vec<LoadError>,
    saved_dir: PathBuf,
    /// Whether `tools/list` includes local tools (a tools path, or saved tools exist).
    listed: AtomicBool,
    /// Fixed at start: whether the `tools.listChanged` capability is advertised.
    advertise_list_changed: bool,
    /// Bumped by every save or delete; a catalog of an older generation is reloaded.
    generation: AtomicU64,
    /// Held while loading, so concurrent lists wait for one load.
    catalog: tokio::sync::Mutex<Option<Arc<Catalog>>>,
    /// The tools of the `--tools` files alone, loaded once (again only after a load whose
    /// session failed, at most every [`RETRY_FAILED_LOAD`]): saves and deletes reload the saved
    /// tools and never reset the user's tools session, and a call of one of the user's tools
    /// never waits for a load of the saved ones (SECURITY.md #113). Its `generation` counts the
    /// files' loads.
    files: tokio::sync::Mutex<Option<Arc<Catalog>>>,
    /// What each saved file listed, kept while the file is unchanged (a save renames a new
    /// file in): a save or delete loads only the files that changed, so a file that hangs at
    /// import costs its [`SAVED_LOAD_TIMEOUT`] once, not at every listing (SECURITY.md #137).
    saved_loads: Mutex<HashMap<PathBuf, SavedFileLoad>>,
    /// Answers the host is waiting for, by token: from which tools session, and the answer.
    inbox: Mutex<HashMap<String, (String, Option<Value>)>>,
    next_token: AtomicU64,
    /// The client to tell when the list changes.
    peer: Mutex<Option<Peer<RoleServer>>>,
    output_mode: crate::config::OutputMode,
    /// A `tools/list_changed` is on its way (saves meanwhile join it), and when the last went.
    notify_pending: AtomicBool,
    last_notified: Arc<Mutex<Option<std::time::Instant>>>,
}

/// Whether `name` is one of the reserved tools sessions (refused for `run_python`).
pub fn is_reserved_session(name: &str) -> bool {
    name == TOOLS_SESSION || name == SAVED_TOOLS_SESSION || is_saved_file_session(name)
}

/// Whether `name` has the form of a saved tools file's session ([`saved_session`]).
pub fn is_saved_file_session(name: &str) -> bool {
    name.strip_prefix(SAVED_TOOLS_SESSION)
        .is_some_and(|rest| rest.starts_with('.'))
}

/// A tool name the host accepts: a Python identifier in ASCII, at most 64 characters, not one
/// of ironcell's own tools.
pub fn valid_tool_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name
            .bytes()
            .next()
            .is_some_and(|b| b.is_ascii_alphabetic() || b == b'_')
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
        && !RESERVED_NAMES.contains(&name)
        && !name.starts_with(RESERVED_PREFIX)
}

impl LocalTools {
    /// Sets up the local tools of `sessions` (from its settings) and starts loading them in the
    /// background when there are any.
    pub fn start<S: ToolSessions + 'static>(sessions: &Arc<S>) -> Arc<LocalTools> {
        let settings = sessions.settings();
        let state_dir = sessions.state_dir().to_path_buf();
        let saved_dir = state_dir.join("tools");
        let (paths, path_errors) = resolve_tool_paths(&settings.tools, &state_dir);
        for e in &path_errors {
            tracing::error!("tools: {e}");
        }
        let has_saved = saved_tool_files(&saved_dir).next().is_some();
        let in_use = !settings.tools.is_empty() || has_saved;
        let weak: Weak<dyn ToolSessions> = Arc::downgrade(sessions) as Weak<S>;
        let tools = Arc::new(LocalTools {
            sessions: weak,
            paths,
            path_errors,
            saved_dir,
            listed: AtomicBool::new(in_use),
            advertise_list_changed: in_use,
            generation: AtomicU64::new(1),
            catalog: tokio::sync::Mutex::new(None),
            files: tokio::sync::Mutex::new(None),
            saved_loads: Mutex::new(HashMap::new()),
            inbox: Mutex::new(HashMap::new()),
            next_token: AtomicU64::new(1),
            peer: Mutex::new(None),
            notify_pending: AtomicBool::new(false),
            last_notified: Arc::new(Mutex::new(None)),
            output_mode: settings.output_mode,
        });
        sessions.set_local_tools(tools.clone());
        if in_use && let Ok(rt) = tokio::runtime::Handle::try_current() {
            let t = tools.clone();
            rt.spawn(async move {
                let catalog = t.ensure_catalog().await;
                for e in &catalog.errors {
                    tracing::warn!("tools: {e}");
                }
                tracing::info!(tools = catalog.tools.len(), "local tools loaded");
            });
        }
        tools
    }

    /// Whether the `tools.listChanged` capability is advertised.
    pub fn advertises_list_changed(&self) -> bool {
        self.advertise_list_changed
    }

    /// Remembers the client, to tell it when the tool list changes.
    pub fn attach_peer(&self, peer: Peer<RoleServer>) {
        *lock(&self.peer) = Some(peer);
    }

    /// Read-only paths the worker of `session` gets beyond the policy's: the tools files for
    /// the tools session, its one file for a saved file's session, nothing for any other.
    pub fn read_grants_for(&self, session: &str) -> Vec<PathBuf> {
        if session == TOOLS_SESSION {
            return self.paths.clone();
        }
        if !is_saved_file_session(session) {
            return Vec::new();
        }
        saved_tool_files(&self.saved_dir)
            .filter(|f| saved_session(saved_stem(f)) == session)
            .take(1)
            .collect()
    }

    /// What a tools session loads: the `--tools` paths, or one saved tools file.
    fn spec_for(&self, saved_file: Option<&Path>, token: &str, generation: u64) -> Value {
        match saved_file {
            None => json!({"token": token, "generation": generation,
                           "paths": self.paths, "saved_file": null}),
            Some(file) => json!({"token": token, "generation": generation,
                                 "paths": [], "saved_file": file}),
        }
    }

    /// Whether `home` has anything to load (no worker is started for it otherwise).
    fn has_tools_in(&self, home: Home) -> bool {
        match home {
            Home::Files => !self.paths.is_empty(),
            Home::Saved => saved_tool_files(&self.saved_dir).next().is_some(),
        }
    }

    /// The local tools for `tools/list`; empty (and no work at all) when none are in use.
    pub async fn listed_tools(&self) -> Vec<Tool> {
        if !self.listed.load(Ordering::SeqCst) {
            return Vec::new();
        }
        let Ok(catalog) = tokio::time::timeout(CATALOG_WAIT, self.ensure_catalog()).await else {
            // The user's own tools, if loaded, are listed all the same.
            let files = self.files.try_lock().ok().and_then(|slot| slot.clone());
            tracing::warn!(
                "tools: still loading after {CATALOG_WAIT:?}; listed without the saved tools"
            );
            return files
                .map(|f| f.tools.iter().map(to_mcp_tool).collect())
                .unwrap_or_default();
        };
        catalog.tools.iter().map(to_mcp_tool).collect()
    }

    /// For `system://info` and `doctor`: the local tools that loaded and what failed (loading
    /// them, as a listing would, if any are in use; at most [`CATALOG_WAIT`]).
    pub async fn describe(&self) -> Value {
        if !self.listed.load(Ordering::SeqCst) {
            return json!({"loaded": [], "failed": self.path_errors.iter().map(ToString::to_string).collect::<Vec<_>>()});
        }
        match tokio::time::timeout(CATALOG_WAIT, self.ensure_catalog()).await {
            Ok(c) => json!({
                "loaded": c.tools.iter().map(|t| t.name.as_str()).collect::<Vec<_>>(),
                "failed": c.errors.iter().map(ToString::to_string).collect::<Vec<_>>(),
            }),
            Err(_) => {
                json!({"loaded": [], "failed": [format!("still loading after {CATALOG_WAIT:?}")]})
            }
        }
    }

    /// The catalog of the current generation, loading it in the tools session if needed.
    async fn ensure_catalog(&self) -> Arc<Catalog> {
        self.ensure_catalog_unless(&CancellationToken::new())
            .await
            .unwrap_or_default()
    }

    /// [`Self::ensure_catalog`] for a worker's request: `None` if `cancel` fires (the worker is
    /// gone) while it waits for the catalog, so a dead worker's request does not sit, with its
    /// parameters, behind a load. A load it started runs to its end (it is a run in a tools
    /// session, which must not be dropped midway).
    async fn ensure_catalog_unless(&self, cancel: &CancellationToken) -> Option<Arc<Catalog>> {
        let mut slot = tokio::select! {
            slot = self.catalog.lock() => slot,
            () = cancel.cancelled() => return None,
        };
        // The files' tools first: a reload of them (their session failed, and a minute has
        // passed) makes this catalog stale too.
        let files_generation = if self.has_tools_in(Home::Files) {
            self.files_part_unless(cancel).await?.generation
        } else {
            0
        };
        let generation = self.generation.load(Ordering::SeqCst);
        let fresh = |c: &&Arc<Catalog>| {
            c.generation == generation
                && c.files_generation == files_generation
                && (!c.load_failed || c.loaded_at.is_some_and(|t| t.elapsed() < RETRY_FAILED_LOAD))
        };
        if let Some(c) = slot.as_ref().filter(fresh) {
            return Some(c.clone());
        }
        let mut catalog = self.load_catalog(generation).await;
        catalog.loaded_at = Some(std::time::Instant::now());
        let catalog = Arc::new(catalog);
        *slot = Some(catalog.clone());
        Some(catalog)
    }

    /// The tools of the `--tools` files: the loaded ones unless their load failed (its session
    /// crashed or was stopped) more than [`RETRY_FAILED_LOAD`] ago, else loaded now. `None` if
    /// `cancel` fires while it waits for a load in progress.
    async fn files_part_unless(&self, cancel: &CancellationToken) -> Option<Arc<Catalog>> {
        let mut slot = tokio::select! {
            slot = self.files.lock() => slot,
            () = cancel.cancelled() => return None,
        };
        // A file that raised at import, or a tool whose hints make no schema, is a settled
        // answer (reported in `tools.errors`; fixed by editing and restarting): retrying would
        // reset the user's tools session on any session's `tools.list` (SECURITY.md #116).
        // Only a session that failed (it crashed or was stopped mid-load) is tried again.
        let usable = |c: &&Arc<Catalog>| {
            !c.load_failed || c.loaded_at.is_some_and(|t| t.elapsed() < RETRY_FAILED_LOAD)
        };
        if let Some(c) = slot.as_ref().filter(usable) {
            return Some(c.clone());
        }
        let mut part = Catalog {
            generation: slot.as_ref().map_or(0, |c| c.generation) + 1,
            ..Catalog::default()
        };
        if self.has_tools_in(Home::Files) {
            self.load_from(None, &mut part).await;
        }
        part.loaded_at = Some(std::time::Instant::now());
        let part = Arc::new(part);
        *slot = Some(part.clone());
        Some(part)
    }

    /// The tool called `name`: one of the user's files' tools (never waiting for the saved
    /// tools), else one of the whole catalog's.
    async fn find_tool_unless(
        &self,
        name: &str,
        cancel: &CancellationToken,
    ) -> Option<Result<LocalTool, Arc<Catalog>>> {
        let files = self.files_part_unless(cancel).await?;
        if let Some(tool) = files.tools.iter().find(|t| t.name == name) {
            return Some(Ok(tool.clone()));
        }
        let catalog = self.ensure_catalog_unless(cancel).await?;
        Some(match catalog.tools.iter().find(|t| t.name == name) {
            Some(tool) => Ok(tool.clone()),
            None => Err(catalog),
        })
    }

    fn new_token(&self) -> String {
        let n = self.next_token.fetch_add(1, Ordering::Relaxed);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        format!("t{n}-{nanos:x}-{:x}", std::process::id())
    }

    /// Runs `mcp.<function>(spec)` in the tools session `session` (in a fresh interpreter if
    /// `reset`; `timeout` instead of the run timeout if given) and takes the answer that
    /// session sends back under `token` (None if it sent none: the record says why).
    /// The run is audited like a `run_python` run, with `cause`: who made it run (a client's
    /// call, a session's, a load).
    #[allow(clippy::too_many_arguments)]
    async fn run_in_tools_session(
        &self,
        session: &str,
        function: &str,
        spec: &Value,
        token: &str,
        (reset, timeout): (bool, Option<Duration>),
        cancel: CancellationToken,
        cause: Value,
    ) -> Result<(RunRecord, Option<Value>), String> {
        let Some(sessions) = self.sessions.upgrade() else {
            return Err("the server is shutting down".into());
        };
        // A JSON string literal is a valid Python string literal (serde_json emits no `\/`).
        let literal = serde_json::to_string(&spec.to_string()).map_err(|e| e.to_string())?;
        let code = format!("__import__(\"mcp\").{function}({literal})");
        lock(&self.inbox).insert(token.to_string(), (session.to_string(), None));
        let outcome = sessions
            .run(
                RunRequest {
                    code,
                    session: session.to_string(),
                    timeout,
                    reset,
                    servers: Vec::new(),
                    progress: None,
                    fork_from: None,
                },
                cancel,
            )
            .await;
        if let Some(log) = sessions.audit() {
            // The generated cell holds the call's arguments: the line names the function only.
            let mut entry =
                crate::audit::AuditEntry::new(session, &format!("mcp.{function}(…)"), &outcome);
            entry.cause = Some(cause);
            log.append(&entry);
        }
        let answer = lock(&self.inbox).remove(token).and_then(|(_, a)| a);
        outcome.map(|r| (r, answer)).map_err(|e| e.to_string())
    }

    /// Calls a local tool for `tools/call`; `None` when `name` is not one.
    pub async fn call(
        &self,
        name: &str,
        arguments: Option<&JsonObject>,
        cancel: CancellationToken,
    ) -> Option<CallToolResult> {
        if !self.listed.load(Ordering::SeqCst) {
            return None;
        }
        let tool = self
            .find_tool_unless(name, &CancellationToken::new())
            .await?
            .ok()?;
        let args = Value::Object(arguments.cloned().unwrap_or_default());
        Some(
            match self
                .invoke(&tool, args, cancel, "the client (tools/call)")
                .await
            {
                Ok((record, envelope)) => self.tool_result(&tool, record, envelope),
                Err(why) => error_result(format!("the tool {name} could not run: {why}")),
            },
        )
    }

    /// Runs one call of `tool`, made by `by` (the client, or a session).
    async fn invoke(
        &self,
        tool: &LocalTool,
        arguments: Value,
        cancel: CancellationToken,
        by: &str,
    ) -> Result<(RunRecord, Option<Value>), String> {
        let generation = match tool.home() {
            Home::Files => self.files_part_unless(&cancel).await,
            Home::Saved => self.ensure_catalog_unless(&cancel).await,
        }
        .ok_or("the caller is gone")?
        .generation;
        let token = self.new_token();
        let mut spec = self.spec_for(tool.saved_file.as_deref(), &token, generation);
        spec["name"] = json!(tool.name);
        spec["arguments"] = arguments;
        let session = tool.session();
        let outcome = self
            .run_in_tools_session(
                &session,
                "_tools_invoke",
                &spec,
                &token,
                (false, None),
                cancel,
                json!({"tool": tool.name, "origin": tool.home().origin(), "called_by": by}),
            )
            .await;
        // A saved file's worker ends with its call: calls of many saved tools never hold the
        // live-session slots the user's sessions need (each call imports its file again).
        if tool.home() == Home::Saved
            && let Some(sessions) = self.sessions.upgrade()
        {
            sessions.stop_idle_worker(&session).await;
        }
        let (record, answer) = outcome?;
        let envelope = answer.and_then(|a| a.get("envelope").cloned());
        Ok((record, envelope))
    }

    /// Bumps the generation, reloads in the background, then tells the client: at most once
    /// per [`LIST_CHANGED_EVERY`], so a save loop cannot flood the client (saves made while a
    /// notification waits join it).
    fn list_changed(&self) {
        self.generation.fetch_add(1, Ordering::SeqCst);
        if self.notify_pending.swap(true, Ordering::SeqCst) {
            return;
        }
        let Some(sessions) = self.sessions.upgrade() else {
            self.notify_pending.store(false, Ordering::SeqCst);
            return;
        };
        let Some(this) = sessions.local_tools() else {
            self.notify_pending.store(false, Ordering::SeqCst);
            return;
        };
        tokio::spawn(async move {
            let last = *lock(&this.last_notified);
            if let Some(last) = last {
                tokio::time::sleep(LIST_CHANGED_EVERY.saturating_sub(last.elapsed())).await;
            }
            *lock(&this.last_notified) = Some(std::time::Instant::now());
            this.notify_pending.store(false, Ordering::SeqCst);
            let catalog = this.ensure_catalog().await;
            for e in &catalog.errors {
                tracing::warn!("tools: {e}");
            }
            let peer = lock(&this.peer).clone();
            if let Some(peer) = peer
                && let Err(e) = peer.notify_tool_list_changed().await
            {
                tracing::debug!(error = %e, "could not send tools/list_changed");
            }
        });
    }
}

/// What the local tools need of the sessions their cells run in (the session manager): the
/// tools never reach into sessions otherwise.
pub trait ToolSessions: Send + Sync {
    fn settings(&self) -> &crate::config::Settings;
    fn state_dir(&self) -> &Path;
    /// Connects the tools (done once, by [`LocalTools::start`]).
    fn set_local_tools(&self, tools: Arc<LocalTools>);
    fn local_tools(&self) -> Option<Arc<LocalTools>>;
    /// Runs a cell; the error is why it was refused before any code ran.
    fn run(
        &self,
        request: RunRequest,
        cancel: CancellationToken,
    ) -> futures::future::BoxFuture<'_, Result<RunRecord, RunRefusal>>;
    /// Stops the session's worker if it is idle.
    fn stop_idle_worker<'a>(&'a self, session: &'a str) -> futures::future::BoxFuture<'a, ()>;
    /// The audit log, once the server has set it.
    fn audit(&self) -> Option<Arc<crate::audit::AuditLog>>;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tool_names_are_identifiers_and_not_ironcells_own() {
        for ok in ["analyze", "safe_divide_numbers", "_x", "A1"] {
            assert!(valid_tool_name(ok), "{ok}");
        }
        for bad in [
            "",
            "1x",
            "a-b",
            "a.b",
            "../x",
            "run_python",
            "run_python_job",
            "run_python_fast",
            "run_pythonx",
            "é",
            &"x".repeat(65),
        ] {
            assert!(!valid_tool_name(bad), "{bad}");
        }
    }

    #[test]
    fn catalog_entries_from_the_worker_are_checked() {
        let ok = json!({"name": "f", "description": "d", "inputSchema": {"type": "object", "properties": {}}});
        let files = |t: &Value| checked_tool(t, None);
        assert!(files(&ok).is_ok());
        let bad_name = json!({"name": "run_python", "inputSchema": {"type": "object"}});
        assert!(files(&bad_name).is_err());
        let not_object = json!({"name": "f", "inputSchema": {"type": "string"}});
        assert!(files(&not_object).is_err());
        let huge = json!({"name": "f", "inputSchema": {"type": "object", "description": "x".repeat(MAX_SCHEMA_BYTES)}});
        assert!(files(&huge).is_err());
        // Where a tool runs is the host's knowledge of which session listed it, not the
        // worker's word: a saved tool that claims to come from the files, or from another
        // saved file, stays in its own file's session.
        let claims_file = json!({"name": "f", "origin": "file", "file": "/x/other.py",
                                 "session": TOOLS_SESSION, "inputSchema": {"type": "object"}});
        let own = Path::new("/state/tools/mine.py");
        let tool = checked_tool(&claims_file, Some(own)).unwrap();
        assert_eq!(tool.home(), Home::Saved);
        assert_eq!(tool.session(), saved_session("mine"));
        assert_eq!(tool.saved_file.as_deref(), Some(own));
    }

    #[test]
    fn each_saved_file_has_a_reserved_session_of_its_own() {
        let (a, b) = (saved_session("alpha"), saved_session("beta"));
        assert_ne!(a, b);
        assert_eq!(a, saved_session("alpha"));
        for s in [&a, &b] {
            assert!(crate::session::valid_session_name(s), "{s}");
            assert!(is_reserved_session(s), "{s}");
        }
        // The longest tool name still makes a valid session name.
        assert!(crate::session::valid_session_name(&saved_session(
            &"x".repeat(64)
        )));
        assert!(is_reserved_session(TOOLS_SESSION) && is_reserved_session(SAVED_TOOLS_SESSION));
        for not in [
            "default",
            "ironcell.saved-toolsx",
            "ironcell.tools.x",
            "xironcell.tools",
        ] {
            assert!(!is_reserved_session(not), "{not}");
        }
    }

    #[test]
    fn each_tools_session_is_granted_only_its_own_files() {
        let dir = std::env::temp_dir().join(format!("ironcell-grants-{}", std::process::id()));
        let (files, saved) = (dir.join("mytools"), dir.join("state/tools"));
        std::fs::create_dir_all(&files).unwrap();
        std::fs::create_dir_all(&saved).unwrap();
        let tools = LocalTools {
            sessions: Weak::<crate::session::SessionManager>::new(),
            paths: vec![files.clone()],
            path_errors: Vec::new(),
            saved_dir: saved.clone(),
            listed: AtomicBool::new(true),
            advertise_list_changed: true,
            generation: AtomicU64::new(1),
            catalog: tokio::sync::Mutex::new(None),
            files: tokio::sync::Mutex::new(None),
            saved_loads: Mutex::new(HashMap::new()),
            inbox: Mutex::new(HashMap::new()),
            next_token: AtomicU64::new(1),
            peer: Mutex::new(None),
            notify_pending: AtomicBool::new(false),
            last_notified: Arc::new(Mutex::new(None)),
            output_mode: crate::config::OutputMode::Compact,
        };
        std::fs::write(saved.join("alpha.py"), "x = 1\n").unwrap();
        std::fs::write(saved.join("beta.py"), "x = 2\n").unwrap();
        assert_eq!(tools.read_grants_for(TOOLS_SESSION), vec![files.clone()]);
        // A saved file's session gets that file alone: not the folder, not the other file.
        assert_eq!(
            tools.read_grants_for(&saved_session("alpha")),
            vec![saved.join("alpha.py")]
        );
        assert_eq!(
            tools.read_grants_for(&saved_session("beta")),
            vec![saved.join("beta.py")]
        );
        assert!(tools.read_grants_for(&saved_session("gone")).is_empty());
        assert!(tools.read_grants_for(SAVED_TOOLS_SESSION).is_empty());
        assert!(tools.read_grants_for("default").is_empty());
        // An answer is taken only from the session the host asked.
        lock(&tools.inbox).insert("t1".into(), (TOOLS_SESSION.to_string(), None));
        let answer = json!({"token": "t1", "tools": []});
        assert!(
            tools
                .accept_answer(&saved_session("alpha"), "t1", answer.clone())
                .is_err()
        );
        assert!(tools.accept_answer(TOOLS_SESSION, "t1", answer).is_ok());
        lock(&tools.inbox).insert("t2".into(), (saved_session("alpha"), None));
        let answer = json!({"token": "t2", "tools": []});
        assert!(
            tools
                .accept_answer(&saved_session("beta"), "t2", answer.clone())
                .is_err()
        );
        assert!(
            tools
                .accept_answer(&saved_session("alpha"), "t2", answer)
                .is_ok()
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn tools_paths_must_exist_and_stay_out_of_the_state_dir() {
        let dir = std::env::temp_dir().join(format!("ironcell-lt-{}", std::process::id()));
        let state = dir.join("state");
        std::fs::create_dir_all(&state).unwrap();
        let good = dir.join("t.py");
        std::fs::write(&good, "x = 1\n").unwrap();
        let (ok, errors) = resolve_tool_paths(
            &[
                good.clone(),
                dir.join("missing.py"),
                state.join("."),
                dir.clone(),
            ],
            &state,
        );
        assert_eq!(ok, vec![std::fs::canonicalize(&good).unwrap()]);
        assert_eq!(errors.len(), 3, "{errors:?}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
