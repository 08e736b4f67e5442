//! The per-container GPU memory watchdog. MPS limits memory per client *process*, and a process
//! can unset or raise its own limit variables, so a container can use more than its grant. Every
//! `watchdog.interval` the watchdog reads each GPU's compute processes and their memory (NVML,
//! through `GpuInventory::processes`) and attributes each by what its container cannot change:
//! its cgroup (`<proc root>/<pid>/cgroup`: the pod UID and the runtime's container ID, cgroup v1
//! and v2; containerd's `cri-containerd-<id>.scope` and plain `<id>`, CRI-O's `crio-<id>`;
//! systemd and cgroupfs drivers) -> the pod and container of that ID in the API's view of the
//! node's pods -> what the kubelet's pod-resources list says that container holds -> the ledger's
//! bytes on that GPU. Nothing in the process's environment is read.
//!
//! - A container over its gpu-memory grant on a GPU (its processes' sum) is logged at WARN once
//!   per episode, published, and announced in a Kubernetes Event on its pod; with
//!   `watchdog.action: kill` (the default) its processes on that GPU get SIGKILL once the episode
//!   has lasted `watchdog.grace` (each PID's cgroup read again first, so a reused PID is spared),
//!   with a second Event naming the container and the PIDs.
//! - A process of a pod's container that holds no grant on that GPU, whose pod the API does not
//!   know, or whose container its pod's status does not name, is a *stray*: once it has been one
//!   for `watchdog.grace` (the API's view and the kubelet's list trail a new container by
//!   moments), it is logged, published, and announced in an Event (on its pod when known, else
//!   on the node). Strays are reported, never killed.
//! - Processes outside every pod's cgroup (host processes) and the MPS servers the daemons name
//!   (`get_server_list`) are left alone. Whole GPUs, MIG slices and NVLink groups have no byte
//!   limit: their processes count as their grant's usage, never as over it.
//!
//! Until the API's view of the node's pods has been listed once, no process is judged. The
//! agent runs it as a subsystem; the current episodes, usage and strays are published for the
//! metrics endpoint, the Events go to the API through a bounded queue (dropped, and counted, when
//! the API cannot keep up).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

use crate::error_chain::Chain;
use crate::inventory::{CallFailures, GpuInventory, GpuProcess, GpuUuid};
use crate::isolation::node_pods::NodePods;

/// What the processes of one grant use on one of its GPUs (every round, for the metrics).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Usage {
    /// The grant's resource.
    pub resource: String,
    /// The grant's device IDs, sorted.
    pub device_ids: Vec<String>,
    /// The GPU.
    pub gpu: GpuUuid,
    /// Bytes its processes use on the GPU together.
    pub used_bytes: u64,
    /// Episodes over the grant so far: since its container's processes appeared on the GPU,
    /// counted again from zero once none of them is left (a counter reset to Prometheus).
    pub over_grant_episodes: u64,
}

/// What the watchdog does about a container over its grant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WatchdogAction {
    /// Log it (WARN, once per episode), publish it and announce it in an Event.
    Log,
    /// Also SIGKILL the container's processes on that GPU once the episode lasted the grace
    /// (default).
    Kill,
}

/// How the watchdog runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WatchdogConfig {
    /// Run it at all (it needs the Kubernetes API's view of the node's pods).
    pub enabled: bool,
    /// Time between two reads.
    pub interval: Duration,
    /// What to do about a container over its grant.
    pub action: WatchdogAction,
    /// How long a container may stay over its grant before it is killed, and how long a
    /// process may be a stray before it is reported.
    pub grace: Duration,
    /// Where the host's `/proc` is (the agent needs the host's PID namespace to read it).
    pub proc_root: PathBuf,
}

impl Default for WatchdogConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            interval: crate::defaults::WATCHDOG_INTERVAL,
            action: WatchdogAction::Kill,
            grace: crate::defaults::WATCHDOG_GRACE,
            proc_root: PathBuf::from(crate::defaults::PROC_ROOT),
        }
    }
}

/// A container, as its processes' cgroup paths name it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ContainerRef {
    /// The pod's UID, when the path names it.
    pub pod_uid: Option<String>,
    /// The container runtime's ID (hex).
    pub container_id: String,
}

/// A pod's container by name: `(namespace, pod, container)`.
pub type ContainerKey = (String, String, String);

/// What one container holds on one GPU, as the kubelet's last pod-resources list and the ledger
/// say.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Holding {
    /// The holder.
    pub holder: ContainerKey,
    /// The grant's resource.
    pub resource: String,
    /// The grant's device IDs, sorted.
    pub device_ids: Vec<String>,
    /// The GPU.
    pub gpu: GpuUuid,
    /// The bytes granted on that GPU when the grant is a share of it (gpu-memory); `None` for a
    /// whole GPU, a MIG slice or an NVLink group (no byte limit to watch).
    pub limit_bytes: Option<u64>,
}

/// What a round attributes processes with.
#[derive(Debug, Clone, Default)]
pub struct Holders {
    /// The API's view of the node's pods.
    pub pods: NodePods,
    /// Every listed container's grants, per GPU.
    pub holdings: Vec<Holding>,
    /// `(resource, GPU)` of the grants the kubelet has not listed (an ordinary init
    /// container's, which its list omits, or one just granted): a process of a container that
    /// asks for that resource is theirs, not a stray, but has no known limit.
    pub unlisted: Vec<(String, GpuUuid)>,
    /// The PIDs of the MPS servers the daemons named at their last probe.
    pub mps_servers: BTreeSet<u32>,
}

/// A container over its grant on one GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Over {
    /// The container, as its processes' cgroup names it.
    pub container: ContainerRef,
    /// The container, by name.
    pub holder: ContainerKey,
    /// The GPU.
    pub gpu: GpuUuid,
    /// Bytes its processes use on the GPU together.
    pub used_bytes: u64,
    /// Bytes granted.
    pub granted_bytes: u64,
    /// Its processes on the GPU.
    pub pids: Vec<u32>,
}

/// Why a process on a GPU belongs to no grant.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum StrayReason {
    /// Its cgroup names a pod the API's view of the node does not hold.
    UnknownPod,
    /// Its pod is known, but no container status of it names the container ID.
    UnknownContainer,
    /// Its container holds nothing on this GPU in the kubelet's list.
    NoGrant,
}

impl StrayReason {
    /// The metric label: `unknown-pod`, `unknown-container` or `no-grant`.
    pub fn label(self) -> &'static str {
        match self {
            StrayReason::UnknownPod => "unknown-pod",
            StrayReason::UnknownContainer => "unknown-container",
            StrayReason::NoGrant => "no-grant",
        }
    }
}

/// A process of a pod on a GPU that belongs to no grant, reported once it has been one for the
/// grace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stray {
    /// The GPU.
    pub gpu: GpuUuid,
    /// The process.
    pub pid: u32,
    /// Bytes it uses on the GPU (0 when NVML does not say).
    pub used_bytes: u64,
    /// Why it is a stray.
    pub reason: StrayReason,
    /// Its container, as its cgroup names it.
    pub container: ContainerRef,
    /// `(namespace, pod name)` when the API's view holds the pod.
    pub pod: Option<(String, String)>,
    /// The container's name when its pod's status names it.
    pub container_name: Option<String>,
}

/// What an Event is about.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Regarding {
    /// A pod of the node.
    Pod {
        /// Its namespace.
        namespace: String,
        /// Its name.
        name: String,
        /// Its UID.
        uid: String,
    },
    /// The node itself (a process whose pod the API does not know).
    Node,
}

/// A Kubernetes Event the watchdog asks for (`events.k8s.io/v1`, type Warning).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Notice {
    /// The object.
    pub regarding: Regarding,
    /// The Event's reason (CamelCase).
    pub reason: &'static str,
    /// What the agent did: `Observed` or `Killed`.
    pub action: &'static str,
    /// The human text.
    pub note: String,
    /// A Warning (else a Normal Event: a recovery).
    pub warning: bool,
}

/// The watchdog's kills and Events so far, for the metrics.
#[derive(Debug, Default)]
pub struct NoticeCounts {
    /// Events queued for the API.
    pub queued: AtomicU64,
    /// Events dropped because the queue was full.
    pub dropped: AtomicU64,
    /// Events the API server refused or did not answer.
    pub failed: AtomicU64,
    /// Processes killed over their container's grant.
    pub kills: AtomicU64,
}

/// What the watchdog publishes, for the metrics endpoint and tests.
#[derive(Debug, Clone)]
pub struct Published {
    /// The containers over their grant at the last round.
    pub over: watch::Receiver<Vec<Over>>,
    /// Each grant's usage at the last round.
    pub usage: watch::Receiver<Vec<Usage>>,
    /// The strays reported at the last round.
    pub strays: watch::Receiver<Vec<Stray>>,
    /// Kills and Events so far.
    pub counts: Arc<NoticeCounts>,
}

impl Published {
    /// Nothing (the watchdog is off).
    pub fn none() -> Self {
        Self {
            over: watch::channel(Vec::new()).1,
            usage: watch::channel(Vec::new()).1,
            strays: watch::channel(Vec::new()).1,
            counts: Arc::default(),
        }
    }
}

/// The container of a process, from the text of its `/proc/<pid>/cgroup`: the first path under
/// `kubepods` whose last component is a container scope or ID.
pub fn container_of(cgroup: &str) -> Option<ContainerRef> {
    cgroup
        .lines()
        .filter_map(|line| line.splitn(3, ':').nth(2))
        .filter(|path| path.contains("kubepods"))
        .find_map(container_in_path)
}

fn container_in_path(path: &str) -> Option<ContainerRef> {
    let mut parts = path.trim_end_matches('/').rsplit('/');
    let last = parts.next()?;
    let id = last.strip_suffix(".scope").unwrap_or(last);
    let id = ["cri-containerd-", "crio-", "docker-", "containerd-"]
        .iter()
        .find_map(|prefix| id.strip_prefix(prefix))
        .unwrap_or(id);
    if id.len() < 12 || !id.chars().all(|c| c.is_ascii_hexdigit()) {
        return None;
    }
    let pod_uid = parts.next().and_then(|pod| {
        let pod = pod.strip_suffix(".slice").unwrap_or(pod);
        let uid = &pod[pod.rfind("pod")? + 3..];
        (!uid.is_empty()).then(|| uid.replace('_', "-"))
    });
    Some(ContainerRef { pod_uid, container_id: id.to_owned() })
}

/// The container of process `pid` under `root`, read now (`None`: in no pod's container, or
/// gone). Bounded: a cgroup file is a few hundred bytes.
fn read_container(root: &Path, pid: u32) -> Option<ContainerRef> {
    use std::io::Read as _;
    let file = std::fs::File::open(root.join(pid.to_string()).join("cgroup")).ok()?;
    let mut text = String::new();
    file.take(64 * 1024).read_to_string(&mut text).ok()?;
    container_of(&text)
}

/// Who a process on a GPU belongs to.
enum Whose {
    /// A host process, an MPS server, or gone: left alone.
    Nobody,
    /// A pod's container, by name.
    Container(ContainerRef, ContainerKey),
    /// A pod's process that cannot be attributed.
    Stray(ContainerRef, StrayReason, Option<(String, String)>, Option<String>),
}

fn attribute(root: &Path, holders: &Holders, p: &GpuProcess) -> Whose {
    if holders.mps_servers.contains(&p.pid) {
        return Whose::Nobody;
    }
    let Some(container) = read_container(root, p.pid) else {
        return Whose::Nobody;
    };
    let pod = container.pod_uid.as_deref().and_then(|uid| holders.pods.pods.get(uid));
    let Some(pod) = pod else {
        return Whose::Stray(container, StrayReason::UnknownPod, None, None);
    };
    let named = (pod.namespace.clone(), pod.name.clone());
    let Some(name) = pod.container_named_by(&container.container_id) else {
        return Whose::Stray(container, StrayReason::UnknownContainer, Some(named), None);
    };
    Whose::Container(container, (named.0, named.1, name.to_owned()))
}

/// Whether container `name` of the process's pod asks for a resource of which the ledger holds
/// a grant on `gpu` the kubelet has not listed.
fn unlisted_grant(holders: &Holders, container: &ContainerRef, name: &str, gpu: &GpuUuid) -> bool {
    let Some(pod) = container.pod_uid.as_deref().and_then(|uid| holders.pods.pods.get(uid)) else {
        return false;
    };
    pod.asks.iter().any(|(c, resource, _)| {
        c == name && holders.unlisted.iter().any(|(r, g)| r == resource && g == gpu)
    })
}

/// A grant as the watchdog counts its episodes: the holder, the GPU and the device IDs.
type GrantKey = (ContainerKey, GpuUuid, Vec<String>);

/// The watchdog's memory between rounds.
#[derive(Debug)]
pub struct Watchdog {
    config: WatchdogConfig,
    /// GPUs whose per-process memory NVML did not report, already logged.
    unreported: BTreeSet<GpuUuid>,
    /// Episodes under way, since when.
    over: BTreeMap<(ContainerRef, GpuUuid), Instant>,
    /// Strays seen, since when, and whether already reported.
    strays: BTreeMap<(u32, GpuUuid), (Instant, bool)>,
    /// Episodes per grant: a container restarted in the same pod keeps its grant and its count.
    grant_episodes: BTreeMap<GrantKey, u64>,
    /// Whether the wait for the pods' view was logged.
    waiting_logged: bool,
    published: watch::Sender<Vec<Over>>,
    usage: watch::Sender<Vec<Usage>>,
    stray_view: watch::Sender<Vec<Stray>>,
    notices: Option<mpsc::Sender<Notice>>,
    counts: Arc<NoticeCounts>,
}

impl Watchdog {
    /// A watchdog with no episode yet; its Events go to `notices` (none: not sent).
    pub fn new(config: WatchdogConfig, notices: Option<mpsc::Sender<Notice>>) -> Self {
        Self {
            config,
            unreported: BTreeSet::new(),
            over: BTreeMap::new(),
            strays: BTreeMap::new(),
            grant_episodes: BTreeMap::new(),
            waiting_logged: false,
            published: watch::channel(Vec::new()).0,
            usage: watch::channel(Vec::new()).0,
            stray_view: watch::channel(Vec::new()).0,
            notices,
            counts: Arc::new(NoticeCounts::default()),
        }
    }

    /// What each grant's processes used at the last round, kept current.
    pub fn usage(&self) -> watch::Receiver<Vec<Usage>> {
        self.usage.subscribe()
    }

    /// The containers over their grant at the last round, kept current.
    pub fn episodes(&self) -> watch::Receiver<Vec<Over>> {
        self.published.subscribe()
    }

    /// The strays reported at the last round, kept current.
    pub fn strays(&self) -> watch::Receiver<Vec<Stray>> {
        self.stray_view.subscribe()
    }

    /// The kills and Events so far.
    pub fn counts(&self) -> Arc<NoticeCounts> {
        self.counts.clone()
    }

    /// Everything it publishes.
    pub fn published(&self) -> Published {
        Published {
            over: self.episodes(),
            usage: self.usage(),
            strays: self.strays(),
            counts: self.counts(),
        }
    }

    fn notify(&self, notice: Notice) {
        let Some(queue) = &self.notices else { return };
        match queue.try_send(notice) {
            Ok(()) => self.counts.queued.fetch_add(1, Ordering::Relaxed),
            Err(_) => self.counts.dropped.fetch_add(1, Ordering::Relaxed),
        };
    }

    /// One round over `processes` at `now`, attributed with `holders`: the containers over their
    /// grant now. Logs and announces an episode when it starts (and logs its end); with the kill
    /// action, kills the processes of each that has lasted the grace. Strays are reported once
    /// they have been strays for the grace.
    pub fn check(
        &mut self,
        processes: &[GpuProcess],
        holders: &Holders,
        now: Instant,
    ) -> Vec<Over> {
        if !holders.pods.synced {
            if !self.waiting_logged {
                tracing::info!(
                    "the memory watchdog waits for the API's list of the node's pods before judging any GPU process"
                );
                self.waiting_logged = true;
            }
            return Vec::new();
        }
        let root = self.config.proc_root.clone();
        let mut groups: BTreeMap<(ContainerRef, GpuUuid), (ContainerKey, u64, Vec<u32>)> =
            BTreeMap::new();
        let mut strays_now: BTreeMap<(u32, GpuUuid), Stray> = BTreeMap::new();
        for p in processes {
            if p.used_bytes.is_none() && self.unreported.insert(p.gpu.clone()) {
                tracing::warn!(gpu.uuid = %p.gpu, pid = p.pid, "NVML does not report per-process memory on this GPU; the memory watchdog cannot check its containers");
            }
            let used = p.used_bytes.unwrap_or(0);
            match attribute(&root, holders, p) {
                Whose::Nobody => {}
                Whose::Container(container, key) => {
                    let held = holders.holdings.iter().any(|h| h.holder == key && h.gpu == p.gpu);
                    if !held && unlisted_grant(holders, &container, &key.2, &p.gpu) {
                        continue;
                    }
                    if held {
                        let entry = groups
                            .entry((container, p.gpu.clone()))
                            .or_insert_with(|| (key, 0, Vec::new()));
                        entry.1 += used;
                        entry.2.push(p.pid);
                    } else {
                        let stray = Stray {
                            gpu: p.gpu.clone(),
                            pid: p.pid,
                            used_bytes: used,
                            reason: StrayReason::NoGrant,
                            container,
                            pod: Some((key.0, key.1)),
                            container_name: Some(key.2),
                        };
                        strays_now.insert((p.pid, p.gpu.clone()), stray);
                    }
                }
                Whose::Stray(container, reason, pod, container_name) => {
                    let stray = Stray {
                        gpu: p.gpu.clone(),
                        pid: p.pid,
                        used_bytes: used,
                        reason,
                        container,
                        pod,
                        container_name,
                    };
                    strays_now.insert((p.pid, p.gpu.clone()), stray);
                }
            }
        }
        self.report_strays(strays_now, holders, now);
        // Usage and episodes per grant; grants with no process left are forgotten, so the map
        // stays as small as the node's running grants.
        let mut episodes: BTreeMap<GrantKey, u64> = BTreeMap::new();
        let mut usage = Vec::new();
        let mut over = Vec::new();
        for ((container, gpu), (key, used, pids)) in groups {
            for h in holders.holdings.iter().filter(|h| h.holder == key && h.gpu == gpu) {
                let grant: GrantKey = (key.clone(), gpu.clone(), h.device_ids.clone());
                let count = episodes
                    .entry(grant.clone())
                    .or_insert_with(|| self.grant_episodes.get(&grant).copied().unwrap_or(0));
                let over_limit = h.limit_bytes.filter(|&limit| used > limit);
                if over_limit.is_some()
                    && !self.over.contains_key(&(container.clone(), gpu.clone()))
                {
                    *count += 1;
                }
                usage.push(Usage {
                    resource: h.resource.clone(),
                    device_ids: h.device_ids.clone(),
                    gpu: gpu.clone(),
                    used_bytes: used,
                    over_grant_episodes: *count,
                });
                if let Some(granted_bytes) = over_limit {
                    over.push(Over {
                        container: container.clone(),
                        holder: key.clone(),
                        gpu: gpu.clone(),
                        used_bytes: used,
                        granted_bytes,
                        pids: pids.clone(),
                    });
                }
            }
        }
        self.grant_episodes = episodes;
        self.usage.send_replace(usage);
        let mut since = BTreeMap::new();
        for o in &over {
            let id = (o.container.clone(), o.gpu.clone());
            let started = self.over.get(&id).copied();
            if started.is_none() {
                self.episode_started(o, holders);
            }
            let started = started.unwrap_or(now);
            since.insert(id, started);
            if self.config.action == WatchdogAction::Kill
                && now.saturating_duration_since(started) >= self.config.grace
            {
                self.kill(o, holders);
            }
        }
        for (container, gpu) in self.over.keys().filter(|k| !since.contains_key(*k)) {
            tracing::info!(gpu.uuid = %gpu, container.id = container.container_id, "container back within its GPU memory grant");
        }
        self.over = since;
        self.published.send_replace(over.clone());
        over
    }

    fn pod_of(
        holders: &Holders,
        container: &ContainerRef,
        namespace: &str,
        name: &str,
    ) -> Regarding {
        let uid = container
            .pod_uid
            .clone()
            .or_else(|| {
                holders
                    .pods
                    .pods
                    .values()
                    .find(|p| p.namespace == namespace && p.name == name)
                    .map(|p| p.uid.clone())
            })
            .unwrap_or_default();
        Regarding::Pod { namespace: namespace.to_owned(), name: name.to_owned(), uid }
    }

    fn episode_started(&self, o: &Over, holders: &Holders) {
        let (namespace, pod, name) = &o.holder;
        tracing::warn!(
            gpu.uuid = %o.gpu,
            pod = format!("{namespace}/{pod}"),
            container = name,
            container.id = o.container.container_id,
            used_bytes = o.used_bytes,
            granted_bytes = o.granted_bytes,
            pids = ?o.pids,
            "container over its GPU memory grant (MPS limits each process, not their sum, and a process can change its own limit)"
        );
        let then = match self.config.action {
            WatchdogAction::Kill => format!(
                "its processes on the GPU are killed unless it is back within {} s",
                self.config.grace.as_secs()
            ),
            WatchdogAction::Log => "watchdog.action is log: nothing is done".to_owned(),
        };
        self.notify(Notice {
            regarding: Self::pod_of(holders, &o.container, namespace, pod),
            reason: "GpuMemoryOverGrant",
            action: "Observed",
            note: format!(
                "container {name} uses {} MiB of GPU memory on {} against its grant of {} MiB (processes {:?}); {then}",
                o.used_bytes >> 20,
                o.gpu,
                o.granted_bytes >> 20,
                o.pids
            ),
            warning: true,
        });
    }

    fn kill(&self, o: &Over, holders: &Holders) {
        let mut killed = Vec::new();
        for &pid in &o.pids {
            // The PID may have ended and been reused since NVML named it: only a process still
            // in the same container is killed.
            if read_container(&self.config.proc_root, pid).as_ref() != Some(&o.container) {
                continue;
            }
            let Ok(raw) = i32::try_from(pid) else { continue };
            match nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(raw),
                nix::sys::signal::Signal::SIGKILL,
            ) {
                Ok(()) => killed.push(pid),
                Err(e) => tracing::warn!(pid, error = %e, "cannot kill a process over its grant"),
            }
        }
        if killed.is_empty() {
            return;
        }
        self.counts.kills.fetch_add(killed.len() as u64, Ordering::Relaxed);
        let (namespace, pod, name) = &o.holder;
        tracing::warn!(gpu.uuid = %o.gpu, pod = format!("{namespace}/{pod}"), container = name, container.id = o.container.container_id, pids = ?killed, "killed the container's processes on the GPU: over its grant for the grace (watchdog.action: kill)");
        self.notify(Notice {
            regarding: Self::pod_of(holders, &o.container, namespace, pod),
            reason: "GpuMemoryOverGrantKilled",
            action: "Killed",
            note: format!(
                "container {name}: processes {killed:?} killed on {} after {} s over the grant ({} MiB used of {} MiB)",
                o.gpu,
                self.config.grace.as_secs(),
                o.used_bytes >> 20,
                o.granted_bytes >> 20
            ),
            warning: true,
        });
    }

    fn report_strays(
        &mut self,
        now_strays: BTreeMap<(u32, GpuUuid), Stray>,
        holders: &Holders,
        now: Instant,
    ) {
        let mut seen = BTreeMap::new();
        let mut reported = Vec::new();
        for (key, stray) in now_strays {
            let (since, told) = self.strays.get(&key).copied().unwrap_or((now, false));
            let due = now.saturating_duration_since(since) >= self.config.grace;
            if due {
                if !told {
                    self.tell_stray(&stray, holders);
                }
                reported.push(stray);
            }
            seen.insert(key, (since, told || due));
        }
        self.strays = seen;
        self.stray_view.send_replace(reported);
    }

    fn tell_stray(&self, s: &Stray, holders: &Holders) {
        let pod = s.pod.as_ref().map(|(ns, name)| format!("{ns}/{name}"));
        tracing::warn!(
            gpu.uuid = %s.gpu,
            pid = s.pid,
            used_bytes = s.used_bytes,
            reason = s.reason.label(),
            pod = pod.as_deref().unwrap_or("-"),
            pod.uid = s.container.pod_uid.as_deref().unwrap_or("-"),
            container = s.container_name.as_deref().unwrap_or("-"),
            container.id = s.container.container_id,
            "a pod's process uses a GPU it holds no grant on (reported, not killed)"
        );
        let what = match s.reason {
            StrayReason::NoGrant => "its container holds no grant on this GPU",
            StrayReason::UnknownContainer => "its pod's status names no such container",
            StrayReason::UnknownPod => "the API holds no such pod on this node",
        };
        let regarding = match &s.pod {
            Some((namespace, name)) => Self::pod_of(holders, &s.container, namespace, name),
            None => Regarding::Node,
        };
        self.notify(Notice {
            regarding,
            reason: "GpuProcessWithoutGrant",
            action: "Observed",
            note: format!(
                "process {} (container {}, ID {}, pod UID {}) uses {} MiB on {}: {what}",
                s.pid,
                s.container_name.as_deref().unwrap_or("?"),
                s.container.container_id,
                s.container.pod_uid.as_deref().unwrap_or("?"),
                s.used_bytes >> 20,
                s.gpu
            ),
            warning: true,
        });
    }

    /// Reads the processes every `interval` (off the async workers: NVML blocks), attributes
    /// them with what `holders` gives at that moment, until `shutdown`.
    pub async fn run(
        mut self,
        inventory: Arc<dyn GpuInventory>,
        holders: Box<dyn Fn() -> Holders + Send>,
        calls: Arc<CallFailures>,
        shutdown: CancellationToken,
    ) {
        let mut outage = crate::retry::Outage::default();
        loop {
            if !crate::retry::sleep_or_stop(self.config.interval, &shutdown).await {
                return;
            }
            let reading = inventory.clone();
            // A read that hangs pauses the watchdog alone, and never holds up a stop.
            let hang = self.config.interval.max(Duration::from_secs(5));
            let what = "the GPUs' process list (the memory watchdog judges nothing meanwhile)";
            let Some(read) = crate::inventory::read_off_thread(what, hang, &shutdown, move || {
                reading.processes()
            })
            .await
            else {
                return;
            };
            match read {
                Ok(Ok(processes)) => {
                    outage.succeeded();
                    let holders = holders();
                    self.check(&processes, &holders, Instant::now());
                }
                Ok(Err(e)) => {
                    calls.record(&e);
                    if outage.failed() {
                        tracing::warn!(error = %Chain(&e), "cannot read the GPUs' processes; the memory watchdog skips this round");
                    }
                }
                Err(e) => tracing::error!(error = %Chain(&e), "memory watchdog read failed"),
            }
        }
    }
}

/// `<proc root>/<pid>`, for tests that build a proc tree.
pub fn proc_dir(root: &Path, pid: u32) -> PathBuf {
    root.join(pid.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    const ID: &str = "4f2a6b8c9d0e1f2a3b4c5d6e7f8091a2b3c4d5e6f708192a3b4c5d6e7f809112";

    #[test]
    fn containers_are_found_in_every_cgroup_form() {
        let forms = [
            // cgroup v2, systemd driver, containerd
            format!(
                "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1a2b3c4d_5e6f_7a8b_9c0d_1e2f3a4b5c6d.slice/cri-containerd-{ID}.scope\n"
            ),
            // cgroup v2, systemd driver, CRI-O
            format!(
                "0::/kubepods.slice/kubepods-pod1a2b3c4d_5e6f_7a8b_9c0d_1e2f3a4b5c6d.slice/crio-{ID}.scope\n"
            ),
            // cgroup v1, cgroupfs driver, containerd
            format!(
                "12:memory:/kubepods/burstable/pod1a2b3c4d-5e6f-7a8b-9c0d-1e2f3a4b5c6d/{ID}\n11:cpu,cpuacct:/kubepods/burstable/pod1a2b3c4d-5e6f-7a8b-9c0d-1e2f3a4b5c6d/{ID}\n"
            ),
            // cgroup v1, cgroupfs driver, CRI-O
            format!(
                "3:pids:/kubepods/besteffort/pod1a2b3c4d-5e6f-7a8b-9c0d-1e2f3a4b5c6d/crio-{ID}\n"
            ),
        ];
        for text in &forms {
            let c = container_of(text).unwrap_or_else(|| panic!("no container in {text}"));
            assert_eq!(c.container_id, ID, "{text}");
            assert_eq!(
                c.pod_uid.as_deref(),
                Some("1a2b3c4d-5e6f-7a8b-9c0d-1e2f3a4b5c6d"),
                "{text}"
            );
        }
        assert_eq!(container_of("0::/system.slice/nvidia-persistenced.service\n"), None);
        assert_eq!(
            container_of("0::/kubepods.slice/kubepods-burstable.slice\n"),
            None,
            "a pod, no container"
        );
    }

    const GPU: &str = "GPU-11111111-2222-3333-4444-555555555555";
    const OTHER: &str = "GPU-99999999-2222-3333-4444-555555555555";
    const R: &str = "awesome-ai-company.com/gpu-memory";

    fn id(c: char) -> String {
        c.to_string().repeat(64)
    }

    /// A process of container `c` of pod `pod` (a UID), with `env` as its environment.
    fn process(root: &Path, pid: u32, pod: &str, c: char, env: &str) {
        let dir = proc_dir(root, pid);
        std::fs::create_dir_all(&dir).expect("proc dir");
        let cgroup = format!(
            "0::/kubepods.slice/kubepods-pod{}.slice/cri-containerd-{}.scope\n",
            pod.replace('-', "_"),
            id(c)
        );
        std::fs::write(dir.join("cgroup"), cgroup).expect("cgroup");
        std::fs::write(dir.join("environ"), env).expect("environ");
    }

    fn host_process(root: &Path, pid: u32) {
        let dir = proc_dir(root, pid);
        std::fs::create_dir_all(&dir).expect("proc dir");
        std::fs::write(dir.join("cgroup"), "0::/system.slice/nvidia-mps.service\n")
            .expect("cgroup");
    }

    /// A pod of the node whose status names `containers` as `(name, ID char)`.
    fn pod(
        uid: &str,
        name: &str,
        containers: &[(&str, char)],
    ) -> crate::isolation::node_pods::PodInfo {
        let statuses: Vec<serde_json::Value> = containers
            .iter()
            .map(|(n, c)| {
                serde_json::json!({"name": n, "image": "i", "imageID": "", "ready": true,
                    "restartCount": 0, "containerID": format!("containerd://{}", id(*c)),
                    "state": {"running": {}}})
            })
            .collect();
        let pod: k8s_openapi::api::core::v1::Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": name, "namespace": "ml", "uid": uid},
            "spec": {"containers": containers.iter().map(|(n, _)| serde_json::json!({"name": n})).collect::<Vec<_>>()},
            "status": {"phase": "Running", "containerStatuses": statuses}
        }))
        .expect("a pod");
        crate::isolation::node_pods::PodInfo::of(&pod).expect("uid")
    }

    fn holding(pod: &str, container: &str, gpu: &str, ids: &[&str], limit: Option<u64>) -> Holding {
        Holding {
            holder: ("ml".into(), pod.into(), container.into()),
            resource: if limit.is_some() { R.into() } else { "awesome-ai-company.com/gpu".into() },
            device_ids: ids.iter().map(|s| (*s).to_owned()).collect(),
            gpu: GpuUuid::new(gpu).expect("uuid"),
            limit_bytes: limit,
        }
    }

    fn holders(pods: Vec<crate::isolation::node_pods::PodInfo>, holdings: Vec<Holding>) -> Holders {
        Holders {
            pods: NodePods {
                synced: true,
                pods: pods.into_iter().map(|p| (p.uid.clone(), p)).collect(),
                ..NodePods::default()
            },
            holdings,
            unlisted: Vec::new(),
            mps_servers: BTreeSet::new(),
        }
    }

    fn dog(root: &Path, action: WatchdogAction) -> (Watchdog, mpsc::Receiver<Notice>) {
        let (tx, rx) = mpsc::channel(16);
        let config = WatchdogConfig {
            enabled: true,
            interval: Duration::from_secs(10),
            action,
            grace: Duration::from_secs(30),
            proc_root: root.to_path_buf(),
        };
        (Watchdog::new(config, Some(tx)), rx)
    }

    fn on(gpu: &str, pid: u32, gib: u64) -> GpuProcess {
        GpuProcess { gpu: GpuUuid::new(gpu).expect("uuid"), pid, used_bytes: Some(gib << 30) }
    }

    fn drain(rx: &mut mpsc::Receiver<Notice>) -> Vec<Notice> {
        std::iter::from_fn(|| rx.try_recv().ok()).collect()
    }

    /// Issue 21, item 4: a process is attributed by its cgroup and the kubelet's list, never by
    /// its own environment: unsetting or inflating the variable changes nothing.
    #[test]
    fn processes_are_held_to_the_grant_their_cgroup_names_whatever_their_environment() {
        let root = tempfile::tempdir().expect("tempdir");
        // Pod train (u-1): container a holds 4 GiB of GPU; its two processes use 3 + 2, one with
        // the variable unset, one with it inflated to 100 GiB.
        process(root.path(), 10, "u-1", 'a', "PATH=/bin\0");
        process(
            root.path(),
            11,
            "u-1",
            'a',
            &format!("BALEEN_GPU_MEMORY_LIMIT_BYTES={}\0", 100u64 << 30),
        );
        // Container b of pod serve (u-2): 3 of its 8 GiB.
        process(root.path(), 20, "u-2", 'b', "");
        // A whole-GPU holder using 50 GiB of its GPU: no byte limit.
        process(root.path(), 40, "u-3", 'c', "");
        // The MPS server (in the MPS pod's cgroup, named by the daemon) and a host process.
        process(root.path(), 30, "u-mps", 'm', "");
        host_process(root.path(), 31);
        let mut h = holders(
            vec![
                pod("u-1", "train", &[("a", 'a')]),
                pod("u-2", "serve", &[("b", 'b')]),
                pod("u-3", "whole", &[("c", 'c')]),
            ],
            vec![
                holding("train", "a", GPU, &["g::1", "g::2"], Some(4 << 30)),
                holding("serve", "b", GPU, &["g::3"], Some(8 << 30)),
                holding("whole", "c", OTHER, &[OTHER], None),
            ],
        );
        h.mps_servers.insert(30);
        let (mut dog, mut notices) = dog(root.path(), WatchdogAction::Log);
        let usage = dog.usage();
        let t0 = Instant::now();
        let all = [
            on(GPU, 10, 3),
            on(GPU, 11, 2),
            on(GPU, 20, 3),
            on(GPU, 30, 1),
            on(GPU, 31, 1),
            on(OTHER, 40, 50),
        ];
        let over = dog.check(&all, &h, t0);
        assert_eq!(over.len(), 1, "{over:?}");
        assert_eq!(over[0].holder, ("ml".into(), "train".into(), "a".into()));
        assert_eq!((over[0].used_bytes, over[0].granted_bytes), (5 << 30, 4 << 30));
        assert_eq!(over[0].pids, [10, 11]);
        let used: Vec<(Vec<String>, u64)> =
            usage.borrow().iter().map(|u| (u.device_ids.clone(), u.used_bytes >> 30)).collect();
        assert_eq!(
            used,
            [
                (vec!["g::1".into(), "g::2".into()], 5),
                (vec!["g::3".into()], 3),
                (vec![OTHER.to_owned()], 50)
            ]
        );
        let told = drain(&mut notices);
        assert_eq!(told.len(), 1, "{told:?}");
        assert_eq!(told[0].reason, "GpuMemoryOverGrant");
        assert_eq!(
            told[0].regarding,
            Regarding::Pod { namespace: "ml".into(), name: "train".into(), uid: "u-1".into() }
        );
        assert!(told[0].note.contains("container a uses 5120 MiB"), "{}", told[0].note);
        assert!(dog.strays().borrow().is_empty(), "nothing stray: {:?}", dog.strays().borrow());
    }

    /// Issue 21, item 4: a pod's process on a GPU its container holds nothing on, of a pod the
    /// API does not know, or of a container its pod does not name, is reported once it has been
    /// one for the grace (not before: the views trail a new container), with an Event.
    #[test]
    fn processes_of_no_grant_are_reported_after_the_grace() {
        let root = tempfile::tempdir().expect("tempdir");
        process(root.path(), 10, "u-1", 'a', ""); // holds GPU, runs on OTHER too
        process(root.path(), 11, "u-1", 'a', "");
        process(root.path(), 20, "u-2", 'b', ""); // a pod that asked for nothing
        process(root.path(), 30, "u-gone", 'c', ""); // a pod the API does not hold
        process(root.path(), 40, "u-1", 'd', ""); // a container u-1's status does not name
        let h = holders(
            vec![pod("u-1", "train", &[("a", 'a')]), pod("u-2", "steal", &[("b", 'b')])],
            vec![holding("train", "a", GPU, &["g::1"], Some(4 << 30))],
        );
        let (mut dog, mut notices) = dog(root.path(), WatchdogAction::Kill);
        let strays = dog.strays();
        let all =
            [on(GPU, 10, 1), on(OTHER, 11, 1), on(OTHER, 20, 7), on(GPU, 30, 1), on(GPU, 40, 1)];
        let t0 = Instant::now();
        dog.check(&all, &h, t0);
        assert!(strays.borrow().is_empty(), "within the grace");
        assert!(drain(&mut notices).is_empty());
        dog.check(&all, &h, t0 + Duration::from_secs(30));
        let found: Vec<(u32, StrayReason)> =
            strays.borrow().iter().map(|s| (s.pid, s.reason)).collect();
        assert_eq!(
            found,
            [
                (11, StrayReason::NoGrant),
                (20, StrayReason::NoGrant),
                (30, StrayReason::UnknownPod),
                (40, StrayReason::UnknownContainer)
            ]
        );
        let told = drain(&mut notices);
        assert_eq!(told.len(), 4, "{told:?}");
        assert!(told.iter().all(|n| n.reason == "GpuProcessWithoutGrant"));
        let steal = told.iter().find(|n| n.note.starts_with("process 20 ")).expect("pid 20");
        assert_eq!(
            steal.regarding,
            Regarding::Pod { namespace: "ml".into(), name: "steal".into(), uid: "u-2".into() }
        );
        assert!(steal.note.contains("holds no grant"), "{}", steal.note);
        let unknown = told.iter().find(|n| n.note.starts_with("process 30 ")).expect("pid 30");
        assert_eq!(unknown.regarding, Regarding::Node);
        // Reported once, listed while it lasts, forgotten when it ends.
        dog.check(&all, &h, t0 + Duration::from_secs(40));
        assert!(drain(&mut notices).is_empty(), "told once");
        assert_eq!(strays.borrow().len(), 4);
        dog.check(&[on(GPU, 10, 1)], &h, t0 + Duration::from_secs(50));
        assert!(strays.borrow().is_empty());
        // Strays are never killed, even with the kill action: 20 is still a process here.
        assert!(dog.counts().kills.load(Ordering::Relaxed) == 0);
    }

    #[test]
    fn nothing_is_judged_before_the_pods_are_listed() {
        let root = tempfile::tempdir().expect("tempdir");
        process(root.path(), 10, "u-1", 'a', "");
        let mut h = holders(vec![], vec![]);
        h.pods.synced = false;
        let (mut dog, mut notices) = dog(root.path(), WatchdogAction::Kill);
        let t0 = Instant::now();
        for s in [0, 60] {
            assert!(dog.check(&[on(GPU, 10, 9)], &h, t0 + Duration::from_secs(s)).is_empty());
        }
        assert!(dog.strays().borrow().is_empty());
        assert!(drain(&mut notices).is_empty());
    }

    #[test]
    fn over_grant_episodes_are_counted_per_grant_across_container_restarts() {
        let root = tempfile::tempdir().expect("tempdir");
        process(root.path(), 10, "u-1", 'a', "");
        process(root.path(), 11, "u-1", 'b', ""); // the same container, restarted: a new ID
        process(root.path(), 20, "u-2", 'c', "");
        let h = holders(
            vec![pod("u-1", "p", &[("w", 'a'), ("w", 'b')]), pod("u-2", "q", &[("w", 'c')])],
            vec![
                holding("p", "w", GPU, &["g::1", "g::2"], Some(4 << 30)),
                holding("q", "w", GPU, &["g::3"], Some(4 << 30)),
            ],
        );
        let (mut dog, _notices) = dog(root.path(), WatchdogAction::Log);
        let usage = dog.usage();
        let episodes_of = |ids: &[&str]| {
            usage.borrow().iter().find(|u| u.device_ids == ids).map(|u| u.over_grant_episodes)
        };
        let t = Instant::now();
        dog.check(&[on(GPU, 10, 5), on(GPU, 20, 1)], &h, t);
        assert_eq!(episodes_of(&["g::1", "g::2"]), Some(1), "the first episode");
        assert_eq!(episodes_of(&["g::3"]), Some(0), "under its grant");
        dog.check(&[on(GPU, 10, 6), on(GPU, 20, 1)], &h, t);
        assert_eq!(episodes_of(&["g::1", "g::2"]), Some(1), "still the same episode");
        dog.check(&[on(GPU, 10, 1), on(GPU, 20, 1)], &h, t);
        assert_eq!(episodes_of(&["g::1", "g::2"]), Some(1), "back under: the count stays");
        // The container restarts in the same pod and goes over again: the grant's second.
        dog.check(&[on(GPU, 11, 5), on(GPU, 20, 1)], &h, t);
        assert_eq!(episodes_of(&["g::1", "g::2"]), Some(2));
        // None of the grant's processes left: forgotten, and a later grant of the same devices
        // starts from zero.
        dog.check(&[on(GPU, 20, 1)], &h, t);
        assert_eq!(episodes_of(&["g::1", "g::2"]), None);
        assert_eq!(dog.grant_episodes.len(), 1, "only running grants are remembered");
        dog.check(&[on(GPU, 11, 1), on(GPU, 20, 1)], &h, t);
        assert_eq!(episodes_of(&["g::1", "g::2"]), Some(0));
    }

    /// Issue 21, item 4: over the grant is acted on by default: killed once the episode lasted
    /// the grace, with an Event naming the pod and container; `log` kills nothing.
    #[test]
    fn the_kill_action_kills_after_the_grace_and_says_so() {
        let root = tempfile::tempdir().expect("tempdir");
        let mut child = std::process::Command::new("sleep").arg("30").spawn().expect("sleep");
        let pid = child.id();
        process(root.path(), pid, "u-1", 'd', "");
        let h = holders(
            vec![pod("u-1", "p", &[("w", 'd')])],
            vec![holding("p", "w", GPU, &["g::1"], Some(1 << 30))],
        );
        assert_eq!(WatchdogConfig::default().action, WatchdogAction::Kill, "the default");
        let (mut logging, _n) = dog(root.path(), WatchdogAction::Log);
        let t0 = Instant::now();
        logging.check(&[on(GPU, pid, 2)], &h, t0);
        logging.check(&[on(GPU, pid, 2)], &h, t0 + Duration::from_secs(60));
        assert!(child.try_wait().expect("wait").is_none(), "log kills nothing");
        let (mut dog, mut notices) = dog(root.path(), WatchdogAction::Kill);
        assert_eq!(dog.check(&[on(GPU, pid, 2)], &h, t0).len(), 1);
        dog.check(&[on(GPU, pid, 2)], &h, t0 + Duration::from_secs(29));
        assert!(child.try_wait().expect("wait").is_none(), "within the grace");
        dog.check(&[on(GPU, pid, 2)], &h, t0 + Duration::from_secs(30));
        let status = child.wait().expect("reaped");
        assert_eq!(std::os::unix::process::ExitStatusExt::signal(&status), Some(9), "SIGKILL");
        assert_eq!(dog.counts().kills.load(Ordering::Relaxed), 1);
        let told: Vec<&str> = drain(&mut notices).iter().map(|n| n.reason).collect();
        assert_eq!(told, ["GpuMemoryOverGrant", "GpuMemoryOverGrantKilled"]);
    }

    #[test]
    fn a_full_event_queue_drops_and_counts() {
        let root = tempfile::tempdir().expect("tempdir");
        let (tx, _rx) = mpsc::channel(1);
        let dog = Watchdog::new(
            WatchdogConfig { proc_root: root.path().into(), ..WatchdogConfig::default() },
            Some(tx),
        );
        for _ in 0..3 {
            dog.notify(Notice {
                regarding: Regarding::Node,
                reason: "R",
                action: "Observed",
                note: String::new(),
                warning: true,
            });
        }
        assert_eq!(dog.counts().queued.load(Ordering::Relaxed), 1);
        assert_eq!(dog.counts().dropped.load(Ordering::Relaxed), 2);
    }
}
