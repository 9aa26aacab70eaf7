//! Idle sessions: the TTL's expiry (workers stopped, files deleted), a worker stopped once it
//! has no further use, and the eviction that makes room under the live-session cap.

use super::*;

impl SessionManager {
    pub(super) async fn expire_idle_sessions_periodically(&self) {
        let every =
            (self.settings.session_ttl / 4).clamp(Duration::from_secs(1), Duration::from_secs(60));
        let mut tick = tokio::time::interval(every);
        loop {
            tick.tick().await;
            self.expire_idle_sessions().await;
        }
    }

    /// Makes room for one more worker by stopping an idle session: a saved tools file's, else
    /// the least recently used.
    pub(super) async fn evict_one_idle_session(&self, except: &str) -> Result<(), RunRefusal> {
        let mut candidates: Vec<Arc<Session>> = lock(&self.sessions)
            .values()
            .filter(|s| s.name != except)
            .cloned()
            .collect();
        // The saved tools files' sessions first (their workers hold nothing a later call cannot
        // rebuild by importing the file again), then the least recently used.
        candidates.sort_by_key(|s| {
            (
                !crate::local_tools::is_saved_file_session(&s.name),
                *lock(&s.last_used),
            )
        });
        for s in candidates {
            let Ok(mut st) = s.state.try_lock() else {
                continue;
            };
            if let Some(w) = st.worker.take() {
                w.kill().await;
                st.pending_notice = Some(format!(
                    "this session was stopped to make room for another (at most {} live sessions, IRONCELL_MAX_SESSIONS); variables were lost, files are kept",
                    self.settings.max_sessions
                ));
                tracing::info!(session = %s.name, "evicted idle session");
                return Ok(());
            }
        }
        Err(RunRefusal::Busy(self.settings.max_sessions))
    }

    /// Stops the worker of session `name`, if it has one, once the session is free (its files
    /// stay; its next run starts a fresh worker). For a session whose worker has no further
    /// use, such as a saved tools file's after its tools were listed: it does not hold a
    /// session slot until the idle TTL.
    pub async fn stop_idle_worker(&self, name: &str) {
        let Some(session) = lock(&self.sessions).get(name).cloned() else {
            return;
        };
        let mut state = session.state.lock().await;
        if let Some(w) = state.worker.take() {
            w.kill().await;
        }
    }

    /// Stops the workers of sessions idle longer than the TTL and deletes their files.
    pub async fn expire_idle_sessions(&self) {
        let ttl = self.settings.session_ttl;
        let idle: Vec<Arc<Session>> = lock(&self.sessions)
            .values()
            .filter(|s| lock(&s.last_used).elapsed() >= ttl)
            .cloned()
            .collect();
        for s in idle {
            let Ok(mut st) = s.state.try_lock() else {
                continue;
            };
            let had_worker = st.worker.is_some();
            if let Some(w) = st.worker.take() {
                w.kill().await;
            }
            let had_files = s.scratch.exists();
            self.empty_scratch(&s).await;
            self.packages.forget(&s.name);
            if had_worker || had_files {
                st.pending_notice = Some(format!(
                    "this session expired after {} s idle (IRONCELL_SESSION_TTL); variables and files were discarded",
                    ttl.as_secs()
                ));
                tracing::info!(session = %s.name, "session expired");
            }
        }
    }
}
