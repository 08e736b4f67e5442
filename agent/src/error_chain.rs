//! How the agent writes an error on one line: its message, then each cause after `: `. Errors
//! carry their cause as `#[source]` and never repeat it in their own message, so logs and gRPC
//! messages use this to show the whole story once.

use std::error::Error;
use std::fmt;

/// Displays an error and its causes, separated by `: `.
pub struct Chain<'a>(pub &'a (dyn Error + 'static));

impl fmt::Display for Chain<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)?;
        let mut source = self.0.source();
        while let Some(cause) = source {
            write!(f, ": {cause}")?;
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
}
