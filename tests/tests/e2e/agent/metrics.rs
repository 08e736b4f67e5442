//! Issue 13: the metrics endpoint: grants, releases, readiness, telemetry, promtool and a real Prometheus, bounded connections.

use super::*;
use anyhow::ensure;

#[test]
fn a_family_missing_from_docs_metrics_md_is_caught() {
    let scrape =
        "# HELP baleen_gpu_info x\n# TYPE baleen_gpu_info gauge\nbaleen_gpu_info{node=\"n\"} 1\n";
    assert!(documented(scrape).is_ok());
    let err = documented("# TYPE baleen_gpu_info gauge\nbaleen_gpu_info 1\n").expect_err("no node");
    assert!(err.to_string().contains("without a node label"), "{err}");
    let scrape = "# TYPE baleen_no_such_family gauge\nbaleen_no_such_family 1\n";
    let err = documented(scrape).expect_err("undocumented");
    assert!(err.to_string().contains("baleen_no_such_family"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_metrics_endpoint_follows_grants_releases_and_readiness() -> Result<()> {
    let node = TestNode::new("l4-4x-pcie.yaml", Backend::Simulated).await?;
    let (agent, token) = node.start().await?;
    node.registered(&agent, 1).await?;
    let address = agent.metrics_address().context("metrics on")?;
    assert_eq!(http_get(address, "/healthz").await?.0, 200);
    // Ready once every resource is registered and every MPS daemon answers.
    poll("ready", async || Ok((http_get(address, "/readyz").await?.0 == 200).then_some(())))
        .await?;
    let a = node.kubelet.admit_to("ns/a", "c", MEM, 4).await?;
    let gpu = gpu_of(&a.device_ids[0]).to_owned();
    let (status, text) = http_get(address, "/metrics").await?;
    assert_eq!(status, 200);
    assert_eq!(
        sample(&text, "baleen_resource_allocated_devices", &[("resource", MEM)]),
        Some(4.0),
        "{text}"
    );
    assert_eq!(
        sample(&text, "baleen_gpu_memory_granted_bytes", &[("gpu_uuid", &gpu)]),
        Some((4u64 << 30) as f64)
    );
    assert_eq!(
        sample(&text, "baleen_gpu_mode", &[("gpu_uuid", &gpu), ("mode", "shared")]),
        Some(1.0)
    );
    assert_eq!(sample(&text, "baleen_gpu_mps_daemon_up", &[("gpu_uuid", &gpu)]), Some(1.0));
    // The agent's own measurements.
    let count = |text: &str, name: &str, labels: &[(&str, &str)]| sample(text, name, labels);
    assert_eq!(count(&text, "baleen_allocate_seconds_count", &[("resource", MEM)]), Some(1.0));
    assert!(count(&text, "baleen_checkpoint_write_seconds_count", &[]).is_some_and(|n| n >= 1.0));
    assert_eq!(count(&text, "baleen_kubelet_registrations_total", &[("resource", MEM)]), Some(1.0));
    scraped(address, "a reconciliation applied", |text| {
        count(text, "baleen_reconciliations_total", &[("outcome", "applied")]).filter(|n| *n >= 1.0)
    })
    .await?;
    let other = node.kubelet.view().healthy(GPU).into_iter().find(|g| *g != gpu).context("gpu")?;
    let split = vec![format!("{gpu}::10"), format!("{other}::0")];
    assert!(node.kubelet.allocate_raw(MEM, vec![split]).await.is_err());
    // (A scrape may share a render up to 100 ms old: asked again past that.)
    tokio::time::sleep(baleen_agent::metrics::MIN_RENDER_INTERVAL).await;
    let text = http_get(address, "/metrics").await?.1;
    assert_eq!(
        count(&text, "baleen_refusals_total", &[("resource", MEM), ("kind", "invalid")]),
        Some(1.0),
        "{text}"
    );
    // The daemon's clients, as its server list says (two clients of one server here).
    std::fs::write(mps_dir(&node, &gpu).join("fake-servers"), "4242\n")?;
    std::fs::write(mps_dir(&node, &gpu).join("fake-clients-4242"), "101\n102\n")?;
    scraped(address, "two MPS clients", |text| {
        sample(text, "baleen_gpu_mps_clients", &[("gpu_uuid", gpu.as_str())]).filter(|n| *n == 2.0)
    })
    .await?;
    let text = http_get(address, "/metrics").await?.1;
    // 22 units on an L4: 18 left on the shared GPU.
    assert_eq!(
        sample(&text, "baleen_gpu_memory_units_largest_free", &[("gpu_uuid", &gpu)]),
        Some(18.0)
    );
    assert_eq!(
        sample(&text, "baleen_gpu_info", &[("gpu_uuid", &gpu), ("node", "node-a")]),
        Some(1.0)
    );
    // Fragmentation against the one grant's shape (4 of 22 units, 0.181 GPU): the 18 units
    // left (0.818 GPU) can take it, so nothing is fragmented.
    assert_eq!(sample(&text, "baleen_node_fragmentation_target_grants", &[]), Some(1.0));
    assert_eq!(sample(&text, "baleen_node_fragmentation_gpus", &[("node", "node-a")]), Some(0.0));
    assert_eq!(sample(&text, "baleen_node_free_compute_gpus", &[]), Some(3.818));
    // Which pod holds which GPU, once the kubelet's list has named it.
    let labels =
        [("namespace", "ns"), ("pod", "a"), ("container", "c"), ("gpu_uuid", gpu.as_str())];
    let named = scraped(address, "the grant named", |text| {
        sample(text, "baleen_grant_memory_bytes", &labels)
    });
    assert_eq!(named.await?, (4u64 << 30) as f64);
    // The pod ends: once released, the GPU is idle again and nothing is allocated.
    node.kubelet.end_pod("ns/a");
    let text = scraped(address, "the grant released", |text| {
        let allocated = sample(text, "baleen_resource_allocated_devices", &[("resource", MEM)]);
        (allocated == Some(0.0)).then(|| text.to_owned())
    })
    .await?;
    assert_eq!(sample(&text, "baleen_gpu_memory_granted_bytes", &[("gpu_uuid", &gpu)]), Some(0.0));
    assert_eq!(
        sample(&text, "baleen_grant_memory_bytes", &[("pod", "a")]),
        None,
        "the grant's series is gone"
    );
    assert_eq!(
        sample(&text, "baleen_gpu_mode", &[("gpu_uuid", &gpu), ("mode", "shared")]),
        None,
        "no stale series"
    );
    assert_eq!(
        sample(&text, "baleen_gpu_mode", &[("gpu_uuid", &gpu), ("mode", "idle")]),
        Some(1.0)
    );
    // A GPU's MPS daemon dies (and cannot start again): not ready, saying why.
    directive(&node, &gpu, "refuse")?;
    let pid = daemon_pid(&node, &gpu)?;
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL)?;
    let why = poll("not ready", async || {
        let (status, body) = http_get(address, "/readyz").await?;
        Ok((status == 503).then_some(body))
    })
    .await?;
    assert!(why.contains("MPS daemon not answering") && why.contains(&gpu), "{why}");
    // (A scrape may share a render up to 100 ms old: asked past that.)
    tokio::time::sleep(baleen_agent::metrics::MIN_RENDER_INTERVAL).await;
    let text = http_get(address, "/metrics").await?.1;
    assert_eq!(sample(&text, "baleen_gpu_mps_daemon_up", &[("gpu_uuid", &gpu)]), Some(0.0));
    stop(agent, token).await
}

/// Issue 13: GPU telemetry read through the real NVML backend over the fake library, on the
/// background loop, as metrics; a GPU without a sensor has no series for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn telemetry_from_nvml_reaches_the_metrics() -> Result<()> {
    let expected = example("l4-4x-pcie.yaml")?;
    let fake = FakeNvml::new(&expected)?;
    // GPU 0: 5 GiB used, 87 % busy, 40 % memory, 61 °C, 72.5 W; the others report no sensors.
    fake.set_telemetry(&[(0, 5 << 30, 87, 40, 61, 72_500)])?;
    let mut node = TestNode::new("l4-4x-pcie.yaml", Backend::Simulated).await?;
    node.inventory = Arc::new(NvmlInventory::new(fake.nvml_config())?);
    let (agent, token) = node.start().await?;
    let address = agent.metrics_address().context("metrics on")?;
    let g0 = expected.gpus[0].uuid.to_string();
    let g1 = expected.gpus[1].uuid.to_string();
    let text = scraped(address, "the telemetry read", |text| {
        let read = sample(text, "baleen_gpu_temperature_celsius", &[("gpu_uuid", g0.as_str())]);
        read.map(|_| text.to_owned())
    })
    .await?;
    let at = |name: &str, gpu: &str| sample(&text, name, &[("gpu_uuid", gpu)]);
    assert_eq!(at("baleen_gpu_memory_used_bytes", &g0), Some((5u64 << 30) as f64));
    assert_eq!(at("baleen_gpu_utilization_ratio", &g0), Some(0.87));
    assert_eq!(at("baleen_gpu_memory_utilization_ratio", &g0), Some(0.4));
    assert_eq!(at("baleen_gpu_temperature_celsius", &g0), Some(61.0));
    assert_eq!(at("baleen_gpu_power_watts", &g0), Some(72.5));
    assert_eq!(at("baleen_gpu_utilization_ratio", &g1), None, "no sensor, no series");
    assert_eq!(at("baleen_gpu_memory_used_bytes", &g1), Some(0.0));
    let age =
        sample(&text, "baleen_telemetry_age_seconds", &[("node", "node-a")]).context("age")?;
    assert!((0.0..5.0).contains(&age), "{age}");
    stop(agent, token).await
}

/// Issue 13: a real scrape passes `promtool check metrics` (Debian's `prometheus` package, which
/// `.ci/run` installs; without it the test fails saying so).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn promtool_accepts_a_real_scrape() -> Result<()> {
    use std::io::Write as _;
    let promtool = baleen_tests::tools::promtool()?;
    let node = TestNode::new("h200-8x-nvswitch.yaml", Backend::Simulated).await?;
    let (agent, token) = node.start().await?;
    node.registered(&agent, 1).await?;
    node.kubelet.admit_to("ns/a", "c", MEM, 8).await?;
    node.kubelet.admit_to("ns/b", "c", GPU, 2).await?;
    let text = http_get(agent.metrics_address().context("metrics")?, "/metrics").await?.1;
    let mut child = std::process::Command::new(promtool)
        .args(["check", "metrics"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()?;
    child.stdin.take().context("stdin")?.write_all(text.as_bytes())?;
    let out = child.wait_with_output()?;
    assert!(
        out.status.success() && out.stdout.is_empty(),
        "promtool check metrics: {}{}\n{text}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    stop(agent, token).await
}

/// Percent-encodes a query-string value.
fn encode(value: &str) -> String {
    value
        .bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// Issue 13: a real Prometheus server (Debian's package) scrapes the agent; over its HTTP API it
/// answers an allocated pod's granted memory and every query of the Grafana dashboard.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_real_prometheus_scrapes_the_agent_and_answers_every_dashboard_query() -> Result<()> {
    let prometheus = baleen_tests::tools::on_path("prometheus")
        .context("prometheus is not installed: apt-get install prometheus (.ci/run installs it)")?;
    let mut node = TestNode::new("l4-4x-pcie.yaml", Backend::Simulated).await?;
    // Live readings for every GPU, as NVML would give them.
    let expected = example("l4-4x-pcie.yaml")?;
    let simulated = Arc::new(SimulatedInventory::new(expected.clone()));
    simulated.set_telemetry(
        expected
            .gpus
            .iter()
            .map(|g| baleen_agent::inventory::GpuTelemetry {
                gpu: Some(g.uuid.clone()),
                memory_used_bytes: Some(1 << 30),
                gpu_utilisation: Some(0.5),
                memory_utilisation: Some(0.25),
                temperature_celsius: Some(50),
                power_watts: Some(40.0),
            })
            .collect(),
    );
    node.inventory = simulated.clone();
    let proc_root = tempfile::tempdir()?;
    node.config.watchdog = baleen_agent::isolation::watchdog::WatchdogConfig {
        enabled: true,
        interval: Duration::from_millis(200),
        action: baleen_agent::isolation::watchdog::WatchdogAction::Log,
        proc_root: proc_root.path().to_path_buf(),
        ..Default::default()
    };
    let api = baleen_tests::fake_apiserver::FakeApiServer::start(&["node-a"]).await?;
    let (uid, id) = ("1111-2222", "d".repeat(64));
    api.put_pod(running_pod("ns/a", uid, "c", &id, 4));
    let (agent, token) =
        node.start_with(Some(baleen_agent::kube_api::KubeNodeApi::at(&api.url())?)).await?;
    node.registered(&agent, 1).await?;
    let granted = node.kubelet.admit_to("ns/a", "c", MEM, 4).await?;
    // A process of the grant's container, 1 GiB on its GPU: the grant's used memory.
    fake_process(proc_root.path(), 700, uid, &id, "")?;
    simulated.set_processes(vec![baleen_agent::inventory::GpuProcess {
        gpu: baleen_agent::inventory::GpuUuid::new(gpu_of(&granted.device_ids[0]))?,
        pid: 700,
        used_bytes: Some(1 << 30),
    }]);
    let target = agent.metrics_address().context("metrics")?;
    let dir = tempfile::tempdir()?;
    let config = dir.path().join("prometheus.yml");
    std::fs::write(
        &config,
        format!(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nscrape_configs:\n  - job_name: baleen\n    static_configs:\n      - targets: ['{target}']\n"
        ),
    )?;
    let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let address: std::net::SocketAddr = format!("127.0.0.1:{port}").parse()?;
    /// Kills the server however the test ends (a failed assertion unwinds past any cleanup).
    struct Server(std::process::Child);
    impl Drop for Server {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let server = std::process::Command::new(prometheus)
        .arg(format!("--config.file={}", config.display()))
        .arg(format!("--storage.tsdb.path={}", dir.path().join("data").display()))
        .arg(format!("--web.listen-address={address}"))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()?;
    let server = Server(server);
    let outcome = async {
        let query = |q: String| async move {
            let (status, body) =
                http_get(address, &format!("/api/v1/query?query={}", encode(&q))).await?;
            anyhow::ensure!(status == 200, "{q}: {status} {body}");
            let value: serde_json::Value = serde_json::from_str(&body)?;
            Ok::<_, anyhow::Error>(value["data"]["result"].as_array().cloned().unwrap_or_default())
        };
        // The first value of `q` once Prometheus has one (it scrapes every second, so within
        // a minute; a query that fails meanwhile is asked again).
        let first_value = |q: &'static str| {
            poll_within(Duration::from_secs(60), q, async move || {
                let first = query(q.into()).await.ok().and_then(|r| r.first().cloned());
                Ok(first.map(|f| f["value"][1].as_str().unwrap_or_default().to_owned()))
            })
        };
        // The allocated pod's granted memory, once scraped and listed.
        let value = first_value(r#"baleen_grant_memory_bytes{pod="a"}"#).await?;
        assert_eq!(value, (4u64 << 30).to_string());
        // And the memory its process uses (the watchdog's read), as the dashboard plots it.
        let value = first_value(r#"baleen_grant_memory_used_bytes{pod="a"}"#).await?;
        assert_eq!(value, (1u64 << 30).to_string());
        // Every dashboard query answers with at least one series.
        let dashboard: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(
            Path::new(EXAMPLES).join("../grafana/baleen.json"),
        )?)?;
        let mut queries = 0;
        anyhow::ensure!(
            dashboard["__inputs"][0]["pluginId"] == "prometheus",
            "importable: the dashboard names its data source input"
        );
        for panel in dashboard["panels"].as_array().context("panels")? {
            // The extender's panel reads the scheduler pods' series, which this agent-only
            // Prometheus does not scrape: its queries are checked to parse, not to answer.
            let extender =
                panel["description"].as_str().is_some_and(|d| d.starts_with("From the extender"));
            for target in panel["targets"].as_array().context("targets")? {
                if extender {
                    let expr = target["expr"].as_str().context("expr")?;
                    query(expr.to_owned()).await?;
                    queries += 1;
                    continue;
                }
                let expr = target["expr"].as_str().context("expr")?.replace("$node", ".*");
                // A rate needs two scrapes (one a second): asked again for a while.
                let asked = std::time::Instant::now();
                let mut result = query(expr.clone()).await?;
                while result.is_empty() && asked.elapsed() < Duration::from_secs(15) {
                    tokio::time::sleep(Duration::from_millis(250)).await;
                    result = query(expr.clone()).await?;
                }
                assert!(!result.is_empty(), "dashboard query {expr} returned no series");
                queries += 1;
            }
        }
        assert!(queries >= 10, "{queries} queries");
        anyhow::Ok(())
    }
    .await;
    drop(server);
    outcome?;
    stop(agent, token).await
}

/// A connection to `to` from the loopback address `127.0.0.<source>` (a peer of its own).
async fn connect_from(source: u8, to: std::net::SocketAddr) -> Result<tokio::net::TcpStream> {
    let socket = tokio::net::TcpSocket::new_v4()?;
    socket.bind(std::net::SocketAddr::from(([127, 0, 0, source], 0)))?;
    Ok(socket.connect(to).await?)
}

/// Sends `GET /healthz` (keep-alive) on `stream` and reads the answer; whether one came.
async fn keep_alive_get(stream: &mut tokio::net::TcpStream) -> bool {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    if stream.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n").await.is_err() {
        return false;
    }
    let mut buf = [0u8; 512];
    matches!(
        tokio::time::timeout(Duration::from_secs(2), stream.read(&mut buf)).await,
        Ok(Ok(n)) if n > 0 && buf.starts_with(b"HTTP/1.1 200")
    )
}

/// Issue 39, item 1: keep-alive connections holding every slot of the metrics port, each
/// sending `GET /healthz` now and then (the attack: 0 of 60 probes answered before) starve
/// neither the probes (their own listener, on the loopback address, which the kubelet reaches
/// through `baleen-agent probe`) nor a scrape (an idle connection of the address holding the
/// most gives way); one address holds at most its share; a half-open connection is closed
/// after the header timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_the_metrics_port_starves_neither_probes_nor_scrapes() -> Result<()> {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let node = TestNode::new("l4-4x-pcie.yaml", Backend::Simulated).await?;
    let (agent, token) = node.start().await?;
    let address = agent.metrics_address().context("metrics")?;
    let probes = agent.probe_address().context("probes")?;
    ensure!(probes != address, "the probes have their own listener");
    let limits = baleen_agent::metrics::METRICS_LIMITS;
    // Twice the cap, from 8 addresses: every slot held by keep-alive connections that ask
    // /healthz now and then.
    let mut hoard = Vec::new();
    for i in 0..2 * limits.total {
        let source = 2 + u8::try_from(i % 8)?;
        let mut stream = connect_from(source, address).await?;
        let _ = keep_alive_get(&mut stream).await;
        hoard.push(stream);
    }
    let mut alive = 0;
    for stream in &mut hoard {
        alive += usize::from(keep_alive_get(stream).await);
    }
    ensure!(
        alive <= limits.total,
        "{alive} connections held: more than the port's {}",
        limits.total
    );
    // The probes, as the kubelet's exec probe makes them: every one answered, at once.
    let started = std::time::Instant::now();
    for _ in 0..60 {
        let (code, body) = http_get(probes, "/healthz").await?;
        ensure!(code == 200, "a probe: {code} {body}");
    }
    let (code, _) = http_get(probes, "/readyz").await?;
    ensure!(code == 200, "ready");
    ensure!(started.elapsed() < Duration::from_secs(10), "60 probes took {:?}", started.elapsed());
    // The metrics port serves nothing but /metrics, /healthz, /readyz; the probe port no /metrics.
    ensure!(http_get(probes, "/metrics").await?.0 == 404, "no /metrics on the probe port");
    // A scraper from another address: answered, an idle hoarder giving way.
    for _ in 0..10 {
        let mut scraper = connect_from(20, address).await?;
        ensure!(keep_alive_get(&mut scraper).await, "a scrape's connection was not served");
    }
    // One address holds at most its share, its oldest idle connections giving way.
    let mut own = Vec::new();
    for _ in 0..limits.per_peer + 8 {
        own.push(connect_from(30, address).await?);
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut served = 0;
    for stream in &mut own {
        served += usize::from(keep_alive_get(stream).await);
    }
    ensure!(
        served <= limits.per_peer,
        "one address holds {served} connections, more than its {}",
        limits.per_peer
    );
    ensure!(served > 0, "the address's newest connections are served");
    drop((hoard, own));
    // Half a request line, then nothing: closed after the header timeout.
    let mut half = tokio::net::TcpStream::connect(address).await?;
    half.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n").await?;
    let wait = baleen_agent::metrics::HEADER_READ_TIMEOUT + Duration::from_secs(2);
    let mut byte = [0u8; 1];
    let closed =
        matches!(tokio::time::timeout(wait, half.read(&mut byte)).await, Ok(Ok(0) | Err(_)));
    ensure!(closed, "a half-open connection outlived the header timeout");
    stop(agent, token).await
}

/// The exec probe as the kubelet runs it: `baleen-agent probe URL` exits 0 for the probe
/// listener's 200, 1 for its 503 or no answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_exec_probe_reads_the_probe_listener() -> Result<()> {
    let node = TestNode::new("l4-4x-pcie.yaml", Backend::Simulated).await?;
    let (agent, token) = node.start().await?;
    let probes = agent.probe_address().context("probes")?;
    let binary = super::agent_binary()?;
    for (path, want) in [("/healthz", 0), ("/readyz", 0), ("/nothing", 1)] {
        let out = tokio::process::Command::new(&binary)
            .args(["probe", &format!("http://{probes}{path}")])
            .output()
            .await?;
        ensure!(
            out.status.code() == Some(want),
            "{path}: {:?} {}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    stop(agent, token).await?;
    let out = tokio::process::Command::new(&binary)
        .args(["probe", "--timeout", "500ms", &format!("http://{probes}/healthz")])
        .output()
        .await?;
    ensure!(out.status.code() == Some(1), "no agent, no answer: {:?}", out.status);
    Ok(())
}
