//! The DRA service socket through tonic's own client, both versions, over a preparer with an
//! in-memory claim source and ledger: what is answered, what is written to the CDI directory,
//! what is asked of the API server, and that nothing stays half-prepared.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use baleen_dra::cdi::{Edits, SpecDir};
use baleen_dra::claims::{ClaimAllocation, ClaimRef, Consumer};
use baleen_dra::service::{self, Booked, Bookings, ClaimSource, Preparer};
use baleen_proto::dra::{v1, v1beta1};
use k8s_openapi::api::resource::v1::ResourceClaim;
use serde_json::json;
use tokio_util::sync::CancellationToken;

const DRIVER: &str = "gpu.example.com";

#[derive(Default)]
struct Claims {
    by_name: Mutex<BTreeMap<(String, String), ResourceClaim>>,
    gets: AtomicUsize,
}

struct Source(Arc<Claims>);

impl ClaimSource for Source {
    async fn get(&self, claim: &ClaimRef) -> Result<Option<ResourceClaim>, String> {
        self.0.gets.fetch_add(1, Ordering::SeqCst);
        let key = (claim.namespace.clone(), claim.name.clone());
        Ok(self.0.by_name.lock().expect("lock").get(&key).cloned())
    }
}

/// A ledger of one GPU of 10 units of 1 GiB: shares are summed, never past 10.
#[derive(Default)]
struct Ledger {
    held: Mutex<BTreeMap<String, (u64, Vec<Booked>)>>,
}

impl Bookings for Ledger {
    fn booked(&self, uid: &str) -> Option<Vec<Booked>> {
        self.held.lock().expect("lock").get(uid).map(|(_, b)| b.clone())
    }

    fn book(&self, a: &ClaimAllocation, _: &[Consumer]) -> Result<Vec<Booked>, String> {
        let mut held = self.held.lock().expect("lock");
        if let Some((_, b)) = held.get(&a.claim.uid) {
            return Ok(b.clone());
        }
        let used: u64 = held.values().map(|(u, _)| u).sum();
        let asked: u64 = a.devices.iter().map(|d| d.memory_bytes.unwrap_or(10 << 30) >> 30).sum();
        if used + asked > 10 {
            return Err(format!("{asked} GiB asked, {} GiB free", 10 - used));
        }
        let booked: Vec<Booked> = a
            .devices
            .iter()
            .map(|d| Booked {
                request: d.request.clone(),
                device: d.device.clone(),
                share_id: d.share_id.clone(),
                edits: Edits {
                    env: vec![format!(
                        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0={}M",
                        d.memory_bytes.unwrap_or(10 << 30) >> 20
                    )],
                    ..Edits::default()
                },
                other_cdi_ids: vec!["nvidia.com/gpu=GPU-0".into()],
            })
            .collect();
        held.insert(a.claim.uid.clone(), (asked, booked.clone()));
        Ok(booked)
    }

    fn release(&self, uid: &str) -> Result<bool, String> {
        Ok(self.held.lock().expect("lock").remove(uid).is_some())
    }
}

fn claim(name: &str, uid: &str, memory: &str, share: &str) -> ResourceClaim {
    serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": "team-a", "uid": uid},
        "spec": {},
        "status": {
            "allocation": {"devices": {"results": [{
                "request": "gpu", "driver": DRIVER, "pool": "node-a", "device": "gpu-0",
                "consumedCapacity": {"memory": memory}, "shareID": share
            }]}},
            "reservedFor": [{"resource": "pods", "name": "p", "uid": "pod-uid"}]
        }
    }))
    .expect("a claim")
}

struct Setup {
    claims: Arc<Claims>,
    ledger: Arc<Ledger>,
    specs: SpecDir,
    socket: std::path::PathBuf,
    token: CancellationToken,
    _dir: tempfile::TempDir,
}

async fn setup() -> Setup {
    let dir = tempfile::tempdir().expect("tempdir");
    let claims = Arc::new(Claims::default());
    let ledger = Arc::new(Ledger::default());
    let specs = SpecDir::new(dir.path().join("cdi"), "gpu.example.com/claim");
    let preparer =
        Preparer::new(DRIVER, "node-a", Source(claims.clone()), ledger.clone(), specs.clone());
    let socket = dir.path().join("dra.sock");
    let token = CancellationToken::new();
    let served = service::serve(&socket, Arc::new(preparer), None, token.clone()).expect("bound");
    tokio::spawn(served);
    Setup { claims, ledger, specs, socket, token, _dir: dir }
}

impl Setup {
    fn put(&self, c: ResourceClaim) {
        let key = (
            c.metadata.namespace.clone().unwrap_or_default(),
            c.metadata.name.clone().unwrap_or_default(),
        );
        self.claims.by_name.lock().expect("lock").insert(key, c);
    }

    async fn v1(&self) -> v1::dra_plugin_client::DraPluginClient<tonic::transport::Channel> {
        let channel = baleen_device_plugin::uds::connect(&self.socket, Duration::from_secs(5))
            .await
            .expect("connected");
        v1::dra_plugin_client::DraPluginClient::new(channel)
    }

    async fn v1beta1(
        &self,
    ) -> v1beta1::dra_plugin_client::DraPluginClient<tonic::transport::Channel> {
        let channel = baleen_device_plugin::uds::connect(&self.socket, Duration::from_secs(5))
            .await
            .expect("connected");
        v1beta1::dra_plugin_client::DraPluginClient::new(channel)
    }
}

fn asked(name: &str, uid: &str) -> v1::Claim {
    v1::Claim { namespace: "team-a".into(), name: name.into(), uid: uid.into() }
}

#[tokio::test]
async fn a_share_is_prepared_once_answered_again_without_the_api_and_unprepared_from_the_ledger() {
    let s = setup().await;
    s.put(claim("c1", "uid-1", "4Gi", "s1"));
    let mut client = s.v1().await;
    let answer = client
        .node_prepare_resources(v1::NodePrepareResourcesRequest {
            claims: vec![asked("c1", "uid-1")],
        })
        .await
        .expect("answered")
        .into_inner();
    let entry = &answer.claims["uid-1"];
    assert_eq!(entry.error, "");
    assert_eq!(entry.devices.len(), 1);
    let d = &entry.devices[0];
    assert_eq!((d.pool_name.as_str(), d.device_name.as_str()), ("node-a", "gpu-0"));
    assert_eq!(d.request_names, ["gpu"]);
    assert_eq!(d.share_id.as_deref(), Some("s1"));
    assert_eq!(d.cdi_device_ids, ["nvidia.com/gpu=GPU-0", "gpu.example.com/claim=uid-1-gpu-0"]);
    let spec = s.specs.read("uid-1").expect("readable").expect("written");
    assert_eq!(spec.devices[0].container_edits.env, ["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=4096M"]);
    assert_eq!(s.claims.gets.load(Ordering::SeqCst), 1);

    // Asked again (the kubelet retries, or restarted): the same answer, no GET, and a spec lost
    // meanwhile (a tmpfs /var/run) written back.
    s.specs.remove("uid-1").expect("removed");
    let again = client
        .node_prepare_resources(v1::NodePrepareResourcesRequest {
            claims: vec![asked("c1", "uid-1")],
        })
        .await
        .expect("answered")
        .into_inner();
    assert_eq!(again, answer);
    assert_eq!(s.claims.gets.load(Ordering::SeqCst), 1, "answered from the ledger");
    assert!(s.specs.read("uid-1").expect("readable").is_some(), "spec written back");

    // The claim deleted from the API server: Unprepare works from the ledger alone.
    s.claims.by_name.lock().expect("lock").clear();
    let gone = client
        .node_unprepare_resources(v1::NodeUnprepareResourcesRequest {
            claims: vec![asked("c1", "uid-1")],
        })
        .await
        .expect("answered")
        .into_inner();
    assert_eq!(gone.claims["uid-1"].error, "");
    assert!(s.ledger.booked("uid-1").is_none());
    assert!(s.specs.read("uid-1").expect("readable").is_none(), "spec removed");
    // Unprepare of a claim not held (again) is not an error.
    let twice = client
        .node_unprepare_resources(v1::NodeUnprepareResourcesRequest {
            claims: vec![asked("c1", "uid-1")],
        })
        .await
        .expect("answered")
        .into_inner();
    assert_eq!(twice.claims["uid-1"].error, "");
    s.token.cancel();
}

#[tokio::test]
async fn each_claim_of_a_batch_answers_for_itself() {
    let s = setup().await;
    s.put(claim("fits", "uid-1", "8Gi", "a"));
    s.put(claim("too-big", "uid-2", "8Gi", "b"));
    s.put(claim("recreated", "uid-new", "1Gi", "c"));
    let mut client = s.v1().await;
    let answer = client
        .node_prepare_resources(v1::NodePrepareResourcesRequest {
            claims: vec![
                asked("fits", "uid-1"),
                asked("too-big", "uid-2"),
                asked("recreated", "uid-old"),
                asked("missing", "uid-4"),
                v1::Claim { namespace: String::new(), name: "x".into(), uid: "uid-5".into() },
            ],
        })
        .await
        .expect("answered")
        .into_inner();
    assert_eq!(answer.claims.len(), 5, "every claim has an entry: {answer:?}");
    let error = |uid: &str| answer.claims[uid].error.clone();
    // One of the two 8 GiB claims fits the 10 GiB GPU; the other is refused with the reason.
    let (ok, refused): (Vec<_>, Vec<_>) =
        ["uid-1", "uid-2"].iter().partition(|u| error(u).is_empty());
    assert_eq!((ok.len(), refused.len()), (1, 1), "{answer:?}");
    assert!(error(refused[0]).contains("8 GiB asked, 2 GiB free"), "{}", error(refused[0]));
    assert!(error("uid-old").contains("deleted and created again"), "{}", error("uid-old"));
    assert!(error("uid-4").contains("no such claim"), "{}", error("uid-4"));
    assert!(error("uid-5").contains("namespace, name and UID"), "{}", error("uid-5"));
    assert!(answer.claims["uid-old"].devices.is_empty());
    assert_eq!(s.specs.claims().expect("listed"), [ok[0]], "specs only for what was prepared");
    s.token.cancel();
}

#[tokio::test]
async fn a_spec_that_cannot_be_written_leaves_nothing_booked() {
    let s = setup().await;
    // The CDI directory is a file: nothing can be written there.
    std::fs::write(s.specs.dir(), "not a directory").expect("file");
    s.put(claim("c1", "uid-1", "4Gi", "s1"));
    let answer = s
        .v1()
        .await
        .node_prepare_resources(v1::NodePrepareResourcesRequest {
            claims: vec![asked("c1", "uid-1")],
        })
        .await
        .expect("answered")
        .into_inner();
    assert!(answer.claims["uid-1"].error.contains("CDI spec"), "{answer:?}");
    assert!(s.ledger.booked("uid-1").is_none(), "the booking was given back");
    s.token.cancel();
}

#[tokio::test]
async fn v1beta1_is_served_on_the_same_socket_without_share_ids() {
    let s = setup().await;
    s.put(claim("c1", "uid-1", "4Gi", "s1"));
    let mut client = s.v1beta1().await;
    let answer = client
        .node_prepare_resources(v1beta1::NodePrepareResourcesRequest {
            claims: vec![v1beta1::Claim {
                namespace: "team-a".into(),
                name: "c1".into(),
                uid: "uid-1".into(),
            }],
        })
        .await
        .expect("answered")
        .into_inner();
    let d = &answer.claims["uid-1"].devices[0];
    assert_eq!(d.cdi_device_ids, ["nvidia.com/gpu=GPU-0", "gpu.example.com/claim=uid-1-gpu-0"]);
    let done = client
        .node_unprepare_resources(v1beta1::NodeUnprepareResourcesRequest {
            claims: vec![v1beta1::Claim {
                namespace: "team-a".into(),
                name: "c1".into(),
                uid: "uid-1".into(),
            }],
        })
        .await
        .expect("answered")
        .into_inner();
    assert_eq!(done.claims["uid-1"].error, "");
    assert!(s.ledger.booked("uid-1").is_none());
    s.token.cancel();
}
