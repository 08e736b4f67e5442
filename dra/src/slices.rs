//! The node's devices as `resource.k8s.io/v1` ResourceSlices: one pool named after the node,
//! owned by the Node (deleted with it), at most [`MAX_DEVICES_PER_SLICE`] devices a slice.
//!
//! - A GPU shared by memory is one device with `allowMultipleAllocations: true` and a
//!   consumable `memory` capacity: its value is the GPU's memory in whole units of the agent's
//!   `memoryUnit` (what its ledger can hand out), and its `requestPolicy` is
//!   `validRange{min: unit, step: unit, max: value}` with the whole value as default, so the
//!   scheduler rounds a request up to whole units (as `gpu-memory` does) and a claim that asks
//!   no capacity takes the GPU whole.
//! - A GPU given only whole, and each static MIG instance, is a device without multiple
//!   allocations; its `memory` capacity is informational.
//! - Attributes an operator selects on with CEL: `uuid`, `productName`, `index`, `type` (`gpu`
//!   or `mig`), `cudaComputeCapability` and `driverVersion` (versions), `numaNode`,
//!   `nvlinkClique`, and `resource.kubernetes.io/pciBusID`; MIG instances add `profile` and
//!   `parentUUID`.
//! - An unhealthy device (XID, MPS daemon down, unreadable) is **withdrawn**: left out of the
//!   slices until it is healthy again, so the scheduler allocates nothing more on it, on every
//!   Kubernetes version. Device taints (KEP-5055) would say why, but API servers whose
//!   `DRADeviceTaints` gate is off (every 1.34 and 1.35 by default) drop the field silently,
//!   which would leave the device allocatable; the claims already prepared on it are kept.

use std::collections::BTreeMap;

use k8s_openapi::api::resource::v1::{
    CapacityRequestPolicy, CapacityRequestPolicyRange, Device, DeviceAttribute, DeviceCapacity,
    ResourcePool, ResourceSlice, ResourceSliceSpec,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};

/// The most devices the API server takes in one ResourceSlice.
pub const MAX_DEVICES_PER_SLICE: usize = 128;
/// The most attributes and capacities one device may have together.
pub const MAX_ATTRIBUTES_AND_CAPACITIES: usize = 32;
/// The standard attribute of a device's PCI address.
pub const PCI_BUS_ID_ATTRIBUTE: &str = "resource.kubernetes.io/pciBusID";

/// What a device is, as the slice publishes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeviceKind {
    /// A GPU shared by memory, in units of `unit_bytes`.
    Shared {
        /// Bytes per unit (the agent's `memoryUnit`).
        unit_bytes: u64,
    },
    /// A GPU given only whole.
    Whole,
    /// A static MIG instance of a GPU.
    Mig {
        /// Its profile (`1g.18gb`).
        profile: String,
        /// Its GPU's UUID.
        parent_uuid: String,
    },
}

/// One device of the node, described for its slice.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeDevice {
    /// Its name in the pool (a DNS label: `gpu-0`, `gpu-0-mig-1`).
    pub name: String,
    /// What it is.
    pub kind: DeviceKind,
    /// Its UUID (`GPU-...`, `MIG-...`).
    pub uuid: String,
    /// Its GPU's index on the node.
    pub index: u32,
    /// The product name (`NVIDIA H200`).
    pub product_name: String,
    /// Its memory in bytes.
    pub memory_bytes: u64,
    /// CUDA compute capability, `major.minor`.
    pub cuda_compute_capability: Option<String>,
    /// The NVIDIA driver's version.
    pub driver_version: Option<String>,
    /// The GPU's PCI bus ID (`0000:3b:00.0`).
    pub pci_bus_id: Option<String>,
    /// Its NUMA node.
    pub numa_node: Option<u32>,
    /// Its NVLink clique (GPUs of one clique reach each other over NVLink).
    pub nvlink_clique: Option<String>,
    /// Whether it can be allocated now (an unhealthy one is withdrawn).
    pub healthy: bool,
}

/// The Node that owns the slices.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Owner {
    /// The node's name (also the pool's).
    pub node_name: String,
    /// The Node object's UID.
    pub node_uid: String,
}

/// Why the devices cannot be published.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SliceError {
    /// A device name the API server would refuse.
    #[error("device name {name:?} is not a DNS label (lowercase letters, digits, '-', at most 63)")]
    BadName {
        /// The name.
        name: String,
    },
    /// Two devices of one name.
    #[error("device name {name:?} appears twice")]
    Duplicate {
        /// The name.
        name: String,
    },
    /// A shared device whose memory is less than one unit, or a unit of zero bytes.
    #[error("device {name}: {memory_bytes} bytes cannot be shared in units of {unit_bytes} bytes")]
    NoUnits {
        /// The device.
        name: String,
        /// Its memory.
        memory_bytes: u64,
        /// The unit.
        unit_bytes: u64,
    },
}

/// Whether `s` is a DNS label as Kubernetes validates one.
pub fn is_dns_label(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= 63
        && b.iter().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
        && b[0] != b'-'
        && b[b.len() - 1] != b'-'
}

/// Bytes as a quantity in the API server's canonical form (`80Gi`, `512Mi`, `12345`).
pub fn bytes_quantity(bytes: u64) -> Quantity {
    const SUFFIXES: [(&str, u32); 6] =
        [("Ei", 60), ("Pi", 50), ("Ti", 40), ("Gi", 30), ("Mi", 20), ("Ki", 10)];
    if bytes != 0 {
        for (suffix, shift) in SUFFIXES {
            if bytes.trailing_zeros() >= shift {
                return Quantity(format!("{}{suffix}", bytes >> shift));
            }
        }
    }
    Quantity(bytes.to_string())
}

/// A version as a semantic version (`9.0` -> `9.0.0`, `535.104.05` -> `535.104.5`), or `None`
/// when it is not one to three numbers.
pub fn semantic_version(text: &str) -> Option<String> {
    let parts: Vec<u64> = text.trim().split('.').map(|p| p.parse().ok()).collect::<Option<_>>()?;
    if parts.is_empty() || parts.len() > 3 {
        return None;
    }
    let part = |i: usize| parts.get(i).copied().unwrap_or(0);
    Some(format!("{}.{}.{}", part(0), part(1), part(2)))
}

fn string(s: &str) -> DeviceAttribute {
    DeviceAttribute { string: Some(s.to_owned()), ..Default::default() }
}

fn int(i: u32) -> DeviceAttribute {
    DeviceAttribute { int: Some(i64::from(i)), ..Default::default() }
}

/// A version attribute, or a string one for a version that is not semantic.
fn version(text: &str) -> DeviceAttribute {
    match semantic_version(text) {
        Some(v) => DeviceAttribute { version: Some(v), ..Default::default() },
        None => string(text),
    }
}

/// The slice device of `d`.
fn device(d: &NodeDevice) -> Result<Device, SliceError> {
    let mut attributes = BTreeMap::new();
    attributes.insert("uuid".to_owned(), string(&d.uuid));
    attributes.insert("index".to_owned(), int(d.index));
    attributes.insert("productName".to_owned(), string(&d.product_name));
    let kind = if matches!(d.kind, DeviceKind::Mig { .. }) { "mig" } else { "gpu" };
    attributes.insert("type".to_owned(), string(kind));
    if let Some(cc) = &d.cuda_compute_capability {
        attributes.insert("cudaComputeCapability".to_owned(), version(cc));
    }
    if let Some(v) = &d.driver_version {
        attributes.insert("driverVersion".to_owned(), version(v));
    }
    if let Some(pci) = &d.pci_bus_id {
        attributes.insert(PCI_BUS_ID_ATTRIBUTE.to_owned(), string(pci));
    }
    if let Some(numa) = d.numa_node {
        attributes.insert("numaNode".to_owned(), int(numa));
    }
    if let Some(clique) = &d.nvlink_clique {
        attributes.insert("nvlinkClique".to_owned(), string(clique));
    }
    let mut memory = DeviceCapacity { value: bytes_quantity(d.memory_bytes), request_policy: None };
    let mut multiple = None;
    match &d.kind {
        DeviceKind::Shared { unit_bytes } => {
            let units = d.memory_bytes.checked_div(*unit_bytes).unwrap_or(0);
            if units == 0 {
                return Err(SliceError::NoUnits {
                    name: d.name.clone(),
                    memory_bytes: d.memory_bytes,
                    unit_bytes: *unit_bytes,
                });
            }
            // Whole units only: what the ledger can hand out.
            let value = bytes_quantity(units * unit_bytes);
            memory = DeviceCapacity {
                value: value.clone(),
                request_policy: Some(CapacityRequestPolicy {
                    default: Some(value.clone()),
                    valid_range: Some(CapacityRequestPolicyRange {
                        min: bytes_quantity(*unit_bytes),
                        step: Some(bytes_quantity(*unit_bytes)),
                        max: Some(value),
                    }),
                    valid_values: None,
                }),
            };
            multiple = Some(true);
        }
        DeviceKind::Whole => {}
        DeviceKind::Mig { profile, parent_uuid } => {
            attributes.insert("profile".to_owned(), string(profile));
            attributes.insert("parentUUID".to_owned(), string(parent_uuid));
        }
    }
    Ok(Device {
        name: d.name.clone(),
        attributes: Some(attributes),
        capacity: Some(BTreeMap::from([(crate::claims::MEMORY_CAPACITY.to_owned(), memory)])),
        allow_multiple_allocations: multiple,
        ..Default::default()
    })
}

/// The name of the `index`th slice of `owner`'s pool for `driver`.
pub fn slice_name(owner: &Owner, driver: &str, index: usize) -> String {
    format!("{}-{}-{index}", owner.node_name, driver.replace('.', "-"))
}

/// The slices publishing `devices` (healthy ones: see the module's documentation) for `driver`
/// as pool generation `generation`. Always at least one slice, so the pool is known even with
/// no device to offer.
pub fn build(
    driver: &str,
    owner: &Owner,
    generation: i64,
    devices: &[NodeDevice],
) -> Result<Vec<ResourceSlice>, SliceError> {
    let mut seen = std::collections::BTreeSet::new();
    let mut offered = Vec::new();
    for d in devices {
        if !is_dns_label(&d.name) {
            return Err(SliceError::BadName { name: d.name.clone() });
        }
        if !seen.insert(d.name.as_str()) {
            return Err(SliceError::Duplicate { name: d.name.clone() });
        }
        // Built even when withdrawn: a device that cannot be published is an error now, not
        // once it turns healthy.
        let device = device(d)?;
        if d.healthy {
            offered.push(device);
        }
    }
    let chunks: Vec<Vec<Device>> = if offered.is_empty() {
        vec![Vec::new()]
    } else {
        offered.chunks(MAX_DEVICES_PER_SLICE).map(<[Device]>::to_vec).collect()
    };
    let count = i64::try_from(chunks.len()).unwrap_or(i64::MAX);
    Ok(chunks
        .into_iter()
        .enumerate()
        .map(|(i, devices)| ResourceSlice {
            metadata: ObjectMeta {
                name: Some(slice_name(owner, driver, i)),
                owner_references: Some(vec![OwnerReference {
                    api_version: "v1".into(),
                    kind: "Node".into(),
                    name: owner.node_name.clone(),
                    uid: owner.node_uid.clone(),
                    controller: Some(true),
                    block_owner_deletion: None,
                }]),
                ..Default::default()
            },
            spec: ResourceSliceSpec {
                driver: driver.to_owned(),
                node_name: Some(owner.node_name.clone()),
                pool: ResourcePool {
                    name: owner.node_name.clone(),
                    generation,
                    resource_slice_count: count,
                },
                devices: Some(devices),
                ..Default::default()
            },
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpu(i: u32, kind: DeviceKind) -> NodeDevice {
        NodeDevice {
            name: format!("gpu-{i}"),
            kind,
            uuid: format!("GPU-{i:08}"),
            index: i,
            product_name: "NVIDIA H200".into(),
            memory_bytes: 143_771_090_944,
            cuda_compute_capability: Some("9.0".into()),
            driver_version: Some("535.104.05".into()),
            pci_bus_id: Some(format!("0000:{:02x}:00.0", 0x18 + i)),
            numa_node: Some(i / 4),
            nvlink_clique: Some("clique-0".into()),
            healthy: true,
        }
    }

    fn owner() -> Owner {
        Owner { node_name: "node-a".into(), node_uid: "node-uid".into() }
    }

    /// Parses `value` as a ResourceSlice and fails on any key k8s-openapi's type does not know
    /// (what a strict decoder, and the API server's pruning, would object to).
    fn strict(value: &serde_json::Value) -> ResourceSlice {
        let mut unknown = Vec::new();
        let slice: ResourceSlice =
            serde_ignored::deserialize(value, |path| unknown.push(path.to_string()))
                .expect("a ResourceSlice");
        assert!(unknown.is_empty(), "keys the type does not know: {unknown:?}");
        slice
    }

    #[test]
    fn a_shared_gpu_is_one_device_with_a_consumable_memory_in_whole_units() {
        let unit = 1 << 30;
        let slices = build(
            "gpu.example.com",
            &owner(),
            3,
            &[gpu(0, DeviceKind::Shared { unit_bytes: unit })],
        )
        .expect("built");
        let value = serde_json::to_value(&slices[0]).expect("json");
        assert_eq!(strict(&value), slices[0], "a strict parse gives the slice back");
        let d = &value["spec"]["devices"][0];
        assert_eq!(d["allowMultipleAllocations"], true);
        // 143,771,090,944 bytes hold 133 whole GiB.
        assert_eq!(d["capacity"]["memory"]["value"], "133Gi");
        let policy = &d["capacity"]["memory"]["requestPolicy"];
        assert_eq!(policy["default"], "133Gi", "no capacity asked: the whole GPU");
        assert_eq!(policy["validRange"]["min"], "1Gi");
        assert_eq!(policy["validRange"]["step"], "1Gi");
        assert_eq!(policy["validRange"]["max"], "133Gi");
        assert_eq!(d["attributes"]["cudaComputeCapability"]["version"], "9.0.0");
        assert_eq!(d["attributes"]["driverVersion"]["version"], "535.104.5");
        assert_eq!(d["attributes"][PCI_BUS_ID_ATTRIBUTE]["string"], "0000:18:00.0");
        assert_eq!(value["spec"]["pool"]["name"], "node-a");
        assert_eq!(value["spec"]["pool"]["generation"], 3);
        assert_eq!(value["spec"]["nodeName"], "node-a");
        assert_eq!(value["metadata"]["ownerReferences"][0]["kind"], "Node");
        assert_eq!(value["metadata"]["ownerReferences"][0]["uid"], "node-uid");
        let count = d["attributes"].as_object().map_or(0, |a| a.len())
            + d["capacity"].as_object().map_or(0, |c| c.len());
        assert!(count <= MAX_ATTRIBUTES_AND_CAPACITIES, "{count}");
    }

    #[test]
    #[should_panic(expected = "keys the type does not know")]
    fn the_strict_parse_notices_an_unknown_key() {
        let slices = build("d", &owner(), 1, &[gpu(0, DeviceKind::Whole)]).expect("built");
        let mut value = serde_json::to_value(&slices[0]).expect("json");
        value["spec"]["devices"][0]["sharable"] = true.into();
        strict(&value);
    }

    #[test]
    fn whole_gpus_and_mig_instances_are_not_shared() {
        let mut mig =
            gpu(1, DeviceKind::Mig { profile: "1g.18gb".into(), parent_uuid: "GPU-1".into() });
        mig.name = "gpu-1-mig-0".into();
        mig.memory_bytes = 18 << 30;
        let slices = build("gpu.example.com", &owner(), 1, &[gpu(0, DeviceKind::Whole), mig])
            .expect("built");
        let value = serde_json::to_value(&slices).expect("json");
        for d in value[0]["spec"]["devices"].as_array().expect("devices") {
            assert!(d.get("allowMultipleAllocations").is_none(), "{d}");
            assert!(d["capacity"]["memory"].get("requestPolicy").is_none(), "{d}");
        }
        assert_eq!(value[0]["spec"]["devices"][1]["attributes"]["profile"]["string"], "1g.18gb");
        assert_eq!(value[0]["spec"]["devices"][1]["attributes"]["type"]["string"], "mig");
        assert_eq!(value[0]["spec"]["devices"][1]["capacity"]["memory"]["value"], "18Gi");
    }

    #[test]
    fn many_devices_make_slices_of_at_most_128_and_count_them() {
        let devices: Vec<_> = (0..300).map(|i| gpu(i, DeviceKind::Whole)).collect();
        let slices = build("gpu.example.com", &owner(), 7, &devices).expect("built");
        let sizes: Vec<_> =
            slices.iter().map(|s| s.spec.devices.as_ref().map_or(0, Vec::len)).collect();
        assert_eq!(sizes, [128, 128, 44]);
        for (i, s) in slices.iter().enumerate() {
            assert_eq!(s.spec.pool.resource_slice_count, 3);
            assert_eq!(s.spec.pool.generation, 7);
            assert_eq!(
                s.metadata.name.as_deref(),
                Some(format!("node-a-gpu-example-com-{i}").as_str())
            );
            strict(&serde_json::to_value(s).expect("json"));
        }
    }

    #[test]
    fn an_unhealthy_device_is_withdrawn_and_an_empty_pool_still_has_a_slice() {
        let mut sick = gpu(0, DeviceKind::Shared { unit_bytes: 1 << 30 });
        sick.healthy = false;
        let slices = build("gpu.example.com", &owner(), 2, &[sick, gpu(1, DeviceKind::Whole)])
            .expect("built");
        let names: Vec<_> =
            slices[0].spec.devices.iter().flatten().map(|d| d.name.as_str()).collect();
        assert_eq!(names, ["gpu-1"]);
        let mut sick = gpu(0, DeviceKind::Whole);
        sick.healthy = false;
        let slices = build("gpu.example.com", &owner(), 2, &[sick]).expect("built");
        assert_eq!(slices.len(), 1);
        assert_eq!(slices[0].spec.devices.as_ref().map(Vec::len), Some(0));
        assert_eq!(slices[0].spec.pool.resource_slice_count, 1);
    }

    #[test]
    fn names_and_units_the_api_server_would_refuse_are_errors() {
        let mut bad = gpu(0, DeviceKind::Whole);
        bad.name = "GPU_0".into();
        assert!(matches!(build("d", &owner(), 1, &[bad]), Err(SliceError::BadName { .. })));
        assert!(matches!(
            build("d", &owner(), 1, &[gpu(0, DeviceKind::Whole), gpu(0, DeviceKind::Whole)]),
            Err(SliceError::Duplicate { .. })
        ));
        let mut small = gpu(0, DeviceKind::Shared { unit_bytes: 1 << 40 });
        small.healthy = false;
        assert!(matches!(build("d", &owner(), 1, &[small]), Err(SliceError::NoUnits { .. })));
    }

    #[test]
    fn quantities_and_versions() {
        assert_eq!(bytes_quantity(80 << 30).0, "80Gi");
        assert_eq!(bytes_quantity(512 << 20).0, "512Mi");
        assert_eq!(bytes_quantity(1 << 40).0, "1Ti");
        assert_eq!(bytes_quantity(12345).0, "12345");
        assert_eq!(bytes_quantity(0).0, "0");
        assert_eq!(semantic_version("9.0").as_deref(), Some("9.0.0"));
        assert_eq!(semantic_version("550.54.15").as_deref(), Some("550.54.15"));
        assert_eq!(semantic_version("12").as_deref(), Some("12.0.0"));
        assert_eq!(semantic_version("1.2.3.4"), None);
        assert_eq!(semantic_version("r535"), None);
        assert!(is_dns_label("gpu-0") && !is_dns_label("-gpu") && !is_dns_label(&"a".repeat(64)));
    }
}
