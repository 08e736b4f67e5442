//! The device-ID codec: how the IDs the kubelet sees are written and read back. A whole GPU is
//! its UUID; a memory unit is `<GPU UUID>::<unit index>`; a MIG instance is its MIG UUID; an
//! NVLink group is `nvlink<n>-<UUID of its first GPU>`. The ledger is the only caller; the IDs
//! never change meaning while a container holds one.

/// The separator between a GPU UUID and a unit index in a gpu-memory device ID.
pub const UNIT_SEPARATOR: &str = "::";

/// The ID of unit `unit` of the GPU `gpu_uuid`.
pub fn unit_id(gpu_uuid: &str, unit: u32) -> String {
    format!("{gpu_uuid}{UNIT_SEPARATOR}{unit}")
}

/// The GPU UUID and unit index of a memory-unit ID, if it has that shape.
pub fn parse_unit_id(id: &str) -> Option<(&str, u32)> {
    let (uuid, n) = id.rsplit_once(UNIT_SEPARATOR)?;
    Some((uuid, n.parse().ok()?))
}

/// The ID of an NVLink group of `size` GPUs whose first GPU is `first_uuid`.
pub fn group_id(size: u32, first_uuid: &str) -> String {
    format!("nvlink{size}-{first_uuid}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unit_ids_read_back() {
        let id = unit_id("GPU-1", 7);
        assert_eq!(id, "GPU-1::7");
        assert_eq!(parse_unit_id(&id), Some(("GPU-1", 7)));
        assert_eq!(parse_unit_id("GPU-1"), None);
        assert_eq!(parse_unit_id("GPU-1::x"), None);
        assert_eq!(group_id(2, "GPU-1"), "nvlink2-GPU-1");
    }
}
