//! A kubelet's DRA side, as the real one behaves towards a DRA driver (kubelet 1.34:
//! `pkg/kubelet/pluginmanager` and `pkg/kubelet/cm/dra`):
//!
//! - at its start it deletes every ResourceSlice of its node (the drivers republish);
//! - its plugin watcher finds `*.sock` in the registry directory and registers each with a gRPC
//!   C-core client (Python `grpcio`, as grpc-go does: the `:authority` is the socket path
//!   percent-encoded), asks `GetInfo`, validates it (type `DRAPlugin`, a service version it
//!   speaks, an absolute endpoint that exists) and answers `NotifyRegistrationStatus`; a socket
//!   that comes back (the plugin restarted) is registered again;
//! - it prepares a pod's claims in one `NodePrepareResources` batch (v1, or v1beta1 when that is
//!   all the plugin offers) with a 45 s deadline, requires one entry per claim UID and no error,
//!   and keeps what it prepared (its own checkpoint): a claim already prepared is not prepared
//!   again, after a plugin restart or for a second pod sharing it;
//! - at a pod's end it unprepares the claims no other running pod uses, retrying until the
//!   plugin answers without error.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use anyhow::{Context as _, Result, anyhow, bail, ensure};
use baleen_proto::dra::{v1, v1beta1};
use baleen_proto::pluginregistration::v1 as reg;
use prost::Message as _;
use tokio_util::sync::CancellationToken;

/// The kubelet's deadline for one Prepare or Unprepare call.
pub const DEADLINE: Duration = Duration::from_secs(45);

/// One unary call through gRPC C-core (Python grpcio, Debian's `python3-grpcio`) on `socket`
/// with the `:authority` grpc-go sends for it (the path percent-encoded); the answer's bytes.
pub fn c_core_call(socket: &Path, method: &str, request: &[u8]) -> Result<Vec<u8>> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../dra/tests/grpc_c_core_call.py");
    let hex: String = request.iter().map(|b| format!("{b:02x}")).collect();
    let out = Command::new("/usr/bin/python3")
        .arg(&script)
        .arg(socket)
        .arg(method)
        .arg(&hex)
        .output()
        .context("run /usr/bin/python3: install Debian's python3 and python3-grpcio")?;
    let text = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    let answer = text.strip_prefix("ok").with_context(|| {
        format!("C-core call {method}: {text} {}", String::from_utf8_lossy(&out.stderr))
    })?;
    let answer = answer.trim();
    (0..answer.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(answer.get(i..i + 2).unwrap_or("zz"), 16).context("hex"))
        .collect()
}

/// A claim as the kubelet names it to the plugin.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Claim {
    /// Its namespace.
    pub namespace: String,
    /// Its name.
    pub name: String,
    /// Its UID.
    pub uid: String,
}

/// A plugin the watcher registered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plugin {
    /// The driver's name.
    pub driver: String,
    /// Its service socket.
    pub endpoint: PathBuf,
    /// The version the kubelet speaks to it.
    pub version: String,
    /// How many times it was registered (a restarted plugin registers again).
    pub registrations: u32,
}

/// One device the plugin answered for a claim.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Prepared {
    /// Its name in the pool.
    pub device: String,
    /// The CDI device names the runtime gets.
    pub cdi_ids: Vec<String>,
    /// Its share ID.
    pub share_id: Option<String>,
}

#[derive(Debug, Default)]
struct State {
    plugins: BTreeMap<String, Plugin>,
    /// Registration sockets seen, by path, with their inode and change time (another file:
    /// registered again).
    seen: BTreeMap<PathBuf, (u64, i64, i64)>,
    /// Sockets whose registration failed, with why.
    refused: BTreeMap<PathBuf, String>,
    /// The claims prepared (the kubelet's own checkpoint), by UID, with the pods using them.
    prepared: BTreeMap<String, (Claim, Vec<Prepared>, BTreeSet<String>)>,
    /// Prepare calls made, and Unprepare calls made.
    prepare_calls: u32,
    unprepare_calls: u32,
}

/// The fake kubelet's DRA side on one node.
pub struct FakeDraKubelet {
    registry: PathBuf,
    node: String,
    /// The fake API server whose slices of the node it deletes at its start, if any.
    api: Option<SocketAddr>,
    state: Arc<Mutex<State>>,
    stop: CancellationToken,
}

impl FakeDraKubelet {
    /// Starts on `node`: deletes the node's slices on the API server at `api`, then watches
    /// `registry` for plugins.
    pub async fn start(registry: &Path, node: &str, api: SocketAddr) -> Result<Self> {
        let kubelet = Self::new(registry, node, Some(api));
        kubelet.wipe_slices().await?;
        kubelet.watch();
        Ok(kubelet)
    }

    /// Starts on `node` beside a real API server (the real-control-plane lane): a node of a
    /// new cluster has no slices to delete, and the plugin writes its own with its token.
    pub fn start_beside(registry: &Path, node: &str) -> Self {
        let kubelet = Self::new(registry, node, None);
        kubelet.watch();
        kubelet
    }

    fn new(registry: &Path, node: &str, api: Option<SocketAddr>) -> Self {
        Self {
            registry: registry.to_path_buf(),
            node: node.to_owned(),
            api,
            state: Arc::default(),
            stop: CancellationToken::new(),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Deletes every ResourceSlice of the node, as the kubelet does when it starts.
    async fn wipe_slices(&self) -> Result<()> {
        let path = format!(
            "/apis/resource.k8s.io/v1/resourceslices?fieldSelector=spec.nodeName%3D{}",
            self.node
        );
        let Some(api) = self.api else { return Ok(()) };
        let (status, body) = crate::http::request(api, "DELETE", &path, "").await?;
        ensure!(status == 200, "deleting the node's slices: {status}: {body}");
        Ok(())
    }

    /// The plugin watcher: every 100 ms, a socket not seen (or seen as another file) is
    /// registered. A file is its inode and its change time: a plugin that restarts between
    /// two looks may get its old socket's inode back (the kernel reuses a freed one at once),
    /// where the kubelet's watcher, told of every create, registers it again all the same.
    fn watch(&self) {
        let (registry, state, stop) =
            (self.registry.clone(), self.state.clone(), self.stop.clone());
        tokio::spawn(async move {
            loop {
                let found: Vec<(PathBuf, (u64, i64, i64))> = std::fs::read_dir(&registry)
                    .into_iter()
                    .flatten()
                    .filter_map(Result::ok)
                    .map(|e| e.path())
                    .filter(|p| p.extension().is_some_and(|x| x == "sock"))
                    .filter_map(|p| {
                        let m = std::fs::metadata(&p).ok()?;
                        Some((p.clone(), (m.ino(), m.ctime(), m.ctime_nsec())))
                    })
                    .collect();
                // A socket gone is forgotten: when it comes back it is new.
                state
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .seen
                    .retain(|path, _| found.iter().any(|(p, _)| p == path));
                for (socket, inode) in found {
                    let new =
                        state.lock().unwrap_or_else(PoisonError::into_inner).seen.get(&socket)
                            != Some(&inode);
                    if !new {
                        continue;
                    }
                    let path = socket.clone();
                    let outcome = tokio::task::spawn_blocking(move || register(&path)).await;
                    let mut s = state.lock().unwrap_or_else(PoisonError::into_inner);
                    s.seen.insert(socket.clone(), inode);
                    match outcome {
                        Ok(Ok(mut plugin)) => {
                            s.refused.remove(&socket);
                            plugin.registrations =
                                s.plugins.get(&plugin.driver).map_or(0, |p| p.registrations) + 1;
                            s.plugins.insert(plugin.driver.clone(), plugin);
                        }
                        Ok(Err(e)) => {
                            s.refused.insert(socket, format!("{e:#}"));
                        }
                        Err(e) => {
                            s.refused.insert(socket, e.to_string());
                        }
                    }
                }
                tokio::select! {
                    () = stop.cancelled() => return,
                    () = tokio::time::sleep(Duration::from_millis(100)) => {}
                }
            }
        });
    }

    /// Waits (at most `limit`) until `driver` is registered at least `times` times.
    pub async fn registered(&self, driver: &str, times: u32, limit: Duration) -> Result<Plugin> {
        let wait = async {
            loop {
                if let Some(p) =
                    self.state().plugins.get(driver).filter(|p| p.registrations >= times)
                {
                    return p.clone();
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        };
        tokio::time::timeout(limit, wait).await.map_err(|_| {
            anyhow!(
                "{driver} not registered {times} times in {limit:?}; refused: {:?}",
                self.state().refused
            )
        })
    }

    /// Prepare and Unprepare calls made so far.
    pub fn calls(&self) -> (u32, u32) {
        let s = self.state();
        (s.prepare_calls, s.unprepare_calls)
    }

    /// What the kubelet holds prepared for claim `uid`.
    pub fn prepared(&self, uid: &str) -> Option<Vec<Prepared>> {
        self.state().prepared.get(uid).map(|(_, d, _)| d.clone())
    }

    /// Starts pod `pod` with `claims` of `driver`: the claims not prepared yet in one batch;
    /// its containers' CDI devices, by claim UID. An error is the pod failing to start (the
    /// kubelet would retry it).
    pub async fn run_pod(
        &self,
        driver: &str,
        pod: &str,
        claims: &[Claim],
    ) -> Result<BTreeMap<String, Vec<Prepared>>> {
        let plugin =
            self.state().plugins.get(driver).cloned().context("the driver is not registered")?;
        let todo: Vec<Claim> = {
            let s = self.state();
            claims.iter().filter(|c| !s.prepared.contains_key(&c.uid)).cloned().collect()
        };
        if !todo.is_empty() {
            self.state().prepare_calls += 1;
            let answers =
                tokio::time::timeout(DEADLINE, prepare(&plugin, &todo)).await.map_err(|_| {
                    anyhow!("NodePrepareResources exceeded the kubelet's {DEADLINE:?}")
                })??;
            let mut errors = Vec::new();
            for c in &todo {
                match answers.get(&c.uid) {
                    None => errors.push(format!("claim {}: no result for its UID", c.uid)),
                    Some(Err(e)) => errors.push(format!("claim {}: {e}", c.uid)),
                    Some(Ok(devices)) => {
                        self.state()
                            .prepared
                            .insert(c.uid.clone(), (c.clone(), devices.clone(), BTreeSet::new()));
                    }
                }
            }
            if !errors.is_empty() {
                bail!("pod {pod} cannot start: {}", errors.join("; "));
            }
        }
        let mut s = self.state();
        let mut out = BTreeMap::new();
        for c in claims {
            let entry = s.prepared.get_mut(&c.uid).context("prepared")?;
            entry.2.insert(pod.to_owned());
            out.insert(c.uid.clone(), entry.1.clone());
        }
        Ok(out)
    }

    /// Ends pod `pod`: unprepares the claims no running pod uses any more, retrying (every
    /// 100 ms, at most `limit`) until the plugin answers each without error.
    pub async fn end_pod(&self, driver: &str, pod: &str, limit: Duration) -> Result<()> {
        let done: Vec<Claim> = {
            let mut s = self.state();
            let mut done = Vec::new();
            for (claim, _, pods) in s.prepared.values_mut() {
                if pods.remove(pod) && pods.is_empty() {
                    done.push(claim.clone());
                }
            }
            done
        };
        if done.is_empty() {
            return Ok(());
        }
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            let plugin = self.state().plugins.get(driver).cloned();
            let outcome = match plugin {
                Some(p) => {
                    self.state().unprepare_calls += 1;
                    unprepare(&p, &done).await
                }
                None => Err(anyhow!("the driver is not registered")),
            };
            match outcome {
                Ok(()) => {
                    let mut s = self.state();
                    for c in &done {
                        s.prepared.remove(&c.uid);
                    }
                    return Ok(());
                }
                Err(e) if tokio::time::Instant::now() >= deadline => {
                    return Err(e.context(format!("unpreparing pod {pod}'s claims")));
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
    }

    /// Restarts: its registrations forgotten (the plugins register again), its prepared claims
    /// kept (its checkpoint), the node's slices deleted again.
    pub async fn restart(&self) -> Result<()> {
        {
            let mut s = self.state();
            s.plugins.clear();
            s.seen.clear();
        }
        self.wipe_slices().await
    }
}

impl Drop for FakeDraKubelet {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// The plugin watcher's registration of the socket at `socket`.
fn register(socket: &Path) -> Result<Plugin> {
    let info = reg::PluginInfo::decode(
        c_core_call(socket, reg::GET_INFO_PATH, &reg::InfoRequest {}.encode_to_vec())?.as_slice(),
    )?;
    let verdict = validate(&info);
    let status = reg::RegistrationStatus {
        plugin_registered: verdict.is_ok(),
        error: verdict.as_ref().err().cloned().unwrap_or_default(),
    };
    c_core_call(socket, reg::NOTIFY_PATH, &status.encode_to_vec())?;
    let version = verdict.map_err(|e| anyhow!(e))?;
    Ok(Plugin {
        driver: info.name,
        endpoint: PathBuf::from(info.endpoint),
        version,
        registrations: 0,
    })
}

/// What the kubelet checks of `GetInfo`: the version it will speak, or why it refuses.
fn validate(info: &reg::PluginInfo) -> Result<String, String> {
    if info.r#type != reg::DRA_PLUGIN {
        return Err(format!("plugin type {:?} is not {}", info.r#type, reg::DRA_PLUGIN));
    }
    if info.name.is_empty() {
        return Err("no driver name".into());
    }
    let endpoint = Path::new(&info.endpoint);
    if !endpoint.is_absolute() || !endpoint.exists() {
        return Err(format!("endpoint {:?} is not an existing absolute path", info.endpoint));
    }
    for version in [v1::SERVICE_VERSION, v1beta1::SERVICE_VERSION] {
        if info.supported_versions.iter().any(|v| v == version) {
            return Ok(version.to_owned());
        }
    }
    Err(format!("none of {:?} is a version this kubelet speaks", info.supported_versions))
}

type Answers = BTreeMap<String, Result<Vec<Prepared>, String>>;

async fn prepare(plugin: &Plugin, claims: &[Claim]) -> Result<Answers> {
    let channel =
        baleen_device_plugin::uds::connect(&plugin.endpoint, Duration::from_secs(5)).await?;
    if plugin.version == v1::SERVICE_VERSION {
        let mut client = v1::dra_plugin_client::DraPluginClient::new(channel);
        let request = v1::NodePrepareResourcesRequest {
            claims: claims
                .iter()
                .map(|c| v1::Claim {
                    namespace: c.namespace.clone(),
                    name: c.name.clone(),
                    uid: c.uid.clone(),
                })
                .collect(),
        };
        let answer = client.node_prepare_resources(request).await?.into_inner();
        Ok(answer
            .claims
            .into_iter()
            .map(|(uid, r)| {
                let devices = r
                    .devices
                    .into_iter()
                    .map(|d| Prepared {
                        device: d.device_name,
                        cdi_ids: d.cdi_device_ids,
                        share_id: d.share_id,
                    })
                    .collect();
                (uid, if r.error.is_empty() { Ok(devices) } else { Err(r.error) })
            })
            .collect())
    } else {
        let mut client = v1beta1::dra_plugin_client::DraPluginClient::new(channel);
        let request = v1beta1::NodePrepareResourcesRequest {
            claims: claims
                .iter()
                .map(|c| v1beta1::Claim {
                    namespace: c.namespace.clone(),
                    name: c.name.clone(),
                    uid: c.uid.clone(),
                })
                .collect(),
        };
        let answer = client.node_prepare_resources(request).await?.into_inner();
        Ok(answer
            .claims
            .into_iter()
            .map(|(uid, r)| {
                let devices = r
                    .devices
                    .into_iter()
                    .map(|d| Prepared {
                        device: d.device_name,
                        cdi_ids: d.cdi_device_ids,
                        share_id: None,
                    })
                    .collect();
                (uid, if r.error.is_empty() { Ok(devices) } else { Err(r.error) })
            })
            .collect())
    }
}

async fn unprepare(plugin: &Plugin, claims: &[Claim]) -> Result<()> {
    let channel =
        baleen_device_plugin::uds::connect(&plugin.endpoint, Duration::from_secs(5)).await?;
    let mut client = v1::dra_plugin_client::DraPluginClient::new(channel);
    let request = v1::NodeUnprepareResourcesRequest {
        claims: claims
            .iter()
            .map(|c| v1::Claim {
                namespace: c.namespace.clone(),
                name: c.name.clone(),
                uid: c.uid.clone(),
            })
            .collect(),
    };
    let answer = tokio::time::timeout(DEADLINE, client.node_unprepare_resources(request))
        .await
        .map_err(|_| anyhow!("NodeUnprepareResources exceeded the kubelet's {DEADLINE:?}"))??
        .into_inner();
    for c in claims {
        match answer.claims.get(&c.uid) {
            None => bail!("claim {}: no result for its UID", c.uid),
            Some(r) if !r.error.is_empty() => bail!("claim {}: {}", c.uid, r.error),
            Some(_) => {}
        }
    }
    Ok(())
}
