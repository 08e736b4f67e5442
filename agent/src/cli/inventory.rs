//! `baleen-agent inventory`: discovers the node's GPUs and prints them with the resources the
//! agent would advertise for them, as a table (for people) or JSON (for programs). It takes the
//! agent's own flags and configuration file and resolves them as the agent does (the node name
//! that seeds simulated UUIDs, the domain, the memory unit, the views, MPS on or off), so that it
//! answers "what will this configuration advertise on this node".

use std::io::Write;

use clap::{Args, ValueEnum};

use super::CliError;
use crate::inventory::{GIB, Inventory, MigState};
use crate::isolation::mps::MpsConfig;

/// Flags of `baleen-agent inventory`: the agent's, and how to print.
#[derive(Debug, Args)]
pub struct InventoryArgs {
    /// The agent's flags (`--config`, `--node-name`, `--simulated`, `--no-mps`, `--domain`,
    /// `--memory-unit`, ...), resolved with the file and the environment as the agent does.
    #[command(flatten)]
    pub agent: crate::config::RunArgs,
    /// Where sysfs is mounted; NVML GPUs' NUMA nodes are read from
    /// DIR/bus/pci/devices/BUS_ID/numa_node [default: the file's inventory.sysfsRoot, or /sys].
    #[arg(long, value_name = "DIR")]
    pub sysfs_root: Option<std::path::PathBuf>,
    /// Output format.
    #[arg(long, value_enum, default_value_t = OutputFormat::Table)]
    pub output: OutputFormat,
}

/// Whether the MPS daemon of a shared GPU answers, and if not, why (its units are not offered
/// while it does not).
#[derive(Debug, Clone, serde::Serialize)]
pub struct MpsStatus {
    /// The GPU.
    pub gpu: String,
    /// Its daemon answered `get_server_list`.
    pub answering: bool,
    /// Why not.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// Probes the MPS daemon of each GPU in `gpus` once.
pub fn mps_status(
    gpus: &[String],
    root: &std::path::Path,
    binary: &std::path::Path,
) -> Vec<MpsStatus> {
    let config = MpsConfig {
        root: root.to_path_buf(),
        control_binary: binary.to_path_buf(),
        ..MpsConfig::default()
    };
    probe_daemons(gpus, &config)
}

/// Probes the MPS daemon of each GPU in `gpus` once, as `config` says (root, binary, timeout).
fn probe_daemons(gpus: &[String], config: &MpsConfig) -> Vec<MpsStatus> {
    use crate::isolation::mps::control::{CommandControl, MpsControl as _};
    let control = CommandControl::new(config.control_binary.clone());
    let probe_all = async {
        let mut out = Vec::new();
        for gpu in gpus {
            let probe = control.probe(&config.dirs(gpu), config.probe_timeout).await;
            out.push(MpsStatus {
                gpu: gpu.clone(),
                answering: probe.is_ok(),
                reason: probe.err().map(|e| e.to_string()),
            });
        }
        out
    };
    match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(runtime) => runtime.block_on(probe_all),
        Err(e) => gpus
            .iter()
            .map(|gpu| MpsStatus {
                gpu: gpu.clone(),
                answering: false,
                reason: Some(format!("cannot run the probe: {e}")),
            })
            .collect(),
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

/// A resource the node would advertise.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ResourceSummary {
    /// The extended resource name.
    pub name: String,
    /// How many devices it advertises.
    pub devices: usize,
    /// How many of them are offered (healthy in ListAndWatch, so counted in the node's
    /// allocatable): a shared GPU's units only while its MPS daemon answers, when MPS is on.
    pub offered: usize,
}

/// The resources `inventory` would be advertised as, with the given domain and unit, every
/// device offered.
pub fn resources_of(
    inventory: &Inventory,
    domain: Option<&str>,
    memory_unit: Option<&str>,
) -> Result<Vec<ResourceSummary>, CliError> {
    let mut views = crate::ledger::ViewConfig::default();
    if let Some(domain) = domain {
        views.domain = domain.to_owned();
    }
    if let Some(unit) = memory_unit {
        views.memory_unit_bytes = crate::config::parse_memory_unit(unit)
            .map_err(|problem| crate::config::ConfigError { problems: vec![problem] })?;
    }
    let ledger = crate::ledger::DeviceLedger::new("inventory", inventory, views)?;
    Ok(summarise(&ledger))
}

fn summarise(ledger: &crate::ledger::DeviceLedger) -> Vec<ResourceSummary> {
    ledger
        .views()
        .iter()
        .map(|v| {
            let devices = ledger.devices(v);
            ResourceSummary {
                name: v.resource_name(&ledger.config().domain),
                devices: devices.len(),
                offered: devices.iter().filter(|d| d.healthy).count(),
            }
        })
        .collect()
}

/// What `inventory` found: the GPUs, what they would be advertised as, and the MPS daemons.
struct Report {
    node: String,
    inventory: Inventory,
    resources: Vec<ResourceSummary>,
    /// MPS on (`None`: off, the units accounting only).
    mps: Option<Vec<MpsStatus>>,
}

/// Resolves the agent's configuration, discovers the GPUs and, with MPS on, probes the daemons
/// of the shared GPUs: a GPU's units are offered only while its daemon answers, as in the agent.
fn report(args: &InventoryArgs) -> Result<Report, CliError> {
    let mut settings =
        crate::config::resolve(&args.agent, &crate::config::Environment::of_process())?;
    if let Some(root) = &args.sysfs_root {
        settings.inventory.sysfs_root = root.clone();
    }
    let inventory = settings.inventory.open()?.discover()?;
    let node = settings.agent.node_name.clone();
    let mut ledger =
        crate::ledger::DeviceLedger::new(&node, &inventory, settings.agent.views.clone())?;
    let mps = settings.agent.mps.enabled.then(|| {
        ledger.require_enforced_shares();
        let status = probe_daemons(&ledger.shared_gpus(), &settings.agent.mps);
        for daemon in status.iter().filter(|d| d.answering) {
            ledger.set_shares_enforced(&daemon.gpu, true);
        }
        status
    });
    Ok(Report { node, resources: summarise(&ledger), inventory, mps })
}

/// `baleen-agent inventory`: discovers the GPUs and prints them.
pub fn run(args: &InventoryArgs, out: &mut dyn Write) -> Result<(), CliError> {
    let report = report(args)?;
    match args.output {
        OutputFormat::Table => out.write_all(render_report(&report).as_bytes())?,
        OutputFormat::Json => {
            #[derive(serde::Serialize)]
            struct Printed<'a> {
                node: &'a str,
                #[serde(flatten)]
                inventory: &'a Inventory,
                resources: &'a [ResourceSummary],
                mps_enabled: bool,
                mps: &'a [MpsStatus],
            }
            serde_json::to_writer_pretty(
                &mut *out,
                &Printed {
                    node: &report.node,
                    inventory: &report.inventory,
                    resources: &report.resources,
                    mps_enabled: report.mps.is_some(),
                    mps: report.mps.as_deref().unwrap_or_default(),
                },
            )?;
            out.write_all(b"\n")?;
        }
    }
    out.flush()?;
    Ok(())
}

/// The table: the GPUs, the resources with how many devices each offers, and the MPS daemons
/// (or that MPS is off).
fn render_report(report: &Report) -> String {
    let mut text = format!("node {}, ", report.node);
    text.push_str(&render_table(&report.inventory));
    text.push_str(&format!("\nRESOURCE{:pad$}  DEVICES  OFFERED\n", "", pad = 40 - 8));
    for r in &report.resources {
        text.push_str(&format!("{:<40}  {:<7}  {}\n", r.name, r.devices, r.offered));
    }
    let shares = report.resources.iter().any(|r| r.name.ends_with("/gpu-memory"));
    match &report.mps {
        None if !shares => {}
        None => text.push_str(
            "\nMPS off (mps.enabled: false, --no-mps): gpu-memory units are offered as accounting only, no limit is enforced\n",
        ),
        Some(daemons) if !daemons.is_empty() => {
            text.push_str(&format!("\nMPS DAEMON OF GPU{:pad$}  STATUS\n", "", pad = 40 - 17));
            for m in daemons {
                let status = match &m.reason {
                    None => "answering".to_owned(),
                    Some(why) => format!("not answering, its units not offered: {why}"),
                };
                text.push_str(&format!("{:<40}  {status}\n", m.gpu));
            }
        }
        Some(_) => {}
    }
    text
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
