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

/// Adds `tool` to `catalog` unless its name is taken or the catalog is full (then says why).
fn admit(catalog: &mut Catalog, tool: LocalTool) {
    if catalog.tools.iter().any(|x| x.name == tool.name) {
        catalog.errors.push(LoadError {
            file: String::new(),
            line: None,
            reason: format!(
                "tool {:?} is defined twice; the second is skipped",
                tool.name
            ),
        });
    } else if catalog.tools.len() < MAX_TOOLS {
        catalog.tools.push(tool);
    } else {
        catalog.errors.push(LoadError {
            file: String::new(),
            line: None,
            reason: format!("more than {MAX_TOOLS} tools; {:?} is skipped", tool.name),
        });
    }
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

/// `ironcell saved-tools …`: the user's own hand on the saved tools.
#[derive(Debug, clap::Subcommand)]
pub enum SavedToolsAction {
    /// List the saved tools and the session that owns each.
    List,
    /// Delete a saved tool, whichever session saved it (a running server drops it from its
    /// list at its next save or delete, or when it restarts).
    Delete {
        /// The tool's name.
        name: String,
    },
}

/// Runs `ironcell saved-tools` on the state directory `state_dir`: what to print, or the error.
pub fn saved_tools_command(state_dir: &Path, action: &SavedToolsAction) -> Result<String, String> {
    let dir = state_dir.join("tools");
    match action {
        SavedToolsAction::List => {
            let mut out = String::new();
            for file in sorted_saved_tool_files(&dir) {
                let name = saved_stem(&file).to_string();
                let owner = owner_of(&dir, &name).map_or_else(
                    || "(no owner: saved before tools had owners)".to_string(),
                    |o| format!("session {}", crate::proxy::approval::escaped_string(&o)),
                );
                out.push_str(&format!("{name}\t{owner}\n"));
            }
            if out.is_empty() {
                out = format!("no saved tools in {}\n", dir.display());
            }
            Ok(out)
        }
        SavedToolsAction::Delete { name } => {
            if !valid_tool_name(name) {
                return Err(format!("{name:?} is not a saved tool's name"));
            }
            let _saving = lock(&SAVING);
            std::fs::remove_file(dir.join(format!("{name}.py")))
                .map_err(|e| format!("no saved tool {name:?} in {}: {e}", dir.display()))?;
            let _ = std::fs::remove_file(owner_file(&dir, name));
            Ok(format!("Tool {name:?} deleted.\n"))
        }
    }
}

/// Held across a save or delete, so two sessions saving one name cannot interleave their
/// owner and tool files.
static SAVING: Mutex<()> = Mutex::new(());

/// The file that names the session which saved the tool `name` (its owner).
fn owner_file(dir: &Path, name: &str) -> PathBuf {
    dir.join(format!(".{name}.owner"))
}

/// The session that saved `name`, if known (a tool saved before owners were kept has none,
/// and no session may replace or delete it: only the user can, by removing its file).
fn owner_of(dir: &Path, name: &str) -> Option<String> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let mut text = String::new();
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(owner_file(dir, name))
        .ok()?
        .take(4096)
        .read_to_string(&mut text)
        .ok()?;
    Some(text)
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

    async fn load_catalog(&self, generation: u64) -> Catalog {
        let mut catalog = Catalog {
            generation,
            files_generation: 0,
            load_failed: false,
            loaded_at: None,
            tools: Vec::new(),
            errors: self.path_errors.clone(),
        };
        // The files first: a saved tool cannot take a file tool's name. Nor while any of the
        // files, or any tool in them, could not be loaded (a file that raised or took too long
        // at import, a session that failed or was stopped, say by the free-disk guard, a
        // `--tools` path that is gone): the names they define are then unknown, so the saved
        // tools wait until every file loads, instead of being listed under names that may be
        // the user's.
        if self.has_tools_in(Home::Files) {
            let files = self
                .files_part_unless(&CancellationToken::new())
                .await
                .unwrap_or_default();
            catalog.files_generation = files.generation;
            catalog.tools.extend(files.tools.iter().cloned());
            catalog.errors.extend(files.errors.iter().cloned());
            catalog.load_failed = files.load_failed;
        }
        if self.has_tools_in(Home::Saved) {
            if catalog.load_failed || !catalog.errors.is_empty() {
                catalog.errors.push(LoadError {
                    file: self.saved_dir.display().to_string(),
                    line: None,
                    reason: "the saved tools are not listed while a tools file (or a tool in one) \
                             cannot be loaded: fix the errors above"
                        .into(),
                });
            } else {
                self.load_saved(&mut catalog).await;
            }
        }
        catalog
    }

    /// Adds the saved files' tools to `catalog`: each file's listing from before if the file
    /// is unchanged, else loaded now, for at most [`SAVED_LOAD_BUDGET`] in all (the files not
    /// reached are named, and the catalog is loaded again after [`RETRY_FAILED_LOAD`]).
    async fn load_saved(&self, catalog: &mut Catalog) {
        let started = std::time::Instant::now();
        let mut kept = HashMap::new();
        let mut not_reached = 0usize;
        for file in sorted_saved_tool_files(&self.saved_dir) {
            let Some(key) = file_key(&file) else {
                continue; // deleted since it was listed
            };
            let cached = lock(&self.saved_loads)
                .get(&file)
                .filter(|l| l.key == key)
                .cloned();
            let load = match cached {
                Some(load) => load,
                None if started.elapsed() >= SAVED_LOAD_BUDGET => {
                    not_reached += 1;
                    continue;
                }
                None => {
                    let mut part = Catalog {
                        generation: catalog.generation,
                        ..Catalog::default()
                    };
                    self.load_saved_file(&file, &mut part).await;
                    SavedFileLoad {
                        key,
                        tools: part.tools,
                        errors: part.errors,
                    }
                }
            };
            for tool in load.tools.iter().cloned() {
                admit(catalog, tool);
            }
            catalog.errors.extend(load.errors.iter().cloned());
            kept.insert(file, load);
        }
        *lock(&self.saved_loads) = kept;
        if not_reached > 0 {
            catalog.errors.push(LoadError {
                file: self.saved_dir.display().to_string(),
                line: None,
                reason: format!(
                    "{not_reached} saved tools files were not loaded yet (loading the others took \
                     over {} s); they are listed once loaded",
                    SAVED_LOAD_BUDGET.as_secs()
                ),
            });
            catalog.load_failed = true;
        }
    }

    /// Loads one saved tools file in a fresh worker of its own session, granted only that file,
    /// for at most [`SAVED_LOAD_TIMEOUT`], and adds its tool to `catalog`; the worker is
    /// stopped after (a call starts another).
    async fn load_saved_file(&self, file: &Path, catalog: &mut Catalog) {
        self.load_from(Some(file), catalog).await;
        if let Some(sessions) = self.sessions.upgrade() {
            sessions.stop_idle_worker(&session_of(Some(file))).await;
        }
    }

    /// Loads the tools of the `--tools` files, or of one saved file, in their session (a fresh
    /// interpreter per generation: modules re-import, and the grants are current) and adds
    /// them to `catalog`.
    async fn load_from(&self, saved_file: Option<&Path>, catalog: &mut Catalog) {
        let session = session_of(saved_file);
        let token = self.new_token();
        let spec = self.spec_for(saved_file, &token, catalog.generation);
        let answer = self
            .run_in_tools_session(
                &session,
                "_tools_catalog",
                &spec,
                &token,
                (true, saved_file.map(|_| SAVED_LOAD_TIMEOUT)),
                CancellationToken::new(),
                json!({"load": saved_file.map_or("the --tools files", |_| "a saved tool's file")}),
            )
            .await;
        let answer = match answer {
            Ok((_, Some(answer))) => answer,
            Ok((record, None)) => {
                catalog
                    .errors
                    .push(session_failure(&record.render(self.output_mode)));
                catalog.load_failed = true;
                return;
            }
            Err(why) => {
                catalog.errors.push(session_failure(&why));
                catalog.load_failed = true;
                return;
            }
        };
        if let Some(errors) = answer.get("errors").and_then(Value::as_array) {
            for e in errors.iter().take(MAX_LOAD_ERRORS) {
                catalog.errors.push(LoadError {
                    file: crate::clip_chars(
                        e.get("file").and_then(Value::as_str).unwrap_or("?"),
                        4096,
                    ),
                    line: e.get("line").and_then(Value::as_u64),
                    reason: crate::clip_chars(
                        e.get("reason").and_then(Value::as_str).unwrap_or("?"),
                        2048,
                    ),
                });
            }
        }
        let tools = answer.get("tools").and_then(Value::as_array);
        // A saved file is one tool, named after the file (`save_tool` writes it so); whatever
        // else its worker lists is its own code's claim, and the names of other files' tools
        // are not its to take (SECURITY.md #137).
        let own_name = saved_file.map(saved_stem);
        let mut listed_own = false;
        for t in tools.into_iter().flatten() {
            match checked_tool(t, saved_file) {
                Ok(tool) if own_name.is_some_and(|own| tool.name != own || listed_own) => {
                    catalog.errors.push(LoadError {
                        file: saved_file
                            .map(|f| f.display().to_string())
                            .unwrap_or_default(),
                        line: None,
                        reason: format!(
                            "a saved tools file holds one tool, named after the file ({:?}); {:?} \
                             is skipped",
                            own_name.unwrap_or_default(),
                            tool.name
                        ),
                    });
                }
                Ok(tool) => {
                    listed_own |= own_name.is_some();
                    admit(catalog, tool);
                }
                Err(why) => catalog.errors.push(LoadError {
                    file: crate::clip_chars(
                        t.get("file").and_then(Value::as_str).unwrap_or("?"),
                        4096,
                    ),
                    line: t.get("line").and_then(Value::as_u64),
                    reason: why,
                }),
            }
        }
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

    /// The MCP result of one call: the value (text, and `structuredContent` for tools with an
    /// output schema), or an `isError` result shaped like `run_python`'s.
    fn tool_result(
        &self,
        tool: &LocalTool,
        mut record: RunRecord,
        envelope: Option<Value>,
    ) -> CallToolResult {
        let Some(env) = envelope else {
            return self.record_error(record, "the tool session gave no answer");
        };
        let message = env
            .get("message")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string();
        if env.get("ok") == Some(&Value::Bool(true)) {
            let value = env.get("value").cloned().unwrap_or(Value::Null);
            let mut content = vec![ContentBlock::text(value_text(&value))];
            let printed = printed_output(&record);
            if !printed.is_empty() {
                content.push(ContentBlock::text(printed));
            }
            let mut result = CallToolResult::success(content);
            if tool.output_schema.is_some() {
                result.structured_content = env.get("structured").cloned();
            }
            return result;
        }
        match env.get("kind").and_then(Value::as_str) {
            Some("validation") => {
                error_result(format!("invalid arguments for {}: {message}", tool.name))
            }
            Some("raised") => {
                record.status = RunStatus::Error;
                record.error = Some(crate::frame::PyErrorInfo {
                    kind: crate::clip_chars(
                        env.get("type").and_then(Value::as_str).unwrap_or("Error"),
                        256,
                    ),
                    message: crate::clip_chars(&message, 8192),
                    traceback: crate::clip_chars(
                        env.get("traceback").and_then(Value::as_str).unwrap_or(""),
                        16384,
                    ),
                });
                self.record_error(record, "")
            }
            _ => error_result(format!("the tool {} could not run: {message}", tool.name)),
        }
    }

    fn record_error(&self, record: RunRecord, why: &str) -> CallToolResult {
        let mut text = record.render(self.output_mode);
        if !record.is_error() && !why.is_empty() {
            text = format!("error: {why}\n{text}");
        }
        let mut result = CallToolResult::error(vec![ContentBlock::text(text)]);
        result.structured_content = serde_json::to_value(&record).ok();
        result
    }

    /// Answers one `tools.<op>` bridge request of the worker of session `from`.
    pub async fn handle(
        &self,
        from: &str,
        request: ToolsRequest,
        cancel: CancellationToken,
    ) -> Result<Value, BridgeError> {
        let from_tools = is_reserved_session(from);
        match request {
            ToolsRequest::Answer { token, answer, .. } => {
                if !from_tools {
                    return Err(BridgeError::new(
                        ErrorKind::BadRequest,
                        "only the tools session answers".into(),
                    ));
                }
                self.accept_answer(from, &token, answer)
                    .map(|()| Value::Null)
            }
            ToolsRequest::List | ToolsRequest::Call { .. } if from_tools => Err(BridgeError::new(
                ErrorKind::BadRequest,
                "inside a tool, call other tools as plain functions".into(),
            )),
            ToolsRequest::List => {
                let catalog = if self.listed.load(Ordering::SeqCst) {
                    self.ensure_catalog_unless(&cancel).await.ok_or_else(gone)?
                } else {
                    Arc::new(Catalog {
                        errors: self.path_errors.clone(),
                        ..Catalog::default()
                    })
                };
                let tools: Vec<Value> = catalog
                    .tools
                    .iter()
                    .map(|t| {
                        let mut v = json!({
                            "name": t.name,
                            "description": t.description,
                            "inputSchema": t.input_schema,
                            "origin": t.home().origin(),
                        });
                        if let Some(o) = &t.output_schema {
                            v["outputSchema"] = Value::Object(o.clone());
                        }
                        v
                    })
                    .collect();
                Ok(json!({"tools": tools, "errors": catalog.errors}))
            }
            ToolsRequest::Call { name, arguments } => {
                if !arguments.is_object() {
                    return Err(BridgeError::new(ErrorKind::BadRequest, "the arguments must be a dict".into()));
                }
                let found = if self.listed.load(Ordering::SeqCst) {
                    self.find_tool_unless(&name, &cancel)
                        .await
                        .ok_or_else(gone)?
                } else {
                    Err(Arc::new(Catalog::default()))
                };
                let tool = match found {
                    Ok(tool) => tool,
                    Err(catalog) => {
                        let names: Vec<&str> = catalog.tools.iter().map(|t| &*t.name).collect();
                        let names = if names.is_empty() {
                            "(none)".to_string()
                        } else {
                            names.join(", ")
                        };
                        let message = format!("no local tool {name:?}; tools: {names}");
                        return Err(BridgeError::new(ErrorKind::UnknownTool, message));
                    }
                };
                let (record, envelope) = self
                    .invoke(&tool, arguments, cancel, &format!("session {from:?}"))
                    .await
                    .map_err(|why| BridgeError::new(ErrorKind::Unavailable, why))?;
                let Some(env) = envelope else {
                    return Err(BridgeError::new(ErrorKind::Unavailable, record.render(self.output_mode)));
                };
                if env.get("ok") == Some(&Value::Bool(true)) {
                    return Ok(env.get("value").cloned().unwrap_or(Value::Null));
                }
                let message = env.get("message").and_then(Value::as_str).unwrap_or("");
                match env.get("kind").and_then(Value::as_str) {
                    Some("validation") => Err(BridgeError::new(
                        ErrorKind::BadRequest,
                        format!("invalid arguments for {name}: {message}"),
                    )),
                    Some("raised") => {
                        let kind = env.get("type").and_then(Value::as_str).unwrap_or("Error");
                        let tb = env.get("traceback").and_then(Value::as_str).unwrap_or("");
                        Err(BridgeError::new(
                            ErrorKind::Refused,
                            format!("{name} raised {kind}: {message}\n{tb}"),
                        ))
                    }
                    _ => Err(BridgeError::new(ErrorKind::Unavailable, message.to_string())),
                }
            }
            ToolsRequest::Save { .. } | ToolsRequest::Delete { .. } if from_tools => Err(BridgeError::new(
                ErrorKind::BadRequest,
                "a tool cannot save or delete tools (its save would reload the tools, which runs it \
                 again); do it from a run_python session"
                    .into(),
            )),
            ToolsRequest::Save { name, source } => {
                // The user's tools keep their names: a saved tool of the same name would never
                // be listed. Asked of the files' tools (waiting for a load of them in progress).
                let shown = name.as_deref().unwrap_or("");
                if !self.paths.is_empty()
                    && self
                        .files_part_unless(&cancel)
                        .await
                        .ok_or_else(gone)?
                        .tools
                        .iter()
                        .any(|t| *t.name == *shown)
                {
                    return Err(BridgeError::new(
                        ErrorKind::BadRequest,
                        format!(
                            "a tool named {shown:?} comes from the tools files; choose another name"
                        ),
                    ));
                }
                let message = self.save(from, name, source)?;
                Ok(json!({ "message": message }))
            }
            ToolsRequest::Delete { name } => {
                let name = name.as_str();
                if !valid_tool_name(name) {
                    return Err(BridgeError::new(ErrorKind::BadRequest, format!("no saved tool {name:?}")));
                }
                let _saving = lock(&SAVING);
                if self.saved_dir.join(format!("{name}.py")).is_file() {
                    self.check_owner(from, name, "delete")?;
                }
                match std::fs::remove_file(self.saved_dir.join(format!("{name}.py"))) {
                    Ok(()) => {
                        let _ = std::fs::remove_file(owner_file(&self.saved_dir, name));
                        self.list_changed();
                        Ok(json!({"message": format!("Tool {name:?} deleted.")}))
                    }
                    Err(_) => Err(BridgeError::new(ErrorKind::BadRequest, format!("no saved tool {name:?}"))),
                }
            }
        }
    }

    /// Takes an answer of the tools session `from` for a token the host is waiting for from it.
    fn accept_answer(&self, from: &str, token: &str, answer: Value) -> Result<(), BridgeError> {
        let size = answer.to_string().len();
        let mut inbox = lock(&self.inbox);
        let Some((session, slot)) = inbox.get_mut(token) else {
            return Err(BridgeError::new(
                ErrorKind::BadRequest,
                "no answer is expected under that token".into(),
            ));
        };
        if session != from {
            return Err(BridgeError::new(
                ErrorKind::BadRequest,
                "no answer is expected from this session under that token".into(),
            ));
        }
        if slot.is_some() {
            return Err(BridgeError::new(
                ErrorKind::BadRequest,
                "that token was already answered".into(),
            ));
        }
        if size > MAX_ANSWER_BYTES {
            let note = format!(
                "the answer is {size} bytes; the limit is {} MiB: return less (or write it to a file)",
                MAX_ANSWER_BYTES >> 20
            );
            *slot = Some(
                json!({"envelope": {"ok": false, "kind": "raised", "type": "ValueError", "message": note, "traceback": ""}, "tools": [], "errors": [{"file": "", "reason": note}]}),
            );
            return Err(BridgeError::new(ErrorKind::BadRequest, note));
        }
        *slot = Some(answer);
        Ok(())
    }

    /// Refuses a session's `what` (replace, delete) of a saved tool another session saved.
    fn check_owner(&self, from: &str, name: &str, what: &str) -> Result<(), BridgeError> {
        let owner = owner_of(&self.saved_dir, name);
        if owner.as_deref() == Some(from) {
            return Ok(());
        }
        let file = self.saved_dir.join(format!("{name}.py"));
        Err(BridgeError::new(
            ErrorKind::Refused,
            format!(
                "the saved tool {name:?} belongs to {}; a session may only {what} the tools it saved. Choose another name, or ask the user to remove it (`ironcell saved-tools delete {name}`, or delete {} on the host)",
                match owner {
                    Some(_) => "another session".to_string(),
                    None => "no session (it was saved before tools had owners)".to_string(),
                },
                file.display()
            ),
        ))
    }

    /// Writes a saved tool (`<state dir>/tools/<name>.py`) owned by session `from`, and
    /// announces the new list.
    fn save(
        &self,
        from: &str,
        name: Option<String>,
        source: Option<String>,
    ) -> Result<String, BridgeError> {
        let bad = |m: String| BridgeError::new(ErrorKind::BadRequest, m);
        let name = name.ok_or_else(|| bad("a tool name must be a string".into()))?;
        let name = name.as_str();
        if !valid_tool_name(name) {
            return Err(bad(format!(
                "invalid tool name {name:?}: use a Python identifier of at most 64 ASCII letters, digits and '_', other than {}",
                RESERVED_NAMES.join(" and ")
            )));
        }
        let source = source.ok_or_else(|| bad("the tool's source must be a string".into()))?;
        if source.len() > MAX_SAVED_TOOL_BYTES {
            return Err(bad(format!(
                "the tool's source is {} bytes; the limit is {MAX_SAVED_TOOL_BYTES}",
                source.len()
            )));
        }
        let target = format!("{name}.py");
        let _saving = lock(&SAVING);
        let existing = saved_tool_files(&self.saved_dir).count();
        let replacing = self.saved_dir.join(&target).is_file();
        if replacing {
            self.check_owner(from, name, "replace")?;
        }
        if !replacing && existing >= MAX_SAVED_TOOLS {
            return Err(bad(format!(
                "there are already {existing} saved tools (the limit); delete some first"
            )));
        }
        let failed = |e: std::io::Error| {
            BridgeError::new(
                ErrorKind::Unavailable,
                format!("saving the tool failed: {e}"),
            )
        };
        // The owner first: a tool file is never without one.
        if !replacing {
            write_saved_tool(&self.saved_dir, &format!(".{name}.owner"), from.as_bytes())
                .map_err(failed)?;
        }
        write_saved_tool(&self.saved_dir, &target, source.as_bytes()).map_err(failed)?;
        self.listed.store(true, Ordering::SeqCst);
        self.list_changed();
        Ok(format!(
            "Tool {name:?} saved: it is an MCP tool from now on (also after restarts), run in the sandbox."
        ))
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

/// Answers a `tools.<op>` bridge request of the worker of session `from` (an error where no
/// local tools exist, e.g. `ironcell exec`). Boxed: a call runs a cell in the tools session,
/// whose run loop is what spawns this future.
pub fn handle_request(
    tools: Option<Arc<LocalTools>>,
    from: String,
    request: ToolsRequest,
    cancel: CancellationToken,
) -> futures::future::BoxFuture<'static, Result<Value, BridgeError>> {
    Box::pin(async move {
        match tools {
            Some(t) => t.handle(&from, request, cancel).await,
            None => Err(BridgeError::unavailable(
                "local tools are only available under `ironcell serve`",
            )),
        }
    })
}

/// The error of a request whose worker went while it waited (nobody reads it).
fn gone() -> BridgeError {
    BridgeError::new(ErrorKind::Unavailable, "the caller is gone".into())
}

fn session_failure(why: &str) -> LoadError {
    LoadError {
        file: String::new(),
        line: None,
        reason: format!(
            "the tools session could not load the tools: {}",
            crate::clip_chars(why, 4096)
        ),
    }
}

/// Checks one tool of the catalog that the session of the `--tools` files, or of `saved_file`,
/// sent (it is untrusted data); the tool is run in that session.
fn checked_tool(t: &Value, saved_file: Option<&Path>) -> Result<LocalTool, String> {
    let name = t.get("name").and_then(Value::as_str).unwrap_or("");
    if !valid_tool_name(name) {
        return Err(format!(
            "tool name {:?} is not usable: use a Python identifier of at most 64 ASCII characters, other than {}",
            crate::clip_chars(name, 80),
            RESERVED_NAMES.join(" and ")
        ));
    }
    let description = t.get("description").and_then(Value::as_str).unwrap_or("");
    let description = crate::clip_chars(
        description,
        if saved_file.is_some() {
            MAX_SAVED_DESCRIPTION_CHARS
        } else {
            MAX_DESCRIPTION_CHARS
        },
    );
    let schema = |key: &str| -> Result<Option<JsonObject>, String> {
        match t.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Object(o)) => {
                if o.get("type") != Some(&json!("object")) {
                    return Err(format!("tool {name}: its {key} is not an object schema"));
                }
                let size = serde_json::to_string(o)
                    .map(|s| s.len())
                    .unwrap_or(usize::MAX);
                if size > MAX_SCHEMA_BYTES {
                    return Err(format!(
                        "tool {name}: its {key} is {size} bytes; the limit is {MAX_SCHEMA_BYTES}"
                    ));
                }
                Ok(Some(o.clone()))
            }
            Some(_) => Err(format!("tool {name}: its {key} is not an object")),
        }
    };
    let input_schema =
        schema("inputSchema")?.ok_or_else(|| format!("tool {name} has no inputSchema"))?;
    let output_schema = schema("outputSchema")?;
    Ok(LocalTool {
        name: name.to_string(),
        description,
        input_schema,
        output_schema,
        saved_file: saved_file.map(Path::to_path_buf),
    })
}

fn to_mcp_tool(t: &LocalTool) -> Tool {
    let tool = Tool::new(
        t.name.clone(),
        t.description.clone(),
        Arc::new(t.input_schema.clone()),
    );
    match &t.output_schema {
        Some(o) => tool.with_raw_output_schema(Arc::new(o.clone())),
        None => tool,
    }
}

/// A tool's value as text: a string as it is, anything else as JSON.
fn value_text(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        other => serde_json::to_string(other).unwrap_or_default(),
    }
}

/// What the tool printed, if anything, as one text block.
fn printed_output(record: &RunRecord) -> String {
    let mut parts = Vec::new();
    if !record.stdout.trim().is_empty() {
        parts.push(format!("[printed]\n{}", record.stdout.trim_end()));
    }
    if !record.stderr.trim().is_empty() {
        parts.push(format!("[stderr]\n{}", record.stderr.trim_end()));
    }
    parts.join("\n")
}

fn error_result(message: String) -> CallToolResult {
    CallToolResult::error(vec![ContentBlock::text(format!("error: {message}"))])
}

/// The `--tools` entries as real paths, and why any cannot be used. A tools path may not
/// contain, or lie inside, the state dir (it is granted to the tools session).
fn resolve_tool_paths(paths: &[PathBuf], state_dir: &Path) -> (Vec<PathBuf>, Vec<LoadError>) {
    let state = std::fs::canonicalize(state_dir).unwrap_or_else(|_| state_dir.to_path_buf());
    let mut ok = Vec::new();
    let mut errors = Vec::new();
    for p in paths {
        let shown = p.display().to_string();
        let fail = |reason: String| LoadError {
            file: shown.clone(),
            line: None,
            reason,
        };
        match std::fs::canonicalize(p) {
            Err(e) => errors.push(fail(format!(
                "{e}; give an existing .py file or folder with --tools (IRONCELL_TOOLS)"
            ))),
            Ok(real) if real == Path::new("/") => errors.push(fail(
                "is the root directory; give a file or a folder of tools".into(),
            )),
            Ok(real) if real.starts_with(&state) || state.starts_with(&real) => {
                errors.push(fail(format!(
                    "overlaps ironcell's state dir {}; keep tools elsewhere",
                    state.display()
                )))
            }
            Ok(real) if real.is_file() && real.extension().is_none_or(|e| e != "py") => {
                errors.push(fail("is not a .py file".into()))
            }
            Ok(real) => {
                if !ok.contains(&real) {
                    ok.push(real);
                }
            }
        }
    }
    (ok, errors)
}

/// The saved tool files (`<identifier>.py`, regular files) of `dir`.
/// The saved tools files, in name order (the order they are listed in).
fn sorted_saved_tool_files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = saved_tool_files(dir).collect();
    files.sort();
    files
}

fn saved_tool_files(dir: &Path) -> impl Iterator<Item = PathBuf> {
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let name = e.file_name();
            let stem = name.to_str()?.strip_suffix(".py")?;
            let regular = e.file_type().ok()?.is_file();
            (regular && valid_tool_name(stem)).then(|| e.path())
        })
}

/// Writes `name` in `dir` (created private if missing) through a fresh temporary file that is
/// renamed over it, so a reader never sees half a file and a planted symlink is never followed.
fn write_saved_tool(dir: &Path, name: &str, bytes: &[u8]) -> std::io::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)?;
    let meta = std::fs::symlink_metadata(dir)?;
    if !meta.is_dir() {
        return Err(std::io::Error::other(format!(
            "{} is not a directory",
            dir.display()
        )));
    }
    crate::host_fs::replace_file_privately(dir, name, bytes)
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
