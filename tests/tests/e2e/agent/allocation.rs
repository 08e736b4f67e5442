//! Allocation through every view: packing, exclusivity across views, MIG, CDI names, init and multi-container pods, clear refusals.

use super::*;

async fn every_view_registers_and_packs(backend: Backend) -> Result<()> {
    let node = TestNode::new("h200-8x-nvswitch.yaml", backend).await?;
    let (agent, token) = node.start().await?;
    let view = node.registered(&agent, 1).await?;
    let mut names: Vec<&str> = agent.plugins().iter().map(|(r, _)| r.as_str()).collect();
    names.sort_unstable();
    assert_eq!(
        names,
        [
            GPU,
            MEM,
            "awesome-ai-company.com/nvlink-group-2",
            "awesome-ai-company.com/nvlink-group-4",
            "awesome-ai-company.com/nvlink-group-8"
        ]
    );
    assert_eq!(view.devices_of(MEM).len(), 8 * 140);
    assert_eq!(view.healthy(GPU).len(), 8);

    // 100 units on one GPU, 120 on another: a 16-unit request goes to the tightest (20 free).
    let a = node.kubelet.admit_to("ns/a", "c", MEM, 100).await?;
    let b = node.kubelet.admit_to("ns/b", "c", MEM, 120).await?;
    let gpu_a = gpu_of(&a.device_ids[0]).to_owned();
    let gpu_b = gpu_of(&b.device_ids[0]).to_owned();
    assert_ne!(gpu_a, gpu_b, "120 units do not fit beside 100 on one 140-unit GPU");
    assert!(a.device_ids.iter().all(|id| gpu_of(id) == gpu_a), "units of one container on one GPU");
    let c = node.kubelet.admit_to("ns/c", "c", MEM, 16).await?;
    assert!(
        c.device_ids.iter().all(|id| gpu_of(id) == gpu_b),
        "packed onto the 20-unit gap: {c:?}"
    );
    assert_eq!(c.preferred.as_deref(), Some(&c.device_ids[..]), "the kubelet took our preference");
    let d = node.kubelet.admit_to("ns/d", "c", MEM, 30).await?;
    assert!(d.device_ids.iter().all(|id| gpu_of(id) == gpu_a), "30 fits only beside the 100");
    assert_eq!(d.response.envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"], "0=30720M");
    assert_eq!(cdi_names(&d.response), [format!("nvidia.com/gpu={gpu_a}")]);
    assert_eq!(d.response.envs["NVIDIA_VISIBLE_DEVICES"], "void", "an image's `all` adds nothing");

    // Two containers never share a unit.
    let mut all: Vec<&String> = [&a, &b, &c, &d].iter().flat_map(|x| x.device_ids.iter()).collect();
    let total = all.len();
    all.sort();
    all.dedup();
    assert_eq!(all.len(), total);
    let records = agent.resources().records();
    assert_eq!(records.len(), 4);
    stop(agent, token).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn simulated_every_view_registers_and_memory_is_packed() -> Result<()> {
    every_view_registers_and_packs(Backend::Simulated).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fake_nvml_every_view_registers_and_memory_is_packed() -> Result<()> {
    every_view_registers_and_packs(Backend::FakeNvml).await
}

async fn exclusivity_and_refusals(backend: Backend) -> Result<()> {
    let node = TestNode::new("l4-4x-pcie.yaml", backend).await?;
    let (agent, token) = node.start().await?;
    let view = node.registered(&agent, 1).await?;
    assert!(view.devices.contains_key("awesome-ai-company.com/nvlink-group-2"));

    // A whole GPU: its units become Unhealthy; after the pod ends, Healthy again.
    let whole = node.kubelet.admit_to("ns/train", "c", GPU, 1).await?;
    let gpu = whole.device_ids[0].clone();
    node.kubelet
        .wait_for("units of the whole GPU unhealthy", WAIT, |v| {
            let h = unit_health(v, &gpu);
            !h.is_empty() && h.iter().all(|s| *s != HEALTHY)
        })
        .await?;

    // Allocate for that GPU's units is refused (a kubelet whose view is stale could ask).
    let err = node
        .kubelet
        .allocate_raw(MEM, vec![vec![format!("{gpu}::0"), format!("{gpu}::1")]])
        .await
        .expect_err("GPU taken whole");
    let AdmitError::Rpc(status) = err else { panic!("expected a gRPC error, got {err}") };
    assert_eq!(status.code(), Code::FailedPrecondition);
    assert!(
        status.message().contains(&gpu) && status.message().contains("held whole"),
        "{status:?}"
    );

    // Units on two GPUs are refused, naming both.
    let view = node.kubelet.view();
    let others: Vec<String> = view.healthy(GPU).into_iter().filter(|g| *g != gpu).collect();
    let split = vec![format!("{}::0", others[0]), format!("{}::0", others[1])];
    let err = node.kubelet.allocate_raw(MEM, vec![split]).await.expect_err("two GPUs");
    let AdmitError::Rpc(status) = err else { panic!("expected a gRPC error, got {err}") };
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(status.message().contains("on one GPU"), "{status:?}");
    assert!(status.message().contains(&others[0]) && status.message().contains(&others[1]));

    // Units on another GPU make that GPU unavailable as a whole GPU.
    let shared = node.kubelet.admit_to("ns/infer", "c", MEM, 4).await?;
    let shared_gpu = gpu_of(&shared.device_ids[0]).to_owned();
    let err =
        node.kubelet.allocate_raw(GPU, vec![vec![shared_gpu.clone()]]).await.expect_err("shared");
    let AdmitError::Rpc(status) = err else { panic!("expected a gRPC error, got {err}") };
    assert_eq!(status.code(), Code::FailedPrecondition);
    assert!(status.message().contains("gpu-memory units"), "{status:?}");

    node.kubelet.end_pod("ns/train");
    node.kubelet
        .wait_for("units healthy again after the pod ended", WAIT, |v| {
            unit_health(v, &gpu).iter().all(|s| *s == HEALTHY)
        })
        .await?;
    assert_eq!(agent.resources().records().len(), 1, "only the gpu-memory allocation is left");
    stop(agent, token).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn simulated_whole_gpu_hides_units_and_conflicts_are_refused() -> Result<()> {
    exclusivity_and_refusals(Backend::Simulated).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fake_nvml_whole_gpu_hides_units_and_conflicts_are_refused() -> Result<()> {
    exclusivity_and_refusals(Backend::FakeNvml).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpus_are_answered_as_cdi_names_the_spec_holds_else_by_volume_mounts() -> Result<()> {
    // A spec that lacks one GPU (the pain of nvidia-container-toolkit#1895): the agent says so
    // at start, answers that GPU's grants with volume-mounts (never a CDI name the runtime
    // cannot resolve) and counts them; the toolkit's configuration, mounted, says the variable
    // is refused for unprivileged containers.
    let expected = example("l4-4x-pcie.yaml")?;
    let node = TestNode::new("l4-4x-pcie.yaml", Backend::Simulated).await?;
    let missing = expected.gpus[3].uuid.to_string();
    let spec_dir = node.config.devices.cdi_spec_dirs[1].clone();
    write_cdi_spec(&spec_dir, &expected, std::slice::from_ref(&missing))?;
    let toolkit = node.config.devices.toolkit_config.clone();
    std::fs::create_dir_all(toolkit.parent().context("dir")?)?;
    std::fs::write(
        &toolkit,
        "accept-nvidia-visible-devices-envvar-when-unprivileged = false\naccept-nvidia-visible-devices-as-volume-mounts = true\n",
    )?;
    let (agent, token) = node.start().await?;
    node.registered(&agent, 1).await?;
    let named =
        node.kubelet.allocate_raw(GPU, vec![vec![expected.gpus[0].uuid.to_string()]]).await?;
    let named = &named.container_responses[0];
    assert_eq!(cdi_names(named), [format!("nvidia.com/gpu={}", expected.gpus[0].uuid)]);
    assert!(named.mounts.is_empty(), "{named:?}");
    let fallback = node.kubelet.allocate_raw(GPU, vec![vec![missing.clone()]]).await?;
    let fallback = &fallback.container_responses[0];
    assert!(fallback.cdi_devices.is_empty(), "never a name the spec lacks: {fallback:?}");
    assert_eq!(fallback.envs["NVIDIA_VISIBLE_DEVICES"], "/var/run/nvidia-container-devices");
    let mount = fallback.mounts.first().context("a device mount")?;
    assert_eq!(mount.container_path, format!("/var/run/nvidia-container-devices/{missing}"));
    assert_eq!((mount.host_path.as_str(), mount.read_only), ("/dev/null", true));
    let text = http_get(agent.metrics_address().context("metrics")?, "/metrics").await?.1;
    assert_eq!(sample(&text, "baleen_device_list_fallbacks_total", &[]), Some(1.0), "{text}");
    let state = |check: &str, state: &str| {
        sample(&text, "baleen_device_isolation", &[("check", check), ("state", state)])
    };
    assert_eq!(state("strategy", "ok"), Some(1.0), "{text}");
    assert_eq!(state("cdi-spec", "failed"), Some(1.0));
    assert_eq!(state("cdi-spec", "ok"), Some(0.0));
    assert_eq!(state("toolkit-envvar", "ok"), Some(1.0));
    assert_eq!(state("toolkit-volume-mounts", "ok"), Some(1.0), "fallbacks need it");
    stop(agent, token).await
}

async fn mig_views(backend: Backend) -> Result<()> {
    let node = TestNode::new("a100-4x-mig.yaml", backend).await?;
    let (agent, token) = node.start().await?;
    let view = node.registered(&agent, 1).await?;
    let mut names: Vec<&str> = agent.plugins().iter().map(|(r, _)| r.as_str()).collect();
    names.sort_unstable();
    assert_eq!(
        names,
        [
            GPU,
            MEM,
            "awesome-ai-company.com/mig-1g.10gb",
            "awesome-ai-company.com/mig-3g.40gb",
            "awesome-ai-company.com/mig-7g.80gb",
            "awesome-ai-company.com/nvlink-group-2",
        ]
    );
    assert_eq!(view.healthy("awesome-ai-company.com/mig-1g.10gb").len(), 2);
    assert_eq!(view.healthy(GPU).len(), 2, "the MIG GPUs are not whole GPUs");
    let mig = node.kubelet.admit_to("ns/m", "c", "awesome-ai-company.com/mig-1g.10gb", 1).await?;
    assert!(mig.device_ids[0].starts_with("MIG-"));
    assert_eq!(cdi_names(&mig.response), [format!("nvidia.com/gpu={}", mig.device_ids[0])]);
    stop(agent, token).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn simulated_mig_views_register_and_allocate() -> Result<()> {
    mig_views(Backend::Simulated).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fake_nvml_mig_views_register_and_allocate() -> Result<()> {
    mig_views(Backend::FakeNvml).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn devices_of_a_running_container_are_not_handed_out_again() -> Result<()> {
    let node = TestNode::new("l4-4x-pcie.yaml", Backend::Simulated).await?;
    let (agent, token) = node.start().await?;
    node.registered(&agent, 1).await?;
    let a = node.kubelet.admit_to("ns/a", "c", MEM, 4).await?;
    let gpu = gpu_of(&a.device_ids[0]).to_owned();
    let units = |r: std::ops::Range<u32>| r.map(|n| format!("{gpu}::{n}")).collect::<Vec<_>>();
    assert_eq!(a.device_ids, units(0..4));
    // A kubelet that lost its books hands units 2..6 to another container while ns/a runs:
    // the agent asks pod-resources and refuses.
    let err = node.kubelet.allocate_raw(MEM, vec![units(2..6)]).await.expect_err("still in use");
    let AdmitError::Rpc(status) = err else { panic!("expected a gRPC error, got {err}") };
    assert_eq!(status.code(), Code::FailedPrecondition);
    assert!(status.message().contains("running container ns/a/c"), "{status:?}");
    assert_eq!(agent.resources().records().len(), 1);
    // Once ns/a has ended, the same request replaces its allocation.
    node.kubelet.end_pod("ns/a");
    node.kubelet.allocate_raw(MEM, vec![units(2..6)]).await?;
    let records = agent.resources().records();
    assert_eq!(records.len(), 1);
    assert_eq!(records[0].device_ids, units(2..6));
    stop(agent, token).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_init_containers_units_are_reused_by_the_app_container() -> Result<()> {
    let node = TestNode::new("h200-8x-nvswitch.yaml", Backend::Simulated).await?;
    let (agent, token) = node.start().await?;
    node.registered(&agent, 1).await?;
    // Another pod already uses part of one GPU, so packing has a preference to show.
    node.kubelet.admit_to("ns/other", "c", MEM, 100).await?;
    // The init container (not in pod-resources, as the kubelet omits init containers).
    let init = node.kubelet.admit(MEM, 4).await?;
    let gpu = gpu_of(&init.device_ids[0]).to_owned();
    // The app container asks for more: the kubelet must include the init container's units.
    let app = node.kubelet.admit_reusing(MEM, 10, &init.device_ids).await?;
    assert!(init.device_ids.iter().all(|id| app.device_ids.contains(id)), "{app:?}");
    assert!(app.device_ids.iter().all(|id| gpu_of(id) == gpu), "all on the init's GPU: {app:?}");
    let records: Vec<Vec<String>> = agent
        .resources()
        .records()
        .into_iter()
        .filter(|r| r.device_ids.iter().any(|id| init.device_ids.contains(id)))
        .map(|r| r.device_ids)
        .collect();
    let mut expected = app.device_ids.clone();
    expected.sort();
    assert_eq!(records, [expected], "the app container's allocation replaced the init one");
    // A second app container needing fewer than the init container had: a subset, no question.
    let init2 = node.kubelet.admit(MEM, 6).await?;
    let small = node.kubelet.admit_reusing(MEM, 2, &init2.device_ids).await?;
    assert_eq!(small.preferred, None, "the kubelet does not ask when reuse suffices");
    assert_eq!(small.device_ids, init2.device_ids[..2]);
    assert_eq!(agent.resources().records().len(), 3);
    stop(agent, token).await
}

/// Issue 11, item 2: a request for exactly the devices a listed, running container holds (a
/// kubelet that lost its books) is refused, not taken for an init container's repeat; and when
/// pod-resources cannot say whether the holder still runs, the Allocate is refused (Unavailable)
/// rather than granted on trust.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exact_repeat_of_a_running_containers_devices_is_refused() -> Result<()> {
    let mut node = TestNode::new("l4-4x-pcie.yaml", Backend::Simulated).await?;
    let (agent, token) = node.start().await?;
    node.registered(&agent, 1).await?;
    let a = node.kubelet.admit_to("ns/a", "c", GPU, 1).await?;
    let err =
        node.kubelet.allocate_raw(GPU, vec![a.device_ids.clone()]).await.expect_err("ns/a runs");
    let AdmitError::Rpc(status) = err else { panic!("expected a gRPC error, got {err}") };
    assert_eq!(status.code(), Code::FailedPrecondition);
    assert!(status.message().contains("running container ns/a/c"), "{status:?}");
    // The same for gpu-memory units.
    let b = node.kubelet.admit_to("ns/b", "c", MEM, 3).await?;
    let err = node.kubelet.allocate_raw(MEM, vec![b.device_ids.clone()]).await.expect_err("runs");
    let AdmitError::Rpc(status) = err else { panic!("expected a gRPC error, got {err}") };
    assert_eq!(status.code(), Code::FailedPrecondition);
    // pod-resources gone: no repeat and no replacement is granted on trust.
    node.kubelet.stop_pod_resources();
    let err = node.kubelet.allocate_raw(GPU, vec![a.device_ids.clone()]).await.expect_err("unsure");
    let AdmitError::Rpc(status) = err else { panic!("expected a gRPC error, got {err}") };
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert!(status.message().contains("pod-resources"), "{status:?}");
    // Fresh devices need no question and are still granted.
    let fresh = node.kubelet.admit_to("ns/c", "c", GPU, 1).await?;
    assert_ne!(fresh.device_ids, a.device_ids);
    // Once ns/a has ended (and pod-resources answers), its GPU may be given again.
    node.kubelet.serve_pod_resources(&node.config.pod_resources_socket)?;
    node.kubelet.end_pod("ns/a");
    node.kubelet.allocate_raw(GPU, vec![a.device_ids.clone()]).await?;
    assert_eq!(agent.resources().records().len(), 3);
    stop(agent, token).await
}

/// Issue 11, also found: an Allocate of several containers that fails at one of them grants
/// none of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_multi_container_allocate_is_all_or_nothing() -> Result<()> {
    let node = TestNode::new("l4-4x-pcie.yaml", Backend::Simulated).await?;
    let (agent, token) = node.start().await?;
    node.registered(&agent, 1).await?;
    let whole = node.kubelet.admit_to("ns/x", "c", GPU, 1).await?;
    let taken = whole.device_ids[0].clone();
    let free =
        node.kubelet.view().healthy(GPU).into_iter().find(|g| *g != taken).context("free")?;
    let err = node
        .kubelet
        .allocate_raw(MEM, vec![vec![format!("{free}::0")], vec![format!("{taken}::0")]])
        .await
        .expect_err("the second container's GPU is held whole");
    let AdmitError::Rpc(status) = err else { panic!("expected a gRPC error, got {err}") };
    assert_eq!(status.code(), Code::FailedPrecondition);
    assert_eq!(agent.resources().records().len(), 1, "the first container got nothing either");
    // Both containers on free GPUs: both granted, answers in order.
    let other = node
        .kubelet
        .view()
        .healthy(GPU)
        .into_iter()
        .find(|g| *g != taken && *g != free)
        .context("x")?;
    let answer = node
        .kubelet
        .allocate_raw(MEM, vec![vec![format!("{free}::0")], vec![format!("{other}::0")]])
        .await?;
    assert_eq!(answer.container_responses.len(), 2);
    assert_eq!(cdi_names(&answer.container_responses[1]), [format!("nvidia.com/gpu={other}")]);
    assert_eq!(agent.resources().records().len(), 3);
    stop(agent, token).await
}
