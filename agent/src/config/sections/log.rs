//! Logging (`log:`): format and filter.

use serde::Deserialize;

use super::{Sources, place};
use crate::config::LogFormat;
use crate::defaults;
use crate::yaml::{Problems, Seg};

/// `log:` in the file.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LogFile {
    /// `text` (default) or `json`.
    pub format: Option<String>,
    /// A tracing filter, e.g. `info` (default) or `baleen_agent=debug`.
    pub level: Option<String>,
}

/// The format and the filter (each flag < file).
pub(in crate::config) fn resolve(
    src: &Sources<'_>,
    problems: &mut Problems,
) -> (LogFormat, String) {
    let (args, file) = (src.args, &src.file.log);
    let format =
        match args.log_format.as_deref().or(file.format.as_deref()).unwrap_or(defaults::LOG_FORMAT)
        {
            "text" => LogFormat::Text,
            "json" => LogFormat::Json,
            other => {
                problems.add(
                    place(args.log_format.is_some(), &[Seg::Key("log"), Seg::Key("format")]),
                    format!("log.format {other:?} is not text or json"),
                );
                LogFormat::Text
            }
        };
    let level =
        args.log_level.clone().or(file.level.clone()).unwrap_or_else(|| defaults::LOG_LEVEL.into());
    if let Err(e) = level.parse::<tracing_subscriber::EnvFilter>() {
        problems.add(
            place(args.log_level.is_some(), &[Seg::Key("log"), Seg::Key("level")]),
            format!("log.level {level:?}: {e}"),
        );
    }
    (format, level)
}
