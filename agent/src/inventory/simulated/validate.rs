//! Loading a topology file: parse its YAML into the `schema` types, then build
//! the [`Inventory`] while checking everything the types cannot (indices, UUIDs, PCI bus IDs,
//! NVLink symmetry, MIG profiles, slices and memory), collecting every problem rather than
//! stopping at the first, and finally `locate` each problem's line. The constructors of
//! [`SimulatedInventory`](super::SimulatedInventory) call [`parse_topology`].

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::Path;

use super::schema::{GpuSpec, MigMode, TopologyFile};
use super::uuid::{generated_gpu_uuid, generated_mig_uuid};
use super::{DEFAULT_NODE_NAME, TopologyError, TopologyProblem};
use crate::inventory::{
    Gpu, GpuUuid, Inventory, MIB, MigInstance, MigProfile, MigState, MigUuid, normalize_pci_bus_id,
};
use crate::yaml::{Problems, Seg};

/// The most memory a simulated GPU may have (16 TiB; the largest GPUs have under 300 GiB).
const MAX_GPU_MEMORY: u64 = 16 << 40;
/// GPU-instance slices of a MIG-capable GPU.
const MIG_GPU_SLICES: u32 = 7;

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

/// Parses and checks `text`, read from `path` (named in errors); `node_override`, when given,
/// seeds the generated UUIDs instead of the file's `node`.
pub(super) fn parse_topology(
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
    let mut problems = Problems::default();
    let inventory = build(&file, node, &mut problems);
    if problems.is_empty() {
        return Ok(inventory);
    }
    let located = problems
        .located(Some(text))
        .into_iter()
        .map(|p| TopologyProblem { line: p.line, message: p.message })
        .collect();
    Err(TopologyError::Invalid { path: path.to_owned(), problems: located })
}

/// Builds the inventory from a parsed file, recording every problem found.
fn build(file: &TopologyFile, node: &str, problems: &mut Problems) -> Inventory {
    let count = file.gpus.len();
    if count > baleen_scheduler_core::model::MAX_GPUS_PER_NODE {
        problems.add(
            &[Seg::Key("gpus")],
            format!(
                "{count} GPUs, more than the {} one node may have",
                baleen_scheduler_core::model::MAX_GPUS_PER_NODE
            ),
        );
    }

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
        } else if spec.memory.0 > MAX_GPU_MEMORY {
            problems.add(
                &gpu_field(position, "memory"),
                format!(
                    "GPU memory of {} bytes is more than {} TiB, more than any GPU has",
                    spec.memory.0,
                    MAX_GPU_MEMORY >> 40
                ),
            );
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
        let cc = spec.cuda_compute_capability.clone();
        let is_cc = |c: &str| {
            c.split_once('.').is_some_and(|(a, b)| {
                [a, b].iter().all(|p| !p.is_empty() && p.bytes().all(|x| x.is_ascii_digit()))
            })
        };
        if let Some(c) = cc.as_deref().filter(|c| !is_cc(c)) {
            problems.add(
                &gpu_field(position, "cuda_compute_capability"),
                format!("{c:?} is not a compute capability (major.minor, e.g. \"9.0\")"),
            );
        }
        gpus.push(Gpu {
            index: spec.index,
            uuid,
            name: spec.model.clone(),
            memory_bytes: spec.memory.0,
            pci_bus_id,
            numa_node: spec.numa_node,
            cuda_compute_capability: cc,
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
    Inventory { driver_version: file.driver_version.clone(), gpus, unreadable: Vec::new() }
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
        // Positions are few (a GPU has at most 7 MIG slices); the file is refused well before 2^32.
        let gpu_instance_id =
            inst.gpu_instance_id.unwrap_or_else(|| u32::try_from(i).unwrap_or(u32::MAX));
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
    // Summed wide: a profile like `4294967295g.10gb` must not wrap the sum back under 7.
    let slices: u64 = gpu_instances.values().map(|&(slices, _, _)| u64::from(slices)).sum();
    if slices > u64::from(MIG_GPU_SLICES) {
        problems.add(
            &with(gpu_field(position, "mig"), Seg::Key("instances")),
            format!(
                "the MIG GPU instances of GPU {} need {slices} GPU slices, more than the \
                 {MIG_GPU_SLICES} a GPU has",
                spec.index
            ),
        );
    }
    let total: u64 =
        gpu_instances.values().map(|&(_, memory, _)| memory).fold(0, u64::saturating_add);
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inventory::GIB;

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
}
