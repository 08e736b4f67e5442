//! Every default of the agent, written once: the configuration, the `--help` text, the view
//! configuration and the isolation module read them from here. `tests::no_default_is_written_twice`
//! checks that no other source file of the workspace spells one of these values again (the
//! domain lives in `baleen_k8s::gpu_state`, shared with the extender).

use std::time::Duration;

/// Resource domain of every extended resource.
pub const DOMAIN: &str = baleen_k8s::gpu_state::DEFAULT_DOMAIN;
/// Size of one `gpu-memory` unit, as written in the configuration.
pub const MEMORY_UNIT: &str = "1GiB";
/// Size of one `gpu-memory` unit in bytes ([`MEMORY_UNIT`]).
pub const MEMORY_UNIT_BYTES: u64 = 1 << 30;
/// Smallest `gpu-memory` unit accepted.
pub const MEMORY_UNIT_MIN_BYTES: u64 = 1 << 20;
/// Sizes of the NVLink groups offered.
pub const NVLINK_GROUP_SIZES: [u32; 3] = [2, 4, 8];
/// CDI kind named in Allocate answers under the `cdi` device-list strategy.
pub const CDI_KIND: &str = "nvidia.com/gpu";
/// How Allocate answers hand out GPUs (`crate::isolation::devices::Strategy`).
pub const DEVICE_LIST_STRATEGY: &str = "cdi";
/// Where the node's CDI spec files are (the CDI specification's two directories), mounted at
/// the same paths in the agent's container.
pub const CDI_SPEC_DIRS: [&str; 2] = ["/etc/cdi", "/var/run/cdi"];
/// The NVIDIA container toolkit's configuration, mounted read-only in the agent's container.
pub const TOOLKIT_CONFIG: &str = "/etc/nvidia-container-runtime/config.toml";

/// The kubelet's device-plugin directory (the kubelet's own default, from the API crate).
pub const DEVICE_PLUGIN_DIR: &str = baleen_proto::deviceplugin::v1beta1::DEFAULT_DEVICE_PLUGIN_DIR;
/// The kubelet's pod-resources socket (the kubelet's own default, from the API crate).
pub const POD_RESOURCES_SOCKET: &str = baleen_proto::podresources::v1::DEFAULT_SOCKET;
/// Directory of the checkpoint.
pub const STATE_DIR: &str = "/var/lib/baleen";
/// Host directory holding `<GPU UUID>/pipe` and `<GPU UUID>/log` of each GPU's MPS daemon.
pub const MPS_ROOT: &str = "/run/baleen/mps";
/// Where a gpu-memory container finds its GPU's MPS pipe directory (a fixed path inside the
/// container, not a host path: it is mounted from `<mps root>/<GPU UUID>/pipe`).
pub const MPS_PIPE_IN_CONTAINER: &str = "/run/baleen/mps";
/// The MPS control binary, looked up on `PATH`.
pub const MPS_CONTROL_BINARY: &str = "nvidia-cuda-mps-control";
/// Time between two probes of a GPU's MPS daemon.
pub const MPS_PROBE_INTERVAL: Duration = Duration::from_secs(5);
/// How long one probe (`get_server_list`) may take; the real daemon answered in 3-5 ms.
pub const MPS_PROBE_TIMEOUT: Duration = Duration::from_secs(2);
/// The waits between two starts of a daemon that will not start: 1 s, doubling to a minute.
pub const MPS_RESTART_BACKOFF: (Duration, Duration) =
    (Duration::from_secs(1), Duration::from_secs(60));
/// How long a kubelet that (re)appeared may still be syncing its pods (a kubelet restarted
/// while the API server is unreachable lists only its static pods until it syncs).
pub const RECONCILE_SETTLE: Duration = Duration::from_secs(300);
/// The longest `reconcile.kubeletSettle` accepted.
pub const RECONCILE_SETTLE_MAX: Duration = Duration::from_secs(3600);
/// Time between two probes of a GPU marked unhealthy.
pub const HEALTH_PROBE_INTERVAL: Duration = Duration::from_secs(10);
/// Good probes in a row that give an unhealthy GPU back.
pub const HEALTH_RECOVERY_PROBES: u32 = 3;
/// Time between two reads of the memory watchdog.
pub const WATCHDOG_INTERVAL: Duration = Duration::from_secs(10);
/// How long a container may stay over its grant before the watchdog kills its processes, and
/// how long a process may belong to no grant before it is reported (three rounds: the API's
/// view of a new container and the kubelet's list trail it by a few seconds).
pub const WATCHDOG_GRACE: Duration = Duration::from_secs(30);
/// How many watchdog Events may wait for the API server before more are dropped (and counted).
pub const WATCHDOG_EVENT_QUEUE: usize = 64;
/// Where the host's `/proc` is (the agent runs in the host's PID namespace).
pub const PROC_ROOT: &str = "/proc";
/// Where the metrics endpoint listens.
pub const METRICS_ADDRESS: std::net::SocketAddr =
    std::net::SocketAddr::V4(std::net::SocketAddrV4::new(std::net::Ipv4Addr::UNSPECIFIED, 9477));
/// Where `/healthz` and `/readyz` are served alone for the kubelet's exec probes: the loopback
/// address of the agent's own network namespace.
pub const PROBE_ADDRESS: std::net::SocketAddr =
    std::net::SocketAddr::V4(std::net::SocketAddrV4::new(std::net::Ipv4Addr::LOCALHOST, 9476));
/// Time between two telemetry reads (never on the scrape path).
pub const METRICS_INTERVAL: Duration = Duration::from_secs(10);
/// The least time between two writes of the node-state annotation.
pub const ANNOTATION_MIN_INTERVAL: Duration = Duration::from_secs(1);
/// The node-state annotation's name in the resource domain: `<domain>/gpu-state`.
pub const ANNOTATION_NAME: &str = baleen_k8s::gpu_state::ANNOTATION_NAME;
/// The node-state annotation is written again after this long without a change.
pub const ANNOTATION_REFRESH: Duration = Duration::from_secs(300);
/// The first and the longest wait before calling the API server again after a failed call (the
/// node-state annotation, the node's allocatable CPU).
pub const API_RETRY: (Duration, Duration) = (Duration::from_millis(500), Duration::from_secs(30));
/// Where the host's cgroup tree is (mounted at the same path in the agent's container).
pub const CGROUP_ROOT: &str = "/sys/fs/cgroup";
/// The kubelet's cgroup driver (`systemd`, the kubelet's default since kubeadm 1.22).
pub const CGROUP_DRIVER: &str = "systemd";
/// The class of a pod without the class label that is not Guaranteed.
pub const COLOCATION_DEFAULT_CLASS: &str = "training";
/// CPU weight of Guaranteed inference pods (cgroup v2 scale: 1..10000, the kernel's default
/// 100); they are capped at their request plus their share of the CPU no pod requested.
pub const INFERENCE_CPU_WEIGHT: u64 = 1000;
/// How long an Allocate waits for the API's view to show the pod it is for.
pub const IDENTIFY_WAIT: Duration = Duration::from_secs(1);
/// The longest `colocation.identifyWait` accepted (the kubelet's Allocate has no deadline of
/// its own, and every container of a gpu-memory share may wait this long).
pub const IDENTIFY_WAIT_MAX: Duration = Duration::from_secs(5);
/// Time between two co-location reconciliations when no pod changes (values the kubelet
/// rewrote are found and written again).
pub const COLOCATION_RESYNC: Duration = Duration::from_secs(30);
/// The file in the state directory that keeps what co-location must put back.
pub const COLOCATION_STATE_FILE: &str = "colocation.json";
/// Where the kernel publishes the boot ID.
pub const BOOT_ID_FILE: &str = "/proc/sys/kernel/random/boot_id";
/// Where the kernel publishes the host name (the node name's last fallback).
pub const HOST_NAME_FILE: &str = "/proc/sys/kernel/hostname";
/// The NVML library loaded when none is named.
pub const NVML_LIBRARY: &str = "libnvidia-ml.so.1";
/// The CUDA driver library the MPS client probe loads when none is named.
pub const CUDA_LIBRARY: &str = "libcuda.so.1";
/// Where sysfs is mounted (NVML GPUs' NUMA nodes are read there).
pub const SYSFS_ROOT: &str = "/sys";

/// Time between reconciliations with pod-resources.
pub const RECONCILE_INTERVAL: Duration = Duration::from_secs(30);
/// How long an allocation the kubelet has never listed is kept.
pub const RECONCILE_GRACE: Duration = Duration::from_secs(600);
/// The shortest grace accepted.
pub const RECONCILE_GRACE_MIN: Duration = Duration::from_secs(10);
/// Log format.
pub const LOG_FORMAT: &str = "text";
/// Log level or tracing filter.
pub const LOG_LEVEL: &str = "info";

#[cfg(test)]
mod tests {
    use std::path::{Path, PathBuf};

    use super::*;

    fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
        for entry in std::fs::read_dir(dir).expect("readable source dir").flatten() {
            let path = entry.path();
            if path.is_dir() {
                sources(&path, out);
            } else if path.extension().is_some_and(|e| e == "rs")
                && path.file_name().is_none_or(|n| n != "tests.rs")
            {
                out.push(path);
            }
        }
    }

    /// The part of a source file outside its `#[cfg(test)]` module (tests may spell values;
    /// files named `tests.rs` are left out whole).
    fn shipped(text: &str) -> &str {
        text.split("#[cfg(test)]").next().unwrap_or(text)
    }

    #[test]
    fn no_default_is_written_twice() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let this = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/defaults.rs");
        // The domain's default is the agent's and the extender's: the interface they share
        // holds it, and the agent's default is that one.
        let shared = root.join("scheduler-core/src/gpu_state.rs");
        let mut files = Vec::new();
        for krate in ["agent", "device-plugin", "scheduler-core", "extender"] {
            sources(&root.join(krate).join("src"), &mut files);
        }
        let literals = [
            format!("{DOMAIN:?}"),
            format!("{MEMORY_UNIT:?}"),
            format!("{CDI_KIND:?}"),
            format!("{TOOLKIT_CONFIG:?}"),
            format!("{:?}", CDI_SPEC_DIRS[0]),
            format!("{:?}", CDI_SPEC_DIRS[1]),
            format!("{STATE_DIR:?}"),
            format!("{MPS_ROOT:?}"),
            format!("{BOOT_ID_FILE:?}"),
            format!("{HOST_NAME_FILE:?}"),
            format!("{NVML_LIBRARY:?}"),
            format!("{CUDA_LIBRARY:?}"),
            format!("{MPS_CONTROL_BINARY:?}"),
            format!("{PROC_ROOT:?}"),
            format!("{SYSFS_ROOT:?}"),
            format!("{CGROUP_ROOT:?}"),
            format!("{COLOCATION_STATE_FILE:?}"),
            format!("{DEVICE_PLUGIN_DIR:?}"),
            format!("{POD_RESOURCES_SOCKET:?}"),
        ];
        let mut found = Vec::new();
        let skip = [this.canonicalize().ok(), shared.canonicalize().ok()];
        for file in files.iter().filter(|f| !skip.contains(&f.canonicalize().ok())) {
            let text = std::fs::read_to_string(file).expect("readable source");
            for literal in &literals {
                if shipped(&text).contains(literal.as_str()) {
                    found.push(format!("{} spells {literal}", file.display()));
                }
            }
        }
        assert!(found.is_empty(), "use agent/src/defaults.rs instead:\n{}", found.join("\n"));
    }

    #[test]
    fn the_unit_text_and_bytes_agree() {
        assert_eq!(crate::config::parse_memory_unit(MEMORY_UNIT), Ok(MEMORY_UNIT_BYTES));
    }
}
