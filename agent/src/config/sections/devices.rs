//! How Allocate answers hand out GPUs: `deviceListStrategy`, `cdi:` and the toolkit's settings
//! (`paths.toolkitConfig`).

use std::path::PathBuf;

use serde::Deserialize;

use super::{Sources, place};
use crate::defaults;
use crate::isolation::devices::{DeviceListConfig, Strategy};
use crate::yaml::{Problems, Seg};

/// `cdi:` in the file.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CdiFile {
    /// Removed (replaced by `deviceListStrategy`); reported if set.
    pub enabled: Option<bool>,
    /// The CDI kind of the node's spec (default `nvidia.com/gpu`).
    pub kind: Option<String>,
    /// Where CDI specs are read (default `/etc/cdi`, `/var/run/cdi`).
    pub spec_dirs: Option<Vec<PathBuf>>,
}

/// How containers are given their GPUs.
pub(in crate::config) fn resolve(src: &Sources<'_>, problems: &mut Problems) -> DeviceListConfig {
    let (file, args) = (src.file, src.args);
    if file.cdi.enabled.is_some() {
        problems.add(
            &[Seg::Key("cdi"), Seg::Key("enabled")],
            "cdi.enabled is replaced by deviceListStrategy: cdi (the default), volume-mounts or envvar; remove it",
        );
    }
    let strategy_name = args
        .device_list_strategy
        .clone()
        .or(file.device_list_strategy.clone())
        .unwrap_or_else(|| defaults::DEVICE_LIST_STRATEGY.into());
    let strategy = Strategy::parse(&strategy_name).unwrap_or_else(|| {
        problems.add(
            place(args.device_list_strategy.is_some(), &[Seg::Key("deviceListStrategy")]),
            format!("deviceListStrategy {strategy_name:?} is none of cdi, volume-mounts, envvar"),
        );
        Strategy::Cdi
    });
    let cdi_kind = file.cdi.kind.clone().unwrap_or_else(|| defaults::CDI_KIND.into());
    let (vendor, class) = cdi_kind.split_once('/').unwrap_or(("", ""));
    if vendor.is_empty() || class.is_empty() || class.contains('/') || cdi_kind.contains('=') {
        problems.add(
            &[Seg::Key("cdi"), Seg::Key("kind")],
            format!("cdi.kind {cdi_kind:?} must look like vendor.com/class"),
        );
    }
    DeviceListConfig {
        strategy,
        cdi_kind,
        cdi_spec_dirs: file
            .cdi
            .spec_dirs
            .clone()
            .unwrap_or_else(|| defaults::CDI_SPEC_DIRS.iter().map(PathBuf::from).collect()),
        toolkit_config: file
            .paths
            .toolkit_config
            .clone()
            .unwrap_or_else(|| PathBuf::from(defaults::TOOLKIT_CONFIG)),
    }
}
