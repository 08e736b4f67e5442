//! How the agent writes an error on one line: its message, then each cause after `: `. Errors
//! carry their cause as `#[source]` and never repeat it in their own message, so logs and gRPC
//! messages use this to show the whole story once.

use std::error::Error;
use std::fmt;

/// Displays an error and its causes, separated by `: `.
pub struct Chain<'a>(pub &'a (dyn Error + 'static));

impl fmt::Display for Chain<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Some libraries' errors (tonic's transport error, hyper's) repeat their cause in their
        // own message: a cause already said is not said again.
        let mut said = self.0.to_string();
        f.write_str(&said)?;
        let mut source = self.0.source();
        while let Some(cause) = source {
            let text = cause.to_string();
            if !said.ends_with(&text) {
                write!(f, ": {text}")?;
                said.push_str(": ");
                said.push_str(&text);
            }
            source = cause.source();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
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
