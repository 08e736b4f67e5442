//! The cluster loop with the real control plane (issue 40, item 5): a trace list replayed
//! through the upstream kube-apiserver and kube-scheduler (the chart's configuration, its
//! extender the release binary with the chart's arguments) and one agent ledger per node.
//!
//! What is real and what is played, beside [`crate::cluster_loop`] (which plays kube-scheduler
//! against the fake API server):
//! - every trace node is a Node object, its capacity and allocatable as the kubelet sets them
//!   once the agent registered (CPU and memory of the trace, 110 pods, `gpu-memory` of 1,000
//!   units a GPU and `gpu`), its gpu-state annotation written by its agent's ledger through the
//!   API server;
//! - every task is a Pod of `baleen-scheduler`, created when the one before is bound or refused
//!   (the replay's protocol: one at a time, placed or failed for good). kube-scheduler runs its
//!   own filters and scores, sends the GPU pods to the extender (filter, prioritize, bind) and
//!   binds the CPU-only ones itself; a pod it marks unschedulable is deleted (no retry, no
//!   departure);
//! - the kubelet is played: a bound GPU pod is admitted by its node's ledger (the kubelet's
//!   GetPreferredAllocation and Allocate, as the agent answers them), and the node's annotation
//!   is written `annotation_delay` pods later and again `listing_delay` pods after the grant
//!   (when the kubelet's pod-resources list names the pod), as in the cluster loop.
//!
//! In DRA mode ([`TraceOptions::dra`]) every node is a DRA driver instead: no GPU extended
//! resources, its ResourceSlices the agent's own (`baleen_agent::dra::node_devices` through
//! `baleen_dra::slices::build`, owned by the Node) created through the API server; each GPU
//! task is a ResourceClaim of the chart's DeviceClass (a share: `gpu_milli` units of 16 MiB of
//! memory as `capacity.requests.memory`; whole GPUs: `count` devices asking no capacity) and a
//! pod holding it, in a namespace of the `restricted` profile. The real allocator chooses the
//! devices; the node's ledger books the allocated claim as `NodePrepareResources` reads it
//! (`baleen_dra::claims::read_allocation`): a booking it refuses is an admission failure.
//!
//! The headline is the replay's: unallocated GPU % at arrived = 100 %.

use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail};
use futures::{StreamExt as _, TryStreamExt as _};
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::runtime::watcher;
use rand::SeedableRng as _;
use serde_json::json;

use baleen_agent::ledger::{ClaimBooking, ClaimDevice, ClaimHolder, View};
use baleen_scheduler_core::model::GpuDemand;
use baleen_scheduler_sim::replay::{Workload, node_ranks, submission_order};
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};

use super::ControlPlane;
use super::scheduling::{DOMAIN, Extender, SchedulerConfig, scheduler_kubeconfig};
use crate::cluster_loop::{AnnotationSchedule, LoopNode, LoopOutcome, UNIT_BYTES, at_100};

/// The namespace of the trace's pods.
const NAMESPACE: &str = "trace";
/// Requests in flight while the Nodes are created.
const IN_FLIGHT: usize = 32;
/// The chart's DRA driver (and DeviceClass).
const DRIVER: &str = "gpu.awesome-ai-company.com";

/// How to run one seed.
#[derive(Debug, Clone)]
pub struct TraceOptions {
    /// Target GPU demand as a fraction of capacity (the replay's 1.3).
    pub tune: f64,
    /// A node's annotation is written this many pods after its allocations changed.
    pub annotation_delay: usize,
    /// A grant's pod is named in its node's annotation this many pods after the grant.
    pub listing_delay: usize,
    /// Chart values (`key=value`, as `--set` takes them) for the install, the extender's
    /// arguments and the scheduler's configuration.
    pub values: Vec<String>,
    /// Every node a DRA driver ([`run_seed`]'s DRA mode) instead of a device-plugin agent.
    pub dra: bool,
}

impl Default for TraceOptions {
    fn default() -> Self {
        Self { tune: 1.3, annotation_delay: 5, listing_delay: 20, values: Vec::new(), dra: false }
    }
}

/// What one seed gave, beyond the loop's figures.
#[derive(Debug, Clone)]
pub struct TraceOutcome {
    /// The loop's figures.
    pub outcome: LoopOutcome,
    /// Pods kube-scheduler refused, by the reason of their PodScheduled condition.
    pub refusals: std::collections::BTreeMap<String, usize>,
    /// The run's wall time, Nodes and components included.
    pub wall: Duration,
    /// Mean time from a pod's create to its binding or refusal seen.
    pub mean_decision: Duration,
}

/// What kube-scheduler did with one pod, as the pod watch saw it.
#[derive(Debug)]
enum Decision {
    Bound(String),
    Refused { reason: String, message: String },
}

/// Replays `seed` of `workload` through a fresh control plane (see the module's documentation).
pub async fn run_seed(
    workload: &Workload,
    seed: u64,
    options: &TraceOptions,
) -> Result<TraceOutcome> {
    let started = Instant::now();
    let mut plane = ControlPlane::start().await?;
    let result = async {
        let mut values = vec!["webhook.enabled=false".to_owned()];
        if options.dra {
            values.push("dra.enabled=true".to_owned());
            // The ledgers' unit (the slices' step), which the extender counts claims in.
            values.push("agent.config.memoryUnit=16MiB".to_owned());
        }
        values.extend(options.values.iter().cloned());
        let mut install = Vec::new();
        for v in &values {
            install.extend(["--set", v.as_str()]);
        }
        plane.install(&install)?;
        plane.kubectl(&["create", "namespace", NAMESPACE])?;
        // The chart lets claims of its class only into namespaces that enforce `restricted`.
        plane.kubectl(&[
            "label",
            "namespace",
            NAMESPACE,
            "pod-security.kubernetes.io/enforce=restricted",
        ])?;
        let admin = plane.kubeconfig(super::ADMIN)?;
        let kubeconfig = kube::config::Kubeconfig::read_from(&admin)?;
        let config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default()).await?;
        let client = kube::Client::try_from(config)?;
        let mut nodes = Vec::with_capacity(workload.nodes.len());
        for (i, spec) in workload.nodes.iter().enumerate() {
            nodes.push(LoopNode::new(i, spec)?);
        }
        let uids = add_nodes(&client, &nodes, options).await?;
        let mut dra = Vec::new();
        if options.dra {
            dra = add_slices(&client, &nodes, &uids).await?;
        }
        let account = scheduler_kubeconfig(&plane)?;
        let args: Vec<&str> = values.iter().map(String::as_str).collect();
        let extender =
            Extender::start(&plane, &account, &args, None, Duration::from_secs(300)).await?;
        let result = async {
            let mut scheduler = SchedulerConfig::as_the_chart(extender.verbs);
            scheduler.leader_elect = false;
            scheduler.values = values.clone();
            scheduler.spawn(&mut plane, &account)?;
            plane.default_account(NAMESPACE, Duration::from_secs(60)).await?;
            replay(&client, workload, nodes, dra, seed, options).await
        }
        .await;
        result.map_err(|e| e.context(extender.log_tail(30)))
    }
    .await;
    let mut outcome = result.map_err(|e| anyhow::anyhow!("{e:#}\n{}", plane.logs()))?;
    outcome.wall = started.elapsed();
    Ok(outcome)
}

/// The Nodes, created as their kubelets and agents leave them: their UIDs, in order.
async fn add_nodes(
    client: &kube::Client,
    nodes: &[LoopNode],
    options: &TraceOptions,
) -> Result<Vec<String>> {
    let api: Api<Node> = Api::all(client.clone());
    futures::stream::iter(nodes)
        .map(|node| {
            let api = api.clone();
            async move {
                let spec = &node.spec;
                let mut object = json!({"apiVersion": "v1", "kind": "Node",
                    "metadata": {"name": spec.name,
                                 "labels": {"kubernetes.io/hostname": spec.name}}});
                let mut resources = json!({"cpu": format!("{}m", spec.cpu.0),
                    "memory": format!("{}Mi", spec.memory.0), "pods": "110"});
                object["metadata"]["annotations"] = json!({format!("{DOMAIN}/gpu-state"):
                    state(node, 0, 0, options)?});
                if !options.dra {
                    let gpus = spec.gpus.len() as u64;
                    resources[format!("{DOMAIN}/gpu-memory")] = (gpus * 1000).to_string().into();
                    resources[format!("{DOMAIN}/gpu")] = gpus.to_string().into();
                }
                let status = super::ready_status(&resources, &resources);
                let made =
                    api.create(&PostParams::default(), &serde_json::from_value(object)?).await?;
                api.patch_status(&spec.name, &PatchParams::default(), &Patch::Merge(&status))
                    .await?;
                made.metadata.uid.context("a Node without a UID")
            }
        })
        .buffered(IN_FLIGHT)
        .try_collect()
        .await
}

/// Node `node`'s gpu-state document after pod `seq`, as its agent writes it (a DRA agent's
/// says `dra`; its claims' pods are named at once, by the claims).
fn state(node: &LoopNode, generation: u64, seq: usize, options: &TraceOptions) -> Result<String> {
    let text = node.state(generation, seq, options.listing_delay);
    if !options.dra {
        return Ok(text);
    }
    let mut doc = baleen_k8s::gpu_state::NodeGpuState::parse(&text)?;
    doc.dra = true;
    Ok(doc.to_json())
}

/// What a DRA node's agent knows of its devices: the DRA device names to GPUs.
type Targets = std::collections::BTreeMap<String, baleen_agent::dra::Target>;

/// Each node's ResourceSlices as its agent publishes them, created through the API server:
/// the agent's device targets, in order.
async fn add_slices(
    client: &kube::Client,
    nodes: &[LoopNode],
    uids: &[String],
) -> Result<Vec<Targets>> {
    let api: Api<ResourceSlice> = Api::all(client.clone());
    let mut targets = Vec::with_capacity(nodes.len());
    let mut slices = Vec::new();
    for (node, uid) in nodes.iter().zip(uids) {
        let (devices, these) = baleen_agent::dra::node_devices(&node.ledger);
        let owner =
            baleen_dra::slices::Owner { node_name: node.spec.name.clone(), node_uid: uid.clone() };
        slices.extend(baleen_dra::slices::build(DRIVER, &owner, 1, &devices)?);
        targets.push(these);
    }
    futures::stream::iter(slices)
        .map(|slice| {
            let api = api.clone();
            async move { api.create(&PostParams::default(), &slice).await.map(|_| ()) }
        })
        .buffer_unordered(IN_FLIGHT)
        .try_collect::<Vec<()>>()
        .await?;
    Ok(targets)
}

/// The ResourceClaim of GPU task `seq` in DRA mode, if it asks for a GPU.
fn claim(
    seq: usize,
    request: &baleen_scheduler_core::model::Request,
) -> Result<Option<ResourceClaim>> {
    let exactly = match request.gpu {
        GpuDemand::None => return Ok(None),
        GpuDemand::Shared { milli, .. } => json!({"deviceClassName": DRIVER,
            "capacity": {"requests": {"memory": (u64::from(milli.0) * UNIT_BYTES).to_string()}}}),
        GpuDemand::Whole { count } => {
            json!({"deviceClassName": DRIVER, "allocationMode": "ExactCount", "count": count})
        }
    };
    Ok(Some(serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": format!("c{seq}"), "namespace": NAMESPACE},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}}
    }))?))
}

/// The bookings of `claim`, allocated on `node`, as `NodePrepareResources` reads them.
fn bookings(
    claim: &ResourceClaim,
    node: &str,
    targets: &Targets,
    pod: &str,
) -> Result<Vec<ClaimBooking>> {
    let asked = baleen_dra::claims::ClaimRef {
        namespace: NAMESPACE.to_owned(),
        name: claim.metadata.name.clone().unwrap_or_default(),
        uid: claim.metadata.uid.clone().unwrap_or_default(),
    };
    let allocation = baleen_dra::claims::read_allocation(claim, &asked, DRIVER, node)?;
    allocation
        .devices
        .iter()
        .map(|d| {
            let device = match (targets.get(&d.device), d.memory_bytes) {
                (Some(baleen_agent::dra::Target::Shared(gpu_uuid)), Some(bytes)) => {
                    ClaimDevice::Share { gpu_uuid: gpu_uuid.clone(), bytes }
                }
                (Some(baleen_agent::dra::Target::Whole(gpu_uuid)), _) => {
                    ClaimDevice::Whole { gpu_uuid: gpu_uuid.clone() }
                }
                (t, c) => bail!("device {} ({t:?}, {c:?})", d.device),
            };
            Ok(ClaimBooking {
                holder: ClaimHolder {
                    namespace: asked.namespace.clone(),
                    name: asked.name.clone(),
                    uid: asked.uid.clone(),
                    request: d.request.clone(),
                    device: d.device.clone(),
                    share_id: d.share_id.clone(),
                    pod: Some(pod.to_owned()),
                    priority: None,
                },
                device,
            })
        })
        .collect()
}

/// The pod of task `seq` (in DRA mode holding claim `c<seq>` if it asks for a GPU), of the
/// `restricted` profile.
fn pod(seq: usize, request: &baleen_scheduler_core::model::Request, dra: bool) -> Result<Pod> {
    let mut resources = json!({"requests": {
        "cpu": format!("{}m", request.cpu.0), "memory": format!("{}Mi", request.memory.0)}});
    let mut pod = json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": format!("t{seq}"), "namespace": NAMESPACE},
        "spec": {"schedulerName": "baleen-scheduler",
                 "securityContext": {"runAsNonRoot": true, "runAsUser": 65534,
                                     "seccompProfile": {"type": "RuntimeDefault"}},
                 // Node objects without a kubelet keep the API server's not-ready taint.
                 "tolerations": [{"operator": "Exists"}],
                 "containers": [{"name": "c", "image": "x",
                    "securityContext": {"allowPrivilegeEscalation": false,
                                        "capabilities": {"drop": ["ALL"]}}}]}
    });
    match (request.gpu, dra) {
        (GpuDemand::None, _) => {}
        (_, true) => {
            pod["spec"]["resourceClaims"] =
                json!([{"name": "gpu", "resourceClaimName": format!("c{seq}")}]);
            resources["claims"] = json!([{"name": "gpu"}]);
        }
        (GpuDemand::Shared { milli, .. }, false) => {
            resources["limits"] = json!({format!("{DOMAIN}/gpu-memory"): milli.0.to_string()});
        }
        (GpuDemand::Whole { count }, false) => {
            resources["limits"] = json!({format!("{DOMAIN}/gpu"): count.to_string()});
        }
    }
    pod["spec"]["containers"][0]["resources"] = resources;
    Ok(serde_json::from_value(pod)?)
}

/// Watches the trace's pods: each one's binding or refusal, once, by name.
fn watch_decisions(
    pods: Api<Pod>,
) -> (tokio::sync::mpsc::UnboundedReceiver<(String, Decision)>, tokio::task::JoinHandle<Result<()>>)
{
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let task = tokio::spawn(async move {
        let mut stream = std::pin::pin!(watcher(pods, watcher::Config::default()));
        while let Some(event) = stream.try_next().await? {
            let (watcher::Event::Apply(p) | watcher::Event::InitApply(p)) = event else {
                continue;
            };
            let name = p.metadata.name.clone().unwrap_or_default();
            if let Some(node) = p.spec.as_ref().and_then(|s| s.node_name.clone()) {
                let _ = tx.send((name, Decision::Bound(node)));
                continue;
            }
            let refused =
                p.status.as_ref().and_then(|s| s.conditions.as_ref()).and_then(|c| {
                    c.iter().find(|c| c.type_ == "PodScheduled" && c.status == "False")
                });
            if let Some(c) = refused {
                let _ = tx.send((
                    name,
                    Decision::Refused {
                        reason: c.reason.clone().unwrap_or_default(),
                        message: c.message.clone().unwrap_or_default(),
                    },
                ));
            }
        }
        Ok(())
    });
    (rx, task)
}

async fn replay(
    client: &kube::Client,
    workload: &Workload,
    mut nodes: Vec<LoopNode>,
    dra: Vec<Targets>,
    seed: u64,
    options: &TraceOptions,
) -> Result<TraceOutcome> {
    let capacity = workload.gpu_capacity_milli();
    // The replay's order for the seed (the same random stream; the node priority is drawn to
    // keep it, though kube-scheduler breaks its own ties).
    let mut order_rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let order = submission_order(&workload.tasks, capacity, options.tune, &mut order_rng);
    let _ = node_ranks(&workload.nodes, &mut order_rng);
    let by_name: std::collections::HashMap<String, usize> =
        nodes.iter().enumerate().map(|(i, n)| (n.spec.name.clone(), i)).collect();
    let pods: Api<Pod> = Api::namespaced(client.clone(), NAMESPACE);
    let node_api: Api<Node> = Api::all(client.clone());
    let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), NAMESPACE);
    let (mut decisions, watch) = watch_decisions(pods.clone());

    let mut annotations = AnnotationSchedule::new(options.annotation_delay, options.listing_delay);
    let (mut arrived, mut allocated) = (0u64, 0u64);
    let (mut placed, mut admission_failures) = (0usize, 0usize);
    let mut refusals = std::collections::BTreeMap::<String, usize>::new();
    let mut rows: Vec<(f64, f64)> = Vec::with_capacity(order.len());
    let mut deciding = Duration::ZERO;
    let mut last_report = Instant::now();
    for (seq, &task) in order.iter().enumerate() {
        while let Some((i, generation)) = annotations.next_due(seq) {
            let state = state(&nodes[i], generation, seq, options)?;
            let patch =
                json!({"metadata": {"annotations": {format!("{DOMAIN}/gpu-state"): state}}});
            node_api
                .patch(&nodes[i].spec.name, &PatchParams::default(), &Patch::Merge(&patch))
                .await?;
        }
        let request = &workload.tasks[task].request;
        arrived += request.gpu.total_milli();
        let name = format!("t{seq}");
        let created = Instant::now();
        let claim = if options.dra { claim(seq, request)? } else { None };
        if let Some(claim) = &claim {
            claims.create(&PostParams::default(), claim).await?;
        }
        pods.create(&PostParams::default(), &pod(seq, request, options.dra)?).await?;
        let decision = loop {
            let next = tokio::time::timeout(Duration::from_secs(120), decisions.recv())
                .await
                .with_context(|| format!("pod {name} neither bound nor refused in 120 s"))?;
            let Some((seen, decision)) = next else {
                bail!("the pod watch ended: {:?}", watch.is_finished());
            };
            if seen == name {
                break decision;
            }
        };
        deciding += created.elapsed();
        match decision {
            Decision::Refused { reason, message } => {
                if reason != "Unschedulable" {
                    bail!("pod {name}: {reason}: {message}");
                }
                *refusals.entry(reason).or_default() += 1;
                // Failed for good: no retry when the cluster changes.
                pods.delete(&name, &DeleteParams::default()).await?;
                if claim.is_some() {
                    claims.delete(&format!("c{seq}"), &DeleteParams::default()).await?;
                }
            }
            Decision::Bound(node) => {
                let i = *by_name.get(&node).with_context(|| format!("{name} bound to {node}"))?;
                let ask = match request.gpu {
                    GpuDemand::None => None,
                    GpuDemand::Shared { milli, .. } => Some((View::GpuMemory, milli.0 as usize)),
                    GpuDemand::Whole { count } => Some((View::Gpu, count as usize)),
                };
                let key = format!("{NAMESPACE}/{name}");
                let admitted = match (&ask, options.dra) {
                    (None, _) => Ok(()),
                    (Some(_), true) => {
                        // The kubelet's NodePrepareResources: the claim as the API server
                        // holds it once the scheduler allocated it.
                        let allocated = claims.get(&format!("c{seq}")).await?;
                        let booked = bookings(&allocated, &node, &dra[i], &name)?;
                        let mut next = nodes[i].ledger.clone();
                        next.book_claim(&booked, 0)
                            .map(|_| nodes[i].ledger = next)
                            .map_err(|e| e.to_string())
                    }
                    (Some((view, count)), false) => nodes[i].admit(view, *count, &key, seq),
                };
                match admitted {
                    Ok(()) => {
                        allocated += request.gpu.total_milli();
                        placed += 1;
                        if ask.is_some() {
                            annotations.granted(seq, i);
                        }
                    }
                    Err(why) => {
                        admission_failures += 1;
                        tracing::warn!(pod = key, node, why, "admission failed");
                        // As the kubelet would: the pod fails and is removed.
                        pods.delete(&name, &DeleteParams::default().grace_period(0)).await?;
                    }
                }
            }
        }
        rows.push((
            100.0 * arrived as f64 / capacity as f64,
            100.0 - 100.0 * allocated as f64 / capacity as f64,
        ));
        if last_report.elapsed() > Duration::from_secs(60) {
            last_report = Instant::now();
            eprintln!(
                "seed {seed}: {} of {} pods, {placed} placed, arrived {:.1} %, unallocated {:.2} %",
                seq + 1,
                order.len(),
                rows.last().map_or(0.0, |r| r.0),
                rows.last().map_or(0.0, |r| r.1)
            );
        }
    }
    watch.abort();
    Ok(TraceOutcome {
        outcome: LoopOutcome {
            seed,
            submitted: order.len(),
            placed,
            admission_failures,
            unallocated_at_100: at_100(&rows),
        },
        refusals,
        wall: Duration::ZERO,
        mean_decision: deciding / u32::try_from(order.len().max(1))?,
    })
}
