//! How the agent writes an error on one line: its message, then each cause after `: `
//! (`baleen_k8s::error_chain`, shared with the DRA driver's crate), tested here over the
//! agent's own errors.

pub use baleen_k8s::error_chain::Chain;

#[cfg(test)]
mod tests {
    use std::error::Error;
    use std::fmt;

    use super::*;

    #[test]
    fn every_cause_once() {
        let io = std::io::Error::other("disk full");
        let err = crate::checkpoint::CheckpointError::Io { path: "/x/cp.json".into(), source: io };
        assert_eq!(Chain(&err).to_string(), "cannot use checkpoint /x/cp.json: disk full");
    }

    /// An error whose message already ends with its cause's (as tonic's transport error says
    /// "transport error: No such file or directory (os error 2)" over that very io::Error).
    #[derive(Debug)]
    struct Repeats(std::io::Error);

    impl fmt::Display for Repeats {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            write!(f, "transport error: {}", self.0)
        }
    }

    impl Error for Repeats {
        fn source(&self) -> Option<&(dyn Error + 'static)> {
            Some(&self.0)
        }
    }

    #[test]
    fn a_cause_the_message_already_says_is_not_repeated() {
        let err = Repeats(std::io::Error::from(std::io::ErrorKind::NotFound));
        let text = Chain(&err).to_string();
        assert_eq!(text.matches("not found").count(), 1, "{text}");
    }
}
