//! The device ledger's unit and property tests: views and IDs, packing, exclusivity across
//! views, repeats and replacements, restore, and that no sequence of operations breaks them.

use super::*;
use crate::defaults::MPS_PIPE_IN_CONTAINER;
use crate::inventory::GpuInventory;
use crate::inventory::simulated::SimulatedInventory;
use crate::isolation::devices::{self, DeviceListConfig, DeviceLister};
use crate::resources::{ResponseConfig, container_response};
use baleen_device_plugin::ContainerAllocation;

fn example(name: &str) -> DeviceLedger {
    let path =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../packaging/examples").join(name);
    let inventory =
        SimulatedInventory::from_file(&path).expect("example loads").discover().expect("discover");
    DeviceLedger::new("node-a", &inventory, ViewConfig::default()).expect("node state")
}

fn uuid(state: &DeviceLedger, i: usize) -> String {
    state.slots[i].gpu.uuid.to_string()
}

fn units(state: &DeviceLedger, gpu: usize, range: std::ops::Range<u32>) -> Vec<String> {
    range.map(|n| format!("{}::{n}", uuid(state, gpu))).collect()
}

fn healthy(devices: &[DeviceState]) -> usize {
    devices.iter().filter(|d| d.healthy).count()
}

/// The kubelet answer for a grant under the envvar strategy (the GPUs read from the variable).
fn respond(grant: &Grant) -> ContainerAllocation {
    let devices = DeviceLister::new(DeviceListConfig {
        strategy: devices::Strategy::Envvar,
        ..DeviceListConfig::default()
    });
    container_response(grant, devices.answer(&grant.visible), &ResponseConfig::default().mps, None)
}

fn all_ids(state: &DeviceLedger, view: &View) -> Vec<String> {
    state.devices(view).into_iter().filter(|d| d.healthy).map(|d| d.id).collect()
}

#[test]
fn h200_views_and_device_ids() {
    let state = example("h200-8x-nvswitch.yaml");
    assert_eq!(
        state.views(),
        [
            View::Gpu,
            View::GpuMemory,
            View::NvlinkGroup(2),
            View::NvlinkGroup(4),
            View::NvlinkGroup(8)
        ]
    );
    let names: Vec<String> =
        state.views().iter().map(|v| v.resource_name("awesome-ai-company.com")).collect();
    assert!(names.contains(&"awesome-ai-company.com/gpu-memory".to_owned()));
    for name in &names {
        baleen_device_plugin::resource_name::validate(name).expect("valid resource name");
    }
    // 150_754_820_096 bytes = 140.4 GiB: 140 whole units per GPU.
    assert_eq!(state.devices(&View::GpuMemory).len(), 8 * 140);
    assert_eq!(state.devices(&View::Gpu).len(), 8);
    assert_eq!(state.devices(&View::NvlinkGroup(2)).len(), 4);
    assert_eq!(state.devices(&View::NvlinkGroup(4)).len(), 2);
    assert_eq!(state.devices(&View::NvlinkGroup(8)).len(), 1);
    let group = &state.devices(&View::NvlinkGroup(4))[1];
    assert_eq!(group.id, format!("nvlink4-{}", uuid(&state, 4)));
    assert_eq!(state.devices(&View::GpuMemory)[141].id, format!("{}::1", uuid(&state, 1)));
}

#[test]
fn a_unit_too_small_for_the_kubelet_is_refused_with_the_smallest_that_works() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../packaging/examples/h200-8x-nvswitch.yaml");
    let inventory =
        SimulatedInventory::from_file(&path).expect("example").discover().expect("discover");
    let config = ViewConfig { memory_unit_bytes: 16 << 20, ..ViewConfig::default() };
    let err = DeviceLedger::new("n", &inventory, config).expect_err("72k devices");
    assert!(err.to_string().contains("at least 36 MiB"), "{err}");
    let config = ViewConfig { memory_unit_bytes: 36 << 20, ..ViewConfig::default() };
    assert!(DeviceLedger::new("n", &inventory, config).is_ok());
}

#[test]
fn mig_gpus_are_only_in_mig_views() {
    let state = example("a100-4x-mig.yaml");
    assert_eq!(
        state.views(),
        [
            View::Gpu,
            View::GpuMemory,
            View::Mig("1g.10gb".into()),
            View::Mig("3g.40gb".into()),
            View::Mig("7g.80gb".into()),
            View::NvlinkGroup(2)
        ]
    );
    assert_eq!(state.devices(&View::Gpu).len(), 2);
    assert_eq!(state.devices(&View::Mig("1g.10gb".into())).len(), 2);
    assert_eq!(state.devices(&View::NvlinkGroup(2)).len(), 1, "only GPUs 0 and 1 are outside MIG");
    let mut state = state;
    let mig = "MIG-6a0d4e1b-2c3f-5a7e-8b9d-0f1e2d3c4b51".to_owned();
    let a = state
        .allocate(&View::Mig("1g.10gb".into()), std::slice::from_ref(&mig), 0)
        .expect("mig allocation");
    assert_eq!(respond(&a).envs["NVIDIA_VISIBLE_DEVICES"], mig);
    let err = state
        .allocate(&View::Mig("3g.40gb".into()), std::slice::from_ref(&mig), 0)
        .expect_err("wrong profile");
    assert!(matches!(err, Refusal::UnknownDevices { .. }), "{err}");
}

#[test]
fn memory_units_are_packed_onto_the_tightest_partly_used_gpu() {
    let mut state = example("h200-8x-nvswitch.yaml");
    state.allocate(&View::GpuMemory, &units(&state, 0, 0..40), 0).expect("40 on GPU 0");
    state.allocate(&View::GpuMemory, &units(&state, 1, 0..120), 0).expect("120 on GPU 1");
    let available: Vec<String> = (0..8)
        .flat_map(|g| units(&state, g, 0..140))
        .filter(|id| {
            !id.starts_with(&uuid(&state, 1))
                || id.rsplit("::").next().is_some_and(|n| n.parse::<u32>().is_ok_and(|n| n >= 120))
        })
        .filter(|id| {
            !id.starts_with(&uuid(&state, 0))
                || id.rsplit("::").next().is_some_and(|n| n.parse::<u32>().is_ok_and(|n| n >= 40))
        })
        .collect();
    // 20 free on GPU 1, 100 on GPU 0, 140 on the others.
    let pick = state.preferred(&View::GpuMemory, &available, &[], 16).expect("fits");
    assert_eq!(pick, units(&state, 1, 120..136));
    let pick = state.preferred(&View::GpuMemory, &available, &[], 21).expect("fits");
    assert_eq!(pick, units(&state, 0, 40..61));
    let pick = state.preferred(&View::GpuMemory, &available, &[], 101).expect("fits");
    assert_eq!(pick, units(&state, 2, 0..101));
    let err = state.preferred(&View::GpuMemory, &available, &[], 141).expect_err("too big");
    assert!(err.to_string().contains("no single GPU has 141"), "{err}");
    // A must-include unit pins the GPU.
    let must = units(&state, 3, 5..6);
    let pick = state.preferred(&View::GpuMemory, &available, &must, 3).expect("fits");
    assert_eq!(
        pick,
        [must[0].clone(), format!("{}::0", uuid(&state, 3)), format!("{}::1", uuid(&state, 3))]
    );
}

#[test]
fn a_whole_gpu_hides_its_units_until_released_and_conflicts_are_refused() {
    let mut state = example("h200-8x-nvswitch.yaml");
    let before = healthy(&state.devices(&View::GpuMemory));
    state.allocate(&View::Gpu, &[uuid(&state, 2)], 0).expect("whole GPU 2");
    assert_eq!(healthy(&state.devices(&View::GpuMemory)), before - 140);
    assert!(
        state
            .devices(&View::GpuMemory)
            .iter()
            .filter(|d| d.id.starts_with(&uuid(&state, 2)))
            .all(|d| !d.healthy)
    );
    assert_eq!(
        healthy(&state.devices(&View::Gpu)),
        8,
        "the gpu view's own allocation stays Healthy"
    );
    assert_eq!(healthy(&state.devices(&View::NvlinkGroup(2))), 3);
    assert_eq!(healthy(&state.devices(&View::NvlinkGroup(8))), 0);

    let err =
        state.allocate(&View::GpuMemory, &units(&state, 2, 0..4), 0).expect_err("GPU 2 is whole");
    assert!(matches!(err, Refusal::Conflict { .. }));
    assert!(
        err.to_string().contains(&uuid(&state, 2)) && err.to_string().contains("held whole"),
        "{err}"
    );

    state.allocate(&View::GpuMemory, &units(&state, 3, 0..4), 0).expect("units on GPU 3");
    let err = state.allocate(&View::Gpu, &[uuid(&state, 3)], 0).expect_err("GPU 3 is shared");
    assert!(err.to_string().contains("4 gpu-memory units"), "{err}");
    assert_eq!(healthy(&state.devices(&View::Gpu)), 7, "GPU 3 advertised Unhealthy as a whole GPU");

    let mut split = units(&state, 4, 0..2);
    split.extend(units(&state, 5, 0..2));
    let err = state.allocate(&View::GpuMemory, &split, 0).expect_err("two GPUs");
    assert!(matches!(err, Refusal::InvalidRequest { .. }));
    assert!(err.to_string().contains("on one GPU"), "{err}");

    let released = state.retain(|r| r.resource != "awesome-ai-company.com/gpu");
    assert_eq!(released.len(), 1);
    assert_eq!(healthy(&state.devices(&View::GpuMemory)), before);
    assert_eq!(state.records().len(), 1);
}

#[test]
fn two_containers_never_share_a_unit_and_repeats_are_idempotent() {
    let mut state = example("l4-4x-pcie.yaml");
    let first = units(&state, 0, 0..4);
    let granted = state.allocate(&View::GpuMemory, &first, 1).expect("first");
    let a = respond(&granted);
    assert_eq!(a.envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"], "0=4096M");
    assert_eq!(a.envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"], "18", "4 of 22 units");
    assert_eq!(a.mounts[0].container_path, MPS_PIPE_IN_CONTAINER);
    // The init container's units, allocated again: same answer, no second record.
    let again = state.allocate(&View::GpuMemory, &first, 2).expect("repeat");
    assert_eq!(again, granted);
    assert_eq!(respond(&again), a);
    assert_eq!(state.records().len(), 1);
    // The kubelet hands out unit 3 again only after the first pod ended: the old allocation
    // is replaced, never shared.
    state.allocate(&View::GpuMemory, &units(&state, 0, 3..6), 3).expect("reassigned");
    let records = state.records();
    assert_eq!(records.len(), 1);
    assert_eq!(records[0].device_ids, units(&state, 0, 3..6));
    assert_eq!(state.units_taken(0), 3);
    // Preferred allocations never offer held units when the kubelet offers only free ones.
    let available = all_ids(&state, &View::GpuMemory)
        .into_iter()
        .filter(|id| !records[0].device_ids.contains(id))
        .collect::<Vec<_>>();
    let pick = state.preferred(&View::GpuMemory, &available, &[], 2).expect("fits");
    assert!(pick.iter().all(|id| !records[0].device_ids.contains(id)));
}

#[test]
fn whole_gpus_are_chosen_by_connectivity_and_records_restore() {
    let mut state = example("l4-4x-pcie.yaml");
    let all = all_ids(&state, &View::Gpu);
    let pick = state.preferred(&View::Gpu, &all, &[], 2).expect("two GPUs");
    assert_eq!(pick, [uuid(&state, 0), uuid(&state, 1)], "the bridged pair");
    let pick = state.preferred(&View::Gpu, &all, &[uuid(&state, 2)], 2).expect("two GPUs");
    assert_eq!(pick, [uuid(&state, 2), uuid(&state, 3)]);
    state
        .allocate(&View::NvlinkGroup(2), &[format!("nvlink2-{}", uuid(&state, 0))], 5)
        .expect("group");
    state.allocate(&View::GpuMemory, &units(&state, 3, 0..2), 6).expect("units");
    let records = state.records();
    let mut fresh = example("l4-4x-pcie.yaml");
    assert!(fresh.restore(&records).is_empty());
    assert_eq!(fresh.records(), records);
    assert_eq!(
        healthy(&fresh.devices(&View::Gpu)),
        1,
        "GPUs 0 and 1 in a group, 3 shared: only 2 left"
    );
    let refused = fresh.restore(&[AllocationRecord {
        resource: "other.com/gpu".into(),
        device_ids: vec![],
        allocated_at: 0,
        listed: false,
        holder: None,
        claim: None,
    }]);
    assert_eq!(refused.len(), 1);
}

mod properties {
    use super::*;
    use proptest::prelude::*;

    #[derive(Debug, Clone)]
    enum Op {
        Units { gpu: usize, start: u32, count: u32 },
        Whole { gpus: Vec<usize> },
        Group { index: usize },
        Release { pick: usize },
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => (0..4usize, 0..22u32, 1..8u32).prop_map(|(gpu, start, count)| Op::Units { gpu, start, count }),
            2 => proptest::collection::vec(0..4usize, 1..3).prop_map(|gpus| Op::Whole { gpus }),
            1 => (0..2usize).prop_map(|index| Op::Group { index }),
            2 => any::<usize>().prop_map(|pick| Op::Release { pick }),
        ]
    }

    fn check_any(state: &DeviceLedger) -> Result<(), TestCaseError> {
        for r in state.records() {
            prop_assert!(state.view_for(&r.resource).is_some());
        }
        Ok(())
    }

    fn check(state: &DeviceLedger) -> Result<(), TestCaseError> {
        let records = state.records();
        let mut whole: Vec<usize> = Vec::new();
        let mut units: BTreeSet<String> = BTreeSet::new();
        for r in &records {
            let view = state.view_for(&r.resource).expect("a view of the node");
            let parsed = state
                .parse(&view, &r.device_ids)
                .map_err(|e| TestCaseError::fail(e.to_string()))?;
            if view.is_whole() {
                whole.extend(parsed.gpus.iter());
            } else {
                for id in &r.device_ids {
                    prop_assert!(units.insert(id.clone()), "unit {id} held twice");
                }
            }
        }
        let mut sorted = whole.clone();
        sorted.sort_unstable();
        sorted.dedup();
        prop_assert_eq!(sorted.len(), whole.len(), "a GPU held whole twice: {:?}", whole);
        for &g in &whole {
            prop_assert_eq!(state.units_taken(g), 0, "GPU {} whole and shared", g);
            let uuid = state.slots[g].gpu.uuid.to_string();
            prop_assert!(
                state
                    .devices(&View::GpuMemory)
                    .iter()
                    .filter(|d| d.id.starts_with(&uuid))
                    .all(|d| !d.healthy)
            );
        }
        for g in 0..4 {
            if state.units_taken(g) > 0 {
                let uuid = state.slots[g].gpu.uuid.to_string();
                let gpu_device = state.devices(&View::Gpu).into_iter().find(|d| d.id == uuid);
                prop_assert_eq!(gpu_device.map(|d| d.healthy), Some(false));
            }
        }
        Ok(())
    }

    proptest! {
        #[test]
        fn arbitrary_device_ids_are_refused_not_panicked_on(ids in proptest::collection::vec(".{0,60}", 1..4)) {
            let mut state = example("a100-4x-mig.yaml");
            for view in state.views() {
                let _ = state.allocate(&view, &ids, 0);
                let _ = state.preferred(&view, &ids, &ids[..1], ids.len());
            }
            check_any(&state)?;
        }

        #[test]
        fn no_sequence_of_allocations_breaks_exclusivity(ops in proptest::collection::vec(op(), 1..40)) {
            let mut state = example("l4-4x-pcie.yaml");
            let groups: Vec<String> = state.devices(&View::NvlinkGroup(2)).into_iter().map(|d| d.id).collect();
            for (t, op) in ops.into_iter().enumerate() {
                let before = state.records();
                let outcome = match op {
                    Op::Units { gpu, start, count } => {
                        let ids = units(&state, gpu, start..(start + count).min(22));
                        state.allocate(&View::GpuMemory, &ids, t as u64).map(drop)
                    }
                    Op::Whole { gpus } => {
                        let ids: Vec<String> = gpus.iter().map(|&g| uuid(&state, g)).collect();
                        state.allocate(&View::Gpu, &ids, t as u64).map(drop)
                    }
                    Op::Group { index } => state.allocate(&View::NvlinkGroup(2), &[groups[index].clone()], t as u64).map(drop),
                    Op::Release { pick } => {
                        if !before.is_empty() {
                            let gone = before[pick % before.len()].clone();
                            state.retain(|r| *r != gone);
                        }
                        Ok(())
                    }
                };
                if outcome.is_err() {
                    prop_assert_eq!(state.records(), before, "a refusal changed the ledger");
                }
                check(&state)?;
            }
        }
    }
}

#[test]
fn fragmentation_is_the_fgd_measure_against_the_shapes_of_recent_grants() {
    let mut state = example("h200-8x-nvswitch.yaml");
    let f = state.fragmentation();
    assert_eq!((f.milli_gpu, f.free_milli_gpu, f.learned_from), (0.0, 8000, 0));
    // 98 of GPU 0's 140 units: a 0.7-GPU shape; GPU 0 keeps 0.3, which that shape cannot use.
    state.allocate(&View::GpuMemory, &units(&state, 0, 0..98), 0).expect("0.7 of GPU 0");
    let f = state.fragmentation();
    assert_eq!((f.milli_gpu, f.free_milli_gpu, f.learned_from), (300.0, 7300, 1));
    // A whole GPU: neither shape can use GPU 0's 0.3.
    state.allocate(&View::Gpu, &[uuid(&state, 1)], 0).expect("GPU 1");
    assert_eq!(state.fragmentation().milli_gpu, 300.0);
    assert_eq!(state.fragmentation().free_milli_gpu, 6300);
    // 42 units fill GPU 0: nothing is fragmented.
    state.allocate(&View::GpuMemory, &units(&state, 0, 98..140), 0).expect("0.3 of GPU 0");
    assert_eq!(state.fragmentation().milli_gpu, 0.0);
    // Released, the 0.3 is free again; a third of the target (the 0.3-GPU shape) can use it.
    let released =
        state.retain(|r| !(r.resource.ends_with("gpu-memory") && r.device_ids.len() == 42));
    assert_eq!(released.len(), 1);
    let f = state.fragmentation();
    assert!((f.milli_gpu - 200.0).abs() < 1e-9, "{f:?}");
    assert_eq!(f.learned_from, 3, "history keeps ended grants");
    // An unhealthy GPU's compute is not free (nor fragmented).
    assert!(state.set_health(&uuid(&state, 2), false));
    let f = state.fragmentation();
    assert!((f.milli_gpu - 200.0).abs() < 1e-9, "{f:?}");
    assert_eq!(f.free_milli_gpu, 5300);
    // After a restart the target is learned from the restored allocations.
    let mut restarted = example("h200-8x-nvswitch.yaml");
    assert!(restarted.restore(&state.records()).is_empty());
    let f = restarted.fragmentation();
    assert_eq!((f.milli_gpu, f.learned_from), (300.0, 2));
}

#[test]
fn mig_gpus_have_no_free_compute_for_fragmentation() {
    let mut state = example("a100-4x-mig.yaml");
    let f = state.fragmentation();
    assert_eq!(f.free_milli_gpu, 2000, "GPUs 2 and 3 are in MIG mode");
    let mig = "MIG-6a0d4e1b-2c3f-5a7e-8b9d-0f1e2d3c4b51".to_owned();
    state.allocate(&View::Mig("1g.10gb".into()), &[mig], 0).expect("mig");
    assert_eq!(state.fragmentation().learned_from, 0, "a MIG slice has no share of a GPU");
    // One unit is at least a thousandth of a GPU in the target.
    state.allocate(&View::GpuMemory, &units(&state, 0, 0..1), 0).expect("one unit");
    let f = state.fragmentation();
    assert_eq!(f.learned_from, 1);
    assert_eq!(f.milli_gpu, 0.0, "a small shape fits everywhere");
}

#[test]
fn the_node_state_document_says_what_is_free_and_who_holds_it() {
    use baleen_k8s::gpu_state::{GpuMode as M, NodeGpuState};
    let mut state = example("h200-8x-nvswitch.yaml");
    state.allocate(&View::GpuMemory, &units(&state, 0, 0..98), 0).expect("0.7 of GPU 0");
    state.allocate(&View::Gpu, &[uuid(&state, 1)], 0).expect("GPU 1");
    let group = format!("nvlink2-{}", uuid(&state, 2));
    state.allocate(&View::NvlinkGroup(2), std::slice::from_ref(&group), 0).expect("GPUs 2, 3");
    assert!(state.set_health(&uuid(&state, 7), false));
    let holder =
        |r: &AllocationRecord| r.resource.ends_with("gpu-memory").then(|| "ns/a".to_owned());
    let doc = state.node_state("node-a", 7, holder);
    assert_eq!((doc.version, doc.node.as_str(), doc.generation), (1, "node-a", 7));
    assert_eq!(doc.memory_unit_bytes, 1 << 30);
    assert!(doc.resources.contains(&"awesome-ai-company.com/nvlink-group-8".to_owned()));
    let g = &doc.gpus;
    assert_eq!((g[0].mode, g[0].units_total, g[0].units_free), (M::Shared, 140, 42));
    assert_eq!((g[0].compute_free_milli, g[0].pods.as_slice()), (300, &["ns/a".to_owned()][..]));
    assert!(g[0].shares_offered);
    assert_eq!((g[1].mode, g[1].compute_free_milli, g[1].shares_offered), (M::Exclusive, 0, false));
    assert!(g[1].pods.is_empty(), "the holder says only gpu-memory grants here");
    // The grants whose pod is not listed yet are published without it.
    let unnamed: Vec<(String, u32)> =
        doc.unnamed.iter().map(|u| (u.resource.clone(), u.devices)).collect();
    assert_eq!(
        unnamed,
        [
            ("awesome-ai-company.com/gpu".to_owned(), 1),
            ("awesome-ai-company.com/nvlink-group-2".to_owned(), 1)
        ]
    );
    assert_eq!((g[2].mode, g[3].mode), (M::Exclusive, M::Exclusive));
    assert_eq!((g[4].mode, g[4].units_free, g[4].compute_free_milli), (M::Idle, 140, 1000));
    assert!(!g[7].healthy && !g[7].shares_offered && g[7].compute_free_milli == 0);
    assert_eq!(g[0].nvlink_peers.len(), 7, "NVSwitch: every other GPU");
    let free: Vec<(u32, bool)> =
        doc.nvlink_groups.iter().filter(|n| n.size == 2).map(|n| (n.gpus[0], n.free)).collect();
    // GPUs 0-1 are held (shared, whole), 2-3 by the group, 6-7 has an unhealthy GPU.
    assert_eq!(free, [(0, false), (2, false), (4, true), (6, false)]);
    assert!(doc.nvlink_groups.iter().all(|n| n.size == 2 || !n.free));
    // What the agent writes, the extender reads back.
    assert_eq!(NodeGpuState::parse(&doc.to_json()).expect("valid"), doc);
}

#[test]
fn mig_instances_are_in_the_node_state_when_offered() {
    let mut state = example("a100-4x-mig.yaml");
    let mig = "MIG-6a0d4e1b-2c3f-5a7e-8b9d-0f1e2d3c4b51".to_owned();
    state.allocate(&View::Mig("1g.10gb".into()), std::slice::from_ref(&mig), 0).expect("mig");
    let doc = state.node_state("n", 1, |_| Some("ns/m".to_owned()));
    let instances: Vec<_> = doc.gpus.iter().flat_map(|g| g.mig.iter()).collect();
    assert!(instances.len() >= 3, "{instances:?}");
    assert!(instances.iter().any(|m| m.uuid == mig && !m.free));
    assert!(instances.iter().filter(|m| m.uuid != mig).all(|m| m.free));
    let holder = doc.gpus.iter().find(|g| g.mig.iter().any(|m| m.uuid == mig)).expect("its GPU");
    assert_eq!(holder.pods, ["ns/m"]);
    assert_eq!(holder.compute_free_milli, 0);
    // With MIG views off, no instance is offered, so none is published.
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../packaging/examples/a100-4x-mig.yaml");
    let inventory =
        SimulatedInventory::from_file(&path).expect("example").discover().expect("discover");
    let config = ViewConfig { mig: false, ..ViewConfig::default() };
    let off = DeviceLedger::new("n", &inventory, config).expect("ledger");
    assert!(off.node_state("n", 0, |_| None).gpus.iter().all(|g| g.mig.is_empty()));
}

/// Issue 22, item 7: the allocations of a checkpoint on the H200 node, restored by a start at
/// which GPU 1 cannot be read: what names GPU 1 (its units, a pair of whole GPUs, an NVLink
/// group of GPUs 0-1, known by the checkpoint's layout) is parked with every readable GPU it
/// names reserved; the rest restores; no group is offered; the layout keeps the parked group.
#[test]
fn allocations_on_an_unreadable_gpu_are_parked_and_their_other_gpus_reserved() {
    let before = example("h200-8x-nvswitch.yaml");
    let layout = before.layout();
    let group = before.devices(&View::NvlinkGroup(2))[0].id.clone();
    let mut held = before.clone();
    let domain = held.config().domain.clone();
    held.allocate(&View::NvlinkGroup(2), std::slice::from_ref(&group), 1).expect("group 0-1");
    held.allocate(&View::GpuMemory, &units(&before, 4, 0..2), 1).expect("units of 4");
    held.allocate(&View::Gpu, &[uuid(&before, 5), uuid(&before, 6)], 1).expect("5 and 6");
    let records = held.records();
    // GPU 1 unreadable at the next start: the inventory without it.
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../packaging/examples/h200-8x-nvswitch.yaml");
    let mut inventory =
        SimulatedInventory::from_file(&path).expect("example").discover().expect("discover");
    let lost = inventory.gpus.remove(1);
    inventory.unreadable.push(crate::inventory::UnreadableGpu {
        index: lost.index,
        uuid: Some(lost.uuid.clone()),
        error: "GPU is lost".into(),
    });
    let mut state = DeviceLedger::new("node-a", &inventory, ViewConfig::default()).expect("ledger");
    assert!(state.views().iter().all(|v| !matches!(v, View::NvlinkGroup(_))), "no group offered");
    assert!(state.meaning_changes(&layout, &records).is_empty(), "the parked group is no change");
    let refused = state.restore_from(&records, &layout);
    assert!(refused.is_empty(), "{refused:?}");
    assert_eq!(state.parked().len(), 1, "the group");
    assert_eq!(state.held_count(), 2, "the units and the pair restored");
    assert_eq!(state.records().len(), 3, "every record kept");
    // GPU 0 (the group's other GPU) is offered to no one, in any view.
    let gpu0 = uuid(&before, 0);
    let gpus = state.devices(&View::Gpu);
    assert!(gpus.iter().any(|d| d.id == gpu0 && !d.healthy), "{gpus:?}");
    assert!(
        state
            .devices(&View::GpuMemory)
            .iter()
            .filter(|d| d.id.starts_with(&gpu0))
            .all(|d| !d.healthy)
    );
    let err = state.allocate(&View::Gpu, std::slice::from_ref(&gpu0), 2).expect_err("reserved");
    assert!(err.to_string().contains("NVML cannot read"), "{err}");
    assert!(state.layout().nvlink_groups.contains_key(&group), "the group's members kept");
    // The kubelet listing an allocation on GPU 1 (a start without a trusted checkpoint): parked
    // too, not refused.
    let listed = AllocationRecord {
        resource: format!("{domain}/gpu-memory"),
        device_ids: vec![format!("{}::3", lost.uuid)],
        allocated_at: 2,
        listed: true,
        holder: None,
        claim: None,
    };
    assert!(state.restore(std::slice::from_ref(&listed)).is_empty());
    assert_eq!(state.parked().len(), 2);
}

/// Issue 23, step 7: whether the MIG instances or NVLink groups asked can be given is
/// scheduler-core's capacity rule (the extender's filter asks the same of the published state),
/// and its reason is the refusal's.
#[test]
fn mig_and_nvlink_preferences_are_refused_by_the_cores_capacity_rule() {
    let state = example("a100-4x-mig.yaml");
    let view = View::Mig("1g.10gb".into());
    let all: Vec<String> = state.devices(&view).into_iter().map(|d| d.id).collect();
    assert_eq!(all.len(), 2);
    assert_eq!(state.preferred(&view, &all, &[], 2).expect("both").len(), 2);
    let Err(Refusal::Exhausted { reason }) = state.preferred(&view, &all, &[], 3) else {
        panic!("three of two instances")
    };
    assert_eq!(reason, "2 of 3 MIG 1g.10gb instances free");
    let state = example("h200-8x-nvswitch.yaml");
    let view = View::NvlinkGroup(4);
    let all: Vec<String> = state.devices(&view).into_iter().map(|d| d.id).collect();
    assert_eq!(state.preferred(&view, &all, &[], 2).expect("both groups of 4").len(), 2);
    let Err(Refusal::Exhausted { reason }) = state.preferred(&view, &all[..1], &[], 2) else {
        panic!("two groups of one offered")
    };
    assert_eq!(reason, "1 of 2 NVLink groups of 4 GPUs free");
}
