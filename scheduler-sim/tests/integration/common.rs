//! Helpers shared by the integration tests: where the shared trace data lives.

use std::path::PathBuf;

/// The Alibaba trace folder in `../shared/`, or a panic that says what is missing.
pub(crate) fn trace_dir() -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../shared/traces/alibaba-gpu-v2023")
        .canonicalize()
        .unwrap_or_else(|e| {
            panic!(
                "these tests read the Alibaba GPU trace from ../shared/traces/alibaba-gpu-v2023 \
                 beside the repository ({e}); check out `shared/` next to the repository"
            )
        });
    assert!(
        dir.join("openb_node_list_gpu_node.csv").is_file(),
        "{} lacks the node list",
        dir.display()
    );
    dir
}
