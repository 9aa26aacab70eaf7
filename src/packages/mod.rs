//! Packages on demand: `%pip install` in a cell installs wheels for that session, after the
//! user approves, without the sandbox ever getting a network.
//!
//! The worker only asks (`packages.install`, a bridge request with requirement strings). The
//! host checks the request, resolves it with the session interpreter's own pip against the
//! user's index configuration ([`pip`]), asks the user (the same question machinery as a
//! proxied call that needs approval, in both protocol eras) unless every package matches the
//! allow patterns, downloads the wheels, verifies their SHA-256, checks and unpacks each one
//! into the content-addressed store ([`wheel`], [`store`]), and hard-links them into the
//! worker's read-only view, which the worker has on its `sys.path`. Every install is audited.

pub mod pip;
pub mod store;
pub mod wheel;

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ironcell_core::bridge::{BridgeError, ErrorKind};
use serde_json::{Value, json};

use crate::proxy::Proxy;
use crate::proxy::approval::{Decision, Question, escaped_text};

pub use store::{Store, View};

/// Most requirements in one request, and the longest one.
const MAX_REQUIREMENTS: usize = 32;
const MAX_REQUIREMENT_CHARS: usize = 200;
/// How long a resolution is reused for the same request (so a second session installing the
/// same thing links from the store without asking the index again).
const RESOLUTION_REUSE: Duration = Duration::from_secs(3600);
/// Installs running at once in the whole host (each runs pip and unpacks wheels).
const INSTALLS_AT_ONCE: usize = 2;

/// `--packages`: whether code may ask to install packages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PackagesMode {
    /// Ask the user each time (unless every package matches `--packages-allow`).
    #[default]
    Ask,
    /// Refuse every install.
    Off,
}

/// What a session installed (what a new worker of the session is given).
#[derive(Debug, Clone)]
struct Installed {
    /// As the index names it (the wheel's own `.dist-info` has the escaped form).
    name: String,
    entry: store::StoreEntry,
}

pub struct Packages {
    mode: PackagesMode,
    allow: Vec<String>,
    /// The session interpreter (pip runs as `<python> -m pip`).
    python: Option<PathBuf>,
    store: Result<Store, String>,
    sessions: std::sync::Mutex<HashMap<String, Vec<Installed>>>,
    resolved: std::sync::Mutex<HashMap<String, (Instant, Vec<pip::Planned>)>>,
    stdlib: tokio::sync::OnceCell<BTreeSet<String>>,
    /// One install at a time per session.
    turns: std::sync::Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    at_once: tokio::sync::Semaphore,
}

/// A refusal or failure: the error kind the worker's code sees, and the message.
type Failure = (ErrorKind, String);

impl Packages {
    pub fn new(
        state_dir: &Path,
        mode: PackagesMode,
        allow: Vec<String>,
        budget: u64,
        python: Option<PathBuf>,
    ) -> Packages {
        let store = if mode == PackagesMode::Off {
            Err("installing packages is off".to_string())
        } else {
            Store::open(state_dir, budget)
        };
        if let Err(e) = &store
            && mode != PackagesMode::Off
        {
            tracing::warn!("the package store cannot be used: {e}");
        }
        Packages {
            mode,
            allow: allow
                .into_iter()
                .map(|p| normalize(p.trim()))
                .filter(|p| !p.is_empty())
                .collect(),
            python,
            store,
            sessions: std::sync::Mutex::new(HashMap::new()),
            resolved: std::sync::Mutex::new(HashMap::new()),
            stdlib: tokio::sync::OnceCell::new(),
            turns: std::sync::Mutex::new(HashMap::new()),
            at_once: tokio::sync::Semaphore::new(INSTALLS_AT_ONCE),
        }
    }

    /// A new, empty view for a worker about to be spawned (`None` when installs are off or
    /// the store cannot be used).
    pub fn new_view(&self) -> Option<View> {
        let store = self.store.as_ref().ok()?;
        match store.new_view() {
            Ok(v) => Some(v),
            Err(e) => {
                tracing::warn!("no package view for a worker: {e}");
                None
            }
        }
    }

    /// Links what `session` installed into the view of its new worker.
    pub fn attach(&self, session: &str, view: Option<&View>) -> bool {
        let (Ok(store), Some(view)) = (&self.store, view) else {
            return false;
        };
        let installed = crate::lock(&self.sessions)
            .get(session)
            .cloned()
            .unwrap_or_default();
        let linked = !installed.is_empty();
        for i in installed {
            if let Err(e) = store.link(&i.entry, &view.dir) {
                tracing::warn!(session, error = %e, "re-linking an installed package failed");
            }
        }
        linked
    }

    /// Forgets what `session` installed (the session was closed).
    pub fn forget(&self, session: &str) {
        crate::lock(&self.sessions).remove(session);
    }

    /// Removes this server's views (at shutdown).
    pub fn shut_down(&self) {
        if let Ok(store) = &self.store {
            store.remove_views();
        }
    }

    /// Answers a `packages.install` request of a worker of `session`, whose view is `view`.
    pub async fn install(
        &self,
        session: &str,
        view: Option<Arc<View>>,
        params: &Value,
        proxy: &Proxy,
    ) -> Result<Value, BridgeError> {
        let started = Instant::now();
        let mut record = json!({});
        let outcome = self
            .install_checked(session, view.as_deref(), params, proxy, &mut record)
            .await;
        if let Some(log) = proxy.audit() {
            let mut e = crate::audit::AuditEntry::new(session, "", &Err(String::new()));
            e.code_sha256 = String::new();
            e.refused = outcome.as_ref().err().map(|(_, m)| m.clone());
            e.status = match &outcome {
                Ok(_) => "packages_installed",
                Err((ErrorKind::Declined, _)) => "packages_declined",
                Err(_) => "packages_refused",
            }
            .to_string();
            e.duration_ms = started.elapsed().as_secs_f64() * 1000.0;
            e.packages = Some(record);
            log.append(&e);
        }
        outcome.map_err(|(kind, message)| BridgeError::new(kind, message))
    }

    /// One install of `mcp.install`, checked at each step.
    ///
    /// Long on purpose: the steps in the order they happen (checks, the session's turn, resolve,
    /// the user's approval, download, hash check, link), each returning its refusal and writing the
    /// audit record; split, the halves would pass the turn guards and the record between them.
    async fn install_checked(
        &self,
        session: &str,
        view: Option<&View>,
        params: &Value,
        proxy: &Proxy,
        record: &mut Value,
    ) -> Result<Value, Failure> {
        let requirements = read_requirements(params)?;
        let source = params
            .get("source")
            .and_then(Value::as_str)
            .filter(|s| s.len() <= 40 && s.chars().all(|c| c.is_ascii_graphic() || c == ' '))
            .unwrap_or("mcp.install")
            .to_string();
        record["requested"] = json!(requirements);
        record["source"] = json!(source);
        let refused = |m: String| (ErrorKind::Refused, m);
        if self.mode == PackagesMode::Off {
            return Err(refused(format!(
                "installing packages is off in this ironcell (--packages off / IRONCELL_PACKAGES=off). Ask the user to start it with --packages ask, or to install {} into the interpreter it runs ({})",
                requirements.join(" "),
                self.python_shown()
            )));
        }
        let Some(python) = self.python.clone() else {
            return Err(refused(
                "no Python interpreter was found for the sessions, so nothing can be installed"
                    .into(),
            ));
        };
        let store = self
            .store
            .as_ref()
            .map_err(|e| refused(format!("the package store cannot be used: {e}")))?;
        let Some(view) = view else {
            return Err(refused(
                "this session's worker has no package directory (see the server log); start a new session".into(),
            ));
        };
        let turn = crate::lock(&self.turns)
            .entry(session.to_string())
            .or_default()
            .clone();
        let _turn = turn.lock().await;
        let _place = self
            .at_once
            .acquire()
            .await
            .map_err(|e| refused(e.to_string()))?;
        let staging = store.staging().map_err(refused)?;
        let stdlib = self
            .stdlib
            .get_or_init(|| async {
                match pip::stdlib_names(&python, &staging.0).await {
                    Some(names) => names.into_iter().collect(),
                    None => wheel::STDLIB_FALLBACK
                        .split_whitespace()
                        .map(str::to_string)
                        .collect(),
                }
            })
            .await
            .clone();
        let have: Vec<Installed> = crate::lock(&self.sessions)
            .get(session)
            .cloned()
            .unwrap_or_default();
        let pins: Vec<String> = have
            .iter()
            .map(|i| format!("{}=={}", i.name, i.entry.unpacked.version))
            .collect();
        // Asked for again, exactly as installed: nothing to resolve (and no index needed).
        let named: Vec<(String, Option<&str>)> = requirements
            .iter()
            .map(|r| match r.split_once("==") {
                Some((n, v)) if !v.contains([',', '*']) => (normalize(n), Some(v)),
                _ => (normalize(r), None),
            })
            .collect();
        if named.iter().all(|(n, v)| {
            !n.contains(|c: char| !(c.is_ascii_alphanumeric() || c == '-'))
                && have.iter().any(|i| {
                    normalize(&i.name) == *n && v.is_none_or(|v| v == i.entry.unpacked.version)
                })
        }) {
            record["decision"] = json!("nothing to install");
            let already: Vec<Value> = have
                .iter()
                .filter(|i| named.iter().any(|(n, _)| *n == normalize(&i.name)))
                .map(|i| json!({"name": i.name, "version": i.entry.unpacked.version}))
                .collect();
            return Ok(json!({"installed": [], "already": already}));
        }
        let key = format!(
            "{}|{}",
            sorted(&requirements).join(" "),
            sorted(&pins).join(" ")
        );
        let reused = crate::lock(&self.resolved)
            .get(&key)
            .filter(|(at, _)| at.elapsed() < RESOLUTION_REUSE)
            .map(|(_, plan)| plan.clone());
        let plan = match reused {
            Some(plan) => plan,
            None => {
                let plan = pip::resolve(&python, &staging.0, &requirements, &pins)
                    .await
                    .map_err(|e| (ErrorKind::Unavailable, e))?;
                crate::lock(&self.resolved).insert(key, (Instant::now(), plan.clone()));
                plan
            }
        };
        let (already, wanted): (Vec<pip::Planned>, Vec<pip::Planned>) =
            plan.into_iter().partition(|p| {
                have.iter().any(|i| {
                    normalize(&i.name) == normalize(&p.name)
                        && i.entry.unpacked.version == p.version
                })
            });
        record["packages"] = json!(wanted);
        if wanted.is_empty() {
            record["decision"] = json!("nothing to install");
            return Ok(json!({
                "installed": [],
                "already": already.iter().map(|p| json!({"name": p.name, "version": p.version})).collect::<Vec<_>>(),
                "note": "already available in this session (installed in it before, or in the interpreter)",
            }));
        }
        let decision = self.decide(session, &wanted, &source, proxy).await;
        record["decision"] = json!(match &decision {
            Ok(how) => how.clone(),
            Err((_, m)) => m.clone(),
        });
        decision?;
        // Download what the store lacks; check every file's hash before it is opened as a zip.
        let missing: Vec<pip::Planned> = wanted
            .iter()
            .filter(|p| store.get(&p.sha256).is_none())
            .cloned()
            .collect();
        let downloads = staging.0.join("wheels");
        if !missing.is_empty() {
            std::fs::create_dir(&downloads).map_err(|e| refused(e.to_string()))?;
            pip::download(&python, &staging.0, &downloads, &missing)
                .await
                .map_err(|e| (ErrorKind::Unavailable, e))?;
        }
        let mut entries = Vec::new();
        for p in &wanted {
            let (store_ref, p2, downloads, stdlib) =
                (store, p.clone(), downloads.clone(), stdlib.clone());
            let entry = tokio::task::block_in_place(|| -> Result<store::StoreEntry, String> {
                if let Some(e) = store_ref.get(&p2.sha256) {
                    return Ok(e);
                }
                let file = downloads.join(&p2.filename);
                if p2.filename.contains('/') || !file.is_file() {
                    return Err(format!("pip did not download {}", p2.filename));
                }
                let sha = wheel::file_sha256(&file)?;
                if sha != p2.sha256 {
                    return Err(format!(
                        "{} does not match the SHA-256 the package index gave for it ({} instead of {}); refused",
                        p2.filename, sha, p2.sha256
                    ));
                }
                store_ref.add(&file, &sha, &p2.filename, &stdlib)
            })
            .map_err(refused)?;
            entries.push(entry);
        }
        for e in &entries {
            tokio::task::block_in_place(|| store.link(e, &view.dir)).map_err(refused)?;
        }
        crate::lock(&self.sessions)
            .entry(session.to_string())
            .or_default()
            .extend(wanted.iter().zip(&entries).map(|(p, e)| Installed {
                name: p.name.clone(),
                entry: e.clone(),
            }));
        Ok(json!({
            "installed": wanted.iter().zip(&entries).map(|(p, e)| json!({"name": p.name, "version": e.unpacked.version, "modules": e.unpacked.top_level})).collect::<Vec<_>>(),
            "already": already.iter().map(|p| json!({"name": p.name, "version": p.version})).collect::<Vec<_>>(),
            "path": view.dir.display().to_string(),
        }))
    }

    /// Whether the install may go ahead: allowed by pattern, or approved by the user.
    async fn decide(
        &self,
        session: &str,
        wanted: &[pip::Planned],
        source: &str,
        proxy: &Proxy,
    ) -> Result<String, Failure> {
        if !self.allow.is_empty()
            && wanted.iter().all(|p| {
                let name = normalize(&p.name);
                self.allow
                    .iter()
                    .any(|pat| wildmatch::WildMatch::new(pat).matches(&name))
            })
        {
            return Ok("allowed by --packages-allow".into());
        }
        let how_to_allow = "To install without asking, start ironcell with --packages-allow NAME (IRONCELL_PACKAGES_ALLOW, patterns such as 'numpy,pandas*'), or install them into the interpreter yourself";
        let question = question(session, wanted, source).map_err(|e| (ErrorKind::Refused, e))?;
        match proxy.ask_user(session, question).await {
            Ok(Decision::Approved) => Ok("approved by the user".into()),
            Ok(Decision::NotApproved) | Ok(Decision::Declined) | Ok(Decision::Cancelled) => Err((
                ErrorKind::Declined,
                format!(
                    "declined: the user did not approve installing {}",
                    names(wanted)
                ),
            )),
            Err(None) => Err((
                ErrorKind::Refused,
                format!(
                    "installing {} needs the user's approval, but this MCP client cannot ask (it does not support elicitation). {how_to_allow}",
                    names(wanted)
                ),
            )),
            Err(Some(why)) => Err((
                ErrorKind::Refused,
                format!(
                    "installing {} needs the user's approval, and asking failed: {why}. {how_to_allow}",
                    names(wanted)
                ),
            )),
        }
    }

    fn python_shown(&self) -> String {
        self.python
            .as_ref()
            .map_or("none found".into(), |p| p.display().to_string())
    }

    /// For `system://info`: the mode and the store.
    pub fn info(&self) -> Value {
        json!({
            "mode": self.mode,
            "allow": self.allow,
            "store": self.store.as_ref().ok().map(|s| json!({
                "path": s.path(),
                "budget_bytes": s.budget(),
                "bytes": s.size(),
            })),
        })
    }
}

fn names(wanted: &[pip::Planned]) -> String {
    wanted
        .iter()
        .map(|p| format!("{} {}", p.name, p.version))
        .collect::<Vec<_>>()
        .join(", ")
}

fn sorted(v: &[String]) -> Vec<String> {
    let mut v = v.to_vec();
    v.sort();
    v
}

/// The approval question: every package and version that would be installed, dependencies
/// included, each file and where it comes from (without credentials).
fn question(session: &str, wanted: &[pip::Planned], source: &str) -> Result<Question, String> {
    let mut lines = String::new();
    for p in wanted {
        let host = p
            .url
            .split("://")
            .nth(1)
            .and_then(|r| r.split('/').next())
            .unwrap_or("?");
        lines.push_str(&format!(
            "  {} {}{} — {} from {}\n",
            escaped_text(&p.name),
            escaped_text(&p.version),
            if p.requested { "" } else { " (dependency)" },
            escaped_text(&p.filename),
            escaped_text(host),
        ));
    }
    let message = format!(
        "Code in the ironcell session {} wants to install {} Python package(s) for that session only ({}):\n\n{lines}\nironcell downloads these wheels itself (the sandbox gets no network), checks their hashes, and never builds or runs anything outside the sandbox. Other sessions and your interpreter are not changed.\n\nAllow this install?",
        crate::proxy::approval::escaped_string(session),
        wanted.len(),
        escaped_text(source),
    );
    let schema = serde_json::from_value(json!({
        "type": "object",
        "properties": {
            "approve": {"type": "boolean", "title": "Install these packages", "default": false}
        },
        "required": ["approve"]
    }))
    .map_err(|e| format!("approval form: {e}"))?;
    Ok(Question { message, schema })
}

/// The request's requirements, each a plain `name[extras]<specifiers>`: no URL, path, option or
/// marker ever reaches pip's command line.
fn read_requirements(params: &Value) -> Result<Vec<String>, Failure> {
    let bad = |m: String| (ErrorKind::BadRequest, m);
    let list = params
        .get("requirements")
        .and_then(Value::as_array)
        .ok_or_else(|| bad("packages.install needs `requirements`, a list of strings".into()))?;
    if list.is_empty() {
        return Err(bad("no package named: e.g. %pip install tabulate".into()));
    }
    if list.len() > MAX_REQUIREMENTS {
        return Err(bad(format!(
            "at most {MAX_REQUIREMENTS} packages per install"
        )));
    }
    list.iter()
        .map(|v| {
            let s = v
                .as_str()
                .ok_or_else(|| bad("each requirement is a string".into()))?;
            check_requirement(s).map_err(bad)
        })
        .collect()
}

/// `s` without whitespace, if it is `NAME`, `NAME[extra,...]`, optionally followed by
/// comma-separated version clauses (`==1.2`, `>=1,<2`, `~=3.1`, `==1.*`).
pub fn check_requirement(s: &str) -> Result<String, String> {
    let shown = crate::clip_chars(&escaped_text(s), 80);
    let s: String = s.chars().filter(|c| !c.is_whitespace()).collect();
    if s.is_empty() || s.len() > MAX_REQUIREMENT_CHARS {
        return Err(format!("{shown:?} is not a package requirement"));
    }
    let not = |why: &str| {
        format!(
            "{shown:?} is not accepted: {why}. Name packages from the package index, optionally with a version (`NAME`, `NAME==1.2`, `NAME>=1,<2`, `NAME[extra]`)"
        )
    };
    let name_end = s
        .find(|c: char| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
        .unwrap_or(s.len());
    let name = &s[..name_end];
    if name.is_empty()
        || !name.starts_with(|c: char| c.is_ascii_alphanumeric())
        || !name.ends_with(|c: char| c.is_ascii_alphanumeric())
    {
        return Err(not(
            "a requirement starts with a package name (no option, URL or path)",
        ));
    }
    let mut rest = &s[name_end..];
    if let Some(r) = rest.strip_prefix('[') {
        let close = r.find(']').ok_or_else(|| not("an unclosed `[`"))?;
        let extras = &r[..close];
        if !extras.split(',').all(|e| {
            !e.is_empty()
                && e.chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
        }) {
            return Err(not("unreadable extras"));
        }
        rest = &r[close + 1..];
    }
    if !rest.is_empty() {
        for clause in rest.split(',') {
            let op_len = ["===", "==", "!=", "~=", ">=", "<=", ">", "<"]
                .iter()
                .find(|op| clause.starts_with(**op))
                .map(|op| op.len())
                .ok_or_else(|| not("only version clauses may follow the name (no URL, `@`, `;` marker or option)"))?;
            let version = &clause[op_len..];
            if version.is_empty()
                || !version.chars().all(|c| {
                    c.is_ascii_alphanumeric() || matches!(c, '.' | '*' | '+' | '!' | '_' | '-')
                })
            {
                return Err(not("an unreadable version"));
            }
        }
    }
    Ok(s)
}

/// A distribution name as PEP 503 compares them.
pub fn normalize(name: &str) -> String {
    let mut out = String::with_capacity(name.len());
    let mut sep = false;
    for c in name.chars() {
        if matches!(c, '-' | '_' | '.') {
            sep = true;
        } else {
            if sep && !out.is_empty() {
                out.push('-');
            }
            sep = false;
            out.push(c.to_ascii_lowercase());
        }
    }
    out
}

/// `ironcell packages list|prune`.
#[derive(Debug, clap::Subcommand)]
pub enum PackagesAction {
    /// Every wheel in the store: name, version, size, and whether a live session uses it.
    List,
    /// Remove the wheels no live session uses.
    Prune,
}

pub fn packages_command(state_dir: &Path, budget: u64, action: &PackagesAction) -> String {
    let store = Store::at(state_dir, budget);
    match action {
        PackagesAction::List => {
            let entries = store.list();
            let mut out = String::new();
            let total: u64 = entries.iter().map(|(e, _)| e.unpacked.bytes).sum();
            for (e, used) in &entries {
                out.push_str(&format!(
                    "{:<30} {:<14} {:>9.1} MiB  {}  {}\n",
                    escaped_text(&e.unpacked.name),
                    escaped_text(&e.unpacked.version),
                    e.unpacked.bytes as f64 / 1048576.0,
                    if *used { "in use" } else { "unused" },
                    escaped_text(&e.filename),
                ));
            }
            out.push_str(&format!(
                "{} wheel(s), {:.1} MiB of a {:.0} MiB budget, in {}\n",
                entries.len(),
                total as f64 / 1048576.0,
                budget as f64 / 1048576.0,
                state_dir.join("packages").display()
            ));
            out
        }
        PackagesAction::Prune => {
            let (n, bytes) = store.prune(None);
            format!(
                "removed {n} unused wheel(s), {:.1} MiB\n",
                bytes as f64 / 1048576.0
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requirements_are_names_and_versions_only() {
        for ok in [
            "tabulate",
            "markdown-it-py==3.0.0",
            "x[a,b]>=1,<2",
            "numpy ~= 2.1",
            "a.b_c==1.*",
        ] {
            assert!(check_requirement(ok).is_ok(), "{ok}");
        }
        for bad in [
            "--index-url=http://evil/",
            "-r/etc/shadow",
            "./local",
            "/abs/path",
            "pkg @ https://evil/x.whl",
            "pkg; os_name=='posix'",
            "git+https://x/y",
            "pkg==1 --hash=sha256:x",
            "",
            "-e",
        ] {
            assert!(check_requirement(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn names_normalize_as_pep_503() {
        assert_eq!(normalize("Markdown_It.Py"), "markdown-it-py");
    }
}
