//! The arguments of ironcell's own tools, parsed with serde derives.
//!
//! Each field's deserializer names the argument, what it must be and what it got, so a bad call
//! comes back as an error result the model can fix in one step. What serde cannot say (a missing
//! required argument, an unknown one, ranges) is checked right after; the session-name alphabet
//! and the code size are checked when the run starts ([`crate::session::RunRefusal`]). The
//! advertised input schemas are written by hand in `server.rs`: derived ones would be larger,
//! and every byte of `tools/list` is in the model's context.

use std::time::Duration;

use rmcp::model::JsonObject;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer};
use serde_json::Value;

use crate::session::RunRequest;

/// The arguments `run_python` takes, as listed in its schema.
pub(super) const RUN_ARGUMENTS: &[&str] = &[
    "code",
    "session",
    "timeout_s",
    "reset",
    "servers",
    "fork_from",
];

/// `run_python`'s arguments as the client sent them. Each field's deserializer names the field,
/// what it must be and what it got; what serde cannot say (a missing `code`, an unknown argument,
/// ranges, the session-name alphabet) is checked after, in [`parse_run_arguments`] and when the
/// run starts.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct RunArguments {
    #[serde(deserialize_with = "code")]
    code: Option<String>,
    #[serde(deserialize_with = "session")]
    session: Option<String>,
    #[serde(deserialize_with = "timeout_s")]
    timeout_s: Option<f64>,
    #[serde(deserialize_with = "reset")]
    reset: Option<bool>,
    #[serde(deserialize_with = "servers")]
    servers: Option<Vec<String>>,
    #[serde(deserialize_with = "fork_from")]
    fork_from: Option<String>,
    /// Anything else, refused by name.
    #[serde(flatten)]
    unknown: JsonObject,
}

fn code<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    typed::<D, String>(d, "code", "a string of Python source").map(Some)
}
fn session<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    typed(d, "session", "a string")
}
fn timeout_s<'de, D: Deserializer<'de>>(d: D) -> Result<Option<f64>, D::Error> {
    typed(d, "timeout_s", "a number of seconds")
}
fn reset<'de, D: Deserializer<'de>>(d: D) -> Result<Option<bool>, D::Error> {
    typed(d, "reset", "true or false")
}
fn servers<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Vec<String>>, D::Error> {
    typed(d, "servers", "a list of server names")
}
fn fork_from<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    typed(d, "fork_from", "a session name")
}

/// `run_python_job`'s arguments. Other keys are ignored, as they always were.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct JobArguments {
    #[serde(deserialize_with = "job")]
    job: Option<String>,
    #[serde(deserialize_with = "action")]
    action: JobAction,
    #[serde(deserialize_with = "wait_s")]
    wait_s: Option<f64>,
}

/// What `run_python_job` does with the job.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(super) enum JobAction {
    /// Wait for the outcome, up to `wait_s` (capped by the wait budget).
    #[default]
    Wait,
    /// The outcome if there is one, at once.
    Poll,
    /// Interrupt the run, then wait for its outcome.
    Cancel,
}

fn job<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    typed(d, "job", "a string (the id a running result named)")
}
fn action<'de, D: Deserializer<'de>>(d: D) -> Result<JobAction, D::Error> {
    let v = Value::deserialize(d)?;
    match v {
        Value::Null => Ok(JobAction::Wait),
        v => JobAction::deserialize(&v).map_err(|_| {
            serde::de::Error::custom(format!(
                "unknown action {v}; use \"wait\", \"poll\" or \"cancel\""
            ))
        }),
    }
}
fn wait_s<'de, D: Deserializer<'de>>(d: D) -> Result<Option<f64>, D::Error> {
    typed(d, "wait_s", "a number of seconds")
}

/// Deserializes a `T`, or fails with a message that names the argument, what it must be and
/// what it got.
fn typed<'de, D, T>(d: D, field: &str, must: &str) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    T: DeserializeOwned,
{
    let v = Value::deserialize(d)?;
    let got = type_name(&v);
    T::deserialize(v).map_err(|e| {
        // For a list, serde's own words say which item is wrong.
        let detail = if got == "an array" {
            format!(" ({e})")
        } else {
            String::new()
        };
        serde::de::Error::custom(format!("`{field}` must be {must}, got {got}{detail}"))
    })
}

/// `run_python_job`'s arguments, checked.
#[derive(Debug)]
pub(super) struct JobCall {
    pub job: String,
    pub action: JobAction,
    /// How long to wait (before the wait budget caps it); none: the whole budget.
    pub wait: Option<Duration>,
}

/// Turns `run_python_job` arguments into a call, or says exactly what is wrong with them.
pub(super) fn parse_job_arguments(args: Option<&JsonObject>) -> Result<JobCall, String> {
    let args: JobArguments = arguments(args)?;
    let Some(job) = args.job else {
        return Err("missing required argument `job` (the id a running result named)".into());
    };
    let wait = match args.wait_s {
        None => None,
        Some(t) if t.is_finite() && t >= 0.0 => Some(Duration::from_secs_f64(t)),
        Some(_) => return Err("`wait_s` must be a non-negative number of seconds".into()),
    };
    Ok(JobCall {
        job,
        action: args.action,
        wait,
    })
}

/// Deserializes a tool's arguments (none: `{}`), keeping the message of the first problem.
fn arguments<T: DeserializeOwned>(args: Option<&JsonObject>) -> Result<T, String> {
    let args = args.cloned().unwrap_or_default();
    serde_json::from_value(Value::Object(args)).map_err(|e| e.to_string())
}

/// Turns `run_python` arguments into a request, or says exactly what is wrong with them.
pub fn parse_run_arguments(args: Option<&JsonObject>) -> Result<RunRequest, String> {
    let args: RunArguments = arguments(args)?;
    if let Some(unknown) = args.unknown.keys().next() {
        return Err(format!(
            "unknown argument {unknown:?}; run_python takes {}",
            RUN_ARGUMENTS.join(", ")
        ));
    }
    let Some(code) = args.code else {
        return Err("missing required argument `code` (a string of Python source)".into());
    };
    let timeout = match args.timeout_s {
        None => None,
        Some(t) if t.is_finite() && t > 0.0 && t <= 1e6 => Some(Duration::from_secs_f64(t)),
        Some(t) => {
            return Err(format!(
                "`timeout_s` must be a positive number of seconds (at most 1000000), got {t}"
            ));
        }
    };
    Ok(RunRequest {
        code,
        session: args.session.unwrap_or_else(|| "default".to_string()),
        timeout,
        reset: args.reset.unwrap_or(false),
        servers: args.servers.unwrap_or_default(),
        progress: None,
        fork_from: args.fork_from,
    })
}

fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn args(v: Value) -> JsonObject {
        match v {
            Value::Object(m) => m,
            _ => unreachable!(),
        }
    }

    #[test]
    fn arguments_get_defaults() {
        let r = parse_run_arguments(Some(&args(json!({"code": "1+1"})))).unwrap();
        assert_eq!(r.session, "default");
        assert!(r.timeout.is_none());
        assert!(!r.reset);
        assert!(r.servers.is_empty());
        let given = json!({"code": "x", "session": null, "timeout_s": 2.5, "reset": true, "servers": ["a"]});
        let r = parse_run_arguments(Some(&args(given))).unwrap();
        assert_eq!(r.session, "default", "null means the default");
        assert_eq!(r.timeout, Some(Duration::from_millis(2500)));
        assert!(r.reset);
        assert_eq!(r.servers, ["a"]);
    }

    #[test]
    fn wrong_argument_types_say_what_was_expected() {
        let cases = [
            (json!({}), "missing required argument `code`"),
            (json!({"code": 5}), "`code` must be a string"),
            (
                json!({"code": "x", "session": 3}),
                "`session` must be a string",
            ),
            (
                json!({"code": "x", "timeout_s": "10"}),
                "`timeout_s` must be a number",
            ),
            (json!({"code": "x", "timeout_s": -1}), "positive number"),
            (
                json!({"code": "x", "reset": "yes"}),
                "`reset` must be true or false",
            ),
            (json!({"code": "x", "cod": "y"}), "unknown argument \"cod\""),
        ];
        for (input, expected) in cases {
            let err = parse_run_arguments(Some(&args(input.clone()))).unwrap_err();
            assert!(err.contains(expected), "{input} -> {err}");
        }
    }

    #[test]
    fn job_arguments_name_what_is_wrong() {
        let ok = parse_job_arguments(Some(&args(json!({"job": "j1", "action": "poll"})))).unwrap();
        assert_eq!(
            (ok.job.as_str(), ok.action, ok.wait),
            ("j1", JobAction::Poll, None)
        );
        let waits = parse_job_arguments(Some(&args(json!({"job": "j", "wait_s": 2})))).unwrap();
        assert_eq!(
            (waits.action, waits.wait),
            (JobAction::Wait, Some(Duration::from_secs(2)))
        );
        let cases = [
            (json!({}), "missing required argument `job`"),
            (
                json!({"job": "j", "wait_s": -1}),
                "non-negative number of seconds",
            ),
            (
                json!({"job": "j", "wait_s": "1"}),
                "`wait_s` must be a number of seconds",
            ),
            (json!({"job": "j", "action": 3}), "unknown action 3; use"),
        ];
        for (input, expected) in cases {
            let err = parse_job_arguments(Some(&args(input.clone()))).unwrap_err();
            assert!(err.contains(expected), "{input} -> {err}");
        }
    }
}
