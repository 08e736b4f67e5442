//! The extender's view of the cluster: each node's gpu-state document and allocatable CPU and
//! memory, and the pods with what they ask and where they are bound. Fed by the watchers (or by
//! the Nodes kube-scheduler sends); read by every filter and prioritize.

use std::collections::{BTreeSet, HashMap};
use std::time::Instant;

use baleen_k8s::gpu_state::NodeGpuState;

use crate::demand::{AskResource as _, Demand, quantity_milli};
use crate::place::Host;
use crate::protocol::{Node, Pod};

/// One node as last seen.
#[derive(Debug, Clone)]
pub struct NodeEntry {
    /// Its document, or why it has none that can be used.
    pub state: Result<NodeGpuState, String>,
    /// Allocatable CPU (millicores) and memory (bytes).
    pub allocatable: (u64, u64),
}

impl NodeEntry {
    /// The entry of `node`, reading the annotation `key`.
    pub fn of(node: &Node, key: &str) -> Self {
        let state = match node.metadata.annotations.as_ref().and_then(|a| a.get(key)) {
            None => Err(format!("no {key} annotation: is baleen-agent running on this node?")),
            Some(text) => NodeGpuState::parse(text).map_err(|e| format!("{key}: {e}")),
        };
        let state = state.and_then(|s| {
            if s.node == node.metadata.name {
                Ok(s)
            } else {
                Err(format!("{key} describes node {}, not this one", s.node))
            }
        });
        let alloc = node.status.allocatable.as_ref();
        let get = |r: &str| {
            alloc
                .and_then(|a| a.get(r))
                .and_then(quantity_milli)
                .map_or(0, |m| u64::try_from(m).unwrap_or(0))
        };
        Self { state, allocatable: (get("cpu"), get("memory").div_ceil(1000)) }
    }
}

/// One pod as last seen.
#[derive(Debug, Clone)]
pub struct PodEntry {
    /// `namespace/name`.
    pub key: String,
    /// The node it is bound to.
    pub node: Option<String>,
    /// What it asks (an unreadable pod asks nothing here).
    pub demand: Demand,
    /// Succeeded or Failed: it holds nothing any more.
    pub finished: bool,
}

impl PodEntry {
    /// The entry of `pod`, reading resources in `domain`.
    pub fn of(pod: &Pod, domain: &str) -> Self {
        let phase = pod.status.phase.as_deref();
        Self {
            key: format!("{}/{}", pod.metadata.namespace, pod.metadata.name),
            node: pod.spec.node_name.clone().filter(|n| !n.is_empty()),
            demand: Demand::of(pod, domain).unwrap_or_default(),
            finished: matches!(phase, Some("Succeeded" | "Failed")),
        }
    }
}

/// Nodes and pods.
#[derive(Debug, Default)]
pub struct ClusterView {
    nodes: HashMap<String, NodeEntry>,
    pods: HashMap<String, PodEntry>,
    /// Per node, the UIDs of the live pods bound to it.
    by_node: HashMap<String, BTreeSet<String>>,
    /// When a node was last added, changed or removed.
    pub updated: Option<Instant>,
    /// Per node, the change count when it or a pod bound to it last changed (what a cached
    /// score is valid for).
    stamps: HashMap<String, u64>,
    changes: u64,
}

impl ClusterView {
    /// Adds or replaces a node.
    pub fn set_node(&mut self, name: &str, entry: NodeEntry) {
        self.nodes.insert(name.to_owned(), entry);
        self.updated = Some(Instant::now());
        self.touch(name);
    }

    /// Forgets a node.
    pub fn remove_node(&mut self, name: &str) {
        self.nodes.remove(name);
        self.updated = Some(Instant::now());
        // A node that comes back gets a new, higher stamp; nothing of the old one is kept.
        self.stamps.remove(name);
        if self.by_node.get(name).is_some_and(BTreeSet::is_empty) {
            self.by_node.remove(name);
        }
    }

    fn touch(&mut self, node: &str) {
        self.changes += 1;
        self.stamps.insert(node.to_owned(), self.changes);
    }

    /// A number that changes whenever `node` or a pod bound to it changes.
    pub fn stamp(&self, node: &str) -> u64 {
        self.stamps.get(node).copied().unwrap_or(0)
    }

    /// Keeps only the nodes `keep` names (after a watcher's fresh list).
    pub fn retain_nodes(&mut self, keep: impl Fn(&str) -> bool) {
        let gone: Vec<String> = self.nodes.keys().filter(|n| !keep(n)).cloned().collect();
        for name in gone {
            self.remove_node(&name);
        }
    }

    /// Keeps only the pods `keep` names by UID (after a watcher's fresh list).
    pub fn retain_pods(&mut self, keep: impl Fn(&str) -> bool) {
        let gone: Vec<String> = self.pods.keys().filter(|uid| !keep(uid)).cloned().collect();
        for uid in gone {
            self.remove_pod(&uid);
        }
    }

    /// A node.
    pub fn node(&self, name: &str) -> Option<&NodeEntry> {
        self.nodes.get(name)
    }

    /// Every node.
    pub fn nodes(&self) -> impl Iterator<Item = (&String, &NodeEntry)> {
        self.nodes.iter()
    }

    /// How many nodes.
    pub fn node_count(&self) -> usize {
        self.nodes.len()
    }

    /// The nodes' documents that can be used.
    pub fn states(&self) -> impl Iterator<Item = &NodeGpuState> {
        self.nodes.values().filter_map(|n| n.state.as_ref().ok())
    }

    /// Adds or replaces a pod by UID.
    pub fn set_pod(&mut self, uid: &str, entry: PodEntry) {
        self.remove_pod(uid);
        if let Some(node) = entry.node.clone().filter(|_| !entry.finished) {
            self.by_node.entry(node.clone()).or_default().insert(uid.to_owned());
            self.touch(&node);
        }
        self.pods.insert(uid.to_owned(), entry);
    }

    /// Whether the pod `uid` is in the view (bound or not).
    pub fn has_pod(&self, uid: &str) -> bool {
        self.pods.contains_key(uid)
    }

    /// Whether the pod `uid` is bound to a node.
    pub fn is_bound(&self, uid: &str) -> bool {
        self.pods.get(uid).is_some_and(|p| p.node.is_some())
    }

    /// Forgets a pod.
    pub fn remove_pod(&mut self, uid: &str) {
        if let Some(old) = self.pods.remove(uid)
            && let Some(node) = old.node
            && let Some(set) = self.by_node.get_mut(&node)
            && set.remove(uid)
        {
            self.touch(&node);
        }
    }

    /// The live pods bound to `node`.
    fn pods_on(&self, node: &str) -> impl Iterator<Item = &PodEntry> {
        self.by_node.get(node).into_iter().flatten().filter_map(|uid| self.pods.get(uid))
    }

    /// What the pods bound to `node` ask that its document does not count yet: pods no GPU
    /// of the document names, less the asks that match its unnamed grants (granted, counted,
    /// not yet listed with their pod), one grant per ask of the same resource and size.
    pub fn assumed(&self, node: &str, state: &NodeGpuState, domain: &str) -> Vec<Demand> {
        let published: BTreeSet<&str> =
            state.gpus.iter().flat_map(|g| g.pods.iter().map(String::as_str)).collect();
        let mut pods: Vec<&PodEntry> = self
            .pods_on(node)
            .filter(|p| !p.demand.is_empty() && !published.contains(p.key.as_str()))
            .collect();
        // Oldest first is not known here; any order gives the same capacity.
        pods.sort_by(|a, b| a.key.cmp(&b.key));
        let mut demands: Vec<Demand> = pods.into_iter().map(|p| p.demand.clone()).collect();
        for grant in &state.unnamed {
            let matched = demands.iter_mut().find_map(|d| {
                let i = d.asks.iter().position(|a| {
                    a.resource(domain) == grant.resource && a.count() == u64::from(grant.devices)
                })?;
                Some((d, i))
            });
            if let Some((d, i)) = matched {
                d.asks.remove(i);
            }
        }
        demands.retain(|d| !d.is_empty());
        demands
    }

    /// `node`'s allocatable CPU and memory with what its live pods request.
    pub fn host(&self, node: &str, allocatable: (u64, u64)) -> Host {
        let (mut cpu, mut memory) = (0u64, 0u64);
        for p in self.pods_on(node) {
            cpu = cpu.saturating_add(p.demand.cpu_milli);
            memory = memory.saturating_add(p.demand.memory_bytes);
        }
        Host {
            cpu_milli: allocatable.0,
            memory_bytes: allocatable.1,
            cpu_used_milli: cpu,
            memory_used_bytes: memory,
        }
    }
}
