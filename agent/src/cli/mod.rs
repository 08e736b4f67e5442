//! The `baleen-agent` command line: argument parsing (clap), dispatch to the run mode
//! (`crate::bootstrap`) or a subcommand, and the exit code of each failure, so that `main` only
//! parses, calls [`run`] and exits.
//!
//! Subcommands so far:
//! - `inventory` ([`inventory`]): print the node's GPUs from NVML or from a simulated topology,
//!   and the resources the agent would advertise, as a table or JSON; it takes the agent's flags
//!   and file ([`crate::config::RunArgs`]) and resolves them as the agent does.
//! - `mps` runs only the MPS daemons; `mps-client-probe` (hidden) is the client the agent runs
//!   as a child to probe an unhealthy GPU through its MPS daemon
//!   (`crate::isolation::mps::client_probe`).
//!
//! New subcommands add a variant to [`Command`], an arm to [`run`] and a module here; one that
//! needs the GPUs or the configuration flattens [`crate::config::RunArgs`] and calls
//! [`crate::config::resolve`], so that it sees the node as the agent does.

pub mod inventory;

use std::io::Write;

use clap::{Parser, Subcommand};

use crate::inventory::InventoryError;
pub use inventory::{InventoryArgs, OutputFormat, ResourceSummary, render_table, resources_of};

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
    /// Run only the MPS daemons of the node's shared GPUs (start, probe, restart; left serving at
    /// exit), for a DaemonSet of their own that an agent upgrade does not restart; the agent then
    /// runs with `mps.daemons: external`. Takes the agent's flags and configuration file.
    Mps(crate::config::RunArgs),
    /// The agent's MPS client probe (run by the agent itself as a child, with the environment
    /// it sets: see docs/agent.md, "Health"): creates a CUDA context on the one visible GPU
    /// through its MPS daemon and checks that the daemon's memory limit binds it.
    #[command(name = "mps-client-probe", hide = true)]
    MpsClientProbe {
        /// The CUDA driver library to load.
        #[arg(long, value_name = "PATH")]
        library: std::path::PathBuf,
    },
    /// The kubelet's exec probe: GET a URL of the agent's probe listener (`metrics.probeAddress`,
    /// on the loopback address) from inside its container; exit 0 for a 2xx answer, 1 otherwise.
    Probe {
        /// e.g. `http://127.0.0.1:9476/readyz`.
        url: String,
        /// Time for each of connecting, writing and reading.
        #[arg(long, default_value = "2s", value_parser = crate::config::parse_duration)]
        timeout: std::time::Duration,
    },
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
    /// The configuration is invalid.
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    /// The inventory cannot be offered as resources.
    #[error(transparent)]
    Ledger(#[from] crate::ledger::BuildError),
    /// The agent could not start or failed.
    #[error(transparent)]
    Run(#[from] crate::bootstrap::RunError),
    /// The MPS client probe found the GPU not served through MPS.
    #[error("{0}")]
    MpsClientProbe(String),
    /// The exec probe got no 2xx answer.
    #[error("{0}")]
    Probe(String),
}

impl CliError {
    /// The process exit code for this error: [`EXIT_CONFIG`] for a configuration problem (bad
    /// flags, file or topology), [`EXIT_FAILURE`] otherwise.
    pub fn exit_code(&self) -> u8 {
        match self {
            CliError::Inventory(InventoryError::Topology(_)) | CliError::Config(_) => EXIT_CONFIG,
            CliError::Run(e) if e.is_configuration() => EXIT_CONFIG,
            CliError::Ledger(
                crate::ledger::BuildError::ZeroUnit
                | crate::ledger::BuildError::TooManyUnits { .. },
            ) => EXIT_CONFIG,
            _ => EXIT_FAILURE,
        }
    }
}

/// Runs a parsed command line, writing its output to `out`.
pub fn run(cli: Cli, out: &mut dyn Write) -> Result<(), CliError> {
    match cli.command {
        Some(Command::Inventory(args)) => inventory::run(&args, out),
        Some(Command::Mps(args)) => Ok(crate::bootstrap::run_mps(&args)?),
        Some(Command::MpsClientProbe { library }) => {
            match crate::isolation::mps::client_probe::client(&library) {
                Ok(served) => {
                    writeln!(
                        out,
                        "served through MPS: {} MiB free of {} MiB",
                        served.free_bytes >> 20,
                        served.total_bytes >> 20
                    )?;
                    Ok(())
                }
                Err(why) => Err(CliError::MpsClientProbe(why)),
            }
        }
        Some(Command::Probe { url, timeout }) => match baleen_edge::probe::get(&url, timeout) {
            Ok((status, body)) if (200..300).contains(&status) => {
                writeln!(out, "{status} {}", body.trim_end())?;
                Ok(())
            }
            Ok((status, body)) => Err(CliError::Probe(format!("{status} {}", body.trim_end()))),
            Err(e) => Err(CliError::Probe(e.to_string())),
        },
        None => Ok(crate::bootstrap::run_agent(&cli.run)?),
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use clap::CommandFactory;

    use super::*;
    use crate::inventory::simulated::SimulatedInventory;
    use crate::inventory::{GpuInventory, Inventory};

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
            text.contains("memoryUnit") && text.contains("log.format") && text.contains("domain"),
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
        for default in [
            crate::defaults::DEVICE_PLUGIN_DIR,
            crate::defaults::POD_RESOURCES_SOCKET,
            crate::defaults::STATE_DIR,
            crate::defaults::MPS_ROOT,
            crate::defaults::BOOT_ID_FILE,
            crate::defaults::NVML_LIBRARY,
            crate::defaults::DOMAIN,
            crate::defaults::MEMORY_UNIT,
            crate::defaults::LOG_FORMAT,
            crate::defaults::LOG_LEVEL,
        ] {
            assert!(help.contains(&format!("[default: {default}]")), "--help shows {default}");
        }
    }

    #[test]
    fn a_memory_unit_too_small_for_the_kubelet_exits_64() {
        let file = format!("{EXAMPLES}/h200-8x-nvswitch.yaml");
        let err = run_args(&[
            "baleen-agent",
            "inventory",
            "--simulated",
            &file,
            "--memory-unit",
            "16MiB",
        ])
        .expect_err("72k devices");
        assert_eq!(err.exit_code(), EXIT_CONFIG, "{err}");
        let dir = tempfile::tempdir().expect("tempdir");
        let boot = dir.path().join("boot_id");
        std::fs::write(&boot, "b").expect("write");
        let path = |name: &str| dir.path().join(name).display().to_string();
        let err = run_args(&[
            "baleen-agent",
            "--node-name",
            "n",
            "--simulated",
            &file,
            "--memory-unit",
            "16MiB",
            "--state-dir",
            &path("state"),
            "--boot-id-file",
            &path("boot_id"),
            "--device-plugin-dir",
            &path("dp"),
            "--pod-resources-socket",
            &path("pr.sock"),
        ])
        .expect_err("the run mode refuses it too");
        assert_eq!(err.exit_code(), EXIT_CONFIG, "{err}");
    }

    /// Issue 22, item 4: inputs that were accepted and then crashed the agent are configuration
    /// errors (exit 64) naming the value.
    #[test]
    fn absurd_inputs_exit_64_naming_them() {
        let dir = tempfile::tempdir().expect("tempdir");
        let topology = |name: &str, text: String| {
            let path = dir.path().join(name);
            std::fs::write(&path, text).expect("write");
            path.display().to_string()
        };
        let gpu = |i: usize, extra: &str| {
            format!(
                "  - index: {i}\n    model: NVIDIA A100\n    memory: 81920MiB\n    pci_bus_id: \"0000:{i:02x}:00.0\"\n{extra}"
            )
        };
        let huge_memory = topology(
            "memory.yaml",
            "node: n\ngpus:\n  - index: 0\n    model: NVIDIA H200\n    memory: 18446744073709551615\n    pci_bus_id: \"0000:17:00.0\"\n".into(),
        );
        let many: String = (0..65).map(|i| gpu(i, "")).collect();
        let many_gpus = topology("many.yaml", format!("node: n\ngpus:\n{many}"));
        let mig = gpu(
            0,
            "    mig:\n      mode: enabled\n      instances:\n        - profile: 4294967295g.10gb\n          memory: 10240MiB\n          gpu_instance_id: 1\n          compute_instance_id: 0\n        - profile: 4294967295g.10gb\n          memory: 10240MiB\n          gpu_instance_id: 2\n          compute_instance_id: 0\n",
        );
        let wrapping_mig = topology("mig.yaml", format!("node: n\ngpus:\n{mig}"));
        for (file, says) in [
            (&huge_memory, "more than 16 TiB"),
            (&many_gpus, "65 GPUs, more than the 64"),
            (&wrapping_mig, "GPU slices"),
        ] {
            let err =
                run_args(&["baleen-agent", "inventory", "--simulated", file]).expect_err(file);
            assert_eq!(err.exit_code(), EXIT_CONFIG, "{file}: {err}");
            assert!(crate::error_chain::Chain(&err).to_string().contains(says), "{file}: {err}");
        }
        let config = topology(
            "agent.yaml",
            "nodeName: n\nannotation:\n  minInterval: 18446744073709551615s\n".into(),
        );
        let err = run_args(&["baleen-agent", "--config", &config]).expect_err("the interval");
        assert_eq!(err.exit_code(), EXIT_CONFIG, "{err}");
        assert!(err.to_string().contains("longer than 168 h"), "{err}");
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
        // Seeded by the node name the agent resolves (this host's, here), as the agent seeds.
        let node = crate::config::resolve(
            &crate::config::RunArgs { simulated: Some(file.clone().into()), ..Default::default() },
            &crate::config::Environment::with_node_name(None),
        )
        .expect("resolves")
        .agent
        .node_name;
        let expected = SimulatedInventory::from_file_for_node(Path::new(&file), Some(&node))
            .expect("example loads")
            .discover()
            .expect("simulated discovery");
        assert_eq!(printed, expected);
    }

    #[test]
    fn table_output_has_a_row_per_gpu_and_mig_instance() {
        let file = format!("{EXAMPLES}/a100-4x-mig.yaml");
        let dir = tempfile::tempdir().expect("temp dir");
        let mps_root = dir.path().display().to_string();
        let table =
            run_args(&["baleen-agent", "inventory", "--simulated", &file, "--mps-root", &mps_root])
                .expect("runs");
        let lines: Vec<&str> = table.lines().collect();
        assert!(lines[0].ends_with(", driver 550.127.05, 4 GPUs"), "{table}");
        assert!(lines[1].starts_with("INDEX  UUID"), "{table}");
        // 4 GPUs + 4 MIG instances, a blank line, then the resources: gpu, gpu-memory, three
        // MIG profiles and one NVLink pair (GPUs 0 and 1; 2 and 3 are in MIG mode); then the
        // MPS daemons of the two shared GPUs, none answering here.
        assert_eq!(lines.len(), 2 + 4 + 4 + 1 + 1 + 6 + 1 + 1 + 2, "{table}");
        assert_eq!(lines[10], "", "{table}");
        assert!(lines[11].starts_with("RESOURCE"), "{table}");
        let resources: Vec<Vec<&str>> =
            lines[12..18].iter().map(|l| l.split_whitespace().collect()).collect();
        // The units of the two shared GPUs are not offered: their MPS daemons do not answer.
        assert_eq!(
            resources,
            [
                ["awesome-ai-company.com/gpu", "2", "2"],
                ["awesome-ai-company.com/gpu-memory", "160", "0"],
                ["awesome-ai-company.com/mig-1g.10gb", "2", "2"],
                ["awesome-ai-company.com/mig-3g.40gb", "1", "1"],
                ["awesome-ai-company.com/mig-7g.80gb", "1", "1"],
                ["awesome-ai-company.com/nvlink-group-2", "1", "1"],
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
        assert!(lines[19].starts_with("MPS DAEMON OF GPU"), "{table}");
        assert!(lines[20].starts_with("GPU-3f1c7a52-8d0e-4b6a-9c21-5e7f0a1b2c30"), "{table}");
        assert!(lines[20].contains("not answering, its units not offered"), "{table}");
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
