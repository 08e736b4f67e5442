//! The node's one ledger of physical GPUs and every resource view of it.
//!
//! A GPU serves one mode at a time: whole (the `gpu` and `nvlink-group-<n>` views), shared (the
//! `gpu-memory` view, in memory units) or MIG (the `mig-<profile>` views, fixed by the GPU's MIG
//! mode). [`NodeState`] keeps the allocations of all views together, so that:
//!
//! - device lists advertise a device `Unhealthy` while its GPU is taken through another view (or
//!   the GPU is unhealthy), and `Healthy` again when that allocation ends;
//! - Allocate re-checks the ledger and refuses a device whose GPU another view holds; a repeated
//!   Allocate of the same IDs in the same view is accepted (init containers), and IDs of the
//!   same view that overlap an older allocation replace it (the kubelet reassigns only devices
//!   whose pod ended, and it never tells the plugin);
//! - preferred allocations come from `baleen-scheduler-core`: gpu-memory units on the one GPU
//!   that fits tightest (packing), whole GPUs as the best-connected set.
//!
//! Device IDs: a whole GPU is its UUID; a memory unit is `<GPU UUID>::<unit index>`; a MIG
//! instance is its MIG UUID; an NVLink group is `nvlink<n>-<UUID of its first GPU>`.
//!
//! This module is synchronous and does no I/O; the resource backends
//! ([`crate::resources`]) wrap it in a mutex and persist every change.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::path::PathBuf;

use baleen_device_plugin::{BackendError, ContainerAllocation, Device, Health, Mount};
use baleen_scheduler_core::ledger::{AllocationId, NodeLedger};
use baleen_scheduler_core::model::{GpuDemand, GpuModel, GpuSet, GpuSpec, NodeSpec, Request};
use baleen_scheduler_core::node_choice;
use baleen_scheduler_core::units::{MemMib, MemUnits, MilliCpu, MilliGpu};
use serde::{Deserialize, Serialize};

use crate::inventory::{Gpu, Inventory};

/// The separator between a GPU UUID and a unit index in a gpu-memory device ID.
pub const UNIT_SEPARATOR: &str = "::";
/// Most devices one resource may advertise: a ListAndWatch message of about 70 bytes per device
/// must stay well under the 4 MiB a kubelet's gRPC client accepts.
pub const MAX_DEVICES_PER_RESOURCE: u64 = 32_768;
/// Where a gpu-memory container finds its GPU's MPS pipe directory.
pub const MPS_PIPE_IN_CONTAINER: &str = "/run/baleen/mps";

/// How the ledger is offered: resource names, unit size, which views.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ViewConfig {
    /// Resource domain, e.g. `awesome-ai-company.com`.
    pub domain: String,
    /// Bytes of GPU memory per gpu-memory unit (default 1 GiB).
    pub memory_unit_bytes: u64,
    /// Offer whole GPUs (`<domain>/gpu`).
    pub whole_gpus: bool,
    /// Offer memory units (`<domain>/gpu-memory`).
    pub gpu_memory: bool,
    /// Offer MIG instances (`<domain>/mig-<profile>`).
    pub mig: bool,
    /// Sizes of NVLink groups to offer (`<domain>/nvlink-group-<n>`).
    pub nvlink_group_sizes: Vec<u32>,
    /// CDI device kind (e.g. `nvidia.com/gpu`); when set, Allocate also answers CDI names
    /// `<kind>=<GPU or MIG UUID>`.
    pub cdi_kind: Option<String>,
    /// Host directory under which each GPU's MPS daemon has `<GPU UUID>/pipe`.
    pub mps_root: PathBuf,
}

impl Default for ViewConfig {
    fn default() -> Self {
        Self {
            domain: "awesome-ai-company.com".into(),
            memory_unit_bytes: 1 << 30,
            whole_gpus: true,
            gpu_memory: true,
            mig: true,
            nvlink_group_sizes: vec![2, 4, 8],
            cdi_kind: None,
            mps_root: PathBuf::from("/run/baleen/mps"),
        }
    }
}

/// One resource view of the ledger.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum View {
    /// Whole GPUs.
    Gpu,
    /// Memory units of one GPU.
    GpuMemory,
    /// MIG instances of one profile.
    Mig(String),
    /// Groups of `n` NVLink-connected GPUs.
    NvlinkGroup(u32),
}

impl View {
    /// The extended resource name of the view in `domain`.
    pub fn resource_name(&self, domain: &str) -> String {
        match self {
            View::Gpu => format!("{domain}/gpu"),
            View::GpuMemory => format!("{domain}/gpu-memory"),
            View::Mig(profile) => format!("{domain}/mig-{profile}"),
            View::NvlinkGroup(n) => format!("{domain}/nvlink-group-{n}"),
        }
    }

    fn is_whole(&self) -> bool {
        matches!(self, View::Gpu | View::NvlinkGroup(_))
    }
}

impl fmt::Display for View {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            View::Gpu => f.write_str("gpu"),
            View::GpuMemory => f.write_str("gpu-memory"),
            View::Mig(p) => write!(f, "mig-{p}"),
            View::NvlinkGroup(n) => write!(f, "nvlink-group-{n}"),
        }
    }
}

/// One allocation as the checkpoint stores it: the resource and the device IDs of one container.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct AllocationRecord {
    /// The extended resource name.
    pub resource: String,
    /// The device IDs, sorted.
    pub device_ids: Vec<String>,
    /// When it was granted (seconds since the Unix epoch); reconciliation leaves allocations the
    /// kubelet has never listed alone for a grace period.
    pub allocated_at: u64,
    /// Whether the kubelet's pod-resources `List` has shown this allocation. Once listed, an
    /// allocation that disappears from the list is released at once; one never listed (an
    /// ordinary init container's, which `List` omits, or one the kubelet has not recorded yet)
    /// only after the grace period.
    #[serde(default)]
    pub listed: bool,
}

/// Why the node state cannot be built.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    /// The inventory cannot be turned into a ledger.
    #[error("invalid node: {0}")]
    Invalid(String),
}

#[derive(Debug, Clone)]
struct Slot {
    gpu: Gpu,
    units: u32,
    healthy: bool,
    /// Per unit, the allocation holding it.
    unit_holder: Vec<Option<u64>>,
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

/// The node's ledger and its views. See the module documentation.
#[derive(Debug, Clone)]
pub struct NodeState {
    config: ViewConfig,
    slots: Vec<Slot>,
    by_uuid: HashMap<String, usize>,
    mig: HashMap<String, (usize, String)>,
    groups: Vec<Group>,
    group_by_id: HashMap<String, usize>,
    ledger: NodeLedger,
    held: BTreeMap<u64, Held>,
    next_id: u64,
}

fn ids_of(ids: &[String]) -> Vec<String> {
    let mut v = ids.to_vec();
    v.sort();
    v
}

impl NodeState {
    /// The ledger for `inventory`, with nothing allocated.
    pub fn new(
        node_name: &str,
        inventory: &Inventory,
        config: ViewConfig,
    ) -> Result<Self, NodeError> {
        if config.memory_unit_bytes == 0 {
            return Err(NodeError::Invalid("the gpu-memory unit must be at least one byte".into()));
        }
        let mut by_uuid = HashMap::new();
        let mut mig = HashMap::new();
        let mut slots = Vec::with_capacity(inventory.gpus.len());
        for (i, gpu) in inventory.gpus.iter().enumerate() {
            if by_uuid.insert(gpu.uuid.as_str().to_owned(), i).is_some() {
                return Err(NodeError::Invalid(format!("GPU {} appears twice", gpu.uuid)));
            }
            for instance in gpu.mig.instances() {
                mig.insert(instance.uuid.as_str().to_owned(), (i, instance.profile.clone()));
            }
            let units = if gpu.mig.is_enabled() {
                0
            } else {
                u32::try_from(gpu.memory_bytes / config.memory_unit_bytes).unwrap_or(u32::MAX)
            };
            slots.push(Slot {
                gpu: gpu.clone(),
                units,
                healthy: true,
                unit_holder: vec![None; units as usize],
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
        let total_units: u64 = slots.iter().map(|s| u64::from(s.units)).sum();
        if config.gpu_memory && total_units > MAX_DEVICES_PER_RESOURCE {
            let memory: u64 =
                slots.iter().filter(|s| s.units > 0).map(|s| s.gpu.memory_bytes).sum();
            return Err(NodeError::Invalid(format!(
                "a gpu-memory unit of {} bytes makes {total_units} devices; the kubelet takes at most \
                 about {MAX_DEVICES_PER_RESOURCE} in one ListAndWatch message (its 4 MiB limit): \
                 use a unit of at least {} MiB",
                config.memory_unit_bytes,
                memory.div_ceil(MAX_DEVICES_PER_RESOURCE).div_ceil(1 << 20)
            )));
        }
        let ledger = NodeLedger::new(spec).map_err(|e| NodeError::Invalid(e.to_string()))?;
        let mut state = Self {
            config,
            slots,
            by_uuid,
            mig,
            groups: Vec::new(),
            group_by_id: HashMap::new(),
            ledger,
            held: BTreeMap::new(),
            next_id: 1,
        };
        state.build_groups();
        Ok(state)
    }

    /// NVLink groups per configured size: GPUs in index order, each group the lowest-indexed
    /// ungrouped GPUs all NVLink peers of each other; groups of one size never overlap.
    fn build_groups(&mut self) {
        let spec = self.ledger.spec().clone();
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
                    let id = format!("nvlink{size}-{}", self.slots[seed].gpu.uuid);
                    self.group_by_id.insert(id.clone(), self.groups.len());
                    self.groups.push(Group { size, id, members: set });
                }
            }
        }
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
        self.slots.iter().map(|s| &s.gpu)
    }

    /// Memory units allocated on the GPU at `index`.
    pub fn units_taken(&self, index: usize) -> u32 {
        if index < self.slots.len() { self.units_held(index, &BTreeSet::new()) as u32 } else { 0 }
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

    /// The current allocations, in grant order.
    pub fn records(&self) -> Vec<AllocationRecord> {
        self.held.values().map(|h| h.record.clone()).collect()
    }

    /// Per GPU: held whole by which allocation (gpu or nvlink view), and units taken.
    fn whole_holder(&self, index: usize, except: &BTreeSet<u64>) -> Option<&Held> {
        self.held
            .iter()
            .filter(|(id, _)| !except.contains(id))
            .map(|(_, h)| h)
            .find(|h| h.view.is_whole() && h.gpus.contains(index))
    }

    fn units_held(&self, index: usize, except: &BTreeSet<u64>) -> usize {
        self.slots[index]
            .unit_holder
            .iter()
            .filter(|h| h.is_some_and(|id| !except.contains(&id)))
            .count()
    }

    /// The device list of `view`.
    pub fn devices(&self, view: &View) -> Vec<Device> {
        let none = BTreeSet::new();
        let health = |ok: bool| if ok { Health::Healthy } else { Health::Unhealthy };
        let mut out = Vec::new();
        match view {
            View::Gpu => {
                for (i, s) in self.slots.iter().enumerate().filter(|(_, s)| !s.gpu.mig.is_enabled())
                {
                    let other = self.units_held(i, &none) > 0
                        || self.whole_holder(i, &none).is_some_and(|h| h.view != View::Gpu);
                    out.push(Device {
                        id: s.gpu.uuid.to_string(),
                        health: health(s.healthy && !other),
                        numa_node: s.gpu.numa_node,
                    });
                }
            }
            View::GpuMemory => {
                for (i, s) in self.slots.iter().enumerate().filter(|(_, s)| !s.gpu.mig.is_enabled())
                {
                    let ok = s.healthy && self.whole_holder(i, &none).is_none();
                    for unit in 0..s.units {
                        out.push(Device {
                            id: format!("{}{UNIT_SEPARATOR}{unit}", s.gpu.uuid),
                            health: health(ok),
                            numa_node: s.gpu.numa_node,
                        });
                    }
                }
            }
            View::Mig(profile) => {
                for s in &self.slots {
                    for inst in s.gpu.mig.instances().iter().filter(|m| &m.profile == profile) {
                        out.push(Device {
                            id: inst.uuid.to_string(),
                            health: health(s.healthy),
                            numa_node: s.gpu.numa_node,
                        });
                    }
                }
            }
            View::NvlinkGroup(size) => {
                for g in self.groups.iter().filter(|g| g.size == *size) {
                    let ok = g.members.iter().all(|i| {
                        self.slots[i].healthy
                            && self.units_held(i, &none) == 0
                            && self.whole_holder(i, &none).is_none_or(|h| {
                                h.view == *view && h.record.device_ids.contains(&g.id)
                            })
                    });
                    let first = g.members.iter().next().unwrap_or(0);
                    out.push(Device {
                        id: g.id.clone(),
                        health: health(ok),
                        numa_node: self.slots[first].gpu.numa_node,
                    });
                }
            }
        }
        out
    }

    fn parse(&self, view: &View, ids: &[String]) -> Result<Parsed, BackendError> {
        let mut parsed = Parsed { gpus: GpuSet::EMPTY, units: Vec::new(), groups: Vec::new() };
        let mut unknown = Vec::new();
        for id in ids {
            match view {
                View::Gpu => match self.by_uuid.get(id) {
                    Some(&i) if !self.slots[i].gpu.mig.is_enabled() => parsed.gpus.insert(i),
                    _ => unknown.push(id.clone()),
                },
                View::GpuMemory => {
                    let unit = id.rsplit_once(UNIT_SEPARATOR).and_then(|(uuid, n)| {
                        let i = *self.by_uuid.get(uuid)?;
                        let n: u32 = n.parse().ok()?;
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
            return Err(BackendError::UnknownDevices { ids: unknown });
        }
        if *view == View::GpuMemory && parsed.gpus.len() > 1 {
            let gpus: Vec<String> =
                parsed.gpus.iter().map(|i| self.slots[i].gpu.uuid.to_string()).collect();
            return Err(BackendError::InvalidRequest {
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
    pub fn allocate(
        &mut self,
        view: &View,
        ids: &[String],
        now: u64,
    ) -> Result<ContainerAllocation, BackendError> {
        let sorted = ids_of(ids);
        if let Some(h) =
            self.held.values_mut().find(|h| h.view == *view && h.record.device_ids == sorted)
        {
            // A repeated Allocate: an init container's devices reused, or a new pod given exactly
            // the devices of one that ended. The same answer; the allocation counts as new
            // until the kubelet lists it.
            h.record.allocated_at = now;
            h.record.listed = false;
            let h = h.clone();
            return Ok(self.response(&h));
        }
        let parsed = self.parse(view, ids)?;
        // Older allocations of the same view that share a device ended (the kubelet reassigns
        // only freed devices): they are replaced.
        let superseded: BTreeSet<u64> =
            self.replaced_by(view, &sorted).map(|(&id, _)| id).collect();
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
                    memory: MemUnits(parsed.units.len() as u32),
                },
                allowed_models: vec![],
            }),
            View::Gpu | View::NvlinkGroup(_) => Some(Request {
                cpu: MilliCpu(0),
                memory: MemMib(0),
                gpu: GpuDemand::Whole { count: parsed.gpus.len() as u32 },
                allowed_models: vec![],
            }),
            View::Mig(_) => None,
        };
        if let Some(request) = request {
            self.ledger
                .allocate(AllocationId(id), &request, parsed.gpus)
                .map_err(|e| BackendError::Conflict { ids: ids.to_vec(), reason: e.to_string() })?;
        }
        for &(i, n) in &parsed.units {
            self.slots[i].unit_holder[n as usize] = Some(id);
        }
        let held = Held {
            record: AllocationRecord {
                resource: view.resource_name(&self.config.domain),
                device_ids: sorted,
                allocated_at: now,
                listed: false,
            },
            view: view.clone(),
            gpus: parsed.gpus,
            units: parsed.units,
        };
        let response = self.response(&held);
        self.held.insert(id, held);
        Ok(response)
    }

    fn check_conflicts(
        &self,
        view: &View,
        ids: &[String],
        parsed: &Parsed,
        superseded: &BTreeSet<u64>,
    ) -> Result<(), BackendError> {
        let conflict = |reason: String| Err(BackendError::Conflict { ids: ids.to_vec(), reason });
        for i in parsed.gpus.iter() {
            let uuid = &self.slots[i].gpu.uuid;
            if !self.slots[i].healthy {
                return conflict(format!("GPU {uuid} is unhealthy"));
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
        if !matches!(held.view, View::Mig(_)) {
            // Recorded together with `held`, so the ledger knows it.
            let _ = self.ledger.release(AllocationId(id));
        }
        for &(i, n) in &held.units {
            self.slots[i].unit_holder[n as usize] = None;
        }
        Some(held.record)
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

    /// Re-records allocations (from a checkpoint or the kubelet); returns the ones refused,
    /// with why.
    pub fn restore(&mut self, records: &[AllocationRecord]) -> Vec<(AllocationRecord, String)> {
        let mut refused = Vec::new();
        for record in records {
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
                    self.mark_listed(|r| {
                        r.resource == record.resource && r.device_ids == record.device_ids
                    });
                }
                Ok(()) => {}
            }
        }
        refused
    }

    /// Marks the allocations for which `listed` is true as seen in the kubelet's list; returns
    /// how many changed.
    pub fn mark_listed(&mut self, mut listed: impl FnMut(&AllocationRecord) -> bool) -> usize {
        let mut changed = 0;
        for h in self.held.values_mut() {
            if !h.record.listed && listed(&h.record) {
                h.record.listed = true;
                changed += 1;
            }
        }
        changed
    }

    /// Allocations of `view` that share a device with `ids` without being exactly `ids`: the
    /// ones an Allocate of `ids` would replace.
    pub fn overlapping(&self, view: &View, ids: &[String]) -> Vec<AllocationRecord> {
        let sorted = ids_of(ids);
        self.replaced_by(view, &sorted)
            .filter(|(_, h)| h.record.device_ids != sorted)
            .map(|(_, h)| h.record.clone())
            .collect()
    }

    /// Allocations of `view` sharing a device with `sorted` (sorted device IDs).
    fn replaced_by<'a>(
        &'a self,
        view: &'a View,
        sorted: &'a [String],
    ) -> impl Iterator<Item = (&'a u64, &'a Held)> + 'a {
        self.held.iter().filter(move |(_, h)| {
            h.view == *view && h.record.device_ids.iter().any(|d| sorted.binary_search(d).is_ok())
        })
    }

    /// The environment, mounts and CDI devices a container needs for an allocation.
    fn response(&self, held: &Held) -> ContainerAllocation {
        let mut a = ContainerAllocation::default();
        let visible: Vec<String> = match &held.view {
            View::Mig(_) => held.record.device_ids.clone(),
            _ => held.gpus.iter().map(|i| self.slots[i].gpu.uuid.to_string()).collect(),
        };
        a.envs.insert("NVIDIA_VISIBLE_DEVICES".into(), visible.join(","));
        if let Some(kind) = &self.config.cdi_kind {
            a.cdi_devices = visible.iter().map(|v| format!("{kind}={v}")).collect();
        }
        if held.view == View::GpuMemory
            && let Some(i) = held.gpus.iter().next()
        {
            let slot = &self.slots[i];
            let units = held.units.len() as u64;
            let bytes = units * self.config.memory_unit_bytes;
            let percent = ((units * 100 + u64::from(slot.units) / 2)
                / u64::from(slot.units.max(1)))
            .clamp(1, 100);
            a.envs.insert("CUDA_MPS_PIPE_DIRECTORY".into(), MPS_PIPE_IN_CONTAINER.into());
            a.envs.insert("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT".into(), format!("0={}M", bytes >> 20));
            a.envs.insert("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE".into(), percent.to_string());
            a.envs.insert("BALEEN_GPU_MEMORY_LIMIT_BYTES".into(), bytes.to_string());
            a.mounts.push(Mount {
                container_path: MPS_PIPE_IN_CONTAINER.into(),
                host_path: self
                    .config
                    .mps_root
                    .join(slot.gpu.uuid.as_str())
                    .join("pipe")
                    .display()
                    .to_string(),
                read_only: false,
            });
        }
        a
    }

    /// The preferred `size` devices of `view` among `available`, including `must_include`.
    pub fn preferred(
        &self,
        view: &View,
        available: &[String],
        must_include: &[String],
        size: usize,
    ) -> Result<Vec<String>, BackendError> {
        // The kubelet's list may lag behind ours (a device that just became Unhealthy because
        // another view took its GPU): prefer only what we advertise as Healthy now.
        let usable: std::collections::HashSet<String> = self
            .devices(view)
            .into_iter()
            .filter(|d| d.health == Health::Healthy)
            .map(|d| d.id)
            .collect();
        let avail: Vec<String> =
            available.iter().filter(|id| usable.contains(*id)).cloned().collect();
        let must = self.parse(view, must_include)?;
        match view {
            View::GpuMemory => self.preferred_units(&avail, must_include, &must, size),
            View::Gpu => {
                let cands = self.parse(view, &avail)?.gpus;
                let set = node_choice::best_connected(self.ledger.spec(), cands, must.gpus, size)
                    .ok_or_else(|| BackendError::Exhausted {
                    reason: format!("{size} whole GPUs asked, {} available", cands.len()),
                })?;
                Ok(set.iter().map(|i| self.slots[i].gpu.uuid.to_string()).collect())
            }
            View::Mig(_) | View::NvlinkGroup(_) => {
                let mut chosen: Vec<String> = must_include.to_vec();
                let mut rest: Vec<&String> =
                    avail.iter().filter(|id| !chosen.contains(id)).collect();
                rest.sort();
                chosen.extend(rest.into_iter().take(size.saturating_sub(chosen.len())).cloned());
                if chosen.len() < size {
                    return Err(BackendError::Exhausted {
                        reason: format!("{size} devices asked, {} available", avail.len()),
                    });
                }
                Ok(chosen)
            }
        }
    }

    fn preferred_units(
        &self,
        available: &[String],
        must_include: &[String],
        must: &Parsed,
        size: usize,
    ) -> Result<Vec<String>, BackendError> {
        let mut by_gpu: BTreeMap<usize, Vec<u32>> = BTreeMap::new();
        for id in available {
            if let Ok(p) = self.parse(&View::GpuMemory, std::slice::from_ref(id))
                && let Some(&(i, n)) = p.units.first()
            {
                by_gpu.entry(i).or_default().push(n);
            }
        }
        let mut allowed = GpuSet::EMPTY;
        for (&i, units) in &by_gpu {
            if units.len() >= size && (must.gpus.is_empty() || must.gpus.contains(i)) {
                allowed.insert(i);
            }
        }
        let request = Request {
            cpu: MilliCpu(0),
            memory: MemMib(0),
            gpu: GpuDemand::Shared { milli: MilliGpu(0), memory: MemUnits(size as u32) },
            allowed_models: vec![],
        };
        let gpu = node_choice::tightest_shared_gpu(&self.ledger, &request, allowed).or_else(|| {
            // The kubelet offers units the ledger still holds (a pod ended and reconciliation has
            // not caught up): go by what the kubelet offers, tightest first.
            let pick = allowed.iter().min_by_key(|i| (by_gpu[i].len(), *i));
            if let Some(i) = pick {
                tracing::warn!(gpu.uuid = %self.slots[i].gpu.uuid, "ledger and kubelet disagree on free units; preferring by the kubelet's offer");
            }
            pick
        });
        let Some(gpu) = gpu else {
            let largest = by_gpu.iter().max_by_key(|(_, u)| u.len());
            return Err(BackendError::Exhausted {
                reason: match largest {
                    Some((&i, u)) => format!(
                        "no single GPU has {size} free gpu-memory units; the most on one GPU is {} on {}",
                        u.len(),
                        self.slots[i].gpu.uuid
                    ),
                    None => format!(
                        "no single GPU has {size} free gpu-memory units; none are available"
                    ),
                },
            });
        };
        let mut chosen: Vec<String> = must_include.to_vec();
        let mut units = by_gpu[&gpu].clone();
        units.sort_unstable();
        for n in units {
            if chosen.len() >= size {
                break;
            }
            let id = format!("{}{UNIT_SEPARATOR}{n}", self.slots[gpu].gpu.uuid);
            if !chosen.contains(&id) {
                chosen.push(id);
            }
        }
        Ok(chosen)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inventory::GpuInventory;
    use crate::inventory::simulated::SimulatedInventory;

    fn example(name: &str) -> NodeState {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../packaging/examples")
            .join(name);
        let inventory = SimulatedInventory::from_file(&path)
            .expect("example loads")
            .discover()
            .expect("discover");
        NodeState::new("node-a", &inventory, ViewConfig::default()).expect("node state")
    }

    fn uuid(state: &NodeState, i: usize) -> String {
        state.slots[i].gpu.uuid.to_string()
    }

    fn units(state: &NodeState, gpu: usize, range: std::ops::Range<u32>) -> Vec<String> {
        range.map(|n| format!("{}::{n}", uuid(state, gpu))).collect()
    }

    fn healthy(devices: &[Device]) -> usize {
        devices.iter().filter(|d| d.health == Health::Healthy).count()
    }

    fn all_ids(state: &NodeState, view: &View) -> Vec<String> {
        state
            .devices(view)
            .into_iter()
            .filter(|d| d.health == Health::Healthy)
            .map(|d| d.id)
            .collect()
    }

    #[test]
    fn h200_views_and_device_ids() {
        let state = example("h200-8x-nvswitch.yaml");
        assert_eq!(
            state.views(),
            [
                View::Gpu,
                View::GpuMemory,
                View::NvlinkGroup(2),
                View::NvlinkGroup(4),
                View::NvlinkGroup(8)
            ]
        );
        let names: Vec<String> =
            state.views().iter().map(|v| v.resource_name("awesome-ai-company.com")).collect();
        assert!(names.contains(&"awesome-ai-company.com/gpu-memory".to_owned()));
        for name in &names {
            baleen_device_plugin::resource_name::validate(name).expect("valid resource name");
        }
        // 150_754_820_096 bytes = 140.4 GiB: 140 whole units per GPU.
        assert_eq!(state.devices(&View::GpuMemory).len(), 8 * 140);
        assert_eq!(state.devices(&View::Gpu).len(), 8);
        assert_eq!(state.devices(&View::NvlinkGroup(2)).len(), 4);
        assert_eq!(state.devices(&View::NvlinkGroup(4)).len(), 2);
        assert_eq!(state.devices(&View::NvlinkGroup(8)).len(), 1);
        let group = &state.devices(&View::NvlinkGroup(4))[1];
        assert_eq!(group.id, format!("nvlink4-{}", uuid(&state, 4)));
        assert_eq!(state.devices(&View::GpuMemory)[141].id, format!("{}::1", uuid(&state, 1)));
    }

    #[test]
    fn a_unit_too_small_for_the_kubelet_is_refused_with_the_smallest_that_works() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../packaging/examples/h200-8x-nvswitch.yaml");
        let inventory =
            SimulatedInventory::from_file(&path).expect("example").discover().expect("discover");
        let config = ViewConfig { memory_unit_bytes: 16 << 20, ..ViewConfig::default() };
        let err = NodeState::new("n", &inventory, config).expect_err("72k devices");
        assert!(err.to_string().contains("at least 36 MiB"), "{err}");
        let config = ViewConfig { memory_unit_bytes: 36 << 20, ..ViewConfig::default() };
        assert!(NodeState::new("n", &inventory, config).is_ok());
    }

    #[test]
    fn mig_gpus_are_only_in_mig_views() {
        let state = example("a100-4x-mig.yaml");
        assert_eq!(
            state.views(),
            [
                View::Gpu,
                View::GpuMemory,
                View::Mig("1g.10gb".into()),
                View::Mig("3g.40gb".into()),
                View::Mig("7g.80gb".into()),
                View::NvlinkGroup(2)
            ]
        );
        assert_eq!(state.devices(&View::Gpu).len(), 2);
        assert_eq!(state.devices(&View::Mig("1g.10gb".into())).len(), 2);
        assert_eq!(
            state.devices(&View::NvlinkGroup(2)).len(),
            1,
            "only GPUs 0 and 1 are outside MIG"
        );
        let mut state = state;
        let mig = "MIG-6a0d4e1b-2c3f-5a7e-8b9d-0f1e2d3c4b51".to_owned();
        let a = state
            .allocate(&View::Mig("1g.10gb".into()), std::slice::from_ref(&mig), 0)
            .expect("mig allocation");
        assert_eq!(a.envs["NVIDIA_VISIBLE_DEVICES"], mig);
        let err = state
            .allocate(&View::Mig("3g.40gb".into()), std::slice::from_ref(&mig), 0)
            .expect_err("wrong profile");
        assert!(matches!(err, BackendError::UnknownDevices { .. }), "{err}");
    }

    #[test]
    fn memory_units_are_packed_onto_the_tightest_partly_used_gpu() {
        let mut state = example("h200-8x-nvswitch.yaml");
        state.allocate(&View::GpuMemory, &units(&state, 0, 0..40), 0).expect("40 on GPU 0");
        state.allocate(&View::GpuMemory, &units(&state, 1, 0..120), 0).expect("120 on GPU 1");
        let available: Vec<String> = (0..8)
            .flat_map(|g| units(&state, g, 0..140))
            .filter(|id| {
                !id.starts_with(&uuid(&state, 1))
                    || id
                        .rsplit("::")
                        .next()
                        .is_some_and(|n| n.parse::<u32>().is_ok_and(|n| n >= 120))
            })
            .filter(|id| {
                !id.starts_with(&uuid(&state, 0))
                    || id
                        .rsplit("::")
                        .next()
                        .is_some_and(|n| n.parse::<u32>().is_ok_and(|n| n >= 40))
            })
            .collect();
        // 20 free on GPU 1, 100 on GPU 0, 140 on the others.
        let pick = state.preferred(&View::GpuMemory, &available, &[], 16).expect("fits");
        assert_eq!(pick, units(&state, 1, 120..136));
        let pick = state.preferred(&View::GpuMemory, &available, &[], 21).expect("fits");
        assert_eq!(pick, units(&state, 0, 40..61));
        let pick = state.preferred(&View::GpuMemory, &available, &[], 101).expect("fits");
        assert_eq!(pick, units(&state, 2, 0..101));
        let err = state.preferred(&View::GpuMemory, &available, &[], 141).expect_err("too big");
        assert!(err.to_string().contains("no single GPU has 141"), "{err}");
        // A must-include unit pins the GPU.
        let must = units(&state, 3, 5..6);
        let pick = state.preferred(&View::GpuMemory, &available, &must, 3).expect("fits");
        assert_eq!(
            pick,
            [must[0].clone(), format!("{}::0", uuid(&state, 3)), format!("{}::1", uuid(&state, 3))]
        );
    }

    #[test]
    fn a_whole_gpu_hides_its_units_until_released_and_conflicts_are_refused() {
        let mut state = example("h200-8x-nvswitch.yaml");
        let before = healthy(&state.devices(&View::GpuMemory));
        state.allocate(&View::Gpu, &[uuid(&state, 2)], 0).expect("whole GPU 2");
        assert_eq!(healthy(&state.devices(&View::GpuMemory)), before - 140);
        assert!(
            state
                .devices(&View::GpuMemory)
                .iter()
                .filter(|d| d.id.starts_with(&uuid(&state, 2)))
                .all(|d| d.health == Health::Unhealthy)
        );
        assert_eq!(
            healthy(&state.devices(&View::Gpu)),
            8,
            "the gpu view's own allocation stays Healthy"
        );
        assert_eq!(healthy(&state.devices(&View::NvlinkGroup(2))), 3);
        assert_eq!(healthy(&state.devices(&View::NvlinkGroup(8))), 0);

        let err = state
            .allocate(&View::GpuMemory, &units(&state, 2, 0..4), 0)
            .expect_err("GPU 2 is whole");
        assert!(matches!(err, BackendError::Conflict { .. }));
        assert!(
            err.to_string().contains(&uuid(&state, 2)) && err.to_string().contains("held whole"),
            "{err}"
        );

        state.allocate(&View::GpuMemory, &units(&state, 3, 0..4), 0).expect("units on GPU 3");
        let err = state.allocate(&View::Gpu, &[uuid(&state, 3)], 0).expect_err("GPU 3 is shared");
        assert!(err.to_string().contains("4 gpu-memory units"), "{err}");
        assert_eq!(
            healthy(&state.devices(&View::Gpu)),
            7,
            "GPU 3 advertised Unhealthy as a whole GPU"
        );

        let mut split = units(&state, 4, 0..2);
        split.extend(units(&state, 5, 0..2));
        let err = state.allocate(&View::GpuMemory, &split, 0).expect_err("two GPUs");
        assert!(matches!(err, BackendError::InvalidRequest { .. }));
        assert!(err.to_string().contains("on one GPU"), "{err}");

        let released = state.retain(|r| r.resource != "awesome-ai-company.com/gpu");
        assert_eq!(released.len(), 1);
        assert_eq!(healthy(&state.devices(&View::GpuMemory)), before);
        assert_eq!(state.records().len(), 1);
    }

    #[test]
    fn two_containers_never_share_a_unit_and_repeats_are_idempotent() {
        let mut state = example("l4-4x-pcie.yaml");
        let first = units(&state, 0, 0..4);
        let a = state.allocate(&View::GpuMemory, &first, 1).expect("first");
        assert_eq!(a.envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"], "0=4096M");
        assert_eq!(a.envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"], "18", "4 of 22 units");
        assert_eq!(a.mounts[0].container_path, MPS_PIPE_IN_CONTAINER);
        // The init container's units, allocated again: same answer, no second record.
        let again = state.allocate(&View::GpuMemory, &first, 2).expect("repeat");
        assert_eq!(again, a);
        assert_eq!(state.records().len(), 1);
        // The kubelet hands out unit 3 again only after the first pod ended: the old allocation
        // is replaced, never shared.
        state.allocate(&View::GpuMemory, &units(&state, 0, 3..6), 3).expect("reassigned");
        let records = state.records();
        assert_eq!(records.len(), 1);
        assert_eq!(records[0].device_ids, units(&state, 0, 3..6));
        assert_eq!(state.units_taken(0), 3);
        // Preferred allocations never offer held units when the kubelet offers only free ones.
        let available = all_ids(&state, &View::GpuMemory)
            .into_iter()
            .filter(|id| !records[0].device_ids.contains(id))
            .collect::<Vec<_>>();
        let pick = state.preferred(&View::GpuMemory, &available, &[], 2).expect("fits");
        assert!(pick.iter().all(|id| !records[0].device_ids.contains(id)));
    }

    #[test]
    fn whole_gpus_are_chosen_by_connectivity_and_records_restore() {
        let mut state = example("l4-4x-pcie.yaml");
        let all = all_ids(&state, &View::Gpu);
        let pick = state.preferred(&View::Gpu, &all, &[], 2).expect("two GPUs");
        assert_eq!(pick, [uuid(&state, 0), uuid(&state, 1)], "the bridged pair");
        let pick = state.preferred(&View::Gpu, &all, &[uuid(&state, 2)], 2).expect("two GPUs");
        assert_eq!(pick, [uuid(&state, 2), uuid(&state, 3)]);
        state
            .allocate(&View::NvlinkGroup(2), &[format!("nvlink2-{}", uuid(&state, 0))], 5)
            .expect("group");
        state.allocate(&View::GpuMemory, &units(&state, 3, 0..2), 6).expect("units");
        let records = state.records();
        let mut fresh = example("l4-4x-pcie.yaml");
        assert!(fresh.restore(&records).is_empty());
        assert_eq!(fresh.records(), records);
        assert_eq!(
            healthy(&fresh.devices(&View::Gpu)),
            1,
            "GPUs 0 and 1 in a group, 3 shared: only 2 left"
        );
        let refused = fresh.restore(&[AllocationRecord {
            resource: "other.com/gpu".into(),
            device_ids: vec![],
            allocated_at: 0,
            listed: false,
        }]);
        assert_eq!(refused.len(), 1);
    }

    mod properties {
        use super::*;
        use proptest::prelude::*;

        #[derive(Debug, Clone)]
        enum Op {
            Units { gpu: usize, start: u32, count: u32 },
            Whole { gpus: Vec<usize> },
            Group { index: usize },
            Release { pick: usize },
        }

        fn op() -> impl Strategy<Value = Op> {
            prop_oneof![
                4 => (0..4usize, 0..22u32, 1..8u32).prop_map(|(gpu, start, count)| Op::Units { gpu, start, count }),
                2 => proptest::collection::vec(0..4usize, 1..3).prop_map(|gpus| Op::Whole { gpus }),
                1 => (0..2usize).prop_map(|index| Op::Group { index }),
                2 => any::<usize>().prop_map(|pick| Op::Release { pick }),
            ]
        }

        fn check_any(state: &NodeState) -> Result<(), TestCaseError> {
            for r in state.records() {
                prop_assert!(state.view_for(&r.resource).is_some());
            }
            Ok(())
        }

        fn check(state: &NodeState) -> Result<(), TestCaseError> {
            let records = state.records();
            let mut whole: Vec<usize> = Vec::new();
            let mut units: BTreeSet<String> = BTreeSet::new();
            for r in &records {
                let view = state.view_for(&r.resource).expect("a view of the node");
                let parsed = state
                    .parse(&view, &r.device_ids)
                    .map_err(|e| TestCaseError::fail(e.to_string()))?;
                if view.is_whole() {
                    whole.extend(parsed.gpus.iter());
                } else {
                    for id in &r.device_ids {
                        prop_assert!(units.insert(id.clone()), "unit {id} held twice");
                    }
                }
            }
            let mut sorted = whole.clone();
            sorted.sort_unstable();
            sorted.dedup();
            prop_assert_eq!(sorted.len(), whole.len(), "a GPU held whole twice: {:?}", whole);
            for &g in &whole {
                prop_assert_eq!(state.units_taken(g), 0, "GPU {} whole and shared", g);
                let uuid = state.slots[g].gpu.uuid.to_string();
                prop_assert!(
                    state
                        .devices(&View::GpuMemory)
                        .iter()
                        .filter(|d| d.id.starts_with(&uuid))
                        .all(|d| d.health == Health::Unhealthy)
                );
            }
            for g in 0..4 {
                if state.units_taken(g) > 0 {
                    let uuid = state.slots[g].gpu.uuid.to_string();
                    let gpu_device = state.devices(&View::Gpu).into_iter().find(|d| d.id == uuid);
                    prop_assert_eq!(gpu_device.map(|d| d.health), Some(Health::Unhealthy));
                }
            }
            Ok(())
        }

        proptest! {
            #[test]
            fn arbitrary_device_ids_are_refused_not_panicked_on(ids in proptest::collection::vec(".{0,60}", 1..4)) {
                let mut state = example("a100-4x-mig.yaml");
                for view in state.views() {
                    let _ = state.allocate(&view, &ids, 0);
                    let _ = state.preferred(&view, &ids, &ids[..1], ids.len());
                }
                check_any(&state)?;
            }

            #[test]
            fn no_sequence_of_allocations_breaks_exclusivity(ops in proptest::collection::vec(op(), 1..40)) {
                let mut state = example("l4-4x-pcie.yaml");
                let groups: Vec<String> = state.devices(&View::NvlinkGroup(2)).into_iter().map(|d| d.id).collect();
                for (t, op) in ops.into_iter().enumerate() {
                    let before = state.records();
                    let outcome = match op {
                        Op::Units { gpu, start, count } => {
                            let ids = units(&state, gpu, start..(start + count).min(22));
                            state.allocate(&View::GpuMemory, &ids, t as u64)
                        }
                        Op::Whole { gpus } => {
                            let ids: Vec<String> = gpus.iter().map(|&g| uuid(&state, g)).collect();
                            state.allocate(&View::Gpu, &ids, t as u64)
                        }
                        Op::Group { index } => state.allocate(&View::NvlinkGroup(2), &[groups[index].clone()], t as u64),
                        Op::Release { pick } => {
                            if !before.is_empty() {
                                let gone = before[pick % before.len()].clone();
                                state.retain(|r| *r != gone);
                            }
                            Ok(ContainerAllocation::default())
                        }
                    };
                    if outcome.is_err() {
                        prop_assert_eq!(state.records(), before, "a refusal changed the ledger");
                    }
                    check(&state)?;
                }
            }
        }
    }
}
