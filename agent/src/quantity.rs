//! Memory quantities: `80GB`, `141GiB`, `23034 MiB` or a bare number of bytes.
//!
//! [`parse_quantity`] is the one parser of such text in the agent; the configuration
//! (`config::parse_memory_unit`, the `gpu-memory` unit) calls it, and the simulated inventory's
//! topology file reads GPU and MIG memory through the serde wrapper [`Quantity`].

use std::fmt;

use serde::de::{self, Visitor};
use serde::{Deserialize, Deserializer};

/// Parses `<integer>[ ]<unit>`: B, kB/KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB
/// (powers of 1024); a bare integer is bytes.
pub fn parse_quantity(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let split = text.find(|c: char| !c.is_ascii_digit()).unwrap_or(text.len());
    let (digits, unit) = text.split_at(split);
    let bad = || {
        format!(
            "`{text}` is not a memory quantity: expected bytes as an integer, or an integer with \
             a unit (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. `80GB` or `143771MiB`"
        )
    };
    if digits.is_empty() {
        return Err(bad());
    }
    let value: u64 = digits.parse().map_err(|_| bad())?;
    let factor: u64 = match unit.trim_start() {
        "" | "B" => 1,
        "kB" | "KB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        "TB" => 1_000_000_000_000,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        "TiB" => 1 << 40,
        _ => return Err(bad()),
    };
    value.checked_mul(factor).ok_or_else(|| format!("`{text}` does not fit in 64 bits of bytes"))
}

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
