//! The fake kubelet as a program, to drive a real `baleen-agent` process (memory measurement,
//! a GPU machine): listens on `<dir>/kubelet.sock` and a pod-resources socket, waits until
//! `--expect` resources have registered, admits the containers asked with `--admit
//! RESOURCE=COUNT` (each as its own pod), prints what happened as JSON, then holds for
//! `--hold-secs` (so the agent can be measured) and exits.
//!
//! `cargo run --release -p baleen-tests --example fake-kubelet -- --dir /tmp/dp \
//!   --pod-resources /tmp/pr.sock --expect 5 --admit awesome-ai-company.com/gpu-memory=8`

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context as _, bail};
use baleen_tests::fake_kubelet::FakeKubelet;
use clap::Parser;

#[derive(Parser)]
struct Args {
    /// Device-plugin directory to listen in.
    #[arg(long)]
    dir: PathBuf,
    /// Pod-resources socket to serve.
    #[arg(long)]
    pod_resources: PathBuf,
    /// Number of resources to wait for.
    #[arg(long, default_value_t = 1)]
    expect: usize,
    /// Containers to admit, RESOURCE=COUNT.
    #[arg(long)]
    admit: Vec<String>,
    /// How long to wait for registrations.
    #[arg(long, default_value_t = 30)]
    timeout_secs: u64,
    /// How long to keep running after the admissions.
    #[arg(long, default_value_t = 0)]
    hold_secs: u64,
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let mut kubelet = FakeKubelet::start(&args.dir).await?;
    kubelet.serve_pod_resources(&args.pod_resources)?;
    let view = kubelet
        .wait_for("registrations", Duration::from_secs(args.timeout_secs), |v| {
            v.streaming.len() >= args.expect && v.devices.len() >= args.expect
        })
        .await?;
    let mut registered = serde_json::Map::new();
    for (resource, devices) in &view.devices {
        registered.insert(
            resource.clone(),
            serde_json::json!({ "devices": devices.len(), "healthy": view.healthy(resource).len() }),
        );
    }
    let mut admissions = Vec::new();
    for (i, spec) in args.admit.iter().enumerate() {
        let Some((resource, count)) = spec.split_once('=') else {
            bail!("--admit {spec:?}: expected RESOURCE=COUNT");
        };
        let count: usize = count.parse().with_context(|| format!("--admit {spec:?}"))?;
        let pod = format!("demo/pod-{i}");
        let outcome = match kubelet.admit_to(&pod, "main", resource, count).await {
            Ok(a) => serde_json::json!({
                "pod": pod, "resource": resource, "devices": a.device_ids,
                "preferred": a.preferred, "envs": a.response.envs,
                "mounts": a.response.mounts.iter().map(|m| (&m.host_path, &m.container_path)).collect::<Vec<_>>(),
            }),
            Err(e) => {
                serde_json::json!({ "pod": pod, "resource": resource, "error": e.to_string() })
            }
        };
        admissions.push(outcome);
    }
    println!(
        "{}",
        serde_json::to_string_pretty(&serde_json::json!({
            "registered": registered,
            "admissions": admissions,
        }))?
    );
    if args.hold_secs > 0 {
        tokio::time::sleep(Duration::from_secs(args.hold_secs)).await;
    }
    Ok(())
}
