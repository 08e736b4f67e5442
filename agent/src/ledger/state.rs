//! What the ledger shows: each GPU's state, its health and whether MPS enforces its shares,
//! the records held, each view's availability and device list, and the node's fragmentation.

use super::*;

impl DeviceLedger {
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
    pub(super) fn whole_holder(&self, index: usize, except: &BTreeSet<u64>) -> Option<&Held> {
        let id = self.slots[index].whole.filter(|id| !except.contains(id))?;
        self.held.get(&id).map(|h| &**h)
    }

    pub(super) fn units_held(&self, index: usize, except: &BTreeSet<u64>) -> usize {
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

    /// The shape of an allocation in the FGD measure's terms: a gpu-memory grant of `n` of a
    /// GPU's `U` units takes `1000 n / U` milli-GPU of that one GPU (rounded down, at least 1),
    /// whole GPUs 1000 each.
    pub(super) fn shape_of(&self, parsed: &Parsed) -> TaskShape {
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
}
