//! CDI specs of prepared claims: one file per claim in the runtime's CDI directory
//! (`/var/run/cdi`), read by the container runtime (containerd, CRI-O, the NVIDIA container
//! toolkit) when a container names one of its devices. Each device of the claim is a CDI device
//! `<kind>=<claim UID>-<device>` whose edits give the container what its share needs (the MPS
//! pipe directory, the memory limit, the thread percentage); the GPU's own device nodes and
//! libraries come from the toolkit's spec (`nvidia.com/gpu=<UUID>`), named beside it.
//!
//! A spec is written whole or not at all (a temporary file the runtime ignores, fsynced, renamed,
//! the directory fsynced): a runtime never reads half a spec. File names come from the claim's
//! UID, which must be a UID (letters, digits, `-`): nothing the kubelet sends can name a path
//! outside the directory.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write as _};
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// The CDI specification version written (0.6.0: env, mounts, device nodes, annotations).
pub const CDI_VERSION: &str = "0.6.0";
/// The runtime's default directory of dynamic CDI specs.
pub const DEFAULT_DIR: &str = "/var/run/cdi";

/// A CDI spec file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Spec {
    /// [`CDI_VERSION`].
    pub cdi_version: String,
    /// `<vendor>/<class>`.
    pub kind: String,
    /// The devices.
    pub devices: Vec<DeviceSpec>,
}

/// One CDI device.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct DeviceSpec {
    /// Its name within the kind.
    pub name: String,
    /// What naming it does to a container.
    pub container_edits: Edits,
}

/// Edits of a container (the part of CDI's `containerEdits` baleen writes).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Edits {
    /// `NAME=value` entries.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub env: Vec<String>,
    /// Device nodes.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub device_nodes: Vec<DeviceNode>,
    /// Bind mounts.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mounts: Vec<Mount>,
}

/// A device node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct DeviceNode {
    /// Its path in the container (and on the host).
    pub path: String,
}

/// A bind mount.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Mount {
    /// On the host.
    pub host_path: String,
    /// In the container.
    pub container_path: String,
    /// Mount options (`rbind`, `ro`, ...).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub options: Vec<String>,
}

/// Why a spec cannot be written, read or removed.
#[derive(Debug, thiserror::Error)]
pub enum CdiError {
    /// The claim UID would not make a safe file or device name.
    #[error("claim UID {uid:?} is not a UID (letters, digits and '-' only)")]
    BadUid {
        /// The UID.
        uid: String,
    },
    /// A device name would not make a CDI device name.
    #[error("device name {name:?} cannot be part of a CDI device name")]
    BadName {
        /// The name.
        name: String,
    },
    /// The file system refused.
    #[error("{action} CDI spec {path}")]
    Io {
        /// What was being done.
        action: &'static str,
        /// The file.
        path: PathBuf,
        /// Why it failed.
        #[source]
        source: io::Error,
    },
}

/// The most bytes a claim's spec may hold when read back: the specs written here are a few KiB.
pub const MAX_SPEC_BYTES: u64 = 1 << 20;

/// The CDI specs of one driver's claims in one directory.
#[derive(Debug, Clone)]
pub struct SpecDir {
    dir: PathBuf,
    kind: String,
}

fn is_uid(uid: &str) -> bool {
    !uid.is_empty()
        && uid.len() <= 128
        && uid.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
}

/// Whether `name` may be a CDI device name (letters, digits, `-`, `_`, `.`, `:`; starting with a
/// letter or digit).
fn is_device_name(name: &str) -> bool {
    name.bytes().next().is_some_and(|b| b.is_ascii_alphanumeric())
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b':'))
}

impl SpecDir {
    /// The specs of kind `kind` (`<vendor>/<class>`, e.g. `gpu.example.com/claim`) in `dir`.
    pub fn new(dir: impl Into<PathBuf>, kind: impl Into<String>) -> Self {
        Self { dir: dir.into(), kind: kind.into() }
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The file prefix of this kind's specs: the kind with `/` as `-`, then `_`.
    fn prefix(&self) -> String {
        format!("{}_", self.kind.replace('/', "-"))
    }

    /// Where the spec of claim `uid` lies.
    pub fn path_of(&self, uid: &str) -> Result<PathBuf, CdiError> {
        if !is_uid(uid) {
            return Err(CdiError::BadUid { uid: uid.to_owned() });
        }
        Ok(self.dir.join(format!("{}{uid}.json", self.prefix())))
    }

    /// The CDI device name of `device` of claim `uid`.
    pub fn device_name(uid: &str, device: &str) -> String {
        format!("{uid}-{device}")
    }

    /// The fully qualified CDI name (`<kind>=<name>`) of device `name`.
    pub fn qualified(&self, name: &str) -> String {
        format!("{}={name}", self.kind)
    }

    /// Writes the spec of claim `uid` with `devices` (device name in the pool, its edits),
    /// replacing any other spec it had (one already as it would be written is left alone);
    /// returns each device's qualified CDI name, in order.
    pub fn write(&self, uid: &str, devices: &[(String, Edits)]) -> Result<Vec<String>, CdiError> {
        let path = self.path_of(uid)?;
        let mut spec =
            Spec { cdi_version: CDI_VERSION.into(), kind: self.kind.clone(), devices: Vec::new() };
        let mut names = Vec::new();
        for (device, edits) in devices {
            let name = Self::device_name(uid, device);
            if !is_device_name(&name) {
                return Err(CdiError::BadName { name });
            }
            names.push(self.qualified(&name));
            spec.devices.push(DeviceSpec { name, container_edits: edits.clone() });
        }
        // Already there as it would be written (a repeated Prepare): no write, no sync.
        if matches!(self.read(uid), Ok(Some(on_disk)) if on_disk == spec) {
            return Ok(names);
        }
        let bytes = serde_json::to_vec_pretty(&spec).map_err(|e| CdiError::Io {
            action: "encoding",
            path: path.clone(),
            source: io::Error::other(e),
        })?;
        write_whole(&path, &bytes).map_err(|source| CdiError::Io {
            action: "writing",
            path,
            source,
        })?;
        Ok(names)
    }

    /// Reads the spec of claim `uid`, if there is one.
    pub fn read(&self, uid: &str) -> Result<Option<Spec>, CdiError> {
        let path = self.path_of(uid)?;
        // Regular files only, bounded, opened non-blocking: a link to /dev/zero or a FIFO
        // planted at the path is refused, never read without end or waited on.
        let bytes = match baleen_edge::files::read_bounded(
            &path,
            MAX_SPEC_BYTES,
            baleen_edge::files::Links::Refuse,
        ) {
            Ok(Some(b)) => b,
            Ok(None) => return Ok(None),
            Err(source) => return Err(CdiError::Io { action: "reading", path, source }),
        };
        serde_json::from_slice(&bytes).map(Some).map_err(|e| CdiError::Io {
            action: "parsing",
            path,
            source: io::Error::new(io::ErrorKind::InvalidData, e),
        })
    }

    /// Removes the spec of claim `uid`; returns whether there was one.
    pub fn remove(&self, uid: &str) -> Result<bool, CdiError> {
        let path = self.path_of(uid)?;
        match fs::remove_file(&path) {
            Ok(()) => Ok(true),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
            Err(source) => Err(CdiError::Io { action: "removing", path, source }),
        }
    }

    /// The claim UIDs this directory holds specs of (for removing those of claims no longer
    /// prepared). A missing directory holds none.
    pub fn claims(&self) -> Result<Vec<String>, CdiError> {
        let entries = match fs::read_dir(&self.dir) {
            Ok(e) => e,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(source) => {
                return Err(CdiError::Io { action: "listing", path: self.dir.clone(), source });
            }
        };
        let prefix = self.prefix();
        let mut uids: Vec<String> = entries
            .filter_map(Result::ok)
            .filter_map(|e| {
                let name = e.file_name().into_string().ok()?;
                let uid = name.strip_prefix(&prefix)?.strip_suffix(".json")?;
                is_uid(uid).then(|| uid.to_owned())
            })
            .collect();
        uids.sort();
        Ok(uids)
    }
}

/// Writes `bytes` at `path` whole: to a hidden temporary file beside it (a name no runtime
/// reads as a spec; a link planted there is not followed), synced, renamed over `path`, the
/// directory synced.
fn write_whole(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let dir = path.parent().ok_or_else(|| io::Error::other("a spec path has a directory"))?;
    fs::create_dir_all(dir)?;
    let name = path.file_name().ok_or_else(|| io::Error::other("a spec path has a file name"))?;
    let tmp = dir.join(format!(".{}.tmp", name.to_string_lossy()));
    let mut file = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o644)
        .custom_flags(nix::libc::O_NOFOLLOW)
        .open(&tmp)?;
    file.write_all(bytes)?;
    file.sync_all()?;
    drop(file);
    fs::rename(&tmp, path)?;
    File::open(dir)?.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;
    use baleen_k8s::error_chain::Chain;

    fn edits() -> Edits {
        Edits {
            env: vec!["CUDA_MPS_PIPE_DIRECTORY=/run/baleen/mps".into()],
            device_nodes: Vec::new(),
            mounts: vec![Mount {
                host_path: "/run/baleen/mps/GPU-1/pipe".into(),
                container_path: "/run/baleen/mps".into(),
                options: vec!["rbind".into(), "rw".into()],
            }],
        }
    }

    #[test]
    fn a_spec_is_written_read_listed_and_removed() {
        let dir = tempfile::tempdir().expect("tempdir");
        let specs = SpecDir::new(dir.path().join("cdi"), "gpu.example.com/claim");
        let names = specs.write("uid-1", &[("gpu-0".into(), edits())]).expect("written");
        assert_eq!(names, ["gpu.example.com/claim=uid-1-gpu-0"]);
        let path = specs.path_of("uid-1").expect("path");
        assert_eq!(
            path.file_name().and_then(|n| n.to_str()),
            Some("gpu.example.com-claim_uid-1.json")
        );
        let text = fs::read_to_string(&path).expect("read");
        let value: serde_json::Value = serde_json::from_str(&text).expect("json");
        assert_eq!(value["cdiVersion"], CDI_VERSION);
        assert_eq!(
            value["devices"][0]["containerEdits"]["mounts"][0]["hostPath"],
            "/run/baleen/mps/GPU-1/pipe"
        );
        assert_eq!(specs.read("uid-1").expect("read").map(|s| s.devices.len()), Some(1));
        assert_eq!(specs.claims().expect("listed"), ["uid-1"]);
        // Nothing else is left in the directory (no temporary file).
        assert_eq!(fs::read_dir(specs.dir()).expect("dir").count(), 1);
        assert!(specs.remove("uid-1").expect("removed"));
        assert!(!specs.remove("uid-1").expect("absent is fine"));
        assert!(specs.claims().expect("listed").is_empty());
    }

    #[test]
    fn a_spec_already_as_written_is_not_written_again_and_a_changed_one_is() {
        let dir = tempfile::tempdir().expect("tempdir");
        let specs = SpecDir::new(dir.path(), "gpu.example.com/claim");
        specs.write("uid-1", &[("gpu-0".into(), edits())]).expect("written");
        let path = specs.path_of("uid-1").expect("path");
        let inode = |p: &Path| std::os::unix::fs::MetadataExt::ino(&fs::metadata(p).expect("meta"));
        let first = inode(&path);
        specs.write("uid-1", &[("gpu-0".into(), edits())]).expect("the same");
        assert_eq!(inode(&path), first, "not replaced");
        let mut other = edits();
        other.env.push("X=1".into());
        specs.write("uid-1", &[("gpu-0".into(), other.clone())]).expect("changed");
        assert_ne!(inode(&path), first, "replaced");
        let read = specs.read("uid-1").expect("read").expect("there");
        assert_eq!(read.devices[0].container_edits, other);
        // A file corrupted on disk is replaced whole.
        fs::write(&path, "{").expect("corrupt");
        specs.write("uid-1", &[("gpu-0".into(), edits())]).expect("rewritten");
        assert!(specs.read("uid-1").expect("parses").is_some());
    }

    #[test]
    fn uids_that_could_name_another_path_are_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        let specs = SpecDir::new(dir.path(), "gpu.example.com/claim");
        for uid in ["", "../../etc/passwd", "a/b", "uid 1", "uid\n"] {
            assert!(
                matches!(specs.write(uid, &[]), Err(CdiError::BadUid { .. })),
                "{uid:?} must be refused"
            );
        }
        assert!(matches!(
            specs.write("uid-1", &[("gpu/0".into(), Edits::default())]),
            Err(CdiError::BadName { .. })
        ));
        assert_eq!(fs::read_dir(dir.path()).expect("dir").count(), 0, "nothing written");
    }

    #[test]
    fn a_link_at_the_temporary_name_is_not_written_through() {
        let dir = tempfile::tempdir().expect("tempdir");
        let specs = SpecDir::new(dir.path(), "gpu.example.com/claim");
        let victim = dir.path().join("victim");
        fs::write(&victim, "keep").expect("victim");
        let tmp = dir.path().join(".gpu.example.com-claim_uid-1.json.tmp");
        std::os::unix::fs::symlink(&victim, &tmp).expect("link");
        let e = specs.write("uid-1", &[("gpu-0".into(), edits())]).expect_err("refused");
        assert!(e.to_string().contains("writing"), "{e}");
        assert_eq!(fs::read_to_string(&victim).expect("victim"), "keep");
    }

    /// Issue 39, item 7: a link to `/dev/zero` or a FIFO planted at a claim's spec path is
    /// refused at once (it once filled the memory in 0.1 s, or hung a Prepare for good), and a
    /// Prepare writes the spec over it.
    #[test]
    fn a_device_or_a_fifo_at_a_spec_path_is_refused_and_written_over() {
        let dir = tempfile::tempdir().expect("tempdir");
        let specs = SpecDir::new(dir.path(), "gpu.example.com/claim");
        let zero = specs.path_of("uid-z").expect("path");
        std::os::unix::fs::symlink("/dev/zero", &zero).expect("link");
        let fifo = specs.path_of("uid-f").expect("path");
        let made = std::process::Command::new("mkfifo").arg(&fifo).status();
        assert!(made.expect("mkfifo (coreutils)").success());
        let big = specs.path_of("uid-b").expect("path");
        fs::write(&big, vec![b' '; usize::try_from(MAX_SPEC_BYTES).expect("fits") + 1])
            .expect("big");
        let started = std::time::Instant::now();
        for (uid, says) in
            [("uid-z", "symbolic link"), ("uid-f", "FIFO"), ("uid-b", "more than the")]
        {
            let e = specs.read(uid).expect_err(uid);
            assert!(Chain(&e).to_string().contains(says), "{uid}: {}", Chain(&e));
            specs.write(uid, &[("gpu-0".into(), edits())]).expect("written over");
            assert_eq!(specs.read(uid).expect("read").map(|s| s.devices.len()), Some(1));
        }
        assert!(started.elapsed() < std::time::Duration::from_secs(5), "nothing waited");
    }

    #[test]
    fn specs_of_other_kinds_are_not_listed() {
        let dir = tempfile::tempdir().expect("tempdir");
        fs::write(dir.path().join("nvidia.yaml"), "x").expect("other");
        fs::write(dir.path().join("gpu.example.com-claim_not a uid.json"), "x").expect("odd");
        let specs = SpecDir::new(dir.path(), "gpu.example.com/claim");
        specs.write("uid-2", &[]).expect("written");
        assert_eq!(specs.claims().expect("listed"), ["uid-2"]);
    }
}
