//! RBAC rules as the front ends declare the Kubernetes API calls they make: each binary lists
//! its own (`agent::kube_access::AGENT`, `extender::kube_access::EXTENDER`), and the install test
//! (`tests/tests/e2e/install.rs`) fails when the shipped RBAC grants other than exactly those.

/// One RBAC rule: verbs on a resource of an API group (`""` is the core group).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct ApiRule {
    /// The API group.
    pub api_group: &'static str,
    /// The resource (plural, lower case, e.g. `nodes`).
    pub resource: &'static str,
    /// The verbs, e.g. `get`, `list`, `watch`, `patch`.
    pub verbs: &'static [&'static str],
}
