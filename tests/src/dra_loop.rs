//! The cluster loop in DRA mode: the same trace, order and node priority as
//! [`crate::cluster_loop`], but each node is served as a DRA driver and placed as
//! kube-scheduler places claims: its ResourceSlices are the agent's own
//! (`baleen_agent::dra::node_devices` through `baleen_dra::slices::build`, read back through
//! JSON into k8s-openapi's types, as the API server holds them), the test allocator
//! ([`crate::dra_allocator`]) chooses devices first fit by their `requestPolicy`, kube-scheduler
//! filters nodes by CPU, memory and whether the claim can be allocated there and scores them by
//! NodeResourcesFit's LeastAllocated (no DRA scoring: the default plugins score no device), and
//! the node's agent books the allocation in its ledger as `NodePrepareResources` does
//! (`DeviceLedger::book_claim`): a booking it refuses is an admission failure.
//!
//! A share of one GPU (`gpu_milli` < 1000) is a claim of `gpu_milli` units of memory (a unit is
//! a thousandth of a GPU, as in [`crate::cluster_loop`]); whole GPUs a claim of `count` devices
//! asking no capacity. The headline is the replay's: unallocated GPU % at arrived = 100 %.

use anyhow::{Context as _, Result};
use baleen_agent::ledger::{ClaimBooking, ClaimDevice, ClaimHolder, DeviceLedger};
use baleen_dra::slices::{self, DeviceKind, NodeDevice, Owner};
use baleen_scheduler_core::cluster::ClusterScheduler;
use baleen_scheduler_core::ledger::{AllocationId, NodeLedger};
use baleen_scheduler_core::model::{GpuDemand, GpuSet};
use baleen_scheduler_core::policy::{Normalisers, Policy, PolicyKind};
use baleen_scheduler_sim::replay::{Workload, node_ranks, submission_order};
use k8s_openapi::api::resource::v1::ResourceSlice;
use rand::SeedableRng;

use crate::cluster_loop::{
    LoopOutcome, UNIT_BYTES, at_100, inventory, least_allocated, view_config,
};
use crate::dra_allocator::{Allocator, Ask};

const DRIVER: &str = "gpu.awesome-ai-company.com";

/// How nodes and devices are chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DraOptions {
    /// Nodes chosen by the policy, as the extender chooses them for `gpu-memory` pods (rebuilt
    /// every 100 pods from the pods seen, as `baleen-sim --online-target`), from each node's
    /// state as it is now (no annotation delay), instead of by NodeResourcesFit's
    /// LeastAllocated; the allocator still chooses the devices on the node.
    pub node_by_policy: bool,
    /// Each node's slices list its shared GPUs fullest first (republished after every change),
    /// so that the allocator's first fit is a best fit.
    pub fullest_first: bool,
}

struct DraNode {
    ledger: DeviceLedger,
    slices: Vec<ResourceSlice>,
    targets: std::collections::BTreeMap<String, baleen_agent::dra::Target>,
    cpu_used: u64,
    memory_used: u64,
}

/// Replays `seed` of `workload` with every node a DRA driver (see the module's documentation).
pub fn run_seed(workload: &Workload, seed: u64, tune: f64) -> Result<LoopOutcome> {
    run_seed_with(workload, seed, tune, DraOptions::default())
}

/// Orders `devices` (of `node_devices` for `ledger`) so that the GPUs shared by memory come
/// fullest first: fewest units free, then by index; other devices keep their order, after them.
///
/// kube-scheduler's DRA allocator gives a claim the first device, in slice order, with room
/// for it. Over slices in this order, that first fit is a best fit: the share lands on the GPU
/// it fills most, and the emptiest GPUs stay whole for the claims that need them. An agent could
/// publish its slices in this order (a slice write per change); measured here
/// ([`DraOptions::fullest_first`]), it moved the default trace by 0.1 point at most, so the
/// agent does not.
fn order_fullest_first(devices: &mut [NodeDevice], ledger: &DeviceLedger) {
    let free: std::collections::BTreeMap<String, u32> = ledger
        .gpu_states()
        .into_iter()
        .map(|s| (s.uuid, s.units.saturating_sub(s.units_held)))
        .collect();
    devices.sort_by_key(|d| match d.kind {
        DeviceKind::Shared { .. } => (0, free.get(&d.uuid).copied().unwrap_or(u32::MAX), d.index),
        _ => (1, 0, 0),
    });
}

/// The node's devices as its agent publishes them, under `options`.
fn published(ledger: &DeviceLedger, options: DraOptions) -> Vec<slices::NodeDevice> {
    let (mut devices, _) = baleen_agent::dra::node_devices(ledger);
    if options.fullest_first {
        order_fullest_first(&mut devices, ledger);
    }
    devices
}

/// Replays `seed` of `workload` with every node a DRA driver, nodes and devices chosen as
/// `options` say.
pub fn run_seed_with(
    workload: &Workload,
    seed: u64,
    tune: f64,
    options: DraOptions,
) -> Result<LoopOutcome> {
    let capacity = workload.gpu_capacity_milli();
    let mut order_rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let order = submission_order(&workload.tasks, capacity, tune, &mut order_rng);
    let ranks = node_ranks(&workload.nodes, &mut order_rng);
    let config = view_config();
    let mut nodes = Vec::with_capacity(workload.nodes.len());
    for (i, spec) in workload.nodes.iter().enumerate() {
        let ledger = DeviceLedger::new(&spec.name, &inventory(i, spec)?, config.clone())?;
        let (_, targets) = baleen_agent::dra::node_devices(&ledger);
        let devices = published(&ledger, options);
        let owner = Owner { node_name: spec.name.clone(), node_uid: format!("uid-{i}") };
        let built = slices::build(DRIVER, &owner, 1, &devices)?;
        // As the API server holds them: through JSON.
        let slices = serde_json::from_value(serde_json::to_value(&built)?)?;
        nodes.push(DraNode { ledger, slices, targets, cpu_used: 0, memory_used: 0 });
    }
    let mut allocator = Allocator::default();
    // The extender's view of the nodes, for `node_by_policy`.
    let mut judge = ClusterScheduler::new(
        Policy::for_requests(PolicyKind::Baleen, std::iter::empty(), 0.95, Normalisers::default()),
        workload.nodes.iter().map(|n| NodeLedger::new(n.clone())).collect::<Result<Vec<_>, _>>()?,
        ranks.clone(),
    );
    let (cluster_cpu, cluster_gpus) = workload.cluster_capacity();
    let mut decision_rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let (mut arrived, mut allocated) = (0u64, 0u64);
    let (mut placed, mut admission_failures) = (0usize, 0usize);
    let mut rows = Vec::with_capacity(order.len());
    for (seq, &task) in order.iter().enumerate() {
        let request = &workload.tasks[task].request;
        arrived += request.gpu.total_milli();
        let ask = match request.gpu {
            GpuDemand::None => None,
            GpuDemand::Shared { milli, .. } => Some(Ask::Memory(u64::from(milli.0) * UNIT_BYTES)),
            GpuDemand::Whole { count } => Some(Ask::Whole(count)),
        };
        let pool = |i: usize| workload.nodes[i].name.as_str();
        // kube-scheduler's filters: CPU and memory, and the DRA plugin (can the claim be
        // allocated on the node?); then NodeResourcesFit's LeastAllocated score.
        if options.node_by_policy && seq % 100 == 0 {
            let seen = order[..seq].iter().map(|&t| &workload.tasks[t].request);
            judge.set_policy(
                Policy::for_requests(PolicyKind::Baleen, seen, 0.95, Normalisers::default())
                    .for_cluster(cluster_cpu, cluster_gpus),
            );
        }
        let chosen = if options.node_by_policy && ask.is_some() {
            judge.choose(request, &mut decision_rng).map(|(i, _)| i)
        } else {
            (0..nodes.len())
                .filter(|&i| {
                    let s = &workload.nodes[i];
                    nodes[i].cpu_used + request.cpu.0 <= s.cpu.0
                        && nodes[i].memory_used + request.memory.0 <= s.memory.0
                        && ask.is_none_or(|a| allocator.fits(&nodes[i].slices, pool(i), a))
                })
                .map(|i| {
                    let n = &nodes[i];
                    (least_allocated(&workload.nodes[i], n.cpu_used, n.memory_used, request), i)
                })
                .max_by(|a, b| a.0.total_cmp(&b.0).then(ranks[b.1].cmp(&ranks[a.1])))
                .map(|(_, i)| i)
        };
        if let Some(i) = chosen {
            let uid = format!("claim-{seq}");
            let booked = match ask {
                None => Ok(GpuSet::default()),
                Some(a) => {
                    let given = allocator
                        .allocate(&nodes[i].slices, pool(i), &uid, a)
                        .context("the claim fitted when filtered")?;
                    let bookings: Vec<ClaimBooking> = given
                        .iter()
                        .map(|g| {
                            let target = nodes[i].targets.get(&g.device).cloned();
                            let device = match (target, g.consumed) {
                                (
                                    Some(baleen_agent::dra::Target::Shared(gpu_uuid)),
                                    Some(bytes),
                                ) => ClaimDevice::Share { gpu_uuid, bytes },
                                (Some(baleen_agent::dra::Target::Whole(gpu_uuid)), _) => {
                                    ClaimDevice::Whole { gpu_uuid }
                                }
                                (t, c) => anyhow::bail!("device {} ({t:?}, {c:?})", g.device),
                            };
                            Ok(ClaimBooking {
                                holder: ClaimHolder {
                                    namespace: "loop".into(),
                                    name: uid.clone(),
                                    uid: uid.clone(),
                                    request: "gpu".into(),
                                    device: g.device.clone(),
                                    share_id: g.share_id.clone(),
                                    pod: Some(format!("t{seq}")),
                                    priority: None,
                                },
                                device,
                            })
                        })
                        .collect::<Result<_>>()?;
                    let mut next = nodes[i].ledger.clone();
                    match next.book_claim(&bookings, 0) {
                        Ok(_) => {
                            nodes[i].ledger = next;
                            if options.fullest_first {
                                let owner = Owner {
                                    node_name: workload.nodes[i].name.clone(),
                                    node_uid: format!("uid-{i}"),
                                };
                                let devices = published(&nodes[i].ledger, options);
                                let built = slices::build(DRIVER, &owner, 1, &devices)?;
                                nodes[i].slices =
                                    serde_json::from_value(serde_json::to_value(&built)?)?;
                            }
                            let indices = bookings.iter().filter_map(|b| {
                                let uuid = match &b.device {
                                    ClaimDevice::Share { gpu_uuid, .. }
                                    | ClaimDevice::Whole { gpu_uuid } => gpu_uuid,
                                    ClaimDevice::Mig { .. } => return None,
                                };
                                nodes[i].ledger.gpus().position(|g| g.uuid.as_str() == uuid)
                            });
                            Ok(GpuSet::from_indices(indices).context("GPU indices")?)
                        }
                        Err(e) => {
                            allocator.release(&uid);
                            Err(e.to_string())
                        }
                    }
                }
            };
            match booked {
                Ok(gpus) => {
                    judge
                        .place(i, AllocationId(seq as u64), request, gpus)
                        .context("the judge's mirror of the booking")?;
                    nodes[i].cpu_used += request.cpu.0;
                    nodes[i].memory_used += request.memory.0;
                    allocated += request.gpu.total_milli();
                    placed += 1;
                }
                Err(why) => {
                    admission_failures += 1;
                    tracing::warn!(
                        claim = uid,
                        node = pool(i),
                        why,
                        "Prepare refused the allocation"
                    );
                }
            }
        }
        rows.push((
            100.0 * arrived as f64 / capacity as f64,
            100.0 - 100.0 * allocated as f64 / capacity as f64,
        ));
    }
    Ok(LoopOutcome {
        seed,
        submitted: order.len(),
        placed,
        admission_failures,
        unallocated_at_100: at_100(&rows),
    })
}
