//! Which pod an Allocate is for, and so which MPS client priority its containers get.
//!
//! The device-plugin API does not say: the kubelet sends device IDs only. Like other plugins,
//! the agent works it out from the node's pods (the Kubernetes API's view, `super::node_pods`):
//! a candidate is bound to this node, being admitted (pending, no container started yet), and
//! has a container asking for exactly this many devices of this resource that is not already
//! accounted for (by an earlier Allocate the agent attributed to it, or by the kubelet's
//! pod-resources list). One candidate, or several of one class: that class. Candidates of
//! different classes, or none within the wait (the API's view can trail the kubelet's by a
//! moment): the configured default class, logged.
//!
//! Limits: two pods admitted at the same moment with the same ask are told apart only by class;
//! a kubelet that repeats an Allocate for one container (it does for a restarted init
//! container) finds the pod already accounted for; a pod the API's view has not seen within the
//! wait gets the default class. A wrong guess changes a scheduling priority, never a memory
//! limit or a device.

use std::collections::BTreeMap;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use tokio::sync::watch;

use super::colocation::{Class, ClassPolicy, classify};
use crate::isolation::node_pods::NodePods;

/// The MPS client variable of the scheduling priority (CUDA 12.4 and later): 0 normal, 1 below
/// normal.
pub const PRIORITY_VARIABLE: &str = "CUDA_MPS_CLIENT_PRIORITY";

/// The MPS client priority of a class: training below normal, inference normal.
pub fn mps_priority(class: Class) -> u8 {
    match class {
        Class::Inference => 0,
        Class::Training => 1,
    }
}

/// Who an Allocate was found to be for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Identity {
    /// The candidates (`namespace/name`), all of one class.
    Pods {
        /// The candidates.
        pods: Vec<String>,
        /// Their class.
        class: Class,
    },
    /// Candidates of different classes: the default class.
    Ambiguous {
        /// The candidates and their classes.
        pods: Vec<(String, Class)>,
        /// The default class.
        class: Class,
    },
    /// No candidate: the default class.
    Unknown {
        /// The default class.
        class: Class,
    },
}

impl Identity {
    /// How the pod was found: `pod`, `ambiguous` or `unknown` (a metric label).
    pub fn how(&self) -> &'static str {
        match self {
            Identity::Pods { .. } => "pod",
            Identity::Ambiguous { .. } => "ambiguous",
            Identity::Unknown { .. } => "unknown",
        }
    }

    /// The class the containers get.
    pub fn class(&self) -> Class {
        match self {
            Identity::Pods { class, .. }
            | Identity::Ambiguous { class, .. }
            | Identity::Unknown { class } => *class,
        }
    }
}

/// Finds the pod of an Allocate in the node's pods.
pub struct PodIdentifier {
    pods: watch::Receiver<NodePods>,
    policy: ClassPolicy,
    wait: Duration,
    /// Containers attributed so far, by pod UID, resource and count, while the pod is being
    /// admitted.
    claimed: Mutex<BTreeMap<(String, String, u64), usize>>,
}

impl PodIdentifier {
    /// Over the node's pods; waits up to `wait` for a candidate to appear.
    pub fn new(pods: watch::Receiver<NodePods>, policy: ClassPolicy, wait: Duration) -> Self {
        Self { pods, policy, wait, claimed: Mutex::new(BTreeMap::new()) }
    }

    /// The pod asking for `count` of `resource` now. `listed`: containers the kubelet's
    /// pod-resources list already shows holding `resource`, by `namespace/name` and their number
    /// of devices.
    pub async fn identify(
        &self,
        resource: &str,
        count: u64,
        listed: &BTreeMap<(String, u64), usize>,
    ) -> Identity {
        let mut pods = self.pods.clone();
        let deadline = tokio::time::Instant::now() + self.wait;
        let found = loop {
            let found = self.candidates(&pods.borrow_and_update(), resource, count, listed);
            if !found.is_empty() {
                break found;
            }
            tokio::select! {
                () = tokio::time::sleep_until(deadline) => break found,
                changed = pods.changed() => if changed.is_err() { break found },
            }
        };
        let default = self.policy.default_class;
        let Some((_, _, first)) = found.first() else {
            tracing::warn!(
                resource,
                count,
                class = ?default,
                "no pod of this node is being admitted with this ask; its containers get the default class"
            );
            return Identity::Unknown { class: default };
        };
        let first = *first;
        if found.iter().all(|(_, _, class)| *class == first) {
            if let [(uid, _, _)] = found.as_slice() {
                *self.claimed().entry((uid.clone(), resource.to_owned(), count)).or_default() += 1;
            }
            return Identity::Pods {
                pods: found.into_iter().map(|(_, key, _)| key).collect(),
                class: first,
            };
        }
        let pods: Vec<(String, Class)> = found.into_iter().map(|(_, key, c)| (key, c)).collect();
        tracing::warn!(
            resource,
            count,
            candidates = ?pods,
            class = ?default,
            "pods of different classes are being admitted with the same ask; their containers get the default class"
        );
        Identity::Ambiguous { pods, class: default }
    }

    /// The class of the pod whose UID is `uid` (a DRA claim names the pods it is reserved
    /// for), waiting up to the identifier's wait for the API's view to show it; the default
    /// class, logged, when it does not.
    pub async fn class_of(&self, uid: &str) -> Identity {
        let mut pods = self.pods.clone();
        let deadline = tokio::time::Instant::now() + self.wait;
        loop {
            let found = {
                let view = pods.borrow_and_update();
                view.pods.get(uid).map(|p| (p.key(), classify(&p.as_node_pod(&view), &self.policy)))
            };
            if let Some((key, class)) = found {
                return Identity::Pods { pods: vec![key], class };
            }
            tokio::select! {
                () = tokio::time::sleep_until(deadline) => break,
                changed = pods.changed() => if changed.is_err() { break },
            }
        }
        let class = self.policy.default_class;
        tracing::warn!(
            pod.uid = uid,
            ?class,
            "the claim's pod is not in the API's view of the node; its containers get the default class"
        );
        Identity::Unknown { class }
    }

    fn claimed(&self) -> std::sync::MutexGuard<'_, BTreeMap<(String, String, u64), usize>> {
        self.claimed.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// `(uid, namespace/name, class)` of every candidate.
    fn candidates(
        &self,
        view: &NodePods,
        resource: &str,
        count: u64,
        listed: &BTreeMap<(String, u64), usize>,
    ) -> Vec<(String, String, Class)> {
        let mut claimed = self.claimed();
        // Claims last only while their pod is being admitted.
        claimed.retain(|(uid, _, _), _| view.pods.get(uid).is_some_and(|p| p.admitting()));
        view.pods
            .values()
            .filter(|p| p.admitting())
            .filter(|p| {
                let asking = p.containers_asking(resource, count);
                let accounted = claimed
                    .get(&(p.uid.clone(), resource.to_owned(), count))
                    .copied()
                    .unwrap_or(0)
                    .max(listed.get(&(p.key(), count)).copied().unwrap_or(0));
                asking > accounted
            })
            .map(|p| (p.uid.clone(), p.key(), classify(&p.as_node_pod(view), &self.policy)))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::isolation::cgroups::Qos;
    use crate::isolation::node_pods::PodInfo;

    const R: &str = "awesome-ai-company.com/gpu-memory";

    fn pod(name: &str, qos: Qos, label: Option<&str>, phase: &str, asks: &[u64]) -> PodInfo {
        PodInfo {
            uid: format!("uid-{name}"),
            namespace: "ml".into(),
            name: name.into(),
            qos,
            class_label: label.map(str::to_owned),
            phase: phase.into(),
            started: phase != "Pending",
            cpu_request_milli: 1000,
            memory_request_bytes: 1 << 30,
            asks: asks
                .iter()
                .enumerate()
                .map(|(i, n)| (format!("c{i}"), R.to_owned(), *n))
                .collect(),
            container_ids: Vec::new(),
        }
    }

    fn view(pods: Vec<PodInfo>) -> NodePods {
        NodePods {
            synced: true,
            pods: pods.into_iter().map(|p| (p.uid.clone(), p)).collect(),
            namespaces_synced: true,
            ..NodePods::default()
        }
    }

    /// An identifier over `pods` whose classes come from the pods themselves (label, else
    /// QoS): how a pod is found does not depend on where its class comes from.
    fn identifier(pods: Vec<PodInfo>) -> (watch::Sender<NodePods>, PodIdentifier) {
        let (tx, rx) = watch::channel(view(pods));
        let policy = ClassPolicy {
            class_from: crate::isolation::colocation::ClassSource::Pod,
            ..ClassPolicy::default()
        };
        (tx, PodIdentifier::new(rx, policy, Duration::from_millis(50)))
    }

    /// Issue 21, item 5: by default the MPS priority follows the namespace's class, not the
    /// pod's own label.
    #[tokio::test]
    async fn by_default_the_class_is_the_namespaces() {
        let mut labelled =
            pod("self-labelled", Qos::Guaranteed, Some("inference"), "Pending", &[4]);
        labelled.namespace = "tenant".into();
        let mut serving = pod("serve", Qos::Burstable, None, "Pending", &[2]);
        serving.namespace = "serving".into();
        let mut v = view(vec![labelled, serving]);
        v.namespace_classes.insert("serving".into(), "inference".into());
        let (_tx, rx) = watch::channel(v);
        let id = PodIdentifier::new(rx, ClassPolicy::default(), Duration::from_millis(50));
        let none = BTreeMap::new();
        assert_eq!(
            id.identify(R, 4, &none).await,
            Identity::Pods { pods: vec!["tenant/self-labelled".into()], class: Class::Training }
        );
        assert_eq!(
            id.identify(R, 2, &none).await,
            Identity::Pods { pods: vec!["serving/serve".into()], class: Class::Inference }
        );
    }

    #[tokio::test]
    async fn one_candidate_gives_its_class_and_is_accounted_for() {
        let (_tx, id) =
            identifier(vec![pod("serve", Qos::Burstable, Some("inference"), "Pending", &[8, 8])]);
        let none = BTreeMap::new();
        let first = id.identify(R, 8, &none).await;
        assert_eq!(
            first,
            Identity::Pods { pods: vec!["ml/serve".into()], class: Class::Inference }
        );
        // Its second container asks the same: still the pod.
        assert_eq!(id.identify(R, 8, &none).await.class(), Class::Inference);
        // Both of its containers are accounted for: a third Allocate is not for it.
        assert!(matches!(
            id.identify(R, 8, &none).await,
            Identity::Unknown { class: Class::Training }
        ));
        // A pod asking 4 in one container and 8 in another: each Allocate finds it.
        let (_tx, id) = identifier(vec![pod("mixed", Qos::Guaranteed, None, "Pending", &[4, 8])]);
        assert_eq!(id.identify(R, 4, &none).await.class(), Class::Inference);
        assert_eq!(id.identify(R, 8, &none).await.class(), Class::Inference);
        // A different count is not it either.
        let (_tx, id) = identifier(vec![pod("serve", Qos::Guaranteed, None, "Pending", &[8])]);
        assert!(matches!(id.identify(R, 4, &none).await, Identity::Unknown { .. }));
    }

    #[tokio::test]
    async fn candidates_of_two_classes_give_the_default_class() {
        let (_tx, id) = identifier(vec![
            pod("serve", Qos::Guaranteed, None, "Pending", &[8]),
            pod("train", Qos::BestEffort, None, "Pending", &[8]),
        ]);
        match id.identify(R, 8, &BTreeMap::new()).await {
            Identity::Ambiguous { pods, class } => {
                assert_eq!(class, Class::Training);
                assert_eq!(
                    pods,
                    [
                        ("ml/serve".to_owned(), Class::Inference),
                        ("ml/train".to_owned(), Class::Training)
                    ]
                );
            }
            other => panic!("expected ambiguity, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn running_and_listed_pods_are_not_candidates() {
        let (_tx, id) = identifier(vec![
            pod("old", Qos::Guaranteed, None, "Running", &[8]),
            pod("pulling", Qos::Guaranteed, None, "Pending", &[8]),
            pod("train", Qos::BestEffort, None, "Pending", &[8]),
        ]);
        // The kubelet already lists the pulling pod's container: the training pod it is.
        let listed = BTreeMap::from([(("ml/pulling".to_owned(), 8), 1)]);
        assert_eq!(
            id.identify(R, 8, &listed).await,
            Identity::Pods { pods: vec!["ml/train".into()], class: Class::Training }
        );
    }

    #[tokio::test]
    async fn a_pod_the_view_sees_late_is_waited_for() {
        let (tx, id) = identifier(vec![]);
        let id = PodIdentifier { wait: Duration::from_secs(5), ..id };
        let late = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(30)).await;
            tx.send_replace(view(vec![pod("serve", Qos::Guaranteed, None, "Pending", &[2])]));
            tx
        });
        let started = std::time::Instant::now();
        assert_eq!(id.identify(R, 2, &BTreeMap::new()).await.class(), Class::Inference);
        assert!(started.elapsed() < Duration::from_secs(4), "answered when the pod came");
        drop(late.await);
    }
}
