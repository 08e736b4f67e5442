//! The kube-scheduler extender protocol (`k8s.io/kube-scheduler/extender/v1`) as JSON: the Go
//! types carry no JSON tags, so keys are the Go field names (`Pod`, `Nodes`, `NodeNames`, ...).
//! Pods and Nodes inside are ordinary core/v1 JSON; only the fields the extender reads are typed
//! ([`Pod`], [`Node`]), everything else is ignored on the way in, and the Nodes a filter keeps
//! are given back exactly as they came (raw JSON), since kube-scheduler reads them back.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// The body of `filter` and `prioritize`. The node names borrow from the body where they can
/// (a name with no JSON escape, as every DNS name): 5,000 of them are parsed without 5,000
/// allocations.
#[derive(Debug, Clone, Deserialize)]
pub struct ExtenderArgs<'a> {
    /// The pod being scheduled.
    #[serde(rename = "Pod")]
    pub pod: Pod,
    /// The candidate nodes, in full (`nodeCacheCapable: false`).
    #[serde(rename = "Nodes", default)]
    pub nodes: Option<NodeList>,
    /// The candidate nodes' names (`nodeCacheCapable: true`).
    #[serde(rename = "NodeNames", default, borrow)]
    pub node_names: Option<Vec<NodeName<'a>>>,
}

/// A node name in a call: borrowed from the body when it has no JSON escape (serde's own `Cow`
/// inside a `Vec` is always copied), owned otherwise.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeName<'a>(pub std::borrow::Cow<'a, str>);

impl AsRef<str> for NodeName<'_> {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl<'de: 'a, 'a> Deserialize<'de> for NodeName<'a> {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visit;
        impl<'de> serde::de::Visitor<'de> for Visit {
            type Value = NodeName<'de>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a node name")
            }
            fn visit_borrowed_str<E: serde::de::Error>(
                self,
                v: &'de str,
            ) -> Result<Self::Value, E> {
                Ok(NodeName(std::borrow::Cow::Borrowed(v)))
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(NodeName(std::borrow::Cow::Owned(v.to_owned())))
            }
            fn visit_string<E: serde::de::Error>(self, v: String) -> Result<Self::Value, E> {
                Ok(NodeName(std::borrow::Cow::Owned(v)))
            }
        }
        deserializer.deserialize_str(Visit)
    }
}

impl<'a> ExtenderArgs<'a> {
    /// A call's body parsed: by [`scan_call`] where it can, else by serde_json (what the
    /// extender's handlers parse; the same answer as serde_json's `from_slice`, faster).
    pub fn parse(body: &'a [u8]) -> Result<Self, serde_json::Error> {
        match scan_call(body, &[]) {
            Some(scanned) => Ok(scanned.into_args()),
            None => serde_json::from_slice(body),
        }
    }
}

impl<'a> Scanned<'a> {
    /// The arguments (the names of a known array split from the body too).
    pub fn into_args(self) -> ExtenderArgs<'a> {
        let borrowed = |names: Vec<&'a str>| {
            names.into_iter().map(|n| NodeName(std::borrow::Cow::Borrowed(n))).collect()
        };
        let node_names = match self.names {
            ScannedNames::Absent => None,
            ScannedNames::Split { names, .. } => Some(borrowed(names)),
            // A known array is one the extender wrote: its names plain, or escaped as
            // serde_json escapes them; either way a JSON array of strings.
            ScannedNames::Known(_, text) => Some(match names_array(text, 0) {
                Some((names, _)) => borrowed(names),
                None => serde_json::from_str(text).unwrap_or_default(),
            }),
        };
        ExtenderArgs { pod: self.pod, nodes: self.nodes, node_names }
    }
}

impl ExtenderArgs<'static> {
    /// The arguments in a JSON value, every name owned (tests, the cluster loop: what is parsed
    /// from a body borrows from it instead).
    pub fn from_json(value: Value) -> Result<Self, serde_json::Error> {
        #[derive(Deserialize)]
        struct Owned {
            #[serde(rename = "Pod")]
            pod: Pod,
            #[serde(rename = "Nodes", default)]
            nodes: Option<NodeList>,
            #[serde(rename = "NodeNames", default)]
            node_names: Option<Vec<String>>,
        }
        let owned: Owned = serde_json::from_value(value)?;
        Ok(Self {
            pod: owned.pod,
            nodes: owned.nodes,
            node_names: owned.node_names.map(|names| {
                names.into_iter().map(|n| NodeName(std::borrow::Cow::Owned(n))).collect()
            }),
        })
    }
}

/// Whether `text` is written in JSON as it is between quotes: no `"`, `\` or control
/// character (serde_json escapes only those; every DNS name is plain).
pub fn json_plain(text: &str) -> bool {
    // Branch-free per byte, so that the compiler can check many at once.
    !text.bytes().fold(false, |bad, b| bad | (b < 0x20) | (b == b'"') | (b == b'\\'))
}

/// How an entry of a `prioritize` answer (a `HostPriority`) starts, before the host's name.
pub const HOST_ITEM_START: &str = "{\"Host\":";
/// What follows the host's name in it, before the score.
pub const HOST_ITEM_SCORE: &str = ",\"Score\":";

/// Appends the start of `host`'s entry in a `prioritize` answer: [`HOST_ITEM_START`], the name
/// as a JSON string (as serde_json writes it), [`HOST_ITEM_SCORE`].
pub fn push_host_item(out: &mut String, host: &str) {
    out.push_str(HOST_ITEM_START);
    if json_plain(host) {
        out.push('"');
        out.push_str(host);
        out.push('"');
    } else {
        // A String of JSON text cannot fail to be written to.
        out.push_str(&serde_json::to_string(host).unwrap_or_default());
    }
    out.push_str(HOST_ITEM_SCORE);
}

/// A call's body as [`scan_call`] reads it.
#[derive(Debug)]
pub struct Scanned<'a> {
    /// The pod.
    pub pod: Pod,
    /// The nodes sent in full, if any.
    pub nodes: Option<NodeList>,
    /// The node names.
    pub names: ScannedNames<'a>,
}

/// The `NodeNames` of a call as [`scan_call`] found them.
#[derive(Debug, PartialEq, Eq)]
pub enum ScannedNames<'a> {
    /// None (absent, or `null`).
    Absent,
    /// Exactly the `.0`-th of the arrays the caller knew, byte for byte, not split: `.1` is
    /// that array's text in the body.
    Known(usize, &'a str),
    /// These names, borrowed from the body, and their array's text in it.
    Split {
        /// The names.
        names: Vec<&'a str>,
        /// The array (`[` to `]`) as it lies in the body.
        text: &'a str,
    },
}

/// Reads a call's body (`ExtenderArgs`: `Pod`, `Nodes`, `NodeNames`) the fast way, as
/// kube-scheduler writes it: the pod and anything else by serde_json, the node names split by
/// hand, since 5,000 of them parsed one by one by serde_json were most of a call's parse (and
/// its parse most of the server's time). Where the names are byte for byte one of the `known`
/// arrays (JSON text: the names a filter answered), they are not even split. `None` where the
/// body is anything else than what serde_json would read the same way: a name or key with an
/// escape or a control character, a key twice, a value that is not what the field takes, text
/// after the object, not UTF-8. The caller then parses it with serde_json, which reads it or
/// says what is wrong; a fuzz target and a property test hold the two to the same answers.
pub fn scan_call<'a>(body: &'a [u8], known: &[&[u8]]) -> Option<Scanned<'a>> {
    let text = std::str::from_utf8(body).ok()?;
    let b = body;
    let mut at = skip_space(b, 0);
    if b.get(at) != Some(&b'{') {
        return None;
    }
    at = skip_space(b, at + 1);
    let (mut pod, mut nodes, mut names) = (None, None, None);
    if b.get(at) == Some(&b'}') {
        at += 1;
    } else {
        loop {
            let (key, next) = plain_string(text, at)?;
            at = skip_space(b, next);
            if b.get(at) != Some(&b':') {
                return None;
            }
            at = skip_space(b, at + 1);
            match key {
                "Pod" if pod.is_none() => {
                    let (value, used) = one_value::<Pod>(&text[at..])?;
                    pod = Some(value);
                    at += used;
                }
                "Nodes" if nodes.is_none() => {
                    let (value, used) = one_value::<Option<NodeList>>(&text[at..])?;
                    nodes = Some(value);
                    at += used;
                }
                "NodeNames" if names.is_none() => {
                    let rest = &b[at..];
                    if let Some(i) = known.iter().position(|k| !k.is_empty() && rest.starts_with(k))
                    {
                        let end = at + known[i].len();
                        // A known array is whole JSON text, so it ends on a char boundary.
                        names = Some(ScannedNames::Known(i, text.get(at..end)?));
                        at = end;
                    } else if rest.starts_with(b"null") {
                        names = Some(ScannedNames::Absent);
                        at += 4;
                    } else {
                        let (list, next) = names_array(text, at)?;
                        names = Some(ScannedNames::Split { names: list, text: &text[at..next] });
                        at = next;
                    }
                }
                "Pod" | "Nodes" | "NodeNames" => return None,
                _ => {
                    let (_, used) = one_value::<serde::de::IgnoredAny>(&text[at..])?;
                    at += used;
                }
            }
            at = skip_space(b, at);
            match b.get(at) {
                Some(b',') => at = skip_space(b, at + 1),
                Some(b'}') => {
                    at += 1;
                    break;
                }
                _ => return None,
            }
        }
    }
    (skip_space(b, at) == b.len()).then_some(())?;
    Some(Scanned {
        pod: pod?,
        nodes: nodes.flatten(),
        names: names.unwrap_or(ScannedNames::Absent),
    })
}

/// The first index from `at` that is not JSON whitespace.
fn skip_space(b: &[u8], mut at: usize) -> usize {
    while at < b.len() && matches!(b[at], b' ' | b'\t' | b'\n' | b'\r') {
        at += 1;
    }
    at
}

/// The string starting at `at` (its opening quote) when it has no escape and no control
/// character, and the index after its closing quote.
fn plain_string(text: &str, at: usize) -> Option<(&str, usize)> {
    let b = text.as_bytes();
    if b.get(at) != Some(&b'"') {
        return None;
    }
    let start = at + 1;
    let end = start + memchr::memchr(b'"', &b[start..])?;
    // Both ends are ASCII quotes: char boundaries of `text`. Up to the first quote, the
    // string is plain exactly where it has no escape and no control character.
    let inner = &text[start..end];
    json_plain(inner).then_some((inner, end + 1))
}

/// The array of plain strings starting at `at`, and the index after it.
fn names_array(text: &str, at: usize) -> Option<(Vec<&str>, usize)> {
    let b = text.as_bytes();
    if b.get(at) != Some(&b'[') {
        return None;
    }
    let mut at = skip_space(b, at + 1);
    let mut names = Vec::with_capacity((b.len() - at) / 12 + 1);
    if b.get(at) == Some(&b']') {
        return Some((names, at + 1));
    }
    loop {
        let (name, next) = plain_string(text, at)?;
        names.push(name);
        at = skip_space(b, next);
        match b.get(at) {
            Some(b',') => at = skip_space(b, at + 1),
            Some(b']') => return Some((names, at + 1)),
            _ => return None,
        }
    }
}

/// One JSON value at the start of `text` as `T`, and how many bytes it took.
fn one_value<'a, T: Deserialize<'a>>(text: &'a str) -> Option<(T, usize)> {
    let mut values = serde_json::Deserializer::from_str(text).into_iter::<T>();
    let value = values.next()?.ok()?;
    Some((value, values.byte_offset()))
}

/// A NodeList: its items kept as they came.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct NodeList {
    /// The list's metadata, given back unchanged.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<Value>,
    /// The Node objects.
    #[serde(default)]
    pub items: Vec<Value>,
}

/// The answer of `filter`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ExtenderFilterResult {
    /// The nodes that pass, in full (when they were sent in full).
    #[serde(rename = "Nodes")]
    pub nodes: Option<NodeListOut>,
    /// The names of the nodes that pass (when names were sent).
    #[serde(rename = "NodeNames")]
    pub node_names: Option<Vec<String>>,
    /// Nodes filtered out, with why; preemption might make room on them.
    #[serde(rename = "FailedNodes")]
    pub failed_nodes: BTreeMap<String, String>,
    /// Nodes filtered out where preemption cannot help.
    #[serde(rename = "FailedAndUnresolvableNodes", default)]
    pub failed_and_unresolvable_nodes: BTreeMap<String, String>,
    /// A failure of the whole call (empty when none).
    #[serde(rename = "Error")]
    pub error: String,
}

/// A NodeList as given back.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct NodeListOut {
    /// The list's metadata.
    pub metadata: Value,
    /// The nodes.
    pub items: Vec<Value>,
}

/// One node's score in the answer of `prioritize` (a bare array of these).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostPriority {
    /// The node.
    #[serde(rename = "Host")]
    pub host: String,
    /// 0 (worst) to [`MAX_SCORE`].
    #[serde(rename = "Score")]
    pub score: i64,
}

/// The body of `bind` (`bindVerb`): the pod kube-scheduler chose `node` for.
#[derive(Debug, Clone, Deserialize)]
pub struct ExtenderBindingArgs {
    /// The pod's name.
    #[serde(rename = "PodName")]
    pub pod_name: String,
    /// Its namespace.
    #[serde(rename = "PodNamespace")]
    pub pod_namespace: String,
    /// Its UID.
    #[serde(rename = "PodUID")]
    pub pod_uid: String,
    /// The node chosen.
    #[serde(rename = "Node")]
    pub node: String,
}

/// The answer of `bind`: empty `Error` when the pod is bound.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExtenderBindingResult {
    /// Why the pod was not bound (kube-scheduler then forgets its assumption and retries it).
    #[serde(rename = "Error")]
    pub error: String,
}

/// The body of `preempt` (`preemptVerb`): the pod, and per candidate node the victims
/// kube-scheduler would evict there (`NodeNameToMetaVictims` by UID when `nodeCacheCapable`,
/// `NodeNameToVictims` with whole pods otherwise).
#[derive(Debug, Clone, Deserialize)]
pub struct ExtenderPreemptionArgs {
    /// The pod to make room for.
    #[serde(rename = "Pod")]
    pub pod: Pod,
    /// Victims as whole pods.
    #[serde(rename = "NodeNameToVictims", default)]
    pub node_name_to_victims: Option<BTreeMap<String, Victims>>,
    /// Victims by UID.
    #[serde(rename = "NodeNameToMetaVictims", default)]
    pub node_name_to_meta_victims: Option<BTreeMap<String, MetaVictims>>,
}

/// The victims on one node, as whole pods.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct Victims {
    /// The pods.
    #[serde(rename = "Pods", default)]
    pub pods: Option<Vec<Pod>>,
    /// PodDisruptionBudget violations the eviction would cause.
    #[serde(rename = "NumPDBViolations", default)]
    pub num_pdb_violations: i64,
}

/// The victims on one node, by UID.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MetaVictims {
    /// The pods.
    #[serde(rename = "Pods", default)]
    pub pods: Option<Vec<MetaPod>>,
    /// PodDisruptionBudget violations the eviction would cause.
    #[serde(rename = "NumPDBViolations", default)]
    pub num_pdb_violations: i64,
}

/// A pod by UID.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MetaPod {
    /// Its UID.
    #[serde(rename = "UID")]
    pub uid: String,
}

/// The answer of `preempt`: the candidate nodes kept, with their victims.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExtenderPreemptionResult {
    /// Per node kept, the victims.
    #[serde(rename = "NodeNameToMetaVictims")]
    pub node_name_to_meta_victims: BTreeMap<String, MetaVictims>,
}

/// kube-scheduler's `MaxExtenderPriority`.
pub const MAX_SCORE: i64 = 10;

/// The fields of a Pod the extender reads.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct Pod {
    /// Name, namespace, UID, annotations.
    pub metadata: Meta,
    /// Containers and the node it is bound to.
    pub spec: PodSpec,
    /// Its phase.
    pub status: PodStatus,
}

/// Object metadata.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct Meta {
    /// Name.
    pub name: String,
    /// Namespace.
    pub namespace: String,
    /// UID.
    pub uid: String,
    /// Annotations.
    pub annotations: Option<BTreeMap<String, String>>,
    /// Set when the object is being deleted.
    pub deletion_timestamp: Option<String>,
}

/// A pod's spec.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct PodSpec {
    /// Containers (upstream's example sends `null`).
    pub containers: Option<Vec<Container>>,
    /// Init containers.
    pub init_containers: Option<Vec<Container>>,
    /// The pod's overhead (its RuntimeClass's), counted on top of its containers.
    pub overhead: Option<BTreeMap<String, Value>>,
    /// The node it is bound to, once bound.
    pub node_name: Option<String>,
    /// The scheduler it asks for (`default-scheduler` when unset).
    pub scheduler_name: Option<String>,
    /// The DRA claims it holds.
    pub resource_claims: Option<Vec<PodResourceClaim>>,
}

/// One entry of a pod's `spec.resourceClaims`: a claim by name, or one made from a template.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct PodResourceClaim {
    /// The entry's name in the pod.
    pub name: String,
    /// The claim, where the pod names it.
    pub resource_claim_name: Option<String>,
    /// The template the claim is made from, where it is.
    pub resource_claim_template_name: Option<String>,
}

/// One entry of a pod's `status.resourceClaimStatuses`: the claim made for a template entry.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct PodResourceClaimStatus {
    /// The entry's name in the pod's `spec.resourceClaims`.
    pub name: String,
    /// The claim made for it (unset where none was needed).
    pub resource_claim_name: Option<String>,
}

/// A pod's status.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct PodStatus {
    /// `Pending`, `Running`, `Succeeded`, `Failed`, `Unknown`.
    pub phase: Option<String>,
    /// The claims made from the templates its `spec.resourceClaims` name.
    pub resource_claim_statuses: Option<Vec<PodResourceClaimStatus>>,
}

/// A container's name and resources.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct Container {
    /// Name.
    pub name: String,
    /// Requests and limits.
    pub resources: Resources,
    /// `Always` for a sidecar (an init container that keeps running).
    pub restart_policy: Option<String>,
}

/// Requests and limits, quantities as they came (a string or a number).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct Resources {
    /// Limits.
    pub limits: Option<BTreeMap<String, Value>>,
    /// Requests.
    pub requests: Option<BTreeMap<String, Value>>,
}

/// The fields of a Node the extender reads.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct Node {
    /// Name and annotations.
    pub metadata: Meta,
    /// Allocatable resources.
    pub status: NodeStatus,
}

/// A node's status.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct NodeStatus {
    /// What pods may use.
    pub allocatable: Option<BTreeMap<String, Value>>,
    /// What the node has (the kubelet's count of every device a plugin advertises).
    pub capacity: Option<BTreeMap<String, Value>>,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Upstream's compatibility examples (kube-scheduler's own test data).
    fn examples() -> Value {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../shared/proto-upstream/scheduler-extender-v1-examples.json"
        );
        let text = std::fs::read_to_string(path)
            .unwrap_or_else(|e| panic!("{path}: {e} (../shared must be beside the repository)"));
        serde_json::from_str(&text).expect("examples")
    }

    fn exact(name: &str) -> String {
        examples()["examples"][name]["exact_json"].as_str().expect("exact_json").to_owned()
    }

    #[test]
    fn upstreams_preemption_args_and_result_are_read_and_written() {
        let args: ExtenderPreemptionArgs =
            serde_json::from_str(&exact("ExtenderPreemptionArgs")).expect("parses");
        let meta = args.node_name_to_meta_victims.expect("meta victims");
        assert_eq!(meta["foo"].pods.as_deref(), Some(&[MetaPod { uid: "myuid".into() }][..]));
        let full = args.node_name_to_victims.expect("victims");
        assert_eq!(full["foo"].num_pdb_violations, 1);
        let result = ExtenderPreemptionResult { node_name_to_meta_victims: meta };
        assert_eq!(
            serde_json::to_string(&result).expect("json"),
            exact("ExtenderPreemptionResult")
        );
    }

    #[test]
    fn upstreams_binding_args_and_result_are_read_and_written() {
        let args: ExtenderBindingArgs =
            serde_json::from_str(&exact("ExtenderBindingArgs")).expect("parses");
        assert_eq!(
            (args.pod_name.as_str(), args.pod_namespace.as_str(), args.pod_uid.as_str()),
            ("mypodname", "mypodnamespace", "mypoduid")
        );
        assert_eq!(args.node, "mynode");
        let result = ExtenderBindingResult { error: "myerror".into() };
        assert_eq!(serde_json::to_string(&result).expect("json"), exact("ExtenderBindingResult"));
    }

    #[test]
    fn upstreams_extender_args_parse() {
        let text = exact("ExtenderArgs");
        let args: ExtenderArgs = serde_json::from_str(&text).expect("parses");
        assert_eq!(args.pod.metadata.name, "podname");
        assert!(args.pod.spec.containers.is_none(), "containers: null");
        let nodes = args.nodes.expect("Nodes");
        assert_eq!(nodes.items.len(), 1);
        assert_eq!(nodes.items[0]["metadata"]["name"], "nodename");
        let names: Vec<&str> = args.node_names.iter().flatten().map(|n| n.as_ref()).collect();
        assert_eq!(names, ["node1"]);
        assert!(
            args.node_names.iter().flatten().all(|n| matches!(n.0, std::borrow::Cow::Borrowed(_))),
            "names are borrowed from the body, not copied"
        );
    }

    #[test]
    fn our_filter_result_is_upstreams_bytes() {
        let upstream = exact("ExtenderFilterResult");
        let parsed: ExtenderFilterResult = serde_json::from_str(&upstream).expect("parses");
        assert_eq!(parsed.failed_nodes["foo"], "bar");
        assert_eq!(parsed.failed_and_unresolvable_nodes["baz"], "qux");
        assert_eq!(parsed.error, "myerror");
        // Written back: the same bytes the Go side marshals.
        assert_eq!(serde_json::to_string(&parsed).expect("writes"), upstream);
    }

    #[test]
    fn our_host_priority_is_upstreams_bytes() {
        let upstream = exact("HostPriority");
        let parsed: HostPriority = serde_json::from_str(&upstream).expect("parses");
        assert_eq!(parsed, HostPriority { host: "myhost".into(), score: 1 });
        assert_eq!(serde_json::to_string(&parsed).expect("writes"), upstream);
    }

    #[test]
    fn a_real_pod_and_node_parse() {
        let pod: Pod = serde_json::from_value(serde_json::json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "p", "namespace": "ns", "uid": "u-1", "labels": {"a": "b"}},
            "spec": {"containers": [{"name": "c", "image": "x",
                "resources": {"limits": {"awesome-ai-company.com/gpu-memory": 8, "cpu": "2"},
                              "requests": {"cpu": "500m", "memory": "1Gi"}}}],
                     "schedulerName": "default-scheduler"},
            "status": {"phase": "Pending", "conditions": []}
        }))
        .expect("a pod");
        let limits = pod.spec.containers.expect("containers")[0].resources.limits.clone();
        assert_eq!(limits.expect("limits")["awesome-ai-company.com/gpu-memory"], 8);
        let node: Node = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "n", "annotations": {"k": "v"}},
            "status": {"allocatable": {"cpu": "96", "memory": "1056Gi", "pods": "110"}}
        }))
        .expect("a node");
        assert_eq!(node.status.allocatable.expect("allocatable")["cpu"], "96");
    }
}
