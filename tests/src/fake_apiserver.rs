//! A fake Kubernetes API server on loopback, answering the calls baleen makes the way the real
//! one does, and able to go away and come back on the same address:
//! - `PATCH /api/v1/nodes/{name}` with a JSON merge patch of `metadata` (what the agent's
//!   node-state publisher sends): merges the annotations into its Node, answers the Node's
//!   metadata (`PartialObjectMetadata`, as for kube-rs' `patch_metadata`), 404 for an unknown
//!   node;
//! - `GET /api/v1/nodes/{name}`: the Node.
//!
//! Every request is recorded. [`FakeApiServer::stop`] closes the listener and every connection
//! (the API server going away); [`FakeApiServer::start_again`] serves again on the same port.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, PoisonError};

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use serde_json::{Value, json};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// One request the server answered.
#[derive(Debug, Clone)]
pub struct Recorded {
    /// `PATCH`, `GET`.
    pub method: String,
    /// The path.
    pub path: String,
    /// The `Content-Type` header.
    pub content_type: String,
    /// The body, as JSON (`Null` when empty).
    pub body: Value,
    /// When it came.
    pub at: std::time::Instant,
}

#[derive(Default)]
struct World {
    /// Node name to its annotations.
    nodes: BTreeMap<String, BTreeMap<String, String>>,
    requests: Vec<Recorded>,
}

type Shared = Arc<(Mutex<World>, watch::Sender<u64>)>;

/// The fake API server.
pub struct FakeApiServer {
    shared: Shared,
    address: SocketAddr,
    stop: CancellationToken,
}

impl FakeApiServer {
    /// Serves on a free loopback port, with the given nodes (no annotations).
    pub async fn start(nodes: &[&str]) -> std::io::Result<Self> {
        let mut world = World::default();
        for n in nodes {
            world.nodes.insert((*n).to_owned(), BTreeMap::new());
        }
        let shared: Shared = Arc::new((Mutex::new(world), watch::channel(0).0));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let address = listener.local_addr()?;
        let stop = serve(listener, shared.clone());
        Ok(Self { shared, address, stop })
    }

    /// Its URL, `http://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("http://{}", self.address)
    }

    /// Goes away: the listener and every open connection close.
    pub fn stop(&mut self) {
        self.stop.cancel();
    }

    /// Comes back on the same address with the same state.
    pub async fn start_again(&mut self) -> std::io::Result<()> {
        let listener = tokio::net::TcpListener::bind(self.address).await?;
        self.stop = serve(listener, self.shared.clone());
        Ok(())
    }

    fn world(&self) -> std::sync::MutexGuard<'_, World> {
        self.shared.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A node's annotation now.
    pub fn annotation(&self, node: &str, key: &str) -> Option<String> {
        self.world().nodes.get(node).and_then(|a| a.get(key).cloned())
    }

    /// Every request answered so far.
    pub fn requests(&self) -> Vec<Recorded> {
        self.world().requests.clone()
    }

    /// Follows the number of requests answered.
    pub fn watch_requests(&self) -> watch::Receiver<u64> {
        self.shared.1.subscribe()
    }
}

impl Drop for FakeApiServer {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

fn serve(listener: tokio::net::TcpListener, shared: Shared) -> CancellationToken {
    let stop = CancellationToken::new();
    let app = Router::new()
        .route("/api/v1/nodes/{name}", get(get_node).patch(patch_node))
        .with_state(shared);
    let token = stop.clone();
    tokio::spawn(async move {
        loop {
            let stream = tokio::select! {
                accepted = listener.accept() => match accepted {
                    Ok((stream, _)) => stream,
                    Err(_) => continue,
                },
                () = token.cancelled() => return,
            };
            let service = hyper_util::service::TowerToHyperService::new(app.clone());
            let token = token.clone();
            tokio::spawn(async move {
                let io = hyper_util::rt::TokioIo::new(stream);
                let connection =
                    hyper::server::conn::http1::Builder::new().serve_connection(io, service);
                // Going away drops every open connection, as a stopped API server does.
                tokio::select! {
                    _ = connection => {}
                    () = token.cancelled() => {}
                }
            });
        }
    });
    stop
}

fn record(shared: &Shared, method: &str, path: String, headers: &HeaderMap, body: &Bytes) {
    let content_type =
        headers.get("content-type").and_then(|v| v.to_str().ok()).unwrap_or_default().to_owned();
    let body = serde_json::from_slice(body).unwrap_or(Value::Null);
    let mut world = shared.0.lock().unwrap_or_else(PoisonError::into_inner);
    world.requests.push(Recorded {
        method: method.into(),
        path,
        content_type,
        body,
        at: std::time::Instant::now(),
    });
    let n = world.requests.len() as u64;
    drop(world);
    shared.1.send_replace(n);
}

fn status(code: StatusCode, reason: &str, message: String) -> Response {
    let body = json!({
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": message, "reason": reason, "code": code.as_u16()
    });
    json_response(code, &body)
}

fn json_response(code: StatusCode, body: &Value) -> Response {
    (code, [("content-type", "application/json")], body.to_string()).into_response()
}

fn node_meta(name: &str, annotations: &BTreeMap<String, String>) -> Value {
    json!({
        "kind": "PartialObjectMetadata",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": { "name": name, "annotations": annotations }
    })
}

async fn get_node(
    State(shared): State<Shared>,
    Path(name): Path<String>,
    headers: HeaderMap,
) -> Response {
    record(&shared, "GET", format!("/api/v1/nodes/{name}"), &headers, &Bytes::new());
    let world = shared.0.lock().unwrap_or_else(PoisonError::into_inner);
    match world.nodes.get(&name) {
        Some(a) => json_response(
            StatusCode::OK,
            &json!({
                "kind": "Node", "apiVersion": "v1",
                "metadata": { "name": name, "annotations": a }
            }),
        ),
        None => status(StatusCode::NOT_FOUND, "NotFound", format!("nodes \"{name}\" not found")),
    }
}

async fn patch_node(
    State(shared): State<Shared>,
    Path(name): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    record(&shared, "PATCH", format!("/api/v1/nodes/{name}"), &headers, &body);
    let content_type = headers.get("content-type").and_then(|v| v.to_str().ok()).unwrap_or("");
    if content_type != "application/merge-patch+json" {
        return status(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "UnsupportedMediaType",
            format!("the body of the request was in an unknown format: {content_type}"),
        );
    }
    let Ok(patch) = serde_json::from_slice::<Value>(&body) else {
        return status(StatusCode::BAD_REQUEST, "BadRequest", "invalid JSON".into());
    };
    let mut world = shared.0.lock().unwrap_or_else(PoisonError::into_inner);
    let Some(annotations) = world.nodes.get_mut(&name) else {
        return status(StatusCode::NOT_FOUND, "NotFound", format!("nodes \"{name}\" not found"));
    };
    if let Some(map) = patch.pointer("/metadata/annotations").and_then(Value::as_object) {
        for (k, v) in map {
            match v {
                Value::Null => {
                    annotations.remove(k);
                }
                Value::String(s) => {
                    annotations.insert(k.clone(), s.clone());
                }
                other => {
                    return status(
                        StatusCode::BAD_REQUEST,
                        "BadRequest",
                        format!("annotation {k} must be a string, not {other}"),
                    );
                }
            }
        }
    }
    json_response(StatusCode::OK, &node_meta(&name, annotations))
}
