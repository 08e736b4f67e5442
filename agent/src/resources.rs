//! The device-plugin adapter: the device ledger served as one extended resource per view.
//! [`NodeResources`] holds the [`DeviceLedger`] behind a mutex, persists it to the checkpoint
//! after every change and publishes each view's device list on a `watch` channel; one
//! [`ViewBackend`] per view implements the device-plugin trait; [`container_response`] turns a
//! [`Grant`] into the kubelet's Allocate answer with the isolation module's help. The only module
//! of the agent that speaks device-plugin types.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use baleen_device_plugin::device::DeviceSnapshot;
use baleen_device_plugin::{
    BackendError, ContainerAllocation, Device, DeviceBackend, DeviceList, Health, Mount,
    PreferredAllocationRequest,
};
use tokio::sync::watch;

use crate::checkpoint::Checkpoint;
use crate::error_chain::Chain;
use crate::isolation::{ContainerSetup, mps};
use crate::ledger::{AllocationRecord, DeviceLedger, DeviceState, Grant, Refusal, View};
use crate::reconcile::{self, KubeletAllocation, Report};

/// Seconds on the boot-time clock (`CLOCK_BOOTTIME`: monotonic, counting suspend, reset at a
/// reboot), the clock of every grant's `allocated_at`: an NTP step of the wall clock cannot
/// shorten the grace of an allocation the kubelet has not listed yet. A checkpoint of another boot
/// is never trusted, so its times are never compared with this boot's.
pub fn boot_seconds() -> u64 {
    nix::time::clock_gettime(nix::time::ClockId::CLOCK_BOOTTIME)
        .map_or(0, |t| u64::try_from(t.tv_sec()).unwrap_or(0))
}
/// How Allocate answers are written beyond what the ledger grants.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ResponseConfig {
    /// CDI device kind (e.g. `nvidia.com/gpu`); when set, Allocate also answers CDI names
    /// `<kind>=<GPU or MIG UUID>`.
    pub cdi_kind: Option<String>,
    /// Where each GPU's MPS daemon keeps its pipe directory.
    pub mps: mps::MpsConfig,
}

/// The kubelet's Allocate answer for one container's grant: the GPUs it sees
/// (`NVIDIA_VISIBLE_DEVICES`, and CDI names when configured) and, for a gpu-memory share, the MPS
/// client setup.
pub fn container_response(grant: &Grant, config: &ResponseConfig) -> ContainerAllocation {
    let mut a = ContainerAllocation::default();
    a.envs.insert("NVIDIA_VISIBLE_DEVICES".into(), grant.visible.join(","));
    if let Some(kind) = &config.cdi_kind {
        a.cdi_devices = grant.visible.iter().map(|v| format!("{kind}={v}")).collect();
    }
    if let Some(share) = &grant.share {
        let ContainerSetup { envs, mounts } = mps::client_setup(&config.mps, share);
        a.envs.extend(envs);
        a.mounts.extend(mounts.into_iter().map(|m| Mount {
            container_path: m.container.display().to_string(),
            host_path: m.host.display().to_string(),
            read_only: m.read_only,
        }));
    }
    a
}

impl From<Refusal> for BackendError {
    fn from(refusal: Refusal) -> Self {
        match refusal {
            Refusal::UnknownDevices { ids } => BackendError::UnknownDevices { ids },
            Refusal::InvalidRequest { ids, reason } => BackendError::InvalidRequest { ids, reason },
            Refusal::Conflict { ids, reason } => BackendError::Conflict { ids, reason },
            Refusal::Exhausted { reason } => BackendError::Exhausted { reason },
        }
    }
}

fn device_list(devices: Vec<DeviceState>) -> Vec<Device> {
    devices
        .into_iter()
        .map(|d| Device {
            id: d.id,
            health: if d.healthy { Health::Healthy } else { Health::Unhealthy },
            numa_node: d.numa_node,
        })
        .collect()
}

/// Whether a change makes an untrusted ledger trusted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Trust {
    /// It does not (an allocation, or a list too old to apply).
    Unchanged,
    /// It was a reconciliation with the kubelet's list.
    Reconciled,
}

struct Inner {
    state: DeviceLedger,
    checkpoint: Checkpoint,
    node: String,
    boot_id: String,
    /// Whether the ledger may be written to the checkpoint: it was restored from a trusted
    /// checkpoint, or reconciled with the kubelet since. An untrusted ledger (after a reboot, a
    /// corrupt or foreign checkpoint) that has not been reconciled knows nothing of the running
    /// containers; writing it would make the next start trust an empty ledger.
    trusted: bool,
    /// Counts the changes of the allocations; a pod-resources list applies only to the
    /// generation it was asked at (see [`NodeResources::reconcile`]).
    generation: u64,
}

/// The node's device ledger shared by every view, persisted on every change.
pub struct NodeResources {
    inner: Mutex<Inner>,
    views: BTreeMap<View, (String, watch::Sender<DeviceSnapshot>)>,
    pod_resources: Option<PathBuf>,
    responses: ResponseConfig,
}

impl NodeResources {
    /// Wraps `state`; every change is written to `checkpoint` for `node` in boot `boot_id`.
    /// `pod_resources` is the kubelet's pod-resources socket, asked before an Allocate replaces
    /// an older allocation of the same resource (`None`: trust the kubelet without asking).
    /// Allocate answers are written with `responses`. `trusted`: `state` was restored from a
    /// trusted checkpoint; if not, nothing is written until the first reconciliation.
    pub fn new(
        state: DeviceLedger,
        checkpoint: Checkpoint,
        node: String,
        boot_id: String,
        pod_resources: Option<PathBuf>,
        responses: ResponseConfig,
        trusted: bool,
    ) -> Arc<Self> {
        let domain = state.config().domain.clone();
        let views = state
            .views()
            .into_iter()
            .map(|v| {
                let (tx, _) =
                    watch::channel(Arc::new(DeviceList::new(device_list(state.devices(&v)))));
                let name = v.resource_name(&domain);
                (v, (name, tx))
            })
            .collect();
        Arc::new(Self {
            inner: Mutex::new(Inner { state, checkpoint, node, boot_id, trusted, generation: 0 }),
            views,
            pod_resources,
            responses,
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
                    resources: self.clone(),
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

    fn publish(&self, state: &DeviceLedger) {
        for (view, (_, tx)) in &self.views {
            let devices = device_list(state.devices(view));
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

    /// Applies `change` (given the ledger and the generation it applies to) to the state; keeps
    /// it only if the checkpoint is written. While the ledger is untrusted nothing is written (see
    /// `Inner::trusted`); an applied reconciliation makes it trusted.
    fn change<T>(
        &self,
        change: impl FnOnce(&mut DeviceLedger, u64) -> Result<(T, Trust), BackendError>,
    ) -> Result<T, BackendError> {
        let mut inner = self.lock();
        let before = inner.state.records();
        let mut next = inner.state.clone();
        let (out, trust) = change(&mut next, inner.generation)?;
        let trusted = inner.trusted || trust == Trust::Reconciled;
        let changed = next.records() != before;
        if trusted && (changed || !inner.trusted) {
            inner
                .checkpoint
                .store(&inner.node, &inner.boot_id, &next.layout(), &next.records())
                .map_err(|e| BackendError::Internal { reason: Chain(&e).to_string() })?;
        }
        inner.trusted = trusted;
        // Kept even when no record changed: the ledger also counts missed listings.
        inner.state = next;
        if changed {
            inner.generation += 1;
            self.publish(&inner.state);
        }
        Ok(out)
    }

    /// The current generation of the allocations: read it before asking pod-resources, and
    /// pass it to [`Self::reconcile`].
    pub fn generation(&self) -> u64 {
        self.lock().generation
    }

    /// Writes the checkpoint now.
    /// Nothing is written while the ledger is untrusted (never reconciled since an untrusted
    /// start); returns whether it was written.
    pub fn persist(&self) -> Result<bool, crate::checkpoint::CheckpointError> {
        let inner = self.lock();
        if !inner.trusted {
            return Ok(false);
        }
        inner.checkpoint.store(
            &inner.node,
            &inner.boot_id,
            &inner.state.layout(),
            &inner.state.records(),
        )?;
        Ok(true)
    }

    /// Whether the ledger is trusted: restored from a trusted checkpoint or reconciled since.
    pub fn is_trusted(&self) -> bool {
        self.lock().trusted
    }

    /// Reconciles with the kubelet's allocations, asked when the allocations were at generation
    /// `asked_at` (see [`reconcile::reconcile`]). A list asked before the latest change may
    /// predate it (an Allocate answered while the list was on its way: restoring an ended pod's
    /// devices over a new grant, or marking a fresh init container's grant as listed), so it is
    /// not applied: `Ok(None)`, and the caller asks again.
    pub fn reconcile(
        &self,
        allocations: &[KubeletAllocation],
        grace_secs: u64,
        asked_at: u64,
    ) -> Result<Option<Report>, BackendError> {
        self.change(|state, generation| {
            if generation != asked_at {
                return Ok((None, Trust::Unchanged));
            }
            let report = reconcile::reconcile(state, allocations, boot_seconds(), grace_secs);
            Ok((Some(report), Trust::Reconciled))
        })
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
    resources: Arc<NodeResources>,
    view: View,
    resource: String,
}

#[async_trait::async_trait]
impl DeviceBackend for ViewBackend {
    fn resource_name(&self) -> &str {
        &self.resource
    }

    fn devices(&self) -> watch::Receiver<DeviceSnapshot> {
        match self.resources.views.get(&self.view) {
            Some((_, tx)) => tx.subscribe(),
            // Backends are made only for the ledger's views.
            None => watch::channel(Arc::new(DeviceList::default())).1,
        }
    }

    async fn preferred_allocation(
        &self,
        request: PreferredAllocationRequest,
    ) -> Result<Vec<String>, BackendError> {
        let inner = self.resources.lock();
        Ok(inner.state.preferred(
            &self.view,
            &request.available,
            &request.must_include,
            request.size,
        )?)
    }

    async fn allocate(
        &self,
        containers: Vec<Vec<String>>,
    ) -> Result<Vec<ContainerAllocation>, BackendError> {
        // Devices of this resource that an older allocation holds, exactly or in part: the
        // kubelet repeats an Allocate only for an init container's devices (which pod-resources
        // does not list) and reassigns only devices whose container ended, but a kubelet that
        // lost its books could hand out devices still in use. Ask its pod-resources list first;
        // if it cannot answer, refuse rather than risk a GPU handed out twice.
        let held: Vec<(usize, Vec<AllocationRecord>)> = {
            let inner = self.resources.lock();
            containers
                .iter()
                .enumerate()
                .map(|(i, ids)| (i, inner.state.sharing_devices(&self.view, ids)))
                .filter(|(_, held)| !held.is_empty())
                .collect()
        };
        if let (Some((first, _)), Some(socket)) = (held.first(), &self.resources.pod_resources) {
            let listed = reconcile::fetch(socket, Duration::from_secs(2)).await.map_err(|e| {
                BackendError::Unavailable {
                    reason: format!(
                        "devices {:?} are held by an earlier allocation and the kubelet's pod-resources API, which says whether its container still runs, cannot be asked ({}); refused rather than risk handing them out twice",
                        containers[*first],
                        Chain(&e)
                    ),
                }
            })?;
            for (i, held) in &held {
                let running = listed.iter().find(|k| {
                    held.iter().any(|r| r.resource == k.resource && r.device_ids == k.device_ids)
                });
                if let Some(k) = running {
                    return Err(BackendError::Conflict {
                        ids: containers[*i].clone(),
                        reason: format!(
                            "the kubelet still lists devices {:?} for running container {}/{}/{}",
                            k.device_ids, k.namespace, k.pod, k.container
                        ),
                    });
                }
            }
        }
        // All containers in one change: a refusal of any leaves the ledger as it was. The
        // checkpoint write blocks (fsync): off the async worker threads.
        let resources = self.resources.clone();
        let view = self.view.clone();
        let grants = tokio::task::spawn_blocking(move || {
            resources.change(|state, _| {
                let now = boot_seconds();
                let grants = containers
                    .iter()
                    .map(|ids| state.allocate(&view, ids, now))
                    .collect::<Result<Vec<Grant>, Refusal>>()?;
                Ok((grants, Trust::Unchanged))
            })
        })
        .await
        .map_err(|e| BackendError::Internal { reason: format!("allocation task failed: {e}") })??;
        Ok(grants.iter().map(|g| container_response(g, &self.resources.responses)).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grants_are_timed_on_the_boot_clock_not_the_wall_clock() {
        // /proc/uptime counts the same clock (seconds since boot, suspend included).
        let uptime: f64 = std::fs::read_to_string("/proc/uptime")
            .expect("/proc/uptime")
            .split_whitespace()
            .next()
            .and_then(|s| s.parse().ok())
            .expect("seconds");
        let now = boot_seconds() as f64;
        assert!((now - uptime).abs() <= 2.0, "boot clock {now} s, uptime {uptime} s");
        let wall = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("after 1970")
            .as_secs() as f64;
        assert!(now < wall / 2.0, "not the wall clock");
    }
}
