//! Pods the front ends' tests share (feature `test-util`), so that each front end's reading of
//! the same pod is checked against the same expectation.

use serde_json::{Value, json};

use crate::requests::PodRequests;

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
