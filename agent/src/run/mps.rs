//! The MPS subsystem of the running agent: with MPS on, one supervised control daemon per GPU
//! whose memory units are offered (`crate::isolation::mps::supervisor`); one round of probes and
//! starts runs before the plugins serve, so that the first device lists already offer the units
//! of every GPU whose daemon answers. With MPS off nothing runs, and the start is logged.

use std::sync::Arc;

use tokio_util::sync::CancellationToken;

use super::{AgentConfig, AgentError, Tasks};
use crate::inventory::Inventory;
use crate::isolation::mps::DaemonPlacement;
use crate::isolation::mps::control::CommandControl;
use crate::isolation::mps::supervisor::{Enforcement, Supervisor};
use crate::ledger::DeviceLedger;
use crate::resources::NodeResources;

/// The MPS daemons alone, without serving any resource (`baleen-agent mps`, for a DaemonSet of
/// their own): starts, probes and restarts the daemons of the GPUs whose memory units the
/// configuration offers until `shutdown`, then leaves them serving (`mps.stopOnExit` applies).
/// One instance per MPS root: a second waits for the first's lock.
pub async fn run_alone(
    config: &AgentConfig,
    inventory: &Inventory,
    shutdown: CancellationToken,
) -> Result<(), AgentError> {
    /// Nobody to tell: the agent probes for itself.
    struct Nobody;
    impl Enforcement for Nobody {
        fn set_enforced(&self, _gpu_uuid: &str, _enforced: bool) {}
    }
    let mut mps = config.mps.clone();
    mps.daemons = DaemonPlacement::Agent;
    let gpus = DeviceLedger::new(&config.node_name, inventory, config.views.clone())?.shared_gpus();
    let Some(_lock) = super::lock::acquire(&mps.root, &shutdown).await? else {
        return Ok(());
    };
    tracing::info!(gpus = gpus.len(), root = %mps.root.display(), "supervising the MPS daemons of the shared GPUs");
    let control = Arc::new(CommandControl::new(mps.control_binary.clone()));
    let mut supervisor = Supervisor::new(control, mps, Arc::new(Nobody), &gpus);
    supervisor.round().await;
    supervisor.run(shutdown).await;
    Ok(())
}

/// Starts the supervisor (one round now, then its task) when MPS is on.
pub async fn start(
    tasks: &mut Tasks,
    config: &AgentConfig,
    resources: &Arc<NodeResources>,
    shutdown: &CancellationToken,
) {
    let mps = &config.mps;
    if !mps.enabled {
        return;
    }
    let gpus = resources.shared_gpus();
    if gpus.is_empty() {
        return;
    }
    let control = Arc::new(CommandControl::new(mps.control_binary.clone()));
    let mut supervisor = Supervisor::new(control, mps.clone(), resources.clone(), &gpus);
    supervisor.round().await;
    let token = shutdown.clone();
    tasks.spawn("MPS supervisor", async move {
        supervisor.run(token).await;
        Ok(())
    });
}
