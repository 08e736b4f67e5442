//! The co-location subsystem: from the node's pods as the Kubernetes API says (the agent's one
//! watcher restricted to `spec.nodeName`, shared with the memory watchdog), applies the class policy to their cgroups
//! (`crate::isolation::colocation`) whenever they change and every `resync`, and gives the
//! device plugins the pod identifier that sets MPS client priorities
//! (`crate::isolation::pod_identity`).
//!
//! What it must put back (each file's value before the policy wrote it) is kept in
//! `<state dir>/colocation.json`, written before any value is: a restarted agent goes on from
//! it, and an agent started with co-location off (or with another cgroup root) puts everything
//! back and deletes it. Stopping the agent leaves the values in place (the pods keep their
//! classes across an agent restart). Co-location never stops the agent: a state it cannot read
//! or save stops co-location alone, with an error in the log; the devices are served as ever.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::{AgentError, Tasks};
use crate::defaults;
use crate::error_chain::Chain;
use crate::isolation::cgroups::{Driver, Layout};
use crate::isolation::colocation::{Class, ClassPolicy, Colocation, NodePod, Report};
use crate::isolation::node_pods::NodePods;
use crate::isolation::pod_identity::PodIdentifier;
use crate::kube_api::NodeApi;
use crate::resources::NodeResources;
use crate::retry::{Backoff, sleep_or_stop};

/// The co-location settings (`colocation:` in the file).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ColocationConfig {
    /// Apply the classes at all.
    pub enabled: bool,
    /// The host's cgroup tree.
    pub cgroup_root: PathBuf,
    /// The kubelet's cgroup driver.
    pub cgroup_driver: Driver,
    /// The classes' CPU and memory policy.
    pub policy: ClassPolicy,
    /// Give MPS clients the priority of their pod's class.
    pub mps_priority: bool,
    /// How long an Allocate waits for the pod it is for to appear.
    pub identify_wait: Duration,
    /// Time between reconciliations when no pod changes.
    pub resync: Duration,
}

impl Default for ColocationConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            cgroup_root: PathBuf::from(defaults::CGROUP_ROOT),
            cgroup_driver: Driver::Systemd,
            policy: ClassPolicy::default(),
            mps_priority: true,
            identify_wait: defaults::IDENTIFY_WAIT,
            resync: defaults::COLOCATION_RESYNC,
        }
    }
}

/// Why co-location cannot start.
#[derive(Debug, thiserror::Error)]
pub enum ColocationError {
    /// The cgroup root is not a cgroup tree.
    #[error(
        "colocation.cgroupRoot: {0}; mount the host's cgroup tree there, or set colocation.enabled: false"
    )]
    Tree(#[source] crate::isolation::cgroups::CgroupError),
    /// The saved state cannot be read or written.
    #[error("cannot {action} the co-location state {}", path.display())]
    State {
        /// `read`, `write` or `remove`.
        action: &'static str,
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
}

fn state_path(state_dir: &Path) -> PathBuf {
    state_dir.join(defaults::COLOCATION_STATE_FILE)
}

/// What co-location must put back, from `path`; empty when there is no file.
fn load(path: &Path) -> Result<Colocation, ColocationError> {
    use crate::checkpoint::MAX_STATE_FILE_BYTES;
    use crate::files::{Links, read_bounded};
    let bytes = match read_bounded(path, MAX_STATE_FILE_BYTES, Links::Refuse) {
        Ok(Some(b)) => b,
        Ok(None) => return Ok(Colocation::default()),
        Err(source) => {
            return Err(ColocationError::State { action: "read", path: path.into(), source });
        }
    };
    serde_json::from_slice(&bytes).map_err(|e| ColocationError::State {
        action: "read",
        path: path.into(),
        source: std::io::Error::other(e),
    })
}

fn save(path: &Path, state: &Colocation) -> Result<(), ColocationError> {
    let io = |source| ColocationError::State { action: "write", path: path.into(), source };
    if state.is_empty() {
        return match std::fs::remove_file(path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(io(e)),
            Err(_) => Ok(()),
            // The removal itself made durable, as a write is.
            Ok(()) => path
                .parent()
                .map_or(Ok(()), |d| std::fs::File::open(d).and_then(|d| d.sync_all()))
                .map_err(io),
        };
    }
    let bytes = serde_json::to_vec(state).map_err(|e| io(std::io::Error::other(e)))?;
    crate::checkpoint::write_atomically(path, &bytes).map_err(io)
}

/// Starts co-location when it is on (the policy, a task, over the node pods' view it is given),
/// or puts back what an earlier run with it on changed when it is off. Whether it runs.
pub fn start(
    tasks: &mut Tasks,
    config: &ColocationConfig,
    state_dir: &Path,
    resources: &Arc<NodeResources>,
    (api, pods): (Option<Arc<dyn NodeApi>>, Option<watch::Receiver<NodePods>>),
    node: &str,
    shutdown: &CancellationToken,
) -> Result<bool, AgentError> {
    // 0 until the policy runs (and again if it stops).
    up(resources, false);
    let path = state_path(state_dir);
    let mut state = match load(&path) {
        Ok(state) => state,
        Err(e) => {
            // Without it the agent cannot know what to put back: co-location stays off (the
            // devices are served as ever) until the file is mended or removed.
            tracing::error!(
                error = %Chain(&e),
                "co-location does not run: its saved state cannot be read; delete the file to start afresh (the values it recorded then stay in the pods' cgroups until they end)"
            );
            return Ok(false);
        }
    };
    let moved = state.root().is_some_and(|r| r != config.cgroup_root);
    if !state.is_empty() && (!config.enabled || moved) {
        // Switched off, or moved to another cgroup root: every value it wrote goes back first.
        let pods = state.pods().len();
        let outcome = state.restore_all();
        if let Err(e) = save(&path, &state) {
            tracing::error!(error = %Chain(&e), "co-location does not run: its state cannot be saved");
            return Ok(false);
        }
        match outcome {
            Ok(()) => tracing::info!(
                pods,
                "co-location is off or its cgroup root changed: the values it wrote are put back"
            ),
            Err(e) => {
                tracing::error!(
                    error = e,
                    "co-location does not run: values it wrote cannot be put back (is the cgroup root it used still mounted?); trying again at the next start"
                );
                return Ok(false);
            }
        }
    }
    if !config.enabled {
        return Ok(false);
    }
    let (Some(api), Some(pods)) = (api, pods) else {
        return Err(AgentError::NoNodeApi { what: "colocation.enabled" });
    };
    let layout =
        Layout::detect(&config.cgroup_root, config.cgroup_driver).map_err(ColocationError::Tree)?;
    if config.mps_priority && resources.mps_enforced() {
        resources.set_pod_identifier(Arc::new(PodIdentifier::new(
            pods.clone(),
            config.policy,
            config.identify_wait,
        )));
    }
    up(resources, true);
    let run = Reconciler {
        resources: resources.clone(),
        api,
        node: node.to_owned(),
        layout,
        policy: config.policy,
        resync: config.resync,
        path,
        state,
    };
    tasks.spawn("co-location", run.run(pods, shutdown.clone()));
    Ok(true)
}

/// Sets `baleen_colocation_up`, where the metrics are on.
fn up(resources: &NodeResources, running: bool) {
    if let Some(i) = resources.instruments() {
        i.colocation_up.with_label_values::<&str>(&[]).set(i64::from(running));
    }
}

struct Reconciler {
    resources: Arc<NodeResources>,
    api: Arc<dyn NodeApi>,
    node: String,
    layout: Layout,
    policy: ClassPolicy,
    resync: Duration,
    path: PathBuf,
    state: Colocation,
}

impl Reconciler {
    async fn run(
        mut self,
        mut pods: watch::Receiver<NodePods>,
        shutdown: CancellationToken,
    ) -> Result<(), AgentError> {
        let mut allocatable: Option<u64> = None;
        let mut last_read = tokio::time::Instant::now();
        let mut retry = Backoff::new(defaults::API_RETRY);
        loop {
            // The node's allocatable CPU: read first, then again at each resync.
            if allocatable.is_none() || last_read.elapsed() >= self.resync {
                match self.api.allocatable_cpu_milli(&self.node).await {
                    Ok(cpu) => {
                        allocatable = Some(cpu);
                        last_read = tokio::time::Instant::now();
                        retry.reset();
                    }
                    Err(e) if allocatable.is_none() => {
                        tracing::warn!(node = self.node, error = %Chain(&e), "cannot read the node's allocatable CPU; co-location waits for it");
                        if !sleep_or_stop(retry.next_wait(), &shutdown).await {
                            return Ok(());
                        }
                        continue;
                    }
                    Err(e) => {
                        tracing::warn!(node = self.node, error = %Chain(&e), "cannot read the node's allocatable CPU; keeping the last value");
                        last_read = tokio::time::Instant::now();
                    }
                }
            }
            let view = pods.borrow_and_update().clone();
            if view.ready()
                && let Some(cpu) = allocatable
                && let Err(e) = self.reconcile(&view, cpu).await
            {
                // What to put back cannot be kept: stop writing (the devices are served as
                // ever); the values written so far stay recorded in the last saved state.
                tracing::error!(error = %Chain(&e), "co-location stops: its state cannot be saved; restart the agent once the state directory is writable");
                up(&self.resources, false);
                return Ok(());
            }
            tokio::select! {
                () = shutdown.cancelled() => return Ok(()),
                changed = pods.changed() => if changed.is_err() { return Ok(()) },
                () = tokio::time::sleep(self.resync) => {}
            }
        }
    }

    /// One reconciliation, off the async workers (file writes and fsync).
    async fn reconcile(&mut self, view: &NodePods, allocatable: u64) -> Result<(), AgentError> {
        let pods: Vec<NodePod> = view.pods.values().map(|p| p.as_node_pod(view)).collect();
        let (layout, policy, path) = (self.layout.clone(), self.policy, self.path.clone());
        let mut state = std::mem::take(&mut self.state);
        let (state, outcome) = tokio::task::spawn_blocking(move || {
            let outcome = state.reconcile(&layout, &pods, allocatable, &policy, |s| save(&path, s));
            (state, outcome)
        })
        .await
        .map_err(|source| AgentError::Task { task: "co-location", source })?;
        self.state = state;
        let report = outcome?;
        log(&report);
        if let Some(i) = self.resources.instruments() {
            for class in [Class::Inference, Class::Training] {
                let pods = i64::try_from(self.state.count(class)).unwrap_or(i64::MAX);
                i.colocation_pods.with_label_values(&[class.name()]).set(pods);
            }
            let failed = u64::try_from(report.failed.len()).unwrap_or(u64::MAX);
            i.colocation_failures.with_label_values::<&str>(&[]).inc_by(failed);
        }
        Ok(())
    }
}

fn log(report: &Report) {
    if !report.applied.is_empty() || !report.restored.is_empty() {
        tracing::info!(applied = ?report.applied, restored = ?report.restored, "co-location classes applied");
    }
    for (uid, why) in &report.failed {
        tracing::warn!(
            pod = uid,
            error = why,
            "cannot apply the co-location class to a pod; trying again at the next resync"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 22, item 2: the co-location state is read as the checkpoint is: a FIFO or a link
    /// there is refused, saying what it is, never read (a FIFO would block the agent).
    #[test]
    fn a_fifo_or_a_link_at_the_state_path_is_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = state_path(dir.path());
        let made = std::process::Command::new("mkfifo").arg(&path).status();
        assert!(made.expect("mkfifo (coreutils)").success());
        let err = load(&path).expect_err("a FIFO");
        assert!(crate::error_chain::Chain(&err).to_string().contains("is a FIFO"), "{err}");
        std::fs::remove_file(&path).expect("rm");
        std::os::unix::fs::symlink("/dev/zero", &path).expect("symlink");
        let err = load(&path).expect_err("a link");
        assert!(crate::error_chain::Chain(&err).to_string().contains("symbolic link"), "{err}");
        std::fs::remove_file(&path).expect("rm");
        assert!(load(&path).expect("absent").is_empty());
    }
}
