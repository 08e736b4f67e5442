//! Device-plugin latency over a real Unix socket, against the fake kubelet:
//!
//! - Allocate round trip (one container, one device), as the kubelet's client sees it;
//! - the delay from a backend publishing a new device list to the kubelet having received the
//!   ListAndWatch message.
//!
//! Prints percentiles (p50, p90, p99, max). Run with
//! `cargo bench -p baleen-tests --bench plugin_latency` (add `-- --quick` for a short run).
//! Criterion reports means and medians of batches; the issue asks for a p99 per call, so this
//! harness times each call itself.

use std::time::{Duration, Instant};

use anyhow::Context as _;
use baleen_device_plugin::{Device, DeviceBackend as _, Plugin, PluginConfig};
use baleen_tests::fake_kubelet::FakeKubelet;
use baleen_tests::memory_backend::MemoryBackend;
use tokio_util::sync::CancellationToken;

const RESOURCE: &str = "example.com/widget";

fn percentiles(label: &str, mut samples: Vec<Duration>) {
    samples.sort_unstable();
    #[allow(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        reason = "a rounded index between 0 and the sample count"
    )]
    let at = |q: f64| {
        let i = ((samples.len() as f64 - 1.0) * q).round() as usize;
        samples[i].as_secs_f64() * 1e6
    };
    println!(
        "{label}: n={} p50={:.1}µs p90={:.1}µs p99={:.1}µs max={:.1}µs",
        samples.len(),
        at(0.5),
        at(0.9),
        at(0.99),
        at(1.0)
    );
}

async fn agent_allocate(
    kubelet: &FakeKubelet,
    dir: &std::path::Path,
    n: usize,
) -> anyhow::Result<Vec<Duration>> {
    use baleen_agent::checkpoint::Checkpoint;
    use baleen_agent::inventory::GpuInventory as _;
    use baleen_agent::inventory::simulated::SimulatedInventory;
    use baleen_agent::ledger::{DeviceLedger, ViewConfig};
    use baleen_agent::resources::{NodeResources, ResponseConfig};

    let example = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../packaging/examples/h200-8x-nvswitch.yaml");
    let inventory = SimulatedInventory::from_file(&example)?.discover()?;
    let state = DeviceLedger::new("bench", &inventory, ViewConfig::default())?;
    // The checkpoint goes where the bench's temp dir is (see docs/benchmarks.md for the disk).
    let checkpoint = Checkpoint::in_dir(&dir.join("state"));
    let resources = NodeResources::new(
        state,
        checkpoint,
        "bench".into(),
        "boot".into(),
        None,
        ResponseConfig::default(),
        // As if restored from a trusted checkpoint at sequence 0: every grant is written.
        Some(0),
    );
    let backend = resources
        .backends()
        .into_iter()
        .find(|b| b.resource_name().ends_with("/gpu-memory"))
        .context("gpu-memory view")?;
    let resource = backend.resource_name().to_owned();
    let token = CancellationToken::new();
    let plugin = Plugin::new(backend, PluginConfig::new(kubelet.dir(), &resource));
    let task = tokio::spawn(plugin.run(token.clone()));
    kubelet.wait_registered(&resource, 1).await?;
    let gpu = inventory.gpus[0].uuid.to_string();
    let units = |from: u32| (from..from + 8).map(|u| format!("{gpu}::{u}")).collect::<Vec<_>>();
    let mut samples = Vec::with_capacity(n);
    for i in 0..n + 20 {
        let request = vec![units(if i % 2 == 0 { 0 } else { 4 })];
        let start = Instant::now();
        kubelet.allocate_raw(&resource, request).await?;
        if i >= 20 {
            samples.push(start.elapsed());
        }
    }
    assert_eq!(resources.records().len(), 1, "each Allocate replaced the previous one");
    token.cancel();
    tokio::time::timeout(Duration::from_secs(10), task).await???;
    Ok(samples)
}

fn main() -> anyhow::Result<()> {
    let quick = std::env::args().any(|a| a == "--quick");
    let (allocs, changes) = if quick { (2_000, 200) } else { (20_000, 2_000) };
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    runtime.block_on(async move {
        let tmp = tempfile::tempdir()?;
        let kubelet = FakeKubelet::start(tmp.path()).await?;
        let backend = MemoryBackend::new(RESOURCE, 64);
        let plugin = Plugin::new(backend.clone(), PluginConfig::new(tmp.path(), RESOURCE));
        let token = CancellationToken::new();
        let task = tokio::spawn(plugin.run(token.clone()));
        kubelet.wait_registered(RESOURCE, 1).await?;
        kubelet
            .wait_for("devices", Duration::from_secs(10), |v| v.devices_of(RESOURCE).len() == 64)
            .await?;

        // Allocate round trips (repeated Allocate of the same IDs is allowed).
        let request = vec![vec!["dev-7".to_owned()]];
        for _ in 0..200 {
            kubelet.allocate_raw(RESOURCE, request.clone()).await?;
        }
        let mut samples = Vec::with_capacity(allocs);
        for _ in 0..allocs {
            let start = Instant::now();
            kubelet.allocate_raw(RESOURCE, request.clone()).await?;
            samples.push(start.elapsed());
        }
        percentiles("Allocate round trip", samples);

        // Device-list change to ListAndWatch message at the kubelet.
        let mut samples = Vec::with_capacity(changes);
        for i in 0..changes {
            let before = kubelet.view().updates[RESOURCE];
            let mut devices: Vec<Device> =
                (0..64).map(|d| Device::healthy(format!("dev-{d}"))).collect();
            devices[i % 64].health = baleen_device_plugin::Health::Unhealthy;
            let start = Instant::now();
            backend.publish(devices);
            kubelet
                .wait_for("update", Duration::from_secs(10), |v| v.updates[RESOURCE] > before)
                .await?;
            samples.push(start.elapsed());
        }
        percentiles("ListAndWatch delay", samples);
        assert_eq!(backend.resource_name(), RESOURCE);
        token.cancel();
        tokio::time::timeout(Duration::from_secs(10), task).await???;

        // The agent's own gpu-memory backend on the 8x H200 example: each Allocate replaces the
        // previous one (overlapping units), so every call changes the ledger and writes the
        // checkpoint (write, fsync, rename, fsync of the directory) before answering.
        let agent_allocs = allocs / 10;
        let samples = agent_allocate(&kubelet, tmp.path(), agent_allocs).await?;
        percentiles("Allocate through the agent's ledger (checkpoint fsync)", samples);
        Ok(())
    })
}
