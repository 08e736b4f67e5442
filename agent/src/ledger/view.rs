//! The resource views of the device ledger and how they are offered: [`View`] (whole GPUs,
//! memory units, MIG instances of one profile, NVLink groups of one size) and [`ViewConfig`]
//! (resource domain, unit size, which views). Used by the ledger, the device-plugin adapter and
//! the configuration.

use std::fmt;

use crate::defaults;

/// How the ledger is offered: resource names, unit size, which views.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ViewConfig {
    /// Resource domain, e.g. `awesome-ai-company.com`.
    pub domain: String,
    /// Bytes of GPU memory per gpu-memory unit (default 1 GiB).
    pub memory_unit_bytes: u64,
    /// Offer whole GPUs (`<domain>/gpu`).
    pub whole_gpus: bool,
    /// Offer memory units (`<domain>/gpu-memory`).
    pub gpu_memory: bool,
    /// Offer MIG instances (`<domain>/mig-<profile>`).
    pub mig: bool,
    /// Sizes of NVLink groups to offer (`<domain>/nvlink-group-<n>`).
    pub nvlink_group_sizes: Vec<u32>,
}

impl Default for ViewConfig {
    fn default() -> Self {
        Self {
            domain: defaults::DOMAIN.into(),
            memory_unit_bytes: defaults::MEMORY_UNIT_BYTES,
            whole_gpus: true,
            gpu_memory: true,
            mig: true,
            nvlink_group_sizes: defaults::NVLINK_GROUP_SIZES.to_vec(),
        }
    }
}

/// One resource view of the ledger.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum View {
    /// Whole GPUs.
    Gpu,
    /// Memory units of one GPU.
    GpuMemory,
    /// MIG instances of one profile.
    Mig(String),
    /// Groups of `n` NVLink-connected GPUs.
    NvlinkGroup(u32),
}

impl View {
    /// The extended resource name of the view in `domain`.
    pub fn resource_name(&self, domain: &str) -> String {
        format!("{domain}/{self}")
    }

    /// Whether an allocation of this view takes its GPUs whole (`gpu`, `nvlink-group-<n>`).
    pub(crate) fn is_whole(&self) -> bool {
        matches!(self, View::Gpu | View::NvlinkGroup(_))
    }
}

impl fmt::Display for View {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            View::Gpu => f.write_str("gpu"),
            View::GpuMemory => f.write_str("gpu-memory"),
            View::Mig(p) => write!(f, "mig-{p}"),
            View::NvlinkGroup(n) => write!(f, "nvlink-group-{n}"),
        }
    }
}
