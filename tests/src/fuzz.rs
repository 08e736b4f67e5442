//! The bodies of the fuzz targets (`fuzz/fuzz_targets/*.rs`, run with cargo-fuzz, see
//! docs/agent.md "Fuzzing"), one per parser of outside input, and their seeds from the
//! repository's own examples. Each body must return (never panic, never hang, never take
//! memory out of proportion to its input) on any bytes; `tests/tests/e2e/fuzz_seeds.rs` runs every
//! body over its seeds and thousands of mutations of them on stable Rust in `cargo test`.

use serde::Deserialize as _;
use std::path::{Path, PathBuf};

/// A fuzz target: its name and its body.
pub type Target = (&'static str, fn(&[u8]));

/// Every target.
pub const TARGETS: &[Target] = &[
    ("config", config),
    ("topology", topology),
    ("checkpoint", checkpoint),
    ("gpu_state", gpu_state),
    ("extender_request", extender_request),
    ("admission_review", admission_review),
    ("quantity", quantity),
    ("mps_log", mps_log),
    ("proc_cgroup", proc_cgroup),
];

fn text(data: &[u8]) -> Option<&str> {
    std::str::from_utf8(data).ok()
}

/// The agent's configuration file, resolved as the agent resolves it.
pub fn config(data: &[u8]) {
    if let Some(t) = text(data) {
        let env = baleen_agent::config::Environment::default();
        let _ = baleen_agent::config::resolve_text(t, Path::new("fuzz.yaml"), &env);
    }
}

/// A simulated topology, parsed and validated, then discovered and built into a ledger.
pub fn topology(data: &[u8]) {
    use baleen_agent::inventory::GpuInventory as _;
    let Some(t) = text(data) else { return };
    let Ok(inventory) =
        baleen_agent::inventory::simulated::SimulatedInventory::from_yaml_str(t, "fuzz.yaml")
    else {
        return;
    };
    if let Ok(found) = inventory.discover() {
        let _ = baleen_agent::ledger::DeviceLedger::new("fuzz", &found, Default::default());
    }
}

/// The checkpoint, checked as the agent reads it: as a snapshot, and as a journal replayed over
/// an empty snapshot.
pub fn checkpoint(data: &[u8]) {
    use baleen_agent::checkpoint::{Checkpoint, Contents, FORMAT};
    let cp = Checkpoint::in_dir(Path::new("/nonexistent"));
    let _ = cp.parse(data);
    let mut contents = Contents {
        format: FORMAT,
        node: "seed".into(),
        boot_id: "boot".into(),
        layout: Default::default(),
        sequence: Some(0),
        allocations: Vec::new(),
    };
    let _ = cp.replay_journal(&mut contents, data);
}

/// The node-state annotation, as the extender reads it.
pub fn gpu_state(data: &[u8]) {
    if let Some(t) = text(data) {
        let _ = baleen_k8s::gpu_state::NodeGpuState::parse(t);
    }
}

/// A kube-scheduler extender request: parsed the fast way (`ExtenderArgs::parse`, names split
/// by hand) and by serde_json, which must agree, and its pod's demand read.
pub fn extender_request(data: &[u8]) {
    use baleen_extender::protocol::ExtenderArgs;
    let seen = |args: &Result<ExtenderArgs<'_>, serde_json::Error>| {
        args.as_ref().ok().map(|a| {
            let names: Option<Vec<&str>> =
                a.node_names.as_ref().map(|n| n.iter().map(AsRef::as_ref).collect());
            format!("{:?} {:?} {:?}", a.pod, a.nodes, names)
        })
    };
    let fast = ExtenderArgs::parse(data);
    let serde = serde_json::from_slice::<ExtenderArgs<'_>>(data);
    assert_eq!(seen(&fast), seen(&serde), "the fast read and serde_json's differ");
    let Ok(args) = fast else { return };
    let _ = baleen_extender::demand::Demand::of(&args.pod, "awesome-ai-company.com");
    // Served as the HTTP handler serves it (names a recent call's reused, its answer given
    // again or patched, the others judged ahead after it): the bytes of the answer judged afresh from the parsed call. One
    // extender across inputs, so that later inputs meet the names and answers of earlier ones.
    let extender = fuzz_extender();
    let served = extender.filter_call(data).expect("a body serde_json reads is answered");
    let afresh = extender.filter_json(&args);
    assert_eq!(
        String::from_utf8_lossy(&served.body),
        String::from_utf8_lossy(&afresh.body),
        "the filter served and the filter judged afresh differ"
    );
    // The other answers kept for these names judged ahead, as the server does after answering.
    if let Some(judge) = &served.judge {
        extender.judge_ahead(judge);
    }
}

/// An AdmissionReview as the webhook reads it (streamed, only what it judges kept), held to the
/// verdict judged from the pod parsed whole, for both of the webhook's rules.
pub fn admission_review(data: &[u8]) {
    use baleen_extender::webhook::{judge, judge_cpu_only, review};
    let domain = "awesome-ai-company.com";
    for cpu_only in [false, true] {
        let rule = review::Rule {
            domain,
            scheduler: "baleen-scheduler",
            largest_units: Some(140),
            cpu_only,
            claims: None,
        };
        let Ok(reviewed) = review::read(data, rule) else { continue };
        let _ = review::answer(&reviewed, "baleen-scheduler");
        let Ok(streamed) = &reviewed.verdict else { continue };
        let object = serde_json::from_slice::<serde_json::Value>(data)
            .ok()
            .and_then(|v| v.pointer("/request/object").cloned());
        let Some(pod) =
            object.and_then(|o| serde_json::from_value::<baleen_extender::protocol::Pod>(o).ok())
        else {
            continue;
        };
        let whole = if cpu_only {
            judge_cpu_only(&pod, domain)
        } else {
            judge(&pod, domain, "baleen-scheduler", Some(140))
        };
        assert_eq!(
            streamed.as_str(),
            whole.as_str(),
            "streamed and whole differ (cpu_only {cpu_only})"
        );
    }
}

/// An extender whose cache holds nodes `a` to `e` (`e` with no usable document), for
/// [`extender_request`].
fn fuzz_extender() -> &'static baleen_extender::service::Extender {
    static EXTENDER: std::sync::OnceLock<std::sync::Arc<baleen_extender::service::Extender>> =
        std::sync::OnceLock::new();
    EXTENDER.get_or_init(|| {
        let extender =
            baleen_extender::service::Extender::new(baleen_extender::service::Settings::default());
        let key = "awesome-ai-company.com/gpu-state";
        for (name, free) in
            [("a", [140, 20]), ("b", [60, 0]), ("c", [0, 0]), ("d", [8, 100]), ("e", [140, 140])]
        {
            let state = baleen_k8s::fixtures::h200_state(name, &free);
            let annotations = if name == "e" {
                serde_json::json!({})
            } else {
                serde_json::json!({key: state.to_json()})
            };
            let node: baleen_extender::protocol::Node = serde_json::from_value(serde_json::json!({
                "metadata": {"name": name, "annotations": annotations},
                "status": {"allocatable": {"cpu": "96", "memory": "1000Gi"},
                           "capacity": {"awesome-ai-company.com/gpu-memory": "280"}}
            }))
            .expect("node");
            extender
                .cluster
                .write()
                .expect("lock")
                .set_node(name, baleen_extender::cluster::NodeEntry::of(&node, key));
        }
        extender
    })
}

/// Kubernetes quantities (the scheduler core's, the agent's sizes).
pub fn quantity(data: &[u8]) {
    let Some(t) = text(data) else { return };
    let _ = baleen_k8s::quantity::quantity_milli(t);
    let _ = baleen_agent::quantity::parse_quantity(t);
    let _ = baleen_agent::config::parse_duration(t);
}

/// The MPS control daemon's log, line by line.
pub fn mps_log(data: &[u8]) {
    let mut reader = baleen_agent::isolation::mps::users::LogReader::default();
    for line in String::from_utf8_lossy(data).lines() {
        let _ = reader.line(line);
    }
}

/// A process's `/proc/<pid>/cgroup`.
pub fn proc_cgroup(data: &[u8]) {
    if let Some(t) = text(data) {
        let _ = baleen_agent::isolation::watchdog::container_of(t);
    }
}

/// The seeds of `target`, from the repository's own examples: its topology files and agent
/// configurations as they are, and the documents the agent writes for them (its checkpoint and
/// node-state annotation with a few grants), with a few inline ones where the repository has no
/// file of the kind.
pub fn seeds(target: &str) -> Vec<Vec<u8>> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let files = |dir: &str, keep: &dyn Fn(&Path) -> bool| -> Vec<Vec<u8>> {
        let mut paths: Vec<PathBuf> = std::fs::read_dir(root.join(dir))
            .map(|d| d.flatten().map(|e| e.path()).collect())
            .unwrap_or_default();
        paths.retain(|p| keep(p));
        paths.sort();
        paths.iter().filter_map(|p| std::fs::read(p).ok()).collect()
    };
    let yaml = |p: &Path| p.extension().is_some_and(|e| e == "yaml");
    let inline: Vec<&[u8]> = match target {
        "quantity" => vec![b"1GiB", b"500m", b"23034MiB", b"1.5", b"2e3", b"30s", b"-1", b"7Ei"],
        "mps_log" => vec![
            b"[2026-11-30 10:11:12.123 Control 1234] Accepting connection...\n[2026-11-30 10:11:12.124 Control 1234] User did not send valid credentials\n[2026-11-30 10:11:12.200 Control 1234] Server 99 exited with status 0\n",
        ],
        "proc_cgroup" => vec![
            b"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1a2b3c4d_5e6f_7a8b_9c0d_1e2f3a4b5c6d.slice/cri-containerd-4f2a6b8c9d0e1f2a3b4c5d6e7f8091a2.scope\n",
            b"12:memory:/kubepods/burstable/pod1a2b3c4d-5e6f-7a8b-9c0d-1e2f3a4b5c6d/4f2a6b8c9d0e1f2a3b4c5d6e7f8091a2\n",
        ],
        "admission_review" => vec![
            b"{\"apiVersion\":\"admission.k8s.io/v1\",\"kind\":\"AdmissionReview\",\"request\":{\"uid\":\"u\",\"namespace\":\"team-a\",\"operation\":\"CREATE\",\"object\":{\"metadata\":{\"name\":\"p\"},\"spec\":{\"containers\":[{\"name\":\"c\",\"args\":[\"0\"],\"resources\":{\"limits\":{\"awesome-ai-company.com/gpu-memory\":\"8\",\"cpu\":\"1\"}}}],\"initContainers\":[{\"name\":\"i\",\"resources\":{\"requests\":{\"awesome-ai-company.com/gpu-memory\":8}}}],\"schedulerName\":\"default-scheduler\"}},\"oldObject\":null}}",
            b"{\"apiVersion\":\"admission.k8s.io/v1\",\"request\":{\"uid\":\"v\",\"object\":{\"spec\":{\"containers\":[{\"name\":\"c\",\"resources\":{\"limits\":{\"awesome-ai-company.com/gpu-memory\":[0],\"awesome-ai-company.com/gpu\":\"1\"},\"requests\":null}}],\"initContainers\":null}}}}",
        ],
        "extender_request" => vec![
            b"{\"Pod\":{\"metadata\":{\"name\":\"p\"},\"spec\":{\"containers\":[{\"name\":\"c\",\"resources\":{\"limits\":{\"awesome-ai-company.com/gpu-memory\":\"8\"}}}],\"initContainers\":[{\"name\":\"i\",\"resources\":{\"requests\":{\"cpu\":\"2\"}}}],\"overhead\":{\"cpu\":\"250m\"}}},\"NodeNames\":[\"a\"]}",
            b"{\"Pod\":{\"metadata\":{\"name\":\"q\"},\"spec\":{\"containers\":[{\"name\":\"c\",\"resources\":{\"limits\":{\"awesome-ai-company.com/gpu-memory\":\"40\"}}}]}},\"Nodes\":null,\"NodeNames\":[\"a\",\"b\",\"c\",\"d\",\"e\",\"x\",\"a\"]}",
        ],
        _ => Vec::new(),
    };
    let mut out: Vec<Vec<u8>> = inline.into_iter().map(<[u8]>::to_vec).collect();
    match target {
        // The agent's configuration in each rendered install (its ConfigMap's agent.yaml).
        "config" => {
            for manifest in files("packaging/manifests", &yaml) {
                out.extend(agent_configs(&manifest));
            }
        }
        "topology" => out.extend(files("packaging/examples", &yaml)),
        "gpu_state" | "checkpoint" => {
            out.extend(written(target, &files("packaging/examples", &yaml)))
        }
        _ => {}
    }
    out
}

/// The node-state documents or checkpoints the agent writes for `topologies`, two grants each.
/// The `agent.yaml` of every `baleen-agent-config` ConfigMap in a YAML stream.
fn agent_configs(stream: &[u8]) -> Vec<Vec<u8>> {
    let Some(t) = text(stream) else { return Vec::new() };
    serde_yaml_ng::Deserializer::from_str(t)
        .filter_map(|doc| serde_yaml_ng::Value::deserialize(doc).ok())
        .filter(|doc| doc["kind"].as_str() == Some("ConfigMap"))
        .filter(|doc| doc["metadata"]["name"].as_str() == Some("baleen-agent-config"))
        .filter_map(|doc| doc["data"]["agent.yaml"].as_str().map(|s| s.as_bytes().to_vec()))
        .collect()
}

fn written(target: &str, topologies: &[Vec<u8>]) -> Vec<Vec<u8>> {
    use baleen_agent::inventory::GpuInventory as _;
    use baleen_agent::ledger::{DeviceLedger, View};
    let dir = std::env::temp_dir().join(format!("baleen-fuzz-seeds-{}", std::process::id()));
    let mut out = Vec::new();
    for yaml in topologies {
        let Some(t) = text(yaml) else { continue };
        let Ok(inv) =
            baleen_agent::inventory::simulated::SimulatedInventory::from_yaml_str(t, "seed")
        else {
            continue;
        };
        let Ok(found) = inv.discover() else { continue };
        let Ok(mut ledger) = DeviceLedger::new("seed", &found, Default::default()) else {
            continue;
        };
        for view in [View::GpuMemory, View::Gpu] {
            let ids: Vec<String> =
                ledger.devices(&view).into_iter().take(1).map(|d| d.id).collect();
            let _ = ledger.allocate(&view, &ids, 1);
        }
        match target {
            "gpu_state" => out
                .push(ledger.node_state("seed", 3, |_| Some("ns/p".into())).to_json().into_bytes()),
            _ => {
                let cp = baleen_agent::checkpoint::Checkpoint::in_dir(&dir);
                if let Ok(mut journal) =
                    cp.compact("seed", "boot", &ledger.layout(), &ledger.records(), 0)
                {
                    let delta =
                        baleen_agent::ledger::Delta { removed: Vec::new(), put: ledger.records() };
                    let _ = journal.append(&[(1, delta)]);
                    out.extend(std::fs::read(cp.path()));
                    out.extend(std::fs::read(cp.journal_path()));
                }
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    out
}
