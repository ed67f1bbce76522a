#!/usr/bin/env python3
"""Reproduce the experiments of docs/results.md with pvgpu-sim.

Usage: python3 docs/experiments.py PVGPU_SIM OUT_DIR [--bench PVGPU_BENCH_DECISION]
                                   [--only NAME,NAME,...]

NAME is one of: fairness, thesis_5421, thesis_5422, nested, gdev, accuracy,
accounting_all, grace, anticipation, feed_cap, preempt_cost, scale_spread, fair_floor, overhead,
irq_latency, bench (default: all; bench only with --bench).

Runs every experiment of DESIGN.md section 8 on the bundled scenarios (variants
are made by editing the JSON, never by hand), prints markdown tables on stdout
and writes CSV data and gnuplot PNG plots to OUT_DIR/plots/.
"""
import json
import math
import os
import random
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
SCENARIOS = os.path.join(HERE, "..", "scheduler", "scenarios")
POLICIES = ["none", "timeslice", "dfq", "hfq"]
ARBS = ["round-robin", "timeslice"]


def load(name):
    with open(os.path.join(SCENARIOS, name + ".json")) as f:
        return json.load(f)


class Runner:
    def __init__(self, sim, tmp):
        self.sim = sim
        self.tmp = tmp
        self.n = 0

    def run(self, scenario, policy, arbitration, series=None):
        self.n += 1
        path = os.path.join(self.tmp, "s%d.json" % self.n)
        sc = json.loads(json.dumps(scenario))
        sc["policy"] = {"name": policy}
        sc.setdefault("gpu", {})["arbitration"] = arbitration
        with open(path, "w") as f:
            json.dump(sc, f)
        cmd = [self.sim, "run", path, "--json"]
        if series:
            cmd += ["--series", series, "--series-interval-ms", "100"]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        return json.loads(out)


def ent(report, path):
    for e in report["entities"]:
        if e["path"] == path:
            return e
    raise KeyError(path)


def table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        lines.append("| " + " | ".join(str(x) for x in r) + " |")
    return "\n".join(lines) + "\n"


def gnuplot(script):
    subprocess.run(["gnuplot"], input=script, text=True, check=True)


def fairness(r, out):
    out.write("## Fairness on the standard scenarios\n\n")
    rows = []
    for name in ["flat", "weighted", "hierarchical", "uncooperative", "mixed", "demo", "low-demand"]:
        sc = load(name)
        for arb in ARBS:
            for pol in POLICIES:
                rep = r.run(sc, pol, arb)
                m = rep["metrics"]
                u = m["unfairness"]
                rows.append([name, arb, pol, "%.4f" % m["max_share_error"], "%.4f" % m["jain_index"],
                             "inf" if u is None else "%.2f" % u,
                             "%.4f" % rep["gpu"]["busy_fraction"],
                             "%.4f" % rep["gpu"]["idle_with_demand_fraction"]])
    out.write(table(["scenario", "gpu", "policy", "max share error", "jain", "unfairness", "busy",
                     "idle w/ work"], rows) + "\n")


def thesis_5421(r, out, plots):
    out.write("## Thesis 5.4.2.1: benchmark and throttle in one VM\n\n")
    base = load("thesis-5.4.2.1")
    data = {}
    for pol in POLICIES:
        for us in range(100, 1001, 100):
            sc = json.loads(json.dumps(base))
            sc["tree"][0]["children"][1]["workload"]["kernel_us"] = us
            rep = r.run(sc, pol, "round-robin")
            data.setdefault(pol, []).append(ent(rep, "vm1/bench")["finished_ms"])
    rows = [[us] + ["%.0f" % data[p][i] for p in POLICIES] for i, us in enumerate(range(100, 1001, 100))]
    rows.append(["max/min"] + ["%.3f" % (max(data[p]) / min(data[p])) for p in POLICIES])
    out.write("Benchmark runtime (ms) against the throttle's kernel length, round-robin GPU:\n\n")
    out.write(table(["throttle kernel (us)"] + POLICIES, rows) + "\n")
    csv = os.path.join(plots, "thesis-5.4.2.1.csv")
    with open(csv, "w") as f:
        f.write("throttle_us," + ",".join(POLICIES) + "\n")
        for i, us in enumerate(range(100, 1001, 100)):
            f.write("%d,%s\n" % (us, ",".join("%.1f" % data[p][i] for p in POLICIES)))
    gnuplot("""set terminal pngcairo size 800,480
set output '%s'
set datafile separator ','
set title 'Thesis 5.4.2.1: benchmark runtime vs throttle kernel length (round-robin GPU)'
set xlabel 'throttle kernel length (us)'
set ylabel 'benchmark runtime (ms)'
set key outside right
set grid
plot for [i=2:5] '%s' using 1:i with linespoints title columnheader(i)
""" % (os.path.join(plots, "thesis-5.4.2.1.png"), csv))
    # Shares over time for one setting.
    for pol in ["none", "hfq"]:
        sc = json.loads(json.dumps(base))
        r.run(sc, pol, "round-robin", series=os.path.join(plots, "thesis-5.4.2.1-%s.csv" % pol))
    gnuplot("""set terminal pngcairo size 900,420
set output '%s'
set datafile separator ','
set multiplot layout 1,2 title 'Thesis 5.4.2.1 (throttle 500 us): GPU share over time'
set xlabel 'time (ms)'; set ylabel 'share'; set yrange [0:1.05]; set grid
set title 'none'
plot for [i=2:3] '%s' using 1:i with lines title columnheader(i)
set title 'hfq'
plot for [i=2:3] '%s' using 1:i with lines title columnheader(i)
unset multiplot
""" % (os.path.join(plots, "thesis-5.4.2.1-shares.png"), os.path.join(plots, "thesis-5.4.2.1-none.csv"),
       os.path.join(plots, "thesis-5.4.2.1-hfq.csv")))


def thesis_5422(r, out, plots):
    out.write("## Thesis 5.4.2.2: host benchmark against 1..8 throttles in a VM\n\n")
    base = load("thesis-5.4.2.2")
    throttle = base["tree"][1]["children"][0]
    data = {}
    for arb in ARBS:
        for pol in POLICIES:
            for n in range(1, 9):
                sc = json.loads(json.dumps(base))
                sc["tree"][1]["children"] = []
                for i in range(1, n + 1):
                    t = json.loads(json.dumps(throttle))
                    t["task"] = "throttle%d" % i
                    sc["tree"][1]["children"].append(t)
                rep = r.run(sc, pol, arb)
                data.setdefault((arb, pol), []).append(ent(rep, "bench")["finished_ms"])
        rows = [[n] + ["%.0f" % data[(arb, p)][n - 1] for p in POLICIES] for n in range(1, 9)]
        rows.append(["max/min"] + ["%.3f" % (max(data[(arb, p)]) / min(data[(arb, p)])) for p in POLICIES])
        out.write("Benchmark runtime (ms), %s GPU:\n\n" % arb)
        out.write(table(["throttles"] + POLICIES, rows) + "\n")
    csv = os.path.join(plots, "thesis-5.4.2.2.csv")
    with open(csv, "w") as f:
        f.write("throttles," + ",".join(POLICIES) + "\n")
        for n in range(1, 9):
            f.write("%d,%s\n" % (n, ",".join("%.1f" % data[("round-robin", p)][n - 1] for p in POLICIES)))
    gnuplot("""set terminal pngcairo size 800,480
set output '%s'
set datafile separator ','
set title 'Thesis 5.4.2.2: host benchmark runtime vs throttles in a VM (round-robin GPU)'
set xlabel 'throttles in the VM'
set ylabel 'benchmark runtime (ms)'
set key outside right
set grid
plot for [i=2:5] '%s' using 1:i with linespoints title columnheader(i)
""" % (os.path.join(plots, "thesis-5.4.2.2.png"), csv))


def nested(r, out):
    out.write("## Nested trees: product of shares (thesis fig 3.1 / 3.5)\n\n")
    sc = load("hierarchical")
    rows = []
    reps = {arb: r.run(sc, "hfq", arb) for arb in ARBS}
    none = r.run(sc, "none", "round-robin")
    for e in reps["round-robin"]["entities"]:
        rows.append([e["path"], e["weight"], "%.4f" % e["target_share"],
                     "%.4f" % ent(none, e["path"])["achieved_share"],
                     "%.4f" % e["achieved_share"],
                     "%.4f" % ent(reps["timeslice"], e["path"])["achieved_share"]])
    out.write(table(["entity", "weight", "target", "none (rr)", "hfq (rr)", "hfq (timeslice)"], rows) + "\n")


def gdev(r, out, plots):
    out.write("## Gdev fig 14: short-kernel VM, long-kernel VM joins at 5 s\n\n")
    sc = load("gdev-fig14")
    rows = []
    for pol in ["none", "hfq"]:
        rep = r.run(sc, pol, "round-robin", series=os.path.join(plots, "gdev-fig14-%s.csv" % pol))
        for e in rep["entities"]:
            rows.append([pol, e["path"], "%.4f" % e["target_share"], "%.4f" % e["achieved_share"],
                         "-" if e["finished_ms"] is None else "%.0f" % e["finished_ms"]])
    out.write(table(["policy", "entity", "target", "achieved", "finished (ms)"], rows) + "\n")
    gnuplot("""set terminal pngcairo size 900,420
set output '%s'
set datafile separator ','
set multiplot layout 1,2 title 'Gdev fig 14 setting: GPU share over time (round-robin GPU)'
set xlabel 'time (ms)'; set ylabel 'share'; set yrange [0:1.15]; set grid
set xtics 5000; set key top left horizontal
set title 'none'
plot for [i=2:3] '%s' using 1:i with lines title columnheader(i)
set title 'hfq'
plot for [i=2:3] '%s' using 1:i with lines title columnheader(i)
unset multiplot
""" % (os.path.join(plots, "gdev-fig14.png"), os.path.join(plots, "gdev-fig14-none.csv"),
       os.path.join(plots, "gdev-fig14-hfq.csv")))


def accuracy(r, out, plots):
    out.write("## LoGA fig 9/10: accounting accuracy of hfq\n\n")
    sc = load("loga-accuracy")
    reps = {arb: r.run(sc, "hfq", arb) for arb in ARBS}
    rows = []
    csv = os.path.join(plots, "loga-accuracy.csv")
    with open(csv, "w") as f:
        f.write("kernel_us,round-robin,timeslice\n")
        for e in reps["round-robin"]["entities"]:
            errs = []
            for arb in ARBS:
                x = ent(reps[arb], e["path"])
                errs.append(100.0 * (x["accounted_ms"] - x["gpu_time_total_ms"]) / x["gpu_time_total_ms"])
            rows.append([e["path"][1:], "%+.2f%%" % errs[0], "%+.2f%%" % errs[1]])
            f.write("%s,%.3f,%.3f\n" % (e["path"][1:], errs[0], errs[1]))
    out.write("Accounted minus true GPU time, per task (kernel length in us):\n\n")
    out.write(table(["kernel (us)", "round-robin", "timeslice"], rows) + "\n")
    gnuplot("""set terminal pngcairo size 800,420
set output '%s'
set datafile separator ','
set title 'hfq accounting error vs kernel length'
set xlabel 'kernel length (us)'; set ylabel 'accounted - true (%%)'; set grid
set yrange [-5:5]
plot for [i=2:3] '%s' using 1:i with linespoints title columnheader(i)
""" % (os.path.join(plots, "loga-accuracy.png"), csv))


def worst_accounting_error(rep):
    # The scheduler's accounting against the engine's ground truth, over the
    # entities with at least 100 ms of GPU time.
    return max((abs(e["measured_ms"] - e["gpu_time_total_ms"]) / e["gpu_time_total_ms"]
                for e in rep["entities"] if e["gpu_time_total_ms"] >= 100), default=0.0)


def accounting_all(r, out):
    out.write("Worst accounting error of the scheduler (what pvgpuctl shows, the same "
              "under every policy) over the entities of each scenario with at least "
              "100 ms of GPU time, round-robin / timeslice GPU:\n\n")
    policies = ["none", "timeslice", "dfq", "hfq"]
    rows = []
    for name in ["flat", "weighted", "hierarchical", "uncooperative", "mixed", "loga-accuracy",
                 "low-demand", "design-example", "gdev-fig14", "demo"]:
        sc = load(name)
        row = [name]
        for policy in policies:
            cell = []
            for arb in ARBS:
                cell.append("%.2f%%" % (100 * worst_accounting_error(r.run(sc, policy, arb))))
            row.append(" / ".join(cell))
        rows.append(row)
    out.write(table(["scenario"] + policies, rows) + "\n")


def run_variant(r, sc):
    """The JSON report of pvgpu-sim on scenario dict `sc`."""
    path = os.path.join(r.tmp, "sweep.json")
    with open(path, "w") as f:
        json.dump(sc, f)
    return json.loads(subprocess.run([r.sim, "run", path, "--json"], check=True,
                                     capture_output=True, text=True).stdout)


def hfq_sweep(r, out, param, values, scenarios):
    """Worst share error and idle-with-work of hfq per scenario, value of
    `param` and GPU model."""
    rows = []
    for name in scenarios:
        base = load(name)
        for v in values:
            row = [name, v]
            for arb in ARBS:
                sc = json.loads(json.dumps(base))
                sc["policy"] = {"name": "hfq", "params": {param: v}}
                sc.setdefault("gpu", {})["arbitration"] = arb
                rep = run_variant(r, sc)
                row += ["%.4f" % rep["metrics"]["max_share_error"],
                        "%.4f" % rep["gpu"]["idle_with_demand_fraction"]]
            rows.append(row)
    out.write(table(["scenario", param, "error (rr)", "idle w/ work (rr)", "error (ts)",
                     "idle w/ work (ts)"], rows) + "\n")


def grace(r, out):
    out.write("## Work conservation against protection: hfq's grace_us\n\n")
    hfq_sweep(r, out, "grace_us", [5, 20, 50, 100], ["design-example", "demo", "low-demand", "mixed"])


def feed_cap(r, out):
    out.write("## hfq's feed_lead_ms: work conservation against bursty leaves (1e6: no cap)\n\n")
    hfq_sweep(r, out, "feed_lead_ms", [1e6, 8, 4, 3, 2],
              ["design-example", "low-demand", "demo", "mixed", "flat"])


def preempt_cost(r, out):
    # The timeslice GPU's host preemption: what its dead time costs hfq.
    out.write("## Host preemption cost (costs.preempt_us), hfq defaults, timeslice GPU\n\n")
    rows = []
    for name in ["design-example", "low-demand", "demo", "mixed"]:
        base = load(name)
        for us in [0, 25, 75, 150, 2000]:
            sc = json.loads(json.dumps(base))
            sc["policy"] = {"name": "hfq"}
            sc.setdefault("gpu", {})["arbitration"] = "timeslice"
            sc.setdefault("costs", {})["preempt_us"] = us
            rep = run_variant(r, sc)
            rows.append([name, "%g" % us,
                         "%.4f" % rep["metrics"]["max_share_error"],
                         "%.4f" % rep["gpu"]["idle_with_demand_fraction"],
                         rep["mechanisms"]["preemptions"]])
    out.write(table(["scenario", "preempt_us", "error (ts)", "idle w/ work (ts)", "preemptions"], rows) + "\n")


def anticipation(r, out):
    out.write("## hfq's anticipate_us: protection of bursty leaves against idle GPU\n\n")
    hfq_sweep(r, out, "anticipate_us", [0, 250, 500, 1000, 2000],
              ["design-example", "low-demand", "demo", "mixed", "flat"])


def overhead_gapped(r, out):
    # One task with CPU gaps, mechanism costs of a real host (trap exit 2 us,
    # remap 50 us, register read 1 us): what hfq costs against none.
    base = load("overhead")
    base["costs"] = {"trap_us": 2, "remap_us": 50, "poll_us": 1}
    rows = []
    for us, gap in [(500, 0), (500, 50), (500, 500), (100, 100), (4000, 200)]:
        sc = json.loads(json.dumps(base))
        sc["tree"][0]["children"][0]["workload"].update({"kernel_us": us, "gap_us": gap})
        for arb in ARBS:
            none = r.run(sc, "none", arb)
            hfq = r.run(sc, "hfq", arb)
            k0 = ent(none, "vm1/saturate")["kernels_completed"]
            rows.append([us, gap, arb,
                         "%.4f" % (ent(hfq, "vm1/saturate")["kernels_completed"] / k0),
                         "%.0f" % none["metrics"]["scheduler_cpu_us_per_s"],
                         "%.0f" % hfq["metrics"]["scheduler_cpu_us_per_s"],
                         "%.0f" % hfq["metrics"]["policy_cpu_us_per_s"],
                         hfq["mechanisms"]["polls"], hfq["mechanisms"]["accounting_reads"],
                         hfq["mechanisms"]["register_reads"], hfq["mechanisms"]["remaps"],
                         hfq["mechanisms"]["policy_calls"]])
    out.write("One task with CPU gaps, hfq against none (costs: trap 2 us, remap 50 us, "
              "register read 1 us):\n\n")
    out.write(table(["kernel (us)", "gap (us)", "gpu", "hfq/none kernels", "mech us/s (none)",
                     "mech us/s (hfq)", "policy us/s (hfq)", "polls", "engine reads", "register reads",
                     "remaps", "decisions"], rows) + "\n")


def scale_spread(r, out):
    # Issue 12's 128 host throttles in the simulator: how far apart equal
    # leaves end up over 30 s, by how much each keeps queued, with and
    # without hfq's queue cap.  Two seconds of warm-up: the first queues are
    # dumped before any kernel length is learned, so nothing is metered yet.
    def scenario(batch, channels, seconds, params):
        tree = [{"task": "t%03d" % i,
                 "workload": {"kernel_us": 250 + (1750 * i) // 127, "batch": batch, "channels": channels}}
                for i in range(128)]
        return {"name": "scale-128", "seed": 1, "duration_ms": 2000 + 1000 * seconds, "warmup_ms": 2000,
                "gpu": {"arbitration": "round-robin"}, "policy": {"name": "hfq", "params": params},
                "tree": tree}

    def extremes(rep):
        gpu = sorted(e["gpu_time_ms"] for e in rep["entities"] if e["path"].startswith("t"))
        total = sorted(e["gpu_time_total_ms"] for e in rep["entities"] if e["path"].startswith("t"))
        return gpu[0], gpu[-1], total[-1] - total[0]

    out.write("## 128 equal leaves, kernels 250..2000 us, hfq, 30 s: spread by queue shape\n\n")
    rows = []
    for batch, channels in [(1, 1), (4, 2), (1, 8)]:
        for queue in [0, 2]:
            for threshold in [2, 0.5]:
                params = {"queue_ms": queue, "threshold_ms": threshold, "unblock_ms": min(0.5, threshold / 4),
                          "fair_window": 0}
                least, most, spread = extremes(run_variant(r, scenario(batch, channels, 30, params)))
                rows.append([batch, channels, queue, "%g" % threshold, "%.1f" % least, "%.1f" % most,
                             "%.3f" % (most / least), "%.1f" % spread])
    out.write(table(["batch", "channels", "queue_ms", "threshold_ms", "least (ms)", "most (ms)", "U",
                     "spread since start (ms)"], rows) + "\n")
    # The same over longer windows: U falls as 1 + spread / (T / n).
    rows = []
    for seconds in [7, 30, 60, 120]:
        row = [seconds]
        for queue in [0, 2]:
            least, most, _ = extremes(run_variant(r, scenario(4, 2, seconds, {"queue_ms": queue, "fair_window": 0})))
            row += ["%.1f" % least, "%.1f" % most, "%.3f" % (most / least)]
        rows.append(row)
    out.write("\nBatch 4, two channels, hfq defaults with fixed bounds (fair_window 0), by window length, "
              "without and with the queue cap:\n\n")
    out.write(table(["window (s)", "least, queue_ms 0", "most, queue_ms 0", "U, queue_ms 0",
                     "least, queue_ms 2", "most, queue_ms 2", "U, queue_ms 2"], rows) + "\n")
    # The 7 s window with tighter blocking: does a smaller threshold or
    # queue bring hfq near a perfectly fair schedule (fair_floor)?
    rows = []
    for threshold in [2, 0.5, 0.2, 0.05]:
        row = ["%g" % threshold]
        for queue in [2, 1, 0.25]:
            params = {"threshold_ms": threshold, "unblock_ms": threshold / 4, "queue_ms": queue, "fair_window": 0}
            least, most, _ = extremes(run_variant(r, scenario(4, 2, 7, params)))
            row.append("%.3f" % (most / least))
        rows.append(row)
    out.write("\nBatch 4, two channels, 7 s window, U by block threshold (unblock at a quarter of it) "
              "and queue cap:\n\n")
    out.write(table(["threshold_ms", "queue_ms 2", "queue_ms 1", "queue_ms 0.25"], rows) + "\n")
    # The defaults, whose bounds shrink with the number of siblings past
    # fair_window, against the same bounds fixed: U by window, and what the
    # extra blocking costs in remaps and modeled mechanism time.
    rows = []
    for seconds in [7, 30, 60]:
        for window in [0, 32]:
            rep = run_variant(r, scenario(4, 2, seconds, {"fair_window": window}))
            least, most, _ = extremes(rep)
            rows.append([seconds, window, "%.1f" % least, "%.1f" % most, "%.3f" % (most / least),
                         "%.0f" % (rep["mechanisms"]["remaps"] / seconds),
                         "%.0f" % rep["metrics"]["scheduler_cpu_us_per_s"]])
    out.write("\nBatch 4, two channels, hfq defaults, by window length, with fixed bounds (fair_window 0) "
              "and bounds scaled past 32 siblings (fair_window 32, the default):\n\n")
    out.write(table(["window (s)", "fair_window", "least (ms)", "most (ms)", "U", "remaps/s", "mech us/s"],
                    rows) + "\n")


def fair_floor(out):
    # The U a perfectly fair schedule of the 128-client benchmark would show
    # (no simulator: a model).  Non-preemptive, so each client runs whole
    # kernels: with equal shares client i runs one kernel of L_i every
    # 128 * L_i, at a phase of its own.  A window of T seconds then holds a
    # whole number of its completions, and a kernel runs across each edge:
    # nobody is ahead on average, but U over 128 clients is the extremes.
    # Measured two ways: the benchmark's (completed kernels, counted by
    # reports every 100 ms and interpolated between them) and the
    # simulator's (GPU time executed in the window).
    n = 128
    lens = [(250 + (2000 - 250) * i / (n - 1)) / 1000.0 for i in range(n)]  # ms, as scale_bench.py
    rng = random.Random(1)

    def completed(t, first, period):
        return 0 if t < first else math.floor((t - first) / period) + 1

    def counted(t, first, period, report_phase, every=100.0):
        a = report_phase + math.floor((t - report_phase) / every) * every
        ca, cb = completed(a, first, period), completed(a + every, first, period)
        return ca + (cb - ca) * (t - a) / every

    def executed(t, first, period, length):  # runs [first + k P - L, first + k P)
        if t <= first - length:
            return 0.0
        k = math.floor((t - (first - length)) / period)
        return k * length + min(length, t - (first - length + k * period))

    def u(window, how, t0=5000.0):
        got = []
        for length in lens:
            period = n * length
            first = rng.uniform(0, period) + length
            if how == "counts":
                ph = rng.uniform(0, 100.0)
                got.append(length * (counted(t0 + window, first, period, ph) - counted(t0, first, period, ph)))
            else:
                got.append(executed(t0 + window, first, period, length) - executed(t0, first, period, length))
        return max(got) / min(got)

    out.write("## The U of a perfectly fair schedule of 128 clients (kernels 250..2000 us): a model\n\n")
    rows = []
    for seconds in [7, 30]:
        row = [seconds]
        for how in ["counts", "executed"]:
            us = sorted(u(seconds * 1000.0, how) for _ in range(2000))
            row += ["%.3f" % us[100], "%.3f" % us[1000], "%.3f" % us[1900]]
        rows.append(row)
    out.write(table(["window (s)", "counts p5", "counts median", "counts p95", "executed p5", "executed median",
                     "executed p95"], rows) + "\n")


def latency_bound(kernels_us, latency_us):
    # Equal weights, every leaf one kernel after another on the
    # round-robin GPU (a non-preemptive engine).  A leaf that waits on its
    # fence is ready again `latency_us` after each of its kernels ends (the
    # interrupt's way to it): two of its kernels in a row leave the engine
    # idle that long, a kernel of another leaf between them covers it.
    # Equal shares x give leaf i x / k_i kernels a second; at best every
    # other kernel separates two of the shortest leaf's, so at least
    # n_short - sum(n_others) of them follow one another.  Returns the
    # share x and the busy fraction of the fairest schedule with the least
    # idle (a model, not a simulation).  `kernels_us`: (length, waits on
    # each fence) per leaf; a leaf that keeps work queued has no turnaround.
    rate = [1.0 / k for k, _ in kernels_us]
    uncovered = 0.0
    for i, (k, waits) in enumerate(kernels_us):
        if waits:
            uncovered = max(uncovered, rate[i] - (sum(rate) - rate[i]))
    x = 1.0 / (len(kernels_us) + latency_us * uncovered)
    return x, len(kernels_us) * x


def irq_latency(r, out):
    out.write("## Interrupt latency (costs.irq_latency_us)\n\n")
    # A lone task: what the latency costs each policy.
    base = load("overhead")
    rows = []
    for us, gap, lat in [(100, 100, 0), (100, 100, 10), (100, 100, 20), (100, 100, 50), (100, 150, 50),
                         (500, 500, 50)]:
        sc = json.loads(json.dumps(base))
        sc["costs"] = {"trap_us": 2, "remap_us": 50, "poll_us": 1, "irq_latency_us": lat}
        sc["tree"][0]["children"][0]["workload"].update({"kernel_us": us, "gap_us": gap})
        none = r.run(sc, "none", "round-robin")
        hfq = r.run(sc, "hfq", "round-robin")
        rows.append(["%d / %d" % (us, gap), lat, ent(none, "vm1/saturate")["kernels_completed"],
                     ent(hfq, "vm1/saturate")["kernels_completed"],
                     "%.0f" % none["metrics"]["scheduler_cpu_us_per_s"],
                     "%.0f" % hfq["metrics"]["scheduler_cpu_us_per_s"], hfq["mechanisms"]["traps"]])
    out.write("One task (round-robin GPU; costs: trap 2 us, remap 50 us, register read 1 us):\n\n")
    out.write(table(["kernel / gap (us)", "latency (us)", "none kernels", "hfq kernels", "none us/s",
                     "hfq us/s", "hfq traps"], rows) + "\n")

    # Shared GPUs: max share error and GPU busy, hfq against none.
    lats = [0, 20, 50, 100]
    rows = []
    for name in ["flat", "weighted", "hierarchical", "uncooperative", "mixed", "demo", "design-example",
                 "low-demand", "gdev-fig14", "loga-accuracy", "thesis-5.4.2.1", "thesis-5.4.2.2"]:
        for arb in ARBS:
            err, busy, nbusy = [], [], []
            for lat in lats:
                sc = load(name)
                sc.setdefault("costs", {})["irq_latency_us"] = lat
                hfq = r.run(sc, "hfq", arb)
                none = r.run(sc, "none", arb)
                err.append("%.4f" % hfq["metrics"]["max_share_error"])
                busy.append("%.3f" % hfq["gpu"]["busy_fraction"])
                nbusy.append("%.3f" % none["gpu"]["busy_fraction"])
            rows.append([name, arb, " / ".join(err), " / ".join(busy), " / ".join(nbusy)])
    out.write("The bundled scenarios at a latency of %s us (each cell lists them in that order):\n\n"
              % " / ".join(str(x) for x in lats))
    out.write(table(["scenario", "gpu", "hfq max error", "hfq busy", "none busy"], rows) + "\n")

    # The scheduler's accounting (section 6's measure) when every
    # interrupt comes late: the host reads the engine as it is then.
    acc_names = ["flat", "weighted", "hierarchical", "uncooperative", "mixed", "loga-accuracy", "low-demand",
                 "design-example", "gdev-fig14", "demo"]

    def late_errors(name, policy, arb, ctxsw_us=None):
        cell = []
        for lat in [0, 20, 50]:
            sc = load(name)
            sc.setdefault("costs", {})["irq_latency_us"] = lat
            if ctxsw_us is not None:
                sc.setdefault("gpu", {})["ctxsw_us"] = ctxsw_us
            cell.append("%.2f" % (100 * worst_accounting_error(r.run(sc, policy, arb))))
        return " / ".join(cell)

    rows = [[name] + [late_errors(name, policy, arb) for policy in ["none", "timeslice", "dfq", "hfq"]
                      for arb in ARBS]
            for name in acc_names]
    out.write("Worst accounting error (%) of the scheduler at a latency of 0 / 20 / 50 us:\n\n")
    out.write(table(["scenario"] + ["%s, %s" % (p, a) for p in ["none", "timeslice", "dfq", "hfq"] for a in ARBS],
                    rows) + "\n")

    # The same on a timeslice GPU whose context switches cost dead time
    # (gpu.ctxsw_us), which nobody should be charged.
    rows = [[name] + [late_errors(name, policy, "timeslice", ctxsw_us=30)
                      for policy in ["none", "timeslice", "dfq", "hfq"]]
            for name in acc_names]
    out.write("Worst accounting error (%) on the timeslice GPU with 30 us of dead time per context switch, "
              "at a latency of 0 / 20 / 50 us:\n\n")
    out.write(table(["scenario", "none", "timeslice", "dfq", "hfq"], rows) + "\n")

    # Against the fairest schedule's least idle (latency_bound).  flat: four
    # leaves waiting on each fence; queued-sync: two leaves that keep work
    # queued (metered) beside one that waits on each fence (a variant of
    # flat); queued: the two alone; queued-batches: the third in batches of
    # four on two channels, so it keeps work queued too.
    sync = load("flat")
    sync["name"] = "queued-sync"
    sync["tree"] = [{"task": "deep", "workload": {"kernel_us": 500, "batch": 16, "channels": 2}},
                    {"task": "deep2", "workload": {"kernel_us": 1000, "batch": 8}},
                    {"task": "sync", "workload": {"kernel_us": 300}}]
    queued = json.loads(json.dumps(sync))
    queued["name"] = "queued"
    queued["tree"] = queued["tree"][:2]
    batches = json.loads(json.dumps(sync))
    batches["name"] = "queued-batches"
    batches["tree"][2]["workload"].update({"batch": 4, "channels": 2})
    cases = [(load("flat"), [(100, True), (500, True), (2000, True), (8000, True)]),
             (sync, [(500, False), (1000, False), (300, True)]),
             (queued, [(500, False), (1000, False)]),
             (batches, [(500, False), (1000, False), (300, False)])]
    rows = []
    for sc0, model in cases:
        for lat in [0, 20, 50, 90]:
            sc = json.loads(json.dumps(sc0))
            sc.setdefault("costs", {})["irq_latency_us"] = lat
            hfq = r.run(sc, "hfq", "round-robin")
            x, b = latency_bound(model, lat)
            shares = [e["achieved_share"] for e in hfq["entities"]]
            rows.append([sc0["name"], lat, "%.4f" % x, "%.4f..%.4f" % (min(shares), max(shares)), "%.4f" % b,
                         "%.4f" % hfq["gpu"]["busy_fraction"]])
    out.write("Equal shares on the round-robin GPU against the fairest schedule with the least idle "
              "(`latency_bound`, a model):\n\n")
    out.write(table(["scenario", "latency (us)", "bound: share", "hfq: shares", "bound: busy", "hfq: busy"],
                    rows) + "\n")


def overhead(r, out):
    out.write("## Overhead on a lone saturating task\n\n")
    base = load("overhead")
    rows = []
    for us in [100, 500, 4000]:
        sc = json.loads(json.dumps(base))
        sc["tree"][0]["children"][0]["workload"]["kernel_us"] = us
        for arb in ARBS:
            reps = {p: r.run(sc, p, arb) for p in POLICIES}
            k0 = ent(reps["none"], "vm1/saturate")["kernels_completed"]
            rows.append([us, arb] + ["%.4f" % (ent(reps[p], "vm1/saturate")["kernels_completed"] / k0)
                                     for p in POLICIES])
    out.write("Throughput (kernels completed) relative to `none`:\n\n")
    out.write(table(["kernel (us)", "gpu"] + POLICIES, rows) + "\n")


def bench(path, out):
    out.write("## Decision cost vs number of entities\n\n")
    res = subprocess.run([path, "--min-kernels", "10"], check=True, capture_output=True,
                         text=True).stdout
    out.write("```\n" + res + "```\n\n")


def main():
    args = sys.argv[1:]
    bench_path = None
    if "--bench" in args:
        i = args.index("--bench")
        bench_path = args[i + 1]
        del args[i:i + 2]
    only = None
    if "--only" in args:
        i = args.index("--only")
        only = set(args[i + 1].split(","))
        del args[i:i + 2]
    if len(args) != 2:
        sys.stderr.write(__doc__)
        return 2
    sim, outdir = args
    plots = os.path.join(outdir, "plots")
    os.makedirs(plots, exist_ok=True)
    out = sys.stdout
    with tempfile.TemporaryDirectory() as tmp:
        r = Runner(sim, tmp)
        parts = [("fairness", lambda: fairness(r, out)),
                 ("thesis_5421", lambda: thesis_5421(r, out, plots)),
                 ("thesis_5422", lambda: thesis_5422(r, out, plots)),
                 ("nested", lambda: nested(r, out)),
                 ("gdev", lambda: gdev(r, out, plots)),
                 ("accuracy", lambda: accuracy(r, out, plots)),
                 ("accounting_all", lambda: accounting_all(r, out)),
                 ("grace", lambda: grace(r, out)),
                 ("anticipation", lambda: anticipation(r, out)),
                 ("feed_cap", lambda: feed_cap(r, out)),
                 ("preempt_cost", lambda: preempt_cost(r, out)),
                 ("scale_spread", lambda: scale_spread(r, out)),
                 ("fair_floor", lambda: fair_floor(out)),
                 ("overhead", lambda: (overhead(r, out), overhead_gapped(r, out))),
                 ("irq_latency", lambda: irq_latency(r, out))]
        if bench_path:
            parts.append(("bench", lambda: bench(bench_path, out)))
        names = {n for n, _ in parts} | {"bench"}
        if only and not only <= names:
            sys.stderr.write("unknown part(s): %s\n" % ", ".join(sorted(only - names)))
            return 2
        for name, fn in parts:
            if only is None or name in only:
                fn()
    return 0


if __name__ == "__main__":
    sys.exit(main())
