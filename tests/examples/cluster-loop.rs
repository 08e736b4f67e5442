//! The cluster in the loop as a program: replays a trace list through the extender (over HTTP),
//! a fake API server and one agent ledger per node (`baleen_tests::cluster_loop`), and beside it
//! `baleen-sim --online-target` on the same list and seeds; prints both, with the admission
//! failures of the live path.
//!
//! `cargo run --release -p baleen-tests --example cluster-loop -- \
//!   --nodes ../shared/traces/alibaba-gpu-v2023/openb_node_list_gpu_node.csv \
//!   --pods ../shared/traces/alibaba-gpu-v2023/openb_pod_list_default.csv --seeds 42,43,44`

use std::path::PathBuf;

use anyhow::Context as _;
use baleen_scheduler_core::policy::PolicyKind;
use baleen_scheduler_sim::replay::{ReplayOptions, Workload, replay};
use baleen_tests::cluster_loop::{LoopOptions, run_seed};
use clap::Parser;

#[derive(Parser)]
struct Args {
    /// The node list (CSV).
    #[arg(long)]
    nodes: PathBuf,
    /// The task list (CSV).
    #[arg(long)]
    pods: PathBuf,
    /// Seeds, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "42,43,44")]
    seeds: Vec<u64>,
    /// A node's annotation is written this many pods after its allocations changed.
    #[arg(long, default_value_t = 5)]
    annotation_delay: usize,
    /// A grant's pod is named in the annotation this many pods after the grant.
    #[arg(long, default_value_t = 20)]
    listing_delay: usize,
    /// The extender (and baleen-sim's online target) rebuild after this many pods.
    #[arg(long, default_value_t = 100)]
    rebuild_every: usize,
    /// CPU-only pods by NodeResourcesFit MostAllocated (packing) instead of LeastAllocated.
    #[arg(long)]
    cpu_most_allocated: bool,
    /// CPU-only pods through the extender too, scored by the policy (--score-cpu-only-pods).
    #[arg(long)]
    cpu_by_extender: bool,
    /// Keep every k-th node only (1: all), for a quicker run.
    #[arg(long, default_value_t = 1)]
    every: usize,
    /// Wait before each pod until the extender has learned every pod and finished the rebuilds
    /// they asked for (what the CI tests do: the packing then does not depend on timing).
    #[arg(long)]
    settled: bool,
    /// Also run every seed with each node a DRA driver (`baleen_tests::dra_loop`): the test
    /// allocator choosing devices first fit, kube-scheduler's LeastAllocated choosing nodes.
    #[arg(long)]
    dra: bool,
    /// With --dra: nodes chosen by the policy (the extender judging DRA nodes), not by
    /// kube-scheduler's LeastAllocated.
    #[arg(long)]
    dra_node_by_policy: bool,
    /// With --dra: each node's shared GPUs listed fullest first in its slices (the agent's
    /// order), so the allocator's first fit is a best fit.
    #[arg(long)]
    dra_fullest_first: bool,
    /// With --dra: skip the live device-plugin loop (the DRA figures only).
    #[arg(long)]
    dra_only: bool,
    /// kube-scheduler's percentageOfNodesToScore: 100 (the chart's) sends every node that fits
    /// to the extender; 0 its adaptive sample (41 % of the default list's 1,213 nodes).
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u32).range(0..=100))]
    percentage_of_nodes_to_score: u32,
    /// The extender's --filter-keep-best (0: every node that fits; the chart's is 50).
    #[arg(long, default_value_t = 0)]
    filter_keep_best: usize,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let mut workload = Workload::load(&args.nodes, &args.pods).context("the trace")?;
    workload.nodes = workload.nodes.into_iter().step_by(args.every.max(1)).collect();
    let options = LoopOptions {
        annotation_delay: args.annotation_delay,
        rebuild_every: args.rebuild_every,
        listing_delay: args.listing_delay,
        cpu_most_allocated: args.cpu_most_allocated,
        cpu_by_extender: args.cpu_by_extender,
        settled: args.settled,
        percentage_of_nodes_to_score: args.percentage_of_nodes_to_score,
        filter_keep_best: args.filter_keep_best,
        ..LoopOptions::default()
    };
    let sim = replay(
        &workload,
        &[PolicyKind::Baleen],
        &args.seeds,
        &ReplayOptions { online_target: Some(args.rebuild_every), ..ReplayOptions::default() },
        2,
    )?;
    let runtime =
        tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    println!(
        "workload {} ({} nodes), annotation delay {} pods, pods named {} pods after their grant, \
         percentageOfNodesToScore {}",
        workload.name,
        workload.nodes.len(),
        args.annotation_delay,
        args.listing_delay,
        args.percentage_of_nodes_to_score
    );
    println!(
        "seed  submitted  placed  admission-failures  live-unallocated-%  baleen-sim-online-%{}",
        if args.dra { "  dra-placed  dra-failures  dra-first-fit-%" } else { "" }
    );
    for (k, &seed) in args.seeds.iter().enumerate() {
        let started = std::time::Instant::now();
        let live = if args.dra && args.dra_only {
            baleen_tests::cluster_loop::LoopOutcome {
                seed,
                submitted: 0,
                placed: 0,
                admission_failures: 0,
                unallocated_at_100: f64::NAN,
            }
        } else {
            runtime.block_on(run_seed(&workload, seed, &options))?
        };
        let dra = if args.dra {
            let dra_options = baleen_tests::dra_loop::DraOptions {
                node_by_policy: args.dra_node_by_policy,
                fullest_first: args.dra_fullest_first,
            };
            let d =
                baleen_tests::dra_loop::run_seed_with(&workload, seed, options.tune, dra_options)?;
            format!(
                "  {:>10}  {:>12}  {:>15.2}",
                d.placed, d.admission_failures, d.unallocated_at_100
            )
        } else {
            String::new()
        };
        println!(
            "{seed:>4}  {:>9}  {:>6}  {:>18}  {:>18.2}  {:>19.2}{dra}   ({:.0} s)",
            live.submitted,
            live.placed,
            live.admission_failures,
            live.unallocated_at_100,
            sim[0].unallocated_pct_at_100.per_seed[k],
            started.elapsed().as_secs_f64()
        );
    }
    Ok(())
}
