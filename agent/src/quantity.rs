//! Memory quantities: `80GB`, `141GiB`, `23034 MiB` or a bare number of bytes.
//!
//! [`parse_quantity`] is the one parser of such text in the agent; the configuration
//! (`config::parse_memory_unit`, the `gpu-memory` unit) calls it, and the simulated inventory's
//! topology file reads GPU and MIG memory through the serde wrapper [`Quantity`].

use std::fmt;

use serde::de::{self, Visitor};
use serde::{Deserialize, Deserializer};

pub use baleen_k8s::quantity::parse_bytes as parse_quantity;

/// A number of bytes as serde reads it: a YAML integer, or a string with a unit (`80GB`,
/// `141GiB`, `23034 MiB`, see [`parse_quantity`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Quantity(pub u64);

impl<'de> Deserialize<'de> for Quantity {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct QuantityVisitor;
        impl Visitor<'_> for QuantityVisitor {
            type Value = Quantity;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a memory size: bytes as an integer, or a string such as `80GB`")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Quantity, E> {
                Ok(Quantity(v))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Quantity, E> {
                u64::try_from(v)
                    .map(Quantity)
                    .map_err(|_| E::custom(format!("memory cannot be negative ({v})")))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Quantity, E> {
                parse_quantity(v).map(Quantity).map_err(E::custom)
            }
        }
        deserializer.deserialize_any(QuantityVisitor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inventory::{GIB, MIB};

    #[test]
    fn quantities() {
        assert_eq!(parse_quantity("80GB"), Ok(80_000_000_000));
        assert_eq!(parse_quantity("141GiB"), Ok(141 * GIB));
        assert_eq!(parse_quantity("23034 MiB"), Ok(23034 * MIB));
        assert_eq!(parse_quantity("150754820096"), Ok(150_754_820_096));
        assert_eq!(parse_quantity("2KiB"), Ok(2048));
        for bad in ["", "GiB", "1.5GiB", "10 parsecs", "-3GB", "99999999999TiB"] {
            assert!(parse_quantity(bad).is_err(), "{bad} should be rejected");
        }
    }

    #[test]
    fn quantities_deserialise_from_integers_and_strings() {
        let read = |json: &str| serde_json::from_str::<Quantity>(json).map_err(|e| e.to_string());
        assert_eq!(read("150754820096"), Ok(Quantity(150_754_820_096)));
        assert_eq!(read("\"80GB\""), Ok(Quantity(80_000_000_000)));
        let negative = read("-3").expect_err("negative");
        assert!(negative.contains("memory cannot be negative (-3)"), "{negative}");
        let bad = read("\"80 furlongs\"").expect_err("unknown unit");
        assert!(bad.contains("`80 furlongs` is not a memory quantity"), "{bad}");
    }
}
