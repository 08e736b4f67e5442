//! The agent's one adapter to the Kubernetes API (kube-rs): the calls it makes, behind a small
//! trait so that subsystems and tests do not name kube. Every call here has its RBAC rule in
//! [`crate::kube_access::AGENT`].

use std::sync::Arc;

use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, Patch, PatchParams};

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

/// What the agent writes to its Node.
#[async_trait::async_trait]
pub trait NodeApi: Send + Sync {
    /// Sets annotation `key` to `value` on node `node`, leaving every other field as it is.
    async fn annotate(&self, node: &str, key: &str, value: &str) -> Result<(), ApiError>;
}

/// [`NodeApi`] over kube-rs.
pub struct KubeNodeApi {
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
        Self { nodes: Api::all(client) }
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
    async fn annotate(&self, node: &str, key: &str, value: &str) -> Result<(), ApiError> {
        // A JSON merge patch of one annotation: nothing else of the Node is read or written.
        let patch = serde_json::json!({ "metadata": { "annotations": { key: value } } });
        self.nodes
            .patch_metadata(node, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .map(drop)
            .map_err(|e| ApiError::Call(Box::new(e)))
    }
}
