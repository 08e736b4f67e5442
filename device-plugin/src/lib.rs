//! The kubelet device-plugin server of baleen.
//!
//! One [`DeviceBackend`] per extended resource holds the domain (the agent's resource views);
//! this crate does the protocol around it:
//!
//! - [`plugin`]: one runner per resource binds its own socket in the device-plugin directory,
//!   registers with the kubelet (retrying with backoff while it is absent), notices a kubelet
//!   restart (`kubelet.sock` created again, or its own socket wiped) and serves and registers
//!   again, and removes its socket on shutdown;
//! - [`service`]: the gRPC `DevicePlugin` service: ListAndWatch follows the backend's device
//!   `watch` channel, GetPreferredAllocation and Allocate check the request and call the backend;
//! - [`status`]: the one place where backend errors become gRPC status codes;
//! - [`resource_name`]: the kubelet's rule for extended resource names;
//! - [`uds`]: gRPC over Unix sockets (client channels and listeners);
//! - [`limits`]: what one client can hold of a plugin's server (connections, streams, windows).
//!
//! The generated protocol types appear only in [`service`], [`registration`] and [`uds`]'s
//! callers; backends speak [`Device`], [`PreferredAllocationRequest`] and [`ContainerAllocation`].

pub mod backend;
pub mod device;
pub mod limits;
pub mod plugin;
pub mod registration;
pub mod resource_name;
pub mod service;
pub mod status;
pub mod uds;

pub use backend::{
    BackendError, ContainerAllocation, DeviceBackend, DeviceSpec, Mount, PreferredAllocationRequest,
};
pub use device::{Device, DeviceList, Health};
pub use plugin::{Plugin, PluginConfig, PluginError, PluginState};
