//! The local tools' side of the bridge: `tools.*` requests from workers (a call, the list, a
//! save or delete of a saved tool, and the tools sessions' answers).

use super::*;

impl LocalTools {
    /// Answers one `tools.<op>` bridge request of the worker of session `from`.
    pub async fn handle(
        &self,
        from: &str,
        request: ToolsRequest,
        cancel: CancellationToken,
    ) -> Result<Value, BridgeError> {
        let from_tools = is_reserved_session(from);
        let bad = |message: &str| Err(BridgeError::bad_request(message));
        match request {
            ToolsRequest::Answer { .. } if !from_tools => bad("only the tools session answers"),
            ToolsRequest::Answer { token, answer, .. } => self
                .accept_answer(from, &token, answer)
                .map(|()| Value::Null),
            ToolsRequest::List | ToolsRequest::Call { .. } if from_tools => {
                bad("inside a tool, call other tools as plain functions")
            }
            ToolsRequest::List => self.list_for_code(&cancel).await,
            ToolsRequest::Call { name, arguments } => {
                self.call_for_code(from, &name, arguments, cancel).await
            }
            ToolsRequest::Save { .. } | ToolsRequest::Delete { .. } if from_tools => bad(
                "a tool cannot save or delete tools (its save would reload the tools, which runs it \
                 again); do it from a run_python session",
            ),
            ToolsRequest::Save { name, source } => {
                self.save_for_code(from, name, source, &cancel).await
            }
            ToolsRequest::Delete { name } => self.delete_for_code(from, &name),
        }
    }

    /// `tools.list`: the tools code can call, with their origin.
    async fn list_for_code(&self, cancel: &CancellationToken) -> Result<Value, BridgeError> {
        let catalog = if self.listed.load(Ordering::SeqCst) {
            self.ensure_catalog_unless(cancel).await.ok_or_else(gone)?
        } else {
            Arc::new(Catalog {
                errors: self.path_errors.clone(),
                ..Catalog::default()
            })
        };
        let tools: Vec<Value> = catalog
            .tools
            .iter()
            .map(|t| {
                let mut v = json!({
                    "name": t.name,
                    "description": t.description,
                    "inputSchema": t.input_schema,
                    "origin": t.home().origin(),
                });
                if let Some(o) = &t.output_schema {
                    v["outputSchema"] = Value::Object(o.clone());
                }
                v
            })
            .collect();
        Ok(json!({"tools": tools, "errors": catalog.errors}))
    }

    /// `tools.call`: runs the tool in its session, for code of session `from`; its value, or
    /// the error the code raises.
    async fn call_for_code(
        &self,
        from: &str,
        name: &str,
        arguments: Value,
        cancel: CancellationToken,
    ) -> Result<Value, BridgeError> {
        if !arguments.is_object() {
            return Err(BridgeError::bad_request("the arguments must be a dict"));
        }
        let found = if self.listed.load(Ordering::SeqCst) {
            self.find_tool_unless(name, &cancel)
                .await
                .ok_or_else(gone)?
        } else {
            Err(Arc::new(Catalog::default()))
        };
        let tool = match found {
            Ok(tool) => tool,
            Err(catalog) => {
                let names: Vec<&str> = catalog.tools.iter().map(|t| &*t.name).collect();
                let names = if names.is_empty() {
                    "(none)".to_string()
                } else {
                    names.join(", ")
                };
                let message = format!("no local tool {name:?}; tools: {names}");
                return Err(BridgeError::new(ErrorKind::UnknownTool, message));
            }
        };
        let (record, envelope) = self
            .invoke(&tool, arguments, cancel, &format!("session {from:?}"))
            .await
            .map_err(BridgeError::unavailable)?;
        let Some(env) = envelope else {
            return Err(BridgeError::unavailable(record.render(self.output_mode)));
        };
        if env.get("ok") == Some(&Value::Bool(true)) {
            return Ok(env.get("value").cloned().unwrap_or(Value::Null));
        }
        let message = env.get("message").and_then(Value::as_str).unwrap_or("");
        match env.get("kind").and_then(Value::as_str) {
            Some("validation") => Err(BridgeError::bad_request(format!(
                "invalid arguments for {name}: {message}"
            ))),
            Some("raised") => {
                let kind = env.get("type").and_then(Value::as_str).unwrap_or("Error");
                let tb = env.get("traceback").and_then(Value::as_str).unwrap_or("");
                Err(BridgeError::new(
                    ErrorKind::Refused,
                    format!("{name} raised {kind}: {message}\n{tb}"),
                ))
            }
            _ => Err(BridgeError::unavailable(message)),
        }
    }

    /// `tools.save` from session `from`. The user's tools keep their names: a saved tool of the
    /// same name would never be listed (asked of the files' tools, waiting for a load of them
    /// in progress).
    async fn save_for_code(
        &self,
        from: &str,
        name: Option<String>,
        source: Option<String>,
        cancel: &CancellationToken,
    ) -> Result<Value, BridgeError> {
        let shown = name.as_deref().unwrap_or("");
        if !self.paths.is_empty()
            && self
                .files_part_unless(cancel)
                .await
                .ok_or_else(gone)?
                .tools
                .iter()
                .any(|t| *t.name == *shown)
        {
            return Err(BridgeError::bad_request(format!(
                "a tool named {shown:?} comes from the tools files; choose another name"
            )));
        }
        let message = self.save(from, name, source)?;
        Ok(json!({ "message": message }))
    }

    /// `tools.delete` of a saved tool, by the session that saved it.
    fn delete_for_code(&self, from: &str, name: &str) -> Result<Value, BridgeError> {
        if !valid_tool_name(name) {
            return Err(BridgeError::bad_request(format!("no saved tool {name:?}")));
        }
        let _saving = lock(&SAVING);
        if self.saved_dir.join(format!("{name}.py")).is_file() {
            self.check_owner(from, name, "delete")?;
        }
        match std::fs::remove_file(self.saved_dir.join(format!("{name}.py"))) {
            Ok(()) => {
                let _ = std::fs::remove_file(owner_file(&self.saved_dir, name));
                self.list_changed();
                Ok(json!({"message": format!("Tool {name:?} deleted.")}))
            }
            Err(_) => Err(BridgeError::bad_request(format!("no saved tool {name:?}"))),
        }
    }

    /// Takes an answer of the tools session `from` for a token the host is waiting for from it.
    pub(super) fn accept_answer(
        &self,
        from: &str,
        token: &str,
        answer: Value,
    ) -> Result<(), BridgeError> {
        let size = answer.to_string().len();
        let mut inbox = lock(&self.inbox);
        let Some((session, slot)) = inbox.get_mut(token) else {
            return Err(BridgeError::new(
                ErrorKind::BadRequest,
                "no answer is expected under that token".into(),
            ));
        };
        if session != from {
            return Err(BridgeError::new(
                ErrorKind::BadRequest,
                "no answer is expected from this session under that token".into(),
            ));
        }
        if slot.is_some() {
            return Err(BridgeError::new(
                ErrorKind::BadRequest,
                "that token was already answered".into(),
            ));
        }
        if size > MAX_ANSWER_BYTES {
            let note = format!(
                "the answer is {size} bytes; the limit is {} MiB: return less (or write it to a file)",
                MAX_ANSWER_BYTES >> 20
            );
            *slot = Some(
                json!({"envelope": {"ok": false, "kind": "raised", "type": "ValueError", "message": note, "traceback": ""}, "tools": [], "errors": [{"file": "", "reason": note}]}),
            );
            return Err(BridgeError::new(ErrorKind::BadRequest, note));
        }
        *slot = Some(answer);
        Ok(())
    }

    /// Refuses a session's `what` (replace, delete) of a saved tool another session saved.
    pub(super) fn check_owner(
        &self,
        from: &str,
        name: &str,
        what: &str,
    ) -> Result<(), BridgeError> {
        let owner = owner_of(&self.saved_dir, name);
        if owner.as_deref() == Some(from) {
            return Ok(());
        }
        let file = self.saved_dir.join(format!("{name}.py"));
        Err(BridgeError::new(
            ErrorKind::Refused,
            format!(
                "the saved tool {name:?} belongs to {}; a session may only {what} the tools it saved. Choose another name, or ask the user to remove it (`ironcell saved-tools delete {name}`, or delete {} on the host)",
                match owner {
                    Some(_) => "another session".to_string(),
                    None => "no session (it was saved before tools had owners)".to_string(),
                },
                file.display()
            ),
        ))
    }

    /// Writes a saved tool (`<state dir>/tools/<name>.py`) owned by session `from`, and
    /// announces the new list.
    pub(super) fn save(
        &self,
        from: &str,
        name: Option<String>,
        source: Option<String>,
    ) -> Result<String, BridgeError> {
        let bad = |m: String| BridgeError::new(ErrorKind::BadRequest, m);
        let name = name.ok_or_else(|| bad("a tool name must be a string".into()))?;
        let name = name.as_str();
        if !valid_tool_name(name) {
            return Err(bad(format!(
                "invalid tool name {name:?}: use a Python identifier of at most 64 ASCII letters, digits and '_', other than {}",
                RESERVED_NAMES.join(" and ")
            )));
        }
        let source = source.ok_or_else(|| bad("the tool's source must be a string".into()))?;
        if source.len() > MAX_SAVED_TOOL_BYTES {
            return Err(bad(format!(
                "the tool's source is {} bytes; the limit is {MAX_SAVED_TOOL_BYTES}",
                source.len()
            )));
        }
        let target = format!("{name}.py");
        let _saving = lock(&SAVING);
        let existing = saved_tool_files(&self.saved_dir).count();
        let replacing = self.saved_dir.join(&target).is_file();
        if replacing {
            self.check_owner(from, name, "replace")?;
        }
        if !replacing && existing >= MAX_SAVED_TOOLS {
            return Err(bad(format!(
                "there are already {existing} saved tools (the limit); delete some first"
            )));
        }
        let failed = |e: std::io::Error| {
            BridgeError::new(
                ErrorKind::Unavailable,
                format!("saving the tool failed: {e}"),
            )
        };
        // The owner first: a tool file is never without one.
        if !replacing {
            write_saved_tool(&self.saved_dir, &format!(".{name}.owner"), from.as_bytes())
                .map_err(failed)?;
        }
        write_saved_tool(&self.saved_dir, &target, source.as_bytes()).map_err(failed)?;
        self.listed.store(true, Ordering::SeqCst);
        self.list_changed();
        Ok(format!(
            "Tool {name:?} saved: it is an MCP tool from now on (also after restarts), run in the sandbox."
        ))
    }
}

/// Answers a `tools.<op>` bridge request of the worker of session `from` (an error where no
/// local tools exist, e.g. `ironcell exec`). Boxed: a call runs a cell in the tools session,
/// whose run loop is what spawns this future.
pub fn handle_request(
    tools: Option<Arc<LocalTools>>,
    from: String,
    request: ToolsRequest,
    cancel: CancellationToken,
) -> futures::future::BoxFuture<'static, Result<Value, BridgeError>> {
    Box::pin(async move {
        match tools {
            Some(t) => t.handle(&from, request, cancel).await,
            None => Err(BridgeError::unavailable(
                "local tools are only available under `ironcell serve`",
            )),
        }
    })
}

/// The error of a request whose worker went while it waited (nobody reads it).
pub(super) fn gone() -> BridgeError {
    BridgeError::new(ErrorKind::Unavailable, "the caller is gone".into())
}
