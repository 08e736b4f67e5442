//! The crates' module layouts stay acyclic: no top-level module of `baleen-agent` or of
//! `baleen-scheduler-core` uses one that uses it back (test code aside, which may reach
//! anywhere). Read from the sources, so a new `use crate::...` that closes a cycle fails here
//! with both directions named.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("readable source dir").flatten() {
        let path = entry.path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The top-level module a source file belongs to (`src/ledger/view.rs` -> `ledger`).
fn module_of(src: &Path, file: &Path) -> Option<String> {
    let rel = file.strip_prefix(src).ok()?;
    let first = rel.components().next()?.as_os_str().to_str()?;
    let name = first.trim_end_matches(".rs");
    (name != "lib" && name != "main").then(|| name.to_owned())
}

/// The pairs of top-level modules of the crate at `src` that use each other.
fn two_way_uses(src: &Path) -> Vec<String> {
    let mut files = Vec::new();
    sources(src, &mut files);
    let mut uses: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for file in &files {
        let Some(module) = module_of(src, file) else { continue };
        if file.file_name().is_some_and(|n| n == "tests.rs") {
            continue;
        }
        let text = std::fs::read_to_string(file).expect("readable source");
        let shipped: String = text
            .split("#[cfg(test)]")
            .next()
            .unwrap_or(&text)
            .lines()
            .filter(|l| !l.trim_start().starts_with("//"))
            .collect::<Vec<_>>()
            .join("\n");
        for (i, _) in shipped.match_indices("crate::") {
            let rest = &shipped[i + "crate::".len()..];
            let target: String =
                rest.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
            if !target.is_empty() && target != module {
                uses.entry(module.clone()).or_default().insert(target);
            }
        }
    }
    assert!(uses.len() > 4, "the scan of {} found the modules: {uses:?}", src.display());
    let mut cycles = Vec::new();
    for (a, targets) in &uses {
        for b in targets {
            if a < b && uses.get(b).is_some_and(|t| t.contains(a)) {
                cycles.push(format!("{a} <-> {b}"));
            }
        }
    }
    if !cycles.is_empty() {
        cycles.push(format!("all uses: {uses:#?}"));
    }
    cycles
}

#[test]
fn no_module_of_the_agent_uses_one_that_uses_it_back() {
    let cycles = two_way_uses(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src"));
    assert!(cycles.is_empty(), "modules that use each other: {cycles:?}");
}

/// Issue 23, step 7: the fits are the ledger's (`NodeLedger::fits`), and the candidate search
/// (`fit`) reads the ledger, never the other way; no other pair of scheduler-core's modules
/// uses each other either.
#[test]
fn no_module_of_scheduler_core_uses_one_that_uses_it_back() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scheduler-core/src");
    let cycles = two_way_uses(&src);
    assert!(cycles.is_empty(), "modules that use each other: {cycles:?}");
}

/// Issue 23, item 1: `baleen-scheduler-core` depends on no Kubernetes or JSON code (quantities,
/// pod requests and the node-state document are `baleen-k8s`'s), and no crate but `baleen-k8s`
/// writes the rule of what a pod requests (the sidecar test, `restartPolicy: Always`).
#[test]
fn scheduler_core_knows_no_kubernetes_and_only_k8s_writes_pod_request_rules() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let manifest = std::fs::read_to_string(root.join("scheduler-core/Cargo.toml")).expect("read");
    for dependency in ["serde_json", "k8s-openapi", "kube", "baleen-k8s"] {
        assert!(
            !manifest.lines().any(|l| l.trim_start().starts_with(dependency)),
            "scheduler-core depends on {dependency}"
        );
    }
    let mut files = Vec::new();
    for dir in ["scheduler-core/src", "agent/src", "extender/src", "scheduler-sim/src"] {
        sources(&root.join(dir), &mut files);
    }
    assert!(files.len() > 20, "the scan found the sources");
    for file in files {
        let text = std::fs::read_to_string(&file).expect("readable source");
        let rel = file.strip_prefix(&root).unwrap_or(&file).display().to_string();
        if rel.starts_with("scheduler-core") {
            assert!(!text.contains("serde_json"), "{rel} uses JSON");
        }
        assert!(!text.contains("Some(\"Always\")"), "{rel} writes the sidecar rule itself");
    }
}
