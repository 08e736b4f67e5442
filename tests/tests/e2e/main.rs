//! baleen's integration tests, in one binary: every test here links the whole agent, the
//! extender, kube, tonic and axum, and one link of them instead of ten is what keeps a clean
//! 2-core CI build inside its time and disk. One module per subject; `support` holds what they
//! share (`TestNode`, `poll`). Run one subject with its path as the filter, e.g.
//! `cargo test -p baleen-tests --test e2e -- agent::recovery::`.

mod support;

mod agent;
mod agreement;
mod cluster_loop;
mod device_plugin;
mod extender;
mod fake_apiserver_resource;
mod fuzz_seeds;
mod gpu_day;
mod install;
mod nvml_inventory;
mod prometheus;
mod tenant;
mod webhook_memory;
