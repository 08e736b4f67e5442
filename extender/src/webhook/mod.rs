//! The mutating admission webhook (`POST /mutate-pods`, AdmissionReview v1): a pod that asks for
//! a baleen resource and names no scheduler (or the default one) is sent to baleen's scheduler
//! (its `schedulerName` set by a JSON patch); a pod no node could serve is refused with the
//! reason, before it waits Pending for ever:
//!
//! - gpu-memory (or any baleen resource) in requests only, or requests unequal to limits: the
//!   API server would refuse it with a message about overcommit; said here in baleen's terms;
//! - gpu-memory and whole GPUs in one container: one container gets memory of one shared GPU
//!   or whole GPUs, not both;
//! - more gpu-memory units than the largest GPU the extender knows of has (only once it has
//!   seen a node's gpu-state).
//!
//! A body that is not an AdmissionReview is answered 400; a review the webhook cannot read is
//! allowed unchanged with a warning (the webhook's `failurePolicy` is Ignore: it never stops
//! pods it does not understand). A review is read as it streams, keeping only what is judged
//! ([`review`]), and at most [`MAX_CONCURRENT_REVIEWS`] are read at once. [`tls`] serves it over
//! TLS with its own certificate or cert-manager's.

pub mod review;
pub mod tls;

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use prometheus::{IntCounterVec, Opts, Registry};
use serde_json::Value;

use crate::demand::device_count;
use crate::protocol::{Container, Pod};
use crate::service::Extender;

/// The largest AdmissionReview read: a Pod is at most about 1.5 MiB (etcd's object limit).
pub const MAX_REVIEW_BYTES: usize = 3 << 20;

/// The most resources of baleen's domain one container's limits (or requests) may name: a
/// container asks for gpu-memory, whole GPUs, a MIG profile or an NVLink group; a list naming
/// more is refused (and a review keeps no more than one past this bound: [`review`]).
pub const MAX_NAMES: usize = 32;

/// Reviews judged at once, once their bodies are read whole (at most
/// [`crate::http::MAX_BODY_READS`] at once, within [`crate::http::BODY_TIMEOUT`]); more wait for
/// their turn, so that at most this many reviews' readings ([`review`]) are in memory. The API
/// server calls the webhook once per pod created; a review takes well under a millisecond.
pub const MAX_CONCURRENT_REVIEWS: usize = 4;

/// What the webhook does with a pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Asks for nothing of baleen's, or names another scheduler: unchanged.
    Leave,
    /// Sent to baleen's scheduler (`schedulerName` set).
    Send,
    /// Refused, with the reason the API server gives the user.
    Refuse(String),
}

impl Verdict {
    /// The metric label.
    pub fn as_str(&self) -> &'static str {
        match self {
            Self::Leave => "left",
            Self::Send => "sent",
            Self::Refuse(_) => "refused",
        }
    }
}

/// The verdict on `pod`: resources in `domain`, baleen's scheduler named `scheduler`, the
/// largest GPU known with `largest_units` gpu-memory units (`None` before any node is known).
pub fn judge(pod: &Pod, domain: &str, scheduler: &str, largest_units: Option<u32>) -> Verdict {
    judged(pod, domain, largest_units, scheduler, false)
}

/// The verdict of the opt-in second webhook (`POST /mutate-cpu-only-pods`, called for pods of
/// namespaces labelled to send their CPU-only pods to baleen's scheduler, which scores them by
/// the policy: `--score-cpu-only-pods`): a pod that asks for no baleen resource and names no
/// scheduler (or the default one) is sent; every other pod is the first webhook's, or left.
pub fn judge_cpu_only(pod: &Pod, domain: &str) -> Verdict {
    judged(pod, domain, None, "", true)
}

/// A [`Scan`] of `pod`'s containers, then its verdict.
fn judged(
    pod: &Pod,
    domain: &str,
    largest_units: Option<u32>,
    scheduler: &str,
    cpu_only: bool,
) -> Verdict {
    let prefix = format!("{domain}/");
    let mut scan = Scan::new(&prefix, largest_units);
    for c in pod.spec.containers.iter().flatten() {
        scan.container(c, false);
    }
    for c in pod.spec.init_containers.iter().flatten() {
        scan.container(c, true);
    }
    scan.verdict(pod.spec.scheduler_name.as_deref(), scheduler, cpu_only)
}

/// What the webhook has seen of a pod's containers so far: they come one at a time, as a
/// review streams past ([`review`]), and are judged as they come; the first problem found in
/// the containers, else the first in the init containers, refuses the pod.
pub(crate) struct Scan<'p> {
    /// `<domain>/`.
    prefix: &'p str,
    largest: Option<u32>,
    /// Some container asks a baleen resource in its limits.
    asks_limits: bool,
    /// Some container names a baleen resource in its limits or requests.
    asks_any: bool,
    refusal: Option<String>,
    init_refusal: Option<String>,
    /// The pod's `spec.resourceClaims` (at most [`MAX_NAMES`]).
    pub(crate) claims: Vec<crate::protocol::PodResourceClaim>,
    /// Some claim of the pod asks for baleen's DRA class (the extender judges such pods:
    /// `--dra-device-class`), as [`crate::claims::ClaimIndex::holds_counted`] found.
    pub(crate) holds_baleen_claims: bool,
}

impl<'p> Scan<'p> {
    pub(crate) fn new(prefix: &'p str, largest: Option<u32>) -> Self {
        Self {
            prefix,
            largest,
            asks_limits: false,
            asks_any: false,
            refusal: None,
            init_refusal: None,
            claims: Vec::new(),
            holds_baleen_claims: false,
        }
    }

    /// Judges container `c` (an init container when `init`).
    pub(crate) fn container(&mut self, c: &Container, init: bool) {
        let prefix = self.prefix;
        let names = |m: &Option<BTreeMap<String, Value>>| {
            m.iter().flatten().any(|(k, _)| k.starts_with(prefix))
        };
        self.asks_any |= names(&c.resources.limits) || names(&c.resources.requests);
        match container_problem(c, prefix, self.largest) {
            Ok(asks) => self.asks_limits |= asks,
            Err(why) => {
                let first = if init { &mut self.init_refusal } else { &mut self.refusal };
                if first.is_none() {
                    *first = Some(format!("container {}: {why}", c.name));
                }
            }
        }
    }

    /// The verdict on the pod whose containers were all given, which names `named` as its
    /// scheduler; by [`judge_cpu_only`]'s rule when `cpu_only`.
    pub(crate) fn verdict(self, named: Option<&str>, scheduler: &str, cpu_only: bool) -> Verdict {
        let unnamed = matches!(named, None | Some("" | "default-scheduler"));
        if cpu_only {
            return if unnamed && !self.asks_any { Verdict::Send } else { Verdict::Leave };
        }
        if let Some(why) = self.refusal.or(self.init_refusal) {
            return Verdict::Refuse(why);
        }
        if !self.asks_limits && !self.holds_baleen_claims {
            return Verdict::Leave;
        }
        if unnamed {
            Verdict::Send
        } else {
            // Baleen's already, or another scheduler chosen on purpose: not ours to override.
            tracing::debug!(scheduler = named, own = scheduler, "a pod that names its scheduler");
            Verdict::Leave
        }
    }
}

/// Whether `c` asks for a baleen resource, or why it cannot be served.
fn container_problem(c: &Container, prefix: &str, largest: Option<u32>) -> Result<bool, String> {
    let ours = |m: &Option<BTreeMap<String, Value>>| -> BTreeMap<String, Value> {
        m.iter()
            .flatten()
            .filter(|(k, _)| k.starts_with(prefix))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    };
    let limits = ours(&c.resources.limits);
    let requests = ours(&c.resources.requests);
    if limits.len().max(requests.len()) > MAX_NAMES {
        return Err(format!(
            "names more than {MAX_NAMES} resources of {} in its limits or its requests; a \
             container asks for gpu-memory, whole GPUs, a MIG slice or an NVLink group",
            prefix.trim_end_matches('/')
        ));
    }
    for (name, request) in &requests {
        match limits.get(name) {
            None => {
                return Err(format!(
                    "{name} is set in requests only; a device resource is asked for in limits \
                     (the request defaults to the limit): move it to resources.limits"
                ));
            }
            Some(limit) if device_count(limit) != device_count(request) => {
                return Err(format!(
                    "{name} asks {} in requests and {} in limits; device resources cannot be \
                     overcommitted: set one number in resources.limits",
                    shown(request),
                    shown(limit)
                ));
            }
            Some(_) => {}
        }
    }
    let memory = format!("{prefix}gpu-memory");
    let gpu = format!("{prefix}gpu");
    for (name, value) in &limits {
        if device_count(value).is_none() {
            return Err(format!("{name} = {} is not a whole positive number", shown(value)));
        }
    }
    if limits.contains_key(&memory) && limits.contains_key(&gpu) {
        return Err(format!(
            "asks for both {memory} and {gpu}; a container gets memory of one shared GPU or \
             whole GPUs, not both: ask for one, or split it into two containers"
        ));
    }
    if let (Some(units), Some(largest)) = (limits.get(&memory).and_then(device_count), largest)
        && units > largest
    {
        return Err(format!(
            "asks for {units} units of {memory}, but the largest GPU in the cluster has \
                 {largest}: a container's gpu-memory comes from one GPU; ask for at most \
                 {largest}, or for whole GPUs ({gpu})"
        ));
    }
    Ok(!limits.is_empty())
}

/// A value as the user wrote it, cut to a sane length for a message.
fn shown(value: &Value) -> String {
    let text = match value {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    };
    if text.len() > 40 {
        let cut = text.char_indices().nth(40).map_or(text.len(), |(i, _)| i);
        format!("{}...", &text[..cut])
    } else {
        text
    }
}

/// The webhook's metric families.
#[derive(Clone)]
pub struct WebhookMetrics {
    reviews: IntCounterVec,
}

impl WebhookMetrics {
    /// Registers the families in `registry`.
    pub fn new(registry: &Registry) -> Result<Self, prometheus::Error> {
        let reviews = IntCounterVec::new(
            Opts::new(
                "baleen_webhook_reviews_total",
                "Pods the admission webhook reviewed, by verdict: sent (schedulerName set), left, refused, unreadable (allowed unchanged).",
            ),
            &["verdict"],
        )?;
        registry.register(Box::new(reviews.clone()))?;
        Ok(Self { reviews })
    }
}

/// The webhook's state.
pub struct Webhook {
    extender: Arc<Extender>,
    scheduler: String,
    metrics: WebhookMetrics,
}

impl Webhook {
    /// The webhook for `extender`'s cluster view, sending pods to `scheduler`.
    pub fn new(extender: Arc<Extender>, scheduler: String, metrics: WebhookMetrics) -> Arc<Self> {
        Arc::new(Self { extender, scheduler, metrics })
    }

    /// The gpu-memory units of the largest GPU any node's gpu-state shows.
    fn largest_units(&self) -> Option<u32> {
        let view = self.extender.cluster.read().unwrap_or_else(std::sync::PoisonError::into_inner);
        view.states().flat_map(|s| s.gpus.iter()).map(|g| g.units_total).max()
    }

    /// The answer to one AdmissionReview body (JSON), or why the body is not one.
    pub fn review(&self, body: &[u8]) -> Result<Vec<u8>, String> {
        self.review_as(body, false)
    }

    /// [`Self::review`], judging by [`judge_cpu_only`] when `cpu_only`.
    pub fn review_as(&self, body: &[u8], cpu_only: bool) -> Result<Vec<u8>, String> {
        let rule = review::Rule {
            domain: &self.extender.settings().domain,
            scheduler: &self.scheduler,
            largest_units: if cpu_only { None } else { self.largest_units() },
            cpu_only,
            claims: (!cpu_only && self.extender.settings().claims.enabled())
                .then_some(&*self.extender.claims),
        };
        let reviewed = review::read(body, rule)?;
        match &reviewed.verdict {
            Err(why) => {
                self.metrics.reviews.with_label_values(&["unreadable"]).inc();
                tracing::warn!(
                    uid = reviewed.uid,
                    error = why,
                    "a review whose pod cannot be read: allowed unchanged"
                );
            }
            Ok(verdict) => {
                self.metrics.reviews.with_label_values(&[verdict.as_str()]).inc();
                if let Verdict::Refuse(why) = verdict {
                    tracing::info!(
                        namespace = reviewed.namespace,
                        name = reviewed.name,
                        reason = why,
                        "refused a pod"
                    );
                }
            }
        }
        Ok(review::answer(&reviewed, &self.scheduler))
    }
}

/// The webhook's routes: `POST /mutate-pods`, and `/healthz` for the TLS port.
pub fn router(webhook: Arc<Webhook>) -> Router {
    let reviews = Router::new()
        .route("/mutate-pods", post(mutate))
        .route("/mutate-cpu-only-pods", post(mutate_cpu_only))
        .layer(axum::extract::DefaultBodyLimit::max(MAX_REVIEW_BYTES))
        .layer(tower::limit::ConcurrencyLimitLayer::new(MAX_CONCURRENT_REVIEWS))
        .layer(axum::middleware::from_fn_with_state(
            crate::http::BodyReads::new(MAX_REVIEW_BYTES),
            crate::http::whole_body,
        ));
    reviews.route("/healthz", axum::routing::get(|| async { "ok" })).with_state(webhook)
}

async fn mutate(State(webhook): State<Arc<Webhook>>, body: Bytes) -> Response {
    answer(&webhook, &body, false)
}

async fn mutate_cpu_only(State(webhook): State<Arc<Webhook>>, body: Bytes) -> Response {
    answer(&webhook, &body, true)
}

fn answer(webhook: &Webhook, body: &[u8], cpu_only: bool) -> Response {
    match webhook.review_as(body, cpu_only) {
        Ok(answer) => {
            (StatusCode::OK, [("content-type", "application/json")], answer).into_response()
        }
        Err(why) => {
            webhook.metrics.reviews.with_label_values(&["unreadable"]).inc();
            tracing::warn!(error = why, "not an admission review");
            (StatusCode::BAD_REQUEST, format!("{why}\n")).into_response()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(containers: Value) -> Pod {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "p", "namespace": "n", "uid": "u"},
            "spec": {"containers": containers}
        }))
        .expect("pod")
    }

    const D: &str = "awesome-ai-company.com";

    #[test]
    fn cpu_only_verdicts() {
        let limits = |m: Value| serde_json::json!([{"name": "c", "resources": {"limits": m}}]);
        let cpu = pod(serde_json::json!([{"name": "c", "resources": {"requests": {"cpu": "2"}}}]));
        assert_eq!(judge_cpu_only(&cpu, D), Verdict::Send);
        let gpu = pod(limits(serde_json::json!({"awesome-ai-company.com/gpu-memory": "8"})));
        assert_eq!(judge_cpu_only(&gpu, D), Verdict::Leave, "the first webhook's");
        let mut named = cpu.clone();
        named.spec.scheduler_name = Some("volcano".into());
        assert_eq!(judge_cpu_only(&named, D), Verdict::Leave, "another scheduler on purpose");
    }

    #[test]
    fn verdicts() {
        let limits = |m: Value| serde_json::json!([{"name": "c", "resources": {"limits": m}}]);
        let send = pod(limits(serde_json::json!({"awesome-ai-company.com/gpu-memory": "8"})));
        assert_eq!(judge(&send, D, "baleen-scheduler", Some(140)), Verdict::Send);
        assert_eq!(judge(&send, D, "baleen-scheduler", None), Verdict::Send);
        let cpu = pod(limits(serde_json::json!({"cpu": "1"})));
        assert_eq!(judge(&cpu, D, "baleen-scheduler", Some(140)), Verdict::Leave);
        let too_big = pod(limits(serde_json::json!({"awesome-ai-company.com/gpu-memory": 141})));
        let Verdict::Refuse(why) = judge(&too_big, D, "s", Some(140)) else { panic!() };
        assert!(why.contains("141 units") && why.contains("has 140"), "{why}");
        let both = pod(limits(serde_json::json!({
            "awesome-ai-company.com/gpu-memory": "8", "awesome-ai-company.com/gpu": "1"
        })));
        assert!(matches!(judge(&both, D, "s", None), Verdict::Refuse(w) if w.contains("not both")));
        let requests_only = pod(serde_json::json!([{"name": "c", "resources": {
            "requests": {"awesome-ai-company.com/gpu-memory": "8"}}}]));
        assert!(matches!(
            judge(&requests_only, D, "s", None),
            Verdict::Refuse(w) if w.contains("requests only")
        ));
        let unequal = pod(serde_json::json!([{"name": "c", "resources": {
            "requests": {"awesome-ai-company.com/gpu-memory": "4"},
            "limits": {"awesome-ai-company.com/gpu-memory": "8"}}}]));
        assert!(
            matches!(judge(&unequal, D, "s", None), Verdict::Refuse(w) if w.contains("4 in requests"))
        );
        let fraction =
            pod(limits(serde_json::json!({"awesome-ai-company.com/gpu-memory": "500m"})));
        assert!(matches!(judge(&fraction, D, "s", None), Verdict::Refuse(_)));
        // A scheduler chosen on purpose is kept; baleen's own is left as it is.
        let mut named = send.clone();
        named.spec.scheduler_name = Some("volcano".into());
        assert_eq!(judge(&named, D, "baleen-scheduler", None), Verdict::Leave);
        named.spec.scheduler_name = Some("default-scheduler".into());
        assert_eq!(judge(&named, D, "baleen-scheduler", None), Verdict::Send);
        // Another domain's resources are not baleen's.
        let other = pod(limits(serde_json::json!({"nvidia.com/gpu": "1"})));
        assert_eq!(judge(&other, D, "s", None), Verdict::Leave);
    }
}
