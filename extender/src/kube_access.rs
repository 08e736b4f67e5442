//! Every Kubernetes API call the extender makes: the install's RBAC grants exactly these
//! (`tests/tests/e2e/install.rs` fails when the two differ). The watchers list and watch Nodes and
//! Pods; the `bind` verb gets a pod the watch has not shown yet and creates its Binding.

pub use baleen_k8s::rbac::ApiRule;

/// What the extender calls.
pub const EXTENDER: &[ApiRule] = &[
    ApiRule { api_group: "", resource: "nodes", verbs: &["list", "watch"] },
    ApiRule { api_group: "", resource: "pods", verbs: &["get", "list", "watch"] },
    ApiRule { api_group: "", resource: "pods/binding", verbs: &["create"] },
];

/// What the extender calls besides, when it judges pods by their DRA claims
/// (`--dra-device-class`): the ResourceClaims and ResourceClaimTemplates it follows.
pub const DRA_CLAIMS: &[ApiRule] = &[
    ApiRule { api_group: "resource.k8s.io", resource: "resourceclaims", verbs: &["list", "watch"] },
    ApiRule {
        api_group: "resource.k8s.io",
        resource: "resourceclaimtemplates",
        verbs: &["list", "watch"],
    },
];

/// What the extender calls besides, when its webhook makes its own certificate
/// (`--webhook-secret`): the Secret it keeps it in (read, or made by the first replica), and the
/// MutatingWebhookConfiguration whose `caBundle` it publishes.
pub const WEBHOOK_OWN_CERTIFICATE: &[ApiRule] = &[
    ApiRule { api_group: "", resource: "secrets", verbs: &["create", "get"] },
    ApiRule {
        api_group: "admissionregistration.k8s.io",
        resource: "mutatingwebhookconfigurations",
        verbs: &["get", "patch"],
    },
];
