#!/usr/bin/env python3
"""The patched KVM for real: nested SVM inside a TCG guest (docs/kvm-hooks.md).

Boots a TCG guest with -cpu max (QEMU's TCG emulates AMD SVM with nested
paging) through tests/vm/pvgpu-vm, loads the kvm.ko and kvm-amd.ko that
kvm-hooks/build.sh built (with Debian's irqbypass.ko and ccp.ko), and runs the
static kvm-wn-l2 there: an L2 VM whose real-mode code stores to a registered
page N times, checked for N eventfd signals, the final memory and one exit to
userspace (the HLT); then tracking off and on, page-crossing stores, two
vCPUs on two L1 CPUs, and unregister while a vCPU stores.  Every check is a
"RESULT name pass|FAIL ..." line of kvm-wn-l2, echoed here.

usage: nested_test.py --pvgpud P --l2 P --modules DIR [--stores N]
Exit status: 0 pass, 1 fail, 77 skipped (modules, QEMU or guest kernel missing).
"""

import argparse
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", "daemon"))
from testlib import Skip, check, run_case  # noqa: E402
from daemon_test import Daemon  # noqa: E402

VM = os.path.join(HERE, "..", "vm", "pvgpu-vm")
# The checks kvm-wn-l2 makes; each must report "pass".
CHECKS = ["register-unaligned", "register-outside-memslots", "register-bad-eventfd",
          "register", "register-overlap", "tracked-stores", "switch-off", "untracked-stores",
          "switch-on", "retracked-stores", "page-crossing-stores", "two-vcpus",
          "bench-mmio-exits", "unregister-during-run", "register-again"]


def kvm_modules(modules_dir):
    """What a -cpu max TCG guest loads for nested SVM with the patched KVM,
    in load order: Debian's irqbypass.ko and ccp.ko, kvm.ko and kvm-amd.ko
    as kvm-hooks/build.sh built them into `modules_dir`."""
    kvm_dir = os.path.join(modules_dir, "src", "arch", "x86", "kvm")
    return [os.path.join(modules_dir, "guest-modules", "irqbypass.ko"),
            os.path.join(modules_dir, "guest-modules", "ccp.ko"),
            os.path.join(kvm_dir, "kvm.ko"), os.path.join(kvm_dir, "kvm-amd.ko")]


def run(args, tmp):
    mods = kvm_modules(args.modules)
    missing = [m for m in mods if not os.path.exists(m)]
    if missing:
        raise Skip(f"{missing[0]} not found: run kvm-hooks/build.sh")
    daemon = Daemon(args, tmp)  # the pvgpu device in the L1 guest needs a pvgpud
    daemon.start()
    try:
        insmods = " && ".join(f"insmod /bin/{os.path.basename(m)}" for m in mods)
        command = (f"{insmods} && dmesg | grep -q 'Nested Paging enabled' && "
                   f"kvm-wn-l2 {args.stores}")
        cmd = [sys.executable, VM, "--socket", daemon.socket, "--name", "kvm-nested",
               "--uuid", "5f0c1a2e-8d1b-4c55-9a10-6e0d2f5b9c4b", "--module", "",
               "--cpus", "2", "--mem", "512", "--timeout", "240",
               "--qemu-arg=-cpu", "--qemu-arg=max",
               "--console-log", os.path.join(tmp, "console.log")]
        for f in mods + [args.l2]:
            cmd += ["--copy", f]
        proc = subprocess.run(cmd + ["--", command], capture_output=True, text=True)
    finally:
        daemon.stop()
    out = proc.stdout
    sys.stdout.write(out)
    sys.stderr.write(proc.stderr)
    found = re.search(r"pvgpu-vm: ((QEMU|guest kernel) not found.*)", proc.stderr)
    if proc.returncode == 125 and found:
        raise Skip(found.group(1))
    results = dict(re.findall(r"^RESULT (\S+) (pass|FAIL)", out, re.M))
    for name in CHECKS:
        check(results.get(name) == "pass", f"{name}: {results.get(name, 'not reported')}")
    check(proc.returncode == 0 and "kvm-wn-l2: ok" in out,
          f"guest command exit status {proc.returncode}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pvgpud", required=True)
    ap.add_argument("--l2", required=True, help="the static kvm-wn-l2")
    ap.add_argument("--modules", required=True, help="kvm-hooks/build.sh output directory")
    ap.add_argument("--stores", type=int, default=1000, help="L2 stores per run")
    return run_case("kvm-nested", run, ap.parse_args())


if __name__ == "__main__":
    sys.exit(main())
