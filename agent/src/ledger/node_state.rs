//! The ledger as the node-state document that the agent publishes for cluster-wide placement
//! (`baleen_k8s::gpu_state`, docs/gpu-state.md): per GPU what is free and who holds
//! it, per MIG instance and NVLink group whether it is free.

use std::collections::{BTreeMap, BTreeSet};

use baleen_k8s::gpu_state::{
    self, GpuEntry, GpuMode as StateMode, MigEntry, NodeGpuState, NvlinkGroupEntry, UnnamedGrant,
};

use super::{AllocationRecord, DeviceLedger, View, count};

impl DeviceLedger {
    /// Free compute of the GPU at `index` in thousandths: `1000 x free units / units`, 0 when
    /// held whole, in MIG mode or unhealthy (what fragmentation and the node state count).
    pub(super) fn free_milli(&self, index: usize) -> u32 {
        let none = BTreeSet::new();
        let s = &self.slots[index];
        if s.gpu.mig.is_enabled() || !s.healthy || self.whole_holder(index, &none).is_some() {
            return 0;
        }
        let units = u64::from(s.units.max(1));
        let free = units.saturating_sub(self.units_held(index, &none) as u64);
        u32::try_from(1000 * free / units).unwrap_or(1000)
    }

    /// The node-state document of node `node` at allocation generation `generation`;
    /// `holder` names the pod (`namespace/name`) of an allocation the kubelet has listed. A DRA
    /// claim's devices are named by the pod the claim was prepared for (the kubelet's
    /// pod-resources list never shows them), so that the extender, which judges claim pods
    /// too, matches them with the pods it sees bound.
    pub fn node_state(
        &self,
        node: &str,
        generation: u64,
        holder: impl Fn(&AllocationRecord) -> Option<String>,
    ) -> NodeGpuState {
        let domain = &self.config.domain;
        let views = self.views();
        let mut pods: BTreeMap<usize, BTreeSet<String>> = BTreeMap::new();
        let mut unnamed = Vec::new();
        for h in self.held.values() {
            let claim_pod = || {
                let c = h.record.claim.as_ref()?;
                Some(format!("{}/{}", c.namespace, c.pod.as_deref()?))
            };
            let Some(pod) = holder(&h.record).or_else(claim_pod) else {
                unnamed.push(UnnamedGrant {
                    resource: h.record.resource.clone(),
                    devices: count(h.record.device_ids.len()),
                });
                continue;
            };
            let gpus = h.gpus.iter().chain(h.units.iter().map(|&(i, _)| i));
            for i in gpus {
                pods.entry(i).or_default().insert(pod.clone());
            }
        }
        let held_ids: BTreeSet<&str> = self
            .held
            .values()
            .flat_map(|h| h.record.device_ids.iter().map(String::as_str))
            .collect();
        let states = self.gpu_states();
        let mig_views: BTreeSet<&str> = views
            .iter()
            .filter_map(|v| match v {
                View::Mig(p) => Some(p.as_str()),
                _ => None,
            })
            .collect();
        let gpus = self
            .slots
            .iter()
            .zip(states)
            .enumerate()
            .map(|(i, (s, state))| {
                let mig = s
                    .gpu
                    .mig
                    .instances()
                    .iter()
                    .filter(|m| mig_views.contains(m.profile.as_str()))
                    .map(|m| MigEntry {
                        profile: m.profile.clone(),
                        uuid: m.uuid.to_string(),
                        free: s.healthy && !held_ids.contains(m.uuid.as_str()),
                    })
                    .collect();
                let mode = match state.mode {
                    super::GpuMode::Idle => StateMode::Idle,
                    super::GpuMode::Shared => StateMode::Shared,
                    super::GpuMode::Exclusive => StateMode::Exclusive,
                    super::GpuMode::Mig => StateMode::Mig,
                };
                GpuEntry {
                    index: s.gpu.index,
                    uuid: state.uuid,
                    model: state.model,
                    memory_bytes: state.memory_bytes,
                    numa_node: s.gpu.numa_node,
                    nvlink_peers: self.ledger.spec().gpus[i]
                        .nvlink_peers
                        .iter()
                        .map(|&p| count(p))
                        .collect(),
                    mode,
                    healthy: s.healthy,
                    shares_offered: self.config.gpu_memory
                        && s.units > 0
                        && s.healthy
                        && s.shares_enforced
                        && mode != StateMode::Exclusive,
                    units_total: s.units,
                    units_free: s.units.saturating_sub(state.units_held),
                    compute_free_milli: self.free_milli(i),
                    mig,
                    pods: pods.remove(&i).map(|p| p.into_iter().collect()).unwrap_or_default(),
                }
            })
            .collect();
        let nvlink_groups = self
            .groups
            .iter()
            .filter(|g| views.contains(&View::NvlinkGroup(g.size)))
            .map(|g| {
                let allocatable = self
                    .devices(&View::NvlinkGroup(g.size))
                    .into_iter()
                    .any(|d| d.id == g.id && d.healthy);
                NvlinkGroupEntry {
                    size: g.size,
                    id: g.id.clone(),
                    gpus: g.members.iter().map(count).collect(),
                    free: allocatable && !held_ids.contains(g.id.as_str()),
                }
            })
            .collect();
        NodeGpuState {
            version: gpu_state::VERSION,
            node: node.to_owned(),
            generation,
            memory_unit_bytes: self.config.memory_unit_bytes,
            resources: views.iter().map(|v| v.resource_name(domain)).collect(),
            gpus,
            nvlink_groups,
            unnamed,
            pod_uids: Default::default(),
            dra: false,
        }
    }
}
