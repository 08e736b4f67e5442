//! A fake Kubernetes API server on loopback, answering the calls baleen makes the way the real
//! one does, and able to go away and come back on the same address:
//! - Nodes (`/api/v1/nodes`), Namespaces (`/api/v1/namespaces`) and Pods (`/api/v1/pods`,
//!   `/api/v1/namespaces/{ns}/pods/{name}`):
//!   `list` (with the collection's `resourceVersion`), `watch` (`?watch=true`: newline-separated
//!   `ADDED`/`MODIFIED`/`DELETED` events after the given `resourceVersion`, kept open) and `get`;
//!   A `fieldSelector` of `spec.nodeName=<node>` (pods) or `metadata.name=<name>` is honoured as
//!   the real server does, and so is a label selector naming one key that must exist: a watch
//!   sees an object that comes to match as `ADDED` and one that stops matching as `DELETED`;
//!   any other selector is refused (400);
//! - `PATCH /api/v1/nodes/{name}` with a JSON merge patch of `metadata.annotations` (what the
//!   agent's node-state publisher sends): merges, answers the Node's metadata
//!   (`PartialObjectMetadata`), and tells watchers (`MODIFIED`); 404 for an unknown node;
//! - `POST /api/v1/namespaces/{ns}/pods/{name}/binding` (what a scheduler sends): sets the pod's
//!   `spec.nodeName`;
//! - `POST /apis/events.k8s.io/v1/namespaces/{ns}/events` (the agent's watchdog): validated as
//!   the real server does for the required fields, named, recorded (read them with
//!   [`FakeApiServer::requests`]).
//!
//! Tests put and delete objects directly ([`FakeApiServer::put_node`], ...). Every request is
//! recorded. [`FakeApiServer::stop`] closes the listener and every connection, watches included
//! (the API server going away); [`FakeApiServer::start_again`] serves again on the same port
//! with the same objects and resource versions.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::{Value, json};
use tokio::sync::{broadcast, watch};
use tokio_util::sync::CancellationToken;

/// One request the server answered.
#[derive(Debug, Clone)]
pub struct Recorded {
    /// `PATCH`, `GET`, `POST`.
    pub method: String,
    /// The path (without the query).
    pub path: String,
    /// The `Content-Type` header.
    pub content_type: String,
    /// The body, as JSON (`Null` when empty).
    pub body: Value,
    /// When it came.
    pub at: std::time::Instant,
}

/// Which collection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Kind {
    Node,
    Pod,
    Namespace,
}

impl Kind {
    fn list_kind(self) -> &'static str {
        match self {
            Kind::Node => "NodeList",
            Kind::Pod => "PodList",
            Kind::Namespace => "NamespaceList",
        }
    }
}

#[derive(Debug, Clone)]
struct Event {
    rv: u64,
    kind: Kind,
    type_: &'static str,
    object: Value,
    /// The object before a `MODIFIED`.
    previous: Option<Value>,
}

struct World {
    rv: u64,
    objects: BTreeMap<(Kind, String), Value>,
    log: Vec<Event>,
    requests: Vec<Recorded>,
    events: broadcast::Sender<Event>,
    /// While held ([`FakeApiServer::hold_watches`]): the events open watches have not been sent.
    held: Option<Vec<Event>>,
}

impl World {
    /// Stores `object` under `key` with a new resource version and tells watchers.
    fn put(&mut self, kind: Kind, key: String, mut object: Value) -> Value {
        self.rv += 1;
        object["metadata"]["resourceVersion"] = Value::String(self.rv.to_string());
        let previous = self.objects.insert((kind, key), object.clone());
        let type_ = if previous.is_some() { "MODIFIED" } else { "ADDED" };
        self.emit(kind, type_, object.clone(), previous);
        object
    }

    fn delete(&mut self, kind: Kind, key: &str) -> Option<Value> {
        let mut object = self.objects.remove(&(kind, key.to_owned()))?;
        self.rv += 1;
        object["metadata"]["resourceVersion"] = Value::String(self.rv.to_string());
        self.emit(kind, "DELETED", object.clone(), None);
        Some(object)
    }

    fn emit(&mut self, kind: Kind, type_: &'static str, object: Value, previous: Option<Value>) {
        let event = Event { rv: self.rv, kind, type_, object, previous };
        self.log.push(event.clone());
        match &mut self.held {
            Some(held) => held.push(event),
            None => {
                let _ = self.events.send(event);
            }
        }
    }
}

type Shared = Arc<(Mutex<World>, watch::Sender<u64>)>;

/// The fake API server.
pub struct FakeApiServer {
    shared: Shared,
    address: SocketAddr,
    stop: CancellationToken,
    listening: Option<tokio::task::JoinHandle<()>>,
}

fn key_of(kind: Kind, object: &Value) -> String {
    let name = object["metadata"]["name"].as_str().unwrap_or_default();
    match kind {
        Kind::Node | Kind::Namespace => name.to_owned(),
        Kind::Pod => {
            format!("{}/{name}", object["metadata"]["namespace"].as_str().unwrap_or("default"))
        }
    }
}

impl FakeApiServer {
    /// Serves on a free loopback port, with the given nodes (no annotations, no capacity).
    pub async fn start(nodes: &[&str]) -> std::io::Result<Self> {
        let world = World {
            rv: 0,
            objects: BTreeMap::new(),
            log: Vec::new(),
            requests: Vec::new(),
            events: broadcast::channel(4096).0,
            held: None,
        };
        let shared: Shared = Arc::new((Mutex::new(world), watch::channel(0).0));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let address = listener.local_addr()?;
        let (stop, listening) = serve(listener, shared.clone());
        let server = Self { shared, address, stop, listening: Some(listening) };
        for n in nodes {
            server.put_node(json!({"metadata": {"name": n}}));
        }
        Ok(server)
    }

    /// From now on open watches get no event (a watch delayed as a loaded API server delays
    /// it); every change is still made and answered. [`Self::release_watches`] sends them.
    pub fn hold_watches(&self) {
        let mut world = self.shared.0.lock().unwrap_or_else(PoisonError::into_inner);
        world.held.get_or_insert_with(Vec::new);
    }

    /// Sends open watches every event held since [`Self::hold_watches`], in order.
    pub fn release_watches(&self) {
        let mut world = self.shared.0.lock().unwrap_or_else(PoisonError::into_inner);
        for event in world.held.take().unwrap_or_default() {
            let _ = world.events.send(event);
        }
    }

    /// Its URL, `http://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("http://{}", self.address)
    }

    /// Goes away: the listener and every open connection close (returns once the port is
    /// free).
    pub async fn stop(&mut self) {
        self.stop.cancel();
        if let Some(listening) = self.listening.take() {
            let _ = listening.await;
        }
    }

    /// Comes back on the same address with the same state.
    pub async fn start_again(&mut self) -> std::io::Result<()> {
        let listener = tokio::net::TcpListener::bind(self.address).await?;
        let (stop, listening) = serve(listener, self.shared.clone());
        self.stop = stop;
        self.listening = Some(listening);
        Ok(())
    }

    fn world(&self) -> std::sync::MutexGuard<'_, World> {
        self.shared.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Adds or replaces a Node (watchers see it); returns it as stored.
    pub fn put_node(&self, node: Value) -> Value {
        let key = key_of(Kind::Node, &node);
        self.world().put(Kind::Node, key, node)
    }

    /// Deletes a Node.
    pub fn delete_node(&self, name: &str) {
        self.world().delete(Kind::Node, name);
    }

    /// Adds or replaces a Pod.
    pub fn put_pod(&self, pod: Value) -> Value {
        let key = key_of(Kind::Pod, &pod);
        self.world().put(Kind::Pod, key, pod)
    }

    /// Adds or replaces a Namespace (watchers see it).
    pub fn put_namespace(&self, namespace: Value) -> Value {
        let key = key_of(Kind::Namespace, &namespace);
        self.world().put(Kind::Namespace, key, namespace)
    }

    /// Deletes a Pod (`namespace/name`).
    pub fn delete_pod(&self, key: &str) {
        self.world().delete(Kind::Pod, key);
    }

    /// A Pod (`namespace/name`).
    pub fn pod(&self, key: &str) -> Option<Value> {
        self.world().objects.get(&(Kind::Pod, key.to_owned())).cloned()
    }

    /// A node's annotation now.
    pub fn annotation(&self, node: &str, key: &str) -> Option<String> {
        let world = self.world();
        let n = world.objects.get(&(Kind::Node, node.to_owned()))?;
        n["metadata"]["annotations"][key].as_str().map(str::to_owned)
    }

    /// Every request answered so far.
    pub fn requests(&self) -> Vec<Recorded> {
        self.world().requests.clone()
    }

    /// Follows the number of requests answered (told again when a write has been applied).
    pub fn watch_requests(&self) -> watch::Receiver<u64> {
        self.shared.1.subscribe()
    }
}

impl Drop for FakeApiServer {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

#[derive(Clone)]
struct AppState {
    shared: Shared,
    stop: CancellationToken,
}

fn serve(
    listener: tokio::net::TcpListener,
    shared: Shared,
) -> (CancellationToken, tokio::task::JoinHandle<()>) {
    let stop = CancellationToken::new();
    let app = Router::new()
        .route("/api/v1/nodes", get(list_nodes))
        .route("/api/v1/nodes/{name}", get(get_node).patch(patch_node))
        .route("/api/v1/pods", get(list_pods))
        .route("/api/v1/namespaces", get(list_namespaces))
        .route("/api/v1/namespaces/{ns}/pods/{name}", get(get_pod))
        .route("/api/v1/namespaces/{ns}/pods/{name}/binding", post(bind_pod))
        .route("/apis/events.k8s.io/v1/namespaces/{ns}/events", post(create_event))
        .with_state(AppState { shared, stop: stop.clone() });
    let token = stop.clone();
    let listening = tokio::spawn(async move {
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
    (stop, listening)
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

fn json_response(code: StatusCode, body: &Value) -> Response {
    (code, [("content-type", "application/json")], body.to_string()).into_response()
}

fn status(code: StatusCode, reason: &str, message: String) -> Response {
    let body = json!({
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": message, "reason": reason, "code": code.as_u16()
    });
    json_response(code, &body)
}

/// The query's parameters, percent-decoded.
fn query(uri: &Uri) -> BTreeMap<String, String> {
    uri.query()
        .unwrap_or_default()
        .split('&')
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (decode(k), decode(v)))
        .collect()
}

fn decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = bytes.get(i + 1..i + 3).and_then(|h| std::str::from_utf8(h).ok());
        match (bytes[i], hex.and_then(|h| u8::from_str_radix(h, 16).ok())) {
            (b'%', Some(b)) => {
                out.push(b);
                i += 3;
            }
            (b'+', _) => {
                out.push(b' ');
                i += 1;
            }
            (b, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The selectors the server can answer: a field selector `(JSON pointer, value)` and a label
/// selector naming one key that must exist.
#[derive(Debug, Clone, Default)]
struct Selector {
    field: Option<(&'static str, String)>,
    label: Option<String>,
}

fn selector(kind: Kind, q: &BTreeMap<String, String>) -> Result<Selector, String> {
    let mut selector = Selector::default();
    if let Some(text) = q.get("labelSelector").filter(|s| !s.is_empty()) {
        // Only `key` (the label exists) is answered here; anything else is refused.
        if text.contains(['=', '!', ',', '(', ' ']) {
            return Err(format!("label selector not supported by the fake: {text}"));
        }
        selector.label = Some(text.clone());
    }
    let Some(text) = q.get("fieldSelector").filter(|s| !s.is_empty()) else {
        return Ok(selector);
    };
    // `field=value` or `field==value`, as the real server reads them.
    let (field, value) = text.split_once('=').unwrap_or((text, ""));
    let value = value.strip_prefix('=').unwrap_or(value);
    let pointer = match (kind, field) {
        (Kind::Pod, "spec.nodeName") => "/spec/nodeName",
        (_, "metadata.name") => "/metadata/name",
        _ => return Err(format!("field label not supported: {field}")),
    };
    selector.field = Some((pointer, value.to_owned()));
    Ok(selector)
}

fn matches(selector: &Selector, object: &Value) -> bool {
    let field = selector.field.as_ref().is_none_or(|(pointer, value)| {
        object.pointer(pointer).and_then(Value::as_str).unwrap_or_default() == value
    });
    let label = selector
        .label
        .as_ref()
        .is_none_or(|key| object["metadata"]["labels"].get(key.as_str()).is_some());
    field && label
}

/// The event a watch with `selector` sees for `e`, if any.
fn seen(selector: &Selector, e: &Event) -> Option<&'static str> {
    let now = matches(selector, &e.object);
    let before = e.previous.as_ref().is_some_and(|p| matches(selector, p));
    match (e.type_, before, now) {
        ("MODIFIED", true, true) => Some("MODIFIED"),
        ("MODIFIED", false, true) => Some("ADDED"),
        ("MODIFIED", true, false) => Some("DELETED"),
        ("MODIFIED", false, false) => None,
        (other, _, true) => Some(other),
        _ => None,
    }
}

async fn list_nodes(State(app): State<AppState>, uri: Uri, headers: HeaderMap) -> Response {
    list_or_watch(app, Kind::Node, uri, headers)
}

async fn list_pods(State(app): State<AppState>, uri: Uri, headers: HeaderMap) -> Response {
    list_or_watch(app, Kind::Pod, uri, headers)
}

async fn list_namespaces(State(app): State<AppState>, uri: Uri, headers: HeaderMap) -> Response {
    list_or_watch(app, Kind::Namespace, uri, headers)
}

fn list_or_watch(app: AppState, kind: Kind, uri: Uri, headers: HeaderMap) -> Response {
    record(&app.shared, "GET", uri.path().to_owned(), &headers, &Bytes::new());
    let q = query(&uri);
    let selector = match selector(kind, &q) {
        Ok(s) => s,
        Err(refused) => return status(StatusCode::BAD_REQUEST, "BadRequest", refused),
    };
    let world = app.shared.0.lock().unwrap_or_else(PoisonError::into_inner);
    if q.get("watch").map(String::as_str) != Some("true") {
        let items: Vec<Value> = world
            .objects
            .iter()
            .filter(|((k, _), v)| *k == kind && matches(&selector, v))
            .map(|(_, v)| v.clone())
            .collect();
        let body = json!({
            "kind": kind.list_kind(), "apiVersion": "v1",
            "metadata": {"resourceVersion": world.rv.to_string()},
            "items": items
        });
        return json_response(StatusCode::OK, &body);
    }
    let from: u64 = q.get("resourceVersion").and_then(|v| v.parse().ok()).unwrap_or(world.rv);
    let timeout = q
        .get("timeoutSeconds")
        .and_then(|v| v.parse().ok())
        .map_or(Duration::from_secs(300), Duration::from_secs);
    let backlog: Vec<Event> =
        world.log.iter().filter(|e| e.kind == kind && e.rv > from).cloned().collect();
    let mut live = world.events.subscribe();
    drop(world);
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::convert::Infallible>>(256);
    let stop = app.stop.clone();
    let line = move |e: &Event| {
        let type_ = seen(&selector, e)?;
        let mut text = json!({"type": type_, "object": e.object}).to_string();
        text.push('\n');
        Some(Ok(Bytes::from(text)))
    };
    tokio::spawn(async move {
        let mut last = from;
        for e in &backlog {
            last = e.rv;
            if let Some(l) = line(e)
                && tx.send(l).await.is_err()
            {
                return;
            }
        }
        let deadline = tokio::time::sleep(timeout);
        tokio::pin!(deadline);
        loop {
            tokio::select! {
                () = stop.cancelled() => return,
                () = &mut deadline => return,
                e = live.recv() => match e {
                    Ok(e) if e.kind == kind && e.rv > last => {
                        last = e.rv;
                        if let Some(l) = line(&e)
                            && tx.send(l).await.is_err()
                        {
                            return;
                        }
                    }
                    Ok(_) => {}
                    // Too far behind, or the server is gone: the client lists again.
                    Err(_) => return,
                },
            }
        }
    });
    let body = Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(rx));
    (StatusCode::OK, [("content-type", "application/json")], body).into_response()
}

async fn get_node(
    State(app): State<AppState>,
    Path(name): Path<String>,
    headers: HeaderMap,
) -> Response {
    record(&app.shared, "GET", format!("/api/v1/nodes/{name}"), &headers, &Bytes::new());
    let world = app.shared.0.lock().unwrap_or_else(PoisonError::into_inner);
    match world.objects.get(&(Kind::Node, name.clone())) {
        Some(n) => json_response(StatusCode::OK, n),
        None => status(StatusCode::NOT_FOUND, "NotFound", format!("nodes \"{name}\" not found")),
    }
}

async fn get_pod(
    State(app): State<AppState>,
    Path((ns, name)): Path<(String, String)>,
    headers: HeaderMap,
) -> Response {
    let path = format!("/api/v1/namespaces/{ns}/pods/{name}");
    record(&app.shared, "GET", path, &headers, &Bytes::new());
    let world = app.shared.0.lock().unwrap_or_else(PoisonError::into_inner);
    match world.objects.get(&(Kind::Pod, format!("{ns}/{name}"))) {
        Some(p) => json_response(StatusCode::OK, p),
        None => status(StatusCode::NOT_FOUND, "NotFound", format!("pods \"{name}\" not found")),
    }
}

async fn patch_node(
    State(app): State<AppState>,
    Path(name): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    record(&app.shared, "PATCH", format!("/api/v1/nodes/{name}"), &headers, &body);
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
    let mut world = app.shared.0.lock().unwrap_or_else(PoisonError::into_inner);
    let Some(mut node) = world.objects.get(&(Kind::Node, name.clone())).cloned() else {
        return status(StatusCode::NOT_FOUND, "NotFound", format!("nodes \"{name}\" not found"));
    };
    if let Some(map) = patch.pointer("/metadata/annotations").and_then(Value::as_object) {
        if !node["metadata"]["annotations"].is_object() {
            node["metadata"]["annotations"] = json!({});
        }
        for (k, v) in map {
            match v {
                Value::Null => {
                    node["metadata"]["annotations"].as_object_mut().map(|a| a.remove(k));
                }
                Value::String(_) => node["metadata"]["annotations"][k] = v.clone(),
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
    let stored = world.put(Kind::Node, name.clone(), node);
    drop(world);
    // Followers of the requests are told again once the patch is applied (the request was
    // recorded before it was): one that looked in between sees the new object.
    app.shared.1.send_modify(|_| {});
    let meta = json!({
        "kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1",
        "metadata": stored["metadata"]
    });
    json_response(StatusCode::OK, &meta)
}

/// `POST` of an `events.k8s.io/v1` Event: checked for what the real server requires of one
/// (namespace matching the path, `eventTime`, `reportingController`, `reportingInstance`,
/// `action`, `reason`, a `type` of Normal or Warning), named from `generateName`, answered.
async fn create_event(
    State(app): State<AppState>,
    Path(ns): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let path = format!("/apis/events.k8s.io/v1/namespaces/{ns}/events");
    record(&app.shared, "POST", path, &headers, &body);
    let Ok(mut event) = serde_json::from_slice::<Value>(&body) else {
        return status(StatusCode::BAD_REQUEST, "BadRequest", "invalid JSON".into());
    };
    let missing: Vec<&str> =
        ["eventTime", "reportingController", "reportingInstance", "action", "reason", "type"]
            .into_iter()
            .filter(|f| event[*f].as_str().is_none_or(str::is_empty))
            .collect();
    let namespace_ok = event["metadata"]["namespace"].as_str().is_none_or(|n| n == ns);
    let type_ok = matches!(event["type"].as_str(), Some("Normal" | "Warning"));
    if !missing.is_empty() || !namespace_ok || !type_ok {
        return status(
            StatusCode::UNPROCESSABLE_ENTITY,
            "Invalid",
            format!(
                "Event is invalid: missing {missing:?}, namespace ok {namespace_ok}, type ok {type_ok}"
            ),
        );
    }
    let mut world = app.shared.0.lock().unwrap_or_else(PoisonError::into_inner);
    world.rv += 1;
    let name =
        format!("{}{}", event["metadata"]["generateName"].as_str().unwrap_or("event-"), world.rv);
    event["metadata"]["name"] = Value::String(name);
    event["metadata"]["namespace"] = Value::String(ns);
    event["metadata"]["resourceVersion"] = Value::String(world.rv.to_string());
    json_response(StatusCode::CREATED, &event)
}

async fn bind_pod(
    State(app): State<AppState>,
    Path((ns, name)): Path<(String, String)>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let path = format!("/api/v1/namespaces/{ns}/pods/{name}/binding");
    record(&app.shared, "POST", path, &headers, &body);
    let Ok(binding) = serde_json::from_slice::<Value>(&body) else {
        return status(StatusCode::BAD_REQUEST, "BadRequest", "invalid JSON".into());
    };
    let Some(node) = binding.pointer("/target/name").and_then(Value::as_str) else {
        return status(StatusCode::BAD_REQUEST, "BadRequest", "no target.name".into());
    };
    let mut world = app.shared.0.lock().unwrap_or_else(PoisonError::into_inner);
    let key = format!("{ns}/{name}");
    let Some(mut pod) = world.objects.get(&(Kind::Pod, key.clone())).cloned() else {
        return status(StatusCode::NOT_FOUND, "NotFound", format!("pods \"{name}\" not found"));
    };
    if pod["spec"]["nodeName"].as_str().is_some_and(|n| !n.is_empty()) {
        return status(
            StatusCode::CONFLICT,
            "Conflict",
            format!("pod {name} is already assigned to node {}", pod["spec"]["nodeName"]),
        );
    }
    pod["spec"]["nodeName"] = Value::String(node.to_owned());
    world.put(Kind::Pod, key, pod);
    drop(world);
    app.shared.1.send_modify(|_| {});
    json_response(
        StatusCode::CREATED,
        &json!({"kind": "Status", "apiVersion": "v1", "status": "Success"}),
    )
}
