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
use k8s_openapi::api::resource::v1::{DeviceRequest, ResourceClaim};
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
    if !settings.classes.iter().any(|c| *c == exactly.device_class_name) {
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
    claim
        .spec
        .devices
        .as_ref()
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

/// The claims the extender knows: `namespace/name` to their asks (claims of no counted class
/// are kept out).
#[derive(Debug, Default)]
pub struct ClaimIndex {
    settings: ClaimSettings,
    asks: RwLock<HashMap<String, Arc<[Ask]>>>,
}

impl ClaimIndex {
    /// An empty index counting claims as `settings` say.
    pub fn new(settings: ClaimSettings) -> Self {
        Self { settings, asks: RwLock::default() }
    }

    /// How claims are counted.
    pub fn settings(&self) -> &ClaimSettings {
        &self.settings
    }

    fn key(claim: &ResourceClaim) -> Option<String> {
        Some(format!(
            "{}/{}",
            claim.metadata.namespace.as_deref()?,
            claim.metadata.name.as_deref()?
        ))
    }

    /// Stores `claim` (or forgets it, where it asks nothing counted).
    pub fn apply(&self, claim: &ResourceClaim) {
        let Some(key) = Self::key(claim) else { return };
        let asks = claim_asks(claim, &self.settings);
        let mut map = self.asks.write().unwrap_or_else(PoisonError::into_inner);
        if asks.is_empty() {
            map.remove(&key);
        } else {
            map.insert(key, asks.into());
        }
    }

    /// Forgets `claim`.
    pub fn remove(&self, claim: &ResourceClaim) {
        if let Some(key) = Self::key(claim) {
            self.asks.write().unwrap_or_else(PoisonError::into_inner).remove(&key);
        }
    }

    /// Replaces every claim with those of a fresh list.
    pub fn replace(&self, claims: &[ResourceClaim]) {
        let fresh: HashMap<String, Arc<[Ask]>> = claims
            .iter()
            .filter_map(|c| {
                let asks = claim_asks(c, &self.settings);
                (!asks.is_empty()).then(|| Some((Self::key(c)?, asks.into())))?
            })
            .collect();
        *self.asks.write().unwrap_or_else(PoisonError::into_inner) = fresh;
    }

    /// What `pod`'s claims ask, in the order the pod names them; empty for a pod without claims
    /// of a counted class (or whose claims are not known yet).
    pub fn asks_of(&self, pod: &Pod) -> Vec<Ask> {
        if pod.spec.resource_claims.as_ref().is_none_or(Vec::is_empty) {
            return Vec::new();
        }
        let names = pod_claim_names(pod);
        let map = self.asks.read().unwrap_or_else(PoisonError::into_inner);
        // A claim two of the pod's entries name counts once.
        let mut seen = BTreeSet::new();
        names
            .iter()
            .filter(|n| seen.insert(n.as_str()))
            .filter_map(|n| map.get(&format!("{}/{n}", pod.metadata.namespace)))
            .flat_map(|a| a.iter().cloned())
            .collect()
    }

    /// How many claims are known.
    pub fn len(&self) -> usize {
        self.asks.read().unwrap_or_else(PoisonError::into_inner).len()
    }

    /// Whether none is.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Follows every ResourceClaim into `index` until `shutdown` (`resource.k8s.io/v1`: list and
/// watch on `resourceclaims`).
pub async fn watch(client: kube::Client, index: Arc<ClaimIndex>, shutdown: CancellationToken) {
    baleen_k8s::watch::follow(
        Api::<ResourceClaim>::all(client),
        watcher::Config::default(),
        "ResourceClaims",
        &shutdown,
        |c| match c {
            Change::Listed(claims) => index.replace(&claims),
            Change::Applied(claim) => index.apply(&claim),
            Change::Deleted(claim) => index.remove(&claim),
        },
    )
    .await;
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
        assert_eq!(index.len(), 2, "a claim of no counted class is not kept");
        let p = pod(
            serde_json::json!([
                {"name": "a", "resourceClaimName": "named"},
                {"name": "b", "resourceClaimTemplateName": "t"},
                {"name": "c", "resourceClaimTemplateName": "t2"},
                {"name": "d", "resourceClaimName": "nic"}
            ]),
            // `c`'s claim is not made yet.
            serde_json::json!([{"name": "b", "resourceClaimName": "p-gpu-x7k2"}]),
        );
        assert_eq!(index.asks_of(&p), [Ask::GpuMemory(4), Ask::GpuMemory(4)]);
        index.remove(&claim("named", serde_json::json!([])));
        assert_eq!(index.asks_of(&p), [Ask::GpuMemory(4)]);
        index.replace(&[]);
        assert!(index.asks_of(&p).is_empty());
    }
}
