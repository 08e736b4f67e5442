//! What a GPU's free share is worth to the shared requests still to come: prices from the
//! fractional bin-packing LP of the target workload's shares.
//!
//! Shared requests take a share of one GPU (`g` milli-GPU, below 1000), so the GPUs they use
//! are bins of size 1000 and the shares items. Given how often each share occurs (the target
//! workload), the fractional bin-packing LP packs them into the fewest GPUs:
//!
//! ```text
//! primal:  min Σ_P x_P        s.t. Σ_P a_sP x_P >= n_s for every share s, x >= 0
//! dual:    max Σ_s n_s y_s    s.t. Σ_s a_sP y_s <= 1 for every pattern P, y >= 0
//! ```
//!
//! where a pattern `P` is a multiset of shares fitting one GPU (`a_sP` copies of `s`). The dual
//! price `y_s` is the part of a GPU that a share of size `s` is worth when every GPU is packed
//! the best way; [`SharePrices::best_fill`] `K(r)` is the most that free share `r` can still be
//! worth (an unbounded knapsack over the prices). Placing share `s` on a GPU with `r` free gives
//! up `K(r) - K(r - s) - y_s >= 0` of a GPU: nothing when the GPU stays on a best pattern (a
//! 470 beside a 470, a 320 beside a 650), much when it strands the rest (a 320 beside a 470
//! leaves 210 that almost no share can use). [`SharePrices::regret`] returns that loss in
//! milli-GPU; the `baleen` policy subtracts it from its fragmentation descent.
//!
//! The dual is solved by cutting planes: start from the one-share patterns, solve, find the
//! pattern the prices violate most by a knapsack, add it, repeat. The LP is small (one variable
//! per distinct share, a few dozen patterns) and is solved once per target workload: 1.4 ms
//! for the Alibaba trace's 20 shares, 58 ms for 99, 1.5 s for all 999 possible shares.
//!
//! Limits: the LP pools the shares of every GPU model (a share constrained to one model may
//! be counted as filling a gap on another), and packs compute only, not GPU memory units.

use crate::frag::TargetWorkload;
use crate::units::MilliGpu;
use microlp::{ComparisonOp, OptimizationDirection, Problem};
use std::collections::BTreeMap;

/// A GPU's compute in milli-GPU: the bin size.
const BIN: usize = MilliGpu::WHOLE.0 as usize;

/// Most cutting-plane rounds; the LP is tiny and converges in a few dozen.
const MAX_ROUNDS: usize = 500;

/// Tolerance on a pattern's price sum above 1 that still counts as feasible.
const EPS: f64 = 1e-9;

/// Prices of GPU shares from the fractional bin-packing LP of a target workload.
#[derive(Clone, Debug, PartialEq)]
pub struct SharePrices {
    /// Dual price of each share (milli-GPU), in GPUs.
    prices: BTreeMap<u32, f64>,
    /// `best_fill[r]`: the most the shares can be worth in `r` free milli-GPU, in GPUs.
    best_fill: Vec<f64>,
}

impl Default for SharePrices {
    /// No shares: every price and fill 0, every regret 0.
    fn default() -> Self {
        Self { prices: BTreeMap::new(), best_fill: vec![0.0; BIN + 1] }
    }
}

impl SharePrices {
    /// Prices for the shared shapes of `target`, weighted by their probabilities.
    pub fn from_target(target: &TargetWorkload) -> Self {
        let mut weights: BTreeMap<u32, f64> = BTreeMap::new();
        for (shape, p) in target.shapes() {
            let g = shape.milli_per_gpu.0;
            if shape.gpu_count == 1 && g > 0 && (g as usize) < BIN {
                *weights.entry(g).or_default() += p;
            }
        }
        Self::from_weights(&weights)
    }

    /// Prices for shares (milli-GPU, 1..=999) with the given weights (counts or probabilities).
    /// Shares of weight 0 or outside 1..=999 are ignored.
    pub fn from_weights(weights: &BTreeMap<u32, f64>) -> Self {
        let items: Vec<(u32, f64)> = weights
            .iter()
            .filter(|&(&s, &w)| s > 0 && (s as usize) < BIN && w > 0.0)
            .map(|(&s, &w)| (s, w))
            .collect();
        if items.is_empty() {
            return Self::default();
        }
        let mut prices = solve_dual(&items);
        let mut best_fill = knapsack(&prices);
        // Keep the prices dual-feasible whatever the solver did (it stops after MAX_ROUNDS
        // or on a numerical error): no pattern may be worth more than one GPU. The knapsack is
        // linear in the prices, so it scales with them.
        let most = best_fill[BIN];
        if most > 1.0 {
            prices.values_mut().for_each(|y| *y /= most);
            best_fill.iter_mut().for_each(|k| *k /= most);
        }
        Self { prices, best_fill }
    }

    /// The dual price of share `milli`, in GPUs (0 for a share the workload does not have).
    pub fn price(&self, milli: u32) -> f64 {
        self.prices.get(&milli).copied().unwrap_or(0.0)
    }

    /// `K(r)`: the most the priced shares can be worth in `free` milli-GPU, in GPUs.
    pub fn best_fill(&self, free: u32) -> f64 {
        self.best_fill[(free as usize).min(BIN)]
    }

    /// What placing share `milli` on a GPU with `free` milli-GPU free gives up, in milli-GPU:
    /// `1000 (K(free) - K(free - milli) - y_milli)`, at least 0. Zero when `milli` does not fit.
    /// A share the target workload does not have is priced 0, so wherever it goes it gives up
    /// what its room could have held of the priced shares.
    pub fn regret(&self, free: u32, milli: u32) -> f64 {
        if milli > free {
            return 0.0;
        }
        let loss = self.best_fill(free) - self.best_fill(free - milli) - self.price(milli);
        (loss * BIN as f64).max(0.0)
    }
}

/// Solves the dual by cutting planes; returns the price of each share.
fn solve_dual(items: &[(u32, f64)]) -> BTreeMap<u32, f64> {
    let mut problem = Problem::new(OptimizationDirection::Maximize);
    let vars: Vec<_> = items.iter().map(|&(_, w)| problem.add_var(w, (0.0, 1.0))).collect();
    // One-share patterns: as many copies as fit.
    for (&(s, _), &v) in items.iter().zip(&vars) {
        let copies = (BIN / s as usize) as f64;
        problem.add_constraint([(v, copies)], ComparisonOp::Le, 1.0);
    }
    // Volume prices (a share worth its size) are always feasible: the answer if the solver
    // fails, which it should not on this bounded LP with a feasible origin.
    let mut prices: BTreeMap<u32, f64> =
        items.iter().map(|&(s, _)| (s, f64::from(s) / BIN as f64)).collect();
    let Ok(mut solution) = problem.solve() else {
        return prices;
    };
    for _ in 0..MAX_ROUNDS {
        let current: Vec<f64> = vars.iter().map(|&v| solution.var_value(v).max(0.0)).collect();
        let priced: BTreeMap<u32, f64> =
            items.iter().zip(&current).map(|(&(s, _), &y)| (s, y)).collect();
        let (value, pattern) = most_valuable_pattern(&priced);
        prices = priced;
        if value <= 1.0 + EPS {
            break;
        }
        let cut: Vec<_> = pattern
            .iter()
            .map(|(s, n)| {
                let i = items.iter().position(|&(t, _)| t == *s).expect("pattern of known shares");
                (vars[i], f64::from(*n))
            })
            .collect();
        match solution.add_constraint(cut, ComparisonOp::Le, 1.0) {
            Ok(next) => solution = next,
            Err(_) => break,
        }
    }
    prices
}

/// The multiset of shares fitting one GPU with the highest total price, and that total.
fn most_valuable_pattern(prices: &BTreeMap<u32, f64>) -> (f64, Vec<(u32, u32)>) {
    let best = knapsack(prices);
    // Walk back from a full GPU to recover one best pattern.
    let mut pattern: BTreeMap<u32, u32> = BTreeMap::new();
    let mut r = BIN;
    while r > 0 {
        if best[r] <= best[r - 1] {
            r -= 1;
            continue;
        }
        let Some((&s, _)) = prices.iter().find(|&(&s, &y)| {
            (s as usize) <= r && (best[r - s as usize] + y - best[r]).abs() < 1e-12
        }) else {
            break;
        };
        *pattern.entry(s).or_default() += 1;
        r -= s as usize;
    }
    (best[BIN], pattern.into_iter().collect())
}

/// `best[r]` for `r` in `0..=1000`: the highest total price of shares fitting in `r`.
fn knapsack(prices: &BTreeMap<u32, f64>) -> Vec<f64> {
    let mut best = vec![0.0f64; BIN + 1];
    for r in 1..=BIN {
        let mut b = best[r - 1];
        for (&s, &y) in prices {
            let s = s as usize;
            if s <= r {
                b = b.max(best[r - s] + y);
            }
        }
        best[r] = b;
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prices(weights: &[(u32, f64)]) -> SharePrices {
        SharePrices::from_weights(&weights.iter().copied().collect())
    }

    #[test]
    fn halves_are_worth_half_a_gpu_and_pair_without_regret() {
        let p = prices(&[(470, 1.0)]);
        assert!((p.price(470) - 0.5).abs() < 1e-9);
        // A 470 on an empty GPU or beside another 470: both on the best pattern.
        assert!(p.regret(1000, 470) < 1e-6);
        assert!(p.regret(530, 470) < 1e-6);
    }

    #[test]
    fn a_share_that_strands_the_rest_has_regret() {
        // 470s pair, 320s go three to a GPU, 650s take a 320 each.
        let p = prices(&[(470, 750.0), (320, 328.0), (650, 253.0), (810, 1078.0)]);
        // A 320 beside a 470 leaves 210 that nothing can use: it gives up the 470's partner.
        let bad = p.regret(530, 320);
        // A 320 beside a 650 completes a best pattern.
        let good = p.regret(350, 320);
        assert!(good < 1e-6, "{good}");
        assert!(bad > 100.0, "{bad}");
        // An 810 alone on a GPU is as good as it gets.
        assert!(p.regret(1000, 810) < 1e-6);
        // The dual optimum equals the best packing: 1078 GPUs of 810, 375 of two 470s, 253 of
        // a 650 and a 320, 25 of three 320s.
        let lp = 750.0 * p.price(470)
            + 328.0 * p.price(320)
            + 253.0 * p.price(650)
            + 1078.0 * p.price(810);
        assert!((lp - 1731.0).abs() < 1e-6, "{lp}");
    }

    #[test]
    fn one_share_is_worth_a_gpu_over_the_copies_that_fit() {
        for s in [50u32, 200, 333, 334, 499, 500, 501, 999] {
            let p = prices(&[(s, 3.0)]);
            let want = 1.0 / f64::from(1000 / s);
            assert!((p.price(s) - want).abs() < 1e-9, "{s}: {} != {want}", p.price(s));
        }
    }

    /// Every multiset of `shares` fitting one GPU (shares of at least 200: at most 5 a GPU).
    fn all_patterns(shares: &[u32]) -> Vec<Vec<u32>> {
        fn extend(
            shares: &[u32],
            from: usize,
            room: u32,
            current: &mut Vec<u32>,
            out: &mut Vec<Vec<u32>>,
        ) {
            if !current.is_empty() {
                out.push(current.clone());
            }
            for i in from..shares.len() {
                if shares[i] <= room {
                    current.push(shares[i]);
                    extend(shares, i, room - shares[i], current, out);
                    current.pop();
                }
            }
        }
        let mut out = Vec::new();
        extend(shares, 0, 1000, &mut Vec::new(), &mut out);
        out
    }

    /// The primal LP solved directly over every pattern: the fewest GPUs.
    fn primal_optimum(weights: &BTreeMap<u32, f64>) -> f64 {
        let shares: Vec<u32> = weights.keys().copied().collect();
        let patterns = all_patterns(&shares);
        let mut problem = Problem::new(OptimizationDirection::Minimize);
        let vars: Vec<_> =
            patterns.iter().map(|_| problem.add_var(1.0, (0.0, f64::INFINITY))).collect();
        for (&s, &n) in weights {
            let row: Vec<_> = patterns
                .iter()
                .zip(&vars)
                .filter_map(|(pat, &v)| {
                    let k = pat.iter().filter(|&&t| t == s).count();
                    (k > 0).then_some((v, k as f64))
                })
                .collect();
            problem.add_constraint(row, ComparisonOp::Ge, n);
        }
        problem.solve().expect("the primal is feasible").objective()
    }

    #[test]
    fn dual_is_feasible_and_tight() {
        let w = [(50, 7.0), (160, 74.0), (230, 140.0), (470, 750.0), (650, 253.0), (810, 1078.0)];
        let p = prices(&w);
        // No pattern is worth more than one GPU...
        assert!(p.best_fill(1000) <= 1.0 + 1e-6);
        // ...and the prices cover at least the items' volume lower bound (LP >= Σ n_s s / 1000).
        let lp: f64 = w.iter().map(|&(s, n)| n * p.price(s)).sum();
        let volume: f64 = w.iter().map(|&(s, n)| n * f64::from(s) / 1000.0).sum();
        assert!(lp >= volume - 1e-6, "{lp} < {volume}");
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]
        #[test]
        fn prices_are_feasible_and_regret_well_formed(
            weights in proptest::collection::btree_map(1u32..1000, 1u32..500, 1..12)
        ) {
            let w: BTreeMap<u32, f64> = weights.iter().map(|(&s, &n)| (s, f64::from(n))).collect();
            let p = SharePrices::from_weights(&w);
            // Dual feasible: no multiset of shares fitting a GPU is worth more than one GPU.
            proptest::prop_assert!(p.best_fill(1000) <= 1.0 + 1e-6);
            // The LP optimum is at least the volume bound (volume prices are feasible).
            let lp: f64 = w.iter().map(|(&s, &n)| n * p.price(s)).sum();
            let volume: f64 = w.iter().map(|(&s, &n)| n * f64::from(s) / 1000.0).sum();
            proptest::prop_assert!(lp >= volume - 1e-6 * volume.max(1.0), "{} < {}", lp, volume);
            // Unclamped, the regret is never negative (K is a knapsack over the prices), and it
            // is 0 where the share does not fit.
            for &s in w.keys() {
                for r in [s, s + (1000 - s) / 2, 999, 1000] {
                    let raw = p.best_fill(r) - p.best_fill(r - s) - p.price(s);
                    proptest::prop_assert!(raw >= -1e-9, "K({}) - K({}) - y = {}", r, r - s, raw);
                }
                proptest::prop_assert_eq!(p.regret(s / 2, s), 0.0);
            }
        }

        #[test]
        fn prices_reach_the_lp_optimum(
            weights in proptest::collection::btree_map(200u32..1000, 1u32..500, 1..7)
        ) {
            let w: BTreeMap<u32, f64> = weights.iter().map(|(&s, &n)| (s, f64::from(n))).collect();
            let p = SharePrices::from_weights(&w);
            let dual: f64 = w.iter().map(|(&s, &n)| n * p.price(s)).sum();
            let primal = primal_optimum(&w);
            proptest::prop_assert!((dual - primal).abs() <= 1e-6 * primal, "dual {} primal {}", dual, primal);
        }
    }

    #[test]
    fn no_shares_no_regret() {
        let p = SharePrices::default();
        assert_eq!(p.regret(1000, 500), 0.0);
        assert_eq!(p.best_fill(1000), 0.0);
    }
}
