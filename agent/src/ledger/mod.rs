//! The agent's device ledger: the node's physical GPUs and every device handed out through any
//! resource view, kept together so that no GPU or unit is ever handed out twice.
//!
//! A GPU serves one mode at a time: whole (the `gpu` and `nvlink-group-<n>` views), shared (the
//! `gpu-memory` view, in memory units) or MIG (the `mig-<profile>` views, fixed by the GPU's MIG
//! mode). [`DeviceLedger`] keeps the allocations of all views together, so that:
//!
//! - device lists mark a device unhealthy while its GPU is taken through another view (or the
//!   GPU is unhealthy), and healthy again when that allocation ends;
//! - an allocation re-checks the ledger and refuses a device whose GPU another view holds; a
//!   repeated allocation of the same IDs in the same view is accepted (init containers), and IDs
//!   of the same view that overlap an older allocation replace it (the kubelet reassigns only
//!   devices whose pod ended, and it never tells the plugin);
//! - preferred choices come from `baleen-scheduler-core` ([`preferred`]).
//!
//! Files by job: this one the types and building the ledger for an inventory; `state` what it
//! shows (GPU states, availability, device lists, fragmentation); `allocate` granting and
//! releasing and each change's [`Delta`]; `restore` the checkpoint's records read back and the
//! parking of allocations on GPUs not readable now; `node_state` the document for the
//! extender; [`preferred`] the preferred choices.
//!
//! Domain values in and out: device IDs ([`device_id`]) and views ([`view`]) in, [`Grant`]s,
//! [`DeviceState`]s and [`Refusal`]s out. It is synchronous, does no I/O and knows nothing of the
//! device-plugin protocol: `crate::resources` wraps it in a mutex, persists every change and
//! turns grants into kubelet answers with `crate::isolation`'s help. (The placement layer below,
//! `baleen_scheduler_core::ledger::NodeLedger`, keeps the GPU shares; this one keeps device IDs.)

mod allocate;
mod claims;
pub mod device_id;
mod node_state;
pub mod preferred;
mod restore;
mod state;
pub mod view;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use baleen_scheduler_core::frag::{self, NodeFree, RecentWorkload, TaskShape};
use baleen_scheduler_core::ledger::{AllocationId, NodeLedger};
use baleen_scheduler_core::model::{GpuDemand, GpuModel, GpuSet, GpuSpec, NodeSpec, Request};
use baleen_scheduler_core::units::{MemMib, MemUnits, MilliCpu, MilliGpu};
use serde::{Deserialize, Serialize};

use crate::inventory::{Gpu, Inventory};

pub use claims::{ClaimBooking, ClaimDevice, ClaimHolder};
pub use device_id::UNIT_SEPARATOR;
use device_id::{group_id, parse_unit_id, unit_id};
pub use view::{View, ViewConfig};

/// Most devices one resource may advertise: a ListAndWatch message of about 70 bytes per device
/// must stay well under the 4 MiB a kubelet's gRPC client accepts.
pub const MAX_DEVICES_PER_RESOURCE: u64 = 32_768;
/// One allocation as the checkpoint stores it: the resource and the device IDs of one container.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct AllocationRecord {
    /// The extended resource name.
    pub resource: String,
    /// The device IDs, sorted.
    pub device_ids: Vec<String>,
    /// When it was granted, in seconds of the boot-time clock (`crate::resources::boot_seconds`);
    /// reconciliation leaves allocations the kubelet has never listed alone for a grace period.
    pub allocated_at: u64,
    /// Whether the kubelet's pod-resources `List` has shown this allocation. Once listed, an
    /// allocation is released when two lists in a row miss it; one never listed (an
    /// ordinary init container's, which `List` omits, or one the kubelet has not recorded yet)
    /// only after the grace period.
    #[serde(default)]
    pub listed: bool,
    /// The container the kubelet's list last showed holding it (`None` until it is listed, and
    /// in checkpoints written before it was kept): whom the Kubernetes API is asked about when a
    /// later list misses it (`crate::reconcile`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub holder: Option<Holder>,
    /// The DRA claim it is booked for (`driver: dra`); `None` for a device-plugin grant.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub claim: Option<ClaimHolder>,
}

/// A pod's container, as the kubelet's pod-resources list names it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Holder {
    /// The pod's namespace.
    pub namespace: String,
    /// The pod's name.
    pub pod: String,
    /// The container's name.
    pub container: String,
}

/// What the device IDs of a ledger mean beyond the inventory's GPUs: recorded with the
/// allocations in the checkpoint, so that a start with another configuration can tell whether
/// the IDs containers hold would change meaning (a unit of another size, a group of other GPUs).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Layout {
    /// The resource domain.
    pub domain: String,
    /// Bytes per gpu-memory unit.
    pub memory_unit_bytes: u64,
    /// The NVLink groups offered, by ID: the UUIDs of their GPUs in index order.
    pub nvlink_groups: BTreeMap<String, Vec<String>>,
}

/// Why the ledger cannot be built for an inventory.
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    /// The gpu-memory unit is zero bytes.
    #[error("invalid node: the gpu-memory unit must be at least one byte")]
    ZeroUnit,
    /// Two GPUs share a UUID.
    #[error("invalid node: GPU {uuid} appears twice")]
    DuplicateGpu {
        /// The UUID.
        uuid: String,
    },
    /// The unit is so small that the gpu-memory device list would not fit in one kubelet message.
    #[error(
        "invalid node: a gpu-memory unit of {unit_bytes} bytes makes {devices} devices; the kubelet \
         takes at most about {MAX_DEVICES_PER_RESOURCE} in one ListAndWatch message (its 4 MiB \
         limit): use a unit of at least {smallest_mib} MiB"
    )]
    TooManyUnits {
        /// The unit.
        unit_bytes: u64,
        /// The devices it would make.
        devices: u64,
        /// The smallest unit that works, in MiB.
        smallest_mib: u64,
    },
    /// More GPUs than a node may have.
    #[error(
        "invalid node: {count} GPUs, more than the {max} one node may have",
        max = baleen_scheduler_core::model::MAX_GPUS_PER_NODE
    )]
    TooManyGpus {
        /// The GPUs found.
        count: usize,
    },
    /// The placement layer refuses the node.
    #[error("invalid node")]
    Placement(#[source] baleen_scheduler_core::ledger::LedgerError),
}

/// Why an allocation or a preferred choice is refused. The ledger is unchanged by a refusal.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// The IDs are not devices of this view.
    #[error("unknown device IDs {}", baleen_device_plugin::backend::shown(ids))]
    UnknownDevices {
        /// The offending IDs.
        ids: Vec<String>,
    },
    /// The IDs cannot go together (units on two GPUs).
    #[error("invalid request for devices {}: {reason}", baleen_device_plugin::backend::shown(ids))]
    InvalidRequest {
        /// The IDs concerned.
        ids: Vec<String>,
        /// What is wrong.
        reason: String,
    },
    /// The devices conflict with the ledger (taken through another view, unhealthy).
    #[error("devices {} cannot be allocated: {reason}", baleen_device_plugin::backend::shown(ids))]
    Conflict {
        /// The IDs concerned.
        ids: Vec<String>,
        /// What they conflict with.
        reason: String,
    },
    /// Not enough free devices to choose from.
    #[error("not enough devices: {reason}")]
    Exhausted {
        /// What ran out.
        reason: String,
    },
}

/// One GPU as the ledger sees it now (for the metrics).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuState {
    /// The GPU.
    pub uuid: String,
    /// Its NVML index.
    pub index: u32,
    /// Its model name.
    pub model: String,
    /// Its memory.
    pub memory_bytes: u64,
    /// Bytes handed out: the whole memory when held whole, else units held times the unit.
    pub granted_bytes: u64,
    /// How it serves now.
    pub mode: GpuMode,
    /// Healthy (no critical XID, the health watch runs).
    pub healthy: bool,
    /// Its shares are enforced (its MPS daemon answers), where that is required.
    pub shares_enforced: bool,
    /// Memory units it offers in all.
    pub units: u32,
    /// Memory units held.
    pub units_held: u32,
}

/// The node's fragmentation now ([`DeviceLedger::fragmentation`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Fragmentation {
    /// Expected free compute a task of the target workload cannot use, in milli-GPU.
    pub milli_gpu: f64,
    /// Free compute in all, in milli-GPU.
    pub free_milli_gpu: u64,
    /// How many allocations the target workload is learned from.
    pub learned_from: usize,
}

/// How a GPU serves now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GpuMode {
    /// Nothing is allocated on it.
    Idle,
    /// Held whole (the `gpu` or an `nvlink-group-<n>` view).
    Exclusive,
    /// Memory units of it are held.
    Shared,
    /// In MIG mode.
    Mig,
}

impl GpuMode {
    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            GpuMode::Idle => "idle",
            GpuMode::Exclusive => "exclusive",
            GpuMode::Shared => "shared",
            GpuMode::Mig => "mig",
        }
    }
}

/// One device of a view as the ledger sees it now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceState {
    /// The device ID.
    pub id: String,
    /// Whether it can be allocated now: its GPU is healthy and not held through another view.
    pub healthy: bool,
    /// NUMA node of its GPU.
    pub numa_node: Option<u32>,
}

/// What one container was granted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grant {
    /// The view it was granted through.
    pub view: View,
    /// The device IDs, sorted.
    pub device_ids: Vec<String>,
    /// What the container must see: the GPUs' UUIDs, or the MIG instances' UUIDs.
    pub visible: Vec<String>,
    /// For a gpu-memory grant: its share of the one GPU.
    pub share: Option<Share>,
}

/// A gpu-memory grant's share of its GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Share {
    /// The GPU.
    pub gpu_uuid: String,
    /// Units granted.
    pub units: u32,
    /// Units the GPU has in all.
    pub gpu_units: u32,
    /// Bytes granted (units times the unit size).
    pub bytes: u64,
}

#[derive(Debug, Clone)]
struct Slot {
    gpu: Arc<Gpu>,
    units: u32,
    healthy: bool,
    /// Whether a share of this GPU is enforced (its MPS daemon answers), where that is
    /// required: its memory units are offered only then.
    shares_enforced: bool,
    /// Per unit, the allocation holding it.
    unit_holder: Vec<Option<u64>>,
    /// How many of `unit_holder` are taken.
    taken: u32,
    /// The allocation holding the GPU whole (gpu or NVLink-group view), if any.
    whole: Option<u64>,
    /// Named by a parked allocation (see [`DeviceLedger::restore_from`]): offered to no one.
    reserved: bool,
}

#[derive(Debug, Clone)]
struct Group {
    size: u32,
    id: String,
    members: GpuSet,
}

#[derive(Debug, Clone)]
struct Held {
    record: AllocationRecord,
    /// Consecutive kubelet listings that did not show this allocation.
    missed: u32,
    view: View,
    gpus: GpuSet,
    units: Vec<(usize, u32)>,
}

/// What a request names, once parsed.
struct Parsed {
    gpus: GpuSet,
    units: Vec<(usize, u32)>,
    groups: Vec<usize>,
}

/// The node's device ledger and its views. See the module documentation.
///
/// Cheap to clone, whatever it holds: what never changes after it is built is shared, and the
/// allocations are persistent maps (`imbl`), so a clone costs a few pointers per GPU. The agent
/// changes a clone and publishes it whole ([`crate::resources`]): a change that fails leaves
/// the published ledger as it was, and readers read a published one without any lock.
#[derive(Debug, Clone)]
pub struct DeviceLedger {
    config: Arc<ViewConfig>,
    slots: Vec<Slot>,
    by_uuid: Arc<HashMap<String, usize>>,
    mig: Arc<HashMap<String, (usize, String)>>,
    groups: Arc<Vec<Group>>,
    group_by_id: Arc<HashMap<String, usize>>,
    ledger: NodeLedger,
    held: imbl::OrdMap<u64, Arc<Held>>,
    /// The allocation holding each device ID (IDs are unique across views).
    by_device: imbl::HashMap<Arc<str>, u64>,
    /// The allocations touched since [`Self::changes_since`] last took them.
    touched: Vec<u64>,
    /// Counts every change of the records (see [`Self::records_version`]).
    records_version: u64,
    next_id: u64,
    /// The shapes of the last allocations: the target workload of [`Self::fragmentation`].
    recent: Arc<RecentWorkload>,
    /// The GPUs the inventory counts but could not read, by UUID where it is known, with why.
    unreadable: Arc<BTreeMap<String, String>>,
    /// Whether any GPU could not be read (with a UUID or without).
    any_unreadable: bool,
    /// The NVIDIA driver's version, as discovery read it (the DRA slices' attribute).
    driver_version: Option<Arc<str>>,
    /// Allocations kept as they are because they name a GPU this start could not read (see
    /// [`Self::restore_from`]).
    parked: Arc<Vec<AllocationRecord>>,
    /// The NVLink groups of parked allocations, as the checkpoint they came from defined them.
    parked_groups: Arc<BTreeMap<String, Vec<String>>>,
}

/// A record's key: its resource and sorted device IDs (one record per key at any time).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RecordKey {
    /// The extended resource name.
    pub resource: String,
    /// The device IDs, sorted.
    pub device_ids: Vec<String>,
}

impl AllocationRecord {
    /// The record's key.
    pub fn key(&self) -> RecordKey {
        RecordKey { resource: self.resource.clone(), device_ids: self.device_ids.clone() }
    }
}

/// What one change did to the records, as the checkpoint's journal keeps it: the keys of the
/// records removed, then the records put (new, or changed under their key). Applied in that
/// order to the records before it, it gives the records after it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Delta {
    /// The records removed.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub removed: Vec<RecordKey>,
    /// The records added or changed.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub put: Vec<AllocationRecord>,
}

impl Delta {
    /// Whether it changes nothing.
    pub fn is_empty(&self) -> bool {
        self.removed.is_empty() && self.put.is_empty()
    }
}

/// A count of units or GPUs as the placement model's `u32`. Counts are bounded by a GPU's units
/// (a `u32`) or by the devices of one request; a count beyond `u32` saturates, which the
/// placement ledger then refuses as over capacity rather than wrapping to a small number.
pub(crate) fn count(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

fn ids_of(ids: &[String]) -> Vec<String> {
    let mut v = ids.to_vec();
    v.sort();
    v
}

impl DeviceLedger {
    /// The ledger for `inventory`, with nothing allocated.
    pub fn new(
        node_name: &str,
        inventory: &Inventory,
        config: ViewConfig,
    ) -> Result<Self, BuildError> {
        if config.memory_unit_bytes == 0 {
            return Err(BuildError::ZeroUnit);
        }
        let mut by_uuid = HashMap::new();
        let mut mig = HashMap::new();
        if inventory.gpus.len() > baleen_scheduler_core::model::MAX_GPUS_PER_NODE {
            return Err(BuildError::TooManyGpus { count: inventory.gpus.len() });
        }
        // The units first, checked before any is allocated (a GPU reported with an absurd
        // memory size must be an error, not a 64 GiB allocation).
        let units_of = |gpu: &crate::inventory::Gpu| {
            if gpu.mig.is_enabled() {
                0
            } else {
                u32::try_from(gpu.memory_bytes / config.memory_unit_bytes).unwrap_or(u32::MAX)
            }
        };
        let total_units: u64 = inventory.gpus.iter().map(|g| u64::from(units_of(g))).sum();
        if total_units > MAX_DEVICES_PER_RESOURCE {
            let memory: u64 = inventory
                .gpus
                .iter()
                .filter(|g| units_of(g) > 0)
                .map(|g| g.memory_bytes)
                .fold(0, u64::saturating_add);
            return Err(BuildError::TooManyUnits {
                unit_bytes: config.memory_unit_bytes,
                devices: total_units,
                smallest_mib: memory.div_ceil(MAX_DEVICES_PER_RESOURCE).div_ceil(1 << 20),
            });
        }
        let mut slots = Vec::with_capacity(inventory.gpus.len());
        for (i, gpu) in inventory.gpus.iter().enumerate() {
            if by_uuid.insert(gpu.uuid.as_str().to_owned(), i).is_some() {
                return Err(BuildError::DuplicateGpu { uuid: gpu.uuid.to_string() });
            }
            for instance in gpu.mig.instances() {
                mig.insert(instance.uuid.as_str().to_owned(), (i, instance.profile.clone()));
            }
            let units = units_of(gpu);
            slots.push(Slot {
                gpu: Arc::new(gpu.clone()),
                units,
                healthy: true,
                shares_enforced: true,
                unit_holder: vec![None; units as usize],
                taken: 0,
                whole: None,
                reserved: false,
            });
        }
        let spec = NodeSpec {
            name: node_name.to_owned(),
            // The kubelet accounts CPU and memory; the ledger only places GPUs.
            cpu: MilliCpu(0),
            memory: MemMib(0),
            gpus: slots
                .iter()
                .map(|s| GpuSpec {
                    memory_units: MemUnits(s.units),
                    numa_node: s.gpu.numa_node,
                    nvlink_peers: s
                        .gpu
                        .nvlink_peers
                        .iter()
                        .filter_map(|p| by_uuid.get(p.as_str()).copied())
                        .collect(),
                    ..GpuSpec::plain(s.gpu.uuid.as_str().to_owned(), GpuModel::new(&s.gpu.name))
                })
                .collect(),
        };
        let ledger = NodeLedger::new(spec).map_err(BuildError::Placement)?;
        let mut state = Self {
            config: Arc::new(config),
            slots,
            by_uuid: Arc::new(by_uuid),
            mig: Arc::new(mig),
            groups: Arc::new(Vec::new()),
            group_by_id: Arc::new(HashMap::new()),
            ledger,
            held: imbl::OrdMap::new(),
            by_device: imbl::HashMap::new(),
            touched: Vec::new(),
            records_version: 0,
            next_id: 1,
            recent: Arc::new(RecentWorkload::default()),
            unreadable: Arc::new(
                inventory
                    .unreadable
                    .iter()
                    .filter_map(|u| Some((u.uuid.as_ref()?.to_string(), u.error.clone())))
                    .collect(),
            ),
            any_unreadable: !inventory.unreadable.is_empty(),
            driver_version: inventory.driver_version.as_deref().map(Arc::from),
            parked: Arc::default(),
            parked_groups: Arc::default(),
        };
        // NVLink groups are numbered over every GPU: with one unreadable they would name other
        // GPUs, so none is offered until every GPU reads (held ones are parked).
        if !state.any_unreadable {
            state.build_groups();
        }
        Ok(state)
    }

    /// NVLink groups per configured size: GPUs in index order, each group the lowest-indexed
    /// ungrouped GPUs all NVLink peers of each other; groups of one size never overlap.
    fn build_groups(&mut self) {
        let spec = self.ledger.spec().clone();
        let (mut groups, mut group_by_id) = (Vec::new(), HashMap::new());
        for &size in &self.config.nvlink_group_sizes {
            if size < 2 {
                continue;
            }
            let mut grouped = GpuSet::EMPTY;
            for seed in 0..self.slots.len() {
                if grouped.contains(seed) || self.slots[seed].gpu.mig.is_enabled() {
                    continue;
                }
                let mut members = vec![seed];
                for cand in seed + 1..self.slots.len() {
                    if members.len() == size as usize {
                        break;
                    }
                    if grouped.contains(cand) || self.slots[cand].gpu.mig.is_enabled() {
                        continue;
                    }
                    if members.iter().all(|&m| spec.gpus[m].nvlink_peers.contains(&cand)) {
                        members.push(cand);
                    }
                }
                if members.len() == size as usize {
                    let set = GpuSet::from_indices(members.iter().copied()).unwrap_or_default();
                    for &m in &members {
                        grouped.insert(m);
                    }
                    let id = group_id(size, self.slots[seed].gpu.uuid.as_str());
                    group_by_id.insert(id.clone(), groups.len());
                    groups.push(Group { size, id, members: set });
                }
            }
        }
        self.groups = Arc::new(groups);
        self.group_by_id = Arc::new(group_by_id);
    }

    /// What this ledger's device IDs mean (see [`Layout`]).
    pub fn layout(&self) -> Layout {
        Layout {
            domain: self.config.domain.clone(),
            memory_unit_bytes: self.config.memory_unit_bytes,
            nvlink_groups: self
                .groups
                .iter()
                .map(|g| {
                    let members =
                        g.members.iter().map(|i| self.slots[i].gpu.uuid.to_string()).collect();
                    (g.id.clone(), members)
                })
                .chain(self.parked_groups.iter().map(|(id, m)| (id.clone(), m.clone())))
                .collect(),
        }
    }

    /// Why `records`, granted under `old`, would not mean the same devices in this ledger: one
    /// line per problem, none if every record reads back exactly. (A record whose IDs no longer
    /// parse, say units of a GPU now in MIG mode, is refused by [`Self::restore`].)
    pub fn meaning_changes(&self, old: &Layout, records: &[AllocationRecord]) -> Vec<String> {
        let now = self.layout();
        let mut problems = Vec::new();
        for r in records.iter().filter(|r| !self.would_park(r, old)) {
            let Some(view) = self.view_for(&r.resource) else {
                problems.push(format!(
                    "{} holds {:?}, but this configuration does not offer {}",
                    r.resource, r.device_ids, r.resource
                ));
                continue;
            };
            match view {
                View::GpuMemory if old.memory_unit_bytes != now.memory_unit_bytes => {
                    problems.push(format!(
                        "{} units {:?} were granted as {} bytes each; the memory unit is now {} bytes",
                        r.resource, r.device_ids, old.memory_unit_bytes, now.memory_unit_bytes
                    ));
                }
                View::NvlinkGroup(_) => {
                    for id in &r.device_ids {
                        let (was, is) = (old.nvlink_groups.get(id), now.nvlink_groups.get(id));
                        if was != is {
                            problems.push(format!(
                                "NVLink group {id} was GPUs {was:?} and would now be {is:?}"
                            ));
                        }
                    }
                }
                _ => {}
            }
        }
        problems
    }

    /// The view configuration.
    pub fn config(&self) -> &ViewConfig {
        &self.config
    }

    /// The views this node offers: whole GPUs and memory units when it has a GPU outside MIG
    /// mode, one view per MIG profile present, one per NVLink group size with a group.
    pub fn views(&self) -> Vec<View> {
        let plain = self.slots.iter().any(|s| !s.gpu.mig.is_enabled());
        let mut views = Vec::new();
        if self.config.whole_gpus && plain {
            views.push(View::Gpu);
        }
        if self.config.gpu_memory && plain {
            views.push(View::GpuMemory);
        }
        if self.config.mig {
            let profiles: BTreeSet<&String> = self.mig.values().map(|(_, p)| p).collect();
            views.extend(profiles.into_iter().map(|p| View::Mig(p.clone())));
        }
        let sizes: BTreeSet<u32> = self.groups.iter().map(|g| g.size).collect();
        views.extend(sizes.into_iter().map(View::NvlinkGroup));
        views
    }

    /// The view serving `resource`, if any.
    pub fn view_for(&self, resource: &str) -> Option<View> {
        self.views().into_iter().find(|v| v.resource_name(&self.config.domain) == resource)
    }

    /// The NVIDIA driver's version, where discovery read one.
    pub fn driver_version(&self) -> Option<&str> {
        self.driver_version.as_deref()
    }

    /// The GPUs of the node.
    pub fn gpus(&self) -> impl Iterator<Item = &Gpu> {
        self.slots.iter().map(|s| &*s.gpu)
    }
}

#[cfg(test)]
mod tests;
