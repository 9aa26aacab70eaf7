//! Control over proxied tools: which tools code may see and call, and which need the user's
//! approval first.
//!
//! One `run_python` call can call any tool of any configured server, in a loop, out of sight of
//! the client's per-tool approval prompt. The host owns the only path from the sandbox to the
//! upstreams, so this is where the rules live. Per server, in the proxy configuration:
//!
//! - `allow`: glob patterns (`*`, `?`) of tool names; when present, only matching tools exist
//!   (`[]`: none does; a rule written empty must not leave every tool open).
//! - `deny`: glob patterns of tool names that never exist (wins over `allow`).
//! - `readOnly: true`: only tools the server annotates `readOnlyHint: true` exist.
//! - `confirm`: `true` (every call needs approval), `false` (none does, even tools annotated
//!   `destructiveHint: true`), or a list of patterns needing approval in addition to the tools
//!   annotated `destructiveHint: true` (the default).
//! - `auditArguments: true`: the audit log records argument values, not only their names.
//!
//! `allow`, `deny` and `readOnly` decide which tools code sees; `confirm` and `destructiveHint`
//! decide which calls ask first. They are independent: a tool named exactly in `allow` is
//! visible and still asks when `confirm` or its annotation says so (only `"confirm": false`
//! turns asking off). Patterns match a tool by its real name and by the Python alias code
//! sees (`get_env` matches `get-env`). Rules that contradict each other are reported with the
//! configuration's problems, and the stricter one applies ([`ToolRules::conflicts`]).
//! Annotations from an upstream are only hints; the configuration wins. Only an explicit
//! `destructiveHint: true` asks for approval (the protocol's default for an unannotated tool
//! is "destructive", which would make every tool of most servers ask).

use serde_json::Value;

/// The rules of one server, as written in its configuration entry.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct ToolRules {
    /// `None`: no allow list; `Some([])`: nothing is allowed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub allow: Option<Vec<String>>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub deny: Vec<String>,
    #[serde(rename = "readOnly", skip_serializing_if = "std::ops::Not::not")]
    pub read_only: bool,
    pub confirm: Confirm,
    #[serde(rename = "auditArguments", skip_serializing_if = "std::ops::Not::not")]
    pub audit_arguments: bool,
}

/// Which calls of a server need the user's approval.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Confirm {
    /// Tools annotated `destructiveHint: true`, plus these patterns.
    #[default]
    Destructive,
    DestructiveAnd(Vec<String>),
    /// Every call.
    Always,
    /// No call.
    Never,
}

/// What the rules say about one tool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// The tool does not exist for code; the string names the rule.
    Denied(String),
    /// Callable without asking.
    Allowed,
    /// Callable after the user approves; the string says why approval is needed.
    NeedsApproval(String),
}

/// The annotations that matter here, read from a tool's JSON (`annotations.readOnlyHint`, …).
#[derive(Debug, Clone, Copy, Default)]
pub struct Hints {
    pub read_only: Option<bool>,
    pub destructive: Option<bool>,
}

impl Hints {
    pub fn of(tool: &rmcp::model::Tool) -> Hints {
        tool.annotations
            .as_ref()
            .map(|a| Hints {
                read_only: a.read_only_hint,
                destructive: a.destructive_hint,
            })
            .unwrap_or_default()
    }
}

impl ToolRules {
    /// Parses the rule fields of a configuration entry. Errors name the field.
    pub fn parse(entry: &serde_json::Map<String, Value>) -> Result<ToolRules, (String, String)> {
        // `null` is refused rather than read as "no rule": a rule that came out empty by
        // mistake must not leave the tools open.
        let patterns = |field: &str| -> Result<Vec<String>, (String, String)> {
            match entry.get(field) {
                None => Ok(Vec::new()),
                Some(Value::Array(a)) => a
                    .iter()
                    .enumerate()
                    .map(|(i, v)| match v {
                        Value::String(s) if !s.is_empty() => Ok(s.clone()),
                        _ => Err((
                            format!("{field}[{i}]"),
                            "must be a non-empty string (a tool name or glob pattern)".into(),
                        )),
                    })
                    .collect(),
                Some(_) => Err((
                    field.to_string(),
                    "must be an array of tool names or glob patterns".into(),
                )),
            }
        };
        let flag = |field: &str| -> Result<bool, (String, String)> {
            match entry.get(field) {
                None => Ok(false),
                Some(Value::Bool(b)) => Ok(*b),
                Some(_) => Err((field.to_string(), "must be true or false".into())),
            }
        };
        let confirm = match entry.get("confirm") {
            None => Confirm::Destructive,
            Some(Value::Bool(true)) => Confirm::Always,
            Some(Value::Bool(false)) => Confirm::Never,
            Some(Value::Array(_)) => {
                let p = patterns("confirm")?;
                if p.is_empty() {
                    Confirm::Destructive
                } else {
                    Confirm::DestructiveAnd(p)
                }
            }
            Some(_) => {
                return Err((
                    "confirm".into(),
                    "must be true, false, or an array of tool names or glob patterns".into(),
                ));
            }
        };
        Ok(ToolRules {
            allow: match entry.get("allow") {
                None => None,
                Some(_) => Some(patterns("allow")?),
            },
            deny: patterns("deny")?,
            read_only: flag("readOnly")?,
            confirm,
            audit_arguments: flag("auditArguments")?,
        })
    }

    /// Whether code may not see `tool` (listed by the server with its annotations).
    pub fn hides(&self, server: &str, tool: &rmcp::model::Tool) -> bool {
        matches!(
            self.verdict(server, &tool.name, Hints::of(tool)),
            Verdict::Denied(_)
        )
    }

    /// Why a tool of this name is hidden whatever its annotations (by `deny` or `allow`), so
    /// a probe is denied whether or not the server has such a tool and cannot tell the two
    /// apart. `None` when only the tool's annotations could hide it (`readOnly`).
    pub fn hides_name(&self, server: &str, tool: &str) -> Option<String> {
        let most_permissive = Hints {
            read_only: Some(true),
            destructive: None,
        };
        match self.verdict(server, tool, most_permissive) {
            Verdict::Denied(why) => Some(why),
            _ => None,
        }
    }

    /// Rules of this entry that contradict each other or cannot mean what they say: (field,
    /// message) for the configuration's problems. None changes what applies: the stricter
    /// rule does (a denied tool stays hidden, a tool under `confirm` asks).
    pub fn conflicts(&self) -> Vec<(String, String)> {
        let mut out = Vec::new();
        let confirm: &[String] = match &self.confirm {
            Confirm::DestructiveAnd(ps) => ps,
            _ => &[],
        };
        let lists: [(&str, &[String]); 3] = [
            ("allow", self.allow.as_deref().unwrap_or(&[])),
            ("deny", &self.deny),
            ("confirm", confirm),
        ];
        for (field, list) in lists {
            for (i, p) in list.iter().enumerate() {
                if list[..i].iter().any(|q| alias(q) == alias(p)) {
                    out.push((
                        format!("{field}[{i}]"),
                        format!("{p:?} is listed twice (as itself or by its Python alias)"),
                    ));
                }
            }
        }
        for (i, p) in self.allow.iter().flatten().enumerate() {
            if let Some(d) = self.deny.iter().find(|d| pattern_matches(d, p)) {
                out.push((
                    format!("allow[{i}]"),
                    format!("{p:?} is also hidden by \"deny\": [{d:?}]; deny wins, so code cannot see it"),
                ));
            }
            if is_exact(p)
                && let Some(c) = confirm.iter().find(|c| pattern_matches(c, p))
            {
                out.push((
                    format!("allow[{i}]"),
                    format!(
                        "{p:?} is in \"allow\" and under \"confirm\" ({c:?}): \"allow\" decides whether code sees a tool, \"confirm\" whether you are asked, so its calls ask"
                    ),
                ));
            }
        }
        for (i, c) in confirm.iter().enumerate() {
            if let Some(d) = self.deny.iter().find(|d| pattern_matches(d, c)) {
                out.push((
                    format!("confirm[{i}]"),
                    format!(
                        "{c:?} is hidden by \"deny\": [{d:?}], so it is never called or asked about"
                    ),
                ));
            }
        }
        out
    }

    /// What the rules say about `tool` of server `server`.
    pub fn verdict(&self, server: &str, tool: &str, hints: Hints) -> Verdict {
        if let Some(p) = self.deny.iter().find(|p| pattern_matches(p, tool)) {
            return Verdict::Denied(format!(
                "{server}.{tool} is denied by the rule \"deny\": [{p:?}] of server {server:?}"
            ));
        }
        if let Some(allow) = &self.allow
            && !allow.iter().any(|p| pattern_matches(p, tool))
        {
            return Verdict::Denied(if allow.is_empty() {
                format!("server {server:?} has \"allow\": [], which allows no tool")
            } else {
                format!("{server}.{tool} is not in the \"allow\" list of server {server:?}")
            });
        }
        if self.read_only && hints.read_only != Some(true) {
            return Verdict::Denied(read_only_denial(server, tool));
        }
        // `allow` decides visibility only: a tool named in it still asks where `confirm` or its
        // annotation says so.
        let listed = |ps: &[String]| ps.iter().any(|p| pattern_matches(p, tool));
        match &self.confirm {
            Confirm::Never => Verdict::Allowed,
            Confirm::Always => {
                Verdict::NeedsApproval(format!("server {server:?} has \"confirm\": true"))
            }
            Confirm::DestructiveAnd(ps) if listed(ps) => Verdict::NeedsApproval(format!(
                "{tool} is listed under \"confirm\" for server {server:?}"
            )),
            Confirm::Destructive | Confirm::DestructiveAnd(_) => {
                if hints.destructive == Some(true) && hints.read_only != Some(true) {
                    Verdict::NeedsApproval(format!(
                        "{server} annotates {tool} as destructive (destructiveHint: true)"
                    ))
                } else {
                    Verdict::Allowed
                }
            }
        }
    }
}

/// Why code cannot call `tool` of a `readOnly` server: the same words whether the server has
/// such a tool without the annotation or no such tool at all, so a probe cannot tell which.
pub fn read_only_denial(server: &str, tool: &str) -> String {
    format!(
        "server {server:?} is \"readOnly\": true, and it has no tool {tool:?} annotated \
         readOnlyHint: true (`await runtime.query_tool_docs({server:?})` lists the ones code can call)"
    )
}

/// Whether a rule's pattern matches `tool`, by its real name or by its Python alias.
pub fn pattern_matches(pattern: &str, tool: &str) -> bool {
    glob_match(pattern, tool)
        || glob_match(pattern, &alias(tool))
        || (is_exact(pattern) && alias(pattern) == alias(tool))
}

fn is_exact(pattern: &str) -> bool {
    !pattern.contains(['*', '?', '['])
}

/// The Python name code uses for a tool: what `mcp.identifier` makes of it (characters other
/// than letters, digits and `_` become `_`; a leading digit gets a `_` before it; a keyword
/// gets one after it).
pub fn alias(name: &str) -> String {
    const KEYWORDS: &[&str] = &[
        "False", "None", "True", "and", "as", "assert", "async", "await", "break", "class",
        "continue", "def", "del", "elif", "else", "except", "finally", "for", "from", "global",
        "if", "import", "in", "is", "lambda", "nonlocal", "not", "or", "pass", "raise", "return",
        "try", "while", "with", "yield",
    ];
    let mut out: String = name
        .chars()
        .map(|c| {
            if c.is_alphanumeric() || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect();
    if out.is_empty() || out.starts_with(|c: char| c.is_ascii_digit()) {
        out.insert(0, '_');
    }
    if KEYWORDS.contains(&out.as_str()) {
        out.push('_');
    }
    out
}

/// Shell-style glob: `*` any run of characters, `?` one character, everything else literal.
pub fn glob_match(pattern: &str, name: &str) -> bool {
    wildmatch::WildMatch::new(pattern).matches(name)
}

/// The default for calls that need approval (`--approval`, `IRONCELL_APPROVAL`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ApprovalMode {
    /// Ask the user through the client (elicitation); refuse where the client cannot ask.
    #[default]
    Ask,
    /// Run them without asking.
    Allow,
    /// Refuse them.
    Deny,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn rules(v: Value) -> ToolRules {
        match v {
            Value::Object(m) => ToolRules::parse(&m).unwrap_or_else(|e| panic!("{e:?}")),
            _ => unreachable!(),
        }
    }
    const RO: Hints = Hints {
        read_only: Some(true),
        destructive: None,
    };
    const DESTRUCTIVE: Hints = Hints {
        read_only: Some(false),
        destructive: Some(true),
    };
    const PLAIN: Hints = Hints {
        read_only: None,
        destructive: None,
    };

    #[test]
    fn deny_wins_over_allow_and_names_the_rule() {
        let r = rules(json!({"allow": ["*"], "deny": ["delete_*"]}));
        match r.verdict("memory", "delete_entities", PLAIN) {
            Verdict::Denied(why) => assert!(why.contains("\"deny\""), "{why}"),
            v => panic!("{v:?}"),
        }
        assert_eq!(r.verdict("memory", "read_graph", PLAIN), Verdict::Allowed);
    }

    #[test]
    fn an_allow_list_hides_everything_else() {
        let r = rules(json!({"allow": ["read_*", "search_nodes"]}));
        assert_eq!(r.verdict("m", "read_graph", PLAIN), Verdict::Allowed);
        assert!(matches!(
            r.verdict("m", "create_entities", PLAIN),
            Verdict::Denied(_)
        ));
    }

    #[test]
    fn an_empty_allow_list_allows_nothing() {
        let r = rules(json!({"allow": []}));
        match r.verdict("m", "read_graph", RO) {
            Verdict::Denied(why) => assert!(why.contains("\"allow\": []"), "{why}"),
            v => panic!("{v:?}"),
        }
        assert!(r.hides_name("m", "anything").is_some());
        assert_eq!(rules(json!({})).verdict("m", "x", PLAIN), Verdict::Allowed);
    }

    #[test]
    fn read_only_admits_only_tools_annotated_read_only() {
        let r = rules(json!({"readOnly": true}));
        assert_eq!(r.verdict("m", "read_graph", RO), Verdict::Allowed);
        assert!(matches!(r.verdict("m", "x", PLAIN), Verdict::Denied(_)));
        assert!(matches!(
            r.verdict("m", "x", DESTRUCTIVE),
            Verdict::Denied(_)
        ));
    }

    #[test]
    fn destructive_tools_need_approval_unless_the_config_says_otherwise() {
        let default = rules(json!({}));
        assert!(matches!(
            default.verdict("m", "drop", DESTRUCTIVE),
            Verdict::NeedsApproval(_)
        ));
        assert_eq!(default.verdict("m", "plain", PLAIN), Verdict::Allowed);
        let never = rules(json!({"confirm": false}));
        assert_eq!(never.verdict("m", "drop", DESTRUCTIVE), Verdict::Allowed);
        // Naming a tool in `allow` makes it visible, never silent.
        let exact = rules(json!({"allow": ["drop", "read_*"]}));
        assert!(matches!(
            exact.verdict("m", "drop", DESTRUCTIVE),
            Verdict::NeedsApproval(_)
        ));
        let exact_and_confirm = rules(json!({"allow": ["write_file"], "confirm": ["write_file"]}));
        assert!(matches!(
            exact_and_confirm.verdict("m", "write_file", PLAIN),
            Verdict::NeedsApproval(_)
        ));
        let exact_and_always = rules(json!({"allow": ["write_file"], "confirm": true}));
        assert!(matches!(
            exact_and_always.verdict("m", "write_file", PLAIN),
            Verdict::NeedsApproval(_)
        ));
        let listed = rules(json!({"confirm": ["create_*"]}));
        assert!(matches!(
            listed.verdict("m", "create_entities", PLAIN),
            Verdict::NeedsApproval(_)
        ));
        assert!(matches!(
            listed.verdict("m", "drop", DESTRUCTIVE),
            Verdict::NeedsApproval(_)
        ));
        let always = rules(json!({"confirm": true}));
        assert!(matches!(
            always.verdict("m", "read_graph", RO),
            Verdict::NeedsApproval(_)
        ));
    }

    #[test]
    fn bad_fields_are_named() {
        let bad = |v: Value| match v {
            Value::Object(m) => ToolRules::parse(&m).err().map(|e| e.0),
            _ => unreachable!(),
        };
        assert_eq!(bad(json!({"allow": "x"})).as_deref(), Some("allow"));
        assert_eq!(bad(json!({"deny": [1]})).as_deref(), Some("deny[0]"));
        assert_eq!(bad(json!({"readOnly": "yes"})).as_deref(), Some("readOnly"));
        assert_eq!(bad(json!({"confirm": 3})).as_deref(), Some("confirm"));
    }

    #[test]
    fn patterns_match_the_real_name_and_the_python_alias() {
        let r = rules(json!({"deny": ["get_env"], "confirm": ["set_*"]}));
        assert!(matches!(
            r.verdict("m", "get-env", PLAIN),
            Verdict::Denied(_)
        ));
        assert!(r.hides_name("m", "get-env").is_some());
        assert!(matches!(
            r.verdict("m", "set-env", PLAIN),
            Verdict::NeedsApproval(_)
        ));
        let by_real = rules(json!({"deny": ["get-env"]}));
        assert!(matches!(
            by_real.verdict("m", "get-env", PLAIN),
            Verdict::Denied(_)
        ));
        assert!(matches!(
            by_real.verdict("m", "get.env", PLAIN),
            Verdict::Denied(_)
        ));
        let allow = rules(json!({"allow": ["get_env"]}));
        assert_eq!(allow.verdict("m", "get-env", PLAIN), Verdict::Allowed);
        assert!(matches!(
            allow.verdict("m", "other", PLAIN),
            Verdict::Denied(_)
        ));
        assert_eq!(alias("class"), "class_");
        assert_eq!(alias("1st"), "_1st");
        assert_eq!(alias("a.b-c"), "a_b_c");
    }

    #[test]
    fn contradicting_rules_are_reported_and_the_stricter_applies() {
        let r = rules(
            json!({"allow": ["write_file", "read_*", "drop"], "deny": ["drop"],
                             "confirm": ["write_file", "write-file", "drop"]}),
        );
        let found: Vec<String> = r
            .conflicts()
            .into_iter()
            .map(|(f, m)| format!("{f}: {m}"))
            .collect();
        let has =
            |f: &str, words: &str| found.iter().any(|m| m.starts_with(f) && m.contains(words));
        assert!(has("allow[0]", "its calls ask"), "{found:?}");
        assert!(has("allow[2]", "deny wins"), "{found:?}");
        assert!(has("confirm[1]", "listed twice"), "{found:?}");
        assert!(has("confirm[2]", "never called"), "{found:?}");
        assert!(matches!(
            r.verdict("m", "drop", DESTRUCTIVE),
            Verdict::Denied(_)
        ));
        assert!(
            rules(json!({"allow": ["a"], "deny": ["b"]}))
                .conflicts()
                .is_empty()
        );
    }

    #[test]
    fn globs_match_whole_names() {
        assert!(glob_match("read_*", "read_graph"));
        assert!(!glob_match("read_*", "xread_graph"));
        assert!(glob_match("get_?", "get_a"));
        assert!(glob_match("exact", "exact"));
        assert!(!glob_match("exact", "exactly"));
    }
}
