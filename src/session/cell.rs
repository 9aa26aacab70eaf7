//! One cell's run: feeding the code to the worker and collecting what comes back until it is
//! done, dead or killed, then linking the outputs it left.
//!
//! The run is a small state machine, [`CellRun`]. Its loop waits for the next [`CellEvent`]
//! and hands it to one method per event; each method says whether the cell goes on
//! ([`ControlFlow::Continue`]) or how it ended ([`ControlFlow::Break`] with an [`Ending`]).
//! A cell's life, as [`Phase`] and [`Ending`] spell it:
//!
//! ```text
//!   Running ──timeout / cancel / output cap: SIGINT──▶ Interrupted ──grace over: SIGKILL──▶ killed
//!      │                                                   │
//!      └──────── `done` frame ──▶ done ◀──── `done` frame ──┘
//!   (from either phase: the worker's death, a protocol violation or the quota ends it too)
//! ```
//!
//! Threat note: the worker is the attacker. Every frame it sends is hostile input, decoded
//! under caps; the loop never blocks on the worker and never awaits a write to it (the code
//! and the bridge answers are queued for a writer task; a worker that stops reading is
//! killed, not waited for).

use std::ops::ControlFlow;

use ironcell_core::bridge::{BridgeError, Request, answer_payload};

use super::outcome::{CellOutcome, is_regular_file_beneath};
use super::quota::removal_outcome;
use super::*;
use crate::router::{Answer, Caller, Requests};

/// The least an output frame counts toward the output limit, in bytes (the worker's pump sends
/// what the pipe holds, so a program's frames are this small only while it prints slowly).
const OUTPUT_FRAME_CHARGE: u64 = 64;

impl SessionManager {
    /// Feeds one cell to the session's worker and collects everything until it is done, dead,
    /// or killed; the proxied calls the cell made are added to its record.
    pub(super) async fn drive_cell(
        &self,
        session: &Session,
        state: &mut SessionState,
        cell: Cell<'_>,
    ) -> CellOutcome {
        let Cell {
            run_no,
            code,
            timeout,
            cancel,
            progress,
            disk_stops_seen,
        } = cell;
        let mut run = CellRun::new(self, session, run_no, timeout, cancel, progress);
        // A stop since the run began skipped this session (the run held it): act on it here.
        if run.disk_stops.borrow().0 != disk_stops_seen {
            run.disk_stops.mark_changed();
        }
        let ending = match run.send_code(state, code).await {
            ControlFlow::Continue(()) => run.run_to_end(state).await,
            ControlFlow::Break(ending) => ending,
        };
        run.children_killed(state).await;
        run.into_outcome(ending)
    }
}

/// Where a cell that has not ended yet stands. The ends themselves (done, or lost: killed,
/// dead, broke the protocol) are [`Ending`]s.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Phase {
    /// The code runs; at `deadline` it is interrupted for [`RunStatus::Timeout`].
    Running { deadline: tokio::time::Instant },
    /// SIGINT was sent for `reason` (timeout, cancellation, output cap). The worker has until
    /// `kill_at` to answer `done`; then it is killed. Further reasons to stop change nothing:
    /// the first one is the cell's status.
    Interrupted {
        reason: RunStatus,
        kill_at: tokio::time::Instant,
    },
}

/// What the timer asks of the loop when it fires.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum WakeAction {
    /// The deadline passed: send SIGINT (the phase is now [`Phase::Interrupted`]).
    Interrupt,
    /// The grace after the interrupt is over: kill the worker; the cell ends with `reason`.
    Kill { reason: RunStatus },
}

impl Phase {
    /// When the loop must wake on its own: the deadline, or the end of the grace.
    pub(super) fn wake_at(self) -> tokio::time::Instant {
        match self {
            Phase::Running { deadline } => deadline,
            Phase::Interrupted { kill_at, .. } => kill_at,
        }
    }

    pub(super) fn is_running(self) -> bool {
        matches!(self, Phase::Running { .. })
    }

    /// Asks a running cell to stop for `reason`, giving it `grace` from `now`. Returns whether
    /// the caller must send SIGINT (false if the cell was interrupted already).
    pub(super) fn interrupt(
        &mut self,
        reason: RunStatus,
        now: tokio::time::Instant,
        grace: Duration,
    ) -> bool {
        if !self.is_running() {
            return false;
        }
        *self = Phase::Interrupted {
            reason,
            kill_at: now + grace,
        };
        true
    }

    /// The timer fired at `now`.
    pub(super) fn on_wake(&mut self, now: tokio::time::Instant, grace: Duration) -> WakeAction {
        match *self {
            Phase::Running { .. } => {
                self.interrupt(RunStatus::Timeout, now, grace);
                WakeAction::Interrupt
            }
            Phase::Interrupted { reason, .. } => WakeAction::Kill { reason },
        }
    }

    /// The run's status when the worker answered `done` with `reported`: an interrupted
    /// cell keeps the reason it was interrupted for (the output cap even if the code caught
    /// the interrupt); otherwise the worker's own verdict.
    pub(super) fn status_when_done(self, reported: CellStatus) -> RunStatus {
        match (self, reported) {
            (
                Phase::Interrupted {
                    reason: RunStatus::OutputLimit,
                    ..
                },
                _,
            ) => RunStatus::OutputLimit,
            (Phase::Interrupted { reason, .. }, CellStatus::Interrupted) => reason,
            (_, CellStatus::Ok) => RunStatus::Ok,
            (_, CellStatus::Error) | (_, CellStatus::Interrupted) => RunStatus::Error,
            (_, CellStatus::Exit) => RunStatus::Exit,
        }
    }

    /// The run's status when the worker died: the reason it was being stopped for, if any.
    pub(super) fn status_when_lost(self) -> RunStatus {
        match self {
            Phase::Running { .. } => RunStatus::Crashed,
            Phase::Interrupted { reason, .. } => reason,
        }
    }
}

/// Whether a run that ended with `status` reports the worker's Python error (the
/// `KeyboardInterrupt` of a cell the host interrupted is not the user's error).
pub(super) fn keeps_python_error(status: RunStatus) -> bool {
    !matches!(
        status,
        RunStatus::Timeout | RunStatus::Cancelled | RunStatus::OutputLimit
    )
}

/// What woke a running cell's loop.
pub(super) enum CellEvent {
    /// The worker's socket yielded a frame, a read error (an oversized frame is
    /// `InvalidData`), or its end (`None`: the worker is gone).
    Frame(Option<std::io::Result<bytes::BytesMut>>),
    /// [`Phase::wake_at`] passed: the deadline, or the end of the interrupt's grace.
    Wake,
    /// Time to report progress to whoever listens.
    Progress,
    /// The background quota measurement published a verdict.
    QuotaCheck,
    /// The free-disk guard stopped the workers (see [`SessionManager::guard_free_disk`]).
    DiskStop,
    /// The client cancelled the call (only listened for while [`Phase::Running`]).
    Cancel,
}

/// How a cell ended.
pub(super) enum Ending {
    /// The worker answered `done`; it lives on with the session's state.
    Done {
        status: RunStatus,
        result: Option<String>,
        error: Option<PyErrorInfo>,
        exit_code: Option<i64>,
        images: Vec<crate::frame::CellImage>,
    },
    /// The worker is gone: it died, or the host killed it. `message` goes to the record (as
    /// the error of a crash, else as a notice); `reason` is told in the session's next run.
    Lost {
        status: RunStatus,
        message: String,
        reason: Option<String>,
    },
    /// The worker broke the session protocol and was killed.
    Violation { message: String, reason: String },
}

/// Everything one running cell's loop reads and changes.
pub(super) struct CellRun<'a> {
    manager: &'a SessionManager,
    session: &'a Session,
    run_no: u64,
    phase: Phase,
    stdout: StreamCollector,
    stderr: StreamCollector,
    /// Output frames so far: each counts [`OUTPUT_FRAME_CHARGE`] bytes at least toward the
    /// output limit, so a stream of empty or one-byte frames cannot keep the host busy for the
    /// whole run.
    output_frames: u64,
    /// Where the tasks answering proxied calls send their summaries, read when the cell ends
    /// (not as they come: waking this loop for each would cost every proxied call a task
    /// wake-up on the host). The answers themselves go straight to the worker's writer, so the
    /// loop never waits on the worker's socket.
    /// Bounded: a run's calls past [`crate::proxy::MAX_CALL_SUMMARIES`] are only counted, so a
    /// cell making millions of calls cannot grow the host's memory, its answer or the audit log.
    summaries_tx: tokio::sync::mpsc::Sender<CallSummary>,
    summaries_rx: tokio::sync::mpsc::Receiver<CallSummary>,
    summaries_omitted: Arc<AtomicU64>,
    /// Proxied calls that failed their look-up: counted, not listed.
    lookups_failed: Arc<AtomicU64>,
    /// The quota is measured in the background; its verdict wakes the loop.
    quota_verdict: tokio::sync::watch::Receiver<Option<String>>,
    disk_stops: tokio::sync::watch::Receiver<(u64, String)>,
    cancel: CancellationToken,
    progress: Option<&'a tokio::sync::watch::Sender<Progress>>,
    progress_tick: tokio::time::Interval,
    started: tokio::time::Instant,
    /// The kills of this run's children (a timeout, a cancel, the output cap) under way: the
    /// run ends only once they are done ([`CellRun::children_killed`]).
    killing_children: Vec<tokio::task::JoinHandle<()>>,
}

impl<'a> CellRun<'a> {
    fn new(
        manager: &'a SessionManager,
        session: &'a Session,
        run_no: u64,
        timeout: Duration,
        cancel: CancellationToken,
        progress: Option<&'a tokio::sync::watch::Sender<Progress>>,
    ) -> CellRun<'a> {
        let s = &manager.settings;
        let (p, d) = spill_location(&session.scratch, run_no, "stdout");
        let stdout = StreamCollector::new(s.inline_output_bytes, s.max_output_bytes, p, d);
        let (p, d) = spill_location(&session.scratch, run_no, "stderr");
        let stderr = StreamCollector::new(s.inline_output_bytes, s.max_output_bytes, p, d);
        let (summaries_tx, summaries_rx) =
            tokio::sync::mpsc::channel(crate::proxy::MAX_CALL_SUMMARIES);
        let mut quota_verdict = session.over_quota.subscribe();
        // A verdict published before the cell started is acted on at once.
        quota_verdict.mark_changed();
        // Stops before this cell began are not its business (its worker is newer, or survived).
        let disk_stops = manager.disk_guard.stops.subscribe();
        let started = tokio::time::Instant::now();
        CellRun {
            manager,
            session,
            run_no,
            phase: Phase::Running {
                deadline: started + timeout,
            },
            stdout,
            stderr,
            output_frames: 0,
            summaries_tx,
            summaries_rx,
            summaries_omitted: Arc::new(AtomicU64::new(0)),
            lookups_failed: Arc::new(AtomicU64::new(0)),
            quota_verdict,
            disk_stops,
            cancel,
            progress,
            progress_tick: tokio::time::interval_at(started + PROGRESS_EVERY, PROGRESS_EVERY),
            started,
            killing_children: Vec::new(),
        }
    }

    /// Once the cell ended: waits for the kills of its children under way, then kills once
    /// more what the cell made meanwhile (it ran until it took the interrupt), so a kill still
    /// running never reaches the next run's children, nor does a child of this one outlive it.
    async fn children_killed(&mut self, state: &SessionState) {
        if self.killing_children.is_empty() {
            return;
        }
        for kill in self.killing_children.drain(..) {
            let _ = kill.await;
        }
        if let Some(w) = state.worker.as_ref()
            && let Some(last) = self.manager.kill_children_of(w.pid())
        {
            let _ = last.await;
        }
    }

    fn grace(&self) -> Duration {
        self.manager.settings.interrupt_grace
    }

    /// Queues the code for the worker, without waiting for it to read.
    async fn send_code(&mut self, state: &mut SessionState, code: &str) -> ControlFlow<Ending> {
        let Some(worker) = state.worker.as_mut() else {
            return ControlFlow::Break(Ending::Lost {
                status: RunStatus::Crashed,
                message: "no worker".into(),
                reason: None,
            });
        };
        if worker.is_forked() {
            resident::fit_fork_memory_before_cell(worker.pid(), &self.manager.sandbox).await;
        }
        let run = ToWorker::Run {
            id: self.run_no,
            code: code.to_string(),
            bind: worker.bind.take(),
        };
        match frame::json_body(&run).map(|body| worker.send(body)) {
            // A gone worker shows as the socket's end, in the loop.
            Ok(Ok(())) | Ok(Err(SendError::Gone)) => ControlFlow::Continue(()),
            Ok(Err(SendError::NotReading)) => {
                kill_worker(state).await;
                let why = "the worker stopped reading its session socket and was killed";
                ControlFlow::Break(Ending::Lost {
                    status: RunStatus::Crashed,
                    message: why.into(),
                    reason: Some(why.into()),
                })
            }
            Err(e) => ControlFlow::Break(Ending::Lost {
                status: RunStatus::Crashed,
                message: format!("the cell could not be encoded: {e}"),
                reason: None,
            }),
        }
    }

    /// The loop: wait for the next event, dispatch it, until the cell ends.
    async fn run_to_end(&mut self, state: &mut SessionState) -> Ending {
        loop {
            let Some(worker) = state.worker.as_mut() else {
                return vanished();
            };
            let event = self.next_event(worker).await;
            let flow = match event {
                CellEvent::Frame(Some(Ok(f))) => self.on_frame(state, f).await,
                CellEvent::Frame(Some(Err(e))) => match oversized_frame(&e) {
                    Some(v) => ControlFlow::Break(end_for_violation(state, v).await),
                    None => ControlFlow::Break(self.on_worker_gone(state).await),
                },
                CellEvent::Frame(None) => ControlFlow::Break(self.on_worker_gone(state).await),
                CellEvent::Wake => self.on_wake(state).await,
                CellEvent::Progress => self.on_progress(),
                CellEvent::QuotaCheck => self.on_quota_check(state).await,
                CellEvent::DiskStop => self.on_disk_stop(state).await,
                CellEvent::Cancel => self.on_cancel(state),
            };
            if let ControlFlow::Break(ending) = flow {
                return ending;
            }
        }
    }

    /// Waits for whatever happens first.
    async fn next_event(&mut self, worker: &mut LiveWorker) -> CellEvent {
        let listen_for_cancel = self.phase.is_running();
        tokio::select! {
            next = worker.frames.next() => CellEvent::Frame(next),
            _ = tokio::time::sleep_until(self.phase.wake_at()) => CellEvent::Wake,
            _ = self.progress_tick.tick(), if self.progress.is_some() => CellEvent::Progress,
            Ok(()) = self.quota_verdict.changed() => CellEvent::QuotaCheck,
            Ok(()) = self.disk_stops.changed() => CellEvent::DiskStop,
            _ = self.cancel.cancelled(), if listen_for_cancel => CellEvent::Cancel,
        }
    }

    /// A frame from the worker (hostile: decoded under the caps, any breach ends the cell).
    ///
    /// Long on purpose: one arm per kind of frame, then the output cap, which every output frame
    /// is checked against.
    async fn on_frame(
        &mut self,
        state: &mut SessionState,
        f: bytes::BytesMut,
    ) -> ControlFlow<Ending> {
        let Some(worker) = state.worker.as_ref() else {
            return ControlFlow::Break(vanished());
        };
        let message = match frame::decode_worker_frame(&f, worker.image_budget_bytes) {
            Ok(WorkerFrame::Stdout(b)) => {
                self.stdout.push(b);
                self.output_frames += 1;
                None
            }
            Ok(WorkerFrame::Stderr(b)) => {
                self.stderr.push(b);
                self.output_frames += 1;
                None
            }
            Ok(WorkerFrame::Message(m)) => Some(m),
            Err(v) => return ControlFlow::Break(end_for_violation(state, v).await),
        };
        match message {
            None => {}
            Some(FromWorker::Request { id, method, params }) => {
                if let Err(v) = self.start_request(worker, id, method, params) {
                    return ControlFlow::Break(end_for_violation(state, v).await);
                }
            }
            Some(FromWorker::Done { id, .. }) if id != self.run_no => {
                let v = Violation(format!(
                    "a `done` frame for run {id} while run {} is running",
                    self.run_no
                ));
                return ControlFlow::Break(end_for_violation(state, v).await);
            }
            Some(FromWorker::Done {
                status,
                result,
                error,
                exit_code,
                images,
                ..
            }) => {
                let status = self.phase.status_when_done(status);
                let error = error.filter(|_| keeps_python_error(status));
                // Only images that really are files in the session are linked.
                let images = images
                    .into_iter()
                    .filter(|img| is_regular_file_beneath(&self.session.scratch, &img.path))
                    .collect();
                return ControlFlow::Break(Ending::Done {
                    status,
                    result,
                    error,
                    exit_code,
                    images,
                });
            }
            Some(other) => {
                let what = match other {
                    FromWorker::Ready { .. } => "ready",
                    FromWorker::Forked { .. } => "forked",
                    _ => "fatal",
                };
                let v = Violation(format!("a `{what}` message in the middle of a run"));
                return ControlFlow::Break(end_for_violation(state, v).await);
            }
        }
        let total = (self.stdout.total() + self.stderr.total())
            .max(self.output_frames.saturating_mul(OUTPUT_FRAME_CHARGE));
        if total > self.manager.settings.max_output_bytes
            && self.phase.interrupt(
                RunStatus::OutputLimit,
                tokio::time::Instant::now(),
                self.grace(),
            )
        {
            worker.signal(Signal::SIGINT);
            self.killing_children
                .extend(self.manager.kill_children_of(worker.pid()));
        }
        ControlFlow::Continue(())
    }

    /// A bridge request: parsed here, once, and handed to the router; answered by a task of
    /// its own (it may outlive this cell), within the worker's cap on open requests.
    ///
    /// Long on purpose: the answers given before the router (over the cap on open requests, over
    /// their room for values, a request that does not parse, one the router answers at once),
    /// each in its own words and in the order checked, then the caller and the answer's task.
    fn start_request(
        &self,
        worker: &LiveWorker,
        id: u64,
        method: String,
        params: serde_json::Value,
    ) -> Result<(), Violation> {
        let Some(slot) = worker.request_slot() else {
            return Err(Violation(format!(
                "more than {} bridge requests open at once",
                frame::MAX_INFLIGHT_REQUESTS
            )));
        };
        let values = json_value_count(&params);
        let Some(room) = worker.request_values(values) else {
            // An answer, not a violation: a program may send large requests in parallel.
            let message = format!(
                "this request carries {values} JSON values (a string counts one per 32 bytes, an object's entry two), \
                 more than its worker's open bridge requests may hold together ({}): send less \
                 at once (a large input can go through a file in the session directory)",
                frame::MAX_OPEN_REQUEST_VALUES
            );
            drop(params);
            answer_now(
                worker,
                id,
                BridgeError::bad_request(message).payload(),
                slot,
            );
            return Ok(());
        };
        let request = match Request::parse(&method, params) {
            Ok(request) => request,
            Err(e) => {
                answer_now(worker, id, e.payload(), slot);
                return Ok(());
            }
        };
        let router = self.manager.router.clone();
        if let Some(answer) = router.answer_now(&self.session.name, &request) {
            answer_now(worker, id, answer_payload(answer), slot);
            return Ok(());
        }
        let caller = Caller {
            session: self.session.name.clone(),
            sink: crate::proxy::CallSink {
                run: self.run_no,
                summaries: self.summaries_tx.clone(),
                lookups_failed: self.lookups_failed.clone(),
                omitted: self.summaries_omitted.clone(),
            },
            gone: worker.gone(),
            tools_turn: worker.tools_turn(),
            blocking_turn: worker.blocking_turn(),
            room: Box::new(room),
            packages_view: worker.packages_view.clone(),
            scratch: self.session.scratch.clone(),
            fork_layers: worker.forks_area.as_ref().map(|_| worker.landlock_layers),
        };
        let answers = worker.answers();
        let answered = router.answer(caller, request);
        tokio::spawn(async move {
            let Some(Answer { result, turn }) = answered.await else {
                return;
            };
            let payload = answer_payload(result);
            match frame::json_body(&ToWorker::Response { id, payload }) {
                Ok(body) => {
                    // The writer task's queue, not the socket: this never waits on the worker
                    // reading (a full queue waits here, in this task, not in the cell's loop).
                    let _ = answers
                        .send(Outgoing {
                            body,
                            _slot: Some(slot),
                            _turn: turn,
                            pass_fds: Vec::new(),
                        })
                        .await;
                }
                Err(e) => tracing::warn!(error = %e, "encoding an answer failed"),
            }
        });
        Ok(())
    }

    /// The socket ended (or failed) mid-cell: the worker is gone.
    async fn on_worker_gone(&mut self, state: &mut SessionState) -> Ending {
        let Some(mut w) = state.worker.take() else {
            return vanished();
        };
        let pipes = w.output_pipes.take();
        let exit = w.wait_exit().await;
        // Only once reaped: what it wrote last and its pump never read.
        self.take_leftover(Vec::new(), pipes.as_ref().filter(|_| exit.is_some()));
        let why = exit.map(|e| e.to_string()).unwrap_or_else(|| {
            "ended (its exit status is unknown: the zygote that reports it is gone)".into()
        });
        Ending::Lost {
            status: self.phase.status_when_lost(),
            message: format!("the worker process {why}{}", crash_reason(exit)),
            reason: Some(why),
        }
    }

    /// After every frame read so far: `frames` (sent, not read yet), then what is left in the
    /// dead worker's pipes, within the output limit (SECURITY.md #277).
    fn take_leftover(
        &mut self,
        frames: Vec<bytes::BytesMut>,
        pipes: Option<&leftover::OutputPipes>,
    ) {
        let total = (self.stdout.total() + self.stderr.total())
            .max(self.output_frames.saturating_mul(OUTPUT_FRAME_CHARGE));
        let room = self.manager.settings.max_output_bytes.saturating_sub(total);
        leftover::append(frames, pipes, [&mut self.stdout, &mut self.stderr], room);
    }

    /// Kills the worker (the grace after an interrupt is over), keeping what it had written.
    async fn kill_keeping_output(&mut self, state: &mut SessionState) -> Option<ExitInfo> {
        let mut w = state.worker.take()?;
        let pipes = w.output_pipes.take();
        let (exit, frames) = w.kill_then_unread_frames(2 * leftover::LEFTOVER_CAP).await;
        self.take_leftover(frames, pipes.as_ref().filter(|_| exit.is_some()));
        exit
    }

    /// The deadline passed (interrupt), or the grace after an interrupt did (kill).
    async fn on_wake(&mut self, state: &mut SessionState) -> ControlFlow<Ending> {
        let grace = self.grace();
        match self.phase.on_wake(tokio::time::Instant::now(), grace) {
            WakeAction::Interrupt => {
                let kill = interrupt_worker(self.manager, state);
                self.killing_children.extend(kill);
                ControlFlow::Continue(())
            }
            WakeAction::Kill { reason } => {
                self.kill_keeping_output(state).await;
                let why = format!(
                    "did not stop within {:.1} s of an interrupt and was killed",
                    grace.as_secs_f64()
                );
                ControlFlow::Break(Ending::Lost {
                    status: reason,
                    message: format!("the worker {why}"),
                    reason: Some(why),
                })
            }
        }
    }

    /// Publishes how far the cell got (elapsed time, bytes, newest lines).
    fn on_progress(&mut self) -> ControlFlow<Ending> {
        if let Some(p) = self.progress {
            let recent = [self.stdout.recent_lines(5), self.stderr.recent_lines(3)]
                .into_iter()
                .filter(|t| !t.is_empty())
                .collect::<Vec<_>>()
                .join("\n[stderr] ");
            p.send_replace(Progress {
                elapsed_s: self.started.elapsed().as_secs_f64(),
                stdout_bytes: self.stdout.total(),
                stderr_bytes: self.stderr.total(),
                recent_output: recent,
            });
        }
        ControlFlow::Continue(())
    }

    /// The quota verdict changed: a session over its quota loses its worker and its files.
    async fn on_quota_check(&mut self, state: &mut SessionState) -> ControlFlow<Ending> {
        let verdict = self.quota_verdict.borrow_and_update().clone();
        let Some(over) = verdict else {
            return ControlFlow::Continue(());
        };
        kill_worker(state).await;
        let removal = self.manager.empty_scratch(self.session).await;
        let why = format!("killed: {over}; {}", removal_outcome(&removal));
        ControlFlow::Break(Ending::Lost {
            status: RunStatus::ScratchQuota,
            message: why.clone(),
            reason: Some(why),
        })
    }

    /// The free-disk guard stopped every worker: this one goes too (its session's files stay),
    /// freeing whatever it held.
    async fn on_disk_stop(&mut self, state: &mut SessionState) -> ControlFlow<Ending> {
        let why = format!("killed: {}", self.disk_stops.borrow_and_update().1);
        kill_worker(state).await;
        ControlFlow::Break(Ending::Lost {
            status: RunStatus::ScratchQuota,
            message: why.clone(),
            reason: Some(why),
        })
    }

    /// The client cancelled: interrupt, as for a timeout.
    fn on_cancel(&mut self, state: &mut SessionState) -> ControlFlow<Ending> {
        let now = tokio::time::Instant::now();
        if self
            .phase
            .interrupt(RunStatus::Cancelled, now, self.grace())
        {
            let kill = interrupt_worker(self.manager, state);
            self.killing_children.extend(kill);
        }
        ControlFlow::Continue(())
    }

    /// The record of the ended cell.
    fn into_outcome(mut self, ending: Ending) -> CellOutcome {
        // The proxied calls answered so far, in the order they were answered (a call answered
        // before `done` sent its summary before its answer).
        // Closed first: a call that ends from now on is audited on a line of its own.
        self.summaries_rx.close();
        let mut calls = Vec::new();
        while let Ok(call) = self.summaries_rx.try_recv() {
            calls.push(call);
        }
        let mut outcome = match ending {
            Ending::Done {
                status,
                result,
                error,
                exit_code,
                images,
            } => {
                let mut done = CellOutcome::finished(
                    self.stdout,
                    self.stderr,
                    status,
                    result,
                    error,
                    exit_code,
                );
                done.images = images;
                done
            }
            Ending::Lost {
                status,
                message,
                reason,
            } => CellOutcome::lost(self.stdout, self.stderr, status, message, reason),
            Ending::Violation { message, reason } => {
                let mut lost = CellOutcome::lost(
                    self.stdout,
                    self.stderr,
                    RunStatus::Crashed,
                    message,
                    Some(reason),
                );
                if let Some(e) = lost.record.error.as_mut() {
                    e.kind = "ProtocolViolation".into();
                }
                lost
            }
        };
        outcome.record.upstream_calls = calls;
        outcome.record.upstream_calls_omitted = self.summaries_omitted.load(Ordering::Relaxed);
        outcome.record.upstream_lookups_failed = self.lookups_failed.load(Ordering::Relaxed);
        outcome
    }
}

/// The ending when the worker handle is missing where the loop expects one.
fn vanished() -> Ending {
    Ending::Lost {
        status: RunStatus::Crashed,
        message: "the worker vanished".into(),
        reason: None,
    }
}

/// Interrupts the run: SIGINT to the worker (KeyboardInterrupt in the cell), SIGKILL to its
/// children (a timed-out or cancelled run's processes end with it): returns that kill's task.
fn interrupt_worker(
    manager: &SessionManager,
    state: &SessionState,
) -> Option<tokio::task::JoinHandle<()>> {
    let w = state.worker.as_ref()?;
    w.signal(Signal::SIGINT);
    manager.kill_children_of(w.pid())
}

/// Kills the session's worker (if it still has one) and waits briefly for its reaping.
async fn kill_worker(state: &mut SessionState) -> Option<ExitInfo> {
    match state.worker.take() {
        Some(w) => w.kill().await,
        None => None,
    }
}

/// A read error that is the worker's doing: a frame header claiming more than the cap.
pub(super) fn oversized_frame(e: &std::io::Error) -> Option<Violation> {
    (e.kind() == std::io::ErrorKind::InvalidData)
        .then(|| Violation(format!("a frame the host cannot accept ({e})")))
}

/// Kills a worker that broke the session protocol; the violation is this run's ending.
async fn end_for_violation(state: &mut SessionState, v: Violation) -> Ending {
    tracing::warn!(error = %v, "killing a worker that broke the session protocol");
    let exit = kill_worker(state).await;
    let how = exit.map(|e| format!(" ({e})")).unwrap_or_default();
    Ending::Violation {
        message: format!("{v}; the worker was killed{how}"),
        reason: format!("{v}; it was killed"),
    }
}

pub(super) fn crash_reason(exit: Option<ExitInfo>) -> &'static str {
    match exit {
        Some(ExitInfo::Signal(s)) if s == libc::SIGSEGV || s == libc::SIGBUS => {
            " (a crash in native code, e.g. ctypes or a C extension)"
        }
        Some(ExitInfo::Signal(s)) if s == libc::SIGKILL => {
            " (killed: out of memory or by the supervisor)"
        }
        Some(ExitInfo::Signal(s)) if s == libc::SIGXCPU => " (CPU time limit)",
        Some(ExitInfo::Signal(s)) if s == libc::SIGSYS => {
            " (a forbidden system call: the sandbox's seccomp filter ended it)"
        }
        Some(ExitInfo::Code(_)) => " (os._exit() or a fatal interpreter error)",
        _ => "",
    }
}

/// One cell to run, with its limits and listeners.
pub(super) struct Cell<'a> {
    pub(super) run_no: u64,
    pub(super) code: &'a str,
    pub(super) timeout: Duration,
    pub(super) cancel: CancellationToken,
    pub(super) progress: Option<&'a tokio::sync::watch::Sender<Progress>>,
    /// The free-disk guard's stop count when the run began (before it took the session).
    pub(super) disk_stops_seen: u64,
}

/// Queues the answer to request `id` at once, without a task unless the worker stopped reading
/// (then a task waits for room, never the caller). `slot` is freed when the answer is written.
fn answer_now(
    worker: &LiveWorker,
    id: u64,
    payload: serde_json::Value,
    slot: tokio::sync::OwnedSemaphorePermit,
) {
    match frame::json_body(&ToWorker::Response { id, payload }) {
        Ok(body) => {
            let answers = worker.answers();
            let answer = Outgoing {
                body,
                _slot: Some(slot),
                _turn: None,
                pass_fds: Vec::new(),
            };
            if let Err(full_or_closed) = answers.try_send(answer) {
                let answer = full_or_closed.into_inner();
                tokio::spawn(async move {
                    let _ = answers.send(answer).await;
                });
            }
        }
        Err(e) => tracing::warn!(error = %e, "encoding an answer failed"),
    }
}

/// What the host holds for `v` parsed, in values of a few dozen bytes: one per value (itself
/// included), one more per 32 bytes of a string, and for an object's entry two plus one per 32
/// bytes of its key (the map's own node).
fn json_value_count(v: &serde_json::Value) -> usize {
    match v {
        serde_json::Value::Array(a) => 1 + a.iter().map(json_value_count).sum::<usize>(),
        serde_json::Value::Object(o) => {
            1 + o
                .iter()
                .map(|(k, v)| 2 + k.len() / 32 + json_value_count(v))
                .sum::<usize>()
        }
        serde_json::Value::String(s) => 1 + s.len() / 32,
        _ => 1,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::time::Instant;

    const GRACE: Duration = Duration::from_secs(2);

    fn running(now: Instant) -> Phase {
        Phase::Running {
            deadline: now + Duration::from_secs(10),
        }
    }

    #[test]
    fn a_cell_past_its_deadline_is_interrupted_then_killed_when_the_grace_is_over() {
        let t0 = Instant::now();
        let mut phase = running(t0);
        assert_eq!(phase.wake_at(), t0 + Duration::from_secs(10));

        let at_deadline = t0 + Duration::from_secs(10);
        assert_eq!(phase.on_wake(at_deadline, GRACE), WakeAction::Interrupt);
        assert_eq!(
            phase,
            Phase::Interrupted {
                reason: RunStatus::Timeout,
                kill_at: at_deadline + GRACE
            }
        );
        assert_eq!(phase.wake_at(), at_deadline + GRACE);
        assert!(!phase.is_running(), "a cancel is no longer listened for");

        assert_eq!(
            phase.on_wake(at_deadline + GRACE, GRACE),
            WakeAction::Kill {
                reason: RunStatus::Timeout
            }
        );
    }

    #[test]
    fn the_first_reason_to_stop_a_cell_is_its_status_and_its_grace_is_not_extended() {
        let t0 = Instant::now();
        let mut phase = running(t0);
        assert!(
            phase.interrupt(RunStatus::Cancelled, t0, GRACE),
            "SIGINT once"
        );
        let later = t0 + Duration::from_secs(1);
        assert!(
            !phase.interrupt(RunStatus::OutputLimit, later, GRACE),
            "not twice"
        );
        assert_eq!(phase.wake_at(), t0 + GRACE);
        assert_eq!(
            phase.on_wake(t0 + GRACE, GRACE),
            WakeAction::Kill {
                reason: RunStatus::Cancelled
            }
        );
        assert_eq!(phase.status_when_lost(), RunStatus::Cancelled);
    }

    #[test]
    fn a_running_cell_reports_the_workers_own_verdict() {
        let phase = running(Instant::now());
        assert_eq!(phase.status_when_done(CellStatus::Ok), RunStatus::Ok);
        assert_eq!(phase.status_when_done(CellStatus::Error), RunStatus::Error);
        assert_eq!(phase.status_when_done(CellStatus::Exit), RunStatus::Exit);
        // A KeyboardInterrupt the host did not send is the code's own error.
        assert_eq!(
            phase.status_when_done(CellStatus::Interrupted),
            RunStatus::Error
        );
        assert_eq!(phase.status_when_lost(), RunStatus::Crashed);
    }

    #[test]
    fn an_interrupted_cell_reports_why_it_was_interrupted() {
        let t0 = Instant::now();
        for reason in [RunStatus::Timeout, RunStatus::Cancelled] {
            let mut phase = running(t0);
            phase.interrupt(reason, t0, GRACE);
            assert_eq!(phase.status_when_done(CellStatus::Interrupted), reason);
            // Code that caught the interrupt and finished keeps its own verdict.
            assert_eq!(phase.status_when_done(CellStatus::Ok), RunStatus::Ok);
            assert_eq!(phase.status_when_lost(), reason);
        }
        // Output past the cap is reported as such whatever the code did next.
        let mut phase = running(t0);
        phase.interrupt(RunStatus::OutputLimit, t0, GRACE);
        for reported in [CellStatus::Ok, CellStatus::Error, CellStatus::Interrupted] {
            assert_eq!(phase.status_when_done(reported), RunStatus::OutputLimit);
        }
    }

    #[test]
    fn the_hosts_own_interrupt_is_not_reported_as_the_users_python_error() {
        for status in [
            RunStatus::Timeout,
            RunStatus::Cancelled,
            RunStatus::OutputLimit,
        ] {
            assert!(!keeps_python_error(status), "{status:?}");
        }
        for status in [RunStatus::Ok, RunStatus::Error, RunStatus::Exit] {
            assert!(keeps_python_error(status), "{status:?}");
        }
    }
}
