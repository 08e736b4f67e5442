//! The extender against a fake Kubernetes API server: its Node and Pod watchers fill the cache
//! (`nodeCacheCapable: true`), pods bound but not yet in their node's annotation count as
//! placed, an agent's annotation patch flows to the extender, and the API server going away
//! and coming back (with changes made meanwhile) leaves the cache right.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, Result};
use baleen_extender::run::{Config, Running, start};
use baleen_extender::service::Settings;
use baleen_k8s::gpu_state::{GpuEntry, GpuMode, NodeGpuState, VERSION};
use baleen_tests::fake_apiserver::FakeApiServer;
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

use crate::support::poll_within;

const WAIT: Duration = Duration::from_secs(20);
const KEY: &str = "awesome-ai-company.com/gpu-state";

fn state(name: &str, free: &[u32], pods: &[&str]) -> String {
    NodeGpuState {
        version: VERSION,
        node: name.into(),
        generation: 1,
        memory_unit_bytes: 1 << 30,
        resources: vec!["awesome-ai-company.com/gpu-memory".into()],
        gpus: free
            .iter()
            .enumerate()
            .map(|(i, &f)| GpuEntry {
                index: u32::try_from(i).expect("few"),
                uuid: format!("GPU-{name}-{i}"),
                model: "NVIDIA H200".into(),
                memory_bytes: 140 << 30,
                numa_node: None,
                nvlink_peers: vec![],
                mode: if f == 140 { GpuMode::Idle } else { GpuMode::Shared },
                healthy: true,
                shares_offered: true,
                units_total: 140,
                units_free: f,
                compute_free_milli: f * 1000 / 140,
                mig: vec![],
                pods: if i == 0 { pods.iter().map(|p| (*p).to_owned()).collect() } else { vec![] },
            })
            .collect(),
        nvlink_groups: vec![],
        unnamed: vec![],
    }
    .to_json()
}

fn node(name: &str, free: &[u32]) -> Value {
    json!({
        "metadata": {"name": name, "annotations": {KEY: state(name, free, &[])}},
        "status": {"allocatable": {"cpu": "96", "memory": "1000Gi"},
                   "capacity": {"awesome-ai-company.com/gpu-memory": (free.len() * 140).to_string()}}
    })
}

fn pod(name: &str, units: u32, node: Option<&str>) -> Value {
    let mut p = json!({
        "metadata": {"name": name, "namespace": "ns", "uid": format!("uid-{name}")},
        "spec": {"containers": [{"name": "c", "resources": {"limits": {
            "awesome-ai-company.com/gpu-memory": units.to_string()}}}]},
        "status": {"phase": "Pending"}
    });
    if let Some(n) = node {
        p["spec"]["nodeName"] = json!(n);
    }
    p
}

async fn extender(api: &FakeApiServer) -> Result<(Running, CancellationToken)> {
    let client = kube::Client::try_from(kube::Config::new(api.url().parse()?))?;
    let token = CancellationToken::new();
    let config = Config {
        listen: "127.0.0.1:0".parse()?,
        prefix: String::new(),
        settings: Settings::default(),
        metrics_listen: None,
        webhook: None,
        tls: None,
    };
    let running = start(config, client, prometheus::Registry::new(), token.clone()).await?;
    Ok((running, token))
}

/// Waits until the filter (names from the cache) passes exactly `expect` for `pod`, saying
/// `says` somewhere in its answer.
async fn filter_passes(
    running: &Running,
    pod: &Value,
    names: &[&str],
    expect: &[&str],
    says: &str,
) -> Result<Value> {
    let args = baleen_extender::protocol::ExtenderArgs::from_json(
        json!({"Pod": pod, "NodeNames": names}),
    )?;
    let extender = running.extender.clone();
    poll_within(WAIT, &format!("{expect:?} to pass"), async || {
        let (result, _) = extender.filter(&args);
        let passed: Vec<String> = result.node_names.clone().unwrap_or_default();
        let answer = serde_json::to_value(&result)?;
        Ok((passed == expect && answer.to_string().contains(says)).then_some(answer))
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_watchers_fill_the_cache_and_bound_pods_count_until_published() -> Result<()> {
    let mut api = FakeApiServer::start(&[]).await?;
    api.put_node(node("a", &[100, 0]));
    api.put_node(node("b", &[60, 0]));
    let (running, token) = extender(&api).await?;
    let big = pod("p1", 100, None);
    let result =
        filter_passes(&running, &big, &["a", "b"], &["a"], "largest free block: 60").await?;
    assert!(result["FailedNodes"]["b"].as_str().context("b")?.contains("largest free block: 60"));

    // p1 is bound to a; a's annotation does not show it yet: a second 100-unit pod finds no room.
    api.put_pod(pod("p1", 100, Some("a")));
    let p2 = pod("p2", 100, None);
    let result = filter_passes(&running, &p2, &["a", "b"], &[], "1 pods bound").await?;
    assert!(result["FailedNodes"]["a"].as_str().context("a")?.contains("1 pods bound"), "{result}");
    // Once a's agent publishes p1 (a merge patch of the annotation), it counts once, not twice.
    let published = state("a", &[0, 0], &["ns/p1"]);
    let client = baleen_agent::kube_api::KubeNodeApi::at(&api.url())?;
    use baleen_agent::kube_api::NodeApi as _;
    client.annotate("a", KEY, &published).await?;
    let small = pod("p3", 1, None);
    filter_passes(&running, &small, &["a", "b"], &["b"], "").await?;
    // a frees its units (p1 ended): the pod's end and the new annotation make room again.
    api.delete_pod("ns/p1");
    client.annotate("a", KEY, &state("a", &[140, 0], &[])).await?;
    filter_passes(&running, &p2, &["a", "b"], &["a"], "").await?;

    // The API server goes away; meanwhile b is freed and a removed (seen after it is back).
    api.stop().await;
    api.start_again().await?;
    api.put_node(node("b", &[140, 0]));
    api.delete_node("a");
    let result = filter_passes(&running, &p2, &["a", "b"], &["b"], "unknown").await?;
    assert!(result["FailedAndUnresolvableNodes"]["a"].as_str().context("a")?.contains("unknown"));
    // Gone for longer, with changes made while it is away: the watchers list again.
    api.stop().await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    api.put_node(node("c", &[140]));
    api.put_pod(pod("p4", 140, Some("c")));
    api.start_again().await?;
    let result =
        filter_passes(&running, &pod("p5", 140, None), &["b", "c"], &["b"], "1 pods bound").await?;
    assert!(result["FailedNodes"]["c"].as_str().context("c")?.contains("1 pods bound"), "{result}");
    token.cancel();
    tokio::time::timeout(WAIT, running.wait()).await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_publishes_and_the_extender_places_on_what_it_published() -> Result<()> {
    // The agent's real publisher writes to the fake API server, whose watch feeds the extender.
    let api = Arc::new(FakeApiServer::start(&["node-a"]).await?);
    let (running, token) = extender(&api).await?;
    // The kubelet's count of the node's devices, which the extender holds the document to.
    api.put_node(json!({"metadata": {"name": "node-a"},
        "status": {"allocatable": {"cpu": "96", "memory": "1000Gi"},
                   "capacity": {"awesome-ai-company.com/gpu-memory": "140"}}}));
    let client = baleen_agent::kube_api::KubeNodeApi::at(&api.url())?;
    use baleen_agent::kube_api::NodeApi as _;
    client.annotate("node-a", KEY, &state("node-a", &[10], &[])).await?;
    let result =
        filter_passes(&running, &pod("p", 11, None), &["node-a"], &[], "largest free block")
            .await?;
    assert!(
        result["FailedNodes"]["node-a"].as_str().context("why")?.contains("largest free block: 10")
    );
    filter_passes(&running, &pod("p", 10, None), &["node-a"], &["node-a"], "").await?;
    token.cancel();
    tokio::time::timeout(WAIT, running.wait()).await?;
    Ok(())
}
