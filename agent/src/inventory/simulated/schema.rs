//! The serde types of a topology file, field for field as `docs/inventory.md` documents them;
//! unknown fields are rejected. Only the loader (`validate`) reads them; what the values must
//! satisfy beyond their types is checked there.

use serde::Deserialize;

use crate::quantity::Quantity;

/// The whole file.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct TopologyFile {
    #[serde(default)]
    pub(super) node: Option<String>,
    #[serde(default)]
    pub(super) driver_version: Option<String>,
    #[serde(default)]
    pub(super) nvlink: NvlinkSpec,
    pub(super) gpus: Vec<GpuSpec>,
}

/// The `nvlink` section: NVSwitch, or groups of directly linked GPUs.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct NvlinkSpec {
    #[serde(default)]
    pub(super) nvswitch: bool,
    #[serde(default)]
    pub(super) groups: Vec<Vec<u32>>,
}

/// One entry of `gpus`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct GpuSpec {
    pub(super) index: u32,
    pub(super) model: String,
    pub(super) memory: Quantity,
    pub(super) pci_bus_id: String,
    #[serde(default)]
    pub(super) numa_node: Option<u32>,
    #[serde(default)]
    pub(super) cuda_compute_capability: Option<String>,
    #[serde(default)]
    pub(super) uuid: Option<String>,
    #[serde(default)]
    pub(super) nvlink_peers: Vec<u32>,
    #[serde(default)]
    pub(super) mig: Option<MigSpec>,
}

/// A GPU's `mig` section.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct MigSpec {
    pub(super) mode: MigMode,
    #[serde(default)]
    pub(super) instances: Vec<MigInstanceSpec>,
}

/// `mig.mode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(super) enum MigMode {
    Enabled,
    Disabled,
}

/// One entry of `mig.instances`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct MigInstanceSpec {
    pub(super) profile: String,
    #[serde(default)]
    pub(super) memory: Option<Quantity>,
    #[serde(default)]
    pub(super) uuid: Option<String>,
    #[serde(default)]
    pub(super) gpu_instance_id: Option<u32>,
    #[serde(default)]
    pub(super) compute_instance_id: Option<u32>,
}
