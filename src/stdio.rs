//! The stdio transport between the MCP client and rmcp: newline-delimited JSON-RPC with an answer
//! for every line.
//!
//! rmcp's own stdio transport drops input it cannot parse, so a client whose request was not
//! valid JSON (bad UTF-8, a number out of range, nesting past the parser's depth, an oversized
//! line) waits forever for an answer. This transport reads each line with a length cap, parses it
//! itself, and answers what it cannot hand to rmcp:
//!
//! - not JSON at all, or a line over the cap: `-32700 Parse error`, id `null` (it cannot be read);
//! - JSON that is not a request, response or notification: `-32600 Invalid Request`, with the id
//!   when one can be read, else `null`;
//! - a request (method and id) whose params do not fit the method: `-32602 Invalid params`,
//!   with its id.
//!
//! A malformed *notification* (a method, no id) gets no answer: JSON-RPC forbids replying to
//! notifications. Every write to stdout, rmcp's and these error answers alike, goes through the
//! one writer behind [`StdioTransport::send`], one whole line at a time, so lines never
//! interleave. The server keeps serving after each bad line.

use std::borrow::Cow;
use std::sync::Arc;

use rmcp::RoleServer;
use rmcp::model::{
    CallToolRequest, ClientJsonRpcMessage, ClientNotification, ClientRequest, ClientResult,
    JsonRpcMessage, JsonRpcRequest, ServerJsonRpcMessage,
};
use rmcp::transport::Transport;
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::sync::Mutex;

/// Default cap on one incoming line. Must stay well above `IRONCELL_MAX_CODE` after JSON
/// escaping, so an oversized `code` argument still reaches the tool and gets its clear refusal.
pub const DEFAULT_MAX_LINE_BYTES: usize = 64 << 20;

const PARSE_ERROR: i64 = -32700;
const INVALID_REQUEST: i64 = -32600;
const INVALID_PARAMS: i64 = -32602;

type Writer<W> = Arc<Mutex<Option<W>>>;

/// Newline-delimited JSON-RPC over a reader and a writer (stdin and stdout in `serve`).
pub struct StdioTransport<R, W> {
    read: BufReader<R>,
    line: Vec<u8>,
    max_line: usize,
    /// Set after an oversized line was rejected, until its newline is seen. Kept on the struct
    /// because `receive` runs inside rmcp's `select!` and can be dropped mid-line.
    discarding: bool,
    writer: Writer<W>,
    /// Shown each whole line before it is parsed ([`StdioTransport::with_line_hook`]).
    on_line: Option<LineHook>,
}

/// What [`StdioTransport::with_line_hook`] takes.
pub type LineHook = Box<dyn Fn(&[u8]) + Send + Sync>;

enum LineRead {
    Line,
    Oversized,
    Eof,
    Io(std::io::Error),
}

impl<R, W> StdioTransport<R, W>
where
    R: AsyncRead + Unpin + Send,
    W: AsyncWrite + Unpin + Send + 'static,
{
    pub fn new(read: R, write: W, max_line: usize) -> Self {
        StdioTransport {
            read: BufReader::new(read),
            line: Vec::new(),
            max_line,
            discarding: false,
            writer: Arc::new(Mutex::new(Some(write))),
            on_line: None,
        }
    }

    /// `hook` sees each whole line as soon as it is read, before it is parsed (the server warms
    /// the worker a request will run on: `SessionManager::warm_for_request`). It must not wait.
    pub fn with_line_hook(mut self, hook: LineHook) -> Self {
        self.on_line = Some(hook);
        self
    }

    /// Reads one `\n`-terminated line into `self.line`, never letting it grow past the cap.
    /// Cancel-safe: a partial line stays in `self.line` for the next call.
    async fn read_line(&mut self) -> LineRead {
        loop {
            let available = match self.read.fill_buf().await {
                Ok(a) => a,
                Err(e) => return LineRead::Io(e),
            };
            if available.is_empty() {
                return LineRead::Eof;
            }
            let newline = available.iter().position(|b| *b == b'\n');
            let take = newline.map_or(available.len(), |i| i + 1);
            let mut outcome = None;
            if self.discarding {
                if newline.is_some() {
                    self.discarding = false;
                }
            } else if self.line.len().saturating_add(take) > self.max_line + 1 {
                self.line.clear();
                self.discarding = newline.is_none();
                outcome = Some(LineRead::Oversized);
            } else {
                self.line.extend_from_slice(&available[..take]);
                if newline.is_some() {
                    outcome = Some(LineRead::Line);
                }
            }
            self.read.consume(take);
            if let Some(o) = outcome {
                return o;
            }
        }
    }

    /// Writes one error answer through the shared writer, off the receive path (so a cancelled
    /// `receive` can never leave half a line on stdout).
    fn answer(&self, id: Value, code: i64, message: String) {
        let body = json!({"jsonrpc": "2.0", "id": id, "error": {"code": code, "message": message}});
        let writer = self.writer.clone();
        tokio::spawn(async move {
            if let Err(e) = write_line(&writer, &body).await {
                tracing::warn!("cannot write an error answer to stdout: {e}");
            }
        });
    }
}

async fn write_line<W: AsyncWrite + Unpin>(
    writer: &Writer<W>,
    msg: &impl serde::Serialize,
) -> std::io::Result<()> {
    let mut bytes = serde_json::to_vec(msg).map_err(std::io::Error::other)?;
    bytes.push(b'\n');
    let mut guard = writer.lock().await;
    let Some(w) = guard.as_mut() else {
        return Err(std::io::Error::new(
            std::io::ErrorKind::NotConnected,
            "stdout is closed",
        ));
    };
    w.write_all(&bytes).await?;
    w.flush().await
}

/// stdin and stdout for `serve`. When they are pipes or sockets (how MCP clients launch
/// servers) they are made non-blocking and driven by the async runtime itself through epoll:
/// tokio's own stdin and stdout hand every read and every write to a blocking thread, a thread
/// hop each way for every message. A terminal or a file keeps tokio's (a terminal's flags are
/// shared with the shell, and files cannot be polled).
pub fn std_streams() -> (
    Box<dyn AsyncRead + Unpin + Send>,
    Box<dyn AsyncWrite + Unpin + Send>,
) {
    use tokio::net::unix::pipe;
    let reader: Box<dyn AsyncRead + Unpin + Send> = match pollable_stream(libc::STDIN_FILENO)
        .and_then(|f| pipe::Receiver::from_file_unchecked(f).ok())
    {
        Some(r) => Box::new(r),
        None => Box::new(tokio::io::stdin()),
    };
    let writer: Box<dyn AsyncWrite + Unpin + Send> = match pollable_stream(libc::STDOUT_FILENO)
        .and_then(|f| pipe::Sender::from_file_unchecked(f).ok())
    {
        Some(w) => Box::new(w),
        None => Box::new(tokio::io::stdout()),
    };
    (reader, writer)
}

/// A non-blocking duplicate of `fd` if it is a pipe or a socket.
fn pollable_stream(fd: std::os::fd::RawFd) -> Option<std::fs::File> {
    use nix::fcntl::{FcntlArg, OFlag, fcntl};
    use std::os::fd::BorrowedFd;
    // SAFETY: fds 0 and 1 stay open for the whole life of the process.
    let fd = unsafe { BorrowedFd::borrow_raw(fd) };
    let st = nix::sys::stat::fstat(fd).ok()?;
    let kind = st.st_mode & libc::S_IFMT;
    if kind != libc::S_IFIFO && kind != libc::S_IFSOCK {
        return None;
    }
    let dup = fd.try_clone_to_owned().ok()?;
    let flags = OFlag::from_bits_truncate(fcntl(&dup, FcntlArg::F_GETFL).ok()?);
    fcntl(&dup, FcntlArg::F_SETFL(flags | OFlag::O_NONBLOCK)).ok()?;
    Some(std::fs::File::from(dup))
}

/// What a line that is not a usable message gets.
#[derive(Debug, PartialEq)]
pub struct Refusal {
    /// `None` for a malformed notification: it is logged, never answered.
    pub id: Option<Value>,
    pub code: i64,
    pub message: String,
}

/// A client message whose requests can only be `tools/call`.
type ToolsCallMessage = JsonRpcMessage<CallToolRequest, ClientResult, ClientNotification>;

/// Parses a line as a `tools/call` request (or a response or notification), as rmcp would, but
/// without trying the other methods first: rmcp's `ClientRequest` is an untagged union that tries
/// its 13 variants before `tools/call` one by one, each failing with a formatted error (under
/// callgrind ~30,000 of the host's ~200,000 instructions per warm call). The variants before it
/// each take one fixed method name, so a line that parses here parses to the same message there.
/// `None` for anything else, which then takes rmcp's whole union.
fn parse_as_tools_call(line: &[u8]) -> Option<ClientJsonRpcMessage> {
    Some(
        match serde_json::from_slice::<ToolsCallMessage>(line).ok()? {
            JsonRpcMessage::Request(r) => JsonRpcMessage::Request(JsonRpcRequest {
                jsonrpc: r.jsonrpc,
                id: r.id,
                request: ClientRequest::CallToolRequest(r.request),
            }),
            JsonRpcMessage::Response(r) => JsonRpcMessage::Response(r),
            JsonRpcMessage::Notification(n) => JsonRpcMessage::Notification(n),
            JsonRpcMessage::Error(e) => JsonRpcMessage::Error(e),
        },
    )
}

/// Parses one line (without its newline) into a client message, or says how to refuse it.
///
/// Long on purpose: each way a line can be unusable gets its own answer, in the order they are
/// checked.
pub fn parse_line(line: &[u8]) -> Result<Option<ClientJsonRpcMessage>, Refusal> {
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    let line = line.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(line);
    if line.iter().all(u8::is_ascii_whitespace) {
        return Ok(None);
    }
    if let Some(dup) = crate::dup_keys::duplicate_key(line) {
        return Err(refuse_duplicate(line, dup));
    }
    // The common case first: a well-formed message straight from the line. What fails is parsed
    // again below, as a tree, to say what is wrong with it.
    if let Some(msg) = parse_as_tools_call(line) {
        return Ok(Some(msg));
    }
    if let Ok(msg) = serde_json::from_slice::<ClientJsonRpcMessage>(line) {
        return Ok(Some(msg));
    }
    let value: Value = match serde_json::from_slice(line) {
        Ok(v) => v,
        Err(e) => {
            return Err(Refusal {
                id: Some(Value::Null),
                code: PARSE_ERROR,
                message: format!(
                    "Parse error: the line is not valid JSON ({e}); send one UTF-8 JSON-RPC message per line"
                ),
            });
        }
    };
    let Value::Object(obj) = &value else {
        let what = match value {
            Value::Array(_) => {
                "a batch (array); batches are not part of MCP, send one message per line"
            }
            _ => "not a JSON object",
        };
        return Err(Refusal {
            id: Some(Value::Null),
            code: INVALID_REQUEST,
            message: format!("Invalid Request: the message is {what}"),
        });
    };
    // An id the answer can echo: a string or an integer, as JSON-RPC and MCP allow.
    let id = match obj.get("id") {
        Some(v @ Value::String(_)) => Some(v.clone()),
        Some(Value::Number(n)) if n.is_i64() || n.is_u64() => Some(Value::Number(n.clone())),
        _ => None,
    };
    let method = obj.get("method").and_then(Value::as_str);
    let is_notification = method.is_some() && !obj.contains_key("id");
    match serde_json::from_value::<ClientJsonRpcMessage>(value.clone()) {
        Ok(msg) => Ok(Some(msg)),
        Err(_) if is_notification => {
            // Unknown or malformed notifications cannot be answered; rmcp ignores unknown ones
            // too. Logged so an operator can see them.
            let method = method.unwrap_or_default();
            tracing::debug!(method, "ignoring a notification that does not parse");
            Err(Refusal {
                id: None,
                code: INVALID_REQUEST,
                message: String::new(),
            })
        }
        Err(e) => {
            let well_formed_request = obj.get("jsonrpc").and_then(Value::as_str) == Some("2.0")
                && method.is_some()
                && id.is_some();
            if well_formed_request {
                Err(Refusal {
                    id,
                    code: INVALID_PARAMS,
                    message: format!("Invalid params for {:?}: {e}", method.unwrap_or_default()),
                })
            } else {
                let problem = if obj.get("jsonrpc").and_then(Value::as_str) != Some("2.0") {
                    "it needs \"jsonrpc\": \"2.0\"".to_string()
                } else if obj.contains_key("id") && id.is_none() {
                    "its \"id\" must be a string or an integer".to_string()
                } else if obj.contains_key("method") && method.is_none() {
                    "its \"method\" must be a string".to_string()
                } else {
                    format!("it is not a request, response or notification ({e})")
                };
                Err(Refusal {
                    id: Some(id.unwrap_or(Value::Null)),
                    code: INVALID_REQUEST,
                    message: format!("Invalid Request: {problem}"),
                })
            }
        }
    }
}

/// The answer to a message that names a key twice in one object (SECURITY.md #296): its id, when
/// the id itself is not the repeated key.
pub(crate) fn refuse_duplicate(line: &[u8], dup: crate::dup_keys::DuplicateKey) -> Refusal {
    #[derive(serde::Deserialize)]
    struct IdOnly {
        id: Option<Value>,
    }
    let id = if dup.top_level && dup.key == "id" {
        None
    } else {
        serde_json::from_slice::<IdOnly>(line)
            .ok()
            .and_then(|m| m.id)
            .filter(|id| id.is_string() || id.is_i64() || id.is_u64())
    };
    let place = if dup.top_level {
        "the message"
    } else {
        "an object in the message"
    };
    Refusal {
        id: Some(id.unwrap_or(Value::Null)),
        code: INVALID_REQUEST,
        message: format!(
            "Invalid Request: {place} names the key {:?} twice; parsers disagree on which one \
             counts (a gateway could show one value while another runs), so send each key once",
            dup.key
        ),
    }
}

impl<R, W> Transport<RoleServer> for StdioTransport<R, W>
where
    R: AsyncRead + Unpin + Send,
    W: AsyncWrite + Unpin + Send + 'static,
{
    type Error = std::io::Error;

    fn name() -> Cow<'static, str> {
        "ironcell-stdio".into()
    }

    fn send(
        &mut self,
        item: ServerJsonRpcMessage,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send + 'static {
        let writer = self.writer.clone();
        async move { write_line(&writer, &item).await }
    }

    async fn receive(&mut self) -> Option<ClientJsonRpcMessage> {
        loop {
            match self.read_line().await {
                LineRead::Line => {}
                LineRead::Oversized => {
                    tracing::warn!(
                        max = self.max_line,
                        "a request line exceeded the size limit"
                    );
                    self.answer(
                        Value::Null,
                        PARSE_ERROR,
                        format!(
                            "Parse error: the message is longer than {} bytes, the limit for one line; send less data per request (large inputs belong in files)",
                            self.max_line
                        ),
                    );
                    continue;
                }
                LineRead::Eof => return None,
                LineRead::Io(e) => {
                    tracing::error!("reading stdin failed: {e}");
                    return None;
                }
            }
            if let Some(hook) = &self.on_line {
                hook(&self.line);
            }
            let parsed = parse_line(self.line.strip_suffix(b"\n").unwrap_or(&self.line));
            self.line.clear();
            match parsed {
                Ok(Some(msg)) => return Some(msg),
                Ok(None) => {}
                Err(Refusal { id: None, .. }) => {}
                Err(Refusal {
                    id: Some(id),
                    code,
                    message,
                }) => {
                    tracing::info!(code, "answering a malformed message: {message}");
                    self.answer(id, code, message);
                }
            }
        }
    }

    async fn close(&mut self) -> Result<(), Self::Error> {
        if let Some(mut w) = self.writer.lock().await.take() {
            w.shutdown().await?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refusal(line: &[u8]) -> Refusal {
        match parse_line(line) {
            Err(r) => r,
            Ok(m) => panic!("{:?} parsed as {m:?}", String::from_utf8_lossy(line)),
        }
    }

    #[test]
    fn unparsable_lines_are_parse_errors_with_a_null_id() {
        let deep = format!(
            "{{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"ping\",\"params\":{{\"x\":{}1{}}}}}",
            "[".repeat(300),
            "]".repeat(300)
        );
        for line in [
            &b"{this is not json"[..],
            b"\xff\xfe invalid utf-8 \xc3",
            b"{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"ping\",\"params\":{\"x\":\"\xc3\x28\"}}",
            b"{\"jsonrpc\":\"2.0\",\"id\":1e999,\"method\":\"ping\"}",
            deep.as_bytes(),
            b"{\"jsonrpc\":\"2.0\",\"id\":1,",
        ] {
            let r = refusal(line);
            assert_eq!((r.code, r.id), (PARSE_ERROR, Some(Value::Null)), "{line:?}");
        }
    }

    #[test]
    fn a_message_naming_a_key_twice_is_refused_with_its_id_when_that_is_not_the_key() {
        let call = |args: &str| {
            format!(
                r#"{{"jsonrpc":"2.0","id":4,"method":"tools/call","params":{{"name":"run_python","arguments":{args}}}}}"#
            )
        };
        let cases: [(String, Value); 4] = [
            (call(r#"{"code":"print(1)","code":"print(2)"}"#), json!(4)),
            (call(r#"{"code":"1","\u0063ode":"2"}"#), json!(4)),
            (
                r#"{"jsonrpc":"2.0","id":"a","method":"ping","method":"tools/call","params":{}}"#
                    .into(),
                json!("a"),
            ),
            (
                r#"{"jsonrpc":"2.0","id":1,"id":2,"method":"ping"}"#.into(),
                Value::Null,
            ),
        ];
        for (line, id) in cases {
            let r = refusal(line.as_bytes());
            assert_eq!((r.code, r.id), (INVALID_REQUEST, Some(id)), "{line}");
            assert!(r.message.contains("twice"), "{}", r.message);
        }
        // The same call with each key once runs.
        assert!(parse_line(call(r#"{"code":"print(2)"}"#).as_bytes()).is_ok_and(|m| m.is_some()));
    }

    #[test]
    fn json_that_is_not_a_request_is_an_invalid_request() {
        let cases: [(&[u8], Value); 6] = [
            (b"[]", Value::Null),
            (b"42", Value::Null),
            (b"{}", Value::Null),
            (br#"{"jsonrpc":"2.0","id":7,"method":12}"#, json!(7)),
            (br#"{"jsonrpc":"1.0","id":"a","method":"ping"}"#, json!("a")),
            (
                br#"{"jsonrpc":"2.0","id":null,"method":"ping"}"#,
                Value::Null,
            ),
        ];
        for (line, id) in cases {
            let r = refusal(line);
            assert_eq!((r.code, r.id), (INVALID_REQUEST, Some(id)), "{line:?}");
        }
    }

    #[test]
    fn a_request_with_bad_params_is_invalid_params_with_its_id() {
        let r = refusal(br#"{"jsonrpc":"2.0","id":"x","method":"tools/call","params":"nope"}"#);
        assert_eq!((r.code, r.id), (INVALID_PARAMS, Some(json!("x"))));
    }

    #[test]
    fn a_malformed_notification_is_not_answered() {
        let r = refusal(br#"{"jsonrpc":"2.0","method":"notifications/cancelled","params":5}"#);
        assert_eq!(r.id, None);
    }

    #[test]
    fn good_messages_and_blank_lines_pass() {
        assert!(matches!(
            parse_line(br#"{"jsonrpc":"2.0","id":0,"method":"ping"}"#),
            Ok(Some(_))
        ));
        assert!(matches!(parse_line(b"  \r"), Ok(None)));
    }

    #[test]
    fn a_tools_call_parses_to_what_rmcps_union_makes_of_it() {
        let lines: [&[u8]; 5] = [
            br#"{"jsonrpc":"2.0","id":4,"method":"tools/call","params":{"name":"run_python","arguments":{"code":"x += 1","session":"w"}}}"#,
            br#"{"jsonrpc":"2.0","id":"s","method":"tools/call","params":{"name":"run_python","arguments":{},"_meta":{"progressToken":9}}}"#,
            br#"{"jsonrpc":"2.0","id":5,"method":"tools/call","params":{"name":"run_python","task":{"ttl":1000}}}"#,
            br#"{"jsonrpc":"2.0","method":"notifications/initialized"}"#,
            br#"{"jsonrpc":"2.0","id":6,"result":{}}"#,
        ];
        for line in lines {
            let fast = parse_as_tools_call(line).expect("parses as a tools/call line");
            let union: ClientJsonRpcMessage = serde_json::from_slice(line).unwrap();
            assert_eq!(format!("{fast:?}"), format!("{union:?}"));
            assert_eq!(
                serde_json::to_value(&fast).unwrap(),
                serde_json::to_value(&union).unwrap()
            );
        }
        // Other methods, a stray `result` beside a method, and bad params take the union's way.
        for line in [
            &br#"{"jsonrpc":"2.0","id":0,"method":"ping"}"#[..],
            br#"{"jsonrpc":"2.0","id":1,"method":"tools/list"}"#,
            br#"{"jsonrpc":"2.0","id":2,"method":"tools/call","params":{"name":"x"},"result":{}}"#,
            br#"{"jsonrpc":"2.0","id":3,"method":"tools/call","params":"nope"}"#,
        ] {
            assert!(parse_as_tools_call(line).is_none(), "{line:?}");
        }
    }

    #[tokio::test]
    async fn every_bad_line_is_answered_and_good_ones_still_arrive() {
        let (mut client, server_in) = tokio::io::duplex(1 << 16);
        let (server_out, mut answers) = tokio::io::duplex(1 << 16);
        let mut t = StdioTransport::new(server_in, server_out, 64);
        client.write_all(b"{oops\n").await.unwrap();
        client.write_all(&[b'x'; 200]).await.unwrap();
        client
            .write_all(b"\n{\"jsonrpc\":\"2.0\",\"id\":3,\"method\":\"ping\"}\n")
            .await
            .unwrap();
        drop(client);
        let msg = t.receive().await.unwrap();
        assert!(serde_json::to_string(&msg).unwrap().contains("\"id\":3"));
        assert!(t.receive().await.is_none());
        // The answers are written by spawned tasks; reading lets them run.
        let mut reader = BufReader::new(&mut answers);
        let mut out = String::new();
        for _ in 0..2 {
            reader.read_line(&mut out).await.unwrap();
        }
        let lines: Vec<Value> = out
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines.len(), 2, "{out}");
        t.close().await.unwrap();
        for l in &lines {
            assert_eq!(l["error"]["code"], PARSE_ERROR);
            assert_eq!(l["id"], Value::Null);
        }
    }
}
