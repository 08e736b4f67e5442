//! The `baleen-agent` command line: argument parsing (clap) and the subcommands' work, so that
//! `main` only parses, calls [`run`] and turns the result into an exit code.
//!
//! Subcommands so far:
//! - `inventory`: print the node's GPUs from NVML (`--nvml-lib PATH`, default
//!   `libnvidia-ml.so.1`) or from a simulated topology (`--simulated FILE`), as a table or JSON.
//!
//! New subcommands add a variant to [`Command`] and an arm to [`run`]; [`InventorySource`] is the
//! set of flags that choose a GPU backend, to be flattened into any subcommand that needs one.

use std::io::Write;
use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::inventory::nvml::{DEFAULT_SYSFS_ROOT, NvmlConfig, NvmlInventory};
use crate::inventory::simulated::SimulatedInventory;
use crate::inventory::{GIB, GpuInventory, Inventory, InventoryError, MigState};

/// Exit code for configuration errors (a bad topology file, bad flags): `EX_USAGE`.
pub const EXIT_CONFIG: u8 = 64;
/// Exit code for every other failure.
pub const EXIT_FAILURE: u8 = 1;

/// baleen's node agent: shares the node's GPUs with Kubernetes pods.
///
/// Without a subcommand it runs the agent: discovers the GPUs (NVML, or --simulated FILE),
/// restores its allocations (checkpoint, then the kubelet's pod-resources API), and serves every
/// resource (`awesome-ai-company.com/gpu`, `gpu-memory`, `mig-<profile>`, `nvlink-group-<n>`) to the
/// kubelet through the device-plugin API, waiting for the kubelet if it is not there yet.
/// Settings: defaults < --config FILE < environment (NODE_NAME) < flags; see docs/agent.md.
/// Exit codes: 0 after SIGTERM/SIGINT, 64 for configuration errors, 1 for other failures.
#[derive(Debug, Parser)]
#[command(
    name = "baleen-agent",
    version,
    about,
    long_about,
    args_conflicts_with_subcommands = true
)]
pub struct Cli {
    /// What to do instead of running the agent.
    #[command(subcommand)]
    pub command: Option<Command>,
    /// How to run the agent.
    #[command(flatten)]
    pub run: crate::config::RunArgs,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Print the node's GPUs (UUID, model, memory, PCI bus, NUMA node, MIG, NVLink) and the
    /// resources the agent would advertise for them, then exit.
    Inventory(InventoryArgs),
}

/// Flags of `baleen-agent inventory`.
#[derive(Debug, Args)]
pub struct InventoryArgs {
    /// Where the GPUs come from.
    #[command(flatten)]
    pub source: InventorySource,
    /// Output format.
    #[arg(long, value_enum, default_value_t = OutputFormat::Table)]
    pub output: OutputFormat,
    /// Resource domain of the resources listed [default: awesome-ai-company.com].
    #[arg(long, value_name = "DOMAIN")]
    pub domain: Option<String>,
    /// Size of one gpu-memory unit for the resources listed [default: 1GiB].
    #[arg(long, value_name = "SIZE")]
    pub memory_unit: Option<String>,
}

/// The flags that choose the GPU inventory backend: NVML (default) or a simulated topology.
#[derive(Debug, Clone, Args)]
pub struct InventorySource {
    /// Read the GPUs from this simulated YAML topology file instead of NVML (see
    /// docs/inventory.md and packaging/examples/).
    #[arg(long, value_name = "FILE", conflicts_with = "nvml_lib")]
    pub simulated: Option<PathBuf>,
    /// The NVML library to load, a path or a name for the dynamic loader
    /// [default: libnvidia-ml.so.1].
    #[arg(long, value_name = "PATH")]
    pub nvml_lib: Option<PathBuf>,
    /// Where sysfs is mounted; NVML GPUs' NUMA nodes are read from
    /// DIR/bus/pci/devices/BUS_ID/numa_node.
    #[arg(long, value_name = "DIR", default_value = DEFAULT_SYSFS_ROOT)]
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

/// How `inventory` prints.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum OutputFormat {
    /// One line per GPU and per MIG instance, for people.
    Table,
    /// The inventory as JSON, for programs.
    Json,
}

/// Why a command failed.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// The GPU inventory could not be read.
    #[error(transparent)]
    Inventory(#[from] InventoryError),
    /// Writing the output failed.
    #[error("cannot write the output")]
    Output(#[from] std::io::Error),
    /// The inventory could not be turned into JSON.
    #[error("cannot encode the inventory as JSON")]
    Json(#[from] serde_json::Error),
    /// The async runtime cannot start.
    #[error("cannot start the async runtime")]
    Runtime(#[source] std::io::Error),
    /// The configuration is invalid.
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    /// The inventory cannot be offered as resources.
    #[error(transparent)]
    Node(#[from] crate::node::NodeError),
    /// The agent failed.
    #[error(transparent)]
    Agent(#[from] crate::agent::AgentError),
}

impl CliError {
    /// The process exit code for this error: [`EXIT_CONFIG`] for a bad topology file,
    /// [`EXIT_FAILURE`] otherwise.
    pub fn exit_code(&self) -> u8 {
        match self {
            CliError::Inventory(InventoryError::Topology(_)) | CliError::Config(_) => EXIT_CONFIG,
            CliError::Agent(crate::agent::AgentError::Inventory(InventoryError::Topology(_))) => {
                EXIT_CONFIG
            }
            _ => EXIT_FAILURE,
        }
    }
}

/// Runs a parsed command line, writing its output to `out`.
pub fn run(cli: Cli, out: &mut dyn Write) -> Result<(), CliError> {
    match cli.command {
        Some(Command::Inventory(args)) => run_inventory(&args, out),
        None => run_agent(&cli.run),
    }
}

/// Runs the agent until SIGTERM or SIGINT: resolves the configuration (every problem at once),
/// starts logging, opens the inventory and calls [`crate::agent::run`].
pub fn run_agent(args: &crate::config::RunArgs) -> Result<(), CliError> {
    use crate::config::LogFormat;
    let settings = crate::config::resolve(args, std::env::var("NODE_NAME").ok())?;
    let filter = tracing_subscriber::EnvFilter::new(&settings.log_level);
    let subscriber = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    // A second initialisation (tests calling this twice) keeps the first subscriber.
    let _ = match settings.log_format {
        LogFormat::Json => subscriber.json().try_init(),
        LogFormat::Text => subscriber.try_init(),
    };
    let inventory: std::sync::Arc<dyn GpuInventory> =
        std::sync::Arc::from(settings.inventory.open()?);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(CliError::Runtime)?;
    runtime.block_on(async move {
        let shutdown = tokio_util::sync::CancellationToken::new();
        let on_signal = shutdown.clone();
        tokio::spawn(async move {
            let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(e) => {
                    tracing::error!(error = %e, "cannot listen for SIGTERM");
                    return;
                }
            };
            tokio::select! {
                _ = term.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
            tracing::info!("shutting down");
            on_signal.cancel();
        });
        let kubelet = settings.agent.device_plugin_dir.join(baleen_proto::deviceplugin::v1beta1::KUBELET_SOCKET);
        tracing::info!(
            node = settings.agent.node_name,
            kubelet = %kubelet.display(),
            "starting; each resource registers as soon as a kubelet listens there (waiting if none does)"
        );
        crate::agent::run(settings.agent, inventory, shutdown).await
    })?;
    Ok(())
}

/// A resource the node would advertise.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ResourceSummary {
    /// The extended resource name.
    pub name: String,
    /// How many devices it advertises.
    pub devices: usize,
}

/// The resources `inventory` would be advertised as, with the given domain and unit.
pub fn resources_of(
    inventory: &Inventory,
    domain: Option<&str>,
    memory_unit: Option<&str>,
) -> Result<Vec<ResourceSummary>, CliError> {
    let mut views = crate::node::ViewConfig::default();
    if let Some(domain) = domain {
        views.domain = domain.to_owned();
    }
    if let Some(unit) = memory_unit {
        views.memory_unit_bytes = crate::config::parse_memory_unit(unit)
            .map_err(|problem| crate::config::ConfigError { problems: vec![problem] })?;
    }
    let state = crate::node::NodeState::new("inventory", inventory, views)?;
    Ok(state
        .views()
        .iter()
        .map(|v| ResourceSummary {
            name: v.resource_name(&state.config().domain),
            devices: state.devices(v).len(),
        })
        .collect())
}

/// `baleen-agent inventory`: discovers the GPUs and prints them.
pub fn run_inventory(args: &InventoryArgs, out: &mut dyn Write) -> Result<(), CliError> {
    let backend = args.source.open()?;
    let inventory = backend.discover()?;
    let resources = resources_of(&inventory, args.domain.as_deref(), args.memory_unit.as_deref())?;
    match args.output {
        OutputFormat::Table => {
            out.write_all(render_table(&inventory).as_bytes())?;
            writeln!(out, "\nRESOURCE{:pad$}  DEVICES", "", pad = 40 - 8)?;
            for r in &resources {
                writeln!(out, "{:<40}  {}", r.name, r.devices)?;
            }
        }
        OutputFormat::Json => {
            #[derive(serde::Serialize)]
            struct Printed<'a> {
                #[serde(flatten)]
                inventory: &'a Inventory,
                resources: &'a [ResourceSummary],
            }
            serde_json::to_writer_pretty(
                &mut *out,
                &Printed { inventory: &inventory, resources: &resources },
            )?;
            out.write_all(b"\n")?;
        }
    }
    out.flush()?;
    Ok(())
}

/// The inventory as a text table: a summary line, then one row per GPU (index, UUID, name,
/// memory in GiB, PCI bus ID, NUMA node, MIG mode, number of NVLink peers) and one row per MIG
/// instance under its GPU.
pub fn render_table(inventory: &Inventory) -> String {
    let header = ["INDEX", "UUID", "NAME", "MEMORY", "PCI BUS ID", "NUMA", "MIG", "NVLINK PEERS"];
    let mut rows: Vec<[String; 8]> = Vec::new();
    for gpu in &inventory.gpus {
        let mig = match &gpu.mig {
            MigState::Disabled => "off".to_owned(),
            MigState::Enabled { instances } => format!("on ({})", instances.len()),
        };
        rows.push([
            gpu.index.to_string(),
            gpu.uuid.to_string(),
            gpu.name.clone(),
            gib(gpu.memory_bytes),
            gpu.pci_bus_id.clone(),
            gpu.numa_node.map_or_else(|| "-".to_owned(), |node| node.to_string()),
            mig,
            gpu.nvlink_peers.len().to_string(),
        ]);
        for inst in gpu.mig.instances() {
            rows.push([
                String::new(),
                format!("└ {}", inst.uuid),
                format!("MIG {}", inst.profile),
                gib(inst.memory_bytes),
                String::new(),
                String::new(),
                format!("gi {} ci {}", inst.gpu_instance_id, inst.compute_instance_id),
                String::new(),
            ]);
        }
    }
    let mut widths = header.map(|h| h.chars().count());
    for row in &rows {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.chars().count());
        }
    }
    let line = |cells: &[&str]| -> String {
        let padded: Vec<String> =
            cells.iter().zip(widths).map(|(cell, width)| format!("{cell:<width$}")).collect();
        format!("{}\n", padded.join("  ").trim_end())
    };

    let driver = inventory.driver_version.as_deref().unwrap_or("unknown");
    let count = inventory.gpus.len();
    let mut text = format!("driver {driver}, {count} GPU{}\n", if count == 1 { "" } else { "s" });
    text.push_str(&line(&header));
    for row in &rows {
        let cells: Vec<&str> = row.iter().map(String::as_str).collect();
        text.push_str(&line(&cells));
    }
    text
}

fn gib(bytes: u64) -> String {
    format!("{:.1} GiB", bytes as f64 / GIB as f64)
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use clap::CommandFactory;

    use super::*;

    const EXAMPLES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../packaging/examples");

    fn run_args(args: &[&str]) -> Result<String, CliError> {
        let cli = Cli::try_parse_from(args).expect("valid command line");
        let mut out = Vec::new();
        run(cli, &mut out)?;
        Ok(String::from_utf8(out).expect("UTF-8 output"))
    }

    #[test]
    fn the_command_line_is_well_formed() {
        Cli::command().debug_assert();
    }

    #[test]
    fn configuration_errors_exit_64_and_list_every_problem() {
        let err = run_args(&[
            "baleen-agent",
            "--node-name",
            "n",
            "--memory-unit",
            "lots",
            "--log-format",
            "xml",
            "--domain",
            "kubernetes.io",
        ])
        .expect_err("invalid configuration");
        assert_eq!(err.exit_code(), EXIT_CONFIG);
        let text = err.to_string();
        assert!(
            text.contains("memory unit") && text.contains("log format") && text.contains("domain"),
            "{text}"
        );
        let help = Cli::command().render_long_help().to_string();
        for flag in [
            "--config",
            "--node-name",
            "--device-plugin-dir",
            "--pod-resources-socket",
            "--state-dir",
            "--log-format",
            "--log-level",
            "--simulated",
            "--nvml-lib",
        ] {
            assert!(help.contains(flag), "--help documents {flag}");
        }
    }

    #[test]
    fn simulated_and_nvml_lib_exclude_each_other() {
        let parsed = Cli::try_parse_from([
            "baleen-agent",
            "inventory",
            "--simulated",
            "x.yaml",
            "--nvml-lib",
            "/lib/libnvidia-ml.so.1",
        ]);
        assert!(parsed.is_err());
    }

    #[test]
    fn inventory_refuses_a_memory_unit_the_agent_refuses() {
        let file = format!("{EXAMPLES}/l4-4x-pcie.yaml");
        let err = run_args(&[
            "baleen-agent",
            "inventory",
            "--simulated",
            &file,
            "--memory-unit",
            "512KiB",
        ])
        .expect_err("below 1MiB");
        assert_eq!(err.exit_code(), EXIT_CONFIG);
        assert!(err.to_string().contains("below 1MiB"), "{err}");
        let ok =
            run_args(&["baleen-agent", "inventory", "--simulated", &file, "--memory-unit", "4MiB"]);
        assert!(ok.is_ok(), "{ok:?}");
    }

    #[test]
    fn json_output_is_the_inventory() {
        let file = format!("{EXAMPLES}/a100-4x-mig.yaml");
        let json =
            run_args(&["baleen-agent", "inventory", "--simulated", &file, "--output", "json"])
                .expect("runs");
        let printed: Inventory = serde_json::from_str(&json).expect("JSON inventory");
        let expected = SimulatedInventory::from_file(Path::new(&file))
            .expect("example loads")
            .discover()
            .expect("simulated discovery");
        assert_eq!(printed, expected);
    }

    #[test]
    fn table_output_has_a_row_per_gpu_and_mig_instance() {
        let file = format!("{EXAMPLES}/a100-4x-mig.yaml");
        let table = run_args(&["baleen-agent", "inventory", "--simulated", &file]).expect("runs");
        let lines: Vec<&str> = table.lines().collect();
        assert_eq!(lines[0], "driver 550.127.05, 4 GPUs");
        assert!(lines[1].starts_with("INDEX  UUID"), "{table}");
        // 4 GPUs + 4 MIG instances, a blank line, then the resources: gpu, gpu-memory, three
        // MIG profiles and one NVLink pair (GPUs 0 and 1; 2 and 3 are in MIG mode).
        assert_eq!(lines.len(), 2 + 4 + 4 + 1 + 1 + 6, "{table}");
        assert_eq!(lines[10], "", "{table}");
        assert!(lines[11].starts_with("RESOURCE"), "{table}");
        let resources: Vec<(&str, &str)> = lines[12..]
            .iter()
            .filter_map(|l| l.split_once(char::is_whitespace))
            .map(|(name, count)| (name, count.trim()))
            .collect();
        assert_eq!(
            resources,
            [
                ("awesome-ai-company.com/gpu", "2"),
                ("awesome-ai-company.com/gpu-memory", "160"),
                ("awesome-ai-company.com/mig-1g.10gb", "2"),
                ("awesome-ai-company.com/mig-3g.40gb", "1"),
                ("awesome-ai-company.com/mig-7g.80gb", "1"),
                ("awesome-ai-company.com/nvlink-group-2", "1"),
            ],
            "{table}"
        );
        assert!(lines[2].starts_with("0      GPU-3f1c7a52-8d0e-4b6a-9c21-5e7f0a1b2c30"), "{table}");
        assert!(lines[2].contains("80.0 GiB  00000000:01:00.0  0     off"), "{table}");
        assert!(lines[2].ends_with(" 3"), "three NVLink peers: {table}");
        assert!(lines[4].contains("on (3)"), "{table}");
        assert!(lines[5].contains("└ MIG-6a0d4e1b-2c3f-5a7e-8b9d-0f1e2d3c4b50"), "{table}");
        assert!(lines[5].contains("MIG 3g.40gb"), "{table}");
        assert!(lines[5].contains("39.2 GiB"), "{table}");
        assert!(lines[5].ends_with("gi 2 ci 0"), "{table}");
    }

    #[test]
    fn a_bad_topology_exits_64_and_a_missing_nvml_exits_1() {
        let dir = tempfile::tempdir().expect("temp dir");
        let bad = dir.path().join("bad.yaml");
        std::fs::write(&bad, "gpus: 3\n").expect("write file");
        let bad = bad.to_str().expect("UTF-8 path");
        let err = run_args(&["baleen-agent", "inventory", "--simulated", bad]).expect_err("bad");
        assert_eq!(err.exit_code(), EXIT_CONFIG);
        assert!(err.to_string().starts_with(&format!("{bad}:1:")), "{err}");

        let missing = dir.path().join("libnvidia-ml.so.1");
        let missing = missing.to_str().expect("UTF-8 path");
        let err =
            run_args(&["baleen-agent", "inventory", "--nvml-lib", missing]).expect_err("none");
        assert_eq!(err.exit_code(), EXIT_FAILURE);
        assert!(err.to_string().contains(missing), "{err}");
    }
}
