//! The kubelet's rule for the resource name of a device plugin: a domain-qualified extended
//! resource name outside the `kubernetes.io` domains. The kubelet refuses any other name at
//! Register; the agent checks its configured names with [`validate`] at start, so a bad name is
//! a configuration error rather than a refusal found later in the kubelet's log.

/// Why a name is not an extended resource name, or `Ok` if it is one.
///
/// Mirrors the kubelet's `IsExtendedResourceName`: the name must contain `/`; its domain must
/// not be `kubernetes.io` or end in `.kubernetes.io`; it must not start with `requests.`; and
/// `requests.<name>` must be a qualified name: a DNS-1123 subdomain (lower case, at most 253
/// characters), `/`, and a name of at most 63 characters of `[A-Za-z0-9._-]` that starts and
/// ends alphanumeric.
pub fn validate(name: &str) -> Result<(), String> {
    let Some((domain, local)) = name.split_once('/') else {
        return Err(format!("{name:?} has no domain (expected e.g. example.com/gpu)"));
    };
    if domain == "kubernetes.io" || domain.ends_with(".kubernetes.io") {
        return Err(format!("{name:?} is in the kubernetes.io domain, reserved for Kubernetes"));
    }
    if name.starts_with("requests.") {
        return Err(format!("{name:?} starts with \"requests.\", reserved for quota"));
    }
    let prefix = format!("requests.{domain}");
    if prefix.len() > 253 || !is_dns_subdomain(&prefix) {
        return Err(format!(
            "{name:?}: domain {domain:?} is not a DNS subdomain (lower-case letters, digits, '-' \
             and '.', at most 244 characters)"
        ));
    }
    if local.is_empty() || local.len() > 63 || !is_qualified_local(local) {
        return Err(format!(
            "{name:?}: {local:?} must be 1 to 63 characters of letters, digits, '-', '_' and \
             '.', starting and ending with a letter or digit"
        ));
    }
    Ok(())
}

fn is_dns_subdomain(s: &str) -> bool {
    s.split('.').all(|label| {
        let bytes = label.as_bytes();
        !bytes.is_empty()
            && bytes.iter().all(|&b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
            && bytes[0] != b'-'
            && bytes[bytes.len() - 1] != b'-'
    })
}

fn is_qualified_local(s: &str) -> bool {
    let bytes = s.as_bytes();
    bytes.iter().all(|&b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
        && bytes[0].is_ascii_alphanumeric()
        && bytes[bytes.len() - 1].is_ascii_alphanumeric()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_extended_names() {
        for name in [
            "awesome-ai-company.com/gpu",
            "awesome-ai-company.com/gpu-memory",
            "awesome-ai-company.com/mig-1g.18gb",
            "awesome-ai-company.com/nvlink-group-4",
            "nvidia.com/gpu",
            "a.b/C_d.e",
        ] {
            assert_eq!(validate(name), Ok(()), "{name}");
        }
    }

    #[test]
    fn refuses_what_the_kubelet_refuses() {
        for name in [
            "gpu",
            "kubernetes.io/gpu",
            "foo.kubernetes.io/gpu",
            "requests.example.com/gpu",
            "Example.com/gpu",
            "example..com/gpu",
            "-example.com/gpu",
            "example.com/",
            "example.com/-gpu",
            "example.com/gpu memory",
            "example.com/a/b",
        ] {
            assert!(validate(name).is_err(), "{name} should be refused");
        }
        let long = format!("example.com/{}", "a".repeat(64));
        assert!(validate(&long).is_err());
    }
}
