//! Issue 40, item 2: rights under the real authorizer and the real admission policies. The
//! agent's calls made with a real token of its account, bound to a pod on node A (the token
//! names the node, as the kubelet's projected tokens do); what the docs say it cannot do,
//! refused; a tenant's root pod refused by the pod policy the chart ships. And issue 39, item 5:
//! the Node authorizer holds a kubelet's credentials to the pods of its node, which is what
//! `agent.podReads.with: kubelet` rests on.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, Result, bail, ensure};
use baleen_agent::kube_api::{KubeNodeApi, NodeApi, client_from_kubeconfig};
use serde_json::json;

use baleen_tests::real::agent::agent_kubeconfig;
use baleen_tests::real::{ControlPlane, NODE_A, with_control_plane};

const CHART: &str = "packaging/helm/baleen";
const NAMESPACE: &str = "baleen-system";
const ANNOTATION: &str = "awesome-ai-company.com/gpu-state";

fn node(name: &str) -> serde_json::Value {
    json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}})
}

/// A pod of the agent's account bound to `node` (no kubelet runs it: it exists to bind a token).
fn agent_pod(name: &str, node: &str) -> serde_json::Value {
    json!({"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": name, "namespace": NAMESPACE},
           "spec": {"nodeName": node, "serviceAccountName": "baleen-agent",
                    "containers": [{"name": "agent", "image": "baleen:test"}]}})
}

/// The agent's API adapter as the agent of pod `pod`.
async fn agent_api(plane: &ControlPlane, pod: &str) -> Result<Arc<KubeNodeApi>> {
    let client = client_from_kubeconfig(&agent_kubeconfig(plane, pod)?).await?;
    Ok(Arc::new(KubeNodeApi::new(client)))
}

/// Follows the pods of `node` with the agent's adapter until `pod` is among them: their names.
async fn pods_seen(api: &Arc<KubeNodeApi>, node: &str, pod: &str) -> Result<Vec<String>> {
    let (view, seen) = tokio::sync::watch::channel(Default::default());
    let token = tokio_util::sync::CancellationToken::new();
    tokio::spawn({
        let (api, token, node) = (api.clone(), token.clone(), node.to_owned());
        async move { api.follow_pods(&node, view, token).await }
    });
    let found = baleen_tests::real::eventually(pod, Duration::from_secs(30), || {
        let v = seen.borrow();
        v.synced && v.pods.values().any(|p| p.name == pod)
    })
    .await;
    token.cancel();
    found?;
    let names = seen.borrow().pods.values().map(|p| p.name.clone()).collect();
    Ok(names)
}

fn forbidden(
    result: Result<(), baleen_agent::kube_api::ApiError>,
    what: &str,
    says: &str,
) -> Result<()> {
    match result {
        Ok(()) => bail!("{what}: allowed"),
        Err(e) => {
            let text = format!("{:#}", anyhow::Error::from(e));
            ensure!(text.contains(says), "{what}: refused, but not saying {says:?}: {text}");
            Ok(())
        }
    }
}

#[tokio::test]
#[ignore = "real-control-plane lane: BALEEN_KUBE=$(scripts/build-control-plane.sh), --ignored"]
async fn an_agents_token_changes_only_its_own_nodes_gpu_state() {
    with_control_plane(async |plane| {
        plane.install(&[])?;
        plane.create(&node("node-a"))?;
        plane.create(&node("node-b"))?;
        plane.create(&agent_pod("agent-a", "node-a"))?;
        let api = agent_api(plane, "agent-a").await?;
        // The policies take effect once the API server's admission has loaded them (a second
        // or so after they are stored): until another Node's annotation is refused.
        let started = std::time::Instant::now();
        while api.annotate("node-b", ANNOTATION, "{}").await.is_ok() {
            if started.elapsed() > Duration::from_secs(30) {
                bail!("the agent of node-a still writes node-b's gpu-state after 30 s");
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        // What the agent calls, with its account: allowed.
        api.annotate("node-a", ANNOTATION, "{}").await.context("its own Node's gpu-state")?;
        let annotated =
            plane.kubectl(&["get", "node", "node-a", "-o", "jsonpath={.metadata.annotations}"])?;
        ensure!(annotated.contains(ANNOTATION), "{annotated}");
        let notice = baleen_agent::isolation::watchdog::Notice {
            regarding: baleen_agent::isolation::watchdog::Regarding::Node,
            reason: "BaleenLaneCheck",
            action: "Observed",
            note: "the real-control-plane lane's Event".into(),
            warning: false,
        };
        api.record_event("node-a", &notice).await.context("an Event")?;
        pods_seen(&api, "node-a", "agent-a").await.context("the agent lists its node's pods")?;
        // What the docs say it cannot: another Node's annotation, its own Node's labels.
        forbidden(
            api.annotate("node-b", ANNOTATION, "{}").await,
            "node-b's gpu-state",
            "the baleen agent may change only the Node it runs on",
        )?;
        forbidden(
            api.annotate("node-a", "example.com/other", "x").await,
            "another annotation of its own Node",
            "may change only its Node's",
        )?;
        let client = client_from_kubeconfig(&agent_kubeconfig(plane, "agent-a")?).await?;
        let secrets: kube::Api<k8s_openapi::api::core::v1::Secret> = kube::Api::all(client);
        match secrets.list(&Default::default()).await {
            Ok(_) => bail!("the agent's account read Secrets"),
            Err(kube::Error::Api(s)) if s.code == 403 => {}
            Err(e) => bail!("listing Secrets: {e}"),
        }
        Ok(())
    })
    .await;
}

#[tokio::test]
#[ignore = "real-control-plane lane: BALEEN_KUBE=$(scripts/build-control-plane.sh), --ignored"]
async fn a_kubelets_credentials_read_only_the_pods_of_its_node() {
    // Issue 39, item 5: what `agent.podReads.with: kubelet` rests on, from the real Node
    // authorizer (`AuthorizeNodeWithSelectors`, on by default since 1.32).
    with_control_plane(async |plane| {
        plane.install(&["-f", &format!("{CHART}/ci/kubelet-pod-reads-values.yaml")])?;
        plane.create(&node("node-a"))?;
        plane.create(&node("node-b"))?;
        plane.create(&agent_pod("agent-a", "node-a"))?;
        plane.create(&agent_pod("agent-b", "node-b"))?;
        let kubelet = plane.kubeconfig(NODE_A)?;
        let as_node = |selector: Option<&str>| {
            let mut args = vec![
                "--kubeconfig".to_owned(),
                kubelet.display().to_string(),
                "get".into(),
                "pods".into(),
                "-A".into(),
                "-o".into(),
                "name".into(),
            ];
            if let Some(s) = selector {
                args.push(format!("--field-selector={s}"));
            }
            let out = std::process::Command::new("kubectl").args(&args).output()?;
            Ok::<_, anyhow::Error>((
                out.status.success(),
                String::from_utf8_lossy(&out.stdout).into_owned(),
                String::from_utf8_lossy(&out.stderr).into_owned(),
            ))
        };
        let (ok, pods, err) = as_node(Some("spec.nodeName=node-a"))?;
        ensure!(
            ok && pods.contains("agent-a") && !pods.contains("agent-b"),
            "its own node's pods: {pods} {err}"
        );
        for other in [None, Some("spec.nodeName=node-b")] {
            let (ok, pods, err) = as_node(other)?;
            ensure!(!ok && err.contains("forbidden"), "{other:?}: a node read {pods} {err}");
        }
        // The agent with the kubelet's credentials for its pod reads, its own account for the
        // rest: its account has no pod rights in this install, and it still sees its pods.
        let own = client_from_kubeconfig(&agent_kubeconfig(plane, "agent-a")?).await?;
        let pods: kube::Api<k8s_openapi::api::core::v1::Pod> = kube::Api::all(own.clone());
        let params = kube::api::ListParams::default().fields("spec.nodeName=node-a");
        match pods.list(&params).await {
            Ok(_) => bail!("the agent's account lists pods in a kubelet-pod-reads install"),
            Err(kube::Error::Api(s)) if s.code == 403 => {}
            Err(e) => bail!("listing pods: {e}"),
        }
        let api = Arc::new(KubeNodeApi::reading_pods_with(own, Some(&kubelet)).await?);
        let seen = pods_seen(&api, "node-a", "agent-a")
            .await
            .context("the pods read with the kubelet's credentials")?;
        ensure!(!seen.contains(&"agent-b".to_owned()), "another node's pod: {seen:?}");
        Ok(())
    })
    .await;
}

#[tokio::test]
#[ignore = "real-control-plane lane: BALEEN_KUBE=$(scripts/build-control-plane.sh), --ignored"]
async fn a_tenants_root_pod_is_refused_by_the_pod_policy() {
    with_control_plane(async |plane| {
        // No webhook here (its test is webhook.rs): the pods are created as they are.
        plane.install(&["--set", "webhook.enabled=false"])?;
        plane.kubectl(&["create", "namespace", "team-a"])?;
        // Pods need the namespace's default account, which the controller manager makes.
        plane.default_account("team-a", Duration::from_secs(30)).await?;
        let pod = |name: &str, context: serde_json::Value| {
            let mut container = json!({"name": "c", "image": "x",
                "resources": {"limits": {"awesome-ai-company.com/gpu-memory": "8"}}});
            if !context.is_null() {
                container["securityContext"] = context;
            }
            json!({"apiVersion": "v1", "kind": "Pod",
                   "metadata": {"name": name, "namespace": "team-a"},
                   "spec": {"containers": [container]}})
        };
        // The policy is enforced once its type checking and binding are in place.
        let root = pod("root", serde_json::Value::Null);
        let started = std::time::Instant::now();
        loop {
            match plane.create(&root) {
                Err(e) if format!("{e:#}").contains("baleen-gpu-memory-non-root") => break,
                Err(e) => bail!("refused, not by the policy: {e:#}"),
                Ok(_) => {
                    plane.kubectl(&["delete", "pod", "root", "-n", "team-a", "--wait=false"])?;
                    if started.elapsed() > Duration::from_secs(30) {
                        bail!("a root pod asking for gpu-memory was admitted for 30 s");
                    }
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
            }
        }
        plane
            .create(&pod("safe", json!({"runAsNonRoot": true, "allowPrivilegeEscalation": false})))
            .context("a non-root pod that cannot escalate")?;
        Ok(())
    })
    .await;
}

/// What the chart's scheduler account (kube-scheduler and the extender, one pod) may do, asked
/// of the real authorizer with a real token of the account (`kubectl auth can-i`): every call
/// its binaries make, and none of what docs/install.md says it cannot.
#[tokio::test]
#[ignore = "real-control-plane lane: BALEEN_KUBE=$(scripts/build-control-plane.sh), --ignored"]
async fn the_scheduler_account_may_do_what_its_binaries_do_and_no_more() {
    with_control_plane(async |plane| {
        plane.install(&[])?;
        let kubeconfig = baleen_tests::real::scheduling::scheduler_kubeconfig(plane)?;
        let can = |args: &[&str]| -> Result<bool> {
            let out = std::process::Command::new("kubectl")
                .args(["--kubeconfig", &kubeconfig.display().to_string(), "auth", "can-i"])
                .args(args)
                .output()
                .context("kubectl auth can-i")?;
            Ok(String::from_utf8_lossy(&out.stdout).trim() == "yes")
        };
        let allowed: &[&[&str]] = &[
            // kube-scheduler (system:kube-scheduler) and its lease.
            &["create", "pods", "--subresource=binding", "-n", "team-a"],
            &["list", "nodes"],
            &["watch", "pods", "--all-namespaces"],
            &["update", "leases/baleen-scheduler", "-n", NAMESPACE],
            // The extender: its watches, its binds, its webhook certificate and CA bundle.
            &["get", "pods", "-n", "team-a"],
            &["create", "secrets", "-n", NAMESPACE],
            &["get", "secrets/baleen-webhook-tls", "-n", NAMESPACE],
            &["patch", "mutatingwebhookconfigurations/baleen-scheduler-name"],
        ];
        for args in allowed {
            ensure!(can(args)?, "the scheduler account may not {args:?}");
        }
        let refused: &[&[&str]] = &[
            &["get", "secrets/other", "-n", NAMESPACE],
            &["list", "secrets", "-n", NAMESPACE],
            &["get", "secrets", "-n", "kube-system"],
            &["patch", "mutatingwebhookconfigurations/another-webhook"],
            &["patch", "nodes"],
            &["create", "pods", "-n", "team-a"],
        ];
        for args in refused {
            ensure!(!can(args)?, "the scheduler account may {args:?}");
        }
        Ok(())
    })
    .await;
}
