//! The ledger's preferred choice for the kubelet's GetPreferredAllocation: gpu-memory units on
//! the one GPU that fits tightest (packing, from `baleen-scheduler-core`), whole GPUs as the
//! best-connected set, MIG instances and NVLink groups in ID order (whether enough of them can
//! be given: `scheduler_core::capacity`, the extender's rule). A preference only: Allocate
//! re-checks everything.

use std::collections::BTreeMap;

use baleen_scheduler_core::capacity::{Ask, Capacity, GpuCap, Group};
use baleen_scheduler_core::model::{GpuDemand, GpuSet, Request};
use baleen_scheduler_core::node_choice;
use baleen_scheduler_core::units::{MemMib, MemUnits, MilliCpu, MilliGpu};

use super::device_id::unit_id;
use super::{DeviceLedger, Parsed, Refusal, View};

impl DeviceLedger {
    /// The preferred `size` devices of `view` among `available`, including `must_include`.
    pub fn preferred(
        &self,
        view: &View,
        available: &[String],
        must_include: &[String],
        size: usize,
    ) -> Result<Vec<String>, Refusal> {
        // The kubelet's list may lag behind ours (a device that just became Unhealthy because
        // another view took its GPU): prefer only what we advertise as Healthy now.
        let usable: std::collections::HashSet<String> =
            self.devices(view).into_iter().filter(|d| d.healthy).map(|d| d.id).collect();
        let avail: Vec<String> =
            available.iter().filter(|id| usable.contains(*id)).cloned().collect();
        let must = self.parse(view, must_include)?;
        match view {
            View::GpuMemory => self.preferred_units(&avail, must_include, &must, size),
            View::Gpu => {
                let cands = self.parse(view, &avail)?.gpus;
                let set = node_choice::best_connected(self.ledger.spec(), cands, must.gpus, size)
                    .ok_or_else(|| Refusal::Exhausted {
                    reason: format!("{size} whole GPUs asked, {} available", cands.len()),
                })?;
                Ok(set.iter().map(|i| self.slots[i].gpu.uuid.to_string()).collect())
            }
            View::Mig(profile) => {
                let ask = Ask::Mig(profile.clone(), u32::try_from(size).unwrap_or(u32::MAX));
                self.preferred_in_id_order(view, ask, &avail, must_include, size)
            }
            View::NvlinkGroup(group) => {
                let ask = Ask::NvlinkGroups(*group, u32::try_from(size).unwrap_or(u32::MAX));
                self.preferred_in_id_order(view, ask, &avail, must_include, size)
            }
        }
    }

    /// `must_include`, then the rest of `avail` in ID order, `size` in all; whether `ask` (those
    /// `size` devices of `view`) can be given among them is scheduler-core's rule, the one the
    /// extender's filter asks of the state this ledger publishes.
    fn preferred_in_id_order(
        &self,
        view: &View,
        ask: Ask,
        avail: &[String],
        must_include: &[String],
        size: usize,
    ) -> Result<Vec<String>, Refusal> {
        let mut chosen: Vec<String> = must_include.to_vec();
        let mut rest: Vec<&String> = avail.iter().filter(|id| !chosen.contains(id)).collect();
        rest.sort();
        chosen.extend(rest.into_iter().cloned());
        self.capacity_among(view, &chosen)
            .take(&ask)
            .map_err(|reason| Refusal::Exhausted { reason })?;
        chosen.truncate(size.max(must_include.len()));
        if chosen.len() < size {
            return Err(Refusal::Exhausted {
                reason: format!("{size} devices asked, {} available", avail.len()),
            });
        }
        Ok(chosen)
    }

    /// What `candidates` (device IDs of `view`, a MIG profile or an NVLink group size) can
    /// give, in scheduler-core's capacity model: the MIG instances among them on each GPU, or
    /// which of the node's groups of that size are among them.
    fn capacity_among(&self, view: &View, candidates: &[String]) -> Capacity {
        let none = || GpuCap { units_free: 0, shares: false, whole: false, mig: BTreeMap::new() };
        let mut gpus: Vec<GpuCap> = (0..self.slots.len()).map(|_| none()).collect();
        let mut groups = Vec::new();
        match view {
            View::Mig(profile) => {
                for id in candidates {
                    if let Ok(p) = self.parse(view, std::slice::from_ref(id)) {
                        for i in p.gpus.iter() {
                            *gpus[i].mig.entry(profile.clone()).or_insert(0) += 1;
                        }
                    }
                }
            }
            View::NvlinkGroup(size) => {
                for g in self.groups.iter().filter(|g| g.size == *size) {
                    groups.push(Group {
                        size: g.size,
                        gpus: g.members.iter().collect(),
                        free: candidates.contains(&g.id),
                    });
                }
            }
            View::Gpu | View::GpuMemory => {}
        }
        Capacity::new(gpus, groups)
    }

    fn preferred_units(
        &self,
        available: &[String],
        must_include: &[String],
        must: &Parsed,
        size: usize,
    ) -> Result<Vec<String>, Refusal> {
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
            gpu: GpuDemand::Shared { milli: MilliGpu(0), memory: MemUnits(super::count(size)) },
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
            return Err(Refusal::Exhausted {
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
            let id = unit_id(self.slots[gpu].gpu.uuid.as_str(), n);
            if !chosen.contains(&id) {
                chosen.push(id);
            }
        }
        Ok(chosen)
    }
}
