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
    MetricsConfig { enabled: file.enabled.unwrap_or(true), address, interval }
}
