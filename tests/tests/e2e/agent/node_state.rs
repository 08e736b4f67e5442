//! The node-state annotation against a fake API server: published, coalesced, and surviving the API server going away.

use super::*;

/// The node's gpu-state annotation as the fake API server holds it now.
fn published(api: &baleen_tests::fake_apiserver::FakeApiServer) -> Option<NodeGpuState> {
    let text = api.annotation("node-a", "awesome-ai-company.com/gpu-state")?;
    Some(NodeGpuState::parse(&text).expect("the agent writes valid documents"))
}

/// Waits (at most `WAIT`) until the published state satisfies `ok`.
async fn published_when(
    api: &baleen_tests::fake_apiserver::FakeApiServer,
    what: &str,
    ok: impl Fn(&NodeGpuState) -> bool,
) -> Result<NodeGpuState> {
    let mut requests = api.watch_requests();
    let wait = async {
        loop {
            if let Some(state) = published(api).filter(|s| ok(s)) {
                return anyhow::Ok(state);
            }
            requests.changed().await?;
        }
    };
    tokio::time::timeout(WAIT, wait).await.with_context(|| {
        let patches: Vec<String> = api
            .requests()
            .iter()
            .filter(|r| r.method == "PATCH")
            .map(|r| format!("{:?}", r.at.elapsed()))
            .collect();
        format!(
            "waiting for {what}; last published {:?}; PATCHes (ago) {patches:?}",
            published(api).map(|s| (
                s.generation,
                s.gpus.iter().map(|g| g.units_total - g.units_free).sum::<u32>()
            ))
        )
    })?
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_node_state_is_published_coalesced_and_survives_the_api_server_going_away() -> Result<()>
{
    let mut node = TestNode::new("l4-4x-pcie.yaml", Backend::Simulated).await?;
    let interval = Duration::from_millis(300);
    node.config.annotation = baleen_agent::run::annotation::AnnotationConfig {
        enabled: true,
        min_interval: interval,
        ..Default::default()
    };
    let mut api = baleen_tests::fake_apiserver::FakeApiServer::start(&["node-a"]).await?;
    let client = baleen_agent::kube_api::KubeNodeApi::at(&api.url())?;
    let (agent, token) = node.start_with(Some(client.clone())).await?;
    node.registered(&agent, 1).await?;
    // Written at start, as a JSON merge patch of the one annotation.
    let first = published_when(&api, "the first state", |s| s.gpus.len() == 4).await?;
    assert!(first.gpus.iter().all(|g| g.units_free == g.units_total && g.units_total == 22));
    let patch = api.requests().into_iter().find(|r| r.method == "PATCH").context("a patch")?;
    assert_eq!(patch.content_type, "application/merge-patch+json");
    assert_eq!(patch.path, "/api/v1/nodes/node-a");
    let keys: Vec<&String> =
        patch.body["metadata"].as_object().context("metadata")?.keys().collect();
    assert_eq!(keys, ["annotations"], "nothing but the annotation is written");

    // A burst of grants: written at most once per interval, and the last state always.
    let before = api.requests().len();
    let mut gpus = std::collections::BTreeSet::new();
    for pod in ["ns/a", "ns/b", "ns/c", "ns/d", "ns/e"] {
        let a = node.kubelet.admit_to(pod, "c", MEM, 4).await?;
        gpus.insert(gpu_of(&a.device_ids[0]).to_owned());
    }
    let all = published_when(&api, "all five grants", |s| {
        s.gpus.iter().map(|g| g.units_total - g.units_free).sum::<u32>() == 20
    })
    .await?;
    let patches: Vec<std::time::Instant> =
        api.requests()[before..].iter().filter(|r| r.method == "PATCH").map(|r| r.at).collect();
    assert!(patches.len() < 5, "five grants, {} writes: not coalesced", patches.len());
    for pair in patches.windows(2) {
        // The interval is measured from the end of a write to the next change; the next write
        // starts at least that long after it (a little slack for the recording's clock).
        assert!(
            pair[1] - pair[0] >= interval - Duration::from_millis(20),
            "{:?}",
            pair[1] - pair[0]
        );
    }
    // The pods that hold them, once the kubelet has listed them.
    let named = published_when(&api, "the pods named", |s| {
        s.gpus.iter().flat_map(|g| g.pods.iter()).any(|p| p == "ns/e")
    })
    .await?;
    assert!(named.generation >= all.generation);
    // Issue 25, item 5: once the agent's watch of its node's pods holds ns/e, the document
    // names it by UID too (a pod recreated with its name is then not taken for it).
    api.put_pod(serde_json::json!({
        "metadata": {"name": "e", "namespace": "ns", "uid": "uid-e"},
        "spec": {"nodeName": "node-a", "containers": [{"name": "c"}]},
        "status": {"phase": "Running"}
    }));
    let by_uid = published_when(&api, "ns/e named by UID", |s| {
        s.pod_uids.get("ns/e").is_some_and(|uid| uid == "uid-e")
    })
    .await?;
    assert!(!by_uid.pod_uids.contains_key("ns/a"), "no UID for a pod the watch does not hold");

    // The API server goes away: Allocate is not held up, and the state is written once it is
    // back.
    api.stop().await;
    let started = std::time::Instant::now();
    node.kubelet.admit_to("ns/f", "c", MEM, 2).await?;
    assert!(started.elapsed() < Duration::from_secs(2), "Allocate waited for the API server");
    let used = |s: &NodeGpuState| s.gpus.iter().map(|g| g.units_total - g.units_free).sum::<u32>();
    assert!(published(&api).is_some_and(|s| used(&s) == 20), "nothing written while away");
    api.start_again().await?;
    published_when(&api, "the grant made while the API server was away", |s| used(s) == 22).await?;

    // A restarted agent writes at start, even an unchanged state.
    stop(agent, token).await?;
    let before = api.requests().iter().filter(|r| r.method == "PATCH").count();
    let (agent, token) = node.start_with(Some(client)).await?;
    let mut requests = api.watch_requests();
    tokio::time::timeout(WAIT, async {
        while api.requests().iter().filter(|r| r.method == "PATCH").count() == before {
            requests.changed().await?;
        }
        anyhow::Ok(())
    })
    .await??;
    assert_eq!(published(&api).map(|s| used(&s)), Some(22));
    stop(agent, token).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_told_to_publish_without_an_api_does_not_start() -> Result<()> {
    let mut node = TestNode::new("l4-4x-pcie.yaml", Backend::Simulated).await?;
    node.config.annotation.enabled = true;
    let err = node.start().await.err().context("started without an API")?;
    assert!(format!("{err:#}").contains("no Kubernetes API client"), "{err:#}");
    Ok(())
}
