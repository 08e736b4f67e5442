//! The FGD fragmentation measure against the check values of `shared/benchmarks/placement.md`,
//! with the target workload built from the default task list.

use crate::common;

use baleen_scheduler_core::frag::{self, TargetWorkload};
use baleen_scheduler_core::ledger::NodeLedger;
use baleen_scheduler_core::model::{GpuModel, GpuSpec, NodeSpec};
use baleen_scheduler_core::units::{MemMib, MilliCpu};
use baleen_scheduler_sim::replay::Workload;

fn default_workload() -> Workload {
    let dir = common::trace_dir();
    Workload::load(
        &dir.join("openb_node_list_gpu_node.csv"),
        &dir.join("openb_pod_list_default.csv"),
    )
    .expect("the default trace loads")
}

fn node(model: &str, gpus: usize) -> NodeSpec {
    let model = GpuModel::new(model);
    NodeSpec {
        name: "check".into(),
        cpu: MilliCpu(0),
        memory: MemMib(0),
        gpus: (0..gpus).map(|i| GpuSpec::plain(format!("g{i}"), model.clone())).collect(),
    }
}

fn frag_of(target: &TargetWorkload, model: &str, cpu_free: u64, free: &[u32]) -> f64 {
    let view = frag::NodeFree { cpu: MilliCpu(cpu_free), memory: MemMib(0), gpus: free };
    frag::node_fragment(target, &node(model, free.len()), &view)
}

fn assert_close(got: f64, want: f64, what: &str) {
    assert!((got - want).abs() < 0.005, "{what}: got {got:.4}, want {want}");
}

#[test]
fn target_workload_of_the_default_list() {
    let target = default_workload().target(0.95, false);
    assert_eq!(target.distinct_shapes(), 91);
    assert_eq!(target.shapes().len(), 35);
    let sum: f64 = target.shapes().iter().map(|s| s.1).sum();
    assert!((sum - 1.0).abs() < 1e-9, "probabilities sum to {sum}");
}

#[test]
fn node_check_values() {
    let t = default_workload().target(0.95, false);
    assert_close(frag_of(&t, "G2", 96_000, &[1000; 8]), 1087.82, "empty 8-GPU G2 node");
    assert_close(frag_of(&t, "T4", 104_000, &[1000; 2]), 271.95, "empty 2-GPU T4 node");
    assert_close(frag_of(&t, "P100", 16_000, &[1000; 2]), 359.26, "empty P100 node, 16 vCPU");
    assert_close(frag_of(&t, "V100M16", 8_000, &[1000]), 605.20, "empty V100M16 node, 8 vCPU");
    let mut partly = [1000; 8];
    partly[7] = 190;
    assert_close(frag_of(&t, "G2", 96_000, &partly), 1140.52, "G2 node [1000 x7, 190]");
    assert_close(frag_of(&t, "G2", 4_000, &[1000; 8]), 5731.65, "G2 node with 4 vCPU free");
}

#[test]
fn empty_cluster_check_value() {
    let w = default_workload();
    let t = w.target(0.95, false);
    let total: f64 = w
        .nodes
        .iter()
        .map(|n| frag::ledger_fragment(&t, &NodeLedger::new(n.clone()).expect("valid node")))
        .sum();
    assert!((total - 866_232.6).abs() < 0.5, "empty cluster F = {total}");
    let pct = 100.0 * total / w.gpu_capacity_milli() as f64;
    assert!((pct - 13.94).abs() < 0.005, "empty cluster F = {pct} %");
}
