//! The kube-scheduler extender: HTTP `filter` and `prioritize` over `baleen-scheduler-core`,
//! reading each node's GPUs from the gpu-state annotation its agent publishes
//! (docs/gpu-state.md).
//!
//! - [`protocol`]: the extender protocol's JSON (kube-scheduler's Go field names);
//! - [`demand`]: what a pod asks of baleen resources, CPU and memory;
//! - [`place`]: which nodes fit (the filter) and how well (the policy's score).

pub mod demand;
pub mod place;
pub mod protocol;
