//! Every Kubernetes API call the agent makes, declared once: the install's RBAC
//! (the Helm chart, `packaging/helm/baleen`) grants exactly these to the agent's service account, and a test
//! (`tests/tests/e2e/install.rs`) fails when the two differ. A subsystem that starts calling the API
//! adds its rule here in the same change.
//!
//! The agent learns which pod holds which device from the kubelet's pod-resources socket on the
//! node, not from the API server. It writes one thing: the node-state annotation on its own Node
//! (`run::annotation`, a JSON merge patch). Co-location (`run::colocation`) reads its Node's
//! allocatable CPU (get) and follows the pods bound to its node (list and watch with the field
//! selector `spec.nodeName`; kube-rs's watcher never gets a single pod: [`POD_READS`], with the
//! agent's account unless `paths.podsKubeconfig` names other credentials) and the class labels of
//! namespaces (list and watch, label selector `awesome-ai-company.com/workload-class`: a
//! namespace's class is set by the cluster admin); the memory watchdog
//! follows the same pods and records Warning Events (`events.k8s.io/v1`, create) about the pods
//! whose processes it found over their grant, killed, or holding no grant. RBAC cannot limit a
//! rule to the agent's own node or its pods, so the rules cover every node and pod; the agent
//! names only its own.

pub use baleen_k8s::rbac::ApiRule;

/// What the node agent (and `baleen-agent mps`) call on the Kubernetes API with its account.
pub const AGENT: &[ApiRule] = &[
    ApiRule { api_group: "", resource: "nodes", verbs: &["get", "patch"] },
    ApiRule { api_group: "", resource: "namespaces", verbs: &["list", "watch"] },
    ApiRule { api_group: "events.k8s.io", resource: "events", verbs: &["create"] },
];

/// What the agent calls in addition in DRA mode (`driver: dra`, `crate::run::dra`): its node's
/// ResourceSlices (found with the field selectors `spec.nodeName` and `spec.driver`, created,
/// replaced and deleted; watched, since the kubelet deletes them all at its start), each
/// prepared claim (get), and its Node (get: the slices' owner is the Node, by UID).
pub const DRA_AGENT: &[ApiRule] = &[
    ApiRule { api_group: "", resource: "nodes", verbs: &["get"] },
    ApiRule {
        api_group: "resource.k8s.io",
        resource: "resourceslices",
        verbs: &["list", "watch", "create", "update", "delete"],
    },
    ApiRule { api_group: "resource.k8s.io", resource: "resourceclaims", verbs: &["get"] },
];

/// What the agent calls in addition with its account where it reads its node's pods with it
/// (no `paths.podsKubeconfig`: the chart's `agent.podReads.with: serviceAccount`). With a pods
/// kubeconfig (the kubelet's own credentials) these reads are the kubelet's, which the Node
/// authorizer holds to the pods bound to the node, and the account has no pod rights.
pub const POD_READS: &[ApiRule] =
    &[ApiRule { api_group: "", resource: "pods", verbs: &["list", "watch"] }];

/// The `reportingController` of the agent's Events (`reportingInstance` adds the node).
pub const EVENT_CONTROLLER: &str = "awesome-ai-company.com/baleen-agent";
