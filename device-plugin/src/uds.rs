//! gRPC over Unix domain sockets: a tonic client channel that dials a socket path, and a
//! listener bound at a path (replacing a stale socket file) whose file is removed on drop.

use std::io;
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use hyper_util::rt::TokioIo;
use tokio::net::{UnixListener, UnixStream};
use tonic::transport::{Channel, Endpoint, Uri};

/// A client channel to the gRPC server on the Unix socket at `path`. Connects eagerly, so an
/// absent server is an error here rather than on the first call.
pub async fn connect(path: &Path, timeout: Duration) -> Result<Channel, tonic::transport::Error> {
    let path = path.to_path_buf();
    // The URI is required by tonic but never resolved: the connector dials the socket.
    Endpoint::from_static("http://localhost")
        .connect_timeout(timeout)
        .timeout(timeout)
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let path = path.clone();
            async move { Ok::<_, io::Error>(TokioIo::new(UnixStream::connect(path).await?)) }
        }))
        .await
}

/// A listening Unix socket whose file is removed when this value is dropped (unless the file
/// was replaced meanwhile by someone else's socket).
#[derive(Debug)]
pub struct BoundSocket {
    path: PathBuf,
    identity: Option<FileIdentity>,
}

impl BoundSocket {
    /// Binds at `path`, first removing a stale socket file left there. Refuses to remove
    /// anything that is not a socket, and a socket that a live process still serves (a second
    /// agent on the node, or a copy run by hand): `AddrInUse`, the file left alone.
    pub fn bind(path: &Path) -> io::Result<(Self, UnixListener)> {
        match std::fs::symlink_metadata(path) {
            Ok(meta) if meta.file_type().is_socket() => {
                if std::os::unix::net::UnixStream::connect(path).is_ok() {
                    return Err(io::Error::new(
                        io::ErrorKind::AddrInUse,
                        format!(
                            "{} is served by another live process (a second agent?); not removing it",
                            path.display()
                        ),
                    ));
                }
                std::fs::remove_file(path)?
            }
            Ok(_) => {
                return Err(io::Error::new(
                    io::ErrorKind::AlreadyExists,
                    format!("{} exists and is not a socket; not removing it", path.display()),
                ));
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        let listener = UnixListener::bind(path)?;
        let identity = FileIdentity::of(path);
        Ok((Self { path: path.to_path_buf(), identity }, listener))
    }

    /// The socket's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether the socket file is still the one this value bound (it is gone or replaced after
    /// the kubelet wiped the directory).
    pub fn is_intact(&self) -> bool {
        self.identity.is_some() && FileIdentity::of(&self.path) == self.identity
    }
}

impl Drop for BoundSocket {
    fn drop(&mut self) {
        if self.is_intact()
            && let Err(e) = std::fs::remove_file(&self.path)
        {
            tracing::warn!(socket = %self.path.display(), error = %e, "could not remove socket");
        }
    }
}

/// Device and inode of a file: tells a re-created file from the one seen before.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileIdentity {
    dev: u64,
    ino: u64,
}

impl FileIdentity {
    /// The identity of the file at `path`, or `None` when there is none.
    pub fn of(path: &Path) -> Option<Self> {
        use std::os::unix::fs::MetadataExt;
        std::fs::symlink_metadata(path).ok().map(|m| Self { dev: m.dev(), ino: m.ino() })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn bind_replaces_a_stale_socket_and_removes_its_own() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("p.sock");
        let (first, l1) = BoundSocket::bind(&path).expect("bind");
        assert!(first.is_intact());
        // A crashed process leaves its socket file behind, with nobody listening.
        drop(l1);
        std::mem::forget(first);
        let (second, _l2) = BoundSocket::bind(&path).expect("rebind over stale socket");
        assert!(second.is_intact());
        drop(second);
        assert!(!path.exists(), "socket removed on drop");
    }

    #[tokio::test]
    async fn a_socket_a_live_process_serves_is_never_taken() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("p.sock");
        let (first, _listening) = BoundSocket::bind(&path).expect("bind");
        let err = BoundSocket::bind(&path).expect_err("someone serves it");
        assert_eq!(err.kind(), io::ErrorKind::AddrInUse);
        assert!(err.to_string().contains("another live process"), "{err}");
        assert!(first.is_intact(), "the live socket file is left alone");
    }

    #[tokio::test]
    async fn bind_refuses_to_remove_a_regular_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("p.sock");
        std::fs::write(&path, b"data").expect("write");
        let err = BoundSocket::bind(&path).expect_err("must refuse");
        assert_eq!(err.kind(), io::ErrorKind::AlreadyExists);
        assert!(path.exists());
    }

    #[tokio::test]
    async fn a_replaced_socket_is_not_intact_and_not_removed() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("p.sock");
        let (ours, _l1) = BoundSocket::bind(&path).expect("bind");
        std::fs::remove_file(&path).expect("wipe");
        let _theirs = UnixListener::bind(&path).expect("someone else binds");
        assert!(!ours.is_intact());
        drop(ours);
        assert!(path.exists(), "the other socket is left alone");
    }
}
