//! A fake Kubernetes API server on loopback, answering the calls baleen makes the way the real
//! one does, and able to go away and come back on the same address:
//! - Nodes (`/api/v1/nodes`), Namespaces (`/api/v1/namespaces`) and Pods (`/api/v1/pods`,
//!   `/api/v1/namespaces/{ns}/pods/{name}`):
//!   `list` (with the collection's `resourceVersion`), `watch` (`?watch=true`: newline-separated
//!   `ADDED`/`MODIFIED`/`DELETED` events after the given `resourceVersion`, kept open) and `get`;
//!   A `fieldSelector` of `spec.nodeName=<node>` (pods) or `metadata.name=<name>` is honoured as
//!   the real server does (`=`, `==` and `!=`, and comma-separated conjunctions of them), and so
//!   is a label selector naming one key that must exist: a watch sees an object that comes to
//!   match as `ADDED` and one that stops matching as `DELETED`; any other selector is refused
//!   (400);
//! - `PATCH /api/v1/nodes/{name}` with a JSON merge patch of `metadata.annotations` (what the
//!   agent's node-state publisher sends): merges, answers the Node's metadata
//!   (`PartialObjectMetadata`), and tells watchers (`MODIFIED`); 404 for an unknown node;
//! - `POST /api/v1/namespaces/{ns}/pods/{name}/binding` (what a scheduler sends): sets the pod's
//!   `spec.nodeName`;
//! - `POST /apis/events.k8s.io/v1/namespaces/{ns}/events` (the agent's watchdog): validated as
//!   the real server does for the required fields, named, recorded (read them with
//!   [`FakeApiServer::requests`]);
//! - what a DRA kubelet plugin uses of `resource.k8s.io/v1`:
//!   - ResourceSlices (`/apis/resource.k8s.io/v1/resourceslices[/{name}]`, cluster-scoped):
//!     `list`, `watch` and `get` as above, with the field selectors the real server has for
//!     them (`spec.nodeName`, `spec.driver`, `spec.pool.name`, `metadata.name`); `create`
//!     (`POST`: named from `generateName`, given `uid`, `creationTimestamp` and `generation: 1`;
//!     409 `AlreadyExists`), `update` (`PUT`: 409 `Conflict` for a stale `resourceVersion`,
//!     `generation` bumped when the spec changed, nothing written when nothing changed),
//!     `delete` (with `preconditions`) and `deletecollection` (with the selectors). Every write
//!     is validated as the real server validates a slice (driver, pool, exactly one node
//!     selection, at most 128 devices with unique names, immutable fields): 422 `Invalid`
//!     naming the fields;
//!   - ResourceClaims (`/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims/{name}`):
//!     `get` of what the test put ([`FakeApiServer::put_resource_claim`]);
//!   - DeviceClasses (`/apis/resource.k8s.io/v1/deviceclasses[/{name}]`): `list`, `watch` and
//!     `get` of what the test put ([`FakeApiServer::put_device_class`]).
//!
//! Tests put and delete objects directly ([`FakeApiServer::put_node`], ...,
//! [`FakeApiServer::delete_resource_slices_of_node`], what a kubelet does when it starts).
//! Objects are kept as JSON, as sent. Every request is recorded. [`FakeApiServer::stop`] closes
//! the listener and every connection, watches included (the API server going away);
//! [`FakeApiServer::start_again`] serves again on the same port with the same objects and
//! resource versions.

use std::collections::{BTreeMap, BTreeSet};
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
    /// The `Authorization` header (whose credentials made the request).
    pub authorization: Option<String>,
}

/// Which collection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Kind {
    Node,
    Pod,
    Namespace,
    ResourceSlice,
    ResourceClaim,
    DeviceClass,
}

/// The root of the `resource.k8s.io/v1` paths.
const RESOURCE_V1: &str = "/apis/resource.k8s.io/v1";

impl Kind {
    fn kind(self) -> &'static str {
        match self {
            Kind::Node => "Node",
            Kind::Pod => "Pod",
            Kind::Namespace => "Namespace",
            Kind::ResourceSlice => "ResourceSlice",
            Kind::ResourceClaim => "ResourceClaim",
            Kind::DeviceClass => "DeviceClass",
        }
    }

    fn list_kind(self) -> String {
        format!("{}List", self.kind())
    }

    fn api_version(self) -> &'static str {
        match self {
            Kind::Node | Kind::Pod | Kind::Namespace => "v1",
            Kind::ResourceSlice | Kind::ResourceClaim | Kind::DeviceClass => "resource.k8s.io/v1",
        }
    }

    /// The resource as the real server names it in its messages (`pods`,
    /// `resourceslices.resource.k8s.io`).
    fn resource(self) -> &'static str {
        match self {
            Kind::Node => "nodes",
            Kind::Pod => "pods",
            Kind::Namespace => "namespaces",
            Kind::ResourceSlice => "resourceslices.resource.k8s.io",
            Kind::ResourceClaim => "resourceclaims.resource.k8s.io",
            Kind::DeviceClass => "deviceclasses.resource.k8s.io",
        }
    }

    /// The kind as the real server names it in a validation message
    /// (`ResourceSlice.resource.k8s.io`).
    fn qualified_kind(self) -> String {
        match self.api_version().split_once('/') {
            Some((group, _)) => format!("{}.{group}", self.kind()),
            None => self.kind().to_owned(),
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
    /// How long each Binding waits before it is made and answered.
    binding_delay: std::time::Duration,
    /// Whether the `DRAConsumableCapacity` gate is off ([`FakeApiServer::without_consumable_capacity`]):
    /// ResourceSlices are stored without the fields it serves.
    no_consumable_capacity: bool,
}

/// Drops from a ResourceSlice what an API server without the `DRAConsumableCapacity` gate
/// drops: each device's `allowMultipleAllocations` and its capacities' `requestPolicy`.
fn drop_consumable_capacity(slice: &mut Value) {
    for device in slice["spec"]["devices"].as_array_mut().into_iter().flatten() {
        if let Some(d) = device.as_object_mut() {
            d.remove("allowMultipleAllocations");
        }
        for capacity in device["capacity"].as_object_mut().into_iter().flat_map(|c| c.values_mut())
        {
            if let Some(c) = capacity.as_object_mut() {
                c.remove("requestPolicy");
            }
        }
    }
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
        Kind::Node | Kind::Namespace | Kind::ResourceSlice | Kind::DeviceClass => name.to_owned(),
        Kind::Pod | Kind::ResourceClaim => {
            format!("{}/{name}", object["metadata"]["namespace"].as_str().unwrap_or("default"))
        }
    }
}

/// `object` with what the real server gives every object it stores and the test left out: its
/// `kind`, `apiVersion`, `uid` and `creationTimestamp` (and, for a namespaced kind, the
/// namespace its key says).
fn with_system_fields(kind: Kind, mut object: Value) -> Value {
    if object["kind"].as_str().is_none() {
        object["kind"] = json!(kind.kind());
    }
    if object["apiVersion"].as_str().is_none() {
        object["apiVersion"] = json!(kind.api_version());
    }
    let metadata = &mut object["metadata"];
    if metadata["uid"].as_str().is_none_or(str::is_empty) {
        metadata["uid"] = json!(new_uid());
    }
    if metadata["creationTimestamp"].as_str().is_none() {
        metadata["creationTimestamp"] = json!(now());
    }
    if matches!(kind, Kind::Pod | Kind::ResourceClaim) && metadata["namespace"].as_str().is_none() {
        metadata["namespace"] = json!("default");
    }
    object
}

/// A random version-4 UUID, as the real server gives a new object.
fn new_uid() -> String {
    let bits: u128 = rand::random();
    // The version (4) and the variant (RFC 4122) bits.
    let bits = (bits & !(0xf << 76) & !(0x3 << 62)) | (0x4 << 76) | (0x2 << 62);
    let hex = format!("{bits:032x}");
    format!("{}-{}-{}-{}-{}", &hex[..8], &hex[8..12], &hex[12..16], &hex[16..20], &hex[20..])
}

/// Now, as the real server writes a `metav1.Time` (RFC 3339, whole seconds, UTC).
fn now() -> String {
    let since =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    rfc3339(since)
}

/// The UTC time `since` the Unix epoch, as `YYYY-MM-DDTHH:MM:SSZ` (the civil date from the
/// day count as in Howard Hinnant's `civil_from_days`).
fn rfc3339(since: Duration) -> String {
    let seconds = i64::try_from(since.as_secs()).unwrap_or(i64::MAX / 2);
    let (days, time) = (seconds.div_euclid(86_400), seconds.rem_euclid(86_400));
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let day_of_era = z.rem_euclid(146_097);
    let year_of_era =
        (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let shifted_month = (5 * day_of_year + 2) / 153;
    let day = day_of_year - (153 * shifted_month + 2) / 5 + 1;
    let month = if shifted_month < 10 { shifted_month + 3 } else { shifted_month - 9 };
    let year = year_of_era + era * 400 + i64::from(month <= 2);
    let (hour, minute, second) = (time / 3600, time % 3600 / 60, time % 60);
    format!("{year:04}-{month:02}-{day:02}T{hour:02}:{minute:02}:{second:02}Z")
}

/// What the real server appends to a `generateName` (`k8s.io/apimachinery/pkg/util/rand`: no
/// vowels, so that no word is spelt).
const NAME_ALPHABET: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";

/// `prefix` and five random characters; the prefix is cut to 58 characters as the real server
/// cuts it, so that the name stays a DNS label's length.
fn generated_name(prefix: &str) -> String {
    use rand::Rng as _;
    let prefix = prefix.get(..58).unwrap_or(prefix);
    let mut rng = rand::rng();
    let suffix: String = (0..5)
        .map(|_| char::from(NAME_ALPHABET[rng.random_range(0..NAME_ALPHABET.len())]))
        .collect();
    format!("{prefix}{suffix}")
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
            binding_delay: std::time::Duration::ZERO,
            no_consumable_capacity: false,
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

    /// From now on ResourceSlices are stored as an API server without the
    /// `DRAConsumableCapacity` gate stores them: each device's `allowMultipleAllocations` and
    /// its capacities' `requestPolicy` dropped (silently, as the real one does).
    pub fn without_consumable_capacity(&self) {
        self.world().no_consumable_capacity = true;
    }

    /// From now on open watches get no event (a watch delayed as a loaded API server delays
    /// it); every change is still made and answered. [`Self::release_watches`] sends them.
    pub fn hold_watches(&self) {
        let mut world = self.shared.0.lock().unwrap_or_else(PoisonError::into_inner);
        world.held.get_or_insert_with(Vec::new);
    }

    /// From now on each Binding waits `delay` before it is made and answered, as a loaded API
    /// server answers late.
    pub fn slow_bindings(&self, delay: std::time::Duration) {
        self.world().binding_delay = delay;
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

    /// Its address.
    pub fn address(&self) -> SocketAddr {
        self.address
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

    /// Adds or replaces a ResourceClaim (`metadata.namespace` or `default`), with a `uid` and a
    /// `creationTimestamp` when it has none; returns it as stored. What a scheduler would have
    /// written (`status.allocation.devices.results`, `status.reservedFor`) is the test's to put.
    pub fn put_resource_claim(&self, claim: Value) -> Value {
        let claim = with_system_fields(Kind::ResourceClaim, claim);
        let key = key_of(Kind::ResourceClaim, &claim);
        self.world().put(Kind::ResourceClaim, key, claim)
    }

    /// Deletes a ResourceClaim.
    pub fn delete_resource_claim(&self, namespace: &str, name: &str) {
        self.world().delete(Kind::ResourceClaim, &format!("{namespace}/{name}"));
    }

    /// Adds or replaces a DeviceClass (watchers see it), with a `uid` and a `creationTimestamp`
    /// when it has none; returns it as stored.
    pub fn put_device_class(&self, class: Value) -> Value {
        let class = with_system_fields(Kind::DeviceClass, class);
        let key = key_of(Kind::DeviceClass, &class);
        self.world().put(Kind::DeviceClass, key, class)
    }

    /// Every ResourceSlice stored, by name.
    pub fn resource_slices(&self) -> Vec<Value> {
        let world = self.world();
        world
            .objects
            .iter()
            .filter(|((kind, _), _)| *kind == Kind::ResourceSlice)
            .map(|(_, slice)| slice.clone())
            .collect()
    }

    /// What a kubelet does when it starts: deletes every ResourceSlice whose `spec.nodeName` is
    /// `node` (watchers see each `DELETED`); returns how many.
    pub fn delete_resource_slices_of_node(&self, node: &str) -> usize {
        let mut world = self.world();
        let names: Vec<String> = world
            .objects
            .iter()
            .filter(|((kind, _), slice)| {
                *kind == Kind::ResourceSlice && slice["spec"]["nodeName"].as_str() == Some(node)
            })
            .map(|((_, name), _)| name.clone())
            .collect();
        for name in &names {
            world.delete(Kind::ResourceSlice, name);
        }
        names.len()
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
        .route(
            "/apis/resource.k8s.io/v1/resourceslices",
            get(list_resource_slices).post(create_resource_slice).delete(delete_resource_slices),
        )
        .route(
            "/apis/resource.k8s.io/v1/resourceslices/{name}",
            get(get_resource_slice).put(update_resource_slice).delete(delete_resource_slice),
        )
        .route(
            "/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims/{name}",
            get(get_resource_claim),
        )
        .route("/apis/resource.k8s.io/v1/deviceclasses", get(list_device_classes))
        .route("/apis/resource.k8s.io/v1/deviceclasses/{name}", get(get_device_class))
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
        authorization: headers
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned),
    });
    let n = world.requests.len() as u64;
    drop(world);
    shared.1.send_replace(n);
}

fn json_response(code: StatusCode, body: &Value) -> Response {
    (code, [("content-type", "application/json")], body.to_string()).into_response()
}

fn status(code: StatusCode, reason: &str, message: String) -> Response {
    status_with_details(code, reason, message, Value::Null)
}

/// A failure `Status` with its `details` (the object's name, group and kind, and for `Invalid`
/// the `causes`), left out when `Null`.
fn status_with_details(
    code: StatusCode,
    reason: &str,
    message: String,
    details: Value,
) -> Response {
    let mut body = json!({
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": message, "reason": reason, "code": code.as_u16()
    });
    if !details.is_null() {
        body["details"] = details;
    }
    json_response(code, &body)
}

/// The `details` of a `Status` about the object `name` of `kind`, as the real server writes
/// them (`kind` is the resource, `resourceslices`).
fn details(kind: Kind, name: &str) -> Value {
    let (resource, group) = kind.resource().split_once('.').unwrap_or((kind.resource(), ""));
    json!({"name": name, "group": group, "kind": resource})
}

fn not_found(kind: Kind, name: &str) -> Response {
    let message = format!("{} \"{name}\" not found", kind.resource());
    status_with_details(StatusCode::NOT_FOUND, "NotFound", message, details(kind, name))
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

/// The selectors the server can answer: a field selector (terms that must all hold) and a
/// label selector naming one key that must exist.
#[derive(Debug, Clone, Default)]
struct Selector {
    fields: Vec<FieldTerm>,
    label: Option<String>,
}

/// `field=value` (or `field!=value`) of a field selector, the field as a JSON pointer.
#[derive(Debug, Clone)]
struct FieldTerm {
    pointer: &'static str,
    value: String,
    equal: bool,
}

/// The fields the real server can select `kind` by, as JSON pointers.
fn field_pointer(kind: Kind, field: &str) -> Option<&'static str> {
    Some(match (kind, field) {
        (Kind::Pod | Kind::ResourceSlice, "spec.nodeName") => "/spec/nodeName",
        (Kind::ResourceSlice, "spec.driver") => "/spec/driver",
        (Kind::ResourceSlice, "spec.pool.name") => "/spec/pool/name",
        (_, "metadata.name") => "/metadata/name",
        _ => return None,
    })
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
    // Comma-separated `field=value`, `field==value` or `field!=value`, as the real server
    // reads them (an empty term is skipped, as there).
    for term in text.split(',').filter(|t| !t.is_empty()) {
        let (field, value, equal) = if let Some((field, value)) = term.split_once("!=") {
            (field, value, false)
        } else if let Some((field, value)) = term.split_once('=') {
            (field, value.strip_prefix('=').unwrap_or(value), true)
        } else {
            return Err(format!("invalid selector: '{text}'; can't understand '{term}'"));
        };
        let pointer = field_pointer(kind, field)
            .ok_or_else(|| format!("field label not supported: {field}"))?;
        selector.fields.push(FieldTerm { pointer, value: value.to_owned(), equal });
    }
    Ok(selector)
}

fn matches(selector: &Selector, object: &Value) -> bool {
    let field = selector.fields.iter().all(|term| {
        let actual = object.pointer(term.pointer).and_then(Value::as_str).unwrap_or_default();
        (actual == term.value) == term.equal
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

async fn list_resource_slices(
    State(app): State<AppState>,
    uri: Uri,
    headers: HeaderMap,
) -> Response {
    list_or_watch(app, Kind::ResourceSlice, uri, headers)
}

async fn list_device_classes(
    State(app): State<AppState>,
    uri: Uri,
    headers: HeaderMap,
) -> Response {
    list_or_watch(app, Kind::DeviceClass, uri, headers)
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
            "kind": kind.list_kind(), "apiVersion": kind.api_version(),
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

/// `GET` of the object `name` of `kind` stored under `key`, recorded under `path`.
fn get_object(
    app: &AppState,
    kind: Kind,
    key: String,
    name: &str,
    path: String,
    headers: &HeaderMap,
) -> Response {
    record(&app.shared, "GET", path, headers, &Bytes::new());
    let world = app.shared.0.lock().unwrap_or_else(PoisonError::into_inner);
    match world.objects.get(&(kind, key)) {
        Some(object) => json_response(StatusCode::OK, object),
        None => not_found(kind, name),
    }
}

async fn get_node(
    State(app): State<AppState>,
    Path(name): Path<String>,
    headers: HeaderMap,
) -> Response {
    let path = format!("/api/v1/nodes/{name}");
    get_object(&app, Kind::Node, name.clone(), &name, path, &headers)
}

async fn get_pod(
    State(app): State<AppState>,
    Path((ns, name)): Path<(String, String)>,
    headers: HeaderMap,
) -> Response {
    let path = format!("/api/v1/namespaces/{ns}/pods/{name}");
    get_object(&app, Kind::Pod, format!("{ns}/{name}"), &name, path, &headers)
}

async fn get_resource_slice(
    State(app): State<AppState>,
    Path(name): Path<String>,
    headers: HeaderMap,
) -> Response {
    let path = format!("{RESOURCE_V1}/resourceslices/{name}");
    get_object(&app, Kind::ResourceSlice, name.clone(), &name, path, &headers)
}

async fn get_resource_claim(
    State(app): State<AppState>,
    Path((ns, name)): Path<(String, String)>,
    headers: HeaderMap,
) -> Response {
    let path = format!("{RESOURCE_V1}/namespaces/{ns}/resourceclaims/{name}");
    get_object(&app, Kind::ResourceClaim, format!("{ns}/{name}"), &name, path, &headers)
}

async fn get_device_class(
    State(app): State<AppState>,
    Path(name): Path<String>,
    headers: HeaderMap,
) -> Response {
    let path = format!("{RESOURCE_V1}/deviceclasses/{name}");
    get_object(&app, Kind::DeviceClass, name.clone(), &name, path, &headers)
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
        return not_found(Kind::Node, &name);
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
    let delay = app.shared.0.lock().unwrap_or_else(PoisonError::into_inner).binding_delay;
    tokio::time::sleep(delay).await;
    let Ok(binding) = serde_json::from_slice::<Value>(&body) else {
        return status(StatusCode::BAD_REQUEST, "BadRequest", "invalid JSON".into());
    };
    let Some(node) = binding.pointer("/target/name").and_then(Value::as_str) else {
        return status(StatusCode::BAD_REQUEST, "BadRequest", "no target.name".into());
    };
    let mut world = app.shared.0.lock().unwrap_or_else(PoisonError::into_inner);
    let key = format!("{ns}/{name}");
    let Some(mut pod) = world.objects.get(&(Kind::Pod, key.clone())).cloned() else {
        return not_found(Kind::Pod, &name);
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

/// The body of a write of `kind`: a JSON object whose `metadata`, if any, is an object, and whose
/// `kind` and `apiVersion`, where given, are `kind`'s; else why not (400, as the real server
/// answers).
fn object_body(kind: Kind, body: &Bytes) -> Result<Value, String> {
    let object: Value = serde_json::from_slice(body).map_err(|e| format!("invalid JSON: {e}"))?;
    if !object.is_object() || !(object["metadata"].is_null() || object["metadata"].is_object()) {
        return Err("the body is not an object with metadata".into());
    }
    if let Some(version) = object["apiVersion"].as_str()
        && version != kind.api_version()
    {
        return Err(format!(
            "the API version in the data ({version}) does not match the expected API version ({})",
            kind.api_version()
        ));
    }
    if let Some(given) = object["kind"].as_str()
        && given != kind.kind()
    {
        return Err(format!(
            "the kind in the data ({given}) does not match the expected kind ({})",
            kind.kind()
        ));
    }
    Ok(object)
}

fn bad_request(message: String) -> Response {
    status(StatusCode::BAD_REQUEST, "BadRequest", message)
}

/// 409 `Conflict` on the object `name`: `why` it cannot be written.
fn conflict(kind: Kind, name: &str, why: &str) -> Response {
    let message = format!("Operation cannot be fulfilled on {} \"{name}\": {why}", kind.resource());
    status_with_details(StatusCode::CONFLICT, "Conflict", message, details(kind, name))
}

/// 422 `Invalid`: the object `name` breaks `errors`, one `cause` each.
fn invalid(kind: Kind, name: &str, errors: &[FieldError]) -> Response {
    let each: Vec<String> = errors.iter().map(|e| format!("{}: {}", e.field, e.body)).collect();
    let all = match each.as_slice() {
        [one] => one.clone(),
        many => format!("[{}]", many.join(", ")),
    };
    let message = format!("{} \"{name}\" is invalid: {all}", kind.qualified_kind());
    let mut details = details(kind, name);
    // An invalid object's details name its kind, not its resource.
    details["kind"] = json!(kind.kind());
    details["causes"] = errors
        .iter()
        .map(|e| json!({"reason": e.reason, "message": e.body, "field": e.field}))
        .collect();
    status_with_details(StatusCode::UNPROCESSABLE_ENTITY, "Invalid", message, details)
}

/// One field error, as the real server reports it (`k8s.io/apimachinery/pkg/util/validation/field`).
#[derive(Debug)]
struct FieldError {
    /// `spec.pool.name`, `spec.devices[3].name`.
    field: String,
    /// `FieldValueRequired`, `FieldValueInvalid`, ...
    reason: &'static str,
    /// What is wrong, worded as there (`Required value`, `Invalid value: 0: must be greater
    /// than zero`).
    body: String,
}

impl FieldError {
    fn required(field: impl Into<String>, detail: &str) -> Self {
        let body = match detail {
            "" => "Required value".to_owned(),
            detail => format!("Required value: {detail}"),
        };
        Self { field: field.into(), reason: "FieldValueRequired", body }
    }

    fn invalid(field: impl Into<String>, value: &Value, detail: &str) -> Self {
        let body = format!("Invalid value: {value}: {detail}");
        Self { field: field.into(), reason: "FieldValueInvalid", body }
    }

    fn too_long(field: impl Into<String>, most: usize) -> Self {
        let body = format!("Too long: may not be more than {most} bytes");
        Self { field: field.into(), reason: "FieldValueTooLong", body }
    }
}

const DNS_SUBDOMAIN: &str = "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character";
const DNS_LABEL: &str = "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and must start and end with an alphanumeric character";

/// `[a-z0-9]([-a-z0-9]*[a-z0-9])?`.
fn label_characters(text: &str) -> bool {
    let alphanumeric = |b: u8| b.is_ascii_lowercase() || b.is_ascii_digit();
    let bytes = text.as_bytes();
    match (bytes.first(), bytes.last()) {
        (Some(&first), Some(&last)) => {
            alphanumeric(first)
                && alphanumeric(last)
                && bytes.iter().all(|&b| alphanumeric(b) || b == b'-')
        }
        _ => false,
    }
}

/// An RFC 1123 label (a device's name).
fn dns_label(text: &str) -> bool {
    text.len() <= 63 && label_characters(text)
}

/// An RFC 1123 subdomain (an object's name, a node's, a driver's).
fn dns_subdomain(text: &str) -> bool {
    text.len() <= 253 && text.split('.').all(label_characters)
}

/// An integer field of a Go struct: absent (or `null`) decodes as 0 there.
fn integer(value: &Value) -> Option<i64> {
    if value.is_null() { Some(0) } else { value.as_i64() }
}

/// How the real server validates a ResourceSlice (`ValidateResourceSlice` and, with `old`,
/// `ValidateResourceSliceUpdate` of `k8s.io/kubernetes/pkg/apis/resource/validation`, for the
/// fields a kubelet plugin writes): every error, in its order.
fn validate_resource_slice(slice: &Value, old: Option<&Value>) -> Vec<FieldError> {
    let mut errors = Vec::new();
    let name = slice["metadata"]["name"].as_str().unwrap_or_default();
    if name.is_empty() {
        errors.push(FieldError::required("metadata.name", "name or generateName is required"));
    } else if !dns_subdomain(name) {
        errors.push(FieldError::invalid("metadata.name", &json!(name), DNS_SUBDOMAIN));
    }
    let spec = &slice["spec"];
    // A driver is named as a CSI driver is: at most 63 characters, a subdomain in any case.
    match spec["driver"].as_str() {
        None | Some("") => errors.push(FieldError::required("spec.driver", "")),
        Some(driver) if driver.len() > 63 => errors.push(FieldError::too_long("spec.driver", 63)),
        Some(driver) if !dns_subdomain(&driver.to_lowercase()) => {
            errors.push(FieldError::invalid("spec.driver", &json!(driver), DNS_SUBDOMAIN));
        }
        Some(_) => {}
    }
    let pool = &spec["pool"];
    match pool["name"].as_str() {
        None | Some("") => errors.push(FieldError::required("spec.pool.name", "")),
        Some(pool_name) if pool_name.len() > 253 => {
            errors.push(FieldError::too_long("spec.pool.name", 253));
        }
        Some(pool_name) if !pool_name.split('/').all(dns_subdomain) => {
            errors.push(FieldError::invalid("spec.pool.name", &json!(pool_name), DNS_SUBDOMAIN));
        }
        Some(_) => {}
    }
    let count = &pool["resourceSliceCount"];
    if integer(count).is_none_or(|c| c <= 0) {
        let shown = if count.is_null() { json!(0) } else { count.clone() };
        errors.push(FieldError::invalid(
            "spec.pool.resourceSliceCount",
            &shown,
            "must be greater than zero",
        ));
    }
    // An absent generation is 0 there, which is valid: only a negative one is refused.
    let generation = &pool["generation"];
    if integer(generation).is_none_or(|g| g < 0) {
        errors.push(FieldError::invalid(
            "spec.pool.generation",
            generation,
            "must be greater than or equal to zero",
        ));
    }
    if let Some(old) = old {
        for (pointer, field) in [
            ("/spec/pool/name", "spec.pool.name"),
            ("/spec/driver", "spec.driver"),
            ("/spec/nodeName", "spec.nodeName"),
        ] {
            let now = slice.pointer(pointer).unwrap_or(&Value::Null);
            if now != old.pointer(pointer).unwrap_or(&Value::Null) {
                errors.push(FieldError::invalid(field, now, "field is immutable"));
            }
        }
    }
    validate_node_selection(spec, &mut errors);
    match &spec["devices"] {
        Value::Null => {}
        Value::Array(devices) => {
            let per_device = spec["perDeviceNodeSelection"] == Value::Bool(true);
            validate_devices(devices, per_device, &mut errors);
        }
        other => errors.push(FieldError::invalid("spec.devices", other, "must be a list")),
    }
    errors
}

/// Exactly one of `nodeName`, `nodeSelector`, `allNodes`, `perDeviceNodeSelection`; a
/// `nodeName` set is not empty, a flag set is true, a selector has one term.
fn validate_node_selection(spec: &Value, errors: &mut Vec<FieldError>) {
    let mut set = Vec::new();
    match &spec["nodeName"] {
        Value::Null => {}
        Value::String(node) if !node.is_empty() => {
            set.push("`nodeName`");
            if !dns_subdomain(node) {
                errors.push(FieldError::invalid("spec.nodeName", &json!(node), DNS_SUBDOMAIN));
            }
        }
        other => errors.push(FieldError::invalid(
            "spec.nodeName",
            other,
            "must be either unset or set to a non-empty string",
        )),
    }
    if !spec["nodeSelector"].is_null() {
        set.push("`nodeSelector`");
        let terms = &spec["nodeSelector"]["nodeSelectorTerms"];
        if terms.as_array().is_none_or(|t| t.len() != 1) {
            errors.push(FieldError::invalid(
                "spec.nodeSelector.nodeSelectorTerms",
                terms,
                "must have exactly one node selector term",
            ));
        }
    }
    for (field, label) in
        [("allNodes", "`allNodes`"), ("perDeviceNodeSelection", "`perDeviceNodeSelection`")]
    {
        match &spec[field] {
            Value::Null => {}
            Value::Bool(true) => set.push(label),
            other => errors.push(FieldError::invalid(
                format!("spec.{field}"),
                other,
                "must be either unset or set to true",
            )),
        }
    }
    const ONE_OF: &str = "exactly one of `nodeName`, `nodeSelector`, `allNodes`, `perDeviceNodeSelection` is required";
    match set.len() {
        0 => errors.push(FieldError::required("spec", ONE_OF)),
        1 => {}
        _ => errors.push(FieldError::invalid(
            "spec",
            &json!(format!("{{{}}}", set.join(", "))),
            &format!("{ONE_OF}, but multiple fields are set"),
        )),
    }
}

/// At most 128 devices (64 when one has taints or consumes counters), each named by a unique
/// DNS label, and choosing its nodes only when the slice says `perDeviceNodeSelection`.
fn validate_devices(devices: &[Value], per_device: bool, errors: &mut Vec<FieldError>) {
    let advanced = devices.iter().any(|d| {
        ["taints", "consumesCounters"]
            .iter()
            .any(|f| d[*f].as_array().is_some_and(|a| !a.is_empty()))
    });
    let most = if advanced { 64 } else { 128 };
    if devices.len() > most {
        errors.push(FieldError {
            field: "spec.devices".into(),
            reason: "FieldValueTooMany",
            body: format!("Too many: {}: must have at most {most} items", devices.len()),
        });
    }
    const PER_DEVICE: &str = "exactly one of `nodeName`, `nodeSelector`, or `allNodes` is required when `perDeviceNodeSelection` is set to true in the ResourceSlice spec";
    for (i, device) in devices.iter().enumerate() {
        let path = format!("spec.devices[{i}]");
        match device["name"].as_str() {
            None | Some("") => errors.push(FieldError::required(format!("{path}.name"), "")),
            Some(name) if !dns_label(name) => {
                errors.push(FieldError::invalid(format!("{path}.name"), &json!(name), DNS_LABEL));
            }
            Some(_) => {}
        }
        let chosen = ["nodeName", "nodeSelector", "allNodes"].map(|f| !device[f].is_null());
        if per_device {
            let mut set = Vec::new();
            match &device["nodeName"] {
                Value::Null => {}
                Value::String(node) if !node.is_empty() => set.push("`nodeName`"),
                other => errors.push(FieldError::invalid(
                    format!("{path}.nodeName"),
                    other,
                    "must not be empty",
                )),
            }
            if chosen[1] {
                set.push("`nodeSelector`");
            }
            match &device["allNodes"] {
                Value::Null => {}
                Value::Bool(true) => set.push("`allNodes`"),
                other => errors.push(FieldError::invalid(
                    format!("{path}.allNodes"),
                    other,
                    "must be either unset or set to true",
                )),
            }
            match set.len() {
                0 => errors.push(FieldError::required(path, PER_DEVICE)),
                1 => {}
                _ => errors.push(FieldError::invalid(
                    path,
                    &json!(format!("{{{}}}", set.join(", "))),
                    PER_DEVICE,
                )),
            }
        } else if chosen.contains(&true) {
            errors.push(FieldError::invalid(
                path,
                &Value::Null,
                "`nodeName`, `nodeSelector` and `allNodes` can only be set if `perDeviceNodeSelection` is set to true in the ResourceSlice spec",
            ));
        }
    }
    let mut names = BTreeSet::new();
    for (i, device) in devices.iter().enumerate() {
        let name = device["name"].as_str().unwrap_or_default();
        if !names.insert(name) {
            errors.push(FieldError {
                field: format!("spec.devices[{i}]"),
                reason: "FieldValueDuplicate",
                body: format!("Duplicate value: {}", json!(name)),
            });
        }
    }
}

/// `value` without the `null`s and empty lists that the real server does not keep
/// (`omitempty`), to compare two specs as it does.
fn normalised(value: &Value) -> Value {
    let kept = |v: &Value| !(v.is_null() || v.as_array().is_some_and(Vec::is_empty));
    match value {
        Value::Object(map) => Value::Object(
            map.iter().filter(|(_, v)| kept(v)).map(|(k, v)| (k.clone(), normalised(v))).collect(),
        ),
        Value::Array(items) => Value::Array(items.iter().map(normalised).collect()),
        other => other.clone(),
    }
}

/// `POST` of a ResourceSlice: named from `generateName` when it has no name, validated, given
/// what the real server gives a new object (`uid`, `creationTimestamp`, `generation: 1`, a
/// resource version), stored (watchers see `ADDED`) and answered 201.
async fn create_resource_slice(
    State(app): State<AppState>,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let kind = Kind::ResourceSlice;
    record(&app.shared, "POST", uri.path().to_owned(), &headers, &body);
    let mut slice = match object_body(kind, &body) {
        Ok(slice) => slice,
        Err(refused) => return bad_request(refused),
    };
    let mut world = app.shared.0.lock().unwrap_or_else(PoisonError::into_inner);
    let prefix = slice["metadata"]["generateName"].as_str().unwrap_or_default().to_owned();
    if slice["metadata"]["name"].as_str().is_none_or(str::is_empty) && !prefix.is_empty() {
        // The real server draws again when a generated name is taken.
        let name = loop {
            let name = generated_name(&prefix);
            if !world.objects.contains_key(&(kind, name.clone())) {
                break name;
            }
        };
        slice["metadata"]["name"] = json!(name);
    }
    let name = slice["metadata"]["name"].as_str().unwrap_or_default().to_owned();
    let errors = validate_resource_slice(&slice, None);
    if !errors.is_empty() {
        return invalid(kind, &name, &errors);
    }
    if world.objects.contains_key(&(kind, name.clone())) {
        let message = format!("{} \"{name}\" already exists", kind.resource());
        return status_with_details(
            StatusCode::CONFLICT,
            "AlreadyExists",
            message,
            details(kind, &name),
        );
    }
    // What the real server sets on a new object, whatever the body said.
    if let Some(metadata) = slice["metadata"].as_object_mut() {
        for field in ["namespace", "resourceVersion", "deletionTimestamp"] {
            metadata.remove(field);
        }
        metadata.insert("uid".into(), json!(new_uid()));
        metadata.insert("creationTimestamp".into(), json!(now()));
        metadata.insert("generation".into(), json!(1));
    }
    if world.no_consumable_capacity {
        drop_consumable_capacity(&mut slice);
    }
    let slice = with_system_fields(kind, slice);
    let stored = world.put(kind, name, slice);
    drop(world);
    app.shared.1.send_modify(|_| {});
    json_response(StatusCode::CREATED, &stored)
}

/// `PUT` of a ResourceSlice: 409 when its `resourceVersion` (if given) or `uid` (if given) is
/// not the stored one's, validated with the immutable fields, `generation` bumped when the spec
/// changed; nothing is written (no new resource version, no event) when nothing changed.
async fn update_resource_slice(
    State(app): State<AppState>,
    Path(name): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let kind = Kind::ResourceSlice;
    record(&app.shared, "PUT", format!("{RESOURCE_V1}/resourceslices/{name}"), &headers, &body);
    let mut slice = match object_body(kind, &body) {
        Ok(slice) => slice,
        Err(refused) => return bad_request(refused),
    };
    let given = slice["metadata"]["name"].as_str().unwrap_or_default();
    if given != name {
        return bad_request(format!(
            "the name of the object ({given}) does not match the name on the URL ({name})"
        ));
    }
    let mut world = app.shared.0.lock().unwrap_or_else(PoisonError::into_inner);
    let Some(stored) = world.objects.get(&(kind, name.clone())).cloned() else {
        return not_found(kind, &name);
    };
    let meta = |object: &Value, field: &str| -> String {
        object["metadata"][field].as_str().unwrap_or_default().to_owned()
    };
    let version = meta(&slice, "resourceVersion");
    if !version.is_empty() && version != meta(&stored, "resourceVersion") {
        let why = "the object has been modified; please apply your changes to the latest version and try again";
        return conflict(kind, &name, why);
    }
    let uid = meta(&slice, "uid");
    if !uid.is_empty() && uid != meta(&stored, "uid") {
        let why = format!(
            "Precondition failed: UID in precondition: {}, UID in object meta: {uid}",
            meta(&stored, "uid")
        );
        return conflict(kind, &name, &why);
    }
    let errors = validate_resource_slice(&slice, Some(&stored));
    if !errors.is_empty() {
        return invalid(kind, &name, &errors);
    }
    if world.no_consumable_capacity {
        drop_consumable_capacity(&mut slice);
    }
    let changed = normalised(&slice["spec"]) != normalised(&stored["spec"]);
    let generation = stored["metadata"]["generation"].as_i64().unwrap_or(1) + i64::from(changed);
    if let Some(metadata) = slice["metadata"].as_object_mut() {
        metadata.remove("namespace");
        for field in ["uid", "creationTimestamp", "resourceVersion"] {
            metadata.insert(field.into(), stored["metadata"][field].clone());
        }
        metadata.insert("generation".into(), json!(generation));
    }
    slice["kind"] = json!(kind.kind());
    slice["apiVersion"] = json!(kind.api_version());
    if slice == stored {
        return json_response(StatusCode::OK, &stored);
    }
    let updated = world.put(kind, name, slice);
    drop(world);
    app.shared.1.send_modify(|_| {});
    json_response(StatusCode::OK, &updated)
}

/// `DELETE` of one ResourceSlice, with the `DeleteOptions`' `preconditions` (`uid`,
/// `resourceVersion`) checked: answers the object deleted (watchers see `DELETED`).
async fn delete_resource_slice(
    State(app): State<AppState>,
    Path(name): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let kind = Kind::ResourceSlice;
    record(&app.shared, "DELETE", format!("{RESOURCE_V1}/resourceslices/{name}"), &headers, &body);
    let options: Value = if body.is_empty() {
        Value::Null
    } else {
        match serde_json::from_slice(&body) {
            Ok(options) => options,
            Err(e) => return bad_request(format!("invalid JSON: {e}")),
        }
    };
    let mut world = app.shared.0.lock().unwrap_or_else(PoisonError::into_inner);
    let Some(stored) = world.objects.get(&(kind, name.clone())) else {
        return not_found(kind, &name);
    };
    for (field, label) in [("uid", "UID"), ("resourceVersion", "ResourceVersion")] {
        let has = stored["metadata"][field].as_str().unwrap_or_default();
        if let Some(wanted) = options["preconditions"][field].as_str()
            && wanted != has
        {
            let why = format!(
                "Precondition failed: {label} in precondition: {wanted}, {label} in object meta: {has}"
            );
            return conflict(kind, &name, &why);
        }
    }
    let deleted = world.delete(kind, &name).unwrap_or_default();
    drop(world);
    app.shared.1.send_modify(|_| {});
    json_response(StatusCode::OK, &deleted)
}

/// `DELETE` of the ResourceSlice collection: deletes every slice the selectors match (all of
/// them without one; watchers see each `DELETED`) and answers the list of them.
async fn delete_resource_slices(
    State(app): State<AppState>,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let kind = Kind::ResourceSlice;
    record(&app.shared, "DELETE", uri.path().to_owned(), &headers, &body);
    let selector = match selector(kind, &query(&uri)) {
        Ok(s) => s,
        Err(refused) => return bad_request(refused),
    };
    let mut world = app.shared.0.lock().unwrap_or_else(PoisonError::into_inner);
    let names: Vec<String> = world
        .objects
        .iter()
        .filter(|((k, _), v)| *k == kind && matches(&selector, v))
        .map(|((_, name), _)| name.clone())
        .collect();
    let items: Vec<Value> = names.iter().filter_map(|name| world.delete(kind, name)).collect();
    let body = json!({
        "kind": kind.list_kind(), "apiVersion": kind.api_version(),
        "metadata": {"resourceVersion": world.rv.to_string()},
        "items": items
    });
    drop(world);
    app.shared.1.send_modify(|_| {});
    json_response(StatusCode::OK, &body)
}
