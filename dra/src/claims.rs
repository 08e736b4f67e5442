//! What a ResourceClaim allocated of this driver's devices on this node, read for
//! `NodePrepareResources`: the kubelet names a claim (namespace, name, UID), the driver GETs it
//! and reads the scheduler's allocation. Every result of this driver must be one it can book:
//! a device of this node's pool, a memory share given as whole bytes, no admin access and no
//! opaque parameters (the driver takes none, and ignoring them would break the user's intent
//! silently). Anything else refuses the claim with a reason the kubelet shows on the pod.

use k8s_openapi::api::resource::v1::{DeviceRequestAllocationResult, ResourceClaim};

/// The consumable capacity a share of a GPU is measured in (a published device's `capacity`).
pub const MEMORY_CAPACITY: &str = "memory";

/// A claim as the kubelet names it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ClaimRef {
    /// Its namespace.
    pub namespace: String,
    /// Its name.
    pub name: String,
    /// Its UID.
    pub uid: String,
}

impl std::fmt::Display for ClaimRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{} (UID {})", self.namespace, self.name, self.uid)
    }
}

/// One device the scheduler allocated to the claim from this driver.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Allocated {
    /// The claim's request it serves (`request` or `request/subrequest`).
    pub request: String,
    /// The pool it is from (this node's).
    pub pool: String,
    /// The device's name in the pool.
    pub device: String,
    /// The memory the share consumes, in bytes (`consumedCapacity.memory`): `None` when the
    /// device was allocated with no consumed capacity (a device that is not shared).
    pub memory_bytes: Option<u64>,
    /// The share's ID, for a device allocated more than once.
    pub share_id: Option<String>,
}

/// Who the claim is reserved for (`status.reservedFor`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Consumer {
    /// `pods`, for a pod.
    pub resource: String,
    /// Its name.
    pub name: String,
    /// Its UID.
    pub uid: String,
}

/// This driver's part of a claim's allocation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimAllocation {
    /// The claim.
    pub claim: ClaimRef,
    /// The devices of this driver, in the order of the allocation.
    pub devices: Vec<Allocated>,
    /// Whom it is reserved for.
    pub reserved_for: Vec<Consumer>,
}

/// Why a claim cannot be prepared from what the API server holds: the claim, and what is wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("claim {claim}: {problem}")]
pub struct ClaimError {
    /// The claim, as the kubelet named it (boxed: errors stay small).
    pub claim: Box<ClaimRef>,
    /// What is wrong with it.
    pub problem: Problem,
}

/// What is wrong with a claim.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Problem {
    /// The claim found is another one than the kubelet asked for (deleted and recreated).
    #[error(
        "the API server holds another claim under that name (UID {found}): it was deleted and \
         created again; the pod must be recreated"
    )]
    UidMismatch {
        /// The UID found.
        found: String,
    },
    /// The claim has no allocation.
    #[error("not allocated (no status.allocation): nothing to prepare")]
    NotAllocated,
    /// No result of the allocation is this driver's.
    #[error("no device of driver {driver} is allocated")]
    NoDevices {
        /// The driver.
        driver: String,
    },
    /// A result names a device of another pool (another node).
    #[error("device {device} was allocated from pool {pool}, not this node's pool {ours}")]
    OtherPool {
        /// The device.
        device: String,
        /// Its pool.
        pool: String,
        /// This node's pool.
        ours: String,
    },
    /// A consumed capacity this driver does not publish, or one that is not whole bytes.
    #[error("device {device} consumes {name}: {value:?}, which {why}")]
    BadCapacity {
        /// The device.
        device: String,
        /// The capacity's name.
        name: String,
        /// Its value as written.
        value: String,
        /// What is wrong with it.
        why: &'static str,
    },
    /// Admin access (monitoring a device in use) is not offered by this driver.
    #[error(
        "device {device} was allocated with adminAccess, which this driver does not serve (it \
         would reach a GPU other pods hold)"
    )]
    AdminAccess {
        /// The device.
        device: String,
    },
    /// Opaque parameters for this driver, which takes none.
    #[error(
        "it carries opaque parameters for driver {driver} (from its {origin}), which takes none: \
         remove them"
    )]
    Parameters {
        /// The driver.
        driver: String,
        /// `FromClass` or `FromClaim`.
        origin: String,
    },
}

/// This driver's devices in `claim`, which the kubelet asked for as `asked`, for the node whose
/// pool is `pool`.
pub fn read_allocation(
    claim: &ResourceClaim,
    asked: &ClaimRef,
    driver: &str,
    pool: &str,
) -> Result<ClaimAllocation, ClaimError> {
    let found = claim.metadata.uid.clone().unwrap_or_default();
    if found != asked.uid {
        return Err(refuse(asked, Problem::UidMismatch { found }));
    }
    let status = claim.status.as_ref();
    let Some(allocation) = status.and_then(|s| s.allocation.as_ref()) else {
        return Err(refuse(asked, Problem::NotAllocated));
    };
    let results = allocation.devices.as_ref();
    for config in results.and_then(|d| d.config.as_deref()).unwrap_or_default() {
        if config.opaque.as_ref().is_some_and(|o| o.driver == driver) {
            let (driver, origin) = (driver.to_owned(), config.source.clone());
            return Err(refuse(asked, Problem::Parameters { driver, origin }));
        }
    }
    let mut devices = Vec::new();
    for result in results.and_then(|d| d.results.as_deref()).unwrap_or_default() {
        if result.driver != driver {
            continue;
        }
        devices.push(read_result(result, asked, pool)?);
    }
    if devices.is_empty() {
        return Err(refuse(asked, Problem::NoDevices { driver: driver.to_owned() }));
    }
    let reserved_for = status
        .and_then(|s| s.reserved_for.as_deref())
        .unwrap_or_default()
        .iter()
        .map(|r| Consumer {
            resource: r.resource.clone(),
            name: r.name.clone(),
            uid: r.uid.clone(),
        })
        .collect();
    Ok(ClaimAllocation { claim: asked.clone(), devices, reserved_for })
}

fn refuse(claim: &ClaimRef, problem: Problem) -> ClaimError {
    ClaimError { claim: Box::new(claim.clone()), problem }
}

fn read_result(
    result: &DeviceRequestAllocationResult,
    claim: &ClaimRef,
    pool: &str,
) -> Result<Allocated, ClaimError> {
    if result.pool != pool {
        let (device, ours) = (result.device.clone(), pool.to_owned());
        return Err(refuse(claim, Problem::OtherPool { device, pool: result.pool.clone(), ours }));
    }
    if result.admin_access == Some(true) {
        return Err(refuse(claim, Problem::AdminAccess { device: result.device.clone() }));
    }
    let mut memory_bytes = None;
    for (name, quantity) in result.consumed_capacity.iter().flatten() {
        let bad = |why| {
            let (device, name, value) = (result.device.clone(), name.clone(), quantity.0.clone());
            refuse(claim, Problem::BadCapacity { device, name, value, why })
        };
        if name != MEMORY_CAPACITY {
            return Err(bad("this driver does not publish"));
        }
        memory_bytes = Some(quantity_bytes(&quantity.0).map_err(bad)?);
    }
    Ok(Allocated {
        request: result.request.clone(),
        pool: result.pool.clone(),
        device: result.device.clone(),
        memory_bytes,
        share_id: result.share_id.clone(),
    })
}

/// A quantity of bytes (`8Gi`, `8589934592`, `8e9`), which must be a whole, positive number.
pub fn quantity_bytes(text: &str) -> Result<u64, &'static str> {
    let milli = baleen_k8s::quantity::quantity_milli(text).ok_or("is not a quantity")?;
    if milli <= 0 {
        return Err("is not positive");
    }
    if milli % 1000 != 0 {
        return Err("is not a whole number of bytes");
    }
    u64::try_from(milli / 1000).map_err(|_| "is more bytes than any GPU has")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn claim(value: serde_json::Value) -> ResourceClaim {
        serde_json::from_value(value).expect("a ResourceClaim")
    }

    fn asked() -> ClaimRef {
        ClaimRef { namespace: "team-a".into(), name: "infer-gpu".into(), uid: "uid-1".into() }
    }

    fn allocated(results: serde_json::Value) -> ResourceClaim {
        claim(json!({
            "metadata": {"name": "infer-gpu", "namespace": "team-a", "uid": "uid-1"},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.example.com"}}]}},
            "status": {
                "allocation": {"devices": {"results": results}},
                "reservedFor": [{"resource": "pods", "name": "infer-0", "uid": "pod-uid"}]
            }
        }))
    }

    #[test]
    fn a_share_and_a_whole_device_are_read_with_their_bytes_and_share_ids() {
        let c = allocated(json!([
            {"request": "gpu", "driver": "gpu.example.com", "pool": "node-a", "device": "gpu-0",
             "consumedCapacity": {"memory": "8Gi"}, "shareID": "7f6e"},
            {"request": "gpu", "driver": "other.example.com", "pool": "x", "device": "nic-0"},
            {"request": "big", "driver": "gpu.example.com", "pool": "node-a", "device": "gpu-1"}
        ]));
        let a = read_allocation(&c, &asked(), "gpu.example.com", "node-a").expect("readable");
        assert_eq!(a.devices.len(), 2, "the other driver's device is not ours");
        assert_eq!(a.devices[0].memory_bytes, Some(8 << 30));
        assert_eq!(a.devices[0].share_id.as_deref(), Some("7f6e"));
        assert_eq!(a.devices[1].memory_bytes, None);
        assert_eq!(a.devices[1].device, "gpu-1");
        assert_eq!(
            a.reserved_for,
            vec![Consumer {
                resource: "pods".into(),
                name: "infer-0".into(),
                uid: "pod-uid".into()
            }]
        );
    }

    #[test]
    fn a_recreated_claim_is_refused_by_its_uid() {
        let c = allocated(json!([]));
        let mut other = asked();
        other.uid = "uid-0".into();
        let e = read_allocation(&c, &other, "gpu.example.com", "node-a").expect_err("mismatch");
        assert!(matches!(&e.problem, Problem::UidMismatch { found } if found == "uid-1"), "{e}");
        assert!(e.to_string().starts_with("claim team-a/infer-gpu (UID uid-0): "), "{e}");
        assert!(e.to_string().contains("deleted and created again"), "{e}");
    }

    #[test]
    fn what_cannot_be_booked_is_refused_with_the_reason() {
        let cases = [
            (
                json!([{"request": "g", "driver": "gpu.example.com", "pool": "node-b", "device": "gpu-0"}]),
                "not this node's pool node-a",
            ),
            (
                json!([{"request": "g", "driver": "gpu.example.com", "pool": "node-a", "device": "gpu-0", "consumedCapacity": {"memory": "1.5"}}]),
                "not a whole number of bytes",
            ),
            (
                json!([{"request": "g", "driver": "gpu.example.com", "pool": "node-a", "device": "gpu-0", "consumedCapacity": {"memory": "0"}}]),
                "not positive",
            ),
            (
                json!([{"request": "g", "driver": "gpu.example.com", "pool": "node-a", "device": "gpu-0", "consumedCapacity": {"memory": "lots"}}]),
                "not a quantity",
            ),
            (
                json!([{"request": "g", "driver": "gpu.example.com", "pool": "node-a", "device": "gpu-0", "consumedCapacity": {"cores": "2"}}]),
                "does not publish",
            ),
            (
                json!([{"request": "g", "driver": "gpu.example.com", "pool": "node-a", "device": "gpu-0", "adminAccess": true}]),
                "adminAccess",
            ),
            (
                json!([{"request": "g", "driver": "other.example.com", "pool": "node-a", "device": "gpu-0"}]),
                "no device of driver gpu.example.com",
            ),
        ];
        for (results, words) in cases {
            let e =
                read_allocation(&allocated(results.clone()), &asked(), "gpu.example.com", "node-a")
                    .expect_err("refused");
            assert!(e.to_string().contains(words), "{results}: {e}");
        }
        let unallocated = claim(json!({"metadata": {"uid": "uid-1"}, "spec": {}}));
        let e = read_allocation(&unallocated, &asked(), "gpu.example.com", "node-a")
            .expect_err("not allocated");
        assert_eq!(e.problem, Problem::NotAllocated, "{e}");
    }

    #[test]
    fn opaque_parameters_for_this_driver_are_refused_and_others_left_alone() {
        let mut c = allocated(
            json!([{"request": "g", "driver": "gpu.example.com", "pool": "node-a", "device": "gpu-0"}]),
        );
        let config = |driver: &str| {
            serde_json::from_value(json!({"source": "FromClaim", "opaque": {"driver": driver, "parameters": {"x": 1}}}))
                .expect("config")
        };
        let devices = c
            .status
            .as_mut()
            .and_then(|s| s.allocation.as_mut())
            .and_then(|a| a.devices.as_mut())
            .expect("devices");
        devices.config = Some(vec![config("other.example.com")]);
        read_allocation(&c, &asked(), "gpu.example.com", "node-a")
            .expect("another driver's config");
        let devices = c
            .status
            .as_mut()
            .and_then(|s| s.allocation.as_mut())
            .and_then(|a| a.devices.as_mut())
            .expect("devices");
        devices.config = Some(vec![config("gpu.example.com")]);
        let e = read_allocation(&c, &asked(), "gpu.example.com", "node-a").expect_err("ours");
        assert!(
            matches!(&e.problem, Problem::Parameters { origin, .. } if origin == "FromClaim"),
            "{e}"
        );
    }

    #[test]
    fn quantities_of_bytes() {
        assert_eq!(quantity_bytes("8Gi"), Ok(8 << 30));
        assert_eq!(quantity_bytes("8589934592"), Ok(8 << 30));
        assert_eq!(quantity_bytes("8e9"), Ok(8_000_000_000));
        assert_eq!(quantity_bytes("1500m"), Err("is not a whole number of bytes"));
        assert_eq!(quantity_bytes("-1Gi"), Err("is not positive"));
        assert_eq!(quantity_bytes("100Ei"), Err("is more bytes than any GPU has"));
    }
}
