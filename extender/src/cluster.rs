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
        let domain = key.strip_suffix("/gpu-state").unwrap_or(key);
        let state = state.and_then(|s| believable(&s, node, domain).map(|()| s));
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

/// The most GPUs, and gpu-memory units, a node can have (the agent's own limits: 64 GPUs, the
/// kubelet's 4 MiB message of device IDs).
pub const MAX_GPUS: usize = 64;
/// See [`MAX_GPUS`].
pub const MAX_UNITS: u64 = 32_768;

/// Whether `state` can be true of `node`: the agent's document is believed only as far as the
/// kubelet's own count of the node's devices (the Node's `capacity`) bears it out, so that a
/// node's credentials cannot make it look larger or emptier than it is (a document claiming
/// 4,294,967,295 free units per GPU once passed and scored 10). The reason, if not.
pub fn believable(state: &NodeGpuState, node: &Node, domain: &str) -> Result<(), String> {
    let refuse = |why: String| Err(format!("refused: {why}"));
    if state.gpus.len() > MAX_GPUS {
        return refuse(format!("{} GPUs (at most {MAX_GPUS})", state.gpus.len()));
    }
    let mut units = 0u64;
    for g in &state.gpus {
        if g.units_free > g.units_total {
            return refuse(format!(
                "GPU {} has {} free of {} units",
                g.index, g.units_free, g.units_total
            ));
        }
        if g.shares_offered {
            units += u64::from(g.units_total);
        }
    }
    if units > MAX_UNITS {
        return refuse(format!("{units} gpu-memory units (at most {MAX_UNITS})"));
    }
    let capacity = |name: &str| {
        node.status
            .capacity
            .as_ref()
            .and_then(|c| c.get(&format!("{domain}/{name}")))
            .and_then(quantity_milli)
            .map_or(0, |m| u64::try_from(m / 1000).unwrap_or(0))
    };
    let has = capacity("gpu-memory");
    // A DRA node's kubelet counts none of its devices: its units are not bounded here. Its
    // document can only matter to pods that hold claims (NodeResourcesFit keeps pods asking
    // gpu-memory off a node that counts none), whose devices kube-scheduler's DRA plugin has
    // already found in the node's ResourceSlices, which the same agent writes.
    if units > has && !(state.dra && has == 0) {
        return refuse(format!(
            "the document offers {units} gpu-memory units, the kubelet counts {has} on the Node"
        ));
    }
    let whole = state.gpus.iter().filter(|g| g.mig.is_empty()).count() as u64;
    let gpus = capacity("gpu");
    if gpus > 0 && whole > gpus {
        return refuse(format!("the document has {whole} GPUs, the kubelet counts {gpus}"));
    }
    Ok(())
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
    /// A DRA claim of it was not known when it was read: `demand` holds its containers' asks
    /// only, until the claim arrives ([`crate::claims::ClaimIndex::resolved`]).
    pub claims_pending: bool,
}

impl PodEntry {
    /// The entry of `pod`, reading resources in `domain`.
    pub fn of(pod: &Pod, domain: &str) -> Self {
        Self::with_claims(pod, domain, &crate::claims::ClaimIndex::default())
    }

    /// The entry of `pod`, reading resources in `domain` and its DRA claims in `claims`.
    pub fn with_claims(pod: &Pod, domain: &str, claims: &crate::claims::ClaimIndex) -> Self {
        let phase = pod.status.phase.as_deref();
        // The containers' asks, and the claims' where they are known.
        let (demand, claims_pending) = match Demand::of(pod, domain) {
            Err(_) => (Demand::default(), false),
            Ok(mut demand) => match claims.asks_of(pod) {
                Ok(asks) => {
                    demand.asks.extend(asks);
                    (demand, false)
                }
                Err(_) => (demand, true),
            },
        };
        Self {
            key: format!("{}/{}", pod.metadata.namespace, pod.metadata.name),
            node: pod.spec.node_name.clone().filter(|n| !n.is_empty()),
            demand,
            claims_pending,
            finished: matches!(phase, Some("Succeeded" | "Failed")),
        }
    }
}

/// One node's place in the view: its entry (none while it is gone) and its stamp (its name is
/// the [`NameIndex`]'s). A name keeps its slot for the view's life, so that the verbs' memos
/// can be indexed by slot.
#[derive(Debug)]
struct Slot {
    entry: Option<NodeEntry>,
    stamp: u64,
}

/// A node as a verb finds it by name: its slot (the memos' index), its entry if it is known,
/// and its stamp.
#[derive(Debug, Clone, Copy)]
pub struct Found<'a> {
    /// The node's slot.
    pub slot: usize,
    /// Its entry (`None`: unknown, or gone).
    pub entry: Option<&'a NodeEntry>,
    /// [`ClusterView::stamp`].
    pub stamp: u64,
    /// Its entry's start in a `prioritize` answer, `{"Host":<the name as JSON>,"Score":`,
    /// written once, when the view first hears of the name.
    pub item: &'a str,
}

/// Node names to slots: one hash of the name per node per call (foldhash: node names are not
/// chosen by whoever calls the verbs, and the extender holds at most the cluster's). The names
/// lie side by side in one string, so that the 5,000 comparisons of a call read a few hundred
/// KiB in order rather than 5,000 allocations scattered among the nodes' entries (a `HashMap`
/// of `String`s spent a sixth of a call's server time in those comparisons, perf, 2026-12-02).
#[derive(Debug, Default)]
struct NameIndex {
    hasher: foldhash::fast::RandomState,
    /// Every name, in slot order.
    names: String,
    /// Slot `i`'s name is `names[ends[i - 1]..ends[i]]`.
    ends: Vec<usize>,
    /// Per slot, the start of its entry in a `prioritize` answer ([`Found::item`]), side by
    /// side, so that 5,000 entries are written with one copy each: slot `i`'s is
    /// `items[item_ends[i - 1]..item_ends[i]]`.
    items: String,
    item_ends: Vec<usize>,
    table: hashbrown::HashTable<usize>,
}

/// Slot `slot`'s name in [`NameIndex`]'s `names` and `ends`.
fn name_at<'a>(names: &'a str, ends: &[usize], slot: usize) -> &'a str {
    let start = slot.checked_sub(1).map_or(0, |i| ends[i]);
    &names[start..ends[slot]]
}

impl NameIndex {
    fn name(&self, slot: usize) -> &str {
        name_at(&self.names, &self.ends, slot)
    }

    fn item(&self, slot: usize) -> &str {
        name_at(&self.items, &self.item_ends, slot)
    }

    fn hash(&self, name: &str) -> u64 {
        std::hash::BuildHasher::hash_one(&self.hasher, name)
    }

    fn get(&self, name: &str) -> Option<usize> {
        // Compared as bytes: the same test, without a char-boundary check per candidate.
        let (names, ends) = (self.names.as_bytes(), &self.ends);
        let wanted = name.as_bytes();
        self.table
            .find(self.hash(name), |&i| {
                let start = i.checked_sub(1).map_or(0, |p| ends[p]);
                names.get(start..ends[i]) == Some(wanted)
            })
            .copied()
    }

    /// Gives `name` the next slot (the caller knows it has none) and returns it.
    fn push(&mut self, name: &str) -> usize {
        let slot = self.ends.len();
        self.names.push_str(name);
        self.ends.push(self.names.len());
        crate::protocol::push_host_item(&mut self.items, name);
        self.item_ends.push(self.items.len());
        let hash = self.hash(name);
        let Self { hasher, names, ends, table, .. } = self;
        table.insert_unique(hash, slot, |&i| {
            std::hash::BuildHasher::hash_one(&*hasher, name_at(names, ends, i))
        });
        slot
    }
}

/// How many changes [`ClusterView::changed_since`] remembers: many more than happen between
/// two pods of a demand at kube-scheduler's pace, few enough to cost nothing (8 KiB).
const CHANGE_LOG: usize = 1024;

/// The cluster view behind its lock, with a count of the writers waiting for it.
///
/// The lock lets no new reader in while a writer waits, so a writer that waits stalls every
/// call behind it. The policy rebuild reads the view in hundreds of short holds; std's lock
/// wakes a waiting writer when the last reader leaves, but a reader that comes back within
/// microseconds takes the lock again before the writer has woken, and the writer sleeps again:
/// the watchers lost every such race, and calls queued behind them for the whole rebuild (5-35
/// ms, issue 39, item 6). [`Self::read_after_writers`] is the rebuild's read: it first waits
/// until no writer is waiting, so a writer waits at most one of its holds.
#[derive(Debug, Default)]
pub struct SharedView {
    lock: std::sync::RwLock<ClusterView>,
    /// Writers waiting for (or about to take) the lock.
    writers: std::sync::atomic::AtomicUsize,
}

/// How long [`SharedView::read_after_writers`] sleeps between looks at the waiting writers.
const STAND_ASIDE: std::time::Duration = std::time::Duration::from_micros(20);

impl SharedView {
    /// The view, to read (the verbs: they hold it briefly, and never stand aside).
    pub fn read(&self) -> std::sync::LockResult<std::sync::RwLockReadGuard<'_, ClusterView>> {
        self.lock.read()
    }

    /// The view, to change: counted as waiting until it holds the lock.
    pub fn write(&self) -> std::sync::LockResult<std::sync::RwLockWriteGuard<'_, ClusterView>> {
        use std::sync::atomic::Ordering;
        self.writers.fetch_add(1, Ordering::SeqCst);
        let guard = self.lock.write();
        self.writers.fetch_sub(1, Ordering::SeqCst);
        guard
    }

    /// The view, to read, once no writer waits: for work that reads in many holds beside the
    /// calls (the policy rebuild), so that it never keeps a writer, and the calls queued behind
    /// the writer, waiting for more than one hold. Never poisoned (a panicking writer's view
    /// is read as it was left, as everywhere in the extender).
    pub fn read_after_writers(&self) -> std::sync::RwLockReadGuard<'_, ClusterView> {
        while self.writers.load(std::sync::atomic::Ordering::SeqCst) > 0 {
            std::thread::sleep(STAND_ASIDE);
        }
        self.lock.read().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// Nodes and pods.
#[derive(Debug, Default)]
pub struct ClusterView {
    /// Per node name, its slot.
    ids: NameIndex,
    slots: Vec<Slot>,
    live_nodes: usize,
    pods: HashMap<String, PodEntry>,
    /// Per node, the UIDs of the live pods bound to it.
    by_node: HashMap<String, BTreeSet<String>>,
    /// When a node was last added, changed or removed.
    pub updated: Option<Instant>,
    changes: u64,
    /// The slots of the latest [`CHANGE_LOG`] changes, oldest first: the last is change
    /// number `changes`'s ([`Self::changed_since`]).
    changed: std::collections::VecDeque<usize>,
    /// Pods this extender bound (the `bind` verb) that the Pod watch does not show bound yet,
    /// by UID: the node. An older event of the pod (still pending) does not undo the binding.
    reserved: HashMap<String, String>,
}

impl ClusterView {
    /// The slot of `name`, made if it has none.
    fn slot_of(&mut self, name: &str) -> usize {
        if let Some(i) = self.ids.get(name) {
            return i;
        }
        let i = self.ids.push(name);
        self.slots.push(Slot { entry: None, stamp: 0 });
        i
    }

    /// Adds or replaces a node.
    pub fn set_node(&mut self, name: &str, entry: NodeEntry) {
        let i = self.slot_of(name);
        if self.slots[i].entry.replace(entry).is_none() {
            self.live_nodes += 1;
        }
        self.updated = Some(Instant::now());
        self.touch(name);
    }

    /// Forgets a node.
    pub fn remove_node(&mut self, name: &str) {
        let Some(i) = self.ids.get(name) else { return };
        if self.slots[i].entry.take().is_some() {
            self.live_nodes -= 1;
        }
        self.updated = Some(Instant::now());
        // A node that comes back is judged afresh: its stamp moves on.
        self.touch(name);
        if self.by_node.get(name).is_some_and(BTreeSet::is_empty) {
            self.by_node.remove(name);
        }
    }

    fn touch(&mut self, node: &str) {
        self.changes += 1;
        let i = self.slot_of(node);
        self.slots[i].stamp = self.changes;
        if self.changed.len() >= CHANGE_LOG {
            self.changed.pop_front();
        }
        self.changed.push_back(i);
    }

    /// The slots of the nodes changed since [`Self::changes`] was `since` (a slot once per
    /// change of it), so that an answer judged then can be checked node by node; `None` where
    /// more changes happened since than the view remembers, or `since` is not a past count.
    pub fn changed_since(&self, since: u64) -> Option<impl Iterator<Item = usize> + '_> {
        let back = usize::try_from(self.changes.checked_sub(since)?).ok()?;
        let skip = self.changed.len().checked_sub(back)?;
        Some(self.changed.iter().skip(skip).copied())
    }

    /// A number that changes whenever `node` or a pod bound to it changes.
    pub fn stamp(&self, node: &str) -> u64 {
        self.ids.get(node).map_or(0, |i| self.slots[i].stamp)
    }

    /// `name`'s slot, entry and stamp in one lookup; `None` if the view never heard of it.
    pub fn find(&self, name: &str) -> Option<Found<'_>> {
        let slot = self.ids.get(name)?;
        let s = &self.slots[slot];
        Some(Found { slot, entry: s.entry.as_ref(), stamp: s.stamp, item: self.ids.item(slot) })
    }

    /// Slot `slot`'s name and what [`Self::find`] finds by it; `None` past the last slot.
    pub fn at(&self, slot: usize) -> Option<(&str, Found<'_>)> {
        let s = self.slots.get(slot)?;
        let item = self.ids.item(slot);
        Some((self.ids.name(slot), Found { slot, entry: s.entry.as_ref(), stamp: s.stamp, item }))
    }

    /// Slot `slot`'s name; `None` past the last slot.
    pub fn name_of(&self, slot: usize) -> Option<&str> {
        (slot < self.slots.len()).then(|| self.ids.name(slot))
    }

    /// Slot `slot`'s [`Found::item`]; `None` past the last slot.
    pub fn item_at(&self, slot: usize) -> Option<&str> {
        (slot < self.slots.len()).then(|| self.ids.item(slot))
    }

    /// Slot `slot`'s entry (`None` while its node is gone) and stamp, as [`Self::find`] finds
    /// them by its name. A slot past the last is no node's.
    pub fn entry_at(&self, slot: usize) -> (Option<&NodeEntry>, u64) {
        self.slots.get(slot).map_or((None, 0), |s| (s.entry.as_ref(), s.stamp))
    }

    /// Slot `slot`'s name as a JSON string (as serde_json writes it): the middle of its
    /// [`Found::item`].
    pub fn quoted(&self, slot: usize) -> &str {
        let item = self.ids.item(slot);
        &item[crate::protocol::HOST_ITEM_START.len()
            ..item.len() - crate::protocol::HOST_ITEM_SCORE.len()]
    }

    /// A number that changes whenever any node's stamp does: what every verdict and score is
    /// computed from is unchanged while it is (the answers made ahead are checked by it).
    pub fn changes(&self) -> u64 {
        self.changes
    }

    /// How many slots there are (one past the highest [`Found::slot`]).
    pub fn slots(&self) -> usize {
        self.slots.len()
    }

    /// Keeps only the nodes `keep` names (after a watcher's fresh list).
    pub fn retain_nodes(&mut self, keep: impl Fn(&str) -> bool) {
        let gone: Vec<String> =
            self.nodes().filter(|(name, _)| !keep(name)).map(|(name, _)| name.to_owned()).collect();
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
        self.find(name)?.entry
    }

    /// Every node.
    pub fn nodes(&self) -> impl Iterator<Item = (&str, &NodeEntry)> {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| Some((self.ids.name(i), s.entry.as_ref()?)))
    }

    /// How many nodes.
    pub fn node_count(&self) -> usize {
        self.live_nodes
    }

    /// The nodes' documents that can be used.
    pub fn states(&self) -> impl Iterator<Item = &NodeGpuState> {
        self.slots.iter().filter_map(|s| s.entry.as_ref()?.state.as_ref().ok())
    }

    /// Adds or replaces a pod by UID. A pod this extender bound and the watch still shows
    /// pending stays bound where it was bound; once the watch shows it bound, it is the watch's.
    pub fn set_pod(&mut self, uid: &str, mut entry: PodEntry) {
        match &entry.node {
            Some(_) => {
                self.reserved.remove(uid);
            }
            None => {
                if let Some(node) = self.reserved.get(uid) {
                    entry.node = Some(node.clone());
                }
            }
        }
        self.remove_pod_entry(uid);
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

    /// Counts the pod `uid` as bound to `node` from now on (the `bind` verb), before the watch
    /// shows it: the next filter counts what it asks there.
    pub fn reserve(&mut self, uid: &str, mut entry: PodEntry, node: &str) {
        entry.node = Some(node.to_owned());
        self.set_pod(uid, entry);
        self.reserved.insert(uid.to_owned(), node.to_owned());
    }

    /// Undoes [`Self::reserve`] (the binding failed): the pod is `entry` again.
    pub fn unreserve(&mut self, uid: &str, entry: PodEntry) {
        if self.reserved.remove(uid).is_some() {
            self.set_pod(uid, entry);
        }
    }

    /// A pod by UID.
    pub fn pod(&self, uid: &str) -> Option<&PodEntry> {
        self.pods.get(uid)
    }

    /// Forgets a pod.
    pub fn remove_pod(&mut self, uid: &str) {
        self.reserved.remove(uid);
        self.remove_pod_entry(uid);
    }

    fn remove_pod_entry(&mut self, uid: &str) {
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
        self.assumed_except(node, state, domain, &BTreeSet::new())
    }

    /// [`Self::assumed`], leaving out the pods whose UIDs are in `except` (preemption's
    /// victims).
    pub fn assumed_except(
        &self,
        node: &str,
        state: &NodeGpuState,
        domain: &str,
        except: &BTreeSet<&str>,
    ) -> Vec<Demand> {
        // A pod the document names (by UID where it gives one, else by name) is counted in it.
        let mut pods: Vec<&PodEntry> = self
            .by_node
            .get(node)
            .into_iter()
            .flatten()
            .filter(|uid| !except.contains(uid.as_str()))
            .filter_map(|uid| Some((uid, self.pods.get(uid)?)))
            .filter(|(uid, p)| !p.demand.is_empty() && !state.names_pod(&p.key, uid))
            .map(|(_, p)| p)
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

#[cfg(test)]
mod believing {
    use super::*;
    use baleen_k8s::gpu_state::{GpuEntry, GpuMode, VERSION};

    fn gpu(index: u32, total: u32, free: u32) -> GpuEntry {
        GpuEntry {
            index,
            uuid: format!("GPU-{index}"),
            model: "H200".into(),
            memory_bytes: 140 << 30,
            numa_node: None,
            nvlink_peers: vec![],
            mode: GpuMode::Shared,
            healthy: true,
            shares_offered: true,
            units_total: total,
            units_free: free,
            compute_free_milli: 0,
            mig: vec![],
            pods: vec![],
        }
    }

    fn node(gpus: Vec<GpuEntry>, capacity: &str) -> Node {
        let state = NodeGpuState {
            version: VERSION,
            node: "a".into(),
            generation: 1,
            memory_unit_bytes: 1 << 30,
            resources: vec![],
            gpus,
            nvlink_groups: vec![],
            unnamed: vec![],
            pod_uids: Default::default(),
            dra: false,
        };
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "a", "annotations": {"d.io/gpu-state": state.to_json()}},
            "status": {"capacity": {"d.io/gpu-memory": capacity, "d.io/gpu": "2"}}
        }))
        .expect("node")
    }

    #[test]
    fn hostile_documents_are_refused_and_honest_ones_kept() {
        let entry = |n: &Node| NodeEntry::of(n, "d.io/gpu-state").state;
        assert!(entry(&node(vec![gpu(0, 140, 100), gpu(1, 140, 140)], "280")).is_ok());
        // Free units past the total (the 4,294,967,295 free units of one attack).
        let e = entry(&node(vec![gpu(0, 140, u32::MAX)], "280")).expect_err("free > total");
        assert!(e.contains("free of 140"), "{e}");
        // More units than the kubelet counts on the Node.
        let e = entry(&node(vec![gpu(0, u32::MAX, u32::MAX)], "280")).expect_err("units");
        assert!(e.starts_with("refused:"), "{e}");
        let three = vec![gpu(0, 140, 140), gpu(1, 140, 140), gpu(2, 140, 140)];
        let e = entry(&node(three, "1000")).expect_err("GPUs");
        assert!(e.contains("3 GPUs"), "{e}");
        // No devices counted at all (the Node has no such capacity).
        let e = entry(&node(vec![gpu(0, 140, 140)], "0")).expect_err("nothing counted");
        assert!(e.contains("counts 0"), "{e}");
        // A DRA node's: its kubelet counts no gpu-memory, its document is believed as far as
        // the agent's limits; a device-plugin node claiming to be one still is not.
        let dra = |capacity: &str, gpus| {
            let mut n = node(gpus, capacity);
            let key = "d.io/gpu-state";
            let annotations = n.metadata.annotations.as_mut().expect("annotations");
            let mut doc = NodeGpuState::parse(&annotations[key]).expect("doc");
            doc.dra = true;
            annotations.insert(key.into(), doc.to_json());
            entry(&n)
        };
        assert!(dra("0", vec![gpu(0, 140, 140)]).is_ok());
        let e = dra("100", vec![gpu(0, 140, 140)]).expect_err("more than counted");
        assert!(e.contains("counts 100"), "{e}");
        let many: Vec<GpuEntry> = (0..65).map(|i| gpu(i, 1, 1)).collect();
        assert!(dra("0", many).is_err(), "past the agent's limits");
        // Past the agent's own limits.
        let many: Vec<GpuEntry> = (0..65).map(|i| gpu(i, 1, 1)).collect();
        assert!(entry(&node(many, "100000")).is_err());
    }
}

#[cfg(test)]
mod sharing {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Duration;

    /// Issue 39, item 6: a reader that takes the view again and again (the policy rebuild)
    /// keeps a writer (a watcher) waiting for at most about one of its holds; with std's lock
    /// alone the reader won every race and the writer (and every call behind it) waited for
    /// the whole rebuild.
    #[test]
    fn a_writer_waits_for_at_most_one_hold_of_a_busy_reader() {
        let view = Arc::new(SharedView::default());
        let stop = Arc::new(AtomicBool::new(false));
        let hold = Duration::from_millis(5);
        let reader = std::thread::spawn({
            let (view, stop) = (view.clone(), stop.clone());
            move || {
                let mut holds = 0u32;
                while !stop.load(Ordering::SeqCst) {
                    let guard = view.read_after_writers();
                    std::thread::sleep(hold);
                    drop(guard);
                    holds += 1;
                }
                holds
            }
        });
        std::thread::sleep(Duration::from_millis(20));
        let mut longest = Duration::ZERO;
        for _ in 0..20 {
            let asked = Instant::now();
            let mut guard = view.write().expect("not poisoned");
            longest = longest.max(asked.elapsed());
            guard.updated = Some(Instant::now());
            drop(guard);
            std::thread::sleep(Duration::from_millis(5));
        }
        stop.store(true, Ordering::SeqCst);
        let holds = reader.join().expect("reader");
        assert!(holds > 20, "the reader held the view only {holds} times: it must keep it busy");
        // One hold (5 ms) and the scheduler's latency; a lost race costs another whole hold
        // each time, and the reader never stops.
        assert!(longest < Duration::from_millis(100), "a writer waited {longest:?}");
    }
}
