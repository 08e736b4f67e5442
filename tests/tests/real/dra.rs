//! Issue 40, item 4 (in part): the agent in `driver: dra` mode (the workspace's binary, its
//! calls made with a real token of its account bound to a pod on its node) publishes
//! ResourceSlices the real API server accepts, with the shared GPUs' consumable memory (on by
//! default in 1.37) surviving the round trip, and the slices' policy holding it to its node
//! (the install is a second old by then: the policy is in force).

use std::time::{Duration, Instant};

use anyhow::{bail, ensure};
use serde_json::{Value, json};

use baleen_tests::real::agent::SimulatedAgent;
use baleen_tests::real::with_control_plane;

const CHART: &str = "packaging/helm/baleen";
const DRIVER: &str = "gpu.awesome-ai-company.com";

#[tokio::test]
#[ignore = "real-control-plane lane: BALEEN_KUBE=$(scripts/build-control-plane.sh), --ignored"]
async fn a_dra_agents_slices_pass_the_real_api_server_with_their_shared_memory() {
    with_control_plane(async |plane| {
        plane.install(&[
            "-f",
            &format!("{CHART}/ci/dra-values.yaml"),
            "--set",
            "webhook.enabled=false",
        ])?;
        plane
            .create(&json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node-a"}}))?;
        let mut agent = SimulatedAgent::start(
            plane,
            "node-a",
            "h200-8x-nvswitch.yaml",
            &SimulatedAgent::dra_config(plane, "node-a", DRIVER),
        )?;
        let kubeconfig = plane.path("agent-node-a.kubeconfig");
        let result = async {
            let started = Instant::now();
            let slices = loop {
                if let Some(status) = agent.exited()? {
                    bail!("the agent exited ({status})");
                }
                let list: Value = serde_json::from_str(&plane.kubectl(&[
                    "get",
                    "resourceslices.v1.resource.k8s.io",
                    "-o",
                    "json",
                ])?)?;
                let slices: Vec<Value> = list["items"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter(|s| s["spec"]["nodeName"] == "node-a" && s["spec"]["driver"] == DRIVER)
                    .cloned()
                    .collect();
                let devices: usize = slices
                    .iter()
                    .map(|s| s["spec"]["devices"].as_array().map_or(0, Vec::len))
                    .sum();
                if devices >= 8 {
                    break slices;
                }
                if started.elapsed() > Duration::from_secs(60) {
                    bail!("no slices of node-a's 8 GPUs within 60 s: {slices:?}");
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            };
            let devices: Vec<&Value> = slices
                .iter()
                .flat_map(|s| s["spec"]["devices"].as_array().into_iter().flatten())
                .collect();
            let shared: Vec<&&Value> =
                devices.iter().filter(|d| d["allowMultipleAllocations"] == true).collect();
            ensure!(!shared.is_empty(), "no shared GPU published: {devices:?}");
            for d in &shared {
                ensure!(
                    d["capacity"]["memory"]["requestPolicy"]["validRange"]["step"].is_string(),
                    "a shared GPU's consumable memory did not survive the API server: {d}"
                );
            }
            let node_uid =
                plane.kubectl(&["get", "node", "node-a", "-o", "jsonpath={.metadata.uid}"])?;
            ensure!(
                slices
                    .iter()
                    .all(|s| s["metadata"]["ownerReferences"][0]["uid"] == node_uid.trim()),
                "the slices' owner is not node-a"
            );
            // With the same token, a slice of another node: refused by the slices' policy (it
            // may take a second after the install to be in force).
            let slice = json!({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
                "metadata": {"name": "node-b-forged"},
                "spec": {"driver": DRIVER, "nodeName": "node-b",
                         "pool": {"name": "node-b", "generation": 1, "resourceSliceCount": 1},
                         "devices": [{"name": "gpu-0"}]}});
            let file = plane.path("forged-slice.json");
            std::fs::write(&file, serde_json::to_vec(&slice)?)?;
            let file = file.display().to_string();
            let forged = std::process::Command::new("kubectl")
                .args(["--kubeconfig", &kubeconfig.display().to_string(), "create", "-f", &file])
                .output()?;
            let said = String::from_utf8_lossy(&forged.stderr);
            ensure!(
                !forged.status.success()
                    && said.contains(
                        "the baleen agent may write only the ResourceSlices of the Node it runs on"
                    ),
                "node-a's agent wrote node-b's slice: {said}"
            );
            Ok(())
        }
        .await;
        result.map_err(|e| e.context(agent.log_tail(30)))
    })
    .await;
}
