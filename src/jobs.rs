//! Background jobs: a `run_python` call still running when the client's patience runs out.
//!
//! Every run executes in its own task. The `tools/call` waits for it up to the wait budget
//! (`IRONCELL_WAIT_BUDGET`, default 45 s, under Claude Desktop's ~60 s limit); if the run is
//! still going, the call returns a "running" result naming the job, and the run continues. The
//! `run_python_job` tool then waits for it, polls it, or cancels it. A finished job's result is
//! kept until it is read, or for an hour.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::audit::{AuditEntry, AuditLog};
use crate::lock;
use std::time::{Duration, Instant};

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::output::RunRecord;
use crate::session::{Progress, RunRefusal, RunRequest, SessionManager};

/// How long a finished job's result is kept when nobody reads it.
pub const FINISHED_JOB_TTL: Duration = Duration::from_secs(3600);

/// How a job's run ended: its record, or why it was refused before any code ran.
pub type Outcome = Arc<Result<RunRecord, RunRefusal>>;

pub struct Job {
    pub id: String,
    pub session: String,
    pub started: Instant,
    /// Wall-clock start, for the task view (`createdAt`).
    pub created_at: chrono::DateTime<chrono::Utc>,
    pub cancel: CancellationToken,
    pub progress: watch::Receiver<Progress>,
    /// Set once a call has answered "still running" for it: from then on it runs in the
    /// background and its session is busy.
    pub detached: std::sync::atomic::AtomicBool,
    outcome: watch::Receiver<Option<Outcome>>,
    finished_at: Arc<Mutex<Option<Instant>>>,
}

impl Job {
    /// The result, if the run has ended.
    pub fn outcome(&self) -> Option<Outcome> {
        self.outcome.borrow().clone()
    }

    /// How long after its start the run ended, if it has.
    pub fn finished_after(&self) -> Option<Duration> {
        lock(&self.finished_at).map(|t| t.duration_since(self.started))
    }

    /// Waits up to `limit` for the run to end.
    pub async fn wait(&self, limit: Duration) -> Option<Outcome> {
        let mut rx = self.outcome.clone();
        let wait = rx.wait_for(Option::is_some);
        match tokio::time::timeout(limit, wait).await {
            Ok(Ok(v)) => v.clone(),
            _ => self.outcome(),
        }
    }
}

#[derive(Default)]
pub struct Jobs {
    map: Mutex<HashMap<String, Arc<Job>>>,
    next: AtomicU64,
    /// Where every run leaves its line (`ironcell audit`).
    audit: Option<Arc<AuditLog>>,
}

impl Jobs {
    pub fn with_audit(audit: Arc<AuditLog>) -> Jobs {
        Jobs {
            audit: Some(audit),
            ..Jobs::default()
        }
    }

    /// Starts `req` in its own task and registers it as a job. `hold` (a principal's run slot,
    /// under `serve --http`) is kept until the run ends.
    pub fn start(
        &self,
        sessions: Arc<SessionManager>,
        mut req: RunRequest,
        hold: Option<tokio::sync::OwnedSemaphorePermit>,
    ) -> Arc<Job> {
        self.expire();
        let id = format!("job-{}", self.next.fetch_add(1, Ordering::Relaxed) + 1);
        let (progress_tx, progress_rx) = watch::channel(Progress::default());
        let (outcome_tx, outcome_rx) = watch::channel(None);
        req.progress = Some(progress_tx);
        let cancel = sessions.stop_token();
        let finished_at = Arc::new(Mutex::new(None));
        let job = Arc::new(Job {
            id: id.clone(),
            session: req.session.clone(),
            started: Instant::now(),
            created_at: chrono::Utc::now(),
            cancel: cancel.clone(),
            progress: progress_rx,
            detached: std::sync::atomic::AtomicBool::new(false),
            outcome: outcome_rx,
            finished_at: finished_at.clone(),
        });
        lock(&self.map).insert(id, job.clone());
        let audit = self
            .audit
            .clone()
            .map(|log| (log, req.session.clone(), req.code.clone()));
        tokio::spawn(async move {
            let result = sessions.run(req, cancel).await;
            drop(hold);
            if let Some((log, session, code)) = audit {
                let entry = AuditEntry::new(&session, &code, &result);
                log.append(&entry);
            }
            *lock(&finished_at) = Some(Instant::now());
            outcome_tx.send_replace(Some(Arc::new(result)));
        });
        job
    }

    pub fn get(&self, id: &str) -> Option<Arc<Job>> {
        self.expire();
        lock(&self.map).get(id).cloned()
    }

    pub fn remove(&self, id: &str) {
        lock(&self.map).remove(id);
    }

    /// The background job still running in `session`, if any. (A run some call is still
    /// waiting for, or one being cancelled, does not count: a new call just queues behind it.)
    pub fn running_in(&self, session: &str) -> Option<String> {
        lock(&self.map)
            .values()
            .find(|j| {
                j.session == session
                    && j.detached.load(Ordering::SeqCst)
                    && !j.cancel.is_cancelled()
                    && j.outcome().is_none()
            })
            .map(|j| j.id.clone())
    }

    /// Ids of all known jobs (for error messages).
    pub fn ids(&self) -> Vec<String> {
        let mut ids: Vec<String> = lock(&self.map).keys().cloned().collect();
        ids.sort();
        ids
    }

    fn expire(&self) {
        lock(&self.map)
            .retain(|_, j| lock(&j.finished_at).is_none_or(|t| t.elapsed() < FINISHED_JOB_TTL));
    }
}
