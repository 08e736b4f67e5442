//! Issue 40, item 3 (in part): the real kube-scheduler, configured as the chart configures it,
//! calls baleen's extender (the release binary's verbs, its real watches of the API server, run
//! with a real token of the chart's scheduler account) and binds GPU pods where the extender
//! chooses. The Nodes are API objects with the capacity a kubelet would set and the gpu-state
//! an agent would publish (written here; real agents publishing it are the rest of the item).

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail, ensure};
use serde_json::{Value, json};

use crate::control_plane::{ControlPlane, with_control_plane};

const CHART: &str = "packaging/helm/baleen";
const NAMESPACE: &str = "baleen-system";
const DOMAIN: &str = "awesome-ai-company.com";

/// Creates or patches objects as the admin from JSON written to a file.
fn kubectl_json(plane: &ControlPlane, verb: &[&str], object: &Value) -> Result<()> {
    let file = plane.path(&format!("object-{}.json", rand::random::<u64>()));
    std::fs::write(&file, serde_json::to_vec(object)?)?;
    let mut args = verb.to_vec();
    let path = file.display().to_string();
    args.extend(["-f", &path]);
    plane.kubectl(&args).map(drop)
}

/// Node `name` as a kubelet and its agent would leave it: 8 H200s with `free` units each in
/// its gpu-state, the device plugins' counts in its capacity.
fn add_node(plane: &ControlPlane, name: &str, free: &[u32]) -> Result<()> {
    let state = baleen_k8s::fixtures::h200_state(name, free);
    kubectl_json(
        plane,
        &["create"],
        &json!({"apiVersion": "v1", "kind": "Node",
                "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name},
                             "annotations": {format!("{DOMAIN}/gpu-state"): state.to_json()}}}),
    )?;
    let units = (free.len() * 140).to_string();
    let resources = json!({"cpu": "96", "memory": "1000Gi", "pods": "110",
                           format!("{DOMAIN}/gpu-memory"): units,
                           format!("{DOMAIN}/gpu"): free.len().to_string()});
    let status = json!({"status": {"capacity": resources, "allocatable": resources,
        "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                        "message": "a Node object of the real-control-plane lane",
                        "lastHeartbeatTime": "2026-01-01T00:00:00Z",
                        "lastTransitionTime": "2026-01-01T00:00:00Z"}]}});
    plane.kubectl(&[
        "patch",
        "node",
        name,
        "--subresource=status",
        "--type=merge",
        "-p",
        &status.to_string(),
    ])?;
    // The API server taints every new Node not-ready (the TaintNodesByCondition admission
    // plugin) until the node lifecycle controller sees it Ready; with no kubelet here that
    // controller is off, so the taint is taken off as it would.
    plane.kubectl(&["taint", "node", name, "node.kubernetes.io/not-ready:NoSchedule-"])?;
    Ok(())
}

/// A tenant's pod asking for `units` of gpu-memory, sent to baleen's scheduler (the webhook
/// would set it: not run here).
fn gpu_pod(name: &str, units: u32) -> Value {
    json!({"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": name, "namespace": "team-a"},
           "spec": {"schedulerName": "baleen-scheduler",
                    "securityContext": {"runAsNonRoot": true, "runAsUser": 65534},
                    "containers": [{"name": "c", "image": "x",
                        "securityContext": {"allowPrivilegeEscalation": false},
                        "resources": {"limits": {format!("{DOMAIN}/gpu-memory"): units.to_string()},
                                      "requests": {"cpu": "4", "memory": "16Gi"}}}]}})
}

/// Where `pod` was bound, once it is (at most `within`).
async fn bound(plane: &ControlPlane, pod: &str, within: Duration) -> Result<String> {
    let started = Instant::now();
    loop {
        let node = plane.kubectl(&[
            "get",
            "pod",
            pod,
            "-n",
            "team-a",
            "-o",
            "jsonpath={.spec.nodeName}",
        ])?;
        if !node.trim().is_empty() {
            return Ok(node.trim().to_owned());
        }
        if started.elapsed() > within {
            let events = plane.kubectl(&["get", "events", "-n", "team-a"]).unwrap_or_default();
            bail!("pod {pod} not bound within {within:?}; events:\n{events}");
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// A process killed when dropped.
struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test]
#[ignore = "real-control-plane lane: BALEEN_KUBE=$(scripts/build-control-plane.sh), --ignored"]
async fn the_real_scheduler_binds_gpu_pods_where_the_extender_chooses() {
    with_control_plane(async |plane| {
        // No webhook: the API server would call it at the Service's cluster IP, which is not on
        // this machine (the lane stays on loopback); the pods name baleen's scheduler themselves.
        plane.helm(&[
            "install",
            "baleen",
            CHART,
            "-n",
            NAMESPACE,
            "--create-namespace",
            "--set",
            "webhook.enabled=false",
        ])?;
        plane.kubectl(&["create", "namespace", "team-a"])?;
        // Each node's capacity counts 1,120 gpu-memory units (8 GPUs), all of them free as
        // kube-scheduler counts (no pod holds any): only the gpu-state says which single GPU
        // has room. node-0: one GPU with 20 units free; node-1: one with 100; node-2: two with 60.
        add_node(plane, "node-0", &[20, 0, 0, 0, 0, 0, 0, 0])?;
        add_node(plane, "node-1", &[100, 0, 0, 0, 0, 0, 0, 0])?;
        add_node(plane, "node-2", &[60, 60, 0, 0, 0, 0, 0, 0])?;
        // The extender and kube-scheduler share the chart's scheduler account (one pod).
        let token = plane.kubectl(&[
            "create",
            "token",
            "baleen-scheduler",
            "-n",
            NAMESPACE,
            "--duration",
            "1h",
        ])?;
        let kubeconfig = plane.kubeconfig_with_token("baleen-scheduler", token.trim())?;
        let port = |()| -> Result<u16> {
            Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
        };
        let (verbs, metrics, probes) = (port(())?, port(())?, port(())?);
        let extender_log = plane.path("baleen-extender.log");
        let log = std::fs::File::create(&extender_log)?;
        let extender = Running(
            Command::new(baleen_tests::tools::workspace_binary("baleen-extender")?)
                .args([
                    &format!("--listen=127.0.0.1:{verbs}"),
                    &format!("--metrics-listen=127.0.0.1:{metrics}"),
                    &format!("--probe-listen=127.0.0.1:{probes}"),
                    "--scheduler-name=baleen-scheduler",
                    &format!("--domain={DOMAIN}"),
                ])
                .env("KUBECONFIG", &kubeconfig)
                .stdin(Stdio::null())
                .stdout(log.try_clone()?)
                .stderr(log)
                .spawn()
                .context("cannot start baleen-extender")?,
        );
        let result = async {
            // Ready once its watches have listed the Nodes and Pods with that account.
            let started = Instant::now();
            loop {
                let probe = Command::new(baleen_tests::tools::workspace_binary("baleen-extender")?)
                    .args(["probe", &format!("http://127.0.0.1:{probes}/readyz")])
                    .output()?;
                if probe.status.success() {
                    break;
                }
                if started.elapsed() > Duration::from_secs(30) {
                    bail!("the extender was not ready within 30 s");
                }
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
            // kube-scheduler with the chart's configuration, the extender at its address.
            let rendered = plane.helm(&["template", "baleen", CHART, "-n", NAMESPACE])?;
            let config = serde_yaml_ng::Deserializer::from_str(&rendered)
                .filter_map(|d| <Value as serde::Deserialize>::deserialize(d).ok())
                .find(|v| v["metadata"]["name"] == "baleen-scheduler-config")
                .and_then(|v| v["data"]["config.yaml"].as_str().map(str::to_owned))
                .context("the scheduler's configuration")?;
            ensure!(
                config.contains("http://127.0.0.1:8888"),
                "the extender's address moved: {config}"
            );
            let config =
                config.replace("http://127.0.0.1:8888", &format!("http://127.0.0.1:{verbs}"));
            let file = plane.path("baleen-scheduler.yaml");
            std::fs::write(
                &file,
                format!("{config}clientConnection:\n  kubeconfig: {}\n", kubeconfig.display()),
            )?;
            let secure = format!("--secure-port={}", port(())?);
            plane.spawn(
                "kube-scheduler",
                &[&format!("--config={}", file.display()), &secure, "--bind-address=127.0.0.1"],
            )?;
            let started = Instant::now();
            while plane.kubectl(&["get", "serviceaccount", "default", "-n", "team-a"]).is_err() {
                ensure!(
                    started.elapsed() < Duration::from_secs(30),
                    "no default account in team-a"
                );
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
            // 100 units: only node-1 has a GPU with room.
            kubectl_json(plane, &["create"], &gpu_pod("large", 100))?;
            let node = bound(plane, "large", Duration::from_secs(60)).await?;
            ensure!(
                node == "node-1",
                "the 100-unit pod went to {node}: only node-1 has a GPU with room"
            );
            // Another 100: node-1's GPU is taken (the extender counts the pod it bound there at
            // once, before any agent rewrites the gpu-state): no node has room; it waits.
            kubectl_json(plane, &["create"], &gpu_pod("large-2", 100))?;
            tokio::time::sleep(Duration::from_secs(5)).await;
            let node = plane.kubectl(&[
                "get",
                "pod",
                "large-2",
                "-n",
                "team-a",
                "-o",
                "jsonpath={.spec.nodeName}",
            ])?;
            ensure!(node.trim().is_empty(), "a second 100-unit pod was bound to {node}");
            let events = plane.kubectl(&[
                "get",
                "events",
                "-n",
                "team-a",
                "--field-selector",
                "involvedObject.name=large-2",
                "-o",
                "jsonpath={.items[*].message}",
            ])?;
            ensure!(
                events.contains("FailedScheduling") || events.contains("nodes are available"),
                "no scheduling failure said: {events}"
            );
            // 20 units: node-0 or node-2, never node-1.
            kubectl_json(plane, &["create"], &gpu_pod("small", 20))?;
            let node = bound(plane, "small", Duration::from_secs(60)).await?;
            ensure!(node != "node-1", "the 20-unit pod went to node-1, whose GPU is taken");
            // The extender bound both (its bind verb): its counter says so.
            let scrape = http_get(&format!("http://127.0.0.1:{metrics}/metrics"))?;
            let bound_count = scrape
                .lines()
                .find(|l| l.starts_with("baleen_extender_bindings_total") && l.contains("bound"))
                .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                .context("baleen_extender_bindings_total{result=\"bound\"}")?;
            ensure!(bound_count >= 2.0, "the extender bound {bound_count} pods:\n{scrape}");
            Ok(())
        }
        .await;
        drop(extender);
        result.map_err(|e| {
            let log = std::fs::read_to_string(&extender_log).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(30).collect();
            e.context(format!(
                "baleen-extender's log, last lines:\n{}",
                tail.into_iter().rev().collect::<Vec<_>>().join("\n")
            ))
        })
    })
    .await;
}

/// One plain HTTP GET on loopback; the body.
fn http_get(url: &str) -> Result<String> {
    use std::io::{Read as _, Write as _};
    let rest = url.strip_prefix("http://").context("http only")?;
    let (host, path) = rest.split_once('/').context("a path")?;
    let mut stream = std::net::TcpStream::connect(host)?;
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(stream, "GET /{path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n")?;
    let mut text = String::new();
    stream.read_to_string(&mut text)?;
    let (_, body) = text.split_once("\r\n\r\n").context("an HTTP answer")?;
    Ok(body.to_owned())
}
