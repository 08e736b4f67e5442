//! Feasibility: whether a request fits a node, and which GPUs can serve it.
//!
//! A GPU serves a shared request when its model is allowed and it has the compute share and
//! memory units free; it serves a whole-GPU request only when nothing is allocated on it. A node
//! fits when its free CPU and memory cover the request and enough of its GPUs can serve it.

use crate::ledger::NodeLedger;
use crate::model::{GpuDemand, GpuSet, Request};

/// Whether GPU `index` of `node` can serve one GPU's worth of `request`.
pub fn gpu_fits(node: &NodeLedger, index: usize, request: &Request) -> bool {
    let spec = &node.spec().gpus[index];
    if !request.allows_model(&spec.model) {
        return false;
    }
    let free = node.gpus()[index];
    match request.gpu {
        GpuDemand::None => false,
        GpuDemand::Whole { .. } => node.gpu_is_idle(index),
        GpuDemand::Shared { milli, memory } => free.milli >= milli && free.memory >= memory,
    }
}

/// The GPUs of `node` that can serve one GPU's worth of `request`.
pub fn fitting_gpus(node: &NodeLedger, request: &Request) -> GpuSet {
    let mut set = GpuSet::EMPTY;
    for i in 0..node.gpus().len() {
        if gpu_fits(node, i, request) {
            set.insert(i);
        }
    }
    set
}

/// Whether free CPU and memory cover the request.
pub fn host_fits(node: &NodeLedger, request: &Request) -> bool {
    node.free_cpu() >= request.cpu && node.free_memory() >= request.memory
}

/// Whether `request` fits on `node` at all.
pub fn node_fits(node: &NodeLedger, request: &Request) -> bool {
    host_fits(node, request)
        && (request.gpu.gpu_count() == 0
            || fitting_gpus(node, request).len() >= request.gpu.gpu_count() as usize)
}

/// The lowest-indexed GPUs that can serve `request` (empty for CPU-only), or `None` if the node
/// does not fit.
pub fn lowest_index_gpus(node: &NodeLedger, request: &Request) -> Option<GpuSet> {
    if !host_fits(node, request) {
        return None;
    }
    let want = request.gpu.gpu_count() as usize;
    let set = GpuSet::from_indices(fitting_gpus(node, request).iter().take(want))?;
    (set.len() == want).then_some(set)
}

/// For a shared request, the GPU with the least free compute that still fits (lowest index on
/// ties); for other requests the lowest-indexed GPUs. `None` if the node does not fit.
pub fn best_fit_gpus(node: &NodeLedger, request: &Request) -> Option<GpuSet> {
    if !matches!(request.gpu, GpuDemand::Shared { .. }) {
        return lowest_index_gpus(node, request);
    }
    if !host_fits(node, request) {
        return None;
    }
    fitting_gpus(node, request)
        .iter()
        .min_by_key(|&i| (node.gpus()[i].milli, i))
        .map(GpuSet::single)
}
