//! The running agent: discovers the GPUs, restores the device ledger (checkpoint, then the
//! kubelet's pod-resources lists), then runs one task per subsystem until shut down:
//!
//! | subsystem | started here | its logic | task |
//! |---|---|---|---|
//! | one agent per node: the state directory's lock | [`lock`] | (here) | before everything |
//! | start-up: boot ID, discovery, checkpoint, first reconciliation | [`startup`] | `inventory/`, `checkpoint.rs`, `resources.rs` | before the others |
//! | MPS: one supervised daemon per shared GPU, units offered while it answers | [`mps`] | `isolation/mps/` | one |
//! | one device plugin per resource view | [`plugins`] | the `baleen-device-plugin` crate, `resources.rs` | one each |
//! | reconciliation with pod-resources | [`reconciler`] | `reconcile.rs` | one |
//! | GPU health (NVML XID events), probes back to health | [`health`] | `inventory/`, `isolation/mps/client_probe.rs` | a thread (NVML's wait blocks) |
//! | the node's pods as the API says (co-location, the watchdog, confirming the kubelet's misses), namespaces' class labels | (in [`Agent::start`]) | `kube_api.rs`, `isolation/node_pods.rs` | one or two (watchers) |
//! | per-container GPU memory against the grant, processes of no grant | [`watchdog`] | `isolation/watchdog.rs` | two (watchdog, Events: [`events`]) |
//! | co-location: the pods' cgroup classes, MPS client priorities | [`colocation`] | `isolation/colocation.rs`, `isolation/cgroups.rs` | one (policy) |
//! | the node-state annotation for the extender | [`annotation`] | `ledger/node_state.rs` (the document) | one |
//! | the metrics endpoint and telemetry | [`endpoint`] | `metrics.rs`, `instruments.rs` | two |
//!
//! Every subsystem's settings are one section of the file (`config/sections/`); every wait
//! between tries and every sleep that a stop ends is `crate::retry`'s.
//!
//! A new subsystem is a module here and one line in [`Agent::start`].
//!
//! `main` (through `crate::bootstrap`) calls [`run`] with the real [`Dependencies`]; tests call
//! [`Agent::start`] with a simulated or fake-NVML inventory, inspect [`Agent::resources`], and
//! either [`Agent::wait`] after cancelling the token (a clean stop) or drop the agent (a crash:
//! tasks aborted, nothing flushed beyond what every change already wrote).

pub mod annotation;
pub mod colocation;
pub mod dra;
pub mod endpoint;
pub mod events;
pub mod health;
pub mod lock;
pub mod mps;
pub mod plugins;
pub mod reconciler;
pub mod startup;
pub mod watchdog;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use baleen_device_plugin::{PluginError, PluginState};
use tokio::sync::watch;
use tokio::task::{JoinError, JoinSet};
use tokio_util::sync::CancellationToken;

use crate::checkpoint::CheckpointError;
use crate::error_chain::Chain;
use crate::instruments::Instruments;
use crate::inventory::{GpuInventory, InventoryError};
use crate::isolation::devices::{DeviceListConfig, Strategy};
use crate::isolation::mps::MpsConfig;
use crate::isolation::node_pods::NodePods;
use crate::isolation::watchdog::{Over, Stray, WatchdogConfig};
use crate::ledger::{BuildError, ViewConfig};
use crate::metrics::{MetricsConfig, MetricsError};
use crate::resources::NodeResources;

/// How the agent runs on this node (see `crate::config` for where the values come from).
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
    /// How a container is given its GPUs in an Allocate answer (CDI names, volume-mounts or
    /// the variable).
    pub devices: DeviceListConfig,
    /// MPS: the daemons of the shared GPUs and what a gpu-memory container gets to reach them.
    pub mps: MpsConfig,
    /// The per-container GPU memory watchdog.
    pub watchdog: WatchdogConfig,
    /// How GPUs marked unhealthy are probed back to health.
    pub health: health::HealthConfig,
    /// The Prometheus endpoint.
    pub metrics: MetricsConfig,
    /// The node-state annotation for the scheduler extender.
    pub annotation: annotation::AnnotationConfig,
    /// Co-location classes (cgroups, MPS client priority).
    pub colocation: colocation::ColocationConfig,
    /// Time between reconciliations with pod-resources.
    pub reconcile_interval: Duration,
    /// How long a kubelet that (re)appeared (the agent's start, a registration, pod-resources
    /// answering again) may still be syncing its pods: until then, an allocation it listed
    /// before and no longer lists is released only if its container is listed without it or
    /// the API says its pod ended.
    pub reconcile_settle: Duration,
    /// How long an allocation the kubelet's pod-resources list has never shown is kept (an
    /// ordinary init container's, or one the kubelet has not recorded yet); allocations it
    /// listed are released as soon as they leave the list.
    pub reconcile_grace: Duration,
    /// Which kubelet API the node is served through (device plugins, or a DRA driver).
    pub driver: crate::dra::DriverMode,
}

impl AgentConfig {
    /// An agent whose host paths all lie under `dir`, for tests, benches and tools that run one
    /// in a directory of its own: device plugins in `device-plugins/`, pod-resources at
    /// `pod-resources/kubelet.sock`, the checkpoint in `state/`, the boot ID in `boot_id`, MPS
    /// daemons under `mps/`, CDI specs in `etc-cdi/` and `run-cdi/`, the toolkit's settings in
    /// `nvidia-container-runtime/config.toml`, cgroups under `cgroup/`; metrics on a free
    /// loopback port; node `node-a`; what needs the Kubernetes API off (the watchdog, the
    /// annotation, co-location); everything else the defaults. (`/proc` stays the host's: the
    /// watchdog kills only PIDs of the agent's own namespace.)
    pub fn for_root(dir: &std::path::Path) -> Self {
        Self {
            node_name: "node-a".into(),
            device_plugin_dir: dir.join("device-plugins"),
            pod_resources_socket: dir.join("pod-resources/kubelet.sock"),
            state_dir: dir.join("state"),
            boot_id_file: dir.join("boot_id"),
            views: ViewConfig::default(),
            devices: DeviceListConfig {
                strategy: Strategy::Cdi,
                cdi_spec_dirs: vec![dir.join("etc-cdi"), dir.join("run-cdi")],
                toolkit_config: dir.join("nvidia-container-runtime/config.toml"),
                ..DeviceListConfig::default()
            },
            mps: MpsConfig { root: dir.join("mps"), ..MpsConfig::default() },
            watchdog: WatchdogConfig { enabled: false, ..WatchdogConfig::default() },
            health: health::HealthConfig::default(),
            metrics: MetricsConfig {
                address: std::net::SocketAddr::from(([127, 0, 0, 1], 0)),
                probe_address: std::net::SocketAddr::from(([127, 0, 0, 1], 0)),
                ..MetricsConfig::default()
            },
            annotation: annotation::AnnotationConfig::default(),
            colocation: colocation::ColocationConfig {
                cgroup_root: dir.join("cgroup"),
                ..colocation::ColocationConfig::default()
            },
            reconcile_interval: crate::defaults::RECONCILE_INTERVAL,
            reconcile_settle: crate::defaults::RECONCILE_SETTLE,
            reconcile_grace: crate::defaults::RECONCILE_GRACE,
            driver: crate::dra::DriverMode::DevicePlugin,
        }
    }
}

/// What the agent runs against: the real adapters from `main`, fakes in tests.
#[derive(Clone)]
pub struct Dependencies {
    /// The node's GPUs (NVML, simulated, or NVML over a fake library).
    pub inventory: Arc<dyn GpuInventory>,
    /// The Kubernetes API (`main`: kube-rs): where the node-state annotation is written and the
    /// node's pods are followed; required when `annotation.enabled` or `colocation.enabled`.
    pub node_api: Option<Arc<dyn crate::kube_api::NodeApi>>,
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
    /// A subsystem that needs the Kubernetes API is on but the agent was given no client.
    #[error("{what} but no Kubernetes API client was given to the agent")]
    NoNodeApi {
        /// The setting.
        what: &'static str,
    },
    /// Co-location cannot start.
    #[error(transparent)]
    Colocation(#[from] colocation::ColocationError),
    /// The inventory cannot be made into a device ledger.
    #[error(transparent)]
    Ledger(#[from] BuildError),
    /// The checkpoint cannot be written.
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    /// The reconciled ledger cannot be saved.
    #[error(transparent)]
    Reconcile(#[from] reconciler::ReconcileError),
    /// A device plugin failed.
    #[error("device plugin for {resource} failed")]
    Plugin {
        /// The resource.
        resource: String,
        /// The cause.
        #[source]
        source: PluginError,
    },
    /// The allocations of the checkpoint would not read back with the same meaning under this
    /// configuration and inventory (a configuration error: exit code 64).
    #[error(
        "the allocations in {} cannot be read back with this configuration and GPUs:\n  - {}\n\
         Running containers hold these devices. Restore the previous configuration, or stop the \
         pods holding them, delete the checkpoint and restart the agent.",
        checkpoint.display(),
        problems.join("\n  - ")
    )]
    HeldDevicesChanged {
        /// The checkpoint.
        checkpoint: PathBuf,
        /// What would change, one line per allocation.
        problems: Vec<String>,
    },
    /// Socket paths longer than a Unix socket address holds.
    #[error(
        "socket paths longer than {} bytes, which a Unix socket address cannot hold: {}; use a shorter device-plugin directory or pod-resources socket path",
        startup::MAX_SOCKET_PATH,
        paths.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ")
    )]
    SocketPathsTooLong {
        /// The paths.
        paths: Vec<PathBuf>,
    },
    /// The device-plugin directory does not exist (a configuration error: exit code 64).
    #[error(
        "the device-plugin directory {} does not exist (paths.devicePluginDir, --device-plugin-dir): the kubelet creates it, /var/lib/kubelet/device-plugins on most nodes; fix the path, or on a simulated node create it (mkdir -p) or start the fake kubelet first",
        dir.display()
    )]
    NoDevicePluginDir {
        /// The directory.
        dir: PathBuf,
    },
    /// The DRA mode cannot start or serve.
    #[error("DRA mode: {what}")]
    Dra {
        /// What failed.
        what: &'static str,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A DRA driver's checkpoint that cannot be trusted (a configuration error: exit code 64).
    #[error(
        "the checkpoint {} cannot be trusted ({reason}); in DRA mode it is the only record of \
         the claims prepared on this node (the kubelet does not prepare them again), so the \
         agent does not serve an empty ledger. Drain the node (no pod using a claim of this \
         driver), then delete the checkpoint and restart the agent.",
        checkpoint.display()
    )]
    DraCheckpointUntrusted {
        /// The checkpoint.
        checkpoint: PathBuf,
        /// Why it is not trusted.
        reason: String,
    },
    /// The node is served as a DRA driver but the agent was given no Kubernetes client.
    #[error(
        "driver: dra needs the Kubernetes API (ResourceSlices, ResourceClaims), and the agent was given no client"
    )]
    DraWithoutApi,
    /// The node's agent lock cannot be taken.
    #[error(transparent)]
    Lock(#[from] lock::LockError),
    /// Shut down before it started (while waiting for another agent to exit).
    #[error("stopped before starting")]
    StoppedBeforeStart,
    /// The metrics endpoint cannot be set up or failed.
    #[error(transparent)]
    Metrics(#[from] MetricsError),
    /// A task of the agent panicked or was aborted.
    #[error("agent task {task} failed")]
    Task {
        /// Which task.
        task: &'static str,
        /// Why.
        #[source]
        source: JoinError,
    },
}

impl AgentError {
    /// Whether the error is a configuration problem (exit code 64): a topology file that cannot
    /// be read as one, a memory unit the kubelet cannot take, or a configuration that would change
    /// what held device IDs mean.
    pub fn is_configuration(&self) -> bool {
        matches!(
            self,
            AgentError::Inventory(InventoryError::Topology(_))
                | AgentError::HeldDevicesChanged { .. }
                | AgentError::DraCheckpointUntrusted { .. }
                | AgentError::SocketPathsTooLong { .. }
                | AgentError::NoDevicePluginDir { .. }
                | AgentError::Lock(lock::LockError::StateDir { .. })
                | AgentError::Ledger(
                    BuildError::ZeroUnit
                        | BuildError::TooManyUnits { .. }
                        | BuildError::TooManyGpus { .. }
                )
        )
    }
}

/// A resource's name and its plugin's state.
pub type PluginWatch = (String, watch::Receiver<PluginState>);

/// The subsystems' tasks, each with a name for its errors.
#[derive(Default)]
pub struct Tasks {
    set: JoinSet<Result<(), AgentError>>,
    names: HashMap<tokio::task::Id, &'static str>,
}

impl Tasks {
    /// Spawns `task`, named `name` in errors and logs.
    pub fn spawn(
        &mut self,
        name: &'static str,
        task: impl Future<Output = Result<(), AgentError>> + Send + 'static,
    ) {
        let handle = self.set.spawn(task);
        self.names.insert(handle.id(), name);
    }

    /// The next task to end, or `None` when none is left.
    async fn join_next(&mut self) -> Option<Result<(), AgentError>> {
        let joined = self.set.join_next_with_id().await?;
        Some(match joined {
            Ok((id, outcome)) => {
                self.names.remove(&id);
                outcome
            }
            Err(source) => {
                let task = self.names.remove(&source.id()).unwrap_or("unnamed");
                Err(AgentError::Task { task, source })
            }
        })
    }
}

/// A started agent.
pub struct Agent {
    shutdown: CancellationToken,
    resources: Arc<NodeResources>,
    plugins: Vec<(String, watch::Receiver<PluginState>)>,
    tasks: Tasks,
    health_stop: CancellationToken,
    health: Option<std::thread::JoinHandle<()>>,
    watchdog: crate::isolation::watchdog::Published,
    endpoints: Option<crate::metrics::Bound>,
    /// Held for the agent's life; declared last, so released after everything else is dropped.
    _lock: lock::InstanceLock,
}

impl Agent {
    /// Discovers, restores and starts every subsystem. Returns once every task is spawned (each
    /// plugin then binds, registers and retries on its own).
    pub async fn start(
        config: AgentConfig,
        deps: Dependencies,
        shutdown: CancellationToken,
    ) -> Result<Self, AgentError> {
        // The kubelet makes the device-plugin directory: one that does not exist is a wrong
        // path (or no kubelet on this node), and waiting for a socket in it would wait forever.
        let dra = match &config.driver {
            crate::dra::DriverMode::DevicePlugin => None,
            crate::dra::DriverMode::Dra(dra) => Some(dra.clone()),
        };
        if dra.is_none() && !config.device_plugin_dir.is_dir() {
            return Err(AgentError::NoDevicePluginDir { dir: config.device_plugin_dir.clone() });
        }
        let dra_client = match &dra {
            Some(_) => Some(
                deps.node_api.as_ref().and_then(|a| a.client()).ok_or(AgentError::DraWithoutApi)?,
            ),
            None => None,
        };
        // Alive from the first second: the metrics address answers while the agent waits for
        // its lock and for the kubelet, /readyz saying for what.
        let phase: crate::metrics::StartPhase = Default::default();
        let set_phase = |text: String| {
            *phase.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = text;
        };
        let starting = if config.metrics.enabled {
            let stop = shutdown.child_token();
            let (_, serve) = crate::metrics::bind_starting(
                &config.metrics,
                config.node_name.clone(),
                phase.clone(),
                stop.clone(),
            )
            .await?;
            Some((stop, tokio::spawn(serve)))
        } else {
            None
        };
        set_phase(format!(
            "waiting for the state directory's lock ({})",
            config.state_dir.display()
        ));
        let Some(lock) = lock::acquire(&config.state_dir, &shutdown).await? else {
            return Err(AgentError::StoppedBeforeStart);
        };
        set_phase(format!(
            "restoring allocations: waiting for the kubelet's pod-resources API at {}",
            config.pod_resources_socket.display()
        ));
        let resources = startup::restore(&config, &deps, &shutdown).await?;
        set_phase("starting the device plugins".into());
        // The full endpoint takes the address over.
        if let Some((stop, task)) = starting {
            stop.cancel();
            let _ = task.await;
        }
        if shutdown.is_cancelled() {
            // Stopped during start-up (waiting for pod-resources): start nothing more, not even
            // an MPS daemon.
            return Err(AgentError::StoppedBeforeStart);
        }
        // The agent's own measurements, recorded from the first Allocate on.
        // Every family in one registry of the agent's own (no global one), each series with
        // the node's name.
        let registry =
            crate::instruments::registry_for(&config.node_name).map_err(MetricsError::Register)?;
        let instruments = if config.metrics.enabled {
            let instruments = Instruments::new(&registry).map_err(MetricsError::Register)?;
            resources.instrument(instruments.clone());
            Some(instruments)
        } else {
            None
        };
        // Whether a container can reach GPUs beyond its grant, as far as the agent can tell:
        // logged and exported before the first answer.
        resources.report_device_posture();
        let mut tasks = Tasks::default();
        mps::start(&mut tasks, &config, &resources, &shutdown).await;
        // The node pods' view, followed once for co-location and the watchdog (where they run).
        let (view, pods) = watch::channel(NodePods::default());
        let api = deps.node_api.as_ref();
        // Before the plugins: their first Allocate already finds its pod's class.
        let colocating = colocation::start(
            &mut tasks,
            &config.colocation,
            &config.state_dir,
            &resources,
            (deps.node_api.clone(), api.map(|_| pods.clone())),
            &config.node_name,
            &shutdown,
        )?;
        let pods = follow_node_pods(&mut tasks, &config, colocating, api, view, pods, &shutdown);
        // One kubelet API per node: device plugins, or a DRA driver on the same ledger.
        let plugins = match (&dra, dra_client) {
            (Some(dra), Some(client)) => {
                vec![dra::start(&mut tasks, &config, dra, &resources, client, &shutdown)?]
            }
            _ => plugins::spawn(&mut tasks, &config, &resources, &shutdown),
        };
        annotation::start(
            &mut tasks,
            &config,
            deps.node_api.as_ref(),
            pods.as_ref(),
            &resources,
            &shutdown,
        )?;
        // A DRA driver's claims are released by NodeUnprepareResources, never by a
        // pod-resources list (which does not show them).
        if dra.is_none() {
            reconciler::start(&mut tasks, &config, &resources, (&plugins, &pods), &shutdown);
        }
        let calls = Arc::new(crate::inventory::CallFailures::default());
        let watchdog = watchdog::start(
            &mut tasks,
            &config,
            (&deps.inventory, calls.clone()),
            &resources,
            deps.node_api.clone(),
            pods,
            &shutdown,
        )?;
        let endpoints = endpoint::start(
            &mut tasks,
            &config,
            &deps,
            &registry,
            instruments,
            endpoint::Readers {
                resources: &resources,
                plugins: &plugins,
                watchdog: &watchdog,
                calls: &calls,
            },
            &shutdown,
        )
        .await?;
        let health_stop = shutdown.child_token();
        let health =
            health::start(&mut tasks, &config, &deps, &resources, calls, (&shutdown, &health_stop));
        Ok(Self {
            shutdown,
            resources,
            plugins,
            tasks,
            health_stop,
            health,
            watchdog,
            endpoints,
            _lock: lock,
        })
    }

    /// The node's resources: the device ledger behind every view.
    pub fn resources(&self) -> &Arc<NodeResources> {
        &self.resources
    }

    /// Where the metrics endpoint listens, when it does.
    pub fn metrics_address(&self) -> Option<std::net::SocketAddr> {
        self.endpoints.map(|b| b.metrics)
    }

    /// Where the probe endpoint (`/healthz`, `/readyz` alone) listens, when it does.
    pub fn probe_address(&self) -> Option<std::net::SocketAddr> {
        self.endpoints.map(|b| b.probes)
    }

    /// The containers over their GPU memory grant, as of the watchdog's last round.
    pub fn over_grant(&self) -> watch::Receiver<Vec<Over>> {
        self.watchdog.over.clone()
    }

    /// The GPU processes of no grant the watchdog reported at its last round.
    pub fn strays(&self) -> watch::Receiver<Vec<Stray>> {
        self.watchdog.strays.clone()
    }

    /// The resources served, with each plugin's state.
    pub fn plugins(&self) -> &[(String, watch::Receiver<PluginState>)] {
        &self.plugins
    }

    /// Waits until every task ends (after the shutdown token is cancelled, or after a task
    /// failed, which cancels it); the first error.
    pub async fn wait(mut self) -> Result<(), AgentError> {
        let mut result = Ok(());
        while let Some(outcome) = self.tasks.join_next().await {
            if let Err(e) = outcome {
                // A resource that cannot be served any more (its socket cannot be bound, say):
                // stop the whole agent so that it exits non-zero and the DaemonSet restarts it,
                // rather than serving part of the node in silence.
                tracing::error!(error = %Chain(&e), "agent task failed; stopping the agent");
                self.shutdown.cancel();
                if result.is_ok() {
                    result = Err(e);
                }
            }
        }
        self.health_stop.cancel();
        // The health thread checks its token at least every half second (NVML's wait).
        if let Some(thread) = self.health.take() {
            let _ = tokio::task::spawn_blocking(move || thread.join()).await;
        }
        result
    }
}

/// Follows the node's pods into `view` through the API where the agent has one (co-location,
/// the watchdog and the reconciler's confirmation of a kubelet's missing allocations use
/// them), and the namespaces' class labels when co-location takes classes from them; the view,
/// kept current.
fn follow_node_pods(
    tasks: &mut Tasks,
    config: &AgentConfig,
    colocating: bool,
    api: Option<&Arc<dyn crate::kube_api::NodeApi>>,
    view: watch::Sender<NodePods>,
    pods: watch::Receiver<NodePods>,
    shutdown: &CancellationToken,
) -> Option<watch::Receiver<NodePods>> {
    let api = api?.clone();
    let namespaces = colocating
        && config.colocation.policy.class_from
            == crate::isolation::colocation::ClassSource::Namespace;
    view.send_modify(|v| v.namespaces_synced = !namespaces);
    if namespaces {
        let (api, view, token) = (api.clone(), view.clone(), shutdown.clone());
        tasks.spawn("namespace class watcher", async move {
            api.follow_namespaces(view, token).await;
            Ok(())
        });
    }
    let (node, token) = (config.node_name.clone(), shutdown.clone());
    tasks.spawn("node pod watcher", async move {
        api.follow_pods(&node, view, token).await;
        Ok(())
    });
    Some(pods)
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
    deps: Dependencies,
    shutdown: CancellationToken,
) -> Result<(), AgentError> {
    match Agent::start(config, deps, shutdown).await {
        Ok(agent) => agent.wait().await,
        Err(AgentError::StoppedBeforeStart) => Ok(()),
        Err(e) => Err(e),
    }
}
