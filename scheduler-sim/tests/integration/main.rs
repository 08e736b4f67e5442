//! `baleen-sim`'s integration tests, in one binary (one link of the simulator instead of three):
//! the command line as a user runs it, the FGD measure's check values, and the replay's
//! fidelity to the published results. `common` finds the shared trace folder.

mod common;

mod cli;
mod frag_check_values;
mod replay_fidelity;
