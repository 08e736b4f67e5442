//! GPU health: follows NVML's XID events on a thread of its own (NVML's wait blocks). A critical
//! XID marks its GPU unhealthy, which advertises all its devices Unhealthy in every view; a
//! failing wait marks every GPU unhealthy and the watch goes on.

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::error_chain::Chain;
use crate::inventory::GpuInventory;
use crate::resources::NodeResources;

/// Follows XID events on a thread of its own (NVML's wait blocks); a critical XID marks the GPU
/// unhealthy, which advertises all its devices Unhealthy.
pub fn spawn(
    inventory: Arc<dyn GpuInventory>,
    resources: Arc<NodeResources>,
    stop: CancellationToken,
) {
    let spawned = std::thread::Builder::new().name("baleen-health".into()).spawn(move || {
        let mut watcher = match inventory.health_watcher() {
            Ok(w) => w,
            Err(e) => {
                tracing::error!(error = %Chain(&e), "cannot watch GPU health; GPUs stay as discovered");
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
                    resources.set_health(event.gpu.as_str(), false);
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
                        tracing::error!(error = %Chain(&e), "GPU health watch failed; every GPU marked unhealthy");
                        failing = true;
                    }
                    resources.set_all_health(false);
                    std::thread::park_timeout(Duration::from_secs(1));
                    continue;
                }
            }
        }
    });
    if let Err(e) = spawned {
        tracing::error!(error = %Chain(&e), "cannot start the health thread");
    }
}
