//! `baleen-sim` as a user runs it: bad input ends with a message naming the file, line and
//! column, and exit code 2; good input prints a table or one JSON object per policy.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const NODES: &str = "sn,cpu_milli,memory_mib,gpu,model\n\
    n0,96000,393216,8,G2\n\
    n1,104000,524288,2,T4\n\
    n2,8000,32768,1,V100M16\n";

const PODS: &str = "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec\n\
    p0,4000,8192,1,500,\n\
    p1,8000,16384,1,1000,T4\n\
    p2,2000,4096,0,0,\n\
    p3,16000,32768,2,1000,G2|T4\n\
    p4,6000,8192,1,250,\n";

fn sim(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_baleen-sim")).args(args).output().expect("baleen-sim runs")
}

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, text).expect("temp file written");
    path
}

fn run_with(nodes: &str, pods: &str, extra: &[&str]) -> Output {
    let dir = tempfile::tempdir().expect("temp dir");
    let n = write(dir.path(), "nodes.csv", nodes);
    let p = write(dir.path(), "pods.csv", pods);
    let mut args =
        vec!["--nodes", n.to_str().expect("utf-8"), "--pods", p.to_str().expect("utf-8")];
    args.extend_from_slice(extra);
    sim(&args)
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn json_has_one_object_per_policy_with_the_promised_fields() {
    let out = run_with(NODES, PODS, &["--policy", "fgd,best-fit", "--seeds", "1..3", "--json"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let lines: Vec<serde_json::Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).expect("each line is JSON"))
        .collect();
    assert_eq!(lines.len(), 2);
    assert_eq!(lines[0]["policy"], "fgd");
    assert_eq!(lines[1]["policy"], "best-fit");
    for v in &lines {
        assert_eq!(v["workload"], "pods");
        assert_eq!(v["seeds"], serde_json::json!([1, 2, 3]));
        assert_eq!(v["unallocated_pct_at_100"]["per_seed"].as_array().expect("array").len(), 3);
        assert!(
            v["unallocated_pct_at_100"]["mean"].is_number()
                || v["unallocated_pct_at_100"]["mean"].is_null()
        );
        assert!(
            v["unallocated_pct_at_100"]["sd"].is_number()
                || v["unallocated_pct_at_100"]["sd"].is_null()
        );
        assert_eq!(v["curves"]["unallocated_pct"].as_array().expect("array").len(), 131);
        assert_eq!(v["curves"]["frag_amount_pct"].as_array().expect("array").len(), 131);
    }
}

#[test]
fn all_runs_every_policy_in_a_table() {
    let out = run_with(NODES, PODS, &["--policy", "all", "--seeds", "7"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = String::from_utf8_lossy(&out.stdout);
    for p in ["random", "dotprod", "gpu-clustering", "gpu-packing", "best-fit", "fgd"] {
        assert!(text.contains(p), "table lacks {p}:\n{text}");
    }
}

#[test]
fn results_are_deterministic_for_a_seed() {
    let a = run_with(NODES, PODS, &["--policy", "all", "--seeds", "5,9", "--json"]);
    let b =
        run_with(NODES, PODS, &["--policy", "all", "--seeds", "5,9", "--json", "--threads", "1"]);
    assert!(a.status.success() && b.status.success());
    assert_eq!(a.stdout, b.stdout);
}

fn assert_bad(out: &Output, needles: &[&str]) {
    assert_eq!(out.status.code(), Some(2), "exit code; stderr: {}", stderr(out));
    let err = stderr(out);
    for n in needles {
        assert!(err.contains(n), "`{err}` should contain `{n}`");
    }
}

#[test]
fn missing_file_is_named() {
    let out = sim(&[
        "--nodes",
        "/nonexistent/nodes.csv",
        "--pods",
        "/nonexistent/pods.csv",
        "--policy",
        "fgd",
    ]);
    assert_bad(&out, &["/nonexistent/nodes.csv"]);
}

#[test]
fn missing_column_is_named() {
    let nodes = NODES.replace("memory_mib", "mem");
    assert_bad(&run_with(&nodes, PODS, &["--policy", "fgd"]), &["nodes.csv:1", "memory_mib"]);
}

#[test]
fn malformed_number_names_line_and_column() {
    let pods = PODS.replace("p4,6000,", "p4,6k,");
    assert_bad(&run_with(NODES, &pods, &["--policy", "fgd"]), &["pods.csv:6", "cpu_milli", "6k"]);
}

#[test]
fn inconsistent_gpu_fields_are_refused() {
    let pods = PODS.replace("p2,2000,4096,0,0,", "p2,2000,4096,0,300,");
    assert_bad(&run_with(NODES, &pods, &["--policy", "fgd"]), &["pods.csv:4", "gpu_milli"]);
    let pods = PODS.replace("p3,16000,32768,2,1000", "p3,16000,32768,2,500");
    assert_bad(&run_with(NODES, &pods, &["--policy", "fgd"]), &["pods.csv:5", "num_gpu 1"]);
}

#[test]
fn short_row_is_refused() {
    let nodes = format!("{NODES}n3,8000\n");
    assert_bad(&run_with(&nodes, PODS, &["--policy", "fgd"]), &["nodes.csv:5"]);
}

#[test]
fn unknown_policy_and_bad_seeds_are_refused() {
    assert_bad(
        &run_with(NODES, PODS, &["--policy", "fastest"]),
        &["fastest", "best-fit", "baleen"],
    );
    assert_bad(&run_with(NODES, PODS, &["--policy", "fgd", "--seeds", "9..3"]), &["9..3"]);
    assert_bad(&run_with(NODES, PODS, &["--policy", "fgd", "--seeds", "x"]), &["`x`"]);
    assert_bad(&run_with(NODES, PODS, &["--policy", "fgd", "--tune=-1"]), &["--tune"]);
}

#[test]
fn empty_task_list_is_refused() {
    assert_bad(
        &run_with(NODES, "name,cpu_milli,memory_mib,num_gpu,gpu_milli\n", &["--policy", "fgd"]),
        &["no rows"],
    );
}

#[test]
fn plot_draws_one_curve_per_policy() {
    let dir = tempfile::tempdir().expect("temp dir");
    let svg = dir.path().join("curves.svg");
    let out = run_with(
        NODES,
        PODS,
        &["--policy", "fgd,baleen", "--seeds", "1", "--plot", svg.to_str().expect("utf-8")],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let text = std::fs::read_to_string(&svg).expect("the plot was written");
    assert!(text.starts_with("<svg"), "an SVG document");
    assert!(text.contains("fgd (") && text.contains("baleen ("), "a legend entry per policy");
    assert!(text.matches("<polyline").count() >= 2, "a curve per policy");
}

#[test]
fn unwritable_plot_path_is_refused_before_the_replay() {
    assert_bad(
        &run_with(NODES, PODS, &["--policy", "fgd", "--plot", "/nonexistent/dir/p.svg"]),
        &["--plot", "/nonexistent/dir/p.svg"],
    );
}

#[test]
fn online_target_runs_and_zero_is_refused() {
    let out = run_with(
        NODES,
        PODS,
        &["--policy", "fgd,baleen", "--seeds", "3", "--online-target", "2", "--json"],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(String::from_utf8_lossy(&out.stdout).lines().count(), 2);
    assert_bad(
        &run_with(NODES, PODS, &["--policy", "fgd", "--online-target", "0"]),
        &["--online-target"],
    );
}
