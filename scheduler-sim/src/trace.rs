//! Reading the Alibaba GPU-sharing trace (cluster-trace-gpu-v2023) into the crate's model.
//!
//! Node lists have the columns `sn,cpu_milli,memory_mib,gpu,model`; task lists
//! `name,cpu_milli,memory_mib,num_gpu,gpu_milli` and optionally `gpu_spec` (allowed models
//! separated by `|`, empty for any) and further columns, which are ignored. Every error names
//! the file, the line and the column. This is the only module of the crate that does I/O.

use baleen_scheduler_core::model::{GpuDemand, GpuModel, GpuSpec, NodeSpec, Request};
use baleen_scheduler_core::units::{MemMib, MilliCpu, MilliGpu};
use std::io::Read;
use std::path::{Path, PathBuf};
use thiserror::Error;

/// A problem with a trace file.
#[derive(Debug, Error)]
pub enum TraceError {
    /// The file could not be opened or read (the message is the path; the I/O error is the
    /// source, printed after it by the caller's error chain).
    #[error("{path}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// A column the format requires is absent from the header.
    #[error("{path}:1: missing column `{column}` (header has: {header})")]
    MissingColumn {
        /// The file.
        path: PathBuf,
        /// The missing column.
        column: &'static str,
        /// The header as found.
        header: String,
    },
    /// A row is not valid CSV or has too few fields.
    #[error("{path}:{line}: {reason}")]
    Row {
        /// The file.
        path: PathBuf,
        /// 1-based line number.
        line: u64,
        /// What is wrong.
        reason: String,
    },
    /// One field has a bad value.
    #[error("{path}:{line}: column `{column}`: {reason}: `{value}`")]
    Field {
        /// The file.
        path: PathBuf,
        /// 1-based line number.
        line: u64,
        /// The column name.
        column: &'static str,
        /// The value found.
        value: String,
        /// What is wrong.
        reason: String,
    },
    /// The file has a header but no rows.
    #[error("{path}: no rows")]
    Empty {
        /// The file.
        path: PathBuf,
    },
}

/// One task of a task list.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TraceTask {
    /// The task name.
    pub name: String,
    /// What it requests.
    pub request: Request,
}

struct Table<R> {
    path: PathBuf,
    reader: csv::Reader<R>,
    columns: Vec<Option<usize>>,
}

impl<R: Read> Table<R> {
    fn open(
        input: R,
        path: &Path,
        required: &[&'static str],
        optional: &[&'static str],
    ) -> Result<Self, TraceError> {
        let mut reader =
            csv::ReaderBuilder::new().has_headers(true).flexible(true).from_reader(input);
        let header = reader
            .headers()
            .map_err(|e| TraceError::Row { path: path.into(), line: 1, reason: e.to_string() })?
            .clone();
        let find = |name: &str| header.iter().position(|h| h.trim() == name);
        let mut columns = Vec::new();
        for &name in required {
            let Some(i) = find(name) else {
                return Err(TraceError::MissingColumn {
                    path: path.into(),
                    column: name,
                    header: header.iter().collect::<Vec<_>>().join(","),
                });
            };
            columns.push(Some(i));
        }
        columns.extend(optional.iter().map(|name| find(name)));
        Ok(Self { path: path.into(), reader, columns })
    }

    /// Calls `row` for each record with a field accessor.
    fn rows(
        mut self,
        names: &[&'static str],
        mut row: impl FnMut(&Fields<'_, R>) -> Result<(), TraceError>,
    ) -> Result<(), TraceError> {
        let mut record = csv::StringRecord::new();
        let mut any = false;
        loop {
            let more = self.reader.read_record(&mut record).map_err(|e| TraceError::Row {
                path: self.path.clone(),
                line: e.position().map_or(0, |p| p.line()),
                reason: e.to_string(),
            })?;
            if !more {
                break;
            }
            any = true;
            let line = record.position().map_or(0, |p| p.line());
            row(&Fields { table: &self, names, record: &record, line })?;
        }
        if any { Ok(()) } else { Err(TraceError::Empty { path: self.path }) }
    }
}

struct Fields<'a, R> {
    table: &'a Table<R>,
    names: &'a [&'static str],
    record: &'a csv::StringRecord,
    line: u64,
}

impl<R> Fields<'_, R> {
    /// The field of column number `k` (in the order given to `Table::open`), if present.
    fn get(&self, k: usize) -> Result<Option<&str>, TraceError> {
        let Some(i) = self.table.columns[k] else { return Ok(None) };
        match self.record.get(i) {
            Some(v) => Ok(Some(v.trim())),
            None => Err(TraceError::Row {
                path: self.table.path.clone(),
                line: self.line,
                reason: format!(
                    "{} fields, column `{}` is field {}",
                    self.record.len(),
                    self.names[k],
                    i + 1
                ),
            }),
        }
    }

    fn text(&self, k: usize) -> Result<String, TraceError> {
        Ok(self.get(k)?.unwrap_or_default().to_owned())
    }

    fn error(&self, k: usize, value: &str, reason: impl Into<String>) -> TraceError {
        TraceError::Field {
            path: self.table.path.clone(),
            line: self.line,
            column: self.names[k],
            value: value.to_owned(),
            reason: reason.into(),
        }
    }

    fn number(&self, k: usize) -> Result<u64, TraceError> {
        let v = self.get(k)?.unwrap_or_default();
        v.parse::<u64>().map_err(|e| self.error(k, v, format!("not a non-negative integer ({e})")))
    }
}

const NODE_COLUMNS: [&str; 5] = ["sn", "cpu_milli", "memory_mib", "gpu", "model"];

fn open(path: &Path) -> Result<std::fs::File, TraceError> {
    std::fs::File::open(path).map_err(|source| TraceError::Io { path: path.into(), source })
}

/// Reads a node list file. Nodes without GPUs are kept (with no GPUs).
pub fn read_nodes(path: &Path) -> Result<Vec<NodeSpec>, TraceError> {
    parse_nodes(open(path)?, path)
}

/// Parses a node list; `path` names it in errors.
pub fn parse_nodes(input: impl Read, path: &Path) -> Result<Vec<NodeSpec>, TraceError> {
    let table = Table::open(input, path, &NODE_COLUMNS, &[])?;
    let mut nodes = Vec::new();
    table.rows(&NODE_COLUMNS, |f| {
        let name = f.text(0)?;
        if name.is_empty() {
            return Err(f.error(0, "", "empty node name"));
        }
        let gpu_count = f.number(3)?;
        if gpu_count > baleen_scheduler_core::model::MAX_GPUS_PER_NODE as u64 {
            return Err(f.error(3, &gpu_count.to_string(), "more GPUs than a node may have (64)"));
        }
        let model = f.text(4)?;
        if gpu_count > 0 && (model.is_empty() || model == "nan") {
            return Err(f.error(4, &model, "a node with GPUs needs a GPU model"));
        }
        let model = GpuModel::new(&model);
        let gpus = (0..gpu_count)
            .map(|i| GpuSpec::plain(format!("{name}/gpu{i}"), model.clone()))
            .collect();
        nodes.push(NodeSpec {
            name,
            cpu: MilliCpu(f.number(1)?),
            memory: MemMib(f.number(2)?),
            gpus,
        });
        Ok(())
    })?;
    Ok(nodes)
}

const TASK_COLUMNS: [&str; 6] =
    ["name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli", "gpu_spec"];

/// Reads a task list file.
pub fn read_tasks(path: &Path) -> Result<Vec<TraceTask>, TraceError> {
    parse_tasks(open(path)?, path)
}

/// Parses a task list; `path` names it in errors.
pub fn parse_tasks(input: impl Read, path: &Path) -> Result<Vec<TraceTask>, TraceError> {
    let table = Table::open(input, path, &TASK_COLUMNS[..5], &TASK_COLUMNS[5..])?;
    let mut tasks = Vec::new();
    table.rows(&TASK_COLUMNS, |f| {
        let num_gpu = f.number(3)?;
        let milli = f.number(4)?;
        let gpu = match (num_gpu, milli) {
            (0, 0) => GpuDemand::None,
            (0, m) => {
                return Err(f.error(
                    4,
                    &m.to_string(),
                    "a task with num_gpu 0 must have gpu_milli 0",
                ));
            }
            (_, 0) => return Err(f.error(4, "0", "a GPU task needs a share above 0")),
            (n, 1000) => GpuDemand::Whole {
                count: u32::try_from(n).map_err(|_| f.error(3, &n.to_string(), "too many GPUs"))?,
            },
            (1, m) if m < 1000 => {
                // m < 1000 here.
                GpuDemand::Shared {
                    milli: MilliGpu(u32::try_from(m).unwrap_or(999)),
                    memory: Default::default(),
                }
            }
            (_, m) if m < 1000 => {
                return Err(f.error(4, &m.to_string(), "a GPU share below 1000 needs num_gpu 1"));
            }
            (_, m) => return Err(f.error(4, &m.to_string(), "a share of one GPU is at most 1000")),
        };
        let spec = f.get(5)?.unwrap_or_default();
        let allowed_models = if spec.is_empty() || spec == "nan" {
            Vec::new()
        } else {
            spec.split('|').map(|m| GpuModel::new(m.trim())).collect()
        };
        let request = Request {
            cpu: MilliCpu(f.number(1)?),
            memory: MemMib(f.number(2)?),
            gpu,
            allowed_models,
        };
        tasks.push(TraceTask { name: f.text(0)?, request });
        Ok(())
    })?;
    Ok(tasks)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn tasks(text: &str) -> Result<Vec<TraceTask>, TraceError> {
        parse_tasks(text.as_bytes(), Path::new("pods.csv"))
    }

    #[test]
    fn task_kinds_and_models() {
        let t = tasks(
            "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec\n\
             a,1000,10,0,0,\n\
             b,2000,20,1,450,nan\n\
             c,3000,30,4,1000,V100M16|V100M32\n",
        )
        .expect("valid");
        assert_eq!(t[0].request.gpu, GpuDemand::None);
        assert_eq!(t[1].request.gpu.milli_per_gpu(), MilliGpu(450));
        assert!(t[1].request.allowed_models.is_empty());
        assert_eq!(t[2].request.gpu, GpuDemand::Whole { count: 4 });
        assert_eq!(
            t[2].request.allowed_models,
            vec![GpuModel::new("V100M16"), GpuModel::new("V100M32")]
        );
        assert_eq!(t[2].request.cpu, MilliCpu(3000));
    }

    #[test]
    fn gpu_spec_column_is_optional() {
        let t =
            tasks("name,cpu_milli,memory_mib,num_gpu,gpu_milli\na,1000,10,1,300\n").expect("valid");
        assert!(t[0].request.allowed_models.is_empty());
    }

    #[test]
    fn node_without_model_is_refused() {
        let err = parse_nodes(
            "sn,cpu_milli,memory_mib,gpu,model\nn,1,1,2,\n".as_bytes(),
            Path::new("nodes.csv"),
        )
        .expect_err("no model");
        assert_eq!(
            err.to_string(),
            "nodes.csv:2: column `model`: a node with GPUs needs a GPU model: ``"
        );
    }

    proptest! {
        /// Any input gives tasks or an error naming the file, never a panic.
        #[test]
        fn arbitrary_input_never_panics(text in "(?s).{0,400}") {
            let header = "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec\n";
            for input in [text.clone(), format!("{header}{text}")] {
                if let Err(e) = tasks(&input) {
                    prop_assert!(e.to_string().starts_with("pods.csv"), "{}", e);
                }
                if let Err(e) = parse_nodes(input.as_bytes(), Path::new("nodes.csv")) {
                    prop_assert!(e.to_string().starts_with("nodes.csv"), "{}", e);
                }
            }
        }
    }
}
