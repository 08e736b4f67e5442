#!/usr/bin/env bash
# MPS facts the MPS supervisor (issue 12) is built on, found on a real GPU with nothing but the
# driver's `nvidia-cuda-mps-control` and a PyTorch client (the agent does not run MPS yet).
# Each experiment prints what it did and what it saw; docs/gpu-day.md records the answers.
#   E1  a control daemon per GPU: CUDA_VISIBLE_DEVICES=<UUID>, private pipe and log directories;
#       what appears there; how long a `get_server_list` probe takes.
#   E2  a second `-d` on the same pipe directory (does it refuse, start a second one?).
#   E3  a client in a private mount namespace with its own empty /dev/shm and only the pipe
#       directory and environment the agent hands out: does it reach the server, is the limit kept?
#   E4  the same client with the host's /dev/shm (what it leaves in /dev/shm).
#   E5  two clients side by side with different limits.
#   E6  a second Linux user while the first user's client runs (MPS serves one user per server).
#   E7  the control daemon killed (SIGKILL) while its server serves a client; a new control
#       daemon on the same pipe directory (what the agent's adoption has to cope with).
#   E8  the server killed under a client; the next client.
#   E9  quit.
# Never changes MIG or compute mode. Usage: OUT=dir scripts/gpu-day-mps.sh
set -uo pipefail
OUT=${OUT:-gpu-day-mps-out}
mkdir -p "$OUT"
exec > >(tee "$OUT/mps-log.txt") 2>&1
step() { echo; echo "=== $(date +%T.%N | cut -c1-12) $*"; }
MPS=$(command -v nvidia-cuda-mps-control || true)
[ -n "$MPS" ] || { echo "nvidia-cuda-mps-control absent: nothing to do"; exit 0; }
echo "nvidia-cuda-mps-control: $MPS"; ls -l "$(dirname "$MPS")" | grep -i mps
UUID=$(nvidia-smi --query-gpu=uuid --format=csv,noheader | head -1)
echo "GPU $UUID"; echo "uname: $(uname -r)"; id
echo "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"
for t in unshare setpriv runuser su; do echo "$t: $(command -v $t || echo absent)"; done
PY=$(command -v python3)
ROOT=/tmp/baleen-mps/$UUID
PIPE=$ROOT/pipe LOG=$ROOT/log
mkdir -p "$PIPE" "$LOG"
CLIENT=/tmp/baleen-mps-client.py
cat > "$CLIENT" <<'PY'
import os, sys, time
t0 = time.time()
tag = os.environ.get("TAG", "client")
def p(*a):
    print(f"[{tag} +{time.time()-t0:5.1f}s]", *a, flush=True)
p("uid", os.getuid(), "/dev/shm:", sorted(os.listdir("/dev/shm")))
import torch
lim = float(os.environ.get("LIM_GIB", "0"))
try:
    free, total = torch.cuda.mem_get_info()
except Exception as e:
    p("CUDA init failed:", repr(e)[:300]); sys.exit(3)
p(f"CUDA up: free={free/2**30:.2f} GiB total={total/2**30:.2f} GiB")
a = torch.empty(int(max(lim - 1, 1) * 2**30), dtype=torch.uint8, device="cuda")
a.fill_(1); torch.cuda.synchronize()
p(f"allocated {max(lim-1,1):.0f} GiB: ok; /dev/shm now:", sorted(os.listdir("/dev/shm"))[:12])
w = os.environ.get("WAIT_FILE")
while w and not os.path.exists(w) and time.time() - t0 < 90:
    time.sleep(0.2)
time.sleep(float(os.environ.get("HOLD_S", "0")))
try:
    b = torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda"); b.fill_(1); torch.cuda.synchronize()
    p("2 GiB more: ok (limit NOT enforced)" if lim else "2 GiB more: ok")
except Exception as e:
    p("2 GiB more refused:", str(e).splitlines()[0][:160])
try:
    a.add_(1); torch.cuda.synchronize(); p("kernel after: ok")
except Exception as e:
    p("kernel after failed:", str(e).splitlines()[0][:160])
p("exit")
PY
chmod 644 "$CLIENT"
ctl() { local t0; t0=$(date +%s%N); echo "> $*"; echo "$*" | CUDA_MPS_PIPE_DIRECTORY=$PIPE timeout 10 "$MPS"; echo "  rc=$? in $((($(date +%s%N)-t0)/1000000)) ms"; }
procs() { ps -eo pid,user,etimes,args | grep -E "nvidia-cuda-mps|baleen-mps-client" | grep -v grep; }
# The environment an 8-unit... N-GiB gpu-memory container gets from the agent (docs/agent.md).
client_env() { echo "CUDA_MPS_PIPE_DIRECTORY=$PIPE CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=$(($1*1024))M CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$2"; }

step "E1 control daemon for one GPU"
env CUDA_VISIBLE_DEVICES="$UUID" CUDA_MPS_PIPE_DIRECTORY="$PIPE" CUDA_MPS_LOG_DIRECTORY="$LOG" timeout 20 "$MPS" -d
echo "daemon start rc=$?"; sleep 0.5
procs; ls -la "$PIPE" "$LOG"
ctl get_server_list
for i in 1 2 3; do ctl get_server_list; done
step "E2 a second -d on the same pipe directory"
env CUDA_VISIBLE_DEVICES="$UUID" CUDA_MPS_PIPE_DIRECTORY="$PIPE" CUDA_MPS_LOG_DIRECTORY="$LOG" timeout 20 "$MPS" -d
echo "second daemon rc=$?"; sleep 0.5; procs; tail -5 "$LOG/control.log"

step "E3 client, private mount namespace, own empty /dev/shm, only the pipe directory"
if unshare -m true 2>/dev/null; then
  env -i PATH=/usr/bin:/bin LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-}" HOME=/tmp TAG=E3-private-shm LIM_GIB=4 $(client_env 4 3) \
    timeout 60 unshare -m sh -c "mount -t tmpfs -o size=64m tmpfs /dev/shm && exec $PY $CLIENT"
  echo "E3 rc=$?"
else
  echo "unshare -m not possible here: $(unshare -m true 2>&1)"
fi
ctl get_server_list; procs; ls -la "$PIPE"
step "E4 client with the host /dev/shm"
ls -la /dev/shm | head
env -i PATH=/usr/bin:/bin LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-}" HOME=/tmp TAG=E4-host-shm LIM_GIB=4 $(client_env 4 3) timeout 60 "$PY" "$CLIENT"
echo "E4 rc=$?"; ls -la /dev/shm | head -20

step "E5 two clients side by side, 4 GiB and 8 GiB"
rm -f /tmp/e5-go
env -i PATH=/usr/bin:/bin LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-}" HOME=/tmp TAG=E5-4G LIM_GIB=4 WAIT_FILE=/tmp/e5-go $(client_env 4 3) timeout 90 "$PY" "$CLIENT" & a=$!
env -i PATH=/usr/bin:/bin LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-}" HOME=/tmp TAG=E5-8G LIM_GIB=8 WAIT_FILE=/tmp/e5-go $(client_env 8 6) timeout 90 "$PY" "$CLIENT" & b=$!
sleep 15; ctl get_server_list; procs; nvidia-smi --query-compute-apps=pid,used_memory --format=csv
ls -la /dev/shm | head -20
touch /tmp/e5-go; wait $a; echo "E5-4G rc=$?"; wait $b; echo "E5-8G rc=$?"

step "E6 a second Linux user (uid 1000) while a root client runs"
chmod 0755 "$ROOT"; ls -la "$PIPE"
RUNAS=""
command -v setpriv >/dev/null && RUNAS="setpriv --reuid=1000 --regid=1000 --clear-groups"
[ -z "$RUNAS" ] && command -v runuser >/dev/null && RUNAS="runuser -u nobody --"
env -i PATH=/usr/bin:/bin LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-}" HOME=/tmp TAG=E6-root LIM_GIB=4 HOLD_S=20 $(client_env 4 3) timeout 90 "$PY" "$CLIENT" & a=$!
sleep 8
echo "second user with the pipe directory as created:"
env -i PATH=/usr/bin:/bin LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-}" HOME=/tmp TAG=E6-uid1000 LIM_GIB=4 $(client_env 4 3) timeout 40 $RUNAS "$PY" "$CLIENT"
echo "E6 uid1000 rc=$? (124 = still waiting after 60 s)"
ctl get_server_list; procs
wait $a; echo "E6-root rc=$?"
echo "second user alone, pipe directory made world-writable:"
chmod -R a+rwX "$PIPE"; ls -la "$PIPE"
env -i PATH=/usr/bin:/bin LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-}" HOME=/tmp TAG=E6-uid1000-alone LIM_GIB=4 $(client_env 4 3) timeout 40 $RUNAS "$PY" "$CLIENT"
echo "E6 uid1000 alone rc=$?"; ctl get_server_list; procs; tail -15 "$LOG/control.log"

step "E7 the control daemon killed while its server serves a client"
env -i PATH=/usr/bin:/bin LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-}" HOME=/tmp TAG=E7-client LIM_GIB=4 HOLD_S=25 $(client_env 4 3) timeout 90 "$PY" "$CLIENT" & a=$!
sleep 10; procs
pkill -KILL -f "nvidia-cuda-mps-control -d"; sleep 1
echo "after SIGKILL of the control daemon:"; procs; ls -la "$PIPE"; ctl get_server_list
echo "new control daemon on the same pipe directory:"
env CUDA_VISIBLE_DEVICES="$UUID" CUDA_MPS_PIPE_DIRECTORY="$PIPE" CUDA_MPS_LOG_DIRECTORY="$LOG" timeout 20 "$MPS" -d
echo "restart rc=$?"; sleep 0.5; procs; ctl get_server_list
wait $a; echo "E7-client rc=$?"
env -i PATH=/usr/bin:/bin LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-}" HOME=/tmp TAG=E7-next LIM_GIB=4 $(client_env 4 3) timeout 60 "$PY" "$CLIENT"
echo "E7-next rc=$?"; ctl get_server_list; procs

step "E8 the server killed under a client"
env -i PATH=/usr/bin:/bin LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-}" HOME=/tmp TAG=E8-client LIM_GIB=4 HOLD_S=15 $(client_env 4 3) timeout 90 "$PY" "$CLIENT" & a=$!
sleep 10; procs
pkill -KILL -f nvidia-cuda-mps-server; sleep 1; procs; ctl get_server_list
wait $a; echo "E8-client rc=$?"
env -i PATH=/usr/bin:/bin LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-}" HOME=/tmp TAG=E8-next LIM_GIB=4 $(client_env 4 3) timeout 60 "$PY" "$CLIENT"
echo "E8-next rc=$?"; ctl get_server_list; procs

step "E9 quit"
ctl quit; sleep 2; procs; echo "processes left: $(procs | wc -l)"
tail -40 "$LOG/control.log"; echo; tail -20 "$LOG/server.log" 2>/dev/null
cp "$LOG"/*.log "$OUT/" 2>/dev/null
nvidia-smi --query-gpu=compute_mode,mig.mode.current --format=csv
