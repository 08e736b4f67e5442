//! The extender against a fake Kubernetes API server: its Node and Pod watchers fill the cache
//! (`nodeCacheCapable: true`), pods bound but not yet in their node's annotation count as
//! placed, an agent's annotation patch flows to the extender, and the API server going away
//! and coming back (with changes made meanwhile) leaves the cache right.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, Result};
use baleen_extender::run::{Config, Running, start};
use baleen_extender::service::Settings;
use baleen_tests::fake_apiserver::FakeApiServer;
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

use crate::support::poll_within;

const WAIT: Duration = Duration::from_secs(20);
const KEY: &str = "awesome-ai-company.com/gpu-state";

fn state(name: &str, free: &[u32], pods: &[&str]) -> String {
    let mut state = baleen_k8s::fixtures::h200_state(name, free);
    state.resources = vec!["awesome-ai-company.com/gpu-memory".into()];
    for gpu in &mut state.gpus {
        gpu.numa_node = None;
    }
    if let Some(first) = state.gpus.first_mut() {
        first.pods = pods.iter().map(|p| (*p).to_owned()).collect();
    }
    state.to_json()
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
    extender_listening(api, None).await
}

/// [`extender`], with its metrics and probe listeners at `health` (both), if given.
async fn extender_listening(
    api: &FakeApiServer,
    health: Option<std::net::SocketAddr>,
) -> Result<(Running, CancellationToken)> {
    let client = kube::Client::try_from(kube::Config::new(api.url().parse()?))?;
    let token = CancellationToken::new();
    let config = Config {
        listen: "127.0.0.1:0".parse()?,
        prefix: String::new(),
        settings: Settings::default(),
        metrics_listen: health,
        probe_listen: health,
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

/// How a burst's pods are bound.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Binder {
    /// kube-scheduler binds through the API server (no `bindVerb`): the extender learns of a
    /// binding only from its Pod watch.
    ApiServer,
    /// The extender's `bind` verb.
    Extender,
}

/// Plays kube-scheduler on `pods` one after the other, as fast as it goes, while the API
/// server's watches are held (a loaded API server, a watch seconds behind): filter over
/// `nodes`, prioritize, the best score wins (ties by name), bound by `binder`. Each pod's node,
/// or `None` where no node passed or the binding was refused.
async fn burst(
    api: &FakeApiServer,
    running: &Running,
    nodes: &[&str],
    pods: &[Value],
    binder: Binder,
) -> Result<Vec<Option<String>>> {
    let address = running.address;
    let api_address: std::net::SocketAddr = api.url().trim_start_matches("http://").parse()?;
    let call = async |path: &str, body: Value| -> Result<Value> {
        let (status, text) =
            baleen_tests::http::request(address, "POST", path, &body.to_string()).await?;
        anyhow::ensure!(status == 200, "{path}: {status} {text}");
        Ok(serde_json::from_str(&text)?)
    };
    api.hold_watches();
    let mut placed = Vec::new();
    for pod in pods {
        let filtered = call("/filter", json!({"Pod": pod, "NodeNames": nodes})).await?;
        let passed = filtered["NodeNames"].as_array().cloned().unwrap_or_default();
        if passed.is_empty() {
            placed.push(None);
            continue;
        }
        let scores = call("/prioritize", json!({"Pod": pod, "NodeNames": passed})).await?;
        let best = scores
            .as_array()
            .context("scores")?
            .iter()
            .filter_map(|s| Some((s["Score"].as_i64()?, s["Host"].as_str()?.to_owned())))
            .max_by(|a, b| a.0.cmp(&b.0).then(b.1.cmp(&a.1)))
            .map(|(_, host)| host)
            .context("a best node")?;
        let name = pod["metadata"]["name"].as_str().context("name")?;
        let bound = match binder {
            Binder::ApiServer => {
                let path = format!("/api/v1/namespaces/ns/pods/{name}/binding");
                let binding = json!({"target": {"name": best}}).to_string();
                let (status, text) =
                    baleen_tests::http::request(api_address, "POST", &path, &binding).await?;
                anyhow::ensure!(status == 201, "binding: {status} {text}");
                true
            }
            Binder::Extender => {
                let args = json!({"PodName": name, "PodNamespace": "ns",
                                  "PodUID": pod["metadata"]["uid"], "Node": best});
                let answer = call("/bind", args).await?;
                answer["Error"].as_str().is_some_and(str::is_empty)
            }
        };
        placed.push(bound.then_some(best));
    }
    api.release_watches();
    Ok(placed)
}

/// The most pods any node got.
fn most_on_one_node(placed: &[Option<String>]) -> usize {
    let mut per_node = std::collections::BTreeMap::<&str, usize>::new();
    for node in placed.iter().flatten() {
        *per_node.entry(node).or_default() += 1;
    }
    per_node.values().copied().max().unwrap_or(0)
}

/// Issue 25, item 2: a burst of pods of half a GPU each, submitted faster than the Pod watch
/// follows (KAI-Scheduler#2153: 16 pods of half a GPU on 8 GPUs gave 3-4 per card). Bound
/// through the API server, the extender sees none of the burst's bindings and sends several to
/// one GPU; bound by its `bind` verb, never more than a GPU holds, on eight one-GPU nodes and on
/// one eight-GPU node, and the pod past the last room finds none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_bound_by_the_extender_never_packs_past_a_gpu() -> Result<()> {
    // Eight nodes of one 140-unit GPU: 16 pods of 70 units fit two to a node, no more.
    let singles: Vec<String> = (0..8).map(|i| format!("single-{i}")).collect();
    let names: Vec<&str> = singles.iter().map(String::as_str).collect();
    for binder in [Binder::ApiServer, Binder::Extender] {
        let api = FakeApiServer::start(&[]).await?;
        for name in &names {
            api.put_node(node(name, &[140]));
        }
        let pods: Vec<Value> = (0..16).map(|i| pod(&format!("half-{i}"), 70, None)).collect();
        for p in &pods {
            api.put_pod(p.clone());
        }
        let (running, token) = extender(&api).await?;
        let extender = running.extender.clone();
        poll_within(WAIT, "the nodes and pods listed", async || {
            let view = extender.cluster.read().map_err(|_| anyhow::anyhow!("poisoned"))?;
            Ok((extender.synced() && view.node_count() == 8 && view.has_pod("uid-half-15"))
                .then_some(()))
        })
        .await?;
        let placed = burst(&api, &running, &names, &pods, binder).await?;
        let most = most_on_one_node(&placed);
        match binder {
            // What the race does without the verb: the test that fails without bind.
            Binder::ApiServer => {
                assert!(most > 2, "bound behind the watch's back, one GPU got {most}: {placed:?}")
            }
            Binder::Extender => {
                assert_eq!(most, 2, "{placed:?}");
                assert!(placed.iter().all(Option::is_some), "all 16 fit: {placed:?}");
            }
        }
        token.cancel();
        tokio::time::timeout(WAIT, running.wait()).await?;
    }

    // One node of eight 140-unit GPUs: 16 pods of 70 fill it; the 17th finds no room.
    let api = FakeApiServer::start(&[]).await?;
    api.put_node(node("eight", &[140; 8]));
    let pods: Vec<Value> = (0..17).map(|i| pod(&format!("share-{i}"), 70, None)).collect();
    let (running, token) = extender(&api).await?;
    let extender = running.extender.clone();
    poll_within(WAIT, "the node listed", async || {
        let view = extender.cluster.read().map_err(|_| anyhow::anyhow!("poisoned"))?;
        Ok((extender.synced() && view.node_count() == 1).then_some(()))
    })
    .await?;
    // Not seen by the watch at all (created while it is held): bind reads them from the API.
    api.hold_watches();
    for p in &pods {
        api.put_pod(p.clone());
    }
    let placed = burst(&api, &running, &["eight"], &pods, Binder::Extender).await?;
    assert!(placed[..16].iter().all(|p| p.as_deref() == Some("eight")), "{placed:?}");
    assert_eq!(placed[16], None, "the 17th has no room: {placed:?}");
    for p in &pods[..16] {
        let key = format!("ns/{}", p["metadata"]["name"].as_str().context("name")?);
        let bound = api.pod(&key).context("the pod")?;
        assert_eq!(bound["spec"]["nodeName"], "eight", "bound through the API server: {key}");
    }
    token.cancel();
    tokio::time::timeout(WAIT, running.wait()).await?;
    Ok(())
}

/// Two bindings at once for the last room of a GPU: one is bound, the other refused (the check
/// and the count are one step), and a pod already bound there is bound again without a second
/// count.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_bindings_for_the_last_room_bind_one() -> Result<()> {
    let api = FakeApiServer::start(&[]).await?;
    api.put_node(node("a", &[100]));
    for name in ["x", "y"] {
        api.put_pod(pod(name, 100, None));
    }
    let (running, token) = extender(&api).await?;
    let extender = running.extender.clone();
    poll_within(WAIT, "listed", async || {
        let view = extender.cluster.read().map_err(|_| anyhow::anyhow!("poisoned"))?;
        Ok((extender.synced() && view.has_pod("uid-x") && view.has_pod("uid-y")).then_some(()))
    })
    .await?;
    api.hold_watches();
    let bind = |name: &'static str| {
        let address = running.address;
        async move {
            let args = json!({"PodName": name, "PodNamespace": "ns", "PodUID": format!("uid-{name}"), "Node": "a"});
            let (status, text) =
                baleen_tests::http::request(address, "POST", "/bind", &args.to_string()).await?;
            anyhow::ensure!(status == 200, "{status} {text}");
            let answer: Value = serde_json::from_str(&text)?;
            Ok::<String, anyhow::Error>(answer["Error"].as_str().unwrap_or_default().to_owned())
        }
    };
    // Issue 39, item 7: a UID of one pod with the name of another is refused (the room was
    // checked for the one, the Binding would be made for the other), and neither is bound.
    let args = json!({"PodName": "y", "PodNamespace": "ns", "PodUID": "uid-x", "Node": "a"});
    let (_, text) =
        baleen_tests::http::request(running.address, "POST", "/bind", &args.to_string()).await?;
    let answer: Value = serde_json::from_str(&text)?;
    let error = answer["Error"].as_str().unwrap_or_default();
    assert!(error.contains("the UID uid-x is the pod ns/x's"), "{text}");
    assert!(api.pod("ns/y").is_some_and(|p| p["spec"]["nodeName"].is_null()), "y not bound");
    let (x, y) = tokio::join!(bind("x"), bind("y"));
    let mut errors = [x?, y?];
    errors.sort();
    assert_eq!(errors[0], "", "one is bound: {errors:?}");
    assert!(errors[1].contains("no longer has room"), "the other is refused: {errors:?}");
    let winner =
        if api.pod("ns/x").is_some_and(|p| p["spec"]["nodeName"] == "a") { "x" } else { "y" };
    // Bound again (kube-scheduler retrying after a lost answer): the same answer, no second count.
    assert_eq!(bind(winner).await?, "");
    api.release_watches();
    token.cancel();
    tokio::time::timeout(WAIT, running.wait()).await?;
    Ok(())
}

/// Issue 40, item 5: kube-scheduler binds in a goroutine per pod, many at once, and each bind
/// waits for the API server. With four turns, as the other verbs have, binds capped the real
/// kube-scheduler's burst at four Bindings in flight (0.6x its throughput without the
/// extender). With every Binding answered a second late: 16 binds at once all finish within
/// about a second (four seconds before), and a filter among them is answered at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn binds_waiting_for_the_api_server_hold_back_neither_each_other_nor_a_filter() -> Result<()>
{
    let api = FakeApiServer::start(&[]).await?;
    api.put_node(node("eight", &[140; 8]));
    let pods: Vec<Value> = (0..16).map(|i| pod(&format!("slow-{i}"), 10, None)).collect();
    for p in &pods {
        api.put_pod(p.clone());
    }
    let (running, token) = extender(&api).await?;
    let extender = running.extender.clone();
    poll_within(WAIT, "listed", async || {
        let view = extender.cluster.read().map_err(|_| anyhow::anyhow!("poisoned"))?;
        Ok((extender.synced() && view.has_pod("uid-slow-15")).then_some(()))
    })
    .await?;
    let delay = Duration::from_secs(1);
    api.slow_bindings(delay);
    let address = running.address;
    let started = std::time::Instant::now();
    let binds: Vec<_> = (0..16)
        .map(|i| {
            tokio::spawn(async move {
                let name = format!("slow-{i}");
                let args = json!({"PodName": name, "PodNamespace": "ns",
                                  "PodUID": format!("uid-{name}"), "Node": "eight"});
                baleen_tests::http::request(address, "POST", "/bind", &args.to_string()).await
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let filtered = std::time::Instant::now();
    let args = json!({"Pod": pods[0], "NodeNames": ["eight"]});
    let (status, text) =
        baleen_tests::http::request(address, "POST", "/filter", &args.to_string()).await?;
    let filter_took = filtered.elapsed();
    anyhow::ensure!(status == 200, "filter: {status} {text}");
    anyhow::ensure!(
        filter_took < Duration::from_millis(500),
        "a filter waited {filter_took:?} behind binds waiting for the API server"
    );
    for bind in binds {
        let (status, text) = bind.await??;
        let answer: Value = serde_json::from_str(&text)?;
        anyhow::ensure!(status == 200 && answer["Error"] == "", "bind: {status} {text}");
    }
    let all = started.elapsed();
    // Four at a time, 16 binds of a second each took four seconds.
    anyhow::ensure!(all < delay * 2, "16 binds of {delay:?} each took {all:?}: not all at once");
    for p in &pods {
        let key = format!("ns/{}", p["metadata"]["name"].as_str().context("name")?);
        let bound = api.pod(&key).context("the pod")?;
        anyhow::ensure!(bound["spec"]["nodeName"] == "eight", "{key} not bound");
    }
    token.cancel();
    tokio::time::timeout(WAIT, running.wait()).await?;
    Ok(())
}

/// Found by the real kube-scheduler (issue 40, item 5): it gives up on a bind after its
/// httpTimeout and closes the connection. A bind dropped then, between counting the pod on its
/// node and the API server's answer, left the pod counted there and never bound, and every
/// later bind of it refused as "already bound" (one pod of a 1,000-pod burst, for good). Here
/// the Binding is answered a second late and the caller hangs up after 200 ms: the pod is
/// bound all the same, and kube-scheduler's retry to that node is answered as done.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bind_whose_caller_hangs_up_still_ends() -> Result<()> {
    use tokio::io::AsyncWriteExt as _;
    let api = FakeApiServer::start(&[]).await?;
    api.put_node(node("eight", &[140; 8]));
    api.put_pod(pod("late", 10, None));
    let (running, token) = extender(&api).await?;
    let extender = running.extender.clone();
    poll_within(WAIT, "listed", async || {
        let view = extender.cluster.read().map_err(|_| anyhow::anyhow!("poisoned"))?;
        Ok((extender.synced() && view.has_pod("uid-late")).then_some(()))
    })
    .await?;
    api.slow_bindings(Duration::from_secs(1));
    let args =
        json!({"PodName": "late", "PodNamespace": "ns", "PodUID": "uid-late", "Node": "eight"})
            .to_string();
    let mut stream = tokio::net::TcpStream::connect(running.address).await?;
    stream
        .write_all(
            format!(
                "POST /bind HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{args}",
                args.len()
            )
            .as_bytes(),
        )
        .await?;
    tokio::time::sleep(Duration::from_millis(200)).await;
    drop(stream);
    poll_within(WAIT, "the pod bound after its caller left", async || {
        Ok(api.pod("ns/late").is_some_and(|p| p["spec"]["nodeName"] == "eight").then_some(()))
    })
    .await?;
    api.slow_bindings(Duration::ZERO);
    let (status, text) =
        baleen_tests::http::request(running.address, "POST", "/bind", &args).await?;
    let answer: Value = serde_json::from_str(&text)?;
    anyhow::ensure!(status == 200 && answer["Error"] == "", "the retry: {status} {text}");
    token.cancel();
    tokio::time::timeout(WAIT, running.wait()).await?;
    Ok(())
}

/// One HTTP/1.1 GET over a keep-alive connection from `127.0.0.<source>`, left open; whether
/// `200` came back.
async fn held_get(source: u8, to: std::net::SocketAddr) -> Result<(tokio::net::TcpStream, bool)> {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let socket = tokio::net::TcpSocket::new_v4()?;
    socket.bind(std::net::SocketAddr::from(([127, 0, 0, source], 0)))?;
    let mut stream = socket.connect(to).await?;
    stream.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n").await?;
    let mut buf = [0u8; 256];
    let answered = matches!(
        tokio::time::timeout(Duration::from_secs(2), stream.read(&mut buf)).await,
        Ok(Ok(n)) if n > 0 && buf.starts_with(b"HTTP/1.1 200")
    );
    Ok((stream, answered))
}

/// Issue 39, item 1: every slot of the extender's metrics port held by keep-alive connections
/// from many addresses (its liveness probe there once answered 0 of 60): the probe listener,
/// on the loopback address the kubelet's exec probe reaches, answers every probe, and a scrape
/// from another address is still answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_the_metrics_port_starves_neither_the_probes_nor_a_scrape() -> Result<()> {
    let api = FakeApiServer::start(&["a"]).await?;
    let (running, token) = extender_listening(&api, Some("127.0.0.1:0".parse()?)).await?;
    let metrics = running.metrics_address.context("metrics")?;
    let probes = running.probe_address.context("probes")?;
    let mut hoard = Vec::new();
    for i in 0..baleen_extender::http::LIMITS.total + 64 {
        hoard.push(held_get(2 + u8::try_from(i % 8)?, metrics).await?.0);
    }
    for _ in 0..60 {
        let (code, body) = baleen_tests::http::request(probes, "GET", "/healthz", "").await?;
        anyhow::ensure!(code == 200, "a probe: {code} {body}");
    }
    let (_, answered) = held_get(40, metrics).await?;
    anyhow::ensure!(answered, "a scrape from another address was not served");
    drop(hoard);
    token.cancel();
    Ok(())
}
