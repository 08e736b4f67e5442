//! Latency of kube-scheduler's calls to the extender: one `filter` (5,000 node names, the cache
//! holding 5,000 annotated 8-GPU nodes) then one `prioritize` (the nodes that passed), over one
//! kept-alive HTTP connection on loopback as kube-scheduler's client keeps it, timed from the
//! first byte sent to the second answer parsed (typed, as Go's client decodes it), the
//! prioritize body built in between. Between two pods the
//! cluster moves as in a live one: the pod is bound to the best node (a pod the annotation does
//! not show yet) and one node's annotation changes; the policy is rebuilt every 100 pods
//! beside the calls, as the running extender does. The 1,000 pods timed come after a first
//! batch of 200 (every demand shape judged once, the target workload learned), as after a
//! while in a cluster. Run: `cargo bench -p baleen-extender --bench call_latency`.

use std::time::{Duration, Instant};

use baleen_extender::cluster::{NodeEntry, PodEntry};
use baleen_extender::http::{Metrics, bind, router};
use baleen_extender::protocol::{Node, Pod};
use baleen_extender::service::{Extender, Settings};
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

mod support;
use support::{Call, Connection, FilterAnswer, Score, percentile};

const NODES: usize = 5000;
const KEY: &str = "awesome-ai-company.com/gpu-state";

fn node(name: &str, free: &[u32]) -> Value {
    let state = baleen_k8s::fixtures::h200_state(name, free);
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

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(std::env::var("W").ok().and_then(|w| w.parse().ok()).unwrap_or(2))
        .enable_all()
        .build()
        .expect("runtime");
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
        let token = CancellationToken::new();
        let registry = prometheus::Registry::new();
        let metrics = Metrics::new(registry.clone()).expect("metrics");
        // CALL_LATENCY_CANNED=1: the two verbs answer canned bodies of the same sizes (all 5,000
        // names, a score for each) without reading the call: what HTTP and the client cost
        // alone, the floor under the extender's own work.
        let verbs = if std::env::var_os("CALL_LATENCY_CANNED").is_some() {
            let filter = axum::body::Bytes::from(
                serde_json::to_vec(&json!({"Nodes": null, "NodeNames": names, "FailedNodes": {},
                                           "FailedAndUnresolvableNodes": {}, "Error": ""}))
                .expect("json"),
            );
            let scores: Vec<Value> = names.iter().map(|n| json!({"Host": n, "Score": 7})).collect();
            let scores = axum::body::Bytes::from(serde_json::to_vec(&scores).expect("json"));
            let canned = |answer: axum::body::Bytes| {
                axum::routing::post(move |_call: axum::body::Bytes| async move { answer })
            };
            axum::Router::new().route("/filter", canned(filter)).route("/prioritize", canned(scores))
        } else {
            router(extender.clone(), metrics, "")
        };
        let (address, server) =
            bind("127.0.0.1:0".parse().expect("addr"), verbs, token.clone())
                .await
                .expect("bind");
        tokio::spawn(server);
        let mut connection = Connection::open(address);
        let mut first_of_demand = Vec::new();
        // A first batch of pods, as after a while in a cluster: the target workload learned
        // from them, and each of their demands judged on every node once (the first pod of a
        // demand never seen judges 5,000 nodes: the bench prints what that first call costs).
        let warm: Vec<&str> = names.iter().map(String::as_str).collect();
        for i in 0..200 {
            let p = pod(1_000_000 + i, shapes[i % shapes.len()]);
            let body = serde_json::to_vec(&Call { pod: &p, node_names: &warm }).expect("json");
            let started = Instant::now();
            connection.post("/filter", &body);
            if i < shapes.len() {
                first_of_demand.push(started.elapsed());
            }
        }
        first_of_demand.sort();
        println!(
            "the first filter of each of the {} demands, every node judged for it: median {:.2} ms, max {:.2} ms",
            shapes.len(),
            first_of_demand[first_of_demand.len() / 2].as_secs_f64() * 1e3,
            first_of_demand.last().expect("shapes").as_secs_f64() * 1e3
        );
        let rebuilt = Instant::now();
        extender.rebuild_policy();
        println!(
            "one policy rebuild (the target, then {NODES} nodes scored for its common demands): {:.1} ms",
            rebuilt.elapsed().as_secs_f64() * 1e3
        );
        // The policy is rebuilt every 100 new pods beside the calls, as in the extender.
        // (CALL_LATENCY_NO_REBUILD=1: without it, to see what it costs the tail.)
        let rebuilder = std::env::var_os("CALL_LATENCY_NO_REBUILD").is_none();
        if rebuilder {
            tokio::spawn(extender.clone().run_rebuilder(token.clone()));
        }
        // CALL_LATENCY_NAMES=500: kube-scheduler's default at 5,000 nodes, which stops after
        // 10 % of the nodes are found feasible (percentageOfNodesToScore; 5,000 names is its
        // `percentageOfNodesToScore: 100`).
        let sent = std::env::var("CALL_LATENCY_NAMES")
            .ok()
            .and_then(|n| n.parse::<usize>().ok())
            .unwrap_or(NODES)
            .min(NODES);
        let all: Vec<&str> = names.iter().take(sent).map(String::as_str).collect();
        // CALL_LATENCY_CALLS / CALL_LATENCY_IN_PROCESS: how many pods each part times (1,000 and
        // 200), e.g. to profile one part alone.
        let count = |var: &str, default: usize| {
            std::env::var(var).ok().and_then(|n| n.parse::<usize>().ok()).unwrap_or(default).max(2)
        };
        let calls = count("CALL_LATENCY_CALLS", 1000);
        let in_process = count("CALL_LATENCY_IN_PROCESS", 200);
        let mut times = Vec::with_capacity(calls);
        let mut filter_times = Vec::with_capacity(calls);
        let mut sizes = Vec::with_capacity(calls);
        let mut first = None;
        // The server's own time in each verb's handler (its latency histogram's sum and count):
        // what of a round trip is the extender's work rather than HTTP's.
        let handler = |verb: &str| {
            registry
                .gather()
                .iter()
                .filter(|f| f.name() == "baleen_extender_request_seconds")
                .flat_map(|f| f.get_metric().iter())
                .filter(|m| m.get_label().iter().any(|l| l.value() == verb))
                .map(|m| (m.get_histogram().get_sample_sum(), m.get_histogram().get_sample_count()))
                .next()
                .unwrap_or((0.0, 0))
        };
        let handlers_before = [handler("filter"), handler("prioritize")];
        let counted = |family: &str, label: &str| {
            registry
                .gather()
                .iter()
                .filter(|f| f.name() == family)
                .flat_map(|f| f.get_metric().iter())
                .filter(|m| m.get_label().iter().any(|l| l.value() == label))
                .map(|m| m.get_counter().get_value())
                .fold(0.0, |a, b| a + b)
        };
        // Per pod, how its filter was judged (given again, or judged in full) and whether a
        // policy rebuild was under way: where the tail comes from.
        let mut classes: [Vec<Duration>; 4] = Default::default();
        let run_started = Instant::now();
        let mut calls_total = Duration::ZERO;
        // The client's own share of the calls: its parse of both answers and its prioritize body.
        let mut client_total = Duration::ZERO;
        let mut client_parts = [Duration::ZERO; 3];
        let mut zero_scores = 0usize;
        let mut scores_seen = 0usize;
        // Each call from its first byte sent to its answer's last byte read (HTTP and the
        // server's work, without the client's parse).
        let mut trips: [Vec<Duration>; 2] = [Vec::with_capacity(calls), Vec::with_capacity(calls)];
        for i in 0..calls {
            let units = shapes[rng.random_range(0..shapes.len())];
            let p = pod(i, units);
            let filter_body = serde_json::to_vec(&Call { pod: &p, node_names: &all }).expect("json");
            let again_before = counted("baleen_extender_filter_names_total", "again")
                + counted("baleen_extender_filter_names_total", "patched");
            // (Without the rebuilder no rebuild is ever under way, though some are asked.)
            let rebuilding = rebuilder && !extender.learning().1;
            let started = Instant::now();
            let text = connection.post("/filter", &filter_body).to_vec();
            let own = Instant::now();
            trips[0].push(own - started);
            let answer: FilterAnswer<'_> = serde_json::from_slice(&text).expect("json");
            assert!(answer.error.is_empty(), "{}", answer.error);
            let filtered = started.elapsed();
            client_parts[0] += own.elapsed();
            let passed = answer.node_names.unwrap_or_default();
            let built = Instant::now();
            let body = serde_json::to_vec(&Call { pod: &p, node_names: &passed }).expect("json");
            client_parts[1] += built.elapsed();
            let mut client = own.elapsed();
            let sent = Instant::now();
            let scored = connection.post("/prioritize", &body).to_vec();
            let own = Instant::now();
            trips[1].push(own - sent);
            let scores: Vec<Score<'_>> = serde_json::from_slice(&scored).expect("json");
            client += own.elapsed();
            client_parts[2] += own.elapsed();
            zero_scores += scores.iter().filter(|s| s.score == 0).count();
            scores_seen += scores.len();
            let elapsed = started.elapsed();
            client_total += client;
            calls_total += elapsed;
            filter_times.push(filtered);
            sizes.push(text.len() + body.len());
            if i == 0 {
                first = Some((elapsed, passed.len()));
            } else {
                times.push(elapsed);
                let again = counted("baleen_extender_filter_names_total", "again")
                    + counted("baleen_extender_filter_names_total", "patched")
                    > again_before;
                let rebuilding = rebuilding || (rebuilder && !extender.learning().1);
                classes[usize::from(again) + 2 * usize::from(rebuilding)].push(elapsed);
            }
            // Bind to the best node (not yet in its annotation), and one other node changes.
            let best = scores.iter().max_by_key(|s| s.score).map(|s| s.host.to_owned());
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
        let wall = run_started.elapsed();
        let handlers_after_calls = [handler("filter"), handler("prioritize")];
        // Where the time goes: the same two verbs in-process, parse and answer JSON included,
        // without HTTP or the client.
        let mut parse = Duration::ZERO;
        let mut filter_work = Duration::ZERO;
        let mut filter_split = Duration::ZERO;
        let mut prioritize_work = Duration::ZERO;
        let mut making = Duration::ZERO;
        let mut judging = Duration::ZERO;
        let mut answering = Duration::ZERO;
        let mut answered_ahead = 0usize;
        for i in 0..in_process {
            let p = pod(calls + i, shapes[i % shapes.len()]);
            let body = serde_json::to_vec(&Call { pod: &p, node_names: &all }).expect("json");
            let t = Instant::now();
            let args = baleen_extender::protocol::ExtenderArgs::parse(&body).expect("args");
            parse += t.elapsed();
            let t = Instant::now();
            let _ = extender.filter_json(&args);
            filter_split += t.elapsed();
            // As the server answers it: the body read, its names those of the call before.
            let t = Instant::now();
            let filtered = extender.filter_call(&body).expect("filter");
            filter_work += t.elapsed();
            let t = Instant::now();
            if let Some(ahead) = &filtered.ahead {
                extender.prepare_ahead(ahead);
            }
            making += t.elapsed();
            let t = Instant::now();
            if let Some(judge) = &filtered.judge {
                extender.judge_ahead(judge);
            }
            judging += t.elapsed();
            let answer: FilterAnswer<'_> = serde_json::from_slice(&filtered.body).expect("json");
            let passed = answer.node_names.unwrap_or_default();
            let body = serde_json::to_vec(&Call { pod: &p, node_names: &passed }).expect("json");
            let t = Instant::now();
            let answer = extender.prioritize_call(&body).expect("scores");
            answering += t.elapsed();
            // Computed where a rebuild finished in between (the policy changed).
            answered_ahead +=
                usize::from(matches!(answer, baleen_extender::service::Prioritized::Ahead(_)));
            let args = baleen_extender::protocol::ExtenderArgs::parse(&body).expect("args");
            let t = Instant::now();
            let _ = extender.prioritize_json(&args).expect("scores");
            prioritize_work += t.elapsed();
        }
        let per = |d: Duration| d.as_secs_f64() * 1e3 / in_process as f64;
        println!(
            "in-process, per pod (mean of {in_process}): parse {sent} names {:.3} ms, filter of the parsed call (names looked up) + its JSON {:.3} ms; filter call as served (body read, names the call before's: compared, not split nor looked up) + its JSON {:.3} ms; prioritize + its JSON {:.3} ms",
            per(parse),
            per(filter_split),
            per(filter_work),
            per(prioritize_work)
        );
        println!(
            "in-process, prioritize made ahead: making {:.3} ms, the other demands' answers judged ahead {:.3} ms (both beside the client), answering {:.3} ms (its parse with the names as text, the lookup; {answered_ahead} of {in_process} answered ahead)",
            per(making),
            per(judging),
            per(answering)
        );
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
        println!(
            "the client's own share (parse of both answers, the prioritize body): {:.3} ms a pod",
            client_total.as_secs_f64() * 1e3 / calls as f64
        );
        for t in &mut trips {
            t.sort();
        }
        println!(
            "round trips (first byte sent to last byte read): filter p50={:.3} ms p99={:.3} ms, prioritize p50={:.3} ms p99={:.3} ms",
            percentile(&trips[0], 500).as_secs_f64() * 1e3,
            percentile(&trips[0], 990).as_secs_f64() * 1e3,
            percentile(&trips[1], 500).as_secs_f64() * 1e3,
            percentile(&trips[1], 990).as_secs_f64() * 1e3,
        );
        let handlers_after = handlers_after_calls;
        let mean_ms = |i: usize| {
            let (sum, count) = (
                handlers_after[i].0 - handlers_before[i].0,
                handlers_after[i].1 - handlers_before[i].1,
            );
            sum * 1e3 / count.max(1) as f64
        };
        println!(
            "the server's own time in its handlers (mean): filter {:.3} ms, prioritize {:.3} ms; filter calls by how (all, the first batch's included): read {}, reused {}, again {}, patched {}; prioritize made ahead {}, computed {}; scores made ahead kept {}, patched {}, afresh {}",
            mean_ms(0),
            mean_ms(1),
            counted("baleen_extender_filter_names_total", "read"),
            counted("baleen_extender_filter_names_total", "reused"),
            counted("baleen_extender_filter_names_total", "again"),
            counted("baleen_extender_filter_names_total", "patched"),
            counted("baleen_extender_prioritize_answers_total", "made_ahead"),
            counted("baleen_extender_prioritize_answers_total", "computed"),
            extender.scores_made.with_label_values(&["kept"]).get(),
            extender.scores_made.with_label_values(&["patched"]).get(),
            extender.scores_made.with_label_values(&["afresh"]).get(),
        );
        for (c, name) in classes.iter_mut().zip([
            "judged in full, no rebuild",
            "given again or patched, no rebuild",
            "judged in full, during a rebuild",
            "given again or patched, during a rebuild",
        ]) {
            c.sort();
            if !c.is_empty() {
                println!(
                    "  pods whose filter was {name}: n={} p50={:.2} ms p99={:.2} ms",
                    c.len(),
                    percentile(c, 500).as_secs_f64() * 1e3,
                    percentile(c, 990).as_secs_f64() * 1e3
                );
            }
        }
        let part = |d: Duration| d.as_secs_f64() * 1e3 / calls as f64;
        println!(
            "of which: filter answer parse {:.3} ms, prioritize body {:.3} ms, prioritize answer parse {:.3} ms; zero scores {:.1} % of {} hosts answered a pod",
            part(client_parts[0]),
            part(client_parts[1]),
            part(client_parts[2]),
            zero_scores as f64 * 100.0 / scores_seen.max(1) as f64,
            scores_seen / calls
        );
        println!(
            "sequential: {:.0} pods/s counting the calls only, {:.0} pods/s counting the harness's bind and annotation change between pods too",
            calls as f64 / calls_total.as_secs_f64(),
            calls as f64 / wall.as_secs_f64()
        );
        let (first, passed) = first.expect("a first call");
        println!(
            "filter + prioritize over {sent} of {NODES} nodes: first (cold cache, {passed} passed) {:.2} ms; then n={} p50={:.2} ms p90={:.2} ms p99={:.2} ms max={:.2} ms",
            first.as_secs_f64() * 1e3,
            times.len(),
            percentile(&times, 500).as_secs_f64() * 1e3,
            percentile(&times, 900).as_secs_f64() * 1e3,
            percentile(&times, 990).as_secs_f64() * 1e3,
            times.last().expect("times").as_secs_f64() * 1e3,
        );
    });
}
