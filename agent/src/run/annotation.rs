//! The node-state publisher: writes the node's gpu-state document (docs/gpu-state.md) as the
//! annotation `<domain>/gpu-state` on the agent's own Node, for the scheduler extender. Written
//! once the ledger is restored and after every change, coalesced (at most one write per
//! `annotation.minInterval`; the last state is always written), retried with backoff while the
//! API server cannot be reached. It runs beside the plugins and never blocks an Allocate: it
//! reads a snapshot of the ledger and writes outside its lock.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use baleen_k8s::gpu_state::NodeGpuState;

use crate::defaults;
use crate::error_chain::Chain;
use crate::isolation::node_pods::NodePods;
use crate::kube_api::NodeApi;
use crate::resources::NodeResources;
use crate::retry::{Backoff, Outage, sleep_or_stop};

/// The annotation's settings (`annotation:` in the file).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AnnotationConfig {
    /// Publish at all.
    pub enabled: bool,
    /// The annotation's key, `<domain>/gpu-state`.
    pub key: String,
    /// The least time between two writes.
    pub min_interval: Duration,
    /// The node is served as a DRA driver (the document says so: `dra`); set by [`start`]
    /// from the agent's driver.
    pub dra: bool,
}

impl Default for AnnotationConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            key: format!("{}/{}", defaults::DOMAIN, defaults::ANNOTATION_NAME),
            min_interval: defaults::ANNOTATION_MIN_INTERVAL,
            dra: false,
        }
    }
}

/// Starts the publisher where `annotation.enabled` (it needs the API: an error without one);
/// `pods`, the node's pods as the API says, gives the UIDs of the pods the document names.
pub fn start(
    tasks: &mut super::Tasks,
    config: &super::AgentConfig,
    api: Option<&Arc<dyn NodeApi>>,
    pods: Option<&tokio::sync::watch::Receiver<NodePods>>,
    resources: &Arc<NodeResources>,
    shutdown: &CancellationToken,
) -> Result<(), super::AgentError> {
    if !config.annotation.enabled {
        return Ok(());
    }
    let api = api.cloned().ok_or(super::AgentError::NoNodeApi { what: "annotation.enabled" })?;
    let annotation = super::annotation::AnnotationConfig {
        dra: matches!(config.driver, crate::dra::DriverMode::Dra(_)),
        ..config.annotation.clone()
    };
    let publish = run(
        api,
        resources.clone(),
        pods.cloned(),
        config.node_name.clone(),
        annotation,
        shutdown.clone(),
    );
    tasks.spawn("node-state publisher", async move {
        publish.await;
        Ok(())
    });
    Ok(())
}

/// `state` with the UID of each pod its GPUs name, where the node's pod view holds exactly one
/// pod of that name (two pods of one name, one of them going, are left to the reader's match by
/// name; so is a pod the view does not hold yet).
pub fn with_uids(mut state: NodeGpuState, pods: &NodePods) -> NodeGpuState {
    let named: std::collections::BTreeSet<&str> =
        state.gpus.iter().flat_map(|g| g.pods.iter().map(String::as_str)).collect();
    let mut uids: std::collections::BTreeMap<String, Option<String>> = Default::default();
    for pod in pods.pods.values() {
        let key = pod.key();
        if named.contains(key.as_str()) {
            uids.entry(key)
                .and_modify(|seen| *seen = None)
                .or_insert_with(|| Some(pod.uid.clone()));
        }
    }
    state.pod_uids = uids.into_iter().filter_map(|(key, uid)| Some((key, uid?))).collect();
    state
}

/// Publishes until `shutdown`.
pub async fn run(
    api: Arc<dyn NodeApi>,
    resources: Arc<NodeResources>,
    mut pods: Option<tokio::sync::watch::Receiver<NodePods>>,
    node: String,
    config: AnnotationConfig,
    shutdown: CancellationToken,
) {
    let mut changes = resources.watch_state();
    let mut written: Option<String> = None;
    let mut retry = Backoff::new(defaults::API_RETRY);
    let mut outage = Outage::default();
    loop {
        changes.borrow_and_update();
        let mut state = resources.node_state();
        state.dra = config.dra;
        let state = match &mut pods {
            Some(pods) => with_uids(state, &pods.borrow_and_update()),
            None => state,
        };
        let text = state.to_json();
        if written.as_deref() != Some(text.as_str()) {
            match api.annotate(&node, &config.key, &text).await {
                Ok(()) => {
                    if outage.succeeded() {
                        tracing::info!(node, annotation = config.key, "node state written again");
                    }
                    retry.reset();
                    written = Some(text);
                }
                Err(e) => {
                    // A write that failed on our side may still have reached the API server:
                    // whatever it holds now, the next state is written.
                    written = None;
                    if outage.failed() {
                        tracing::warn!(
                            node,
                            annotation = config.key,
                            error = %Chain(&e),
                            "cannot write the node state; retrying with backoff (the scheduler extender sees an older state meanwhile)"
                        );
                    }
                    if !sleep_or_stop(retry.next_wait(), &shutdown).await {
                        return;
                    }
                    continue;
                }
            }
        }
        let at = Instant::now();
        let pods_changed = async {
            match &mut pods {
                // A pod's UID becoming known is written too (an unchanged text is not).
                Some(pods) => {
                    if pods.changed().await.is_err() {
                        std::future::pending::<()>().await;
                    }
                }
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            () = shutdown.cancelled() => return,
            changed = changes.changed() => if changed.is_err() { return },
            () = pods_changed => {}
            // Written again now and then, even unchanged: an annotation someone removed or
            // overwrote comes back.
            () = tokio::time::sleep(defaults::ANNOTATION_REFRESH) => written = None,
        }
        // Coalesce: changes during the interval are written together, as the state at its end.
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = tokio::time::sleep_until(at + config.min_interval) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicBool, Ordering};

    use tokio::sync::watch;

    use super::*;
    use crate::checkpoint::Checkpoint;
    use crate::isolation::watchdog::Notice;
    use crate::kube_api::ApiError;
    use crate::ledger::{DeviceLedger, ViewConfig};
    use crate::resources::test_support;

    /// An API server that records each annotation asked, when (on the runtime's clock), and
    /// whether it was written; it refuses while `down`.
    #[derive(Default)]
    struct Recording {
        asked: Mutex<Vec<(Instant, String, bool)>>,
        down: AtomicBool,
    }

    #[async_trait::async_trait]
    impl NodeApi for Recording {
        async fn annotate(&self, _node: &str, _key: &str, value: &str) -> Result<(), ApiError> {
            let down = self.down.load(Ordering::SeqCst);
            self.asked.lock().expect("asked").push((Instant::now(), value.to_owned(), !down));
            if down { Err(ApiError::Call("the API server is away".into())) } else { Ok(()) }
        }
        async fn allocatable_cpu_milli(&self, _node: &str) -> Result<u64, ApiError> {
            Err(ApiError::Call("not asked by the publisher".into()))
        }
        async fn follow_pods(
            &self,
            _node: &str,
            _view: watch::Sender<NodePods>,
            shutdown: CancellationToken,
        ) {
            shutdown.cancelled().await;
        }
        async fn follow_namespaces(
            &self,
            _view: watch::Sender<NodePods>,
            shutdown: CancellationToken,
        ) {
            shutdown.cancelled().await;
        }
        async fn record_event(&self, _node: &str, _notice: &Notice) -> Result<(), ApiError> {
            Ok(())
        }
    }

    /// Issue 23, step 6, in paused time: the first state is written at once; three changes
    /// within the minimum interval are one write at its end, holding all three; an unchanged
    /// state is written again after 300 s; while the API server refuses, the write is retried
    /// after 0.5, 1, 2 and 4 s, and the state at the end is what is written.
    #[tokio::test(start_paused = true)]
    async fn writes_are_coalesced_refreshed_every_300_s_and_retried_with_backoff() {
        let inventory = test_support::l4_inventory();
        let ledger = DeviceLedger::new("n", &inventory, ViewConfig::default()).expect("ledger");
        let dir = tempfile::tempdir().expect("tempdir");
        let resources = test_support::resources(ledger, Checkpoint::in_dir(dir.path()));
        let api = Arc::new(Recording::default());
        let config = AnnotationConfig { enabled: true, ..AnnotationConfig::default() };
        let stop = CancellationToken::new();
        let start = Instant::now();
        let publisher = tokio::spawn(run(
            api.clone(),
            resources.clone(),
            None,
            "n".into(),
            config,
            stop.clone(),
        ));
        let gpu = |i: usize| inventory.gpus[i].uuid.to_string();
        let at = |s: f64| start + Duration::from_secs_f64(s);
        for (i, t) in [(0, 0.1), (1, 0.2), (2, 0.3)] {
            tokio::time::sleep_until(at(t)).await;
            test_support::grant_whole(&resources, &gpu(i));
        }
        let three_held = resources.node_state().to_json();
        tokio::time::sleep_until(at(400.0)).await;
        api.down.store(true, Ordering::SeqCst);
        test_support::grant_whole(&resources, &gpu(3));
        let four_held = resources.node_state().to_json();
        tokio::time::sleep_until(at(405.0)).await;
        api.down.store(false, Ordering::SeqCst);
        tokio::time::sleep_until(at(420.0)).await;
        stop.cancel();
        publisher.await.expect("the publisher ends");

        let asked = api.asked.lock().expect("asked").clone();
        // When each was asked, to the millisecond (the timer's resolution), and whether written.
        let when: Vec<(u128, bool)> =
            asked.iter().map(|(t, _, ok)| ((*t - start).as_millis(), *ok)).collect();
        assert_eq!(
            when,
            [
                (0, true),
                (1000, true),
                (301_000, true),
                (400_000, false),
                (400_500, false),
                (401_500, false),
                (403_500, false),
                (407_500, true)
            ]
        );
        let texts: Vec<&str> = asked.iter().map(|(_, text, _)| text.as_str()).collect();
        assert_ne!(texts[0], three_held);
        assert_eq!(texts[1], three_held, "one write holds the three changes");
        assert_eq!(texts[2], three_held, "the refresh writes the same state again");
        assert!(texts[3..].iter().all(|t| *t == four_held), "the state after the fourth");
    }

    /// Issue 25, item 5: the document carries the UID of each pod it names, where the node's
    /// pod view holds exactly one pod of that name.
    #[test]
    fn the_document_names_its_pods_by_uid_where_one_pod_has_the_name() {
        let inventory = test_support::l4_inventory();
        let ledger = DeviceLedger::new("n", &inventory, ViewConfig::default()).expect("ledger");
        let mut state = ledger.node_state("n", 1, |_| None);
        state.gpus[0].pods = vec!["ns/a".into(), "ns/twice".into()];
        state.gpus[1].pods = vec!["ns/unseen".into()];
        let pod = |name: &str, uid: &str| {
            let pod: k8s_openapi::api::core::v1::Pod = serde_json::from_value(serde_json::json!({
                "metadata": {"name": name, "namespace": "ns", "uid": uid},
                "spec": {"nodeName": "n", "containers": [{"name": "c"}]}
            }))
            .expect("pod");
            crate::isolation::node_pods::PodInfo::of(&pod).expect("info")
        };
        let mut view = NodePods::default();
        for (name, uid) in [("a", "u-a"), ("twice", "u-old"), ("twice", "u-new"), ("other", "u-o")]
        {
            let info = pod(name, uid);
            view.pods.insert(uid.to_owned(), info);
        }
        let state = with_uids(state, &view);
        let expected: std::collections::BTreeMap<String, String> =
            [("ns/a".to_owned(), "u-a".to_owned())].into();
        assert_eq!(state.pod_uids, expected, "one UID per name known once; none guessed");
        let back = NodeGpuState::parse(&state.to_json()).expect("reads back");
        assert!(back.names_pod("ns/a", "u-a") && !back.names_pod("ns/a", "u-recreated"));
        assert!(back.names_pod("ns/twice", "anything"), "no UID: matched by name, as before");
    }
}
