//! One device plugin per resource view: each binds its socket, registers with the kubelet,
//! serves ListAndWatch from the view's device list and re-registers when the kubelet restarts
//! (all in `baleen-device-plugin`). A plugin that fails stops the agent.

use std::sync::Arc;

use baleen_device_plugin::{DeviceBackend, Plugin, PluginConfig, PluginState};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::{AgentConfig, AgentError, Tasks};
use crate::resources::NodeResources;

/// Spawns one plugin task per view into `tasks`; returns each resource's name and state.
pub fn spawn(
    tasks: &mut Tasks,
    config: &AgentConfig,
    resources: &Arc<NodeResources>,
    shutdown: &CancellationToken,
) -> Vec<(String, watch::Receiver<PluginState>)> {
    let mut plugins = Vec::new();
    for backend in resources.backends() {
        let resource = backend.resource_name().to_owned();
        let plugin = Plugin::new(backend, PluginConfig::new(&config.device_plugin_dir, &resource));
        plugins.push((resource.clone(), plugin.state()));
        let token = shutdown.clone();
        tasks.spawn("device plugin", async move {
            plugin.run(token).await.map_err(|source| AgentError::Plugin { resource, source })
        });
    }
    plugins
}
