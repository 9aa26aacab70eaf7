//! Which MCP servers to proxy: discovery of the configuration sources, parsing, and `${VAR}`
//! expansion.
//!
//! Sources, highest precedence first (a server named in a higher source hides the same name in
//! lower ones): `MCP_BRIDGE_CONFIG` (a JSON string or a path), `./mcp_bridge_config.json`,
//! `~/.config/mcp-bridge/config.json`, and the other servers of Claude Desktop's config (never
//! ironcell itself). Each file may use `"mcpServers"` or `"servers"`. A malformed file or entry
//! is reported (file, server, field) and the rest still load.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Serialize;
use serde_json::Value;

/// One stdio server to proxy, ready to start.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ServerConfig {
    pub name: String,
    pub command: String,
    pub args: Vec<String>,
    /// The entry's own `env`, with `${VAR}` expanded. Secrets live here and only here.
    #[serde(skip)]
    pub env: BTreeMap<String, String>,
    pub cwd: Option<PathBuf>,
    pub description: Option<String>,
    /// Where the entry came from.
    pub source: String,
    /// Which of its tools code may see and call, and which need approval.
    pub rules: super::rules::ToolRules,
}

/// A problem found while loading, reported to the log and in `system://info`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ConfigProblem {
    pub source: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub server: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub field: Option<String>,
    pub message: String,
}

impl std::fmt::Display for ConfigProblem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.source)?;
        if let Some(s) = &self.server {
            write!(f, ", server {s:?}")?;
        }
        if let Some(k) = &self.field {
            write!(f, ", field `{k}`")?;
        }
        write!(f, ": {}", self.message)
    }
}

/// A well-formed entry that cannot be started from here, and why (e.g. a Windows-side server
/// under WSL2 without interop).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SkippedServer {
    pub name: String,
    pub source: String,
    pub reason: String,
}

/// Everything loaded: the servers by name, and what was wrong.
#[derive(Debug, Default, Clone)]
pub struct LoadedConfig {
    pub servers: BTreeMap<String, ServerConfig>,
    pub problems: Vec<ConfigProblem>,
    /// Entries that are well-formed but cannot run here.
    pub skipped: Vec<SkippedServer>,
    /// Sources that were read, in precedence order.
    pub sources: Vec<String>,
    /// Every server name a source defined, usable or not: a lower source never defines it
    /// again (an entry skipped for a misspelt rule must not be replaced by one without rules).
    pub claimed: std::collections::BTreeSet<String>,
}

/// The environment to read `MCP_BRIDGE_CONFIG`, `HOME` and `${VAR}`s from (the process's, or a
/// test's).
pub trait Env {
    fn var(&self, name: &str) -> Option<String>;
}

pub struct ProcessEnv;

impl Env for ProcessEnv {
    fn var(&self, name: &str) -> Option<String> {
        std::env::var(name).ok()
    }
}

/// Reads every source in precedence order.
pub fn load(env: &dyn Env, cwd: &Path, own_exe: Option<&Path>) -> LoadedConfig {
    let mut loaded = LoadedConfig::default();
    if let Some(v) = env
        .var("MCP_BRIDGE_CONFIG")
        .filter(|v| !v.trim().is_empty())
    {
        if v.trim_start().starts_with('{') {
            read_source(&mut loaded, env, "MCP_BRIDGE_CONFIG", Ok(v), None);
        } else {
            let path = PathBuf::from(&v);
            let text = std::fs::read_to_string(&path);
            read_source(
                &mut loaded,
                env,
                &format!("MCP_BRIDGE_CONFIG ({v})"),
                text,
                None,
            );
        }
    }
    let home = env.var("HOME").map(PathBuf::from);
    let mut files: Vec<(PathBuf, bool)> = vec![(cwd.join("mcp_bridge_config.json"), false)];
    if let Some(h) = &home {
        files.push((h.join(".config/mcp-bridge/config.json"), false));
        files.push((h.join(".config/Claude/claude_desktop_config.json"), true));
        files.push((
            h.join("Library/Application Support/Claude/claude_desktop_config.json"),
            true,
        ));
    }
    for (path, is_claude) in files {
        if !path.exists() {
            continue;
        }
        let skip_self = if is_claude { Some(own_exe) } else { None };
        read_source(
            &mut loaded,
            env,
            &path.display().to_string(),
            std::fs::read_to_string(&path),
            skip_self,
        );
    }
    load_windows_claude_desktop(&mut loaded, env, own_exe);
    loaded
}

/// Under WSL2: the servers of the Windows-side Claude Desktop config, made startable from
/// Linux where they can be (`wsl.exe … --exec cmd` entries run directly; Windows programs
/// through interop, bare names via `cmd.exe /c`, their `env` named in `WSLENV` so it crosses
/// to Windows); the others are listed in `skipped` with the reason.
fn load_windows_claude_desktop(loaded: &mut LoadedConfig, env: &dyn Env, own_exe: Option<&Path>) {
    let root = env
        .var("IRONCELL_PROBE_ROOT")
        .filter(|r| !r.is_empty())
        .unwrap_or_else(|| "/".into());
    let Some(wsl) = crate::setup::wsl::detect(Path::new(&root), env.var("WSL_DISTRO_NAME")) else {
        return;
    };
    let path = match env
        .var("IRONCELL_WINDOWS_CLAUDE_CONFIG")
        .filter(|p| !p.is_empty())
    {
        Some(p) => PathBuf::from(p),
        None => match wsl.claude_desktop_config(None) {
            Ok(p) if p.is_file() => p,
            Ok(_) => return,
            Err(e) => {
                tracing::info!("Windows-side Claude Desktop config not read: {e}");
                return;
            }
        },
    };
    let source = format!("{} (Windows side)", path.display());
    let before: Vec<String> = loaded.servers.keys().cloned().collect();
    read_source(
        loaded,
        env,
        &source,
        std::fs::read_to_string(&path),
        Some(own_exe),
    );
    let added: Vec<String> = loaded
        .servers
        .keys()
        .filter(|k| !before.contains(k))
        .cloned()
        .collect();
    for name in added {
        let Some(server) = loaded.servers.remove(&name) else {
            continue;
        };
        match runnable_from_wsl(server, &wsl) {
            Ok(s) => {
                loaded.servers.insert(name, s);
            }
            Err(reason) => loaded.skipped.push(SkippedServer {
                name,
                source: source.clone(),
                reason,
            }),
        }
    }
}

/// A Windows-side entry as a command Linux can start, or why it cannot be.
///
/// Long on purpose: the cases of a Windows-side command (path forms, interpreters, launchers),
/// each refused or translated in a few lines, in the order they are tried.
fn runnable_from_wsl(
    mut s: ServerConfig,
    wsl: &crate::setup::wsl::Wsl,
) -> Result<ServerConfig, String> {
    let base = s
        .command
        .rsplit(['/', '\\'])
        .next()
        .unwrap_or_default()
        .to_ascii_lowercase();
    if base == "wsl.exe" || base == "wsl" {
        let mut distro = None;
        let mut rest: Option<Vec<String>> = None;
        let mut it = s.args.iter();
        while let Some(a) = it.next() {
            match a.as_str() {
                "-d" | "--distribution" => distro = it.next().cloned(),
                "-u" | "--user" | "--cd" => {
                    it.next();
                }
                "-e" | "--exec" | "--" => {
                    rest = Some(it.by_ref().cloned().collect());
                }
                _ => {
                    rest = Some(
                        std::iter::once(a.clone())
                            .chain(it.by_ref().cloned())
                            .collect(),
                    );
                }
            }
        }
        if let (Some(want), Some(here)) = (&distro, &wsl.distro)
            && !want.eq_ignore_ascii_case(here)
        {
            return Err(format!(
                "starts in the WSL distro {want:?}, but ironcell runs in {here:?}"
            ));
        }
        let mut rest = rest.unwrap_or_default();
        if rest.is_empty() {
            return Err("starts a WSL shell, not a server command".into());
        }
        s.command = rest.remove(0);
        s.args = rest;
        return Ok(s);
    }
    if s.command.starts_with('/') {
        return Ok(s); // already a Linux path
    }
    if !wsl.interop {
        return Err(format!(
            "{:?} is a Windows program, and WSL interop is off here, so it cannot be started from WSL (turn on [interop] in /etc/wsl.conf, or run the server inside WSL)",
            s.command
        ));
    }
    if let Some(linux) = wsl.linux_path_of(&s.command) {
        if !linux.is_file() {
            return Err(format!(
                "{:?} does not exist (looked for {})",
                s.command,
                linux.display()
            ));
        }
        s.command = linux.display().to_string();
    } else {
        let cmd = wsl.c_drive.join("Windows/System32/cmd.exe");
        if !cmd.is_file() {
            return Err(format!(
                "{:?} needs Windows' cmd.exe to start, and {} is missing",
                s.command,
                cmd.display()
            ));
        }
        let mut args = vec!["/c".to_string(), s.command.clone()];
        args.append(&mut s.args);
        s.args = args;
        s.command = cmd.display().to_string();
    }
    if let Some(cwd) = &s.cwd
        && let Some(linux) = wsl.linux_path_of(&cwd.display().to_string())
    {
        s.cwd = Some(linux);
    }
    // Variables reach a Windows program only when WSLENV names them.
    let names: Vec<String> = s.env.keys().filter(|k| *k != "WSLENV").cloned().collect();
    if !names.is_empty() {
        let mut list = s.env.get("WSLENV").cloned().unwrap_or_default();
        for n in names {
            if !list.is_empty() {
                list.push(':');
            }
            list.push_str(&n);
        }
        s.env.insert("WSLENV".into(), list);
    }
    Ok(s)
}

/// One configuration source: its servers and the problems found in it.
///
/// Long on purpose: one source's reading, step by step (size, syntax, shape, each entry), each
/// step adding the problem it finds in the words the user sees.
fn read_source(
    loaded: &mut LoadedConfig,
    env: &dyn Env,
    source: &str,
    text: std::io::Result<String>,
    skip_self: Option<Option<&Path>>,
) {
    let problem = |server: Option<&str>, field: Option<&str>, message: String| ConfigProblem {
        source: source.to_string(),
        server: server.map(str::to_string),
        field: field.map(str::to_string),
        message,
    };
    let text = match text {
        Ok(t) => t,
        Err(e) => {
            loaded
                .problems
                .push(problem(None, None, format!("cannot read: {e}")));
            return;
        }
    };
    loaded.sources.push(source.to_string());
    let (doc, duplicates) = match parse_noting_duplicates(&text) {
        Ok(v) => v,
        Err(e) => {
            loaded
                .problems
                .push(problem(None, None, format!("not valid JSON: {e}")));
            return;
        }
    };
    // "mcpServers" wins where a file has both.
    let table_key = if doc.get("mcpServers").is_some() {
        "mcpServers"
    } else {
        "servers"
    };
    // A key given twice: serde_json keeps the last, which may be the one without the rule.
    // Within a server entry (or a server named twice) that server is not used; the table of
    // servers given twice, none of either's is. Their names stay claimed, so a lower source
    // cannot stand in for them. Keys ironcell does not read may repeat.
    let mut twice: BTreeMap<String, String> = BTreeMap::new();
    for (path, dropped) in &duplicates {
        match path.as_slice() {
            [table, name, rest @ ..] if table == table_key => {
                twice.entry(name.clone()).or_insert_with(|| rest.join("."));
            }
            [table] if table == table_key => {
                loaded.problems.push(problem(
                    None,
                    Some(table),
                    "is given twice; ironcell does not guess which one was meant, so none of \
                     the servers of either is used until one is removed"
                        .into(),
                ));
                for servers in [dropped, &doc[table_key]] {
                    if let Value::Object(m) = servers {
                        loaded.claimed.extend(m.keys().cloned());
                    }
                }
                return;
            }
            _ => {}
        }
    }
    let table = match doc.get(table_key) {
        Some(Value::Object(m)) => m,
        Some(_) => {
            loaded.problems.push(problem(
                None,
                Some(table_key),
                "must be an object of servers".into(),
            ));
            return;
        }
        None => {
            loaded.problems.push(problem(
                None,
                None,
                "has neither \"mcpServers\" nor \"servers\"".into(),
            ));
            return;
        }
    };
    for (name, entry) in table {
        if !loaded.claimed.insert(name.clone()) {
            continue; // a higher-precedence source already defines it (usable or not)
        }
        if let Some(field) = twice.get(name) {
            let (field, what) = if field.is_empty() {
                (None, "this server is defined twice in this file")
            } else {
                (
                    Some(field.as_str()),
                    "is given twice in this server's entry",
                )
            };
            loaded.problems.push(problem(
                Some(name),
                field,
                format!(
                    "{what}; ironcell does not guess which one was meant, so this server is not \
                     used until one is removed"
                ),
            ));
            continue;
        }
        match parse_entry(name, entry, env, source) {
            Ok(None) => {}
            Ok(Some((server, warnings))) => {
                if let Some(own) = skip_self
                    && let Some(why) = ironcell_itself(&server, own)
                {
                    loaded.skipped.push(SkippedServer {
                        name: name.clone(),
                        source: source.to_string(),
                        reason: format!("{why}: ironcell does not proxy itself"),
                    });
                    continue;
                }
                loaded.problems.extend(warnings);
                loaded.servers.insert(name.clone(), server);
            }
            Err(p) => loaded.problems.push(p),
        }
    }
}

/// A key given twice in one object: its path (array elements by index) and the value that
/// serde_json would have dropped without a word.
type Twice = (Vec<String>, Value);

/// Parses JSON as `serde_json::from_str::<Value>` does (the last of two keys kept), and also
/// returns every key given twice.
fn parse_noting_duplicates(text: &str) -> serde_json::Result<(Value, Vec<Twice>)> {
    use serde::de::{DeserializeSeed, MapAccess, SeqAccess, Visitor};
    use std::cell::RefCell;

    struct Seed<'a> {
        path: Vec<String>,
        twice: &'a RefCell<Vec<Twice>>,
    }
    impl<'a> Seed<'a> {
        fn at(&self, key: String) -> Seed<'a> {
            let mut path = self.path.clone();
            path.push(key);
            Seed {
                path,
                twice: self.twice,
            }
        }
    }
    impl<'de> DeserializeSeed<'de> for Seed<'_> {
        type Value = Value;
        fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
            d.deserialize_any(self)
        }
    }
    impl<'de> Visitor<'de> for Seed<'_> {
        type Value = Value;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("any JSON value")
        }
        fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
            Ok(Value::Bool(v))
        }
        fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
            Ok(v.into())
        }
        fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
            Ok(v.into())
        }
        fn visit_f64<E>(self, v: f64) -> Result<Value, E> {
            Ok(v.into())
        }
        fn visit_str<E>(self, v: &str) -> Result<Value, E> {
            Ok(Value::String(v.to_string()))
        }
        fn visit_string<E>(self, v: String) -> Result<Value, E> {
            Ok(Value::String(v))
        }
        fn visit_unit<E>(self) -> Result<Value, E> {
            Ok(Value::Null)
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
            let mut out = Vec::new();
            while let Some(v) = seq.next_element_seed(self.at(out.len().to_string()))? {
                out.push(v);
            }
            Ok(Value::Array(out))
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
            let mut out = serde_json::Map::new();
            while let Some(key) = map.next_key::<String>()? {
                let value = map.next_value_seed(self.at(key.clone()))?;
                if let Some(dropped) = out.insert(key.clone(), value) {
                    self.twice.borrow_mut().push((self.at(key).path, dropped));
                }
            }
            Ok(Value::Object(out))
        }
    }

    let twice = RefCell::new(Vec::new());
    let mut de = serde_json::Deserializer::from_str(text);
    let value = Seed {
        path: Vec::new(),
        twice: &twice,
    }
    .deserialize(&mut de)?;
    de.end()?;
    Ok((value, twice.into_inner()))
}

type Parsed = Option<(ServerConfig, Vec<ConfigProblem>)>;

/// The fields of a server entry ironcell reads.
const FIELDS: &[&str] = &[
    "command",
    "args",
    "env",
    "cwd",
    "description",
    "type",
    "disabled",
    "allow",
    "deny",
    "readOnly",
    "confirm",
    "auditArguments",
];

/// The fields that restrict what code may call: one of them misspelt skips the server.
const RULE_FIELDS: &[&str] = &["allow", "deny", "readOnly", "confirm", "auditArguments"];

/// Other clients' names for tool rules (Claude Code, Gemini CLI): written here they would be
/// ignored and leave the tools open, so they skip the server and name ironcell's field.
const OTHER_CLIENTS_RULES: &[(&str, &str)] = &[
    ("disallowedTools", "deny"),
    ("excludeTools", "deny"),
    ("allowedTools", "allow"),
    ("includeTools", "allow"),
];

/// The field `key` is most likely a misspelling of: same letters in another case, or one edit
/// away (two for names longer than five letters).
fn nearest_field(key: &str) -> Option<&'static str> {
    let key = key.to_ascii_lowercase();
    FIELDS
        .iter()
        .map(|f| {
            (
                strsim::damerau_levenshtein(&key, &f.to_ascii_lowercase()),
                *f,
            )
        })
        .filter(|(d, f)| *d <= if f.len() > 5 { 2 } else { 1 })
        .min()
        .map(|(_, f)| f)
}

/// One server's entry of a configuration source, as a server or the problems that keep it out.
///
/// Long on purpose: one field of a server's entry after another, read fail-closed in the order
/// docs/CONFIGURATION.md lists them; each check is a few lines.
fn parse_entry(
    name: &str,
    entry: &Value,
    env: &dyn Env,
    source: &str,
) -> Result<Parsed, ConfigProblem> {
    let problem = |field: Option<&str>, message: String| ConfigProblem {
        source: source.to_string(),
        server: Some(name.to_string()),
        field: field.map(str::to_string),
        message,
    };
    let Value::Object(e) = entry else {
        return Err(problem(None, "must be an object".into()));
    };
    if e.get("disabled").and_then(Value::as_bool) == Some(true) {
        return Ok(None);
    }
    let mut warnings = Vec::new();
    for key in e.keys().filter(|k| !FIELDS.contains(&k.as_str())) {
        if let Some((_, ours)) = OTHER_CLIENTS_RULES.iter().find(|(theirs, _)| theirs == key) {
            return Err(problem(
                Some(key),
                format!(
                    "is another client's tool rule, which ironcell does not read; write it as \
                     {ours:?}. This server is not used until then, since running it without the \
                     rule would leave its tools open"
                ),
            ));
        }
        match nearest_field(key) {
            Some(f) if RULE_FIELDS.contains(&f) => {
                return Err(problem(
                    Some(key),
                    format!(
                        "is not a field; did you mean {f:?}? A misspelt rule would leave open the \
                         tools it should restrict, so this server is not used until it is fixed"
                    ),
                ));
            }
            Some(f) => warnings.push(problem(
                Some(key),
                format!("is not a field (ignored); did you mean {f:?}?"),
            )),
            None => warnings.push(problem(
                Some(key),
                format!(
                    "is not a field ironcell reads (ignored); it reads {}",
                    FIELDS.join(", ")
                ),
            )),
        }
    }
    if let Some(t) = e.get("type").and_then(Value::as_str)
        && t != "stdio"
    {
        return Err(problem(
            Some("type"),
            format!("{t:?} servers are not supported; only stdio"),
        ));
    }
    let command = match e.get("command") {
        Some(Value::String(c)) if !c.trim().is_empty() => c.clone(),
        Some(_) => {
            return Err(problem(
                Some("command"),
                "must be a non-empty string".into(),
            ));
        }
        None => return Err(problem(Some("command"), "is missing".into())),
    };
    let args = match e.get("args") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(a)) => {
            let mut out = Vec::new();
            for (i, v) in a.iter().enumerate() {
                match v {
                    Value::String(s) => out.push(s.clone()),
                    Value::Number(n) => out.push(n.to_string()),
                    _ => {
                        return Err(problem(
                            Some(&format!("args[{i}]")),
                            "must be a string".into(),
                        ));
                    }
                }
            }
            out
        }
        Some(_) => return Err(problem(Some("args"), "must be an array of strings".into())),
    };
    let mut vars = BTreeMap::new();
    match e.get("env") {
        None | Some(Value::Null) => {}
        Some(Value::Object(m)) => {
            for (k, v) in m {
                let Value::String(raw) = v else {
                    return Err(problem(
                        Some(&format!("env.{k}")),
                        "must be a string".into(),
                    ));
                };
                let (value, missing) = expand_vars(raw, env);
                for var in missing {
                    warnings.push(problem(
                        Some(&format!("env.{k}")),
                        format!("refers to ${{{var}}}, which is not set in ironcell's environment (left empty)"),
                    ));
                }
                vars.insert(k.clone(), value);
            }
        }
        Some(_) => return Err(problem(Some("env"), "must be an object of strings".into())),
    }
    let cwd = match e.get("cwd") {
        None | Some(Value::Null) => None,
        Some(Value::String(c)) => Some(PathBuf::from(c)),
        Some(_) => return Err(problem(Some("cwd"), "must be a string".into())),
    };
    let description = match e.get("description") {
        None | Some(Value::Null) => None,
        Some(Value::String(d)) => Some(d.clone()),
        Some(_) => return Err(problem(Some("description"), "must be a string".into())),
    };
    let rules = super::rules::ToolRules::parse(e)
        .map_err(|(field, message)| problem(Some(&field), message))?;
    for (field, message) in rules.conflicts() {
        warnings.push(problem(Some(&field), message));
    }
    let server = ServerConfig {
        name: name.to_string(),
        command,
        args,
        env: vars,
        cwd,
        description,
        source: source.to_string(),
        rules,
    };
    Ok(Some((server, warnings)))
}

/// Expands `${NAME}` from `env`. Returns the value and the names that were not set. Only ever
/// applied to `env` values of the configuration, never to tool arguments.
pub fn expand_vars(raw: &str, env: &dyn Env) -> (String, Vec<String>) {
    let mut out = String::with_capacity(raw.len());
    let mut missing = Vec::new();
    let mut rest = raw;
    while let Some(start) = rest.find("${") {
        out.push_str(&rest[..start]);
        let after = &rest[start + 2..];
        match after.find('}') {
            Some(end) if is_var_name(&after[..end]) => {
                let name = &after[..end];
                match env.var(name) {
                    Some(v) => out.push_str(&v),
                    None => missing.push(name.to_string()),
                }
                rest = &after[end + 1..];
            }
            _ => {
                out.push_str("${");
                rest = after;
            }
        }
    }
    out.push_str(rest);
    (out, missing)
}

fn is_var_name(s: &str) -> bool {
    !s.is_empty()
        && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
        && !s.starts_with(|c: char| c.is_ascii_digit())
}

/// Why a Claude Desktop entry starts ironcell itself, if it does (so ironcell does not proxy
/// itself): it is named `ironcell`, or its command or one of its arguments (a launcher's:
/// `wsl.exe --exec`, `conda run`, `env`, `docker run`) is this very binary or a file (or image)
/// named `ironcell`. A path that merely contains "ironcell" (a clone's folder) is not.
fn ironcell_itself(server: &ServerConfig, own_exe: Option<&Path>) -> Option<String> {
    if server.name.eq_ignore_ascii_case("ironcell") {
        return Some("it is named ironcell".into());
    }
    let own = own_exe.and_then(|o| std::fs::canonicalize(o).ok());
    std::iter::once(&server.command)
        .chain(&server.args)
        .find_map(|word| {
            let base = word.rsplit(['/', '\\']).next().unwrap_or_default();
            let named =
                base.eq_ignore_ascii_case("ironcell") || base.eq_ignore_ascii_case("ironcell.exe");
            let same = own
                .as_ref()
                .is_some_and(|o| std::fs::canonicalize(word).is_ok_and(|w| w == *o));
            (named || same).then(|| format!("it starts ironcell ({word})"))
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    struct MapEnv(HashMap<&'static str, String>);
    impl Env for MapEnv {
        fn var(&self, name: &str) -> Option<String> {
            self.0.get(name).cloned()
        }
    }

    /// An environment whose only variable is `MCP_BRIDGE_CONFIG`.
    fn bridge_config(json: &str) -> MapEnv {
        MapEnv(HashMap::from([("MCP_BRIDGE_CONFIG", json.to_string())]))
    }

    /// The problems loading found, as the log shows them.
    fn problems(c: &LoadedConfig) -> Vec<String> {
        c.problems.iter().map(|p| p.to_string()).collect()
    }

    fn dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("ironcell-cfg-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn vars_expand_only_when_set_and_well_formed() {
        let env = MapEnv(HashMap::from([("TOKEN", "s3cret".to_string())]));
        assert_eq!(
            expand_vars("Bearer ${TOKEN}", &env),
            ("Bearer s3cret".into(), vec![])
        );
        assert_eq!(
            expand_vars("${NOPE}x", &env),
            ("x".into(), vec!["NOPE".into()])
        );
        assert_eq!(
            expand_vars("$TOKEN ${ bad } ${", &env).0,
            "$TOKEN ${ bad } ${"
        );
    }

    #[test]
    fn sources_follow_precedence_and_claude_desktop_skips_ironcell() {
        let home = dir("home");
        let cwd = dir("cwd");
        std::fs::create_dir_all(home.join(".config/Claude")).unwrap();
        std::fs::write(
            home.join(".config/Claude/claude_desktop_config.json"),
            r#"{"mcpServers": {"ironcell": {"command": "/opt/ironcell/bin/ironcell"},
                 "git": {"command": "uvx", "args": ["mcp-server-git"]},
                 "time": {"command": "from-claude"}}}"#,
        )
        .unwrap();
        std::fs::write(
            cwd.join("mcp_bridge_config.json"),
            r#"{"servers": {"time": {"command": "from-cwd"}}}"#,
        )
        .unwrap();
        let env = MapEnv(HashMap::from([
            ("HOME", home.display().to_string()),
            (
                "MCP_BRIDGE_CONFIG",
                r#"{"mcpServers": {"mem": {"command": "node", "env": {"K": "${HOME}"}}}}"#
                    .to_string(),
            ),
        ]));
        let c = load(&env, &cwd, None);
        assert_eq!(c.servers.keys().collect::<Vec<_>>(), ["git", "mem", "time"]);
        assert_eq!(c.servers["time"].command, "from-cwd");
        assert_eq!(c.servers["mem"].env["K"], home.display().to_string());
        assert!(c.problems.is_empty(), "{:?}", c.problems);
    }

    #[test]
    fn ironcell_itself_is_skipped_with_the_reason_and_a_path_merely_containing_its_name_is_not() {
        let home = dir("self");
        std::fs::create_dir_all(home.join(".config/Claude")).unwrap();
        std::fs::write(
            home.join(".config/Claude/claude_desktop_config.json"),
            r#"{"mcpServers": {
                 "mine": {"command": "/home/u/ironcell/target/release/ironcell", "args": ["serve"]},
                 "via-wsl": {"command": "wsl.exe", "args": ["-d", "U", "--exec", "/opt/bin/ironcell", "serve"]},
                 "in-clone": {"command": "python3", "args": ["/home/u/ironcell/tests/server.py"]},
                 "ironcellar": {"command": "/opt/ironcellar/bin/serve"}}}"#,
        )
        .unwrap();
        let env = MapEnv(HashMap::from([("HOME", home.display().to_string())]));
        let c = load(&env, &home, None);
        assert_eq!(
            c.servers.keys().collect::<Vec<_>>(),
            ["in-clone", "ironcellar"]
        );
        let skipped: Vec<(&str, &str)> = c
            .skipped
            .iter()
            .map(|s| (s.name.as_str(), s.reason.as_str()))
            .collect();
        assert_eq!(
            skipped,
            [
                (
                    "mine",
                    "it starts ironcell (/home/u/ironcell/target/release/ironcell): ironcell does not proxy itself"
                ),
                (
                    "via-wsl",
                    "it starts ironcell (/opt/bin/ironcell): ironcell does not proxy itself"
                )
            ]
        );
    }

    #[test]
    fn malformed_entries_are_reported_by_file_server_and_field_and_the_rest_load() {
        let cwd = dir("bad");
        std::fs::write(
            cwd.join("mcp_bridge_config.json"),
            r#"{"mcpServers": {"ok": {"command": "x"}, "noargs": {"command": "x", "args": "oops"},
                 "nocmd": {"args": []}, "http": {"type": "http", "command": "x"}}}"#,
        )
        .unwrap();
        let c = load(&MapEnv(HashMap::new()), &cwd, None);
        assert_eq!(c.servers.keys().collect::<Vec<_>>(), ["ok"]);
        let text = problems(&c);
        assert!(
            text.iter()
                .any(|t| t.contains("server \"noargs\", field `args`")),
            "{text:?}"
        );
        assert!(
            text.iter()
                .any(|t| t.contains("server \"nocmd\", field `command`: is missing")),
            "{text:?}"
        );
        assert!(text.iter().any(|t| t.contains("only stdio")), "{text:?}");

        // A misspelt rule skips the server (it would leave its tools open); any other unknown
        // field is reported and ignored.
        std::fs::write(
            cwd.join("mcp_bridge_config.json"),
            r#"{"mcpServers": {"a": {"command": "x", "Deny": ["delete_*"]},
                 "b": {"command": "x", "readonly": true}, "c": {"command": "x", "alow": []},
                 "d": {"command": "x", "comand": "y"}, "e": {"command": "x", "url": "http://h"}}}"#,
        )
        .unwrap();
        let c = load(&MapEnv(HashMap::new()), &cwd, None);
        assert_eq!(c.servers.keys().collect::<Vec<_>>(), ["d", "e"]);
        let text = problems(&c);
        for (server, field, fix) in [
            ("a", "Deny", "deny"),
            ("b", "readonly", "readOnly"),
            ("c", "alow", "allow"),
        ] {
            assert!(
                text.iter().any(
                    |t| t.contains(&format!("server \"{server}\", field `{field}`"))
                        && t.contains(&format!("did you mean \"{fix}\"?"))
                        && t.contains("not used")
                ),
                "{text:?}"
            );
        }
        assert!(
            text.iter().any(|t| t
                .contains("field `comand`: is not a field (ignored); did you mean \"command\"?")),
            "{text:?}"
        );
        assert!(
            text.iter()
                .any(|t| t.contains("field `url`: is not a field ironcell reads (ignored)")),
            "{text:?}"
        );

        // Fail closed: a skipped or disabled entry is not replaced by a lower source's entry of
        // the same name; `null` is not "no rule"; other clients' rule names are not ignored.
        std::fs::write(
            cwd.join("mcp_bridge_config.json"),
            r#"{"mcpServers": {"a": {"command": "x"}, "b": {"command": "x"},
                 "c": {"command": "x"}, "d": {"command": "x"}}}"#,
        )
        .unwrap();
        let env = bridge_config(
            r#"{"mcpServers": {"a": {"command": "x", "Deny": ["delete_*"]},
                 "b": {"command": "x", "disabled": true}, "c": {"command": "x", "deny": null},
                 "d": {"command": "x", "disallowedTools": ["delete_*"]}}}"#,
        );
        let c = load(&env, &cwd, None);
        assert!(c.servers.is_empty(), "{:?}", c.servers.keys());
        let text = problems(&c);
        assert!(
            text.iter()
                .any(|t| t.contains("server \"c\", field `deny`")),
            "{text:?}"
        );
        assert!(
            text.iter()
                .any(|t| t.contains("field `disallowedTools`") && t.contains("\"deny\"")),
            "{text:?}"
        );

        std::fs::write(cwd.join("mcp_bridge_config.json"), "{ not json").unwrap();
        let c = load(&MapEnv(HashMap::new()), &cwd, None);
        assert!(c.problems[0].to_string().contains("not valid JSON"));
    }

    #[test]
    fn a_key_given_twice_is_not_resolved_by_keeping_the_last() {
        // serde_json keeps the last of two keys: here the one without the rule.
        let cwd = dir("twice");
        std::fs::write(
            cwd.join("mcp_bridge_config.json"),
            r#"{"mcpServers": {"a": {"command": "x"}, "b": {"command": "x"}, "z": {"command": "x"}}}"#,
        )
        .unwrap();
        let env = bridge_config(
            r#"{"mcpServers": {"a": {"command": "x", "deny": ["delete_*"], "deny": []},
                 "b": {"command": "x", "readOnly": true}, "b": {"command": "x"},
                 "c": {"command": "x", "env": {"K": "1"}}}}"#,
        );
        let c = load(&env, &cwd, None);
        assert_eq!(c.servers.keys().collect::<Vec<_>>(), ["c", "z"]);
        let text = problems(&c);
        assert!(
            text.iter()
                .any(|t| t.contains("server \"a\", field `deny`: is given twice")
                    && t.contains("not used")),
            "{text:?}"
        );
        assert!(
            text.iter()
                .any(|t| t.contains("server \"b\": this server is defined twice")),
            "{text:?}"
        );
        // Outside any server entry: none of the file's servers, and no lower source's either.
        let env = bridge_config(
            r#"{"mcpServers": {"z": {"command": "x", "deny": ["*"]}}, "mcpServers": {"y": {"command": "x"}}}"#,
        );
        let c = load(&env, &cwd, None);
        assert_eq!(c.servers.keys().collect::<Vec<_>>(), ["a", "b"]);
        assert!(
            c.problems[0]
                .to_string()
                .contains("field `mcpServers`: is given twice"),
            "{:?}",
            c.problems
        );
        // A key ironcell does not read may repeat (Claude Desktop's own settings).
        let env =
            bridge_config(r#"{"theme": 1, "theme": 2, "mcpServers": {"y": {"command": "x"}}}"#);
        let c = load(&env, &cwd, None);
        assert_eq!(c.servers.keys().collect::<Vec<_>>(), ["a", "b", "y", "z"]);
        assert!(c.problems.is_empty(), "{:?}", c.problems);
        // Nested and array positions are named by path; no duplicate, no problem.
        let (v, twice) =
            parse_noting_duplicates(r#"{"s": [{"k": 1, "k": 2}], "t": {"u": 1}}"#).unwrap();
        assert_eq!(
            twice,
            [(vec!["s".into(), "0".into(), "k".into()], 1.into())]
        );
        assert_eq!(v["s"][0]["k"], 2);
        assert!(parse_noting_duplicates("[1, {}] x").is_err());
        assert!(
            parse_noting_duplicates(r#"{"a": 1.5, "b": null, "c": -3}"#)
                .unwrap()
                .1
                .is_empty()
        );
    }
}
