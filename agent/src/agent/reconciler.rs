//! Reconciliation with the kubelet's pod-resources API: every `reconcile_interval` the ledger is
//! brought in line with what the kubelet lists (`crate::reconcile` decides what changes), and
//! what changed is logged. Also the one reconciliation that start-up waits for.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use baleen_device_plugin::BackendError;
use tokio::task::JoinError;
use tokio_util::sync::CancellationToken;

use super::{AgentConfig, AgentError};
use crate::error_chain::Chain;
use crate::reconcile;
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
    Saving(#[source] BackendError),
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
}

impl Settings {
    /// The loop's settings from the agent's.
    pub fn of(config: &AgentConfig) -> Self {
        Self {
            socket: config.pod_resources_socket.clone(),
            interval: config.reconcile_interval,
            grace_secs: config.reconcile_grace.as_secs(),
        }
    }
}

/// Reconciles every `settings.interval` until `shutdown`; logs an unreachable kubelet once per
/// outage.
pub async fn run(
    resources: Arc<NodeResources>,
    settings: Settings,
    shutdown: CancellationToken,
) -> Result<(), AgentError> {
    let mut failing = false;
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return Ok(()),
            () = tokio::time::sleep(settings.interval) => {}
        }
        match reconcile_once(&resources, &settings.socket, LIST_TIMEOUT, settings.grace_secs).await
        {
            Ok(()) => {
                if failing {
                    tracing::info!(socket = %settings.socket.display(), "pod-resources reachable again");
                    failing = false;
                }
            }
            Err(ReconcileFailure::NotSaved(e)) => {
                tracing::error!(error = %Chain(&e), "reconciliation failed")
            }
            Err(ReconcileFailure::Unreachable(e)) if !failing => {
                tracing::warn!(error = %Chain(&e), "cannot reconcile with the kubelet; allocations of ended pods stay held until it answers");
                failing = true;
            }
            Err(ReconcileFailure::Unreachable(e)) => {
                tracing::debug!(error = %Chain(&e), "pod-resources still unreachable");
            }
        }
    }
}

/// Reads the kubelet's allocations and brings the ledger in line, logging what changed. The
/// checkpoint write blocks (fsync), so the ledger change runs off the async worker threads.
pub(super) async fn reconcile_once(
    resources: &Arc<NodeResources>,
    socket: &Path,
    timeout: Duration,
    grace_secs: u64,
) -> Result<(), ReconcileFailure> {
    for _ in 0..STALE_RETRIES {
        let asked_at = resources.generation();
        let truth = match reconcile::fetch(socket, timeout).await {
            Ok(truth) => truth,
            Err(e) => {
                resources.count_unreachable();
                return Err(ReconcileFailure::Unreachable(e));
            }
        };
        let applying = resources.clone();
        let outcome =
            tokio::task::spawn_blocking(move || applying.reconcile(&truth, grace_secs, asked_at))
                .await
                .map_err(|e| ReconcileFailure::NotSaved(ReconcileError::Task(e)))?
                .map_err(|e| ReconcileFailure::NotSaved(ReconcileError::Saving(e)))?;
        match outcome {
            Some(report) => {
                log_report(&report);
                return Ok(());
            }
            None => {
                tracing::debug!("allocations changed while pod-resources answered; asking again")
            }
        }
    }
    tracing::debug!(tries = STALE_RETRIES, "allocations kept changing; reconciling next time");
    Ok(())
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
