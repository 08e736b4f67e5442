//! Issue 22, item 4: every fuzz target's body (`baleen_tests::fuzz`, run by cargo-fuzz from
//! `fuzz/`) over its seeds from the repository's own examples and over mutations of them (bit
//! flips, cut, repeated and spliced bytes, extreme numbers), on stable Rust: none may panic,
//! and each call is timed so that a parser that slows to a crawl fails here too.

use std::time::{Duration, Instant};

use baleen_tests::fuzz::{TARGETS, seeds};

/// Mutations per target (deterministic: the generator is seeded with the target's index).
const MUTATIONS: usize = 1500;

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        // xorshift64*
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: usize) -> usize {
        usize::try_from(self.next() % (n.max(1) as u64)).unwrap_or(0)
    }
}

fn mutate(rng: &mut Rng, seeds: &[Vec<u8>]) -> Vec<u8> {
    let mut data = seeds[rng.below(seeds.len())].clone();
    for _ in 0..=rng.below(4) {
        let at = rng.below(data.len() + 1);
        match rng.below(7) {
            0 if !data.is_empty() => {
                let i = rng.below(data.len());
                data[i] ^= 1 << rng.below(8);
            }
            1 => data.truncate(at),
            2 => {
                let other = &seeds[rng.below(seeds.len())];
                let from = rng.below(other.len() + 1);
                data.splice(at..at, other[from..].iter().copied().take(256));
            }
            3 => {
                let extreme: &[u8] = [
                    &b"18446744073709551615"[..],
                    b"-9223372036854775808",
                    b"4294967295",
                    b"1e308",
                    b"NaN",
                    b"\"",
                    b"{",
                    b"\n- ",
                    b"\xff\xfe",
                ][rng.below(9)];
                data.splice(at..at, extreme.iter().copied());
            }
            4 if at < data.len() => {
                let end = (at + 1 + rng.below(64)).min(data.len());
                let chunk: Vec<u8> = data[at..end].to_vec();
                data.splice(at..at, chunk.iter().copied().cycle().take(chunk.len() * 8));
            }
            5 if at < data.len() => {
                let end = (at + 1 + rng.below(32)).min(data.len());
                data.drain(at..end);
            }
            _ => data.insert(at, u8::try_from(rng.below(256)).unwrap_or(0)),
        }
    }
    data
}

#[test]
fn every_fuzz_body_survives_its_seeds_and_their_mutations() {
    for (i, (name, body)) in TARGETS.iter().enumerate() {
        let seeds = seeds(name);
        assert!(!seeds.is_empty(), "{name}: no seed");
        let mut slowest = Duration::ZERO;
        for seed in &seeds {
            body(seed);
        }
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ (i as u64 + 1));
        for _ in 0..MUTATIONS {
            let data = mutate(&mut rng, &seeds);
            let started = Instant::now();
            body(&data);
            slowest = slowest.max(started.elapsed());
        }
        assert!(slowest < Duration::from_secs(2), "{name}: one input took {slowest:?}");
    }
}

/// Writes every target's seeds under `$BALEEN_FUZZ_SEEDS_OUT/<target>/` (for `scripts/fuzz.sh`);
/// without the variable it only checks that there are seeds to write.
#[test]
fn write_seeds_when_asked() {
    let out = std::env::var_os("BALEEN_FUZZ_SEEDS_OUT");
    for (name, _) in TARGETS {
        let seeds = seeds(name);
        assert!(!seeds.is_empty(), "{name}");
        if let Some(out) = &out {
            let dir = std::path::Path::new(out).join(name);
            std::fs::create_dir_all(&dir).expect("corpus dir");
            for (i, seed) in seeds.iter().enumerate() {
                std::fs::write(dir.join(format!("seed-{i}")), seed).expect("seed");
            }
        }
    }
}
