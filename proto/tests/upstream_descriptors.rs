//! The project's `.proto` files are the wire contract with the kubelet: this test compiles the
//! upstream definitions in `../shared/proto-upstream/` with protox and compares them, field by
//! field, with the descriptors this crate was built from.

use std::path::PathBuf;

use prost::Message as _;
use prost_types::{DescriptorProto, FileDescriptorProto, FileDescriptorSet};

fn upstream_dir() -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/proto-upstream");
    assert!(
        dir.is_dir(),
        "the upstream proto files are expected in {} (the project's shared data, beside the \
         repository); check out ../shared",
        dir.display()
    );
    dir
}

fn ours() -> FileDescriptorSet {
    FileDescriptorSet::decode(baleen_proto::FILE_DESCRIPTOR_SET)
        .expect("embedded descriptors decode")
}

fn upstream(file: &str) -> FileDescriptorProto {
    let dir = upstream_dir();
    let set = protox::compile([file], [&dir]).expect("upstream proto compiles");
    set.file.into_iter().find(|f| f.name() == file).expect("compiled set holds the requested file")
}

fn our_file(package: &str) -> FileDescriptorProto {
    // Two of our files are package `v1` (pod-resources and DRA health), as upstream's are.
    let name = match package {
        "v1" => Some("podresources_v1.proto"),
        "dra-health" => Some("dra_health_v1.proto"),
        _ => None,
    };
    ours()
        .file
        .into_iter()
        .find(|f| name.map_or(f.package() == package, |n| f.name() == n))
        .unwrap_or_else(|| panic!("no compiled file with package {package}"))
}

/// Every difference on the wire between two files: package, services and methods, messages
/// (nested ones too) and their fields, enums. Comments, options and file names do not count.
fn differences(ours: &FileDescriptorProto, theirs: &FileDescriptorProto) -> Vec<String> {
    let mut out = Vec::new();
    if ours.package() != theirs.package() {
        out.push(format!("package {:?} != {:?}", ours.package(), theirs.package()));
    }
    let names = |v: Vec<&str>| v.into_iter().map(str::to_owned).collect::<Vec<_>>();
    let our_services = names(ours.service.iter().map(|s| s.name()).collect());
    let their_services = names(theirs.service.iter().map(|s| s.name()).collect());
    if our_services != their_services {
        out.push(format!("services {our_services:?} != {their_services:?}"));
    }
    for theirs_svc in &theirs.service {
        let Some(ours_svc) = ours.service.iter().find(|s| s.name() == theirs_svc.name()) else {
            continue;
        };
        if ours_svc.method.len() != theirs_svc.method.len() {
            out.push(format!(
                "service {}: {} methods != {}",
                theirs_svc.name(),
                ours_svc.method.len(),
                theirs_svc.method.len()
            ));
        }
        for tm in &theirs_svc.method {
            match ours_svc.method.iter().find(|m| m.name() == tm.name()) {
                None => out.push(format!("method {}.{} missing", theirs_svc.name(), tm.name())),
                Some(om) => {
                    let sig = |m: &prost_types::MethodDescriptorProto| {
                        (
                            m.input_type().to_owned(),
                            m.output_type().to_owned(),
                            m.client_streaming(),
                            m.server_streaming(),
                        )
                    };
                    if sig(om) != sig(tm) {
                        out.push(format!(
                            "method {}.{}: {:?} != {:?}",
                            theirs_svc.name(),
                            tm.name(),
                            sig(om),
                            sig(tm)
                        ));
                    }
                }
            }
        }
    }
    compare_messages("", &ours.message_type, &theirs.message_type, &mut out);
    let enums = |f: &FileDescriptorProto| {
        f.enum_type
            .iter()
            .map(|e| {
                let values: Vec<_> =
                    e.value.iter().map(|v| (v.name().to_owned(), v.number())).collect();
                (e.name().to_owned(), values)
            })
            .collect::<Vec<_>>()
    };
    if enums(ours) != enums(theirs) {
        out.push(format!("enums {:?} != {:?}", enums(ours), enums(theirs)));
    }
    out
}

fn compare_messages(
    scope: &str,
    ours: &[DescriptorProto],
    theirs: &[DescriptorProto],
    out: &mut Vec<String>,
) {
    let mut our_names: Vec<_> = ours.iter().map(|m| m.name()).collect();
    let mut their_names: Vec<_> = theirs.iter().map(|m| m.name()).collect();
    our_names.sort_unstable();
    their_names.sort_unstable();
    if our_names != their_names {
        out.push(format!("messages in {scope:?}: {our_names:?} != {their_names:?}"));
    }
    for tm in theirs {
        let Some(om) = ours.iter().find(|m| m.name() == tm.name()) else {
            continue;
        };
        let name = format!("{scope}.{}", tm.name());
        let field_key = |f: &prost_types::FieldDescriptorProto| {
            (
                f.number(),
                f.name().to_owned(),
                f.json_name().to_owned(),
                f.r#type(),
                f.label(),
                f.type_name().to_owned(),
                f.proto3_optional(),
                f.oneof_index,
            )
        };
        let mut of: Vec<_> = om.field.iter().map(field_key).collect();
        let mut tf: Vec<_> = tm.field.iter().map(field_key).collect();
        of.sort();
        tf.sort();
        if of != tf {
            for f in tf.iter().filter(|f| !of.contains(f)) {
                out.push(format!("{name}: upstream field {f:?} missing or different"));
            }
            for f in of.iter().filter(|f| !tf.contains(f)) {
                out.push(format!("{name}: our field {f:?} is not upstream"));
            }
        }
        let oneofs = |m: &DescriptorProto| {
            m.oneof_decl.iter().map(|o| o.name().to_owned()).collect::<Vec<_>>()
        };
        if oneofs(om) != oneofs(tm) {
            out.push(format!("{name}: oneofs {:?} != {:?}", oneofs(om), oneofs(tm)));
        }
        let map_entry = |m: &DescriptorProto| m.options.as_ref().and_then(|o| o.map_entry);
        if map_entry(om) != map_entry(tm) {
            out.push(format!("{name}: map_entry differs"));
        }
        compare_messages(&name, &om.nested_type, &tm.nested_type, out);
    }
}

#[test]
fn device_plugin_v1beta1_matches_upstream() {
    let diffs = differences(&our_file("v1beta1"), &upstream("deviceplugin_v1beta1.proto"));
    assert!(diffs.is_empty(), "device-plugin API drifted from upstream:\n{}", diffs.join("\n"));
}

#[test]
fn plugin_registration_v1_matches_upstream() {
    let diffs =
        differences(&our_file("pluginregistration"), &upstream("pluginregistration_v1.proto"));
    assert!(
        diffs.is_empty(),
        "plugin-registration API drifted from upstream:\n{}",
        diffs.join("\n")
    );
}

#[test]
fn pod_resources_v1_matches_upstream_master() {
    let diffs = differences(&our_file("v1"), &upstream("podresources_v1.proto"));
    assert!(diffs.is_empty(), "pod-resources API drifted from upstream:\n{}", diffs.join("\n"));
}

#[test]
fn pod_resources_v1_differs_from_the_1_36_release_only_by_the_pod_level_fields() {
    let diffs = differences(&our_file("v1"), &upstream("podresources_v1.at-v0.36.3.proto"));
    assert_eq!(diffs.len(), 2, "unexpected differences:\n{}", diffs.join("\n"));
    assert!(
        diffs.iter().all(|d| d.starts_with(".PodResources: our field")),
        "only PodResources' pod-level cpu_ids and memory should differ:\n{}",
        diffs.join("\n")
    );
}

#[test]
fn the_comparison_notices_a_renumbered_field_and_a_missing_method() {
    let theirs = upstream("deviceplugin_v1beta1.proto");
    let mut changed = our_file("v1beta1");
    let device =
        changed.message_type.iter_mut().find(|m| m.name() == "Device").expect("Device message");
    device.field[1].number = Some(7);
    changed.service[1].method.pop();
    let diffs = differences(&changed, &theirs);
    assert!(diffs.iter().any(|d| d.contains(".Device")), "{diffs:?}");
    assert!(diffs.iter().any(|d| d.contains("DevicePlugin")), "{diffs:?}");
}

#[test]
fn grpc_method_paths_are_the_kubelets() {
    // The generated clients and servers route by these paths; check them from the descriptors.
    let ours = ours();
    let mut paths = Vec::new();
    for file in &ours.file {
        for svc in &file.service {
            for m in &svc.method {
                paths.push(format!("/{}.{}/{}", file.package(), svc.name(), m.name()));
            }
        }
    }
    paths.sort();
    let mut expected = [
        baleen_proto::pluginregistration::v1::GET_INFO_PATH,
        baleen_proto::pluginregistration::v1::NOTIFY_PATH,
        "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources",
        "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodeUnprepareResources",
        "/k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin/NodePrepareResources",
        "/k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin/NodeUnprepareResources",
        "/v1.DRAResourceHealth/NodeWatchResources",
        "/v1.PodResourcesLister/Get",
        "/v1.PodResourcesLister/GetAllocatableResources",
        "/v1.PodResourcesLister/List",
        "/v1beta1.DevicePlugin/Allocate",
        "/v1beta1.DevicePlugin/GetDevicePluginOptions",
        "/v1beta1.DevicePlugin/GetPreferredAllocation",
        "/v1beta1.DevicePlugin/ListAndWatch",
        "/v1beta1.DevicePlugin/PreStartContainer",
        "/v1beta1.Registration/Register",
    ];
    expected.sort_unstable();
    assert_eq!(paths, expected);
}

/// A file's wire shape in one line per item: each method with its types and streaming, each
/// field with its number, type, label and proto3 optionality (map fields by their entry type).
fn shape(file: &FileDescriptorProto) -> Vec<String> {
    let mut out = vec![format!("package {}", file.package())];
    for svc in &file.service {
        for m in &svc.method {
            out.push(format!(
                "rpc {}.{}({}{}) -> {}{}",
                svc.name(),
                m.name(),
                if m.client_streaming() { "stream " } else { "" },
                m.input_type(),
                if m.server_streaming() { "stream " } else { "" },
                m.output_type()
            ));
        }
    }
    fn messages(scope: &str, ms: &[DescriptorProto], out: &mut Vec<String>) {
        for m in ms {
            let name = format!("{scope}{}", m.name());
            for f in &m.field {
                let ty = if f.type_name().is_empty() {
                    format!("{:?}", f.r#type()).to_lowercase()
                } else {
                    f.type_name().to_owned()
                };
                out.push(format!(
                    "{name}.{}={} {ty} {:?}{}",
                    f.name(),
                    f.number(),
                    f.label(),
                    if f.proto3_optional() { " optional" } else { "" }
                ));
            }
            messages(&format!("{name}."), &m.nested_type, out);
        }
    }
    messages("", &file.message_type, &mut out);
    out.sort();
    out
}

/// The DRA plugin API as kubernetes/kubelet defines it at commit 63b3249724f7
/// (pkg/apis/dra/v1/api.proto; v1beta1/api.proto is the same but for its package and for
/// `Device.share_id`, which v1 added). Transcribed field by field: ../shared/proto-upstream has
/// no copy of these files yet.
fn dra_upstream_shape(version: &str) -> Vec<String> {
    let p = format!(".k8s.io.kubelet.pkg.apis.dra.{version}");
    let mut v = vec![
        format!("package k8s.io.kubelet.pkg.apis.dra.{version}"),
        format!(
            "rpc DRAPlugin.NodePrepareResources({p}.NodePrepareResourcesRequest) -> \
             {p}.NodePrepareResourcesResponse"
        ),
        format!(
            "rpc DRAPlugin.NodeUnprepareResources({p}.NodeUnprepareResourcesRequest) -> \
             {p}.NodeUnprepareResourcesResponse"
        ),
        format!("NodePrepareResourcesRequest.claims=1 {p}.Claim Repeated"),
        format!(
            "NodePrepareResourcesResponse.claims=1 {p}.NodePrepareResourcesResponse.ClaimsEntry \
             Repeated"
        ),
        "NodePrepareResourcesResponse.ClaimsEntry.key=1 string Optional".to_owned(),
        format!(
            "NodePrepareResourcesResponse.ClaimsEntry.value=2 {p}.NodePrepareResourceResponse \
             Optional"
        ),
        format!("NodePrepareResourceResponse.devices=1 {p}.Device Repeated"),
        "NodePrepareResourceResponse.error=2 string Optional".to_owned(),
        "Device.request_names=1 string Repeated".to_owned(),
        "Device.pool_name=2 string Optional".to_owned(),
        "Device.device_name=3 string Optional".to_owned(),
        "Device.cdi_device_ids=4 string Repeated".to_owned(),
        format!("NodeUnprepareResourcesRequest.claims=1 {p}.Claim Repeated"),
        format!(
            "NodeUnprepareResourcesResponse.claims=1 \
             {p}.NodeUnprepareResourcesResponse.ClaimsEntry Repeated"
        ),
        "NodeUnprepareResourcesResponse.ClaimsEntry.key=1 string Optional".to_owned(),
        format!(
            "NodeUnprepareResourcesResponse.ClaimsEntry.value=2 \
             {p}.NodeUnprepareResourceResponse Optional"
        ),
        "NodeUnprepareResourceResponse.error=1 string Optional".to_owned(),
        "Claim.namespace=1 string Optional".to_owned(),
        "Claim.uid=2 string Optional".to_owned(),
        "Claim.name=3 string Optional".to_owned(),
    ];
    if version == "v1" {
        v.push("Device.share_id=5 string Optional optional".to_owned());
    }
    v.sort();
    v
}

#[test]
fn dra_v1_and_v1beta1_have_the_kubelets_shape() {
    for version in ["v1", "v1beta1"] {
        let ours = shape(&our_file(&format!("k8s.io.kubelet.pkg.apis.dra.{version}")));
        let theirs = dra_upstream_shape(version);
        let missing: Vec<_> = theirs.iter().filter(|l| !ours.contains(l)).collect();
        let extra: Vec<_> = ours.iter().filter(|l| !theirs.contains(l)).collect();
        assert!(
            missing.is_empty() && extra.is_empty(),
            "DRA {version} drifted from the kubelet's: missing {missing:#?}, not upstream {extra:#?}"
        );
    }
}

#[test]
fn the_shape_notices_a_renumbered_dra_field() {
    let mut changed = our_file("k8s.io.kubelet.pkg.apis.dra.v1");
    let claim = changed.message_type.iter_mut().find(|m| m.name() == "Claim").expect("Claim");
    claim.field[1].number = Some(9);
    assert_ne!(shape(&changed), dra_upstream_shape("v1"));
}

#[test]
fn dra_health_v1_has_the_kubelets_shape() {
    // kubernetes/kubelet pkg/apis/dra-health/v1/api.proto at commit 63b3249724f7.
    let mut theirs = vec![
        "package v1".to_owned(),
        "rpc DRAResourceHealth.NodeWatchResources(.v1.NodeWatchResourcesRequest) -> stream \
         .v1.NodeWatchResourcesResponse"
            .to_owned(),
        "DeviceIdentifier.pool_name=1 string Optional".to_owned(),
        "DeviceIdentifier.device_name=2 string Optional".to_owned(),
        "DeviceHealth.device=1 .v1.DeviceIdentifier Optional".to_owned(),
        "DeviceHealth.health=2 .v1.HealthStatus Optional".to_owned(),
        "DeviceHealth.last_updated_time=3 int64 Optional".to_owned(),
        "DeviceHealth.health_check_timeout_seconds=4 int64 Optional".to_owned(),
        "DeviceHealth.message=5 string Optional".to_owned(),
        "NodeWatchResourcesResponse.devices=1 .v1.DeviceHealth Repeated".to_owned(),
    ];
    theirs.sort();
    let file = our_file("dra-health");
    assert_eq!(shape(&file), theirs);
    let values: Vec<(String, i32)> =
        file.enum_type[0].value.iter().map(|v| (v.name().to_owned(), v.number())).collect();
    assert_eq!(
        values,
        [("UNKNOWN".to_owned(), 0), ("HEALTHY".to_owned(), 1), ("UNHEALTHY".to_owned(), 2)]
    );
}
