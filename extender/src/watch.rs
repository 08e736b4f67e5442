//! The extender's watchers (kube-rs): Nodes (their gpu-state annotation and allocatable CPU and
//! memory, for `nodeCacheCapable: true`) and Pods (where they are bound and what they ask, so
//! that pods bound but not yet in their node's annotation count as placed, and CPU and memory
//! in use are known). Each re-lists after the API server comes back, with backoff meanwhile;
//! a relist replaces what the cache held.

use std::collections::BTreeSet;
use std::sync::{Arc, PoisonError};

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Node as KubeNode, Pod as KubePod};
use kube::Api;
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};
use tokio_util::sync::CancellationToken;

use crate::cluster::{ClusterView, NodeEntry, PodEntry};
use crate::protocol::{Node, Pod};
use crate::service::{Extender, Watched};

/// Follows every Node until `shutdown`.
pub async fn nodes(client: kube::Client, extender: Arc<Extender>, shutdown: CancellationToken) {
    let key = extender.settings().annotation();
    let kind = Kind {
        what: Watched::Nodes,
        apply: move |view: &mut ClusterView, node: &KubeNode| {
            let node: Node = serde_json::to_value(node).and_then(serde_json::from_value).ok()?;
            let name = node.metadata.name.clone();
            view.set_node(&name, NodeEntry::of(&node, &key));
            Some(name)
        },
        key: |node: &KubeNode| node.metadata.name.clone(),
        remove: ClusterView::remove_node,
        retain: |view, seen| view.retain_nodes(|name| seen.contains(name)),
    };
    follow(Api::all(client), extender, kind, shutdown).await;
}

/// Follows every Pod until `shutdown`.
pub async fn pods(client: kube::Client, extender: Arc<Extender>, shutdown: CancellationToken) {
    let domain = extender.settings().domain.clone();
    let kind = Kind {
        what: Watched::Pods,
        apply: move |view: &mut ClusterView, pod: &KubePod| {
            let pod: Pod = serde_json::to_value(pod).and_then(serde_json::from_value).ok()?;
            let uid = pod.metadata.uid.clone();
            view.set_pod(&uid, PodEntry::of(&pod, &domain));
            Some(uid)
        },
        key: |pod: &KubePod| pod.metadata.uid.clone(),
        remove: ClusterView::remove_pod,
        retain: |view, seen| view.retain_pods(|uid| seen.contains(uid)),
    };
    follow(Api::all(client), extender, kind, shutdown).await;
}

/// How one kind of object enters the cluster view, by its key (a node's name, a pod's UID).
struct Kind<K, A> {
    what: Watched,
    /// Stores the object; its key.
    apply: A,
    key: fn(&K) -> Option<String>,
    remove: fn(&mut ClusterView, &str),
    /// Keeps only the objects of a fresh list.
    retain: fn(&mut ClusterView, &BTreeSet<String>),
}

/// Follows the objects of `api` into the cluster view until `shutdown`: each applied as it
/// comes, each deleted as it goes, and after a (re)list whatever the list did not hold dropped.
async fn follow<K, A>(
    api: Api<K>,
    extender: Arc<Extender>,
    kind: Kind<K, A>,
    shutdown: CancellationToken,
) where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug + Send + 'static,
    A: Fn(&mut ClusterView, &K) -> Option<String>,
{
    let stream = watcher::watcher(api, watcher::Config::default()).default_backoff();
    futures::pin_mut!(stream);
    let mut listing: Option<BTreeSet<String>> = None;
    loop {
        let event = tokio::select! {
            () = shutdown.cancelled() => return,
            event = stream.next() => match event {
                Some(e) => e,
                None => return,
            },
        };
        let event = match event {
            Ok(e) => e,
            Err(e) => {
                tracing::warn!(watch = ?kind.what, error = %e, "watch failed; retrying with backoff");
                continue;
            }
        };
        let mut view = extender.cluster.write().unwrap_or_else(PoisonError::into_inner);
        match event {
            Event::Init => listing = Some(BTreeSet::new()),
            Event::InitApply(object) => {
                if let (Some(key), Some(seen)) =
                    ((kind.apply)(&mut view, &object), listing.as_mut())
                {
                    seen.insert(key);
                }
            }
            Event::InitDone => {
                if let Some(seen) = listing.take() {
                    (kind.retain)(&mut view, &seen);
                }
                extender.listed(kind.what);
            }
            Event::Apply(object) => {
                (kind.apply)(&mut view, &object);
            }
            Event::Delete(object) => {
                if let Some(key) = (kind.key)(&object) {
                    (kind.remove)(&mut view, &key);
                }
            }
        }
    }
}
