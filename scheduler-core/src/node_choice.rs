//! In-node GPU choice for the node agent, where the kubelet has already chosen the node and
//! names the devices it could give:
//!
//! - [`tightest_shared_gpu`]: for a share of one GPU (gpu-memory units), the allowed GPU with
//!   the least free memory that still fits, so partly used GPUs fill up first and whole free
//!   GPUs stay whole for whole-GPU requests (best fit, the packing the FGD paper's measure
//!   reduces to on one node when the future workload is unknown);
//! - [`best_connected`]: for several whole GPUs, the set with the most NVLink-connected pairs,
//!   then the most pairs on the same NUMA node, then the lowest indices.

use crate::ledger::NodeLedger;
use crate::model::{GpuDemand, GpuSet, NodeSpec, Request};

/// The allowed GPU that serves `request` (a shared demand) with the least free memory left,
/// ties broken by least free compute, then lowest index. `None` if no allowed GPU fits.
pub fn tightest_shared_gpu(node: &NodeLedger, request: &Request, allowed: GpuSet) -> Option<usize> {
    if !matches!(request.gpu, GpuDemand::Shared { .. }) {
        return None;
    }
    node.fitting_gpus(request)
        .iter()
        .filter(|&i| allowed.contains(i))
        .min_by_key(|&i| (node.gpus()[i].memory, node.gpus()[i].milli, i))
}

/// Above this many candidate sets, [`best_connected`] grows the set greedily instead of trying
/// every one.
pub const EXHAUSTIVE_LIMIT: u64 = 20_000;

/// The best-connected set of `n` GPUs among `candidates` that contains `must`, or `None` when
/// `must` is not within `candidates` or there are too few candidates. Exact up to
/// [`EXHAUSTIVE_LIMIT`] candidate sets; beyond, a greedy search from every seed GPU.
pub fn best_connected(
    spec: &NodeSpec,
    candidates: GpuSet,
    must: GpuSet,
    n: usize,
) -> Option<GpuSet> {
    if must.iter().any(|i| !candidates.contains(i)) || must.len() > n || candidates.len() < n {
        return None;
    }
    let free: Vec<usize> = candidates.iter().filter(|&i| !must.contains(i)).collect();
    let need = n - must.len();
    if binomial(free.len() as u64, need as u64) <= EXHAUSTIVE_LIMIT {
        let mut best: Option<((u32, u32), GpuSet)> = None;
        let mut chosen = Vec::with_capacity(need);
        combinations(&free, need, 0, &mut chosen, &mut |extra| {
            let mut set = must;
            for &i in extra {
                set.insert(i);
            }
            let score = connectivity(spec, set);
            // Combinations come in lexicographic order, so the first best has the lowest indices.
            if best.is_none_or(|(s, _)| score > s) {
                best = Some((score, set));
            }
        });
        return best.map(|(_, set)| set);
    }
    // Greedy from every seed: add the candidate that adds the most connectivity (lowest index
    // on ties); keep the best grown set, the lowest seed on ties.
    let seeds: Vec<Option<usize>> =
        if need == 0 { vec![None] } else { free.iter().copied().map(Some).collect() };
    let mut best: Option<((u32, u32), GpuSet)> = None;
    for seed in seeds {
        let mut set = must;
        if let Some(seed) = seed {
            set.insert(seed);
        }
        while set.len() < n {
            let next = free.iter().copied().filter(|&i| !set.contains(i)).max_by_key(|&i| {
                let mut with = set;
                with.insert(i);
                (connectivity(spec, with), std::cmp::Reverse(i))
            })?;
            set.insert(next);
        }
        let score = connectivity(spec, set);
        if best.is_none_or(|(s, _)| score > s) {
            best = Some((score, set));
        }
    }
    best.map(|(_, set)| set)
}

/// (NVLink-connected pairs, same-NUMA pairs) within `set`.
pub fn connectivity(spec: &NodeSpec, set: GpuSet) -> (u32, u32) {
    let members: Vec<usize> = set.iter().collect();
    let mut nvlink = 0;
    let mut numa = 0;
    for (k, &a) in members.iter().enumerate() {
        for &b in &members[k + 1..] {
            if spec.gpus[a].nvlink_peers.contains(&b) {
                nvlink += 1;
            }
            if spec.gpus[a].numa_node.is_some() && spec.gpus[a].numa_node == spec.gpus[b].numa_node
            {
                numa += 1;
            }
        }
    }
    (nvlink, numa)
}

fn binomial(n: u64, k: u64) -> u64 {
    if k > n {
        return 0;
    }
    let k = k.min(n - k);
    let mut result: u64 = 1;
    for i in 0..k {
        result = result.saturating_mul(n - i) / (i + 1);
    }
    result
}

fn combinations(
    items: &[usize],
    k: usize,
    start: usize,
    chosen: &mut Vec<usize>,
    visit: &mut dyn FnMut(&[usize]),
) {
    if chosen.len() == k {
        visit(chosen);
        return;
    }
    for i in start..items.len() {
        if items.len() - i < k - chosen.len() {
            break;
        }
        chosen.push(items[i]);
        combinations(items, k, i + 1, chosen, visit);
        chosen.pop();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ledger::AllocationId;
    use crate::model::{GpuModel, GpuSpec};
    use crate::units::{MemMib, MemUnits, MilliCpu, MilliGpu};

    fn node(n: usize, units: u32, peers: &[(usize, usize)], numa: &[u32]) -> NodeSpec {
        let model = GpuModel::new("H200");
        let mut gpus: Vec<GpuSpec> = (0..n)
            .map(|i| GpuSpec {
                memory_units: MemUnits(units),
                numa_node: numa.get(i).copied(),
                ..GpuSpec::plain(format!("GPU-{i}"), model.clone())
            })
            .collect();
        for &(a, b) in peers {
            gpus[a].nvlink_peers.push(b);
            gpus[b].nvlink_peers.push(a);
        }
        NodeSpec { name: "n".into(), cpu: MilliCpu(0), memory: MemMib(0), gpus }
    }

    fn units(u: u32) -> Request {
        Request {
            cpu: MilliCpu(0),
            memory: MemMib(0),
            gpu: GpuDemand::Shared { milli: MilliGpu(0), memory: MemUnits(u) },
            allowed_models: vec![],
        }
    }

    #[test]
    fn shared_requests_go_to_the_fullest_gpu_that_fits() {
        let mut ledger = NodeLedger::new(node(3, 141, &[], &[])).expect("node");
        ledger.allocate(AllocationId(1), &units(41), GpuSet::single(0)).expect("fits");
        ledger.allocate(AllocationId(2), &units(121), GpuSet::single(1)).expect("fits");
        let all = GpuSet::from_indices(0..3).expect("set");
        // 20 free on GPU 1, 100 on GPU 0, 141 on GPU 2.
        assert_eq!(tightest_shared_gpu(&ledger, &units(16), all), Some(1));
        assert_eq!(tightest_shared_gpu(&ledger, &units(21), all), Some(0));
        assert_eq!(tightest_shared_gpu(&ledger, &units(101), all), Some(2));
        assert_eq!(tightest_shared_gpu(&ledger, &units(142), all), None);
        let not_1 = GpuSet::from_indices([0, 2]).expect("set");
        assert_eq!(tightest_shared_gpu(&ledger, &units(16), not_1), Some(0));
    }

    #[test]
    fn whole_gpus_prefer_nvlink_then_numa_then_low_indices() {
        // Pairs (0,1) and (2,3) bridged; GPUs 1 and 2 share NUMA node 0, 0 and 3 node 1.
        let spec = node(4, 0, &[(0, 1), (2, 3)], &[1, 0, 0, 1]);
        let all = GpuSet::from_indices(0..4).expect("set");
        let pick = |cands: GpuSet, must: GpuSet, n| {
            best_connected(&spec, cands, must, n).map(|s| s.iter().collect::<Vec<_>>())
        };
        assert_eq!(pick(all, GpuSet::EMPTY, 2), Some(vec![0, 1]));
        assert_eq!(pick(all, GpuSet::single(3), 2), Some(vec![2, 3]));
        let no_pairs = GpuSet::from_indices([0, 1, 2]).expect("set");
        assert_eq!(pick(no_pairs, GpuSet::single(2), 2), Some(vec![1, 2]));
        let apart = GpuSet::from_indices([0, 2]).expect("set");
        assert_eq!(pick(apart, GpuSet::EMPTY, 2), Some(vec![0, 2]));
        assert_eq!(pick(apart, GpuSet::EMPTY, 3), None);
        assert_eq!(pick(apart, GpuSet::single(1), 2), None, "must outside the candidates");
    }

    #[test]
    fn greedy_and_exhaustive_agree_on_a_clique_layout() {
        // 64 GPUs in cliques of 8: exhaustive search is over the limit for n = 8.
        let mut peers = Vec::new();
        for c in 0..8 {
            for a in 0..8 {
                for b in a + 1..8 {
                    peers.push((c * 8 + a, c * 8 + b));
                }
            }
        }
        let spec = node(64, 0, &peers, &[]);
        let mut cands = GpuSet::EMPTY;
        for i in 3..64 {
            cands.insert(i);
        }
        let set = best_connected(&spec, cands, GpuSet::EMPTY, 8).expect("enough GPUs");
        assert_eq!(connectivity(&spec, set).0, 28, "a full clique of 8: {:?}", set);
        assert!(binomial(61, 8) > EXHAUSTIVE_LIMIT);
    }
}
