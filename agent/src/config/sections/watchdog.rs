//! The per-container GPU memory watchdog (`watchdog:`).

use std::path::{Path, PathBuf};

use serde::Deserialize;

use super::{Sources, duration};
use crate::defaults;
use crate::isolation::watchdog::{WatchdogAction, WatchdogConfig};
use crate::yaml::{Problems, Seg};

/// `watchdog:` in the file.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct WatchdogFile {
    /// Run it (default: inside a pod; it needs the Kubernetes API).
    pub enabled: Option<bool>,
    /// Time between two reads of the GPUs' processes, e.g. `10s` (default).
    pub interval: Option<String>,
    /// `kill` (default) or `log`.
    pub action: Option<String>,
    /// How long a container may stay over its grant, e.g. `30s` (default).
    pub grace: Option<String>,
}

/// The watchdog's settings; it reads processes under `proc_root` (`paths.procRoot`).
pub(in crate::config) fn resolve(
    src: &Sources<'_>,
    proc_root: PathBuf,
    problems: &mut Problems,
) -> WatchdogConfig {
    let file = &src.file.watchdog;
    let at = |key| [Seg::Key("watchdog"), Seg::Key(key)];
    let interval = duration(
        problems,
        &at("interval"),
        "watchdog.interval",
        file.interval.as_ref(),
        defaults::WATCHDOG_INTERVAL,
    );
    let grace = duration(
        problems,
        &at("grace"),
        "watchdog.grace",
        file.grace.as_ref(),
        defaults::WATCHDOG_GRACE,
    );
    // As the annotation: inside a pod the API server (the node's pods) is there; outside one,
    // only when asked.
    let enabled = file.enabled.unwrap_or(src.env.in_pod);
    let action = match file.action.as_deref().unwrap_or("kill") {
        "log" => WatchdogAction::Log,
        "kill" => WatchdogAction::Kill,
        other => {
            problems.add(&at("action"), format!("watchdog.action {other:?} is not log or kill"));
            WatchdogAction::Log
        }
    };
    if enabled && action == WatchdogAction::Kill && proc_root != Path::new(defaults::PROC_ROOT) {
        // PIDs read under another /proc may name other processes in the agent's own namespace.
        problems.add(
            &[Seg::Key("paths"), Seg::Key("procRoot")],
            format!(
                "watchdog.action kill (the default) needs the host's /proc at {} (paths.procRoot is {}): the PIDs it kills must be the agent's own namespace's; or set watchdog.action: log",
                defaults::PROC_ROOT,
                proc_root.display()
            ),
        );
    }
    WatchdogConfig { enabled, interval, action, grace, proc_root }
}
