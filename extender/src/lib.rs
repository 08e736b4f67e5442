//! The kube-scheduler extender: HTTP filter and prioritize over `baleen-scheduler-core`.
//!
//! Not built yet; the crate exists so the workspace has its final shape.
