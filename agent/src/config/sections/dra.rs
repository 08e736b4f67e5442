//! Which kubelet API the agent serves (`driver:`), and the DRA mode's settings (`dra:`).

use std::path::PathBuf;

use serde::Deserialize;

use super::Sources;
use crate::dra::{DraConfig, DriverMode};
use crate::yaml::{Problems, Seg};

/// `dra:` in the file.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DraFile {
    /// The DRA driver's name (default `gpu.<domain>`).
    pub driver_name: Option<String>,
    /// The kubelet's plugin-registration directory.
    pub registry_dir: Option<PathBuf>,
    /// The directory of the driver's service socket (default `/var/lib/kubelet/plugins/<driver>`).
    pub plugin_dir: Option<PathBuf>,
    /// Where CDI specs of prepared claims go (default `/var/run/cdi`).
    pub cdi_dir: Option<PathBuf>,
}

/// Whether `name` is a DNS subdomain of at most 63 characters, as a DRA driver's name must be.
fn is_driver_name(name: &str) -> bool {
    name.len() <= 63 && name.split('.').all(baleen_dra::slices::is_dns_label) && name.contains('.')
}

/// `driver: device-plugin` (default) or `driver: dra`, with `dra:` resolved for the latter.
pub(in crate::config) fn resolve(
    src: &Sources<'_>,
    domain: &str,
    problems: &mut Problems,
) -> DriverMode {
    let file = &src.file.dra;
    let mode = src.file.driver.as_deref().unwrap_or("device-plugin");
    match mode {
        "device-plugin" => DriverMode::DevicePlugin,
        "dra" => {
            let name = file.driver_name.clone().unwrap_or_else(|| format!("gpu.{domain}"));
            if !is_driver_name(&name) {
                problems.add(
                    &[Seg::Key("dra"), Seg::Key("driverName")],
                    format!(
                        "dra.driverName {name:?} is not a DNS subdomain of at most 63 characters \
                         (lowercase labels joined by dots, e.g. gpu.example.com)"
                    ),
                );
            }
            let mut config = DraConfig::new(&name);
            let absolute =
                |problems: &mut Problems, key: &'static str, path: &Option<PathBuf>| match path {
                    Some(p) if p.is_absolute() => Some(p.clone()),
                    Some(p) => {
                        problems.add(
                            &[Seg::Key("dra"), Seg::Key(key)],
                            format!("dra.{key} {} must be an absolute path", p.display()),
                        );
                        None
                    }
                    None => None,
                };
            if let Some(p) = absolute(problems, "registryDir", &file.registry_dir) {
                config.registry_dir = p;
            }
            if let Some(p) = absolute(problems, "pluginDir", &file.plugin_dir) {
                config.plugin_dir = p;
            }
            if let Some(p) = absolute(problems, "cdiDir", &file.cdi_dir) {
                config.cdi_dir = p;
            }
            DriverMode::Dra(config)
        }
        other => {
            problems.add(
                &[Seg::Key("driver")],
                format!("driver {other:?} is not one of device-plugin (the default), dra"),
            );
            DriverMode::DevicePlugin
        }
    }
}
