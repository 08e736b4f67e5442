//! The agent's configuration: defaults (`crate::defaults`), then a YAML file ([`file`]: what the
//! node offers; unknown fields rejected), then the environment (`NODE_NAME`, set from the
//! downward API in the DaemonSet), then flags ([`RunArgs`]: how to run). [`resolve`] reports
//! every problem at once; the binary exits with code 64 on any of them. Also the flags that
//! choose the GPU inventory backend ([`InventorySource`]), shared by the run mode and
//! `baleen-agent inventory`. Configuration only: the command line and the process bootstrap live
//! in `crate::cli` and `crate::bootstrap`.

use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::Args;

use crate::agent::AgentConfig;
use crate::defaults;
use crate::inventory::nvml::{NvmlConfig, NvmlInventory};
use crate::inventory::simulated::SimulatedInventory;
use crate::inventory::{GpuInventory, InventoryError};
use crate::isolation::devices::{DeviceListConfig, Strategy};
use crate::isolation::mps::{DaemonPlacement, MpsConfig, ThreadPercentage};
use crate::isolation::watchdog::{WatchdogAction, WatchdogConfig};
use crate::ledger::ViewConfig;
use crate::metrics::MetricsConfig;
use crate::quantity::parse_quantity;
use crate::resources::ResponseConfig;

mod file;
mod flags;

pub use file::*;
pub use flags::RunArgs;

/// The flags that choose the GPU inventory backend: NVML (default) or a simulated topology.
#[derive(Debug, Clone, Args)]
pub struct InventorySource {
    /// Read the GPUs from this simulated YAML topology file instead of NVML (see
    /// docs/inventory.md and packaging/examples/).
    #[arg(long, value_name = "FILE", conflicts_with = "nvml_lib")]
    pub simulated: Option<PathBuf>,
    /// The NVML library to load, a path or a name for the dynamic loader.
    #[arg(long, value_name = "PATH", help = format!("The NVML library to load, a path or a name for the dynamic loader [default: {}]", defaults::NVML_LIBRARY))]
    pub nvml_lib: Option<PathBuf>,
    /// Where sysfs is mounted; NVML GPUs' NUMA nodes are read from
    /// DIR/bus/pci/devices/BUS_ID/numa_node.
    #[arg(long, value_name = "DIR", default_value = defaults::SYSFS_ROOT)]
    pub sysfs_root: PathBuf,
    /// Node name that seeds the UUIDs generated for simulated GPUs without one
    /// [default: the topology file's `node`].
    #[arg(long, value_name = "NAME", requires = "simulated")]
    pub node_name: Option<String>,
}

impl InventorySource {
    /// Opens the chosen backend (for NVML: loads and initialises the library).
    pub fn open(&self) -> Result<Box<dyn GpuInventory>, InventoryError> {
        match &self.simulated {
            Some(path) => Ok(Box::new(SimulatedInventory::from_file_for_node(
                path,
                self.node_name.as_deref(),
            )?)),
            None => Ok(Box::new(NvmlInventory::new(NvmlConfig {
                library: self.nvml_lib.clone(),
                sysfs_root: self.sysfs_root.clone(),
            })?)),
        }
    }
}

/// How logs are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

/// Everything the run mode needs, resolved and checked.
#[derive(Debug, Clone)]
pub struct Settings {
    /// The agent's configuration.
    pub agent: AgentConfig,
    /// Where the GPUs come from.
    pub inventory: InventorySource,
    /// Log format.
    pub log_format: LogFormat,
    /// Log filter.
    pub log_level: String,
}

/// Every configuration problem found, each on its own line.
#[derive(Debug, thiserror::Error)]
#[error("invalid configuration:\n  - {}", problems.join("\n  - "))]
pub struct ConfigError {
    /// The problems.
    pub problems: Vec<String>,
}

/// Parses `30s`, `500ms`, `5m`, `1h` (an integer and a unit).
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let split = text.find(|c: char| !c.is_ascii_digit()).unwrap_or(text.len());
    let (digits, unit) = text.split_at(split);
    let n: u64 =
        digits.parse().map_err(|_| format!("{text:?} is not a duration like 30s, 500ms, 5m"))?;
    let seconds = |per: u64| {
        n.checked_mul(per).map(Duration::from_secs).ok_or_else(|| format!("{text:?} is too long"))
    };
    let d = match unit.trim() {
        "ms" => Ok(Duration::from_millis(n)),
        "s" => Ok(Duration::from_secs(n)),
        "m" => seconds(60),
        "h" => seconds(3600),
        other => Err(format!("{text:?}: unknown unit {other:?} (use ms, s, m or h)")),
    }?;
    if d > MAX_DURATION {
        return Err(format!(
            "{text:?} is longer than {} h, the most any setting takes",
            MAX_DURATION.as_secs() / 3600
        ));
    }
    Ok(d)
}

/// The longest duration any setting takes: a timer that far ahead cannot overflow the clock.
pub const MAX_DURATION: Duration = Duration::from_secs(7 * 24 * 3600);

/// What the process environment contributes to the configuration.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Environment {
    /// `$NODE_NAME` (set from the downward API in the DaemonSet).
    pub node_name: Option<String>,
    /// Whether the agent runs in a Kubernetes pod (`$KUBERNETES_SERVICE_HOST` is set): there the
    /// host name is the pod's name, never a fallback for the node name.
    pub in_pod: bool,
}

impl Environment {
    /// The environment of this process.
    pub fn of_process() -> Self {
        Self {
            node_name: std::env::var("NODE_NAME").ok(),
            in_pod: std::env::var_os("KUBERNETES_SERVICE_HOST").is_some(),
        }
    }

    /// Only `$NODE_NAME`, outside a pod (tests).
    pub fn with_node_name(node_name: Option<&str>) -> Self {
        Self { node_name: node_name.map(str::to_owned), in_pod: false }
    }
}

fn host_name() -> Option<String> {
    std::fs::read_to_string(defaults::HOST_NAME_FILE)
        .ok()
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty())
}

/// The GPU memory unit of the `gpu-memory` resource from its text (`1GiB`, `512MiB`, ...): at
/// least 1 MiB, or the problem in words. The one parser of the unit for the agent and for
/// `baleen-agent inventory --memory-unit`.
pub fn parse_memory_unit(text: &str) -> Result<u64, String> {
    match parse_quantity(text) {
        Ok(b) if b >= defaults::MEMORY_UNIT_MIN_BYTES => Ok(b),
        Ok(_) => Err(format!("memory unit {text:?} is below 1MiB")),
        Err(e) => Err(format!("memory unit: {e}")),
    }
}

/// Resolves defaults < file < environment (`env`) < flags.
pub fn resolve(args: &RunArgs, env: &Environment) -> Result<Settings, ConfigError> {
    let file = match &args.config {
        None => FileConfig::default(),
        Some(path) => match read_file(path) {
            Ok(file) => file,
            Err(problem) => return Err(ConfigError { problems: vec![problem] }),
        },
    };
    resolve_with(file, args, env)
}

fn resolve_with(
    file: FileConfig,
    args: &RunArgs,
    env: &Environment,
) -> Result<Settings, ConfigError> {
    let mut problems = Vec::new();

    let node_name = args.node_name.clone().or(env.node_name.clone()).or(file.node_name.clone());
    // Inside a pod the host name is the pod's: every new pod would distrust the checkpoint.
    let node_name = if env.in_pod { node_name } else { node_name.or_else(host_name) };
    let node_name = match node_name {
        Some(name) if !name.trim().is_empty() => name,
        Some(_) => {
            problems.push("the node name is empty: set --node-name, NODE_NAME or nodeName".into());
            String::new()
        }
        None if env.in_pod => {
            problems.push(
                "no node name: in a pod, set NODE_NAME from the downward API (spec.nodeName)"
                    .into(),
            );
            String::new()
        }
        None => {
            problems.push("no node name: set --node-name, NODE_NAME or nodeName".into());
            String::new()
        }
    };

    let domain =
        args.domain.clone().or(file.domain.clone()).unwrap_or_else(|| defaults::DOMAIN.into());
    if let Err(e) = baleen_device_plugin::resource_name::validate(&format!("{domain}/gpu")) {
        problems.push(format!("domain {domain:?} does not make valid resource names: {e}"));
    }

    let unit_text = args
        .memory_unit
        .clone()
        .or(file.memory_unit.clone())
        .unwrap_or_else(|| defaults::MEMORY_UNIT.into());
    let memory_unit_bytes = parse_memory_unit(&unit_text).unwrap_or_else(|problem| {
        problems.push(problem);
        defaults::MEMORY_UNIT_BYTES
    });

    let sizes = file
        .resources
        .nvlink_group_sizes
        .clone()
        .unwrap_or_else(|| defaults::NVLINK_GROUP_SIZES.to_vec());
    for &n in &sizes {
        if !(2..=64).contains(&n) {
            problems.push(format!("NVLink group size {n} is not between 2 and 64"));
        }
    }
    if file.cdi.enabled.is_some() {
        problems.push(
            "cdi.enabled is replaced by deviceListStrategy: cdi (the default), volume-mounts or envvar; remove it".into(),
        );
    }
    let strategy_name = args
        .device_list_strategy
        .clone()
        .or(file.device_list_strategy.clone())
        .unwrap_or_else(|| defaults::DEVICE_LIST_STRATEGY.into());
    let strategy = Strategy::parse(&strategy_name).unwrap_or_else(|| {
        problems.push(format!(
            "deviceListStrategy {strategy_name:?} is none of cdi, volume-mounts, envvar"
        ));
        Strategy::Cdi
    });
    let cdi_kind = file.cdi.kind.clone().unwrap_or_else(|| defaults::CDI_KIND.into());
    let (vendor, class) = cdi_kind.split_once('/').unwrap_or(("", ""));
    if vendor.is_empty() || class.is_empty() || class.contains('/') || cdi_kind.contains('=') {
        problems.push(format!("CDI kind {cdi_kind:?} must look like vendor.com/class"));
    }
    let devices = DeviceListConfig {
        strategy,
        cdi_kind,
        cdi_spec_dirs: file
            .cdi
            .spec_dirs
            .clone()
            .unwrap_or_else(|| defaults::CDI_SPEC_DIRS.iter().map(PathBuf::from).collect()),
        toolkit_config: file
            .paths
            .toolkit_config
            .clone()
            .unwrap_or_else(|| PathBuf::from(defaults::TOOLKIT_CONFIG)),
    };

    let mut duration = |what: &str, text: Option<&String>, default: Duration| match text {
        None => default,
        Some(t) => match parse_duration(t) {
            Ok(d) if !d.is_zero() => d,
            Ok(_) => {
                problems.push(format!("{what} must be above zero"));
                default
            }
            Err(e) => {
                problems.push(format!("{what}: {e}"));
                default
            }
        },
    };
    let reconcile_interval = duration(
        "reconcile interval",
        file.reconcile.interval.as_ref(),
        defaults::RECONCILE_INTERVAL,
    );
    let reconcile_grace =
        duration("reconcile grace", file.reconcile.grace.as_ref(), defaults::RECONCILE_GRACE);
    let reconcile_settle = duration(
        "reconcile kubeletSettle",
        file.reconcile.kubelet_settle.as_ref(),
        defaults::RECONCILE_SETTLE,
    );
    let mps_probe_interval = duration(
        "mps probeInterval",
        file.mps.probe_interval.as_ref(),
        defaults::MPS_PROBE_INTERVAL,
    );
    let mps_probe_timeout =
        duration("mps probeTimeout", file.mps.probe_timeout.as_ref(), defaults::MPS_PROBE_TIMEOUT);
    let metrics_interval =
        duration("metrics interval", file.metrics.interval.as_ref(), defaults::METRICS_INTERVAL);
    let annotation_interval = duration(
        "annotation minInterval",
        file.annotation.min_interval.as_ref(),
        defaults::ANNOTATION_MIN_INTERVAL,
    );
    let watchdog_interval =
        duration("watchdog interval", file.watchdog.interval.as_ref(), defaults::WATCHDOG_INTERVAL);
    let watchdog_grace =
        duration("watchdog grace", file.watchdog.grace.as_ref(), defaults::WATCHDOG_GRACE);
    let health_probe_interval = duration(
        "health probeInterval",
        file.health.probe_interval.as_ref(),
        defaults::HEALTH_PROBE_INTERVAL,
    );

    // As the annotation: inside a pod the API server (the node's pods) is there; outside one,
    // only when asked.
    let watchdog_enabled = file.watchdog.enabled.unwrap_or(env.in_pod);
    let colocation_resync =
        duration("colocation resync", file.colocation.resync.as_ref(), defaults::COLOCATION_RESYNC);
    let identify_wait = match file.colocation.identify_wait.as_ref().map(|t| parse_duration(t)) {
        None => defaults::IDENTIFY_WAIT,
        Some(Ok(d)) if d > defaults::IDENTIFY_WAIT_MAX => {
            problems.push(format!(
                "colocation identifyWait {d:?} is above {:?}: each Allocate of a gpu-memory share may wait this long",
                defaults::IDENTIFY_WAIT_MAX
            ));
            defaults::IDENTIFY_WAIT
        }
        Some(Ok(d)) => d,
        Some(Err(e)) => {
            problems.push(format!("colocation identifyWait: {e}"));
            defaults::IDENTIFY_WAIT
        }
    };
    let recovery_probes = match file.health.recovery_probes {
        None => defaults::HEALTH_RECOVERY_PROBES,
        Some(n @ 1..=100) => n,
        Some(n) => {
            problems.push(format!("health recoveryProbes {n} is not between 1 and 100"));
            defaults::HEALTH_RECOVERY_PROBES
        }
    };
    // The MPS client probe: the agent's own binary as the client, where MPS serves shares.
    let mps_on = !args.no_mps && file.mps.enabled.unwrap_or(true);
    let simulated_gpus = args.simulated.is_some() || file.inventory.simulated.is_some();
    let mps_client = if mps_on && file.health.mps_client_probe.unwrap_or(!simulated_gpus) {
        match std::env::current_exe() {
            Ok(program) => Some(crate::isolation::mps::client_probe::ClientProbe {
                program,
                library: file
                    .health
                    .cuda_library
                    .clone()
                    .unwrap_or_else(|| defaults::CUDA_LIBRARY.into()),
                timeout: crate::isolation::mps::client_probe::PROBE_TIMEOUT,
            }),
            Err(e) => {
                problems.push(format!(
                    "health mpsClientProbe: the agent's own binary (the probe's client) cannot be found: {e}"
                ));
                None
            }
        }
    } else {
        None
    };
    if reconcile_settle > defaults::RECONCILE_SETTLE_MAX {
        problems.push(format!(
            "reconcile kubeletSettle {reconcile_settle:?} is above {:?}: after every kubelet restart, allocations of ended pods would be held this long where the API cannot confirm",
            defaults::RECONCILE_SETTLE_MAX
        ));
    }
    if reconcile_grace < defaults::RECONCILE_GRACE_MIN {
        problems.push(format!(
            "reconcile grace {reconcile_grace:?} is below {:?}: allocations the kubelet has not listed yet would be released",
            defaults::RECONCILE_GRACE_MIN
        ));
    }

    let watchdog_action = match file.watchdog.action.as_deref().unwrap_or("kill") {
        "log" => WatchdogAction::Log,
        "kill" => WatchdogAction::Kill,
        other => {
            problems.push(format!("watchdog action {other:?} is not log or kill"));
            WatchdogAction::Log
        }
    };
    let metrics_address = match args.metrics_address.as_deref().or(file.metrics.address.as_deref())
    {
        None => defaults::METRICS_ADDRESS,
        Some(text) => text.parse().unwrap_or_else(|e| {
            problems.push(format!("metrics address {text:?} is not an IP address and port: {e}"));
            defaults::METRICS_ADDRESS
        }),
    };
    let thread_percentage = match &file.mps.thread_percentage {
        None => ThreadPercentage::Proportional,
        Some(serde_yaml_ng::Value::String(s)) if s == "proportional" => {
            ThreadPercentage::Proportional
        }
        Some(serde_yaml_ng::Value::String(s)) if s == "none" => ThreadPercentage::None,
        Some(serde_yaml_ng::Value::Number(n)) => {
            match n.as_u64().and_then(|n| u8::try_from(n).ok()) {
                Some(p @ 1..=100) => ThreadPercentage::Fixed(p),
                _ => {
                    problems.push(format!("mps threadPercentage {n} is not between 1 and 100"));
                    ThreadPercentage::Proportional
                }
            }
        }
        Some(other) => {
            problems.push(format!(
                "mps threadPercentage {other:?} is not proportional, none or a percentage"
            ));
            ThreadPercentage::Proportional
        }
    };
    let daemons = match file.mps.daemons.as_deref().unwrap_or("agent") {
        "agent" => DaemonPlacement::Agent,
        "external" => DaemonPlacement::External,
        other => {
            problems.push(format!("mps daemons {other:?} is not agent or external"));
            DaemonPlacement::Agent
        }
    };

    let colocation = colocation_config(
        &file.colocation,
        env.in_pod,
        &mut problems,
        identify_wait,
        colocation_resync,
    );

    let log_format = match args
        .log_format
        .as_deref()
        .or(file.log.format.as_deref())
        .unwrap_or(defaults::LOG_FORMAT)
    {
        "text" => LogFormat::Text,
        "json" => LogFormat::Json,
        other => {
            problems.push(format!("log format {other:?} is not text or json"));
            LogFormat::Text
        }
    };
    let log_level = args
        .log_level
        .clone()
        .or(file.log.level.clone())
        .unwrap_or_else(|| defaults::LOG_LEVEL.into());
    if let Err(e) = log_level.parse::<tracing_subscriber::EnvFilter>() {
        problems.push(format!("log level {log_level:?}: {e}"));
    }

    let simulated = args.simulated.clone().or(file.inventory.simulated.clone());
    let nvml_lib = args.nvml_lib.clone().or(file.inventory.nvml_library.clone());
    if simulated.is_some() && nvml_lib.is_some() {
        problems.push("choose either a simulated topology or an NVML library, not both".into());
    }
    if let Some(path) = &simulated
        && !path.is_file()
    {
        problems.push(format!("simulated topology {} does not exist", path.display()));
    }

    let pick = |flag: &Option<PathBuf>, file: &Option<PathBuf>, default: &str| {
        flag.clone().or(file.clone()).unwrap_or_else(|| PathBuf::from(default))
    };
    let proc_root = pick(&None, &file.paths.proc_root, defaults::PROC_ROOT);
    if watchdog_enabled
        && watchdog_action == WatchdogAction::Kill
        && proc_root != Path::new(defaults::PROC_ROOT)
    {
        // PIDs read under another /proc may name other processes in the agent's own namespace.
        problems.push(format!(
            "watchdog action kill (the default) needs the host's /proc at {} (paths.procRoot is {}): the PIDs it kills must be the agent's own namespace's; or set watchdog.action: log",
            defaults::PROC_ROOT,
            proc_root.display()
        ));
    }
    let paths = &file.paths;
    let views_domain = domain.clone();
    let agent = AgentConfig {
        node_name: node_name.clone(),
        device_plugin_dir: pick(
            &args.device_plugin_dir,
            &paths.device_plugin_dir,
            defaults::DEVICE_PLUGIN_DIR,
        ),
        pod_resources_socket: pick(
            &args.pod_resources_socket,
            &paths.pod_resources_socket,
            defaults::POD_RESOURCES_SOCKET,
        ),
        state_dir: pick(&args.state_dir, &paths.state_dir, defaults::STATE_DIR),
        boot_id_file: pick(&args.boot_id_file, &paths.boot_id_file, defaults::BOOT_ID_FILE),
        views: ViewConfig {
            domain,
            memory_unit_bytes,
            whole_gpus: file.resources.gpu.unwrap_or(true),
            gpu_memory: file.resources.gpu_memory.unwrap_or(true),
            mig: file.resources.mig.unwrap_or(true),
            nvlink_group_sizes: sizes,
        },
        responses: ResponseConfig {
            devices,
            mps: MpsConfig {
                enabled: mps_on,
                root: pick(&args.mps_root, &paths.mps_root, defaults::MPS_ROOT),
                control_binary: pick(
                    &args.mps_control_binary,
                    &file.mps.control_binary,
                    defaults::MPS_CONTROL_BINARY,
                ),
                probe_interval: mps_probe_interval,
                probe_timeout: mps_probe_timeout,
                stop_on_exit: file.mps.stop_on_exit.unwrap_or(false),
                thread_percentage,
                daemons,
            },
        },
        health: crate::agent::health::HealthConfig {
            probe_interval: health_probe_interval,
            recovery_probes,
            mps_client,
        },
        watchdog: WatchdogConfig {
            enabled: watchdog_enabled,
            interval: watchdog_interval,
            action: watchdog_action,
            grace: watchdog_grace,
            proc_root: proc_root.clone(),
        },
        metrics: MetricsConfig {
            enabled: file.metrics.enabled.unwrap_or(true),
            address: metrics_address,
            interval: metrics_interval,
        },
        annotation: crate::agent::node_state::AnnotationConfig {
            // Inside a pod the API server is there to write to; outside one, only when asked.
            enabled: file.annotation.enabled.unwrap_or(env.in_pod),
            key: format!("{}/{}", views_domain, defaults::ANNOTATION_NAME),
            min_interval: annotation_interval,
        },
        colocation,
        reconcile_interval,
        reconcile_grace,
        reconcile_settle,
    };
    if !problems.is_empty() {
        return Err(ConfigError { problems });
    }
    let inventory = InventorySource {
        simulated,
        nvml_lib,
        sysfs_root: file
            .inventory
            .sysfs_root
            .clone()
            .unwrap_or_else(|| PathBuf::from(defaults::SYSFS_ROOT)),
        node_name: Some(node_name),
    };
    Ok(Settings { agent, inventory, log_format, log_level })
}

/// `colocation:` of the file, its problems added to `problems`.
fn colocation_config(
    file: &file::ColocationFile,
    in_pod: bool,
    problems: &mut Vec<String>,
    identify_wait: Duration,
    resync: Duration,
) -> crate::agent::colocation::ColocationConfig {
    use crate::isolation::cgroups::Driver;
    use crate::isolation::colocation::{Class, ClassPolicy, ClassSource};
    let driver = match file.cgroup_driver.as_deref().unwrap_or(defaults::CGROUP_DRIVER) {
        "systemd" => Driver::Systemd,
        "cgroupfs" => Driver::Cgroupfs,
        other => {
            problems.push(format!("colocation cgroupDriver {other:?} is not systemd or cgroupfs"));
            Driver::Systemd
        }
    };
    let default_class =
        match file.default_class.as_deref().unwrap_or(defaults::COLOCATION_DEFAULT_CLASS) {
            "training" => Class::Training,
            "inference" => Class::Inference,
            other => {
                problems.push(format!(
                    "colocation defaultClass {other:?} is not training or inference"
                ));
                Class::Training
            }
        };
    if file.training_cpu_weight.is_some() {
        problems.push(
            "colocation trainingCpuWeight is removed: training pods keep the kubelet's weight (their requests), so that no pod is pushed below the CPU it requested; delete the key".to_owned(),
        );
    }
    let class_from = match file.class_from.as_deref().unwrap_or("namespace") {
        "namespace" => ClassSource::Namespace,
        "pod" => ClassSource::Pod,
        other => {
            problems.push(format!("colocation classFrom {other:?} is not namespace or pod"));
            ClassSource::Namespace
        }
    };
    let mut weight = |what: &str, value: Option<u64>, default: u64| match value {
        None => default,
        Some(w @ 1..=10_000) => w,
        Some(w) => {
            problems.push(format!("colocation {what} {w} is not between 1 and 10000"));
            default
        }
    };
    let policy = ClassPolicy {
        class_from,
        default_class,
        inference_weight: weight(
            "inferenceCpuWeight",
            file.inference_cpu_weight,
            defaults::INFERENCE_CPU_WEIGHT,
        ),
        protect_memory: file.protect_inference_memory.unwrap_or(true),
        cap_training: file.cap_training.unwrap_or(true),
        idle_training: file.idle_training.unwrap_or(false),
    };
    crate::agent::colocation::ColocationConfig {
        // As the annotation: inside a pod the API server is there; outside one, only when asked.
        enabled: file.enabled.unwrap_or(in_pod),
        cgroup_root: file
            .cgroup_root
            .clone()
            .unwrap_or_else(|| PathBuf::from(defaults::CGROUP_ROOT)),
        cgroup_driver: driver,
        policy,
        mps_priority: file.mps_priority.unwrap_or(true),
        identify_wait,
        resync,
    }
}

/// The most bytes a configuration file may hold.
const MAX_CONFIG_BYTES: u64 = 1 << 20;

fn read_file(path: &Path) -> Result<FileConfig, String> {
    use crate::files::{Links, read_bounded};
    let cannot = |e: String| format!("cannot read {}: {e}", path.display());
    let bytes = read_bounded(path, MAX_CONFIG_BYTES, Links::Follow)
        .map_err(|e| cannot(e.to_string()))?
        .ok_or_else(|| cannot("no such file".into()))?;
    let text = String::from_utf8(bytes).map_err(|e| cannot(e.to_string()))?;
    parse_file(&text, path)
}

fn parse_file(text: &str, path: &Path) -> Result<FileConfig, String> {
    serde_yaml_ng::from_str(text).map_err(|e| match e.location() {
        Some(l) => format!("{}:{}:{}: {e}", path.display(), l.line(), l.column()),
        None => format!("{}: {e}", path.display()),
    })
}

/// Resolves a configuration file's `text` as [`resolve`] would read it from `origin`, with no
/// flags and `env` (for fuzzing and tools: every problem an error, never a panic).
pub fn resolve_text(text: &str, origin: &Path, env: &Environment) -> Result<Settings, ConfigError> {
    let file =
        parse_file(text, origin).map_err(|problem| ConfigError { problems: vec![problem] })?;
    resolve_with(file, &RunArgs::default(), env)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_then_file_then_env_then_flags() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("agent.yaml");
        std::fs::write(
            &file,
            "nodeName: from-file\nmemoryUnit: 512MiB\ndomain: example.com\nresources:\n  nvlinkGroupSizes: [2]\ndeviceListStrategy: volume-mounts\ncdi:\n  kind: example.com/gpu\n  specDirs: [/host/cdi]\nreconcile:\n  interval: 5s\npaths:\n  stateDir: /tmp/state\n",
        )
        .expect("write");
        let args = RunArgs { config: Some(file.clone()), ..RunArgs::default() };
        let s = resolve(&args, &Environment::default()).expect("valid");
        assert_eq!(s.agent.node_name, "from-file");
        assert_eq!(s.agent.views.memory_unit_bytes, 512 << 20);
        assert_eq!(s.agent.views.domain, "example.com");
        assert_eq!(s.agent.views.nvlink_group_sizes, [2]);
        assert_eq!(s.agent.responses.devices.strategy, Strategy::VolumeMounts);
        assert_eq!(s.agent.responses.devices.cdi_kind, "example.com/gpu");
        assert_eq!(s.agent.responses.devices.cdi_spec_dirs, [PathBuf::from("/host/cdi")]);
        assert_eq!(s.agent.reconcile_interval, Duration::from_secs(5));
        assert_eq!(s.agent.reconcile_grace, Duration::from_secs(600));
        assert_eq!(s.agent.reconcile_settle, Duration::from_secs(300), "the default");
        assert_eq!(s.agent.state_dir, PathBuf::from("/tmp/state"));
        assert_eq!(s.agent.device_plugin_dir, PathBuf::from(defaults::DEVICE_PLUGIN_DIR));
        let s = resolve(&args, &Environment::with_node_name(Some("from-env"))).expect("valid");
        assert_eq!(s.agent.node_name, "from-env");
        let args = RunArgs {
            node_name: Some("from-flag".into()),
            memory_unit: Some("2GiB".into()),
            ..args
        };
        let s = resolve(&args, &Environment::with_node_name(Some("from-env"))).expect("valid");
        assert_eq!(s.agent.node_name, "from-flag");
        assert_eq!(s.agent.views.memory_unit_bytes, 2 << 30);
    }

    #[test]
    fn every_problem_is_reported_at_once() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("agent.yaml");
        std::fs::write(
            &file,
            "domain: Bad_Domain\nmemoryUnit: 12 parsecs\nresources:\n  nvlinkGroupSizes: [1]\nreconcile:\n  interval: soon\nlog:\n  format: xml\n",
        )
        .expect("write");
        let args = RunArgs {
            config: Some(file),
            node_name: Some("n".into()),
            simulated: Some("/nonexistent.yaml".into()),
            ..RunArgs::default()
        };
        let err = resolve(&args, &Environment::default()).expect_err("invalid");
        let text = err.to_string();
        for expected in
            ["domain", "memory unit", "group size 1", "interval", "log format", "/nonexistent.yaml"]
        {
            assert!(text.contains(expected), "missing {expected:?} in:\n{text}");
        }
        assert_eq!(err.problems.len(), 6, "{text}");
    }

    #[test]
    fn the_device_list_strategy_defaults_to_cdi_and_bad_values_are_named() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("agent.yaml");
        let args = RunArgs { config: Some(file.clone()), ..RunArgs::default() };
        std::fs::write(&file, "nodeName: n\n").expect("write");
        let d = resolve(&args, &Environment::default()).expect("valid").agent.responses.devices;
        assert_eq!(d, DeviceListConfig::default());
        assert_eq!(d.strategy, Strategy::Cdi, "secure by default");
        let flag = RunArgs { device_list_strategy: Some("envvar".into()), ..args.clone() };
        let d = resolve(&flag, &Environment::default()).expect("valid").agent.responses.devices;
        assert_eq!(d.strategy, Strategy::Envvar, "an explicit opt-in");
        std::fs::write(
            &file,
            "nodeName: n\ndeviceListStrategy: all\ncdi:\n  enabled: true\n  kind: nvidia.com\n",
        )
        .expect("write");
        let err = resolve(&args, &Environment::default()).expect_err("three problems");
        let text = err.to_string();
        for expected in ["deviceListStrategy \"all\"", "cdi.enabled is replaced", "CDI kind"] {
            assert!(text.contains(expected), "missing {expected:?} in:\n{text}");
        }
        assert_eq!(err.problems.len(), 3, "{text}");
    }

    #[test]
    fn unknown_fields_are_rejected_with_their_line() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("agent.yaml");
        std::fs::write(&file, "nodeName: n\npaths:\n  devicePluginDirectory: /x\n").expect("write");
        let err =
            resolve(&RunArgs { config: Some(file), ..RunArgs::default() }, &Environment::default())
                .expect_err("unknown field");
        let text = err.to_string();
        assert!(text.contains("agent.yaml:3") && text.contains("devicePluginDirectory"), "{text}");
    }

    #[test]
    fn mps_and_watchdog_settings() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("agent.yaml");
        let write = |text: &str| std::fs::write(&file, text).expect("write");
        let args = RunArgs { config: Some(file.clone()), ..RunArgs::default() };
        write(
            "nodeName: n\nmps:\n  probeInterval: 1s\n  stopOnExit: true\n  threadPercentage: 40\n  daemons: external\nwatchdog:\n  interval: 3s\n  grace: 1m\n  action: log\npaths:\n  procRoot: /host/proc\n",
        );
        let s = resolve(&args, &Environment::default()).expect("valid");
        assert_eq!(s.agent.watchdog.grace, Duration::from_secs(60));
        assert!(!s.agent.watchdog.enabled, "off outside a pod unless asked");
        let mps = &s.agent.responses.mps;
        assert!(mps.enabled && mps.stop_on_exit);
        assert_eq!(mps.probe_interval, Duration::from_secs(1));
        assert_eq!(mps.thread_percentage, ThreadPercentage::Fixed(40));
        assert_eq!(mps.daemons, DaemonPlacement::External);
        assert_eq!(s.agent.watchdog.action, WatchdogAction::Log);
        assert_eq!(s.agent.watchdog.interval, Duration::from_secs(3));
        assert_eq!(s.agent.watchdog.proc_root, PathBuf::from("/host/proc"));
        let s = resolve(&RunArgs { no_mps: true, ..args.clone() }, &Environment::default())
            .expect("valid");
        assert!(!s.agent.responses.mps.enabled, "--no-mps wins over the file");
        // Killing by PID (the default action) needs the host's own /proc.
        write("nodeName: n\nwatchdog:\n  enabled: true\npaths:\n  procRoot: /host/proc\n");
        let err = resolve(&args, &Environment::default()).expect_err("kill needs the host /proc");
        assert!(
            err.to_string().contains("watchdog action kill (the default) needs the host's /proc"),
            "{err}"
        );
        write("nodeName: n\nwatchdog:\n  enabled: true\n");
        let s = resolve(&args, &Environment::default()).expect("valid");
        assert_eq!(s.agent.watchdog.action, WatchdogAction::Kill, "the default");
        assert_eq!(s.agent.watchdog.grace, defaults::WATCHDOG_GRACE);
        assert!(s.agent.watchdog.enabled);
        write(
            "nodeName: n\nmps:\n  threadPercentage: 150\n  daemons: host\nwatchdog:\n  action: shout\n",
        );
        let err = resolve(&args, &Environment::default()).expect_err("three problems");
        assert_eq!(err.problems.len(), 3, "{err}");
    }

    #[test]
    fn the_mps_client_probe_is_on_with_nvml_and_mps_only() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("agent.yaml");
        let write = |text: &str| std::fs::write(&file, text).expect("write");
        let args = RunArgs { config: Some(file.clone()), ..RunArgs::default() };
        write("nodeName: n\n");
        let probe = resolve(&args, &Environment::default()).expect("valid").agent.health.mps_client;
        let probe = probe.expect("on with NVML and MPS");
        assert_eq!(probe.library, PathBuf::from(defaults::CUDA_LIBRARY));
        assert_eq!(probe.program, std::env::current_exe().expect("this binary"));
        let off = |args: &RunArgs| {
            resolve(args, &Environment::default()).expect("valid").agent.health.mps_client
        };
        assert_eq!(off(&RunArgs { no_mps: true, ..args.clone() }), None, "no MPS, no client");
        let topology = dir.path().join("topology.yaml");
        std::fs::write(&topology, "gpus: []\n").expect("write");
        let simulated = RunArgs { simulated: Some(topology), ..args.clone() };
        assert_eq!(off(&simulated), None, "no CUDA on a simulated node");
        write(
            "nodeName: n\nhealth:\n  mpsClientProbe: true\n  cudaLibrary: /opt/cuda/libcuda.so.1\n",
        );
        let asked = off(&simulated).expect("asked for");
        assert_eq!(asked.library, PathBuf::from("/opt/cuda/libcuda.so.1"));
        write("nodeName: n\nhealth:\n  mpsClientProbe: false\n");
        assert_eq!(off(&args), None, "turned off");
    }

    #[test]
    fn colocation_settings_defaults_and_bad_values() {
        use crate::isolation::cgroups::Driver;
        use crate::isolation::colocation::{Class, ClassSource};
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("agent.yaml");
        let args = RunArgs { config: Some(file.clone()), ..RunArgs::default() };
        std::fs::write(&file, "nodeName: n\n").expect("write");
        let outside = resolve(&args, &Environment::default()).expect("valid");
        let c = &outside.agent.colocation;
        assert!(!c.enabled, "off outside a pod");
        assert_eq!(c.cgroup_root, PathBuf::from("/sys/fs/cgroup"));
        assert_eq!(c.cgroup_driver, Driver::Systemd);
        assert_eq!(c.policy, crate::isolation::colocation::ClassPolicy::default());
        assert!(c.mps_priority);
        assert_eq!((c.identify_wait, c.resync), (Duration::from_secs(1), Duration::from_secs(30)));
        let inside =
            resolve(&args, &Environment { in_pod: true, ..Environment::default() }).expect("valid");
        assert!(inside.agent.colocation.enabled, "on in a pod");
        std::fs::write(
            &file,
            "nodeName: n\ncolocation:\n  enabled: true\n  cgroupRoot: /host/cgroup\n  cgroupDriver: cgroupfs\n  defaultClass: inference\n  inferenceCpuWeight: 500\n  classFrom: pod\n  protectInferenceMemory: false\n  capTraining: false\n  idleTraining: true\n  mpsPriority: false\n  identifyWait: 0s\n  resync: 5s\n",
        )
        .expect("write");
        let c = resolve(&args, &Environment::default()).expect("valid").agent.colocation;
        assert!(c.enabled && !c.mps_priority);
        assert_eq!(c.cgroup_root, PathBuf::from("/host/cgroup"));
        assert_eq!(c.cgroup_driver, Driver::Cgroupfs);
        assert_eq!(c.policy.default_class, Class::Inference);
        assert_eq!((c.policy.inference_weight, c.policy.class_from), (500, ClassSource::Pod));
        assert!(!c.policy.protect_memory && !c.policy.cap_training && c.policy.idle_training);
        assert_eq!((c.identify_wait, c.resync), (Duration::ZERO, Duration::from_secs(5)));
        std::fs::write(
            &file,
            "nodeName: n\ncolocation:\n  cgroupDriver: docker\n  defaultClass: batch\n  trainingCpuWeight: 10\n  inferenceCpuWeight: 20000\n  resync: 0s\n  identifyWait: soon\n  classFrom: label\n",
        )
        .expect("write");
        let err = resolve(&args, &Environment::default()).expect_err("seven problems");
        assert_eq!(err.problems.len(), 7, "{err}");
        assert!(err.to_string().contains("trainingCpuWeight is removed"), "{err}");
        std::fs::write(&file, "nodeName: n\ncolocation:\n  identifyWait: 10s\n").expect("write");
        let err = resolve(&args, &Environment::default()).expect_err("too long a wait");
        assert!(err.to_string().contains("identifyWait 10s is above 5s"), "{err}");
    }

    #[test]
    fn the_annotation_is_on_in_a_pod_and_off_outside_unless_told() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("agent.yaml");
        let args = RunArgs { config: Some(file.clone()), ..RunArgs::default() };
        std::fs::write(&file, "nodeName: n\n").expect("write");
        let outside = resolve(&args, &Environment::default()).expect("valid");
        assert!(!outside.agent.annotation.enabled);
        let in_pod = Environment { node_name: Some("n".into()), in_pod: true };
        let inside = resolve(&args, &in_pod).expect("valid");
        assert!(inside.agent.annotation.enabled);
        assert_eq!(inside.agent.annotation.key, "awesome-ai-company.com/gpu-state");
        assert_eq!(inside.agent.annotation.min_interval, Duration::from_secs(1));
        std::fs::write(&file, "nodeName: n\ndomain: example.org\nannotation:\n  enabled: false\n  minInterval: 250ms\n")
            .expect("write");
        let told = resolve(&args, &in_pod).expect("valid");
        assert!(!told.agent.annotation.enabled);
        assert_eq!(told.agent.annotation.key, "example.org/gpu-state");
        assert_eq!(told.agent.annotation.min_interval, Duration::from_millis(250));
        std::fs::write(&file, "nodeName: n\nannotation:\n  minInterval: 0s\n").expect("write");
        let err = resolve(&args, &in_pod).expect_err("zero");
        assert!(err.to_string().contains("annotation minInterval must be above zero"), "{err}");
    }

    #[test]
    fn the_node_name_is_never_empty_nor_a_pods_host_name() {
        let args = RunArgs::default();
        let err = resolve(&args, &Environment::with_node_name(Some(""))).expect_err("empty");
        assert!(err.to_string().contains("node name is empty"), "{err}");
        let in_pod = Environment { node_name: None, in_pod: true };
        let err = resolve(&args, &in_pod).expect_err("no fallback in a pod");
        assert!(err.to_string().contains("downward API"), "{err}");
        let in_pod = Environment { node_name: Some("node-7".into()), in_pod: true };
        assert_eq!(resolve(&args, &in_pod).expect("valid").agent.node_name, "node-7");
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert!(parse_duration("2 fortnights").is_err());
        assert!(parse_duration("s").is_err());
        assert!(parse_duration("99999999999999999h").is_err(), "overflow is an error, not a wrap");
        // Issue 22, item 4: accepted, it once panicked at the first change (an instant overflow).
        let err = parse_duration("18446744073709551615s").expect_err("too long");
        assert!(err.contains("longer than 168 h"), "{err}");
        assert_eq!(parse_duration("168h"), Ok(MAX_DURATION));
        assert!(parse_duration("169h").is_err());
    }
}
