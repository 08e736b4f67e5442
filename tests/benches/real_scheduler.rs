//! The real kube-scheduler's throughput and latency without and with baleen's extender, in one
//! run (issue 40, item 5): the upstream control plane of the real-control-plane lane, `N` Nodes
//! as API objects (8 H200s each, capacity and gpu-state as the agents publish them), two
//! kube-schedulers of the chart's configuration (one with the extender, one with the extenders
//! taken out, the same client limits) and bursts of GPU pods for each in turn.
//!
//! ```text
//! BALEEN_KUBE=$(scripts/build-control-plane.sh) cargo build --release -p baleen-extender
//! BALEEN_KUBE=$(scripts/build-control-plane.sh) cargo bench -p baleen-tests --bench real_scheduler -- \
//!     --nodes=500,5000 --pods=1000 --rounds=2 --qps=1000
//! ```
//!
//! Per burst: `pods` pods created at once (64 requests in flight) for one scheduler; the pod's
//! latency is from its create's answer to the watch showing it bound; the throughput is the
//! pods over the time from the first create sent to the last bind seen. `--set=key=value`
//! renders both schedulers' configurations and the extender's arguments with a chart value,
//! `--plain-set=key=value` the plain scheduler's only (e.g.
//! `--plain-set=scheduler.percentageOfNodesToScore=null`: the cluster's default scheduler
//! beside the chart's). Figures:
//! docs/benchmarks.md, "The real kube-scheduler with and without the extender".

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail, ensure};
use futures::{StreamExt as _, TryStreamExt as _};
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::runtime::watcher;
use serde_json::json;

use baleen_tests::real::ControlPlane;
use baleen_tests::real::scheduling::{
    DOMAIN, Extender, SchedulerConfig, node_objects, scheduler_kubeconfig,
};

/// What one run does.
struct Plan {
    nodes: Vec<usize>,
    pods: usize,
    rounds: usize,
    qps: u32,
    /// Chart values (`--set` pairs) both schedulers' configurations and the extender are
    /// rendered with.
    values: Vec<String>,
    /// Chart values for the plain scheduler's configuration only, after `values`.
    plain_values: Vec<String>,
}

impl Plan {
    fn from_args() -> Result<Self> {
        let mut plan = Self {
            nodes: vec![500, 5000],
            pods: 1000,
            rounds: 2,
            qps: 1000,
            values: Vec::new(),
            plain_values: Vec::new(),
        };
        for arg in std::env::args().skip(1) {
            let Some((key, value)) = arg.split_once('=') else {
                continue; // cargo bench's own `--bench`
            };
            match key {
                "--nodes" => {
                    plan.nodes = value.split(',').map(str::parse).collect::<Result<_, _>>()?
                }
                "--pods" => plan.pods = value.parse()?,
                "--rounds" => plan.rounds = value.parse()?,
                "--qps" => plan.qps = value.parse()?,
                "--set" => plan.values.push(value.to_owned()),
                "--plain-set" => plan.plain_values.push(value.to_owned()),
                _ => bail!(
                    "unknown argument {arg}: --nodes=500,5000 --pods=N --rounds=N --qps=N \
                     --set=key=value --plain-set=key=value"
                ),
            }
        }
        ensure!(plan.pods >= 2 && plan.rounds >= 1, "at least 2 pods and 1 round");
        Ok(plan)
    }
}

/// The GPU pods' sizes in gpu-memory units (of 140 on an H200), taken in turn.
const SIZES: [u32; 6] = [10, 20, 35, 70, 14, 140];
/// Requests in flight when creating Nodes and pods.
const IN_FLIGHT: usize = 64;

/// One burst's figures.
struct Burst {
    scheduler: &'static str,
    pods: usize,
    /// Pods created per second (the create answers).
    created_per_s: f64,
    /// Pods bound per second, from the first create sent to the last bind seen.
    bound_per_s: f64,
    p50: Duration,
    p99: Duration,
    max: Duration,
}

fn pod(name: &str, burst: &str, scheduler: &str, units: u32) -> Result<Pod> {
    Ok(serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "bench", "labels": {"burst": burst}},
        "spec": {"schedulerName": scheduler,
                 "securityContext": {"runAsNonRoot": true, "runAsUser": 65534},
                 // Node objects without a kubelet keep the API server's not-ready taint.
                 "tolerations": [{"key": "node.kubernetes.io/not-ready", "operator": "Exists",
                                  "effect": "NoSchedule"}],
                 "containers": [{"name": "c", "image": "x",
                    "securityContext": {"allowPrivilegeEscalation": false},
                    "resources": {"limits": {format!("{DOMAIN}/gpu-memory"): units.to_string()},
                                  "requests": {"cpu": "100m", "memory": "128Mi"}}}]}
    }))?)
}

/// Creates `count` pods for `scheduler` at once and waits until all are bound.
async fn burst(
    client: &kube::Client,
    id: &str,
    scheduler: &'static str,
    count: usize,
) -> Result<Burst> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), "bench");
    let bound: Arc<Mutex<HashMap<String, Instant>>> = Arc::default();
    let (synced_tx, synced) = tokio::sync::oneshot::channel();
    let watch = {
        let bound = bound.clone();
        let config = watcher::Config::default().labels(&format!("burst={id}"));
        let stream = watcher(pods.clone(), config);
        tokio::spawn(async move {
            let mut synced_tx = Some(synced_tx);
            let mut stream = std::pin::pin!(stream);
            while let Some(event) = stream.try_next().await? {
                let seen = Instant::now();
                match event {
                    watcher::Event::InitDone => {
                        if let Some(tx) = synced_tx.take() {
                            let _ = tx.send(());
                        }
                    }
                    watcher::Event::Apply(p) | watcher::Event::InitApply(p)
                        if p.spec.as_ref().and_then(|s| s.node_name.as_ref()).is_some() =>
                    {
                        let name = p.metadata.name.unwrap_or_default();
                        bound.lock().expect("bound").entry(name).or_insert(seen);
                    }
                    _ => {}
                }
            }
            anyhow::Ok(())
        })
    };
    synced.await.context("the pod watch did not start")?;
    let started = Instant::now();
    let created: Vec<(String, Instant)> = futures::stream::iter(0..count)
        .map(|i| {
            let pods = pods.clone();
            async move {
                let name = format!("{id}-{i}");
                let object = pod(&name, id, scheduler, SIZES[i % SIZES.len()])?;
                pods.create(&PostParams::default(), &object).await?;
                anyhow::Ok((name, Instant::now()))
            }
        })
        .buffer_unordered(IN_FLIGHT)
        .try_collect()
        .await?;
    let all_created = started.elapsed();
    let deadline = Instant::now() + Duration::from_secs(600);
    loop {
        if bound.lock().expect("bound").len() >= count {
            break;
        }
        if watch.is_finished() {
            bail!("the pod watch ended: {:?}", watch.await);
        }
        if Instant::now() > deadline {
            bail!("{} of {count} pods bound in 600 s", bound.lock().expect("bound").len());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    watch.abort();
    let bound = bound.lock().expect("bound").clone();
    let last = bound.values().max().copied().context("no pod bound")?;
    let mut latencies: Vec<Duration> = created
        .iter()
        .map(|(name, at)| {
            bound.get(name).map_or(Duration::ZERO, |b| b.saturating_duration_since(*at))
        })
        .collect();
    latencies.sort();
    // The nearest-rank quantile: the smallest latency with at least `per_mille` of them at or
    // below it.
    let quantile = |per_mille: usize| latencies[(latencies.len() * per_mille).div_ceil(1000) - 1];
    Ok(Burst {
        scheduler,
        pods: count,
        created_per_s: count as f64 / all_created.as_secs_f64(),
        bound_per_s: count as f64 / (last - started).as_secs_f64(),
        p50: quantile(500),
        p99: quantile(990),
        max: *latencies.last().context("no pods")?,
    })
}

/// The Nodes, created as the kubelets and agents would leave them, 64 at a time.
async fn add_nodes(client: &kube::Client, count: usize) -> Result<()> {
    let nodes: Api<Node> = Api::all(client.clone());
    futures::stream::iter(0..count)
        .map(|i| {
            let nodes = nodes.clone();
            async move {
                let name = format!("node-{i:05}");
                let (node, resources) = node_objects(&name, &[140; 8]);
                let status = baleen_tests::real::ready_status(&resources, &resources);
                nodes.create(&PostParams::default(), &serde_json::from_value(node)?).await?;
                nodes.patch_status(&name, &PatchParams::default(), &Patch::Merge(&status)).await?;
                anyhow::Ok(())
            }
        })
        .buffer_unordered(IN_FLIGHT)
        .try_collect::<Vec<()>>()
        .await?;
    Ok(())
}

async fn run(plan: &Plan, nodes: usize) -> Result<Vec<Burst>> {
    let mut plane = ControlPlane::start().await?;
    let result = async {
        plane.install(&["--set", "webhook.enabled=false"])?;
        plane.kubectl(&["create", "namespace", "bench"])?;
        let admin = plane.kubeconfig(baleen_tests::real::ADMIN)?;
        let kubeconfig = kube::config::Kubeconfig::read_from(&admin)?;
        let config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default()).await?;
        let client = kube::Client::try_from(config)?;
        let started = Instant::now();
        add_nodes(&client, nodes).await?;
        eprintln!("{nodes} nodes created in {:.1} s", started.elapsed().as_secs_f64());
        let account = scheduler_kubeconfig(&plane)?;
        let mut values = vec!["webhook.enabled=false"];
        values.extend(plan.values.iter().map(String::as_str));
        let extender =
            Extender::start(&plane, &account, &values, None, Duration::from_secs(120)).await?;
        let result = async {
            for (name, extender) in
                [("plain-scheduler", None), ("baleen-scheduler", Some(extender.verbs))]
            {
                let mut values = plan.values.clone();
                if extender.is_none() {
                    values.extend(plan.plain_values.iter().cloned());
                }
                let config = SchedulerConfig {
                    extender,
                    scheduler_name: name.to_owned(),
                    qps: Some(plan.qps),
                    leader_elect: false,
                    values,
                };
                config.spawn(&mut plane, &account)?;
            }
            plane.default_account("bench", Duration::from_secs(60)).await?;
            // Warm-up, not counted: each scheduler's caches filled, the first calls made.
            for scheduler in ["plain-scheduler", "baleen-scheduler"] {
                burst(&client, &format!("warm-{}", &scheduler[..5]), scheduler, 20).await?;
            }
            let mut bursts = Vec::new();
            let cpu = |plane: &ControlPlane| {
                let mut times = plane.cpu_times();
                times.push(("baleen-extender".to_owned(), extender.cpu_time().unwrap_or_default()));
                times
            };
            for round in 0..plan.rounds {
                for scheduler in ["plain-scheduler", "baleen-scheduler"] {
                    let id = format!("r{round}-{}", &scheduler[..5]);
                    let before = cpu(&plane);
                    let figures = burst(&client, &id, scheduler, plan.pods).await?;
                    let used: Vec<String> = cpu(&plane)
                        .iter()
                        .zip(&before)
                        .map(|((name, after), (_, before))| {
                            format!("{name} {:.1}", (*after - *before).as_secs_f64())
                        })
                        .collect();
                    eprintln!("{nodes} nodes, {id}: CPU s: {}", used.join(", "));
                    eprintln!(
                        "{nodes} nodes, {id}: {:.1} pods/s bound, p99 {:.0} ms",
                        figures.bound_per_s,
                        figures.p99.as_secs_f64() * 1e3
                    );
                    bursts.push(figures);
                }
            }
            // Where the extender's time went: its answers by verb, from each call's arrival.
            for verb in ["filter", "prioritize", "bind", "preempt"] {
                let labels = format!("verb=\"{verb}\"");
                let count =
                    extender.sample("baleen_extender_request_seconds_count", &labels).await?;
                let sum = extender.sample("baleen_extender_request_seconds_sum", &labels).await?;
                if count > 0.0 {
                    eprintln!(
                        "{nodes} nodes: extender {verb}: {count} calls, mean {:.2} ms",
                        sum / count * 1e3
                    );
                }
            }
            anyhow::Ok(bursts)
        }
        .await;
        result.map_err(|e| e.context(extender.log_tail(30)))
    }
    .await;
    result.map_err(|e| anyhow::anyhow!("{e:#}\n{}", plane.logs()))
}

#[tokio::main]
async fn main() -> Result<()> {
    let plan = Plan::from_args()?;
    println!("chart values {:?}, the plain scheduler's also {:?}", plan.values, plan.plain_values);
    println!(
        "| nodes | scheduler | pods | created/s | bound/s | p50 ms | p99 ms | max ms |\n|---|---|---|---|---|---|---|---|"
    );
    let mut summary = Vec::new();
    for &nodes in &plan.nodes {
        let bursts = run(&plan, nodes).await?;
        for b in &bursts {
            println!(
                "| {nodes} | {} | {} | {:.0} | {:.1} | {:.0} | {:.0} | {:.0} |",
                b.scheduler,
                b.pods,
                b.created_per_s,
                b.bound_per_s,
                b.p50.as_secs_f64() * 1e3,
                b.p99.as_secs_f64() * 1e3,
                b.max.as_secs_f64() * 1e3
            );
        }
        let mean = |name: &str| {
            let of: Vec<f64> =
                bursts.iter().filter(|b| b.scheduler == name).map(|b| b.bound_per_s).collect();
            of.iter().sum::<f64>() / of.len() as f64
        };
        summary.push((nodes, mean("baleen-scheduler") / mean("plain-scheduler")));
    }
    for (nodes, ratio) in summary {
        println!("{nodes} nodes: with the extender {ratio:.2}x the throughput without it");
    }
    Ok(())
}
