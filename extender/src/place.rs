//! Which nodes can take a pod, and how well, from each node's gpu-state document
//! (`baleen_k8s::gpu_state`) and the pods assumed on it (bound there, not yet in its
//! document):
//! - [`verdict`]: the filter's answer for one node: fits, full (preemption might make room) or
//!   never (no such GPU, profile or group at all, even on an empty node);
//! - [`NodeModel`]: the node as `scheduler_core`'s placement model, so that `prioritize`
//!   scores it with the same policy the replay measures.

use std::collections::{BTreeMap, BTreeSet};

use baleen_k8s::gpu_state::{GpuMode, NodeGpuState};
use baleen_scheduler_core::ledger::{AllocationId, NodeLedger};
use baleen_scheduler_core::model::{GpuDemand, GpuModel, GpuSet, GpuSpec, NodeSpec, Request};
use baleen_scheduler_core::policy::Policy;
use baleen_scheduler_core::units::{MemMib, MemUnits, MilliCpu, MilliGpu};

use baleen_scheduler_core::capacity::{Ask, Capacity, GpuCap, Group, ordered};

use crate::demand::{AskResource as _, Demand};

/// The filter's answer for one node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// The pod fits.
    Fits,
    /// It does not fit now; evicting pods could make room (`FailedNodes`).
    Full(String),
    /// It could not fit even on the empty node (`FailedAndUnresolvableNodes`).
    Never(String),
    /// The node has no usable gpu-state (`FailedAndUnresolvableNodes`).
    NoState(String),
}

/// MIG instances counted by profile.
fn mig_counts<'a>(
    mig: impl Iterator<Item = &'a baleen_k8s::gpu_state::MigEntry>,
) -> BTreeMap<String, u32> {
    let mut by = BTreeMap::new();
    for m in mig {
        *by.entry(m.profile.clone()).or_insert(0) += 1;
    }
    by
}

/// A group's GPUs, by index.
fn members(n: &baleen_k8s::gpu_state::NvlinkGroupEntry) -> Vec<usize> {
    n.gpus.iter().map(|&i| i as usize).collect()
}

/// What the node of `doc` can give now, as its document says.
fn capacity_now(doc: &NodeGpuState) -> Capacity {
    let gpus = doc
        .gpus
        .iter()
        .map(|g| GpuCap {
            units_free: g.units_free,
            shares: g.shares_offered,
            whole: g.healthy && g.mode == GpuMode::Idle,
            mig: mig_counts(g.mig.iter().filter(|m| m.free)),
        })
        .collect();
    let groups = doc
        .nvlink_groups
        .iter()
        .map(|n| Group { size: n.size, gpus: members(n), free: n.free })
        .collect();
    Capacity::new(gpus, groups)
}

/// What the node of `doc` could give with nothing allocated (healthy GPUs only).
fn capacity_empty(doc: &NodeGpuState) -> Capacity {
    let gpus = doc
        .gpus
        .iter()
        .map(|g| {
            let plain = g.healthy && g.mode != GpuMode::Mig;
            GpuCap {
                units_free: if plain { g.units_total } else { 0 },
                shares: plain && g.units_total > 0,
                whole: plain,
                mig: mig_counts(g.mig.iter().filter(|_| g.healthy)),
            }
        })
        .collect();
    let groups: Vec<(u32, Vec<usize>)> =
        doc.nvlink_groups.iter().map(|n| (n.size, members(n))).collect();
    Capacity::with_groups_of_whole_gpus(gpus, &groups)
}

/// Whether `demand` fits on the node of `doc`, after the pods in `assumed` (bound there, not
/// yet in the document), reading resource names in `domain`.
pub fn verdict(doc: &NodeGpuState, assumed: &[&Demand], demand: &Demand, domain: &str) -> Verdict {
    let offered: BTreeSet<&str> = doc.resources.iter().map(String::as_str).collect();
    for ask in &demand.asks {
        let resource = ask.resource(domain);
        if !offered.contains(resource.as_str()) {
            return Verdict::Never(format!("the node offers no {resource}"));
        }
    }
    let mut empty = capacity_empty(doc);
    for ask in ordered(&demand.asks) {
        if let Err(why) = empty.take(ask) {
            return Verdict::Never(format!("{why} even with nothing allocated"));
        }
    }
    let mut now = capacity_now(doc);
    for other in assumed {
        for ask in ordered(&other.asks) {
            // A pod the document has not caught up with may already be counted there: taking
            // too much only makes this node look fuller for a moment.
            let _ = now.take(ask);
        }
    }
    for ask in ordered(&demand.asks) {
        if let Err(why) = now.take(ask) {
            let pending = if assumed.is_empty() {
                String::new()
            } else {
                format!(" (counting {} pods bound but not yet published)", assumed.len())
            };
            return Verdict::Full(format!("{why}{pending}"));
        }
    }
    Verdict::Fits
}

/// A node as `scheduler_core`'s placement model: its GPUs with what is held on them, and its
/// CPU and memory with what its pods request.
#[derive(Debug, Clone)]
pub struct NodeModel {
    ledger: NodeLedger,
    /// Memory units of one GPU (to express a gpu-memory ask as a share of a GPU).
    units_per_gpu: u32,
    next: u64,
}

/// Allocatable CPU and memory of a node, and what its pods request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Host {
    /// Allocatable CPU, millicores.
    pub cpu_milli: u64,
    /// Allocatable memory, bytes.
    pub memory_bytes: u64,
    /// CPU requested by the pods on it.
    pub cpu_used_milli: u64,
    /// Memory requested by the pods on it.
    pub memory_used_bytes: u64,
}

const MIB: u64 = 1 << 20;

impl NodeModel {
    /// The model of the node of `doc`, with `host`'s CPU and memory; `None` if the document
    /// cannot be expressed (more GPUs than the model holds).
    pub fn new(doc: &NodeGpuState, host: Host) -> Option<Self> {
        let spec = NodeSpec {
            name: doc.node.clone(),
            cpu: MilliCpu(host.cpu_milli),
            memory: MemMib(host.memory_bytes / MIB),
            gpus: doc
                .gpus
                .iter()
                .map(|g| GpuSpec {
                    memory_units: MemUnits(g.units_total),
                    numa_node: g.numa_node,
                    nvlink_peers: g.nvlink_peers.iter().map(|&p| p as usize).collect(),
                    ..GpuSpec::plain(g.uuid.clone(), GpuModel::new(&g.model))
                })
                .collect(),
        };
        let mut ledger = NodeLedger::new(spec).ok()?;
        let mut next = 0;
        let mut hold = |ledger: &mut NodeLedger, request: &Request, gpus: GpuSet| {
            next += 1;
            // What the agent reports held always fits the empty model.
            let _ = ledger.allocate(AllocationId(next), request, gpus);
        };
        let host_request = Request {
            cpu: MilliCpu(host.cpu_used_milli.min(host.cpu_milli)),
            memory: MemMib((host.memory_used_bytes / MIB).min(host.memory_bytes / MIB)),
            gpu: GpuDemand::None,
            allowed_models: vec![],
        };
        hold(&mut ledger, &host_request, GpuSet::EMPTY);
        for (i, g) in doc.gpus.iter().enumerate() {
            let used_units = g.units_total - g.units_free;
            let whole = !g.healthy
                || matches!(g.mode, GpuMode::Exclusive | GpuMode::Mig)
                || (used_units > 0 && (!g.shares_offered || g.units_free == 0));
            let request = if whole {
                Some(GpuDemand::Whole { count: 1 })
            } else if used_units > 0 {
                Some(GpuDemand::Shared {
                    milli: MilliGpu((1000 - g.compute_free_milli).clamp(1, 999)),
                    memory: MemUnits(used_units),
                })
            } else {
                None
            };
            if let Some(gpu) = request {
                let r =
                    Request { cpu: MilliCpu(0), memory: MemMib(0), gpu, allowed_models: vec![] };
                hold(&mut ledger, &r, GpuSet::single(i));
            }
        }
        let units_per_gpu = doc.gpus.iter().map(|g| g.units_total).max().unwrap_or(0);
        Some(Self { ledger, units_per_gpu, next })
    }

    /// The placement model's request for `demand` on this node: its CPU and memory, and its
    /// largest GPU ask (a gpu-memory ask of `n` units is `n / units` of one GPU's compute).
    /// `None` for a pod without a GPU ask the model can express (MIG only).
    pub fn request(&self, demand: &Demand) -> Option<Request> {
        let gpu = ordered(&demand.asks).into_iter().find_map(|ask| match ask {
            Ask::Gpus(n) => Some(GpuDemand::Whole { count: *n }),
            Ask::NvlinkGroups(size, n) => Some(GpuDemand::Whole { count: size.saturating_mul(*n) }),
            Ask::GpuMemory(n) => {
                let units = self.units_per_gpu.max(1);
                let milli = (u64::from(*n) * 1000 / u64::from(units)).clamp(1, 999);
                Some(GpuDemand::Shared {
                    milli: MilliGpu(u32::try_from(milli).unwrap_or(999)),
                    memory: MemUnits(*n),
                })
            }
            Ask::Mig(..) => None,
        })?;
        Some(Request {
            cpu: MilliCpu(demand.cpu_milli),
            memory: MemMib(demand.memory_bytes.div_ceil(MIB)),
            gpu,
            allowed_models: vec![],
        })
    }

    /// Places `demand` as its node's agent does (a pod bound here, not yet in the document):
    /// memory units on the tightest GPU that fits, whole GPUs lowest index first
    /// (`agent::ledger::preferred`; the GPUs do not model NVLink here). `_policy` decides
    /// nothing here: the agent, not the policy, chooses GPUs on its node.
    pub fn assume(&mut self, demand: &Demand, _policy: &Policy) {
        let Some(mut request) = self.request(demand) else { return };
        // Its CPU and memory are already in the host's use (every pod bound here counts).
        request.cpu = MilliCpu(0);
        request.memory = MemMib(0);
        if let Some(gpus) = baleen_scheduler_core::fit::best_fit_gpus(&self.ledger, &request) {
            self.next += 1;
            let _ = self.ledger.allocate(AllocationId(self.next), &request, gpus);
        }
    }

    /// `policy`'s score of this node for `demand` (higher is better); `None` if the model says
    /// it does not fit or cannot express it.
    pub fn score(&self, demand: &Demand, policy: &Policy) -> Option<i64> {
        let request = if demand.is_empty() { cpu_only(demand) } else { self.request(demand)? };
        let mut rng = <rand_chacha::ChaCha8Rng as rand::SeedableRng>::seed_from_u64(0);
        policy.score(&self.ledger, &request, &mut rng).map(|s| s.score)
    }

    /// The model's ledger.
    pub fn ledger(&self) -> &NodeLedger {
        &self.ledger
    }
}

/// A pod asking for no baleen resource, as the policy sees it: its CPU and memory only.
pub fn cpu_only(demand: &Demand) -> Request {
    Request {
        cpu: MilliCpu(demand.cpu_milli),
        memory: MemMib(demand.memory_bytes.div_ceil(MIB)),
        gpu: GpuDemand::None,
        allowed_models: vec![],
    }
}

/// Scores of one decision as kube-scheduler's 0..=10: the best node(s) 10, the others spread
/// over 0..=9 by their raw score, nodes without a score 0.
pub fn extender_scores(raw: &[Option<i64>]) -> Vec<i64> {
    scaled(Scale::of(raw), raw)
}

/// `raw` on `scale` ([`Scale::of`] them; every score 0 where it is `None`).
pub fn scaled(scale: Option<Scale>, raw: &[Option<i64>]) -> Vec<i64> {
    match scale {
        Some(scale) => raw.iter().map(|s| scale.score(*s)).collect(),
        None => vec![0; raw.len()],
    }
}

/// How [`extender_scores`] maps one decision's raw scores: by their least and greatest.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Scale {
    /// The least raw score.
    pub min: i64,
    /// The greatest raw score.
    pub max: i64,
    /// `max - min` where the division fits in i64 (always, for the policy's scores): 5,000
    /// i128 divisions a call were measurable.
    narrow: Option<i64>,
}

impl Scale {
    /// The scale of `raw`; `None` where no node has a score.
    pub fn of(raw: &[Option<i64>]) -> Option<Self> {
        let (Some(&min), Some(&max)) = (raw.iter().flatten().min(), raw.iter().flatten().max())
        else {
            return None;
        };
        Some(Self::between(min, max))
    }

    /// The scale from `min` to `max`.
    pub fn between(min: i64, max: i64) -> Self {
        let span = i128::from(max) - i128::from(min);
        let narrow = i64::try_from(span).ok().filter(|&s| s <= i64::MAX / 9);
        Scale { min, max, narrow }
    }

    /// One raw score on this scale (0 where the node has none).
    pub fn score(&self, raw: Option<i64>) -> i64 {
        match raw {
            None => 0,
            Some(s) if s == self.max => crate::protocol::MAX_SCORE,
            Some(s) => match self.narrow {
                Some(span) => ((s - self.min) * 9 / span.max(1)).clamp(0, 9),
                None => {
                    let span = i128::from(self.max) - i128::from(self.min);
                    let pos = (i128::from(s) - i128::from(self.min)) * 9 / span.max(1);
                    i64::try_from(pos).unwrap_or(0).clamp(0, 9)
                }
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use baleen_k8s::gpu_state::{GpuEntry, MigEntry, NvlinkGroupEntry, VERSION};
    use baleen_scheduler_core::policy::{Normalisers, PolicyKind};

    const D: &str = "awesome-ai-company.com";

    fn gpu(index: u32, mode: GpuMode, units_free: u32) -> GpuEntry {
        GpuEntry {
            index,
            uuid: format!("GPU-{index}"),
            model: "NVIDIA H200".into(),
            memory_bytes: 140 << 30,
            numa_node: None,
            nvlink_peers: vec![],
            mode,
            healthy: true,
            shares_offered: mode != GpuMode::Exclusive,
            units_total: 140,
            units_free,
            compute_free_milli: if mode == GpuMode::Exclusive {
                0
            } else {
                units_free * 1000 / 140
            },
            mig: vec![],
            pods: vec![],
        }
    }

    fn doc(gpus: Vec<GpuEntry>) -> NodeGpuState {
        let n = u32::try_from(gpus.len()).expect("few");
        NodeGpuState {
            version: VERSION,
            node: "n".into(),
            generation: 1,
            memory_unit_bytes: 1 << 30,
            resources: ["gpu", "gpu-memory", "nvlink-group-2", "mig-1g.18gb"]
                .map(|r| format!("{D}/{r}"))
                .to_vec(),
            nvlink_groups: (0..n / 2)
                .map(|g| NvlinkGroupEntry {
                    size: 2,
                    id: format!("nvlink2-GPU-{}", 2 * g),
                    gpus: vec![2 * g, 2 * g + 1],
                    free: gpus[2 * g as usize].mode == GpuMode::Idle
                        && gpus[2 * g as usize + 1].mode == GpuMode::Idle,
                })
                .collect(),
            gpus,
            unnamed: vec![],
            pod_uids: Default::default(),
            dra: false,
        }
    }

    fn ask(asks: Vec<Ask>) -> Demand {
        Demand { asks, cpu_milli: 0, memory_bytes: 0 }
    }

    #[test]
    fn the_filter_says_fits_full_or_never_and_why() {
        // 40 units free on GPU 0, GPU 1 held whole, GPUs 2 and 3 idle.
        let d = doc(vec![
            gpu(0, GpuMode::Shared, 40),
            gpu(1, GpuMode::Exclusive, 140),
            gpu(2, GpuMode::Idle, 140),
            gpu(3, GpuMode::Idle, 140),
        ]);
        assert_eq!(verdict(&d, &[], &ask(vec![Ask::GpuMemory(140)]), D), Verdict::Fits);
        assert_eq!(verdict(&d, &[], &ask(vec![Ask::Gpus(2)]), D), Verdict::Fits);
        // Three whole GPUs: only two are free, but the node has four.
        let Verdict::Full(why) = verdict(&d, &[], &ask(vec![Ask::Gpus(3)]), D) else {
            panic!("full")
        };
        assert!(why.contains("2 of 3 whole GPUs free"), "{why}");
        // Five whole GPUs, or 141 units: never on this node.
        assert!(matches!(verdict(&d, &[], &ask(vec![Ask::Gpus(5)]), D), Verdict::Never(_)));
        let Verdict::Never(why) = verdict(&d, &[], &ask(vec![Ask::GpuMemory(141)]), D) else {
            panic!("never")
        };
        assert!(why.contains("no GPU has 141"), "{why}");
        // A resource the node does not offer.
        let Verdict::Never(why) = verdict(&d, &[], &ask(vec![Ask::NvlinkGroups(4, 1)]), D) else {
            panic!("never")
        };
        assert!(why.contains("offers no awesome-ai-company.com/nvlink-group-4"), "{why}");
        // The one free NVLink pair is GPUs 2-3; after a whole GPU taken from it, none.
        assert_eq!(verdict(&d, &[], &ask(vec![Ask::NvlinkGroups(2, 1)]), D), Verdict::Fits);
        let one = ask(vec![Ask::Gpus(1)]);
        assert!(matches!(
            verdict(&d, &[&one], &ask(vec![Ask::NvlinkGroups(2, 1)]), D),
            Verdict::Full(_)
        ));
    }

    #[test]
    fn pods_bound_but_not_yet_published_count_as_placed() {
        let d = doc(vec![gpu(0, GpuMode::Shared, 40), gpu(1, GpuMode::Idle, 140)]);
        let big = ask(vec![Ask::GpuMemory(100)]);
        assert_eq!(verdict(&d, &[], &big, D), Verdict::Fits);
        // A burst: the first 100-unit pod takes GPU 1; the second finds no room.
        let Verdict::Full(why) = verdict(&d, &[&big], &big, D) else { panic!("full") };
        assert!(why.contains("largest free block: 40") && why.contains("1 pods bound"), "{why}");
        // Small pods pack into the tightest GPU first: 40 units fill GPU 0 and 140 still fit.
        let small = ask(vec![Ask::GpuMemory(40)]);
        assert_eq!(verdict(&d, &[&small], &ask(vec![Ask::GpuMemory(140)]), D), Verdict::Fits);
    }

    #[test]
    fn mig_instances_and_unhealthy_gpus() {
        let mut mig = gpu(1, GpuMode::Mig, 0);
        mig.units_total = 0;
        mig.shares_offered = false;
        mig.mig = vec![
            MigEntry { profile: "1g.18gb".into(), uuid: "MIG-a".into(), free: false },
            MigEntry { profile: "1g.18gb".into(), uuid: "MIG-b".into(), free: true },
        ];
        let mut sick = gpu(0, GpuMode::Idle, 140);
        sick.healthy = false;
        sick.shares_offered = false;
        let d = doc(vec![sick, mig]);
        let m = |n| ask(vec![Ask::Mig("1g.18gb".into(), n)]);
        assert_eq!(verdict(&d, &[], &m(1), D), Verdict::Fits);
        assert!(matches!(verdict(&d, &[], &m(2), D), Verdict::Full(_)));
        assert!(matches!(verdict(&d, &[], &m(3), D), Verdict::Never(_)));
        // The only non-MIG GPU is unhealthy: preemption cannot help.
        assert!(matches!(verdict(&d, &[], &ask(vec![Ask::GpuMemory(1)]), D), Verdict::Never(_)));
    }

    #[test]
    fn the_model_holds_what_the_document_says_and_scores_with_the_policy() {
        let d = doc(vec![gpu(0, GpuMode::Shared, 40), gpu(1, GpuMode::Exclusive, 140)]);
        let host = Host {
            cpu_milli: 96_000,
            memory_bytes: 512 << 30,
            cpu_used_milli: 8000,
            memory_used_bytes: 0,
        };
        let model = NodeModel::new(&d, host).expect("model");
        let l = model.ledger();
        assert_eq!(l.free_cpu(), MilliCpu(88_000));
        assert_eq!(l.gpus()[0].memory, MemUnits(40));
        assert_eq!(l.gpus()[1].milli, MilliGpu(0));
        let request = model.request(&ask(vec![Ask::GpuMemory(70)])).expect("request");
        assert_eq!(request.gpu, GpuDemand::Shared { milli: MilliGpu(500), memory: MemUnits(70) });
        let seen = [request.clone()];
        let policy = Policy::for_requests(PolicyKind::Baleen, &seen, 0.95, Normalisers::default());
        assert_eq!(model.score(&ask(vec![Ask::GpuMemory(70)]), &policy), None, "40 free < 70");
        assert!(model.score(&ask(vec![Ask::GpuMemory(40)]), &policy).is_some());
    }

    #[test]
    fn an_assumed_pod_takes_its_gpu_share_once_and_its_cpu_not_again() {
        let d = doc(vec![gpu(0, GpuMode::Shared, 100), gpu(1, GpuMode::Idle, 140)]);
        // The host's use already counts the bound pod's 8 CPUs.
        let host = Host {
            cpu_milli: 96_000,
            memory_bytes: 512 << 30,
            cpu_used_milli: 8000,
            memory_used_bytes: 16 << 30,
        };
        let mut model = NodeModel::new(&d, host).expect("model");
        let seen = [model.request(&ask(vec![Ask::GpuMemory(40)])).expect("request")];
        let policy = Policy::for_requests(PolicyKind::Baleen, &seen, 0.95, Normalisers::default());
        let bound =
            Demand { asks: vec![Ask::GpuMemory(40)], cpu_milli: 8000, memory_bytes: 16 << 30 };
        model.assume(&bound, &policy);
        let l = model.ledger();
        assert_eq!(l.free_cpu(), MilliCpu(88_000), "CPU counted once");
        assert_eq!(l.free_memory(), MemMib((512 << 10) - (16 << 10)));
        // On the tightest GPU, as the agent places it.
        assert_eq!(l.gpus()[0].memory, MemUnits(60));
        assert_eq!(l.gpus()[1].memory, MemUnits(140));
    }

    #[test]
    fn scores_become_zero_to_ten_with_the_best_at_ten() {
        assert_eq!(
            extender_scores(&[Some(5), None, Some(-3), Some(5), Some(1)]),
            [10, 0, 0, 10, 4]
        );
        assert_eq!(extender_scores(&[None, None]), [0, 0]);
        assert_eq!(extender_scores(&[Some(7)]), [10]);
        // A span past i64 (the wide path) and one at its edge (the narrow path).
        assert_eq!(extender_scores(&[Some(i64::MIN), Some(0), Some(i64::MAX)]), [0, 4, 10]);
        assert_eq!(
            extender_scores(&[Some(0), Some(i64::MAX / 18), Some(i64::MAX / 9)]),
            [0, 4, 10]
        );
    }
}
