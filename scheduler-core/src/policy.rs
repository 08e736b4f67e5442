//! Placement policies: score a node for a request, and choose the GPUs on it.
//!
//! This is the API the agent (which GPU on this node) and the extender (which node) share. Each
//! policy gives a feasible node an integer score, highest best, and names the GPUs it would use
//! there; an infeasible node gets no score. Six policies are those of the FGD paper, defined in
//! `shared/benchmarks/placement.md`; the seventh, `baleen`, is ours and the default (see
//! [`BaleenParams`] and `docs/benchmarks.md`):
//!
//! | policy | node score | GPUs on the node |
//! |---|---|---|
//! | `random` | 0 everywhere: the caller picks uniformly | a random fitting GPU; whole GPUs lowest index first |
//! | `dotprod` | `100 (1 - (c_n c / C^2 + U_n g / G^2) / 2)` | best fit |
//! | `gpu-clustering` | tier by the GPU-task classes already on the node, plus how full it is | best fit |
//! | `gpu-packing` | partly used GPUs first, then used nodes, then idle nodes | best fit |
//! | `best-fit` | `100 (1 - (c_n - c) / 2C - (U_n - g) / 2G)` | best fit |
//! | `fgd` | `100 sigmoid(ΔF / 1000)`, the drop in expected fragmentation | the GPU with the best ΔF |
//! | `baleen` (default) | `25 sigmoid((ΔF' - 12 R) / 1000)`, with `F'` = FGD's measure (memory-aware, all shapes) plus the GPU that free CPU and memory cannot feed, and `R` the share of a GPU a shared placement gives up ([`crate::packing`]) | the GPU with the best `ΔF' - 12 R` |
//!
//! `C` and `G` are the [`Normalisers`]; `c_n` and `U_n` the node's free CPU and GPU compute;
//! `c` and `g` the request's CPU and total GPU demand.

use crate::fit;
use crate::frag::{self, TargetWorkload};
use crate::ledger::NodeLedger;
use crate::model::{GpuDemand, GpuSet, MAX_GPUS_PER_NODE, Request};
use crate::packing::SharePrices;
use crate::units::{MemMib, MilliCpu};
use rand::{Rng, RngCore};
use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

/// The placement policies.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum PolicyKind {
    /// A uniformly random feasible node.
    Random,
    /// Smallest dot product of free resources and request.
    DotProd,
    /// Keep GPU tasks of one class together.
    GpuClustering,
    /// Fill partly used GPUs, then used nodes, then idle nodes.
    GpuPacking,
    /// Least leftover CPU and GPU.
    BestFit,
    /// Fragmentation gradient descent.
    Fgd,
    /// baleen's own policy.
    Baleen,
}

impl PolicyKind {
    /// Every policy, in the paper's order.
    pub const ALL: [PolicyKind; 7] = [
        PolicyKind::Random,
        PolicyKind::DotProd,
        PolicyKind::GpuClustering,
        PolicyKind::GpuPacking,
        PolicyKind::BestFit,
        PolicyKind::Fgd,
        PolicyKind::Baleen,
    ];

    /// The policy's name on the command line and in results.
    pub fn name(self) -> &'static str {
        match self {
            PolicyKind::Random => "random",
            PolicyKind::DotProd => "dotprod",
            PolicyKind::GpuClustering => "gpu-clustering",
            PolicyKind::GpuPacking => "gpu-packing",
            PolicyKind::BestFit => "best-fit",
            PolicyKind::Fgd => "fgd",
            PolicyKind::Baleen => "baleen",
        }
    }

    /// Whether a node's score depends only on the node and the request (every policy but
    /// `random`), so that it may be cached until the node changes.
    pub fn is_deterministic(self) -> bool {
        self != PolicyKind::Random
    }
}

impl Default for PolicyKind {
    /// `baleen`: the policy the agent and the extender use unless configured otherwise.
    fn default() -> Self {
        PolicyKind::Baleen
    }
}

impl fmt::Display for PolicyKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The knobs of the `baleen` policy. The defaults are the values the trace replay chose
/// (`docs/benchmarks.md`, "baleen policy"); change them only with a new measurement.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BaleenParams {
    /// Share of requests the target workload covers (the paper's 0.95 leaves out the rare
    /// shapes, such as 8-GPU tasks, whose needs then go unseen).
    pub coverage: f64,
    /// Whether host memory is part of a shape (the FGD measure ignores memory).
    pub memory_in_shapes: bool,
    /// Weight of each shape's GPU that the node's free CPU and memory cannot feed
    /// ([`frag::node_fragment_with_host`]).
    pub shape_host_weight: f64,
    /// Weight of the GPU that the node's free CPU and memory cannot feed at the workload's
    /// average needs ([`frag::host_stranded`]).
    pub host_weight: f64,
    /// Score levels: the score is `floor(levels * sigmoid(ΔF / 1000))`. Coarse levels make
    /// near-equal placements tie, and ties go to the fixed node priority, which fills nodes one
    /// at a time; FGD uses 100.
    pub score_levels: f64,
    /// Weight of the GPU share a shared placement gives up by leaving its GPU off the best
    /// packing patterns of the target workload's shares ([`SharePrices::regret`], in
    /// milli-GPU, subtracted from the fragmentation drop). 0 turns it off. On the Alibaba
    /// trace the result stops changing from about 12 up (`docs/benchmarks.md`); it is not a
    /// strict filter, as the fragmentation drop of two nodes can differ by more.
    pub pattern_weight: f64,
    /// How much [`Self::shape_host_weight`] grows with the cluster's CPU scarcity `s` (the CPU
    /// the target workload asks per milli-GPU, times the cluster's GPUs, over its CPU): by
    /// `1 + scarcity_gain * (s - 1)` when `s > 1` (CPU runs out before the GPUs), at most
    /// [`MAX_SCARCITY_FACTOR`] times ([`Policy::for_cluster`]). On the Alibaba trace only
    /// `cpu250` and `cpu300` have `s > 1` (`docs/benchmarks.md`).
    pub scarcity_gain: f64,
}

/// The most [`BaleenParams::scarcity_gain`] may multiply the shape host weight by.
pub const MAX_SCARCITY_FACTOR: f64 = 8.0;

impl Default for BaleenParams {
    fn default() -> Self {
        Self {
            coverage: 1.0,
            memory_in_shapes: true,
            shape_host_weight: 0.5,
            host_weight: 3.0,
            score_levels: 25.0,
            pattern_weight: 12.0,
            scarcity_gain: 50.0,
        }
    }
}

/// The CPU a workload asks per milli-GPU (CPU-only tasks included), times the cluster's
/// milli-GPUs, over the cluster's CPU: above 1, the CPU runs out before the GPUs do.
pub fn cpu_scarcity(target: &TargetWorkload, cpu: MilliCpu, gpus: usize) -> f64 {
    let (mut asked_cpu, mut asked_gpu) = (0.0, 0.0);
    for (shape, p) in target.shapes() {
        asked_cpu += p * shape.cpu.0 as f64;
        asked_gpu += p * f64::from(shape.milli_per_gpu.0) * f64::from(shape.gpu_count);
    }
    if asked_gpu == 0.0 || cpu.0 == 0 {
        return 0.0;
    }
    asked_cpu / asked_gpu * gpus as f64 * 1000.0 / cpu.0 as f64
}

/// An unknown policy name.
#[derive(Debug, thiserror::Error)]
#[error("unknown policy `{0}`; known: {known}", known = known_policies())]
pub struct UnknownPolicy(pub String);

fn known_policies() -> String {
    PolicyKind::ALL.map(PolicyKind::name).join(", ")
}

impl FromStr for PolicyKind {
    type Err = UnknownPolicy;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        PolicyKind::ALL
            .into_iter()
            .find(|k| k.name() == s)
            .ok_or_else(|| UnknownPolicy(s.to_owned()))
    }
}

/// The scales that turn free CPU and GPU into fractions in the dot-product and best-fit scores:
/// the largest node's CPU and GPU compute.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Normalisers {
    /// CPU scale.
    pub cpu: MilliCpu,
    /// GPU scale in milli-GPU.
    pub gpu_milli: u64,
}

impl Default for Normalisers {
    /// The paper's values: 128 cores and 8 GPUs.
    fn default() -> Self {
        Self { cpu: MilliCpu(128_000), gpu_milli: 8_000 }
    }
}

/// A feasible node's score and the GPUs the request would get there.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Scored {
    /// Integer score, highest best.
    pub score: i64,
    /// The GPUs (empty for a CPU-only request).
    pub gpus: GpuSet,
}

/// A policy with what it needs to score.
#[derive(Clone, Debug)]
pub struct Policy {
    kind: PolicyKind,
    target: Arc<TargetWorkload>,
    normalisers: Normalisers,
    baleen: BaleenParams,
    prices: Arc<SharePrices>,
}

impl Policy {
    /// A policy with an explicit target workload: the workload `fgd` and `baleen` measure
    /// fragmentation against (the others ignore it). [`Policy::for_requests`] builds the target
    /// each policy expects.
    pub fn new(kind: PolicyKind, target: Arc<TargetWorkload>, normalisers: Normalisers) -> Self {
        let prices = Arc::new(share_prices(kind, &target));
        Self { kind, target, normalisers, baleen: BaleenParams::default(), prices }
    }

    /// A policy whose target workload is learned from `requests` (those seen so far, or a
    /// trace) the way the policy expects: `fgd` as the paper (shapes without memory, covering
    /// `fgd_coverage` of the requests), `baleen` per its [`BaleenParams`].
    pub fn for_requests<'a>(
        kind: PolicyKind,
        requests: impl IntoIterator<Item = &'a Request>,
        fgd_coverage: f64,
        normalisers: Normalisers,
    ) -> Self {
        let params = BaleenParams::default();
        let target = match kind {
            PolicyKind::Baleen => {
                TargetWorkload::from_requests(requests, params.coverage, params.memory_in_shapes)
            }
            _ => TargetWorkload::from_requests(requests, fgd_coverage, false),
        };
        let prices = Arc::new(share_prices(kind, &target));
        Self { kind, target: Arc::new(target), normalisers, baleen: params, prices }
    }

    /// The same policy with other `baleen` scoring knobs (the other policies ignore them).
    /// `coverage` and `memory_in_shapes` shape the target workload, which is built with the
    /// policy ([`Policy::for_requests`]); changing them here has no effect.
    pub fn with_baleen_params(mut self, params: BaleenParams) -> Self {
        self.baleen = params;
        self
    }

    /// The same policy for a cluster of `cpu` and `gpus` GPUs: `baleen` weighs the GPU that
    /// free CPU cannot feed more when the target workload needs more CPU than the cluster has
    /// for its GPUs ([`BaleenParams::scarcity_gain`]); the other policies are unchanged.
    pub fn for_cluster(mut self, cpu: MilliCpu, gpus: usize) -> Self {
        if self.kind == PolicyKind::Baleen {
            let s = cpu_scarcity(&self.target, cpu, gpus);
            let factor =
                (1.0 + self.baleen.scarcity_gain * (s - 1.0).max(0.0)).min(MAX_SCARCITY_FACTOR);
            self.baleen.shape_host_weight *= factor;
        }
        self
    }

    /// The `baleen` knobs in use.
    pub fn baleen_params(&self) -> BaleenParams {
        self.baleen
    }

    /// Which policy this is.
    pub fn kind(&self) -> PolicyKind {
        self.kind
    }

    /// The target workload.
    pub fn target(&self) -> &TargetWorkload {
        &self.target
    }

    /// Scores `node` for `request`: `None` if it does not fit. `rng` serves only the random
    /// policy's GPU choice.
    pub fn score(
        &self,
        node: &NodeLedger,
        request: &Request,
        rng: &mut dyn RngCore,
    ) -> Option<Scored> {
        if !node.fits(request) {
            return None;
        }
        match self.kind {
            PolicyKind::Random => {
                random_gpus(node, request, rng).map(|gpus| Scored { score: 0, gpus })
            }
            PolicyKind::DotProd => self.dot_prod(node, request),
            PolicyKind::GpuClustering => gpu_clustering(node, request, &self.normalisers),
            PolicyKind::GpuPacking => gpu_packing(node, request),
            PolicyKind::BestFit => self.best_fit(node, request),
            PolicyKind::Fgd => self.fgd(node, request),
            PolicyKind::Baleen => self.baleen(node, request),
        }
    }

    /// The GPUs this policy would give `request` on `node`, or `None` if it does not fit.
    pub fn choose_gpus(
        &self,
        node: &NodeLedger,
        request: &Request,
        rng: &mut dyn RngCore,
    ) -> Option<GpuSet> {
        self.score(node, request, rng).map(|s| s.gpus)
    }

    /// Rescales the scores of the candidate nodes of one decision in place, as the policy's
    /// kube-scheduler plugin does before nodes are compared: min-max to 0..=100 for `best-fit`,
    /// unchanged for the others. The order of nodes by score never changes.
    pub fn normalise(&self, scores: &mut [i64]) {
        if self.kind != PolicyKind::BestFit {
            return;
        }
        let (Some(&min), Some(&max)) = (scores.iter().min(), scores.iter().max()) else { return };
        for s in scores.iter_mut() {
            *s = if max == min { 100 } else { (*s - min) * 100 / (max - min) };
        }
    }

    fn fractions(&self, node: &NodeLedger, request: &Request) -> (f64, f64, f64, f64) {
        let n = &self.normalisers;
        (
            node.free_cpu().0 as f64 / n.cpu.0 as f64,
            request.cpu.0 as f64 / n.cpu.0 as f64,
            node.free_milli_total() as f64 / n.gpu_milli as f64,
            request.gpu.total_milli() as f64 / n.gpu_milli as f64,
        )
    }

    fn dot_prod(&self, node: &NodeLedger, request: &Request) -> Option<Scored> {
        let (cn, c, un, g) = self.fractions(node, request);
        let score = floor_score(100.0 * (1.0 - (cn * c + un * g) / 2.0));
        Some(Scored { score, gpus: fit::best_fit_gpus(node, request)? })
    }

    fn best_fit(&self, node: &NodeLedger, request: &Request) -> Option<Scored> {
        let (cn, c, un, g) = self.fractions(node, request);
        let score = floor_score(100.0 * (1.0 - (0.5 * (cn - c) + 0.5 * (un - g))));
        Some(Scored { score, gpus: fit::best_fit_gpus(node, request)? })
    }

    fn baleen(&self, node: &NodeLedger, request: &Request) -> Option<Scored> {
        let p = &self.baleen;
        let prices = (p.pattern_weight != 0.0).then_some((&*self.prices, p.pattern_weight));
        frag_descent(node, request, p.score_levels, prices, Measure::Baleen(&self.target, p))
    }

    fn fgd(&self, node: &NodeLedger, request: &Request) -> Option<Scored> {
        frag_descent(node, request, 100.0, None, Measure::Fgd(&self.target))
    }
}

/// What a fragmentation descent measures a node state by.
#[derive(Clone, Copy)]
enum Measure<'a> {
    /// FGD's: [`frag::node_fragment`] over the target workload.
    Fgd(&'a TargetWorkload),
    /// baleen's: [`frag::node_fragment_with_host`] at the shape host weight, plus the host
    /// weight times [`frag::host_stranded`].
    Baleen(&'a TargetWorkload, &'a BaleenParams),
}

/// The share prices a policy uses: solved for `baleen`, none for the others.
fn share_prices(kind: PolicyKind, target: &TargetWorkload) -> SharePrices {
    match kind {
        PolicyKind::Baleen => SharePrices::from_target(target),
        _ => SharePrices::default(),
    }
}

/// Scores each way of placing `request` on `node` by the drop in `measure` it causes,
/// `floor(levels * sigmoid((F_before - F_after) / 1000))`, and keeps the best: a shared request
/// tries every fitting GPU (the lowest index wins ties; of alike GPUs only the lowest is
/// measured), other requests use the lowest-index GPUs. With `prices` `(p, w)`, a shared placement's drop is lowered by `w` times its
/// [`SharePrices::regret`] on that GPU.
///
/// The measure of the state before and of every candidate's state after are computed together
/// ([`TargetWorkload::candidate_fragments`]), which gives the same values as measuring each
/// state on its own at a fraction of the cost.
fn frag_descent(
    node: &NodeLedger,
    request: &Request,
    levels: f64,
    prices: Option<(&SharePrices, f64)>,
    measure: Measure<'_>,
) -> Option<Scored> {
    let score_of = |delta: f64| floor_score(levels / (1.0 + (-delta / 1000.0).exp()));
    let shared = matches!(request.gpu, GpuDemand::Shared { .. });
    let mut sets = [GpuSet::EMPTY; MAX_GPUS_PER_NODE];
    let count = if shared {
        // Two GPUs of one model with the same free compute are interchangeable: the measures
        // only count GPUs and add their free compute (exactly: integers), and the regret reads
        // the free compute alone. So both give the same score, the lower index wins the tie,
        // and the other need not be measured.
        let spec = node.spec();
        let alike = |a: usize, b: usize| {
            node.gpus()[a].milli == node.gpus()[b].milli && spec.gpus[a].model == spec.gpus[b].model
        };
        let mut count = 0;
        for i in node.fitting_gpus(request).iter() {
            if !sets[..count].iter().flat_map(|s| s.iter()).any(|j| alike(i, j)) {
                sets[count] = GpuSet::single(i);
                count += 1;
            }
        }
        count
    } else {
        sets[0] = fit::lowest_index_gpus(node, request)?;
        1
    };
    let sets = &sets[..count];
    let mut gpus = [0u32; MAX_GPUS_PER_NODE];
    let n = frag::fill_free(node, &mut gpus);
    let spec = node.spec();
    let share = request.gpu.milli_per_gpu().0;
    let candidates = frag::Candidates {
        before: frag::NodeFree {
            cpu: node.free_cpu(),
            memory: node.free_memory(),
            gpus: &gpus[..n],
        },
        cpu_after: MilliCpu(node.free_cpu().0 - request.cpu.0),
        memory_after: MemMib(node.free_memory().0 - request.memory.0),
        share,
        sets,
    };
    let mut values = [0.0f64; MAX_GPUS_PER_NODE + 1];
    let values = &mut values[..candidates.states()];
    match measure {
        Measure::Fgd(target) => target.candidate_fragments(spec, &candidates, values),
        Measure::Baleen(target, p) => {
            target.candidate_fragments_with_host(spec, &candidates, p.shape_host_weight, values);
            let needs = target.host_needs();
            values[0] += p.host_weight * frag::host_stranded(needs, &candidates.before);
            let mut after = gpus;
            for (value, set) in values[1..].iter_mut().zip(sets) {
                for i in set.iter() {
                    after[i] -= share;
                }
                let free = frag::NodeFree {
                    cpu: candidates.cpu_after,
                    memory: candidates.memory_after,
                    gpus: &after[..n],
                };
                *value += p.host_weight * frag::host_stranded(needs, &free);
                for i in set.iter() {
                    after[i] += share;
                }
            }
        }
    }
    let before = values[0];
    let mut best: Option<Scored> = None;
    for (&after, &set) in values[1..].iter().zip(sets) {
        let delta = before - after;
        let score = if shared {
            let free = set.iter().next().map_or(0, |i| node.gpus()[i].milli.0);
            let regret = prices.map_or(0.0, |(p, w)| w * p.regret(free, share));
            score_of(delta - regret)
        } else {
            score_of(delta)
        };
        if best.is_none_or(|b| score > b.score) {
            best = Some(Scored { score, gpus: set });
        }
    }
    best
}

fn random_gpus(node: &NodeLedger, request: &Request, rng: &mut dyn RngCore) -> Option<GpuSet> {
    match request.gpu {
        GpuDemand::Shared { .. } => {
            let fitting = node.fitting_gpus(request);
            if fitting.is_empty() {
                return None;
            }
            let pick = rng.random_range(0..fitting.len());
            fitting.iter().nth(pick).map(GpuSet::single)
        }
        GpuDemand::None | GpuDemand::Whole { .. } => fit::lowest_index_gpus(node, request),
    }
}

fn gpu_clustering(node: &NodeLedger, request: &Request, n: &Normalisers) -> Option<Scored> {
    let gpus = fit::best_fit_gpus(node, request)?;
    let Some(class) = request.gpu.class() else { return Some(Scored { score: 0, gpus }) };
    let (mut own, mut other) = (false, false);
    for (_, alloc) in node.allocations() {
        match alloc.request.gpu.class() {
            Some(c) if c == class => own = true,
            Some(_) => other = true,
            None => {}
        }
    }
    let tier = match (own, other) {
        (true, false) => 75,
        (true, true) => 50,
        (false, false) => 25,
        (false, true) => 0,
    };
    let used = n.gpu_milli.saturating_sub(node.free_milli_total());
    // At most 25: used never exceeds the node's milli-GPU.
    let fullness = i64::try_from(25 * used / n.gpu_milli).unwrap_or(25);
    Some(Scored { score: tier + fullness, gpus })
}

fn gpu_packing(node: &NodeLedger, request: &Request) -> Option<Scored> {
    let gpus = fit::best_fit_gpus(node, request)?;
    if request.gpu.gpu_count() == 0 {
        return Some(Scored { score: 0, gpus });
    }
    let gpu_count = i64::from(count(node.gpus().len()));
    if node.gpus_idle() {
        return Some(Scored { score: (33 - gpu_count).max(gpu_count), gpus });
    }
    let partly_used = gpus.iter().all(|i| !node.gpu_is_idle(i));
    let score = if partly_used {
        let free_pct: i64 = gpus.iter().map(|i| i64::from(node.gpus()[i].milli.0) / 10).sum();
        (100 - free_pct / 10).max(50)
    } else {
        (50 - i64::from(count(gpus.len()))).max(33)
    };
    Some(Scored { score, gpus })
}

/// A score from a real-valued measure: rounded down; `as` saturates at the ends of `i64` and
/// maps NaN to 0, which is what a score wants (scores are compared, never summed).
#[allow(clippy::cast_possible_truncation, reason = "saturating float-to-int is the intent")]
fn floor_score(x: f64) -> i64 {
    x.floor() as i64
}

/// A count of GPUs (at most 64 on a node) as a score term.
fn count(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

#[cfg(test)]
#[allow(clippy::cast_possible_truncation, reason = "test scores are small")]
mod tests {
    use super::*;
    use crate::frag::TaskShape;
    use crate::ledger::AllocationId;
    use crate::model::{GpuModel, GpuSpec, NodeSpec};
    use crate::units::{MemUnits, MilliGpu};
    use rand::SeedableRng;
    use rand_chacha::ChaCha8Rng;

    fn node(cpu: u64, gpus: usize) -> NodeLedger {
        let model = GpuModel::new("G2");
        NodeLedger::new(NodeSpec {
            name: "n".into(),
            cpu: MilliCpu(cpu),
            memory: MemMib(393_216),
            gpus: (0..gpus).map(|i| GpuSpec::plain(format!("g{i}"), model.clone())).collect(),
        })
        .expect("valid node")
    }

    fn shared(cpu: u64, milli: u32) -> Request {
        Request {
            cpu: MilliCpu(cpu),
            memory: MemMib(1000),
            gpu: GpuDemand::Shared { milli: MilliGpu(milli), memory: MemUnits::ZERO },
            allowed_models: vec![],
        }
    }

    fn whole(cpu: u64, count: u32) -> Request {
        Request {
            cpu: MilliCpu(cpu),
            memory: MemMib(1000),
            gpu: GpuDemand::Whole { count },
            allowed_models: vec![],
        }
    }

    fn cpu_only(cpu: u64) -> Request {
        Request {
            cpu: MilliCpu(cpu),
            memory: MemMib(1000),
            gpu: GpuDemand::None,
            allowed_models: vec![],
        }
    }

    fn policy(kind: PolicyKind) -> Policy {
        Policy::new(kind, Arc::new(TargetWorkload::default()), Normalisers::default())
    }

    fn score(kind: PolicyKind, node: &NodeLedger, request: &Request) -> Option<Scored> {
        policy(kind).score(node, request, &mut ChaCha8Rng::seed_from_u64(1))
    }

    fn place(node: &mut NodeLedger, id: u64, request: &Request, gpus: &[usize]) {
        let set = GpuSet::from_indices(gpus.iter().copied()).expect("small indices");
        node.allocate(AllocationId(id), request, set).expect("fits");
    }

    #[test]
    fn the_shape_host_weight_grows_only_where_cpu_runs_out_before_the_gpus() {
        // Half the tasks take a whole GPU and 8 cores, half are CPU-only with 8 cores: 16 cores
        // per GPU of demand.
        let requests = [whole(8000, 1), cpu_only(8000)];
        let target = TargetWorkload::from_requests(&requests, 1.0, true);
        assert!((cpu_scarcity(&target, MilliCpu(160_000), 10) - 1.0).abs() < 1e-12);
        assert!((cpu_scarcity(&target, MilliCpu(80_000), 10) - 2.0).abs() < 1e-12);
        assert_eq!(cpu_scarcity(&target, MilliCpu(0), 10), 0.0);
        let baleen =
            || Policy::for_requests(PolicyKind::Baleen, &requests, 0.95, Normalisers::default());
        let base = baleen().baleen_params().shape_host_weight;
        // Enough CPU (s <= 1): unchanged.
        let roomy = baleen().for_cluster(MilliCpu(320_000), 10);
        assert_eq!(roomy.baleen_params().shape_host_weight, base);
        // s = 1.02: 1 + 50 x 0.02 = 2 times.
        let tight = baleen().for_cluster(MilliCpu(156_863), 10);
        assert!((tight.baleen_params().shape_host_weight / base - 2.0).abs() < 1e-3);
        // Far short: at most MAX_SCARCITY_FACTOR times.
        let short = baleen().for_cluster(MilliCpu(80_000), 10);
        assert_eq!(short.baleen_params().shape_host_weight, base * MAX_SCARCITY_FACTOR);
        // Other policies are untouched.
        let fgd = Policy::for_requests(PolicyKind::Fgd, &requests, 0.95, Normalisers::default());
        let before = fgd.baleen_params();
        assert_eq!(fgd.for_cluster(MilliCpu(80_000), 10).baleen_params(), before);
    }

    #[test]
    fn names_round_trip_and_unknown_is_refused() {
        for k in PolicyKind::ALL {
            assert_eq!(k.name().parse::<PolicyKind>().expect("known"), k);
        }
        let err = "fastest".parse::<PolicyKind>().expect_err("unknown");
        assert!(err.to_string().contains("fastest"));
    }

    #[test]
    fn infeasible_nodes_get_no_score() {
        let n = node(2000, 1);
        for k in PolicyKind::ALL {
            assert_eq!(score(k, &n, &shared(4000, 500)), None, "{k}: CPU short");
            assert_eq!(score(k, &n, &whole(1000, 2)), None, "{k}: too few GPUs");
        }
    }

    #[test]
    fn dot_prod_score() {
        // cn = .75, c = 1/32, Un = 1, g = 1/16: 100 (1 - (.75/32 + 1/16) / 2) = 95.70
        let s = score(PolicyKind::DotProd, &node(96_000, 8), &shared(4000, 500)).expect("fits");
        assert_eq!(s.score, 95);
        assert_eq!(s.gpus, GpuSet::single(0));
        // CPU-only tasks are scored too: 100 (1 - (.75 * 1/32) / 2) = 98.83
        assert_eq!(
            score(PolicyKind::DotProd, &node(96_000, 8), &cpu_only(4000)).expect("fits").score,
            98
        );
    }

    #[test]
    fn best_fit_score_and_device() {
        let mut n = node(96_000, 8);
        // 100 (1 - (.5 (.75 - 1/32) + .5 (1 - 1/16))) = 17.19
        assert_eq!(score(PolicyKind::BestFit, &n, &shared(4000, 500)).expect("fits").score, 17);
        place(&mut n, 1, &shared(0, 300), &[3]);
        place(&mut n, 2, &shared(0, 600), &[5]);
        // GPU 5 has 400 free, GPU 3 has 700: the tightest fit is GPU 5.
        let s = score(PolicyKind::BestFit, &n, &shared(4000, 400)).expect("fits");
        assert_eq!(s.gpus, GpuSet::single(5));
        assert_eq!(
            score(PolicyKind::BestFit, &n, &shared(4000, 500)).expect("fits").gpus,
            GpuSet::single(3)
        );
    }

    #[test]
    fn best_fit_normalise_is_min_max() {
        let mut scores = [10, 20, 30];
        policy(PolicyKind::BestFit).normalise(&mut scores);
        assert_eq!(scores, [0, 50, 100]);
        let mut same = [7, 7];
        policy(PolicyKind::BestFit).normalise(&mut same);
        assert_eq!(same, [100, 100]);
        let mut other = [10, 20];
        policy(PolicyKind::Fgd).normalise(&mut other);
        assert_eq!(other, [10, 20]);
    }

    #[test]
    fn gpu_clustering_tiers() {
        let mut n = node(96_000, 8);
        assert_eq!(
            score(PolicyKind::GpuClustering, &n, &shared(1000, 500)).expect("fits").score,
            25
        );
        assert_eq!(score(PolicyKind::GpuClustering, &n, &cpu_only(1000)).expect("fits").score, 0);
        place(&mut n, 1, &shared(0, 500), &[0]);
        // Only its own class: 75, plus floor(25 * 500 / 8000) = 1.
        assert_eq!(
            score(PolicyKind::GpuClustering, &n, &shared(1000, 200)).expect("fits").score,
            76
        );
        // Only other classes: 0 + 1.
        assert_eq!(score(PolicyKind::GpuClustering, &n, &whole(1000, 1)).expect("fits").score, 1);
        place(&mut n, 2, &whole(0, 1), &[1]);
        // Own class among others: 50 + floor(25 * 1500 / 8000) = 54.
        assert_eq!(
            score(PolicyKind::GpuClustering, &n, &shared(1000, 200)).expect("fits").score,
            54
        );
    }

    #[test]
    fn gpu_packing_tiers() {
        let mut n = node(96_000, 8);
        // Idle node: max(33 - 8, 8).
        assert_eq!(score(PolicyKind::GpuPacking, &n, &shared(1000, 300)).expect("fits").score, 25);
        assert_eq!(
            score(PolicyKind::GpuPacking, &node(96_000, 2), &shared(1000, 300))
                .expect("fits")
                .score,
            31
        );
        assert_eq!(score(PolicyKind::GpuPacking, &n, &cpu_only(1000)).expect("fits").score, 0);
        place(&mut n, 1, &shared(0, 450), &[2]);
        // Fits the partly used GPU 2 (55 % free): 100 - 55 / 10 = 95.
        let s = score(PolicyKind::GpuPacking, &n, &shared(1000, 300)).expect("fits");
        assert_eq!((s.score, s.gpus), (95, GpuSet::single(2)));
        // Needs a free GPU on a used node: 50 - 1; two whole GPUs: 50 - 2.
        assert_eq!(score(PolicyKind::GpuPacking, &n, &shared(1000, 600)).expect("fits").score, 49);
        assert_eq!(score(PolicyKind::GpuPacking, &n, &whole(1000, 2)).expect("fits").score, 48);
    }

    #[test]
    fn fgd_picks_the_gpu_that_fragments_least() {
        let shape = |milli: u32, count: u32| TaskShape {
            cpu: MilliCpu(1000),
            milli_per_gpu: MilliGpu(milli),
            gpu_count: count,
            models: vec![],
            memory: None,
        };
        let target = TargetWorkload::from_shapes(vec![(shape(500, 1), 0.5), (shape(1000, 1), 0.5)]);
        let fgd = Policy::new(PolicyKind::Fgd, Arc::new(target), Normalisers::default());
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let mut n = node(8000, 2);
        // Empty: F = 0. Either GPU leaves 700 that a whole GPU cannot use: F' = 350,
        // score floor(100 sigmoid(-0.35)) = 41, lowest index on the tie.
        let s = fgd.score(&n, &shared(1000, 300), &mut rng).expect("fits");
        assert_eq!((s.score, s.gpus), (41, GpuSet::single(0)));
        place(&mut n, 1, &shared(1000, 300), &[0]);
        // Now GPU 0 (700 free) gives F' = 400 (delta -50, score 48); GPU 1 gives F' = 700
        // (delta -350, score 41).
        let s = fgd.score(&n, &shared(1000, 300), &mut rng).expect("fits");
        assert_eq!((s.score, s.gpus), (48, GpuSet::single(0)));
    }

    #[test]
    fn random_picks_any_fitting_gpu_and_whole_gpus_lowest_first() {
        let mut n = node(96_000, 4);
        place(&mut n, 1, &shared(0, 900), &[1]);
        let random = policy(PolicyKind::Random);
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        let mut seen = GpuSet::EMPTY;
        for _ in 0..200 {
            let s = random.score(&n, &shared(1000, 500), &mut rng).expect("fits");
            assert_eq!(s.score, 0);
            assert!(!s.gpus.contains(1), "GPU 1 has only 100 free");
            seen.insert(s.gpus.iter().next().expect("one GPU"));
        }
        assert_eq!(seen, GpuSet::from_indices([0, 2, 3]).expect("small"));
        let s = random.score(&n, &whole(1000, 2), &mut rng).expect("fits");
        assert_eq!(s.gpus, GpuSet::from_indices([0, 2]).expect("small"));
    }

    #[test]
    fn baleen_keeps_cpu_where_gpus_need_it() {
        // The workload: whole-GPU tasks with 11 cores each. A 32-core CPU-only task on the
        // 96-core, 8-GPU node leaves 64 cores for 8 GPUs (2 GPUs stranded); on the 104-core,
        // 2-GPU node it strands nothing. FGD sees no difference (each node still fits one more
        // GPU task); baleen does.
        let gpu_task = whole(11_000, 1);
        let requests =
            vec![gpu_task.clone(); 9].into_iter().chain([cpu_only(32_000)]).collect::<Vec<_>>();
        let crowded = node(96_000, 8);
        let roomy = node(104_000, 2);
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let fgd = Policy::for_requests(PolicyKind::Fgd, &requests, 0.95, Normalisers::default());
        let baleen =
            Policy::for_requests(PolicyKind::Baleen, &requests, 0.95, Normalisers::default());
        let cpu_task = cpu_only(32_000);
        let fgd_scores =
            [&crowded, &roomy].map(|n| fgd.score(n, &cpu_task, &mut rng).expect("fits").score);
        assert_eq!(fgd_scores[0], fgd_scores[1], "fgd is indifferent");
        let b =
            [&crowded, &roomy].map(|n| baleen.score(n, &cpu_task, &mut rng).expect("fits").score);
        assert!(b[1] > b[0], "baleen prefers the node where no GPU is stranded: {b:?}");
        // With nothing stranded either way, baleen is indifferent too.
        let small = cpu_only(1_000);
        let b = [&crowded, &roomy].map(|n| baleen.score(n, &small, &mut rng).expect("fits").score);
        assert_eq!(b[0], b[1]);
    }

    #[test]
    fn baleen_keeps_shared_gpus_on_their_best_packing_patterns() {
        // The workload: whole GPUs, and shares that pack well: 470s in pairs (60 left), 320s
        // three to a GPU or beside a 650. A 320 beside a 470 would leave 210 that no share of
        // the workload can use.
        let requests: Vec<Request> = [(470, 750), (320, 328), (650, 253)]
            .into_iter()
            .flat_map(|(milli, n)| std::iter::repeat_n(shared(1000, milli), n))
            .chain(std::iter::repeat_n(whole(1000, 1), 1500))
            .collect();
        let mut n = node(96_000, 2);
        place(&mut n, 1, &shared(1000, 470), &[0]);
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let baleen =
            Policy::for_requests(PolicyKind::Baleen, &requests, 0.95, Normalisers::default());
        let blind = baleen
            .clone()
            .with_baleen_params(BaleenParams { pattern_weight: 0.0, ..BaleenParams::default() });
        let fgd = Policy::for_requests(PolicyKind::Fgd, &requests, 0.95, Normalisers::default());
        let third = shared(1000, 320);
        // FGD's measure alone fills the 470's GPU: the idle GPU's 680 left would be fragment
        // for every whole-GPU task, while the 530 there already is for all but the 470s.
        for p in [&fgd, &blind] {
            let s = p.score(&n, &third, &mut rng).expect("fits");
            assert_eq!(s.gpus, GpuSet::single(0), "{:?} without pattern prices", p.kind());
        }
        let s = baleen.score(&n, &third, &mut rng).expect("fits");
        assert_eq!(s.gpus, GpuSet::single(1), "baleen keeps the 470's GPU for another 470");
        // Beside a 650 the 320 completes a best pattern, and baleen takes it.
        let mut m = node(96_000, 2);
        place(&mut m, 1, &shared(1000, 650), &[1]);
        let s = baleen.score(&m, &third, &mut rng).expect("fits");
        assert_eq!(s.gpus, GpuSet::single(1));
    }

    #[test]
    fn baleen_target_covers_every_shape_with_memory() {
        let mut big = whole(64_000, 8);
        big.memory = MemMib(256_000);
        let requests: Vec<Request> =
            std::iter::repeat_n(shared(1000, 500), 99).chain([big]).collect();
        let fgd = Policy::for_requests(PolicyKind::Fgd, &requests, 0.95, Normalisers::default());
        let baleen =
            Policy::for_requests(PolicyKind::Baleen, &requests, 0.95, Normalisers::default());
        assert_eq!(fgd.target().shapes().len(), 1, "the paper drops the rare 8-GPU shape");
        assert_eq!(baleen.target().shapes().len(), 2);
        assert!(baleen.target().shapes().iter().all(|(s, _)| s.memory.is_some()));
    }

    /// The descent as first written: every fitting GPU, each state measured on its own.
    fn reference_descent(
        node: &NodeLedger,
        request: &Request,
        levels: f64,
        prices: Option<(&SharePrices, f64)>,
        measure: impl Fn(&NodeSpec, &frag::NodeFree<'_>) -> f64,
    ) -> Option<Scored> {
        let score_of = |delta: f64| (levels / (1.0 + (-delta / 1000.0).exp())).floor() as i64;
        let mut gpus = [0u32; MAX_GPUS_PER_NODE];
        let n = frag::fill_free(node, &mut gpus);
        let spec = node.spec();
        let (cpu, memory) = (node.free_cpu(), node.free_memory());
        let before = measure(spec, &frag::NodeFree { cpu, memory, gpus: &gpus[..n] });
        let cpu = MilliCpu(cpu.0 - request.cpu.0);
        let memory = MemMib(memory.0 - request.memory.0);
        let share = request.gpu.milli_per_gpu().0;
        let mut delta = |set: GpuSet| {
            for i in set.iter() {
                gpus[i] -= share;
            }
            let after = measure(spec, &frag::NodeFree { cpu, memory, gpus: &gpus[..n] });
            for i in set.iter() {
                gpus[i] += share;
            }
            before - after
        };
        if let GpuDemand::Shared { .. } = request.gpu {
            let mut best: Option<Scored> = None;
            for i in node.fitting_gpus(request).iter() {
                let free = node.gpus()[i].milli.0;
                let regret = prices.map_or(0.0, |(p, w)| w * p.regret(free, share));
                let score = score_of(delta(GpuSet::single(i)) - regret);
                if best.is_none_or(|b| score > b.score) {
                    best = Some(Scored { score, gpus: GpuSet::single(i) });
                }
            }
            return best;
        }
        let set = fit::lowest_index_gpus(node, request)?;
        Some(Scored { score: score_of(delta(set)), gpus: set })
    }

    proptest::proptest! {
        /// fgd and baleen score every node and request exactly as the descent that measures
        /// each fitting GPU's state on its own.
        #[test]
        fn descent_equals_the_per_state_reference(
            placed in proptest::collection::vec((0u32..8, 1u32..=1000, 0u64..16), 0..12),
            gpus in 1usize..=8,
            t4 in proptest::collection::vec(proptest::prelude::any::<bool>(), 8),
            asks in proptest::collection::vec((0u32..3, 1u32..=1000, 0u64..40, 0u64..3, proptest::prelude::any::<bool>()), 1..8),
        ) {
            let request = |&(count, milli, cpu, models, big): &(u32, u32, u64, u64, bool)| Request {
                cpu: MilliCpu(cpu * 1000),
                memory: MemMib(if big { 96_000 } else { 8_000 }),
                gpu: match (count, milli) {
                    (0, _) => GpuDemand::None,
                    (n, 1000) => GpuDemand::Whole { count: n },
                    (_, m) => GpuDemand::Shared { milli: MilliGpu(m), memory: MemUnits::ZERO },
                },
                allowed_models: match models {
                    0 => vec![],
                    1 => vec![GpuModel::new("T4")],
                    _ => vec![GpuModel::new("G2")],
                },
            };
            let requests: Vec<Request> = asks.iter().map(request).collect();
            let mut n = NodeLedger::new(NodeSpec {
                name: "n".into(),
                cpu: MilliCpu(64_000),
                memory: MemMib(393_216),
                gpus: (0..gpus)
                    .map(|i| GpuSpec::plain(format!("g{i}"), GpuModel::new(if t4[i] { "T4" } else { "G2" })))
                    .collect(),
            })
            .expect("valid node");
            // Shares of 1000 stand for whole GPUs; what does not fit is skipped.
            for (k, &(gpu, milli, cpu)) in placed.iter().enumerate() {
                let gpu = gpu as usize % gpus;
                let r = if milli == 1000 { whole(cpu * 1000, 1) } else { shared(cpu * 1000, milli) };
                let _ = n.allocate(AllocationId(k as u64), &r, GpuSet::single(gpu));
            }
            let mut rng = ChaCha8Rng::seed_from_u64(1);
            for kind in [PolicyKind::Fgd, PolicyKind::Baleen] {
                let policy = Policy::for_requests(kind, &requests, 0.9, Normalisers::default());
                for r in &requests {
                    let got = policy.score(&n, r, &mut rng);
                    let target = policy.target();
                    let p = &policy.baleen;
                    let want = if !n.fits(r) {
                        None
                    } else if kind == PolicyKind::Fgd {
                        reference_descent(&n, r, 100.0, None, |spec, free| frag::node_fragment(target, spec, free))
                    } else {
                        let prices = Some((&*policy.prices, p.pattern_weight));
                        reference_descent(&n, r, p.score_levels, prices, |spec, free| {
                            frag::node_fragment_with_host(target, spec, free, p.shape_host_weight)
                                + p.host_weight * frag::host_stranded(target.host_needs(), free)
                        })
                    };
                    proptest::prop_assert_eq!(got, want, "{} {:?}", kind, r);
                }
            }
        }
    }

    #[test]
    fn model_constraints_are_respected() {
        let n = node(96_000, 2);
        let mut req = shared(1000, 500);
        req.allowed_models = vec![GpuModel::new("T4")];
        for k in PolicyKind::ALL {
            assert_eq!(score(k, &n, &req), None, "{k}");
        }
        req.allowed_models.push(GpuModel::new("G2"));
        for k in PolicyKind::ALL {
            assert!(score(k, &n, &req).is_some(), "{k}");
        }
    }
}
