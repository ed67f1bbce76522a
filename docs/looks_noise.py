#!/usr/bin/env python3
"""How noisy the audit looks are: the varied accounting sweep run under
several seeds of the looks, each configuration's measured standard deviation
set against the one predicted from its strata (docs/results.md section 6,
"How large the looks' noise is").

A look in a stratum of width w moves a charge by w when it lands between
the guessed and the true start of a kernel (odds delta/w), so a tenant's N
kernels of mean length L are off by a relative standard deviation of about
sqrt(w * E|delta| / N) / L, where w is its pace over four (at least 200 us),
N is 2 s over its pace and E|delta| is L times its spread over two (the
guess being the mean length).

usage: looks_noise.py UNIT_TESTS [--seeds N] [--jobs J]
UNIT_TESTS: build/tests/unit-tests.  Prints one line per configuration and
a summary; asserts nothing.
"""
import argparse
import concurrent.futures
import math
import os
import re
import statistics
import subprocess
import sys

LINE = re.compile(r"seed (\d+): (\w+), kernels ([\d.]+) ms \+-(\d+)%, think ([\d.]+) ms \+-(\d+)%: ([+-][\d.]+)%")
SUMMARY = re.compile(r"(\d+) of 60 configurations beyond 1% \(mean error ([\d.]+)%; ([\d.]+) engine reads per kernel\)")
MIN_WIDTH_MS = 0.2
PER_PACE = 4


def run(unit_tests, seed):
    env = dict(os.environ, PVGPU_LOOKS_SEED=str(seed))
    out = subprocess.run([unit_tests, "[accounting-sweep-varied]"], env=env, capture_output=True, text=True).stdout
    configs = {}
    for m in LINE.finditer(out):
        configs[int(m[1])] = (float(m[3]), float(m[4]) / 100, float(m[5]), float(m[7]))
    summary = SUMMARY.search(out)
    if not configs or not summary:
        sys.exit(f"looks_noise: no sweep output from {unit_tests} (seed {seed})")
    return configs, int(summary[1]), float(summary[3])


def predicted_sd_at(length, spread, think, width):
    """Relative sd (%) of a tenant's charge over 2 s with strata `width` ms wide."""
    kernels = 2000 / (length + think)
    return 100 * math.sqrt(width * length * spread / 2 / kernels) / length


def predicted_sd(length, spread, think):
    return predicted_sd_at(length, spread, think, max((length + think) / PER_PACE, MIN_WIDTH_MS))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("unit_tests")
    ap.add_argument("--seeds", type=int, default=12)
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ns = ap.parse_args()
    with concurrent.futures.ThreadPoolExecutor(ns.jobs) as pool:
        runs = list(pool.map(lambda s: run(ns.unit_tests, s), range(1, ns.seeds + 1)))
    meta = runs[0][0]
    rows = []
    for cfg, (length, spread, think, _) in sorted(meta.items()):
        errs = [r[0][cfg][3] for r in runs]
        rows.append((cfg, length, spread, think, predicted_sd(length, spread, think), statistics.pstdev(errs),
                     statistics.mean(errs)))
        print(f"config {cfg:2d}: kernels {length:.2f} ms +-{100 * spread:.0f}%, think {think:.2f} ms: "
              f"predicted sd {rows[-1][4]:.2f}%, measured sd {rows[-1][5]:.2f}%, mean {rows[-1][6]:+.2f}%")
    errs = [r[0][c][3] for r in runs for c in r[0]]
    pred = [r[4] for r in rows]
    meas = [r[5] for r in rows]
    print(f"{ns.seeds} seeds x {len(rows)} configurations: correlation of predicted and measured sd "
          f"{statistics.correlation(pred, meas):.2f}, measured / predicted median "
          f"{statistics.median(m / p for p, m in zip(pred, meas) if p > 0.05):.2f}")
    print(f"mean error {statistics.mean(errs):+.3f}% (standard error {statistics.pstdev(errs) / math.sqrt(len(errs)):.3f}), "
          f"RMS {math.sqrt(statistics.mean(e * e for e in errs)):.2f}%")
    print(f"beyond 1% per seed: {[r[1] for r in runs]}; engine reads per kernel {statistics.mean(r[2] for r in runs):.2f}")
    floor = [predicted_sd_at(length, spread, think, MIN_WIDTH_MS) for _, length, spread, think, *_ in rows]
    print(f"configurations whose predicted sd stays above 0.5% with every stratum at {1000 * MIN_WIDTH_MS:.0f} us: "
          f"{sum(1 for f in floor if f > 0.5)} of {len(rows)}")


if __name__ == "__main__":
    main()
