#!/usr/bin/env python3
"""The accounting's unit cases on a GPU without a context-switch trace.

The cases tagged [accounting] were written for the trace-less accounting
(interrupts, engine reads, audit looks, doorbell traps); on the default
simulated GPU, which keeps a trace, they are charged exactly from it.  This
runs them again with every rig on a trace-less GPU
(PVGPU_TEST_CTXSW_TRACE=0, tests/unit/policy_rig.hpp) and reports how many
fail, as the pinned target `accounting-cases-notrace` (tests/summary.py):

    UNMET accounting-cases-notrace measured=FAILED_CASES target=0 failed_assertions=N

    usage: accounting_notrace.py UNIT_TESTS
Exit 0 when every case passes (no UNMET line), 1 otherwise.
"""
import os
import re
import subprocess
import sys

NAME = "accounting-cases-notrace"
# [trace] asserts the trace itself; [.targets] are the pinned sweeps.
FILTER = "[accounting]~[trace]"


def main():
    if len(sys.argv) != 2:
        print(__doc__.strip().splitlines()[-3].strip(), file=sys.stderr)
        return 2
    env = dict(os.environ, PVGPU_TEST_CTXSW_TRACE="0")
    proc = subprocess.run([sys.argv[1], FILTER, "-r", "compact"], env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    sys.stdout.write(proc.stdout)
    if proc.returncode < 0:
        print(f"{NAME}: unit-tests killed by signal {-proc.returncode}")
        return 1
    if proc.returncode == 0:
        return 0
    # Catch2's compact reporter ends with "Failed N test cases, failed M assertions."
    m = re.search(r"Failed (\d+) test cases?, failed (\d+) assertions?", proc.stdout)
    if not m:
        print(f"{NAME}: exit status {proc.returncode} without Catch2's count (crash or broken run)")
        return 1
    print(f"UNMET {NAME} measured={m.group(1)} target=0 failed_assertions={m.group(2)}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
