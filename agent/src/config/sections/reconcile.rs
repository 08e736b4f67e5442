//! Reconciliation with the kubelet's pod-resources (`reconcile:`).

use std::time::Duration;

use serde::Deserialize;

use super::{Sources, duration};
use crate::defaults;
use crate::yaml::{Problems, Seg};

/// `reconcile:` in the file.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ReconcileFile {
    /// Time between two reconciliations, e.g. `30s` (default).
    pub interval: Option<String>,
    /// How long an allocation pod-resources has never listed is kept, e.g. `10m` (default).
    pub grace: Option<String>,
    /// How long a kubelet that (re)appeared may still be syncing its pods, e.g. `5m` (default).
    pub kubelet_settle: Option<String>,
}

/// The three reconciliation times.
pub(in crate::config) struct Reconcile {
    pub(in crate::config) interval: Duration,
    pub(in crate::config) grace: Duration,
    pub(in crate::config) settle: Duration,
}

/// The reconciliation times, each within its bounds.
pub(in crate::config) fn resolve(src: &Sources<'_>, problems: &mut Problems) -> Reconcile {
    let file = &src.file.reconcile;
    let at = |key| [Seg::Key("reconcile"), Seg::Key(key)];
    let interval = duration(
        problems,
        &at("interval"),
        "reconcile.interval",
        file.interval.as_ref(),
        defaults::RECONCILE_INTERVAL,
    );
    let grace = duration(
        problems,
        &at("grace"),
        "reconcile.grace",
        file.grace.as_ref(),
        defaults::RECONCILE_GRACE,
    );
    let settle = duration(
        problems,
        &at("kubeletSettle"),
        "reconcile.kubeletSettle",
        file.kubelet_settle.as_ref(),
        defaults::RECONCILE_SETTLE,
    );
    if settle > defaults::RECONCILE_SETTLE_MAX {
        problems.add(
            &at("kubeletSettle"),
            format!(
                "reconcile.kubeletSettle {settle:?} is above {:?}: after every kubelet restart, allocations of ended pods would be held this long where the API cannot confirm",
                defaults::RECONCILE_SETTLE_MAX
            ),
        );
    }
    if grace < defaults::RECONCILE_GRACE_MIN {
        problems.add(
            &at("grace"),
            format!(
                "reconcile.grace {grace:?} is below {:?}: allocations the kubelet has not listed yet would be released",
                defaults::RECONCILE_GRACE_MIN
            ),
        );
    }
    Reconcile { interval, grace, settle }
}
