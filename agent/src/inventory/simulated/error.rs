//! The simulated backend's own errors: what can be wrong with a topology file and how it prints
//! ([`TopologyError`]: unreadable, not YAML of the expected shape, or invalid with every
//! [`TopologyProblem`] listed with its line), and [`UnknownGpu`] for an injected event about a GPU
//! the node lacks. The loader (`validate`) and the constructors of [`SimulatedInventory`] build
//! them; the shared [`InventoryError::Topology`] wraps a `TopologyError`, and the CLI maps that
//! variant to exit code 64.
//!
//! [`SimulatedInventory`]: super::SimulatedInventory
//! [`InventoryError::Topology`]: crate::inventory::InventoryError::Topology

use std::fmt;
use std::path::{Path, PathBuf};

use crate::inventory::GpuUuid;

/// A topology file that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum TopologyError {
    /// The file could not be read.
    #[error("cannot read topology file {}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The file is not YAML of the expected shape (unknown field, wrong type, bad quantity...).
    /// YAML parsing stops at the first such error.
    #[error("{}:{}: {message}", path.display(), location(*line, *column))]
    Parse {
        /// The file.
        path: PathBuf,
        /// The line (1-based), when the parser knows it.
        line: Option<usize>,
        /// The column (1-based), when the parser knows it.
        column: Option<usize>,
        /// What is wrong.
        message: String,
    },
    /// The file parses but describes an impossible node; every problem found is listed.
    #[error("{}: invalid topology ({} problem{}):{}", path.display(), problems.len(),
        if problems.len() == 1 { "" } else { "s" }, list_problems(path, problems))]
    Invalid {
        /// The file.
        path: PathBuf,
        /// Every problem, ordered by line.
        problems: Vec<TopologyProblem>,
    },
}

fn location(line: Option<usize>, column: Option<usize>) -> String {
    match (line, column) {
        (Some(line), Some(column)) => format!("{line}:{column}"),
        (Some(line), None) => line.to_string(),
        _ => "?".to_owned(),
    }
}

fn list_problems(path: &Path, problems: &[TopologyProblem]) -> String {
    problems
        .iter()
        .map(|problem| match problem.line {
            Some(line) => format!("\n  {}:{line}: {}", path.display(), problem.message),
            None => format!("\n  {}: {}", path.display(), problem.message),
        })
        .collect()
}

/// One problem in a topology file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TopologyProblem {
    /// The line (1-based) of the YAML node the problem is about, when it can be located.
    pub line: Option<usize>,
    /// What is wrong.
    pub message: String,
}

impl fmt::Display for TopologyProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.line {
            Some(line) => write!(f, "line {line}: {}", self.message),
            None => f.write_str(&self.message),
        }
    }
}

/// [`SimulatedInventory::inject_xid`](super::SimulatedInventory::inject_xid) was asked for a GPU
/// the simulated node does not have.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("no GPU {0} on this simulated node")]
pub struct UnknownGpu(pub GpuUuid);
