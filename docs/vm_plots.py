#!/usr/bin/env python3
"""Plot the real-guest experiments of docs/results.md section 13.

Usage: meson test -C build --suite vm -v > vm.log
       python3 docs/vm_plots.py vm.log OUT_DIR

Reads the `RESULT vm.thesis1.*` and `RESULT vm.thesis2.*` lines that
tests/vm/vm_test.py prints (measured by pvgpu-load inside the guests), writes
OUT_DIR/plots/vm-thesis-5.4.2.1.csv and vm-thesis-5.4.2.2.csv, and draws them
with gnuplot (benchmark runtime under `none` and hfq).
"""
import os
import re
import subprocess
import sys

# e.g. RESULT vm.thesis1.hfq.throttle400us_bench_ms=1170.8
LINE = re.compile(r"RESULT vm\.(thesis[12])\.(\w+)\.(throttle(\d+)us|throttles(\d+))_bench_ms=([0-9.]+)")

EXPERIMENTS = {
    "thesis1": ("vm-thesis-5.4.2.1", "throttle kernel (us)",
                "thesis 5.4.2.1 in a TCG VM: bench (4 ms kernels) beside a throttle"),
    "thesis2": ("vm-thesis-5.4.2.2", "throttles in the VM",
                "thesis 5.4.2.2: host bench (2 ms kernels) against throttles in a TCG VM"),
}


def parse(path):
    data = {}  # experiment -> policy -> {x: ms}
    with open(path) as f:
        for line in f:
            m = LINE.search(line)
            if not m:
                continue
            exp, policy = m.group(1), m.group(2)
            x = int(m.group(4) or m.group(5))
            data.setdefault(exp, {}).setdefault(policy, {})[x] = float(m.group(6))
    return data


def main():
    if len(sys.argv) != 3 or sys.argv[1] in ("-h", "--help"):
        print(__doc__.strip(), file=sys.stderr)
        return 2
    data = parse(sys.argv[1])
    if not data:
        print(f"vm_plots: no thesis RESULT lines in {sys.argv[1]}", file=sys.stderr)
        return 1
    plots = os.path.join(sys.argv[2], "plots")
    os.makedirs(plots, exist_ok=True)
    for exp, by_policy in sorted(data.items()):
        name, xlabel, title = EXPERIMENTS[exp]
        policies = [p for p in ("none", "hfq") if p in by_policy]
        xs = sorted(set().union(*(by_policy[p].keys() for p in policies)))
        csv = os.path.join(plots, name + ".csv")
        with open(csv, "w") as f:
            f.write("x," + ",".join(policies) + "\n")
            for x in xs:
                f.write(f"{x}," + ",".join(str(by_policy[p].get(x, "")) for p in policies) + "\n")
        lines = ", ".join(f"'{csv}' using 1:{i + 2} with linespoints title '{p}'"
                          for i, p in enumerate(policies))
        script = (f"set terminal png size 800,480\nset output '{os.path.join(plots, name + '.png')}'\n"
                  f"set datafile separator ','\nset key autotitle columnhead left top\n"
                  f"set title \"{title}\"\nset xlabel '{xlabel}'\nset ylabel 'bench runtime (ms)'\n"
                  f"set yrange [0:*]\nset grid\nplot {lines}\n")
        subprocess.run(["gnuplot"], input=script, text=True, check=True)
        print(f"wrote {csv} and {name}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
