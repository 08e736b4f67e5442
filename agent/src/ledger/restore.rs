//! Restoring the ledger from the checkpoint's records, and parking the allocations that name a
//! GPU the inventory cannot read now (kept, never released, their other GPUs reserved).

use super::*;

impl DeviceLedger {
    /// Whether `record` (granted under `layout`) is parked rather than restored: while a GPU
    /// cannot be read, a record that names it (a unit of it, it whole, an NVLink group of it
    /// under `layout`), that needs a view this start does not offer (NVLink groups are not
    /// offered then), or whose devices this ledger does not know (a MIG instance of the
    /// unreadable GPU cannot be told).
    pub(super) fn would_park(&self, record: &AllocationRecord, layout: &Layout) -> bool {
        if !self.any_unreadable {
            return false;
        }
        let Some(view) = self.view_for(&record.resource) else { return true };
        record.device_ids.iter().any(|id| {
            let gpu = parse_unit_id(id).map_or(id.as_str(), |(uuid, _)| uuid);
            let members = layout.nvlink_groups.get(id).into_iter().flatten();
            self.unreadable.contains_key(gpu)
                || members.into_iter().any(|m| self.unreadable.contains_key(m))
        }) || self.parse(&view, &record.device_ids).is_err()
    }

    /// Parks `record` (granted under `layout`): kept as it is, in every checkpoint, never
    /// released, and every readable GPU it names reserved (offered to no one), until a start
    /// that reads every GPU restores it. What it holds of the unreadable GPU is not offered
    /// anyway: that GPU is not in the ledger.
    pub(super) fn park(&mut self, record: &AllocationRecord, layout: &Layout) {
        let mut named: Vec<String> = Vec::new();
        for id in &record.device_ids {
            if let Some((uuid, _)) = parse_unit_id(id) {
                named.push(uuid.to_owned());
            } else if let Some(members) = layout.nvlink_groups.get(id) {
                named.extend(members.iter().cloned());
                Arc::make_mut(&mut self.parked_groups).insert(id.clone(), members.clone());
            } else if let Some((_, first)) =
                id.split_once('-').filter(|(kind, _)| kind.starts_with("nvlink"))
            {
                // An NVLink group without its layout: its ID names its first GPU.
                named.push(first.to_owned());
            } else {
                named.push(id.clone());
            }
        }
        for uuid in named {
            if let Some(&i) = self.by_uuid.get(&uuid) {
                self.slots[i].reserved = true;
            }
        }
        tracing::warn!(
            resource = record.resource,
            devices = ?record.device_ids,
            "allocation parked: it names a GPU NVML cannot read; it stays held, and every GPU it names stays unoffered, until a start that reads every GPU"
        );
        Arc::make_mut(&mut self.parked).push(record.clone());
        self.records_version += 1;
    }

    /// Restores the allocations of a checkpoint written under `layout` (see [`Self::restore`]),
    /// parking those that name a GPU this start could not read (kept held as they are); returns the
    /// ones refused, with why.
    pub fn restore_from(
        &mut self,
        records: &[AllocationRecord],
        layout: &Layout,
    ) -> Vec<(AllocationRecord, String)> {
        let (parked, rest): (Vec<&AllocationRecord>, Vec<&AllocationRecord>) =
            records.iter().partition(|r| self.would_park(r, layout));
        for r in parked {
            self.park(r, layout);
        }
        let rest: Vec<AllocationRecord> = rest.into_iter().cloned().collect();
        self.restore(&rest)
    }

    /// Re-records allocations (from a checkpoint or the kubelet); returns the ones refused,
    /// with why. While a GPU cannot be read, a record the kubelet lists that names it is parked
    /// instead (see [`Self::restore_from`]; no layout: an NVLink group's members are unknown then, and
    /// only its first GPU, named in its ID, is reserved).
    pub fn restore(&mut self, records: &[AllocationRecord]) -> Vec<(AllocationRecord, String)> {
        let mut refused = Vec::new();
        let unknown = Layout::default();
        for record in records {
            if self.would_park(record, &unknown) {
                if !self.parked.iter().any(|p| p.key() == record.key()) {
                    self.park(record, &unknown);
                }
                continue;
            }
            let outcome = match self.view_for(&record.resource) {
                None => Err(format!("this node does not offer {}", record.resource)),
                Some(view) => self
                    .allocate(&view, &record.device_ids, record.allocated_at)
                    .map(drop)
                    .map_err(|e| e.to_string()),
            };
            if outcome.is_ok()
                && let Some(claim) = &record.claim
            {
                self.set_claim(&record.device_ids, claim.clone());
            }
            match outcome {
                Err(why) => refused.push((record.clone(), why)),
                Ok(()) if record.listed => {
                    let same = |r: &AllocationRecord| {
                        r.resource == record.resource && r.device_ids == record.device_ids
                    };
                    self.mark_listed(same);
                    self.set_holders(|r| record.holder.clone().filter(|_| same(r)));
                }
                Ok(()) => {}
            }
        }
        refused
    }
}
