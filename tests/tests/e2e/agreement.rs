//! Issue 23, step 7: the extender's verdict agrees with what the agent's ledger grants. Random
//! nodes (the example topologies: NVSwitch H200s with NVLink groups, PCIe L4s, A100s in MIG
//! mode) are filled by random grants through the agent's own ledger, with random GPUs made
//! unhealthy; the ledger publishes its gpu-state document, and for a random ask (gpu-memory
//! units, whole GPUs, an NVLink group, MIG instances) the extender's filter must say `Fits`
//! exactly when the ledger, asked as the kubelet asks it (its preferred devices, then
//! Allocate), grants it.

use std::collections::HashSet;

use baleen_agent::ledger::{DeviceLedger, View, ViewConfig};
use baleen_extender::demand::{Ask, Demand};
use baleen_extender::place::{Verdict, verdict};
use proptest::prelude::*;

use crate::support::example;

const DOMAIN: &str = "awesome-ai-company.com";
const NODES: [&str; 3] = ["h200-8x-nvswitch.yaml", "l4-4x-pcie.yaml", "a100-4x-mig.yaml"];

/// An ask of one container: a view of the node and how many of its devices.
#[derive(Debug, Clone)]
struct Want {
    /// Which of the node's views (modulo their number).
    view: usize,
    /// How many devices, from 1 (units: up to a GPU's worth and a little more).
    size: usize,
}

fn want() -> impl Strategy<Value = Want> {
    (0usize..16, 1usize..160).prop_map(|(view, size)| Want { view, size })
}

/// The view and size `want` names on `ledger`: a count of a GPU's units for gpu-memory, a few
/// devices for the others.
fn resolve(ledger: &DeviceLedger, want: &Want) -> (View, usize) {
    let views = ledger.views();
    let view = views[want.view % views.len()].clone();
    let size = match view {
        View::GpuMemory => want.size,
        _ => 1 + want.size % 3,
    };
    (view, size)
}

/// What the agent's ledger does with the ask, as the kubelet asks it: the kubelet offers the
/// view's healthy devices that it has not handed out itself (it keeps its own books of what
/// runs), the ledger prefers some of them, then Allocate. The grant, if any, is kept in
/// `ledger`.
fn ledger_grants(ledger: &mut DeviceLedger, view: &View, size: usize) -> bool {
    let resource = view.resource_name(DOMAIN);
    let handed_out: HashSet<String> = ledger
        .records()
        .into_iter()
        .filter(|r| r.resource == resource)
        .flat_map(|r| r.device_ids)
        .collect();
    let healthy: Vec<String> = ledger
        .devices(view)
        .into_iter()
        .filter(|d| d.healthy && !handed_out.contains(&d.id))
        .map(|d| d.id)
        .collect();
    let Ok(ids) = ledger.preferred(view, &healthy, &[], size) else { return false };
    ids.len() == size && ledger.allocate(view, &ids, 0).is_ok()
}

/// The extender's ask for `size` devices of `view`.
fn ask(view: &View, size: usize) -> Ask {
    let n = u32::try_from(size).expect("small");
    match view {
        View::Gpu => Ask::Gpus(n),
        View::GpuMemory => Ask::GpuMemory(n),
        View::Mig(profile) => Ask::Mig(profile.clone(), n),
        View::NvlinkGroup(group) => Ask::NvlinkGroups(*group, n),
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn the_extenders_verdict_agrees_with_what_the_agents_ledger_grants(
        node in 0usize..NODES.len(),
        grants in proptest::collection::vec(want(), 0..12),
        unhealthy in proptest::collection::vec(0usize..8, 0..3),
        asked in want(),
    ) {
        let inventory = example(NODES[node]).expect("example");
        let mut ledger =
            DeviceLedger::new("node-a", &inventory, ViewConfig::default()).expect("ledger");
        for g in &grants {
            let (view, size) = resolve(&ledger, g);
            ledger_grants(&mut ledger, &view, size);
        }
        for i in unhealthy {
            let uuid = inventory.gpus[i % inventory.gpus.len()].uuid.to_string();
            ledger.set_health(&uuid, false);
        }
        let doc = ledger.node_state("node-a", 1, |_| None);
        let (view, size) = resolve(&ledger, &asked);
        let demand = Demand { asks: vec![ask(&view, size)], cpu_milli: 0, memory_bytes: 0 };
        let said = verdict(&doc, &[], &demand, DOMAIN);
        let granted = ledger_grants(&mut ledger.clone(), &view, size);
        prop_assert_eq!(
            said == Verdict::Fits,
            granted,
            "{} on {} after {} grants: the extender said {:?}, the ledger {}",
            format!("{size} x {view}"),
            NODES[node],
            grants.len(),
            said,
            if granted { "grants it" } else { "refuses it" }
        );
    }
}
