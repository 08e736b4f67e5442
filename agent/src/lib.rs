//! The baleen node agent (a DaemonSet): GPU inventory, the node ledger and its resource views,
//! MPS and cgroup isolation, health, checkpoint and metrics.
//!
//! Not built yet (issue 5); placement decisions already live in `baleen-scheduler-core`.
