//! Issue 40, item 3: the real API server calls baleen's webhook, as the chart installs it (the
//! Service `baleen-extender`, port 443, the certificate the extender makes and the caBundle it
//! publishes), for pods asking for gpu-memory, whole GPUs, a MIG slice and an NVLink group, and
//! the real kube-scheduler places what it sent.
//!
//! The API server calls a webhook at its Service's cluster IP (its default service resolver);
//! with no kube-proxy in the lane, that address is put on the loopback interface for the test
//! (`ip addr add <cluster IP>/32 dev lo`, taken off at its end), and the extender's webhook
//! listens there: the call never leaves the machine.

use std::net::{IpAddr, SocketAddr};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail, ensure};
use serde_json::{Value, json};

use baleen_tests::real::scheduling::{
    DOMAIN, Extender, NAMESPACE, SchedulerConfig, node_objects, scheduler_kubeconfig,
};
use baleen_tests::real::{ControlPlane, with_control_plane};

/// An address put on `lo` for the test's length.
struct OnLoopback(IpAddr);

impl OnLoopback {
    fn add(address: IpAddr) -> Result<Self> {
        let out = Command::new("ip")
            .args(["addr", "add", &format!("{address}/32"), "dev", "lo"])
            .output()
            .context("cannot run ip: the webhook test needs iproute2 (apt-get install iproute2)")?;
        ensure!(
            out.status.success(),
            "cannot put the webhook Service's cluster IP {address} on lo (the test needs root, \
             CAP_NET_ADMIN): {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
        Ok(Self(address))
    }
}

impl Drop for OnLoopback {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["addr", "del", &format!("{}/32", self.0), "dev", "lo"])
            .output();
    }
}

/// A tenant's pod with `resources` on its one container and no scheduler named.
fn pod(name: &str, resources: Value) -> Value {
    json!({"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": name, "namespace": "team-a"},
           "spec": {"securityContext": {"runAsNonRoot": true, "runAsUser": 65534},
                    "tolerations": [{"key": "node.kubernetes.io/not-ready", "operator": "Exists",
                                     "effect": "NoSchedule"}],
                    "containers": [{"name": "c", "image": "x",
                        "securityContext": {"allowPrivilegeEscalation": false},
                        "resources": resources}]}})
}

fn field(plane: &ControlPlane, pod: &str, path: &str) -> Result<String> {
    Ok(plane
        .kubectl(&["get", "pod", pod, "-n", "team-a", "-o", &format!("jsonpath={{{path}}}")])?
        .trim()
        .to_owned())
}

#[tokio::test]
#[ignore = "real-control-plane lane: BALEEN_KUBE=$(scripts/build-control-plane.sh), --ignored"]
async fn the_real_api_server_calls_the_webhook_and_the_scheduler_places_what_it_sent() {
    with_control_plane(async |plane| {
        plane.install(&[])?;
        plane.kubectl(&["create", "namespace", "team-a"])?;
        let ip: IpAddr = plane
            .kubectl(&[
                "get",
                "service",
                "baleen-extender",
                "-n",
                NAMESPACE,
                "-o",
                "jsonpath={.spec.clusterIP}",
            ])?
            .trim()
            .parse()
            .context("the webhook Service's cluster IP")?;
        let _address = OnLoopback::add(ip)?;
        // One node of 8 H200s, all free, as its kubelet and agent leave it.
        let (node, resources) = node_objects("node-0", &[140; 8]);
        plane.create(&node)?;
        plane.node_ready("node-0", &resources, &resources)?;
        let kubeconfig = scheduler_kubeconfig(plane)?;
        let extender = Extender::start(
            plane,
            &kubeconfig,
            &[],
            Some(SocketAddr::new(ip, 443)),
            Duration::from_secs(30),
        )
        .await?;
        let result = async {
            // The extender makes its certificate, keeps it in its Secret and publishes its CA
            // in the chart's MutatingWebhookConfiguration.
            let started = Instant::now();
            loop {
                let bundle = plane.kubectl(&[
                    "get",
                    "mutatingwebhookconfiguration",
                    "baleen-scheduler-name",
                    "-o",
                    "jsonpath={.webhooks[0].clientConfig.caBundle}",
                ])?;
                if !bundle.trim().is_empty() {
                    break;
                }
                ensure!(
                    started.elapsed() < Duration::from_secs(30),
                    "no caBundle published in 30 s"
                );
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
            plane.default_account("team-a", Duration::from_secs(60)).await?;
            let limits =
                |name: &str, n: u32| json!({"limits": {format!("{DOMAIN}/{name}"): n.to_string()}});
            // Refused, each with the webhook's reason, by the real API server's call.
            let refused = [
                (
                    "requests-only",
                    json!({"requests": {format!("{DOMAIN}/gpu-memory"): "8"}}),
                    "is set in requests only",
                ),
                (
                    "unequal",
                    json!({"requests": {format!("{DOMAIN}/gpu-memory"): "4"},
                           "limits": {format!("{DOMAIN}/gpu-memory"): "8"}}),
                    "asks 4 in requests and 8 in limits",
                ),
                ("oversized", limits("gpu-memory", 141), "the largest GPU in the cluster has 140"),
            ];
            for (name, resources, reason) in refused {
                match plane.create(&pod(name, resources)) {
                    Ok(out) => bail!("pod {name} was admitted: {out}"),
                    Err(e) => {
                        let said = format!("{e:#}");
                        ensure!(
                            said.contains("admission webhook") && said.contains(reason),
                            "pod {name} was refused, but not with the webhook's reason \
                             ({reason}): {said}"
                        );
                    }
                }
            }
            // Sent: each gets baleen's scheduler from the webhook's patch.
            let sent = [
                ("memory", limits("gpu-memory", 20)),
                ("whole", limits("gpu", 1)),
                ("mig", limits("mig-1g.10gb", 1)),
                ("nvlink", limits("nvlink-group-2", 1)),
            ];
            for (name, resources) in &sent {
                plane.create(&pod(name, resources.clone()))?;
                let scheduler = field(plane, name, ".spec.schedulerName")?;
                ensure!(
                    scheduler == "baleen-scheduler",
                    "pod {name} went to {scheduler:?}, not baleen-scheduler"
                );
            }
            // A pod asking for nothing of baleen is not sent (the matchConditions: never even
            // reviewed) and keeps the default scheduler.
            plane.create(&pod("plain", json!({"limits": {"cpu": "1"}})))?;
            let scheduler = field(plane, "plain", ".spec.schedulerName")?;
            ensure!(scheduler == "default-scheduler", "a CPU pod went to {scheduler}");
            // The real kube-scheduler, as the chart configures it, places the gpu-memory and
            // whole-GPU pods on node-0 (it has no MIG slices or NVLink groups: those wait).
            SchedulerConfig::as_the_chart(extender.verbs).spawn(plane, &kubeconfig)?;
            for name in ["memory", "whole"] {
                plane.bound("team-a", name, Duration::from_secs(60)).await?;
            }
            tokio::time::sleep(Duration::from_secs(2)).await;
            for name in ["mig", "nvlink"] {
                let node = field(plane, name, ".spec.nodeName")?;
                ensure!(node.is_empty(), "pod {name} was bound to {node}, which has none");
            }
            // The webhook's own count: four sent, three refused, none unreadable.
            let family = "baleen_webhook_reviews_total";
            let count = async |verdict: &str| {
                extender.sample(family, &format!("verdict=\"{verdict}\"")).await
            };
            let (sent, refused) = (count("sent").await?, count("refused").await?);
            let unreadable = count("unreadable").await?;
            ensure!(
                sent == 4.0 && refused == 3.0 && unreadable == 0.0,
                "the webhook's counts: sent {sent}, refused {refused}, unreadable {unreadable}"
            );
            Ok(())
        }
        .await;
        result.map_err(|e| e.context(extender.log_tail(30)))
    })
    .await;
}
