//! The agent's one adapter to the Kubernetes API (kube-rs): the calls it makes, behind a small
//! trait so that subsystems and tests do not name kube. Every call here has its RBAC rule in
//! [`crate::kube_access::AGENT`].

use std::sync::Arc;

use baleen_k8s::watch::{Change, follow};
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::watcher;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::isolation::node_pods::{NodePods, PodInfo};
use crate::isolation::watchdog::{Notice, Regarding};

/// Why a call to the API server failed.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// The client could not be built from the environment (in-cluster or kubeconfig).
    #[error("no Kubernetes API configuration (in-cluster service account or KUBECONFIG)")]
    Config(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// The call failed (unreachable, refused, or an error status).
    #[error("the API server refused or did not answer")]
    Call(#[source] Box<dyn std::error::Error + Send + Sync>),
}

/// What the agent asks of the API server about its own node.
#[async_trait::async_trait]
pub trait NodeApi: Send + Sync {
    /// Sets annotation `key` to `value` on node `node`, leaving every other field as it is.
    async fn annotate(&self, node: &str, key: &str, value: &str) -> Result<(), ApiError>;

    /// The node's allocatable CPU (`status.allocatable.cpu`), millicores.
    async fn allocatable_cpu_milli(&self, node: &str) -> Result<u64, ApiError>;

    /// Follows the pods bound to `node` into `view` until `shutdown`: the whole view is sent
    /// after the first list and after every change; after the API server went away and came
    /// back, the pods listed again replace the old view. Errors are logged and retried with
    /// backoff.
    async fn follow_pods(
        &self,
        node: &str,
        view: watch::Sender<NodePods>,
        shutdown: CancellationToken,
    );

    /// Follows the class labels of the namespaces that have one
    /// ([`crate::isolation::colocation::CLASS_LABEL`], a label selector) into `view`'s
    /// `namespace_classes` until `shutdown`, as [`NodeApi::follow_pods`] follows the pods.
    async fn follow_namespaces(&self, view: watch::Sender<NodePods>, shutdown: CancellationToken);

    /// Records `notice` as a Warning Event (`events.k8s.io/v1`) about its pod, or about `node`,
    /// reported by the agent of `node`.
    async fn record_event(&self, node: &str, notice: &Notice) -> Result<(), ApiError>;

    /// The kube-rs client behind it, for the DRA mode (`crate::run::dra`: ResourceSlices and
    /// ResourceClaims); `None` where there is none (test doubles).
    fn client(&self) -> Option<kube::Client> {
        None
    }
}

/// The Event of `notice`, reported by the agent on `node`, and its namespace.
pub fn event_of(node: &str, notice: &Notice) -> (String, k8s_openapi::api::events::v1::Event) {
    use k8s_openapi::api::core::v1::ObjectReference;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
    let (namespace, regarding) = match &notice.regarding {
        Regarding::Pod { namespace, name, uid } => (
            namespace.clone(),
            ObjectReference {
                api_version: Some("v1".into()),
                kind: Some("Pod".into()),
                namespace: Some(namespace.clone()),
                name: Some(name.clone()),
                uid: (!uid.is_empty()).then(|| uid.clone()),
                ..ObjectReference::default()
            },
        ),
        // Node events live in `default`, as the kubelet's do.
        Regarding::Node => (
            "default".to_owned(),
            ObjectReference {
                api_version: Some("v1".into()),
                kind: Some("Node".into()),
                name: Some(node.to_owned()),
                ..ObjectReference::default()
            },
        ),
    };
    let event = k8s_openapi::api::events::v1::Event {
        metadata: ObjectMeta {
            generate_name: Some("baleen-".into()),
            namespace: Some(namespace.clone()),
            ..ObjectMeta::default()
        },
        event_time: Some(MicroTime(k8s_openapi::jiff::Timestamp::now())),
        action: Some(notice.action.into()),
        reason: Some(notice.reason.into()),
        note: Some(notice.note.chars().take(1024).collect()),
        regarding: Some(regarding),
        reporting_controller: Some(crate::kube_access::EVENT_CONTROLLER.into()),
        reporting_instance: Some(format!("{}-{node}", crate::kube_access::EVENT_CONTROLLER)),
        type_: Some(if notice.warning { "Warning" } else { "Normal" }.into()),
        ..Default::default()
    };
    (namespace, event)
}

/// [`NodeApi`] over kube-rs.
pub struct KubeNodeApi {
    client: kube::Client,
    nodes: Api<Node>,
}

impl KubeNodeApi {
    /// A client from the environment: the pod's service account in a cluster, else KUBECONFIG
    /// or `~/.kube/config`.
    pub async fn from_environment() -> Result<Arc<Self>, ApiError> {
        let client =
            kube::Client::try_default().await.map_err(|e| ApiError::Config(Box::new(e)))?;
        Ok(Arc::new(Self::new(client)))
    }

    /// Over `client`.
    pub fn new(client: kube::Client) -> Self {
        Self { nodes: Api::all(client.clone()), client }
    }

    /// A client of the API server at `url` without credentials (tests, and `kubectl proxy`).
    pub fn at(url: &str) -> Result<Arc<Self>, ApiError> {
        let uri: http::Uri = url.parse().map_err(|e| ApiError::Config(Box::new(e)))?;
        let client = kube::Client::try_from(kube::Config::new(uri))
            .map_err(|e| ApiError::Config(Box::new(e)))?;
        Ok(Arc::new(Self::new(client)))
    }
}

#[async_trait::async_trait]
impl NodeApi for KubeNodeApi {
    fn client(&self) -> Option<kube::Client> {
        Some(self.client.clone())
    }

    async fn annotate(&self, node: &str, key: &str, value: &str) -> Result<(), ApiError> {
        // A JSON merge patch of one annotation: nothing else of the Node is read or written.
        let patch = serde_json::json!({ "metadata": { "annotations": { key: value } } });
        self.nodes
            .patch_metadata(node, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .map(drop)
            .map_err(|e| ApiError::Call(Box::new(e)))
    }

    async fn allocatable_cpu_milli(&self, node: &str) -> Result<u64, ApiError> {
        let n = self.nodes.get(node).await.map_err(|e| ApiError::Call(Box::new(e)))?;
        let cpu = n.status.and_then(|s| s.allocatable).and_then(|a| a.get("cpu").cloned());
        let Some(cpu) = cpu else {
            return Err(ApiError::Call(format!("node {node} has no allocatable CPU").into()));
        };
        crate::isolation::node_pods::quantity_milli(&cpu).ok_or_else(|| {
            ApiError::Call(
                format!("node {node}: allocatable CPU {} is not a quantity", cpu.0).into(),
            )
        })
    }

    async fn record_event(&self, node: &str, notice: &Notice) -> Result<(), ApiError> {
        let (namespace, event) = event_of(node, notice);
        let events: Api<k8s_openapi::api::events::v1::Event> =
            Api::namespaced(self.client.clone(), &namespace);
        events
            .create(&kube::api::PostParams::default(), &event)
            .await
            .map(drop)
            .map_err(|e| ApiError::Call(Box::new(e)))
    }

    async fn follow_namespaces(&self, view: watch::Sender<NodePods>, shutdown: CancellationToken) {
        use crate::isolation::colocation::CLASS_LABEL;
        let namespaces: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(self.client.clone());
        let config = watcher::Config::default().labels(CLASS_LABEL);
        let class_of = |ns: &k8s_openapi::api::core::v1::Namespace| {
            let name = ns.metadata.name.clone()?;
            let value = ns.metadata.labels.as_ref()?.get(CLASS_LABEL)?.clone();
            Some((name, value))
        };
        follow(
            namespaces,
            config,
            "the namespaces' class labels",
            &shutdown,
            |change| match change {
                Change::Listed(list) => {
                    let classes = list.iter().filter_map(class_of).collect();
                    view.send_modify(|v| {
                        v.namespaces_synced = true;
                        v.namespace_classes = classes;
                    });
                }
                Change::Applied(ns) => match (class_of(&ns), ns.metadata.name) {
                    (Some((name, value)), _) => view.send_modify(|v| {
                        v.namespace_classes.insert(name, value);
                    }),
                    (None, Some(name)) => view.send_modify(|v| {
                        v.namespace_classes.remove(&name);
                    }),
                    (None, None) => {}
                },
                Change::Deleted(ns) => {
                    if let Some(name) = ns.metadata.name {
                        view.send_modify(|v| {
                            v.namespace_classes.remove(&name);
                        });
                    }
                }
            },
        )
        .await;
    }

    async fn follow_pods(
        &self,
        node: &str,
        view: watch::Sender<NodePods>,
        shutdown: CancellationToken,
    ) {
        let pods: Api<Pod> = Api::all(self.client.clone());
        let config = watcher::Config::default().fields(&format!("spec.nodeName={node}"));
        follow(pods, config, "the node's pods", &shutdown, |change| match change {
            Change::Listed(list) => {
                let pods =
                    list.iter().filter_map(PodInfo::of).map(|p| (p.uid.clone(), p)).collect();
                // The namespaces' labels, followed by another watcher, stay.
                view.send_modify(|v| {
                    v.synced = true;
                    v.pods = pods;
                });
            }
            Change::Applied(pod) => {
                if let Some(p) = PodInfo::of(&pod) {
                    view.send_modify(|v| {
                        v.pods.insert(p.uid.clone(), p);
                    });
                }
            }
            Change::Deleted(pod) => {
                if let Some(uid) = pod.metadata.uid {
                    view.send_modify(|v| {
                        v.pods.remove(&uid);
                    });
                }
            }
        })
        .await;
    }
}
