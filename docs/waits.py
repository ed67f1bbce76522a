#!/usr/bin/env python3
"""Where an entity's kernels waited: who ran while they were queued.

Usage: python3 docs/waits.py TRACE.csv ENTITY [--from-ms T]

TRACE.csv is what `pvgpu-sim run SCENARIO --trace TRACE.csv` writes.  For
every kernel ENTITY (a path, e.g. host-monitor or tenant-a/training)
submitted after T ms (default: 1000, the usual warm-up), the wait from its
submission to the start of its run is split by who held the engine
meanwhile, or `idle`.  A channel's n-th submission is matched with its n-th
run, which is its n-th kernel on the round-robin GPU (non-preemptive: one
run per kernel); on the timeslice GPU a preempted kernel runs in pieces and
the matching is not meaningful.

Also prints, for every other entity, how its runs' starts fall after the
end of ENTITY's previous run (100 us bins): a long kernel that starts the
moment a bursty entity's kernel ends makes it wait least.
"""
import argparse
import bisect
import collections
import csv
import sys


def load(path):
    runs, subs = [], collections.defaultdict(list)
    with open(path, newline="") as f:
        rd = csv.DictReader(f)
        if rd.fieldnames != ["event", "start_us", "end_us", "entity", "channel"]:
            sys.exit(f"{path}: not a pvgpu-sim trace (header {rd.fieldnames})")
        for row in rd:
            if row["event"] == "run":
                runs.append((float(row["start_us"]), float(row["end_us"]), row["entity"], row["channel"]))
            elif row["event"] == "submit":
                subs[row["channel"]].append((float(row["start_us"]), row["entity"]))
    runs.sort()
    return runs, subs


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("entity")
    ap.add_argument("--from-ms", type=float, default=1000.0)
    a = ap.parse_args()
    runs, subs = load(a.trace)
    since = a.from_ms * 1000
    chans = sorted({ch for ch, s in subs.items() if s and s[0][1] == a.entity})
    if not chans:
        sys.exit(f"no submission of entity '{a.entity}' in {a.trace}")
    starts = [r[0] for r in runs]
    held_by = collections.Counter()
    kernels = 0
    for ch in chans:
        own = [r for r in runs if r[3] == ch]
        for (t_sub, _), run in zip(subs[ch], own):
            if t_sub < since:
                continue
            kernels += 1
            t_run = run[0]
            k = max(0, bisect.bisect_right(starts, t_sub) - 1)
            covered = 0.0
            while k < len(runs) and runs[k][0] < t_run:
                s, e, who, _ = runs[k]
                overlap = min(e, t_run) - max(s, t_sub)
                if overlap > 0:
                    held_by[who] += overlap
                    covered += overlap
                k += 1
            held_by["idle"] += (t_run - t_sub) - covered
    print(f"{a.entity}: {kernels} kernels submitted after {a.from_ms:g} ms; "
          f"mean wait {sum(held_by.values()) / max(kernels, 1):.1f} us")
    print("| while it waited, the engine ran | total (ms) | per kernel of it (us) |")
    print("|---|---|---|")
    for who, t in held_by.most_common():
        print(f"| {who} | {t / 1000:.1f} | {t / max(kernels, 1):.1f} |")

    ends = [r[1] for r in runs if r[2] == a.entity]
    after = collections.defaultdict(collections.Counter)
    for s, e, who, _ in runs:
        if who == a.entity or s < since:
            continue
        j = bisect.bisect_right(ends, s) - 1
        if j >= 0:
            after[who][int((s - ends[j]) // 100) * 100] += 1
    print()
    print(f"| entity | runs | started within 100 us of {a.entity}'s last kernel's end | mean start after it (us) |")
    print("|---|---|---|---|")
    for who in sorted(after):
        c = after[who]
        n = sum(c.values())
        mean = sum((b + 50) * v for b, v in c.items()) / n
        print(f"| {who} | {n} | {c[0] / n:.2f} | {mean:.0f} |")


if __name__ == "__main__":
    main()
