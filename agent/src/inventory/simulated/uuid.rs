//! The UUIDs a simulated GPU or MIG instance gets when its topology file gives none: a stable
//! hash (FNV-1a and the splitmix64 finaliser) of the node name and the GPU's index (and the MIG
//! instance's IDs), so that the same file on the same node always yields the same UUIDs and two
//! nodes sharing one file do not. The loader (`validate`) calls them; they are public for tests
//! that predict a simulated node's UUIDs.

use crate::inventory::{GpuUuid, MigUuid};

/// FNV-1a, 64 bits: stable across Rust versions, unlike `DefaultHasher`.
fn fnv1a(seed: u64, bytes: &[u8]) -> u64 {
    bytes.iter().fold(seed, |hash, &b| (hash ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
}

/// The splitmix64 finaliser: spreads FNV's output so that keys differing in one character give
/// UUIDs that differ everywhere.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn uuid_body(key: &str) -> String {
    let high = mix(fnv1a(0xcbf2_9ce4_8422_2325, key.as_bytes()));
    let low = mix(fnv1a(high ^ 0x9e37_79b9_7f4a_7c15, key.as_bytes()));
    format!(
        "{:08x}-{:04x}-{:04x}-{:04x}-{:012x}",
        high >> 32,
        (high >> 16) & 0xffff,
        high & 0xffff,
        low >> 48,
        low & 0xffff_ffff_ffff
    )
}

/// The UUID a simulated GPU gets when the file gives none: a hash of the node name and index.
pub fn generated_gpu_uuid(node: &str, index: u32) -> GpuUuid {
    GpuUuid(format!("GPU-{}", uuid_body(&format!("baleen-simulated/{node}/gpu/{index}"))))
}

/// The UUID a simulated MIG instance gets when the file gives none.
pub fn generated_mig_uuid(
    node: &str,
    gpu_index: u32,
    gpu_instance_id: u32,
    compute_instance_id: u32,
) -> MigUuid {
    let key = format!(
        "baleen-simulated/{node}/gpu/{gpu_index}/mig/{gpu_instance_id}/{compute_instance_id}"
    );
    MigUuid(format!("MIG-{}", uuid_body(&key)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_uuids_are_stable_across_versions() {
        // Pinned values: a change here renames every simulated GPU in existing checkpoints.
        assert_eq!(
            generated_gpu_uuid("simulated", 0).as_str(),
            "GPU-67a8a5e5-19b0-6f61-9052-90b8b1d977a4"
        );
        assert_eq!(
            generated_gpu_uuid("gpu-node-7", 3).as_str(),
            "GPU-0209a208-e9e0-05a6-60e7-3a4cdc441d10"
        );
        assert_eq!(
            generated_mig_uuid("gpu-node-7", 2, 1, 0).as_str(),
            "MIG-e9f512d3-39ad-08bf-9747-f09b6fd6e413"
        );
    }
}
