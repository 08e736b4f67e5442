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
//!     uuid: GPU-...             # optional
//!     nvlink_peers: [1]         # optional, must be symmetric
//!     mig:                      # optional
//!       mode: enabled
//!       instances:
//!         - profile: 3g.40gb    # memory, uuid, gpu_instance_id, compute_instance_id optional
//! ```
//!
//! Loading checks the whole file and reports every problem at once, each with its file and line.
//! The agent's CLI (`baleen-agent inventory --simulated FILE`) and the tests construct it;
//! [`SimulatedInventory::inject_xid`] lets them play a GPU error to the health watchers.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use serde::de::{self, DeserializeSeed, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::{Deserialize, Deserializer};

use crate::quantity::Quantity;

use super::{
    Gpu, GpuInventory, GpuUuid, HealthEvent, HealthWatcher, Inventory, InventoryError, MIB,
    MigInstance, MigProfile, MigState, MigUuid, normalize_pci_bus_id,
};

/// The node name used to generate UUIDs when neither the file nor the caller gives one.
pub const DEFAULT_NODE_NAME: &str = "simulated";

/// A topology file that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum TopologyError {
    /// The file could not be read.
    #[error("cannot read topology file {}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The file is not YAML of the expected shape (unknown field, wrong type, bad quantity...).
    /// YAML parsing stops at the first such error.
    #[error("{}:{}: {message}", path.display(), location(*line, *column))]
    Parse {
        /// The file.
        path: PathBuf,
        /// The line (1-based), when the parser knows it.
        line: Option<usize>,
        /// The column (1-based), when the parser knows it.
        column: Option<usize>,
        /// What is wrong.
        message: String,
    },
    /// The file parses but describes an impossible node; every problem found is listed.
    #[error("{}: invalid topology ({} problem{}):{}", path.display(), problems.len(),
        if problems.len() == 1 { "" } else { "s" }, list_problems(path, problems))]
    Invalid {
        /// The file.
        path: PathBuf,
        /// Every problem, ordered by line.
        problems: Vec<TopologyProblem>,
    },
}

fn location(line: Option<usize>, column: Option<usize>) -> String {
    match (line, column) {
        (Some(line), Some(column)) => format!("{line}:{column}"),
        (Some(line), None) => line.to_string(),
        _ => "?".to_owned(),
    }
}

fn list_problems(path: &Path, problems: &[TopologyProblem]) -> String {
    problems
        .iter()
        .map(|problem| match problem.line {
            Some(line) => format!("\n  {}:{line}: {}", path.display(), problem.message),
            None => format!("\n  {}: {}", path.display(), problem.message),
        })
        .collect()
}

/// One problem in a topology file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TopologyProblem {
    /// The line (1-based) of the YAML node the problem is about, when it can be located.
    pub line: Option<usize>,
    /// What is wrong.
    pub message: String,
}

impl fmt::Display for TopologyProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.line {
            Some(line) => write!(f, "line {line}: {}", self.message),
            None => f.write_str(&self.message),
        }
    }
}

/// GPU-instance slices of a MIG-capable GPU.
const MIG_GPU_SLICES: u32 = 7;

/// A GPU inventory read from a YAML topology file.
#[derive(Debug)]
pub struct SimulatedInventory {
    inventory: Inventory,
    watchers: Mutex<Vec<Sender<HealthEvent>>>,
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
        let text = std::fs::read_to_string(path)
            .map_err(|source| TopologyError::Read { path: path.to_owned(), source })?;
        Ok(Self::new(parse_topology(&text, path, node_name)?))
    }

    /// Reads a topology from YAML text; `origin` names it in error messages.
    pub fn from_yaml_str(yaml: &str, origin: impl AsRef<Path>) -> Result<Self, InventoryError> {
        Ok(Self::new(parse_topology(yaml, origin.as_ref(), None)?))
    }

    /// A simulated backend serving a ready-made inventory.
    pub fn new(inventory: Inventory) -> Self {
        Self { inventory, watchers: Mutex::new(Vec::new()) }
    }

    /// The inventory this backend serves.
    pub fn inventory(&self) -> &Inventory {
        &self.inventory
    }

    /// Plays an XID error of `gpu` to every live health watcher, and returns the event.
    pub fn inject_xid(&self, gpu: &GpuUuid, xid: u64) -> Result<HealthEvent, InventoryError> {
        if self.inventory.gpu(gpu).is_none() {
            return Err(InventoryError::UnknownGpu(gpu.clone()));
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

// ---------------------------------------------------------------------------------------------
// The file format.

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct TopologyFile {
    #[serde(default)]
    node: Option<String>,
    #[serde(default)]
    driver_version: Option<String>,
    #[serde(default)]
    nvlink: NvlinkSpec,
    gpus: Vec<GpuSpec>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct NvlinkSpec {
    #[serde(default)]
    nvswitch: bool,
    #[serde(default)]
    groups: Vec<Vec<u32>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct GpuSpec {
    index: u32,
    model: String,
    memory: Quantity,
    pci_bus_id: String,
    #[serde(default)]
    numa_node: Option<u32>,
    #[serde(default)]
    uuid: Option<String>,
    #[serde(default)]
    nvlink_peers: Vec<u32>,
    #[serde(default)]
    mig: Option<MigSpec>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct MigSpec {
    mode: MigMode,
    #[serde(default)]
    instances: Vec<MigInstanceSpec>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
enum MigMode {
    Enabled,
    Disabled,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct MigInstanceSpec {
    profile: String,
    #[serde(default)]
    memory: Option<Quantity>,
    #[serde(default)]
    uuid: Option<String>,
    #[serde(default)]
    gpu_instance_id: Option<u32>,
    #[serde(default)]
    compute_instance_id: Option<u32>,
}

// ---------------------------------------------------------------------------------------------
// Loading and validation.

/// A step of a path into the YAML document, to find a problem's line.
#[derive(Debug, Clone, Copy)]
enum Seg {
    Key(&'static str),
    Index(usize),
}

/// A problem before its line is known.
struct Pending {
    at: Vec<Seg>,
    message: String,
}

struct Problems(Vec<Pending>);

impl Problems {
    fn add(&mut self, at: &[Seg], message: impl Into<String>) {
        self.0.push(Pending { at: at.to_vec(), message: message.into() });
    }
}

fn gpu_field(position: usize, key: &'static str) -> Vec<Seg> {
    vec![Seg::Key("gpus"), Seg::Index(position), Seg::Key(key)]
}

fn mig_instance_at(position: usize, instance: usize) -> Vec<Seg> {
    vec![
        Seg::Key("gpus"),
        Seg::Index(position),
        Seg::Key("mig"),
        Seg::Key("instances"),
        Seg::Index(instance),
    ]
}

fn with(mut path: Vec<Seg>, seg: Seg) -> Vec<Seg> {
    path.push(seg);
    path
}

fn parse_topology(
    text: &str,
    path: &Path,
    node_override: Option<&str>,
) -> Result<Inventory, TopologyError> {
    let file: TopologyFile = serde_yaml_ng::from_str(text).map_err(|err| {
        let location = err.location();
        let line = location.as_ref().map(|l| l.line());
        let column = location.as_ref().map(|l| l.column());
        let mut message = err.to_string();
        // The parser appends the location; the error shows it in front, as `file:line:column`.
        if let (Some(line), Some(column)) = (line, column) {
            let suffix = format!(" at line {line} column {column}");
            if let Some(stripped) = message.strip_suffix(&suffix) {
                message = stripped.to_owned();
            }
        }
        TopologyError::Parse { path: path.to_owned(), line, column, message }
    })?;

    let node = node_override.or(file.node.as_deref()).unwrap_or(DEFAULT_NODE_NAME);
    let mut problems = Problems(Vec::new());
    let inventory = build(&file, node, &mut problems);
    if problems.0.is_empty() {
        return Ok(inventory);
    }
    let mut located: Vec<TopologyProblem> = problems
        .0
        .into_iter()
        .map(|p| TopologyProblem { line: locate(text, &p.at), message: p.message })
        .collect();
    located.sort_by_key(|p| p.line.unwrap_or(usize::MAX));
    Err(TopologyError::Invalid { path: path.to_owned(), problems: located })
}

/// Builds the inventory from a parsed file, recording every problem found.
fn build(file: &TopologyFile, node: &str, problems: &mut Problems) -> Inventory {
    let count = file.gpus.len();

    // Indices: unique and exactly 0..count, as NVML numbers GPUs.
    let mut position_of: HashMap<u32, usize> = HashMap::new();
    for (position, gpu) in file.gpus.iter().enumerate() {
        if let Some(first) = position_of.get(&gpu.index) {
            problems.add(
                &gpu_field(position, "index"),
                format!(
                    "GPU index {} appears twice (also GPU #{} in the list)",
                    gpu.index,
                    first + 1
                ),
            );
        } else {
            position_of.insert(gpu.index, position);
        }
        if gpu.index as usize >= count {
            problems.add(
                &gpu_field(position, "index"),
                format!(
                    "GPU index {} is out of range: NVML numbers this node's GPUs from 0 to {}",
                    gpu.index,
                    count.saturating_sub(1)
                ),
            );
        }
    }

    let mut seen_uuids: HashMap<String, u32> = HashMap::new();
    let mut seen_mig_uuids: HashMap<String, u32> = HashMap::new();
    let mut seen_pci: HashMap<String, u32> = HashMap::new();
    let mut gpus = Vec::with_capacity(count);
    let mut uuid_of: BTreeMap<u32, GpuUuid> = BTreeMap::new();

    for (position, spec) in file.gpus.iter().enumerate() {
        if spec.model.trim().is_empty() {
            problems.add(&gpu_field(position, "model"), "the GPU model is empty");
        }
        if spec.memory.0 == 0 {
            problems.add(&gpu_field(position, "memory"), "GPU memory must be more than 0 bytes");
        }
        let uuid = match &spec.uuid {
            Some(text) => match GpuUuid::new(text.clone()) {
                Ok(uuid) => uuid,
                Err(err) => {
                    problems.add(&gpu_field(position, "uuid"), err.to_string());
                    generated_gpu_uuid(node, spec.index)
                }
            },
            None => generated_gpu_uuid(node, spec.index),
        };
        // Generated UUIDs count too: one pasted from `inventory` output onto another GPU
        // would otherwise repeat unnoticed.
        let other = seen_uuids.insert(uuid.as_str().to_owned(), spec.index);
        if let Some(other) = other {
            problems.add(
                &gpu_field(position, "uuid"),
                format!("UUID {uuid} is used by GPU {other} and GPU {}", spec.index),
            );
        }
        uuid_of.entry(spec.index).or_insert_with(|| uuid.clone());

        let pci_bus_id = match normalize_pci_bus_id(&spec.pci_bus_id) {
            Ok(id) => {
                if let Some(other) = seen_pci.insert(id.clone(), spec.index) {
                    problems.add(
                        &gpu_field(position, "pci_bus_id"),
                        format!("PCI bus ID {id} is used by GPU {other} and GPU {}", spec.index),
                    );
                }
                id
            }
            Err(err) => {
                problems.add(&gpu_field(position, "pci_bus_id"), err.to_string());
                spec.pci_bus_id.clone()
            }
        };

        let mig = build_mig(spec, position, node, &mut seen_mig_uuids, problems);
        gpus.push(Gpu {
            index: spec.index,
            uuid,
            name: spec.model.clone(),
            memory_bytes: spec.memory.0,
            pci_bus_id,
            numa_node: spec.numa_node,
            nvlink_peers: Vec::new(),
            mig,
        });
    }

    let peers = nvlink_peers(file, &position_of, problems);
    for gpu in &mut gpus {
        if let Some(peer_indices) = peers.get(&gpu.index) {
            let mut uuids: Vec<GpuUuid> =
                peer_indices.iter().filter_map(|index| uuid_of.get(index).cloned()).collect();
            uuids.sort();
            gpu.nvlink_peers = uuids;
        }
    }
    gpus.sort_by_key(|gpu| gpu.index);
    Inventory { driver_version: file.driver_version.clone(), gpus }
}

/// NVLink peers by GPU index: from `nvswitch`, `groups` and each GPU's `nvlink_peers`.
fn nvlink_peers(
    file: &TopologyFile,
    position_of: &HashMap<u32, usize>,
    problems: &mut Problems,
) -> BTreeMap<u32, BTreeSet<u32>> {
    let mut peers: BTreeMap<u32, BTreeSet<u32>> = BTreeMap::new();
    let mut connect = |a: u32, b: u32| {
        if a != b {
            peers.entry(a).or_default().insert(b);
            peers.entry(b).or_default().insert(a);
        }
    };
    let nvlink = &file.nvlink;
    let any_peer_lists = file.gpus.iter().any(|gpu| !gpu.nvlink_peers.is_empty());
    if nvlink.nvswitch && (!nvlink.groups.is_empty() || any_peer_lists) {
        problems.add(
            &[Seg::Key("nvlink"), Seg::Key("nvswitch")],
            "`nvswitch: true` already makes every GPU a peer of every other; remove \
             `nvlink.groups` and the GPUs' `nvlink_peers`",
        );
    }
    if nvlink.nvswitch {
        let indices: Vec<u32> = file.gpus.iter().map(|gpu| gpu.index).collect();
        for &a in &indices {
            for &b in &indices {
                connect(a, b);
            }
        }
    }
    for (g, group) in nvlink.groups.iter().enumerate() {
        let at = [Seg::Key("nvlink"), Seg::Key("groups"), Seg::Index(g)];
        if group.len() < 2 {
            problems.add(&at, "an NVLink group needs at least two GPUs");
        }
        let mut members = BTreeSet::new();
        for &index in group {
            if !position_of.contains_key(&index) {
                problems.add(&at, format!("NVLink group names GPU {index}, which does not exist"));
            } else if !members.insert(index) {
                problems.add(&at, format!("NVLink group names GPU {index} twice"));
            }
        }
        for &a in &members {
            for &b in &members {
                connect(a, b);
            }
        }
    }
    let listed: BTreeSet<(u32, u32)> = file
        .gpus
        .iter()
        .flat_map(|gpu| gpu.nvlink_peers.iter().map(move |&peer| (gpu.index, peer)))
        .collect();
    for (position, gpu) in file.gpus.iter().enumerate() {
        let at = gpu_field(position, "nvlink_peers");
        for &peer in &gpu.nvlink_peers {
            if peer == gpu.index {
                problems.add(&at, format!("GPU {peer} lists itself as an NVLink peer"));
            } else if !position_of.contains_key(&peer) {
                problems.add(&at, format!("NVLink peer GPU {peer} does not exist"));
            } else {
                if !listed.contains(&(peer, gpu.index)) {
                    problems.add(
                        &at,
                        format!(
                            "GPU {} lists GPU {peer} as an NVLink peer, but GPU {peer} does not \
                             list GPU {} (NVLink is symmetric)",
                            gpu.index, gpu.index
                        ),
                    );
                }
                connect(gpu.index, peer);
            }
        }
    }
    peers
}

fn build_mig(
    spec: &GpuSpec,
    position: usize,
    node: &str,
    seen_mig_uuids: &mut HashMap<String, u32>,
    problems: &mut Problems,
) -> MigState {
    let Some(mig) = &spec.mig else { return MigState::Disabled };
    if mig.mode == MigMode::Disabled {
        if !mig.instances.is_empty() {
            problems.add(
                &with(gpu_field(position, "mig"), Seg::Key("instances")),
                format!(
                    "GPU {} has MIG instances but `mode: disabled`; set `mode: enabled` or \
                     remove the instances",
                    spec.index
                ),
            );
        }
        return MigState::Disabled;
    }

    let gpu_memory = spec.memory.0;
    let mut instances = Vec::with_capacity(mig.instances.len());
    // GPU instance ID -> (slices, memory, position of the first instance naming it).
    let mut gpu_instances: BTreeMap<u32, (u32, u64, usize)> = BTreeMap::new();
    let mut ids: HashMap<(u32, u32), usize> = HashMap::new();

    for (i, inst) in mig.instances.iter().enumerate() {
        let at = mig_instance_at(position, i);
        let gpu_instance_id = inst.gpu_instance_id.unwrap_or(i as u32);
        let compute_instance_id = inst.compute_instance_id.unwrap_or(0);
        if let Some(first) = ids.insert((gpu_instance_id, compute_instance_id), i) {
            problems.add(
                &at,
                format!(
                    "MIG instance #{} repeats GPU instance {gpu_instance_id} / compute instance \
                     {compute_instance_id} of instance #{}",
                    i + 1,
                    first + 1
                ),
            );
        }

        let profile: Option<MigProfile> = match inst.profile.parse::<MigProfile>() {
            Ok(profile) => Some(profile),
            Err(err) => {
                problems.add(&with(at.clone(), Seg::Key("profile")), err.to_string());
                None
            }
        };
        let memory_bytes = match (inst.memory, profile) {
            (Some(memory), profile) => {
                if memory.0 == 0 {
                    problems.add(
                        &with(at.clone(), Seg::Key("memory")),
                        "MIG instance memory must be more than 0 bytes",
                    );
                } else if memory.0 > gpu_memory {
                    problems.add(
                        &with(at.clone(), Seg::Key("memory")),
                        format!(
                            "MIG instance memory ({} MiB) is more than GPU {}'s memory ({} MiB)",
                            memory.0 / MIB,
                            spec.index,
                            gpu_memory / MIB
                        ),
                    );
                } else if let Some(profile) = profile {
                    let derived = MigProfile::from_attributes(
                        profile.gpu_slices,
                        profile.compute_slices,
                        memory.0 / MIB,
                        gpu_memory,
                    );
                    if derived != profile {
                        problems.add(
                            &with(at.clone(), Seg::Key("memory")),
                            format!(
                                "{} MiB of a {} MiB GPU makes profile {derived}, not {profile}",
                                memory.0 / MIB,
                                gpu_memory / MIB
                            ),
                        );
                    }
                }
                memory.0
            }
            (None, Some(profile)) => match profile.default_memory_mib(gpu_memory) {
                Some(mib) => mib * MIB,
                None => {
                    problems.add(
                        &with(at.clone(), Seg::Key("profile")),
                        format!(
                            "profile {profile} does not fit GPU {} ({} MiB)",
                            spec.index,
                            gpu_memory / MIB
                        ),
                    );
                    0
                }
            },
            (None, None) => 0,
        };

        if let Some(profile) = profile {
            match gpu_instances.get(&gpu_instance_id) {
                None => {
                    gpu_instances.insert(gpu_instance_id, (profile.gpu_slices, memory_bytes, i));
                }
                Some(&(slices, memory, first)) => {
                    if slices != profile.gpu_slices || memory != memory_bytes {
                        problems.add(
                            &at,
                            format!(
                                "MIG instance #{} shares GPU instance {gpu_instance_id} with \
                                 instance #{} but not its GPU slices and memory",
                                i + 1,
                                first + 1
                            ),
                        );
                    }
                }
            }
        }

        let uuid = match &inst.uuid {
            Some(text) => match MigUuid::new(text.clone()) {
                Ok(uuid) => uuid,
                Err(err) => {
                    problems.add(&with(at.clone(), Seg::Key("uuid")), err.to_string());
                    generated_mig_uuid(node, spec.index, gpu_instance_id, compute_instance_id)
                }
            },
            None => generated_mig_uuid(node, spec.index, gpu_instance_id, compute_instance_id),
        };
        // Generated MIG UUIDs repeat only where instance IDs do, which is reported above.
        let repeated = inst.uuid.is_some()
            && seen_mig_uuids.insert(uuid.as_str().to_owned(), spec.index).is_some();
        if repeated {
            problems
                .add(&with(at.clone(), Seg::Key("uuid")), format!("MIG UUID {uuid} is used twice"));
        }

        instances.push(MigInstance {
            uuid,
            profile: profile.map(|p| p.to_string()).unwrap_or_else(|| inst.profile.clone()),
            memory_bytes,
            gpu_instance_id,
            compute_instance_id,
        });
    }

    // A GPU has 7 GPU-instance slices (A100, H100, H200); instances cannot share them.
    let slices: u32 = gpu_instances.values().map(|&(slices, _, _)| slices).sum();
    if slices > MIG_GPU_SLICES {
        problems.add(
            &with(gpu_field(position, "mig"), Seg::Key("instances")),
            format!(
                "the MIG GPU instances of GPU {} need {slices} GPU slices, more than the \
                 {MIG_GPU_SLICES} a GPU has",
                spec.index
            ),
        );
    }
    let total: u64 = gpu_instances.values().map(|&(_, memory, _)| memory).sum();
    if total > gpu_memory {
        problems.add(
            &with(gpu_field(position, "mig"), Seg::Key("instances")),
            format!(
                "the MIG GPU instances of GPU {} need {} MiB, more than its {} MiB",
                spec.index,
                total / MIB,
                gpu_memory / MIB
            ),
        );
    }
    instances.sort_by_key(|inst| (inst.gpu_instance_id, inst.compute_instance_id));
    MigState::Enabled { instances }
}

/// FNV-1a, 64 bits: stable across Rust versions, unlike `DefaultHasher`.
fn fnv1a(seed: u64, bytes: &[u8]) -> u64 {
    bytes.iter().fold(seed, |hash, &b| (hash ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
}

/// The splitmix64 finaliser: spreads FNV's output so that keys differing in one character give
/// UUIDs that differ everywhere.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn uuid_body(key: &str) -> String {
    let high = mix(fnv1a(0xcbf2_9ce4_8422_2325, key.as_bytes()));
    let low = mix(fnv1a(high ^ 0x9e37_79b9_7f4a_7c15, key.as_bytes()));
    format!(
        "{:08x}-{:04x}-{:04x}-{:04x}-{:012x}",
        high >> 32,
        (high >> 16) & 0xffff,
        high & 0xffff,
        low >> 48,
        low & 0xffff_ffff_ffff
    )
}

/// The UUID a simulated GPU gets when the file gives none: a hash of the node name and index.
pub fn generated_gpu_uuid(node: &str, index: u32) -> GpuUuid {
    GpuUuid(format!("GPU-{}", uuid_body(&format!("baleen-simulated/{node}/gpu/{index}"))))
}

/// The UUID a simulated MIG instance gets when the file gives none.
pub fn generated_mig_uuid(
    node: &str,
    gpu_index: u32,
    gpu_instance_id: u32,
    compute_instance_id: u32,
) -> MigUuid {
    let key = format!(
        "baleen-simulated/{node}/gpu/{gpu_index}/mig/{gpu_instance_id}/{compute_instance_id}"
    );
    MigUuid(format!("MIG-{}", uuid_body(&key)))
}

// ---------------------------------------------------------------------------------------------
// Finding the line of a YAML node.
//
// serde_yaml_ng keeps no positions in deserialised values, but it stamps the position of the
// node being read on any error a visitor returns. So to find where `gpus[3].uuid` is, walk the
// document to that node and fail there on purpose; the error carries the line.

const PROBE_MARKER: &str = "baleen-topology-probe";

fn locate(text: &str, path: &[Seg]) -> Option<usize> {
    let deserializer = serde_yaml_ng::Deserializer::from_str(text);
    match (Probe { path }).deserialize(deserializer) {
        Err(err) if err.to_string().contains(PROBE_MARKER) => err.location().map(|l| l.line()),
        _ => None,
    }
}

struct Probe<'p> {
    path: &'p [Seg],
}

impl<'de> DeserializeSeed<'de> for Probe<'_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        match self.path.split_first() {
            None => deserializer.deserialize_any(Found),
            Some((Seg::Key(key), rest)) => deserializer.deserialize_map(KeyWalker { key, rest }),
            Some((Seg::Index(index), rest)) => {
                deserializer.deserialize_seq(IndexWalker { index: *index, rest })
            }
        }
    }
}

/// Fails on whatever node it is asked to read (every `visit_*` defaults to an error).
struct Found;

impl Visitor<'_> for Found {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(PROBE_MARKER)
    }
}

struct KeyWalker<'p> {
    key: &'p str,
    rest: &'p [Seg],
}

impl<'de> Visitor<'de> for KeyWalker<'_> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "a mapping with key {}", self.key)
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        // The last step points at the key itself: for a block collection the key's line reads
        // better than the line of the collection's first entry.
        let seed = KeyMatch { key: self.key, fail_on_match: self.rest.is_empty() };
        while let Some(matched) = map.next_key_seed(seed)? {
            if matched {
                map.next_value_seed(Probe { path: self.rest })?;
            } else {
                map.next_value::<IgnoredAny>()?;
            }
        }
        Ok(())
    }
}

/// Reads a mapping key: whether it is the one looked for, or (when `fail_on_match`) the probe's
/// error at that key.
#[derive(Clone, Copy)]
struct KeyMatch<'p> {
    key: &'p str,
    fail_on_match: bool,
}

impl<'de> DeserializeSeed<'de> for KeyMatch<'_> {
    type Value = bool;
    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<bool, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl Visitor<'_> for KeyMatch<'_> {
    type Value = bool;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a mapping key")
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<bool, E> {
        match (v == self.key, self.fail_on_match) {
            (true, true) => Err(E::custom(PROBE_MARKER)),
            (matched, _) => Ok(matched),
        }
    }
    fn visit_u64<E: de::Error>(self, _: u64) -> Result<bool, E> {
        Ok(false)
    }
    fn visit_i64<E: de::Error>(self, _: i64) -> Result<bool, E> {
        Ok(false)
    }
    fn visit_bool<E: de::Error>(self, _: bool) -> Result<bool, E> {
        Ok(false)
    }
    fn visit_unit<E: de::Error>(self) -> Result<bool, E> {
        Ok(false)
    }
}

struct IndexWalker<'p> {
    index: usize,
    rest: &'p [Seg],
}

impl<'de> Visitor<'de> for IndexWalker<'_> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "a sequence with an element {}", self.index)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        let mut position = 0;
        loop {
            if position == self.index {
                seq.next_element_seed(Probe { path: self.rest })?;
            } else if seq.next_element::<IgnoredAny>()?.is_none() {
                return Ok(());
            }
            position += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inventory::GIB;

    const EXAMPLES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../packaging/examples");

    fn example(name: &str) -> Inventory {
        let path = Path::new(EXAMPLES).join(name);
        SimulatedInventory::from_file(&path)
            .unwrap_or_else(|err| panic!("{} should load: {err}", path.display()))
            .discover()
            .expect("simulated discovery cannot fail")
    }

    fn problems(yaml: &str) -> Vec<TopologyProblem> {
        match parse_topology(yaml, Path::new("bad.yaml"), None) {
            Err(TopologyError::Invalid { path, problems }) => {
                assert_eq!(path, Path::new("bad.yaml"));
                problems
            }
            other => panic!("expected validation problems, got {other:?}"),
        }
    }

    fn has(problems: &[TopologyProblem], line: usize, text: &str) -> bool {
        problems.iter().any(|p| p.line == Some(line) && p.message.contains(text))
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
    fn generated_uuids_are_deterministic_and_follow_the_node_name() {
        let yaml = "gpus:\n  - {index: 0, model: X, memory: 1GiB, pci_bus_id: '0000:01:00.0'}\n";
        let a = parse_topology(yaml, Path::new("a.yaml"), Some("node-a")).expect("valid");
        let again = parse_topology(yaml, Path::new("a.yaml"), Some("node-a")).expect("valid");
        let b = parse_topology(yaml, Path::new("a.yaml"), Some("node-b")).expect("valid");
        assert_eq!(a.gpus[0].uuid, again.gpus[0].uuid);
        assert_ne!(a.gpus[0].uuid, b.gpus[0].uuid);
        assert_eq!(a.gpus[0].uuid.as_str().len(), "GPU-".len() + 36);
        assert_eq!(a.gpus[0].memory_bytes, GIB);
    }

    #[test]
    fn parse_errors_name_file_line_and_column() {
        let yaml = "gpus:\n  - index: 0\n    model: X\n    memory: 80 furlongs\n    pci_bus_id: '0000:01:00.0'\n";
        let err = parse_topology(yaml, Path::new("t.yaml"), None).expect_err("bad quantity");
        let TopologyError::Parse { line, message, .. } = &err else { panic!("{err:?}") };
        assert_eq!(*line, Some(4));
        assert!(message.contains("80 furlongs"), "{message}");
        assert!(err.to_string().starts_with("t.yaml:4:"), "{err}");
        assert!(!err.to_string().contains("at line"), "location not repeated: {err}");

        let yaml = "gpus:\n  - index: 0\n    model: X\n    memory: 1GiB\n    pci_bus_id: '0000:01:00.0'\n    colour: green\n";
        let err = parse_topology(yaml, Path::new("t.yaml"), None).expect_err("unknown field");
        assert!(err.to_string().starts_with("t.yaml:6:"), "{err}");
        assert!(err.to_string().contains("colour"), "{err}");
    }

    #[test]
    fn every_problem_is_reported_with_its_line() {
        let yaml = "\
node: bad                                  # 1
nvlink:                                    # 2
  groups: [[0, 7]]                         # 3
gpus:                                      # 4
  - index: 0                               # 5
    model: X                               # 6
    memory: 80GiB                          # 7
    pci_bus_id: '0000:01:00.0'             # 8
    uuid: GPU-same                         # 9
    nvlink_peers: [1]                      # 10
  - index: 0                               # 11
    model: ''                              # 12
    memory: 0                              # 13
    pci_bus_id: '0000:01:00.0'             # 14
    uuid: GPU-same                         # 15
    mig:                                   # 16
      mode: disabled                       # 17
      instances:                           # 18
        - profile: 1g.10gb                 # 19
  - index: 5                               # 20
    model: Y                               # 21
    memory: 80GiB                          # 22
    pci_bus_id: 'not-a-bus'                # 23
    uuid: MIG-wrong                        # 24
    mig:                                   # 25
      mode: enabled                        # 26
      instances:                           # 27
        - profile: 7g.80gb                 # 28
          memory: 81GiB                    # 29
        - profile: 3g.40gb                 # 30
          gpu_instance_id: 0               # 31
        - profile: 2g.banana               # 32
        - profile: 3g.40gb                 # 33
          memory: 10GiB                    # 34
        - profile: 1g.10gb                 # 35
          uuid: GPU-not-mig                # 36
";
        let found = problems(yaml);
        let expected: &[(usize, &str)] = &[
            (3, "GPU 7, which does not exist"),
            (10, "NVLink peer GPU 1 does not exist"),
            (11, "GPU index 0 appears twice"),
            (12, "model is empty"),
            (13, "more than 0 bytes"),
            (14, "PCI bus ID 00000000:01:00.0 is used by GPU 0 and GPU 0"),
            (15, "UUID GPU-same is used by GPU 0 and GPU 0"),
            (18, "`mode: disabled`"),
            (20, "GPU index 5 is out of range"),
            (23, "not a PCI bus ID"),
            (24, "not a GPU UUID"),
            (29, "more than GPU 5's memory"),
            (30, "repeats GPU instance 0 / compute instance 0"),
            (32, "not a MIG profile name"),
            (34, "makes profile 3g.10gb, not 3g.40gb"),
            (36, "not a MIG UUID"),
            (27, "need 11 GPU slices, more than the 7 a GPU has"),
        ];
        for (line, text) in expected {
            assert!(has(&found, *line, text), "missing line {line}: {text}\nfound: {found:#?}");
        }
        assert_eq!(found.len(), expected.len() + 2, "unexpected extra problems: {found:#?}");
        // Two more: GPU instance 0 shared by 7g and 3g (line 30) and MIG memory over the GPU's.
        assert!(has(&found, 30, "shares GPU instance 0"), "{found:#?}");
        assert!(has(&found, 27, "need"), "{found:#?}");
        let lines: Vec<_> = found.iter().map(|p| p.line).collect();
        assert!(lines.windows(2).all(|w| w[0] <= w[1]), "ordered by line: {lines:?}");

        let err = parse_topology(yaml, Path::new("bad.yaml"), None).expect_err("invalid");
        let text = err.to_string();
        assert!(text.starts_with("bad.yaml: invalid topology (19 problems):"), "{text}");
        assert!(text.contains("\n  bad.yaml:3: NVLink group names GPU 7"), "{text}");
    }

    #[test]
    fn nvswitch_with_explicit_links_is_a_problem() {
        let yaml = "\
nvlink:
  nvswitch: true
  groups: [[0, 1]]
gpus:
  - {index: 0, model: X, memory: 1GiB, pci_bus_id: '0000:01:00.0'}
  - {index: 1, model: X, memory: 1GiB, pci_bus_id: '0000:02:00.0'}
";
        let found = problems(yaml);
        assert_eq!(found.len(), 1, "{found:#?}");
        assert!(has(&found, 2, "already makes every GPU a peer"), "{found:#?}");
    }

    #[test]
    fn one_sided_nvlink_peers_are_a_problem() {
        let yaml = "\
gpus:
  - {index: 0, model: X, memory: 1GiB, pci_bus_id: '0000:01:00.0', nvlink_peers: [1, 2]}
  - {index: 1, model: X, memory: 1GiB, pci_bus_id: '0000:02:00.0', nvlink_peers: [0]}
  - {index: 2, model: X, memory: 1GiB, pci_bus_id: '0000:03:00.0'}
";
        let found = problems(yaml);
        assert_eq!(found.len(), 1, "{found:#?}");
        assert!(has(&found, 2, "GPU 0 lists GPU 2 as an NVLink peer, but GPU 2 does not"));
    }

    #[test]
    fn self_and_unknown_peers_are_problems() {
        let yaml = "\
gpus:
  - {index: 0, model: X, memory: 1GiB, pci_bus_id: '0000:01:00.0', nvlink_peers: [0, 4]}
";
        let found = problems(yaml);
        assert!(has(&found, 2, "lists itself"), "{found:#?}");
        assert!(has(&found, 2, "peer GPU 4 does not exist"), "{found:#?}");
    }

    #[test]
    fn compute_instances_may_share_a_gpu_instance() {
        let yaml = "\
gpus:
  - index: 0
    model: NVIDIA A100-SXM4-80GB
    memory: 81920MiB
    pci_bus_id: '0000:07:00.0'
    mig:
      mode: enabled
      instances:
        - {profile: 1c.3g.40gb, gpu_instance_id: 1, compute_instance_id: 0}
        - {profile: 2c.3g.40gb, gpu_instance_id: 1, compute_instance_id: 1}
        - {profile: 3g.40gb, gpu_instance_id: 2, compute_instance_id: 0, uuid: MIG-fixed}
";
        let inventory = parse_topology(yaml, Path::new("ok.yaml"), None).expect("valid");
        let instances = inventory.gpus[0].mig.instances();
        assert_eq!(instances.len(), 3);
        assert_eq!(instances[0].profile, "1c.3g.40gb");
        assert_eq!(instances[1].profile, "2c.3g.40gb");
        assert_eq!(instances[0].memory_bytes, instances[1].memory_bytes);
        assert_eq!(instances[2].uuid.as_str(), "MIG-fixed");
        assert_ne!(instances[0].uuid, instances[1].uuid);
    }

    #[test]
    fn mig_enabled_without_instances_is_enabled_and_empty() {
        let yaml = "\
gpus:
  - index: 0
    model: X
    memory: 80GiB
    pci_bus_id: '0000:07:00.0'
    mig: {mode: enabled}
";
        let inventory = parse_topology(yaml, Path::new("ok.yaml"), None).expect("valid");
        assert_eq!(inventory.gpus[0].mig, MigState::Enabled { instances: vec![] });
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
        assert!(matches!(backend.inject_xid(&unknown, 79), Err(InventoryError::UnknownGpu(_))));
    }
}
