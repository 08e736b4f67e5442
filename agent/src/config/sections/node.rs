//! The node's name and resource domain (`nodeName`, `domain` at the top of the file).

use super::{Sources, place};
use crate::defaults;
use crate::yaml::{Problems, Seg};

/// The node name: `--node-name` < `NODE_NAME` < `nodeName` < (outside a pod) the host name.
pub(in crate::config) fn name(src: &Sources<'_>, problems: &mut Problems) -> String {
    let (args, env, file) = (src.args, src.env, src.file);
    let given = args.node_name.clone().or(env.node_name.clone());
    let from_file = given.is_none() && file.node_name.is_some();
    let name = given.or(file.node_name.clone());
    // Inside a pod the host name is the pod's: every new pod would distrust the checkpoint.
    let name = if env.in_pod { name } else { name.or_else(host_name) };
    let at = place(!from_file, &[Seg::Key("nodeName")]).to_vec();
    match name {
        Some(name) if !name.trim().is_empty() => name,
        Some(_) => {
            problems.add(&at, "the node name is empty: set --node-name, NODE_NAME or nodeName");
            String::new()
        }
        None if env.in_pod => {
            problems.general(
                "no node name: in a pod, set NODE_NAME from the downward API (spec.nodeName)",
            );
            String::new()
        }
        None => {
            problems.general("no node name: set --node-name, NODE_NAME or nodeName");
            String::new()
        }
    }
}

/// The resource domain (`--domain` < `domain`): it must make valid resource names.
pub(in crate::config) fn domain(src: &Sources<'_>, problems: &mut Problems) -> String {
    let domain = src
        .args
        .domain
        .clone()
        .or(src.file.domain.clone())
        .unwrap_or_else(|| defaults::DOMAIN.into());
    if let Err(e) = baleen_device_plugin::resource_name::validate(&format!("{domain}/gpu")) {
        problems.add(
            place(src.args.domain.is_some(), &[Seg::Key("domain")]),
            format!("domain {domain:?} does not make valid resource names: {e}"),
        );
    }
    domain
}

fn host_name() -> Option<String> {
    std::fs::read_to_string(defaults::HOST_NAME_FILE)
        .ok()
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty())
}
