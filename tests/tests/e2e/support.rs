//! What the integration tests share: `TestNode` (a temp dir holding every host path, a fake
//! kubelet serving pod-resources, the agent's configuration for that root, and how to start,
//! wait for and stop the agent on it), and `poll`, the one way these tests wait for something.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, Result};
use baleen_agent::inventory::nvml::NvmlInventory;
use baleen_agent::inventory::simulated::SimulatedInventory;
use baleen_agent::inventory::{GpuInventory, Inventory};
use baleen_agent::isolation::mps::MpsConfig;
use baleen_agent::run::{Agent, AgentConfig, Dependencies};
use baleen_tests::fake_kubelet::{FakeKubelet, KubeletView};
use baleen_tests::fake_nvml::FakeNvml;
use tokio_util::sync::CancellationToken;

/// How often `poll` asks again.
pub(crate) const POLL: Duration = Duration::from_millis(20);

/// Asks `check` every `POLL` until it answers `Some`, for at most `WAIT`: the one polling loop
/// of these tests. An error from `check` ends the wait with that error; running out of time
/// says what was waited for.
pub(crate) async fn poll<T>(
    what: &str,
    check: impl AsyncFnMut() -> Result<Option<T>>,
) -> Result<T> {
    poll_within(WAIT, what, check).await
}

/// `poll` for at most `limit`.
pub(crate) async fn poll_within<T>(
    limit: Duration,
    what: &str,
    mut check: impl AsyncFnMut() -> Result<Option<T>>,
) -> Result<T> {
    tokio::time::timeout(limit, async {
        loop {
            if let Some(found) = check().await? {
                return Ok(found);
            }
            tokio::time::sleep(POLL).await;
        }
    })
    .await
    .with_context(|| format!("timed out after {limit:?} waiting for {what}"))?
}

/// `poll` for a condition that cannot fail.
pub(crate) async fn eventually(what: &str, ok: impl Fn() -> bool) -> Result<()> {
    poll(what, async || Ok(ok().then_some(()))).await
}

pub(crate) const EXAMPLES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../packaging/examples");

/// How long any wait of these tests lasts before it fails.
pub(crate) const WAIT: Duration = Duration::from_secs(10);

pub(crate) fn example(name: &str) -> Result<Inventory> {
    Ok(SimulatedInventory::from_file(&Path::new(EXAMPLES).join(name))?.discover()?)
}

/// Writes `dir/nvidia.yaml`, a CDI spec naming every GPU and MIG instance of `inventory` by UUID
/// but those in `leave_out`.
pub(crate) fn write_cdi_spec(
    dir: &Path,
    inventory: &Inventory,
    leave_out: &[String],
) -> Result<()> {
    std::fs::create_dir_all(dir)?;
    let mut text = String::from("cdiVersion: 0.6.0\nkind: nvidia.com/gpu\ndevices:\n");
    for gpu in &inventory.gpus {
        let names = std::iter::once(gpu.uuid.to_string())
            .chain(gpu.mig.instances().iter().map(|m| m.uuid.to_string()));
        for name in names.filter(|n| !leave_out.contains(n)) {
            text.push_str(&format!(
                "  - name: {name}\n    containerEdits:\n      deviceNodes:\n        - path: /dev/nvidia{}\n",
                gpu.index
            ));
        }
    }
    std::fs::write(dir.join("nvidia.yaml"), text)?;
    Ok(())
}

/// A node: a temp dir holding every host path, a fake kubelet serving pod-resources there, the
/// agent's configuration for that root (fast intervals), and how to start the agent on it.
pub(crate) struct TestNode {
    /// The root of every host path (`config` names them); removed when the node is dropped.
    _root: tempfile::TempDir,
    pub(crate) kubelet: FakeKubelet,
    pub(crate) config: AgentConfig,
    /// What the agent discovers: replace it before `start` for a node of another inventory.
    pub(crate) inventory: Arc<dyn GpuInventory>,
    /// The fake NVML library of a `Backend::FakeNvml` node (a test may put one of its own).
    pub(crate) nvml: Option<FakeNvml>,
}

/// How a `TestNode` discovers its GPUs.
pub(crate) enum Backend {
    /// The simulated inventory of the example topology.
    Simulated,
    /// The real NVML backend over the fake `libnvidia-ml.so`, serving the example topology.
    FakeNvml,
}

impl TestNode {
    pub(crate) async fn new(example_name: &str, backend: Backend) -> Result<Self> {
        let tmp = tempfile::tempdir()?;
        // Every host path in the temp dir (CDI names, the default, resolved in the node's spec
        // written below).
        let defaults = AgentConfig::for_root(tmp.path());
        let mut kubelet = FakeKubelet::start(&defaults.device_plugin_dir).await?;
        kubelet.serve_pod_resources(&defaults.pod_resources_socket)?;
        std::fs::write(&defaults.boot_id_file, "boot-1\n")?;
        let expected = example(example_name)?;
        // The node's CDI spec, as `nvidia-ctk cdi generate --device-name-strategy=uuid`
        // names devices: every GPU and MIG instance by UUID.
        write_cdi_spec(&defaults.devices.cdi_spec_dirs[1], &expected, &[])?;
        let (inventory, nvml): (Arc<dyn GpuInventory>, _) = match backend {
            Backend::Simulated => (Arc::new(SimulatedInventory::new(expected)), None),
            Backend::FakeNvml => {
                let fake = FakeNvml::new(&expected)?;
                (Arc::new(NvmlInventory::new(fake.nvml_config())?), Some(fake))
            }
        };
        let config = AgentConfig {
            mps: MpsConfig {
                control_binary: env!("CARGO_BIN_EXE_fake-mps-control").into(),
                probe_interval: Duration::from_millis(100),
                ..defaults.mps.clone()
            },
            metrics: baleen_agent::metrics::MetricsConfig {
                interval: Duration::from_millis(100),
                ..defaults.metrics.clone()
            },
            reconcile_interval: Duration::from_millis(100),
            // Whole seconds: an allocation is at least 1 s old before it can be released.
            reconcile_grace: Duration::from_secs(2),
            // Settled at once: tests of the settling kubelet set their own.
            reconcile_settle: Duration::from_millis(1),
            ..defaults
        };
        Ok(Self { _root: tmp, kubelet, config, inventory, nvml })
    }

    /// The fake NVML library of a `Backend::FakeNvml` node.
    pub(crate) fn nvml(&self) -> Result<&FakeNvml> {
        self.nvml.as_ref().context("a node over the fake NVML (Backend::FakeNvml)")
    }

    pub(crate) async fn start(&self) -> Result<(Agent, CancellationToken)> {
        self.start_with(None).await
    }

    /// Starts the agent with `node_api` for its node-state annotation.
    pub(crate) async fn start_with(
        &self,
        node_api: Option<Arc<dyn baleen_agent::kube_api::NodeApi>>,
    ) -> Result<(Agent, CancellationToken)> {
        let token = CancellationToken::new();
        let agent = tokio::time::timeout(
            WAIT,
            Agent::start(
                self.config.clone(),
                Dependencies { inventory: self.inventory.clone(), node_api },
                token.clone(),
            ),
        )
        .await
        .context("agent start timed out")??;
        Ok((agent, token))
    }

    /// Waits until every resource of `agent` has registered `n` times and streams its devices.
    pub(crate) async fn registered(&self, agent: &Agent, n: u64) -> Result<KubeletView> {
        let resources: Vec<String> = agent.plugins().iter().map(|(r, _)| r.clone()).collect();
        self.kubelet
            .wait_for("every resource registered", WAIT, |v| {
                resources.iter().all(|r| {
                    v.registrations.get(r).copied().unwrap_or(0) >= n
                        && v.streaming.contains(r)
                        && v.devices.contains_key(r)
                })
            })
            .await
    }

    pub(crate) fn checkpoint(&self) -> PathBuf {
        self.config.state_dir.join(baleen_agent::checkpoint::FILE_NAME)
    }
}

/// Cancels the agent and waits (at most `WAIT`) for it to finish cleanly.
pub(crate) async fn stop(agent: Agent, token: CancellationToken) -> Result<()> {
    token.cancel();
    tokio::time::timeout(WAIT, agent.wait()).await??;
    Ok(())
}

pub(crate) use baleen_tests::tools::workspace_binary;
