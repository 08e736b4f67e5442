//! Start-up: read the boot ID, discover the GPUs, build the device ledger, restore it from the
//! checkpoint when that is trusted (same node, same boot, intact), and reconcile once with the
//! kubelet's pod-resources API before anything is served. Without a trusted checkpoint that
//! reconciliation is waited for: the kubelet is then the only record of running containers.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::reconciler::{ReconcileFailure, reconcile_once};
use super::{AgentConfig, AgentError, Dependencies};
use baleen_device_plugin::PluginConfig;

use crate::checkpoint::{Checkpoint, read_boot_id};
use crate::error_chain::Chain;
use crate::ledger::DeviceLedger;
use crate::resources::NodeResources;

/// How long the first pod-resources `List` may take.
const FIRST_LIST_TIMEOUT: Duration = Duration::from_secs(2);
/// How often a wait for the kubelet says it still waits.
pub const STILL_WAITING_EVERY: std::time::Duration = std::time::Duration::from_secs(30);

/// Time between tries while waiting for pod-resources.
const RETRY: Duration = Duration::from_secs(1);

/// Longest path a Unix socket address holds (`sun_path` is 108 bytes with its final NUL).
pub const MAX_SOCKET_PATH: usize = 107;

/// Every socket the agent binds or dials fits in a socket address; otherwise a configuration
/// error naming each path, before anything is bound (binding would fail later, and vaguely).
fn check_socket_paths(config: &AgentConfig, ledger: &DeviceLedger) -> Result<(), AgentError> {
    let domain = &ledger.config().domain;
    let mut paths = vec![config.pod_resources_socket.clone()];
    match &config.driver {
        crate::dra::DriverMode::DevicePlugin => {
            for view in ledger.views() {
                let resource = view.resource_name(domain);
                let plugin = PluginConfig::new(&config.device_plugin_dir, &resource);
                paths.push(plugin.socket_path());
                paths.push(plugin.kubelet_socket());
            }
        }
        crate::dra::DriverMode::Dra(dra) => {
            paths.push(dra.socket());
            paths.push(dra.registration_socket());
        }
    }
    let long: Vec<PathBuf> =
        paths.into_iter().filter(|p| p.as_os_str().len() > MAX_SOCKET_PATH).collect();
    if long.is_empty() { Ok(()) } else { Err(AgentError::SocketPathsTooLong { paths: long }) }
}

/// The node's resources, restored and reconciled, with the checkpoint written.
pub async fn restore(
    config: &AgentConfig,
    deps: &Dependencies,
    shutdown: &CancellationToken,
) -> Result<Arc<NodeResources>, AgentError> {
    let boot_id = read_boot_id(&config.boot_id_file)
        .map_err(|source| AgentError::BootId { path: config.boot_id_file.clone(), source })?;
    let discovered = {
        let inventory = deps.inventory.clone();
        // NVML can hang (a GPU fallen off the bus): a stop during discovery stops the agent.
        let discovering = tokio::task::spawn_blocking(move || inventory.discover());
        tokio::select! {
            found = discovering => {
                found.map_err(|source| AgentError::Task { task: "GPU discovery", source })??
            }
            () = shutdown.cancelled() => return Err(AgentError::StoppedBeforeStart),
        }
    };
    tracing::info!(
        node = config.node_name,
        gpus = discovered.gpus.len(),
        driver = discovered.driver_version.as_deref().unwrap_or("unknown"),
        "GPUs discovered"
    );
    for u in &discovered.unreadable {
        tracing::error!(
            gpu.index = u.index,
            gpu.uuid = u.uuid.as_ref().map(ToString::to_string),
            error = u.error,
            "GPU cannot be read: it is not offered, what is held on it stays held; the other GPUs are served"
        );
    }
    let mut ledger = DeviceLedger::new(&config.node_name, &discovered, config.views.clone())?;
    check_socket_paths(config, &ledger)?;
    if config.mps.enabled {
        // Units are offered once their GPU's MPS daemon answers (the MPS subsystem).
        ledger.require_enforced_shares();
    } else {
        tracing::warn!(
            "MPS is off (mps.enabled: false): gpu-memory units are accounting only, no limit is enforced; every Allocate answer says so (BALEEN_GPU_SHARING=accounting-only)"
        );
    }
    let dra = matches!(config.driver, crate::dra::DriverMode::Dra(_));
    let checkpoint = Checkpoint::in_dir(&config.state_dir);
    let read = checkpoint.read();
    // Whatever its boot, an intact checkpoint of this node says what the device IDs the kubelet
    // holds meant: refuse a configuration under which they would mean something else.
    if let Ok(Some(contents)) = &read
        && contents.node == config.node_name
    {
        let mut problems = ledger.meaning_changes(&contents.layout, &contents.allocations);
        problems.extend(mode_changes(dra, &contents.allocations));
        if !problems.is_empty() {
            return Err(AgentError::HeldDevicesChanged {
                checkpoint: checkpoint.path().to_path_buf(),
                problems,
            });
        }
    }
    // A DRA driver's claims outlive a reboot (the kubelet keeps its own record of prepared
    // claims and does not prepare them again): its checkpoint is trusted whatever its boot.
    let verified = read.and_then(|contents| match contents {
        Some(c) => {
            let boot = if dra { c.boot_id.clone() } else { boot_id.clone() };
            checkpoint.verify(&c, &config.node_name, &boot).map(|()| Some(c))
        }
        None => Ok(None),
    });
    if dra && let Err(e) = &verified {
        // Nothing else records the claims prepared here: serving an empty ledger would hand
        // their GPUs out again.
        return Err(AgentError::DraCheckpointUntrusted {
            checkpoint: checkpoint.path().to_path_buf(),
            reason: Chain(e).to_string(),
        });
    }
    let restored = match verified {
        Ok(Some(contents)) => {
            let refused = ledger.restore_from(&contents.allocations, &contents.layout);
            if !refused.is_empty() {
                // Dropping them would hand the devices of running containers out again.
                return Err(AgentError::HeldDevicesChanged {
                    checkpoint: checkpoint.path().to_path_buf(),
                    problems: refused
                        .iter()
                        .map(|(r, why)| format!("{} {:?}: {why}", r.resource, r.device_ids))
                        .collect(),
                });
            }
            tracing::info!(
                allocations = contents.allocations.len(),
                checkpoint = %checkpoint.path().display(),
                "ledger restored from the checkpoint"
            );
            Some(contents.sequence.unwrap_or(0))
        }
        Ok(None) => {
            tracing::info!(checkpoint = %checkpoint.path().display(), "no checkpoint");
            None
        }
        Err(e) => {
            tracing::warn!(error = %Chain(&e), "checkpoint not trusted; rebuilding the ledger from pod-resources");
            None
        }
    };
    if dra {
        // No pod-resources list to wait for: the checkpoint (or, on a first start, nothing) is
        // the whole truth of a DRA driver's claims.
        let restored = restored.or(Some(0));
        let resources = NodeResources::new(
            ledger,
            checkpoint,
            config.node_name.clone(),
            boot_id,
            None,
            crate::resources::ResponseConfig {
                devices: config.devices.clone(),
                mps: config.mps.clone(),
            },
            restored,
        );
        resources.persist()?;
        return Ok(resources);
    }
    let trusted = restored.is_some();
    let resources = NodeResources::new(
        ledger,
        checkpoint,
        config.node_name.clone(),
        boot_id,
        Some(config.pod_resources_socket.clone()),
        crate::resources::ResponseConfig {
            devices: config.devices.clone(),
            mps: config.mps.clone(),
        },
        restored,
    );
    let grace = config.reconcile_grace.as_secs();
    // Without a trusted checkpoint the ledger knows nothing of the containers running on the
    // node (after a reboot the kubelet restarts them without calling Allocate): serving now
    // could hand their GPUs out again through another view. Wait for pod-resources first.
    let mut waiting_since: Option<std::time::Instant> = None;
    let mut said_at = std::time::Instant::now();
    loop {
        // The kubelet may have just started too: nothing it listed before is released here.
        let witness = crate::reconcile::Witness::settling();
        match reconcile_once(
            &resources,
            &config.pod_resources_socket,
            FIRST_LIST_TIMEOUT,
            grace,
            &witness,
        )
        .await
        {
            Ok(_) => break,
            Err(ReconcileFailure::NotSaved(e)) => return Err(e.into()),
            Err(ReconcileFailure::Unreachable(e)) if trusted => {
                tracing::warn!(error = %Chain(&e), "cannot reconcile with the kubelet yet; serving from the checkpoint and retrying");
                break;
            }
            Err(ReconcileFailure::Unreachable(e)) => {
                match waiting_since {
                    None => {
                        tracing::warn!(
                            error = %Chain(&e),
                            "no kubelet answers at {}: start the kubelet (or, on a simulated node, the fake kubelet: cargo run -p baleen-tests --example fake-kubelet -- --help); the agent waits for its pod-resources API before serving, since without a trusted checkpoint it is the only record of running containers",
                            config.pod_resources_socket.display()
                        );
                        waiting_since = Some(std::time::Instant::now());
                        said_at = std::time::Instant::now();
                    }
                    Some(since) if said_at.elapsed() >= STILL_WAITING_EVERY => {
                        tracing::warn!(
                            "still waiting for the kubelet at {} ({} s)",
                            config.pod_resources_socket.display(),
                            since.elapsed().as_secs()
                        );
                        said_at = std::time::Instant::now();
                    }
                    Some(_) => {}
                }
                if !crate::retry::sleep_or_stop(RETRY, shutdown).await {
                    break;
                }
            }
        }
    }
    if !resources.persist()? {
        // Stopped while waiting: the empty ledger is not written, so that the next start waits
        // for the kubelet again instead of trusting it.
        tracing::info!("stopped before the ledger was reconciled; checkpoint left as it was");
    }
    Ok(resources)
}

/// What a checkpoint written in the other mode holds that this mode cannot serve: device-plugin
/// grants on a node now served as a DRA driver, or claims on one now served by device plugins
/// (one mode per node: drain it before switching).
fn mode_changes(dra: bool, records: &[crate::ledger::AllocationRecord]) -> Vec<String> {
    records
        .iter()
        .filter(|r| r.claim.is_some() != dra)
        .map(|r| match &r.claim {
            Some(c) => format!(
                "DRA claim {}/{} (UID {}) holds {} {:?}, but the node is served by device plugins \
                 now (driver: device-plugin): drain the node before switching modes",
                c.namespace, c.name, c.uid, r.resource, r.device_ids
            ),
            None => format!(
                "a device-plugin container holds {} {:?}, but the node is served as a DRA driver \
                 now (driver: dra): drain the node before switching modes",
                r.resource, r.device_ids
            ),
        })
        .collect()
}
