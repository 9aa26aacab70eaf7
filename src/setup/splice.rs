//! Putting one server entry into an MCP client's JSON config while leaving every other byte of
//! the file as it was: the new text is the old text with only the span of `mcpServers.<name>`
//! replaced (or inserted), found by a small scanner over the JSON text. The result is then
//! parsed again and checked: everything but that entry must be equal to what it was.

use serde_json::Value;

/// A member of a JSON object: its decoded key and where its key and value sit in the text.
struct Member {
    key: String,
    key_start: usize,
    value_start: usize,
    value_end: usize,
}

/// An object's members and the position of its closing brace.
struct Object {
    open: usize,
    close: usize,
    members: Vec<Member>,
}

fn skip_ws(b: &[u8], mut i: usize) -> usize {
    while i < b.len() && matches!(b[i], b' ' | b'\t' | b'\n' | b'\r') {
        i += 1;
    }
    i
}

/// End (exclusive) of the string starting at `i` (which is a `"`).
fn string_end(b: &[u8], mut i: usize) -> Result<usize, String> {
    i += 1;
    while i < b.len() {
        match b[i] {
            b'\\' => i += 2,
            b'"' => return Ok(i + 1),
            _ => i += 1,
        }
    }
    Err("unterminated string".into())
}

/// End (exclusive) of the JSON value starting at `i`.
fn value_end(b: &[u8], i: usize) -> Result<usize, String> {
    match b.get(i) {
        Some(b'"') => string_end(b, i),
        Some(b'{') | Some(b'[') => {
            let mut depth = 0usize;
            let mut j = i;
            while j < b.len() {
                match b[j] {
                    b'"' => {
                        j = string_end(b, j)?;
                        continue;
                    }
                    b'{' | b'[' => depth += 1,
                    b'}' | b']' => {
                        depth -= 1;
                        if depth == 0 {
                            return Ok(j + 1);
                        }
                    }
                    _ => {}
                }
                j += 1;
            }
            Err("unbalanced brackets".into())
        }
        Some(_) => {
            let mut j = i;
            while j < b.len() && !matches!(b[j], b',' | b'}' | b']' | b' ' | b'\t' | b'\n' | b'\r')
            {
                j += 1;
            }
            Ok(j)
        }
        None => Err("unexpected end of text".into()),
    }
}

/// Scans the object whose `{` is at `open`.
fn scan_object(text: &str, open: usize) -> Result<Object, String> {
    let b = text.as_bytes();
    let mut members = Vec::new();
    let mut i = skip_ws(b, open + 1);
    if b.get(i) == Some(&b'}') {
        return Ok(Object {
            open,
            close: i,
            members,
        });
    }
    loop {
        if b.get(i) != Some(&b'"') {
            return Err(format!("expected a key at byte {i}"));
        }
        let key_start = i;
        let key_end = string_end(b, i)?;
        let key: String =
            serde_json::from_str(&text[key_start..key_end]).map_err(|e| e.to_string())?;
        i = skip_ws(b, key_end);
        if b.get(i) != Some(&b':') {
            return Err(format!("expected `:` at byte {i}"));
        }
        let value_start = skip_ws(b, i + 1);
        let end = value_end(b, value_start)?;
        members.push(Member {
            key,
            key_start,
            value_start,
            value_end: end,
        });
        i = skip_ws(b, end);
        match b.get(i) {
            Some(b',') => i = skip_ws(b, i + 1),
            Some(b'}') => {
                return Ok(Object {
                    open,
                    close: i,
                    members,
                });
            }
            _ => return Err(format!("expected `,` or `}}` at byte {i}")),
        }
    }
}

/// The whitespace that starts the line holding byte `pos`.
fn line_indent(text: &str, pos: usize) -> &str {
    let line_start = text[..pos].rfind('\n').map(|n| n + 1).unwrap_or(0);
    let rest = &text[line_start..];
    let len = rest.len() - rest.trim_start_matches([' ', '\t']).len();
    &rest[..len]
}

/// The indentation one level inside the object `obj` (from its first member, else two spaces
/// more than the object's own line).
fn inner_indent(text: &str, obj: &Object) -> String {
    match obj.members.first() {
        Some(m) if text[obj.open..m.key_start].contains('\n') => {
            line_indent(text, m.key_start).to_string()
        }
        _ => format!("{}  ", line_indent(text, obj.open)),
    }
}

/// `value` pretty-printed, its continuation lines indented by `indent`.
fn render(value: &Value, indent: &str) -> String {
    let pretty = serde_json::to_string_pretty(value).unwrap_or_else(|_| value.to_string());
    pretty.replace('\n', &format!("\n{indent}"))
}

/// Inserts `"key": value` as the last member of `obj`.
fn insert_member(text: &str, obj: &Object, key: &str, value: &Value) -> String {
    let key_json = Value::String(key.to_string()).to_string();
    let indent = inner_indent(text, obj);
    let member = format!("{key_json}: {}", render(value, &indent));
    match obj.members.last() {
        Some(last) => format!(
            "{}{}\n{indent}{member}{}",
            &text[..last.value_end],
            ",",
            &text[last.value_end..]
        ),
        None => format!(
            "{}{{\n{indent}{member}\n{}}}{}",
            &text[..obj.open],
            line_indent(text, obj.open),
            &text[obj.close + 1..]
        ),
    }
}

/// Returns `text` with `mcpServers.<name>` set to `entry`; every other byte unchanged. An empty
/// `text` (a new file) becomes a small config with just this entry.
pub fn set_server_entry(text: &str, name: &str, entry: &Value) -> Result<String, String> {
    // Files written on Windows may start with a byte-order mark and use CRLF line ends: keep both.
    if let Some(rest) = text.strip_prefix('\u{feff}') {
        return set_server_entry(rest, name, entry).map(|t| format!("\u{feff}{t}"));
    }
    if text.contains("\r\n") && !text.replace("\r\n", "").contains('\n') {
        let lf = set_server_entry(&text.replace("\r\n", "\n"), name, entry)?;
        return Ok(lf.replace('\n', "\r\n"));
    }
    if text.trim().is_empty() {
        let doc = serde_json::json!({ "mcpServers": { name: entry } });
        return Ok(render(&doc, "") + "\n");
    }
    let before: Value =
        serde_json::from_str(text).map_err(|e| format!("the file is not valid JSON ({e})"))?;
    if !before.is_object() {
        return Err("the file's top level is not a JSON object".into());
    }
    let b = text.as_bytes();
    let top = scan_object(text, skip_ws(b, 0))?;
    let out = match top.members.iter().rev().find(|m| m.key == "mcpServers") {
        None => insert_member(
            text,
            &top,
            "mcpServers",
            &serde_json::json!({ name: entry }),
        ),
        Some(servers) => {
            if b.get(servers.value_start) != Some(&b'{') {
                return Err("its \"mcpServers\" is not an object".into());
            }
            let obj = scan_object(text, servers.value_start)?;
            match obj.members.iter().rev().find(|m| m.key == name) {
                Some(m) => format!(
                    "{}{}{}",
                    &text[..m.value_start],
                    render(entry, line_indent(text, m.key_start)),
                    &text[m.value_end..]
                ),
                None => insert_member(text, &obj, name, entry),
            }
        }
    };
    // The proof: parsed again, the file differs from before in this one entry only.
    let after: Value = serde_json::from_str(&out)
        .map_err(|e| format!("internal error: merged text is not JSON ({e})"))?;
    if after.pointer(&format!("/mcpServers/{}", pointer_escape(name))) != Some(entry)
        || without_entry(&after, name) != without_entry(&before, name)
    {
        return Err("internal error: merging would change more than the ironcell entry".into());
    }
    Ok(out)
}

fn pointer_escape(key: &str) -> String {
    key.replace('~', "~0").replace('/', "~1")
}

fn without_entry(doc: &Value, name: &str) -> Value {
    let mut d = doc.clone();
    if let Some(Value::Object(servers)) = d.get_mut("mcpServers") {
        servers.shift_remove(name);
        if servers.is_empty() {
            d.as_object_mut().map(|o| o.shift_remove("mcpServers"));
        }
    }
    d
}

/// A unified diff of `old` → `new` (one hunk: a splice changes one contiguous region).
pub fn unified_diff(old: &str, new: &str, path: &str) -> String {
    if old == new {
        return format!("(no change to {path})\n");
    }
    let a: Vec<&str> = old.lines().collect();
    let b: Vec<&str> = new.lines().collect();
    let prefix = a.iter().zip(&b).take_while(|(x, y)| x == y).count();
    let max_suffix = a.len().min(b.len()) - prefix;
    let suffix = a
        .iter()
        .rev()
        .zip(b.iter().rev())
        .take(max_suffix)
        .take_while(|(x, y)| x == y)
        .count();
    let ctx = 3;
    let start = prefix.saturating_sub(ctx);
    let a_end = (a.len() - suffix + ctx).min(a.len());
    let b_end = (b.len() - suffix + ctx).min(b.len());
    // A side with no lines in the hunk is numbered by the line before it.
    let at = |count: usize| if count == 0 { start } else { start + 1 };
    let mut out = format!(
        "--- {path}\n+++ {path} (with ironcell)\n@@ -{},{} +{},{} @@\n",
        at(a_end - start),
        a_end - start,
        at(b_end - start),
        b_end - start
    );
    for l in &a[start..prefix] {
        out.push_str(&format!(" {l}\n"));
    }
    for l in &a[prefix..a.len() - suffix] {
        out.push_str(&format!("-{l}\n"));
    }
    for l in &b[prefix..b.len() - suffix] {
        out.push_str(&format!("+{l}\n"));
    }
    for l in &a[a.len() - suffix..a_end] {
        out.push_str(&format!(" {l}\n"));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const EXISTING: &str = r#"{
    "globalShortcut": "Ctrl+Space",
    "mcpServers": {
        "git":   {"command": "uvx", "args": ["mcp-server-git"]},
        "files": {
            "command": "npx",
            "env": {"TOKEN": "s\u00e9cret"}
        }
    }
}
"#;

    #[test]
    fn adding_keeps_every_other_byte() {
        let e = json!({"command": "/usr/bin/ironcell", "args": ["serve"]});
        let out = set_server_entry(EXISTING, "ironcell", &e).unwrap();
        let cut = EXISTING.rfind("\n        }").unwrap() + "\n        }".len();
        assert!(out.starts_with(&EXISTING[..cut]), "{out}");
        assert!(out.ends_with(&EXISTING[cut..]), "{out}");
        let v: Value = serde_json::from_str(&out).unwrap();
        assert_eq!(v["mcpServers"]["ironcell"], e);
        assert!(out.contains("\n        \"ironcell\": {\n"), "{out}");
    }

    #[test]
    fn replacing_touches_only_the_entry_and_is_idempotent() {
        let e1 = json!({"command": "a"});
        let once = set_server_entry(EXISTING, "ironcell", &e1).unwrap();
        let e2 = json!({"command": "b", "args": ["serve"]});
        let twice = set_server_entry(&once, "ironcell", &e2).unwrap();
        let again = set_server_entry(&twice, "ironcell", &e2).unwrap();
        assert_eq!(twice, again);
        assert!(twice.starts_with(&once[..once.find("\"ironcell\"").unwrap()]));
    }

    #[test]
    fn new_files_empty_objects_and_missing_tables_work() {
        let e = json!({"command": "x"});
        for text in ["", "{}", "{\"other\": 1}", "{\"mcpServers\": {}}"] {
            let out = set_server_entry(text, "ironcell", &e).unwrap();
            let v: Value = serde_json::from_str(&out).unwrap();
            assert_eq!(v["mcpServers"]["ironcell"], e, "{text:?} -> {out}");
        }
        assert!(set_server_entry("[1]", "ironcell", &e).is_err());
        assert!(set_server_entry("{\"mcpServers\": 3}", "ironcell", &e).is_err());
        assert!(set_server_entry("{oops", "ironcell", &e).is_err());
    }

    #[test]
    fn windows_files_keep_their_bom_and_crlf_line_ends() {
        let text = format!("\u{feff}{}", EXISTING.replace('\n', "\r\n"));
        let out = set_server_entry(&text, "ironcell", &json!({"command": "x"})).unwrap();
        assert!(out.starts_with("\u{feff}{\r\n"));
        assert!(!out.replace("\r\n", "").contains('\n'), "{out:?}");
    }

    #[test]
    fn the_diff_shows_only_the_change_with_context() {
        let d = unified_diff("a\nb\nc\nd\n", "a\nb\nX\nd\n", "f");
        assert!(
            d.contains("-c\n+X\n") && d.contains(" b\n") && d.contains("@@ -1,4 +1,4 @@"),
            "{d}"
        );
    }
}
