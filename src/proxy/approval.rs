//! Asking the user before a proxied call runs, in the era the client speaks.
//!
//! - Up to 2025-11-25: ironcell sends `elicitation/create` to the client in the middle of the
//!   `tools/call` that runs the code ([`Asker::Elicit`]).
//! - 2026-07-28: a server may no longer send requests to the client. Instead, a `tools/call`
//!   that is waiting for a run answers `resultType: "input_required"` with the question, and the
//!   client retries the same call with the user's answer and the `requestState` it was given
//!   (multi round-trip requests, "MRTR"). The run never stops meanwhile: the sandboxed code's
//!   proxied call waits here, in the [`Relay`], until the answer arrives ([`Asker::Relay`]).
//!
//! The `requestState` is an unguessable, single-use handle to questions kept here, never data:
//! a client cannot change what was asked, answer for another call, or answer twice. Which
//! session a question comes from is known to the host (the worker cannot claim another), so a
//! question is only carried by a call that is waiting for a run of that same session.

use std::collections::HashMap;
use std::io::Read;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use rmcp::model::{
    ElicitRequest, ElicitRequestParams, ElicitResult, ElicitationAction, ElicitationSchema,
    InputRequest, InputRequests, InputRequiredResult, InputResponses,
};
use serde_json::{Value, json};
use sha2::Digest;
use tokio::sync::{oneshot, watch};

use crate::lock;

/// How long a proxied call waits for the user to approve it.
pub const APPROVAL_TIMEOUT: Duration = Duration::from_secs(300);

/// Where the approval questions of one session's runs go.
#[derive(Clone)]
pub enum Asker {
    /// Handshake era: an `elicitation/create` request to this client.
    Elicit(rmcp::Peer<rmcp::RoleServer>),
    /// 2026-07-28: through the [`Relay`], as `input_required` results.
    Relay,
}

/// One approval question: what the user sees, and the one-field form they answer.
pub struct Question {
    pub message: String,
    pub schema: ElicitationSchema,
}

/// Largest argument text an approval question shows. Arguments that would show longer are
/// refused for approval with a message that says so: a question never shows less than the call.
pub const MAX_SHOWN_ARGUMENT_BYTES: usize = 8 << 10;

impl Question {
    /// The question for `server.tool(args)`, showing the server, the tool and every argument
    /// whole, in canonical form ([`shown_arguments`]): keys sorted, and every character that is
    /// not printable ASCII written as a `\u{…}` escape, so what the user reads cannot hide,
    /// reorder or imitate what runs. `declared` are the argument names the tool's inputSchema
    /// declares (`None`: it declares none); other keys are shown, and named as undeclared.
    /// Errs with the reason when the arguments are too large to show whole.
    pub fn for_call(
        server: &str,
        tool: &str,
        args: &serde_json::Map<String, Value>,
        declared: Option<&[String]>,
        why: &str,
    ) -> Result<Question, String> {
        let shown = shown_arguments(args);
        if shown.len() > MAX_SHOWN_ARGUMENT_BYTES {
            return Err(format!(
                "its arguments are {} bytes when shown in full, and an approval question shows at most {MAX_SHOWN_ARGUMENT_BYTES} (it never shows part of a call); pass smaller arguments (e.g. write the data in several calls)",
                shown.len()
            ));
        }
        let mut undeclared: Vec<String> = args
            .keys()
            .filter(|k| declared.is_none_or(|d| !d.iter().any(|n| n == *k)))
            .map(|k| escaped_string(k))
            .collect();
        undeclared.sort();
        let note = if undeclared.is_empty() {
            String::new()
        } else {
            format!(
                "\n\nNot declared by the tool's inputSchema (passed on as shown; the server may use or ignore them): {}",
                undeclared.join(", ")
            )
        };
        let (tool_shown, server_shown) = (escaped_string(tool), escaped_string(server));
        let why = escaped_text(why);
        let message = format!(
            "Code running in ironcell wants to call the tool {tool_shown} on the MCP server {server_shown} ({why}).\n\nArguments (all of them, keys sorted; characters other than printable ASCII are shown as \\u{{...}} escapes):\n{shown}{note}\n\nAllow this call?"
        );
        let schema = serde_json::from_value::<ElicitationSchema>(json!({
            "type": "object",
            "properties": {
                "approve": {"type": "boolean", "title": "Allow this call", "default": false}
            },
            "required": ["approve"]
        }))
        .map_err(|e| format!("approval form: {e}"))?;
        Ok(Question { message, schema })
    }

    pub fn params(&self) -> ElicitRequestParams {
        ElicitRequestParams::FormElicitationParams {
            meta: None,
            message: self.message.clone(),
            requested_schema: self.schema.clone(),
        }
    }
}

/// What the user said, as far as approval goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    Approved,
    /// Accepted the form without ticking "approve".
    NotApproved,
    Declined,
    Cancelled,
}

impl Decision {
    /// Only an accepted form with `approve: true` is approval.
    pub fn of(answer: &ElicitResult) -> Decision {
        match answer.action {
            ElicitationAction::Accept
                if answer.content.as_ref().and_then(|c| c.get("approve"))
                    == Some(&Value::Bool(true)) =>
            {
                Decision::Approved
            }
            ElicitationAction::Accept => Decision::NotApproved,
            ElicitationAction::Decline => Decision::Declined,
            _ => Decision::Cancelled,
        }
    }
}

/// A question no call has carried to the client yet.
struct Waiting {
    session: String,
    key: String,
    question: Question,
    answer: oneshot::Sender<ElicitResult>,
}

/// Questions carried to the client in one `input_required` result, until its retry.
struct Shown {
    job: String,
    call: String,
    session: String,
    at: Instant,
    questions: Vec<(String, Question, oneshot::Sender<ElicitResult>)>,
}

#[derive(Default)]
struct RelayState {
    next: u64,
    waiting: Vec<Waiting>,
    /// By `requestState`.
    shown: HashMap<String, Shown>,
    /// Shown in `tasks/get` answers, by task (job) id, until `tasks/update` answers them.
    tasks: HashMap<String, Shown>,
}

/// Approval questions of 2026-07-28 runs, between the proxied call that waits for the answer
/// and the `tools/call` that carries the question to the client.
pub struct Relay {
    state: Mutex<RelayState>,
    /// Bumped whenever a question arrives.
    arrived: watch::Sender<u64>,
}

impl Default for Relay {
    fn default() -> Self {
        Relay {
            state: Mutex::new(RelayState::default()),
            arrived: watch::channel(0).0,
        }
    }
}

impl Relay {
    /// Puts `question` from a run of `session` to the user and waits for the answer (`None` when
    /// nobody answered within [`APPROVAL_TIMEOUT`]).
    pub async fn ask(&self, session: &str, question: Question) -> Option<ElicitResult> {
        let (tx, rx) = oneshot::channel();
        let key = {
            let mut st = lock(&self.state);
            st.next += 1;
            let key = format!("approve-{}", st.next);
            st.waiting.push(Waiting {
                session: session.to_string(),
                key: key.clone(),
                question,
                answer: tx,
            });
            key
        };
        self.arrived.send_modify(|n| *n += 1);
        let answer = tokio::time::timeout(APPROVAL_TIMEOUT, rx).await;
        // Whatever happened, the question is no longer open.
        let mut guard = lock(&self.state);
        let st = &mut *guard;
        st.waiting.retain(|w| w.key != key);
        for shown in [&mut st.shown, &mut st.tasks] {
            shown.retain(|_, s| {
                s.questions.retain(|(k, _, _)| *k != key);
                !s.questions.is_empty()
            });
        }
        answer.ok().and_then(Result::ok)
    }

    /// Waits until a run of `session` has a question, then hands out every open question of
    /// that session as one `input_required` result for the call `call` (see [`call_digest`])
    /// that is waiting for `job`.
    pub async fn next_questions(
        &self,
        session: &str,
        job: &str,
        call: &str,
    ) -> InputRequiredResult {
        let mut arrived = self.arrived.subscribe();
        loop {
            arrived.borrow_and_update();
            if let Some(r) = self.claim(session, job, call) {
                return r;
            }
            if arrived.changed().await.is_err() {
                // The relay lives as long as the server; never reached in practice.
                std::future::pending::<()>().await;
            }
        }
    }

    fn claim(&self, session: &str, job: &str, call: &str) -> Option<InputRequiredResult> {
        let mut st = lock(&self.state);
        let (mine, rest): (Vec<Waiting>, Vec<Waiting>) = std::mem::take(&mut st.waiting)
            .into_iter()
            .partition(|w| w.session == session);
        st.waiting = rest;
        let mine: Vec<Waiting> = mine.into_iter().filter(|w| !w.answer.is_closed()).collect();
        if mine.is_empty() {
            return None;
        }
        let token = match new_token() {
            Ok(t) => t,
            Err(e) => {
                tracing::error!(error = %e, "cannot make a requestState; the questions stay open");
                st.waiting.extend(mine);
                return None;
            }
        };
        let mut requests = InputRequests::new();
        for w in &mine {
            requests.insert(
                w.key.clone(),
                InputRequest::Elicitation(ElicitRequest::new(w.question.params())),
            );
        }
        st.shown.retain(|_, s| s.at.elapsed() < APPROVAL_TIMEOUT);
        st.shown.insert(
            token.clone(),
            Shown {
                job: job.to_string(),
                call: call.to_string(),
                session: session.to_string(),
                at: Instant::now(),
                questions: mine
                    .into_iter()
                    .map(|w| (w.key, w.question, w.answer))
                    .collect(),
            },
        );
        Some(InputRequiredResult::new(Some(requests), Some(token)))
    }

    /// Delivers a retry's answers. `call` must be the digest of the retried call, which must be
    /// the call that was answered `input_required`. A question the client left unanswered is
    /// asked again. Returns the job the call goes on waiting for.
    pub fn answer(
        &self,
        token: &str,
        call: &str,
        responses: Option<&InputResponses>,
    ) -> Result<String, String> {
        let mut st = lock(&self.state);
        let Some(shown) = st.shown.remove(token) else {
            return Err(
                "this requestState is unknown: it was already answered, or its questions expired (ironcell waits 300 s for an answer); call the tool again without it"
                    .to_string(),
            );
        };
        if shown.call != call {
            let message = "a retry must repeat the call that was answered input_required (same tool, same arguments) with its requestState".to_string();
            st.shown.insert(token.to_string(), shown);
            return Err(message);
        }
        let empty = InputResponses::new();
        let responses = responses.unwrap_or(&empty);
        for (key, question, answer) in shown.questions {
            match responses.get(&key) {
                Some(value) => {
                    let _ = answer.send(read_answer(&key, value));
                }
                None => st.waiting.push(Waiting {
                    session: shown.session.clone(),
                    key,
                    question,
                    answer,
                }),
            }
        }
        drop(st);
        self.arrived.send_modify(|n| *n += 1);
        Ok(shown.job)
    }
}

impl Relay {
    /// For `tasks/get` of the task that runs `job` in `session`: its open questions, the same
    /// keys on every poll until `tasks/update` answers them (`None`: nothing to ask).
    pub fn task_questions(&self, session: &str, job: &str) -> Option<InputRequests> {
        let mut st = lock(&self.state);
        let (mine, rest): (Vec<Waiting>, Vec<Waiting>) = std::mem::take(&mut st.waiting)
            .into_iter()
            .partition(|w| w.session == session);
        st.waiting = rest;
        let entry = st.tasks.entry(job.to_string()).or_insert_with(|| Shown {
            job: job.to_string(),
            call: String::new(),
            session: session.to_string(),
            at: Instant::now(),
            questions: Vec::new(),
        });
        entry
            .questions
            .extend(mine.into_iter().map(|w| (w.key, w.question, w.answer)));
        entry.questions.retain(|(_, _, answer)| !answer.is_closed());
        let requests: InputRequests = entry
            .questions
            .iter()
            .map(|(key, q, _)| {
                (
                    key.clone(),
                    InputRequest::Elicitation(ElicitRequest::new(q.params())),
                )
            })
            .collect();
        if requests.is_empty() {
            st.tasks.remove(job);
            return None;
        }
        Some(requests)
    }

    /// `tasks/update`: delivers answers to questions a `tasks/get` showed for task `job`.
    /// Every key must be one of them.
    pub fn answer_task(&self, job: &str, responses: &InputResponses) -> Result<(), String> {
        let mut st = lock(&self.state);
        let Some(entry) = st.tasks.get_mut(job) else {
            return Err(format!(
                "task {job:?} has no outstanding input requests (tasks/get lists them)"
            ));
        };
        if let Some(unknown) = responses
            .keys()
            .find(|k| !entry.questions.iter().any(|(key, _, _)| key == *k))
        {
            return Err(format!(
                "{unknown:?} is not an outstanding input request of task {job:?}"
            ));
        }
        let (answered, open): (Vec<_>, Vec<_>) = std::mem::take(&mut entry.questions)
            .into_iter()
            .partition(|(key, _, _)| responses.contains_key(key));
        entry.questions = open;
        if entry.questions.is_empty() {
            st.tasks.remove(job);
        }
        drop(st);
        for (key, _, answer) in answered {
            let _ = answer.send(read_answer(&key, &responses[&key]));
        }
        Ok(())
    }
}

/// One client answer to an approval question; an unreadable one counts as "cancel".
fn read_answer(key: &str, value: &Value) -> ElicitResult {
    serde_json::from_value::<ElicitResult>(value.clone()).unwrap_or_else(|e| {
        tracing::warn!(key, error = %e, "unreadable answer to an approval question; taken as cancel");
        ElicitResult::new(ElicitationAction::Cancel)
    })
}

/// Identifies one `tools/call` (tool and arguments), so a retry can be matched to it.
pub fn call_digest(tool: &str, arguments: Option<&serde_json::Map<String, Value>>) -> String {
    let args = arguments
        .map(|a| serde_json::to_string(a).unwrap_or_default())
        .unwrap_or_default();
    let mut h = sha2::Sha256::new();
    h.update(tool.as_bytes());
    h.update([0]);
    h.update(args.as_bytes());
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

/// 128 random bits, hex.
fn new_token() -> std::io::Result<String> {
    let mut bytes = [0u8; 16];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut bytes)?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// `value` with every object's keys in sorted order, at every depth: the form an approved
/// call is shown in and passed on in, so the order the code chose cannot change what is shown.
pub fn canonical(value: &Value) -> Value {
    match value {
        Value::Object(m) => Value::Object(canonical_map(m)),
        Value::Array(a) => Value::Array(a.iter().map(canonical).collect()),
        other => other.clone(),
    }
}

/// [`canonical`] of an object.
pub fn canonical_map(m: &serde_json::Map<String, Value>) -> serde_json::Map<String, Value> {
    let mut keys: Vec<&String> = m.keys().collect();
    keys.sort();
    keys.into_iter()
        .map(|k| (k.clone(), canonical(&m[k])))
        .collect()
}

/// Arguments as an approval question shows them: JSON laid out one key per line, keys sorted,
/// strings quoted with [`escaped_string`].
pub fn shown_arguments(args: &serde_json::Map<String, Value>) -> String {
    let mut out = String::new();
    show_value(&Value::Object(canonical_map(args)), 0, &mut out);
    out
}

fn show_value(v: &Value, depth: usize, out: &mut String) {
    let pad = |n: usize| "  ".repeat(n);
    match v {
        Value::Object(m) if !m.is_empty() => {
            out.push_str("{\n");
            for (i, (k, v)) in m.iter().enumerate() {
                out.push_str(&pad(depth + 1));
                out.push_str(&escaped_string(k));
                out.push_str(": ");
                show_value(v, depth + 1, out);
                if i + 1 < m.len() {
                    out.push(',');
                }
                out.push('\n');
            }
            out.push_str(&pad(depth));
            out.push('}');
        }
        Value::Array(a) if !a.is_empty() => {
            out.push_str("[\n");
            for (i, v) in a.iter().enumerate() {
                out.push_str(&pad(depth + 1));
                show_value(v, depth + 1, out);
                if i + 1 < a.len() {
                    out.push(',');
                }
                out.push('\n');
            }
            out.push_str(&pad(depth));
            out.push(']');
        }
        Value::String(s) => out.push_str(&escaped_string(s)),
        other => out.push_str(&other.to_string()),
    }
}

/// `s` in double quotes, with `"` and `\\` escaped, `\n`, `\r`, `\t` as such, and every other
/// character outside printable ASCII (controls, format and bidi characters, line and paragraph
/// separators, zero-width characters, and every non-ASCII letter, so a look-alike cannot pass
/// for the letter it imitates) as `\u{hex}`.
pub fn escaped_string(s: &str) -> String {
    format!("\"{}\"", escaped_text(s).replace('"', "\\\""))
}

/// `s` with the escapes of [`escaped_string`] except for `"` (for text that is not quoted).
pub fn escaped_text(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            ' '..='~' => out.push(c),
            _ => out.push_str(&format!("\\u{{{:x}}}", c as u32)),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn question() -> Question {
        Question::for_call(
            "memory",
            "delete_entities",
            &serde_json::Map::new(),
            None,
            "test",
        )
        .unwrap_or_else(|e| panic!("{e}"))
    }

    fn accept(approve: bool) -> Value {
        json!({"action": "accept", "content": {"approve": approve}})
    }

    #[tokio::test]
    async fn a_question_reaches_a_call_of_its_session_and_the_answer_comes_back() {
        let relay = std::sync::Arc::new(Relay::default());
        let asking = {
            let relay = relay.clone();
            tokio::spawn(async move { relay.ask("s1", question()).await })
        };
        // A call waiting for a run of another session does not get it.
        let other = tokio::time::timeout(
            Duration::from_millis(200),
            relay.next_questions("s2", "job-9", "d"),
        )
        .await;
        assert!(other.is_err());
        let ir = relay.next_questions("s1", "job-1", "digest").await;
        let token = ir.request_state.clone().unwrap_or_default();
        let keys: Vec<String> = ir.input_requests.unwrap_or_default().into_keys().collect();
        assert_eq!(keys.len(), 1);
        // A retry of a different call, or a forged state, is refused and changes nothing.
        assert!(relay.answer(&token, "other call", None).is_err());
        assert!(relay.answer("forged", "digest", None).is_err());
        let mut responses = InputResponses::new();
        responses.insert(keys[0].clone(), accept(true));
        assert_eq!(
            relay.answer(&token, "digest", Some(&responses)),
            Ok("job-1".to_string())
        );
        let answer = asking.await.unwrap_or_default();
        assert_eq!(answer.as_ref().map(Decision::of), Some(Decision::Approved));
        // Single use.
        assert!(relay.answer(&token, "digest", Some(&responses)).is_err());
    }

    #[tokio::test]
    async fn an_unanswered_question_is_asked_again() {
        let relay = std::sync::Arc::new(Relay::default());
        let asking = {
            let relay = relay.clone();
            tokio::spawn(async move { relay.ask("s", question()).await })
        };
        let first = relay.next_questions("s", "job-1", "d").await;
        let token = first.request_state.unwrap_or_default();
        assert!(relay.answer(&token, "d", None).is_ok());
        let again = relay.next_questions("s", "job-1", "d").await;
        let key = again
            .input_requests
            .unwrap_or_default()
            .into_keys()
            .next()
            .unwrap_or_default();
        let mut responses = InputResponses::new();
        responses.insert(key, json!({"action": "decline"}));
        let token = again.request_state.unwrap_or_default();
        assert!(relay.answer(&token, "d", Some(&responses)).is_ok());
        let answer = asking.await.unwrap_or_default();
        assert_eq!(answer.as_ref().map(Decision::of), Some(Decision::Declined));
    }

    #[test]
    fn the_question_shows_every_key_and_value_escaped_sorted_and_whole() {
        let args: serde_json::Map<String, Value> = serde_json::from_value(json!({
            "path\u{200b}": "notes.txt",
            "pad": "x".repeat(3000),
            "path": "other.txt",
            "content": "a\u{202e}b\u{2028}c\u{85}\u{1b}[2K\"\\\n",
            "nested": {"z": 1, "a": ["\u{feff}"]},
        }))
        .unwrap_or_else(|e| panic!("{e}"));
        let declared = ["path".to_string(), "content".to_string()];
        let q = Question::for_call("s", "write_file", &args, Some(&declared), "why")
            .unwrap_or_else(|e| panic!("{e}"));
        let m = &q.message;
        assert!(
            m.chars().all(|c| c == '\n' || (' '..='~').contains(&c)),
            "{m}"
        );
        assert!(m.contains(&format!("\"pad\": \"{}\"", "x".repeat(3000))));
        assert!(
            m.contains(r#""content": "a\u{202e}b\u{2028}c\u{85}\u{1b}[2K\"\\\n""#),
            "{m}"
        );
        assert!(
            m.contains(
                r#""a": [
      "\u{feff}"
    ]"#
            ),
            "{m}"
        );
        let at = |k: &str| m.find(k).unwrap_or_else(|| panic!("{k} missing: {m}"));
        assert!(at("\"content\"") < at("\"nested\"") && at("\"nested\"") < at("\"pad\""));
        assert!(at("\"pad\"") < at("\"path\"") && at("\"path\"") < at(r#""path\u{200b}""#));
        let note = &m[at("Not declared")..];
        assert!(
            note.contains(r#""path\u{200b}""#)
                && note.contains("\"pad\"")
                && !note.contains("\"path\",")
        );
        // The canonical form sorts keys at every depth and keeps every value.
        let c = canonical_map(&args);
        assert_eq!(Value::Object(c.clone()), Value::Object(args.clone()));
        let keys: Vec<&String> = c.keys().collect();
        let mut sorted = keys.clone();
        sorted.sort();
        assert_eq!(keys, sorted);
    }

    #[test]
    fn arguments_too_large_to_show_whole_are_refused_not_cut() {
        let mut args = serde_json::Map::new();
        args.insert("content".into(), json!("\u{200b}".repeat(1100)));
        let err = Question::for_call("s", "t", &args, None, "why").err();
        assert!(
            err.as_deref().is_some_and(|e| e.contains("at most 8192")),
            "{err:?}"
        );
    }

    #[test]
    fn only_a_ticked_accept_is_approval() {
        let of =
            |v: Value| Decision::of(&serde_json::from_value(v).unwrap_or_else(|e| panic!("{e}")));
        assert_eq!(of(accept(true)), Decision::Approved);
        assert_eq!(of(accept(false)), Decision::NotApproved);
        assert_eq!(of(json!({"action": "accept"})), Decision::NotApproved);
        assert_eq!(of(json!({"action": "decline"})), Decision::Declined);
        assert_eq!(of(json!({"action": "cancel"})), Decision::Cancelled);
    }
}
