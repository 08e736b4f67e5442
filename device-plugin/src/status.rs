//! The one mapping from backend errors to gRPC status codes. Every message names the resource
//! and the device IDs, so a `kubectl describe pod` event says what went wrong where.

use tonic::{Code, Status};

use crate::backend::BackendError;

/// The gRPC code for a backend error.
pub fn code(error: &BackendError) -> Code {
    match error {
        BackendError::UnknownDevices { .. } | BackendError::InvalidRequest { .. } => {
            Code::InvalidArgument
        }
        BackendError::Conflict { .. } => Code::FailedPrecondition,
        BackendError::Exhausted { .. } => Code::ResourceExhausted,
        BackendError::Unavailable { .. } => Code::Unavailable,
        BackendError::Internal { .. } => Code::Internal,
    }
}

/// The status the kubelet receives for a failed `operation` on `resource`.
pub fn to_status(resource: &str, operation: &str, error: &BackendError) -> Status {
    Status::new(code(error), format!("{resource}: {operation}: {error}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_and_messages() {
        let cases = [
            (BackendError::UnknownDevices { ids: vec!["x".into()] }, Code::InvalidArgument),
            (
                BackendError::InvalidRequest { ids: vec![], reason: "r".into() },
                Code::InvalidArgument,
            ),
            (
                BackendError::Conflict { ids: vec!["g".into()], reason: "taken".into() },
                Code::FailedPrecondition,
            ),
            (BackendError::Exhausted { reason: "r".into() }, Code::ResourceExhausted),
            (BackendError::Unavailable { reason: "r".into() }, Code::Unavailable),
            (BackendError::Internal { reason: "r".into() }, Code::Internal),
        ];
        for (error, expected) in cases {
            let status = to_status("example.com/gpu", "Allocate", &error);
            assert_eq!(status.code(), expected, "{error}");
            assert!(status.message().starts_with("example.com/gpu: Allocate: "), "{status:?}");
        }
        let status = to_status(
            "example.com/gpu",
            "Allocate",
            &BackendError::UnknownDevices { ids: vec!["GPU-1".into(), "bad id".into()] },
        );
        assert!(status.message().contains("\"GPU-1\", \"bad id\""), "{}", status.message());
    }
}
