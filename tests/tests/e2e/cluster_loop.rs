//! The cluster in the loop (`baleen_tests::cluster_loop`): a tenth of the default trace's nodes,
//! its tasks replayed through the extender over HTTP, the fake API server and one agent ledger
//! per node, each node's annotation reaching the extender five pods after its allocations
//! changed. No pod may fail admission, and the packing must be as good as `baleen-sim
//! --online-target` on the same nodes and seed (the full default list's three seeds are a
//! documented command: docs/benchmarks.md, as is cpu300, where CPU is scarce).

use anyhow::{Context as _, Result, ensure};
use baleen_scheduler_core::policy::PolicyKind;
use baleen_scheduler_sim::replay::{ReplayOptions, Workload, replay};
use baleen_tests::cluster_loop::{LoopOptions, run_seed};

/// Every tenth node of the trace's node list, with the tasks of `list` (`default`, `cpu300`).
fn tenth_of(list: &str) -> Result<Workload> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../shared/traces/alibaba-gpu-v2023");
    let mut workload = Workload::load(
        &dir.join("openb_node_list_gpu_node.csv"),
        &dir.join(format!("openb_pod_list_{list}.csv")),
    )
    .context("the trace (../shared beside the repository)")?;
    workload.nodes = workload.nodes.into_iter().step_by(10).collect();
    Ok(workload)
}

/// A tenth of the trace's nodes, `list`'s tasks replayed through the live path for each of
/// `seeds` (with `options`), and the replay's `--online-target` on the same nodes and seeds:
/// the mean (live, replayed) unallocated %.
async fn live_and_replayed(list: &str, seeds: &[u64], options: &LoopOptions) -> Result<(f64, f64)> {
    let workload = tenth_of(list)?;
    let mut live = 0.0;
    for &seed in seeds {
        let outcome = run_seed(&workload, seed, options).await?;
        ensure!(
            outcome.admission_failures == 0,
            "{} pods failed admission: {outcome:?}",
            outcome.admission_failures
        );
        ensure!(outcome.placed > outcome.submitted / 2, "{outcome:?}");
        live += outcome.unallocated_at_100;
    }
    let sim = replay(
        &workload,
        &[PolicyKind::Baleen],
        seeds,
        &ReplayOptions { online_target: Some(options.rebuild_every), ..ReplayOptions::default() },
        1,
    )?;
    let per_seed = &sim[0].unallocated_pct_at_100.per_seed;
    let replayed = per_seed.iter().sum::<f64>() / per_seed.len() as f64;
    Ok((live / seeds.len() as f64, replayed))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trace_replayed_through_the_live_path_packs_like_the_replay() -> Result<()> {
    let options = LoopOptions { settled: true, ..LoopOptions::default() };
    let (live, replayed) = live_and_replayed("default", &[42], &options).await?;
    ensure!(live <= replayed + 0.3, "live {live:.2} % unallocated, the replay {replayed:.2} %");
    Ok(())
}

/// Issue 25, item 3: where CPU is scarce (cpu300), the live path packs like the replay once the
/// CPU-only pods are placed by the policy too, as the replay places every task: the extender
/// scores them (`--score-cpu-only-pods`) and learns its target from every pod. Placed by
/// NodeResourcesFit instead (the loop's default, kube-scheduler with `managedResources`), the
/// same ten seeds were 2.86 points worse (docs/benchmarks.md).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn where_cpu_is_scarce_the_live_path_packs_like_the_replay() -> Result<()> {
    let options = LoopOptions { cpu_by_extender: true, settled: true, ..LoopOptions::default() };
    let seeds: Vec<u64> = (42..52).collect();
    let (live, replayed) = live_and_replayed("cpu300", &seeds, &options).await?;
    ensure!(
        live <= replayed + 0.3,
        "cpu300, ten seeds: live {live:.2} % unallocated, the replay {replayed:.2} %"
    );
    Ok(())
}

/// Issue 26, item 7: the same nodes and seed with every node a DRA driver: kube-scheduler's DRA
/// allocator (the test allocator, first fit by each device's requestPolicy) allocates from the
/// agent's own slices, and every allocation it makes is one the agent's ledger books at Prepare
/// (no admission failure); its packing is reported beside the extender's (docs/benchmarks.md),
/// not held to it: first fit is not a packing policy.
#[test]
fn every_allocation_of_the_dra_allocator_is_booked_at_prepare() -> Result<()> {
    let workload = tenth_of("default")?;
    let outcome = baleen_tests::dra_loop::run_seed(&workload, 42, 1.3)?;
    ensure!(outcome.admission_failures == 0, "Prepare refused allocations: {outcome:?}");
    ensure!(outcome.placed > outcome.submitted / 2, "{outcome:?}");
    ensure!(outcome.unallocated_at_100.is_finite(), "{outcome:?}");
    Ok(())
}

/// Issue 40, item 5 (the DRA packing gap), in the fake DRA loop on a tenth of the nodes: with
/// the node chosen by the policy (what the extender does for claim pods with
/// `--dra-device-class`), DRA pods pack as the replay, where the allocator's first fit and
/// NodeResourcesFit's LeastAllocated leave points more unallocated; every allocation is still
/// booked at Prepare.
#[test]
fn dra_pods_whose_node_the_policy_chooses_pack_like_the_replay() -> Result<()> {
    use baleen_tests::dra_loop::{DraOptions, run_seed_with};
    let workload = tenth_of("default")?;
    let first_fit = run_seed_with(&workload, 42, 1.3, DraOptions::default())?;
    let judged = run_seed_with(
        &workload,
        42,
        1.3,
        DraOptions { node_by_policy: true, ..DraOptions::default() },
    )?;
    ensure!(judged.admission_failures == 0, "Prepare refused allocations: {judged:?}");
    let sim = replay(
        &workload,
        &[PolicyKind::Baleen],
        &[42],
        &ReplayOptions { online_target: Some(100), ..ReplayOptions::default() },
        1,
    )?;
    let replayed = sim[0].unallocated_pct_at_100.per_seed[0];
    // The device is still first fit here: on a tenth of the nodes that costs up to half a
    // point (4.69 against the replay's 4.27 on seed 42, 2026-12-07); on every node the fake
    // was within 0.2 of the replay on seeds 42-44 (docs/benchmarks.md).
    ensure!(
        judged.unallocated_at_100 <= replayed + 0.5,
        "judged by the policy {:.2} % unallocated, the replay {replayed:.2} %",
        judged.unallocated_at_100
    );
    ensure!(
        judged.unallocated_at_100 + 1.0 < first_fit.unallocated_at_100,
        "judged {:.2} %, first fit {:.2} %: the node should matter",
        judged.unallocated_at_100,
        first_fit.unallocated_at_100
    );
    Ok(())
}
