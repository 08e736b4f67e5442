//! A test allocator that plays kube-scheduler's DRA allocator for one driver's pools: it reads
//! the published ResourceSlices (k8s-openapi's types, as the API server holds them), rounds a
//! requested capacity up by the device's `requestPolicy` (`validRange{min, step, max}`, or the
//! `default` when nothing is asked) exactly as the scheduler's structured-parameters allocator
//! does, keeps each device's consumed sum within its `capacity.value`, gives a device without
//! `allowMultipleAllocations` to one claim only, assigns a `shareID` to each share of a
//! multiply-allocatable device, and chooses devices first-fit in slice and device order (the
//! allocator's order: it takes the first device that satisfies the request).

use std::collections::{BTreeMap, BTreeSet};

use baleen_dra::claims::{MEMORY_CAPACITY, quantity_bytes};
use k8s_openapi::api::resource::v1::{CapacityRequestPolicy, Device, ResourceSlice};
use serde_json::{Value, json};

/// What a claim asks of the driver.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ask {
    /// One device with this much memory consumed (`capacity.requests.memory`).
    Memory(u64),
    /// `count` devices, each given whole (no capacity requested: the policy's default).
    Whole(u32),
}

/// One device given to a claim.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Given {
    /// The pool (the node).
    pub pool: String,
    /// The device.
    pub device: String,
    /// The memory consumed, when the device is multiply allocatable.
    pub consumed: Option<u64>,
    /// The share's ID, when it is.
    pub share_id: Option<String>,
}

/// The allocator's state: what each device has given.
#[derive(Debug, Default)]
pub struct Allocator {
    /// Memory consumed per (pool, device).
    consumed: BTreeMap<(String, String), u64>,
    /// Devices given to a claim whole (or, multiply allocatable, consumed at all).
    exclusive: BTreeSet<(String, String)>,
    /// Per claim UID, what it holds.
    claims: BTreeMap<String, Vec<Given>>,
    next_share: u64,
}

fn memory_of(d: &Device) -> Option<(u64, Option<&CapacityRequestPolicy>)> {
    let c = d.capacity.as_ref()?.get(MEMORY_CAPACITY)?;
    Some((quantity_bytes(&c.value.0).ok()?, c.request_policy.as_ref()))
}

/// The memory a request of `asked` bytes (`None`: nothing asked) consumes under `policy`, as
/// the scheduler computes it, or `None` if the policy admits no such request.
pub fn consumed_by(
    asked: Option<u64>,
    value: u64,
    policy: Option<&CapacityRequestPolicy>,
) -> Option<u64> {
    let Some(policy) = policy else {
        // No policy: a request consumes what it asks, nothing asked consumes the whole value.
        return Some(asked.unwrap_or(value));
    };
    let Some(asked) = asked else {
        return match &policy.default {
            Some(d) => quantity_bytes(&d.0).ok(),
            None => Some(value),
        };
    };
    if let Some(range) = &policy.valid_range {
        let min = quantity_bytes(&range.min.0).ok()?;
        let mut v = asked.max(min);
        if let Some(step) = range.step.as_ref().and_then(|s| quantity_bytes(&s.0).ok()) {
            v = min + (v - min).div_ceil(step) * step;
        }
        if let Some(max) = range.max.as_ref().and_then(|m| quantity_bytes(&m.0).ok())
            && v > max
        {
            return None;
        }
        return Some(v);
    }
    if let Some(values) = &policy.valid_values {
        return values
            .iter()
            .filter_map(|q| quantity_bytes(&q.0).ok())
            .filter(|&v| v >= asked)
            .min();
    }
    Some(asked)
}

impl Allocator {
    /// Whether `ask` could be allocated from `pool` in `slices` now.
    pub fn fits(&self, slices: &[ResourceSlice], pool: &str, ask: Ask) -> bool {
        self.choose(slices, pool, ask).is_some()
    }

    fn devices<'a>(slices: &'a [ResourceSlice], pool: &'a str) -> impl Iterator<Item = &'a Device> {
        slices
            .iter()
            .filter(move |s| s.spec.pool.name == pool)
            .flat_map(|s| s.spec.devices.iter().flatten())
    }

    fn choose(
        &self,
        slices: &[ResourceSlice],
        pool: &str,
        ask: Ask,
    ) -> Option<Vec<(String, Option<u64>)>> {
        let key = |d: &Device| (pool.to_owned(), d.name.clone());
        match ask {
            Ask::Memory(bytes) => Self::devices(slices, pool).find_map(|d| {
                let (value, policy) = memory_of(d)?;
                let multiple = d.allow_multiple_allocations == Some(true);
                if self.exclusive.contains(&key(d)) && !multiple {
                    return None;
                }
                let need = consumed_by(Some(bytes), value, policy)?;
                let used = self.consumed.get(&key(d)).copied().unwrap_or(0);
                if !multiple {
                    // A device given to one claim only: it must be untouched, and hold the ask.
                    return (used == 0 && bytes <= value).then(|| vec![(d.name.clone(), None)]);
                }
                (used + need <= value).then(|| vec![(d.name.clone(), Some(need))])
            }),
            Ask::Whole(count) => {
                let free: Vec<(String, Option<u64>)> = Self::devices(slices, pool)
                    .filter(|d| {
                        !self.exclusive.contains(&key(d))
                            && self.consumed.get(&key(d)).copied().unwrap_or(0) == 0
                    })
                    .filter_map(|d| {
                        let (value, policy) = memory_of(d)?;
                        let multiple = d.allow_multiple_allocations == Some(true);
                        // A shared device asked for nothing consumes its default (the whole).
                        let consumed =
                            if multiple { Some(consumed_by(None, value, policy)?) } else { None };
                        Some((d.name.clone(), consumed))
                    })
                    .take(count as usize)
                    .collect();
                (free.len() == count as usize).then_some(free)
            }
        }
    }

    /// Allocates `ask` for claim `uid` from `pool`, first fit; what it was given, or `None`.
    pub fn allocate(
        &mut self,
        slices: &[ResourceSlice],
        pool: &str,
        uid: &str,
        ask: Ask,
    ) -> Option<Vec<Given>> {
        let chosen = self.choose(slices, pool, ask)?;
        let mut given = Vec::new();
        for (device, consumed) in chosen {
            let key = (pool.to_owned(), device.clone());
            *self.consumed.entry(key.clone()).or_default() += consumed.unwrap_or(1);
            if consumed.is_none() {
                self.exclusive.insert(key);
            }
            let share_id = consumed.map(|_| {
                self.next_share += 1;
                format!("{:08x}-0000-4000-8000-{:012x}", self.next_share, self.next_share)
            });
            given.push(Given { pool: pool.to_owned(), device, consumed, share_id });
        }
        self.claims.insert(uid.to_owned(), given.clone());
        Some(given)
    }

    /// Gives back what claim `uid` holds.
    pub fn release(&mut self, uid: &str) {
        for g in self.claims.remove(uid).unwrap_or_default() {
            let key = (g.pool, g.device);
            if let Some(c) = self.consumed.get_mut(&key) {
                *c = c.saturating_sub(g.consumed.unwrap_or(1));
            }
            if g.consumed.is_none() {
                self.exclusive.remove(&key);
            }
        }
    }
}

/// The `status` of a claim allocated `given` by `driver`, reserved for pod `pod` (name, UID).
pub fn claim_status(driver: &str, given: &[Given], pod: (&str, &str)) -> Value {
    let results: Vec<Value> = given
        .iter()
        .map(|g| {
            let mut r =
                json!({"request": "gpu", "driver": driver, "pool": g.pool, "device": g.device});
            if let Some(c) = g.consumed {
                r["consumedCapacity"] =
                    json!({MEMORY_CAPACITY: baleen_dra::slices::bytes_quantity(c).0});
            }
            if let Some(s) = &g.share_id {
                r["shareID"] = json!(s);
            }
            r
        })
        .collect();
    json!({
        "allocation": {"devices": {"results": results}},
        "reservedFor": [{"resource": "pods", "name": pod.0, "uid": pod.1}]
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::resource::v1::CapacityRequestPolicyRange;
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

    fn policy(min: &str, step: &str, max: &str, default: &str) -> CapacityRequestPolicy {
        CapacityRequestPolicy {
            default: Some(Quantity(default.into())),
            valid_range: Some(CapacityRequestPolicyRange {
                min: Quantity(min.into()),
                step: Some(Quantity(step.into())),
                max: Some(Quantity(max.into())),
            }),
            valid_values: None,
        }
    }

    #[test]
    fn requests_round_up_by_the_policy_and_nothing_asked_takes_the_default() {
        let p = policy("1Gi", "1Gi", "80Gi", "80Gi");
        let gib = 1_u64 << 30;
        assert_eq!(consumed_by(Some(gib * 15 / 2), 80 * gib, Some(&p)), Some(8 * gib));
        assert_eq!(consumed_by(Some(1), 80 * gib, Some(&p)), Some(gib));
        assert_eq!(consumed_by(Some(81 * gib), 80 * gib, Some(&p)), None);
        assert_eq!(consumed_by(None, 80 * gib, Some(&p)), Some(80 * gib));
    }
}
