//! A small HTTP/2 server for unary gRPC calls, for the one socket no tonic server can serve: the
//! kubelet's plugin watcher dials a registration socket with grpc-go and no authority override,
//! so its `:authority` is the socket path percent-encoded, which h2 (under every tonic server)
//! refuses with PROTOCOL_ERROR (hyperium/h2#487). This server reads `:path` and ignores
//! `:authority`.
//!
//! What it does (RFC 9113): the client preface, SETTINGS both ways (acknowledged), PING
//! answered, WINDOW_UPDATE for what it receives and tracking of what it may send, HEADERS with
//! CONTINUATION, padding and priority, DATA, RST_STREAM, GOAWAY. Header blocks are decoded by
//! `loona-hpack` (Huffman, the dynamic table); the answers' headers are written as HPACK
//! literals without indexing, which any decoder reads whatever table size it chose. A request is
//! one gRPC message (uncompressed); the answer is `:status 200`, the message, and the
//! `grpc-status` trailer, or a trailers-only error. Bounds: frames of at most 16 KiB (the
//! default it never raises), 64 KiB of header block, a dynamic table of at most 4 KiB (the
//! default it never raises: a larger table size update is a COMPRESSION_ERROR), 16 KiB of
//! decoded header list (SETTINGS_MAX_HEADER_LIST_SIZE: a block whose headers decode to more,
//! through references to one large entry, ends the connection with ENHANCE_YOUR_CALM), 64 KiB
//! of message (registration messages are a few hundred bytes), 16 streams at once (so at most
//! 1 MiB of messages buffered per connection), an idle connection closed after [`IDLE`], and a
//! client that does not read what it is sent dropped after the same time. Anything it does not
//! accept ends the connection with GOAWAY and the error code the RFC names.

use std::collections::HashMap;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// The client connection preface.
const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
/// The largest frame payload this server accepts (SETTINGS_MAX_FRAME_SIZE's default, which it
/// does not raise) and sends.
const MAX_FRAME: usize = 16_384;
/// The largest header block (HEADERS and its CONTINUATIONs) accepted.
const MAX_HEADER_BLOCK: usize = 64 << 10;
/// The largest request message accepted.
const MAX_MESSAGE: usize = 64 << 10;
/// The HPACK dynamic table's most (SETTINGS_HEADER_TABLE_SIZE's default, never raised).
const MAX_TABLE: usize = 4096;
/// The largest decoded header list (names, values and 32 bytes each, as RFC 9113 counts).
const MAX_HEADER_LIST: usize = 16 << 10;
/// Streams open at once (advertised as SETTINGS_MAX_CONCURRENT_STREAMS).
const MAX_STREAMS: usize = 16;
/// A connection that sends nothing for this long is closed.
pub const IDLE: Duration = Duration::from_secs(60);

const DATA: u8 = 0x0;
const HEADERS: u8 = 0x1;
const RST_STREAM: u8 = 0x3;
const SETTINGS: u8 = 0x4;
const PUSH_PROMISE: u8 = 0x5;
const PING: u8 = 0x6;
const GOAWAY: u8 = 0x7;
const WINDOW_UPDATE: u8 = 0x8;
const CONTINUATION: u8 = 0x9;

const END_STREAM: u8 = 0x1;
const ACK: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const PADDED: u8 = 0x8;
const PRIORITY_FLAG: u8 = 0x20;

/// HTTP/2 error codes (RFC 9113, section 7).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum H2Error {
    /// PROTOCOL_ERROR.
    Protocol = 0x1,
    /// FLOW_CONTROL_ERROR.
    FlowControl = 0x3,
    /// FRAME_SIZE_ERROR.
    FrameSize = 0x6,
    /// REFUSED_STREAM.
    RefusedStream = 0x7,
    /// COMPRESSION_ERROR.
    Compression = 0x9,
    /// ENHANCE_YOUR_CALM.
    EnhanceYourCalm = 0xb,
}

/// gRPC status codes this server answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Code {
    /// INVALID_ARGUMENT.
    InvalidArgument = 3,
    /// RESOURCE_EXHAUSTED.
    ResourceExhausted = 8,
    /// UNIMPLEMENTED.
    Unimplemented = 12,
    /// INTERNAL.
    Internal = 13,
}

/// A call's failure: its gRPC status and message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Status {
    /// The code.
    pub code: Code,
    /// What went wrong, for the caller.
    pub message: String,
}

impl Status {
    /// A status with `code` and `message`.
    pub fn new(code: Code, message: impl Into<String>) -> Self {
        Self { code, message: message.into() }
    }
}

/// One call as it came.
#[derive(Debug)]
pub struct Call<'a> {
    /// `:path`: `/package.Service/Method`.
    pub path: &'a str,
    /// `:authority` as the client sent it (the kubelet: its socket path, percent-encoded), or
    /// empty; never judged.
    pub authority: &'a str,
    /// The request message, encoded.
    pub message: &'a [u8],
}

/// What serves the calls: the answer's message, encoded.
pub trait Unary: Send + Sync {
    /// Answers one call.
    fn call(&self, call: &Call<'_>) -> Result<Vec<u8>, Status>;
}

/// How a connection ended, for the log and tests.
#[derive(Debug, PartialEq, Eq)]
pub enum Ended {
    /// The client closed it, or said GOAWAY.
    Closed,
    /// Nothing came for [`IDLE`] (or the server's shutdown).
    Idle,
    /// The client broke the protocol; the server said GOAWAY with this code.
    Refused(H2Error, String),
    /// Reading or writing failed.
    Io(String),
}

#[derive(Default)]
struct Stream {
    path: String,
    authority: String,
    body: Vec<u8>,
    /// The client's flow-control window for what this server sends on the stream.
    send_window: i64,
}

/// One frame's header.
struct Frame {
    kind: u8,
    flags: u8,
    stream: u32,
    payload: Vec<u8>,
}

struct Connection<'h, H: ?Sized> {
    handler: &'h H,
    decoder: loona_hpack::Decoder<'static>,
    streams: HashMap<u32, Stream>,
    /// A header block waiting for CONTINUATION frames: its stream, bytes, END_STREAM.
    pending: Option<(u32, Vec<u8>, bool)>,
    /// The client's connection-level window for what this server sends.
    send_window: i64,
    /// The client's SETTINGS_INITIAL_WINDOW_SIZE.
    initial_window: i64,
    highest_stream: u32,
    out: Vec<u8>,
}

/// Serves one connection until it ends, with `handler` answering its calls.
pub async fn serve<S, H>(io: S, handler: &H, idle: Duration) -> Ended
where
    S: AsyncRead + AsyncWrite + Unpin,
    H: Unary + ?Sized,
{
    let (mut reader, mut writer) = tokio::io::split(io);
    let mut preface = [0u8; PREFACE.len()];
    match tokio::time::timeout(idle, reader.read_exact(&mut preface)).await {
        Err(_) => return Ended::Idle,
        Ok(Err(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ended::Closed,
        Ok(Err(e)) => return Ended::Io(e.to_string()),
        Ok(Ok(_)) if preface != PREFACE => {
            // Not HTTP/2 with prior knowledge: nothing sensible can be said back.
            return Ended::Refused(H2Error::Protocol, "not the HTTP/2 client preface".into());
        }
        Ok(Ok(_)) => {}
    }
    let mut decoder = loona_hpack::Decoder::new();
    decoder.set_max_allowed_table_size(MAX_TABLE);
    let mut c = Connection {
        handler,
        decoder,
        streams: HashMap::new(),
        pending: None,
        send_window: 65_535,
        initial_window: 65_535,
        highest_stream: 0,
        out: Vec::new(),
    };
    // Our SETTINGS: at most MAX_STREAMS streams and MAX_HEADER_LIST of headers; every other
    // setting at its default.
    let mut settings = Vec::new();
    settings.extend_from_slice(&0x3u16.to_be_bytes());
    settings.extend_from_slice(&u32::try_from(MAX_STREAMS).unwrap_or(16).to_be_bytes());
    settings.extend_from_slice(&0x6u16.to_be_bytes());
    settings.extend_from_slice(&u32::try_from(MAX_HEADER_LIST).unwrap_or(16_384).to_be_bytes());
    c.frame(SETTINGS, 0, 0, &settings);
    loop {
        if !c.out.is_empty() {
            // Within the idle time too: a client that never reads is dropped, not waited on.
            let send = async { writer.write_all(&c.out).await.and(writer.flush().await) };
            let sent = tokio::time::timeout(idle, send).await;
            c.out.clear();
            match sent {
                Err(_) => return Ended::Io("the client read nothing of the answers".into()),
                Ok(Err(e)) => return Ended::Io(e.to_string()),
                Ok(Ok(())) => {}
            }
        }
        let frame = match tokio::time::timeout(idle, read_frame(&mut reader)).await {
            Err(_) => return Ended::Idle,
            Ok(Err(ReadError::Closed)) => return Ended::Closed,
            Ok(Err(ReadError::Io(e))) => return Ended::Io(e),
            Ok(Err(ReadError::TooLarge(n))) => {
                return c
                    .refuse(&mut writer, H2Error::FrameSize, format!("a frame of {n} bytes"), idle)
                    .await;
            }
            Ok(Ok(f)) => f,
        };
        match c.on_frame(frame) {
            Ok(true) => {}
            Ok(false) => {
                let send = async { writer.write_all(&c.out).await.and(writer.flush().await) };
                let _ = tokio::time::timeout(idle, send).await;
                return Ended::Closed;
            }
            Err((code, why)) => return c.refuse(&mut writer, code, why, idle).await,
        }
    }
}

enum ReadError {
    Closed,
    TooLarge(usize),
    Io(String),
}

async fn read_frame<R: AsyncRead + Unpin>(reader: &mut R) -> Result<Frame, ReadError> {
    let mut head = [0u8; 9];
    match reader.read_exact(&mut head).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Err(ReadError::Closed),
        Err(e) => return Err(ReadError::Io(e.to_string())),
    }
    let length = usize::from(head[0]) << 16 | usize::from(head[1]) << 8 | usize::from(head[2]);
    if length > MAX_FRAME {
        return Err(ReadError::TooLarge(length));
    }
    let stream = u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff;
    let mut payload = vec![0u8; length];
    reader.read_exact(&mut payload).await.map_err(|e| ReadError::Io(e.to_string()))?;
    Ok(Frame { kind: head[3], flags: head[4], stream, payload })
}

type Refusal = (H2Error, String);

impl<H: Unary + ?Sized> Connection<'_, H> {
    fn frame(&mut self, kind: u8, flags: u8, stream: u32, payload: &[u8]) {
        let length = u32::try_from(payload.len()).unwrap_or(u32::MAX).to_be_bytes();
        self.out.extend_from_slice(&length[1..]);
        self.out.push(kind);
        self.out.push(flags);
        self.out.extend_from_slice(&stream.to_be_bytes());
        self.out.extend_from_slice(payload);
    }

    async fn refuse<W: AsyncWrite + Unpin>(
        &mut self,
        writer: &mut W,
        code: H2Error,
        why: String,
        within: Duration,
    ) -> Ended {
        let mut payload = self.highest_stream.to_be_bytes().to_vec();
        payload.extend_from_slice(&(code as u32).to_be_bytes());
        payload.extend_from_slice(why.as_bytes());
        payload.truncate(MAX_FRAME);
        self.frame(GOAWAY, 0, 0, &payload);
        let send = async { writer.write_all(&self.out).await.and(writer.flush().await) };
        let _ = tokio::time::timeout(within, send).await;
        Ended::Refused(code, why)
    }

    /// Handles one frame; `Ok(false)` when the client said GOAWAY.
    fn on_frame(&mut self, f: Frame) -> Result<bool, Refusal> {
        if let Some((stream, _, _)) = &self.pending
            && (f.kind != CONTINUATION || f.stream != *stream)
        {
            return Err((H2Error::Protocol, "a frame inside a header block".into()));
        }
        match f.kind {
            SETTINGS => self.on_settings(&f)?,
            PING => {
                if f.stream != 0 || f.payload.len() != 8 {
                    return Err((H2Error::Protocol, "a malformed PING".into()));
                }
                if f.flags & ACK == 0 {
                    self.frame(PING, ACK, 0, &f.payload);
                }
            }
            WINDOW_UPDATE => {
                let Ok(bytes) = <[u8; 4]>::try_from(f.payload.as_slice()) else {
                    return Err((H2Error::FrameSize, "a malformed WINDOW_UPDATE".into()));
                };
                let increment = i64::from(u32::from_be_bytes(bytes) & 0x7fff_ffff);
                let window = if f.stream == 0 {
                    Some(&mut self.send_window)
                } else {
                    self.streams.get_mut(&f.stream).map(|s| &mut s.send_window)
                };
                if let Some(w) = window {
                    *w += increment;
                    if *w > i64::from(i32::MAX) {
                        return Err((H2Error::FlowControl, "a window past 2^31-1".into()));
                    }
                }
            }
            HEADERS => self.on_headers(f)?,
            CONTINUATION => {
                let Some((stream, mut block, end_stream)) = self.pending.take() else {
                    return Err((H2Error::Protocol, "CONTINUATION without HEADERS".into()));
                };
                block.extend_from_slice(&f.payload);
                if block.len() > MAX_HEADER_BLOCK {
                    return Err((H2Error::EnhanceYourCalm, "a header block past 64 KiB".into()));
                }
                if f.flags & END_HEADERS != 0 {
                    self.on_header_block(stream, &block, end_stream)?;
                } else {
                    self.pending = Some((stream, block, end_stream));
                }
            }
            DATA => self.on_data(f)?,
            RST_STREAM => {
                self.streams.remove(&f.stream);
            }
            GOAWAY => return Ok(false),
            PUSH_PROMISE => return Err((H2Error::Protocol, "a client may not push".into())),
            // PRIORITY, and frame types this server does not know, are ignored (RFC 9113, 4.1).
            _ => {}
        }
        Ok(true)
    }

    fn on_settings(&mut self, f: &Frame) -> Result<(), Refusal> {
        if f.stream != 0 || !f.payload.len().is_multiple_of(6) {
            return Err((H2Error::FrameSize, "a malformed SETTINGS".into()));
        }
        if f.flags & ACK != 0 {
            return Ok(());
        }
        for pair in f.payload.chunks_exact(6) {
            let id = u16::from_be_bytes([pair[0], pair[1]]);
            let value = u32::from_be_bytes([pair[2], pair[3], pair[4], pair[5]]);
            if id == 0x4 {
                // SETTINGS_INITIAL_WINDOW_SIZE moves every open stream's window by the change.
                if value > 0x7fff_ffff {
                    return Err((H2Error::FlowControl, "an initial window past 2^31-1".into()));
                }
                let change = i64::from(value) - self.initial_window;
                self.initial_window = i64::from(value);
                for s in self.streams.values_mut() {
                    s.send_window += change;
                }
            }
            // The others (table size: this server's answers never index; frame size: it
            // sends at most the default; push, streams) need nothing of it.
        }
        self.frame(SETTINGS, ACK, 0, &[]);
        Ok(())
    }

    fn on_headers(&mut self, f: Frame) -> Result<(), Refusal> {
        if f.stream == 0 || f.stream.is_multiple_of(2) {
            return Err((H2Error::Protocol, format!("HEADERS on stream {}", f.stream)));
        }
        let mut block = unpad(&f)?;
        if f.flags & PRIORITY_FLAG != 0 {
            if block.len() < 5 {
                return Err((H2Error::FrameSize, "a short HEADERS priority".into()));
            }
            block = &block[5..];
        }
        let end_stream = f.flags & END_STREAM != 0;
        if f.flags & END_HEADERS != 0 {
            self.on_header_block(f.stream, block, end_stream)
        } else {
            self.pending = Some((f.stream, block.to_vec(), end_stream));
            Ok(())
        }
    }

    fn on_header_block(
        &mut self,
        stream: u32,
        block: &[u8],
        end_stream: bool,
    ) -> Result<(), Refusal> {
        // Decoded even for a stream refused below: the decoder's table must see every block.
        let mut path = None;
        let mut authority = String::new();
        let mut method_post = false;
        let mut grpc = false;
        // What the block decodes to, counted as RFC 9113 counts a header list; past the bound
        // nothing more is copied (the decoder still runs, so its table stays right).
        let mut listed = 0usize;
        self.decoder
            .decode_with_cb(block, |name, value| {
                listed = listed.saturating_add(name.len() + value.len() + 32);
                if listed > MAX_HEADER_LIST {
                    return;
                }
                match &*name {
                    b":path" => path = Some(String::from_utf8_lossy(&value).into_owned()),
                    b":authority" => authority = String::from_utf8_lossy(&value).into_owned(),
                    b":method" => method_post = &*value == b"POST",
                    b"content-type" => grpc = value.starts_with(b"application/grpc"),
                    _ => {}
                }
            })
            .map_err(|e| {
                (H2Error::Compression, format!("a header block HPACK cannot decode: {e}"))
            })?;
        if listed > MAX_HEADER_LIST {
            return Err((
                H2Error::EnhanceYourCalm,
                format!("a header list of {listed} bytes decoded, past {MAX_HEADER_LIST}"),
            ));
        }
        if self.streams.contains_key(&stream) {
            // Trailers from the client end its message.
            if !end_stream {
                return Err((H2Error::Protocol, "trailers without END_STREAM".into()));
            }
            self.finish(stream);
            return Ok(());
        }
        if stream <= self.highest_stream {
            return Err((H2Error::Protocol, format!("stream {stream} reused or out of order")));
        }
        self.highest_stream = stream;
        if self.streams.len() >= MAX_STREAMS {
            let code = (H2Error::RefusedStream as u32).to_be_bytes();
            self.frame(RST_STREAM, 0, stream, &code);
            return Ok(());
        }
        let Some(path) = path.filter(|_| method_post && grpc) else {
            // Not a gRPC call: answered as one that failed, so that any client learns why.
            let why = "only gRPC calls (POST, application/grpc, a :path) are served here";
            self.answer_status(stream, &Status::new(Code::Unimplemented, why));
            return Ok(());
        };
        self.streams.insert(
            stream,
            Stream { path, authority, body: Vec::new(), send_window: self.initial_window },
        );
        if end_stream {
            self.finish(stream);
        }
        Ok(())
    }

    fn on_data(&mut self, f: Frame) -> Result<(), Refusal> {
        let received = u32::try_from(f.payload.len()).unwrap_or(0);
        if received > 0 {
            // Whatever comes back to the client's window at once: the bound is MAX_MESSAGE.
            self.frame(WINDOW_UPDATE, 0, 0, &received.to_be_bytes());
        }
        let data = unpad(&f)?;
        let Some(s) = self.streams.get_mut(&f.stream) else {
            // A stream already answered or reset: its data is dropped.
            return Ok(());
        };
        if s.body.len() + data.len() > MAX_MESSAGE + 5 {
            self.streams.remove(&f.stream);
            let why = format!("a request past {MAX_MESSAGE} bytes");
            self.answer_status(f.stream, &Status::new(Code::ResourceExhausted, why));
            let code = 0x8u32.to_be_bytes(); // CANCEL: nothing more is read of it.
            self.frame(RST_STREAM, 0, f.stream, &code);
            return Ok(());
        }
        s.body.extend_from_slice(data);
        if f.flags & END_STREAM != 0 {
            self.finish(f.stream);
        } else if received > 0 {
            self.frame(WINDOW_UPDATE, 0, f.stream, &received.to_be_bytes());
        }
        Ok(())
    }

    /// The client's message is complete: the call is answered and the stream closed.
    fn finish(&mut self, stream: u32) {
        let Some(s) = self.streams.remove(&stream) else { return };
        let answer = grpc_message(&s.body).and_then(|message| {
            self.handler.call(&Call { path: &s.path, authority: &s.authority, message })
        });
        match answer {
            Ok(message) => self.answer_message(stream, s.send_window, &message),
            Err(status) => self.answer_status(stream, &status),
        }
    }

    /// The answer's message, within the client's window for the stream (`window`) and the
    /// connection.
    fn answer_message(&mut self, stream: u32, window: i64, message: &[u8]) {
        let mut body = Vec::with_capacity(message.len() + 5);
        body.push(0);
        body.extend_from_slice(&u32::try_from(message.len()).unwrap_or(u32::MAX).to_be_bytes());
        body.extend_from_slice(message);
        let size = i64::try_from(body.len()).unwrap_or(i64::MAX);
        if size > window.min(self.send_window) {
            let why = "the answer is larger than the client's flow-control window";
            self.answer_status(stream, &Status::new(Code::ResourceExhausted, why));
            return;
        }
        self.send_window -= size;
        let mut head = Vec::new();
        head.push(0x88); // :status 200, static table index 8.
        literal(&mut head, b"content-type", b"application/grpc");
        self.frame(HEADERS, END_HEADERS, stream, &head);
        for chunk in body.chunks(MAX_FRAME) {
            self.frame(DATA, 0, stream, chunk);
        }
        let mut trailers = Vec::new();
        literal(&mut trailers, b"grpc-status", b"0");
        self.frame(HEADERS, END_HEADERS | END_STREAM, stream, &trailers);
    }

    /// A trailers-only answer: the status, no message.
    fn answer_status(&mut self, stream: u32, status: &Status) {
        let mut head = Vec::new();
        head.push(0x88);
        literal(&mut head, b"content-type", b"application/grpc");
        literal(&mut head, b"grpc-status", (status.code as u8).to_string().as_bytes());
        literal(&mut head, b"grpc-message", &percent_encode(&status.message));
        self.frame(HEADERS, END_HEADERS | END_STREAM, stream, &head);
    }
}

/// The frame's payload without its padding.
fn unpad(f: &Frame) -> Result<&[u8], Refusal> {
    if f.flags & PADDED == 0 {
        return Ok(&f.payload);
    }
    let Some((&pad, rest)) = f.payload.split_first() else {
        return Err((H2Error::FrameSize, "a padded frame with no pad length".into()));
    };
    let pad = usize::from(pad);
    if pad > rest.len() {
        return Err((H2Error::Protocol, "padding longer than the frame".into()));
    }
    Ok(&rest[..rest.len() - pad])
}

/// The one gRPC message of a unary request body.
fn grpc_message(body: &[u8]) -> Result<&[u8], Status> {
    let Some((&compressed, rest)) = body.split_first() else {
        return Err(Status::new(Code::Internal, "the request carried no message"));
    };
    if compressed != 0 {
        return Err(Status::new(Code::Unimplemented, "compressed messages are not accepted"));
    }
    let (Some(length), Some(message)) = (rest.get(..4), rest.get(4..)) else {
        return Err(Status::new(Code::Internal, "a message shorter than its prefix"));
    };
    let length = u32::from_be_bytes([length[0], length[1], length[2], length[3]]);
    if usize::try_from(length).ok() != Some(message.len()) {
        return Err(Status::new(Code::InvalidArgument, "a unary call carries exactly one message"));
    }
    Ok(message)
}

/// An HPACK integer with an `n`-bit prefix, the first byte's high bits `first`.
fn integer(out: &mut Vec<u8>, first: u8, n: u32, value: usize) {
    let max = (1usize << n) - 1;
    if value < max {
        out.push(first | u8::try_from(value).unwrap_or(0));
        return;
    }
    out.push(first | u8::try_from(max).unwrap_or(0));
    let mut rest = value - max;
    while rest >= 128 {
        out.push(u8::try_from(rest % 128).unwrap_or(0) | 0x80);
        rest /= 128;
    }
    out.push(u8::try_from(rest).unwrap_or(0));
}

/// A literal header field without indexing, new name, no Huffman (RFC 7541, 6.2.2).
fn literal(out: &mut Vec<u8>, name: &[u8], value: &[u8]) {
    out.push(0x00);
    integer(out, 0, 7, name.len());
    out.extend_from_slice(name);
    integer(out, 0, 7, value.len());
    out.extend_from_slice(value);
}

/// `grpc-message`'s encoding: printable ASCII but `%` as is, every other byte `%XX`.
fn percent_encode(text: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(text.len());
    for &b in text.as_bytes() {
        if (0x20..=0x7e).contains(&b) && b != b'%' {
            out.push(b);
        } else {
            out.extend_from_slice(format!("%{b:02X}").as_bytes());
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Echoes the message.
    struct Echo;
    impl Unary for Echo {
        fn call(&self, call: &Call<'_>) -> Result<Vec<u8>, Status> {
            Ok(call.message.to_vec())
        }
    }

    fn raw_frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
        let mut out = u32::try_from(payload.len()).expect("len").to_be_bytes()[1..].to_vec();
        out.extend_from_slice(&[kind, flags]);
        out.extend_from_slice(&stream.to_be_bytes());
        out.extend_from_slice(payload);
        out
    }

    fn request_headers() -> Vec<u8> {
        let mut block = vec![0x83]; // :method POST
        literal(&mut block, b":path", b"/x.Y/Z");
        literal(&mut block, b":authority", b"%2Fvar%2Flib%2Fkubelet%2Fx-reg.sock");
        literal(&mut block, b"content-type", b"application/grpc");
        block
    }

    /// Runs the server on `input` (after the preface) and returns how it ended and what it wrote.
    async fn exchange(input: &[u8]) -> (Ended, Vec<u8>) {
        let (client, server) = tokio::io::duplex(4 << 20);
        let (mut read, mut write) = tokio::io::split(client);
        let mut bytes = PREFACE.to_vec();
        bytes.extend_from_slice(input);
        let writer = tokio::spawn(async move {
            write.write_all(&bytes).await.expect("write");
            write.shutdown().await.expect("shutdown");
        });
        let ended = serve(server, &Echo, Duration::from_secs(5)).await;
        writer.await.expect("writer");
        let mut out = Vec::new();
        read.read_to_end(&mut out).await.expect("read");
        (ended, out)
    }

    /// The frames in `out`: (kind, flags, stream, payload).
    fn frames(mut out: &[u8]) -> Vec<(u8, u8, u32, Vec<u8>)> {
        let mut all = Vec::new();
        while out.len() >= 9 {
            let n = usize::from(out[0]) << 16 | usize::from(out[1]) << 8 | usize::from(out[2]);
            let stream = u32::from_be_bytes([out[5], out[6], out[7], out[8]]);
            all.push((out[3], out[4], stream, out[9..9 + n].to_vec()));
            out = &out[9 + n..];
        }
        all
    }

    #[tokio::test]
    async fn a_call_split_over_continuation_and_padded_data_is_answered() {
        let block = request_headers();
        let (first, rest) = block.split_at(5);
        let mut input = raw_frame(SETTINGS, 0, 0, &[]);
        input.extend(raw_frame(HEADERS, 0, 1, first));
        input.extend(raw_frame(CONTINUATION, END_HEADERS, 1, rest));
        // One message of 3 bytes, padded with 4.
        input.extend(raw_frame(
            DATA,
            PADDED | END_STREAM,
            1,
            &[4, 0, 0, 0, 0, 3, 7, 8, 9, 0, 0, 0, 0],
        ));
        input.extend(raw_frame(PING, 0, 0, &[1; 8]));
        let (ended, out) = exchange(&input).await;
        assert_eq!(ended, Ended::Closed);
        let frames = frames(&out);
        assert!(frames.iter().any(|f| f.0 == SETTINGS && f.1 == ACK), "settings acked");
        assert!(frames.iter().any(|f| f.0 == PING && f.1 == ACK && f.3 == [1; 8]), "ping answered");
        let data: Vec<_> = frames.iter().filter(|f| f.0 == DATA && f.2 == 1).collect();
        assert_eq!(data.len(), 1);
        assert_eq!(data[0].3, [0, 0, 0, 0, 3, 7, 8, 9]);
        let trailers = frames.iter().rfind(|f| f.0 == HEADERS && f.2 == 1).expect("trailers");
        assert_eq!(trailers.1, END_HEADERS | END_STREAM);
        let headers = loona_hpack::Decoder::new().decode(&trailers.3).expect("hpack");
        assert_eq!(headers, [(b"grpc-status".to_vec(), b"0".to_vec())]);
    }

    #[tokio::test]
    async fn a_frame_past_16_kib_ends_the_connection_with_frame_size_error() {
        let mut input = raw_frame(HEADERS, END_HEADERS, 1, &request_headers());
        input.extend(raw_frame(DATA, 0, 1, &vec![0; MAX_FRAME + 1]));
        let (ended, out) = exchange(&input).await;
        assert!(matches!(ended, Ended::Refused(H2Error::FrameSize, _)), "{ended:?}");
        let goaway = frames(&out).into_iter().find(|f| f.0 == GOAWAY).expect("GOAWAY");
        assert_eq!(goaway.3[4..8], (H2Error::FrameSize as u32).to_be_bytes());
    }

    #[tokio::test]
    async fn a_message_past_its_bound_is_refused_and_its_stream_cancelled() {
        let mut input = raw_frame(HEADERS, END_HEADERS, 1, &request_headers());
        let chunk = vec![0; MAX_FRAME];
        for _ in 0..=(MAX_MESSAGE / MAX_FRAME) {
            input.extend(raw_frame(DATA, 0, 1, &chunk));
        }
        let (ended, out) = exchange(&input).await;
        assert_eq!(ended, Ended::Closed);
        let frames = frames(&out);
        let status = frames.iter().find(|f| f.0 == HEADERS && f.2 == 1).expect("status");
        let headers = loona_hpack::Decoder::new().decode(&status.3).expect("hpack");
        assert!(headers.contains(&(b"grpc-status".to_vec(), b"8".to_vec())), "{headers:?}");
        assert!(frames.iter().any(|f| f.0 == RST_STREAM && f.2 == 1), "stream cancelled");
        assert!(!frames.iter().any(|f| f.0 == DATA), "nothing answered");
    }

    #[tokio::test]
    async fn streams_past_the_bound_are_refused_and_a_bad_preface_or_block_ends_it() {
        // 17 streams opened, none finished: the 17th is refused.
        let mut input = Vec::new();
        for i in 0..=MAX_STREAMS {
            let id = u32::try_from(2 * i + 1).expect("id");
            input.extend(raw_frame(HEADERS, END_HEADERS, id, &request_headers()));
        }
        let (_, out) = exchange(&input).await;
        let refused: Vec<_> = frames(&out).into_iter().filter(|f| f.0 == RST_STREAM).collect();
        assert_eq!(refused.len(), 1);
        assert_eq!(refused[0].2, 33);
        assert_eq!(refused[0].3, (H2Error::RefusedStream as u32).to_be_bytes());
        // A header block HPACK cannot decode (an index past both tables).
        let (ended, _) = exchange(&raw_frame(HEADERS, END_HEADERS, 1, &[0xff, 0x7f])).await;
        assert!(matches!(ended, Ended::Refused(H2Error::Compression, _)), "{ended:?}");
        // A frame of another stream inside a header block.
        let mut input = raw_frame(HEADERS, 0, 1, &request_headers()[..2]);
        input.extend(raw_frame(DATA, 0, 3, &[]));
        let (ended, _) = exchange(&input).await;
        assert!(matches!(ended, Ended::Refused(H2Error::Protocol, _)), "{ended:?}");
        // Not HTTP/2 at all.
        let (client, server) = tokio::io::duplex(1024);
        let (_, mut write) = tokio::io::split(client);
        write.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").await.expect("write");
        let ended = serve(server, &Echo, Duration::from_secs(5)).await;
        assert!(matches!(ended, Ended::Refused(H2Error::Protocol, _)), "{ended:?}");
    }

    /// Issue 39, item 7: a table size update past the 4 KiB the server allows (2^28-1 once let
    /// a client fill 68 MiB of table) ends the connection with COMPRESSION_ERROR; references
    /// to one large entry decoding past the header list bound (16,000 of a 4 KiB entry once
    /// decoded to 12 GiB a frame) end it with ENHANCE_YOUR_CALM, at once.
    #[tokio::test]
    async fn hpack_tables_and_header_lists_are_bounded() {
        let mut huge = Vec::new();
        integer(&mut huge, 0x20, 5, (1 << 28) - 1);
        huge.extend(request_headers());
        let (ended, out) = exchange(&raw_frame(HEADERS, END_HEADERS, 1, &huge)).await;
        assert!(matches!(ended, Ended::Refused(H2Error::Compression, _)), "{ended:?}");
        assert!(frames(&out).iter().any(|f| f.0 == GOAWAY), "said");
        // A 4,000-byte entry (it fits the 4 KiB table), then a block of 16,000 references
        // to it (index 62, one byte each).
        let mut first = vec![0x40];
        integer(&mut first, 0, 7, 1);
        first.push(b'x');
        integer(&mut first, 0, 7, 4000);
        first.extend(std::iter::repeat_n(b'v', 4000));
        first.extend(request_headers());
        let mut input = raw_frame(HEADERS, END_HEADERS | END_STREAM, 1, &first);
        let references = vec![0x80 | 62; 16_000];
        input.extend(raw_frame(HEADERS, END_HEADERS, 3, &references));
        let started = std::time::Instant::now();
        let (ended, out) = exchange(&input).await;
        assert!(matches!(ended, Ended::Refused(H2Error::EnhanceYourCalm, _)), "{ended:?}");
        assert!(started.elapsed() < Duration::from_secs(2), "took {:?}", started.elapsed());
        let frames = frames(&out);
        // The first call (a header list within the bound) was answered.
        assert!(frames.iter().any(|f| f.0 == HEADERS && f.2 == 1), "stream 1 answered");
        // The server says its bounds.
        let settings = frames.iter().find(|f| f.0 == SETTINGS && f.1 == 0).expect("settings");
        assert!(settings.3.windows(6).any(|w| w == [0, 6, 0, 0, 0x40, 0]), "{:?}", settings.3);
    }

    /// Issue 39, item 7: a client that sends and never reads (PINGs whose answers fill its
    /// socket) is dropped after the idle time, not waited on for good.
    #[tokio::test]
    async fn a_client_that_never_reads_is_dropped() {
        let (client, server) = tokio::io::duplex(1024);
        let (_read, mut write) = tokio::io::split(client);
        let pings = tokio::spawn(async move {
            let _ = write.write_all(PREFACE).await;
            for _ in 0..100_000 {
                if write.write_all(&raw_frame(PING, 0, 0, &[1; 8])).await.is_err() {
                    break;
                }
            }
        });
        let ended = tokio::time::timeout(
            Duration::from_secs(5),
            serve(server, &Echo, Duration::from_millis(300)),
        )
        .await
        .expect("dropped in time");
        assert!(matches!(ended, Ended::Io(ref why) if why.contains("read nothing")), "{ended:?}");
        pings.abort();
    }

    #[tokio::test]
    async fn a_silent_client_is_dropped_when_idle() {
        let (_client, server) = tokio::io::duplex(1024);
        let ended = serve(server, &Echo, Duration::from_millis(50)).await;
        assert_eq!(ended, Ended::Idle);
    }

    #[test]
    fn integers_are_rfc_7541s_examples() {
        // C.1.1: 10 with a 5-bit prefix; C.1.2: 1337 with a 5-bit prefix.
        let mut out = Vec::new();
        integer(&mut out, 0, 5, 10);
        assert_eq!(out, [0x0a]);
        out.clear();
        integer(&mut out, 0, 5, 1337);
        assert_eq!(out, [0x1f, 0x9a, 0x0a]);
    }

    #[test]
    fn literals_decode_with_the_crate_whatever_the_table() {
        let mut block = vec![0x88];
        let long = "x".repeat(300);
        literal(&mut block, b"grpc-message", long.as_bytes());
        let mut decoder = loona_hpack::Decoder::new();
        decoder.set_max_table_size(0);
        let headers = decoder.decode(&block).expect("decodes");
        assert_eq!(headers[0], (b":status".to_vec(), b"200".to_vec()));
        assert_eq!(headers[1], (b"grpc-message".to_vec(), long.into_bytes()));
    }

    #[test]
    fn messages_are_percent_encoded() {
        assert_eq!(percent_encode("a b%c\né"), b"a b%25c%0A%C3%A9");
    }

    #[test]
    fn a_unary_body_is_one_uncompressed_message() {
        assert_eq!(grpc_message(&[0, 0, 0, 0, 2, 7, 8]), Ok(&[7u8, 8][..]));
        assert_eq!(grpc_message(&[]).unwrap_err().code, Code::Internal);
        assert_eq!(grpc_message(&[1, 0, 0, 0, 0]).unwrap_err().code, Code::Unimplemented);
        assert_eq!(grpc_message(&[0, 0, 0, 0, 1, 7, 8]).unwrap_err().code, Code::InvalidArgument);
    }
}
