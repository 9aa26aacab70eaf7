//! One cell's run: feeding the code to the worker and collecting what comes back until it is
//! done, dead or killed, then linking the outputs it left.

use super::quota::removal_outcome;
use super::*;

impl SessionManager {
    /// [`Self::drive_cell_inner`], with the proxied calls the cell made added to its record.
    pub(super) async fn drive_cell(
        &self,
        session: &Session,
        state: &mut SessionState,
        cell: Cell<'_>,
    ) -> CellOutcome {
        let mut calls = Vec::new();
        let mut outcome = self
            .drive_cell_inner(session, state, cell, &mut calls)
            .await;
        outcome.record.upstream_calls = calls;
        outcome
    }

    /// Feeds one cell to the session's worker and collects everything until it is done, dead,
    /// or killed.
    pub(super) async fn drive_cell_inner(
        &self,
        session: &Session,
        state: &mut SessionState,
        cell: Cell<'_>,
        calls: &mut Vec<CallSummary>,
    ) -> CellOutcome {
        let Cell {
            run_no,
            code,
            timeout,
            cancel,
            progress,
        } = cell;
        let s = &self.settings;
        let (p, d) = spill_location(&session.scratch, run_no, "stdout");
        let mut stdout = StreamCollector::new(s.inline_output_bytes, s.max_output_bytes, p, d);
        let (p, d) = spill_location(&session.scratch, run_no, "stderr");
        let mut stderr = StreamCollector::new(s.inline_output_bytes, s.max_output_bytes, p, d);
        let Some(worker) = state.worker.as_mut() else {
            return CellOutcome::lost(stdout, stderr, RunStatus::Crashed, "no worker".into(), None);
        };

        let run = ToWorker::Run {
            id: run_no,
            code: code.to_string(),
        };
        match frame::json_body(&run).map(|body| worker.send(body)) {
            Ok(Ok(())) | Ok(Err(SendError::Gone)) => {} // a gone worker shows as the socket's end
            Ok(Err(SendError::NotReading)) => {
                if let Some(w) = state.worker.take() {
                    w.kill().await;
                }
                let why = "the worker stopped reading its session socket and was killed";
                return CellOutcome::lost(
                    stdout,
                    stderr,
                    RunStatus::Crashed,
                    why.into(),
                    Some(why.into()),
                );
            }
            Err(e) => {
                let why = format!("the cell could not be encoded: {e}");
                return CellOutcome::lost(stdout, stderr, RunStatus::Crashed, why, None);
            }
        }

        let deadline = tokio::time::Instant::now() + timeout;
        let mut stopping: Option<(RunStatus, tokio::time::Instant)> = None;
        // Summaries of the proxied calls this cell made; their answers go straight to the
        // worker's writer, so the loop below never waits on the worker's socket.
        let (summaries_tx, mut summaries_rx) =
            tokio::sync::mpsc::unbounded_channel::<CallSummary>();
        // The quota is measured in the background; its verdict wakes this loop.
        let mut quota_verdict_rx = session.over_quota.subscribe();
        quota_verdict_rx.mark_changed();
        let cell_started = tokio::time::Instant::now();
        let mut progress_tick =
            tokio::time::interval_at(cell_started + PROGRESS_EVERY, PROGRESS_EVERY);
        while let Some(worker) = state.worker.as_mut() {
            let wake_at = stopping.map(|(_, kill_at)| kill_at).unwrap_or(deadline);
            let event = tokio::select! {
                next = worker.frames.next() => CellEvent::Frame(next),
                _ = tokio::time::sleep_until(wake_at) => CellEvent::Wake,
                Some(call) = summaries_rx.recv() => CellEvent::Call(call),
                _ = progress_tick.tick(), if progress.is_some() => CellEvent::Progress,
                Ok(()) = quota_verdict_rx.changed() => CellEvent::QuotaCheck,
                _ = cancel.cancelled(), if stopping.is_none() => CellEvent::Cancel,
            };
            match event {
                CellEvent::Frame(Some(Ok(f))) => {
                    let message = match frame::decode_worker_frame(&f, worker.image_budget_bytes) {
                        Ok(WorkerFrame::Stdout(b)) => {
                            stdout.push(b);
                            None
                        }
                        Ok(WorkerFrame::Stderr(b)) => {
                            stderr.push(b);
                            None
                        }
                        Ok(WorkerFrame::Message(m)) => Some(m),
                        Err(v) => return end_for_violation(state, stdout, stderr, v).await,
                    };
                    match message {
                        None => {}
                        Some(FromWorker::Request { id, method, params }) => {
                            let Some(slot) = worker.request_slot() else {
                                let v = Violation(format!(
                                    "more than {} bridge requests open at once",
                                    frame::MAX_INFLIGHT_REQUESTS
                                ));
                                return end_for_violation(state, stdout, stderr, v).await;
                            };
                            // Proxied calls run concurrently; an answer may outlive this cell.
                            let proxy = self.proxy.clone();
                            let session_name = session.name.clone();
                            let memory = self.memory.clone();
                            let local_tools = self.local_tools.get().cloned();
                            let from = session.name.clone();
                            let summaries = summaries_tx.clone();
                            let answers = worker.answers();
                            tokio::spawn(async move {
                                use crate::proxy::BridgeMethod;
                                let (payload, summary) = match BridgeMethod::parse(&method) {
                                    // The host does the file I/O, off the async runtime.
                                    Ok(BridgeMethod::Memory(op)) => {
                                        let answer = tokio::task::spawn_blocking(move || {
                                            memory.handle(op, &params)
                                        })
                                        .await
                                        .unwrap_or_else(|e| {
                                            crate::proxy::error_payload(
                                                crate::proxy::ErrorKind::Unavailable,
                                                &e.to_string(),
                                            )
                                        });
                                        (answer, None)
                                    }
                                    Ok(BridgeMethod::Tools(op)) => {
                                        let answer = crate::local_tools::handle_request(
                                            local_tools,
                                            from,
                                            op,
                                            params,
                                        );
                                        (answer.await, None)
                                    }
                                    Ok(BridgeMethod::Proxy(m)) => {
                                        proxy.handle(&session_name, m, &params).await
                                    }
                                    Err(unknown) => (unknown, None),
                                };
                                if let Some(call) = summary {
                                    let _ = summaries.send(call);
                                }
                                match frame::json_body(&ToWorker::Response { id, payload }) {
                                    Ok(body) => {
                                        let _ = answers
                                            .send(Outgoing {
                                                body,
                                                _slot: Some(slot),
                                            })
                                            .await;
                                    }
                                    Err(e) => {
                                        tracing::warn!(error = %e, "encoding an answer failed")
                                    }
                                }
                            });
                        }
                        Some(FromWorker::Done { id, .. }) if id != run_no => {
                            let v = Violation(format!(
                                "a `done` frame for run {id} while run {run_no} is running"
                            ));
                            return end_for_violation(state, stdout, stderr, v).await;
                        }
                        Some(FromWorker::Done {
                            status,
                            result,
                            error,
                            exit_code,
                            images,
                            ..
                        }) => {
                            // Calls answered before `done` were summarized before their answer.
                            while let Ok(call) = summaries_rx.try_recv() {
                                calls.push(call);
                            }
                            let status = match (stopping, status) {
                                (Some((RunStatus::OutputLimit, _)), _) => RunStatus::OutputLimit,
                                (Some((reason, _)), CellStatus::Interrupted) => reason,
                                (_, CellStatus::Ok) => RunStatus::Ok,
                                (_, CellStatus::Error) | (_, CellStatus::Interrupted) => {
                                    RunStatus::Error
                                }
                                (_, CellStatus::Exit) => RunStatus::Exit,
                            };
                            let error = if matches!(
                                status,
                                RunStatus::Timeout | RunStatus::Cancelled | RunStatus::OutputLimit
                            ) {
                                None
                            } else {
                                error
                            };
                            let mut done = CellOutcome::finished(
                                stdout, stderr, status, result, error, exit_code,
                            );
                            // Only images that really are files in the session are linked.
                            done.images = images
                                .into_iter()
                                .filter(|img| is_regular_file_beneath(&session.scratch, &img.path))
                                .collect();
                            return done;
                        }
                        Some(other) => {
                            let what = match other {
                                FromWorker::Ready { .. } => "ready",
                                _ => "fatal",
                            };
                            let v = Violation(format!("a `{what}` message in the middle of a run"));
                            return end_for_violation(state, stdout, stderr, v).await;
                        }
                    }
                    if stopping.is_none() && stdout.total() + stderr.total() > s.max_output_bytes {
                        worker.signal(Signal::SIGINT);
                        stopping = Some((
                            RunStatus::OutputLimit,
                            tokio::time::Instant::now() + s.interrupt_grace,
                        ));
                    }
                }
                CellEvent::Frame(Some(Err(e))) if oversized_frame(&e).is_some() => {
                    let v = oversized_frame(&e).unwrap_or_else(|| Violation(e.to_string()));
                    return end_for_violation(state, stdout, stderr, v).await;
                }
                CellEvent::Frame(_) => {
                    // The worker is gone mid-cell.
                    let Some(w) = state.worker.take() else { break };
                    let exit = w.wait_exit().await;
                    let why = exit.map(|e| e.to_string()).unwrap_or_else(|| {
                        "ended (its exit status is unknown: the zygote that reports it is gone)"
                            .into()
                    });
                    let status = match stopping {
                        Some((reason, _)) => reason,
                        None => RunStatus::Crashed,
                    };
                    let reason = crash_reason(exit);
                    return CellOutcome::lost(
                        stdout,
                        stderr,
                        status,
                        format!("the worker process {why}{reason}"),
                        Some(why),
                    );
                }
                CellEvent::Wake => match stopping {
                    None => {
                        worker.signal(Signal::SIGINT);
                        stopping = Some((
                            RunStatus::Timeout,
                            tokio::time::Instant::now() + s.interrupt_grace,
                        ));
                    }
                    Some((reason, _)) => {
                        let Some(w) = state.worker.take() else { break };
                        w.kill().await;
                        let why = format!(
                            "did not stop within {:.1} s of an interrupt and was killed",
                            s.interrupt_grace.as_secs_f64()
                        );
                        return CellOutcome::lost(
                            stdout,
                            stderr,
                            reason,
                            format!("the worker {why}"),
                            Some(why),
                        );
                    }
                },
                CellEvent::Call(call) => calls.push(call),
                CellEvent::Progress => {
                    if let Some(p) = progress {
                        let recent = [stdout.recent_lines(5), stderr.recent_lines(3)]
                            .into_iter()
                            .filter(|t| !t.is_empty())
                            .collect::<Vec<_>>()
                            .join("\n[stderr] ");
                        p.send_replace(Progress {
                            elapsed_s: cell_started.elapsed().as_secs_f64(),
                            stdout_bytes: stdout.total(),
                            stderr_bytes: stderr.total(),
                            recent_output: recent,
                        });
                    }
                }
                CellEvent::QuotaCheck => {
                    let verdict = quota_verdict_rx.borrow_and_update().clone();
                    if let Some(over) = verdict {
                        let Some(w) = state.worker.take() else { break };
                        w.kill().await;
                        let removal = self.empty_scratch(session).await;
                        let why = format!("killed: {over}; {}", removal_outcome(&removal));
                        return CellOutcome::lost(
                            stdout,
                            stderr,
                            RunStatus::ScratchQuota,
                            why.clone(),
                            Some(why),
                        );
                    }
                }
                CellEvent::Cancel => {
                    worker.signal(Signal::SIGINT);
                    stopping = Some((
                        RunStatus::Cancelled,
                        tokio::time::Instant::now() + s.interrupt_grace,
                    ));
                }
            }
        }
        CellOutcome::lost(
            stdout,
            stderr,
            RunStatus::Crashed,
            "the worker vanished".into(),
            None,
        )
    }
}

/// What woke a running cell's loop.
pub(super) enum CellEvent {
    Frame(Option<std::io::Result<bytes::BytesMut>>),
    Wake,
    Call(CallSummary),
    Progress,
    QuotaCheck,
    Cancel,
}

/// A read error that is the worker's doing: a frame header claiming more than the cap.
pub(super) fn oversized_frame(e: &std::io::Error) -> Option<Violation> {
    (e.kind() == std::io::ErrorKind::InvalidData)
        .then(|| Violation(format!("a frame the host cannot accept ({e})")))
}

/// Kills a worker that broke the session protocol and reports it as this run's outcome.
pub(super) async fn end_for_violation(
    state: &mut SessionState,
    stdout: StreamCollector,
    stderr: StreamCollector,
    v: Violation,
) -> CellOutcome {
    tracing::warn!(error = %v, "killing a worker that broke the session protocol");
    let exit = match state.worker.take() {
        Some(w) => w.kill().await,
        None => None,
    };
    let how = exit.map(|e| format!(" ({e})")).unwrap_or_default();
    let mut outcome = CellOutcome::lost(
        stdout,
        stderr,
        RunStatus::Crashed,
        format!("{v}; the worker was killed{how}"),
        Some(format!("{v}; it was killed")),
    );
    if let Some(e) = outcome.record.error.as_mut() {
        e.kind = "ProtocolViolation".into();
    }
    outcome
}

/// Whether `rel` names a regular file beneath the session directory `root`, reached without
/// following any symlink (an image path the worker named is linked only then).
pub(super) fn is_regular_file_beneath(root: &Path, rel: &str) -> bool {
    use nix::fcntl::OFlag;
    let Ok(dir) = host_fs::open_session_dir(root) else {
        return false;
    };
    host_fs::open_beneath(
        dir.as_fd(),
        Path::new(rel),
        OFlag::O_PATH | OFlag::O_CLOEXEC,
        nix::sys::stat::Mode::empty(),
    )
    .and_then(|f| nix::sys::stat::fstat(&f).map_err(std::io::Error::from))
    .is_ok_and(|st| host_fs::is_regular(&st))
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
}

pub(super) struct CellOutcome {
    pub(super) record: RunRecord,
    pub(super) images: Vec<crate::frame::CellImage>,
    pub(super) worker_lost: bool,
    pub(super) loss_reason: Option<String>,
}

impl CellOutcome {
    pub(super) fn base(
        stdout: StreamCollector,
        stderr: StreamCollector,
        status: RunStatus,
    ) -> RunRecord {
        let (out, out_cut) = stdout.finish();
        let (err, err_cut) = stderr.finish();
        RunRecord {
            session: String::new(),
            status,
            stdout: out,
            stderr: err,
            result: None,
            error: None,
            exit_code: None,
            duration_ms: 0.0,
            session_state: crate::output::SessionState::Kept,
            notices: Vec::new(),
            stdout_truncated: out_cut,
            stderr_truncated: err_cut,
            upstream_calls: Vec::new(),
            images: Vec::new(),
            files: Vec::new(),
            inline_images: Vec::new(),
        }
    }

    pub(super) fn finished(
        stdout: StreamCollector,
        stderr: StreamCollector,
        status: RunStatus,
        result: Option<String>,
        error: Option<PyErrorInfo>,
        exit_code: Option<i64>,
    ) -> CellOutcome {
        let mut record = Self::base(stdout, stderr, status);
        record.result = result;
        record.error = error;
        record.exit_code = exit_code;
        CellOutcome {
            record,
            images: Vec::new(),
            worker_lost: false,
            loss_reason: None,
        }
    }

    pub(super) fn lost(
        stdout: StreamCollector,
        stderr: StreamCollector,
        status: RunStatus,
        message: String,
        reason: Option<String>,
    ) -> CellOutcome {
        let mut record = Self::base(stdout, stderr, status);
        if status == RunStatus::Crashed {
            record.error = Some(PyErrorInfo {
                kind: "WorkerCrashed".into(),
                message,
                traceback: String::new(),
            });
        } else {
            record.notices.push(message);
        }
        CellOutcome {
            record,
            images: Vec::new(),
            worker_lost: true,
            loss_reason: reason,
        }
    }
}

/// Adds resource URIs for the spilled output, the run's images (inline copies kept aside for
/// image content) and the files it created or changed.
pub(super) async fn link_outputs(
    record: &mut RunRecord,
    session: &Session,
    changes: &Arc<crate::files::ChangeTracker>,
    images: Vec<crate::frame::CellImage>,
    since: std::time::SystemTime,
) {
    use crate::files::session_uri;
    for cut in [
        record.stdout_truncated.as_mut(),
        record.stderr_truncated.as_mut(),
    ]
    .into_iter()
    .flatten()
    {
        cut.uri = cut.file.as_deref().map(|f| session_uri(&session.name, f));
    }
    for img in images {
        let inline = img.data.is_some();
        if let Some(data) = img.data {
            record.inline_images.push((data, img.mime.clone()));
        }
        record.images.push(crate::output::ImageRef {
            uri: session_uri(&session.name, &img.path),
            path: img.path,
            mime: img.mime,
            bytes: img.bytes,
            width: img.width,
            height: img.height,
            inline,
        });
    }
    let shown: std::collections::HashSet<String> =
        record.images.iter().map(|i| i.path.clone()).collect();
    let (dir, name, changes) = (
        session.scratch.clone(),
        session.name.clone(),
        changes.clone(),
    );
    let listed = tokio::task::spawn_blocking(move || changes.changed(&name, &dir, since, 50))
        .await
        .unwrap_or_else(|e| crate::files::Changes {
            files: Vec::new(),
            incomplete: Some(format!("the listing failed: {e}")),
            method: "none",
        });
    tracing::debug!(session = %session.name, method = listed.method, "listed the run's files");
    let (files, incomplete) = (listed.files, listed.incomplete);
    if let Some(why) = incomplete {
        record.notices.push(format!(
            "the list of changed files may be incomplete: {why}"
        ));
    }
    record.files = files
        .into_iter()
        .filter(|f| !shown.contains(&f.path))
        .collect();
}
