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
use crate::model::{GpuModel, NodeSpec, Request};
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
}

/// The task shapes a cluster expects, with their probabilities.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TargetWorkload {
    shapes: Vec<(TaskShape, f64)>,
    distinct: usize,
    needs: (f64, f64),
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
        let mut index: HashMap<TaskShape, usize> = HashMap::new();
        let mut groups: Vec<(TaskShape, u64)> = Vec::new();
        for request in requests {
            let shape = TaskShape::of(request, with_memory);
            match index.get(&shape) {
                Some(&i) => groups[i].1 += 1,
                None => {
                    index.insert(shape.clone(), groups.len());
                    groups.push((shape, 1));
                }
            }
        }
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
        let mut t = Self { shapes, distinct, needs: (0.0, 0.0) };
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
    if shape.gpu_count == 0 || free.cpu < shape.cpu || shape.memory.is_some_and(|m| free.memory < m)
    {
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
            let per = f64::from(shape.milli_per_gpu.0) * f64::from(shape.gpu_count);
            let mut copies = f64::INFINITY;
            if shape.cpu.0 > 0 {
                copies = copies.min(free.cpu.0 as f64 / shape.cpu.0 as f64);
            }
            if let Some(m) = shape.memory.filter(|m| m.0 > 0) {
                copies = copies.min(free.memory.0 as f64 / m.0 as f64);
            }
            let fed = copies * per;
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
