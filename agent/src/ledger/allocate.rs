//! Granting and releasing: an allocation parsed, checked against every view and granted (a
//! repeat accepted, an overlap of the same view replacing the older one), released when the
//! kubelet's lists no longer hold it, and each change as the journal's [`Delta`].

use super::*;

impl DeviceLedger {
    pub(super) fn parse(&self, view: &View, ids: &[String]) -> Result<Parsed, Refusal> {
        let mut parsed = Parsed { gpus: GpuSet::EMPTY, units: Vec::new(), groups: Vec::new() };
        let mut unknown = Vec::new();
        for id in ids {
            match view {
                View::Gpu => match self.by_uuid.get(id) {
                    Some(&i) if !self.slots[i].gpu.mig.is_enabled() => parsed.gpus.insert(i),
                    _ => unknown.push(id.clone()),
                },
                View::GpuMemory => {
                    let unit = parse_unit_id(id).and_then(|(uuid, n)| {
                        let i = *self.by_uuid.get(uuid)?;
                        (n < self.slots[i].units).then_some((i, n))
                    });
                    match unit {
                        Some((i, n)) => {
                            parsed.gpus.insert(i);
                            parsed.units.push((i, n));
                        }
                        None => unknown.push(id.clone()),
                    }
                }
                View::Mig(profile) => match self.mig.get(id) {
                    Some((i, p)) if p == profile => parsed.gpus.insert(*i),
                    _ => unknown.push(id.clone()),
                },
                View::NvlinkGroup(size) => match self.group_by_id.get(id) {
                    Some(&g) if self.groups[g].size == *size => {
                        for i in self.groups[g].members.iter() {
                            parsed.gpus.insert(i);
                        }
                        parsed.groups.push(g);
                    }
                    _ => unknown.push(id.clone()),
                },
            }
        }
        if !unknown.is_empty() {
            return Err(Refusal::UnknownDevices { ids: unknown });
        }
        if *view == View::GpuMemory && parsed.gpus.len() > 1 {
            let gpus: Vec<String> =
                parsed.gpus.iter().map(|i| self.slots[i].gpu.uuid.to_string()).collect();
            return Err(Refusal::InvalidRequest {
                ids: ids.to_vec(),
                reason: format!(
                    "gpu-memory units must all be on one GPU, these are on {}: {}",
                    gpus.len(),
                    gpus.join(", ")
                ),
            });
        }
        Ok(parsed)
    }

    /// Grants one container the devices `ids` of `view`, or refuses with nothing changed.
    pub fn allocate(&mut self, view: &View, ids: &[String], now: u64) -> Result<Grant, Refusal> {
        let sorted = ids_of(ids);
        let repeat =
            sorted.first().and_then(|d| self.by_device.get(d.as_str())).copied().filter(|id| {
                self.held.get(id).is_some_and(|h| h.view == *view && h.record.device_ids == sorted)
            });
        if let Some(id) = repeat
            && let Some(h) = self.held.get_mut(&id)
        {
            // A repeated Allocate: an init container's devices reused, or a new pod given exactly
            // the devices of one that ended. The same answer; the allocation counts as new
            // until the kubelet lists it.
            let h = Arc::make_mut(h);
            h.record.allocated_at = now;
            h.record.listed = false;
            h.missed = 0;
            let h = h.clone();
            self.records_version += 1;
            self.touched.push(id);
            return Ok(self.grant(&h));
        }
        let parsed = self.parse(view, ids)?;
        // Older allocations of the same view that share a device ended (the kubelet reassigns
        // only freed devices): they are replaced.
        let superseded: BTreeSet<u64> =
            self.replaced_by(view, &sorted).into_iter().map(|(id, _)| id).collect();
        self.check_conflicts(view, ids, &parsed, &superseded)?;
        for id in &superseded {
            self.release_id(*id);
        }
        let id = self.next_id;
        self.next_id += 1;
        let request = match view {
            View::GpuMemory => Some(Request {
                cpu: MilliCpu(0),
                memory: MemMib(0),
                gpu: GpuDemand::Shared {
                    milli: MilliGpu(0),
                    memory: MemUnits(count(parsed.units.len())),
                },
                allowed_models: vec![],
            }),
            View::Gpu | View::NvlinkGroup(_) => Some(Request {
                cpu: MilliCpu(0),
                memory: MemMib(0),
                gpu: GpuDemand::Whole { count: count(parsed.gpus.len()) },
                allowed_models: vec![],
            }),
            View::Mig(_) => None,
        };
        if let Some(request) = request {
            self.ledger
                .allocate(AllocationId(id), &request, parsed.gpus)
                .map_err(|e| Refusal::Conflict { ids: ids.to_vec(), reason: e.to_string() })?;
            let shape = self.shape_of(&parsed);
            Arc::make_mut(&mut self.recent).record(shape);
        }
        for &(i, n) in &parsed.units {
            let slot = &mut self.slots[i];
            slot.unit_holder[n as usize] = Some(id);
            slot.taken += 1;
        }
        if view.is_whole() {
            for i in parsed.gpus.iter() {
                self.slots[i].whole = Some(id);
            }
        }
        let held = Held {
            missed: 0,
            record: AllocationRecord {
                resource: view.resource_name(&self.config.domain),
                device_ids: sorted,
                allocated_at: now,
                listed: false,
                holder: None,
                claim: None,
            },
            view: view.clone(),
            gpus: parsed.gpus,
            units: parsed.units,
        };
        let grant = self.grant(&held);
        for d in &held.record.device_ids {
            self.by_device.insert(Arc::from(d.as_str()), id);
        }
        self.held.insert(id, Arc::new(held));
        self.records_version += 1;
        self.touched.push(id);
        Ok(grant)
    }

    pub(super) fn check_conflicts(
        &self,
        view: &View,
        ids: &[String],
        parsed: &Parsed,
        superseded: &BTreeSet<u64>,
    ) -> Result<(), Refusal> {
        let conflict = |reason: String| Err(Refusal::Conflict { ids: ids.to_vec(), reason });
        for i in parsed.gpus.iter() {
            let uuid = &self.slots[i].gpu.uuid;
            if !self.slots[i].healthy {
                return conflict(format!("GPU {uuid} is unhealthy"));
            }
            if self.slots[i].reserved {
                return conflict(format!(
                    "GPU {uuid} is held by an allocation that also names a GPU NVML cannot read"
                ));
            }
            if matches!(view, View::Mig(_)) {
                continue;
            }
            if let Some(h) = self.whole_holder(i, superseded) {
                return conflict(format!(
                    "GPU {uuid} is held whole through {} ({})",
                    h.record.resource,
                    h.record.device_ids.join(",")
                ));
            }
            if view.is_whole() {
                let units = self.units_held(i, superseded);
                if units > 0 {
                    return conflict(format!(
                        "GPU {uuid} is shared: {units} gpu-memory units are allocated on it through {}",
                        View::GpuMemory.resource_name(&self.config.domain)
                    ));
                }
            }
        }
        if let View::GpuMemory = view {
            for &(i, n) in &parsed.units {
                if let Some(holder) =
                    self.slots[i].unit_holder[n as usize].filter(|id| !superseded.contains(id))
                {
                    return conflict(format!(
                        "unit {n} of GPU {} is held by another allocation ({holder})",
                        self.slots[i].gpu.uuid
                    ));
                }
            }
        }
        Ok(())
    }

    pub(super) fn release_id(&mut self, id: u64) -> Option<AllocationRecord> {
        let held = self.held.remove(&id)?;
        self.records_version += 1;
        self.touched.push(id);
        if !matches!(held.view, View::Mig(_)) {
            // Recorded together with `held`, so the ledger knows it.
            let _ = self.ledger.release(AllocationId(id));
        }
        for &(i, n) in &held.units {
            let slot = &mut self.slots[i];
            if slot.unit_holder[n as usize].take().is_some() {
                slot.taken = slot.taken.saturating_sub(1);
            }
        }
        for i in held.gpus.iter() {
            if self.slots[i].whole == Some(id) {
                self.slots[i].whole = None;
            }
        }
        for d in &held.record.device_ids {
            if self.by_device.get(d.as_str()) == Some(&id) {
                self.by_device.remove(d.as_str());
            }
        }
        Some(Arc::unwrap_or_clone(held).record)
    }

    /// Releases every allocation for which `keep` is false; returns them.
    pub fn retain(
        &mut self,
        mut keep: impl FnMut(&AllocationRecord) -> bool,
    ) -> Vec<AllocationRecord> {
        let gone: Vec<u64> =
            self.held.iter().filter(|(_, h)| !keep(&h.record)).map(|(&id, _)| id).collect();
        gone.into_iter().filter_map(|id| self.release_id(id)).collect()
    }

    /// Applies one listing of the kubelet's: an allocation `shown` is in it has its consecutive
    /// misses reset; every other one counts one more and is released if `release(record,
    /// misses)` says so. Returns the released allocations.
    pub fn note_listing(
        &mut self,
        mut shown: impl FnMut(&AllocationRecord) -> bool,
        mut release: impl FnMut(&AllocationRecord, u32) -> bool,
    ) -> Vec<AllocationRecord> {
        let mut gone = Vec::new();
        let mut missed = Vec::new();
        for (&id, h) in &self.held {
            if shown(&h.record) {
                if h.missed != 0 {
                    missed.push((id, 0));
                }
                continue;
            }
            let n = h.missed.saturating_add(1);
            missed.push((id, n));
            if release(&h.record, n) {
                gone.push(id);
            }
        }
        // Only the counts that change are written: a shared allocation is copied on write.
        for (id, n) in missed {
            if let Some(h) = self.held.get_mut(&id) {
                Arc::make_mut(h).missed = n;
            }
        }
        gone.into_iter().filter_map(|id| self.release_id(id)).collect()
    }

    /// Marks the allocations for which `listed` is true as seen in the kubelet's list; returns
    /// how many changed.
    pub fn mark_listed(&mut self, mut listed: impl FnMut(&AllocationRecord) -> bool) -> usize {
        let ids: Vec<u64> = self
            .held
            .iter()
            .filter(|(_, h)| !h.record.listed && listed(&h.record))
            .map(|(&id, _)| id)
            .collect();
        for &id in &ids {
            if let Some(h) = self.held.get_mut(&id) {
                Arc::make_mut(h).record.listed = true;
            }
        }
        self.records_version += ids.len() as u64;
        self.touched.extend_from_slice(&ids);
        ids.len()
    }

    /// Records the holder `holder_of` names for each allocation (`None`: left as it is); how many
    /// changed (each a change for the checkpoint).
    pub fn set_holders(
        &mut self,
        mut holder_of: impl FnMut(&AllocationRecord) -> Option<Holder>,
    ) -> usize {
        let changes: Vec<(u64, Holder)> = self
            .held
            .iter()
            .filter_map(|(&id, h)| {
                let holder = holder_of(&h.record)?;
                (h.record.holder.as_ref() != Some(&holder)).then_some((id, holder))
            })
            .collect();
        let changed = changes.len();
        for (id, holder) in changes {
            if let Some(h) = self.held.get_mut(&id) {
                Arc::make_mut(h).record.holder = Some(holder);
                self.touched.push(id);
            }
        }
        self.records_version += changed as u64;
        changed
    }

    /// Allocations of `view` that share a device with `ids`, an exact repeat of `ids` included:
    /// the ones an Allocate of `ids` would replace or repeat. Before granting such an Allocate
    /// the adapter asks the kubelet whether their containers still run.
    pub fn sharing_devices(&self, view: &View, ids: &[String]) -> Vec<AllocationRecord> {
        let sorted = ids_of(ids);
        self.replaced_by(view, &sorted).into_iter().map(|(_, h)| h.record.clone()).collect()
    }

    /// Allocations of `view` sharing a device with `sorted` (sorted device IDs), by ID: looked
    /// up per device, never a scan of the allocations.
    pub(super) fn replaced_by(&self, view: &View, sorted: &[String]) -> Vec<(u64, &Held)> {
        let ids: BTreeSet<u64> =
            sorted.iter().filter_map(|d| self.by_device.get(d.as_str()).copied()).collect();
        ids.into_iter()
            .filter_map(|id| self.held.get(&id).map(|h| (id, &**h)))
            .filter(|(_, h)| h.view == *view)
            .collect()
    }

    /// What the allocations touched since the last call became, against `before` (the ledger
    /// this one was cloned from): the change the checkpoint's journal records. Takes them: the
    /// next call starts afresh.
    pub fn changes_since(&mut self, before: &DeviceLedger) -> Delta {
        let mut touched = std::mem::take(&mut self.touched);
        touched.sort_unstable();
        touched.dedup();
        let mut delta = Delta::default();
        // Parked allocations are only ever added.
        delta.put.extend(self.parked.iter().skip(before.parked.len()).cloned());
        for id in touched {
            match (before.held.get(&id), self.held.get(&id)) {
                (Some(old), None) => delta.removed.push(old.record.key()),
                (None, Some(new)) => delta.put.push(new.record.clone()),
                (Some(old), Some(new)) if old.record != new.record => {
                    delta.put.push(new.record.clone());
                }
                _ => {}
            }
        }
        delta
    }

    /// Forgets the allocations touched so far (a ledger restored before it is first published).
    pub fn forget_changes(&mut self) {
        self.touched.clear();
    }

    /// What an allocation grants, as the isolation module and the kubelet adapter need it.
    pub(super) fn grant(&self, held: &Held) -> Grant {
        let visible: Vec<String> = match &held.view {
            View::Mig(_) => held.record.device_ids.clone(),
            _ => held.gpus.iter().map(|i| self.slots[i].gpu.uuid.to_string()).collect(),
        };
        let share = match (&held.view, held.gpus.iter().next()) {
            (View::GpuMemory, Some(i)) => {
                let units = count(held.units.len());
                Some(Share {
                    gpu_uuid: self.slots[i].gpu.uuid.to_string(),
                    units,
                    gpu_units: self.slots[i].units,
                    bytes: u64::from(units) * self.config.memory_unit_bytes,
                })
            }
            _ => None,
        };
        Grant {
            view: held.view.clone(),
            device_ids: held.record.device_ids.clone(),
            visible,
            share,
        }
    }
}
