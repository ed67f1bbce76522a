#!/usr/bin/env python3
"""pvgpud's CPU against the number of GPUs it drives (issue 49 section 6).

For each GPU count G: one pvgpud with --gpus G, N throttles on each GPU
(pvgpu-load --gpu), 250 us .. 2 ms kernels; over a window after a warm-up,
pvgpud's CPU (fraction of a core, /proc) and each GPU's busy fraction (its
utilisation counter in `pvgpuctl stats`).  Prints, per G, the CPU per busy
GPU: flat (or falling) means the cost grows no worse than linearly with the
GPUs.  A benchmark: it prints numbers and asserts nothing but that it ran.

usage: gpus_bench.py --pvgpud P --pvgpuctl P --load P [--gpus 1,2,4,8]
       [--per-gpu 16] [--seconds 5] [--quick]
"""

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import daemon_test as t  # noqa: E402
from scale_bench import bench_arguments, cpu_seconds, end_run, many_clients_config  # noqa: E402

KERNELS_US = [250, 500, 1000, 2000]


def run(ns, bins, gpus):
    tmp = tempfile.mkdtemp(prefix="pvgpu-gpus-bench-")
    n = gpus * ns.per_gpu
    d = t.Daemon(bins, tmp, ["--gpus", str(gpus)])
    with open(d.config, "w") as f:
        f.write(many_clients_config(n))
    d.start()
    loads = []
    try:
        for i in range(n):
            k = KERNELS_US[i % len(KERNELS_US)]
            loads.append(t.Load(bins, d, "throttle", "--kernel-us", k, "--batch", 4, "--depth", 2,
                                "--duration-s", ns.seconds + 60, "--report-interval-s", "0.5",
                                "--gpu", i % gpus, name=f"g{i % gpus}-{i:03d}"))
        for load in loads:
            load.wait_until(lambda x: len(x.reports) >= 1, 60, "its first report")
        time.sleep(ns.warmup)
        s0 = t.ctl_json(bins, d, "stats")
        c0, w0 = cpu_seconds(d.proc.pid), time.monotonic()
        time.sleep(ns.seconds)
        c1, w1 = cpu_seconds(d.proc.pid), time.monotonic()
        s1 = t.ctl_json(bins, d, "stats")
        span = s1["uptime_s"] - s0["uptime_s"]
        busy = [(b["busy_s"] - a["busy_s"]) / span for a, b in zip(s0["gpus"], s1["gpus"])]
        core = (c1 - c0) / (w1 - w0)
        return core, busy
    finally:
        end_run(loads, d, tmp)


def main():
    ap = bench_arguments(__doc__)
    ap.add_argument("--gpus", default="1,2,4,8", help="GPU counts to run (comma separated)")
    ap.add_argument("--per-gpu", type=int, default=16, help="throttles on each GPU")
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--warmup", type=float, default=2.0)
    ap.add_argument("--quick", action="store_true", help="smoke run: 1 and 2 GPUs, 4 throttles each, 2 s")
    ns = ap.parse_args()
    if ns.quick:
        ns.gpus, ns.per_gpu, ns.seconds, ns.warmup = "1,2", 4, 2.0, 1.0
    bins = t.Bins(argparse.Namespace(pvgpud=ns.pvgpud, pvgpuctl=ns.pvgpuctl, load=ns.load, libtest=None))
    for g in (int(x) for x in ns.gpus.split(",")):
        core, busy = run(ns, bins, g)
        total = sum(busy)
        print(f"RESULT gpus_bench.{g}.pvgpud_core={core:.4f}")
        print(f"RESULT gpus_bench.{g}.busy_gpus={total:.3f}")
        print(f"RESULT gpus_bench.{g}.busy_per_gpu={','.join(f'{b:.3f}' for b in busy)}")
        print(f"RESULT gpus_bench.{g}.core_per_busy_gpu={core / total if total > 0 else float('inf'):.4f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
