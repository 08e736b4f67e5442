//! The whole agent in-process against the fake kubelet (device plugins and pod-resources), on
//! the simulated inventory and on the real NVML backend over the fake `libnvidia-ml.so`:
//! registration of every view, packing, exclusivity across views, clear refusals, health, and
//! crash recovery with an intact or a corrupted checkpoint, the node-state annotation against a
//! fake API server. Every wait has a timeout.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, Result};
use baleen_agent::inventory::nvml::NvmlInventory;
use baleen_agent::inventory::simulated::SimulatedInventory;
use baleen_agent::inventory::{GpuInventory, Inventory};
use baleen_agent::isolation::mps::MpsConfig;
use baleen_agent::ledger::AllocationRecord;
use baleen_agent::run::{Agent, AgentConfig, Dependencies};
use baleen_k8s::gpu_state::NodeGpuState;
use baleen_proto::deviceplugin::v1beta1::HEALTHY;
use baleen_tests::fake_kubelet::{AdmitError, FakeKubelet, KubeletView};
use baleen_tests::fake_nvml::FakeNvml;
use tokio_util::sync::CancellationToken;
use tonic::Code;

const EXAMPLES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../packaging/examples");
const WAIT: Duration = Duration::from_secs(10);
const GPU: &str = "awesome-ai-company.com/gpu";
const MEM: &str = "awesome-ai-company.com/gpu-memory";

fn example(name: &str) -> Result<Inventory> {
    Ok(SimulatedInventory::from_file(&Path::new(EXAMPLES).join(name))?.discover()?)
}

/// Writes `dir/nvidia.yaml`, a CDI spec naming every GPU and MIG instance of `inventory` by UUID
/// but those in `leave_out`.
fn write_cdi_spec(dir: &Path, inventory: &Inventory, leave_out: &[String]) -> Result<()> {
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

/// The CDI names of an Allocate answer.
fn cdi_names(
    response: &baleen_proto::deviceplugin::v1beta1::ContainerAllocateResponse,
) -> Vec<String> {
    response.cdi_devices.iter().map(|d| d.name.clone()).collect()
}

/// A node: temp dirs, a fake kubelet serving pod-resources, and how to start the agent.
struct Node {
    _tmp: tempfile::TempDir,
    kubelet: FakeKubelet,
    config: AgentConfig,
    inventory: Arc<dyn GpuInventory>,
    nvml: Option<FakeNvml>,
}

enum Backend {
    Simulated,
    FakeNvml,
}

impl Node {
    async fn new(example_name: &str, backend: Backend) -> Result<Self> {
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
        Ok(Self { _tmp: tmp, kubelet, config, inventory, nvml })
    }

    /// The fake NVML library of a `Backend::FakeNvml` node.
    fn nvml(&self) -> Result<&FakeNvml> {
        self.nvml.as_ref().context("a node over the fake NVML (Backend::FakeNvml)")
    }

    async fn start(&self) -> Result<(Agent, CancellationToken)> {
        self.start_with(None).await
    }

    /// Starts the agent with `node_api` for its node-state annotation.
    async fn start_with(
        &self,
        node_api: Option<Arc<dyn baleen_agent::kube_api::NodeApi>>,
    ) -> Result<(Agent, CancellationToken)> {
        let token = CancellationToken::new();
        let agent = tokio::time::timeout(
            WAIT,
            Agent::start(
                self.config.clone(),
                Dependencies {
                    inventory: self.inventory.clone(),
                    registry: Default::default(),
                    node_api,
                },
                token.clone(),
            ),
        )
        .await
        .context("agent start timed out")??;
        Ok((agent, token))
    }

    /// Waits until every resource of `agent` has registered `n` times and streams its devices.
    async fn registered(&self, agent: &Agent, n: u64) -> Result<KubeletView> {
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

    fn checkpoint(&self) -> PathBuf {
        self.config.state_dir.join(baleen_agent::checkpoint::FILE_NAME)
    }
}

/// Cancels the agent and waits (at most `WAIT`) for it to finish cleanly.
async fn stop(agent: Agent, token: CancellationToken) -> Result<()> {
    token.cancel();
    tokio::time::timeout(WAIT, agent.wait()).await??;
    Ok(())
}

fn gpu_of(unit: &str) -> &str {
    unit.split_once("::").map_or(unit, |(gpu, _)| gpu)
}

fn unit_health<'a>(view: &'a KubeletView, gpu: &str) -> Vec<&'a str> {
    view.devices_of(MEM)
        .iter()
        .filter(|d| gpu_of(&d.id) == gpu)
        .map(|d| d.health.as_str())
        .collect()
}

async fn every_view_registers_and_packs(backend: Backend) -> Result<()> {
    let node = Node::new("h200-8x-nvswitch.yaml", backend).await?;
    let (agent, token) = node.start().await?;
    let view = node.registered(&agent, 1).await?;
    let mut names: Vec<&str> = agent.plugins().iter().map(|(r, _)| r.as_str()).collect();
    names.sort_unstable();
    assert_eq!(
        names,
        [
            GPU,
            MEM,
            "awesome-ai-company.com/nvlink-group-2",
            "awesome-ai-company.com/nvlink-group-4",
            "awesome-ai-company.com/nvlink-group-8"
        ]
    );
    assert_eq!(view.devices_of(MEM).len(), 8 * 140);
    assert_eq!(view.healthy(GPU).len(), 8);

    // 100 units on one GPU, 120 on another: a 16-unit request goes to the tightest (20 free).
    let a = node.kubelet.admit_to("ns/a", "c", MEM, 100).await?;
    let b = node.kubelet.admit_to("ns/b", "c", MEM, 120).await?;
    let gpu_a = gpu_of(&a.device_ids[0]).to_owned();
    let gpu_b = gpu_of(&b.device_ids[0]).to_owned();
    assert_ne!(gpu_a, gpu_b, "120 units do not fit beside 100 on one 140-unit GPU");
    assert!(a.device_ids.iter().all(|id| gpu_of(id) == gpu_a), "units of one container on one GPU");
    let c = node.kubelet.admit_to("ns/c", "c", MEM, 16).await?;
    assert!(
        c.device_ids.iter().all(|id| gpu_of(id) == gpu_b),
        "packed onto the 20-unit gap: {c:?}"
    );
    assert_eq!(c.preferred.as_deref(), Some(&c.device_ids[..]), "the kubelet took our preference");
    let d = node.kubelet.admit_to("ns/d", "c", MEM, 30).await?;
    assert!(d.device_ids.iter().all(|id| gpu_of(id) == gpu_a), "30 fits only beside the 100");
    assert_eq!(d.response.envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"], "0=30720M");
    assert_eq!(cdi_names(&d.response), [format!("nvidia.com/gpu={gpu_a}")]);
    assert_eq!(d.response.envs["NVIDIA_VISIBLE_DEVICES"], "void", "an image's `all` adds nothing");

    // Two containers never share a unit.
    let mut all: Vec<&String> = [&a, &b, &c, &d].iter().flat_map(|x| x.device_ids.iter()).collect();
    let total = all.len();
    all.sort();
    all.dedup();
    assert_eq!(all.len(), total);
    let records = agent.resources().records();
    assert_eq!(records.len(), 4);
    stop(agent, token).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn simulated_every_view_registers_and_memory_is_packed() -> Result<()> {
    every_view_registers_and_packs(Backend::Simulated).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fake_nvml_every_view_registers_and_memory_is_packed() -> Result<()> {
    every_view_registers_and_packs(Backend::FakeNvml).await
}

async fn exclusivity_and_refusals(backend: Backend) -> Result<()> {
    let node = Node::new("l4-4x-pcie.yaml", backend).await?;
    let (agent, token) = node.start().await?;
    let view = node.registered(&agent, 1).await?;
    assert!(view.devices.contains_key("awesome-ai-company.com/nvlink-group-2"));

    // A whole GPU: its units become Unhealthy; after the pod ends, Healthy again.
    let whole = node.kubelet.admit_to("ns/train", "c", GPU, 1).await?;
    let gpu = whole.device_ids[0].clone();
    node.kubelet
        .wait_for("units of the whole GPU unhealthy", WAIT, |v| {
            let h = unit_health(v, &gpu);
            !h.is_empty() && h.iter().all(|s| *s != HEALTHY)
        })
        .await?;

    // Allocate for that GPU's units is refused (a kubelet whose view is stale could ask).
    let err = node
        .kubelet
        .allocate_raw(MEM, vec![vec![format!("{gpu}::0"), format!("{gpu}::1")]])
        .await
        .expect_err("GPU taken whole");
    let AdmitError::Rpc(status) = err else { panic!("expected a gRPC error, got {err}") };
    assert_eq!(status.code(), Code::FailedPrecondition);
    assert!(
        status.message().contains(&gpu) && status.message().contains("held whole"),
        "{status:?}"
    );

    // Units on two GPUs are refused, naming both.
    let view = node.kubelet.view();
    let others: Vec<String> = view.healthy(GPU).into_iter().filter(|g| *g != gpu).collect();
    let split = vec![format!("{}::0", others[0]), format!("{}::0", others[1])];
    let err = node.kubelet.allocate_raw(MEM, vec![split]).await.expect_err("two GPUs");
    let AdmitError::Rpc(status) = err else { panic!("expected a gRPC error, got {err}") };
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(status.message().contains("on one GPU"), "{status:?}");
    assert!(status.message().contains(&others[0]) && status.message().contains(&others[1]));

    // Units on another GPU make that GPU unavailable as a whole GPU.
    let shared = node.kubelet.admit_to("ns/infer", "c", MEM, 4).await?;
    let shared_gpu = gpu_of(&shared.device_ids[0]).to_owned();
    let err =
        node.kubelet.allocate_raw(GPU, vec![vec![shared_gpu.clone()]]).await.expect_err("shared");
    let AdmitError::Rpc(status) = err else { panic!("expected a gRPC error, got {err}") };
    assert_eq!(status.code(), Code::FailedPrecondition);
    assert!(status.message().contains("gpu-memory units"), "{status:?}");

    node.kubelet.end_pod("ns/train");
    node.kubelet
        .wait_for("units healthy again after the pod ended", WAIT, |v| {
            unit_health(v, &gpu).iter().all(|s| *s == HEALTHY)
        })
        .await?;
    assert_eq!(agent.resources().records().len(), 1, "only the gpu-memory allocation is left");
    stop(agent, token).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn simulated_whole_gpu_hides_units_and_conflicts_are_refused() -> Result<()> {
    exclusivity_and_refusals(Backend::Simulated).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fake_nvml_whole_gpu_hides_units_and_conflicts_are_refused() -> Result<()> {
    exclusivity_and_refusals(Backend::FakeNvml).await
}

fn sorted(mut records: Vec<AllocationRecord>) -> Vec<(String, Vec<String>)> {
    records.sort();
    records.into_iter().map(|r| (r.resource, r.device_ids)).collect()
}

async fn crash_and_restart(corrupt: bool) -> Result<()> {
    let node = Node::new("h200-8x-nvswitch.yaml", Backend::Simulated).await?;
    // The first agent runs on a runtime of its own, so that it can be killed whole: every task,
    // gRPC connections included, dropped at once, nothing shut down in order.
    let doomed =
        tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build()?;
    let (config, inventory) = (node.config.clone(), node.inventory.clone());
    let agent = tokio::time::timeout(
        WAIT,
        doomed.spawn(async move {
            Agent::start(
                config,
                Dependencies { inventory, registry: Default::default(), node_api: None },
                CancellationToken::new(),
            )
            .await
        }),
    )
    .await???;
    node.registered(&agent, 1).await?;
    node.kubelet.admit_to("ns/a", "c", MEM, 10).await?;
    node.kubelet.admit_to("ns/b", "c", GPU, 2).await?;
    node.kubelet.admit_to("ns/c", "c", "awesome-ai-company.com/nvlink-group-2", 1).await?;
    let before = sorted(agent.resources().records());
    assert_eq!(before.len(), 3);
    let sockets: Vec<PathBuf> = agent
        .plugins()
        .iter()
        .map(|(r, _)| {
            node.config.device_plugin_dir.join(baleen_device_plugin::plugin::socket_name(r))
        })
        .collect();
    // The crash.
    drop(agent);
    doomed.shutdown_background();
    // A crashed process leaves its socket files behind: put stale ones in place (new files, so
    // that no dying task of the old runtime takes them for its own and removes them).
    for socket in &sockets {
        let _ = std::fs::remove_file(socket);
        drop(std::os::unix::net::UnixListener::bind(socket)?);
        assert!(socket.exists());
    }
    if corrupt {
        // The grants are in the journal (the snapshot was written at start, empty): one byte of
        // a whole line changed.
        let journal = node.config.state_dir.join(baleen_agent::checkpoint::JOURNAL_FILE_NAME);
        let text = std::fs::read_to_string(&journal)?;
        anyhow::ensure!(text.contains("::1"), "the grants are in the journal: {text}");
        std::fs::write(&journal, text.replacen("::1", "::9", 1))?;
    }
    let (agent, token) = node.start().await?;
    assert_eq!(sorted(agent.resources().records()), before, "nothing lost or duplicated");
    node.registered(&agent, 2).await?;
    // The restarted agent keeps packing around what it restored: no unit handed out twice.
    let more = node.kubelet.admit_to("ns/d", "c", MEM, 5).await?;
    let held: Vec<String> = before.iter().flat_map(|(_, ids)| ids.clone()).collect();
    assert!(more.device_ids.iter().all(|id| !held.contains(id)));
    assert_eq!(agent.resources().records().len(), 4);
    stop(agent, token).await?;
    // And the checkpoint written since is trusted again.
    let contents = baleen_agent::checkpoint::Checkpoint::in_dir(&node.config.state_dir)
        .load("node-a", "boot-1")?
        .context("checkpoint present")?;
    assert_eq!(contents.allocations.len(), 4);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_then_restart_loses_and_duplicates_nothing() -> Result<()> {
    crash_and_restart(false).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_with_a_corrupted_checkpoint_is_rebuilt_from_pod_resources() -> Result<()> {
    crash_and_restart(true).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_critical_xid_makes_the_gpu_unhealthy() -> Result<()> {
    let expected = example("l4-4x-pcie.yaml")?;
    let simulated = Arc::new(SimulatedInventory::new(expected.clone()));
    let mut node = Node::new("l4-4x-pcie.yaml", Backend::Simulated).await?;
    node.inventory = simulated.clone();
    let (agent, token) = node.start().await?;
    node.registered(&agent, 1).await?;
    let gpu = expected.gpus[2].uuid.clone();
    // The health thread subscribes right after start; retry the injection until it is seen.
    let seen = tokio::time::timeout(WAIT, async {
        loop {
            simulated.inject_xid(&gpu, 79)?; // 79: fallen off the bus, critical
            let unhealthy = node
                .kubelet
                .wait_for("GPU and its units unhealthy", Duration::from_millis(200), |v| {
                    v.devices_of(GPU).iter().any(|d| d.id == gpu.as_str() && d.health != HEALTHY)
                        && unit_health(v, gpu.as_str()).iter().all(|s| *s != HEALTHY)
                })
                .await;
            if let Ok(view) = unhealthy {
                return Ok::<_, anyhow::Error>(view);
            }
        }
    })
    .await??;
    assert!(unit_health(&seen, gpu.as_str()).iter().all(|s| *s != HEALTHY));
    // The metrics say why.
    let text = http_get(agent.metrics_address().context("metrics")?, "/metrics").await?.1;
    let labels = [("gpu_uuid", gpu.as_str()), ("reason", "critical XID 79")];
    assert_eq!(sample(&text, "baleen_gpu_unhealthy_reason", &labels), Some(1.0), "{text}");
    assert_eq!(sample(&text, "baleen_gpu_healthy", &[("gpu_uuid", gpu.as_str())]), Some(0.0));
    stop(agent, token).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpus_are_answered_as_cdi_names_the_spec_holds_else_by_volume_mounts() -> Result<()> {
    // A spec that lacks one GPU (the pain of nvidia-container-toolkit#1895): the agent says so
    // at start, answers that GPU's grants with volume-mounts (never a CDI name the runtime
    // cannot resolve) and counts them; the toolkit's configuration, mounted, says the variable
    // is refused for unprivileged containers.
    let expected = example("l4-4x-pcie.yaml")?;
    let node = Node::new("l4-4x-pcie.yaml", Backend::Simulated).await?;
    let missing = expected.gpus[3].uuid.to_string();
    let spec_dir = node.config.devices.cdi_spec_dirs[1].clone();
    write_cdi_spec(&spec_dir, &expected, std::slice::from_ref(&missing))?;
    let toolkit = node.config.devices.toolkit_config.clone();
    std::fs::create_dir_all(toolkit.parent().context("dir")?)?;
    std::fs::write(
        &toolkit,
        "accept-nvidia-visible-devices-envvar-when-unprivileged = false\naccept-nvidia-visible-devices-as-volume-mounts = true\n",
    )?;
    let (agent, token) = node.start().await?;
    node.registered(&agent, 1).await?;
    let named =
        node.kubelet.allocate_raw(GPU, vec![vec![expected.gpus[0].uuid.to_string()]]).await?;
    let named = &named.container_responses[0];
    assert_eq!(cdi_names(named), [format!("nvidia.com/gpu={}", expected.gpus[0].uuid)]);
    assert!(named.mounts.is_empty(), "{named:?}");
    let fallback = node.kubelet.allocate_raw(GPU, vec![vec![missing.clone()]]).await?;
    let fallback = &fallback.container_responses[0];
    assert!(fallback.cdi_devices.is_empty(), "never a name the spec lacks: {fallback:?}");
    assert_eq!(fallback.envs["NVIDIA_VISIBLE_DEVICES"], "/var/run/nvidia-container-devices");
    let mount = fallback.mounts.first().context("a device mount")?;
    assert_eq!(mount.container_path, format!("/var/run/nvidia-container-devices/{missing}"));
    assert_eq!((mount.host_path.as_str(), mount.read_only), ("/dev/null", true));
    let text = http_get(agent.metrics_address().context("metrics")?, "/metrics").await?.1;
    assert_eq!(sample(&text, "baleen_device_list_fallbacks_total", &[]), Some(1.0), "{text}");
    let state = |check: &str, state: &str| {
        sample(&text, "baleen_device_isolation", &[("check", check), ("state", state)])
    };
    assert_eq!(state("strategy", "ok"), Some(1.0), "{text}");
    assert_eq!(state("cdi-spec", "failed"), Some(1.0));
    assert_eq!(state("cdi-spec", "ok"), Some(0.0));
    assert_eq!(state("toolkit-envvar", "ok"), Some(1.0));
    assert_eq!(state("toolkit-volume-mounts", "ok"), Some(1.0), "fallbacks need it");
    stop(agent, token).await
}

async fn mig_views(backend: Backend) -> Result<()> {
    let node = Node::new("a100-4x-mig.yaml", backend).await?;
    let (agent, token) = node.start().await?;
    let view = node.registered(&agent, 1).await?;
    let mut names: Vec<&str> = agent.plugins().iter().map(|(r, _)| r.as_str()).collect();
    names.sort_unstable();
    assert_eq!(
        names,
        [
            GPU,
            MEM,
            "awesome-ai-company.com/mig-1g.10gb",
            "awesome-ai-company.com/mig-3g.40gb",
            "awesome-ai-company.com/mig-7g.80gb",
            "awesome-ai-company.com/nvlink-group-2",
        ]
    );
    assert_eq!(view.healthy("awesome-ai-company.com/mig-1g.10gb").len(), 2);
    assert_eq!(view.healthy(GPU).len(), 2, "the MIG GPUs are not whole GPUs");
    let mig = node.kubelet.admit_to("ns/m", "c", "awesome-ai-company.com/mig-1g.10gb", 1).await?;
    assert!(mig.device_ids[0].starts_with("MIG-"));
    assert_eq!(cdi_names(&mig.response), [format!("nvidia.com/gpu={}", mig.device_ids[0])]);
    stop(agent, token).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn simulated_mig_views_register_and_allocate() -> Result<()> {
    mig_views(Backend::Simulated).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fake_nvml_mig_views_register_and_allocate() -> Result<()> {
    mig_views(Backend::FakeNvml).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn devices_of_a_running_container_are_not_handed_out_again() -> Result<()> {
    let node = Node::new("l4-4x-pcie.yaml", Backend::Simulated).await?;
    let (agent, token) = node.start().await?;
    node.registered(&agent, 1).await?;
    let a = node.kubelet.admit_to("ns/a", "c", MEM, 4).await?;
    let gpu = gpu_of(&a.device_ids[0]).to_owned();
    let units = |r: std::ops::Range<u32>| r.map(|n| format!("{gpu}::{n}")).collect::<Vec<_>>();
    assert_eq!(a.device_ids, units(0..4));
    // A kubelet that lost its books hands units 2..6 to another container while ns/a runs:
    // the agent asks pod-resources and refuses.
    let err = node.kubelet.allocate_raw(MEM, vec![units(2..6)]).await.expect_err("still in use");
    let AdmitError::Rpc(status) = err else { panic!("expected a gRPC error, got {err}") };
    assert_eq!(status.code(), Code::FailedPrecondition);
    assert!(status.message().contains("running container ns/a/c"), "{status:?}");
    assert_eq!(agent.resources().records().len(), 1);
    // Once ns/a has ended, the same request replaces its allocation.
    node.kubelet.end_pod("ns/a");
    node.kubelet.allocate_raw(MEM, vec![units(2..6)]).await?;
    let records = agent.resources().records();
    assert_eq!(records.len(), 1);
    assert_eq!(records[0].device_ids, units(2..6));
    stop(agent, token).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_init_containers_units_are_reused_by_the_app_container() -> Result<()> {
    let node = Node::new("h200-8x-nvswitch.yaml", Backend::Simulated).await?;
    let (agent, token) = node.start().await?;
    node.registered(&agent, 1).await?;
    // Another pod already uses part of one GPU, so packing has a preference to show.
    node.kubelet.admit_to("ns/other", "c", MEM, 100).await?;
    // The init container (not in pod-resources, as the kubelet omits init containers).
    let init = node.kubelet.admit(MEM, 4).await?;
    let gpu = gpu_of(&init.device_ids[0]).to_owned();
    // The app container asks for more: the kubelet must include the init container's units.
    let app = node.kubelet.admit_reusing(MEM, 10, &init.device_ids).await?;
    assert!(init.device_ids.iter().all(|id| app.device_ids.contains(id)), "{app:?}");
    assert!(app.device_ids.iter().all(|id| gpu_of(id) == gpu), "all on the init's GPU: {app:?}");
    let records: Vec<Vec<String>> = agent
        .resources()
        .records()
        .into_iter()
        .filter(|r| r.device_ids.iter().any(|id| init.device_ids.contains(id)))
        .map(|r| r.device_ids)
        .collect();
    let mut expected = app.device_ids.clone();
    expected.sort();
    assert_eq!(records, [expected], "the app container's allocation replaced the init one");
    // A second app container needing fewer than the init container had: a subset, no question.
    let init2 = node.kubelet.admit(MEM, 6).await?;
    let small = node.kubelet.admit_reusing(MEM, 2, &init2.device_ids).await?;
    assert_eq!(small.preferred, None, "the kubelet does not ask when reuse suffices");
    assert_eq!(small.device_ids, init2.device_ids[..2]);
    assert_eq!(agent.resources().records().len(), 3);
    stop(agent, token).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_health_watch_marks_every_gpu_unhealthy() -> Result<()> {
    let expected = example("l4-4x-pcie.yaml")?;
    // NVML_ERROR_GPU_IS_LOST (15) from every wait, as when a GPU falls off the bus.
    let fake = FakeNvml::with_directives(&expected, &["fail nvmlEventSetWait_v2 * 15"])?;
    let mut node = Node::new("l4-4x-pcie.yaml", Backend::Simulated).await?;
    node.inventory = Arc::new(NvmlInventory::new(fake.nvml_config())?);
    node.nvml = Some(fake);
    let (agent, token) = node.start().await?;
    node.registered(&agent, 1).await?;
    node.kubelet
        .wait_for("every GPU unhealthy", WAIT, |v| {
            v.devices_of(GPU).len() == 4
                && v.healthy(GPU).is_empty()
                && v.healthy(MEM).is_empty()
                && !v.devices_of(MEM).is_empty()
        })
        .await?;
    // Each failed wait is counted, by NVML function, on /metrics.
    let address = agent.metrics_address().context("metrics")?;
    let text = http_get(address, "/metrics").await?.1;
    let failed =
        sample(&text, "baleen_nvml_call_failures_total", &[("call", "nvmlEventSetWait_v2")]);
    assert!(failed.is_some_and(|n| n >= 1.0), "{failed:?}");
    stop(agent, token).await
}

/// Issue 11, item 3: an agent stopped while it waits for pod-resources (no trusted checkpoint)
/// writes nothing, so that the next start waits for the kubelet again instead of trusting an
/// empty ledger and handing out the GPUs of running containers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stopped_while_waiting_for_pod_resources_writes_no_checkpoint() -> Result<()> {
    let mut node = Node::new("l4-4x-pcie.yaml", Backend::Simulated).await?;
    let (agent, token) = node.start().await?;
    node.registered(&agent, 1).await?;
    let held = node.kubelet.admit_to("ns/a", "c", GPU, 1).await?;
    stop(agent, token).await?;
    // A corrupted checkpoint (or a reboot): the kubelet is the only record of ns/a, and it does
    // not answer. The agent is stopped while it waits.
    std::fs::write(node.checkpoint(), "torn")?;
    node.kubelet.stop_pod_resources();
    let token = CancellationToken::new();
    token.cancel();
    let stopped = tokio::time::timeout(
        WAIT,
        Agent::start(
            node.config.clone(),
            Dependencies {
                inventory: node.inventory.clone(),
                registry: Default::default(),
                node_api: None,
            },
            token.clone(),
        ),
    )
    .await?;
    assert!(
        matches!(stopped, Err(baleen_agent::run::AgentError::StoppedBeforeStart)),
        "stopped before serving anything"
    );
    assert_eq!(std::fs::read_to_string(node.checkpoint())?, "torn", "nothing written");
    // The kubelet answers again: the next start restores ns/a from it, not from an empty ledger.
    node.kubelet.serve_pod_resources(&node.config.pod_resources_socket)?;
    let (agent, token) = node.start().await?;
    let records = agent.resources().records();
    assert_eq!(records.len(), 1, "{records:?}");
    assert_eq!(records[0].device_ids, held.device_ids);
    stop(agent, token).await
}

/// Issue 11, item 2: a request for exactly the devices a listed, running container holds (a
/// kubelet that lost its books) is refused, not taken for an init container's repeat; and when
/// pod-resources cannot say whether the holder still runs, the Allocate is refused (Unavailable)
/// rather than granted on trust.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exact_repeat_of_a_running_containers_devices_is_refused() -> Result<()> {
    let mut node = Node::new("l4-4x-pcie.yaml", Backend::Simulated).await?;
    let (agent, token) = node.start().await?;
    node.registered(&agent, 1).await?;
    let a = node.kubelet.admit_to("ns/a", "c", GPU, 1).await?;
    let err =
        node.kubelet.allocate_raw(GPU, vec![a.device_ids.clone()]).await.expect_err("ns/a runs");
    let AdmitError::Rpc(status) = err else { panic!("expected a gRPC error, got {err}") };
    assert_eq!(status.code(), Code::FailedPrecondition);
    assert!(status.message().contains("running container ns/a/c"), "{status:?}");
    // The same for gpu-memory units.
    let b = node.kubelet.admit_to("ns/b", "c", MEM, 3).await?;
    let err = node.kubelet.allocate_raw(MEM, vec![b.device_ids.clone()]).await.expect_err("runs");
    let AdmitError::Rpc(status) = err else { panic!("expected a gRPC error, got {err}") };
    assert_eq!(status.code(), Code::FailedPrecondition);
    // pod-resources gone: no repeat and no replacement is granted on trust.
    node.kubelet.stop_pod_resources();
    let err = node.kubelet.allocate_raw(GPU, vec![a.device_ids.clone()]).await.expect_err("unsure");
    let AdmitError::Rpc(status) = err else { panic!("expected a gRPC error, got {err}") };
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert!(status.message().contains("pod-resources"), "{status:?}");
    // Fresh devices need no question and are still granted.
    let fresh = node.kubelet.admit_to("ns/c", "c", GPU, 1).await?;
    assert_ne!(fresh.device_ids, a.device_ids);
    // Once ns/a has ended (and pod-resources answers), its GPU may be given again.
    node.kubelet.serve_pod_resources(&node.config.pod_resources_socket)?;
    node.kubelet.end_pod("ns/a");
    node.kubelet.allocate_raw(GPU, vec![a.device_ids.clone()]).await?;
    assert_eq!(agent.resources().records().len(), 3);
    stop(agent, token).await
}

/// Lets the reconciliation pass now under way finish: holds the next pod-resources `List` and
/// waits until it is asked (the reconciler asks only after it has applied or dropped the last
/// one), then lets it answer.
async fn next_pass(node: &Node) -> Result<()> {
    let mut held = node.kubelet.hold_next_list();
    held.asked(WAIT).await?;
    held.release();
    Ok(())
}

/// Issue 11, item 4: a pod-resources list asked before an Allocate and answered after it is not
/// applied. Here it would restore an ended pod's units over the new grant that replaced them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_list_does_not_restore_an_ended_pod_over_a_new_grant() -> Result<()> {
    let node = Node::new("l4-4x-pcie.yaml", Backend::Simulated).await?;
    let (agent, token) = node.start().await?;
    node.registered(&agent, 1).await?;
    let a = node.kubelet.admit_to("ns/a", "c", MEM, 4).await?;
    let gpu = gpu_of(&a.device_ids[0]).to_owned();
    let units = |r: std::ops::Range<u32>| r.map(|n| format!("{gpu}::{n}")).collect::<Vec<_>>();
    // The reconciler asks; the kubelet's answer (ns/a holds units 0..4) is held on its way.
    let mut stale = node.kubelet.hold_next_list();
    stale.asked(WAIT).await?;
    // Meanwhile ns/a ends and another container is given units 2..6, replacing ns/a's grant.
    node.kubelet.end_pod("ns/a");
    node.kubelet.allocate_raw(MEM, vec![units(2..6)]).await?;
    // The stale answer arrives, then the reconciler asks again.
    let mut after = node.kubelet.hold_next_list();
    stale.release();
    after.asked(WAIT).await?;
    let records: Vec<Vec<String>> =
        agent.resources().records().into_iter().map(|r| r.device_ids).collect();
    assert_eq!(records, [units(2..6)], "the new grant stands; ns/a is not restored over it");
    after.release();
    stop(agent, token).await
}

/// Issue 11, item 4: a stale list does not mark a fresh init-container grant of the same devices
/// as listed (which would release it as soon as the next list, which omits init containers,
/// came).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_list_does_not_mark_a_fresh_grant_listed() -> Result<()> {
    let mut node = Node::new("l4-4x-pcie.yaml", Backend::Simulated).await?;
    // The init container's grant must outlive the passes below however slow the machine is.
    node.config.reconcile_grace = Duration::from_secs(600);
    let (agent, token) = node.start().await?;
    node.registered(&agent, 1).await?;
    let a = node.kubelet.admit_to("ns/a", "c", GPU, 1).await?;
    next_pass(&node).await?;
    next_pass(&node).await?;
    assert!(agent.resources().records().iter().all(|r| r.listed), "ns/a seen in the list");
    let mut stale = node.kubelet.hold_next_list();
    stale.asked(WAIT).await?;
    // ns/a ends; an init container of another pod is given exactly ns/a's GPU.
    node.kubelet.end_pod("ns/a");
    node.kubelet.allocate_raw(GPU, vec![a.device_ids.clone()]).await?;
    let mut after = node.kubelet.hold_next_list();
    stale.release();
    after.asked(WAIT).await?;
    let records = agent.resources().records();
    assert_eq!(records.len(), 1);
    assert!(!records[0].listed, "the init container's grant is not taken for ns/a's: {records:?}");
    after.release();
    // Passes go on: the grant is kept for the grace, not released.
    next_pass(&node).await?;
    next_pass(&node).await?;
    assert_eq!(agent.resources().records().len(), 1);
    stop(agent, token).await
}

/// Issue 11, item 6: one list that misses a running container (a kubelet answering before it has
/// synced its pods) does not release its GPU; two in a row do.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_list_missing_a_container_does_not_release_it() -> Result<()> {
    let node = Node::new("l4-4x-pcie.yaml", Backend::Simulated).await?;
    let (agent, token) = node.start().await?;
    node.registered(&agent, 1).await?;
    node.kubelet.admit_to("ns/a", "c", GPU, 1).await?;
    next_pass(&node).await?;
    next_pass(&node).await?;
    assert!(agent.resources().records().iter().all(|r| r.listed));
    // The kubelet leaves ns/a out of exactly one answer.
    node.kubelet.omit_from_next_list("ns/a");
    next_pass(&node).await?;
    // The next list is asked only once the one without ns/a has been applied.
    let mut applied = node.kubelet.hold_next_list();
    applied.asked(WAIT).await?;
    assert_eq!(agent.resources().records().len(), 1, "one miss keeps the GPU held");
    applied.release();
    // A pod that really ended is released after the second miss.
    node.kubelet.end_pod("ns/a");
    next_pass(&node).await?;
    next_pass(&node).await?;
    next_pass(&node).await?;
    assert!(agent.resources().records().is_empty());
    stop(agent, token).await
}

/// Issue 11, item 5: a second agent on the node (a rolling update with surge) waits for the
/// first to exit and never touches its sockets or checkpoint; a copy with another state
/// directory cannot take the first one's sockets and stops.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_agent_waits_and_never_steals_the_first_ones_sockets() -> Result<()> {
    let node = Node::new("l4-4x-pcie.yaml", Backend::Simulated).await?;
    let (first, first_token) = node.start().await?;
    let view = node.registered(&first, 1).await?;
    let a = node.kubelet.admit_to("ns/a", "c", GPU, 1).await?;
    let second_token = CancellationToken::new();
    let second = tokio::spawn(Agent::start(
        node.config.clone(),
        Dependencies {
            inventory: node.inventory.clone(),
            registry: Default::default(),
            node_api: None,
        },
        second_token.clone(),
    ));
    // It waits (a bounded look for something that must not happen).
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert!(!second.is_finished(), "the second agent waits for the lock");
    assert_eq!(node.kubelet.view().registrations, view.registrations, "no registration stolen");
    // The first exits; the second takes over with its allocations.
    stop(first, first_token).await?;
    let second = tokio::time::timeout(WAIT, second).await???;
    node.registered(&second, 2).await?;
    let records = second.resources().records();
    assert_eq!(records.len(), 1);
    assert_eq!(records[0].device_ids, a.device_ids);
    // A copy run by hand with its own state directory cannot take the serving agent's sockets.
    let registered = node.kubelet.view().registrations;
    let mut stray = node.config.clone();
    stray.state_dir = node.config.state_dir.with_extension("stray");
    let stray_agent = tokio::time::timeout(
        WAIT,
        Agent::start(
            stray,
            Dependencies {
                inventory: node.inventory.clone(),
                registry: Default::default(),
                node_api: None,
            },
            CancellationToken::new(),
        ),
    )
    .await??;
    let err = tokio::time::timeout(WAIT, stray_agent.wait()).await?.expect_err("stops");
    assert!(format!("{:#}", anyhow::Error::new(err)).contains("another live process"));
    let after = node.kubelet.view();
    assert_eq!(after.registrations, registered, "the stray copy registered nothing");
    assert!(after.streaming.len() >= 2, "the serving agent still streams: {}", after.summary());
    assert_eq!(second.resources().records().len(), 1);
    stop(second, second_token).await
}

/// Issue 11, item 1: a start whose configuration or GPUs would change what held device IDs
/// mean (another memory unit, a dropped NVLink group size, groups renumbered by a GPU entering
/// MIG mode) is refused as a configuration error, the checkpoint untouched; the unchanged
/// configuration starts with every allocation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_configuration_that_changes_held_device_ids_is_refused() -> Result<()> {
    let node = Node::new("h200-8x-nvswitch.yaml", Backend::Simulated).await?;
    let (agent, token) = node.start().await?;
    node.registered(&agent, 1).await?;
    node.kubelet.admit_to("ns/a", "c", MEM, 8).await?;
    let group =
        node.kubelet.admit_to("ns/g", "c", "awesome-ai-company.com/nvlink-group-2", 1).await?;
    stop(agent, token).await?;
    let journal = node.config.state_dir.join(baleen_agent::checkpoint::JOURNAL_FILE_NAME);
    let saved = (std::fs::read(node.checkpoint())?, std::fs::read(&journal)?);
    let start = |config: AgentConfig, inventory: Arc<dyn GpuInventory>| async move {
        let token = CancellationToken::new();
        let started = tokio::time::timeout(
            WAIT,
            Agent::start(
                config,
                Dependencies { inventory, registry: Default::default(), node_api: None },
                token.clone(),
            ),
        )
        .await?;
        anyhow::Ok((started, token))
    };
    let refused = |started: std::result::Result<Agent, baleen_agent::run::AgentError>| {
        let err = started.err().context("refused")?;
        assert!(err.is_configuration(), "exit 64: {err}");
        anyhow::Ok(err.to_string())
    };
    // Another memory unit.
    let mut config = node.config.clone();
    config.views.memory_unit_bytes = 512 << 20;
    let text = refused(start(config, node.inventory.clone()).await?.0)?;
    assert!(text.contains("memory unit is now 536870912 bytes"), "{text}");
    // The held group's size no longer offered.
    let mut config = node.config.clone();
    config.views.nvlink_group_sizes = vec![4, 8];
    let text = refused(start(config, node.inventory.clone()).await?.0)?;
    assert!(text.contains("does not offer awesome-ai-company.com/nvlink-group-2"), "{text}");
    // GPU 1 in MIG mode: nvlink2-<GPU 0> would name GPUs 0 and 2.
    let mut inventory = example("h200-8x-nvswitch.yaml")?;
    inventory.gpus[1].mig = baleen_agent::inventory::MigState::Enabled { instances: vec![] };
    let text =
        refused(start(node.config.clone(), Arc::new(SimulatedInventory::new(inventory))).await?.0)?;
    assert!(text.contains(&format!("NVLink group {}", group.device_ids[0])), "{text}");
    let now = (std::fs::read(node.checkpoint())?, std::fs::read(&journal)?);
    assert_eq!(now, saved, "the checkpoint and its journal are left as they were");
    // The configuration it was written with starts, with both allocations.
    let (agent, token) = node.start().await?;
    assert_eq!(agent.resources().records().len(), 2);
    stop(agent, token).await
}

/// Issue 11, also found: a device-plugin directory too long for a Unix socket address is a
/// configuration error naming the paths, found before anything is bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn socket_paths_too_long_are_a_configuration_error() -> Result<()> {
    let node = Node::new("l4-4x-pcie.yaml", Backend::Simulated).await?;
    let mut config = node.config.clone();
    config.device_plugin_dir = node.config.device_plugin_dir.join("d".repeat(80));
    let err = tokio::time::timeout(
        WAIT,
        Agent::start(
            config,
            Dependencies {
                inventory: node.inventory.clone(),
                registry: Default::default(),
                node_api: None,
            },
            CancellationToken::new(),
        ),
    )
    .await?
    .err()
    .context("refused")?;
    assert!(err.is_configuration(), "{err}");
    let text = err.to_string();
    assert!(text.contains("longer than 107 bytes") && text.contains("gpu-memory.sock"), "{text}");
    Ok(())
}

/// Issue 11, also found: an Allocate of several containers that fails at one of them grants
/// none of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_multi_container_allocate_is_all_or_nothing() -> Result<()> {
    let node = Node::new("l4-4x-pcie.yaml", Backend::Simulated).await?;
    let (agent, token) = node.start().await?;
    node.registered(&agent, 1).await?;
    let whole = node.kubelet.admit_to("ns/x", "c", GPU, 1).await?;
    let taken = whole.device_ids[0].clone();
    let free =
        node.kubelet.view().healthy(GPU).into_iter().find(|g| *g != taken).context("free")?;
    let err = node
        .kubelet
        .allocate_raw(MEM, vec![vec![format!("{free}::0")], vec![format!("{taken}::0")]])
        .await
        .expect_err("the second container's GPU is held whole");
    let AdmitError::Rpc(status) = err else { panic!("expected a gRPC error, got {err}") };
    assert_eq!(status.code(), Code::FailedPrecondition);
    assert_eq!(agent.resources().records().len(), 1, "the first container got nothing either");
    // Both containers on free GPUs: both granted, answers in order.
    let other = node
        .kubelet
        .view()
        .healthy(GPU)
        .into_iter()
        .find(|g| *g != taken && *g != free)
        .context("x")?;
    let answer = node
        .kubelet
        .allocate_raw(MEM, vec![vec![format!("{free}::0")], vec![format!("{other}::0")]])
        .await?;
    assert_eq!(answer.container_responses.len(), 2);
    assert_eq!(cdi_names(&answer.container_responses[1]), [format!("nvidia.com/gpu={other}")]);
    assert_eq!(agent.resources().records().len(), 3);
    stop(agent, token).await
}

/// Issue 11, also found: when the health watch cannot even start, every GPU is advertised
/// Unhealthy (nothing would report a failed GPU) rather than Healthy for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_health_watch_that_cannot_start_leaves_no_gpu_healthy() -> Result<()> {
    let expected = example("l4-4x-pcie.yaml")?;
    let fake = FakeNvml::with_directives(&expected, &["fail nvmlEventSetCreate * 999"])?;
    let mut node = Node::new("l4-4x-pcie.yaml", Backend::Simulated).await?;
    node.inventory = Arc::new(NvmlInventory::new(fake.nvml_config())?);
    node.nvml = Some(fake);
    let (agent, token) = node.start().await?;
    node.registered(&agent, 1).await?;
    node.kubelet
        .wait_for("every GPU unhealthy", WAIT, |v| {
            v.devices_of(GPU).len() == 4 && v.healthy(GPU).is_empty() && v.healthy(MEM).is_empty()
        })
        .await?;
    stop(agent, token).await
}

// ---- Issue 12: the MPS supervisor, against the fake control binary ----

/// The MPS directory of a GPU (`<mps root>/<UUID>`): `pipe/`, `log/control.log`, and the fake's
/// `fake-directives`.
fn mps_dir(node: &Node, gpu: &str) -> PathBuf {
    node.config.mps.root.join(gpu)
}

fn directive(node: &Node, gpu: &str, word: &str) -> Result<()> {
    std::fs::create_dir_all(mps_dir(node, gpu))?;
    Ok(std::fs::write(mps_dir(node, gpu).join("fake-directives"), word)?)
}

fn control_log(node: &Node, gpu: &str) -> String {
    std::fs::read_to_string(mps_dir(node, gpu).join("log/control.log")).unwrap_or_default()
}

fn daemon_pid(node: &Node, gpu: &str) -> Result<i32> {
    let text =
        std::fs::read_to_string(mps_dir(node, gpu).join("pipe/nvidia-cuda-mps-control.pid"))?;
    Ok(text.trim().parse()?)
}

async fn units_are(node: &Node, gpu: &str, healthy: bool, what: &str) -> Result<KubeletView> {
    let gpu = gpu.to_owned();
    node.kubelet
        .wait_for(what, WAIT, move |v| {
            let units = unit_health(v, &gpu);
            !units.is_empty() && units.iter().all(|h| (*h == HEALTHY) == healthy)
        })
        .await
}

fn gpus(node: &Node) -> Vec<String> {
    let mut gpus: Vec<String> =
        node.kubelet.view().devices_of(GPU).iter().map(|d| d.id.clone()).collect();
    gpus.sort();
    gpus
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn units_wait_for_their_daemon_and_a_killed_daemon_withdraws_only_its_gpu() -> Result<()> {
    let mut node = Node::new("l4-4x-pcie.yaml", Backend::Simulated).await?;
    let expected = example("l4-4x-pcie.yaml")?;
    let refused = expected.gpus[1].uuid.to_string();
    // GPU 1's daemon will not start at first.
    directive(&node, &refused, "refuse")?;
    node.config.mps.probe_timeout = Duration::from_millis(500);
    let (agent, token) = node.start().await?;
    node.registered(&agent, 1).await?;
    units_are(&node, &refused, false, "GPU 1's units withheld while its daemon cannot start")
        .await?;
    for g in expected.gpus.iter().map(|g| g.uuid.to_string()).filter(|g| *g != refused) {
        units_are(&node, &g, true, "the other GPUs' units offered").await?;
        assert!(control_log(&node, &g).contains("started"), "a daemon per GPU");
    }
    // GPU 1's daemon can start now: after its backoff it does, and its units come.
    directive(&node, &refused, "")?;
    units_are(&node, &refused, true, "GPU 1's units offered once its daemon answers").await?;
    // A daemon killed: only its GPU's units go, then it is restarted and they return.
    let victim = expected.gpus[2].uuid.to_string();
    let pid = daemon_pid(&node, &victim)?;
    // (Its restart is held back until the withdrawal has been seen: a restart within a
    // millisecond could replace the Unhealthy list before the kubelet reads it.)
    directive(&node, &victim, "refuse")?;
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL)?;
    units_are(&node, &victim, false, "the killed daemon's GPU withdrawn").await?;
    units_are(&node, &refused, true, "the others untouched").await?;
    directive(&node, &victim, "")?;
    units_are(&node, &victim, true, "restarted, offered again").await?;
    assert_ne!(daemon_pid(&node, &victim)?, pid, "a new daemon");
    // A hung daemon times out the same way.
    directive(&node, &victim, "hang")?;
    units_are(&node, &victim, false, "the hung daemon's GPU withdrawn").await?;
    directive(&node, &victim, "")?;
    units_are(&node, &victim, true, "answering again").await?;
    stop(agent, token).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_agent_adopts_the_daemons_and_quits_them_only_when_told() -> Result<()> {
    let mut node = Node::new("l4-4x-pcie.yaml", Backend::Simulated).await?;
    let (agent, token) = node.start().await?;
    node.registered(&agent, 1).await?;
    let gpu = gpus(&node)[0].clone();
    units_are(&node, &gpu, true, "offered").await?;
    let pid = daemon_pid(&node, &gpu)?;
    stop(agent, token).await?;
    // Left serving (mps.stopOnExit false): no quit, same daemon.
    assert!(!control_log(&node, &gpu).contains("Cmd:quit"), "{}", control_log(&node, &gpu));
    let (agent, token) = node.start().await?;
    node.registered(&agent, 2).await?;
    units_are(&node, &gpu, true, "offered at once by the adopted daemon").await?;
    assert_eq!(daemon_pid(&node, &gpu)?, pid, "adopted, not started again");
    assert_eq!(control_log(&node, &gpu).matches("started").count(), 1, "one daemon ever");
    stop(agent, token).await?;
    // With stopOnExit, the agent tells its daemons to quit.
    node.config.mps.stop_on_exit = true;
    let (agent, token) = node.start().await?;
    node.registered(&agent, 3).await?;
    stop(agent, token).await?;
    let log = control_log(&node, &gpu);
    assert!(log.contains("Cmd:quit") && log.contains("exit"), "{log}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_control_binary_no_unit_is_offered_and_with_mps_off_they_are_accounting_only()
-> Result<()> {
    let mut node = Node::new("l4-4x-pcie.yaml", Backend::Simulated).await?;
    node.config.mps.control_binary = "/nonexistent/nvidia-cuda-mps-control".into();
    let (agent, token) = node.start().await?;
    node.registered(&agent, 1).await?;
    let view = node.kubelet.view();
    assert!(!view.devices_of(MEM).is_empty() && view.healthy(MEM).is_empty(), "{}", view.summary());
    assert_eq!(view.healthy(GPU).len(), 4, "whole GPUs need no MPS");
    stop(agent, token).await?;
    // MPS off: offered, and every answer says the limit is not enforced.
    node.config.mps.enabled = false;
    let (agent, token) = node.start().await?;
    node.registered(&agent, 2).await?;
    node.kubelet
        .wait_for("units offered without MPS", WAIT, |v| !v.healthy(MEM).is_empty())
        .await?;
    let a = node.kubelet.admit_to("ns/a", "c", MEM, 2).await?;
    assert_eq!(a.response.envs["BALEEN_GPU_SHARING"], "accounting-only");
    assert!(
        !a.response.envs.contains_key("CUDA_MPS_PIPE_DIRECTORY") && a.response.mounts.is_empty()
    );
    stop(agent, token).await
}

/// Issue 12, item 3: the daemons in a process of their own (`baleen-agent mps`, a DaemonSet an
/// agent upgrade does not restart); the agent with `mps.daemons: external` only probes: it
/// offers the units while the daemons answer, withdraws them when one dies (the MPS process
/// restarts it), and its own restarts never touch them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_mps_process_of_its_own_keeps_the_daemons_across_agent_restarts() -> Result<()> {
    let mut node = Node::new("l4-4x-pcie.yaml", Backend::Simulated).await?;
    let mps_stop = CancellationToken::new();
    let (mut config, inventory) = (node.config.clone(), node.inventory.discover()?);
    // The MPS process probes less often than the agent, so that the agent sees a killed daemon
    // before it is replaced.
    config.mps.probe_interval = Duration::from_secs(1);
    let mps_token = mps_stop.clone();
    let mps = tokio::spawn(async move {
        baleen_agent::run::mps::run_alone(&config, &inventory, mps_token).await
    });
    node.config.mps.daemons = baleen_agent::isolation::mps::DaemonPlacement::External;
    node.config.mps.stop_on_exit = true;
    let (agent, token) = node.start().await?;
    node.registered(&agent, 1).await?;
    let gpu = gpus(&node)[0].clone();
    units_are(&node, &gpu, true, "offered while the MPS process's daemon answers").await?;
    let pid = daemon_pid(&node, &gpu)?;
    // A daemon dies: the agent withdraws its units, the MPS process starts it again (held back
    // until the withdrawal has been seen).
    directive(&node, &gpu, "refuse")?;
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL)?;
    units_are(&node, &gpu, false, "withdrawn").await?;
    directive(&node, &gpu, "")?;
    units_are(&node, &gpu, true, "offered again").await?;
    let pid = daemon_pid(&node, &gpu)?;
    // The agent stops (even with stopOnExit, daemons it does not own are not told to quit) and
    // comes back: the same daemon.
    stop(agent, token).await?;
    assert!(!control_log(&node, &gpu).contains("Cmd:quit"));
    let (agent, token) = node.start().await?;
    node.registered(&agent, 2).await?;
    units_are(&node, &gpu, true, "offered by the same daemon").await?;
    assert_eq!(daemon_pid(&node, &gpu)?, pid);
    stop(agent, token).await?;
    mps_stop.cancel();
    tokio::time::timeout(WAIT, mps).await???;
    assert!(!control_log(&node, &gpu).contains("Cmd:quit"), "left serving");
    Ok(())
}

/// A pod bound to node-a whose container `container` runs as runtime ID `id` (as the kubelet
/// reports it in the pod's status), asking for `asks` of the gpu-memory resource.
fn running_pod(
    ns_name: &str,
    uid: &str,
    container: &str,
    id: &str,
    asks: u64,
) -> serde_json::Value {
    let (ns, name) = ns_name.split_once('/').expect("ns/name");
    let resources = if asks > 0 {
        serde_json::json!({"limits": {MEM: asks.to_string()}})
    } else {
        serde_json::json!({})
    };
    serde_json::json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": ns, "uid": uid},
        "spec": {"nodeName": "node-a", "containers": [{"name": container, "image": "cuda", "resources": resources}]},
        "status": {"phase": "Running", "qosClass": "BestEffort", "containerStatuses": [{
            "name": container, "image": "cuda", "imageID": "", "ready": true, "restartCount": 0,
            "containerID": format!("containerd://{id}"), "state": {"running": {}}}]}
    })
}

/// A process `pid` under `proc_root` in container `id` of pod `uid` (systemd driver, cgroup
/// v2), with `environ` as its environment.
fn fake_process(proc_root: &Path, pid: u32, uid: &str, id: &str, environ: &str) -> Result<()> {
    let dir = proc_root.join(pid.to_string());
    std::fs::create_dir_all(&dir)?;
    std::fs::write(
        dir.join("cgroup"),
        format!(
            "0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{}.slice/cri-containerd-{id}.scope\n",
            uid.replace('-', "_")
        ),
    )?;
    Ok(std::fs::write(dir.join("environ"), environ)?)
}

/// The watchdog's Events the fake API server received: `(reason, regarding name, note)`.
fn watchdog_events(
    api: &baleen_tests::fake_apiserver::FakeApiServer,
) -> Vec<(String, String, String)> {
    api.requests()
        .into_iter()
        .filter(|r| r.method == "POST" && r.path.ends_with("/events"))
        .map(|r| {
            let text =
                |p: &str| r.body.pointer(p).and_then(|v| v.as_str()).unwrap_or_default().to_owned();
            (text("/reason"), text("/regarding/name"), text("/note"))
        })
        .collect()
}

/// Issue 21, item 4 (and issue 12, item 7): the memory watchdog on the fake NVML, with the
/// API's pods and the kubelet's list. A process is held to the grant its cgroup leads to, with
/// its limit variable unset; a pod's process on a GPU its container holds nothing on is
/// reported (metric, Event on its pod); a container over its grant is announced, then killed
/// after the grace with an Event naming pod and container, and counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_watchdog_holds_processes_to_the_grant_their_cgroup_names_and_kills_after_the_grace()
-> Result<()> {
    let expected = example("l4-4x-pcie.yaml")?;
    let mut node = Node::new("l4-4x-pcie.yaml", Backend::FakeNvml).await?;
    let fake = node.nvml.take().context("the fake NVML")?;
    let proc_root = tempfile::tempdir()?;
    node.config.watchdog = baleen_agent::isolation::watchdog::WatchdogConfig {
        enabled: true,
        interval: Duration::from_millis(100),
        action: baleen_agent::isolation::watchdog::WatchdogAction::Kill,
        grace: Duration::from_millis(600),
        proc_root: proc_root.path().to_path_buf(),
    };
    let api = baleen_tests::fake_apiserver::FakeApiServer::start(&["node-a"]).await?;
    let (w_uid, w_id) = ("9f8e7d6c-0000-4000-8000-000000000001", "e".repeat(64));
    let (s_uid, s_id) = ("9f8e7d6c-0000-4000-8000-000000000002", "5".repeat(64));
    api.put_pod(running_pod("ns/w", w_uid, "c", &w_id, 4));
    api.put_pod(running_pod("ns/steal", s_uid, "x", &s_id, 0));
    let client = baleen_agent::kube_api::KubeNodeApi::at(&api.url())?;
    let (agent, token) = node.start_with(Some(client)).await?;
    node.registered(&agent, 1).await?;
    let granted = node.kubelet.admit_to("ns/w", "c", MEM, 4).await?;
    let gpu = gpu_of(&granted.device_ids[0]).to_owned();
    let index =
        u32::try_from(expected.gpus.iter().position(|g| g.uuid.as_str() == gpu).context("gpu")?)?;
    let other = (index + 1) % 4;
    // The grant's one process, a real one (it will be killed), with the limit variable unset:
    // 3 GiB of its 4 GiB, attributed all the same.
    let mut child = std::process::Command::new("sleep").arg("60").spawn()?;
    let pid = child.id();
    fake_process(proc_root.path(), pid, w_uid, &w_id, "HOME=/\0")?;
    // A pod that asked for nothing, using 7 GiB of another GPU (a fake PID: strays are never
    // killed), and a host process (the MPS server, say), left alone.
    fake_process(proc_root.path(), 3_999_001, s_uid, &s_id, "")?;
    let host = proc_root.path().join("3999002");
    std::fs::create_dir_all(&host)?;
    std::fs::write(host.join("cgroup"), "0::/system.slice/nvidia-mps.service\n")?;
    fake.set_processes(&[
        (index, pid, 3 << 30),
        (other, 3_999_001, 7 << 30),
        (index, 3_999_002, 66 << 20),
    ])?;
    let address = agent.metrics_address().context("metrics")?;
    let metric = |name: &'static str, labels: Vec<(&'static str, String)>, want: f64| async move {
        loop {
            let text = http_get(address, "/metrics").await?.1;
            let labels: Vec<(&str, &str)> = labels.iter().map(|(k, v)| (*k, v.as_str())).collect();
            if sample(&text, name, &labels) == Some(want) {
                return anyhow::Ok(());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    let used = metric(
        "baleen_grant_memory_used_bytes",
        vec![("pod", "w".into()), ("gpu_uuid", gpu.clone())],
        (3u64 << 30) as f64,
    );
    tokio::time::timeout(WAIT, used).await.context("the grant's usage")??;
    let other_gpu = expected.gpus[other as usize].uuid.to_string();
    let stray = metric(
        "baleen_gpu_processes_without_grant",
        vec![("gpu_uuid", other_gpu.clone()), ("reason", "no-grant".into())],
        1.0,
    );
    tokio::time::timeout(WAIT, stray).await.context("the stray")??;
    let strays = agent.strays().borrow().clone();
    assert_eq!(strays.len(), 1, "the host process is nobody's: {strays:?}");
    assert_eq!(strays[0].pod, Some(("ns".into(), "steal".into())));
    assert!(child.try_wait()?.is_none(), "within its grant: alive");
    // It goes over (5 of 4 GiB): announced, killed after the grace, counted.
    fake.set_processes(&[(index, pid, 5 << 30), (other, 3_999_001, 7 << 30)])?;
    let status =
        tokio::time::timeout(WAIT, tokio::task::spawn_blocking(move || child.wait())).await???;
    assert_eq!(std::os::unix::process::ExitStatusExt::signal(&status), Some(9), "SIGKILL");
    let kills = metric("baleen_watchdog_killed_processes_total", vec![], 1.0);
    tokio::time::timeout(WAIT, kills).await.context("the kill counted")??;
    let events = async {
        loop {
            let events = watchdog_events(&api);
            if events.iter().any(|e| e.0 == "GpuMemoryOverGrantKilled") {
                return events;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    let events = tokio::time::timeout(WAIT, events).await.context("the Events")?;
    let reasons: Vec<(&str, &str)> = events.iter().map(|e| (e.0.as_str(), e.1.as_str())).collect();
    assert_eq!(
        reasons,
        [
            ("GpuProcessWithoutGrant", "steal"),
            ("GpuMemoryOverGrant", "w"),
            ("GpuMemoryOverGrantKilled", "w")
        ],
        "{events:?}"
    );
    assert!(
        events[2].2.contains(&format!("container c: processes [{pid}] killed")),
        "{}",
        events[2].2
    );
    assert!(events[0].2.contains("holds no grant"), "{}", events[0].2);
    stop(agent, token).await
}

/// Issue 21, item 4: the watchdog needs the API's pods; without an API it refuses to start
/// rather than judge nothing in silence.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_watchdog_without_the_api_is_a_start_error() -> Result<()> {
    let mut node = Node::new("l4-4x-pcie.yaml", Backend::Simulated).await?;
    node.config.watchdog.enabled = true;
    let err = node.start().await.err().context("refused")?;
    assert!(err.to_string().contains("watchdog.enabled"), "{err:#}");
    Ok(())
}

/// Issue 12, item 6: `baleen-agent inventory` says, per shared GPU, whether its MPS daemon
/// answers, and why not.
#[test]
fn inventory_says_whether_each_mps_daemon_answers() -> Result<()> {
    let root = tempfile::tempdir()?;
    let fake = PathBuf::from(env!("CARGO_BIN_EXE_fake-mps-control"));
    let gpu = "GPU-11111111-2222-3333-4444-555555555555".to_owned();
    let status =
        baleen_agent::cli::inventory::mps_status(std::slice::from_ref(&gpu), root.path(), &fake);
    assert!(!status[0].answering);
    assert!(
        status[0].reason.as_deref().is_some_and(|r| r.contains("Cannot find MPS control daemon"))
    );
    let dirs = root.path().join(&gpu);
    let started = std::process::Command::new(&fake)
        .arg("-d")
        .env("CUDA_MPS_PIPE_DIRECTORY", dirs.join("pipe"))
        .env("CUDA_MPS_LOG_DIRECTORY", dirs.join("log"))
        .status()?;
    assert!(started.success());
    let status = baleen_agent::cli::inventory::mps_status(&[gpu], root.path(), &fake);
    assert!(status[0].answering, "{status:?}");
    let missing = baleen_agent::cli::inventory::mps_status(
        &["GPU-x".to_owned()],
        root.path(),
        Path::new("/nonexistent/nvidia-cuda-mps-control"),
    );
    assert!(
        missing[0]
            .reason
            .as_deref()
            .is_some_and(|r| r.contains("cannot run the MPS control binary"))
    );
    Ok(())
}

// ---- Issue 13 (first part): the metrics endpoint ----

/// A plain HTTP/1.1 GET on loopback: the status code and the body. A scrape of `/metrics` is
/// also checked against docs/metrics.md ([`documented`]), so every test that scrapes holds the
/// page to the families it sees.
async fn http_get(address: std::net::SocketAddr, path: &str) -> Result<(u16, String)> {
    let (code, body) =
        tokio::time::timeout(WAIT, baleen_tests::http::request(address, "GET", path, "")).await??;
    if path == "/metrics" && code == 200 {
        documented(&body)?;
    }
    Ok((code, body))
}

/// Issue 23, step 5: every family of a scrape (its `# TYPE` line) has a row in docs/metrics.md.
fn documented(scrape: &str) -> Result<()> {
    let page = Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/metrics.md");
    let page = std::fs::read_to_string(&page).with_context(|| format!("{}", page.display()))?;
    let missing: Vec<&str> = scrape
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_whitespace().next())
        .filter(|family| !page.contains(&format!("`{family}`")))
        .collect();
    anyhow::ensure!(missing.is_empty(), "families without a row in docs/metrics.md: {missing:?}");
    // Every series carries `node`, as the page says.
    let nodeless: Vec<&str> =
        scrape.lines().filter(|l| l.starts_with("baleen_") && !l.contains("node=\"")).collect();
    anyhow::ensure!(nodeless.is_empty(), "series without a node label: {nodeless:?}");
    Ok(())
}

#[test]
fn a_family_missing_from_docs_metrics_md_is_caught() {
    let scrape =
        "# HELP baleen_gpu_info x\n# TYPE baleen_gpu_info gauge\nbaleen_gpu_info{node=\"n\"} 1\n";
    assert!(documented(scrape).is_ok());
    let err = documented("# TYPE baleen_gpu_info gauge\nbaleen_gpu_info 1\n").expect_err("no node");
    assert!(err.to_string().contains("without a node label"), "{err}");
    let scrape = "# TYPE baleen_no_such_family gauge\nbaleen_no_such_family 1\n";
    let err = documented(scrape).expect_err("undocumented");
    assert!(err.to_string().contains("baleen_no_such_family"), "{err}");
}

/// The value of the series whose line starts with `prefix` (`name{labels}`), if any.
fn sample(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    text.lines().filter(|l| l.starts_with(name) && !l.starts_with('#')).find_map(|l| {
        let (series, value) = l.rsplit_once(' ')?;
        let wanted = labels.iter().all(|(k, v)| series.contains(&format!("{k}=\"{v}\"")));
        (series.split('{').next() == Some(name) && wanted).then(|| value.parse().ok()).flatten()
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_metrics_endpoint_follows_grants_releases_and_readiness() -> Result<()> {
    let node = Node::new("l4-4x-pcie.yaml", Backend::Simulated).await?;
    let (agent, token) = node.start().await?;
    node.registered(&agent, 1).await?;
    let address = agent.metrics_address().context("metrics on")?;
    assert_eq!(http_get(address, "/healthz").await?.0, 200);
    // Ready once every resource is registered and every MPS daemon answers.
    let ready = async {
        loop {
            if http_get(address, "/readyz").await?.0 == 200 {
                return anyhow::Ok(());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::time::timeout(WAIT, ready).await??;
    let a = node.kubelet.admit_to("ns/a", "c", MEM, 4).await?;
    let gpu = gpu_of(&a.device_ids[0]).to_owned();
    let (status, text) = http_get(address, "/metrics").await?;
    assert_eq!(status, 200);
    assert_eq!(
        sample(&text, "baleen_resource_allocated_devices", &[("resource", MEM)]),
        Some(4.0),
        "{text}"
    );
    assert_eq!(
        sample(&text, "baleen_gpu_memory_granted_bytes", &[("gpu_uuid", &gpu)]),
        Some((4u64 << 30) as f64)
    );
    assert_eq!(
        sample(&text, "baleen_gpu_mode", &[("gpu_uuid", &gpu), ("mode", "shared")]),
        Some(1.0)
    );
    assert_eq!(sample(&text, "baleen_gpu_mps_daemon_up", &[("gpu_uuid", &gpu)]), Some(1.0));
    // The agent's own measurements.
    let count = |text: &str, name: &str, labels: &[(&str, &str)]| sample(text, name, labels);
    assert_eq!(count(&text, "baleen_allocate_seconds_count", &[("resource", MEM)]), Some(1.0));
    assert!(count(&text, "baleen_checkpoint_write_seconds_count", &[]).is_some_and(|n| n >= 1.0));
    assert_eq!(count(&text, "baleen_kubelet_registrations_total", &[("resource", MEM)]), Some(1.0));
    let reconciled = async {
        loop {
            let text = http_get(address, "/metrics").await?.1;
            if count(&text, "baleen_reconciliations_total", &[("outcome", "applied")])
                .is_some_and(|n| n >= 1.0)
            {
                return anyhow::Ok(());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    tokio::time::timeout(WAIT, reconciled).await??;
    let other = node.kubelet.view().healthy(GPU).into_iter().find(|g| *g != gpu).context("gpu")?;
    let split = vec![format!("{gpu}::10"), format!("{other}::0")];
    assert!(node.kubelet.allocate_raw(MEM, vec![split]).await.is_err());
    // (A scrape may share a render up to 100 ms old: asked again past that.)
    tokio::time::sleep(baleen_agent::metrics::MIN_RENDER_INTERVAL).await;
    let text = http_get(address, "/metrics").await?.1;
    assert_eq!(
        count(&text, "baleen_refusals_total", &[("resource", MEM), ("kind", "invalid")]),
        Some(1.0),
        "{text}"
    );
    // The daemon's clients, as its server list says (two clients of one server here).
    std::fs::write(mps_dir(&node, &gpu).join("fake-servers"), "4242\n")?;
    std::fs::write(mps_dir(&node, &gpu).join("fake-clients-4242"), "101\n102\n")?;
    let counted = async {
        loop {
            let text = http_get(address, "/metrics").await?.1;
            if sample(&text, "baleen_gpu_mps_clients", &[("gpu_uuid", gpu.as_str())]) == Some(2.0) {
                return anyhow::Ok(());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    tokio::time::timeout(WAIT, counted).await??;
    let text = http_get(address, "/metrics").await?.1;
    // 22 units on an L4: 18 left on the shared GPU.
    assert_eq!(
        sample(&text, "baleen_gpu_memory_units_largest_free", &[("gpu_uuid", &gpu)]),
        Some(18.0)
    );
    assert_eq!(
        sample(&text, "baleen_gpu_info", &[("gpu_uuid", &gpu), ("node", "node-a")]),
        Some(1.0)
    );
    // Fragmentation against the one grant's shape (4 of 22 units, 0.181 GPU): the 18 units
    // left (0.818 GPU) can take it, so nothing is fragmented.
    assert_eq!(sample(&text, "baleen_node_fragmentation_target_grants", &[]), Some(1.0));
    assert_eq!(sample(&text, "baleen_node_fragmentation_gpus", &[("node", "node-a")]), Some(0.0));
    assert_eq!(sample(&text, "baleen_node_free_compute_gpus", &[]), Some(3.818));
    // Which pod holds which GPU, once the kubelet's list has named it.
    let named = async {
        loop {
            let text = http_get(address, "/metrics").await?.1;
            let labels =
                [("namespace", "ns"), ("pod", "a"), ("container", "c"), ("gpu_uuid", gpu.as_str())];
            if let Some(v) = sample(&text, "baleen_grant_memory_bytes", &labels) {
                return anyhow::Ok(v);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    assert_eq!(tokio::time::timeout(WAIT, named).await??, (4u64 << 30) as f64);
    // The pod ends: once released, the GPU is idle again and nothing is allocated.
    node.kubelet.end_pod("ns/a");
    let released = async {
        loop {
            let text = http_get(address, "/metrics").await?.1;
            if sample(&text, "baleen_resource_allocated_devices", &[("resource", MEM)]) == Some(0.0)
            {
                return anyhow::Ok(text);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    let text = tokio::time::timeout(WAIT, released).await??;
    assert_eq!(sample(&text, "baleen_gpu_memory_granted_bytes", &[("gpu_uuid", &gpu)]), Some(0.0));
    assert_eq!(
        sample(&text, "baleen_grant_memory_bytes", &[("pod", "a")]),
        None,
        "the grant's series is gone"
    );
    assert_eq!(
        sample(&text, "baleen_gpu_mode", &[("gpu_uuid", &gpu), ("mode", "shared")]),
        None,
        "no stale series"
    );
    assert_eq!(
        sample(&text, "baleen_gpu_mode", &[("gpu_uuid", &gpu), ("mode", "idle")]),
        Some(1.0)
    );
    // A GPU's MPS daemon dies (and cannot start again): not ready, saying why.
    directive(&node, &gpu, "refuse")?;
    let pid = daemon_pid(&node, &gpu)?;
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL)?;
    let not_ready = async {
        loop {
            let (status, body) = http_get(address, "/readyz").await?;
            if status == 503 {
                return anyhow::Ok(body);
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    let why = tokio::time::timeout(WAIT, not_ready).await??;
    assert!(why.contains("MPS daemon not answering") && why.contains(&gpu), "{why}");
    // (A scrape may share a render up to 100 ms old: asked past that.)
    tokio::time::sleep(baleen_agent::metrics::MIN_RENDER_INTERVAL).await;
    let text = http_get(address, "/metrics").await?.1;
    assert_eq!(sample(&text, "baleen_gpu_mps_daemon_up", &[("gpu_uuid", &gpu)]), Some(0.0));
    stop(agent, token).await
}

/// Issue 13: GPU telemetry read through the real NVML backend over the fake library, on the
/// background loop, as metrics; a GPU without a sensor has no series for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn telemetry_from_nvml_reaches_the_metrics() -> Result<()> {
    let expected = example("l4-4x-pcie.yaml")?;
    let fake = FakeNvml::new(&expected)?;
    // GPU 0: 5 GiB used, 87 % busy, 40 % memory, 61 °C, 72.5 W; the others report no sensors.
    fake.set_telemetry(&[(0, 5 << 30, 87, 40, 61, 72_500)])?;
    let mut node = Node::new("l4-4x-pcie.yaml", Backend::Simulated).await?;
    node.inventory = Arc::new(NvmlInventory::new(fake.nvml_config())?);
    let (agent, token) = node.start().await?;
    let address = agent.metrics_address().context("metrics on")?;
    let g0 = expected.gpus[0].uuid.to_string();
    let g1 = expected.gpus[1].uuid.to_string();
    let read = async {
        loop {
            let text = http_get(address, "/metrics").await?.1;
            if sample(&text, "baleen_gpu_temperature_celsius", &[("gpu_uuid", g0.as_str())])
                .is_some()
            {
                return anyhow::Ok(text);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    let text = tokio::time::timeout(WAIT, read).await??;
    let at = |name: &str, gpu: &str| sample(&text, name, &[("gpu_uuid", gpu)]);
    assert_eq!(at("baleen_gpu_memory_used_bytes", &g0), Some((5u64 << 30) as f64));
    assert_eq!(at("baleen_gpu_utilization_ratio", &g0), Some(0.87));
    assert_eq!(at("baleen_gpu_memory_utilization_ratio", &g0), Some(0.4));
    assert_eq!(at("baleen_gpu_temperature_celsius", &g0), Some(61.0));
    assert_eq!(at("baleen_gpu_power_watts", &g0), Some(72.5));
    assert_eq!(at("baleen_gpu_utilization_ratio", &g1), None, "no sensor, no series");
    assert_eq!(at("baleen_gpu_memory_used_bytes", &g1), Some(0.0));
    let age =
        sample(&text, "baleen_telemetry_age_seconds", &[("node", "node-a")]).context("age")?;
    assert!((0.0..5.0).contains(&age), "{age}");
    stop(agent, token).await
}

/// Issue 13: a real scrape passes `promtool check metrics` (Debian's `prometheus` package, which
/// `.ci/run` installs; without it the test fails saying so).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn promtool_accepts_a_real_scrape() -> Result<()> {
    use std::io::Write as _;
    let promtool = baleen_tests::tools::promtool()?;
    let node = Node::new("h200-8x-nvswitch.yaml", Backend::Simulated).await?;
    let (agent, token) = node.start().await?;
    node.registered(&agent, 1).await?;
    node.kubelet.admit_to("ns/a", "c", MEM, 8).await?;
    node.kubelet.admit_to("ns/b", "c", GPU, 2).await?;
    let text = http_get(agent.metrics_address().context("metrics")?, "/metrics").await?.1;
    let mut child = std::process::Command::new(promtool)
        .args(["check", "metrics"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()?;
    child.stdin.take().context("stdin")?.write_all(text.as_bytes())?;
    let out = child.wait_with_output()?;
    assert!(
        out.status.success() && out.stdout.is_empty(),
        "promtool check metrics: {}{}\n{text}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    stop(agent, token).await
}

/// Percent-encodes a query-string value.
fn encode(value: &str) -> String {
    value
        .bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// Issue 13: a real Prometheus server (Debian's package) scrapes the agent; over its HTTP API it
/// answers an allocated pod's granted memory and every query of the Grafana dashboard.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_real_prometheus_scrapes_the_agent_and_answers_every_dashboard_query() -> Result<()> {
    let prometheus = baleen_tests::tools::on_path("prometheus")
        .context("prometheus is not installed: apt-get install prometheus (.ci/run installs it)")?;
    let mut node = Node::new("l4-4x-pcie.yaml", Backend::Simulated).await?;
    // Live readings for every GPU, as NVML would give them.
    let expected = example("l4-4x-pcie.yaml")?;
    let simulated = Arc::new(SimulatedInventory::new(expected.clone()));
    simulated.set_telemetry(
        expected
            .gpus
            .iter()
            .map(|g| baleen_agent::inventory::GpuTelemetry {
                gpu: Some(g.uuid.clone()),
                memory_used_bytes: Some(1 << 30),
                gpu_utilisation: Some(0.5),
                memory_utilisation: Some(0.25),
                temperature_celsius: Some(50),
                power_watts: Some(40.0),
            })
            .collect(),
    );
    node.inventory = simulated.clone();
    let proc_root = tempfile::tempdir()?;
    node.config.watchdog = baleen_agent::isolation::watchdog::WatchdogConfig {
        enabled: true,
        interval: Duration::from_millis(200),
        action: baleen_agent::isolation::watchdog::WatchdogAction::Log,
        proc_root: proc_root.path().to_path_buf(),
        ..Default::default()
    };
    let api = baleen_tests::fake_apiserver::FakeApiServer::start(&["node-a"]).await?;
    let (uid, id) = ("1111-2222", "d".repeat(64));
    api.put_pod(running_pod("ns/a", uid, "c", &id, 4));
    let (agent, token) =
        node.start_with(Some(baleen_agent::kube_api::KubeNodeApi::at(&api.url())?)).await?;
    node.registered(&agent, 1).await?;
    let granted = node.kubelet.admit_to("ns/a", "c", MEM, 4).await?;
    // A process of the grant's container, 1 GiB on its GPU: the grant's used memory.
    fake_process(proc_root.path(), 700, uid, &id, "")?;
    simulated.set_processes(vec![baleen_agent::inventory::GpuProcess {
        gpu: baleen_agent::inventory::GpuUuid::new(gpu_of(&granted.device_ids[0]))?,
        pid: 700,
        used_bytes: Some(1 << 30),
    }]);
    let target = agent.metrics_address().context("metrics")?;
    let dir = tempfile::tempdir()?;
    let config = dir.path().join("prometheus.yml");
    std::fs::write(
        &config,
        format!(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nscrape_configs:\n  - job_name: baleen\n    static_configs:\n      - targets: ['{target}']\n"
        ),
    )?;
    let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let address: std::net::SocketAddr = format!("127.0.0.1:{port}").parse()?;
    /// Kills the server however the test ends (a failed assertion unwinds past any cleanup).
    struct Server(std::process::Child);
    impl Drop for Server {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let server = std::process::Command::new(prometheus)
        .arg(format!("--config.file={}", config.display()))
        .arg(format!("--storage.tsdb.path={}", dir.path().join("data").display()))
        .arg(format!("--web.listen-address={address}"))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()?;
    let server = Server(server);
    let outcome = async {
        let query = |q: String| async move {
            let (status, body) =
                http_get(address, &format!("/api/v1/query?query={}", encode(&q))).await?;
            anyhow::ensure!(status == 200, "{q}: {status} {body}");
            let value: serde_json::Value = serde_json::from_str(&body)?;
            Ok::<_, anyhow::Error>(value["data"]["result"].as_array().cloned().unwrap_or_default())
        };
        // The first value of `q` once Prometheus has one.
        let first_value = |q: &'static str| async move {
            loop {
                if let Ok(result) = query(q.into()).await
                    && let Some(first) = result.first()
                {
                    return anyhow::Ok(first["value"][1].as_str().unwrap_or_default().to_owned());
                }
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
        };
        // The allocated pod's granted memory, once scraped and listed.
        let granted = first_value(r#"baleen_grant_memory_bytes{pod="a"}"#);
        let value = tokio::time::timeout(Duration::from_secs(60), granted).await??;
        assert_eq!(value, (4u64 << 30).to_string());
        // And the memory its process uses (the watchdog's read), as the dashboard plots it.
        let used = first_value(r#"baleen_grant_memory_used_bytes{pod="a"}"#);
        let value = tokio::time::timeout(Duration::from_secs(60), used).await??;
        assert_eq!(value, (1u64 << 30).to_string());
        // Every dashboard query answers with at least one series.
        let dashboard: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(
            Path::new(EXAMPLES).join("../grafana/baleen.json"),
        )?)?;
        let mut queries = 0;
        for panel in dashboard["panels"].as_array().context("panels")? {
            for target in panel["targets"].as_array().context("targets")? {
                let expr = target["expr"].as_str().context("expr")?.replace("$node", ".*");
                let result = query(expr.clone()).await?;
                assert!(!result.is_empty(), "dashboard query {expr} returned no series");
                queries += 1;
            }
        }
        assert!(queries >= 10, "{queries} queries");
        anyhow::Ok(())
    }
    .await;
    drop(server);
    outcome?;
    stop(agent, token).await
}

/// The node's gpu-state annotation as the fake API server holds it now.
fn published(api: &baleen_tests::fake_apiserver::FakeApiServer) -> Option<NodeGpuState> {
    let text = api.annotation("node-a", "awesome-ai-company.com/gpu-state")?;
    Some(NodeGpuState::parse(&text).expect("the agent writes valid documents"))
}

/// Waits (at most `WAIT`) until the published state satisfies `ok`.
async fn published_when(
    api: &baleen_tests::fake_apiserver::FakeApiServer,
    what: &str,
    ok: impl Fn(&NodeGpuState) -> bool,
) -> Result<NodeGpuState> {
    let mut requests = api.watch_requests();
    let wait = async {
        loop {
            if let Some(state) = published(api).filter(|s| ok(s)) {
                return anyhow::Ok(state);
            }
            requests.changed().await?;
        }
    };
    tokio::time::timeout(WAIT, wait).await.with_context(|| {
        let patches: Vec<String> = api
            .requests()
            .iter()
            .filter(|r| r.method == "PATCH")
            .map(|r| format!("{:?}", r.at.elapsed()))
            .collect();
        format!(
            "waiting for {what}; last published {:?}; PATCHes (ago) {patches:?}",
            published(api).map(|s| (
                s.generation,
                s.gpus.iter().map(|g| g.units_total - g.units_free).sum::<u32>()
            ))
        )
    })?
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_node_state_is_published_coalesced_and_survives_the_api_server_going_away() -> Result<()>
{
    let mut node = Node::new("l4-4x-pcie.yaml", Backend::Simulated).await?;
    let interval = Duration::from_millis(300);
    node.config.annotation = baleen_agent::run::annotation::AnnotationConfig {
        enabled: true,
        min_interval: interval,
        ..Default::default()
    };
    let mut api = baleen_tests::fake_apiserver::FakeApiServer::start(&["node-a"]).await?;
    let client = baleen_agent::kube_api::KubeNodeApi::at(&api.url())?;
    let (agent, token) = node.start_with(Some(client.clone())).await?;
    node.registered(&agent, 1).await?;
    // Written at start, as a JSON merge patch of the one annotation.
    let first = published_when(&api, "the first state", |s| s.gpus.len() == 4).await?;
    assert!(first.gpus.iter().all(|g| g.units_free == g.units_total && g.units_total == 22));
    let patch = api.requests().into_iter().find(|r| r.method == "PATCH").context("a patch")?;
    assert_eq!(patch.content_type, "application/merge-patch+json");
    assert_eq!(patch.path, "/api/v1/nodes/node-a");
    let keys: Vec<&String> =
        patch.body["metadata"].as_object().context("metadata")?.keys().collect();
    assert_eq!(keys, ["annotations"], "nothing but the annotation is written");

    // A burst of grants: written at most once per interval, and the last state always.
    let before = api.requests().len();
    let mut gpus = std::collections::BTreeSet::new();
    for pod in ["ns/a", "ns/b", "ns/c", "ns/d", "ns/e"] {
        let a = node.kubelet.admit_to(pod, "c", MEM, 4).await?;
        gpus.insert(gpu_of(&a.device_ids[0]).to_owned());
    }
    let all = published_when(&api, "all five grants", |s| {
        s.gpus.iter().map(|g| g.units_total - g.units_free).sum::<u32>() == 20
    })
    .await?;
    let patches: Vec<std::time::Instant> =
        api.requests()[before..].iter().filter(|r| r.method == "PATCH").map(|r| r.at).collect();
    assert!(patches.len() < 5, "five grants, {} writes: not coalesced", patches.len());
    for pair in patches.windows(2) {
        // The interval is measured from the end of a write to the next change; the next write
        // starts at least that long after it (a little slack for the recording's clock).
        assert!(
            pair[1] - pair[0] >= interval - Duration::from_millis(20),
            "{:?}",
            pair[1] - pair[0]
        );
    }
    // The pods that hold them, once the kubelet has listed them.
    let named = published_when(&api, "the pods named", |s| {
        s.gpus.iter().flat_map(|g| g.pods.iter()).any(|p| p == "ns/e")
    })
    .await?;
    assert!(named.generation >= all.generation);

    // The API server goes away: Allocate is not held up, and the state is written once it is
    // back.
    api.stop().await;
    let started = std::time::Instant::now();
    node.kubelet.admit_to("ns/f", "c", MEM, 2).await?;
    assert!(started.elapsed() < Duration::from_secs(2), "Allocate waited for the API server");
    let used = |s: &NodeGpuState| s.gpus.iter().map(|g| g.units_total - g.units_free).sum::<u32>();
    assert!(published(&api).is_some_and(|s| used(&s) == 20), "nothing written while away");
    api.start_again().await?;
    published_when(&api, "the grant made while the API server was away", |s| used(s) == 22).await?;

    // A restarted agent writes at start, even an unchanged state.
    stop(agent, token).await?;
    let before = api.requests().iter().filter(|r| r.method == "PATCH").count();
    let (agent, token) = node.start_with(Some(client)).await?;
    let mut requests = api.watch_requests();
    tokio::time::timeout(WAIT, async {
        while api.requests().iter().filter(|r| r.method == "PATCH").count() == before {
            requests.changed().await?;
        }
        anyhow::Ok(())
    })
    .await??;
    assert_eq!(published(&api).map(|s| used(&s)), Some(22));
    stop(agent, token).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_told_to_publish_without_an_api_does_not_start() -> Result<()> {
    let mut node = Node::new("l4-4x-pcie.yaml", Backend::Simulated).await?;
    node.config.annotation.enabled = true;
    let err = node.start().await.err().context("started without an API")?;
    assert!(format!("{err:#}").contains("no Kubernetes API client"), "{err:#}");
    Ok(())
}

/// A pod of node `node` as the API server stores it, asking `units` gpu-memory units.
fn api_pod(
    name: &str,
    node: &str,
    qos: &str,
    label: Option<&str>,
    phase: &str,
    units: u32,
) -> serde_json::Value {
    let mut resources = serde_json::json!({"limits": {MEM: units.to_string()}});
    if qos == "Guaranteed" {
        resources = serde_json::json!({
            "requests": {"cpu": "2", "memory": "4Gi"},
            "limits": {"cpu": "2", "memory": "4Gi", MEM: units.to_string()}
        });
    }
    let labels = label.map_or_else(
        || serde_json::json!({}),
        |l| serde_json::json!({baleen_agent::isolation::colocation::CLASS_LABEL: l}),
    );
    let mut status = serde_json::json!({"phase": phase, "qosClass": qos});
    if phase == "Running" {
        status["containerStatuses"] = serde_json::json!([{"name": "c", "image": "i", "imageID": "",
            "ready": true, "restartCount": 0, "state": {"running": {}}}]);
    }
    // Guaranteed pods live in `serving` (an inference namespace in the co-location test), the
    // others in `ml`.
    let namespace = if qos == "Guaranteed" { "serving" } else { "ml" };
    serde_json::json!({
        "metadata": {"name": name, "namespace": namespace, "uid": format!("uid-{name}"), "labels": labels},
        "spec": {"nodeName": node, "containers": [{"name": "c", "resources": resources}]},
        "status": status
    })
}

/// A cgroup v2 tree with each pod's directory (systemd driver), files at the kernel's defaults.
fn cgroup_tree(root: &Path, pods: &[(&str, baleen_agent::isolation::cgroups::Qos)]) -> Result<()> {
    use baleen_agent::isolation::cgroups::{Driver, Layout};
    std::fs::create_dir_all(root)?;
    std::fs::write(root.join("cgroup.controllers"), "cpuset cpu io memory pids\n")?;
    let layout = Layout::detect(root, Driver::Systemd)?;
    for (uid, qos) in pods {
        let dir = layout.pod_dir("cpu", *qos, uid);
        std::fs::create_dir_all(&dir)?;
        for (file, value) in [
            ("cpu.weight", "100"),
            ("cpu.max", "max 100000"),
            ("memory.low", "0"),
            ("cpu.idle", "0"),
        ] {
            std::fs::write(dir.join(file), value)?;
        }
    }
    Ok(())
}

fn cgroup_file(
    root: &Path,
    uid: &str,
    qos: baleen_agent::isolation::cgroups::Qos,
    file: &str,
) -> String {
    use baleen_agent::isolation::cgroups::{Driver, Layout};
    let layout = Layout::detect(root, Driver::Systemd).expect("a tree");
    std::fs::read_to_string(layout.pod_dir("cpu", qos, uid).join(file))
        .expect("readable")
        .trim()
        .to_owned()
}

async fn eventually(what: &str, ok: impl Fn() -> bool) -> Result<()> {
    tokio::time::timeout(WAIT, async {
        while !ok() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .with_context(|| format!("waiting for {what}"))
}

/// The MPS client priority an Allocate answer carries.
fn priority(a: &baleen_tests::fake_kubelet::Admission) -> Option<&str> {
    a.response
        .envs
        .get(baleen_agent::isolation::pod_identity::PRIORITY_VARIABLE)
        .map(String::as_str)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn colocation_classes_reach_the_pods_cgroups_and_mps_priorities_and_survive_restarts()
-> Result<()> {
    use baleen_agent::isolation::cgroups::Qos;
    let mut node = Node::new("l4-4x-pcie.yaml", Backend::Simulated).await?;
    let cgroups = node.config.state_dir.parent().context("root")?.join("cgroup");
    cgroup_tree(
        &cgroups,
        &[
            ("uid-serve", Qos::Guaranteed),
            ("uid-train", Qos::BestEffort),
            ("uid-old", Qos::BestEffort),
            ("uid-other", Qos::Guaranteed),
        ],
    )?;
    node.config.colocation = baleen_agent::run::colocation::ColocationConfig {
        enabled: true,
        cgroup_root: cgroups.clone(),
        identify_wait: Duration::from_millis(500),
        resync: Duration::from_millis(200),
        ..Default::default()
    };
    let mut api = baleen_tests::fake_apiserver::FakeApiServer::start(&["node-a", "node-b"]).await?;
    api.put_node(serde_json::json!({
        "metadata": {"name": "node-a"}, "status": {"allocatable": {"cpu": "8", "memory": "64Gi"}}
    }));
    // Classes come from namespaces, labelled by the cluster admin: `serving` is an inference
    // namespace; `ml` has no label (the default class, training).
    let class = baleen_agent::isolation::colocation::CLASS_LABEL;
    api.put_namespace(
        serde_json::json!({"metadata": {"name": "serving", "labels": {class: "inference"}}}),
    );
    api.put_namespace(serde_json::json!({"metadata": {"name": "ml"}}));
    // Being admitted: two inference pods and a training pod; already running: a training pod
    // with the same ask as the second inference pod (not a candidate); on another node: an
    // inference pod the agent must not see.
    api.put_pod(api_pod("serve", "node-a", "Guaranteed", None, "Pending", 4));
    api.put_pod(api_pod("train", "node-a", "BestEffort", None, "Pending", 6));
    api.put_pod(api_pod("serve2", "node-a", "Guaranteed", None, "Pending", 6));
    api.put_pod(api_pod("old", "node-a", "BestEffort", None, "Running", 6));
    api.put_pod(api_pod("other", "node-b", "Guaranteed", None, "Running", 6));
    let client = baleen_agent::kube_api::KubeNodeApi::at(&api.url())?;
    let (agent, token) = node.start_with(Some(client.clone())).await?;
    node.registered(&agent, 1).await?;

    // One candidate: the inference pod's client at normal priority.
    let serve = node.kubelet.admit_to("serving/serve", "c", MEM, 4).await?;
    assert_eq!(priority(&serve), Some("0"));
    // Two candidates of different classes with the same ask (the pending training and inference
    // pods asking 6): the default class, training, below normal.
    let train = node.kubelet.admit_to("ml/train", "c", MEM, 6).await?;
    assert_eq!(priority(&train), Some("1"));
    // The training pod's container is now listed by the kubelet: the second inference pod is the
    // one candidate left (the running training pod asking 6 is not one, or this would be
    // ambiguous and get the default class).
    eventually("the training pod listed", || {
        agent
            .resources()
            .grants()
            .iter()
            .any(|(_, _, _, k)| k.as_ref().is_some_and(|k| k.pod == "train"))
    })
    .await?;
    let serve2 = node.kubelet.admit_to("serving/serve2", "c", MEM, 6).await?;
    assert_eq!(priority(&serve2), Some("0"));
    // Two pods of different classes with the same ask: the default class (training). The
    // second labels itself `inference`, which counts for nothing: its namespace is `ml`.
    api.put_pod(api_pod("a", "node-a", "Guaranteed", None, "Pending", 2));
    api.put_pod(api_pod("b", "node-a", "Burstable", Some("inference"), "Pending", 2));
    // (Both in the agent's view before the Allocate: the first alone would be one candidate.)
    tokio::time::sleep(Duration::from_millis(200)).await;
    let either = node.kubelet.admit_to("serving/a", "c", MEM, 2).await?;
    assert_eq!(priority(&either), Some("1"), "ambiguous: the default class");
    // No pod at all with this ask: the default class after the wait.
    let started = std::time::Instant::now();
    let nobody = node.kubelet.admit_to("ml/ghost", "c", MEM, 1).await?;
    assert_eq!(priority(&nobody), Some("1"));
    assert!(started.elapsed() >= Duration::from_millis(400), "waited for the pod to appear");

    // Running: the inference pod gets weight 1000 (10240 shares: cgroup v2 weight 391) capped
    // at its 2 cores plus the 6 nobody requested, and its memory protected; the training pods keep
    // the kubelet's weight and together get a cap of the allocatable CPU less the inference
    // requests (8 - 2 = 6 cores, 3 each, never below their requests); the other node's
    // inference pod is not counted.
    api.put_pod(api_pod("serve", "node-a", "Guaranteed", None, "Running", 4));
    api.put_pod(api_pod("train", "node-a", "BestEffort", None, "Running", 6));
    let f = |uid: &str, qos, file: &str| cgroup_file(&cgroups, uid, qos, file);
    eventually("the classes applied", || {
        f("uid-train", Qos::BestEffort, "cpu.max") == "300000 100000"
            && f("uid-serve", Qos::Guaranteed, "cpu.weight") == "391"
            && f("uid-serve", Qos::Guaranteed, "cpu.max") == "800000 100000"
            && f("uid-serve", Qos::Guaranteed, "memory.low") == (4u64 << 30).to_string()
    })
    .await?;
    assert_eq!(f("uid-serve", Qos::Guaranteed, "memory.low"), (4u64 << 30).to_string());
    // Training keeps the kubelet's weight and is not SCHED_IDLE (the opt-in).
    assert_eq!(f("uid-train", Qos::BestEffort, "cpu.idle"), "0");
    assert_eq!(f("uid-train", Qos::BestEffort, "cpu.weight"), "100");
    assert_eq!(f("uid-other", Qos::Guaranteed, "cpu.weight"), "100", "another node's pod");
    let state = node.config.state_dir.join("colocation.json");
    assert!(state.is_file(), "what to put back is kept");
    // Seen on /metrics: co-location runs, its pods by class, and how each MPS client's pod was
    // found (serve and serve2: one candidate; train and a: ambiguous; ghost: none).
    let text = http_get(agent.metrics_address().context("metrics")?, "/metrics").await?.1;
    for series in [
        r#"baleen_colocation_up{node="node-a"} 1"#,
        r#"baleen_colocation_failures_total{node="node-a"} 0"#,
        r#"baleen_colocation_pods{class="inference",node="node-a"} 1"#,
        r#"baleen_colocation_pods{class="training",node="node-a"} 2"#,
        r#"baleen_mps_client_priorities_total{class="inference",identity="pod",node="node-a"} 2"#,
        r#"baleen_mps_client_priorities_total{class="training",identity="ambiguous",node="node-a"} 2"#,
        r#"baleen_mps_client_priorities_total{class="training",identity="unknown",node="node-a"} 1"#,
    ] {
        assert!(text.lines().any(|l| l == series), "{series} not in:\n{text}");
    }

    // The kubelet rewrites a weight: written again at the next resync.
    let layout = baleen_agent::isolation::cgroups::Layout::detect(
        &cgroups,
        baleen_agent::isolation::cgroups::Driver::Systemd,
    )?;
    std::fs::write(layout.pod_dir("cpu", Qos::Guaranteed, "uid-serve").join("cpu.weight"), "1")?;
    eventually("the weight written again", || {
        f("uid-serve", Qos::Guaranteed, "cpu.weight") == "391"
    })
    .await?;

    // A crash and a restart: the values stay, and the agent goes on from what it saved.
    drop(agent);
    token.cancel();
    let (agent, token) = node.start_with(Some(client.clone())).await?;
    // The API server goes away; meanwhile the inference pods end. Once it is back, the agent
    // lists again: the training cap goes, the inference pods' values are put back.
    api.stop().await;
    api.delete_pod("serving/serve");
    api.delete_pod("ml/old");
    api.start_again().await?;
    eventually("the cap lifted, the inference values put back", || {
        f("uid-train", Qos::BestEffort, "cpu.max") == "max 100000"
            && f("uid-serve", Qos::Guaranteed, "cpu.weight") == "1"
    })
    .await?;
    assert_eq!(f("uid-serve", Qos::Guaranteed, "cpu.weight"), "1", "the kubelet's value put back");
    assert_eq!(f("uid-serve", Qos::Guaranteed, "memory.low"), "0", "put back");
    assert_eq!(f("uid-train", Qos::BestEffort, "cpu.weight"), "100", "never touched");
    assert_eq!(f("uid-train", Qos::BestEffort, "cpu.idle"), "0");
    stop(agent, token).await?;

    // Co-location switched off: everything put back at start, the saved state gone.
    node.config.colocation.enabled = false;
    let (agent, token) = node.start_with(None).await?;
    assert_eq!(f("uid-train", Qos::BestEffort, "cpu.weight"), "100", "the kernel's value back");
    assert!(!state.exists());
    let plain = node.kubelet.admit_to("ml/plain", "c", MEM, 1).await?;
    assert_eq!(priority(&plain), None, "no priority without co-location");
    stop(agent, token).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_node_pods_view_sees_only_its_node_follows_binding_and_the_api_coming_back()
-> Result<()> {
    use baleen_agent::kube_api::NodeApi as _;
    let mut api = baleen_tests::fake_apiserver::FakeApiServer::start(&["node-a", "node-b"]).await?;
    let address: std::net::SocketAddr = api.url().trim_start_matches("http://").parse()?;
    // A field selector the API server cannot answer is refused, as the real one refuses it.
    let (code, body) = baleen_tests::http::request(
        address,
        "GET",
        "/api/v1/pods?fieldSelector=status.hostIP%3D1.2.3.4",
        "",
    )
    .await?;
    assert_eq!(code, 400, "{body}");
    api.put_pod(api_pod("mine", "node-a", "Guaranteed", None, "Running", 1));
    api.put_pod(api_pod("theirs", "node-b", "Guaranteed", None, "Running", 1));
    api.put_pod(api_pod("unbound", "", "BestEffort", None, "Pending", 2));
    let client = baleen_agent::kube_api::KubeNodeApi::at(&api.url())?;
    let (view, mut pods) =
        tokio::sync::watch::channel(baleen_agent::isolation::node_pods::NodePods::default());
    let token = CancellationToken::new();
    let follower = {
        let (client, token) = (client.clone(), token.clone());
        tokio::spawn(async move { client.follow_pods("node-a", view, token).await })
    };
    let names = |v: &baleen_agent::isolation::node_pods::NodePods| -> Vec<String> {
        v.pods.values().map(|p| p.name.clone()).collect()
    };
    let mut until =
        async |what: &str, ok: &dyn Fn(&baleen_agent::isolation::node_pods::NodePods) -> bool| {
            tokio::time::timeout(WAIT, pods.wait_for(|v| v.synced && ok(v)))
                .await
                .with_context(|| format!("waiting for {what}"))?
                .map(|v| v.clone())
                .context("the follower ended")
        };
    until("the first list", &|v| names(v) == ["mine"]).await?;
    // Bound to this node: it comes into the view (a watch with the selector sees ADDED).
    let binding = serde_json::json!({"target": {"kind": "Node", "name": "node-a"}}).to_string();
    let (code, _) = baleen_tests::http::request(
        address,
        "POST",
        "/api/v1/namespaces/ml/pods/unbound/binding",
        &binding,
    )
    .await?;
    assert_eq!(code, 201);
    let seen = until("the bound pod", &|v| names(v).len() == 2).await?;
    assert_eq!(seen.pods["uid-unbound"].asks.len(), 1);
    // The API server goes away; a pod ends meanwhile; once it is back the watch goes on (or
    // lists again) and the pod is gone from the view.
    api.stop().await;
    api.delete_pod("serving/mine");
    api.start_again().await?;
    until("the ended pod gone", &|v| names(v) == ["unbound"]).await?;
    token.cancel();
    tokio::time::timeout(WAIT, follower).await??;
    Ok(())
}

/// Issue 21, item 5: the namespaces' class labels are followed (a label selector: namespaces
/// without the label are not even listed), labels added, changed and removed, and the pods'
/// view is kept beside them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_namespaces_class_labels_are_followed() -> Result<()> {
    use baleen_agent::kube_api::NodeApi as _;
    let class = baleen_agent::isolation::colocation::CLASS_LABEL;
    let api = baleen_tests::fake_apiserver::FakeApiServer::start(&["node-a"]).await?;
    api.put_namespace(
        serde_json::json!({"metadata": {"name": "serving", "labels": {class: "inference"}}}),
    );
    api.put_namespace(serde_json::json!({"metadata": {"name": "ml", "labels": {"team": "a"}}}));
    api.put_pod(api_pod("mine", "node-a", "Guaranteed", None, "Running", 1));
    let client = baleen_agent::kube_api::KubeNodeApi::at(&api.url())?;
    let (view, mut seen) =
        tokio::sync::watch::channel(baleen_agent::isolation::node_pods::NodePods::default());
    let token = CancellationToken::new();
    let followers = {
        let (client, token, view) = (client.clone(), token.clone(), view.clone());
        tokio::spawn(async move {
            tokio::join!(
                client.follow_namespaces(view.clone(), token.clone()),
                client.follow_pods("node-a", view, token)
            )
        })
    };
    let classes = |v: &baleen_agent::isolation::node_pods::NodePods| -> Vec<(String, String)> {
        v.namespace_classes.iter().map(|(k, v)| (k.clone(), v.clone())).collect()
    };
    let mut until = async |what: &str, want: Vec<(&str, &str)>| {
        let want: Vec<(String, String)> =
            want.into_iter().map(|(a, b)| (a.to_owned(), b.to_owned())).collect();
        tokio::time::timeout(
            WAIT,
            seen.wait_for(|v| v.ready() && v.pods.len() == 1 && classes(v) == want),
        )
        .await
        .with_context(|| format!("waiting for {what}"))?
        .map(drop)
        .context("the followers ended")
    };
    until("the first lists", vec![("serving", "inference")]).await?;
    api.put_namespace(
        serde_json::json!({"metadata": {"name": "ml", "labels": {class: "training"}}}),
    );
    until("a label added", vec![("ml", "training"), ("serving", "inference")]).await?;
    api.put_namespace(
        serde_json::json!({"metadata": {"name": "ml", "labels": {class: "inference"}}}),
    );
    until("a label changed", vec![("ml", "inference"), ("serving", "inference")]).await?;
    api.put_namespace(serde_json::json!({"metadata": {"name": "serving"}}));
    until("a label removed", vec![("ml", "inference")]).await?;
    let listed = api.requests().into_iter().any(|r| r.path == "/api/v1/namespaces");
    assert!(listed, "listed with the selector");
    token.cancel();
    tokio::time::timeout(WAIT, followers).await??;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_colocation_state_that_cannot_be_read_stops_colocation_not_the_agent() -> Result<()> {
    let mut node = Node::new("l4-4x-pcie.yaml", Backend::Simulated).await?;
    let cgroups = node.config.state_dir.parent().context("root")?.join("cgroup");
    cgroup_tree(&cgroups, &[])?;
    node.config.colocation = baleen_agent::run::colocation::ColocationConfig {
        enabled: true,
        cgroup_root: cgroups,
        ..Default::default()
    };
    std::fs::create_dir_all(&node.config.state_dir)?;
    let state = node.config.state_dir.join("colocation.json");
    std::fs::write(&state, "{ not json")?;
    let api = baleen_tests::fake_apiserver::FakeApiServer::start(&["node-a"]).await?;
    let client = baleen_agent::kube_api::KubeNodeApi::at(&api.url())?;
    let (agent, token) = node.start_with(Some(client)).await?;
    node.registered(&agent, 1).await?;
    // The devices are served; no class is given (co-location is not running); the file is
    // left for the operator to mend or remove.
    let a = node.kubelet.admit_to("ml/p", "c", MEM, 2).await?;
    assert_eq!(priority(&a), None);
    assert_eq!(std::fs::read_to_string(&state)?, "{ not json");
    let text = http_get(agent.metrics_address().context("metrics")?, "/metrics").await?.1;
    assert!(text.lines().any(|l| l == r#"baleen_colocation_up{node="node-a"} 0"#), "{text}");
    // Co-location does not run: its namespace watcher neither (the pods are followed all the
    // same: the reconciler asks the API about pods the kubelet stops listing).
    assert!(!api.requests().iter().any(|r| r.path == "/api/v1/namespaces"), "no namespace watch");
    stop(agent, token).await
}

/// Whether the ledger still holds `gpu` whole for pod `pod`.
fn held_whole_by(agent: &Agent, gpu: &str, pod: &str) -> bool {
    agent.resources().grants().iter().any(|(r, g, _, k)| {
        r.resource == GPU && g == gpu && k.as_ref().is_none_or(|k| k.pod == pod)
    })
}

/// Issue 22, item 1: a whole GPU held by pod-w; the kubelet restarts (it registers the plugins
/// again) and lists no pod at all, as one restarted while the API server is unreachable does
/// until it syncs. Nothing is released while it settles: the GPU's units stay Unhealthy, so no
/// 4-unit share of it can be granted, and when pod-w is listed again the ledger still holds it.
/// Once the kubelet has settled and still does not list it (and there is no API to ask), the
/// kubelet's word holds again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_kubelets_empty_list_releases_nothing_until_it_has_settled() -> Result<()> {
    let mut node = Node::new("l4-4x-pcie.yaml", Backend::Simulated).await?;
    node.config.reconcile_settle = Duration::from_millis(1500);
    let (agent, token) = node.start().await?;
    node.registered(&agent, 1).await?;
    let w = node.kubelet.admit_to("ns/w", "c", GPU, 1).await?;
    let gpu = w.device_ids[0].clone();
    eventually("pod-w listed", || {
        agent.resources().grants().iter().any(|(_, g, _, k)| *g == gpu && k.is_some())
    })
    .await?;
    // Past the settling of the agent's own start.
    tokio::time::sleep(Duration::from_millis(1600)).await;
    node.kubelet.forget_pods(true);
    node.kubelet.restart().await?;
    node.registered(&agent, 2).await?;
    // Many reconciliations (every 100 ms) while it settles: nothing released.
    for _ in 0..10 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(held_whole_by(&agent, &gpu, "w"), "released while the kubelet settles");
        let view = node.kubelet.view();
        assert!(
            unit_health(&view, &gpu).iter().all(|h| *h == "Unhealthy"),
            "the GPU's units offered: {:?}",
            unit_health(&view, &gpu)
        );
    }
    let text = http_get(agent.metrics_address().context("metrics")?, "/metrics").await?.1;
    let held = sample(&text, "baleen_reconcile_changes_total", &[("change", "held")]);
    assert!(held.is_some_and(|n| n >= 1.0), "counted: {held:?}");
    // It syncs and lists pod-w again: still held, by pod-w.
    node.kubelet.forget_pods(false);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(held_whole_by(&agent, &gpu, "w"));
    // Forgetful again once settled, with no API to ask: two misses release it, as before.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    node.kubelet.forget_pods(true);
    eventually("released once settled", || !held_whole_by(&agent, &gpu, "w")).await?;
    stop(agent, token).await
}

/// Issue 22, item 1: where the agent follows the node's pods, a miss the API server
/// contradicts (it says pod-w runs) is held however long it lasts, and released as soon as the
/// API says the pod is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_miss_the_api_server_contradicts_is_held_until_the_api_says_the_pod_ended() -> Result<()>
{
    let node = Node::new("l4-4x-pcie.yaml", Backend::Simulated).await?;
    let api = baleen_tests::fake_apiserver::FakeApiServer::start(&["node-a"]).await?;
    api.put_pod(running_pod(
        "ns/w",
        "9f8e7d6c-0000-4000-8000-0000000000aa",
        "c",
        &"a".repeat(64),
        0,
    ));
    let client = baleen_agent::kube_api::KubeNodeApi::at(&api.url())?;
    let (agent, token) = node.start_with(Some(client)).await?;
    node.registered(&agent, 1).await?;
    let w = node.kubelet.admit_to("ns/w", "c", GPU, 1).await?;
    let gpu = w.device_ids[0].clone();
    eventually("pod-w listed", || {
        agent.resources().grants().iter().any(|(_, g, _, k)| *g == gpu && k.is_some())
    })
    .await?;
    node.kubelet.forget_pods(true);
    for _ in 0..10 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(held_whole_by(&agent, &gpu, "w"), "released though the API says pod-w runs");
    }
    api.delete_pod("ns/w");
    eventually("released once the API says pod-w is gone", || !held_whole_by(&agent, &gpu, "w"))
        .await?;
    stop(agent, token).await
}

/// An inventory whose discovery hangs (NVML with a GPU fallen off the bus), the rest simulated.
struct HangingDiscovery(SimulatedInventory);

impl GpuInventory for HangingDiscovery {
    fn discover(
        &self,
    ) -> Result<baleen_agent::inventory::Inventory, baleen_agent::inventory::InventoryError> {
        // Long against the stop asked (the test's runtime waits for this thread at its end).
        std::thread::sleep(Duration::from_secs(3));
        self.0.discover()
    }
    fn health_watcher(
        &self,
    ) -> Result<
        Box<dyn baleen_agent::inventory::HealthWatcher + '_>,
        baleen_agent::inventory::InventoryError,
    > {
        self.0.health_watcher()
    }
    fn processes(
        &self,
    ) -> Result<Vec<baleen_agent::inventory::GpuProcess>, baleen_agent::inventory::InventoryError>
    {
        self.0.processes()
    }
    fn telemetry(
        &self,
    ) -> Result<Vec<baleen_agent::inventory::GpuTelemetry>, baleen_agent::inventory::InventoryError>
    {
        self.0.telemetry()
    }
}

/// Issue 22, item 2: a stop during a discovery that hangs stops the start at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_during_a_hanging_discovery_stops_the_start() -> Result<()> {
    let mut node = Node::new("l4-4x-pcie.yaml", Backend::Simulated).await?;
    node.inventory =
        Arc::new(HangingDiscovery(SimulatedInventory::new(example("l4-4x-pcie.yaml")?)));
    let token = CancellationToken::new();
    let starting = tokio::spawn(Agent::start(
        node.config.clone(),
        Dependencies {
            inventory: node.inventory.clone(),
            registry: Default::default(),
            node_api: None,
        },
        token.clone(),
    ));
    tokio::time::sleep(Duration::from_millis(300)).await;
    let asked = std::time::Instant::now();
    token.cancel();
    let outcome = tokio::time::timeout(Duration::from_secs(2), starting)
        .await
        .context("start did not stop")??;
    assert!(
        matches!(outcome, Err(baleen_agent::run::AgentError::StoppedBeforeStart)),
        "{:?}",
        outcome.err()
    );
    assert!(asked.elapsed() < Duration::from_secs(1));
    Ok(())
}

/// Issue 22, item 6: the unauthenticated metrics port bounds what a client can hold: at most
/// `MAX_CONNECTIONS` connections (one more is closed at once, and counted), headers within
/// `HEADER_READ_TIMEOUT` (a half-open connection is closed), and it answers again once the
/// hoarder lets go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_metrics_port_bounds_connections_and_half_open_ones() -> Result<()> {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let node = Node::new("l4-4x-pcie.yaml", Backend::Simulated).await?;
    let (agent, token) = node.start().await?;
    let address = agent.metrics_address().context("metrics")?;
    let closed = |mut s: tokio::net::TcpStream, within: Duration| async move {
        let mut byte = [0u8; 1];
        matches!(tokio::time::timeout(within, s.read(&mut byte)).await, Ok(Ok(0) | Err(_)))
    };
    let mut hoard = Vec::new();
    for _ in 0..baleen_agent::metrics::MAX_CONNECTIONS {
        hoard.push(tokio::net::TcpStream::connect(address).await?);
    }
    // Let the server accept them all, then one more: closed at once.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let extra = tokio::net::TcpStream::connect(address).await?;
    assert!(closed(extra, Duration::from_secs(2)).await, "a connection beyond the cap was kept");
    drop(hoard);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let text = http_get(address, "/metrics").await?.1;
    let refused = sample(&text, "baleen_metrics_connections_refused_total", &[]);
    assert!(refused.is_some_and(|n| n >= 1.0), "counted: {refused:?}");
    // Half a request line, then nothing: closed after the header timeout.
    let mut half = tokio::net::TcpStream::connect(address).await?;
    half.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n").await?;
    let wait = baleen_agent::metrics::HEADER_READ_TIMEOUT + Duration::from_secs(2);
    assert!(closed(half, wait).await, "a half-open connection outlived the header timeout");
    stop(agent, token).await
}

/// Issue 22, item 7: health per GPU that recovers, on the real NVML backend over the fake
/// library. A critical XID makes the GPU unhealthy; while its NVML reads fail (GPU_IS_LOST) or
/// hang it stays so (and the metrics endpoint answers meanwhile); while its MPS daemon hangs,
/// or answers but a CUDA client through it is not bound by MPS (the fake CUDA library: the
/// agent binary's `mps-client-probe`), it stays so; once all answer, `recoveryProbes` good
/// probes in a row give it back; every transition counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gpu_marked_unhealthy_is_probed_back_to_health() -> Result<()> {
    let expected = example("l4-4x-pcie.yaml")?;
    let mut node = Node::new("l4-4x-pcie.yaml", Backend::FakeNvml).await?;
    let fake = node.nvml.take().context("the fake NVML")?;
    let cuda = baleen_tests::fake_cuda::FakeCuda::new()?;
    node.config.health = baleen_agent::run::health::HealthConfig {
        probe_interval: Duration::from_millis(150),
        recovery_probes: 3,
        mps_client: Some(baleen_agent::isolation::mps::client_probe::ClientProbe {
            program: agent_binary()?,
            library: cuda.library(),
            timeout: Duration::from_secs(5),
        }),
    };
    node.config.mps.probe_timeout = Duration::from_millis(300);
    // With the API: each transition is an Event on the node.
    let api = baleen_tests::fake_apiserver::FakeApiServer::start(&["node-a"]).await?;
    let (agent, token) =
        node.start_with(Some(baleen_agent::kube_api::KubeNodeApi::at(&api.url())?)).await?;
    node.registered(&agent, 1).await?;
    let gpu = expected.gpus[1].uuid.to_string();
    let units_are = |healthy: bool| {
        let gpu = gpu.clone();
        move |v: &KubeletView| {
            let units = unit_health(v, &gpu);
            !units.is_empty() && units.iter().all(|s| (*s == HEALTHY) == healthy)
        }
    };
    // The GPU falls off the bus: its reads fail, then they hang.
    fake.set_faults(&["fail nvmlDeviceGetMemoryInfo_v2 1 15"])?;
    let seen = tokio::time::timeout(WAIT, async {
        loop {
            fake.inject_xid(1, 79)?;
            if node
                .kubelet
                .wait_for("unhealthy", Duration::from_millis(300), units_are(false))
                .await
                .is_ok()
            {
                return anyhow::Ok(());
            }
        }
    });
    seen.await??;
    tokio::time::sleep(Duration::from_millis(900)).await;
    assert!(units_are(false)(&node.kubelet.view()), "given back while its reads fail");
    fake.set_faults(&["hang nvmlDeviceGetMemoryInfo_v2 1 1500"])?;
    let address = agent.metrics_address().context("metrics")?;
    let asked = std::time::Instant::now();
    http_get(address, "/metrics").await?;
    assert!(asked.elapsed() < Duration::from_millis(800), "the endpoint waited on NVML");
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert!(units_are(false)(&node.kubelet.view()), "given back while its probe hangs");
    // NVML answers again, but the GPU's MPS daemon hangs: no probe counts as good.
    directive(&node, &gpu, "hang")?;
    let enforced = |agent: &Agent| {
        agent.resources().snapshot().0.iter().any(|g| g.uuid == gpu && g.shares_enforced)
    };
    tokio::time::timeout(WAIT, async {
        while enforced(&agent) {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .context("the daemon seen hanging")?;
    fake.set_faults(&[])?;
    // Long enough for a hung probe still in flight (1.5 s) and three good ones after it (the
    // health thread steps at least every 500 ms).
    tokio::time::sleep(Duration::from_millis(5000)).await;
    // (Its units are withdrawn by the MPS supervisor anyway; the whole GPU shows its health.)
    let whole_healthy =
        |v: &KubeletView| v.devices_of(GPU).iter().any(|d| d.id == gpu && d.health == HEALTHY);
    assert!(!whole_healthy(&node.kubelet.view()), "given back while its MPS daemon hangs");
    // The daemon answers, but a CUDA client through it runs without MPS (its free memory is the
    // whole GPU's, not the probe's 64 MiB limit): still no good probe.
    cuda.set_directive("nomps")?;
    directive(&node, &gpu, "")?;
    tokio::time::timeout(WAIT, async {
        while !enforced(&agent) {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .context("the daemon seen answering")?;
    let without_mps = |probes: &[String]| probes.iter().filter(|l| l.ends_with("mps=0")).count();
    tokio::time::timeout(WAIT, async {
        while without_mps(&cuda.probes()) < 4 {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .with_context(|| format!("four client probes without MPS: {:?}", cuda.probes()))?;
    assert!(!units_are(true)(&node.kubelet.view()), "given back while no MPS client works");
    // A client works through the daemon: healthy after three good probes.
    cuda.set_directive("")?;
    node.kubelet.wait_for("healthy again", WAIT, units_are(true)).await?;
    let pipe = node.config.mps.pipe_dir(&gpu);
    let expected_probe = format!("probe visible={gpu} pipe={} limit=0=64M mps=1", pipe.display());
    let probes = cuda.probes();
    assert!(
        probes.iter().filter(|l| **l == expected_probe).count() >= 3,
        "three good client probes with the GPU, its pipe and the limit: {probes:?}"
    );
    let text = http_get(address, "/metrics").await?.1;
    for (to, n) in [("unhealthy", 1.0), ("healthy", 1.0)] {
        let got = sample(
            &text,
            "baleen_gpu_health_transitions_total",
            &[("gpu_uuid", gpu.as_str()), ("to", to)],
        );
        assert_eq!(got, Some(n), "{to}");
    }
    let events = tokio::time::timeout(WAIT, async {
        loop {
            let events = watchdog_events(&api);
            if events.iter().any(|e| e.0 == "GpuHealthy") {
                return events;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .context("the GPU's Events")?;
    let reasons: Vec<&str> = events.iter().map(|e| e.0.as_str()).collect();
    assert_eq!(reasons, ["GpuUnhealthy", "GpuHealthy"], "{events:?}");
    assert!(events.iter().all(|e| e.1 == "node-a" && e.2.contains(&gpu)), "{events:?}");
    assert!(events[0].2.contains("critical XID 79"), "{events:?}");
    stop(agent, token).await
}

/// Issue 22, item 5: under concurrency (16 clients at once, one write covering many of them)
/// every grant is on disk before it is answered: each client reads the checkpoint the moment
/// its answer arrives and finds its devices there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_grants_are_each_durable_before_they_are_answered() -> Result<()> {
    let mut node = Node::new("h200-8x-nvswitch.yaml", Backend::Simulated).await?;
    // Never listed (raw Allocates): kept for the whole test.
    node.config.reconcile_grace = Duration::from_secs(600);
    let (agent, token) = node.start().await?;
    let view = node.registered(&agent, 1).await?;
    let mut free = view.healthy(MEM);
    free.sort();
    let checkpoint = baleen_agent::checkpoint::Checkpoint::in_dir(&node.config.state_dir);
    let kubelet = &node.kubelet;
    // Sixteen clients in flight at once (one task, their requests interleaved).
    let clients = (0..16).map(|_| {
        let ids: Vec<String> = free.drain(..20).collect();
        let checkpoint = checkpoint.clone();
        async move {
            for id in ids {
                kubelet
                    .allocate_raw(MEM, vec![vec![id.clone()]])
                    .await
                    .map_err(|e| anyhow::anyhow!("{e:?}"))?;
                // The snapshot and its journal, read as a restart would.
                let held = checkpoint.load("node-a", "boot-1")?.context("a checkpoint")?;
                anyhow::ensure!(
                    held.allocations.iter().any(|r| r.device_ids == [id.clone()]),
                    "{id} answered before it was on disk"
                );
            }
            anyhow::Ok(())
        }
    });
    let clients: Vec<_> = clients.collect();
    futures::future::try_join_all(clients).await?;
    assert_eq!(agent.resources().records().len(), 320);
    stop(agent, token).await
}

/// Issue 22, item 5: a checkpoint that cannot be written refuses the grants it was to hold
/// (Internal), and their devices stay held: never handed out twice; once it can be written
/// again, grants go on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkpoint_that_cannot_be_written_refuses_the_grant_and_hands_nothing_out_twice()
-> Result<()> {
    let node = Node::new("l4-4x-pcie.yaml", Backend::Simulated).await?;
    let (agent, token) = node.start().await?;
    let view = node.registered(&agent, 1).await?;
    let mut free = view.healthy(MEM);
    free.sort();
    let checkpoint = baleen_agent::checkpoint::Checkpoint::in_dir(&node.config.state_dir);
    // The journal removed under the agent (an append would go nowhere), and the snapshot's
    // temporary path taken by a directory (no new snapshot can be written either).
    let blocker = PathBuf::from(format!("{}.tmp", node.checkpoint().display()));
    std::fs::create_dir_all(&blocker)?;
    std::fs::remove_file(checkpoint.journal_path())?;
    for unit in &free[..2] {
        let refused = node.kubelet.allocate_raw(MEM, vec![vec![unit.clone()]]).await;
        assert!(refused.is_err(), "answered though not durable");
        assert!(format!("{refused:?}").contains("Internal"), "{refused:?}");
    }
    std::fs::remove_dir(&blocker)?;
    let again = node.kubelet.allocate_raw(MEM, vec![vec![free[0].clone(), free[2].clone()]]).await;
    assert!(again.is_err(), "the refused grant's unit handed out again: {again:?}");
    node.kubelet
        .allocate_raw(MEM, vec![vec![free[2].clone()]])
        .await
        .map_err(|e| anyhow::anyhow!("{e:?}"))?;
    let held = checkpoint.load("node-a", "boot-1")?.context("a checkpoint")?;
    let on_disk: Vec<&String> = held.allocations.iter().flat_map(|r| &r.device_ids).collect();
    for unit in &free[..3] {
        assert!(on_disk.contains(&unit), "{unit} held, on disk now: {on_disk:?}");
    }
    stop(agent, token).await
}

/// The agent binary beside this test's executable (`target/<profile>/baleen-agent`), built by
/// `cargo test --workspace` with the agent's own integration tests.
fn agent_binary() -> Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let binary = exe
        .parent()
        .and_then(Path::parent)
        .map(|profile| profile.join("baleen-agent"))
        .context("the test's target directory")?;
    anyhow::ensure!(
        binary.is_file(),
        "{} is missing: build it with `cargo build -p baleen-agent` (or run `cargo test --workspace`, which builds it)",
        binary.display()
    );
    Ok(binary)
}

/// Issue 22, item 5: the agent as its own process, SIGKILLed in the middle of bursts of
/// concurrent grants, round after round: every grant answered before a kill is held by every
/// later agent (read back from the snapshot and its journal), none is held twice, and the
/// journal's torn tail, if the kill left one, costs nothing answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_during_bursts_of_grants_loses_no_answered_grant() -> Result<()> {
    const ROUNDS: u64 = 20;
    let binary = agent_binary()?;
    let tmp = tempfile::tempdir()?;
    let root = tmp.path();
    let layout = AgentConfig::for_root(root);
    let mut kubelet = FakeKubelet::start(&layout.device_plugin_dir).await?;
    kubelet.serve_pod_resources(&layout.pod_resources_socket)?;
    std::fs::write(root.join("boot_id"), "boot-1\n")?;
    let topology =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../packaging/examples/h200-8x-nvswitch.yaml");
    let spawn = || {
        baleen_tests::bench::agent_process(&binary, &topology, root, "node-a")
            .args(["--metrics-address", "127.0.0.1:0", "--memory-unit", "256MiB"])
            .arg("--boot-id-file")
            .arg(root.join("boot_id"))
            .args(["--log-level", "warn"])
            .spawn()
    };
    let kubelet = Arc::new(kubelet);
    let mut answered: Vec<String> = Vec::new();
    let mut free: Vec<String> = Vec::new();
    for round in 1..=ROUNDS {
        let mut child = spawn()?;
        kubelet.wait_registered(MEM, round).await?;
        let view = kubelet.wait_for("units offered", WAIT, |v| v.healthy(MEM).len() > 4000).await?;
        if free.is_empty() {
            free = view.healthy(MEM);
            free.sort();
        }
        // Sixteen clients granting one unit at a time until the kill; an ID is tried once, ever.
        let burst: Vec<Vec<String>> = (0..16).map(|_| free.drain(..12).collect()).collect();
        let first = Arc::new(tokio::sync::Notify::new());
        let clients: Vec<_> = burst
            .into_iter()
            .map(|ids| {
                let (kubelet, first) = (kubelet.clone(), first.clone());
                tokio::spawn(async move {
                    let mut ok = Vec::new();
                    for id in ids {
                        if kubelet.allocate_raw(MEM, vec![vec![id.clone()]]).await.is_err() {
                            break;
                        }
                        ok.push(id);
                        first.notify_one();
                    }
                    ok
                })
            })
            .collect();
        // Killed at a different point of the burst each round, once it has begun.
        tokio::time::timeout(WAIT, first.notified()).await.context("a first grant")?;
        tokio::time::sleep(Duration::from_millis((37 * round) % 130)).await;
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(i32::try_from(child.id())?),
            nix::sys::signal::Signal::SIGKILL,
        )?;
        let _ = child.wait();
        let before = answered.len();
        for c in clients {
            answered.extend(c.await?);
        }
        anyhow::ensure!(
            answered.len() > before,
            "round {round}: no grant answered before the kill"
        );
        // What the next agent will read.
        let held = baleen_agent::checkpoint::Checkpoint::in_dir(&layout.state_dir)
            .load("node-a", "boot-1")?
            .context("a checkpoint")?;
        let mut ids: Vec<&String> = held.allocations.iter().flat_map(|r| &r.device_ids).collect();
        for id in &answered {
            anyhow::ensure!(ids.contains(&id), "round {round}: answered grant {id} lost");
        }
        let all = ids.len();
        ids.sort();
        ids.dedup();
        anyhow::ensure!(ids.len() == all, "round {round}: a unit held twice");
    }
    // The last agent starts from it all and rewrites its checkpoint from its ledger.
    let mut child = spawn()?;
    kubelet.wait_registered(MEM, ROUNDS + 1).await?;
    let held = baleen_agent::checkpoint::Checkpoint::in_dir(&layout.state_dir)
        .load("node-a", "boot-1")?
        .context("a checkpoint")?;
    child.kill()?;
    let _ = child.wait();
    let ids: std::collections::BTreeSet<&String> =
        held.allocations.iter().flat_map(|r| &r.device_ids).collect();
    assert!(answered.iter().all(|id| ids.contains(id)), "every answered grant held");
    assert!(answered.len() as u64 >= ROUNDS, "{} grants answered", answered.len());
    eprintln!("{} grants answered over {ROUNDS} kills, none lost", answered.len());
    Ok(())
}

/// Issue 22, item 7: a GPU NVML cannot read at start is not offered and the others are served;
/// what was held on it stays held (parked, in every checkpoint), and a readable GPU held
/// together with it stays unoffered; a start that reads every GPU restores it all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreadable_gpu_at_start_is_left_out_and_what_it_held_stays_held() -> Result<()> {
    let expected = example("l4-4x-pcie.yaml")?;
    let mut node = Node::new("l4-4x-pcie.yaml", Backend::FakeNvml).await?;
    // Raw Allocates, never listed: kept for the whole test.
    node.config.reconcile_grace = Duration::from_secs(600);
    let uuid = |i: usize| expected.gpus[i].uuid.to_string();
    let (agent, token) = node.start().await?;
    node.registered(&agent, 1).await?;
    let raw = |resource: &'static str, ids: Vec<String>| {
        let kubelet = &node.kubelet;
        async move {
            kubelet.allocate_raw(resource, vec![ids]).await.map_err(|e| anyhow::anyhow!("{e:?}"))
        }
    };
    raw(GPU, vec![uuid(0), uuid(1)]).await?;
    raw(MEM, vec![format!("{}::0", uuid(3)), format!("{}::1", uuid(3))]).await?;
    stop(agent, token).await?;
    // GPU 1 falls off the bus before the next start: its memory cannot be read.
    let fake = node.nvml()?;
    fake.set_faults(&["fail nvmlDeviceGetMemoryInfo_v2 1 15"])?;
    let (agent, token) = node.start().await?;
    node.registered(&agent, 2).await?;
    let view =
        node.kubelet.wait_for("GPU 1 withdrawn", WAIT, |v| v.devices_of(GPU).len() == 3).await?;
    let gpus: BTreeSet<String> = view.devices_of(GPU).iter().map(|d| d.id.clone()).collect();
    assert!(!gpus.contains(&uuid(1)), "the unreadable GPU is not offered: {gpus:?}");
    assert_eq!(view.healthy(GPU), vec![uuid(2)], "GPU 0 is held with GPU 1, GPU 3 is shared");
    assert!(
        unit_health(&view, &uuid(2)).iter().all(|h| *h == HEALTHY),
        "the readable GPUs are served"
    );
    let records = sorted(agent.resources().records());
    assert_eq!(records.len(), 2, "both held: {records:?}");
    assert_eq!(agent.resources().published().state.parked().len(), 1);
    let refused = node.kubelet.allocate_raw(GPU, vec![vec![uuid(0)]]).await;
    assert!(refused.is_err(), "GPU 0 handed out though its holder runs: {refused:?}");
    stop(agent, token).await?;
    // Readable again: everything restored as it was granted.
    fake.set_faults(&[])?;
    let (agent, token) = node.start().await?;
    // (The NVLink groups were not offered while GPU 1 could not be read: registered twice.)
    node.kubelet.wait_registered("awesome-ai-company.com/nvlink-group-2", 2).await?;
    node.kubelet.wait_registered(MEM, 3).await?;
    let view = node.kubelet.wait_registered(GPU, 3).await?;
    assert_eq!(sorted(agent.resources().records()), records);
    assert!(agent.resources().published().state.parked().is_empty());
    // Held whole through this view again: Healthy in it (the kubelet counts them); 3 shared.
    let want: BTreeSet<String> = [uuid(0), uuid(1), uuid(2)].into_iter().collect();
    drop(view);
    node.kubelet
        .wait_for("GPUs 0-2 offered in the gpu view", WAIT, |v| {
            v.healthy(GPU).into_iter().collect::<BTreeSet<_>>() == want
        })
        .await?;
    stop(agent, token).await
}

/// Issue 22, item 7: NVML calls that hang (a GPU lost mid-call) stall only the subsystem that
/// made them: Allocate and `/metrics` answer at once, and the agent stops within seconds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hung_nvml_calls_stop_neither_allocate_nor_the_metrics_nor_a_stop() -> Result<()> {
    let mut node = Node::new("l4-4x-pcie.yaml", Backend::FakeNvml).await?;
    let fake = node.nvml.take().context("the fake NVML")?;
    node.config.watchdog = baleen_agent::isolation::watchdog::WatchdogConfig {
        enabled: true,
        interval: Duration::from_millis(100),
        proc_root: tempfile::tempdir()?.path().to_path_buf(),
        ..Default::default()
    };
    let api = baleen_tests::fake_apiserver::FakeApiServer::start(&["node-a"]).await?;
    let client = baleen_agent::kube_api::KubeNodeApi::at(&api.url())?;
    // The agent on a runtime of its own, dropped at the end without waiting for the threads
    // still inside a hung NVML call.
    let runtime =
        tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let token = CancellationToken::new();
    let (config, inventory, stop_token) =
        (node.config.clone(), node.inventory.clone(), token.clone());
    let agent = tokio::time::timeout(
        WAIT,
        runtime.spawn(async move {
            Agent::start(
                config,
                Dependencies { inventory, registry: Default::default(), node_api: Some(client) },
                stop_token,
            )
            .await
        }),
    )
    .await???;
    node.registered(&agent, 1).await?;
    // The watchdog's process list and the telemetry hang for a minute.
    fake.set_faults(&[
        "hang nvmlDeviceGetComputeRunningProcesses_v3 * 60000",
        "hang nvmlDeviceGetUtilizationRates * 60000",
    ])?;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let asked = std::time::Instant::now();
    node.kubelet.admit_to("ns/a", "c", MEM, 2).await?;
    let address = agent.metrics_address().context("metrics")?;
    assert_eq!(http_get(address, "/metrics").await?.0, 200);
    assert!(asked.elapsed() < Duration::from_secs(2), "waited on NVML: {:?}", asked.elapsed());
    let stopping = std::time::Instant::now();
    token.cancel();
    let stopped = runtime.spawn(async move { agent.wait().await });
    tokio::time::timeout(Duration::from_secs(5), stopped).await.context("stop")???;
    assert!(stopping.elapsed() < Duration::from_secs(5));
    runtime.shutdown_background();
    Ok(())
}
