//! Issue 12: the MPS supervisor against the fake control binary: daemons per GPU, adoption across restarts, a process of their own, the inventory's view of them.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn units_wait_for_their_daemon_and_a_killed_daemon_withdraws_only_its_gpu() -> Result<()> {
    let mut node = TestNode::new("l4-4x-pcie.yaml", Backend::Simulated).await?;
    let expected = example("l4-4x-pcie.yaml")?;
    let refused = expected.gpus[1].uuid.to_string();
    // GPU 1's daemon will not start at first.
    directive(&node, &refused, "refuse")?;
    node.config.mps.probe_timeout = Duration::from_millis(500);
    let (agent, token) = node.start().await?;
    node.registered(&agent, 1).await?;
    units_are(&node, &refused, false, "GPU 1's units withheld while its daemon cannot start")
        .await?;
    for g in expected.gpus.iter().map(|g| g.uuid.to_string()).filter(|g| *g != refused) {
        units_are(&node, &g, true, "the other GPUs' units offered").await?;
        assert!(control_log(&node, &g).contains("started"), "a daemon per GPU");
    }
    // GPU 1's daemon can start now: after its backoff it does, and its units come.
    directive(&node, &refused, "")?;
    units_are(&node, &refused, true, "GPU 1's units offered once its daemon answers").await?;
    // A daemon killed: only its GPU's units go, then it is restarted and they return.
    let victim = expected.gpus[2].uuid.to_string();
    let pid = daemon_pid(&node, &victim)?;
    // (Its restart is held back until the withdrawal has been seen: a restart within a
    // millisecond could replace the Unhealthy list before the kubelet reads it.)
    directive(&node, &victim, "refuse")?;
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL)?;
    units_are(&node, &victim, false, "the killed daemon's GPU withdrawn").await?;
    units_are(&node, &refused, true, "the others untouched").await?;
    directive(&node, &victim, "")?;
    units_are(&node, &victim, true, "restarted, offered again").await?;
    assert_ne!(daemon_pid(&node, &victim)?, pid, "a new daemon");
    // A hung daemon times out the same way.
    directive(&node, &victim, "hang")?;
    units_are(&node, &victim, false, "the hung daemon's GPU withdrawn").await?;
    directive(&node, &victim, "")?;
    units_are(&node, &victim, true, "answering again").await?;
    stop(agent, token).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_agent_adopts_the_daemons_and_quits_them_only_when_told() -> Result<()> {
    let mut node = TestNode::new("l4-4x-pcie.yaml", Backend::Simulated).await?;
    let (agent, token) = node.start().await?;
    node.registered(&agent, 1).await?;
    let gpu = gpus(&node)[0].clone();
    units_are(&node, &gpu, true, "offered").await?;
    let pid = daemon_pid(&node, &gpu)?;
    stop(agent, token).await?;
    // Left serving (mps.stopOnExit false): no quit, same daemon.
    assert!(!control_log(&node, &gpu).contains("Cmd:quit"), "{}", control_log(&node, &gpu));
    let (agent, token) = node.start().await?;
    node.registered(&agent, 2).await?;
    units_are(&node, &gpu, true, "offered at once by the adopted daemon").await?;
    assert_eq!(daemon_pid(&node, &gpu)?, pid, "adopted, not started again");
    assert_eq!(control_log(&node, &gpu).matches("started").count(), 1, "one daemon ever");
    stop(agent, token).await?;
    // With stopOnExit, the agent tells its daemons to quit.
    node.config.mps.stop_on_exit = true;
    let (agent, token) = node.start().await?;
    node.registered(&agent, 3).await?;
    stop(agent, token).await?;
    let log = control_log(&node, &gpu);
    assert!(log.contains("Cmd:quit") && log.contains("exit"), "{log}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_control_binary_no_unit_is_offered_and_with_mps_off_they_are_accounting_only()
-> Result<()> {
    let mut node = TestNode::new("l4-4x-pcie.yaml", Backend::Simulated).await?;
    node.config.mps.control_binary = "/nonexistent/nvidia-cuda-mps-control".into();
    let (agent, token) = node.start().await?;
    node.registered(&agent, 1).await?;
    let view = node.kubelet.view();
    assert!(!view.devices_of(MEM).is_empty() && view.healthy(MEM).is_empty(), "{}", view.summary());
    assert_eq!(view.healthy(GPU).len(), 4, "whole GPUs need no MPS");
    stop(agent, token).await?;
    // MPS off: offered, and every answer says the limit is not enforced.
    node.config.mps.enabled = false;
    let (agent, token) = node.start().await?;
    node.registered(&agent, 2).await?;
    node.kubelet
        .wait_for("units offered without MPS", WAIT, |v| !v.healthy(MEM).is_empty())
        .await?;
    let a = node.kubelet.admit_to("ns/a", "c", MEM, 2).await?;
    assert_eq!(a.response.envs["BALEEN_GPU_SHARING"], "accounting-only");
    assert!(
        !a.response.envs.contains_key("CUDA_MPS_PIPE_DIRECTORY") && a.response.mounts.is_empty()
    );
    stop(agent, token).await
}

/// Issue 12, item 3: the daemons in a process of their own (`baleen-agent mps`, a DaemonSet an
/// agent upgrade does not restart); the agent with `mps.daemons: external` only probes: it
/// offers the units while the daemons answer, withdraws them when one dies (the MPS process
/// restarts it), and its own restarts never touch them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_mps_process_of_its_own_keeps_the_daemons_across_agent_restarts() -> Result<()> {
    let mut node = TestNode::new("l4-4x-pcie.yaml", Backend::Simulated).await?;
    let mps_stop = CancellationToken::new();
    let (mut config, inventory) = (node.config.clone(), node.inventory.discover()?);
    // The MPS process probes less often than the agent, so that the agent sees a killed daemon
    // before it is replaced.
    config.mps.probe_interval = Duration::from_secs(1);
    let mps_token = mps_stop.clone();
    let mps = tokio::spawn(async move {
        baleen_agent::run::mps::run_alone(&config, &inventory, mps_token).await
    });
    node.config.mps.daemons = baleen_agent::isolation::mps::DaemonPlacement::External;
    node.config.mps.stop_on_exit = true;
    let (agent, token) = node.start().await?;
    node.registered(&agent, 1).await?;
    let gpu = gpus(&node)[0].clone();
    units_are(&node, &gpu, true, "offered while the MPS process's daemon answers").await?;
    let pid = daemon_pid(&node, &gpu)?;
    // A daemon dies: the agent withdraws its units, the MPS process starts it again (held back
    // until the withdrawal has been seen).
    directive(&node, &gpu, "refuse")?;
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL)?;
    units_are(&node, &gpu, false, "withdrawn").await?;
    directive(&node, &gpu, "")?;
    units_are(&node, &gpu, true, "offered again").await?;
    let pid = daemon_pid(&node, &gpu)?;
    // The agent stops (even with stopOnExit, daemons it does not own are not told to quit) and
    // comes back: the same daemon.
    stop(agent, token).await?;
    assert!(!control_log(&node, &gpu).contains("Cmd:quit"));
    let (agent, token) = node.start().await?;
    node.registered(&agent, 2).await?;
    units_are(&node, &gpu, true, "offered by the same daemon").await?;
    assert_eq!(daemon_pid(&node, &gpu)?, pid);
    stop(agent, token).await?;
    mps_stop.cancel();
    tokio::time::timeout(WAIT, mps).await???;
    assert!(!control_log(&node, &gpu).contains("Cmd:quit"), "left serving");
    Ok(())
}

/// Issue 12, item 6: `baleen-agent inventory` says, per shared GPU, whether its MPS daemon
/// answers, and why not.
#[test]
fn inventory_says_whether_each_mps_daemon_answers() -> Result<()> {
    let root = tempfile::tempdir()?;
    let fake = PathBuf::from(env!("CARGO_BIN_EXE_fake-mps-control"));
    let gpu = "GPU-11111111-2222-3333-4444-555555555555".to_owned();
    let status =
        baleen_agent::cli::inventory::mps_status(std::slice::from_ref(&gpu), root.path(), &fake);
    assert!(!status[0].answering);
    assert!(
        status[0].reason.as_deref().is_some_and(|r| r.contains("Cannot find MPS control daemon"))
    );
    let dirs = root.path().join(&gpu);
    let started = std::process::Command::new(&fake)
        .arg("-d")
        .env("CUDA_MPS_PIPE_DIRECTORY", dirs.join("pipe"))
        .env("CUDA_MPS_LOG_DIRECTORY", dirs.join("log"))
        .status()?;
    assert!(started.success());
    let status = baleen_agent::cli::inventory::mps_status(&[gpu], root.path(), &fake);
    assert!(status[0].answering, "{status:?}");
    let missing = baleen_agent::cli::inventory::mps_status(
        &["GPU-x".to_owned()],
        root.path(),
        Path::new("/nonexistent/nvidia-cuda-mps-control"),
    );
    assert!(
        missing[0]
            .reason
            .as_deref()
            .is_some_and(|r| r.contains("cannot run the MPS control binary"))
    );
    Ok(())
}
