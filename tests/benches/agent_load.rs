//! Issue 22, item 6: the release agent's memory under the load that once took it from 12.6 to
//! 78 MiB and OOM-killed it: 1,120 gpu-memory grants (every unit of the simulated 8x H200),
//! 1,000 idle connections to its gpu-memory plugin socket and 2,000 half-open connections to its
//! metrics port. The agent runs as its own process (the release binary: build it first with
//! `cargo build --release -p baleen-agent`, or set `BALEEN_AGENT_BIN`) against the fake kubelet
//! in this one; its RSS (`VmRSS`) and peak (`VmHWM`) are read from `/proc` at each step.
//! Run: `cargo bench -p baleen-tests --bench agent_load`.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use baleen_tests::bench::report_memory as report;
use baleen_tests::fake_kubelet::FakeKubelet;
use tokio::io::AsyncWriteExt as _;

const MEM: &str = "awesome-ai-company.com/gpu-memory";

/// The size of one `/metrics` answer's body.
async fn scrape(address: std::net::SocketAddr) -> anyhow::Result<usize> {
    let (code, body) = baleen_tests::http::request(address, "GET", "/metrics", "").await?;
    anyhow::ensure!(code == 200, "scrape failed: {code}");
    Ok(body.len())
}

fn main() -> anyhow::Result<()> {
    let binary = std::env::var_os("BALEEN_AGENT_BIN").map(PathBuf::from).unwrap_or_else(|| {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/release/baleen-agent")
    });
    anyhow::ensure!(
        binary.is_file(),
        "no agent binary at {}: build it with `cargo build --release -p baleen-agent` or set BALEEN_AGENT_BIN",
        binary.display()
    );
    let runtime =
        tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    runtime.block_on(async move {
        let tmp = tempfile::tempdir()?;
        let root = tmp.path();
        let layout = baleen_agent::run::AgentConfig::for_root(root);
        let mut kubelet = FakeKubelet::start(&layout.device_plugin_dir).await?;
        kubelet.serve_pod_resources(&layout.pod_resources_socket)?;
        let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        let metrics: std::net::SocketAddr = format!("127.0.0.1:{port}").parse()?;
        let example = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../packaging/examples/h200-8x-nvswitch.yaml");
        let mut agent = baleen_tests::bench::agent_process(&binary, &example, root, "load")
            .args(["--log-level", "warn"])
            .arg("--metrics-address")
            .arg(metrics.to_string())
            .spawn()
            .context("the agent binary")?;
        let pid = agent.id();
        let outcome = async {
            kubelet
                .wait_for("every unit offered", Duration::from_secs(30), |v| {
                    v.healthy(MEM).len() == 8 * 140
                })
                .await?;
            report(pid, "registered, no grant");
            let started = Instant::now();
            for i in 0..8 * 140 {
                kubelet.admit_to(&format!("ns/p{i}"), "c", MEM, 1).await?;
            }
            println!("{:>48}: {:.1} s", "1,120 grants took", started.elapsed().as_secs_f64());
            report(pid, "1,120 grants");
            let socket = std::fs::read_dir(&layout.device_plugin_dir)?
                .flatten()
                .map(|e| e.path())
                .find(|p| p.to_string_lossy().contains("gpu-memory"))
                .context("the gpu-memory plugin socket")?;
            let mut plugin = Vec::new();
            for _ in 0..1000 {
                if let Ok(s) = tokio::net::UnixStream::connect(&socket).await {
                    plugin.push(s);
                }
            }
            let mut half_open = Vec::new();
            for _ in 0..2000 {
                if let Ok(mut s) = tokio::net::TcpStream::connect(metrics).await {
                    let _ = s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n").await;
                    half_open.push(s);
                }
            }
            tokio::time::sleep(Duration::from_secs(2)).await;
            report(pid, "+ 1,000 plugin and 2,000 half-open metrics conns");
            // The header timeout closes the half-open ones; the hoarded plugin ones stay open
            // on this side (the agent closed all but its cap).
            tokio::time::sleep(Duration::from_secs(7)).await;
            let size = scrape(metrics).await?;
            report(pid, "after the header timeout (a scrape answers)");
            println!("{:>48}: {size} bytes", "scrape");
            drop(plugin);
            drop(half_open);
            tokio::time::sleep(Duration::from_secs(1)).await;
            report(pid, "every client gone");
            anyhow::Ok(())
        }
        .await;
        let _ = agent.kill();
        let _ = agent.wait();
        outcome
    })
}
