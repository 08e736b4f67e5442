//! Issue 26, item 7: the DRA mode's Prepare and the agent's memory in DRA mode, in one run.
//!
//! 1. In-process, the simulated 8x H200 (1 GiB units, the fake MPS daemons) served as a DRA
//!    driver against the fake API server: `NodePrepareResources` of a batch of one claim (a
//!    1 GiB share, read from the API server, booked in the ledger, on disk, CDI spec written)
//!    over the real Unix socket with tonic's client, 300 times as claims pile up (0-300
//!    prepared, then 600-900); the same claim prepared again (answered from the ledger); and
//!    `NodeUnprepareResources`.
//! 2. The release agent as its own process in DRA mode (`driver: dra`, KUBECONFIG naming the
//!    fake API server; build it first with `cargo build --release -p baleen-agent`, or set
//!    `BALEEN_AGENT_BIN`): RSS (`VmRSS`) and peak (`VmHWM`) after its start, and after 1,000
//!    claims prepared.
//!
//! Run: `cargo bench -p baleen-tests --bench dra_prepare`.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use baleen_agent::dra::{DraConfig, DriverMode};
use baleen_agent::kube_api::KubeNodeApi;
use baleen_agent::ledger::ViewConfig;
use baleen_proto::dra::v1;
use baleen_tests::bench::report_memory as report;
use baleen_tests::fake_apiserver::FakeApiServer;
use serde_json::json;

const DRIVER: &str = "gpu.awesome-ai-company.com";

fn line(label: &str, samples: &mut [Duration]) {
    baleen_tests::bench::latency_line(label, 44, samples);
}

/// A claim `n` of one 1 GiB share on `gpu-<n mod 8>`, as the scheduler allocates it.
fn claim(n: usize) -> serde_json::Value {
    json!({
        "metadata": {"name": format!("c{n}"), "namespace": "bench", "uid": format!("uid-{n}")},
        "spec": {},
        "status": {
            "allocation": {"devices": {"results": [{
                "request": "gpu", "driver": DRIVER, "pool": "node-a", "device": format!("gpu-{}", n % 8),
                "consumedCapacity": {"memory": "1Gi"}, "shareID": format!("s{n}")
            }]}},
            "reservedFor": [{"resource": "pods", "name": format!("p{n}"), "uid": format!("pod-{n}")}]
        }
    })
}

fn asked(n: usize) -> v1::NodePrepareResourcesRequest {
    v1::NodePrepareResourcesRequest {
        claims: vec![v1::Claim {
            namespace: "bench".into(),
            name: format!("c{n}"),
            uid: format!("uid-{n}"),
        }],
    }
}

type Client = v1::dra_plugin_client::DraPluginClient<tonic::transport::Channel>;

async fn client(socket: &Path) -> anyhow::Result<Client> {
    let channel = baleen_device_plugin::uds::connect(socket, Duration::from_secs(10)).await?;
    Ok(v1::dra_plugin_client::DraPluginClient::new(channel))
}

/// Prepares claims `range` one batch each; each call's latency.
async fn prepare(c: &mut Client, range: std::ops::Range<usize>) -> anyhow::Result<Vec<Duration>> {
    let mut samples = Vec::new();
    for n in range {
        let started = Instant::now();
        let answer = c.node_prepare_resources(asked(n)).await?.into_inner();
        samples.push(started.elapsed());
        let error = &answer.claims[&format!("uid-{n}")].error;
        anyhow::ensure!(error.is_empty(), "claim {n}: {error}");
    }
    Ok(samples)
}

async fn in_process() -> anyhow::Result<()> {
    let tmp = tempfile::tempdir()?;
    let root = tmp.path();
    let mut config = baleen_tests::bench::agent_config(
        root,
        "node-a",
        ViewConfig::default(),
        Path::new(env!("CARGO_BIN_EXE_fake-mps-control")),
    );
    let mut dra = DraConfig::new(DRIVER);
    dra.registry_dir = root.join("plugins_registry");
    dra.plugin_dir = root.join("plugins").join(DRIVER);
    dra.cdi_dir = root.join("run-cdi");
    std::fs::create_dir_all(&dra.registry_dir)?;
    config.driver = DriverMode::Dra(dra.clone());
    std::fs::write(&config.boot_id_file, "b")?;
    let api = FakeApiServer::start(&["node-a"]).await?;
    for n in 0..1_000 {
        api.put_resource_claim(claim(n));
    }
    let inventory = baleen_agent::inventory::simulated::SimulatedInventory::from_file(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("../packaging/examples/h200-8x-nvswitch.yaml"),
    )?;
    let token = tokio_util::sync::CancellationToken::new();
    let node_api: Arc<dyn baleen_agent::kube_api::NodeApi> = KubeNodeApi::at(&api.url())?;
    let agent = baleen_agent::run::Agent::start(
        config,
        baleen_agent::run::Dependencies {
            inventory: Arc::new(inventory),
            node_api: Some(node_api),
        },
        token.clone(),
    )
    .await?;
    // Shares are offered once the MPS daemons answer.
    let wait = Instant::now();
    while agent.resources().shared_gpus().len() < 8
        || agent.resources().published().state.gpu_states().iter().any(|g| !g.shares_enforced)
    {
        anyhow::ensure!(wait.elapsed() < Duration::from_secs(20), "the MPS daemons did not answer");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut c = client(&dra.socket()).await?;
    prepare(&mut c, 0..10).await?;
    line("Prepare, 10-310 claims held", &mut prepare(&mut c, 10..310).await?);
    prepare(&mut c, 310..600).await?;
    line("Prepare, 600-900 claims held", &mut prepare(&mut c, 600..900).await?);
    line("Prepare again (answered as held)", &mut prepare(&mut c, 600..900).await?);
    let mut samples = Vec::new();
    for n in 600..900 {
        let started = Instant::now();
        let request = v1::NodeUnprepareResourcesRequest { claims: asked(n).claims };
        let answer = c.node_unprepare_resources(request).await?.into_inner();
        samples.push(started.elapsed());
        anyhow::ensure!(answer.claims[&format!("uid-{n}")].error.is_empty());
    }
    line("Unprepare, 900-600 claims held", &mut samples);
    token.cancel();
    agent.wait().await?;
    Ok(())
}

fn binary() -> PathBuf {
    std::env::var_os("BALEEN_AGENT_BIN").map_or_else(
        || Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/release/baleen-agent"),
        PathBuf::from,
    )
}

async fn as_process() -> anyhow::Result<()> {
    let binary = binary();
    anyhow::ensure!(
        binary.is_file(),
        "{} is missing: cargo build --release -p baleen-agent (or set BALEEN_AGENT_BIN)",
        binary.display()
    );
    let tmp = tempfile::tempdir()?;
    let root = tmp.path();
    let api = FakeApiServer::start(&["node-a"]).await?;
    for n in 0..1_000 {
        api.put_resource_claim(claim(n));
    }
    let kubeconfig = root.join("kubeconfig");
    std::fs::write(
        &kubeconfig,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: {}\n\
             contexts:\n- name: fake\n  context:\n    cluster: fake\n    user: nobody\n\
             current-context: fake\nusers:\n- name: nobody\n  user: {{}}\n",
            api.url()
        ),
    )?;
    let (registry, plugins, cdi) = (root.join("registry"), root.join("plugins"), root.join("cdi"));
    std::fs::create_dir_all(&registry)?;
    let config = root.join("agent.yaml");
    std::fs::write(
        &config,
        format!(
            "driver: dra\ndra:\n  registryDir: {}\n  pluginDir: {}\n  cdiDir: {}\nmetrics:\n  enabled: false\n",
            registry.display(),
            plugins.display(),
            cdi.display()
        ),
    )?;
    let topology =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../packaging/examples/h200-8x-nvswitch.yaml");
    let mut command = baleen_tests::bench::agent_process(&binary, &topology, root, "node-a");
    command.arg("--config").arg(&config).env("KUBECONFIG", &kubeconfig);
    let mut child = command.spawn()?;
    let pid = child.id();
    let socket = plugins.join("dra.sock");
    let started = Instant::now();
    while !socket.exists() {
        anyhow::ensure!(started.elapsed() < Duration::from_secs(20), "no DRA socket");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    report(pid, "release agent, DRA mode, after start");
    let mut c = client(&socket).await?;
    prepare(&mut c, 0..1_000).await?;
    report(pid, "after 1,000 claims prepared");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(i32::try_from(pid)?),
        nix::sys::signal::Signal::SIGTERM,
    )?;
    let _ = child.wait();
    Ok(())
}

fn main() -> anyhow::Result<()> {
    let runtime =
        tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    runtime.block_on(in_process()).context("in-process Prepare")?;
    runtime.block_on(as_process()).context("the release agent's memory")?;
    Ok(())
}
