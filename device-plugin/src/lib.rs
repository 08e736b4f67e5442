//! The kubelet device-plugin server: one socket per resource, registration and re-registration,
//! ListAndWatch streams, and the single mapping from domain errors to gRPC status codes.
//!
//! Not built yet (issue 4); the crate exists so the workspace has its final shape.
