//! baleen's agent on a simulated node against the real control plane: the workspace's binary
//! on a topology of `packaging/examples/`, its calls made with a real token of the chart's
//! agent account bound to a pod on its node (so the token names the node, as the kubelet's
//! projected token does), no kubelet (issue 41 brings one).

use std::path::PathBuf;
use std::process::{Command, Stdio};

use anyhow::{Context as _, Result};
use serde_json::json;

use super::scheduling::{NAMESPACE, Running};
use super::{ControlPlane, repo};

/// A kubeconfig with a token of the chart's `baleen-agent` account bound to pod `pod` of it
/// (so naming the pod's node, as the kubelet's projected token does): `<pod>.kubeconfig`.
pub fn agent_kubeconfig(plane: &ControlPlane, pod: &str) -> Result<PathBuf> {
    let token = plane.kubectl(&[
        "create",
        "token",
        "baleen-agent",
        "-n",
        NAMESPACE,
        "--bound-object-kind",
        "Pod",
        "--bound-object-name",
        pod,
        "--duration",
        "1h",
    ])?;
    plane.kubeconfig_with_token(pod, token.trim())
}

/// The agent of one simulated node, stopped when dropped.
pub struct SimulatedAgent {
    process: Running,
    log: PathBuf,
}

impl SimulatedAgent {
    /// Starts the agent of Node `node` (which must exist) on `topology` (a file of
    /// `packaging/examples/`), with `config` (agent.yaml lines after its paths, e.g. its
    /// `driver:` and `annotation:`), run with a token of `baleen-agent` bound to a pod of the
    /// account on `node`, made here.
    pub fn start(plane: &ControlPlane, node: &str, topology: &str, config: &str) -> Result<Self> {
        let pod = format!("agent-{node}");
        let object = json!({"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": pod, "namespace": NAMESPACE},
            "spec": {"nodeName": node, "serviceAccountName": "baleen-agent",
                     "containers": [{"name": "agent", "image": "baleen:test"}]}});
        let file = plane.path(&format!("{pod}.json"));
        std::fs::write(&file, serde_json::to_vec(&object)?)?;
        plane.kubectl(&["create", "-f", &file.display().to_string()])?;
        let kubeconfig = agent_kubeconfig(plane, &pod)?;
        let root = plane.path(node);
        for dir in ["registry", "plugins", "cdi", "state", "device-plugins"] {
            std::fs::create_dir_all(root.join(dir))?;
        }
        let text = format!(
            "nodeName: {node}\npaths:\n  stateDir: {r}/state\n  devicePluginDir: {r}/device-plugins\n  podResourcesSocket: {r}/pod-resources.sock\nmetrics:\n  address: 127.0.0.1:0\n  probeAddress: 127.0.0.1:0\ncolocation:\n  enabled: false\nwatchdog:\n  enabled: false\n{config}",
            r = root.display()
        );
        let config_path = root.join("agent.yaml");
        std::fs::write(&config_path, text)?;
        let log = plane.path(&format!("baleen-agent-{node}.log"));
        let out = std::fs::File::create(&log)?;
        let process = Running(
            Command::new(crate::tools::workspace_binary("baleen-agent")?)
                .args(["--config", &config_path.display().to_string(), "--simulated"])
                .arg(repo().join("packaging/examples").join(topology))
                .arg("--no-mps")
                .env("KUBECONFIG", &kubeconfig)
                .stdin(Stdio::null())
                .stdout(out.try_clone()?)
                .stderr(out)
                .spawn()
                .context("cannot start baleen-agent")?,
        );
        Ok(Self { process, log })
    }

    /// The directory of the node's files (`<node>/` in the run's directory): `registry`,
    /// `plugins`, `cdi`, `state`, `device-plugins`.
    pub fn node_dir(plane: &ControlPlane, node: &str) -> PathBuf {
        plane.path(node)
    }

    /// The agent.yaml lines of `driver: dra` mode for `node` (its registry, plugin and CDI
    /// directories in the node's directory), driver `driver`, no gpu-state annotation.
    pub fn dra_config(plane: &ControlPlane, node: &str, driver: &str) -> String {
        format!(
            "driver: dra\ndra:\n  driverName: {driver}\n  registryDir: {r}/registry\n  pluginDir: {r}/plugins/{driver}\n  cdiDir: {r}/cdi\nannotation:\n  enabled: false\n",
            r = Self::node_dir(plane, node).display()
        )
    }

    /// Whether it has exited, and how.
    pub fn exited(&mut self) -> Result<Option<std::process::ExitStatus>> {
        Ok(self.process.0.try_wait()?)
    }

    /// The last `lines` of its log.
    pub fn log_tail(&self, lines: usize) -> String {
        let log = std::fs::read_to_string(&self.log).unwrap_or_default();
        let all: Vec<&str> = log.lines().collect();
        format!(
            "{}, last lines:\n{}",
            self.log.display(),
            all[all.len().saturating_sub(lines)..].join("\n")
        )
    }
}
