//! Crashes, restarts and forgetful kubelets: nothing lost or handed out twice, with an intact, corrupted or unwritable checkpoint, stale or empty pod-resources lists, a second agent, a stop at any step of the start.

use super::*;

async fn crash_and_restart(corrupt: bool) -> Result<()> {
    let node = TestNode::new("h200-8x-nvswitch.yaml", Backend::Simulated).await?;
    // The first agent runs on a runtime of its own, so that it can be killed whole: every task,
    // gRPC connections included, dropped at once, nothing shut down in order.
    let doomed =
        tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build()?;
    let (config, inventory) = (node.config.clone(), node.inventory.clone());
    let agent = tokio::time::timeout(
        WAIT,
        doomed.spawn(async move {
            Agent::start(
                config,
                Dependencies { inventory, node_api: None },
                CancellationToken::new(),
            )
            .await
        }),
    )
    .await???;
    node.registered(&agent, 1).await?;
    node.kubelet.admit_to("ns/a", "c", MEM, 10).await?;
    node.kubelet.admit_to("ns/b", "c", GPU, 2).await?;
    node.kubelet.admit_to("ns/c", "c", "awesome-ai-company.com/nvlink-group-2", 1).await?;
    let before = sorted(agent.resources().records());
    assert_eq!(before.len(), 3);
    let sockets: Vec<PathBuf> = agent
        .plugins()
        .iter()
        .map(|(r, _)| {
            node.config.device_plugin_dir.join(baleen_device_plugin::plugin::socket_name(r))
        })
        .collect();
    // The crash.
    drop(agent);
    doomed.shutdown_background();
    // A crashed process leaves its socket files behind: put stale ones in place (new files, so
    // that no dying task of the old runtime takes them for its own and removes them).
    for socket in &sockets {
        let _ = std::fs::remove_file(socket);
        drop(std::os::unix::net::UnixListener::bind(socket)?);
        assert!(socket.exists());
    }
    if corrupt {
        // The grants are in the journal (the snapshot was written at start, empty): one byte of
        // a whole line changed.
        let journal = node.config.state_dir.join(baleen_agent::checkpoint::JOURNAL_FILE_NAME);
        let text = std::fs::read_to_string(&journal)?;
        anyhow::ensure!(text.contains("::1"), "the grants are in the journal: {text}");
        std::fs::write(&journal, text.replacen("::1", "::9", 1))?;
    }
    let (agent, token) = node.start().await?;
    assert_eq!(sorted(agent.resources().records()), before, "nothing lost or duplicated");
    node.registered(&agent, 2).await?;
    // The restarted agent keeps packing around what it restored: no unit handed out twice.
    let more = node.kubelet.admit_to("ns/d", "c", MEM, 5).await?;
    let held: Vec<String> = before.iter().flat_map(|(_, ids)| ids.clone()).collect();
    assert!(more.device_ids.iter().all(|id| !held.contains(id)));
    assert_eq!(agent.resources().records().len(), 4);
    stop(agent, token).await?;
    // And the checkpoint written since is trusted again.
    let contents = baleen_agent::checkpoint::Checkpoint::in_dir(&node.config.state_dir)
        .load("node-a", "boot-1")?
        .context("checkpoint present")?;
    assert_eq!(contents.allocations.len(), 4);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_then_restart_loses_and_duplicates_nothing() -> Result<()> {
    crash_and_restart(false).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_with_a_corrupted_checkpoint_is_rebuilt_from_pod_resources() -> Result<()> {
    crash_and_restart(true).await
}

/// Issue 11, item 3: an agent stopped while it waits for pod-resources (no trusted checkpoint)
/// writes nothing, so that the next start waits for the kubelet again instead of trusting an
/// empty ledger and handing out the GPUs of running containers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stopped_while_waiting_for_pod_resources_writes_no_checkpoint() -> Result<()> {
    let mut node = TestNode::new("l4-4x-pcie.yaml", Backend::Simulated).await?;
    let (agent, token) = node.start().await?;
    node.registered(&agent, 1).await?;
    let held = node.kubelet.admit_to("ns/a", "c", GPU, 1).await?;
    stop(agent, token).await?;
    // A corrupted checkpoint (or a reboot): the kubelet is the only record of ns/a, and it does
    // not answer. The agent is stopped while it waits.
    std::fs::write(node.checkpoint(), "torn")?;
    node.kubelet.stop_pod_resources();
    let token = CancellationToken::new();
    token.cancel();
    let stopped = tokio::time::timeout(
        WAIT,
        Agent::start(
            node.config.clone(),
            Dependencies { inventory: node.inventory.clone(), node_api: None },
            token.clone(),
        ),
    )
    .await?;
    assert!(
        matches!(stopped, Err(baleen_agent::run::AgentError::StoppedBeforeStart)),
        "stopped before serving anything"
    );
    assert_eq!(std::fs::read_to_string(node.checkpoint())?, "torn", "nothing written");
    // The kubelet answers again: the next start restores ns/a from it, not from an empty ledger.
    node.kubelet.serve_pod_resources(&node.config.pod_resources_socket)?;
    let (agent, token) = node.start().await?;
    let records = agent.resources().records();
    assert_eq!(records.len(), 1, "{records:?}");
    assert_eq!(records[0].device_ids, held.device_ids);
    stop(agent, token).await
}

/// Lets the reconciliation pass now under way finish: holds the next pod-resources `List` and
/// waits until it is asked (the reconciler asks only after it has applied or dropped the last
/// one), then lets it answer.
async fn next_pass(node: &TestNode) -> Result<()> {
    let mut held = node.kubelet.hold_next_list();
    held.asked(WAIT).await?;
    held.release();
    Ok(())
}

/// Issue 11, item 4: a pod-resources list asked before an Allocate and answered after it is not
/// applied. Here it would restore an ended pod's units over the new grant that replaced them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_list_does_not_restore_an_ended_pod_over_a_new_grant() -> Result<()> {
    let node = TestNode::new("l4-4x-pcie.yaml", Backend::Simulated).await?;
    let (agent, token) = node.start().await?;
    node.registered(&agent, 1).await?;
    let a = node.kubelet.admit_to("ns/a", "c", MEM, 4).await?;
    let gpu = gpu_of(&a.device_ids[0]).to_owned();
    let units = |r: std::ops::Range<u32>| r.map(|n| format!("{gpu}::{n}")).collect::<Vec<_>>();
    // The reconciler asks; the kubelet's answer (ns/a holds units 0..4) is held on its way.
    let mut stale = node.kubelet.hold_next_list();
    stale.asked(WAIT).await?;
    // Meanwhile ns/a ends and another container is given units 2..6, replacing ns/a's grant.
    node.kubelet.end_pod("ns/a");
    node.kubelet.allocate_raw(MEM, vec![units(2..6)]).await?;
    // The stale answer arrives, then the reconciler asks again.
    let mut after = node.kubelet.hold_next_list();
    stale.release();
    after.asked(WAIT).await?;
    let records: Vec<Vec<String>> =
        agent.resources().records().into_iter().map(|r| r.device_ids).collect();
    assert_eq!(records, [units(2..6)], "the new grant stands; ns/a is not restored over it");
    after.release();
    stop(agent, token).await
}

/// Issue 11, item 4: a stale list does not mark a fresh init-container grant of the same devices
/// as listed (which would release it as soon as the next list, which omits init containers,
/// came).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_list_does_not_mark_a_fresh_grant_listed() -> Result<()> {
    let mut node = TestNode::new("l4-4x-pcie.yaml", Backend::Simulated).await?;
    // The init container's grant must outlive the passes below however slow the machine is.
    node.config.reconcile_grace = Duration::from_secs(600);
    let (agent, token) = node.start().await?;
    node.registered(&agent, 1).await?;
    let a = node.kubelet.admit_to("ns/a", "c", GPU, 1).await?;
    next_pass(&node).await?;
    next_pass(&node).await?;
    assert!(agent.resources().records().iter().all(|r| r.listed), "ns/a seen in the list");
    let mut stale = node.kubelet.hold_next_list();
    stale.asked(WAIT).await?;
    // ns/a ends; an init container of another pod is given exactly ns/a's GPU.
    node.kubelet.end_pod("ns/a");
    node.kubelet.allocate_raw(GPU, vec![a.device_ids.clone()]).await?;
    let mut after = node.kubelet.hold_next_list();
    stale.release();
    after.asked(WAIT).await?;
    let records = agent.resources().records();
    assert_eq!(records.len(), 1);
    assert!(!records[0].listed, "the init container's grant is not taken for ns/a's: {records:?}");
    after.release();
    // Passes go on: the grant is kept for the grace, not released.
    next_pass(&node).await?;
    next_pass(&node).await?;
    assert_eq!(agent.resources().records().len(), 1);
    stop(agent, token).await
}

/// Issue 11, item 6: one list that misses a running container (a kubelet answering before it has
/// synced its pods) does not release its GPU; two in a row do.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_list_missing_a_container_does_not_release_it() -> Result<()> {
    let node = TestNode::new("l4-4x-pcie.yaml", Backend::Simulated).await?;
    let (agent, token) = node.start().await?;
    node.registered(&agent, 1).await?;
    node.kubelet.admit_to("ns/a", "c", GPU, 1).await?;
    next_pass(&node).await?;
    next_pass(&node).await?;
    assert!(agent.resources().records().iter().all(|r| r.listed));
    // The kubelet leaves ns/a out of exactly one answer.
    node.kubelet.omit_from_next_list("ns/a");
    next_pass(&node).await?;
    // The next list is asked only once the one without ns/a has been applied.
    let mut applied = node.kubelet.hold_next_list();
    applied.asked(WAIT).await?;
    assert_eq!(agent.resources().records().len(), 1, "one miss keeps the GPU held");
    applied.release();
    // A pod that really ended is released after the second miss.
    node.kubelet.end_pod("ns/a");
    next_pass(&node).await?;
    next_pass(&node).await?;
    next_pass(&node).await?;
    assert!(agent.resources().records().is_empty());
    stop(agent, token).await
}

/// Issue 11, item 5: a second agent on the node (a rolling update with surge) waits for the
/// first to exit and never touches its sockets or checkpoint; a copy with another state
/// directory cannot take the first one's sockets and stops.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_agent_waits_and_never_steals_the_first_ones_sockets() -> Result<()> {
    let node = TestNode::new("l4-4x-pcie.yaml", Backend::Simulated).await?;
    let (first, first_token) = node.start().await?;
    let view = node.registered(&first, 1).await?;
    let a = node.kubelet.admit_to("ns/a", "c", GPU, 1).await?;
    let second_token = CancellationToken::new();
    let second = tokio::spawn(Agent::start(
        node.config.clone(),
        Dependencies { inventory: node.inventory.clone(), node_api: None },
        second_token.clone(),
    ));
    // It waits (a bounded look for something that must not happen).
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert!(!second.is_finished(), "the second agent waits for the lock");
    assert_eq!(node.kubelet.view().registrations, view.registrations, "no registration stolen");
    // The first exits; the second takes over with its allocations.
    stop(first, first_token).await?;
    let second = tokio::time::timeout(WAIT, second).await???;
    node.registered(&second, 2).await?;
    let records = second.resources().records();
    assert_eq!(records.len(), 1);
    assert_eq!(records[0].device_ids, a.device_ids);
    // A copy run by hand with its own state directory cannot take the serving agent's sockets.
    let registered = node.kubelet.view().registrations;
    let mut stray = node.config.clone();
    stray.state_dir = node.config.state_dir.with_extension("stray");
    let stray_agent = tokio::time::timeout(
        WAIT,
        Agent::start(
            stray,
            Dependencies { inventory: node.inventory.clone(), node_api: None },
            CancellationToken::new(),
        ),
    )
    .await??;
    let err = tokio::time::timeout(WAIT, stray_agent.wait()).await?.expect_err("stops");
    assert!(format!("{:#}", anyhow::Error::new(err)).contains("another live process"));
    let after = node.kubelet.view();
    assert_eq!(after.registrations, registered, "the stray copy registered nothing");
    assert!(after.streaming.len() >= 2, "the serving agent still streams: {}", after.summary());
    assert_eq!(second.resources().records().len(), 1);
    stop(second, second_token).await
}

/// Issue 11, item 1: a start whose configuration or GPUs would change what held device IDs
/// mean (another memory unit, a dropped NVLink group size, groups renumbered by a GPU entering
/// MIG mode) is refused as a configuration error, the checkpoint untouched; the unchanged
/// configuration starts with every allocation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_configuration_that_changes_held_device_ids_is_refused() -> Result<()> {
    let node = TestNode::new("h200-8x-nvswitch.yaml", Backend::Simulated).await?;
    let (agent, token) = node.start().await?;
    node.registered(&agent, 1).await?;
    node.kubelet.admit_to("ns/a", "c", MEM, 8).await?;
    let group =
        node.kubelet.admit_to("ns/g", "c", "awesome-ai-company.com/nvlink-group-2", 1).await?;
    stop(agent, token).await?;
    let journal = node.config.state_dir.join(baleen_agent::checkpoint::JOURNAL_FILE_NAME);
    let saved = (std::fs::read(node.checkpoint())?, std::fs::read(&journal)?);
    let start = |config: AgentConfig, inventory: Arc<dyn GpuInventory>| async move {
        let token = CancellationToken::new();
        let started = tokio::time::timeout(
            WAIT,
            Agent::start(config, Dependencies { inventory, node_api: None }, token.clone()),
        )
        .await?;
        anyhow::Ok((started, token))
    };
    let refused = |started: std::result::Result<Agent, baleen_agent::run::AgentError>| {
        let err = started.err().context("refused")?;
        assert!(err.is_configuration(), "exit 64: {err}");
        anyhow::Ok(err.to_string())
    };
    // Another memory unit.
    let mut config = node.config.clone();
    config.views.memory_unit_bytes = 512 << 20;
    let text = refused(start(config, node.inventory.clone()).await?.0)?;
    assert!(text.contains("memory unit is now 536870912 bytes"), "{text}");
    // The held group's size no longer offered.
    let mut config = node.config.clone();
    config.views.nvlink_group_sizes = vec![4, 8];
    let text = refused(start(config, node.inventory.clone()).await?.0)?;
    assert!(text.contains("does not offer awesome-ai-company.com/nvlink-group-2"), "{text}");
    // GPU 1 in MIG mode: nvlink2-<GPU 0> would name GPUs 0 and 2.
    let mut inventory = example("h200-8x-nvswitch.yaml")?;
    inventory.gpus[1].mig = baleen_agent::inventory::MigState::Enabled { instances: vec![] };
    let text =
        refused(start(node.config.clone(), Arc::new(SimulatedInventory::new(inventory))).await?.0)?;
    assert!(text.contains(&format!("NVLink group {}", group.device_ids[0])), "{text}");
    let now = (std::fs::read(node.checkpoint())?, std::fs::read(&journal)?);
    assert_eq!(now, saved, "the checkpoint and its journal are left as they were");
    // The configuration it was written with starts, with both allocations.
    let (agent, token) = node.start().await?;
    assert_eq!(agent.resources().records().len(), 2);
    stop(agent, token).await
}

/// Issue 11, also found: a device-plugin directory too long for a Unix socket address is a
/// configuration error naming the paths, found before anything is bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn socket_paths_too_long_are_a_configuration_error() -> Result<()> {
    let node = TestNode::new("l4-4x-pcie.yaml", Backend::Simulated).await?;
    let mut config = node.config.clone();
    config.device_plugin_dir = node.config.device_plugin_dir.join("d".repeat(80));
    std::fs::create_dir_all(&config.device_plugin_dir)?;
    let err = tokio::time::timeout(
        WAIT,
        Agent::start(
            config,
            Dependencies { inventory: node.inventory.clone(), node_api: None },
            CancellationToken::new(),
        ),
    )
    .await?
    .err()
    .context("refused")?;
    assert!(err.is_configuration(), "{err}");
    let text = err.to_string();
    assert!(text.contains("longer than 107 bytes") && text.contains("gpu-memory.sock"), "{text}");
    Ok(())
}

/// Whether the ledger still holds `gpu` whole for pod `pod`.
fn held_whole_by(agent: &Agent, gpu: &str, pod: &str) -> bool {
    agent.resources().grants().iter().any(|(r, g, _, k)| {
        r.resource == GPU && g == gpu && k.as_ref().is_none_or(|k| k.pod == pod)
    })
}

/// Issue 22, item 1: a whole GPU held by pod-w; the kubelet restarts (it registers the plugins
/// again) and lists no pod at all, as one restarted while the API server is unreachable does
/// until it syncs. Nothing is released while it settles: the GPU's units stay Unhealthy, so no
/// 4-unit share of it can be granted, and when pod-w is listed again the ledger still holds it.
/// Once the kubelet has settled and still does not list it (and there is no API to ask), the
/// kubelet's word holds again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_kubelets_empty_list_releases_nothing_until_it_has_settled() -> Result<()> {
    let mut node = TestNode::new("l4-4x-pcie.yaml", Backend::Simulated).await?;
    node.config.reconcile_settle = Duration::from_millis(1500);
    let (agent, token) = node.start().await?;
    node.registered(&agent, 1).await?;
    let w = node.kubelet.admit_to("ns/w", "c", GPU, 1).await?;
    let gpu = w.device_ids[0].clone();
    eventually("pod-w listed", || {
        agent.resources().grants().iter().any(|(_, g, _, k)| *g == gpu && k.is_some())
    })
    .await?;
    // Past the settling of the agent's own start.
    tokio::time::sleep(Duration::from_millis(1600)).await;
    node.kubelet.forget_pods(true);
    node.kubelet.restart().await?;
    node.registered(&agent, 2).await?;
    // Many reconciliations (every 100 ms) while it settles: nothing released.
    for _ in 0..10 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(held_whole_by(&agent, &gpu, "w"), "released while the kubelet settles");
        let view = node.kubelet.view();
        assert!(
            unit_health(&view, &gpu).iter().all(|h| *h == "Unhealthy"),
            "the GPU's units offered: {:?}",
            unit_health(&view, &gpu)
        );
    }
    let text = http_get(agent.metrics_address().context("metrics")?, "/metrics").await?.1;
    let held = sample(&text, "baleen_reconcile_changes_total", &[("change", "held")]);
    assert!(held.is_some_and(|n| n >= 1.0), "counted: {held:?}");
    // It syncs and lists pod-w again: still held, by pod-w.
    node.kubelet.forget_pods(false);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(held_whole_by(&agent, &gpu, "w"));
    // Forgetful again once settled, with no API to ask: two misses release it, as before.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    node.kubelet.forget_pods(true);
    eventually("released once settled", || !held_whole_by(&agent, &gpu, "w")).await?;
    stop(agent, token).await
}

/// Issue 22, item 1: where the agent follows the node's pods, a miss the API server
/// contradicts (it says pod-w runs) is held however long it lasts, and released as soon as the
/// API says the pod is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_miss_the_api_server_contradicts_is_held_until_the_api_says_the_pod_ended() -> Result<()>
{
    let node = TestNode::new("l4-4x-pcie.yaml", Backend::Simulated).await?;
    let api = baleen_tests::fake_apiserver::FakeApiServer::start(&["node-a"]).await?;
    api.put_pod(running_pod(
        "ns/w",
        "9f8e7d6c-0000-4000-8000-0000000000aa",
        "c",
        &"a".repeat(64),
        0,
    ));
    let client = baleen_agent::kube_api::KubeNodeApi::at(&api.url())?;
    let (agent, token) = node.start_with(Some(client)).await?;
    node.registered(&agent, 1).await?;
    let w = node.kubelet.admit_to("ns/w", "c", GPU, 1).await?;
    let gpu = w.device_ids[0].clone();
    eventually("pod-w listed", || {
        agent.resources().grants().iter().any(|(_, g, _, k)| *g == gpu && k.is_some())
    })
    .await?;
    node.kubelet.forget_pods(true);
    for _ in 0..10 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(held_whole_by(&agent, &gpu, "w"), "released though the API says pod-w runs");
    }
    api.delete_pod("ns/w");
    eventually("released once the API says pod-w is gone", || !held_whole_by(&agent, &gpu, "w"))
        .await?;
    stop(agent, token).await
}

/// An inventory whose discovery hangs (NVML with a GPU fallen off the bus), the rest simulated.
struct HangingDiscovery(SimulatedInventory);

impl GpuInventory for HangingDiscovery {
    fn discover(
        &self,
    ) -> Result<baleen_agent::inventory::Inventory, baleen_agent::inventory::InventoryError> {
        // Long against the stop asked (the test's runtime waits for this thread at its end).
        std::thread::sleep(Duration::from_secs(3));
        self.0.discover()
    }
    fn health_watcher(
        &self,
    ) -> Result<
        Box<dyn baleen_agent::inventory::HealthWatcher + '_>,
        baleen_agent::inventory::InventoryError,
    > {
        self.0.health_watcher()
    }
    fn processes(
        &self,
    ) -> Result<Vec<baleen_agent::inventory::GpuProcess>, baleen_agent::inventory::InventoryError>
    {
        self.0.processes()
    }
    fn telemetry(
        &self,
    ) -> Result<Vec<baleen_agent::inventory::GpuTelemetry>, baleen_agent::inventory::InventoryError>
    {
        self.0.telemetry()
    }
}

/// Issue 22, item 2: a stop during a discovery that hangs stops the start at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_during_a_hanging_discovery_stops_the_start() -> Result<()> {
    let mut node = TestNode::new("l4-4x-pcie.yaml", Backend::Simulated).await?;
    node.inventory =
        Arc::new(HangingDiscovery(SimulatedInventory::new(example("l4-4x-pcie.yaml")?)));
    let token = CancellationToken::new();
    let starting = tokio::spawn(Agent::start(
        node.config.clone(),
        Dependencies { inventory: node.inventory.clone(), node_api: None },
        token.clone(),
    ));
    tokio::time::sleep(Duration::from_millis(300)).await;
    let asked = std::time::Instant::now();
    token.cancel();
    let outcome = tokio::time::timeout(Duration::from_secs(2), starting)
        .await
        .context("start did not stop")??;
    assert!(
        matches!(outcome, Err(baleen_agent::run::AgentError::StoppedBeforeStart)),
        "{:?}",
        outcome.err()
    );
    assert!(asked.elapsed() < Duration::from_secs(1));
    Ok(())
}

/// Issue 22, item 5: under concurrency (16 clients at once, one write covering many of them)
/// every grant is on disk before it is answered: each client reads the checkpoint the moment
/// its answer arrives and finds its devices there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_grants_are_each_durable_before_they_are_answered() -> Result<()> {
    let mut node = TestNode::new("h200-8x-nvswitch.yaml", Backend::Simulated).await?;
    // Never listed (raw Allocates): kept for the whole test.
    node.config.reconcile_grace = Duration::from_secs(600);
    let (agent, token) = node.start().await?;
    let view = node.registered(&agent, 1).await?;
    let mut free = view.healthy(MEM);
    free.sort();
    let checkpoint = baleen_agent::checkpoint::Checkpoint::in_dir(&node.config.state_dir);
    let kubelet = &node.kubelet;
    // Sixteen clients in flight at once (one task, their requests interleaved).
    let clients = (0..16).map(|_| {
        let ids: Vec<String> = free.drain(..20).collect();
        let checkpoint = checkpoint.clone();
        async move {
            for id in ids {
                kubelet
                    .allocate_raw(MEM, vec![vec![id.clone()]])
                    .await
                    .map_err(|e| anyhow::anyhow!("{e:?}"))?;
                // The snapshot and its journal, read as a restart would.
                let held = checkpoint.load("node-a", "boot-1")?.context("a checkpoint")?;
                anyhow::ensure!(
                    held.allocations.iter().any(|r| r.device_ids == [id.clone()]),
                    "{id} answered before it was on disk"
                );
            }
            anyhow::Ok(())
        }
    });
    let clients: Vec<_> = clients.collect();
    futures::future::try_join_all(clients).await?;
    assert_eq!(agent.resources().records().len(), 320);
    stop(agent, token).await
}

/// Issue 22, item 5: a checkpoint that cannot be written refuses the grants it was to hold
/// (Internal), and their devices stay held: never handed out twice; once it can be written
/// again, grants go on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkpoint_that_cannot_be_written_refuses_the_grant_and_hands_nothing_out_twice()
-> Result<()> {
    let node = TestNode::new("l4-4x-pcie.yaml", Backend::Simulated).await?;
    let (agent, token) = node.start().await?;
    let view = node.registered(&agent, 1).await?;
    let mut free = view.healthy(MEM);
    free.sort();
    let checkpoint = baleen_agent::checkpoint::Checkpoint::in_dir(&node.config.state_dir);
    // The journal removed under the agent (an append would go nowhere), and the snapshot's
    // temporary path taken by a directory (no new snapshot can be written either).
    let blocker = PathBuf::from(format!("{}.tmp", node.checkpoint().display()));
    std::fs::create_dir_all(&blocker)?;
    std::fs::remove_file(checkpoint.journal_path())?;
    for unit in &free[..2] {
        let refused = node.kubelet.allocate_raw(MEM, vec![vec![unit.clone()]]).await;
        assert!(refused.is_err(), "answered though not durable");
        assert!(format!("{refused:?}").contains("Internal"), "{refused:?}");
    }
    std::fs::remove_dir(&blocker)?;
    let again = node.kubelet.allocate_raw(MEM, vec![vec![free[0].clone(), free[2].clone()]]).await;
    assert!(again.is_err(), "the refused grant's unit handed out again: {again:?}");
    node.kubelet
        .allocate_raw(MEM, vec![vec![free[2].clone()]])
        .await
        .map_err(|e| anyhow::anyhow!("{e:?}"))?;
    let held = checkpoint.load("node-a", "boot-1")?.context("a checkpoint")?;
    let on_disk: Vec<&String> = held.allocations.iter().flat_map(|r| &r.device_ids).collect();
    for unit in &free[..3] {
        assert!(on_disk.contains(&unit), "{unit} held, on disk now: {on_disk:?}");
    }
    stop(agent, token).await
}

/// Issue 22, item 5: the agent as its own process, SIGKILLed in the middle of bursts of
/// concurrent grants, round after round: every grant answered before a kill is held by every
/// later agent (read back from the snapshot and its journal), none is held twice, and the
/// journal's torn tail, if the kill left one, costs nothing answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_during_bursts_of_grants_loses_no_answered_grant() -> Result<()> {
    const ROUNDS: u64 = 20;
    let binary = agent_binary()?;
    let tmp = tempfile::tempdir()?;
    let root = tmp.path();
    let layout = AgentConfig::for_root(root);
    let mut kubelet = FakeKubelet::start(&layout.device_plugin_dir).await?;
    kubelet.serve_pod_resources(&layout.pod_resources_socket)?;
    std::fs::write(root.join("boot_id"), "boot-1\n")?;
    let topology =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../packaging/examples/h200-8x-nvswitch.yaml");
    let spawn = || {
        baleen_tests::bench::agent_process(&binary, &topology, root, "node-a")
            .args(["--metrics-address", "127.0.0.1:0", "--memory-unit", "256MiB"])
            .arg("--boot-id-file")
            .arg(root.join("boot_id"))
            .args(["--log-level", "warn"])
            .spawn()
    };
    let kubelet = Arc::new(kubelet);
    let mut answered: Vec<String> = Vec::new();
    let mut free: Vec<String> = Vec::new();
    for round in 1..=ROUNDS {
        let mut child = spawn()?;
        kubelet.wait_registered(MEM, round).await?;
        let view = kubelet.wait_for("units offered", WAIT, |v| v.healthy(MEM).len() > 4000).await?;
        if free.is_empty() {
            free = view.healthy(MEM);
            free.sort();
        }
        // Sixteen clients granting one unit at a time until the kill; an ID is tried once, ever.
        let burst: Vec<Vec<String>> = (0..16).map(|_| free.drain(..12).collect()).collect();
        let first = Arc::new(tokio::sync::Notify::new());
        let clients: Vec<_> = burst
            .into_iter()
            .map(|ids| {
                let (kubelet, first) = (kubelet.clone(), first.clone());
                tokio::spawn(async move {
                    let mut ok = Vec::new();
                    for id in ids {
                        if kubelet.allocate_raw(MEM, vec![vec![id.clone()]]).await.is_err() {
                            break;
                        }
                        ok.push(id);
                        first.notify_one();
                    }
                    ok
                })
            })
            .collect();
        // Killed at a different point of the burst each round, once it has begun.
        tokio::time::timeout(WAIT, first.notified()).await.context("a first grant")?;
        tokio::time::sleep(Duration::from_millis((37 * round) % 130)).await;
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(i32::try_from(child.id())?),
            nix::sys::signal::Signal::SIGKILL,
        )?;
        let _ = child.wait();
        let before = answered.len();
        for c in clients {
            answered.extend(c.await?);
        }
        anyhow::ensure!(
            answered.len() > before,
            "round {round}: no grant answered before the kill"
        );
        // What the next agent will read.
        let held = baleen_agent::checkpoint::Checkpoint::in_dir(&layout.state_dir)
            .load("node-a", "boot-1")?
            .context("a checkpoint")?;
        let mut ids: Vec<&String> = held.allocations.iter().flat_map(|r| &r.device_ids).collect();
        for id in &answered {
            anyhow::ensure!(ids.contains(&id), "round {round}: answered grant {id} lost");
        }
        let all = ids.len();
        ids.sort();
        ids.dedup();
        anyhow::ensure!(ids.len() == all, "round {round}: a unit held twice");
    }
    // The last agent starts from it all and rewrites its checkpoint from its ledger.
    let mut child = spawn()?;
    kubelet.wait_registered(MEM, ROUNDS + 1).await?;
    let held = baleen_agent::checkpoint::Checkpoint::in_dir(&layout.state_dir)
        .load("node-a", "boot-1")?
        .context("a checkpoint")?;
    child.kill()?;
    let _ = child.wait();
    let ids: std::collections::BTreeSet<&String> =
        held.allocations.iter().flat_map(|r| &r.device_ids).collect();
    assert!(answered.iter().all(|id| ids.contains(id)), "every answered grant held");
    assert!(answered.len() as u64 >= ROUNDS, "{} grants answered", answered.len());
    eprintln!("{} grants answered over {ROUNDS} kills, none lost", answered.len());
    Ok(())
}
