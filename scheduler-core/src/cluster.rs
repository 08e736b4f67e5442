//! Choosing a node across a cluster: the decision the extender makes, and the replay tool's.
//!
//! Every feasible node is scored by the policy; the highest score wins, and ties go to the node
//! ranked first in a fixed priority order (as in the FGD paper's simulator, where node names
//! carry a prefix from a seeded permutation). The random policy picks a feasible node
//! uniformly instead.

use crate::ledger::{Allocation, AllocationId, LedgerError, NodeLedger};
use crate::model::{GpuModel, GpuSet, Request};
use crate::policy::{Policy, PolicyKind, Scored};
use crate::units::{MemMib, MemUnits, MilliCpu};
use memo::StateMemo;
use rand::{Rng, RngCore};
use std::collections::HashMap;

mod memo;

/// Whether a node with `score` and priority `rank` beats the best so far.
pub fn beats(score: i64, rank: u32, best: Option<(i64, u32)>) -> bool {
    match best {
        None => true,
        Some((b, r)) => score > b || (score == b && rank < r),
    }
}

/// Chooses a node for `request`: its index and what the policy would do there, or `None` if no
/// node fits. `ranks[i]` is node `i`'s place in the tie-break order (lower first).
pub fn select_node(
    policy: &Policy,
    nodes: &[NodeLedger],
    ranks: &[u32],
    request: &Request,
    rng: &mut dyn RngCore,
) -> Option<(usize, Scored)> {
    debug_assert_eq!(nodes.len(), ranks.len());
    if !policy.kind().is_deterministic() {
        let feasible: Vec<usize> = (0..nodes.len()).filter(|&i| nodes[i].fits(request)).collect();
        let pick = match feasible.len() {
            0 => return None,
            // As kube-scheduler: a single feasible node is taken without scoring.
            1 => feasible[0],
            n => feasible[rng.random_range(0..n)],
        };
        return policy.score(&nodes[pick], request, rng).map(|s| (pick, s));
    }
    let mut best: Option<(usize, Scored)> = None;
    for (i, node) in nodes.iter().enumerate() {
        if let Some(s) = policy.score(node, request, rng)
            && beats(s.score, ranks[i], best.map(|(b, bs)| (bs.score, ranks[b])))
        {
            best = Some((i, s));
        }
    }
    best
}

/// A cluster's nodes with a policy, a tie-break order and a score cache: the decision loop
/// of the extender and of the replay tool.
///
/// A node's score for a request depends only on the node and the request (for every policy but
/// `random`), so it is computed once per node state and request shape and kept until that node
/// changes: a decision costs one cache look-up per node, plus a fresh score for the few nodes
/// that changed since the last decision with that request shape. Each node carries a
/// generation number, bumped on every change, so invalidation is O(1).
///
/// Behind that cache, for the policies whose scoring is costly (`fgd` and `baleen`), nodes in
/// identical states share one score: a memo keyed by the request shape, the node's kind (its
/// description less names and IDs) and what is free on it and on each GPU, so a fresh scheduler
/// over many alike nodes scores each state once. The memo keeps the recently met states, at
/// most twice [`MEMO_LIMIT`] (the private module `cluster::memo` says how).
#[derive(Debug)]
pub struct ClusterScheduler {
    policy: Policy,
    nodes: Vec<NodeLedger>,
    ranks: Vec<u32>,
    generations: Vec<u32>,
    shapes: HashMap<Request, usize>,
    /// `cache[shape][node]`: the node's generation when scored, and its score.
    cache: Vec<Vec<(u32, Option<Scored>)>>,
    /// Each node's kind: equal for nodes with equal descriptions but for names and IDs.
    kinds: Vec<u32>,
    memo: StateMemo,
    key: Vec<u64>,
}

/// The most node states one generation of [`ClusterScheduler`]'s memo holds; the memo keeps
/// two. A replay of the Alibaba trace meets about 230,000 states in a seed, but nearly all the
/// states that recur do so within a few thousand decisions: this limit keeps most of the
/// memo's hits (`docs/benchmarks.md`, "Replay speed (issue 10)") in about a MiB, where keeping
/// every state took 50 MiB.
pub const MEMO_LIMIT: usize = 1 << 12;

/// The most distinct request shapes [`ClusterScheduler`] caches scores for before it forgets
/// them all.
pub const SHAPE_LIMIT: usize = 1024;

/// A generation no node has, marking an empty cache slot.
const UNSCORED: u32 = u32::MAX;

impl ClusterScheduler {
    /// A scheduler over `nodes`, where `ranks[i]` is node `i`'s place in the tie-break order.
    ///
    /// # Panics
    /// If `ranks` and `nodes` differ in length.
    pub fn new(policy: Policy, nodes: Vec<NodeLedger>, ranks: Vec<u32>) -> Self {
        assert_eq!(nodes.len(), ranks.len(), "one rank per node");
        let generations = vec![0; nodes.len()];
        // A node's kind: its description less the node name and the GPU IDs.
        type Kind<'a> =
            (MilliCpu, MemMib, Vec<(&'a GpuModel, MemUnits, Option<u32>, &'a [usize], usize)>);
        // Ranks are u32, so there are fewer than 2^32 nodes, and kinds.
        let mut kind_ids: HashMap<Kind<'_>, u32> = HashMap::new();
        let kinds = nodes
            .iter()
            .map(|n| {
                let s = n.spec();
                let gpus = s
                    .gpus
                    .iter()
                    .map(|g| {
                        (
                            &g.model,
                            g.memory_units,
                            g.numa_node,
                            g.nvlink_peers.as_slice(),
                            g.mig.len(),
                        )
                    })
                    .collect();
                // Task kinds are few (a trace has dozens); past 2^32 they would share an ID.
                let next = u32::try_from(kind_ids.len()).unwrap_or(u32::MAX);
                *kind_ids.entry((s.cpu, s.memory, gpus)).or_insert(next)
            })
            .collect();
        Self {
            policy,
            nodes,
            ranks,
            generations,
            shapes: HashMap::new(),
            cache: Vec::new(),
            kinds,
            memo: StateMemo::new(MEMO_LIMIT),
            key: Vec::new(),
        }
    }

    /// The nodes.
    pub fn nodes(&self) -> &[NodeLedger] {
        &self.nodes
    }

    /// The policy.
    pub fn policy(&self) -> &Policy {
        &self.policy
    }

    /// Replaces the policy (for instance with a target workload learned from more requests);
    /// every cached and memoised score is dropped.
    pub fn set_policy(&mut self, policy: Policy) {
        self.policy = policy;
        self.shapes.clear();
        self.cache.clear();
        self.memo.clear();
    }

    /// Chooses a node and GPUs for `request` without placing it; `None` if no node fits.
    pub fn choose(&mut self, request: &Request, rng: &mut dyn RngCore) -> Option<(usize, Scored)> {
        if !self.policy.kind().is_deterministic() {
            return select_node(&self.policy, &self.nodes, &self.ranks, request, rng);
        }
        let shape = match self.shapes.get(request) {
            Some(&s) => s,
            None => {
                if self.cache.len() >= SHAPE_LIMIT {
                    // Requests of ever new shapes (an extender serving varied pods) would grow
                    // the per-shape caches without bound: start over instead. The memo goes too,
                    // as its keys name shapes by their index.
                    self.shapes.clear();
                    self.cache.clear();
                    self.memo.clear();
                }
                let s = self.cache.len();
                self.shapes.insert(request.clone(), s);
                self.cache.push(vec![(UNSCORED, None); self.nodes.len()]);
                s
            }
        };
        let memoise = memoised(self.policy.kind());
        let Self { policy, nodes, ranks, generations, cache, kinds, memo, key, .. } = self;
        // One pass over nodes, slots, generations and ranks together: no bounds checks and no
        // reloads through `self` in the loop every decision runs over every node.
        let slots = cache[shape].iter_mut().zip(generations.iter()).zip(ranks.iter());
        let mut best: Option<(usize, Scored)> = None;
        let mut best_rank = 0;
        for (i, (node, ((slot, &generation), &rank))) in nodes.iter().zip(slots).enumerate() {
            if slot.0 != generation {
                let scored = if !memoise {
                    policy.score(node, request, rng)
                } else if !node.fits(request) {
                    // Scoring starts by this test, and failing it gives no score: cheaper
                    // than a memo look-up, and on a loaded cluster most nodes fail it.
                    None
                } else {
                    state_key(key, shape, kinds[i], node);
                    memo.get_or_insert_with(key, || policy.score(node, request, &mut *rng))
                };
                *slot = (generation, scored);
            }
            if let Some(s) = slot.1
                && beats(s.score, rank, best.map(|(_, b)| (b.score, best_rank)))
            {
                best = Some((i, s));
                best_rank = rank;
            }
        }
        best
    }

    /// Records an allocation on node `node` (see [`NodeLedger::allocate`]).
    pub fn place(
        &mut self,
        node: usize,
        id: AllocationId,
        request: &Request,
        gpus: GpuSet,
    ) -> Result<(), LedgerError> {
        self.nodes[node].allocate(id, request, gpus)?;
        self.touch(node);
        Ok(())
    }

    /// Releases an allocation on node `node`.
    pub fn release(&mut self, node: usize, id: AllocationId) -> Result<Allocation, LedgerError> {
        let alloc = self.nodes[node].release(id)?;
        self.touch(node);
        Ok(alloc)
    }

    fn touch(&mut self, node: usize) {
        // Skip UNSCORED so that a wrapped generation never looks valid.
        let g = &mut self.generations[node];
        *g = if *g + 1 == UNSCORED { 0 } else { *g + 1 };
    }
}

/// Whether the scheduler memoises the scores of `kind` by node state ([`state_key`]): where
/// scoring is costly (fragmentation over a target workload). For the simple formulas building
/// the key costs more than scoring.
fn memoised(kind: PolicyKind) -> bool {
    matches!(kind, PolicyKind::Fgd | PolicyKind::Baleen)
}

/// Writes into `key` everything a [`memoised`] policy's score depends on: the request shape,
/// the node's kind, its free CPU and memory, and each GPU's free compute and memory. (`fgd` and
/// `baleen` read nothing else of a node; a policy that looks at the tasks a node runs, as GPU
/// clustering does, must not be memoised with this key.) Shapes are below [`SHAPE_LIMIT`], so
/// the shape and the kind share a word.
fn state_key(key: &mut Vec<u64>, shape: usize, kind: u32, node: &NodeLedger) {
    key.clear();
    key.extend([(shape as u64) << 32 | u64::from(kind), node.free_cpu().0, node.free_memory().0]);
    key.extend(node.gpus().iter().map(|g| u64::from(g.milli.0) << 32 | u64::from(g.memory.0)));
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::frag::TargetWorkload;
    use crate::ledger::AllocationId;
    use crate::model::{GpuDemand, GpuModel, GpuSpec, NodeSpec};
    use crate::policy::{Normalisers, PolicyKind};
    use crate::units::{MemMib, MemUnits, MilliCpu, MilliGpu};
    use proptest::prelude::*;
    use rand::SeedableRng;
    use rand_chacha::ChaCha8Rng;
    use std::sync::Arc;

    fn node_spec(i: usize, cpu: u64, gpus: usize, model: &str) -> NodeSpec {
        let model = GpuModel::new(model);
        NodeSpec {
            name: format!("n{i}"),
            cpu: MilliCpu(cpu),
            memory: MemMib(64_000),
            gpus: (0..gpus).map(|g| GpuSpec::plain(format!("n{i}/g{g}"), model.clone())).collect(),
        }
    }

    fn request() -> impl Strategy<Value = Request> {
        (0u64..=16_000, 0u32..=8, 0u32..=1000, any::<bool>()).prop_map(|(cpu, count, milli, t4)| {
            let gpu = match (count, milli) {
                (0, _) => GpuDemand::None,
                (_, 0) | (_, 1000) => GpuDemand::Whole { count: count.min(4) },
                (_, m) => GpuDemand::Shared { milli: MilliGpu(m), memory: MemUnits::ZERO },
            };
            let allowed_models = if t4 { vec![GpuModel::new("T4")] } else { vec![] };
            Request { cpu: MilliCpu(cpu), memory: MemMib(1000), gpu, allowed_models }
        })
    }

    fn cluster() -> impl Strategy<Value = Vec<NodeSpec>> {
        proptest::collection::vec((0u64..=64_000, 0usize..=8, any::<bool>()), 1..8).prop_map(
            |nodes| {
                nodes
                    .into_iter()
                    .enumerate()
                    .map(|(i, (cpu, gpus, t4))| {
                        node_spec(i, cpu, gpus, if t4 { "T4" } else { "A100" })
                    })
                    .collect()
            },
        )
    }

    fn policy(kind: PolicyKind, requests: &[Request]) -> Policy {
        Policy::new(
            kind,
            Arc::new(TargetWorkload::from_requests(requests, 0.95, false)),
            Normalisers::default(),
        )
    }

    /// Places `requests` one by one; returns the placements. Panics if the ledger refuses one.
    fn run(
        kind: PolicyKind,
        specs: &[NodeSpec],
        requests: &[Request],
        seed: u64,
    ) -> Vec<Option<(usize, Scored)>> {
        let p = policy(kind, requests);
        let mut nodes: Vec<NodeLedger> =
            specs.iter().map(|s| NodeLedger::new(s.clone()).expect("valid")).collect();
        let ranks: Vec<u32> = (0..u32::try_from(nodes.len()).expect("a few nodes")).rev().collect();
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        requests
            .iter()
            .enumerate()
            .map(|(k, r)| {
                let choice = select_node(&p, &nodes, &ranks, r, &mut rng);
                if let Some((n, s)) = choice {
                    nodes[n]
                        .allocate(AllocationId(k as u64), r, s.gpus)
                        .expect("policies only choose what fits");
                }
                choice
            })
            .collect()
    }

    proptest! {
        /// Every policy only ever chooses placements the ledger accepts (so never over-commits),
        /// and gives the same placements for the same seed.
        #[test]
        fn placements_fit_and_are_deterministic(
            specs in cluster(),
            requests in proptest::collection::vec(request(), 1..40),
            seed in any::<u64>(),
        ) {
            for kind in PolicyKind::ALL {
                let a = run(kind, &specs, &requests, seed);
                let b = run(kind, &specs, &requests, seed);
                prop_assert_eq!(a, b, "{} is not deterministic", kind);
            }
        }

        /// A request that fits somewhere still fits when a node is added, and a node is found
        /// exactly when one fits.
        #[test]
        fn adding_capacity_keeps_feasible_requests_feasible(
            specs in cluster(),
            extra in (0u64..=64_000, 0usize..=8, any::<bool>()),
            r in request(),
        ) {
            let mut bigger = specs.clone();
            bigger.push(node_spec(99, extra.0, extra.1, if extra.2 { "T4" } else { "A100" }));
            for kind in PolicyKind::ALL {
                let p = policy(kind, std::slice::from_ref(&r));
                let mut rng = ChaCha8Rng::seed_from_u64(3);
                let small: Vec<NodeLedger> = specs.iter().map(|s| NodeLedger::new(s.clone()).expect("valid")).collect();
                let big: Vec<NodeLedger> = bigger.iter().map(|s| NodeLedger::new(s.clone()).expect("valid")).collect();
                let fits_small = small.iter().any(|n| n.fits(&r));
                let chosen_small = select_node(&p, &small, &vec![0; small.len()], &r, &mut rng).is_some();
                let chosen_big = select_node(&p, &big, &vec![0; big.len()], &r, &mut rng).is_some();
                prop_assert_eq!(chosen_small, fits_small);
                prop_assert!(!chosen_small || chosen_big, "{}: adding a node lost a placement", kind);
            }
        }
    }

    proptest! {
        /// The cached scheduler chooses exactly what scoring every node afresh chooses, through
        /// any sequence of placements and releases.
        #[test]
        fn cache_never_changes_a_decision(
            specs in cluster(),
            requests in proptest::collection::vec(request(), 1..40),
            release_every in 2usize..5,
        ) {
            // Every node twice, so that nodes in identical states share memoised scores.
            let specs: Vec<NodeSpec> = specs.iter().chain(&specs).cloned().collect();
            for kind in PolicyKind::ALL.into_iter().filter(|k| k.is_deterministic()) {
                let p = policy(kind, &requests);
                let nodes: Vec<NodeLedger> = specs.iter().map(|s| NodeLedger::new(s.clone()).expect("valid")).collect();
                let ranks: Vec<u32> = (0..u32::try_from(nodes.len()).expect("a few nodes")).collect();
                let mut cached = ClusterScheduler::new(p.clone(), nodes, ranks.clone());
                let mut rng = ChaCha8Rng::seed_from_u64(0);
                let mut placed = Vec::new();
                for (k, r) in requests.iter().enumerate() {
                    let fresh = select_node(&p, cached.nodes(), &ranks, r, &mut rng);
                    let got = cached.choose(r, &mut rng);
                    prop_assert_eq!(got, fresh, "{}", kind);
                    if let Some((n, s)) = got {
                        cached.place(n, AllocationId(k as u64), r, s.gpus).expect("fits");
                        placed.push((n, AllocationId(k as u64)));
                    }
                    if k % release_every == 0 && !placed.is_empty() {
                        let (n, id) = placed.remove(0);
                        cached.release(n, id).expect("placed");
                    }
                }
            }
        }
    }

    #[test]
    fn many_request_shapes_stay_correct_past_the_cache_limit() {
        let specs: Vec<NodeSpec> = (0..3).map(|i| node_spec(i, 64_000, 4, "A100")).collect();
        let requests: Vec<Request> = (0..SHAPE_LIMIT as u64 + 50)
            .map(|k| Request {
                cpu: MilliCpu(1 + k % 3000),
                memory: MemMib(1 + k),
                gpu: GpuDemand::Shared {
                    milli: MilliGpu(100 + (k % 9) as u32 * 100),
                    memory: MemUnits::ZERO,
                },
                allowed_models: vec![],
            })
            .collect();
        let p = policy(PolicyKind::Baleen, &requests);
        let nodes: Vec<NodeLedger> =
            specs.iter().map(|s| NodeLedger::new(s.clone()).expect("valid")).collect();
        let ranks = vec![2, 0, 1];
        let mut cached = ClusterScheduler::new(p.clone(), nodes, ranks.clone());
        let mut rng = ChaCha8Rng::seed_from_u64(0);
        for (k, r) in requests.iter().enumerate() {
            let fresh = select_node(&p, cached.nodes(), &ranks, r, &mut rng);
            assert_eq!(cached.choose(r, &mut rng), fresh, "request {k}");
        }
        assert!(cached.cache.len() <= SHAPE_LIMIT);
    }

    #[test]
    fn ties_go_to_the_first_ranked_node() {
        let specs: Vec<NodeSpec> = (0..4).map(|i| node_spec(i, 32_000, 2, "A100")).collect();
        let nodes: Vec<NodeLedger> =
            specs.into_iter().map(|s| NodeLedger::new(s).expect("valid")).collect();
        let r = Request {
            cpu: MilliCpu(1000),
            memory: MemMib(1000),
            gpu: GpuDemand::Whole { count: 1 },
            allowed_models: vec![],
        };
        let p = policy(PolicyKind::BestFit, std::slice::from_ref(&r));
        let mut rng = ChaCha8Rng::seed_from_u64(0);
        let (n, _) = select_node(&p, &nodes, &[3, 1, 0, 2], &r, &mut rng).expect("fits");
        assert_eq!(n, 2);
    }
}
