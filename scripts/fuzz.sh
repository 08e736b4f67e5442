#!/usr/bin/env bash
# Runs every cargo-fuzz target for SECONDS seconds each (default 30), seeded from the
# repository's own examples (`baleen_tests::fuzz::seeds`, written out by the fuzz_seeds test's
# helper below). Needs the nightly toolchain and `cargo install cargo-fuzz`.
# Usage: scripts/fuzz.sh [SECONDS] [TARGET...]
set -euo pipefail
cd "$(dirname "$0")/.."
SECONDS_EACH=${1:-30}
shift || true
TARGETS=("$@")
[ ${#TARGETS[@]} -gt 0 ] || TARGETS=(config topology checkpoint gpu_state extender_request admission_review quantity mps_log proc_cgroup)
command -v cargo-fuzz >/dev/null || { echo "cargo-fuzz is not installed: cargo install cargo-fuzz" >&2; exit 2; }
rustup toolchain list | grep -q nightly || { echo "the nightly toolchain is needed: rustup toolchain install nightly" >&2; exit 2; }
# Seeds: the same ones the stable test uses.
BALEEN_FUZZ_SEEDS_OUT="$PWD/fuzz/corpus" cargo test -q -p baleen-tests --test e2e -- --exact fuzz_seeds::write_seeds_when_asked >/dev/null
for t in "${TARGETS[@]}"; do
  mkdir -p "fuzz/corpus/$t"
  echo "== $t ($SECONDS_EACH s)"
  (cd fuzz && cargo +nightly fuzz run "$t" "corpus/$t" -- -max_total_time="$SECONDS_EACH" -rss_limit_mb=512 -max_len=65536 2>&1 | tail -3)
done
