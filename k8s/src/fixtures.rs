//! Pods the front ends' tests share (feature `test-util`), so that each front end's reading of
//! the same pod is checked against the same expectation.

use serde_json::{Value, json};

use crate::gpu_state::{GpuEntry, GpuMode, NodeGpuState, VERSION};
use crate::requests::PodRequests;

/// The gpu-state document of node `node` with one shared H200 per entry of `free` (140 units
/// of 1 GiB, that many free; idle when all are), offering whole GPUs and gpu-memory units.
pub fn h200_state(node: &str, free: &[u32]) -> NodeGpuState {
    NodeGpuState {
        version: VERSION,
        node: node.into(),
        generation: 1,
        memory_unit_bytes: 1 << 30,
        resources: vec![
            "awesome-ai-company.com/gpu".into(),
            "awesome-ai-company.com/gpu-memory".into(),
        ],
        gpus: free
            .iter()
            .zip(0u32..)
            .map(|(&f, index)| GpuEntry {
                index,
                uuid: format!("GPU-{node}-{index}"),
                model: "NVIDIA H200".into(),
                memory_bytes: 140 << 30,
                numa_node: Some(0),
                nvlink_peers: vec![],
                mode: if f == 140 { GpuMode::Idle } else { GpuMode::Shared },
                healthy: true,
                shares_offered: true,
                units_total: 140,
                units_free: f,
                compute_free_milli: f * 1000 / 140,
                mig: vec![],
                pods: vec![],
            })
            .collect(),
        nvlink_groups: vec![],
        unnamed: vec![],
        pod_uids: Default::default(),
        dra: false,
    }
}

/// A pod (`ml/serve`) that takes every branch of the request rule: an init container (4 CPUs)
/// larger than the app containers summed (1.5 + 1), a container with limits only (its limits
/// are its requests), a RuntimeClass overhead (250m, 1 GiB), and container `a` asking 8
/// `awesome-ai-company.com/gpu-memory`. Callers add metadata or status as they need.
pub fn pod_with_overhead() -> Value {
    json!({
        "metadata": {"name": "serve", "namespace": "ml"},
        "spec": {
            "initContainers": [{"name": "warm", "resources": {"requests": {"cpu": "4"}}}],
            "overhead": {"cpu": "250m", "memory": "1Gi"},
            "containers": [
                {"name": "a", "resources": {"requests": {"cpu": "1500m", "memory": "2Gi"},
                    "limits": {"awesome-ai-company.com/gpu-memory": "8"}}},
                {"name": "b", "resources": {"limits": {"cpu": "1", "memory": "1Gi"}}}
            ]
        }
    })
}

/// What kube-scheduler counts for [`pod_with_overhead`]: the init container's 4 CPUs beat the
/// apps' 2.5, plus the overhead's 250m; the apps' 3 GiB of memory beat the init container's
/// none, plus the overhead's 1 GiB.
pub const POD_WITH_OVERHEAD: PodRequests = PodRequests { cpu_milli: 4250, memory_bytes: 4 << 30 };
