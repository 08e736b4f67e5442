//! The agent's configuration: defaults (`crate::defaults`), then a YAML file ([`file`]: what the
//! node offers; unknown fields rejected), then the environment (`NODE_NAME`, set from the
//! downward API in the DaemonSet), then flags ([`RunArgs`]: how to run). [`resolve`] reports
//! every problem at once; the binary exits with code 64 on any of them. The run mode, `mps` and
//! `baleen-agent inventory` all resolve the same flags and file, so that `inventory` describes the
//! agent it is given; [`InventorySource`] is the GPU backend they resolve to. Configuration only: the command line and the process bootstrap live
//! in `crate::cli` and `crate::bootstrap`.

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::defaults;
use crate::inventory::nvml::{NvmlConfig, NvmlInventory};
use crate::inventory::simulated::SimulatedInventory;
use crate::inventory::{GpuInventory, InventoryError};
use crate::quantity::parse_quantity;
use crate::run::AgentConfig;
use crate::yaml::{Problems, Seg};
use sections::Sources;

mod file;
mod flags;
mod sections;

pub use file::*;
pub use flags::RunArgs;

/// The GPU inventory backend resolved from the flags and the file: NVML (default) or a
/// simulated topology.
#[derive(Debug, Clone)]
pub struct InventorySource {
    /// Read the GPUs from this simulated YAML topology file instead of NVML (see
    /// docs/inventory.md and packaging/examples/).
    pub simulated: Option<PathBuf>,
    /// The NVML library to load, a path or a name for the dynamic loader (default
    /// `libnvidia-ml.so.1`).
    pub nvml_lib: Option<PathBuf>,
    /// Where sysfs is mounted; NVML GPUs' NUMA nodes are read from
    /// DIR/bus/pci/devices/BUS_ID/numa_node.
    pub sysfs_root: PathBuf,
    /// The node name that seeds the UUIDs generated for simulated GPUs without one (the
    /// agent's resolved node name; `None`: the topology file's `node`).
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
    /// The kubeconfig whose credentials read the node's pods (`paths.podsKubeconfig`); none:
    /// the agent's own account reads them.
    pub pods_kubeconfig: Option<PathBuf>,
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

/// The GPU memory unit of the `gpu-memory` resource from its text (`1GiB`, `512MiB`, ...): at
/// least 1 MiB, or the problem in words. The one parser of the unit for the agent and for
/// `baleen-agent inventory --memory-unit`.
pub fn parse_memory_unit(text: &str) -> Result<u64, String> {
    match parse_quantity(text) {
        Ok(b) if b >= defaults::MEMORY_UNIT_MIN_BYTES => Ok(b),
        Ok(_) => Err(format!("memoryUnit {text:?} is below 1MiB")),
        Err(e) => Err(format!("memoryUnit {text:?}: {e}")),
    }
}

/// Resolves defaults < file < environment (`env`) < flags.
pub fn resolve(args: &RunArgs, env: &Environment) -> Result<Settings, ConfigError> {
    match &args.config {
        None => resolve_with(None, args, env),
        Some(path) => match read_file(path) {
            Ok(text) => resolve_with(Some((&text, path)), args, env),
            Err(problem) => Err(ConfigError { problems: vec![problem] }),
        },
    }
}

/// Resolves the file `text` read from `path` (none: no file), every section in turn (see
/// `sections`), every problem of them all reported at once with its line.
fn resolve_with(
    text: Option<(&str, &Path)>,
    args: &RunArgs,
    env: &Environment,
) -> Result<Settings, ConfigError> {
    let mut problems = Problems::default();
    let file = match text {
        None => FileConfig::default(),
        Some((text, path)) => match crate::yaml::parse_reporting_unknown(text, &mut problems) {
            Ok(file) => file,
            Err(e) => {
                let problem = match e.location() {
                    Some(l) => format!("{}:{}:{}: {e}", path.display(), l.line(), l.column()),
                    None => format!("{}: {e}", path.display()),
                };
                return Err(ConfigError { problems: vec![problem] });
            }
        },
    };
    if let Some(version) = file.version.filter(|v| *v != FILE_VERSION) {
        problems.add(
            &[Seg::Key("version")],
            format!(
                "version {version} is not one this agent reads: it reads version {FILE_VERSION}"
            ),
        );
    }
    let src = Sources { file: &file, args, env };
    let node_name = sections::node::name(&src, &mut problems);
    let domain = sections::node::domain(&src, &mut problems);
    let views = sections::resources::resolve(&src, domain.clone(), &mut problems);
    let devices = sections::devices::resolve(&src, &mut problems);
    let paths = sections::paths::resolve(&src, &mut problems);
    let reconcile = sections::reconcile::resolve(&src, &mut problems);
    let mps = sections::mps::resolve(&src, paths.mps_root, &mut problems);
    let health = sections::health::resolve(&src, mps.enabled, &mut problems);
    let watchdog = sections::watchdog::resolve(&src, paths.proc_root, &mut problems);
    let metrics = sections::metrics::resolve(&src, &mut problems);
    let annotation = sections::annotation::resolve(&src, &domain, &mut problems);
    let colocation = sections::colocation::resolve(&src, &mut problems);
    let driver = sections::dra::resolve(&src, &domain, &mut problems);
    let (log_format, log_level) = sections::log::resolve(&src, &mut problems);
    let inventory = sections::inventory::resolve(&src, node_name.clone(), &mut problems);
    if !problems.is_empty() {
        let located = problems.located(text.map(|(t, _)| t));
        let shown = |p: &crate::yaml::Located| match (text, p.line, p.column) {
            (Some((_, path)), Some(line), Some(column)) => {
                format!("{}:{line}:{column}: ", path.display())
            }
            _ => String::new(),
        };
        let problems = located.iter().map(|p| format!("{}{}", shown(p), p.message));
        return Err(ConfigError { problems: problems.collect() });
    }
    let agent = AgentConfig {
        node_name,
        device_plugin_dir: paths.device_plugin_dir,
        pod_resources_socket: paths.pod_resources_socket,
        state_dir: paths.state_dir,
        boot_id_file: paths.boot_id_file,
        views,
        devices,
        mps,
        health,
        watchdog,
        metrics,
        annotation,
        colocation,
        reconcile_interval: reconcile.interval,
        reconcile_grace: reconcile.grace,
        reconcile_settle: reconcile.settle,
        driver,
    };
    Ok(Settings { agent, inventory, log_format, log_level, pods_kubeconfig: paths.pods_kubeconfig })
}

/// The most bytes a configuration file may hold.
const MAX_CONFIG_BYTES: u64 = 1 << 20;

fn read_file(path: &Path) -> Result<String, String> {
    use crate::files::{Links, read_bounded};
    let cannot = |e: String| format!("cannot read {}: {e}", path.display());
    let bytes = read_bounded(path, MAX_CONFIG_BYTES, Links::Follow)
        .map_err(|e| cannot(e.to_string()))?
        .ok_or_else(|| cannot("no such file".into()))?;
    String::from_utf8(bytes).map_err(|e| cannot(e.to_string()))
}

/// Resolves a configuration file's `text` as [`resolve`] would read it from `origin`, with no
/// flags and `env` (for fuzzing and tools: every problem an error, never a panic).
pub fn resolve_text(text: &str, origin: &Path, env: &Environment) -> Result<Settings, ConfigError> {
    resolve_with(Some((text, origin)), &RunArgs::default(), env)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::isolation::devices::{DeviceListConfig, Strategy};
    use crate::isolation::mps::{DaemonPlacement, ThreadPercentage};
    use crate::isolation::watchdog::WatchdogAction;

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
        assert_eq!(s.agent.devices.strategy, Strategy::VolumeMounts);
        assert_eq!(s.agent.devices.cdi_kind, "example.com/gpu");
        assert_eq!(s.agent.devices.cdi_spec_dirs, [PathBuf::from("/host/cdi")]);
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
        for expected in [
            "domain",
            "memoryUnit",
            "nvlinkGroupSizes[0] 1",
            "interval",
            "log.format",
            "/nonexistent.yaml",
        ] {
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
        let d = resolve(&args, &Environment::default()).expect("valid").agent.devices;
        assert_eq!(d, DeviceListConfig::default());
        assert_eq!(d.strategy, Strategy::Cdi, "secure by default");
        let flag = RunArgs { device_list_strategy: Some("envvar".into()), ..args.clone() };
        let d = resolve(&flag, &Environment::default()).expect("valid").agent.devices;
        assert_eq!(d.strategy, Strategy::Envvar, "an explicit opt-in");
        std::fs::write(
            &file,
            "nodeName: n\ndeviceListStrategy: all\ncdi:\n  enabled: true\n  kind: nvidia.com\n",
        )
        .expect("write");
        let err = resolve(&args, &Environment::default()).expect_err("three problems");
        let text = err.to_string();
        for expected in ["deviceListStrategy \"all\"", "cdi.enabled is replaced", "cdi.kind"] {
            assert!(text.contains(expected), "missing {expected:?} in:\n{text}");
        }
        assert_eq!(err.problems.len(), 3, "{text}");
    }

    /// Issue 24, item 5: a directory setting that names a file is a configuration error at its
    /// key (exit 64), not a lock failure later.
    #[test]
    fn a_state_or_plugin_directory_that_is_a_file_is_a_problem_at_its_key() {
        let dir = tempfile::tempdir().expect("tempdir");
        let not_a_dir = dir.path().join("a-file");
        std::fs::write(&not_a_dir, "").expect("write");
        let file = dir.path().join("agent.yaml");
        let at = not_a_dir.display();
        std::fs::write(&file, format!("nodeName: n\npaths:\n  stateDir: {at}\n")).expect("write");
        let args = RunArgs { config: Some(file), ..RunArgs::default() };
        let err = resolve(&args, &Environment::default()).expect_err("a file");
        let text = err.to_string();
        assert!(
            text.contains(&format!("agent.yaml:3:3: paths.stateDir {at} is not a directory")),
            "{text}"
        );
        let flag = RunArgs { device_plugin_dir: Some(not_a_dir.clone()), ..args };
        let text = resolve(&flag, &Environment::default()).expect_err("two").to_string();
        assert!(text.contains(&format!("paths.devicePluginDir {at} is not a directory")), "{text}");
    }

    /// Issue 39, item 5: `paths.podsKubeconfig` is taken as given, and a directory there is a
    /// problem at its key (a missing file stops the agent when it makes the client from it).
    #[test]
    fn the_pods_kubeconfig_is_taken_and_a_directory_there_is_a_problem() {
        let dir = tempfile::tempdir().expect("tempdir");
        let kubeconfig = dir.path().join("kubelet.conf");
        std::fs::write(&kubeconfig, "kind: Config\n").expect("write");
        let file = dir.path().join("agent.yaml");
        let write = |at: &Path| {
            std::fs::write(
                &file,
                format!("nodeName: n\npaths:\n  podsKubeconfig: {}\n", at.display()),
            )
            .expect("write");
        };
        let args = RunArgs { config: Some(file.clone()), ..RunArgs::default() };
        write(&kubeconfig);
        let settings = resolve(&args, &Environment::default()).expect("valid");
        assert_eq!(settings.pods_kubeconfig.as_deref(), Some(kubeconfig.as_path()));
        write(dir.path());
        let text = resolve(&args, &Environment::default()).expect_err("a directory").to_string();
        assert!(text.contains("agent.yaml:3:3: paths.podsKubeconfig"), "{text}");
        assert!(text.contains("is not a file"), "{text}");
        std::fs::write(&file, "nodeName: n\n").expect("write");
        let settings = resolve(&args, &Environment::default()).expect("valid");
        assert_eq!(settings.pods_kubeconfig, None, "the agent's own account by default");
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
        assert!(text.contains("agent.yaml:3:3: unknown key paths.devicePluginDirectory"), "{text}");
    }

    /// Issue 23, step 2: every problem of the file at once, each with its line and column (issue 24,
    /// item 5) and named by its key path, in line order;
    /// every unknown key among them; a flag's problem without a line; `version: 1` read.
    #[test]
    fn every_problem_comes_with_its_line_column_and_key_path_and_every_unknown_key_at_once() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("agent.yaml");
        std::fs::write(
            &file,
            "version: 1\nnodeName: n\nmps:\n  probeTimout: 2s\n  threadPercentage: 150\nwatchdgo:\n  action: log\nmetrics:\n  interval: soon\ncolocation:\n  cgroupDriver: yes-please\n",
        )
        .expect("write");
        let args = RunArgs {
            config: Some(file.clone()),
            log_format: Some("xml".into()),
            ..RunArgs::default()
        };
        let err = resolve(&args, &Environment::default()).expect_err("five problems");
        let shown = file.display().to_string();
        let expected = [
            format!("{shown}:4:3: unknown key mps.probeTimout"),
            format!("{shown}:5:3: mps.threadPercentage 150 is not between 1 and 100"),
            format!("{shown}:6:1: unknown key watchdgo"),
            format!(
                "{shown}:9:3: metrics.interval: \"soon\" is not a duration like 30s, 500ms, 5m"
            ),
            format!(
                "{shown}:11:3: colocation.cgroupDriver \"yes-please\" is not systemd or cgroupfs"
            ),
            "log.format \"xml\" is not text or json".to_owned(),
        ];
        assert_eq!(err.problems, expected, "{err}");
        // The same file fixed parses, with its version.
        std::fs::write(&file, "version: 1\nnodeName: n\n").expect("write");
        let fine = RunArgs { config: Some(file.clone()), ..RunArgs::default() };
        assert_eq!(resolve(&fine, &Environment::default()).expect("valid").agent.node_name, "n");
        std::fs::write(&file, "nodeName: n\nversion: 2\n").expect("write");
        let err = resolve(&fine, &Environment::default()).expect_err("a later version");
        assert_eq!(
            err.problems,
            [format!("{shown}:2:1: version 2 is not one this agent reads: it reads version 1")]
        );
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
        let mps = &s.agent.mps;
        assert!(mps.enabled && mps.stop_on_exit);
        assert_eq!(mps.probe_interval, Duration::from_secs(1));
        assert_eq!(mps.thread_percentage, ThreadPercentage::Fixed(40));
        assert_eq!(mps.daemons, DaemonPlacement::External);
        assert_eq!(s.agent.watchdog.action, WatchdogAction::Log);
        assert_eq!(s.agent.watchdog.interval, Duration::from_secs(3));
        assert_eq!(s.agent.watchdog.proc_root, PathBuf::from("/host/proc"));
        let s = resolve(&RunArgs { no_mps: true, ..args.clone() }, &Environment::default())
            .expect("valid");
        assert!(!s.agent.mps.enabled, "--no-mps wins over the file");
        // Killing by PID (the default action) needs the host's own /proc.
        write("nodeName: n\nwatchdog:\n  enabled: true\npaths:\n  procRoot: /host/proc\n");
        let err = resolve(&args, &Environment::default()).expect_err("kill needs the host /proc");
        assert!(
            err.to_string().contains("watchdog.action kill (the default) needs the host's /proc"),
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
        assert!(err.to_string().contains("annotation.minInterval must be above zero"), "{err}");
    }

    #[test]
    fn the_driver_is_device_plugin_unless_told_and_dra_takes_its_defaults_and_checks() {
        use crate::dra::DriverMode;
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("agent.yaml");
        let args = RunArgs { config: Some(file.clone()), ..RunArgs::default() };
        std::fs::write(&file, "nodeName: n\n").expect("write");
        let plain = resolve(&args, &Environment::default()).expect("valid");
        assert_eq!(plain.agent.driver, DriverMode::DevicePlugin);
        std::fs::write(&file, "nodeName: n\ndomain: example.org\ndriver: dra\n").expect("write");
        let dra = resolve(&args, &Environment::default()).expect("valid");
        let DriverMode::Dra(d) = dra.agent.driver else { panic!("driver: dra") };
        assert_eq!(d.driver_name, "gpu.example.org");
        assert_eq!(d.socket(), Path::new("/var/lib/kubelet/plugins/gpu.example.org/dra.sock"));
        assert_eq!(
            d.registration_socket(),
            Path::new("/var/lib/kubelet/plugins_registry/gpu.example.org-reg.sock")
        );
        std::fs::write(
            &file,
            "nodeName: n\ndriver: dra\ndra:\n  driverName: GPU_x\n  cdiDir: run/cdi\n  pluginDirr: /x\n",
        )
        .expect("write");
        let err = resolve(&args, &Environment::default()).expect_err("three problems");
        assert_eq!(err.problems.len(), 3, "{err}");
        assert!(err.to_string().contains("is not a DNS subdomain"), "{err}");
        assert!(err.to_string().contains("dra.cdiDir run/cdi must be an absolute path"), "{err}");
        assert!(err.to_string().contains("pluginDirr"), "{err}");
        std::fs::write(&file, "nodeName: n\ndriver: csi\n").expect("write");
        let err = resolve(&args, &Environment::default()).expect_err("unknown driver");
        assert!(err.to_string().contains("not one of device-plugin (the default), dra"), "{err}");
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
