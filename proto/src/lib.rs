//! The kubelet gRPC APIs baleen speaks: device plugin `v1beta1` and pod resources `v1`.
//!
//! This crate will hold the project's own `.proto` files compiled with tonic/prost, checked
//! field by field against the upstream copies in `../shared/proto-upstream/` (issue 4). It has
//! no code yet; it exists so that the workspace has its final shape from the start.
