//! End-to-end tests of baleen: the whole agent against a fake kubelet, fake NVML, fake MPS and
//! cgroup trees.
//!
//! Not built yet (issues 4 and 5). The placement replay check against the published Alibaba
//! results lives with the code it checks, in `scheduler-core/tests/replay_fidelity.rs`.
