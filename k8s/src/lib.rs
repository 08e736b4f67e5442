//! What baleen's front ends both know of Kubernetes, written once: the node agent and the
//! kube-scheduler extender today, a DRA driver next. `baleen-scheduler-core` knows none of it
//! (no Kubernetes, no JSON): it places GPUs.
//!
//! - [`error_chain`]: an error and its causes on one line, each cause once;
//! - [`quantity`]: resource quantities (`2`, `500m`, `16Gi`, `1e3`) as the API server writes them;
//! - [`requests`]: what a pod requests of a node's CPU and memory, as kube-scheduler counts it
//!   (app containers and sidecars summed, against the largest init container, plus the pod's
//!   overhead);
//! - [`gpu_state`]: the node-state document the agent publishes and the extender reads;
//! - [`rbac`]: the rule each front end declares its API calls with (checked against the install);
//! - [`watch`]: one watch loop (backoff, the relist swap, outage logging) for every follower;
//! - `fixtures` (feature `test-util`): pods the front ends' tests share.

pub mod error_chain;
#[cfg(feature = "test-util")]
pub mod fixtures;
pub mod gpu_state;
pub mod quantity;
pub mod rbac;
pub mod requests;
pub mod watch;
