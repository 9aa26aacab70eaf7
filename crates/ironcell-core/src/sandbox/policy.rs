//! Sandbox policy files (`sandbox-policy/*.toml`): parsing, validation, the embedded defaults.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

const DEFAULT_POLICY: &str = include_str!("../../../../sandbox-policy/default.toml");
const STRICT_POLICY: &str = include_str!("../../../../sandbox-policy/strict.toml");

/// A parsed, validated policy.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Policy {
    pub name: String,
    pub description: String,
    pub filesystem: FilesystemPolicy,
    pub limits: LimitsPolicy,
    /// Where the policy came from (an embedded name or a file path).
    #[serde(skip)]
    pub source: String,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct FilesystemPolicy {
    pub python_environment: bool,
    pub read_only: Vec<PathBuf>,
    pub read_write: Vec<PathBuf>,
    /// The user's folders (or files) code may read: `--allow-read`, or a policy overlay.
    /// Each must exist.
    #[serde(default)]
    pub allow_read: Vec<PathBuf>,
    /// The user's folders code may read and write: `--allow-write`, or a policy overlay.
    /// Each must be an existing directory.
    #[serde(default)]
    pub allow_write: Vec<PathBuf>,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct LimitsPolicy {
    pub cpu_seconds: u64,
    pub memory_mib: u64,
    pub file_size_mib: u64,
    pub open_files: u64,
    pub scratch_quota_mib: u64,
    /// RLIMIT_AS beyond `memory_mib`: room for what reserves address space without using
    /// memory (thread stacks, malloc arenas, extension modules). Bounds shared anonymous
    /// mappings, which RLIMIT_DATA does not count. Optional; older policy files get the default.
    #[serde(default = "default_address_space_headroom_mib")]
    pub address_space_headroom_mib: u64,
    /// Threads a worker may run at once (RLIMIT_NPROC; see `rlimits::thread_cap`). Optional;
    /// older policy files get the default.
    #[serde(default = "default_threads")]
    pub threads: u64,
}

fn default_address_space_headroom_mib() -> u64 {
    1024
}

fn default_threads() -> u64 {
    256
}

#[derive(Debug, thiserror::Error)]
pub enum PolicyError {
    #[error(
        "cannot read policy file {path}: {error}. IRONCELL_POLICY (--policy) takes `default`, \
         `strict`, or the path of a policy TOML file (see sandbox-policy/README.md)"
    )]
    Read { path: String, error: std::io::Error },
    #[error("policy {source_name}: {message}")]
    Parse {
        source_name: String,
        message: String,
    },
    #[error("policy {source_name}: `{key}` {problem}")]
    Invalid {
        source_name: String,
        key: String,
        problem: String,
    },
    #[error("cannot grant {flag} {path}: {problem}")]
    Grant {
        flag: String,
        path: String,
        problem: String,
    },
}

impl Policy {
    /// `default`, `strict`, or a path to a TOML file, which is an overlay: the keys it sets
    /// replace those of its base policy (`base = "default"` unless it says `"strict"`).
    pub fn load(spec: &str) -> Result<Policy, PolicyError> {
        match spec {
            "default" => Policy::parse(DEFAULT_POLICY, "default (embedded)"),
            "strict" => Policy::parse(STRICT_POLICY, "strict (embedded)"),
            path => {
                let text = std::fs::read_to_string(path).map_err(|error| PolicyError::Read {
                    path: path.to_string(),
                    error,
                })?;
                Policy::parse_overlay(&text, path)
            }
        }
    }

    pub fn parse(text: &str, source_name: &str) -> Result<Policy, PolicyError> {
        let mut policy: Policy = toml::from_str(text).map_err(|e| PolicyError::Parse {
            source_name: source_name.to_string(),
            message: e.to_string().trim().replace('\n', " "),
        })?;
        policy.source = source_name.to_string();
        policy.validate()?;
        Ok(policy)
    }

    fn validate(&self) -> Result<(), PolicyError> {
        let invalid = |key: &str, problem: String| PolicyError::Invalid {
            source_name: self.source.clone(),
            key: key.to_string(),
            problem,
        };
        let l = &self.limits;
        for (key, value, min, max) in [
            ("limits.cpu_seconds", l.cpu_seconds, 1, 7 * 86_400),
            ("limits.memory_mib", l.memory_mib, 64, 1 << 20),
            ("limits.file_size_mib", l.file_size_mib, 1, 1 << 20),
            ("limits.open_files", l.open_files, 32, 1 << 20),
            ("limits.scratch_quota_mib", l.scratch_quota_mib, 1, 1 << 24),
            (
                "limits.address_space_headroom_mib",
                l.address_space_headroom_mib,
                256,
                1 << 20,
            ),
            ("limits.threads", l.threads, 8, 65_536),
        ] {
            if !(min..=max).contains(&value) {
                return Err(invalid(
                    key,
                    format!("is {value}; it must be between {min} and {max}"),
                ));
            }
        }
        for (key, paths) in [
            ("filesystem.read_only", &self.filesystem.read_only),
            ("filesystem.read_write", &self.filesystem.read_write),
        ] {
            if let Some(p) = paths.iter().find(|p| !p.is_absolute()) {
                return Err(invalid(
                    key,
                    format!("has {:?}; paths must be absolute", p.display().to_string()),
                ));
            }
            if let Some(p) = paths.iter().find(|p| p.as_os_str() == "/") {
                return Err(invalid(
                    key,
                    format!(
                        "has {:?}; granting the whole filesystem defeats the sandbox",
                        p.display().to_string()
                    ),
                ));
            }
        }
        self.validate_grants(&invalid)?;
        if let Some(p) = self.filesystem.read_write.iter().find(|p| !p.is_dir()) {
            return Err(invalid(
                "filesystem.read_write",
                format!(
                    "has {:?}, which is not an existing directory",
                    p.display().to_string()
                ),
            ));
        }
        Ok(())
    }

    /// The read-only entries that exist on this machine.
    pub fn existing_read_only(&self) -> Vec<PathBuf> {
        self.filesystem
            .read_only
            .iter()
            .filter(|p| Path::new(p).exists())
            .cloned()
            .collect()
    }
}

// ---------------------------------------------------------------------------------------------
// Overlays and grants: a user's policy file states only what differs from its base, and the
// user's own folders are granted by `--allow-read` / `--allow-write` or `allow_*` keys.
// ---------------------------------------------------------------------------------------------

impl Policy {
    /// Parses a policy file as an overlay: every key it sets replaces the same key of its base
    /// policy (`base = "default"`, the default, or `"strict"`); tables merge key by key, lists
    /// are replaced whole. A key the base does not have, or a value of the wrong type, is an
    /// error naming the key. A complete policy file is an overlay that sets every key.
    pub fn parse_overlay(text: &str, source_name: &str) -> Result<Policy, PolicyError> {
        let parse_error = |message: String| PolicyError::Parse {
            source_name: source_name.to_string(),
            message: message.trim().replace('\n', " "),
        };
        let invalid = |key: &str, problem: String| PolicyError::Invalid {
            source_name: source_name.to_string(),
            key: key.to_string(),
            problem,
        };
        let mut overlay: toml::Table =
            toml::from_str(text).map_err(|e| parse_error(e.to_string()))?;
        let base_name = match overlay.remove("base") {
            None => "default".to_string(),
            Some(toml::Value::String(s)) if s == "default" || s == "strict" => s,
            Some(other) => {
                return Err(invalid(
                    "base",
                    format!(
                        "is {}; it must be \"default\" or \"strict\"",
                        toml_type(&other)
                    ),
                ));
            }
        };
        let base_text = if base_name == "strict" {
            STRICT_POLICY
        } else {
            DEFAULT_POLICY
        };
        let mut merged: toml::Table =
            toml::from_str(base_text).map_err(|e| parse_error(e.to_string()))?;
        merge_overlay_into(&mut merged, overlay, "", &invalid)?;
        let mut policy: Policy = toml::Value::Table(merged)
            .try_into()
            .map_err(|e: toml::de::Error| parse_error(e.to_string()))?;
        let home = std::env::var_os("HOME").map(PathBuf::from);
        for list in [
            &mut policy.filesystem.allow_read,
            &mut policy.filesystem.allow_write,
        ] {
            for p in list.iter_mut() {
                if let (Ok(rest), Some(h)) = (p.strip_prefix("~"), &home) {
                    *p = h.join(rest);
                }
            }
        }
        policy.source = format!("{source_name} (over {base_name})");
        policy.validate()?;
        Ok(policy)
    }

    fn validate_grants(
        &self,
        invalid: &dyn Fn(&str, String) -> PolicyError,
    ) -> Result<(), PolicyError> {
        let fs = &self.filesystem;
        for (key, paths, need_dir) in [
            ("filesystem.allow_read", &fs.allow_read, false),
            ("filesystem.allow_write", &fs.allow_write, true),
        ] {
            for p in paths {
                let shown = p.display().to_string();
                if !p.is_absolute() {
                    return Err(invalid(
                        key,
                        format!("has {shown:?}; paths must be absolute (or start with ~/)"),
                    ));
                }
                if p.as_os_str() == "/" {
                    return Err(invalid(
                        key,
                        format!("has {shown:?}; granting the whole filesystem defeats the sandbox"),
                    ));
                }
                let ok = if need_dir { p.is_dir() } else { p.exists() };
                if !ok {
                    let what = if need_dir {
                        "an existing directory"
                    } else {
                        "an existing file or directory"
                    };
                    return Err(invalid(key, format!("has {shown:?}, which is not {what}")));
                }
            }
        }
        Ok(())
    }

    /// Adds the command line's grants to the policy's own, resolves every grant to its real
    /// path (so a symlink cannot later point elsewhere), and refuses grants that would expose
    /// ironcell's own state: a grant may not contain, or lie inside, any of `state_dirs` (where
    /// every session's files live).
    pub fn add_grants(
        &mut self,
        read: &[PathBuf],
        write: &[PathBuf],
        state_dirs: &[PathBuf],
    ) -> Result<(), PolicyError> {
        let grant_error = |flag: &str, path: &Path, problem: String| PolicyError::Grant {
            flag: flag.to_string(),
            path: path.display().to_string(),
            problem,
        };
        let states: Vec<PathBuf> = state_dirs
            .iter()
            .map(|d| real_path_of_possibly_missing(d))
            .collect();
        let fs = &mut self.filesystem;
        for (flag, extra, list, need_dir) in [
            ("--allow-read", read, &mut fs.allow_read, false),
            ("--allow-write", write, &mut fs.allow_write, true),
        ] {
            let mut resolved = Vec::new();
            for p in list.iter().chain(extra) {
                let real = std::fs::canonicalize(p)
                    .map_err(|e| grant_error(flag, p, format!("{e}; give an existing folder")))?;
                if need_dir && !real.is_dir() {
                    return Err(grant_error(
                        flag,
                        p,
                        "is not a directory; only folders can be granted for writing".into(),
                    ));
                }
                if real == Path::new("/") {
                    return Err(grant_error(
                        flag,
                        p,
                        "is the root directory; granting the whole filesystem defeats the sandbox"
                            .into(),
                    ));
                }
                if let Some(s) = states
                    .iter()
                    .find(|s| s.starts_with(&real) || real.starts_with(s))
                {
                    return Err(grant_error(
                        flag,
                        p,
                        format!(
                            "overlaps ironcell's state dir {} (every session's files); grant a narrower folder, or move the state dir with MCP_BRIDGE_STATE_DIR",
                            s.display()
                        ),
                    ));
                }
                if !resolved.contains(&real) {
                    resolved.push(real);
                }
            }
            *list = resolved;
        }
        Ok(())
    }

    /// The effective policy as a TOML policy file (what `ironcell policy show` prints).
    pub fn to_toml(&self) -> String {
        let value = serde_json::to_value(self).unwrap_or_default();
        let mut out = String::new();
        let mut tables = Vec::new();
        if let serde_json::Value::Object(top) = value {
            for (k, v) in top {
                match v {
                    serde_json::Value::Object(t) => tables.push((k, t)),
                    v => out.push_str(&format!("{k} = {}\n", toml_scalar(&v))),
                }
            }
        }
        for (name, table) in tables {
            out.push_str(&format!("\n[{name}]\n"));
            for (k, v) in table {
                out.push_str(&format!("{k} = {}\n", toml_scalar(&v)));
            }
        }
        out
    }
}

/// A JSON scalar or list as TOML (strings as basic strings: JSON's escapes are TOML's).
fn toml_scalar(v: &serde_json::Value) -> String {
    match v {
        serde_json::Value::Array(items) if items.is_empty() => "[]".into(),
        serde_json::Value::Array(items) => {
            let inner: Vec<String> = items
                .iter()
                .map(|i| format!("  {},\n", toml_scalar(i)))
                .collect();
            format!("[\n{}]", inner.concat())
        }
        other => other.to_string(),
    }
}

/// The real path of `p`, or of its nearest existing ancestor joined with the rest.
fn real_path_of_possibly_missing(p: &Path) -> PathBuf {
    let mut missing = Vec::new();
    let mut cur = p.to_path_buf();
    loop {
        if let Ok(real) = std::fs::canonicalize(&cur) {
            return missing.iter().rev().fold(real, |acc, part| acc.join(part));
        }
        match (cur.file_name().map(|f| f.to_os_string()), cur.parent()) {
            (Some(name), Some(parent)) => {
                missing.push(name);
                cur = parent.to_path_buf();
            }
            _ => return p.to_path_buf(),
        }
    }
}

fn toml_type(v: &toml::Value) -> &'static str {
    match v {
        toml::Value::String(_) => "a string",
        toml::Value::Integer(_) => "an integer",
        toml::Value::Float(_) => "a number",
        toml::Value::Boolean(_) => "true or false",
        toml::Value::Datetime(_) => "a date",
        toml::Value::Array(_) => "a list",
        toml::Value::Table(_) => "a table",
    }
}

/// Merges `overlay` into `base` key by key; only keys `base` has, with values of its types.
fn merge_overlay_into(
    base: &mut toml::Table,
    overlay: toml::Table,
    prefix: &str,
    invalid: &dyn Fn(&str, String) -> PolicyError,
) -> Result<(), PolicyError> {
    for (k, v) in overlay {
        let key = if prefix.is_empty() {
            k.clone()
        } else {
            format!("{prefix}.{k}")
        };
        let Some(slot) = base.get_mut(&k) else {
            let known: Vec<&str> = base.keys().map(String::as_str).collect();
            return Err(invalid(
                &key,
                format!("is not a policy key; keys here are: {}", known.join(", ")),
            ));
        };
        match (slot, v) {
            (toml::Value::Table(b), toml::Value::Table(o)) => {
                merge_overlay_into(b, o, &key, invalid)?
            }
            (slot, v) if toml_type(slot) != toml_type(&v) => {
                return Err(invalid(
                    &key,
                    format!("is {}, but it must be {}", toml_type(&v), toml_type(slot)),
                ));
            }
            (toml::Value::Array(b), toml::Value::Array(o)) => {
                let want = b.first().map(toml_type).unwrap_or("a string");
                if let Some((i, bad)) = o.iter().enumerate().find(|(_, e)| toml_type(e) != want) {
                    return Err(invalid(
                        &format!("{key}[{i}]"),
                        format!("is {}, but it must be {want}", toml_type(bad)),
                    ));
                }
                *b = o;
            }
            (slot, v) => *slot = v,
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_embedded_policies_parse() {
        let d = Policy::load("default").unwrap();
        assert_eq!(d.limits.memory_mib, 1024);
        let s = Policy::load("strict").unwrap();
        assert!(s.limits.memory_mib < d.limits.memory_mib);
    }

    #[test]
    fn the_newer_limit_keys_are_optional() {
        let old = DEFAULT_POLICY
            .lines()
            .filter(|l| !l.starts_with("threads") && !l.starts_with("address_space_headroom_mib"))
            .collect::<Vec<_>>()
            .join("\n");
        let p = Policy::parse(&old, "old.toml").unwrap();
        assert_eq!(p.limits.threads, default_threads());
        assert_eq!(
            p.limits.address_space_headroom_mib,
            default_address_space_headroom_mib()
        );
        let bad = DEFAULT_POLICY.replace("threads = 256", "threads = 1");
        let e = Policy::parse(&bad, "t.toml").unwrap_err().to_string();
        assert!(e.contains("`limits.threads` is 1"), "{e}");
    }

    #[test]
    fn errors_name_the_key_and_the_problem() {
        let bad_value = DEFAULT_POLICY.replace("memory_mib = 1024", "memory_mib = 0");
        let e = Policy::parse(&bad_value, "t.toml").unwrap_err().to_string();
        assert!(e.contains("`limits.memory_mib` is 0"), "{e}");

        let unknown =
            DEFAULT_POLICY.replace("open_files = 1024", "open_files = 1024\nnetwork = true");
        let e = Policy::parse(&unknown, "t.toml").unwrap_err().to_string();
        assert!(e.contains("network") && e.contains("t.toml"), "{e}");

        let missing = DEFAULT_POLICY.replace("cpu_seconds = 3600\n", "");
        let e = Policy::parse(&missing, "t.toml").unwrap_err().to_string();
        assert!(e.contains("cpu_seconds"), "{e}");

        let relative = DEFAULT_POLICY.replace("\"/etc/localtime\",", "\"etc/localtime\",");
        let e = Policy::parse(&relative, "t.toml").unwrap_err().to_string();
        assert!(
            e.contains("filesystem.read_only") && e.contains("absolute"),
            "{e}"
        );

        let wrong_type =
            DEFAULT_POLICY.replace("python_environment = true", "python_environment = \"yes\"");
        let e = Policy::parse(&wrong_type, "t.toml")
            .unwrap_err()
            .to_string();
        assert!(e.contains("python_environment"), "{e}");
    }
}
