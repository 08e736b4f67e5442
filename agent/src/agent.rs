//! The running agent: discovers the GPUs, restores the ledger (checkpoint, then the kubelet's
//! pod-resources lists), serves every resource view through the device-plugin library,
//! reconciles periodically and follows GPU health, until shut down.
//!
//! `main` builds the real inventory and calls [`run`]; tests call [`Agent::start`] with a
//! simulated or fake-NVML inventory, inspect the [`Ledger`], and either [`Agent::wait`] after
//! cancelling the token (a clean stop) or drop the agent (a crash: tasks aborted, nothing
//! flushed beyond what every change already wrote).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use baleen_device_plugin::{Plugin, PluginConfig, PluginError, PluginState};
use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::checkpoint::{Checkpoint, CheckpointError, read_boot_id};
use crate::inventory::{GpuInventory, InventoryError};
use crate::node::{NodeError, NodeState, ViewConfig};
use crate::reconcile;
use crate::resources::Ledger;

/// How the agent runs on this node (see [`crate::config`] for where the values come from).
#[derive(Debug, Clone)]
pub struct AgentConfig {
    /// The Kubernetes node name.
    pub node_name: String,
    /// The kubelet's device-plugin directory.
    pub device_plugin_dir: PathBuf,
    /// The kubelet's pod-resources socket.
    pub pod_resources_socket: PathBuf,
    /// Where the checkpoint lives.
    pub state_dir: PathBuf,
    /// The kernel boot ID file.
    pub boot_id_file: PathBuf,
    /// Resource names, unit size and views.
    pub views: ViewConfig,
    /// Time between reconciliations with pod-resources.
    pub reconcile_interval: Duration,
    /// How long an allocation the kubelet's pod-resources list has never shown is kept (an
    /// ordinary init container's, or one the kubelet has not recorded yet); allocations it
    /// listed are released as soon as they leave the list.
    pub reconcile_grace: Duration,
}

/// Why the agent cannot start or stopped.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// The boot ID cannot be read.
    #[error("cannot read the boot ID from {}", path.display())]
    BootId {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// GPU discovery failed.
    #[error(transparent)]
    Inventory(#[from] InventoryError),
    /// The inventory cannot be made into a ledger.
    #[error(transparent)]
    Node(#[from] NodeError),
    /// The checkpoint cannot be written.
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    /// A device plugin failed.
    #[error("device plugin for {resource} failed")]
    Plugin {
        /// The resource.
        resource: String,
        /// The cause.
        #[source]
        source: PluginError,
    },
    /// A task of the agent panicked or was aborted.
    #[error("agent task failed: {0}")]
    Task(String),
}

/// A started agent.
pub struct Agent {
    shutdown: CancellationToken,
    ledger: Arc<Ledger>,
    plugins: Vec<(String, watch::Receiver<PluginState>)>,
    tasks: JoinSet<Result<(), AgentError>>,
    health_stop: CancellationToken,
}

impl Agent {
    /// Discovers, restores and starts serving. Returns once every plugin task is spawned (each
    /// then binds, registers and retries on its own).
    pub async fn start(
        config: AgentConfig,
        inventory: Arc<dyn GpuInventory>,
        shutdown: CancellationToken,
    ) -> Result<Self, AgentError> {
        let boot_id = read_boot_id(&config.boot_id_file)
            .map_err(|source| AgentError::BootId { path: config.boot_id_file.clone(), source })?;
        let discovered = {
            let inventory = inventory.clone();
            tokio::task::spawn_blocking(move || inventory.discover())
                .await
                .map_err(|e| AgentError::Task(e.to_string()))??
        };
        tracing::info!(
            node = config.node_name,
            gpus = discovered.gpus.len(),
            driver = discovered.driver_version.as_deref().unwrap_or("unknown"),
            "GPUs discovered"
        );
        let mut state = NodeState::new(&config.node_name, &discovered, config.views.clone())?;
        let checkpoint = Checkpoint::in_dir(&config.state_dir);
        let trusted = match checkpoint.load(&config.node_name, &boot_id) {
            Ok(Some(contents)) => {
                let refused = state.restore(&contents.allocations);
                for (record, why) in &refused {
                    tracing::warn!(resource = record.resource, devices = ?record.device_ids, why, "checkpointed allocation not restored");
                }
                tracing::info!(
                    allocations = contents.allocations.len() - refused.len(),
                    checkpoint = %checkpoint.path().display(),
                    "ledger restored from the checkpoint"
                );
                true
            }
            Ok(None) => {
                tracing::info!(checkpoint = %checkpoint.path().display(), "no checkpoint");
                false
            }
            Err(e) => {
                tracing::warn!(error = %e, "checkpoint not trusted; rebuilding the ledger from pod-resources");
                false
            }
        };
        let ledger = Ledger::new(
            state,
            checkpoint,
            config.node_name.clone(),
            boot_id,
            Some(config.pod_resources_socket.clone()),
        );
        let grace = config.reconcile_grace.as_secs();
        // Without a trusted checkpoint the ledger knows nothing of the containers running on the
        // node (after a reboot the kubelet restarts them without calling Allocate): serving now
        // could hand their GPUs out again through another view. Wait for pod-resources first.
        let mut waiting_logged = false;
        loop {
            match reconcile_once(
                &ledger,
                &config.pod_resources_socket,
                Duration::from_secs(2),
                grace,
            )
            .await
            {
                Ok(()) => break,
                Err(ReconcileFailure::NotSaved(e)) => return Err(AgentError::Task(e)),
                Err(ReconcileFailure::Unreachable(e)) if trusted => {
                    tracing::warn!(error = %e, "cannot reconcile with the kubelet yet; serving from the checkpoint and retrying");
                    break;
                }
                Err(ReconcileFailure::Unreachable(e)) => {
                    if !waiting_logged {
                        tracing::warn!(
                            error = %e,
                            "waiting for the kubelet's pod-resources API before serving: without a trusted checkpoint it is the only record of running containers"
                        );
                        waiting_logged = true;
                    }
                    tokio::select! {
                        () = shutdown.cancelled() => break,
                        () = tokio::time::sleep(Duration::from_secs(1)) => {}
                    }
                }
            }
        }
        ledger.persist()?;

        let mut tasks = JoinSet::new();
        let mut plugins = Vec::new();
        for backend in ledger.backends() {
            let resource =
                baleen_device_plugin::DeviceBackend::resource_name(backend.as_ref()).to_owned();
            let plugin =
                Plugin::new(backend, PluginConfig::new(&config.device_plugin_dir, &resource));
            plugins.push((resource.clone(), plugin.state()));
            let token = shutdown.clone();
            tasks.spawn(async move {
                plugin.run(token).await.map_err(|source| AgentError::Plugin { resource, source })
            });
        }
        {
            let ledger = ledger.clone();
            let shutdown = shutdown.clone();
            let socket = config.pod_resources_socket.clone();
            let interval = config.reconcile_interval;
            tasks.spawn(async move {
                reconcile_loop(ledger, socket, interval, grace, shutdown).await;
                Ok(())
            });
        }
        let health_stop = shutdown.child_token();
        spawn_health_thread(inventory, ledger.clone(), health_stop.clone());
        Ok(Self { shutdown, ledger, plugins, tasks, health_stop })
    }

    /// The node's ledger.
    pub fn ledger(&self) -> &Arc<Ledger> {
        &self.ledger
    }

    /// The resources served, with each plugin's state.
    pub fn plugins(&self) -> &[(String, watch::Receiver<PluginState>)] {
        &self.plugins
    }

    /// Waits until every task ends (after the shutdown token is cancelled, or after a task
    /// failed, which cancels it); the first error.
    pub async fn wait(mut self) -> Result<(), AgentError> {
        let mut result = Ok(());
        while let Some(joined) = self.tasks.join_next().await {
            let outcome = joined.map_err(|e| AgentError::Task(e.to_string())).and_then(|r| r);
            if let Err(e) = outcome {
                // A resource that cannot be served any more (its socket cannot be bound, say):
                // stop the whole agent so that it exits non-zero and the DaemonSet restarts it,
                // rather than serving part of the node in silence.
                tracing::error!(error = %e, "agent task failed; stopping the agent");
                self.shutdown.cancel();
                if result.is_ok() {
                    result = Err(e);
                }
            }
        }
        self.health_stop.cancel();
        result
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        // Dropping the JoinSet aborts the tasks; the health thread checks this token.
        self.health_stop.cancel();
    }
}

/// Runs the agent until `shutdown` is cancelled.
pub async fn run(
    config: AgentConfig,
    inventory: Arc<dyn GpuInventory>,
    shutdown: CancellationToken,
) -> Result<(), AgentError> {
    let agent = Agent::start(config, inventory, shutdown).await?;
    agent.wait().await
}

fn log_report(report: &reconcile::Report) {
    for r in &report.released {
        tracing::info!(resource = r.resource, devices = ?r.device_ids, "released: no container holds it any more");
    }
    for r in &report.restored {
        tracing::info!(resource = r.resource, devices = ?r.device_ids, "restored from pod-resources");
    }
    for (r, why) in &report.refused {
        tracing::error!(resource = r.resource, devices = ?r.device_ids, why, "the kubelet reports an allocation that conflicts with the ledger");
    }
}

async fn reconcile_loop(
    ledger: Arc<Ledger>,
    socket: PathBuf,
    interval: Duration,
    grace: u64,
    shutdown: CancellationToken,
) {
    let mut failing = false;
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = tokio::time::sleep(interval) => {}
        }
        match reconcile_once(&ledger, &socket, Duration::from_secs(5), grace).await {
            Ok(()) => {
                if failing {
                    tracing::info!(socket = %socket.display(), "pod-resources reachable again");
                    failing = false;
                }
            }
            Err(ReconcileFailure::NotSaved(e)) => {
                tracing::error!(error = %e, "reconciliation failed")
            }
            Err(ReconcileFailure::Unreachable(e)) if !failing => {
                tracing::warn!(error = %e, "cannot reconcile with the kubelet; allocations of ended pods stay held until it answers");
                failing = true;
            }
            Err(ReconcileFailure::Unreachable(e)) => {
                tracing::debug!(error = %e, "pod-resources still unreachable");
            }
        }
    }
}

/// Why one reconciliation did not happen.
enum ReconcileFailure {
    /// The kubelet's pod-resources API did not answer.
    Unreachable(reconcile::FetchError),
    /// The reconciled ledger could not be saved (or its task failed).
    NotSaved(String),
}

/// Reads the kubelet's allocations and brings the ledger in line, logging what changed. The
/// checkpoint write blocks (fsync), so the ledger change runs off the async worker threads.
async fn reconcile_once(
    ledger: &Arc<Ledger>,
    socket: &Path,
    timeout: Duration,
    grace: u64,
) -> Result<(), ReconcileFailure> {
    let truth = reconcile::fetch(socket, timeout).await.map_err(ReconcileFailure::Unreachable)?;
    let ledger = ledger.clone();
    let report = tokio::task::spawn_blocking(move || ledger.reconcile(&truth, grace))
        .await
        .map_err(|e| ReconcileFailure::NotSaved(format!("reconciliation task failed: {e}")))?
        .map_err(|e| ReconcileFailure::NotSaved(e.to_string()))?;
    log_report(&report);
    Ok(())
}

/// Follows XID events on a thread of its own (NVML's wait blocks); a critical XID marks the GPU
/// unhealthy, which advertises all its devices Unhealthy.
fn spawn_health_thread(
    inventory: Arc<dyn GpuInventory>,
    ledger: Arc<Ledger>,
    stop: CancellationToken,
) {
    let spawned = std::thread::Builder::new().name("baleen-health".into()).spawn(move || {
        let mut watcher = match inventory.health_watcher() {
            Ok(w) => w,
            Err(e) => {
                tracing::error!(error = %e, "cannot watch GPU health; GPUs stay as discovered");
                return;
            }
        };
        for gpu in watcher.unwatched() {
            tracing::warn!(gpu.uuid = %gpu, "GPU cannot report health events");
        }
        let mut failing = false;
        while !stop.is_cancelled() {
            let event = watcher.next_event(Duration::from_millis(500));
            if failing && event.is_ok() {
                tracing::warn!("GPU health watch answers again; GPUs stay unhealthy until the agent restarts");
                failing = false;
            }
            match event {
                Ok(Some(event)) if event.critical => {
                    tracing::error!(gpu.uuid = %event.gpu, xid = event.xid, "critical XID: GPU marked unhealthy");
                    ledger.set_health(event.gpu.as_str(), false);
                }
                Ok(Some(event)) => {
                    tracing::warn!(gpu.uuid = %event.gpu, xid = event.xid, "application XID; GPU stays healthy");
                }
                Ok(None) => {}
                Err(e) => {
                    // A failed wait usually means a GPU fell off the bus, and the event cannot
                    // even say which: like NVIDIA's device plugin, mark every GPU unhealthy and
                    // keep watching (once per second while the errors last).
                    if !failing {
                        tracing::error!(error = %e, "GPU health watch failed; every GPU marked unhealthy");
                        failing = true;
                    }
                    ledger.set_all_health(false);
                    std::thread::park_timeout(Duration::from_secs(1));
                    continue;
                }
            }
        }
    });
    if let Err(e) = spawned {
        tracing::error!(error = %e, "cannot start the health thread");
    }
}
