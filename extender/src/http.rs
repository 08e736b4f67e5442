//! The extender's HTTP endpoint: `POST <prefix>/filter` and `<prefix>/prioritize` in
//! kube-scheduler's extender JSON, `GET /healthz`, and `GET /metrics` (request latency per verb,
//! nodes filtered out per reason, the node cache's age). A body that is not the protocol's JSON
//! is answered 400 with what is wrong, and logged; nothing in a request can panic the server.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use prometheus::{Encoder, GaugeVec, HistogramOpts, HistogramVec, IntCounterVec, Opts, Registry};
use tokio_util::sync::CancellationToken;

use crate::protocol::ExtenderArgs;
use crate::service::Extender;

/// The extender's metric families.
pub struct Metrics {
    registry: Registry,
    latency: HistogramVec,
    filtered: IntCounterVec,
    bad_requests: IntCounterVec,
    cache_age: prometheus::Gauge,
    nodes: GaugeVec,
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
                    "Time to answer one kube-scheduler call, by verb.",
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
                    "Nodes the filter removed, by reason: full (preemption might help), never (no such GPU, profile or group), no_state (no usable gpu-state annotation).",
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
        Ok(Self { registry, latency, filtered, bad_requests, cache_age, nodes })
    }
}

/// The largest request body accepted (5,000 Nodes of about 20 KiB each fit).
pub const MAX_BODY_BYTES: usize = 256 << 20;

struct App {
    extender: Arc<Extender>,
    metrics: Metrics,
}

/// The router, with the verbs under `prefix` (e.g. `/baleen`; empty for the root).
pub fn router(extender: Arc<Extender>, metrics: Metrics, prefix: &str) -> Router {
    let app = Arc::new(App { extender, metrics });
    let prefix = prefix.trim_end_matches('/');
    Router::new()
        .route(&format!("{prefix}/filter"), post(filter))
        .route(&format!("{prefix}/prioritize"), post(prioritize))
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(ready))
        .route("/metrics", get(render_metrics))
        // Nodes sent in full (nodeCacheCapable: false) are tens of KiB each: far past axum's
        // default 2 MB on a large cluster.
        .layer(axum::extract::DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(app)
}

/// Binds `address` and serves until `shutdown`; returns the bound address and the server.
pub async fn bind(
    address: SocketAddr,
    router: Router,
    shutdown: CancellationToken,
) -> std::io::Result<(SocketAddr, impl std::future::Future<Output = std::io::Result<()>>)> {
    let listener = tokio::net::TcpListener::bind(address).await?;
    let bound = listener.local_addr()?;
    let serve = async move {
        axum::serve(listener, router)
            .with_graceful_shutdown(async move { shutdown.cancelled().await })
            .await
    };
    Ok((bound, serve))
}

fn json(status: StatusCode, text: String) -> Response {
    (status, [("content-type", "application/json")], text).into_response()
}

fn parse(app: &App, verb: &str, body: &Bytes) -> Result<ExtenderArgs, Box<Response>> {
    serde_json::from_slice::<ExtenderArgs>(body).map_err(|e| {
        app.metrics.bad_requests.with_label_values(&[verb]).inc();
        tracing::warn!(verb, error = %e, "not an extender request");
        Box::new(
            (StatusCode::BAD_REQUEST, format!("not an ExtenderArgs JSON body: {e}\n"))
                .into_response(),
        )
    })
}

/// One span per call, so that every line it logs names the verb.
#[tracing::instrument(name = "filter", skip_all, fields(bytes = body.len()))]
async fn filter(State(app): State<Arc<App>>, body: Bytes) -> Response {
    let started = Instant::now();
    let args = match parse(&app, "filter", &body) {
        Ok(a) => a,
        Err(r) => return *r,
    };
    let (result, kinds) = app.extender.filter(&args);
    for kind in kinds {
        app.metrics.filtered.with_label_values(&[kind.as_str()]).inc();
    }
    if !result.error.is_empty() {
        tracing::warn!(error = result.error, "filter refused the pod");
    }
    app.metrics.latency.with_label_values(&["filter"]).observe(started.elapsed().as_secs_f64());
    json(StatusCode::OK, serde_json::to_string(&result).unwrap_or_default())
}

#[tracing::instrument(name = "prioritize", skip_all, fields(bytes = body.len()))]
async fn prioritize(State(app): State<Arc<App>>, body: Bytes) -> Response {
    let started = Instant::now();
    let args = match parse(&app, "prioritize", &body) {
        Ok(a) => a,
        Err(r) => return *r,
    };
    let answer = match app.extender.prioritize(&args) {
        Ok(scores) => json(StatusCode::OK, serde_json::to_string(&scores).unwrap_or_default()),
        Err(why) if why == crate::service::NOT_SYNCED => {
            (StatusCode::SERVICE_UNAVAILABLE, format!("{why}\n")).into_response()
        }
        Err(why) => {
            app.metrics.bad_requests.with_label_values(&["prioritize"]).inc();
            tracing::warn!(error = why, "prioritize refused the pod");
            (StatusCode::BAD_REQUEST, format!("{why}\n")).into_response()
        }
    };
    app.metrics.latency.with_label_values(&["prioritize"]).observe(started.elapsed().as_secs_f64());
    answer
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
