//! GPU health: follows NVML's XID events on a thread of its own (NVML's wait blocks). A critical
//! XID marks its GPU unhealthy, which advertises all its devices Unhealthy in every view; a
//! failing wait marks every GPU unhealthy and the watch goes on.

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::error_chain::Chain;
use crate::inventory::{CallFailures, GpuInventory};
use crate::resources::NodeResources;

/// The longest wait between two tries to start the health watch.
const START_RETRY_MAX: Duration = Duration::from_secs(30);

/// Follows XID events on a thread of its own (NVML's wait blocks); a critical XID marks the GPU
/// unhealthy, which advertises all its devices Unhealthy. While the watch cannot be started,
/// every GPU is advertised Unhealthy (nothing would tell the agent that one failed) and the
/// start is retried with backoff; once it starts, the GPUs are healthy again.
pub fn spawn(
    inventory: Arc<dyn GpuInventory>,
    resources: Arc<NodeResources>,
    calls: Arc<CallFailures>,
    stop: CancellationToken,
) -> Option<std::thread::JoinHandle<()>> {
    let on_thread = resources.clone();
    let spawned = std::thread::Builder::new()
        .name("baleen-health".into())
        .spawn(move || watch(inventory.as_ref(), &on_thread, &calls, &stop));
    match spawned {
        Ok(handle) => Some(handle),
        Err(e) => {
            tracing::error!(error = %Chain(&e), "cannot start the health thread; every GPU marked unhealthy");
            resources.set_all_health(false, "health thread not running");
            None
        }
    }
}

fn watch(
    inventory: &dyn GpuInventory,
    resources: &NodeResources,
    calls: &CallFailures,
    stop: &CancellationToken,
) {
    let mut retry = Duration::from_secs(1);
    let mut watcher = loop {
        match inventory.health_watcher() {
            Ok(w) => break w,
            Err(e) => {
                calls.record(&e);
                if retry == Duration::from_secs(1) {
                    tracing::error!(error = %Chain(&e), "cannot watch GPU health; every GPU marked unhealthy until the watch starts");
                    resources.set_all_health(false, "health watch cannot start");
                }
                if !sleep_unless_stopped(retry, stop) {
                    return;
                }
                retry = (retry * 2).min(START_RETRY_MAX);
            }
        }
    };
    if retry > Duration::from_secs(1) {
        tracing::warn!("GPU health watch started; GPUs healthy again");
        resources.set_all_health(true, "");
    }
    for gpu in watcher.unwatched() {
        tracing::warn!(gpu.uuid = %gpu, "GPU cannot report health events");
    }
    let mut failing = false;
    while !stop.is_cancelled() {
        let event = watcher.next_event(Duration::from_millis(500));
        if failing && event.is_ok() {
            tracing::warn!(
                "GPU health watch answers again; GPUs stay unhealthy until the agent restarts"
            );
            failing = false;
        }
        match event {
            Ok(Some(event)) if event.critical => {
                tracing::error!(gpu.uuid = %event.gpu, xid = event.xid, "critical XID: GPU marked unhealthy");
                resources.set_health(
                    event.gpu.as_str(),
                    false,
                    &format!("critical XID {}", event.xid),
                );
            }
            Ok(Some(event)) => {
                tracing::warn!(gpu.uuid = %event.gpu, xid = event.xid, "application XID; GPU stays healthy");
            }
            Ok(None) => {}
            Err(e) => {
                calls.record(&e);
                // A failed wait usually means a GPU fell off the bus, and the event cannot even
                // say which: like NVIDIA's device plugin, mark every GPU unhealthy and keep
                // watching (once per second while the errors last).
                if !failing {
                    tracing::error!(error = %Chain(&e), "GPU health watch failed; every GPU marked unhealthy");
                    failing = true;
                }
                resources.set_all_health(false, "health watch failed");
                std::thread::park_timeout(Duration::from_secs(1));
            }
        }
    }
}

/// Sleeps `total` in short slices; false as soon as `stop` is cancelled.
fn sleep_unless_stopped(total: Duration, stop: &CancellationToken) -> bool {
    let slice = Duration::from_millis(200);
    let mut left = total;
    while !left.is_zero() {
        if stop.is_cancelled() {
            return false;
        }
        let step = left.min(slice);
        std::thread::sleep(step);
        left -= step;
    }
    !stop.is_cancelled()
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
            watch(inventory.as_ref(), &on_thread, &on_calls, &thread_stop);
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
