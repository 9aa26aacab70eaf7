//! The framing shared by the host and a worker on a session socket.
//!
//! Every frame is a big-endian `u32` length, then one kind byte, then the payload:
//! `J` carries a JSON control message ([`ToWorker`] or [`FromWorker`]), `O` and `E` carry raw
//! bytes the worker wrote to its fd 1 and fd 2. Output travels as bytes, not JSON strings, so a
//! UTF-8 sequence split across two reads is joined again by the host instead of being mangled.

use std::io::{self, Read, Write};

use serde::{Deserialize, Serialize};

/// Largest frame either side accepts. Code is capped well below this by the host.
pub const MAX_FRAME_BYTES: usize = 64 * 1024 * 1024;

pub const KIND_JSON: u8 = b'J';
pub const KIND_STDOUT: u8 = b'O';
pub const KIND_STDERR: u8 = b'E';

/// Messages the host sends to a worker.
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum ToWorker {
    /// Run a cell of Python in the session's namespace.
    Run { id: u64, code: String },
    /// The answer to a [`FromWorker::Request`]: `{"result": ...}` or
    /// `{"error": {"kind", "message"}}`.
    Response { id: u64, payload: serde_json::Value },
}

/// How a cell ended, as the worker saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CellStatus {
    Ok,
    Error,
    Interrupted,
    Exit,
}

/// A Python exception, summarized for the model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PyErrorInfo {
    #[serde(rename = "type")]
    pub kind: String,
    pub message: String,
    pub traceback: String,
}

/// Messages a worker sends to the host.
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum FromWorker {
    /// The worker finished its lockdown and accepts code.
    Ready {
        pid: i32,
        /// Sandbox layers skipped (best-effort mode only).
        #[serde(default)]
        missing_layers: Vec<String>,
        /// How long the lockdown took (reported in `system://info` and by the benchmark).
        #[serde(default)]
        lockdown_us: u64,
    },
    /// The worker could not set itself up and is about to exit.
    Fatal { message: String },
    /// A call from the in-sandbox `mcp` module to the host (and through it to a proxied MCP
    /// server): `servers`, `tools`, `search` or `call`.
    Request {
        id: u64,
        method: String,
        params: serde_json::Value,
    },
    /// A cell finished. Everything it wrote was sent before this frame.
    Done {
        id: u64,
        status: CellStatus,
        result: Option<String>,
        error: Option<PyErrorInfo>,
        exit_code: Option<i64>,
        /// Figures the cell left open and images it wrote, downscaled by the worker.
        #[serde(default)]
        images: Vec<CellImage>,
    },
}

/// An image a cell produced. `data` (base64) is the inline copy within the byte budget, if any.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CellImage {
    /// Relative to the session directory.
    pub path: String,
    pub mime: String,
    pub bytes: u64,
    #[serde(default)]
    pub width: Option<u32>,
    #[serde(default)]
    pub height: Option<u32>,
    #[serde(default)]
    pub data: Option<String>,
}

/// Writes one frame to a blocking writer (the worker side).
pub fn write_frame(w: &mut impl Write, kind: u8, payload: &[u8]) -> io::Result<()> {
    let len = u32::try_from(payload.len() + 1)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "frame too large"))?;
    let mut header = [0u8; 5];
    header[..4].copy_from_slice(&len.to_be_bytes());
    header[4] = kind;
    w.write_all(&header)?;
    w.write_all(payload)?;
    w.flush()
}

/// Reads one frame from a blocking reader (the worker side). `Ok(None)` on a clean EOF.
pub fn read_frame(r: &mut impl Read) -> io::Result<Option<(u8, Vec<u8>)>> {
    let mut len = [0u8; 4];
    match r.read_exact(&mut len) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    let len = u32::from_be_bytes(len) as usize;
    if len == 0 || len > MAX_FRAME_BYTES {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("bad frame length {len}"),
        ));
    }
    let mut buf = vec![0u8; len];
    r.read_exact(&mut buf)?;
    let kind = buf.remove(0);
    Ok(Some((kind, buf)))
}

/// The codec the host uses on its end of a session socket.
pub fn host_codec() -> tokio_util::codec::LengthDelimitedCodec {
    tokio_util::codec::LengthDelimitedCodec::builder()
        .length_field_length(4)
        .big_endian()
        .max_frame_length(MAX_FRAME_BYTES)
        .new_codec()
}

/// Encodes a JSON control frame body for the host codec (kind byte + JSON).
pub fn json_body<T: Serialize>(msg: &T) -> io::Result<bytes::Bytes> {
    let mut body = vec![KIND_JSON];
    serde_json::to_writer(&mut body, msg)?;
    Ok(body.into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_frame_written_by_the_worker_reads_back_whole() {
        let mut buf = Vec::new();
        write_frame(&mut buf, KIND_STDOUT, b"hello\n").unwrap();
        write_frame(
            &mut buf,
            KIND_JSON,
            br#"{"op":"ready","pid":7,"missing_layers":[]}"#,
        )
        .unwrap();
        let mut r = &buf[..];
        assert_eq!(
            read_frame(&mut r).unwrap(),
            Some((KIND_STDOUT, b"hello\n".to_vec()))
        );
        let (kind, body) = read_frame(&mut r).unwrap().unwrap();
        assert_eq!(kind, KIND_JSON);
        let msg: FromWorker = serde_json::from_slice(&body).unwrap();
        assert!(matches!(msg, FromWorker::Ready { pid: 7, .. }));
        assert_eq!(read_frame(&mut r).unwrap(), None);
    }

    #[test]
    fn an_oversized_length_is_rejected_not_allocated() {
        let mut buf = ((MAX_FRAME_BYTES + 2) as u32).to_be_bytes().to_vec();
        buf.push(KIND_JSON);
        assert!(read_frame(&mut &buf[..]).is_err());
    }
}
