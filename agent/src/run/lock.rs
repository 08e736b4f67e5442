//! One agent per node: an exclusive lock on `<stateDir>/baleen-agent.lock`, taken before the
//! checkpoint is read or any socket is bound, and held for the agent's life (the kernel drops it
//! when the process dies, however it dies). A second agent (a DaemonSet rolling update with
//! surge, or a copy run by hand with the same state directory) waits for the first to exit,
//! logging once, and never touches its checkpoint or sockets. A copy with another state directory
//! is stopped by the sockets themselves: a socket a live process serves is never removed.

use std::fs::{File, OpenOptions, TryLockError};
use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio_util::sync::CancellationToken;

/// The lock file's name in the state directory.
pub const LOCK_FILE: &str = "baleen-agent.lock";
/// Time between tries while another agent holds the lock.
const RETRY: Duration = Duration::from_millis(500);

/// Why the lock could not be taken.
#[derive(Debug, thiserror::Error)]
pub enum LockError {
    /// The state directory cannot be created.
    #[error(
        "cannot create the state directory {} (paths.stateDir, --state-dir)",
        dir.display()
    )]
    StateDir {
        /// The state directory.
        dir: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The lock file cannot be created or locked.
    #[error("cannot lock {}", path.display())]
    Io {
        /// The lock file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
}

/// The held lock; dropping it releases it.
#[derive(Debug)]
pub struct InstanceLock {
    _file: File,
}

/// Takes the lock in `state_dir`, waiting while another agent holds it; `None` if `shutdown` is
/// cancelled first.
pub async fn acquire(
    state_dir: &Path,
    shutdown: &CancellationToken,
) -> Result<Option<InstanceLock>, LockError> {
    let path = state_dir.join(LOCK_FILE);
    let io = |source| LockError::Io { path: path.clone(), source };
    std::fs::create_dir_all(state_dir)
        .map_err(|source| LockError::StateDir { dir: state_dir.to_owned(), source })?;
    let file =
        OpenOptions::new().create(true).truncate(false).write(true).open(&path).map_err(io)?;
    let mut logged = false;
    loop {
        match file.try_lock() {
            Ok(()) => {
                if logged {
                    tracing::info!(lock = %path.display(), "the other agent has exited; starting");
                }
                return Ok(Some(InstanceLock { _file: file }));
            }
            Err(TryLockError::WouldBlock) => {
                if !logged {
                    tracing::warn!(
                        lock = %path.display(),
                        "another baleen-agent runs on this node (its lock is held); waiting for it to exit"
                    );
                    logged = true;
                }
            }
            Err(TryLockError::Error(source)) => return Err(io(source)),
        }
        if !crate::retry::sleep_or_stop(RETRY, shutdown).await {
            return Ok(None);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_second_holder_waits_until_the_first_lets_go() {
        let dir = tempfile::tempdir().expect("tempdir");
        let token = CancellationToken::new();
        let first = acquire(dir.path(), &token).await.expect("lock").expect("not cancelled");
        let waiting = acquire(dir.path(), &token);
        tokio::pin!(waiting);
        assert!(
            tokio::time::timeout(Duration::from_millis(300), &mut waiting).await.is_err(),
            "the second waits while the first holds the lock"
        );
        drop(first);
        let second = tokio::time::timeout(Duration::from_secs(5), waiting)
            .await
            .expect("taken once released")
            .expect("lock");
        assert!(second.is_some());
        // Cancelled while waiting: no lock, no error.
        let stop = CancellationToken::new();
        stop.cancel();
        assert!(acquire(dir.path(), &stop).await.expect("no error").is_none());
    }
}
