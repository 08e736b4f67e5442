//! The cluster in the loop (`baleen_tests::cluster_loop`): a tenth of the default trace's nodes,
//! its tasks replayed through the extender over HTTP, the fake API server and one agent ledger
//! per node, each node's annotation reaching the extender five pods after its allocations
//! changed. No pod may fail admission, and the packing must be as good as `baleen-sim
//! --online-target` on the same nodes and seed (the full default list's three seeds are a
//! documented command: docs/benchmarks.md).

use anyhow::{Context as _, Result, ensure};
use baleen_scheduler_core::policy::PolicyKind;
use baleen_scheduler_sim::replay::{ReplayOptions, Workload, replay};
use baleen_tests::cluster_loop::{LoopOptions, run_seed};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trace_replayed_through_the_live_path_packs_like_the_replay() -> Result<()> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../shared/traces/alibaba-gpu-v2023");
    let mut workload = Workload::load(
        &dir.join("openb_node_list_gpu_node.csv"),
        &dir.join("openb_pod_list_default.csv"),
    )
    .context("the trace (../shared beside the repository)")?;
    workload.nodes = workload.nodes.into_iter().step_by(10).collect();
    let options = LoopOptions::default();
    let seed = 42;
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
    ensure!(
        live.unallocated_at_100 <= replayed + 0.3,
        "live {:.2} % unallocated, the replay {replayed:.2} %",
        live.unallocated_at_100
    );
    Ok(())
}
