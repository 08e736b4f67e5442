//! The agent's DRA kubelet-plugin mode (issue 26, `driver: dra`): the protocol side, with no
//! knowledge of the agent's ledger (the agent's `dra` module implements [`service::Bookings`]).
//!
//! - [`h2_unary`]: a small HTTP/2 server for unary gRPC calls that reads `:path` and accepts
//!   any `:authority` (the kubelet's plugin watcher sends its socket path, which h2 refuses);
//! - [`registration`]: `pluginregistration.Registration` (`GetInfo`,
//!   `NotifyRegistrationStatus`) on `<registry>/<driver>-reg.sock`;
//! - [`service`]: the DRAPlugin service (v1 and v1beta1 on one tonic socket), the
//!   [`service::Preparer`] that reads, books and answers claims, and the resource-health stream;
//! - [`claims`]: what a ResourceClaim allocated of this driver's devices;
//! - [`slices`]: the node's devices as ResourceSlices;
//! - [`cdi`]: the CDI spec of each prepared claim.

pub mod cdi;
pub mod claims;
pub mod h2_unary;
pub mod registration;
pub mod service;
pub mod slices;
