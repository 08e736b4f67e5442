//! How a container is given the GPUs of its grant, in a form the container runtime enforces
//! (the device-list strategy), and what the agent can tell of whether the node refuses every
//! other way in. Called by the device-plugin adapter (`crate::resources`) for every Allocate
//! answer and once at start for the node's posture (log and metric).
//!
//! The hole this closes: the NVIDIA container runtime gives a container every GPU its
//! `NVIDIA_VISIBLE_DEVICES` names, and CUDA images bake in `NVIDIA_VISIBLE_DEVICES=all`. Unless
//! the toolkit refuses that variable for unprivileged containers
//! (`accept-nvidia-visible-devices-envvar-when-unprivileged = false` in its `config.toml`), any
//! pod on the node, asking for nothing, sees every GPU. With the variable refused, a GPU reaches
//! a container only through what the kubelet passes from an Allocate answer:
//!
//! - [`Strategy::Cdi`] (default): fully qualified CDI device names (`nvidia.com/gpu=<UUID>`),
//!   which the runtime resolves in the node's CDI spec files. A name the spec lacks would fail
//!   the container's start, so the agent reads the specs (`cdi.specDirs`) and answers a grant
//!   whose GPUs the spec does not name with volume-mounts instead, with a warning and
//!   `baleen_device_list_fallbacks_total`.
//! - [`Strategy::VolumeMounts`]: `/dev/null` bound at `/var/run/nvidia-container-devices/<UUID>`
//!   and `NVIDIA_VISIBLE_DEVICES` pointing there, which the toolkit reads with
//!   `accept-nvidia-visible-devices-as-volume-mounts = true`.
//! - [`Strategy::Envvar`]: `NVIDIA_VISIBLE_DEVICES=<UUIDs>` only. Insecure: it works only where
//!   the toolkit honours the variable for every container, so any pod can name any GPU.
//!
//! Every answer also sets `NVIDIA_VISIBLE_DEVICES` (to `void` under CDI) so that an image's baked
//! `all` never adds GPUs where the toolkit still reads the variable.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde::Deserialize;

use super::BindMount;

/// Where the toolkit looks for volume-mounted device names in a container.
pub const VOLUME_MOUNTS_DIR: &str = "/var/run/nvidia-container-devices";
/// The toolkit key that must be `false` for unprivileged containers to be held to their grant.
pub const ENVVAR_KEY: &str = "accept-nvidia-visible-devices-envvar-when-unprivileged";
/// The toolkit key that must be `true` for the volume-mounts strategy.
pub const VOLUME_MOUNTS_KEY: &str = "accept-nvidia-visible-devices-as-volume-mounts";
/// The largest spec or toolkit file read (a node's CDI spec is tens of KiB).
const MAX_FILE_BYTES: u64 = 16 << 20;
/// Re-read the CDI specs at most this often when a grant's device is missing from them.
const SPEC_REREAD: Duration = Duration::from_secs(10);

/// How Allocate answers hand out GPUs (`deviceListStrategy` in the file).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Strategy {
    /// CDI device names (default).
    Cdi,
    /// `/dev/null` mounts under [`VOLUME_MOUNTS_DIR`].
    VolumeMounts,
    /// `NVIDIA_VISIBLE_DEVICES` only: insecure, an explicit opt-in.
    Envvar,
}

impl Strategy {
    /// Its name in the file: `cdi`, `volume-mounts`, `envvar`.
    pub fn name(self) -> &'static str {
        match self {
            Strategy::Cdi => "cdi",
            Strategy::VolumeMounts => "volume-mounts",
            Strategy::Envvar => "envvar",
        }
    }

    /// The strategy named `name`.
    pub fn parse(name: &str) -> Option<Self> {
        [Strategy::Cdi, Strategy::VolumeMounts, Strategy::Envvar]
            .into_iter()
            .find(|s| s.name() == name)
    }
}

/// The device-list settings of the node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceListConfig {
    /// How GPUs are handed out.
    pub strategy: Strategy,
    /// The CDI kind of the node's GPU devices.
    pub cdi_kind: String,
    /// Where the node's CDI spec files are (as mounted in the agent's container).
    pub cdi_spec_dirs: Vec<PathBuf>,
    /// The NVIDIA container toolkit's configuration (as mounted in the agent's container).
    pub toolkit_config: PathBuf,
}

impl Default for DeviceListConfig {
    fn default() -> Self {
        Self {
            strategy: Strategy::Cdi,
            cdi_kind: crate::defaults::CDI_KIND.to_owned(),
            cdi_spec_dirs: crate::defaults::CDI_SPEC_DIRS.iter().map(PathBuf::from).collect(),
            toolkit_config: PathBuf::from(crate::defaults::TOOLKIT_CONFIG),
        }
    }
}

/// The device names of one CDI kind in the node's spec files.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CdiSpecs {
    /// Device names (the part after `=`).
    pub names: BTreeSet<String>,
    /// The spec files that hold the kind.
    pub files: Vec<PathBuf>,
    /// Files or directories that could not be read, with why.
    pub problems: Vec<String>,
}

#[derive(Deserialize)]
struct SpecFile {
    kind: String,
    #[serde(default)]
    devices: Vec<SpecDevice>,
}

#[derive(Deserialize)]
struct SpecDevice {
    name: String,
}

/// A regular file's bytes, at most [`MAX_FILE_BYTES`] (`crate::files::read_bounded`: a FIFO, a
/// device or an endless file is refused, not read; links followed, as a mounted file's are):
/// `Ok(None)` when there is none.
fn read_bounded(path: &Path) -> Result<Option<Vec<u8>>, String> {
    crate::files::read_bounded(path, MAX_FILE_BYTES, crate::files::Links::Follow)
        .map_err(|e| e.to_string())
}

/// The devices of `kind` in the spec files (`*.yaml`, `*.yml`, `*.json`) of `dirs`. A missing
/// directory holds nothing; a file that cannot be read or parsed is a problem, not an error:
/// the others still count.
pub fn read_cdi_specs(dirs: &[PathBuf], kind: &str) -> CdiSpecs {
    let mut specs = CdiSpecs::default();
    for dir in dirs {
        let entries = match std::fs::read_dir(dir) {
            Ok(entries) => entries,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => {
                specs.problems.push(format!("{}: {e}", dir.display()));
                continue;
            }
        };
        let mut paths: Vec<PathBuf> = entries.flatten().map(|e| e.path()).collect();
        paths.sort();
        for path in paths {
            let spec_like = path
                .extension()
                .and_then(|e| e.to_str())
                .is_some_and(|e| matches!(e, "yaml" | "yml" | "json"));
            if !spec_like {
                continue;
            }
            let parsed = read_bounded(&path)
                .and_then(|bytes| bytes.ok_or_else(|| "no such file".to_owned()))
                .and_then(|bytes| {
                    // JSON is YAML: one parser for both forms.
                    serde_yaml_ng::from_slice::<SpecFile>(&bytes).map_err(|e| e.to_string())
                });
            match parsed {
                Ok(spec) if spec.kind == kind => {
                    specs.names.extend(spec.devices.into_iter().map(|d| d.name));
                    specs.files.push(path);
                }
                Ok(_) => {}
                Err(e) => specs.problems.push(format!("{}: {e}", path.display())),
            }
        }
    }
    specs
}

/// What the toolkit's configuration says about the two keys that matter here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ToolkitSettings {
    /// [`ENVVAR_KEY`] (the toolkit's default: true).
    pub envvar_when_unprivileged: bool,
    /// [`VOLUME_MOUNTS_KEY`] (the toolkit's default: false).
    pub volume_mounts: bool,
}

/// The toolkit's settings from its `config.toml`: `Ok(None)` when the file is not there (not
/// mounted into the agent's container), `Err` when it is there but unreadable or not TOML.
pub fn read_toolkit_config(path: &Path) -> Result<Option<ToolkitSettings>, String> {
    let bytes = match read_bounded(path) {
        Ok(Some(bytes)) => bytes,
        Ok(None) => return Ok(None),
        Err(e) => return Err(format!("{}: {e}", path.display())),
    };
    let text = String::from_utf8(bytes).map_err(|e| format!("{}: {e}", path.display()))?;
    let table: toml::Table = text.parse().map_err(|e| format!("{}: {e}", path.display()))?;
    let flag = |key: &str, default: bool| match table.get(key) {
        None => Ok(default),
        Some(toml::Value::Boolean(b)) => Ok(*b),
        Some(other) => Err(format!("{}: {key} is {other}, not true or false", path.display())),
    };
    Ok(Some(ToolkitSettings {
        envvar_when_unprivileged: flag(ENVVAR_KEY, true)?,
        volume_mounts: flag(VOLUME_MOUNTS_KEY, false)?,
    }))
}

/// What a check of the node's configuration found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CheckState {
    /// It holds.
    Ok,
    /// It does not: a container may reach GPUs it was not granted, or a grant may fail.
    Failed,
    /// The agent cannot tell (the file is not mounted into its container).
    Unknown,
}

impl CheckState {
    /// Its label value: `ok`, `failed`, `unknown`.
    pub fn name(self) -> &'static str {
        match self {
            CheckState::Ok => "ok",
            CheckState::Failed => "failed",
            CheckState::Unknown => "unknown",
        }
    }
}

/// One check of the node's device isolation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Check {
    /// `strategy`, `cdi-spec`, `toolkit-envvar`, `toolkit-volume-mounts`.
    pub name: &'static str,
    /// What it found.
    pub state: CheckState,
    /// Why, for the log.
    pub detail: String,
}

/// The node's device isolation as far as the agent can tell: the checks that apply to
/// `config`'s strategy, given the specs, the toolkit's settings and the device names the
/// answers will use (every GPU and MIG UUID of the node).
pub fn posture(
    config: &DeviceListConfig,
    specs: &CdiSpecs,
    toolkit: &Result<Option<ToolkitSettings>, String>,
    visible: &[String],
) -> Vec<Check> {
    let check = |name, state, detail: String| Check { name, state, detail };
    let mut checks = vec![match config.strategy {
        Strategy::Envvar => check(
            "strategy",
            CheckState::Failed,
            "deviceListStrategy envvar: answers name GPUs only in NVIDIA_VISIBLE_DEVICES, which works only where the toolkit honours it for every container, so any pod can name any GPU".into(),
        ),
        s => check("strategy", CheckState::Ok, format!("deviceListStrategy {}", s.name())),
    }];
    let missing: Vec<&String> = visible.iter().filter(|v| !specs.names.contains(*v)).collect();
    let cdi_complete = missing.is_empty() && !specs.files.is_empty();
    if config.strategy == Strategy::Cdi {
        let dirs: Vec<String> =
            config.cdi_spec_dirs.iter().map(|d| d.display().to_string()).collect();
        checks.push(if cdi_complete {
            check(
                "cdi-spec",
                CheckState::Ok,
                format!(
                    "{} names every GPU of the node ({} devices)",
                    join_paths(&specs.files),
                    visible.len()
                ),
            )
        } else if specs.files.is_empty() {
            check(
                "cdi-spec",
                CheckState::Failed,
                format!(
                    "no CDI spec of kind {} in {} (generate one: nvidia-ctk cdi generate --device-name-strategy=uuid); grants are answered with volume-mounts{}",
                    config.cdi_kind,
                    dirs.join(", "),
                    problems_text(specs)
                ),
            )
        } else {
            check(
                "cdi-spec",
                CheckState::Failed,
                format!(
                    "{} lacks {} of the node's {} devices ({}); their grants are answered with volume-mounts{}",
                    join_paths(&specs.files),
                    missing.len(),
                    visible.len(),
                    missing.iter().map(|s| s.as_str()).collect::<Vec<_>>().join(", "),
                    problems_text(specs)
                ),
            )
        });
    }
    let path = config.toolkit_config.display();
    // One check of the toolkit's configuration: `holds` says whether its key is set safely.
    let toolkit_check =
        |name, holds: fn(&ToolkitSettings) -> bool, ok, failed, unmounted| match toolkit {
            Ok(Some(t)) if holds(t) => check(name, CheckState::Ok, ok),
            Ok(Some(_)) => check(name, CheckState::Failed, failed),
            Ok(None) => check(name, CheckState::Unknown, unmounted),
            Err(e) => check(name, CheckState::Unknown, e.clone()),
        };
    checks.push(toolkit_check(
        "toolkit-envvar",
        |t| !t.envvar_when_unprivileged,
        format!("{path}: {ENVVAR_KEY} = false"),
        format!(
            "{path}: {ENVVAR_KEY} is true (the toolkit's default): any unprivileged container that sets NVIDIA_VISIBLE_DEVICES, as CUDA images do, sees every GPU of the node"
        ),
        format!(
            "{path} is not mounted into the agent's container; cannot tell whether the toolkit refuses NVIDIA_VISIBLE_DEVICES for unprivileged containers"
        ),
    ));
    let volume_mounts_used = config.strategy == Strategy::VolumeMounts
        || (config.strategy == Strategy::Cdi && !cdi_complete);
    if volume_mounts_used {
        checks.push(toolkit_check(
            "toolkit-volume-mounts",
            |t| t.volume_mounts,
            format!("{path}: {VOLUME_MOUNTS_KEY} = true"),
            format!(
                "{path}: {VOLUME_MOUNTS_KEY} is false: containers answered with volume-mounts get no GPU"
            ),
            format!("{path} is not mounted into the agent's container"),
        ));
    }
    checks
}

fn join_paths(paths: &[PathBuf]) -> String {
    paths.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ")
}

fn problems_text(specs: &CdiSpecs) -> String {
    if specs.problems.is_empty() {
        String::new()
    } else {
        format!("; unreadable: {}", specs.problems.join("; "))
    }
}

/// How one container is given its GPUs.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeviceAnswer {
    /// Environment variables.
    pub envs: Vec<(String, String)>,
    /// Mounts.
    pub mounts: Vec<BindMount>,
    /// Fully qualified CDI device names.
    pub cdi_devices: Vec<String>,
    /// Under CDI, the devices the spec lacked (the answer used volume-mounts instead).
    pub fell_back: Vec<String>,
}

/// Writes the device part of Allocate answers by the strategy, with the node's CDI specs
/// (read at start, and again, at most every 10 s, when a grant names a device they lack).
#[derive(Debug)]
pub struct DeviceLister {
    config: DeviceListConfig,
    specs: Mutex<(CdiSpecs, Instant)>,
}

impl DeviceLister {
    /// Reads the CDI specs now when the strategy is CDI.
    pub fn new(config: DeviceListConfig) -> Self {
        let specs = if config.strategy == Strategy::Cdi {
            read_cdi_specs(&config.cdi_spec_dirs, &config.cdi_kind)
        } else {
            CdiSpecs::default()
        };
        Self { config, specs: Mutex::new((specs, Instant::now())) }
    }

    /// The settings.
    pub fn config(&self) -> &DeviceListConfig {
        &self.config
    }

    /// The node's posture for answers naming `visible` (every GPU and MIG UUID), reading the
    /// specs and the toolkit's configuration again.
    pub fn posture(&self, visible: &[String]) -> Vec<Check> {
        let specs = if self.config.strategy == Strategy::Cdi {
            let fresh = read_cdi_specs(&self.config.cdi_spec_dirs, &self.config.cdi_kind);
            *self.lock() = (fresh.clone(), Instant::now());
            fresh
        } else {
            CdiSpecs::default()
        };
        posture(&self.config, &specs, &read_toolkit_config(&self.config.toolkit_config), visible)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, (CdiSpecs, Instant)> {
        self.specs.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The devices of `visible` the CDI specs lack, re-reading them (rate limited) first when
    /// some are missing.
    fn missing_from_specs(&self, visible: &[String]) -> Vec<String> {
        let mut specs = self.lock();
        let missing = |s: &CdiSpecs| -> Vec<String> {
            visible.iter().filter(|v| !s.names.contains(*v)).cloned().collect()
        };
        let gone = missing(&specs.0);
        if gone.is_empty() || specs.1.elapsed() < SPEC_REREAD {
            return gone;
        }
        *specs =
            (read_cdi_specs(&self.config.cdi_spec_dirs, &self.config.cdi_kind), Instant::now());
        missing(&specs.0)
    }

    /// How a container granted `visible` (GPU or MIG UUIDs) is given them.
    pub fn answer(&self, visible: &[String]) -> DeviceAnswer {
        let env = |v: String| vec![("NVIDIA_VISIBLE_DEVICES".to_owned(), v)];
        match self.config.strategy {
            Strategy::Envvar => DeviceAnswer { envs: env(visible.join(",")), ..Default::default() },
            Strategy::VolumeMounts => volume_mounts(visible, Vec::new()),
            Strategy::Cdi => {
                let missing = self.missing_from_specs(visible);
                if missing.is_empty() {
                    let kind = &self.config.cdi_kind;
                    DeviceAnswer {
                        envs: env("void".into()),
                        cdi_devices: visible.iter().map(|v| format!("{kind}={v}")).collect(),
                        ..Default::default()
                    }
                } else {
                    tracing::warn!(
                        devices = ?missing,
                        cdi.kind = self.config.cdi_kind,
                        "the node's CDI specs do not name these devices; this grant is answered with volume-mounts (generate the spec with nvidia-ctk cdi generate --device-name-strategy=uuid)"
                    );
                    volume_mounts(visible, missing)
                }
            }
        }
    }
}

fn volume_mounts(visible: &[String], fell_back: Vec<String>) -> DeviceAnswer {
    DeviceAnswer {
        envs: vec![("NVIDIA_VISIBLE_DEVICES".to_owned(), VOLUME_MOUNTS_DIR.to_owned())],
        mounts: visible
            .iter()
            .map(|v| BindMount {
                host: PathBuf::from("/dev/null"),
                container: Path::new(VOLUME_MOUNTS_DIR).join(v),
                read_only: true,
            })
            .collect(),
        cdi_devices: Vec::new(),
        fell_back,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GPU_A: &str = "GPU-11111111-2222-3333-4444-555555555555";
    const GPU_B: &str = "GPU-66666666-7777-8888-9999-000000000000";

    fn spec(dir: &Path, file: &str, kind: &str, names: &[&str]) {
        let devices: Vec<String> = names
            .iter()
            .map(|n| format!("  - name: \"{n}\"\n    containerEdits:\n      deviceNodes:\n        - path: /dev/nvidia0\n"))
            .collect();
        let text = format!("cdiVersion: 0.5.0\nkind: {kind}\ndevices:\n{}", devices.concat());
        std::fs::write(dir.join(file), text).expect("spec");
    }

    fn config(dir: &Path, strategy: Strategy) -> DeviceListConfig {
        DeviceListConfig {
            strategy,
            cdi_kind: "nvidia.com/gpu".into(),
            cdi_spec_dirs: vec![dir.join("etc-cdi"), dir.join("run-cdi")],
            toolkit_config: dir.join("config.toml"),
        }
    }

    #[test]
    fn cdi_names_are_answered_when_the_spec_holds_every_uuid() {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::create_dir_all(dir.path().join("run-cdi")).expect("dir");
        spec(&dir.path().join("run-cdi"), "nvidia.yaml", "nvidia.com/gpu", &["0", GPU_A, "all"]);
        let lister = DeviceLister::new(config(dir.path(), Strategy::Cdi));
        let a = lister.answer(&[GPU_A.to_owned()]);
        assert_eq!(a.cdi_devices, [format!("nvidia.com/gpu={GPU_A}")]);
        assert!(a.mounts.is_empty() && a.fell_back.is_empty());
        assert_eq!(a.envs, [("NVIDIA_VISIBLE_DEVICES".to_owned(), "void".to_owned())]);
    }

    #[test]
    fn a_uuid_the_spec_lacks_falls_back_to_volume_mounts_and_is_counted() {
        // nvidia-ctk's index-only naming (the spec holds "0" and "all", no UUID).
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::create_dir_all(dir.path().join("etc-cdi")).expect("dir");
        spec(&dir.path().join("etc-cdi"), "nvidia.json", "nvidia.com/gpu", &["0", GPU_A]);
        let lister = DeviceLister::new(config(dir.path(), Strategy::Cdi));
        let a = lister.answer(&[GPU_A.to_owned(), GPU_B.to_owned()]);
        assert!(a.cdi_devices.is_empty(), "never a name the runtime cannot resolve");
        assert_eq!(a.fell_back, [GPU_B]);
        assert_eq!(
            a.mounts.iter().map(|m| m.container.display().to_string()).collect::<Vec<_>>(),
            [format!("{VOLUME_MOUNTS_DIR}/{GPU_A}"), format!("{VOLUME_MOUNTS_DIR}/{GPU_B}")]
        );
        assert!(a.mounts.iter().all(|m| m.read_only && m.host == Path::new("/dev/null")));
    }

    #[test]
    fn the_specs_are_read_from_every_directory_and_only_of_the_kind() {
        let dir = tempfile::tempdir().expect("tempdir");
        for d in ["etc-cdi", "run-cdi"] {
            std::fs::create_dir_all(dir.path().join(d)).expect("dir");
        }
        spec(&dir.path().join("etc-cdi"), "a.yaml", "nvidia.com/gpu", &[GPU_A]);
        spec(&dir.path().join("run-cdi"), "b.yml", "nvidia.com/gpu", &[GPU_B]);
        spec(&dir.path().join("run-cdi"), "c.yaml", "example.com/nic", &["GPU-x"]);
        std::fs::write(dir.path().join("run-cdi/notes.txt"), "not a spec").expect("txt");
        std::fs::write(dir.path().join("run-cdi/broken.yaml"), "kind: [").expect("broken");
        let specs =
            read_cdi_specs(&config(dir.path(), Strategy::Cdi).cdi_spec_dirs, "nvidia.com/gpu");
        assert_eq!(specs.names, BTreeSet::from([GPU_A.to_owned(), GPU_B.to_owned()]));
        assert_eq!(specs.files.len(), 2);
        assert_eq!(specs.problems.len(), 1, "{:?}", specs.problems);
        assert!(specs.problems[0].contains("broken.yaml"));
    }

    #[test]
    fn hostile_spec_files_are_refused_not_read() {
        // A FIFO would block a reader forever; /dev/zero never ends.
        let dir = tempfile::tempdir().expect("tempdir");
        let cdi = dir.path().join("etc-cdi");
        std::fs::create_dir_all(&cdi).expect("dir");
        let made = std::process::Command::new("mkfifo").arg(cdi.join("fifo.yaml")).status();
        assert!(made.expect("mkfifo (coreutils)").success(), "mkfifo");
        std::os::unix::fs::symlink("/dev/zero", cdi.join("zero.yaml")).expect("symlink");
        let huge = std::fs::File::create(cdi.join("huge.yaml")).expect("file");
        huge.set_len(MAX_FILE_BYTES + 1).expect("sparse");
        let specs = read_cdi_specs(&[cdi], "nvidia.com/gpu");
        assert_eq!(specs.problems.len(), 3, "{:?}", specs.problems);
        assert!(specs.names.is_empty());
    }

    #[test]
    fn volume_mounts_and_envvar_answer_what_they_say() {
        let dir = tempfile::tempdir().expect("tempdir");
        let ids = [GPU_A.to_owned(), GPU_B.to_owned()];
        let v = DeviceLister::new(config(dir.path(), Strategy::VolumeMounts)).answer(&ids);
        assert_eq!(v.envs, [("NVIDIA_VISIBLE_DEVICES".to_owned(), VOLUME_MOUNTS_DIR.to_owned())]);
        assert_eq!(v.mounts.len(), 2);
        assert!(v.cdi_devices.is_empty() && v.fell_back.is_empty());
        let e = DeviceLister::new(config(dir.path(), Strategy::Envvar)).answer(&ids);
        assert_eq!(e.envs, [("NVIDIA_VISIBLE_DEVICES".to_owned(), format!("{GPU_A},{GPU_B}"))]);
        assert!(e.mounts.is_empty() && e.cdi_devices.is_empty());
    }

    #[test]
    fn the_toolkit_configuration_is_read_for_the_two_keys() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("config.toml");
        assert_eq!(read_toolkit_config(&path), Ok(None), "not mounted");
        std::fs::write(
            &path,
            "disable-require = false\n[nvidia-container-cli]\nldconfig = \"@/sbin/ldconfig\"\n",
        )
        .expect("toml");
        assert_eq!(
            read_toolkit_config(&path),
            Ok(Some(ToolkitSettings { envvar_when_unprivileged: true, volume_mounts: false })),
            "the toolkit's defaults"
        );
        std::fs::write(&path, format!("{ENVVAR_KEY} = false\n{VOLUME_MOUNTS_KEY} = true\n"))
            .expect("toml");
        assert_eq!(
            read_toolkit_config(&path),
            Ok(Some(ToolkitSettings { envvar_when_unprivileged: false, volume_mounts: true }))
        );
        std::fs::write(&path, format!("{ENVVAR_KEY} = \"no\"\n")).expect("toml");
        assert!(read_toolkit_config(&path).is_err_and(|e| e.contains(ENVVAR_KEY)));
        std::fs::write(&path, "[[[").expect("toml");
        assert!(read_toolkit_config(&path).is_err());
    }

    #[test]
    fn the_posture_names_what_fails() {
        let dir = tempfile::tempdir().expect("tempdir");
        let ids = [GPU_A.to_owned(), GPU_B.to_owned()];
        let state =
            |checks: &[Check], name: &str| checks.iter().find(|c| c.name == name).map(|c| c.state);
        let cdi = config(dir.path(), Strategy::Cdi);
        let safe_toolkit =
            Ok(Some(ToolkitSettings { envvar_when_unprivileged: false, volume_mounts: true }));
        let full = CdiSpecs {
            names: ids.iter().cloned().collect(),
            files: vec!["/etc/cdi/nvidia.yaml".into()],
            problems: vec![],
        };
        let checks = posture(&cdi, &full, &safe_toolkit, &ids);
        assert!(checks.iter().all(|c| c.state == CheckState::Ok), "{checks:?}");
        assert_eq!(state(&checks, "toolkit-volume-mounts"), None, "no fallback, no need");
        let partial = CdiSpecs { names: [GPU_A.to_owned()].into(), ..full.clone() };
        let checks = posture(&cdi, &partial, &Ok(None), &ids);
        assert_eq!(state(&checks, "cdi-spec"), Some(CheckState::Failed));
        assert!(checks[1].detail.contains(GPU_B), "{}", checks[1].detail);
        assert_eq!(state(&checks, "toolkit-envvar"), Some(CheckState::Unknown));
        assert_eq!(state(&checks, "toolkit-volume-mounts"), Some(CheckState::Unknown));
        let unsafe_toolkit =
            Ok(Some(ToolkitSettings { envvar_when_unprivileged: true, volume_mounts: false }));
        let checks = posture(&config(dir.path(), Strategy::Envvar), &full, &unsafe_toolkit, &ids);
        assert_eq!(state(&checks, "strategy"), Some(CheckState::Failed));
        assert_eq!(state(&checks, "toolkit-envvar"), Some(CheckState::Failed));
        assert_eq!(state(&checks, "cdi-spec"), None);
        let checks =
            posture(&config(dir.path(), Strategy::VolumeMounts), &full, &unsafe_toolkit, &ids);
        assert_eq!(state(&checks, "toolkit-volume-mounts"), Some(CheckState::Failed));
    }
}
