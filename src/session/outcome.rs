//! What an ended cell leaves: its record ([`CellOutcome`]), and the resource links of its
//! spilled output, images and changed files ([`link_outputs`]).

use super::*;

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
            lineage: Vec::new(),
            notices: Vec::new(),
            stdout_truncated: out_cut,
            stderr_truncated: err_cut,
            upstream_calls: Vec::new(),
            upstream_calls_omitted: 0,
            upstream_lookups_failed: 0,
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
    // Most runs change no file: the tracker knows that without a thread hop.
    let listed = match changes.unchanged(&name) {
        Some(listed) => listed,
        None => tokio::task::spawn_blocking(move || changes.changed(&name, &dir, since, 50))
            .await
            .unwrap_or_else(|e| crate::files::Changes {
                files: Vec::new(),
                incomplete: Some(format!("the listing failed: {e}")),
                method: "none",
            }),
    };
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
