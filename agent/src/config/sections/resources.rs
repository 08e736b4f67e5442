//! What the node offers: `memoryUnit` and `resources:` (which views, NVLink group sizes).

use serde::Deserialize;

use super::{Sources, place};
use crate::config::parse_memory_unit;
use crate::defaults;
use crate::ledger::ViewConfig;
use crate::yaml::{Problems, Seg};

/// `resources:` in the file.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ResourcesFile {
    /// Offer whole GPUs (default true).
    pub gpu: Option<bool>,
    /// Offer gpu-memory units (default true).
    pub gpu_memory: Option<bool>,
    /// Offer MIG slices (default true).
    pub mig: Option<bool>,
    /// NVLink group sizes to offer (default [2, 4, 8]).
    pub nvlink_group_sizes: Option<Vec<u32>>,
}

/// The views, their names under `domain` and the unit.
pub(in crate::config) fn resolve(
    src: &Sources<'_>,
    domain: String,
    problems: &mut Problems,
) -> ViewConfig {
    let file = &src.file.resources;
    let unit_text = src
        .args
        .memory_unit
        .clone()
        .or(src.file.memory_unit.clone())
        .unwrap_or_else(|| defaults::MEMORY_UNIT.into());
    let memory_unit_bytes = parse_memory_unit(&unit_text).unwrap_or_else(|problem| {
        problems.add(place(src.args.memory_unit.is_some(), &[Seg::Key("memoryUnit")]), problem);
        defaults::MEMORY_UNIT_BYTES
    });
    let sizes =
        file.nvlink_group_sizes.clone().unwrap_or_else(|| defaults::NVLINK_GROUP_SIZES.to_vec());
    for (i, &n) in sizes.iter().enumerate() {
        if !(2..=64).contains(&n) {
            problems.add(
                &[Seg::Key("resources"), Seg::Key("nvlinkGroupSizes"), Seg::Index(i)],
                format!("resources.nvlinkGroupSizes[{i}] {n} is not between 2 and 64"),
            );
        }
    }
    ViewConfig {
        domain,
        memory_unit_bytes,
        whole_gpus: file.gpu.unwrap_or(true),
        gpu_memory: file.gpu_memory.unwrap_or(true),
        mig: file.mig.unwrap_or(true),
        nvlink_group_sizes: sizes,
    }
}
