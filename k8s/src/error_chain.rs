//! How baleen writes an error on one line: its message, then each cause after `: `. Errors
//! carry their cause as `#[source]` and never repeat it in their own message, so logs, gRPC
//! messages and the DRA driver's answers to the kubelet use this to show the whole story once.
//! (The node agent's tests of it are in `baleen_agent::error_chain`, over its own errors.)

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
