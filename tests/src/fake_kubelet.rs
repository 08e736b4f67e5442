//! A fake kubelet that behaves, towards device plugins, like the kubelet's device manager:
//!
//! - at start it creates the device-plugin directory (mode 0750), deletes everything in it but
//!   `kubelet_internal_checkpoint`, and listens on `kubelet.sock`;
//! - `Register` checks the version (`v1beta1`) and the resource name (an extended resource name)
//!   and otherwise fails with a plain error (gRPC `Unknown`, the kubelet's messages); it dials the
//!   plugin's endpoint back (10 s timeout) and calls `GetDevicePluginOptions` *before* answering,
//!   then keeps `ListAndWatch` open, each message replacing the resource's device list;
//! - admitting a container ([`FakeKubelet::admit`]) asks `GetPreferredAllocation` when the plugin
//!   offers it, uses the answer when it is valid, then calls `Allocate` for that one container,
//!   and keeps the devices in its own books (there is no Deallocate; [`FakeKubelet::release`]
//!   models a pod ending);
//! - [`FakeKubelet::restart`] drops every plugin connection, wipes the directory and listens
//!   again; [`FakeKubelet::stop`] leaves no kubelet at all.
//!
//! It can also serve the pod-resources API from its books ([`FakeKubelet::serve_pod_resources`];
//! [`FakeKubelet::admit_to`] records a container of a pod, [`FakeKubelet::end_pod`] ends it).
//!
//! Tests observe it through [`FakeKubelet::wait_for`], which waits (with a timeout) on a `watch`
//! channel of [`KubeletView`]; nothing sleeps to synchronise.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context as _, anyhow, bail};
use baleen_proto::deviceplugin::v1beta1 as api;
use tokio::net::UnixListener;
use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle;
use tokio_stream::wrappers::UnixListenerStream;
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;
use tonic::{Request, Response, Status};

type PluginClient = api::device_plugin_client::DevicePluginClient<Channel>;
use baleen_proto::podresources::v1 as pr;

/// The kubelet's dial-back timeout.
const DIAL_TIMEOUT: Duration = Duration::from_secs(10);
/// The file the kubelet keeps when it wipes its directory.
pub const KUBELET_CHECKPOINT: &str = "kubelet_internal_checkpoint";

/// What the fake kubelet has seen, for tests to wait on.
#[derive(Debug, Clone, Default)]
pub struct KubeletView {
    /// Successful registrations per resource, since the fake was created (across restarts).
    pub registrations: HashMap<String, u64>,
    /// Refused registrations: (resource name, the kubelet's error message).
    pub refusals: Vec<(String, String)>,
    /// The last device list per resource received on ListAndWatch.
    pub devices: HashMap<String, Vec<api::Device>>,
    /// ListAndWatch messages received per resource.
    pub updates: HashMap<String, u64>,
    /// Resources whose ListAndWatch stream is open now.
    pub streaming: BTreeSet<String>,
    /// Times the kubelet (re)started listening.
    pub starts: u64,
}

impl KubeletView {
    /// The device list of `resource` (empty if none was received).
    pub fn devices_of(&self, resource: &str) -> &[api::Device] {
        self.devices.get(resource).map_or(&[], Vec::as_slice)
    }

    /// A short description for error messages: registrations, refusals, open streams, and
    /// per resource the devices and how many are healthy.
    pub fn summary(&self) -> String {
        let devices: BTreeMap<&String, (usize, usize)> = self
            .devices
            .iter()
            .map(|(r, d)| (r, (d.len(), d.iter().filter(|x| x.health == api::HEALTHY).count())))
            .collect();
        format!(
            "registrations {:?}, refusals {:?}, streaming {:?}, devices (all, healthy) {:?}, starts {}",
            self.registrations, self.refusals, self.streaming, devices, self.starts
        )
    }

    /// The healthy device IDs of `resource`.
    pub fn healthy(&self, resource: &str) -> Vec<String> {
        self.devices_of(resource)
            .iter()
            .filter(|d| d.health == api::HEALTHY)
            .map(|d| d.id.clone())
            .collect()
    }
}

struct PluginConn {
    client: PluginClient,
    options: api::DevicePluginOptions,
    stream: JoinHandle<()>,
}

#[derive(Default)]
struct Books {
    plugins: HashMap<String, PluginConn>,
    /// Devices handed out per resource (the kubelet's own accounting).
    allocated: HashMap<String, BTreeSet<String>>,
    /// Per pod (`namespace/name`): each container's devices per resource, for pod-resources.
    pods: BTreeMap<String, Vec<(String, String, Vec<String>)>>,
    /// A pod the next pod-resources `List` leaves out (see [`FakeKubelet::omit_from_next_list`]).
    omit_once: Option<String>,
    /// Every `List` answers no pod (see [`FakeKubelet::forget_pods`]).
    forgetful: bool,
}

struct Shared {
    dir: PathBuf,
    view: watch::Sender<KubeletView>,
    books: Mutex<Books>,
    /// The gate of the next pod-resources `List` (see [`FakeKubelet::hold_next_list`]).
    held_list: Mutex<Option<(oneshot::Sender<()>, oneshot::Receiver<()>)>>,
}

impl Shared {
    fn books(&self) -> std::sync::MutexGuard<'_, Books> {
        // A panicking test thread may poison the lock; the books are still consistent.
        self.books.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn held_list(
        &self,
    ) -> std::sync::MutexGuard<'_, Option<(oneshot::Sender<()>, oneshot::Receiver<()>)>> {
        self.held_list.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// A pod-resources `List` held on its way back (see [`FakeKubelet::hold_next_list`]).
pub struct HeldList {
    asked: oneshot::Receiver<()>,
    release: oneshot::Sender<()>,
}

impl HeldList {
    /// Waits (at most `timeout`) until the held `List` has been asked: its answer, the books as
    /// they were then, is fixed from that moment.
    pub async fn asked(&mut self, timeout: Duration) -> anyhow::Result<()> {
        tokio::time::timeout(timeout, &mut self.asked)
            .await
            .context("no pod-resources List was asked in time")?
            .context("the kubelet went away")
    }

    /// Lets the held `List` answer.
    pub fn release(self) {
        let _ = self.release.send(());
    }
}

/// A container admitted by [`FakeKubelet::admit`].
#[derive(Debug, Clone)]
pub struct Admission {
    /// The plugin's preferred allocation, when it offers one.
    pub preferred: Option<Vec<String>>,
    /// The device IDs the kubelet allocated.
    pub device_ids: Vec<String>,
    /// The plugin's answer for the container.
    pub response: api::ContainerAllocateResponse,
}

/// Why admission failed.
#[derive(Debug, thiserror::Error)]
pub enum AdmitError {
    /// No plugin is registered for the resource.
    #[error("no plugin registered for {0}")]
    NotRegistered(String),
    /// Fewer healthy, unallocated devices than requested (the kubelet's own check).
    #[error("{resource}: {requested} requested, {available} available")]
    NotEnough {
        /// The resource.
        resource: String,
        /// Devices requested.
        requested: usize,
        /// Devices available.
        available: usize,
    },
    /// The plugin answered with an error.
    #[error("plugin error: {0}")]
    Rpc(#[from] Status),
}

/// A fake kubelet listening on `<dir>/kubelet.sock` (or stopped).
pub struct FakeKubelet {
    shared: Arc<Shared>,
    server: Option<(CancellationToken, JoinHandle<()>)>,
    pod_resources: Option<(CancellationToken, JoinHandle<()>)>,
}

impl FakeKubelet {
    /// Starts a kubelet on `dir`, as the real one starts.
    pub async fn start(dir: &Path) -> anyhow::Result<Self> {
        let (view, _) = watch::channel(KubeletView::default());
        let shared = Arc::new(Shared {
            dir: dir.to_path_buf(),
            view,
            books: Mutex::new(Books::default()),
            held_list: Mutex::new(None),
        });
        let mut kubelet = Self { shared, server: None, pod_resources: None };
        kubelet.listen()?;
        Ok(kubelet)
    }

    /// A kubelet that has not started yet: [`FakeKubelet::restart`] starts it.
    pub fn absent(dir: &Path) -> Self {
        let (view, _) = watch::channel(KubeletView::default());
        let shared = Arc::new(Shared {
            dir: dir.to_path_buf(),
            view,
            books: Mutex::new(Books::default()),
            held_list: Mutex::new(None),
        });
        Self { shared, server: None, pod_resources: None }
    }

    /// Serves the pod-resources API (`List`, `GetAllocatableResources`, `Get`) from the
    /// kubelet's books on `socket`, as the kubelet does on
    /// `/var/lib/kubelet/pod-resources/kubelet.sock`.
    pub fn serve_pod_resources(&mut self, socket: &Path) -> anyhow::Result<()> {
        self.stop_pod_resources();
        if let Some(parent) = socket.parent() {
            std::fs::create_dir_all(parent)?;
        }
        let _ = std::fs::remove_file(socket);
        let listener = UnixListener::bind(socket)
            .with_context(|| format!("listen on {}", socket.display()))?;
        let router = tonic::transport::Server::builder().add_service(
            pr::pod_resources_lister_server::PodResourcesListerServer::new(PodResources(
                self.shared.clone(),
            )),
        );
        self.pod_resources = Some(serve(router, listener, "fake pod-resources"));
        Ok(())
    }

    /// Stops serving pod-resources.
    pub fn stop_pod_resources(&mut self) {
        if let Some((token, task)) = self.pod_resources.take() {
            token.cancel();
            task.abort();
        }
    }

    /// Holds the next pod-resources `List`: it is answered with the books as they are when it is
    /// asked, but only once the returned handle is released. A deterministic stale answer, as a
    /// real kubelet gives when pods change while its answer is on its way.
    pub fn hold_next_list(&self) -> HeldList {
        let (asked_tx, asked) = oneshot::channel();
        let (release, release_rx) = oneshot::channel();
        *self.shared.held_list() = Some((asked_tx, release_rx));
        HeldList { asked, release }
    }

    /// Admits one container of `pod` (`namespace/name`) and records it for pod-resources.
    pub async fn admit_to(
        &self,
        pod: &str,
        container: &str,
        resource: &str,
        count: usize,
    ) -> Result<Admission, AdmitError> {
        let admission = self.admit(resource, count).await?;
        self.shared.books().pods.entry(pod.to_owned()).or_default().push((
            container.to_owned(),
            resource.to_owned(),
            admission.device_ids.clone(),
        ));
        Ok(admission)
    }

    /// The next pod-resources `List` leaves `pod` out, once (a kubelet that has just restarted
    /// answers before it has synced its pods).
    pub fn omit_from_next_list(&self, pod: &str) {
        self.shared.books().omit_once = Some(pod.to_owned());
    }

    /// While `forgetful`, every pod-resources `List` answers no pod at all, while the pods run and
    /// their devices stay allocated (a kubelet restarted while the API server is unreachable
    /// lists only its static pods until it syncs).
    pub fn forget_pods(&self, forgetful: bool) {
        self.shared.books().forgetful = forgetful;
    }

    /// The pod ended: its devices are free in the kubelet's books and gone from pod-resources.
    pub fn end_pod(&self, pod: &str) {
        let mut books = self.shared.books();
        for (_, resource, ids) in books.pods.remove(pod).unwrap_or_default() {
            if let Some(set) = books.allocated.get_mut(&resource) {
                for id in &ids {
                    set.remove(id);
                }
            }
        }
    }

    /// The device-plugin directory.
    pub fn dir(&self) -> &Path {
        &self.shared.dir
    }

    fn listen(&mut self) -> anyhow::Result<()> {
        let dir = &self.shared.dir;
        std::fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o750))?;
        for entry in std::fs::read_dir(dir)? {
            let entry = entry?;
            if entry.file_name() == KUBELET_CHECKPOINT {
                continue;
            }
            let path = entry.path();
            if entry.file_type()?.is_dir() {
                std::fs::remove_dir_all(&path)?;
            } else {
                std::fs::remove_file(&path)?;
            }
        }
        let listener = UnixListener::bind(dir.join(api::KUBELET_SOCKET))
            .with_context(|| format!("listen on {}", dir.display()))?;
        let router = tonic::transport::Server::builder().add_service(
            api::registration_server::RegistrationServer::new(Registration(self.shared.clone())),
        );
        self.server = Some(serve(router, listener, "fake kubelet"));
        self.shared.view.send_modify(|v| v.starts += 1);
        Ok(())
    }

    async fn shut_down(&mut self) {
        if let Some((token, task)) = self.server.take() {
            token.cancel();
            let abort = task.abort_handle();
            if tokio::time::timeout(Duration::from_secs(2), task).await.is_err() {
                abort.abort();
            }
        }
        let plugins: Vec<PluginConn> = {
            let mut books = self.shared.books();
            books.plugins.drain().map(|(_, c)| c).collect()
        };
        for conn in plugins {
            conn.stream.abort();
        }
        self.shared.view.send_modify(|v| v.streaming.clear());
    }

    /// Stops listening, like a kubelet that died or was stopped: connections drop, and
    /// `kubelet.sock` stays behind as a stale file (the kubelet does not remove it).
    pub async fn stop(&mut self) {
        self.shut_down().await;
    }

    /// A kubelet restart: drop every plugin connection, wipe the directory, listen again. The
    /// kubelet's allocation books survive (they live in its checkpoint).
    pub async fn restart(&mut self) -> anyhow::Result<()> {
        self.shut_down().await;
        self.listen()
    }

    /// What the kubelet has seen so far.
    pub fn view(&self) -> KubeletView {
        self.shared.view.borrow().clone()
    }

    /// Waits until `predicate` holds for the kubelet's view, at most `timeout`.
    pub async fn wait_for(
        &self,
        what: &str,
        timeout: Duration,
        mut predicate: impl FnMut(&KubeletView) -> bool,
    ) -> anyhow::Result<KubeletView> {
        let mut rx = self.shared.view.subscribe();
        let outcome = tokio::time::timeout(timeout, rx.wait_for(|v| predicate(v)))
            .await
            .map(|r| r.map(|view| view.clone()));
        match outcome {
            Ok(Ok(view)) => Ok(view),
            Ok(Err(_)) => bail!("fake kubelet dropped while waiting for {what}"),
            Err(_) => bail!(
                "timed out after {timeout:?} waiting for {what}; kubelet view: {}",
                rx.borrow().summary()
            ),
        }
    }

    /// Waits until `resource` has registered at least `n` times in all.
    pub async fn wait_registered(&self, resource: &str, n: u64) -> anyhow::Result<KubeletView> {
        self.wait_for(&format!("{resource} registered {n} time(s)"), Duration::from_secs(10), |v| {
            v.registrations.get(resource).copied().unwrap_or(0) >= n
                && v.streaming.contains(resource)
        })
        .await
    }

    fn client(
        &self,
        resource: &str,
    ) -> Result<(PluginClient, api::DevicePluginOptions), AdmitError> {
        let books = self.shared.books();
        let conn = books
            .plugins
            .get(resource)
            .ok_or_else(|| AdmitError::NotRegistered(resource.into()))?;
        Ok((conn.client.clone(), conn.options))
    }

    /// Admits one container asking for `count` devices of `resource`, as the kubelet does.
    pub async fn admit(&self, resource: &str, count: usize) -> Result<Admission, AdmitError> {
        self.admit_reusing(resource, count, &[]).await
    }

    /// Admits one container that may reuse `reusable` devices of the pod's init containers, as
    /// the kubelet does: with enough reusable devices it takes the first `count` of them without
    /// asking the plugin; otherwise it asks GetPreferredAllocation with the reusable devices as
    /// must-include (and among the available), then calls Allocate with all of them.
    pub async fn admit_reusing(
        &self,
        resource: &str,
        count: usize,
        reusable: &[String],
    ) -> Result<Admission, AdmitError> {
        let (mut client, options) = self.client(resource)?;
        let mut reusable: Vec<String> = reusable.to_vec();
        reusable.sort();
        let available: Vec<String> = {
            let books = self.shared.books();
            let taken = books.allocated.get(resource);
            let mut healthy = self.view().healthy(resource);
            healthy.retain(|id| !taken.is_some_and(|t| t.contains(id)) || reusable.contains(id));
            healthy.sort();
            healthy
        };
        if available.len() < count {
            return Err(AdmitError::NotEnough {
                resource: resource.into(),
                requested: count,
                available: available.len(),
            });
        }
        let preferred = if reusable.len() >= count {
            None
        } else if options.get_preferred_allocation_available {
            let request = api::PreferredAllocationRequest {
                container_requests: vec![api::ContainerPreferredAllocationRequest {
                    available_device_i_ds: available.clone(),
                    must_include_device_i_ds: reusable.clone(),
                    allocation_size: i32::try_from(count).unwrap_or(i32::MAX),
                }],
            };
            let answer = with_timeout(client.get_preferred_allocation(request)).await?;
            Some(
                answer
                    .container_responses
                    .into_iter()
                    .next()
                    .map(|c| c.device_i_ds)
                    .unwrap_or_default(),
            )
        } else {
            None
        };
        // Like the kubelet: reusable devices first, then the preferred devices that are
        // available, then its own choice (here: in sorted order) for the rest.
        let mut device_ids: Vec<String> = Vec::with_capacity(count);
        for id in reusable.iter().chain(preferred.iter().flatten()).chain(available.iter()) {
            if device_ids.len() == count {
                break;
            }
            if available.contains(id) && !device_ids.contains(id) {
                device_ids.push(id.clone());
            }
        }
        let response = self.allocate_raw(resource, vec![device_ids.clone()]).await?;
        let response = response
            .container_responses
            .into_iter()
            .next()
            .ok_or_else(|| Status::internal("plugin returned no container response"))?;
        self.shared
            .books()
            .allocated
            .entry(resource.to_owned())
            .or_default()
            .extend(device_ids.iter().cloned());
        Ok(Admission { preferred, device_ids, response })
    }

    /// Calls Allocate with these containers' device IDs, outside the kubelet's books (for
    /// requests the real kubelet would not make, and for repeated init-container allocations).
    pub async fn allocate_raw(
        &self,
        resource: &str,
        containers: Vec<Vec<String>>,
    ) -> Result<api::AllocateResponse, AdmitError> {
        let (mut client, _) = self.client(resource)?;
        let request = api::AllocateRequest {
            container_requests: containers
                .into_iter()
                .map(|devices_ids| api::ContainerAllocateRequest { devices_ids })
                .collect(),
        };
        Ok(with_timeout(client.allocate(request)).await?)
    }

    /// A pod ended: the kubelet frees its devices in its own books and tells the plugin nothing.
    pub fn release(&self, resource: &str, device_ids: &[String]) {
        if let Some(set) = self.shared.books().allocated.get_mut(resource) {
            for id in device_ids {
                set.remove(id);
            }
        }
    }
}

impl Drop for FakeKubelet {
    fn drop(&mut self) {
        self.stop_pod_resources();
        if let Some((token, task)) = self.server.take() {
            token.cancel();
            task.abort();
        }
        for (_, conn) in self.shared.books().plugins.drain() {
            conn.stream.abort();
        }
    }
}

/// Serves `router` on `listener` until the returned token is cancelled.
fn serve(
    router: tonic::transport::server::Router,
    listener: UnixListener,
    what: &'static str,
) -> (CancellationToken, JoinHandle<()>) {
    let token = CancellationToken::new();
    let stop = token.clone();
    let task = tokio::spawn(async move {
        let served = router
            .serve_with_incoming_shutdown(UnixListenerStream::new(listener), stop.cancelled_owned())
            .await;
        if let Err(e) = served {
            tracing::error!(error = %e, "{what} server failed");
        }
    });
    (token, task)
}

async fn with_timeout<T>(
    call: impl std::future::Future<Output = Result<Response<T>, Status>>,
) -> Result<T, Status> {
    match tokio::time::timeout(Duration::from_secs(10), call).await {
        Ok(result) => result.map(Response::into_inner),
        Err(_) => Err(Status::deadline_exceeded("plugin did not answer within 10 s")),
    }
}

struct Registration(Arc<Shared>);

impl Registration {
    async fn connect(&self, request: &api::RegisterRequest) -> anyhow::Result<()> {
        let shared = &self.0;
        let resource = request.resource_name.clone();
        let socket = shared.dir.join(&request.endpoint);
        let channel = baleen_device_plugin::uds::connect(&socket, DIAL_TIMEOUT)
            .await
            .map_err(|e| anyhow!("failed to dial device plugin: {e}"))?;
        let mut client = PluginClient::new(channel);
        let options = with_timeout(client.get_device_plugin_options(api::Empty {})).await?;
        // Like the kubelet's goroutine: ListAndWatch is opened beside, not before, the answer.
        let view = shared.view.clone();
        let name = resource.clone();
        let mut stream_client = client.clone();
        // The stream's first list may reach the view only once the plugin is in the books: a
        // test that waits for devices can then admit at once.
        let (booked, is_booked) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            let _ = is_booked.await;
            let Ok(Ok(response)) =
                tokio::time::timeout(DIAL_TIMEOUT, stream_client.list_and_watch(api::Empty {}))
                    .await
            else {
                return;
            };
            let mut stream = response.into_inner();
            view.send_modify(|v| {
                v.streaming.insert(name.clone());
            });
            while let Ok(Some(message)) = stream.message().await {
                view.send_modify(|v| {
                    v.devices.insert(name.clone(), message.devices);
                    *v.updates.entry(name.clone()).or_default() += 1;
                });
            }
            view.send_modify(|v| {
                v.streaming.remove(&name);
            });
        });
        let old = shared
            .books()
            .plugins
            .insert(resource.clone(), PluginConn { client, options, stream: task });
        if let Some(old) = old {
            old.stream.abort();
        }
        let _ = booked.send(());
        Ok(())
    }
}

#[tonic::async_trait]
impl api::registration_server::Registration for Registration {
    async fn register(
        &self,
        request: Request<api::RegisterRequest>,
    ) -> Result<Response<api::Empty>, Status> {
        let request = request.into_inner();
        let refuse = |message: String| {
            self.0
                .view
                .send_modify(|v| v.refusals.push((request.resource_name.clone(), message.clone())));
            // The kubelet returns a plain Go error, which gRPC sends as Unknown.
            Status::unknown(message)
        };
        if request.version != api::VERSION {
            return Err(refuse(format!(
                "requested API version {:?} is not supported by kubelet. Supported versions are [\"v1beta1\"]",
                request.version
            )));
        }
        if baleen_device_plugin::resource_name::validate(&request.resource_name).is_err() {
            return Err(refuse(format!("the ResourceName {:?} is invalid", request.resource_name)));
        }
        if let Err(e) = self.connect(&request).await {
            return Err(refuse(e.to_string()));
        }
        self.0.view.send_modify(|v| {
            *v.registrations.entry(request.resource_name.clone()).or_default() += 1;
        });
        Ok(Response::new(api::Empty {}))
    }
}

struct PodResources(Arc<Shared>);

impl PodResources {
    fn pod(&self, key: &str, containers: &[(String, String, Vec<String>)]) -> pr::PodResources {
        let (namespace, name) = key.split_once('/').unwrap_or(("default", key));
        let mut by_container: BTreeMap<&str, Vec<pr::ContainerDevices>> = BTreeMap::new();
        for (container, resource, ids) in containers {
            by_container.entry(container).or_default().push(pr::ContainerDevices {
                resource_name: resource.clone(),
                device_ids: ids.clone(),
                topology: None,
            });
        }
        pr::PodResources {
            name: name.to_owned(),
            namespace: namespace.to_owned(),
            containers: by_container
                .into_iter()
                .map(|(name, devices)| pr::ContainerResources {
                    name: name.to_owned(),
                    devices,
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        }
    }
}

#[tonic::async_trait]
impl pr::pod_resources_lister_server::PodResourcesLister for PodResources {
    async fn list(
        &self,
        _request: Request<pr::ListPodResourcesRequest>,
    ) -> Result<Response<pr::ListPodResourcesResponse>, Status> {
        let pod_resources = {
            let mut books = self.0.books();
            let omit = books.omit_once.take();
            let forgetful = books.forgetful;
            books
                .pods
                .iter()
                .filter(|_| !forgetful)
                .filter(|(key, _)| omit.as_deref() != Some(key.as_str()))
                .map(|(key, c)| self.pod(key, c))
                .collect()
        };
        let gate = self.0.held_list().take();
        if let Some((asked, release)) = gate {
            let _ = asked.send(());
            // A dropped handle releases too.
            let _ = release.await;
        }
        Ok(Response::new(pr::ListPodResourcesResponse { pod_resources }))
    }

    async fn get_allocatable_resources(
        &self,
        _request: Request<pr::AllocatableResourcesRequest>,
    ) -> Result<Response<pr::AllocatableResourcesResponse>, Status> {
        let view = self.0.view.borrow().clone();
        let devices = view
            .devices
            .keys()
            .map(|resource| pr::ContainerDevices {
                resource_name: resource.clone(),
                device_ids: view.healthy(resource),
                topology: None,
            })
            .collect();
        Ok(Response::new(pr::AllocatableResourcesResponse { devices, ..Default::default() }))
    }

    async fn get(
        &self,
        request: Request<pr::GetPodResourcesRequest>,
    ) -> Result<Response<pr::GetPodResourcesResponse>, Status> {
        let request = request.into_inner();
        let key = format!("{}/{}", request.pod_namespace, request.pod_name);
        let books = self.0.books();
        let containers = books
            .pods
            .get(&key)
            .ok_or_else(|| Status::not_found(format!("pod {key} not found")))?;
        Ok(Response::new(pr::GetPodResourcesResponse {
            pod_resources: Some(self.pod(&key, containers)),
        }))
    }
}
