//! The install (the Helm chart `packaging/helm/baleen`, and the plain manifests rendered from
//! it), the image (`packaging/docker`) and the example pods (`packaging/examples/pods`), checked
//! against the code so that they cannot drift from it: the chart is rendered by the real `helm
//! template` for its default values and every values file under its `ci/`, every object parsed
//! strictly into the Kubernetes API types (a round trip that must give back the same document,
//! so a misspelt or misplaced field fails), the DaemonSets' arguments parsed by the agent's own
//! command line and its ConfigMap by the agent's own configuration loader, the extender's by its
//! own, every host path the agent uses checked to be mounted at the same path, RBAC checked
//! against `kube_access`, and the policies' CEL evaluated.

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
    MutatingWebhookConfiguration, ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding,
};
use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::core::v1::{
    ConfigMap, Container, Namespace, Pod, PodSpec, Service, ServiceAccount,
};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, PolicyRule, Role, RoleBinding};
use k8s_openapi::api::resource::v1::DeviceClass;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// The values the chart is checked with: its defaults, and each file under its `ci/`.
const VALUES: [&str; 10] = [
    "default",
    "kubelet-pod-reads",
    "dra",
    "cpu-only-pods",
    "mig",
    "no-mps",
    "extender-service",
    "prometheus-operator",
    "cgroupfs",
    "custom-domain",
];
const AGENT: &str = "baleen-agent";
const DRA_AGENT: &str = "baleen-agent-dra";
const MPS: &str = "baleen-mps";
const CHART: &str = "packaging/helm/baleen";

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The values file of `name`.
fn values_file(name: &str) -> PathBuf {
    let chart = repo().join(CHART);
    if name == "default" {
        chart.join("values.yaml")
    } else {
        chart.join(format!("ci/{name}-values.yaml"))
    }
}

/// `helm` with `args`, its standard output.
fn helm(args: &[&str]) -> Result<String> {
    let out = Command::new("helm").args(args).current_dir(repo()).output().map_err(|e| {
        anyhow!(
            "cannot run helm ({e}): these tests render the chart with the real helm; put helm 3.8 \
             or later on PATH (scripts/install-kube-tools.sh installs helm 4.1.4 and prints where)"
        )
    })?;
    ensure!(
        out.status.success(),
        "helm {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8(out.stdout)?)
}

/// The chart rendered with the values `name`, as the plain manifests are (the namespace too).
fn render(name: &str) -> Result<String> {
    let values = values_file(name);
    let values = values.to_str().context("path")?;
    helm(&[
        "template",
        "baleen",
        CHART,
        "--namespace",
        "baleen-system",
        "--set",
        "namespace.create=true",
        "--values",
        values,
    ])
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
    device_classes: Vec<DeviceClass>,
    policy_bindings: Vec<ValidatingAdmissionPolicyBinding>,
    webhooks: Vec<MutatingWebhookConfiguration>,
    network_policies: Vec<k8s_openapi::api::networking::v1::NetworkPolicy>,
    /// cert-manager's and the Prometheus Operator's other objects, by kind (no typed crate).
    custom: Vec<Value>,
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
                "MutatingWebhookConfiguration" => install.webhooks.push(strict(&doc)?),
                "DeviceClass" => install.device_classes.push(strict(&doc)?),
                "NetworkPolicy" => install.network_policies.push(strict(&doc)?),
                "PrometheusRule" | "Certificate" | "Issuer" => install.custom.push(doc),
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

    /// Every (API group, resource, verb) bound to service account `account` by the install's
    /// own roles (the cluster's built-in roles it binds: [`Self::builtin_roles_of`]).
    fn granted_to(&self, account: &str) -> Result<BTreeSet<(String, String, String)>> {
        let mut granted = BTreeSet::new();
        for (kind, role, subjects) in &self.bindings {
            if !subjects.iter().any(|s| s == account) || is_builtin(role) {
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

    /// The cluster's built-in roles bound to `account`.
    fn builtin_roles_of(&self, account: &str) -> BTreeSet<String> {
        self.bindings
            .iter()
            .filter(|(_, role, subjects)| is_builtin(role) && subjects.iter().any(|s| s == account))
            .map(|(_, role, _)| role.clone())
            .collect()
    }

    fn daemon_set(&self, name: &str) -> Option<&DaemonSet> {
        self.daemon_sets.iter().find(|d| d.metadata.name.as_deref() == Some(name))
    }
}

/// A role the cluster has built in (bound by the install, defined by Kubernetes).
fn is_builtin(role: &str) -> bool {
    role.starts_with("system:") || role == "extension-apiserver-authentication-reader"
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

/// The host paths either agent uses whatever its kubelet API: pod-resources, the state, the
/// MPS root and the cgroup tree where they are on, and what the device-isolation checks read
/// at start (the CDI spec directories, the toolkit's settings).
fn host_paths_used(a: &baleen_agent::run::AgentConfig) -> Result<Vec<PathBuf>> {
    let mut used = vec![
        a.pod_resources_socket.parent().context("socket dir")?.to_path_buf(),
        a.state_dir.clone(),
    ];
    if a.mps.enabled {
        used.push(a.mps.root.clone());
    }
    if a.colocation.enabled {
        used.push(a.colocation.cgroup_root.clone());
    }
    used.extend(a.devices.cdi_spec_dirs.iter().cloned());
    used.push(a.devices.toolkit_config.parent().context("toolkit dir")?.to_path_buf());
    Ok(used)
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
    let mut used = host_paths_used(a)?;
    used.push(a.device_plugin_dir.clone());
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
    // The kubelet's credentials where the node's pods are read with them: read-only, the
    // kubeconfig and the directories of the files it names (its client certificate).
    if let Some(kubeconfig) = &settings.pods_kubeconfig {
        used.push(kubeconfig.clone());
        for m in c.volume_mounts.iter().flatten() {
            if m.name.starts_with("kubelet-credentials") {
                ensure!(
                    m.read_only == Some(true),
                    "{}: the kubelet's credentials, writable",
                    m.name
                );
                used.push(PathBuf::from(&m.mount_path));
            }
        }
    } else {
        ensure!(
            !c.volume_mounts.iter().flatten().any(|m| m.name.starts_with("kubelet-credentials")),
            "the kubelet's credentials mounted, and not used"
        );
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
    // Exec probes of the agent's own binary on its loopback probe address (no other pod
    // reaches it: a flood of the metrics port cannot starve them).
    ensure!(a.metrics.probe_address.ip().is_loopback(), "the probe address is on loopback");
    for (probe, path) in [(&c.liveness_probe, "/healthz"), (&c.readiness_probe, "/readyz")] {
        let probe = probe.as_ref().context("a probe")?;
        ensure!(probe.http_get.is_none() && probe.grpc.is_none(), "an exec probe");
        let argv = probe.exec.as_ref().and_then(|e| e.command.clone()).context("exec")?;
        let cli = baleen_agent::cli::Cli::try_parse_from(&argv)
            .map_err(|e| anyhow!("the probe {argv:?}: {e}"))?;
        let url = format!("http://{}{path}", a.metrics.probe_address);
        ensure!(
            matches!(&cli.command, Some(baleen_agent::cli::Command::Probe { url: u, .. }) if *u == url),
            "the probe {argv:?} is not the agent's probe of {url}"
        );
        ensure!(argv.first().is_some_and(|b| b.ends_with("/baleen-agent")), "{argv:?}");
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
            labels.get(&format!("{}/gpu-sharing", a.views.domain)).map(String::as_str)
                == Some("accounting-only"),
            "an install without MPS says so on its pods"
        );
    }

    // RBAC: exactly what the agent calls.
    let sa = spec.service_account_name.clone().context("serviceAccountName")?;
    ensure!(install.service_accounts.iter().any(|s| s.metadata.name.as_deref() == Some(&sa)));
    let granted = install.granted_to(&sa)?;
    // With the DRA agent beside it (same account), what it calls too.
    let dra: &[baleen_agent::kube_access::ApiRule] = if install.daemon_set(DRA_AGENT).is_some() {
        baleen_agent::kube_access::DRA_AGENT
    } else {
        &[]
    };
    // Its node's pods with its own account, unless it reads them with the kubelet's.
    let pods: &[baleen_agent::kube_access::ApiRule] =
        if settings.pods_kubeconfig.is_some() { &[] } else { baleen_agent::kube_access::POD_READS };
    let called = calls(
        baleen_agent::kube_access::AGENT
            .iter()
            .chain(dra)
            .chain(pods)
            .map(|r| (r.api_group, r.resource, r.verbs)),
    );
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
    for monitor in
        install.service_monitors.iter().filter(|m| m.metadata.name.as_deref() == Some(AGENT))
    {
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
fn every_values_file_renders_into_valid_objects_that_match_the_agent() -> Result<()> {
    let scratch = tempfile::tempdir()?;
    let mut problems = Vec::new();
    let mut seen = BTreeMap::new();
    for name in VALUES {
        let checked = check_overlay(name, scratch.path()).and_then(|install| {
            let agent = install.daemon_set(AGENT).context("agent")?;
            let spec = pod_spec(agent)?;
            let (_, s) = settings_of(&install, spec, only_container(spec)?, scratch.path())?;
            check_scheduling(&install, &s.agent.views.domain)
                .with_context(|| format!("{name}: the scheduler"))?;
            if name == "dra" {
                check_dra_agent(&install, scratch.path()).context("the DRA agent")?;
            } else {
                ensure!(install.daemon_set(DRA_AGENT).is_none(), "{name}: no DRA agent");
            }
            let operator = name == "prometheus-operator";
            ensure!(
                install.service_monitors.is_empty() != operator,
                "{name}: ServiceMonitors only with the Prometheus Operator"
            );
            let rules = install.custom.iter().filter(|d| d["kind"] == "PrometheusRule").count();
            ensure!((rules == 1) == operator, "{name}: a PrometheusRule only with the operator");
            Ok((s, install))
        });
        match checked {
            Ok(found) => {
                seen.insert(name, found);
            }
            Err(e) => problems.push(format!("{name}: {e:#}")),
        }
    }
    ensure!(problems.is_empty(), "{}", problems.join("\n"));
    // What distinguishes the values files.
    let agent = |name: &str| &seen[name].0.agent;
    ensure!(agent("mig").views.mig && !agent("default").views.mig, "MIG views");
    ensure!(!agent("no-mps").mps.enabled && agent("default").mps.enabled, "MPS");
    ensure!(
        agent("cgroupfs").colocation.cgroup_driver
            == baleen_agent::isolation::cgroups::Driver::Cgroupfs,
        "the cgroupfs kubelet's driver"
    );
    ensure!(agent("custom-domain").views.domain == "gpus.example.org", "the custom domain");
    let runtime = seen["cgroupfs"]
        .1
        .daemon_set(AGENT)
        .and_then(|d| d.spec.as_ref()?.template.spec.as_ref()?.runtime_class_name.clone());
    ensure!(runtime.as_deref() == Some("nvidia"), "runtimeClassName: {runtime:?}");
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

/// The resources the agent would advertise on the example nodes with every view on, in
/// `domain`.
fn advertised(domain: &str) -> Result<BTreeSet<String>> {
    let mut names = BTreeSet::new();
    for entry in std::fs::read_dir(repo().join("packaging/examples"))? {
        let path = entry?.path();
        if path.extension().is_none_or(|e| e != "yaml") {
            continue;
        }
        let inventory = SimulatedInventory::from_file(&path)?.discover()?;
        let config =
            baleen_agent::ledger::ViewConfig { domain: domain.to_owned(), ..Default::default() };
        let ledger = DeviceLedger::new("node-a", &inventory, config.clone())?;
        names.extend(ledger.views().iter().map(|v| v.resource_name(&config.domain)));
    }
    Ok(names)
}

#[test]
fn example_pods_are_valid_and_ask_for_what_the_agent_advertises() -> Result<()> {
    let advertised = advertised(baleen_k8s::gpu_state::DEFAULT_DOMAIN)?;
    let install = Install::parse(&render("default")?)?;
    let dir = repo().join("packaging/examples/pods");
    let mut asked = BTreeSet::new();
    for entry in std::fs::read_dir(&dir)? {
        let path = entry?.path();
        let text = std::fs::read_to_string(&path)?;
        for doc in documents(&text)? {
            let pod: Pod = strict(&doc).with_context(|| path.display().to_string())?;
            // What the install's tenant policy matches, it admits (the examples run as shown).
            let admitted = tenant_admits(&install, &doc)?;
            ensure!(admitted != Some(false), "{}: refused by the install", path.display());
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

/// The extender's Deployment (beside kube-scheduler in the second scheduler, or alone behind a
/// Service), its Service and RBAC, the webhook, and the kube-scheduler configuration that calls
/// it; nothing of it when the chart places no scheduler.
fn check_scheduling(install: &Install, domain: &str) -> Result<()> {
    let Some(deployment) = install.deployments.first() else {
        ensure!(install.webhooks.is_empty(), "a webhook without the extender");
        return Ok(());
    };
    ensure!(install.deployments.len() == 1, "one Deployment");
    let name = deployment.metadata.name.clone().context("name")?;
    let second = name == "baleen-scheduler";
    ensure!(second || name == "baleen-extender", "Deployment {name}");
    let spec = deployment.spec.as_ref().and_then(|s| s.template.spec.as_ref()).context("pod")?;
    ensure!(spec.containers.len() == if second { 2 } else { 1 }, "containers");
    let c = spec.containers.iter().find(|c| c.name == "extender").context("the extender")?;
    let mut argv: Vec<String> = c.command.clone().unwrap_or_default();
    ensure!(
        argv.first().is_some_and(|b| b.ends_with("/baleen-extender")),
        "the extender's command: {argv:?}"
    );
    argv.extend(c.args.iter().flatten().cloned());
    let args =
        baleen_extender::run::Cli::try_parse_from(&argv).map_err(|e| anyhow!("{argv:?}: {e}"))?.run;
    ensure!(args.policy.parse::<baleen_scheduler_core::policy::PolicyKind>().is_ok(), "policy");
    ensure!(
        args.domain == domain,
        "the extender's domain {} is not the agent's {domain}",
        args.domain
    );
    let webhook = args.webhook().map_err(|e| anyhow!(e))?;
    ensure!(
        c.image.as_deref() == Some(format!("baleen:{}", env!("CARGO_PKG_VERSION")).as_str()),
        "one image for the agent and the extender"
    );
    let port_named = |name: &str| {
        c.ports.iter().flatten().find(|p| p.name.as_deref() == Some(name)).map(|p| p.container_port)
    };
    // Filter and prioritize: on localhost beside kube-scheduler (no other caller reaches them),
    // or on the pod's address behind the Service.
    if second {
        ensure!(
            args.listen.ip().is_loopback(),
            "beside kube-scheduler the verbs listen on localhost"
        );
        ensure!(port_named("http").is_none(), "no port for the verbs");
    } else {
        let port = port_named("http").context("a port named http")?;
        ensure!(i64::from(port) == i64::from(args.listen.port()), "the listen port");
    }
    let metrics = args.metrics_listen.context("--metrics-listen: probes and Prometheus")?;
    ensure!(
        port_named("metrics").map(i64::from) == Some(i64::from(metrics.port())),
        "the metrics port"
    );
    // Exec probes of the extender's own binary on its loopback probe listener.
    ensure!(args.probe_listen.ip().is_loopback(), "the probe listener is on loopback");
    for (probe, path) in [(&c.liveness_probe, "/healthz"), (&c.readiness_probe, "/readyz")] {
        let probe = probe.as_ref().context("a probe")?;
        ensure!(probe.http_get.is_none() && probe.grpc.is_none(), "an exec probe");
        let argv = probe.exec.as_ref().and_then(|e| e.command.clone()).context("exec")?;
        let cli = baleen_extender::run::Cli::try_parse_from(&argv)
            .map_err(|e| anyhow!("the probe {argv:?}: {e}"))?;
        let url = format!("http://{}{path}", args.probe_listen);
        ensure!(
            matches!(&cli.command, Some(baleen_extender::run::Command::Probe { url: u, .. }) if *u == url),
            "the probe {argv:?} is not the extender's probe of {url}"
        );
    }
    let pod_security = spec.security_context.as_ref().context("pod securityContext")?;
    ensure!(pod_security.run_as_non_root == Some(true), "the extender runs as non-root");
    for c in &spec.containers {
        let security = c.security_context.as_ref().context("securityContext")?;
        ensure!(security.read_only_root_filesystem == Some(true), "{}: read-only root", c.name);
        ensure!(
            security.capabilities.as_ref().and_then(|c| c.drop.clone())
                == Some(vec!["ALL".to_owned()]),
            "{}: no capabilities",
            c.name
        );
    }
    // RBAC: exactly what the extender calls (and, in the second scheduler, kube-scheduler's
    // built-in roles and its own lease).
    let account = spec.service_account_name.clone().context("serviceAccountName")?;
    let own_certificate = matches!(
        webhook.as_ref().map(|w| &w.certificates),
        Some(baleen_extender::run::Certificates::Own { .. })
    );
    let mut rules: Vec<_> = baleen_extender::kube_access::EXTENDER.to_vec();
    if own_certificate {
        rules.extend_from_slice(baleen_extender::kube_access::WEBHOOK_OWN_CERTIFICATE);
    }
    if args.claims().enabled() {
        rules.extend_from_slice(baleen_extender::kube_access::DRA_CLAIMS);
    }
    let mut called = calls(rules.iter().map(|r| (r.api_group, r.resource, r.verbs)));
    let builtin = install.builtin_roles_of(&account);
    if second {
        for verb in ["create", "get", "update"] {
            called.insert(("coordination.k8s.io".into(), "leases".into(), verb.into()));
        }
        let wanted: BTreeSet<String> = [
            "system:kube-scheduler",
            "system:volume-scheduler",
            "extension-apiserver-authentication-reader",
        ]
        .map(String::from)
        .into();
        ensure!(builtin == wanted, "built-in roles bound: {builtin:?}");
    } else {
        ensure!(builtin.is_empty(), "built-in roles bound: {builtin:?}");
    }
    let granted = install.granted_to(&account)?;
    ensure!(granted == called, "RBAC grants {granted:?}, the code calls {called:?}");
    // The Service.
    let service = install
        .services
        .iter()
        .find(|s| s.metadata.name.as_deref() == Some("baleen-extender"))
        .context("the extender's Service")?;
    let svc = service.spec.as_ref().context("spec")?;
    let ns = service.metadata.namespace.clone().context("namespace")?;
    let svc_port = |name: &str| {
        svc.ports.iter().flatten().find(|p| p.name.as_deref() == Some(name)).map(|p| {
            ensure!(
                p.target_port
                    == Some(k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::String(
                        name.into()
                    )),
                "Service port {name} targets the container's"
            );
            Ok(p.port)
        })
    };
    svc_port("metrics").context("the Service's metrics port")??;
    // kube-scheduler's configuration: the extender's address, the verbs it serves, and every
    // resource an agent advertises on the example nodes.
    let (map, key) = if second {
        ("baleen-scheduler-config", "config.yaml")
    } else {
        ("baleen-kube-scheduler-config", "kube-scheduler-config.yaml")
    };
    let text = install
        .config_maps
        .iter()
        .find(|m| m.metadata.name.as_deref() == Some(map))
        .and_then(|m| m.data.as_ref()?.get(key).cloned())
        .with_context(|| format!("ConfigMap {map}"))?;
    let config = documents(&text)?.into_iter().next().context("a document")?;
    ensure!(config["kind"] == "KubeSchedulerConfiguration");
    ensure!(config["apiVersion"] == "kubescheduler.config.k8s.io/v1");
    let extenders = config["extenders"].as_array().context("extenders")?;
    ensure!(extenders.len() == 1, "one extender");
    let e = &extenders[0];
    // Every feasible node goes to the extender, not kube-scheduler's adaptive sample, which
    // hid partly used GPUs from it on the default trace (docs/benchmarks.md).
    ensure!(
        config["profiles"][0]["percentageOfNodesToScore"] == 100,
        "the profile looks at every feasible node: {}",
        config["profiles"][0]
    );
    let url = if second {
        let profiles = config["profiles"].as_array().context("profiles")?;
        ensure!(profiles.len() == 1, "one profile");
        let scheduler = args.scheduler_name.clone().context("--scheduler-name")?;
        ensure!(profiles[0]["schedulerName"] == scheduler.as_str(), "the profile is the webhook's");
        ensure!(config["leaderElection"]["leaderElect"] == true, "leader elected");
        ensure!(config["leaderElection"]["resourceName"] == scheduler.as_str(), "its own lease");
        format!("http://{}{}", args.listen, args.url_prefix)
    } else {
        let port = svc_port("http").context("the Service's http port")??;
        let ip =
            svc.cluster_ip.clone().context("a fixed cluster IP for a host-network scheduler")?;
        format!("http://{ip}:{port}{}", args.url_prefix)
    };
    let url = if args.verbs_tls().is_some() { url.replacen("http:", "https:", 1) } else { url };
    ensure!(e["urlPrefix"] == url.as_str(), "urlPrefix {} is not {url}", e["urlPrefix"]);
    ensure!(
        e["enableHTTPS"] == args.verbs_tls().is_some(),
        "enableHTTPS {} while the extender's TLS is {:?}",
        e["enableHTTPS"],
        args.verbs_tls()
    );
    if !second {
        check_verbs_reach(install, &args, e, spec, c, &ns)?;
    }
    ensure!(e["filterVerb"] == "filter" && e["prioritizeVerb"] == "prioritize");
    ensure!(e["bindVerb"] == "bind", "the extender binds (issue 25, item 2)");
    ensure!(e["preemptVerb"] == "preempt", "the extender trims preemption (issue 25, item 4)");
    ensure!(e["nodeCacheCapable"] == true, "the extender keeps a node cache");
    ensure!(e["weight"].as_i64().is_some_and(|w| w >= 1), "a weight");
    if args.score_cpu_only_pods {
        // Every pod of the profile goes to the extender (the CPU-only ones to be scored); only
        // beside its own scheduler, where only the webhook's pods come.
        ensure!(second, "--score-cpu-only-pods only in baleen's own scheduler");
        ensure!(e["managedResources"].is_null(), "no managedResources with CPU-only pods sent");
    }
    // Judging the pods that hold claims of baleen's class (`--dra-device-class`): every pod of
    // the profile goes to the extender too, beside its own scheduler only.
    let judges_claims = args.claims().enabled();
    if judges_claims {
        ensure!(second, "--dra-device-class only in baleen's own scheduler");
        ensure!(e["managedResources"].is_null(), "no managedResources with claim pods judged");
    }
    let every_pod = args.score_cpu_only_pods || judges_claims;
    let managed: BTreeSet<String> = e["managedResources"]
        .as_array()
        .or(every_pod.then_some(&Vec::new()))
        .context("managedResources")?
        .iter()
        .map(|r| r["name"].as_str().unwrap_or_default().to_owned())
        .collect();
    let advertised = advertised(domain)?;
    for name in &managed {
        ensure!(advertised.contains(name), "{name} is managed but no agent advertises it");
    }
    for name in advertised.iter().filter(|_| !every_pod) {
        ensure!(managed.contains(name), "{name} is advertised on an example node but not managed");
    }
    // The webhook: the API server reaches it through the Service, over TLS with a certificate
    // for the Service's name; an outage admits pods unchanged.
    match (&webhook, install.webhooks.as_slice()) {
        (None, []) => {}
        (Some(w), [config]) => {
            let hooks = config.webhooks.as_deref().unwrap_or_default();
            // The second, with scheduler.cpuOnlyPods: CPU-only pods of opted-in namespaces.
            let want = if args.score_cpu_only_pods { 2 } else { 1 };
            ensure!(hooks.len() == want, "{want} webhooks, {} rendered", hooks.len());
            if let Some(cpu) = hooks.get(1) {
                let path = cpu.client_config.service.as_ref().and_then(|s| s.path.as_deref());
                ensure!(path == Some("/mutate-cpu-only-pods"), "the CPU-only path: {path:?}");
                ensure!(cpu.failure_policy.as_deref() == Some("Ignore"), "an outage admits pods");
                let labels = cpu
                    .namespace_selector
                    .as_ref()
                    .and_then(|n| n.match_labels.clone())
                    .unwrap_or_default();
                ensure!(!labels.is_empty(), "only namespaces that opt in");
            }
            let hook = &hooks[0];
            ensure!(hook.failure_policy.as_deref() == Some("Ignore"), "an outage admits pods");
            ensure!(hook.side_effects == "None", "no side effects");
            let service_ref = hook.client_config.service.as_ref().context("a service")?;
            ensure!(service_ref.name == "baleen-extender" && service_ref.namespace == ns);
            ensure!(service_ref.path.as_deref() == Some("/mutate-pods"), "the path");
            let port = svc_port("webhook").context("the Service's webhook port")??;
            ensure!(service_ref.port == Some(port), "the Service's webhook port");
            ensure!(
                port_named("webhook").map(i64::from) == Some(i64::from(w.listen.port())),
                "the container's webhook port is --webhook-listen"
            );
            let dns = format!("baleen-extender.{ns}.svc");
            match &w.certificates {
                baleen_extender::run::Certificates::Own { configuration, dns_names, .. } => {
                    ensure!(
                        config.metadata.name.as_ref() == Some(configuration),
                        "caBundle target"
                    );
                    ensure!(
                        dns_names == std::slice::from_ref(&dns),
                        "the certificate's names {dns_names:?}"
                    );
                }
                baleen_extender::run::Certificates::Directory(dir) => {
                    let cert = install
                        .custom
                        .iter()
                        .find(|d| d["kind"] == "Certificate")
                        .context("cert-manager's Certificate")?;
                    ensure!(cert["spec"]["dnsNames"] == serde_json::json!([dns]), "dnsNames");
                    let secret = cert["spec"]["secretName"].as_str().context("secretName")?;
                    let mount = c
                        .volume_mounts
                        .iter()
                        .flatten()
                        .find(|m| Path::new(&m.mount_path) == dir)
                        .context("the certificate's directory is mounted")?;
                    let volume = spec.volumes.iter().flatten().find(|v| v.name == mount.name);
                    ensure!(
                        volume.and_then(|v| v.secret.as_ref()?.secret_name.clone()).as_deref()
                            == Some(secret),
                        "the Certificate's Secret is what is mounted"
                    );
                    let inject = config.metadata.annotations.clone().unwrap_or_default();
                    ensure!(
                        inject.get("cert-manager.io/inject-ca-from")
                            == Some(&format!(
                                "{ns}/{}",
                                cert["metadata"]["name"].as_str().unwrap_or_default()
                            )),
                        "cert-manager injects the CA"
                    );
                }
            }
        }
        (w, hooks) => bail!("webhook flags {w:?} and {} configurations", hooks.len()),
    }
    Ok(())
}

/// Behind a Service (issue 24, item 9), only kube-scheduler reaches filter and prioritize: the
/// NetworkPolicy opens the verbs' port to ipBlocks only, and with TLS the extender demands a
/// client certificate of the CA in its serving Secret (`--client-ca` there), the scheduler's
/// configuration verifies the Service's name and presents a client certificate, and
/// cert-manager's Certificates (when used) are for that name and client authentication, from
/// one issuer.
fn check_verbs_reach(
    install: &Install,
    args: &baleen_extender::run::Args,
    stanza: &Value,
    spec: &PodSpec,
    c: &Container,
    ns: &str,
) -> Result<()> {
    let pod_labels = install
        .deployments
        .first()
        .and_then(|d| d.spec.as_ref()?.template.metadata.as_ref()?.labels.clone())
        .unwrap_or_default();
    let open = |port: &str| -> Result<Option<Vec<String>>> {
        let mut found = None;
        for policy in &install.network_policies {
            let spec = policy.spec.as_ref().context("NetworkPolicy spec")?;
            let selects = spec
                .pod_selector
                .as_ref()
                .and_then(|s| s.match_labels.clone())
                .unwrap_or_default()
                .iter()
                .all(|(k, v)| pod_labels.get(k) == Some(v));
            if !selects {
                continue;
            }
            for rule in spec.ingress.iter().flatten() {
                let named = rule.ports.iter().flatten().any(|p| {
                    p.port
                        == Some(k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::String(
                            port.into(),
                        ))
                });
                if !named {
                    continue;
                }
                let from = rule.from.clone().unwrap_or_default();
                ensure!(!from.is_empty(), "the NetworkPolicy opens port {port} to anyone");
                let mut cidrs = Vec::new();
                for peer in from {
                    ensure!(
                        peer.pod_selector.is_none() && peer.namespace_selector.is_none(),
                        "port {port} is open to pods, not only to the scheduler's addresses"
                    );
                    cidrs.push(peer.ip_block.context("an ipBlock")?.cidr);
                }
                found = Some(cidrs);
            }
        }
        Ok(found)
    };
    let cidrs = open("http")?.context("no NetworkPolicy limits who reaches the verbs")?;
    ensure!(!cidrs.is_empty(), "the verbs' port is reachable from nowhere");
    let Some(tls) = args.verbs_tls() else { return Ok(()) };
    let dns = format!("baleen-extender.{ns}.svc");
    let client_ca = tls.client_ca.clone().context("TLS without client certificates")?;
    ensure!(
        client_ca.parent() == Some(tls.cert_dir.as_path()),
        "the client CA {} is the serving Secret's ca.crt",
        client_ca.display()
    );
    let tls_config = &stanza["tlsConfig"];
    ensure!(tls_config["serverName"] == dns.as_str(), "the scheduler verifies {dns}");
    ensure!(tls_config["insecure"].is_null(), "no insecure TLS");
    for key in ["caFile", "certFile", "keyFile"] {
        ensure!(tls_config[key].is_string(), "tlsConfig.{key}: the scheduler's client certificate");
    }
    let mount = c
        .volume_mounts
        .iter()
        .flatten()
        .find(|m| Path::new(&m.mount_path) == tls.cert_dir)
        .context("the extender's certificate directory is mounted")?;
    let secret = spec
        .volumes
        .iter()
        .flatten()
        .find(|v| v.name == mount.name)
        .and_then(|v| v.secret.as_ref()?.secret_name.clone())
        .context("a Secret at the certificate directory")?;
    let certificates: Vec<&Value> =
        install.custom.iter().filter(|d| d["kind"] == "Certificate").collect();
    if certificates.is_empty() {
        return Ok(()); // The operator's own Secret (extender.tls.certificates: secret).
    }
    let serving = certificates
        .iter()
        .find(|d| d["spec"]["secretName"] == secret.as_str())
        .context("cert-manager's Certificate for the mounted Secret")?;
    ensure!(serving["spec"]["dnsNames"] == serde_json::json!([dns]), "the serving dnsNames");
    ensure!(serving["spec"]["usages"] == serde_json::json!(["server auth"]), "server auth");
    let client = certificates
        .iter()
        .find(|d| d["spec"]["usages"] == serde_json::json!(["client auth"]))
        .context("a client Certificate for kube-scheduler")?;
    ensure!(
        client["spec"]["issuerRef"] == serving["spec"]["issuerRef"],
        "one issuer signs the serving and the client certificate, so ca.crt verifies the client"
    );
    Ok(())
}

/// Whether the install's tenant policy (rendered with `values`) matches `pod` and, if so,
/// admits it: `None` when not matched. Its binding denies, and an error admits nothing.
fn tenant_admits(install: &Install, pod: &Value) -> Result<Option<bool>> {
    let name = "baleen-gpu-memory-non-root";
    let binding = install
        .policy_bindings
        .iter()
        .find(|b| b.spec.as_ref().and_then(|s| s.policy_name.as_deref()) == Some(name))
        .context("a binding")?;
    let bound = binding.spec.as_ref().context("binding spec")?;
    ensure!(bound.validation_actions.as_deref() == Some(&["Deny".to_owned()][..]), "it denies");
    policy_admits(install, name, &Value::Null, pod, &Value::Null)
}

fn cel_true(expression: &str, pod: &serde_json::Value) -> Result<bool> {
    match cel_eval(expression, &[("object", pod)], &std::collections::HashMap::new())? {
        cel::Value::Bool(b) => Ok(b),
        other => bail!("{expression} gave {other:?}, not a bool"),
    }
}

#[test]
fn gpu_memory_pods_that_may_run_as_root_are_refused_by_the_install() -> Result<()> {
    // A root process in a gpu-memory container can connect to its GPU's MPS control socket
    // (root passes the socket's mode) and send `quit`: the API server must refuse the pod. A
    // setuid-root binary in the tenant's image makes a non-root process root again unless
    // privilege escalation is off (no_new_privs), and a privileged container or an added
    // capability (CAP_DAC_OVERRIDE passes the socket's mode) is as good as root.
    let install = Install::parse(&render("default")?)?;
    let gpu_memory = serde_json::json!({"limits": {"awesome-ai-company.com/gpu-memory": "8"}});
    let safe = serde_json::json!({"runAsNonRoot": true, "allowPrivilegeEscalation": false});
    let with = |extra: Value| {
        let mut ctx = safe.clone();
        for (k, v) in extra.as_object().into_iter().flatten() {
            ctx[k] = v.clone();
        }
        ctx
    };
    let pod = |pod_ctx: Value, containers: Value| {
        let mut pod = serde_json::json!({"spec": {"containers": containers}});
        if !pod_ctx.is_null() {
            pod["spec"]["securityContext"] = pod_ctx;
        }
        pod
    };
    let one = |ctx: Value| {
        let mut c = serde_json::json!({"name": "c", "resources": gpu_memory});
        if !ctx.is_null() {
            c["securityContext"] = ctx;
        }
        pod(Value::Null, serde_json::json!([c]))
    };
    let cases = [
        // (what, pod, matched and admitted: None when not matched)
        ("no security context", one(Value::Null), Some(false)),
        ("non-root, no escalation", one(safe.clone()), Some(true)),
        (
            "runAsNonRoot on the pod, no escalation on the container",
            pod(
                serde_json::json!({"runAsNonRoot": true}),
                serde_json::json!([{"name": "c", "resources": gpu_memory,
                    "securityContext": {"allowPrivilegeEscalation": false}}]),
            ),
            Some(true),
        ),
        (
            "runAsNonRoot without allowPrivilegeEscalation",
            one(serde_json::json!({"runAsNonRoot": true})),
            Some(false),
        ),
        (
            "allowPrivilegeEscalation: true",
            one(with(serde_json::json!({"allowPrivilegeEscalation": true}))),
            Some(false),
        ),
        (
            "the container undoes the pod's",
            one(with(serde_json::json!({"runAsNonRoot": false}))),
            Some(false),
        ),
        ("privileged", one(with(serde_json::json!({"privileged": true}))), Some(false)),
        ("privileged: false", one(with(serde_json::json!({"privileged": false}))), Some(true)),
        (
            "an added capability",
            one(with(serde_json::json!({"capabilities": {"add": ["DAC_OVERRIDE"]}}))),
            Some(false),
        ),
        (
            "every capability dropped",
            one(with(serde_json::json!({"capabilities": {"drop": ["ALL"], "add": []}}))),
            Some(true),
        ),
        (
            "a root sidecar beside the GPU container",
            pod(
                Value::Null,
                serde_json::json!([{"name": "c", "resources": gpu_memory, "securityContext": safe}, {"name": "side"}]),
            ),
            Some(false),
        ),
        (
            "a sidecar that may escalate",
            pod(
                serde_json::json!({"runAsNonRoot": true}),
                serde_json::json!([{"name": "c", "resources": gpu_memory, "securityContext": safe},
                    {"name": "side", "securityContext": {"allowPrivilegeEscalation": true}}]),
            ),
            Some(false),
        ),
        (
            "gpu-memory in requests only",
            pod(
                Value::Null,
                serde_json::json!([{"name": "c", "resources": {"requests": {"awesome-ai-company.com/gpu-memory": "1"}}}]),
            ),
            Some(false),
        ),
        (
            "a whole GPU (no MPS)",
            pod(
                Value::Null,
                serde_json::json!([{"name": "c", "resources": {"limits": {"awesome-ai-company.com/gpu": "1"}}}]),
            ),
            None,
        ),
        ("no resources at all", pod(Value::Null, serde_json::json!([{"name": "c"}])), None),
    ];
    for (what, pod, want) in cases {
        let got = tenant_admits(&install, &pod)?;
        ensure!(got == want, "{what}: {got:?}, not {want:?}");
    }
    // An init container asking for gpu-memory is matched and held to the same rule.
    let init = serde_json::json!({"spec": {"containers": [{"name": "c"}], "initContainers": [{"name": "i", "resources": gpu_memory}]}});
    ensure!(tenant_admits(&install, &init)? == Some(false), "an init container");
    // `kubectl debug` adds an ephemeral container (subresource pods/ephemeralcontainers, which
    // the policy matches): a root one beside the GPU container is refused, a safe one is not.
    let mut debugged = one(safe.clone());
    debugged["spec"]["ephemeralContainers"] = serde_json::json!([{"name": "debug"}]);
    ensure!(tenant_admits(&install, &debugged)? == Some(false), "a root ephemeral container");
    debugged["spec"]["ephemeralContainers"][0]["securityContext"] = safe.clone();
    ensure!(tenant_admits(&install, &debugged)? == Some(true), "a safe ephemeral container");
    let policy = install
        .admission_policies
        .iter()
        .find(|p| p.metadata.name.as_deref() == Some("baleen-gpu-memory-non-root"))
        .and_then(|p| p.spec.as_ref()?.match_constraints.clone())
        .context("the tenant policy's constraints")?;
    let resources: Vec<String> = policy
        .resource_rules
        .iter()
        .flatten()
        .flat_map(|r| r.resources.clone().unwrap_or_default())
        .collect();
    ensure!(
        resources.iter().any(|r| r == "pods/ephemeralcontainers"),
        "the policy sees containers added by kubectl debug: {resources:?}"
    );
    Ok(())
}

#[test]
fn dra_claims_of_the_gpu_class_need_a_restricted_namespace() -> Result<()> {
    // A claim of the GPU class gets the MPS pipe directory through its CDI spec; the pod names
    // only its claim, so the rule is the namespace's: Pod Security `restricted` enforced.
    let install = Install::parse(&render("dra")?)?;
    let name = "baleen-gpu-claims-restricted";
    ensure!(
        install.policy_bindings.iter().any(|b| b
            .spec
            .as_ref()
            .and_then(|s| s.policy_name.as_deref())
            == Some(name)),
        "the claims policy is bound"
    );
    let request =
        |class: &str| serde_json::json!({"name": "g", "exactly": {"deviceClassName": class}});
    let claim = |requests: Value| serde_json::json!({"spec": {"devices": {"requests": requests}}});
    let template = |requests: Value| serde_json::json!({"spec": {"spec": {"devices": {"requests": requests}}}});
    let namespace =
        |labels: Value| serde_json::json!({"metadata": {"name": "team-a", "labels": labels}});
    let restricted = serde_json::json!({"pod-security.kubernetes.io/enforce": "restricted"});
    let gpu = "gpu.awesome-ai-company.com";
    let cases = [
        // (what, object, namespace labels, matched and admitted)
        (
            "a GPU claim, restricted",
            claim(serde_json::json!([request(gpu)])),
            restricted.clone(),
            Some(true),
        ),
        (
            "a GPU claim, no labels",
            claim(serde_json::json!([request(gpu)])),
            Value::Null,
            Some(false),
        ),
        (
            "a GPU claim, baseline",
            claim(serde_json::json!([request(gpu)])),
            serde_json::json!({"pod-security.kubernetes.io/enforce": "baseline"}),
            Some(false),
        ),
        (
            "a GPU claim, restricted only warned",
            claim(serde_json::json!([request(gpu)])),
            serde_json::json!({"pod-security.kubernetes.io/warn": "restricted"}),
            Some(false),
        ),
        (
            "a GPU claim, restricted at v1.0 (before allowPrivilegeEscalation was checked)",
            claim(serde_json::json!([request(gpu)])),
            serde_json::json!({"pod-security.kubernetes.io/enforce": "restricted",
                "pod-security.kubernetes.io/enforce-version": "v1.0"}),
            Some(false),
        ),
        (
            "a GPU claim, restricted at v1.9",
            claim(serde_json::json!([request(gpu)])),
            serde_json::json!({"pod-security.kubernetes.io/enforce": "restricted",
                "pod-security.kubernetes.io/enforce-version": "v1.9"}),
            Some(false),
        ),
        (
            "a GPU claim, restricted at v1.34",
            claim(serde_json::json!([request(gpu)])),
            serde_json::json!({"pod-security.kubernetes.io/enforce": "restricted",
                "pod-security.kubernetes.io/enforce-version": "v1.34"}),
            Some(true),
        ),
        (
            "a GPU claim, restricted at latest",
            claim(serde_json::json!([request(gpu)])),
            serde_json::json!({"pod-security.kubernetes.io/enforce": "restricted",
                "pod-security.kubernetes.io/enforce-version": "latest"}),
            Some(true),
        ),
        (
            "a template, no labels",
            template(serde_json::json!([request(gpu)])),
            Value::Null,
            Some(false),
        ),
        (
            "a template, restricted",
            template(serde_json::json!([request(gpu)])),
            restricted.clone(),
            Some(true),
        ),
        (
            "a first-available alternative",
            claim(serde_json::json!([{"name": "g", "firstAvailable": [
                {"name": "a", "deviceClassName": "other.example.com"},
                {"name": "b", "deviceClassName": gpu}]}])),
            Value::Null,
            Some(false),
        ),
        (
            "v1beta1's class on the request",
            claim(serde_json::json!([{"name": "g", "deviceClassName": gpu}])),
            Value::Null,
            Some(false),
        ),
        (
            "another driver's class",
            claim(serde_json::json!([request("gpu.nvidia.com")])),
            Value::Null,
            None,
        ),
        (
            "a MIG instance (no MPS)",
            claim(serde_json::json!([request("mig.gpu.awesome-ai-company.com")])),
            Value::Null,
            None,
        ),
        ("a claim with no devices", serde_json::json!({"spec": {}}), Value::Null, None),
    ];
    for (what, object, labels, want) in cases {
        let ns = if labels.is_null() {
            serde_json::json!({"metadata": {"name": "team-a"}})
        } else {
            namespace(labels)
        };
        let got = policy_admits_with(
            &install,
            name,
            &[("object", &object), ("oldObject", &Value::Null), ("namespaceObject", &ns)],
        )?;
        ensure!(got == want, "{what}: {got:?}, not {want:?}");
    }
    // Without DRA the policy is not installed.
    let plain = Install::parse(&render("default")?)?;
    ensure!(
        !plain.admission_policies.iter().any(|p| p.metadata.name.as_deref() == Some(name)),
        "no claims policy without DRA"
    );
    Ok(())
}

/// A CEL program's value with `vars` bound (each a JSON value) and `variables` (a
/// ValidatingAdmissionPolicy's, already evaluated).
fn cel_eval(
    expression: &str,
    vars: &[(&str, &Value)],
    variables: &std::collections::HashMap<String, cel::Value>,
) -> Result<cel::Value> {
    let program = cel::Program::compile(expression).map_err(|e| anyhow!("{expression}: {e}"))?;
    let mut context = cel::Context::default();
    for (name, value) in vars {
        context.add_variable_from_value(*name, cel::to_value(value)?);
    }
    context.add_variable_from_value("variables", cel::Value::from(variables.clone()));
    program.execute(&context).map_err(|e| anyhow!("{expression}: {e}"))
}

#[test]
fn the_tenant_policy_follows_a_custom_domain() -> Result<()> {
    let install = Install::parse(&render("custom-domain")?)?;
    let pod = |resource: &str| serde_json::json!({"spec": {"containers": [{"name": "c", "resources": {"limits": {resource: "8"}}}]}});
    let custom = tenant_admits(&install, &pod("gpus.example.org/gpu-memory"))?;
    ensure!(custom == Some(false), "the custom domain's, refused as root: {custom:?}");
    let default = tenant_admits(&install, &pod("awesome-ai-company.com/gpu-memory"))?;
    ensure!(default.is_none(), "not the default's: {default:?}");
    Ok(())
}

/// The agent's Node policy (`baleen-agent-own-node`) evaluated as the API server would: its
/// match condition, then its variables, then every validation.
fn node_policy_admits(
    install: &Install,
    request: &Value,
    object: &Value,
    old: &Value,
) -> Result<Option<bool>> {
    policy_admits(install, "baleen-agent-own-node", request, object, old)
}

/// Admission policy `name` evaluated as the API server would: its match condition, then its
/// variables, then every validation.
fn policy_admits(
    install: &Install,
    name: &str,
    request: &Value,
    object: &Value,
    old: &Value,
) -> Result<Option<bool>> {
    policy_admits_with(
        install,
        name,
        &[("request", request), ("object", object), ("oldObject", old)],
    )
}

/// [`policy_admits`] with `base` bound (request, object, oldObject, namespaceObject, ...).
fn policy_admits_with(
    install: &Install,
    name: &str,
    base: &[(&str, &Value)],
) -> Result<Option<bool>> {
    let policy = install
        .admission_policies
        .iter()
        .find(|p| p.metadata.name.as_deref() == Some(name))
        .with_context(|| format!("the policy {name}"))?;
    let spec = policy.spec.as_ref().context("spec")?;
    ensure!(spec.failure_policy.as_deref() == Some("Fail"), "an error admits nothing");
    let mut variables = std::collections::HashMap::new();
    for condition in spec.match_conditions.iter().flatten() {
        match cel_eval(&condition.expression, base, &variables)? {
            cel::Value::Bool(true) => {}
            cel::Value::Bool(false) => return Ok(None),
            other => bail!("match condition gave {other:?}"),
        }
    }
    for variable in spec.variables.iter().flatten() {
        let value = cel_eval(&variable.expression, base, &variables)?;
        variables.insert(variable.name.clone(), value);
    }
    for validation in spec.validations.iter().flatten() {
        match cel_eval(&validation.expression, base, &variables)? {
            cel::Value::Bool(true) => {}
            cel::Value::Bool(false) => return Ok(Some(false)),
            other => bail!("validation gave {other:?}"),
        }
    }
    Ok(Some(true))
}

#[test]
fn the_agents_account_may_change_only_its_own_nodes_gpu_state() -> Result<()> {
    let install = Install::parse(&render("default")?)?;
    let agent = |node: &str| {
        serde_json::json!({
            "userInfo": {
                "username": "system:serviceaccount:baleen-system:baleen-agent",
                "extra": {"authentication.kubernetes.io/node-name": [node]}
            }
        })
    };
    let node = |name: &str, state: &str, label: &str| {
        serde_json::json!({
            "metadata": {
                "name": name,
                "labels": {"kubernetes.io/hostname": name, "tier": label},
                "annotations": {"awesome-ai-company.com/gpu-state": state, "other": "x"}
            },
            "spec": {"podCIDR": "10.0.0.0/24"}
        })
    };
    let old = node("gpu-1", "{\"v\":1}", "a");
    let cases = [
        ("its own node's gpu-state", agent("gpu-1"), node("gpu-1", "{\"v\":2}", "a"), Some(true)),
        ("another node's gpu-state", agent("gpu-2"), node("gpu-1", "{\"v\":2}", "a"), Some(false)),
        ("a label on its own node", agent("gpu-1"), node("gpu-1", "{\"v\":1}", "b"), Some(false)),
        (
            "a token without a node",
            serde_json::json!({"userInfo": {"username": "system:serviceaccount:baleen-system:baleen-agent"}}),
            node("gpu-1", "{\"v\":2}", "a"),
            Some(false),
        ),
        (
            "another user (not matched)",
            serde_json::json!({"userInfo": {"username": "system:node:gpu-1"}}),
            node("gpu-1", "{\"v\":2}", "b"),
            None,
        ),
    ];
    for (what, request, object, want) in cases {
        let got = node_policy_admits(&install, &request, &object, &old)?;
        ensure!(got == want, "{what}: {got:?}, not {want:?}");
    }
    // Another annotation, added or removed, and a change to the spec (a taint).
    let mut added = node("gpu-1", "{\"v\":1}", "a");
    added["metadata"]["annotations"]["sneaky"] = "1".into();
    let mut removed = node("gpu-1", "{\"v\":1}", "a");
    removed["metadata"]["annotations"].as_object_mut().context("map")?.remove("other");
    let mut tainted = node("gpu-1", "{\"v\":1}", "a");
    tainted["spec"]["taints"] = serde_json::json!([{"key": "k", "effect": "NoSchedule"}]);
    for (what, object) in
        [("an annotation added", added), ("one removed", removed), ("a taint", tainted)]
    {
        let got = node_policy_admits(&install, &agent("gpu-1"), &object, &old)?;
        ensure!(got == Some(false), "{what}: {got:?}");
    }
    Ok(())
}

#[test]
fn the_webhook_is_called_only_for_pods_asking_for_a_baleen_resource() -> Result<()> {
    let install = Install::parse(&render("default")?)?;
    let config = install.webhooks.first().context("the webhook")?;
    let hook = config.webhooks.as_ref().and_then(|w| w.first()).context("a webhook")?;
    let condition = hook.match_conditions.as_ref().and_then(|c| c.first()).context("condition")?;
    let pod = |resources: Value, init: bool| {
        let c = serde_json::json!([{"name": "c", "resources": resources}]);
        if init {
            serde_json::json!({"spec": {"containers": [{"name": "app"}], "initContainers": c}})
        } else {
            serde_json::json!({"spec": {"containers": c}})
        }
    };
    let cases = [
        (
            "gpu-memory",
            pod(serde_json::json!({"limits": {"awesome-ai-company.com/gpu-memory": "8"}}), false),
            true,
        ),
        (
            "a MIG slice, init",
            pod(serde_json::json!({"limits": {"awesome-ai-company.com/mig-1g.10gb": "1"}}), true),
            true,
        ),
        (
            "requests only",
            pod(serde_json::json!({"requests": {"awesome-ai-company.com/gpu": "1"}}), false),
            true,
        ),
        (
            "nvidia.com/gpu",
            pod(serde_json::json!({"limits": {"nvidia.com/gpu": "1"}}), false),
            false,
        ),
        ("cpu only", pod(serde_json::json!({"requests": {"cpu": "1"}}), false), false),
        ("no resources", serde_json::json!({"spec": {"containers": [{"name": "c"}]}}), false),
    ];
    for (what, pod, want) in cases {
        ensure!(cel_true(&condition.expression, &pod)? == want, "{what}: not {want}");
    }
    // Namespaces opt out by label; the control plane's and baleen's own are never sent.
    let selector = hook.namespace_selector.as_ref().context("namespaceSelector")?;
    let expressions = selector.match_expressions.as_deref().unwrap_or_default();
    ensure!(
        expressions.iter().any(|e| e.key == "awesome-ai-company.com/baleen-scheduler"
            && e.operator == "NotIn"
            && e.values.as_deref() == Some(&["disabled".to_owned()][..])),
        "the opt-out label"
    );
    ensure!(
        expressions.iter().any(|e| e.key == "kubernetes.io/metadata.name"
            && e.values.iter().flatten().any(|v| v == "kube-system")
            && e.values.iter().flatten().any(|v| v == "baleen-system")),
        "kube-system and baleen's namespace left alone"
    );
    // With scheduler.cpuOnlyPods, the second webhook takes exactly the pods the first leaves,
    // and only from namespaces that opt in.
    let install = Install::parse(&render("cpu-only-pods")?)?;
    let config = install.webhooks.first().context("the webhook")?;
    let hooks = config.webhooks.as_deref().unwrap_or_default();
    let first = hooks.first().and_then(|h| h.match_conditions.as_ref()?.first()).context("1st")?;
    let second = hooks.get(1).and_then(|h| h.match_conditions.as_ref()?.first()).context("2nd")?;
    for (what, pod, asks) in cases_again() {
        ensure!(cel_true(&first.expression, &pod)? == asks, "{what}: first not {asks}");
        ensure!(cel_true(&second.expression, &pod)? != asks, "{what}: second not {}", !asks);
    }
    let labels = hooks[1]
        .namespace_selector
        .as_ref()
        .and_then(|n| n.match_labels.clone())
        .unwrap_or_default();
    ensure!(
        labels.get("awesome-ai-company.com/baleen-cpu-pods").map(String::as_str) == Some("true"),
        "the opt-in label: {labels:?}"
    );
    Ok(())
}

/// Pods asking (true) or not asking for a baleen resource, for the webhooks' conditions.
fn cases_again() -> Vec<(&'static str, Value, bool)> {
    let limits =
        |m: Value| serde_json::json!({"spec": {"containers": [{"name": "c", "resources": m}]}});
    vec![
        (
            "gpu-memory",
            limits(serde_json::json!({"limits": {"awesome-ai-company.com/gpu-memory": "8"}})),
            true,
        ),
        (
            "requests only",
            limits(serde_json::json!({"requests": {"awesome-ai-company.com/gpu": "1"}})),
            true,
        ),
        ("cpu only", limits(serde_json::json!({"requests": {"cpu": "1"}})), false),
        ("no resources", serde_json::json!({"spec": {"containers": [{"name": "c"}]}}), false),
    ]
}

/// The second scheduler's pod template's `checksum/config` and its configuration's text, the
/// chart rendered with `set` (`--set` pairs).
fn scheduler_config_and_checksum(set: &[&str]) -> Result<(String, String)> {
    let mut args = vec!["template", "baleen", CHART, "--namespace", "baleen-system"];
    for pair in set {
        args.extend(["--set", pair]);
    }
    let docs = documents(&helm(&args)?)?;
    let named = |kind: &str, name: &str| {
        docs.iter()
            .find(|d| d["kind"] == kind && d["metadata"]["name"] == name)
            .with_context(|| format!("{kind} {name}"))
    };
    let config = named("ConfigMap", "baleen-scheduler-config")?["data"]["config.yaml"]
        .as_str()
        .context("config.yaml")?
        .to_owned();
    let checksum = named("Deployment", "baleen-scheduler")?["spec"]["template"]["metadata"]
        ["annotations"]["checksum/config"]
        .as_str()
        .context("checksum/config")?
        .to_owned();
    Ok((config, checksum))
}

/// kube-scheduler reads its configuration once: any change to it must roll the pods, and the
/// share of nodes it scores is left to its adaptive default only when asked.
#[test]
fn a_changed_scheduler_configuration_rolls_the_schedulers_pods() -> Result<()> {
    let (config, checksum) = scheduler_config_and_checksum(&[])?;
    ensure!(config.contains("percentageOfNodesToScore: 100"), "{config}");
    for set in [
        "scheduler.percentageOfNodesToScore=30",
        "scheduler.percentageOfNodesToScore=null",
        "scheduler.extenderWeight=7",
        "scheduler.name=gpu-scheduler",
    ] {
        let (other, other_sum) = scheduler_config_and_checksum(&[set])?;
        ensure!(other != config, "{set} changes nothing in the configuration");
        ensure!(other_sum != checksum, "{set} changes the configuration but not the checksum");
    }
    for adaptive in
        ["scheduler.percentageOfNodesToScore=null", "scheduler.percentageOfNodesToScore=0"]
    {
        let (other, _) = scheduler_config_and_checksum(&[adaptive])?;
        ensure!(!other.contains("percentageOfNodesToScore"), "{adaptive}: {other}");
        ensure!(documents(&other)?.len() == 1, "{adaptive}: one document");
    }
    let refused =
        helm(&["template", "baleen", CHART, "--set", "scheduler.percentageOfNodesToScore=101"]);
    ensure!(refused.is_err(), "101 % accepted");
    Ok(())
}

#[test]
fn the_plain_manifests_are_the_chart_rendered() -> Result<()> {
    let scratch = tempfile::tempdir()?;
    let out = Command::new("bash")
        .arg(repo().join("scripts/render-manifests.sh"))
        .arg(scratch.path())
        .output()?;
    ensure!(out.status.success(), "render-manifests.sh: {}", String::from_utf8_lossy(&out.stderr));
    let names = |dir: &Path| -> Result<BTreeSet<String>> {
        std::fs::read_dir(dir)?.map(|e| Ok(e?.file_name().to_string_lossy().into_owned())).collect()
    };
    let committed = repo().join("packaging/manifests");
    ensure!(names(&committed)? == names(scratch.path())?, "packaging/manifests holds other files");
    for name in names(scratch.path())? {
        let fresh = std::fs::read_to_string(scratch.path().join(&name))?;
        let old = std::fs::read_to_string(committed.join(&name))?;
        ensure!(
            fresh == old,
            "packaging/manifests/{name} is stale: run scripts/render-manifests.sh and commit"
        );
    }
    Ok(())
}

#[test]
fn the_chart_lints_clean_and_its_version_is_the_binaries() -> Result<()> {
    for name in VALUES {
        let values = values_file(name);
        let out = helm(&["lint", "--strict", CHART, "--values", values.to_str().context("path")?])?;
        ensure!(out.contains("0 chart(s) failed"), "{name}: {out}");
    }
    let chart: Value =
        serde_yaml_ng::from_str(&std::fs::read_to_string(repo().join(CHART).join("Chart.yaml"))?)?;
    let version = env!("CARGO_PKG_VERSION");
    ensure!(
        chart["version"] == version && chart["appVersion"] == version,
        "Chart.yaml is not {version}"
    );
    // A misspelt value is refused by the chart's schema, not ignored.
    let err =
        helm(&["template", "baleen", CHART, "--set", "schduler.mode=none"]).expect_err("typo");
    ensure!(err.to_string().contains("schduler"), "{err}");
    // The extender's policies in the schema are the ones it knows.
    let schema: Value = serde_json::from_str(&std::fs::read_to_string(
        repo().join(CHART).join("values.schema.json"),
    )?)?;
    let policies = schema["properties"]["extender"]["properties"]["policy"]["enum"]
        .as_array()
        .context("enum")?;
    for p in policies {
        let p = p.as_str().context("a name")?;
        ensure!(p.parse::<baleen_scheduler_core::policy::PolicyKind>().is_ok(), "policy {p}");
    }
    Ok(())
}

/// Every leaf key of values.yaml, dotted (lists are leaves; `agent.config` is the agent's file,
/// documented in docs/agent.md, and listed by its top-level sections).
fn value_keys(value: &serde_yaml_ng::Value, path: &str, keys: &mut BTreeSet<String>) {
    match value {
        serde_yaml_ng::Value::Mapping(map)
            if !map.is_empty() && path != "agent.config" && !is_leaf_map(path) =>
        {
            for (k, v) in map {
                let k = k.as_str().unwrap_or_default();
                let here = if path.is_empty() { k.to_owned() } else { format!("{path}.{k}") };
                value_keys(v, &here, keys);
            }
        }
        serde_yaml_ng::Value::Mapping(map) if path == "agent.config" => {
            for k in map.keys() {
                keys.insert(format!("{path}.{}", k.as_str().unwrap_or_default()));
            }
        }
        _ => {
            keys.insert(path.to_owned());
        }
    }
}

/// Maps given whole (Kubernetes objects, labels): one row each.
fn is_leaf_map(path: &str) -> bool {
    let last = path.rsplit('.').next().unwrap_or(path);
    ["resources", "nodeSelector", "labels", "podAnnotations", "commonLabels", "affinity"]
        .contains(&last)
}

#[test]
fn the_values_table_in_the_install_docs_lists_every_value() -> Result<()> {
    let values: serde_yaml_ng::Value =
        serde_yaml_ng::from_str(&std::fs::read_to_string(values_file("default"))?)?;
    let mut keys = BTreeSet::new();
    value_keys(&values, "", &mut keys);
    let docs = std::fs::read_to_string(repo().join("docs/install.md"))?;
    let table: BTreeSet<String> = docs
        .lines()
        .filter_map(|l| l.strip_prefix("| `"))
        .filter_map(|l| l.split_once('`'))
        .map(|(k, _)| k.to_owned())
        .filter(|k| !k.contains(' '))
        .collect();
    let missing: Vec<_> = keys.difference(&table).collect();
    let extra: Vec<_> = table.difference(&keys).collect();
    ensure!(
        missing.is_empty() && extra.is_empty(),
        "docs/install.md's values table: missing {missing:?}, not in values.yaml {extra:?}"
    );
    Ok(())
}

/// The DRA agent (`dra.enabled`): runs `driver: dra` with the kubelet's DRA directories mounted
/// at their host paths, only on nodes labelled for it while the device-plugin agent keeps the
/// others, and the DeviceClasses select its devices.
fn check_dra_agent(install: &Install, scratch: &Path) -> Result<()> {
    let ds = install.daemon_set(DRA_AGENT).context("the DRA agent's DaemonSet")?;
    let spec = pod_spec(ds)?;
    let c = only_container(spec)?;
    let (command, settings) = settings_of(install, spec, c, scratch)?;
    ensure!(command.is_none(), "the DRA agent runs a subcommand");
    let a = &settings.agent;
    let baleen_agent::dra::DriverMode::Dra(d) = &a.driver else {
        bail!("the DRA agent's configuration says driver: device-plugin")
    };
    ensure!(d.driver_name == "gpu.awesome-ai-company.com", "driver {}", d.driver_name);
    ensure!(
        d.registry_dir == Path::new("/var/lib/kubelet/plugins_registry")
            && d.plugin_dir == Path::new("/var/lib/kubelet/plugins/gpu.awesome-ai-company.com"),
        "the kubelet's directories: {d:?}"
    );
    // The extender judges claims of this driver's class in the agents' memory unit.
    let deployment = install.deployments.first().context("the scheduler's Deployment")?;
    let pod = deployment.spec.as_ref().and_then(|s| s.template.spec.as_ref()).context("pod")?;
    let extender = pod.containers.iter().find(|c| c.name == "extender").context("extender")?;
    let mut argv: Vec<String> = extender.command.clone().unwrap_or_default();
    argv.extend(extender.args.iter().flatten().cloned());
    let claims = baleen_extender::run::Cli::try_parse_from(&argv)
        .map_err(|e| anyhow!("{argv:?}: {e}"))?
        .run
        .claims();
    ensure!(
        claims.classes == [d.driver_name.clone()]
            && claims.memory_unit_bytes == a.views.memory_unit_bytes,
        "the extender counts claims as {claims:?}, the agent serves {} in units of {} bytes",
        d.driver_name,
        a.views.memory_unit_bytes
    );
    let mut used = host_paths_used(a)?;
    used.extend([d.registry_dir.clone(), d.plugin_dir.clone(), d.cdi_dir.clone()]);
    let (host, _) = mounts(spec, c)?;
    check_host_paths("the DRA agent", &host, &used)?;
    // The CDI directory it writes is mounted writable.
    let cdi = c
        .volume_mounts
        .iter()
        .flatten()
        .find(|m| Path::new(&m.mount_path) == d.cdi_dir)
        .context("the CDI directory mounted")?;
    ensure!(cdi.read_only != Some(true), "the DRA agent writes {}", d.cdi_dir.display());
    // Labelled nodes run the DRA agent, the others the device-plugin agent.
    let expression = |ds: &DaemonSet| -> Option<(String, Vec<String>)> {
        let terms = pod_spec(ds)
            .ok()?
            .affinity
            .as_ref()?
            .node_affinity
            .as_ref()?
            .required_during_scheduling_ignored_during_execution
            .as_ref()?
            .node_selector_terms
            .clone();
        let e = terms
            .first()?
            .match_expressions
            .as_ref()?
            .iter()
            .find(|e| e.key == "awesome-ai-company.com/driver")?
            .clone();
        Some((e.operator, e.values.unwrap_or_default()))
    };
    ensure!(expression(ds) == Some(("In".into(), vec!["dra".into()])), "the DRA agent's nodes");
    let plugin = install.daemon_set(AGENT).context("the device-plugin agent")?;
    ensure!(
        expression(plugin) == Some(("NotIn".into(), vec!["dra".into()])),
        "the device-plugin agent leaves the DRA nodes"
    );
    // The DeviceClasses select this driver's GPUs and MIG instances, by the attribute the
    // slices publish.
    let names: Vec<_> =
        install.device_classes.iter().filter_map(|c| c.metadata.name.clone()).collect();
    ensure!(
        names == ["gpu.awesome-ai-company.com", "mig.gpu.awesome-ai-company.com"],
        "DeviceClasses {names:?}"
    );
    for (class, kind) in install.device_classes.iter().zip(["gpu", "mig"]) {
        let selectors = class.spec.selectors.as_deref().unwrap_or_default();
        let cel = selectors.first().and_then(|s| s.cel.as_ref()).context("a CEL selector")?;
        let device = |driver: &str, t: &str| serde_json::json!({"driver": driver, "attributes": {driver: {"type": t}}});
        let eval = |d: Value| -> Result<bool> {
            match cel_eval(&cel.expression, &[("device", &d)], &Default::default())? {
                cel::Value::Bool(b) => Ok(b),
                other => bail!("{} gave {other:?}", cel.expression),
            }
        };
        ensure!(eval(device("gpu.awesome-ai-company.com", kind))?, "{kind}: its own devices");
        let other = if kind == "gpu" { "mig" } else { "gpu" };
        ensure!(!eval(device("gpu.awesome-ai-company.com", other))?, "{kind}: not {other}s");
        ensure!(!eval(device("gpu.nvidia.com", kind))?, "{kind}: not another driver's");
        // DRA for extended resources (KEP-5004, GA in 1.37) is not served: a count of a
        // shareable device would be a default share, not a GPU (docs/dra.md).
        ensure!(
            class.spec.extended_resource_name.is_none(),
            "{kind}: the class backs an extended resource"
        );
    }
    Ok(())
}

#[test]
fn the_agents_account_may_write_only_its_own_nodes_slices() -> Result<()> {
    let install = Install::parse(&render("dra")?)?;
    let agent = |node: &str| {
        serde_json::json!({
            "userInfo": {
                "username": "system:serviceaccount:baleen-system:baleen-agent",
                "extra": {"authentication.kubernetes.io/node-name": [node]}
            }
        })
    };
    let slice = |node: &str, driver: &str| serde_json::json!({"metadata": {"name": format!("{node}-s")}, "spec": {"nodeName": node, "driver": driver, "pool": {"name": node}}});
    let ours = "gpu.awesome-ai-company.com";
    let none = Value::Null;
    let cases = [
        (
            "its own node's slice, created",
            agent("gpu-1"),
            slice("gpu-1", ours),
            none.clone(),
            Some(true),
        ),
        (
            "its own node's slice, deleted",
            agent("gpu-1"),
            none.clone(),
            slice("gpu-1", ours),
            Some(true),
        ),
        (
            "another node's slice, created",
            agent("gpu-2"),
            slice("gpu-1", ours),
            none.clone(),
            Some(false),
        ),
        (
            "another node's slice, deleted",
            agent("gpu-2"),
            none.clone(),
            slice("gpu-1", ours),
            Some(false),
        ),
        (
            "its slice moved to another node",
            agent("gpu-1"),
            slice("gpu-2", ours),
            slice("gpu-1", ours),
            Some(false),
        ),
        (
            "another driver's slice",
            agent("gpu-1"),
            slice("gpu-1", "gpu.nvidia.com"),
            none.clone(),
            Some(false),
        ),
        (
            "a token without a node",
            serde_json::json!({"userInfo": {"username": "system:serviceaccount:baleen-system:baleen-agent"}}),
            slice("gpu-1", ours),
            none.clone(),
            Some(false),
        ),
        (
            "the kubelet (not matched)",
            serde_json::json!({"userInfo": {"username": "system:node:gpu-1"}}),
            none.clone(),
            slice("gpu-2", ours),
            None,
        ),
    ];
    for (what, request, object, old, want) in cases {
        let got = policy_admits(&install, "baleen-agent-own-slices", &request, &object, &old)?;
        ensure!(got == want, "{what}: {got:?}, not {want:?}");
    }
    ensure!(
        install
            .policy_bindings
            .iter()
            .any(|b| b.metadata.name.as_deref() == Some("baleen-agent-own-slices")),
        "the slices policy is bound"
    );
    Ok(())
}

/// Issue 39, item 1: the chart's NetworkPolicies admit only the scrapers to the metrics ports
/// (the agents' and the extender's) and only the API server's addresses to the webhook when
/// they are given; with `networkPolicy.enabled: false` there are none.
#[test]
fn network_policies_admit_only_the_scrapers_and_the_api_server() -> Result<()> {
    use k8s_openapi::api::networking::v1::NetworkPolicy;
    let render_with = |sets: &[&str]| -> Result<Install> {
        let mut args = vec!["template", "baleen", CHART, "--namespace", "baleen-system"];
        for set in sets {
            args.extend(["--set", set]);
        }
        Install::parse(&helm(&args)?)
    };
    let policy = |install: &Install, name: &str| -> Option<NetworkPolicy> {
        install.network_policies.iter().find(|p| p.metadata.name.as_deref() == Some(name)).cloned()
    };
    // Which peers a policy admits to `port` (None: the port is not opened; Some(empty): anyone).
    let peers = |p: &NetworkPolicy, port: &str| -> Option<Vec<Value>> {
        let spec = p.spec.as_ref()?;
        spec.ingress.iter().flatten().find_map(|rule| {
            let named = rule.ports.iter().flatten().any(|q| {
                q.port
                    == Some(k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::String(
                        port.into(),
                    ))
            });
            named.then(|| {
                rule.from
                    .iter()
                    .flatten()
                    .map(|f| serde_json::to_value(f).unwrap_or_default())
                    .collect()
            })
        })
    };
    let install = render_with(&[])?;
    let agent = policy(&install, "baleen-agent").context("the agents' policy")?;
    let selector = agent.spec.as_ref().and_then(|s| s.pod_selector.clone()).unwrap_or_default();
    let selected: Vec<String> = selector
        .match_expressions
        .iter()
        .flatten()
        .filter(|e| e.key == "app.kubernetes.io/name" && e.operator == "In")
        .flat_map(|e| e.values.clone().unwrap_or_default())
        .collect();
    let scrapers = serde_json::json!([{"namespaceSelector": {"matchLabels": {"awesome-ai-company.com/metrics-scraper": "true"}}}]);
    ensure!(
        peers(&agent, "metrics") == Some(scrapers.as_array().cloned().unwrap_or_default()),
        "{agent:?}"
    );
    ensure!(
        agent.spec.as_ref().and_then(|s| s.ingress.as_ref()).map(Vec::len) == Some(1),
        "the agent opens nothing else"
    );
    let scheduler = policy(&install, "baleen-scheduler").context("the scheduler pod's policy")?;
    ensure!(peers(&scheduler, "metrics") == Some(scrapers.as_array().cloned().unwrap_or_default()));
    ensure!(peers(&scheduler, "webhook") == Some(vec![]), "no CIDRs given: the webhook open");
    // The pods they select carry the labels they name: both agents'.
    let dra = render_with(&["dra.enabled=true"])?;
    for (install, name) in [(&install, AGENT), (&dra, DRA_AGENT)] {
        let ds = install.daemon_set(name).context(name)?;
        let labels = ds.spec.as_ref().and_then(|s| s.template.metadata.as_ref()?.labels.clone());
        let label = labels.and_then(|l| l.get("app.kubernetes.io/name").cloned());
        ensure!(
            label.as_ref().is_some_and(|l| selected.contains(l)),
            "{name}'s pods ({label:?}) are not selected by {selected:?}"
        );
    }
    let limited = render_with(&["networkPolicy.apiServerCIDRs={10.0.0.1/32,10.0.0.2/32}"])?;
    let scheduler = policy(&limited, "baleen-scheduler").context("policy")?;
    let cidrs: Vec<Value> = peers(&scheduler, "webhook").context("the webhook's port")?;
    ensure!(
        cidrs
            == vec![
                serde_json::json!({"ipBlock": {"cidr": "10.0.0.1/32"}}),
                serde_json::json!({"ipBlock": {"cidr": "10.0.0.2/32"}})
            ],
        "{cidrs:?}"
    );
    let anyone = render_with(&["networkPolicy.scrapers=null"])?;
    let agent = policy(&anyone, "baleen-agent").context("policy")?;
    ensure!(peers(&agent, "metrics") == Some(vec![]), "no scrapers given: anyone");
    let off = render_with(&["networkPolicy.enabled=false"])?;
    ensure!(policy(&off, "baleen-agent").is_none() && policy(&off, "baleen-scheduler").is_none());
    Ok(())
}
