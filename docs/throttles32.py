#!/usr/bin/env python3
"""32 host throttles under `none` (kernels 100, 200, .., 3200 us, one each):
the clients' own Jain's index and unfairness over the daemon's window against
what `pvgpuctl stats` and `list` say.  usage: throttles32.py BUILD_DIR
(docs/results.md section 12; reuses tests/daemon/daemon_test.py's helpers)"""
import os, shutil, sys, tempfile, time
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "daemon"))
import daemon_test as t
b = sys.argv[1]
class NS: pass
ns = NS(); ns.pvgpud = f"{b}/scheduler/daemon/pvgpud"; ns.pvgpuctl = f"{b}/scheduler/ctl/pvgpuctl"
ns.load = f"{b}/scheduler/tools/pvgpu-load"; ns.libtest = None
bins = t.Bins(ns)
tmp = tempfile.mkdtemp()
d = t.Daemon(bins, tmp, ["--policy", "none"]); d.start()
ks = [100 * (i + 1) for i in range(32)]
loads = [t.throttle(bins, d, f"t{i:02d}", k, duration=40) for i, k in enumerate(ks)]
try:
    for l in loads: l.wait_until(lambda x: len(x.reports) >= 1, 20, "first report")
    t0 = max(l.reports[0][0] for l in loads) + 3.0
    for l in loads: l.wait_until(lambda x: x.reports and x.reports[-1][0] >= t0, 30, "warmup")
    stats = t.ctl_json(bins, d, "stats"); tb = time.monotonic()
    lst = t.ctl_json(bins, d, "list")
    window = lst.get("window_s", 2.0)
    for l in loads: l.wait_until(lambda x: x.reports and x.reports[-1][0] >= tb + 0.05, 30, "past tb")
    shares, util = t.measure_shares(loads, ks, tb - window, tb)
    jain, u = t.fairness_of(shares, [1 / 32] * 32)
    m = stats["metrics"]
    print(f"clients: jain {jain:.3f} unfairness {u:.2f} util {util:.3f}")
    print(f"pvgpuctl stats: jain_index {m['jain_index']} max_share_error {m['max_share_error']} unfairness {m['unfairness']}")
    tg = [e['target_share'] for e in lst['entities']]
    print(f"pvgpuctl list: target min {min(tg):.4f} max {max(tg):.4f}; achieved sum {sum(e['achieved_share'] for e in lst['entities']):.3f}")
finally:
    for l in loads: l.kill()
    d.stop()
    shutil.rmtree(tmp, ignore_errors=True)
