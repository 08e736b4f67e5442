//! MPS (`mps:`): whether gpu-memory grants are enforced, the daemons and the clients' share.

use std::path::PathBuf;

use serde::Deserialize;

use super::{Sources, duration};
use crate::defaults;
use crate::isolation::mps::{DaemonPlacement, MpsConfig, ThreadPercentage};
use crate::yaml::{Problems, Seg};

/// `mps:` in the file.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MpsFile {
    /// Enforce gpu-memory grants with MPS (default true); false: accounting only.
    pub enabled: Option<bool>,
    /// The control binary (default: `nvidia-cuda-mps-control` on `PATH`).
    pub control_binary: Option<PathBuf>,
    /// Time between probes of each daemon, e.g. `5s` (default).
    pub probe_interval: Option<String>,
    /// How long a probe may take, e.g. `2s` (default).
    pub probe_timeout: Option<String>,
    /// Tell the daemons to quit when the agent stops (default false).
    pub stop_on_exit: Option<bool>,
    /// `proportional` (default), `none`, or a percentage 1..100.
    pub thread_percentage: Option<serde_yaml_ng::Value>,
    /// Who owns the daemons: `agent` (default) or `external`.
    pub daemons: Option<String>,
}

/// Whether MPS is on: `--no-mps` wins over the file.
pub(in crate::config) fn enabled(src: &Sources<'_>) -> bool {
    !src.args.no_mps && src.file.mps.enabled.unwrap_or(true)
}

/// The MPS settings; the daemons' directories under `root` (`paths.mpsRoot`).
pub(in crate::config) fn resolve(
    src: &Sources<'_>,
    root: PathBuf,
    problems: &mut Problems,
) -> MpsConfig {
    let file = &src.file.mps;
    let at = |key| [Seg::Key("mps"), Seg::Key(key)];
    let probe_interval = duration(
        problems,
        &at("probeInterval"),
        "mps.probeInterval",
        file.probe_interval.as_ref(),
        defaults::MPS_PROBE_INTERVAL,
    );
    let probe_timeout = duration(
        problems,
        &at("probeTimeout"),
        "mps.probeTimeout",
        file.probe_timeout.as_ref(),
        defaults::MPS_PROBE_TIMEOUT,
    );
    let thread_percentage =
        thread_percentage(file.thread_percentage.as_ref()).unwrap_or_else(|problem| {
            problems.add(&at("threadPercentage"), problem);
            ThreadPercentage::Proportional
        });
    let daemons = match file.daemons.as_deref().unwrap_or("agent") {
        "agent" => DaemonPlacement::Agent,
        "external" => DaemonPlacement::External,
        other => {
            problems.add(&at("daemons"), format!("mps.daemons {other:?} is not agent or external"));
            DaemonPlacement::Agent
        }
    };
    MpsConfig {
        enabled: enabled(src),
        root,
        control_binary: src
            .args
            .mps_control_binary
            .clone()
            .or(file.control_binary.clone())
            .unwrap_or_else(|| PathBuf::from(defaults::MPS_CONTROL_BINARY)),
        probe_interval,
        probe_timeout,
        stop_on_exit: file.stop_on_exit.unwrap_or(false),
        thread_percentage,
        daemons,
    }
}

fn thread_percentage(value: Option<&serde_yaml_ng::Value>) -> Result<ThreadPercentage, String> {
    use serde_yaml_ng::Value;
    match value {
        None => Ok(ThreadPercentage::Proportional),
        Some(Value::String(s)) if s == "proportional" => Ok(ThreadPercentage::Proportional),
        Some(Value::String(s)) if s == "none" => Ok(ThreadPercentage::None),
        Some(Value::Number(n)) => match n.as_u64().and_then(|n| u8::try_from(n).ok()) {
            Some(p @ 1..=100) => Ok(ThreadPercentage::Fixed(p)),
            _ => Err(format!("mps.threadPercentage {n} is not between 1 and 100")),
        },
        Some(other) => {
            Err(format!("mps.threadPercentage {other:?} is not proportional, none or a percentage"))
        }
    }
}
