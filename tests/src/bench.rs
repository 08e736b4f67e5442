//! What the in-process benchmarks (`tests/benches/`) share: the agent's configuration for a
//! node under `root` beside the fake kubelet.

use std::path::Path;
use std::time::Duration;

use baleen_agent::agent::AgentConfig;
use baleen_agent::isolation::devices::{DeviceListConfig, Strategy};
use baleen_agent::isolation::mps::MpsConfig;
use baleen_agent::isolation::watchdog::WatchdogConfig;
use baleen_agent::ledger::ViewConfig;
use baleen_agent::metrics::MetricsConfig;
use baleen_agent::resources::ResponseConfig;

/// The agent of node `node` under `root` (device plugins in `dp`, pod-resources at `pr.sock`,
/// state in `state`, boot ID in `boot_id`), with `views`, GPUs handed out by the variable, the
/// MPS daemons run by `mps_control` (the fake's binary), metrics on a free loopback port, no
/// watchdog, and a reconciliation every second.
pub fn agent_config(root: &Path, node: &str, views: ViewConfig, mps_control: &Path) -> AgentConfig {
    AgentConfig {
        node_name: node.into(),
        device_plugin_dir: root.join("dp"),
        pod_resources_socket: root.join("pr.sock"),
        state_dir: root.join("state"),
        boot_id_file: root.join("boot_id"),
        views,
        responses: ResponseConfig {
            devices: DeviceListConfig { strategy: Strategy::Envvar, ..Default::default() },
            mps: MpsConfig {
                root: root.join("mps"),
                control_binary: mps_control.to_path_buf(),
                ..MpsConfig::default()
            },
        },
        health: Default::default(),
        watchdog: WatchdogConfig { enabled: false, ..WatchdogConfig::default() },
        metrics: MetricsConfig {
            enabled: true,
            address: std::net::SocketAddr::from(([127, 0, 0, 1], 0)),
            interval: Duration::from_secs(1),
        },
        annotation: baleen_agent::agent::node_state::AnnotationConfig::default(),
        colocation: baleen_agent::agent::colocation::ColocationConfig::default(),
        reconcile_interval: Duration::from_secs(1),
        reconcile_grace: Duration::from_secs(600),
        reconcile_settle: Duration::from_secs(300),
    }
}

/// The agent binary `binary` as its own process for node `node` on the simulated `topology`,
/// laid out under `root` as [`agent_config`] does (device plugins in `dp`, pod-resources at
/// `pr.sock`, state in `state`), MPS off, its output dropped; the caller adds the rest
/// (metrics address, memory unit, log level) and spawns it.
pub fn agent_process(
    binary: &Path,
    topology: &Path,
    root: &Path,
    node: &str,
) -> std::process::Command {
    let mut command = std::process::Command::new(binary);
    command
        .arg("--simulated")
        .arg(topology)
        .args(["--no-mps", "--node-name", node])
        .arg("--device-plugin-dir")
        .arg(root.join("dp"))
        .arg("--pod-resources-socket")
        .arg(root.join("pr.sock"))
        .arg("--state-dir")
        .arg(root.join("state"))
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
    baleen_agent::agent::Agent,
    tokio_util::sync::CancellationToken,
)> {
    let mut kubelet = crate::fake_kubelet::FakeKubelet::start(&root.join("dp")).await?;
    kubelet.serve_pod_resources(&root.join("pr.sock"))?;
    std::fs::write(root.join("boot_id"), "b")?;
    let example =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../packaging/examples/h200-8x-nvswitch.yaml");
    let inventory: std::sync::Arc<dyn baleen_agent::inventory::GpuInventory> = std::sync::Arc::new(
        baleen_agent::inventory::simulated::SimulatedInventory::from_file(&example)?,
    );
    let token = tokio_util::sync::CancellationToken::new();
    let agent = baleen_agent::agent::Agent::start(
        agent_config(root, node, views, mps_control),
        baleen_agent::agent::Dependencies {
            inventory,
            registry: Default::default(),
            node_api: None,
        },
        token.clone(),
    )
    .await?;
    kubelet.wait_registered(&format!("{}/gpu-memory", baleen_agent::defaults::DOMAIN), 1).await?;
    Ok((kubelet, agent, token))
}
