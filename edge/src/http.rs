//! The one HTTP/1.1 accept loop of every TCP listener a baleen daemon serves: connections
//! admitted by a [`Gate`] (per peer and in all, idle ones closed first), a TLS handshake and
//! each request's headers within [`Bounds::header_timeout`], at most [`Bounds::max_buffer`]
//! bytes buffered, and a connection's life within [`Bounds::lifetime`]. A connection is busy
//! from a request's arrival until its answer has been written whole (a client that does not
//! read its answer holds a busy slot, so it counts against its peer's cap). Each request carries
//! when it arrived ([`Arrived`]).

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio_util::sync::CancellationToken;
use tower::ServiceExt as _;

use crate::gate::{Busy, Gate, Peer};

/// When a request arrived: its headers read, before its body, a concurrency limit or a
/// handler (an extension of every request this loop serves). A latency measured from it
/// counts the time a request waited for its turn, as the client sees it.
#[derive(Debug, Clone, Copy)]
pub struct Arrived(pub std::time::Instant);

/// What one connection may take.
#[derive(Debug, Clone, Copy)]
pub struct Bounds {
    /// Time for a TLS handshake, and for each request's headers (at the start and between
    /// keep-alive requests).
    pub header_timeout: Duration,
    /// How long a connection may live, whatever it does (`None`: as long as it is used).
    pub lifetime: Option<Duration>,
    /// The most bytes buffered per connection (a request's headers included).
    pub max_buffer: usize,
}

impl Default for Bounds {
    fn default() -> Self {
        Self {
            header_timeout: Duration::from_secs(5),
            lifetime: Some(Duration::from_secs(300)),
            max_buffer: 64 * 1024,
        }
    }
}

/// How a connection starts.
#[derive(Clone)]
enum Handshake {
    Plain,
    #[cfg(feature = "tls")]
    Tls(tokio_rustls::TlsAcceptor),
}

/// Binds `address` now (readiness by binding, not by sleeping) and returns the bound address
/// and the server, which serves `router` until `shutdown`, admitting connections by `gate`.
pub async fn bind(
    address: SocketAddr,
    router: Router,
    gate: Arc<Gate>,
    bounds: Bounds,
    shutdown: CancellationToken,
) -> std::io::Result<(SocketAddr, impl Future<Output = ()> + Send + 'static)> {
    bind_with(address, router, gate, bounds, Handshake::Plain, shutdown).await
}

/// [`bind`] over TLS with `config`.
#[cfg(feature = "tls")]
pub async fn bind_tls(
    address: SocketAddr,
    router: Router,
    gate: Arc<Gate>,
    bounds: Bounds,
    config: Arc<tokio_rustls::rustls::ServerConfig>,
    shutdown: CancellationToken,
) -> std::io::Result<(SocketAddr, impl Future<Output = ()> + Send + 'static)> {
    let tls = Handshake::Tls(tokio_rustls::TlsAcceptor::from(config));
    bind_with(address, router, gate, bounds, tls, shutdown).await
}

async fn bind_with(
    address: SocketAddr,
    router: Router,
    gate: Arc<Gate>,
    bounds: Bounds,
    handshake: Handshake,
    shutdown: CancellationToken,
) -> std::io::Result<(SocketAddr, impl Future<Output = ()> + Send + 'static)> {
    let listener = tokio::net::TcpListener::bind(address).await?;
    let bound = listener.local_addr()?;
    Ok((bound, accept(listener, router, gate, bounds, handshake, shutdown)))
}

async fn accept(
    listener: tokio::net::TcpListener,
    router: Router,
    gate: Arc<Gate>,
    bounds: Bounds,
    handshake: Handshake,
    shutdown: CancellationToken,
) {
    let mut connections = tokio::task::JoinSet::new();
    loop {
        let accepted = tokio::select! {
            () = shutdown.cancelled() => break,
            a = listener.accept() => a,
        };
        while connections.try_join_next().is_some() {}
        let (stream, peer) = match accepted {
            Ok(a) => a,
            Err(e) => {
                // Out of file descriptors and the like: wait, do not spin.
                tracing::warn!(error = %e, "cannot accept a connection");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let Some(slot) = gate.admit(Peer::Ip(peer.ip())) else {
            drop(stream);
            continue;
        };
        let router = router.clone();
        let handshake = handshake.clone();
        let shutdown = shutdown.clone();
        connections.spawn(async move {
            let slot = Arc::new(slot);
            match handshake {
                Handshake::Plain => serve(stream, router, slot, bounds, shutdown).await,
                #[cfg(feature = "tls")]
                Handshake::Tls(acceptor) => {
                    // Idle (so the first to give way) until the handshake is done.
                    let closed = slot.closed().clone();
                    let handshook = tokio::select! {
                        () = closed.cancelled() => return,
                        h = tokio::time::timeout(bounds.header_timeout, acceptor.accept(stream)) => h,
                    };
                    match handshook {
                        Ok(Ok(stream)) => serve(stream, router, slot, bounds, shutdown).await,
                        Ok(Err(e)) => tracing::debug!(error = %e, "a TLS handshake failed"),
                        Err(_) => tracing::debug!("a TLS handshake timed out"),
                    }
                }
            }
        });
    }
    // Connections finish what they serve, for a while.
    let drain = async { while connections.join_next().await.is_some() {} };
    if tokio::time::timeout(Duration::from_secs(5), drain).await.is_err() {
        connections.shutdown().await;
    }
}

/// Serves one admitted connection until it ends, its slot is taken back (dropped at once: it
/// was idle), `shutdown` (gracefully, for two seconds) or its lifetime runs out (the same).
async fn serve<I>(
    io: I,
    router: Router,
    slot: Arc<crate::gate::Slot>,
    bounds: Bounds,
    shutdown: CancellationToken,
) where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let closed = slot.closed().clone();
    let service = tower::service_fn(move |mut request: http::Request<hyper::body::Incoming>| {
        request.extensions_mut().insert(Arrived(std::time::Instant::now()));
        let busy = slot.busy();
        let router = router.clone();
        async move {
            let response = router.oneshot(request).await?;
            Ok::<_, std::convert::Infallible>(response.map(|body| Guarded { body, _busy: busy }))
        }
    });
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(bounds.header_timeout)
        .max_buf_size(bounds.max_buffer);
    let connection = builder.serve_connection(
        hyper_util::rt::TokioIo::new(io),
        hyper_util::service::TowerToHyperService::new(service),
    );
    tokio::pin!(connection);
    let lifetime = async {
        match bounds.lifetime {
            Some(d) => tokio::time::sleep(d).await,
            None => std::future::pending().await,
        }
    };
    tokio::select! {
        ended = connection.as_mut() => {
            if let Err(e) = ended {
                tracing::debug!(error = %e, "a connection ended with an error");
            }
            return;
        }
        () = closed.cancelled() => return,
        () = shutdown.cancelled() => {}
        () = lifetime => {}
    }
    connection.as_mut().graceful_shutdown();
    let _ = tokio::time::timeout(Duration::from_secs(2), connection).await;
}

/// An answer's body that keeps its connection busy until it has been written whole.
struct Guarded {
    body: axum::body::Body,
    _busy: Busy,
}

impl http_body::Body for Guarded {
    type Data = bytes::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}
