//! The gRPC `DevicePlugin` service for one resource: the only module that implements the
//! generated server trait. It checks every request's shape and IDs against the advertised list,
//! then calls the backend; every backend error goes through [`crate::status`].

use std::collections::HashSet;
use std::pin::Pin;
use std::sync::Arc;

use baleen_proto::deviceplugin::v1beta1 as api;
use futures_util::{Stream, StreamExt as _};
use tokio_stream::wrappers::WatchStream;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

use crate::backend::{
    BackendError, ContainerAllocation, DeviceBackend, PreferredAllocationRequest,
};
use crate::device::DeviceList;
use crate::status::to_status;

/// Serves one backend. ListAndWatch streams end when `shutdown` is cancelled, so that the
/// server can stop gracefully.
pub struct DevicePluginService {
    backend: Arc<dyn DeviceBackend>,
    shutdown: CancellationToken,
}

impl DevicePluginService {
    /// A service for `backend` whose streams end on `shutdown`.
    pub fn new(backend: Arc<dyn DeviceBackend>, shutdown: CancellationToken) -> Self {
        Self { backend, shutdown }
    }

    /// The tonic server wrapper, ready to add to a router.
    pub fn into_server(self) -> api::device_plugin_server::DevicePluginServer<Self> {
        api::device_plugin_server::DevicePluginServer::new(self)
    }

    fn options(&self) -> api::DevicePluginOptions {
        api::DevicePluginOptions {
            pre_start_required: false,
            get_preferred_allocation_available: self.backend.has_preferred_allocation(),
        }
    }

    fn resource(&self) -> &str {
        self.backend.resource_name()
    }

    fn fail(&self, operation: &str, error: &BackendError) -> Status {
        let status = to_status(self.resource(), operation, error);
        tracing::warn!(resource = self.resource(), code = ?status.code(), "{}", status.message());
        status
    }
}

/// The kubelet's view of a device list.
pub fn to_response(list: &DeviceList) -> api::ListAndWatchResponse {
    api::ListAndWatchResponse {
        devices: list
            .devices()
            .iter()
            .map(|d| api::Device {
                id: d.id.clone(),
                health: d.health.as_str().to_owned(),
                topology: d
                    .numa_node
                    .map(|n| api::TopologyInfo { nodes: vec![api::NumaNode { id: i64::from(n) }] }),
            })
            .collect(),
    }
}

/// Checks that the IDs are well-formed, distinct and advertised.
fn check_ids(list: &DeviceList, ids: &[String]) -> Result<(), BackendError> {
    let malformed: Vec<String> = ids
        .iter()
        .filter(|id| id.is_empty() || id.chars().any(|c| c.is_whitespace() || c.is_control()))
        .cloned()
        .collect();
    if !malformed.is_empty() {
        return Err(BackendError::InvalidRequest {
            ids: malformed,
            reason: "malformed device IDs (empty, or containing whitespace or control characters)"
                .into(),
        });
    }
    let mut seen = HashSet::with_capacity(ids.len());
    let repeated: Vec<String> =
        ids.iter().filter(|id| !seen.insert(id.as_str())).cloned().collect();
    if !repeated.is_empty() {
        return Err(BackendError::InvalidRequest {
            ids: repeated,
            reason: "device IDs repeated in one request".into(),
        });
    }
    let unknown: Vec<String> = ids.iter().filter(|id| list.get(id).is_none()).cloned().collect();
    if !unknown.is_empty() {
        return Err(BackendError::UnknownDevices { ids: unknown });
    }
    Ok(())
}

fn check_preferred(
    list: &DeviceList,
    request: &api::ContainerPreferredAllocationRequest,
) -> Result<PreferredAllocationRequest, BackendError> {
    check_ids(list, &request.available_device_i_ds)?;
    let missing: Vec<String> = request
        .must_include_device_i_ds
        .iter()
        .filter(|id| !request.available_device_i_ds.contains(id))
        .cloned()
        .collect();
    if !missing.is_empty() {
        return Err(BackendError::InvalidRequest {
            ids: missing,
            reason: "must-include devices are not among the available ones".into(),
        });
    }
    let size = usize::try_from(request.allocation_size).unwrap_or(0);
    if size == 0
        || size > request.available_device_i_ds.len()
        || size < request.must_include_device_i_ds.len()
    {
        return Err(BackendError::InvalidRequest {
            ids: request.must_include_device_i_ds.clone(),
            reason: format!(
                "allocation size {} is not between {} (must include) and {} (available)",
                request.allocation_size,
                request.must_include_device_i_ds.len().max(1),
                request.available_device_i_ds.len()
            ),
        });
    }
    Ok(PreferredAllocationRequest {
        available: request.available_device_i_ds.clone(),
        must_include: request.must_include_device_i_ds.clone(),
        size,
    })
}

fn to_container_response(a: ContainerAllocation) -> api::ContainerAllocateResponse {
    api::ContainerAllocateResponse {
        envs: a.envs.into_iter().collect(),
        mounts: a
            .mounts
            .into_iter()
            .map(|m| api::Mount {
                container_path: m.container_path,
                host_path: m.host_path,
                read_only: m.read_only,
            })
            .collect(),
        devices: a
            .devices
            .into_iter()
            .map(|d| api::DeviceSpec {
                container_path: d.container_path,
                host_path: d.host_path,
                permissions: d.permissions,
            })
            .collect(),
        annotations: a.annotations.into_iter().collect(),
        cdi_devices: a.cdi_devices.into_iter().map(|name| api::CdiDevice { name }).collect(),
    }
}

type ListAndWatchStream =
    Pin<Box<dyn Stream<Item = Result<api::ListAndWatchResponse, Status>> + Send + 'static>>;

#[tonic::async_trait]
impl api::device_plugin_server::DevicePlugin for DevicePluginService {
    async fn get_device_plugin_options(
        &self,
        _request: Request<api::Empty>,
    ) -> Result<Response<api::DevicePluginOptions>, Status> {
        Ok(Response::new(self.options()))
    }

    type ListAndWatchStream = ListAndWatchStream;

    async fn list_and_watch(
        &self,
        _request: Request<api::Empty>,
    ) -> Result<Response<Self::ListAndWatchStream>, Status> {
        tracing::info!(resource = self.resource(), "kubelet opened ListAndWatch");
        // WatchStream yields the current list first, then every change (intermediate states
        // may be skipped, which is right: each message replaces the whole list).
        let stream = WatchStream::new(self.backend.devices())
            .map(|list| Ok(to_response(&list)))
            .take_until(self.shutdown.clone().cancelled_owned());
        Ok(Response::new(Box::pin(stream)))
    }

    async fn get_preferred_allocation(
        &self,
        request: Request<api::PreferredAllocationRequest>,
    ) -> Result<Response<api::PreferredAllocationResponse>, Status> {
        const OP: &str = "GetPreferredAllocation";
        let request = request.into_inner();
        let containers = request.container_requests.len();
        let span =
            tracing::info_span!("preferred_allocation", resource = self.resource(), containers);
        let answer = async {
            let list = self.backend.devices().borrow().clone();
            let mut container_responses = Vec::with_capacity(containers);
            for container in &request.container_requests {
                let checked = check_preferred(&list, container).map_err(|e| self.fail(OP, &e))?;
                let device_ids = self
                    .backend
                    .preferred_allocation(checked)
                    .await
                    .map_err(|e| self.fail(OP, &e))?;
                container_responses
                    .push(api::ContainerPreferredAllocationResponse { device_i_ds: device_ids });
            }
            Ok(Response::new(api::PreferredAllocationResponse { container_responses }))
        };
        tracing::Instrument::instrument(answer, span).await
    }

    async fn allocate(
        &self,
        request: Request<api::AllocateRequest>,
    ) -> Result<Response<api::AllocateResponse>, Status> {
        let request = request.into_inner();
        let containers = request.container_requests.len();
        let span = tracing::info_span!("allocate", resource = self.resource(), containers);
        tracing::Instrument::instrument(self.answer_allocate(request), span).await
    }

    async fn pre_start_container(
        &self,
        _request: Request<api::PreStartContainerRequest>,
    ) -> Result<Response<api::PreStartContainerResponse>, Status> {
        // Never requested (pre_start_required is false); answered for kubelets that call anyway.
        Ok(Response::new(api::PreStartContainerResponse {}))
    }
}

impl DevicePluginService {
    /// Allocate's answer (in the call's span).
    async fn answer_allocate(
        &self,
        request: api::AllocateRequest,
    ) -> Result<Response<api::AllocateResponse>, Status> {
        const OP: &str = "Allocate";
        if request.container_requests.is_empty() {
            return Err(self.fail(
                OP,
                &BackendError::InvalidRequest {
                    ids: vec![],
                    reason: "no container requests".into(),
                },
            ));
        }
        let list = self.backend.devices().borrow().clone();
        let mut containers = Vec::with_capacity(request.container_requests.len());
        for container in request.container_requests {
            if container.devices_ids.is_empty() {
                return Err(self.fail(
                    OP,
                    &BackendError::InvalidRequest {
                        ids: vec![],
                        reason: "a container request names no devices".into(),
                    },
                ));
            }
            check_ids(&list, &container.devices_ids).map_err(|e| self.fail(OP, &e))?;
            containers.push(container.devices_ids);
        }
        // One call for the whole request: the backend grants every container or none.
        let granted =
            self.backend.allocate(containers.clone()).await.map_err(|e| self.fail(OP, &e))?;
        for ids in &containers {
            tracing::info!(resource = self.resource(), devices = ?ids, "allocated");
        }
        let container_responses = granted.into_iter().map(to_container_response).collect();
        Ok(Response::new(api::AllocateResponse { container_responses }))
    }
}
