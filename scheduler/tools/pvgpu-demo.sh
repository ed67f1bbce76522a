#!/bin/sh
# pvgpu demo: pvgpud with the simulated GPU, three host tasks with very
# different kernel lengths, live shares from pvgpuctl; then a weight change.
# With --gpus 2, pvgpud drives two simulated GPUs: the three tasks share
# gpu0 as before and two more tasks share gpu1, scheduled independently.
# Everything runs unprivileged in a temporary directory and is cleaned up.
# Usage: scheduler/tools/pvgpu-demo.sh [--gpus N] [BUILD_DIR] [SECONDS_PER_PHASE]
set -eu
usage() {
    cat <<'EOF'
usage: pvgpu-demo.sh [--gpus N] [BUILD_DIR] [SECONDS_PER_PHASE]

Starts pvgpud on simulated GPUs in a temporary directory (unprivileged
sockets), runs three host tasks with 4 ms, 1 ms and 0.2 ms kernels on GPU 0,
shows their live shares with pvgpuctl top, then gives one task weight 400
and shows the shares move.

  --gpus N             simulated GPUs (pvgpud --gpus N; default: pvgpud's
                       one GPU).  With 2 or more, two more tasks (2 ms and
                       0.5 ms kernels) run on GPU 1, and the views show
                       every GPU: the weight change on GPU 0 leaves GPU 1's
                       split alone.
  BUILD_DIR            meson build directory (default: build)
  SECONDS_PER_PHASE    top refreshes per phase, one a second (default: 4)
  -h, --help           this help
EOF
}
gpus=""
while [ $# -gt 0 ]; do
    case $1 in
        -h|--help) usage; exit 0 ;;
        --gpus) [ $# -ge 2 ] || { echo "pvgpu-demo: --gpus needs a number" >&2; exit 2; }
                gpus=$2; shift 2 ;;
        --gpus=*) gpus=${1#--gpus=}; shift ;;
        --) shift; break ;;
        -*) echo "pvgpu-demo: unknown option '$1' (see --help)" >&2; exit 2 ;;
        *) break ;;
    esac
done
if [ -n "$gpus" ]; then
    case $gpus in
        ''|*[!0-9]*) echo "pvgpu-demo: --gpus needs a number of GPUs, got '$gpus'" >&2; exit 2 ;;
    esac
    [ "$gpus" -ge 1 ] || { echo "pvgpu-demo: --gpus needs at least 1" >&2; exit 2; }
fi
build=${1:-build}
phase=${2:-4}
pvgpud=$build/scheduler/daemon/pvgpud
load=$build/scheduler/tools/pvgpu-load
ctl=$build/scheduler/ctl/pvgpuctl
for b in "$pvgpud" "$load" "$ctl"; do
    [ -x "$b" ] || { echo "pvgpu-demo: $b not built; run ./setup.sh first" >&2; exit 1; }
done

# pvgpud --gpus and pvgpu-load --gpu came with several GPUs (issue 49); an
# older build would fail at start, and the demo wait for it forever.
if [ -n "$gpus" ]; then
    "$pvgpud" --help | grep -q -- '--gpus' ||
        { echo "pvgpu-demo: $pvgpud has no --gpus option; rebuild" >&2; exit 1; }
    [ "$gpus" -lt 2 ] || "$load" --help 2>&1 | grep -q -- '--gpu ' ||
        { echo "pvgpu-demo: $load has no --gpu option; rebuild" >&2; exit 1; }
fi

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
    --state-dir "$dir/state" ${gpus:+--gpus "$gpus"} 2> "$dir/log" &
daemon_pid=$!
while IFS= read -r line; do
    case $line in *"pvgpud: ready"*) break ;; esac
done < "$dir/log" 3<> "$dir/log"
cat "$dir/log" > /dev/null &   # keep draining the daemon's log
export PVGPU_SOCKET=$dir/pvgpud.sock PVGPU_ADMIN_SOCKET=$dir/admin.sock

two=""
[ -n "$gpus" ] && [ "$gpus" -ge 2 ] && two=1
# With several GPUs each task names its GPU (pvgpu-load --gpu); pvgpud would
# otherwise place all of one user's tasks on one GPU.
on0=""
[ -n "$two" ] && on0="--gpu 0"

if [ -n "$two" ]; then
    echo "== pvgpud (policy hfq, $gpus simulated round-robin GPUs) with five host tasks:"
    echo "   gpu0: long: 4 ms kernels   medium: 1 ms kernels   short: 0.2 ms kernels, 4 per batch"
    echo "   gpu1: wide: 2 ms kernels   narrow: 0.5 ms kernels"
else
    echo "== pvgpud (policy hfq, simulated round-robin GPU) with three host tasks:"
    echo "   long: 4 ms kernels   medium: 1 ms kernels   short: 0.2 ms kernels, 4 per batch"
fi
# shellcheck disable=SC2086 # $on0 is empty or two words
"$load" throttle $on0 --kernel-us 4000 --name long > /dev/null &
pids="$pids $!"
# shellcheck disable=SC2086
"$load" throttle $on0 --kernel-us 1000 --name medium > /dev/null &
pids="$pids $!"
# shellcheck disable=SC2086
"$load" throttle $on0 --kernel-us 200 --batch 4 --name short > /dev/null &
pids="$pids $!"
if [ -n "$two" ]; then
    "$load" throttle --gpu 1 --kernel-us 2000 --name wide > /dev/null &
    pids="$pids $!"
    "$load" throttle --gpu 1 --kernel-us 500 --batch 2 --name narrow > /dev/null &
    pids="$pids $!"
fi

if [ -n "$two" ]; then
    echo "== equal weights: each task should get a third of gpu0, each a half of gpu1"
else
    echo "== equal weights: each should get a third"
fi
"$ctl" top --interval 1 --count "$phase"
echo
# Host tasks are host/USER/NAME (USER: who runs them).
user=$(id -un)
if [ -n "$two" ]; then
    echo "== pvgpuctl set-weight host/$user/long 400: on gpu0 long should get 4/6, the others 1/6;"
    echo "   gpu1 keeps its halves"
else
    echo "== pvgpuctl set-weight host/$user/long 400: long should get 4/6, the others 1/6"
fi
"$ctl" set-weight "host/$user/long" 400
"$ctl" top --interval 1 --count "$phase"
echo
"$ctl" list
