//! `baleen-agent`'s integration tests, in one binary: the module layout read from the sources,
//! and the agent binary's start-up against hostile files at its state paths.

mod layout;
mod signals;
mod state_files;
