//! The agent's checkpoint: the node's allocations, written atomically (temporary file, fsync,
//! rename, fsync of the directory) after every change, with a SHA-256 checksum, the node name
//! and the boot ID, so that a torn, corrupted or foreign file is recognised rather than trusted.
//!
//! The checkpoint is a cache: the kubelet's pod-resources API is the truth, and
//! [`crate::reconcile`] rebuilds the allocations from it whenever the checkpoint is missing or
//! cannot be trusted. It also records the [`Layout`] the device IDs were read with (unit size,
//! domain, NVLink group members), so that a start with another configuration can tell whether
//! the held IDs would change meaning (format 2; a format-1 file is not trusted and the ledger is
//! rebuilt from pod-resources).

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write as _};
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest as _, Sha256};

use crate::files::{Links, read_bounded};
use crate::ledger::{AllocationRecord, Layout};

/// The checkpoint format version written by this agent.
pub const FORMAT: u32 = 2;
/// The checkpoint's file name in the state directory.
pub const FILE_NAME: &str = "baleen-checkpoint.json";

/// What the checkpoint holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Contents {
    /// Format version.
    pub format: u32,
    /// The node the allocations belong to.
    pub node: String,
    /// The kernel boot ID when written (`/proc/sys/kernel/random/boot_id`).
    pub boot_id: String,
    /// What the device IDs meant when written.
    pub layout: Layout,
    /// The allocations.
    pub allocations: Vec<AllocationRecord>,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Envelope {
    checksum: String,
    contents: Contents,
}

/// Why a checkpoint is not used.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// The file cannot be read or written.
    #[error("cannot use checkpoint {}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// The file is not a checkpoint, or its checksum does not match (torn or corrupted).
    #[error("checkpoint {} is corrupt: {reason}", path.display())]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// The file was written for another node.
    #[error("checkpoint {} belongs to node {found:?}, not {expected:?}", path.display())]
    Foreign {
        /// The file.
        path: PathBuf,
        /// Its node.
        found: String,
        /// This node.
        expected: String,
    },
    /// The file was written before the node rebooted.
    #[error("checkpoint {} was written in boot {found}, this is boot {current}", path.display())]
    OtherBoot {
        /// The file.
        path: PathBuf,
        /// Its boot ID.
        found: String,
        /// The current boot ID.
        current: String,
    },
    /// The file was written by an agent with another format.
    #[error("checkpoint {} has format {found}, this agent reads {FORMAT}", path.display())]
    Format {
        /// The file.
        path: PathBuf,
        /// Its format.
        found: u32,
    },
}

fn checksum(contents: &Contents) -> String {
    // serde_json writes struct fields in declaration order, so this is canonical for a value.
    let bytes = serde_json::to_vec(contents).unwrap_or_default();
    let digest = Sha256::digest(&bytes);
    let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
    format!("sha256:{hex}")
}

/// The checkpoint file of a state directory.
#[derive(Debug, Clone)]
pub struct Checkpoint {
    path: PathBuf,
}

impl Checkpoint {
    /// The checkpoint at `<state_dir>/baleen-checkpoint.json`.
    pub fn in_dir(state_dir: &Path) -> Self {
        Self { path: state_dir.join(FILE_NAME) }
    }

    /// The file path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Reads and verifies the checkpoint: `Ok(None)` when there is none.
    pub fn load(&self, node: &str, boot_id: &str) -> Result<Option<Contents>, CheckpointError> {
        let Some(contents) = self.read()? else { return Ok(None) };
        self.verify(&contents, node, boot_id)?;
        Ok(Some(contents))
    }

    /// Reads the checkpoint and checks its checksum and format, but not whose or which boot's
    /// it is (see [`Self::verify`]): `Ok(None)` when there is none. An intact checkpoint of an
    /// earlier boot still says what the device IDs the kubelet holds meant.
    pub fn read(&self) -> Result<Option<Contents>, CheckpointError> {
        let bytes = match read_bounded(&self.path, MAX_STATE_FILE_BYTES, Links::Refuse) {
            Ok(Some(bytes)) => bytes,
            Ok(None) => return Ok(None),
            Err(source) => return Err(CheckpointError::Io { path: self.path.clone(), source }),
        };
        self.parse(&bytes).map(Some)
    }

    /// Checks `bytes` as this checkpoint's contents: checksum and format (see [`Self::read`]).
    pub fn parse(&self, bytes: &[u8]) -> Result<Contents, CheckpointError> {
        let corrupt = |reason: String| CheckpointError::Corrupt { path: self.path.clone(), reason };
        // The format first: a file of another format is that, not corrupt.
        let found = serde_json::from_slice::<serde_json::Value>(bytes)
            .ok()
            .and_then(|v| v.get("contents")?.get("format")?.as_u64());
        if let Some(found) = found.filter(|&f| f != u64::from(FORMAT)) {
            return Err(CheckpointError::Format {
                path: self.path.clone(),
                found: u32::try_from(found).unwrap_or(u32::MAX),
            });
        }
        let envelope: Envelope =
            serde_json::from_slice(bytes).map_err(|e| corrupt(e.to_string()))?;
        let expected = checksum(&envelope.contents);
        if envelope.checksum != expected {
            return Err(corrupt(format!(
                "checksum {} does not match the contents ({expected})",
                envelope.checksum
            )));
        }
        let contents = envelope.contents;
        if contents.format != FORMAT {
            return Err(CheckpointError::Format {
                path: self.path.clone(),
                found: contents.format,
            });
        }
        Ok(contents)
    }

    /// Whether `contents` are this node's, of this boot: only then are its allocations trusted.
    pub fn verify(
        &self,
        contents: &Contents,
        node: &str,
        boot_id: &str,
    ) -> Result<(), CheckpointError> {
        if contents.node != node {
            return Err(CheckpointError::Foreign {
                path: self.path.clone(),
                found: contents.node.clone(),
                expected: node.into(),
            });
        }
        if contents.boot_id != boot_id {
            return Err(CheckpointError::OtherBoot {
                path: self.path.clone(),
                found: contents.boot_id.clone(),
                current: boot_id.into(),
            });
        }
        Ok(())
    }

    /// Writes the allocations and the layout atomically: after a crash at any point the file
    /// holds either the previous or the new checkpoint. The temporary file is created afresh
    /// (never through a symbolic link left at its path) and readable by its owner only.
    pub fn store(
        &self,
        node: &str,
        boot_id: &str,
        layout: &Layout,
        allocations: &[AllocationRecord],
    ) -> Result<(), CheckpointError> {
        let io_err = |source| CheckpointError::Io { path: self.path.clone(), source };
        let contents = Contents {
            format: FORMAT,
            node: node.into(),
            boot_id: boot_id.into(),
            layout: layout.clone(),
            allocations: allocations.to_vec(),
        };
        let envelope = Envelope { checksum: checksum(&contents), contents };
        // Compact: the file is for the agent (and `jq`), a third of the pretty size to write.
        let bytes = serde_json::to_vec(&envelope).map_err(|e| io_err(io::Error::other(e)))?;
        write_atomically(&self.path, &bytes).map_err(io_err)
    }
}

/// Replaces `path` with `bytes` so that a crash leaves either the old or the new file, whole:
/// a temporary file beside it (created anew, mode 0600), fsync, rename, fsync of the directory.
pub fn write_atomically(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    fs::create_dir_all(dir)?;
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = std::path::PathBuf::from(tmp);
    match fs::remove_file(&tmp) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    {
        // create_new: O_EXCL, which never follows a symbolic link planted at the path.
        let mut file = OpenOptions::new().write(true).create_new(true).mode(0o600).open(&tmp)?;
        file.write_all(bytes)?;
        file.sync_all()?;
    }
    fs::rename(&tmp, path)?;
    File::open(dir).and_then(|d| d.sync_all())
}

/// The kernel's boot ID from `path` (normally `/proc/sys/kernel/random/boot_id`): at most 4 KiB
/// of a regular file (a FIFO or an endless file there is an error, never a hang).
pub fn read_boot_id(path: &Path) -> io::Result<String> {
    let bytes = read_bounded(path, 4096, Links::Follow)?
        .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, "no such file"))?;
    Ok(String::from_utf8_lossy(&bytes).trim().to_owned())
}

/// The most bytes a state file (the checkpoint, the co-location state) may hold: a ledger at
/// its largest (32,768 devices per resource) writes well under half of it.
pub const MAX_STATE_FILE_BYTES: u64 = 16 << 20;

#[cfg(test)]
mod tests {
    use super::*;

    fn record(ids: &[&str]) -> AllocationRecord {
        AllocationRecord {
            resource: "example.com/gpu-memory".into(),
            device_ids: ids.iter().map(|s| (*s).to_owned()).collect(),
            allocated_at: 7,
            listed: true,
            holder: None,
        }
    }

    #[test]
    fn round_trip_and_every_kind_of_distrust() {
        let dir = tempfile::tempdir().expect("tempdir");
        let cp = Checkpoint::in_dir(&dir.path().join("state"));
        assert!(cp.load("n1", "boot-a").expect("no file is fine").is_none());
        let records = vec![record(&["GPU-1::0", "GPU-1::1"]), record(&["GPU-2::5"])];
        cp.store("n1", "boot-a", &Layout::default(), &records).expect("store");
        let loaded = cp.load("n1", "boot-a").expect("load").expect("present");
        assert_eq!(loaded.allocations, records);
        assert!(!cp.path().with_extension("json.tmp").exists(), "temporary file renamed away");

        assert!(matches!(cp.load("n2", "boot-a"), Err(CheckpointError::Foreign { .. })));
        assert!(matches!(cp.load("n1", "boot-b"), Err(CheckpointError::OtherBoot { .. })));

        // One changed byte inside the contents: the checksum catches it.
        let text = fs::read_to_string(cp.path()).expect("read");
        fs::write(cp.path(), text.replacen("GPU-2::5", "GPU-2::6", 1)).expect("write");
        let err = cp.load("n1", "boot-a").expect_err("corrupt");
        assert!(matches!(err, CheckpointError::Corrupt { .. }), "{err}");
        assert!(err.to_string().contains("checksum"), "{err}");

        // A torn file.
        fs::write(cp.path(), &text[..text.len() / 2]).expect("write");
        assert!(matches!(cp.load("n1", "boot-a"), Err(CheckpointError::Corrupt { .. })));
        fs::write(cp.path(), b"").expect("write");
        assert!(matches!(cp.load("n1", "boot-a"), Err(CheckpointError::Corrupt { .. })));
    }

    #[test]
    fn a_file_of_another_format_is_reported_as_such_not_as_corrupt() {
        let dir = tempfile::tempdir().expect("tempdir");
        let cp = Checkpoint::in_dir(dir.path());
        let old = r#"{"checksum":"sha256:00","contents":{"format":1,"node":"n1","boot_id":"b","allocations":[]}}"#;
        fs::write(cp.path(), old).expect("write");
        let err = cp.load("n1", "b").expect_err("format 1");
        assert!(matches!(err, CheckpointError::Format { found: 1, .. }), "{err}");
    }

    #[test]
    fn the_file_is_private_and_no_link_is_followed() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = tempfile::tempdir().expect("tempdir");
        let cp = Checkpoint::in_dir(dir.path());
        // A link planted where the temporary file goes, pointing at a file of someone else's.
        let victim = dir.path().join("victim");
        fs::write(&victim, "precious").expect("write");
        std::os::unix::fs::symlink(&victim, cp.path().with_extension("json.tmp")).expect("link");
        cp.store("n1", "boot-a", &Layout::default(), &[record(&["GPU-1::0"])]).expect("store");
        assert_eq!(fs::read_to_string(&victim).expect("read"), "precious", "not written through");
        let mode = fs::metadata(cp.path()).expect("meta").permissions().mode() & 0o777;
        assert_eq!(mode, 0o600, "{mode:o}");
        assert!(cp.load("n1", "boot-a").expect("load").is_some());
    }

    proptest::proptest! {
        #[test]
        fn any_bytes_load_as_an_error_or_a_checkpoint_never_a_panic(bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..512)) {
            let dir = tempfile::tempdir().expect("tempdir");
            let cp = Checkpoint::in_dir(dir.path());
            fs::write(cp.path(), &bytes).expect("write");
            let _ = cp.load("n1", "boot-a");
        }
    }
}
