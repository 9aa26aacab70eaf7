//! `mcp.fork(name)`: a fork asked for from code. The cell cannot be forked mid-run (the fork
//! would continue the cell with nobody listening), so the request queues the fork for the end
//! of the run: `session.fork` is refused at once for everything known then (the name, where
//! sessions cannot fork, the depth, the live-session cap, the quota and the free disk), and the
//! fork is made when the cell returns, under the run's own lock of the session (no other run of
//! it comes between), with every check made again. The run's result says how it went.

use futures::future::BoxFuture;
use ironcell_core::bridge::{BridgeError, ErrorKind};
use serde_json::{Value, json};

use super::*;

impl crate::router::Forks for SessionManager {
    fn queue_fork(
        self: Arc<Self>,
        session: String,
        name: String,
        fork_layers: Option<u32>,
    ) -> BoxFuture<'static, Result<Value, BridgeError>> {
        Box::pin(async move { self.queue(&session, &name, fork_layers).await })
    }
}

impl SessionManager {
    /// Queues a fork of `from` into `to` for the end of `from`'s run, or says why not.
    async fn queue(
        &self,
        from: &str,
        to: &str,
        fork_layers: Option<u32>,
    ) -> Result<Value, BridgeError> {
        let refused = |why: String| BridgeError::new(ErrorKind::Refused, why);
        if !valid_session_name(to) {
            return Err(BridgeError::bad_request(format!(
                "{to:?} is not a session name: 1 to 64 letters, digits, '-', '_' or '.'"
            )));
        }
        self.fork_name_refusal(from, to)
            .map_err(|e| refused(e.to_string()))?;
        let Some(layers) = fork_layers else {
            return Err(refused(format!("cannot fork: {}", self.cannot_fork_here())));
        };
        let Some(parent) = lock(&self.sessions).get(from).cloned() else {
            return Err(BridgeError::unavailable("this session is gone"));
        };
        {
            let mut queued = lock(&parent.queued_forks);
            // Each fork of this run takes one more layer and one more slot.
            let ahead = queued.len() as u32;
            let ancestors = lock(&parent.lineage).len();
            if let Some(why) = Self::depth_refusal(from, layers + ahead, ancestors) {
                return Err(refused(format!("cannot fork: {why}")));
            }
            if self.session_slots.available_permits() <= ahead as usize {
                return Err(refused(format!("cannot fork: {}", self.cap_refusal())));
            }
            queued.push(to.to_string());
        }
        if let Err(why) = self.fork_fits_on_disk(&parent.scratch).await {
            lock(&parent.queued_forks).retain(|n| n != to);
            return Err(refused(format!("cannot fork: {why}")));
        }
        Ok(json!({
            "session": to,
            "forked_from": from,
            "when": "end_of_run",
        }))
    }

    /// Makes the forks `names` that `parent`'s run asked for, as the run left it: each ordered
    /// under the run's lock (`state`), then finished without it. Returns the run's notes.
    pub(super) async fn make_queued_forks(
        &self,
        parent: &Arc<Session>,
        mut state: tokio::sync::MutexGuard<'_, SessionState>,
        names: Vec<String>,
        cancel: &tokio_util::sync::CancellationToken,
    ) -> Vec<String> {
        let mut notes = Vec::new();
        let mut ordered = Vec::new();
        for to in names {
            let made = match self.fork_name_refusal(&parent.name, &to) {
                Ok(()) => self.order_fork(parent, &mut state, &to, cancel).await,
                Err(e) => Err(e),
            };
            match made {
                Ok(o) => ordered.push(o),
                Err(e) => notes.push(format!("mcp.fork({to:?}) did not happen: {e}")),
            }
        }
        drop(state);
        for o in ordered {
            let to = o.to.clone();
            notes.push(match self.finish_fork(o, cancel).await {
                Ok(_) => format!(
                    "forked into session {to:?} as this run left it (mcp.fork): run code there \
                     with session={to:?}"
                ),
                Err(e) => format!("mcp.fork({to:?}) did not happen: {e}"),
            });
        }
        notes
    }
}
