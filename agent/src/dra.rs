//! The DRA kubelet-plugin mode (`driver: dra`) on the agent's ledger: what the node's devices
//! are called in its ResourceSlices, how a claim's allocated devices are booked in the ledger,
//! what a prepared claim's containers get (the same setup a gpu-memory Allocate answers: the MPS
//! pipe directory, the pinned memory limit, the thread percentage), and where claims are read.
//! The protocol (registration, the DRAPlugin service, slices, CDI specs) is `baleen-dra`'s;
//! `crate::run::dra` starts it.
//!
//! Device names in the pool: `gpu-<index>` for a GPU (shared by memory when the gpu-memory view
//! is on and the GPU has units, else whole), `gpu-<index>-mig-<GI>-<CI>` for a MIG instance.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use baleen_device_plugin::ContainerAllocation;
use baleen_dra::cdi::{self, Edits};
use baleen_dra::claims::{ClaimAllocation, ClaimRef, Consumer};
use baleen_dra::service::{Booked, Bookings, ClaimSource};
use baleen_dra::slices::{DeviceKind, NodeDevice};
use k8s_openapi::api::resource::v1::ResourceClaim;

use crate::isolation::devices::DeviceLister;
use crate::isolation::mps::MpsConfig;
use crate::ledger::{
    AllocationRecord, ClaimBooking, ClaimDevice, ClaimHolder, DeviceLedger, Grant,
};
use crate::resources::{NodeResources, container_response};

/// Which kubelet API the agent serves the node through (one per node).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum DriverMode {
    /// The device-plugin API (the default): one plugin per resource view.
    #[default]
    DevicePlugin,
    /// A DRA kubelet plugin: ResourceSlices, NodePrepareResources.
    Dra(DraConfig),
}

/// The DRA mode's settings (the `dra` section of the file).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DraConfig {
    /// The driver's name (a DNS subdomain; also the DeviceClass's and the CDI vendor).
    pub driver_name: String,
    /// The kubelet's plugin-registration directory.
    pub registry_dir: PathBuf,
    /// The directory of the driver's service socket (`<plugins>/<driver>/dra.sock`).
    pub plugin_dir: PathBuf,
    /// Where CDI specs of prepared claims are written (the runtime reads them).
    pub cdi_dir: PathBuf,
}

impl DraConfig {
    /// The defaults for `driver_name`: the kubelet's directories and the runtime's CDI one.
    pub fn new(driver_name: &str) -> Self {
        Self {
            driver_name: driver_name.to_owned(),
            registry_dir: baleen_proto::pluginregistration::v1::DEFAULT_REGISTRY_DIR.into(),
            plugin_dir: PathBuf::from("/var/lib/kubelet/plugins").join(driver_name),
            cdi_dir: cdi::DEFAULT_DIR.into(),
        }
    }

    /// The service socket the kubelet dials.
    pub fn socket(&self) -> PathBuf {
        self.plugin_dir.join("dra.sock")
    }

    /// The registration socket the kubelet's plugin watcher finds.
    pub fn registration_socket(&self) -> PathBuf {
        baleen_dra::registration::socket_path(&self.registry_dir, &self.driver_name)
    }

    /// The CDI kind of prepared claims' own devices.
    pub fn cdi_kind(&self) -> String {
        format!("{}/claim", self.driver_name)
    }
}

/// What a device of the pool is in the ledger.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// A GPU shared by memory.
    Shared(String),
    /// A GPU given whole.
    Whole(String),
    /// A MIG instance.
    Mig(String),
}

/// The node's devices as its slices publish them, and what each name is in the ledger.
pub fn node_devices(ledger: &DeviceLedger) -> (Vec<NodeDevice>, BTreeMap<String, Target>) {
    let config = ledger.config();
    let driver_version = ledger.driver_version();
    let cliques = nvlink_cliques(ledger);
    let states: BTreeMap<String, crate::ledger::GpuState> =
        ledger.gpu_states().into_iter().map(|s| (s.uuid.clone(), s)).collect();
    let mut devices = Vec::new();
    let mut targets = BTreeMap::new();
    for gpu in ledger.gpus() {
        let uuid = gpu.uuid.to_string();
        let Some(state) = states.get(&uuid) else { continue };
        let base =
            |name: String, kind: DeviceKind, device_uuid: &str, memory_bytes: u64| NodeDevice {
                name,
                kind,
                uuid: device_uuid.to_owned(),
                index: gpu.index,
                product_name: gpu.name.clone(),
                memory_bytes,
                cuda_compute_capability: gpu.cuda_compute_capability.clone(),
                driver_version: driver_version.map(str::to_owned),
                pci_bus_id: Some(gpu.pci_bus_id.to_string()),
                numa_node: gpu.numa_node,
                nvlink_clique: cliques.get(&uuid).cloned(),
                healthy: state.healthy,
            };
        if gpu.mig.is_enabled() {
            if !config.mig {
                continue;
            }
            for m in gpu.mig.instances() {
                let name = format!(
                    "gpu-{}-mig-{}-{}",
                    gpu.index, m.gpu_instance_id, m.compute_instance_id
                );
                let kind =
                    DeviceKind::Mig { profile: m.profile.clone(), parent_uuid: uuid.clone() };
                let mig_uuid = m.uuid.to_string();
                devices.push(base(name.clone(), kind, &mig_uuid, m.memory_bytes));
                targets.insert(name, Target::Mig(mig_uuid));
            }
            continue;
        }
        let name = format!("gpu-{}", gpu.index);
        if config.gpu_memory && state.units > 0 {
            let kind = DeviceKind::Shared { unit_bytes: config.memory_unit_bytes };
            let mut d = base(name.clone(), kind, &uuid, gpu.memory_bytes);
            // A share nothing enforces is not offered (its MPS daemon does not answer).
            d.healthy = state.healthy && state.shares_enforced;
            devices.push(d);
            targets.insert(name, Target::Shared(uuid));
        } else if config.whole_gpus {
            devices.push(base(name.clone(), DeviceKind::Whole, &uuid, gpu.memory_bytes));
            targets.insert(name, Target::Whole(uuid));
        }
    }
    (devices, targets)
}

/// Each GPU's NVLink clique: the GPUs it reaches over NVLink, directly or through others,
/// named `nvlink-<index of the clique's first GPU>`; GPUs with no NVLink peer have none.
fn nvlink_cliques(ledger: &DeviceLedger) -> BTreeMap<String, String> {
    let gpus: Vec<&crate::inventory::Gpu> = ledger.gpus().collect();
    let index: BTreeMap<String, usize> =
        gpus.iter().enumerate().map(|(i, g)| (g.uuid.to_string(), i)).collect();
    let mut clique = BTreeMap::new();
    for start in 0..gpus.len() {
        let uuid = gpus[start].uuid.to_string();
        if clique.contains_key(&uuid) || gpus[start].nvlink_peers.is_empty() {
            continue;
        }
        let name = format!("nvlink-{}", gpus[start].index);
        let mut todo = vec![start];
        while let Some(i) = todo.pop() {
            if clique.insert(gpus[i].uuid.to_string(), name.clone()).is_some() {
                continue;
            }
            todo.extend(gpus[i].nvlink_peers.iter().filter_map(|p| index.get(&p.to_string())));
        }
    }
    clique
}

/// The agent's ledger as the DRA service books claims in it.
pub struct LedgerBookings {
    resources: Arc<NodeResources>,
    targets: BTreeMap<String, Target>,
    mps: MpsConfig,
    lister: DeviceLister,
}

impl LedgerBookings {
    /// Bookings in `resources` of the devices `targets` names; containers reach their GPUs
    /// as `lister` says (the toolkit's CDI names by default) and their MPS daemon as `mps` says.
    pub fn new(
        resources: Arc<NodeResources>,
        targets: BTreeMap<String, Target>,
        mps: MpsConfig,
        lister: DeviceLister,
    ) -> Self {
        Self { resources, targets, mps, lister }
    }

    /// What a booked device gives a container: the device-plugin answer for the same grant,
    /// as CDI edits of the claim's own device and the other specs' CDI names.
    fn booked(&self, held: &[(AllocationRecord, Grant)]) -> Vec<Booked> {
        held.iter()
            .filter_map(|(record, grant)| Some(self.booked_one(record.claim.clone()?, grant)))
            .collect()
    }

    fn booked_one(&self, holder: ClaimHolder, grant: &Grant) -> Booked {
        let devices = self.lister.answer(&grant.visible);
        let answer = container_response(grant, devices, &self.mps, holder.priority);
        let (edits, other_cdi_ids) = edits_of(answer);
        Booked {
            request: holder.request,
            device: holder.device,
            share_id: holder.share_id,
            edits,
            other_cdi_ids,
        }
    }
}

/// A device-plugin answer as CDI edits and CDI names.
fn edits_of(answer: ContainerAllocation) -> (Edits, Vec<String>) {
    let edits = Edits {
        env: answer.envs.into_iter().map(|(k, v)| format!("{k}={v}")).collect(),
        device_nodes: answer
            .devices
            .into_iter()
            .map(|d| cdi::DeviceNode { path: d.container_path })
            .collect(),
        mounts: answer
            .mounts
            .into_iter()
            .map(|m| cdi::Mount {
                host_path: m.host_path,
                container_path: m.container_path,
                options: ["rbind", if m.read_only { "ro" } else { "rw" }, "nosuid", "nodev"]
                    .map(String::from)
                    .to_vec(),
            })
            .collect(),
    };
    (edits, answer.cdi_devices)
}

impl Bookings for LedgerBookings {
    fn booked(&self, uid: &str) -> Option<Vec<Booked>> {
        let held = self.resources.claim_grants(uid);
        (!held.is_empty()).then(|| self.booked(&held))
    }

    fn book(
        &self,
        allocation: &ClaimAllocation,
        consumers: &[Consumer],
    ) -> Result<Vec<Booked>, String> {
        let first = consumers.iter().find(|c| c.resource == "pods");
        let pod = first.map(|c| c.name.clone());
        // The MPS client priority of the pod's class, where co-location runs (a share only).
        let identifier = self.resources.pod_identifier().filter(|_| self.mps.enabled);
        let shared = allocation.devices.iter().any(|d| d.memory_bytes.is_some());
        let priority = match (identifier, first) {
            (Some(id), Some(c)) if shared => {
                // Called on the blocking pool (the booking syncs to disk): wait there.
                let identity = tokio::runtime::Handle::current().block_on(id.class_of(&c.uid));
                Some(crate::isolation::pod_identity::mps_priority(identity.class()))
            }
            _ => None,
        };
        let mut bookings = Vec::new();
        for d in &allocation.devices {
            let device = match (self.targets.get(&d.device), d.memory_bytes) {
                (None, _) => {
                    return Err(format!(
                        "device {} is not one this node publishes (the node's devices changed \
                         since the claim was allocated)",
                        d.device
                    ));
                }
                (Some(Target::Shared(uuid)), Some(bytes)) => {
                    ClaimDevice::Share { gpu_uuid: uuid.clone(), bytes }
                }
                // A shared GPU allocated with no capacity consumed: what the published default
                // says, the GPU's every unit.
                (Some(Target::Shared(uuid)), None) => {
                    let state = self.resources.published().state.clone();
                    let units = state
                        .gpu_states()
                        .into_iter()
                        .find(|s| &s.uuid == uuid)
                        .map_or(0, |s| u64::from(s.units));
                    let bytes = units * state.config().memory_unit_bytes;
                    ClaimDevice::Share { gpu_uuid: uuid.clone(), bytes }
                }
                (Some(Target::Whole(uuid)), None) => ClaimDevice::Whole { gpu_uuid: uuid.clone() },
                (Some(Target::Mig(uuid)), None) => ClaimDevice::Mig { uuid: uuid.clone() },
                (Some(_), Some(_)) => {
                    return Err(format!(
                        "device {} is not shared, but the allocation consumes capacity of it",
                        d.device
                    ));
                }
            };
            bookings.push(ClaimBooking {
                holder: ClaimHolder {
                    namespace: allocation.claim.namespace.clone(),
                    name: allocation.claim.name.clone(),
                    uid: allocation.claim.uid.clone(),
                    request: d.request.clone(),
                    device: d.device.clone(),
                    share_id: d.share_id.clone(),
                    pod: pod.clone(),
                    priority,
                },
                device,
            });
        }
        let held = self.resources.book_claim(&bookings).map_err(|e| e.to_string())?;
        Ok(self.booked(&held))
    }

    fn release(&self, uid: &str) -> Result<bool, String> {
        self.resources.release_claim(uid).map_err(|e| e.to_string())
    }
}

/// Claims read from the API server.
#[derive(Clone)]
pub struct ApiClaims {
    client: kube::Client,
}

impl ApiClaims {
    /// Claims read with `client`.
    pub fn new(client: kube::Client) -> Self {
        Self { client }
    }
}

impl ClaimSource for ApiClaims {
    async fn get(&self, claim: &ClaimRef) -> Result<Option<ResourceClaim>, String> {
        let api: kube::Api<ResourceClaim> =
            kube::Api::namespaced(self.client.clone(), &claim.namespace);
        api.get_opt(&claim.name).await.map_err(|e| crate::error_chain::Chain(&e).to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inventory::GpuInventory as _;
    use crate::inventory::simulated::SimulatedInventory;
    use crate::ledger::ViewConfig;

    fn ledger(example: &str, views: ViewConfig) -> DeviceLedger {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../packaging/examples")
            .join(example);
        let inventory =
            SimulatedInventory::from_file(&path).expect("example").discover().expect("discover");
        DeviceLedger::new("node-a", &inventory, views).expect("ledger")
    }

    #[test]
    fn gpus_are_shared_devices_with_the_nodes_attributes() {
        let (devices, targets) =
            node_devices(&ledger("h200-8x-nvswitch.yaml", ViewConfig::default()));
        assert_eq!(devices.len(), 8);
        assert!(devices.iter().all(|d| matches!(d.kind, DeviceKind::Shared { .. })));
        assert!(matches!(targets.get("gpu-3"), Some(Target::Shared(_))));
        // Behind one NVSwitch: every GPU in one clique, named by its first GPU.
        assert!(
            devices.iter().all(|d| d.nvlink_clique.as_deref() == Some("nvlink-0")),
            "{devices:?}"
        );
        assert!(devices.iter().all(|d| d.driver_version.as_deref() == Some("570.124.06")));
        assert!(devices.iter().all(|d| d.cuda_compute_capability.as_deref() == Some("9.0")));
        // The slices build from them, and say the version as a semantic version.
        let owner = baleen_dra::slices::Owner { node_name: "node-a".into(), node_uid: "u".into() };
        let slices =
            baleen_dra::slices::build("gpu.example.com", &owner, 1, &devices).expect("built");
        let d = &slices[0].spec.devices.as_ref().expect("devices")[0];
        let attributes = d.attributes.as_ref().expect("attributes");
        assert_eq!(attributes["driverVersion"].version.as_deref(), Some("570.124.6"));
        assert_eq!(attributes["nvlinkClique"].string.as_deref(), Some("nvlink-0"));
        assert_eq!(attributes["cudaComputeCapability"].version.as_deref(), Some("9.0.0"));
    }

    #[test]
    fn without_gpu_memory_gpus_are_whole_and_bridged_pairs_are_cliques_of_their_own() {
        let views = ViewConfig { gpu_memory: false, ..ViewConfig::default() };
        let (devices, targets) = node_devices(&ledger("l4-4x-pcie.yaml", views));
        assert!(devices.iter().all(|d| d.kind == DeviceKind::Whole));
        assert!(matches!(targets.get("gpu-0"), Some(Target::Whole(_))));
        // The example bridges (0, 1) and (2, 3).
        let cliques: Vec<Option<&str>> =
            devices.iter().map(|d| d.nvlink_clique.as_deref()).collect();
        assert_eq!(
            cliques,
            [Some("nvlink-0"), Some("nvlink-0"), Some("nvlink-2"), Some("nvlink-2")]
        );
        // No NVLink peer, no clique.
        let (one, _) = node_devices(&ledger("h200-1x-gpu-day.yaml", ViewConfig::default()));
        assert!(one.iter().all(|d| d.nvlink_clique.is_none()), "{one:?}");
    }

    #[test]
    fn mig_instances_are_their_own_devices_named_by_their_instance_ids() {
        let (devices, targets) = node_devices(&ledger("a100-4x-mig.yaml", ViewConfig::default()));
        let mig: Vec<&NodeDevice> =
            devices.iter().filter(|d| matches!(d.kind, DeviceKind::Mig { .. })).collect();
        assert!(!mig.is_empty());
        for d in &mig {
            assert!(d.name.starts_with(&format!("gpu-{}-mig-", d.index)), "{}", d.name);
            assert!(baleen_dra::slices::is_dns_label(&d.name), "{}", d.name);
            assert!(matches!(targets.get(&d.name), Some(Target::Mig(u)) if *u == d.uuid));
        }
    }

    #[test]
    fn a_prepared_claims_gpu_names_its_pod_in_the_node_state() {
        let mut l = ledger("h200-8x-nvswitch.yaml", ViewConfig::default());
        let gpu_uuid = l.gpus().nth(2).expect("gpu").uuid.to_string();
        let holder = |pod: Option<&str>, uid: &str| crate::ledger::ClaimHolder {
            namespace: "ns".into(),
            name: uid.into(),
            uid: uid.into(),
            request: "gpu".into(),
            device: "gpu-2".into(),
            share_id: Some(format!("{uid}-share")),
            pod: pod.map(str::to_owned),
            priority: None,
        };
        let bytes = 3 * l.config().memory_unit_bytes;
        let booking = |pod, uid| ClaimBooking {
            holder: holder(pod, uid),
            device: ClaimDevice::Share { gpu_uuid: gpu_uuid.clone(), bytes },
        };
        l.book_claim(&[booking(Some("trainer"), "a")], 0).expect("booked");
        l.book_claim(&[booking(None, "b")], 0).expect("booked");
        // No pod-resources list names either: the claim's pod names the first, the second
        // (prepared for no known pod) stays an unnamed grant.
        let doc = l.node_state("node-a", 1, |_| None);
        assert_eq!(doc.gpus[2].pods, ["ns/trainer"]);
        assert_eq!(doc.unnamed.len(), 1, "{:?}", doc.unnamed);
    }
}
