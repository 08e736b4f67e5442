//! baleen's placement brain: pure, synchronous, and shared by the node agent (which GPU) and
//! the kube-scheduler extender (which node).
//!
//! - [`units`] and [`model`]: nodes, GPUs and requests in their own types;
//! - [`ledger`]: one node's allocations, never over-committed, and what fits it;
//! - [`fit`]: in-node GPU candidates (reading the ledger's fits);
//! - [`capacity`]: what a node can still give per GPU, NVLink group and MIG profile, and
//!   whether a pod's asks fit it (the extender's filter verdict);
//! - [`node_choice`]: the node agent's in-node choice (tightest shared GPU, best-connected set);
//! - [`frag`]: the FGD fragmentation measure and its target workload;
//! - [`packing`]: prices of GPU shares from the bin-packing LP of the target workload;
//! - [`policy`]: score a node for a request and choose its GPUs;
//! - [`cluster`]: choose a node across a cluster with a fixed tie-break order.
//!
//! It knows nothing of Kubernetes or JSON: quantities, pod requests and the node-state document
//! are `baleen-k8s`'s.
//!
//! The trace reader and the paper's replay protocol (`baleen-sim`) live in `baleen-scheduler-sim`.
//!
//! # Example
//!
//! Score a node for a request and record the placement:
//!
//! ```
//! use baleen_scheduler_core::ledger::{AllocationId, NodeLedger};
//! use baleen_scheduler_core::model::{GpuDemand, GpuModel, GpuSpec, NodeSpec, Request};
//! use baleen_scheduler_core::policy::{Normalisers, Policy, PolicyKind};
//! use baleen_scheduler_core::units::{MemMib, MemUnits, MilliCpu, MilliGpu};
//! use rand::SeedableRng;
//!
//! let model = GpuModel::new("H200");
//! let mut node = NodeLedger::new(NodeSpec {
//!     name: "node-a".into(),
//!     cpu: MilliCpu(64_000),
//!     memory: MemMib(512 * 1024),
//!     gpus: (0..2).map(|i| GpuSpec::plain(format!("GPU-{i}"), model.clone())).collect(),
//! })?;
//! let request = Request {
//!     cpu: MilliCpu(4_000),
//!     memory: MemMib(16 * 1024),
//!     gpu: GpuDemand::Shared { milli: MilliGpu(250), memory: MemUnits(0) },
//!     allowed_models: vec![],
//! };
//! // The default policy (baleen), its target workload learned from the requests seen so far:
//! let policy = Policy::for_requests(PolicyKind::default(), [&request], 0.95, Normalisers::default());
//! let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);
//! let scored = policy.score(&node, &request, &mut rng).expect("the request fits");
//! node.allocate(AllocationId(1), &request, scored.gpus)?;
//! assert_eq!(node.gpus()[0].milli, MilliGpu(750));
//! # Ok::<(), baleen_scheduler_core::ledger::LedgerError>(())
//! ```

pub mod capacity;
pub mod cluster;
pub mod fit;
pub mod frag;
pub mod ledger;
pub mod model;
pub mod node_choice;
pub mod packing;
pub mod policy;
pub mod units;
