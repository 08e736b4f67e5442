//! How GPUs marked unhealthy are probed back (`health:`), with the MPS client probe.

use std::path::PathBuf;

use serde::Deserialize;

use super::{Sources, duration};
use crate::defaults;
use crate::isolation::mps::client_probe::{ClientProbe, PROBE_TIMEOUT};
use crate::run::health::HealthConfig;
use crate::yaml::{Problems, Seg};

/// `health:` in the file.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HealthFile {
    /// Time between two probes of an unhealthy GPU, e.g. `10s` (default).
    pub probe_interval: Option<String>,
    /// Good probes in a row that make it healthy again, 1..100 (default 3).
    pub recovery_probes: Option<u32>,
    /// Where MPS serves a GPU's shares, end each probe with a tiny MPS client (a CUDA context
    /// through the GPU's daemon, under a memory limit). Default: true with NVML, false with a
    /// simulated topology (no CUDA there).
    pub mps_client_probe: Option<bool>,
    /// The CUDA driver library the client loads (default `libcuda.so.1`).
    pub cuda_library: Option<PathBuf>,
}

/// The health settings; the MPS client probe where `mps_on` and GPUs come from NVML (or asked).
pub(in crate::config) fn resolve(
    src: &Sources<'_>,
    mps_on: bool,
    problems: &mut Problems,
) -> HealthConfig {
    let file = &src.file.health;
    let at = |key| [Seg::Key("health"), Seg::Key(key)];
    let probe_interval = duration(
        problems,
        &at("probeInterval"),
        "health.probeInterval",
        file.probe_interval.as_ref(),
        defaults::HEALTH_PROBE_INTERVAL,
    );
    let recovery_probes = match file.recovery_probes {
        None => defaults::HEALTH_RECOVERY_PROBES,
        Some(n @ 1..=100) => n,
        Some(n) => {
            problems.add(
                &at("recoveryProbes"),
                format!("health.recoveryProbes {n} is not between 1 and 100"),
            );
            defaults::HEALTH_RECOVERY_PROBES
        }
    };
    // The client is the agent's own binary.
    let simulated_gpus = src.args.simulated.is_some() || src.file.inventory.simulated.is_some();
    let mps_client = if mps_on && file.mps_client_probe.unwrap_or(!simulated_gpus) {
        match std::env::current_exe() {
            Ok(program) => Some(ClientProbe {
                program,
                library: file.cuda_library.clone().unwrap_or_else(|| defaults::CUDA_LIBRARY.into()),
                timeout: PROBE_TIMEOUT,
            }),
            Err(e) => {
                problems.add(
                    &at("mpsClientProbe"),
                    format!(
                        "health.mpsClientProbe: the agent's own binary (the probe's client) cannot be found: {e}"
                    ),
                );
                None
            }
        }
    } else {
        None
    };
    HealthConfig { probe_interval, recovery_probes, mps_client }
}
