//! The agent as a DRA driver (`driver: dra`) against the fake API server (ResourceSlices,
//! ResourceClaims) and the kubelet's side of the DRA sockets: registration asked by a gRPC
//! C-core client under the kubelet's percent-encoded authority, Prepare and Unprepare through
//! tonic's client of both versions, the CDI specs written, a restart with prepared claims, and
//! the kubelet's wipe of the node's slices.

use std::path::Path;

use baleen_agent::dra::{DraConfig, DriverMode};
use baleen_agent::kube_api::KubeNodeApi;
use baleen_proto::dra::v1;
use baleen_proto::pluginregistration::v1 as reg;
use baleen_tests::dra_allocator::{Allocator, Ask, claim_status};
use baleen_tests::fake_apiserver::FakeApiServer;
use baleen_tests::fake_dra_kubelet::{self as dra_kubelet, FakeDraKubelet, c_core_call};
use prost::Message as _;
use serde_json::{Value, json};

use super::*;

const DRIVER: &str = "gpu.awesome-ai-company.com";

/// A node served as a DRA driver, its host paths under the test node's root.
async fn dra_node() -> Result<(TestNode, FakeApiServer)> {
    let mut node = TestNode::new("h200-8x-nvswitch.yaml", Backend::Simulated).await?;
    let root = node.config.state_dir.parent().context("a root")?.to_path_buf();
    let mut dra = DraConfig::new(DRIVER);
    dra.registry_dir = root.join("plugins_registry");
    dra.plugin_dir = root.join("plugins").join(DRIVER);
    dra.cdi_dir = root.join("run-cdi");
    std::fs::create_dir_all(&dra.registry_dir)?;
    node.config.driver = DriverMode::Dra(dra);
    let api = FakeApiServer::start(&[]).await?;
    api.put_node(json!({"metadata": {"name": "node-a", "uid": "node-a-uid"}}));
    Ok((node, api))
}

fn dra(node: &TestNode) -> Result<DraConfig> {
    match &node.config.driver {
        DriverMode::Dra(d) => Ok(d.clone()),
        DriverMode::DevicePlugin => anyhow::bail!("a DRA node"),
    }
}

async fn start(node: &TestNode, api: &FakeApiServer) -> Result<(Agent, CancellationToken)> {
    let client: Arc<dyn baleen_agent::kube_api::NodeApi> = KubeNodeApi::at(&api.url())?;
    node.start_with(Some(client)).await
}

/// The devices of the node's published slices, by name.
fn published(api: &FakeApiServer) -> std::collections::BTreeMap<String, Value> {
    api.resource_slices()
        .into_iter()
        .filter(|s| s["spec"]["nodeName"] == "node-a" && s["spec"]["driver"] == DRIVER)
        .flat_map(|s| s["spec"]["devices"].as_array().cloned().unwrap_or_default())
        .filter_map(|d| Some((d["name"].as_str()?.to_owned(), d)))
        .collect()
}

fn allocated_claim(name: &str, uid: &str, device: &str, memory: Option<&str>) -> Value {
    let mut result = json!({
        "request": "gpu", "driver": DRIVER, "pool": "node-a", "device": device, "shareID": format!("share-{uid}")
    });
    if let Some(m) = memory {
        result["consumedCapacity"] = json!({"memory": m});
    }
    json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": "team-a", "uid": uid},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": DRIVER}}]}},
        "status": {
            "allocation": {"devices": {"results": [result]}},
            "reservedFor": [{"resource": "pods", "name": format!("pod-{name}"), "uid": format!("pod-{uid}")}]
        }
    })
}

fn claim(name: &str, uid: &str) -> v1::Claim {
    v1::Claim { namespace: "team-a".into(), name: name.into(), uid: uid.into() }
}

async fn client(socket: &Path) -> Result<DraClient> {
    let channel = baleen_device_plugin::uds::connect(socket, WAIT).await?;
    Ok(v1::dra_plugin_client::DraPluginClient::new(channel))
}

type DraClient = v1::dra_plugin_client::DraPluginClient<tonic::transport::Channel>;

/// One NodePrepareResources batch of `claims`, as the kubelet sends it.
async fn prepare(
    c: &mut DraClient,
    claims: Vec<v1::Claim>,
) -> Result<v1::NodePrepareResourcesResponse> {
    Ok(c.node_prepare_resources(v1::NodePrepareResourcesRequest { claims }).await?.into_inner())
}

/// One NodeUnprepareResources batch of `claims`.
async fn unprepare(
    c: &mut DraClient,
    claims: Vec<v1::Claim>,
) -> Result<v1::NodeUnprepareResourcesResponse> {
    Ok(c.node_unprepare_resources(v1::NodeUnprepareResourcesRequest { claims }).await?.into_inner())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_as_a_dra_driver_registers_publishes_prepares_and_keeps_claims_across_a_restart()
-> Result<()> {
    let (node, api) = dra_node().await?;
    let d = dra(&node)?;
    let (agent, token) = start(&node, &api).await?;

    // Registration, as the kubelet's plugin watcher asks it.
    let socket = d.registration_socket();
    poll("the registration socket", async || Ok(socket.exists().then_some(()))).await?;
    let info = reg::PluginInfo::decode(
        c_core_call(&socket, reg::GET_INFO_PATH, &reg::InfoRequest {}.encode_to_vec())?.as_slice(),
    )?;
    assert_eq!(info.r#type, "DRAPlugin");
    assert_eq!(info.name, DRIVER);
    assert_eq!(Path::new(&info.endpoint), d.socket());
    assert_eq!(info.supported_versions, ["v1.DRAPlugin", "v1beta1.DRAPlugin"]);

    // Slices: every GPU shared by memory once its MPS daemon answers.
    let devices = poll("8 shared GPUs published", async || {
        let p = published(&api);
        Ok((p.len() == 8 && p.values().all(|d| d["allowMultipleAllocations"] == true)).then_some(p))
    })
    .await?;
    let gpu0 = &devices["gpu-0"];
    assert_eq!(gpu0["capacity"]["memory"]["requestPolicy"]["validRange"]["step"], "1Gi");
    let slice = &api.resource_slices()[0];
    assert_eq!(slice["metadata"]["ownerReferences"][0]["uid"], "node-a-uid");
    assert_eq!(slice["spec"]["pool"]["name"], "node-a");

    // Prepare a share of 8 GiB on gpu-0.
    api.put_resource_claim(allocated_claim("infer", "uid-1", "gpu-0", Some("8Gi")));
    let mut dra_client = client(&d.socket()).await?;
    let answer = prepare(&mut dra_client, vec![claim("infer", "uid-1")]).await?;
    let entry = &answer.claims["uid-1"];
    assert_eq!(entry.error, "", "{answer:?}");
    let prepared = &entry.devices[0];
    assert_eq!(prepared.device_name, "gpu-0");
    assert_eq!(prepared.share_id.as_deref(), Some("share-uid-1"));
    let own = format!("{DRIVER}/claim=uid-1-gpu-0");
    assert!(prepared.cdi_device_ids.contains(&own), "{:?}", prepared.cdi_device_ids);
    let uuid = agent.resources().published().state.gpus().next().context("a GPU")?.uuid.to_string();
    assert!(
        prepared.cdi_device_ids.contains(&format!("nvidia.com/gpu={uuid}")),
        "{:?}",
        prepared.cdi_device_ids
    );
    let spec_path = d.cdi_dir.join(format!("{DRIVER}-claim_uid-1.json"));
    let spec = std::fs::read_to_string(&spec_path)?;
    assert!(spec.contains("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=8192M"), "{spec}");
    assert!(spec.contains("CUDA_MPS_PIPE_DIRECTORY="), "{spec}");
    assert!(spec.contains("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE="), "{spec}");
    assert!(spec.contains(&format!("{uuid}/pipe")), "the pipe directory is mounted: {spec}");

    // The share in the metrics, by claim and pod.
    let address = agent.metrics_address().context("metrics")?;
    let line = scraped(address, "the claim's series", |text| {
        text.lines().find(|l| l.starts_with("baleen_claim_memory_bytes{")).map(str::to_owned)
    })
    .await?;
    assert!(line.contains(r#"claim="infer""#) && line.contains(r#"pod="pod-infer""#), "{line}");
    assert!(line.contains(r#"namespace="team-a""#) && line.contains(r#"device="gpu-0""#), "{line}");
    assert!(line.ends_with(&format!(" {}", 8_u64 << 30)), "{line}");

    // More than gpu-0 holds beside it: refused, nothing booked.
    api.put_resource_claim(allocated_claim("train", "uid-2", "gpu-0", Some("140Gi")));
    let over = prepare(&mut dra_client, vec![claim("train", "uid-2")]).await?;
    assert!(over.claims["uid-2"].error.contains("memory units free"), "{over:?}");
    assert!(agent.resources().claim_grants("uid-2").is_empty());

    // A crash; the CDI directory lost (tmpfs at a reboot); the claim deleted from the API.
    drop(agent);
    drop(token);
    std::fs::remove_file(&spec_path)?;
    api.delete_resource_claim("team-a", "infer");
    let (agent, token) = start(&node, &api).await?;
    assert_eq!(agent.resources().claim_grants("uid-1").len(), 1, "the claim survives the restart");
    assert!(spec_path.exists(), "its CDI spec written again before serving");
    // Unprepare works from the ledger alone.
    let mut dra_client = client(&d.socket()).await?;
    let done = unprepare(&mut dra_client, vec![claim("infer", "uid-1")]).await?;
    assert_eq!(done.claims["uid-1"].error, "");
    assert!(agent.resources().claim_grants("uid-1").is_empty());
    assert!(!spec_path.exists());

    // The kubelet starts and deletes every slice of its node: republished within seconds.
    let before = published(&api).len();
    assert!(api.delete_resource_slices_of_node("node-a") > 0);
    poll("slices republished after the kubelet's wipe", async || {
        Ok((published(&api).len() == before).then_some(()))
    })
    .await?;
    stop(agent, token).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_pods_prepared_at_once_on_one_gpu_never_share_a_unit_nor_exceed_it() -> Result<()> {
    let (node, api) = dra_node().await?;
    let d = dra(&node)?;
    let (agent, token) = start(&node, &api).await?;
    poll("slices", async || Ok((published(&api).len() == 8).then_some(()))).await?;
    let units = agent.resources().published().state.gpu_states()[0].units;
    // Two claims of 60 % of the GPU each: one fits, the other must be refused.
    let share = format!("{}Gi", units * 6 / 10);
    api.put_resource_claim(allocated_claim("a", "uid-a", "gpu-0", Some(&share)));
    api.put_resource_claim(allocated_claim("b", "uid-b", "gpu-0", Some(&share)));
    let (mut ca, mut cb) = (client(&d.socket()).await?, client(&d.socket()).await?);
    let (ra, rb) = tokio::join!(
        ca.node_prepare_resources(v1::NodePrepareResourcesRequest {
            claims: vec![claim("a", "uid-a")]
        }),
        cb.node_prepare_resources(v1::NodePrepareResourcesRequest {
            claims: vec![claim("b", "uid-b")]
        }),
    );
    let (ra, rb) = (ra?.into_inner(), rb?.into_inner());
    let errors = [ra.claims["uid-a"].error.clone(), rb.claims["uid-b"].error.clone()];
    assert_eq!(errors.iter().filter(|e| e.is_empty()).count(), 1, "{errors:?}");
    let taken = agent.resources().published().state.units_taken(0);
    assert_eq!(taken, units * 6 / 10, "exactly one share is held");
    stop(agent, token).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkpoint_of_device_plugin_grants_is_refused_in_dra_mode() -> Result<()> {
    let (mut node, api) = dra_node().await?;
    let d = node.config.driver.clone();
    // First as a device-plugin node with one grant.
    node.config.driver = DriverMode::DevicePlugin;
    let (agent, token) = node.start().await?;
    node.registered(&agent, 1).await?;
    node.kubelet.admit(&format!("{}/gpu", baleen_agent::defaults::DOMAIN), 1).await?;
    stop(agent, token).await?;
    node.config.driver = d;
    let Err(e) = start(&node, &api).await else {
        anyhow::bail!("a DRA start over device-plugin grants must fail")
    };
    let text = format!("{e:#}");
    assert!(text.contains("drain the node before switching modes"), "{text}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gpu_going_unhealthy_under_held_shares_is_withdrawn_and_its_shares_kept() -> Result<()> {
    let (node, api) = dra_node().await?;
    let d = dra(&node)?;
    let (agent, token) = start(&node, &api).await?;
    poll("slices", async || Ok((published(&api).len() == 8).then_some(()))).await?;
    api.put_resource_claim(allocated_claim("held", "uid-1", "gpu-0", Some("4Gi")));
    let mut c = client(&d.socket()).await?;
    let r = prepare(&mut c, vec![claim("held", "uid-1")]).await?;
    assert_eq!(r.claims["uid-1"].error, "");
    // The kubelet's health stream (KEP-4680), on the same socket.
    let channel = baleen_device_plugin::uds::connect(&d.socket(), WAIT).await?;
    let mut watch =
        baleen_proto::dra::health::dra_resource_health_client::DraResourceHealthClient::new(
            channel,
        )
        .node_watch_resources(baleen_proto::dra::health::NodeWatchResourcesRequest {})
        .await?
        .into_inner();
    let first = watch.message().await?.context("a first message")?;
    assert_eq!(first.devices.len(), 8);
    assert!(
        first
            .devices
            .iter()
            .all(|h| h.health == baleen_proto::dra::health::HealthStatus::Healthy as i32)
    );
    assert!(
        first.devices.iter().all(|h| h.device.as_ref().is_some_and(|i| i.pool_name == "node-a"))
    );
    let uuid = agent.resources().published().state.gpus().next().context("a GPU")?.uuid.to_string();
    agent.resources().set_health(&uuid, false, "XID 79 (test)");
    let sick = tokio::time::timeout(WAIT, async {
        loop {
            let m = watch.message().await?.context("the stream ended")?;
            let gpu0 = m
                .devices
                .iter()
                .find(|h| h.device.as_ref().is_some_and(|i| i.device_name == "gpu-0"))
                .cloned();
            if let Some(h) = gpu0
                .filter(|h| h.health == baleen_proto::dra::health::HealthStatus::Unhealthy as i32)
            {
                return anyhow::Ok(h);
            }
        }
    })
    .await??;
    assert!(sick.message.contains("XID 79 (test)"), "{sick:?}");
    assert_eq!(sick.health_check_timeout_seconds, baleen_dra::service::HEALTH_TIMEOUT_SECONDS);
    poll("gpu-0 withdrawn from the slices", async || {
        let p = published(&api);
        Ok((p.len() == 7 && !p.contains_key("gpu-0")).then_some(()))
    })
    .await?;
    assert_eq!(agent.resources().claim_grants("uid-1").len(), 1, "the held share is kept");
    // A claim the scheduler allocated before the withdrawal: refused while the GPU is sick.
    api.put_resource_claim(allocated_claim("late", "uid-2", "gpu-0", Some("4Gi")));
    let late = prepare(&mut c, vec![claim("late", "uid-2")]).await?;
    assert!(late.claims["uid-2"].error.contains("unhealthy"), "{late:?}");
    agent.resources().set_health(&uuid, true, "");
    poll("gpu-0 published again", async || Ok((published(&api).len() == 8).then_some(()))).await?;
    let again = prepare(&mut c, vec![claim("late", "uid-2")]).await?;
    assert_eq!(again.claims["uid-2"].error, "", "{again:?}");
    stop(agent, token).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_share_on_a_gpu_whose_mps_daemon_does_not_answer_is_refused() -> Result<()> {
    let (node, api) = dra_node().await?;
    let d = dra(&node)?;
    let (agent, token) = start(&node, &api).await?;
    poll("slices", async || Ok((published(&api).len() == 8).then_some(()))).await?;
    let uuid = agent.resources().published().state.gpus().next().context("a GPU")?.uuid.to_string();
    agent.resources().set_shares_enforced(&uuid, false);
    poll("gpu-0 withdrawn", async || Ok((!published(&api).contains_key("gpu-0")).then_some(())))
        .await?;
    api.put_resource_claim(allocated_claim("c", "uid-1", "gpu-0", Some("4Gi")));
    let r = prepare(&mut client(&d.socket()).await?, vec![claim("c", "uid-1")]).await?;
    assert!(r.claims["uid-1"].error.contains("MPS daemon"), "{r:?}");
    assert!(agent.resources().claim_grants("uid-1").is_empty());
    stop(agent, token).await
}

/// The node's slices as kube-scheduler reads them (k8s-openapi's types).
fn slices(api: &FakeApiServer) -> Result<Vec<k8s_openapi::api::resource::v1::ResourceSlice>> {
    api.resource_slices().into_iter().map(|s| Ok(serde_json::from_value(s)?)).collect()
}

/// Allocates a claim `name` (UID `uid`) of `ask` with the test allocator from the node's
/// slices, reserved for pod `pod`, and stores it in the API server.
fn allocate(
    api: &FakeApiServer,
    allocator: &mut Allocator,
    name: &str,
    uid: &str,
    ask: Ask,
    pod: &str,
) -> Result<dra_kubelet::Claim> {
    let given = allocator
        .allocate(&slices(api)?, "node-a", uid, ask)
        .with_context(|| format!("{ask:?} does not fit the node's slices"))?;
    api.put_resource_claim(json!({
        "metadata": {"name": name, "namespace": "team-a", "uid": uid},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": DRIVER}}]}},
        "status": claim_status(DRIVER, &given, (pod, &format!("uid-{pod}")))
    }));
    Ok(dra_kubelet::Claim { namespace: "team-a".into(), name: name.into(), uid: uid.into() })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn through_a_kubelet_claims_survive_both_restarts_and_are_prepared_once() -> Result<()> {
    let (node, api) = dra_node().await?;
    let d = dra(&node)?;
    // Slices left by an earlier agent: the kubelet's start deletes them.
    let stale = json!({"metadata": {"name": "stale"}, "spec": {"driver": DRIVER, "nodeName": "node-a",
        "pool": {"name": "node-a", "generation": 1, "resourceSliceCount": 1}, "devices": []}});
    let (status, body) = baleen_tests::http::request(
        api.address(),
        "POST",
        "/apis/resource.k8s.io/v1/resourceslices",
        &stale.to_string(),
    )
    .await?;
    assert_eq!(status, 201, "{body}");
    let kubelet = FakeDraKubelet::start(&d.registry_dir, "node-a", api.address()).await?;
    assert!(api.resource_slices().is_empty(), "the kubelet's start wipes the node's slices");
    let (agent, token) = start(&node, &api).await?;
    let plugin = kubelet.registered(DRIVER, 1, WAIT).await?;
    assert_eq!(plugin.version, "v1.DRAPlugin");
    // The kubelet's verdict is the agent's readiness, as a device plugin's registration is.
    let registered = |agent: &Agent, n: u64| {
        agent.plugins().iter().any(|(name, s)| {
            name == DRIVER
                && matches!(*s.borrow(), baleen_device_plugin::PluginState::Registered { registrations } if registrations == n)
        })
    };
    eventually("the agent knows it is registered", || registered(&agent, 1)).await?;
    let address = agent.metrics_address().context("metrics")?;
    let (code, _) = baleen_tests::http::request(address, "GET", "/readyz", "").await?;
    assert_eq!(code, 200, "ready once registered");
    poll("slices", async || Ok((published(&api).len() == 8).then_some(()))).await?;

    // Two pods' claims on the node, allocated first fit: both land on gpu-0.
    let mut allocator = Allocator::default();
    let a = allocate(&api, &mut allocator, "a", "uid-a", Ask::Memory(8 << 30), "pod-a")?;
    let b = allocate(&api, &mut allocator, "b", "uid-b", Ask::Memory(16 << 30), "pod-b")?;
    let (ra, rb) = tokio::join!(
        kubelet.run_pod(DRIVER, "pod-a", std::slice::from_ref(&a)),
        kubelet.run_pod(DRIVER, "pod-b", std::slice::from_ref(&b)),
    );
    let (ra, rb) = (ra?, rb?);
    assert_eq!(ra["uid-a"][0].device, "gpu-0");
    assert_eq!(rb["uid-b"][0].device, "gpu-0");
    assert_eq!(agent.resources().published().state.units_taken(0), 24);
    let spec_a = std::fs::read_to_string(d.cdi_dir.join(format!("{DRIVER}-claim_uid-a.json")))?;
    assert!(spec_a.contains("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=8192M"), "{spec_a}");

    // The kubelet restarts: slices wiped and republished; nothing prepared again.
    let calls = kubelet.calls();
    kubelet.restart().await?;
    kubelet.registered(DRIVER, 1, WAIT).await?;
    eventually("registered again after the kubelet's restart", || registered(&agent, 2)).await?;
    poll("slices republished", async || Ok((published(&api).len() == 8).then_some(()))).await?;
    kubelet.run_pod(DRIVER, "pod-a", std::slice::from_ref(&a)).await?;
    assert_eq!(kubelet.calls(), calls, "a prepared claim is not prepared again");

    // The plugin restarts (a crash): registered again; the kubelet does not prepare again, the
    // claims and their MPS limits are as they were, and Unprepare works, with the claim gone.
    drop(agent);
    drop(token);
    let (agent, token) = start(&node, &api).await?;
    kubelet.registered(DRIVER, 2, WAIT).await?;
    assert_eq!(agent.resources().published().state.units_taken(0), 24, "both shares kept");
    let again = std::fs::read_to_string(d.cdi_dir.join(format!("{DRIVER}-claim_uid-a.json")))?;
    assert_eq!(again, spec_a, "the MPS limits of the running pod are kept");
    api.delete_resource_claim("team-a", "a");
    kubelet.end_pod(DRIVER, "pod-a", WAIT).await?;
    allocator.release("uid-a");
    assert_eq!(agent.resources().published().state.units_taken(0), 16);
    assert!(kubelet.prepared("uid-a").is_none());
    kubelet.end_pod(DRIVER, "pod-b", WAIT).await?;
    assert_eq!(agent.resources().published().state.units_taken(0), 0);
    assert_eq!(kubelet.calls().0, calls.0, "Prepare was called only for the two pods");
    stop(agent, token).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn through_a_kubelet_a_recreated_claim_and_an_overcommitted_gpu_fail_the_pod() -> Result<()> {
    let (node, api) = dra_node().await?;
    let d = dra(&node)?;
    let kubelet = FakeDraKubelet::start(&d.registry_dir, "node-a", api.address()).await?;
    let (agent, token) = start(&node, &api).await?;
    kubelet.registered(DRIVER, 1, WAIT).await?;
    poll("slices", async || Ok((published(&api).len() == 8).then_some(()))).await?;
    let mut allocator = Allocator::default();
    // Deleted and created again under its name between scheduling and the pod's start.
    let mut c = allocate(&api, &mut allocator, "c", "uid-1", Ask::Memory(1 << 30), "p")?;
    c.uid = "uid-0".into();
    let e = kubelet.run_pod(DRIVER, "p", &[c]).await.expect_err("the UID differs");
    assert!(format!("{e:#}").contains("deleted and created again"), "{e:#}");
    // Two allocators that each think the GPU is theirs (the scheduler's sum slipped): the
    // second pod cannot start, and nothing is booked for it.
    let mut other = Allocator::default();
    let units = agent.resources().published().state.gpu_states()[0].units;
    let big = u64::from(units - 4) << 30;
    let x = allocate(&api, &mut allocator, "x", "uid-x", Ask::Memory(big), "px")?;
    let y = allocate(&api, &mut other, "y", "uid-y", Ask::Memory(big), "py")?;
    kubelet.run_pod(DRIVER, "px", &[x]).await?;
    let e = kubelet.run_pod(DRIVER, "py", &[y]).await.expect_err("over the GPU");
    assert!(format!("{e:#}").contains("memory units free"), "{e:#}");
    assert!(agent.resources().claim_grants("uid-y").is_empty());
    stop(agent, token).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dra_socket_path_too_long_or_no_api_client_is_refused_before_serving() -> Result<()> {
    let (mut node, api) = dra_node().await?;
    let mut d = dra(&node)?;
    d.plugin_dir = d.plugin_dir.join("p".repeat(100));
    node.config.driver = DriverMode::Dra(d);
    let Err(e) = start(&node, &api).await else { anyhow::bail!("a socket path too long") };
    let e = e.downcast::<baleen_agent::run::AgentError>()?;
    assert!(e.is_configuration(), "{e}");
    assert!(e.to_string().contains("dra.sock"), "{e}");
    let (node, _api) = dra_node().await?;
    let Err(e) = node.start_with(None).await else { anyhow::bail!("no API client") };
    assert!(format!("{e:#}").contains("driver: dra needs the Kubernetes API"), "{e:#}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_api_server_that_drops_the_shared_fields_is_not_rewritten_forever() -> Result<()> {
    let (node, api) = dra_node().await?;
    api.without_consumable_capacity();
    let (agent, token) = start(&node, &api).await?;
    poll("slices", async || Ok((published(&api).len() == 8).then_some(()))).await?;
    assert!(published(&api).values().all(|d| d.get("allowMultipleAllocations").is_none()));
    let writes = || {
        api.requests()
            .iter()
            .filter(|r| {
                r.path.contains("/resourceslices") && (r.method == "POST" || r.method == "PUT")
            })
            .count()
    };
    let before = writes();
    // A change of the allocations (and the watch events of the agent's own writes) leaves the
    // stored slices alone.
    api.put_resource_claim(allocated_claim("c", "uid-1", "gpu-0", Some("4Gi")));
    let d = dra(&node)?;
    let r = prepare(&mut client(&d.socket()).await?, vec![claim("c", "uid-1")]).await?;
    assert_eq!(r.claims["uid-1"].error, "");
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(writes(), before, "the slices are written again only when the devices change");
    let generation = api.resource_slices()[0]["spec"]["pool"]["generation"].clone();
    assert_eq!(generation, 1, "{generation}");
    stop(agent, token).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_booking_that_cannot_be_written_is_refused_and_not_answered_later() -> Result<()> {
    let (node, api) = dra_node().await?;
    let d = dra(&node)?;
    let (agent, token) = start(&node, &api).await?;
    poll("slices", async || Ok((published(&api).len() == 8).then_some(()))).await?;
    let checkpoint = baleen_agent::checkpoint::Checkpoint::in_dir(&node.config.state_dir);
    // No journal to append to, and no snapshot can be written either.
    let blocker = PathBuf::from(format!("{}.tmp", node.checkpoint().display()));
    std::fs::create_dir_all(&blocker)?;
    std::fs::remove_file(checkpoint.journal_path())?;
    api.put_resource_claim(allocated_claim("c", "uid-1", "gpu-0", Some("4Gi")));
    let mut c = client(&d.socket()).await?;
    let r = prepare(&mut c, vec![claim("c", "uid-1")]).await?;
    assert!(r.claims["uid-1"].error.contains("checkpoint cannot be written"), "{r:?}");
    assert!(agent.resources().claim_grants("uid-1").is_empty(), "taken back out of the ledger");
    assert!(!d.cdi_dir.join(format!("{DRIVER}-claim_uid-1.json")).exists());
    // Once the disk takes writes again, the kubelet's retry books it, durably.
    std::fs::remove_dir(&blocker)?;
    let r = prepare(&mut c, vec![claim("c", "uid-1")]).await?;
    assert_eq!(r.claims["uid-1"].error, "", "{r:?}");
    let held = checkpoint.load("node-a", "boot-1")?.context("a checkpoint")?;
    assert!(
        held.allocations.iter().any(|a| a.claim.as_ref().is_some_and(|c| c.uid == "uid-1")),
        "the claim is on disk"
    );
    stop(agent, token).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_checkpoint_stops_the_dra_agent() -> Result<()> {
    let (node, api) = dra_node().await?;
    let d = dra(&node)?;
    let (agent, token) = start(&node, &api).await?;
    api.put_resource_claim(allocated_claim("c", "uid-1", "gpu-0", Some("4Gi")));
    let r = prepare(&mut client(&d.socket()).await?, vec![claim("c", "uid-1")]).await?;
    assert_eq!(r.claims["uid-1"].error, "");
    stop(agent, token).await?;
    // One byte of the snapshot changed: its checksum no longer matches.
    let mut bytes = std::fs::read(node.checkpoint())?;
    let at = bytes.iter().position(|b| *b == b'G').context("a GPU UUID")?;
    bytes[at] = b'H';
    std::fs::write(node.checkpoint(), bytes)?;
    let Err(e) = start(&node, &api).await else { anyhow::bail!("a corrupt checkpoint served") };
    let e = e.downcast::<baleen_agent::run::AgentError>()?;
    assert!(e.is_configuration(), "exit 64: {e}");
    assert!(e.to_string().contains("only record of the claims prepared"), "{e}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claims_share_gets_its_pods_mps_priority_and_keeps_it_across_a_restart() -> Result<()> {
    use baleen_agent::isolation::cgroups::Qos;
    let (mut node, api) = dra_node().await?;
    let d = dra(&node)?;
    let cgroups = node.config.state_dir.parent().context("root")?.join("cgroup");
    super::colocation::cgroup_tree(
        &cgroups,
        &[("uid-serve", Qos::Guaranteed), ("uid-train", Qos::BestEffort)],
    )?;
    node.config.colocation = baleen_agent::run::colocation::ColocationConfig {
        enabled: true,
        cgroup_root: cgroups,
        identify_wait: Duration::from_millis(500),
        resync: Duration::from_millis(200),
        ..Default::default()
    };
    api.put_node(json!({"metadata": {"name": "node-a", "uid": "node-a-uid"},
        "status": {"allocatable": {"cpu": "8", "memory": "64Gi"}}}));
    let class = baleen_agent::isolation::colocation::CLASS_LABEL;
    api.put_namespace(json!({"metadata": {"name": "serving", "labels": {class: "inference"}}}));
    api.put_namespace(json!({"metadata": {"name": "ml"}}));
    api.put_pod(api_pod("serve", "node-a", "Guaranteed", None, "Pending", 0));
    api.put_pod(api_pod("train", "node-a", "BestEffort", None, "Pending", 0));
    let (agent, token) = start(&node, &api).await?;
    poll("slices", async || Ok((published(&api).len() == 8).then_some(()))).await?;
    let reserved = |name: &str, uid: &str, pod: &str| {
        let mut c = allocated_claim(name, uid, "gpu-0", Some("4Gi"));
        c["status"]["reservedFor"] =
            json!([{"resource": "pods", "name": pod, "uid": format!("uid-{pod}")}]);
        c
    };
    api.put_resource_claim(reserved("s", "uid-s", "serve"));
    api.put_resource_claim(reserved("t", "uid-t", "train"));
    let r =
        prepare(&mut client(&d.socket()).await?, vec![claim("s", "uid-s"), claim("t", "uid-t")])
            .await?;
    assert!(r.claims.values().all(|c| c.error.is_empty()), "{r:?}");
    let spec =
        |uid: &str| std::fs::read_to_string(d.cdi_dir.join(format!("{DRIVER}-claim_{uid}.json")));
    let (serve, train) = (spec("uid-s")?, spec("uid-t")?);
    assert!(serve.contains("CUDA_MPS_CLIENT_PRIORITY=0"), "inference: normal priority: {serve}");
    assert!(train.contains("CUDA_MPS_CLIENT_PRIORITY=1"), "training: below normal: {train}");
    // After a restart, written again as the containers started with it.
    drop(agent);
    drop(token);
    std::fs::remove_file(d.cdi_dir.join(format!("{DRIVER}-claim_uid-t.json")))?;
    let (agent, token) = start(&node, &api).await?;
    assert_eq!(spec("uid-t")?, train);
    stop(agent, token).await
}
