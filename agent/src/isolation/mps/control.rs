//! Talking to one GPU's MPS control daemon: start it, probe it, tell it to quit, behind the small
//! [`MpsControl`] trait so that the supervisor runs against a fake in tests. [`CommandControl`]
//! runs the control binary as the real one is run (`nvidia-cuda-mps-control -d` with
//! `CUDA_VISIBLE_DEVICES`, `CUDA_MPS_PIPE_DIRECTORY`, `CUDA_MPS_LOG_DIRECTORY`; commands on its
//! stdin), and reads its answers as the GPU day recorded them (tests/data/gpu-day-2026-11-30-mps).

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use tokio::io::AsyncWriteExt as _;
use tokio::process::Command;

use super::MpsDirs;

/// What the daemon said when a second `-d` found it already serving the pipe directory.
const ALREADY_RUNNING: &str = "An instance of this daemon is already running";

/// Why a control command failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MpsError {
    /// The control binary cannot be run (absent, not executable).
    #[error("cannot run the MPS control binary {binary}: {reason}")]
    Binary {
        /// The binary.
        binary: String,
        /// Why.
        reason: String,
    },
    /// No daemon answers on the pipe directory.
    #[error("no MPS control daemon answers on {pipe}: {answer}")]
    NotRunning {
        /// The pipe directory.
        pipe: String,
        /// What the control binary printed.
        answer: String,
    },
    /// The command did not finish within its timeout (a hung daemon).
    #[error("the MPS control daemon on {pipe} did not answer within {timeout:?}")]
    Hung {
        /// The pipe directory.
        pipe: String,
        /// The timeout.
        timeout: Duration,
    },
    /// A daemon holds the pipe directory (a second `-d` says it is running) but does not answer.
    #[error(
        "the MPS control daemon on {pipe} is running but did not answer within {timeout:?}; it is not killed, since its server may serve running clients: restart it by hand if it stays hung"
    )]
    HungAdopted {
        /// The pipe directory.
        pipe: String,
        /// The probe timeout.
        timeout: Duration,
    },
    /// `-d` failed.
    #[error("the MPS control daemon for {pipe} did not start (exit {code:?}): {output}")]
    StartFailed {
        /// The pipe directory.
        pipe: String,
        /// The exit code.
        code: Option<i32>,
        /// What it printed.
        output: String,
    },
    /// The directories cannot be created.
    #[error("cannot create {path}: {reason}")]
    Dirs {
        /// The directory.
        path: String,
        /// Why.
        reason: String,
    },
}

/// How a start went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Started {
    /// A new daemon.
    New,
    /// One already served the pipe directory; it is adopted.
    AlreadyRunning,
}

/// The PIDs of a control answer, one a line (as `get_server_list` printed them on the GPU day).
fn pids(answer: &str) -> Vec<u32> {
    answer.lines().filter_map(|l| l.trim().parse().ok()).collect()
}

/// Start, probe and stop one GPU's control daemon.
#[async_trait::async_trait]
pub trait MpsControl: Send + Sync {
    /// Starts the control daemon of the GPU `gpu_uuid` on `dirs` (creating them).
    async fn start(&self, gpu_uuid: &str, dirs: &MpsDirs) -> Result<Started, MpsError>;
    /// Asks the daemon on `dirs` for its server list within `timeout`; the servers' PIDs.
    async fn probe(&self, dirs: &MpsDirs, timeout: Duration) -> Result<Vec<u32>, MpsError>;
    /// The client PIDs of the server `server` of the daemon on `dirs`.
    async fn clients(
        &self,
        dirs: &MpsDirs,
        server: u32,
        timeout: Duration,
    ) -> Result<Vec<u32>, MpsError>;
    /// Tells the daemon on `dirs` to quit (its server shuts down after its clients).
    async fn quit(&self, dirs: &MpsDirs, timeout: Duration) -> Result<(), MpsError>;
}

/// The real control binary.
#[derive(Debug, Clone)]
pub struct CommandControl {
    binary: PathBuf,
}

impl CommandControl {
    /// Runs `binary` (a path, or a name looked up on `PATH`).
    pub fn new(binary: PathBuf) -> Self {
        Self { binary }
    }

    fn command(&self, dirs: &MpsDirs) -> Command {
        let mut command = Command::new(&self.binary);
        command
            .env("CUDA_MPS_PIPE_DIRECTORY", &dirs.pipe)
            .env("CUDA_MPS_LOG_DIRECTORY", &dirs.log)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        command
    }

    fn binary_error(&self, e: &std::io::Error) -> MpsError {
        MpsError::Binary { binary: self.binary.display().to_string(), reason: e.to_string() }
    }

    /// Sends one command on stdin; its output, or why not.
    async fn send(
        &self,
        dirs: &MpsDirs,
        line: &str,
        timeout: Duration,
    ) -> Result<String, MpsError> {
        let pipe = dirs.pipe.display().to_string();
        let mut child = self.command(dirs).spawn().map_err(|e| self.binary_error(&e))?;
        if let Some(mut stdin) = child.stdin.take() {
            // A daemon that is gone makes the client exit early; a failed write shows below.
            let _ = stdin.write_all(format!("{line}\n").as_bytes()).await;
        }
        let output = tokio::time::timeout(timeout, child.wait_with_output())
            .await
            .map_err(|_| MpsError::Hung { pipe: pipe.clone(), timeout })?
            .map_err(|e| self.binary_error(&e))?;
        let text = String::from_utf8_lossy(&output.stdout).trim().to_owned();
        if output.status.success() {
            Ok(text)
        } else {
            let err = String::from_utf8_lossy(&output.stderr).trim().to_owned();
            Err(MpsError::NotRunning { pipe, answer: [text, err].join(" ").trim().to_owned() })
        }
    }
}

#[async_trait::async_trait]
impl MpsControl for CommandControl {
    async fn start(&self, gpu_uuid: &str, dirs: &MpsDirs) -> Result<Started, MpsError> {
        for dir in [&dirs.pipe, &dirs.log] {
            std::fs::create_dir_all(dir).map_err(|e| MpsError::Dirs {
                path: dir.display().to_string(),
                reason: e.to_string(),
            })?;
        }
        let mut command = self.command(dirs);
        command.arg("-d").env("CUDA_VISIBLE_DEVICES", gpu_uuid).stdin(Stdio::null());
        let output = tokio::time::timeout(Duration::from_secs(20), command.output())
            .await
            .map_err(|_| MpsError::Hung {
                pipe: dirs.pipe.display().to_string(),
                timeout: Duration::from_secs(20),
            })?
            .map_err(|e| self.binary_error(&e))?;
        let printed = [&output.stdout[..], &output.stderr[..]]
            .map(|b| String::from_utf8_lossy(b).trim().to_owned())
            .join(" ")
            .trim()
            .to_owned();
        if output.status.success() {
            Ok(Started::New)
        } else if printed.contains(ALREADY_RUNNING) {
            Ok(Started::AlreadyRunning)
        } else {
            Err(MpsError::StartFailed {
                pipe: dirs.pipe.display().to_string(),
                code: output.status.code(),
                output: printed,
            })
        }
    }

    async fn probe(&self, dirs: &MpsDirs, timeout: Duration) -> Result<Vec<u32>, MpsError> {
        Ok(pids(&self.send(dirs, "get_server_list", timeout).await?))
    }

    async fn clients(
        &self,
        dirs: &MpsDirs,
        server: u32,
        timeout: Duration,
    ) -> Result<Vec<u32>, MpsError> {
        Ok(pids(&self.send(dirs, &format!("get_client_list {server}"), timeout).await?))
    }

    async fn quit(&self, dirs: &MpsDirs, timeout: Duration) -> Result<(), MpsError> {
        self.send(dirs, "quit", timeout).await.map(drop)
    }
}
