//! The cluster in the loop: a trace list replayed through the whole live path. A small driver
//! plays kube-scheduler (CPU and memory fit as its NodeResourcesFit filter, then the extender's
//! `filter` and `prioritize` over HTTP, the best score wins, ties by the replay's node
//! priority; CPU-only pods, which kube-scheduler never sends to the extender, go where
//! NodeResourcesFit's LeastAllocated score is highest) and binds GPU pods through the
//! extender's `bind` verb (which creates the Binding in a fake API server), CPU-only pods
//! through the fake API server itself, as kube-scheduler does;
//! each node is an agent's device ledger (`DeviceLedger`) that answers the kubelet's
//! GetPreferredAllocation and Allocate; each node's gpu-state annotation is written through the
//! fake API server some pods later (the delay), and reaches the extender through its watch.
//!
//! Mapping of a trace task: a share of one GPU (`gpu_milli` < 1000) asks for `gpu_milli` units
//! of `gpu-memory` on nodes whose GPUs have 1,000 units each (so a unit is a thousandth of a
//! GPU, as in the trace); whole GPUs ask for `gpu`; CPU and memory are the pod's requests.
//! The submission order is the replay's for the seed (`scheduler_sim::replay`), and the
//! headline figure is the replay's: unallocated GPU % at arrived = 100 %.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::time::Duration;

use anyhow::{Context as _, Result, bail};
use baleen_agent::inventory::{Gpu, GpuUuid, Inventory, MigState};
use baleen_agent::kube_api::{KubeNodeApi, NodeApi as _};
use baleen_agent::ledger::{AllocationRecord, DeviceLedger, View, ViewConfig};
use baleen_extender::run::{Config, Running, start};
use baleen_extender::service::Settings;
use baleen_scheduler_core::model::{GpuDemand, NodeSpec, Request};
use baleen_scheduler_sim::replay::{Workload, node_ranks, submission_order};
use rand::SeedableRng;
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

use crate::fake_apiserver::FakeApiServer;

const DOMAIN: &str = "awesome-ai-company.com";
const UNITS_PER_GPU: u64 = 1000;
/// One unit: a GPU of 1,000 units of 16 MiB.
pub(crate) const UNIT_BYTES: u64 = 16 << 20;

/// How to run.
#[derive(Debug, Clone)]
pub struct LoopOptions {
    /// Target GPU demand as a fraction of capacity (the replay's 1.3).
    pub tune: f64,
    /// A node's annotation is written this many pods after its allocations changed.
    pub annotation_delay: usize,
    /// The extender rebuilds its policy after this many new pods.
    pub rebuild_every: usize,
    /// A grant's pod is named in its node's annotation only this many pods after it was
    /// granted (the kubelet's pod-resources list, read at the agent's reconciliation); until
    /// then the annotation carries it as an unnamed grant.
    pub listing_delay: usize,
    /// CPU-only pods go where NodeResourcesFit's MostAllocated scores highest (packing CPU)
    /// instead of its default LeastAllocated (spreading).
    pub cpu_most_allocated: bool,
    /// CPU-only pods go through the extender too, which scores them by the policy
    /// (`--score-cpu-only-pods`, a profile without `managedResources`), as the replay places
    /// every task.
    pub cpu_by_extender: bool,
    /// Before each pod is scheduled, wait until the extender has learned every pod created so
    /// far and finished every policy rebuild they asked for, so that the packing does not
    /// depend on how fast the watcher and the rebuilder run (the replay rebuilds at fixed
    /// counts). The CI tests set it: without it seed 42 moved 0.4 points between runs.
    pub settled: bool,
    /// kube-scheduler's `percentageOfNodesToScore` for the pods' profile: 100 (the chart's)
    /// sends every node that fits to the extender; 0 is kube-scheduler's adaptive default,
    /// which stops its filter once it has found [`nodes_to_find`] nodes that fit, starting
    /// where the last pod's search stopped, and sends only those.
    pub percentage_of_nodes_to_score: u32,
    /// The extender's `--filter-keep-best` (0: every node that fits; the chart's is 50).
    pub filter_keep_best: usize,
}

impl Default for LoopOptions {
    fn default() -> Self {
        Self {
            tune: 1.3,
            annotation_delay: 5,
            listing_delay: 20,
            rebuild_every: 100,
            cpu_most_allocated: false,
            cpu_by_extender: false,
            settled: false,
            percentage_of_nodes_to_score: 100,
            filter_keep_best: 0,
        }
    }
}

/// kube-scheduler's search for nodes that fit, one at a time: from `start` round the `n` nodes
/// until `to_find` fit; the ones that fit, in that order, and where the next search starts
/// (after the last node looked at).
pub fn search(
    start: usize,
    n: usize,
    to_find: usize,
    fits: impl Fn(usize) -> bool,
) -> (Vec<usize>, usize) {
    let mut found = Vec::new();
    let mut looked = 0;
    while looked < n && found.len() < to_find {
        let i = (start + looked) % n;
        looked += 1;
        if fits(i) {
            found.push(i);
        }
    }
    (found, if n == 0 { 0 } else { (start + looked) % n })
}

/// How many nodes that fit kube-scheduler looks for before it stops filtering, of `all`
/// nodes, at `percentage` (`percentageOfNodesToScore`; 0: adaptive), as kube-scheduler 1.37
/// counts them: every node below 100 nodes; else 50 % less one point a 125 nodes (at least 5 %)
/// where adaptive; never fewer than 100.
pub fn nodes_to_find(percentage: u32, all: usize) -> usize {
    const MIN_NODES: usize = 100;
    if all < MIN_NODES {
        return all;
    }
    let percentage = match percentage {
        0 => 50usize.saturating_sub(all / 125).max(5),
        p => p.min(100) as usize,
    };
    (all * percentage / 100).max(MIN_NODES)
}

/// When each node's gpu-state annotation is written, counted in pods: `annotation_delay`
/// pods after a grant, and again `listing_delay` pods after it (when the kubelet's
/// pod-resources list names the pod); each write a new generation.
pub(crate) struct AnnotationSchedule {
    due: VecDeque<(usize, usize)>,
    generation: u64,
    annotation_delay: usize,
    listing_delay: usize,
}

impl AnnotationSchedule {
    pub(crate) fn new(annotation_delay: usize, listing_delay: usize) -> Self {
        Self { due: VecDeque::new(), generation: 0, annotation_delay, listing_delay }
    }

    /// Node `node` granted something at pod `seq`.
    pub(crate) fn granted(&mut self, seq: usize, node: usize) {
        self.due.push_back((seq + self.annotation_delay, node));
        self.due.push_back((seq + self.listing_delay.max(self.annotation_delay), node));
        self.due.make_contiguous().sort_unstable();
    }

    /// The next node whose annotation is due by pod `seq`, and the generation to write.
    pub(crate) fn next_due(&mut self, seq: usize) -> Option<(usize, u64)> {
        let &(at, node) = self.due.front()?;
        if at > seq {
            return None;
        }
        self.due.pop_front();
        self.generation += 1;
        Some((node, self.generation))
    }
}

/// What one seed produced.
#[derive(Debug, Clone, PartialEq)]
pub struct LoopOutcome {
    /// The seed.
    pub seed: u64,
    /// Pods submitted.
    pub submitted: usize,
    /// Pods placed and admitted.
    pub placed: usize,
    /// Pods bound to a node whose Allocate (or GetPreferredAllocation) then failed.
    pub admission_failures: usize,
    /// Unallocated GPU % at arrived = 100 %.
    pub unallocated_at_100: f64,
}

/// One node of the loop: its agent's ledger and who holds what.
pub(crate) struct LoopNode {
    pub(crate) spec: NodeSpec,
    pub(crate) ledger: DeviceLedger,
    pub(crate) cpu_used: u64,
    pub(crate) memory_used: u64,
    /// The gpu-memory units and whole GPUs its bound pods request (the kubelet's extended
    /// resources, which kube-scheduler's NodeResourcesFit counts).
    pub(crate) gpu_memory_requested: u64,
    pub(crate) gpus_requested: u64,
    /// Device IDs (sorted, joined) to the pod holding them and the pod's sequence number.
    holders: HashMap<String, (String, usize)>,
}

/// The views of every loop node: gpu-memory units of 16 MiB (1,000 a GPU) and whole GPUs.
pub(crate) fn view_config() -> ViewConfig {
    ViewConfig {
        domain: DOMAIN.into(),
        memory_unit_bytes: UNIT_BYTES,
        whole_gpus: true,
        gpu_memory: true,
        mig: false,
        nvlink_group_sizes: vec![],
    }
}

/// kube-scheduler's NodeResourcesFit LeastAllocated score of placing `request` on node `spec`
/// with `cpu_used` and `memory_used` taken: the share of CPU and memory left free, averaged.
pub(crate) fn least_allocated(
    spec: &NodeSpec,
    cpu_used: u64,
    memory_used: u64,
    request: &baleen_scheduler_core::model::Request,
) -> f64 {
    let free = |used: u64, cap: u64, ask: u64| (cap - used - ask) as f64 / cap.max(1) as f64;
    (free(cpu_used, spec.cpu.0, request.cpu.0) + free(memory_used, spec.memory.0, request.memory.0))
        / 2.0
}

pub(crate) fn inventory(index: usize, spec: &NodeSpec) -> Result<Inventory> {
    let gpus = spec
        .gpus
        .iter()
        .enumerate()
        .map(|(i, g)| {
            Ok(Gpu {
                index: u32::try_from(i)?,
                uuid: GpuUuid::new(format!("GPU-{index:08x}-0000-4000-8000-{i:012x}"))?,
                name: g.model.to_string(),
                memory_bytes: UNITS_PER_GPU * UNIT_BYTES,
                pci_bus_id: format!("00000000:{i:02X}:00.0"),
                numa_node: None,
                cuda_compute_capability: None,
                nvlink_peers: vec![],
                mig: MigState::Disabled,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(Inventory { driver_version: None, gpus, unreadable: Vec::new() })
}

fn node_json(spec: &NodeSpec) -> Value {
    json!({
        "metadata": {"name": spec.name},
        "status": {
            "allocatable": {"cpu": format!("{}m", spec.cpu.0), "memory": format!("{}Mi", spec.memory.0)},
            // What the kubelet counts once the node's agent has registered its devices.
            "capacity": {
                "awesome-ai-company.com/gpu-memory": (spec.gpus.len() as u64 * UNITS_PER_GPU).to_string(),
                "awesome-ai-company.com/gpu": spec.gpus.len().to_string()
            }
        }
    })
}

impl LoopNode {
    /// Node `index` of the trace, `spec`, with an empty ledger.
    pub(crate) fn new(index: usize, spec: &NodeSpec) -> Result<Self> {
        Ok(Self {
            spec: spec.clone(),
            ledger: DeviceLedger::new(&spec.name, &inventory(index, spec)?, view_config())?,
            cpu_used: 0,
            memory_used: 0,
            gpu_memory_requested: 0,
            gpus_requested: 0,
            holders: HashMap::new(),
        })
    }

    /// The node's annotation after pod `seq`: holders listed `listing_delay` pods after their
    /// grant.
    pub(crate) fn state(&self, generation: u64, seq: usize, listing_delay: usize) -> String {
        let holder = |r: &AllocationRecord| {
            let (pod, at) = self.holders.get(&r.device_ids.join(","))?;
            (seq >= at + listing_delay).then(|| pod.clone())
        };
        self.ledger.node_state(&self.spec.name, generation, holder).to_json()
    }

    /// Whether kube-scheduler's NodeResourcesFit lets `request` onto the node: CPU, memory
    /// and the extended resource it asks for (gpu-memory units or whole GPUs), against what
    /// the pods bound to it request.
    pub(crate) fn fits(&self, request: &Request) -> bool {
        let s = &self.spec;
        let gpus = s.gpus.len() as u64;
        let extended = match request.gpu {
            GpuDemand::None => true,
            GpuDemand::Shared { milli, .. } => {
                self.gpu_memory_requested + u64::from(milli.0) <= gpus * UNITS_PER_GPU
            }
            GpuDemand::Whole { count } => self.gpus_requested + u64::from(count) <= gpus,
        };
        self.cpu_used + request.cpu.0 <= s.cpu.0
            && self.memory_used + request.memory.0 <= s.memory.0
            && extended
    }

    /// Counts `request` as bound to the node (its requests, as kube-scheduler counts them).
    pub(crate) fn book(&mut self, request: &Request) {
        self.cpu_used += request.cpu.0;
        self.memory_used += request.memory.0;
        match request.gpu {
            GpuDemand::None => {}
            GpuDemand::Shared { milli, .. } => self.gpu_memory_requested += u64::from(milli.0),
            GpuDemand::Whole { count } => self.gpus_requested += u64::from(count),
        }
    }

    /// The kubelet's admission of one container asking `count` devices of `view`: its free
    /// devices, GetPreferredAllocation, then Allocate.
    pub(crate) fn admit(
        &mut self,
        view: &View,
        count: usize,
        pod: &str,
        seq: usize,
    ) -> Result<(), String> {
        let resource = view.resource_name(DOMAIN);
        let held: std::collections::HashSet<String> = self
            .ledger
            .records()
            .into_iter()
            .filter(|r| r.resource == resource)
            .flat_map(|r| r.device_ids)
            .collect();
        let free: Vec<String> = self
            .ledger
            .devices(view)
            .into_iter()
            .filter(|d| d.healthy && !held.contains(&d.id))
            .map(|d| d.id)
            .collect();
        if free.len() < count {
            return Err(format!("{} free {resource}, {count} asked", free.len()));
        }
        let chosen = self.ledger.preferred(view, &free, &[], count).map_err(|e| e.to_string())?;
        let grant = self.ledger.allocate(view, &chosen, 0).map_err(|e| e.to_string())?;
        self.holders.insert(grant.device_ids.join(","), (pod.to_owned(), seq));
        Ok(())
    }
}

/// POSTs `body` to the extender and reads its JSON answer (200 only).
async fn post(address: std::net::SocketAddr, path: &str, body: &str) -> Result<Value> {
    let (status, answer) = crate::http::request(address, "POST", path, body).await?;
    if status != 200 {
        bail!("{path}: {status}: {answer}");
    }
    Ok(serde_json::from_str(&answer)?)
}

/// Waits (at most 10 s) until the extender has learned `created` pods and rebuilt its policy
/// for them ([`LoopOptions::settled`]).
async fn settle(extender: &baleen_extender::service::Extender, created: u64) -> Result<()> {
    let wait = async {
        loop {
            let (learned, rebuilt) = extender.learning();
            if learned >= created && rebuilt {
                return;
            }
            tokio::time::sleep(Duration::from_micros(200)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(10), wait)
        .await
        .map_err(|_| anyhow::anyhow!("the extender did not learn {created} pods in 10 s"))
}

/// Waits (at most 10 s) until the extender's cache satisfies `ok`.
async fn until(
    running: &Running,
    what: &str,
    ok: impl Fn(&baleen_extender::cluster::ClusterView) -> bool,
) -> Result<()> {
    let wait = async {
        loop {
            if ok(&running
                .extender
                .cluster
                .read()
                .unwrap_or_else(std::sync::PoisonError::into_inner))
            {
                return;
            }
            tokio::time::sleep(Duration::from_micros(200)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(10), wait)
        .await
        .with_context(|| format!("waiting for the extender to see {what}"))
}

/// Replays `seed` of `workload` through the live path.
pub async fn run_seed(
    workload: &Workload,
    seed: u64,
    options: &LoopOptions,
) -> Result<LoopOutcome> {
    let capacity = workload.gpu_capacity_milli();
    // The replay's order and node priority for the seed (the same random stream).
    let mut order_rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let order = submission_order(&workload.tasks, capacity, options.tune, &mut order_rng);
    let ranks = node_ranks(&workload.nodes, &mut order_rng);

    let api = FakeApiServer::start(&[]).await?;
    let mut nodes = Vec::with_capacity(workload.nodes.len());
    for (i, spec) in workload.nodes.iter().enumerate() {
        let node = LoopNode::new(i, spec)?;
        let mut json = node_json(spec);
        json["metadata"]["annotations"] =
            json!({format!("{DOMAIN}/gpu-state"): node.state(0, 0, options.listing_delay)});
        api.put_node(json);
        nodes.push(node);
    }
    let client = kube::Client::try_from(kube::Config::new(api.url().parse()?))?;
    let token = CancellationToken::new();
    let settings = Settings {
        rebuild_every: options.rebuild_every,
        score_cpu_only: options.cpu_by_extender,
        filter_keep_best: options.filter_keep_best,
        ..Settings::default()
    };
    let running = start(
        Config {
            listen: "127.0.0.1:0".parse()?,
            prefix: String::new(),
            settings,
            metrics_listen: None,
            probe_listen: None,
            webhook: None,
            tls: None,
        },
        client,
        prometheus::Registry::new(),
        token.clone(),
    )
    .await?;
    let n = nodes.len();
    until(&running, "every node", |v| v.states().count() == n).await?;
    let extender = running.extender.clone();
    until(&running, "both watchers listed", move |_| extender.synced()).await?;
    let publisher = KubeNodeApi::at(&api.url())?;
    let names: Vec<String> = nodes.iter().map(|n| n.spec.name.clone()).collect();
    let by_name: BTreeMap<&str, usize> =
        names.iter().enumerate().map(|(i, n)| (n.as_str(), i)).collect();

    let mut annotations = AnnotationSchedule::new(options.annotation_delay, options.listing_delay);
    let (mut arrived, mut allocated) = (0u64, 0u64);
    let (mut placed, mut admission_failures) = (0usize, 0usize);
    let mut rows: Vec<(f64, f64)> = Vec::with_capacity(order.len());
    // Where kube-scheduler's next search for nodes that fit starts.
    let mut next_start = 0usize;
    for (seq, &task) in order.iter().enumerate() {
        // Annotations due now reach the API server (and the extender's watch).
        while let Some((i, generation)) = annotations.next_due(seq) {
            let state = nodes[i].state(generation, seq, options.listing_delay);
            publisher.annotate(&nodes[i].spec.name, &format!("{DOMAIN}/gpu-state"), &state).await?;
            // The delay is counted in pods: the extender sees the annotation before the next.
            let name = nodes[i].spec.name.clone();
            until(&running, "the annotation", |v| {
                v.node(&name)
                    .and_then(|e| e.state.as_ref().ok())
                    .is_some_and(|s| s.generation == generation)
            })
            .await?;
        }
        let request = &workload.tasks[task].request;
        arrived += request.gpu.total_milli();
        let pod_name = format!("t{seq}");
        let key = format!("loop/{pod_name}");
        let gpu_ask = match request.gpu {
            GpuDemand::None => None,
            GpuDemand::Shared { milli, .. } => {
                Some((View::GpuMemory, milli.0 as usize, "gpu-memory"))
            }
            GpuDemand::Whole { count } => Some((View::Gpu, count as usize, "gpu")),
        };
        let mut limits = json!({});
        if let Some((_, count, resource)) = &gpu_ask {
            limits[format!("{DOMAIN}/{resource}")] = json!(count.to_string());
        }
        let pod = json!({
            "metadata": {"name": pod_name, "namespace": "loop", "uid": format!("uid-{seq}")},
            "spec": {"containers": [{"name": "c", "resources": {"limits": limits, "requests": {
                "cpu": format!("{}m", request.cpu.0), "memory": format!("{}Mi", request.memory.0)}}}]},
            "status": {"phase": "Pending"}
        });
        api.put_pod(pod.clone());
        if options.settled {
            settle(&running.extender, u64::try_from(seq + 1)?).await?;
        }
        // kube-scheduler's own filter: CPU, memory and the extended resources, over the
        // nodes from where the last search stopped until it has found enough.
        let to_find = nodes_to_find(options.percentage_of_nodes_to_score, n);
        let fits;
        (fits, next_start) = search(next_start, n, to_find, |i| nodes[i].fits(request));
        let chosen = if gpu_ask.is_some() || options.cpu_by_extender {
            let names_in: Vec<&str> = fits.iter().map(|&i| names[i].as_str()).collect();
            let filtered = post(
                running.address,
                "/filter",
                &json!({"Pod": pod, "NodeNames": names_in}).to_string(),
            )
            .await?;
            let passed = filtered["NodeNames"].clone();
            if passed.as_array().is_none_or(Vec::is_empty) {
                None
            } else {
                let scores = post(
                    running.address,
                    "/prioritize",
                    &json!({"Pod": pod, "NodeNames": passed}).to_string(),
                )
                .await?;
                scores
                    .as_array()
                    .context("scores")?
                    .iter()
                    .filter_map(|s| {
                        Some((s["Score"].as_i64()?, by_name.get(s["Host"].as_str()?).copied()?))
                    })
                    .max_by(|a, b| a.0.cmp(&b.0).then(ranks[b.1].cmp(&ranks[a.1])))
                    .map(|(_, i)| i)
            }
        } else {
            // NodeResourcesFit, LeastAllocated: the most free CPU and memory, in proportion.
            fits.iter()
                .map(|&i| {
                    let n = &nodes[i];
                    (least_allocated(&n.spec, n.cpu_used, n.memory_used, request), i)
                })
                .max_by(|a, b| {
                    let (x, y) = if options.cpu_most_allocated { (b.0, a.0) } else { (a.0, b.0) };
                    x.total_cmp(&y).then(ranks[b.1].cmp(&ranks[a.1]))
                })
                .map(|(_, i)| i)
        };
        if let Some(i) = chosen {
            // Bound by the extender's bind verb, as the install configures kube-scheduler
            // (it creates the Binding through the fake API server and counts the pod at once).
            // kube-scheduler sends only the pods asking for a managed resource to the extender
            // (its binder too): CPU-only pods it binds itself.
            let uid = format!("uid-{seq}");
            if gpu_ask.is_some() {
                let binding = json!({"PodName": pod_name, "PodNamespace": "loop",
                                     "PodUID": uid, "Node": names[i]});
                let answer = post(running.address, "/bind", &binding.to_string()).await?;
                if answer["Error"].as_str().is_some_and(|e| !e.is_empty()) {
                    bail!("bind {key}: {}", answer["Error"]);
                }
            } else {
                let binding = json!({"target": {"name": names[i]}});
                let address: std::net::SocketAddr =
                    api.url().trim_start_matches("http://").parse()?;
                post_binding(address, &key, &binding).await?;
            }
            until(&running, "the binding", |v| v.is_bound(&uid)).await?;
            let admitted = match &gpu_ask {
                None => Ok(()),
                Some((view, count, _)) => nodes[i].admit(view, *count, &key, seq),
            };
            match admitted {
                Ok(()) => {
                    nodes[i].book(request);
                    allocated += request.gpu.total_milli();
                    placed += 1;
                    if gpu_ask.is_some() {
                        annotations.granted(seq, i);
                    }
                }
                Err(why) => {
                    admission_failures += 1;
                    tracing::warn!(pod = key, node = names[i], why, "admission failed");
                    api.delete_pod(&key);
                }
            }
        }
        rows.push((
            100.0 * arrived as f64 / capacity as f64,
            100.0 - 100.0 * allocated as f64 / capacity as f64,
        ));
    }
    token.cancel();
    running.wait().await;
    Ok(LoopOutcome {
        seed,
        submitted: order.len(),
        placed,
        admission_failures,
        unallocated_at_100: at_100(&rows),
    })
}

/// Binds the pod `key` (`namespace/name`) as a scheduler does (201 only).
async fn post_binding(address: std::net::SocketAddr, key: &str, binding: &Value) -> Result<()> {
    let (ns, name) = key.split_once('/').context("namespace/name")?;
    let path = format!("/api/v1/namespaces/{ns}/pods/{name}/binding");
    let (status, answer) =
        crate::http::request(address, "POST", &path, &binding.to_string()).await?;
    if status != 201 {
        bail!("binding {key}: {status}: {answer}");
    }
    Ok(())
}

/// The replay's headline: the mean unallocated % of the records whose arrived % rounds (half
/// to even) to 100; if none does, of those rounding to 99 and 101.
pub(crate) fn at_100(rows: &[(f64, f64)]) -> f64 {
    let mean = |lo: f64, hi: f64| {
        let v: Vec<f64> = rows
            .iter()
            .filter(|(a, _)| (lo..=hi).contains(&a.round_ties_even()))
            .map(|(_, u)| *u)
            .collect();
        (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64)
    };
    mean(100.0, 100.0).or_else(|| mean(99.0, 101.0)).unwrap_or(f64::NAN)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kube_scheduler_looks_for_as_many_nodes_as_its_formula_says() {
        // 100 % and small clusters: every node.
        assert_eq!(nodes_to_find(100, 1213), 1213);
        assert_eq!(nodes_to_find(0, 99), 99);
        assert_eq!(nodes_to_find(30, 50), 50);
        // Adaptive: 50 % less a point a 125 nodes (1,213: 41 %; 5,000: 10 %), at least 5 %.
        assert_eq!(nodes_to_find(0, 1213), 497);
        assert_eq!(nodes_to_find(0, 5000), 500);
        assert_eq!(nodes_to_find(0, 20_000), 1000);
        // Never fewer than 100.
        assert_eq!(nodes_to_find(0, 150), 100);
        assert_eq!(nodes_to_find(10, 500), 100);
        assert_eq!(nodes_to_find(30, 1000), 300);
    }

    #[test]
    fn each_search_starts_where_the_last_stopped() {
        let fit = |i: usize| i.is_multiple_of(2);
        // From 0 among 10 nodes, 2 that fit: 0 and 2, 3 looked at.
        assert_eq!(search(0, 10, 2, fit), (vec![0, 2], 3));
        assert_eq!(search(3, 10, 2, fit), (vec![4, 6], 7));
        // Round the end.
        assert_eq!(search(7, 10, 3, fit), (vec![8, 0, 2], 3));
        // Fewer fit than asked: every node looked at, the start stays.
        assert_eq!(search(5, 10, 9, fit), (vec![6, 8, 0, 2, 4], 5));
        assert_eq!(search(0, 0, 5, fit), (vec![], 0));
    }
}
