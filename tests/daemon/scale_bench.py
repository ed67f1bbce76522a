#!/usr/bin/env python3
"""Scale benchmark of pvgpud (issue 12): N host throttles with kernels spread
evenly over 250 us .. 2 ms, equal weights, under one policy.  Prints the
clients' own Jain's index and unfairness (from their completed-kernel counts,
tests/daemon/daemon_test.py's measure_shares), pvgpud's CPU as a fraction
of one core (from /proc over the same window) and the part of it spent in
the scheduler's own code (policy and accounting: `stats` scheduler_cpu_s),
the 1-minute load average (the machine is shared: read the numbers beside
it) and the clients with the smallest and largest share.  Also the kernels
completed per second and pvgpud's CPU per completed kernel: every
completion that asks for an interrupt (libpvgpu asks on every entry) is a
wakeup of pvgpud (the simulated GPU's timer and the interrupt a real host
would take), so a policy that splits the GPU differently changes the
kernel rate, and with it pvgpud's CPU, without costing more per decision.
Asserts nothing: numbers for docs/results.md.

usage: scale_bench.py --pvgpud P --pvgpuctl P --load P [--clients N]
                      [--seconds S] [--warmup S] [--policy NAME] [--demo | --kernels-us LIST]
                      [--compare BASE [--repeat R]] [--quick]
                      [--batch K] [--depth D] [--param KEY=VALUE ...]
--warmup S: seconds after every client's first report before the window
opens (default 2; the first queues of a start run before any kernel length
is learned, so hfq's queue cap settles over a few seconds).
--quick: 32 clients for 3 s (the smoke run of tests/run-all.sh).
--demo: the demo's three host tasks (4 ms, 1 ms, 0.2 ms kernels) instead.
--kernels-us LIST: one throttle per comma-separated kernel length in us
(e.g. 480,480,480: the demo's kernel rate under a fair split, for none).
--compare BASE: run BASE too, alternating R times, and print the median
extra CPU of the policy over BASE (fraction of a core), the median extra
CPU per kernel (us) and the ratio of their GPU busy fractions (issue 12:
hfq over none on the demo load), by the clients' counts (busy_ratio) and
by the GPU's own busy counter, `pvgpuctl stats`' gpu.busy_s
(busy_ratio_by_gpu: no batch granularity at the window's ends).
--param KEY=VALUE: a parameter of --policy (not of BASE), written to
pvgpud.conf's [policy.NAME] group; repeatable (e.g. --param queue_ms=0).
"""
import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import daemon_test as t  # noqa: E402


def bench_arguments(doc):
    """The parser every daemon benchmark starts from: the binaries it runs."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pvgpud", required=True)
    ap.add_argument("--pvgpuctl", required=True)
    ap.add_argument("--load", required=True)
    return ap


def end_run(loads, d, tmp):
    """A benchmark run's end: its clients, its pvgpud, its files."""
    for load in loads:
        load.kill()
    d.stop()
    shutil.rmtree(tmp, ignore_errors=True)


def cpu_seconds(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def many_clients_config(n):
    """pvgpud.conf text for n host clients of this one user: the per-user
    host budgets lifted, libvirt not followed."""
    return (f"[libvirt]\nuri = none\n[limits]\nmax_clients = {max(256, n)}\n"
            f"host_clients = {max(256, n)}\nhost_clients_per_uid = {max(256, n)}\n"
            f"host_channels = {max(1024, 2 * n)}\nhost_channels_per_uid = {max(1024, 2 * n)}\n")


def run_policy(ns, bins, policy, ks):
    """One pvgpud under `policy` with a throttle per kernel length in `ks`;
    the clients' Jain and U, the GPU's busy fraction and kernel rate (their
    own counts) and pvgpud's CPU per core over the same window."""
    tmp = tempfile.mkdtemp(prefix="pvgpu-scale-")
    d = t.Daemon(bins, tmp, ["--policy", policy] +
                 (["--realtime-priority", str(ns.realtime_priority)] if ns.realtime_priority else []))
    n = len(ks)
    with open(d.config, "w") as f:
        f.write(many_clients_config(n))
        # Parameters of the policy under test only (--param KEY=VALUE).
        if ns.param and policy == ns.policy:
            f.write(f"[policy.{policy}]\n" + "".join(f"{kv}\n" for kv in ns.param))
    d.start()
    loads = []
    names = [f"s{i:03d}" for i in range(n)]
    try:
        loads = [t.throttle(bins, d, name, k, duration=ns.seconds + 60, batch=ns.batch, depth=ns.depth)
                 for name, k in zip(names, ks)]
        for load in loads:
            load.wait_until(lambda x: len(x.reports) >= 1, 60, "its first report")
        t0 = max(load.reports[0][0] for load in loads) + ns.warmup
        while time.monotonic() < t0:
            time.sleep(t0 - time.monotonic())
        # pvgpud's accounting at both ends, outside the CPU window (an admin
        # request costs pvgpud CPU too).
        _, before, _ = t.list_at(bins, d)
        stats0 = t.ctl_json(bins, d, "stats")
        c0, w0 = cpu_seconds(d.proc.pid), time.monotonic()
        t1 = t0 + ns.seconds
        while time.monotonic() < t1:
            time.sleep(t1 - time.monotonic())
        c1, w1 = cpu_seconds(d.proc.pid), time.monotonic()
        stats1 = t.ctl_json(bins, d, "stats")
        _, after, _ = t.list_at(bins, d)
        # The same window by pvgpud's accounting (per-kernel, no batch
        # granularity at the window's edges).
        acc = [after[p]["gpu_time_ms"] - before[p]["gpu_time_ms"] for p in (f"{t.HOST}/{name}" for name in names)]
        acc_jain, acc_u = t.fairness_of([a / sum(acc) for a in acc], [1 / n] * n)
        shares, busy = t.measure_between(loads, ks, t0, t1, 60)
        kernels = sum(load.completed_at(t1) - load.completed_at(t0) for load in loads)
        core = (c1 - c0) / (w1 - w0)
        jain, u = t.fairness_of(shares, [1 / n] * n)
        # Where the unfairness is: the extremes, with their kernel lengths.
        order = sorted(range(n), key=lambda i: shares[i])
        extremes = [(label, shares[i] * n, ks[i]) for label, i in (("min", order[0]), ("max", order[-1]))]
        rate = kernels / (t1 - t0)
        # GPU register reads per completion interrupt: each an MMIO read on
        # real hardware (the simulated GPU's cost little and are inside `core`).
        c0s, c1s = stats0["counters"], stats1["counters"]
        fences = max(1, c1s["fences"] - c0s["fences"])
        reads = {k: (c1s[k] - c0s[k]) / fences for k in ("accounting_reads", "register_reads", "polls", "timer_wakeups", "doorbells")}
        # The policy's own counters (hfq's blocks, covers, ...) per second of
        # the window: which of its mechanisms acted on this load.
        pc0, pc1 = stats0.get("policy_counters", {}), stats1.get("policy_counters", {})
        policy_rates = {k: (pc1[k] - pc0.get(k, 0)) / (t1 - t0) for k in sorted(pc1)}
        # The GPU's own busy counter over the window between the two stats
        # (pvgpud's clock): the clients' counts see a batch of 4 kernels at a
        # time, up to 16 ms of the 4 ms task's work at each end of the window.
        span = stats1["uptime_s"] - stats0["uptime_s"]
        gpu_busy = (stats1["gpu"]["busy_s"] - stats0["gpu"]["busy_s"]) / span
        # The scheduler's own code (policy and accounting, every entry timed
        # once) over the same window: the part of `core` a policy decides;
        # the rest is the loop's wakeups and the clients' I/O per kernel.
        sched_core = (stats1.get("scheduler_cpu_s", 0) - stats0.get("scheduler_cpu_s", 0)) / span
        return {"reads_per_fence": reads, "policy_per_s": policy_rates, "jain": jain, "unfairness": u, "gpu_busy": busy, "gpu_busy_by_gpu": gpu_busy, "core": core, "sched_core": sched_core, "kernels_per_s": rate,
                "us_per_kernel": core * 1e6 / rate if rate > 0 else float("inf"), "extremes": extremes,
                "acc_jain": acc_jain, "acc_unfairness": acc_u}
    finally:
        end_run(loads, d, tmp)


def main():
    ap = bench_arguments(__doc__)
    ap.add_argument("--clients", type=int, default=128)
    ap.add_argument("--seconds", type=float, default=7.0)
    ap.add_argument("--warmup", type=float, default=2.0,
                    help="seconds after every client's first report before the window opens")
    ap.add_argument("--policy", default="hfq")
    ap.add_argument("--demo", action="store_true",
                    help="the demo's load instead: three throttles of 4 ms, 1 ms and 0.2 ms kernels")
    ap.add_argument("--kernels-us", metavar="LIST",
                    help="one throttle per comma-separated kernel length in us instead")
    ap.add_argument("--compare", metavar="BASE",
                    help="also run policy BASE, alternating, and print the differences")
    ap.add_argument("--repeat", type=int, default=1, help="runs of each policy (alternating)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--batch", type=int, default=4,
                    help="kernels per submission of each throttle (a client counts whole batches)")
    ap.add_argument("--depth", type=int, default=2, help="batches in flight per throttle")
    ap.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                    help="a parameter of --policy, written to pvgpud.conf's [policy.NAME] (repeatable)")
    ap.add_argument("--realtime-priority", type=int, default=0, metavar="N",
                    help="pvgpud's --realtime-priority under every policy (SCHED_FIFO; needs CAP_SYS_NICE)")
    ap.add_argument("--cpu-hogs", type=int, default=0, metavar="N",
                    help="N busy loops at normal priority beside pvgpud and the clients (a loaded host)")
    ns = ap.parse_args()
    if ns.quick:
        ns.clients, ns.seconds = 32, 3.0
    ns.libtest = None
    bins = t.Bins(ns)
    if ns.demo and ns.kernels_us:
        ap.error("--demo and --kernels-us exclude each other")
    if ns.demo:
        ks = [4000, 1000, 200]
        label = "demo"
    elif ns.kernels_us:
        try:
            ks = [int(k) for k in ns.kernels_us.split(",")]
        except ValueError:
            ap.error(f"--kernels-us: not a comma-separated list of integers: {ns.kernels_us!r}")
        if not ks or min(ks) < 1:
            ap.error("--kernels-us: kernel lengths must be at least 1 us")
        label = "k" + "_".join(str(k) for k in ks)
    else:
        n = ns.clients
        ks = [int(250 + (2000 - 250) * i / max(1, n - 1)) for i in range(n)]
        label = str(n)
    policies = [ns.policy] + ([ns.compare] if ns.compare else [])
    # Busy loops stand for vCPU threads that keep a host's cores busy: pvgpud
    # then waits for a CPU before it handles a completion.
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(ns.cpu_hogs)]
    try:
        results = run_all(ns, bins, policies, ks, label)
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    return results


def run_all(ns, bins, policies, ks, label):
    runs = {p: [] for p in policies}
    for _ in range(ns.repeat):
        for p in policies:
            r = run_policy(ns, bins, p, ks)
            runs[p].append(r)
            tag = f"scale.{p}.{label}"
            print(f"RESULT {tag}.jain={r['jain']:.4f}")
            print(f"RESULT {tag}.unfairness={r['unfairness']:.3f}")
            print(f"RESULT {tag}.gpu_busy={r['gpu_busy']:.3f}")
            print(f"RESULT {tag}.gpu_busy_by_gpu={r['gpu_busy_by_gpu']:.4f}")
            print(f"RESULT {tag}.accounted_jain={r['acc_jain']:.4f}")
            print(f"RESULT {tag}.accounted_unfairness={r['acc_unfairness']:.3f}")
            print(f"RESULT {tag}.pvgpud_core_fraction={r['core']:.3f}")
            print(f"RESULT {tag}.scheduler_core_fraction={r['sched_core']:.4f}")
            print(f"RESULT {tag}.kernels_per_s={r['kernels_per_s']:.0f}")
            print(f"RESULT {tag}.pvgpud_us_per_kernel={r['us_per_kernel']:.1f}")
            for k, v in r["reads_per_fence"].items():
                print(f"RESULT {tag}.{k}_per_fence={v:.2f}")
            for k, v in r["policy_per_s"].items():
                print(f"RESULT {tag}.policy.{k}_per_s={v:.1f}")
            print(f"RESULT {tag}.loadavg_1m={os.getloadavg()[0]:.2f}")
            for which, share, k in r["extremes"]:
                print(f"# {which} share {share:.3f} of fair, kernel {k} us", flush=True)
    if ns.compare:
        # Medians over the alternating runs: one slow run of either policy
        # (the machine is shared) does not decide the difference.
        def med(p, k):
            v = sorted(r[k] for r in runs[p])
            return v[len(v) // 2]
        a, b = ns.policy, ns.compare
        print(f"RESULT scale.{a}_vs_{b}.{label}.extra_core={med(a, 'core') - med(b, 'core'):.4f}")
        print(f"RESULT scale.{a}_vs_{b}.{label}.extra_scheduler_core={med(a, 'sched_core') - med(b, 'sched_core'):.4f}")
        print(f"RESULT scale.{a}_vs_{b}.{label}.kernel_rate_ratio="
              f"{med(a, 'kernels_per_s') / med(b, 'kernels_per_s'):.3f}")
        print(f"RESULT scale.{a}_vs_{b}.{label}.extra_us_per_kernel="
              f"{med(a, 'us_per_kernel') - med(b, 'us_per_kernel'):.2f}")
        print(f"RESULT scale.{a}_vs_{b}.{label}.busy_ratio={med(a, 'gpu_busy') / med(b, 'gpu_busy'):.4f}")
        print(f"RESULT scale.{a}_vs_{b}.{label}.busy_ratio_by_gpu="
              f"{med(a, 'gpu_busy_by_gpu') / med(b, 'gpu_busy_by_gpu'):.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
