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

use crate::cluster::{NodeEntry, PodEntry};
use crate::protocol::{Node, Pod};
use crate::service::Extender;

/// Follows every Node until `shutdown`.
pub async fn nodes(client: kube::Client, extender: Arc<Extender>, shutdown: CancellationToken) {
    let key = extender.settings().annotation();
    let stream = watcher::watcher(Api::<KubeNode>::all(client), watcher::Config::default())
        .default_backoff();
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
                tracing::warn!(error = %e, "node watch failed; retrying with backoff");
                continue;
            }
        };
        let mut view = extender.cluster.write().unwrap_or_else(PoisonError::into_inner);
        let apply = |view: &mut crate::cluster::ClusterView, node: &KubeNode| {
            let Ok(node) = serde_json::to_value(node).and_then(serde_json::from_value::<Node>)
            else {
                return None;
            };
            let name = node.metadata.name.clone();
            view.set_node(&name, NodeEntry::of(&node, &key));
            Some(name)
        };
        match event {
            Event::Init => listing = Some(BTreeSet::new()),
            Event::InitApply(node) => {
                if let (Some(name), Some(seen)) = (apply(&mut view, &node), listing.as_mut()) {
                    seen.insert(name);
                }
            }
            Event::InitDone => {
                if let Some(seen) = listing.take() {
                    view.retain_nodes(|name| seen.contains(name));
                }
                extender.listed(crate::service::Watched::Nodes);
            }
            Event::Apply(node) => {
                apply(&mut view, &node);
            }
            Event::Delete(node) => {
                if let Some(name) = node.metadata.name.as_deref() {
                    view.remove_node(name);
                }
            }
        }
    }
}

/// Follows every Pod until `shutdown`.
pub async fn pods(client: kube::Client, extender: Arc<Extender>, shutdown: CancellationToken) {
    let domain = extender.settings().domain.clone();
    let stream =
        watcher::watcher(Api::<KubePod>::all(client), watcher::Config::default()).default_backoff();
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
                tracing::warn!(error = %e, "pod watch failed; retrying with backoff");
                continue;
            }
        };
        let mut view = extender.cluster.write().unwrap_or_else(PoisonError::into_inner);
        let apply = |view: &mut crate::cluster::ClusterView, pod: &KubePod| {
            let Ok(pod) = serde_json::to_value(pod).and_then(serde_json::from_value::<Pod>) else {
                return None;
            };
            let uid = pod.metadata.uid.clone();
            view.set_pod(&uid, PodEntry::of(&pod, &domain));
            Some(uid)
        };
        match event {
            Event::Init => listing = Some(BTreeSet::new()),
            Event::InitApply(pod) => {
                if let (Some(uid), Some(seen)) = (apply(&mut view, &pod), listing.as_mut()) {
                    seen.insert(uid);
                }
            }
            Event::InitDone => {
                if let Some(seen) = listing.take() {
                    view.retain_pods(|uid| seen.contains(uid));
                }
                extender.listed(crate::service::Watched::Pods);
            }
            Event::Apply(pod) => {
                apply(&mut view, &pod);
            }
            Event::Delete(pod) => {
                if let Some(uid) = pod.metadata.uid.as_deref() {
                    view.remove_pod(uid);
                }
            }
        }
    }
}
