//! Compiles the project's own `.proto` files with protox (pure Rust, no system `protoc`) and
//! generates the prost messages and tonic clients and servers. The encoded descriptor set is
//! written next to the generated code so tests can compare it with the upstream files.

use prost::Message as _;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let files = [
        "proto/deviceplugin_v1beta1.proto",
        "proto/podresources_v1.proto",
        "proto/pluginregistration_v1.proto",
        "proto/dra_v1.proto",
        "proto/dra_v1beta1.proto",
        // Package `v1`, as pod-resources: generated into the same `v1` module.
        "proto/dra_health_v1.proto",
    ];
    for file in files {
        println!("cargo:rerun-if-changed={file}");
    }
    let fds = protox::compile(files, ["proto"])?;
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR")?);
    std::fs::write(out.join("baleen_descriptors.bin"), fds.encode_to_vec())?;
    tonic_prost_build::configure().build_client(true).build_server(true).compile_fds(fds)?;
    Ok(())
}
