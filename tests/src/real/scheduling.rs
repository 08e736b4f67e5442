//! A second scheduler against the real control plane, as the chart runs it: baleen's extender
//! (the release binary, its watches of the API server made with a token of the chart's
//! scheduler account) and kube-scheduler with the configuration the chart renders; and Nodes as
//! a kubelet and an agent leave them (capacity counted, gpu-state published).

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail, ensure};
use serde_json::{Value, json};

use super::{ControlPlane, free_port};

/// The chart, from the repository's root.
pub const CHART: &str = "packaging/helm/baleen";
/// Where the tests install it.
pub const NAMESPACE: &str = "baleen-system";
/// The chart's default resource domain.
pub const DOMAIN: &str = "awesome-ai-company.com";
/// The extender's address in the rendered scheduler configuration (the chart's default port).
const RENDERED_EXTENDER: &str = "http://127.0.0.1:8888";

/// Node `name` as its agent leaves it (its gpu-state annotation saying `free` units on each of
/// its H200s), and the resources its kubelet counts from the device plugins (capacity and
/// allocatable alike: [`ControlPlane::node_ready`]).
pub fn node_objects(name: &str, free: &[u32]) -> (Value, Value) {
    let state = baleen_k8s::fixtures::h200_state(name, free);
    let node = json!({"apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name},
                     "annotations": {format!("{DOMAIN}/gpu-state"): state.to_json()}}});
    let units = (free.len() * 140).to_string();
    let resources = json!({"cpu": "96", "memory": "1000Gi", "pods": "110",
                           format!("{DOMAIN}/gpu-memory"): units,
                           format!("{DOMAIN}/gpu"): free.len().to_string()});
    (node, resources)
}

/// A process killed when dropped.
pub struct Running(pub Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A kubeconfig with a token of the chart's scheduler account (the extender and kube-scheduler
/// share it: one pod), once the chart is installed.
pub fn scheduler_kubeconfig(plane: &ControlPlane) -> Result<PathBuf> {
    let token = plane.kubectl(&[
        "create",
        "token",
        "baleen-scheduler",
        "-n",
        NAMESPACE,
        "--duration",
        "2h",
    ])?;
    plane.kubeconfig_with_token("baleen-scheduler", token.trim())
}

/// baleen's extender, running with a kubeconfig, on ports of its own.
pub struct Extender {
    _process: Running,
    /// The verbs' port (filter, prioritize, bind, preempt).
    pub verbs: u16,
    /// Its metrics port.
    pub metrics: u16,
    log: PathBuf,
}

impl Extender {
    /// Starts the release binary with the arguments the chart gives it (rendered with
    /// `values`), its ports on loopback and its webhook, if the chart serves one, at `webhook`
    /// (or none), run with `kubeconfig`; waits until it is ready (its watches have listed the
    /// Nodes and Pods), at most `within`.
    pub async fn start(
        plane: &ControlPlane,
        kubeconfig: &PathBuf,
        values: &[&str],
        webhook: Option<std::net::SocketAddr>,
        within: Duration,
    ) -> Result<Self> {
        let (verbs, metrics, probes) = (free_port()?, free_port()?, free_port()?);
        let mut args = Vec::new();
        for arg in chart_extender_args(plane, values)? {
            let (flag, _) = arg.split_once('=').unwrap_or((&arg, ""));
            match flag {
                "--listen" => args.push(format!("--listen=127.0.0.1:{verbs}")),
                "--metrics-listen" => args.push(format!("--metrics-listen=127.0.0.1:{metrics}")),
                "--probe-listen" => args.push(format!("--probe-listen=127.0.0.1:{probes}")),
                "--webhook-listen" => match webhook {
                    Some(address) => args.push(format!("--webhook-listen={address}")),
                    None => bail!("the chart serves a webhook: give it an address"),
                },
                _ => args.push(arg),
            }
        }
        let log = plane.path("baleen-extender.log");
        let out = std::fs::File::create(&log)?;
        let binary = crate::tools::workspace_binary("baleen-extender")?;
        let process = Running(
            Command::new(&binary)
                .args(&args)
                .env("KUBECONFIG", kubeconfig)
                .stdin(Stdio::null())
                .stdout(out.try_clone()?)
                .stderr(out)
                .spawn()
                .context("cannot start baleen-extender")?,
        );
        let extender = Self { _process: process, verbs, metrics, log };
        let started = Instant::now();
        loop {
            let probe = Command::new(&binary)
                .args(["probe", &format!("http://127.0.0.1:{probes}/readyz")])
                .output()?;
            if probe.status.success() {
                return Ok(extender);
            }
            if started.elapsed() > within {
                bail!("the extender was not ready within {within:?}\n{}", extender.log_tail(30));
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    /// The CPU time it has used so far.
    pub fn cpu_time(&self) -> Option<Duration> {
        super::cpu_time(self._process.0.id())
    }

    /// Its metrics, scraped.
    pub async fn scrape(&self) -> Result<String> {
        let address = std::net::SocketAddr::from(([127, 0, 0, 1], self.metrics));
        let (status, body) = crate::http::request(address, "GET", "/metrics", "").await?;
        ensure!(status == 200, "the extender's /metrics answered {status}: {body}");
        Ok(body)
    }

    /// The value of the first sample of `family` whose line contains `labels` (0 if none).
    pub async fn sample(&self, family: &str, labels: &str) -> Result<f64> {
        Ok(self
            .scrape()
            .await?
            .lines()
            .find(|l| l.starts_with(&format!("{family}{{")) && l.contains(labels))
            .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .unwrap_or(0.0))
    }

    /// The last `lines` of its log.
    pub fn log_tail(&self, lines: usize) -> String {
        let log = std::fs::read_to_string(&self.log).unwrap_or_default();
        let all: Vec<&str> = log.lines().collect();
        format!(
            "baleen-extender's log, last lines:\n{}",
            all[all.len().saturating_sub(lines)..].join("\n")
        )
    }
}

/// The arguments of the extender's container as the chart renders it with `values` (`--set`
/// pairs).
pub fn chart_extender_args(plane: &ControlPlane, values: &[&str]) -> Result<Vec<String>> {
    let mut command = vec!["template", "baleen", CHART, "-n", NAMESPACE];
    for value in values {
        command.extend(["--set", value]);
    }
    let rendered = plane.helm(&command)?;
    let args = serde_yaml_ng::Deserializer::from_str(&rendered)
        .filter_map(|d| <Value as serde::Deserialize>::deserialize(d).ok())
        .filter(|v| v["kind"] == "Deployment")
        .flat_map(|v| {
            v["spec"]["template"]["spec"]["containers"].as_array().cloned().unwrap_or_default()
        })
        .find(|c| c["command"][0].as_str().is_some_and(|c| c.ends_with("/baleen-extender")))
        .and_then(|c| c["args"].as_array().cloned())
        .context("the chart renders no baleen-extender container with arguments")?;
    args.iter()
        .map(|a| a.as_str().map(str::to_owned).context("an argument that is not a string"))
        .collect()
}

/// The kube-scheduler configuration the chart renders with its defaults: its ConfigMap's
/// `config.yaml`, as text.
pub fn rendered_scheduler_config_text(plane: &ControlPlane) -> Result<String> {
    rendered_scheduler_config_with(plane, &[])
}

/// The same, rendered with `values` (`--set` pairs).
pub fn rendered_scheduler_config_with(plane: &ControlPlane, values: &[String]) -> Result<String> {
    let mut command = vec!["template", "baleen", CHART, "-n", NAMESPACE];
    for value in values {
        command.extend(["--set", value]);
    }
    let rendered = plane.helm(&command)?;
    serde_yaml_ng::Deserializer::from_str(&rendered)
        .filter_map(|d| <Value as serde::Deserialize>::deserialize(d).ok())
        .find(|v| v["kind"] == "ConfigMap" && v["metadata"]["name"] == "baleen-scheduler-config")
        .and_then(|v| v["data"]["config.yaml"].as_str().map(str::to_owned))
        .context("the chart renders no baleen-scheduler-config")
}

/// The same, read as YAML.
pub fn rendered_scheduler_config(plane: &ControlPlane) -> Result<serde_yaml_ng::Value> {
    Ok(serde_yaml_ng::from_str(&rendered_scheduler_config_text(plane)?)?)
}

/// How a kube-scheduler of the lane is configured, starting from the chart's configuration.
pub struct SchedulerConfig {
    /// The extender's verbs port, or `None` to drop the extenders (the same scheduler without
    /// baleen).
    pub extender: Option<u16>,
    /// The profile's scheduler name.
    pub scheduler_name: String,
    /// `clientConnection.qps` and `burst`, or `None` for kube-scheduler's defaults (50, 100).
    pub qps: Option<u32>,
    /// `leaderElection.leaderElect`.
    pub leader_elect: bool,
    /// The chart values (`--set` pairs) the configuration is rendered with.
    pub values: Vec<String>,
}

impl SchedulerConfig {
    /// The chart's: `baleen-scheduler`, the extender at `extender`, kube-scheduler's client
    /// limits, leader election.
    pub fn as_the_chart(extender: u16) -> Self {
        Self {
            extender: Some(extender),
            scheduler_name: "baleen-scheduler".to_owned(),
            qps: None,
            leader_elect: true,
            values: Vec::new(),
        }
    }

    /// The configuration file's text, with `kubeconfig` as its client connection.
    pub fn render(&self, plane: &ControlPlane, kubeconfig: &std::path::Path) -> Result<String> {
        let mut config: serde_yaml_ng::Value =
            serde_yaml_ng::from_str(&rendered_scheduler_config_with(plane, &self.values)?)?;
        let map = config.as_mapping_mut().context("the configuration is a mapping")?;
        match self.extender {
            Some(port) => {
                let extenders = map
                    .get_mut("extenders")
                    .and_then(serde_yaml_ng::Value::as_sequence_mut)
                    .context("the chart's configuration has no extenders")?;
                for extender in extenders {
                    let url = extender.get("urlPrefix").and_then(serde_yaml_ng::Value::as_str);
                    ensure!(
                        url == Some(RENDERED_EXTENDER),
                        "the extender's address moved: {url:?}, not {RENDERED_EXTENDER}"
                    );
                    extender["urlPrefix"] = format!("http://127.0.0.1:{port}").into();
                }
            }
            None => {
                map.remove("extenders");
            }
        }
        let profiles = map
            .get_mut("profiles")
            .and_then(serde_yaml_ng::Value::as_sequence_mut)
            .context("the chart's configuration has no profiles")?;
        ensure!(profiles.len() == 1, "the chart renders one profile, not {}", profiles.len());
        profiles[0]["schedulerName"] = self.scheduler_name.clone().into();
        map.insert(
            "leaderElection".into(),
            serde_yaml_ng::from_str(&format!(
                "{{leaderElect: {}, resourceName: {}, resourceNamespace: {NAMESPACE}}}",
                self.leader_elect, self.scheduler_name
            ))?,
        );
        let mut connection = serde_yaml_ng::Mapping::new();
        connection.insert("kubeconfig".into(), kubeconfig.display().to_string().into());
        if let Some(qps) = self.qps {
            connection.insert("qps".into(), qps.into());
            connection.insert("burst".into(), qps.into());
        }
        map.insert("clientConnection".into(), connection.into());
        Ok(serde_yaml_ng::to_string(&config)?)
    }

    /// Writes the configuration and starts kube-scheduler with it (a component of `plane`:
    /// its log printed with the others on failure).
    pub fn spawn(&self, plane: &mut ControlPlane, kubeconfig: &std::path::Path) -> Result<()> {
        let file = plane.path(&format!("{}.yaml", self.scheduler_name));
        std::fs::write(&file, self.render(plane, kubeconfig)?)?;
        let secure = format!("--secure-port={}", free_port()?);
        plane.spawn_named(
            &self.scheduler_name,
            "kube-scheduler",
            &[&format!("--config={}", file.display()), &secure, "--bind-address=127.0.0.1"],
        )
    }
}
