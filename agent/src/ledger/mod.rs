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
//! Domain values in and out: device IDs ([`device_id`]) and views ([`view`]) in, [`Grant`]s,
//! [`DeviceState`]s and [`Refusal`]s out. It is synchronous, does no I/O and knows nothing of the
//! device-plugin protocol: `crate::resources` wraps it in a mutex, persists every change and
//! turns grants into kubelet answers with `crate::isolation`'s help. (The placement layer below,
//! `baleen_scheduler_core::ledger::NodeLedger`, keeps the GPU shares; this one keeps device IDs.)

pub mod device_id;
mod node_state;
pub mod preferred;
pub mod view;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use baleen_scheduler_core::frag::{self, NodeFree, RecentWorkload, TaskShape};
use baleen_scheduler_core::ledger::{AllocationId, NodeLedger};
use baleen_scheduler_core::model::{GpuDemand, GpuModel, GpuSet, GpuSpec, NodeSpec, Request};
use baleen_scheduler_core::units::{MemMib, MemUnits, MilliCpu, MilliGpu};
use serde::{Deserialize, Serialize};

use crate::inventory::{Gpu, Inventory};

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

    /// The GPUs of the node.
    pub fn gpus(&self) -> impl Iterator<Item = &Gpu> {
        self.slots.iter().map(|s| &*s.gpu)
    }

    /// Every GPU's state now.
    pub fn gpu_states(&self) -> Vec<GpuState> {
        let none = BTreeSet::new();
        self.slots
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let units_held = count(self.units_held(i, &none));
                let whole = self.whole_holder(i, &none).is_some();
                let mode = if s.gpu.mig.is_enabled() {
                    GpuMode::Mig
                } else if whole {
                    GpuMode::Exclusive
                } else if units_held > 0 {
                    GpuMode::Shared
                } else {
                    GpuMode::Idle
                };
                GpuState {
                    uuid: s.gpu.uuid.to_string(),
                    index: s.gpu.index,
                    model: s.gpu.name.clone(),
                    memory_bytes: s.gpu.memory_bytes,
                    granted_bytes: if whole {
                        s.gpu.memory_bytes
                    } else {
                        u64::from(units_held) * self.config.memory_unit_bytes
                    },
                    mode,
                    healthy: s.healthy,
                    shares_enforced: s.shares_enforced,
                    units: s.units,
                    units_held,
                }
            })
            .collect()
    }

    /// Memory units allocated on the GPU at `index`.
    pub fn units_taken(&self, index: usize) -> u32 {
        if index < self.slots.len() { count(self.units_held(index, &BTreeSet::new())) } else { 0 }
    }

    /// From now on, a GPU's memory units are offered only while its shares are enforced (see
    /// [`Self::set_shares_enforced`]); until then, none is.
    pub fn require_enforced_shares(&mut self) {
        for slot in &mut self.slots {
            slot.shares_enforced = false;
        }
    }

    /// Marks whether a GPU's shares are enforced (its MPS daemon answers); returns whether
    /// anything changed.
    pub fn set_shares_enforced(&mut self, uuid: &str, enforced: bool) -> bool {
        match self.by_uuid.get(uuid) {
            Some(&i) if self.slots[i].shares_enforced != enforced => {
                self.slots[i].shares_enforced = enforced;
                true
            }
            _ => false,
        }
    }

    /// The GPUs of a gpu-memory request whose shares are not enforced now (an Allocate of them
    /// would hand out a limit nothing enforces).
    pub fn unenforced(&self, view: &View, ids: &[String]) -> Vec<String> {
        if *view != View::GpuMemory {
            return Vec::new();
        }
        match self.parse(view, ids) {
            Ok(parsed) => parsed
                .gpus
                .iter()
                .filter(|&i| !self.slots[i].shares_enforced)
                .map(|i| self.slots[i].gpu.uuid.to_string())
                .collect(),
            Err(_) => Vec::new(),
        }
    }

    /// The GPUs whose memory units are offered (not in MIG mode), by UUID.
    pub fn shared_gpus(&self) -> Vec<String> {
        self.slots
            .iter()
            .filter(|s| s.units > 0 && self.config.gpu_memory)
            .map(|s| s.gpu.uuid.to_string())
            .collect()
    }

    /// Marks a GPU healthy or not; returns whether anything changed.
    pub fn set_health(&mut self, uuid: &str, healthy: bool) -> bool {
        match self.by_uuid.get(uuid) {
            Some(&i) if self.slots[i].healthy != healthy => {
                self.slots[i].healthy = healthy;
                true
            }
            _ => false,
        }
    }

    /// A number that changes whenever the records do (an allocation made, repeated, released,
    /// listed, or its holder named): telling whether a change changed them without comparing
    /// them all.
    pub fn records_version(&self) -> u64 {
        self.records_version
    }

    /// How many allocations are held.
    pub fn held_count(&self) -> usize {
        self.held.len()
    }

    /// The current allocations, in grant order, then the parked ones.
    pub fn records(&self) -> Vec<AllocationRecord> {
        self.held.values().map(|h| h.record.clone()).chain(self.parked.iter().cloned()).collect()
    }

    /// The allocations parked because they name a GPU this start could not read.
    pub fn parked(&self) -> &[AllocationRecord] {
        &self.parked
    }

    /// Per allocation, per GPU it holds: the bytes of that GPU's memory it was granted (its
    /// units times the unit, or the whole memory; MIG instances their own memory).
    pub fn granted_bytes(&self) -> Vec<(AllocationRecord, String, u64)> {
        let mut out = Vec::new();
        for h in self.held.values() {
            match &h.view {
                View::GpuMemory => {
                    for i in h.gpus.iter() {
                        let units = h.units.iter().filter(|(g, _)| *g == i).count();
                        let bytes = u64::from(count(units)) * self.config.memory_unit_bytes;
                        out.push((h.record.clone(), self.slots[i].gpu.uuid.to_string(), bytes));
                    }
                }
                View::Gpu | View::NvlinkGroup(_) => {
                    for i in h.gpus.iter() {
                        let gpu = &self.slots[i].gpu;
                        out.push((h.record.clone(), gpu.uuid.to_string(), gpu.memory_bytes));
                    }
                }
                View::Mig(_) => {
                    for i in h.gpus.iter() {
                        let gpu = &self.slots[i].gpu;
                        let bytes = gpu
                            .mig
                            .instances()
                            .iter()
                            .filter(|m| h.record.device_ids.iter().any(|d| d == m.uuid.as_str()))
                            .map(|m| m.memory_bytes)
                            .sum();
                        out.push((h.record.clone(), gpu.uuid.to_string(), bytes));
                    }
                }
            }
        }
        out
    }

    /// Per GPU: held whole by which allocation (gpu or nvlink view), and units taken.
    fn whole_holder(&self, index: usize, except: &BTreeSet<u64>) -> Option<&Held> {
        let id = self.slots[index].whole.filter(|id| !except.contains(id))?;
        self.held.get(&id).map(|h| &**h)
    }

    fn units_held(&self, index: usize, except: &BTreeSet<u64>) -> usize {
        let slot = &self.slots[index];
        if except.is_empty() {
            return slot.taken as usize;
        }
        slot.unit_holder.iter().filter(|h| h.is_some_and(|id| !except.contains(&id))).count()
    }

    /// Per device group of `view`, whether its devices can be allocated now, in the order of
    /// [`Self::devices`]: per GPU outside MIG mode (gpu: the GPU; gpu-memory: all its units
    /// alike), per MIG instance, per NVLink group. A device list changes only when this does;
    /// it costs no string, so a change can tell cheaply whether to send the list again.
    pub fn availability(&self, view: &View) -> Vec<bool> {
        let none = BTreeSet::new();
        let plain = || self.slots.iter().enumerate().filter(|(_, s)| !s.gpu.mig.is_enabled());
        match view {
            View::Gpu => plain()
                .map(|(i, s)| {
                    let other = self.units_held(i, &none) > 0
                        || self.whole_holder(i, &none).is_some_and(|h| h.view != View::Gpu);
                    s.healthy && !s.reserved && !other
                })
                .collect(),
            View::GpuMemory => plain()
                .map(|(i, s)| {
                    s.healthy
                        && !s.reserved
                        && s.shares_enforced
                        && self.whole_holder(i, &none).is_none()
                })
                .collect(),
            View::Mig(profile) => self
                .slots
                .iter()
                .flat_map(|s| {
                    s.gpu
                        .mig
                        .instances()
                        .iter()
                        .filter(|m| &m.profile == profile)
                        .map(|_| s.healthy)
                })
                .collect(),
            View::NvlinkGroup(size) => self
                .groups
                .iter()
                .filter(|g| g.size == *size)
                .map(|g| {
                    g.members.iter().all(|i| {
                        self.slots[i].healthy
                            && !self.slots[i].reserved
                            && self.units_held(i, &none) == 0
                            && self.whole_holder(i, &none).is_none_or(|h| {
                                h.view == *view && h.record.device_ids.contains(&g.id)
                            })
                    })
                })
                .collect(),
        }
    }

    /// How many devices `view` lists, and how many of them are healthy (without listing them).
    pub fn device_counts(&self, view: &View) -> (usize, usize) {
        let available = self.availability(view);
        match view {
            View::GpuMemory => {
                let plain = self.slots.iter().filter(|s| !s.gpu.mig.is_enabled());
                plain.zip(&available).fold((0, 0), |(all, ok), (s, &a)| {
                    let units = s.units as usize;
                    (all + units, ok + if a { units } else { 0 })
                })
            }
            _ => (available.len(), available.iter().filter(|&&a| a).count()),
        }
    }

    /// The device list of `view`.
    pub fn devices(&self, view: &View) -> Vec<DeviceState> {
        let available = self.availability(view);
        let mut out = Vec::new();
        let plain = self.slots.iter().filter(|s| !s.gpu.mig.is_enabled());
        match view {
            View::Gpu => {
                for (s, &healthy) in plain.zip(&available) {
                    out.push(DeviceState {
                        id: s.gpu.uuid.to_string(),
                        healthy,
                        numa_node: s.gpu.numa_node,
                    });
                }
            }
            View::GpuMemory => {
                for (s, &healthy) in plain.zip(&available) {
                    for unit in 0..s.units {
                        out.push(DeviceState {
                            id: unit_id(s.gpu.uuid.as_str(), unit),
                            healthy,
                            numa_node: s.gpu.numa_node,
                        });
                    }
                }
            }
            View::Mig(profile) => {
                let instances = self.slots.iter().flat_map(|s| {
                    s.gpu
                        .mig
                        .instances()
                        .iter()
                        .filter(|m| &m.profile == profile)
                        .map(move |m| (s, m))
                });
                for ((s, inst), &healthy) in instances.zip(&available) {
                    out.push(DeviceState {
                        id: inst.uuid.to_string(),
                        healthy,
                        numa_node: s.gpu.numa_node,
                    });
                }
            }
            View::NvlinkGroup(size) => {
                let groups = self.groups.iter().filter(|g| g.size == *size);
                for (g, &healthy) in groups.zip(&available) {
                    let first = g.members.iter().next().unwrap_or(0);
                    out.push(DeviceState {
                        id: g.id.clone(),
                        healthy,
                        numa_node: self.slots[first].gpu.numa_node,
                    });
                }
            }
        }
        out
    }

    fn parse(&self, view: &View, ids: &[String]) -> Result<Parsed, Refusal> {
        let mut parsed = Parsed { gpus: GpuSet::EMPTY, units: Vec::new(), groups: Vec::new() };
        let mut unknown = Vec::new();
        for id in ids {
            match view {
                View::Gpu => match self.by_uuid.get(id) {
                    Some(&i) if !self.slots[i].gpu.mig.is_enabled() => parsed.gpus.insert(i),
                    _ => unknown.push(id.clone()),
                },
                View::GpuMemory => {
                    let unit = parse_unit_id(id).and_then(|(uuid, n)| {
                        let i = *self.by_uuid.get(uuid)?;
                        (n < self.slots[i].units).then_some((i, n))
                    });
                    match unit {
                        Some((i, n)) => {
                            parsed.gpus.insert(i);
                            parsed.units.push((i, n));
                        }
                        None => unknown.push(id.clone()),
                    }
                }
                View::Mig(profile) => match self.mig.get(id) {
                    Some((i, p)) if p == profile => parsed.gpus.insert(*i),
                    _ => unknown.push(id.clone()),
                },
                View::NvlinkGroup(size) => match self.group_by_id.get(id) {
                    Some(&g) if self.groups[g].size == *size => {
                        for i in self.groups[g].members.iter() {
                            parsed.gpus.insert(i);
                        }
                        parsed.groups.push(g);
                    }
                    _ => unknown.push(id.clone()),
                },
            }
        }
        if !unknown.is_empty() {
            return Err(Refusal::UnknownDevices { ids: unknown });
        }
        if *view == View::GpuMemory && parsed.gpus.len() > 1 {
            let gpus: Vec<String> =
                parsed.gpus.iter().map(|i| self.slots[i].gpu.uuid.to_string()).collect();
            return Err(Refusal::InvalidRequest {
                ids: ids.to_vec(),
                reason: format!(
                    "gpu-memory units must all be on one GPU, these are on {}: {}",
                    gpus.len(),
                    gpus.join(", ")
                ),
            });
        }
        Ok(parsed)
    }

    /// Grants one container the devices `ids` of `view`, or refuses with nothing changed.
    pub fn allocate(&mut self, view: &View, ids: &[String], now: u64) -> Result<Grant, Refusal> {
        let sorted = ids_of(ids);
        let repeat =
            sorted.first().and_then(|d| self.by_device.get(d.as_str())).copied().filter(|id| {
                self.held.get(id).is_some_and(|h| h.view == *view && h.record.device_ids == sorted)
            });
        if let Some(id) = repeat
            && let Some(h) = self.held.get_mut(&id)
        {
            // A repeated Allocate: an init container's devices reused, or a new pod given exactly
            // the devices of one that ended. The same answer; the allocation counts as new
            // until the kubelet lists it.
            let h = Arc::make_mut(h);
            h.record.allocated_at = now;
            h.record.listed = false;
            h.missed = 0;
            let h = h.clone();
            self.records_version += 1;
            self.touched.push(id);
            return Ok(self.grant(&h));
        }
        let parsed = self.parse(view, ids)?;
        // Older allocations of the same view that share a device ended (the kubelet reassigns
        // only freed devices): they are replaced.
        let superseded: BTreeSet<u64> =
            self.replaced_by(view, &sorted).into_iter().map(|(id, _)| id).collect();
        self.check_conflicts(view, ids, &parsed, &superseded)?;
        for id in &superseded {
            self.release_id(*id);
        }
        let id = self.next_id;
        self.next_id += 1;
        let request = match view {
            View::GpuMemory => Some(Request {
                cpu: MilliCpu(0),
                memory: MemMib(0),
                gpu: GpuDemand::Shared {
                    milli: MilliGpu(0),
                    memory: MemUnits(count(parsed.units.len())),
                },
                allowed_models: vec![],
            }),
            View::Gpu | View::NvlinkGroup(_) => Some(Request {
                cpu: MilliCpu(0),
                memory: MemMib(0),
                gpu: GpuDemand::Whole { count: count(parsed.gpus.len()) },
                allowed_models: vec![],
            }),
            View::Mig(_) => None,
        };
        if let Some(request) = request {
            self.ledger
                .allocate(AllocationId(id), &request, parsed.gpus)
                .map_err(|e| Refusal::Conflict { ids: ids.to_vec(), reason: e.to_string() })?;
            let shape = self.shape_of(&parsed);
            Arc::make_mut(&mut self.recent).record(shape);
        }
        for &(i, n) in &parsed.units {
            let slot = &mut self.slots[i];
            slot.unit_holder[n as usize] = Some(id);
            slot.taken += 1;
        }
        if view.is_whole() {
            for i in parsed.gpus.iter() {
                self.slots[i].whole = Some(id);
            }
        }
        let held = Held {
            missed: 0,
            record: AllocationRecord {
                resource: view.resource_name(&self.config.domain),
                device_ids: sorted,
                allocated_at: now,
                listed: false,
                holder: None,
            },
            view: view.clone(),
            gpus: parsed.gpus,
            units: parsed.units,
        };
        let grant = self.grant(&held);
        for d in &held.record.device_ids {
            self.by_device.insert(Arc::from(d.as_str()), id);
        }
        self.held.insert(id, Arc::new(held));
        self.records_version += 1;
        self.touched.push(id);
        Ok(grant)
    }

    /// The shape of an allocation in the FGD measure's terms: a gpu-memory grant of `n` of a
    /// GPU's `U` units takes `1000 n / U` milli-GPU of that one GPU (rounded down, at least 1),
    /// whole GPUs 1000 each.
    fn shape_of(&self, parsed: &Parsed) -> TaskShape {
        let (milli, count) = match parsed.units.first() {
            Some(&(i, _)) => {
                let of = u64::from(self.slots[i].units.max(1));
                let n = parsed.units.len() as u64;
                (u32::try_from((1000 * n / of).clamp(1, 1000)).unwrap_or(1000), 1)
            }
            None => (1000, count(parsed.gpus.len())),
        };
        TaskShape {
            cpu: MilliCpu(0),
            milli_per_gpu: MilliGpu(milli),
            gpu_count: count,
            models: vec![],
            memory: None,
        }
    }

    /// The node's fragmentation by the FGD measure (`baleen_scheduler_core::frag`), against a
    /// target workload learned from the last [`RecentWorkload::DEFAULT_WINDOW`] allocations of
    /// this ledger (gpu-memory and whole-GPU views; restored allocations count): the expected
    /// free GPU compute, in milli-GPU, that a task drawn from that workload could not use.
    /// A GPU's free compute is `1000 x free units / units`, 0 when it is held whole, in MIG
    /// mode or unhealthy. CPU and memory are the kubelet's and are not looked at.
    pub fn fragmentation(&self) -> Fragmentation {
        let free: Vec<u32> = (0..self.slots.len()).map(|i| self.free_milli(i)).collect();
        let target = self.recent.target();
        let node =
            NodeFree { cpu: MilliCpu(u64::MAX), memory: MemMib(u64::MAX), gpus: free.as_slice() };
        Fragmentation {
            milli_gpu: frag::node_fragment(&target, self.ledger.spec(), &node),
            free_milli_gpu: free.iter().map(|&f| u64::from(f)).sum(),
            learned_from: self.recent.len(),
        }
    }

    fn check_conflicts(
        &self,
        view: &View,
        ids: &[String],
        parsed: &Parsed,
        superseded: &BTreeSet<u64>,
    ) -> Result<(), Refusal> {
        let conflict = |reason: String| Err(Refusal::Conflict { ids: ids.to_vec(), reason });
        for i in parsed.gpus.iter() {
            let uuid = &self.slots[i].gpu.uuid;
            if !self.slots[i].healthy {
                return conflict(format!("GPU {uuid} is unhealthy"));
            }
            if self.slots[i].reserved {
                return conflict(format!(
                    "GPU {uuid} is held by an allocation that also names a GPU NVML cannot read"
                ));
            }
            if matches!(view, View::Mig(_)) {
                continue;
            }
            if let Some(h) = self.whole_holder(i, superseded) {
                return conflict(format!(
                    "GPU {uuid} is held whole through {} ({})",
                    h.record.resource,
                    h.record.device_ids.join(",")
                ));
            }
            if view.is_whole() {
                let units = self.units_held(i, superseded);
                if units > 0 {
                    return conflict(format!(
                        "GPU {uuid} is shared: {units} gpu-memory units are allocated on it through {}",
                        View::GpuMemory.resource_name(&self.config.domain)
                    ));
                }
            }
        }
        if let View::GpuMemory = view {
            for &(i, n) in &parsed.units {
                if let Some(holder) =
                    self.slots[i].unit_holder[n as usize].filter(|id| !superseded.contains(id))
                {
                    return conflict(format!(
                        "unit {n} of GPU {} is held by another allocation ({holder})",
                        self.slots[i].gpu.uuid
                    ));
                }
            }
        }
        Ok(())
    }

    fn release_id(&mut self, id: u64) -> Option<AllocationRecord> {
        let held = self.held.remove(&id)?;
        self.records_version += 1;
        self.touched.push(id);
        if !matches!(held.view, View::Mig(_)) {
            // Recorded together with `held`, so the ledger knows it.
            let _ = self.ledger.release(AllocationId(id));
        }
        for &(i, n) in &held.units {
            let slot = &mut self.slots[i];
            if slot.unit_holder[n as usize].take().is_some() {
                slot.taken = slot.taken.saturating_sub(1);
            }
        }
        for i in held.gpus.iter() {
            if self.slots[i].whole == Some(id) {
                self.slots[i].whole = None;
            }
        }
        for d in &held.record.device_ids {
            if self.by_device.get(d.as_str()) == Some(&id) {
                self.by_device.remove(d.as_str());
            }
        }
        Some(Arc::unwrap_or_clone(held).record)
    }

    /// Releases every allocation for which `keep` is false; returns them.
    pub fn retain(
        &mut self,
        mut keep: impl FnMut(&AllocationRecord) -> bool,
    ) -> Vec<AllocationRecord> {
        let gone: Vec<u64> =
            self.held.iter().filter(|(_, h)| !keep(&h.record)).map(|(&id, _)| id).collect();
        gone.into_iter().filter_map(|id| self.release_id(id)).collect()
    }

    /// Applies one listing of the kubelet's: an allocation `shown` is in it has its consecutive
    /// misses reset; every other one counts one more and is released if `release(record,
    /// misses)` says so. Returns the released allocations.
    pub fn note_listing(
        &mut self,
        mut shown: impl FnMut(&AllocationRecord) -> bool,
        mut release: impl FnMut(&AllocationRecord, u32) -> bool,
    ) -> Vec<AllocationRecord> {
        let mut gone = Vec::new();
        let mut missed = Vec::new();
        for (&id, h) in &self.held {
            if shown(&h.record) {
                if h.missed != 0 {
                    missed.push((id, 0));
                }
                continue;
            }
            let n = h.missed.saturating_add(1);
            missed.push((id, n));
            if release(&h.record, n) {
                gone.push(id);
            }
        }
        // Only the counts that change are written: a shared allocation is copied on write.
        for (id, n) in missed {
            if let Some(h) = self.held.get_mut(&id) {
                Arc::make_mut(h).missed = n;
            }
        }
        gone.into_iter().filter_map(|id| self.release_id(id)).collect()
    }

    /// Whether `record` (granted under `layout`) is parked rather than restored: while a GPU
    /// cannot be read, a record that names it (a unit of it, it whole, an NVLink group of it
    /// under `layout`), that needs a view this start does not offer (NVLink groups are not
    /// offered then), or whose devices this ledger does not know (a MIG instance of the
    /// unreadable GPU cannot be told).
    fn would_park(&self, record: &AllocationRecord, layout: &Layout) -> bool {
        if !self.any_unreadable {
            return false;
        }
        let Some(view) = self.view_for(&record.resource) else { return true };
        record.device_ids.iter().any(|id| {
            let gpu = parse_unit_id(id).map_or(id.as_str(), |(uuid, _)| uuid);
            let members = layout.nvlink_groups.get(id).into_iter().flatten();
            self.unreadable.contains_key(gpu)
                || members.into_iter().any(|m| self.unreadable.contains_key(m))
        }) || self.parse(&view, &record.device_ids).is_err()
    }

    /// Parks `record` (granted under `layout`): kept as it is, in every checkpoint, never
    /// released, and every readable GPU it names reserved (offered to no one), until a start
    /// that reads every GPU restores it. What it holds of the unreadable GPU is not offered
    /// anyway: that GPU is not in the ledger.
    fn park(&mut self, record: &AllocationRecord, layout: &Layout) {
        let mut named: Vec<String> = Vec::new();
        for id in &record.device_ids {
            if let Some((uuid, _)) = parse_unit_id(id) {
                named.push(uuid.to_owned());
            } else if let Some(members) = layout.nvlink_groups.get(id) {
                named.extend(members.iter().cloned());
                Arc::make_mut(&mut self.parked_groups).insert(id.clone(), members.clone());
            } else if let Some((_, first)) =
                id.split_once('-').filter(|(kind, _)| kind.starts_with("nvlink"))
            {
                // An NVLink group without its layout: its ID names its first GPU.
                named.push(first.to_owned());
            } else {
                named.push(id.clone());
            }
        }
        for uuid in named {
            if let Some(&i) = self.by_uuid.get(&uuid) {
                self.slots[i].reserved = true;
            }
        }
        tracing::warn!(
            resource = record.resource,
            devices = ?record.device_ids,
            "allocation parked: it names a GPU NVML cannot read; it stays held, and every GPU it names stays unoffered, until a start that reads every GPU"
        );
        Arc::make_mut(&mut self.parked).push(record.clone());
        self.records_version += 1;
    }

    /// Restores the allocations of a checkpoint written under `layout` (see [`Self::restore`]),
    /// parking those that name a GPU this start could not read (kept held as they are); returns the
    /// ones refused, with why.
    pub fn restore_from(
        &mut self,
        records: &[AllocationRecord],
        layout: &Layout,
    ) -> Vec<(AllocationRecord, String)> {
        let (parked, rest): (Vec<&AllocationRecord>, Vec<&AllocationRecord>) =
            records.iter().partition(|r| self.would_park(r, layout));
        for r in parked {
            self.park(r, layout);
        }
        let rest: Vec<AllocationRecord> = rest.into_iter().cloned().collect();
        self.restore(&rest)
    }

    /// Re-records allocations (from a checkpoint or the kubelet); returns the ones refused,
    /// with why. While a GPU cannot be read, a record the kubelet lists that names it is parked
    /// instead (see [`Self::restore_from`]; no layout: an NVLink group's members are unknown then, and
    /// only its first GPU, named in its ID, is reserved).
    pub fn restore(&mut self, records: &[AllocationRecord]) -> Vec<(AllocationRecord, String)> {
        let mut refused = Vec::new();
        let unknown = Layout::default();
        for record in records {
            if self.would_park(record, &unknown) {
                if !self.parked.iter().any(|p| p.key() == record.key()) {
                    self.park(record, &unknown);
                }
                continue;
            }
            let outcome = match self.view_for(&record.resource) {
                None => Err(format!("this node does not offer {}", record.resource)),
                Some(view) => self
                    .allocate(&view, &record.device_ids, record.allocated_at)
                    .map(drop)
                    .map_err(|e| e.to_string()),
            };
            match outcome {
                Err(why) => refused.push((record.clone(), why)),
                Ok(()) if record.listed => {
                    let same = |r: &AllocationRecord| {
                        r.resource == record.resource && r.device_ids == record.device_ids
                    };
                    self.mark_listed(same);
                    self.set_holders(|r| record.holder.clone().filter(|_| same(r)));
                }
                Ok(()) => {}
            }
        }
        refused
    }

    /// Marks the allocations for which `listed` is true as seen in the kubelet's list; returns
    /// how many changed.
    pub fn mark_listed(&mut self, mut listed: impl FnMut(&AllocationRecord) -> bool) -> usize {
        let ids: Vec<u64> = self
            .held
            .iter()
            .filter(|(_, h)| !h.record.listed && listed(&h.record))
            .map(|(&id, _)| id)
            .collect();
        for &id in &ids {
            if let Some(h) = self.held.get_mut(&id) {
                Arc::make_mut(h).record.listed = true;
            }
        }
        self.records_version += ids.len() as u64;
        self.touched.extend_from_slice(&ids);
        ids.len()
    }

    /// Records the holder `holder_of` names for each allocation (`None`: left as it is); how many
    /// changed (each a change for the checkpoint).
    pub fn set_holders(
        &mut self,
        mut holder_of: impl FnMut(&AllocationRecord) -> Option<Holder>,
    ) -> usize {
        let changes: Vec<(u64, Holder)> = self
            .held
            .iter()
            .filter_map(|(&id, h)| {
                let holder = holder_of(&h.record)?;
                (h.record.holder.as_ref() != Some(&holder)).then_some((id, holder))
            })
            .collect();
        let changed = changes.len();
        for (id, holder) in changes {
            if let Some(h) = self.held.get_mut(&id) {
                Arc::make_mut(h).record.holder = Some(holder);
                self.touched.push(id);
            }
        }
        self.records_version += changed as u64;
        changed
    }

    /// Allocations of `view` that share a device with `ids`, an exact repeat of `ids` included:
    /// the ones an Allocate of `ids` would replace or repeat. Before granting such an Allocate
    /// the adapter asks the kubelet whether their containers still run.
    pub fn sharing_devices(&self, view: &View, ids: &[String]) -> Vec<AllocationRecord> {
        let sorted = ids_of(ids);
        self.replaced_by(view, &sorted).into_iter().map(|(_, h)| h.record.clone()).collect()
    }

    /// Allocations of `view` sharing a device with `sorted` (sorted device IDs), by ID: looked
    /// up per device, never a scan of the allocations.
    fn replaced_by(&self, view: &View, sorted: &[String]) -> Vec<(u64, &Held)> {
        let ids: BTreeSet<u64> =
            sorted.iter().filter_map(|d| self.by_device.get(d.as_str()).copied()).collect();
        ids.into_iter()
            .filter_map(|id| self.held.get(&id).map(|h| (id, &**h)))
            .filter(|(_, h)| h.view == *view)
            .collect()
    }

    /// What the allocations touched since the last call became, against `before` (the ledger
    /// this one was cloned from): the change the checkpoint's journal records. Takes them: the
    /// next call starts afresh.
    pub fn changes_since(&mut self, before: &DeviceLedger) -> Delta {
        let mut touched = std::mem::take(&mut self.touched);
        touched.sort_unstable();
        touched.dedup();
        let mut delta = Delta::default();
        // Parked allocations are only ever added.
        delta.put.extend(self.parked.iter().skip(before.parked.len()).cloned());
        for id in touched {
            match (before.held.get(&id), self.held.get(&id)) {
                (Some(old), None) => delta.removed.push(old.record.key()),
                (None, Some(new)) => delta.put.push(new.record.clone()),
                (Some(old), Some(new)) if old.record != new.record => {
                    delta.put.push(new.record.clone());
                }
                _ => {}
            }
        }
        delta
    }

    /// Forgets the allocations touched so far (a ledger restored before it is first published).
    pub fn forget_changes(&mut self) {
        self.touched.clear();
    }

    /// What an allocation grants, as the isolation module and the kubelet adapter need it.
    fn grant(&self, held: &Held) -> Grant {
        let visible: Vec<String> = match &held.view {
            View::Mig(_) => held.record.device_ids.clone(),
            _ => held.gpus.iter().map(|i| self.slots[i].gpu.uuid.to_string()).collect(),
        };
        let share = match (&held.view, held.gpus.iter().next()) {
            (View::GpuMemory, Some(i)) => {
                let units = count(held.units.len());
                Some(Share {
                    gpu_uuid: self.slots[i].gpu.uuid.to_string(),
                    units,
                    gpu_units: self.slots[i].units,
                    bytes: u64::from(units) * self.config.memory_unit_bytes,
                })
            }
            _ => None,
        };
        Grant {
            view: held.view.clone(),
            device_ids: held.record.device_ids.clone(),
            visible,
            share,
        }
    }
}

#[cfg(test)]
mod tests;
