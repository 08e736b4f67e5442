//! The extender's HTTP endpoint: `POST <prefix>/filter` and `<prefix>/prioritize` in
//! kube-scheduler's extender JSON, `GET /healthz`, and `GET /metrics` (request latency per verb,
//! nodes filtered out per reason, the node cache's age). A body that is not the protocol's JSON
//! is answered 400 with what is wrong, and logged; nothing in a request can panic the server.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Router};
use prometheus::{Encoder, GaugeVec, HistogramOpts, HistogramVec, IntCounterVec, Opts, Registry};
use tokio_util::sync::CancellationToken;

use baleen_edge::http::Arrived;

use crate::service::{CallError, Extender, Prioritized};

/// The extender's metric families.
#[derive(Clone)]
pub struct Metrics {
    registry: Registry,
    latency: HistogramVec,
    filtered: IntCounterVec,
    bad_requests: IntCounterVec,
    cache_age: prometheus::Gauge,
    nodes: GaugeVec,
    bindings: IntCounterVec,
    prioritize_answers: IntCounterVec,
    filter_names: IntCounterVec,
}

/// Registers `metric` in `registry` and gives it back: the extender's one registration helper.
fn register<M: prometheus::core::Collector + Clone + 'static>(
    registry: &Registry,
    metric: Result<M, prometheus::Error>,
) -> Result<M, prometheus::Error> {
    let metric = metric?;
    registry.register(Box::new(metric.clone()))?;
    Ok(metric)
}

impl Metrics {
    /// Registers the families in `registry`.
    pub fn new(registry: Registry) -> Result<Self, prometheus::Error> {
        let r = &registry;
        let latency = register(
            r,
            HistogramVec::new(
                HistogramOpts::new(
                    "baleen_extender_request_seconds",
                    "Time to answer one kube-scheduler call, by verb: from its arrival (headers read) to its answer, the wait for its body and its turn included.",
                )
                .buckets(vec![0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5, 1.0]),
                &["verb"],
            ),
        )?;
        let filtered = register(
            r,
            IntCounterVec::new(
                Opts::new(
                    "baleen_extender_filtered_nodes_total",
                    "Nodes the filter removed, by reason: full (preemption might help), never (no such GPU, profile or group), no_state (no usable gpu-state annotation), not_best (they fit, but more than --filter-keep-best did and scored better).",
                ),
                &["reason"],
            ),
        )?;
        let bad_requests = register(
            r,
            IntCounterVec::new(
                Opts::new(
                    "baleen_extender_bad_requests_total",
                    "Calls answered 400 (not the extender protocol's JSON), by verb.",
                ),
                &["verb"],
            ),
        )?;
        let cache_age = register(
            r,
            prometheus::Gauge::new(
                "baleen_extender_node_cache_age_seconds",
                "Seconds since the node cache last changed (-1 before the first node).",
            ),
        )?;
        let nodes = register(
            r,
            GaugeVec::new(
                Opts::new(
                    "baleen_extender_nodes",
                    "Nodes in the cache, by whether their gpu-state can be used.",
                ),
                &["state"],
            ),
        )?;
        let bindings = register(
            r,
            IntCounterVec::new(
                Opts::new(
                    "baleen_extender_bindings_total",
                    "Pods the bind verb was asked to bind, by result: bound, no_room (another binding took the room first; kube-scheduler retries the pod), refused, failed (the API server).",
                ),
                &["result"],
            ),
        )?;
        let prioritize_answers = register(
            r,
            IntCounterVec::new(
                Opts::new(
                    "baleen_extender_prioritize_answers_total",
                    "prioritize calls answered, by how: made_ahead (the scores of the nodes the filter just passed, made while its answer travelled), computed (the names were not the filter's last answer for that pod, or a node or the policy changed in between).",
                ),
                &["how"],
            ),
        )?;
        let filter_names = register(
            r,
            IntCounterVec::new(
                Opts::new(
                    "baleen_extender_filter_names_total",
                    "filter calls by how their node names were judged: read (split and looked up), reused (byte for byte a recent call's, judged from the slots found then; kube-scheduler sends the same names pod after pod with percentageOfNodesToScore: 100), again (a recent call's names and demand, no node among them changed its verdict since it was last judged, by a call or ahead: that answer again), patched (the same, some nodes' verdicts changed: that answer with theirs patched in).",
                ),
                &["how"],
            ),
        )?;
        Ok(Self {
            registry,
            filter_names,
            latency,
            filtered,
            bad_requests,
            cache_age,
            nodes,
            bindings,
            prioritize_answers,
        })
    }
}

/// The largest request body accepted. kube-scheduler with `nodeCacheCapable: true` (the
/// install's) sends a pod (at most about 1.5 MiB, etcd's object limit) and node names (5,000
/// names are about 150 KiB); Nodes sent in full fit for a few dozen nodes only. A bigger body
/// is answered 413 before it is read whole: one made-up 30 MiB body once took the extender past
/// its 512 MiB limit.
pub const MAX_BODY_BYTES: usize = 4 << 20;

/// Calls of one verb (filter, prioritize, preempt: each its own turns) served at once, once
/// their bodies are read whole ([`whole_body`]); more wait for their turn (kube-scheduler's
/// scheduling cycle calls them for one pod at a time per profile).
pub const MAX_CONCURRENT_CALLS: usize = 4;

/// Bind calls served at once. kube-scheduler binds in a goroutine per pod, many at once, and
/// each bind waits for the API server's Binding: with four turns like the other verbs, binds
/// capped a burst at four API round trips at a time (about 105 pods/s against 175 without the
/// extender on the real kube-scheduler at 5,000 nodes, docs/benchmarks.md).
pub const MAX_CONCURRENT_BINDS: usize = 64;

/// The largest bind body: `ExtenderBindingArgs` is a pod's name, namespace and UID and a
/// node's name (under 1 KiB); [`MAX_CONCURRENT_BINDS`] of these are little memory.
pub const MAX_BIND_BODY_BYTES: usize = 16 << 10;

/// What each of the extender's TCP listeners admits (`baleen_edge::gate`): at most 256
/// connections, 64 from one address; at a cap an idle one (the oldest of the address holding
/// the most) is closed to make room, and only when every one is busy is a new one refused.
pub const LIMITS: baleen_edge::gate::Limits =
    baleen_edge::gate::Limits { total: 256, per_peer: 64 };

/// What the probe listener admits: the kubelet's exec probes, from inside the container.
pub const PROBE_LIMITS: baleen_edge::gate::Limits =
    baleen_edge::gate::Limits { total: 8, per_peer: 8 };

/// Time for a request's headers (and a TLS handshake) to arrive.
pub const HEADER_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// Time for a request's body to arrive whole once its headers have: a body begun and never
/// finished holds one of the [`MAX_BODY_READS`] reads at most this long.
pub const BODY_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// The bounds of every connection to the extender's ports.
const BOUNDS: baleen_edge::http::Bounds = baleen_edge::http::Bounds {
    header_timeout: HEADER_TIMEOUT,
    lifetime: None,
    max_buffer: 64 * 1024,
};

struct App {
    extender: Arc<Extender>,
    metrics: Metrics,
}

/// The router, with the verbs under `prefix` (e.g. `/baleen`; empty for the root).
pub fn router(extender: Arc<Extender>, metrics: Metrics, prefix: &str) -> Router {
    let app = Arc::new(App { extender, metrics });
    let prefix = prefix.trim_end_matches('/');
    let verbs = Router::new()
        .route(&format!("{prefix}/filter"), post(filter))
        .route(&format!("{prefix}/prioritize"), post(prioritize))
        .route(&format!("{prefix}/preempt"), post(preempt))
        .layer(axum::extract::DefaultBodyLimit::max(MAX_BODY_BYTES))
        .layer(tower::limit::ConcurrencyLimitLayer::new(MAX_CONCURRENT_CALLS))
        .layer(axum::middleware::from_fn_with_state(BodyReads::new(MAX_BODY_BYTES), whole_body));
    let binds = Router::new()
        .route(&format!("{prefix}/bind"), post(bind_pod))
        .layer(axum::extract::DefaultBodyLimit::max(MAX_BIND_BODY_BYTES))
        .layer(tower::limit::ConcurrencyLimitLayer::new(MAX_CONCURRENT_BINDS))
        .layer(axum::middleware::from_fn_with_state(
            BodyReads::new(MAX_BIND_BODY_BYTES),
            whole_body,
        ));
    verbs.merge(binds).merge(health_routes()).with_state(app)
}

/// Bodies read at once per router, before their call takes one of the
/// [`MAX_CONCURRENT_CALLS`] turns: at most this many bodies are in memory while they arrive,
/// and a body that never ends holds a read, not a turn.
pub const MAX_BODY_READS: usize = 16;

/// How a router's bodies are read: at most `max` bytes, [`MAX_BODY_READS`] at once.
#[derive(Clone)]
pub struct BodyReads {
    max: usize,
    reads: Arc<tokio::sync::Semaphore>,
}

impl BodyReads {
    /// Bodies of at most `max` bytes.
    pub fn new(max: usize) -> Self {
        Self { max, reads: Arc::new(tokio::sync::Semaphore::new(MAX_BODY_READS)) }
    }
}

/// Reads a request's body whole before its handler runs: at most `max` bytes (413 past it,
/// before it is read whole), within [`BODY_TIMEOUT`] (408 after it), one of
/// [`MAX_BODY_READS`] at once.
pub async fn whole_body(
    State(reads): State<BodyReads>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let (parts, body) = request.into_parts();
    let max = reads.max;
    let declared = parts
        .headers
        .get(axum::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    let too_large = || {
        (StatusCode::PAYLOAD_TOO_LARGE, format!("a body of at most {max} bytes is read\n"))
            .into_response()
    };
    if declared.is_some_and(|n| n > max as u64) {
        return too_large();
    }
    let Ok(read) = reads.reads.acquire().await else {
        return (StatusCode::SERVICE_UNAVAILABLE, "shutting down\n").into_response();
    };
    let whole = tokio::time::timeout(BODY_TIMEOUT, axum::body::to_bytes(body, max)).await;
    drop(read);
    match whole {
        Ok(Ok(bytes)) => {
            next.run(axum::extract::Request::from_parts(parts, axum::body::Body::from(bytes))).await
        }
        Ok(Err(_)) => too_large(),
        Err(_) => (
            StatusCode::REQUEST_TIMEOUT,
            format!("the body did not arrive within {} s\n", BODY_TIMEOUT.as_secs()),
        )
            .into_response(),
    }
}

/// `/healthz`, `/readyz` and `/metrics` only: the router of `--metrics-listen`, where probes and
/// Prometheus reach the extender while its verbs listen on localhost.
pub fn health_router(extender: Arc<Extender>, metrics: Metrics) -> Router {
    health_routes().with_state(Arc::new(App { extender, metrics }))
}

fn health_routes() -> Router<Arc<App>> {
    Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(ready))
        .route("/metrics", get(render_metrics))
}

/// `/healthz` and `/readyz` alone: the router of `--probe-listen`, the loopback address the
/// kubelet's exec probes reach from inside the container (no other pod can fill it).
pub fn probe_router(extender: Arc<Extender>, metrics: Metrics) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(ready))
        .with_state(Arc::new(App { extender, metrics }))
}

/// Binds `address` and serves until `shutdown`; returns the bound address and the server.
/// Every listener admits connections within [`LIMITS`] and gives headers [`HEADER_TIMEOUT`].
pub async fn bind(
    address: SocketAddr,
    router: Router,
    shutdown: CancellationToken,
) -> std::io::Result<(SocketAddr, impl std::future::Future<Output = ()> + use<>)> {
    bind_maybe_tls(address, router, None, shutdown).await
}

/// [`bind`] within `limits` (the probe listener's).
pub async fn bind_within(
    address: SocketAddr,
    router: Router,
    limits: baleen_edge::gate::Limits,
    shutdown: CancellationToken,
) -> std::io::Result<(SocketAddr, impl std::future::Future<Output = ()> + use<>)> {
    let gate = baleen_edge::gate::Gate::new("probes", limits);
    baleen_edge::http::bind(address, router, gate, BOUNDS, shutdown).await
}

/// [`bind`] over TLS with `config` (the webhook).
pub async fn bind_tls(
    address: SocketAddr,
    router: Router,
    config: Arc<rustls::ServerConfig>,
    shutdown: CancellationToken,
) -> std::io::Result<(SocketAddr, impl std::future::Future<Output = ()> + use<>)> {
    bind_maybe_tls(address, router, Some(config), shutdown).await
}

/// [`bind`], over TLS when `config` is given (filter and prioritize behind a Service).
pub async fn bind_maybe_tls(
    address: SocketAddr,
    router: Router,
    config: Option<Arc<rustls::ServerConfig>>,
    shutdown: CancellationToken,
) -> std::io::Result<(SocketAddr, impl std::future::Future<Output = ()> + use<>)> {
    let gate = baleen_edge::gate::Gate::new("extender", LIMITS);
    Ok(match config {
        None => {
            let (bound, serve) =
                baleen_edge::http::bind(address, router, gate, BOUNDS, shutdown).await?;
            (bound, futures::future::Either::Left(serve))
        }
        Some(config) => {
            let (bound, serve) =
                baleen_edge::http::bind_tls(address, router, gate, BOUNDS, config, shutdown)
                    .await?;
            (bound, futures::future::Either::Right(serve))
        }
    })
}

/// `body` as the protocol's `what` (`ExtenderArgs`, ...), or the 400 answer saying why, counted
/// and logged under `verb`.
fn parse<'b, T: serde::Deserialize<'b>>(
    app: &App,
    verb: &str,
    what: &str,
    body: &'b Bytes,
) -> Result<T, Box<Response>> {
    serde_json::from_slice::<T>(body).map_err(|e| Box::new(bad_body(app, verb, what, &e)))
}

/// The 400 answer to a body that is not the protocol's `what`, counted and logged under `verb`.
fn bad_body(app: &App, verb: &str, what: &str, e: &serde_json::Error) -> Response {
    app.metrics.bad_requests.with_label_values(&[verb]).inc();
    tracing::warn!(verb, error = %e, "not an extender request");
    (StatusCode::BAD_REQUEST, format!("not an {what} JSON body: {e}\n")).into_response()
}

/// A verb's refusal: 503 while the caches are not listed yet, else 400 with why (counted under
/// `verb` and logged).
fn refusal(app: &App, verb: &str, why: &str) -> Response {
    if why == crate::service::NOT_SYNCED {
        return (StatusCode::SERVICE_UNAVAILABLE, format!("{why}\n")).into_response();
    }
    app.metrics.bad_requests.with_label_values(&[verb]).inc();
    tracing::warn!(verb, error = why, "refused the pod");
    (StatusCode::BAD_REQUEST, format!("{why}\n")).into_response()
}

fn json_bytes(body: impl Into<Bytes>) -> Response {
    let body: Bytes = body.into();
    (StatusCode::OK, [("content-type", "application/json")], body).into_response()
}

/// When a call arrived (its headers read, `baleen_edge::http`), so that the latency histogram
/// counts its wait for a turn and for its body as kube-scheduler does (issue 39, item 6: the
/// handler's own clock saw 999 of 1,000 filters under 0.5 ms where the client saw 35 ms);
/// now, for a router served another way.
fn arrival(arrived: Option<Extension<Arrived>>) -> Instant {
    arrived.map_or_else(Instant::now, |Extension(Arrived(at))| at)
}

/// One span per call, so that every line it logs names the verb.
#[tracing::instrument(name = "filter", skip_all, fields(bytes = body.len()))]
async fn filter(
    State(app): State<Arc<App>>,
    arrived: Option<Extension<Arrived>>,
    body: Bytes,
) -> Response {
    let started = arrival(arrived);
    let answer = match app.extender.filter_call(&body) {
        Ok(a) => app.extender.keep_best(a),
        Err(e) => return bad_body(&app, "filter", "ExtenderArgs", &e),
    };
    if answer.cut > 0 {
        app.metrics.filtered.with_label_values(&["not_best"]).inc_by(answer.cut as u64);
    }
    app.metrics.filter_names.with_label_values(&[answer.how.as_str()]).inc();
    for (kind, n) in answer.removed.by_kind() {
        if n > 0 {
            app.metrics.filtered.with_label_values(&[kind.as_str()]).inc_by(n);
        }
    }
    if !answer.error.is_empty() {
        tracing::warn!(error = answer.error, "filter refused the pod");
    }
    if answer.ahead.is_some() || answer.judge.is_some() {
        // The scores of the nodes that passed, made while this answer travels and
        // kube-scheduler reads it (the prioritize that follows finds them, or waits for them);
        // then the other answers kept for these names judged again, off the next call's path.
        let extender = app.extender.clone();
        let (ahead, judge) = (answer.ahead, answer.judge);
        tokio::spawn(async move {
            if let Some(ahead) = ahead {
                extender.prepare_ahead(&ahead);
            }
            if let Some(judge) = judge {
                extender.judge_ahead(&judge);
            }
        });
    }
    app.metrics.latency.with_label_values(&["filter"]).observe(started.elapsed().as_secs_f64());
    json_bytes(answer.body)
}

#[tracing::instrument(name = "prioritize", skip_all, fields(bytes = body.len()))]
async fn prioritize(
    State(app): State<Arc<App>>,
    arrived: Option<Extension<Arrived>>,
    body: Bytes,
) -> Response {
    let started = arrival(arrived);
    let answered = |how: &str| app.metrics.prioritize_answers.with_label_values(&[how]).inc();
    let answer = match app.extender.prioritize_call(&body) {
        Ok(Prioritized::Ahead(scores)) => {
            answered("made_ahead");
            json_bytes(scores)
        }
        Ok(Prioritized::Computed(scores)) => {
            answered("computed");
            json_bytes(scores)
        }
        Err(CallError::Body(e)) => bad_body(&app, "prioritize", "ExtenderArgs", &e),
        Err(CallError::Refused(why)) => refusal(&app, "prioritize", &why),
    };
    app.metrics.latency.with_label_values(&["prioritize"]).observe(started.elapsed().as_secs_f64());
    answer
}

#[tracing::instrument(name = "preempt", skip_all, fields(bytes = body.len()))]
async fn preempt(
    State(app): State<Arc<App>>,
    arrived: Option<Extension<Arrived>>,
    body: Bytes,
) -> Response {
    let started = arrival(arrived);
    let args = match parse::<crate::protocol::ExtenderPreemptionArgs>(
        &app,
        "preempt",
        "ExtenderPreemptionArgs",
        &body,
    ) {
        Ok(a) => a,
        Err(r) => return *r,
    };
    let answer = match app.extender.preempt(&args) {
        Ok(result) => json_bytes(serde_json::to_vec(&result).unwrap_or_default()),
        Err(why) => refusal(&app, "preempt", &why),
    };
    app.metrics.latency.with_label_values(&["preempt"]).observe(started.elapsed().as_secs_f64());
    answer
}

#[tracing::instrument(name = "bind", skip_all, fields(bytes = body.len()))]
async fn bind_pod(
    State(app): State<Arc<App>>,
    arrived: Option<Extension<Arrived>>,
    body: Bytes,
) -> Response {
    let started = arrival(arrived);
    let args = match parse::<crate::protocol::ExtenderBindingArgs>(
        &app,
        "bind",
        "ExtenderBindingArgs",
        &body,
    ) {
        Ok(a) => a,
        Err(r) => return *r,
    };
    // In a task of its own: kube-scheduler gives up on a call after its httpTimeout and closes
    // the connection, which drops this handler; a bind dropped between counting the pod on its
    // node and the API server's answer would leave the pod counted there and not bound, and
    // every later bind of it refused ("already bound"), for good. The task ends the bind
    // either way: bound, or the count taken back.
    let extender = app.extender.clone();
    let task_args = args.clone();
    let outcome = tokio::spawn(async move { extender.bind(&task_args).await }).await;
    let outcome = outcome.unwrap_or_else(|e| Err(crate::service::BindError::Task(e.to_string())));
    let error = match outcome {
        Ok(()) => {
            app.metrics.bindings.with_label_values(&["bound"]).inc();
            String::new()
        }
        Err(e) => {
            app.metrics.bindings.with_label_values(&[e.kind()]).inc();
            tracing::warn!(pod = args.pod_name, namespace = args.pod_namespace, node = args.node, error = %e, "not bound");
            e.to_string()
        }
    };
    app.metrics.latency.with_label_values(&["bind"]).observe(started.elapsed().as_secs_f64());
    let answer = crate::protocol::ExtenderBindingResult { error };
    json_bytes(serde_json::to_vec(&answer).unwrap_or_default())
}

/// Ready once the watchers have listed the cluster (kube-scheduler's calls fail before).
async fn ready(State(app): State<Arc<App>>) -> Response {
    if app.extender.synced() {
        (StatusCode::OK, "ready\n").into_response()
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, format!("{}\n", crate::service::NOT_SYNCED))
            .into_response()
    }
}

async fn render_metrics(State(app): State<Arc<App>>) -> Response {
    {
        let view = app.extender.cluster.read().unwrap_or_else(std::sync::PoisonError::into_inner);
        app.metrics.cache_age.set(view.updated.map_or(-1.0, |at| at.elapsed().as_secs_f64()));
        let usable = view.states().count();
        app.metrics.nodes.with_label_values(&["usable"]).set(usable as f64);
        app.metrics.nodes.with_label_values(&["unusable"]).set((view.node_count() - usable) as f64);
    }
    let mut out = Vec::new();
    let _ = prometheus::TextEncoder::new().encode(&app.metrics.registry.gather(), &mut out);
    (StatusCode::OK, [("content-type", "text/plain; version=0.0.4")], out).into_response()
}
