//! Each principal's world: its own [`SessionManager`] and [`IroncellServer`], in a state
//! directory of its own (`<state dir>/principals/<name>-<hash>/`).
//!
//! Everything a session owns is therefore keyed by (principal, name) by construction: sessions
//! and their files and resources, jobs and tasks (ids are per world), the memory store, saved
//! tools, approvals (askers and the relay are per world's proxy), limits (the live-session cap
//! and the spare pool are per world, plus [`Worlds::max_runs`] runs at once), and the audit log
//! (the principal's own file, every line stamped with its name). Two principals both using
//! "default" never meet; a client that reconnects, or a second client of the same principal,
//! finds the same world.
//!
//! [`HttpHandler`] is the one rmcp handler of the HTTP service: each request carries the
//! principal its bearer token proved (put in the request's extensions by the auth layer), and
//! goes to that principal's world.

use std::borrow::Cow;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CancelTaskParams, GetTaskParams, GetTaskResult,
    ListResourcesResult, ListToolsResult, PaginatedRequestParams, ProtocolVersion,
    ReadResourceRequestParams, ReadResourceResponse, ServerConfig, UpdateTaskParams,
};
use rmcp::service::RequestContext;
use rmcp::{ErrorData as McpError, RoleServer, ServerHandler};
use sha2::Digest;

use super::auth::Principal;
use crate::config::Settings;
use crate::lock;
use crate::server::IroncellServer;
use crate::session::SessionManager;

/// One principal's sessions and everything they own.
pub struct World {
    pub principal: Principal,
    pub sessions: Arc<SessionManager>,
    pub server: IroncellServer,
    last_used: std::sync::Mutex<Instant>,
}

/// The worlds of the principals seen so far.
pub struct Worlds {
    settings: Settings,
    /// `<state dir>/principals`.
    base: PathBuf,
    exe: PathBuf,
    /// Runs one principal may have going at once.
    pub max_runs: u32,
    /// Worlds alive at once; past it an idle one is closed, or the request refused.
    pub max_principals: usize,
    map: std::sync::Mutex<HashMap<Principal, Arc<World>>>,
    /// Set when the drain's grace is over and the runs still going are being stopped.
    stopping: std::sync::atomic::AtomicBool,
}

/// How often worlds are looked at for idleness.
const REAP_EVERY: Duration = Duration::from_secs(30);

impl Worlds {
    pub fn new(
        settings: Settings,
        state_dir: PathBuf,
        exe: PathBuf,
        max_runs: u32,
        max_principals: usize,
    ) -> anyhow::Result<Arc<Worlds>> {
        let base = state_dir.join("principals");
        create_private_dir(&base)?;
        Ok(Arc::new(Worlds {
            settings,
            base,
            exe,
            max_runs,
            max_principals,
            map: std::sync::Mutex::new(HashMap::new()),
            stopping: Default::default(),
        }))
    }

    /// The world of `principal`, started on its first request.
    pub async fn get(&self, principal: &Principal) -> Result<Arc<World>, String> {
        if let Some(w) = lock(&self.map).get(principal) {
            *lock(&w.last_used) = Instant::now();
            return Ok(w.clone());
        }
        let closed = {
            let map = lock(&self.map);
            if map.len() < self.max_principals {
                None
            } else {
                Some(self.idle_worlds(&map, Duration::ZERO))
            }
        };
        if let Some(idle) = closed {
            let Some(oldest) = idle.into_iter().min_by_key(|w| *lock(&w.last_used)) else {
                return Err(format!(
                    "{} principals have live sessions on this server, the most at once \
                     (IRONCELL_MAX_PRINCIPALS); try again when one is idle",
                    self.max_principals
                ));
            };
            self.close(&oldest).await;
        }
        let mut map = lock(&self.map);
        if let Some(w) = map.get(principal) {
            return Ok(w.clone());
        }
        let world = self.start_world(principal).map_err(|e| {
            tracing::error!(
                principal = principal.as_str(),
                "cannot start its sessions: {e:#}"
            );
            format!("cannot start your sessions: {e:#}")
        })?;
        map.insert(principal.clone(), world.clone());
        Ok(world)
    }

    fn start_world(&self, principal: &Principal) -> anyhow::Result<Arc<World>> {
        let dir = self.base.join(dir_name(principal.as_str()));
        create_private_dir(&dir)?;
        let mut settings = self.settings.clone();
        settings.state_dir = Some(dir.clone());
        // Never the shared fallback directory: a world's state is its principal's alone.
        let used = settings.prepare_state_dir()?;
        if used != dir {
            anyhow::bail!(
                "the principal's state directory {} is not usable (got {})",
                dir.display(),
                used.display()
            );
        }
        let _ = std::fs::write(dir.join("principal"), principal.as_str());
        let sessions = SessionManager::start(settings, self.exe.clone())?;
        sessions.start_background_work();
        let server = IroncellServer::new(sessions.clone()).with_run_limit(self.max_runs);
        if let Some(audit) = sessions.proxy().audit() {
            audit.set_principal(principal.as_str());
        }
        tracing::info!(
            principal = principal.as_str(),
            dir = %dir.display(),
            "started a principal's sessions"
        );
        Ok(Arc::new(World {
            principal: principal.clone(),
            sessions,
            server,
            last_used: std::sync::Mutex::new(Instant::now()),
        }))
    }

    /// Worlds without a live session (their workers ended: expired after the session TTL, or
    /// gone), unused for at least `idle_for`.
    fn idle_worlds(
        &self,
        map: &HashMap<Principal, Arc<World>>,
        idle_for: Duration,
    ) -> Vec<Arc<World>> {
        map.values()
            .filter(|w| {
                w.sessions.live_worker_count() == 0 && lock(&w.last_used).elapsed() >= idle_for
            })
            .cloned()
            .collect()
    }

    async fn close(&self, world: &Arc<World>) {
        let removed = {
            let mut map = lock(&self.map);
            match map.get(&world.principal) {
                Some(w) if Arc::ptr_eq(w, world) => map.remove(&world.principal),
                _ => None,
            }
        };
        if let Some(w) = removed {
            tracing::info!(
                principal = w.principal.as_str(),
                "closing an idle principal's world"
            );
            w.sessions.shutdown().await;
        }
    }

    /// Closes worlds that have had no live session and no request for the session TTL (their
    /// zygote and spares are memory nobody uses); a principal's next request starts a fresh one.
    pub async fn reap_idle_periodically(self: Arc<Self>) {
        let mut tick = tokio::time::interval(REAP_EVERY);
        loop {
            tick.tick().await;
            let idle = self.idle_worlds(&lock(&self.map), self.settings.session_ttl);
            for w in idle {
                self.close(&w).await;
            }
        }
    }

    /// Runs going on now in every world (background jobs included).
    pub fn runs_in_progress(&self) -> usize {
        lock(&self.map)
            .values()
            .map(|w| w.server.runs_in_progress())
            .sum()
    }

    /// Stops every run still going (the drain's grace is over): each answers as cancelled,
    /// with a notice that says the server stopped it.
    pub async fn stop_runs(&self) {
        self.stopping
            .store(true, std::sync::atomic::Ordering::SeqCst);
        self.shutdown().await;
    }

    pub async fn shutdown(&self) {
        let all: Vec<Arc<World>> = lock(&self.map).drain().map(|(_, w)| w).collect();
        futures::future::join_all(all.iter().map(|w| w.sessions.shutdown())).await;
    }
}

/// Creates `dir` (and its parents) if missing, mode 700, and checks it is a directory of this
/// user's, not a symlink.
fn create_private_dir(dir: &std::path::Path) -> anyhow::Result<()> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt};
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(|e| anyhow::anyhow!("creating {}: {e}", dir.display()))?;
    let m = std::fs::symlink_metadata(dir)
        .map_err(|e| anyhow::anyhow!("checking {}: {e}", dir.display()))?;
    if !m.is_dir() || m.uid() != nix::unistd::getuid().as_raw() {
        anyhow::bail!(
            "{} is not a directory of this user's (a symlink, or someone else's)",
            dir.display()
        );
    }
    Ok(())
}

/// The directory of `principal`'s world under the state directory `state_dir`.
pub fn principal_dir(state_dir: &std::path::Path, principal: &str) -> PathBuf {
    state_dir.join("principals").join(dir_name(principal))
}

/// A principal's directory name: the safe characters of its name (for operators), then 16 hex
/// digits of its SHA-256 (so names that differ only in unsafe characters never share one).
pub fn dir_name(principal: &str) -> String {
    let readable: String = principal
        .chars()
        .take(40)
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '-' | '_') {
                c
            } else {
                '_'
            }
        })
        .collect();
    let hash = sha2::Sha256::digest(principal.as_bytes());
    let hex: String = hash.iter().take(8).map(|b| format!("{b:02x}")).collect();
    format!("{readable}-{hex}")
}

/// The rmcp handler behind `/mcp`: every request goes to its principal's world.
#[derive(Clone)]
pub struct HttpHandler {
    pub worlds: Arc<Worlds>,
    pub info: ServerConfig,
}

/// The principal the auth layer attached to the HTTP request behind `context`.
pub fn principal_of(context: &RequestContext<RoleServer>) -> Option<Principal> {
    context
        .extensions
        .get::<axum::http::request::Parts>()
        .and_then(|parts| parts.extensions.get::<Principal>())
        .cloned()
}

impl HttpHandler {
    async fn world(&self, context: &RequestContext<RoleServer>) -> Result<Arc<World>, McpError> {
        let Some(principal) = principal_of(context) else {
            // The auth layer runs before every request reaches rmcp: this cannot happen.
            return Err(McpError::internal_error(
                "request without a principal",
                None,
            ));
        };
        self.worlds
            .get(&principal)
            .await
            .map_err(|e| McpError::internal_error(e, None))
    }
}

impl ServerHandler for HttpHandler {
    fn get_info(&self) -> ServerConfig {
        self.info.clone()
    }

    fn supported_protocol_versions(&self) -> Cow<'static, [ProtocolVersion]> {
        Cow::Borrowed(crate::server::SUPPORTED_VERSIONS)
    }

    async fn get_task(
        &self,
        request: GetTaskParams,
        context: RequestContext<RoleServer>,
    ) -> Result<GetTaskResult, McpError> {
        let world = self.world(&context).await?;
        world.server.get_task(request, context).await
    }

    async fn cancel_task(
        &self,
        request: CancelTaskParams,
        context: RequestContext<RoleServer>,
    ) -> Result<(), McpError> {
        let world = self.world(&context).await?;
        world.server.cancel_task(request, context).await
    }

    async fn update_task(
        &self,
        request: UpdateTaskParams,
        context: RequestContext<RoleServer>,
    ) -> Result<(), McpError> {
        let world = self.world(&context).await?;
        world.server.update_task(request, context).await
    }

    async fn list_tools(
        &self,
        request: Option<PaginatedRequestParams>,
        context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, McpError> {
        let world = self.world(&context).await?;
        world.server.list_tools(request, context).await
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, McpError> {
        let world = self.world(&context).await?;
        let mut response = world.server.call_tool(request, context).await?;
        if self
            .worlds
            .stopping
            .load(std::sync::atomic::Ordering::SeqCst)
            && let CallToolResponse::Complete(result) = &mut response
        {
            note_stopped_by_shutdown(result);
        }
        Ok(response)
    }

    async fn list_resources(
        &self,
        request: Option<PaginatedRequestParams>,
        context: RequestContext<RoleServer>,
    ) -> Result<ListResourcesResult, McpError> {
        let world = self.world(&context).await?;
        world.server.list_resources(request, context).await
    }

    async fn read_resource(
        &self,
        request: ReadResourceRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<ReadResourceResponse, McpError> {
        let world = self.world(&context).await?;
        world.server.read_resource(request, context).await
    }
}

/// A run the server stopped when its drain's grace ran out says so: not "cancelled by the
/// client", and its session is gone with this server.
fn note_stopped_by_shutdown(result: &mut rmcp::model::CallToolResult) {
    let Some(record) = result.structured_content.as_mut() else {
        return;
    };
    if record.get("status").and_then(|s| s.as_str()) != Some("cancelled") {
        return;
    }
    let note = "this server was shutting down and its grace period for runs \
                (IRONCELL_DRAIN_GRACE) ended: it stopped this run, and the session is lost; run \
                it again (behind a load balancer it goes to another replica, in a new session)";
    record["session_state"] = "lost".into();
    if let Some(notices) = record.get_mut("notices").and_then(|n| n.as_array_mut()) {
        notices.insert(0, note.into());
    } else {
        record["notices"] = serde_json::json!([note]);
    }
    result.content.insert(
        0,
        rmcp::model::ContentBlock::text(format!("Stopped: {note}")),
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn principals_get_distinct_safe_directory_names() {
        let names = [
            "alice",
            "alice/",
            "alice?",
            "../..",
            ".",
            "",
            "a".repeat(300).as_str(),
        ]
        .map(dir_name);
        for n in &names {
            assert!(crate::session::valid_session_name(&n[..n.len().min(64)]) || n.len() > 64);
            assert!(!n.contains('/') && n != "." && n != "..", "{n}");
        }
        let unique: std::collections::HashSet<_> = names.iter().collect();
        assert_eq!(unique.len(), names.len());
    }
}
