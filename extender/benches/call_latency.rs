//! Latency of kube-scheduler's calls to the extender: one `filter` (5,000 node names, the cache
//! holding 5,000 annotated 8-GPU nodes) then one `prioritize` (the nodes that passed), over HTTP
//! on loopback, timed from connect to the last byte of the second answer. Between two pods the
//! cluster moves as in a live one: the pod is bound to the best node (a pod the annotation does
//! not show yet) and one node's annotation changes; the policy is rebuilt every 100 pods
//! beside the calls, as the running extender does. Run:
//! `cargo bench -p baleen-extender --bench call_latency`.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use baleen_extender::cluster::{NodeEntry, PodEntry};
use baleen_extender::http::{Metrics, bind, router};
use baleen_extender::protocol::{ExtenderArgs, Node, Pod};
use baleen_extender::service::{Extender, Settings};
use baleen_k8s::gpu_state::{GpuEntry, GpuMode, NodeGpuState, VERSION};
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;

const NODES: usize = 5000;
const CALLS: usize = 1000;
const KEY: &str = "awesome-ai-company.com/gpu-state";

fn node(name: &str, free: &[u32]) -> Value {
    let state = NodeGpuState {
        version: VERSION,
        node: name.into(),
        generation: 1,
        memory_unit_bytes: 1 << 30,
        resources: vec![
            "awesome-ai-company.com/gpu".into(),
            "awesome-ai-company.com/gpu-memory".into(),
        ],
        gpus: free
            .iter()
            .enumerate()
            .map(|(i, &f)| GpuEntry {
                index: u32::try_from(i).expect("eight GPUs"),
                uuid: format!("GPU-{name}-{i}"),
                model: "NVIDIA H200".into(),
                memory_bytes: 140 << 30,
                numa_node: Some(0),
                nvlink_peers: vec![],
                mode: if f == 140 { GpuMode::Idle } else { GpuMode::Shared },
                healthy: true,
                shares_offered: true,
                units_total: 140,
                units_free: f,
                compute_free_milli: f * 1000 / 140,
                mig: vec![],
                pods: vec![],
            })
            .collect(),
        nvlink_groups: vec![],
        unnamed: vec![],
    };
    json!({"metadata": {"name": name, "annotations": {KEY: state.to_json()}},
           "status": {"allocatable": {"cpu": "96", "memory": "1000Gi"},
                      "capacity": {"awesome-ai-company.com/gpu-memory": (free.len() * 140).to_string()}}})
}

fn pod(i: usize, units: u32) -> Value {
    json!({"metadata": {"name": format!("p{i}"), "namespace": "bench", "uid": format!("u{i}")},
           "spec": {"containers": [{"name": "c", "resources": {
               "limits": {"awesome-ai-company.com/gpu-memory": units},
               "requests": {"cpu": "4", "memory": "16Gi"}}}]}})
}

async fn post(address: SocketAddr, path: &str, body: &str) -> String {
    let mut stream = tokio::net::TcpStream::connect(address).await.expect("connect");
    let request = format!(
        "POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes()).await.expect("write");
    let mut response = String::new();
    stream.read_to_string(&mut response).await.expect("read");
    response.split_once("\r\n\r\n").map(|(_, b)| b.to_owned()).expect("body")
}

/// The `per_mille`-th thousandth of sorted samples (nearest rank).
fn percentile(sorted: &[Duration], per_mille: usize) -> Duration {
    sorted[((sorted.len() - 1) * per_mille).div_ceil(1000)]
}

fn main() {
    let runtime =
        tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("runtime");
    runtime.block_on(async {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        let extender = Extender::new(Settings::default());
        let names: Vec<String> = (0..NODES).map(|i| format!("node-{i:05}")).collect();
        let mut frees: Vec<Vec<u32>> = Vec::new();
        {
            let mut view = extender.cluster.write().expect("lock");
            for name in &names {
                let free: Vec<u32> = (0..8).map(|_| [140, 140, 100, 60, 20, 0][rng.random_range(0..6)]).collect();
                let n: Node = serde_json::from_value(node(name, &free)).expect("node");
                view.set_node(name, NodeEntry::of(&n, KEY));
                frees.push(free);
            }
        }
        let shapes = [4u32, 8, 16, 20, 40, 70, 140];
        // A target workload learned from a first batch of pods, as after a while in a cluster.
        for i in 0..200 {
            let args: ExtenderArgs = serde_json::from_value(json!({"Pod": pod(1_000_000 + i, shapes[i % shapes.len()]), "NodeNames": []})).expect("args");
            extender.filter(&args);
        }
        extender.rebuild_policy();
        let token = CancellationToken::new();
        let metrics = Metrics::new(prometheus::Registry::new()).expect("metrics");
        let (address, server) =
            bind("127.0.0.1:0".parse().expect("addr"), router(extender.clone(), metrics, ""), token.clone())
                .await
                .expect("bind");
        tokio::spawn(server);
        // The policy is rebuilt every 100 new pods beside the calls, as in the extender.
        tokio::spawn(extender.clone().run_rebuilder(token.clone()));
        let mut times = Vec::with_capacity(CALLS);
        let mut filter_times = Vec::with_capacity(CALLS);
        let mut sizes = Vec::with_capacity(CALLS);
        let mut first = None;
        for i in 0..CALLS {
            let units = shapes[rng.random_range(0..shapes.len())];
            let p = pod(i, units);
            let filter_body = json!({"Pod": p, "NodeNames": names}).to_string();
            let started = Instant::now();
            let text = post(address, "/filter", &filter_body).await;
            let answer: Value = serde_json::from_str(&text).expect("json");
            let filtered = started.elapsed();
            let passed = answer["NodeNames"].clone();
            let body = json!({"Pod": p, "NodeNames": passed}).to_string();
            let scores: Value = serde_json::from_str(&post(address, "/prioritize", &body).await).expect("json");
            let elapsed = started.elapsed();
            filter_times.push(filtered);
            sizes.push(text.len() + body.len());
            if i == 0 {
                first = Some((elapsed, passed.as_array().map_or(0, Vec::len)));
            } else {
                times.push(elapsed);
            }
            // Bind to the best node (not yet in its annotation), and one other node changes.
            let best = scores
                .as_array()
                .expect("array")
                .iter()
                .max_by_key(|s| s["Score"].as_i64())
                .map(|s| s["Host"].as_str().expect("host").to_owned());
            let mut view = extender.cluster.write().expect("lock");
            if let Some(best) = best {
                let mut bound = p.clone();
                bound["spec"]["nodeName"] = json!(best);
                let bound: Pod = serde_json::from_value(bound).expect("pod");
                view.set_pod(&format!("u{i}"), PodEntry::of(&bound, "awesome-ai-company.com"));
            }
            let k = rng.random_range(0..NODES);
            let g = rng.random_range(0..8);
            frees[k][g] = frees[k][g].saturating_sub(units);
            let n: Node = serde_json::from_value(node(&names[k], &frees[k])).expect("node");
            view.set_node(&names[k], NodeEntry::of(&n, KEY));
        }
        token.cancel();
        times.sort();
        filter_times.sort();
        sizes.sort_unstable();
        println!(
            "of which filter: p50={:.2} ms p99={:.2} ms; filter answer + prioritize body: median {} KiB",
            percentile(&filter_times, 500).as_secs_f64() * 1e3,
            percentile(&filter_times, 990).as_secs_f64() * 1e3,
            sizes[sizes.len() / 2] / 1024
        );
        let (first, passed) = first.expect("a first call");
        println!(
            "filter + prioritize over {NODES} nodes: first (cold cache, {passed} passed) {:.2} ms; then n={} p50={:.2} ms p90={:.2} ms p99={:.2} ms max={:.2} ms",
            first.as_secs_f64() * 1e3,
            times.len(),
            percentile(&times, 500).as_secs_f64() * 1e3,
            percentile(&times, 900).as_secs_f64() * 1e3,
            percentile(&times, 990).as_secs_f64() * 1e3,
            times.last().expect("times").as_secs_f64() * 1e3,
        );
    });
}
