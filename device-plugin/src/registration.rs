//! Registering one resource with the kubelet's `Registration` service on `kubelet.sock`.

use std::path::{Path, PathBuf};
use std::time::Duration;

use baleen_proto::deviceplugin::v1beta1 as api;

/// Why a registration attempt failed.
#[derive(Debug, thiserror::Error)]
pub enum RegisterError {
    /// Nothing answers on the kubelet's socket (kubelet absent or restarting).
    #[error("kubelet not reachable on {}", socket.display())]
    Unreachable {
        /// The kubelet socket dialled.
        socket: PathBuf,
        /// The connection error.
        #[source]
        source: tonic::transport::Error,
    },
    /// The kubelet answered Register with an error (bad name or version, or it could not dial
    /// the plugin back).
    #[error("kubelet refused the registration of {resource}: {} ({:?})", status.message(), status.code())]
    Refused {
        /// The resource being registered.
        resource: String,
        /// The kubelet's answer.
        status: tonic::Status,
    },
}

/// Registers `resource` served on `endpoint` (a file name in the kubelet's directory). Returns
/// once the kubelet has dialled the plugin back and accepted it.
pub async fn register(
    kubelet_socket: &Path,
    resource: &str,
    endpoint: &str,
    preferred_allocation: bool,
    timeout: Duration,
) -> Result<(), RegisterError> {
    let channel = crate::uds::connect(kubelet_socket, timeout).await.map_err(|source| {
        RegisterError::Unreachable { socket: kubelet_socket.to_path_buf(), source }
    })?;
    let mut client = api::registration_client::RegistrationClient::new(channel);
    let request = api::RegisterRequest {
        version: api::VERSION.to_owned(),
        endpoint: endpoint.to_owned(),
        resource_name: resource.to_owned(),
        options: Some(api::DevicePluginOptions {
            pre_start_required: false,
            get_preferred_allocation_available: preferred_allocation,
        }),
    };
    client
        .register(request)
        .await
        .map(drop)
        .map_err(|status| RegisterError::Refused { resource: resource.to_owned(), status })
}
