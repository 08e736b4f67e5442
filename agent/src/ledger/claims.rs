//! DRA claims on the same ledger (`driver: dra`): a claim's device is booked as the grant the
//! device-plugin views would make of it (a share as gpu-memory units of its GPU, a whole GPU
//! through the gpu view, a MIG instance through its profile's view), so every check of the
//! views holds for claims too (a GPU given whole is not shared, units are never held twice, an
//! unhealthy or reserved GPU takes nothing new), and its record names the claim. A claim is
//! booked all or none, once: booking it again answers what it holds.

use super::*;

/// The DRA claim device a record is booked for.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClaimHolder {
    /// The claim's namespace.
    pub namespace: String,
    /// The claim's name.
    pub name: String,
    /// The claim's UID.
    pub uid: String,
    /// The claim's request the device serves.
    pub request: String,
    /// The device's name in the node's pool.
    pub device: String,
    /// Its share ID, for a device allocated more than once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub share_id: Option<String>,
    /// The pod the claim is reserved for (the first, for the metrics' labels).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod: Option<String>,
    /// The MPS client priority of the pod's co-location class when it was booked (kept, so
    /// that the CDI spec written again after a restart is the one the containers started with).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority: Option<u8>,
}

/// What a claim's device is, in the ledger's terms.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClaimDevice {
    /// A share of `bytes` (whole memory units) of one GPU.
    Share {
        /// The GPU.
        gpu_uuid: String,
        /// The bytes consumed.
        bytes: u64,
    },
    /// A GPU whole.
    Whole {
        /// The GPU.
        gpu_uuid: String,
    },
    /// A MIG instance.
    Mig {
        /// The instance's UUID.
        uuid: String,
    },
}

/// One device of a claim to book.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimBooking {
    /// Whose.
    pub holder: ClaimHolder,
    /// What.
    pub device: ClaimDevice,
}

impl DeviceLedger {
    /// What claim `uid` holds: each device's record and grant, in device-name order.
    pub fn claim_grants(&self, uid: &str) -> Vec<(AllocationRecord, Grant)> {
        let mut v: Vec<(AllocationRecord, Grant)> = self
            .held
            .values()
            .filter(|h| h.record.claim.as_ref().is_some_and(|c| c.uid == uid))
            .map(|h| (h.record.clone(), self.grant(h)))
            .collect();
        v.sort_by(|a, b| a.0.claim.cmp(&b.0.claim));
        v
    }

    /// Books every device of one claim, or refuses with nothing booked (the ledger is left
    /// half-changed on a refusal: a caller changes a clone and drops it, as
    /// `crate::resources` does). A claim already held is answered as it is held, whatever is
    /// asked now.
    pub fn book_claim(
        &mut self,
        bookings: &[ClaimBooking],
        now: u64,
    ) -> Result<Vec<(AllocationRecord, Grant)>, Refusal> {
        let Some(uid) = bookings.first().map(|b| b.holder.uid.clone()) else {
            return Ok(Vec::new());
        };
        let held = self.claim_grants(&uid);
        if !held.is_empty() {
            return Ok(held);
        }
        for b in bookings {
            let (view, ids) = self.claim_ids(b)?;
            let grant = self.allocate(&view, &ids, now)?;
            self.set_claim(&grant.device_ids, b.holder.clone());
        }
        Ok(self.claim_grants(&uid))
    }

    /// Names `claim` as the holder of the allocation of `device_ids` (just granted or restored).
    pub(super) fn set_claim(&mut self, device_ids: &[String], claim: ClaimHolder) {
        let id = device_ids.first().and_then(|d| self.by_device.get(d.as_str())).copied();
        if let Some(h) = id.and_then(|id| self.held.get_mut(&id)) {
            Arc::make_mut(h).record.claim = Some(claim);
        }
    }

    /// The view and device IDs a claim's device is booked as: a share takes the lowest free
    /// units of its GPU.
    fn claim_ids(&self, b: &ClaimBooking) -> Result<(View, Vec<String>), Refusal> {
        let gpu = |uuid: &str| {
            self.by_uuid
                .get(uuid)
                .copied()
                .ok_or_else(|| Refusal::UnknownDevices { ids: vec![uuid.to_owned()] })
        };
        match &b.device {
            ClaimDevice::Whole { gpu_uuid } => {
                gpu(gpu_uuid)?;
                Ok((View::Gpu, vec![gpu_uuid.clone()]))
            }
            ClaimDevice::Mig { uuid } => match self.mig.get(uuid) {
                Some((_, profile)) => Ok((View::Mig(profile.clone()), vec![uuid.clone()])),
                None => Err(Refusal::UnknownDevices { ids: vec![uuid.clone()] }),
            },
            ClaimDevice::Share { gpu_uuid, bytes } => {
                let i = gpu(gpu_uuid)?;
                let unit = self.config.memory_unit_bytes;
                let invalid = |reason: String| Refusal::InvalidRequest {
                    ids: vec![b.holder.device.clone()],
                    reason,
                };
                if *bytes == 0 || bytes % unit != 0 {
                    return Err(invalid(format!(
                        "a share of {bytes} bytes is not a whole number of {unit}-byte memory \
                         units (the published requestPolicy rounds requests up to whole units)"
                    )));
                }
                let units = usize::try_from(bytes / unit).unwrap_or(usize::MAX);
                let slot = &self.slots[i];
                let free: Vec<u32> = (0..slot.units)
                    .filter(|&n| slot.unit_holder[n as usize].is_none())
                    .take(units)
                    .collect();
                if free.len() < units {
                    return Err(Refusal::Conflict {
                        ids: vec![b.holder.device.clone()],
                        reason: format!(
                            "GPU {gpu_uuid} has {} of its {} memory units free and the claim's \
                             share needs {units}: more than the GPU holds is allocated on it",
                            free.len(),
                            slot.units
                        ),
                    });
                }
                Ok((View::GpuMemory, free.into_iter().map(|n| unit_id(gpu_uuid, n)).collect()))
            }
        }
    }

    /// Releases every device claim `uid` holds; returns their records.
    pub fn release_claim(&mut self, uid: &str) -> Vec<AllocationRecord> {
        self.retain(|r| r.claim.as_ref().is_none_or(|c| c.uid != uid))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inventory::GpuInventory as _;
    use crate::inventory::simulated::SimulatedInventory;

    fn h200() -> DeviceLedger {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../packaging/examples/h200-8x-nvswitch.yaml");
        let inventory = SimulatedInventory::from_file(&path)
            .expect("example loads")
            .discover()
            .expect("discover");
        DeviceLedger::new("node-a", &inventory, ViewConfig::default()).expect("ledger")
    }

    fn holder(uid: &str, device: &str) -> ClaimHolder {
        ClaimHolder {
            namespace: "team-a".into(),
            name: format!("claim-{uid}"),
            uid: uid.into(),
            request: "gpu".into(),
            device: device.into(),
            share_id: Some(format!("share-{uid}")),
            pod: Some("infer-0".into()),
            priority: None,
        }
    }

    fn share(l: &DeviceLedger, uid: &str, gpu: usize, gib: u64) -> ClaimBooking {
        ClaimBooking {
            holder: holder(uid, &format!("gpu-{gpu}")),
            device: ClaimDevice::Share {
                gpu_uuid: l.slots[gpu].gpu.uuid.to_string(),
                bytes: gib * l.config.memory_unit_bytes,
            },
        }
    }

    #[test]
    fn shares_of_one_gpu_take_distinct_units_and_never_more_than_it_holds() {
        let mut l = h200();
        let total = l.slots[0].units;
        let a = l.book_claim(&[share(&l, "a", 0, 8)], 1).expect("a books");
        let b = l.book_claim(&[share(&l, "b", 0, 8)], 1).expect("b books");
        let ua = a[0].1.share.as_ref().map(|s| s.units);
        assert_eq!(ua, Some(8));
        let mut ids = a[0].0.device_ids.clone();
        ids.extend(b[0].0.device_ids.clone());
        let n = ids.len();
        ids.sort();
        ids.dedup();
        assert_eq!(ids.len(), n, "no unit twice");
        assert_eq!(a[0].0.claim.as_ref().map(|c| c.uid.as_str()), Some("a"));
        // The rest of the GPU fits; one unit more does not.
        let rest = u64::from(total - 16);
        let mut over = l.clone();
        let e = over.book_claim(&[share(&l, "c", 0, rest + 1)], 1).expect_err("over");
        assert!(e.to_string().contains("more than the GPU holds"), "{e}");
        l.book_claim(&[share(&l, "c", 0, rest)], 1).expect("the rest fits");
        assert_eq!(l.units_taken(0), total);
    }

    #[test]
    fn a_claim_is_booked_once_and_released_whole() {
        let mut l = h200();
        let two = [share(&l, "a", 0, 4), share(&l, "a", 1, 4)];
        let first = l.book_claim(&two, 1).expect("booked");
        assert_eq!(first.len(), 2);
        // Booked again (a repeated Prepare): the same devices, nothing more taken.
        let again = l.book_claim(&[share(&l, "a", 2, 9)], 2).expect("answered");
        assert_eq!(again, first);
        assert_eq!(l.units_taken(2), 0);
        assert_eq!(l.release_claim("a").len(), 2);
        assert_eq!((l.units_taken(0), l.units_taken(1)), (0, 0));
        assert!(l.release_claim("a").is_empty());
    }

    #[test]
    fn a_gpu_is_never_whole_and_shared_at_once() {
        let mut l = h200();
        let uuid = l.slots[0].gpu.uuid.to_string();
        l.book_claim(&[share(&l, "a", 0, 1)], 1).expect("share");
        let whole = ClaimBooking {
            holder: holder("w", "gpu-0"),
            device: ClaimDevice::Whole { gpu_uuid: uuid.clone() },
        };
        let e = l.clone().book_claim(std::slice::from_ref(&whole), 1).expect_err("shared already");
        assert!(e.to_string().contains("is shared"), "{e}");
        l.release_claim("a");
        l.book_claim(std::slice::from_ref(&whole), 1).expect("whole");
        let e = l.book_claim(&[share(&l, "b", 0, 1)], 1).expect_err("whole already");
        assert!(e.to_string().contains("held whole"), "{e}");
    }

    #[test]
    fn a_share_that_is_not_whole_units_or_on_an_unhealthy_gpu_is_refused() {
        let mut l = h200();
        let mut odd = share(&l, "a", 0, 1);
        odd.device = ClaimDevice::Share {
            gpu_uuid: l.slots[0].gpu.uuid.to_string(),
            bytes: l.config.memory_unit_bytes + 1,
        };
        let e = l.book_claim(&[odd], 1).expect_err("not whole units");
        assert!(e.to_string().contains("not a whole number"), "{e}");
        let uuid = l.slots[1].gpu.uuid.to_string();
        l.set_health(&uuid, false);
        let e = l.book_claim(&[share(&l, "b", 1, 1)], 1).expect_err("unhealthy");
        assert!(e.to_string().contains("unhealthy"), "{e}");
        let unknown = ClaimBooking {
            holder: holder("c", "gpu-9"),
            device: ClaimDevice::Whole { gpu_uuid: "GPU-none".into() },
        };
        assert!(matches!(l.book_claim(&[unknown], 1), Err(Refusal::UnknownDevices { .. })));
    }

    #[test]
    fn a_claims_records_restore_with_the_claim() {
        let mut l = h200();
        l.book_claim(&[share(&l, "a", 3, 5)], 1).expect("booked");
        let records = l.records();
        let mut fresh = h200();
        assert!(fresh.restore(&records).is_empty());
        let back = fresh.claim_grants("a");
        assert_eq!(back.len(), 1);
        assert_eq!(back[0].0, records[0], "the claim comes back with its record");
        let json = serde_json::to_string(&records[0]).expect("json");
        assert!(json.contains(r#""claim":{"namespace":"team-a""#), "{json}");
    }
}
