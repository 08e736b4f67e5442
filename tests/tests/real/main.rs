//! The real-control-plane lane (issue 40): baleen against the upstream kube-apiserver, etcd,
//! kube-controller-manager and kube-scheduler, built from their Go modules by
//! `scripts/build-control-plane.sh` (one binary, `tests/harness`). Every test here is ignored
//! in the plain `cargo test`: `.ci/run` runs them with `--ignored` and `BALEEN_KUBE` set to
//! that binary; run alone, a test without it fails saying how to build it:
//!
//! ```text
//! BALEEN_KUBE=$(scripts/build-control-plane.sh) cargo test -p baleen-tests --test real -- --ignored
//! ```
//!
//! Everything listens on loopback, in directories of the test's own; a failing test prints the
//! last lines of every component's log.

mod agents;
mod allocation;
mod chart;
mod dra;
mod rights;
mod scheduling;
mod webhook;
