//! What a node's GPUs are, whatever the backend: the [`Inventory`] and its [`Gpu`]s, their MIG
//! instances and profiles, the UUID types, and PCI bus IDs as NVML and sysfs write them.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use super::{GIB, MIB};

/// A string that is not a valid GPU or MIG UUID.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "`{value}` is not a {kind} UUID: expected `{prefix}` followed by letters, digits and dashes"
)]
pub struct InvalidUuid {
    /// The rejected text.
    pub value: String,
    /// "GPU" or "MIG".
    pub kind: &'static str,
    /// The expected prefix, `GPU-` or `MIG-`.
    pub prefix: &'static str,
}

fn check_uuid(value: &str, kind: &'static str, prefix: &'static str) -> Result<(), InvalidUuid> {
    let rest = value.strip_prefix(prefix);
    let ok = rest.is_some_and(|rest| {
        !rest.is_empty() && rest.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
    });
    if ok { Ok(()) } else { Err(InvalidUuid { value: value.to_owned(), kind, prefix }) }
}

macro_rules! uuid_newtype {
    ($(#[$doc:meta])* $name:ident, $kind:literal, $prefix:literal) => {
        $(#[$doc])*
        #[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
        #[serde(try_from = "String", into = "String")]
        pub struct $name(pub(in crate::inventory) String);

        impl $name {
            /// Checks the prefix and the characters, and wraps the text.
            pub fn new(value: impl Into<String>) -> Result<Self, InvalidUuid> {
                let value = value.into();
                check_uuid(&value, $kind, $prefix)?;
                Ok(Self(value))
            }

            /// The UUID as NVML prints it.
            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl FromStr for $name {
            type Err = InvalidUuid;
            fn from_str(s: &str) -> Result<Self, Self::Err> {
                Self::new(s)
            }
        }

        impl TryFrom<String> for $name {
            type Error = InvalidUuid;
            fn try_from(value: String) -> Result<Self, Self::Error> {
                Self::new(value)
            }
        }

        impl From<$name> for String {
            fn from(value: $name) -> String {
                value.0
            }
        }
    };
}

uuid_newtype!(
    /// The UUID of a physical GPU, e.g. `GPU-5a6c8d6e-2f59-4f7b-9a1e-0c2d4b6f8a10`; always starts
    /// with `GPU-`.
    GpuUuid,
    "GPU",
    "GPU-"
);
uuid_newtype!(
    /// The UUID of a MIG instance, e.g. `MIG-0b1f6a4e-...`; always starts with `MIG-`.
    MigUuid,
    "MIG",
    "MIG-"
);

/// What the agent knows about a node's GPUs at one moment.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Inventory {
    /// The NVIDIA driver version (e.g. `570.124.06`), when the backend knows it.
    pub driver_version: Option<String>,
    /// The GPUs, ordered by [`Gpu::index`].
    pub gpus: Vec<Gpu>,
    /// The GPUs the backend counts but cannot read (NVML errors at discovery): the agent serves
    /// the others, and keeps what was held on these held (see `crate::ledger`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub unreadable: Vec<UnreadableGpu>,
}

/// A GPU the backend counts but cannot read.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UnreadableGpu {
    /// NVML's index.
    pub index: u32,
    /// Its UUID, when even that could be read.
    pub uuid: Option<GpuUuid>,
    /// What failed.
    pub error: String,
}

impl Inventory {
    /// The GPU with this UUID, if the node has it.
    pub fn gpu(&self, uuid: &GpuUuid) -> Option<&Gpu> {
        self.gpus.iter().find(|gpu| &gpu.uuid == uuid)
    }
}

/// One physical GPU.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Gpu {
    /// NVML's index (0..count), the order of `nvidia-smi`.
    pub index: u32,
    /// The GPU's UUID.
    pub uuid: GpuUuid,
    /// The product name, e.g. `NVIDIA H200`.
    pub name: String,
    /// Total memory in bytes, as NVML reports it (e.g. 143771 MiB on an H200 141GB).
    pub memory_bytes: u64,
    /// The PCI bus ID, normalised as NVML prints it: `00000000:19:00.0` (8-digit domain, uppercase
    /// hex). See [`normalize_pci_bus_id`].
    pub pci_bus_id: String,
    /// The NUMA node of the GPU's PCI device, `None` when the platform has no NUMA information.
    pub numa_node: Option<u32>,
    /// The CUDA compute capability, `major.minor` (`9.0` on an H200), where it was read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cuda_compute_capability: Option<String>,
    /// The GPUs reachable from this one over NVLink (directly or through NVSwitch), sorted.
    pub nvlink_peers: Vec<GpuUuid>,
    /// MIG mode and, when enabled, the MIG instances that exist.
    pub mig: MigState,
}

/// Whether a GPU is split into MIG instances.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "mode", rename_all = "snake_case")]
pub enum MigState {
    /// MIG is off (or the GPU does not support it): the GPU is used whole.
    Disabled,
    /// MIG is on; the instances that currently exist (possibly none), ordered by GPU-instance
    /// ID then compute-instance ID.
    Enabled {
        /// The MIG devices.
        instances: Vec<MigInstance>,
    },
}

impl MigState {
    /// The MIG instances (none when MIG is disabled).
    pub fn instances(&self) -> &[MigInstance] {
        match self {
            MigState::Disabled => &[],
            MigState::Enabled { instances } => instances,
        }
    }

    /// Whether MIG mode is on.
    pub fn is_enabled(&self) -> bool {
        matches!(self, MigState::Enabled { .. })
    }
}

/// One MIG device (a compute instance inside a GPU instance).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MigInstance {
    /// The MIG device's UUID.
    pub uuid: MigUuid,
    /// The profile name as NVIDIA's device plugin names it, e.g. `1g.10gb` or `1c.3g.40gb`
    /// (see [`MigProfile`]).
    pub profile: String,
    /// The memory the MIG device offers, in bytes.
    pub memory_bytes: u64,
    /// The GPU-instance ID on its GPU.
    pub gpu_instance_id: u32,
    /// The compute-instance ID inside its GPU instance.
    pub compute_instance_id: u32,
}

/// A MIG profile: GPU-instance slices, compute-instance slices and memory in (rounded) GB.
///
/// Named the way NVIDIA's k8s-device-plugin (go-nvlib) names MIG devices: `<g>g.<gb>gb`, with a
/// `<c>c.` prefix when the compute instance has fewer slices than its GPU instance. Profiles with
/// attributes (`+me`, `+gfx`) are not modelled.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MigProfile {
    /// Compute-instance slices.
    pub compute_slices: u32,
    /// GPU-instance slices.
    pub gpu_slices: u32,
    /// Memory in GB as the name shows it.
    pub memory_gb: u64,
}

/// A MIG profile name that does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "`{0}` is not a MIG profile name: expected `<g>g.<gb>gb` or `<c>c.<g>g.<gb>gb`, e.g. \
     `1g.10gb`, `3g.40gb` or `1c.3g.40gb` (profiles with attributes such as `+me` are not supported)"
)]
pub struct InvalidMigProfile(pub String);

impl MigProfile {
    /// The profile of a MIG device from its attributes, the way go-nvlib computes it: the MIG
    /// memory as a fraction of the parent GPU's memory, rounded up to eighths, times the GPU's
    /// memory in whole GB (rounded up), rounded to the nearest GB.
    pub fn from_attributes(
        gpu_slices: u32,
        compute_slices: u32,
        mig_memory_mib: u64,
        gpu_memory_bytes: u64,
    ) -> Self {
        Self {
            compute_slices,
            gpu_slices,
            memory_gb: mig_memory_gb(gpu_memory_bytes, mig_memory_mib),
        }
    }

    /// The largest MIG memory size, in MiB, that still gets this profile's GB figure on a GPU
    /// with `gpu_memory_bytes`, or `None` when no size does (the GB figure does not fit the GPU).
    ///
    /// The simulated backend uses it as the default memory of a MIG instance whose size the
    /// topology file does not give.
    pub fn default_memory_mib(&self, gpu_memory_bytes: u64) -> Option<u64> {
        (1..=8u64).rev().find_map(|eighths| {
            let mib = gpu_memory_bytes / 8 * eighths / MIB;
            (mig_memory_gb(gpu_memory_bytes, mib) == self.memory_gb).then_some(mib)
        })
    }
}

/// go-nvlib's `getMigMemorySizeGB`.
fn mig_memory_gb(gpu_memory_bytes: u64, mig_memory_mib: u64) -> u64 {
    if gpu_memory_bytes == 0 {
        return 0;
    }
    const EIGHTHS: f64 = 8.0;
    let fraction = (mig_memory_mib as f64 * MIB as f64) / gpu_memory_bytes as f64;
    let fraction = (fraction * EIGHTHS).ceil() / EIGHTHS;
    let total_gb = gpu_memory_bytes.div_ceil(GIB) as f64;
    round_gb(fraction * total_gb)
}

/// A non-negative size in GB from its real value: rounded, and `as` saturates (a negative or NaN
/// value, impossible here, would give 0).
#[allow(
    clippy::cast_possible_truncation,
    clippy::cast_sign_loss,
    reason = "a rounded, non-negative size far below 2^64"
)]
fn round_gb(gb: f64) -> u64 {
    gb.round() as u64
}

impl fmt::Display for MigProfile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.compute_slices != self.gpu_slices {
            write!(f, "{}c.", self.compute_slices)?;
        }
        write!(f, "{}g.{}gb", self.gpu_slices, self.memory_gb)
    }
}

impl FromStr for MigProfile {
    type Err = InvalidMigProfile;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let invalid = || InvalidMigProfile(s.to_owned());
        let number = |part: &str, suffix: &str| -> Option<u64> {
            let digits = part.strip_suffix(suffix)?;
            if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
                return None;
            }
            digits.parse().ok()
        };
        let parts: Vec<&str> = s.split('.').collect();
        let (compute, gpu, memory) = match parts.as_slice() {
            [g, gb] => (None, *g, *gb),
            [c, g, gb] => (Some(*c), *g, *gb),
            _ => return Err(invalid()),
        };
        let gpu_slices =
            number(gpu, "g").and_then(|n| u32::try_from(n).ok()).ok_or_else(invalid)?;
        let memory_gb = number(memory, "gb").ok_or_else(invalid)?;
        let compute_slices = match compute {
            None => gpu_slices,
            Some(c) => number(c, "c").and_then(|n| u32::try_from(n).ok()).ok_or_else(invalid)?,
        };
        if gpu_slices == 0 || compute_slices == 0 || compute_slices > gpu_slices {
            return Err(invalid());
        }
        Ok(Self { compute_slices, gpu_slices, memory_gb })
    }
}

/// A PCI bus ID that does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "`{0}` is not a PCI bus ID: expected `domain:bus:device.function` in hex, e.g. \
     `00000000:19:00.0` or `0000:19:00.0`"
)]
pub struct InvalidPciBusId(pub String);

/// Normalises a PCI bus ID to NVML's form: 8-digit domain, uppercase hex, e.g.
/// `0000:3b:00.0` becomes `00000000:3B:00.0`.
pub fn normalize_pci_bus_id(bus_id: &str) -> Result<String, InvalidPciBusId> {
    let invalid = || InvalidPciBusId(bus_id.to_owned());
    let hex = |part: &str, max_len: usize| -> Option<u32> {
        if part.is_empty() || part.len() > max_len {
            return None;
        }
        u32::from_str_radix(part, 16).ok()
    };
    let (domain, rest) = bus_id.split_once(':').ok_or_else(invalid)?;
    let (bus, rest) = rest.split_once(':').ok_or_else(invalid)?;
    let (device, function) = rest.split_once('.').ok_or_else(invalid)?;
    let domain = hex(domain, 8).ok_or_else(invalid)?;
    let bus = hex(bus, 2).ok_or_else(invalid)?;
    let device = hex(device, 2).filter(|d| *d < 32).ok_or_else(invalid)?;
    let function = hex(function, 1).filter(|f| *f < 8).ok_or_else(invalid)?;
    Ok(format!("{domain:08X}:{bus:02X}:{device:02X}.{function:X}"))
}

/// The name of a GPU's directory under `/sys/bus/pci/devices/` for a normalised bus ID:
/// lowercase, the domain printed as the kernel does (`%04x`: `00000000:3B:00.0` becomes
/// `0000:3b:00.0`, a VMD domain `00010000:01:00.0` becomes `10000:01:00.0`).
pub fn pci_sysfs_name(normalized_bus_id: &str) -> String {
    let lower = normalized_bus_id.to_ascii_lowercase();
    match lower.split_once(':') {
        Some((domain, rest)) => match u32::from_str_radix(domain, 16) {
            Ok(value) => format!("{value:04x}:{rest}"),
            Err(_) => lower,
        },
        None => lower,
    }
}
