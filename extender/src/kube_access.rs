//! Every Kubernetes API call the extender makes: the install's RBAC grants exactly these
//! (`tests/tests/install.rs` fails when the two differ). The watchers list and watch Nodes and
//! Pods; nothing is written.

/// One RBAC rule: verbs on a resource of an API group (`""` is the core group).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ApiRule {
    /// The API group.
    pub api_group: &'static str,
    /// The resource.
    pub resource: &'static str,
    /// The verbs.
    pub verbs: &'static [&'static str],
}

/// What the extender calls.
pub const EXTENDER: &[ApiRule] = &[
    ApiRule { api_group: "", resource: "nodes", verbs: &["list", "watch"] },
    ApiRule { api_group: "", resource: "pods", verbs: &["list", "watch"] },
];
