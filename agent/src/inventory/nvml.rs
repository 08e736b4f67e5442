//! The real GPU inventory, read through NVML (`libnvidia-ml.so.1`, which the NVIDIA driver
//! ships) with `nvml-wrapper`. This is the only module of the project that names `nvml_wrapper`;
//! everything it returns is in the domain types of [`super`].
//!
//! What it reads, per GPU (index `0..nvmlDeviceGetCount_v2`):
//!
//! | field | NVML call |
//! |---|---|
//! | driver version | `nvmlSystemGetDriverVersion` |
//! | UUID, name | `nvmlDeviceGetUUID`, `nvmlDeviceGetName` |
//! | memory | `nvmlDeviceGetMemoryInfo_v2` (`total`) |
//! | PCI bus ID | `nvmlDeviceGetPciInfo_v3` (`busId`) |
//! | NUMA node | none: `<sysfs>/bus/pci/devices/<bus id>/numa_node` (see below) |
//! | NVLink peers | `nvmlDeviceGetP2PStatus(NVML_P2P_CAPS_INDEX_NVLINK)` for every pair |
//! | MIG mode | `nvmlDeviceGetMigMode` (`current`) |
//! | MIG instances | `nvmlDeviceGetMaxMigDeviceCount`, `nvmlDeviceGetMigDeviceHandleByIndex`, then per MIG device `nvmlDeviceGetUUID`, `nvmlDeviceGetMemoryInfo_v2`, `nvmlDeviceGetAttributes_v2` (slices and memory, for the profile name), `nvmlDeviceGetGpuInstanceId`, `nvmlDeviceGetComputeInstanceId` |
//! | health | `nvmlDeviceGetSupportedEventTypes`, `nvmlEventSetCreate`, `nvmlDeviceRegisterEvents(XidCriticalError)`, `nvmlEventSetWait_v2` |
//!
//! - NVLink through P2P status rather than per-link remote PCI info: on NVSwitch systems the
//!   remote end of every link is the switch, while the P2P status answers "can these two GPUs
//!   talk over NVLink" directly, for direct links and switches alike.
//! - NUMA from sysfs, not `nvmlDeviceGetNumaNodeId`: that call gives the NUMA node *of the GPU's
//!   memory* on platforms where GPU memory is a NUMA node (Grace Hopper) and is unsupported
//!   elsewhere, while the agent wants the CPU-side node of the GPU's PCI device, which is what
//!   the kernel (and the kubelet's topology manager) use. `-1` or a missing file means `None`.
//! - A call answering `NotSupported` means "none" (no NVLink on a PCIe card, no MIG on an L4, no
//!   XID events on an old GPU), never an error. Any other failure is an
//!   [`NvmlInventoryError::Call`] naming the call and the GPU index.
//! - GPU- and compute-instance IDs have no safe wrapper in nvml-wrapper 0.13; they are the only
//!   raw calls, in `mig_instance_ids`.
//!
//! [`NvmlInventory::new`] loads and initialises NVML once; a missing library or a failing
//! `nvmlInit_v2` is an error that says what was tried and what to install, never an empty node.

use std::collections::BTreeSet;
use std::ffi::OsString;
use std::fmt;
use std::os::raw::c_uint;
use std::path::{Path, PathBuf};
use std::time::Duration;

use nvml_wrapper::bitmasks::event::EventTypes;
use nvml_wrapper::enum_wrappers::device::{P2pCapabilitiesIndex, P2pStatus};
use nvml_wrapper::enums::event::XidError;
use nvml_wrapper::error::{NvmlError, nvml_sym, nvml_try};
use nvml_wrapper::{Device, EventSet, Nvml};

use super::{
    BoxError, Gpu, GpuInventory, GpuProcess, GpuTelemetry, GpuUuid, HealthEvent, HealthWatcher,
    Inventory, InventoryError, MigInstance, MigProfile, MigState, MigUuid, UnreadableGpu,
    normalize_pci_bus_id, pci_sysfs_name,
};

/// The library loaded when none is configured: the name the driver installs, found through the
/// dynamic loader's search path (`ld.so.conf`, `LD_LIBRARY_PATH`).
pub const DEFAULT_LIBRARY: &str = crate::defaults::NVML_LIBRARY;
/// The sysfs mount point read for NUMA nodes when none is configured.
pub const DEFAULT_SYSFS_ROOT: &str = crate::defaults::SYSFS_ROOT;
/// Why the NVML backend failed: the library, one of its calls, or the sysfs files it reads.
#[derive(Debug, thiserror::Error)]
pub enum NvmlInventoryError {
    /// The NVML library could not be loaded.
    #[error(
        "cannot load the NVML library `{library}`: install the NVIDIA driver (it provides \
         libnvidia-ml.so.1; in a container, run with the NVIDIA container toolkit), or give its \
         path with --nvml-lib; on a node without GPUs use --simulated FILE"
    )]
    LibraryNotFound {
        /// The library path or name that was tried.
        library: String,
        /// The loader's error.
        #[source]
        source: BoxError,
    },
    /// The NVML library loaded but did not initialise.
    #[error(
        "NVML (`{library}`) failed to initialise: check that the NVIDIA kernel driver is loaded \
         (`nvidia-smi` works on the host) and that the agent can open /dev/nvidia*"
    )]
    Init {
        /// The library path or name that was loaded.
        library: String,
        /// NVML's error.
        #[source]
        source: BoxError,
    },
    /// An NVML call failed.
    #[error("NVML call {call} failed{}", on_gpu(*gpu_index))]
    Call {
        /// The NVML function, e.g. `nvmlDeviceGetUUID`.
        call: &'static str,
        /// The GPU index it was called for, if any.
        gpu_index: Option<u32>,
        /// NVML's error.
        #[source]
        source: BoxError,
    },
    /// An NVML call returned a value the agent cannot use.
    #[error("NVML call {call} returned an unusable value{}: {detail}", on_gpu(*gpu_index))]
    Value {
        /// The NVML function.
        call: &'static str,
        /// The GPU index it was called for, if any.
        gpu_index: Option<u32>,
        /// What is wrong with the value.
        detail: String,
    },
    /// A sysfs file could not be read.
    #[error("cannot read {}", path.display())]
    Sysfs {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// A sysfs file holds something unexpected.
    #[error("{}:{line}: unexpected content `{content}`: {expected}", path.display())]
    SysfsValue {
        /// The file.
        path: PathBuf,
        /// The line (1-based).
        line: usize,
        /// What was there.
        content: String,
        /// What was expected.
        expected: &'static str,
    },
}

fn on_gpu(gpu_index: Option<u32>) -> String {
    gpu_index.map(|index| format!(" for GPU {index}")).unwrap_or_default()
}

/// `NVML_DEVICE_MIG_ENABLE` from nvml.h.
const MIG_ENABLED: u32 = 1;
/// The XID NVML reports when it cannot tell which XID happened.
const UNKNOWN_XID: u64 = 999;

/// Where the NVML backend finds the host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NvmlConfig {
    /// The NVML library, a path or a bare name for the dynamic loader; `None` means
    /// [`DEFAULT_LIBRARY`].
    pub library: Option<PathBuf>,
    /// Where sysfs is mounted ([`DEFAULT_SYSFS_ROOT`]); tests point it at a temp-dir tree.
    pub sysfs_root: PathBuf,
}

impl Default for NvmlConfig {
    fn default() -> Self {
        Self { library: None, sysfs_root: PathBuf::from(DEFAULT_SYSFS_ROOT) }
    }
}

/// The GPU inventory of this machine, through NVML.
pub struct NvmlInventory {
    nvml: Nvml,
    library: String,
    sysfs_root: PathBuf,
}

impl fmt::Debug for NvmlInventory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NvmlInventory")
            .field("library", &self.library)
            .field("sysfs_root", &self.sysfs_root)
            .finish_non_exhaustive()
    }
}

fn nvml_error(
    call: &'static str,
    gpu_index: Option<u32>,
) -> impl FnOnce(NvmlError) -> InventoryError {
    move |err| NvmlInventoryError::Call { call, gpu_index, source: Box::new(err) }.into()
}

fn bad_value(
    call: &'static str,
    gpu_index: Option<u32>,
    detail: impl fmt::Display,
) -> InventoryError {
    NvmlInventoryError::Value { call, gpu_index, detail: detail.to_string() }.into()
}

/// `Ok(None)` for `NotSupported`, the value otherwise.
fn supported<T>(result: Result<T, NvmlError>) -> Result<Option<T>, NvmlError> {
    match result {
        Ok(value) => Ok(Some(value)),
        Err(NvmlError::NotSupported) => Ok(None),
        Err(err) => Err(err),
    }
}

impl NvmlInventory {
    /// Loads the NVML library and initialises it (`nvmlInit_v2`).
    pub fn new(config: NvmlConfig) -> Result<Self, InventoryError> {
        let library: OsString = match &config.library {
            Some(path) => path.clone().into_os_string(),
            None => OsString::from(DEFAULT_LIBRARY),
        };
        let shown = library.to_string_lossy().into_owned();
        let nvml = Nvml::builder().lib_path(&library).init().map_err(|err| match err {
            // The loader's own error, without nvml-wrapper's wrapper that repeats it.
            NvmlError::LibloadingError(loader) => NvmlInventoryError::LibraryNotFound {
                library: shown.clone(),
                source: Box::new(loader),
            },
            other => NvmlInventoryError::Init { library: shown.clone(), source: Box::new(other) },
        })?;
        Ok(Self { nvml, library: shown, sysfs_root: config.sysfs_root })
    }

    /// The library path or name that was loaded.
    pub fn library(&self) -> &str {
        &self.library
    }

    fn devices(&self) -> Result<Vec<Device<'_>>, InventoryError> {
        let count = self.nvml.device_count().map_err(nvml_error("nvmlDeviceGetCount_v2", None))?;
        (0..count)
            .map(|index| {
                self.nvml
                    .device_by_index(index)
                    .map_err(nvml_error("nvmlDeviceGetHandleByIndex_v2", Some(index)))
            })
            .collect()
    }

    fn read_gpu(&self, index: u32, device: &Device<'_>) -> Result<Gpu, InventoryError> {
        let at = Some(index);
        let uuid = device.uuid().map_err(nvml_error("nvmlDeviceGetUUID", at))?;
        let uuid = GpuUuid::new(uuid).map_err(|err| bad_value("nvmlDeviceGetUUID", at, err))?;
        let name = device.name().map_err(nvml_error("nvmlDeviceGetName", at))?;
        let memory_bytes =
            device.memory_info().map_err(nvml_error("nvmlDeviceGetMemoryInfo_v2", at))?.total;
        let pci = device.pci_info().map_err(nvml_error("nvmlDeviceGetPciInfo_v3", at))?;
        let pci_bus_id = normalize_pci_bus_id(&pci.bus_id)
            .map_err(|err| bad_value("nvmlDeviceGetPciInfo_v3", at, err))?;
        let numa_node = read_numa_node(&self.sysfs_root, &pci_bus_id)?;
        let mig = read_mig(index, device, memory_bytes)?;
        // Informational (a DRA slice's attribute): a driver or library without it is no failure.
        let cuda_compute_capability =
            device.cuda_compute_capability().ok().map(|c| format!("{}.{}", c.major, c.minor));
        Ok(Gpu {
            index,
            uuid,
            name,
            memory_bytes,
            pci_bus_id,
            numa_node,
            cuda_compute_capability,
            nvlink_peers: Vec::new(),
            mig,
        })
    }
}

/// The NUMA node of the PCI device `bus_id` (normalised), from sysfs.
fn read_numa_node(sysfs_root: &Path, bus_id: &str) -> Result<Option<u32>, InventoryError> {
    let path = sysfs_root.join("bus/pci/devices").join(pci_sysfs_name(bus_id)).join("numa_node");
    let text = match std::fs::read_to_string(&path) {
        Ok(text) => text,
        // Kernels built without NUMA support have no such file.
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => return Err(NvmlInventoryError::Sysfs { path, source }.into()),
    };
    let content = text.trim();
    if content == "-1" {
        return Ok(None);
    }
    content.parse::<u32>().map(Some).map_err(|_| {
        NvmlInventoryError::SysfsValue {
            path,
            line: 1,
            content: content.to_owned(),
            expected: "a NUMA node number, or -1 for none",
        }
        .into()
    })
}

fn read_mig(index: u32, device: &Device<'_>, gpu_memory: u64) -> Result<MigState, InventoryError> {
    let at = Some(index);
    let mode = supported(device.mig_mode()).map_err(nvml_error("nvmlDeviceGetMigMode", at))?;
    if mode.is_none_or(|mode| mode.current != MIG_ENABLED) {
        return Ok(MigState::Disabled);
    }
    let slots = supported(device.mig_device_count())
        .map_err(nvml_error("nvmlDeviceGetMaxMigDeviceCount", at))?
        .unwrap_or(0);
    let mut instances = Vec::new();
    for slot in 0..slots {
        let mig = match device.mig_device_by_index(slot) {
            Ok(mig) => mig,
            // An empty slot: no MIG device was created there.
            Err(NvmlError::NotFound) => continue,
            Err(err) => return Err(nvml_error("nvmlDeviceGetMigDeviceHandleByIndex", at)(err)),
        };
        let uuid = mig.uuid().map_err(nvml_error("nvmlDeviceGetUUID", at))?;
        let uuid = MigUuid::new(uuid).map_err(|err| bad_value("nvmlDeviceGetUUID", at, err))?;
        let memory_bytes =
            mig.memory_info().map_err(nvml_error("nvmlDeviceGetMemoryInfo_v2", at))?.total;
        let attributes = mig.attributes().map_err(nvml_error("nvmlDeviceGetAttributes_v2", at))?;
        let (gpu_instance_id, compute_instance_id) =
            mig_instance_ids(&mig).map_err(|(call, err)| nvml_error(call, at)(err))?;
        let profile = MigProfile::from_attributes(
            attributes.gpu_instance_slice_count,
            attributes.compute_instance_slice_count,
            attributes.memory_size_mb,
            gpu_memory,
        );
        instances.push(MigInstance {
            uuid,
            profile: profile.to_string(),
            memory_bytes,
            gpu_instance_id,
            compute_instance_id,
        });
    }
    instances.sort_by_key(|inst| (inst.gpu_instance_id, inst.compute_instance_id));
    Ok(MigState::Enabled { instances })
}

/// The GPU-instance and compute-instance IDs of a MIG device handle.
///
/// nvml-wrapper 0.13 loads `nvmlDeviceGetGpuInstanceId` and `nvmlDeviceGetComputeInstanceId` but
/// offers no safe method for them, so they are called through its raw bindings here.
#[allow(unsafe_code)]
fn mig_instance_ids(mig: &Device<'_>) -> Result<(u32, u32), (&'static str, NvmlError)> {
    const GPU_INSTANCE: &str = "nvmlDeviceGetGpuInstanceId";
    const COMPUTE_INSTANCE: &str = "nvmlDeviceGetComputeInstanceId";
    let lib = mig.nvml().lib();
    let gpu_instance_fn =
        nvml_sym(lib.nvmlDeviceGetGpuInstanceId.as_ref()).map_err(|err| (GPU_INSTANCE, err))?;
    let compute_instance_fn = nvml_sym(lib.nvmlDeviceGetComputeInstanceId.as_ref())
        .map_err(|err| (COMPUTE_INSTANCE, err))?;
    let mut gpu_instance: c_uint = 0;
    let mut compute_instance: c_uint = 0;
    // SAFETY: both functions were resolved from the library that `mig.nvml()` initialised and
    // that stays loaded while `mig` borrows it; their signatures match nvml.h
    // (`nvmlReturn_t f(nvmlDevice_t, unsigned int *)`); `mig.handle()` is a device handle NVML
    // gave out (from `nvmlDeviceGetMigDeviceHandleByIndex`); the out-pointers are valid, aligned
    // and writable for the duration of each call, and NVML keeps neither.
    unsafe {
        nvml_try(gpu_instance_fn(mig.handle(), &mut gpu_instance))
            .map_err(|err| (GPU_INSTANCE, err))?;
        nvml_try(compute_instance_fn(mig.handle(), &mut compute_instance))
            .map_err(|err| (COMPUTE_INSTANCE, err))?;
    }
    Ok((gpu_instance, compute_instance))
}

impl GpuInventory for NvmlInventory {
    fn discover(&self) -> Result<Inventory, InventoryError> {
        let driver_version = supported(self.nvml.sys_driver_version())
            .map_err(nvml_error("nvmlSystemGetDriverVersion", None))?;
        let count = self.nvml.device_count().map_err(nvml_error("nvmlDeviceGetCount_v2", None))?;
        // One GPU that cannot be read does not hide the others: it is reported unreadable (with
        // its UUID when that much answers) and the agent serves the rest.
        let mut gpus = Vec::with_capacity(count as usize);
        let mut devices = Vec::with_capacity(count as usize);
        let mut unreadable = Vec::new();
        for index in 0..count {
            let device = match self.nvml.device_by_index(index) {
                Ok(device) => device,
                Err(e) => {
                    let e = nvml_error("nvmlDeviceGetHandleByIndex_v2", Some(index))(e);
                    let error = crate::error_chain::Chain(&e).to_string();
                    unreadable.push(UnreadableGpu { index, uuid: None, error });
                    continue;
                }
            };
            match self.read_gpu(index, &device) {
                Ok(gpu) => {
                    gpus.push(gpu);
                    devices.push(device);
                }
                Err(e) => {
                    let uuid = device.uuid().ok().and_then(|u| GpuUuid::new(u).ok());
                    let error = crate::error_chain::Chain(&e).to_string();
                    unreadable.push(UnreadableGpu { index, uuid, error });
                }
            }
        }

        // NVLink: one P2P query per unordered pair; the answer is symmetric.
        let mut peers: Vec<BTreeSet<GpuUuid>> = vec![BTreeSet::new(); devices.len()];
        for (i, first) in devices.iter().enumerate() {
            for (j, second) in devices.iter().enumerate().skip(i + 1) {
                let status = supported(first.p2p_status(second, P2pCapabilitiesIndex::NvLink))
                    .map_err(nvml_error("nvmlDeviceGetP2PStatus", Some(gpus[i].index)))?;
                if status == Some(P2pStatus::Ok) {
                    peers[i].insert(gpus[j].uuid.clone());
                    peers[j].insert(gpus[i].uuid.clone());
                }
            }
        }
        for (gpu, peers) in gpus.iter_mut().zip(peers) {
            gpu.nvlink_peers = peers.into_iter().collect();
        }
        Ok(Inventory { driver_version, gpus, unreadable })
    }

    fn processes(&self) -> Result<Vec<GpuProcess>, InventoryError> {
        let mut out = Vec::new();
        for (index, device) in (0u32..).zip(&self.devices()?) {
            let at = Some(index);
            let uuid = device.uuid().map_err(nvml_error("nvmlDeviceGetUUID", at))?;
            let gpu = GpuUuid::new(uuid).map_err(|err| bad_value("nvmlDeviceGetUUID", at, err))?;
            let listed = supported(device.running_compute_processes())
                .map_err(nvml_error("nvmlDeviceGetComputeRunningProcesses_v3", at))?
                .unwrap_or_default();
            out.extend(listed.into_iter().map(|p| GpuProcess {
                gpu: gpu.clone(),
                pid: p.pid,
                used_bytes: match p.used_gpu_memory {
                    nvml_wrapper::enums::device::UsedGpuMemory::Used(bytes) => Some(bytes),
                    nvml_wrapper::enums::device::UsedGpuMemory::Unavailable => None,
                },
            }));
        }
        Ok(out)
    }

    fn probe(&self, gpu: &GpuUuid) -> Result<(), InventoryError> {
        for (index, device) in (0u32..).zip(&self.devices()?) {
            let at = Some(index);
            let uuid = device.uuid().map_err(nvml_error("nvmlDeviceGetUUID", at))?;
            if uuid == gpu.as_str() {
                device.memory_info().map_err(nvml_error("nvmlDeviceGetMemoryInfo_v2", at))?;
                return Ok(());
            }
        }
        Err(bad_value("nvmlDeviceGetUUID", None, format!("no GPU {gpu} any more")))
    }

    fn telemetry(&self) -> Result<Vec<GpuTelemetry>, InventoryError> {
        use nvml_wrapper::enum_wrappers::device::TemperatureSensor;
        let mut out = Vec::new();
        for (index, device) in (0u32..).zip(&self.devices()?) {
            let at = Some(index);
            let uuid = device.uuid().map_err(nvml_error("nvmlDeviceGetUUID", at))?;
            let gpu = GpuUuid::new(uuid).map_err(|err| bad_value("nvmlDeviceGetUUID", at, err))?;
            let memory = supported(device.memory_info())
                .map_err(nvml_error("nvmlDeviceGetMemoryInfo_v2", at))?;
            let rates = supported(device.utilization_rates())
                .map_err(nvml_error("nvmlDeviceGetUtilizationRates", at))?;
            let temperature = supported(device.temperature(TemperatureSensor::Gpu))
                .map_err(nvml_error("nvmlDeviceGetTemperature", at))?;
            let milliwatts = supported(device.power_usage())
                .map_err(nvml_error("nvmlDeviceGetPowerUsage", at))?;
            out.push(GpuTelemetry {
                gpu: Some(gpu),
                memory_used_bytes: memory.map(|m| m.used),
                gpu_utilisation: rates.as_ref().map(|r| f64::from(r.gpu) / 100.0),
                memory_utilisation: rates.as_ref().map(|r| f64::from(r.memory) / 100.0),
                temperature_celsius: temperature,
                power_watts: milliwatts.map(|mw| f64::from(mw) / 1000.0),
            });
        }
        Ok(out)
    }

    fn health_watcher(&self) -> Result<Box<dyn HealthWatcher + '_>, InventoryError> {
        let devices = self.devices()?;
        let mut watched = Vec::new();
        let mut unwatched = Vec::new();
        for (index, device) in (0u32..).zip(&devices) {
            let at = Some(index);
            // A GPU that cannot say who it is or what it reports is left out (it was reported
            // unreadable at discovery); the others are watched.
            let uuid = device.uuid().map_err(nvml_error("nvmlDeviceGetUUID", at)).and_then(|u| {
                GpuUuid::new(u).map_err(|err| bad_value("nvmlDeviceGetUUID", at, err))
            });
            let uuid = match uuid {
                Ok(uuid) => uuid,
                Err(e) => {
                    tracing::warn!(gpu.index = index, error = %crate::error_chain::Chain(&e), "cannot watch this GPU: its UUID cannot be read");
                    continue;
                }
            };
            let types = match supported(device.supported_event_types()) {
                Ok(types) => types.unwrap_or(EventTypes::empty()),
                Err(e) => {
                    let e = nvml_error("nvmlDeviceGetSupportedEventTypes", at)(e);
                    tracing::warn!(gpu.uuid = %uuid, error = %crate::error_chain::Chain(&e), "cannot watch this GPU's XID events");
                    EventTypes::empty()
                }
            };
            if types.contains(EventTypes::CRITICAL_XID_ERROR) {
                watched.push((index, device));
            } else {
                unwatched.push(uuid);
            }
        }
        // On a registration failure nvml-wrapper frees the set: start a new one without the GPU
        // that failed (it is reported as unwatched) rather than watching no GPU at all.
        let set = loop {
            let mut set =
                Some(self.nvml.create_event_set().map_err(nvml_error("nvmlEventSetCreate", None))?);
            let mut failed = None;
            for (position, (index, device)) in watched.iter().enumerate() {
                let Some(current) = set.take() else { break };
                match device.register_events(EventTypes::CRITICAL_XID_ERROR, current) {
                    Ok(next) => set = Some(next),
                    Err(err) => {
                        tracing::warn!(gpu.index = *index, error = %err.error, "cannot watch this GPU's XID events");
                        failed = Some(position);
                        break;
                    }
                }
            }
            match (failed, set) {
                (None, Some(set)) => break set,
                (None, None) => {
                    return Err(NvmlInventoryError::Value {
                        call: "nvmlDeviceRegisterEvents",
                        gpu_index: None,
                        detail: "the event set was lost without an error".into(),
                    }
                    .into());
                }
                (Some(position), _) => {
                    let (index, device) = watched.remove(position);
                    let uuid =
                        device.uuid().map_err(nvml_error("nvmlDeviceGetUUID", Some(index)))?;
                    unwatched.push(
                        GpuUuid::new(uuid)
                            .map_err(|err| bad_value("nvmlDeviceGetUUID", Some(index), err))?,
                    );
                }
            }
        };
        Ok(Box::new(NvmlHealthWatcher { set, unwatched }))
    }
}

/// XID events of every GPU that supports them, from one NVML event set.
struct NvmlHealthWatcher<'nvml> {
    set: EventSet<'nvml>,
    unwatched: Vec<GpuUuid>,
}

impl HealthWatcher for NvmlHealthWatcher<'_> {
    fn unwatched(&self) -> &[GpuUuid] {
        &self.unwatched
    }

    fn next_event(&mut self, timeout: Duration) -> Result<Option<HealthEvent>, InventoryError> {
        let timeout_ms = u32::try_from(timeout.as_millis()).unwrap_or(u32::MAX);
        let data = match self.set.wait(timeout_ms) {
            Ok(data) => data,
            Err(NvmlError::Timeout) => return Ok(None),
            Err(err) => return Err(nvml_error("nvmlEventSetWait_v2", None)(err)),
        };
        if !data.event_type.contains(EventTypes::CRITICAL_XID_ERROR) {
            return Ok(None);
        }
        let xid = match data.event_data {
            Some(XidError::Value(xid)) => xid,
            Some(XidError::Unknown) | None => UNKNOWN_XID,
        };
        let uuid = data.device.uuid().map_err(nvml_error("nvmlDeviceGetUUID", None))?;
        let uuid = GpuUuid::new(uuid).map_err(|err| bad_value("nvmlDeviceGetUUID", None, err))?;
        Ok(Some(HealthEvent::from_xid(uuid, xid)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_library_is_a_clear_error() {
        let config = NvmlConfig {
            library: Some(PathBuf::from("/nonexistent/libnvidia-ml.so.1")),
            ..NvmlConfig::default()
        };
        let err = NvmlInventory::new(config).expect_err("no such library");
        assert!(
            matches!(err, InventoryError::Nvml(NvmlInventoryError::LibraryNotFound { .. })),
            "{err:?}"
        );
        let text = err.to_string();
        assert!(text.contains("/nonexistent/libnvidia-ml.so.1"), "{text}");
        assert!(text.contains("install the NVIDIA driver"), "{text}");
    }

    #[test]
    fn numa_node_comes_from_sysfs() {
        let root = tempfile::tempdir().expect("temp dir");
        let write = |name: &str, content: &str| {
            let dir = root.path().join("bus/pci/devices").join(name);
            std::fs::create_dir_all(&dir).expect("create device dir");
            std::fs::write(dir.join("numa_node"), content).expect("write numa_node");
        };
        write("0000:3b:00.0", "1\n");
        write("0000:5e:00.0", "-1\n");
        write("0000:86:00.0", "lots\n");
        assert_eq!(read_numa_node(root.path(), "00000000:3B:00.0").expect("readable"), Some(1));
        assert_eq!(read_numa_node(root.path(), "00000000:5E:00.0").expect("readable"), None);
        assert_eq!(read_numa_node(root.path(), "00000000:AF:00.0").expect("absent"), None);
        let err = read_numa_node(root.path(), "00000000:86:00.0").expect_err("garbage");
        let text = err.to_string();
        assert!(text.contains("0000:86:00.0/numa_node:1: unexpected content `lots`"), "{text}");
    }
}
