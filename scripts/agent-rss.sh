#!/usr/bin/env bash
# Resident memory of a running baleen-agent serving every resource of a node to the fake kubelet
# (docs/benchmarks.md). Builds nothing: run
#   cargo build --release -p baleen-agent && cargo build --release -p baleen-tests --examples
# first. Usage:
#   scripts/agent-rss.sh [AGENT FLAGS...]
# Default flags: --simulated packaging/examples/h200-8x-nvswitch.yaml (1 GiB units). Environment:
#   EXPECT  resources to wait for (default 5: gpu, gpu-memory, nvlink-group-2/4/8)
#   ADMIT   space-separated RESOURCE=COUNT admissions (default: 8 gpu-memory units and 1 GPU)
#   OUT     directory for the kubelet's JSON and the agent's log (default: a temp dir)
set -euo pipefail
cd "$(dirname "$0")/.."
AGENT=${AGENT:-target/release/baleen-agent}
KUBELET=${KUBELET:-target/release/examples/fake-kubelet}
EXPECT=${EXPECT:-5}
ADMIT=${ADMIT:-"awesome-ai-company.com/gpu-memory=8 awesome-ai-company.com/gpu=1"}
for bin in "$AGENT" "$KUBELET"; do
  [ -x "$bin" ] || { echo "missing $bin: cargo build --release -p baleen-agent && cargo build --release -p baleen-tests --examples" >&2; exit 1; }
done
T=$(mktemp -d)
OUT=${OUT:-$T}
mkdir -p "$OUT"
echo "rss-measurement-boot" > "$T/boot_id"
flags=("$@")
# A simulated node has no GPU to run MPS on: its gpu-memory units are accounting only.
[ ${#flags[@]} -gt 0 ] || flags=(--simulated packaging/examples/h200-8x-nvswitch.yaml --no-mps)
mkdir -p "$T/dp"  # the kubelet makes it on a node; the agent refuses one that is missing
"$AGENT" "${flags[@]}" --node-name rss-node --device-plugin-dir "$T/dp" \
  --pod-resources-socket "$T/pr.sock" --state-dir "$T/state" --boot-id-file "$T/boot_id" \
  --log-level info 2> "$OUT/agent.log" &
agent_pid=$!
trap 'kill $agent_pid 2>/dev/null || true; rm -rf "$T"' EXIT
admit=()
for a in $ADMIT; do admit+=(--admit "$a"); done
"$KUBELET" --dir "$T/dp" --pod-resources "$T/pr.sock" --expect "$EXPECT" "${admit[@]}" \
  --hold-secs 3 > "$OUT/kubelet.json" &
kubelet_pid=$!
# The kubelet prints its JSON once registrations and admissions are done, then holds.
for _ in $(seq 1 300); do
  [ -s "$OUT/kubelet.json" ] && grep -q '^}' "$OUT/kubelet.json" && break
  kill -0 $kubelet_pid 2>/dev/null || break
  sleep 0.1
done
cat "$OUT/kubelet.json"
grep -E '^(VmRSS|VmHWM)' "/proc/$agent_pid/status"
wait $kubelet_pid
kill -TERM $agent_pid
wait $agent_pid && echo "agent exited 0 after SIGTERM"
