//! Finds the line of a node of a YAML document, given its path (`gpus`, 3, `uuid`), so that each
//! problem a reader (the topology loader, the configuration) finds is reported with its line.
//!
//! serde_yaml_ng keeps no positions in deserialised values, but it stamps the position of the
//! node being read on any error a visitor returns. So to find where `gpus[3].uuid` is, walk the
//! document to that node and fail there on purpose; the error carries the line.

use std::fmt;

use serde::Deserializer;
use serde::de::{self, DeserializeSeed, IgnoredAny, MapAccess, SeqAccess, Visitor};

/// A step of a path into the YAML document, to find a problem's line.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Seg {
    /// A mapping key the reader knows.
    Key(&'static str),
    /// A mapping key read from the document (an unknown one).
    Name(String),
    /// A sequence element.
    Index(usize),
}

const PROBE_MARKER: &str = "baleen-yaml-probe";

/// The line and column (both 1-based) of the node at `path` in the YAML `text`, or `None` when
/// the path does not lead to a node (the problem is then reported without a place).
pub(crate) fn locate(text: &str, path: &[Seg]) -> Option<(usize, usize)> {
    let deserializer = serde_yaml_ng::Deserializer::from_str(text);
    match (Probe { path }).deserialize(deserializer) {
        Err(err) if err.to_string().contains(PROBE_MARKER) => {
            err.location().map(|l| (l.line(), l.column()))
        }
        _ => None,
    }
}

struct Probe<'p> {
    path: &'p [Seg],
}

impl<'de> DeserializeSeed<'de> for Probe<'_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        match self.path.split_first() {
            None => deserializer.deserialize_any(Found),
            Some((Seg::Key(key), rest)) => deserializer.deserialize_map(KeyWalker { key, rest }),
            Some((Seg::Name(key), rest)) => {
                deserializer.deserialize_map(KeyWalker { key: key.as_str(), rest })
            }
            Some((Seg::Index(index), rest)) => {
                deserializer.deserialize_seq(IndexWalker { index: *index, rest })
            }
        }
    }
}

/// Fails on whatever node it is asked to read (every `visit_*` defaults to an error).
struct Found;

impl Visitor<'_> for Found {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(PROBE_MARKER)
    }
}

struct KeyWalker<'p> {
    key: &'p str,
    rest: &'p [Seg],
}

impl<'de> Visitor<'de> for KeyWalker<'_> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "a mapping with key {}", self.key)
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        // The last step points at the key itself: for a block collection the key's line reads
        // better than the line of the collection's first entry.
        let seed = KeyMatch { key: self.key, fail_on_match: self.rest.is_empty() };
        while let Some(matched) = map.next_key_seed(seed)? {
            if matched {
                map.next_value_seed(Probe { path: self.rest })?;
            } else {
                map.next_value::<IgnoredAny>()?;
            }
        }
        Ok(())
    }
}

/// Reads a mapping key: whether it is the one looked for, or (when `fail_on_match`) the probe's
/// error at that key.
#[derive(Clone, Copy)]
struct KeyMatch<'p> {
    key: &'p str,
    fail_on_match: bool,
}

impl<'de> DeserializeSeed<'de> for KeyMatch<'_> {
    type Value = bool;
    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<bool, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl Visitor<'_> for KeyMatch<'_> {
    type Value = bool;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a mapping key")
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<bool, E> {
        match (v == self.key, self.fail_on_match) {
            (true, true) => Err(E::custom(PROBE_MARKER)),
            (matched, _) => Ok(matched),
        }
    }
    fn visit_u64<E: de::Error>(self, _: u64) -> Result<bool, E> {
        Ok(false)
    }
    fn visit_i64<E: de::Error>(self, _: i64) -> Result<bool, E> {
        Ok(false)
    }
    fn visit_bool<E: de::Error>(self, _: bool) -> Result<bool, E> {
        Ok(false)
    }
    fn visit_unit<E: de::Error>(self) -> Result<bool, E> {
        Ok(false)
    }
}

struct IndexWalker<'p> {
    index: usize,
    rest: &'p [Seg],
}

impl<'de> Visitor<'de> for IndexWalker<'_> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "a sequence with an element {}", self.index)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        let mut position = 0;
        loop {
            if position == self.index {
                seq.next_element_seed(Probe { path: self.rest })?;
            } else if seq.next_element::<IgnoredAny>()?.is_none() {
                return Ok(());
            }
            position += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const YAML: &str = "\
node: n                      # 1
gpus:                        # 2
  - index: 0                 # 3
    model: X                 # 4
  - {index: 1, model: Y}     # 5
  - index: 2                 # 6
    mig:                     # 7
      instances:             # 8
        - profile: 1g.10gb   # 9
";

    #[test]
    fn keys_and_indices_lead_to_their_line_and_column() {
        assert_eq!(locate(YAML, &[Seg::Key("node")]), Some((1, 1)));
        let model = |i| locate(YAML, &[Seg::Key("gpus"), Seg::Index(i), Seg::Key("model")]);
        assert_eq!(model(0), Some((4, 5)));
        assert_eq!(model(1), Some((5, 16)), "a flow mapping's key, at its column");
        let instance = [
            Seg::Key("gpus"),
            Seg::Index(2),
            Seg::Key("mig"),
            Seg::Key("instances"),
            Seg::Index(0),
            Seg::Key("profile"),
        ];
        assert_eq!(locate(YAML, &instance), Some((9, 11)));
        // A block collection is located at its key, not at its first entry.
        let mig = locate(YAML, &[Seg::Key("gpus"), Seg::Index(2), Seg::Key("mig")]);
        assert_eq!(mig, Some((7, 5)));
    }

    #[test]
    fn a_path_that_leads_nowhere_has_no_line() {
        assert_eq!(locate(YAML, &[Seg::Key("nvlink")]), None);
        assert_eq!(locate(YAML, &[Seg::Key("gpus"), Seg::Index(7), Seg::Key("uuid")]), None);
        assert_eq!(
            locate(YAML, &[Seg::Key("node"), Seg::Key("name")]),
            None,
            "a scalar has no keys"
        );
    }
}
