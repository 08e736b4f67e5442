//! The Prometheus endpoint (`metrics:`).

use serde::Deserialize;

use super::{Sources, duration, place};
use crate::defaults;
use crate::metrics::MetricsConfig;
use crate::yaml::{Problems, Seg};

/// `metrics:` in the file.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MetricsFile {
    /// Serve the endpoint (default true).
    pub enabled: Option<bool>,
    /// Where, e.g. `0.0.0.0:9477` (default).
    pub address: Option<String>,
    /// Where the probes are served alone, e.g. `127.0.0.1:9476` (default).
    pub probe_address: Option<String>,
    /// Time between two telemetry reads, e.g. `10s` (default).
    pub interval: Option<String>,
}

/// The endpoint's settings (`--metrics-address` < `metrics.address`).
pub(in crate::config) fn resolve(src: &Sources<'_>, problems: &mut Problems) -> MetricsConfig {
    let file = &src.file.metrics;
    let interval = duration(
        problems,
        &[Seg::Key("metrics"), Seg::Key("interval")],
        "metrics.interval",
        file.interval.as_ref(),
        defaults::METRICS_INTERVAL,
    );
    let flag = src.args.metrics_address.as_deref();
    let address = match flag.or(file.address.as_deref()) {
        None => defaults::METRICS_ADDRESS,
        Some(text) => text.parse().unwrap_or_else(|e| {
            problems.add(
                place(flag.is_some(), &[Seg::Key("metrics"), Seg::Key("address")]),
                format!("metrics.address {text:?} is not an IP address and port: {e}"),
            );
            defaults::METRICS_ADDRESS
        }),
    };
    let probe_address = match file.probe_address.as_deref() {
        None => defaults::PROBE_ADDRESS,
        Some(text) => text.parse().unwrap_or_else(|e| {
            problems.add(
                place(false, &[Seg::Key("metrics"), Seg::Key("probeAddress")]),
                format!("metrics.probeAddress {text:?} is not an IP address and port: {e}"),
            );
            defaults::PROBE_ADDRESS
        }),
    };
    if probe_address == address && address.port() != 0 {
        problems.add(
            place(false, &[Seg::Key("metrics"), Seg::Key("probeAddress")]),
            format!(
                "metrics.probeAddress {probe_address} is metrics.address: the probes need a \
                 port of their own (on the loopback address, which no other pod reaches)"
            ),
        );
    }
    MetricsConfig { enabled: file.enabled.unwrap_or(true), address, probe_address, interval }
}
