//! What the latency benches share: kube-scheduler's side of the calls (one kept-alive
//! connection, the bodies it sends, what it reads of the answers).
#![allow(dead_code)]

use std::net::SocketAddr;
use std::time::Duration;

use serde_json::Value;

/// One kube-scheduler HTTP connection, kept alive between calls as Go's `http.Transport` keeps
/// it (the extender's `httpTimeout` client reuses its connection). A blocking socket on the
/// harness's own thread: kube-scheduler is another process, with its own network poller, so
/// the client's reads are not woken through the extender's runtime (an async client in the
/// same runtime had the extender's workers poll the client's socket and wake its thread).
pub(crate) struct Connection {
    stream: std::net::TcpStream,
    buffer: Vec<u8>,
}

impl Connection {
    pub(crate) fn open(address: SocketAddr) -> Self {
        let stream = std::net::TcpStream::connect(address).expect("connect");
        stream.set_nodelay(true).expect("nodelay");
        Self { stream, buffer: Vec::with_capacity(256 << 10) }
    }

    /// POSTs `body` to `path`; the answer's body.
    pub(crate) fn post(&mut self, path: &str, body: &[u8]) -> &[u8] {
        use std::io::{Read, Write};
        let head = format!(
            "POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
            body.len()
        );
        self.stream.write_all(head.as_bytes()).expect("write");
        self.stream.write_all(body).expect("write");
        self.buffer.clear();
        let mut start = 0;
        let mut length: Option<usize> = None;
        loop {
            if let Some(length) = length
                && self.buffer.len() >= start + length
            {
                return &self.buffer[start..start + length];
            }
            // Read straight into the buffer's spare room.
            let filled = self.buffer.len();
            if self.buffer.capacity() - filled < (64 << 10) {
                self.buffer.reserve(64 << 10);
            }
            self.buffer.resize(self.buffer.capacity(), 0);
            let n = self.stream.read(&mut self.buffer[filled..]).expect("read");
            self.buffer.truncate(filled + n);
            assert!(n > 0, "the connection closed");
            if length.is_none()
                && let Some(end) = self.buffer.windows(4).position(|w| w == b"\r\n\r\n")
            {
                let head = std::str::from_utf8(&self.buffer[..end]).expect("headers");
                length = Some(
                    head.lines()
                        .find_map(|l| {
                            let (k, v) = l.split_once(':')?;
                            k.eq_ignore_ascii_case("content-length")
                                .then(|| v.trim().parse().ok())?
                        })
                        .expect("a content-length"),
                );
                start = end + 4;
            }
        }
    }
}

/// What kube-scheduler reads of `filter`'s answer (Go decodes into typed fields too).
#[derive(serde::Deserialize)]
pub(crate) struct FilterAnswer<'a> {
    #[serde(rename = "NodeNames", borrow)]
    pub(crate) node_names: Option<Vec<&'a str>>,
    #[serde(rename = "Error")]
    pub(crate) error: String,
}

#[derive(serde::Deserialize)]
pub(crate) struct Score<'a> {
    #[serde(rename = "Host")]
    pub(crate) host: &'a str,
    #[serde(rename = "Score")]
    pub(crate) score: i64,
}

#[derive(serde::Serialize)]
pub(crate) struct Call<'a> {
    #[serde(rename = "Pod")]
    pub(crate) pod: &'a Value,
    #[serde(rename = "NodeNames")]
    pub(crate) node_names: &'a [&'a str],
}

/// The `per_mille`-th thousandth of sorted samples (nearest rank).
pub(crate) fn percentile(sorted: &[Duration], per_mille: usize) -> Duration {
    sorted[((sorted.len() - 1) * per_mille).div_ceil(1000)]
}
