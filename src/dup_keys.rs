//! Client messages whose objects name a key twice (SECURITY.md #296).
//!
//! JSON leaves a repeated key's meaning open, and parsers disagree: serde_json's maps, Python's
//! `json` and JavaScript's `JSON.parse` keep the last value, others the first, rmcp's typed
//! requests refuse some. A proxy, gateway or approval layer in front of ironcell that reads the
//! first `code` would show one program while the last one runs. A message is refused instead,
//! whatever the depth of the object that repeats a key.

use std::borrow::Cow;
use std::cell::RefCell;
use std::collections::BTreeSet;
use std::fmt;

use serde::Deserializer;
use serde::de::{self, DeserializeSeed, MapAccess, SeqAccess, Visitor};

/// A key found twice in one object.
#[derive(Debug, PartialEq, Eq)]
pub struct DuplicateKey {
    pub key: String,
    /// The repeated key belongs to the message itself, not to an object inside it.
    pub top_level: bool,
}

/// The first key that `json` names twice in one object (after escapes are decoded, so `"c"`
/// and `"\u0063"` are the same key), or `None` when every object's keys differ or `json` does
/// not parse (the caller's parse then says why).
pub fn duplicate_key(json: &[u8]) -> Option<DuplicateKey> {
    let found = RefCell::new(None);
    let mut de = serde_json::Deserializer::from_slice(json);
    let walked = Walk {
        depth: 0,
        found: &found,
    }
    .deserialize(&mut de);
    if walked.is_ok() {
        return None;
    }
    found.into_inner()
}

/// Visits every value of a document, keeping nothing but the keys of the object being read.
struct Walk<'a> {
    depth: usize,
    found: &'a RefCell<Option<DuplicateKey>>,
}

impl<'de> DeserializeSeed<'de> for Walk<'_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Walk<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_bool<E>(self, _: bool) -> Result<(), E> {
        Ok(())
    }
    fn visit_i64<E>(self, _: i64) -> Result<(), E> {
        Ok(())
    }
    fn visit_u64<E>(self, _: u64) -> Result<(), E> {
        Ok(())
    }
    fn visit_f64<E>(self, _: f64) -> Result<(), E> {
        Ok(())
    }
    fn visit_str<E>(self, _: &str) -> Result<(), E> {
        Ok(())
    }
    fn visit_unit<E>(self) -> Result<(), E> {
        Ok(())
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while seq
            .next_element_seed(Walk {
                depth: self.depth + 1,
                found: self.found,
            })?
            .is_some()
        {}
        Ok(())
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        // An ordered set: a hostile object of many keys costs n log n, never n².
        let mut keys: BTreeSet<Cow<'de, str>> = BTreeSet::new();
        while let Some(key) = map.next_key_seed(Key)? {
            map.next_value_seed(Walk {
                depth: self.depth + 1,
                found: self.found,
            })?;
            if keys.contains(&key) {
                *self.found.borrow_mut() = Some(DuplicateKey {
                    key: key.into_owned(),
                    top_level: self.depth == 0,
                });
                return Err(de::Error::custom("a key appears twice"));
            }
            keys.insert(key);
        }
        Ok(())
    }
}

/// An object's key, borrowed from the document unless it holds escapes.
struct Key;

impl<'de> DeserializeSeed<'de> for Key {
    type Value = Cow<'de, str>;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Self::Value, D::Error> {
        deserializer.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for Key {
    type Value = Cow<'de, str>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a key")
    }

    fn visit_borrowed_str<E>(self, s: &'de str) -> Result<Self::Value, E> {
        Ok(Cow::Borrowed(s))
    }

    fn visit_str<E>(self, s: &str) -> Result<Self::Value, E> {
        Ok(Cow::Owned(s.to_owned()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dup(json: &str) -> Option<(String, bool)> {
        duplicate_key(json.as_bytes()).map(|d| (d.key, d.top_level))
    }

    #[test]
    fn a_key_named_twice_is_found_at_any_depth_escaped_or_not() {
        assert_eq!(
            dup(r#"{"method":"ping","id":1,"method":"tools/call"}"#),
            Some(("method".into(), true))
        );
        assert_eq!(
            dup(r#"{"params":{"arguments":{"code":"1","\u0063ode":"2"}}}"#),
            Some(("code".into(), false))
        );
        assert_eq!(
            dup(r#"{"a":[1,{"x":{"y":[{"k":1,"k":2}]}}]}"#),
            Some(("k".into(), false))
        );
    }

    #[test]
    fn distinct_keys_and_unparsable_text_are_not_duplicates() {
        for json in [
            r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"run_python","arguments":{"code":"x = {'a': 1, 'a': 2}","session":"s"}}}"#,
            r#"{"a":{"k":1},"b":{"k":1},"k":[{"k":1},{"k":2}]}"#,
            r#"[{"k":1},{"k":1}]"#,
            r#"{"k":1,"k":"#,
            "not json",
        ] {
            assert_eq!(dup(json), None, "{json}");
        }
    }

    #[test]
    fn many_keys_are_walked_in_n_log_n() {
        let body: Vec<String> = (0..200_000).map(|i| format!("\"k{i}\":{i}")).collect();
        let json = format!("{{{},\"k7\":0}}", body.join(","));
        assert_eq!(dup(&json), Some(("k7".into(), true)));
    }
}
