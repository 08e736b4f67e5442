//! Choosing a node across a cluster: the decision the extender makes, and the replay tool's.
//!
//! Every feasible node is scored by the policy; the highest score wins, and ties go to the node
//! ranked first in a fixed priority order (as in the FGD paper's simulator, where node names
//! carry a prefix from a seeded permutation). The random policy picks a feasible node
//! uniformly instead.

use crate::ledger::NodeLedger;
use crate::model::Request;
use crate::policy::{Policy, Scored};
use rand::{Rng, RngCore};

/// Whether a node with `score` and priority `rank` beats the best so far.
pub fn beats(score: i64, rank: u32, best: Option<(i64, u32)>) -> bool {
    match best {
        None => true,
        Some((b, r)) => score > b || (score == b && rank < r),
    }
}

/// Chooses a node for `request`: its index and what the policy would do there, or `None` if no
/// node fits. `ranks[i]` is node `i`'s place in the tie-break order (lower first).
pub fn select_node(
    policy: &Policy,
    nodes: &[NodeLedger],
    ranks: &[u32],
    request: &Request,
    rng: &mut dyn RngCore,
) -> Option<(usize, Scored)> {
    debug_assert_eq!(nodes.len(), ranks.len());
    if !policy.kind().is_deterministic() {
        let feasible: Vec<usize> =
            (0..nodes.len()).filter(|&i| crate::fit::node_fits(&nodes[i], request)).collect();
        let pick = match feasible.len() {
            0 => return None,
            // As kube-scheduler: a single feasible node is taken without scoring.
            1 => feasible[0],
            n => feasible[rng.random_range(0..n)],
        };
        return policy.score(&nodes[pick], request, rng).map(|s| (pick, s));
    }
    let mut best: Option<(usize, Scored)> = None;
    for (i, node) in nodes.iter().enumerate() {
        if let Some(s) = policy.score(node, request, rng) {
            if beats(s.score, ranks[i], best.map(|(b, bs)| (bs.score, ranks[b]))) {
                best = Some((i, s));
            }
        }
    }
    best
}
