//! The extender's two verbs over the cluster view: `filter` (which candidate nodes can take the
//! pod, and why not) and `prioritize` (how well, by the `scheduler_core` policy), and the
//! policy's target workload, learned online from the pods seen and rebuilt off the request path.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex, PoisonError, RwLock};

use baleen_k8s::gpu_state::NodeGpuState;
use baleen_scheduler_core::model::Request;
use baleen_scheduler_core::policy::{Normalisers, Policy, PolicyKind};

use crate::cluster::{ClusterView, NodeEntry, PodEntry};
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
    /// Score pods that ask for no baleen resource too (CPU-only pods on GPU nodes), by the
    /// policy, as the replay places every task; off: every node scores 0 for them. Only pods
    /// kube-scheduler sends are scored: with `managedResources` set, it sends none of them.
    pub score_cpu_only: bool,
    /// The most nodes a filter answer passes (0: every node that fits): of more, those of the
    /// best scores, in the call's order. kube-scheduler scores and prioritizes only these (at
    /// 5,000 nodes it sends 500: scoring and decoding them was most of what the extender cost
    /// it, docs/benchmarks.md).
    pub filter_keep_best: usize,
    /// DRA claims counted as the pods' asks (`--dra-device-class`, `--dra-memory-unit`): none
    /// by default.
    pub claims: crate::claims::ClaimSettings,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            domain: baleen_k8s::gpu_state::DEFAULT_DOMAIN.into(),
            policy: PolicyKind::Baleen,
            target_window: 5000,
            rebuild_every: 100,
            scheduler_name: None,
            score_cpu_only: false,
            filter_keep_best: 0,
            claims: crate::claims::ClaimSettings::default(),
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

/// Nodes whose models a rebuild builds per hold of the view's read lock (scored after it is
/// released): a writer waits at most one hold, and the calls behind it as long.
const WARM_SLOTS_PER_HOLD: usize = 32;

/// How many times a rebuild scores again the nodes that changed while it scored.
const WARM_CATCH_UPS: usize = 2;

/// Nodes a rebuild's survey of the cluster reads per hold of the view's read lock.
const SURVEY_SLOTS_PER_HOLD: usize = 256;

/// What a rebuild reads of the whole cluster ([`Extender::survey`]).
#[derive(Debug, Default)]
struct Survey {
    /// Allocatable CPU of the nodes with a usable document, millicores.
    cpu: u64,
    /// Their GPUs.
    gpus: usize,
    /// How many nodes have each largest GPU size (units), and one document of each.
    by_units: BTreeMap<u32, usize>,
    sample: BTreeMap<u32, NodeGpuState>,
}

/// How many of the most common recent demands are scored on every node after a rebuild.
const WARM_DEMANDS: usize = 16;

/// Per demand and node, the filter's verdict and the node stamp it holds for.
type Verdicts = Memo<u64, Verdict>;

/// Per demand and node, the policy's score and the (node stamp, policy epoch) it holds for.
type Scores = Memo<(u64, u64), Option<i64>>;

/// Per demand, per node slot ([`crate::cluster::Found::slot`]): a value and what it holds for.
type Memo<K, V> = std::collections::HashMap<Demand, Vec<Option<(K, V)>>>;

/// Why a node the view does not know fails the filter.
const UNKNOWN_NODE: &str = "unknown to the extender's node cache";

/// How many nodes a filter removed, by why (for the metrics).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Removed {
    /// [`FailKind::Full`].
    pub full: u64,
    /// [`FailKind::Never`].
    pub never: u64,
    /// [`FailKind::NoState`].
    pub no_state: u64,
}

impl Removed {
    fn count(&mut self, verdict: &Verdict) {
        match verdict {
            Verdict::Fits => {}
            Verdict::Full(_) => self.add(FailKind::Full),
            Verdict::Never(_) => self.add(FailKind::Never),
            Verdict::NoState(_) => self.add(FailKind::NoState),
        }
    }

    fn add(&mut self, kind: FailKind) {
        match kind {
            FailKind::Full => self.full += 1,
            FailKind::Never => self.never += 1,
            FailKind::NoState => self.no_state += 1,
        }
    }

    /// Each kind with its count.
    pub fn by_kind(&self) -> [(FailKind, u64); 3] {
        [
            (FailKind::Full, self.full),
            (FailKind::Never, self.never),
            (FailKind::NoState, self.no_state),
        ]
    }
}

/// Appends `text` as a JSON string: as it is between quotes when it needs no escape (every
/// DNS name), through serde_json otherwise. The same bytes serde_json writes (it escapes only
/// `"`, `\\` and control characters).
fn push_json_str(out: &mut Vec<u8>, text: &str) {
    if crate::protocol::json_plain(text) {
        out.push(b'"');
        out.extend_from_slice(text.as_bytes());
        out.push(b'"');
    } else {
        // Writing to a Vec cannot fail.
        let _ = serde_json::to_writer(&mut *out, text);
    }
}

/// One node name of a call as the filter judged it.
struct Judged<'n, 'v> {
    name: &'n str,
    verdict: &'v Verdict,
    /// Where the view knows the node: its slot and its name's JSON text
    /// ([`ClusterView::quoted`]).
    known: Option<(usize, &'v str)>,
}

impl Judged<'_, '_> {
    /// Appends the name as a JSON string.
    fn push_name(&self, out: &mut Vec<u8>) {
        match self.known {
            Some((_, quoted)) => out.extend_from_slice(quoted.as_bytes()),
            None => push_json_str(out, self.name),
        }
    }
}

/// The answer of `filter` for node names, written from borrowed names and verdicts: the JSON
/// of [`ExtenderFilterResult`] with `NodeNames`, 5,000 nodes answered without copying a name or
/// a reason into a value first (held to the typed answer by a test in `tests/http.rs`).
/// Also returns where its `NodeNames` array lies in it.
fn names_answer(judged: &[Judged<'_, '_>]) -> (Vec<u8>, std::ops::Range<usize>) {
    let mut out = Vec::with_capacity(judged.iter().map(|j| j.name.len() + 3).sum::<usize>() + 96);
    out.extend_from_slice(b"{\"Nodes\":null,\"NodeNames\":");
    let start = out.len();
    out.push(b'[');
    let mut first = true;
    for j in judged.iter().filter(|j| matches!(j.verdict, Verdict::Fits)) {
        if !std::mem::take(&mut first) {
            out.push(b',');
        }
        j.push_name(&mut out);
    }
    out.push(b']');
    let names = start..out.len();
    push_failed(&mut out, judged.iter().enumerate().map(|(i, j)| (i, j.verdict)), |out, i| {
        judged[i].push_name(out);
    });
    (out, names)
}

/// Appends the end of a filter answer: the names that did not pass (`failed`, each name's
/// index and verdict; those that fit are skipped), by kind, with why, each name written by
/// `push_name`, and the empty error.
fn push_failed<'v>(
    out: &mut Vec<u8>,
    failed: impl Iterator<Item = (usize, &'v Verdict)> + Clone,
    push_name: impl Fn(&mut Vec<u8>, usize),
) {
    for (key, resolvable) in [("FailedNodes", true), ("FailedAndUnresolvableNodes", false)] {
        out.extend_from_slice(b",\"");
        out.extend_from_slice(key.as_bytes());
        out.extend_from_slice(b"\":{");
        let mut first = true;
        for (i, verdict) in failed.clone() {
            let why = match verdict {
                Verdict::Full(why) if resolvable => why,
                Verdict::Never(why) | Verdict::NoState(why) if !resolvable => why,
                _ => continue,
            };
            if !std::mem::take(&mut first) {
                out.push(b',');
            }
            push_name(out, i);
            out.push(b':');
            push_json_str(out, why);
        }
        out.push(b'}');
    }
    out.extend_from_slice(b",\"Error\":\"\"}");
}

/// The answer of `prioritize` (a `HostPriorityList`): per host, its name and, where the view
/// knows it, its entry's start ([`crate::cluster::Found::item`]), and its score.
fn scores_answer<'a>(
    hosts: impl ExactSizeIterator<Item = (&'a str, Option<&'a str>)>,
    scores: &[i64],
) -> Vec<u8> {
    scores_answer_at(hosts, scores, None)
}

/// [`scores_answer`], noting in `at` where each entry's score starts.
fn scores_answer_at<'a>(
    hosts: impl ExactSizeIterator<Item = (&'a str, Option<&'a str>)>,
    scores: &[i64],
    mut at: Option<&mut Vec<usize>>,
) -> Vec<u8> {
    use crate::protocol::{HOST_ITEM_SCORE, HOST_ITEM_START};
    // About 32 bytes an entry for names of a dozen characters; grown where longer.
    let mut out = Vec::with_capacity(hosts.len() * 40 + 2);
    out.push(b'[');
    let mut number = itoa::Buffer::new();
    for (i, ((host, item), &score)) in hosts.zip(scores).enumerate() {
        if i > 0 {
            out.push(b',');
        }
        match item {
            Some(item) => out.extend_from_slice(item.as_bytes()),
            None => {
                out.extend_from_slice(HOST_ITEM_START.as_bytes());
                push_json_str(&mut out, host);
                out.extend_from_slice(HOST_ITEM_SCORE.as_bytes());
            }
        }
        if let Some(at) = at.as_mut() {
            at.push(out.len());
        }
        push_score(&mut out, &mut number, score);
        out.push(b'}');
    }
    out.push(b']');
    out
}

/// Appends `score` as JSON.
fn push_score(out: &mut Vec<u8>, number: &mut itoa::Buffer, score: i64) {
    match u8::try_from(score) {
        // 0 to 9, most scores: one digit.
        Ok(digit @ 0..=9) => out.push(b'0' + digit),
        _ => out.extend_from_slice(number.format(score).as_bytes()),
    }
}

/// How many bytes `score` takes in JSON.
fn score_width(score: i64) -> usize {
    itoa::Buffer::new().format(score).len()
}

/// The most answers made ahead that are kept (one per call served at once).
const AHEADS: usize = crate::http::MAX_CONCURRENT_CALLS;

/// The answer of `filter`, with what it removed and the call's error (empty when none), and the
/// `prioritize` answer it prepared the making of ([`Extender::prepare_ahead`]).
#[derive(Debug)]
pub struct FilterAnswer {
    /// The JSON answer.
    pub body: bytes::Bytes,
    /// How many nodes it removed, by why.
    pub removed: Removed,
    /// The call's error (empty when none).
    pub error: String,
    /// The `prioritize` answer for the nodes it passed, to be made while this answer travels.
    pub ahead: Option<Arc<Ahead>>,
    /// The other answers kept for the call's names, to be judged again while this answer
    /// travels ([`Extender::judge_ahead`]).
    pub judge: Option<JudgeAhead>,
    /// How the call's names were judged.
    pub how: FilterHow,
    /// Nodes that fit but were left out, not among the best ([`Settings::filter_keep_best`]).
    pub cut: usize,
}

/// The answers kept for one call's names for the demands last asked over them, but one (the
/// call's own, just judged): judged again beside the calls ([`Extender::judge_ahead`]), so that
/// the next call for one of those demands finds its answer holding for all but the nodes
/// changed since.
#[derive(Debug)]
pub struct JudgeAhead {
    names: Arc<Resolved>,
    except: Demand,
}

/// How a filter call's node names were judged ([`Extender::filter_call`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FilterHow {
    /// Read (split, or parsed by serde_json) and looked up.
    Read,
    /// Byte for byte a recent call's names, judged from the slots found for them then.
    Reused,
    /// A recent call's names and demand, none of whose nodes changed its verdict since: that
    /// call's answer again, only the nodes changed since judged anew.
    Again,
    /// A recent call's names and demand, some of whose nodes changed their verdict since: that
    /// call's answer with those verdicts patched in, only the nodes changed since judged anew.
    Patched,
}

impl FilterHow {
    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            FilterHow::Read => "read",
            FilterHow::Reused => "reused",
            FilterHow::Again => "again",
            FilterHow::Patched => "patched",
        }
    }
}

impl FilterAnswer {
    /// A typed answer written out (nothing prepared ahead).
    fn whole(result: ExtenderFilterResult, removed: Removed) -> Self {
        FilterAnswer {
            body: serde_json::to_vec(&result).unwrap_or_default().into(),
            removed,
            error: result.error,
            ahead: None,
            judge: None,
            how: FilterHow::Read,
            cut: 0,
        }
    }
}

/// A `prioritize` answer, and how it was made.
#[derive(Debug)]
pub enum Prioritized {
    /// From the scores made ahead by the filter before.
    Ahead(bytes::Bytes),
    /// Computed for this call.
    Computed(Vec<u8>),
}

/// Why a call was not answered.
#[derive(Debug)]
pub enum CallError {
    /// The body is not the protocol's JSON.
    Body(serde_json::Error),
    /// The call is refused: why.
    Refused(String),
}

/// A `prioritize` answer made ahead: kube-scheduler calls `prioritize` right after `filter`,
/// for the same pod, with the node names `filter` answered, in the same order, written the same
/// way (Go's encoder, like ours, writes a DNS name between quotes as it is). So the scores of the
/// nodes a filter passed are made while its answer travels and kube-scheduler reads it, and a
/// `prioritize` whose `NodeNames` are those bytes and whose pod asks the same is answered with
/// them, without parsing and looking up the names again: if nothing the scores depend on
/// changed in between (the view's [`ClusterView::changes`] and the policy's epoch); else it is
/// answered as any other call.
#[derive(Debug)]
pub struct Ahead {
    demand: Demand,
    /// The filter answer's `NodeNames` array, as written (shared with the answer, not copied).
    names: bytes::Bytes,
    /// The slots of the nodes it passed, in its order.
    slots: Arc<[usize]>,
    made: std::sync::OnceLock<Made>,
}

/// An answer made ahead, and what it holds for.
#[derive(Debug)]
struct Made {
    body: bytes::Bytes,
    /// [`ClusterView::changes`] and the policy epoch when it was made.
    changes: u64,
    epoch: u64,
}

/// An answer made ahead for the nodes a filter passed (their slots, shared with the filter's
/// kept answer, [`Judgement::passed`]) and a demand, kept with what it was made from: the next
/// answer for the same nodes and demand under the same policy is this one with the scores of
/// the nodes changed since patched in, where those changes leave the least and the greatest
/// raw score as they were (then no other node's score moves); else it is made afresh.
#[derive(Debug)]
struct MadeKept {
    demand: Demand,
    slots: Arc<[usize]>,
    epoch: u64,
    /// [`ClusterView::changes`] when it was last known to hold.
    changes: std::sync::atomic::AtomicU64,
    /// Each node's raw score (in `slots`' order).
    raw: Vec<Option<i64>>,
    /// Their scale; `None` where no node had a score.
    scale: Option<crate::place::Scale>,
    /// How many nodes have the least and the greatest raw score.
    at_min: usize,
    at_max: usize,
    body: bytes::Bytes,
    /// Where each node's score starts in `body`.
    score_at: Vec<usize>,
    /// Where each slot is in `slots`; shared by the patched answers of the same nodes.
    places: Arc<SlotPlaces>,
}

impl MadeKept {
    /// The places in `slots` of slot `slot`.
    fn places_of(&self, slot: usize) -> impl Iterator<Item = usize> + '_ {
        self.places.of(slot, || self.slots.iter().copied().map(Some))
    }
}

/// Where each slot lies in a list of slots: each (slot, index) sorted, made when first asked
/// (a list never asked costs no sort), so that the indices of a node that changed are found
/// by a binary search.
#[derive(Debug, Default)]
struct SlotPlaces(std::sync::OnceLock<Vec<(usize, usize)>>);

impl SlotPlaces {
    /// The indices of `slot` in the list `slots` gives (`None`: no slot there); `slots` is
    /// read only the first time.
    fn of<I: Iterator<Item = Option<usize>>>(
        &self,
        slot: usize,
        slots: impl FnOnce() -> I,
    ) -> impl Iterator<Item = usize> + '_ {
        let places = self.0.get_or_init(|| {
            let mut places: Vec<(usize, usize)> =
                slots().enumerate().filter_map(|(i, s)| s.map(|s| (s, i))).collect();
            places.sort_unstable();
            places
        });
        let from = places.partition_point(|&(s, _)| s < slot);
        places[from..].iter().take_while(move |&&(s, _)| s == slot).map(|&(_, i)| i)
    }
}

/// How a `prioritize` answer made ahead was made (the metric's label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MadeHow {
    /// The answer made last for the same passed nodes and demand, none of them changed since.
    Kept,
    /// That answer with the scores of the nodes changed since patched in.
    Patched,
    /// Every node's score looked up in the memo or computed.
    Afresh,
}

impl MadeHow {
    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            MadeHow::Kept => "kept",
            MadeHow::Patched => "patched",
            MadeHow::Afresh => "afresh",
        }
    }
}

/// The most answers made ahead kept to be patched ([`MadeKept`]): about 370 KiB each at 5,000
/// nodes.
const MADE_KEPT: usize = 8;

/// The most filter calls' names kept resolved ([`Resolved`]).
const RESOLVED: usize = AHEADS;

/// A filter call's `NodeNames` as the view resolved them, kept so that a later call sending
/// the same array (compared as bytes) skips splitting and hashing 5,000 names. A name's slot
/// is its for the view's life; a name the view did not know then is looked up again.
#[derive(Debug)]
struct Resolved {
    /// The `NodeNames` array as it was sent (JSON text, `[` to `]`).
    text: Box<str>,
    /// Each name's place in `text`.
    spans: Vec<std::ops::Range<usize>>,
    /// Each name's slot (`None`: unknown then).
    slots: Vec<Option<usize>>,
    /// Whether every name had a slot: only then are answers kept ([`Judgement`]).
    all_known: bool,
    /// Each (slot, index of a name with it), sorted, to find the names of a node that changed;
    /// made when first asked (names never sent again cost no sort).
    places: SlotPlaces,
    /// Whether consecutive names are separated by exactly `","` (as kube-scheduler's encoder
    /// writes them): runs of passing names are then copied from the text in one piece.
    compact: bool,
    /// The latest answer for these names, per demand (at most [`JUDGEMENTS`]).
    judgements: Mutex<HashMap<Demand, Arc<Judgement>>>,
    /// The demands last asked over these names, newest last (at most [`JUDGED_AHEAD`]).
    asked: Mutex<VecDeque<Demand>>,
}

impl Resolved {
    fn new(text: &str, names: &[&str], slots: Vec<Option<usize>>) -> Self {
        let base = text.as_ptr() as usize;
        let spans: Vec<std::ops::Range<usize>> = names
            .iter()
            .map(|n| {
                let start = n.as_ptr() as usize - base;
                start..start + n.len()
            })
            .collect();
        let all_known = slots.iter().all(Option::is_some);
        let compact =
            spans.windows(2).all(|w| text.as_bytes().get(w[0].end..w[1].start) == Some(b"\",\""));
        Resolved {
            text: text.into(),
            spans,
            slots,
            all_known,
            places: SlotPlaces::default(),
            compact,
            judgements: Mutex::default(),
            asked: Mutex::default(),
        }
    }

    /// Notes `demand` as the latest asked over these names.
    fn asked(&self, demand: &Demand) {
        let mut asked = self.asked.lock().unwrap_or_else(PoisonError::into_inner);
        if asked.back() != Some(demand) {
            asked.retain(|d| d != demand);
            if asked.len() >= JUDGED_AHEAD {
                asked.pop_front();
            }
            asked.push_back(demand.clone());
        }
    }

    /// Name `i` with its quotes, as the call wrote it: every name kept is plain JSON (the
    /// scanner splits no other), so these are serde_json's bytes for it.
    fn quoted(&self, i: usize) -> &[u8] {
        &self.text.as_bytes()[self.spans[i].start - 1..self.spans[i].end + 1]
    }

    /// Names `from` to `to` (exclusive, at least one) as a comma-separated run of JSON strings,
    /// copied from the call's text at once ([`Self::compact`] arrays only).
    fn run(&self, from: usize, to: usize) -> &[u8] {
        &self.text.as_bytes()[self.spans[from].start - 1..self.spans[to - 1].end + 1]
    }

    /// Appends the end of a filter answer whose failed names are `failed` ([`push_failed`]).
    fn push_failed(&self, out: &mut Vec<u8>, failed: &[(usize, Verdict)]) {
        push_failed(out, failed.iter().map(|(i, v)| (*i, v)), |out, i| {
            out.extend_from_slice(self.quoted(i));
        });
    }

    /// Keeps `judgement` as the latest for `demand` (where every name had a slot), and gives
    /// it back shared.
    fn keep(&self, demand: &Demand, judgement: Judgement) -> Arc<Judgement> {
        let judgement = Arc::new(judgement);
        if self.all_known {
            let mut kept = self.judgements.lock().unwrap_or_else(PoisonError::into_inner);
            if !kept.contains_key(demand) && kept.len() >= JUDGEMENTS {
                kept.clear();
            }
            kept.insert(demand.clone(), judgement.clone());
        }
        judgement
    }

    /// The indices of the names with slot `slot`.
    fn places_of(&self, slot: usize) -> impl Iterator<Item = usize> + '_ {
        self.places.of(slot, || self.slots.iter().copied())
    }
}

/// The most demands whose latest answer is kept per names ([`Resolved::judgements`]): 16
/// answers of 5,000 names are about 1.7 MiB.
const JUDGEMENTS: usize = 16;

/// The most demands whose answers over one call's names are judged ahead
/// ([`Extender::judge_ahead`]): the latest asked over them.
const JUDGED_AHEAD: usize = 8;

/// A filter answer for one call's names and one demand, and the view it holds for: while no
/// node among the names changed its verdict since (the view's change log, [`ClusterView::changed_since`]),
/// it is the answer again, byte for byte; only the nodes changed are judged anew.
#[derive(Debug)]
struct Judgement {
    /// [`ClusterView::changes`] when it was last known to hold.
    changes: std::sync::atomic::AtomicU64,
    body: bytes::Bytes,
    /// Where its `NodeNames` array lies in `body`.
    names: std::ops::Range<usize>,
    removed: Removed,
    /// The slots of the nodes that passed, in order.
    passed: Arc<[usize]>,
    /// The names that did not pass, by index (ascending), and their verdicts.
    failed: Vec<(usize, Verdict)>,
}

/// The most demands remembered; past it the memo starts afresh.
const MEMO_DEMANDS: usize = 64;

/// The pods seen, for the target workload.
#[derive(Debug, Default)]
struct Seen {
    /// Shared with a rebuild, which copies the list under the lock (5,000 demands cloned one by
    /// one were a millisecond of it).
    recent: VecDeque<Arc<Demand>>,
    uids: std::collections::HashSet<String>,
    /// The GPU asks (per container) of the pods learned: a pod asking for GPUs in a way none
    /// learned before asks for a rebuild at once (at most [`ASK_SHAPES`], then forgotten).
    ask_shapes: std::collections::HashSet<Vec<crate::demand::Ask>>,
    since_rebuild: usize,
    /// Pods learned so far.
    learned: u64,
    /// Rebuilds asked so far, and how many of those the last finished rebuild covered.
    asked: u64,
    built: u64,
}

/// The most GPU ask shapes [`Seen`] remembers (a trace has dozens).
const ASK_SHAPES: usize = 1024;

/// The extender.
pub struct Extender {
    settings: Settings,
    /// The DRA claims the pods hold (filled by [`crate::claims::watch`] where
    /// `settings.claims` names classes).
    pub claims: Arc<crate::claims::ClaimIndex>,
    /// Nodes and pods (the watchers write, the verbs read).
    pub cluster: crate::cluster::SharedView,
    policy: RwLock<Arc<Policy>>,
    /// Rebuilds of the policy so far (what a cached score is valid for).
    epoch: std::sync::atomic::AtomicU64,
    /// Per node: the filter's verdicts and the scores by demand, valid while the node, the
    /// pods bound to it and the policy stay the same. Only one node changes per placement, so
    /// most of the next call's work is here.
    verdicts: Mutex<Verdicts>,
    scores: Mutex<Scores>,
    /// The latest `prioritize` answers made ahead by `filter`, newest last.
    aheads: Mutex<VecDeque<Arc<Ahead>>>,
    /// The latest answers made ahead, kept to be patched, newest last.
    made_kept: Mutex<VecDeque<Arc<MadeKept>>>,
    /// The names of the latest filter calls, resolved, newest last.
    resolved: Mutex<VecDeque<Arc<Resolved>>>,
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
    /// `prioritize` answers made ahead, by how ([`MadeHow`]).
    pub scores_made: prometheus::IntCounterVec,
    /// Node scores computed for a call (found neither in the memo nor made by a rebuild).
    pub scores_computed: prometheus::IntCounter,
    /// The API client the `bind` verb binds with (none: the verb answers that it cannot).
    binder: std::sync::OnceLock<kube::Client>,
}

/// Why `bind` did not bind a pod.
#[derive(Debug, thiserror::Error)]
pub enum BindError {
    /// This extender has no API client to bind with.
    #[error("this extender does not bind (no Kubernetes API client)")]
    NoClient,
    /// The caches are not listed yet.
    #[error("{NOT_SYNCED}")]
    NotSynced,
    /// The node cannot take the pod now: another binding took the room first.
    #[error("node {node} no longer has room for pod {pod}: {why}; kube-scheduler retries the pod")]
    NoRoom {
        /// The node.
        node: String,
        /// `namespace/name`.
        pod: String,
        /// Why.
        why: String,
    },
    /// The pod is not the one asked for, or already bound elsewhere.
    #[error("pod {pod}: {why}")]
    Pod {
        /// `namespace/name`.
        pod: String,
        /// Why.
        why: String,
    },
    /// The API server refused or could not be reached.
    #[error("pod {pod}: {source}")]
    Api {
        /// `namespace/name`.
        pod: String,
        /// The cause.
        #[source]
        source: kube::Error,
    },
    /// The bind's task ended without an answer (it panicked).
    #[error("the bind did not finish: {0}")]
    Task(String),
}

impl BindError {
    /// The metric label: `no_room`, `refused` or `failed`.
    pub fn kind(&self) -> &'static str {
        match self {
            BindError::NoRoom { .. } => "no_room",
            BindError::Pod { .. } | BindError::NoClient | BindError::NotSynced => "refused",
            BindError::Api { .. } | BindError::Task(_) => "failed",
        }
    }
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
            claims: Arc::new(crate::claims::ClaimIndex::new(settings.claims.clone())),
            settings,
            cluster: crate::cluster::SharedView::default(),
            policy: RwLock::new(Arc::new(policy)),
            epoch: std::sync::atomic::AtomicU64::new(0),
            verdicts: Mutex::new(Verdicts::new()),
            scores: Mutex::new(Scores::new()),
            aheads: Mutex::new(VecDeque::new()),
            made_kept: Mutex::new(VecDeque::new()),
            resolved: Mutex::new(VecDeque::new()),
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
            scores_made: prometheus::IntCounterVec::new(
                prometheus::Opts::new(
                    "baleen_extender_scores_made_total",
                    "prioritize answers made ahead, by how: kept (the answer made last for the same passed nodes and demand, none of those nodes changed since), patched (that answer with the scores of the nodes changed since patched in: the changes left the least and greatest raw score as they were), afresh (every node's score looked up in the memo or computed).",
                ),
                &["how"],
            )
            .unwrap_or_else(|_| unreachable!("a valid constant name and label")),
            scores_computed: prometheus::IntCounter::new(
                "baleen_extender_scores_computed_total",
                "Node scores computed for a call: found neither in the memo nor made ahead by a policy rebuild (which scores every node for the 16 most common recent demands).",
            )
            .unwrap_or_else(|_| unreachable_counter()),
            binder: std::sync::OnceLock::new(),
        })
    }

    /// From now on `bind` binds with `client`.
    pub fn bind_with(&self, client: kube::Client) {
        let _ = self.binder.set(client);
    }

    /// The `bind` verb: checks that `args.node` still has room for the pod with every pod
    /// already bound or reserved there, counts the pod there at once (so that the next filter,
    /// which may come before the Pod watch shows this binding, sees it), then creates the
    /// Binding; a failed Binding is undone. Two pods bound one after the other can never both
    /// take the last room of a GPU, however late the watch.
    pub async fn bind(&self, args: &crate::protocol::ExtenderBindingArgs) -> Result<(), BindError> {
        use kube::api::{Api, PostParams};
        let client = self.binder.get().ok_or(BindError::NoClient)?.clone();
        if !self.synced() {
            return Err(BindError::NotSynced);
        }
        let key = format!("{}/{}", args.pod_namespace, args.pod_name);
        let api: Api<k8s_openapi::api::core::v1::Pod> =
            Api::namespaced(client, &args.pod_namespace);
        let known = self.view().pod(&args.pod_uid).cloned();
        let entry = match known {
            // The pod the UID names must be the pod the name names: the room is checked for
            // the one and the Binding made for the other otherwise.
            Some(entry) if entry.key != key => {
                return Err(BindError::Pod {
                    pod: key,
                    why: format!("the UID {} is the pod {}'s", args.pod_uid, entry.key),
                });
            }
            Some(entry) => entry,
            // Not seen by the watch yet: the API server's pod (never a call's).
            None => {
                let pod = api
                    .get(&args.pod_name)
                    .await
                    .map_err(|source| BindError::Api { pod: key.clone(), source })?;
                if pod.metadata.uid.as_deref() != Some(args.pod_uid.as_str()) {
                    return Err(BindError::Pod {
                        pod: key,
                        why: format!("its UID is not {}", args.pod_uid),
                    });
                }
                let pod: crate::protocol::Pod = serde_json::to_value(&pod)
                    .and_then(serde_json::from_value)
                    .map_err(|e| BindError::Pod { pod: key.clone(), why: e.to_string() })?;
                PodEntry::of(&pod, &self.settings.domain)
            }
        };
        {
            let mut view = self.cluster.write().unwrap_or_else(PoisonError::into_inner);
            match &entry.node {
                Some(node) if *node == args.node => return Ok(()),
                Some(node) => {
                    return Err(BindError::Pod {
                        pod: key,
                        why: format!("already bound to {node}"),
                    });
                }
                None => {}
            }
            if !entry.demand.is_empty() {
                let no_room = |why: String| BindError::NoRoom {
                    node: args.node.clone(),
                    pod: key.clone(),
                    why,
                };
                let node = view.node(&args.node).ok_or_else(|| no_room(UNKNOWN_NODE.into()))?;
                match self.verdict_on(&view, &args.node, node, &entry.demand) {
                    Verdict::Fits => {}
                    Verdict::Full(why) | Verdict::Never(why) | Verdict::NoState(why) => {
                        return Err(no_room(why));
                    }
                }
            }
            view.reserve(&args.pod_uid, entry.clone(), &args.node);
        }
        let binding = serde_json::json!({
            "apiVersion": "v1",
            "kind": "Binding",
            "metadata": {"name": args.pod_name, "namespace": args.pod_namespace, "uid": args.pod_uid},
            "target": {"apiVersion": "v1", "kind": "Node", "name": args.node}
        });
        let created: Result<serde_json::Value, _> = api
            .create_subresource("binding", &args.pod_name, &PostParams::default(), &binding)
            .await;
        if let Err(source) = created {
            self.cluster
                .write()
                .unwrap_or_else(PoisonError::into_inner)
                .unreserve(&args.pod_uid, entry);
            return Err(BindError::Api { pod: key, source });
        }
        Ok(())
    }

    /// Counts and logs `pod` if it asks for a baleen resource (`asks`), was new to the view
    /// (`known` false), is pending, and names another scheduler than baleen's second scheduler.
    pub fn note_scheduler(&self, known: bool, pod: &crate::protocol::Pod, asks: bool) {
        let Some(ours) = self.settings.scheduler_name.as_deref() else { return };
        if known || !asks || pod.spec.node_name.as_deref().is_some_and(|n| !n.is_empty()) {
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
    fn sent_entries(&self, args: &ExtenderArgs<'_>) -> Vec<(String, NodeEntry, usize)> {
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
    /// Pod watcher, every pod it sees, CPU-only ones too, since they are what makes CPU scarce;
    /// or from the filter's pod where no watcher runs); wakes the rebuilder every
    /// `rebuild_every`, at the first pod, and at a pod asking for GPUs as none before it did.
    pub fn learn(&self, pod_uid: &str, demand: &Demand) {
        let mut seen = self.seen.lock().unwrap_or_else(PoisonError::into_inner);
        if !pod_uid.is_empty() && !seen.uids.insert(pod_uid.to_owned()) {
            return;
        }
        seen.recent.push_back(Arc::new(demand.clone()));
        if seen.recent.len() > self.settings.target_window {
            seen.recent.pop_front();
        }
        seen.since_rebuild += 1;
        seen.learned += 1;
        // The first pod too: until then the target is empty and every node scores the same. And
        // a pod asking for GPUs as none before: a target that lacks its shape scores its
        // placement blind until the next rebuild (on a fresh cluster the first pods learned are
        // the agents' and the schedulers' own, which ask for no GPU: the first hundred GPU pods
        // were placed by kube-scheduler's own scores).
        let new_shape = !demand.asks.is_empty() && !seen.ask_shapes.contains(&demand.asks);
        if new_shape {
            if seen.ask_shapes.len() >= ASK_SHAPES {
                seen.ask_shapes.clear();
            }
            seen.ask_shapes.insert(demand.asks.clone());
        }
        if seen.since_rebuild >= self.settings.rebuild_every || seen.recent.len() == 1 || new_shape
        {
            seen.since_rebuild = 0;
            seen.asked += 1;
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
    ///
    /// On the rebuild thread (`SCHED_IDLE`) it yields the CPU between its steps and between
    /// each few nodes it scores, holding no lock then: the kernel's scheduler (EEVDF) may pick
    /// an idle-class thread that has just woken over a runnable worker and let it run to the
    /// next tick (4 ms at 250 Hz), and did, once per rebuild or so, in `call_latency`.
    pub fn rebuild_policy(&self) {
        let (demands, asked): (Vec<Arc<Demand>>, u64) = {
            let seen = self.seen.lock().unwrap_or_else(PoisonError::into_inner);
            (seen.recent.iter().cloned().collect(), seen.asked)
        };
        let survey = self.survey();
        let requests = Self::requests_of(&survey, &demands);
        let (cpu, gpus) = (survey.cpu, survey.gpus);
        std::thread::yield_now();
        let policy =
            Policy::for_requests(self.settings.policy, &requests, 0.95, Normalisers::default());
        std::thread::yield_now();

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
        // CPU-only pods shape the target, but are never scored.
        for d in demands.iter().map(|d| &**d).filter(|d| !d.is_empty()) {
            *counts.entry(d).or_default() += 1;
        }
        let mut common: Vec<(&Demand, usize)> = counts.into_iter().collect();
        common.sort_by_key(|c| std::cmp::Reverse(c.1));
        common.truncate(WARM_DEMANDS);
        let epoch = self.epoch.load(std::sync::atomic::Ordering::SeqCst) + 1;
        let mut warm = Scores::new();
        // A few dozen nodes' models built per hold of the view's read lock, and scored for the
        // common demands after it is released, the CPU yielded between holds: scoring every
        // node takes tens of milliseconds at 5,000 nodes, and a watcher or `bind` waiting for
        // the write lock would hold up every call behind it (the lock lets no reader past a
        // waiting writer), the longer if this thread (`SCHED_IDLE`) were preempted while
        // holding it. A node that changes after its turn has a new stamp, so its warm score is
        // never used.
        let (mut todo, mut from) = {
            let view = self.cluster.read_after_writers();
            ((0..view.slots()).collect::<Vec<usize>>(), view.changes())
        };
        // Then the nodes that changed meanwhile, again, a few times: a rebuild takes a while
        // beside a busy scheduler, and each node changed since its turn would be scored on a
        // call's path after the swap.
        for _ in 0..=WARM_CATCH_UPS {
            self.warm_scores(&mut warm, &todo, &common, &policy, epoch);
            let view = self.cluster.read_after_writers();
            let Some(changed) = view.changed_since(from) else { break };
            todo = changed.collect::<std::collections::BTreeSet<usize>>().into_iter().collect();
            from = view.changes();
            if todo.is_empty() {
                break;
            }
        }
        // The old scores are all stale now: swapped out whole, dropped outside the lock.
        let old = {
            let mut scores = self.scores.lock().unwrap_or_else(PoisonError::into_inner);
            *self.policy.write().unwrap_or_else(PoisonError::into_inner) = policy;
            self.epoch.store(epoch, std::sync::atomic::Ordering::SeqCst);
            std::mem::replace(&mut *scores, warm)
        };
        drop(old);
        let mut seen = self.seen.lock().unwrap_or_else(PoisonError::into_inner);
        seen.built = seen.built.max(asked);
    }

    /// Scores the nodes of `slots` for the `common` demands with `policy` into `warm`: the
    /// models of [`WARM_SLOTS_PER_HOLD`] nodes built per hold of the view's read lock (each
    /// after the waiting writers), scored after it is released, the CPU yielded between holds:
    /// scoring every node takes tens of milliseconds at 5,000 nodes, and a watcher or `bind`
    /// waiting for the write lock would hold up every call behind it (the lock lets no reader
    /// past a waiting writer), the longer if this thread (`SCHED_IDLE`) were preempted while
    /// holding it. A node that changes after its turn has a new stamp, so its warm score is
    /// never used.
    fn warm_scores(
        &self,
        warm: &mut Scores,
        slots: &[usize],
        common: &[(&Demand, usize)],
        policy: &Policy,
        epoch: u64,
    ) {
        let mut models = Vec::with_capacity(WARM_SLOTS_PER_HOLD);
        for chunk in slots.chunks(WARM_SLOTS_PER_HOLD) {
            std::thread::yield_now();
            let count = {
                let view = self.cluster.read_after_writers();
                for &slot in chunk {
                    let Some((name, found)) = view.at(slot) else { continue };
                    let Some(entry) = found.entry else { continue };
                    let Ok(state) = &entry.state else { continue };
                    let Some(mut model) = NodeModel::new(state, view.host(name, entry.allocatable))
                    else {
                        continue;
                    };
                    for other in &view.assumed(name, state, &self.settings.domain) {
                        model.assume(other, policy);
                    }
                    models.push((slot, found.stamp, model));
                }
                view.slots()
            };
            for (slot, stamp, model) in models.drain(..) {
                for (demand, _) in common {
                    let score = model.score(demand, policy);
                    let per_node = demand_memo(warm, demand, count);
                    per_node[slot] = Some(((stamp, epoch), score));
                }
            }
        }
    }

    /// How many pods the extender has learned from, and whether every policy rebuild they
    /// asked for has finished: for harnesses that replay a trace and must not depend on how
    /// fast the watcher and the rebuilder run (the cluster loop's CI tests).
    pub fn learning(&self) -> (u64, bool) {
        let seen = self.seen.lock().unwrap_or_else(PoisonError::into_inner);
        (seen.learned, seen.built >= seen.asked)
    }

    /// What a rebuild needs of the whole cluster, read in holds of [`SURVEY_SLOTS_PER_HOLD`]
    /// nodes of the view's read lock (each after the waiting writers): its allocatable CPU, its
    /// GPUs, and a document of each GPU size with how many nodes have it.
    fn survey(&self) -> Survey {
        let mut survey = Survey::default();
        let mut next = 0;
        loop {
            std::thread::yield_now();
            let view = self.cluster.read_after_writers();
            let end = (next + SURVEY_SLOTS_PER_HOLD).min(view.slots());
            for slot in next..end {
                let Some((_, found)) = view.at(slot) else { continue };
                let Some(entry) = found.entry else { continue };
                let Ok(state) = &entry.state else { continue };
                survey.cpu = survey.cpu.saturating_add(entry.allocatable.0);
                survey.gpus += state.gpus.len();
                let units = state.gpus.iter().map(|g| g.units_total).max().unwrap_or(0);
                *survey.by_units.entry(units).or_default() += 1;
                survey.sample.entry(units).or_insert_with(|| state.clone());
            }
            next = end;
            if next >= view.slots() {
                return survey;
            }
        }
    }

    /// The demands as placement requests on the cluster's most common GPU (its units).
    /// Each distinct demand is turned into a request once (a few thousand pods ask a handful
    /// of shapes).
    fn requests_of(survey: &Survey, demands: &[Arc<Demand>]) -> Vec<Request> {
        let Some(common) = survey.by_units.iter().max_by_key(|(_, n)| **n).map(|(u, _)| *u) else {
            return Vec::new();
        };
        let Some(model) = NodeModel::new(&survey.sample[&common], Default::default()) else {
            return Vec::new();
        };
        let mut made: HashMap<&Demand, Option<Request>> = HashMap::new();
        demands
            .iter()
            .filter_map(|d| {
                made.entry(&**d)
                    .or_insert_with(|| {
                        if d.is_empty() {
                            // A CPU-only pod: what makes CPU scarce beside the GPU pods.
                            Some(crate::place::cpu_only(d))
                        } else {
                            model.request(d)
                        }
                    })
                    .clone()
            })
            .collect()
    }

    /// Runs the rebuilder until `shutdown`: after every `rebuild_every` new pods, a rebuild on
    /// a thread of its own at the kernel's idle scheduling class (`SCHED_IDLE`). A rebuild
    /// scores every node for the common demands, tens of milliseconds of a core at 5,000 nodes;
    /// at the normal class it took a core from the calls it is meant to speed up (on two
    /// cores, the tail of the calls while it ran). A thread of the normal class that wakes (a
    /// call, a watch event) preempts it at once; the kernel still gives it a small share of a
    /// busy core, so under a flood of calls the policy is rebuilt later, never not at all.
    /// Where the kernel refuses the class, rebuilds run at the normal class, and that is said.
    pub async fn run_rebuilder(self: Arc<Self>, shutdown: tokio_util::sync::CancellationToken) {
        let (jobs, queue) = std::sync::mpsc::channel::<tokio::sync::oneshot::Sender<()>>();
        let me = self.clone();
        let thread = std::thread::Builder::new().name("baleen-rebuild".to_owned()).spawn(move || {
            use thread_priority::{
                NormalThreadSchedulePolicy, ThreadPriority, ThreadSchedulePolicy,
                set_thread_priority_and_policy, thread_native_id,
            };
            if let Err(e) = set_thread_priority_and_policy(
                thread_native_id(),
                ThreadPriority::Min,
                ThreadSchedulePolicy::Normal(NormalThreadSchedulePolicy::Idle),
            ) {
                tracing::warn!(
                    error = ?e,
                    "the kernel refused SCHED_IDLE for the policy rebuild thread: rebuilds run at \
                     the normal class and compete with the calls for the CPU"
                );
            }
            // Ends when the rebuilder does (the channel closes).
            for done in queue {
                me.rebuild_policy();
                let _ = done.send(());
            }
        });
        if let Err(e) = thread {
            tracing::error!(error = %e, "cannot start the policy rebuild thread: rebuilds run on the blocking pool at the normal class");
        }
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = self.rebuild.notified() => {}
            }
            let (done, finished) = tokio::sync::oneshot::channel();
            if jobs.send(done).is_ok() {
                // Err: the thread is gone (it panicked); the next rebuild goes to the pool.
                if finished.await.is_ok() {
                    continue;
                }
            }
            let me = self.clone();
            let _ = tokio::task::spawn_blocking(move || me.rebuild_policy()).await;
        }
    }

    /// What `pod` asks, or the call's error naming it.
    fn demand_of(&self, pod: &crate::protocol::Pod) -> Result<Demand, String> {
        Demand::of_with_claims(pod, &self.settings.domain, &self.claims)
            .map_err(|e| format!("pod {}/{}: {e}", pod.metadata.namespace, pod.metadata.name))
    }

    /// The filter's verdict on node `name` (its `entry`) for `demand`, counting the pods
    /// assumed there.
    fn verdict_on(
        &self,
        view: &ClusterView,
        name: &str,
        entry: &NodeEntry,
        demand: &Demand,
    ) -> Verdict {
        match &entry.state {
            Err(why) => Verdict::NoState(why.clone()),
            Ok(state) => {
                let assumed = view.assumed(name, state, &self.settings.domain);
                let assumed: Vec<&Demand> = assumed.iter().collect();
                verdict(state, &assumed, demand, &self.settings.domain)
            }
        }
    }

    /// A node's verdict for `demand` from its place in the demand's memo (`kept`), judged anew
    /// (its `entry`, named by `name`) where the memo's is older than the node's `stamp`.
    fn memo_verdict<'c, 'n>(
        &self,
        kept: &'c mut Option<(u64, Verdict)>,
        view: &ClusterView,
        entry: &NodeEntry,
        stamp: u64,
        name: impl FnOnce() -> &'n str,
        demand: &Demand,
    ) -> &'c Verdict {
        if kept.as_ref().is_some_and(|(s, _)| *s != stamp) {
            *kept = None;
        }
        &kept.get_or_insert_with(|| (stamp, self.verdict_on(view, name(), entry, demand))).1
    }

    /// The policy's raw score of node `name` (its `entry`) for `demand`, the pods assumed there
    /// placed first; `None` where the model cannot score it.
    fn score_on(
        &self,
        view: &ClusterView,
        name: &str,
        entry: &NodeEntry,
        demand: &Demand,
        policy: &Policy,
    ) -> Option<i64> {
        let state = entry.state.as_ref().ok()?;
        let mut model = NodeModel::new(state, view.host(name, entry.allocatable))?;
        for other in &view.assumed(name, state, &self.settings.domain) {
            model.assume(other, policy);
        }
        model.score(demand, policy)
    }

    /// The filter's verdict on each of `names` for `demand`, handed to `finish` (borrowed from
    /// the memo, under its lock) with each name's slot (none where the view does not know it,
    /// and no slots at all for a demand not the extender's to judge): one lookup of each name,
    /// a verdict computed only where the node or its pods changed since it was last judged for
    /// this demand.
    fn judged<'n, R>(
        &self,
        demand: &Demand,
        names: &[&'n str],
        finish: impl FnOnce(&[Judged<'n, '_>]) -> R,
    ) -> R {
        let unknown = Verdict::NoState(UNKNOWN_NODE.into());
        if demand.is_empty() {
            // Not ours to judge: every node passes.
            let fits = Verdict::Fits;
            let all: Vec<Judged<'n, '_>> =
                names.iter().map(|n| Judged { name: n, verdict: &fits, known: None }).collect();
            return finish(&all);
        }
        let view = self.view();
        let mut memo_map = self.verdicts.lock().unwrap_or_else(PoisonError::into_inner);
        let cache = demand_memo(&mut memo_map, demand, view.slots());
        // One pass (a verdict computed where the memo's is stale), keeping only each known
        // node's slot; the verdicts are read from the memo once it is complete.
        let slots: Vec<Option<usize>> = names
            .iter()
            .map(|name| {
                let f = view.find(name)?;
                self.memo_verdict(&mut cache[f.slot], &view, f.entry?, f.stamp, || name, demand);
                Some(f.slot)
            })
            .collect();
        let judged: Vec<Judged<'n, '_>> = names
            .iter()
            .zip(slots)
            .map(|(name, known)| {
                let verdict = known.and_then(|s| cache[s].as_ref()).map_or(&unknown, |(_, v)| v);
                Judged { name, verdict, known: known.map(|s| (s, view.quoted(s))) }
            })
            .collect();
        finish(&judged)
    }

    /// Each of `names`' slot in the view (`None` where it never heard of the name).
    fn resolve(&self, names: &[&str]) -> Vec<Option<usize>> {
        let view = self.view();
        names.iter().map(|name| view.find(name).map(|f| f.slot)).collect()
    }

    /// A `filter` call's body answered. kube-scheduler sends the names its own filters passed,
    /// the same list pod after pod while the cluster stands still (all the nodes with
    /// `percentageOfNodesToScore: 100`): a call whose `NodeNames` are byte for byte a recent
    /// call's (kept resolved) is judged from that call's slots, the names neither split nor
    /// hashed again. Anything else is read and judged as [`Self::filter_json`] does.
    pub fn filter_call(&self, body: &[u8]) -> Result<FilterAnswer, serde_json::Error> {
        use crate::protocol::{ScannedNames, scan_call};
        let recent: Vec<Arc<Resolved>> =
            self.resolved.lock().unwrap_or_else(PoisonError::into_inner).iter().cloned().collect();
        let known: Vec<&[u8]> = recent.iter().map(|r| r.text.as_bytes()).collect();
        let Some(scanned) = scan_call(body, &known) else {
            let args: ExtenderArgs<'_> = serde_json::from_slice(body)?;
            return Ok(self.filter_json(&args));
        };
        if scanned.nodes.is_some() || !self.synced() {
            return Ok(self.filter_json(&scanned.into_args()));
        }
        match &scanned.names {
            ScannedNames::Known(i, _) => {
                let mut answer = self.filter_resolved(&scanned.pod, &recent[*i]);
                if answer.how == FilterHow::Read {
                    answer.how = FilterHow::Reused;
                }
                Ok(answer)
            }
            ScannedNames::Split { names, text } if !names.is_empty() => {
                let r = Arc::new(Resolved::new(text, names, self.resolve(names)));
                {
                    let mut resolved = self.resolved.lock().unwrap_or_else(PoisonError::into_inner);
                    if resolved.len() >= RESOLVED {
                        resolved.pop_front();
                    }
                    resolved.push_back(r.clone());
                }
                Ok(self.filter_resolved(&scanned.pod, &r))
            }
            _ => Ok(self.filter_json(&scanned.into_args())),
        }
    }

    /// The filter's answer for `pod` over a call's names kept resolved: [`Self::filter_names`]'
    /// answer, the same bytes, in one pass over the names that touches only what it must (each
    /// node's stamp and memoised verdict by its slot), each passing name copied from the call's
    /// own text rather than from the view's far larger index.
    fn filter_resolved(&self, pod: &crate::protocol::Pod, r: &Arc<Resolved>) -> FilterAnswer {
        let mut answer = self.filter_resolved_now(pod, r);
        if let Some(demand) = answer.ahead.as_ref().map(|a| &a.demand)
            && r.all_known
        {
            r.asked(demand);
            answer.judge = Some(JudgeAhead { names: r.clone(), except: demand.clone() });
        }
        answer
    }

    /// [`Self::filter_resolved`]'s answer, nothing judged ahead.
    fn filter_resolved_now(&self, pod: &crate::protocol::Pod, r: &Resolved) -> FilterAnswer {
        let demand = match self.demand_of(pod) {
            Ok(d) if !d.is_empty() => d,
            // Refused, or not the extender's to judge (every node passes): as any call.
            _ => {
                let names: Vec<&str> = r.spans.iter().map(|s| &r.text[s.clone()]).collect();
                return self.filter_names(pod, &names);
            }
        };
        if !self.watched.load(std::sync::atomic::Ordering::SeqCst) {
            self.learn(&pod.metadata.uid, &demand);
        }
        if let Some(answer) = self.judged_again(&demand, r) {
            return answer;
        }
        let unknown = Verdict::NoState(UNKNOWN_NODE.into());
        let mut out = Vec::with_capacity(r.text.len() + 96);
        out.extend_from_slice(b"{\"Nodes\":null,\"NodeNames\":");
        let names_start = out.len();
        out.push(b'[');
        let mut passed = Vec::with_capacity(r.slots.len());
        // The names that failed, by index, with their slot where the view knows the node.
        let mut failed: Vec<(usize, Option<usize>)> = Vec::new();
        let view = self.view();
        let mut memo_map = self.verdicts.lock().unwrap_or_else(PoisonError::into_inner);
        let cache = demand_memo(&mut memo_map, &demand, view.slots());
        for (i, slot) in r.slots.iter().enumerate() {
            let name = || &r.text[r.spans[i].clone()];
            // A name given no slot may have been heard of since: looked up.
            let slot = slot.or_else(|| view.find(name()).map(|f| f.slot));
            let known = slot.and_then(|s| {
                let (entry, stamp) = view.entry_at(s);
                entry.map(|e| (s, e, stamp))
            });
            let Some((slot, entry, stamp)) = known else {
                failed.push((i, None));
                continue;
            };
            let verdict = self.memo_verdict(&mut cache[slot], &view, entry, stamp, name, &demand);
            if matches!(verdict, Verdict::Fits) {
                if !passed.is_empty() {
                    out.push(b',');
                }
                out.extend_from_slice(r.quoted(i));
                passed.push(slot);
            } else {
                failed.push((i, Some(slot)));
            }
        }
        out.push(b']');
        let names = names_start..out.len();
        let failed: Vec<(usize, Verdict)> = failed
            .into_iter()
            .map(|(i, slot)| {
                (i, slot.and_then(|s| cache[s].as_ref()).map_or(&unknown, |(_, v)| v).clone())
            })
            .collect();
        let changes = view.changes();
        drop(memo_map);
        drop(view);
        r.push_failed(&mut out, &failed);
        let judgement = Judgement::new(changes, out, names, passed, failed);
        let judgement = r.keep(&demand, judgement);
        self.answer_judged(demand, &judgement)
    }

    /// The answer of `judgement`, the `prioritize` after it prepared.
    fn answer_judged(&self, demand: Demand, judgement: &Judgement) -> FilterAnswer {
        let body = judgement.body.clone();
        let ahead = (judgement.passed.len() >= 2).then(|| {
            Arc::new(Ahead {
                demand,
                names: body.slice(judgement.names.clone()),
                slots: judgement.passed.clone(),
                made: std::sync::OnceLock::new(),
            })
        });
        self.keep_ahead(ahead.as_ref());
        FilterAnswer {
            body,
            removed: judgement.removed,
            error: String::new(),
            ahead,
            judge: None,
            how: FilterHow::Read,
            cut: 0,
        }
    }

    /// `answer` with at most [`Settings::filter_keep_best`] of the nodes it passed: where it
    /// passed more, the ones of the best scores (the answer `prioritize` would give them,
    /// made now instead of ahead), in the call's order; ties kept in that order too. The
    /// failed nodes are as they were.
    pub fn keep_best(&self, answer: FilterAnswer) -> FilterAnswer {
        let keep = self.settings.filter_keep_best;
        let Some(ahead) = answer.ahead.as_ref() else { return answer };
        if keep == 0 || ahead.slots.len() <= keep {
            return answer;
        }
        let made = self.made(ahead);
        let Ok(scores) = serde_json::from_slice::<Vec<HostPriority>>(&made.body) else {
            return answer;
        };
        // The answer's `NodeNames` array, replaced in place: node names hold no `]`.
        let start = b"\"NodeNames\":[";
        let Some(open) = answer.body.windows(start.len()).position(|w| w == start) else {
            return answer;
        };
        let open = open + start.len() - 1;
        let Some(close) = answer.body[open..].iter().position(|&b| b == b']') else {
            return answer;
        };
        let mut best: Vec<usize> = (0..scores.len()).collect();
        // Stable: among equal scores, the call's order (kube-scheduler's rotating start).
        best.sort_by_key(|&i| std::cmp::Reverse(scores[i].score));
        best.truncate(keep);
        best.sort_unstable();
        let names: Vec<&str> = best.iter().map(|&i| scores[i].host.as_str()).collect();
        let Ok(array) = serde_json::to_vec(&names) else { return answer };
        let mut body = Vec::with_capacity(answer.body.len());
        body.extend_from_slice(&answer.body[..open]);
        body.extend_from_slice(&array);
        body.extend_from_slice(&answer.body[open + close + 1..]);
        FilterAnswer { body: body.into(), cut: scores.len() - best.len(), ..answer }
    }

    /// The latest answer for `r`'s names and `demand` again, where it still holds: every node
    /// among the names changed since it was judged is judged anew (the view's change log);
    /// where none's verdict differs, that answer is given again, byte for byte; where some do,
    /// it is patched (the verdicts of the others are the same: their nodes did not change),
    /// the runs of passing names between the failed ones copied from the call's text at once.
    /// `None` where more changed than the log keeps, where some name had no slot, or where a
    /// verdict differs and the names are not written compactly (then the whole answer is
    /// judged again).
    fn judged_again(&self, demand: &Demand, r: &Resolved) -> Option<FilterAnswer> {
        let (judgement, how) = self.rejudged(demand, r)?;
        let mut answer = self.answer_judged(demand.clone(), &judgement);
        answer.how = how;
        Some(answer)
    }

    /// [`Self::judged_again`]'s judgement, kept for `r`'s names and `demand` (patched where it
    /// must be), and how it was had: [`FilterHow::Again`] or [`FilterHow::Patched`].
    fn rejudged(&self, demand: &Demand, r: &Resolved) -> Option<(Arc<Judgement>, FilterHow)> {
        let last =
            r.judgements.lock().unwrap_or_else(PoisonError::into_inner).get(demand).cloned()?;
        let unknown = Verdict::NoState(UNKNOWN_NODE.into());
        let view = self.view();
        let since = last.changes.load(std::sync::atomic::Ordering::SeqCst);
        let mut memo_map = self.verdicts.lock().unwrap_or_else(PoisonError::into_inner);
        let cache = demand_memo(&mut memo_map, demand, view.slots());
        // The names whose verdict differs from the answer's, with their verdict now.
        let mut fresh: Vec<(usize, Verdict)> = Vec::new();
        for slot in view.changed_since(since)? {
            for i in r.places_of(slot) {
                let now = match view.entry_at(slot) {
                    (Some(entry), stamp) => {
                        let name = || &r.text[r.spans[i].clone()];
                        self.memo_verdict(&mut cache[slot], &view, entry, stamp, name, demand)
                    }
                    (None, _) => &unknown,
                };
                let then = last
                    .failed
                    .binary_search_by_key(&i, |(at, _)| *at)
                    .map_or(&Verdict::Fits, |k| &last.failed[k].1);
                if now != then {
                    if !r.compact {
                        return None;
                    }
                    fresh.push((i, now.clone()));
                }
            }
        }
        let changes = view.changes();
        drop(memo_map);
        drop(view);
        if fresh.is_empty() {
            // Never back: a caller that judged a later view first moved it further.
            last.changes.fetch_max(changes, std::sync::atomic::Ordering::SeqCst);
            return Some((last, FilterHow::Again));
        }
        // A node changed twice since is judged once, as it is now.
        fresh.sort_by_key(|(i, _)| *i);
        fresh.dedup_by_key(|(i, _)| *i);
        let failed = patched(&last.failed, fresh);
        let mut out = Vec::with_capacity(last.body.len() + 64);
        out.extend_from_slice(b"{\"Nodes\":null,\"NodeNames\":");
        let names_start = out.len();
        out.push(b'[');
        let mut passed = Vec::with_capacity(r.slots.len());
        let mut from = 0;
        for to in failed.iter().map(|(i, _)| *i).chain([r.slots.len()]) {
            if from < to {
                if !passed.is_empty() {
                    out.push(b',');
                }
                out.extend_from_slice(r.run(from, to));
                // Every name has a slot here (`all_known`: only then is an answer kept).
                passed.extend(r.slots[from..to].iter().flatten());
            }
            from = to + 1;
        }
        out.push(b']');
        let names = names_start..out.len();
        r.push_failed(&mut out, &failed);
        let judgement = r.keep(demand, Judgement::new(changes, out, names, passed, failed));
        Some((judgement, FilterHow::Patched))
    }

    /// Keeps `ahead` among the latest answers made ahead.
    fn keep_ahead(&self, ahead: Option<&Arc<Ahead>>) {
        if let Some(ahead) = ahead {
            let mut aheads = self.aheads.lock().unwrap_or_else(PoisonError::into_inner);
            if aheads.len() >= AHEADS {
                aheads.pop_front();
            }
            aheads.push_back(ahead.clone());
        }
    }

    /// The filter verb as its JSON answer, with how many nodes it removed by why and the
    /// call's error (empty when none). Node names are answered from the memo without a copy.
    /// Where at least two nodes pass (kube-scheduler calls `prioritize` only then), the answer
    /// of the `prioritize` that follows is prepared: kept among the latest [`Ahead`]s and
    /// given back, for the caller to make ([`Self::prepare_ahead`]) while the answer travels.
    pub fn filter_json(&self, args: &ExtenderArgs<'_>) -> FilterAnswer {
        if args.nodes.is_some() || !self.synced() {
            let (result, kinds) = self.filter(args);
            let mut removed = Removed::default();
            for kind in kinds {
                removed.add(kind);
            }
            return FilterAnswer::whole(result, removed);
        }
        let names: Vec<&str> = args.node_names.iter().flatten().map(|n| n.as_ref()).collect();
        self.filter_names(&args.pod, &names)
    }

    /// The filter's answer for `pod` over `names` ([`Self::judged`]), the view synced and no
    /// nodes sent in full.
    fn filter_names(&self, pod: &crate::protocol::Pod, names: &[&str]) -> FilterAnswer {
        let demand = match self.demand_of(pod) {
            Ok(d) => d,
            Err(error) => {
                let result = ExtenderFilterResult { error, ..Default::default() };
                return FilterAnswer::whole(result, Removed::default());
            }
        };
        if !self.watched.load(std::sync::atomic::Ordering::SeqCst) {
            self.learn(&pod.metadata.uid, &demand);
        }
        let answer = self.judged(&demand, names, |judged| {
            let mut removed = Removed::default();
            for j in judged {
                removed.count(j.verdict);
            }
            let (body, names) = names_answer(judged);
            let body = bytes::Bytes::from(body);
            // A node passes only where the view knows it, so each has its slot.
            let passed: Vec<usize> = judged
                .iter()
                .filter(|j| matches!(j.verdict, Verdict::Fits))
                .filter_map(|j| j.known.map(|(slot, _)| slot))
                .collect();
            let ahead = (passed.len() >= 2).then(|| {
                Arc::new(Ahead {
                    demand: demand.clone(),
                    names: body.slice(names),
                    slots: passed.into(),
                    made: std::sync::OnceLock::new(),
                })
            });
            FilterAnswer {
                body,
                removed,
                error: String::new(),
                ahead,
                judge: None,
                how: FilterHow::Read,
                cut: 0,
            }
        });
        self.keep_ahead(answer.ahead.as_ref());
        answer
    }

    /// Makes `ahead`'s answer now if it is not made yet (or waits while another thread makes
    /// it): from the scores memo, under the view and the policy of this moment, which it then
    /// holds for.
    pub fn prepare_ahead(&self, ahead: &Ahead) {
        self.made(ahead);
    }

    /// Judges again the answers kept for a filter call's names for the other demands last asked
    /// over them ([`JudgeAhead`]): each node changed since an answer was last known to hold is
    /// judged anew for its demand, and the answer is kept patched where a verdict changed,
    /// as the next call for that demand would (see [`FilterHow::Patched`]). That call then judges
    /// only the nodes changed after this: the work moves off its path, to the time kube-scheduler
    /// spends reading this answer and scoring.
    pub fn judge_ahead(&self, next: &JudgeAhead) {
        let asked: Vec<Demand> = {
            let asked = next.names.asked.lock().unwrap_or_else(PoisonError::into_inner);
            asked.iter().rev().filter(|d| **d != next.except).cloned().collect()
        };
        for demand in asked {
            let _ = self.rejudged(&demand, &next.names);
        }
    }

    fn made<'a>(&self, ahead: &'a Ahead) -> &'a Made {
        ahead.made.get_or_init(|| {
            let (policy, epoch) = self.policy_and_epoch();
            let view = self.view();
            let (kept, how) = match self.made_patched(&view, &policy, epoch, ahead) {
                Some(patched) => patched,
                None => {
                    let kept = Arc::new(self.made_afresh(&view, &policy, epoch, ahead));
                    self.keep_made(&kept);
                    (kept, MadeHow::Afresh)
                }
            };
            self.scores_made.with_label_values(&[how.as_str()]).inc();
            Made { body: kept.body.clone(), changes: view.changes(), epoch }
        })
    }

    /// `ahead`'s answer made from the scores memo, every node's score looked up or computed.
    fn made_afresh(
        &self,
        view: &ClusterView,
        policy: &Policy,
        epoch: u64,
        ahead: &Ahead,
    ) -> MadeKept {
        let slots = ahead.slots.iter().map(|&slot| Some(slot));
        let raw = self.raw_scores_in(view, policy, epoch, &ahead.demand, slots);
        let scale = crate::place::Scale::of(&raw);
        let scores = crate::place::scaled(scale, &raw);
        let (at_min, at_max) = scale.map_or((0, 0), |scale| {
            let count = |v: i64| raw.iter().filter(|r| **r == Some(v)).count();
            (count(scale.min), count(scale.max))
        });
        // Each entry's start as the view wrote it once (slots are never taken back: each
        // is there).
        let hosts = ahead.slots.iter().map(|&slot| ("", view.item_at(slot)));
        let mut score_at = Vec::with_capacity(raw.len());
        let body = scores_answer_at(hosts, &scores, Some(&mut score_at));
        MadeKept {
            demand: ahead.demand.clone(),
            slots: ahead.slots.clone(),
            epoch,
            changes: view.changes().into(),
            raw,
            scale,
            at_min,
            at_max,
            body: body.into(),
            score_at,
            places: Arc::default(),
        }
    }

    /// `ahead`'s answer as the one kept for the same nodes (the same filter answer's, given
    /// again) and demand under the same policy, with the scores of the nodes changed since
    /// patched in; `None` where there is none, where more changed than the view's log keeps,
    /// or where the changes move the least or the greatest raw score (every score moves then).
    fn made_patched(
        &self,
        view: &ClusterView,
        policy: &Policy,
        epoch: u64,
        ahead: &Ahead,
    ) -> Option<(Arc<MadeKept>, MadeHow)> {
        let kept = {
            let kept = self.made_kept.lock().unwrap_or_else(PoisonError::into_inner);
            kept.iter()
                .rev()
                .find(|k| {
                    Arc::ptr_eq(&k.slots, &ahead.slots)
                        && k.epoch == epoch
                        && k.demand == ahead.demand
                })
                .cloned()?
        };
        let since = kept.changes.load(std::sync::atomic::Ordering::SeqCst);
        let mut touched: Vec<usize> =
            view.changed_since(since)?.flat_map(|slot| kept.places_of(slot)).collect();
        touched.sort_unstable();
        touched.dedup();
        let changes = view.changes();
        if touched.is_empty() {
            kept.changes.fetch_max(changes, std::sync::atomic::Ordering::SeqCst);
            return Some((kept, MadeHow::Kept));
        }
        let slots = touched.iter().map(|&i| Some(kept.slots[i]));
        let fresh = self.raw_scores_in(view, policy, epoch, &ahead.demand, slots);
        let scale = kept.scale?;
        let (mut at_min, mut at_max) = (kept.at_min, kept.at_max);
        for (&i, new) in touched.iter().zip(&fresh) {
            let old = kept.raw[i];
            if old == *new {
                continue;
            }
            at_min -= usize::from(old == Some(scale.min));
            at_max -= usize::from(old == Some(scale.max));
            if let Some(v) = *new {
                if v < scale.min || v > scale.max {
                    return None;
                }
                at_min += usize::from(v == scale.min);
                at_max += usize::from(v == scale.max);
            }
        }
        if at_min == 0 || at_max == 0 {
            return None;
        }
        // The old answer in runs between the scores that change; each later score's start
        // moved by what the changed ones grew or shrank before it.
        let mut raw = kept.raw.clone();
        let mut body = Vec::with_capacity(kept.body.len() + touched.len());
        let mut score_at = Vec::with_capacity(kept.score_at.len());
        let mut number = itoa::Buffer::new();
        let (mut from, mut next) = (0, 0);
        for (&i, new) in touched.iter().zip(&fresh) {
            let (before, after) = (scale.score(kept.raw[i]), scale.score(*new));
            raw[i] = *new;
            let at = kept.score_at[i];
            body.extend_from_slice(&kept.body[from..at]);
            let shift = body.len().wrapping_sub(at);
            score_at.extend(kept.score_at[next..=i].iter().map(|a| a.wrapping_add(shift)));
            push_score(&mut body, &mut number, after);
            from = at + score_width(before);
            next = i + 1;
        }
        let shift = body.len().wrapping_sub(from);
        body.extend_from_slice(&kept.body[from..]);
        score_at.extend(kept.score_at[next..].iter().map(|a| a.wrapping_add(shift)));
        let patched = Arc::new(MadeKept {
            demand: kept.demand.clone(),
            slots: kept.slots.clone(),
            epoch,
            changes: changes.into(),
            raw,
            scale: Some(scale),
            at_min,
            at_max,
            body: body.into(),
            score_at,
            places: kept.places.clone(),
        });
        self.keep_made(&patched);
        Some((patched, MadeHow::Patched))
    }

    /// Keeps `made` as the latest answer made for its nodes and demand.
    fn keep_made(&self, made: &Arc<MadeKept>) {
        let mut kept = self.made_kept.lock().unwrap_or_else(PoisonError::into_inner);
        kept.retain(|k| !(Arc::ptr_eq(&k.slots, &made.slots) && k.demand == made.demand));
        if kept.len() >= MADE_KEPT {
            kept.pop_front();
        }
        kept.push_back(made.clone());
    }

    /// A `prioritize` call's body answered: from the scores made ahead where its names are a
    /// recent filter's answer (`prioritize_ahead`; found by comparing bytes, the names
    /// not even split), else computed ([`Self::prioritize_json`]).
    pub fn prioritize_call(&self, body: &[u8]) -> Result<Prioritized, CallError> {
        use crate::protocol::{ScannedNames, scan_call};
        let aheads: Vec<Arc<Ahead>> =
            self.aheads.lock().unwrap_or_else(PoisonError::into_inner).iter().cloned().collect();
        let known: Vec<&[u8]> = aheads.iter().map(|a| a.names.as_ref()).collect();
        let args = match scan_call(body, &known) {
            Some(scanned) => {
                if let (ScannedNames::Known(_, names), None) = (&scanned.names, &scanned.nodes)
                    && let Some(answer) = self.prioritize_ahead(&scanned.pod, names)
                {
                    return Ok(Prioritized::Ahead(answer));
                }
                scanned.into_args()
            }
            None => serde_json::from_slice(body).map_err(CallError::Body)?,
        };
        self.prioritize_json(&args).map(Prioritized::Computed).map_err(CallError::Refused)
    }

    /// The answer made ahead for a `prioritize` of `pod` with the node names `names` (the
    /// call's `NodeNames` as JSON text): there when a recent filter passed exactly those
    /// names, written the same way, for a pod asking the same, and nothing they are scored
    /// from changed since it was made; `None` otherwise (the call is then answered as any
    /// other, [`Self::prioritize_json`]).
    fn prioritize_ahead(&self, pod: &crate::protocol::Pod, names: &str) -> Option<bytes::Bytes> {
        if !self.synced() {
            return None;
        }
        let demand = self.demand_of(pod).ok()?;
        let ahead = {
            let aheads = self.aheads.lock().unwrap_or_else(PoisonError::into_inner);
            aheads
                .iter()
                .rev()
                .find(|a| a.demand == demand && a.names == names.as_bytes())
                .cloned()?
        };
        let made = self.made(&ahead);
        let epoch = self.epoch.load(std::sync::atomic::Ordering::SeqCst);
        let changes = self.view().changes();
        (made.changes == changes && made.epoch == epoch).then(|| made.body.clone())
    }

    /// The filter verb; also returns, per filtered-out node, why (for the metrics).
    pub fn filter(&self, args: &ExtenderArgs<'_>) -> (ExtenderFilterResult, Vec<FailKind>) {
        let mut result = ExtenderFilterResult::default();
        let mut kinds = Vec::new();
        if !self.synced() {
            result.error = NOT_SYNCED.into();
            return (result, kinds);
        }
        let demand = match self.demand_of(&args.pod) {
            Ok(d) => d,
            Err(e) => {
                result.error = e;
                return (result, kinds);
            }
        };
        if !self.watched.load(std::sync::atomic::Ordering::SeqCst) {
            self.learn(&args.pod.metadata.uid, &demand);
        }
        let mut record = |name: &str, verdict: &Verdict| -> bool {
            match verdict {
                Verdict::Fits => return true,
                Verdict::Full(why) => {
                    kinds.push(FailKind::Full);
                    result.failed_nodes.insert(name.to_owned(), why.clone());
                }
                Verdict::Never(why) => {
                    kinds.push(FailKind::Never);
                    result.failed_and_unresolvable_nodes.insert(name.to_owned(), why.clone());
                }
                Verdict::NoState(why) => {
                    kinds.push(FailKind::NoState);
                    result.failed_and_unresolvable_nodes.insert(name.to_owned(), why.clone());
                }
            }
            false
        };
        if let Some(list) = &args.nodes {
            // Nodes sent in full may differ from the cache's: judged afresh, as sent.
            let view = self.view();
            let mut kept = Vec::new();
            for (name, entry, i) in &self.sent_entries(args) {
                let v = if demand.is_empty() {
                    Verdict::Fits
                } else {
                    self.verdict_on(&view, name, entry, &demand)
                };
                if record(name, &v) {
                    kept.push(list.items[*i].clone());
                }
            }
            drop(view);
            result.nodes = Some(NodeListOut {
                metadata: list.metadata.clone().unwrap_or_else(|| serde_json::json!({})),
                items: kept,
            });
        } else {
            let names: Vec<&str> = args.node_names.iter().flatten().map(|n| n.as_ref()).collect();
            let passed = self.judged(&demand, &names, |judged| {
                judged
                    .iter()
                    .filter(|j| record(j.name, j.verdict))
                    .map(|j| j.name.to_owned())
                    .collect()
            });
            result.node_names = Some(passed);
        }
        (result, kinds)
    }

    /// The policy now and its epoch (what a memoised score holds for).
    fn policy_and_epoch(&self) -> (Arc<Policy>, u64) {
        let policy = self.policy.read().unwrap_or_else(PoisonError::into_inner);
        (policy.clone(), self.epoch.load(std::sync::atomic::Ordering::SeqCst))
    }

    /// Each of `names`' score for `demand` (0 to [`crate::protocol::MAX_SCORE`]), from the memo
    /// where the node, its pods and the policy are as they were.
    fn scores_of(&self, demand: &Demand, names: &[&str]) -> Vec<i64> {
        let (policy, epoch) = self.policy_and_epoch();
        let view = self.view();
        let slots = names.iter().map(|name| view.find(name).map(|f| f.slot));
        extender_scores(&self.raw_scores_in(&view, &policy, epoch, demand, slots))
    }

    /// The raw scores for `demand` of the nodes by their slot in `view` (`None`: unknown; no
    /// score), under `policy` of `epoch`, from the memo where the node, its pods and the
    /// policy are as they were, before they are put on kube-scheduler's scale.
    fn raw_scores_in(
        &self,
        view: &ClusterView,
        policy: &Policy,
        epoch: u64,
        demand: &Demand,
        slots: impl Iterator<Item = Option<usize>>,
    ) -> Vec<Option<i64>> {
        let mut memo_map = self.scores.lock().unwrap_or_else(PoisonError::into_inner);
        let cache = demand_memo(&mut memo_map, demand, view.slots());
        let mut computed = 0;
        let scores = slots
            .map(|slot| {
                let slot = slot?;
                let (entry, stamp) = view.entry_at(slot);
                let entry = entry?;
                let key = (stamp, epoch);
                if let Some((k, v)) = &cache[slot]
                    && *k == key
                {
                    return *v;
                }
                // The name only where the score must be computed anew.
                let name = view.name_of(slot)?;
                let score = self.score_on(view, name, entry, demand, policy);
                cache[slot] = Some((key, score));
                computed += 1;
                score
            })
            .collect();
        self.scores_computed.inc_by(computed);
        scores
    }

    /// The preempt verb: of the candidate nodes and victims kube-scheduler proposes (it picks
    /// them by the node's totals), keeps only those where evicting the victims frees enough on
    /// one GPU (or MIG profile, or NVLink group) for the pod, by the same verdict as the
    /// filter; the others would evict pods and still not fit. A victim frees what the
    /// document shows it holding: its units on the one GPU that lists it (a pod listed on
    /// several GPUs, or holding MIG instances, frees nothing here: which units are whose is
    /// not in the document), its whole GPUs, and what it asks where it is assumed (bound, not
    /// yet published). Victims the extender does not know free nothing.
    pub fn preempt(
        &self,
        args: &crate::protocol::ExtenderPreemptionArgs,
    ) -> Result<crate::protocol::ExtenderPreemptionResult, String> {
        use crate::protocol::{MetaPod, MetaVictims};
        if !self.synced() {
            return Err(NOT_SYNCED.into());
        }
        let demand = self.demand_of(&args.pod)?;
        let candidates: BTreeMap<String, MetaVictims> =
            match (&args.node_name_to_meta_victims, &args.node_name_to_victims) {
                (Some(meta), _) => meta.clone(),
                (None, Some(full)) => full
                    .iter()
                    .map(|(node, v)| {
                        let pods = v
                            .pods
                            .iter()
                            .flatten()
                            .map(|p| MetaPod { uid: p.metadata.uid.clone() });
                        (
                            node.clone(),
                            MetaVictims {
                                pods: Some(pods.collect()),
                                num_pdb_violations: v.num_pdb_violations,
                            },
                        )
                    })
                    .collect(),
                (None, None) => BTreeMap::new(),
            };
        let mut result = crate::protocol::ExtenderPreemptionResult::default();
        if demand.is_empty() {
            result.node_name_to_meta_victims = candidates;
            return Ok(result);
        }
        let view = self.view();
        for (node, victims) in candidates {
            let Some(Ok(state)) = view.node(&node).map(|e| e.state.as_ref()) else { continue };
            let uids: std::collections::BTreeSet<&str> =
                victims.pods.iter().flatten().map(|p| p.uid.as_str()).collect();
            let mut freed = state.clone();
            for uid in &uids {
                let Some(victim) = view.pod(uid) else { continue };
                free_published(&mut freed, victim);
            }
            let assumed = view.assumed_except(&node, &freed, &self.settings.domain, &uids);
            let assumed: Vec<&Demand> = assumed.iter().collect();
            if matches!(verdict(&freed, &assumed, &demand, &self.settings.domain), Verdict::Fits) {
                result.node_name_to_meta_victims.insert(node, victims);
            }
        }
        Ok(result)
    }

    /// The prioritize verb as its JSON answer.
    pub fn prioritize_json(&self, args: &ExtenderArgs<'_>) -> Result<Vec<u8>, String> {
        if args.nodes.is_some() {
            return self.prioritize(args).map(|s| serde_json::to_vec(&s).unwrap_or_default());
        }
        if !self.synced() {
            return Err(NOT_SYNCED.into());
        }
        let demand = self.demand_of(&args.pod)?;
        let names: Vec<&str> = args.node_names.iter().flatten().map(|n| n.as_ref()).collect();
        let scores = if demand.is_empty() && !self.settings.score_cpu_only {
            vec![0; names.len()]
        } else {
            self.scores_of(&demand, &names)
        };
        let hosts: Vec<(&str, Option<&str>)> = names.iter().map(|n| (*n, None)).collect();
        Ok(scores_answer(hosts.iter().copied(), &scores))
    }

    /// The prioritize verb.
    pub fn prioritize(&self, args: &ExtenderArgs<'_>) -> Result<Vec<HostPriority>, String> {
        if !self.synced() {
            return Err(NOT_SYNCED.into());
        }
        let demand = self.demand_of(&args.pod)?;
        let sent = self.sent_entries(args);
        let names: Vec<&str> = if args.nodes.is_some() {
            sent.iter().map(|(n, _, _)| n.as_str()).collect()
        } else {
            args.node_names.iter().flatten().map(|n| n.as_ref()).collect()
        };
        let scores = if demand.is_empty() && !self.settings.score_cpu_only {
            // Unscored: every node the same.
            vec![0; names.len()]
        } else if args.nodes.is_some() {
            // Nodes sent in full may differ from the cache's: scored afresh.
            let policy = self.policy();
            let view = self.view();
            let raw: Vec<Option<i64>> = sent
                .iter()
                .map(|(name, entry, _)| self.score_on(&view, name, entry, &demand, &policy))
                .collect();
            extender_scores(&raw)
        } else {
            self.scores_of(&demand, &names)
        };
        Ok(names
            .into_iter()
            .zip(scores)
            .map(|(host, score)| HostPriority { host: host.to_owned(), score })
            .collect())
    }
}

/// What `victim` holds in `state` as published, given back: its units on the one GPU listing
/// it, or the GPUs it holds whole.
fn free_published(state: &mut NodeGpuState, victim: &PodEntry) {
    use crate::demand::Ask;
    use baleen_k8s::gpu_state::GpuMode;
    let listed: Vec<usize> = state
        .gpus
        .iter()
        .enumerate()
        .filter(|(_, g)| g.pods.contains(&victim.key))
        .map(|(i, _)| i)
        .collect();
    let units: u64 = victim
        .demand
        .asks
        .iter()
        .map(|a| if let Ask::GpuMemory(n) = a { u64::from(*n) } else { 0 })
        .sum();
    let whole =
        victim.demand.asks.iter().any(|a| matches!(a, Ask::Gpus(_) | Ask::NvlinkGroups(..)));
    let others = victim.demand.asks.iter().any(|a| matches!(a, Ask::Mig(..)));
    if others {
        return;
    }
    let free = |g: &mut baleen_k8s::gpu_state::GpuEntry, by: u64| {
        g.units_free = u32::try_from(u64::from(g.units_free).saturating_add(by))
            .unwrap_or(u32::MAX)
            .min(g.units_total);
        g.pods.retain(|p| *p != victim.key);
        let idle = g.pods.is_empty() && g.units_free == g.units_total;
        g.mode = if idle { GpuMode::Idle } else { GpuMode::Shared };
        g.compute_free_milli = g
            .units_free
            .saturating_mul(1000)
            .checked_div(g.units_total)
            .unwrap_or(if idle { 1000 } else { 0 });
    };
    match (listed.as_slice(), whole) {
        (_, true) => {
            for &i in &listed {
                let g = &mut state.gpus[i];
                if g.mode == GpuMode::Exclusive && g.pods.len() == 1 {
                    let total = u64::from(g.units_total);
                    free(g, total);
                }
            }
        }
        ([i], false) if units > 0 => free(&mut state.gpus[*i], units),
        _ => {}
    }
}

/// The memo of `demand`, one place per node slot of the view (`slots`); a fresh memo when too
/// many demands are remembered.
fn demand_memo<'a, K, V>(
    memo: &'a mut Memo<K, V>,
    demand: &Demand,
    slots: usize,
) -> &'a mut Vec<Option<(K, V)>> {
    if !memo.contains_key(demand) && memo.len() >= MEMO_DEMANDS {
        memo.clear();
    }
    let per_node = memo.entry(demand.clone()).or_default();
    if per_node.len() < slots {
        per_node.resize_with(slots, || None);
    }
    per_node
}

impl Judgement {
    /// The answer `body` (its `NodeNames` at `names`) judged when the view's change count was
    /// `changes`, with the slots that passed and the names that failed.
    fn new(
        changes: u64,
        body: Vec<u8>,
        names: std::ops::Range<usize>,
        passed: Vec<usize>,
        failed: Vec<(usize, Verdict)>,
    ) -> Self {
        let mut removed = Removed::default();
        for (_, verdict) in &failed {
            removed.count(verdict);
        }
        Judgement {
            changes: changes.into(),
            body: body.into(),
            names,
            removed,
            passed: passed.into(),
            failed,
        }
    }
}

/// The failed names of an answer (`failed`, by index) with the verdicts of `fresh` (by index,
/// each once) in place of theirs: a name now passing leaves the list, one now failing enters
/// or changes its reason.
fn patched(failed: &[(usize, Verdict)], fresh: Vec<(usize, Verdict)>) -> Vec<(usize, Verdict)> {
    let mut out = Vec::with_capacity(failed.len() + fresh.len());
    let mut old = failed.iter().peekable();
    for (i, verdict) in fresh {
        while let Some(kept) = old.next_if(|(at, _)| *at < i) {
            out.push(kept.clone());
        }
        old.next_if(|(at, _)| *at == i);
        if !matches!(verdict, Verdict::Fits) {
            out.push((i, verdict));
        }
    }
    out.extend(old.cloned());
    out
}

/// The counter's options are constants that are valid: `IntCounter::new` cannot fail on them.
fn unreachable_counter() -> prometheus::IntCounter {
    prometheus::IntCounter::with_opts(prometheus::Opts::new("baleen_extender_unnamed", "-"))
        .unwrap_or_else(|_| unreachable!("a valid constant name"))
}
