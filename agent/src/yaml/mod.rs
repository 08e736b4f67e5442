//! What the agent's two YAML readers share, the configuration file (`crate::config`) and the
//! simulated topology (`crate::inventory::simulated`): a collector of every problem found with
//! the YAML path it is about ([`Problems`]), the locator that finds each path's line
//! ([`locate`]), and a parse that reports every key the schema does not know at once
//! ([`parse_reporting_unknown`]) instead of stopping at the first.

mod locate;

pub(crate) use locate::{Seg, locate};
use serde::de::DeserializeOwned;

/// One problem, with the line of the YAML node it is about when that is known.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Located {
    /// The line (1-based).
    pub(crate) line: Option<usize>,
    /// The column (1-based) on that line.
    pub(crate) column: Option<usize>,
    /// What is wrong.
    pub(crate) message: String,
}

/// Every problem found so far, each with where in the document it is (if anywhere: a problem of
/// a flag or of the environment has no place in the file).
#[derive(Debug, Default)]
pub(crate) struct Problems(Vec<(Vec<Seg>, String)>);

impl Problems {
    /// A problem about the node at `at` (an empty path: about nothing in the document).
    pub(crate) fn add(&mut self, at: &[Seg], message: impl Into<String>) {
        self.0.push((at.to_vec(), message.into()));
    }

    /// A problem about nothing in the document (a flag, the environment, two settings at once).
    pub(crate) fn general(&mut self, message: impl Into<String>) {
        self.add(&[], message);
    }

    /// Whether none was found.
    pub(crate) fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Each problem with its line in `text` (none without a text), ordered by line (those
    /// without one last, in the order found), each once (the same message about the same node
    /// found twice is one problem).
    pub(crate) fn located(self, text: Option<&str>) -> Vec<Located> {
        let mut seen = std::collections::BTreeSet::new();
        let mut located: Vec<Located> = self
            .0
            .into_iter()
            .filter(|(at, message)| seen.insert((at.clone(), message.clone())))
            .map(|(at, message)| {
                let place = text.filter(|_| !at.is_empty()).and_then(|t| locate(t, &at));
                Located { line: place.map(|p| p.0), column: place.map(|p| p.1), message }
            })
            .collect();
        located.sort_by_key(|p| (p.line.unwrap_or(usize::MAX), p.column.unwrap_or(0)));
        located
    }
}

/// Parses `text` as `T`, every key `T` does not know added to `problems` at its path (`unknown
/// key mps.probeTimout`); the parse goes on past them. An error of the document's shape (a
/// wrong type, bad YAML) still stops it: that is the `Err`.
pub(crate) fn parse_reporting_unknown<T: DeserializeOwned>(
    text: &str,
    problems: &mut Problems,
) -> Result<T, serde_yaml_ng::Error> {
    let mut unknown = Vec::new();
    let value = serde_ignored::deserialize(serde_yaml_ng::Deserializer::from_str(text), |path| {
        let mut at = Vec::new();
        segments(&path, &mut at);
        unknown.push((at, path.to_string()));
    })?;
    for (at, dotted) in unknown {
        problems.add(&at, format!("unknown key {dotted}"));
    }
    Ok(value)
}

fn segments(path: &serde_ignored::Path<'_>, out: &mut Vec<Seg>) {
    use serde_ignored::Path;
    match path {
        Path::Root => {}
        Path::Seq { parent, index } => {
            segments(parent, out);
            out.push(Seg::Index(*index));
        }
        Path::Map { parent, key } => {
            segments(parent, out);
            out.push(Seg::Name(key.clone()));
        }
        Path::Some { parent }
        | Path::NewtypeStruct { parent }
        | Path::NewtypeVariant { parent } => {
            segments(parent, out);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, Default, serde::Deserialize)]
    #[serde(rename_all = "camelCase")]
    struct Doc {
        #[serde(default)]
        mps: Section,
        node_name: Option<String>,
    }

    #[derive(Debug, Default, serde::Deserialize)]
    #[serde(rename_all = "camelCase")]
    struct Section {
        probe_interval: Option<String>,
    }

    #[test]
    fn every_unknown_key_is_reported_at_its_line_and_the_rest_is_read() {
        let text = "nodeName: n\nmps:\n  probeIntervl: 1s\n  probeInterval: 2s\nwatchdgo: {}\n";
        let mut problems = Problems::default();
        let doc: Doc = parse_reporting_unknown(text, &mut problems).expect("the shape is right");
        assert_eq!(doc.node_name.as_deref(), Some("n"));
        assert_eq!(doc.mps.probe_interval.as_deref(), Some("2s"));
        let located = problems.located(Some(text));
        assert_eq!(
            located,
            [
                Located {
                    line: Some(3),
                    column: Some(3),
                    message: "unknown key mps.probeIntervl".into()
                },
                Located { line: Some(5), column: Some(1), message: "unknown key watchdgo".into() },
            ]
        );
    }

    #[test]
    fn problems_are_ordered_by_line_once_each_and_general_ones_last() {
        let text = "a: 1\nb: 2\n";
        let mut problems = Problems::default();
        problems.general("a flag");
        problems.add(&[Seg::Key("b")], "b is bad");
        problems.add(&[Seg::Key("a")], "a is bad");
        problems.add(&[Seg::Key("a")], "a is bad");
        problems.add(&[Seg::Key("c")], "c is absent");
        let lines: Vec<_> =
            problems.located(Some(text)).into_iter().map(|p| (p.line, p.message)).collect();
        assert_eq!(
            lines,
            [
                (Some(1), "a is bad".to_owned()),
                (Some(2), "b is bad".to_owned()),
                (None, "a flag".to_owned()),
                (None, "c is absent".to_owned()),
            ]
        );
    }
}
