//! `baleen-agent inventory`: discovers the node's GPUs and prints them with the resources the
//! agent would advertise for them, as a table (for people) or JSON (for programs).

use std::io::Write;

use clap::{Args, ValueEnum};

use super::CliError;
use crate::config::InventorySource;
use crate::inventory::{GIB, Inventory, MigState};

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
    /// Host directory of the per-GPU MPS pipe directories probed.
    #[arg(long, value_name = "DIR", default_value = crate::defaults::MPS_ROOT)]
    pub mps_root: std::path::PathBuf,
    /// The MPS control binary the probes run.
    #[arg(long, value_name = "PATH", default_value = crate::defaults::MPS_CONTROL_BINARY)]
    pub mps_control_binary: std::path::PathBuf,
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
    use crate::isolation::mps::MpsConfig;
    use crate::isolation::mps::control::{CommandControl, MpsControl as _};
    let config = MpsConfig { root: root.to_path_buf(), ..MpsConfig::default() };
    let control = CommandControl::new(binary.to_path_buf());
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
}

/// The resources `inventory` would be advertised as, with the given domain and unit.
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
    let state = crate::ledger::DeviceLedger::new("inventory", inventory, views)?;
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
pub fn run(args: &InventoryArgs, out: &mut dyn Write) -> Result<(), CliError> {
    let backend = args.source.open()?;
    let inventory = backend.discover()?;
    let resources = resources_of(&inventory, args.domain.as_deref(), args.memory_unit.as_deref())?;
    let shared = crate::ledger::DeviceLedger::new(
        "inventory",
        &inventory,
        crate::ledger::ViewConfig::default(),
    )?
    .shared_gpus();
    let mps = mps_status(&shared, &args.mps_root, &args.mps_control_binary);
    match args.output {
        OutputFormat::Table => {
            out.write_all(render_table(&inventory).as_bytes())?;
            writeln!(out, "\nRESOURCE{:pad$}  DEVICES", "", pad = 40 - 8)?;
            for r in &resources {
                writeln!(out, "{:<40}  {}", r.name, r.devices)?;
            }
            if !mps.is_empty() {
                writeln!(out, "\nMPS DAEMON OF GPU{:pad$}  STATUS", "", pad = 40 - 17)?;
                for m in &mps {
                    let status = match &m.reason {
                        None => "answering".to_owned(),
                        Some(why) => format!("not answering (units not offered): {why}"),
                    };
                    writeln!(out, "{:<40}  {status}", m.gpu)?;
                }
            }
        }
        OutputFormat::Json => {
            #[derive(serde::Serialize)]
            struct Printed<'a> {
                #[serde(flatten)]
                inventory: &'a Inventory,
                resources: &'a [ResourceSummary],
                mps: &'a [MpsStatus],
            }
            serde_json::to_writer_pretty(
                &mut *out,
                &Printed { inventory: &inventory, resources: &resources, mps: &mps },
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
