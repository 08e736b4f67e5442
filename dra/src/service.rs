//! The DRA service socket: `NodePrepareResources` and `NodeUnprepareResources` in both versions
//! kubelets speak (`v1`, 1.34 and later; `v1beta1`, 1.32 and later), served by tonic (kubelets
//! dial this socket with `:authority` `localhost`, which h2 accepts), and [`Preparer`], which
//! does the work on the agent's ledger:
//!
//! - **Prepare**, per claim of the batch, concurrently: a claim the ledger already holds is
//!   answered as booked (the kubelet repeats a Prepare it saw fail, or after its own restart),
//!   without asking the API server; any other is read from the API server (its UID must be the
//!   one asked), its devices booked in the ledger (durably, before the answer: the kubelet never
//!   prepares a claim in use again after a plugin restart), its CDI spec written, and its CDI
//!   device names answered. A claim that fails answers its own error and leaves nothing booked;
//!   the others of the batch are answered.
//! - **Unprepare**, per claim: its CDI spec removed and its booking released, from the ledger
//!   alone (the claim may be gone from the API server); a claim not held is already unprepared.
//!
//! Every claim asked about gets an entry in the answer, as the kubelet requires.
//!
//! Beside them, where the agent gives one, [`HealthService`]: `v1.DRAResourceHealth`'s
//! `NodeWatchResources` stream of every device's health, which kubelets with
//! `ResourceHealthStatus` (KEP-4680) put in the status of the pods using the devices.

use std::collections::BTreeMap;
use std::future::Future;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use baleen_device_plugin::limits;
use baleen_device_plugin::uds::BoundSocket;
use baleen_proto::dra::{health, v1, v1beta1};
use k8s_openapi::api::resource::v1::ResourceClaim;
use tokio_util::sync::CancellationToken;

use baleen_k8s::error_chain::Chain;

use crate::cdi::{Edits, SpecDir};
use crate::claims::{self, ClaimAllocation, ClaimRef, Consumer};

/// How long one claim's GET may take (the kubelet gives the whole batch 45 s).
pub const GET_TIMEOUT: Duration = Duration::from_secs(10);

/// One device of a prepared claim, as the kubelet is told of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PreparedDevice {
    /// The claim's requests it serves.
    pub requests: Vec<String>,
    /// Its pool.
    pub pool: String,
    /// Its name in the pool.
    pub device: String,
    /// The CDI devices the runtime gives the containers.
    pub cdi_ids: Vec<String>,
    /// Its share, for a device allocated more than once.
    pub share_id: Option<String>,
}

/// What the service asks of the driver; every claim asked must have an entry, by UID.
pub trait Driver: Send + Sync + 'static {
    /// Prepares the claims of one pod.
    fn prepare(
        &self,
        claims: Vec<ClaimRef>,
    ) -> impl Future<Output = BTreeMap<String, Result<Vec<PreparedDevice>, String>>> + Send;
    /// Unprepares claims.
    fn unprepare(
        &self,
        claims: Vec<ClaimRef>,
    ) -> impl Future<Output = BTreeMap<String, Result<(), String>>> + Send;
}

/// Where claims are read: the API server (`GET` of one ResourceClaim).
pub trait ClaimSource: Send + Sync + 'static {
    /// The claim `claim` names (by namespace and name), `None` if there is none.
    fn get(
        &self,
        claim: &ClaimRef,
    ) -> impl Future<Output = Result<Option<ResourceClaim>, String>> + Send;
}

/// One device of a claim as the ledger booked it, with what its containers need.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Booked {
    /// The claim's request it serves.
    pub request: String,
    /// The device's name in the pool.
    pub device: String,
    /// Its share ID, as allocated.
    pub share_id: Option<String>,
    /// What the claim's own CDI device does to a container (MPS pipe, limits, ...).
    pub edits: Edits,
    /// CDI devices of other specs the containers also need (the toolkit's
    /// `nvidia.com/gpu=<UUID>`), named before the claim's own.
    pub other_cdi_ids: Vec<String>,
}

/// The agent's ledger as the preparer uses it. Calls block (a booking is on disk before it
/// returns): the preparer makes them off the async threads.
pub trait Bookings: Send + Sync + 'static {
    /// What claim `uid` holds, if the ledger holds it.
    fn booked(&self, uid: &str) -> Option<Vec<Booked>>;
    /// Books `allocation`'s devices for the claim (reserved for `consumers`), all or none, and
    /// durably; a claim already held is answered as it was booked. Refuses, with the reason,
    /// whatever the ledger cannot hold.
    fn book(
        &self,
        allocation: &ClaimAllocation,
        consumers: &[Consumer],
    ) -> Result<Vec<Booked>, String>;
    /// Releases claim `uid`, durably; whether it was held.
    fn release(&self, uid: &str) -> Result<bool, String>;
}

/// The driver: claims read from `source`, booked in `bookings`, specs written to `specs`.
pub struct Preparer<S, B> {
    driver: String,
    pool: String,
    source: S,
    bookings: Arc<B>,
    specs: SpecDir,
}

impl<S: ClaimSource, B: Bookings> Preparer<S, B> {
    /// The preparer of `driver` for the node whose pool is `pool`.
    pub fn new(driver: &str, pool: &str, source: S, bookings: Arc<B>, specs: SpecDir) -> Self {
        Self { driver: driver.to_owned(), pool: pool.to_owned(), source, bookings, specs }
    }

    /// The answer for claim `uid`'s booked devices: writes its CDI spec (again: a spec lost
    /// with `/var/run` is written back) and names its devices. The spec's files are read and
    /// written on a blocking thread, never on the runtime's.
    async fn answer(&self, uid: &str, booked: &[Booked]) -> Result<Vec<PreparedDevice>, String> {
        let edits: Vec<(String, Edits)> =
            booked.iter().map(|b| (b.device.clone(), b.edits.clone())).collect();
        let (specs, claim) = (self.specs.clone(), uid.to_owned());
        let ours = tokio::task::spawn_blocking(move || specs.write(&claim, &edits))
            .await
            .map_err(|e| format!("writing the CDI spec of claim {uid}: {e}"))?
            .map_err(|e| Chain(&e).to_string())?;
        Ok(booked
            .iter()
            .zip(ours)
            .map(|(b, own)| PreparedDevice {
                requests: vec![b.request.clone()],
                pool: self.pool.clone(),
                device: b.device.clone(),
                cdi_ids: b.other_cdi_ids.iter().cloned().chain(std::iter::once(own)).collect(),
                share_id: b.share_id.clone(),
            })
            .collect())
    }

    async fn prepare_one(&self, claim: &ClaimRef) -> Result<Vec<PreparedDevice>, String> {
        if claim.uid.is_empty() || claim.name.is_empty() || claim.namespace.is_empty() {
            return Err(format!(
                "claim {claim}: the kubelet must name its namespace, name and UID"
            ));
        }
        let bookings = self.bookings.clone();
        let uid = claim.uid.clone();
        if let Some(booked) = blocking(move || Ok(bookings.booked(&uid))).await? {
            return self.answer(&claim.uid, &booked).await;
        }
        let found = tokio::time::timeout(GET_TIMEOUT, self.source.get(claim))
            .await
            .map_err(|_| {
                format!("claim {claim}: the API server did not answer in {GET_TIMEOUT:?}")
            })?
            .map_err(|e| format!("claim {claim}: cannot be read from the API server: {e}"))?
            .ok_or_else(|| format!("claim {claim}: the API server has no such claim"))?;
        let allocation = claims::read_allocation(&found, claim, &self.driver, &self.pool)
            .map_err(|e| e.to_string())?;
        let bookings = self.bookings.clone();
        let consumers = allocation.reserved_for.clone();
        let booked = blocking(move || bookings.book(&allocation, &consumers)).await?;
        match self.answer(&claim.uid, &booked).await {
            Ok(devices) => Ok(devices),
            Err(e) => {
                // Nothing half-prepared: a booking whose spec cannot be written is given back.
                let bookings = self.bookings.clone();
                let uid = claim.uid.clone();
                if let Err(r) = blocking(move || bookings.release(&uid)).await {
                    tracing::error!(%claim, error = r, "cannot release a claim whose CDI spec failed");
                }
                Err(format!("claim {claim}: {e}"))
            }
        }
    }

    async fn unprepare_one(&self, claim: &ClaimRef) -> Result<(), String> {
        self.specs.remove(&claim.uid).map_err(|e| format!("claim {claim}: {}", Chain(&e)))?;
        let bookings = self.bookings.clone();
        let uid = claim.uid.clone();
        let held = blocking(move || bookings.release(&uid))
            .await
            .map_err(|e| format!("claim {claim}: {e}"))?;
        if held {
            tracing::info!(%claim, "claim unprepared");
        } else {
            tracing::debug!(%claim, "claim was not prepared here; nothing to unprepare");
        }
        Ok(())
    }
}

/// Runs `f` on the blocking pool.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, String> + Send + 'static,
) -> Result<T, String> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| format!("internal: the booking task failed: {e}"))?
}

impl<S: ClaimSource, B: Bookings> Driver for Preparer<S, B> {
    async fn prepare(
        &self,
        claims: Vec<ClaimRef>,
    ) -> BTreeMap<String, Result<Vec<PreparedDevice>, String>> {
        let answers =
            futures_util::future::join_all(claims.iter().map(|c| self.prepare_one(c))).await;
        claims.into_iter().map(|c| c.uid).zip(answers).collect()
    }

    async fn unprepare(&self, claims: Vec<ClaimRef>) -> BTreeMap<String, Result<(), String>> {
        let answers =
            futures_util::future::join_all(claims.iter().map(|c| self.unprepare_one(c))).await;
        claims.into_iter().map(|c| c.uid).zip(answers).collect()
    }
}

/// The tonic service of both versions over one driver.
pub struct Service<D> {
    driver: Arc<D>,
}

impl<D> Clone for Service<D> {
    fn clone(&self) -> Self {
        Self { driver: self.driver.clone() }
    }
}

impl<D: Driver> Service<D> {
    /// The service of `driver`.
    pub fn new(driver: Arc<D>) -> Self {
        Self { driver }
    }

    /// Asks the driver, and gives every claim asked an entry (see [`every_claim`]).
    async fn prepare(
        &self,
        claims: Vec<ClaimRef>,
    ) -> BTreeMap<String, Result<Vec<PreparedDevice>, String>> {
        let uids: Vec<String> = claims.iter().map(|c| c.uid.clone()).collect();
        every_claim(uids, self.driver.prepare(claims).await)
    }

    async fn unprepare(&self, claims: Vec<ClaimRef>) -> BTreeMap<String, Result<(), String>> {
        let uids: Vec<String> = claims.iter().map(|c| c.uid.clone()).collect();
        every_claim(uids, self.driver.unprepare(claims).await)
    }
}

/// `answers` with an entry for every one of `uids`: one the driver left out is an internal
/// error, never a missing entry the kubelet would wait on.
fn every_claim<T>(
    uids: Vec<String>,
    mut answers: BTreeMap<String, Result<T, String>>,
) -> BTreeMap<String, Result<T, String>> {
    for uid in uids {
        answers.entry(uid).or_insert_with(|| Err("internal: the driver gave no answer".into()));
    }
    answers
}

macro_rules! claim_refs {
    ($claims:expr) => {
        $claims
            .into_iter()
            .map(|c| ClaimRef { namespace: c.namespace, name: c.name, uid: c.uid })
            .collect::<Vec<_>>()
    };
}

#[tonic::async_trait]
impl<D: Driver> v1::dra_plugin_server::DraPlugin for Service<D> {
    async fn node_prepare_resources(
        &self,
        request: tonic::Request<v1::NodePrepareResourcesRequest>,
    ) -> Result<tonic::Response<v1::NodePrepareResourcesResponse>, tonic::Status> {
        let answers = self.prepare(claim_refs!(request.into_inner().claims)).await;
        let claims = answers
            .into_iter()
            .map(|(uid, answer)| {
                let entry = match answer {
                    Ok(devices) => v1::NodePrepareResourceResponse {
                        devices: devices
                            .into_iter()
                            .map(|d| v1::Device {
                                request_names: d.requests,
                                pool_name: d.pool,
                                device_name: d.device,
                                cdi_device_ids: d.cdi_ids,
                                share_id: d.share_id,
                            })
                            .collect(),
                        error: String::new(),
                    },
                    Err(error) => v1::NodePrepareResourceResponse { devices: Vec::new(), error },
                };
                (uid, entry)
            })
            .collect();
        Ok(tonic::Response::new(v1::NodePrepareResourcesResponse { claims }))
    }

    async fn node_unprepare_resources(
        &self,
        request: tonic::Request<v1::NodeUnprepareResourcesRequest>,
    ) -> Result<tonic::Response<v1::NodeUnprepareResourcesResponse>, tonic::Status> {
        let answers = self.unprepare(claim_refs!(request.into_inner().claims)).await;
        let claims = answers
            .into_iter()
            .map(|(uid, a)| {
                (uid, v1::NodeUnprepareResourceResponse { error: a.err().unwrap_or_default() })
            })
            .collect();
        Ok(tonic::Response::new(v1::NodeUnprepareResourcesResponse { claims }))
    }
}

#[tonic::async_trait]
impl<D: Driver> v1beta1::dra_plugin_server::DraPlugin for Service<D> {
    async fn node_prepare_resources(
        &self,
        request: tonic::Request<v1beta1::NodePrepareResourcesRequest>,
    ) -> Result<tonic::Response<v1beta1::NodePrepareResourcesResponse>, tonic::Status> {
        let answers = self.prepare(claim_refs!(request.into_inner().claims)).await;
        let claims = answers
            .into_iter()
            .map(|(uid, answer)| {
                let entry = match answer {
                    // v1beta1 has no share IDs: a kubelet speaking it has no shares either.
                    Ok(devices) => v1beta1::NodePrepareResourceResponse {
                        devices: devices
                            .into_iter()
                            .map(|d| v1beta1::Device {
                                request_names: d.requests,
                                pool_name: d.pool,
                                device_name: d.device,
                                cdi_device_ids: d.cdi_ids,
                            })
                            .collect(),
                        error: String::new(),
                    },
                    Err(error) => {
                        v1beta1::NodePrepareResourceResponse { devices: Vec::new(), error }
                    }
                };
                (uid, entry)
            })
            .collect();
        Ok(tonic::Response::new(v1beta1::NodePrepareResourcesResponse { claims }))
    }

    async fn node_unprepare_resources(
        &self,
        request: tonic::Request<v1beta1::NodeUnprepareResourcesRequest>,
    ) -> Result<tonic::Response<v1beta1::NodeUnprepareResourcesResponse>, tonic::Status> {
        let answers = self.unprepare(claim_refs!(request.into_inner().claims)).await;
        let claims = answers
            .into_iter()
            .map(|(uid, a)| {
                (uid, v1beta1::NodeUnprepareResourceResponse { error: a.err().unwrap_or_default() })
            })
            .collect();
        Ok(tonic::Response::new(v1beta1::NodeUnprepareResourcesResponse { claims }))
    }
}

/// One device's health, as the kubelet's health stream carries it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceHealth {
    /// The device's name in the pool.
    pub device: String,
    /// Whether it is healthy.
    pub healthy: bool,
    /// Why not, when it is not.
    pub message: String,
}

/// How often the health stream says every device's health again, whether or not it changed:
/// the kubelet takes a device whose last word is older than [`HEALTH_TIMEOUT_SECONDS`] as of
/// unknown health.
pub const HEALTH_RESEND: Duration = Duration::from_secs(10);
/// How long the kubelet may trust one message of the health stream.
pub const HEALTH_TIMEOUT_SECONDS: i64 = 30;

/// `v1.DRAResourceHealth`: every device's health on each change of `health`, and every
/// [`HEALTH_RESEND`].
#[derive(Clone)]
pub struct HealthService {
    pool: String,
    health: tokio::sync::watch::Receiver<Vec<DeviceHealth>>,
    /// Ends every stream (a server shutting down waits for its streams).
    stop: CancellationToken,
}

impl HealthService {
    /// The health of the devices of `pool`, as `health` says it, until `stop` (which ends every
    /// stream).
    pub fn new(
        pool: &str,
        health: tokio::sync::watch::Receiver<Vec<DeviceHealth>>,
        stop: CancellationToken,
    ) -> Self {
        Self { pool: pool.to_owned(), health, stop }
    }

    fn message(&self, devices: &[DeviceHealth]) -> health::NodeWatchResourcesResponse {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX));
        health::NodeWatchResourcesResponse {
            devices: devices
                .iter()
                .map(|d| health::DeviceHealth {
                    device: Some(health::DeviceIdentifier {
                        pool_name: self.pool.clone(),
                        device_name: d.device.clone(),
                    }),
                    health: if d.healthy {
                        health::HealthStatus::Healthy
                    } else {
                        health::HealthStatus::Unhealthy
                    }
                    .into(),
                    last_updated_time: now,
                    health_check_timeout_seconds: HEALTH_TIMEOUT_SECONDS,
                    // The kubelet cuts a longer message at 1,021 characters and adds "...".
                    message: d.message.chars().take(1024).collect(),
                })
                .collect(),
        }
    }
}

type HealthStream = std::pin::Pin<
    Box<
        dyn futures_util::Stream<Item = Result<health::NodeWatchResourcesResponse, tonic::Status>>
            + Send,
    >,
>;

#[tonic::async_trait]
impl health::dra_resource_health_server::DraResourceHealth for HealthService {
    type NodeWatchResourcesStream = HealthStream;

    async fn node_watch_resources(
        &self,
        _: tonic::Request<health::NodeWatchResourcesRequest>,
    ) -> Result<tonic::Response<HealthStream>, tonic::Status> {
        let mut watch = self.health.clone();
        watch.mark_changed();
        let service = self.clone();
        let stream = futures_util::stream::unfold((watch, service), |(mut watch, service)| async {
            // The first message at once, then on each change or every HEALTH_RESEND.
            if !watch.has_changed().unwrap_or(false) {
                tokio::select! {
                    () = service.stop.cancelled() => return None,
                    _ = tokio::time::timeout(HEALTH_RESEND, watch.changed()) => {}
                }
            }
            if service.stop.is_cancelled() {
                return None;
            }
            let devices = watch.borrow_and_update().clone();
            let message = service.message(&devices);
            Some((Ok(message), (watch, service)))
        });
        Ok(tonic::Response::new(Box::pin(stream)))
    }
}

/// Serves `driver` (both versions) on a socket bound at `path`, with `health`'s stream where
/// given, with the device-plugin sockets' bounds (connections, streams, windows), until `token`
/// is cancelled; the socket file is removed then.
pub fn serve<D: Driver>(
    path: &Path,
    driver: Arc<D>,
    health: Option<HealthService>,
    token: CancellationToken,
) -> std::io::Result<impl Future<Output = Result<(), tonic::transport::Error>> + Send + 'static> {
    let (socket, listener) = BoundSocket::bind(path)?;
    let service = Service::new(driver);
    let router = limits::bounded_server()
        .add_optional_service(
            health.map(health::dra_resource_health_server::DraResourceHealthServer::new),
        )
        .add_service(v1::dra_plugin_server::DraPluginServer::new(service.clone()))
        .add_service(v1beta1::dra_plugin_server::DraPluginServer::new(service));
    Ok(async move {
        let _socket = socket;
        router
            .serve_with_incoming_shutdown(limits::slotted(listener), token.cancelled_owned())
            .await
    })
}
