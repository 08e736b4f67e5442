//! The baleen node agent (a DaemonSet): discovers the node's GPUs, keeps one device ledger behind
//! every resource view, serves the views to the kubelet through the device-plugin API, and keeps
//! the ledger through restarts (checkpoint, reconciliation with pod-resources) and GPU faults.
//!
//! Modules, from the process inwards:
//! - [`cli`]: the command line (`baleen-agent`, `baleen-agent inventory`) and exit codes;
//! - [`bootstrap`]: the run mode's process: configuration, logging, runtime, signals;
//! - [`config`] and [`defaults`]: settings from defaults, file, environment and flags;
//! - [`run`]: the running agent, how each subsystem is started and stopped (one task each);
//! - [`resources`]: the device-plugin adapter (views as resources, Allocate answers);
//! - [`dra`]: the DRA mode's adapter (`driver: dra`: slices' device names, claims booked in
//!   the ledger, what a prepared claim's containers get);
//! - [`metrics`] and [`instruments`]: the Prometheus endpoint (`/metrics`, `/healthz`,
//!   `/readyz`) and the agent's own measurements;
//! - [`isolation`]: what a container needs for its share to be enforced (MPS client setup), and
//!   the co-location classes (cgroups, MPS client priority);
//! - [`ledger`]: the device ledger (device IDs, views, grants), pure bookkeeping;
//! - [`checkpoint`] and [`reconcile`]: persistence and reconciliation with the kubelet;
//! - [`error_chain`]: an error and its causes on one line, for logs and gRPC messages;
//! - [`files`]: bounded reads of state and configuration files (no FIFO, device or huge file);
//! - [`inventory`]: the node's GPUs from NVML or a simulated topology;
//! - [`quantity`]: sizes like `1GiB` in configuration and topology files;
//! - [`kube_api`]: the Kubernetes API (the node-state annotation, the node's pods);
//!   [`kube_access`]: every call the agent makes (the install's RBAC).
//!
//! Placement decisions live in `baleen-scheduler-core`.

pub mod bootstrap;
pub mod checkpoint;
pub mod cli;
pub mod config;
pub mod defaults;
pub mod dra;
pub mod error_chain;
pub use baleen_edge::files;
pub mod instruments;
pub mod inventory;
pub mod isolation;
pub mod kube_access;
pub mod kube_api;
pub mod ledger;
pub mod metrics;
pub mod quantity;
pub mod reconcile;
pub mod resources;
pub mod retry;
pub mod run;
pub(crate) mod yaml;
