//! MPS (CUDA Multi-Process Service) for gpu-memory grants: one control daemon per shared GPU,
//! with its pipe and log directories under the MPS root ([`MpsConfig`]); the [`supervisor`]
//! starts, probes, restarts and adopts them through [`control::MpsControl`]; a client container
//! gets what it needs to reach its GPU's daemon with its limits ([`client_setup`]): the pipe
//! directory mounted at a fixed path, `CUDA_MPS_PIPE_DIRECTORY`,
//! `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` from the granted bytes and, by default,
//! `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE` proportional to the share. On the GPU days the pipe
//! directory was all a client needed (docs/gpu-day.md, "MPS facts"): no shared `/dev/shm`.

pub mod client_probe;
pub mod control;
pub mod supervisor;
pub mod users;

use std::path::{Path, PathBuf};
use std::time::Duration;

use super::{BindMount, ContainerSetup};
use crate::defaults;
use crate::ledger::Share;

/// How a client's share of the GPU's streaming multiprocessors is set
/// (`CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`, which MPS applies to the client's contexts).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ThreadPercentage {
    /// The client's share of the GPU's memory units, rounded, 1 to 100 (default).
    Proportional,
    /// Not set: every client may use every SM (MPS then schedules them all together).
    None,
    /// The same percentage, 1 to 100, for every client.
    Fixed(u8),
}

/// Where the MPS daemons run (docs/agent.md, "MPS").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DaemonPlacement {
    /// The agent starts, restarts and (with `stop_on_exit`) stops them itself. Daemons started
    /// from the agent's container die with it in Kubernetes: for development and single-binary
    /// installs.
    Agent,
    /// Another process owns them (`baleen-agent mps` in a DaemonSet of its own, which an agent
    /// upgrade does not restart): the agent only probes and adopts.
    External,
}

/// The MPS settings of the node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MpsConfig {
    /// Enforce gpu-memory grants with MPS (default). Off: the units are accounting only, which
    /// the agent logs at start and every Allocate answer says (`BALEEN_GPU_SHARING`).
    pub enabled: bool,
    /// Host directory holding `<GPU UUID>/pipe` and `<GPU UUID>/log`.
    pub root: PathBuf,
    /// The control binary, a path or a name looked up on `PATH`.
    pub control_binary: PathBuf,
    /// Time between two probes of each daemon.
    pub probe_interval: Duration,
    /// How long a probe (`get_server_list`) may take.
    pub probe_timeout: Duration,
    /// Send `quit` to the daemons when the agent stops (default: leave them serving).
    pub stop_on_exit: bool,
    /// The clients' SM share.
    pub thread_percentage: ThreadPercentage,
    /// Who owns the daemons.
    pub daemons: DaemonPlacement,
}

impl Default for MpsConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            root: PathBuf::from(defaults::MPS_ROOT),
            control_binary: PathBuf::from(defaults::MPS_CONTROL_BINARY),
            probe_interval: defaults::MPS_PROBE_INTERVAL,
            probe_timeout: defaults::MPS_PROBE_TIMEOUT,
            stop_on_exit: false,
            thread_percentage: ThreadPercentage::Proportional,
            daemons: DaemonPlacement::Agent,
        }
    }
}

/// One GPU's daemon directories on the host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MpsDirs {
    /// `CUDA_MPS_PIPE_DIRECTORY`: the control socket; what a client mounts.
    pub pipe: PathBuf,
    /// `CUDA_MPS_LOG_DIRECTORY`: `control.log` and `server.log`.
    pub log: PathBuf,
}

impl MpsConfig {
    /// The host pipe directory of the daemon serving `gpu_uuid`.
    pub fn pipe_dir(&self, gpu_uuid: &str) -> PathBuf {
        self.root.join(gpu_uuid).join("pipe")
    }

    /// The directories of the daemon serving `gpu_uuid`.
    pub fn dirs(&self, gpu_uuid: &str) -> MpsDirs {
        MpsDirs { pipe: self.pipe_dir(gpu_uuid), log: self.root.join(gpu_uuid).join("log") }
    }
}

/// The share of the GPU's streaming multiprocessors a client gets: its share of the GPU's units,
/// rounded, at least 1 and at most 100 percent.
pub fn thread_percentage(share: &Share) -> u64 {
    let units = u64::from(share.units);
    let all = u64::from(share.gpu_units);
    ((units * 100 + all / 2) / all.max(1)).clamp(1, 100)
}

/// The environment and mounts of a client container of `share`. With MPS off, no MPS variable
/// and no mount (there is no daemon to reach), and `BALEEN_GPU_SHARING=accounting-only`.
pub fn client_setup(config: &MpsConfig, share: &Share) -> ContainerSetup {
    let env = |k: &str, v: String| (k.to_owned(), v);
    let limit = env("BALEEN_GPU_MEMORY_LIMIT_BYTES", share.bytes.to_string());
    if !config.enabled {
        return ContainerSetup {
            envs: vec![env("BALEEN_GPU_SHARING", "accounting-only".to_owned()), limit],
            mounts: vec![],
        };
    }
    let pipe_in_container = Path::new(defaults::MPS_PIPE_IN_CONTAINER);
    let mut envs = vec![
        env("CUDA_MPS_PIPE_DIRECTORY", defaults::MPS_PIPE_IN_CONTAINER.to_owned()),
        env("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", format!("0={}M", share.bytes >> 20)),
    ];
    match config.thread_percentage {
        ThreadPercentage::Proportional => envs
            .push(env("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", thread_percentage(share).to_string())),
        ThreadPercentage::Fixed(p) => {
            envs.push(env("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", p.to_string()));
        }
        ThreadPercentage::None => {}
    }
    envs.push(limit);
    ContainerSetup {
        envs,
        mounts: vec![BindMount {
            host: config.pipe_dir(&share.gpu_uuid),
            container: pipe_in_container.to_path_buf(),
            // A client only connects to the `control` socket (connecting needs no write to the
            // file system); read-only, a tenant cannot delete or replace the socket, so that
            // later clients run outside MPS. The privileged control socket beside it is refused
            // to non-root processes by its mode: the install refuses gpu-memory pods that may
            // run as root (docs/agent.md, "What a tenant can and cannot do").
            read_only: true,
        }],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_follow_the_share() {
        let share = Share { gpu_uuid: "GPU-1".into(), units: 4, gpu_units: 22, bytes: 4 << 30 };
        let config = MpsConfig { root: "/host/mps".into(), ..MpsConfig::default() };
        let setup = client_setup(&config, &share);
        let envs: std::collections::BTreeMap<_, _> = setup.envs.into_iter().collect();
        assert_eq!(envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"], "0=4096M");
        assert_eq!(envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"], "18");
        assert_eq!(setup.mounts[0].host, PathBuf::from("/host/mps/GPU-1/pipe"));
        assert!(setup.mounts[0].read_only, "a tenant cannot delete or replace the sockets");
        let tiny = Share { units: 1, gpu_units: 1000, ..share.clone() };
        assert_eq!(thread_percentage(&tiny), 1, "never 0 %");
        let fixed = MpsConfig { thread_percentage: ThreadPercentage::Fixed(30), ..config.clone() };
        let envs: std::collections::BTreeMap<_, _> =
            client_setup(&fixed, &share).envs.into_iter().collect();
        assert_eq!(envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"], "30");
        let none = MpsConfig { thread_percentage: ThreadPercentage::None, ..config.clone() };
        let envs: std::collections::BTreeMap<_, _> =
            client_setup(&none, &share).envs.into_iter().collect();
        assert!(!envs.contains_key("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"));
        let off = MpsConfig { enabled: false, ..config };
        let setup = client_setup(&off, &share);
        let envs: std::collections::BTreeMap<_, _> = setup.envs.into_iter().collect();
        assert_eq!(envs["BALEEN_GPU_SHARING"], "accounting-only");
        assert!(!envs.contains_key("CUDA_MPS_PIPE_DIRECTORY") && setup.mounts.is_empty());
    }
}
