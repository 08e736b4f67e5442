//! The YAML configuration file's schema (what the node offers): every field optional, unknown
//! fields rejected with their line. Read by [`super::resolve`]; documented in docs/agent.md.

use std::path::PathBuf;

use serde::Deserialize;

/// The YAML configuration file. Every field is optional; see `docs/agent.md`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct FileConfig {
    /// Kubernetes node name.
    pub node_name: Option<String>,
    /// Resource domain.
    pub domain: Option<String>,
    /// Size of one gpu-memory unit, e.g. `1GiB`, `512MiB`.
    pub memory_unit: Option<String>,
    /// Which views to offer.
    #[serde(default)]
    pub resources: ResourcesFile,
    /// How Allocate answers hand out GPUs: `cdi` (default), `volume-mounts`, `envvar`.
    pub device_list_strategy: Option<String>,
    /// Container Device Interface names in Allocate answers.
    #[serde(default)]
    pub cdi: CdiFile,
    /// Where GPUs come from.
    #[serde(default)]
    pub inventory: InventoryFile,
    /// Host paths.
    #[serde(default)]
    pub paths: PathsFile,
    /// Reconciliation with pod-resources.
    #[serde(default)]
    pub reconcile: ReconcileFile,
    /// MPS daemons and the limits of gpu-memory grants.
    #[serde(default)]
    pub mps: MpsFile,
    /// The per-container GPU memory watchdog.
    #[serde(default)]
    pub watchdog: WatchdogFile,
    /// How GPUs marked unhealthy are probed back.
    #[serde(default)]
    pub health: HealthFile,
    /// The Prometheus endpoint.
    #[serde(default)]
    pub metrics: MetricsFile,
    /// Logging.
    #[serde(default)]
    pub log: LogFile,
    /// `annotation:`: the node-state annotation for the scheduler extender.
    #[serde(default)]
    pub annotation: AnnotationFile,
    /// `colocation:`: inference and training classes (cgroups, MPS client priority).
    #[serde(default)]
    pub colocation: ColocationFile,
}

/// `colocation:` in the file.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ColocationFile {
    /// Apply the classes (default: true inside a pod, false outside).
    pub enabled: Option<bool>,
    /// The host's cgroup tree (default `/sys/fs/cgroup`).
    pub cgroup_root: Option<PathBuf>,
    /// The kubelet's cgroup driver: `systemd` (default) or `cgroupfs`.
    pub cgroup_driver: Option<String>,
    /// Where classes come from: `namespace` (default: the namespace's label, set by the
    /// cluster admin) or `pod` (the pod's label, else its QoS class: tenant-set).
    pub class_from: Option<String>,
    /// Class of pods their source says nothing of: `training` (default) or `inference`.
    pub default_class: Option<String>,
    /// CPU weight of Guaranteed inference pods, 1..10000 (cgroup v2 scale; default 1000); they
    /// are capped at their request plus their share of the CPU no pod requested.
    pub inference_cpu_weight: Option<u64>,
    /// Removed: training pods keep the kubelet's weight (a config error naming why).
    pub training_cpu_weight: Option<serde_yaml_ng::Value>,
    /// `memory.low` = the memory request of inference pods (cgroup v2; default true).
    pub protect_inference_memory: Option<bool>,
    /// Cap training pods while inference runs (default true).
    pub cap_training: Option<bool>,
    /// Schedule training pods as SCHED_IDLE (`cpu.idle`) while inference runs (default false:
    /// it gives up their requests under contention; Linux 5.15 and later).
    pub idle_training: Option<bool>,
    /// MPS client priority by class (default true).
    pub mps_priority: Option<bool>,
    /// How long an Allocate waits for its pod to appear, e.g. `1s` (default).
    pub identify_wait: Option<String>,
    /// Time between reconciliations without pod changes, e.g. `30s` (default).
    pub resync: Option<String>,
}

/// `resources:` in the file.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ResourcesFile {
    /// Offer whole GPUs (default true).
    pub gpu: Option<bool>,
    /// Offer gpu-memory units (default true).
    pub gpu_memory: Option<bool>,
    /// Offer MIG instances (default true).
    pub mig: Option<bool>,
    /// NVLink group sizes (default [2, 4, 8]; empty for none).
    pub nvlink_group_sizes: Option<Vec<u32>>,
}

/// `cdi:` in the file.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct CdiFile {
    /// Replaced by `deviceListStrategy` (a problem when set, saying so).
    pub enabled: Option<bool>,
    /// CDI kind (default `nvidia.com/gpu`).
    pub kind: Option<String>,
    /// Where the node's CDI spec files are (default `/etc/cdi` and `/var/run/cdi`).
    pub spec_dirs: Option<Vec<PathBuf>>,
}

/// `inventory:` in the file.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct InventoryFile {
    /// A simulated topology file instead of NVML.
    pub simulated: Option<PathBuf>,
    /// The NVML library.
    pub nvml_library: Option<PathBuf>,
    /// Where sysfs is mounted.
    pub sysfs_root: Option<PathBuf>,
}

/// `paths:` in the file.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct PathsFile {
    /// The kubelet's device-plugin directory.
    pub device_plugin_dir: Option<PathBuf>,
    /// The kubelet's pod-resources socket.
    pub pod_resources_socket: Option<PathBuf>,
    /// The checkpoint directory.
    pub state_dir: Option<PathBuf>,
    /// The MPS pipe root.
    pub mps_root: Option<PathBuf>,
    /// The boot ID file.
    pub boot_id_file: Option<PathBuf>,
    /// The host's `/proc` (default `/proc`).
    pub proc_root: Option<PathBuf>,
    /// The NVIDIA container toolkit's `config.toml`, read to report whether the node refuses
    /// `NVIDIA_VISIBLE_DEVICES` from unprivileged containers.
    pub toolkit_config: Option<PathBuf>,
}

/// `reconcile:` in the file.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ReconcileFile {
    /// Interval, e.g. `30s`.
    pub interval: Option<String>,
    /// How long an allocation the kubelet has never listed is kept, e.g. `10m` (default; at
    /// least `10s`).
    pub grace: Option<String>,
    /// How long a kubelet that (re)appeared may still be syncing its pods, e.g. `5m` (default;
    /// at most `1h`).
    pub kubelet_settle: Option<String>,
}

/// `mps:` in the file.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct MpsFile {
    /// Enforce gpu-memory grants with MPS (default true); false: accounting only.
    pub enabled: Option<bool>,
    /// The control binary (default: `nvidia-cuda-mps-control` on `PATH`).
    pub control_binary: Option<PathBuf>,
    /// Time between probes of each daemon, e.g. `5s` (default).
    pub probe_interval: Option<String>,
    /// How long a probe may take, e.g. `2s` (default).
    pub probe_timeout: Option<String>,
    /// Tell the daemons to quit when the agent stops (default false).
    pub stop_on_exit: Option<bool>,
    /// `proportional` (default), `none`, or a percentage 1..100.
    pub thread_percentage: Option<serde_yaml_ng::Value>,
    /// Who owns the daemons: `agent` (default) or `external`.
    pub daemons: Option<String>,
}

/// `health:` in the file.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct HealthFile {
    /// Time between two probes of an unhealthy GPU, e.g. `10s` (default).
    pub probe_interval: Option<String>,
    /// Good probes in a row that make it healthy again, 1..100 (default 3).
    pub recovery_probes: Option<u32>,
    /// Where MPS serves a GPU's shares, end each probe with a tiny MPS client (a CUDA context
    /// through the GPU's daemon, under a memory limit). Default: true with NVML, false with a
    /// simulated topology (no CUDA there).
    pub mps_client_probe: Option<bool>,
    /// The CUDA driver library the client loads (default `libcuda.so.1`).
    pub cuda_library: Option<PathBuf>,
}

/// `watchdog:` in the file.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct WatchdogFile {
    /// Run it (default: inside a pod; it needs the Kubernetes API).
    pub enabled: Option<bool>,
    /// Time between reads, e.g. `10s` (default).
    pub interval: Option<String>,
    /// `kill` (default) or `log`.
    pub action: Option<String>,
    /// How long a container may stay over its grant before it is killed, and a process of no
    /// grant before it is reported, e.g. `30s` (default).
    pub grace: Option<String>,
}

/// `metrics:` in the file.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct MetricsFile {
    /// Serve `/metrics`, `/healthz`, `/readyz` (default true).
    pub enabled: Option<bool>,
    /// Where, e.g. `0.0.0.0:9477` (default).
    pub address: Option<String>,
    /// Time between telemetry reads, e.g. `10s` (default).
    pub interval: Option<String>,
}

/// `annotation:` in the file.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct AnnotationFile {
    /// Publish the node's GPU state on its Node (default: true inside a pod, false outside).
    pub enabled: Option<bool>,
    /// The least time between two writes, e.g. `1s` (default).
    pub min_interval: Option<String>,
}

/// `log:` in the file.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct LogFile {
    /// `text` or `json`.
    pub format: Option<String>,
    /// A level or a tracing filter, e.g. `info` or `baleen_agent=debug,info`.
    pub level: Option<String>,
}
