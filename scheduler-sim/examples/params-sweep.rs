//! baleen's knobs against task lists: for every combination of the knob values given in the
//! environment (comma-separated: `HW` host weight, `SHW` shape host weight, `LEVELS` score
//! levels, `PW` pattern weight, `GAIN` CPU scarcity gain; defaults the current values), the mean unallocated GPU % at
//! arrived = 100 % over seeds 42..51 of each list named on the command line, with the policy
//! built as the replay builds it (`Policy::for_cluster` applied after the knobs). How the CPU
//! scarcity gain was chosen (docs/benchmarks.md, change 6):
//!
//! `GAIN=0 HW=0,1,3 SHW=2,4,8 cargo run --release -p baleen-scheduler-sim --example params-sweep -- cpu300 default`
//! and `GAIN=0,50 cargo run ... -- cpu250 cpu300 default`.
use baleen_scheduler_core::policy::{BaleenParams, Policy, PolicyKind};
use baleen_scheduler_sim::replay::{ReplayOptions, Workload, replay_seed};

fn main() {
    let dir = std::path::Path::new("../shared/traces/alibaba-gpu-v2023");
    let lists: Vec<String> = std::env::args().skip(1).collect();
    let options = ReplayOptions::default();
    let seeds: Vec<u64> = (42..52).collect();
    let list_of = |k: &str, d: &str| -> Vec<f64> {
        std::env::var(k)
            .unwrap_or_else(|_| d.into())
            .split(',')
            .map(|x| x.parse().expect("number"))
            .collect()
    };
    let mut grid = Vec::new();
    for hw in list_of("HW", "3") {
        for shw in list_of("SHW", "0.5") {
            for levels in list_of("LEVELS", "25") {
                for pw in list_of("PW", "12") {
                    for gain in list_of("GAIN", "50") {
                        grid.push((hw, shw, levels, pw, gain));
                    }
                }
            }
        }
    }
    for list in &lists {
        let w = Workload::load(
            &dir.join("openb_node_list_gpu_node.csv"),
            &dir.join(format!("openb_pod_list_{list}.csv")),
        )
        .expect("load");
        let metric = w.target(options.coverage, false);
        let requests: Vec<_> = w.tasks.iter().map(|t| &t.request).collect();
        for &(hw, shw, levels, pw, gain) in &grid {
            let params = BaleenParams {
                host_weight: hw,
                shape_host_weight: shw,
                score_levels: levels,
                pattern_weight: pw,
                scarcity_gain: gain,
                ..BaleenParams::default()
            };
            let policy = Policy::for_requests(
                PolicyKind::Baleen,
                requests.iter().copied(),
                0.95,
                Default::default(),
            )
            .with_baleen_params(params)
            .for_cluster(w.cluster_capacity().0, w.cluster_capacity().1);
            let v: Vec<f64> = seeds
                .iter()
                .map(|&s| {
                    replay_seed(&w, &metric, &policy, s, &options)
                        .expect("run")
                        .unallocated_at_100()
                })
                .collect();
            println!(
                "{list} hw={hw} shw={shw} levels={levels} pw={pw} gain={gain}: {:.3}",
                v.iter().sum::<f64>() / v.len() as f64
            );
        }
    }
}
