//! Sandbox policy files (`sandbox-policy/*.toml`): parsing, validation, the embedded defaults.

use std::path::{Path, PathBuf};

use serde::Deserialize;

const DEFAULT_POLICY: &str = include_str!("../../sandbox-policy/default.toml");
const STRICT_POLICY: &str = include_str!("../../sandbox-policy/strict.toml");

/// A parsed, validated policy.
#[derive(Debug, Clone, Deserialize)]
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

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FilesystemPolicy {
    pub python_environment: bool,
    pub read_only: Vec<PathBuf>,
    pub read_write: Vec<PathBuf>,
}

#[derive(Debug, Clone, Deserialize)]
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
    #[error("cannot read policy file {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
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
}

impl Policy {
    /// `default`, `strict`, or a path to a TOML file.
    pub fn load(spec: &str) -> Result<Policy, PolicyError> {
        match spec {
            "default" => Policy::parse(DEFAULT_POLICY, "default (embedded)"),
            "strict" => Policy::parse(STRICT_POLICY, "strict (embedded)"),
            path => {
                let text = std::fs::read_to_string(path).map_err(|source| PolicyError::Read {
                    path: path.to_string(),
                    source,
                })?;
                Policy::parse(&text, path)
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
