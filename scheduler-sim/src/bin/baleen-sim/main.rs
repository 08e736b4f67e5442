//! `baleen-sim`: replays a GPU trace under one or more placement policies, following the FGD
//! paper's protocol, and prints a table or JSON (one object per policy, one per line).
//!
//! With `--plot FILE.svg` it also draws the unallocated-% curves.
//!
//! Exit codes: 0 success, 2 bad input (arguments or trace files; the message names the file,
//! line and column), 1 an internal failure.

mod plot;

use baleen_scheduler_core::policy::PolicyKind;
use baleen_scheduler_sim::replay::{self, PolicySummary, ReplayOptions, Workload};
use clap::Parser;
use std::path::PathBuf;
use std::process::ExitCode;

/// Replay the Alibaba GPU-sharing trace (cluster-trace-gpu-v2023) under placement policies.
#[derive(Debug, Parser)]
#[command(
    version,
    about = "Replay baleen's and the FGD paper's placement policies on the Alibaba GPU trace.",
    long_about = None
)]
struct Args {
    /// Node list CSV (sn,cpu_milli,memory_mib,gpu,model).
    #[arg(long, value_name = "FILE")]
    nodes: PathBuf,
    /// Task list CSV (name,cpu_milli,memory_mib,num_gpu,gpu_milli and optionally gpu_spec).
    #[arg(long, value_name = "FILE")]
    pods: PathBuf,
    /// Policies: random, dotprod, gpu-clustering, gpu-packing, best-fit, fgd (the paper's six),
    /// baleen (ours), or all.
    /// Repeat the flag or separate with commas.
    #[arg(long, value_name = "NAME", value_delimiter = ',', required = true)]
    policy: Vec<String>,
    /// Seeds: an inclusive range `A..B`, a list `A,B,C`, or one seed.
    #[arg(long, value_name = "SEEDS", default_value = "42..51")]
    seeds: String,
    /// Target GPU demand as a fraction of cluster capacity.
    #[arg(long, value_name = "RATIO", default_value_t = 1.3)]
    tune: f64,
    /// Print one JSON object per policy, one per line, instead of a table.
    #[arg(long)]
    json: bool,
    /// Learn the target workload online: rebuild it from the tasks submitted so far every N
    /// tasks, starting from none (default: from the whole list, as the paper).
    #[arg(long, value_name = "N")]
    online_target: Option<usize>,
    /// Also draw unallocated GPU % against arrived % for every policy into this SVG file.
    #[arg(long, value_name = "FILE.svg")]
    plot: Option<PathBuf>,
    /// Worker threads (default: the number of CPUs).
    #[arg(long, value_name = "N")]
    threads: Option<usize>,
}

fn parse_seeds(text: &str) -> Result<Vec<u64>, String> {
    let bad = |part: &str| format!("--seeds: `{part}` is not a seed (a non-negative integer)");
    if let Some((a, b)) = text.split_once("..") {
        let a: u64 = a.trim().parse().map_err(|_| bad(a))?;
        let b: u64 = b.trim().trim_start_matches('=').parse().map_err(|_| bad(b))?;
        if b < a {
            return Err(format!("--seeds: empty range {a}..{b}"));
        }
        return Ok((a..=b).collect());
    }
    text.split(',').map(|p| p.trim().parse().map_err(|_| bad(p))).collect()
}

fn parse_policies(names: &[String]) -> Result<Vec<PolicyKind>, String> {
    let mut kinds = Vec::new();
    for name in names.iter().map(|n| n.trim()) {
        let add: Vec<PolicyKind> = if name == "all" {
            PolicyKind::ALL.to_vec()
        } else {
            vec![name.parse().map_err(|e| format!("--policy: {e}"))?]
        };
        for k in add {
            if !kinds.contains(&k) {
                kinds.push(k);
            }
        }
    }
    Ok(kinds)
}

fn table(workload: &Workload, summaries: &[PolicySummary]) -> String {
    let mut out = format!(
        "workload {} ({} nodes, {} GPUs, {} tasks), seeds {:?}, tune {}\n",
        workload.name,
        workload.nodes.len(),
        workload.gpu_capacity_milli() / 1000,
        workload.tasks.len(),
        summaries.first().map(|s| s.seeds.clone()).unwrap_or_default(),
        summaries.first().map_or(0.0, |s| s.tune),
    );
    out.push_str(&format!(
        "{:<16} {:>20} {:>22} {:>12} {:>8}\n",
        "policy", "unallocated% @100", "frag amount% @100", "placed", "s/seed"
    ));
    for s in summaries {
        let u = &s.unallocated_pct_at_100;
        let f = &s.frag_amount_pct_at_100;
        let placed = s.placed.iter().sum::<usize>() as f64 / s.placed.len().max(1) as f64;
        let submitted = s.submitted.iter().sum::<usize>() as f64 / s.submitted.len().max(1) as f64;
        let seconds = s.seconds.iter().sum::<f64>() / s.seconds.len().max(1) as f64;
        out.push_str(&format!(
            "{:<16} {:>12.2} ± {:<5.2} {:>14.2} ± {:<5.2} {:>6.0}/{:<5.0} {:>8.2}\n",
            s.policy, u.mean, u.sd, f.mean, f.sd, placed, submitted, seconds
        ));
    }
    out
}

fn main() -> ExitCode {
    let args = Args::parse();
    // Every argument problem is reported at once, before anything is read or written.
    let seeds = parse_seeds(&args.seeds);
    let kinds = parse_policies(&args.policy);
    let mut problems: Vec<String> =
        [seeds.as_ref().err(), kinds.as_ref().err()].into_iter().flatten().cloned().collect();
    if !(args.tune.is_finite() && args.tune > 0.0) {
        problems.push(format!("--tune must be a positive number, got {}", args.tune));
    }
    if args.online_target == Some(0) {
        problems.push("--online-target must be at least 1".to_owned());
    }
    let (Ok(seeds), Ok(kinds), true) = (seeds, kinds, problems.is_empty()) else {
        for p in problems {
            eprintln!("baleen-sim: {p}");
        }
        return ExitCode::from(2);
    };
    if let Some(path) = &args.plot {
        // Fail before a long replay, not after it.
        if let Err(e) = std::fs::File::create(path) {
            eprintln!("baleen-sim: --plot {}: {e}", path.display());
            return ExitCode::from(2);
        }
    }
    let workload = match Workload::load(&args.nodes, &args.pods) {
        Ok(w) => w,
        Err(e) => {
            eprintln!("baleen-sim: {}", chain(&e));
            return ExitCode::from(2);
        }
    };
    let options = ReplayOptions {
        tune: args.tune,
        online_target: args.online_target,
        ..ReplayOptions::default()
    };
    let threads =
        args.threads.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let summaries = match replay::replay(&workload, &kinds, &seeds, &options, threads) {
        Ok(s) => s,
        Err(e @ (replay::ReplayError::NoGpus(_) | replay::ReplayError::NoTasks(_))) => {
            eprintln!("baleen-sim: {}", chain(&e));
            return ExitCode::from(2);
        }
        Err(e) => {
            eprintln!("baleen-sim: {}", chain(&e));
            return ExitCode::FAILURE;
        }
    };
    if let Some(path) = &args.plot
        && let Err(e) = plot::unallocated_svg(path, &summaries)
    {
        eprintln!("baleen-sim: {e}");
        return ExitCode::FAILURE;
    }
    if args.json {
        for s in &summaries {
            match serde_json::to_string(s) {
                Ok(line) => println!("{line}"),
                Err(e) => {
                    eprintln!("baleen-sim: cannot encode results: {e}");
                    return ExitCode::FAILURE;
                }
            }
        }
    } else {
        print!("{}", table(&workload, &summaries));
    }
    ExitCode::SUCCESS
}

/// An error and its causes on one line, separated by `: ` (errors never repeat their cause).
fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}
