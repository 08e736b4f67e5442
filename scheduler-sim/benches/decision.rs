//! Latency of one placement decision on the Alibaba trace cluster (1,213 nodes) at 0 %, 50 %
//! and 95 % GPU load, and on a synthetic 10,000-node cluster at 95 % load.
//!
//! A cluster is brought to the load by replaying the default task list (seed 42) with the
//! policy under test; the synthetic cluster repeats the loaded trace nodes up to 10,000. Each
//! measured iteration takes the next request of the rest of the list, chooses a node
//! (`ClusterScheduler::choose`), places it and releases it again, so the load stays put and the
//! score cache sees what a live scheduler sees: one node changed per decision. The `cold`
//! benchmarks start a fresh scheduler, with no cache and no memo, so every node is scored or
//! looked up by state.
//!
//! Needs `../shared/traces/alibaba-gpu-v2023` beside the repository.
//! Run: `cargo bench -p baleen-scheduler-sim --bench decision`.

// criterion_group! generates an undocumented public function.
#![allow(missing_docs)]

use baleen_scheduler_core::cluster::ClusterScheduler;
use baleen_scheduler_core::ledger::{AllocationId, NodeLedger};
use baleen_scheduler_core::model::Request;
use baleen_scheduler_core::policy::{Normalisers, Policy, PolicyKind};
use baleen_scheduler_sim::replay::{Workload, node_ranks, submission_order};
use criterion::{Criterion, criterion_group, criterion_main};
use rand::SeedableRng;
use rand::seq::SliceRandom;
use rand_chacha::ChaCha8Rng;
use std::hint::black_box;
use std::path::PathBuf;

struct Loaded {
    nodes: Vec<NodeLedger>,
    ranks: Vec<u32>,
    stream: Vec<Request>,
}

fn workload() -> Workload {
    let dir =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/traces/alibaba-gpu-v2023");
    Workload::load(
        &dir.join("openb_node_list_gpu_node.csv"),
        &dir.join("openb_pod_list_default.csv"),
    )
    .unwrap_or_else(|e| panic!("the benchmark reads the trace from ../shared ({e})"))
}

fn policy(kind: PolicyKind, w: &Workload) -> Policy {
    Policy::for_requests(kind, w.tasks.iter().map(|t| &t.request), 0.95, Normalisers::default())
}

/// Replays the default list with `kind` until `load_pct` of the GPU capacity is allocated.
fn load(w: &Workload, kind: PolicyKind, load_pct: f64) -> Loaded {
    let capacity = w.gpu_capacity_milli();
    let mut rng = ChaCha8Rng::seed_from_u64(42);
    let order = submission_order(&w.tasks, capacity, 1.3, &mut rng);
    let ranks = node_ranks(&w.nodes, &mut rng);
    let nodes: Vec<NodeLedger> =
        w.nodes.iter().map(|n| NodeLedger::new(n.clone()).expect("valid node")).collect();
    let mut cluster = ClusterScheduler::new(policy(kind, w), nodes, ranks.clone());
    let mut allocated = 0u64;
    let mut used = 0;
    for (seq, &t) in order.iter().enumerate() {
        if allocated as f64 >= load_pct / 100.0 * capacity as f64 {
            break;
        }
        used = seq + 1;
        let r = &w.tasks[t].request;
        if let Some((n, s)) = cluster.choose(r, &mut rng) {
            cluster.place(n, AllocationId(seq as u64), r, s.gpus).expect("fits");
            allocated += r.gpu.total_milli();
        }
    }
    let stream = order[used..].iter().map(|&t| w.tasks[t].request.clone()).collect();
    Loaded { nodes: cluster.nodes().to_vec(), ranks, stream }
}

/// The loaded trace nodes repeated up to `count` nodes, with a fresh random priority.
fn scale(l: &Loaded, count: usize) -> Loaded {
    let nodes: Vec<NodeLedger> = (0..count).map(|i| l.nodes[i % l.nodes.len()].clone()).collect();
    let mut ranks: Vec<u32> = (0..u32::try_from(count).expect("10,000 nodes")).collect();
    ranks.shuffle(&mut ChaCha8Rng::seed_from_u64(7));
    Loaded { nodes, ranks, stream: l.stream.clone() }
}

fn bench_steady(c: &mut Criterion, name: &str, kind: PolicyKind, w: &Workload, l: &Loaded) {
    let mut cluster = ClusterScheduler::new(policy(kind, w), l.nodes.clone(), l.ranks.clone());
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    let mut k = 0usize;
    c.bench_function(&format!("decision/{}/{name}", kind.name()), |b| {
        b.iter(|| {
            let r = &l.stream[k % l.stream.len()];
            k += 1;
            if let Some((n, s)) = cluster.choose(black_box(r), &mut rng) {
                let id = AllocationId(u64::MAX - k as u64);
                cluster.place(n, id, r, s.gpus).expect("fits");
                cluster.release(n, id).expect("placed");
            }
        })
    });
}

fn bench_cold(c: &mut Criterion, name: &str, kind: PolicyKind, w: &Workload, l: &Loaded) {
    let p = policy(kind, w);
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    let mut k = 0usize;
    c.bench_function(&format!("cold-decision/{}/{name}", kind.name()), |b| {
        b.iter_batched(
            || ClusterScheduler::new(p.clone(), l.nodes.clone(), l.ranks.clone()),
            |mut cluster| {
                let r = &l.stream[k % l.stream.len()];
                k += 1;
                black_box(cluster.choose(r, &mut rng))
            },
            criterion::BatchSize::LargeInput,
        )
    });
}

fn decisions(c: &mut Criterion) {
    let w = workload();
    for kind in [PolicyKind::Baleen, PolicyKind::Fgd] {
        let mut at95 = None;
        for pct in [0.0, 50.0, 95.0] {
            let l = load(&w, kind, pct);
            bench_steady(c, &format!("1213-nodes/load-{pct:.0}"), kind, &w, &l);
            if pct == 95.0 {
                at95 = Some(l);
            }
        }
        let l95 = at95.expect("loaded at 95 %");
        bench_cold(c, "1213-nodes/load-95", kind, &w, &l95);
        let big = scale(&l95, 10_000);
        bench_steady(c, "10000-nodes/load-95", kind, &w, &big);
        let empty = scale(&load(&w, kind, 0.0), 10_000);
        bench_cold(c, "10000-nodes/load-0", kind, &w, &empty);
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(30).warm_up_time(std::time::Duration::from_secs(1)).measurement_time(std::time::Duration::from_secs(3));
    targets = decisions
}
criterion_main!(benches);
