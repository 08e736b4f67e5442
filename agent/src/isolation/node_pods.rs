//! The pods bound to this node, as the Kubernetes API says (a kube-rs watcher restricted to
//! `spec.nodeName`, in `crate::kube_api`): what the co-location subsystem needs of each (UID,
//! QoS class, class label, CPU and memory requests, phase), the extended resources each of its
//! containers asks for, which the MPS client priority needs to tell which pod an Allocate is for,
//! and its containers' runtime IDs, which the memory watchdog attributes processes with; and the
//! class labels of the namespaces that have one (a second watcher), where co-location takes
//! classes from namespaces.

use std::collections::BTreeMap;

use baleen_k8s::requests::{ContainerRequests, PodRequests, Role, pod_requests};
use k8s_openapi::api::core::v1::{Container, Pod};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

use super::cgroups::Qos;
use super::colocation::{CLASS_LABEL, NodePod};

/// One pod of the node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodInfo {
    /// Its UID.
    pub uid: String,
    /// Its namespace.
    pub namespace: String,
    /// Its name.
    pub name: String,
    /// Its QoS class (`status.qosClass`, else worked out from the containers as the API server
    /// does).
    pub qos: Qos,
    /// The value of the class label, if any.
    pub class_label: Option<String>,
    /// `status.phase` (`Pending` when the API has none yet).
    pub phase: String,
    /// Whether any container has started (running or ended).
    pub started: bool,
    /// The CPU request kube-scheduler counts for it, millicores.
    pub cpu_request_milli: u64,
    /// Its memory request, bytes.
    pub memory_request_bytes: u64,
    /// Every container's (init and app) extended-resource asks: `(container, resource, count)`.
    pub asks: Vec<(String, String, u64)>,
    /// The runtime's IDs of its containers (init, app, ephemeral; the current one and the last
    /// ended one of each, from `status`), without the `<runtime>://` prefix: `(ID, container)`.
    /// What the memory watchdog maps a process's cgroup to a container name with.
    pub container_ids: Vec<(String, String)>,
}

impl PodInfo {
    /// Reads `pod`; `None` without a UID (never the case for a pod the API server stored).
    pub fn of(pod: &Pod) -> Option<Self> {
        let uid = pod.metadata.uid.clone()?;
        let spec = pod.spec.as_ref();
        let apps: Vec<&Container> = spec.map(|s| s.containers.iter().collect()).unwrap_or_default();
        let inits: Vec<&Container> = spec
            .and_then(|s| s.init_containers.as_ref())
            .map(|c| c.iter().collect())
            .unwrap_or_default();
        // What kube-scheduler counts the pod as requesting: the one rule, in baleen-k8s.
        let reads = |c: &Container, role| ContainerRequests {
            role,
            cpu_milli: request(c, "cpu"),
            memory_bytes: request(c, "memory") / 1000,
        };
        let containers: Vec<ContainerRequests> = apps
            .iter()
            .map(|c| reads(c, Role::App))
            .chain(inits.iter().map(|c| reads(c, Role::of_init(c.restart_policy.as_deref()))))
            .collect();
        // The pod's overhead (its RuntimeClass's), counted by kube-scheduler and the kubelet.
        let overhead =
            spec.and_then(|s| s.overhead.as_ref()).map_or_else(PodRequests::default, |o| {
                PodRequests {
                    cpu_milli: o.get("cpu").map_or(0, milli),
                    memory_bytes: o.get("memory").map_or(0, milli) / 1000,
                }
            });
        let PodRequests { cpu_milli: cpu, memory_bytes: memory } =
            pod_requests(&containers, overhead);
        let mut asks = Vec::new();
        for c in inits.iter().chain(apps.iter()) {
            let resources = c.resources.as_ref();
            let limits = resources.and_then(|r| r.limits.as_ref());
            let requests = resources.and_then(|r| r.requests.as_ref());
            // Extended resources: limits, else requests (the API server requires both equal).
            let merged: BTreeMap<&String, &Quantity> =
                requests.into_iter().flatten().chain(limits.into_iter().flatten()).collect();
            for (resource, value) in merged {
                if !resource.contains('/') {
                    continue;
                }
                let count = milli(value) / 1000;
                if count > 0 {
                    asks.push((c.name.clone(), resource.clone(), count));
                }
            }
        }
        let status = pod.status.as_ref();
        let qos = match status.and_then(|s| s.qos_class.as_deref()) {
            Some("Guaranteed") => Qos::Guaranteed,
            Some("Burstable") => Qos::Burstable,
            Some("BestEffort") => Qos::BestEffort,
            _ => qos_of(&apps, &inits),
        };
        let mut container_ids = Vec::new();
        for c in status.into_iter().flat_map(|s| {
            s.container_statuses
                .iter()
                .flatten()
                .chain(s.init_container_statuses.iter().flatten())
                .chain(s.ephemeral_container_statuses.iter().flatten())
        }) {
            let last = c.last_state.as_ref().and_then(|l| l.terminated.as_ref());
            let ended = c.state.as_ref().and_then(|s| s.terminated.as_ref());
            let ids = [c.container_id.as_deref(), last.and_then(|t| t.container_id.as_deref())]
                .into_iter()
                .chain([ended.and_then(|t| t.container_id.as_deref())])
                .flatten();
            for id in ids {
                let bare = id.rsplit_once("://").map_or(id, |(_, bare)| bare);
                if !bare.is_empty() && !container_ids.iter().any(|(known, _)| known == bare) {
                    container_ids.push((bare.to_owned(), c.name.clone()));
                }
            }
        }
        let started = status
            .into_iter()
            .flat_map(|s| {
                s.container_statuses
                    .iter()
                    .flatten()
                    .chain(s.init_container_statuses.iter().flatten())
            })
            .any(|c| {
                c.state.as_ref().is_some_and(|s| s.running.is_some() || s.terminated.is_some())
            });
        Some(Self {
            uid,
            namespace: pod.metadata.namespace.clone().unwrap_or_default(),
            name: pod.metadata.name.clone().unwrap_or_default(),
            qos,
            class_label: pod.metadata.labels.as_ref().and_then(|l| l.get(CLASS_LABEL)).cloned(),
            phase: status.and_then(|s| s.phase.clone()).unwrap_or_else(|| "Pending".into()),
            started,
            cpu_request_milli: cpu,
            memory_request_bytes: memory,
            asks,
            container_ids,
        })
    }

    /// The name of the container the runtime knows as `id`, if its status names it.
    pub fn container_named_by(&self, id: &str) -> Option<&str> {
        self.container_ids.iter().find(|(known, _)| known == id).map(|(_, name)| name.as_str())
    }

    /// `namespace/name`.
    pub fn key(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }

    /// Running: the co-location policy applies to it.
    pub fn running(&self) -> bool {
        self.phase == "Running"
    }

    /// Being admitted: pending and no container started yet.
    pub fn admitting(&self) -> bool {
        self.phase == "Pending" && !self.started
    }

    /// How many of its containers ask for exactly `count` of `resource`.
    pub fn containers_asking(&self, resource: &str, count: u64) -> usize {
        self.asks.iter().filter(|(_, r, n)| r == resource && *n == count).count()
    }

    /// As the co-location policy sees it, with its namespace's class label from `view`.
    pub fn as_node_pod(&self, view: &NodePods) -> NodePod {
        NodePod {
            uid: self.uid.clone(),
            qos: self.qos,
            label: self.class_label.clone(),
            namespace_label: view.namespace_classes.get(&self.namespace).cloned(),
            cpu_request_milli: self.cpu_request_milli,
            memory_request_bytes: self.memory_request_bytes,
            running: self.running(),
        }
    }
}

/// The node's pods, by UID, and the class labels of the namespaces that have one.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodePods {
    /// Whether the watcher has listed the pods at least once (before that, the map means
    /// nothing).
    pub synced: bool,
    /// The pods, by UID.
    pub pods: BTreeMap<String, PodInfo>,
    /// Whether the namespaces' class labels have been listed at least once (true from the
    /// start where they are not followed).
    pub namespaces_synced: bool,
    /// The value of the class label of each namespace that has one, by name.
    pub namespace_classes: BTreeMap<String, String>,
}

impl NodePods {
    /// Whether both the pods and (where followed) the namespaces' labels have been listed.
    pub fn ready(&self) -> bool {
        self.synced && self.namespaces_synced
    }
}

/// A Kubernetes quantity in thousandths (`None`: not one, or negative).
pub fn quantity_milli(q: &Quantity) -> Option<u64> {
    baleen_k8s::quantity::quantity_milli(&q.0).and_then(|m| u64::try_from(m).ok())
}

/// A pod's quantity in thousandths; 0 when unreadable (the API server validated it).
fn milli(q: &Quantity) -> u64 {
    quantity_milli(q).unwrap_or(0)
}

/// A container's request of `resource` in thousandths; a limit alone counts as the request.
fn request(c: &Container, resource: &str) -> u64 {
    let r = c.resources.as_ref();
    r.and_then(|r| r.requests.as_ref())
        .and_then(|q| q.get(resource))
        .or_else(|| r.and_then(|r| r.limits.as_ref()).and_then(|q| q.get(resource)))
        .map_or(0, milli)
}

/// The QoS class as the API server works it out: Guaranteed when every container has CPU and
/// memory limits equal to its requests, BestEffort when none asks for either, else Burstable.
fn qos_of(apps: &[&Container], inits: &[&Container]) -> Qos {
    let all: Vec<&&Container> = apps.iter().chain(inits.iter()).collect();
    let get = |c: &Container, which: bool, resource: &str| {
        let r = c.resources.as_ref();
        let map = if which {
            r.and_then(|r| r.limits.as_ref())
        } else {
            r.and_then(|r| r.requests.as_ref())
        };
        map.and_then(|m| m.get(resource)).map(milli)
    };
    let any = all.iter().any(|c| {
        ["cpu", "memory"].iter().any(|r| {
            get(c, true, r).is_some_and(|v| v > 0) || get(c, false, r).is_some_and(|v| v > 0)
        })
    });
    if !any {
        return Qos::BestEffort;
    }
    let guaranteed = all.iter().all(|c| {
        ["cpu", "memory"].iter().all(|r| match (get(c, false, r), get(c, true, r)) {
            (Some(req), Some(lim)) => req == lim,
            (None, Some(_)) => true,
            _ => false,
        })
    });
    if guaranteed { Qos::Guaranteed } else { Qos::Burstable }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod(value: serde_json::Value) -> Pod {
        serde_json::from_value(value).expect("a pod")
    }

    #[test]
    fn a_pod_reads_as_the_api_server_and_kubelet_see_it() {
        use baleen_k8s::fixtures::{POD_WITH_OVERHEAD, pod_with_overhead};
        let mut value = pod_with_overhead();
        value["metadata"]["uid"] = json!("u1");
        value["metadata"]["labels"] = json!({CLASS_LABEL: "inference"});
        value["status"] = json!({"phase": "Pending", "qosClass": "Burstable"});
        let p = PodInfo::of(&pod(value)).expect("uid");
        assert_eq!(p.key(), "ml/serve");
        assert_eq!(p.qos, Qos::Burstable);
        assert_eq!(p.class_label.as_deref(), Some("inference"));
        assert_eq!(
            p.cpu_request_milli, POD_WITH_OVERHEAD.cpu_milli,
            "the init container's 4 beats 1.5 + 1; overhead"
        );
        assert_eq!(p.memory_request_bytes, POD_WITH_OVERHEAD.memory_bytes);
        assert_eq!(p.asks, [("a".into(), "awesome-ai-company.com/gpu-memory".into(), 8)]);
        assert!(p.admitting() && !p.running());
        assert_eq!(p.containers_asking("awesome-ai-company.com/gpu-memory", 8), 1);
        assert_eq!(p.containers_asking("awesome-ai-company.com/gpu-memory", 4), 0);
    }

    #[test]
    fn the_qos_class_is_worked_out_when_the_status_has_none() {
        let qos = |containers: serde_json::Value| {
            PodInfo::of(&pod(json!({
                "metadata": {"name": "p", "uid": "u"}, "spec": {"containers": containers}
            })))
            .expect("uid")
            .qos
        };
        assert_eq!(qos(json!([{"name": "a"}])), Qos::BestEffort);
        assert_eq!(
            qos(json!([{"name": "a", "resources": {"limits": {"cpu": "1", "memory": "1Gi"}}}])),
            Qos::Guaranteed
        );
        assert_eq!(
            qos(json!([{"name": "a", "resources": {"requests": {"cpu": "1"}}}])),
            Qos::Burstable
        );
        assert_eq!(
            qos(json!([{"name": "a", "resources": {
                "requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"cpu": "2", "memory": "1Gi"}}}])),
            Qos::Burstable
        );
    }

    #[test]
    fn a_started_container_means_the_pod_is_past_admission() {
        let p = PodInfo::of(&pod(json!({
            "metadata": {"name": "p", "uid": "u"}, "spec": {"containers": [{"name": "a"}]},
            "status": {"phase": "Pending", "containerStatuses": [{"name": "a", "image": "i",
                "imageID": "", "ready": false, "restartCount": 0, "state": {"running": {}}}]}
        })))
        .expect("uid");
        assert!(!p.admitting());
    }

    #[test]
    fn containers_are_named_by_the_ids_the_runtime_gave_them() {
        let p = PodInfo::of(&pod(json!({
            "metadata": {"name": "p", "uid": "u"},
            "spec": {"containers": [{"name": "a"}, {"name": "b"}],
                     "initContainers": [{"name": "init"}]},
            "status": {"phase": "Running",
                "containerStatuses": [
                    {"name": "a", "image": "i", "imageID": "", "ready": true, "restartCount": 1,
                     "containerID": "containerd://aaaa", "state": {"running": {}},
                     "lastState": {"terminated": {"exitCode": 1, "containerID": "containerd://a0a0"}}},
                    {"name": "b", "image": "i", "imageID": "", "ready": false, "restartCount": 0,
                     "state": {"waiting": {"reason": "ContainerCreating"}}}
                ],
                "initContainerStatuses": [
                    {"name": "init", "image": "i", "imageID": "", "ready": false, "restartCount": 0,
                     "containerID": "cri-o://c0c0", "state": {"terminated": {"exitCode": 0, "containerID": "cri-o://c0c0"}}}
                ]}
        })))
        .expect("uid");
        assert_eq!(p.container_named_by("aaaa"), Some("a"));
        assert_eq!(p.container_named_by("a0a0"), Some("a"), "the restarted container's last");
        assert_eq!(p.container_named_by("c0c0"), Some("init"));
        assert_eq!(p.container_named_by("bbbb"), None, "b has no ID yet");
        assert_eq!(p.container_ids.len(), 3);
    }
}
