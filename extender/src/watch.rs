//! The extender's watchers (kube-rs): Nodes (their gpu-state annotation and allocatable CPU and
//! memory, for `nodeCacheCapable: true`) and Pods (where they are bound and what they ask, so
//! that pods bound but not yet in their node's annotation count as placed, and CPU and memory
//! in use are known). Each re-lists after the API server comes back, with backoff meanwhile;
//! a relist replaces what the cache held (the loop is `baleen_k8s::watch::follow`; what each
//! change does is a [`Feed`]).

use std::collections::BTreeSet;
use std::sync::{Arc, PoisonError};

use baleen_k8s::watch::Change;
use k8s_openapi::api::core::v1::{Node as KubeNode, Pod as KubePod};
use kube::Api;
use kube::runtime::watcher;
use tokio_util::sync::CancellationToken;

use crate::cluster::{ClusterView, NodeEntry, PodEntry};
use crate::protocol::{Node, Pod};
use crate::service::{Extender, Watched};

/// Follows every Node until `shutdown`.
pub async fn nodes(client: kube::Client, extender: Arc<Extender>, shutdown: CancellationToken) {
    let feed = Feed::nodes(extender);
    baleen_k8s::watch::follow(
        Api::all(client),
        watcher::Config::default(),
        "Nodes",
        &shutdown,
        |c| {
            feed.change(c);
        },
    )
    .await;
}

/// Follows every Pod until `shutdown`.
pub async fn pods(client: kube::Client, extender: Arc<Extender>, shutdown: CancellationToken) {
    let feed = Feed::pods(extender);
    baleen_k8s::watch::follow(
        Api::all(client),
        watcher::Config::default(),
        "Pods",
        &shutdown,
        |c| {
            feed.change(c);
        },
    )
    .await;
}

/// How one kind of watched object enters the cluster view: what the watcher does with each
/// change it receives. Public so that a harness drives the watchers' own path (the
/// `live_latency` bench), on a task of the runtime as the watcher runs.
pub struct Feed<K> {
    extender: Arc<Extender>,
    kind: Kind<K>,
}

impl Feed<KubeNode> {
    /// The Node watcher's feed.
    pub fn nodes(extender: Arc<Extender>) -> Self {
        let key = extender.settings().annotation();
        let counter = extender.clone();
        let apply = move |view: &mut ClusterView, node: &KubeNode| {
            let node: Node = serde_json::to_value(node).and_then(serde_json::from_value).ok()?;
            let name = node.metadata.name.clone();
            let entry = NodeEntry::of(&node, &key);
            if let Err(why) = &entry.state
                && why.starts_with("refused:")
                && view.node(&name).and_then(|e| e.state.as_ref().err()) != Some(why)
            {
                counter.refused_documents.inc();
                tracing::warn!(
                    node = name,
                    reason = why,
                    "a gpu-state document not believed: the node is left out until its document and the kubelet's counts agree"
                );
            }
            view.set_node(&name, entry);
            Some(name)
        };
        let kind = Kind {
            what: Watched::Nodes,
            apply: Box::new(apply),
            key: |node: &KubeNode| node.metadata.name.clone(),
            remove: ClusterView::remove_node,
            retain: |view, seen| view.retain_nodes(|name| seen.contains(name)),
        };
        Self { extender, kind }
    }
}

impl Feed<KubePod> {
    /// The Pod watcher's feed.
    pub fn pods(extender: Arc<Extender>) -> Self {
        let domain = extender.settings().domain.clone();
        let noter = extender.clone();
        let apply = move |view: &mut ClusterView, pod: &KubePod| {
            let pod: Pod = serde_json::to_value(pod).and_then(serde_json::from_value).ok()?;
            let uid = pod.metadata.uid.clone();
            let entry = PodEntry::of(&pod, &domain);
            noter.note_scheduler(view, &pod, !entry.demand.is_empty());
            if !entry.finished {
                noter.learn(&uid, &entry.demand);
            }
            view.set_pod(&uid, entry);
            Some(uid)
        };
        let kind = Kind {
            what: Watched::Pods,
            apply: Box::new(apply),
            key: |pod: &KubePod| pod.metadata.uid.clone(),
            remove: ClusterView::remove_pod,
            retain: |view, seen| view.retain_pods(|uid| seen.contains(uid)),
        };
        Self { extender, kind }
    }
}

/// Stores one object in the view; its key.
type Apply<K> = Box<dyn Fn(&mut ClusterView, &K) -> Option<String> + Send + Sync>;

/// How one kind of object enters the cluster view, by its key (a node's name, a pod's UID).
struct Kind<K> {
    what: Watched,
    apply: Apply<K>,
    key: fn(&K) -> Option<String>,
    remove: fn(&mut ClusterView, &str),
    /// Keeps only the objects of a fresh list.
    retain: fn(&mut ClusterView, &BTreeSet<String>),
}

impl<K> Feed<K> {
    /// One change: each object applied as it comes, each deleted as it goes, and a (re)list
    /// replacing what the view held of the kind (`baleen_k8s::watch::follow` does the relist
    /// swap).
    pub fn change(&self, change: Change<K>) {
        let (kind, extender) = (&self.kind, &self.extender);
        let mut view = extender.cluster.write().unwrap_or_else(PoisonError::into_inner);
        match change {
            Change::Listed(objects) => {
                let seen: BTreeSet<String> =
                    objects.iter().filter_map(|o| (kind.apply)(&mut view, o)).collect();
                (kind.retain)(&mut view, &seen);
                drop(view);
                extender.listed(kind.what);
            }
            Change::Applied(object) => {
                (kind.apply)(&mut view, &object);
            }
            Change::Deleted(object) => {
                if let Some(key) = (kind.key)(&object) {
                    (kind.remove)(&mut view, &key);
                }
            }
        }
    }
}
