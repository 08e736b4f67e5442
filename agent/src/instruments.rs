//! The agent's own measurements (Allocate and GetPreferredAllocation latency and refusals,
//! checkpoint writes, reconciliations, registrations), recorded where they happen (the
//! device-plugin adapter, the reconciler) and registered in the registry the metrics endpoint
//! exports (`crate::metrics`).

use std::sync::Arc;

use prometheus::core::Collector;
use prometheus::{Opts, Registry};

/// A registry whose every series carries `node=<node>` (the registry's const label): the one
/// way this binary makes a registry, so that no family can lack the label.
pub fn registry_for(node: &str) -> Result<Registry, prometheus::Error> {
    let labels = std::collections::HashMap::from([("node".to_owned(), node.to_owned())]);
    Registry::new_custom(None, Some(labels))
}

/// Registers `metric` in `registry` and gives it back: the one registration helper of the
/// agent (its instruments and the families here).
pub fn register<M: Collector + Clone + 'static>(
    registry: &Registry,
    metric: Result<M, prometheus::Error>,
) -> Result<M, prometheus::Error> {
    let metric = metric?;
    registry.register(Box::new(metric.clone()))?;
    Ok(metric)
}

/// The agent's own measurements, recorded where they happen (the device-plugin adapter, the
/// checkpoint writes, the reconciler) and exported with the other families.
pub struct Instruments {
    /// Time the agent took to answer an Allocate, per resource.
    pub allocate_seconds: prometheus::HistogramVec,
    /// Time the agent took to answer a GetPreferredAllocation, per resource.
    pub preferred_seconds: prometheus::HistogramVec,
    /// Allocate and GetPreferredAllocation answers refused, per resource and kind.
    pub refusals: prometheus::IntCounterVec,
    /// Time one checkpoint write took (write, fsync, rename, directory fsync).
    pub checkpoint_write_seconds: prometheus::Histogram,
    /// Reconciliations with pod-resources, by outcome (applied, stale, unreachable).
    pub reconciliations: prometheus::IntCounterVec,
    /// What applied reconciliations changed, by change (released, restored, refused).
    pub reconcile_changes: prometheus::IntCounterVec,
    /// Registrations with the kubelet seen, per resource (a kubelet restart adds one).
    pub registrations: prometheus::IntCounterVec,
    /// 1 while co-location applies its policy, 0 when it is off or stopped.
    pub colocation_up: prometheus::IntGaugeVec,
    /// Pods the co-location policy has set, by class.
    pub colocation_pods: prometheus::IntGaugeVec,
    /// Pods the co-location policy could not set or put back (one per pod and attempt).
    pub colocation_failures: prometheus::IntCounterVec,
    /// MPS clients given a priority, by class and how their pod was found (pod, ambiguous,
    /// unknown).
    pub mps_priorities: prometheus::IntCounterVec,
    /// The node's device isolation checks, one series per check and state (1 for the state it
    /// is in).
    pub device_isolation: prometheus::IntGaugeVec,
    /// Allocate answers that gave GPUs by volume-mounts because the CDI specs lacked them.
    pub device_list_fallbacks: prometheus::IntCounterVec,
    /// GPU health transitions, per GPU and state reached (`unhealthy`, `healthy`).
    pub gpu_health_transitions: prometheus::IntCounterVec,
}

/// Latency buckets: 50 µs to 2.5 s.
const LATENCY_BUCKETS: [f64; 12] =
    [0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1, 0.5, 2.5];

impl Instruments {
    /// Registers the families in `registry` (made by [`registry_for`]: every
    /// series carries the node's name).
    pub fn new(registry: &Registry) -> Result<Arc<Self>, prometheus::Error> {
        use prometheus::{Histogram, HistogramOpts, HistogramVec, IntCounterVec, IntGaugeVec};
        let hist_vec = |name: &str, help: &str, labels: &[&str]| {
            let opts = HistogramOpts::new(name, help).buckets(LATENCY_BUCKETS.to_vec());
            register(registry, HistogramVec::new(opts, labels))
        };
        let counter_vec = |name: &str, help: &str, labels: &[&str]| {
            register(registry, IntCounterVec::new(Opts::new(name, help), labels))
        };
        let gauge_vec = |name: &str, help: &str, labels: &[&str]| {
            register(registry, IntGaugeVec::new(Opts::new(name, help), labels))
        };
        let checkpoint_write_seconds = register(
            registry,
            Histogram::with_opts(
                HistogramOpts::new(
                    "baleen_checkpoint_write_seconds",
                    "Time one checkpoint write took (write, fsync, rename, directory fsync).",
                )
                .buckets(LATENCY_BUCKETS.to_vec()),
            ),
        )?;
        Ok(Arc::new(Self {
            allocate_seconds: hist_vec(
                "baleen_allocate_seconds",
                "Time the agent took to answer an Allocate (its own part: checks, ledger, checkpoint).",
                &["resource"],
            )?,
            preferred_seconds: hist_vec(
                "baleen_preferred_allocation_seconds",
                "Time the agent took to answer a GetPreferredAllocation.",
                &["resource"],
            )?,
            refusals: counter_vec(
                "baleen_refusals_total",
                "Allocate and GetPreferredAllocation answers refused, by kind (unknown, invalid, conflict, exhausted, unavailable, internal).",
                &["resource", "kind"],
            )?,
            checkpoint_write_seconds,
            reconciliations: counter_vec(
                "baleen_reconciliations_total",
                "Reconciliations with the kubelet's pod-resources list, by outcome (applied, stale, unreachable).",
                &["outcome"],
            )?,
            reconcile_changes: counter_vec(
                "baleen_reconcile_changes_total",
                "What applied reconciliations changed (released, restored, refused allocations) or held (a miss not confirmed: counted at every reconciliation that holds it).",
                &["change"],
            )?,
            registrations: counter_vec(
                "baleen_kubelet_registrations_total",
                "Registrations with the kubelet, per resource (a kubelet restart adds one).",
                &["resource"],
            )?,
            colocation_up: gauge_vec(
                "baleen_colocation_up",
                "1 while co-location applies its classes to the node's pods, 0 when it is off or stopped (see the agent's log).",
                &[],
            )?,
            colocation_pods: gauge_vec(
                "baleen_colocation_pods",
                "Pods the co-location policy has set, by class (inference, training).",
                &["class"],
            )?,
            colocation_failures: counter_vec(
                "baleen_colocation_failures_total",
                "Pods the co-location policy could not set or put back (one per pod and attempt; retried at the next resync).",
                &[],
            )?,
            mps_priorities: counter_vec(
                "baleen_mps_client_priorities_total",
                "MPS clients given the priority of a class in Allocate, by class and how their pod was found (pod, ambiguous, unknown: the default class).",
                &["class", "identity"],
            )?,
            device_isolation: gauge_vec(
                "baleen_device_isolation",
                "The node's device isolation checks at the agent's start (strategy; cdi-spec: the CDI specs name every GPU; toolkit-envvar: the NVIDIA toolkit refuses NVIDIA_VISIBLE_DEVICES for unprivileged containers; toolkit-volume-mounts): 1 for the state each is in (ok, failed, unknown).",
                &["strategy", "check", "state"],
            )?,
            gpu_health_transitions: counter_vec(
                "baleen_gpu_health_transitions_total",
                "GPU health transitions, by the state reached: unhealthy (a critical XID, a failed health watch), healthy (every re-probe answered).",
                &["gpu_uuid", "to"],
            )?,
            device_list_fallbacks: counter_vec(
                "baleen_device_list_fallbacks_total",
                "Allocate answers that handed GPUs out by volume-mounts because the node's CDI specs do not name them (deviceListStrategy cdi).",
                &[],
            )?,
        }))
    }
}

/// The label value of a refusal's kind.
pub fn refusal_kind(e: &baleen_device_plugin::BackendError) -> &'static str {
    use baleen_device_plugin::BackendError as E;
    match e {
        E::UnknownDevices { .. } => "unknown",
        E::InvalidRequest { .. } => "invalid",
        E::Conflict { .. } => "conflict",
        E::Exhausted { .. } => "exhausted",
        E::Unavailable { .. } => "unavailable",
        E::Internal { .. } => "internal",
    }
}
