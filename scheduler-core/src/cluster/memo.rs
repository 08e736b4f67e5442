//! The score memo of [`super::ClusterScheduler`]: scores of node states, keyed by a short list
//! of words that names everything the score depends on ([`super::state_key`]).
//!
//! A placement replay asks for hundreds of thousands of node states, most of them seen once, and
//! the states that do repeat (alike nodes empty or holding the same few tasks) come back soon
//! after they were first seen. So the memo keeps only recent states, in two generations of at
//! most `limit` entries each: a look-up searches the current generation, then the previous one,
//! moving what it finds there into the current one; when the current one is full it becomes the
//! previous one and the oldest is dropped. Memory stays bounded and small (about a MiB at the
//! scheduler's limit of 4,096 states) while frequently met states survive every turnover.
//!
//! Each generation stores its keys back to back in one vector and finds them through an
//! open-addressing table of entry numbers, so an insertion allocates nothing once the vectors
//! have grown, and the keys are hashed with a multiply-rotate hash (keys come from the
//! scheduler, not from an adversary, so SipHash's protection against chosen collisions buys
//! nothing here). The memo only ever returns a score stored under an equal key, so which
//! states it keeps changes how often a score is computed, never a decision.

use crate::policy::Scored;

/// A memo of at most `2 * limit` node states and their scores.
#[derive(Debug)]
pub(super) struct StateMemo {
    limit: usize,
    current: Generation,
    previous: Generation,
}

impl StateMemo {
    /// An empty memo keeping at most `limit` states per generation (at least 1).
    pub(super) fn new(limit: usize) -> Self {
        let limit = limit.max(1);
        Self { limit, current: Generation::default(), previous: Generation::default() }
    }

    /// The score stored under `key`, or `score()` stored under it and returned.
    pub(super) fn get_or_insert_with(
        &mut self,
        key: &[u64],
        score: impl FnOnce() -> Option<Scored>,
    ) -> Option<Scored> {
        let hash = hash(key);
        if let Some(found) = self.current.get(hash, key) {
            return found;
        }
        let value = match self.previous.get(hash, key) {
            Some(found) => found,
            None => score(),
        };
        if self.current.len() >= self.limit {
            std::mem::swap(&mut self.current, &mut self.previous);
            self.current.clear();
        }
        self.current.insert(hash, key, value, self.limit);
        value
    }

    /// Forgets every state.
    pub(super) fn clear(&mut self) {
        self.current.clear();
        self.previous.clear();
    }

    /// How many states are remembered.
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.current.len() + self.previous.len()
    }
}

/// One generation: keys back to back, their entries, and a table of entry numbers.
#[derive(Debug, Default)]
struct Generation {
    /// The keys, back to back.
    words: Vec<u64>,
    /// Per entry: where its key starts in `words`, its length, and its score.
    entries: Vec<Entry>,
    /// Open addressing with linear probing: `0` empty, else the entry's hash in the upper 32
    /// bits and its number plus one in the lower 32. Its length is a power of two at least
    /// twice the generation's limit, so a probe always ends on an empty slot.
    slots: Vec<u64>,
}

#[derive(Debug)]
struct Entry {
    start: usize,
    len: usize,
    value: Option<Scored>,
}

impl Generation {
    fn len(&self) -> usize {
        self.entries.len()
    }

    fn clear(&mut self) {
        self.words.clear();
        self.entries.clear();
        self.slots.iter_mut().for_each(|s| *s = 0);
    }

    fn mask(&self) -> usize {
        self.slots.len().wrapping_sub(1)
    }

    /// `Some(score)` if `key` is stored.
    #[allow(
        clippy::cast_possible_truncation,
        reason = "a slot packs a 32-bit hash tag over a 32-bit entry number, and a hash picks the table index: truncation is the encoding"
    )]
    fn get(&self, hash: u64, key: &[u64]) -> Option<Option<Scored>> {
        if self.slots.is_empty() {
            return None;
        }
        let tag = hash >> 32;
        let mut i = hash as usize & self.mask();
        loop {
            let slot = self.slots[i];
            if slot == 0 {
                return None;
            }
            if slot >> 32 == tag {
                let entry = &self.entries[(slot as u32 - 1) as usize];
                if self.words[entry.start..entry.start + entry.len] == *key {
                    return Some(entry.value);
                }
            }
            i = (i + 1) & self.mask();
        }
    }

    /// Stores `key` (not yet stored); the generation holds fewer than `limit` entries.
    #[allow(
        clippy::cast_possible_truncation,
        reason = "a slot packs a 32-bit hash tag over a 32-bit entry number, and a hash picks the table index: truncation is the encoding"
    )]
    fn insert(&mut self, hash: u64, key: &[u64], value: Option<Scored>, limit: usize) {
        if self.slots.is_empty() {
            // Limits are small (a few thousand), so this fits u32 entry numbers easily.
            self.slots = vec![0; (2 * limit).next_power_of_two()];
        }
        let number = self.entries.len() as u64 + 1;
        self.entries.push(Entry { start: self.words.len(), len: key.len(), value });
        self.words.extend_from_slice(key);
        let mut i = hash as usize & self.mask();
        while self.slots[i] != 0 {
            i = (i + 1) & self.mask();
        }
        self.slots[i] = (hash >> 32) << 32 | number;
    }
}

/// A multiply-rotate hash of the words (as rustc's FxHash), finished with MurmurHash3's 64-bit
/// mixer so that both the low bits (the slot) and the high bits (the tag) depend on every bit of
/// every word: a GPU's word has its compute in the upper half, which FxHash alone would leave
/// out of the low bits.
fn hash(key: &[u64]) -> u64 {
    const K: u64 = 0x517c_c1b7_2722_0a95;
    let mut h = key.len() as u64;
    for &w in key {
        h = (h.rotate_left(5) ^ w).wrapping_mul(K);
    }
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^ (h >> 33)
}

#[cfg(test)]
#[allow(
    clippy::cast_possible_truncation,
    clippy::cast_possible_wrap,
    clippy::cast_sign_loss,
    reason = "test data: small numbers"
)]
mod tests {
    use super::*;
    use crate::model::GpuSet;
    use proptest::prelude::*;

    fn scored(score: i64) -> Option<Scored> {
        Some(Scored { score, gpus: GpuSet::single((score & 7) as usize) })
    }

    proptest! {
        /// Whatever keys come, in whatever order, and whatever the limit, the memo returns
        /// what the scorer gives for that key: a stored score or a fresh one, never another
        /// key's; and it never holds more than two generations.
        #[test]
        fn returns_only_the_score_of_an_equal_key(
            keys in proptest::collection::vec(proptest::collection::vec(0u64..4, 0..4), 1..300),
            limit in 1usize..20,
        ) {
            let truth = |k: &[u64]| scored(k.iter().fold(k.len() as i64, |a, &w| a * 5 + w as i64));
            let mut memo = StateMemo::new(limit);
            for k in &keys {
                let got = memo.get_or_insert_with(k, || truth(k));
                prop_assert_eq!(got, truth(k));
                prop_assert!(memo.len() <= 2 * limit);
            }
        }
    }

    #[test]
    fn a_state_met_again_is_not_scored_again() {
        let mut memo = StateMemo::new(4);
        let mut scorings = 0;
        for round in 0..10 {
            for k in 0..3u64 {
                let got = memo.get_or_insert_with(&[k, 7], || {
                    scorings += 1;
                    scored(k as i64)
                });
                assert_eq!(got, scored(k as i64), "round {round}");
            }
            // A new state every round pushes the generations over.
            memo.get_or_insert_with(&[100 + round], || None);
        }
        assert_eq!(scorings, 3, "the three recurring states survive every turnover");
        memo.clear();
        assert_eq!(memo.len(), 0);
    }
}
