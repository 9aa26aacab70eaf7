//! A tool call's answer as the MCP client sees it: the listed tool, the result, the errors.

use super::*;

impl LocalTools {
    /// The MCP result of one call: the value (text, and `structuredContent` for tools with an
    /// output schema), or an `isError` result shaped like `run_python`'s.
    pub(super) fn tool_result(
        &self,
        tool: &LocalTool,
        mut record: RunRecord,
        envelope: Option<Value>,
    ) -> CallToolResult {
        let Some(env) = envelope else {
            return self.record_error(record, "the tool session gave no answer");
        };
        let message = env
            .get("message")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string();
        if env.get("ok") == Some(&Value::Bool(true)) {
            let value = env.get("value").cloned().unwrap_or(Value::Null);
            let mut content = vec![ContentBlock::text(value_text(&value))];
            let printed = printed_output(&record);
            if !printed.is_empty() {
                content.push(ContentBlock::text(printed));
            }
            let mut result = CallToolResult::success(content);
            if tool.output_schema.is_some() {
                result.structured_content = env.get("structured").cloned();
            }
            return result;
        }
        match env.get("kind").and_then(Value::as_str) {
            Some("validation") => {
                error_result(format!("invalid arguments for {}: {message}", tool.name))
            }
            Some("raised") => {
                record.status = RunStatus::Error;
                record.error = Some(crate::frame::PyErrorInfo {
                    kind: crate::clip_chars(
                        env.get("type").and_then(Value::as_str).unwrap_or("Error"),
                        256,
                    ),
                    message: crate::clip_chars(&message, 8192),
                    traceback: crate::clip_chars(
                        env.get("traceback").and_then(Value::as_str).unwrap_or(""),
                        16384,
                    ),
                });
                self.record_error(record, "")
            }
            _ => error_result(format!("the tool {} could not run: {message}", tool.name)),
        }
    }

    pub(super) fn record_error(&self, record: RunRecord, why: &str) -> CallToolResult {
        let mut text = record.render(self.output_mode);
        if !record.is_error() && !why.is_empty() {
            text = format!("error: {why}\n{text}");
        }
        let mut result = CallToolResult::error(vec![ContentBlock::text(text)]);
        result.structured_content = serde_json::to_value(&record).ok();
        result
    }
}

pub(super) fn to_mcp_tool(t: &LocalTool) -> Tool {
    let tool = Tool::new(
        t.name.clone(),
        t.description.clone(),
        Arc::new(t.input_schema.clone()),
    );
    match &t.output_schema {
        Some(o) => tool.with_raw_output_schema(Arc::new(o.clone())),
        None => tool,
    }
}

/// A tool's value as text: a string as it is, anything else as JSON.
pub(super) fn value_text(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        other => serde_json::to_string(other).unwrap_or_default(),
    }
}

/// What the tool printed, if anything, as one text block.
pub(super) fn printed_output(record: &RunRecord) -> String {
    let mut parts = Vec::new();
    if !record.stdout.trim().is_empty() {
        parts.push(format!("[printed]\n{}", record.stdout.trim_end()));
    }
    if !record.stderr.trim().is_empty() {
        parts.push(format!("[stderr]\n{}", record.stderr.trim_end()));
    }
    parts.join("\n")
}

pub(super) fn error_result(message: String) -> CallToolResult {
    CallToolResult::error(vec![ContentBlock::text(format!("error: {message}"))])
}
