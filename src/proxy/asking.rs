//! Whether a proxied call may run: the approval setting, the user's recent declines (a session
//! whose user keeps saying no is not asked again for a while), and the question itself, put to
//! the client of the run's session in its era ([`super::approval`]).

use std::time::Duration;

use ironcell_core::bridge::{BridgeError, ErrorKind};
use rmcp::model::ElicitResult;
use serde_json::Value;

use super::Proxy;
use super::approval::{self, APPROVAL_TIMEOUT, Asker, Decision, Question};
use super::rules::ApprovalMode;

/// How many declines in [`DECLINE_WINDOW`] stop a session's questions until the window passes.
const MAX_DECLINES: usize = 3;
const DECLINE_WINDOW: Duration = Duration::from_secs(60);
/// Most declined calls remembered per session (by digest), each refused without asking for
/// the rest of its run.
const MAX_REMEMBERED_DECLINES: usize = 256;
/// One session's recent declines.
#[derive(Default)]
pub(super) struct Declines {
    /// When the user last said no (newest last, at most [`MAX_DECLINES`]).
    times: std::collections::VecDeque<std::time::Instant>,
    /// (run, digest of server, tool and canonical arguments) of declined calls.
    calls: std::collections::VecDeque<(u64, String)>,
}

impl Proxy {
    /// Why `call` is refused without asking, if it is: the user declined this same call in
    /// this run, or declined [`MAX_DECLINES`] questions of the session within
    /// [`DECLINE_WINDOW`].
    pub(super) fn declined_before(&self, asked: &Asked<'_>, digest: &str) -> Option<String> {
        let declines = crate::lock(&self.declines);
        let d = declines.get(asked.session)?;
        if let Some(run) = asked.run
            && d.calls.iter().any(|(r, c)| *r == run && c == digest)
        {
            return Some(format!(
                "declined: the user already declined this same call of {}.{} in this run; ironcell does not ask again before the next run",
                asked.server, asked.tool
            ));
        }
        let recent: Vec<_> = d
            .times
            .iter()
            .filter(|t| t.elapsed() < DECLINE_WINDOW)
            .collect();
        if recent.len() >= MAX_DECLINES {
            let wait = recent.first().map_or(DECLINE_WINDOW, |t| {
                DECLINE_WINDOW.saturating_sub(t.elapsed())
            });
            return Some(format!(
                "declined: the user declined {MAX_DECLINES} questions of this session within {} s, so ironcell does not ask again for {} s (the call of {}.{} was not shown)",
                DECLINE_WINDOW.as_secs(),
                wait.as_secs().max(1),
                asked.server,
                asked.tool
            ));
        }
        None
    }

    pub(super) fn note_decline(&self, asked: &Asked<'_>, digest: String) {
        let mut declines = crate::lock(&self.declines);
        let d = declines.entry(asked.session.to_string()).or_default();
        d.times.push_back(std::time::Instant::now());
        while d.times.len() > MAX_DECLINES {
            d.times.pop_front();
        }
        if let Some(run) = asked.run {
            d.calls.push_back((run, digest));
            while d.calls.len() > MAX_REMEMBERED_DECLINES {
                d.calls.pop_front();
            }
        }
    }

    /// Asks the user whether the call may run, as the approval setting says. The question goes
    /// to the client of the run's session, in that client's era, one at a time per session.
    pub(super) async fn approve(
        &self,
        asked: &Asked<'_>,
        why: &str,
        source: &str,
    ) -> Result<(), BridgeError> {
        let (session, server, tool) = (asked.session, asked.server, asked.tool);
        let how_to_allow = format!(
            "To allow it without asking, set \"confirm\": false for server {server:?} in {source} (and do not list it under \"confirm\"), or start ironcell with --approval allow (IRONCELL_APPROVAL=allow)"
        );
        match self.approval {
            ApprovalMode::Allow => return Ok(()),
            ApprovalMode::Deny => {
                return Err(BridgeError::new(
                    ErrorKind::Refused,
                    format!(
                        "{server}.{tool} needs approval ({why}), and ironcell runs with --approval deny. {how_to_allow}"
                    ),
                ));
            }
            ApprovalMode::Ask => {}
        }
        let asker = crate::lock(&self.askers).get(session).cloned();
        let Some(asker) = asker else {
            return Err(BridgeError::new(
                ErrorKind::Refused,
                format!(
                    "{server}.{tool} needs your approval ({why}), but this MCP client cannot ask you (it does not support elicitation). {how_to_allow}"
                ),
            ));
        };
        let question =
            Question::for_call(server, tool, asked.args, asked.declared, why).map_err(|e| {
                BridgeError::new(
                    ErrorKind::Refused,
                    format!(
                        "{server}.{tool} needs your approval ({why}), and cannot be asked: {e}"
                    ),
                )
            })?;
        let digest = approval::call_digest(&format!("{server}\0{tool}"), Some(asked.args));
        let gate = crate::lock(&self.asking)
            .entry(session.to_string())
            .or_default()
            .clone();
        let _open = gate.lock().await;
        if let Some(why) = self.declined_before(asked, &digest) {
            return Err(BridgeError::new(ErrorKind::Declined, why));
        }
        let answer = self.put(session, asker, question).await;
        let declined = |how: &str| {
            self.note_decline(asked, digest.clone());
            Err(BridgeError::new(
                ErrorKind::Declined,
                format!("declined: the user {how} the call of {server}.{tool}"),
            ))
        };
        match answer.as_ref().map(Decision::of) {
            Ok(Decision::Approved) => Ok(()),
            Ok(Decision::NotApproved) => declined("did not approve"),
            Ok(Decision::Declined) => declined("declined"),
            Ok(Decision::Cancelled) => declined("cancelled"),
            Err(e) => Err(BridgeError::new(
                ErrorKind::Refused,
                format!(
                    "{server}.{tool} needs your approval ({why}), and asking failed: {e}. {how_to_allow}"
                ),
            )),
        }
    }

    /// Puts `question` to the user through `asker`, `session`'s client, in its era.
    async fn put(
        &self,
        session: &str,
        asker: Asker,
        question: Question,
    ) -> Result<ElicitResult, String> {
        match asker {
            Asker::Elicit(peer) => peer
                .create_elicitation_with_timeout(question.params(), Some(APPROVAL_TIMEOUT))
                .await
                .map_err(|e| e.to_string()),
            Asker::Relay => self.relay.ask(session, question).await.ok_or_else(|| {
                format!(
                    "nobody answered within {} s (the client did not retry the call that asked)",
                    APPROVAL_TIMEOUT.as_secs()
                )
            }),
        }
    }

    /// Puts a question that is not about a proxied call (a package install) to the client of
    /// `session`'s runs, in its era, one at a time with the session's other questions.
    /// `Err(None)`: this client cannot ask; `Err(Some(why))`: asking failed.
    pub async fn ask_user(
        &self,
        session: &str,
        question: Question,
    ) -> Result<Decision, Option<String>> {
        let asker = crate::lock(&self.askers)
            .get(session)
            .cloned()
            .ok_or(None)?;
        let gate = crate::lock(&self.asking)
            .entry(session.to_string())
            .or_default()
            .clone();
        let _open = gate.lock().await;
        let answer = self.put(session, asker, question).await;
        answer
            .as_ref()
            .map(Decision::of)
            .map_err(|e| Some(e.clone()))
    }
}

/// One call put to the user.
pub(super) struct Asked<'a> {
    pub(super) session: &'a str,
    pub(super) run: Option<u64>,
    pub(super) server: &'a str,
    pub(super) tool: &'a str,
    pub(super) args: &'a serde_json::Map<String, Value>,
    pub(super) declared: Option<&'a [String]>,
}
