//! Co-location: classes from the API's pods and namespaces reach the pods' cgroups and MPS priorities, and survive restarts.

use super::*;

/// A cgroup v2 tree with each pod's directory (systemd driver), files at the kernel's defaults.
pub(super) fn cgroup_tree(
    root: &Path,
    pods: &[(&str, baleen_agent::isolation::cgroups::Qos)],
) -> Result<()> {
    use baleen_agent::isolation::cgroups::{Driver, Layout};
    std::fs::create_dir_all(root)?;
    std::fs::write(root.join("cgroup.controllers"), "cpuset cpu io memory pids\n")?;
    let layout = Layout::detect(root, Driver::Systemd)?;
    for (uid, qos) in pods {
        let dir = layout.pod_dir("cpu", *qos, uid);
        std::fs::create_dir_all(&dir)?;
        for (file, value) in [
            ("cpu.weight", "100"),
            ("cpu.max", "max 100000"),
            ("memory.low", "0"),
            ("cpu.idle", "0"),
        ] {
            std::fs::write(dir.join(file), value)?;
        }
    }
    Ok(())
}

fn cgroup_file(
    root: &Path,
    uid: &str,
    qos: baleen_agent::isolation::cgroups::Qos,
    file: &str,
) -> String {
    use baleen_agent::isolation::cgroups::{Driver, Layout};
    let layout = Layout::detect(root, Driver::Systemd).expect("a tree");
    std::fs::read_to_string(layout.pod_dir("cpu", qos, uid).join(file))
        .expect("readable")
        .trim()
        .to_owned()
}

/// The MPS client priority an Allocate answer carries.
fn priority(a: &baleen_tests::fake_kubelet::Admission) -> Option<&str> {
    a.response
        .envs
        .get(baleen_agent::isolation::pod_identity::PRIORITY_VARIABLE)
        .map(String::as_str)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn colocation_classes_reach_the_pods_cgroups_and_mps_priorities_and_survive_restarts()
-> Result<()> {
    use baleen_agent::isolation::cgroups::Qos;
    let mut node = TestNode::new("l4-4x-pcie.yaml", Backend::Simulated).await?;
    let cgroups = node.config.state_dir.parent().context("root")?.join("cgroup");
    cgroup_tree(
        &cgroups,
        &[
            ("uid-serve", Qos::Guaranteed),
            ("uid-train", Qos::BestEffort),
            ("uid-old", Qos::BestEffort),
            ("uid-other", Qos::Guaranteed),
        ],
    )?;
    node.config.colocation = baleen_agent::run::colocation::ColocationConfig {
        enabled: true,
        cgroup_root: cgroups.clone(),
        identify_wait: Duration::from_millis(500),
        resync: Duration::from_millis(200),
        ..Default::default()
    };
    let mut api = baleen_tests::fake_apiserver::FakeApiServer::start(&["node-a", "node-b"]).await?;
    api.put_node(serde_json::json!({
        "metadata": {"name": "node-a"}, "status": {"allocatable": {"cpu": "8", "memory": "64Gi"}}
    }));
    // Classes come from namespaces, labelled by the cluster admin: `serving` is an inference
    // namespace; `ml` has no label (the default class, training).
    let class = baleen_agent::isolation::colocation::CLASS_LABEL;
    api.put_namespace(
        serde_json::json!({"metadata": {"name": "serving", "labels": {class: "inference"}}}),
    );
    api.put_namespace(serde_json::json!({"metadata": {"name": "ml"}}));
    // Being admitted: two inference pods and a training pod; already running: a training pod
    // with the same ask as the second inference pod (not a candidate); on another node: an
    // inference pod the agent must not see.
    api.put_pod(api_pod("serve", "node-a", "Guaranteed", None, "Pending", 4));
    api.put_pod(api_pod("train", "node-a", "BestEffort", None, "Pending", 6));
    api.put_pod(api_pod("serve2", "node-a", "Guaranteed", None, "Pending", 6));
    api.put_pod(api_pod("old", "node-a", "BestEffort", None, "Running", 6));
    api.put_pod(api_pod("other", "node-b", "Guaranteed", None, "Running", 6));
    let client = baleen_agent::kube_api::KubeNodeApi::at(&api.url())?;
    let (agent, token) = node.start_with(Some(client.clone())).await?;
    node.registered(&agent, 1).await?;

    // One candidate: the inference pod's client at normal priority.
    let serve = node.kubelet.admit_to("serving/serve", "c", MEM, 4).await?;
    assert_eq!(priority(&serve), Some("0"));
    // Two candidates of different classes with the same ask (the pending training and inference
    // pods asking 6): the default class, training, below normal.
    let train = node.kubelet.admit_to("ml/train", "c", MEM, 6).await?;
    assert_eq!(priority(&train), Some("1"));
    // The training pod's container is now listed by the kubelet: the second inference pod is the
    // one candidate left (the running training pod asking 6 is not one, or this would be
    // ambiguous and get the default class).
    eventually("the training pod listed", || {
        agent
            .resources()
            .grants()
            .iter()
            .any(|(_, _, _, k)| k.as_ref().is_some_and(|k| k.pod == "train"))
    })
    .await?;
    let serve2 = node.kubelet.admit_to("serving/serve2", "c", MEM, 6).await?;
    assert_eq!(priority(&serve2), Some("0"));
    // Two pods of different classes with the same ask: the default class (training). The
    // second labels itself `inference`, which counts for nothing: its namespace is `ml`.
    api.put_pod(api_pod("a", "node-a", "Guaranteed", None, "Pending", 2));
    api.put_pod(api_pod("b", "node-a", "Burstable", Some("inference"), "Pending", 2));
    // (Both in the agent's view before the Allocate: the first alone would be one candidate.)
    tokio::time::sleep(Duration::from_millis(200)).await;
    let either = node.kubelet.admit_to("serving/a", "c", MEM, 2).await?;
    assert_eq!(priority(&either), Some("1"), "ambiguous: the default class");
    // No pod at all with this ask: the default class after the wait.
    let started = std::time::Instant::now();
    let nobody = node.kubelet.admit_to("ml/ghost", "c", MEM, 1).await?;
    assert_eq!(priority(&nobody), Some("1"));
    assert!(started.elapsed() >= Duration::from_millis(400), "waited for the pod to appear");

    // Running: the inference pod gets weight 1000 (10240 shares: cgroup v2 weight 391) capped
    // at its 2 cores plus the 6 nobody requested, and its memory protected; the training pods keep
    // the kubelet's weight and together get a cap of the allocatable CPU less the inference
    // requests (8 - 2 = 6 cores, 3 each, never below their requests); the other node's
    // inference pod is not counted.
    api.put_pod(api_pod("serve", "node-a", "Guaranteed", None, "Running", 4));
    api.put_pod(api_pod("train", "node-a", "BestEffort", None, "Running", 6));
    let f = |uid: &str, qos, file: &str| cgroup_file(&cgroups, uid, qos, file);
    eventually("the classes applied", || {
        f("uid-train", Qos::BestEffort, "cpu.max") == "300000 100000"
            && f("uid-serve", Qos::Guaranteed, "cpu.weight") == "391"
            && f("uid-serve", Qos::Guaranteed, "cpu.max") == "800000 100000"
            && f("uid-serve", Qos::Guaranteed, "memory.low") == (4u64 << 30).to_string()
    })
    .await?;
    assert_eq!(f("uid-serve", Qos::Guaranteed, "memory.low"), (4u64 << 30).to_string());
    // Training keeps the kubelet's weight and is not SCHED_IDLE (the opt-in).
    assert_eq!(f("uid-train", Qos::BestEffort, "cpu.idle"), "0");
    assert_eq!(f("uid-train", Qos::BestEffort, "cpu.weight"), "100");
    assert_eq!(f("uid-other", Qos::Guaranteed, "cpu.weight"), "100", "another node's pod");
    let state = node.config.state_dir.join("colocation.json");
    assert!(state.is_file(), "what to put back is kept");
    // Seen on /metrics: co-location runs, its pods by class, and how each MPS client's pod was
    // found (serve and serve2: one candidate; train and a: ambiguous; ghost: none).
    let text = http_get(agent.metrics_address().context("metrics")?, "/metrics").await?.1;
    for series in [
        r#"baleen_colocation_up{node="node-a"} 1"#,
        r#"baleen_colocation_failures_total{node="node-a"} 0"#,
        r#"baleen_colocation_pods{class="inference",node="node-a"} 1"#,
        r#"baleen_colocation_pods{class="training",node="node-a"} 2"#,
        r#"baleen_mps_client_priorities_total{class="inference",identity="pod",node="node-a"} 2"#,
        r#"baleen_mps_client_priorities_total{class="training",identity="ambiguous",node="node-a"} 2"#,
        r#"baleen_mps_client_priorities_total{class="training",identity="unknown",node="node-a"} 1"#,
    ] {
        assert!(text.lines().any(|l| l == series), "{series} not in:\n{text}");
    }

    // The kubelet rewrites a weight: written again at the next resync.
    let layout = baleen_agent::isolation::cgroups::Layout::detect(
        &cgroups,
        baleen_agent::isolation::cgroups::Driver::Systemd,
    )?;
    std::fs::write(layout.pod_dir("cpu", Qos::Guaranteed, "uid-serve").join("cpu.weight"), "1")?;
    eventually("the weight written again", || {
        f("uid-serve", Qos::Guaranteed, "cpu.weight") == "391"
    })
    .await?;

    // A crash and a restart: the values stay, and the agent goes on from what it saved.
    drop(agent);
    token.cancel();
    let (agent, token) = node.start_with(Some(client.clone())).await?;
    // The API server goes away; meanwhile the inference pods end. Once it is back, the agent
    // lists again: the training cap goes, the inference pods' values are put back.
    api.stop().await;
    api.delete_pod("serving/serve");
    api.delete_pod("ml/old");
    api.start_again().await?;
    eventually("the cap lifted, the inference values put back", || {
        f("uid-train", Qos::BestEffort, "cpu.max") == "max 100000"
            && f("uid-serve", Qos::Guaranteed, "cpu.weight") == "1"
    })
    .await?;
    assert_eq!(f("uid-serve", Qos::Guaranteed, "cpu.weight"), "1", "the kubelet's value put back");
    assert_eq!(f("uid-serve", Qos::Guaranteed, "memory.low"), "0", "put back");
    assert_eq!(f("uid-train", Qos::BestEffort, "cpu.weight"), "100", "never touched");
    assert_eq!(f("uid-train", Qos::BestEffort, "cpu.idle"), "0");
    stop(agent, token).await?;

    // Co-location switched off: everything put back at start, the saved state gone.
    node.config.colocation.enabled = false;
    let before = node.kubelet.wait_for("the kubelet's view", WAIT, |_| true).await?;
    let registrations = before.registrations.get(MEM).copied().unwrap_or(0);
    let (agent, token) = node.start_with(None).await?;
    assert_eq!(f("uid-train", Qos::BestEffort, "cpu.weight"), "100", "the kernel's value back");
    assert!(!state.exists());
    // Admitted once the new agent's gpu-memory plugin has registered (before, the kubelet
    // could still dial the stopped agent's socket).
    node.kubelet
        .wait_for("gpu-memory registered again", WAIT, |v| {
            v.registrations.get(MEM).copied().unwrap_or(0) > registrations
                && v.streaming.contains(MEM)
        })
        .await?;
    let plain = node.kubelet.admit_to("ml/plain", "c", MEM, 1).await?;
    assert_eq!(priority(&plain), None, "no priority without co-location");
    stop(agent, token).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_node_pods_view_sees_only_its_node_follows_binding_and_the_api_coming_back()
-> Result<()> {
    use baleen_agent::kube_api::NodeApi as _;
    let mut api = baleen_tests::fake_apiserver::FakeApiServer::start(&["node-a", "node-b"]).await?;
    let address: std::net::SocketAddr = api.url().trim_start_matches("http://").parse()?;
    // A field selector the API server cannot answer is refused, as the real one refuses it.
    let (code, body) = baleen_tests::http::request(
        address,
        "GET",
        "/api/v1/pods?fieldSelector=status.hostIP%3D1.2.3.4",
        "",
    )
    .await?;
    assert_eq!(code, 400, "{body}");
    api.put_pod(api_pod("mine", "node-a", "Guaranteed", None, "Running", 1));
    api.put_pod(api_pod("theirs", "node-b", "Guaranteed", None, "Running", 1));
    api.put_pod(api_pod("unbound", "", "BestEffort", None, "Pending", 2));
    let client = baleen_agent::kube_api::KubeNodeApi::at(&api.url())?;
    let (view, mut pods) =
        tokio::sync::watch::channel(baleen_agent::isolation::node_pods::NodePods::default());
    let token = CancellationToken::new();
    let follower = {
        let (client, token) = (client.clone(), token.clone());
        tokio::spawn(async move { client.follow_pods("node-a", view, token).await })
    };
    let names = |v: &baleen_agent::isolation::node_pods::NodePods| -> Vec<String> {
        v.pods.values().map(|p| p.name.clone()).collect()
    };
    let mut until =
        async |what: &str, ok: &dyn Fn(&baleen_agent::isolation::node_pods::NodePods) -> bool| {
            tokio::time::timeout(WAIT, pods.wait_for(|v| v.synced && ok(v)))
                .await
                .with_context(|| format!("waiting for {what}"))?
                .map(|v| v.clone())
                .context("the follower ended")
        };
    until("the first list", &|v| names(v) == ["mine"]).await?;
    // Bound to this node: it comes into the view (a watch with the selector sees ADDED).
    let binding = serde_json::json!({"target": {"kind": "Node", "name": "node-a"}}).to_string();
    let (code, _) = baleen_tests::http::request(
        address,
        "POST",
        "/api/v1/namespaces/ml/pods/unbound/binding",
        &binding,
    )
    .await?;
    assert_eq!(code, 201);
    let seen = until("the bound pod", &|v| names(v).len() == 2).await?;
    assert_eq!(seen.pods["uid-unbound"].asks.len(), 1);
    // The API server goes away; a pod ends meanwhile; once it is back the watch goes on (or
    // lists again) and the pod is gone from the view.
    api.stop().await;
    api.delete_pod("serving/mine");
    api.start_again().await?;
    until("the ended pod gone", &|v| names(v) == ["unbound"]).await?;
    token.cancel();
    tokio::time::timeout(WAIT, follower).await??;
    Ok(())
}

/// Issue 21, item 5: the namespaces' class labels are followed (a label selector: namespaces
/// without the label are not even listed), labels added, changed and removed, and the pods'
/// view is kept beside them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_namespaces_class_labels_are_followed() -> Result<()> {
    use baleen_agent::kube_api::NodeApi as _;
    let class = baleen_agent::isolation::colocation::CLASS_LABEL;
    let api = baleen_tests::fake_apiserver::FakeApiServer::start(&["node-a"]).await?;
    api.put_namespace(
        serde_json::json!({"metadata": {"name": "serving", "labels": {class: "inference"}}}),
    );
    api.put_namespace(serde_json::json!({"metadata": {"name": "ml", "labels": {"team": "a"}}}));
    api.put_pod(api_pod("mine", "node-a", "Guaranteed", None, "Running", 1));
    let client = baleen_agent::kube_api::KubeNodeApi::at(&api.url())?;
    let (view, mut seen) =
        tokio::sync::watch::channel(baleen_agent::isolation::node_pods::NodePods::default());
    let token = CancellationToken::new();
    let followers = {
        let (client, token, view) = (client.clone(), token.clone(), view.clone());
        tokio::spawn(async move {
            tokio::join!(
                client.follow_namespaces(view.clone(), token.clone()),
                client.follow_pods("node-a", view, token)
            )
        })
    };
    let classes = |v: &baleen_agent::isolation::node_pods::NodePods| -> Vec<(String, String)> {
        v.namespace_classes.iter().map(|(k, v)| (k.clone(), v.clone())).collect()
    };
    let mut until = async |what: &str, want: Vec<(&str, &str)>| {
        let want: Vec<(String, String)> =
            want.into_iter().map(|(a, b)| (a.to_owned(), b.to_owned())).collect();
        tokio::time::timeout(
            WAIT,
            seen.wait_for(|v| v.ready() && v.pods.len() == 1 && classes(v) == want),
        )
        .await
        .with_context(|| format!("waiting for {what}"))?
        .map(drop)
        .context("the followers ended")
    };
    until("the first lists", vec![("serving", "inference")]).await?;
    api.put_namespace(
        serde_json::json!({"metadata": {"name": "ml", "labels": {class: "training"}}}),
    );
    until("a label added", vec![("ml", "training"), ("serving", "inference")]).await?;
    api.put_namespace(
        serde_json::json!({"metadata": {"name": "ml", "labels": {class: "inference"}}}),
    );
    until("a label changed", vec![("ml", "inference"), ("serving", "inference")]).await?;
    api.put_namespace(serde_json::json!({"metadata": {"name": "serving"}}));
    until("a label removed", vec![("ml", "inference")]).await?;
    let listed = api.requests().into_iter().any(|r| r.path == "/api/v1/namespaces");
    assert!(listed, "listed with the selector");
    token.cancel();
    tokio::time::timeout(WAIT, followers).await??;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_colocation_state_that_cannot_be_read_stops_colocation_not_the_agent() -> Result<()> {
    let mut node = TestNode::new("l4-4x-pcie.yaml", Backend::Simulated).await?;
    let cgroups = node.config.state_dir.parent().context("root")?.join("cgroup");
    cgroup_tree(&cgroups, &[])?;
    node.config.colocation = baleen_agent::run::colocation::ColocationConfig {
        enabled: true,
        cgroup_root: cgroups,
        ..Default::default()
    };
    std::fs::create_dir_all(&node.config.state_dir)?;
    let state = node.config.state_dir.join("colocation.json");
    std::fs::write(&state, "{ not json")?;
    let api = baleen_tests::fake_apiserver::FakeApiServer::start(&["node-a"]).await?;
    let client = baleen_agent::kube_api::KubeNodeApi::at(&api.url())?;
    let (agent, token) = node.start_with(Some(client)).await?;
    node.registered(&agent, 1).await?;
    // The devices are served; no class is given (co-location is not running); the file is
    // left for the operator to mend or remove.
    let a = node.kubelet.admit_to("ml/p", "c", MEM, 2).await?;
    assert_eq!(priority(&a), None);
    assert_eq!(std::fs::read_to_string(&state)?, "{ not json");
    let text = http_get(agent.metrics_address().context("metrics")?, "/metrics").await?.1;
    assert!(text.lines().any(|l| l == r#"baleen_colocation_up{node="node-a"} 0"#), "{text}");
    // Co-location does not run: its namespace watcher neither (the pods are followed all the
    // same: the reconciler asks the API about pods the kubelet stops listing).
    assert!(!api.requests().iter().any(|r| r.path == "/api/v1/namespaces"), "no namespace watch");
    stop(agent, token).await
}

/// Issue 39, item 5: with `paths.podsKubeconfig` (the chart's `agent.podReads.with: kubelet`)
/// the node's pods are listed and watched with that kubeconfig's credentials (the kubelet's,
/// which the API server's Node authorizer holds to the pods of its node) and every other call
/// with the agent's own: the agent's account then needs no pod rights. A kubeconfig that makes
/// no client stops the agent at its start, naming the file.
#[tokio::test]
async fn the_node_pods_are_read_with_the_pods_kubeconfig_and_nothing_else_is() -> Result<()> {
    use baleen_agent::kube_api::{KubeNodeApi, NodeApi, client_from_kubeconfig};
    let api = baleen_tests::fake_apiserver::FakeApiServer::start(&["node-a", "node-b"]).await?;
    api.put_pod(api_pod("serve", "node-a", "Guaranteed", None, "Running", 4));
    api.put_pod(api_pod("other", "node-b", "Guaranteed", None, "Running", 4));
    let class = baleen_agent::isolation::colocation::CLASS_LABEL;
    api.put_namespace(
        serde_json::json!({"metadata": {"name": "serving", "labels": {class: "inference"}}}),
    );
    let dir = tempfile::tempdir()?;
    let kubeconfig = |name: &str, token: &str| -> Result<PathBuf> {
        let path = dir.path().join(name);
        std::fs::write(
            &path,
            format!(
                "apiVersion: v1\nkind: Config\ncurrent-context: c\nclusters:\n- name: k\n  cluster:\n    server: {}\ncontexts:\n- name: c\n  context:\n    cluster: k\n    user: u\nusers:\n- name: u\n  user:\n    token: {token}\n",
                api.url()
            ),
        )?;
        Ok(path)
    };
    let own = client_from_kubeconfig(&kubeconfig("agent.conf", "agent-token")?).await?;
    let kubelet = kubeconfig("kubelet.conf", "kubelet-token")?;
    let node_api = Arc::new(KubeNodeApi::reading_pods_with(own, Some(&kubelet)).await?);
    let (view, seen) = tokio::sync::watch::channel(Default::default());
    let token = CancellationToken::new();
    tokio::spawn({
        let (node_api, view, token) = (node_api.clone(), view.clone(), token.clone());
        async move { node_api.follow_pods("node-a", view, token).await }
    });
    tokio::spawn({
        let (node_api, token) = (node_api.clone(), token.clone());
        async move { node_api.follow_namespaces(view, token).await }
    });
    node_api.annotate("node-a", "awesome-ai-company.com/gpu-state", "{}").await?;
    eventually("the node's pods and the namespaces' classes listed", || {
        let v = seen.borrow();
        v.synced && v.namespaces_synced && !v.pods.is_empty()
    })
    .await?;
    let names: Vec<String> = seen.borrow().pods.values().map(|p| p.name.clone()).collect();
    assert_eq!(names, ["serve"], "only the pods bound to node-a");
    token.cancel();
    let requests = api.requests();
    let bearer = |t: &str| Some(format!("Bearer {t}"));
    let (pods, others): (Vec<_>, Vec<_>) = requests.iter().partition(|r| r.path.ends_with("/pods"));
    assert!(!pods.is_empty() && !others.is_empty(), "{requests:?}");
    for r in &pods {
        assert_eq!(r.authorization, bearer("kubelet-token"), "{} {}", r.method, r.path);
    }
    for r in &others {
        assert_eq!(r.authorization, bearer("agent-token"), "{} {}", r.method, r.path);
    }
    // No such file, or one that makes no client: an error naming it, before anything runs.
    let own = client_from_kubeconfig(&kubeconfig("agent2.conf", "agent-token")?).await?;
    let missing = dir.path().join("missing.conf");
    let Err(e) = KubeNodeApi::reading_pods_with(own.clone(), Some(&missing)).await else {
        panic!("a missing kubeconfig was taken");
    };
    let said = format!("{:#}", anyhow::Error::from(e));
    assert!(said.contains("missing.conf"), "{said}");
    let garbage = dir.path().join("garbage.conf");
    std::fs::write(&garbage, "users: [")?;
    let Err(e) = KubeNodeApi::reading_pods_with(own, Some(&garbage)).await else {
        panic!("a kubeconfig that is not one was taken");
    };
    let said = format!("{:#}", anyhow::Error::from(e));
    assert!(said.contains("garbage.conf"), "{said}");
    Ok(())
}
