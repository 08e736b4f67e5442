//! The default trace through the real kube-scheduler, baleen's extender and the agents' ledgers
//! (issue 40, item 5), beside `baleen-sim --online-target` on the same list and seeds:
//! `baleen_tests::real::trace`.
//!
//! ```text
//! cargo build --release -p baleen-extender
//! BALEEN_KUBE=$(scripts/build-control-plane.sh) cargo bench -p baleen-tests --bench real_trace -- \
//!     --seeds=42,43,44
//! ```
//!
//! Options: `--nodes=FILE --pods=FILE` (the default list of `../shared/traces/`), `--every=K`
//! (every K-th node only, for a quicker run), `--set=key=value` (a chart value, repeatable:
//! `--set=scheduler.percentageOfNodesToScore=null` for kube-scheduler's adaptive sample),
//! `--dra=true` (every node a DRA driver, the GPU tasks claims allocated by the real allocator).
//! Figures: docs/benchmarks.md, "The default trace through the real kube-scheduler".

use std::path::PathBuf;

use anyhow::{Context as _, Result, bail};
use baleen_scheduler_core::policy::PolicyKind;
use baleen_scheduler_sim::replay::{ReplayOptions, Workload, replay};
use baleen_tests::real::trace::{TraceOptions, run_seed};

#[tokio::main]
async fn main() -> Result<()> {
    let traces = baleen_tests::real::repo().join("../shared/traces/alibaba-gpu-v2023");
    let mut nodes_file = traces.join("openb_node_list_gpu_node.csv");
    let mut pods_file = traces.join("openb_pod_list_default.csv");
    let mut seeds = vec![42u64, 43, 44];
    let mut every = 1usize;
    let mut options = TraceOptions::default();
    for arg in std::env::args().skip(1) {
        let Some((key, value)) = arg.split_once('=') else {
            continue; // cargo bench's own `--bench`
        };
        match key {
            "--nodes" => nodes_file = PathBuf::from(value),
            "--pods" => pods_file = PathBuf::from(value),
            "--seeds" => seeds = value.split(',').map(str::parse).collect::<Result<_, _>>()?,
            "--every" => every = value.parse()?,
            "--set" => options.values.push(value.to_owned()),
            "--dra" => options.dra = value.parse()?,
            _ => bail!(
                "unknown argument {arg}: --nodes=FILE --pods=FILE --seeds=42,43 --every=K \
                 --set=key=value --dra=true"
            ),
        }
    }
    let mut workload = Workload::load(&nodes_file, &pods_file)
        .with_context(|| format!("the trace {}", nodes_file.display()))?;
    workload.nodes = workload.nodes.into_iter().step_by(every.max(1)).collect();
    let sim = replay(
        &workload,
        &[PolicyKind::Baleen],
        &seeds,
        &ReplayOptions { online_target: Some(100), ..ReplayOptions::default() },
        2,
    )?;
    println!(
        "workload {} ({} nodes, {}), chart values {:?}",
        workload.name,
        workload.nodes.len(),
        if options.dra { "DRA drivers" } else { "device-plugin agents" },
        options.values,
    );
    println!(
        "| seed | pods submitted | placed | refused | admission failures | unallocated GPU % at arrived 100 %: real scheduler | `baleen-sim --online-target 100` | mean decision ms | wall s |\n|---|---|---|---|---|---|---|---|---|"
    );
    for (k, &seed) in seeds.iter().enumerate() {
        let run = run_seed(&workload, seed, &options).await?;
        let o = &run.outcome;
        println!(
            "| {seed} | {} | {} | {} | {} | {:.2} | {:.2} | {:.1} | {:.0} |",
            o.submitted,
            o.placed,
            run.refusals.values().sum::<usize>(),
            o.admission_failures,
            o.unallocated_at_100,
            sim[0].unallocated_pct_at_100.per_seed[k],
            run.mean_decision.as_secs_f64() * 1e3,
            run.wall.as_secs_f64()
        );
    }
    Ok(())
}
