//! Health per GPU: XIDs, a failing or unstartable health watch, unreadable or hung NVML, and the probes that bring a GPU back.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_critical_xid_makes_the_gpu_unhealthy() -> Result<()> {
    let expected = example("l4-4x-pcie.yaml")?;
    let simulated = Arc::new(SimulatedInventory::new(expected.clone()));
    let mut node = TestNode::new("l4-4x-pcie.yaml", Backend::Simulated).await?;
    node.inventory = simulated.clone();
    let (agent, token) = node.start().await?;
    node.registered(&agent, 1).await?;
    let gpu = expected.gpus[2].uuid.clone();
    // The health thread subscribes right after start; retry the injection until it is seen.
    let seen = poll("the GPU and its units unhealthy", async || {
        simulated.inject_xid(&gpu, 79)?; // 79: fallen off the bus, critical
        let unhealthy = node
            .kubelet
            .wait_for("GPU and its units unhealthy", Duration::from_millis(200), |v| {
                v.devices_of(GPU).iter().any(|d| d.id == gpu.as_str() && d.health != HEALTHY)
                    && unit_health(v, gpu.as_str()).iter().all(|s| *s != HEALTHY)
            })
            .await;
        Ok(unhealthy.ok())
    })
    .await?;
    assert!(unit_health(&seen, gpu.as_str()).iter().all(|s| *s != HEALTHY));
    // The metrics say why.
    let text = http_get(agent.metrics_address().context("metrics")?, "/metrics").await?.1;
    let labels = [("gpu_uuid", gpu.as_str()), ("reason", "critical XID 79")];
    assert_eq!(sample(&text, "baleen_gpu_unhealthy_reason", &labels), Some(1.0), "{text}");
    assert_eq!(sample(&text, "baleen_gpu_healthy", &[("gpu_uuid", gpu.as_str())]), Some(0.0));
    stop(agent, token).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_health_watch_marks_every_gpu_unhealthy() -> Result<()> {
    let expected = example("l4-4x-pcie.yaml")?;
    // NVML_ERROR_GPU_IS_LOST (15) from every wait, as when a GPU falls off the bus.
    let fake = FakeNvml::with_directives(&expected, &["fail nvmlEventSetWait_v2 * 15"])?;
    let mut node = TestNode::new("l4-4x-pcie.yaml", Backend::Simulated).await?;
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

/// Issue 11, also found: when the health watch cannot even start, every GPU is advertised
/// Unhealthy (nothing would report a failed GPU) rather than Healthy for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_health_watch_that_cannot_start_leaves_no_gpu_healthy() -> Result<()> {
    let expected = example("l4-4x-pcie.yaml")?;
    let fake = FakeNvml::with_directives(&expected, &["fail nvmlEventSetCreate * 999"])?;
    let mut node = TestNode::new("l4-4x-pcie.yaml", Backend::Simulated).await?;
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

/// Issue 22, item 7: health per GPU that recovers, on the real NVML backend over the fake
/// library. A critical XID makes the GPU unhealthy; while its NVML reads fail (GPU_IS_LOST) or
/// hang it stays so (and the metrics endpoint answers meanwhile); while its MPS daemon hangs,
/// or answers but a CUDA client through it is not bound by MPS (the fake CUDA library: the
/// agent binary's `mps-client-probe`), it stays so; once all answer, `recoveryProbes` good
/// probes in a row give it back; every transition counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gpu_marked_unhealthy_is_probed_back_to_health() -> Result<()> {
    let expected = example("l4-4x-pcie.yaml")?;
    let mut node = TestNode::new("l4-4x-pcie.yaml", Backend::FakeNvml).await?;
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
    poll("the GPU unhealthy", async || {
        fake.inject_xid(1, 79)?;
        let seen = node.kubelet.wait_for("unhealthy", Duration::from_millis(300), units_are(false));
        Ok(seen.await.ok().map(|_| ()))
    })
    .await?;
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
    eventually("the daemon seen hanging", || !enforced(&agent)).await?;
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
    eventually("the daemon seen answering", || enforced(&agent)).await?;
    let without_mps = |probes: &[String]| probes.iter().filter(|l| l.ends_with("mps=0")).count();
    eventually("four client probes without MPS", || without_mps(&cuda.probes()) >= 4)
        .await
        .with_context(|| format!("the probes: {:?}", cuda.probes()))?;
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
    let events = poll("the GPU's Events", async || {
        let events = watchdog_events(&api);
        Ok(events.iter().any(|e| e.0 == "GpuHealthy").then_some(events))
    })
    .await?;
    let reasons: Vec<&str> = events.iter().map(|e| e.0.as_str()).collect();
    assert_eq!(reasons, ["GpuUnhealthy", "GpuHealthy"], "{events:?}");
    assert!(events.iter().all(|e| e.1 == "node-a" && e.2.contains(&gpu)), "{events:?}");
    assert!(events[0].2.contains("critical XID 79"), "{events:?}");
    stop(agent, token).await
}

/// Issue 22, item 7: a GPU NVML cannot read at start is not offered and the others are served;
/// what was held on it stays held (parked, in every checkpoint), and a readable GPU held
/// together with it stays unoffered; a start that reads every GPU restores it all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreadable_gpu_at_start_is_left_out_and_what_it_held_stays_held() -> Result<()> {
    let expected = example("l4-4x-pcie.yaml")?;
    let mut node = TestNode::new("l4-4x-pcie.yaml", Backend::FakeNvml).await?;
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
    let mut node = TestNode::new("l4-4x-pcie.yaml", Backend::FakeNvml).await?;
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
            Agent::start(config, Dependencies { inventory, node_api: Some(client) }, stop_token)
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
