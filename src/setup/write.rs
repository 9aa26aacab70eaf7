//! Writing one client config: the diff shown (and confirmed in a terminal), ironcell's entry
//! merged with what the user had in it, the file replaced through a rename, with a backup.

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{Context, anyhow, bail};
use serde_json::{Value, json};

use super::{SetupArgs, Target, splice};
use crate::config::Settings;

/// Writes (or, in a dry run, shows) one target.
pub(super) fn apply(t: &Target, args: &SetupArgs, interactive: bool) -> anyhow::Result<()> {
    println!("== {}", t.label);
    let Some(path) = &t.path else {
        let snippet = json!({"mcpServers": {args.name.clone(): t.entry.clone()}});
        println!("{}", serde_json::to_string_pretty(&snippet)?);
        println!("{}\n", t.check);
        return Ok(());
    };
    let old = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
        Err(e) => bail!("cannot read {}: {e}", path.display()),
    };
    let (entry, carried) = match existing_entry(&old, &args.name) {
        Some(existing) => merge_entry(&existing, &t.entry),
        None => (t.entry.clone(), Vec::new()),
    };
    let entry = if args.replace { t.entry.clone() } else { entry };
    if !carried.is_empty() {
        if args.replace {
            println!(
                "--replace: dropping what the existing {:?} entry had and this run does not give: {}",
                args.name,
                carried.join(", ")
            );
        } else {
            println!(
                "kept from the existing {:?} entry (this run does not give them; --replace drops them): {}",
                args.name,
                carried.join(", ")
            );
        }
    }
    let new = splice::set_server_entry(&old, &args.name, &entry).map_err(|e| {
        anyhow!(
            "not changing {}: {e}. Fix the file (or move it away) and run setup again",
            path.display()
        )
    })?;
    let shown = path.display().to_string();
    if args.dry_run {
        println!("dry run: would write {shown}");
        print!("{}", splice::unified_diff(&old, &new, &shown));
        println!("{}\n", t.check);
        return Ok(());
    }
    if old == new {
        println!(
            "{shown} already has this entry; nothing to do.\n{}\n",
            t.check
        );
        return Ok(());
    }
    if interactive {
        print!("{}", splice::unified_diff(&old, &new, &shown));
        print!("Write {shown}? [y/N] ");
        std::io::stdout().flush()?;
        let mut answer = String::new();
        std::io::stdin().read_line(&mut answer)?;
        if !matches!(answer.trim(), "y" | "Y" | "yes") {
            println!("left unchanged.\n");
            return Ok(());
        }
    }
    let backup = write_with_backup(path, &old, &new)?;
    match backup {
        Some(b) => println!("wrote {shown} (the previous version is in {})", b.display()),
        None => println!("wrote {shown} (new file)"),
    }
    println!("{}\n", t.check);
    Ok(())
}

/// The entry `name` of the config `text`, if it has one.
fn existing_entry(text: &str, name: &str) -> Option<Value> {
    let doc: Value = serde_json::from_str(text.strip_prefix('\u{feff}').unwrap_or(text)).ok()?;
    doc.get("mcpServers")?.get(name).cloned()
}

/// A `serve` flag of an entry: `--name value` (or `--name=value`), or a lone word.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Word {
    Flag(String, Option<String>),
    Other(String),
}

/// What follows `serve` in `args`, read as flags (`None` without a `serve`).
fn serve_words(args: &[Value]) -> Option<Vec<Word>> {
    let args: Vec<&str> = args.iter().filter_map(Value::as_str).collect();
    let start = args.iter().position(|a| *a == "serve")? + 1;
    let mut out = Vec::new();
    let mut i = start;
    while i < args.len() {
        let a = args[i];
        match a.strip_prefix("--") {
            Some(flag) if !flag.is_empty() => match flag.split_once('=') {
                Some((k, v)) => out.push(Word::Flag(k.into(), Some(v.into()))),
                None => {
                    let value = args.get(i + 1).filter(|v| !v.starts_with("--"));
                    out.push(Word::Flag(flag.into(), value.map(|v| v.to_string())));
                    i += usize::from(value.is_some());
                }
            },
            _ => out.push(Word::Other(a.into())),
        }
        i += 1;
    }
    Some(out)
}

/// The `serve` flags that may be given more than once (`--allow-read`, `--tools`, …).
fn repeatable_flags() -> Vec<String> {
    let defs = <Settings as clap::Args>::augment_args(clap::Command::new("settings"));
    defs.get_arguments()
        .filter(|a| matches!(a.get_action(), clap::ArgAction::Append))
        .filter_map(|a| a.get_long().map(str::to_string))
        .collect()
}

/// `new` with what `old` (the entry already in the file) has and `new` does not: its `serve`
/// flags that `new` does not set (a repeatable flag's other values too) and its `env`
/// variables that `new` does not set. Also returns those, as words for the user.
fn merge_entry(old: &Value, new: &Value) -> (Value, Vec<String>) {
    let empty = Vec::new();
    let old_args = old.get("args").and_then(Value::as_array).unwrap_or(&empty);
    let new_args = new.get("args").and_then(Value::as_array).unwrap_or(&empty);
    let mut merged = new.clone();
    let mut carried = Vec::new();
    if let (Some(old_words), Some(new_words)) = (serve_words(old_args), serve_words(new_args)) {
        let repeatable = repeatable_flags();
        let set_by_new = |k: &str| {
            new_words
                .iter()
                .any(|w| matches!(w, Word::Flag(n, _) if n == k))
        };
        let mut args = new_args.clone();
        for w in old_words {
            let keep = match &w {
                Word::Flag(k, _) if repeatable.contains(k) => !new_words.contains(&w),
                Word::Flag(k, _) => !set_by_new(k),
                Word::Other(_) => !new_words.contains(&w),
            };
            if !keep {
                continue;
            }
            let shown = match &w {
                Word::Flag(k, Some(v)) => {
                    args.push(json!(format!("--{k}")));
                    args.push(json!(v));
                    format!("--{k} {v}")
                }
                Word::Flag(k, None) => {
                    args.push(json!(format!("--{k}")));
                    format!("--{k}")
                }
                Word::Other(o) => {
                    args.push(json!(o));
                    o.clone()
                }
            };
            carried.push(shown);
        }
        merged["args"] = Value::Array(args);
    }
    if let Some(old_env) = old.get("env").and_then(Value::as_object) {
        let mut env = new
            .get("env")
            .and_then(Value::as_object)
            .cloned()
            .unwrap_or_default();
        for (k, v) in old_env {
            if !env.contains_key(k) {
                env.insert(k.clone(), v.clone());
                carried.push(format!("env {k}"));
            }
        }
        if !env.is_empty() || merged.get("env").is_some() {
            merged["env"] = Value::Object(env);
        }
    }
    (merged, carried)
}

/// Backups of a config kept beside it (the newest; older ones setup made are removed).
const BACKUPS_KEPT: usize = 3;

/// Writes `new` to `path` through a temporary file and a rename, after copying the current
/// file beside it as `<name>.bak-<UTC timestamp>`; both keep the file's mode (a private
/// `~/.claude.json` stays 0600), and only the newest [`BACKUPS_KEPT`] backups are kept.
/// Returns the backup's path.
fn write_with_backup(path: &Path, old: &str, new: &str) -> anyhow::Result<Option<PathBuf>> {
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    // The file's mode, or for a new file what the umask gives.
    let mode = std::fs::metadata(path)
        .ok()
        .map(|m| std::os::unix::fs::PermissionsExt::mode(&m.permissions()) & 0o7777);
    let mut backup = None;
    if let Some(mode) = mode {
        // Several runs in one second: `-<n>` past the highest taken (a lower one may be free
        // because it was the oldest and removed, and would then sort as older than it is).
        let stamp = utc_stamp();
        let mut b = dir.join(format!("{name}.bak-{stamp}"));
        let mut n = 1;
        while b.exists() {
            b = dir.join(format!("{name}.bak-{stamp}-{n}"));
            n += 1;
        }
        let same_second = format!("{name}.bak-{stamp}-");
        let highest = std::fs::read_dir(dir)
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| {
                let file = e.file_name();
                file.to_str()?
                    .strip_prefix(&same_second)?
                    .parse::<u64>()
                    .ok()
            })
            .max();
        if let Some(h) = highest {
            b = dir.join(format!("{name}.bak-{stamp}-{}", h + 1));
        }
        write_private(&b, old, mode)
            .with_context(|| format!("writing the backup {}", b.display()))?;
        backup = Some(b);
        remove_old_backups(dir, &name);
    }
    let tmp = dir.join(format!(".{name}.ironcell-{}", std::process::id()));
    let written = match mode {
        Some(mode) => write_private(&tmp, new, mode),
        None => std::fs::write(&tmp, new),
    };
    written.with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("replacing {}", path.display()))?;
    Ok(backup)
}

/// Creates `path` (it must not exist) with mode 0600 — so no one else can open it while it is
/// written — writes `text`, then gives it `mode`.
fn write_private(path: &Path, text: &str, mode: u32) -> std::io::Result<()> {
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)?;
    f.write_all(text.as_bytes())?;
    f.sync_all()?;
    f.set_permissions(std::fs::Permissions::from_mode(mode))
}

/// Removes all but the newest [`BACKUPS_KEPT`] of `<name>.bak-<stamp>` in `dir` (the stamp
/// sorts by time).
fn remove_old_backups(dir: &Path, name: &str) {
    let prefix = format!("{name}.bak-");
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let mut backups: Vec<(String, PathBuf)> = entries
        .flatten()
        .filter_map(|e| {
            let file = e.file_name().to_str()?.to_string();
            let stamp = file.strip_prefix(&prefix)?;
            // Only setup's own names: `YYYYMMDDTHHMMSSZ`, maybe `-<n>`.
            let ours = stamp.len() >= 16
                && stamp.as_bytes()[8] == b'T'
                && stamp.as_bytes()[15] == b'Z'
                && stamp[..8].bytes().all(|b| b.is_ascii_digit());
            ours.then(|| (stamp_key(stamp), e.path()))
        })
        .collect();
    backups.sort();
    let excess = backups.len().saturating_sub(BACKUPS_KEPT);
    for (_, old) in backups.into_iter().take(excess) {
        let _ = std::fs::remove_file(old);
    }
}

/// A backup's stamp as a key that sorts by age: `…Z-10` after `…Z-9`.
fn stamp_key(stamp: &str) -> String {
    match stamp.split_once('-') {
        Some((t, n)) => format!("{t}-{n:0>6}"),
        None => format!("{t}-{:0>6}", "", t = stamp),
    }
}

/// Now, as `YYYYMMDDTHHMMSSZ`.
fn utc_stamp() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let (days, rem) = ((secs / 86_400) as i64, secs % 86_400);
    // Howard Hinnant's days-to-civil.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}{m:02}{d:02}T{:02}{:02}{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}
