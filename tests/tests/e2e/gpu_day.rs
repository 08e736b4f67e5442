//! What a real H200 answered on the GPU day (tests/data/gpu-day-2026-11-30), reproduced without
//! a GPU: the simulated topology made from it, the real NVML backend on the fake library with
//! that topology, and the whole agent admitting the same containers.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, Result};
use baleen_agent::inventory::nvml::NvmlInventory;
use baleen_agent::inventory::simulated::SimulatedInventory;
use baleen_agent::inventory::{GpuInventory, Inventory};
use baleen_agent::isolation::mps::MpsConfig;
use baleen_agent::run::{Agent, AgentConfig, Dependencies};
use baleen_tests::fake_kubelet::FakeKubelet;
use baleen_tests::fake_nvml::FakeNvml;
use serde_json::Value;
use tokio_util::sync::CancellationToken;

const DATA: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/data/gpu-day-2026-11-30");
const EXAMPLE: &str =
    concat!(env!("CARGO_MANIFEST_DIR"), "/../packaging/examples/h200-1x-gpu-day.yaml");

fn recorded(name: &str) -> Result<Value> {
    let path = Path::new(DATA).join(name);
    Ok(serde_json::from_str(
        &std::fs::read_to_string(&path).with_context(|| path.display().to_string())?,
    )?)
}

/// An answer's environment as the GPU days recorded it: since then the agent also names the
/// grant's devices in `BALEEN_DEVICE_IDS` (informational), checked here and left out.
fn recorded_envs(
    admitted: &baleen_tests::fake_kubelet::Admission,
) -> Result<std::collections::HashMap<String, String>> {
    let mut envs = admitted.response.envs.clone();
    let mut ids = admitted.device_ids.clone();
    ids.sort();
    let named = envs.remove("BALEEN_DEVICE_IDS").context("the grant's devices are named")?;
    anyhow::ensure!(named == ids.join(","), "BALEEN_DEVICE_IDS {named}");
    Ok(envs)
}

fn simulated() -> Result<Inventory> {
    Ok(SimulatedInventory::from_file(Path::new(EXAMPLE))?.discover()?)
}

#[test]
fn the_simulated_topology_prints_what_real_nvml_printed() -> Result<()> {
    let real = recorded("inventory.json")?;
    let inventory: Inventory = serde_json::from_value(real.clone())?;
    assert_eq!(simulated()?, inventory);
    let resources = baleen_agent::cli::resources_of(&inventory, None, None)?;
    // Recorded before `inventory` printed `offered`: the names and device counts.
    let printed: Vec<(String, u64)> =
        resources.iter().map(|r| (r.name.clone(), r.devices as u64)).collect();
    let recorded: Vec<(String, u64)> = real["resources"]
        .as_array()
        .context("resources")?
        .iter()
        .map(|r| {
            (r["name"].as_str().unwrap_or_default().to_owned(), r["devices"].as_u64().unwrap_or(0))
        })
        .collect();
    assert_eq!(printed, recorded);
    Ok(())
}

#[test]
fn the_nvml_backend_on_the_fake_library_reads_the_same_gpu() -> Result<()> {
    let expected = simulated()?;
    let fake = FakeNvml::new(&expected)?;
    assert_eq!(NvmlInventory::new(fake.nvml_config())?.discover()?, expected);
    Ok(())
}

/// The fake kubelet (serving pod-resources) and the agent's configuration of node `node`
/// under `root`, as the agent ran on the GPU day: its defaults, but the paths in the temp dir
/// (the MPS root served by the fake control daemon: the answers are compared with the root put
/// back), GPUs handed out by the variable (that day's device-list strategy), and no watchdog
/// (no API server on the GPU machine; it needs the node's pods).
async fn day_node(root: &Path, node: &str) -> Result<(FakeKubelet, AgentConfig)> {
    let defaults = AgentConfig::for_root(root);
    let mut kubelet = FakeKubelet::start(&defaults.device_plugin_dir).await?;
    kubelet.serve_pod_resources(&defaults.pod_resources_socket)?;
    std::fs::write(&defaults.boot_id_file, "b")?;
    let config = AgentConfig {
        node_name: node.into(),
        devices: baleen_agent::isolation::devices::DeviceListConfig {
            strategy: baleen_agent::isolation::devices::Strategy::Envvar,
            ..defaults.devices.clone()
        },
        mps: MpsConfig {
            control_binary: env!("CARGO_BIN_EXE_fake-mps-control").into(),
            ..defaults.mps.clone()
        },
        metrics: baleen_agent::metrics::MetricsConfig {
            interval: Duration::from_millis(100),
            ..defaults.metrics.clone()
        },
        reconcile_interval: Duration::from_secs(30),
        reconcile_grace: Duration::from_secs(60),
        reconcile_settle: Duration::from_secs(300),
        ..defaults
    };
    Ok((kubelet, config))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_answers_the_admissions_as_it_did_on_the_gpu() -> Result<()> {
    let real = recorded("kubelet.json")?;
    let tmp = tempfile::tempdir()?;
    let root = tmp.path();
    let (kubelet, config) = day_node(root, "rss-node").await?;
    let inventory: Arc<dyn GpuInventory> =
        Arc::new(SimulatedInventory::from_file(Path::new(EXAMPLE))?);
    let token = CancellationToken::new();
    let agent = tokio::time::timeout(
        Duration::from_secs(10),
        Agent::start(config, Dependencies { inventory, node_api: None }, token.clone()),
    )
    .await??;
    let view = kubelet
        .wait_for("two resources", Duration::from_secs(10), |v| {
            v.streaming.len() == 2 && v.devices.len() == 2
        })
        .await?;
    for (resource, counts) in real["registered"].as_object().context("registered")? {
        assert_eq!(
            Some(view.devices_of(resource).len() as u64),
            counts["devices"].as_u64(),
            "{resource}"
        );
    }
    let first = &real["admissions"][0];
    let admitted =
        kubelet.admit_to("demo/pod-0", "main", "awesome-ai-company.com/gpu-memory", 8).await?;
    assert_eq!(serde_json::to_value(&admitted.device_ids)?, first["devices"]);
    assert_eq!(serde_json::to_value(&admitted.preferred)?, first["preferred"]);
    assert_eq!(serde_json::to_value(recorded_envs(&admitted)?)?, first["envs"]);
    let there = baleen_agent::defaults::MPS_ROOT;
    let here = root.join("mps").display().to_string();
    let hosts: Vec<String> =
        admitted.response.mounts.iter().map(|m| m.host_path.replacen(&here, there, 1)).collect();
    let mounts: Vec<(&String, &String)> =
        hosts.iter().zip(&admitted.response.mounts).map(|(h, m)| (h, &m.container_path)).collect();
    assert_eq!(serde_json::to_value(mounts)?, first["mounts"]);
    // The only GPU is shared now: the whole GPU is refused, as it was there.
    kubelet
        .wait_for("whole GPU unhealthy", Duration::from_secs(10), |v| {
            v.healthy("awesome-ai-company.com/gpu").is_empty()
        })
        .await?;
    let err = kubelet
        .admit_to("demo/pod-1", "main", "awesome-ai-company.com/gpu", 1)
        .await
        .expect_err("shared GPU");
    assert_eq!(Value::String(err.to_string()), real["admissions"][1]["error"]);
    token.cancel();
    tokio::time::timeout(Duration::from_secs(10), agent.wait()).await??;
    Ok(())
}

/// The third GPU day: the agent ran the MPS daemon itself and its answers were enforced
/// (docs/gpu-day.md, "The agent's own MPS"). The agent on the simulated twin of that GPU, with
/// the fake control binary, answers the same two admissions exactly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_answers_as_it_did_when_it_ran_mps_on_the_gpu() -> Result<()> {
    let data = Path::new(env!("CARGO_MANIFEST_DIR")).join("data/gpu-day-2026-11-30-agent-mps");
    let real: Value = serde_json::from_str(&std::fs::read_to_string(data.join("kubelet.json"))?)?;
    let first_uuid = simulated()?.gpus[0].uuid.to_string();
    let uuid = "GPU-e84d5dc7-0103-169e-06da-d0ee90288aef";
    let twin: Inventory =
        serde_json::from_str(&serde_json::to_string(&simulated()?)?.replace(&first_uuid, uuid))?;
    let tmp = tempfile::tempdir()?;
    let root = tmp.path();
    let (kubelet, config) = day_node(root, "gpu-node").await?;
    let inventory: Arc<dyn GpuInventory> = Arc::new(SimulatedInventory::new(twin));
    let token = CancellationToken::new();
    let agent = tokio::time::timeout(
        Duration::from_secs(10),
        Agent::start(config, Dependencies { inventory, node_api: None }, token.clone()),
    )
    .await??;
    kubelet
        .wait_for("units offered", Duration::from_secs(10), |v| {
            !v.healthy("awesome-ai-company.com/gpu-memory").is_empty()
        })
        .await?;
    let there = "/tmp/baleen-gd.bnya/mps";
    let here = root.join("mps").display().to_string();
    for (i, count) in [(0, 4), (1, 8)] {
        let expected = &real["admissions"][i];
        let pod = format!("demo/pod-{i}");
        let admitted =
            kubelet.admit_to(&pod, "main", "awesome-ai-company.com/gpu-memory", count).await?;
        assert_eq!(serde_json::to_value(&admitted.device_ids)?, expected["devices"]);
        assert_eq!(serde_json::to_value(recorded_envs(&admitted)?)?, expected["envs"]);
        let mounts: Vec<(String, &String)> = admitted
            .response
            .mounts
            .iter()
            .map(|m| (m.host_path.replacen(&here, there, 1), &m.container_path))
            .collect();
        assert_eq!(serde_json::to_value(mounts)?, expected["mounts"]);
    }
    token.cancel();
    tokio::time::timeout(Duration::from_secs(10), agent.wait()).await??;
    Ok(())
}
