//! The flags of the agent's run mode (how to run): they win over the file and the environment.
//! The `[default: ...]` of each help text comes from `crate::defaults`, so `--help` cannot drift
//! from what [`super::resolve`] applies.

use std::path::PathBuf;

use clap::Args;

use crate::defaults;

/// Flags of the agent's run mode (they win over the file and the environment).
#[derive(Debug, Clone, Default, Args)]
pub struct RunArgs {
    /// YAML configuration file (see docs/agent.md).
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Kubernetes node name [env: NODE_NAME; default: the host name].
    #[arg(long, value_name = "NAME")]
    pub node_name: Option<String>,
    /// The kubelet's device-plugin directory.
    #[arg(long, value_name = "DIR", help = format!("The kubelet's device-plugin directory [default: {}]", defaults::DEVICE_PLUGIN_DIR))]
    pub device_plugin_dir: Option<PathBuf>,
    /// The kubelet's pod-resources socket.
    #[arg(long, value_name = "PATH", help = format!("The kubelet's pod-resources socket [default: {}]", defaults::POD_RESOURCES_SOCKET))]
    pub pod_resources_socket: Option<PathBuf>,
    /// Directory of the checkpoint.
    #[arg(long, value_name = "DIR", help = format!("Directory of the checkpoint [default: {}]", defaults::STATE_DIR))]
    pub state_dir: Option<PathBuf>,
    /// Host directory of the per-GPU MPS pipe directories.
    #[arg(long, value_name = "DIR", help = format!("Host directory of the per-GPU MPS pipe directories [default: {}]", defaults::MPS_ROOT))]
    pub mps_root: Option<PathBuf>,
    /// How Allocate answers hand out GPUs: cdi, volume-mounts or envvar (insecure).
    #[arg(long, value_name = "STRATEGY", help = format!("How Allocate answers hand out GPUs: cdi, volume-mounts, or envvar (insecure: any pod that sets NVIDIA_VISIBLE_DEVICES sees every GPU unless the toolkit refuses it) [default: {}]", defaults::DEVICE_LIST_STRATEGY))]
    pub device_list_strategy: Option<String>,
    /// Do not enforce gpu-memory grants with MPS: the units are accounting only (for simulated
    /// nodes, which have no GPU to run MPS on; the agent logs a warning and every Allocate
    /// answer says so). Same as `mps.enabled: false` in the file.
    #[arg(long)]
    pub no_mps: bool,
    /// Where the metrics endpoint listens.
    #[arg(long, value_name = "ADDR", help = format!("Where /metrics, /healthz and /readyz listen [default: {}]", defaults::METRICS_ADDRESS))]
    pub metrics_address: Option<String>,
    /// The MPS control binary.
    #[arg(long, value_name = "PATH", help = format!("The MPS control binary, a path or a name on PATH [default: {}]", defaults::MPS_CONTROL_BINARY))]
    pub mps_control_binary: Option<PathBuf>,
    /// The kernel boot ID file.
    #[arg(long, value_name = "FILE", help = format!("The kernel boot ID file [default: {}]", defaults::BOOT_ID_FILE))]
    pub boot_id_file: Option<PathBuf>,
    /// Read GPUs from this simulated topology (YAML) instead of NVML.
    #[arg(long, value_name = "FILE", conflicts_with = "nvml_lib")]
    pub simulated: Option<PathBuf>,
    /// The NVML library.
    #[arg(long, value_name = "PATH", help = format!("The NVML library [default: {}]", defaults::NVML_LIBRARY))]
    pub nvml_lib: Option<PathBuf>,
    /// Resource domain.
    #[arg(long, value_name = "DOMAIN", help = format!("Resource domain [default: {}]", defaults::DOMAIN))]
    pub domain: Option<String>,
    /// Size of one gpu-memory unit.
    #[arg(long, value_name = "SIZE", help = format!("Size of one gpu-memory unit [default: {}]", defaults::MEMORY_UNIT))]
    pub memory_unit: Option<String>,
    /// Log format: text or json.
    #[arg(long, value_name = "FORMAT", help = format!("Log format: text or json [default: {}]", defaults::LOG_FORMAT))]
    pub log_format: Option<String>,
    /// Log level or tracing filter.
    #[arg(long, value_name = "FILTER", help = format!("Log level or tracing filter [default: {}]", defaults::LOG_LEVEL))]
    pub log_level: Option<String>,
}
