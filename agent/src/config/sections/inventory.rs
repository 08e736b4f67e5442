//! Where the GPUs come from (`inventory:`): NVML (default) or a simulated topology.

use std::path::PathBuf;

use serde::Deserialize;

use super::{Sources, place};
use crate::config::InventorySource;
use crate::defaults;
use crate::yaml::{Problems, Seg};

/// `inventory:` in the file.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct InventoryFile {
    /// A simulated topology file instead of NVML.
    pub simulated: Option<PathBuf>,
    /// The NVML library (default `libnvidia-ml.so.1`).
    pub nvml_library: Option<PathBuf>,
    /// Where sysfs is mounted (default `/sys`).
    pub sysfs_root: Option<PathBuf>,
}

/// The GPU backend of node `node_name`.
pub(in crate::config) fn resolve(
    src: &Sources<'_>,
    node_name: String,
    problems: &mut Problems,
) -> InventorySource {
    let (args, file) = (src.args, &src.file.inventory);
    let simulated = args.simulated.clone().or(file.simulated.clone());
    let nvml_lib = args.nvml_lib.clone().or(file.nvml_library.clone());
    if simulated.is_some() && nvml_lib.is_some() {
        problems.general("choose either a simulated topology or an NVML library, not both");
    }
    if let Some(path) = &simulated
        && !path.is_file()
    {
        problems.add(
            place(args.simulated.is_some(), &[Seg::Key("inventory"), Seg::Key("simulated")]),
            format!("inventory.simulated {} does not exist", path.display()),
        );
    }
    InventorySource {
        simulated,
        nvml_lib,
        sysfs_root: file.sysfs_root.clone().unwrap_or_else(|| PathBuf::from(defaults::SYSFS_ROOT)),
        node_name: Some(node_name),
    }
}
