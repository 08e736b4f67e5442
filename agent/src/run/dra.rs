//! The DRA mode's tasks (`driver: dra`, in place of the device plugins and the pod-resources
//! reconciler): the DRAPlugin service on `<pluginDir>/dra.sock` (tonic), the registration
//! socket the kubelet's plugin watcher finds (`baleen-dra`'s own HTTP/2 responder), and the
//! publisher of the node's ResourceSlices, which republishes whenever the ledger's devices
//! change (health, MPS enforcement) and whenever the slices on the API server differ from
//! them (the kubelet deletes every slice of its node when it starts), checked at every watch
//! event and every [`RESYNC`].
//!
//! Before serving, the CDI spec of every claim the ledger holds is written again (a tmpfs
//! `/var/run` loses them at a reboot, and the kubelet does not prepare a claim in use again),
//! and the specs of claims the ledger does not hold are removed.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use baleen_device_plugin::PluginState;
use baleen_dra::cdi::SpecDir;
use baleen_dra::service::{self, Bookings as _, Preparer};
use baleen_dra::slices::{self, Owner};
use futures::StreamExt as _;
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1::ResourceSlice;
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use kube::runtime::watcher;
use tokio_util::sync::CancellationToken;

use super::{AgentConfig, AgentError, Tasks};
use crate::dra::{ApiClaims, DraConfig, LedgerBookings, node_devices};
use crate::error_chain::Chain;
use crate::isolation::devices::DeviceLister;
use crate::resources::NodeResources;

/// The most time between two checks of the published slices against the ledger.
pub const RESYNC: Duration = Duration::from_secs(30);
/// The least time between two checks (a burst of watch events is one check).
const DEBOUNCE: Duration = Duration::from_millis(200);

/// Starts the DRA service, its registration and the slice publisher; returns the driver's
/// name with its registration's state (as a device plugin's: `Registered` once the kubelet
/// said so, counted; `Refused` with its reason), for `/readyz` and `Agent::plugins`.
pub fn start(
    tasks: &mut Tasks,
    config: &AgentConfig,
    dra: &DraConfig,
    resources: &Arc<NodeResources>,
    client: kube::Client,
    shutdown: &CancellationToken,
) -> Result<super::PluginWatch, AgentError> {
    let (_, targets) = node_devices(&resources.published().state);
    let bookings = Arc::new(LedgerBookings::new(
        resources.clone(),
        targets,
        config.mps.clone(),
        DeviceLister::new(config.devices.clone()),
    ));
    let specs = SpecDir::new(&dra.cdi_dir, dra.cdi_kind());
    restore_specs(resources, &bookings, &specs);
    std::fs::create_dir_all(&dra.plugin_dir)
        .map_err(|source| AgentError::Dra { what: "creating the plugin directory", source })?;
    let preparer = Preparer::new(
        &dra.driver_name,
        &config.node_name,
        ApiClaims::new(client.clone()),
        bookings,
        specs,
    );
    let (health, watched_health) = tokio::sync::watch::channel(device_health(resources));
    let follower = resources.clone();
    let token = shutdown.clone();
    tasks.spawn("dra health", async move {
        let mut state = follower.watch_state();
        loop {
            tokio::select! {
                () = token.cancelled() => return Ok(()),
                changed = state.changed() => if changed.is_err() { return Ok(()) },
            }
            let now = device_health(&follower);
            health.send_if_modified(|h| {
                let changed = *h != now;
                *h = now;
                changed
            });
        }
    });
    let health = service::HealthService::new(&config.node_name, watched_health, shutdown.clone());
    let serving = service::serve(&dra.socket(), Arc::new(preparer), Some(health), shutdown.clone())
        .map_err(|source| AgentError::Dra { what: "binding the DRA service socket", source })?;
    tasks.spawn("dra service", async move {
        serving.await.map_err(|e| AgentError::Dra {
            what: "serving the DRA service socket",
            source: std::io::Error::other(Chain(&e).to_string()),
        })
    });
    let (registration, mut verdict) =
        baleen_dra::registration::Registration::new(&dra.driver_name, &dra.socket());
    let (state, watched) = tokio::sync::watch::channel(PluginState::WaitingForKubelet {
        attempts: 0,
        last_error: "the kubelet has not registered the driver yet".into(),
    });
    let token = shutdown.clone();
    tasks.spawn("dra registration state", async move {
        let (mut registrations, mut refusals) = (0_u64, 0_u32);
        loop {
            tokio::select! {
                () = token.cancelled() => break,
                changed = verdict.changed() => if changed.is_err() { break },
            }
            let Some(v) = verdict.borrow_and_update().clone() else { continue };
            if v.registered {
                registrations += 1;
                state.send_replace(PluginState::Registered { registrations });
            } else {
                refusals += 1;
                state.send_replace(PluginState::Refused { attempts: refusals, reason: v.error });
            }
        }
        state.send_replace(PluginState::Stopped);
        Ok(())
    });
    let registry_socket = dra.registration_socket();
    let token = shutdown.clone();
    tasks.spawn("dra registration", async move {
        let serving =
            baleen_dra::registration::serve(&registry_socket, registration, token).await.map_err(
                |source| AgentError::Dra { what: "binding the registration socket", source },
            )?;
        serving.await;
        Ok(())
    });
    let publisher = Publisher {
        api: Api::all(client.clone()),
        nodes: Api::all(client),
        driver: dra.driver_name.clone(),
        node: config.node_name.clone(),
        resources: resources.clone(),
    };
    let token = shutdown.clone();
    tasks.spawn("dra slices", async move {
        publisher.run(token).await;
        Ok(())
    });
    tracing::info!(
        driver = dra.driver_name,
        socket = %dra.socket().display(),
        registration = %dra.registration_socket().display(),
        "serving the node as a DRA driver"
    );
    Ok((dra.driver_name.clone(), watched))
}

/// Every device's health as the slices see it, with why where it is not healthy: the GPU's
/// reason (an XID, unreadable, ...), or its MPS daemon not answering.
fn device_health(resources: &NodeResources) -> Vec<service::DeviceHealth> {
    let published = resources.published();
    let (devices, _) = node_devices(&published.state);
    let enforced: BTreeMap<String, bool> =
        published.state.gpu_states().into_iter().map(|g| (g.uuid, g.shares_enforced)).collect();
    devices
        .into_iter()
        .map(|d| {
            let gpu = match &d.kind {
                slices::DeviceKind::Mig { parent_uuid, .. } => parent_uuid.clone(),
                _ => d.uuid.clone(),
            };
            let message = if d.healthy {
                String::new()
            } else if let Some(why) = published.unhealthy.get(&gpu) {
                why.clone()
            } else if enforced.get(&gpu) == Some(&false) {
                "its MPS daemon does not answer: no memory limit on it can be enforced".into()
            } else {
                "unhealthy".into()
            };
            service::DeviceHealth { device: d.name, healthy: d.healthy, message }
        })
        .collect()
}

/// Writes the CDI spec of every claim the ledger holds and removes those of claims it does not.
fn restore_specs(resources: &NodeResources, bookings: &LedgerBookings, specs: &SpecDir) {
    let mut held: Vec<String> =
        resources.records().into_iter().filter_map(|r| r.claim.map(|c| c.uid)).collect();
    held.sort();
    held.dedup();
    for uid in &held {
        let Some(booked) = bookings.booked(uid) else { continue };
        let edits: Vec<_> = booked.iter().map(|b| (b.device.clone(), b.edits.clone())).collect();
        match specs.write(uid, &edits) {
            Ok(_) => tracing::debug!(claim = uid, "CDI spec of a prepared claim written again"),
            Err(e) => {
                tracing::error!(claim = uid, error = %Chain(&e), "cannot write the CDI spec of a prepared claim: its containers cannot start again until it is")
            }
        }
    }
    match specs.claims() {
        Ok(found) => {
            for uid in found.iter().filter(|u| held.binary_search(u).is_err()) {
                match specs.remove(uid) {
                    Ok(_) => {
                        tracing::info!(claim = uid, "CDI spec of a claim not prepared here removed")
                    }
                    Err(e) => {
                        tracing::warn!(claim = uid, error = %Chain(&e), "cannot remove a stale CDI spec")
                    }
                }
            }
        }
        Err(e) => tracing::warn!(error = %Chain(&e), "cannot list the CDI directory"),
    }
}

/// What the publisher last wrote: the devices, and each slice's spec as the server answered.
struct Written {
    devices: Vec<baleen_dra::slices::NodeDevice>,
    stored: BTreeMap<String, k8s_openapi::api::resource::v1::ResourceSliceSpec>,
    /// Whether the server dropped fields of what was written (said once).
    dropped: bool,
}

/// Publishes the node's slices and keeps them as the ledger says.
struct Publisher {
    api: Api<ResourceSlice>,
    nodes: Api<Node>,
    driver: String,
    node: String,
    resources: Arc<NodeResources>,
}

impl Publisher {
    fn selector(&self) -> String {
        format!("spec.nodeName={},spec.driver={}", self.node, self.driver)
    }

    async fn run(self, shutdown: CancellationToken) {
        let owner = loop {
            match self.nodes.get(&self.node).await {
                Ok(n) => {
                    break Owner {
                        node_name: self.node.clone(),
                        node_uid: n.metadata.uid.unwrap_or_default(),
                    };
                }
                Err(e) => {
                    tracing::warn!(node = self.node, error = %Chain(&e), "cannot read the node (the slices' owner); retrying");
                    if !crate::retry::sleep_or_stop(Duration::from_secs(2), &shutdown).await {
                        return;
                    }
                }
            }
        };
        let config = watcher::Config::default().fields(&self.selector());
        let mut events = watcher::watcher(self.api.clone(), config).boxed();
        let mut state = self.resources.watch_state();
        let mut generation = 0_i64;
        let mut written: Option<Written> = None;
        loop {
            match self.sync(&owner, &mut generation, &mut written).await {
                Ok(changed) if changed => tracing::info!(generation, "ResourceSlices published"),
                Ok(_) => {}
                Err(e) => {
                    // Written again in whole at the next try.
                    written = None;
                    tracing::warn!(error = e, "cannot publish the ResourceSlices; retrying");
                }
            }
            loop {
                let ledger_changed = tokio::select! {
                    () = shutdown.cancelled() => return,
                    changed = state.changed() => { let _ = changed; true }
                    _ = events.next() => false,
                    () = tokio::time::sleep(RESYNC) => false,
                };
                // A change of the allocations alone leaves the devices as they were: no call.
                let devices = node_devices(&self.resources.published().state).0;
                if !ledger_changed || written.as_ref().is_none_or(|w| w.devices != devices) {
                    break;
                }
            }
            if !crate::retry::sleep_or_stop(DEBOUNCE, &shutdown).await {
                return;
            }
        }
    }

    /// Makes the API server's slices of this node and driver the ledger's; whether anything
    /// was written.
    /// Makes the API server's slices of this node and driver the ledger's; whether anything
    /// was written. Slices are written when the devices changed since the last write, or when
    /// the server's slices are not what it answered to that write (one deleted, say by the
    /// kubelet at its start, or changed by someone else): never because the server stores them
    /// differently from what was sent (an API server without the DRAConsumableCapacity gate
    /// drops the shared devices' fields; that is said once, not rewritten every resync).
    async fn sync(
        &self,
        owner: &Owner,
        generation: &mut i64,
        memory: &mut Option<Written>,
    ) -> Result<bool, String> {
        let (devices, _) = node_devices(&self.resources.published().state);
        let listed = self
            .api
            .list(&ListParams::default().fields(&self.selector()))
            .await
            .map_err(|e| Chain(&e).to_string())?;
        let mut existing: BTreeMap<String, ResourceSlice> =
            listed.items.into_iter().filter_map(|s| Some((s.metadata.name.clone()?, s))).collect();
        let unchanged = memory.as_ref().is_some_and(|m| {
            m.devices == devices
                && m.stored.len() == existing.len()
                && m.stored
                    .iter()
                    .all(|(name, spec)| existing.get(name).is_some_and(|e| e.spec == *spec))
        });
        if unchanged {
            return Ok(false);
        }
        // A generation above every one seen: a pool's newest generation is the one counted.
        let seen = existing.values().map(|s| s.spec.pool.generation).max().unwrap_or(0);
        *generation = (*generation).max(seen) + 1;
        let desired =
            slices::build(&self.driver, owner, *generation, &devices).map_err(|e| e.to_string())?;
        let mut stored = BTreeMap::new();
        let mut dropped = false;
        for d in &desired {
            let name = d.metadata.name.clone().unwrap_or_default();
            let answer = match existing.remove(&name) {
                Some(old) => {
                    let mut next = d.clone();
                    next.metadata.resource_version = old.metadata.resource_version;
                    self.api
                        .replace(&name, &PostParams::default(), &next)
                        .await
                        .map_err(|e| format!("replacing {name}: {}", Chain(&e)))?
                }
                None => self
                    .api
                    .create(&PostParams::default(), d)
                    .await
                    .map_err(|e| format!("creating {name}: {}", Chain(&e)))?,
            };
            dropped |= answer.spec != d.spec;
            stored.insert(name, answer.spec);
        }
        for name in existing.keys() {
            self.api
                .delete(name, &DeleteParams::default())
                .await
                .map_err(|e| format!("deleting {name}: {}", Chain(&e)))?;
        }
        if dropped && memory.as_ref().is_none_or(|m| !m.dropped) {
            tracing::warn!(
                "the API server stores the ResourceSlices differently from what was written: it \
                 dropped fields it does not serve. If allowMultipleAllocations and the memory \
                 requestPolicy are gone, its DRAConsumableCapacity gate is off (alpha before \
                 1.36) and every claim takes a GPU whole (docs/dra.md)"
            );
        }
        *memory = Some(Written { devices, stored, dropped });
        Ok(true)
    }
}
