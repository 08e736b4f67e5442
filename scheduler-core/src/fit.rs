//! The candidate search: which GPUs of a node to give a request, by the two simple rules the
//! policies build on. Whether a request fits at all is the ledger's to say
//! ([`NodeLedger::fits`], [`NodeLedger::gpu_fits`]); this module only reads it, so the
//! dependency runs one way, from the search to the ledger.

use crate::ledger::NodeLedger;
use crate::model::{GpuDemand, GpuSet, Request};

/// The lowest-indexed GPUs that can serve `request` (empty for CPU-only), or `None` if the node
/// does not fit.
pub fn lowest_index_gpus(node: &NodeLedger, request: &Request) -> Option<GpuSet> {
    if !node.host_fits(request) {
        return None;
    }
    let want = request.gpu.gpu_count() as usize;
    let set = GpuSet::from_indices(node.fitting_gpus(request).iter().take(want))?;
    (set.len() == want).then_some(set)
}

/// For a shared request, the GPU with the least free compute that still fits (lowest index on
/// ties); for other requests the lowest-indexed GPUs. `None` if the node does not fit.
pub fn best_fit_gpus(node: &NodeLedger, request: &Request) -> Option<GpuSet> {
    if !matches!(request.gpu, GpuDemand::Shared { .. }) {
        return lowest_index_gpus(node, request);
    }
    if !node.host_fits(request) {
        return None;
    }
    node.fitting_gpus(request).iter().min_by_key(|&i| (node.gpus()[i].milli, i)).map(GpuSet::single)
}
