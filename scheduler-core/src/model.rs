//! What placement reasons about: nodes with their GPUs, and requests.
//!
//! These are plain descriptions; what is allocated lives in [`crate::ledger`]. The agent builds
//! them from its GPU inventory, the extender from published node state, the replay tool from a
//! trace.

use crate::units::{MemMib, MemUnits, MilliCpu, MilliGpu};
use serde::{Deserialize, Serialize};
use std::fmt;
use std::sync::Arc;

/// A GPU model name as the cluster knows it (`A100-SXM4-80GB`, `T4`, `G2`, ...).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct GpuModel(Arc<str>);

impl GpuModel {
    /// A model with the given name.
    pub fn new(name: &str) -> Self {
        Self(Arc::from(name))
    }

    /// The model's name.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for GpuModel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// One MIG instance carved out of a GPU.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MigInstance {
    /// The instance's MIG UUID (`MIG-...`).
    pub uuid: String,
    /// The profile name, e.g. `1g.18gb`.
    pub profile: String,
    /// The instance's memory.
    pub memory: MemMib,
}

/// One physical GPU of a node.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuSpec {
    /// A stable identifier: the GPU UUID on a real node, a synthetic name in a trace.
    pub id: String,
    /// The GPU model.
    pub model: GpuModel,
    /// Memory of the GPU in allocation units (0 where memory is not tracked, as in the traces).
    pub memory_units: MemUnits,
    /// The NUMA node the GPU is attached to, if known.
    pub numa_node: Option<u32>,
    /// Indices (within the node) of the GPUs this one reaches over NVLink.
    pub nvlink_peers: Vec<usize>,
    /// MIG instances, when the GPU is in MIG mode.
    pub mig: Vec<MigInstance>,
}

impl GpuSpec {
    /// A GPU of the given model with no memory tracking, topology or MIG: what a trace describes.
    pub fn plain(id: String, model: GpuModel) -> Self {
        Self {
            id,
            model,
            memory_units: MemUnits::ZERO,
            numa_node: None,
            nvlink_peers: Vec::new(),
            mig: Vec::new(),
        }
    }
}

/// The most GPUs one node may have: device sets are 64-bit masks.
pub const MAX_GPUS_PER_NODE: usize = 64;

/// A node's capacity.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeSpec {
    /// The node name.
    pub name: String,
    /// Allocatable CPU.
    pub cpu: MilliCpu,
    /// Allocatable host memory.
    pub memory: MemMib,
    /// The GPUs, in device-index order.
    pub gpus: Vec<GpuSpec>,
}

/// What a request needs of GPUs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum GpuDemand {
    /// No GPU (a CPU-only task).
    None,
    /// A share of ONE GPU: compute in milli-GPU (below 1000) and memory units (0 = untracked).
    Shared {
        /// Compute share.
        milli: MilliGpu,
        /// GPU memory.
        memory: MemUnits,
    },
    /// `count` whole GPUs, each fully free.
    Whole {
        /// Number of GPUs, at least 1.
        count: u32,
    },
}

impl GpuDemand {
    /// Number of GPUs touched.
    pub fn gpu_count(&self) -> u32 {
        match *self {
            GpuDemand::None => 0,
            GpuDemand::Shared { .. } => 1,
            GpuDemand::Whole { count } => count,
        }
    }

    /// Compute needed on each touched GPU (0 for CPU-only).
    pub fn milli_per_gpu(&self) -> MilliGpu {
        match *self {
            GpuDemand::None => MilliGpu::ZERO,
            GpuDemand::Shared { milli, .. } => milli,
            GpuDemand::Whole { .. } => MilliGpu::WHOLE,
        }
    }

    /// Memory units needed on each touched GPU (whole GPUs take all of theirs).
    pub fn memory_per_gpu(&self) -> MemUnits {
        match *self {
            GpuDemand::Shared { memory, .. } => memory,
            GpuDemand::None | GpuDemand::Whole { .. } => MemUnits::ZERO,
        }
    }

    /// Total GPU demand in milli-GPU: `count * share`.
    pub fn total_milli(&self) -> u64 {
        u64::from(self.gpu_count()) * u64::from(self.milli_per_gpu().0)
    }

    /// The class of GPU task, as GPU-clustering groups them: `None` for CPU-only, `Some(0)` for a
    /// shared GPU, `Some(k)` for `k` whole GPUs.
    pub fn class(&self) -> Option<u32> {
        match *self {
            GpuDemand::None => None,
            GpuDemand::Shared { .. } => Some(0),
            GpuDemand::Whole { count } => Some(count),
        }
    }
}

/// One container's (or task's) request.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Request {
    /// CPU.
    pub cpu: MilliCpu,
    /// Host memory.
    pub memory: MemMib,
    /// GPUs.
    pub gpu: GpuDemand,
    /// GPU models allowed; empty means any.
    pub allowed_models: Vec<GpuModel>,
}

impl Request {
    /// Whether a GPU of `model` may serve this request.
    pub fn allows_model(&self, model: &GpuModel) -> bool {
        self.allowed_models.is_empty() || self.allowed_models.contains(model)
    }
}

/// A set of GPUs of one node, by device index.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct GpuSet(u64);

impl GpuSet {
    /// The empty set.
    pub const EMPTY: Self = Self(0);

    /// A set holding the given indices; `None` if one is `MAX_GPUS_PER_NODE` or more.
    pub fn from_indices(indices: impl IntoIterator<Item = usize>) -> Option<Self> {
        let mut set = Self::EMPTY;
        for i in indices {
            if i >= MAX_GPUS_PER_NODE {
                return None;
            }
            set.0 |= 1 << i;
        }
        Some(set)
    }

    /// A set with one index (below [`MAX_GPUS_PER_NODE`]).
    pub fn single(index: usize) -> Self {
        debug_assert!(index < MAX_GPUS_PER_NODE);
        Self(1 << index)
    }

    /// Adds `index` (below [`MAX_GPUS_PER_NODE`]).
    pub fn insert(&mut self, index: usize) {
        debug_assert!(index < MAX_GPUS_PER_NODE);
        self.0 |= 1 << index;
    }

    /// Whether `index` is in the set.
    pub fn contains(&self, index: usize) -> bool {
        index < MAX_GPUS_PER_NODE && self.0 & (1 << index) != 0
    }

    /// Number of GPUs in the set.
    pub fn len(&self) -> usize {
        self.0.count_ones() as usize
    }

    /// Whether the set is empty.
    pub fn is_empty(&self) -> bool {
        self.0 == 0
    }

    /// The indices, ascending.
    pub fn iter(&self) -> impl Iterator<Item = usize> + '_ {
        // Visits the set bits only (lowest first), not all 64 positions: scoring iterates
        // sets in its innermost loops.
        let mut bits = self.0;
        std::iter::from_fn(move || {
            if bits == 0 {
                return None;
            }
            let i = bits.trailing_zeros() as usize;
            bits &= bits - 1;
            Some(i)
        })
    }
}
