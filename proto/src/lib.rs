//! The kubelet gRPC APIs baleen speaks, generated at build time from the project's own `.proto`
//! files in `proto/proto/` (compiled by protox, so no system `protoc` is needed).
//!
//! - [`deviceplugin::v1beta1`]: the device-plugin API (`Registration` served by the kubelet,
//!   `DevicePlugin` served by each plugin).
//! - [`podresources::v1`]: the pod-resources API (`PodResourcesLister`, served by the kubelet).
//! - [`pluginregistration::v1`]: the plugin-registration API (a DRA driver's registration socket).
//! - [`dra::v1`] and [`dra::v1beta1`]: the DRA plugin API (`DRAPlugin`, served by a DRA driver).
//!
//! The device-plugin crate is the only user of the generated server traits; the agent uses the
//! pod-resources client. [`FILE_DESCRIPTOR_SET`] holds the compiled descriptors, which this crate's
//! tests compare field by field with the upstream definitions.

/// The kubelet device-plugin API, package `v1beta1`.
pub mod deviceplugin {
    /// Generated messages, the `Registration` and `DevicePlugin` clients and servers.
    #[allow(missing_docs, unreachable_pub, clippy::all, clippy::pedantic)]
    pub mod v1beta1 {
        tonic::include_proto!("v1beta1");

        /// The only API version the kubelet accepts in `RegisterRequest.version`.
        pub const VERSION: &str = "v1beta1";
        /// `Device.health` of a device that can be allocated.
        pub const HEALTHY: &str = "Healthy";
        /// `Device.health` of a device that must not be allocated.
        pub const UNHEALTHY: &str = "Unhealthy";
        /// The kubelet's socket, relative to the device-plugin directory.
        pub const KUBELET_SOCKET: &str = "kubelet.sock";
        /// The kubelet's default device-plugin directory.
        pub const DEFAULT_DEVICE_PLUGIN_DIR: &str = "/var/lib/kubelet/device-plugins";
    }
}

/// The kubelet pod-resources API, package `v1`.
pub mod podresources {
    /// Generated messages and the `PodResourcesLister` client and server.
    #[allow(missing_docs, unreachable_pub, clippy::all, clippy::pedantic)]
    pub mod v1 {
        tonic::include_proto!("v1");

        /// The kubelet's default pod-resources socket.
        pub const DEFAULT_SOCKET: &str = "/var/lib/kubelet/pod-resources/kubelet.sock";
    }
}

/// The kubelet plugin-registration API, package `pluginregistration` (its v1), which a DRA
/// driver serves on its registration socket. Only the messages are used: the server is
/// `baleen-dra`'s own HTTP/2 responder, since the kubelet's `:authority` is one no tonic server
/// accepts.
pub mod pluginregistration {
    /// Generated messages (and tonic's `Registration` client, for tests).
    #[allow(missing_docs, unreachable_pub, clippy::all, clippy::pedantic)]
    pub mod v1 {
        tonic::include_proto!("pluginregistration");

        /// `PluginInfo.type` of a DRA driver.
        pub const DRA_PLUGIN: &str = "DRAPlugin";
        /// The kubelet's default plugin-registration directory.
        pub const DEFAULT_REGISTRY_DIR: &str = "/var/lib/kubelet/plugins_registry";
        /// `GetInfo`'s gRPC path.
        pub const GET_INFO_PATH: &str = "/pluginregistration.Registration/GetInfo";
        /// `NotifyRegistrationStatus`'s gRPC path.
        pub const NOTIFY_PATH: &str = "/pluginregistration.Registration/NotifyRegistrationStatus";
    }
}

/// The kubelet's DRA plugin API (`k8s.io/kubelet/pkg/apis/dra`), served by the agent in DRA mode
/// on its service socket (tonic: kubelets dial it with authority `localhost`).
pub mod dra {
    /// Version v1 (kubelets 1.34 and later), package `k8s.io.kubelet.pkg.apis.dra.v1`.
    #[allow(missing_docs, unreachable_pub, clippy::all, clippy::pedantic)]
    pub mod v1 {
        tonic::include_proto!("k8s.io.kubelet.pkg.apis.dra.v1");

        /// The name of this service version in `PluginInfo.supported_versions`.
        pub const SERVICE_VERSION: &str = "v1.DRAPlugin";
    }
    /// The resource-health stream (`v1.DRAResourceHealth`, kubelets with KEP-4680's
    /// `ResourceHealthStatus`), package `v1`: generated beside pod-resources (the same package),
    /// re-exported here.
    pub mod health {
        pub use crate::podresources::v1::dra_resource_health_client;
        pub use crate::podresources::v1::dra_resource_health_server;
        pub use crate::podresources::v1::{
            DeviceHealth, DeviceIdentifier, HealthStatus, NodeWatchResourcesRequest,
            NodeWatchResourcesResponse,
        };
    }
    /// Version v1beta1 (kubelets 1.32 and later), package `k8s.io.kubelet.pkg.apis.dra.v1beta1`.
    #[allow(missing_docs, unreachable_pub, clippy::all, clippy::pedantic)]
    pub mod v1beta1 {
        tonic::include_proto!("k8s.io.kubelet.pkg.apis.dra.v1beta1");

        /// The name of this service version in `PluginInfo.supported_versions`.
        pub const SERVICE_VERSION: &str = "v1beta1.DRAPlugin";
    }
}

/// The encoded `FileDescriptorSet` of the project's `.proto` files, as compiled.
pub const FILE_DESCRIPTOR_SET: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/baleen_descriptors.bin"));
