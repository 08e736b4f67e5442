//! One module per section of the configuration file: its serde type (every field optional) and
//! its `resolve`, which takes the file, the flags and the environment ([`Sources`]) and adds
//! each problem at the YAML path it is about (a value from a flag: at none), so that every
//! problem is reported at once with its line.

pub(super) mod annotation;
pub(super) mod colocation;
pub(super) mod devices;
pub(super) mod dra;
pub(super) mod health;
pub(super) mod inventory;
pub(super) mod log;
pub(super) mod metrics;
pub(super) mod mps;
pub(super) mod node;
pub(super) mod paths;
pub(super) mod reconcile;
pub(super) mod resources;
pub(super) mod watchdog;

use std::time::Duration;

use super::{Environment, FileConfig, RunArgs, parse_duration};
use crate::yaml::{Problems, Seg};

/// What a section is resolved from.
pub(super) struct Sources<'a> {
    /// The file (defaults where there is none).
    pub(super) file: &'a FileConfig,
    /// The flags.
    pub(super) args: &'a RunArgs,
    /// The process environment.
    pub(super) env: &'a Environment,
}

/// Where a value's problem is reported: nowhere in the file when a flag gave it.
pub(super) fn place(flag_given: bool, at: &[Seg]) -> &[Seg] {
    if flag_given { &[] } else { at }
}

/// A duration setting (`what` names it in problems) at `at`: `default` when absent; above zero.
pub(super) fn duration(
    problems: &mut Problems,
    at: &[Seg],
    what: &str,
    text: Option<&String>,
    default: Duration,
) -> Duration {
    match text.map(|t| parse_duration(t)) {
        None => default,
        Some(Ok(d)) if !d.is_zero() => d,
        Some(Ok(_)) => {
            problems.add(at, format!("{what} must be above zero"));
            default
        }
        Some(Err(e)) => {
            problems.add(at, format!("{what}: {e}"));
            default
        }
    }
}
