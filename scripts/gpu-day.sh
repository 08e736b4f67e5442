#!/usr/bin/env bash
# The GPU-day check, run on a machine with a real NVIDIA GPU and driver (no kubelet needed):
#   1. nvidia-smi -q, and whether nvidia-cuda-mps-control exists;
#   2. `baleen-agent inventory` against the real NVML (table and JSON), then the whole agent on
#      real NVML registered with the fake kubelet, a gpu-memory and a whole-GPU admission, and
#      the agent's resident memory;
#   3. MPS by hand: start a control daemon on private pipe/log directories, set and read default limits,
#      run a PyTorch client with the limit the agent hands out (CUDA_MPS_PINNED_DEVICE_MEM_LIMIT),
#      quit;
#   4. the agent running MPS itself, with containers given only its answers
#      (scripts/gpu-day-agent-mps.sh). Never changes MIG or compute mode.
# Needs the release binaries: BIN=dir holding baleen-agent and fake-kubelet (default .device/bin).
# Writes everything under $OUT (default ./gpu-day-out).
set -uo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-.device/bin}
OUT=${OUT:-gpu-day-out}
mkdir -p "$OUT"
exec > >(tee "$OUT/log.txt") 2>&1
step() { echo; echo "=== $*"; }

step "1. nvidia-smi -q"
timeout 60 nvidia-smi -q > "$OUT/nvidia-smi-q.txt" 2>&1; echo "rc=$?"
grep -E "Driver Version|CUDA Version|Product Name|Product Architecture|GPU UUID|Bus Id|MIG Mode|Current  |Compute Mode|^\s+Total\s+:|Persistence" "$OUT/nvidia-smi-q.txt" | head -40
timeout 30 nvidia-smi topo -m 2>&1 | head -20
MPS=$(command -v nvidia-cuda-mps-control || true)
echo "nvidia-cuda-mps-control: ${MPS:-absent}"
ls -l /dev/nvidia* 2>&1 | head

step "2a. baleen-agent inventory (real NVML)"
timeout 60 "$BIN/baleen-agent" inventory; echo "rc=$?"
timeout 60 "$BIN/baleen-agent" inventory --output json > "$OUT/inventory.json"; echo "json rc=$?"

step "2b. the agent on real NVML with the fake kubelet; RSS"
AGENT="$BIN/baleen-agent" KUBELET="$BIN/fake-kubelet" EXPECT=${EXPECT:-2} \
  ADMIT="awesome-ai-company.com/gpu-memory=8 awesome-ai-company.com/gpu=1" OUT="$OUT/agent" \
  timeout 120 bash scripts/agent-rss.sh --log-format text; echo "rc=$?"
tail -25 "$OUT/agent/agent.log"
# The agent left its MPS daemon serving (mps.stopOnExit false): stop it before step 3's own.
for pipe in /run/baleen/mps/*/pipe; do
  [ -d "$pipe" ] && echo quit | CUDA_MPS_PIPE_DIRECTORY=$pipe timeout 10 nvidia-cuda-mps-control
done

step "3. MPS"
if [ -n "$MPS" ]; then
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/baleen-mps/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/baleen-mps/log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  ctl() { echo "> $*"; echo "$*" | timeout 20 nvidia-cuda-mps-control; echo "  rc=$?"; }
  timeout 20 nvidia-cuda-mps-control -d; echo "daemon start rc=$?"
  ctl get_server_list
  ctl set_default_active_thread_percentage 25
  ctl get_default_active_thread_percentage
  ctl set_default_device_pinned_mem_limit 0 16G
  ctl get_default_device_pinned_mem_limit 0
  # A client with the limit the agent gives an 8-unit (8 GiB) gpu-memory allocation.
  CUDA_MPS_PINNED_DEVICE_MEM_LIMIT="0=8192M" CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=6 timeout 120 python3 - <<'PY'
import torch
print("cuda available:", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
free, total = torch.cuda.mem_get_info()
print(f"mem_get_info under MPS: free={free/2**30:.2f} GiB total={total/2**30:.2f} GiB")
a = torch.empty(6 * 2**30, dtype=torch.uint8, device="cuda")
print("allocated 6 GiB: ok")
try:
    b = torch.empty(4 * 2**30, dtype=torch.uint8, device="cuda")
    print("allocated 4 GiB more: ok (limit NOT enforced)")
except RuntimeError as e:
    print("allocating 4 GiB more failed as the 8 GiB limit requires:", str(e).splitlines()[0])
PY
  echo "client rc=$?"
  ctl get_server_list
  ctl quit
  sleep 1
  mkdir -p "$OUT/mps"
  cp "$CUDA_MPS_LOG_DIRECTORY"/*.log "$OUT/mps/" 2>/dev/null; ls "$OUT/mps"
  tail -20 "$CUDA_MPS_LOG_DIRECTORY"/control.log 2>/dev/null
else
  echo "MPS control binary absent: skipped"
fi
step "compute mode after (unchanged)"
timeout 30 nvidia-smi --query-gpu=compute_mode,mig.mode.current --format=csv

step "4. the agent's own MPS (scripts/gpu-day-agent-mps.sh)"
BIN="$BIN" OUT="$OUT/agent-mps" bash scripts/gpu-day-agent-mps.sh; echo "rc=$?"
