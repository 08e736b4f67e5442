//! The extender's two verbs over the cluster view: `filter` (which candidate nodes can take the
//! pod, and why not) and `prioritize` (how well, by the `scheduler_core` policy), and the
//! policy's target workload, learned online from the pods seen and rebuilt off the request path.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex, PoisonError, RwLock};

use baleen_scheduler_core::gpu_state::NodeGpuState;
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
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            domain: baleen_scheduler_core::gpu_state::DEFAULT_DOMAIN.into(),
            policy: PolicyKind::Baleen,
            target_window: 5000,
            rebuild_every: 100,
        }
    }
}

impl Settings {
    /// The annotation the agents write, `<domain>/gpu-state`.
    pub fn annotation(&self) -> String {
        format!("{}/{}", self.domain, baleen_scheduler_core::gpu_state::ANNOTATION_NAME)
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

/// One node's cached scores: the (node stamp, policy epoch) they hold for, and the score of
/// each demand asked.
type NodeScores = ((u64, u64), std::collections::HashMap<Demand, Option<i64>>);

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
    /// Per node: the (node stamp, policy epoch) its scores are valid for, and the scores by
    /// demand. Only one node changes per placement, so most scores of the next call are here.
    scores: Mutex<std::collections::HashMap<String, NodeScores>>,
    seen: Mutex<Seen>,
    rebuild: tokio::sync::Notify,
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
            scores: Mutex::new(std::collections::HashMap::new()),
            seen: Mutex::new(Seen::default()),
            rebuild: tokio::sync::Notify::new(),
        })
    }

    /// The settings.
    pub fn settings(&self) -> &Settings {
        &self.settings
    }

    fn view(&self) -> std::sync::RwLockReadGuard<'_, ClusterView> {
        self.cluster.read().unwrap_or_else(PoisonError::into_inner)
    }

    /// The candidate nodes of a call: the Nodes sent (their annotations as sent), or the
    /// cache's entries of the names sent. A name the cache does not know has no entry.
    fn candidates(&self, args: &ExtenderArgs) -> Vec<(String, Option<NodeEntry>, Option<usize>)> {
        let key = self.settings.annotation();
        if let Some(list) = &args.nodes {
            return list
                .items
                .iter()
                .enumerate()
                .map(|(i, raw)| {
                    let node: Node = serde_json::from_value(raw.clone()).unwrap_or_default();
                    let name = node.metadata.name.clone();
                    (name, Some(NodeEntry::of(&node, &key)), Some(i))
                })
                .collect();
        }
        let view = self.view();
        args.node_names
            .iter()
            .flatten()
            .map(|name| (name.clone(), view.node(name).cloned(), None))
            .collect()
    }

    /// Records the pod for the target workload; wakes the rebuilder every `rebuild_every`.
    fn see(&self, pod_uid: &str, demand: &Demand) {
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
        let policy =
            Policy::for_requests(self.settings.policy, &requests, 0.95, Normalisers::default());
        *self.policy.write().unwrap_or_else(PoisonError::into_inner) = Arc::new(policy);
        self.epoch.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
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
        let demand = match Demand::of(&args.pod, &self.settings.domain) {
            Ok(d) => d,
            Err(e) => {
                result.error = format!("pod {}: {e}", pod_name(args));
                return (result, kinds);
            }
        };
        self.see(&args.pod.metadata.uid, &demand);
        let candidates = self.candidates(args);
        let mut passed = Vec::new();
        {
            let view = self.view();
            for (name, entry, index) in &candidates {
                if demand.is_empty() {
                    // Not ours to judge: every node passes.
                    passed.push((name.clone(), *index));
                    continue;
                }
                let outcome = match entry.as_ref().map(|e| &e.state) {
                    None => Err((FailKind::NoState, "unknown to the extender's node cache".into())),
                    Some(Err(why)) => Err((FailKind::NoState, why.clone())),
                    Some(Ok(state)) => {
                        let assumed = view.assumed(name, state);
                        match verdict(state, &assumed, &demand, &self.settings.domain) {
                            Verdict::Fits => Ok(()),
                            Verdict::Full(why) => Err((FailKind::Full, why)),
                            Verdict::Never(why) => Err((FailKind::Never, why)),
                        }
                    }
                };
                match outcome {
                    Ok(()) => passed.push((name.clone(), *index)),
                    Err((FailKind::Full, why)) => {
                        kinds.push(FailKind::Full);
                        result.failed_nodes.insert(name.clone(), why);
                    }
                    Err((kind, why)) => {
                        kinds.push(kind);
                        result.failed_and_unresolvable_nodes.insert(name.clone(), why);
                    }
                }
            }
        }
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
        let demand = Demand::of(&args.pod, &self.settings.domain)
            .map_err(|e| format!("pod {}: {e}", pod_name(args)))?;
        let candidates = self.candidates(args);
        if demand.is_empty() {
            // Unscored: every node the same.
            return Ok(candidates
                .into_iter()
                .map(|(host, _, _)| HostPriority { host, score: 0 })
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
            for other in view.assumed(name, state) {
                model.assume(other, &policy);
            }
            model.score(&demand, &policy)
        };
        let mut cache = self.scores.lock().unwrap_or_else(PoisonError::into_inner);
        let raw: Vec<Option<i64>> = candidates
            .iter()
            .map(|(name, entry, sent)| {
                let entry = entry.as_ref()?;
                if sent.is_some() {
                    // A Node sent in full may differ from the cache's: scored afresh.
                    return score(name, entry);
                }
                let stamp = (view.stamp(name), epoch);
                let slot = cache.entry(name.clone()).or_default();
                if slot.0 != stamp {
                    *slot = (stamp, std::collections::HashMap::new());
                }
                *slot.1.entry(demand.clone()).or_insert_with(|| score(name, entry))
            })
            .collect();
        let scores = extender_scores(&raw);
        Ok(candidates
            .into_iter()
            .zip(scores)
            .map(|((host, _, _), score)| HostPriority { host, score })
            .collect())
    }
}

fn pod_name(args: &ExtenderArgs) -> String {
    format!("{}/{}", args.pod.metadata.namespace, args.pod.metadata.name)
}
