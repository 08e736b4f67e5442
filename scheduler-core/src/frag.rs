//! GPU fragmentation as defined by FGD (Weng et al., USENIX ATC 2023), and the target workload
//! it is measured against.
//!
//! For a node with free CPU `c_n`, free compute `r_j` on each GPU and total free `U_n`, and a task
//! shape `m` (CPU `c_m`, per-GPU share `g_m`, `k_m` GPUs, allowed models `T_m`), the free compute
//! that the shape cannot use is:
//! - all of `U_n` for a CPU-only shape, when the CPU does not fit, or when fewer than `k_m` GPUs
//!   of an allowed model have `r_j >= g_m`;
//! - otherwise the sum of `r_j` over GPUs that cannot serve it (`r_j < g_m` or a model not in
//!   `T_m`).
//!
//! The fragmentation of a node is the expectation over the target workload `M`; the cluster's is
//! the sum over nodes. Memory is ignored, as in the paper. The FGD policy scores a placement by
//! how much it lowers this measure; the replay tool records it as a curve.
//!
//! The `baleen` policy extends the measure: shapes may carry memory (checked like CPU), and
//! [`node_fragment_with_host`] and [`host_stranded`] add the GPU compute that the node's free CPU
//! and memory cannot feed.

use crate::ledger::NodeLedger;
use crate::model::{GpuModel, GpuSet, NodeSpec, Request};
use crate::units::{MemMib, MilliCpu, MilliGpu};
use std::collections::HashMap;

/// The parts of a request that fragmentation looks at.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TaskShape {
    /// CPU.
    pub cpu: MilliCpu,
    /// Share of each GPU (0 for CPU-only, 1000 for whole GPUs).
    pub milli_per_gpu: MilliGpu,
    /// Number of GPUs.
    pub gpu_count: u32,
    /// Allowed GPU models (empty = any), sorted.
    pub models: Vec<GpuModel>,
    /// Host memory, when fragmentation counts it (the paper's measure does not).
    pub memory: Option<MemMib>,
}

impl TaskShape {
    /// The shape of `request`, with or without its memory.
    pub fn of(request: &Request, with_memory: bool) -> Self {
        let mut models = request.allowed_models.clone();
        models.sort();
        Self {
            cpu: request.cpu,
            milli_per_gpu: request.gpu.milli_per_gpu(),
            gpu_count: request.gpu.gpu_count(),
            models,
            memory: with_memory.then_some(request.memory),
        }
    }

    fn allows(&self, model: &GpuModel) -> bool {
        self.models.is_empty() || self.models.contains(model)
    }

    /// Whether free CPU and memory cover one task of this shape.
    fn host_fits(&self, cpu: MilliCpu, memory: MemMib) -> bool {
        cpu >= self.cpu && self.memory.is_none_or(|m| memory >= m)
    }

    /// GPU compute that free CPU and memory can feed with tasks of this shape: the tasks they
    /// can feed (unbounded when the shape needs neither) times the shape's GPU demand.
    fn fed(&self, cpu: MilliCpu, memory: MemMib) -> f64 {
        let per = f64::from(self.milli_per_gpu.0) * f64::from(self.gpu_count);
        let mut copies = f64::INFINITY;
        if self.cpu.0 > 0 {
            copies = copies.min(cpu.0 as f64 / self.cpu.0 as f64);
        }
        if let Some(m) = self.memory.filter(|m| m.0 > 0) {
            copies = copies.min(memory.0 as f64 / m.0 as f64);
        }
        copies * per
    }
}

/// The GPU side of a task shape: what [`shape_fragment`] reads once host resources fit.
/// Shapes that differ only in CPU or memory share one (the Alibaba trace's 151 shapes have 25).
#[derive(Clone, Debug, PartialEq)]
struct GpuPart {
    milli_per_gpu: u32,
    gpu_count: u32,
    models: Vec<GpuModel>,
}

/// The task shapes a cluster expects, with their probabilities.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TargetWorkload {
    shapes: Vec<(TaskShape, f64)>,
    distinct: usize,
    needs: (f64, f64),
    /// The distinct GPU parts of the shapes.
    gpu_parts: Vec<GpuPart>,
    /// For each shape, its index in `gpu_parts`; `None` for CPU-only shapes.
    part_of: Vec<Option<usize>>,
}

impl TargetWorkload {
    /// Builds the target workload from a list of requests, as the FGD paper does: group by
    /// shape (with memory as part of the shape if `with_memory`; the paper leaves it out), sort the groups by count (descending; ties keep first appearance), keep the
    /// shortest prefix covering at least `coverage` (0..=1) of the requests, and renormalise
    /// the kept counts into probabilities.
    pub fn from_requests<'a>(
        requests: impl IntoIterator<Item = &'a Request>,
        coverage: f64,
        with_memory: bool,
    ) -> Self {
        let mut groups = ShapeCounts::default();
        for request in requests {
            groups.add(TaskShape::of(request, with_memory));
        }
        Self::from_counts(groups.groups, coverage)
    }

    /// The paper's cut over shapes already counted, in order of first appearance.
    fn from_counts(mut groups: Vec<(TaskShape, u64)>, coverage: f64) -> Self {
        let distinct = groups.len();
        let total: u64 = groups.iter().map(|g| g.1).sum();
        // A stable sort keeps first appearance among equal counts.
        groups.sort_by_key(|g| std::cmp::Reverse(g.1));
        let mut kept = 0;
        let mut covered = 0u64;
        for (_, count) in &groups {
            if total == 0 || covered as f64 >= coverage * total as f64 {
                break;
            }
            covered += count;
            kept += 1;
        }
        groups.truncate(kept);
        let shapes = groups.into_iter().map(|(s, c)| (s, c as f64 / covered as f64)).collect();
        Self::from_parts(shapes, distinct)
    }

    fn from_parts(shapes: Vec<(TaskShape, f64)>, distinct: usize) -> Self {
        let mut gpu_parts: Vec<GpuPart> = Vec::new();
        let part_of = shapes
            .iter()
            .map(|(shape, _)| {
                if shape.gpu_count == 0 {
                    return None;
                }
                let part = GpuPart {
                    milli_per_gpu: shape.milli_per_gpu.0,
                    gpu_count: shape.gpu_count,
                    models: shape.models.clone(),
                };
                Some(gpu_parts.iter().position(|p| *p == part).unwrap_or_else(|| {
                    gpu_parts.push(part);
                    gpu_parts.len() - 1
                }))
            })
            .collect();
        let mut t = Self { shapes, distinct, needs: (0.0, 0.0), gpu_parts, part_of };
        t.needs = per_gpu_needs(&t);
        t
    }

    /// A target workload with given shapes and probabilities (which should sum to 1).
    pub fn from_shapes(shapes: Vec<(TaskShape, f64)>) -> Self {
        let distinct = shapes.len();
        Self::from_parts(shapes, distinct)
    }

    /// CPU (milli) and memory (MiB) the GPU tasks of the workload need per milli-GPU, on
    /// average (memory 0 unless shapes carry memory).
    pub fn host_needs(&self) -> (f64, f64) {
        self.needs
    }

    /// The kept shapes and their probabilities.
    pub fn shapes(&self) -> &[(TaskShape, f64)] {
        &self.shapes
    }

    /// How many distinct shapes the source list had before the cut.
    pub fn distinct_shapes(&self) -> usize {
        self.distinct
    }
}

/// Shapes with their counts, in order of first appearance. A shape whose count falls to 0
/// keeps its place (a live history sees few distinct shapes).
#[derive(Clone, Debug, Default)]
struct ShapeCounts {
    index: HashMap<TaskShape, usize>,
    groups: Vec<(TaskShape, u64)>,
}

impl ShapeCounts {
    fn add(&mut self, shape: TaskShape) {
        match self.index.get(&shape) {
            Some(&i) => self.groups[i].1 += 1,
            None => {
                self.index.insert(shape.clone(), self.groups.len());
                self.groups.push((shape, 1));
            }
        }
    }

    fn remove(&mut self, shape: &TaskShape) {
        if let Some(&i) = self.index.get(shape) {
            self.groups[i].1 = self.groups[i].1.saturating_sub(1);
        }
    }

    /// The shapes seen at least once, with their counts.
    fn counted(&self) -> Vec<(TaskShape, u64)> {
        self.groups.iter().filter(|g| g.1 > 0).cloned().collect()
    }
}

/// The target workload a live component can know: the paper's rule (group by shape, keep the
/// most frequent shapes covering `coverage` of the tasks, renormalise) over the last `window`
/// tasks it has seen, not over a whole trace. The agent's fragmentation metric and the extender
/// learn their target this way; with no task seen yet the target is empty and every node's
/// fragmentation is 0.
#[derive(Clone, Debug)]
pub struct RecentWorkload {
    window: usize,
    coverage: f64,
    recent: std::collections::VecDeque<TaskShape>,
    counts: ShapeCounts,
}

impl RecentWorkload {
    /// How many recent tasks a live target is learned from unless told otherwise.
    pub const DEFAULT_WINDOW: usize = 1000;
    /// The paper's coverage (95 % of the tasks).
    pub const DEFAULT_COVERAGE: f64 = 0.95;

    /// An empty history that keeps the last `window` tasks (at least one).
    pub fn new(window: usize, coverage: f64) -> Self {
        let window = window.max(1);
        Self {
            window,
            coverage,
            recent: std::collections::VecDeque::with_capacity(window.min(4096)),
            counts: ShapeCounts::default(),
        }
    }

    /// Records one task; the oldest leaves when the window is full.
    pub fn record(&mut self, shape: TaskShape) {
        if self.recent.len() == self.window
            && let Some(old) = self.recent.pop_front()
        {
            self.counts.remove(&old);
        }
        self.counts.add(shape.clone());
        self.recent.push_back(shape);
    }

    /// How many tasks the target is learned from now.
    pub fn len(&self) -> usize {
        self.recent.len()
    }

    /// Whether no task has been seen.
    pub fn is_empty(&self) -> bool {
        self.recent.is_empty()
    }

    /// The target workload of the tasks in the window.
    pub fn target(&self) -> TargetWorkload {
        TargetWorkload::from_counts(self.counts.counted(), self.coverage)
    }
}

impl Default for RecentWorkload {
    fn default() -> Self {
        Self::new(Self::DEFAULT_WINDOW, Self::DEFAULT_COVERAGE)
    }
}

/// What is free on a node, as fragmentation sees it.
#[derive(Clone, Copy, Debug)]
pub struct NodeFree<'a> {
    /// Free CPU.
    pub cpu: MilliCpu,
    /// Free host memory.
    pub memory: MemMib,
    /// Free compute of each GPU, in device order.
    pub gpus: &'a [u32],
}

/// Free compute of a node that `shape` cannot use, in milli-GPU.
pub fn shape_fragment(shape: &TaskShape, spec: &NodeSpec, free: &NodeFree<'_>) -> u64 {
    let total: u64 = free.gpus.iter().map(|&r| u64::from(r)).sum();
    if shape.gpu_count == 0 || !shape.host_fits(free.cpu, free.memory) {
        return total;
    }
    let g = shape.milli_per_gpu.0;
    let mut usable = 0u32;
    let mut unusable = 0u64;
    for (r, gpu) in free.gpus.iter().zip(&spec.gpus) {
        if *r >= g && shape.allows(&gpu.model) {
            usable += 1;
        } else {
            unusable += u64::from(*r);
        }
    }
    if usable < shape.gpu_count { total } else { unusable }
}

fn per_gpu_needs(target: &TargetWorkload) -> (f64, f64) {
    let (mut cpu, mut mem, mut gpu) = (0.0, 0.0, 0.0);
    for (s, p) in &target.shapes {
        if s.gpu_count == 0 {
            continue;
        }
        cpu += p * s.cpu.0 as f64;
        mem += p * s.memory.map_or(0.0, |m| m.0 as f64);
        gpu += p * f64::from(s.milli_per_gpu.0) * f64::from(s.gpu_count);
    }
    if gpu == 0.0 { (0.0, 0.0) } else { (cpu / gpu, mem / gpu) }
}

/// Free GPU compute that the node's free CPU or memory cannot feed at the workload's average
/// needs per milli-GPU ([`TargetWorkload::host_needs`]), in milli-GPU: `U_n - min(c_n / cpu
/// per milli-GPU, m_n / memory per milli-GPU)`, at least 0.
pub fn host_stranded(needs: (f64, f64), free: &NodeFree<'_>) -> f64 {
    let u: f64 = free.gpus.iter().map(|&r| f64::from(r)).sum();
    let mut usable = u;
    if needs.0 > 0.0 {
        usable = usable.min(free.cpu.0 as f64 / needs.0);
    }
    if needs.1 > 0.0 {
        usable = usable.min(free.memory.0 as f64 / needs.1);
    }
    u - usable
}

/// Expected fragment of a node over `target` (as [`node_fragment`]) plus `weight` times, for
/// each shape, the GPU compute that shape could use but the node's free CPU and memory cannot
/// feed: usable compute beyond `min(c_n / c_m, m_n / mem_m) * g_m * k_m`. The FGD measure sees
/// CPU only as a cliff (one more task fits or not); this term also counts the GPU that a node
/// short of CPU or memory strands for the tasks after the next one.
pub fn node_fragment_with_host(
    target: &TargetWorkload,
    spec: &NodeSpec,
    free: &NodeFree<'_>,
    weight: f64,
) -> f64 {
    let total: u64 = free.gpus.iter().map(|&r| u64::from(r)).sum();
    let mut sum = 0.0;
    for (shape, p) in &target.shapes {
        let f = shape_fragment(shape, spec, free);
        let mut v = f as f64;
        if shape.gpu_count > 0 && f < total {
            let usable = (total - f) as f64;
            let fed = shape.fed(free.cpu, free.memory);
            if fed < usable {
                v += weight * (usable - fed);
            }
        }
        sum += p * v;
    }
    sum
}

/// Expected fragment of a node over `target`, in milli-GPU.
pub fn node_fragment(target: &TargetWorkload, spec: &NodeSpec, free: &NodeFree<'_>) -> f64 {
    target.shapes.iter().map(|(shape, p)| p * shape_fragment(shape, spec, free) as f64).sum()
}

/// Expected fragment of a node in its current state.
pub fn ledger_fragment(target: &TargetWorkload, node: &NodeLedger) -> f64 {
    let mut gpus = [0u32; crate::model::MAX_GPUS_PER_NODE];
    let n = fill_free(node, &mut gpus);
    let free = NodeFree { cpu: node.free_cpu(), memory: node.free_memory(), gpus: &gpus[..n] };
    node_fragment(target, node.spec(), &free)
}

/// A node's state before a placement and after each of its candidate placements: what a
/// fragmentation descent compares. Every candidate takes the same CPU, memory and share of each
/// of its GPUs; only the GPUs differ.
#[derive(Clone, Copy, Debug)]
pub struct Candidates<'a> {
    /// What is free before the placement: one entry in `gpus` per GPU of the node, so at most
    /// [`MAX_GPUS_PER_NODE`](crate::model::MAX_GPUS_PER_NODE), as in every ledger.
    pub before: NodeFree<'a>,
    /// Free CPU after the placement.
    pub cpu_after: MilliCpu,
    /// Free host memory after the placement.
    pub memory_after: MemMib,
    /// The compute the placement takes of each of its GPUs, in milli-GPU.
    pub share: u32,
    /// The candidate GPU sets; each GPU in them has at least `share` free.
    pub sets: &'a [GpuSet],
}

impl Candidates<'_> {
    /// The number of states: the one before, and one after each candidate.
    pub fn states(&self) -> usize {
        self.sets.len() + 1
    }
}

thread_local! {
    /// Scratch words of [`TargetWorkload::candidate_fragments`], kept between calls: a fresh
    /// buffer each call (a heap allocation, or zeroing a large stack array) cost more than the
    /// arithmetic it holds. Taken out while in use, so a nested call would only allocate anew.
    static SCRATCH: std::cell::Cell<Vec<u64>> = const { std::cell::Cell::new(Vec::new()) };
}

impl TargetWorkload {
    /// [`node_fragment`] of the state before the placement into `out[0]`, and of the state
    /// after candidate `j` into `out[1 + j]`: bit for bit what calling it on each state gives.
    ///
    /// # Panics
    /// If `out` has fewer than [`Candidates::states`] entries.
    pub fn candidate_fragments(
        &self,
        spec: &NodeSpec,
        candidates: &Candidates<'_>,
        out: &mut [f64],
    ) {
        self.candidate_measures(spec, candidates, None, out);
    }

    /// [`node_fragment_with_host`] of each state, as [`TargetWorkload::candidate_fragments`].
    ///
    /// # Panics
    /// If `out` has fewer than [`Candidates::states`] entries.
    pub fn candidate_fragments_with_host(
        &self,
        spec: &NodeSpec,
        candidates: &Candidates<'_>,
        weight: f64,
        out: &mut [f64],
    ) {
        self.candidate_measures(spec, candidates, Some(weight), out);
    }

    /// The measure of every state in one pass over the shapes, where calling the per-state
    /// functions costs a pass over every shape and GPU for each state. Two facts make it cheap
    /// and exact:
    /// - the GPU side of [`shape_fragment`] (how many GPUs serve a shape, and the compute of the
    ///   rest) depends only on the shape's [`GpuPart`], so it is counted once per part and
    ///   state; after a candidate, only the GPUs of its set change, so each state's counts are
    ///   the state before's, corrected for those GPUs. These are integers: exact.
    /// - the host side (whether CPU and memory fit a task, and the GPU they can feed) is the
    ///   same for all states after a placement, so it is computed twice per shape, not once per
    ///   state.
    ///
    /// Each state's sum then adds the very terms the per-state functions add, in the same
    /// (shape) order, from the same starting value, so the floating-point results are equal.
    fn candidate_measures(
        &self,
        spec: &NodeSpec,
        candidates: &Candidates<'_>,
        host_weight: Option<f64>,
        out: &mut [f64],
    ) {
        let states = candidates.states();
        let out = &mut out[..states];
        let gpus = candidates.before.gpus;
        let share = candidates.share;
        // shape_fragment pairs free compute with the GPUs of the spec: GPUs past the shorter
        // of the two count in the total only.
        let paired = gpus.len().min(spec.gpus.len());
        // Scratch: the free compute of each state, then the GPU-side fragment of each part
        // in each state (row `1 + part`).
        let mut scratch = SCRATCH.take();
        scratch.clear();
        scratch.resize(states * (self.gpu_parts.len() + 1), 0);
        let (totals, parts) = scratch.split_at_mut(states);
        totals[0] = gpus.iter().map(|&r| u64::from(r)).sum();
        for (j, set) in candidates.sets.iter().enumerate() {
            let taken: u64 = set
                .iter()
                .filter(|&i| i < gpus.len())
                .map(|i| u64::from(gpus[i] - gpus[i].saturating_sub(share)))
                .sum();
            totals[1 + j] = totals[0] - taken;
        }
        for (part, row) in self.gpu_parts.iter().zip(parts.chunks_exact_mut(states)) {
            let mut allowed = GpuSet::EMPTY;
            for (i, gpu) in spec.gpus[..paired].iter().enumerate() {
                if part.models.is_empty() || part.models.contains(&gpu.model) {
                    allowed.insert(i);
                }
            }
            let serves = |i: usize, free: u32| allowed.contains(i) && free >= part.milli_per_gpu;
            let (mut usable, mut unusable) = (0u32, 0u64);
            for (i, &r) in gpus[..paired].iter().enumerate() {
                if serves(i, r) {
                    usable += 1;
                } else {
                    unusable += u64::from(r);
                }
            }
            let fragment = |usable: u32, unusable: u64, total: u64| {
                if usable < part.gpu_count { total } else { unusable }
            };
            row[0] = fragment(usable, unusable, totals[0]);
            for (j, set) in candidates.sets.iter().enumerate() {
                let (mut u, mut un) = (usable, unusable);
                for i in set.iter().filter(|&i| i < paired) {
                    let (was, now) = (gpus[i], gpus[i].saturating_sub(share));
                    if serves(i, was) {
                        u -= 1;
                    } else {
                        un -= u64::from(was);
                    }
                    if serves(i, now) {
                        u += 1;
                    } else {
                        un += u64::from(now);
                    }
                }
                row[1 + j] = fragment(u, un, totals[1 + j]);
            }
        }
        // node_fragment sums with Iterator::sum (whose starting value is -0.0 in recent Rust
        // releases), node_fragment_with_host from 0.0: start where each starts.
        out.fill(if host_weight.is_some() { 0.0 } else { std::iter::empty::<f64>().sum() });
        let before = &candidates.before;
        for ((shape, p), part) in self.shapes.iter().zip(&self.part_of) {
            let fits = [
                shape.host_fits(before.cpu, before.memory),
                shape.host_fits(candidates.cpu_after, candidates.memory_after),
            ];
            // shape_fragment of state `s`.
            let fragment = |s: usize| match part {
                Some(k) if fits[usize::from(s > 0)] => parts[k * states + s],
                _ => totals[s],
            };
            match host_weight {
                None => {
                    for (s, sum) in out.iter_mut().enumerate() {
                        *sum += p * fragment(s) as f64;
                    }
                }
                Some(weight) => {
                    let fed = [
                        shape.fed(before.cpu, before.memory),
                        shape.fed(candidates.cpu_after, candidates.memory_after),
                    ];
                    for (s, sum) in out.iter_mut().enumerate() {
                        let (f, total) = (fragment(s), totals[s]);
                        let mut v = f as f64;
                        if shape.gpu_count > 0 && f < total {
                            let usable = (total - f) as f64;
                            let fed = fed[usize::from(s > 0)];
                            if fed < usable {
                                v += weight * (usable - fed);
                            }
                        }
                        *sum += p * v;
                    }
                }
            }
        }
        SCRATCH.set(scratch);
    }
}

/// Copies the free compute of each GPU of `node` into `out` and returns how many there are.
pub(crate) fn fill_free(
    node: &NodeLedger,
    out: &mut [u32; crate::model::MAX_GPUS_PER_NODE],
) -> usize {
    for (slot, g) in out.iter_mut().zip(node.gpus()) {
        *slot = g.milli.0;
    }
    node.gpus().len()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{GpuDemand, GpuSpec};
    use proptest::prelude::*;

    fn spec(gpus: usize) -> NodeSpec {
        let model = GpuModel::new("G2");
        NodeSpec {
            name: "n".into(),
            cpu: MilliCpu(96_000),
            memory: MemMib(393_216),
            gpus: (0..gpus).map(|i| GpuSpec::plain(format!("g{i}"), model.clone())).collect(),
        }
    }

    fn whole(cpu: u64, memory: u64) -> Request {
        Request {
            cpu: MilliCpu(cpu),
            memory: MemMib(memory),
            gpu: GpuDemand::Whole { count: 1 },
            allowed_models: vec![],
        }
    }

    /// Requests of a few shapes: CPU-only, shared, whole; any model or one of two; with memory.
    fn request() -> impl Strategy<Value = Request> {
        (0u64..=8, 0u64..=4, 0u32..=3, prop_oneof![Just(1000u32), 100u32..=999], 0usize..3)
            .prop_map(|(cpu, memory, count, milli, models)| Request {
                cpu: MilliCpu(cpu * 4000),
                memory: MemMib(memory * 32_000),
                gpu: match (count, milli) {
                    (0, _) => GpuDemand::None,
                    (n, 1000) => GpuDemand::Whole { count: n },
                    (_, m) => GpuDemand::Shared { milli: MilliGpu(m), memory: Default::default() },
                },
                allowed_models: [vec![], vec![GpuModel::new("A")], vec![GpuModel::new("B")]]
                    [models]
                    .clone(),
            })
    }

    proptest! {
        /// The measures of a node before a placement and after each candidate, computed
        /// together, are bit for bit those of each state computed on its own.
        #[test]
        fn candidate_fragments_equal_the_per_state_measures(
            requests in proptest::collection::vec(request(), 1..30),
            with_memory in any::<bool>(),
            models in proptest::collection::vec(0usize..3, 0..=8),
            free in proptest::collection::vec(prop_oneof![Just(1000u32), 0u32..=1000], 8),
            host in (0u64..=40, 0u64..=8, 0u64..=40, 0u64..=8),
            share in prop_oneof![Just(1000u32), 1u32..=1000],
            weight in 0.0f64..4.0,
        ) {
            let target = TargetWorkload::from_requests(&requests, 0.9, with_memory);
            let names = ["A", "B", "C"];
            let spec = NodeSpec {
                name: "n".into(),
                cpu: MilliCpu(160_000),
                memory: MemMib(1 << 20),
                gpus: models
                    .iter()
                    .enumerate()
                    .map(|(i, &m)| GpuSpec::plain(format!("g{i}"), GpuModel::new(names[m])))
                    .collect(),
            };
            let gpus = &free[..models.len()];
            let before = NodeFree {
                cpu: MilliCpu(host.0 * 4000),
                memory: MemMib(host.2 * 32_000),
                gpus,
            };
            let (cpu_after, memory_after) = (
                MilliCpu(before.cpu.0.saturating_sub(host.1 * 4000)),
                MemMib(before.memory.0.saturating_sub(host.3 * 32_000)),
            );
            // Every GPU with the share free on its own, and the GPUs with it free together.
            let fitting: Vec<usize> = (0..gpus.len()).filter(|&i| gpus[i] >= share).collect();
            let mut sets: Vec<GpuSet> = fitting.iter().map(|&i| GpuSet::single(i)).collect();
            sets.push(GpuSet::from_indices(fitting.iter().copied()).expect("small"));
            let candidates = Candidates { before, cpu_after, memory_after, share, sets: &sets };
            let mut states = vec![before];
            let mut after = Vec::new();
            for set in &sets {
                let mut g = gpus.to_vec();
                for i in set.iter() {
                    g[i] -= share;
                }
                after.push(g);
            }
            states.extend(after.iter().map(|g| NodeFree { cpu: cpu_after, memory: memory_after, gpus: g }));
            let mut fast = vec![f64::NAN; states.len()];
            target.candidate_fragments(&spec, &candidates, &mut fast);
            let mut fast_host = vec![f64::NAN; states.len()];
            target.candidate_fragments_with_host(&spec, &candidates, weight, &mut fast_host);
            for (s, free) in states.iter().enumerate() {
                let slow = node_fragment(&target, &spec, free);
                prop_assert_eq!(fast[s].to_bits(), slow.to_bits(), "state {}: {} != {}", s, fast[s], slow);
                let slow = node_fragment_with_host(&target, &spec, free, weight);
                prop_assert_eq!(fast_host[s].to_bits(), slow.to_bits(), "state {}: {} != {}", s, fast_host[s], slow);
            }
        }
    }

    proptest! {
        /// A live history holds exactly the shapes of the last `window` tasks, with their
        /// frequencies (ties at a coverage cut may differ in order, so the whole list is kept).
        #[test]
        fn recent_workload_is_the_target_of_the_last_window_tasks(
            requests in proptest::collection::vec(request(), 0..60),
            window in 1usize..20,
        ) {
            let mut recent = RecentWorkload::new(window, 1.0);
            for r in &requests {
                recent.record(TaskShape::of(r, false));
            }
            let last = &requests[requests.len().saturating_sub(window)..];
            prop_assert_eq!(recent.len(), last.len());
            let sorted = |t: &TargetWorkload| {
                let mut v: Vec<(TaskShape, u64)> =
                    t.shapes().iter().map(|(s, p)| (s.clone(), p.to_bits())).collect();
                v.sort();
                v
            };
            let expected = TargetWorkload::from_requests(last, 1.0, false);
            prop_assert_eq!(sorted(&recent.target()), sorted(&expected));
            prop_assert_eq!(recent.target().distinct_shapes(), expected.distinct_shapes());
        }
    }

    #[test]
    fn recent_workload_forgets_the_oldest_task_and_cuts_at_coverage() {
        let shape = |milli| {
            TaskShape::of(
                &Request {
                    cpu: MilliCpu(0),
                    memory: MemMib(0),
                    gpu: GpuDemand::Shared { milli: MilliGpu(milli), memory: Default::default() },
                    allowed_models: vec![],
                },
                false,
            )
        };
        let mut recent = RecentWorkload::new(20, RecentWorkload::DEFAULT_COVERAGE);
        assert!(recent.is_empty());
        assert!(recent.target().shapes().is_empty(), "nothing seen: no target");
        recent.record(shape(100));
        for _ in 0..19 {
            recent.record(shape(500));
        }
        // 19 of 20 tasks cover 95 %: the single 0.1-GPU task is cut.
        assert_eq!(recent.target().shapes(), &[(shape(500), 1.0)]);
        assert_eq!(recent.target().distinct_shapes(), 2);
        recent.record(shape(500));
        // The 0.1-GPU task left the window.
        assert_eq!(recent.len(), 20);
        assert_eq!(recent.target().distinct_shapes(), 1);
        for _ in 0..2 {
            recent.record(shape(250));
        }
        let target = recent.target();
        assert_eq!(target.shapes().len(), 2);
        assert!((target.shapes()[0].1 - 18.0 / 20.0).abs() < 1e-12);
    }

    #[test]
    fn host_stranded_counts_gpu_that_cpu_cannot_feed() {
        let target = TargetWorkload::from_requests([&whole(11_000, 0)], 1.0, false);
        assert_eq!(target.host_needs(), (11.0, 0.0));
        let gpus = [1000u32; 8];
        let free = |cpu| NodeFree { cpu: MilliCpu(cpu), memory: MemMib(0), gpus: &gpus };
        // 96 cores feed 8 GPUs at 11 cores each: nothing stranded.
        assert_eq!(host_stranded(target.host_needs(), &free(96_000)), 0.0);
        // 64 cores feed 5.8 GPUs: 2.18 GPUs stranded.
        let s = host_stranded(target.host_needs(), &free(64_000));
        assert!((s - (8000.0 - 64_000.0 / 11.0)).abs() < 1e-9, "{s}");
    }

    #[test]
    fn per_shape_host_term_adds_to_the_fgd_measure() {
        let target = TargetWorkload::from_requests([&whole(11_000, 48_000)], 1.0, true);
        let gpus = [1000u32; 8];
        let spec = spec(8);
        let roomy = NodeFree { cpu: MilliCpu(96_000), memory: MemMib(393_216), gpus: &gpus };
        let short = NodeFree { cpu: MilliCpu(33_000), memory: MemMib(393_216), gpus: &gpus };
        for free in [&roomy, &short] {
            assert_eq!(
                node_fragment_with_host(&target, &spec, free, 0.0),
                node_fragment(&target, &spec, free)
            );
        }
        // FGD: one more task fits either way, so nothing is fragmented.
        assert_eq!(node_fragment(&target, &spec, &short), 0.0);
        // 33 cores feed 3 tasks: 5 GPUs stranded, counted at the weight.
        assert!((node_fragment_with_host(&target, &spec, &short, 0.5) - 2500.0).abs() < 1e-9);
        // Memory too: 100 GiB free feeds 2 tasks of 48,000 MiB.
        let low_mem = NodeFree { cpu: MilliCpu(96_000), memory: MemMib(100_000), gpus: &gpus };
        let expected = 1.0 * (8000.0 - 100_000.0 / 48_000.0 * 1000.0);
        assert!((node_fragment_with_host(&target, &spec, &low_mem, 1.0) - expected).abs() < 1e-9);
    }
}
