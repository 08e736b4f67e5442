//! MPS (CUDA Multi-Process Service) for gpu-memory grants: where each GPU's daemon keeps its
//! pipe and log directories on the host ([`MpsConfig`]), and what a client container needs to
//! reach it with its limits ([`client_setup`]): the pipe directory mounted at a fixed path,
//! `CUDA_MPS_PIPE_DIRECTORY`, `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` from the granted bytes and
//! `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE` proportional to the share. On the GPU days the pipe
//! directory was all a client needed (docs/gpu-day.md, "MPS facts"): no shared `/dev/shm`.

use std::path::{Path, PathBuf};

use super::{BindMount, ContainerSetup};
use crate::defaults;
use crate::ledger::Share;

/// Where the per-GPU MPS directories live on the host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MpsConfig {
    /// Host directory holding `<GPU UUID>/pipe` and `<GPU UUID>/log`.
    pub root: PathBuf,
}

impl Default for MpsConfig {
    fn default() -> Self {
        Self { root: PathBuf::from(defaults::MPS_ROOT) }
    }
}

impl MpsConfig {
    /// The host pipe directory of the daemon serving `gpu_uuid`.
    pub fn pipe_dir(&self, gpu_uuid: &str) -> PathBuf {
        self.root.join(gpu_uuid).join("pipe")
    }
}

/// The share of the GPU's streaming multiprocessors a client gets: its share of the GPU's units,
/// rounded, at least 1 and at most 100 percent.
pub fn thread_percentage(share: &Share) -> u64 {
    let units = u64::from(share.units);
    let all = u64::from(share.gpu_units);
    ((units * 100 + all / 2) / all.max(1)).clamp(1, 100)
}

/// The environment and mounts of a client container of `share`.
pub fn client_setup(config: &MpsConfig, share: &Share) -> ContainerSetup {
    let pipe_in_container = Path::new(defaults::MPS_PIPE_IN_CONTAINER);
    let env = |k: &str, v: String| (k.to_owned(), v);
    ContainerSetup {
        envs: vec![
            env("CUDA_MPS_PIPE_DIRECTORY", defaults::MPS_PIPE_IN_CONTAINER.to_owned()),
            env("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", format!("0={}M", share.bytes >> 20)),
            env("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", thread_percentage(share).to_string()),
            env("BALEEN_GPU_MEMORY_LIMIT_BYTES", share.bytes.to_string()),
        ],
        mounts: vec![BindMount {
            host: config.pipe_dir(&share.gpu_uuid),
            container: pipe_in_container.to_path_buf(),
            read_only: false,
        }],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_follow_the_share() {
        let share = Share { gpu_uuid: "GPU-1".into(), units: 4, gpu_units: 22, bytes: 4 << 30 };
        let setup = client_setup(&MpsConfig { root: "/host/mps".into() }, &share);
        let envs: std::collections::BTreeMap<_, _> = setup.envs.into_iter().collect();
        assert_eq!(envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"], "0=4096M");
        assert_eq!(envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"], "18");
        assert_eq!(setup.mounts[0].host, PathBuf::from("/host/mps/GPU-1/pipe"));
        let tiny = Share { units: 1, gpu_units: 1000, ..share };
        assert_eq!(thread_percentage(&tiny), 1, "never 0 %");
    }
}
