//! The DRA driver's registration socket, `<registry>/<driver>-reg.sock`: the kubelet's plugin
//! watcher finds it, dials it (grpc-go, `:authority` = the path percent-encoded), asks
//! `GetInfo` and answers `NotifyRegistrationStatus`. Served by [`crate::h2_unary`], which
//! accepts that authority; tonic's server would reset the call (hyperium/h2#487).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use baleen_device_plugin::uds::BoundSocket;
use baleen_proto::pluginregistration::v1 as reg;
use prost::Message as _;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::h2_unary::{self, Call, Code, Status, Unary};

/// The service versions the driver serves on its DRA socket, newest first (what kubelets from
/// 1.34 on accept).
pub const SUPPORTED_VERSIONS: [&str; 2] = ["v1.DRAPlugin", "v1beta1.DRAPlugin"];

/// Connections served at once; a further one is closed at accept (the kubelet opens one at a
/// time), by the one policy of every listener (`baleen_edge::gate`).
const MAX_CONNECTIONS: usize = 8;

/// Where the registration socket of `driver` lies in the kubelet's registry directory.
pub fn socket_path(registry_dir: &Path, driver: &str) -> PathBuf {
    registry_dir.join(format!("{driver}-reg.sock"))
}

/// What the kubelet last said of the registration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Registered {
    /// Whether it registered the plugin.
    pub registered: bool,
    /// Its error when it did not.
    pub error: String,
}

/// The registration service: the plugin's info, and where the kubelet's verdict goes.
#[derive(Debug)]
pub struct Registration {
    info: reg::PluginInfo,
    verdict: watch::Sender<Option<Registered>>,
}

impl Registration {
    /// The service of `driver` whose DRA socket is `endpoint` (an absolute path: the kubelet
    /// dials it as given).
    pub fn new(driver: &str, endpoint: &Path) -> (Self, watch::Receiver<Option<Registered>>) {
        let (verdict, seen) = watch::channel(None);
        let info = reg::PluginInfo {
            r#type: reg::DRA_PLUGIN.into(),
            name: driver.into(),
            endpoint: endpoint.display().to_string(),
            supported_versions: SUPPORTED_VERSIONS.iter().map(|v| (*v).to_owned()).collect(),
        };
        (Self { info, verdict }, seen)
    }
}

impl Unary for Registration {
    fn call(&self, call: &Call<'_>) -> Result<Vec<u8>, Status> {
        match call.path {
            reg::GET_INFO_PATH => {
                reg::InfoRequest::decode(call.message)
                    .map_err(|e| Status::new(Code::InvalidArgument, format!("InfoRequest: {e}")))?;
                tracing::debug!(authority = call.authority, "the kubelet asked GetInfo");
                Ok(self.info.encode_to_vec())
            }
            reg::NOTIFY_PATH => {
                let status = reg::RegistrationStatus::decode(call.message).map_err(|e| {
                    Status::new(Code::InvalidArgument, format!("RegistrationStatus: {e}"))
                })?;
                if status.plugin_registered {
                    tracing::info!(driver = self.info.name, "the kubelet registered the driver");
                } else {
                    tracing::error!(
                        driver = self.info.name,
                        error = status.error,
                        "the kubelet refused to register the driver"
                    );
                }
                self.verdict.send_replace(Some(Registered {
                    registered: status.plugin_registered,
                    error: status.error,
                }));
                Ok(reg::RegistrationStatusResponse {}.encode_to_vec())
            }
            other => Err(Status::new(Code::Unimplemented, format!("no method {other} here"))),
        }
    }
}

/// Serves `service` on a socket bound at `path` (a stale socket there is replaced; a live one
/// or another file is an error) until `token` is cancelled; the socket file is removed then.
pub async fn serve(
    path: &Path,
    service: Registration,
    token: CancellationToken,
) -> std::io::Result<impl Future<Output = ()> + Send + 'static> {
    let (socket, listener) = BoundSocket::bind(path)?;
    let service = Arc::new(service);
    let gate = baleen_edge::gate::Gate::new(
        "DRA registration socket",
        baleen_edge::gate::Limits { total: MAX_CONNECTIONS, per_peer: MAX_CONNECTIONS },
    );
    Ok(async move {
        let _socket = socket;
        let mut connections = tokio::task::JoinSet::new();
        loop {
            let accepted = tokio::select! {
                () = token.cancelled() => break,
                a = listener.accept() => a,
            };
            let stream = match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    tracing::warn!(error = %e, "cannot accept on the registration socket");
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                    continue;
                }
            };
            // Closed at once when the socket holds its most (waiting here would block every
            // later caller, the kubelet too, behind clients that never finish).
            let Some(slot) = gate.admit(baleen_edge::gate::Peer::Local) else { continue };
            let slot = slot.hold();
            let service = service.clone();
            let token = token.clone();
            connections.spawn(async move {
                let _slot = slot;
                tokio::select! {
                    () = token.cancelled() => {}
                    ended = h2_unary::serve(stream, &*service, h2_unary::IDLE) => {
                        tracing::debug!(?ended, "a registration connection ended");
                    }
                }
            });
            while connections.try_join_next().is_some() {}
        }
        connections.shutdown().await;
    })
}
