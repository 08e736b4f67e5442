//! The whole agent in-process against the fake kubelet (device plugins and pod-resources), on
//! the simulated inventory and on the real NVML backend over the fake `libnvidia-ml.so`, one
//! module per subject; what they share (kubelet views, scrapes, MPS directives, API pods) is
//! here. Every wait has a timeout.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, Result};
use baleen_agent::inventory::GpuInventory;
use baleen_agent::inventory::nvml::NvmlInventory;
use baleen_agent::inventory::simulated::SimulatedInventory;
use baleen_agent::ledger::AllocationRecord;
use baleen_agent::run::{Agent, AgentConfig, Dependencies};
use baleen_k8s::gpu_state::NodeGpuState;
use baleen_proto::deviceplugin::v1beta1::HEALTHY;
use baleen_tests::fake_kubelet::{AdmitError, FakeKubelet, KubeletView};
use baleen_tests::fake_nvml::FakeNvml;
use tokio_util::sync::CancellationToken;
use tonic::Code;

use crate::support::{
    Backend, EXAMPLES, TestNode, WAIT, eventually, example, poll, poll_within, stop, write_cdi_spec,
};

mod allocation;
mod colocation;
mod dra;
mod health;
mod inventory;
mod metrics;
mod mps;
mod node_state;
mod recovery;
mod watchdog;

const GPU: &str = "awesome-ai-company.com/gpu";
const MEM: &str = "awesome-ai-company.com/gpu-memory";

/// The CDI names of an Allocate answer.
fn cdi_names(
    response: &baleen_proto::deviceplugin::v1beta1::ContainerAllocateResponse,
) -> Vec<String> {
    response.cdi_devices.iter().map(|d| d.name.clone()).collect()
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

/// The MPS directory of a GPU (`<mps root>/<UUID>`): `pipe/`, `log/control.log`, and the fake's
/// `fake-directives`.
fn mps_dir(node: &TestNode, gpu: &str) -> PathBuf {
    node.config.mps.root.join(gpu)
}

fn directive(node: &TestNode, gpu: &str, word: &str) -> Result<()> {
    std::fs::create_dir_all(mps_dir(node, gpu))?;
    Ok(std::fs::write(mps_dir(node, gpu).join("fake-directives"), word)?)
}

fn control_log(node: &TestNode, gpu: &str) -> String {
    std::fs::read_to_string(mps_dir(node, gpu).join("log/control.log")).unwrap_or_default()
}

fn daemon_pid(node: &TestNode, gpu: &str) -> Result<i32> {
    let text =
        std::fs::read_to_string(mps_dir(node, gpu).join("pipe/nvidia-cuda-mps-control.pid"))?;
    Ok(text.trim().parse()?)
}

async fn units_are(node: &TestNode, gpu: &str, healthy: bool, what: &str) -> Result<KubeletView> {
    let gpu = gpu.to_owned();
    node.kubelet
        .wait_for(what, WAIT, move |v| {
            let units = unit_health(v, &gpu);
            !units.is_empty() && units.iter().all(|h| (*h == HEALTHY) == healthy)
        })
        .await
}

fn gpus(node: &TestNode) -> Vec<String> {
    let mut gpus: Vec<String> =
        node.kubelet.view().devices_of(GPU).iter().map(|d| d.id.clone()).collect();
    gpus.sort();
    gpus
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

/// Scrapes `/metrics` until `found` answers `Some` of the text (`poll`).
pub(super) async fn scraped<T>(
    address: std::net::SocketAddr,
    what: &str,
    found: impl Fn(&str) -> Option<T>,
) -> Result<T> {
    poll(what, async || Ok(found(&http_get(address, "/metrics").await?.1))).await
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

/// The value of the series whose line starts with `prefix` (`name{labels}`), if any.
fn sample(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    text.lines().filter(|l| l.starts_with(name) && !l.starts_with('#')).find_map(|l| {
        let (series, value) = l.rsplit_once(' ')?;
        let wanted = labels.iter().all(|(k, v)| series.contains(&format!("{k}=\"{v}\"")));
        (series.split('{').next() == Some(name) && wanted).then(|| value.parse().ok()).flatten()
    })
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

fn sorted(mut records: Vec<AllocationRecord>) -> Vec<(String, Vec<String>)> {
    records.sort();
    records.into_iter().map(|r| (r.resource, r.device_ids)).collect()
}

/// The agent binary beside this test's executable (`target/<profile>/baleen-agent`).
fn agent_binary() -> Result<PathBuf> {
    crate::support::workspace_binary("baleen-agent")
}
