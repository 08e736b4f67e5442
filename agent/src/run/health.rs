//! GPU health, per GPU: healthy -> unhealthy (a critical XID, or every GPU when the health watch
//! itself fails: a GPU fallen off the bus cannot say which) -> probing -> healthy again. It
//! follows NVML's XID events on a thread of its own (NVML's wait blocks). A GPU marked unhealthy
//! is re-probed every `health.probeInterval` (`GpuInventory::probe`: found by its UUID, its
//! memory read), each probe on a thread of its own and bounded by the interval (a probe that
//! hangs counts as failed, and no second one starts meanwhile); after `health.recoveryProbes`
//! good probes in a row it is healthy again. A critical XID during probing starts the count
//! again. Every transition is logged, counted (`baleen_gpu_health_transitions_total`) and, where
//! the API is reachable, an Event on the node (`GpuUnhealthy`, a Warning, and `GpuHealthy`).
//! MPS daemons that stop answering are the MPS supervisor's (their GPU's units withdrawn until
//! the daemon answers); a GPU whose shares MPS enforces is probed good only while its daemon
//! answers too and, with `health.mpsClientProbe`, a tiny CUDA client through the daemon is
//! bound by its memory limit ([`client_probe`]).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::mpsc::{self, TryRecvError};
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use super::events::EventQueue;
use crate::error_chain::Chain;
use crate::inventory::{CallFailures, GpuInventory, GpuUuid, InventoryError};
use crate::isolation::mps::MpsConfig;
use crate::isolation::mps::client_probe::{self, ClientProbe};
use crate::isolation::watchdog::{Notice, Regarding};
use crate::resources::NodeResources;
use crate::retry::{Backoff, Outage, sleep_or_stop_on_thread};

/// The longest wait between two tries to start the health watch.
const START_RETRY_MAX: Duration = Duration::from_secs(30);

/// How GPUs marked unhealthy are given back (`health:` in the file).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HealthConfig {
    /// Time between two probes of an unhealthy GPU.
    pub probe_interval: Duration,
    /// Good probes in a row that make it healthy again.
    pub recovery_probes: u32,
    /// The MPS client that ends a probe where MPS serves the GPU's shares (see
    /// [`crate::isolation::mps::client_probe`]); `None`: the daemon's answer is enough (the
    /// default here; the configuration turns it on with NVML).
    pub mps_client: Option<ClientProbe>,
}

impl Default for HealthConfig {
    fn default() -> Self {
        Self {
            probe_interval: crate::defaults::HEALTH_PROBE_INTERVAL,
            recovery_probes: crate::defaults::HEALTH_RECOVERY_PROBES,
            mps_client: None,
        }
    }
}

/// Starts the health thread, with its transitions as Events on the node where the API is
/// reachable (their sender stops at `shutdown`); the thread stops at `stop`, a token of its own
/// (see `Agent::wait`).
pub fn start(
    tasks: &mut super::Tasks,
    config: &super::AgentConfig,
    deps: &super::Dependencies,
    resources: &Arc<NodeResources>,
    calls: Arc<CallFailures>,
    (shutdown, stop): (&CancellationToken, &CancellationToken),
) -> Option<std::thread::JoinHandle<()>> {
    let events = deps.node_api.clone().map(|api| {
        super::events::start(
            tasks,
            "GPU health events",
            config.node_name.clone(),
            api,
            crate::defaults::WATCHDOG_EVENT_QUEUE,
            shutdown,
        )
    });
    spawn(
        deps.inventory.clone(),
        resources.clone(),
        (calls, events),
        config.health.clone(),
        config.mps.clone(),
        stop.clone(),
    )
}

/// Follows XID events and re-probes unhealthy GPUs on a thread of its own (NVML's wait blocks).
/// While the watch cannot be started, every GPU is advertised Unhealthy (nothing would tell the
/// agent that one failed) and the start is retried with backoff; once it starts, the GPUs are
/// healthy again.
/// `report`: where NVML call failures are counted, and where transitions go as Events.
pub fn spawn(
    inventory: Arc<dyn GpuInventory>,
    resources: Arc<NodeResources>,
    report: (Arc<CallFailures>, Option<EventQueue>),
    config: HealthConfig,
    mps: MpsConfig,
    stop: CancellationToken,
) -> Option<std::thread::JoinHandle<()>> {
    let on_thread = resources.clone();
    let (calls, events) = report;
    let spawned = std::thread::Builder::new()
        .name("baleen-health".into())
        .spawn(move || watch(&inventory, &on_thread, (&calls, events), (config, mps), &stop));
    match spawned {
        Ok(handle) => Some(handle),
        Err(e) => {
            tracing::error!(error = %Chain(&e), "cannot start the health thread; every GPU marked unhealthy");
            resources.set_all_health(false, "health thread not running");
            None
        }
    }
}

/// One unhealthy GPU's way back.
struct Recovery {
    reason: String,
    good: u32,
    next: Instant,
    /// A probe under way, and when it started.
    probing: Option<(mpsc::Receiver<Result<(), InventoryError>>, Instant)>,
    hang_logged: bool,
}

/// The GPUs being probed back to health.
struct Recoveries<'a> {
    inventory: &'a Arc<dyn GpuInventory>,
    resources: &'a NodeResources,
    calls: &'a CallFailures,
    events: Option<EventQueue>,
    config: HealthConfig,
    /// Where the GPUs' MPS daemons are (the client probe's pipe directories).
    mps: MpsConfig,
    gpus: BTreeMap<String, Recovery>,
}

impl Recoveries<'_> {
    /// Sends the Event of a transition, where the API is reachable.
    fn announce(&self, reason: &'static str, note: String, warning: bool) {
        if let Some(events) = &self.events {
            let action = if warning { "MarkedUnhealthy" } else { "MarkedHealthy" };
            events.send(Notice { regarding: Regarding::Node, reason, action, note, warning });
        }
    }

    /// `uuid` is unhealthy for `reason`: probed from now on (its count of good probes from 0).
    fn mark(&mut self, uuid: &str, reason: &str) {
        if self.resources.set_health(uuid, false, reason) {
            count(self.resources, uuid, "unhealthy");
            self.announce(
                "GpuUnhealthy",
                format!(
                    "GPU {uuid} marked Unhealthy ({reason}): its devices are withdrawn; it is probed every {} s and healthy again after {} good probes in a row",
                    self.config.probe_interval.as_secs_f64(),
                    self.config.recovery_probes
                ),
                true,
            );
        }
        let next = Instant::now() + self.config.probe_interval;
        let r = self.gpus.entry(uuid.to_owned()).or_insert_with(|| Recovery {
            reason: reason.to_owned(),
            good: 0,
            next,
            probing: None,
            hang_logged: false,
        });
        r.good = 0;
        r.next = next;
        r.reason = reason.to_owned();
    }

    /// Starts the probes that are due, collects the ones that answered; a GPU with enough good
    /// probes in a row is healthy again.
    fn step(&mut self) {
        let now = Instant::now();
        let mut healthy = Vec::new();
        for (uuid, r) in &mut self.gpus {
            if let Some((answer, started)) = &r.probing {
                let outcome = match answer.try_recv() {
                    Ok(outcome) => Some(outcome),
                    Err(TryRecvError::Disconnected) => Some(Err(InventoryError::Unavailable {
                        reason: "probe thread ended".into(),
                    })),
                    Err(TryRecvError::Empty) => {
                        if now.duration_since(*started) > self.config.probe_interval
                            && !r.hang_logged
                        {
                            tracing::warn!(
                                gpu.uuid = uuid,
                                "a probe of the unhealthy GPU hangs; it stays unhealthy"
                            );
                            r.hang_logged = true;
                            r.good = 0;
                        }
                        None
                    }
                };
                let Some(outcome) = outcome else { continue };
                r.probing = None;
                r.hang_logged = false;
                r.next = now + self.config.probe_interval;
                // Where MPS serves the GPU's shares, its daemon must answer too (the MPS
                // supervisor's probe of it: `shares_enforced`).
                let outcome = outcome.and_then(|()| mps_answers(self.resources, uuid));
                match outcome {
                    Ok(()) => {
                        r.good += 1;
                        tracing::info!(
                            gpu.uuid = uuid,
                            good = r.good,
                            of = self.config.recovery_probes,
                            reason = r.reason,
                            "unhealthy GPU answered a probe"
                        );
                        if r.good >= self.config.recovery_probes {
                            healthy.push(uuid.clone());
                        }
                    }
                    Err(e) => {
                        self.calls.record(&e);
                        if r.good > 0 {
                            tracing::warn!(gpu.uuid = uuid, error = %Chain(&e), "unhealthy GPU failed a probe; counting again");
                        }
                        r.good = 0;
                    }
                }
            } else if now >= r.next {
                let (tx, rx) = mpsc::channel();
                let (inventory, gpu) = (self.inventory.clone(), uuid.clone());
                let client = client_for(&self.config, self.resources, &self.mps, uuid);
                let spawned =
                    std::thread::Builder::new().name("baleen-probe".into()).spawn(move || {
                        let outcome = GpuUuid::new(&gpu)
                            .map_err(|e| InventoryError::Unavailable { reason: e.to_string() })
                            .and_then(|g| inventory.probe(&g))
                            .and_then(|()| match &client {
                                Some((probe, pipe)) => client_probe::run(probe, &gpu, pipe)
                                    .map_err(|reason| InventoryError::Unavailable { reason }),
                                None => Ok(()),
                            });
                        let _ = tx.send(outcome);
                    });
                match spawned {
                    Ok(_) => r.probing = Some((rx, now)),
                    Err(e) => {
                        tracing::warn!(error = %Chain(&e), "cannot start a GPU probe");
                        r.next = now + self.config.probe_interval;
                    }
                }
            }
        }
        for uuid in healthy {
            let was = self.gpus.remove(&uuid).map(|r| {
                tracing::warn!(
                    gpu.uuid = uuid,
                    probes = r.good,
                    was = r.reason,
                    "GPU healthy again: it answered every probe"
                );
                (r.good, r.reason)
            });
            if self.resources.set_health(&uuid, true, "") {
                count(self.resources, &uuid, "healthy");
                let (probes, reason) = was.unwrap_or_default();
                self.announce(
                    "GpuHealthy",
                    format!("GPU {uuid} healthy again after {probes} good probes in a row (was: {reason}); its devices are offered again"),
                    false,
                );
            }
        }
    }
}

/// Whether the MPS daemon of `uuid` answers, where MPS enforces its shares (the MPS
/// supervisor's last probe of it); a GPU without shares, or with MPS off, needs none.
fn mps_answers(resources: &NodeResources, uuid: &str) -> Result<(), InventoryError> {
    if !resources.mps_enforced() {
        return Ok(());
    }
    let (gpus, _) = resources.snapshot();
    match gpus.iter().find(|g| g.uuid == uuid) {
        Some(g) if g.units > 0 && !g.shares_enforced => Err(InventoryError::Unavailable {
            reason: format!("the MPS daemon of GPU {uuid} does not answer"),
        }),
        _ => Ok(()),
    }
}

/// The MPS client probe of `uuid`'s next probe and its daemon's pipe directory: where the
/// probe is on, MPS serves the GPU's shares, its daemon answers and runs no server (a
/// server means clients are served; a probe as another user would wait behind them).
fn client_for(
    config: &HealthConfig,
    resources: &NodeResources,
    mps: &MpsConfig,
    uuid: &str,
) -> Option<(ClientProbe, std::path::PathBuf)> {
    let probe = config.mps_client.clone()?;
    if !resources.mps_enforced() {
        return None;
    }
    // One published state for both questions.
    let published = resources.published();
    let gpus = published.state.gpu_states();
    let gpu = gpus.iter().find(|g| g.uuid == uuid)?;
    let serving = published.mps_servers.get(uuid).is_some_and(|s| !s.is_empty());
    (gpu.units > 0 && gpu.shares_enforced && !serving).then(|| (probe, mps.pipe_dir(uuid)))
}

/// Counts a transition of `uuid` to `to`, where the metrics are on.
fn count(resources: &NodeResources, uuid: &str, to: &str) {
    if let Some(i) = resources.instruments() {
        i.gpu_health_transitions.with_label_values(&[uuid, to]).inc();
    }
}

fn watch(
    inventory: &Arc<dyn GpuInventory>,
    resources: &NodeResources,
    (calls, events): (&CallFailures, Option<EventQueue>),
    (config, mps): (HealthConfig, MpsConfig),
    stop: &CancellationToken,
) {
    let mut retry = Backoff::new((Duration::from_secs(1), START_RETRY_MAX));
    let mut watcher = loop {
        match inventory.health_watcher() {
            Ok(w) => break w,
            Err(e) => {
                calls.record(&e);
                if retry.is_fresh() {
                    tracing::error!(error = %Chain(&e), "cannot watch GPU health; every GPU marked unhealthy until the watch starts");
                    resources.set_all_health(false, "health watch cannot start");
                }
                if !sleep_or_stop_on_thread(retry.next_wait(), stop) {
                    return;
                }
            }
        }
    };
    if !retry.is_fresh() {
        tracing::warn!("GPU health watch started; GPUs healthy again");
        resources.set_all_health(true, "");
    }
    for gpu in watcher.unwatched() {
        tracing::warn!(gpu.uuid = %gpu, "GPU cannot report health events");
    }
    let mut recoveries =
        Recoveries { inventory, resources, calls, events, config, mps, gpus: BTreeMap::new() };
    let mut outage = Outage::default();
    while !stop.is_cancelled() {
        let event = watcher.next_event(Duration::from_millis(500));
        if event.is_ok() && outage.succeeded() {
            tracing::warn!("GPU health watch answers again; every GPU is probed back to health");
        }
        match event {
            Ok(Some(event)) if event.critical => {
                tracing::error!(gpu.uuid = %event.gpu, xid = event.xid, "critical XID: GPU marked unhealthy and probed until it answers");
                recoveries.mark(event.gpu.as_str(), &format!("critical XID {}", event.xid));
            }
            Ok(Some(event)) => {
                tracing::warn!(gpu.uuid = %event.gpu, xid = event.xid, "application XID; GPU stays healthy");
            }
            Ok(None) => {}
            Err(e) => {
                calls.record(&e);
                // A failed wait usually means a GPU fell off the bus, and the event cannot even
                // say which: like NVIDIA's device plugin, mark every GPU unhealthy and keep
                // watching (once per second while the errors last); each is probed back.
                if outage.failed() {
                    tracing::error!(error = %Chain(&e), "GPU health watch failed; every GPU marked unhealthy");
                }
                let (gpus, _) = resources.snapshot();
                for g in gpus {
                    recoveries.mark(&g.uuid, "health watch failed");
                }
                std::thread::park_timeout(Duration::from_secs(1));
            }
        }
        recoveries.step();
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU32, Ordering};

    use baleen_device_plugin::{DeviceBackend as _, Health};

    use super::*;
    use crate::checkpoint::Checkpoint;
    use crate::inventory::simulated::{SimulatedInventory, TopologyError};
    use crate::inventory::{HealthWatcher, Inventory, InventoryError};
    use crate::ledger::{DeviceLedger, ViewConfig};
    use crate::resources::test_support;

    /// A simulated node whose health watch fails to start the first `fails` times.
    struct Flaky {
        inner: SimulatedInventory,
        fails: AtomicU32,
    }

    impl GpuInventory for Flaky {
        fn discover(&self) -> Result<Inventory, InventoryError> {
            self.inner.discover()
        }

        fn health_watcher(&self) -> Result<Box<dyn HealthWatcher + '_>, InventoryError> {
            if self.fails.fetch_sub(1, Ordering::SeqCst) > 0 {
                return Err(TopologyError::Read {
                    path: "flaky".into(),
                    source: std::io::Error::other("not yet"),
                }
                .into());
            }
            self.inner.health_watcher()
        }

        fn processes(&self) -> Result<Vec<crate::inventory::GpuProcess>, InventoryError> {
            self.inner.processes()
        }

        fn telemetry(&self) -> Result<Vec<crate::inventory::GpuTelemetry>, InventoryError> {
            self.inner.telemetry()
        }
    }

    #[test]
    fn gpus_are_unhealthy_while_the_watch_cannot_start_and_healthy_once_it_does() {
        let inventory = test_support::l4_inventory();
        let inner = SimulatedInventory::new(inventory.clone());
        let ledger = DeviceLedger::new("n", &inventory, ViewConfig::default()).expect("ledger");
        let dir = tempfile::tempdir().expect("tempdir");
        let resources = test_support::resources(ledger, Checkpoint::in_dir(dir.path()));
        let gpu_view =
            resources.backends().into_iter().find(|b| b.resource_name().ends_with("/gpu"));
        let devices = gpu_view.expect("gpu view").devices();
        let healthy =
            || devices.borrow().devices().iter().filter(|d| d.health == Health::Healthy).count();
        let flaky = Arc::new(Flaky { inner, fails: AtomicU32::new(1) });
        let stop = CancellationToken::new();
        let (inventory, on_thread, thread_stop) = (flaky.clone(), resources.clone(), stop.clone());
        let calls = Arc::new(CallFailures::default());
        let on_calls = calls.clone();
        let thread = std::thread::spawn(move || {
            let inventory: Arc<dyn GpuInventory> = inventory;
            watch(
                &inventory,
                &on_thread,
                (&on_calls, None),
                (HealthConfig::default(), MpsConfig::default()),
                &thread_stop,
            );
        });
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        let mut saw_unhealthy = false;
        while std::time::Instant::now() < deadline {
            saw_unhealthy |= healthy() == 0;
            if saw_unhealthy && healthy() == 4 {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        stop.cancel();
        thread.join().expect("health thread");
        assert!(saw_unhealthy, "every GPU unhealthy while the watch could not start");
        assert_eq!(healthy(), 4, "healthy again once it started");
        assert!(calls.counts().is_empty(), "a topology error is no NVML call failure");
    }
}
