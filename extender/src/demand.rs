//! What a pod asks of a node: its baleen resources per container, and the CPU and memory
//! kube-scheduler accounts for it, read from the pod's containers as kube-scheduler reads them
//! (the larger of the sum over app containers and the largest init container).

use std::collections::BTreeMap;

use baleen_k8s::requests::{ContainerRequests, PodRequests, Role, pod_requests};
use serde_json::Value;

use crate::protocol::{Container, Pod};

/// A quantity as a pod's JSON carries it (a string, or a number) in thousandths, read by the one
/// parser in `baleen-k8s` (the agent reads pods too).
pub fn quantity_milli(value: &Value) -> Option<i128> {
    match value {
        Value::String(s) => baleen_k8s::quantity::quantity_milli(s),
        Value::Number(n) => baleen_k8s::quantity::quantity_milli(&n.to_string()),
        _ => None,
    }
}

/// Why a pod's resources cannot be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DemandError {
    /// A DRA claim of the pod that the extender cannot read yet (answered as an error, so
    /// that kube-scheduler asks again after its backoff).
    #[error("{why}")]
    Claim {
        /// What is missing.
        why: String,
    },
    /// A quantity that is not a Kubernetes quantity.
    #[error("container {container}: {resource} = {value} is not a quantity")]
    Quantity {
        /// The container.
        container: String,
        /// The resource.
        resource: String,
        /// What was there.
        value: String,
    },
    /// A count of devices that is not a whole positive number.
    #[error("container {container}: {resource} = {value} is not a whole number of devices")]
    Count {
        /// The container.
        container: String,
        /// The resource.
        resource: String,
        /// What was there.
        value: String,
    },
}

pub use baleen_scheduler_core::capacity::Ask;

/// The extended resource an [`Ask`] names.
pub trait AskResource {
    /// The resource's name in `domain`.
    fn resource(&self, domain: &str) -> String;
}

impl AskResource for Ask {
    fn resource(&self, domain: &str) -> String {
        match self {
            Ask::GpuMemory(_) => format!("{domain}/gpu-memory"),
            Ask::Gpus(_) => format!("{domain}/gpu"),
            Ask::Mig(p, _) => format!("{domain}/mig-{p}"),
            Ask::NvlinkGroups(s, _) => format!("{domain}/nvlink-group-{s}"),
        }
    }
}

/// What a pod asks of a node.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct Demand {
    /// Per container (app and init), its asks of baleen resources.
    pub asks: Vec<Ask>,
    /// CPU in millicores (requests, as kube-scheduler counts them).
    pub cpu_milli: u64,
    /// Memory in bytes (requests).
    pub memory_bytes: u64,
}

impl Demand {
    /// Whether the pod asks for any baleen resource.
    pub fn is_empty(&self) -> bool {
        self.asks.is_empty()
    }

    /// The pod's demand, reading resources in `domain`, with what its DRA claims of baleen's
    /// classes ask (`claims`) after its containers' asks.
    pub fn of_with_claims(
        pod: &Pod,
        domain: &str,
        claims: &crate::claims::ClaimIndex,
    ) -> Result<Self, DemandError> {
        let mut demand = Self::of(pod, domain)?;
        demand.asks.extend(claims.asks_of(pod).map_err(|why| DemandError::Claim { why })?);
        Ok(demand)
    }

    /// The pod's demand, reading resources in `domain`.
    pub fn of(pod: &Pod, domain: &str) -> Result<Self, DemandError> {
        let all_init = pod.spec.init_containers.as_deref().unwrap_or_default();
        // Sidecars (init containers that keep running) count as app containers.
        let sidecar = |c: &&Container| Role::of_init(c.restart_policy.as_deref()) == Role::Sidecar;
        let app: Vec<&Container> = pod
            .spec
            .containers
            .as_deref()
            .unwrap_or_default()
            .iter()
            .chain(all_init.iter().filter(sidecar))
            .collect();
        let init: Vec<&Container> = all_init.iter().filter(|c| !sidecar(c)).collect();
        let mut asks = Vec::new();
        for c in &app {
            asks.extend(asks_of(c, domain)?);
        }
        // An init container runs alone, and the kubelet hands its devices on to the app
        // containers: a resource needs the larger of the apps' sum and the largest init ask
        // (as kube-scheduler counts it), not both.
        for c in &init {
            for ask in asks_of(c, domain)? {
                let same = |a: &Ask| {
                    std::mem::discriminant(a) == std::mem::discriminant(&ask)
                        && a.resource(domain) == ask.resource(domain)
                };
                let apps: u64 = asks.iter().filter(|a| same(a)).map(Ask::count).sum();
                if ask.count() > apps {
                    asks.retain(|a| !same(a));
                    asks.push(ask);
                }
            }
        }
        // What kube-scheduler counts the pod as requesting: the one rule, in baleen-k8s, with
        // the pod's overhead.
        let reads = |c: &Container, role| {
            host_requests(c).map(|(cpu_milli, memory_bytes)| ContainerRequests {
                role,
                cpu_milli,
                memory_bytes,
            })
        };
        let containers = app
            .iter()
            .map(|c| reads(c, Role::App))
            .chain(init.iter().map(|c| reads(c, Role::Init)))
            .collect::<Result<Vec<_>, _>>()?;
        let overhead = match &pod.spec.overhead {
            Some(o) => {
                let (cpu_milli, memory_bytes) = quantities("(the pod's overhead)", o)?;
                PodRequests { cpu_milli, memory_bytes }
            }
            None => PodRequests::default(),
        };
        let total = pod_requests(&containers, overhead);
        Ok(Self { asks, cpu_milli: total.cpu_milli, memory_bytes: total.memory_bytes })
    }
}

/// A count of devices as a pod asks it: a whole positive number that fits a `u32`, as a string
/// or a number (the filter and the webhook read counts with this one rule).
pub fn device_count(value: &Value) -> Option<u32> {
    let milli = quantity_milli(value)?;
    if milli % 1000 != 0 || milli <= 0 {
        return None;
    }
    u32::try_from(milli / 1000).ok()
}

/// A container's baleen asks: limits, else requests (extended resources must be equal in both).
fn asks_of(c: &Container, domain: &str) -> Result<Vec<Ask>, DemandError> {
    let prefix = format!("{domain}/");
    let merged: BTreeMap<&String, &Value> =
        c.resources.requests.iter().flatten().chain(c.resources.limits.iter().flatten()).collect();
    let mut asks = Vec::new();
    for (name, value) in merged {
        let Some(kind) = name.strip_prefix(&prefix) else { continue };
        let count = || {
            device_count(value).ok_or_else(|| DemandError::Count {
                container: c.name.clone(),
                resource: name.clone(),
                value: value.to_string(),
            })
        };
        let ask = if kind == "gpu-memory" {
            Ask::GpuMemory(count()?)
        } else if kind == "gpu" {
            Ask::Gpus(count()?)
        } else if let Some(profile) = kind.strip_prefix("mig-") {
            Ask::Mig(profile.to_owned(), count()?)
        } else if let Some(size) =
            kind.strip_prefix("nvlink-group-").and_then(|s| s.parse::<u32>().ok())
        {
            Ask::NvlinkGroups(size, count()?)
        } else {
            // Another resource of the domain (e.g. one a newer agent offers): not ours to judge.
            continue;
        };
        asks.push(ask);
    }
    Ok(asks)
}

/// A container's CPU (millicores) and memory (bytes) requests; a limit without a request counts
/// as the request, as the API server defaults it.
/// CPU (millicores) and memory (bytes) in `map` (a pod's overhead), `what` named in errors.
fn quantities(what: &str, map: &BTreeMap<String, Value>) -> Result<(u64, u64), DemandError> {
    let get = |resource: &str| -> Result<u64, DemandError> {
        let Some(value) = map.get(resource) else { return Ok(0) };
        let milli = quantity_milli(value).ok_or_else(|| DemandError::Quantity {
            container: what.to_owned(),
            resource: resource.to_owned(),
            value: value.to_string(),
        })?;
        Ok(u64::try_from(milli).unwrap_or(0))
    };
    Ok((get("cpu")?, get("memory")?.div_ceil(1000)))
}

fn host_requests(c: &Container) -> Result<(u64, u64), DemandError> {
    let get = |resource: &str| -> Result<u64, DemandError> {
        let value = c
            .resources
            .requests
            .as_ref()
            .and_then(|r| r.get(resource))
            .or_else(|| c.resources.limits.as_ref().and_then(|l| l.get(resource)));
        let Some(value) = value else { return Ok(0) };
        let milli = quantity_milli(value).ok_or_else(|| DemandError::Quantity {
            container: c.name.clone(),
            resource: resource.to_owned(),
            value: value.to_string(),
        })?;
        Ok(u64::try_from(milli).unwrap_or(0))
    };
    let cpu = get("cpu")?;
    let memory = get("memory")?.div_ceil(1000);
    Ok((cpu, memory))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod(containers: Value, init: Value) -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": "p", "namespace": "ns"},
            "spec": {"containers": containers, "initContainers": init}
        }))
        .expect("pod")
    }

    #[test]
    fn a_pods_asks_and_host_requests() {
        let p = pod(
            json!([
                {"name": "a", "resources": {"limits": {"awesome-ai-company.com/gpu-memory": "8"},
                                            "requests": {"cpu": "2", "memory": "4Gi"}}},
                {"name": "b", "resources": {"limits": {"awesome-ai-company.com/gpu": 2, "cpu": "1"}}},
                {"name": "c", "resources": {"limits": {"awesome-ai-company.com/mig-1g.10gb": 1,
                    "awesome-ai-company.com/nvlink-group-4": 1, "other.com/gpu": 3}}}
            ]),
            json!([{"name": "i", "resources": {"requests": {"cpu": "8"}}}]),
        );
        let d = Demand::of(&p, "awesome-ai-company.com").expect("reads");
        assert_eq!(
            d.asks,
            [
                Ask::GpuMemory(8),
                Ask::Gpus(2),
                Ask::Mig("1g.10gb".into(), 1),
                Ask::NvlinkGroups(4, 1)
            ]
        );
        assert_eq!(d.cpu_milli, 8000, "the init container's 8 CPUs exceed the apps' 3");
        assert_eq!(d.memory_bytes, 4 << 30);
        let none =
            pod(json!([{"name": "a", "resources": {"requests": {"cpu": "1"}}}]), json!(null));
        assert!(Demand::of(&none, "awesome-ai-company.com").expect("reads").is_empty());
        assert!(Demand::of(&Pod::default(), "awesome-ai-company.com").expect("reads").is_empty());
    }

    /// Issue 23, item 1: a RuntimeClass's overhead is counted, as kube-scheduler counts it
    /// (this copy omitted it); the agent's reading of the same pod agrees
    /// (`isolation::node_pods::tests::a_pod_reads_as_the_api_server_and_kubelet_see_it`).
    #[test]
    fn the_pods_overhead_is_counted_on_top_of_its_containers() {
        use baleen_k8s::fixtures::{POD_WITH_OVERHEAD, pod_with_overhead};
        let p: Pod = serde_json::from_value(pod_with_overhead()).expect("pod");
        let d = Demand::of(&p, "awesome-ai-company.com").expect("reads");
        assert_eq!(
            d.cpu_milli, POD_WITH_OVERHEAD.cpu_milli,
            "the init container's 4 beats 1.5 + 1; overhead"
        );
        assert_eq!(d.memory_bytes, POD_WITH_OVERHEAD.memory_bytes);
        let bad: Pod = serde_json::from_value(json!({
            "metadata": {"name": "p"},
            "spec": {"overhead": {"cpu": "lots"}, "containers": [{"name": "a"}]}
        }))
        .expect("pod");
        let err = Demand::of(&bad, "awesome-ai-company.com").expect_err("not a quantity");
        assert!(err.to_string().contains("overhead"), "{err}");
    }

    #[test]
    fn init_containers_hand_their_devices_on_and_sidecars_add_theirs() {
        let gpu = |n: u32| json!({"limits": {"awesome-ai-company.com/gpu": n}});
        let mem = |n: u32| json!({"limits": {"awesome-ai-company.com/gpu-memory": n}});
        let d = |apps: Value, init: Value| {
            Demand::of(&pod(apps, init), "awesome-ai-company.com").expect("reads").asks
        };
        // The app reuses the init container's GPU: one GPU, not two.
        assert_eq!(
            d(
                json!([{"name": "a", "resources": gpu(1)}]),
                json!([{"name": "i", "resources": gpu(1)}])
            ),
            [Ask::Gpus(1)]
        );
        // A larger init ask wins.
        assert_eq!(
            d(
                json!([{"name": "a", "resources": gpu(1)}]),
                json!([{"name": "i", "resources": gpu(2)}])
            ),
            [Ask::Gpus(2)]
        );
        // Another resource in the init container is asked as well.
        assert_eq!(
            d(
                json!([{"name": "a", "resources": gpu(1)}]),
                json!([{"name": "i", "resources": mem(4)}])
            ),
            [Ask::Gpus(1), Ask::GpuMemory(4)]
        );
        // A sidecar runs beside the app: both asks.
        assert_eq!(
            d(
                json!([{"name": "a", "resources": mem(8)}]),
                json!([{"name": "s", "restartPolicy": "Always", "resources": mem(4)}])
            ),
            [Ask::GpuMemory(8), Ask::GpuMemory(4)]
        );
    }

    #[test]
    fn a_fraction_of_a_device_or_a_bad_quantity_is_refused() {
        let half = pod(
            json!([{"name": "a", "resources": {"limits": {"awesome-ai-company.com/gpu": "500m"}}}]),
            json!(null),
        );
        let err = Demand::of(&half, "awesome-ai-company.com").expect_err("half a GPU");
        assert!(err.to_string().contains("not a whole number"), "{err}");
        let bad =
            pod(json!([{"name": "a", "resources": {"requests": {"cpu": "lots"}}}]), json!(null));
        let err = Demand::of(&bad, "awesome-ai-company.com").expect_err("bad cpu");
        assert!(err.to_string().contains("cpu = \"lots\""), "{err}");
    }
}
