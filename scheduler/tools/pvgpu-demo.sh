#!/bin/sh
# pvgpu demo: pvgpud with the simulated GPU, three host tasks with very
# different kernel lengths, live shares from pvgpuctl; then a weight change.
# Everything runs unprivileged in a temporary directory and is cleaned up.
# Usage: scheduler/tools/pvgpu-demo.sh [BUILD_DIR] [SECONDS_PER_PHASE]
set -eu
build=${1:-build}
phase=${2:-4}
pvgpud=$build/scheduler/daemon/pvgpud
load=$build/scheduler/tools/pvgpu-load
ctl=$build/scheduler/ctl/pvgpuctl
for b in "$pvgpud" "$load" "$ctl"; do
    [ -x "$b" ] || { echo "pvgpu-demo: $b not built; run ./setup.sh first" >&2; exit 1; }
done

dir=$(mktemp -d)
pids=""
cleanup() {
    # Loads first, then the daemon (the first pid), so nobody reconnects.
    for p in $pids; do kill "$p" 2>/dev/null || true; done
    for p in $pids; do wait "$p" 2>/dev/null || true; done
    [ -n "${daemon_pid:-}" ] && kill "$daemon_pid" 2>/dev/null
    wait 2>/dev/null || true
    rm -rf "$dir"
}
trap cleanup EXIT INT TERM

# Start the daemon and wait until it says it listens (no sleeping on it).
mkfifo "$dir/log"
"$pvgpud" --config /dev/null --socket "$dir/pvgpud.sock" --admin-socket "$dir/admin.sock" \
    --state-dir "$dir/state" 2> "$dir/log" &
daemon_pid=$!
while IFS= read -r line; do
    case $line in *"pvgpud: ready"*) break ;; esac
done < "$dir/log" 3<> "$dir/log"
cat "$dir/log" > /dev/null &   # keep draining the daemon's log
export PVGPU_SOCKET=$dir/pvgpud.sock PVGPU_ADMIN_SOCKET=$dir/admin.sock

echo "== pvgpud (policy hfq, simulated round-robin GPU) with three host tasks:"
echo "   long: 4 ms kernels   medium: 1 ms kernels   short: 0.2 ms kernels, 4 per batch"
"$load" throttle --kernel-us 4000 --name long > /dev/null &
pids="$pids $!"
"$load" throttle --kernel-us 1000 --name medium > /dev/null &
pids="$pids $!"
"$load" throttle --kernel-us 200 --batch 4 --name short > /dev/null &
pids="$pids $!"

echo "== equal weights: each should get a third"
"$ctl" top --interval 1 --count "$phase"
echo
# Host tasks are host/USER/NAME (USER: who runs them).
user=$(id -un)
echo "== pvgpuctl set-weight host/$user/long 400: long should get 4/6, the others 1/6"
"$ctl" set-weight "host/$user/long" 400
"$ctl" top --interval 1 --count "$phase"
echo
"$ctl" list
