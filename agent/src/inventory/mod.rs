//! The node's GPU inventory: what GPUs there are, how they are connected, how they are split into
//! MIG instances, and whether they report errors.
//!
//! This module owns the domain types ([`Inventory`], [`Gpu`], [`MigState`]: in `model`, with the
//! UUID and PCI types; [`HealthEvent`], telemetry and errors here) and the [`GpuInventory`]
//! trait that the rest of the agent (the ledger, the resource views, health) calls, with
//! [`read_off_thread`] for the callers that must not wait on a hung NVML call. Two backends
//! implement it:
//!
//! - [`nvml::NvmlInventory`]: the real one, through NVML (`libnvidia-ml.so.1`); the only module
//!   of the project that names `nvml_wrapper`;
//! - [`simulated::SimulatedInventory`]: a YAML topology file, for development and tests on machines
//!   without a GPU (format in `docs/inventory.md`, examples in `packaging/examples/`).
//!
//! The trait is synchronous: NVML calls block, so an async caller runs them with
//! `tokio::task::spawn_blocking` (or on a thread of its own for the health watch).
//!
//! ```
//! use baleen_agent::inventory::{GpuInventory, MigState, simulated::SimulatedInventory};
//!
//! let yaml = r#"
//! node: example
//! gpus:
//!   - index: 0
//!     model: NVIDIA L4
//!     memory: 23034MiB
//!     pci_bus_id: "0000:3b:00.0"
//!     numa_node: 0
//! "#;
//! let backend = SimulatedInventory::from_yaml_str(yaml, "inline.yaml")?;
//! let inventory = backend.discover()?;
//! assert_eq!(inventory.gpus[0].memory_bytes, 23034 * 1024 * 1024);
//! assert_eq!(inventory.gpus[0].pci_bus_id, "00000000:3B:00.0");
//! assert_eq!(inventory.gpus[0].mig, MigState::Disabled);
//! # Ok::<(), baleen_agent::inventory::InventoryError>(())
//! ```

mod model;
pub mod nvml;
pub mod simulated;

use std::time::Duration;

use serde::{Deserialize, Serialize};

pub use model::*;
pub use simulated::{TopologyError, TopologyProblem};

/// One mebibyte, the unit NVML uses for MIG memory sizes.
pub const MIB: u64 = 1024 * 1024;
/// One gibibyte.
pub const GIB: u64 = 1024 * MIB;

/// A boxed error from a layer below (NVML, the file system), kept as the `source` of an
/// [`InventoryError`] so that no vendor type appears in this module's API.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Runs the blocking `read` (NVML calls) on a blocking thread and waits for it: says once, at
/// WARN, that `what` does not answer once `hang` has passed (NVML stuck on a lost GPU), and
/// stops waiting at `shutdown` (`None`; the thread is left to finish). The caller starts no
/// second read behind a hung one, so hung threads never pile up.
pub async fn read_off_thread<T: Send + 'static>(
    what: &'static str,
    hang: std::time::Duration,
    shutdown: &tokio_util::sync::CancellationToken,
    read: impl FnOnce() -> T + Send + 'static,
) -> Option<Result<T, tokio::task::JoinError>> {
    let mut handle = tokio::task::spawn_blocking(read);
    let mut warned = false;
    let outcome = loop {
        tokio::select! {
            () = shutdown.cancelled() => return None,
            outcome = &mut handle => break outcome,
            () = tokio::time::sleep(hang), if !warned => {
                tracing::warn!(read = what, waited_s = hang.as_secs(), "an NVML read does not answer; waited for, and nothing else waits on it");
                warned = true;
            }
        }
    };
    if warned {
        tracing::info!(read = what, "the NVML read answers again");
    }
    Some(outcome)
}

/// XIDs that NVIDIA's device plugin treats as application errors: the application faulted, the
/// GPU is fine (13 graphics engine exception, 31 GPU memory page fault, 43 GPU stopped
/// processing, 45 preemptive cleanup, 68 video processor exception, 109 context switch timeout).
pub const APPLICATION_XIDS: [u64; 6] = [13, 31, 43, 45, 68, 109];

/// Whether an XID means the GPU itself is in trouble (everything but [`APPLICATION_XIDS`]).
pub fn is_critical_xid(xid: u64) -> bool {
    !APPLICATION_XIDS.contains(&xid)
}

/// An error a GPU reported (an NVML critical XID event).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HealthEvent {
    /// The GPU that reported it.
    pub gpu: GpuUuid,
    /// The XID number (999 when NVML could not tell which).
    pub xid: u64,
    /// Whether it marks the GPU unhealthy ([`is_critical_xid`]).
    pub critical: bool,
}

impl HealthEvent {
    /// An event for `xid` on `gpu`, classified with [`is_critical_xid`].
    pub fn from_xid(gpu: GpuUuid, xid: u64) -> Self {
        Self { gpu, xid, critical: is_critical_xid(xid) }
    }
}

/// A source of GPU inventory: NVML, or a simulated topology.
///
/// Methods block (NVML calls do); call them from `spawn_blocking` or a dedicated thread.
pub trait GpuInventory: Send + Sync {
    /// Reads the node's GPUs now.
    fn discover(&self) -> Result<Inventory, InventoryError>;

    /// Starts watching the GPUs for health events. The watcher borrows the backend; run it on a
    /// thread of its own and call [`HealthWatcher::next_event`] in a loop, checking for shutdown
    /// between calls.
    fn health_watcher(&self) -> Result<Box<dyn HealthWatcher + '_>, InventoryError>;

    /// The compute processes running on the GPUs now, with the GPU memory each uses (NVML's
    /// `nvmlDeviceGetComputeRunningProcesses`: under MPS, each client process with its own
    /// memory, and the MPS server).
    fn processes(&self) -> Result<Vec<GpuProcess>, InventoryError>;

    /// Every GPU's live readings now (memory used, utilisation, temperature, power); a reading
    /// the GPU does not support is `None`.
    fn telemetry(&self) -> Result<Vec<GpuTelemetry>, InventoryError>;

    /// Whether the GPU `gpu` answers now: found by its UUID and its memory read (the health
    /// watch's re-probe of a GPU it marked unhealthy). A simulated GPU always answers.
    fn probe(&self, _gpu: &GpuUuid) -> Result<(), InventoryError> {
        Ok(())
    }
}

/// One GPU's live readings.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GpuTelemetry {
    /// The GPU.
    pub gpu: Option<GpuUuid>,
    /// Memory in use, bytes.
    pub memory_used_bytes: Option<u64>,
    /// Share of the last sample period a kernel ran, 0 to 1.
    pub gpu_utilisation: Option<f64>,
    /// Share of the last sample period memory was read or written, 0 to 1.
    pub memory_utilisation: Option<f64>,
    /// Temperature of the GPU die, degrees Celsius.
    pub temperature_celsius: Option<u32>,
    /// Power draw, watts.
    pub power_watts: Option<f64>,
}

/// One compute process on a GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuProcess {
    /// The GPU.
    pub gpu: GpuUuid,
    /// The process ID, in the host's PID namespace.
    pub pid: u32,
    /// GPU memory used, in bytes, if the driver says.
    pub used_bytes: Option<u64>,
}

/// A live subscription to GPU health events, from [`GpuInventory::health_watcher`].
pub trait HealthWatcher: Send {
    /// GPUs that cannot report health events (e.g. NVML says events are not supported on them);
    /// the caller decides how to treat them.
    fn unwatched(&self) -> &[GpuUuid];

    /// Waits up to `timeout` for the next event. `Ok(None)` means none came in time (it may
    /// return early, e.g. when NVML delivered an event of another kind).
    fn next_event(&mut self, timeout: Duration) -> Result<Option<HealthEvent>, InventoryError>;
}

/// Why the inventory could not be read.
///
/// Each backend's failures are its own error type, wrapped here: the NVML backend's
/// ([`nvml::NvmlInventoryError`]) and the simulated backend's ([`simulated::TopologyError`]).
#[derive(Debug, thiserror::Error)]
pub enum InventoryError {
    /// The NVML backend failed.
    #[error(transparent)]
    Nvml(#[from] nvml::NvmlInventoryError),
    /// The simulated topology file is unreadable or invalid; the CLI exits with code 64 on it.
    #[error(transparent)]
    Topology(#[from] TopologyError),
    /// A read could not even be made (a probe's thread that ended without answering).
    #[error("{reason}")]
    Unavailable {
        /// What happened.
        reason: String,
    },
}

impl InventoryError {
    /// The NVML function that failed or returned an unusable value, if this is such an error.
    pub fn nvml_call(&self) -> Option<&'static str> {
        match self {
            Self::Nvml(
                nvml::NvmlInventoryError::Call { call, .. }
                | nvml::NvmlInventoryError::Value { call, .. },
            ) => Some(call),
            _ => None,
        }
    }
}

/// NVML calls that failed while the agent ran (telemetry, the memory watchdog, the health watch),
/// counted per NVML function for the metrics endpoint.
#[derive(Debug, Default)]
pub struct CallFailures(std::sync::Mutex<std::collections::BTreeMap<&'static str, u64>>);

impl CallFailures {
    /// Counts `err` if an NVML call caused it.
    pub fn record(&self, err: &InventoryError) {
        if let Some(call) = err.nvml_call() {
            let mut counts = self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            *counts.entry(call).or_insert(0) += 1;
        }
    }

    /// The counts so far, per NVML function.
    pub fn counts(&self) -> std::collections::BTreeMap<&'static str, u64> {
        self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uuids_need_their_prefix() {
        assert!(GpuUuid::new("GPU-5a6c8d6e-2f59-4f7b-9a1e-0c2d4b6f8a10").is_ok());
        assert!(MigUuid::new("MIG-0b1f6a4e-1111-2222-3333-444455556666").is_ok());
        let err = GpuUuid::new("MIG-0b1f").expect_err("a MIG UUID is not a GPU UUID");
        assert_eq!(err.prefix, "GPU-");
        assert!(GpuUuid::new("GPU-").is_err());
        assert!(GpuUuid::new("GPU-has space").is_err());
        assert!(MigUuid::new("GPU-0b1f").is_err());
        let parsed: GpuUuid =
            serde_json::from_str("\"GPU-abc\"").expect("a valid UUID deserialises");
        assert_eq!(parsed.as_str(), "GPU-abc");
        assert!(serde_json::from_str::<GpuUuid>("\"abc\"").is_err());
    }

    #[test]
    fn pci_bus_ids_are_normalised_like_nvml() {
        assert_eq!(normalize_pci_bus_id("0000:3b:00.0").as_deref(), Ok("00000000:3B:00.0"));
        assert_eq!(normalize_pci_bus_id("00000000:19:00.0").as_deref(), Ok("00000000:19:00.0"));
        assert_eq!(normalize_pci_bus_id("1:c1:1f.7").as_deref(), Ok("00000001:C1:1F.7"));
        for bad in ["", "19:00.0", "0000:3b:00", "0000:3g:00.0", "0000:3b:20.0", "0000:3b:00.8"] {
            assert!(normalize_pci_bus_id(bad).is_err(), "{bad} should be rejected");
        }
        assert_eq!(pci_sysfs_name("00000000:3B:00.0"), "0000:3b:00.0");
        assert_eq!(pci_sysfs_name("00010000:3B:00.0"), "10000:3b:00.0", "the kernel prints %04x");
    }

    #[test]
    fn mig_profiles_are_named_like_nvidia_device_plugin() {
        let a100 = 81920 * MIB;
        // Memory sizes like those NVML reports for A100-SXM4-80GB GPU-instance profiles.
        assert_eq!(MigProfile::from_attributes(1, 1, 9728, a100).to_string(), "1g.10gb");
        assert_eq!(MigProfile::from_attributes(2, 2, 19968, a100).to_string(), "2g.20gb");
        assert_eq!(MigProfile::from_attributes(3, 3, 40192, a100).to_string(), "3g.40gb");
        assert_eq!(MigProfile::from_attributes(7, 7, 80640, a100).to_string(), "7g.80gb");
        assert_eq!(MigProfile::from_attributes(3, 1, 40192, a100).to_string(), "1c.3g.40gb");
        // H200 141GB (143771 MiB): one eighth rounds to 18 GB.
        let h200 = 143_771 * MIB;
        assert_eq!(MigProfile::from_attributes(1, 1, 16_384, h200).to_string(), "1g.18gb");
    }

    #[test]
    fn mig_profile_names_parse_and_round_trip() {
        for name in ["1g.10gb", "3g.40gb", "7g.80gb", "1c.3g.40gb", "2c.4g.20gb"] {
            let profile: MigProfile = name.parse().expect("valid profile");
            assert_eq!(profile.to_string(), name);
        }
        for bad in ["", "1g", "g.10gb", "1g.10", "1g.10gb+me", "4c.3g.40gb", "0g.5gb", "x.1g.5gb"] {
            assert!(bad.parse::<MigProfile>().is_err(), "{bad} should be rejected");
        }
    }

    #[test]
    fn default_mig_memory_gives_back_the_profile() {
        let a100 = 81920 * MIB;
        let h200 = 143_771 * MIB;
        for (name, gpu) in
            [("1g.10gb", a100), ("3g.40gb", a100), ("7g.80gb", a100), ("1g.18gb", h200)]
        {
            let profile: MigProfile = name.parse().expect("valid profile");
            let mib = profile.default_memory_mib(gpu).expect("the profile fits the GPU");
            assert!(mib * MIB <= gpu);
            let again =
                MigProfile::from_attributes(profile.gpu_slices, profile.compute_slices, mib, gpu);
            assert_eq!(again, profile);
        }
        let too_big: MigProfile = "1g.500gb".parse().expect("valid profile");
        assert_eq!(too_big.default_memory_mib(a100), None);
    }

    #[test]
    fn xids_are_classified_like_nvidia_device_plugin() {
        for xid in APPLICATION_XIDS {
            assert!(!is_critical_xid(xid));
        }
        for xid in [48, 63, 64, 74, 79, 92, 94, 95, 119, 999] {
            assert!(is_critical_xid(xid), "xid {xid}");
        }
        let gpu = GpuUuid::new("GPU-1").expect("valid");
        assert!(HealthEvent::from_xid(gpu.clone(), 79).critical);
        assert!(!HealthEvent::from_xid(gpu, 31).critical);
    }

    #[test]
    fn inventory_json_round_trips() {
        let inventory = Inventory {
            unreadable: vec![],
            driver_version: Some("570.124.06".into()),
            gpus: vec![Gpu {
                index: 0,
                uuid: GpuUuid::new("GPU-a").expect("valid"),
                name: "NVIDIA A100-SXM4-80GB".into(),
                memory_bytes: 81920 * MIB,
                pci_bus_id: "00000000:07:00.0".into(),
                numa_node: Some(0),
                cuda_compute_capability: Some("8.0".into()),
                nvlink_peers: vec![GpuUuid::new("GPU-b").expect("valid")],
                mig: MigState::Enabled {
                    instances: vec![MigInstance {
                        uuid: MigUuid::new("MIG-a").expect("valid"),
                        profile: "3g.40gb".into(),
                        memory_bytes: 40192 * MIB,
                        gpu_instance_id: 2,
                        compute_instance_id: 0,
                    }],
                },
            }],
        };
        let json = serde_json::to_string(&inventory).expect("serialises");
        assert!(json.contains(r#""mig":{"mode":"enabled","instances":["#), "{json}");
        let back: Inventory = serde_json::from_str(&json).expect("deserialises");
        assert_eq!(back, inventory);
    }
}
