//! Memory: small JSON values that agent code saves with `save_memory(key, value)` and reads back
//! with `load_memory(key)` in any later session, after restarts too (the bridge's API).
//!
//! The worker is hostile, so it never touches these files: it sends `memory.*` requests over its
//! session socket and the host does the I/O, in `<state dir>/memory/`, which no sandbox grants.
//! File names are derived by the host from the key (hex of its UTF-8 bytes), never taken from
//! the worker; keys, values and the whole store are size-capped. One store per ironcell user
//! (the state dir is per user).

use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use ironcell_core::bridge::{BridgeError, MemoryRequest};
use serde_json::{Value, json};

/// Longest key, in bytes of UTF-8.
pub const MAX_KEY_BYTES: usize = 100;
/// Largest stored entry (value and metadata, as JSON).
pub const MAX_ENTRY_BYTES: usize = 1 << 20;
/// Largest store, all entries together.
pub const MAX_STORE_BYTES: u64 = 32 << 20;
/// Most entries.
pub const MAX_ENTRIES: usize = 4096;
/// Largest metadata of one entry, as JSON: tags and notes, listed with every key.
pub const MAX_METADATA_BYTES: usize = 4096;
/// Most metadata one `list` answer carries, as JSON; entries past it are listed without theirs.
const MAX_LISTED_METADATA_BYTES: usize = 1 << 20;

pub struct MemoryStore {
    dir: PathBuf,
    /// Serializes writers, so the caps hold across concurrent sessions, and readers: a value
    /// parsed into a `Value` takes many times its size as JSON, so one read at a time bounds what
    /// concurrent requests can make the host hold.
    lock: Mutex<()>,
}

/// What `list` reads of an entry: the stored value is skipped unparsed, the metadata is kept as
/// text until its size is known.
#[derive(serde::Deserialize)]
struct ListedEntry {
    key: String,
    #[serde(default)]
    metadata: Option<Box<serde_json::value::RawValue>>,
    #[serde(default)]
    created_at: Value,
    #[serde(default)]
    updated_at: Value,
}

/// A refused request: becomes `ValueError` (bad key/value) or `MCPError` in Python.
type Refusal = BridgeError;

fn bad(message: String) -> Refusal {
    BridgeError::bad_request(message)
}

fn io_failure(what: &str, e: std::io::Error) -> Refusal {
    BridgeError::unavailable(format!("memory store: {what}: {e}"))
}

impl MemoryStore {
    pub fn new(state_dir: &Path) -> MemoryStore {
        MemoryStore {
            dir: state_dir.join("memory"),
            lock: Mutex::new(()),
        }
    }

    /// Answers one `memory.<op>` request.
    pub fn handle(&self, request: MemoryRequest) -> Result<Value, BridgeError> {
        match request {
            MemoryRequest::Save {
                key,
                value,
                metadata,
            } => self.save(key, value, metadata),
            MemoryRequest::Load { key } => self.load(key),
            MemoryRequest::Delete { key } => self.delete(key),
            MemoryRequest::List => self.list(),
        }
    }

    fn path_for(&self, key: String) -> Result<(String, PathBuf), Refusal> {
        if key.is_empty() || key.len() > MAX_KEY_BYTES {
            return Err(bad(format!(
                "a memory key must be 1 to {MAX_KEY_BYTES} bytes long (got {})",
                key.len()
            )));
        }
        if key.chars().any(char::is_control) {
            return Err(bad("a memory key cannot contain control characters".into()));
        }
        let name: String = key.bytes().map(|b| format!("{b:02x}")).collect();
        Ok((key, self.dir.join(format!("{name}.json"))))
    }

    fn ensure_dir(&self) -> Result<(), Refusal> {
        use std::os::unix::fs::DirBuilderExt;
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&self.dir)
            .map_err(|e| io_failure(&format!("creating {}", self.dir.display()), e))
    }

    /// Entries (path, size) in the store; only names this module could have made.
    fn entries(&self) -> Vec<(PathBuf, u64)> {
        let Ok(rd) = std::fs::read_dir(&self.dir) else {
            return Vec::new();
        };
        rd.flatten()
            .filter(|e| {
                e.file_name().to_str().is_some_and(|n| {
                    n.strip_suffix(".json")
                        .is_some_and(|h| !h.is_empty() && h.bytes().all(|b| b.is_ascii_hexdigit()))
                })
            })
            .filter_map(|e| {
                let meta = e.metadata().ok()?;
                meta.is_file().then(|| (e.path(), meta.len()))
            })
            .collect()
    }

    /// An entry's key, metadata (as text) and times, its value skipped unparsed.
    fn read_listed(path: &Path) -> Option<ListedEntry> {
        let text = std::fs::read_to_string(path).ok()?;
        serde_json::from_str(&text).ok()
    }

    fn read_entry(path: &Path) -> Option<Value> {
        let text = std::fs::read_to_string(path).ok()?;
        serde_json::from_str(&text).ok()
    }

    fn save(&self, key: String, value: Value, metadata: Value) -> Result<Value, Refusal> {
        let (key, path) = self.path_for(key)?;
        let metadata = match metadata {
            Value::Null => json!({}),
            m @ Value::Object(_) => m,
            _ => return Err(bad("memory metadata must be a dict".into())),
        };
        let metadata_bytes = serde_json::to_vec(&metadata).map_or(0, |v| v.len());
        if metadata_bytes > MAX_METADATA_BYTES {
            return Err(bad(format!(
                "the metadata of memory {key:?} is {metadata_bytes} bytes as JSON; the limit is \
                 {MAX_METADATA_BYTES} bytes (keep large data in the value)"
            )));
        }
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs_f64())
            .unwrap_or(0.0);
        let _guard = crate::lock(&self.lock);
        self.ensure_dir()?;
        let created = Self::read_listed(&path)
            .map(|e| e.created_at)
            .filter(|c| !c.is_null())
            .unwrap_or(json!(now));
        let entry = json!({"key": key, "value": value, "metadata": metadata,
                           "created_at": created, "updated_at": now});
        let text = serde_json::to_string(&entry).map_err(|e| bad(e.to_string()))?;
        if text.len() > MAX_ENTRY_BYTES {
            return Err(bad(format!(
                "memory {key:?} is {} bytes as JSON; the limit per entry is {MAX_ENTRY_BYTES} bytes",
                text.len()
            )));
        }
        let entries = self.entries();
        let existing = entries.iter().find(|(p, _)| *p == path).map(|(_, s)| *s);
        if existing.is_none() && entries.len() >= MAX_ENTRIES {
            return Err(bad(format!(
                "the memory store holds {MAX_ENTRIES} entries, its limit; delete_memory() some first"
            )));
        }
        let total: u64 = entries.iter().map(|(_, s)| *s).sum::<u64>() - existing.unwrap_or(0);
        if total + text.len() as u64 > MAX_STORE_BYTES {
            return Err(bad(format!(
                "the memory store would exceed {} MiB; delete_memory() some entries first",
                MAX_STORE_BYTES >> 20
            )));
        }
        // Written beside and renamed over, so a reader never sees half an entry.
        let tmp = self.dir.join(format!(".write-{}", std::process::id()));
        std::fs::write(&tmp, text.as_bytes()).map_err(|e| io_failure("writing", e))?;
        std::fs::rename(&tmp, &path).map_err(|e| io_failure("renaming", e))?;
        Ok(json!({"key": key, "created_at": created, "updated_at": now}))
    }

    fn load(&self, key: String) -> Result<Value, Refusal> {
        let (_, path) = self.path_for(key)?;
        let _guard = crate::lock(&self.lock);
        Ok(match Self::read_entry(&path) {
            Some(entry) => json!({"found": true, "entry": entry}),
            None => json!({"found": false}),
        })
    }

    fn delete(&self, key: String) -> Result<Value, Refusal> {
        let (_, path) = self.path_for(key)?;
        let _guard = crate::lock(&self.lock);
        match std::fs::remove_file(&path) {
            Ok(()) => Ok(json!({"deleted": true})),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(json!({"deleted": false})),
            Err(e) => Err(io_failure("deleting", e)),
        }
    }

    fn list(&self) -> Result<Value, Refusal> {
        let _guard = crate::lock(&self.lock);
        let mut listed: Vec<(ListedEntry, u64)> = self
            .entries()
            .into_iter()
            .filter_map(|(p, size)| Some((Self::read_listed(&p)?, size)))
            .collect();
        listed.sort_by(|a, b| a.0.key.cmp(&b.0.key));
        let mut metadata_budget = MAX_LISTED_METADATA_BYTES;
        let out = listed
            .into_iter()
            .map(|(e, size)| {
                let raw = e.metadata.as_deref().map_or("{}", |m| m.get());
                let mut item = json!({"key": e.key, "metadata": {}, "created_at": e.created_at,
                                      "updated_at": e.updated_at, "bytes": size});
                // Entries saved before metadata was capped may carry more: listed without it
                // (load_memory still returns it), so no list grows past the budget.
                if raw.len() <= MAX_METADATA_BYTES && raw.len() <= metadata_budget {
                    metadata_budget -= raw.len();
                    item["metadata"] = serde_json::from_str(raw).unwrap_or_else(|_| json!({}));
                } else {
                    item["metadata_omitted_bytes"] = json!(raw.len());
                }
                item
            })
            .collect();
        Ok(Value::Array(out))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The payload a worker gets for `method` and `params`, parsed as the host parses them.
    fn ask(s: &MemoryStore, method: &str, params: Value) -> Value {
        use ironcell_core::bridge::{Request, answer_payload};
        answer_payload(Request::parse(method, params).and_then(|r| match r {
            Request::Memory(m) => s.handle(m),
            other => panic!("not a memory request: {other:?}"),
        }))
    }

    fn store(name: &str) -> MemoryStore {
        let d = std::env::temp_dir().join(format!("ironcell-mem-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        MemoryStore::new(&d)
    }

    #[test]
    fn values_round_trip_and_keys_never_become_paths() {
        let s = store("rt");
        for key in ["../../etc/passwd", "a/b", "ключ", ".."] {
            let r = ask(
                &s,
                "memory.save",
                json!({"key": key, "value": {"n": [1, 2]}}),
            );
            assert!(r.get("result").is_some(), "{r}");
            let r = ask(&s, "memory.load", json!({"key": key}));
            assert_eq!(r["result"]["entry"]["value"], json!({"n": [1, 2]}), "{r}");
        }
        for (p, _) in s.entries() {
            assert_eq!(p.parent(), Some(s.dir.as_path()));
        }
        assert_eq!(
            ask(&s, "memory.list", json!({}))["result"]
                .as_array()
                .unwrap()
                .len(),
            4
        );
        assert_eq!(
            ask(&s, "memory.delete", json!({"key": "a/b"}))["result"]["deleted"],
            true
        );
        assert_eq!(
            ask(&s, "memory.load", json!({"key": "a/b"}))["result"]["found"],
            false
        );
    }

    #[test]
    fn metadata_is_capped_and_a_list_carries_only_small_metadata() {
        let s = store("meta");
        let big = json!({"a": vec![0; MAX_METADATA_BYTES]});
        let r = ask(
            &s,
            "memory.save",
            json!({"key": "k", "value": 1, "metadata": big}),
        );
        assert!(
            r["error"]["message"].as_str().unwrap().contains("metadata"),
            "{r}"
        );
        let r = ask(
            &s,
            "memory.save",
            json!({"key": "k", "value": [1, 2], "metadata": {"tag": "x"}}),
        );
        assert!(r.get("result").is_some(), "{r}");
        // An entry written before the cap (or by hand) with 1 MB of metadata: listed without it,
        // loaded whole.
        let legacy = json!({"key": "old", "value": 0, "metadata": {"a": vec![0; 500_000]},
                            "created_at": 1.0, "updated_at": 1.0});
        std::fs::write(s.dir.join("6f6c64.json"), legacy.to_string()).unwrap();
        let list = ask(&s, "memory.list", json!({}));
        let items = list["result"].as_array().unwrap();
        assert_eq!(items.len(), 2, "{list}");
        assert_eq!(items[0]["key"], "k");
        assert_eq!(items[0]["metadata"], json!({"tag": "x"}));
        assert_eq!(items[1]["key"], "old");
        assert_eq!(items[1]["metadata"], json!({}));
        assert!(items[1]["metadata_omitted_bytes"].as_u64().unwrap() > 1_000_000);
        assert!(
            list.to_string().len() < 4096,
            "the list stays small: {}",
            list.to_string().len()
        );
        let r = ask(&s, "memory.load", json!({"key": "old"}));
        assert_eq!(
            r["result"]["entry"]["metadata"]["a"]
                .as_array()
                .unwrap()
                .len(),
            500_000
        );
    }

    #[test]
    fn bad_keys_and_oversized_values_are_refused() {
        let s = store("bad");
        for key in [json!(""), json!("x".repeat(101)), json!("a\nb"), json!(3)] {
            let r = ask(&s, "memory.save", json!({"key": key, "value": 1}));
            assert_eq!(r["error"]["kind"], "bad_request", "{r}");
        }
        let big = "x".repeat(MAX_ENTRY_BYTES);
        let r = ask(&s, "memory.save", json!({"key": "big", "value": big}));
        assert!(
            r["error"]["message"].as_str().unwrap().contains("limit"),
            "{r}"
        );
    }
}
