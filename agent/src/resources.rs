//! The resource views as device-plugin backends: one [`Ledger`] (the node state behind a mutex,
//! persisted to the checkpoint after every change) and one [`ViewBackend`] per view, whose
//! device list is a `watch` channel recomputed after every change of the ledger.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;
use std::time::{SystemTime, UNIX_EPOCH};

use baleen_device_plugin::device::DeviceSnapshot;
use baleen_device_plugin::{
    BackendError, ContainerAllocation, DeviceBackend, DeviceList, PreferredAllocationRequest,
};
use tokio::sync::watch;

use crate::checkpoint::Checkpoint;
use crate::node::{AllocationRecord, NodeState, View};
use crate::reconcile::{self, KubeletAllocation, Report};

/// Seconds since the Unix epoch.
pub fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

struct Inner {
    state: NodeState,
    checkpoint: Checkpoint,
    node: String,
    boot_id: String,
}

/// The node's ledger shared by every view, persisted on every change.
pub struct Ledger {
    inner: Mutex<Inner>,
    views: BTreeMap<View, (String, watch::Sender<DeviceSnapshot>)>,
    pod_resources: Option<PathBuf>,
}

impl Ledger {
    /// Wraps `state`; every change is written to `checkpoint` for `node` in boot `boot_id`.
    /// `pod_resources` is the kubelet's pod-resources socket, asked before an Allocate replaces
    /// an older allocation of the same resource (`None`: trust the kubelet without asking).
    pub fn new(
        state: NodeState,
        checkpoint: Checkpoint,
        node: String,
        boot_id: String,
        pod_resources: Option<PathBuf>,
    ) -> Arc<Self> {
        let domain = state.config().domain.clone();
        let views = state
            .views()
            .into_iter()
            .map(|v| {
                let (tx, _) = watch::channel(Arc::new(DeviceList::new(state.devices(&v))));
                let name = v.resource_name(&domain);
                (v, (name, tx))
            })
            .collect();
        Arc::new(Self {
            inner: Mutex::new(Inner { state, checkpoint, node, boot_id }),
            views,
            pod_resources,
        })
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// One backend per view.
    pub fn backends(self: &Arc<Self>) -> Vec<Arc<ViewBackend>> {
        self.views
            .iter()
            .map(|(view, (name, _))| {
                Arc::new(ViewBackend {
                    ledger: self.clone(),
                    view: view.clone(),
                    resource: name.clone(),
                })
            })
            .collect()
    }

    /// The current allocations.
    pub fn records(&self) -> Vec<AllocationRecord> {
        self.lock().state.records()
    }

    fn publish(&self, state: &NodeState) {
        for (view, (_, tx)) in &self.views {
            let devices = state.devices(view);
            tx.send_if_modified(|current| {
                if current.devices() == devices.as_slice() {
                    false
                } else {
                    *current = Arc::new(DeviceList::new(devices));
                    true
                }
            });
        }
    }

    /// Applies `change` to the state; keeps it only if the checkpoint is written.
    fn change<T>(
        &self,
        change: impl FnOnce(&mut NodeState) -> Result<T, BackendError>,
    ) -> Result<T, BackendError> {
        let mut inner = self.lock();
        let before = inner.state.records();
        let mut next = inner.state.clone();
        let out = change(&mut next)?;
        if next.records() != before {
            inner
                .checkpoint
                .store(&inner.node, &inner.boot_id, &next.records())
                .map_err(|e| BackendError::Internal { reason: e.to_string() })?;
            inner.state = next;
            self.publish(&inner.state);
        }
        Ok(out)
    }

    /// Writes the checkpoint now.
    pub fn persist(&self) -> Result<(), crate::checkpoint::CheckpointError> {
        let inner = self.lock();
        inner.checkpoint.store(&inner.node, &inner.boot_id, &inner.state.records())
    }

    /// Reconciles with the kubelet's allocations; see [`reconcile::reconcile`].
    pub fn reconcile(
        &self,
        allocations: &[KubeletAllocation],
        grace_secs: u64,
    ) -> Result<Report, BackendError> {
        self.change(|state| Ok(reconcile::reconcile(state, allocations, unix_now(), grace_secs)))
    }

    /// Marks every GPU healthy or not and republishes.
    pub fn set_all_health(&self, healthy: bool) {
        let mut inner = self.lock();
        let uuids: Vec<String> = inner.state.gpus().map(|g| g.uuid.to_string()).collect();
        let mut changed = false;
        for uuid in uuids {
            changed |= inner.state.set_health(&uuid, healthy);
        }
        if changed {
            self.publish(&inner.state);
        }
    }

    /// Marks a GPU healthy or not and republishes.
    pub fn set_health(&self, uuid: &str, healthy: bool) -> bool {
        let mut inner = self.lock();
        let changed = inner.state.set_health(uuid, healthy);
        if changed {
            self.publish(&inner.state);
        }
        changed
    }
}

/// One view of the ledger, served as one extended resource.
pub struct ViewBackend {
    ledger: Arc<Ledger>,
    view: View,
    resource: String,
}

#[async_trait::async_trait]
impl DeviceBackend for ViewBackend {
    fn resource_name(&self) -> &str {
        &self.resource
    }

    fn devices(&self) -> watch::Receiver<DeviceSnapshot> {
        match self.ledger.views.get(&self.view) {
            Some((_, tx)) => tx.subscribe(),
            // Backends are made only for the ledger's views.
            None => watch::channel(Arc::new(DeviceList::default())).1,
        }
    }

    async fn preferred_allocation(
        &self,
        request: PreferredAllocationRequest,
    ) -> Result<Vec<String>, BackendError> {
        let inner = self.ledger.lock();
        inner.state.preferred(&self.view, &request.available, &request.must_include, request.size)
    }

    async fn allocate(&self, device_ids: Vec<String>) -> Result<ContainerAllocation, BackendError> {
        // Devices of this resource that an older allocation holds: the kubelet reassigns only
        // devices whose container ended, but if its books were lost it could hand out devices
        // still in use. Ask its pod-resources list before replacing anything.
        let replaced = self.ledger.lock().state.overlapping(&self.view, &device_ids);
        if !replaced.is_empty()
            && let Some(socket) = &self.ledger.pod_resources
        {
            match reconcile::fetch(socket, Duration::from_secs(2)).await {
                Ok(listed) => {
                    let running: Vec<&KubeletAllocation> = listed
                        .iter()
                        .filter(|k| {
                            replaced
                                .iter()
                                .any(|r| r.resource == k.resource && r.device_ids == k.device_ids)
                        })
                        .collect();
                    if let Some(k) = running.first() {
                        return Err(BackendError::Conflict {
                            ids: device_ids,
                            reason: format!(
                                "the kubelet still lists devices {:?} for running container {}/{}/{}",
                                k.device_ids, k.namespace, k.pod, k.container
                            ),
                        });
                    }
                }
                Err(e) => tracing::warn!(
                    resource = self.resource,
                    error = %e,
                    "cannot ask pod-resources whether replaced allocations ended; trusting the kubelet"
                ),
            }
        }
        // The checkpoint write blocks (fsync): off the async worker threads.
        let ledger = self.ledger.clone();
        let view = self.view.clone();
        let granted = tokio::task::spawn_blocking(move || {
            ledger.change(|state| state.allocate(&view, &device_ids, unix_now()))
        })
        .await
        .map_err(|e| BackendError::Internal { reason: format!("allocation task failed: {e}") })??;
        Ok(granted)
    }
}
