//! Reconciliation with the kubelet's pod-resources API: every `reconcile_interval` the ledger is
//! brought in line with what the kubelet lists (`crate::reconcile` decides what changes), and
//! what changed is logged. Also the one reconciliation that start-up waits for.
//!
//! What confirms a miss besides the list (`reconcile::Witness`) is gathered here: whether the
//! kubelet (re)appeared less than `reconcile.kubeletSettle` ago (the agent's start, a plugin
//! registering again, pod-resources answering again after an outage), and the API server's view
//! of the node's pods where the agent follows them.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use baleen_device_plugin::PluginState;
use tokio::sync::watch;
use tokio::task::JoinError;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::{AgentConfig, AgentError};
use crate::error_chain::Chain;
use crate::isolation::node_pods::NodePods;
use crate::reconcile::{self, PodFate, Witness};
use crate::resources::NodeResources;

/// How long one pod-resources `List` may take in the periodic loop.
const LIST_TIMEOUT: Duration = Duration::from_secs(5);
/// How often one reconciliation asks again when the allocations changed while the kubelet
/// answered (its list may predate the change).
const STALE_RETRIES: usize = 3;

/// Why a reconciled ledger was not saved.
#[derive(Debug, thiserror::Error)]
pub enum ReconcileError {
    /// The ledger change (its checkpoint write) failed.
    #[error("the reconciled ledger cannot be saved")]
    Saving(#[source] crate::resources::ChangeError),
    /// The blocking task that applies the change failed.
    #[error("the reconciliation task failed")]
    Task(#[source] JoinError),
}

/// Why one reconciliation did not happen.
pub(super) enum ReconcileFailure {
    /// The kubelet's pod-resources API did not answer.
    Unreachable(reconcile::FetchError),
    /// The reconciled ledger could not be saved.
    NotSaved(ReconcileError),
}

/// What the loop needs of the agent's configuration.
#[derive(Debug, Clone)]
pub struct Settings {
    /// The kubelet's pod-resources socket.
    pub socket: PathBuf,
    /// Time between reconciliations.
    pub interval: Duration,
    /// Seconds an allocation the kubelet never listed is kept.
    pub grace_secs: u64,
    /// How long a kubelet that (re)appeared may still be syncing its pods.
    pub settle: Duration,
}

impl Settings {
    /// The loop's settings from the agent's.
    pub fn of(config: &AgentConfig) -> Self {
        Self {
            socket: config.pod_resources_socket.clone(),
            interval: config.reconcile_interval,
            grace_secs: config.reconcile_grace.as_secs(),
            settle: config.reconcile_settle,
        }
    }
}

/// What the loop watches besides the kubelet's list.
pub struct Witnesses {
    /// Each resource's plugin state: a registration beyond the first is a kubelet that came
    /// back.
    pub plugins: Vec<watch::Receiver<PluginState>>,
    /// The API server's view of the node's pods, where the agent follows them.
    pub pods: Option<watch::Receiver<NodePods>>,
}

/// The API's word on each pod of the node, when its view has been listed.
fn fates(pods: Option<&watch::Receiver<NodePods>>) -> Option<BTreeMap<(String, String), PodFate>> {
    let view = pods?.borrow();
    view.synced.then(|| {
        view.pods
            .values()
            .map(|p| {
                let fate = match p.phase.as_str() {
                    "Succeeded" | "Failed" => PodFate::Ended,
                    _ => PodFate::Runs,
                };
                ((p.namespace.clone(), p.name.clone()), fate)
            })
            .collect()
    })
}

fn registrations(plugins: &[watch::Receiver<PluginState>]) -> u64 {
    plugins
        .iter()
        .map(|p| match *p.borrow() {
            PluginState::Registered { registrations } => registrations,
            _ => 0,
        })
        .sum()
}

/// Starts the reconciliation, its witnesses the plugins' states and the node's pods.
pub fn start(
    tasks: &mut super::Tasks,
    config: &AgentConfig,
    resources: &Arc<NodeResources>,
    (plugins, pods): (&[super::PluginWatch], &Option<watch::Receiver<NodePods>>),
    shutdown: &CancellationToken,
) {
    let witnesses = Witnesses {
        plugins: plugins.iter().map(|(_, state)| state.clone()).collect(),
        pods: pods.clone(),
    };
    tasks.spawn(
        "reconciliation",
        run(resources.clone(), Settings::of(config), witnesses, shutdown.clone()),
    );
}

/// Reconciles every `settings.interval` until `shutdown`; logs an unreachable kubelet once per
/// outage, and each allocation held for an unconfirmed miss once per episode.
pub async fn run(
    resources: Arc<NodeResources>,
    settings: Settings,
    witnesses: Witnesses,
    shutdown: CancellationToken,
) -> Result<(), AgentError> {
    let mut outage = crate::retry::Outage::default();
    // The agent has just started: the kubelet may have too.
    let mut appeared = Instant::now();
    let mut registered = registrations(&witnesses.plugins);
    let mut held: BTreeSet<(String, Vec<String>)> = BTreeSet::new();
    loop {
        if !crate::retry::sleep_or_stop(settings.interval, &shutdown).await {
            return Ok(());
        }
        let now = registrations(&witnesses.plugins);
        if now > registered {
            // The first registrations are the kubelet appearing to this agent; later ones, the
            // kubelet coming back after a restart. Either way it may still be syncing.
            if registered > 0 {
                tracing::info!(
                    "the kubelet registered the plugins again (it restarted): allocations it no longer lists are kept until the miss is confirmed"
                );
            }
            appeared = Instant::now();
        }
        registered = now;
        let witness = Witness {
            kubelet_settling: appeared.elapsed() < settings.settle,
            pods: fates(witnesses.pods.as_ref()),
        };
        let outcome = reconcile_once(
            &resources,
            &settings.socket,
            LIST_TIMEOUT,
            settings.grace_secs,
            &witness,
        )
        .await;
        match outcome {
            Ok(report) => {
                if outage.succeeded() {
                    tracing::info!(socket = %settings.socket.display(), "pod-resources reachable again: allocations it no longer lists are kept until the miss is confirmed");
                    appeared = Instant::now();
                }
                if let Some(report) = report {
                    log_held(&report, &mut held);
                }
            }
            Err(ReconcileFailure::NotSaved(e)) => {
                tracing::error!(error = %Chain(&e), "reconciliation failed")
            }
            Err(ReconcileFailure::Unreachable(e)) if outage.failed() => {
                tracing::warn!(error = %Chain(&e), "cannot reconcile with the kubelet; allocations of ended pods stay held until it answers");
            }
            Err(ReconcileFailure::Unreachable(e)) => {
                tracing::debug!(error = %Chain(&e), "pod-resources still unreachable");
            }
        }
    }
}

/// Logs each newly held allocation at WARN (with why) and each that is no longer held at INFO.
fn log_held(report: &reconcile::Report, held: &mut BTreeSet<(String, Vec<String>)>) {
    let now: BTreeSet<(String, Vec<String>)> =
        report.held.iter().map(|(r, _)| (r.resource.clone(), r.device_ids.clone())).collect();
    for (r, why) in &report.held {
        if !held.contains(&(r.resource.clone(), r.device_ids.clone())) {
            tracing::warn!(resource = r.resource, devices = ?r.device_ids, holder = ?r.holder, why, "kept: the kubelet no longer lists this allocation, and the miss is not confirmed");
        }
    }
    for (resource, devices) in held.difference(&now) {
        tracing::info!(
            resource,
            ?devices,
            "no longer kept for an unconfirmed miss (listed again, or released)"
        );
    }
    *held = now;
}

/// Reads the kubelet's allocations and brings the ledger in line, logging what changed. The
/// checkpoint write blocks (fsync), so the ledger change runs off the async worker threads.
pub(super) async fn reconcile_once(
    resources: &Arc<NodeResources>,
    socket: &Path,
    timeout: Duration,
    grace_secs: u64,
    witness: &Witness,
) -> Result<Option<reconcile::Report>, ReconcileFailure> {
    for _ in 0..STALE_RETRIES {
        let asked_at = resources.generation();
        let truth = match reconcile::fetch(socket, timeout).await {
            Ok(truth) => truth,
            Err(e) => {
                resources.count_unreachable();
                return Err(ReconcileFailure::Unreachable(e));
            }
        };
        let (applying, witness) = (resources.clone(), witness.clone());
        let outcome = tokio::task::spawn_blocking(move || {
            applying.reconcile(&truth, grace_secs, asked_at, &witness)
        })
        .await
        .map_err(|e| ReconcileFailure::NotSaved(ReconcileError::Task(e)))?
        .map_err(|e| ReconcileFailure::NotSaved(ReconcileError::Saving(e)))?;
        match outcome {
            Some(report) => {
                log_report(&report);
                return Ok(Some(report));
            }
            None => {
                tracing::debug!("allocations changed while pod-resources answered; asking again")
            }
        }
    }
    tracing::debug!(tries = STALE_RETRIES, "allocations kept changing; reconciling next time");
    Ok(None)
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
