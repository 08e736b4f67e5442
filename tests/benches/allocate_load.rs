//! Issue 22, item 5: Allocate under a growing ledger, under scrapes and under concurrency, on
//! the simulated 8x H200 (a 256 MiB unit: 4,480 units) with the whole agent in-process against
//! the fake kubelet over real Unix sockets, every grant durable (the checkpoint written and
//! synced) before it is answered. In one run, so that the machine's noise falls on every phase:
//!
//! - single-client Allocate of one unit at 10 to 310 records, then at 1,000 to 1,300 (300
//!   samples each, so that a p99 is not one sample);
//! - from 1,300 to 1,900 records, six rounds of 50 grants without scrapers and 50 with 8
//!   clients scraping `/metrics` in a loop (the agent paces a flood: see
//!   `baleen_agent::metrics::Pacer`; it renders at idle priority: `Renderer`), alternating so
//!   that the machine's noise falls on both;
//! - 16 clients at once, 100 grants each: grants per second and the latency percentiles.
//!
//! Run with `cargo bench -p baleen-tests --bench allocate_load`.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use baleen_agent::ledger::ViewConfig;
use baleen_tests::fake_kubelet::FakeKubelet;
use tokio_util::sync::CancellationToken;

const MEM: &str = "awesome-ai-company.com/gpu-memory";
/// Rounds of the scrape phase, each `ROUND` grants without scrapers and `ROUND` with.
const ROUNDS: usize = 6;
const ROUND: usize = 50;

fn line(label: &str, samples: &mut [Duration]) -> f64 {
    baleen_tests::bench::latency_line(label, 40, samples)
}

async fn scrape(address: std::net::SocketAddr) -> anyhow::Result<()> {
    let (code, _) = baleen_tests::http::request(address, "GET", "/metrics", "").await?;
    anyhow::ensure!(code == 200, "scrape failed: {code}");
    Ok(())
}

/// Allocates each of `ids` alone, in turn; the latency of each.
async fn one_by_one(kubelet: &FakeKubelet, ids: &[String]) -> anyhow::Result<Vec<Duration>> {
    let mut samples = Vec::with_capacity(ids.len());
    for id in ids {
        let started = Instant::now();
        kubelet
            .allocate_raw(MEM, vec![vec![id.clone()]])
            .await
            .map_err(|e| anyhow::anyhow!("{e:?}"))?;
        samples.push(started.elapsed());
    }
    Ok(samples)
}

fn main() -> anyhow::Result<()> {
    let runtime =
        tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    runtime.block_on(async move {
        let tmp = tempfile::tempdir()?;
        let root = tmp.path();
        // A 256 MiB unit: 4,480 units on the 8 GPUs, room for every phase.
        let (kubelet, agent, token) = baleen_tests::bench::start_h200(
            root,
            "load",
            ViewConfig { memory_unit_bytes: 256 << 20, ..ViewConfig::default() },
            Path::new(env!("CARGO_BIN_EXE_fake-mps-control")),
        )
        .await?;
        let view = kubelet
            .wait_for("units offered", Duration::from_secs(10), |v| v.healthy(MEM).len() > 4000)
            .await?;
        let mut free: Vec<String> = view.healthy(MEM);
        free.sort();
        let mut take = |n: usize| -> Vec<String> { free.drain(..n).collect() };
        let address = agent.metrics_address().context("metrics on")?;
        one_by_one(&kubelet, &take(10)).await?;
        let small =
            line("Allocate at 10-310 records", &mut one_by_one(&kubelet, &take(300)).await?);
        one_by_one(&kubelet, &take(690)).await?;
        let large =
            line("Allocate at 1,000-1,300 records", &mut one_by_one(&kubelet, &take(300)).await?);
        // With and without scrapers in alternating rounds, so that the shared machine's noise
        // (other tenants, frequency changes) falls on both alike.
        let (mut quiet, mut scraped, mut scrapes) = (Vec::new(), Vec::new(), 0);
        for _ in 0..ROUNDS {
            quiet.extend(one_by_one(&kubelet, &take(ROUND)).await?);
            let stop = CancellationToken::new();
            let scrapers: Vec<_> = (0..8)
                .map(|_| {
                    let stop = stop.clone();
                    tokio::spawn(async move {
                        let mut n = 0u64;
                        while !stop.is_cancelled() {
                            if scrape(address).await.is_ok() {
                                n += 1;
                            }
                        }
                        n
                    })
                })
                .collect();
            tokio::time::sleep(Duration::from_millis(100)).await;
            scraped.extend(one_by_one(&kubelet, &take(ROUND)).await?);
            stop.cancel();
            for s in scrapers {
                scrapes += s.await?;
            }
        }
        let quiet = line("1,300-1,900 records, no scrapers", &mut quiet);
        let scraped = line("... with 8 scrapers (alternating)", &mut scraped);
        println!("{:>40}: {scrapes}", "scrapes served meanwhile");
        let kubelet = Arc::new(kubelet);
        let started = Instant::now();
        let clients: Vec<_> = (0..16)
            .map(|_| {
                let (kubelet, ids) = (kubelet.clone(), take(100));
                tokio::spawn(async move { one_by_one(&kubelet, &ids).await })
            })
            .collect();
        let mut all = Vec::new();
        for c in clients {
            all.extend(c.await??);
        }
        let took = started.elapsed().as_secs_f64();
        line("16 clients, 1,600 grants", &mut all);
        println!("{:>40}: {:.0} grants/s over {took:.2} s", "throughput", 1600.0 / took);
        println!("{:>40}: {:.2}x", "p99 at 1,000 / at 10 records", large / small);
        println!("{:>40}: {:.2}x", "p99 with / without scrapers", scraped / quiet);
        assert_eq!(
            agent.resources().records().len(),
            10 + 300 + 690 + 300 + 2 * ROUNDS * ROUND + 1600
        );
        token.cancel();
        tokio::time::timeout(Duration::from_secs(10), agent.wait()).await??;
        Ok(())
    })
}
