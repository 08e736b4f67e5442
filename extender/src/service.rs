//! The extender's two verbs over the cluster view: `filter` (which candidate nodes can take the
//! pod, and why not) and `prioritize` (how well, by the `scheduler_core` policy), and the
//! policy's target workload, learned online from the pods seen and rebuilt off the request path.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex, PoisonError, RwLock};

use baleen_k8s::gpu_state::NodeGpuState;
use baleen_scheduler_core::model::Request;
use baleen_scheduler_core::policy::{Normalisers, Policy, PolicyKind};

use crate::cluster::{ClusterView, NodeEntry};
use crate::demand::Demand;
use crate::place::{NodeModel, Verdict, extender_scores, verdict};
use crate::protocol::{ExtenderArgs, ExtenderFilterResult, HostPriority, Node, NodeListOut};

/// The extender's settings.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Resource domain.
    pub domain: String,
    /// The placement policy.
    pub policy: PolicyKind,
    /// How many recent pods the target workload is learned from.
    pub target_window: usize,
    /// Rebuild the policy after this many new pods.
    pub rebuild_every: usize,
    /// The second scheduler baleen's pods go to, if there is one: GPU pods the Pod watcher sees
    /// pending under another scheduler are counted and logged (the webhook was down, or their
    /// namespace opted out).
    pub scheduler_name: Option<String>,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            domain: baleen_k8s::gpu_state::DEFAULT_DOMAIN.into(),
            policy: PolicyKind::Baleen,
            target_window: 5000,
            rebuild_every: 100,
            scheduler_name: None,
        }
    }
}

impl Settings {
    /// The annotation the agents write, `<domain>/gpu-state`.
    pub fn annotation(&self) -> String {
        format!("{}/{}", self.domain, baleen_k8s::gpu_state::ANNOTATION_NAME)
    }
}

/// Why a filtered-out node failed, for the metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum FailKind {
    /// No usable gpu-state document.
    NoState,
    /// Does not fit now.
    Full,
    /// Cannot fit even empty.
    Never,
}

impl FailKind {
    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            FailKind::NoState => "no_state",
            FailKind::Full => "full",
            FailKind::Never => "never",
        }
    }
}

/// The answer while the watchers have not listed yet.
pub const NOT_SYNCED: &str =
    "baleen-extender has not listed the cluster's nodes and pods yet; try again shortly";

/// How many of the most common recent demands are scored on every node after a rebuild.
const WARM_DEMANDS: usize = 8;

/// Per demand and node, the filter's verdict and the node stamp it holds for.
type Verdicts = Memo<u64, Verdict>;

/// Per demand and node, the policy's score and the (node stamp, policy epoch) it holds for.
type Scores = Memo<(u64, u64), Option<i64>>;

/// Per demand, per node: a value and what it holds for.
type Memo<K, V> = std::collections::HashMap<Demand, std::collections::HashMap<String, (K, V)>>;

/// The most demands remembered; past it the memo starts afresh.
const MEMO_DEMANDS: usize = 64;

/// The pods seen, for the target workload.
#[derive(Debug, Default)]
struct Seen {
    recent: VecDeque<Demand>,
    uids: std::collections::HashSet<String>,
    since_rebuild: usize,
}

/// The extender.
pub struct Extender {
    settings: Settings,
    /// Nodes and pods (the watchers write, the verbs read).
    pub cluster: RwLock<ClusterView>,
    policy: RwLock<Arc<Policy>>,
    /// Rebuilds of the policy so far (what a cached score is valid for).
    epoch: std::sync::atomic::AtomicU64,
    /// Per node: the filter's verdicts and the scores by demand, valid while the node, the
    /// pods bound to it and the policy stay the same. Only one node changes per placement, so
    /// most of the next call's work is here.
    verdicts: Mutex<Verdicts>,
    scores: Mutex<Scores>,
    seen: Mutex<Seen>,
    rebuild: tokio::sync::Notify,
    /// Whether the Node and the Pod watchers have each listed once (true when none runs).
    synced: [std::sync::atomic::AtomicBool; 2],
    /// Whether watchers feed the view (then only they teach the target workload).
    watched: std::sync::atomic::AtomicBool,
    /// GPU pods first seen pending under another scheduler than `settings.scheduler_name`.
    pub not_sent: prometheus::IntCounter,
    /// gpu-state documents refused as not believable ([`crate::cluster::believable`]).
    pub refused_documents: prometheus::IntCounter,
}

/// Which watcher has listed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Watched {
    /// Nodes.
    Nodes = 0,
    /// Pods.
    Pods = 1,
}

impl Extender {
    /// An extender with nothing seen yet (an empty target until the first pods).
    pub fn new(settings: Settings) -> Arc<Self> {
        let none = std::iter::empty::<&Request>();
        let policy = Policy::for_requests(settings.policy, none, 0.95, Normalisers::default());
        Arc::new(Self {
            settings,
            cluster: RwLock::new(ClusterView::default()),
            policy: RwLock::new(Arc::new(policy)),
            epoch: std::sync::atomic::AtomicU64::new(0),
            verdicts: Mutex::new(Verdicts::new()),
            scores: Mutex::new(Scores::new()),
            seen: Mutex::new(Seen::default()),
            rebuild: tokio::sync::Notify::new(),
            synced: [
                std::sync::atomic::AtomicBool::new(true),
                std::sync::atomic::AtomicBool::new(true),
            ],
            watched: std::sync::atomic::AtomicBool::new(false),
            not_sent: prometheus::IntCounter::new(
                "baleen_extender_pods_not_sent_total",
                "Pods asking for a baleen resource first seen pending under another scheduler than baleen's (the webhook was down, or the namespace opted out).",
            )
            .unwrap_or_else(|_| unreachable_counter()),
            refused_documents: prometheus::IntCounter::new(
                "baleen_extender_documents_refused_total",
                "gpu-state documents refused because the Node's own device counts do not bear them out (more units or GPUs than the kubelet counts, more free than total, past the agent's limits).",
            )
            .unwrap_or_else(|_| unreachable_counter()),
        })
    }

    /// Counts and logs `pod` if it asks for a baleen resource, is new to the view, pending, and
    /// names another scheduler than baleen's second scheduler.
    pub fn note_scheduler(&self, view: &ClusterView, pod: &crate::protocol::Pod, asks: bool) {
        let Some(ours) = self.settings.scheduler_name.as_deref() else { return };
        if !asks || pod.spec.node_name.as_deref().is_some_and(|n| !n.is_empty()) {
            return;
        }
        if view.has_pod(&pod.metadata.uid) {
            return;
        }
        let named = pod.spec.scheduler_name.as_deref().unwrap_or("default-scheduler");
        if named != ours {
            self.not_sent.inc();
            tracing::warn!(
                namespace = pod.metadata.namespace,
                name = pod.metadata.name,
                scheduler = named,
                "a pod asking for a baleen resource goes to another scheduler than {ours}: the webhook was down or its namespace opted out; it may be placed where no GPU has room"
            );
        }
    }

    /// From now on the verbs answer only once both watchers have listed ([`Self::listed`]).
    /// The target workload is then learned from the Pod watcher only ([`Self::learn`]), never
    /// from a call's pod: an unauthenticated caller could otherwise send made-up pods until the
    /// target is theirs.
    pub fn await_watchers(&self) {
        self.watched.store(true, std::sync::atomic::Ordering::SeqCst);
        for s in &self.synced {
            s.store(false, std::sync::atomic::Ordering::SeqCst);
        }
    }

    /// A watcher has listed everything once.
    pub fn listed(&self, what: Watched) {
        self.synced[what as usize].store(true, std::sync::atomic::Ordering::SeqCst);
    }

    /// Whether the caches can be trusted: every watcher has listed once. Before that, a node
    /// would look unknown and a bound pod would be missed.
    pub fn synced(&self) -> bool {
        self.synced.iter().all(|s| s.load(std::sync::atomic::Ordering::SeqCst))
    }

    /// The settings.
    pub fn settings(&self) -> &Settings {
        &self.settings
    }

    fn view(&self) -> std::sync::RwLockReadGuard<'_, ClusterView> {
        self.cluster.read().unwrap_or_else(PoisonError::into_inner)
    }

    /// The Nodes a call sent in full, parsed (their annotations as sent), with their place in
    /// the list.
    fn sent_entries(&self, args: &ExtenderArgs) -> Vec<(String, NodeEntry, usize)> {
        let key = self.settings.annotation();
        args.nodes
            .iter()
            .flat_map(|list| list.items.iter().enumerate())
            .map(|(i, raw)| {
                let node: Node = serde_json::from_value(raw.clone()).unwrap_or_default();
                (node.metadata.name.clone(), NodeEntry::of(&node, &key), i)
            })
            .collect()
    }

    /// Records the pod `pod_uid` with `demand` for the target workload (once per pod; from the
    /// Pod watcher, or from the filter's pod where no watcher runs); wakes the rebuilder every
    /// `rebuild_every`.
    pub fn learn(&self, pod_uid: &str, demand: &Demand) {
        let mut seen = self.seen.lock().unwrap_or_else(PoisonError::into_inner);
        if demand.is_empty() || (!pod_uid.is_empty() && !seen.uids.insert(pod_uid.to_owned())) {
            return;
        }
        seen.recent.push_back(demand.clone());
        if seen.recent.len() > self.settings.target_window {
            seen.recent.pop_front();
        }
        seen.since_rebuild += 1;
        // The first pod too: until then the target is empty and every node scores the same.
        if seen.since_rebuild >= self.settings.rebuild_every || seen.recent.len() == 1 {
            seen.since_rebuild = 0;
            self.rebuild.notify_one();
        }
        if seen.uids.len() > 4 * self.settings.target_window {
            seen.uids.clear();
        }
    }

    /// The policy now.
    pub fn policy(&self) -> Arc<Policy> {
        self.policy.read().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// Rebuilds the policy from the pods seen (the LP of `baleen` runs here, not in a verb).
    pub fn rebuild_policy(&self) {
        let demands: Vec<Demand> = {
            let seen = self.seen.lock().unwrap_or_else(PoisonError::into_inner);
            seen.recent.iter().cloned().collect()
        };
        let requests = self.requests_of(&demands);
        let (cpu, gpus) = {
            let view = self.view();
            let mut cpu = 0u64;
            let mut gpus = 0usize;
            for (_, entry) in view.nodes() {
                if let Ok(state) = &entry.state {
                    cpu = cpu.saturating_add(entry.allocatable.0);
                    gpus += state.gpus.len();
                }
            }
            (cpu, gpus)
        };
        let policy =
            Policy::for_requests(self.settings.policy, &requests, 0.95, Normalisers::default());
        // The cluster's CPU scarcity is read from the target only once it holds enough pods:
        // the first pod's CPU per GPU alone says little (it cost 1.2 points on a tenth of the
        // trace's nodes, docs/benchmarks.md).
        let policy = Arc::new(if demands.len() >= self.settings.rebuild_every {
            policy.for_cluster(baleen_scheduler_core::units::MilliCpu(cpu), gpus)
        } else {
            policy
        });
        // Score every node for the most common recent demands with the new policy before it
        // replaces the old one, so that the calls after a rebuild do not pay for it.
        let mut counts: std::collections::HashMap<&Demand, usize> =
            std::collections::HashMap::new();
        for d in &demands {
            *counts.entry(d).or_default() += 1;
        }
        let mut common: Vec<(&Demand, usize)> = counts.into_iter().collect();
        common.sort_by_key(|c| std::cmp::Reverse(c.1));
        common.truncate(WARM_DEMANDS);
        let view = self.view();
        let epoch = self.epoch.load(std::sync::atomic::Ordering::SeqCst) + 1;
        let mut warm = Scores::new();
        for (name, entry) in view.nodes() {
            let Ok(state) = &entry.state else { continue };
            let Some(mut model) = NodeModel::new(state, view.host(name, entry.allocatable)) else {
                continue;
            };
            for other in &view.assumed(name, state, &self.settings.domain) {
                model.assume(other, &policy);
            }
            for (demand, _) in &common {
                let score = model.score(demand, &policy);
                let per_node = warm.entry((*demand).clone()).or_default();
                per_node.insert(name.clone(), ((view.stamp(name), epoch), score));
            }
        }
        drop(view);
        // The old scores are all stale now: swapped out whole, dropped outside the lock.
        let old = {
            let mut scores = self.scores.lock().unwrap_or_else(PoisonError::into_inner);
            *self.policy.write().unwrap_or_else(PoisonError::into_inner) = policy;
            self.epoch.store(epoch, std::sync::atomic::Ordering::SeqCst);
            std::mem::replace(&mut *scores, warm)
        };
        drop(old);
    }

    /// The demands as placement requests on the cluster's most common GPU (its units).
    fn requests_of(&self, demands: &[Demand]) -> Vec<Request> {
        let view = self.view();
        let mut by_units: BTreeMap<u32, usize> = BTreeMap::new();
        let mut sample: BTreeMap<u32, &NodeGpuState> = BTreeMap::new();
        for s in view.states() {
            let units = s.gpus.iter().map(|g| g.units_total).max().unwrap_or(0);
            *by_units.entry(units).or_default() += 1;
            sample.entry(units).or_insert(s);
        }
        let Some(common) = by_units.iter().max_by_key(|(_, n)| **n).map(|(u, _)| *u) else {
            return Vec::new();
        };
        let Some(model) = NodeModel::new(sample[&common], Default::default()) else {
            return Vec::new();
        };
        demands.iter().filter_map(|d| model.request(d)).collect()
    }

    /// Runs the rebuilder until `shutdown`: after every `rebuild_every` new pods.
    pub async fn run_rebuilder(self: Arc<Self>, shutdown: tokio_util::sync::CancellationToken) {
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = self.rebuild.notified() => {}
            }
            let me = self.clone();
            // The LP may take milliseconds: off the async workers.
            let _ = tokio::task::spawn_blocking(move || me.rebuild_policy()).await;
        }
    }

    /// The filter verb; also returns, per filtered-out node, why (for the metrics).
    pub fn filter(&self, args: &ExtenderArgs) -> (ExtenderFilterResult, Vec<FailKind>) {
        let mut result = ExtenderFilterResult::default();
        let mut kinds = Vec::new();
        if !self.synced() {
            result.error = NOT_SYNCED.into();
            return (result, kinds);
        }
        let demand = match Demand::of(&args.pod, &self.settings.domain) {
            Ok(d) => d,
            Err(e) => {
                result.error = format!("pod {}: {e}", pod_name(args));
                return (result, kinds);
            }
        };
        if !self.watched.load(std::sync::atomic::Ordering::SeqCst) {
            self.learn(&args.pod.metadata.uid, &demand);
        }
        let sent = self.sent_entries(args);
        let view = self.view();
        let mut memo_map = self.verdicts.lock().unwrap_or_else(PoisonError::into_inner);
        let cache = demand_memo(&mut memo_map, &demand);
        let mut judge = |name: &str, entry: Option<&NodeEntry>, cached: bool| -> Verdict {
            if demand.is_empty() {
                // Not ours to judge: every node passes.
                return Verdict::Fits;
            }
            let Some(entry) = entry else {
                return Verdict::NoState("unknown to the extender's node cache".into());
            };
            let compute = || match &entry.state {
                Err(why) => Verdict::NoState(why.clone()),
                Ok(state) => {
                    let assumed = view.assumed(name, state, &self.settings.domain);
                    let assumed: Vec<&Demand> = assumed.iter().collect();
                    verdict(state, &assumed, &demand, &self.settings.domain)
                }
            };
            if !cached {
                return compute();
            }
            remembered(cache, name, view.stamp(name), compute)
        };
        let mut passed = Vec::new();
        let mut judged = |name: &str, verdict: Verdict, index: Option<usize>| match verdict {
            Verdict::Fits => passed.push((name.to_owned(), index)),
            Verdict::Full(why) => {
                kinds.push(FailKind::Full);
                result.failed_nodes.insert(name.to_owned(), why);
            }
            Verdict::Never(why) => {
                kinds.push(FailKind::Never);
                result.failed_and_unresolvable_nodes.insert(name.to_owned(), why);
            }
            Verdict::NoState(why) => {
                kinds.push(FailKind::NoState);
                result.failed_and_unresolvable_nodes.insert(name.to_owned(), why);
            }
        };
        if args.nodes.is_some() {
            for (name, entry, i) in &sent {
                let v = judge(name, Some(entry), false);
                judged(name, v, Some(*i));
            }
        } else {
            for name in args.node_names.iter().flatten() {
                let v = judge(name, view.node(name), true);
                judged(name, v, None);
            }
        }
        drop(memo_map);
        drop(view);
        if let Some(list) = &args.nodes {
            result.nodes = Some(NodeListOut {
                metadata: list.metadata.clone().unwrap_or_else(|| serde_json::json!({})),
                items: passed
                    .iter()
                    .filter_map(|(_, i)| i.map(|i| list.items[i].clone()))
                    .collect(),
            });
        } else {
            result.node_names = Some(passed.into_iter().map(|(n, _)| n).collect());
        }
        (result, kinds)
    }

    /// The prioritize verb.
    pub fn prioritize(&self, args: &ExtenderArgs) -> Result<Vec<HostPriority>, String> {
        if !self.synced() {
            return Err(NOT_SYNCED.into());
        }
        let demand = Demand::of(&args.pod, &self.settings.domain)
            .map_err(|e| format!("pod {}: {e}", pod_name(args)))?;
        let sent = self.sent_entries(args);
        let names: Vec<&str> = if args.nodes.is_some() {
            sent.iter().map(|(n, _, _)| n.as_str()).collect()
        } else {
            args.node_names.iter().flatten().map(String::as_str).collect()
        };
        if demand.is_empty() {
            // Unscored: every node the same.
            return Ok(names
                .into_iter()
                .map(|host| HostPriority { host: host.to_owned(), score: 0 })
                .collect());
        }
        let (policy, epoch) = {
            let policy = self.policy.read().unwrap_or_else(PoisonError::into_inner);
            (policy.clone(), self.epoch.load(std::sync::atomic::Ordering::SeqCst))
        };
        let view = self.view();
        let score = |name: &str, entry: &NodeEntry| {
            let state = entry.state.as_ref().ok()?;
            let mut model = NodeModel::new(state, view.host(name, entry.allocatable))?;
            for other in &view.assumed(name, state, &self.settings.domain) {
                model.assume(other, &policy);
            }
            model.score(&demand, &policy)
        };
        let mut memo_map = self.scores.lock().unwrap_or_else(PoisonError::into_inner);
        let cache = demand_memo(&mut memo_map, &demand);
        let raw: Vec<Option<i64>> = if args.nodes.is_some() {
            // Nodes sent in full may differ from the cache's: scored afresh.
            sent.iter().map(|(name, entry, _)| score(name, entry)).collect()
        } else {
            names
                .iter()
                .map(|name| {
                    let entry = view.node(name)?;
                    remembered(cache, name, (view.stamp(name), epoch), || score(name, entry))
                })
                .collect()
        };
        drop(memo_map);
        let scores = extender_scores(&raw);
        Ok(names
            .into_iter()
            .zip(scores)
            .map(|(host, score)| HostPriority { host: host.to_owned(), score })
            .collect())
    }
}

/// The memo of `demand` (a fresh memo when too many demands are remembered).
fn demand_memo<'a, K, V>(
    memo: &'a mut Memo<K, V>,
    demand: &Demand,
) -> &'a mut std::collections::HashMap<String, (K, V)> {
    if !memo.contains_key(demand) {
        if memo.len() >= MEMO_DEMANDS {
            memo.clear();
        }
        memo.insert(demand.clone(), std::collections::HashMap::new());
    }
    memo.get_mut(demand).expect("just inserted")
}

/// `node`'s remembered value if it holds for `stamp`, else `compute`'s, remembered.
fn remembered<K: PartialEq + Copy, V: Clone>(
    memo: &mut std::collections::HashMap<String, (K, V)>,
    node: &str,
    stamp: K,
    compute: impl FnOnce() -> V,
) -> V {
    if let Some((k, v)) = memo.get(node)
        && *k == stamp
    {
        return v.clone();
    }
    let v = compute();
    memo.insert(node.to_owned(), (stamp, v.clone()));
    v
}

fn pod_name(args: &ExtenderArgs) -> String {
    format!("{}/{}", args.pod.metadata.namespace, args.pod.metadata.name)
}

/// The counter's options are constants that are valid: `IntCounter::new` cannot fail on them.
fn unreachable_counter() -> prometheus::IntCounter {
    prometheus::IntCounter::with_opts(prometheus::Opts::new("baleen_extender_unnamed", "-"))
        .unwrap_or_else(|_| unreachable!("a valid constant name"))
}
