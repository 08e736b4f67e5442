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
    /// Where the node's pods are read with other credentials than `client`'s.
    pod_reads: Option<PodReads>,
}

/// The node's pods read with the credentials of a kubeconfig of their own (`paths.podsKubeconfig`:
/// the kubelet's, which the API server's Node authorizer holds to the pods bound to its node),
/// so that the agent's account needs no pod rights (issue 39, item 5).
struct PodReads {
    kubeconfig: std::path::PathBuf,
    /// The client of the first round, made when the agent started (a bad file stops it there).
    first: std::sync::Mutex<Option<kube::Client>>,
}

/// How often the pod reads' client is made again from its kubeconfig (the pods listed again):
/// the kubelet rotates its client certificate in place (`kubelet-client-current.pem`), and a
/// client keeps the certificate it was made with.
pub const POD_CREDENTIALS_REFRESH: std::time::Duration = std::time::Duration::from_secs(3600);

/// The most bytes a pod-reads kubeconfig may hold.
const MAX_KUBECONFIG_BYTES: u64 = 1 << 20;

/// A client from the kubeconfig at `path` (its current context), read bounded.
pub async fn client_from_kubeconfig(path: &std::path::Path) -> Result<kube::Client, ApiError> {
    use crate::files::{Links, read_bounded};
    let named = |e: String| ApiError::Config(format!("{}: {e}", path.display()).into());
    let bytes = read_bounded(path, MAX_KUBECONFIG_BYTES, Links::Follow)
        .map_err(|e| named(e.to_string()))?
        .ok_or_else(|| named("no such file".into()))?;
    let text = String::from_utf8(bytes).map_err(|e| named(e.to_string()))?;
    let kubeconfig =
        kube::config::Kubeconfig::from_yaml(&text).map_err(|e| named(e.to_string()))?;
    let config = kube::Config::from_custom_kubeconfig(
        kubeconfig,
        &kube::config::KubeConfigOptions::default(),
    )
    .await
    .map_err(|e| named(e.to_string()))?;
    kube::Client::try_from(config).map_err(|e| named(e.to_string()))
}

impl KubeNodeApi {
    /// A client from the environment: the pod's service account in a cluster, else KUBECONFIG
    /// or `~/.kube/config`; the node's pods read with `pods_kubeconfig`'s credentials where it
    /// is given (a file that makes no client is an error now, not at the first read).
    pub async fn from_environment(
        pods_kubeconfig: Option<&std::path::Path>,
    ) -> Result<Arc<Self>, ApiError> {
        let client =
            kube::Client::try_default().await.map_err(|e| ApiError::Config(Box::new(e)))?;
        Ok(Arc::new(Self::reading_pods_with(client, pods_kubeconfig).await?))
    }

    /// Over `client`.
    pub fn new(client: kube::Client) -> Self {
        Self { nodes: Api::all(client.clone()), client, pod_reads: None }
    }

    /// Over `client`, the node's pods read with `pods_kubeconfig`'s credentials where given.
    pub async fn reading_pods_with(
        client: kube::Client,
        pods_kubeconfig: Option<&std::path::Path>,
    ) -> Result<Self, ApiError> {
        let mut api = Self::new(client);
        if let Some(path) = pods_kubeconfig {
            let first = client_from_kubeconfig(path).await?;
            api.pod_reads = Some(PodReads {
                kubeconfig: path.to_owned(),
                first: std::sync::Mutex::new(Some(first)),
            });
        }
        Ok(api)
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
        let Some(reads) = &self.pod_reads else {
            follow_node_pods(self.client.clone(), node, &view, &shutdown).await;
            return;
        };
        // The client made again from the kubeconfig every POD_CREDENTIALS_REFRESH (the pods
        // listed again), and after a failure to make one, with backoff.
        let mut backoff = std::time::Duration::from_secs(1);
        while !shutdown.is_cancelled() {
            let made = reads.first.lock().unwrap_or_else(std::sync::PoisonError::into_inner).take();
            let client = match made {
                Some(client) => Ok(client),
                None => client_from_kubeconfig(&reads.kubeconfig).await,
            };
            match client {
                Ok(client) => {
                    backoff = std::time::Duration::from_secs(1);
                    let round = shutdown.child_token();
                    let ends = round.clone();
                    let timer = tokio::spawn(async move {
                        tokio::time::sleep(POD_CREDENTIALS_REFRESH).await;
                        ends.cancel();
                    });
                    follow_node_pods(client, node, &view, &round).await;
                    timer.abort();
                }
                Err(e) => {
                    tracing::warn!(
                        error = %crate::error_chain::Chain(&e),
                        "cannot make the client that reads the node's pods (paths.podsKubeconfig): trying again"
                    );
                    tokio::select! {
                        () = shutdown.cancelled() => return,
                        () = tokio::time::sleep(backoff) => {}
                    }
                    backoff = (backoff * 2).min(std::time::Duration::from_secs(60));
                }
            }
        }
    }
}

/// Follows the pods bound to `node` with `client` into `view` until `shutdown`.
async fn follow_node_pods(
    client: kube::Client,
    node: &str,
    view: &watch::Sender<NodePods>,
    shutdown: &CancellationToken,
) {
    let pods: Api<Pod> = Api::all(client);
    let config = watcher::Config::default().fields(&format!("spec.nodeName={node}"));
    follow(pods, config, "the node's pods", shutdown, |change| match change {
        Change::Listed(list) => {
            let pods = list.iter().filter_map(PodInfo::of).map(|p| (p.uid.clone(), p)).collect();
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
