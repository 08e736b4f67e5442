//! Kubernetes resource quantities (`2`, `500m`, `16Gi`, `1e3`), read as the API server writes
//! them: shared by the extender and the node agent, which both read pods' requests.

/// A Kubernetes quantity (`2`, `500m`, `1.5`, `16Gi`, `1e3`) in thousandths, rounded up; `None`
/// if it is not one. Memory in bytes comes out times 1000.
pub fn quantity_milli(text: &str) -> Option<i128> {
    let text = text.trim();
    const SUFFIXES: [(&str, i128, i128); 13] = [
        ("Ki", 1 << 10, 1),
        ("Mi", 1 << 20, 1),
        ("Gi", 1 << 30, 1),
        ("Ti", 1 << 40, 1),
        ("Pi", 1 << 50, 1),
        ("Ei", 1 << 60, 1),
        ("m", 1, 1000),
        ("k", 1_000, 1),
        ("M", 1_000_000, 1),
        ("G", 1_000_000_000, 1),
        ("T", 1_000_000_000_000, 1),
        ("P", 1_000_000_000_000_000, 1),
        ("E", 1_000_000_000_000_000_000, 1),
    ];
    let suffixed = SUFFIXES
        .iter()
        .find_map(|&(suffix, num, den)| text.strip_suffix(suffix).map(|n| (n, num, den)));
    let (number, scale_num, scale_den, exponent) = match suffixed {
        Some((n, num, den)) => (n, num, den, 0),
        // An exponent form (`1e3`), or a plain number.
        None => match text.find(['e', 'E']) {
            Some(i) => (&text[..i], 1, 1, text[i + 1..].parse::<i32>().ok()?),
            None => (text, 1, 1, 0),
        },
    };
    let negative = number.starts_with('-');
    let number = number.trim_start_matches(['+', '-']);
    let (whole, frac) = number.split_once('.').unwrap_or((number, ""));
    if whole.is_empty() && frac.is_empty()
        || !whole.bytes().chain(frac.bytes()).all(|b| b.is_ascii_digit())
        || frac.len() > 18
    {
        return None;
    }
    // mantissa / 10^frac_len * 10^exponent * scale * 1000, rounded up.
    let mantissa: i128 = format!("{whole}{frac}").parse().ok()?;
    let mut num = mantissa.checked_mul(scale_num)?.checked_mul(1000)?;
    let mut den = scale_den.checked_mul(10i128.checked_pow(u32::try_from(frac.len()).ok()?)?)?;
    if exponent >= 0 {
        num = num.checked_mul(10i128.checked_pow(u32::try_from(exponent).ok()?)?)?;
    } else {
        den = den.checked_mul(10i128.checked_pow(exponent.unsigned_abs())?)?;
    }
    let value = num.checked_add(den - 1)? / den;
    Some(if negative { -value } else { value })
}

/// Parses `<integer>[ ]<unit>`: B, kB/KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB
/// (powers of 1024); a bare integer is bytes. The agent's memory sizes (its `memoryUnit`,
/// topology files) and the extender's `--dra-memory-unit` are read by it.
pub fn parse_bytes(text: &str) -> Result<u64, String> {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantities_read_as_kubernetes_writes_them() {
        let q = quantity_milli;
        assert_eq!(q("2"), Some(2000));
        assert_eq!(q(" 8 "), Some(8000));
        assert_eq!(q("500m"), Some(500));
        assert_eq!(q("1.5"), Some(1500));
        assert_eq!(q("0.1m"), Some(1), "rounded up, as the API server does");
        assert_eq!(q("16Gi"), Some(16 * (1 << 30) * 1000));
        assert_eq!(q("1e3"), Some(1_000_000));
        assert_eq!(q("1k"), Some(1_000_000));
        assert_eq!(q("128974848"), Some(128_974_848_000));
        assert_eq!(q("2E"), Some(2_000_000_000_000_000_000_000));
        assert_eq!(q("1Ei"), Some((1i128 << 60) * 1000));
        assert_eq!(q("-1"), Some(-1000));
        for bad in ["x", "1Gb", "", "1.2.3", "true", "1e3Gi"] {
            assert_eq!(q(bad), None, "{bad}");
        }
    }
}
