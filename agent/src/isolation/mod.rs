//! Isolation of the containers that share a GPU: how a container is given exactly the GPUs of its
//! grant in a form the runtime enforces ([`devices`]); what a container needs so that its share
//! is enforced: the MPS daemons and the client setup of a gpu-memory grant ([`mps`]), and the
//! per-container memory [`watchdog`] for what MPS does not enforce. Called by the device-plugin
//! adapter (`crate::resources`) when it answers Allocate.
//!
//! Co-location of inference and training: the classes and their CPU policy ([`colocation`]) on
//! the pods' cgroups ([`cgroups`]), and the MPS client priority of the pod an Allocate is for
//! ([`pod_identity`]), over the node's pods as the Kubernetes API shows them ([`node_pods`]).

pub mod cgroups;
pub mod colocation;
pub mod devices;
pub mod mps;
pub mod node_pods;
pub mod pod_identity;
pub mod watchdog;

use std::path::PathBuf;

/// A host directory or file bound into a container.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BindMount {
    /// Path on the host.
    pub host: PathBuf,
    /// Path in the container.
    pub container: PathBuf,
    /// Mounted read-only.
    pub read_only: bool,
}

/// What a container must be given for its share to be enforced.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ContainerSetup {
    /// Environment variables, in the order they were set.
    pub envs: Vec<(String, String)>,
    /// Mounts.
    pub mounts: Vec<BindMount>,
}
