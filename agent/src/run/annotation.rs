//! The node-state publisher: writes the node's gpu-state document (docs/gpu-state.md) as the
//! annotation `<domain>/gpu-state` on the agent's own Node, for the scheduler extender. Written
//! once the ledger is restored and after every change, coalesced (at most one write per
//! `annotation.minInterval`; the last state is always written), retried with backoff while the
//! API server cannot be reached. It runs beside the plugins and never blocks an Allocate: it
//! reads a snapshot of the ledger and writes outside its lock.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::defaults;
use crate::error_chain::Chain;
use crate::kube_api::NodeApi;
use crate::resources::NodeResources;
use crate::retry::{Backoff, Outage, sleep_or_stop};

/// The annotation's settings (`annotation:` in the file).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AnnotationConfig {
    /// Publish at all.
    pub enabled: bool,
    /// The annotation's key, `<domain>/gpu-state`.
    pub key: String,
    /// The least time between two writes.
    pub min_interval: Duration,
}

impl Default for AnnotationConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            key: format!("{}/{}", defaults::DOMAIN, defaults::ANNOTATION_NAME),
            min_interval: defaults::ANNOTATION_MIN_INTERVAL,
        }
    }
}

/// Starts the publisher where `annotation.enabled` (it needs the API: an error without one).
pub fn start(
    tasks: &mut super::Tasks,
    config: &super::AgentConfig,
    api: Option<&Arc<dyn NodeApi>>,
    resources: &Arc<NodeResources>,
    shutdown: &CancellationToken,
) -> Result<(), super::AgentError> {
    if !config.annotation.enabled {
        return Ok(());
    }
    let api = api.cloned().ok_or(super::AgentError::NoNodeApi { what: "annotation.enabled" })?;
    let publish = run(
        api,
        resources.clone(),
        config.node_name.clone(),
        config.annotation.clone(),
        shutdown.clone(),
    );
    tasks.spawn("node-state publisher", async move {
        publish.await;
        Ok(())
    });
    Ok(())
}

/// Publishes until `shutdown`.
pub async fn run(
    api: Arc<dyn NodeApi>,
    resources: Arc<NodeResources>,
    node: String,
    config: AnnotationConfig,
    shutdown: CancellationToken,
) {
    let mut changes = resources.watch_state();
    let mut written: Option<String> = None;
    let mut retry = Backoff::new(defaults::API_RETRY);
    let mut outage = Outage::default();
    loop {
        changes.borrow_and_update();
        let text = resources.node_state().to_json();
        if written.as_deref() != Some(text.as_str()) {
            match api.annotate(&node, &config.key, &text).await {
                Ok(()) => {
                    if outage.succeeded() {
                        tracing::info!(node, annotation = config.key, "node state written again");
                    }
                    retry.reset();
                    written = Some(text);
                }
                Err(e) => {
                    // A write that failed on our side may still have reached the API server:
                    // whatever it holds now, the next state is written.
                    written = None;
                    if outage.failed() {
                        tracing::warn!(
                            node,
                            annotation = config.key,
                            error = %Chain(&e),
                            "cannot write the node state; retrying with backoff (the scheduler extender sees an older state meanwhile)"
                        );
                    }
                    if !sleep_or_stop(retry.next_wait(), &shutdown).await {
                        return;
                    }
                    continue;
                }
            }
        }
        let at = Instant::now();
        tokio::select! {
            () = shutdown.cancelled() => return,
            changed = changes.changed() => if changed.is_err() { return },
            // Written again now and then, even unchanged: an annotation someone removed or
            // overwrote comes back.
            () = tokio::time::sleep(defaults::ANNOTATION_REFRESH) => written = None,
        }
        // Coalesce: changes during the interval are written together, as the state at its end.
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = tokio::time::sleep_until(at + config.min_interval) => {}
        }
    }
}
