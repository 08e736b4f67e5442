//! One resource's plugin: binds its socket, serves the `DevicePlugin` service, registers with
//! the kubelet, and starts over whenever the kubelet restarts, until shut down.
//!
//! The kubelet, when it starts, deletes every file in its device-plugin directory (including our
//! socket) and listens on a new `kubelet.sock`. The plugin polls the identity (device, inode) of
//! both files every [`PluginConfig::watch_interval`] (100 ms by default): when `kubelet.sock`
//! is a new file or our socket is gone, it binds a new socket and registers again. Polling two
//! `stat` calls is cheap, needs no inotify watch that would break when the directory itself is
//! re-created, and keeps re-registration well within one second.

use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use baleen_proto::deviceplugin::v1beta1 as api;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tokio_util::task::AbortOnDropHandle;

use crate::backend::DeviceBackend;
use crate::limits::{bounded_server, slotted};
use crate::registration::{RegisterError, register};
use crate::service::DevicePluginService;
use crate::uds::{BoundSocket, FileIdentity};

/// Where and how a plugin runs.
#[derive(Debug, Clone)]
pub struct PluginConfig {
    /// The kubelet's device-plugin directory (default `/var/lib/kubelet/device-plugins`).
    pub device_plugin_dir: PathBuf,
    /// The plugin's socket file name in that directory.
    pub socket_name: String,
    /// How often to check whether the kubelet restarted.
    pub watch_interval: Duration,
    /// First wait between failed registrations; doubles up to `backoff_max`.
    pub backoff_initial: Duration,
    /// Longest wait between failed registrations.
    pub backoff_max: Duration,
    /// Limit for one registration call (the kubelet dials back within 10 s).
    pub register_timeout: Duration,
}

impl PluginConfig {
    /// Defaults for `resource` in `device_plugin_dir`: socket `baleen-<resource>.sock` (with
    /// `/` replaced by `_`), 100 ms watch interval, backoff 100 ms to 5 s, 15 s register timeout.
    pub fn new(device_plugin_dir: impl Into<PathBuf>, resource: &str) -> Self {
        Self {
            device_plugin_dir: device_plugin_dir.into(),
            socket_name: socket_name(resource),
            watch_interval: Duration::from_millis(100),
            backoff_initial: Duration::from_millis(100),
            backoff_max: Duration::from_secs(5),
            register_timeout: Duration::from_secs(15),
        }
    }

    /// Where the plugin's socket is bound.
    pub fn socket_path(&self) -> PathBuf {
        self.device_plugin_dir.join(&self.socket_name)
    }

    /// The kubelet's registration socket the plugin dials.
    pub fn kubelet_socket(&self) -> PathBuf {
        self.device_plugin_dir.join(api::KUBELET_SOCKET)
    }
}

/// The socket file name baleen uses for a resource.
pub fn socket_name(resource: &str) -> String {
    format!("baleen-{}.sock", resource.replace('/', "_"))
}

/// Where a plugin stands, published on a `watch` channel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PluginState {
    /// Not yet serving.
    Starting,
    /// Serving, waiting for a kubelet to register with.
    WaitingForKubelet {
        /// Failed attempts since serving began.
        attempts: u32,
        /// Why the last attempt failed.
        last_error: String,
    },
    /// The kubelet refused the registration (it will be retried with backoff).
    Refused {
        /// Refusals since serving began.
        attempts: u32,
        /// The kubelet's message.
        reason: String,
    },
    /// Registered; `registrations` counts successful registrations since start (2 after one
    /// kubelet restart).
    Registered {
        /// Successful registrations so far.
        registrations: u64,
    },
    /// Shut down; the socket is removed.
    Stopped,
}

/// Failures a plugin cannot recover from by waiting.
#[derive(Debug, thiserror::Error)]
pub enum PluginError {
    /// The plugin's socket cannot be bound (permissions, or a non-socket file in the way).
    #[error("cannot bind device-plugin socket {}", path.display())]
    Bind {
        /// The socket path.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
}

/// A plugin for one resource. Create it, take [`Plugin::state`] receivers, then [`Plugin::run`].
pub struct Plugin {
    backend: Arc<dyn DeviceBackend>,
    config: PluginConfig,
    state: watch::Sender<PluginState>,
}

/// What wakes a plugin waiting between checks.
enum Wake {
    Shutdown,
    KubeletChanged,
    SocketLost,
    Elapsed,
}

impl Plugin {
    /// A plugin serving `backend` as configured.
    pub fn new(backend: Arc<dyn DeviceBackend>, config: PluginConfig) -> Self {
        let (state, _) = watch::channel(PluginState::Starting);
        Self { backend, config, state }
    }

    /// Publishes `state`, logging when the kind of state or its reason changes (so a plugin
    /// waiting for an absent kubelet says so once, not at every retry).
    fn set_state(&self, state: PluginState) {
        let resource = self.resource();
        self.state.send_if_modified(|current| {
            let same_kind = match (&*current, &state) {
                (
                    PluginState::WaitingForKubelet { last_error: a, .. },
                    PluginState::WaitingForKubelet { last_error: b, .. },
                )
                | (PluginState::Refused { reason: a, .. }, PluginState::Refused { reason: b, .. }) => {
                    a == b
                }
                _ => false,
            };
            if !same_kind {
                match &state {
                    PluginState::WaitingForKubelet { last_error, .. } => {
                        tracing::info!(resource, reason = %last_error, "waiting for the kubelet");
                    }
                    PluginState::Refused { reason, .. } => {
                        tracing::error!(resource, reason = %reason, "the kubelet refused the registration");
                    }
                    _ => {}
                }
            }
            *current = state;
            true
        });
    }

    /// Follows the plugin's state.
    pub fn state(&self) -> watch::Receiver<PluginState> {
        self.state.subscribe()
    }

    /// The resource served.
    pub fn resource(&self) -> &str {
        self.backend.resource_name()
    }

    /// Serves and registers until `shutdown` is cancelled, then removes the socket.
    pub async fn run(self, shutdown: CancellationToken) -> Result<(), PluginError> {
        // One span per plugin: every line it logs names its resource.
        let span = tracing::info_span!("plugin", resource = self.resource());
        let result = tracing::Instrument::instrument(self.serve_loop(&shutdown), span).await;
        self.state.send_replace(PluginState::Stopped);
        tracing::info!(resource = self.resource(), "device plugin stopped");
        result
    }

    async fn serve_loop(&self, shutdown: &CancellationToken) -> Result<(), PluginError> {
        let resource = self.resource().to_owned();
        let socket_path = self.config.socket_path();
        let kubelet_socket = self.config.kubelet_socket();
        let mut registrations = 0_u64;
        let mut backoff = self.config.backoff_initial;
        while !shutdown.is_cancelled() {
            let (socket, listener) = match BoundSocket::bind(&socket_path) {
                Ok(bound) => bound,
                Err(e) if e.kind() == io::ErrorKind::NotFound => {
                    // The kubelet has not created its directory yet.
                    self.set_state(PluginState::WaitingForKubelet {
                        attempts: 0,
                        last_error: format!(
                            "device-plugin directory {} does not exist",
                            self.config.device_plugin_dir.display()
                        ),
                    });
                    if let Wake::Shutdown = self.wait(backoff, None, None, shutdown).await {
                        break;
                    }
                    backoff = (backoff * 2).min(self.config.backoff_max);
                    continue;
                }
                Err(source) => return Err(PluginError::Bind { path: socket_path, source }),
            };
            tracing::info!(resource, socket = %socket_path.display(), "serving");
            let server_stop = shutdown.child_token();
            // Aborted if this future is dropped (the plugin's task aborted), so that a server
            // never outlives its plugin.
            let server = AbortOnDropHandle::new(tokio::spawn(
                bounded_server()
                    .add_service(
                        DevicePluginService::new(self.backend.clone(), server_stop.clone())
                            .into_server(),
                    )
                    .serve_with_incoming_shutdown(
                        slotted(listener),
                        server_stop.clone().cancelled_owned(),
                    ),
            ));

            let outcome = self
                .register_and_watch(
                    &socket,
                    &kubelet_socket,
                    &mut registrations,
                    &mut backoff,
                    shutdown,
                )
                .await;
            server_stop.cancel();
            stop_server(server, &resource).await;
            drop(socket);
            match outcome {
                Wake::Shutdown => break,
                Wake::KubeletChanged | Wake::SocketLost | Wake::Elapsed => {
                    tracing::info!(resource, "kubelet restarted; serving and registering again");
                }
            }
        }
        Ok(())
    }

    /// Registers (retrying with backoff), then watches for a kubelet restart. Returns why it
    /// stopped: shutdown, or a restart that needs a new socket and registration.
    async fn register_and_watch(
        &self,
        socket: &BoundSocket,
        kubelet_socket: &Path,
        registrations: &mut u64,
        backoff: &mut Duration,
        shutdown: &CancellationToken,
    ) -> Wake {
        let resource = self.resource();
        let mut failures = 0_u32;
        let registered_with = loop {
            let kubelet = FileIdentity::of(kubelet_socket);
            if kubelet.is_some() {
                let attempt = register(
                    kubelet_socket,
                    resource,
                    &self.config.socket_name,
                    self.backend.has_preferred_allocation(),
                    self.config.register_timeout,
                );
                // A kubelet that hangs in Register must not hold up a shutdown for the whole
                // register timeout.
                let outcome = tokio::select! {
                    () = shutdown.cancelled() => return Wake::Shutdown,
                    outcome = attempt => outcome,
                };
                match outcome {
                    Ok(()) => break kubelet,
                    Err(e @ RegisterError::Refused { .. }) => {
                        failures += 1;
                        self.set_state(PluginState::Refused {
                            attempts: failures,
                            reason: e.to_string(),
                        });
                    }
                    Err(e @ RegisterError::Unreachable { .. }) => {
                        failures += 1;
                        self.set_state(PluginState::WaitingForKubelet {
                            attempts: failures,
                            last_error: e.to_string(),
                        });
                    }
                }
            } else {
                self.set_state(PluginState::WaitingForKubelet {
                    attempts: failures,
                    last_error: format!("{} does not exist", kubelet_socket.display()),
                });
            }
            match self.wait(*backoff, kubelet, Some(socket), shutdown).await {
                Wake::Shutdown => return Wake::Shutdown,
                Wake::SocketLost => return Wake::SocketLost,
                // A new kubelet socket: try at once, with a fresh backoff.
                Wake::KubeletChanged => *backoff = self.config.backoff_initial,
                Wake::Elapsed => *backoff = (*backoff * 2).min(self.config.backoff_max),
            }
        };
        *registrations += 1;
        *backoff = self.config.backoff_initial;
        tracing::info!(resource, registrations = *registrations, "registered with the kubelet");
        self.state.send_replace(PluginState::Registered { registrations: *registrations });
        loop {
            match self.wait(Duration::MAX, registered_with, Some(socket), shutdown).await {
                Wake::Elapsed => {}
                other => return other,
            }
        }
    }

    /// Waits up to `limit`, checking every watch interval whether the kubelet socket is no
    /// longer `kubelet` or our socket is gone.
    async fn wait(
        &self,
        limit: Duration,
        kubelet: Option<FileIdentity>,
        socket: Option<&BoundSocket>,
        shutdown: &CancellationToken,
    ) -> Wake {
        let deadline = tokio::time::Instant::now().checked_add(limit);
        let kubelet_socket = self.config.kubelet_socket();
        loop {
            let now = tokio::time::Instant::now();
            let step = match deadline {
                Some(d) if d <= now => return Wake::Elapsed,
                Some(d) => (d - now).min(self.config.watch_interval),
                None => self.config.watch_interval,
            };
            tokio::select! {
                () = shutdown.cancelled() => return Wake::Shutdown,
                () = tokio::time::sleep(step) => {}
            }
            if socket.is_some_and(|s| !s.is_intact()) {
                return Wake::SocketLost;
            }
            let now_kubelet = FileIdentity::of(&kubelet_socket);
            if now_kubelet.is_some() && now_kubelet != kubelet {
                return Wake::KubeletChanged;
            }
        }
    }
}

async fn stop_server(
    server: AbortOnDropHandle<Result<(), tonic::transport::Error>>,
    resource: &str,
) {
    // Streams end on the stop token, so a graceful stop is quick; do not hang on a peer that
    // keeps a connection open.
    let abort = server.abort_handle();
    match tokio::time::timeout(Duration::from_secs(2), server).await {
        Ok(Ok(Ok(()))) => {}
        Ok(Ok(Err(e))) => tracing::warn!(resource, error = %e, "device-plugin server failed"),
        Ok(Err(e)) if e.is_cancelled() => {}
        Ok(Err(e)) => tracing::error!(resource, error = %e, "device-plugin server task panicked"),
        Err(_) => {
            tracing::warn!(resource, "device-plugin server did not stop within 2 s; aborted");
            abort.abort();
        }
    }
}
