//! Resolution and download with the session interpreter's own pip, run by the host.
//!
//! Why pip, as a subprocess of the session's interpreter: `pip install --dry-run --report`
//! resolves against exactly what that interpreter already has (its version, platform tags and
//! installed distributions), and reads the user's own index configuration (`PIP_INDEX_URL`,
//! `pip.conf`, netrc, keyring) in the host, where its credentials stay. `--only-binary=:all:`
//! means a package without a wheel for this interpreter is refused by the resolver itself,
//! never built (a build runs the package's code outside the sandbox). The download is a second
//! run, `pip download --no-deps --require-hashes` of exactly the files the report named, and
//! the host checks each file's SHA-256 again before unpacking it.
//!
//! pip runs with a fresh private directory as its working directory (so `-m pip` imports
//! nothing from a session), no stdin, `--no-input` (it never waits for a password), a 5 s
//! socket timeout without retries (an index that hangs fails within seconds), and an overall
//! deadline; it is killed when the request is dropped.

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use serde_json::Value;

/// Socket timeout given to pip, in seconds.
pub const SOCKET_TIMEOUT_S: u64 = 5;
/// Longest a resolution may take in all.
const RESOLVE_DEADLINE: Duration = Duration::from_secs(120);
/// Longest the downloads of one install may take in all.
const DOWNLOAD_DEADLINE: Duration = Duration::from_secs(600);

/// One distribution the resolver chose.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Planned {
    pub name: String,
    pub version: String,
    pub filename: String,
    /// Without any user:password part.
    pub url: String,
    pub sha256: String,
    /// Named in the request (not only a dependency).
    pub requested: bool,
}

/// `python -m pip install --dry-run --report` of `requirements`, with `constraints` (pins the
/// session already has). Returns what pip would install.
pub async fn resolve(
    python: &Path,
    work: &Path,
    requirements: &[String],
    constraints: &[String],
) -> Result<Vec<Planned>, String> {
    let report = work.join("report.json");
    let mut args: Vec<String> = vec![
        "install".into(),
        "--dry-run".into(),
        "--report".into(),
        report.display().to_string(),
        "--only-binary=:all:".into(),
    ];
    if !constraints.is_empty() {
        let c = work.join("constraints.txt");
        std::fs::write(&c, constraints.join("\n") + "\n")
            .map_err(|e| format!("writing constraints: {e}"))?;
        args.push("-c".into());
        args.push(c.display().to_string());
    }
    args.push("--".into());
    args.extend(requirements.iter().cloned());
    run_pip(python, work, &args, RESOLVE_DEADLINE).await?;
    let text =
        std::fs::read_to_string(&report).map_err(|e| format!("pip wrote no report ({e})"))?;
    let report: Value =
        serde_json::from_str(&text).map_err(|e| format!("pip's report is not JSON: {e}"))?;
    parse_report(&report)
}

fn parse_report(report: &Value) -> Result<Vec<Planned>, String> {
    let mut out = Vec::new();
    for item in report
        .get("install")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        let s = |v: Option<&Value>| v.and_then(Value::as_str).unwrap_or_default().to_string();
        let name = s(item.pointer("/metadata/name"));
        let version = s(item.pointer("/metadata/version"));
        let url = s(item.pointer("/download_info/url"));
        let hashes = item.pointer("/download_info/archive_info/hashes");
        let sha256 = hashes
            .and_then(|h| h.get("sha256"))
            .and_then(Value::as_str)
            .map(str::to_string)
            .or_else(|| {
                item.pointer("/download_info/archive_info/hash")
                    .and_then(Value::as_str)
                    .and_then(|h| h.strip_prefix("sha256="))
                    .map(str::to_string)
            })
            .unwrap_or_default()
            .to_ascii_lowercase();
        let filename = url
            .split(['#', '?'])
            .next()
            .and_then(|u| u.rsplit('/').next())
            .map(|f| {
                percent_encoding::percent_decode_str(f)
                    .decode_utf8_lossy()
                    .into_owned()
            })
            .unwrap_or_default();
        if name.is_empty() || version.is_empty() {
            return Err("pip's report names a package without a name or version".into());
        }
        if item.get("is_direct").and_then(Value::as_bool) == Some(true) && !url.starts_with("http")
        {
            return Err(format!(
                "{name} would come from {url}, not from the package index"
            ));
        }
        if !filename.ends_with(".whl") {
            return Err(format!(
                "{name} {version} has no wheel for this interpreter (only {filename:?}); ironcell installs wheels only and never builds a package (a build runs its code outside the sandbox). Install it into your own environment instead"
            ));
        }
        if sha256.len() != 64 || !sha256.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(format!(
                "the package index gave no SHA-256 for {filename}, so it cannot be verified; use an index that publishes hashes"
            ));
        }
        out.push(Planned {
            name,
            version,
            filename,
            url: without_credentials(&url),
            sha256,
            requested: item.get("requested").and_then(Value::as_bool) == Some(true),
        });
    }
    Ok(out)
}

/// `python -m pip download` of exactly `planned` (no dependencies, hashes required) into `dir`.
pub async fn download(
    python: &Path,
    work: &Path,
    dir: &Path,
    planned: &[Planned],
) -> Result<(), String> {
    let req = work.join("download.txt");
    let lines: Vec<String> = planned
        .iter()
        .map(|p| format!("{}=={} --hash=sha256:{}", p.name, p.version, p.sha256))
        .collect();
    std::fs::write(&req, lines.join("\n") + "\n")
        .map_err(|e| format!("writing the download list: {e}"))?;
    let args: Vec<String> = vec![
        "download".into(),
        "--no-deps".into(),
        "--only-binary=:all:".into(),
        "--require-hashes".into(),
        "-d".into(),
        dir.display().to_string(),
        "-r".into(),
        req.display().to_string(),
    ];
    run_pip(python, work, &args, DOWNLOAD_DEADLINE).await
}

/// The interpreter's `sys.stdlib_module_names` (3.10+), or `None`.
pub async fn stdlib_names(python: &Path, work: &Path) -> Option<Vec<String>> {
    let out = tokio::process::Command::new(python)
        .args([
            "-I",
            "-c",
            "import sys, json; print(json.dumps(sorted(getattr(sys, 'stdlib_module_names', []))))",
        ])
        .current_dir(work)
        .stdin(Stdio::null())
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(Duration::from_secs(30), out)
        .await
        .ok()?
        .ok()?;
    let names: Vec<String> = serde_json::from_slice(&out.stdout).ok()?;
    (!names.is_empty()).then_some(names)
}

async fn run_pip(
    python: &Path,
    work: &Path,
    args: &[String],
    deadline: Duration,
) -> Result<(), String> {
    let mut cmd = tokio::process::Command::new(python);
    // The subcommand, then the common options, then its own (which may end with `--`).
    let (subcommand, rest) = args.split_first().ok_or("no pip subcommand")?;
    cmd.args(["-m", "pip", subcommand])
        .args([
            "-vv",
            "--no-input",
            "--disable-pip-version-check",
            "--progress-bar",
            "off",
            "--retries",
            "0",
            "--timeout",
        ])
        .arg(SOCKET_TIMEOUT_S.to_string())
        .args(rest)
        .current_dir(work)
        .env("PIP_NO_INPUT", "1")
        .env("PIP_DISABLE_PIP_VERSION_CHECK", "1")
        .env_remove("PYTHONPATH")
        .env_remove("PYTHONSTARTUP")
        .env_remove("PYTHONHOME")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let started = std::time::Instant::now();
    let mut child = cmd
        .spawn()
        .map_err(|e| format!("cannot run {} -m pip: {e}", python.display()))?;
    let (stdout, stderr) = (child.stdout.take(), child.stderr.take());
    // pip runs with -vv (an index it could not fetch is logged only at that level, on stdout);
    // keep the lines that explain a failure, and the last few of each stream.
    let reading = async move {
        let (mut a, b) = tokio::join!(explaining_lines(stdout), explaining_lines(stderr));
        a.extend(b);
        a.join("\n")
    };
    let waited = tokio::time::timeout(deadline, async {
        let (text, status) = tokio::join!(reading, child.wait());
        (text, status)
    })
    .await;
    let (stderr, status) = match waited {
        Err(_) => {
            return Err(format!(
                "pip did not finish within {} s (a slow or unreachable package index?)",
                deadline.as_secs()
            ));
        }
        Ok((text, status)) => (text, status),
    };
    match status {
        Ok(s) if s.success() => return Ok(()),
        Ok(_) => {}
        Err(e) => return Err(format!("waiting for {} -m pip: {e}", python.display())),
    }
    tracing::info!(stderr = %stderr, elapsed_ms = started.elapsed().as_millis() as u64, "pip failed");
    Err(explain_failure(python, &stderr))
}

/// The lines of pip's output that explain a failure, and the last few.
async fn explaining_lines(stream: Option<impl tokio::io::AsyncRead + Unpin>) -> Vec<String> {
    use tokio::io::AsyncBufReadExt;
    let mut kept: Vec<String> = Vec::new();
    let mut tail: std::collections::VecDeque<String> = std::collections::VecDeque::new();
    let Some(stream) = stream else {
        return kept;
    };
    let mut reader = tokio::io::BufReader::new(stream);
    let mut buf = Vec::new();
    loop {
        buf.clear();
        match reader.read_until(b'\n', &mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(_) => {}
        }
        let line = crate::clip_chars(String::from_utf8_lossy(&buf).trim_end(), 2000);
        if (line.starts_with("ERROR:")
            || line.starts_with("Could not fetch URL")
            || line.contains("No module named pip"))
            && kept.len() < 50
            && !kept.contains(&line)
        {
            kept.push(line.clone());
        }
        tail.push_back(line);
        if tail.len() > 5 {
            tail.pop_front();
        }
    }
    kept.extend(tail);
    kept
}

/// pip's failure, as one message that names the problem and the fix.
fn explain_failure(python: &Path, stderr: &str) -> String {
    let py = python.display();
    if stderr.contains("No module named pip") {
        return format!(
            "the session's interpreter {py} has no pip, which ironcell uses to resolve and download wheels; install it there ({py} -m ensurepip, or your distribution's python3-pip) or start ironcell with a --python that has pip"
        );
    }
    let lines: Vec<&str> = stderr
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    let errors: Vec<&str> = lines
        .iter()
        .copied()
        .filter(|l| l.starts_with("ERROR:") || l.starts_with("Could not fetch URL"))
        .fold(Vec::new(), |mut v, l| {
            if !v.contains(&l) {
                v.push(l);
            }
            v
        });
    let detail = if errors.is_empty() {
        lines
            .iter()
            .rev()
            .take(3)
            .rev()
            .copied()
            .collect::<Vec<_>>()
            .join(" / ")
    } else {
        errors.join(" / ")
    };
    let detail = crate::clip_chars(&without_credentials(&detail), 1500);
    let unreachable = [
        "Read timed out",
        "timed out",
        "Connection refused",
        "Failed to establish a new connection",
        "Name or service not known",
        "Temporary failure in name resolution",
        "Network is unreachable",
        "ConnectTimeout",
    ];
    if unreachable.iter().any(|m| stderr.contains(m)) {
        return format!(
            "the package index could not be reached or did not answer within {SOCKET_TIMEOUT_S} s (offline, or the index hangs): {detail}. ironcell uses the index of your pip configuration (PIP_INDEX_URL, pip.conf) where it is started"
        );
    }
    if stderr.contains("No matching distribution found")
        || stderr.contains("Could not find a version that satisfies")
    {
        return format!(
            "no wheel for this interpreter satisfies the request: {detail}. ironcell installs wheels only (never builds a package from source): a package without a wheel for this Python and platform, or with a dependency that has none, must go into your own environment instead"
        );
    }
    if stderr.contains("THESE PACKAGES DO NOT MATCH THE HASHES") {
        return format!(
            "a downloaded file does not match the hash the package index gave for it, and was refused: {detail}"
        );
    }
    format!("pip failed: {detail}")
}

/// `url` with any `user:password@` removed (an index URL may carry credentials, which stay in
/// the host: they are never shown, audited or sent to a worker).
pub fn without_credentials(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find("://") {
        let (head, tail) = rest.split_at(at + 3);
        out.push_str(head);
        let end = tail
            .find(|c: char| c == '/' || c.is_whitespace() || c == '"' || c == '\'')
            .unwrap_or(tail.len());
        let authority = &tail[..end];
        match authority.rfind('@') {
            Some(i) => {
                out.push_str("***@");
                out.push_str(&authority[i + 1..]);
            }
            None => out.push_str(authority),
        }
        rest = &tail[end..];
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn credentials_never_leave_the_host() {
        assert_eq!(
            without_credentials("see https://user:s3cret@pypi.example/simple/x/ and http://h/y"),
            "see https://***@pypi.example/simple/x/ and http://h/y"
        );
    }

    #[test]
    fn a_report_becomes_a_plan_and_sdists_are_refused() {
        let sha = "a".repeat(64);
        let item = |url: &str| {
            json!({"install": [{"metadata": {"name": "x", "version": "1"}, "requested": true,
              "download_info": {"url": url, "archive_info": {"hashes": {"sha256": sha}}}}]})
        };
        let plan = parse_report(&item("https://t:pw@h/x-1-py3-none-any.whl"))
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(plan[0].filename, "x-1-py3-none-any.whl");
        assert_eq!(plan[0].url, "https://***@h/x-1-py3-none-any.whl");
        let e = parse_report(&item("https://h/x-1.tar.gz"))
            .err()
            .unwrap_or_default();
        assert!(e.contains("wheels only"), "{e}");
    }
}
