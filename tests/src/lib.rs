//! End-to-end test support for baleen: fakes of what surrounds the agent on a node.
//!
//! - [`fake_kubelet`]: a kubelet that behaves like the real one towards device plugins
//!   (see `../shared/kubelet-behaviour.md`): Registration on `kubelet.sock`, dial-back,
//!   GetDevicePluginOptions, ListAndWatch kept open, GetPreferredAllocation then Allocate per
//!   container, and a restart that wipes the directory.
//! - [`cluster_loop`]: a trace list replayed through the extender, a fake API server and
//!   agent ledgers (the cluster in the loop);
//! - [`dra_allocator`]: a test allocator playing kube-scheduler's DRA allocator (first fit by
//!   each device's `requestPolicy`), and [`dra_loop`]: the cluster loop with every node a DRA
//!   driver;
//! - [`bench`](mod@bench): the in-process benchmarks' agent configuration;
//! - [`fuzz`]: the bodies and seeds of the fuzz targets (`fuzz/`);
//! - [`fake_apiserver`]: a Kubernetes API server on loopback for the agent's node annotation,
//!   which can go away and come back;
//! - [`fake_dra_kubelet`]: a kubelet's DRA side (slices wiped at its start, the plugin watcher
//!   registering with a gRPC C-core client, Prepare batched per pod, Unprepare retried, never a
//!   claim prepared twice);
//! - [`fake_cuda`]: a CUDA driver library for the agent's MPS client probe, without a GPU;
//! - [`http`]: a plain HTTP/1.1 client for the tests;
//! - [`memory_backend`]: an in-memory device-plugin backend for tests and benchmarks;
//! - [`real`](mod@real): the upstream control plane (etcd, kube-apiserver,
//!   kube-controller-manager, kube-scheduler built by `scripts/build-control-plane.sh`) on
//!   loopback, for the real-control-plane lane (`tests/tests/real/`) and its benchmark;
//! - [`tools`]: outside programs the tests use (promtool), or how to install them;
//! - the `fake-mps-control` binary: a fake `nvidia-cuda-mps-control`.
//!
//! The tests themselves are in `tests/tests/`. The placement replay check against the published
//! Alibaba results lives with the code it checks, in `scheduler-sim/tests/integration/replay_fidelity.rs`.

pub mod bench;
pub mod cluster_loop;
pub mod dra_allocator;
pub mod dra_loop;
pub mod fake_apiserver;
pub mod fake_cuda;
pub mod fake_dra_kubelet;
pub mod fake_kubelet;
pub mod fake_nvml;
pub mod fuzz;
pub mod http;
pub mod memory_backend;
pub mod real;
pub mod tools;
