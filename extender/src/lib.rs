//! The kube-scheduler extender: HTTP `filter` and `prioritize` over `baleen-scheduler-core`,
//! reading each node's GPUs from the gpu-state annotation its agent publishes
//! (docs/gpu-state.md).
//!
//! - [`protocol`]: the extender protocol's JSON (kube-scheduler's Go field names);
//! - [`demand`]: what a pod asks of baleen resources, CPU and memory;
//! - [`claims`]: what pods ask through DRA claims of baleen's DeviceClasses;
//! - [`place`]: which nodes fit (the filter) and how well (the policy's score);
//! - [`cluster`]: the nodes and pods the watchers (or kube-scheduler) report;
//! - [`service`]: the verbs over the cluster view, and the online target workload;
//! - [`http`]: the HTTP endpoint and its metrics;
//! - [`watch`]: the Node and Pod watchers (kube-rs) that feed the cluster view;
//! - [`run`]: all of it started together, and the command line (the binary's `main`);
//! - [`webhook`]: the mutating admission webhook that sends GPU pods to baleen's scheduler, over TLS;
//! - [`kube_access`]: every Kubernetes API call it makes (the install's RBAC).

pub mod claims;
pub mod cluster;
pub mod demand;
pub mod http;
pub mod kube_access;
pub mod place;
pub mod protocol;
pub mod run;
pub mod service;
pub mod watch;
pub mod webhook;
