//! The install (`packaging/kustomize`), the image (`packaging/docker`) and the example pods
//! (`packaging/examples/pods`), checked against the code so that they cannot drift from it:
//! every overlay is rendered by the real `kubectl kustomize`, every object parsed strictly into
//! the Kubernetes API types (a round trip that must give back the same document, so a misspelt
//! or misplaced field fails), the DaemonSets' arguments parsed by the agent's own command line
//! and its ConfigMap by the agent's own configuration loader, every host path the agent uses
//! checked to be mounted at the same path, and RBAC checked against `kube_access::AGENT`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, anyhow, bail, ensure};
use baleen_agent::cli::{Cli, Command as AgentCommand};
use baleen_agent::config::{Environment, RunArgs, Settings, resolve};
use baleen_agent::inventory::GpuInventory;
use baleen_agent::inventory::simulated::SimulatedInventory;
use baleen_agent::ledger::DeviceLedger;
use clap::Parser;
use k8s_openapi::api::admissionregistration::v1::{
    ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding,
};
use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::core::v1::{
    ConfigMap, Container, Namespace, Pod, PodSpec, Service, ServiceAccount,
};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, PolicyRule, Role, RoleBinding};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::Value;

const OVERLAYS: [&str; 5] = ["default", "mig", "no-mps", "prometheus-operator", "extender"];
const AGENT: &str = "baleen-agent";
const MPS: &str = "baleen-mps";

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The overlay rendered by kubectl's built-in kustomize.
fn render(overlay: &str) -> Result<String> {
    let dir = repo().join("packaging/kustomize/overlays").join(overlay);
    let out = Command::new("kubectl").arg("kustomize").arg(&dir).output().map_err(|e| {
        anyhow!(
            "cannot run kubectl ({e}): these tests render the install with kubectl's built-in \
             kustomize; put kubectl 1.27 or later on PATH (scripts/install-kube-tools.sh \
             installs kubectl 1.34.5 and prints where)"
        )
    })?;
    ensure!(
        out.status.success(),
        "kubectl kustomize {} failed: {}",
        dir.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8(out.stdout)?)
}

/// The documents of a YAML stream (empty ones skipped).
fn documents(yaml: &str) -> Result<Vec<Value>> {
    let mut docs = Vec::new();
    for doc in serde_yaml_ng::Deserializer::from_str(yaml) {
        let value = Value::deserialize(doc)?;
        if !value.is_null() {
            docs.push(value);
        }
    }
    Ok(docs)
}

/// Where `back` (the document written back from its type) differs from `original`, if it does.
/// A number where the type writes a string of the same number is the same (a Quantity such as
/// `gpu-memory: 8` is written back as `"8"`).
fn difference(original: &Value, back: &Value, path: &str) -> Option<String> {
    match (original, back) {
        (Value::Object(a), Value::Object(b)) => {
            let keys: BTreeSet<&String> = a.keys().chain(b.keys()).collect();
            keys.into_iter().find_map(|k| {
                let here = format!("{path}.{k}");
                match (a.get(k), b.get(k)) {
                    (Some(x), Some(y)) => difference(x, y, &here),
                    (Some(_), None) => Some(format!("{here}: unknown to the API type")),
                    (None, _) => Some(format!("{here}: added by the API type")),
                }
            })
        }
        (Value::Array(a), Value::Array(b)) if a.len() == b.len() => a
            .iter()
            .zip(b)
            .enumerate()
            .find_map(|(i, (x, y))| difference(x, y, &format!("{path}[{i}]"))),
        (Value::Number(n), Value::String(s)) if n.to_string() == *s => None,
        (a, b) if a == b => None,
        (a, b) => Some(format!("{path}: {a} became {b}")),
    }
}

/// `doc` as `T`, required to write back to the same document.
fn strict<T: DeserializeOwned + Serialize>(doc: &Value) -> Result<T> {
    let name = doc.pointer("/metadata/name").and_then(Value::as_str).unwrap_or("?").to_owned();
    let kind = doc["kind"].as_str().unwrap_or("?").to_owned();
    let typed: T = serde_json::from_value(doc.clone())
        .with_context(|| format!("{kind} {name} does not parse"))?;
    let back = serde_json::to_value(&typed)?;
    if let Some(diff) = difference(doc, &back, "") {
        bail!("{kind} {name} is not a valid {kind}: {diff}");
    }
    Ok(typed)
}

/// The Prometheus Operator's ServiceMonitor, the fields the install uses (no Rust crate of the
/// operator's types is kept well enough to depend on); unknown fields are errors.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct ServiceMonitor {
    api_version: String,
    kind: String,
    metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
    spec: ServiceMonitorSpec,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct ServiceMonitorSpec {
    selector: k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector,
    namespace_selector: NamespaceSelector,
    endpoints: Vec<Endpoint>,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct NamespaceSelector {
    match_names: Vec<String>,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct Endpoint {
    port: String,
    path: String,
    interval: String,
    scrape_timeout: String,
    honor_labels: bool,
}

/// One rendered overlay, every object typed.
#[derive(Default)]
struct Install {
    namespaces: Vec<Namespace>,
    service_accounts: Vec<ServiceAccount>,
    config_maps: Vec<ConfigMap>,
    daemon_sets: Vec<DaemonSet>,
    services: Vec<Service>,
    service_monitors: Vec<ServiceMonitor>,
    deployments: Vec<Deployment>,
    admission_policies: Vec<ValidatingAdmissionPolicy>,
    policy_bindings: Vec<ValidatingAdmissionPolicyBinding>,
    roles: Vec<(Option<String>, Vec<PolicyRule>)>,
    bindings: Vec<(String, String, Vec<String>)>,
}

impl Install {
    fn parse(yaml: &str) -> Result<Self> {
        let mut install = Self::default();
        for doc in documents(yaml)? {
            match doc["kind"].as_str().unwrap_or_default() {
                "Namespace" => install.namespaces.push(strict(&doc)?),
                "ServiceAccount" => install.service_accounts.push(strict(&doc)?),
                "ConfigMap" => install.config_maps.push(strict(&doc)?),
                "DaemonSet" => install.daemon_sets.push(strict(&doc)?),
                "Service" => install.services.push(strict(&doc)?),
                "ServiceMonitor" => install.service_monitors.push(strict(&doc)?),
                "Deployment" => install.deployments.push(strict(&doc)?),
                "ValidatingAdmissionPolicy" => install.admission_policies.push(strict(&doc)?),
                "ValidatingAdmissionPolicyBinding" => {
                    install.policy_bindings.push(strict(&doc)?);
                }
                "Role" => {
                    let r: Role = strict(&doc)?;
                    install.roles.push((r.metadata.name, r.rules.unwrap_or_default()));
                }
                "ClusterRole" => {
                    let r: ClusterRole = strict(&doc)?;
                    install.roles.push((r.metadata.name, r.rules.unwrap_or_default()));
                }
                "RoleBinding" => {
                    let b: RoleBinding = strict(&doc)?;
                    let subjects = b.subjects.unwrap_or_default().into_iter().map(|s| s.name);
                    install.bindings.push((b.role_ref.kind, b.role_ref.name, subjects.collect()));
                }
                "ClusterRoleBinding" => {
                    let b: ClusterRoleBinding = strict(&doc)?;
                    let subjects = b.subjects.unwrap_or_default().into_iter().map(|s| s.name);
                    install.bindings.push((b.role_ref.kind, b.role_ref.name, subjects.collect()));
                }
                other => bail!("the install holds a {other}, which this test does not check"),
            }
        }
        Ok(install)
    }

    /// Every (API group, resource, verb) bound to service account `account`.
    fn granted_to(&self, account: &str) -> Result<BTreeSet<(String, String, String)>> {
        let mut granted = BTreeSet::new();
        for (kind, role, subjects) in &self.bindings {
            if !subjects.iter().any(|s| s == account) {
                continue;
            }
            let rules = self
                .roles
                .iter()
                .find(|(name, _)| name.as_deref() == Some(role.as_str()))
                .with_context(|| format!("{kind} {role} is not in the install"))?;
            for rule in &rules.1 {
                for group in rule.api_groups.iter().flatten() {
                    for resource in rule.resources.iter().flatten() {
                        for verb in &rule.verbs {
                            granted.insert((group.clone(), resource.clone(), verb.clone()));
                        }
                    }
                }
            }
        }
        Ok(granted)
    }

    fn daemon_set(&self, name: &str) -> Option<&DaemonSet> {
        self.daemon_sets.iter().find(|d| d.metadata.name.as_deref() == Some(name))
    }
}

fn pod_spec(ds: &DaemonSet) -> Result<&PodSpec> {
    ds.spec.as_ref().and_then(|s| s.template.spec.as_ref()).context("DaemonSet without a pod")
}

fn only_container(spec: &PodSpec) -> Result<&Container> {
    ensure!(spec.containers.len() == 1, "one container per pod");
    Ok(&spec.containers[0])
}

/// The host path each of the container's mounts shows, by mount path (hostPath volumes only),
/// and the other volumes by mount path.
fn mounts(spec: &PodSpec, c: &Container) -> Result<(BTreeMap<PathBuf, PathBuf>, Vec<PathBuf>)> {
    let mut host = BTreeMap::new();
    let mut other = Vec::new();
    for m in c.volume_mounts.iter().flatten() {
        let volume = spec
            .volumes
            .iter()
            .flatten()
            .find(|v| v.name == m.name)
            .with_context(|| format!("mount {} names no volume", m.name))?;
        match &volume.host_path {
            Some(h) => {
                host.insert(PathBuf::from(&m.mount_path), PathBuf::from(&h.path));
            }
            None => other.push(PathBuf::from(&m.mount_path)),
        }
    }
    Ok((host, other))
}

/// The configuration a container runs with: its arguments parsed by the agent's own command
/// line, its `--config` file read from the mounted ConfigMap, resolved by the agent's own
/// loader with `NODE_NAME` from the downward API inside a pod.
fn settings_of(
    install: &Install,
    spec: &PodSpec,
    c: &Container,
    scratch: &Path,
) -> Result<(Option<AgentCommand>, Settings)> {
    let mut argv = vec!["baleen-agent".to_owned()];
    argv.extend(c.command.iter().flatten().cloned());
    argv.extend(c.args.iter().flatten().cloned());
    let cli = Cli::try_parse_from(&argv).map_err(|e| anyhow!("{argv:?}: {e}"))?;
    let (command, mut run): (Option<AgentCommand>, RunArgs) = match cli.command {
        None => (None, cli.run),
        Some(AgentCommand::Mps(run)) => (Some(AgentCommand::Mps(run.clone())), run),
        Some(other) => bail!("{} runs {other:?}, not the agent", c.name),
    };
    let config = run.config.clone().context("no --config: the ConfigMap is not read")?;
    let dir = config.parent().context("config path")?;
    let mount = c
        .volume_mounts
        .iter()
        .flatten()
        .find(|m| Path::new(&m.mount_path) == dir)
        .with_context(|| format!("{} is not mounted", dir.display()))?;
    let volume = spec.volumes.iter().flatten().find(|v| v.name == mount.name).context("volume")?;
    let map_name =
        volume.config_map.as_ref().context("the config is not a ConfigMap")?.name.clone();
    let map = install
        .config_maps
        .iter()
        .find(|m| m.metadata.name.as_deref() == Some(map_name.as_str()))
        .with_context(|| format!("ConfigMap {map_name} is not in the install"))?;
    let key = config.file_name().context("file")?.to_string_lossy().into_owned();
    let text = map.data.as_ref().and_then(|d| d.get(&key)).context("the config key")?;
    let file = scratch.join(format!("{map_name}-{key}"));
    std::fs::write(&file, text)?;
    run.config = Some(file);
    let env = c.env.iter().flatten().find(|e| e.name == "NODE_NAME").context("NODE_NAME")?;
    let field = env.value_from.as_ref().and_then(|v| v.field_ref.as_ref()).context("fieldRef")?;
    ensure!(field.field_path == "spec.nodeName", "NODE_NAME must come from spec.nodeName");
    let settings = resolve(&run, &Environment { node_name: Some("node-a".into()), in_pod: true })
        .map_err(|e| anyhow!("{}: {e}", c.name))?;
    Ok((command, settings))
}

/// Every host path `what` uses must be mounted from the host at the same path (the kubelet and
/// the MPS clients see host paths), and nothing else from the host may be.
fn check_host_paths(what: &str, host: &BTreeMap<PathBuf, PathBuf>, used: &[PathBuf]) -> Result<()> {
    for (inside, outside) in host {
        ensure!(
            inside == outside,
            "{what}: host {} mounted at {}",
            outside.display(),
            inside.display()
        );
        ensure!(
            used.iter().any(|u| u.starts_with(inside)),
            "{what}: mounts host {} but uses nothing there",
            inside.display()
        );
    }
    for path in used {
        ensure!(
            host.keys().any(|m| path.starts_with(m)),
            "{what}: {} is not mounted from the host",
            path.display()
        );
    }
    Ok(())
}

fn check_overlay(overlay: &str, scratch: &Path) -> Result<Install> {
    let install = Install::parse(&render(overlay)?)?;
    let version = env!("CARGO_PKG_VERSION");

    // The namespace admits the agent's host access, and everything lives in it.
    ensure!(install.namespaces.len() == 1, "one namespace");
    let ns = install.namespaces[0].metadata.name.clone().context("namespace name")?;
    let labels = install.namespaces[0].metadata.labels.clone().unwrap_or_default();
    ensure!(
        labels.get("pod-security.kubernetes.io/enforce").map(String::as_str) == Some("privileged")
    );

    // The agent.
    let agent = install.daemon_set(AGENT).context("the agent's DaemonSet")?;
    ensure!(agent.metadata.namespace.as_deref() == Some(ns.as_str()));
    let spec = pod_spec(agent)?;
    let c = only_container(spec)?;
    let (command, settings) = settings_of(&install, spec, c, scratch)?;
    ensure!(command.is_none(), "the agent's DaemonSet runs a subcommand");
    let a = &settings.agent;
    ensure!(
        c.image.as_deref() == Some(format!("baleen:{version}").as_str()),
        "image {:?} is not this version ({version})",
        c.image
    );
    ensure!(spec.priority_class_name.as_deref() == Some("system-node-critical"));
    ensure!(!spec.tolerations.clone().unwrap_or_default().is_empty(), "tolerations");
    ensure!(!spec.node_selector.clone().unwrap_or_default().is_empty(), "a node selector");
    let mut used = vec![
        a.device_plugin_dir.clone(),
        a.pod_resources_socket.parent().context("socket dir")?.to_path_buf(),
        a.state_dir.clone(),
    ];
    if a.mps.enabled {
        used.push(a.mps.root.clone());
    }
    if a.colocation.enabled {
        used.push(a.colocation.cgroup_root.clone());
    }
    // What the device-isolation checks read at start.
    used.extend(a.devices.cdi_spec_dirs.iter().cloned());
    used.push(a.devices.toolkit_config.parent().context("toolkit dir")?.to_path_buf());
    ensure!(
        a.devices.strategy != baleen_agent::isolation::devices::Strategy::Envvar,
        "{overlay}: the envvar strategy lets any pod name any GPU"
    );
    // The watchdog reads the host's /proc: the host's PID namespace or a mount.
    if a.watchdog.proc_root == Path::new("/proc") {
        ensure!(spec.host_pid == Some(true), "procRoot /proc needs hostPID");
    } else {
        used.push(a.watchdog.proc_root.clone());
    }
    let (host, _) = mounts(spec, c)?;
    check_host_paths("the agent", &host, &used)?;
    // Probes and the Service reach the metrics endpoint where the configuration puts it.
    ensure!(a.metrics.enabled, "the probes need the metrics endpoint");
    let port = c
        .ports
        .iter()
        .flatten()
        .find(|p| p.name.as_deref() == Some("metrics"))
        .context("a port named metrics")?;
    ensure!(
        i64::from(port.container_port) == i64::from(a.metrics.address.port()),
        "metrics port {} is not {}",
        port.container_port,
        a.metrics.address
    );
    for (probe, path) in [(&c.liveness_probe, "/healthz"), (&c.readiness_probe, "/readyz")] {
        let get = probe.as_ref().and_then(|p| p.http_get.as_ref()).context("an HTTP probe")?;
        ensure!(get.path.as_deref() == Some(path), "probe {:?} is not {path}", get.path);
        ensure!(
            get.port
                == k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::String(
                    "metrics".into()
                ),
            "probe port"
        );
    }
    let resources = c.resources.as_ref().context("resources")?;
    for (what, list) in [("requests", &resources.requests), ("limits", &resources.limits)] {
        let list = list.as_ref().with_context(|| format!("no {what}"))?;
        ensure!(list.contains_key("cpu") && list.contains_key("memory"), "{what}: cpu and memory");
    }
    // Privileged: with the toolkit refusing NVIDIA_VISIBLE_DEVICES from unprivileged
    // containers (the install's device isolation), that is how the agent gets every GPU; its
    // root file system stays read-only and every path it writes is a named mount.
    let security = c.security_context.as_ref().context("securityContext")?;
    ensure!(security.privileged == Some(true), "the agent needs every GPU: privileged");
    ensure!(security.read_only_root_filesystem == Some(true), "a read-only root file system");
    let visible = c.env.iter().flatten().find(|e| e.name == "NVIDIA_VISIBLE_DEVICES");
    ensure!(visible.and_then(|e| e.value.as_deref()) == Some("all"), "the agent sees every GPU");
    // A surge would start a second agent that waits for the first one's lock forever.
    let strategy =
        agent.spec.as_ref().and_then(|s| s.update_strategy.as_ref()).context("strategy")?;
    let rolling = strategy.rolling_update.as_ref().context("rollingUpdate")?;
    ensure!(
        rolling.max_surge
            == Some(k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(0)),
        "no surge"
    );

    // The MPS daemons: with MPS on, exactly when the agent leaves them to another process.
    let mps = install.daemon_set(MPS);
    let external =
        a.mps.enabled && a.mps.daemons == baleen_agent::isolation::mps::DaemonPlacement::External;
    ensure!(mps.is_some() == external, "{overlay}: MPS DaemonSet present: {}", mps.is_some());
    if let Some(mps) = mps {
        let spec = pod_spec(mps)?;
        let c = only_container(spec)?;
        let (command, settings) = settings_of(&install, spec, c, scratch)?;
        ensure!(
            matches!(command, Some(AgentCommand::Mps(_))),
            "baleen-mps runs `baleen-agent mps`"
        );
        ensure!(
            settings.agent.mps.root == a.mps.root,
            "the daemons and the agent must share the MPS root"
        );
        ensure!(c.image == only_container(pod_spec(agent)?)?.image, "one image for both");
        let (host, _) = mounts(spec, c)?;
        check_host_paths("baleen-mps", &host, std::slice::from_ref(&settings.agent.mps.root))?;
        let strategy =
            mps.spec.as_ref().and_then(|s| s.update_strategy.as_ref()).context("strategy")?;
        ensure!(
            strategy.type_.as_deref() == Some("OnDelete"),
            "a rollout of the MPS DaemonSet would kill every tenant"
        );
        ensure!(c.liveness_probe.is_none(), "a failed probe would restart the daemons");
        ensure!(
            c.security_context.as_ref().and_then(|s| s.privileged) == Some(true),
            "the MPS daemons need every shared GPU: privileged"
        );
        ensure!(
            c.resources
                .as_ref()
                .and_then(|r| r.limits.as_ref())
                .is_none_or(|l| !l.contains_key("memory")),
            "an OOM kill of the MPS servers kills their clients"
        );
    }
    if !a.mps.enabled {
        let labels = agent
            .spec
            .as_ref()
            .and_then(|s| s.template.metadata.as_ref())
            .and_then(|m| m.labels.clone())
            .unwrap_or_default();
        ensure!(
            labels.get("awesome-ai-company.com/gpu-sharing").map(String::as_str)
                == Some("accounting-only"),
            "an install without MPS says so on its pods"
        );
    }

    // RBAC: exactly what the agent calls.
    let sa = spec.service_account_name.clone().context("serviceAccountName")?;
    ensure!(install.service_accounts.iter().any(|s| s.metadata.name.as_deref() == Some(&sa)));
    let granted = install.granted_to(&sa)?;
    let called =
        calls(baleen_agent::kube_access::AGENT.iter().map(|r| (r.api_group, r.resource, r.verbs)));
    ensure!(granted == called, "RBAC grants {granted:?}, the agent calls {called:?}");
    if called.is_empty() {
        ensure!(
            spec.automount_service_account_token == Some(false),
            "the agent calls no API: no token in its pods"
        );
    } else {
        let account =
            install.service_accounts.iter().find(|s| s.metadata.name.as_deref() == Some(&sa));
        ensure!(
            spec.automount_service_account_token != Some(false)
                && account.and_then(|a| a.automount_service_account_token) != Some(false),
            "the agent calls the API: its pods need the token"
        );
    }
    // The MPS daemons call nothing: an account of their own, bound to nothing, no token.
    if let Some(mps) = install.daemon_set(MPS) {
        let spec = pod_spec(mps)?;
        let account = spec.service_account_name.clone().context("baleen-mps account")?;
        ensure!(account != sa, "the MPS daemons must not share the agent's rights");
        ensure!(
            install.bindings.iter().all(|(_, _, subjects)| !subjects.contains(&account)),
            "the MPS daemons' account is bound to a role"
        );
        let token = install
            .service_accounts
            .iter()
            .find(|s| s.metadata.name.as_deref() == Some(&account))
            .and_then(|a| a.automount_service_account_token);
        ensure!(
            token == Some(false) || spec.automount_service_account_token == Some(false),
            "no token in the MPS pods"
        );
    }
    // The agent publishes its node's state wherever it may (the extender reads it).
    ensure!(a.annotation.enabled, "{overlay}: the node-state annotation is off");

    // The metrics Service selects the agent's pods on the metrics port.
    let service = install
        .services
        .iter()
        .find(|s| s.metadata.name.as_deref() == Some("baleen-agent-metrics"))
        .context("the metrics Service")?;
    let svc = service.spec.as_ref().context("spec")?;
    let pod_labels = agent
        .spec
        .as_ref()
        .and_then(|s| s.template.metadata.as_ref())
        .and_then(|m| m.labels.clone())
        .unwrap_or_default();
    for (k, v) in svc.selector.iter().flatten() {
        ensure!(pod_labels.get(k) == Some(v), "the Service selects {k}={v}, not on the agent");
    }
    let svc_port = svc.ports.iter().flatten().find(|p| p.name.as_deref() == Some("metrics"));
    ensure!(
        svc_port.and_then(|p| p.target_port.clone())
            == Some(k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::String(
                "metrics".into()
            )),
        "the Service's metrics port targets the container's"
    );
    for monitor in &install.service_monitors {
        let wanted = monitor.spec.selector.match_labels.clone().unwrap_or_default();
        let svc_labels = service.metadata.labels.clone().unwrap_or_default();
        for (k, v) in &wanted {
            ensure!(svc_labels.get(k) == Some(v), "the ServiceMonitor selects {k}={v}");
        }
        ensure!(monitor.spec.namespace_selector.match_names == std::slice::from_ref(&ns));
        ensure!(monitor.spec.endpoints.iter().all(|e| e.port == "metrics" && e.path == "/metrics"));
    }
    Ok(install)
}

#[test]
fn every_overlay_renders_into_valid_objects_that_match_the_agent() -> Result<()> {
    let scratch = tempfile::tempdir()?;
    let mut problems = Vec::new();
    let mut mig = BTreeMap::new();
    for overlay in OVERLAYS {
        match check_overlay(overlay, scratch.path()) {
            Ok(install) => {
                let agent = install.daemon_set(AGENT).context("agent")?;
                let spec = pod_spec(agent)?;
                let (_, s) = settings_of(&install, spec, only_container(spec)?, scratch.path())?;
                mig.insert(overlay, s.agent.views.mig);
                ensure!(
                    install.deployments.is_empty() == (overlay != "extender"),
                    "{overlay}: the extender's Deployment only in the extender overlay"
                );
                if overlay == "extender" {
                    check_extender(&install)?;
                }
                if overlay == "prometheus-operator" {
                    ensure!(install.service_monitors.len() == 1, "one ServiceMonitor");
                } else {
                    ensure!(install.service_monitors.is_empty(), "{overlay}: no CRD needed");
                }
            }
            Err(e) => problems.push(format!("{overlay}: {e:#}")),
        }
    }
    ensure!(problems.is_empty(), "{}", problems.join("\n"));
    // What distinguishes the overlays.
    ensure!(mig["mig"] && !mig["default"] && !mig["no-mps"], "MIG views: {mig:?}");
    Ok(())
}

#[test]
fn a_misspelt_field_fails_the_strict_parse() -> Result<()> {
    let yaml = render("default")?;
    let mut docs = documents(&yaml)?;
    let ds = docs.iter_mut().find(|d| d["kind"] == "DaemonSet").context("a DaemonSet")?;
    strict::<DaemonSet>(ds)?;
    ds["spec"]["template"]["spec"]["hostPid"] = Value::Bool(true);
    let err = strict::<DaemonSet>(ds).expect_err("hostPid is not hostPID");
    assert!(err.to_string().contains("hostPid: unknown"), "{err}");
    // And in the agent's own file: the loader refuses unknown keys.
    let scratch = tempfile::tempdir()?;
    let file = scratch.path().join("agent.yaml");
    std::fs::write(&file, "mps:\n  deamons: external\n")?;
    let run = RunArgs { config: Some(file), ..RunArgs::default() };
    let err = resolve(&run, &Environment::with_node_name(Some("n"))).expect_err("deamons");
    assert!(err.to_string().contains("deamons"), "{err}");
    Ok(())
}

#[test]
fn a_mount_at_another_path_or_a_path_not_mounted_is_caught() {
    let used = [PathBuf::from("/var/lib/baleen"), PathBuf::from("/run/baleen/mps")];
    let ok: BTreeMap<PathBuf, PathBuf> = used.iter().map(|p| (p.clone(), p.clone())).collect();
    assert!(check_host_paths("t", &ok, &used).is_ok());
    let mut moved = ok.clone();
    moved.insert("/var/lib/baleen".into(), "/var/lib/other".into());
    assert!(check_host_paths("t", &moved, &used).is_err());
    let mut missing = ok.clone();
    missing.remove(Path::new("/run/baleen/mps"));
    assert!(check_host_paths("t", &missing, &used).is_err());
    let mut extra = ok;
    extra.insert("/etc".into(), "/etc".into());
    assert!(check_host_paths("t", &extra, &used).is_err(), "host /etc mounted for nothing");
}

/// The resources the agent would advertise on the example nodes with every view on.
fn advertised() -> Result<BTreeSet<String>> {
    let mut names = BTreeSet::new();
    for entry in std::fs::read_dir(repo().join("packaging/examples"))? {
        let path = entry?.path();
        if path.extension().is_none_or(|e| e != "yaml") {
            continue;
        }
        let inventory = SimulatedInventory::from_file(&path)?.discover()?;
        let config = baleen_agent::ledger::ViewConfig::default();
        let ledger = DeviceLedger::new("node-a", &inventory, config.clone())?;
        names.extend(ledger.views().iter().map(|v| v.resource_name(&config.domain)));
    }
    Ok(names)
}

#[test]
fn example_pods_are_valid_and_ask_for_what_the_agent_advertises() -> Result<()> {
    let advertised = advertised()?;
    let policy = tenant_policy()?;
    let dir = repo().join("packaging/examples/pods");
    let mut asked = BTreeSet::new();
    for entry in std::fs::read_dir(&dir)? {
        let path = entry?.path();
        let text = std::fs::read_to_string(&path)?;
        for doc in documents(&text)? {
            let pod: Pod = strict(&doc).with_context(|| path.display().to_string())?;
            // What the install's tenant policy matches, it admits (the examples run as shown).
            if cel_true(&policy.0, &doc)? {
                ensure!(cel_true(&policy.1, &doc)?, "{}: refused by the install", path.display());
            }
            let spec = pod.spec.context("spec")?;
            for c in &spec.containers {
                let limits =
                    c.resources.as_ref().and_then(|r| r.limits.clone()).unwrap_or_default();
                for (name, quantity) in limits {
                    ensure!(
                        advertised.contains(&name),
                        "{}: {name} is not a resource the agent advertises ({advertised:?})",
                        path.display()
                    );
                    ensure!(quantity.0.parse::<u32>().is_ok_and(|n| n > 0), "{name}: a count");
                    asked.insert(name.rsplit('/').next().unwrap_or_default().to_owned());
                }
            }
        }
    }
    for kind in ["gpu-memory", "gpu"] {
        ensure!(asked.contains(kind), "no example asks for {kind}: {asked:?}");
    }
    ensure!(asked.iter().any(|a| a.starts_with("mig-")), "a MIG slice example");
    ensure!(asked.iter().any(|a| a.starts_with("nvlink-group-")), "an NVLink group example");
    Ok(())
}

/// The workspace's binary targets, from `cargo metadata`.
fn workspace_binaries() -> Result<BTreeSet<String>> {
    let out = Command::new(env!("CARGO"))
        .args(["metadata", "--no-deps", "--format-version", "1", "--offline"])
        .current_dir(repo())
        .output()?;
    ensure!(out.status.success(), "cargo metadata: {}", String::from_utf8_lossy(&out.stderr));
    let meta: Value = serde_json::from_slice(&out.stdout)?;
    let mut bins = BTreeSet::new();
    for package in meta["packages"].as_array().context("packages")? {
        for target in package["targets"].as_array().context("targets")? {
            if target["kind"].as_array().is_some_and(|k| k.iter().any(|k| k == "bin")) {
                bins.insert(target["name"].as_str().context("name")?.to_owned());
            }
        }
    }
    Ok(bins)
}

#[test]
fn the_dockerfile_builds_workspace_binaries_in_stages() -> Result<()> {
    let text = std::fs::read_to_string(repo().join("packaging/docker/Dockerfile"))?;
    let lines: Vec<&str> = text.lines().map(str::trim).filter(|l| !l.starts_with('#')).collect();
    let stages: Vec<(String, String)> = lines
        .iter()
        .filter_map(|l| l.strip_prefix("FROM "))
        .map(|f| {
            let parts: Vec<&str> = f.split_whitespace().collect();
            let name = match parts.as_slice() {
                [_, as_, name] if as_.eq_ignore_ascii_case("as") => (*name).to_owned(),
                _ => String::new(),
            };
            (parts[0].to_owned(), name)
        })
        .collect();
    ensure!(stages.len() >= 2, "a multi-stage build: {stages:?}");
    ensure!(stages.iter().all(|(_, name)| !name.is_empty()), "every stage named");
    let rust = &stages[0].0;
    let wanted = format!("rust:{}", env!("CARGO_PKG_RUST_VERSION"));
    ensure!(rust.contains(&wanted), "the build stage {rust} is not the CI toolchain ({wanted})");
    let runtime = &stages.last().context("stage")?.0;
    ensure!(
        runtime.contains("debian") && runtime.contains("slim"),
        "a small glibc base: {runtime}"
    );
    // What it builds and copies are the workspace's binaries.
    let bins = workspace_binaries()?;
    let build = lines.iter().find(|l| l.contains("cargo build")).context("cargo build")?;
    ensure!(build.contains("--locked") && build.contains("--release"), "{build}");
    let mut copied = 0;
    for line in &lines {
        if let Some(rest) = line.strip_prefix("COPY --from=") {
            let (stage, paths) = rest.split_once(' ').context("COPY")?;
            ensure!(stages.iter().any(|(_, n)| n == stage), "COPY from unknown stage {stage}");
            let source = paths.split_whitespace().next().context("source")?;
            let bin = Path::new(source).file_name().context("name")?.to_string_lossy();
            ensure!(bins.contains(bin.as_ref()), "{bin} is not a workspace binary ({bins:?})");
            ensure!(text.contains(&format!("target/release/{bin}")), "{bin} is not built");
            copied += 1;
        }
    }
    ensure!(copied >= 1 && bins.contains("baleen-agent"), "the agent is copied");
    // The user is said, with why (the agent needs root; see the comment above it).
    let user = lines.iter().rfind(|l| l.starts_with("USER ")).context("a USER line")?;
    ensure!(*user == "USER 0:0", "{user}");
    ensure!(text.contains("runs as root: it creates its sockets"), "the USER line is explained");
    let entry = lines.iter().find(|l| l.starts_with("ENTRYPOINT")).context("ENTRYPOINT")?;
    ensure!(entry.contains("baleen-agent"), "{entry}");
    // The DaemonSets run what the image holds.
    let ignore = std::fs::read_to_string(repo().join(".dockerignore"))?;
    ensure!(ignore.lines().any(|l| l.trim() == "target/"), "the build context leaves target/ out");
    Ok(())
}

/// Every (API group, resource, verb) of a program's declared API calls.
fn calls<'a>(
    rules: impl Iterator<Item = (&'a str, &'a str, &'a [&'a str])>,
) -> BTreeSet<(String, String, String)> {
    rules
        .flat_map(|(group, resource, verbs)| {
            verbs.iter().map(move |v| (group.to_owned(), resource.to_owned(), (*v).to_owned()))
        })
        .collect()
}

/// The extender's Deployment, Service and RBAC, and kube-scheduler's configuration that calls
/// it (`packaging/scheduler/kube-scheduler-config.yaml`).
fn check_extender(install: &Install) -> Result<()> {
    let deployment = install
        .deployments
        .iter()
        .find(|d| d.metadata.name.as_deref() == Some("baleen-extender"))
        .context("the extender's Deployment")?;
    let spec = deployment.spec.as_ref().and_then(|s| s.template.spec.as_ref()).context("pod")?;
    let c = only_container(spec)?;
    let mut argv: Vec<String> = c.command.clone().unwrap_or_default();
    ensure!(
        argv.first().is_some_and(|b| b.ends_with("/baleen-extender")),
        "the extender's command: {argv:?}"
    );
    argv.extend(c.args.iter().flatten().cloned());
    let args =
        baleen_extender::run::Args::try_parse_from(&argv).map_err(|e| anyhow!("{argv:?}: {e}"))?;
    ensure!(args.policy.parse::<baleen_scheduler_core::policy::PolicyKind>().is_ok(), "policy");
    ensure!(
        c.image.as_deref() == Some(format!("baleen:{}", env!("CARGO_PKG_VERSION")).as_str()),
        "one image for the agent and the extender"
    );
    let port = c
        .ports
        .iter()
        .flatten()
        .find(|p| p.name.as_deref() == Some("http"))
        .context("a port named http")?;
    ensure!(i64::from(port.container_port) == i64::from(args.listen.port()), "the listen port");
    for (probe, path) in [(&c.liveness_probe, "/healthz"), (&c.readiness_probe, "/readyz")] {
        let get = probe.as_ref().and_then(|p| p.http_get.as_ref()).context("an HTTP probe")?;
        ensure!(get.path.as_deref() == Some(path), "probe path {:?} is not {path}", get.path);
    }
    let pod_security = spec.security_context.as_ref().context("pod securityContext")?;
    ensure!(pod_security.run_as_non_root == Some(true), "the extender runs as non-root");
    let security = c.security_context.as_ref().context("securityContext")?;
    ensure!(security.read_only_root_filesystem == Some(true));
    ensure!(
        security.capabilities.as_ref().and_then(|c| c.drop.clone()) == Some(vec!["ALL".to_owned()])
    );
    // RBAC: exactly what the extender calls.
    let account = spec.service_account_name.clone().context("serviceAccountName")?;
    let called = calls(
        baleen_extender::kube_access::EXTENDER.iter().map(|r| (r.api_group, r.resource, r.verbs)),
    );
    let granted = install.granted_to(&account)?;
    ensure!(granted == called, "RBAC grants {granted:?}, the extender calls {called:?}");
    // The Service kube-scheduler calls.
    let service = install
        .services
        .iter()
        .find(|s| s.metadata.name.as_deref() == Some("baleen-extender"))
        .context("the extender's Service")?;
    let svc = service.spec.as_ref().context("spec")?;
    let svc_port =
        svc.ports.iter().flatten().find(|p| p.name.as_deref() == Some("http")).context("http")?;
    ensure!(
        svc_port.target_port
            == Some(k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::String(
                "http".into()
            ))
    );
    let ns = service.metadata.namespace.clone().context("namespace")?;
    // kube-scheduler's configuration names that Service, the verbs the extender serves, and
    // every resource an agent advertises on the example nodes.
    let text =
        std::fs::read_to_string(repo().join("packaging/scheduler/kube-scheduler-config.yaml"))?;
    let config = documents(&text)?.into_iter().next().context("a document")?;
    ensure!(config["kind"] == "KubeSchedulerConfiguration");
    ensure!(config["apiVersion"] == "kubescheduler.config.k8s.io/v1");
    let extenders = config["extenders"].as_array().context("extenders")?;
    ensure!(extenders.len() == 1, "one extender");
    let e = &extenders[0];
    let url = format!("http://baleen-extender.{ns}.svc:{}{}", svc_port.port, args.url_prefix);
    ensure!(e["urlPrefix"] == url.as_str(), "urlPrefix {} is not {url}", e["urlPrefix"]);
    ensure!(e["filterVerb"] == "filter" && e["prioritizeVerb"] == "prioritize");
    ensure!(e["nodeCacheCapable"] == true, "the extender keeps a node cache");
    ensure!(e["weight"].as_i64().is_some_and(|w| w >= 1), "a weight");
    let managed: BTreeSet<String> = e["managedResources"]
        .as_array()
        .context("managedResources")?
        .iter()
        .map(|r| r["name"].as_str().unwrap_or_default().to_owned())
        .collect();
    let advertised = advertised()?;
    for name in &managed {
        ensure!(advertised.contains(name), "{name} is managed but no agent advertises it");
    }
    for name in &advertised {
        ensure!(managed.contains(name), "{name} is advertised on an example node but not managed");
    }
    Ok(())
}

/// The install's tenant policy's two CEL expressions: whether a pod is matched, and whether it
/// is admitted.
fn tenant_policy() -> Result<(String, String)> {
    let install = Install::parse(&render("default")?)?;
    ensure!(install.admission_policies.len() == 1, "one ValidatingAdmissionPolicy");
    let policy = &install.admission_policies[0];
    let name = policy.metadata.name.clone().context("name")?;
    let binding = install.policy_bindings.first().context("a binding")?;
    let bound = binding.spec.as_ref().context("binding spec")?;
    ensure!(bound.policy_name.as_deref() == Some(name.as_str()), "the binding names the policy");
    ensure!(bound.validation_actions.as_deref() == Some(&["Deny".to_owned()][..]), "it denies");
    let spec = policy.spec.as_ref().context("policy spec")?;
    ensure!(spec.failure_policy.as_deref() == Some("Fail"), "an error admits nothing");
    let matched = spec.match_conditions.as_ref().and_then(|m| m.first()).context("condition")?;
    let valid = spec.validations.as_ref().and_then(|v| v.first()).context("validation")?;
    Ok((matched.expression.clone(), valid.expression.clone()))
}

fn cel_true(expression: &str, pod: &serde_json::Value) -> Result<bool> {
    let program = cel::Program::compile(expression).map_err(|e| anyhow::anyhow!("{e}"))?;
    let mut context = cel::Context::default();
    context.add_variable_from_value("object", cel::to_value(pod)?);
    match program.execute(&context).map_err(|e| anyhow::anyhow!("{e}"))? {
        cel::Value::Bool(b) => Ok(b),
        other => bail!("{expression} gave {other:?}, not a bool"),
    }
}

#[test]
fn gpu_memory_pods_that_may_run_as_root_are_refused_by_the_install() -> Result<()> {
    // A root process in a gpu-memory container can connect to its GPU's MPS control socket
    // (root passes the socket's mode) and send `quit`: the API server must refuse the pod.
    let (matched, valid) = tenant_policy()?;
    let gpu_memory = serde_json::json!({"limits": {"awesome-ai-company.com/gpu-memory": "8"}});
    let pod = |pod_ctx: serde_json::Value, containers: serde_json::Value| {
        let mut pod = serde_json::json!({"spec": {"containers": containers}});
        if !pod_ctx.is_null() {
            pod["spec"]["securityContext"] = pod_ctx;
        }
        pod
    };
    let cases = [
        // (what, pod, matched, admitted)
        (
            "no security context",
            pod(
                serde_json::Value::Null,
                serde_json::json!([{"name": "c", "resources": gpu_memory}]),
            ),
            true,
            false,
        ),
        (
            "runAsNonRoot on the pod",
            pod(
                serde_json::json!({"runAsNonRoot": true}),
                serde_json::json!([{"name": "c", "resources": gpu_memory}]),
            ),
            true,
            true,
        ),
        (
            "runAsNonRoot on the container",
            pod(
                serde_json::Value::Null,
                serde_json::json!([{"name": "c", "resources": gpu_memory, "securityContext": {"runAsNonRoot": true}}]),
            ),
            true,
            true,
        ),
        (
            "the container undoes the pod's",
            pod(
                serde_json::json!({"runAsNonRoot": true}),
                serde_json::json!([{"name": "c", "resources": gpu_memory, "securityContext": {"runAsNonRoot": false}}]),
            ),
            true,
            false,
        ),
        (
            "a root sidecar beside the GPU container",
            pod(
                serde_json::Value::Null,
                serde_json::json!([{"name": "c", "resources": gpu_memory, "securityContext": {"runAsNonRoot": true}}, {"name": "side"}]),
            ),
            true,
            false,
        ),
        (
            "gpu-memory in requests only",
            pod(
                serde_json::Value::Null,
                serde_json::json!([{"name": "c", "resources": {"requests": {"awesome-ai-company.com/gpu-memory": "1"}}}]),
            ),
            true,
            false,
        ),
        (
            "a whole GPU (no MPS)",
            pod(
                serde_json::Value::Null,
                serde_json::json!([{"name": "c", "resources": {"limits": {"awesome-ai-company.com/gpu": "1"}}}]),
            ),
            false,
            false,
        ),
        (
            "no resources at all",
            pod(serde_json::Value::Null, serde_json::json!([{"name": "c"}])),
            false,
            false,
        ),
    ];
    for (what, pod, want_matched, want_admitted) in cases {
        ensure!(cel_true(&matched, &pod)? == want_matched, "{what}: matched is not {want_matched}");
        if want_matched {
            ensure!(
                cel_true(&valid, &pod)? == want_admitted,
                "{what}: admitted is not {want_admitted}"
            );
        }
    }
    // An init container asking for gpu-memory is matched and held to the same rule.
    let init = serde_json::json!({"spec": {"containers": [{"name": "c"}], "initContainers": [{"name": "i", "resources": gpu_memory}]}});
    ensure!(cel_true(&matched, &init)? && !cel_true(&valid, &init)?, "an init container");
    Ok(())
}
