//! `runtime.search_tool_docs`: rank tools of every server against a free-text query.
//!
//! Cheap and predictable rather than clever: the query is split into words; each word scores
//! against the tool's name words (best), the server's name, and the description, with exact,
//! prefix, substring and one-typo matches weighted in that order. The score is normalized to
//! 0..1 so callers can threshold it.

use serde::Serialize;

/// Longest query accepted, in characters. A query is a few keywords; a megabyte one would only
/// cost time (each word is scored against every word of every tool).
pub const MAX_QUERY_CHARS: usize = 1000;
/// Most distinct words of a query that are scored.
const MAX_QUERY_WORDS: usize = 32;

/// Refuses a query longer than [`MAX_QUERY_CHARS`], with a message that says what to do.
pub fn check_query(query: &str) -> Result<(), String> {
    let n = query.chars().count();
    if n > MAX_QUERY_CHARS {
        return Err(format!(
            "the search query is {n} characters; the limit is {MAX_QUERY_CHARS}. Search with a few keywords"
        ));
    }
    Ok(())
}

/// One searchable tool, split into words once (when its server's tool list is fetched).
pub struct Indexed {
    server: String,
    tool: String,
    summary: String,
    tool_words: Vec<String>,
    server_words: Vec<String>,
    desc_words: Vec<String>,
}

impl Indexed {
    pub fn new(server: &str, tool: &str, description: &str) -> Indexed {
        Indexed {
            server: server.to_string(),
            tool: tool.to_string(),
            summary: summary_of(description),
            tool_words: words(tool),
            server_words: words(server),
            desc_words: words(description),
        }
    }
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Hit {
    pub server: String,
    pub tool: String,
    pub description: String,
    pub score: f64,
}

fn words(s: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut prev_lower = false;
    for c in s.chars() {
        if c.is_alphanumeric() {
            // split camelCase too: createIssue -> create, issue
            if c.is_uppercase() && prev_lower && !cur.is_empty() {
                out.push(std::mem::take(&mut cur));
            }
            prev_lower = c.is_lowercase();
            cur.extend(c.to_lowercase());
        } else {
            prev_lower = false;
            if !cur.is_empty() {
                out.push(std::mem::take(&mut cur));
            }
        }
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    out
}

/// At most one insertion, deletion or substitution apart (for words of 4+ letters).
fn one_typo(a: &str, b: &str) -> bool {
    // Bytes are exact for ASCII and merely conservative for other scripts.
    let (a, b) = (a.as_bytes(), b.as_bytes());
    if a.len() < 4 || b.len() < 4 || a.len().abs_diff(b.len()) > 1 {
        return false;
    }
    let (mut i, mut j, mut edits) = (0, 0, 0);
    while i < a.len() && j < b.len() {
        if a[i] == b[j] {
            i += 1;
            j += 1;
            continue;
        }
        edits += 1;
        if edits > 1 {
            return false;
        }
        match a.len().cmp(&b.len()) {
            std::cmp::Ordering::Greater => i += 1,
            std::cmp::Ordering::Less => j += 1,
            std::cmp::Ordering::Equal => {
                i += 1;
                j += 1;
            }
        }
    }
    edits + (a.len() - i) + (b.len() - j) <= 1
}

fn word_score(q: &str, candidates: &[String]) -> f64 {
    let mut best: f64 = 0.0;
    for c in candidates {
        let s = if c == q {
            1.0
        } else if c.starts_with(q) || q.starts_with(c.as_str()) && c.len() >= 3 {
            0.8
        } else if c.contains(q) && q.len() >= 3 {
            0.6
        } else if one_typo(q, c) {
            0.5
        } else {
            0.0
        };
        best = best.max(s);
    }
    best
}

/// The first paragraph of a description, at most 240 characters: enough to choose a tool.
fn summary_of(description: &str) -> String {
    let first = description
        .trim()
        .split("\n\n")
        .next()
        .unwrap_or_default()
        .trim();
    if first.chars().count() <= 240 {
        return first.to_string();
    }
    let cut: String = first.chars().take(239).collect();
    format!("{cut}…")
}

/// The `limit` best tools for `query`, best first; tools that match nothing are left out.
pub fn search<'a>(
    entries: impl IntoIterator<Item = &'a Indexed>,
    query: &str,
    limit: usize,
) -> Vec<Hit> {
    let mut q = words(query);
    let mut seen = std::collections::HashSet::new();
    q.retain(|w| seen.insert(w.clone()));
    q.truncate(MAX_QUERY_WORDS);
    if q.is_empty() {
        return Vec::new();
    }
    let mut scored: Vec<(f64, &Indexed)> = entries
        .into_iter()
        .filter_map(|e| {
            let total: f64 = q
                .iter()
                .map(|w| {
                    word_score(w, &e.tool_words)
                        .max(word_score(w, &e.server_words) * 0.7)
                        .max(word_score(w, &e.desc_words) * 0.6)
                })
                .sum();
            let score = total / q.len() as f64;
            (score > 0.0).then_some((score, e))
        })
        .collect();
    scored.sort_by(|a, b| {
        b.0.total_cmp(&a.0)
            .then_with(|| a.1.tool.len().cmp(&b.1.tool.len()))
    });
    scored
        .into_iter()
        .take(limit)
        .map(|(score, e)| Hit {
            server: e.server.clone(),
            tool: e.tool.clone(),
            description: e.summary.clone(),
            score: (score * 1000.0).round() / 1000.0,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn e(server: &str, tool: &str, description: &str) -> Indexed {
        Indexed::new(server, tool, description)
    }

    #[test]
    fn the_obvious_tool_ranks_first() {
        let entries = [
            e(
                "github",
                "create_issue",
                "Create a new issue in a repository",
            ),
            e("github", "list_issues", "List issues in a repository"),
            e(
                "filesystem",
                "read_file",
                "Read the complete contents of a file",
            ),
            e(
                "memory",
                "create_entities",
                "Create multiple new entities in the knowledge graph",
            ),
            e("everything", "get-sum", "Returns the sum of two numbers"),
        ];
        let hits = search(&entries, "create issue", 3);
        assert_eq!(hits[0].tool, "create_issue");
        assert_eq!(hits[0].score, 1.0);
        assert_eq!(search(&entries, "read file", 1)[0].tool, "read_file");
        assert_eq!(search(&entries, "sum", 1)[0].tool, "get-sum");
        assert_eq!(search(&entries, "isue", 1)[0].tool, "create_issue");
        assert!(search(&entries, "zzzz", 5).is_empty());
        assert_eq!(
            search(&entries, "createEntities", 1)[0].tool,
            "create_entities"
        );
    }

    #[test]
    fn a_megabyte_query_is_refused_and_a_long_one_is_cheap() {
        assert!(check_query("create issue").is_ok());
        let huge = "word ".repeat(200_000);
        let err = check_query(&huge).unwrap_err();
        assert!(
            err.contains("1000000 characters") && err.contains("limit is 1000"),
            "{err}"
        );
        // Even unchecked, repeated words are scored once and the word count is capped.
        let entries = [e("github", "create_issue", "Create a new issue")];
        let hits = search(&entries, &"issue ".repeat(10_000), 1);
        assert_eq!(hits[0].tool, "create_issue");
    }

    #[test]
    fn typo_matching_is_one_edit_only() {
        assert!(one_typo("issue", "isue"));
        assert!(one_typo("files", "filez"));
        assert!(!one_typo("issue", "tissues"));
        assert!(!one_typo("abc", "abd"));
    }
}
