//! Issue 21, item 4 (and issue 12, item 7): the memory watchdog on the fake NVML, against the fake API server.

use super::*;

/// Issue 21, item 4 (and issue 12, item 7): the memory watchdog on the fake NVML, with the
/// API's pods and the kubelet's list. A process is held to the grant its cgroup leads to, with
/// its limit variable unset; a pod's process on a GPU its container holds nothing on is
/// reported (metric, Event on its pod); a container over its grant is announced, then killed
/// after the grace with an Event naming pod and container, and counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_watchdog_holds_processes_to_the_grant_their_cgroup_names_and_kills_after_the_grace()
-> Result<()> {
    let expected = example("l4-4x-pcie.yaml")?;
    let mut node = TestNode::new("l4-4x-pcie.yaml", Backend::FakeNvml).await?;
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
    // Scrapes until `name{labels}` is `want`.
    let metric =
        |what: &'static str, name: &'static str, labels: Vec<(&'static str, String)>, want| {
            scraped(address, what, move |text| {
                let labels: Vec<(&str, &str)> =
                    labels.iter().map(|(k, v)| (*k, v.as_str())).collect();
                (sample(text, name, &labels) == Some(want)).then_some(())
            })
        };
    let labels = vec![("pod", "w".into()), ("gpu_uuid", gpu.clone())];
    metric("the grant's usage", "baleen_grant_memory_used_bytes", labels, (3u64 << 30) as f64)
        .await?;
    let other_gpu = expected.gpus[other as usize].uuid.to_string();
    let labels = vec![("gpu_uuid", other_gpu.clone()), ("reason", "no-grant".into())];
    metric("the stray", "baleen_gpu_processes_without_grant", labels, 1.0).await?;
    let strays = agent.strays().borrow().clone();
    assert_eq!(strays.len(), 1, "the host process is nobody's: {strays:?}");
    assert_eq!(strays[0].pod, Some(("ns".into(), "steal".into())));
    assert!(child.try_wait()?.is_none(), "within its grant: alive");
    // It goes over (5 of 4 GiB): announced, killed after the grace, counted.
    fake.set_processes(&[(index, pid, 5 << 30), (other, 3_999_001, 7 << 30)])?;
    let status =
        tokio::time::timeout(WAIT, tokio::task::spawn_blocking(move || child.wait())).await???;
    assert_eq!(std::os::unix::process::ExitStatusExt::signal(&status), Some(9), "SIGKILL");
    metric("the kill counted", "baleen_watchdog_killed_processes_total", vec![], 1.0).await?;
    let events = poll("the Events", async || {
        let events = watchdog_events(&api);
        Ok(events.iter().any(|e| e.0 == "GpuMemoryOverGrantKilled").then_some(events))
    })
    .await?;
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
    let mut node = TestNode::new("l4-4x-pcie.yaml", Backend::Simulated).await?;
    node.config.watchdog.enabled = true;
    let err = node.start().await.err().context("refused")?;
    assert!(err.to_string().contains("watchdog.enabled"), "{err:#}");
    Ok(())
}
