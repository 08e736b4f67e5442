//! The cost of one scrape of the agent's `/metrics` on the 8x H200 example with 100 gpu-memory
//! grants: the whole agent runs in-process against the fake kubelet (and the fake MPS control,
//! so every family is there), and this harness times each HTTP GET itself (connect, request,
//! the whole body) and reports percentiles and the size of the text. Run with
//! `cargo bench -p baleen-tests --bench scrape_cost` (add `-- --quick` for a short run).

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use baleen_agent::ledger::ViewConfig;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

const MEM: &str = "awesome-ai-company.com/gpu-memory";

async fn scrape(address: std::net::SocketAddr) -> anyhow::Result<usize> {
    let mut stream = tokio::net::TcpStream::connect(address).await?;
    stream
        .write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        .await?;
    let mut response = Vec::new();
    stream.read_to_end(&mut response).await?;
    let text = String::from_utf8_lossy(&response);
    anyhow::ensure!(text.starts_with("HTTP/1.1 200"), "scrape failed: {text}");
    Ok(text.split_once("\r\n\r\n").map_or(0, |(_, body)| body.len()))
}

fn main() -> anyhow::Result<()> {
    let quick = std::env::args().any(|a| a == "--quick");
    let scrapes = if quick { 200 } else { 2_000 };
    let runtime =
        tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    runtime.block_on(async move {
        let tmp = tempfile::tempdir()?;
        let root = tmp.path();
        let (kubelet, agent, token) = baleen_tests::bench::start_h200(
            root,
            "bench",
            ViewConfig::default(),
            Path::new(env!("CARGO_BIN_EXE_fake-mps-control")),
        )
        .await?;
        kubelet
            .wait_for("units offered", Duration::from_secs(10), |v| v.healthy(MEM).len() == 8 * 140)
            .await?;
        for i in 0..100 {
            kubelet.admit_to(&format!("bench/pod-{i}"), "main", MEM, 1 + i % 8).await?;
        }
        let address = agent.metrics_address().context("metrics on")?;
        // Let the reconciler name every grant's pod, as in a live node.
        tokio::time::sleep(Duration::from_secs(3)).await;
        for _ in 0..20 {
            scrape(address).await?;
        }
        let mut samples = Vec::with_capacity(scrapes);
        let mut bytes = 0;
        for _ in 0..scrapes {
            let start = Instant::now();
            bytes = scrape(address).await?;
            samples.push(start.elapsed());
        }
        samples.sort_unstable();
        #[allow(
            clippy::cast_possible_truncation,
            clippy::cast_sign_loss,
            reason = "a rounded index between 0 and the sample count"
        )]
        let at = |q: f64| samples[((samples.len() as f64 - 1.0) * q).round() as usize].as_secs_f64() * 1e3;
        println!(
            "scrape of 8 GPUs, 100 grants: n={} p50={:.2}ms p90={:.2}ms p99={:.2}ms max={:.2}ms, {} bytes ({:.1} KiB)",
            samples.len(),
            at(0.5),
            at(0.9),
            at(0.99),
            at(1.0),
            bytes,
            bytes as f64 / 1024.0
        );
        assert_eq!(agent.resources().records().len(), 100);
        token.cancel();
        tokio::time::timeout(Duration::from_secs(10), agent.wait()).await??;
        Ok(())
    })
}
