//! The memory watchdog subsystem: every `watchdog.interval` it judges the GPUs' processes
//! (`crate::isolation::watchdog`) with what the agent knows of who holds what: the API's view of
//! the node's pods (shared with co-location), the kubelet's last pod-resources list and the
//! ledger (`NodeResources::watchdog_view`), and the MPS servers the daemons named. Its Events go
//! to the API server from a second task ([`super::events::send_all`]).

use std::sync::Arc;

use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

use super::{AgentConfig, AgentError, Tasks};
use crate::inventory::{CallFailures, GpuInventory};
use crate::isolation::node_pods::NodePods;
use crate::isolation::watchdog::{Holders, Published, Watchdog};
use crate::kube_api::NodeApi;
use crate::resources::NodeResources;

/// Starts the watchdog and its Event sender when `watchdog.enabled`.
pub fn start(
    tasks: &mut Tasks,
    config: &AgentConfig,
    deps: (&Arc<dyn GpuInventory>, Arc<CallFailures>),
    resources: &Arc<NodeResources>,
    api: Option<Arc<dyn NodeApi>>,
    pods: Option<watch::Receiver<NodePods>>,
    shutdown: &CancellationToken,
) -> Result<Published, AgentError> {
    if !config.watchdog.enabled {
        tracing::info!(
            "the memory watchdog is off (watchdog.enabled: false): nothing holds a container to the sum of its processes' GPU memory"
        );
        return Ok(Published::none());
    }
    let (Some(api), Some(pods)) = (api, pods) else {
        return Err(AgentError::NoNodeApi { what: "watchdog.enabled" });
    };
    let (queue, notices) = mpsc::channel(crate::defaults::WATCHDOG_EVENT_QUEUE);
    let dog = Watchdog::new(config.watchdog.clone(), Some(queue));
    let published = dog.published();
    let counts = published.counts.clone();
    let view = resources.clone();
    let holders = Box::new(move || {
        let (holdings, unlisted, mps_servers) = view.watchdog_view();
        Holders { pods: pods.borrow().clone(), holdings, unlisted, mps_servers }
    });
    let (inventory, calls, token) = (deps.0.clone(), deps.1, shutdown.clone());
    tasks.spawn("memory watchdog", async move {
        dog.run(inventory, holders, calls, token).await;
        Ok(())
    });
    let (node, token) = (config.node_name.clone(), shutdown.clone());
    tasks.spawn("watchdog events", async move {
        super::events::send_all("watchdog", node, api, notices, counts, token).await;
        Ok(())
    });
    Ok(published)
}
