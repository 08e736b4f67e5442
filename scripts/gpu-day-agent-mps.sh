#!/usr/bin/env bash
# The MPS part of the GPU day (issue 12): the agent itself runs the MPS daemon on the real GPU.
#   A. baleen-agent on the real NVML starts (or adopts) one control daemon per GPU; the fake
#      kubelet program admits two gpu-memory containers (4 and 8 units);
#   B. each admission's answer, and nothing else, is given to a PyTorch client in a private mount
#      namespace (its own /dev/shm, the answer's mounts bound, only the answer's environment):
#      both side by side, each allocates under its limit and is refused past it;
#   C. the daemon killed: the agent withdraws the units, restarts it, and a new client works;
#   D. a client of another user (uid 1000) while a root client runs;
#   E. SIGTERM: the agent exits and leaves the daemon serving (mps.stopOnExit false); then quit.
# Never changes MIG or compute mode. Needs BIN=dir with baleen-agent and fake-kubelet (release).
# Writes under $OUT (default ./gpu-day-agent-mps-out). AGENT_FLAGS adds agent flags (a dry run
# without a GPU: AGENT_FLAGS="--simulated packaging/examples/h200-1x-gpu-day.yaml" with the fake
# control binary first on PATH as nvidia-cuda-mps-control).
set -uo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-.devbin}
OUT=${OUT:-gpu-day-agent-mps-out}
mkdir -p "$OUT"
exec > >(tee "$OUT/agent-mps-log.txt") 2>&1
step() { echo; echo "=== $(date +%T) $*"; }
command -v nvidia-cuda-mps-control >/dev/null || { echo "nvidia-cuda-mps-control absent: skipped"; exit 0; }
PY=$(command -v python3)
T=$(mktemp -d /tmp/baleen-gd.XXXX)
chmod 755 "$T"  # the other user's client reads client.py here
echo "gpu-day-boot" > "$T/boot_id"
cat > "$T/agent.yaml" <<'YAML'
mps:
  probeInterval: 1s
YAML
CLIENT=$T/client.py
cat > "$CLIENT" <<'PY'
import os, sys, time
t0 = time.time()
tag = os.environ.get("TAG", "client")
def p(*a):
    print(f"[{tag} +{time.time()-t0:5.1f}s]", *a, flush=True)
limit = int(os.environ["BALEEN_GPU_MEMORY_LIMIT_BYTES"]) / 2**30
p("uid", os.getuid(), "limit", limit, "GiB; env:", {k: v for k, v in os.environ.items() if k.startswith(("CUDA_MPS", "NVIDIA", "BALEEN"))})
import torch
try:
    free, total = torch.cuda.mem_get_info()
except Exception as e:
    p("CUDA init failed:", repr(e)[:300]); sys.exit(3)
p(f"CUDA up: free={free/2**30:.2f} GiB total={total/2**30:.2f} GiB")
a = torch.empty(int((limit - 1) * 2**30), dtype=torch.uint8, device="cuda"); a.fill_(1); torch.cuda.synchronize()
p(f"allocated {limit-1:.0f} GiB: ok")
w = os.environ.get("WAIT_FILE")
while w and not os.path.exists(w) and time.time() - t0 < 60:
    time.sleep(0.2)
time.sleep(float(os.environ.get("HOLD_S", "0")))
try:
    b = torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda"); b.fill_(1); torch.cuda.synchronize()
    p("2 GiB more: ok (limit NOT enforced)")
except Exception as e:
    p("2 GiB more refused:", str(e).splitlines()[0][:120])
p("exit")
PY
chmod 644 "$CLIENT"
# Runs admission N's answer as a container would get it: private mounts, its env only.
run_as_container() {
  local n=$1; shift
  local env_args mounts
  env_args=$("$PY" -c "import json,sys; a=json.load(open('$T/kubelet.json'))['admissions'][$n]; print(' '.join(f'{k}={v}' for k,v in a['envs'].items()))")
  mounts=$("$PY" -c "import json,sys; a=json.load(open('$T/kubelet.json'))['admissions'][$n]; print(' '.join(f'mkdir -p {c} && mount --bind {h} {c} &&' for h,c in a['mounts']))")
  unshare -m sh -c "mount --make-rprivate / && mount -t tmpfs -o size=64m tmpfs /dev/shm && $mounts exec env -i PATH=/usr/bin:/bin LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-} HOME=/tmp $env_args $* $PY $CLIENT"
}

step "A. the agent on real NVML; it starts the MPS daemon itself"
mkdir -p "$T/dp"  # the kubelet makes it on a node; the agent refuses one that is missing
"$BIN/baleen-agent" --config "$T/agent.yaml" --node-name gpu-node --device-plugin-dir "$T/dp" \
  --pod-resources-socket "$T/pr.sock" --state-dir "$T/state" --boot-id-file "$T/boot_id" \
  --mps-root "$T/mps" --log-format text ${AGENT_FLAGS:-} 2> "$OUT/agent.log" &
agent=$!
timeout 60 "$BIN/fake-kubelet" --dir "$T/dp" --pod-resources "$T/pr.sock" --expect 2 \
  --admit awesome-ai-company.com/gpu-memory=4 --admit awesome-ai-company.com/gpu-memory=8 > "$T/kubelet.json"
echo "fake kubelet rc=$?"; cp "$T/kubelet.json" "$OUT/kubelet.json"
"$PY" -c "import json; d=json.load(open('$T/kubelet.json')); [print(a.get('devices', a.get('error')), a.get('envs'), a.get('mounts')) for a in d['admissions']]"
ps -eo pid,user,args | grep -E "nvidia-cuda-mps" | grep -v grep
grep -E "MPS|mps" "$OUT/agent.log" | sed 's/\x1b\[[0-9;]*m//g' | head

step "B. two containers side by side, 4 and 8 GiB, only what the answers give"
rm -f "$T/go"
run_as_container 0 TAG=B-4G WAIT_FILE="$T/go" & a=$!
run_as_container 1 TAG=B-8G WAIT_FILE="$T/go" & b=$!
sleep 12; nvidia-smi --query-compute-apps=pid,used_memory --format=csv; touch "$T/go"
wait $a; echo "B-4G rc=$?"; wait $b; echo "B-8G rc=$?"

step "C. the daemon killed: withdrawn, restarted by the agent, a new client works"
pkill -KILL -f "nvidia-cuda-mps-control -d"; sleep 4
ps -eo pid,user,args | grep -E "nvidia-cuda-mps" | grep -v grep
sed 's/\x1b\[[0-9;]*m//g' "$OUT/agent.log" | grep -E "MPS daemon" | tail -4
run_as_container 0 TAG=C-after-restart; echo "C rc=$?"

step "D. another user (uid 1000) while a root client runs"
run_as_container 0 TAG=D-root HOLD_S=15 & a=$!
sleep 6
run_as_container 1 TAG=D-uid1000 timeout 40 setpriv --reuid=1000 --regid=1000 --clear-groups; echo "D uid1000 rc=$? (124: still waiting)"
wait $a; echo "D-root rc=$?"

step "E. SIGTERM: the agent leaves the daemon serving"
kill -TERM $agent; wait $agent; echo "agent exit=$?"
ps -eo pid,user,args | grep -E "nvidia-cuda-mps" | grep -v grep
for pipe in "$T"/mps/*/pipe; do
  echo get_server_list | CUDA_MPS_PIPE_DIRECTORY=$pipe timeout 10 nvidia-cuda-mps-control; echo "probe after exit rc=$?"
  echo quit | CUDA_MPS_PIPE_DIRECTORY=$pipe timeout 10 nvidia-cuda-mps-control; echo "quit rc=$?"
done
sleep 1; echo "MPS processes left: $(pgrep -fc nvidia-cuda-mps)"
sed -i 's/\x1b\[[0-9;]*m//g' "$OUT/agent.log"
cp "$T"/mps/*/log/control.log "$OUT/control.log" 2>/dev/null
nvidia-smi --query-gpu=compute_mode,mig.mode.current --format=csv
