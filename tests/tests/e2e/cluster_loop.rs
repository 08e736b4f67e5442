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

/// A tenth of the trace's nodes, `list`'s tasks replayed through the live path for `seed`, and
/// the replay's `--online-target` on the same nodes and seed: (live, replayed) unallocated %.
async fn live_and_replayed(list: &str, seed: u64) -> Result<(f64, f64)> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../shared/traces/alibaba-gpu-v2023");
    let mut workload = Workload::load(
        &dir.join("openb_node_list_gpu_node.csv"),
        &dir.join(format!("openb_pod_list_{list}.csv")),
    )
    .context("the trace (../shared beside the repository)")?;
    workload.nodes = workload.nodes.into_iter().step_by(10).collect();
    let options = LoopOptions::default();
    let live = run_seed(&workload, seed, &options).await?;
    let sim = replay(
        &workload,
        &[PolicyKind::Baleen],
        &[seed],
        &ReplayOptions { online_target: Some(options.rebuild_every), ..ReplayOptions::default() },
        1,
    )?;
    let replayed = sim[0].unallocated_pct_at_100.per_seed[0];
    ensure!(
        live.admission_failures == 0,
        "{} pods failed admission: {live:?}",
        live.admission_failures
    );
    ensure!(live.placed > live.submitted / 2, "{live:?}");
    Ok((live.unallocated_at_100, replayed))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trace_replayed_through_the_live_path_packs_like_the_replay() -> Result<()> {
    let (live, replayed) = live_and_replayed("default", 42).await?;
    ensure!(live <= replayed + 0.3, "live {live:.2} % unallocated, the replay {replayed:.2} %");
    Ok(())
}
