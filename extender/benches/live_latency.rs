//! The extender's calls while the cluster changes under it as a live one does, timed from
//! kube-scheduler's side (issue 39, item 6). 5,000 annotated 8-GPU nodes; pods of 16 shapes
//! (a few common, most rare, as in a real workload); for each pod: its creation arrives through
//! the Pod watcher's own path (`baleen_extender::watch::Feed`, on a task of the runtime as the
//! watcher runs, the object converted and stored as the watcher does), then one `filter` of all
//! 5,000 names and one `prioritize` of the nodes that passed, sent as kube-scheduler sends them
//! (compact JSON, one kept-alive connection, a blocking client on its own thread); then the pod
//! bound to the best node (its update through the Pod watcher), its node's annotation rewritten
//! by its agent two pods later and another node's annotation changed (a pod ended there),
//! both through the Node watcher's path. Nothing waits for a change to land before the next
//! call: the watchers race the calls as they do in a cluster. The policy is rebuilt every 100
//! pods beside the calls (the extender's rebuilder, on its `SCHED_IDLE` thread).
//!
//! Printed: each pod's two calls from the first byte sent to the second answer read (p50, p99,
//! max), each verb's round trips, and what the extender's own latency histogram says of the
//! same calls (its share of calls within 0.5, 1 and 2 ms, beside the client's), so that a
//! histogram that misses queueing shows. Run:
//! `cargo bench -p baleen-extender --bench live_latency` (`LIVE_PODS`: pods timed, 4,000;
//! `LIVE_SHAPES`: how many of the 16 shapes, 16; `LIVE_NO_REBUILD=1`: no policy rebuilds, to
//! see what they cost the tail; `LIVE_FEED_TIMES=1`: how long each watcher's changes took).

use std::time::{Duration, Instant};

use baleen_extender::http::{Metrics, bind, router};
use baleen_extender::service::{Extender, Settings};
use baleen_extender::watch::{Feed, Object};
use baleen_k8s::watch::Change;
use k8s_openapi::api::core::v1::Node as KubeNode;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

mod support;
use support::{Call, Connection, FilterAnswer, Score, percentile};

const NODES: usize = 5000;
const GPUS: usize = 8;
const KEY: &str = "awesome-ai-company.com/gpu-state";
const DOMAIN: &str = "awesome-ai-company.com";

/// The shapes: gpu-memory units of an H200 (140 a GPU), CPU, memory in GiB; by how often they
/// come (the first is asked 16 times as often as the last).
const SHAPES: [(u32, u32, u32); 16] = [
    (8, 4, 16),
    (16, 8, 32),
    (4, 2, 8),
    (40, 8, 64),
    (20, 4, 32),
    (70, 16, 128),
    (140, 24, 256),
    (10, 2, 16),
    (35, 8, 48),
    (2, 1, 4),
    (24, 6, 32),
    (100, 16, 160),
    (12, 4, 24),
    (50, 12, 96),
    (6, 2, 8),
    (28, 6, 40),
];

fn node(name: &str, free: &[u32]) -> KubeNode {
    let state = baleen_k8s::fixtures::h200_state(name, free);
    serde_json::from_value(json!({
        "metadata": {"name": name, "annotations": {KEY: state.to_json()}},
        "status": {"allocatable": {"cpu": "192", "memory": "2000Gi"},
                   "capacity": {format!("{DOMAIN}/gpu-memory"): (free.len() * 140).to_string()}}}))
    .expect("node")
}

fn pod(i: usize, (units, cpu, memory): (u32, u32, u32), node: Option<&str>) -> Value {
    let mut pod = json!({
        "metadata": {"name": format!("p{i}"), "namespace": "bench", "uid": format!("u{i}")},
        "spec": {"schedulerName": "baleen", "containers": [{"name": "c", "image": "x", "resources": {
            "limits": {format!("{DOMAIN}/gpu-memory"): units},
            "requests": {"cpu": cpu.to_string(), "memory": format!("{memory}Gi")}}}]},
        "status": {"phase": "Pending"}});
    if let Some(node) = node {
        pod["spec"]["nodeName"] = json!(node);
    }
    pod
}

/// A watcher's task: takes each change from its channel and hands it to the watcher's feed,
/// as `baleen_extender::watch` does with the API server's events.
fn watcher<K: Object + Send + 'static>(
    feed: Feed<K>,
) -> tokio::sync::mpsc::UnboundedSender<Change<K>> {
    let (send, mut changes) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        let mut took = Vec::new();
        while let Some(change) = changes.recv().await {
            let t = Instant::now();
            feed.change(change);
            took.push(t.elapsed());
        }
        took.sort();
        if std::env::var_os("LIVE_FEED_TIMES").is_some() && !took.is_empty() {
            println!(
                "  feed {}: n={} p50={:?} p99={:?} max={:?}",
                std::any::type_name::<K>(),
                took.len(),
                percentile(&took, 500),
                percentile(&took, 990),
                took.last().expect("one")
            );
        }
    });
    send
}

/// Shares of `sorted` within 0.5, 1 and 2 ms.
fn shares(sorted: &[Duration]) -> [f64; 3] {
    [0.5, 1.0, 2.0].map(|ms| {
        let within = sorted.partition_point(|d| d.as_secs_f64() * 1e3 <= ms);
        within as f64 * 100.0 / sorted.len().max(1) as f64
    })
}

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(std::env::var("W").ok().and_then(|w| w.parse().ok()).unwrap_or(2))
        .enable_all()
        .build()
        .expect("runtime");
    let count = |var: &str, default: usize| {
        std::env::var(var).ok().and_then(|n| n.parse::<usize>().ok()).unwrap_or(default)
    };
    let timed = count("LIVE_PODS", 4000).max(100);
    let kinds = count("LIVE_SHAPES", SHAPES.len()).clamp(1, SHAPES.len());
    runtime.block_on(async move {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
        let extender = Extender::new(Settings::default());
        let nodes = watcher(Feed::nodes(extender.clone()));
        let pods = watcher(Feed::pods(extender.clone()));
        let names: Vec<String> = (0..NODES).map(|i| format!("node-{i:05}")).collect();
        let mut frees: Vec<Vec<u32>> = (0..NODES)
            .map(|_| (0..GPUS).map(|_| [140, 140, 140, 100, 60, 20][rng.random_range(0..6)]).collect())
            .collect();
        nodes
            .send(Change::Listed(names.iter().zip(&frees).map(|(n, f)| node(n, f)).collect()))
            .expect("node watcher");
        pods.send(Change::Listed(Vec::new())).expect("pod watcher");
        let token = CancellationToken::new();
        let registry = prometheus::Registry::new();
        let metrics = Metrics::new(registry.clone()).expect("metrics");
        let (address, server) =
            bind("127.0.0.1:0".parse().expect("addr"), router(extender.clone(), metrics, ""), token.clone())
                .await
                .expect("bind");
        tokio::spawn(server);
        if std::env::var_os("LIVE_NO_REBUILD").is_none() {
            tokio::spawn(extender.clone().run_rebuilder(token.clone()));
        }
        while extender.cluster.read().expect("lock").nodes().count() < NODES {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let weights: Vec<u32> = (0..16u32).take(kinds).map(|k| 16 - k).collect();
        let total: u32 = weights.iter().sum();
        let warm = 300;
        // The client's thread: blocking, as kube-scheduler is another process.
        let client = std::thread::spawn({
            let extender = extender.clone();
            let registry = registry.clone();
            move || {
                let all: Vec<&str> = names.iter().map(String::as_str).collect();
                let mut connection = Connection::open(address);
                let mut pods_times = Vec::with_capacity(timed);
                // Per pod, whether a policy rebuild was under way during its calls.
                let mut during: [Vec<Duration>; 2] = Default::default();
                // Per pod, whether it came within 16 pods of a new policy (its first pods of
                // each shape pay for what the rebuild did not warm).
                let mut after_swap: [Vec<Duration>; 2] = Default::default();
                let mut policy = std::sync::Arc::as_ptr(&extender.policy());
                let mut since_swap = usize::MAX;
                let mut trips: [Vec<Duration>; 2] = Default::default();
                // Per pod, its two round trips alone (the client's parse and body between them
                // left out: kube-scheduler's own work, not the extender's).
                let mut both = Vec::with_capacity(timed);
                let mut written: std::collections::VecDeque<usize> = Default::default();
                let mut handler_before = None;
                let mut started_timed = Instant::now();
                for i in 0..warm + timed {
                    if i == warm {
                        handler_before = Some(histograms(&registry));
                        started_timed = Instant::now();
                    }
                    let mut pick = rng.random_range(0..total);
                    let kind = weights
                        .iter()
                        .position(|w| {
                            if pick < *w {
                                return true;
                            }
                            pick -= w;
                            false
                        })
                        .expect("a shape");
                    let shape = SHAPES[kind];
                    let created = pod(i, shape, None);
                    pods.send(Change::Applied(serde_json::from_value(created.clone()).expect("pod")))
                        .expect("pod watcher");
                    let body = serde_json::to_vec(&Call { pod: &created, node_names: &all }).expect("json");
                    let rebuilding = !extender.learning().1;
                    let now = std::sync::Arc::as_ptr(&extender.policy());
                    since_swap = if now == policy { since_swap.saturating_add(1) } else { 0 };
                    policy = now;
                    let started = Instant::now();
                    let text = connection.post("/filter", &body).to_vec();
                    let filtered = started.elapsed();
                    let answer: FilterAnswer<'_> = serde_json::from_slice(&text).expect("json");
                    assert!(answer.error.is_empty(), "{}", answer.error);
                    let passed = answer.node_names.unwrap_or_default();
                    let body = serde_json::to_vec(&Call { pod: &created, node_names: &passed }).expect("json");
                    let sent = Instant::now();
                    let scored = connection.post("/prioritize", &body).to_vec();
                    let prioritized = sent.elapsed();
                    let elapsed = started.elapsed();
                    let scores: Vec<Score<'_>> = serde_json::from_slice(&scored).expect("json");
                    if i >= warm {
                        let rebuilding = rebuilding || !extender.learning().1;
                        during[usize::from(rebuilding)].push(elapsed);
                        after_swap[usize::from(since_swap < 16)].push(elapsed);
                        pods_times.push(elapsed);
                        both.push(filtered + prioritized);
                        trips[0].push(filtered);
                        trips[1].push(prioritized);
                    }
                    // Bound to the best node (kube-scheduler's own binding, seen by the Pod
                    // watcher); that node's agent rewrites its annotation two pods later.
                    let Some(best) = scores.iter().max_by_key(|s| s.score) else { continue };
                    let k = names.binary_search_by(|n| n.as_str().cmp(best.host)).expect("a node");
                    let bound = pod(i, shape, Some(best.host));
                    pods.send(Change::Applied(serde_json::from_value(bound).expect("pod")))
                        .expect("pod watcher");
                    if let Some(g) = frees[k].iter().position(|f| *f >= shape.0) {
                        frees[k][g] -= shape.0;
                    }
                    written.push_back(k);
                    if written.len() > 2
                        && let Some(k) = written.pop_front()
                    {
                        nodes.send(Change::Applied(node(&names[k], &frees[k]))).expect("node watcher");
                    }
                    // Elsewhere a pod ended: its node has room again.
                    let k = rng.random_range(0..NODES);
                    let g = rng.random_range(0..GPUS);
                    frees[k][g] = (frees[k][g] + 20).min(140);
                    nodes.send(Change::Applied(node(&names[k], &frees[k]))).expect("node watcher");
                }
                let wall = started_timed.elapsed();
                let handler_after = histograms(&registry);
                let made = ["kept", "patched", "afresh"].map(|how| extender.scores_made.with_label_values(&[how]).get())
                    .into_iter()
                    .chain([extender.scores_computed.get()])
                    .collect::<Vec<u64>>();
                (pods_times, after_swap, made, both, trips, during, handler_before.expect("warmed"), handler_after, wall, extender.learning())
            }
        });
        let (mut times, mut after_swap, made, mut both, mut trips, mut during, before, after, wall, learning) =
            tokio::task::spawn_blocking(move || client.join().expect("client")).await.expect("join");
        token.cancel();
        drop(extender);
        tokio::time::sleep(Duration::from_millis(100)).await;
        times.sort();
        for t in &mut trips {
            t.sort();
        }
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        println!(
            "{timed} pods ({kinds} shapes, {NODES} nodes, watch changes{} running; {} pods learned): filter + prioritize p50={:.2} ms p90={:.2} ms p99={:.2} ms max={:.2} ms; {:.0} pods/s with the harness's own work",
            if std::env::var_os("LIVE_NO_REBUILD").is_some() { "" } else { " and rebuilds" },
            learning.0,
            ms(percentile(&times, 500)),
            ms(percentile(&times, 900)),
            ms(percentile(&times, 990)),
            ms(*times.last().expect("times")),
            timed as f64 / wall.as_secs_f64(),
        );
        println!(
            "  prioritize answers made ahead: kept {}, patched {}, afresh {}; node scores computed for calls (the first batch's included): {}",
            made[0], made[1], made[2], made[3]
        );
        for (d, when) in after_swap.iter_mut().zip(["16 pods or more", "under 16 pods"]) {
            d.sort();
            if !d.is_empty() {
                println!(
                    "  pods {when} after a new policy: n={} p50={:.2} ms p99={:.2} ms",
                    d.len(),
                    ms(percentile(d, 500)),
                    ms(percentile(d, 990))
                );
            }
        }
        both.sort();
        println!(
            "  the two round trips alone (the client's parse and prioritize body left out): p50={:.2} ms p90={:.2} ms p99={:.2} ms max={:.2} ms",
            ms(percentile(&both, 500)),
            ms(percentile(&both, 900)),
            ms(percentile(&both, 990)),
            ms(*both.last().expect("times")),
        );
        let rebuilds = if std::env::var_os("LIVE_NO_REBUILD").is_some() { 0 } else { 1 };
        for (d, when) in during.iter_mut().take(rebuilds + 1).zip(["no rebuild under way", "a rebuild under way"]) {
            d.sort();
            if !d.is_empty() {
                println!(
                    "  pods with {when}: n={} p50={:.2} ms p99={:.2} ms",
                    d.len(),
                    ms(percentile(d, 500)),
                    ms(percentile(d, 990))
                );
            }
        }
        for (i, verb) in ["filter", "prioritize"].iter().enumerate() {
            let client = shares(&trips[i]);
            let server: Vec<f64> = after[i]
                .iter()
                .zip(&before[i])
                .map(|(a, b)| (a - b) as f64 * 100.0 / (after[i][3] - before[i][3]).max(1) as f64)
                .take(3)
                .collect();
            println!(
                "  {verb}: round trip p50={:.3} ms p99={:.3} ms; within 0.5/1/2 ms: client {:.1}/{:.1}/{:.1} %, the extender's histogram {:.1}/{:.1}/{:.1} %",
                ms(percentile(&trips[i], 500)),
                ms(percentile(&trips[i], 990)),
                client[0],
                client[1],
                client[2],
                server[0],
                server[1],
                server[2],
            );
        }
    });
}

/// Per verb (filter, prioritize): the extender's latency histogram's cumulative counts at
/// 0.5, 1 and 2 ms, and its count.
fn histograms(registry: &prometheus::Registry) -> [[u64; 4]; 2] {
    ["filter", "prioritize"].map(|verb| {
        registry
            .gather()
            .iter()
            .filter(|f| f.name() == "baleen_extender_request_seconds")
            .flat_map(|f| f.get_metric().iter())
            .find(|m| m.get_label().iter().any(|l| l.value() == verb))
            .map(|m| {
                let h = m.get_histogram();
                let at = |bound: f64| {
                    h.get_bucket()
                        .iter()
                        .find(|b| (b.upper_bound() - bound).abs() < 1e-9)
                        .map_or(0, |b| b.cumulative_count())
                };
                [at(0.0005), at(0.001), at(0.002), h.get_sample_count()]
            })
            .unwrap_or_default()
    })
}
