//! Issue 40, item 3: the real kube-scheduler, configured as the chart configures it, calls
//! baleen's extender (the workspace's binary with the chart's arguments, its real watches of the
//! API server, run with a real token of the chart's scheduler account): it binds GPU pods where
//! the extender chooses, and preempts through its preempt verb. The Nodes are API objects with
//! the capacity a kubelet would set and the gpu-state an agent would publish (written here).
use std::time::{Duration, Instant};

use anyhow::{Result, bail, ensure};
use serde_json::{Value, json};

use baleen_tests::real::scheduling::{
    DOMAIN, Extender, SchedulerConfig, node_objects, scheduler_kubeconfig,
};
use baleen_tests::real::{ControlPlane, with_control_plane};

/// Node `name` as a kubelet and its agent would leave it: 8 H200s with `free` units each in
/// its gpu-state, the device plugins' counts in its capacity.
fn add_node(plane: &ControlPlane, name: &str, free: &[u32]) -> Result<()> {
    let (node, resources) = node_objects(name, free);
    plane.create(&node)?;
    plane.node_ready(name, &resources, &resources)
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

#[tokio::test]
#[ignore = "real-control-plane lane: BALEEN_KUBE=$(scripts/build-control-plane.sh), --ignored"]
async fn the_real_scheduler_binds_and_preempts_where_the_extender_chooses() {
    with_control_plane(async |plane| {
        // No webhook: the API server would call it at the Service's cluster IP, which is not on
        // this machine (the lane stays on loopback); the pods name baleen's scheduler themselves.
        plane.install(&["--set", "webhook.enabled=false"])?;
        plane.kubectl(&["create", "namespace", "team-a"])?;
        // Each node's capacity counts 1,120 gpu-memory units (8 GPUs), all of them free as
        // kube-scheduler counts (no pod holds any): only the gpu-state says which single GPU
        // has room. node-0: one GPU with 20 units free; node-1: one with 100; node-2: two with 60.
        add_node(plane, "node-0", &[20, 0, 0, 0, 0, 0, 0, 0])?;
        add_node(plane, "node-1", &[100, 0, 0, 0, 0, 0, 0, 0])?;
        add_node(plane, "node-2", &[60, 60, 0, 0, 0, 0, 0, 0])?;
        // The extender and kube-scheduler share the chart's scheduler account (one pod).
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
            // kube-scheduler with the chart's configuration, the extender at its address.
            let config = SchedulerConfig::as_the_chart(extender.verbs);
            config.spawn(plane, &kubeconfig)?;
            plane.default_account("team-a", Duration::from_secs(30)).await?;
            // 100 units: only node-1 has a GPU with room.
            plane.create(&gpu_pod("large", 100))?;
            let node = plane.bound("team-a", "large", Duration::from_secs(60)).await?;
            ensure!(
                node == "node-1",
                "the 100-unit pod went to {node}: only node-1 has a GPU with room"
            );
            // Another 100: node-1's GPU is taken (the extender counts the pod it bound there at
            // once, before any agent rewrites the gpu-state): no node has room; it waits.
            plane.create(&gpu_pod("large-2", 100))?;
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
            plane.create(&gpu_pod("small", 20))?;
            let node = plane.bound("team-a", "small", Duration::from_secs(60)).await?;
            ensure!(node != "node-1", "the 20-unit pod went to node-1, whose GPU is taken");
            // Preemption. node-p has one GPU, all of it taken by a pod of no priority: a pod of
            // a higher priority asking for the whole GPU fits nowhere; kube-scheduler finds
            // the victim by node-p's totals and asks the extender's preempt verb, which keeps
            // it (its eviction frees the GPU); the victim is deleted, the pod bound there.
            plane.kubectl(&["delete", "pod", "large-2", "-n", "team-a", "--wait=false"])?;
            add_node(plane, "node-p", &[140])?;
            plane.create(&gpu_pod("low", 140))?;
            let node = plane.bound("team-a", "low", Duration::from_secs(60)).await?;
            ensure!(node == "node-p", "the 140-unit pod went to {node}, not node-p");
            plane.create(&json!({"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass",
                        "metadata": {"name": "urgent"}, "value": 1000}))?;
            let mut high = gpu_pod("high", 140);
            high["spec"]["priorityClassName"] = "urgent".into();
            plane.create(&high)?;
            // No kubelet ends the victim's graceful deletion: the test does, as one would.
            let started = Instant::now();
            loop {
                let deleting = plane.kubectl(&[
                    "get",
                    "pod",
                    "low",
                    "-n",
                    "team-a",
                    "--ignore-not-found",
                    "-o",
                    "jsonpath={.metadata.deletionTimestamp}",
                ])?;
                if !deleting.trim().is_empty() {
                    break;
                }
                if started.elapsed() > Duration::from_secs(60) {
                    let events = plane.kubectl(&["get", "events", "-n", "team-a"])?;
                    bail!("the low pod was not preempted in 60 s:\n{events}");
                }
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
            plane.kubectl(&[
                "delete",
                "pod",
                "low",
                "-n",
                "team-a",
                "--grace-period=0",
                "--force",
            ])?;
            let node = plane.bound("team-a", "high", Duration::from_secs(60)).await?;
            ensure!(node == "node-p", "the preempting pod went to {node}, not node-p");
            let preempts = extender
                .sample("baleen_extender_request_seconds_count", "verb=\"preempt\"")
                .await?;
            ensure!(preempts >= 1.0, "kube-scheduler never called the preempt verb");
            // The extender bound every pod (its bind verb): its counter says so.
            let bound_count =
                extender.sample("baleen_extender_bindings_total", "result=\"bound\"").await?;
            ensure!(bound_count >= 4.0, "the extender bound {bound_count} pods");
            Ok(())
        }
        .await;
        result.map_err(|e| e.context(extender.log_tail(30)))
    })
    .await;
}
