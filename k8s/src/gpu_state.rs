//! The node-state document: what an agent publishes about its node's GPUs for cluster-wide
//! placement (as the Node annotation `<domain>/gpu-state`, docs/gpu-state.md), and what the
//! extender reads back. The agent writes it from its device ledger; the extender decides from it
//! which nodes can take a pod and how well.
//!
//! The format is a stable interface between two programs that are upgraded separately, so it is
//! versioned: [`VERSION`] changes when a field is removed or changes meaning; a new optional
//! field keeps the version (readers ignore fields they do not know). A reader refuses a document
//! of another version rather than guessing.

use serde::{Deserialize, Serialize};

/// The version of the format this crate reads and writes.
pub const VERSION: u32 = 1;

/// The resource domain both the agent and the extender use unless configured otherwise (the
/// agent's `crate::defaults::DOMAIN` is this one).
pub const DEFAULT_DOMAIN: &str = "awesome-ai-company.com";

/// The annotation's name in the domain: `<domain>/gpu-state`.
pub const ANNOTATION_NAME: &str = "gpu-state";

/// One node's GPUs, as its agent sees them.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeGpuState {
    /// The format's version ([`VERSION`]).
    pub version: u32,
    /// The Kubernetes node name.
    pub node: String,
    /// Changes whenever the agent's allocations change (it counts from 0 at each agent start, so
    /// it orders documents of one agent's run only).
    pub generation: u64,
    /// Bytes of one `gpu-memory` unit on this node.
    pub memory_unit_bytes: u64,
    /// The extended resources the node offers (full names, e.g.
    /// `awesome-ai-company.com/gpu-memory`).
    pub resources: Vec<String>,
    /// The GPUs, in index order.
    pub gpus: Vec<GpuEntry>,
    /// The NVLink groups (each a device of `<domain>/nvlink-group-<size>`).
    #[serde(default)]
    pub nvlink_groups: Vec<NvlinkGroupEntry>,
    /// Grants already counted in `gpus` whose pod the kubelet has not listed yet (it lists on
    /// the agent's next reconciliation): a reader matches them with the pods bound to the node
    /// that no GPU names, so that such a pod is not counted twice.
    #[serde(default)]
    pub unnamed: Vec<UnnamedGrant>,
    /// The UID of each pod `gpus[].pods` names (`namespace/name` to UID), where the agent knows
    /// it (from its watch of the node's pods): a reader matches the pods it sees bound by UID,
    /// so that a pod recreated with the same name is not taken for the one that held the grant.
    /// A pod without an entry here is matched by name, as before the field (a new optional
    /// field: the version stays, and documents without it are read as they were).
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub pod_uids: std::collections::BTreeMap<String, String>,
    /// The node is served as a DRA driver: its GPUs are in ResourceSlices, and the kubelet
    /// counts none of them as extended resources (a new optional field, omitted when false).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub dra: bool,
}

impl NodeGpuState {
    /// Whether the pod `key` (`namespace/name`) with UID `uid` is the one the document names:
    /// by UID where the document gives one for `key`, by name otherwise.
    pub fn names_pod(&self, key: &str, uid: &str) -> bool {
        match self.pod_uids.get(key) {
            Some(named) => named == uid,
            None => self.gpus.iter().any(|g| g.pods.iter().any(|p| p == key)),
        }
    }
}

/// One grant without its pod yet.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct UnnamedGrant {
    /// The resource, e.g. `awesome-ai-company.com/gpu-memory`.
    pub resource: String,
    /// How many of its devices (one container's).
    pub devices: u32,
}

/// How a GPU serves now.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum GpuMode {
    /// Nothing allocated on it.
    Idle,
    /// Memory units of it are held (shared through MPS).
    Shared,
    /// Held whole (`gpu` or an NVLink group).
    Exclusive,
    /// In MIG mode: only its instances are offered.
    Mig,
}

/// One GPU.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct GpuEntry {
    /// NVML's index.
    pub index: u32,
    /// The GPU's UUID.
    pub uuid: String,
    /// The product name, e.g. `NVIDIA H200`.
    pub model: String,
    /// Its memory.
    pub memory_bytes: u64,
    /// Its NUMA node, if the platform says.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub numa_node: Option<u32>,
    /// Indices of the GPUs it reaches over NVLink.
    #[serde(default)]
    pub nvlink_peers: Vec<u32>,
    /// How it serves now.
    pub mode: GpuMode,
    /// No critical fault: its devices can be allocated.
    pub healthy: bool,
    /// Its memory units are offered now (healthy, not held whole, and where MPS enforces
    /// shares, its daemon answers).
    pub shares_offered: bool,
    /// Memory units it has in all (0 in MIG mode or with gpu-memory off).
    pub units_total: u32,
    /// Memory units not held by anyone.
    pub units_free: u32,
    /// Free compute in thousandths of the GPU: `1000 * unitsFree / unitsTotal` (compute follows
    /// memory), 0 when held whole, in MIG mode or unhealthy, 1000 when idle without units.
    pub compute_free_milli: u32,
    /// Its MIG instances (MIG mode only).
    #[serde(default)]
    pub mig: Vec<MigEntry>,
    /// The pods holding grants on it, as `namespace/name` (as far as the kubelet has listed
    /// them: a grant not yet listed has no pod here).
    #[serde(default)]
    pub pods: Vec<String>,
}

/// One MIG instance.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MigEntry {
    /// Its profile, e.g. `1g.10gb` (the resource `<domain>/mig-<profile>`).
    pub profile: String,
    /// Its MIG UUID.
    pub uuid: String,
    /// Not held, and its GPU healthy.
    pub free: bool,
}

/// One NVLink group.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NvlinkGroupEntry {
    /// How many GPUs.
    pub size: u32,
    /// Its device ID, `nvlink<size>-<UUID of its first GPU>`.
    pub id: String,
    /// Its GPUs' indices.
    pub gpus: Vec<u32>,
    /// Allocatable now: not held, and none of its GPUs held through another view or unhealthy.
    pub free: bool,
}

/// Why a document cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    /// Not JSON of this shape.
    #[error("not a gpu-state document: {0}")]
    Malformed(#[from] serde_json::Error),
    /// Another version of the format.
    #[error("gpu-state version {found} (this reader knows version {VERSION})")]
    Version {
        /// The document's version.
        found: u32,
    },
    /// Inconsistent content.
    #[error("inconsistent gpu-state: {0}")]
    Inconsistent(String),
}

impl NodeGpuState {
    /// Reads a document, refusing another version and inconsistent content (free beyond total,
    /// indices out of order, groups naming GPUs that are not there).
    pub fn parse(text: &str) -> Result<Self, StateError> {
        #[derive(Deserialize)]
        struct Versioned {
            version: u32,
        }
        let v: Versioned = serde_json::from_str(text)?;
        if v.version != VERSION {
            return Err(StateError::Version { found: v.version });
        }
        let doc: Self = serde_json::from_str(text)?;
        doc.check()?;
        Ok(doc)
    }

    /// The document as JSON (one line).
    pub fn to_json(&self) -> String {
        // A struct of strings, numbers, booleans and vectors always serialises.
        serde_json::to_string(self).unwrap_or_default()
    }

    fn check(&self) -> Result<(), StateError> {
        let bad = |what: String| Err(StateError::Inconsistent(what));
        for (i, g) in self.gpus.iter().enumerate() {
            if usize::try_from(g.index).ok() != Some(i) {
                return bad(format!("GPU {} is listed at position {i}", g.index));
            }
            if g.units_free > g.units_total {
                return bad(format!(
                    "GPU {}: {} units free of {}",
                    g.index, g.units_free, g.units_total
                ));
            }
            if g.compute_free_milli > 1000 {
                return bad(format!(
                    "GPU {}: compute free {} > 1000",
                    g.index, g.compute_free_milli
                ));
            }
        }
        let n = self.gpus.len();
        for group in &self.nvlink_groups {
            if group.gpus.iter().any(|&g| usize::try_from(g).map_or(true, |g| g >= n))
                || usize::try_from(group.size).ok() != Some(group.gpus.len())
            {
                return bad(format!(
                    "NVLink group {} does not name {} GPUs of the node",
                    group.id, group.size
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn doc() -> NodeGpuState {
        NodeGpuState {
            version: VERSION,
            node: "n".into(),
            generation: 3,
            memory_unit_bytes: 1 << 30,
            resources: vec!["awesome-ai-company.com/gpu-memory".into()],
            gpus: vec![GpuEntry {
                index: 0,
                uuid: "GPU-0".into(),
                model: "NVIDIA L4".into(),
                memory_bytes: 23_034_920_960,
                numa_node: Some(0),
                nvlink_peers: vec![],
                mode: GpuMode::Shared,
                healthy: true,
                shares_offered: true,
                units_total: 21,
                units_free: 13,
                compute_free_milli: 619,
                mig: vec![],
                pods: vec!["ns/a".into()],
            }],
            nvlink_groups: vec![],
            unnamed: vec![],
            pod_uids: Default::default(),
            dra: false,
        }
    }

    #[test]
    fn a_document_reads_back_and_unknown_fields_are_ignored() {
        let d = doc();
        let text = d.to_json();
        assert!(
            text.contains("\"unitsFree\":13") && text.contains("\"mode\":\"shared\""),
            "{text}"
        );
        assert_eq!(NodeGpuState::parse(&text).expect("reads"), d);
        // A newer writer's extra field keeps the version.
        let newer = text.replacen('{', "{\"futureField\":[1,2],", 1);
        assert_eq!(NodeGpuState::parse(&newer).expect("reads"), d);
    }

    #[test]
    fn another_version_or_inconsistent_content_is_refused() {
        let text = doc().to_json().replace("\"version\":1", "\"version\":2");
        let err = NodeGpuState::parse(&text).expect_err("version 2");
        assert!(err.to_string().contains("version 2"), "{err}");
        let mut d = doc();
        d.gpus[0].units_free = 22;
        assert!(NodeGpuState::parse(&d.to_json()).is_err(), "free beyond total");
        let mut d = doc();
        d.nvlink_groups.push(NvlinkGroupEntry {
            size: 2,
            id: "nvlink2-GPU-0".into(),
            gpus: vec![0, 1],
            free: true,
        });
        assert!(NodeGpuState::parse(&d.to_json()).is_err(), "GPU 1 is not there");
        assert!(NodeGpuState::parse("{\"version\":1}").is_err(), "fields missing");
        assert!(NodeGpuState::parse("[]").is_err());
    }
}
