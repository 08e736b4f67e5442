//! A fake NVML library for tests, so that the real NVML backend
//! ([`baleen_agent::inventory::nvml::NvmlInventory`]) runs without a GPU.
//!
//! [`FakeNvml::new`] compiles `tests/fake-nvml/fake_nvml.c` with the system C compiler (`cc`, or
//! `$CC`) into a temp dir of its own, writes there the topology file the library reads (converted
//! from an [`Inventory`], usually one the simulated backend loaded from a YAML file) and a sysfs
//! tree with the GPUs' NUMA nodes. Each fake gets its own copy of the library, so tests in one
//! process do not share NVML state and need no environment variables. The file format is
//! described at the top of the C source and in `docs/inventory.md`.

use std::fmt::Write as _;
use std::io::Write as _;
use std::path::{Path, PathBuf};

use anyhow::{Context, ensure};
use baleen_agent::inventory::nvml::NvmlConfig;
use baleen_agent::inventory::{Inventory, MIB, MigProfile, MigState, pci_sysfs_name};

/// The C source of the fake library.
pub const SOURCE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/fake-nvml/fake_nvml.c");
/// The file name the library is built as (what the driver installs).
pub const LIBRARY_NAME: &str = "libnvidia-ml.so.1";
/// The topology file the library reads from its own directory...
pub const TOPOLOGY_FILE: &str = "fake-nvml-topology.txt";
/// ...unless this environment variable names another one.
pub const TOPOLOGY_ENV: &str = "BALEEN_FAKE_NVML_TOPOLOGY";
/// The file of XID events (`xid <gpu index> <xid>` lines) the library reads from its directory...
pub const EVENTS_FILE: &str = "fake-nvml-events.txt";
/// The file of live readings (`telemetry <gpu index> <used bytes> <gpu %> <memory %> <celsius>
/// <milliwatts>` lines) the library reads at every memory, utilisation, temperature or power call.
pub const TELEMETRY_FILE: &str = "fake-nvml-telemetry.txt";
/// The file of compute processes (`process <gpu index> <pid> <bytes>` lines) the library reads
/// at every `nvmlDeviceGetComputeRunningProcesses_v3`.
pub const PROCESSES_FILE: &str = "fake-nvml-processes.txt";
/// ...unless this environment variable names another one.
pub const EVENTS_ENV: &str = "BALEEN_FAKE_NVML_EVENTS";

/// Compiles the fake library to `output` with `$CC` (default `cc`).
pub fn compile(output: &Path) -> anyhow::Result<()> {
    crate::tools::compile_shared_library(SOURCE, output, "the fake NVML library")
}

/// The fake library's topology file for `inventory` (NUMA nodes excepted: they live in sysfs).
pub fn topology_text(inventory: &Inventory) -> anyhow::Result<String> {
    let mut text = String::from("# written by baleen_tests::fake_nvml\n");
    if let Some(version) = &inventory.driver_version {
        ensure!(!version.contains(char::is_whitespace), "driver version `{version}` has spaces");
        writeln!(text, "driver {version}")?;
    }
    for (position, gpu) in inventory.gpus.iter().enumerate() {
        ensure!(
            gpu.index as usize == position,
            "GPU #{position} has index {}; the fake needs indices 0..N-1 in order",
            gpu.index
        );
        ensure!(
            !gpu.name.trim().is_empty() && !gpu.name.contains(['\n', '#']),
            "GPU {} has a name the fake cannot serve: {:?}",
            gpu.index,
            gpu.name
        );
        writeln!(
            text,
            "gpu {} {} {} {} {}",
            gpu.index, gpu.uuid, gpu.memory_bytes, gpu.pci_bus_id, gpu.name
        )?;
        writeln!(text, "mig_mode {} {}", gpu.index, u8::from(gpu.mig.is_enabled()))?;
        if let Some(cc) = &gpu.cuda_compute_capability {
            let (major, minor) =
                cc.split_once('.').context("a compute capability is major.minor")?;
            writeln!(text, "cuda_cc {} {major} {minor}", gpu.index)?;
        }
        if let MigState::Enabled { instances } = &gpu.mig {
            for inst in instances {
                let profile: MigProfile = inst.profile.parse()?;
                writeln!(
                    text,
                    "mig {} {} {} {} {} {} {} {}",
                    gpu.index,
                    inst.uuid,
                    inst.memory_bytes,
                    inst.gpu_instance_id,
                    inst.compute_instance_id,
                    profile.gpu_slices,
                    profile.compute_slices,
                    inst.memory_bytes / MIB
                )?;
            }
        }
    }
    for (a, gpu) in inventory.gpus.iter().enumerate() {
        for peer in &gpu.nvlink_peers {
            let b = inventory
                .gpus
                .iter()
                .position(|other| &other.uuid == peer)
                .with_context(|| format!("GPU {a}'s NVLink peer {peer} is not on the node"))?;
            if a < b {
                writeln!(text, "nvlink {a} {b}")?;
            }
        }
    }
    Ok(text)
}

/// A built fake library with its topology, events file and sysfs tree, in a temp dir that lives
/// as long as this value (drop it after the NVML backend that loaded it).
#[derive(Debug)]
pub struct FakeNvml {
    dir: tempfile::TempDir,
}

impl FakeNvml {
    /// A fake serving `inventory`.
    pub fn new(inventory: &Inventory) -> anyhow::Result<Self> {
        Self::with_directives(inventory, &[])
    }

    /// A fake serving `inventory`, with extra topology lines, e.g.
    /// `fail nvmlDeviceGetP2PStatus * 3` to make a call fail (see the C source).
    pub fn with_directives(inventory: &Inventory, directives: &[&str]) -> anyhow::Result<Self> {
        let dir = tempfile::Builder::new().prefix("baleen-fake-nvml-").tempdir()?;
        compile(&dir.path().join(LIBRARY_NAME))?;
        let mut text = topology_text(inventory)?;
        for directive in directives {
            writeln!(text, "{directive}")?;
        }
        let topology = dir.path().join(TOPOLOGY_FILE);
        std::fs::write(&topology, text)
            .with_context(|| format!("cannot write {}", topology.display()))?;
        for gpu in &inventory.gpus {
            let device =
                dir.path().join("sys/bus/pci/devices").join(pci_sysfs_name(&gpu.pci_bus_id));
            std::fs::create_dir_all(&device)
                .with_context(|| format!("cannot create {}", device.display()))?;
            let numa = gpu.numa_node.map_or_else(|| "-1".to_owned(), |node| node.to_string());
            std::fs::write(device.join("numa_node"), format!("{numa}\n"))?;
        }
        Ok(Self { dir })
    }

    /// The directory holding the library, its files and the sysfs tree.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The built library.
    pub fn library(&self) -> PathBuf {
        self.dir.path().join(LIBRARY_NAME)
    }

    /// The topology file the library reads.
    pub fn topology_file(&self) -> PathBuf {
        self.dir.path().join(TOPOLOGY_FILE)
    }

    /// The root of the fake sysfs tree (`<root>/bus/pci/devices/<bus id>/numa_node`).
    pub fn sysfs_root(&self) -> PathBuf {
        self.dir.path().join("sys")
    }

    /// The NVML backend's configuration for this fake.
    pub fn nvml_config(&self) -> NvmlConfig {
        NvmlConfig { library: Some(self.library()), sysfs_root: self.sysfs_root() }
    }

    /// Replaces the GPUs' live readings: `(gpu index, used bytes, gpu %, memory %, celsius,
    /// milliwatts)`; a GPU not named reports no utilisation, temperature or power.
    pub fn set_telemetry(&self, readings: &[(u32, u64, u32, u32, u32, u32)]) -> anyhow::Result<()> {
        let text: String = readings
            .iter()
            .map(|(g, used, ug, um, c, mw)| format!("telemetry {g} {used} {ug} {um} {c} {mw}\n"))
            .collect();
        let path = self.dir().join(TELEMETRY_FILE);
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, text)?;
        Ok(std::fs::rename(tmp, path)?)
    }

    /// Replaces the GPUs' compute processes the library lists: `(gpu index, pid, bytes used)`.
    pub fn set_processes(&self, processes: &[(u32, u32, u64)]) -> anyhow::Result<()> {
        let text: String =
            processes.iter().map(|(g, p, b)| format!("process {g} {p} {b}\n")).collect();
        let path = self.dir().join(PROCESSES_FILE);
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, text)?;
        Ok(std::fs::rename(tmp, path)?)
    }

    /// Replaces the faults the library applies from its next call on: lines of `fail <function>
    /// <gpu index or *> <nvml return code>` (e.g. 15, GPU_IS_LOST) or `hang <function> <gpu
    /// index or *> <milliseconds>`; none clears them.
    pub fn set_faults(&self, faults: &[&str]) -> anyhow::Result<()> {
        let text: String = faults.iter().map(|f| format!("{f}\n")).collect();
        let path = self.dir().join("fake-nvml-faults.txt");
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, text)?;
        Ok(std::fs::rename(tmp, path)?)
    }

    /// Makes the GPU with this index report `xid` to every event set registered for XIDs.
    pub fn inject_xid(&self, gpu_index: u32, xid: u64) -> anyhow::Result<()> {
        let path = self.dir.path().join(EVENTS_FILE);
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .with_context(|| format!("cannot open {}", path.display()))?;
        // One write of a whole line: the library only consumes lines that end in a newline.
        file.write_all(format!("xid {gpu_index} {xid}\n").as_bytes())
            .with_context(|| format!("cannot append to {}", path.display()))?;
        Ok(())
    }
}
