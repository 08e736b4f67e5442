//! The YAML configuration file's top level (what the node offers): every field optional, each
//! section's type in its own module of `sections` (re-exported here), every unknown key reported
//! with its line. Read by [`super::resolve`]; documented in docs/agent.md.

use serde::Deserialize;

pub use super::sections::annotation::AnnotationFile;
pub use super::sections::colocation::ColocationFile;
pub use super::sections::devices::CdiFile;
pub use super::sections::dra::DraFile;
pub use super::sections::health::HealthFile;
pub use super::sections::inventory::InventoryFile;
pub use super::sections::log::LogFile;
pub use super::sections::metrics::MetricsFile;
pub use super::sections::mps::MpsFile;
pub use super::sections::paths::PathsFile;
pub use super::sections::reconcile::ReconcileFile;
pub use super::sections::resources::ResourcesFile;
pub use super::sections::watchdog::WatchdogFile;

/// The version of the file's format this agent reads (`version: 1`, optional).
pub const FILE_VERSION: u32 = 1;

/// The YAML configuration file. Every field is optional; see `docs/agent.md`.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct FileConfig {
    /// The format's version: [`FILE_VERSION`] (optional; another is refused).
    pub version: Option<u32>,
    /// Kubernetes node name.
    pub node_name: Option<String>,
    /// Resource domain.
    pub domain: Option<String>,
    /// Size of one gpu-memory unit, e.g. `1GiB`, `512MiB`.
    pub memory_unit: Option<String>,
    /// Which kubelet API the node is served through: `device-plugin` (default) or `dra`.
    pub driver: Option<String>,
    /// `dra:`: the DRA mode's driver name and directories.
    #[serde(default)]
    pub dra: DraFile,
    /// Which views to offer.
    #[serde(default)]
    pub resources: ResourcesFile,
    /// How Allocate answers hand out GPUs: `cdi` (default), `volume-mounts`, `envvar`.
    pub device_list_strategy: Option<String>,
    /// Container Device Interface names in Allocate answers.
    #[serde(default)]
    pub cdi: CdiFile,
    /// Where GPUs come from.
    #[serde(default)]
    pub inventory: InventoryFile,
    /// Host paths.
    #[serde(default)]
    pub paths: PathsFile,
    /// Reconciliation with pod-resources.
    #[serde(default)]
    pub reconcile: ReconcileFile,
    /// MPS daemons and the limits of gpu-memory grants.
    #[serde(default)]
    pub mps: MpsFile,
    /// The per-container GPU memory watchdog.
    #[serde(default)]
    pub watchdog: WatchdogFile,
    /// How GPUs marked unhealthy are probed back.
    #[serde(default)]
    pub health: HealthFile,
    /// The Prometheus endpoint.
    #[serde(default)]
    pub metrics: MetricsFile,
    /// Logging.
    #[serde(default)]
    pub log: LogFile,
    /// `annotation:`: the node-state annotation for the scheduler extender.
    #[serde(default)]
    pub annotation: AnnotationFile,
    /// `colocation:`: inference and training classes (cgroups, MPS client priority).
    #[serde(default)]
    pub colocation: ColocationFile,
}
