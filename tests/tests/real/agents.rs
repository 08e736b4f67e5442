//! Issue 40, item 3: the gpu-state the real kube-scheduler places by is the one real agents
//! publish. Three agents (the workspace's binary, device-plugin mode, each on a simulated
//! topology: 8x H200, 4x L4, 4x A100 with MIG) write their Nodes' gpu-state through the real API
//! server with real tokens of the agent account (the chart's policies in force); the extender
//! reads them, and kube-scheduler, as the chart configures it, sends a pod larger than any L4
//! or A100 to the H200 node and a MIG slice to the A100 node. Each agent registers with a fake
//! kubelet (the real one is issue 41's), and its Node's capacity and allocatable are set as the
//! kubelet sets them: each resource's device count, its healthy devices.

use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail, ensure};
use serde_json::{Value, json};

use baleen_k8s::gpu_state::NodeGpuState;
use baleen_proto::deviceplugin::v1beta1 as api;
use baleen_tests::fake_kubelet::FakeKubelet;
use baleen_tests::real::agent::SimulatedAgent;
use baleen_tests::real::scheduling::{DOMAIN, Extender, SchedulerConfig, scheduler_kubeconfig};
use baleen_tests::real::{ControlPlane, with_control_plane};

/// The simulated nodes: name, topology and the resources (of `DOMAIN`) its agent registers at
/// least.
const NODES: [(&str, &str, &[&str]); 3] = [
    ("node-h200", "h200-8x-nvswitch.yaml", &["gpu-memory", "gpu"]),
    ("node-l4", "l4-4x-pcie.yaml", &["gpu-memory", "gpu"]),
    ("node-a100", "a100-4x-mig.yaml", &["gpu-memory", "gpu", "mig-1g.10gb"]),
];

/// Sets Node `name`'s status as its kubelet would once the agent registered `resources` with
/// `kubelet`:
/// each baleen resource's device count in capacity, its healthy devices in allocatable, Ready;
/// the not-ready taint taken off as the node lifecycle controller would.
async fn set_status(
    plane: &ControlPlane,
    name: &str,
    kubelet: &FakeKubelet,
    resources: &[&str],
) -> Result<()> {
    let names: Vec<String> = resources.iter().map(|r| format!("{DOMAIN}/{r}")).collect();
    kubelet
        .wait_for(&format!("{name}'s agent's {resources:?}"), Duration::from_secs(60), |v| {
            names.iter().all(|r| v.devices.get(r).is_some_and(|d| !d.is_empty()))
        })
        .await?;
    let view = kubelet.view();
    let mut capacity = json!({"cpu": "96", "memory": "1000Gi", "pods": "110"});
    let mut allocatable = capacity.clone();
    for (resource, devices) in &view.devices {
        let healthy = devices.iter().filter(|d| d.health == api::HEALTHY).count();
        capacity[resource] = devices.len().to_string().into();
        allocatable[resource] = healthy.to_string().into();
    }
    plane.node_ready(name, &capacity, &allocatable)?;
    Ok(())
}

/// The gpu-state on Node `name`, once its agent has written it.
async fn published(
    plane: &ControlPlane,
    name: &str,
    agent: &mut SimulatedAgent,
) -> Result<NodeGpuState> {
    let started = Instant::now();
    let key = format!("{DOMAIN}/gpu-state").replace('.', "\\.").replace('/', "\\/");
    loop {
        if let Some(status) = agent.exited()? {
            bail!("the agent of {name} exited ({status})\n{}", agent.log_tail(30));
        }
        let text = plane.kubectl(&[
            "get",
            "node",
            name,
            "-o",
            &format!("jsonpath={{.metadata.annotations.{key}}}"),
        ])?;
        if !text.trim().is_empty() {
            return NodeGpuState::parse(text.trim())
                .with_context(|| format!("the gpu-state {name}'s agent wrote: {text}"));
        }
        if started.elapsed() > Duration::from_secs(60) {
            bail!("no gpu-state on {name} within 60 s\n{}", agent.log_tail(30));
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

fn pod(name: &str, resource: &str, count: u32) -> Value {
    json!({"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": name, "namespace": "team-a"},
           "spec": {"schedulerName": "baleen-scheduler",
                    "securityContext": {"runAsNonRoot": true, "runAsUser": 65534},
                    "containers": [{"name": "c", "image": "x",
                        "securityContext": {"allowPrivilegeEscalation": false},
                        "resources": {"limits": {format!("{DOMAIN}/{resource}"): count.to_string()}}}]}})
}

#[tokio::test]
#[ignore = "real-control-plane lane: BALEEN_KUBE=$(scripts/build-control-plane.sh), --ignored"]
async fn the_scheduler_places_by_the_gpu_state_real_agents_publish() {
    with_control_plane(async |plane| {
        plane.install(&["--set", "webhook.enabled=false"])?;
        plane.kubectl(&["create", "namespace", "team-a"])?;
        let mut agents = Vec::new();
        let mut kubelets = Vec::new();
        for (name, topology, _) in NODES {
            plane.create(&json!({"apiVersion": "v1", "kind": "Node",
                "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}}}))?;
            let dir = SimulatedAgent::node_dir(plane, name);
            let mut kubelet = FakeKubelet::start(&dir.join("device-plugins")).await?;
            kubelet.serve_pod_resources(&dir.join("pod-resources.sock"))?;
            kubelets.push(kubelet);
            agents.push(SimulatedAgent::start(
                plane,
                name,
                topology,
                "annotation:\n  enabled: true\n",
            )?);
        }
        for ((name, _, resources), kubelet) in NODES.iter().zip(&kubelets) {
            set_status(plane, name, kubelet, resources).await?;
        }
        let mut states = Vec::new();
        for ((name, _, _), agent) in NODES.iter().zip(&mut agents) {
            let state = published(plane, name, agent).await?;
            ensure!(state.node == *name, "{name}'s agent wrote the state of {}", state.node);
            states.push(state);
        }
        let largest = |s: &NodeGpuState| s.gpus.iter().map(|g| g.units_free).max().unwrap_or(0);
        let (h200, l4, a100) = (largest(&states[0]), largest(&states[1]), largest(&states[2]));
        ensure!(
            h200 > 100 && l4 < 100 && a100 < 100,
            "the topologies' largest free GPUs: H200 {h200}, L4 {l4}, A100 {a100} units"
        );
        let slices = |s: &NodeGpuState| s.gpus.iter().map(|g| g.mig.len()).sum::<usize>();
        ensure!(
            slices(&states[2]) > 0 && slices(&states[0]) == 0 && slices(&states[1]) == 0,
            "only the A100 node has MIG slices"
        );
        let kubeconfig = scheduler_kubeconfig(plane)?;
        let extender = Extender::start(
            plane,
            &kubeconfig,
            &["webhook.enabled=false"],
            None,
            Duration::from_secs(30),
        )
        .await?;
        let result = async {
            SchedulerConfig::as_the_chart(extender.verbs).spawn(plane, &kubeconfig)?;
            plane.default_account("team-a", Duration::from_secs(30)).await?;
            plane.create(&pod("large", "gpu-memory", 100))?;
            let node = plane.bound("team-a", "large", Duration::from_secs(60)).await?;
            ensure!(node == "node-h200", "a 100-unit pod went to {node}: only an H200 has room");
            plane.create(&pod("slice", "mig-1g.10gb", 1))?;
            let node = plane.bound("team-a", "slice", Duration::from_secs(60)).await?;
            ensure!(node == "node-a100", "a MIG slice went to {node}: only the A100 node has one");
            Ok(())
        }
        .await;
        result.map_err(|e| e.context(extender.log_tail(30)))
    })
    .await;
}
