//! What a baleen daemon needs at its edges, written once for the agent, the DRA driver, the
//! device-plugin server and the extender: [`files`], files read whole and bounded, regular
//! files only; [`gate`], the one admission policy of every listener; [`http`] (feature `http`), the one HTTP accept loop over it; [`probe`], the exec
//! probe that reaches a daemon's loopback-only probe listener.

pub mod files;
pub mod gate;
#[cfg(feature = "http")]
pub mod http;
pub mod probe;
