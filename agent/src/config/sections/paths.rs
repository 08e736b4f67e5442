//! The host paths (`paths:`): each from its flag, else the file, else the default.

use std::path::PathBuf;

use serde::Deserialize;

use super::{Sources, place};
use crate::defaults;
use crate::yaml::{Problems, Seg};

/// `paths:` in the file.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PathsFile {
    /// The kubelet's device-plugin directory.
    pub device_plugin_dir: Option<PathBuf>,
    /// The kubelet's pod-resources socket.
    pub pod_resources_socket: Option<PathBuf>,
    /// Where the checkpoint lives.
    pub state_dir: Option<PathBuf>,
    /// Where the MPS daemons' directories live.
    pub mps_root: Option<PathBuf>,
    /// The kernel boot ID file.
    pub boot_id_file: Option<PathBuf>,
    /// Where the host's `/proc` is (the memory watchdog reads processes there).
    pub proc_root: Option<PathBuf>,
    /// The NVIDIA container toolkit's settings.
    pub toolkit_config: Option<PathBuf>,
    /// A kubeconfig whose credentials read the pods of the node (the kubelet's own, e.g.
    /// `/etc/kubernetes/kubelet.conf`): the agent's account then reads no pod (docs/agent.md,
    /// "What an agent's token can read").
    pub pods_kubeconfig: Option<PathBuf>,
}

/// The host paths, resolved.
pub(in crate::config) struct Paths {
    pub(in crate::config) device_plugin_dir: PathBuf,
    pub(in crate::config) pod_resources_socket: PathBuf,
    pub(in crate::config) state_dir: PathBuf,
    pub(in crate::config) boot_id_file: PathBuf,
    pub(in crate::config) mps_root: PathBuf,
    pub(in crate::config) proc_root: PathBuf,
    pub(in crate::config) pods_kubeconfig: Option<PathBuf>,
}

/// Flag < file < default, per path. A directory setting that names something other than a
/// directory (a file, say) is a problem at its key: the agent would fail on it later, with a
/// less clear error.
pub(in crate::config) fn resolve(src: &Sources<'_>, problems: &mut Problems) -> Paths {
    let (args, paths) = (src.args, &src.file.paths);
    let pick = |flag: &Option<PathBuf>, file: &Option<PathBuf>, default: &str| {
        flag.clone().or(file.clone()).unwrap_or_else(|| PathBuf::from(default))
    };
    let resolved = Paths {
        device_plugin_dir: pick(
            &args.device_plugin_dir,
            &paths.device_plugin_dir,
            defaults::DEVICE_PLUGIN_DIR,
        ),
        pod_resources_socket: pick(
            &args.pod_resources_socket,
            &paths.pod_resources_socket,
            defaults::POD_RESOURCES_SOCKET,
        ),
        state_dir: pick(&args.state_dir, &paths.state_dir, defaults::STATE_DIR),
        boot_id_file: pick(&args.boot_id_file, &paths.boot_id_file, defaults::BOOT_ID_FILE),
        mps_root: pick(&args.mps_root, &paths.mps_root, defaults::MPS_ROOT),
        proc_root: pick(&None, &paths.proc_root, defaults::PROC_ROOT),
        pods_kubeconfig: paths.pods_kubeconfig.clone(),
    };
    if let Some(file) = &resolved.pods_kubeconfig
        && file.exists()
        && !file.is_file()
    {
        problems.add(
            place(false, &[Seg::Key("paths"), Seg::Key("podsKubeconfig")]),
            format!(
                "paths.podsKubeconfig {} is not a file: the pods of the node are read with its credentials, and there are none",
                file.display()
            ),
        );
    }
    for (dir, flag, key) in [
        (&resolved.state_dir, args.state_dir.is_some(), "stateDir"),
        (&resolved.device_plugin_dir, args.device_plugin_dir.is_some(), "devicePluginDir"),
        (&resolved.mps_root, args.mps_root.is_some(), "mpsRoot"),
    ] {
        if dir.exists() && !dir.is_dir() {
            problems.add(
                place(flag, &[Seg::Key("paths"), Seg::Key(key)]),
                format!("paths.{key} {} is not a directory", dir.display()),
            );
        }
    }
    resolved
}
