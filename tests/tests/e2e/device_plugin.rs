//! End-to-end tests of the device-plugin library over Unix sockets against the fake kubelet:
//! registration, ListAndWatch, GetPreferredAllocation then Allocate, kubelet restarts, an absent
//! kubelet, bad requests and a bad resource name. Every await has a timeout; nothing sleeps.

use std::sync::Arc;
use std::time::{Duration, Instant};

use baleen_device_plugin::{Device, DeviceBackend, Health, Plugin, PluginConfig, PluginState};
use baleen_tests::fake_kubelet::{AdmitError, FakeKubelet};
use baleen_tests::memory_backend::MemoryBackend as TestBackend;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tonic::Code;

const RESOURCE: &str = "example.com/widget";
const WAIT: Duration = Duration::from_secs(10);

struct Running {
    token: CancellationToken,
    state: watch::Receiver<PluginState>,
    task: JoinHandle<Result<(), baleen_device_plugin::PluginError>>,
    socket: std::path::PathBuf,
}

fn start_plugin(dir: &std::path::Path, backend: Arc<TestBackend>) -> Running {
    let config = PluginConfig::new(dir, backend.resource_name());
    let socket = dir.join(&config.socket_name);
    let plugin = Plugin::new(backend, config);
    let state = plugin.state();
    let token = CancellationToken::new();
    let task = tokio::spawn(plugin.run(token.clone()));
    Running { token, state, task, socket }
}

impl Running {
    async fn wait_state(&mut self, what: &str, pred: impl Fn(&PluginState) -> bool) -> PluginState {
        let outcome = tokio::time::timeout(WAIT, self.state.wait_for(|s| pred(s)))
            .await
            .map(|r| r.map(|s| s.clone()));
        match outcome {
            Ok(Ok(s)) => s,
            Ok(Err(_)) => panic!("plugin ended while waiting for {what}"),
            Err(_) => panic!("timed out waiting for {what}; state {:?}", *self.state.borrow()),
        }
    }

    async fn stop(self) {
        self.token.cancel();
        let result = tokio::time::timeout(WAIT, self.task)
            .await
            .expect("plugin stops within the timeout")
            .expect("plugin task did not panic");
        assert!(result.is_ok(), "plugin run failed: {result:?}");
        assert_eq!(*self.state.borrow(), PluginState::Stopped);
        assert!(!self.socket.exists(), "socket {} removed on shutdown", self.socket.display());
    }
}

/// Issue 23, step 6, in paused time: while the kubelet's socket is absent the plugin looks
/// again after 100 ms, doubling to the 5 s cap (`PluginConfig`'s defaults), each look a new
/// `WaitingForKubelet` state.
#[tokio::test(start_paused = true)]
async fn without_a_kubelet_registration_is_retried_doubling_to_the_cap() -> anyhow::Result<()> {
    let tmp = tempfile::tempdir()?;
    let start = tokio::time::Instant::now();
    let mut plugin = start_plugin(tmp.path(), TestBackend::new(RESOURCE, 1));
    let mut looked = Vec::new();
    while looked.len() < 10 {
        plugin.state.changed().await?;
        if let PluginState::WaitingForKubelet { last_error, .. } =
            &*plugin.state.borrow_and_update()
        {
            assert!(last_error.contains("does not exist"), "{last_error}");
            looked.push((tokio::time::Instant::now() - start).as_millis());
        }
    }
    let gaps: Vec<u128> = looked.windows(2).map(|w| w[1] - w[0]).collect();
    assert_eq!(gaps, [100, 200, 400, 800, 1600, 3200, 5000, 5000, 5000], "looked at {looked:?}");
    plugin.stop().await;
    Ok(())
}

#[tokio::test]
async fn registers_and_streams_the_initial_list_then_updates() -> anyhow::Result<()> {
    let tmp = tempfile::tempdir()?;
    let dir = tmp.path().join("device-plugins");
    let kubelet = FakeKubelet::start(&dir).await?;
    let backend = TestBackend::new(RESOURCE, 4);
    let mut plugin = start_plugin(&dir, backend.clone());

    let view = kubelet.wait_registered(RESOURCE, 1).await?;
    assert_eq!(view.registrations.get(RESOURCE), Some(&1));
    let view = kubelet.wait_for("4 devices", WAIT, |v| v.devices_of(RESOURCE).len() == 4).await?;
    assert_eq!(view.healthy(RESOURCE), ["dev-0", "dev-1", "dev-2", "dev-3"]);
    plugin.wait_state("registered", |s| *s == PluginState::Registered { registrations: 1 }).await;

    // A change: one device unhealthy, one more device with a NUMA node.
    let mut next: Vec<Device> = (0..5).map(|i| Device::healthy(format!("dev-{i}"))).collect();
    next[1].health = Health::Unhealthy;
    next[4].numa_node = Some(1);
    backend.publish(next);
    let view = kubelet.wait_for("5 devices", WAIT, |v| v.devices_of(RESOURCE).len() == 5).await?;
    assert_eq!(view.healthy(RESOURCE), ["dev-0", "dev-2", "dev-3", "dev-4"]);
    let dev4 = &view.devices_of(RESOURCE)[4];
    let numa: Vec<i64> = dev4.topology.iter().flat_map(|t| t.nodes.iter().map(|n| n.id)).collect();
    assert_eq!(numa, [1]);
    assert!(view.updates[RESOURCE] >= 2);
    plugin.stop().await;
    Ok(())
}

#[tokio::test]
async fn preferred_allocation_then_allocate() -> anyhow::Result<()> {
    let tmp = tempfile::tempdir()?;
    let kubelet = FakeKubelet::start(tmp.path()).await?;
    let backend = TestBackend::new(RESOURCE, 4);
    let plugin = start_plugin(tmp.path(), backend.clone());
    kubelet.wait_for("devices", WAIT, |v| v.devices_of(RESOURCE).len() == 4).await?;

    let admitted = kubelet.admit(RESOURCE, 2).await?;
    assert_eq!(admitted.preferred.as_deref(), Some(&["dev-3".to_owned(), "dev-2".to_owned()][..]));
    assert_eq!(admitted.device_ids, ["dev-3", "dev-2"], "the kubelet used the preference");
    assert_eq!(admitted.response.envs.get("WIDGETS").map(String::as_str), Some("dev-3,dev-2"));
    let second = kubelet.admit(RESOURCE, 2).await?;
    assert_eq!(second.device_ids, ["dev-1", "dev-0"]);
    let err = kubelet.admit(RESOURCE, 1).await.expect_err("nothing left");
    assert!(matches!(err, AdmitError::NotEnough { available: 0, .. }), "{err}");

    // An init container's devices are allocated again for the next container: accepted.
    let again = kubelet.allocate_raw(RESOURCE, vec![vec!["dev-3".into(), "dev-2".into()]]).await?;
    assert_eq!(again.container_responses.len(), 1);
    assert_eq!(backend.granted().len(), 3);
    plugin.stop().await;
    Ok(())
}

#[tokio::test]
async fn kubelet_restart_is_followed_by_registration_within_a_second() -> anyhow::Result<()> {
    let tmp = tempfile::tempdir()?;
    let mut kubelet = FakeKubelet::start(tmp.path()).await?;
    let backend = TestBackend::new(RESOURCE, 2);
    let mut plugin = start_plugin(tmp.path(), backend);
    kubelet.wait_registered(RESOURCE, 1).await?;
    let socket = plugin.socket.clone();
    assert!(socket.exists());

    let restarted = Instant::now();
    kubelet.restart().await?;
    kubelet.wait_registered(RESOURCE, 2).await?;
    let took = restarted.elapsed();
    assert!(took < Duration::from_secs(1), "re-registration took {took:?}");
    assert!(socket.exists(), "the plugin re-created its socket");
    plugin
        .wait_state("second registration", |s| *s == PluginState::Registered { registrations: 2 })
        .await;
    let admitted = kubelet.admit(RESOURCE, 1).await?;
    assert_eq!(admitted.device_ids, ["dev-1"]);

    // A kubelet that dies leaves a stale kubelet.sock; when it comes back it replaces it.
    kubelet.stop().await;
    assert!(tmp.path().join("kubelet.sock").exists(), "stale socket left behind");
    let restarted = Instant::now();
    kubelet.restart().await?;
    kubelet.wait_registered(RESOURCE, 3).await?;
    let took = restarted.elapsed();
    assert!(took < Duration::from_secs(1), "re-registration took {took:?}");
    let admitted = kubelet.admit(RESOURCE, 1).await?;
    assert_eq!(admitted.device_ids, ["dev-0"]);
    plugin.stop().await;
    Ok(())
}

#[tokio::test]
async fn kubelet_absent_at_start_then_appearing() -> anyhow::Result<()> {
    let tmp = tempfile::tempdir()?;
    let dir = tmp.path().join("not-yet");
    let mut kubelet = FakeKubelet::absent(&dir);
    let mut plugin = start_plugin(&dir, TestBackend::new(RESOURCE, 1));
    let waiting = plugin
        .wait_state("waiting for the kubelet", |s| {
            matches!(s, PluginState::WaitingForKubelet { .. })
        })
        .await;
    let PluginState::WaitingForKubelet { last_error, .. } = waiting else { unreachable!() };
    assert!(last_error.contains("does not exist"), "{last_error}");

    kubelet.restart().await?; // the kubelet's first start
    kubelet.wait_registered(RESOURCE, 1).await?;
    let admitted = kubelet.admit(RESOURCE, 1).await?;
    assert_eq!(admitted.device_ids, ["dev-0"]);
    plugin.stop().await;
    Ok(())
}

#[tokio::test]
async fn unknown_or_malformed_ids_are_invalid_argument_and_serving_goes_on() -> anyhow::Result<()> {
    let tmp = tempfile::tempdir()?;
    let kubelet = FakeKubelet::start(tmp.path()).await?;
    let backend = TestBackend::new(RESOURCE, 3);
    let plugin = start_plugin(tmp.path(), backend.clone());
    kubelet.wait_for("devices", WAIT, |v| v.devices_of(RESOURCE).len() == 3).await?;

    let cases: [(Vec<&str>, &str); 4] = [
        (vec!["dev-0", "GPU-nope", "dev-9"], "unknown device IDs [\"GPU-nope\", \"dev-9\"]"),
        (vec![""], "malformed"),
        (vec!["dev 1"], "\"dev 1\""),
        (vec!["dev-1", "dev-1"], "repeated"),
    ];
    for (ids, expected) in cases {
        let ids: Vec<String> = ids.into_iter().map(str::to_owned).collect();
        let err = kubelet.allocate_raw(RESOURCE, vec![ids.clone()]).await.expect_err("refused");
        let AdmitError::Rpc(status) = err else { panic!("expected a gRPC error, got {err}") };
        assert_eq!(status.code(), Code::InvalidArgument, "{ids:?}: {status:?}");
        assert!(status.message().starts_with(RESOURCE), "{}", status.message());
        assert!(status.message().contains(expected), "{ids:?}: {}", status.message());
    }
    let err = kubelet.allocate_raw(RESOURCE, vec![vec![]]).await.expect_err("empty request");
    assert!(matches!(&err, AdmitError::Rpc(s) if s.code() == Code::InvalidArgument), "{err}");

    // A conflict in the backend is FailedPrecondition, naming the device.
    backend.block("dev-2");
    let err =
        kubelet.allocate_raw(RESOURCE, vec![vec!["dev-2".into()]]).await.expect_err("conflict");
    let AdmitError::Rpc(status) = err else { panic!("expected a gRPC error, got {err}") };
    assert_eq!(status.code(), Code::FailedPrecondition);
    assert!(status.message().contains("dev-2") && status.message().contains("another resource"));

    // Still serving.
    let ok = kubelet.allocate_raw(RESOURCE, vec![vec!["dev-0".into()]]).await?;
    assert_eq!(ok.container_responses[0].envs["WIDGETS"], "dev-0");
    assert_eq!(backend.granted().len(), 1, "refused requests granted nothing");
    plugin.stop().await;
    Ok(())
}

#[tokio::test]
async fn a_bad_resource_name_is_refused_by_the_kubelet() -> anyhow::Result<()> {
    let tmp = tempfile::tempdir()?;
    let kubelet = FakeKubelet::start(tmp.path()).await?;
    let mut plugin = start_plugin(tmp.path(), TestBackend::new("kubernetes.io/widget", 1));
    let view = kubelet.wait_for("a refusal", WAIT, |v| !v.refusals.is_empty()).await?;
    assert_eq!(
        view.refusals[0],
        (
            "kubernetes.io/widget".to_owned(),
            "the ResourceName \"kubernetes.io/widget\" is invalid".to_owned()
        )
    );
    assert!(view.registrations.is_empty());
    let refused = plugin.wait_state("refused", |s| matches!(s, PluginState::Refused { .. })).await;
    let PluginState::Refused { reason, .. } = refused else { unreachable!() };
    assert!(reason.contains("is invalid"), "{reason}");
    plugin.stop().await;
    Ok(())
}

#[tokio::test]
async fn several_resources_each_on_their_own_socket() -> anyhow::Result<()> {
    let tmp = tempfile::tempdir()?;
    let kubelet = FakeKubelet::start(tmp.path()).await?;
    let a = start_plugin(tmp.path(), TestBackend::new("example.com/a", 2));
    let b = start_plugin(tmp.path(), TestBackend::new("example.com/b", 3));
    assert_ne!(a.socket, b.socket);
    kubelet.wait_registered("example.com/a", 1).await?;
    let view = kubelet.wait_registered("example.com/b", 1).await?;
    assert_eq!(view.streaming.len(), 2);
    let view = kubelet
        .wait_for("both lists", WAIT, |v| {
            v.devices_of("example.com/a").len() == 2 && v.devices_of("example.com/b").len() == 3
        })
        .await?;
    assert_eq!(view.devices.len(), 2);
    a.stop().await;
    b.stop().await;
    Ok(())
}

#[tokio::test]
async fn the_fake_kubelet_refuses_an_unsupported_version_like_the_kubelet() -> anyhow::Result<()> {
    use baleen_proto::deviceplugin::v1beta1 as api;
    let tmp = tempfile::tempdir()?;
    let kubelet = FakeKubelet::start(tmp.path()).await?;
    let channel =
        baleen_device_plugin::uds::connect(&tmp.path().join("kubelet.sock"), WAIT).await?;
    let mut client = api::registration_client::RegistrationClient::new(channel);
    let refused = tokio::time::timeout(
        WAIT,
        client.register(api::RegisterRequest {
            version: "v1alpha".into(),
            endpoint: "x.sock".into(),
            resource_name: RESOURCE.into(),
            options: None,
        }),
    )
    .await?
    .expect_err("refused");
    assert_eq!(refused.code(), Code::Unknown);
    assert!(refused.message().contains("\"v1alpha\" is not supported by kubelet"), "{refused:?}");
    // A good version but nothing serving on the endpoint: the dial-back fails, so does Register.
    let refused = tokio::time::timeout(
        WAIT,
        client.register(api::RegisterRequest {
            version: api::VERSION.into(),
            endpoint: "nobody.sock".into(),
            resource_name: RESOURCE.into(),
            options: None,
        }),
    )
    .await?
    .expect_err("no plugin to dial");
    assert!(refused.message().contains("failed to dial device plugin"), "{refused:?}");
    assert_eq!(kubelet.view().refusals.len(), 2);
    assert!(kubelet.view().registrations.is_empty());
    Ok(())
}

/// Issue 11, also found: shutdown is not held up by a kubelet that accepts the connection but
/// never answers Register (it used to wait for the whole register timeout).
#[tokio::test]
async fn shutdown_does_not_wait_for_a_kubelet_stuck_in_register() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let listener = tokio::net::UnixListener::bind(dir.path().join("kubelet.sock"))?;
    let backend = TestBackend::new(RESOURCE, 2);
    let running = start_plugin(dir.path(), backend);
    // The plugin dials; the "kubelet" takes the connection and says nothing.
    let (stuck, _) = tokio::time::timeout(WAIT, listener.accept()).await??;
    let started = Instant::now();
    running.stop().await;
    assert!(started.elapsed() < Duration::from_secs(5), "stopped in {:?}", started.elapsed());
    drop(stuck);
    Ok(())
}
