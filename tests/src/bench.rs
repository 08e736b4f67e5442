//! What the in-process benchmarks (`tests/benches/`) share: the agent's configuration for a
//! node under `root` beside the fake kubelet.

use std::path::Path;
use std::time::Duration;

use baleen_agent::isolation::devices::{DeviceListConfig, Strategy};
use baleen_agent::isolation::mps::MpsConfig;
use baleen_agent::ledger::ViewConfig;
use baleen_agent::metrics::MetricsConfig;
use baleen_agent::run::AgentConfig;

/// The agent of node `node` under `root` (the layout of [`AgentConfig::for_root`]), with
/// `views`, GPUs handed out by the variable, the MPS daemons run by `mps_control` (the fake's
/// binary), metrics every second on a free loopback port, no watchdog, and a reconciliation
/// every second.
pub fn agent_config(root: &Path, node: &str, views: ViewConfig, mps_control: &Path) -> AgentConfig {
    let defaults = AgentConfig::for_root(root);
    AgentConfig {
        node_name: node.into(),
        views,
        devices: DeviceListConfig { strategy: Strategy::Envvar, ..defaults.devices.clone() },
        mps: MpsConfig { control_binary: mps_control.to_path_buf(), ..defaults.mps.clone() },
        metrics: MetricsConfig { interval: Duration::from_secs(1), ..defaults.metrics.clone() },
        reconcile_interval: Duration::from_secs(1),
        reconcile_grace: Duration::from_secs(600),
        reconcile_settle: Duration::from_secs(300),
        ..defaults
    }
}

/// The agent binary `binary` as its own process for node `node` on the simulated `topology`,
/// laid out under `root` as [`AgentConfig::for_root`] lays it out (device plugins,
/// pod-resources, state), MPS off, its output dropped; the caller adds the rest (metrics
/// address, memory unit, log level) and spawns it. The device-plugin directory is made, as the
/// kubelet makes it on a node (the agent refuses one that does not exist).
pub fn agent_process(
    binary: &Path,
    topology: &Path,
    root: &Path,
    node: &str,
) -> std::process::Command {
    let layout = AgentConfig::for_root(root);
    if let Err(e) = std::fs::create_dir_all(&layout.device_plugin_dir) {
        panic!("cannot make {}: {e}", layout.device_plugin_dir.display());
    }
    let mut command = std::process::Command::new(binary);
    command
        .arg("--simulated")
        .arg(topology)
        .args(["--no-mps", "--node-name", node])
        .arg("--device-plugin-dir")
        .arg(&layout.device_plugin_dir)
        .arg("--pod-resources-socket")
        .arg(&layout.pod_resources_socket)
        .arg("--state-dir")
        .arg(&layout.state_dir)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    command
}

/// The whole agent in-process on the simulated 8x H200 (`packaging/examples`), as node `node`
/// under `root` ([`agent_config`] with `views`, the fake MPS daemons run by `mps_control`),
/// beside a fake kubelet serving pod-resources; returned once its gpu-memory resource has
/// registered. Stop it by cancelling the token.
pub async fn start_h200(
    root: &Path,
    node: &str,
    views: ViewConfig,
    mps_control: &Path,
) -> anyhow::Result<(
    crate::fake_kubelet::FakeKubelet,
    baleen_agent::run::Agent,
    tokio_util::sync::CancellationToken,
)> {
    let config = agent_config(root, node, views, mps_control);
    let mut kubelet = crate::fake_kubelet::FakeKubelet::start(&config.device_plugin_dir).await?;
    kubelet.serve_pod_resources(&config.pod_resources_socket)?;
    std::fs::write(&config.boot_id_file, "b")?;
    let example =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../packaging/examples/h200-8x-nvswitch.yaml");
    let inventory: std::sync::Arc<dyn baleen_agent::inventory::GpuInventory> = std::sync::Arc::new(
        baleen_agent::inventory::simulated::SimulatedInventory::from_file(&example)?,
    );
    let token = tokio_util::sync::CancellationToken::new();
    let agent = baleen_agent::run::Agent::start(
        config,
        baleen_agent::run::Dependencies { inventory, node_api: None },
        token.clone(),
    )
    .await?;
    kubelet.wait_registered(&format!("{}/gpu-memory", baleen_agent::defaults::DOMAIN), 1).await?;
    Ok((kubelet, agent, token))
}

/// A field of `/proc/<pid>/status` in KiB (`VmRSS:`, `VmHWM:`), 0 if it cannot be read.
pub fn status_kib(pid: u32, field: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

/// Prints process `pid`'s resident memory and its peak, labelled `what`.
pub fn report_memory(pid: u32, what: &str) {
    println!(
        "{what:>48}: RSS {:6.1} MiB, peak {:6.1} MiB",
        status_kib(pid, "VmRSS:") as f64 / 1024.0,
        status_kib(pid, "VmHWM:") as f64 / 1024.0
    );
}

/// The `q` quantile (0 to 1, nearest rank) of `samples`, in milliseconds; sorts them.
pub fn quantile_ms(samples: &mut [std::time::Duration], q: f64) -> f64 {
    samples.sort_unstable();
    #[allow(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        reason = "a rounded index between 0 and the sample count"
    )]
    let i = ((samples.len() as f64 - 1.0) * q).round() as usize;
    samples[i].as_secs_f64() * 1e3
}

/// Prints `samples`' count, p50, p90, p99 and max labelled `label` (right-aligned to `width`);
/// returns the p99 in milliseconds.
pub fn latency_line(label: &str, width: usize, samples: &mut [std::time::Duration]) -> f64 {
    let q = |samples: &mut [std::time::Duration], x| quantile_ms(samples, x);
    let p99 = q(samples, 0.99);
    println!(
        "{label:>width$}: n={} p50={:.2}ms p90={:.2}ms p99={:.2}ms max={:.2}ms",
        samples.len(),
        q(samples, 0.5),
        q(samples, 0.9),
        p99,
        q(samples, 1.0)
    );
    p99
}
