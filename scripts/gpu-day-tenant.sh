#!/usr/bin/env bash
# Device checks for issue 21 (items 1-3), for the next GPU day. Never changes MIG or compute mode.
# Prints what it did and saw; docs/gpu-day.md gets the answers.
#   T1  a CUDA client with only NVIDIA_VISIBLE_DEVICES set (no grant) under the node's toolkit
#       config: what the toolkit's accept-nvidia-visible-devices-envvar-when-unprivileged says.
#   T2  an MPS daemon; a root client and a uid-65534 client with the pipe directory bound
#       read-only in their own mount namespace: does CUDA work (read-only suffices)? can each
#       send `get_server_list` / `quit` through the privileged socket? can it delete `control`?
#   T3  a client that unsets CUDA_MPS_PINNED_DEVICE_MEM_LIMIT, and one that raises it, with the
#       daemon's default limit set by set_default_device_pinned_mem_limit: what each can allocate.
#   T4  (issue 22, item 7) the agent's MPS client probe (`baleen-agent mps-client-probe`, as the
#       agent runs it: env -i, the GPU, the pipe directory, a 64 MiB limit) against the daemon
#       (expected: exit 0, about 62 MiB free), against an empty pipe directory (expected: exit 1,
#       "not an MPS client": the driver runs the context without MPS), and its time.
#   T5  (issue 39, item 3) a setuid-root copy of nvidia-cuda-mps-control run by uid 65534 with
#       the pipe directory read-only: without no_new_privs its euid is 0 and `quit` is
#       expected to reach the daemon (why the install asks allowPrivilegeEscalation: false);
#       with no_new_privs (what allowPrivilegeEscalation: false sets) `quit` must be refused.
# Usage: OUT=dir AGENT=target/release/baleen-agent scripts/gpu-day-tenant.sh
set -uo pipefail
OUT=${OUT:-gpu-day-tenant-out}
mkdir -p "$OUT"
exec > >(tee "$OUT/tenant-log.txt") 2>&1
step() { echo; echo "=== $(date +%T) $*"; }
MPS=$(command -v nvidia-cuda-mps-control || true)
[ -n "$MPS" ] || { echo "nvidia-cuda-mps-control absent: nothing to do"; exit 0; }
UUID=$(nvidia-smi --query-gpu=uuid --format=csv,noheader | head -1)
echo "GPU $UUID"; nvidia-smi --query-gpu=compute_mode,mig.mode.current --format=csv
step "T1 toolkit configuration"
cat /etc/nvidia-container-runtime/config.toml 2>&1 | grep -E "accept-nvidia|^\[" || echo "no toolkit config here"
ls /etc/cdi /var/run/cdi 2>&1; grep -h "name:" /etc/cdi/*.yaml /var/run/cdi/*.yaml 2>/dev/null | head -20
ROOT=/tmp/baleen-tenant/$UUID; PIPE=$ROOT/pipe; LOG=$ROOT/log; VIEW=/tmp/baleen-tenant/view
mkdir -p "$PIPE" "$LOG" "$VIEW"; chmod 755 /tmp/baleen-tenant "$ROOT"
CUDA_VISIBLE_DEVICES=$UUID CUDA_MPS_PIPE_DIRECTORY=$PIPE CUDA_MPS_LOG_DIRECTORY=$LOG "$MPS" -d
sleep 1; ls -la "$PIPE"
CLIENT=/tmp/baleen-tenant/client.py
cat > "$CLIENT" <<'PY'
import os, torch
free, total = torch.cuda.mem_get_info()
print(f"uid {os.getuid()} CUDA up: free={free/2**30:.2f} GiB")
for gib in (3, 6, 12):
    try:
        a = torch.empty(int(gib * 2**30), dtype=torch.uint8, device="cuda"); a.fill_(1)
        torch.cuda.synchronize(); print(f"  {gib} GiB allocated"); del a
    except Exception as e:
        print(f"  {gib} GiB refused: {str(e)[:80]}")
PY
tenant() { # uid, then the command, in a mount namespace with the pipe directory read-only
  local uid=$1; shift
  unshare --mount --propagation private sh -c "mount --bind $PIPE $VIEW && mount -o remount,bind,ro $VIEW && exec setpriv --reuid $uid --regid $uid --clear-groups env -i PATH=$PATH HOME=/tmp CUDA_MPS_PIPE_DIRECTORY=$VIEW $*"
}
step "T2 clients with the pipe directory read-only"
timeout 60 tenant 0 CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=4096M python3 "$CLIENT"
echo "root get_server_list:"; echo get_server_list | timeout 10 tenant 0 "$MPS"; echo "rc=$?"
echo "uid 65534 get_server_list:"; echo get_server_list | timeout 10 tenant 65534 "$MPS"; echo "rc=$?"
echo "root rm control:"; timeout 10 tenant 0 rm -f "$VIEW/control"; echo "rc=$?"; ls -la "$PIPE"
step "T3 a client's own limit against the daemon's default"
echo "set_default_device_pinned_mem_limit 0 8G" | CUDA_MPS_PIPE_DIRECTORY=$PIPE "$MPS"
echo "unset:"; timeout 60 tenant 0 python3 "$CLIENT"
echo "raised to 64G:"; timeout 60 tenant 0 CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=65536M python3 "$CLIENT"
echo "lowered to 4G:"; timeout 60 tenant 0 CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=4096M python3 "$CLIENT"
step "uid 65534 quit through the privileged socket (expected: refused)"
echo quit | timeout 10 tenant 65534 "$MPS"; echo "rc=$?"
echo get_server_list | CUDA_MPS_PIPE_DIRECTORY=$PIPE "$MPS"; echo "daemon answers: rc=$?"
step "T5 a setuid-root copy of the control binary, uid 65534 (expected: refused with no_new_privs)"
SUID=/tmp/baleen-tenant/suid-mps-control
cp "$MPS" "$SUID"; chown root:root "$SUID"; chmod 4755 "$SUID"; ls -la "$SUID"
findmnt -no OPTIONS -T "$SUID"  # nosuid here would hide what a setuid bit does
nnp() { # uid, then the command: tenant() with no_new_privs set before the exec
  local uid=$1; shift
  unshare --mount --propagation private sh -c "mount --bind $PIPE $VIEW && mount -o remount,bind,ro $VIEW && exec setpriv --no-new-privs --reuid $uid --regid $uid --clear-groups env -i PATH=$PATH HOME=/tmp CUDA_MPS_PIPE_DIRECTORY=$VIEW $*"
}
echo "with no_new_privs, quit:"; echo quit | timeout 10 nnp 65534 "$SUID"; echo "rc=$?"
echo get_server_list | CUDA_MPS_PIPE_DIRECTORY=$PIPE "$MPS"; echo "daemon still answers: rc=$? (expected 0)"
echo "without no_new_privs, get_server_list (quit not sent, so T4 still has a daemon):"
echo get_server_list | timeout 10 tenant 65534 "$SUID"; echo "rc=$? (0: the setuid copy reached control_privileged)"
rm -f "$SUID"
step "T4 the agent's MPS client probe"
AGENT=${AGENT:-target/release/baleen-agent}
if [ -x "$AGENT" ]; then
  # Its peak RSS matters: the child counts against the agent container's memory limit.
  TIMER=(); [ -x /usr/bin/time ] && TIMER=(/usr/bin/time -f "%M KiB peak RSS, %e s")
  probe() { env -i CUDA_VISIBLE_DEVICES=$UUID CUDA_MPS_PIPE_DIRECTORY=$1 CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=64M \
    timeout 30 "${TIMER[@]}" "$AGENT" mps-client-probe --library libcuda.so.1; echo "rc=$?"; }
  echo "through the daemon:"; time probe "$PIPE"
  mkdir -p /tmp/baleen-tenant/empty-pipe
  echo "no daemon there:"; time probe /tmp/baleen-tenant/empty-pipe
else
  echo "$AGENT absent: build it with cargo build --release -p baleen-agent"
fi
step "cleanup"
echo quit | CUDA_MPS_PIPE_DIRECTORY=$PIPE "$MPS"
nvidia-smi --query-gpu=compute_mode,mig.mode.current --format=csv
