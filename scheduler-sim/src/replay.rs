//! The FGD paper's trace replay protocol (`shared/benchmarks/placement.md`), as run by
//! `baleen-sim` and by the fidelity test.
//!
//! One run, for a policy, a workload and a seed:
//! 1. every node empty; the target workload built from the original task list;
//! 2. the tasks shuffled, then tasks drawn with replacement appended until the GPU demand would
//!    pass `tune` (130 %) of capacity, or random tasks removed while it is above;
//! 3. tasks submitted one at a time, each placed or failed for good;
//! 4. after each task, arrived %, unallocated % and fragmentation recorded, then bucketed by
//!    arrived % rounded half to even, 0..=130.
//!
//! Two quirks of the paper's simulator are kept on purpose, since the published numbers depend
//! on them: the inflation loop stops when the running total plus the drawn task's *per-GPU*
//! share would pass the target (a multi-GPU draw can overshoot), and ties between nodes go to a
//! fixed seeded node priority. Random streams are ChaCha8 seeded from the seed: the artifact's
//! streams are not reproduced, only their distribution.

use crate::trace::{self, TraceError, TraceTask};
use baleen_scheduler_core::cluster::ClusterScheduler;
use baleen_scheduler_core::frag::{self, TargetWorkload};
use baleen_scheduler_core::ledger::{AllocationId, LedgerError, NodeLedger};
use baleen_scheduler_core::model::{NodeSpec, Request};
use baleen_scheduler_core::policy::{Normalisers, Policy, PolicyKind};
use baleen_scheduler_core::units::MilliCpu;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Serialize;
use std::path::Path;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use thiserror::Error;

/// Buckets of arrived %: 0..=130.
pub const BUCKETS: usize = 131;
/// [`BUCKETS`] as the curves' `u32` bucket labels.
const BUCKET_COUNT: u32 = 131;
const _: () = assert!(BUCKET_COUNT as usize == BUCKETS);

/// The bucket of an arrived percentage already rounded to a whole number, if in range.
#[allow(
    clippy::cast_possible_truncation,
    clippy::cast_sign_loss,
    reason = "a whole number between 0 and 130, checked first"
)]
fn bucket_index(rounded_pct: f64) -> Option<usize> {
    (0.0..f64::from(BUCKET_COUNT)).contains(&rounded_pct).then_some(rounded_pct as usize)
}

/// The arrived-% bucket the headline figure is read at.
pub const HEADLINE_BUCKET: usize = 100;

/// A cluster and a task list.
#[derive(Clone, Debug)]
pub struct Workload {
    /// Short name, e.g. `default` for `openb_pod_list_default.csv`.
    pub name: String,
    /// The nodes, empty at the start of each run.
    pub nodes: Vec<NodeSpec>,
    /// The tasks, in file order.
    pub tasks: Vec<TraceTask>,
}

impl Workload {
    /// Reads a node list and a task list.
    pub fn load(nodes: &Path, tasks: &Path) -> Result<Self, TraceError> {
        let stem = tasks.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
        let name = stem.strip_prefix("openb_pod_list_").unwrap_or(&stem).to_owned();
        Ok(Self { name, nodes: trace::read_nodes(nodes)?, tasks: trace::read_tasks(tasks)? })
    }

    /// Total CPU and GPU count of the cluster (what [`Policy::for_cluster`] adapts to).
    pub fn cluster_capacity(&self) -> (MilliCpu, usize) {
        let cpu = self.nodes.iter().map(|n| n.cpu.0).sum();
        (MilliCpu(cpu), self.nodes.iter().map(|n| n.gpus.len()).sum())
    }

    /// Total GPU compute of the cluster in milli-GPU.
    pub fn gpu_capacity_milli(&self) -> u64 {
        self.nodes.iter().map(|n| n.gpus.len() as u64 * 1000).sum()
    }

    /// The target workload of this task list.
    pub fn target(&self, coverage: f64, with_memory: bool) -> TargetWorkload {
        TargetWorkload::from_requests(self.tasks.iter().map(|t| &t.request), coverage, with_memory)
    }
}

/// Knobs of the protocol.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ReplayOptions {
    /// Target GPU demand as a fraction of capacity (1.3 in the paper).
    pub tune: f64,
    /// Share of tasks the target workload covers (0.95 in the paper).
    pub coverage: f64,
    /// Scales of the dot-product and best-fit scores.
    pub normalisers: Normalisers,
    /// Learn the policy's target workload online instead of from the whole list: start with
    /// none and rebuild it from the requests submitted so far every this many tasks, as a live
    /// scheduler must. `None`: the paper's protocol (the whole original list).
    pub online_target: Option<usize>,
}

impl Default for ReplayOptions {
    fn default() -> Self {
        Self { tune: 1.3, coverage: 0.95, normalisers: Normalisers::default(), online_target: None }
    }
}

/// Why a replay could not run.
#[derive(Debug, Error)]
pub enum ReplayError {
    /// The cluster has no GPU, so no percentage can be computed.
    #[error("workload {0}: the node list has no GPU")]
    NoGpus(String),
    /// The workload has no task.
    #[error("workload {0}: the task list is empty")]
    NoTasks(String),
    /// A node of the list is unusable.
    #[error("workload {workload}")]
    Node {
        /// The workload.
        workload: String,
        /// The cause.
        source: LedgerError,
    },
    /// A policy chose a placement the ledger refused: a bug in the policy.
    #[error("workload {workload}, policy {policy}, seed {seed}: placement refused")]
    Refused {
        /// The workload.
        workload: String,
        /// The policy.
        policy: PolicyKind,
        /// The seed.
        seed: u64,
        /// The cause.
        source: LedgerError,
    },
}

/// What one seed of one policy produced.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SeedOutcome {
    /// The seed.
    pub seed: u64,
    /// Tasks submitted (after inflation).
    pub submitted: usize,
    /// Tasks placed.
    pub placed: usize,
    /// Unallocated GPU % per arrived-% bucket.
    pub unallocated_pct: Vec<f64>,
    /// Fragmentation amount (% of cluster GPU) per bucket.
    pub frag_amount_pct: Vec<f64>,
    /// Fragmentation ratio (% of idle GPU) per bucket.
    pub frag_ratio_pct: Vec<f64>,
    /// Tasks that failed while arrived % was at most 100 (rounded), by class: what the
    /// headline figure is made of.
    pub failed_up_to_100: Vec<FailedClass>,
    /// Wall time of the run in seconds (kept out of JSON, which stays deterministic).
    #[serde(skip)]
    pub seconds: f64,
}

/// Failed tasks of one class.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct FailedClass {
    /// `None` for CPU-only, `Some(0)` for shared GPUs, `Some(k)` for `k` whole GPUs.
    pub class: Option<u32>,
    /// How many failed.
    pub tasks: usize,
    /// Their GPU demand in milli-GPU.
    pub gpu_milli: u64,
}

impl SeedOutcome {
    /// Unallocated GPU % at arrived = 100 %.
    pub fn unallocated_at_100(&self) -> f64 {
        self.unallocated_pct[HEADLINE_BUCKET]
    }
}

/// The task order of one run: indices into `tasks`.
pub fn submission_order(
    tasks: &[TraceTask],
    capacity_milli: u64,
    tune: f64,
    rng: &mut impl Rng,
) -> Vec<usize> {
    let mut order: Vec<usize> = (0..tasks.len()).collect();
    order.shuffle(rng);
    let target = tune * capacity_milli as f64;
    let demand = |i: usize| tasks[i].request.gpu.total_milli();
    let mut total: u64 = order.iter().map(|&i| demand(i)).sum();
    if total as f64 > target {
        while total as f64 > target && !order.is_empty() {
            let k = rng.random_range(0..order.len());
            total -= demand(order.remove(k));
        }
    } else if !tasks.is_empty() {
        loop {
            let i = rng.random_range(0..tasks.len());
            // The artifact's test: the running total plus the task's per-GPU share.
            let share = u64::from(tasks[i].request.gpu.milli_per_gpu().0);
            if (total + share) as f64 > target {
                break;
            }
            total += demand(i);
            order.push(i);
        }
    }
    order
}

/// A fixed tie-break priority for the nodes: `ranks[i]` is node `i`'s place (lower first),
/// from a seeded permutation over the nodes sorted by name.
pub fn node_ranks(nodes: &[NodeSpec], rng: &mut impl Rng) -> Vec<u32> {
    let mut by_name: Vec<usize> = (0..nodes.len()).collect();
    by_name.sort_by(|&a, &b| nodes[a].name.cmp(&nodes[b].name));
    // A node list has thousands of nodes; past 2^32 the last ones would share a rank.
    let mut perm: Vec<u32> = (0..u32::try_from(nodes.len()).unwrap_or(u32::MAX)).collect();
    perm.shuffle(rng);
    let mut ranks = vec![0; nodes.len()];
    for (k, &node) in by_name.iter().enumerate() {
        ranks[node] = perm[k];
    }
    ranks
}

/// One seed's run before its first task: what [`replay_seed`] submits, and tools that replay a
/// seed their own way (stopping early, inspecting the cluster) start from, so that a seed means
/// the same run everywhere.
#[derive(Debug)]
pub struct SeedRun {
    /// The task order: indices into the workload's tasks.
    pub order: Vec<usize>,
    /// The empty cluster with the seed's node priority and the policy.
    pub cluster: ClusterScheduler,
    /// The random stream of the decisions (the random policy's picks).
    pub decision_rng: ChaCha8Rng,
}

impl SeedRun {
    /// The order (shuffle and inflation to `options.tune`), node priority and decision stream
    /// of `seed`, and an empty cluster of `workload`'s nodes under `policy`.
    pub fn start(
        workload: &Workload,
        policy: &Policy,
        seed: u64,
        options: &ReplayOptions,
    ) -> Result<Self, ReplayError> {
        let capacity = workload.gpu_capacity_milli();
        if capacity == 0 {
            return Err(ReplayError::NoGpus(workload.name.clone()));
        }
        if workload.tasks.is_empty() {
            return Err(ReplayError::NoTasks(workload.name.clone()));
        }
        let mut order_rng = ChaCha8Rng::seed_from_u64(seed);
        let order = submission_order(&workload.tasks, capacity, options.tune, &mut order_rng);
        let ranks = node_ranks(&workload.nodes, &mut order_rng);
        let mut decision_rng = ChaCha8Rng::seed_from_u64(seed);
        decision_rng.set_stream(1);
        let nodes = workload
            .nodes
            .iter()
            .map(|n| NodeLedger::new(n.clone()))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|source| ReplayError::Node { workload: workload.name.clone(), source })?;
        let cluster = ClusterScheduler::new(policy.clone(), nodes, ranks);
        Ok(Self { order, cluster, decision_rng })
    }
}

/// Runs one seed of one policy. `metric` is the target workload the fragmentation curves are
/// measured against (the paper's, whatever the policy).
pub fn replay_seed(
    workload: &Workload,
    metric: &TargetWorkload,
    policy: &Policy,
    seed: u64,
    options: &ReplayOptions,
) -> Result<SeedOutcome, ReplayError> {
    let kind = policy.kind();
    let started = std::time::Instant::now();
    let capacity = workload.gpu_capacity_milli();
    let SeedRun { order, mut cluster, mut decision_rng } =
        SeedRun::start(workload, policy, seed, options)?;
    let mut fragment =
        RunningSum::new(cluster.nodes().iter().map(|n| frag::ledger_fragment(metric, n)).collect());
    let mut arrived: u64 = 0;
    let mut allocated: u64 = 0;
    let mut placed = 0;
    let mut failed: Vec<FailedClass> = Vec::new();
    let mut rows: Vec<Row> = Vec::with_capacity(order.len());
    for (seq, &task) in order.iter().enumerate() {
        if options.online_target.is_some_and(|every| every > 0 && seq % every == 0) {
            let seen = order[..seq].iter().map(|&t| &workload.tasks[t].request);
            let (cpu, gpus) = workload.cluster_capacity();
            cluster.set_policy(
                Policy::for_requests(kind, seen, options.coverage, options.normalisers)
                    .for_cluster(cpu, gpus),
            );
        }
        let request = &workload.tasks[task].request;
        let choice = cluster.choose(request, &mut decision_rng);
        arrived += request.gpu.total_milli();
        if let Some((n, scored)) = choice {
            cluster.place(n, AllocationId(seq as u64), request, scored.gpus).map_err(|source| {
                ReplayError::Refused { workload: workload.name.clone(), policy: kind, seed, source }
            })?;
            fragment.set(n, frag::ledger_fragment(metric, &cluster.nodes()[n]));
            allocated += request.gpu.total_milli();
            placed += 1;
        } else if (100.0 * arrived as f64 / capacity as f64).round_ties_even()
            <= HEADLINE_BUCKET as f64
        {
            let class = request.gpu.class();
            let i =
                failed.iter().position(|f: &FailedClass| f.class == class).unwrap_or_else(|| {
                    failed.push(FailedClass { class, tasks: 0, gpu_milli: 0 });
                    failed.len() - 1
                });
            failed[i].tasks += 1;
            failed[i].gpu_milli += request.gpu.total_milli();
        }
        let fragment = fragment.total();
        let idle = (capacity - allocated) as f64;
        rows.push(Row {
            arrived_pct: 100.0 * arrived as f64 / capacity as f64,
            values: [
                100.0 - 100.0 * allocated as f64 / capacity as f64,
                100.0 * fragment / capacity as f64,
                if idle > 0.0 { 100.0 * fragment / idle } else { 0.0 },
            ],
        });
    }
    let [unallocated_pct, frag_amount_pct, frag_ratio_pct] = bucket(&rows);
    Ok(SeedOutcome {
        seed,
        submitted: order.len(),
        placed,
        unallocated_pct,
        frag_amount_pct,
        frag_ratio_pct,
        failed_up_to_100: {
            failed.sort_by_key(|f| f.class);
            failed
        },
        seconds: started.elapsed().as_secs_f64(),
    })
}

/// The sum of a list of values, in list order, as `Iterator::sum` adds them, kept up to date as
/// values change: the cluster's fragmentation is the sum of its nodes', read after every task.
///
/// Floating-point addition is not associative, so the total cannot be corrected by the change
/// of one value without changing its last bits. Instead the partial sums are kept: changing
/// value `i` re-adds only the values from `i` on (half the list on average, where summing
/// afresh after every task re-added all of it, whether a node had changed or not).
struct RunningSum {
    values: Vec<f64>,
    /// `partial[k]`: the sum of `values[..k]`.
    partial: Vec<f64>,
}

impl RunningSum {
    fn new(values: Vec<f64>) -> Self {
        // Iterator::sum's starting value (-0.0 in recent Rust releases).
        let partial = vec![std::iter::empty::<f64>().sum(); values.len() + 1];
        let mut sum = Self { values, partial };
        sum.readd_from(0);
        sum
    }

    fn set(&mut self, i: usize, value: f64) {
        self.values[i] = value;
        self.readd_from(i);
    }

    fn readd_from(&mut self, i: usize) {
        // The running sum stays in a register: reading it back from `partial` would put a
        // store-to-load round trip on the chain of additions.
        let mut sum = self.partial[i];
        for (value, partial) in self.values[i..].iter().zip(&mut self.partial[i + 1..]) {
            sum += value;
            *partial = sum;
        }
    }

    fn total(&self) -> f64 {
        self.partial[self.values.len()]
    }
}

/// One record: arrived % and the values measured after a task.
struct Row {
    arrived_pct: f64,
    values: [f64; 3],
}

/// Averages rows per arrived-% bucket (rounded half to even); an empty bucket averages the rows
/// of its neighbours (±1), as the paper's analysis does; NaN where those are empty too.
fn bucket(rows: &[Row]) -> [Vec<f64>; 3] {
    let mut sums = vec![[0.0f64; 3]; BUCKETS];
    let mut counts = vec![0u32; BUCKETS];
    for row in rows {
        let b = row.arrived_pct.round_ties_even();
        if let Some(b) = bucket_index(b) {
            counts[b] += 1;
            for (sum, value) in sums[b].iter_mut().zip(row.values) {
                *sum += value;
            }
        }
    }
    let mut out: [Vec<f64>; 3] = Default::default();
    for b in 0..BUCKETS {
        let span =
            if counts[b] > 0 { b..=b } else { b.saturating_sub(1)..=(b + 1).min(BUCKETS - 1) };
        let n: u32 = counts[span.clone()].iter().sum();
        for (k, curve) in out.iter_mut().enumerate() {
            let s: f64 = sums[span.clone()].iter().map(|v| v[k]).sum();
            curve.push(if n > 0 { s / f64::from(n) } else { f64::NAN });
        }
    }
    out
}

/// Mean, standard deviation and values over seeds.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SeedStat {
    /// Mean.
    pub mean: f64,
    /// Sample standard deviation (n - 1); 0 for one seed.
    pub sd: f64,
    /// One value per seed, in seed order.
    pub per_seed: Vec<f64>,
}

impl SeedStat {
    /// Statistics of `values`.
    pub fn of(values: Vec<f64>) -> Self {
        let n = values.len() as f64;
        let mean = values.iter().sum::<f64>() / n;
        let sd = if values.len() > 1 {
            (values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / (n - 1.0)).sqrt()
        } else {
            0.0
        };
        Self { mean, sd, per_seed: values }
    }
}

/// Curves averaged over seeds, one value per arrived-% bucket (`arrived_pct`).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Curves {
    /// The buckets, 0..=130.
    pub arrived_pct: Vec<u32>,
    /// Unallocated GPU %.
    pub unallocated_pct: Vec<f64>,
    /// Fragmentation amount, % of cluster GPU.
    pub frag_amount_pct: Vec<f64>,
    /// Fragmentation ratio, % of idle GPU.
    pub frag_ratio_pct: Vec<f64>,
}

/// The result of one policy on one workload over several seeds.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PolicySummary {
    /// The workload name.
    pub workload: String,
    /// The policy name.
    pub policy: String,
    /// The seeds.
    pub seeds: Vec<u64>,
    /// The inflation target.
    pub tune: f64,
    /// The headline: unallocated GPU % at arrived = 100 %.
    pub unallocated_pct_at_100: SeedStat,
    /// Fragmentation amount % at arrived = 100 %.
    pub frag_amount_pct_at_100: SeedStat,
    /// Tasks that failed up to arrived = 100 %, by class, averaged over seeds.
    pub failed_up_to_100: Vec<FailedSummary>,
    /// Tasks placed, per seed.
    pub placed: Vec<usize>,
    /// Tasks submitted, per seed.
    pub submitted: Vec<usize>,
    /// Wall seconds of each seed's run (kept out of JSON, which stays deterministic).
    #[serde(skip)]
    pub seconds: Vec<f64>,
    /// Mean curves over the seeds.
    pub curves: Curves,
}

impl PolicySummary {
    /// Summarises the outcomes of one policy (in seed order).
    pub fn of(
        workload: &str,
        kind: PolicyKind,
        tune: f64,
        capacity_milli: u64,
        outcomes: &[SeedOutcome],
    ) -> Self {
        let mean_curve = |f: &dyn Fn(&SeedOutcome) -> &Vec<f64>| -> Vec<f64> {
            (0..BUCKETS)
                .map(|b| outcomes.iter().map(|o| f(o)[b]).sum::<f64>() / outcomes.len() as f64)
                .collect()
        };
        Self {
            workload: workload.to_owned(),
            policy: kind.name().to_owned(),
            seeds: outcomes.iter().map(|o| o.seed).collect(),
            tune,
            unallocated_pct_at_100: SeedStat::of(
                outcomes.iter().map(SeedOutcome::unallocated_at_100).collect(),
            ),
            frag_amount_pct_at_100: SeedStat::of(
                outcomes.iter().map(|o| o.frag_amount_pct[HEADLINE_BUCKET]).collect(),
            ),
            failed_up_to_100: FailedSummary::of(outcomes, capacity_milli),
            placed: outcomes.iter().map(|o| o.placed).collect(),
            submitted: outcomes.iter().map(|o| o.submitted).collect(),
            seconds: outcomes.iter().map(|o| o.seconds).collect(),
            curves: Curves {
                arrived_pct: (0..BUCKET_COUNT).collect(),
                unallocated_pct: mean_curve(&|o| &o.unallocated_pct),
                frag_amount_pct: mean_curve(&|o| &o.frag_amount_pct),
                frag_ratio_pct: mean_curve(&|o| &o.frag_ratio_pct),
            },
        }
    }
}

/// Failed tasks of one class, averaged over seeds.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct FailedSummary {
    /// `cpu-only`, `shared`, or `K-gpu`.
    pub class: String,
    /// Mean number of failed tasks per seed.
    pub tasks: f64,
    /// Mean failed GPU demand, % of cluster GPU.
    pub gpu_pct: f64,
}

impl FailedSummary {
    fn of(outcomes: &[SeedOutcome], capacity_milli: u64) -> Vec<Self> {
        let mut classes: Vec<Option<u32>> =
            outcomes.iter().flat_map(|o| o.failed_up_to_100.iter().map(|f| f.class)).collect();
        classes.sort();
        classes.dedup();
        let n = outcomes.len().max(1) as f64;
        classes
            .into_iter()
            .map(|class| {
                let (tasks, milli) = outcomes
                    .iter()
                    .flat_map(|o| o.failed_up_to_100.iter().filter(|f| f.class == class))
                    .fold((0usize, 0u64), |(t, m), f| (t + f.tasks, m + f.gpu_milli));
                FailedSummary {
                    class: match class {
                        None => "cpu-only".to_owned(),
                        Some(0) => "shared".to_owned(),
                        Some(k) => format!("{k}-gpu"),
                    },
                    tasks: tasks as f64 / n,
                    gpu_pct: 100.0 * milli as f64 / capacity_milli as f64 / n,
                }
            })
            .collect()
    }
}

/// Runs every (policy, seed) pair on `threads` threads and summarises each policy, in the
/// order of `kinds`.
pub fn replay(
    workload: &Workload,
    kinds: &[PolicyKind],
    seeds: &[u64],
    options: &ReplayOptions,
    threads: usize,
) -> Result<Vec<PolicySummary>, ReplayError> {
    let metric = workload.target(options.coverage, false);
    let requests: Vec<&Request> = workload.tasks.iter().map(|t| &t.request).collect();
    let policies: Vec<Policy> = kinds
        .iter()
        .map(|&k| {
            let (cpu, gpus) = workload.cluster_capacity();
            Policy::for_requests(k, requests.iter().copied(), options.coverage, options.normalisers)
                .for_cluster(cpu, gpus)
        })
        .collect();
    let jobs: Vec<(&Policy, u64)> =
        policies.iter().flat_map(|p| seeds.iter().map(move |&s| (p, s))).collect();
    let results: Mutex<Vec<Option<Result<SeedOutcome, ReplayError>>>> =
        Mutex::new((0..jobs.len()).map(|_| None).collect());
    let next = AtomicUsize::new(0);
    std::thread::scope(|scope| {
        for _ in 0..threads.clamp(1, jobs.len().max(1)) {
            scope.spawn(|| {
                loop {
                    let j = next.fetch_add(1, Ordering::Relaxed);
                    let Some(&(policy, seed)) = jobs.get(j) else { break };
                    let outcome = replay_seed(workload, &metric, policy, seed, options);
                    results.lock().unwrap_or_else(|e| e.into_inner())[j] = Some(outcome);
                }
            });
        }
    });
    let results = results.into_inner().unwrap_or_else(|e| e.into_inner());
    let mut outcomes = results.into_iter().flatten();
    kinds
        .iter()
        .map(|&kind| {
            let runs = outcomes.by_ref().take(seeds.len()).collect::<Result<Vec<_>, _>>()?;
            Ok(PolicySummary::of(
                &workload.name,
                kind,
                options.tune,
                workload.gpu_capacity_milli(),
                &runs,
            ))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Whatever values change, the running total is bit for bit the sum of the current
        /// values in order, as `Iterator::sum` gives it.
        #[test]
        fn running_sum_is_the_sum_in_order(
            values in proptest::collection::vec(-1e6f64..1e6, 0..40),
            changes in proptest::collection::vec((0usize..40, -1e6f64..1e6), 0..40),
        ) {
            let mut values = values;
            let mut sum = RunningSum::new(values.clone());
            prop_assert_eq!(sum.total().to_bits(), values.iter().sum::<f64>().to_bits());
            let n = values.len();
            for (i, v) in changes.into_iter().filter(|&(i, _)| i < n) {
                values[i] = v;
                sum.set(i, v);
                prop_assert_eq!(sum.total().to_bits(), values.iter().sum::<f64>().to_bits());
            }
        }
    }
}
