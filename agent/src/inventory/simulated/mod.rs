//! The simulated GPU inventory: a node's GPUs described in a YAML topology file, for development
//! and tests on machines without a GPU, and for trying the agent on the shapes of real nodes.
//!
//! The format is documented in `docs/inventory.md`; `packaging/examples/` has three examples
//! (8x H200 on NVSwitch, 4x A100 80GB with two GPUs in MIG mode, 4x L4 in NVLink-bridged pairs).
//! In short:
//!
//! ```yaml
//! node: gpu-node-7              # optional: seeds the UUIDs generated for GPUs without one
//! driver_version: "570.124.06"  # optional
//! nvlink:
//!   nvswitch: false             # true: every GPU is an NVLink peer of every other
//!   groups: [[0, 1], [2, 3]]    # each group is fully connected
//! gpus:
//!   - index: 0
//!     model: NVIDIA A100-SXM4-80GB
//!     memory: 81920MiB          # bytes as an integer, or a quantity: 80GB, 80GiB, 81920MiB
//!     pci_bus_id: "0000:07:00.0"
//!     numa_node: 0              # optional
//!     cuda_compute_capability: "9.0"   # optional, major.minor
//!     uuid: GPU-...             # optional
//!     nvlink_peers: [1]         # optional, must be symmetric
//!     mig:                      # optional
//!       mode: enabled
//!       instances:
//!         - profile: 3g.40gb    # memory, uuid, gpu_instance_id, compute_instance_id optional
//! ```
//!
//! Loading checks the whole file and reports every problem at once, each with its file and line.
//!
//! The work is split by job: `schema` holds the file's serde types, `validate` turns a parsed
//! file into an [`Inventory`] collecting every problem, `locate` finds each problem's line,
//! `uuid` generates the UUIDs a file leaves out, and `error` holds this backend's own errors. This module
//! is the backend itself: its constructors, [`GpuInventory`] and the injected health events.

mod error;
mod schema;
mod uuid;
mod validate;

use std::path::Path;
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

pub use self::error::{TopologyError, TopologyProblem, UnknownGpu};
pub use self::uuid::{generated_gpu_uuid, generated_mig_uuid};
use self::validate::parse_topology;
use super::{
    GpuInventory, GpuProcess, GpuTelemetry, GpuUuid, HealthEvent, HealthWatcher, Inventory,
    InventoryError,
};

/// The node name used to generate UUIDs when neither the file nor the caller gives one.
pub const DEFAULT_NODE_NAME: &str = "simulated";
/// The most bytes a topology file may hold.
const MAX_TOPOLOGY_BYTES: u64 = 16 << 20;

/// A GPU inventory read from a YAML topology file.
#[derive(Debug)]
pub struct SimulatedInventory {
    inventory: Inventory,
    watchers: Mutex<Vec<Sender<HealthEvent>>>,
    processes: Mutex<Vec<GpuProcess>>,
    telemetry: Mutex<Vec<GpuTelemetry>>,
}

impl SimulatedInventory {
    /// Reads and validates a topology file. GPUs and MIG instances without a UUID get one
    /// generated from the file's `node` name (default [`DEFAULT_NODE_NAME`]) and their indices.
    pub fn from_file(path: &Path) -> Result<Self, InventoryError> {
        Self::from_file_for_node(path, None)
    }

    /// Like [`SimulatedInventory::from_file`], with `node_name` (when given) seeding the
    /// generated UUIDs instead of the file's `node`, so that nodes sharing one file differ.
    pub fn from_file_for_node(
        path: &Path,
        node_name: Option<&str>,
    ) -> Result<Self, InventoryError> {
        let read = |source| TopologyError::Read { path: path.to_owned(), source };
        let bytes =
            crate::files::read_bounded(path, MAX_TOPOLOGY_BYTES, crate::files::Links::Follow)
                .map_err(read)?
                .ok_or_else(|| {
                    read(std::io::Error::new(std::io::ErrorKind::NotFound, "no such file"))
                })?;
        let text = String::from_utf8(bytes)
            .map_err(|e| read(std::io::Error::new(std::io::ErrorKind::InvalidData, e)))?;
        Ok(Self::new(parse_topology(&text, path, node_name)?))
    }

    /// Reads a topology from YAML text; `origin` names it in error messages.
    pub fn from_yaml_str(yaml: &str, origin: impl AsRef<Path>) -> Result<Self, InventoryError> {
        Ok(Self::new(parse_topology(yaml, origin.as_ref(), None)?))
    }

    /// Replaces the live readings [`GpuInventory::telemetry`] reports (tests, demos).
    pub fn set_telemetry(&self, telemetry: Vec<GpuTelemetry>) {
        *self.telemetry.lock().unwrap_or_else(PoisonError::into_inner) = telemetry;
    }

    /// Replaces the compute processes [`GpuInventory::processes`] reports (tests, demos).
    pub fn set_processes(&self, processes: Vec<GpuProcess>) {
        *self.processes.lock().unwrap_or_else(PoisonError::into_inner) = processes;
    }

    /// A simulated backend serving a ready-made inventory.
    pub fn new(inventory: Inventory) -> Self {
        Self {
            inventory,
            watchers: Mutex::new(Vec::new()),
            processes: Mutex::new(Vec::new()),
            telemetry: Mutex::new(Vec::new()),
        }
    }

    /// The inventory this backend serves.
    pub fn inventory(&self) -> &Inventory {
        &self.inventory
    }

    /// Plays an XID error of `gpu` to every live health watcher, and returns the event.
    pub fn inject_xid(&self, gpu: &GpuUuid, xid: u64) -> Result<HealthEvent, UnknownGpu> {
        if self.inventory.gpu(gpu).is_none() {
            return Err(UnknownGpu(gpu.clone()));
        }
        let event = HealthEvent::from_xid(gpu.clone(), xid);
        let mut watchers = self.watchers.lock().unwrap_or_else(PoisonError::into_inner);
        watchers.retain(|watcher| watcher.send(event.clone()).is_ok());
        Ok(event)
    }
}

impl GpuInventory for SimulatedInventory {
    fn discover(&self) -> Result<Inventory, InventoryError> {
        Ok(self.inventory.clone())
    }

    fn health_watcher(&self) -> Result<Box<dyn HealthWatcher + '_>, InventoryError> {
        let (sender, receiver) = mpsc::channel();
        self.watchers.lock().unwrap_or_else(PoisonError::into_inner).push(sender);
        Ok(Box::new(SimulatedHealthWatcher { receiver }))
    }

    fn processes(&self) -> Result<Vec<GpuProcess>, InventoryError> {
        Ok(self.processes.lock().unwrap_or_else(PoisonError::into_inner).clone())
    }

    /// What [`SimulatedInventory::set_telemetry`] set; no reading for the other GPUs.
    fn telemetry(&self) -> Result<Vec<GpuTelemetry>, InventoryError> {
        let set = self.telemetry.lock().unwrap_or_else(PoisonError::into_inner).clone();
        Ok(self
            .inventory
            .gpus
            .iter()
            .map(|g| {
                set.iter().find(|t| t.gpu.as_ref() == Some(&g.uuid)).cloned().unwrap_or(
                    GpuTelemetry { gpu: Some(g.uuid.clone()), ..GpuTelemetry::default() },
                )
            })
            .collect())
    }
}

/// Receives what [`SimulatedInventory::inject_xid`] plays.
struct SimulatedHealthWatcher {
    receiver: Receiver<HealthEvent>,
}

impl HealthWatcher for SimulatedHealthWatcher {
    fn unwatched(&self) -> &[GpuUuid] {
        &[]
    }

    fn next_event(&mut self, timeout: Duration) -> Result<Option<HealthEvent>, InventoryError> {
        match self.receiver.recv_timeout(timeout) {
            Ok(event) => Ok(Some(event)),
            // The backend holds the sender for as long as the watcher can borrow it, so a
            // disconnect cannot happen; treat it as "nothing came".
            Err(RecvTimeoutError::Timeout | RecvTimeoutError::Disconnected) => Ok(None),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;
    use crate::inventory::{MIB, MigProfile, MigState};

    const EXAMPLES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../packaging/examples");

    fn example(name: &str) -> Inventory {
        let path = Path::new(EXAMPLES).join(name);
        SimulatedInventory::from_file(&path)
            .unwrap_or_else(|err| panic!("{} should load: {err}", path.display()))
            .discover()
            .expect("simulated discovery cannot fail")
    }

    #[test]
    fn a_compute_capability_is_read_and_a_malformed_one_refused() {
        let topology = |cc: &str| {
            format!(
                "node: n\ngpus:\n  - index: 0\n    model: NVIDIA H200\n    memory: 141GiB\n    \
                 pci_bus_id: \"00000000:18:00.0\"\n    cuda_compute_capability: \"{cc}\"\n"
            )
        };
        let good = SimulatedInventory::from_yaml_str(&topology("9.0"), "t.yaml")
            .expect("valid")
            .discover()
            .expect("discover");
        assert_eq!(good.gpus[0].cuda_compute_capability.as_deref(), Some("9.0"));
        for bad in ["9", "nine.0", "9.0.1", ".0"] {
            let err = SimulatedInventory::from_yaml_str(&topology(bad), "t.yaml")
                .and_then(|s| s.discover())
                .expect_err("malformed");
            assert!(err.to_string().contains("is not a compute capability"), "{bad}: {err}");
        }
    }

    #[test]
    fn h200_example_is_eight_nvswitch_peers_on_two_numa_nodes() {
        let inventory = example("h200-8x-nvswitch.yaml");
        assert_eq!(inventory.gpus.len(), 8);
        for (i, gpu) in inventory.gpus.iter().enumerate() {
            assert_eq!(gpu.index as usize, i);
            assert_eq!(gpu.name, "NVIDIA H200");
            assert_eq!(gpu.memory_bytes, 150_754_820_096);
            assert_eq!(gpu.nvlink_peers.len(), 7);
            assert!(!gpu.nvlink_peers.contains(&gpu.uuid));
            assert!(gpu.nvlink_peers.windows(2).all(|w| w[0] < w[1]), "peers are sorted");
            assert_eq!(gpu.mig, MigState::Disabled);
            assert_eq!(gpu.numa_node, Some(if i < 4 { 0 } else { 1 }));
        }
        let uuids: BTreeSet<_> = inventory.gpus.iter().map(|g| g.uuid.clone()).collect();
        assert_eq!(uuids.len(), 8);
    }

    #[test]
    fn a100_example_has_two_mig_gpus() {
        let inventory = example("a100-4x-mig.yaml");
        assert_eq!(inventory.gpus.len(), 4);
        for gpu in &inventory.gpus {
            assert_eq!(gpu.name, "NVIDIA A100-SXM4-80GB");
            assert_eq!(gpu.memory_bytes, 81920 * MIB);
            assert_eq!(gpu.nvlink_peers.len(), 3);
        }
        assert_eq!(inventory.gpus[0].mig, MigState::Disabled);
        assert_eq!(inventory.gpus[1].mig, MigState::Disabled);
        let profiles = |i: usize| -> Vec<String> {
            inventory.gpus[i].mig.instances().iter().map(|m| m.profile.clone()).collect()
        };
        assert_eq!(profiles(2), ["3g.40gb", "1g.10gb", "1g.10gb"]);
        assert_eq!(profiles(3), ["7g.80gb"]);
        for gpu in &inventory.gpus[2..] {
            for inst in gpu.mig.instances() {
                let profile: MigProfile = inst.profile.parse().expect("canonical profile");
                let again = MigProfile::from_attributes(
                    profile.gpu_slices,
                    profile.compute_slices,
                    inst.memory_bytes / MIB,
                    gpu.memory_bytes,
                );
                assert_eq!(again, profile);
            }
        }
    }

    #[test]
    fn l4_example_has_nvlink_pairs() {
        let inventory = example("l4-4x-pcie.yaml");
        assert_eq!(inventory.gpus.len(), 4);
        let uuid = |i: usize| inventory.gpus[i].uuid.clone();
        assert_eq!(inventory.gpus[0].nvlink_peers, [uuid(1)]);
        assert_eq!(inventory.gpus[1].nvlink_peers, [uuid(0)]);
        assert_eq!(inventory.gpus[2].nvlink_peers, [uuid(3)]);
        assert_eq!(inventory.gpus[3].nvlink_peers, [uuid(2)]);
        assert_eq!(inventory.gpus[0].memory_bytes, 23034 * MIB);
    }

    #[test]
    fn unreadable_file_names_the_path() {
        let err = SimulatedInventory::from_file(Path::new("/nonexistent/topology.yaml"))
            .expect_err("missing file");
        assert!(err.to_string().contains("/nonexistent/topology.yaml"), "{err}");
    }

    #[test]
    fn injected_xids_reach_every_watcher() {
        let backend = SimulatedInventory::new(example("l4-4x-pcie.yaml"));
        let gpu = backend.inventory().gpus[2].uuid.clone();
        let mut first = backend.health_watcher().expect("watcher");
        let mut second = backend.health_watcher().expect("watcher");
        assert!(first.unwatched().is_empty());
        let sent = backend.inject_xid(&gpu, 79).expect("known GPU");
        assert!(sent.critical);
        for watcher in [&mut first, &mut second] {
            let got = watcher.next_event(Duration::from_secs(5)).expect("no error");
            assert_eq!(got.as_ref(), Some(&sent));
        }
        assert_eq!(first.next_event(Duration::from_millis(1)).expect("no error"), None);
        let unknown = GpuUuid::new("GPU-unknown").expect("valid");
        assert!(matches!(backend.inject_xid(&unknown, 79), Err(UnknownGpu(_))));
    }
}
