#!/usr/bin/env python3
"""vm-dkms: the guest driver installed with DKMS in a real Debian 12 guest.

Boots the Debian 12 image of tests/vm/setup-dkms-image.sh (a debootstrap
userland with systemd and Debian's kernel of the test guests' ABI) under TCG
with the project's QEMU and a pvgpu device wired to a private pvgpud, on a
qcow2 overlay (the image stays pristine), with a second disk (mounted read-only)
carrying the project's guest-driver/ and include/pvgpu/ sources, the static
pvgpu-load and the guest side of the test (tests/vm/dkms-guest.sh).  In the
guest, as a tenant would: ./guest-driver/install.sh, which apt-installs dkms
and the kernel headers from the image's offline repository (the guest has no
network) and has DKMS build and install pvgpu.ko; then a real reboot of the
same disk; then the module udev loaded at boot must be the DKMS-built one
(/lib/modules/ABI/updates/dkms, same srcversion), /dev/pvgpu must belong to
group pvgpu, and `pvgpu-load info` and a 200-kernel bench run as a member of
that group (and are refused to a user outside it); finally
./guest-driver/install.sh --uninstall must leave no module, DKMS tree,
source tree or udev rule behind.

The guest reports over its second serial port ("pvgpu-dkms: key=value" and
"[tag] ..." lines); the host waits for each marker with a bounded timeout
and checks the values.  On failure the console, the guest's report, QEMU's
output and QEMU's view of the vCPU are kept (an evidence directory under the
build's meson-logs/evidence).

usage: dkms_test.py --pvgpud P [--qemu P] [--image-dir D] [--load-static P]
Exit status: 0 pass, 1 fail, 77 skipped (no QEMU, no image, no qemu-img or
mke2fs, no static pvgpu-load).
"""

import argparse
import importlib.machinery
import importlib.util
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.normpath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", "daemon"))
from testlib import Skip, TestFailure, check, evidence_dir, log, result  # noqa: E402
from daemon_test import Daemon  # noqa: E402


def load_pvgpu_vm():
    """tests/vm/pvgpu-vm as a module: its serial listeners, QEMU and firmware
    defaults, the kernel-trouble pattern and QEMU's monitor report."""
    loader = importlib.machinery.SourceFileLoader("pvgpu_vm", os.path.join(HERE, "pvgpu-vm"))
    spec = importlib.util.spec_from_loader("pvgpu_vm", loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


VM = load_pvgpu_vm()
SKIP = 77
MARK = re.compile(r"^pvgpu-dkms: (?P<key>[\w.-]+)(?:=(?P<value>.*))?$")
TAGGED = re.compile(r"^\[(?P<tag>[\w.-]+)\] (?P<rest>.*)$")
UUID = "5f0c1a2e-8d1b-4c55-9a10-6e0d2f5bd000"
NAME = "dkms"
# Bounds of each phase: about three times what each took under TCG on the
# 2-core host shared with other builds (docs/guest.md, "The DKMS test").
BOOT_S = 300       # QEMU start to the guest's first report (systemd boot)
INSTALL_S = 900    # install.sh: apt-get from the offline repository, DKMS build
REBOOT_S = 300     # "rebooting" to the second boot's first report
RUN_S = 300        # second boot: checks, info, bench, uninstall, power off


class Guest:
    """A QEMU running the Debian image; the console and the guest's report
    (second serial port) read by a thread, line by line."""

    def __init__(self, args, work, socket_path):
        self.work = work
        self.lines = {"console": [], "out": []}
        self.seen = 0  # report lines wait() has looked at
        self.cond = threading.Condition()
        self.listeners = {n: VM.Listener(os.path.join(work, n + ".sock")) for n in ("console", "out")}
        self.logs = {n: open(os.path.join(work, n + ".log"), "w") for n in ("console", "out")}
        self.monitor = os.path.join(work, "monitor.sock")
        append = ("root=LABEL=pvgpu-root ro console=ttyS0 loglevel=4 panic=-1 "
                  "systemd.show_status=true")
        cmd = [args.qemu, "-machine", "q35", "-accel", "tcg", "-nodefaults", "-no-user-config",
               "-display", "none", "-m", "1024", "-smp", "2",
               "-kernel", os.path.join(args.image_dir, "vmlinuz"),
               "-initrd", os.path.join(args.image_dir, "initrd.img"), "-append", append,
               "-uuid", UUID, "-name", NAME,
               "-drive", f"file={os.path.join(work, 'root.qcow2')},if=none,id=root,format=qcow2,cache=unsafe",
               "-device", "ide-hd,drive=root,bus=ide.0",
               "-drive", f"file={os.path.join(work, 'test.img')},if=none,id=test,format=raw,cache=unsafe",
               "-device", "ide-hd,drive=test,bus=ide.1",
               "-chardev", f"socket,id=pv,path={socket_path},reconnect=1",
               "-device", "pvgpu,chardev=pv",
               "-monitor", f"unix:{self.monitor},server=on,wait=off"]
        for i, n in enumerate(("console", "out")):
            cmd += ["-chardev", f"socket,id=ser{i},path={self.listeners[n].path}", "-serial", f"chardev:ser{i}"]
        with open(os.path.join(work, "qemu-command.txt"), "w") as f:
            f.write(" ".join(cmd) + "\n")
        self.qemu_log = os.path.join(work, "qemu.log")
        self.t0 = time.monotonic()
        self.qemu = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=open(self.qemu_log, "w"),
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        partial = {n: b"" for n in self.listeners}
        fds = dict(self.listeners)
        while fds:
            readable, _, _ = select.select(list(fds.values()), [], [], 0.5)
            if not readable and self.qemu.poll() is not None:
                break
            for lst in readable:
                name = next(k for k, v in fds.items() if v is lst)
                data = lst.on_readable()
                if data is None:
                    continue
                if not data:
                    del fds[name]
                    continue
                *done, partial[name] = (partial[name] + data).split(b"\n")
                with self.cond:
                    for raw in done:
                        line = raw.decode(errors="replace").rstrip("\r")
                        self.lines[name].append(line)
                        # Each line with the seconds since QEMU started: where the time goes.
                        self.logs[name].write(f"{time.monotonic() - self.t0:7.1f} {line}\n")
                    self.cond.notify_all()
                self.logs[name].flush()
        with self.cond:
            self.cond.notify_all()

    def trouble(self):
        """The guest kernel's first line of trouble (BUG, Oops, WARNING, panic), if any."""
        return next((l for l in self.lines["console"] if VM.KERNEL_TROUBLE.search(l)), None)

    def wait(self, pattern, timeout, what):
        """The first report line from now on matching `pattern` (its match)."""
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                for line in self.lines["out"][self.seen:]:
                    self.seen += 1
                    m = rx.search(line)
                    if m:
                        return m
                bad = self.trouble()
                if bad:
                    raise TestFailure(f"the guest kernel reported a problem while waiting for {what}: {bad}")
                if self.qemu.poll() is not None:
                    raise TestFailure(f"QEMU exited (status {self.qemu.returncode}) while waiting for {what}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TestFailure(f"no {what} within {timeout} s")
                self.cond.wait(min(left, 0.5))

    def values(self):
        """Every "pvgpu-dkms: key=value" reported so far (later ones win)."""
        vals = {}
        with self.cond:
            for line in self.lines["out"]:
                m = MARK.match(line)
                if m and m.group("value") is not None:
                    vals[m.group("key")] = m.group("value").strip()
        return vals

    def tagged(self, tag):
        """The lines of command `tag` and its exit status (None if not seen)."""
        out, rc = [], None
        with self.cond:
            for line in self.lines["out"]:
                m = TAGGED.match(line)
                if m and m.group("tag") == tag:
                    r = re.fullmatch(r"rc=(\d+)", m.group("rest"))
                    if r:
                        rc = int(r.group(1))
                    else:
                        out.append(m.group("rest"))
        return out, rc

    def wait_exit(self, timeout, failed):
        """QEMU's exit status once the guest powered off; `failed()` says
        why it will not (the guest's poweroff_failed report)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                return self.qemu.wait(0.5)
            except subprocess.TimeoutExpired:
                why = failed()
                if why:
                    raise TestFailure(f"systemctl poweroff in the guest failed (exit status {why})") from None
        raise TestFailure(f"the guest did not power off within {timeout} s")

    def stop(self):
        if self.qemu.poll() is None:
            os.killpg(self.qemu.pid, signal.SIGKILL)
            self.qemu.wait()
        self.reader.join(5)
        for lst in self.listeners.values():
            lst.close()
        for f in self.logs.values():
            f.close()

    def dump(self, last=40):
        with self.cond:
            for name in ("out", "console"):
                print(f"# guest {name} (last lines):")
                for line in self.lines[name][-last:]:
                    print(f"#   | {line}")
        q = open(self.qemu_log, errors="replace").read().strip() if os.path.exists(self.qemu_log) else ""
        if q:
            print("# QEMU said:")
            for line in q.splitlines()[-20:]:
                print(f"#   | {line}")


def kv(lines):
    """key=value lines (pvgpu-load's output)."""
    return dict(l.split("=", 1) for l in lines if re.match(r"^\w+=", l))


def stage_test_disk(args, work):
    """The read-only disk labelled PVGPUTEST: the guest side of the test as
    boot.sh, the project's guest-driver/ and include/pvgpu/ (what a tenant
    copies into the guest), and the static pvgpu-load."""
    stage = os.path.join(work, "test-disk")
    tree = os.path.join(stage, "pvgpu")
    skip = shutil.ignore_patterns("*.o", "*.ko", "*.mod", "*.mod.c", ".*.cmd", "Module.symvers",
                                  "modules.order", ".tmp_versions")
    shutil.copytree(os.path.join(REPO, "guest-driver"), os.path.join(tree, "guest-driver"), ignore=skip)
    shutil.copytree(os.path.join(REPO, "include", "pvgpu"), os.path.join(tree, "include", "pvgpu"))
    os.makedirs(os.path.join(stage, "bin"))
    shutil.copy2(args.load_static, os.path.join(stage, "bin", "pvgpu-load"))
    shutil.copy2(os.path.join(HERE, "dkms-guest.sh"), os.path.join(stage, "boot.sh"))
    img = os.path.join(work, "test.img")
    p = subprocess.run(["mke2fs", "-q", "-t", "ext4", "-L", "PVGPUTEST", "-d", stage, img, "64M"],
                       capture_output=True, text=True)
    check(p.returncode == 0, f"mke2fs for the test disk: {p.stderr.strip()}")
    p = subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-F", "raw",
                        "-b", os.path.join(args.image_dir, "rootfs.img"), os.path.join(work, "root.qcow2")],
                       capture_output=True, text=True)
    check(p.returncode == 0, f"qemu-img create (the overlay): {p.stderr.strip()}")


def keep_evidence(guest, work, why):
    d = evidence_dir("vm-dkms")
    try:
        os.makedirs(d)
        with open(os.path.join(d, "why.txt"), "w") as f:
            f.write(why + "\n")
        if guest is not None and guest.qemu.poll() is None:
            with open(os.path.join(d, "monitor.txt"), "w") as f:
                f.write(VM.monitor_report(guest.monitor) + "\n")
        for n in ("console.log", "out.log", "qemu.log", "qemu-command.txt", "pvgpud.log"):
            if os.path.exists(os.path.join(work, n)):
                shutil.copy2(os.path.join(work, n), d)
        print(f"# evidence kept in {d}", flush=True)
    except OSError as e:
        print(f"# could not keep the evidence in {d}: {e}", flush=True)


def run(args, work):
    kver = open(os.path.join(args.image_dir, "kernel")).read().strip()
    stage_test_disk(args, work)
    d = Daemon(args, work)
    d.start()
    guest = None
    t0 = time.monotonic()
    try:
        guest = Guest(args, work, d.socket)

        # ---- boot 1: install as a tenant would ----
        guest.wait(r"^pvgpu-dkms: boot=1$", BOOT_S, "first boot report")
        t_boot1 = time.monotonic()
        result("vm.dkms.boot_s", f"{t_boot1 - t0:.1f}")
        guest.wait(r"^pvgpu-dkms: rebooting$", INSTALL_S, "install.sh's end")
        t_installed = time.monotonic()
        result("vm.dkms.install_s", f"{t_installed - t_boot1:.1f}")
        v = guest.values()
        check(v.get("kernel") == kver, f"guest kernel {v.get('kernel')}, want {kver}")
        check(v.get("dkms_before") == "absent" and v.get("headers_before") == "absent",
              f"the image already had dkms ({v.get('dkms_before')}) or the headers "
              f"({v.get('headers_before')}): install.sh's apt path is not tested")
        check(v.get("network_links") == "0", f"the guest has network links ({v.get('network_links')}): "
              "the offline install is not shown")
        out, rc = guest.tagged("install")
        text = "\n".join(out)
        check(rc == 0, f"install.sh exit status {rc}:\n{text[-3000:]}")
        check(re.search(rf"install\.sh: installing dkms linux-headers-{re.escape(kver)}", text),
              f"install.sh did not install dkms and the headers with apt:\n{text[-2000:]}")
        check(re.search(r"pvgpu \S+ installed", text), f"install.sh did not report the install:\n{text[-2000:]}")
        out, rc = guest.tagged("dkms")
        check(rc == 0 and any(re.match(rf"pvgpu/\S+, {re.escape(kver)}, x86_64: installed", l) for l in out),
              f"dkms status after install.sh: {out} (exit {rc})")
        check("pvgpu" in v.get("tenant_groups", "").split(), f"user tenant's groups: {v.get('tenant_groups')}")

        # ---- boot 2: the DKMS-built module, loaded by udev at boot ----
        m = guest.wait(r"^pvgpu-dkms: (boot=2|reboot_failed=\d+)$", REBOOT_S, "second boot report")
        check(m.group(1) == "boot=2", f"systemctl reboot in the guest failed ({m.group(1)})")
        result("vm.dkms.reboot_s", f"{time.monotonic() - t_installed:.1f}")
        guest.wait(r"^pvgpu-dkms: done$", RUN_S, "the second boot's end")
        rc = guest.wait_exit(60, lambda: guest.values().get("poweroff_failed"))
        check(rc == 0, f"QEMU exit status {rc} after the guest powered off")
        result("vm.dkms.case_s", f"{time.monotonic() - t0:.1f}")
        bad = guest.trouble()
        check(bad is None, f"the guest kernel reported a problem: {bad}")
        v = guest.values()
        check(v.get("kernel") == kver, f"guest kernel after the reboot {v.get('kernel')}, want {kver}")
        check(v.get("loaded") == "yes", "pvgpu was not loaded at boot (udev, by the device's PCI alias)")
        path = v.get("module_path", "")
        check(re.fullmatch(rf"/lib/modules/{re.escape(kver)}/updates/dkms/pvgpu\.ko(\.xz|\.zst)?", path),
              f"modinfo -n pvgpu: {path!r}, want DKMS's /lib/modules/{kver}/updates/dkms/pvgpu.ko")
        check(v.get("srcversion_loaded") and v.get("srcversion_loaded") == v.get("srcversion_file"),
              f"the loaded module (srcversion {v.get('srcversion_loaded')}) is not DKMS's "
              f"{path} (srcversion {v.get('srcversion_file')})")
        check(re.fullmatch(r"character special file crw-rw---- pvgpu", v.get("dev", "")),
              f"/dev/pvgpu: {v.get('dev')!r}, want crw-rw---- group pvgpu (60-pvgpu.rules)")
        out, rc = guest.tagged("dkms")
        check(rc == 0 and any(re.match(rf"pvgpu/\S+, {re.escape(kver)}, x86_64: installed", l) for l in out),
              f"dkms status after the reboot: {out} (exit {rc})")
        out, rc = guest.tagged("info")
        info = kv(out)
        check(rc == 0 and info.get("transport") == "device" and info.get("device") == "/dev/pvgpu",
              f"pvgpu-load info as user tenant (exit {rc}): {out}")
        check(info.get("pid_hints") == "on", f"pvgpu-load info: pid_hints={info.get('pid_hints')}")
        out, rc = guest.tagged("bench")
        bench = kv(out)
        check(rc == 0 and bench.get("kernels") == "200", f"pvgpu-load bench as user tenant (exit {rc}): {out}")
        runtime = float(bench.get("runtime_ms", "0"))
        # 200 kernels of 500 us on the simulated GPU: at least 100 ms of GPU time.
        check(runtime >= 100.0, f"bench runtime_ms={runtime}: less than its 200 x 500 us of kernels")
        result("vm.dkms.bench_runtime_ms", f"{runtime:.1f}")
        out, rc = guest.tagged("nogroup")
        check(rc not in (None, 0), f"pvgpu-load info as user nobody (not in group pvgpu) succeeded: {out}")
        out, rc = guest.tagged("uninstall")
        check(rc == 0, f"install.sh --uninstall exit status {rc}: {out}")
        check(v.get("after_loaded") == "no", "pvgpu still loaded after the uninstall")
        check(v.get("after_modinfo") == "none", "modinfo still finds pvgpu after the uninstall")
        check(v.get("after_files", "x") == "", f"pvgpu.ko left in /lib/modules: {v.get('after_files')}")
        check(v.get("after_dkms_tree") == "absent", "/var/lib/dkms/pvgpu left after the uninstall")
        check(v.get("after_src", "x") == "", f"DKMS source left: {v.get('after_src')}")
        check(v.get("after_rules") == "absent", "/etc/udev/rules.d/60-pvgpu.rules left after the uninstall")
        check(v.get("after_dkms_status", "x") == "", f"dkms status after the uninstall: {v.get('after_dkms_status')}")
        check(d.alive(), "pvgpud died")
    except TestFailure as e:
        if guest is not None:
            guest.dump()
        d.dump_log(30)
        with open(os.path.join(work, "pvgpud.log"), "w") as f:
            f.write("\n".join(d.lines) + "\n")
        keep_evidence(guest, work, str(e))
        raise
    finally:
        if guest is not None:
            guest.stop()
        d.stop()


def main():
    build = os.environ.get("PVGPU_BUILD_DIR", os.path.join(REPO, "build"))
    ap = argparse.ArgumentParser(description="the guest driver's DKMS install in a Debian 12 guest")
    ap.add_argument("--pvgpud", required=True)
    ap.add_argument("--qemu", default=VM.default_qemu())
    ap.add_argument("--image-dir", default=os.path.join(build, "dkms-image"))
    ap.add_argument("--load-static", default=os.path.join(build, "scheduler", "tools", "pvgpu-load-static"))
    args = ap.parse_args()
    try:
        if not os.path.exists(args.qemu):
            raise Skip(f"QEMU not found: {args.qemu} (build it: qemu-patches/build-qemu.sh)")
        for f in ("rootfs.img", "vmlinuz", "initrd.img", "kernel"):
            if not os.path.exists(os.path.join(args.image_dir, f)):
                raise Skip(f"the Debian 12 image is missing ({args.image_dir}/{f}): "
                           "make it with tests/vm/setup-dkms-image.sh (as root)")
        for tool, pkg in (("qemu-img", "qemu-utils"), ("mke2fs", "e2fsprogs")):
            if shutil.which(tool) is None:
                raise Skip(f"{tool} not found (apt-get install {pkg})")
        if not os.path.exists(args.load_static):
            raise Skip(f"static pvgpu-load not found: {args.load_static}")
        work = tempfile.mkdtemp(prefix="pvgpu-vm-dkms-")
        log(f"vm-dkms in {work}")
        run(args, work)
    except Skip as e:
        print(f"SKIP: {e}")
        return SKIP
    except TestFailure as e:
        print(f"FAIL dkms: {e}", flush=True)
        print(f"# files kept in {work}")
        return 1
    shutil.rmtree(work, ignore_errors=True)
    print("PASS dkms", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
