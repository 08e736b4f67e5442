//! CI's placement fidelity check: replay the default Alibaba task list with two seeds under
//! best-fit and fgd, and compare unallocated GPU % at arrived = 100 % with the published means
//! of the FGD paper's artifact (`expected_results/analysis_allo_discrete.csv` in the shared
//! trace folder, 10 seeds each).
//!
//! Tolerance: 0.75 points, the fidelity bound for a 10-seed mean. Two seeds are a
//! noisier estimate (published standard deviations over seeds are 0.14 for best-fit and 0.11
//! for fgd, so a 2-seed mean moves by about 0.1), but the runs are deterministic for a seed, and
//! the ten-seed table in docs/benchmarks.md shows the margin. The gap between the two policies
//! is checked too, so a change that makes fgd no better than best-fit fails even inside the
//! bound.
//!
//! baleen's own policy must stay at or below `BALEEN_TARGET` (issue 3's target, 4.0 %, against
//! the published fgd mean of 4.77 %) on the same two seeds (measured: 3.72 and 3.75 %), and
//! better than our fgd, so a change that makes placement worse fails CI; on `cpu300` too.

use crate::common;

use baleen_scheduler_core::policy::PolicyKind;
use baleen_scheduler_sim::replay::{self, ReplayOptions, Workload};
use std::collections::HashMap;

const TOLERANCE: f64 = 0.75;
const BALEEN_TARGET: f64 = 4.0;
const SEEDS: [u64; 2] = [42, 43];

/// Published mean unallocated % at arrived = 100 % per artifact policy, for one workload.
fn published(workload: &str) -> HashMap<String, f64> {
    let path = common::trace_dir().join("expected_results/analysis_allo_discrete.csv");
    let mut reader =
        csv::Reader::from_path(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let headers = reader.headers().expect("header").clone();
    let col = |name: &str| headers.iter().position(|h| h == name).expect("column present");
    let (w, p, at100) = (col("workload"), col("sc_policy"), col("100"));
    let mut sums: HashMap<String, (f64, u32)> = HashMap::new();
    for row in reader.records() {
        let row = row.expect("valid row");
        if row[w] != *format!("openb_pod_list_{workload}") {
            continue;
        }
        let allocated: f64 = row[at100].parse().expect("a number");
        let e = sums.entry(row[p].to_owned()).or_default();
        e.0 += 100.0 - allocated;
        e.1 += 1;
    }
    sums.into_iter().map(|(k, (s, n))| (k, s / f64::from(n))).collect()
}

#[test]
fn default_trace_matches_published_best_fit_and_fgd() {
    let dir = common::trace_dir();
    let workload = Workload::load(
        &dir.join("openb_node_list_gpu_node.csv"),
        &dir.join("openb_pod_list_default.csv"),
    )
    .expect("the default trace loads");
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let results = replay::replay(
        &workload,
        &[PolicyKind::BestFit, PolicyKind::Fgd, PolicyKind::Baleen],
        &SEEDS,
        &ReplayOptions::default(),
        threads,
    )
    .expect("the replay runs");
    let published = published("default");
    let mut ours = HashMap::new();
    for (summary, artifact) in results.iter().zip(["05-BestFit", "06-FGD"]) {
        let want = published[artifact];
        let got = summary.unallocated_pct_at_100.mean;
        eprintln!("{}: ours {got:.2} %, published {want:.2} %", summary.policy,);
        assert!(
            (got - want).abs() <= TOLERANCE,
            "{}: unallocated at 100 % is {got:.2}, published {want:.2}, tolerance {TOLERANCE}",
            summary.policy
        );
        ours.insert(summary.policy.clone(), got);
    }
    let baleen = results[2].unallocated_pct_at_100.mean;
    let fgd = published["06-FGD"];
    eprintln!("baleen: ours {baleen:.2} %, published fgd {fgd:.2} %");
    assert!(
        baleen <= BALEEN_TARGET && baleen < ours["fgd"],
        "baleen leaves {baleen:.2} % unallocated: it must stay at or below {BALEEN_TARGET} % \
         (published fgd: {fgd:.2} %) and beat our fgd ({:.2} %)",
        ours["fgd"]
    );
    assert!(
        ours["best-fit"] - ours["fgd"] >= 1.5,
        "fgd should beat best-fit by at least 1.5 points (published: 2.37): {ours:?}"
    );
}

/// `cpu300` (CPU-only tasks three times `default`'s; the cluster's CPU runs out before its
/// GPUs): baleen must beat our fgd there too (issue 15, item 4; ten seeds: 13.56 against 14.10,
/// and 14.61 before the policy weighed CPU scarcity).
#[test]
fn baleen_beats_fgd_where_cpu_runs_out_first() {
    let dir = common::trace_dir();
    let workload = Workload::load(
        &dir.join("openb_node_list_gpu_node.csv"),
        &dir.join("openb_pod_list_cpu300.csv"),
    )
    .expect("the cpu300 list loads");
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let results = replay::replay(
        &workload,
        &[PolicyKind::Fgd, PolicyKind::Baleen],
        &SEEDS,
        &ReplayOptions::default(),
        threads,
    )
    .expect("the replay runs");
    let (fgd, baleen) =
        (results[0].unallocated_pct_at_100.mean, results[1].unallocated_pct_at_100.mean);
    eprintln!("cpu300: baleen {baleen:.2} %, fgd {fgd:.2} %");
    assert!(baleen < fgd, "cpu300: baleen leaves {baleen:.2} % unallocated, fgd {fgd:.2} %");
}
