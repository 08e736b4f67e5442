//! The device-plugin adapter: the device ledger served as one extended resource per view.
//! [`NodeResources`] holds the [`DeviceLedger`] behind a mutex, persists it to the checkpoint
//! after every change and publishes each view's device list on a `watch` channel; one
//! [`ViewBackend`] per view implements the device-plugin trait; [`container_response`] turns a
//! [`Grant`] into the kubelet's Allocate answer with the isolation module's help. The only module
//! of the agent that speaks device-plugin types.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use baleen_device_plugin::device::DeviceSnapshot;
use baleen_device_plugin::{
    BackendError, ContainerAllocation, Device, DeviceBackend, DeviceList, Health, Mount,
    PreferredAllocationRequest,
};
use tokio::sync::watch;

use crate::checkpoint::Checkpoint;
use crate::error_chain::Chain;
use crate::instruments::Instruments;
use crate::inventory::GpuUuid;
use crate::isolation::devices::{DeviceAnswer, DeviceListConfig, DeviceLister};
use crate::isolation::pod_identity::{self, PodIdentifier};
use crate::isolation::watchdog::Holding;
use crate::isolation::{ContainerSetup, mps};
use crate::ledger::{
    AllocationRecord, ClaimBooking, Delta, DeviceLedger, DeviceState, Fragmentation, GpuState,
    Grant, Refusal, View,
};
use crate::reconcile::{self, KubeletAllocation, Report};

/// Seconds on the boot-time clock (`CLOCK_BOOTTIME`: monotonic, counting suspend, reset at a
/// reboot), the clock of every grant's `allocated_at`: an NTP step of the wall clock cannot
/// shorten the grace of an allocation the kubelet has not listed yet. A checkpoint of another boot
/// is never trusted, so its times are never compared with this boot's.
pub fn boot_seconds() -> u64 {
    nix::time::clock_gettime(nix::time::ClockId::CLOCK_BOOTTIME)
        .map_or(0, |t| u64::try_from(t.tv_sec()).unwrap_or(0))
}
/// How Allocate answers are written beyond what the ledger grants.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ResponseConfig {
    /// How a container is given its GPUs (CDI names, volume-mounts, or the variable).
    pub devices: DeviceListConfig,
    /// Where each GPU's MPS daemon keeps its pipe directory.
    pub mps: mps::MpsConfig,
}

/// The variable naming a gpu-memory container's devices (informational).
pub const DEVICES_VARIABLE: &str = "BALEEN_DEVICE_IDS";

/// The kubelet's Allocate answer for one container's grant: its GPUs as `answer` gives them (CDI
/// names by default, see [`DeviceLister::answer`]) and, for a gpu-memory share, the MPS client
/// setup, with the client `priority` of its co-location class when given (and MPS runs).
pub fn container_response(
    grant: &Grant,
    answer: DeviceAnswer,
    mps_config: &mps::MpsConfig,
    priority: Option<u8>,
) -> ContainerAllocation {
    let mut a = ContainerAllocation::default();
    a.envs.extend(answer.envs);
    a.cdi_devices = answer.cdi_devices;
    let mut mounts = answer.mounts;
    if let Some(share) = &grant.share {
        // The grant's devices, for the workload's own information: nothing the agent decides
        // reads it back (the watchdog attributes processes by their cgroup).
        a.envs.insert(DEVICES_VARIABLE.into(), grant.device_ids.join(","));
        let ContainerSetup { envs, mounts: mps_mounts } = mps::client_setup(mps_config, share);
        a.envs.extend(envs);
        if let Some(p) = priority.filter(|_| mps_config.enabled) {
            a.envs.insert(pod_identity::PRIORITY_VARIABLE.into(), p.to_string());
        }
        mounts.extend(mps_mounts);
    }
    a.mounts.extend(mounts.into_iter().map(|m| Mount {
        container_path: m.container.display().to_string(),
        host_path: m.host.display().to_string(),
        read_only: m.read_only,
    }));
    a
}

/// Refuses a request that names a device twice, in one container or in two: the ledger can
/// record each device for one container only, so answering both would leave one of them using a
/// device the ledger counts as free.
fn refuse_overlaps(containers: &[Vec<String>]) -> Result<(), BackendError> {
    let mut seen: BTreeMap<&str, usize> = BTreeMap::new();
    for (i, ids) in containers.iter().enumerate() {
        for id in ids {
            if let Some(first) = seen.insert(id, i) {
                let id = baleen_device_plugin::backend::cut(
                    id,
                    baleen_device_plugin::backend::MAX_SHOWN_ID,
                );
                let reason = if first == i {
                    format!("device {id} is named twice for one container")
                } else {
                    format!("device {id} is asked for by containers {first} and {i} of one request")
                };
                return Err(BackendError::InvalidRequest { ids: ids.clone(), reason });
            }
        }
    }
    Ok(())
}

impl From<Refusal> for BackendError {
    fn from(refusal: Refusal) -> Self {
        match refusal {
            Refusal::UnknownDevices { ids } => BackendError::UnknownDevices { ids },
            Refusal::InvalidRequest { ids, reason } => BackendError::InvalidRequest { ids, reason },
            Refusal::Conflict { ids, reason } => BackendError::Conflict { ids, reason },
            Refusal::Exhausted { reason } => BackendError::Exhausted { reason },
        }
    }
}

fn device_list(devices: Vec<DeviceState>) -> Vec<Device> {
    devices
        .into_iter()
        .map(|d| Device {
            id: d.id,
            health: if d.healthy { Health::Healthy } else { Health::Unhealthy },
            numa_node: d.numa_node,
        })
        .collect()
}

/// What a change was, for the ledger's trust and generation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Trust {
    /// Nothing that matters to either (a list too old to apply).
    Unchanged,
    /// An Allocate granted: a new generation even when no record changed (an exact repeat in
    /// the same second), so that a list asked before it is not applied after it.
    Granted,
    /// A reconciliation with the kubelet's list: makes the ledger trusted.
    Reconciled,
}

/// Counts the changes of the allocations: a pod-resources list applies only to the generation
/// it was asked at (see [`NodeResources::reconcile`]), and the node-state document carries it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Generation(u64);

impl Generation {
    /// The generation after this one.
    #[must_use]
    pub fn next(self) -> Self {
        Self(self.0.wrapping_add(1))
    }

    /// Its number.
    pub fn get(self) -> u64 {
        self.0
    }
}

impl std::fmt::Display for Generation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

/// Why a change of the ledger was not made, or not made durable. A change that fails leaves
/// the ledger as it was, except [`ChangeError::NotDurable`]: the change is in the ledger (its
/// devices stay held, never handed out twice) but was never answered.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ChangeError {
    /// The ledger refused it.
    #[error(transparent)]
    Refused(#[from] Refusal),
    /// A share on these GPUs cannot be enforced now: their MPS daemon does not answer.
    #[error(
        "the MPS daemon of GPU {} does not answer, so no memory limit on it can be enforced now",
        gpus.join(", ")
    )]
    Unenforced {
        /// The GPUs.
        gpus: Vec<String>,
    },
    /// The checkpoint could not be written: the change is not durable.
    #[error("the checkpoint cannot be written: {reason}")]
    NotDurable {
        /// Why the write failed.
        reason: String,
    },
}

impl From<ChangeError> for BackendError {
    fn from(e: ChangeError) -> Self {
        match e {
            ChangeError::Refused(r) => r.into(),
            e @ ChangeError::Unenforced { .. } => {
                BackendError::Unavailable { reason: e.to_string() }
            }
            ChangeError::NotDurable { reason } => BackendError::Internal { reason },
        }
    }
}

/// The writer's state, behind `NodeResources::inner`: taken by every change for the time it
/// takes to apply it to a clone of the ledger (cheap, see [`DeviceLedger`]), never while the
/// checkpoint is written.
struct Inner {
    /// The ledger as last changed (also the published one).
    state: Arc<DeviceLedger>,
    /// Whether the ledger may be written to the checkpoint: it was restored from a trusted
    /// checkpoint, or reconciled with the kubelet since. An untrusted ledger (after a reboot, a
    /// corrupt or foreign checkpoint) that has not been reconciled knows nothing of the running
    /// containers; writing it would make the next start trust an empty ledger.
    trusted: bool,
    generation: Generation,
    /// The kubelet's last list applied: who holds which devices (for the metrics' pod labels).
    listed: Arc<Vec<KubeletAllocation>>,
    /// Why each unhealthy GPU is (for the metrics).
    unhealthy: Arc<BTreeMap<String, String>>,
    /// MPS client processes per GPU at the last probe (for the metrics).
    mps_clients: Arc<BTreeMap<String, usize>>,
    /// The MPS server PIDs each GPU's daemon named at its last answered probe (the watchdog
    /// leaves them alone).
    mps_servers: Arc<BTreeMap<String, Vec<u32>>>,
    /// Changes applied to `state` that must reach the checkpoint, numbered; see [`Commits`].
    staged: Vec<(u64, Delta)>,
    /// The number of the last change staged (the journal's sequence).
    sequence: u64,
    /// The next write must be a whole snapshot: the ledger was just trusted.
    compact: bool,
    /// Per view, the availability its device list was last published with.
    shown: BTreeMap<View, Vec<bool>>,
}

/// The ledger and what goes with it at one moment, published after every change: every reader
/// (GetPreferredAllocation, `/metrics`, the node-state document, the watchdog) reads one of
/// these without waiting on a change or a checkpoint write, and never mixes two states.
#[derive(Debug, Clone)]
pub struct Published {
    /// The ledger.
    pub state: Arc<DeviceLedger>,
    /// Its generation.
    pub generation: Generation,
    /// The kubelet's last list applied.
    pub listed: Arc<Vec<KubeletAllocation>>,
    /// Why each unhealthy GPU is.
    pub unhealthy: Arc<BTreeMap<String, String>>,
    /// MPS clients per GPU at the last probe.
    pub mps_clients: Arc<BTreeMap<String, usize>>,
    /// The MPS servers' PIDs per GPU.
    pub mps_servers: Arc<BTreeMap<String, Vec<u32>>>,
}

/// The group commit of the checkpoint: a change is applied to the ledger under its lock (fast)
/// and numbered; then one thread at a time (the one holding `NodeResources::store`) appends
/// every change staged so far to the journal and syncs it, outside the ledger's lock, while
/// the others wait for their number to be on disk. Under concurrency one write covers many
/// changes. A change is answered only once its number is durable; a write that fails fails
/// every change it was to cover (their grants stay held in the ledger, never answered:
/// released once the reconciliation's grace for grants the kubelet never lists has passed;
/// never handed out twice), and the next write rewrites the snapshot whole.
#[derive(Debug, Default)]
struct Commits {
    /// The last change number on disk.
    durable: u64,
    /// The last change number a failed write was to cover, and why it failed.
    failed: (u64, String),
}

/// The writer's end of the checkpoint, held by the one thread writing.
#[derive(Debug, Default)]
struct Store {
    /// The journal being appended to; `None` until the first write, and after a failed one:
    /// the next write is then a compaction.
    journal: Option<crate::checkpoint::JournalWriter>,
}

/// The node's device ledger shared by every view, persisted on every change.
pub struct NodeResources {
    inner: Mutex<Inner>,
    /// The last state published (see [`Published`]): readers load it without a lock, so a
    /// reader that is descheduled (the metrics render runs at idle priority) never holds up a
    /// change.
    published: arc_swap::ArcSwap<Published>,
    checkpoint: Checkpoint,
    node: String,
    boot_id: String,
    /// Where the agent's own measurements go, once the metrics are set up (with the node label).
    instruments: std::sync::OnceLock<Arc<Instruments>>,
    views: BTreeMap<View, (String, watch::Sender<DeviceSnapshot>)>,
    /// Counts changes of what the node-state document says (allocations, health, shares
    /// offered, the pods holding grants); the publisher follows it.
    state_changes: watch::Sender<u64>,
    pod_resources: Option<PathBuf>,
    responses: ResponseConfig,
    /// Writes the device part of every answer (with the node's CDI specs).
    devices: DeviceLister,
    /// Grants answered since the agent started, for telling whether a pod-resources list can
    /// judge them (see [`Answers`]). Taken inside `inner`'s lock, never the other way round.
    answers: Mutex<Answers>,
    /// Finds the pod of an Allocate for its MPS client priority, once co-location runs.
    identifier: std::sync::OnceLock<Arc<PodIdentifier>>,
    /// The group commit's state (taken alone, or inside `store`: never with `inner` held).
    commits: Mutex<Commits>,
    /// The checkpoint's writer: whoever holds it writes (taken before `inner`, never inside it).
    store: Mutex<Store>,
}

impl NodeResources {
    /// Wraps `state`; every change is written to `checkpoint` for `node` in boot `boot_id`.
    /// `pod_resources` is the kubelet's pod-resources socket, asked before an Allocate replaces
    /// an older allocation of the same resource (`None`: trust the kubelet without asking).
    /// Allocate answers are written with `responses`. `restored`: the sequence of the trusted
    /// checkpoint `state` was restored from; if `None`, nothing is written until the first
    /// reconciliation.
    pub fn new(
        mut state: DeviceLedger,
        checkpoint: Checkpoint,
        node: String,
        boot_id: String,
        pod_resources: Option<PathBuf>,
        responses: ResponseConfig,
        restored: Option<u64>,
    ) -> Arc<Self> {
        state.forget_changes();
        let domain = state.config().domain.clone();
        let mut shown = BTreeMap::new();
        let views = state
            .views()
            .into_iter()
            .map(|v| {
                let (tx, _) =
                    watch::channel(Arc::new(DeviceList::new(device_list(state.devices(&v)))));
                shown.insert(v.clone(), state.availability(&v));
                let name = v.resource_name(&domain);
                (v, (name, tx))
            })
            .collect();
        let inner = Inner {
            state: Arc::new(state),
            trusted: restored.is_some(),
            generation: Generation::default(),
            listed: Arc::default(),
            unhealthy: Arc::default(),
            mps_clients: Arc::default(),
            mps_servers: Arc::default(),
            staged: Vec::new(),
            sequence: restored.unwrap_or(0),
            compact: true,
            shown,
        };
        let published = arc_swap::ArcSwap::from_pointee(published_of(&inner));
        Arc::new(Self {
            inner: Mutex::new(inner),
            published,
            checkpoint,
            node,
            boot_id,
            views,
            state_changes: watch::channel(0).0,
            pod_resources,
            devices: DeviceLister::new(responses.devices.clone()),
            responses,
            instruments: std::sync::OnceLock::new(),
            identifier: std::sync::OnceLock::new(),
            answers: Mutex::new(Answers::default()),
            commits: Mutex::new(Commits::default()),
            store: Mutex::new(Store::default()),
        })
    }

    /// The node's device isolation as far as the agent can tell (see
    /// [`crate::isolation::devices::posture`]), for every name an answer may use: each GPU's UUID
    /// and each MIG instance's. Reads the CDI specs and the toolkit's configuration again; logs
    /// every check (WARN for one that fails or cannot be told) and sets
    /// `baleen_device_isolation` where the metrics are on.
    pub fn report_device_posture(&self) -> Vec<crate::isolation::devices::Check> {
        use crate::isolation::devices::CheckState;
        let visible: Vec<String> = self
            .published()
            .state
            .gpus()
            .flat_map(|g| {
                std::iter::once(g.uuid.to_string())
                    .chain(g.mig.instances().iter().map(|m| m.uuid.to_string()))
            })
            .collect();
        let checks = self.devices.posture(&visible);
        let strategy = self.devices.config().strategy.name();
        for c in &checks {
            match c.state {
                CheckState::Ok => {
                    tracing::info!(
                        check = c.name,
                        strategy,
                        detail = c.detail,
                        "device isolation: ok"
                    );
                }
                CheckState::Failed => tracing::warn!(
                    check = c.name,
                    strategy,
                    detail = c.detail,
                    "device isolation: FAILED: a container may reach GPUs it was not granted, or a grant may not reach its GPUs"
                ),
                CheckState::Unknown => tracing::warn!(
                    check = c.name,
                    strategy,
                    detail = c.detail,
                    "device isolation: cannot tell"
                ),
            }
        }
        if let Some(i) = self.instruments.get() {
            for c in &checks {
                for state in [CheckState::Ok, CheckState::Failed, CheckState::Unknown] {
                    i.device_isolation
                        .with_label_values(&[strategy, c.name, state.name()])
                        .set(i64::from(c.state == state));
                }
            }
        }
        checks
    }

    /// Whether gpu-memory shares are enforced by MPS (not accounting only).
    pub fn mps_enforced(&self) -> bool {
        self.responses.mps.enabled
    }

    /// The agent's own measurements, once the metrics are set up.
    pub fn instruments(&self) -> Option<&Arc<Instruments>> {
        self.instruments.get()
    }

    /// The finder of a pod's co-location class, once co-location runs.
    pub fn pod_identifier(&self) -> Option<&Arc<PodIdentifier>> {
        self.identifier.get()
    }

    /// Gives MPS clients the priority of their pod's class from now on (co-location).
    pub fn set_pod_identifier(&self, identifier: Arc<PodIdentifier>) {
        let _ = self.identifier.set(identifier);
    }

    /// How many containers of each pod (`namespace/name`) the kubelet's last pod-resources list
    /// shows holding `resource`, by their number of devices.
    fn listed_holders(&self, resource: &str) -> BTreeMap<(String, u64), usize> {
        let mut holders = BTreeMap::new();
        for k in self.published().listed.iter().filter(|k| k.resource == resource) {
            let count = u64::try_from(k.device_ids.len()).unwrap_or(u64::MAX);
            *holders.entry((format!("{}/{}", k.namespace, k.pod), count)).or_default() += 1;
        }
        holders
    }

    /// Records the agent's own measurements in `instruments` from now on.
    pub fn instrument(&self, instruments: Arc<Instruments>) {
        let _ = self.instruments.set(instruments);
    }

    /// Counts a reconciliation that could not ask the kubelet.
    pub fn count_unreachable(&self) {
        if let Some(i) = self.instruments.get() {
            i.reconciliations.with_label_values(&["unreachable"]).inc();
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn answers_lock(&self) -> MutexGuard<'_, Answers> {
        self.answers.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn commits_lock(&self) -> MutexGuard<'_, Commits> {
        self.commits.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The state published last: what every reader reads.
    pub fn published(&self) -> Arc<Published> {
        self.published.load_full()
    }

    /// Publishes `inner` as it is now (see [`Published`]).
    fn publish(&self, inner: &Inner) {
        let next = Arc::new(published_of(inner));
        self.published.store(next);
    }

    /// One backend per view.
    pub fn backends(self: &Arc<Self>) -> Vec<Arc<ViewBackend>> {
        self.views
            .iter()
            .map(|(view, (name, _))| {
                Arc::new(ViewBackend {
                    resources: self.clone(),
                    view: view.clone(),
                    resource: name.clone(),
                })
            })
            .collect()
    }

    /// Every GPU's state, and per resource its devices and healthy devices, now.
    pub fn snapshot(&self) -> (Vec<GpuState>, Vec<(String, usize, usize)>) {
        self.snapshot_of(&self.published().state)
    }

    fn snapshot_of(&self, state: &DeviceLedger) -> (Vec<GpuState>, Vec<(String, usize, usize)>) {
        let views = self
            .views
            .iter()
            .map(|(view, (name, _))| {
                let (devices, healthy) = state.device_counts(view);
                (name.clone(), devices, healthy)
            })
            .collect();
        (state.gpu_states(), views)
    }

    /// Everything a `/metrics` scrape shows of the ledger, from one published state: one
    /// scrape never mixes two states of the ledger, and never holds up a change.
    pub fn scrape_view(&self) -> ScrapeView {
        let published = self.published();
        let (gpus, views) = self.snapshot_of(&published.state);
        ScrapeView {
            gpus,
            views,
            reasons: (*published.unhealthy).clone(),
            clients: (*published.mps_clients).clone(),
            records: published.state.records(),
            fragmentation: published.state.fragmentation(),
            grants: grants_of(&published),
        }
    }

    /// Per allocation and GPU, the bytes granted, with the container the kubelet's last list
    /// names for it (`None` for one it has not listed: an init container, or one just granted).
    pub fn grants(&self) -> Vec<GrantShown> {
        grants_of(&self.published())
    }

    /// What the memory watchdog attributes GPU processes with: each listed container's grants
    /// per GPU (with the bytes of a gpu-memory share as its limit), the `(resource, GPU)` of
    /// grants the kubelet has not listed (an ordinary init container's, or one just granted),
    /// and the MPS servers' PIDs.
    pub fn watchdog_view(&self) -> (Vec<Holding>, Vec<(String, GpuUuid)>, BTreeSet<u32>) {
        let shares: BTreeSet<&str> = self
            .views
            .iter()
            .filter(|(v, _)| matches!(v, View::GpuMemory))
            .map(|(_, (name, _))| name.as_str())
            .collect();
        let published = self.published();
        let mut holdings = Vec::new();
        let mut unlisted = Vec::new();
        for (record, gpu, bytes, holder) in grants_of(&published) {
            let Ok(gpu) = GpuUuid::new(&gpu) else { continue };
            match holder {
                Some(k) => holdings.push(Holding {
                    holder: (k.namespace, k.pod, k.container),
                    limit_bytes: shares.contains(record.resource.as_str()).then_some(bytes),
                    resource: record.resource,
                    device_ids: record.device_ids,
                    gpu,
                }),
                None => unlisted.push((record.resource, gpu)),
            }
        }
        let servers = published.mps_servers.values().flatten().copied().collect();
        (holdings, unlisted, servers)
    }

    /// The current allocations.
    pub fn records(&self) -> Vec<AllocationRecord> {
        self.published().state.records()
    }

    /// Follows changes of the node-state document (see [`Self::node_state`]).
    pub fn watch_state(&self) -> watch::Receiver<u64> {
        self.state_changes.subscribe()
    }

    /// The node-state document now: the ledger, with the pods the kubelet's last list names.
    pub fn node_state(&self) -> baleen_k8s::gpu_state::NodeGpuState {
        let published = self.published();
        let holders = listed_by_key(&published.listed);
        let holder = |r: &AllocationRecord| {
            holders
                .get(&(r.resource.as_str(), r.device_ids.as_slice()))
                .map(|k| format!("{}/{}", k.namespace, k.pod))
        };
        published.state.node_state(&self.node, published.generation.get(), holder)
    }

    fn state_changed(&self) {
        self.state_changes.send_modify(|n| *n = n.wrapping_add(1));
    }

    /// Sends the device list of every view whose availability changed (a GPU taken whole or
    /// freed, a first unit taken or the last freed, health, enforcement): a grant that changes
    /// no device's health costs no list.
    fn publish_devices(&self, inner: &mut Inner) {
        for (view, (_, tx)) in &self.views {
            let availability = inner.state.availability(view);
            if inner.shown.get(view) == Some(&availability) {
                continue;
            }
            let devices = device_list(inner.state.devices(view));
            tx.send_if_modified(|current| {
                if current.devices() == devices.as_slice() {
                    false
                } else {
                    *current = Arc::new(DeviceList::new(devices));
                    true
                }
            });
            inner.shown.insert(view.clone(), availability);
        }
    }

    /// Changes what is not an allocation (health, enforcement) on the ledger, and the reasons
    /// of unhealthy GPUs, and publishes both at once (a reader never sees a GPU unhealthy
    /// without its reason); `change` says whether the ledger changed, which is returned.
    fn change_devices(
        &self,
        change: impl FnOnce(&mut DeviceLedger, &mut BTreeMap<String, String>) -> bool,
    ) -> bool {
        let mut inner = self.lock();
        let mut next = DeviceLedger::clone(&inner.state);
        let mut reasons = (*inner.unhealthy).clone();
        let changed = change(&mut next, &mut reasons);
        let noted = reasons != *inner.unhealthy;
        if changed {
            inner.state = Arc::new(next);
        }
        if noted {
            inner.unhealthy = Arc::new(reasons);
        }
        // Published before anyone is told: a kubelet shown a device list, or the node-state
        // publisher woken, reads this state or a later one, never the one before it.
        if changed || noted {
            self.publish(&inner);
        }
        if changed {
            self.publish_devices(&mut inner);
            self.state_changed();
        }
        changed
    }

    /// Applies `change` (given the ledger and the generation it applies to) to a clone of the
    /// ledger and publishes it, then returns once the checkpoint holds it (the group commit,
    /// [`Commits`]); a change that fails leaves the ledger as it was. While the ledger is
    /// untrusted nothing is written (see `Inner::trusted`); an applied reconciliation makes it
    /// trusted, and its first write is a whole snapshot.
    fn change<T>(
        &self,
        change: impl FnOnce(&mut DeviceLedger, Generation) -> Result<(T, Trust), ChangeError>,
    ) -> Result<T, ChangeError> {
        let mut inner = self.lock();
        let mut next = DeviceLedger::clone(&inner.state);
        let (out, trust) = change(&mut next, inner.generation)?;
        let delta = next.changes_since(&inner.state);
        let was_trusted = inner.trusted;
        inner.trusted = was_trusted || trust == Trust::Reconciled;
        let changed = !delta.is_empty();
        // Kept even when no record changed: the ledger also counts missed listings.
        inner.state = Arc::new(next);
        let tell = changed || trust == Trust::Granted;
        if tell {
            inner.generation = inner.generation.next();
        }
        // Published before anyone is told (see `change_devices`).
        self.publish(&inner);
        if tell {
            self.state_changed();
        }
        if changed {
            self.publish_devices(&mut inner);
        }
        // Written: a change of a trusted ledger, and the first reconciliation that trusts it.
        let durable = inner.trusted && (changed || !was_trusted);
        if !durable {
            return Ok(out);
        }
        if !was_trusted {
            inner.compact = true;
        }
        inner.sequence += 1;
        let number = inner.sequence;
        inner.staged.push((number, delta));
        drop(inner);
        self.until_durable(number)?;
        Ok(out)
    }

    /// Returns once change `number` is on disk (writing the checkpoint itself when no other
    /// thread is), or with the error of the write that was to cover it.
    fn until_durable(&self, number: u64) -> Result<(), ChangeError> {
        let settled = |c: &Commits| {
            if c.durable >= number {
                Some(Ok(()))
            } else if c.failed.0 >= number {
                Some(Err(ChangeError::NotDurable { reason: c.failed.1.clone() }))
            } else {
                None
            }
        };
        loop {
            if let Some(done) = settled(&self.commits_lock()) {
                return done;
            }
            // Become the writer, or wait for the one writing (it may cover this change).
            let mut store = self.store.lock().unwrap_or_else(PoisonError::into_inner);
            if let Some(done) = settled(&self.commits_lock()) {
                return done;
            }
            self.write(&mut store);
        }
    }

    /// Writes every change staged so far: appended to the journal, or, when the journal has
    /// outgrown the snapshot (or none is open), the ledger as it is now as a new snapshot.
    fn write(&self, store: &mut Store) {
        let (covers, staged, snapshot) = {
            let mut inner = self.lock();
            let compact = std::mem::take(&mut inner.compact)
                || store.journal.as_ref().is_none_or(|j| j.wants_compaction());
            let staged = std::mem::take(&mut inner.staged);
            (inner.sequence, staged, compact.then(|| inner.state.clone()))
        };
        let started = std::time::Instant::now();
        let written = match (snapshot, store.journal.as_mut()) {
            (None, Some(journal)) => journal.append(&staged),
            (snapshot, _) => {
                let state = snapshot.unwrap_or_else(|| self.lock().state.clone());
                self.checkpoint
                    .compact(&self.node, &self.boot_id, &state.layout(), &state.records(), covers)
                    .map(|journal| store.journal = Some(journal))
            }
        };
        if let Some(i) = self.instruments.get() {
            i.checkpoint_write_seconds.observe(started.elapsed().as_secs_f64());
        }
        let mut c = self.commits_lock();
        match written {
            Ok(()) => c.durable = c.durable.max(covers),
            Err(e) => {
                let why = Chain(&e).to_string();
                tracing::error!(
                    error = why,
                    "the checkpoint cannot be written: the changes it was to hold are refused"
                );
                c.failed = (covers, why);
                // The journal's end is unknown now: the next write starts afresh.
                store.journal = None;
            }
        }
    }

    /// The current generation of the allocations: read it before asking pod-resources, and
    /// pass it to [`Self::reconcile`].
    pub fn generation(&self) -> Generation {
        self.published().generation
    }

    /// Writes the checkpoint now, whole (a snapshot with an empty journal), through the same
    /// writer as every change. Nothing is written while the ledger is untrusted (never
    /// reconciled since an untrusted start); returns whether it was written.
    pub fn persist(&self) -> Result<bool, crate::checkpoint::CheckpointError> {
        let mut store = self.store.lock().unwrap_or_else(PoisonError::into_inner);
        let (covers, state) = {
            let mut inner = self.lock();
            if !inner.trusted {
                return Ok(false);
            }
            inner.staged.clear();
            inner.compact = false;
            (inner.sequence, inner.state.clone())
        };
        store.journal = None;
        let journal = self.checkpoint.compact(
            &self.node,
            &self.boot_id,
            &state.layout(),
            &state.records(),
            covers,
        )?;
        store.journal = Some(journal);
        let mut c = self.commits_lock();
        c.durable = c.durable.max(covers);
        Ok(true)
    }

    /// Whether the ledger is trusted: restored from a trusted checkpoint or reconciled since.
    pub fn is_trusted(&self) -> bool {
        self.lock().trusted
    }

    /// Reconciles with the kubelet's allocations, asked when the allocations were at generation
    /// `asked_at` (see [`reconcile::reconcile`]). A list asked before the latest change may
    /// predate it (an Allocate answered while the list was on its way: restoring an ended pod's
    /// devices over a new grant, or marking a fresh init container's grant as listed), so it is
    /// not applied: `Ok(None)`, and the caller asks again.
    pub fn reconcile(
        &self,
        allocations: &[KubeletAllocation],
        grace_secs: u64,
        asked_at: Generation,
        witness: &reconcile::Witness,
    ) -> Result<Option<Report>, ChangeError> {
        self.reconcile_at(allocations, grace_secs, asked_at, boot_seconds(), witness)
    }

    /// [`Self::reconcile`] at `now` (seconds on the boot-time clock).
    fn reconcile_at(
        &self,
        allocations: &[KubeletAllocation],
        grace_secs: u64,
        asked_at: Generation,
        now: u64,
        witness: &reconcile::Witness,
    ) -> Result<Option<Report>, ChangeError> {
        let report = self.change(|state, generation| {
            if generation != asked_at {
                return Ok((None, Trust::Unchanged));
            }
            let report = reconcile::reconcile(state, allocations, now, grace_secs, witness);
            Ok((Some(report), Trust::Reconciled))
        })?;
        if report.is_some() {
            let mut inner = self.lock();
            if inner.listed.as_slice() != allocations {
                inner.listed = Arc::new(allocations.to_vec());
                self.publish(&inner);
                self.state_changed();
            }
        }
        if let Some(i) = self.instruments.get() {
            match &report {
                Some(r) => {
                    i.reconciliations.with_label_values(&["applied"]).inc();
                    for (change, n) in [
                        ("released", r.released.len()),
                        ("restored", r.restored.len()),
                        ("refused", r.refused.len()),
                        ("held", r.held.len()),
                    ] {
                        i.reconcile_changes
                            .with_label_values(&[change])
                            .inc_by(u64::try_from(n).unwrap_or(u64::MAX));
                    }
                }
                None => i.reconciliations.with_label_values(&["stale"]).inc(),
            }
        }
        Ok(report)
    }

    /// Marks every GPU healthy or not (saying why when not) and republishes.
    pub fn set_all_health(&self, healthy: bool, reason: &str) {
        let uuids: Vec<String> =
            self.published().state.gpus().map(|g| g.uuid.to_string()).collect();
        for uuid in uuids {
            self.set_health(&uuid, healthy, reason);
        }
    }

    /// Marks whether a GPU's shares are enforced (its MPS daemon answers) and republishes.
    pub fn set_shares_enforced(&self, uuid: &str, enforced: bool) -> bool {
        self.change_devices(|state, _| state.set_shares_enforced(uuid, enforced))
    }

    /// The GPUs whose memory units are offered, by UUID.
    pub fn shared_gpus(&self) -> Vec<String> {
        self.published().state.shared_gpus()
    }

    /// Marks a GPU healthy or not (saying why when not) and republishes.
    pub fn set_health(&self, uuid: &str, healthy: bool, reason: &str) -> bool {
        self.change_devices(|state, reasons| {
            note_reason(reasons, uuid, healthy, reason);
            state.set_health(uuid, healthy)
        })
    }

    /// What DRA claim `uid` holds (`driver: dra`), from the published ledger.
    pub fn claim_grants(&self, uid: &str) -> Vec<(AllocationRecord, Grant)> {
        self.published().state.claim_grants(uid)
    }

    /// Books a DRA claim's devices in one change, on disk before it returns (blocks: call it
    /// off the async threads). A share whose GPU's MPS daemon does not answer is refused; a
    /// claim already held is answered as held. A booking whose write fails is taken back out
    /// of the ledger (it was never answered, and the kubelet asks again), so no later Prepare
    /// answers a booking the checkpoint does not hold.
    pub fn book_claim(
        &self,
        bookings: &[ClaimBooking],
    ) -> Result<Vec<(AllocationRecord, Grant)>, ChangeError> {
        let booked = self.change(|state, _| {
            let held = state.claim_grants(bookings.first().map_or("", |b| b.holder.uid.as_str()));
            if !held.is_empty() {
                return Ok((held, Trust::Unchanged));
            }
            let booked = state.book_claim(bookings, boot_seconds())?;
            for (_, grant) in &booked {
                let gpus = state.unenforced(&grant.view, &grant.device_ids);
                if !gpus.is_empty() {
                    return Err(ChangeError::Unenforced { gpus });
                }
            }
            Ok((booked, Trust::Granted))
        });
        if let Err(ChangeError::NotDurable { .. }) = &booked
            && let Some(b) = bookings.first()
            && let Err(e) = self.release_claim(&b.holder.uid)
        {
            tracing::error!(claim = b.holder.uid, error = %e, "a booking that was not written cannot be taken back durably either");
        }
        booked
    }

    /// Releases DRA claim `uid`, on disk before it returns (blocks); whether it was held.
    pub fn release_claim(&self, uid: &str) -> Result<bool, ChangeError> {
        self.change(|state, _| {
            let released = state.release_claim(uid);
            let trust = if released.is_empty() { Trust::Unchanged } else { Trust::Granted };
            Ok((!released.is_empty(), trust))
        })
    }
}

fn published_of(inner: &Inner) -> Published {
    Published {
        state: inner.state.clone(),
        generation: inner.generation,
        listed: inner.listed.clone(),
        unhealthy: inner.unhealthy.clone(),
        mps_clients: inner.mps_clients.clone(),
        mps_servers: inner.mps_servers.clone(),
    }
}

/// One allocation on one GPU: the record, the GPU, the bytes granted there, and the container
/// the kubelet's last list names for it.
pub type GrantShown = (AllocationRecord, String, u64, Option<KubeletAllocation>);

fn grants_of(published: &Published) -> Vec<GrantShown> {
    let holders = listed_by_key(&published.listed);
    published
        .state
        .granted_bytes()
        .into_iter()
        .map(|(record, gpu, bytes)| {
            let holder = holders
                .get(&(record.resource.as_str(), record.device_ids.as_slice()))
                .map(|k| (*k).clone());
            (record, gpu, bytes, holder)
        })
        .collect()
}

/// The kubelet's last list by `(resource, device IDs)`: one lookup per grant, not a scan.
fn listed_by_key(listed: &[KubeletAllocation]) -> HashMap<(&str, &[String]), &KubeletAllocation> {
    listed.iter().map(|k| ((k.resource.as_str(), k.device_ids.as_slice()), k)).collect()
}

/// What a `/metrics` scrape shows of the ledger, read at one moment ([`NodeResources::scrape_view`]).
#[derive(Debug, Clone)]
pub struct ScrapeView {
    /// Every GPU's state.
    pub gpus: Vec<GpuState>,
    /// Per resource: its devices and healthy devices.
    pub views: Vec<(String, usize, usize)>,
    /// Why each unhealthy GPU is.
    pub reasons: BTreeMap<String, String>,
    /// MPS clients per GPU at the last probe.
    pub clients: BTreeMap<String, usize>,
    /// The allocations.
    pub records: Vec<AllocationRecord>,
    /// The node's fragmentation.
    pub fragmentation: Fragmentation,
    /// Per allocation and GPU, the bytes granted and the container listed for it.
    pub grants: Vec<GrantShown>,
}

/// Keeps why `uuid` is unhealthy (the first reason of an episode), or forgets it when healthy.
fn note_reason(reasons: &mut BTreeMap<String, String>, uuid: &str, healthy: bool, reason: &str) {
    if healthy {
        reasons.remove(uuid);
    } else {
        reasons.entry(uuid.to_owned()).or_insert_with(|| reason.to_owned());
    }
}

impl mps::supervisor::Enforcement for NodeResources {
    fn set_enforced(&self, gpu_uuid: &str, enforced: bool) {
        self.set_shares_enforced(gpu_uuid, enforced);
    }

    fn set_clients(&self, gpu_uuid: &str, clients: usize) {
        let mut inner = self.lock();
        if inner.mps_clients.get(gpu_uuid) != Some(&clients) {
            Arc::make_mut(&mut inner.mps_clients).insert(gpu_uuid.to_owned(), clients);
            self.publish(&inner);
        }
    }

    fn set_servers(&self, gpu_uuid: &str, servers: &[u32]) {
        let mut inner = self.lock();
        if inner.mps_servers.get(gpu_uuid).map(Vec::as_slice) != Some(servers) {
            Arc::make_mut(&mut inner.mps_servers).insert(gpu_uuid.to_owned(), servers.to_vec());
            self.publish(&inner);
        }
    }
}

/// A grant's key: its resource and sorted device IDs.
type RecordKey = (String, Vec<String>);

/// When each grant of this run was answered, in the order of answers. A pod-resources list
/// shows only what the kubelet recorded before it was asked, and the kubelet records a grant
/// only once its Allocate answer came back: a list asked before a grant was answered (or while
/// it is still being answered) cannot say that grant's container ended, so it never lets
/// another Allocate replace it. Grants restored at start have no entry: the kubelet has known
/// them for as long as the agent has run.
#[derive(Debug, Default)]
struct Answers {
    /// The number the next answer gets; read before a list is asked.
    next: u64,
    /// Per grant, the number of its answer; `u64::MAX` while it is being answered.
    by_key: BTreeMap<RecordKey, u64>,
}

impl Answers {
    /// Whether a list asked at `asked` (a value of `next`) can judge the grant `key`.
    fn known_to_list(&self, key: &RecordKey, asked: u64) -> bool {
        self.by_key.get(key).is_none_or(|&answered| answered < asked)
    }

    /// Forgets the grants no longer held, once the map is well past the ledger's size (`held`
    /// allocations; `records` read only then).
    fn prune(&mut self, held: usize, records: impl FnOnce() -> Vec<AllocationRecord>) {
        if self.by_key.len() > 2 * held + 64 {
            let held: BTreeSet<RecordKey> =
                records().into_iter().map(|r| (r.resource, r.device_ids)).collect();
            self.by_key.retain(|k, _| held.contains(k));
        }
    }
}

/// A request past the checks before the ledger's lock.
struct Checked {
    containers: Vec<Vec<String>>,
    /// The earlier allocations checked against the kubelet's list (the grant may replace them).
    replaceable: BTreeSet<RecordKey>,
    /// `Answers::next` before the list was asked.
    asked: u64,
}

/// One view of the ledger, served as one extended resource.
pub struct ViewBackend {
    resources: Arc<NodeResources>,
    view: View,
    resource: String,
}

#[async_trait::async_trait]
impl DeviceBackend for ViewBackend {
    fn resource_name(&self) -> &str {
        &self.resource
    }

    fn devices(&self) -> watch::Receiver<DeviceSnapshot> {
        match self.resources.views.get(&self.view) {
            Some((_, tx)) => tx.subscribe(),
            // Backends are made only for the ledger's views.
            None => watch::channel(Arc::new(DeviceList::default())).1,
        }
    }

    async fn preferred_allocation(
        &self,
        request: PreferredAllocationRequest,
    ) -> Result<Vec<String>, BackendError> {
        let started = std::time::Instant::now();
        // From the published ledger: never waits on a change or a checkpoint write.
        let answer = self
            .resources
            .published()
            .state
            .preferred(&self.view, &request.available, &request.must_include, request.size)
            .map_err(BackendError::from);
        self.measure(|i| &i.preferred_seconds, started, &answer);
        answer
    }

    async fn allocate(
        &self,
        containers: Vec<Vec<String>>,
    ) -> Result<Vec<ContainerAllocation>, BackendError> {
        let started = std::time::Instant::now();
        let answer = self.grant(containers).await;
        self.measure(|i| &i.allocate_seconds, started, &answer);
        answer
    }
}

impl ViewBackend {
    /// Records how long an answer took, and its refusal.
    fn measure<T>(
        &self,
        histogram: impl Fn(&Instruments) -> &prometheus::HistogramVec,
        started: std::time::Instant,
        answer: &Result<T, BackendError>,
    ) {
        if let Some(i) = self.resources.instruments.get() {
            let labels = [self.resource.as_str()];
            histogram(i).with_label_values(&labels).observe(started.elapsed().as_secs_f64());
            if let Err(e) = answer {
                let kind = crate::instruments::refusal_kind(e);
                i.refusals.with_label_values(&[self.resource.as_str(), kind]).inc();
            }
        }
    }

    /// Grants every container of one Allocate request, or none (see `DeviceBackend::allocate`):
    /// checks it, commits the grant, answers. Each step is its own function so that tests can
    /// interleave two requests at every point.
    async fn grant(
        &self,
        containers: Vec<Vec<String>>,
    ) -> Result<Vec<ContainerAllocation>, BackendError> {
        let checked = self.check(containers).await?;
        let grants = self.commit(checked).await?;
        Ok(self.respond(&grants).await)
    }

    /// The checks before the ledger's lock: no device named twice, every share enforced, and the
    /// earlier allocations the request would replace checked against the kubelet's list.
    async fn check(&self, containers: Vec<Vec<String>>) -> Result<Checked, BackendError> {
        refuse_overlaps(&containers)?;
        // Devices of this resource that an older allocation holds, exactly or in part: the
        // kubelet repeats an Allocate only for an init container's devices (which pod-resources
        // does not list) and reassigns only devices whose container ended, but a kubelet that
        // lost its books could hand out devices still in use. Ask its pod-resources list first;
        // if it cannot answer, refuse rather than risk a GPU handed out twice.
        let held: Vec<(usize, Vec<AllocationRecord>)> = {
            let published = self.resources.published();
            // A share nothing enforces is not handed out (the daemon died after the kubelet
            // chose the units).
            for ids in &containers {
                let gpus = published.state.unenforced(&self.view, ids);
                if !gpus.is_empty() {
                    return Err(ChangeError::Unenforced { gpus }.into());
                }
            }
            containers
                .iter()
                .enumerate()
                .map(|(i, ids)| (i, published.state.sharing_devices(&self.view, ids)))
                .filter(|(_, held)| !held.is_empty())
                .collect()
        };
        // Grants answered from here on are not in the list about to be asked.
        let asked = self.resources.answers_lock().next;
        if let (Some((first, _)), Some(socket)) = (held.first(), &self.resources.pod_resources) {
            let listed = reconcile::fetch(socket, Duration::from_secs(2)).await.map_err(|e| {
                BackendError::Unavailable {
                    reason: format!(
                        "devices {:?} are held by an earlier allocation and the kubelet's pod-resources API, which says whether its container still runs, cannot be asked ({}); refused rather than risk handing them out twice",
                        containers[*first],
                        Chain(&e)
                    ),
                }
            })?;
            for (i, held) in &held {
                let running = listed.iter().find(|k| {
                    held.iter().any(|r| r.resource == k.resource && r.device_ids == k.device_ids)
                });
                if let Some(k) = running {
                    return Err(BackendError::Conflict {
                        ids: containers[*i].clone(),
                        reason: format!(
                            "the kubelet still lists devices {:?} for running container {}/{}/{}",
                            k.device_ids, k.namespace, k.pod, k.container
                        ),
                    });
                }
            }
        }
        // What was checked against the kubelet's list: the grant may replace these and only
        // these. An allocation of the same devices granted meanwhile (a second Allocate on
        // another connection, answered while this one asked pod-resources) was never checked:
        // this request is then refused rather than answered beside it.
        let replaceable: BTreeSet<RecordKey> = held
            .iter()
            .flat_map(|(_, records)| records.iter())
            .map(|r| (r.resource.clone(), r.device_ids.clone()))
            .collect();
        Ok(Checked { containers, replaceable, asked })
    }

    /// Grants a checked request in one change of the ledger, refusing it if anything it would
    /// replace was not checked or could not be judged by the list it was checked against.
    async fn commit(&self, checked: Checked) -> Result<Vec<Grant>, BackendError> {
        let Checked { containers, replaceable: checked, asked } = checked;
        // All containers in one change: a refusal of any leaves the ledger as it was. The
        // checkpoint write blocks (fsync): off the async worker threads.
        let resources = self.resources.clone();
        let (view, resource) = (self.view.clone(), self.resource.clone());
        let grants = tokio::task::spawn_blocking(move || {
            resources.change(|state, _| {
                // Again under the lock: the daemon may have died while pod-resources answered.
                for ids in &containers {
                    let gpus = state.unenforced(&view, ids);
                    if !gpus.is_empty() {
                        return Err(ChangeError::Unenforced { gpus });
                    }
                }
                // The check and the grant are one step: nothing granted since the check, and
                // nothing the list could not have shown yet.
                let mut answers = resources.answers_lock();
                for ids in &containers {
                    for r in state.sharing_devices(&view, ids) {
                        let key = (r.resource.clone(), r.device_ids.clone());
                        let why = if !checked.contains(&key) {
                            "were granted to another container while this request was being checked"
                        } else if !answers.known_to_list(&key, asked) {
                            "were granted to a container the kubelet had not been told of when its list was asked"
                        } else {
                            continue;
                        };
                        return Err(Refusal::Conflict {
                            ids: ids.clone(),
                            reason: format!(
                                "devices {:?} {why}; refused rather than handing them out twice",
                                r.device_ids
                            ),
                        }
                        .into());
                    }
                }
                let now = boot_seconds();
                let grants = containers
                    .iter()
                    .map(|ids| state.allocate(&view, ids, now))
                    .collect::<Result<Vec<Grant>, Refusal>>()?;
                answers.prune(state.held_count(), || state.records());
                for g in &grants {
                    answers.by_key.insert((resource.clone(), g.device_ids.clone()), u64::MAX);
                }
                Ok((grants, Trust::Granted))
            })
        })
        .await
        .map_err(|e| BackendError::Internal { reason: format!("allocation task failed: {e}") })??;
        Ok(grants)
    }

    /// The kubelet's answers for `grants`, after which a list asked may show them.
    async fn respond(&self, grants: &[Grant]) -> Vec<ContainerAllocation> {
        // The MPS client priority of the pod's class, when co-location runs: the pod is found
        // after the grant (its identity never decides a device).
        let mut answers = Vec::with_capacity(grants.len());
        let identifier =
            self.resources.identifier.get().filter(|_| self.resources.responses.mps.enabled);
        let listed = match identifier {
            Some(_) if grants.iter().any(|g| g.share.is_some()) => {
                self.resources.listed_holders(&self.resource)
            }
            _ => BTreeMap::new(),
        };
        for g in grants {
            let priority = match (identifier, &g.share) {
                (Some(id), Some(_)) => {
                    let count = u64::try_from(g.device_ids.len()).unwrap_or(u64::MAX);
                    let identity = id.identify(&self.resource, count, &listed).await;
                    if let Some(i) = self.resources.instruments.get() {
                        let labels = [identity.class().name(), identity.how()];
                        i.mps_priorities.with_label_values(&labels).inc();
                    }
                    Some(pod_identity::mps_priority(identity.class()))
                }
                _ => None,
            };
            let devices = self.resources.devices.answer(&g.visible);
            if !devices.fell_back.is_empty()
                && let Some(i) = self.resources.instruments.get()
            {
                i.device_list_fallbacks.with_label_values::<&str>(&[]).inc();
            }
            answers.push(container_response(g, devices, &self.resources.responses.mps, priority));
        }
        // Answered: a list asked from now on may show these grants.
        let mut numbers = self.resources.answers_lock();
        let number = numbers.next;
        numbers.next += 1;
        for g in grants {
            numbers.by_key.insert((self.resource.clone(), g.device_ids.clone()), number);
        }
        answers
    }
}

#[cfg(test)]
pub(crate) mod test_support {
    //! What the unit tests of the adapter and its users build a node from.

    use super::*;
    use crate::inventory::GpuInventory as _;
    use crate::inventory::Inventory;
    use crate::inventory::simulated::SimulatedInventory;

    /// The inventory of `packaging/examples/l4-4x-pcie.yaml`.
    pub(crate) fn l4_inventory() -> Inventory {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../packaging/examples/l4-4x-pcie.yaml");
        SimulatedInventory::from_file(&path).expect("example").discover().expect("discover")
    }

    /// The adapter over `ledger` on node `n` with boot ID `b`, no pod-resources client and the
    /// default answers, as the agent builds it.
    pub(crate) fn resources(ledger: DeviceLedger, checkpoint: Checkpoint) -> Arc<NodeResources> {
        NodeResources::new(
            ledger,
            checkpoint,
            "n".into(),
            "b".into(),
            None,
            ResponseConfig::default(),
            Some(0),
        )
    }

    /// Grants GPU `uuid` whole to a new allocation: a change of the node's state.
    pub(crate) fn grant_whole(resources: &NodeResources, uuid: &str) {
        let ids = [uuid.to_owned()];
        resources
            .change(|state, _| Ok((state.allocate(&View::Gpu, &ids, 7)?, Trust::Granted)))
            .expect("granted");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grants_are_timed_on_the_boot_clock_not_the_wall_clock() {
        // /proc/uptime counts the same clock (seconds since boot, suspend included).
        let uptime: f64 = std::fs::read_to_string("/proc/uptime")
            .expect("/proc/uptime")
            .split_whitespace()
            .next()
            .and_then(|s| s.parse().ok())
            .expect("seconds");
        let now = boot_seconds() as f64;
        assert!((now - uptime).abs() <= 2.0, "boot clock {now} s, uptime {uptime} s");
        let wall = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("after 1970")
            .as_secs() as f64;
        assert!(now < wall / 2.0, "not the wall clock");
    }

    #[test]
    fn every_grant_is_a_new_generation_even_an_identical_repeat() {
        let inventory = test_support::l4_inventory();
        let ledger = DeviceLedger::new("n", &inventory, crate::ledger::ViewConfig::default())
            .expect("ledger");
        let dir = tempfile::tempdir().expect("tempdir");
        let resources = test_support::resources(ledger, Checkpoint::in_dir(dir.path()));
        let gpu = vec![inventory.gpus[0].uuid.to_string()];
        let grant = || {
            resources.change(|state, _| Ok((state.allocate(&View::Gpu, &gpu, 7)?, Trust::Granted)))
        };
        grant().expect("granted");
        let first = resources.generation();
        // The same IDs again in the same second: no record changes, the generation does, so a
        // list asked before this repeat is not applied after it.
        grant().expect("repeat granted");
        assert_eq!(resources.generation(), first.next());
    }

    /// Changes from many threads at once (one write covering many of them): every one is kept,
    /// in the published ledger and on disk.
    #[test]
    fn concurrent_changes_are_all_kept_and_all_on_disk() {
        let inventory = test_support::l4_inventory();
        let ledger = DeviceLedger::new("n", &inventory, crate::ledger::ViewConfig::default())
            .expect("ledger");
        let ids: Vec<String> = ledger.devices(&View::GpuMemory).into_iter().map(|d| d.id).collect();
        let dir = tempfile::tempdir().expect("tempdir");
        let resources = test_support::resources(ledger, Checkpoint::in_dir(dir.path()));
        resources.persist().expect("persist");
        std::thread::scope(|s| {
            for chunk in ids.chunks(12) {
                let resources = &resources;
                s.spawn(move || {
                    for id in chunk {
                        resources
                            .change(|state, _| {
                                let grant = state.allocate(
                                    &View::GpuMemory,
                                    std::slice::from_ref(id),
                                    7,
                                )?;
                                Ok((grant, Trust::Granted))
                            })
                            .expect("granted");
                    }
                });
            }
        });
        assert_eq!(resources.records().len(), ids.len());
        let cp = Checkpoint::in_dir(dir.path()).load("n", "b").expect("load").expect("some");
        assert_eq!(cp.allocations.len(), ids.len());
    }

    /// The gpu-memory backend over a fresh ledger of the L4 node, and the first GPU's UUID.
    fn memory_backend() -> (tempfile::TempDir, Arc<NodeResources>, Arc<ViewBackend>, String) {
        let inventory = test_support::l4_inventory();
        let ledger = DeviceLedger::new("n", &inventory, crate::ledger::ViewConfig::default())
            .expect("ledger");
        let dir = tempfile::tempdir().expect("tempdir");
        let resources = test_support::resources(ledger, Checkpoint::in_dir(dir.path()));
        let backend = resources
            .backends()
            .into_iter()
            .find(|b| b.view == View::GpuMemory)
            .expect("a gpu-memory view");
        (dir, resources, backend, inventory.gpus[0].uuid.to_string())
    }

    fn units(gpu: &str, range: std::ops::Range<u32>) -> Vec<String> {
        range.map(|n| format!("{gpu}::{n}")).collect()
    }

    #[tokio::test]
    async fn a_request_naming_a_device_twice_is_refused_and_nothing_granted() {
        let (_dir, resources, backend, gpu) = memory_backend();
        // Containers [u0, u1] and [u1, u2]: answering both would leave u0 in use and free.
        let overlapping = vec![units(&gpu, 0..2), units(&gpu, 1..3)];
        let err = backend.allocate(overlapping).await.expect_err("overlap refused");
        assert!(
            matches!(&err, BackendError::InvalidRequest { reason, .. } if reason.contains("containers 0 and 1")),
            "{err:?}"
        );
        let twice = vec![vec![format!("{gpu}::0"), format!("{gpu}::0")]];
        let err = backend.allocate(twice).await.expect_err("a unit twice refused");
        assert!(
            matches!(&err, BackendError::InvalidRequest { reason, .. } if reason.contains("twice for one container")),
            "{err:?}"
        );
        assert!(resources.records().is_empty(), "nothing granted: {:?}", resources.records());
        // Disjoint containers in one request are granted, each its own.
        backend.allocate(vec![units(&gpu, 0..2), units(&gpu, 2..4)]).await.expect("granted");
        assert_eq!(resources.records().len(), 2);
    }

    #[tokio::test]
    async fn two_overlapping_allocates_never_both_answer_whatever_the_interleaving() {
        // [u0, u1] and [u1, u2] on two connections: the kubelet never does this, but a ledger
        // that answers both has handed u1 out twice and keeps only one of them.
        let refused = |r: Result<Vec<Grant>, BackendError>| match r {
            Err(BackendError::Conflict { reason, .. }) => reason,
            other => panic!("not refused: {other:?}"),
        };
        // Both checked before either is granted: the second is refused at the grant.
        let (_dir, resources, backend, gpu) = memory_backend();
        let a = backend.check(vec![units(&gpu, 0..2)]).await.expect("checked");
        let b = backend.check(vec![units(&gpu, 1..3)]).await.expect("checked");
        let granted = backend.commit(a).await.expect("granted");
        let why = refused(backend.commit(b).await);
        assert!(why.contains("while this request was being checked"), "{why}");
        backend.respond(&granted).await;
        assert_eq!(resources.records().len(), 1);
        assert_eq!(resources.records()[0].device_ids, units(&gpu, 0..2));
        // The second checked after the first was granted but before it was answered: the
        // kubelet cannot have listed the first yet, so its list cannot say it ended.
        let (_dir, resources, backend, gpu) = memory_backend();
        let a = backend.check(vec![units(&gpu, 0..2)]).await.expect("checked");
        let granted = backend.commit(a).await.expect("granted");
        let b = backend.check(vec![units(&gpu, 1..3)]).await.expect("checked");
        let why = refused(backend.commit(b).await);
        assert!(why.contains("had not been told of"), "{why}");
        backend.respond(&granted).await;
        assert_eq!(resources.records()[0].device_ids, units(&gpu, 0..2));
        // Checked after the first was answered: the list asked then is the kubelet's word that
        // the first container ended (here no list: trusted), and the second replaces it.
        let b = backend.check(vec![units(&gpu, 1..3)]).await.expect("checked");
        backend.commit(b).await.expect("a reassignment the kubelet vouches for");
        assert_eq!(resources.records().len(), 1);
        assert_eq!(resources.records()[0].device_ids, units(&gpu, 1..3));
    }

    mod properties {
        //! Issue 11's promise as a property: under any sequence of admissions, pod ends,
        //! reconciliations with fresh, stale and partial lists, restarts and configuration
        //! changes, no device is held twice, no GPU promised beyond its memory, and nothing a
        //! running container holds is released.

        use std::collections::BTreeSet;

        use proptest::prelude::*;

        use super::super::*;
        use crate::ledger::{ViewConfig, device_id};

        const GRACE: u64 = 600;

        #[derive(Debug, Clone)]
        enum Op {
            /// The kubelet admits a container: `count` units on GPU `gpu`, or (count 0) the GPU whole.
            Admit { gpu: usize, count: u32 },
            /// A running container ends.
            End { pick: usize },
            /// A list as of now.
            Fresh,
            /// A list asked `back` steps ago, answered now.
            Stale { back: usize },
            /// A list as of now that misses one running container which the last list applied
            /// showed: a kubelet answering before it has synced its pods. (A container missing
            /// from two lists in a row has ended, as far as the protocol can tell.)
            Partial { pick: usize },
            /// The agent restarts, with the memory unit halved or not.
            Restart { halve_unit: bool },
        }

        fn op() -> impl Strategy<Value = Op> {
            prop_oneof![
                5 => (0..4usize, 0..6u32).prop_map(|(gpu, count)| Op::Admit { gpu, count }),
                3 => any::<usize>().prop_map(|pick| Op::End { pick }),
                2 => Just(Op::Fresh),
                2 => (1..5usize).prop_map(|back| Op::Stale { back }),
                2 => any::<usize>().prop_map(|pick| Op::Partial { pick }),
                1 => any::<bool>().prop_map(|halve_unit| Op::Restart { halve_unit }),
            ]
        }

        struct Node {
            dir: tempfile::TempDir,
            inventory: crate::inventory::Inventory,
            unit: u64,
            resources: Arc<NodeResources>,
            /// The kubelet's running containers: resource and device IDs.
            running: Vec<(String, Vec<String>)>,
            /// Per running container, the bytes of GPU memory it was promised (units times the unit
            /// at its grant; what its MPS limit says), on which GPU.
            promised: Vec<Option<(String, u64)>>,
            /// Per running container, how many applied lists in a row have missed it (a
            /// partial list omits a running container; two in a row may release it).
            missed: Vec<u32>,
            /// Past lists, with the generation each was asked at.
            asked: Vec<(Generation, Vec<KubeletAllocation>)>,
            clock: u64,
        }

        fn views(unit: u64) -> ViewConfig {
            ViewConfig { memory_unit_bytes: unit, ..ViewConfig::default() }
        }

        impl Node {
            fn new() -> Self {
                let inventory = super::super::test_support::l4_inventory();
                let dir = tempfile::tempdir().expect("tempdir");
                let unit = 1 << 30;
                let ledger = DeviceLedger::new("n", &inventory, views(unit)).expect("ledger");
                let resources =
                    super::super::test_support::resources(ledger, Checkpoint::in_dir(dir.path()));
                resources.persist().expect("written at start, as the agent does");
                Self {
                    dir,
                    inventory,
                    unit,
                    resources,
                    running: vec![],
                    promised: vec![],
                    missed: vec![],
                    asked: vec![],
                    clock: 1000,
                }
            }

            fn list(&self) -> Vec<KubeletAllocation> {
                self.running
                    .iter()
                    .map(|(resource, ids)| KubeletAllocation {
                        namespace: "ns".into(),
                        pod: "p".into(),
                        container: "c".into(),
                        resource: resource.clone(),
                        device_ids: ids.clone(),
                    })
                    .collect()
            }

            /// Applies `list`, asked at generation `asked_at`, through
            /// `NodeResources::reconcile`; the model counts the misses of running containers.
            fn reconcile(&mut self, list: &[KubeletAllocation], asked_at: Generation) {
                let applied = self.resources.reconcile_at(
                    list,
                    GRACE,
                    asked_at,
                    self.clock,
                    &reconcile::Witness::default(),
                );
                if matches!(applied, Ok(Some(_))) {
                    for (running, missed) in self.running.iter().zip(&mut self.missed) {
                        let shown = list
                            .iter()
                            .any(|k| k.resource == running.0 && k.device_ids == running.1);
                        *missed = if shown { 0 } else { *missed + 1 };
                    }
                }
            }

            fn admit(&mut self, gpu: usize, count: u32) {
                let published = self.resources.published();
                let state = &published.state;
                let uuid = state.gpus().nth(gpu).expect("gpu").uuid.to_string();
                let domain = state.config().domain.clone();
                // Like the kubelet: only devices advertised Healthy and not in its own books.
                let taken: BTreeSet<&String> =
                    self.running.iter().flat_map(|(_, ids)| ids).collect();
                let (view, ids) = if count == 0 {
                    let free = state
                        .devices(&View::Gpu)
                        .into_iter()
                        .any(|d| d.id == uuid && d.healthy && !taken.contains(&d.id));
                    (View::Gpu, if free { vec![uuid.clone()] } else { vec![] })
                } else {
                    let ids: Vec<String> = state
                        .devices(&View::GpuMemory)
                        .into_iter()
                        .filter(|d| d.healthy && !taken.contains(&d.id))
                        .filter(|d| device_id::parse_unit_id(&d.id).is_some_and(|(g, _)| g == uuid))
                        .map(|d| d.id)
                        .take(count as usize)
                        .collect();
                    (View::GpuMemory, if ids.len() == count as usize { ids } else { vec![] })
                };
                if ids.is_empty() {
                    return;
                }
                let now = self.clock;
                let granted = self
                    .resources
                    .change(|state, _| Ok((state.allocate(&view, &ids, now)?, Trust::Granted)));
                if granted.is_ok() {
                    let mut ids = ids;
                    ids.sort();
                    let promised = (view == View::GpuMemory)
                        .then(|| (uuid.clone(), u64::from(count) * self.unit));
                    self.running.push((view.resource_name(&domain), ids));
                    self.promised.push(promised);
                    self.missed.push(0);
                }
            }

            /// Restarts from the checkpoint as the agent's start-up does: refused (and the old
            /// agent kept) when a held ID would change meaning.
            fn restart(&mut self, halve_unit: bool) {
                let unit = if halve_unit { self.unit / 2 } else { self.unit };
                let mut ledger =
                    DeviceLedger::new("n", &self.inventory, views(unit)).expect("ledger");
                let checkpoint = Checkpoint::in_dir(self.dir.path());
                let contents =
                    checkpoint.load("n", "b").expect("trusted").expect("written since start");
                if !ledger.meaning_changes(&contents.layout, &contents.allocations).is_empty() {
                    return;
                }
                assert!(
                    ledger.restore(&contents.allocations).is_empty(),
                    "a trusted checkpoint restores"
                );
                self.unit = unit;
                self.resources = super::super::test_support::resources(ledger, checkpoint);
                self.resources.persist().expect("written at start, as the agent does");
                self.asked.clear();
            }

            fn check(&self) -> Result<(), TestCaseError> {
                let records = self.resources.records();
                let mut whole: BTreeSet<String> = BTreeSet::new();
                let mut units: BTreeSet<String> = BTreeSet::new();
                let mut units_per_gpu: std::collections::BTreeMap<String, u64> = Default::default();
                for r in &records {
                    for id in &r.device_ids {
                        if r.resource.ends_with("/gpu") {
                            prop_assert!(whole.insert(id.clone()), "GPU {} held whole twice", id);
                        } else if let Some((gpu, _)) = device_id::parse_unit_id(id) {
                            prop_assert!(units.insert(id.clone()), "unit {} held twice", id);
                            *units_per_gpu.entry(gpu.to_owned()).or_default() += 1;
                        }
                    }
                }
                for (gpu, n) in &units_per_gpu {
                    prop_assert!(!whole.contains(gpu), "GPU {} whole and shared", gpu);
                    let memory = self
                        .inventory
                        .gpus
                        .iter()
                        .find(|g| g.uuid.as_str() == gpu)
                        .map(|g| g.memory_bytes)
                        .unwrap_or(0);
                    prop_assert!(n * self.unit <= memory, "GPU {} promised beyond its memory", gpu);
                }
                let held: BTreeSet<(String, Vec<String>)> =
                    records.iter().map(|r| (r.resource.clone(), r.device_ids.clone())).collect();
                for (running, promised) in self.running.iter().zip(&self.promised) {
                    prop_assert!(held.contains(running), "running {:?} released", running);
                    // The ledger reads its units as the bytes its MPS limit says.
                    if let Some((_, bytes)) = promised {
                        let read_as = running.1.len() as u64 * self.unit;
                        prop_assert_eq!(read_as, *bytes, "{:?} changed meaning", running);
                    }
                }
                // What the running containers were promised (their MPS limits) fits each GPU,
                // whatever unit the ledger reads their IDs with now.
                let mut promised: std::collections::BTreeMap<&str, u64> = Default::default();
                for (gpu, bytes) in self.promised.iter().flatten() {
                    *promised.entry(gpu.as_str()).or_default() += bytes;
                }
                for (gpu, bytes) in promised {
                    let memory = self
                        .inventory
                        .gpus
                        .iter()
                        .find(|g| g.uuid.as_str() == gpu)
                        .map_or(0, |g| g.memory_bytes);
                    prop_assert!(
                        bytes <= memory,
                        "GPU {} promised {} of {} bytes",
                        gpu,
                        bytes,
                        memory
                    );
                }
                Ok(())
            }
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(64))]
            #[test]
            fn no_device_twice_no_bytes_beyond_memory_no_running_container_released(
                ops in proptest::collection::vec(op(), 1..60)
            ) {
                let mut node = Node::new();
                for op in ops {
                    node.clock += 1;
                    let generation = node.resources.generation();
                    node.asked.push((generation, node.list()));
                    match op {
                        Op::Admit { gpu, count } => node.admit(gpu, count),
                        Op::End { pick } => {
                            if !node.running.is_empty() {
                                let i = pick % node.running.len();
                                node.running.remove(i);
                                node.promised.remove(i);
                                node.missed.remove(i);
                            }
                        }
                        Op::Fresh => {
                            let list = node.list();
                            node.reconcile(&list, generation);
                        }
                        Op::Stale { back } => {
                            let at = node.asked.len().saturating_sub(back + 1);
                            let (asked_at, list) = node.asked[at].clone();
                            node.reconcile(&list, asked_at);
                        }
                        Op::Partial { pick } => {
                            let mut list = node.list();
                            let shown: Vec<usize> =
                                (0..list.len()).filter(|&i| node.missed[i] == 0).collect();
                            if !shown.is_empty() {
                                list.remove(shown[pick % shown.len()]);
                            }
                            node.reconcile(&list, generation);
                        }
                        Op::Restart { halve_unit } => node.restart(halve_unit),
                    }
                    node.check()?;
                }
            }
        }
    }
}
