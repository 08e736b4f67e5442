use baleen_scheduler_core::cluster::select_node;
use baleen_scheduler_core::ledger::{AllocationId, NodeLedger};
use baleen_scheduler_core::policy::{Normalisers, Policy, PolicyKind};
use baleen_scheduler_core::replay::{node_ranks, submission_order, Workload};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

fn main() {
    let dir = Path::new("../shared/traces/alibaba-gpu-v2023");
    let w = Workload::load(&dir.join("openb_node_list_gpu_node.csv"), &dir.join("openb_pod_list_default.csv")).unwrap();
    let kind: PolicyKind = std::env::args().nth(1).unwrap_or("fgd".into()).parse().unwrap();
    let bp = baleen_scheduler_core::policy::BaleenParams::current();
    let target = Arc::new(if kind == PolicyKind::Baleen { w.target(bp.coverage.unwrap_or(0.95), bp.memory_aware) } else { w.target(0.95, false) });
    let policy = Policy::new(kind, target, Normalisers::default());
    let cap = w.gpu_capacity_milli();
    let mut rng = ChaCha8Rng::seed_from_u64(42);
    let order = submission_order(&w.tasks, cap, 1.3, &mut rng);
    let ranks = node_ranks(&w.nodes, &mut rng);
    let mut nodes: Vec<NodeLedger> = w.nodes.iter().map(|n| NodeLedger::new(n.clone()).unwrap()).collect();
    let mut arrived = 0u64;
    let mut small: BTreeMap<(u32, u32), u32> = BTreeMap::new();
    let mut fails: BTreeMap<String, (u32, u64)> = BTreeMap::new();
    for (seq, &t) in order.iter().enumerate() {
        let r = &w.tasks[t].request;
        arrived += r.gpu.total_milli();
        if arrived as f64 > cap as f64 { break; }
        match select_node(&policy, &nodes, &ranks, r, &mut rng) {
            Some((n, s)) => {
                let m = r.gpu.milli_per_gpu().0;
                if m > 0 && m <= 190 {
                    let d = s.gpus.iter().next().unwrap();
                    *small.entry((m, nodes[n].gpus()[d].milli.0 / 10 * 10)).or_insert(0) += 1;
                }
                nodes[n].allocate(AllocationId(seq as u64), r, s.gpus).unwrap()
            }
            None => {
                if r.gpu.gpu_count() >= 2 { println!("fail {:?} at {:.2}%: cpu {} mem {}", r.gpu, 100.0 * arrived as f64 / cap as f64, r.cpu.0, r.memory.0); }
                let key = format!("{:?} cpu{} mem{}", r.gpu.class(), r.cpu.0 / 1000, r.memory.0 / 1024);
                let e = fails.entry(key).or_default();
                e.0 += 1;
                e.1 += r.gpu.total_milli();
            }
        }
    }
    println!("small tasks (size, gap before): count: {small:?}");
    println!("failures (class cpu mem): count, milli");
    let mut f: Vec<_> = fails.into_iter().collect();
    f.sort_by_key(|x| std::cmp::Reverse(x.1.1));
    for (k, v) in f.iter().take(25) { println!("  {k}: {v:?}"); }
    // Idle GPU by model and by free CPU / memory bands.
    let mut by: BTreeMap<String, (u64, u64, u64)> = BTreeMap::new();
    for n in &nodes {
        let idle = n.free_milli_total();
        if idle == 0 { continue; }
        let model = n.spec().gpus[0].model.to_string();
        let cpu = n.free_cpu().0 / 1000;
        let band = match cpu { 0..=2 => "cpu<3", 3..=7 => "cpu3-7", 8..=10 => "cpu8-10", _ => "cpu11+" };
        let full = n.gpus().iter().filter(|g| g.milli.0 == 1000).count() as u64;
        let e = by.entry(format!("{model:8} {band:8}")).or_default();
        e.0 += idle; e.1 += full; e.2 += 1;
    }
    let mut hist: BTreeMap<u32, (u32, u64)> = BTreeMap::new();
    for n in &nodes {
        for g in n.gpus() {
            if g.milli.0 > 0 {
                let e = hist.entry(g.milli.0 / 50 * 50).or_default();
                e.0 += 1;
                e.1 += u64::from(g.milli.0);
            }
        }
    }
    println!("per-GPU free histogram (bucket 50): gpus, milli");
    for (k, v) in &hist { println!("  {k}: {v:?}"); }
    println!("idle milli by (model, free cpu band, free mem GiB floor16): idle milli, full free GPUs, nodes");
    for (k, v) in by { println!("  {k}: {v:?}"); }
}
