//! Issue 40, item 1: the chart, server-side. `helm install` of the chart with its defaults and
//! with every values file under `packaging/helm/baleen/ci/` into the real API server (every
//! object through its validation: DeviceClasses and their CEL selectors, the admission policies
//! through the real CEL compiler and, once stored, its type checker, the webhook configuration
//! and its match conditions), `helm upgrade` with a changed value, and `helm uninstall` leaving
//! none of the chart's objects behind; and kube-scheduler started with the configuration the
//! chart renders.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail, ensure};
use serde_json::Value;

use baleen_tests::real::{ControlPlane, repo, with_control_plane};

const CHART: &str = "packaging/helm/baleen";
const NAMESPACE: &str = "baleen-system";
const RELEASE: &str = "baleen";

/// The chart's values files: its defaults, then each file of its `ci/`.
fn values_files() -> Result<Vec<(String, String)>> {
    let mut files = vec![("default".to_owned(), format!("{CHART}/values.yaml"))];
    let mut ci: Vec<(String, String)> = std::fs::read_dir(repo().join(CHART).join("ci"))?
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let stem = name.strip_suffix("-values.yaml")?.to_owned();
            Some((stem, format!("{CHART}/ci/{name}")))
        })
        .collect();
    ci.sort();
    files.extend(ci);
    Ok(files)
}

/// The objects the chart renders with `values`: `(namespace, "kind.version.group/name")`, the
/// form kubectl takes, by namespace (cluster-scoped ones under the release's, where kubectl
/// ignores it).
fn rendered(plane: &ControlPlane, values: &str) -> Result<BTreeMap<String, Vec<String>>> {
    let text = plane.helm(&["template", RELEASE, CHART, "-n", NAMESPACE, "-f", values])?;
    let mut objects: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for doc in serde_yaml_ng::Deserializer::from_str(&text) {
        let value: Value = serde::Deserialize::deserialize(doc)?;
        let (Some(api_version), Some(kind), Some(name)) = (
            value["apiVersion"].as_str(),
            value["kind"].as_str(),
            value["metadata"]["name"].as_str(),
        ) else {
            continue;
        };
        let kind = kind.to_lowercase();
        let resource = match api_version.split_once('/') {
            Some((group, version)) => format!("{kind}.{version}.{group}/{name}"),
            None => format!("{kind}/{name}"),
        };
        let namespace = value["metadata"]["namespace"].as_str().unwrap_or(NAMESPACE).to_owned();
        objects.entry(namespace).or_default().push(resource);
    }
    Ok(objects)
}

/// Which of `objects` the API server still has.
fn still_there(
    plane: &ControlPlane,
    objects: &BTreeMap<String, Vec<String>>,
) -> Result<Vec<String>> {
    let mut found = Vec::new();
    for (namespace, resources) in objects {
        let mut args = vec!["get", "-n", namespace, "--ignore-not-found", "-o", "name"];
        args.extend(resources.iter().map(String::as_str));
        found.extend(plane.kubectl(&args)?.lines().map(|l| format!("{namespace}: {l}")));
    }
    Ok(found)
}

/// Other projects' CRDs the chart's objects may need, by API group: the project's Go module (the
/// module proxy serves its repository, CRDs included), where in it, and which files. Nothing is
/// copied into this repository.
const CRDS: [(&str, &str, &str, &[&str]); 2] = [
    (
        "monitoring.coreos.com",
        "github.com/prometheus-operator/prometheus-operator@v0.85.0",
        "example/prometheus-operator-crd",
        &["monitoring.coreos.com_servicemonitors", "monitoring.coreos.com_prometheusrules"],
    ),
    (
        "cert-manager.io",
        "github.com/cert-manager/cert-manager@v1.21.2",
        "deploy/crds",
        &["cert-manager.io_certificates", "cert-manager.io_issuers"],
    ),
];

/// Installs the CRDs of `group` (one of [`CRDS`]) and waits until they are served.
fn install_crds(plane: &ControlPlane, group: &str) -> Result<()> {
    let (_, module, dir, files) =
        CRDS.iter().find(|(g, ..)| *g == group).with_context(|| format!("no CRDs for {group}"))?;
    let out = std::process::Command::new("go")
        .args(["mod", "download", "-json", module])
        .current_dir(repo().join("tests/harness"))
        .output()
        .context("cannot run go (the lane needs Go and the module proxy)")?;
    ensure!(
        out.status.success(),
        "go mod download {module}: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    let info: Value = serde_json::from_slice(&out.stdout)?;
    let dir = Path::new(info["Dir"].as_str().context("the module's directory")?).join(dir);
    for file in *files {
        let path = dir.join(format!("{file}.yaml"));
        plane.kubectl(&["apply", "--server-side", "-f", &path.display().to_string()])?;
        let (group, plural) = file.split_once('_').context("group_plural")?;
        // Polled, not `kubectl wait --for=condition=Established`: a CRD read before the API
        // server has written any condition makes kubectl 1.34 fail at once ("conditions
        // accessor error: <nil>") instead of waiting (seen once in CI).
        let crd = format!("crd/{plural}.{group}");
        let started = Instant::now();
        loop {
            let established = plane.kubectl(&[
                "get",
                &crd,
                "-o",
                "jsonpath={.status.conditions[?(@.type==\"Established\")].status}",
            ])?;
            if established.trim() == "True" {
                break;
            }
            ensure!(
                started.elapsed() < Duration::from_secs(60),
                "{crd} not established in 60 s ({established:?})"
            );
            std::thread::sleep(Duration::from_millis(250));
        }
    }
    Ok(())
}

/// Every ValidatingAdmissionPolicy of the install type-checked by the API server with no
/// warning (the type checker runs after the policy is stored and writes its status).
async fn policies_type_check(plane: &ControlPlane) -> Result<()> {
    let started = Instant::now();
    loop {
        let list: Value = serde_json::from_str(&plane.kubectl(&[
            "get",
            "validatingadmissionpolicies.v1.admissionregistration.k8s.io",
            "-l",
            &format!("app.kubernetes.io/instance={RELEASE}"),
            "-o",
            "json",
        ])?)?;
        let items = list["items"].as_array().cloned().unwrap_or_default();
        ensure!(!items.is_empty(), "the install has no ValidatingAdmissionPolicy");
        let checked = items.iter().all(|p| {
            p["status"]["observedGeneration"] == p["metadata"]["generation"]
                && !p["status"]["typeChecking"].is_null()
        });
        if checked {
            for p in &items {
                let warnings = &p["status"]["typeChecking"]["expressionWarnings"];
                ensure!(
                    warnings.as_array().is_none_or(Vec::is_empty),
                    "policy {}: the type checker warns {warnings}",
                    p["metadata"]["name"]
                );
            }
            return Ok(());
        }
        if started.elapsed() > Duration::from_secs(60) {
            bail!("the policies were not type-checked within 60 s: {items:?}");
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Uninstalls the release and waits until none of `objects` is left.
async fn uninstall(plane: &ControlPlane, objects: &BTreeMap<String, Vec<String>>) -> Result<()> {
    plane.helm(&["uninstall", RELEASE, "-n", NAMESPACE, "--wait", "--timeout", "120s"])?;
    let started = Instant::now();
    loop {
        let left = still_there(plane, objects)?;
        if left.is_empty() {
            return Ok(());
        }
        if started.elapsed() > Duration::from_secs(60) {
            bail!("helm uninstall left {left:?}");
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

#[tokio::test]
#[ignore = "real-control-plane lane: BALEEN_KUBE=$(scripts/build-control-plane.sh), --ignored"]
async fn every_values_file_installs_upgrades_and_uninstalls_server_side() {
    with_control_plane(async |plane| {
        let mut crds_installed = std::collections::BTreeSet::new();
        for (name, values) in values_files()? {
            let objects = rendered(plane, &values)?;
            for (group, ..) in CRDS {
                let needed = objects.values().flatten().any(|r| r.contains(&format!(".{group}/")));
                if needed && crds_installed.insert(group) {
                    install_crds(plane, group).with_context(|| format!("{name}: {group}'s CRDs"))?;
                }
            }
            plane
                .helm(&[
                    "install", RELEASE, CHART, "-n", NAMESPACE, "--create-namespace", "-f", &values,
                ])
                .with_context(|| format!("{name}: helm install"))?;
            let there = still_there(plane, &objects)?;
            let rendered_count: usize = objects.values().map(Vec::len).sum();
            ensure!(
                there.len() == rendered_count,
                "{name}: installed, yet the API server has {} of the {rendered_count} objects: {there:?} of {objects:?}",
                there.len()
            );
            policies_type_check(plane).await.with_context(|| name.clone())?;
            if name == "default" {
                plane
                    .helm(&[
                        "upgrade", RELEASE, CHART, "-n", NAMESPACE, "-f", &values, "--set",
                        "agent.config.watchdog.interval=20s",
                    ])
                    .context("helm upgrade")?;
                let config = plane.kubectl(&[
                    "get", "configmap", "baleen-agent-config", "-n", NAMESPACE, "-o",
                    "jsonpath={.data.agent\\.yaml}",
                ])?;
                ensure!(config.contains("interval: 20s"), "the upgrade's value: {config}");
            }
            uninstall(plane, &objects).await.with_context(|| name.clone())?;
        }
        Ok(())
    })
    .await;
}

/// The scheduler's configuration as the chart renders it (its ConfigMap), with the client's
/// kubeconfig added (in the chart's pod it is the in-cluster account).
fn scheduler_config(plane: &ControlPlane) -> Result<String> {
    let config = baleen_tests::real::scheduling::rendered_scheduler_config_text(plane)?;
    let kubeconfig = plane.kubeconfig(baleen_tests::real::ADMIN)?;
    Ok(format!("{config}clientConnection:\n  kubeconfig: {}\n", kubeconfig.display()))
}

#[tokio::test]
#[ignore = "real-control-plane lane: BALEEN_KUBE=$(scripts/build-control-plane.sh), --ignored"]
async fn kube_scheduler_loads_the_rendered_configuration_and_refuses_a_bad_one() {
    with_control_plane(async |plane| {
        plane.kubectl(&["create", "namespace", NAMESPACE])?;
        let config = scheduler_config(plane)?;
        let good = plane.path("scheduler.yaml");
        std::fs::write(&good, &config)?;
        // A field the configuration does not have: the strict decoder refuses it.
        let bad = plane.path("scheduler-bad.yaml");
        std::fs::write(&bad, format!("{config}notAField: true\n"))?;
        let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        let serving = [format!("--secure-port={port}"), "--bind-address=127.0.0.1".to_owned()];
        let (code, log) = plane.run(
            "kube-scheduler",
            &[&format!("--config={}", bad.display()), &serving[0], &serving[1]],
            Duration::from_secs(60),
        )?;
        ensure!(code.is_some_and(|c| c != 0), "a bad configuration was taken ({code:?}):\n{log}");
        ensure!(log.contains("notAField"), "the refusal names the field:\n{log}");
        // The rendered one: running, healthy and leading within a minute.
        let args = [format!("--config={}", good.display()), serving[0].clone(), serving[1].clone()];
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        plane.spawn("kube-scheduler", &args)?;
        let started = Instant::now();
        loop {
            let lease = plane.kubectl(&[
                "get",
                "lease",
                "baleen-scheduler",
                "-n",
                NAMESPACE,
                "--ignore-not-found",
                "-o",
                "jsonpath={.spec.holderIdentity}",
            ])?;
            if !lease.trim().is_empty() {
                break;
            }
            if started.elapsed() > Duration::from_secs(60) {
                bail!("kube-scheduler with the rendered configuration took no lease in 60 s");
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        plane.ready("/readyz", Duration::from_secs(5)).await
    })
    .await;
}
