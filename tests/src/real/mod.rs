//! A control plane of the upstream components: etcd, kube-apiserver (its default admission
//! plugins and feature gates, with `NodeRestriction` and the `Node,RBAC` authorizers as kubeadm
//! sets them) and kube-controller-manager, on loopback, with static tokens for the test's own
//! users and a certificate authority made for the run.

use std::net::{IpAddr, Ipv4Addr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, anyhow, bail, ensure};

pub mod agent;
pub mod scheduling;
pub mod trace;

/// The repository's root.
pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The upstream binary (`BALEEN_KUBE`), or an error that says how to build it.
pub fn kube_binary() -> Result<PathBuf> {
    let path = std::env::var_os("BALEEN_KUBE").map(PathBuf::from).ok_or_else(|| {
        anyhow!(
            "the real-control-plane lane needs the upstream components: build them with \
             scripts/build-control-plane.sh (Go 1.26 and the Go module proxy) and set BALEEN_KUBE \
             to the path it prints"
        )
    })?;
    ensure!(path.is_file(), "BALEEN_KUBE={} is not a file", path.display());
    Ok(path)
}

/// A free port on loopback (bound and let go: another process may take it first, rarely).
pub fn free_port() -> Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// One running component: its process and its log.
struct Component {
    name: String,
    child: Child,
    log: PathBuf,
}

/// The users the tests act as: static tokens (`--token-auth-file`).
pub const ADMIN: &str = "admin";
/// kube-scheduler's identity (the built-in `system:kube-scheduler` roles).
pub const SCHEDULER: &str = "scheduler";
/// kube-controller-manager's.
pub const CONTROLLER_MANAGER: &str = "controller-manager";
/// A kubelet's identity (`system:node:node-a`, group `system:nodes`): what the Node authorizer
/// allows a node.
pub const NODE_A: &str = "node-a";

/// The running control plane; stopped when dropped.
pub struct ControlPlane {
    dir: tempfile::TempDir,
    kube: PathBuf,
    /// `https://127.0.0.1:<port>`.
    pub url: String,
    components: Vec<Component>,
}

impl ControlPlane {
    /// etcd, kube-apiserver and kube-controller-manager, started and ready.
    pub async fn start() -> Result<Self> {
        let kube = kube_binary()?;
        let dir = tempfile::Builder::new().prefix("baleen-real-").tempdir()?;
        let api_port = free_port()?;
        let mut plane = Self {
            dir,
            kube,
            url: format!("https://127.0.0.1:{api_port}"),
            components: Vec::new(),
        };
        if let Err(e) = plane.boot(api_port).await {
            bail!("the control plane did not start: {e:#}\n{}", plane.logs());
        }
        Ok(plane)
    }

    async fn boot(&mut self, api_port: u16) -> Result<()> {
        self.write_credentials()?;
        let (client, peer) = (free_port()?, free_port()?);
        let etcd_dir = self.path("etcd");
        self.spawn(
            "etcd",
            &[
                "--name=default",
                &format!("--data-dir={}", etcd_dir.display()),
                &format!("--listen-client-urls=http://127.0.0.1:{client}"),
                &format!("--advertise-client-urls=http://127.0.0.1:{client}"),
                &format!("--listen-peer-urls=http://127.0.0.1:{peer}"),
                &format!("--initial-advertise-peer-urls=http://127.0.0.1:{peer}"),
                &format!("--initial-cluster=default=http://127.0.0.1:{peer}"),
                "--log-level=warn",
            ],
        )?;
        let root = self.dir.path().to_owned();
        let p = move |name: &str| root.join(name).display().to_string();
        let args = vec![
            format!("--etcd-servers=http://127.0.0.1:{client}"),
            "--bind-address=127.0.0.1".to_owned(),
            "--advertise-address=127.0.0.1".to_owned(),
            // The `kubernetes` Service's endpoints may not be a loopback address: none kept.
            "--endpoint-reconciler-type=none".to_owned(),
            format!("--secure-port={api_port}"),
            format!("--cert-dir={}", p("apiserver-certs")),
            format!("--tls-cert-file={}", p("serving.crt")),
            format!("--tls-private-key-file={}", p("serving.key")),
            format!("--token-auth-file={}", p("tokens.csv")),
            "--authorization-mode=Node,RBAC".to_owned(),
            "--enable-admission-plugins=NodeRestriction".to_owned(),
            "--allow-privileged=true".to_owned(),
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local".to_owned(),
            format!("--service-account-key-file={}", p("sa.pub")),
            format!("--service-account-signing-key-file={}", p("sa.key")),
            "--service-cluster-ip-range=10.96.0.0/16".to_owned(),
        ];
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        self.spawn("kube-apiserver", &args)?;
        self.ready("/readyz", Duration::from_secs(120)).await?;
        let kubeconfig = self.kubeconfig(CONTROLLER_MANAGER)?;
        let args = vec![
            format!("--kubeconfig={}", kubeconfig.display()),
            format!("--authentication-kubeconfig={}", kubeconfig.display()),
            format!("--authorization-kubeconfig={}", kubeconfig.display()),
            "--bind-address=127.0.0.1".to_owned(),
            format!("--secure-port={}", free_port()?),
            format!("--service-account-private-key-file={}", p("sa.key")),
            format!("--root-ca-file={}", p("ca.crt")),
            "--leader-elect=false".to_owned(),
            // No kubelet runs in this lane: the node lifecycle controller would mark every Node
            // unreachable (and taint it) after its grace period.
            "--controllers=*,-node-lifecycle-controller".to_owned(),
            // Each controller with its own account and bootstrap role, as kubeadm runs it: the
            // manager's own user may do little more than that.
            "--use-service-account-credentials=true".to_owned(),
        ];
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        self.spawn("kube-controller-manager", &args)?;
        Ok(())
    }

    /// A path in the run's directory.
    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// The CA, serving certificate, service-account key pair and static tokens.
    fn write_credentials(&self) -> Result<()> {
        let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new())?;
        ca_params.distinguished_name.push(rcgen::DnType::CommonName, "baleen real-lane CA");
        ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        ca_params.key_usages =
            vec![rcgen::KeyUsagePurpose::KeyCertSign, rcgen::KeyUsagePurpose::CrlSign];
        let ca = rcgen::CertifiedIssuer::self_signed(ca_params, rcgen::KeyPair::generate()?)?;
        let mut params = rcgen::CertificateParams::new(vec![
            "localhost".to_owned(),
            "kubernetes.default.svc".to_owned(),
        ])?;
        params.subject_alt_names.push(rcgen::SanType::IpAddress(IpAddr::V4(Ipv4Addr::LOCALHOST)));
        params.distinguished_name.push(rcgen::DnType::CommonName, "kube-apiserver");
        params.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ServerAuth];
        let key = rcgen::KeyPair::generate()?;
        let cert = params.signed_by(&key, &ca)?;
        std::fs::write(self.path("ca.crt"), ca.pem())?;
        std::fs::write(self.path("serving.crt"), cert.pem())?;
        std::fs::write(self.path("serving.key"), key.serialize_pem())?;
        let sa = rcgen::KeyPair::generate()?;
        std::fs::write(self.path("sa.key"), sa.serialize_pem())?;
        std::fs::write(self.path("sa.pub"), sa.public_key_pem())?;
        let tokens = [
            (ADMIN, "admin", "system:masters"),
            (SCHEDULER, "system:kube-scheduler", ""),
            (CONTROLLER_MANAGER, "system:kube-controller-manager", ""),
            (NODE_A, "system:node:node-a", "system:nodes"),
        ]
        .iter()
        .map(|(token, user, group)| format!("{token}-token,{user},{user},\"{group}\"\n"))
        .collect::<String>();
        std::fs::write(self.path("tokens.csv"), tokens)?;
        Ok(())
    }

    /// A kubeconfig acting as `user` (one of [`ADMIN`], [`SCHEDULER`], [`CONTROLLER_MANAGER`]).
    pub fn kubeconfig(&self, user: &str) -> Result<PathBuf> {
        self.kubeconfig_with_token(user, &format!("{user}-token"))
    }

    /// A kubeconfig presenting `token`.
    pub fn kubeconfig_with_token(&self, name: &str, token: &str) -> Result<PathBuf> {
        let path = self.path(&format!("{name}.kubeconfig"));
        let ca = self.path("ca.crt");
        std::fs::write(
            &path,
            format!(
                "apiVersion: v1\nkind: Config\ncurrent-context: real\nclusters:\n- name: real\n  cluster:\n    server: {}\n    certificate-authority: {}\ncontexts:\n- name: real\n  context:\n    cluster: real\n    user: {name}\nusers:\n- name: {name}\n  user:\n    token: {token}\n",
                self.url,
                ca.display()
            ),
        )?;
        Ok(path)
    }

    /// Starts `name` (a command of the upstream binary) with `args`, its output to its log.
    pub fn spawn(&mut self, name: &str, args: &[&str]) -> Result<()> {
        self.spawn_named(name, name, args)
    }

    /// Starts `command` of the upstream binary with `args` as the component `name` (its log
    /// `<name>.log`): two of one command, such as two kube-schedulers, told apart.
    pub fn spawn_named(&mut self, name: &str, command: &str, args: &[&str]) -> Result<()> {
        let log = self.path(&format!("{name}.log"));
        let out = std::fs::File::create(&log)?;
        let child = Command::new(&self.kube)
            .arg(command)
            .args(args)
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out)
            .spawn()
            .with_context(|| format!("cannot start {command}"))?;
        self.components.push(Component { name: name.to_owned(), child, log });
        Ok(())
    }

    /// Runs `name` to its end with `args`: its exit status and output.
    pub fn run(
        &self,
        name: &str,
        args: &[&str],
        within: Duration,
    ) -> Result<(Option<i32>, String)> {
        let log = self.path(&format!("{name}-run.log"));
        let out = std::fs::File::create(&log)?;
        let mut child = Command::new(&self.kube)
            .arg(name)
            .args(args)
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out)
            .spawn()?;
        let started = Instant::now();
        let status = loop {
            if let Some(status) = child.try_wait()? {
                break Some(status);
            }
            if started.elapsed() > within {
                break None;
            }
            std::thread::sleep(Duration::from_millis(100));
        };
        if status.is_none() {
            let _ = child.kill();
            let _ = child.wait();
        }
        Ok((status.and_then(|s| s.code()), std::fs::read_to_string(&log)?))
    }

    /// Waits until `path` of the API server answers `ok` to the admin, or a component exits.
    pub async fn ready(&mut self, path: &str, within: Duration) -> Result<()> {
        let kubeconfig = self.kubeconfig(ADMIN)?;
        let started = Instant::now();
        loop {
            for c in &mut self.components {
                if let Some(status) = c.child.try_wait()? {
                    bail!("{} exited ({status}) while the control plane started", c.name);
                }
            }
            let out = Command::new("kubectl")
                .args(["--kubeconfig", &kubeconfig.display().to_string(), "get", "--raw", path])
                .output()
                .context("cannot run kubectl: scripts/install-kube-tools.sh installs it")?;
            if out.status.success() && String::from_utf8_lossy(&out.stdout).trim() == "ok" {
                return Ok(());
            }
            if started.elapsed() > within {
                bail!(
                    "{path} not ok within {within:?}: {}",
                    String::from_utf8_lossy(&out.stderr).trim()
                );
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    /// `kubectl` as the admin; its standard output, or an error with its standard error.
    pub fn kubectl(&self, args: &[&str]) -> Result<String> {
        let kubeconfig = self.kubeconfig(ADMIN)?;
        tool("kubectl", &kubeconfig, args)
    }

    /// `helm` as the admin, in the repository.
    pub fn helm(&self, args: &[&str]) -> Result<String> {
        let kubeconfig = self.kubeconfig(ADMIN)?;
        tool("helm", &kubeconfig, args)
    }

    /// `helm install` of the chart as release `baleen` in [`scheduling::NAMESPACE`] (made),
    /// with `extra` arguments (`--set`, `-f`).
    pub fn install(&self, extra: &[&str]) -> Result<String> {
        let mut args = vec![
            "install",
            "baleen",
            scheduling::CHART,
            "-n",
            scheduling::NAMESPACE,
            "--create-namespace",
        ];
        args.extend(extra);
        self.helm(&args)
    }

    /// `kubectl create` of `object` as the admin: the output, or the error kubectl printed
    /// (the API server's refusal).
    pub fn create(&self, object: &serde_json::Value) -> Result<String> {
        let file = self.path(&format!("object-{}.json", rand::random::<u64>()));
        std::fs::write(&file, serde_json::to_vec(object)?)?;
        self.kubectl(&["create", "-f", &file.display().to_string()])
    }

    /// Node `name`'s status as its kubelet sets it once its device plugins registered:
    /// `capacity` and `allocatable`, Ready; and its not-ready taint (the `TaintNodesByCondition`
    /// admission plugin's) taken off as the node lifecycle controller would, which does not
    /// run in the lane (no kubelet heartbeats).
    pub fn node_ready(
        &self,
        name: &str,
        capacity: &serde_json::Value,
        allocatable: &serde_json::Value,
    ) -> Result<()> {
        let status = ready_status(capacity, allocatable).to_string();
        let patch = ["patch", "node", name, "--subresource=status", "--type=merge", "-p", &status];
        self.kubectl(&patch)?;
        self.kubectl(&["taint", "node", name, "node.kubernetes.io/not-ready:NoSchedule-"])?;
        Ok(())
    }

    /// Waits until `namespace` has its default ServiceAccount (kube-controller-manager makes
    /// it; pods are refused before), at most `within`.
    pub async fn default_account(&self, namespace: &str, within: Duration) -> Result<()> {
        let started = Instant::now();
        while self.kubectl(&["get", "serviceaccount", "default", "-n", namespace]).is_err() {
            ensure!(started.elapsed() < within, "no default account in {namespace} in {within:?}");
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        Ok(())
    }

    /// The node pod `namespace/pod` is bound to, once it is (at most `within`; the error holds
    /// the namespace's events).
    pub async fn bound(&self, namespace: &str, pod: &str, within: Duration) -> Result<String> {
        let started = Instant::now();
        loop {
            let node = self.kubectl(&[
                "get",
                "pod",
                pod,
                "-n",
                namespace,
                "-o",
                "jsonpath={.spec.nodeName}",
            ])?;
            if !node.trim().is_empty() {
                return Ok(node.trim().to_owned());
            }
            if started.elapsed() > within {
                let events = self.kubectl(&["get", "events", "-n", namespace]).unwrap_or_default();
                bail!("pod {pod} not bound within {within:?}; events:\n{events}");
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    /// The CPU time each running component has used so far (user and system), by name.
    pub fn cpu_times(&self) -> Vec<(String, Duration)> {
        self.components
            .iter()
            .filter_map(|c| Some((c.name.clone(), cpu_time(c.child.id())?)))
            .collect()
    }

    /// The last lines of every component's log.
    pub fn logs(&self) -> String {
        let mut text = String::new();
        for c in &self.components {
            let log = std::fs::read_to_string(&c.log).unwrap_or_default();
            let lines: Vec<&str> = log.lines().collect();
            let tail = &lines[lines.len().saturating_sub(40)..];
            text.push_str(&format!(
                "--- {} ({}), last {} lines:\n",
                c.name,
                c.log.display(),
                tail.len()
            ));
            for l in tail {
                text.push_str(l);
                text.push('\n');
            }
        }
        text
    }
}

/// A Node's status as its kubelet sets it: `capacity`, `allocatable` and Ready.
pub fn ready_status(
    capacity: &serde_json::Value,
    allocatable: &serde_json::Value,
) -> serde_json::Value {
    serde_json::json!({"status": {"capacity": capacity, "allocatable": allocatable,
        "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                        "message": "a Node object of the real-control-plane lane",
                        "lastHeartbeatTime": "2026-01-01T00:00:00Z",
                        "lastTransitionTime": "2026-01-01T00:00:00Z"}]}})
}

/// The CPU time process `pid` has used (`/proc/<pid>/stat`'s utime and stime, in clock ticks
/// of 1/100 s, as Linux counts them for user space).
pub fn cpu_time(pid: u32) -> Option<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command's name, in parentheses, may hold spaces: the fields after its last ')'.
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    let ticks = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    Some(Duration::from_millis(ticks * 10))
}

/// Runs `program` (kubectl or helm) with `kubeconfig` and `args` in the repository.
fn tool(program: &str, kubeconfig: &Path, args: &[&str]) -> Result<String> {
    let out = Command::new(program)
        .args(args)
        .env("KUBECONFIG", kubeconfig)
        .current_dir(repo())
        .output()
        .with_context(|| {
            format!("cannot run {program}: scripts/install-kube-tools.sh installs it")
        })?;
    ensure!(
        out.status.success(),
        "{program} {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr).trim()
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        for c in self.components.iter_mut().rev() {
            let _ = c.child.kill();
            let _ = c.child.wait();
        }
    }
}

/// Waits until `ok`, at most `within`.
pub async fn eventually(what: &str, within: Duration, ok: impl Fn() -> bool) -> Result<()> {
    let started = Instant::now();
    while !ok() {
        if started.elapsed() > within {
            bail!("{what}: not within {within:?}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Ok(())
}

/// Runs `test` against a fresh control plane; on failure, the error and every component's log.
pub async fn with_control_plane<F>(test: F)
where
    F: AsyncFnOnce(&mut ControlPlane) -> Result<()>,
{
    let mut plane = match ControlPlane::start().await {
        Ok(p) => p,
        Err(e) => panic!("{e:#}"),
    };
    if let Err(e) = test(&mut plane).await {
        panic!("{e:#}\n{}", plane.logs());
    }
}
