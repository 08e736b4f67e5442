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
/// change it receives. Each object is read (turned into the view's entry) before the view's
/// write lock is taken, and what follows its storing (counters, logs, the target workload)
/// after it is released, so the lock is held only to store: every call waits while a writer
/// does (issue 39, item 6). Public so that a harness drives the watchers' own path (the
/// `live_latency` bench), on a task of the runtime as the watcher runs.
pub struct Feed<K> {
    extender: Arc<Extender>,
    /// What [`Object::read`] needs: the annotation's key or the resources' domain.
    context: String,
    _kind: std::marker::PhantomData<fn(K)>,
}

impl Feed<KubeNode> {
    /// The Node watcher's feed.
    pub fn nodes(extender: Arc<Extender>) -> Self {
        let context = extender.settings().annotation();
        Self { extender, context, _kind: std::marker::PhantomData }
    }
}

impl Feed<KubePod> {
    /// The Pod watcher's feed.
    pub fn pods(extender: Arc<Extender>) -> Self {
        let context = extender.settings().domain.clone();
        Self { extender, context, _kind: std::marker::PhantomData }
    }
}

impl<K: Object> Feed<K> {
    /// One change: each object applied as it comes, each deleted as it goes, and a (re)list
    /// replacing what the view held of the kind (`baleen_k8s::watch::follow` does the relist
    /// swap).
    pub fn change(&self, change: Change<K>) {
        let extender = &*self.extender;
        let lock = || extender.cluster.write().unwrap_or_else(PoisonError::into_inner);
        match change {
            Change::Listed(objects) => {
                let read: Vec<(String, K::Entry)> =
                    objects.iter().filter_map(|o| o.read(extender, &self.context)).collect();
                let keys: BTreeSet<String> = read.iter().map(|(k, _)| k.clone()).collect();
                let stored: Vec<(String, K::Stored)> = {
                    let mut view = lock();
                    let stored = read
                        .into_iter()
                        .map(|(k, e)| {
                            let s = K::store(&mut view, &k, e);
                            (k, s)
                        })
                        .collect();
                    K::retain(&mut view, &keys);
                    stored
                };
                for (key, s) in stored {
                    K::after(extender, &key, s);
                }
                extender.listed(K::WHAT);
            }
            Change::Applied(object) => {
                if let Some((key, entry)) = object.read(extender, &self.context) {
                    let stored = K::store(&mut lock(), &key, entry);
                    K::after(extender, &key, stored);
                }
            }
            Change::Deleted(object) => {
                if let Some(key) = object.key() {
                    K::remove(&mut lock(), &key);
                }
            }
        }
    }
}

/// An object the extender watches: how it is read outside the view's lock, stored inside it,
/// and what follows outside it again.
pub trait Object: Sized {
    /// What is read of one object.
    type Entry;
    /// What storing it leaves for [`Self::after`].
    type Stored;
    /// Which watcher this is.
    const WHAT: Watched;
    /// The object's key and entry; `None` for one that cannot be read.
    fn read(&self, extender: &Extender, context: &str) -> Option<(String, Self::Entry)>;
    /// Its key alone (for a deletion).
    fn key(&self) -> Option<String>;
    /// Stores `entry` under `key`, the view's write lock held.
    fn store(view: &mut ClusterView, key: &str, entry: Self::Entry) -> Self::Stored;
    /// What follows a stored entry, the lock released.
    fn after(extender: &Extender, key: &str, stored: Self::Stored);
    /// Removes `key`.
    fn remove(view: &mut ClusterView, key: &str);
    /// Keeps only the objects of a fresh list.
    fn retain(view: &mut ClusterView, keys: &BTreeSet<String>);
}

impl Object for KubeNode {
    type Entry = NodeEntry;
    /// The reason its document was refused, where that is new (said once, not at each rewrite).
    type Stored = Option<String>;
    const WHAT: Watched = Watched::Nodes;

    fn read(&self, _: &Extender, key: &str) -> Option<(String, NodeEntry)> {
        let node: Node = serde_json::to_value(self).and_then(serde_json::from_value).ok()?;
        let entry = NodeEntry::of(&node, key);
        Some((node.metadata.name, entry))
    }

    fn key(&self) -> Option<String> {
        self.metadata.name.clone()
    }

    fn store(view: &mut ClusterView, name: &str, entry: NodeEntry) -> Option<String> {
        let refused = match &entry.state {
            Err(why)
                if why.starts_with("refused:")
                    && view.node(name).and_then(|e| e.state.as_ref().err()) != Some(why) =>
            {
                Some(why.clone())
            }
            _ => None,
        };
        view.set_node(name, entry);
        refused
    }

    fn after(extender: &Extender, name: &str, refused: Option<String>) {
        if let Some(why) = refused {
            extender.refused_documents.inc();
            tracing::warn!(
                node = name,
                reason = why,
                "a gpu-state document not believed: the node is left out until its document and the kubelet's counts agree"
            );
        }
    }

    fn remove(view: &mut ClusterView, name: &str) {
        view.remove_node(name);
    }

    fn retain(view: &mut ClusterView, names: &BTreeSet<String>) {
        view.retain_nodes(|name| names.contains(name));
    }
}

/// A Pod read: the view's entry and the pod itself (for what follows its storing).
pub struct PodRead {
    entry: PodEntry,
    pod: Pod,
}

/// A Pod stored: the pod, whether the view knew it before, and what it asks if it still runs.
pub struct PodStored {
    pod: Pod,
    known: bool,
    asks: bool,
    running: Option<crate::demand::Demand>,
}

impl Object for KubePod {
    type Entry = PodRead;
    type Stored = PodStored;
    const WHAT: Watched = Watched::Pods;

    fn read(&self, extender: &Extender, domain: &str) -> Option<(String, PodRead)> {
        let pod: Pod = serde_json::to_value(self).and_then(serde_json::from_value).ok()?;
        let entry = PodEntry::with_claims(&pod, domain, &extender.claims);
        // Read again with its claims when they arrive (`crate::claims::watch`).
        if entry.claims_pending {
            extender.claims.note_pending(&pod);
        } else {
            extender.claims.forget_pending(&pod.metadata.uid);
        }
        Some((pod.metadata.uid.clone(), PodRead { entry, pod }))
    }

    fn key(&self) -> Option<String> {
        self.metadata.uid.clone()
    }

    fn store(view: &mut ClusterView, uid: &str, read: PodRead) -> PodStored {
        let PodRead { entry, pod } = read;
        let known = view.has_pod(uid);
        let asks = !entry.demand.is_empty();
        // Learned once its claims are known, not before (a pod is learned once).
        let running = (!entry.finished && !entry.claims_pending).then(|| entry.demand.clone());
        view.set_pod(uid, entry);
        PodStored { pod, known, asks, running }
    }

    fn after(extender: &Extender, uid: &str, stored: PodStored) {
        extender.note_scheduler(stored.known, &stored.pod, stored.asks);
        if let Some(demand) = &stored.running {
            extender.learn(uid, demand);
        }
    }

    fn remove(view: &mut ClusterView, uid: &str) {
        view.remove_pod(uid);
    }

    fn retain(view: &mut ClusterView, uids: &BTreeSet<String>) {
        view.retain_pods(|uid| uids.contains(uid));
    }
}
