//! baleen's placement replay: the Alibaba GPU trace read into `baleen-scheduler-core`'s model
//! and the FGD paper's replay protocol, behind the `baleen-sim` tool, the idle-census example and
//! the decision benchmarks. Kept out of `scheduler-core` so that the agent and the extender do not
//! compile the trace reader, the command line or the plotting.
//!
//! - [`trace`]: the node and task lists (CSV), every error naming file, line and column;
//! - [`replay`]: the paper's protocol (target workload, inflation, submission, bucketed curves),
//!   one seed or many, in parallel.

pub mod replay;
pub mod trace;
