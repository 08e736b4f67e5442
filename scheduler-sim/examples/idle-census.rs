//! Where the idle GPU is when arrived demand reaches 100 % of capacity: one seed of one policy
//! on a trace, replayed as `baleen-sim` does, stopped after the first task that takes arrived
//! demand to 100 %. There the unallocated GPU is the demand that failed less the overshoot of
//! that last task (arrived - 100 %), so this shows what the headline figure (the average over
//! arrived 99.5..100.5 %) is made of.
//!
//! Usage: `cargo run --release -p baleen-scheduler-core --example idle-census -- NODES PODS
//! POLICY SEED [SEED...]`

use baleen_scheduler_core::ledger::AllocationId;
use baleen_scheduler_core::model::GpuDemand;
use baleen_scheduler_core::packing::SharePrices;
use baleen_scheduler_core::policy::{Policy, PolicyKind};
use baleen_scheduler_sim::replay::{self, ReplayOptions, Workload};
use std::collections::BTreeMap;
use std::path::Path;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.len() < 4 {
        return Err("usage: idle-census NODES PODS POLICY SEED [SEED...]".into());
    }
    let workload = Workload::load(Path::new(&args[0]), Path::new(&args[1]))?;
    let kind: PolicyKind = args[2].parse()?;
    let options = ReplayOptions::default();
    let policy = Policy::for_requests(
        kind,
        workload.tasks.iter().map(|t| &t.request),
        options.coverage,
        options.normalisers,
    );
    let capacity = workload.gpu_capacity_milli();
    let pct = |m: u64| 100.0 * m as f64 / capacity as f64;
    let mut total_unallocated = 0.0;
    let seeds: Vec<u64> = args[3..].iter().map(|s| s.parse()).collect::<Result<_, _>>()?;
    for &seed in &seeds {
        let replay::SeedRun { order, mut cluster, decision_rng: mut rng } =
            replay::SeedRun::start(&workload, &policy, seed, &options)?;
        let mut arrived = 0u64;
        let mut allocated = 0u64;
        // Shared tasks submitted so far, by share: what the packing bound is computed for.
        let mut shares: BTreeMap<u32, f64> = BTreeMap::new();
        // Failed demand by (class, milli per GPU): count and milli.
        let mut failed: BTreeMap<(Option<u32>, u32), (usize, u64)> = BTreeMap::new();
        for (seq, &t) in order.iter().enumerate() {
            if arrived >= capacity {
                break;
            }
            let request = &workload.tasks[t].request;
            arrived += request.gpu.total_milli();
            if let GpuDemand::Shared { milli, .. } = request.gpu {
                *shares.entry(milli.0).or_default() += 1.0;
            }
            match cluster.choose(request, &mut rng) {
                Some((n, s)) => {
                    cluster.place(n, AllocationId(seq as u64), request, s.gpus)?;
                    allocated += request.gpu.total_milli();
                }
                None => {
                    let e = failed
                        .entry((request.gpu.class(), request.gpu.milli_per_gpu().0))
                        .or_default();
                    e.0 += 1;
                    e.1 += request.gpu.total_milli();
                }
            }
        }
        let failed_sum: u64 = failed.values().map(|v| v.1).sum();
        total_unallocated += pct(capacity - allocated);
        println!(
            "seed {seed}: arrived {:.2} %, failed {:.2} %, unallocated {:.2} %",
            pct(arrived),
            pct(failed_sum),
            pct(capacity - allocated)
        );
        for ((class, milli), (n, m)) in &failed {
            println!("  failed class {class:?} {milli:>4}: {n:>4} tasks {:.3} %", pct(*m));
        }
        // The fractional bin-packing LP of the shared tasks submitted so far: the GPUs they need
        // at best, and the gaps that leaves (a bound for a policy that places all of them).
        let prices = SharePrices::from_weights(&shares);
        let gpus_needed: f64 = shares.iter().map(|(&s, &n)| n * prices.price(s)).sum();
        let demand: f64 = shares.iter().map(|(&s, &n)| n * f64::from(s)).sum();
        println!(
            "  shared tasks submitted: {:.0}, {:.3} % of the cluster; best fractional packing \
             needs {gpus_needed:.1} GPUs, leaving {:.3} % in gaps",
            shares.values().sum::<f64>(),
            100.0 * demand / capacity as f64,
            100.0 * (gpus_needed * 1000.0 - demand) / capacity as f64
        );
        // Idle GPU by what each partly used GPU holds (the sorted shares on it).
        let mut holes: BTreeMap<Vec<u32>, (usize, u64)> = BTreeMap::new();
        let mut idle_whole = (0usize, 0usize); // (GPUs, of which on nodes whose CPU or memory is short)
        for node in cluster.nodes() {
            for (i, g) in node.gpus().iter().enumerate() {
                if g.milli.0 == 0 {
                    continue;
                }
                if g.milli.0 == 1000 {
                    idle_whole.0 += 1;
                    if node.free_cpu().0 < 4000 || node.free_memory().0 < 16_384 {
                        idle_whole.1 += 1;
                    }
                    continue;
                }
                let mut shares: Vec<u32> = node
                    .allocations()
                    .filter(|(_, a)| a.gpus.contains(i))
                    .map(|(_, a)| match a.request.gpu {
                        GpuDemand::Shared { milli, .. } => milli.0,
                        _ => 1000,
                    })
                    .collect();
                shares.sort_unstable_by(|a, b| b.cmp(a));
                let e = holes.entry(shares).or_default();
                e.0 += 1;
                e.1 += u64::from(g.milli.0);
            }
        }
        println!(
            "  idle whole GPUs: {} ({} on nodes with under 4 cores or 16 GiB free), {:.3} %",
            idle_whole.0,
            idle_whole.1,
            pct(idle_whole.0 as u64 * 1000)
        );
        let mut by_waste: Vec<_> = holes.into_iter().collect();
        by_waste.sort_by_key(|(_, (_, m))| std::cmp::Reverse(*m));
        for (shares, (n, m)) in by_waste.iter().take(25) {
            println!("  holes {shares:?}: {n:>4} GPUs {:.3} %", pct(*m));
        }
    }
    println!("mean unallocated {:.3} %", total_unallocated / seeds.len() as f64);
    Ok(())
}
