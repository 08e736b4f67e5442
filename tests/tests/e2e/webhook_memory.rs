//! Issue 39, item 2: the extender binary, its webhook on, in a real cgroup v1 memory cgroup of
//! the chart's limit (`extender.resources.limits.memory`), watching a fake API server with
//! 1,000 GPU nodes, under rounds of concurrent AdmissionReviews of the worst shapes at the
//! body bound: it answers every one and no process of the cgroup is OOM-killed. Before, two
//! concurrent 3 MiB reviews of `[0]` items took it past 512 MiB.
//!
//! Host lane (`.ci/run`): needs root, a writable `/sys/fs/cgroup/memory` (cgroup v1), and curl;
//! ignored in the plain run, and fails saying what is missing where it is run without them.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context as _, Result, bail, ensure};
use baleen_extender::webhook::MAX_REVIEW_BYTES;
use baleen_tests::fake_apiserver::FakeApiServer;
use serde_json::json;

const KEY: &str = "awesome-ai-company.com/gpu-state";
const HOST: &str = "baleen-extender.baleen-system.svc";

/// The extender's memory limit in the chart's values, in bytes.
fn charts_limit() -> Result<u64> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../packaging/helm/baleen/values.yaml");
    let values: serde_yaml_ng::Value = serde_yaml_ng::from_str(&std::fs::read_to_string(&path)?)?;
    let limit = values["extender"]["resources"]["limits"]["memory"]
        .as_str()
        .context("extender.resources.limits.memory in the chart's values")?;
    let mib: u64 = limit.strip_suffix("Mi").context("a limit in Mi")?.parse()?;
    Ok(mib << 20)
}

/// A review whose pod's spec is `head`, `item` repeated to fill the body bound, and `tail`.
fn worst_review(head: &str, item: &str, tail: &str) -> Vec<u8> {
    let start = format!(
        r#"{{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","request":{{"uid":"u","kind":{{"group":"","version":"v1","kind":"Pod"}},"resource":{{"group":"","version":"v1","resource":"pods"}},"requestKind":{{"group":"","version":"v1","kind":"Pod"}},"requestResource":{{"group":"","version":"v1","resource":"pods"}},"namespace":"team-a","operation":"CREATE","userInfo":{{"username":"u"}},"dryRun":false,"object":{{"apiVersion":"v1","kind":"Pod","metadata":{{"name":"p"}},"spec":{{{head}"#
    );
    let end = format!(r#"{tail}}}}},"oldObject":null}}}}"#);
    let n = (MAX_REVIEW_BYTES - start.len() - end.len() - 64) / (item.len() + 1);
    let mut body = start.into_bytes();
    body.extend_from_slice(vec![item; n].join(",").as_bytes());
    body.extend_from_slice(end.as_bytes());
    body
}

/// A memory cgroup (v1) made for the test, removed when dropped (its processes killed first).
struct MemoryCgroup(PathBuf);

impl MemoryCgroup {
    fn new(limit: u64) -> Result<Self> {
        let root = Path::new("/sys/fs/cgroup/memory");
        ensure!(
            root.join("cgroup.procs").exists(),
            "this test needs a cgroup v1 memory hierarchy at {} (run it as root on a host with one)",
            root.display()
        );
        let dir = root.join(format!("baleen-webhook-test-{}", std::process::id()));
        std::fs::create_dir(&dir)
            .with_context(|| format!("make {} (root is needed)", dir.display()))?;
        let cgroup = Self(dir);
        std::fs::write(cgroup.0.join("memory.limit_in_bytes"), limit.to_string())?;
        // No swap to escape to, where the kernel accounts it.
        let _ = std::fs::write(cgroup.0.join("memory.swappiness"), "0");
        Ok(cgroup)
    }

    fn read(&self, file: &str) -> String {
        std::fs::read_to_string(self.0.join(file)).unwrap_or_default()
    }

    /// `oom_kill N` of `memory.oom_control` (kernels since 4.13).
    fn oom_kills(&self) -> u64 {
        self.read("memory.oom_control")
            .lines()
            .find_map(|l| l.strip_prefix("oom_kill "))
            .and_then(|n| n.trim().parse().ok())
            .unwrap_or(0)
    }
}

impl Drop for MemoryCgroup {
    fn drop(&mut self) {
        for pid in self.read("cgroup.procs").lines() {
            let _ = std::process::Command::new("kill").args(["-9", pid]).status();
        }
        for _ in 0..50 {
            if std::fs::remove_dir(&self.0).is_ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// curl posting the file `body` to the webhook (or GET `/healthz` without one): the HTTP
/// status and the answer.
async fn curl(port: u16, ca: &Path, body: Option<&Path>) -> Result<(String, String)> {
    let mut command = tokio::process::Command::new("curl");
    command
        .args(["--silent", "--show-error", "--max-time", "60", "--cacert"])
        .arg(ca)
        .arg("--resolve")
        .arg(format!("{HOST}:{port}:127.0.0.1"))
        .args(["-w", "\n%{http_code}"]);
    match body {
        Some(file) => {
            command
                .args(["-H", "Content-Type: application/json", "--data-binary"])
                .arg(format!("@{}", file.display()))
                .arg(format!("https://{HOST}:{port}/mutate-pods"));
        }
        None => {
            command.arg(format!("https://{HOST}:{port}/healthz"));
        }
    }
    let out = command
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .output()
        .await
        .context("curl runs (apt-get install -y curl)")?;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (answer, status) = text.rsplit_once('\n').unwrap_or(("", ""));
    Ok((status.to_owned(), answer.to_owned() + &String::from_utf8_lossy(&out.stderr)))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "host lane (.ci/run): needs root and a writable cgroup v1 memory hierarchy"]
async fn the_extender_answers_concurrent_worst_case_reviews_within_the_charts_memory_limit()
-> Result<()> {
    let limit = charts_limit()?;
    let binary = crate::support::workspace_binary("baleen-extender")?;
    let api = FakeApiServer::start(&[]).await?;
    for i in 0..1000 {
        let name = format!("gpu-{i:04}");
        let state = baleen_k8s::fixtures::h200_state(&name, &[140, 100, 40, 0, 140, 140, 8, 0]);
        api.put_node(json!({
            "metadata": {"name": name, "annotations": {KEY: state.to_json()}},
            "status": {"allocatable": {"cpu": "96", "memory": "1000Gi"},
                       "capacity": {"awesome-ai-company.com/gpu-memory": "1120"}}
        }));
    }
    let dir = tempfile::tempdir()?;
    let material = baleen_extender::webhook::tls::Material::generate(&[HOST.to_owned()])?;
    std::fs::write(dir.path().join("tls.crt"), &material.cert_pem)?;
    std::fs::write(dir.path().join("tls.key"), &material.key_pem)?;
    let ca = dir.path().join("ca.crt");
    std::fs::write(&ca, &material.ca_pem)?;
    let kubeconfig = dir.path().join("kubeconfig");
    std::fs::write(
        &kubeconfig,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: {}\ncontexts:\n- name: fake\n  context:\n    cluster: fake\n    user: fake\ncurrent-context: fake\nusers:\n- name: fake\n  user: {{}}\n",
            api.url()
        ),
    )?;
    let shapes = [
        ("args of [0] items", worst_review(r#""containers":[{"name":"c","args":["#, "[0]", "]}]")),
        ("empty containers", worst_review(r#""containers":["#, "{}", "]")),
        (
            "gpu-memory containers",
            worst_review(
                r#""containers":["#,
                r#"{"resources":{"limits":{"awesome-ai-company.com/gpu-memory":1}}}"#,
                "]",
            ),
        ),
        ("a name of escapes", worst_review(r#""containers":[{"name":""#, r"\u0041", r#""}]"#)),
        (
            "many baleen names",
            worst_review(
                r#""containers":[{"name":"c","resources":{"limits":{"awesome-ai-company.com/gpu-memory":"1","#,
                r#""awesome-ai-company.com/x":0"#,
                "}}}]",
            ),
        ),
    ];
    let mut files = Vec::new();
    for (i, (what, body)) in shapes.iter().enumerate() {
        ensure!(body.len() <= MAX_REVIEW_BYTES, "{what}: {} bytes", body.len());
        let file = dir.path().join(format!("review-{i}.json"));
        std::fs::write(&file, body)?;
        files.push((*what, file));
    }

    let cgroup = MemoryCgroup::new(limit)?;
    let (verbs, webhook) = (free_port()?, free_port()?);
    let log = std::fs::File::create(dir.path().join("extender.log"))?;
    let mut child = tokio::process::Command::new("sh")
        .arg("-c")
        .arg(format!("echo $$ > {}/cgroup.procs && exec \"$0\" \"$@\"", cgroup.0.display()))
        .arg(&binary)
        .args(["--listen", &format!("127.0.0.1:{verbs}")])
        .args(["--scheduler-name", "baleen-scheduler"])
        .args(["--webhook-listen", &format!("127.0.0.1:{webhook}")])
        .arg("--webhook-cert-dir")
        .arg(dir.path())
        .env("KUBECONFIG", &kubeconfig)
        .stdout(Stdio::null())
        .stderr(log)
        .kill_on_drop(true)
        .spawn()?;
    let logs = || std::fs::read_to_string(dir.path().join("extender.log")).unwrap_or_default();
    let started = std::time::Instant::now();
    loop {
        if let Ok((status, _)) = curl(webhook, &ca, None).await
            && status == "200"
        {
            break;
        }
        if let Some(exit) = child.try_wait()? {
            bail!("the extender exited ({exit}) before serving:\n{}", logs());
        }
        ensure!(started.elapsed() < Duration::from_secs(60), "no webhook in 60 s:\n{}", logs());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let settled = cgroup.read("memory.usage_in_bytes");

    // Rounds of 16 reviews at once, every shape in each, 4 times the webhook's own bound.
    for round in 0..3 {
        let mut calls = tokio::task::JoinSet::new();
        for i in 0..16 {
            let (what, file) = files[(i + round) % files.len()].clone();
            let ca = ca.clone();
            calls.spawn(async move { (what, curl(webhook, &ca, Some(&file)).await) });
        }
        while let Some(done) = calls.join_next().await {
            let (what, answer) = done?;
            let (status, text) = answer?;
            ensure!(
                status == "200" && text.contains("\"allowed\""),
                "round {round}, {what}: {status} {text:.300}\nextender log:\n{}",
                logs()
            );
        }
        ensure!(child.try_wait()?.is_none(), "the extender died in round {round}:\n{}", logs());
    }
    let peak: u64 = cgroup.read("memory.max_usage_in_bytes").trim().parse().unwrap_or(0);
    let kills = cgroup.oom_kills();
    eprintln!(
        "memory cgroup of {} MiB: {} MiB after start, peak {} MiB over 48 worst-case reviews, 16 at a time; {kills} OOM kills",
        limit >> 20,
        settled.trim().parse::<u64>().unwrap_or(0) >> 20,
        peak >> 20
    );
    ensure!(kills == 0, "the OOM killer ran in the extender's cgroup ({kills})\n{}", logs());
    ensure!(peak < limit, "the cgroup reached its limit: {peak} of {limit} bytes");
    child.kill().await?;
    drop(cgroup);
    Ok(())
}
