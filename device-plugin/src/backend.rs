//! The small trait between the protocol and the domain: a backend owns one extended resource's
//! devices (published as a `watch` channel), chooses preferred allocations and grants
//! allocations. The agent's resource views implement it; tests use simple in-memory backends.

use std::collections::BTreeMap;

use tokio::sync::watch;

use crate::device::DeviceSnapshot;

/// The most of one device ID a message shows.
pub const MAX_SHOWN_ID: usize = 96;
/// The most device IDs a message lists.
pub const MAX_SHOWN_IDS: usize = 8;
/// The most of a reason a message shows.
pub const MAX_REASON: usize = 1024;

/// `text`, cut to at most `max` bytes (on a character boundary) and saying how long it was.
pub fn cut(text: &str, max: usize) -> std::borrow::Cow<'_, str> {
    if text.len() <= max {
        return text.into();
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}... ({} bytes)", &text[..end], text.len()).into()
}

/// Device IDs as a message shows them: at most [`MAX_SHOWN_IDS`] of them, each cut to
/// [`MAX_SHOWN_ID`] bytes (a request is the kubelet's to make: a 3 MiB ID must not become a
/// 3 MiB log line or gRPC status).
pub fn shown(ids: &[String]) -> String {
    let mut out: Vec<String> =
        ids.iter().take(MAX_SHOWN_IDS).map(|id| format!("{:?}", cut(id, MAX_SHOWN_ID))).collect();
    if ids.len() > MAX_SHOWN_IDS {
        out.push(format!("and {} more", ids.len() - MAX_SHOWN_IDS));
    }
    format!("[{}]", out.join(", "))
}

/// One container's GetPreferredAllocation question, already checked by the service: every
/// `must_include` ID is in `available`, and `size` is between `must_include.len()` and
/// `available.len()`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PreferredAllocationRequest {
    /// Healthy device IDs the kubelet could give.
    pub available: Vec<String>,
    /// IDs that must be in the answer.
    pub must_include: Vec<String>,
    /// How many IDs to choose.
    pub size: usize,
}

/// A mount for the container.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mount {
    /// Path in the container.
    pub container_path: String,
    /// Path on the host.
    pub host_path: String,
    /// Mounted read-only.
    pub read_only: bool,
}

/// A device node for the container.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceSpec {
    /// Path in the container.
    pub container_path: String,
    /// Path on the host.
    pub host_path: String,
    /// Cgroup permissions, any of `r`, `w`, `m`.
    pub permissions: String,
}

/// What the runtime must do to give one container its devices.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ContainerAllocation {
    /// Environment variables.
    pub envs: BTreeMap<String, String>,
    /// Mounts.
    pub mounts: Vec<Mount>,
    /// Device nodes.
    pub devices: Vec<DeviceSpec>,
    /// Container annotations.
    pub annotations: BTreeMap<String, String>,
    /// Fully qualified CDI device names.
    pub cdi_devices: Vec<String>,
}

/// Why a backend refused; the service turns it into a gRPC status (see [`crate::status`]) with a
/// message naming the resource and the device IDs.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BackendError {
    /// The IDs are not devices of this resource.
    #[error("unknown device IDs {}", shown(ids))]
    UnknownDevices {
        /// The offending IDs.
        ids: Vec<String>,
    },
    /// The request is malformed (wrong count, IDs that cannot go together, ...).
    #[error("invalid request for devices {}: {}", shown(ids), cut(reason, MAX_REASON))]
    InvalidRequest {
        /// The IDs concerned.
        ids: Vec<String>,
        /// What is wrong.
        reason: String,
    },
    /// The devices exist but conflict with the node's state (taken through another view,
    /// unhealthy).
    #[error("devices {} cannot be allocated: {}", shown(ids), cut(reason, MAX_REASON))]
    Conflict {
        /// The IDs concerned.
        ids: Vec<String>,
        /// What they conflict with.
        reason: String,
    },
    /// Not enough capacity to answer.
    #[error("not enough devices: {reason}")]
    Exhausted {
        /// What ran out.
        reason: String,
    },
    /// A transient failure (NVML, MPS); the kubelet may retry.
    #[error("temporarily unavailable: {reason}")]
    Unavailable {
        /// What failed.
        reason: String,
    },
    /// A bug or an unexpected failure (e.g. the checkpoint cannot be written).
    #[error("internal error: {reason}")]
    Internal {
        /// What failed.
        reason: String,
    },
}

/// The domain side of one extended resource.
#[async_trait::async_trait]
pub trait DeviceBackend: Send + Sync + 'static {
    /// The extended resource name, e.g. `awesome-ai-company.com/gpu-memory`.
    fn resource_name(&self) -> &str;

    /// The device list, kept current by the backend. Every ListAndWatch stream follows it.
    fn devices(&self) -> watch::Receiver<DeviceSnapshot>;

    /// Whether the kubelet should ask [`Self::preferred_allocation`] before Allocate.
    fn has_preferred_allocation(&self) -> bool {
        true
    }

    /// Chooses `request.size` IDs from `request.available`, including `request.must_include`.
    async fn preferred_allocation(
        &self,
        request: PreferredAllocationRequest,
    ) -> Result<Vec<String>, BackendError>;

    /// Grants every container of one Allocate request its devices (each container's IDs
    /// already checked to be advertised and distinct), answers in the same order, or refuses the
    /// whole request with nothing granted: a request that fails at its second container keeps no
    /// grant of its first. A repeated Allocate of IDs already granted in this resource must
    /// succeed (the kubelet reuses an init container's devices).
    async fn allocate(
        &self,
        containers: Vec<Vec<String>>,
    ) -> Result<Vec<ContainerAllocation>, BackendError>;
}
