//! An in-memory device-plugin backend for tests and the plugin latency benchmark: `n` devices
//! `dev-0..`, preferring the highest-numbered available ones (so a test can tell the kubelet used
//! the preference), refusing blocked IDs as taken through another resource, and recording what
//! it granted.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use baleen_device_plugin::device::DeviceSnapshot;
use baleen_device_plugin::{
    BackendError, ContainerAllocation, Device, DeviceBackend, DeviceList,
    PreferredAllocationRequest,
};
use tokio::sync::watch;

/// See the module documentation.
pub struct MemoryBackend {
    resource: String,
    devices: watch::Sender<DeviceSnapshot>,
    blocked: Mutex<BTreeSet<String>>,
    granted: Mutex<Vec<Vec<String>>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl MemoryBackend {
    /// `n` healthy devices of `resource`.
    pub fn new(resource: &str, n: usize) -> Arc<Self> {
        let list = (0..n).map(|i| Device::healthy(format!("dev-{i}"))).collect();
        let (devices, _) = watch::channel(Arc::new(DeviceList::new(list)));
        Arc::new(Self {
            resource: resource.into(),
            devices,
            blocked: Mutex::new(BTreeSet::new()),
            granted: Mutex::new(Vec::new()),
        })
    }

    /// Replaces the advertised devices.
    pub fn publish(&self, devices: Vec<Device>) {
        self.devices.send_replace(Arc::new(DeviceList::new(devices)));
    }

    /// From now on Allocate refuses `id` as taken through another resource.
    pub fn block(&self, id: &str) {
        lock(&self.blocked).insert(id.to_owned());
    }

    /// Every granted container's device IDs, in order.
    pub fn granted(&self) -> Vec<Vec<String>> {
        lock(&self.granted).clone()
    }
}

#[async_trait::async_trait]
impl DeviceBackend for MemoryBackend {
    fn resource_name(&self) -> &str {
        &self.resource
    }

    fn devices(&self) -> watch::Receiver<DeviceSnapshot> {
        self.devices.subscribe()
    }

    async fn preferred_allocation(
        &self,
        request: PreferredAllocationRequest,
    ) -> Result<Vec<String>, BackendError> {
        let mut chosen = request.must_include.clone();
        let mut rest: Vec<_> =
            request.available.iter().filter(|id| !chosen.contains(id)).cloned().collect();
        rest.sort_by_key(|id| std::cmp::Reverse(id.clone()));
        chosen.extend(rest.into_iter().take(request.size - chosen.len()));
        Ok(chosen)
    }

    async fn allocate(
        &self,
        containers: Vec<Vec<String>>,
    ) -> Result<Vec<ContainerAllocation>, BackendError> {
        let blocked: Vec<String> = {
            let blocked = lock(&self.blocked);
            containers.iter().flatten().filter(|id| blocked.contains(*id)).cloned().collect()
        };
        if !blocked.is_empty() {
            return Err(BackendError::Conflict {
                ids: blocked,
                reason: "taken through another resource".into(),
            });
        }
        let mut granted = lock(&self.granted);
        Ok(containers
            .into_iter()
            .map(|device_ids| {
                granted.push(device_ids.clone());
                let mut allocation = ContainerAllocation::default();
                allocation.envs.insert("WIDGETS".into(), device_ids.join(","));
                allocation
            })
            .collect())
    }
}
