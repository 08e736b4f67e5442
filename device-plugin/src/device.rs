//! Devices as a plugin advertises them, and the device list a backend publishes through a
//! `tokio::sync::watch` channel. The list carries an index by ID so that the service can check
//! the IDs of every request in constant time.

use std::collections::HashMap;
use std::sync::Arc;

/// Whether the kubelet may allocate a device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Health {
    /// Allocatable.
    Healthy,
    /// Advertised but not allocatable (broken, or taken through another view of the same GPU).
    Unhealthy,
}

impl Health {
    /// The string the device-plugin API uses.
    pub fn as_str(self) -> &'static str {
        match self {
            Health::Healthy => baleen_proto::deviceplugin::v1beta1::HEALTHY,
            Health::Unhealthy => baleen_proto::deviceplugin::v1beta1::UNHEALTHY,
        }
    }
}

/// One advertised device.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Device {
    /// The device ID the kubelet hands back in Allocate.
    pub id: String,
    /// Allocatable or not.
    pub health: Health,
    /// NUMA node of the device, for the kubelet's topology manager.
    pub numa_node: Option<u32>,
}

impl Device {
    /// A healthy device without NUMA affinity.
    pub fn healthy(id: impl Into<String>) -> Self {
        Self { id: id.into(), health: Health::Healthy, numa_node: None }
    }
}

/// The complete device list of one resource, in advertised order, indexed by ID.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeviceList {
    devices: Vec<Device>,
    index: HashMap<String, usize>,
}

impl DeviceList {
    /// Builds the list. A repeated ID keeps its first entry (the kubelet would count it once).
    pub fn new(devices: Vec<Device>) -> Self {
        let mut index = HashMap::with_capacity(devices.len());
        let mut kept = Vec::with_capacity(devices.len());
        for device in devices {
            if !index.contains_key(&device.id) {
                index.insert(device.id.clone(), kept.len());
                kept.push(device);
            }
        }
        Self { devices: kept, index }
    }

    /// The devices, in advertised order.
    pub fn devices(&self) -> &[Device] {
        &self.devices
    }

    /// The device with this ID, if advertised.
    pub fn get(&self, id: &str) -> Option<&Device> {
        self.index.get(id).map(|&i| &self.devices[i])
    }

    /// Number of devices.
    pub fn len(&self) -> usize {
        self.devices.len()
    }

    /// Whether no device is advertised.
    pub fn is_empty(&self) -> bool {
        self.devices.is_empty()
    }
}

/// What a backend publishes: a shared, immutable snapshot per change.
pub type DeviceSnapshot = Arc<DeviceList>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn index_finds_devices_and_drops_repeats() {
        let list = DeviceList::new(vec![
            Device::healthy("a"),
            Device { id: "b".into(), health: Health::Unhealthy, numa_node: Some(1) },
            Device::healthy("a"),
        ]);
        assert_eq!(list.len(), 2);
        assert_eq!(list.get("b").map(|d| d.health), Some(Health::Unhealthy));
        assert_eq!(list.get("a").map(|d| d.health), Some(Health::Healthy));
        assert!(list.get("c").is_none());
        assert_eq!(Health::Unhealthy.as_str(), "Unhealthy");
    }
}
