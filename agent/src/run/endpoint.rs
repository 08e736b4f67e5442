//! The metrics endpoint and the telemetry reader it shows (where `metrics.enabled`): the
//! families (`crate::metrics`) over the readers' published state, never the writer's lock.

use std::sync::Arc;

use baleen_device_plugin::PluginState;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::{AgentConfig, AgentError, Dependencies, Tasks};
use crate::instruments::Instruments;
use crate::inventory::CallFailures;
use crate::isolation::watchdog::Published;
use crate::metrics::{Endpoint, Metrics, MetricsError, Renderer, StateSources, TelemetryRead};
use crate::resources::NodeResources;

/// What the endpoint reads.
pub struct Readers<'a> {
    /// The ledger.
    pub resources: &'a Arc<NodeResources>,
    /// Each resource's plugin state.
    pub plugins: &'a [(String, watch::Receiver<PluginState>)],
    /// The memory watchdog's published state.
    pub watchdog: &'a Published,
    /// NVML call failures so far.
    pub calls: &'a Arc<CallFailures>,
}

/// Starts the telemetry reader and the endpoint when `instruments` are given (the metrics are
/// on), its families in `registry`; the address it listens on.
pub async fn start(
    tasks: &mut Tasks,
    config: &AgentConfig,
    deps: &Dependencies,
    registry: &prometheus::Registry,
    instruments: Option<Arc<Instruments>>,
    readers: Readers<'_>,
    shutdown: &CancellationToken,
) -> Result<Option<crate::metrics::Bound>, AgentError> {
    let Some(instruments) = instruments else { return Ok(None) };
    let (publish, telemetry) = watch::channel(TelemetryRead::default());
    let sources = StateSources {
        resources: readers.resources.clone(),
        watchdog: readers.watchdog.clone(),
        calls: readers.calls.clone(),
        telemetry,
        mps_enforced: config.mps.enabled,
    };
    let metrics = Metrics::new(registry.clone(), sources)?;
    let reader = crate::metrics::read_telemetry(
        deps.inventory.clone(),
        config.metrics.interval,
        publish,
        metrics.telemetry_failures.clone(),
        readers.calls.clone(),
        shutdown.clone(),
    );
    tasks.spawn("telemetry reader", async move {
        reader.await;
        Ok(())
    });
    let endpoint = Arc::new(Endpoint {
        metrics,
        resources: readers.resources.clone(),
        plugins: readers.plugins.to_vec(),
        instruments,
        mps_enforced: config.mps.enabled,
        last_render: tokio::sync::Mutex::new(None),
        pacer: Default::default(),
        renderer: Renderer::start().map_err(MetricsError::RenderThread)?,
    });
    let (bound, serve) = crate::metrics::bind(&config.metrics, endpoint, shutdown.clone()).await?;
    tracing::info!(
        address = %bound.metrics,
        probes = %bound.probes,
        "serving /metrics, /healthz and /readyz, and the probes alone"
    );
    tasks.spawn("metrics endpoint", async move { Ok(serve.await?) });
    Ok(Some(bound))
}
