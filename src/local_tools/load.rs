//! Loading the catalog: the tools files' tools in the tools session, each saved tool in a session
//! of its own, every schema checked before it is listed.

use super::*;

impl LocalTools {
    pub(super) async fn load_catalog(&self, generation: u64) -> Catalog {
        let mut catalog = Catalog {
            generation,
            files_generation: 0,
            load_failed: false,
            loaded_at: None,
            tools: Vec::new(),
            errors: self.path_errors.clone(),
        };
        // The files first: a saved tool cannot take a file tool's name. Nor while any of the
        // files, or any tool in them, could not be loaded (a file that raised or took too long
        // at import, a session that failed or was stopped, say by the free-disk guard, a
        // `--tools` path that is gone): the names they define are then unknown, so the saved
        // tools wait until every file loads, instead of being listed under names that may be
        // the user's.
        if self.has_tools_in(Home::Files) {
            let files = self
                .files_part_unless(&CancellationToken::new())
                .await
                .unwrap_or_default();
            catalog.files_generation = files.generation;
            catalog.tools.extend(files.tools.iter().cloned());
            catalog.errors.extend(files.errors.iter().cloned());
            catalog.load_failed = files.load_failed;
        }
        if self.has_tools_in(Home::Saved) {
            if catalog.load_failed || !catalog.errors.is_empty() {
                catalog.errors.push(LoadError {
                    file: self.saved_dir.display().to_string(),
                    line: None,
                    reason: "the saved tools are not listed while a tools file (or a tool in one) \
                             cannot be loaded: fix the errors above"
                        .into(),
                });
            } else {
                self.load_saved(&mut catalog).await;
            }
        }
        catalog
    }

    /// Adds the saved files' tools to `catalog`: each file's listing from before if the file
    /// is unchanged, else loaded now, for at most [`SAVED_LOAD_BUDGET`] in all (the files not
    /// reached are named, and the catalog is loaded again after [`RETRY_FAILED_LOAD`]).
    pub(super) async fn load_saved(&self, catalog: &mut Catalog) {
        let started = std::time::Instant::now();
        let mut kept = HashMap::new();
        let mut not_reached = 0usize;
        for file in sorted_saved_tool_files(&self.saved_dir) {
            let Some(key) = file_key(&file) else {
                continue; // deleted since it was listed
            };
            let cached = lock(&self.saved_loads)
                .get(&file)
                .filter(|l| l.key == key)
                .cloned();
            let load = match cached {
                Some(load) => load,
                None if started.elapsed() >= SAVED_LOAD_BUDGET => {
                    not_reached += 1;
                    continue;
                }
                None => {
                    let mut part = Catalog {
                        generation: catalog.generation,
                        ..Catalog::default()
                    };
                    self.load_saved_file(&file, &mut part).await;
                    SavedFileLoad {
                        key,
                        tools: part.tools,
                        errors: part.errors,
                    }
                }
            };
            for tool in load.tools.iter().cloned() {
                admit(catalog, tool);
            }
            catalog.errors.extend(load.errors.iter().cloned());
            kept.insert(file, load);
        }
        *lock(&self.saved_loads) = kept;
        if not_reached > 0 {
            catalog.errors.push(LoadError {
                file: self.saved_dir.display().to_string(),
                line: None,
                reason: format!(
                    "{not_reached} saved tools files were not loaded yet (loading the others took \
                     over {} s); they are listed once loaded",
                    SAVED_LOAD_BUDGET.as_secs()
                ),
            });
            catalog.load_failed = true;
        }
    }

    /// Loads one saved tools file in a fresh worker of its own session, granted only that file,
    /// for at most [`SAVED_LOAD_TIMEOUT`], and adds its tool to `catalog`; the worker is
    /// stopped after (a call starts another).
    pub(super) async fn load_saved_file(&self, file: &Path, catalog: &mut Catalog) {
        self.load_from(Some(file), catalog).await;
        if let Some(sessions) = self.sessions.upgrade() {
            sessions.stop_idle_worker(&session_of(Some(file))).await;
        }
    }

    /// Loads the tools of the `--tools` files, or of one saved file, in their session (a fresh
    /// interpreter per generation: modules re-import, and the grants are current) and adds
    /// them to `catalog`.
    ///
    /// Long on purpose: one load in its session (the run, then each answer's field checked), in the
    /// order they come.
    pub(super) async fn load_from(&self, saved_file: Option<&Path>, catalog: &mut Catalog) {
        let session = session_of(saved_file);
        let token = self.new_token();
        let spec = self.spec_for(saved_file, &token, catalog.generation);
        let answer = self
            .run_in_tools_session(
                &session,
                "_tools_catalog",
                &spec,
                &token,
                (true, saved_file.map(|_| SAVED_LOAD_TIMEOUT)),
                CancellationToken::new(),
                json!({"load": saved_file.map_or("the --tools files", |_| "a saved tool's file")}),
            )
            .await;
        let answer = match answer {
            Ok((_, Some(answer))) => answer,
            Ok((record, None)) => {
                catalog
                    .errors
                    .push(session_failure(&record.render(self.output_mode)));
                catalog.load_failed = true;
                return;
            }
            Err(why) => {
                catalog.errors.push(session_failure(&why));
                catalog.load_failed = true;
                return;
            }
        };
        if let Some(errors) = answer.get("errors").and_then(Value::as_array) {
            for e in errors.iter().take(MAX_LOAD_ERRORS) {
                catalog.errors.push(LoadError {
                    file: crate::clip_chars(
                        e.get("file").and_then(Value::as_str).unwrap_or("?"),
                        4096,
                    ),
                    line: e.get("line").and_then(Value::as_u64),
                    reason: crate::clip_chars(
                        e.get("reason").and_then(Value::as_str).unwrap_or("?"),
                        2048,
                    ),
                });
            }
        }
        let tools = answer.get("tools").and_then(Value::as_array);
        // A saved file is one tool, named after the file (`save_tool` writes it so); whatever
        // else its worker lists is its own code's claim, and the names of other files' tools
        // are not its to take (SECURITY.md #137).
        let own_name = saved_file.map(saved_stem);
        let mut listed_own = false;
        for t in tools.into_iter().flatten() {
            match checked_tool(t, saved_file) {
                Ok(tool) if own_name.is_some_and(|own| tool.name != own || listed_own) => {
                    catalog.errors.push(LoadError {
                        file: saved_file
                            .map(|f| f.display().to_string())
                            .unwrap_or_default(),
                        line: None,
                        reason: format!(
                            "a saved tools file holds one tool, named after the file ({:?}); {:?} \
                             is skipped",
                            own_name.unwrap_or_default(),
                            tool.name
                        ),
                    });
                }
                Ok(tool) => {
                    listed_own |= own_name.is_some();
                    admit(catalog, tool);
                }
                Err(why) => catalog.errors.push(LoadError {
                    file: crate::clip_chars(
                        t.get("file").and_then(Value::as_str).unwrap_or("?"),
                        4096,
                    ),
                    line: t.get("line").and_then(Value::as_u64),
                    reason: why,
                }),
            }
        }
    }
}

/// Adds `tool` to `catalog` unless its name is taken or the catalog is full (then says why).
pub(super) fn admit(catalog: &mut Catalog, tool: LocalTool) {
    if catalog.tools.iter().any(|x| x.name == tool.name) {
        catalog.errors.push(LoadError {
            file: String::new(),
            line: None,
            reason: format!(
                "tool {:?} is defined twice; the second is skipped",
                tool.name
            ),
        });
    } else if catalog.tools.len() < MAX_TOOLS {
        catalog.tools.push(tool);
    } else {
        catalog.errors.push(LoadError {
            file: String::new(),
            line: None,
            reason: format!("more than {MAX_TOOLS} tools; {:?} is skipped", tool.name),
        });
    }
}

pub(super) fn session_failure(why: &str) -> LoadError {
    LoadError {
        file: String::new(),
        line: None,
        reason: format!(
            "the tools session could not load the tools: {}",
            crate::clip_chars(why, 4096)
        ),
    }
}

/// Checks one tool of the catalog that the session of the `--tools` files, or of `saved_file`,
/// sent (it is untrusted data); the tool is run in that session.
pub(super) fn checked_tool(t: &Value, saved_file: Option<&Path>) -> Result<LocalTool, String> {
    let name = t.get("name").and_then(Value::as_str).unwrap_or("");
    if !valid_tool_name(name) {
        return Err(format!(
            "tool name {:?} is not usable: use a Python identifier of at most 64 ASCII characters, other than {}",
            crate::clip_chars(name, 80),
            RESERVED_NAMES.join(" and ")
        ));
    }
    let description = t.get("description").and_then(Value::as_str).unwrap_or("");
    let description = crate::clip_chars(
        description,
        if saved_file.is_some() {
            MAX_SAVED_DESCRIPTION_CHARS
        } else {
            MAX_DESCRIPTION_CHARS
        },
    );
    let schema = |key: &str| -> Result<Option<JsonObject>, String> {
        match t.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Object(o)) => {
                if o.get("type") != Some(&json!("object")) {
                    return Err(format!("tool {name}: its {key} is not an object schema"));
                }
                let size = serde_json::to_string(o)
                    .map(|s| s.len())
                    .unwrap_or(usize::MAX);
                if size > MAX_SCHEMA_BYTES {
                    return Err(format!(
                        "tool {name}: its {key} is {size} bytes; the limit is {MAX_SCHEMA_BYTES}"
                    ));
                }
                Ok(Some(o.clone()))
            }
            Some(_) => Err(format!("tool {name}: its {key} is not an object")),
        }
    };
    let input_schema =
        schema("inputSchema")?.ok_or_else(|| format!("tool {name} has no inputSchema"))?;
    let output_schema = schema("outputSchema")?;
    Ok(LocalTool {
        name: name.to_string(),
        description,
        input_schema,
        output_schema,
        saved_file: saved_file.map(Path::to_path_buf),
    })
}

/// The `--tools` entries as real paths, and why any cannot be used. A tools path may not
/// contain, or lie inside, the state dir (it is granted to the tools session).
pub(super) fn resolve_tool_paths(
    paths: &[PathBuf],
    state_dir: &Path,
) -> (Vec<PathBuf>, Vec<LoadError>) {
    let state = std::fs::canonicalize(state_dir).unwrap_or_else(|_| state_dir.to_path_buf());
    let mut ok = Vec::new();
    let mut errors = Vec::new();
    for p in paths {
        let shown = p.display().to_string();
        let fail = |reason: String| LoadError {
            file: shown.clone(),
            line: None,
            reason,
        };
        match std::fs::canonicalize(p) {
            Err(e) => errors.push(fail(format!(
                "{e}; give an existing .py file or folder with --tools (IRONCELL_TOOLS)"
            ))),
            Ok(real) if real == Path::new("/") => errors.push(fail(
                "is the root directory; give a file or a folder of tools".into(),
            )),
            Ok(real) if real.starts_with(&state) || state.starts_with(&real) => {
                errors.push(fail(format!(
                    "overlaps ironcell's state dir {}; keep tools elsewhere",
                    state.display()
                )))
            }
            Ok(real) if real.is_file() && real.extension().is_none_or(|e| e != "py") => {
                errors.push(fail("is not a .py file".into()))
            }
            Ok(real) => {
                if !ok.contains(&real) {
                    ok.push(real);
                }
            }
        }
    }
    (ok, errors)
}
