//! The real NVML backend against the fake `libnvidia-ml.so.1` (built from
//! `tests/fake-nvml/fake_nvml.c`): for every example topology it must see exactly what the
//! simulated backend sees; XID events become health events; NotSupported means "none"; other
//! failures and a missing library are clear errors.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use baleen_agent::cli::{self, Cli};
use baleen_agent::inventory::nvml::{NvmlConfig, NvmlInventory, NvmlInventoryError};
use baleen_agent::inventory::simulated::SimulatedInventory;
use baleen_agent::inventory::{
    GpuInventory, HealthEvent, HealthWatcher, Inventory, InventoryError, MigProfile, MigState,
    normalize_pci_bus_id,
};
use baleen_tests::fake_nvml::FakeNvml;
use clap::Parser;

const EXAMPLES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../packaging/examples");

fn simulated(name: &str) -> Result<Inventory> {
    let path = Path::new(EXAMPLES).join(name);
    Ok(SimulatedInventory::from_file(&path)?.discover()?)
}

/// NVML through the fake must return the simulated inventory, field for field. Nothing is
/// excluded: the fake serves every field NVML has from the same topology, the NUMA nodes come
/// from the fake's sysfs tree and the driver version from the topology's `driver` line.
fn nvml_matches_simulated(example: &str) -> Result<()> {
    let expected = simulated(example)?;
    let fake = FakeNvml::new(&expected)?;
    let nvml = NvmlInventory::new(fake.nvml_config())?;
    let found = nvml.discover()?;
    assert_eq!(found, expected, "{example}: NVML and simulated inventories differ");
    Ok(())
}

#[test]
fn nvml_sees_the_h200_nvswitch_example_like_the_simulated_backend() -> Result<()> {
    nvml_matches_simulated("h200-8x-nvswitch.yaml")
}

#[test]
fn nvml_sees_the_a100_mig_example_like_the_simulated_backend() -> Result<()> {
    nvml_matches_simulated("a100-4x-mig.yaml")
}

#[test]
fn nvml_sees_the_l4_pairs_example_like_the_simulated_backend() -> Result<()> {
    nvml_matches_simulated("l4-4x-pcie.yaml")
}

/// Waits for the next health event, polling in short NVML waits, for at most `limit`.
fn next_event(watcher: &mut dyn HealthWatcher, limit: Duration) -> Result<HealthEvent> {
    let start = Instant::now();
    loop {
        if let Some(event) = watcher.next_event(Duration::from_millis(200))? {
            return Ok(event);
        }
        ensure!(start.elapsed() < limit, "no health event within {limit:?}");
    }
}

#[test]
fn injected_xids_become_classified_health_events() -> Result<()> {
    let inventory = simulated("l4-4x-pcie.yaml")?;
    let fake = FakeNvml::new(&inventory)?;
    let nvml = NvmlInventory::new(fake.nvml_config())?;
    let mut watcher = nvml.health_watcher()?;
    assert!(watcher.unwatched().is_empty(), "{:?}", watcher.unwatched());
    assert_eq!(watcher.next_event(Duration::from_millis(10))?, None, "no event yet");

    fake.inject_xid(2, 79)?;
    let event = next_event(watcher.as_mut(), Duration::from_secs(10))?;
    assert_eq!(event, HealthEvent { gpu: inventory.gpus[2].uuid.clone(), xid: 79, critical: true });

    fake.inject_xid(0, 31)?;
    let event = next_event(watcher.as_mut(), Duration::from_secs(10))?;
    assert_eq!(
        event,
        HealthEvent { gpu: inventory.gpus[0].uuid.clone(), xid: 31, critical: false }
    );
    Ok(())
}

#[test]
fn gpus_without_xid_events_are_reported_unwatched() -> Result<()> {
    let inventory = simulated("a100-4x-mig.yaml")?;
    let fake =
        FakeNvml::with_directives(&inventory, &["fail nvmlDeviceGetSupportedEventTypes 1 3"])?;
    let nvml = NvmlInventory::new(fake.nvml_config())?;
    let mut watcher = nvml.health_watcher()?;
    assert_eq!(watcher.unwatched(), [inventory.gpus[1].uuid.clone()]);

    // GPU 1 is not registered, so its event is skipped and GPU 3's arrives first.
    fake.inject_xid(1, 48)?;
    fake.inject_xid(3, 48)?;
    let event = next_event(watcher.as_mut(), Duration::from_secs(10))?;
    assert_eq!(event.gpu, inventory.gpus[3].uuid);
    Ok(())
}

#[test]
fn a_gpu_whose_event_registration_fails_is_unwatched_and_the_others_are_watched() -> Result<()> {
    let inventory = simulated("l4-4x-pcie.yaml")?;
    // NVML_ERROR_UNKNOWN (999) registering GPU 2's events; nvml-wrapper frees the set then.
    let fake = FakeNvml::with_directives(&inventory, &["fail nvmlDeviceRegisterEvents 2 999"])?;
    let nvml = NvmlInventory::new(fake.nvml_config())?;
    let mut watcher = nvml.health_watcher()?;
    assert_eq!(watcher.unwatched(), [inventory.gpus[2].uuid.clone()]);
    fake.inject_xid(2, 79)?;
    fake.inject_xid(0, 79)?;
    let event = next_event(watcher.as_mut(), Duration::from_secs(10))?;
    assert_eq!(event.gpu, inventory.gpus[0].uuid, "GPU 0 registered in the rebuilt set");
    Ok(())
}

#[test]
fn not_supported_means_none() -> Result<()> {
    let mut expected = simulated("a100-4x-mig.yaml")?;
    let fake = FakeNvml::with_directives(
        &expected,
        &[
            "fail nvmlDeviceGetP2PStatus * 3",
            "fail nvmlDeviceGetMigMode * 3",
            "fail nvmlDeviceGetCudaComputeCapability * 3",
        ],
    )?;
    let nvml = NvmlInventory::new(fake.nvml_config())?;
    for gpu in &mut expected.gpus {
        gpu.nvlink_peers.clear();
        gpu.mig = MigState::Disabled;
        gpu.cuda_compute_capability = None;
    }
    assert_eq!(nvml.discover()?, expected);
    Ok(())
}

/// A GPU whose reads fail at discovery is reported unreadable (its UUID, the call and the GPU
/// named in the error) and the others are discovered as they are.
#[test]
fn a_gpu_that_cannot_be_read_is_reported_and_the_others_discovered() -> Result<()> {
    let mut inventory = simulated("h200-8x-nvswitch.yaml")?;
    let fake = FakeNvml::with_directives(&inventory, &["fail nvmlDeviceGetName 5 999"])?;
    let nvml = NvmlInventory::new(fake.nvml_config())?;
    let found = nvml.discover()?;
    assert_eq!(found.unreadable.len(), 1, "{:?}", found.unreadable);
    let lost = &found.unreadable[0];
    assert_eq!((lost.index, lost.uuid.as_ref()), (5, Some(&inventory.gpus[5].uuid)));
    assert!(lost.error.contains("NVML call nvmlDeviceGetName failed for GPU 5"), "{}", lost.error);
    // The others, with their NVLink peers among the readable GPUs.
    let gone = inventory.gpus.remove(5).uuid;
    for gpu in &mut inventory.gpus {
        gpu.nvlink_peers.retain(|p| *p != gone);
    }
    assert_eq!(found.gpus, inventory.gpus);
    Ok(())
}

#[test]
fn a_missing_library_is_a_clear_error() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let library = dir.path().join("libnvidia-ml.so.1");
    let config = NvmlConfig { library: Some(library.clone()), ..NvmlConfig::default() };
    let err = NvmlInventory::new(config).expect_err("there is no library");
    assert!(
        matches!(err, InventoryError::Nvml(NvmlInventoryError::LibraryNotFound { .. })),
        "{err:?}"
    );
    let text = err.to_string();
    assert!(text.contains(&library.display().to_string()), "names the path tried: {text}");
    assert!(text.contains("install the NVIDIA driver"), "says what to install: {text}");
    assert!(text.contains("--nvml-lib"), "says what to configure: {text}");
    Ok(())
}

#[test]
fn a_driver_that_does_not_initialise_is_a_clear_error() -> Result<()> {
    let inventory = simulated("l4-4x-pcie.yaml")?;
    let fake = FakeNvml::new(&inventory)?;
    // Without its topology the fake answers nvmlInit_v2 with NVML_ERROR_DRIVER_NOT_LOADED.
    std::fs::remove_file(fake.topology_file())?;
    let err = NvmlInventory::new(fake.nvml_config()).expect_err("init fails");
    assert!(matches!(err, InventoryError::Nvml(NvmlInventoryError::Init { .. })), "{err:?}");
    let text = err.to_string();
    assert!(text.contains(&fake.library().display().to_string()), "{text}");
    assert!(text.contains("NVIDIA kernel driver"), "{text}");
    Ok(())
}

#[test]
fn the_cli_prints_the_nvml_inventory() -> Result<()> {
    let expected = simulated("a100-4x-mig.yaml")?;
    let fake = FakeNvml::new(&expected)?;
    let library = fake.library();
    let sysfs = fake.sysfs_root();
    let args = |output: &str| -> Result<Cli> {
        Ok(Cli::try_parse_from([
            "baleen-agent",
            "inventory",
            "--nvml-lib",
            library.to_str().context("UTF-8 path")?,
            "--sysfs-root",
            sysfs.to_str().context("UTF-8 path")?,
            "--output",
            output,
        ])?)
    };

    let mut json = Vec::new();
    cli::run(args("json")?, &mut json)?;
    let printed: Inventory = serde_json::from_slice(&json)?;
    assert_eq!(printed, expected);

    let mut table = Vec::new();
    cli::run(args("table")?, &mut table)?;
    let table = String::from_utf8(table)?;
    assert!(
        table.lines().next().is_some_and(|l| l.ends_with(", driver 550.127.05, 4 GPUs")),
        "{table}"
    );
    assert!(table.contains("MIG 7g.80gb"), "{table}");
    Ok(())
}

/// On a machine with an NVIDIA GPU and driver:
/// `cargo test -p baleen-tests --test e2e -- --ignored nvml_inventory:: --nocapture`.
#[test]
#[ignore = "needs an NVIDIA GPU and driver"]
fn real_nvml_inventory_is_consistent_and_watchable() -> Result<()> {
    let nvml = NvmlInventory::new(NvmlConfig::default())?;
    let inventory = nvml.discover()?;
    print!("{}", cli::render_table(&inventory));
    ensure!(!inventory.gpus.is_empty(), "NVML reports no GPUs");
    ensure!(inventory.driver_version.is_some(), "NVML reports no driver version");
    for gpu in &inventory.gpus {
        ensure!(gpu.memory_bytes > 0, "GPU {} has no memory", gpu.index);
        ensure!(normalize_pci_bus_id(&gpu.pci_bus_id)? == gpu.pci_bus_id, "{}", gpu.pci_bus_id);
        ensure!(!gpu.nvlink_peers.contains(&gpu.uuid), "GPU {} is its own peer", gpu.index);
        for peer in &gpu.nvlink_peers {
            let back = inventory.gpu(peer).context("an NVLink peer is not on the node")?;
            ensure!(back.nvlink_peers.contains(&gpu.uuid), "NVLink is not symmetric");
        }
        for inst in gpu.mig.instances() {
            ensure!(inst.memory_bytes <= gpu.memory_bytes, "{} is larger than its GPU", inst.uuid);
            inst.profile.parse::<MigProfile>()?;
        }
    }
    assert_eq!(nvml.discover()?, inventory, "discovery is repeatable");

    let mut watcher = nvml.health_watcher()?;
    println!("GPUs without XID events: {:?}", watcher.unwatched());
    // An idle healthy GPU usually reports nothing; an event is shown, not failed on.
    if let Some(event) = watcher.next_event(Duration::from_secs(1))? {
        println!("health event: {event:?}");
    }
    Ok(())
}
