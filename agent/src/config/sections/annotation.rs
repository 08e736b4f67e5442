//! The node-state annotation for the scheduler extender (`annotation:`).

use serde::Deserialize;

use super::{Sources, duration};
use crate::defaults;
use crate::run::annotation::AnnotationConfig;
use crate::yaml::{Problems, Seg};

/// `annotation:` in the file.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AnnotationFile {
    /// Write it (default: inside a pod).
    pub enabled: Option<bool>,
    /// The least time between two writes, e.g. `1s` (default).
    pub min_interval: Option<String>,
}

/// The annotation's settings; its key under `domain`.
pub(in crate::config) fn resolve(
    src: &Sources<'_>,
    domain: &str,
    problems: &mut Problems,
) -> AnnotationConfig {
    let file = &src.file.annotation;
    let min_interval = duration(
        problems,
        &[Seg::Key("annotation"), Seg::Key("minInterval")],
        "annotation.minInterval",
        file.min_interval.as_ref(),
        defaults::ANNOTATION_MIN_INTERVAL,
    );
    AnnotationConfig {
        // Inside a pod the API server is there to write to; outside one, only when asked.
        enabled: file.enabled.unwrap_or(src.env.in_pod),
        key: format!("{domain}/{}", defaults::ANNOTATION_NAME),
        min_interval,
        dra: false,
    }
}
