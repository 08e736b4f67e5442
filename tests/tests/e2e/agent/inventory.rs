//! Issue 24, item 6: `baleen-agent inventory` describes the agent it is given. Before, the two
//! seeded a simulated node's UUIDs differently (the file's `node` in one, the resolved node name
//! in the other), `inventory` could not read the agent's file or `--no-mps`, and it printed
//! "units not offered" beside a table that counted them as offered.

use super::*;

/// The agent binary and `inventory` given one configuration file agree on every GPU UUID and on
/// how many devices of each resource are advertised and offered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inventory_prints_what_the_agent_with_the_same_configuration_advertises() -> Result<()> {
    let binary = agent_binary()?;
    let tmp = tempfile::tempdir()?;
    let root = tmp.path();
    let layout = AgentConfig::for_root(root);
    let mut kubelet = FakeKubelet::start(&layout.device_plugin_dir).await?;
    kubelet.serve_pod_resources(&layout.pod_resources_socket)?;
    let topology = Path::new(EXAMPLES).join("l4-4x-pcie.yaml");
    // A node name that is neither the file's `node` nor this machine's host name, from the file.
    let config = root.join("agent.yaml");
    std::fs::write(
        &config,
        "nodeName: gpu-node-3\nmemoryUnit: 2GiB\nmps:\n  enabled: false\nannotation:\n  enabled: false\ncolocation:\n  enabled: false\nwatchdog:\n  enabled: false\n",
    )?;
    let common = |command: &mut std::process::Command| {
        command.arg("--config").arg(&config).arg("--simulated").arg(&topology);
    };
    let mut agent = std::process::Command::new(&binary);
    common(&mut agent);
    let mut child = agent
        .args(["--metrics-address", "127.0.0.1:0"])
        .arg("--device-plugin-dir")
        .arg(&layout.device_plugin_dir)
        .arg("--pod-resources-socket")
        .arg(&layout.pod_resources_socket)
        .arg("--state-dir")
        .arg(&layout.state_dir)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()?;
    let advertised = async {
        kubelet.wait_registered(GPU, 1).await?;
        kubelet.wait_registered(MEM, 1).await?;
        kubelet
            .wait_for("both device lists", WAIT, |v| {
                !v.devices_of(GPU).is_empty() && !v.devices_of(MEM).is_empty()
            })
            .await
    }
    .await;
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(i32::try_from(child.id())?),
        nix::sys::signal::Signal::SIGTERM,
    );
    let _ = child.wait();
    let advertised = advertised?;

    let mut inventory = std::process::Command::new(&binary);
    inventory.arg("inventory");
    common(&mut inventory);
    let printed = inventory.args(["--output", "json"]).output()?;
    anyhow::ensure!(printed.status.success(), "{}", String::from_utf8_lossy(&printed.stderr));
    let json: serde_json::Value = serde_json::from_slice(&printed.stdout)?;
    assert_eq!(json["node"], "gpu-node-3", "{json}");
    let uuids: BTreeSet<String> = json["gpus"]
        .as_array()
        .context("gpus")?
        .iter()
        .filter_map(|g| g["uuid"].as_str().map(str::to_owned))
        .collect();
    let served: BTreeSet<String> =
        advertised.devices_of(GPU).iter().map(|d| d.id.clone()).collect();
    assert_eq!(uuids.len(), 4, "{json}");
    assert_eq!(uuids, served, "the same UUIDs in inventory and in the agent's device list");
    let resource = |name: &str| {
        json["resources"]
            .as_array()
            .and_then(|r| r.iter().find(|r| r["name"] == name))
            .map(|r| (r["devices"].as_u64(), r["offered"].as_u64()))
    };
    let units = advertised.devices_of(MEM).len() as u64;
    let healthy = advertised.healthy(MEM).len() as u64;
    assert_eq!(units, 44, "four L4s of 11 units of 2 GiB: {}", advertised.summary());
    assert_eq!(resource(MEM), Some((Some(units), Some(healthy))), "{json}");
    assert_eq!(json["mps_enabled"], false, "{json}");

    // The table says MPS is off, and nothing about units not offered.
    let mut table = std::process::Command::new(&binary);
    table.arg("inventory");
    common(&mut table);
    let text = String::from_utf8(table.output()?.stdout)?;
    assert!(text.starts_with("node gpu-node-3, driver "), "{text}");
    assert!(text.contains("MPS off"), "{text}");
    assert!(!text.contains("not offered"), "{text}");
    Ok(())
}

/// With MPS on and no daemon answering, the table's gpu-memory row offers none of its units,
/// the same answer as the MPS section below it; with `--no-mps` it offers them all.
#[test]
fn units_not_offered_are_not_counted_as_offered() -> Result<()> {
    let binary = agent_binary()?;
    let tmp = tempfile::tempdir()?;
    let topology = Path::new(EXAMPLES).join("l4-4x-pcie.yaml");
    let run = |extra: &[&str]| -> Result<String> {
        let out = std::process::Command::new(&binary)
            .arg("inventory")
            .arg("--simulated")
            .arg(&topology)
            .args(["--node-name", "n1", "--mps-root"])
            .arg(tmp.path())
            .args(extra)
            .output()?;
        anyhow::ensure!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        Ok(String::from_utf8(out.stdout)?)
    };
    let row = |text: &str| -> Option<Vec<String>> {
        text.lines()
            .find(|l| l.starts_with(MEM))
            .map(|l| l.split_whitespace().map(str::to_owned).collect())
    };
    let on = run(&[])?;
    assert_eq!(row(&on), Some(vec![MEM.to_owned(), "88".into(), "0".into()]), "{on}");
    assert_eq!(on.matches("not answering, its units not offered").count(), 4, "{on}");
    let off = run(&["--no-mps"])?;
    assert_eq!(row(&off), Some(vec![MEM.to_owned(), "88".into(), "88".into()]), "{off}");
    assert!(!off.contains("not offered") && off.contains("MPS off"), "{off}");
    Ok(())
}
