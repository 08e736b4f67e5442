//! The agent's Prometheus endpoint: `/metrics` (text format, from a registry passed in, no
//! global registry), `/healthz` (the process answers) and `/readyz` (every resource registered
//! with the kubelet, and every shared GPU's MPS daemon answering where MPS is on), on
//! `metrics.address`. Families are filled from the agent's in-memory state at each scrape (the
//! ledger, the watchdog's episodes and the last telemetry read: no NVML call on the scrape path;
//! [`read_telemetry`] reads NVML every `metrics.interval` on a blocking thread, and a hung read
//! shows as a growing `baleen_telemetry_age_seconds`); series of GPUs, resources and episodes
//! that are gone disappear with them. Run by the agent as two subsystems (reader, endpoint).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use baleen_device_plugin::PluginState;
use prometheus::core::{Collector, Desc};
use prometheus::proto::MetricFamily;
use prometheus::{
    Encoder as _, GaugeVec, IntCounter, IntCounterVec, IntGaugeVec, Opts, Registry, TextEncoder,
};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::error_chain::Chain;
use crate::instruments::{Instruments, register};
use crate::inventory::{CallFailures, GpuInventory, GpuTelemetry};
use crate::isolation::watchdog::Published;
use crate::ledger::GpuMode;
use crate::resources::NodeResources;

/// Whether and where the endpoint serves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetricsConfig {
    /// Serve the endpoint (default true).
    pub enabled: bool,
    /// Where (default `0.0.0.0:9477`).
    pub address: SocketAddr,
    /// Where `/healthz` and `/readyz` are served for the kubelet's exec probes, alone (default
    /// `127.0.0.1:9476`: the loopback address of the agent's own network namespace, which no
    /// other pod reaches, so none can fill it).
    pub probe_address: SocketAddr,
    /// Time between two telemetry reads (default 10 s).
    pub interval: Duration,
}

impl Default for MetricsConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            address: crate::defaults::METRICS_ADDRESS,
            probe_address: crate::defaults::PROBE_ADDRESS,
            interval: crate::defaults::METRICS_INTERVAL,
        }
    }
}

/// The last good telemetry read.
#[derive(Debug, Clone, Default)]
pub struct TelemetryRead {
    /// Per GPU.
    pub readings: Vec<GpuTelemetry>,
    /// When it was read.
    pub at: Option<Instant>,
}

/// Reads every GPU's telemetry every `interval` on a blocking thread (NVML calls block) until
/// `shutdown`, publishing each good read; counts failed reads in `failures`.
pub async fn read_telemetry(
    inventory: Arc<dyn GpuInventory>,
    interval: Duration,
    publish: watch::Sender<TelemetryRead>,
    failures: IntCounter,
    calls: Arc<CallFailures>,
    shutdown: CancellationToken,
) {
    let mut failing = false;
    loop {
        let reading = inventory.clone();
        // A read that hangs leaves the last good read published, ageing
        // (`baleen_telemetry_age_seconds`).
        let hang = interval.max(Duration::from_secs(5));
        let what = "GPU telemetry (the last good read stays published and ages)";
        let Some(read) =
            crate::inventory::read_off_thread(what, hang, &shutdown, move || reading.telemetry())
                .await
        else {
            return;
        };
        match read {
            Ok(Ok(readings)) => {
                failing = false;
                publish.send_replace(TelemetryRead { readings, at: Some(Instant::now()) });
            }
            Ok(Err(e)) => {
                failures.inc();
                calls.record(&e);
                if !failing {
                    tracing::warn!(error = %Chain(&e), "cannot read GPU telemetry; the last good read stays published and ages");
                    failing = true;
                }
            }
            Err(e) => {
                failures.inc();
                tracing::error!(error = %Chain(&e), "telemetry read failed");
            }
        }
        if !crate::retry::sleep_or_stop(interval, &shutdown).await {
            return;
        }
    }
}

/// Why the metrics could not be set up or served.
#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    /// A family could not be registered (a name used twice).
    #[error("cannot register the metric families")]
    Register(#[source] prometheus::Error),
    /// The address cannot be bound.
    #[error("cannot listen for metrics on {address}")]
    Bind {
        /// The address.
        address: SocketAddr,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The render thread cannot be started.
    #[error("cannot start the metrics render thread")]
    RenderThread(#[source] std::io::Error),
}

const GPU_LABELS: [&str; 3] = ["gpu_uuid", "gpu_index", "model"];
const GRANT_LABELS: [&str; 5] = ["namespace", "pod", "container", "resource", "gpu_uuid"];

/// What the state families are read from at each scrape.
pub struct StateSources {
    /// The ledger (its published snapshot: no lock a change needs).
    pub resources: Arc<NodeResources>,
    /// What the memory watchdog publishes.
    pub watchdog: Published,
    /// NVML call failures so far.
    pub calls: Arc<CallFailures>,
    /// The last good telemetry read.
    pub telemetry: watch::Receiver<TelemetryRead>,
    /// Whether MPS enforces the gpu-memory units.
    pub mps_enforced: bool,
}

/// The families that describe the node's state, built afresh at every scrape from one reading
/// of [`StateSources`] (a `prometheus` collector): a series lives exactly as long as what it
/// describes, and there is nothing to reset. A new state family is one `add` in
/// `state_families` and its row in docs/metrics.md.
pub struct StateCollector {
    sources: StateSources,
    descs: Vec<Desc>,
}

impl StateCollector {
    /// The collector over `sources`.
    pub fn new(sources: StateSources) -> Result<Self, prometheus::Error> {
        let descs = state_families(&sources)?.descs();
        Ok(Self { sources, descs })
    }
}

impl Collector for StateCollector {
    fn desc(&self) -> Vec<&Desc> {
        self.descs.iter().collect()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        match state_families(&self.sources) {
            Ok(families) => families.collect(),
            // Only a family whose labels do not match its values, which the tests would show.
            Err(e) => {
                tracing::error!(error = %Chain(&e), "cannot build the state metric families");
                Vec::new()
            }
        }
    }
}

/// The families of one scrape, in the order they were added.
#[derive(Default)]
struct Families(Vec<Box<dyn Collector>>);

impl Families {
    /// Adds a family (empty) and gives it back to be filled.
    fn add<M: Collector + Clone + 'static>(
        &mut self,
        family: Result<M, prometheus::Error>,
    ) -> Result<M, prometheus::Error> {
        let family = family?;
        self.0.push(Box::new(family.clone()));
        Ok(family)
    }

    fn collect(&self) -> Vec<MetricFamily> {
        self.0.iter().flat_map(|f| f.collect()).collect()
    }

    fn descs(&self) -> Vec<Desc> {
        self.0.iter().flat_map(|f| f.desc().into_iter().cloned()).collect()
    }
}

fn int_gauges(name: &str, help: &str, labels: &[&str]) -> Result<IntGaugeVec, prometheus::Error> {
    IntGaugeVec::new(Opts::new(name, help), labels)
}

fn gauges(name: &str, help: &str, labels: &[&str]) -> Result<GaugeVec, prometheus::Error> {
    GaugeVec::new(Opts::new(name, help), labels)
}

fn counters(name: &str, help: &str, labels: &[&str]) -> Result<IntCounterVec, prometheus::Error> {
    IntCounterVec::new(Opts::new(name, help), labels)
}

/// Every state family, named, described and filled from one reading of `sources`: the ledger's
/// published state (one snapshot for the whole scrape), the watchdog's last round and counts,
/// NVML's failed calls and the last telemetry read.
fn state_families(sources: &StateSources) -> Result<Families, prometheus::Error> {
    let crate::resources::ScrapeView {
        gpus,
        views,
        reasons,
        clients,
        records,
        fragmentation,
        grants,
    } = sources.resources.scrape_view();
    let telemetry = sources.telemetry.borrow().clone();
    let watchdog = &sources.watchdog;
    let mut f = Families::default();
    let with = |extra: &'static str| {
        let mut labels = GPU_LABELS.to_vec();
        labels.push(extra);
        labels
    };
    let int = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);

    // The GPUs: what each is, holds and reads.
    let gpu_info =
        f.add(int_gauges("baleen_gpu_info", "A GPU of the node (value 1).", &GPU_LABELS))?;
    let gpu_memory_total =
        f.add(int_gauges("baleen_gpu_memory_total_bytes", "Memory of the GPU.", &GPU_LABELS))?;
    let gpu_memory_granted = f.add(int_gauges(
        "baleen_gpu_memory_granted_bytes",
        "Memory of the GPU handed out: all of it when held whole, else its gpu-memory units held times the unit.",
        &GPU_LABELS,
    ))?;
    let gpu_units = f.add(int_gauges(
        "baleen_gpu_memory_units",
        "gpu-memory units the GPU offers.",
        &GPU_LABELS,
    ))?;
    let gpu_units_held = f.add(int_gauges(
        "baleen_gpu_memory_units_held",
        "gpu-memory units of the GPU held by containers.",
        &GPU_LABELS,
    ))?;
    let gpu_healthy = f.add(int_gauges(
        "baleen_gpu_healthy",
        "1 if the GPU is healthy (no critical XID, the health watch runs).",
        &GPU_LABELS,
    ))?;
    let gpu_mode = f.add(int_gauges(
        "baleen_gpu_mode",
        "How the GPU serves now (value 1 on the series of its mode: idle, exclusive, shared or mig).",
        &with("mode"),
    ))?;
    let gpu_mps_up = f.add(int_gauges(
        "baleen_gpu_mps_daemon_up",
        "1 if the GPU's MPS daemon answers (its memory units are offered only then); only for GPUs whose units MPS enforces.",
        &GPU_LABELS,
    ))?;
    let mps_clients = f.add(int_gauges(
        "baleen_gpu_mps_clients",
        "MPS client processes on the GPU at the last probe of its daemon.",
        &GPU_LABELS,
    ))?;
    let unhealthy_reason = f.add(int_gauges(
        "baleen_gpu_unhealthy_reason",
        "Why an unhealthy GPU is (value 1, while it is): a critical XID, or the health watch failing or not running.",
        &with("reason"),
    ))?;
    let largest_free = f.add(int_gauges(
        "baleen_gpu_memory_units_largest_free",
        "gpu-memory units one container could get on this GPU now (its free units when they are offered, else 0): the largest block a request of one GPU can use.",
        &GPU_LABELS,
    ))?;
    let stranded = f.add(int_gauges(
        "baleen_gpu_memory_units_stranded",
        "gpu-memory units free but unusable because the GPU is held whole through another view.",
        &GPU_LABELS,
    ))?;
    let memory_used = f.add(int_gauges(
        "baleen_gpu_memory_used_bytes",
        "GPU memory in use (NVML), as of the last telemetry read.",
        &GPU_LABELS,
    ))?;
    let utilisation = f.add(gauges(
        "baleen_gpu_utilization_ratio",
        "Share of the last sample period a kernel ran on the GPU, 0 to 1.",
        &GPU_LABELS,
    ))?;
    let memory_utilisation = f.add(gauges(
        "baleen_gpu_memory_utilization_ratio",
        "Share of the last sample period the GPU's memory was read or written, 0 to 1.",
        &GPU_LABELS,
    ))?;
    let temperature =
        f.add(int_gauges("baleen_gpu_temperature_celsius", "GPU die temperature.", &GPU_LABELS))?;
    let power = f.add(gauges("baleen_gpu_power_watts", "GPU power draw.", &GPU_LABELS))?;
    for g in &gpus {
        let index = g.index.to_string();
        let labels = [g.uuid.as_str(), index.as_str(), g.model.as_str()];
        gpu_info.with_label_values(&labels).set(1);
        gpu_memory_total.with_label_values(&labels).set(int(g.memory_bytes));
        gpu_memory_granted.with_label_values(&labels).set(int(g.granted_bytes));
        gpu_units.with_label_values(&labels).set(i64::from(g.units));
        gpu_units_held.with_label_values(&labels).set(i64::from(g.units_held));
        gpu_healthy.with_label_values(&labels).set(i64::from(g.healthy));
        let mode = [g.uuid.as_str(), index.as_str(), g.model.as_str(), g.mode.as_str()];
        gpu_mode.with_label_values(&mode).set(1);
        if sources.mps_enforced && g.units > 0 {
            gpu_mps_up.with_label_values(&labels).set(i64::from(g.shares_enforced));
            if let Some(&n) = clients.get(&g.uuid) {
                mps_clients.with_label_values(&labels).set(int(n as u64));
            }
        }
        if let Some(reason) = reasons.get(&g.uuid).filter(|_| !g.healthy) {
            let with_reason = [g.uuid.as_str(), index.as_str(), g.model.as_str(), reason.as_str()];
            unhealthy_reason.with_label_values(&with_reason).set(1);
        }
        let free = i64::from(g.units.saturating_sub(g.units_held));
        let offered = g.healthy && g.shares_enforced && g.mode != GpuMode::Exclusive;
        largest_free.with_label_values(&labels).set(if offered { free } else { 0 });
        let unusable = if g.mode == GpuMode::Exclusive { free } else { 0 };
        stranded.with_label_values(&labels).set(unusable);
        let reading = telemetry
            .readings
            .iter()
            .find(|t| t.gpu.as_ref().is_some_and(|u| u.as_str() == g.uuid));
        if let Some(t) = reading {
            if let Some(v) = t.memory_used_bytes {
                memory_used.with_label_values(&labels).set(int(v));
            }
            if let Some(v) = t.gpu_utilisation {
                utilisation.with_label_values(&labels).set(v);
            }
            if let Some(v) = t.memory_utilisation {
                memory_utilisation.with_label_values(&labels).set(v);
            }
            if let Some(v) = t.temperature_celsius {
                temperature.with_label_values(&labels).set(i64::from(v));
            }
            if let Some(v) = t.power_watts {
                power.with_label_values(&labels).set(v);
            }
        }
    }
    let telemetry_age = f.add(gauges(
        "baleen_telemetry_age_seconds",
        "Seconds since the last good telemetry read (a hung or failing NVML makes it grow).",
        &[],
    ))?;
    if let Some(at) = telemetry.at {
        telemetry_age.with_label_values::<&str>(&[]).set(at.elapsed().as_secs_f64());
    }

    // The node's fragmentation.
    let fragmentation_gpus = f.add(gauges(
        "baleen_node_fragmentation_gpus",
        "The node's GPU fragmentation by the FGD measure: the expected free GPU compute, in GPUs, that a task drawn from the target workload (the shapes of this agent's last 1000 grants) could not use.",
        &[],
    ))?;
    fragmentation_gpus.with_label_values::<&str>(&[]).set(fragmentation.milli_gpu / 1000.0);
    let free_compute = f.add(gauges(
        "baleen_node_free_compute_gpus",
        "Free GPU compute, in GPUs, as the fragmentation measure counts it (free units over units per GPU; 0 for GPUs held whole, in MIG mode or unhealthy).",
        &[],
    ))?;
    free_compute.with_label_values::<&str>(&[]).set(fragmentation.free_milli_gpu as f64 / 1000.0);
    let fragmentation_learned = f.add(int_gauges(
        "baleen_node_fragmentation_target_grants",
        "How many grants the fragmentation's target workload is learned from (0: none yet, and the fragmentation is 0).",
        &[],
    ))?;
    fragmentation_learned
        .with_label_values::<&str>(&[])
        .set(int(fragmentation.learned_from as u64));

    // The resources advertised.
    let resource_devices = f.add(int_gauges(
        "baleen_resource_devices",
        "Devices the resource advertises.",
        &["resource"],
    ))?;
    let resource_healthy = f.add(int_gauges(
        "baleen_resource_healthy_devices",
        "Devices the resource advertises Healthy (allocatable now).",
        &["resource"],
    ))?;
    let resource_allocated = f.add(int_gauges(
        "baleen_resource_allocated_devices",
        "Devices of the resource held by containers.",
        &["resource"],
    ))?;
    for (resource, devices, healthy) in &views {
        let labels = [resource.as_str()];
        resource_devices.with_label_values(&labels).set(int(*devices as u64));
        resource_healthy.with_label_values(&labels).set(int(*healthy as u64));
        let allocated: usize =
            records.iter().filter(|r| r.resource == *resource).map(|r| r.device_ids.len()).sum();
        resource_allocated.with_label_values(&labels).set(int(allocated as u64));
    }

    // The grants, with what the watchdog read of them.
    let grant_bytes = f.add(int_gauges(
        "baleen_grant_memory_bytes",
        "GPU memory granted to a container on one GPU (gpu-memory units times the unit, a whole GPU's or a MIG instance's memory); pod labels from the kubelet's pod-resources list, empty until it lists the grant. The series ends with the grant.",
        &GRANT_LABELS,
    ))?;
    let grant_used = f.add(int_gauges(
        "baleen_grant_memory_used_bytes",
        "GPU memory the processes of a grant's container use together on its GPU (the memory watchdog's last read, processes attributed by their cgroup); labels as baleen_grant_memory_bytes.",
        &GRANT_LABELS,
    ))?;
    let grant_episodes = f.add(counters(
        "baleen_grant_over_grant_episodes_total",
        "Times the processes of a gpu-memory grant went over it on its GPU together (the memory watchdog); labels as baleen_grant_memory_bytes.",
        &GRANT_LABELS,
    ))?;
    let usage = watchdog.usage.borrow().clone();
    // Each grant's usage by key: one lookup per grant, not a scan (the first of a key wins).
    let mut used_by = std::collections::HashMap::new();
    for u in &usage {
        used_by.entry((u.gpu.as_str(), u.resource.as_str(), u.device_ids.as_slice())).or_insert(u);
    }
    for (record, gpu, bytes, holder) in grants.iter().cloned() {
        let (namespace, pod, container) =
            holder.map(|k| (k.namespace, k.pod, k.container)).unwrap_or_default();
        let labels = [
            namespace.as_str(),
            pod.as_str(),
            container.as_str(),
            record.resource.as_str(),
            gpu.as_str(),
        ];
        grant_bytes.with_label_values(&labels).set(int(bytes));
        let used =
            used_by.get(&(gpu.as_str(), record.resource.as_str(), record.device_ids.as_slice()));
        if let Some(u) = used {
            grant_used.with_label_values(&labels).set(int(u.used_bytes));
            grant_episodes.with_label_values(&labels).inc_by(u.over_grant_episodes);
        }
    }

    // DRA claims (`driver: dra`): each booked device by its claim and the pod it is reserved for.
    let claim_bytes = f.add(int_gauges(
        "baleen_claim_memory_bytes",
        "GPU memory a DRA claim's device holds on one GPU (driver: dra): a share's consumed memory, a whole GPU's or a MIG instance's; the pod is the first the claim is reserved for. The series ends with the claim's Unprepare.",
        &["namespace", "pod", "claim", "device", "gpu_uuid"],
    ))?;
    for (record, gpu, bytes, _) in grants {
        if let Some(c) = &record.claim {
            let pod = c.pod.as_deref().unwrap_or("");
            let labels =
                [c.namespace.as_str(), pod, c.name.as_str(), c.device.as_str(), gpu.as_str()];
            claim_bytes.with_label_values(&labels).set(int(bytes));
        }
    }

    // The memory watchdog: containers over their grant, processes without one, what it did.
    let over_grant = f.add(int_gauges(
        "baleen_container_gpu_memory_over_grant_bytes",
        "GPU memory a container uses beyond its gpu-memory grant, while it does (the memory watchdog).",
        &["gpu_uuid", "pod_uid", "container_id"],
    ))?;
    for o in watchdog.over.borrow().iter() {
        let gpu = o.gpu.to_string();
        let pod = o.container.pod_uid.as_deref().unwrap_or("");
        over_grant
            .with_label_values(&[gpu.as_str(), pod, o.container.container_id.as_str()])
            .set(int(o.used_bytes.saturating_sub(o.granted_bytes)));
    }
    let stray_processes = f.add(int_gauges(
        "baleen_gpu_processes_without_grant",
        "Processes of a pod's container using a GPU that no grant of the container covers, for at least watchdog.grace (the memory watchdog; reported, not killed), by reason: no-grant, unknown-pod, unknown-container.",
        &["gpu_uuid", "reason"],
    ))?;
    let stray_bytes = f.add(int_gauges(
        "baleen_gpu_memory_without_grant_bytes",
        "GPU memory those processes use; labels as baleen_gpu_processes_without_grant.",
        &["gpu_uuid", "reason"],
    ))?;
    for s in watchdog.strays.borrow().iter() {
        let gpu = s.gpu.to_string();
        let labels = [gpu.as_str(), s.reason.label()];
        stray_processes.with_label_values(&labels).inc();
        stray_bytes.with_label_values(&labels).add(int(s.used_bytes));
    }
    let load = |c: &std::sync::atomic::AtomicU64| c.load(std::sync::atomic::Ordering::Relaxed);
    let counts = &watchdog.counts;
    let watchdog_kills = f.add(counters(
        "baleen_watchdog_killed_processes_total",
        "Processes the memory watchdog killed: their container stayed over its gpu-memory grant for watchdog.grace (watchdog.action: kill).",
        &[],
    ))?;
    watchdog_kills.with_label_values::<&str>(&[]).inc_by(load(&counts.kills));
    let watchdog_events = f.add(counters(
        "baleen_watchdog_events_total",
        "Kubernetes Events of the memory watchdog, by outcome: queued (for the API server), dropped (the queue was full), failed (the API server refused or did not answer).",
        &["outcome"],
    ))?;
    for (outcome, c) in
        [("queued", &counts.queued), ("dropped", &counts.dropped), ("failed", &counts.failed)]
    {
        watchdog_events.with_label_values(&[outcome]).inc_by(load(c));
    }

    // NVML.
    let nvml_failures = f.add(counters(
        "baleen_nvml_call_failures_total",
        "NVML calls that failed or returned an unusable value while the agent ran (telemetry, memory watchdog, health watch), by NVML function.",
        &["call"],
    ))?;
    for (call, n) in sources.calls.counts() {
        nvml_failures.with_label_values(&[call]).inc_by(n);
    }
    Ok(f)
}

/// The agent's metric families, registered in one registry: the state families (read at each
/// scrape by a [`StateCollector`]) and the counters of the endpoint and telemetry reader.
pub struct Metrics {
    registry: Registry,
    /// Connections the metrics server closed at accept: it held [`MAX_CONNECTIONS`] already.
    connections_refused: IntCounter,
    /// Failed telemetry reads (the reader counts them).
    pub telemetry_failures: IntCounter,
}

impl Metrics {
    /// Registers the families in `registry` (made by [`crate::instruments::registry_for`]).
    pub fn new(registry: Registry, sources: StateSources) -> Result<Self, MetricsError> {
        let r = &registry;
        let state = StateCollector::new(sources).map_err(MetricsError::Register)?;
        r.register(Box::new(state)).map_err(MetricsError::Register)?;
        let counter = |name: &str, help: &str| {
            register(r, IntCounter::with_opts(Opts::new(name, help)))
                .map_err(MetricsError::Register)
        };
        Ok(Self {
            telemetry_failures: counter(
                "baleen_telemetry_read_failures_total",
                "Telemetry reads that failed.",
            )?,
            connections_refused: counter(
                "baleen_metrics_connections_refused_total",
                "Connections the metrics server closed at once because it held its maximum already (a client holding connections open, or too many scrapers).",
            )?,
            registry,
        })
    }

    /// The text exposition of every family now.
    pub fn render(&self) -> String {
        let mut out = Vec::new();
        // Encoding into memory fails only for invalid families, which registration refused.
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut out);
        String::from_utf8_lossy(&out).into_owned()
    }
}

/// What the endpoint reads.
pub struct Endpoint {
    /// The families.
    pub metrics: Metrics,
    /// The ledger (for readiness).
    pub resources: Arc<NodeResources>,
    /// Each resource's plugin state.
    pub plugins: Vec<(String, watch::Receiver<PluginState>)>,
    /// The agent's own measurements (registrations are counted here from the plugins' states).
    pub instruments: Arc<Instruments>,
    /// Whether MPS enforces the gpu-memory units.
    pub mps_enforced: bool,
    /// The last render and when it started (see `scrape`).
    pub last_render: tokio::sync::Mutex<Option<(Instant, axum::body::Bytes)>>,
    /// Paces the scrapes served (see [`Pacer`]).
    pub pacer: Pacer,
    /// Where renders run (see [`Renderer`]).
    pub renderer: Renderer,
}

/// The thread renders run on, at the kernel's idle scheduling class (`SCHED_IDLE`): a render
/// takes a core for a few milliseconds, and on a node whose agent has one or two cores the
/// Allocate it would delay matters more than the scrape. A thread of the normal class that wakes
/// (a gRPC answer, a checkpoint write) preempts it at once; the kernel still gives it a small
/// share of a busy core, so a scrape is delayed under load, never starved. Readers it uses
/// (the published ledger, the watchdog's and telemetry's channels) take no lock a change needs.
pub struct Renderer {
    jobs: std::sync::mpsc::Sender<RenderJob>,
    /// What the thread's scheduling class is (`SCHED_IDLE`, or why not).
    class: std::sync::Arc<std::sync::OnceLock<Result<(), String>>>,
}

type RenderJob = Box<dyn FnOnce() + Send>;

impl Renderer {
    /// Starts the thread; it ends when the renderer is dropped. The scheduling class is asked
    /// for on the thread itself: where the kernel refuses it the renders run at the normal
    /// class, and that is said (a warning here, and [`Renderer::idle`]).
    pub fn start() -> std::io::Result<Self> {
        let (jobs, queue) = std::sync::mpsc::channel::<RenderJob>();
        let class = std::sync::Arc::new(std::sync::OnceLock::new());
        let set = class.clone();
        std::thread::Builder::new().name("baleen-render".to_owned()).spawn(move || {
            use thread_priority::{
                NormalThreadSchedulePolicy, ThreadPriority, ThreadSchedulePolicy,
                set_thread_priority_and_policy, thread_native_id,
            };
            let idle = set_thread_priority_and_policy(
                thread_native_id(),
                ThreadPriority::Min,
                ThreadSchedulePolicy::Normal(NormalThreadSchedulePolicy::Idle),
            )
            .map_err(|e| format!("{e:?}"));
            if let Err(e) = &idle {
                tracing::warn!(
                    error = %e,
                    "the kernel refused SCHED_IDLE for the metrics render thread: renders run \
                     at the normal class and compete with Allocate for the CPU"
                );
            }
            let _ = set.set(idle);
            for job in queue {
                job();
            }
        })?;
        Ok(Self { jobs, class })
    }

    /// Runs `f` on the render thread; `None` if the thread is gone (it panicked).
    pub async fn run<T: Send + 'static>(
        &self,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> Option<T> {
        let (answer, answered) = tokio::sync::oneshot::channel();
        let job: RenderJob = Box::new(move || {
            let _ = answer.send(f());
        });
        self.jobs.send(job).ok()?;
        answered.await.ok()
    }

    /// Whether the thread runs at `SCHED_IDLE` (`Err`: why not; `None`: not known yet).
    pub fn idle(&self) -> Option<Result<(), String>> {
        self.class.get().cloned()
    }
}

/// Scrapes served per second at most, after a burst of [`SCRAPE_BURST`]: Prometheus scrapes a
/// target every few seconds (an HA pair, twice), so only a flood waits; what it costs the agent
/// (connections, HTTP, the text written) is bounded by this rate, not by the flood.
pub const MAX_SCRAPES_PER_SECOND: u32 = 50;
/// Scrapes served at once before the pace applies.
pub const SCRAPE_BURST: u32 = 10;

/// A rate limit by theoretical arrival time (GCRA): a scrape waits until its turn at
/// [`MAX_SCRAPES_PER_SECOND`], with [`SCRAPE_BURST`] served without waiting.
#[derive(Debug)]
pub struct Pacer {
    /// When the next scrape is due, were none early.
    due: std::sync::Mutex<Instant>,
}

impl Default for Pacer {
    fn default() -> Self {
        Self { due: std::sync::Mutex::new(Instant::now()) }
    }
}

impl Pacer {
    /// How long the scrape arriving now must wait for its turn (and takes it).
    fn turn(&self) -> Duration {
        let period = Duration::from_secs(1) / MAX_SCRAPES_PER_SECOND;
        let now = Instant::now();
        let mut due = self.due.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let at = (*due).max(now);
        *due = at + period;
        at.saturating_duration_since(now + period * SCRAPE_BURST)
    }
}

impl Endpoint {
    /// Whether the agent is ready: every resource registered, every shared GPU's MPS daemon
    /// answering where MPS is on; if not, why.
    pub fn ready(&self) -> Result<(), String> {
        let waiting: Vec<&str> = self
            .plugins
            .iter()
            .filter(|(_, s)| !matches!(*s.borrow(), PluginState::Registered { .. }))
            .map(|(r, _)| r.as_str())
            .collect();
        if !waiting.is_empty() {
            return Err(format!("not registered with the kubelet: {}", waiting.join(", ")));
        }
        if self.mps_enforced {
            let (gpus, _) = self.resources.snapshot();
            let down: Vec<String> = gpus
                .into_iter()
                .filter(|g| g.units > 0 && !g.shares_enforced)
                .map(|g| g.uuid)
                .collect();
            if !down.is_empty() {
                return Err(format!("MPS daemon not answering for {}", down.join(", ")));
            }
        }
        Ok(())
    }
}

/// What the metrics port admits (`baleen_edge::gate`): at most 128 connections, 32 from one
/// address; at a cap an idle one (the oldest of the address holding the most) is closed to make
/// room, and only when every one is busy is a new one refused (and counted). A Prometheus
/// scrape needs one.
pub const METRICS_LIMITS: baleen_edge::gate::Limits =
    baleen_edge::gate::Limits { total: 128, per_peer: 32 };
/// What the probe port admits: the kubelet's exec probes, from inside the agent's container.
pub const PROBE_LIMITS: baleen_edge::gate::Limits =
    baleen_edge::gate::Limits { total: 8, per_peer: 8 };
/// How long a client has to send a request's headers (at the start and between keep-alive
/// requests) before its connection is closed.
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(5);
/// How long one connection may live, whatever it does.
pub const CONNECTION_LIFETIME: Duration = Duration::from_secs(300);
/// The most bytes buffered per connection (a request's headers included).
pub const MAX_BUFFER: usize = 16 * 1024;

/// The bounds of every connection to the agent's ports.
const BOUNDS: baleen_edge::http::Bounds = baleen_edge::http::Bounds {
    header_timeout: HEADER_READ_TIMEOUT,
    lifetime: Some(CONNECTION_LIFETIME),
    max_buffer: MAX_BUFFER,
};

/// Where the agent's endpoints were bound.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bound {
    /// `/metrics`, `/healthz`, `/readyz`.
    pub metrics: SocketAddr,
    /// `/healthz` and `/readyz` alone, for the exec probes.
    pub probes: SocketAddr,
}

/// Binds `config`'s two addresses now (readiness by binding, not by sleeping); where they were
/// bound and the server, which serves until `shutdown`. The metrics port is unauthenticated and
/// open to the pod network, so its connections are admitted by [`METRICS_LIMITS`] (refusals
/// counted in `baleen_metrics_connections_refused_total`), their headers within
/// [`HEADER_READ_TIMEOUT`], [`MAX_BUFFER`] bytes buffered, [`CONNECTION_LIFETIME`] each. The
/// probe port, on the loopback address by default, serves only `/healthz` and `/readyz`, so a
/// flood of the metrics port never starves the kubelet's probes.
pub async fn bind(
    config: &MetricsConfig,
    endpoint: Arc<Endpoint>,
    shutdown: CancellationToken,
) -> Result<(Bound, impl Future<Output = Result<(), MetricsError>> + use<>), MetricsError> {
    let refused = endpoint.metrics.connections_refused.clone();
    let probes =
        Router::new().route("/healthz", get(|| async { "ok\n" })).route("/readyz", get(readyz));
    let app = probes.clone().route("/metrics", get(scrape));
    serve_bounded(
        config,
        app.with_state(endpoint.clone()),
        probes.with_state(endpoint),
        refused,
        shutdown,
    )
    .await
}

/// What the agent is waiting for before it serves, shown by the start-up endpoint.
pub type StartPhase = Arc<std::sync::Mutex<String>>;

/// The endpoint of the agent's first seconds, on the metrics and probe addresses until the full
/// one replaces it: `/healthz` answers (the agent is alive, so a liveness probe does not kill it
/// while it waits for the kubelet or the lock), `/readyz` 503 with what it waits for, `/metrics`
/// `baleen_agent_starting 1` (node-labelled like every family).
pub async fn bind_starting(
    config: &MetricsConfig,
    node: String,
    phase: StartPhase,
    shutdown: CancellationToken,
) -> Result<(Bound, impl Future<Output = Result<(), MetricsError>> + use<>), MetricsError> {
    let refused = IntCounter::new("baleen_metrics_connections_refused_total", "-")
        .map_err(MetricsError::Register)?;
    let text = format!(
        "# HELP baleen_agent_starting 1 while the agent starts (before it serves its resources).\n\
         # TYPE baleen_agent_starting gauge\nbaleen_agent_starting{{node=\"{}\"}} 1\n",
        node.replace('\\', "\\\\").replace('"', "\\\"")
    );
    let probes = Router::new().route("/healthz", get(|| async { "ok (starting)\n" })).route(
        "/readyz",
        get(move || {
            let phase = phase.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone();
            async move { (StatusCode::SERVICE_UNAVAILABLE, format!("starting: {phase}\n")) }
        }),
    );
    let app = probes.clone().route(
        "/metrics",
        get(move || {
            let text = text.clone();
            async move { ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text) }
        }),
    );
    serve_bounded(config, app, probes, refused, shutdown).await
}

/// Binds `config`'s addresses and serves `app` on the metrics one and `probes` on the probe
/// one until `shutdown`, within the bounds of [`bind`].
async fn serve_bounded(
    config: &MetricsConfig,
    app: Router,
    probes: Router,
    refused: IntCounter,
    shutdown: CancellationToken,
) -> Result<(Bound, impl Future<Output = Result<(), MetricsError>> + use<>), MetricsError> {
    let bind = |address: SocketAddr| move |source| MetricsError::Bind { address, source };
    let gate = baleen_edge::gate::Gate::counting("metrics", METRICS_LIMITS, refused);
    let (metrics, serve_metrics) =
        baleen_edge::http::bind(config.address, app, gate, BOUNDS, shutdown.clone())
            .await
            .map_err(bind(config.address))?;
    let gate = baleen_edge::gate::Gate::new("probes", PROBE_LIMITS);
    let (probes, serve_probes) =
        baleen_edge::http::bind(config.probe_address, probes, gate, BOUNDS, shutdown)
            .await
            .map_err(bind(config.probe_address))?;
    let serve = async move {
        tokio::join!(serve_metrics, serve_probes);
        Ok(())
    };
    Ok((Bound { metrics, probes }, serve))
}

/// A scrape shares the text of a render that started at most this long before it: a flood of
/// scrapes (the port is unauthenticated) costs at most ten renders a second and leaves the CPU
/// to Allocate. Prometheus scrapes a target every few seconds, so what it reads is never more
/// than this much older than its scrape.
pub const MIN_RENDER_INTERVAL: Duration = Duration::from_millis(100);

async fn scrape(State(endpoint): State<Arc<Endpoint>>) -> impl IntoResponse {
    // A flood waits for its turn (see Pacer).
    let wait = endpoint.pacer.turn();
    if !wait.is_zero() {
        tokio::time::sleep(wait).await;
    }
    // One render at a time; scrapes that arrive while one waits share the text rendered after
    // they arrived, or at most MIN_RENDER_INTERVAL before: many scrapers at once cost one
    // render, not one each.
    let arrived = Instant::now();
    let mut last = endpoint.last_render.lock().await;
    let fresh = |started: Instant| {
        started >= arrived || arrived.duration_since(started) < MIN_RENDER_INTERVAL
    };
    let text = match &*last {
        Some((started, text)) if fresh(*started) => text.clone(),
        _ => {
            let started = Instant::now();
            // Off the runtime's workers and below them: a render never delays the gRPC
            // answers they serve (see Renderer).
            let rendering = endpoint.clone();
            let text = match endpoint.renderer.run(move || render_now(&rendering)).await {
                Some(text) => axum::body::Bytes::from(text),
                None => {
                    tracing::error!("the metrics render failed: its thread is gone");
                    return (
                        http::StatusCode::INTERNAL_SERVER_ERROR,
                        "the metrics render failed\n",
                    )
                        .into_response();
                }
            };
            *last = Some((started, text.clone()));
            text
        }
    };
    drop(last);
    // Shared, not copied: one render's bytes serve every scrape that shares it.
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], text).into_response()
}

fn render_now(endpoint: &Endpoint) -> String {
    for (resource, state) in &endpoint.plugins {
        let registrations = match *state.borrow() {
            PluginState::Registered { registrations } => registrations,
            _ => 0,
        };
        let counter = endpoint.instruments.registrations.with_label_values(&[resource.as_str()]);
        counter.inc_by(registrations.saturating_sub(counter.get()));
    }
    endpoint.metrics.render()
}

async fn readyz(State(endpoint): State<Arc<Endpoint>>) -> impl IntoResponse {
    match endpoint.ready() {
        Ok(()) => (StatusCode::OK, "ready\n".to_owned()),
        Err(why) => (StatusCode::SERVICE_UNAVAILABLE, format!("{why}\n")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn renders_run_on_their_own_thread_at_the_idle_class() {
        let renderer = Renderer::start().expect("the render thread starts");
        let caller = std::thread::current().id();
        // The kernel's word, not the crate's: field 41 of /proc/thread-self/stat is the policy
        // (SCHED_IDLE is 5), read on the thread that renders.
        let (thread, policy) = renderer
            .run(|| {
                let stat = std::fs::read_to_string("/proc/thread-self/stat").expect("stat");
                let after_name = stat.rsplit_once(')').expect("a comm field").1;
                let policy: u32 = after_name
                    .split_whitespace()
                    .nth(41 - 3)
                    .and_then(|p| p.parse().ok())
                    .expect("a policy field");
                (std::thread::current().id(), policy)
            })
            .await
            .expect("the job ran");
        assert_ne!(thread, caller);
        assert_eq!(policy, 5, "SCHED_IDLE");
        assert_eq!(renderer.idle(), Some(Ok(())));
        // One thread for every job, in turn.
        let again = renderer.run(|| std::thread::current().id()).await.expect("the job ran");
        assert_eq!(again, thread);
    }

    #[test]
    fn a_flood_of_scrapes_is_paced_after_its_burst() {
        let pacer = Pacer::default();
        let waits: Vec<Duration> = (0..40).map(|_| pacer.turn()).collect();
        let period = Duration::from_secs(1) / MAX_SCRAPES_PER_SECOND;
        assert!(waits[..=SCRAPE_BURST as usize].iter().all(|w| w.is_zero()), "{waits:?}");
        // Each later one a period after the one before (give or take the time the loop took).
        let last = waits[39];
        let expected = period * (39 - SCRAPE_BURST);
        assert!(last <= expected && last + period >= expected, "{last:?} vs {expected:?}");
        assert!(waits.windows(2).all(|w| w[1] >= w[0]), "{waits:?}");
    }
}
