//! What one client can hold of a plugin's server: the kubelet dials each plugin socket with one
//! connection, so a socket takes at most [`MAX_CONNECTIONS`] at once, admitted by the one policy
//! of every listener (`baleen_edge::gate`: a gRPC connection is held busy for its life, so more
//! are closed at accept, counted, and logged once a burst), each with at most [`MAX_STREAMS`] concurrent streams, small HTTP/2 windows (the
//! memory a peer can make the server buffer) and keep-alive pings that close a dead peer's
//! connection.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use baleen_edge::gate::{Gate, Limits, Peer, Slot};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{UnixListener, UnixStream};
use tokio_stream::{Stream, StreamExt as _};

/// The most connections one plugin socket holds at once.
pub const MAX_CONNECTIONS: usize = 16;
/// The most concurrent streams (calls) per connection.
pub const MAX_STREAMS: u32 = 32;
/// HTTP/2 flow-control windows: what a peer can make the server buffer per stream and per
/// connection.
const STREAM_WINDOW: u32 = 64 * 1024;
const CONNECTION_WINDOW: u32 = 256 * 1024;
/// Keep-alive pings, and how long an unanswered one may wait before the connection closes.
const KEEPALIVE: Duration = Duration::from_secs(30);
const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(10);
/// The most bytes of headers a request may carry.
const MAX_HEADERS: u32 = 16 * 1024;

/// A tonic server builder with those bounds.
pub fn bounded_server() -> tonic::transport::Server {
    tonic::transport::Server::builder()
        .max_concurrent_streams(Some(MAX_STREAMS))
        .initial_stream_window_size(Some(STREAM_WINDOW))
        .initial_connection_window_size(Some(CONNECTION_WINDOW))
        .http2_keepalive_interval(Some(KEEPALIVE))
        .http2_keepalive_timeout(Some(KEEPALIVE_TIMEOUT))
        .http2_max_header_list_size(Some(MAX_HEADERS))
}

/// A connection holding one of its socket's slots while it lives.
pub struct Slotted {
    stream: UnixStream,
    _slot: Slot,
}

/// The connections of `listener`, at most [`MAX_CONNECTIONS`] at once: one more is closed as
/// soon as it is accepted.
pub fn slotted(listener: UnixListener) -> impl Stream<Item = std::io::Result<Slotted>> {
    let gate: Arc<Gate> = Gate::new(
        "device-plugin socket",
        Limits { total: MAX_CONNECTIONS, per_peer: MAX_CONNECTIONS },
    );
    tokio_stream::wrappers::UnixListenerStream::new(listener).filter_map(move |accepted| {
        match accepted {
            // Closed at once when the socket holds its most.
            Ok(stream) => {
                gate.admit(Peer::Local).map(|slot| Ok(Slotted { stream, _slot: slot.hold() }))
            }
            Err(e) => Some(Err(e)),
        }
    })
}

impl tonic::transport::server::Connected for Slotted {
    type ConnectInfo = <UnixStream as tonic::transport::server::Connected>::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.stream.connect_info()
    }
}

impl AsyncRead for Slotted {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for Slotted {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 22, item 6: a socket holds at most MAX_CONNECTIONS connections; a slot comes back
    /// when one closes.
    #[tokio::test]
    async fn a_socket_holds_at_most_its_connections() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("p.sock");
        let mut incoming = Box::pin(slotted(UnixListener::bind(&path).expect("bind")));
        let mut clients = Vec::new();
        let mut held = Vec::new();
        for _ in 0..MAX_CONNECTIONS {
            clients.push(UnixStream::connect(&path).await.expect("connect"));
            held.push(incoming.next().await.expect("one").expect("accepted"));
        }
        // One more: accepted by the kernel, closed by the server, never yielded.
        let mut extra = UnixStream::connect(&path).await.expect("connect");
        let next = tokio::time::timeout(Duration::from_millis(200), incoming.next()).await;
        assert!(next.is_err(), "a connection beyond the cap was yielded");
        let mut byte = [0u8; 1];
        let read = tokio::io::AsyncReadExt::read(&mut extra, &mut byte).await;
        assert!(matches!(read, Ok(0) | Err(_)), "closed: {read:?}");
        // One closes: the next is served.
        held.pop();
        clients.push(UnixStream::connect(&path).await.expect("connect"));
        let next = tokio::time::timeout(Duration::from_secs(2), incoming.next()).await;
        assert!(matches!(next, Ok(Some(Ok(_)))), "a slot came back");
    }
}
