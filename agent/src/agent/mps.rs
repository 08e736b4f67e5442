//! The MPS subsystem of the running agent: with MPS on, one supervised control daemon per GPU
//! whose memory units are offered (`crate::isolation::mps::supervisor`); one round of probes and
//! starts runs before the plugins serve, so that the first device lists already offer the units
//! of every GPU whose daemon answers. With MPS off nothing runs, and the start is logged.

use std::sync::Arc;

use tokio_util::sync::CancellationToken;

use super::{AgentConfig, Tasks};
use crate::isolation::mps::control::CommandControl;
use crate::isolation::mps::supervisor::Supervisor;
use crate::resources::NodeResources;

/// Starts the supervisor (one round now, then its task) when MPS is on.
pub async fn start(
    tasks: &mut Tasks,
    config: &AgentConfig,
    resources: &Arc<NodeResources>,
    shutdown: &CancellationToken,
) {
    let mps = &config.responses.mps;
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
