//! Reconciliation with the kubelet's pod-resources API, the truth for what is allocated: the
//! kubelet never tells a device plugin when a pod ends, and a checkpoint can be lost or stale.
//!
//! [`reconcile`] compares the ledger with the kubelet's per-container device lists: allocations
//! of containers that are gone are released (unless younger than a grace period, since the
//! kubelet records an allocation only after Allocate returns), and allocations the kubelet
//! knows but the ledger lacks are restored. [`fetch`] reads the kubelet's lists over its socket.
//!
//! A kubelet that restarted while the API server was unreachable lists only its static pods
//! until it syncs: its list can be empty for minutes while every container runs. So an
//! allocation the kubelet listed before is released only once the miss is confirmed
//! ([`Witness`]): the kubelet lists its container without it, or the API server says its pod
//! ended (gone from the node, or Succeeded/Failed), or, where the API cannot tell, the kubelet
//! has been back long enough to have synced (`reconcile.kubeletSettle`). A miss the API
//! contradicts (it says the pod runs) is held for as long as it does.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::time::Duration;

use baleen_proto::podresources::v1 as api;

use crate::ledger::{AllocationRecord, DeviceLedger, Holder};

/// One container's devices of one resource, as the kubelet reports them. A container that
/// holds no device is listed once with an empty resource and no device IDs (so that a missing
/// allocation can be told from a missing container).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KubeletAllocation {
    /// Pod namespace.
    pub namespace: String,
    /// Pod name.
    pub pod: String,
    /// Container name.
    pub container: String,
    /// The resource.
    pub resource: String,
    /// The device IDs, sorted.
    pub device_ids: Vec<String>,
}

/// What a reconciliation changed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Report {
    /// Allocations released (their containers are gone).
    pub released: Vec<AllocationRecord>,
    /// Allocations restored from the kubelet's lists.
    pub restored: Vec<AllocationRecord>,
    /// Kubelet allocations the ledger refused (a conflict across views), with why.
    pub refused: Vec<(AllocationRecord, String)>,
    /// Allocations never listed by the kubelet but kept because they are younger than the grace.
    pub kept_young: usize,
    /// Allocations the kubelet listed for the first time.
    pub newly_listed: usize,
    /// Allocations whose recorded holder changed (first listed, or listed for another
    /// container).
    pub holders_changed: usize,
    /// Allocations the kubelet no longer lists, kept because the miss is not confirmed, with
    /// why.
    pub held: Vec<(AllocationRecord, String)>,
}

impl Report {
    /// Whether the ledger changed.
    pub fn changed(&self) -> bool {
        !self.released.is_empty()
            || !self.restored.is_empty()
            || self.newly_listed > 0
            || self.holders_changed > 0
    }
}

/// What the API server says of a pod.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PodFate {
    /// Bound to the node and not finished (pending or running).
    Runs,
    /// Succeeded or Failed.
    Ended,
}

/// What is known besides the kubelet's list when it misses an allocation it listed before.
#[derive(Debug, Clone, Default)]
pub struct Witness {
    /// The kubelet (re)appeared moments ago (it registered again, answered again after an
    /// outage, or the agent has just started): its list may not hold all its pods yet.
    pub kubelet_settling: bool,
    /// The node's pods as the API server says, `(namespace, name)` -> fate; `None` when the API
    /// cannot tell (no API, or its view not listed yet). A pod absent from it has ended.
    pub pods: Option<BTreeMap<(String, String), PodFate>>,
}

impl Witness {
    /// Nothing but the kubelet, which may be settling: no listed allocation is released.
    pub fn settling() -> Self {
        Self { kubelet_settling: true, pods: None }
    }

    /// Whether the miss of `record` (an allocation the kubelet listed before) is confirmed,
    /// given the containers the list shows; if not, why it is held.
    fn confirms(
        &self,
        record: &AllocationRecord,
        listed: &BTreeSet<(&str, &str, &str)>,
    ) -> Result<(), String> {
        let holder = record.holder.as_ref();
        if let Some(h) = holder
            && listed.contains(&(h.namespace.as_str(), h.pod.as_str(), h.container.as_str()))
        {
            return Ok(()); // the kubelet lists its container without it
        }
        let fate = holder.zip(self.pods.as_ref()).map(|(h, pods)| {
            pods.get(&(h.namespace.clone(), h.pod.clone())).copied().unwrap_or(PodFate::Ended)
        });
        match (fate, holder) {
            (Some(PodFate::Ended), _) => Ok(()),
            (Some(PodFate::Runs), Some(h)) => Err(format!(
                "the kubelet's list misses it, but the API server says its pod {}/{} runs on this node",
                h.namespace, h.pod
            )),
            _ if self.kubelet_settling => Err(
                "the kubelet's list misses it, but the kubelet has just (re)appeared and may not have synced its pods"
                    .to_owned(),
            ),
            _ => Ok(()),
        }
    }
}

/// Consecutive lists that must miss an allocation the kubelet listed before it is released: a
/// kubelet that has just restarted may answer `List` before it has synced its pods, and one
/// missing entry in one answer must not hand a running container's GPU out again.
pub const RELEASE_AFTER_MISSES: u32 = 2;

/// Brings `state` in line with the kubelet's `allocations` (only resources the node serves
/// count). An allocation the kubelet listed before is released once [`RELEASE_AFTER_MISSES`]
/// lists in a row have not shown it and `witness` confirms the miss (else it is held, and said
/// why in the report); one it has never listed is kept until `grace` seconds after it was
/// granted (the kubelet records an allocation only after Allocate returns, and `List` omits
/// ordinary init containers). Each listed allocation's holder is recorded. `now` is in seconds.
pub fn reconcile(
    state: &mut DeviceLedger,
    allocations: &[KubeletAllocation],
    now: u64,
    grace: u64,
    witness: &Witness,
) -> Report {
    let truth: BTreeMap<(String, Vec<String>), Holder> = allocations
        .iter()
        .filter(|a| state.view_for(&a.resource).is_some() && !a.device_ids.is_empty())
        .map(|a| {
            let mut ids = a.device_ids.clone();
            ids.sort();
            let holder = Holder {
                namespace: a.namespace.clone(),
                pod: a.pod.clone(),
                container: a.container.clone(),
            };
            ((a.resource.clone(), ids), holder)
        })
        .collect();
    let containers: BTreeSet<(&str, &str, &str)> = allocations
        .iter()
        .map(|a| (a.namespace.as_str(), a.pod.as_str(), a.container.as_str()))
        .collect();
    let key = |r: &AllocationRecord| (r.resource.clone(), r.device_ids.clone());
    let mut report = Report::default();
    let mut young = 0;
    let mut held = Vec::new();
    report.released = state.note_listing(
        |r| truth.contains_key(&key(r)),
        |r, misses| {
            if r.listed {
                misses >= RELEASE_AFTER_MISSES
                    && match witness.confirms(r, &containers) {
                        Ok(()) => true,
                        Err(why) => {
                            held.push((r.clone(), why));
                            false
                        }
                    }
            } else {
                let keep = r.allocated_at.saturating_add(grace) > now;
                young += usize::from(keep);
                !keep
            }
        },
    );
    report.kept_young = young;
    report.held = held;
    let held_keys: BTreeSet<(String, Vec<String>)> = state.records().iter().map(key).collect();
    let missing: Vec<AllocationRecord> = truth
        .iter()
        .filter(|(k, _)| !held_keys.contains(*k))
        .map(|((resource, device_ids), holder)| AllocationRecord {
            resource: resource.clone(),
            device_ids: device_ids.clone(),
            allocated_at: now,
            listed: true,
            holder: Some(holder.clone()),
            claim: None,
        })
        .collect();
    let refused = state.restore(&missing);
    report.restored =
        missing.into_iter().filter(|m| !refused.iter().any(|(r, _)| r == m)).collect();
    report.refused = refused;
    report.newly_listed = state.mark_listed(|r| truth.contains_key(&key(r)));
    report.holders_changed = state.set_holders(|r| truth.get(&key(r)).cloned());
    report
}

/// Why the kubelet's lists could not be read.
#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    /// The socket does not answer.
    #[error("pod-resources socket {socket} not reachable")]
    Unreachable {
        /// The socket.
        socket: String,
        /// The cause.
        #[source]
        source: tonic::transport::Error,
    },
    /// The kubelet answered with an error.
    #[error("pod-resources List on {socket} failed: {status}")]
    List {
        /// The socket.
        socket: String,
        /// The kubelet's answer.
        status: tonic::Status,
    },
}

/// Reads every container's devices from the kubelet's pod-resources socket.
pub async fn fetch(socket: &Path, timeout: Duration) -> Result<Vec<KubeletAllocation>, FetchError> {
    let name = socket.display().to_string();
    let channel = baleen_device_plugin::uds::connect(socket, timeout)
        .await
        .map_err(|source| FetchError::Unreachable { socket: name.clone(), source })?;
    let mut client = api::pod_resources_lister_client::PodResourcesListerClient::new(channel);
    let response = client
        .list(api::ListPodResourcesRequest {})
        .await
        .map_err(|status| FetchError::List { socket: name, status })?
        .into_inner();
    let mut out = Vec::new();
    for pod in response.pod_resources {
        for container in pod.containers {
            if container.devices.is_empty() {
                out.push(KubeletAllocation {
                    namespace: pod.namespace.clone(),
                    pod: pod.name.clone(),
                    container: container.name.clone(),
                    resource: String::new(),
                    device_ids: Vec::new(),
                });
            }
            for devices in container.devices {
                let mut device_ids = devices.device_ids;
                device_ids.sort();
                out.push(KubeletAllocation {
                    namespace: pod.namespace.clone(),
                    pod: pod.name.clone(),
                    container: container.name.clone(),
                    resource: devices.resource_name,
                    device_ids,
                });
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inventory::{GpuInventory as _, simulated::SimulatedInventory};
    use crate::ledger::{View, ViewConfig};

    fn state() -> DeviceLedger {
        let path =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../packaging/examples/l4-4x-pcie.yaml");
        let inventory =
            SimulatedInventory::from_file(&path).expect("example").discover().expect("discover");
        DeviceLedger::new("n", &inventory, ViewConfig::default()).expect("state")
    }

    fn unit_ids(state: &DeviceLedger, gpu: usize, units: std::ops::Range<u32>) -> Vec<String> {
        let uuid = state.gpus().nth(gpu).expect("gpu").uuid.to_string();
        units.map(|n| format!("{uuid}::{n}")).collect()
    }

    fn kubelet(resource: &str, ids: Vec<String>) -> KubeletAllocation {
        KubeletAllocation {
            namespace: "ns".into(),
            pod: "p".into(),
            container: "c".into(),
            resource: resource.into(),
            device_ids: ids,
        }
    }

    #[test]
    fn releases_gone_restores_lost_keeps_young() {
        const MEM: &str = "awesome-ai-company.com/gpu-memory";
        let mut s = state();
        s.allocate(&View::GpuMemory, &unit_ids(&s, 0, 0..2), 100).expect("old, still running");
        s.allocate(&View::GpuMemory, &unit_ids(&s, 1, 0..2), 100).expect("old, gone");
        s.allocate(&View::GpuMemory, &unit_ids(&s, 2, 0..2), 995).expect("young, not yet listed");
        let truth = vec![
            kubelet(MEM, unit_ids(&s, 0, 0..2)),
            kubelet(MEM, unit_ids(&s, 3, 4..6)), // lost from the checkpoint
            kubelet("other.com/thing", vec!["x".into()]), // not ours
        ];
        let report = reconcile(&mut s, &truth, 1000, 30, &Witness::default());
        assert_eq!(report.released.len(), 1);
        assert_eq!(report.released[0].device_ids, unit_ids(&s, 1, 0..2));
        assert_eq!(report.restored.len(), 1);
        assert_eq!(report.restored[0].device_ids, unit_ids(&s, 3, 4..6));
        assert_eq!(report.kept_young, 1);
        assert!(report.refused.is_empty());
        assert_eq!(s.records().len(), 3);
        // Once old enough, the unlisted young one goes too; a second pass changes nothing else.
        let report = reconcile(&mut s, &truth, 2000, 30, &Witness::default());
        assert_eq!(report.released.len(), 1);
        assert!(report.restored.is_empty());
        let report = reconcile(&mut s, &truth, 3000, 30, &Witness::default());
        assert!(!report.changed());
    }

    #[test]
    fn unlisted_allocations_wait_for_the_grace_listed_ones_go_when_delisted() {
        const GPU: &str = "awesome-ai-company.com/gpu";
        let mut s = state();
        let gpu = |i: usize| s_gpu(&s, i);
        let (g0, g1) = (gpu(0), gpu(1));
        // An init container's whole GPU (never in List) and an app container's.
        s.allocate(&View::Gpu, std::slice::from_ref(&g0), 100).expect("init container");
        s.allocate(&View::Gpu, std::slice::from_ref(&g1), 100).expect("app container");
        let app = vec![kubelet(GPU, vec![g1.clone()])];
        let report = reconcile(&mut s, &app, 130, 600, &Witness::default());
        assert_eq!(report.newly_listed, 1);
        assert!(report.released.is_empty(), "the init container's GPU is kept within the grace");
        assert!(s.records().iter().any(|r| r.device_ids == [g1.clone()] && r.listed));
        // The app container ends: one list without it is not enough (a kubelet that has just
        // restarted may answer before it has synced its pods); the second releases it, though
        // young; the init one still waits.
        let report = reconcile(&mut s, &[], 139, 600, &Witness::default());
        assert!(report.released.is_empty(), "one miss keeps it");
        let report = reconcile(&mut s, &[], 140, 600, &Witness::default());
        assert_eq!(report.released.len(), 1);
        assert_eq!(report.released[0].device_ids, [g1]);
        assert_eq!(report.kept_young, 1);
        let report = reconcile(&mut s, &[], 700, 600, &Witness::default());
        assert_eq!(report.released.len(), 1, "after the grace");
        assert!(s.records().is_empty());
    }

    #[test]
    fn a_listing_that_shows_it_again_resets_the_misses() {
        const GPU: &str = "awesome-ai-company.com/gpu";
        let mut s = state();
        let g = s_gpu(&s, 0);
        s.allocate(&View::Gpu, std::slice::from_ref(&g), 100).expect("app container");
        let listed = vec![kubelet(GPU, vec![g.clone()])];
        reconcile(&mut s, &listed, 110, 600, &Witness::default());
        // Missed, shown, missed: never two in a row, never released.
        for (t, list) in [(111, &[][..]), (112, &listed[..]), (113, &[][..])] {
            assert!(
                reconcile(&mut s, list, t, 600, &Witness::default()).released.is_empty(),
                "at {t}"
            );
        }
        assert_eq!(
            reconcile(&mut s, &[], 114, 600, &Witness::default()).released.len(),
            1,
            "two in a row"
        );
    }

    /// Issue 22, item 1: a whole GPU held by a listed container, and a kubelet whose list goes
    /// empty (restarted while the API server was unreachable). Nothing is released until the
    /// miss is confirmed, each way a test.
    fn held_whole() -> (DeviceLedger, Vec<KubeletAllocation>) {
        const GPU: &str = "awesome-ai-company.com/gpu";
        let mut s = state();
        let g = s_gpu(&s, 0);
        s.allocate(&View::Gpu, std::slice::from_ref(&g), 100).expect("pod-w");
        let listed = vec![KubeletAllocation { pod: "w".into(), ..kubelet(GPU, vec![g]) }];
        let report = reconcile(&mut s, &listed, 110, 600, &Witness::default());
        assert_eq!((report.newly_listed, report.holders_changed), (1, 1));
        assert_eq!(
            s.records()[0].holder,
            Some(Holder { namespace: "ns".into(), pod: "w".into(), container: "c".into() })
        );
        (s, listed)
    }

    #[test]
    fn a_settling_kubelets_empty_list_releases_nothing_until_it_has_settled() {
        let (mut s, _) = held_whole();
        for t in 111..120 {
            let report = reconcile(&mut s, &[], t, 600, &Witness::settling());
            assert!(report.released.is_empty(), "at {t}");
        }
        let report = reconcile(&mut s, &[], 120, 600, &Witness::settling());
        assert_eq!(report.held.len(), 1);
        assert!(report.held[0].1.contains("just (re)appeared"), "{:?}", report.held);
        // Settled, nothing else to ask: the kubelet's word, two misses in a row, as before.
        let settled = Witness::default();
        assert_eq!(reconcile(&mut s, &[], 121, 600, &settled).released.len(), 1);
    }

    #[test]
    fn a_miss_the_api_contradicts_is_held_and_one_it_confirms_is_not() {
        let runs = |fate| Witness {
            kubelet_settling: false,
            pods: Some(BTreeMap::from([(("ns".to_owned(), "w".to_owned()), fate)])),
        };
        let (mut s, _) = held_whole();
        for t in 111..115 {
            let report = reconcile(&mut s, &[], t, 600, &runs(PodFate::Runs));
            assert!(report.released.is_empty(), "the API says pod-w runs: at {t}");
        }
        let report = reconcile(&mut s, &[], 115, 600, &runs(PodFate::Runs));
        assert!(report.held[0].1.contains("says its pod ns/w runs"), "{:?}", report.held);
        // The API says it ended: released, even while the kubelet settles.
        let ended = Witness { kubelet_settling: true, ..runs(PodFate::Ended) };
        assert_eq!(reconcile(&mut s, &[], 116, 600, &ended).released.len(), 1);
        // Gone from the API's view of the node: ended too.
        let (mut s, _) = held_whole();
        let gone = Witness { kubelet_settling: true, pods: Some(BTreeMap::new()) };
        reconcile(&mut s, &[], 111, 600, &gone);
        assert_eq!(reconcile(&mut s, &[], 112, 600, &gone).released.len(), 1);
    }

    #[test]
    fn a_kubelet_that_lists_the_container_without_it_confirms_the_miss() {
        let (mut s, _) = held_whole();
        // The kubelet lists pod-w's container c with no device (a new pod of the same name):
        // its GPU is gone, whatever the API says and however fresh the kubelet.
        let bare = vec![KubeletAllocation {
            pod: "w".into(),
            resource: String::new(),
            device_ids: Vec::new(),
            ..kubelet("", Vec::new())
        }];
        let contradicting = Witness {
            kubelet_settling: true,
            pods: Some(BTreeMap::from([(("ns".to_owned(), "w".to_owned()), PodFate::Runs)])),
        };
        reconcile(&mut s, &bare, 111, 600, &contradicting);
        let report = reconcile(&mut s, &bare, 112, 600, &contradicting);
        assert_eq!(report.released.len(), 1, "{report:?}");
    }

    #[test]
    fn an_allocation_of_no_known_holder_waits_for_the_kubelet_to_settle() {
        // Restored from a checkpoint written before holders were kept: listed, holder unknown.
        let mut s = state();
        let g = s_gpu(&s, 0);
        let record = AllocationRecord {
            resource: "awesome-ai-company.com/gpu".into(),
            device_ids: vec![g],
            allocated_at: 100,
            listed: true,
            holder: None,
            claim: None,
        };
        assert!(s.restore(std::slice::from_ref(&record)).is_empty());
        let api = Witness { kubelet_settling: true, pods: Some(BTreeMap::new()) };
        reconcile(&mut s, &[], 111, 600, &api);
        let report = reconcile(&mut s, &[], 112, 600, &api);
        assert!(report.released.is_empty(), "the API cannot be asked about nobody");
        assert_eq!(reconcile(&mut s, &[], 113, 600, &Witness::default()).released.len(), 1);
    }

    fn s_gpu(s: &DeviceLedger, i: usize) -> String {
        s.gpus().nth(i).expect("gpu").uuid.to_string()
    }

    #[test]
    fn a_kubelet_conflict_across_views_is_refused_and_reported() {
        let mut s = state();
        let gpu0 = s.gpus().next().expect("gpu").uuid.to_string();
        let truth = vec![
            kubelet("awesome-ai-company.com/gpu", vec![gpu0.clone()]),
            kubelet("awesome-ai-company.com/gpu-memory", unit_ids(&s, 0, 0..1)),
        ];
        let report = reconcile(&mut s, &truth, 10, 30, &Witness::default());
        assert_eq!(report.restored.len(), 1);
        assert_eq!(report.refused.len(), 1);
        assert!(report.refused[0].1.contains("held whole"), "{:?}", report.refused);
    }
}
