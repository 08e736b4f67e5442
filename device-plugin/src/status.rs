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
    let message = format!("{resource}: {operation}: {error}");
    Status::new(code(error), crate::backend::cut(&message, MAX_STATUS).into_owned())
}

/// The most bytes of a status message (gRPC clients refuse large trailers; a kubelet shows the
/// message in the pod's events).
pub const MAX_STATUS: usize = 4096;

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 22, item 4: a 3 MiB device ID is not echoed whole.
    #[test]
    fn huge_device_ids_are_cut_in_every_message() {
        let huge = "x".repeat(3 << 20);
        let many: Vec<String> = (0..1000).map(|i| format!("id-{i}")).collect();
        for error in [
            BackendError::UnknownDevices { ids: vec![huge.clone()] },
            BackendError::InvalidRequest { ids: many.clone(), reason: huge.clone() },
            BackendError::Conflict { ids: vec![huge.clone(), huge.clone()], reason: "r".into() },
        ] {
            let text = error.to_string();
            assert!(text.len() < 4096, "{} bytes", text.len());
            let status = to_status("r", "Allocate", &error);
            assert!(status.message().len() <= MAX_STATUS + 64, "{}", status.message().len());
        }
        let text = BackendError::UnknownDevices { ids: vec![huge] }.to_string();
        assert!(text.contains(&format!("... ({} bytes)", 3 << 20)), "{}", &text[..200]);
        let text = BackendError::InvalidRequest { ids: many, reason: "r".into() }.to_string();
        assert!(text.contains("and 992 more"), "{text}");
        assert_eq!(crate::backend::cut("héllo", 2), "h... (6 bytes)", "on a char boundary");
    }

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
