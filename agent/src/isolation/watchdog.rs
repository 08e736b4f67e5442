//! The per-container GPU memory watchdog. MPS limits memory per client *process*, so a container
//! running several CUDA processes can use more than its grant in total. Every
//! `watchdog.interval` the watchdog reads each GPU's compute processes and their memory (NVML,
//! through `GpuInventory::processes`), finds each process's container from
//! `<proc root>/<pid>/cgroup` (cgroup v1 and v2; containerd's `cri-containerd-<id>.scope` and
//! plain `<id>`, CRI-O's `crio-<id>`; systemd and cgroupfs drivers) and its grant from
//! `BALEEN_GPU_MEMORY_LIMIT_BYTES` in `<proc root>/<pid>/environ` (set by the agent's Allocate
//! answer), sums per container and GPU, and compares. A container over its grant is logged at
//! WARN once per episode (and again when it is back under); with `watchdog.action: kill` its
//! processes on that GPU get SIGKILL, and their PIDs are logged. Processes of no container, and
//! containers without a gpu-memory grant (whole GPUs, MIG), are left alone. The agent runs it as
//! a subsystem; the current episodes are published for the metrics endpoint.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::error_chain::Chain;
use crate::inventory::{CallFailures, GpuInventory, GpuProcess, GpuUuid};

/// The environment variable holding a container's granted bytes.
pub const GRANT_VARIABLE: &str = "BALEEN_GPU_MEMORY_LIMIT_BYTES";
/// The environment variable naming a container's gpu-memory devices (its grant).
pub const DEVICES_VARIABLE: &str = "BALEEN_DEVICE_IDS";

/// What the processes of one gpu-memory grant use on its GPU (every round, for the metrics).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Usage {
    /// The grant's device IDs, sorted (from the processes' environment).
    pub device_ids: Vec<String>,
    /// The GPU.
    pub gpu: GpuUuid,
    /// Bytes its processes use on the GPU together.
    pub used_bytes: u64,
    /// Episodes over the grant so far: since its pod's processes appeared on the GPU, counted
    /// again from zero once none of them is left (a counter reset to Prometheus).
    pub over_grant_episodes: u64,
}

/// What the watchdog does about a container over its grant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WatchdogAction {
    /// Log it (WARN, once per episode) and publish it (default).
    Log,
    /// Also SIGKILL the container's processes on that GPU.
    Kill,
}

/// How the watchdog runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WatchdogConfig {
    /// Time between two reads.
    pub interval: Duration,
    /// What to do about a container over its grant.
    pub action: WatchdogAction,
    /// Where the host's `/proc` is (the agent needs the host's PID namespace to read it).
    pub proc_root: PathBuf,
}

impl Default for WatchdogConfig {
    fn default() -> Self {
        Self {
            interval: crate::defaults::WATCHDOG_INTERVAL,
            action: WatchdogAction::Log,
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

/// A container over its grant on one GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Over {
    /// The container.
    pub container: ContainerRef,
    /// The GPU.
    pub gpu: GpuUuid,
    /// Bytes its processes use on the GPU together.
    pub used_bytes: u64,
    /// Bytes granted.
    pub granted_bytes: u64,
    /// Its processes on the GPU.
    pub pids: Vec<u32>,
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

/// The granted bytes in a process's environment (`/proc/<pid>/environ`, NUL-separated).
pub fn grant_of(environ: &[u8]) -> Option<u64> {
    env_var(environ, GRANT_VARIABLE)?.parse().ok()
}

/// The value of `name` in a process's environment (`/proc/<pid>/environ`, NUL-separated).
fn env_var<'a>(environ: &'a [u8], name: &str) -> Option<&'a str> {
    environ
        .split(|&b| b == 0)
        .filter_map(|var| std::str::from_utf8(var).ok())
        .find_map(|var| var.strip_prefix(name)?.strip_prefix('='))
}

/// A grant as the watchdog sees it: the pod UID from the cgroup, the GPU and the device IDs.
type GrantKey = (Option<String>, GpuUuid, Vec<String>);

/// The watchdog's memory of episodes between rounds.
#[derive(Debug)]
pub struct Watchdog {
    config: WatchdogConfig,
    /// GPUs whose per-process memory NVML did not report, already logged.
    unreported: BTreeSet<GpuUuid>,
    over: BTreeSet<(ContainerRef, GpuUuid)>,
    /// Episodes per grant, by (pod UID, GPU, device IDs): a container restarted in the same pod
    /// keeps its grant and its count.
    grant_episodes: BTreeMap<GrantKey, u64>,
    published: watch::Sender<Vec<Over>>,
    usage: watch::Sender<Vec<Usage>>,
}

impl Watchdog {
    /// A watchdog with no episode yet.
    pub fn new(config: WatchdogConfig) -> Self {
        Self {
            config,
            unreported: BTreeSet::new(),
            over: BTreeSet::new(),
            grant_episodes: BTreeMap::new(),
            published: watch::channel(Vec::new()).0,
            usage: watch::channel(Vec::new()).0,
        }
    }

    /// What each gpu-memory grant's processes used at the last round, kept current.
    pub fn usage(&self) -> watch::Receiver<Vec<Usage>> {
        self.usage.subscribe()
    }

    /// The containers over their grant at the last round, kept current.
    pub fn episodes(&self) -> watch::Receiver<Vec<Over>> {
        self.published.subscribe()
    }

    /// One round over `processes`: the containers over their grant now. Logs an episode when it
    /// starts and ends; with the kill action, kills the processes of each.
    pub fn check(&mut self, processes: &[GpuProcess]) -> Vec<Over> {
        let root = &self.config.proc_root;
        let mut groups: BTreeMap<(ContainerRef, GpuUuid), (u64, u64, Vec<u32>)> = BTreeMap::new();
        let mut devices: BTreeMap<(ContainerRef, GpuUuid), Vec<String>> = BTreeMap::new();
        for p in processes {
            let dir = root.join(p.pid.to_string());
            let Some(container) =
                std::fs::read_to_string(dir.join("cgroup")).ok().as_deref().and_then(container_of)
            else {
                continue; // not in a container (the MPS server, a host process) or gone
            };
            let environ = std::fs::read(dir.join("environ")).unwrap_or_default();
            let Some(granted) = grant_of(&environ) else {
                continue; // no gpu-memory grant: a whole GPU, MIG, or not ours
            };
            if let Some(ids) = env_var(&environ, DEVICES_VARIABLE) {
                let mut ids: Vec<String> = ids.split(',').map(str::to_owned).collect();
                ids.sort();
                devices.insert((container.clone(), p.gpu.clone()), ids);
            }
            if p.used_bytes.is_none() && self.unreported.insert(p.gpu.clone()) {
                tracing::warn!(gpu.uuid = %p.gpu, pid = p.pid, "NVML does not report per-process memory on this GPU; the memory watchdog cannot check its containers");
            }
            let entry = groups.entry((container, p.gpu.clone())).or_insert((0, granted, vec![]));
            entry.0 += p.used_bytes.unwrap_or(0);
            entry.1 = entry.1.min(granted);
            entry.2.push(p.pid);
        }
        // Each group its processes' environment names a grant for counts toward that grant's
        // episodes and usage; grants with no process left are forgotten, so the map stays as
        // small as the node's running grants.
        let mut episodes: BTreeMap<GrantKey, u64> = BTreeMap::new();
        let mut named = Vec::new();
        for (key, (used, granted, _)) in &groups {
            let Some(ids) = devices.remove(key) else { continue };
            let grant: GrantKey = (key.0.pod_uid.clone(), key.1.clone(), ids);
            let count = episodes
                .entry(grant.clone())
                .or_insert_with(|| self.grant_episodes.get(&grant).copied().unwrap_or(0));
            if used > granted && !self.over.contains(key) {
                *count += 1;
            }
            named.push((grant, *used));
        }
        let usage: Vec<Usage> = named
            .into_iter()
            .map(|(grant, used_bytes)| Usage {
                over_grant_episodes: episodes[&grant],
                gpu: grant.1,
                device_ids: grant.2,
                used_bytes,
            })
            .collect();
        self.grant_episodes = episodes;
        self.usage.send_replace(usage);
        let over: Vec<Over> = groups
            .into_iter()
            .filter(|(_, (used, granted, _))| used > granted)
            .map(|((container, gpu), (used_bytes, granted_bytes, pids))| Over {
                container,
                gpu,
                used_bytes,
                granted_bytes,
                pids,
            })
            .collect();
        let now: BTreeSet<(ContainerRef, GpuUuid)> =
            over.iter().map(|o| (o.container.clone(), o.gpu.clone())).collect();
        for o in over.iter().filter(|o| !self.over.contains(&(o.container.clone(), o.gpu.clone())))
        {
            tracing::warn!(
                gpu.uuid = %o.gpu,
                pod.uid = o.container.pod_uid.as_deref().unwrap_or("-"),
                container.id = o.container.container_id,
                used_bytes = o.used_bytes,
                granted_bytes = o.granted_bytes,
                pids = ?o.pids,
                "container over its GPU memory grant (MPS limits each process, not their sum)"
            );
        }
        for (container, gpu) in self.over.difference(&now) {
            tracing::info!(gpu.uuid = %gpu, container.id = container.container_id, "container back within its GPU memory grant");
        }
        if self.config.action == WatchdogAction::Kill {
            for o in &over {
                kill(o);
            }
        }
        self.over = now;
        self.published.send_replace(over.clone());
        over
    }

    /// Reads the processes every `interval` (off the async workers: NVML blocks) until
    /// `shutdown`.
    pub async fn run(
        mut self,
        inventory: Arc<dyn GpuInventory>,
        calls: Arc<CallFailures>,
        shutdown: CancellationToken,
    ) {
        let mut failing = false;
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = tokio::time::sleep(self.config.interval) => {}
            }
            let reading = inventory.clone();
            match tokio::task::spawn_blocking(move || reading.processes()).await {
                Ok(Ok(processes)) => {
                    failing = false;
                    self.check(&processes);
                }
                Ok(Err(e)) => {
                    calls.record(&e);
                    if !failing {
                        tracing::warn!(error = %Chain(&e), "cannot read the GPUs' processes; the memory watchdog skips this round");
                        failing = true;
                    }
                }
                Err(e) => tracing::error!(error = %Chain(&e), "memory watchdog read failed"),
            }
        }
    }
}

fn kill(over: &Over) {
    for &pid in &over.pids {
        let Ok(raw) = i32::try_from(pid) else { continue };
        match nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(raw),
            nix::sys::signal::Signal::SIGKILL,
        ) {
            Ok(()) => {}
            Err(e) => tracing::warn!(pid, error = %e, "cannot kill a process over its grant"),
        }
    }
    tracing::warn!(gpu.uuid = %over.gpu, container.id = over.container.container_id, pids = ?over.pids, "killed the container's processes on the GPU (watchdog.action: kill)");
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

    #[test]
    fn the_grant_is_read_from_the_environment() {
        let env = b"PATH=/bin\0BALEEN_GPU_MEMORY_LIMIT_BYTES=4294967296\0HOME=/\0";
        assert_eq!(grant_of(env), Some(4 << 30));
        assert_eq!(grant_of(b"PATH=/bin\0"), None);
        assert_eq!(grant_of(b"BALEEN_GPU_MEMORY_LIMIT_BYTES_X=1\0"), None);
    }

    fn process(root: &Path, pid: u32, cgroup: &str, grant: Option<u64>) {
        let dir = proc_dir(root, pid);
        std::fs::create_dir_all(&dir).expect("proc dir");
        std::fs::write(dir.join("cgroup"), cgroup).expect("cgroup");
        let env = grant.map(|g| format!("PATH=/bin\0{GRANT_VARIABLE}={g}\0")).unwrap_or_default();
        std::fs::write(dir.join("environ"), env).expect("environ");
    }

    fn in_container(id: char) -> String {
        format!(
            "0::/kubepods.slice/kubepods-pod1111_2222.slice/cri-containerd-{}.scope\n",
            id.to_string().repeat(64)
        )
    }

    #[test]
    fn a_container_over_its_grant_is_found_and_one_under_is_not() {
        let root = tempfile::tempdir().expect("tempdir");
        let gpu = GpuUuid::new("GPU-11111111-2222-3333-4444-555555555555").expect("uuid");
        let on = |pid, gib: u64| GpuProcess { gpu: gpu.clone(), pid, used_bytes: Some(gib << 30) };
        // Container a: two processes, 3 + 2 GiB against 4 GiB. Container b: 3 of 8 GiB.
        process(root.path(), 10, &in_container('a'), Some(4 << 30));
        process(root.path(), 11, &in_container('a'), Some(4 << 30));
        process(root.path(), 20, &in_container('b'), Some(8 << 30));
        // The MPS server (no container) and a whole-GPU container (no grant).
        process(root.path(), 30, "0::/system.slice/nvidia-mps.service\n", None);
        process(root.path(), 40, &in_container('c'), None);
        let mut dog = Watchdog::new(WatchdogConfig {
            interval: Duration::from_secs(10),
            action: WatchdogAction::Log,
            proc_root: root.path().to_path_buf(),
        });
        let episodes = dog.episodes();
        let all = [on(10, 3), on(11, 2), on(20, 3), on(30, 1), on(40, 50), on(99, 7)];
        let over = dog.check(&all);
        assert_eq!(over.len(), 1, "{over:?}");
        assert_eq!(over[0].container.container_id, "a".repeat(64));
        assert_eq!((over[0].used_bytes, over[0].granted_bytes), (5 << 30, 4 << 30));
        assert_eq!(over[0].pids, [10, 11]);
        assert_eq!(episodes.borrow().len(), 1, "published for the metrics");
        // One process ends: back under, the episode is over.
        assert!(dog.check(&[on(10, 3), on(20, 3)]).is_empty());
        assert!(episodes.borrow().is_empty());
    }

    #[test]
    fn over_grant_episodes_are_counted_per_grant_across_container_restarts() {
        let root = tempfile::tempdir().expect("tempdir");
        let gpu = GpuUuid::new("GPU-11111111-2222-3333-4444-555555555555").expect("uuid");
        let on = |pid, gib: u64| GpuProcess { gpu: gpu.clone(), pid, used_bytes: Some(gib << 30) };
        let granted = |pid: u32, id: char, ids: &str| {
            let dir = proc_dir(root.path(), pid);
            std::fs::create_dir_all(&dir).expect("proc dir");
            std::fs::write(dir.join("cgroup"), in_container(id)).expect("cgroup");
            let env = format!("{GRANT_VARIABLE}={}\0{DEVICES_VARIABLE}={ids}\0", 4u64 << 30);
            std::fs::write(dir.join("environ"), env).expect("environ");
        };
        granted(10, 'a', "g::2,g::1");
        granted(11, 'b', "g::1,g::2"); // the same grant after a container restart, same pod
        granted(20, 'c', "g::3");
        let mut dog = Watchdog::new(WatchdogConfig {
            interval: Duration::from_secs(10),
            action: WatchdogAction::Log,
            proc_root: root.path().to_path_buf(),
        });
        let usage = dog.usage();
        let episodes_of = |ids: &[&str]| {
            usage.borrow().iter().find(|u| u.device_ids == ids).map(|u| u.over_grant_episodes)
        };
        dog.check(&[on(10, 5), on(20, 1)]);
        assert_eq!(episodes_of(&["g::1", "g::2"]), Some(1), "the first episode");
        assert_eq!(episodes_of(&["g::3"]), Some(0), "under its grant");
        dog.check(&[on(10, 6), on(20, 1)]);
        assert_eq!(episodes_of(&["g::1", "g::2"]), Some(1), "still the same episode");
        dog.check(&[on(10, 1), on(20, 1)]);
        assert_eq!(episodes_of(&["g::1", "g::2"]), Some(1), "back under: the count stays");
        // The container restarts in the same pod and goes over again: the grant's second.
        dog.check(&[on(11, 5), on(20, 1)]);
        assert_eq!(episodes_of(&["g::1", "g::2"]), Some(2));
        // None of the grant's processes left: forgotten, and a later grant of the same devices
        // starts from zero.
        dog.check(&[on(20, 1)]);
        assert_eq!(episodes_of(&["g::1", "g::2"]), None);
        assert_eq!(dog.grant_episodes.len(), 1, "only running grants are remembered");
        dog.check(&[on(11, 1), on(20, 1)]);
        assert_eq!(episodes_of(&["g::1", "g::2"]), Some(0));
    }

    #[test]
    fn the_kill_action_kills_the_containers_processes() {
        let root = tempfile::tempdir().expect("tempdir");
        let mut child = std::process::Command::new("sleep").arg("30").spawn().expect("sleep");
        let pid = child.id();
        process(root.path(), pid, &in_container('d'), Some(1 << 30));
        let gpu = GpuUuid::new("GPU-11111111-2222-3333-4444-555555555555").expect("uuid");
        let mut dog = Watchdog::new(WatchdogConfig {
            interval: Duration::from_secs(10),
            action: WatchdogAction::Kill,
            proc_root: root.path().to_path_buf(),
        });
        let over = dog.check(&[GpuProcess { gpu, pid, used_bytes: Some(2 << 30) }]);
        assert_eq!(over.len(), 1);
        let status = child.wait().expect("reaped");
        assert_eq!(std::os::unix::process::ExitStatusExt::signal(&status), Some(9), "SIGKILL");
    }
}
