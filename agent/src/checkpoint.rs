//! The agent's checkpoint: the node's allocations as a compacted snapshot (written atomically:
//! temporary file, fsync, rename, fsync of the directory) and an append-only journal of every
//! change since (one line per change, synced before the change is answered), each with a SHA-256
//! checksum, the node name and the boot ID, so that a torn, corrupted or foreign file is
//! recognised rather than trusted. A change costs one line and one `fdatasync`, whatever the
//! ledger holds; the snapshot is rewritten (and the journal started afresh) once the journal has
//! grown to the snapshot's size, so the journal's replay at start stays short.
//!
//! What a crash can leave, and what a start makes of it ([`Checkpoint::read`]): a torn last
//! journal line (its change was never answered: dropped); a new snapshot beside the journal it
//! replaced (the journal's changes up to the snapshot's sequence skipped); anything else out of
//! order (a corrupt line followed by others, a gap in the sequence, a journal without its
//! snapshot or a snapshot without its journal) is not trusted, and the ledger is rebuilt from
//! the kubelet's pod-resources API.
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
use crate::ledger::{AllocationRecord, Delta, Layout, RecordKey};

/// The checkpoint format version written by this agent: 3, a snapshot with its journal. A
/// format-2 snapshot (no journal, written by earlier agents) is still read.
pub const FORMAT: u32 = 3;
/// The snapshot's file name in the state directory.
pub const FILE_NAME: &str = "baleen-checkpoint.json";
/// The journal's file name in the state directory.
pub const JOURNAL_FILE_NAME: &str = "baleen-journal.jsonl";
/// The journal is compacted into a new snapshot once it holds more bytes than the snapshot did,
/// and never before it holds this many.
pub const MIN_JOURNAL_BYTES: u64 = 256 << 10;

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
    /// The last change the allocations include (format 3; a read checkpoint's is the journal's
    /// last line applied).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sequence: Option<u64>,
    /// The allocations.
    pub allocations: Vec<AllocationRecord>,
}

/// One line of the journal: an entry and the checksum of its JSON.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Line {
    checksum: String,
    entry: Entry,
}

/// What a journal line says.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
enum Entry {
    /// The first line: whose journal it is and the snapshot sequence it follows.
    Header {
        /// The node.
        node: String,
        /// The boot.
        boot_id: String,
        /// The sequence of the snapshot this journal was started after.
        base: u64,
    },
    /// One change, numbered from `base + 1`.
    Change {
        /// Its number.
        sequence: u64,
        /// What it did.
        delta: Delta,
    },
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

fn checksum(contents: &impl Serialize) -> String {
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

    /// The snapshot's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The journal's path (beside the snapshot).
    pub fn journal_path(&self) -> PathBuf {
        self.path.with_file_name(JOURNAL_FILE_NAME)
    }

    /// Reads and verifies the checkpoint: `Ok(None)` when there is none.
    pub fn load(&self, node: &str, boot_id: &str) -> Result<Option<Contents>, CheckpointError> {
        let Some(contents) = self.read()? else { return Ok(None) };
        self.verify(&contents, node, boot_id)?;
        Ok(Some(contents))
    }

    /// Reads the checkpoint (the snapshot, then its journal's changes applied) and checks
    /// checksums, formats and the order of the journal, but not whose or which boot's it is
    /// (see [`Self::verify`]): `Ok(None)` when there is none. An intact checkpoint of an earlier
    /// boot still says what the device IDs the kubelet holds meant.
    pub fn read(&self) -> Result<Option<Contents>, CheckpointError> {
        let journal_path = self.journal_path();
        let io = |path: &Path, source| CheckpointError::Io { path: path.to_path_buf(), source };
        let journal = read_bounded(&journal_path, MAX_JOURNAL_BYTES, Links::Refuse)
            .map_err(|e| io(&journal_path, e))?;
        let bytes = match read_bounded(&self.path, MAX_STATE_FILE_BYTES, Links::Refuse) {
            Ok(Some(bytes)) => bytes,
            Ok(None) if journal.is_some() => {
                return Err(CheckpointError::Corrupt {
                    path: journal_path,
                    reason: "a journal without its snapshot: the changes it holds follow a state that is gone".into(),
                });
            }
            Ok(None) => return Ok(None),
            Err(source) => return Err(io(&self.path, source)),
        };
        let mut contents = self.parse(&bytes)?;
        if contents.format == FORMAT {
            let Some(journal) = journal else {
                return Err(CheckpointError::Corrupt {
                    path: journal_path,
                    reason: "missing: the changes since the snapshot were in it".into(),
                });
            };
            self.replay_journal(&mut contents, &journal)?;
        }
        // A format-2 snapshot was written by an agent that keeps no journal, after any journal
        // left beside it: such a journal is older than the snapshot and is not read.
        Ok(Some(contents))
    }

    /// Checks `bytes` as this checkpoint's contents: checksum and format (see [`Self::read`]).
    pub fn parse(&self, bytes: &[u8]) -> Result<Contents, CheckpointError> {
        let corrupt = |reason: String| CheckpointError::Corrupt { path: self.path.clone(), reason };
        // The format first: a file of another format is that, not corrupt.
        let found = serde_json::from_slice::<serde_json::Value>(bytes)
            .ok()
            .and_then(|v| v.get("contents")?.get("format")?.as_u64());
        if let Some(found) = found.filter(|&f| f != u64::from(FORMAT) && f != 2) {
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
        if contents.format != FORMAT && contents.format != 2 {
            return Err(CheckpointError::Format {
                path: self.path.clone(),
                found: contents.format,
            });
        }
        if (contents.format == FORMAT) != contents.sequence.is_some() {
            return Err(corrupt(format!(
                "a format-{} snapshot {} a sequence",
                contents.format,
                if contents.sequence.is_some() { "with" } else { "without" }
            )));
        }
        Ok(contents)
    }

    /// Applies the journal `bytes` to the snapshot `contents` as [`Self::read`] does.
    pub fn replay_journal(
        &self,
        contents: &mut Contents,
        bytes: &[u8],
    ) -> Result<(), CheckpointError> {
        replay(&self.journal_path(), contents, bytes)
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

    /// Writes the allocations and the layout as a snapshot with an empty journal (see
    /// [`Self::compact`]), at sequence 0.
    pub fn store(
        &self,
        node: &str,
        boot_id: &str,
        layout: &Layout,
        allocations: &[AllocationRecord],
    ) -> Result<(), CheckpointError> {
        self.compact(node, boot_id, layout, allocations, 0).map(drop)
    }

    /// Writes the allocations and the layout as the snapshot at `sequence`, then a new journal
    /// that follows it, each atomically: after a crash at any point the files hold either the
    /// previous or the new checkpoint. Temporary files are created afresh (never through a
    /// symbolic link left at their path) and readable by their owner only. Returns the writer
    /// that appends the changes after `sequence`.
    pub fn compact(
        &self,
        node: &str,
        boot_id: &str,
        layout: &Layout,
        allocations: &[AllocationRecord],
        sequence: u64,
    ) -> Result<JournalWriter, CheckpointError> {
        let io_err = |path: &Path, source| CheckpointError::Io { path: path.to_path_buf(), source };
        let contents = Contents {
            format: FORMAT,
            node: node.into(),
            boot_id: boot_id.into(),
            layout: layout.clone(),
            sequence: Some(sequence),
            allocations: allocations.to_vec(),
        };
        let envelope = Envelope { checksum: checksum(&contents), contents };
        // Compact: the file is for the agent (and `jq`), a third of the pretty size to write.
        let bytes =
            serde_json::to_vec(&envelope).map_err(|e| io_err(&self.path, io::Error::other(e)))?;
        write_atomically(&self.path, &bytes).map_err(|e| io_err(&self.path, e))?;
        let journal = self.journal_path();
        let header =
            line(&Entry::Header { node: node.into(), boot_id: boot_id.into(), base: sequence });
        write_atomically(&journal, &header).map_err(|e| io_err(&journal, e))?;
        let file = OpenOptions::new()
            .append(true)
            .custom_flags(nix::libc::O_NOFOLLOW)
            .open(&journal)
            .map_err(|e| io_err(&journal, e))?;
        Ok(JournalWriter {
            file,
            path: journal,
            bytes: header.len() as u64,
            snapshot_bytes: bytes.len() as u64,
            last: sequence,
        })
    }
}

/// Appends changes to the journal (see the module documentation).
#[derive(Debug)]
pub struct JournalWriter {
    file: File,
    path: PathBuf,
    /// Bytes in the journal.
    bytes: u64,
    /// Bytes of the snapshot it follows.
    snapshot_bytes: u64,
    /// The last sequence written.
    last: u64,
}

impl JournalWriter {
    /// Appends `changes` (numbered, each the one after the last written) in one write and
    /// syncs them: once it returns `Ok`, a crash keeps them. After an error the journal's end
    /// is unknown: append nothing more, compact instead.
    pub fn append(&mut self, changes: &[(u64, Delta)]) -> Result<(), CheckpointError> {
        use std::os::unix::fs::MetadataExt as _;
        let io_err = |source| CheckpointError::Io { path: self.path.clone(), source };
        // Still the file at the journal's path: one removed or replaced (by hand, by a restore
        // of the state directory) would take every change written to it into oblivion.
        let open = self.file.metadata().map_err(io_err)?;
        let at_path = fs::symlink_metadata(&self.path).map_err(io_err)?;
        if (open.dev(), open.ino()) != (at_path.dev(), at_path.ino()) {
            return Err(io_err(io::Error::other(
                "the journal at this path is no longer the file being appended to (removed or replaced)",
            )));
        }
        let mut bytes = Vec::new();
        let mut last = self.last;
        for (sequence, delta) in changes {
            if *sequence != last + 1 {
                return Err(io_err(io::Error::other(format!(
                    "change {sequence} does not follow change {last} in the journal"
                ))));
            }
            last = *sequence;
            bytes.extend(line(&Entry::Change { sequence: *sequence, delta: delta.clone() }));
        }
        self.file.write_all(&bytes).map_err(io_err)?;
        self.file.sync_data().map_err(io_err)?;
        self.bytes += bytes.len() as u64;
        self.last = last;
        Ok(())
    }

    /// Whether the journal has grown enough to be compacted into a new snapshot.
    pub fn wants_compaction(&self) -> bool {
        self.bytes > self.snapshot_bytes.max(MIN_JOURNAL_BYTES)
    }
}

/// One journal line: the entry with its checksum, and a newline.
fn line(entry: &Entry) -> Vec<u8> {
    let line = Line { checksum: checksum(entry), entry: entry.clone() };
    let mut bytes = serde_json::to_vec(&line).unwrap_or_default();
    bytes.push(b'\n');
    bytes
}

/// The entry of one journal line, if it is whole and its checksum matches.
fn parse_line(bytes: &[u8]) -> Result<Entry, String> {
    let line: Line = serde_json::from_slice(bytes).map_err(|e| e.to_string())?;
    let expected = checksum(&line.entry);
    if line.checksum != expected {
        return Err(format!("checksum {} does not match the entry ({expected})", line.checksum));
    }
    Ok(line.entry)
}

/// Applies the journal `bytes` to the snapshot `contents` (see the module documentation).
fn replay(path: &Path, contents: &mut Contents, bytes: &[u8]) -> Result<(), CheckpointError> {
    let corrupt = |reason: String| CheckpointError::Corrupt { path: path.to_path_buf(), reason };
    let snapshot = contents.sequence.unwrap_or(0);
    // Every line ends with a newline, written with it in one write: what follows the last
    // newline is a line torn by a crash while it was written, never synced, so never answered.
    let mut lines: Vec<&[u8]> = bytes.split(|&b| b == b'\n').collect();
    let tail = lines.pop().unwrap_or_default();
    if !tail.is_empty() {
        tracing::warn!(journal = %path.display(), line = lines.len() + 1, "the journal's last line is torn; its change was never answered and is dropped");
    }
    let mut entries = Vec::with_capacity(lines.len());
    for (i, bytes) in lines.iter().enumerate() {
        let entry = parse_line(bytes)
            .map_err(|why| corrupt(format!("line {} is corrupt: {why}", i + 1)))?;
        entries.push(entry);
    }
    let mut entries = entries.into_iter();
    let base = match entries.next() {
        Some(Entry::Header { node, boot_id, base }) => {
            if node != contents.node || boot_id != contents.boot_id {
                return Err(corrupt(format!(
                    "it follows a snapshot of node {node:?} in boot {boot_id}, the snapshot is of node {:?} in boot {}",
                    contents.node, contents.boot_id
                )));
            }
            base
        }
        _ => return Err(corrupt("its first line is not its header".into())),
    };
    if base > snapshot {
        return Err(corrupt(format!(
            "it follows snapshot {base}, the snapshot present is {snapshot}: the one it follows is gone"
        )));
    }
    let mut records = Records::new(std::mem::take(&mut contents.allocations));
    let mut last = base;
    for entry in entries {
        let Entry::Change { sequence, delta } = entry else {
            return Err(corrupt("a second header".into()));
        };
        if sequence != last + 1 {
            return Err(corrupt(format!("change {sequence} follows change {last}")));
        }
        last = sequence;
        if sequence > snapshot {
            records.apply(delta);
        }
    }
    contents.allocations = records.into_vec();
    contents.sequence = Some(last.max(snapshot));
    Ok(())
}

/// Records by key in the order they were first put (the ledger's grant order).
struct Records {
    order: std::collections::BTreeMap<u64, AllocationRecord>,
    by_key: std::collections::HashMap<RecordKey, u64>,
    next: u64,
}

impl Records {
    fn new(records: Vec<AllocationRecord>) -> Self {
        let mut out = Self { order: Default::default(), by_key: Default::default(), next: 0 };
        out.apply(Delta { removed: Vec::new(), put: records });
        out
    }

    fn apply(&mut self, delta: Delta) {
        for key in delta.removed {
            if let Some(n) = self.by_key.remove(&key) {
                self.order.remove(&n);
            }
        }
        for record in delta.put {
            let n = *self.by_key.entry(record.key()).or_insert_with(|| {
                self.next += 1;
                self.next
            });
            self.order.insert(n, record);
        }
    }

    fn into_vec(self) -> Vec<AllocationRecord> {
        self.order.into_values().collect()
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

/// The most bytes a state file (the checkpoint, the co-location state) may hold. Reading one
/// costs about eleven times its size at its peak (issue 39: 11, 21, 41, 89 MiB at 1, 2, 4, 8
/// MiB), and the agent's memory limit is 128 MiB: at 16 MiB a 12 MiB snapshot OOM-killed the
/// agent at every start. The largest ledger of a node (every one of 32,768 units of a resource
/// held, by 1,024 containers of the longest names) writes 2.1 MiB
/// (`tests::the_largest_ledger_of_a_node_fits_the_bound`).
pub const MAX_STATE_FILE_BYTES: u64 = 4 << 20;
/// The most bytes the journal may hold: it is compacted once it outgrows the snapshot (or 256
/// KiB), so it holds at most about the snapshot's size and one more change.
pub const MAX_JOURNAL_BYTES: u64 = MAX_STATE_FILE_BYTES + (1 << 20);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ledger::Holder;

    fn record(ids: &[&str]) -> AllocationRecord {
        AllocationRecord {
            resource: "example.com/gpu-memory".into(),
            device_ids: ids.iter().map(|s| (*s).to_owned()).collect(),
            allocated_at: 7,
            listed: true,
            holder: None,
            claim: None,
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

    /// Issue 39, item 7: the bound fits the largest ledger a node holds, with room: every unit
    /// of a resource at its most (32,768) held, by 1,024 containers (a node's pods times their
    /// containers, well past the kubelet's 110 pods) whose names are the longest Kubernetes
    /// takes (a namespace of 63, a pod of 253, a container of 63 characters).
    #[test]
    fn the_largest_ledger_of_a_node_fits_the_bound() {
        let dir = tempfile::tempdir().expect("tempdir");
        let cp = Checkpoint::in_dir(dir.path());
        let units = usize::try_from(crate::ledger::MAX_DEVICES_PER_RESOURCE).expect("fits");
        let per = units / 1024;
        let records: Vec<AllocationRecord> = (0..1024)
            .map(|r| AllocationRecord {
                holder: Some(Holder {
                    namespace: format!("{r:0>63}"),
                    pod: format!("{r:0>253}"),
                    container: format!("{r:0>63}"),
                }),
                listed: true,
                ..record(
                    &(0..per)
                        .map(|u| {
                            format!("GPU-0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0::{}", r * per + u)
                        })
                        .collect::<Vec<_>>()
                        .iter()
                        .map(String::as_str)
                        .collect::<Vec<_>>(),
                )
            })
            .collect();
        cp.store("n1", "boot-a", &Layout::default(), &records).expect("store");
        let size = fs::metadata(cp.path()).expect("written").len();
        eprintln!("the largest ledger of a node: {size} bytes");
        assert!(size < MAX_STATE_FILE_BYTES * 3 / 4, "{size} bytes: too close to the bound");
        assert_eq!(cp.load("n1", "boot-a").expect("read").expect("there").allocations, records);
        // One byte past the bound: refused, not read.
        fs::write(cp.path(), vec![b' '; usize::try_from(MAX_STATE_FILE_BYTES).expect("fits") + 1])
            .expect("write");
        let err = cp.load("n1", "boot-a").expect_err("past the bound");
        let said = crate::error_chain::Chain(&err).to_string();
        assert!(said.contains("more than the"), "{said}");
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

    fn delta(put: &[&[&str]], removed: &[&[&str]]) -> Delta {
        Delta {
            removed: removed.iter().map(|ids| record(ids).key()).collect(),
            put: put.iter().map(|ids| record(ids)).collect(),
        }
    }

    fn ids(contents: &Contents) -> Vec<Vec<String>> {
        contents.allocations.iter().map(|r| r.device_ids.clone()).collect()
    }

    /// A snapshot of one record and a journal of three changes after it.
    fn journal_of_three(dir: &Path) -> Checkpoint {
        let cp = Checkpoint::in_dir(dir);
        let mut journal =
            cp.compact("n1", "boot-a", &Layout::default(), &[record(&["A"])], 10).expect("compact");
        journal.append(&[(11, delta(&[&["B"]], &[]))]).expect("append");
        // Two changes in one write (a group commit), the second replacing A with A again.
        journal
            .append(&[(12, delta(&[&["C"]], &[&["B"]])), (13, delta(&[&["A"]], &[]))])
            .expect("append");
        cp
    }

    #[test]
    fn the_journal_replays_its_changes_over_the_snapshot_in_order() {
        let dir = tempfile::tempdir().expect("tempdir");
        let cp = journal_of_three(dir.path());
        let contents = cp.load("n1", "boot-a").expect("load").expect("present");
        assert_eq!(ids(&contents), vec![vec!["A".to_owned()], vec!["C".to_owned()]]);
        assert_eq!(contents.sequence, Some(13));
        // A change out of order is never written.
        let mut journal = Checkpoint::in_dir(dir.path())
            .compact("n1", "boot-a", &Layout::default(), &[], 20)
            .expect("compact");
        assert!(journal.append(&[(22, delta(&[&["X"]], &[]))]).is_err(), "a gap");
    }

    #[test]
    fn a_torn_last_line_is_dropped_and_the_rest_trusted() {
        let dir = tempfile::tempdir().expect("tempdir");
        let cp = journal_of_three(dir.path());
        let path = cp.journal_path();
        let text = fs::read(&path).expect("read");
        // Cut inside the last line: the two changes before it stay.
        let last_start = text[..text.len() - 1].iter().rposition(|&b| b == b'\n').expect("lines");
        fs::write(&path, &text[..last_start + 20]).expect("write");
        let contents = cp.load("n1", "boot-a").expect("a torn tail is not corruption");
        assert_eq!(contents.expect("present").sequence, Some(12));
        // Cut just before its newline: the line is whole but was never synced; dropped too.
        fs::write(&path, &text[..text.len() - 1]).expect("write");
        assert_eq!(cp.load("n1", "boot-a").expect("load").expect("present").sequence, Some(12));
    }

    #[test]
    fn a_corrupt_line_before_others_a_gap_or_a_missing_half_is_not_trusted() {
        let dir = tempfile::tempdir().expect("tempdir");
        let cp = journal_of_three(dir.path());
        let path = cp.journal_path();
        let text = fs::read_to_string(&path).expect("read");
        let not_trusted = |why: &str| {
            let err = cp.load("n1", "boot-a").expect_err(why);
            assert!(matches!(err, CheckpointError::Corrupt { .. }), "{why}: {err}");
            err.to_string()
        };
        // One changed byte in a line that others follow (a whole line, its newline intact).
        fs::write(&path, text.replacen("\"B\"", "\"D\"", 1)).expect("write");
        assert!(not_trusted("a corrupt middle line").contains("line 2"));
        // A line lost in the middle: the sequence has a gap.
        let lines: Vec<&str> = text.lines().collect();
        fs::write(&path, format!("{}\n{}\n{}\n", lines[0], lines[2], lines[3])).expect("write");
        assert!(not_trusted("a gap").contains("follows change 10"));
        // The journal without its snapshot.
        fs::write(&path, &text).expect("write");
        let snapshot = fs::read(cp.path()).expect("read");
        fs::remove_file(cp.path()).expect("remove");
        assert!(not_trusted("no snapshot").contains("without its snapshot"));
        // The snapshot without its journal.
        fs::write(cp.path(), &snapshot).expect("write");
        fs::remove_file(&path).expect("remove");
        assert!(not_trusted("no journal").contains("missing"));
        // A journal that follows a newer snapshot than the one present.
        let newer = journal_of_three(&dir.path().join("newer"));
        drop(cp.compact("n1", "boot-a", &Layout::default(), &[], 5).expect("compact"));
        fs::copy(newer.journal_path(), &path).expect("copy");
        assert!(not_trusted("newer journal").contains("the one it follows is gone"));
    }

    #[test]
    fn a_crash_between_the_new_snapshot_and_its_journal_skips_what_the_snapshot_holds() {
        let dir = tempfile::tempdir().expect("tempdir");
        let cp = journal_of_three(dir.path());
        let old_journal = fs::read(cp.journal_path()).expect("read");
        // The compaction at 13 wrote its snapshot, then the crash: the old journal is left.
        let records = cp.load("n1", "boot-a").expect("load").expect("present").allocations;
        cp.compact("n1", "boot-a", &Layout::default(), &records, 13).expect("compact");
        fs::write(cp.journal_path(), &old_journal).expect("write");
        let contents = cp.load("n1", "boot-a").expect("load").expect("present");
        assert_eq!(ids(&contents), vec![vec!["A".to_owned()], vec!["C".to_owned()]]);
        assert_eq!(contents.sequence, Some(13));
    }

    #[test]
    fn a_journal_removed_or_replaced_under_the_writer_fails_the_append() {
        let dir = tempfile::tempdir().expect("tempdir");
        let cp = Checkpoint::in_dir(dir.path());
        let mut journal = cp.compact("n1", "boot-a", &Layout::default(), &[], 0).expect("compact");
        fs::remove_file(cp.journal_path()).expect("remove");
        fs::write(cp.journal_path(), b"").expect("another file there");
        let err = journal.append(&[(1, delta(&[&["A"]], &[]))]).expect_err("not the same file");
        assert!(err.to_string().contains(JOURNAL_FILE_NAME), "{err}");
    }

    #[test]
    fn a_format_two_snapshot_is_read_without_a_journal() {
        let dir = tempfile::tempdir().expect("tempdir");
        let cp = Checkpoint::in_dir(dir.path());
        let contents = Contents {
            format: 2,
            node: "n1".into(),
            boot_id: "boot-a".into(),
            layout: Layout::default(),
            sequence: None,
            allocations: vec![record(&["A"])],
        };
        let envelope = Envelope { checksum: checksum(&contents), contents };
        fs::write(cp.path(), serde_json::to_vec(&envelope).expect("json")).expect("write");
        let loaded = cp.load("n1", "boot-a").expect("load").expect("present");
        assert_eq!(loaded.allocations, vec![record(&["A"])]);
    }

    proptest::proptest! {
        #[test]
        fn any_bytes_load_as_an_error_or_a_checkpoint_never_a_panic(bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..512)) {
            let dir = tempfile::tempdir().expect("tempdir");
            let cp = Checkpoint::in_dir(dir.path());
            fs::write(cp.path(), &bytes).expect("write");
            let _ = cp.load("n1", "boot-a");
        }

        #[test]
        fn any_journal_bytes_load_as_an_error_or_a_checkpoint_never_a_panic(bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..512)) {
            let dir = tempfile::tempdir().expect("tempdir");
            let cp = Checkpoint::in_dir(dir.path());
            cp.store("n1", "boot-a", &Layout::default(), &[]).expect("store");
            fs::write(cp.journal_path(), &bytes).expect("write");
            let _ = cp.load("n1", "boot-a");
        }
    }
}
