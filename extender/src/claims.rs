//! What pods ask through DRA claims of baleen's DeviceClasses, so that the extender judges the
//! nodes of a pod that holds claims as it judges a pod asking `gpu-memory` or `gpu`
//! (docs/dra.md, "Packing").
//!
//! kube-scheduler's DRA allocator chooses a claim's devices on a node; which node is its score
//! plugins' choice, and none of them looks at how full a GPU is. With the extender called for
//! such pods (a profile without `managedResources`), the policy chooses the node, from the
//! node's gpu-state document, which DRA agents publish as device-plugin agents do. Each claim
//! request of one of the classes named by `--dra-device-class` becomes an [`Ask`]:
//! - `exactly` with `capacity.requests.memory`: `count` shares of that memory, in units of
//!   `--dra-memory-unit` rounded up (as the slices' `requestPolicy` rounds it);
//! - `exactly` without capacity: `count` GPUs whole (the class gives a GPU whole when no
//!   capacity is asked);
//! - anything else (`allocationMode: All`, `firstAvailable` lists, other classes): no ask; the
//!   allocator alone places it. The extender's filter only narrows the nodes that
//!   kube-scheduler's own filters (the DRA plugin among them) let through, so an ask missed here
//!   costs packing, never a placement.
//!
//! The claims are followed by a ResourceClaim watch ([`watch`]); a pod's claims are found by
//! name (`resourceClaimName`) or, for a claim made from a template, through the pod's
//! `status.resourceClaimStatuses`, which kube-controller-manager writes before kube-scheduler
//! takes the pod.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, PoisonError, RwLock};

use baleen_k8s::watch::Change;
use k8s_openapi::api::resource::v1::{
    DeviceClaim, DeviceRequest, ResourceClaim, ResourceClaimTemplate,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::Api;
use kube::runtime::watcher;
use tokio_util::sync::CancellationToken;

use crate::demand::Ask;
use crate::protocol::Pod;

/// The capacity a share of a baleen GPU asks for (the slices' consumable capacity).
const MEMORY: &str = "memory";

/// Which claims count, and how their memory is counted.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ClaimSettings {
    /// The DeviceClasses whose requests are baleen GPUs (the chart's `<driver>` class).
    pub classes: Vec<String>,
    /// Bytes of one memory unit (the agents' `memoryUnit`); a claim's memory is counted in
    /// these, rounded up.
    pub memory_unit_bytes: u64,
}

impl ClaimSettings {
    /// Whether any class is named (the extender then follows claims).
    pub fn enabled(&self) -> bool {
        !self.classes.is_empty() && self.memory_unit_bytes > 0
    }
}

/// A positive quantity in bytes (a fraction of a byte rounds up), or `None`.
fn quantity_bytes(text: &str) -> Option<u64> {
    let milli = baleen_k8s::quantity::quantity_milli(text)?;
    if milli <= 0 {
        return None;
    }
    u64::try_from(milli.div_euclid(1000) + i128::from(milli.rem_euclid(1000) != 0)).ok()
}

/// The asks of one request of a claim, under `settings`; empty where the request is not one
/// the extender can count (see the module's documentation).
fn request_asks(request: &DeviceRequest, settings: &ClaimSettings) -> Vec<Ask> {
    let Some(exactly) = &request.exactly else { return Vec::new() };
    if !settings.classes.contains(&exactly.device_class_name) {
        return Vec::new();
    }
    if exactly.allocation_mode.as_deref().is_some_and(|m| m != "ExactCount") {
        return Vec::new();
    }
    let count = exactly.count.unwrap_or(1);
    let Ok(count) = u32::try_from(count) else { return Vec::new() };
    if count == 0 {
        return Vec::new();
    }
    let memory = exactly
        .capacity
        .as_ref()
        .and_then(|c| c.requests.as_ref())
        .and_then(|r| r.get(MEMORY))
        .map(|q| quantity_bytes(&q.0));
    match memory {
        None => vec![Ask::Gpus(count)],
        Some(Some(bytes)) => {
            let units = bytes.div_ceil(settings.memory_unit_bytes).max(1);
            match u32::try_from(units) {
                Ok(units) => (0..count).map(|_| Ask::GpuMemory(units)).collect(),
                Err(_) => Vec::new(),
            }
        }
        // A quantity the API server took but this reader cannot: not counted.
        Some(None) => Vec::new(),
    }
}

/// The asks of `claim`'s requests under `settings`, in request order.
pub fn claim_asks(claim: &ResourceClaim, settings: &ClaimSettings) -> Vec<Ask> {
    devices_asks(claim.spec.devices.as_ref(), settings)
}

/// The asks of the requests of a claim's `devices` under `settings`, in request order.
fn devices_asks(devices: Option<&DeviceClaim>, settings: &ClaimSettings) -> Vec<Ask> {
    devices
        .and_then(|d| d.requests.as_ref())
        .into_iter()
        .flatten()
        .flat_map(|r| request_asks(r, settings))
        .collect()
}

/// The names of the claims `pod` holds, in its namespace: named ones as named, those made from
/// a template as its status says (none yet while kube-controller-manager has not made them).
pub fn pod_claim_names(pod: &Pod) -> Vec<String> {
    let made: HashMap<&str, &str> = pod
        .status
        .resource_claim_statuses
        .iter()
        .flatten()
        .filter_map(|s| Some((s.name.as_str(), s.resource_claim_name.as_deref()?)))
        .collect();
    pod.spec
        .resource_claims
        .iter()
        .flatten()
        .filter_map(|c| match &c.resource_claim_name {
            Some(name) => Some(name.clone()),
            None => made.get(c.name.as_str()).map(|n| (*n).to_owned()),
        })
        .collect()
}

/// Objects (claims or claim templates) by `namespace/name`, each with its asks: empty for one
/// that asks for no counted class (known, so that a pod holding it is not taken for one whose
/// claim the watch has not shown yet).
#[derive(Debug, Default)]
struct AsksByKey(RwLock<HashMap<String, Arc<[Ask]>>>);

impl AsksByKey {
    fn key(meta: &ObjectMeta) -> Option<String> {
        Some(format!("{}/{}", meta.namespace.as_deref()?, meta.name.as_deref()?))
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, HashMap<String, Arc<[Ask]>>> {
        self.0.read().unwrap_or_else(PoisonError::into_inner)
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, HashMap<String, Arc<[Ask]>>> {
        self.0.write().unwrap_or_else(PoisonError::into_inner)
    }

    /// Stores the asks of the object of `meta`.
    fn apply(&self, meta: &ObjectMeta, asks: Vec<Ask>) {
        if let Some(key) = Self::key(meta) {
            self.write().insert(key, asks.into());
        }
    }

    /// Forgets the object of `meta`.
    fn remove(&self, meta: &ObjectMeta) {
        if let Some(key) = Self::key(meta) {
            self.write().remove(&key);
        }
    }

    /// Replaces every object with those of a fresh list, each with its asks.
    fn replace<'a>(&self, fresh: impl Iterator<Item = (&'a ObjectMeta, Vec<Ask>)>) {
        let fresh: HashMap<String, Arc<[Ask]>> =
            fresh.filter_map(|(meta, asks)| Some((Self::key(meta)?, asks.into()))).collect();
        *self.write() = fresh;
    }

    /// Whether `namespace/name` is known and asks for something counted.
    fn counted(&self, namespace: &str, name: &str) -> bool {
        self.read().get(&format!("{namespace}/{name}")).is_some_and(|a| !a.is_empty())
    }
}

/// The claims the extender knows, and the claim templates: `namespace/name` to their asks.
#[derive(Debug, Default)]
pub struct ClaimIndex {
    settings: ClaimSettings,
    asks: AsksByKey,
    /// ResourceClaimTemplates: what the webhook reads of a pod whose claims are not made yet.
    templates: AsksByKey,
    /// Pods the Pod watcher read before their claims arrived, by UID, as last read: read again
    /// when a claim arrives (at most [`MAX_PENDING`]).
    pending: std::sync::Mutex<HashMap<String, Pod>>,
}

/// The most pods kept waiting for their claims; past it the oldest waits are dropped (those
/// pods keep their containers' asks only until their next change).
pub const MAX_PENDING: usize = 4096;

impl ClaimIndex {
    /// An empty index counting claims as `settings` say.
    pub fn new(settings: ClaimSettings) -> Self {
        Self {
            settings,
            asks: AsksByKey::default(),
            templates: AsksByKey::default(),
            pending: std::sync::Mutex::default(),
        }
    }

    /// How claims are counted.
    pub fn settings(&self) -> &ClaimSettings {
        &self.settings
    }

    /// Stores `claim` (with no asks, where it asks for no counted class).
    pub fn apply(&self, claim: &ResourceClaim) {
        self.asks.apply(&claim.metadata, claim_asks(claim, &self.settings));
    }

    /// Forgets `claim`.
    pub fn remove(&self, claim: &ResourceClaim) {
        self.asks.remove(&claim.metadata);
    }

    /// Replaces every claim with those of a fresh list.
    pub fn replace(&self, claims: &[ResourceClaim]) {
        self.asks.replace(claims.iter().map(|c| (&c.metadata, claim_asks(c, &self.settings))));
    }

    /// Keeps `pod` (read before one of its claims arrived) to be read again when it does.
    pub fn note_pending(&self, pod: &Pod) {
        let mut pending = self.pending.lock().unwrap_or_else(PoisonError::into_inner);
        if pending.len() >= MAX_PENDING && !pending.contains_key(&pod.metadata.uid) {
            tracing::warn!(
                pods = pending.len(),
                "too many pods wait for their DRA claims: forgetting the waits"
            );
            pending.clear();
        }
        pending.insert(pod.metadata.uid.clone(), pod.clone());
    }

    /// Forgets the wait of the pod `uid` (read with its claims, or gone).
    pub fn forget_pending(&self, uid: &str) {
        self.pending.lock().unwrap_or_else(PoisonError::into_inner).remove(uid);
    }

    /// The pods waiting for claims whose claims are all known now, taken out of the wait.
    pub fn resolved(&self) -> Vec<Pod> {
        let mut pending = self.pending.lock().unwrap_or_else(PoisonError::into_inner);
        let ready: Vec<String> = pending
            .iter()
            .filter(|(_, p)| self.asks_of(p).is_ok())
            .map(|(u, _)| u.clone())
            .collect();
        ready.iter().filter_map(|u| pending.remove(u)).collect()
    }

    /// The asks of `template`'s claims.
    fn template_asks(&self, template: &ResourceClaimTemplate) -> Vec<Ask> {
        devices_asks(template.spec.spec.devices.as_ref(), &self.settings)
    }

    /// Stores `template` (with no asks, where it asks for no counted class).
    pub fn apply_template(&self, template: &ResourceClaimTemplate) {
        self.templates.apply(&template.metadata, self.template_asks(template));
    }

    /// Forgets `template`.
    pub fn remove_template(&self, template: &ResourceClaimTemplate) {
        self.templates.remove(&template.metadata);
    }

    /// Replaces every template with those of a fresh list.
    pub fn replace_templates(&self, templates: &[ResourceClaimTemplate]) {
        self.templates.replace(templates.iter().map(|t| (&t.metadata, self.template_asks(t))));
    }

    /// Whether a pod of `namespace` holding `claims` (its `spec.resourceClaims`) holds one that
    /// asks for a counted class, by the claim it names or the template it names: what the
    /// webhook sends to baleen's scheduler.
    pub fn holds_counted(
        &self,
        namespace: &str,
        claims: &[crate::protocol::PodResourceClaim],
    ) -> bool {
        claims.iter().any(|c| match (&c.resource_claim_name, &c.resource_claim_template_name) {
            (Some(name), _) => self.asks.counted(namespace, name),
            (None, Some(t)) => self.templates.counted(namespace, t),
            (None, None) => false,
        })
    }

    /// What `pod`'s claims ask, in the order the pod names them; empty for a pod without claims
    /// of a counted class. Where the extender judges claims, a claim the watch has not shown
    /// yet (or one kube-controller-manager has not made yet) is an error: kube-scheduler
    /// calls for a pod as soon as its claims exist, a few milliseconds before the watch may
    /// bring them, and a pod judged without its claim would be placed as one asking nothing.
    pub fn asks_of(&self, pod: &Pod) -> Result<Vec<Ask>, String> {
        let entries = pod.spec.resource_claims.as_deref().unwrap_or_default();
        if entries.is_empty() || !self.settings.enabled() {
            return Ok(Vec::new());
        }
        let names = pod_claim_names(pod);
        if names.len() < entries.len() {
            let made: BTreeSet<&str> = pod
                .status
                .resource_claim_statuses
                .iter()
                .flatten()
                .map(|s| s.name.as_str())
                .collect();
            // An entry whose status has no claim name needs none (as kube-scheduler reads it).
            if let Some(e) = entries
                .iter()
                .find(|e| e.resource_claim_name.is_none() && !made.contains(e.name.as_str()))
            {
                return Err(format!("the claim of its entry {:?} is not made yet", e.name));
            }
        }
        let map = self.asks.read();
        // A claim two of the pod's entries name counts once.
        let mut seen = BTreeSet::new();
        let mut asks = Vec::new();
        for name in names.iter().filter(|n| seen.insert(n.as_str())) {
            let key = format!("{}/{name}", pod.metadata.namespace);
            match map.get(&key) {
                Some(a) => asks.extend(a.iter().cloned()),
                None => return Err(format!("its claim {key} is not known to the extender yet")),
            }
        }
        Ok(asks)
    }

    /// How many claims are known.
    pub fn len(&self) -> usize {
        self.asks.read().len()
    }

    /// Whether none is.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Follows every ResourceClaim and ResourceClaimTemplate into `extender`'s index until
/// `shutdown` (`resource.k8s.io/v1`: list and watch on `resourceclaims` and
/// `resourceclaimtemplates`); a pod read before its claims arrived is read again, into the
/// cluster view and the target workload, when they have.
pub async fn watch(
    client: kube::Client,
    extender: Arc<crate::service::Extender>,
    shutdown: CancellationToken,
) {
    let index = extender.claims.clone();
    let domain = extender.settings().domain.clone();
    let claims = baleen_k8s::watch::follow(
        Api::<ResourceClaim>::all(client.clone()),
        watcher::Config::default(),
        "ResourceClaims",
        &shutdown,
        |c| {
            match c {
                Change::Listed(claims) => index.replace(&claims),
                Change::Applied(claim) => index.apply(&claim),
                Change::Deleted(claim) => index.remove(&claim),
            }
            for pod in index.resolved() {
                let entry = crate::cluster::PodEntry::with_claims(&pod, &domain, &index);
                let running = (!entry.finished).then(|| entry.demand.clone());
                let uid = pod.metadata.uid.clone();
                extender
                    .cluster
                    .write()
                    .unwrap_or_else(PoisonError::into_inner)
                    .set_pod(&uid, entry);
                if let Some(demand) = running {
                    extender.learn(&uid, &demand);
                }
            }
        },
    );
    let templates = baleen_k8s::watch::follow(
        Api::<ResourceClaimTemplate>::all(client),
        watcher::Config::default(),
        "ResourceClaimTemplates",
        &shutdown,
        |c| match c {
            Change::Listed(templates) => index.replace_templates(&templates),
            Change::Applied(template) => index.apply_template(&template),
            Change::Deleted(template) => index.remove_template(&template),
        },
    );
    tokio::join!(claims, templates);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings() -> ClaimSettings {
        ClaimSettings { classes: vec!["gpu.example.com".into()], memory_unit_bytes: 1 << 30 }
    }

    fn claim(name: &str, requests: serde_json::Value) -> ResourceClaim {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": "ns"},
            "spec": {"devices": {"requests": requests}}
        }))
        .expect("claim")
    }

    fn pod(spec_claims: serde_json::Value, statuses: serde_json::Value) -> Pod {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "p", "namespace": "ns", "uid": "u"},
            "spec": {"containers": [], "resourceClaims": spec_claims},
            "status": {"resourceClaimStatuses": statuses}
        }))
        .expect("pod")
    }

    #[test]
    fn memory_shares_round_up_to_units_and_no_capacity_is_whole_gpus() {
        let c = claim(
            "c",
            serde_json::json!([
                {"name": "a", "exactly": {"deviceClassName": "gpu.example.com",
                    "capacity": {"requests": {"memory": "1536Mi"}}}},
                {"name": "b", "exactly": {"deviceClassName": "gpu.example.com", "count": 2}},
                {"name": "other", "exactly": {"deviceClassName": "nic.example.com"}},
                {"name": "all", "exactly": {"deviceClassName": "gpu.example.com",
                    "allocationMode": "All"}},
                {"name": "list", "firstAvailable": [
                    {"name": "x", "deviceClassName": "gpu.example.com"}]}
            ]),
        );
        assert_eq!(claim_asks(&c, &settings()), [Ask::GpuMemory(2), Ask::Gpus(2)]);
    }

    #[test]
    fn a_pods_claims_are_found_by_name_and_through_its_status() {
        let index = ClaimIndex::new(settings());
        let share = serde_json::json!([{"name": "r", "exactly": {
            "deviceClassName": "gpu.example.com", "capacity": {"requests": {"memory": "4Gi"}}}}]);
        index.apply(&claim("named", share.clone()));
        index.apply(&claim("p-gpu-x7k2", share));
        index.apply(&claim(
            "nic",
            serde_json::json!([{"name": "n", "exactly": {
            "deviceClassName": "nic.example.com"}}]),
        ));
        assert_eq!(index.len(), 3, "a claim of no counted class is known, asking nothing");
        let p = |statuses: serde_json::Value| {
            pod(
                serde_json::json!([
                    {"name": "a", "resourceClaimName": "named"},
                    {"name": "b", "resourceClaimTemplateName": "t"},
                    {"name": "d", "resourceClaimName": "nic"}
                ]),
                statuses,
            )
        };
        let made = p(serde_json::json!([{"name": "b", "resourceClaimName": "p-gpu-x7k2"}]));
        assert_eq!(index.asks_of(&made), Ok(vec![Ask::GpuMemory(4), Ask::GpuMemory(4)]));
        // `b`'s claim not made yet: no answer without it (kube-scheduler asks again).
        let e = index.asks_of(&p(serde_json::json!([]))).expect_err("not made");
        assert!(e.contains("\"b\" is not made yet"), "{e}");
        // A claim the watch has not shown (or no longer holds).
        index.remove(&claim("named", serde_json::json!([])));
        let e = index.asks_of(&made).expect_err("not seen");
        assert!(e.contains("ns/named is not known"), "{e}");
        index.replace(&[]);
        assert!(index.asks_of(&made).is_err());
        // Where the extender judges no claims, a pod's claims ask nothing of it.
        let off = ClaimIndex::new(ClaimSettings::default());
        assert_eq!(off.asks_of(&made), Ok(vec![]));
    }

    #[test]
    fn a_pod_read_before_its_claim_is_read_again_when_the_claim_arrives() {
        let index = ClaimIndex::new(settings());
        let p = pod(
            serde_json::json!([{"name": "b", "resourceClaimTemplateName": "t"}]),
            serde_json::json!([{"name": "b", "resourceClaimName": "p-gpu-1"}]),
        );
        assert!(index.asks_of(&p).is_err());
        index.note_pending(&p);
        assert!(index.resolved().is_empty(), "its claim has not arrived");
        index.apply(&claim(
            "p-gpu-1",
            serde_json::json!([{"name": "r", "exactly": {
            "deviceClassName": "gpu.example.com", "count": 1}}]),
        ));
        let ready = index.resolved();
        assert_eq!(ready.len(), 1);
        assert_eq!(index.asks_of(&ready[0]), Ok(vec![Ask::Gpus(1)]));
        assert!(index.resolved().is_empty(), "taken out of the wait");
        index.note_pending(&p);
        index.forget_pending("u");
        assert!(index.resolved().is_empty(), "a forgotten wait is not read again");
    }

    #[test]
    fn the_webhook_knows_a_pod_by_the_claims_and_templates_it_names() {
        let index = ClaimIndex::new(settings());
        let template = |name: &str, class: &str| -> ResourceClaimTemplate {
            serde_json::from_value(serde_json::json!({
                "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
                "metadata": {"name": name, "namespace": "ns"},
                "spec": {"spec": {"devices": {"requests": [
                    {"name": "r", "exactly": {"deviceClassName": class}}]}}}
            }))
            .expect("template")
        };
        index.apply_template(&template("gpu", "gpu.example.com"));
        index.apply_template(&template("nic", "nic.example.com"));
        index.apply(&claim(
            "shared",
            serde_json::json!([{"name": "r", "exactly": {
            "deviceClassName": "gpu.example.com", "count": 2}}]),
        ));
        let refs = |v: serde_json::Value| -> Vec<crate::protocol::PodResourceClaim> {
            serde_json::from_value(v).expect("refs")
        };
        let by_template =
            refs(serde_json::json!([{"name": "a", "resourceClaimTemplateName": "gpu"}]));
        assert!(index.holds_counted("ns", &by_template));
        assert!(!index.holds_counted("other", &by_template), "templates are namespaced");
        assert!(!index.holds_counted(
            "ns",
            &refs(serde_json::json!([
            {"name": "a", "resourceClaimTemplateName": "nic"}]))
        ));
        assert!(index.holds_counted(
            "ns",
            &refs(serde_json::json!([
            {"name": "a", "resourceClaimTemplateName": "nic"},
            {"name": "b", "resourceClaimName": "shared"}]))
        ));
        index.replace_templates(&[]);
        assert!(!index.holds_counted("ns", &by_template));
        index.apply_template(&template("gpu", "gpu.example.com"));
        index.remove_template(&template("gpu", "gpu.example.com"));
        assert!(!index.holds_counted("ns", &by_template));
    }
}
