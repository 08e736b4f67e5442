//! baleen's placement brain: pure, synchronous, and shared by the node agent (which GPU) and
//! the kube-scheduler extender (which node).
//!
//! - [`units`] and [`model`]: nodes, GPUs and requests in their own types;
//! - [`ledger`]: one node's allocations, never over-committed;
//! - [`fit`]: feasibility and in-node GPU candidates;
//! - [`frag`]: the FGD fragmentation measure and its target workload;
//! - [`policy`]: score a node for a request and choose its GPUs;
//! - [`cluster`]: choose a node across a cluster with a fixed tie-break order;
//! - [`trace`] and [`replay`]: the Alibaba GPU trace and the paper's replay protocol, behind the
//!   `baleen-sim` tool.

pub mod cluster;
pub mod fit;
pub mod frag;
pub mod ledger;
pub mod model;
pub mod policy;
pub mod replay;
pub mod trace;
pub mod units;
