//! The baleen node agent (a DaemonSet): GPU inventory, the node ledger and its resource views,
//! MPS and cgroup isolation, health, checkpoint and metrics.
//!
//! Built so far (issue 5, part 1):
//! - [`inventory`]: the node's GPUs behind the [`inventory::GpuInventory`] trait, from NVML or
//!   from a simulated YAML topology;
//! - [`cli`]: the `baleen-agent` command line (`baleen-agent inventory`), kept here so that the
//!   binary stays thin.
//!
//! Placement decisions live in `baleen-scheduler-core`.

pub mod agent;
pub mod checkpoint;
pub mod cli;
pub mod config;
pub mod inventory;
pub mod node;
pub mod quantity;
pub mod reconcile;
pub mod resources;
