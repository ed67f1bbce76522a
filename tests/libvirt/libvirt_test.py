#!/usr/bin/env python3
"""End-to-end tests of the libvirt integration against a real libvirtd.

Each case runs a private libvirtd (session mode, as the unprivileged user
`nobody`, state in a temporary directory: the host's libvirt is not touched),
a private pvgpud following it, and TCG domains with the project's QEMU, the
Debian guest kernel and an initramfs made by tests/vm/pvgpu-vm --write-initrd
(pvgpu.ko, the static guest tools, the command).  Guests stream their output
over serial ports to UNIX sockets of this script.  Measured numbers are
printed as "RESULT key=value" lines (docs/results.md).

usage: libvirt_test.py --pvgpud P --pvgpuctl P --vm P [--kubevirt-hook P] CASE
CASE: lifecycle | shares | wedge | identity | migrate | kubevirt-hook | all
Exit status: 0 pass, 1 fail, 77 skipped (no libvirtd, QEMU, guest kernel or module).
"""

import argparse
import functools
import json
import importlib.machinery
import importlib.util
import os
import pwd
import re
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import uuid as uuidlib

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", "daemon"))
sys.path.insert(0, os.path.join(HERE, "..", "vm"))
from testlib import (Skip, TestFailure, check, evidence_dir, log, monotonic_from_wall, recv_lines,  # noqa: E402
                     rerun, result, stop_process)
from testlib import wait_for as testlib_wait_for  # noqa: E402
from daemon_test import (DAEMONS, E_OK, MSG_HELLO, MSG_HELLO_REPLY, ROLE_VMM, Daemon,  # noqa: E402
                         RawClient, ctl_json, measure_between)
from vm_test import (GuestReports, guest_pause_ends, guest_throttle, key_values, load_cmd,  # noqa: E402
                     report_pause, tagged)

SKIP = 77
NS = "http://pvgpu.org/xmlns/domain/1.0"
USER = "nobody"

# pvgpu-vm (no .py: loaded by path) knows the guests' heartbeat and how to
# read QEMU's view of a stopped vCPU.
_loader = importlib.machinery.SourceFileLoader("pvgpu_vm", os.path.join(HERE, "..", "vm", "pvgpu-vm"))
pvgpu_vm = importlib.util.module_from_spec(importlib.util.spec_from_loader("pvgpu_vm", _loader))
_loader.exec_module(pvgpu_vm)

# Guests whose kernel stopped under TCG (docs/guest.md, "A guest that
# stops"): the init's heartbeat on the console (every 5 s) silent this long,
# and QEMU shows the vCPU halted with interrupts on.  A case that failed
# with one is run once more, as tests/vm does, never silently: a RERUN line
# names the case, the cause and the evidence kept (console, libvirt's QEMU
# log, QEMU's view, a core dump of QEMU), and the summary counts it.
HEARTBEAT_SILENCE = 20
GUESTS = []
WEDGED = []


# Conditions here are listings and processes: look every 50 ms.
wait_for = functools.partial(testlib_wait_for, step=0.05)


class Paths:
    def __init__(self, ns):
        self.pvgpud = ns.pvgpud
        self.pvgpuctl = ns.pvgpuctl
        self.vm = ns.vm
        self.hook = ns.kubevirt_hook
        build = os.environ.get("PVGPU_BUILD_DIR", os.path.join(HERE, "..", "..", "build"))
        self.qemu = os.path.join(os.environ.get("PVGPU_QEMU_DIR", os.path.join(build, "qemu-src")),
                                 "qemu-system-x86_64")
        kdir = os.path.join(build, "guest-kernel")
        self.kernel = None
        if os.path.exists(os.path.join(kdir, "version")):
            k = os.path.join(kdir, "vmlinuz-" + open(os.path.join(kdir, "version")).read().strip())
            self.kernel = k if os.path.exists(k) else None
        self.module = os.path.join(build, "guest-driver", "pvgpu.ko")
        self.load = os.path.join(build, "scheduler", "tools", "pvgpu-load-static")

    def check_present(self):
        for what, p in (("libvirtd", shutil.which("libvirtd", path="/usr/sbin:/usr/bin")),
                        ("virsh", shutil.which("virsh")), ("QEMU", self.qemu), ("guest kernel", self.kernel),
                        ("guest module", self.module), ("static pvgpu-load", self.load)):
            if not p or not os.path.exists(p):
                raise Skip(f"{what} not found ({p}): run tests/libvirt/setup-libvirt.sh, "
                           "tests/vm/setup-guest.sh and qemu-patches/build-qemu.sh")
        if os.geteuid() != 0:
            raise Skip("needs root (runs libvirtd as the user nobody)")


class Libvirt:
    """A session-mode libvirtd running as `nobody` with its state in `root`."""

    def __init__(self, root, host_uuid=None, bind=None):
        """host_uuid: libvirt's host UUID (libvirtd.conf), what tells two
        hosts apart in a migration.  bind: (what, where) mounted over `where`
        in a mount namespace of this libvirtd and its QEMUs, so that a path
        names this host's own file (pvgpud's socket, the same path on every
        host)."""
        self.root = root
        self.pw = pwd.getpwnam(USER)
        self.bind = bind
        for d in ("run", "cfg/libvirt", "cache", "home"):
            os.makedirs(os.path.join(root, d), exist_ok=True)
        if host_uuid:
            with open(os.path.join(root, "cfg", "libvirt", "libvirtd.conf"), "w") as f:
                f.write(f'host_uuid = "{host_uuid}"\n')
        self._chown(root)
        self.env = {"HOME": os.path.join(root, "home"), "XDG_RUNTIME_DIR": os.path.join(root, "run"),
                    "XDG_CONFIG_HOME": os.path.join(root, "cfg"), "XDG_CACHE_HOME": os.path.join(root, "cache"),
                    "PATH": "/usr/sbin:/usr/bin:/bin", "LANG": "C",
                    # virsh must not start a session libvirtd of its own
                    # while this one comes up.
                    "LIBVIRT_AUTOSTART": "0"}
        self.sock = os.path.join(root, "run", "libvirt", "libvirt-sock")
        # root reaches nobody's session daemon through its socket.
        self.uri = f"qemu+unix:///session?socket={self.sock}"
        self.pid_dir = os.path.join(root, "run", "libvirt", "qemu", "run")
        self.proc = None
        self.log = os.path.join(root, "libvirtd.log")

    def _chown(self, path):
        for dirpath, dirnames, filenames in os.walk(path):
            for n in [dirpath] + [os.path.join(dirpath, f) for f in dirnames + filenames]:
                os.chown(n, self.pw.pw_uid, self.pw.pw_gid)

    def _as_user(self):
        uid, gid = self.pw.pw_uid, self.pw.pw_gid

        def demote():
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
        return demote

    def start(self):
        if os.path.exists(self.sock):
            os.unlink(self.sock)
        if self.bind:
            # unshare and setpriv exec: the process is libvirtd's.
            cmd = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                   'mount --bind "$1" "$2" && exec setpriv --reuid="$3" --regid="$4" --clear-groups libvirtd',
                   "sh", self.bind[0], self.bind[1], str(self.pw.pw_uid), str(self.pw.pw_gid)]
            demote = None
        else:
            cmd, demote = ["libvirtd"], self._as_user()
        self.proc = subprocess.Popen(cmd, env=self.env, cwd=self.root, preexec_fn=demote,
                                     stdin=subprocess.DEVNULL, stdout=open(self.log, "a"),
                                     stderr=subprocess.STDOUT)
        wait_for(lambda: self.virsh("uri", check_rc=False).returncode == 0, 30, "libvirtd to answer", step=0.2)

    def stop(self):
        if self.proc:
            stop_process(self.proc, timeout=15)
        self.proc = None

    def virsh(self, *args, check_rc=True, timeout=60):
        p = subprocess.run(["virsh", "-q", "-c", "qemu:///session"] + list(args), env=self.env,
                           preexec_fn=self._as_user(), capture_output=True, text=True, timeout=timeout)
        if check_rc and p.returncode != 0:
            raise TestFailure(f"virsh {' '.join(args)}: exit {p.returncode}: {p.stderr.strip()}")
        return p

    def qemu_log(self, name):
        """libvirt's log of the domain's QEMU ('' if none yet)."""
        path = os.path.join(self.root, "cache", "libvirt", "qemu", "log", f"{name}.log")
        try:
            with open(path, errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def cleanup(self):
        try:
            if self.proc and self.proc.poll() is None:
                # Before the domains go: a stopped guest is told from a
                # failure of ours only while its QEMU runs.  A probe that
                # fails (a monitor that does not answer) only means no rerun.
                for g in GUESTS:
                    try:
                        if g.lv is self and g.name not in WEDGED and g.stopped():
                            WEDGED.append(g.name)
                    except (subprocess.SubprocessError, OSError) as e:
                        print(f"# [{g.name}] could not ask QEMU about the vCPU: {e}", flush=True)
        finally:
            if self.proc and self.proc.poll() is None:
                for name in self.virsh("list", "--name", check_rc=False).stdout.split():
                    self.virsh("destroy", name, check_rc=False)
            self.stop()
        # QEMUs that outlived libvirtd (it does not kill them when it stops).
        subprocess.run(["pkill", "-u", USER, "-f", "qemu-system-x86_64 -name guest="], check=False)


class Guest(GuestReports):
    """A libvirt domain booting the guest kernel with a command; its stdout
    (ttyS1) comes to a UNIX socket here and feeds Series like tests/vm."""

    def __init__(self, paths, lv, tmp, name, command, extra_initrd=(), edit=None):
        """edit: what the XML goes through before it is defined (a KubeVirt
        hook), given the XML, returning the XML to define."""
        super().__init__(name)
        GUESTS.append(self)
        self.lv = lv
        self.expect_stop = False  # the wedge case stops this guest on purpose: no evidence then
        self.uuid = str(uuidlib.uuid4())
        self.dir = os.path.join(tmp, name)
        os.makedirs(self.dir)
        initrd = os.path.join(self.dir, "initrd.cpio")
        p = subprocess.run([sys.executable, paths.vm, "--write-initrd", initrd, "--module", paths.module]
                           + list(extra_initrd) + ["--", command], capture_output=True, text=True)
        check(p.returncode == 0, f"pvgpu-vm --write-initrd: {p.stderr.strip()}")
        self.lines = []
        self.conn_lines = []  # the lines of each connection: one per QEMU the guest ran in
        self.out_path = os.path.join(self.dir, "out.sock")
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(self.out_path)
        self.listener.listen(1)
        lv._chown(self.dir)
        os.chmod(self.out_path, 0o777)
        self.console = os.path.join(self.dir, "console.log")
        # The admin's own <qemu:commandline> (a no-op): attach must keep it.
        self.xml = f"""<domain type='qemu' xmlns:qemu='http://libvirt.org/schemas/domain/qemu/1.0'>
  <name>{name}</name>
  <uuid>{self.uuid}</uuid>
  <memory unit='MiB'>256</memory>
  <vcpu>1</vcpu>
  <os>
    <type arch='x86_64' machine='q35'>hvm</type>
    <kernel>{paths.kernel}</kernel>
    <initrd>{initrd}</initrd>
    <cmdline>console=ttyS0 quiet loglevel=4 panic=-1 rdinit=/init</cmdline>
  </os>
  <on_reboot>destroy</on_reboot>
  <devices>
    <emulator>{os.path.realpath(paths.qemu)}</emulator>
    <serial type='file'><source path='{self.console}' append='on'/><target port='0'/></serial>
    <serial type='unix'><source mode='connect' path='{self.out_path}'/><target port='1'/></serial>
    <controller type='usb' model='none'/>
    <memballoon model='none'/>
  </devices>
  <qemu:commandline>
    <qemu:arg value='-msg'/><qemu:arg value='timestamp=off'/>
  </qemu:commandline>
</domain>
"""
        if edit:
            self.xml = edit(self.xml)
        path = os.path.join(self.dir, "domain.xml")
        with open(path, "w") as f:
            f.write(self.xml)
        os.chmod(path, 0o644)
        lv.virsh("define", path)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            sink = []
            self.conn_lines.append(sink)
            threading.Thread(target=self._read_conn, args=(conn, sink), daemon=True).start()

    def _read_conn(self, conn, sink):
        for raw in recv_lines(conn):
            line, now = raw.decode(errors="replace").rstrip("\r"), time.monotonic()
            self.take(self.lines, line, now)
            with self.cond:
                sink.append((now, line))

    def stopped(self):
        """The guest kernel stopped: its heartbeat was on the console and has
        been silent for HEARTBEAT_SILENCE s, the domain still runs, and QEMU
        shows the vCPU halted with interrupts enabled (a vCPU still running
        is the guest's own trouble, not this).  Prints QEMU's view."""
        try:
            silent = time.time() - os.path.getmtime(self.console)
            with open(self.console, errors="replace") as f:
                beat = pvgpu_vm.ALIVE_MARK in f.read()
        except OSError:
            return False
        if not beat or silent < HEARTBEAT_SILENCE:
            return False
        if self.lv.virsh("domstate", self.name, check_rc=False, timeout=20).stdout.strip() != "running":
            return False
        # A vCPU caught handling a rare tick shows HLT=0: look a few times.
        for _ in range(3):
            report = "\n".join(self.lv.virsh("qemu-monitor-command", self.name, "--hmp", c, check_rc=False,
                                              timeout=20).stdout
                               for c in ("info status", "info registers", "info lapic"))
            if pvgpu_vm.halted_with_interrupts_on(report):
                break
        print(f"# [{self.name}] no heartbeat for {silent:.0f} s; QEMU monitor:", flush=True)
        for line in report.splitlines():
            if line.strip():
                print(f"#   | {line}", flush=True)
        halted = pvgpu_vm.halted_with_interrupts_on(report)
        if halted and not self.expect_stop:
            self.keep_evidence(f"no heartbeat for {silent:.0f} s; vCPU halted with interrupts enabled", report)
        return halted

    def keep_evidence(self, why, report):
        """The console, libvirt's QEMU log, QEMU's view and a core dump of the
        domain's QEMU (gcore), as pvgpu-vm keeps them (self.evidence)."""
        self.evidence = evidence_dir(f"libvirt-{self.name}")
        qemu_log = [self.lv.qemu_log(self.name)]
        pid = None
        p = subprocess.run(["pgrep", "-f", f"qemu-system-x86_64 -name guest={self.name},"],
                           capture_output=True, text=True)
        if p.stdout.split():
            pid = int(p.stdout.split()[0])
        with open(self.console, errors="replace") as f:
            console = f.read().splitlines()
        pvgpu_vm.keep_evidence(argparse.Namespace(evidence_dir=self.evidence), why, console, qemu_log,
                               report, live_pid=pid)

    def dump(self):
        for _, line in self.lines[-20:]:
            print(f"#   [{self.name}] {line}")
        if os.path.exists(self.console):
            for line in open(self.console, errors="replace").read().splitlines()[-15:]:
                print(f"#   [{self.name} console] {line}")


def pvgpuctl(paths, d, lv, *args, check_rc=True):
    cmd = [paths.pvgpuctl, "--admin-socket", d.admin, "-c", lv.uri] + list(args)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    if check_rc and p.returncode != 0:
        raise TestFailure(f"pvgpuctl {' '.join(args)}: exit {p.returncode}: {p.stderr.strip()}")
    return p


def vm_row(paths, d, name):
    for e in ctl_json(paths, d, "list")["entities"]:
        if e["path"] == name:
            return e
    return None


def write_daemon_config(d, lv, vmm_users=("root", USER)):
    # The session libvirtd runs its QEMUs as nobody: that user is a VMM here.
    with open(d.config, "w") as f:
        f.write(f"[daemon]\nsocket_mode = 0666\nvmm_users = {', '.join(vmm_users)}\n\n"
                f"[libvirt]\nuri = {lv.uri}\npid_dir = {lv.pid_dir}\n")


def start_daemon(paths, tmp, lv, socket_path=None, vmm_users=("root", USER)):
    d = Daemon(paths, tmp)
    if socket_path:
        d.socket = socket_path
    write_daemon_config(d, lv, vmm_users)
    d.start()
    return d


def set_metadata(lv, name, xml, *flags):
    lv.virsh("metadata", name, NS, "--key", "pvgpu", "--set", xml, *flags)


def hello_as(d, vm_uuid, name):
    """A VMM HELLO from this process; returns the reply status (0 OK)."""
    c = RawClient(d.socket)
    try:
        payload = struct.pack("<II16s64sII", 1, ROLE_VMM, uuidlib.UUID(vm_uuid).bytes, name.encode(), os.getpid(), 0)
        seq = c.send(MSG_HELLO, payload)
        msg = c.expect(seq)
        check(msg[0] == MSG_HELLO_REPLY, f"HELLO answered with type {msg[0]}")
        return struct.unpack_from("<I", msg[2])[0]
    finally:
        c.close()


# ---- cases ------------------------------------------------------------------------------------


def case_lifecycle(paths, tmp):
    """attach, start, weights from virsh metadata and pvgpuctl, restarts, identity, shutdown."""
    lv = Libvirt(os.path.join(tmp, "libvirt"))
    try:
        # pvgpud first: libvirtd absent at its start must not hold it up.
        d = start_daemon(paths, tmp, lv)
        wait_for(lambda: any("libvirt: cannot connect" in line for line in d.lines), 5,
                 "pvgpud to say libvirt is not there")
        lv.start()
        wait_for(lambda: any("libvirt: following domains" in line for line in d.lines), 40,
                 "pvgpud to connect once libvirtd runs")
        g = Guest(paths, lv, tmp, "lv1", "sleep 600")
        out = pvgpuctl(paths, d, lv, "attach", "lv1", "--weight", "200", "--socket", d.socket).stdout
        check("attached" in out, f"attach said: {out}")
        xml = lv.virsh("dumpxml", "--inactive", "lv1").stdout
        check(f'xmlns:pvgpu="{NS}" weight="200"' in xml, "attach: no <pvgpu:gpu weight=200/> in the XML")
        check("pvgpu,chardev=pvgpu0" in xml and f"path={d.socket}" in xml, "attach: no device wiring")
        check("timestamp=off" in xml, "attach lost the admin's own qemu:commandline arguments")

        lv.virsh("start", "lv1")
        # The VM and its weight show up once QEMU says HELLO, before any channel.
        row = wait_for(lambda: vm_row(paths, d, "lv1"), 30, "lv1 in pvgpuctl list")
        check(row["weight"] == 200 and row.get("channels", 0) == 0, f"lv1 row: {row}")

        t0 = time.monotonic()
        set_metadata(lv, "lv1", '<gpu weight="300"/>', "--live", "--config")
        wait_for(lambda: vm_row(paths, d, "lv1")["weight"] == 300, 1.0, "virsh metadata 300 applied within 1 s",
                 step=0.01)
        result("libvirt.metadata_applied_ms", f"{(time.monotonic() - t0) * 1000:.0f}")

        pvgpuctl(paths, d, lv, "set-weight", "lv1", "400")
        check(vm_row(paths, d, "lv1")["weight"] == 400, "pvgpuctl set-weight 400 not applied")
        for flag in ((), ("--inactive",)):
            xml = lv.virsh("dumpxml", *flag, "lv1").stdout
            check('weight="400"' in xml, f"pvgpuctl set-weight not in virsh dumpxml {' '.join(flag)}")

        # libvirtd restarts while the domain runs: pvgpud reconnects and resyncs.
        lv.stop()
        lv.start()
        t0 = time.monotonic()
        set_metadata(lv, "lv1", '<gpu weight="500"/>', "--live", "--config")
        wait_for(lambda: vm_row(paths, d, "lv1")["weight"] == 500, 40, "weight 500 after a libvirtd restart")
        result("libvirt.after_libvirtd_restart_applied_s", f"{time.monotonic() - t0:.1f}")
        check(d.alive(), "pvgpud died when libvirtd restarted")

        # pvgpud restarts while the domain runs: the device reconnects, the
        # weight comes from the domain's metadata again.
        d.stop()
        d.start()
        row = wait_for(lambda: vm_row(paths, d, "lv1"), 30, "lv1 back after a pvgpud restart")
        check(row["weight"] == 500, f"after a pvgpud restart lv1 has weight {row['weight']}, metadata says 500")

        # Nobody else may be lv1: a HELLO with its UUID from another process.
        check(hello_as(d, g.uuid, "lv1") != E_OK, "a second HELLO as lv1 was accepted")
        # Nor a stopped-and-started pvgpu domain whose QEMU is not connected yet
        # (its device points elsewhere): the pid libvirt recorded decides.
        g2 = Guest(paths, lv, tmp, "lv2", "sleep 600")
        pvgpuctl(paths, d, lv, "attach", "lv2", "--socket", os.path.join(tmp, "elsewhere.sock"))
        lv.virsh("start", "lv2")
        status = hello_as(d, g2.uuid, "lv2")
        check(status != E_OK, "a HELLO as libvirt domain lv2 from a process that is not its QEMU was accepted")
        wait_for(lambda: any("is not its QEMU" in line for line in d.lines), 5, "a log line about the impostor")

        # Invalid metadata: one clear line naming the domain, default weight.
        set_metadata(lv, "lv1", '<gpu weight="lots"/>', "--live")
        wait_for(lambda: vm_row(paths, d, "lv1")["weight"] == 100, 5, "invalid metadata -> weight 100")
        bad = wait_for(lambda: [line for line in d.lines if "invalid pvgpu metadata" in line], 5,
                       "a log line about the invalid metadata")
        check(len(bad) == 1 and "lv1" in bad[0], f"invalid metadata log lines: {bad}")

        # Detach and shut down: the VM leaves pvgpuctl list.
        pvgpuctl(paths, d, lv, "detach", "lv2")
        xml = lv.virsh("dumpxml", "--inactive", "lv2").stdout
        check("-device" not in xml and "id=pvgpu0" not in xml and NS not in xml, f"detach left pvgpu in: {xml}")
        check("timestamp=off" in xml, "detach removed the admin's own qemu:commandline arguments")
        lv.virsh("destroy", "lv1")
        wait_for(lambda: vm_row(paths, d, "lv1") is None, 10, "lv1 to leave pvgpuctl list")
        check(d.alive(), "pvgpud died")
    finally:
        lv.cleanup()


def case_shares(paths, tmp):
    """Two libvirt domains at weights 2:1 running the guest pvgpu-load get 2:1."""
    lv = Libvirt(os.path.join(tmp, "libvirt"))
    lv.start()
    try:
        d = start_daemon(paths, tmp, lv)
        k = 2000
        guests = []
        for name, w in (("lvA", 200), ("lvB", 100)):
            g = Guest(paths, lv, tmp, name, guest_throttle(name, k, 40))
            pvgpuctl(paths, d, lv, "attach", name, "--weight", str(w), "--socket", d.socket)
            guests.append(g)
        for g in guests:
            lv.virsh("start", g.name)
        series = [g.get(g.name) for g in guests]
        try:
            for s in series:
                s.wait_until(lambda x: len(x.reports) >= 1, 150, "its first report")
        except TestFailure:
            for g in guests:
                g.dump()
            raise
        t0 = max(s.reports[0][0] for s in series) + 2.0
        shares, busy = measure_between(series, [k, k], t0, t0 + 8.0, 100)
        for g, got in zip(guests, shares):
            result(f"libvirt.shares.{g.name}_share", f"{got:.3f}")
        result("libvirt.shares.gpu_busy", f"{busy:.3f}")
        for g, got, want in zip(guests, shares, (2 / 3, 1 / 3)):
            # The goal is 0.02 (VM shares); 0.05 since the test was written,
            # not from a measured spread: two recorded runs were 0.004 and
            # 0.029 off, so the goal is not met in every run.
            check(abs(got - want) <= 0.05, f"{g.name} got {got:.3f}, target {want:.3f}")
    finally:
        lv.cleanup()


def case_wedge(paths, tmp):
    """A domain whose guest stops every process but its shell (the heartbeat
    among them) and sleeps is told stopped; one that sleeps quietly is not."""
    lv = Libvirt(os.path.join(tmp, "libvirt"))
    lv.start()
    try:
        quiet = Guest(paths, lv, tmp, "lvquiet", "sleep 600")
        # Stopped only after several heartbeats (one every 5 s) got out.
        wedge = Guest(paths, lv, tmp, "lvwedge", "sleep 20; kill -STOP -1; sleep 600")
        wedge.expect_stop = True
        for g in (quiet, wedge):
            lv.virsh("start", g.name)

        def beat(g):
            try:
                with open(g.console, errors="replace") as f:
                    return pvgpu_vm.ALIVE_MARK in f.read()
            except OSError:
                return False
        t0 = time.monotonic()
        wait_for(lambda: beat(quiet) and beat(wedge), 150, "both guests' first heartbeat", step=1)
        told = wait_for(wedge.stopped, 120, "the stopped guest to be told", step=2)
        took = time.monotonic() - t0
        check(told, "the stopped guest was not told")
        check(not quiet.stopped(), "the quiet guest was taken for stopped")
        result("libvirt.wedge.detected_after_s", f"{took:.1f}")
    finally:
        lv.cleanup()
    # cleanup() looks at every guest before the domains go: the stopped one
    # only (once), which is what makes another case run again.
    check(WEDGED == ["lvwedge"], f"guests noted stopped at cleanup: {WEDGED}")


def define_only(paths, lv, tmp, name, vm_uuid, weight):
    """A domain with pvgpu metadata that is defined and never started (no guest needed)."""
    xml = f"""<domain type='qemu'>
  <name>{name}</name>
  <uuid>{vm_uuid}</uuid>
  <memory unit='MiB'>64</memory>
  <metadata><pvgpu:gpu xmlns:pvgpu='{NS}' weight='{weight}'/></metadata>
  <os><type arch='x86_64' machine='q35'>hvm</type></os>
  <devices>
    <emulator>{os.path.realpath(paths.qemu)}</emulator>
    <controller type='usb' model='none'/>
    <memballoon model='none'/>
  </devices>
</domain>
"""
    path = os.path.join(tmp, f"{name}.xml")
    with open(path, "w") as f:
        f.write(xml)
    os.chmod(path, 0o644)
    lv.virsh("define", path)


def kubevirt_shaped(xml, vmi_uid):
    """The test domain as virt-launcher writes its domains (KubeVirt's
    converter, Go's encoding/xml): double quotes, <metadata> holding
    KubeVirt's element in its own namespace, the qemu namespace declared."""
    xml = xml.replace("'", '"')
    return xml.replace("  <on_reboot>", f"""  <metadata>
    <kubevirt xmlns="http://kubevirt.io">
      <uid>{vmi_uid}</uid>
      <graceperiod>
        <deletionGracePeriodSeconds>0</deletionGracePeriodSeconds>
      </graceperiod>
    </kubevirt>
  </metadata>
  <on_reboot>""", 1)


def case_kubevirt_hook(paths, tmp):
    """Issue 55: a virt-launcher-shaped domain through pvgpu-kubevirt-hook,
    run as KubeVirt's sidecar-shim runs onDefineDomain, for a VMI annotated
    pvgpu.org/weight "300"; the XML it prints is defined and started: the VM
    arrives at pvgpud with weight 300 and its guest's load runs through the
    device."""
    check(paths.hook is not None, "kubevirt-hook needs --kubevirt-hook (pvgpu-kubevirt-hook)")
    lv = Libvirt(os.path.join(tmp, "libvirt"))
    lv.start()
    try:
        d = start_daemon(paths, tmp, lv)
        with open(os.path.join(HERE, "kubevirt", "vmi.json")) as f:
            vmi = json.load(f)
        vmi["metadata"]["name"] = "lvkube"
        check(vmi["metadata"]["annotations"].get("pvgpu.org/weight") == "300", "fixture VMI: weight is not 300")
        hooked = {}

        def hook(xml):
            xml = kubevirt_shaped(xml, vmi["metadata"]["uid"])
            # As the shim runs it: two arguments, the socket from the sidecar image's environment.
            env = {k: v for k, v in os.environ.items() if not k.startswith("PVGPU_")}
            env["PVGPU_SOCKET"] = d.socket
            p = subprocess.run([paths.hook, "--vmi", json.dumps(vmi), "--domain", xml], capture_output=True,
                               text=True, env=env, timeout=30)
            check(p.returncode == 0, f"pvgpu-kubevirt-hook: exit {p.returncode}: {p.stderr.strip()}")
            hooked["in"], hooked["err"] = xml, p.stderr
            return p.stdout

        g = Guest(paths, lv, tmp, "lvkube", guest_throttle("lvkube", 2000, 30), edit=hook)
        log(f"hook: {hooked['err'].strip()}")
        xml = lv.virsh("dumpxml", "--inactive", "lvkube").stdout
        check(f'xmlns:pvgpu="{NS}" weight="300"' in xml, f"no <pvgpu:gpu weight=300/> in the defined domain:\n{xml}")
        check(f"<uid>{vmi['metadata']['uid']}</uid>" in xml, "KubeVirt's metadata lost")
        check("pvgpu,chardev=pvgpu0" in xml and f"path={d.socket}" in xml, "no device wiring in the defined domain")
        check("timestamp=off" in xml, "the domain's own qemu:commandline arguments lost")
        t0 = time.monotonic()
        lv.virsh("start", "lvkube")
        row = wait_for(lambda: vm_row(paths, d, "lvkube"), 30, "lvkube in pvgpuctl list")
        check(row["weight"] == 300, f"lvkube arrived with weight {row['weight']}, the annotation says 300")
        s = g.get("lvkube")
        try:
            s.wait_until(lambda x: len(x.reports) >= 3, 150, "three reports of the guest's load")
        except TestFailure:
            g.dump()
            raise
        result("libvirt.kubevirt_hook.start_to_load_s", f"{s.reports[0][0] - t0:.1f}")
        first, last = s.reports[0], s.reports[-1]
        check(last[1] > first[1], f"the guest's kernels did not complete through the device: {first} .. {last}")
        row = vm_row(paths, d, "lvkube")
        check(row["weight"] == 300 and row.get("channels", 0) >= 1, f"lvkube row while loaded: {row}")
        check(d.alive(), "pvgpud died")
    finally:
        lv.cleanup()


def case_identity(paths, tmp):
    """Issue 51.9: the UUID of a libvirt domain is closed to all but its running
    QEMU even when libvirt cannot tell (domain stopped, libvirtd gone); a client
    taken while pvgpud never heard of the domain goes once libvirt names it."""
    lv = Libvirt(os.path.join(tmp, "libvirt"))
    try:
        lv.start()
        vm_uuid = str(uuidlib.uuid4())
        define_only(paths, lv, tmp, "lvid", vm_uuid, 300)
        d = start_daemon(paths, tmp, lv)
        wait_for(lambda: any("libvirt: following domains" in line for line in d.lines), 30,
                 "pvgpud to follow libvirtd")
        # Defined, not running: nobody is its QEMU (main admitted this HELLO,
        # which then took the domain's weight).
        check(hello_as(d, vm_uuid, "lvid") != E_OK, "a HELLO as the stopped domain lvid was accepted")
        wait_for(lambda: any("which is not running" in line for line in d.lines), 5, "a log line: not running")

        # libvirtd gone: the UUID is still one libvirt named, so still closed.
        lv.stop()
        wait_for(lambda: any("libvirt: connection to" in line and " lost " in line for line in d.lines), 30,
                 "pvgpud to notice libvirtd went")
        t0 = time.monotonic()
        check(hello_as(d, vm_uuid, "lvid") != E_OK, "a HELLO as lvid was accepted while libvirtd was gone")
        result("libvirt.identity_unreachable_hello_s", f"{time.monotonic() - t0:.3f}")
        wait_for(lambda: any("libvirt cannot confirm its QEMU" in line for line in d.lines), 5,
                 "a log line: libvirt cannot confirm")

        # pvgpud restarted while libvirtd is gone: it never heard of lvid, so
        # the HELLO passes with a warning (docs/libvirt.md), and the client
        # goes once libvirtd is back and names a domain that does not run.
        d.stop()
        d.start()
        c = RawClient(d.socket, timeout=10)
        c.hello("lvid", role=ROLE_VMM, uuid=uuidlib.UUID(vm_uuid).bytes)
        wait_for(lambda: any("taken without libvirt's word" in line for line in d.lines), 5,
                 "a log line: taken without libvirt's word")
        lv.start()
        check(c.wait_closed(40), "the client taken without libvirt's word stayed once libvirtd named lvid")
        c.close()
        check(d.alive(), "pvgpud died")
    finally:
        lv.cleanup()


class Events:
    """`virsh qemu-monitor-event --loop` on one libvirtd: its domains' QEMU
    events, each at the time QEMU stamped it (the wall clock), taken to the
    host's monotonic clock."""

    def __init__(self, lv):
        self.events = []
        self.proc = subprocess.Popen(["virsh", "-q", "-c", "qemu:///session", "qemu-monitor-event", "--loop"],
                                     env=lv.env, preexec_fn=lv._as_user(), stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        rx = re.compile(r"^event (\w+) at (\d+)\.(\d+) for domain")
        for line in self.proc.stdout:
            m = rx.match(line.strip())
            if m:
                self.events.append((monotonic_from_wall(int(m.group(2)) + int(m.group(3)) / 1e6), m.group(1)))

    def first(self, name):
        return next((t for t, e in self.events if e == name), None)

    def stop(self):
        stop_process(self.proc, timeout=5)


def free_tcp_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def case_migrate(paths, tmp):
    """Issue 52: `virsh migrate --live` between two hosts.  Host A and host B
    are two private libvirtds with distinct host UUIDs, each followed by its
    own pvgpud; pvgpud's socket has one path on both, which on B (its own
    mount namespace) is B's pvgpud.  A guest running a bench of 5000 x 1 ms
    and a throttle, attached at weight 200, migrates mid-run: the bench
    completes exactly 5000 kernels with no resubmission or reconnect, the
    throttle goes on at B, pvgpud A drops the VM, and pvgpud B has it with
    its channels, the guest's task weight, and weight 200 from the
    <pvgpu:gpu> metadata that came with the domain.  Before that, a
    migration to B while B's pvgpud refuses the VM fails and the guest goes
    on at A."""
    run_dir, b_run = os.path.join(tmp, "pvgpu-run"), os.path.join(tmp, "b-run")
    for d in (run_dir, b_run, os.path.join(tmp, "a"), os.path.join(tmp, "b")):
        os.makedirs(d)
    lva = Libvirt(os.path.join(tmp, "libvirt-a"), host_uuid=uuidlib.uuid4())
    lvb = Libvirt(os.path.join(tmp, "libvirt-b"), host_uuid=uuidlib.uuid4(), bind=(b_run, run_dir))
    try:
        lva.start()
        lvb.start()
        da = start_daemon(paths, os.path.join(tmp, "a"), lva, os.path.join(run_dir, "pvgpud.sock"))
        # B's pvgpud first takes no VMM of user nobody: it refuses the VM.
        db = start_daemon(paths, os.path.join(tmp, "b"), lvb, os.path.join(b_run, "pvgpud.sock"), ("root",))
        for d in (da, db):
            wait_for(lambda d=d: any("libvirt: following domains" in line for line in d.lines), 30,
                     "pvgpud to follow its libvirtd")
        command = (guest_throttle("thr", 1000, 60) + " & T=$!; " +
                   tagged("bench", load_cmd("bench", 1000, "--kernels", 5000, "--weight", 200,
                                            "--report-interval-s", "0.02", "--name", "bench")) +
                   "; kill $T; wait")
        g = Guest(paths, lva, tmp, "lvmig", command)
        pvgpuctl(paths, da, lva, "attach", "lvmig", "--weight", "200", "--socket", da.socket)
        lva.virsh("start", "lvmig")
        bench = g.get("bench")
        bench.wait_until(lambda s: len(s.reports) >= 3, 150, "the bench's reports at A")
        g.get("thr").wait_until(lambda s: len(s.reports) >= 1, 30, "the throttle's reports at A")
        check(vm_row(paths, da, "lvmig")["weight"] == 200, "weight 200 at A")
        # A destination whose pvgpud refuses the VM: the migration fails
        # with the device's reason and the guest goes on at A.
        port = free_tcp_port()
        p = lva.virsh("migrate", "--live", "--persistent", "--undefinesource", "lvmig", lvb.uri,
                      f"tcp://127.0.0.1:{port}", timeout=240, check_rc=False)
        check(p.returncode != 0, "the migration to a pvgpud refusing the VM succeeded")
        # libvirt says only that the job failed; the reason is in B's QEMU log.
        check("failed" in p.stderr, f"virsh migrate said: {p.stderr.strip()}")
        wait_for(lambda: "did not accept the VM (HELLO)" in lvb.qemu_log("lvmig"), 10,
                 "the device's reason in B's QEMU log")
        check(lva.virsh("domstate", "lvmig").stdout.strip() == "running", "lvmig not running at A after the refusal")
        check(any("channels resumed" in line for line in da.lines), "pvgpud A did not resume the channels")
        n = bench.reports[-1][1]
        bench.wait_until(lambda s: s.reports[-1][1] > n, 30, "the bench to go on at A after the refusal")
        db.stop()
        write_daemon_config(db, lvb)
        db.start()

        before = bench.reports[-1][1]
        ev_a, ev_b = Events(lva), Events(lvb)
        t0 = time.monotonic()
        lva.virsh("migrate", "--live", "--persistent", "--undefinesource", "lvmig", lvb.uri,
                  f"tcp://127.0.0.1:{port}", timeout=240)
        result("libvirt.migrate.migration_s", f"{time.monotonic() - t0:.2f}")
        g.lv = lvb
        check(before < 5000, f"the bench had finished ({before}) before the migration")
        check(lvb.virsh("domstate", "lvmig").stdout.strip() == "running", "lvmig not running at B")
        check("lvmig" not in lva.virsh("list", "--all", "--name").stdout.split(), "lvmig still defined at A")
        # While the guest runs at B (it ends with the bench): B's restore time,
        # B's view of the VM.
        q = lvb.virsh("qemu-monitor-command", "lvmig", json.dumps(
            {"execute": "qom-get", "arguments": {"path": "/machine/peripheral-anon/device[0]",
                                                 "property": "restore-us"}})).stdout
        result("libvirt.migrate.restore_us", json.loads(q)["return"])
        row = wait_for(lambda: vm_row(paths, db, "lvmig"), 30, "lvmig in pvgpud B's list")
        check(row["weight"] == 200, f"pvgpud B gave lvmig weight {row['weight']}, its metadata says 200")
        ents = {e["path"]: e for e in ctl_json(paths, db, "list")["entities"] if e["path"].startswith("lvmig")}
        tasks = [e for p, e in ents.items() if p.startswith("lvmig/task-")]
        check(ents["lvmig"].get("channels", 0) >= 2 and len(tasks) == 2, f"pvgpud B's view of the VM: {ents}")
        check(any(e.get("guest_weight") == 200 for e in tasks), f"the bench's task weight at B: {tasks}")
        info = lvb.virsh("domjobinfo", "lvmig", "--completed", check_rc=False).stdout
        m = re.search(r"Total downtime:\s+(\d+)\s+ms", info)
        if m:
            result("libvirt.migrate.qemu_downtime_ms", m.group(1))
        check('weight="200"' in lvb.virsh("dumpxml", "lvmig").stdout, "the <pvgpu:gpu> metadata at B")
        wait_for(lambda: vm_row(paths, da, "lvmig") is None, 15, "pvgpud A to drop the VM")
        thr = g.get("thr")
        thr_at_a = thr.reports[-1][1]
        thr.wait_until(lambda s: s.reports[-1][1] > thr_at_a, 60, "the throttle to go on at B")
        v = wait_for(lambda: key_values(g.lines, "bench").get("runtime_ms") and key_values(g.lines, "bench"),
                     240, "the bench to finish at B", step=0.5)
        check(v.get("kernels") == "5000" and v.get("resubmitted") == "0" and v.get("reconnects") == "0",
              f"bench at B: {v}")
        # A's QEMU, the refused destination's (the guest never ran there), B's.
        check(len(g.conn_lines) == 3 and not g.conn_lines[1],
              f"the guest's output came over {[len(c) for c in g.conn_lines]} lines per connection")
        # pvgpu's part of the downtime: A's drain and B's restore.
        quiesced = [line for line in da.lines if "quiesced in" in line]
        check(quiesced, "pvgpud A logged no quiesce")
        result("libvirt.migrate.quiesce_ms", re.search(r"quiesced in ([0-9.]+) ms", quiesced[-1]).group(1))
        # The stop and the resume: QEMU's STOP event at A, RESUME at B.
        for ev in (ev_a, ev_b):
            ev.stop()
        report_pause("libvirt.migrate", guest_pause_ends(g.conn_lines[0], g.conn_lines[2], "bench"),
                     ev_a.first("STOP"), ev_b.first("RESUME"))
        da.check_healthy()
        db.check_healthy()
    finally:
        lvb.cleanup()
        lva.cleanup()


CASES = {"lifecycle": case_lifecycle, "shares": case_shares, "wedge": case_wedge,
         "identity": case_identity, "migrate": case_migrate, "kubevirt-hook": case_kubevirt_hook}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pvgpud", required=True)
    ap.add_argument("--pvgpuctl", required=True)
    ap.add_argument("--vm", required=True, help="tests/vm/pvgpu-vm (writes the guests' initramfs)")
    ap.add_argument("--kubevirt-hook", help="pvgpu-kubevirt-hook (case kubevirt-hook)")
    ap.add_argument("case", choices=sorted(CASES) + ["all"])
    ns = ap.parse_args()
    paths = Paths(ns)
    try:
        paths.check_present()
    except Skip as e:
        print(f"SKIP: {e}")
        return SKIP
    names = sorted(CASES) if ns.case == "all" else [ns.case]
    status = 0
    for name in names:
        tmp = tempfile.mkdtemp(prefix=f"pvgpu-libvirt-{name}-")
        os.chmod(tmp, 0o755)
        start = time.monotonic()
        DAEMONS.clear()
        GUESTS.clear()
        WEDGED.clear()
        try:
            try:
                CASES[name](paths, tmp)
            except TestFailure as e:
                if not WEDGED or name == "wedge":
                    raise
                # Not this project's code: a guest kernel stopped (above:
                # QEMU's view of its vCPU).
                print(f"# case {name}: guest kernel of {', '.join(WEDGED)} stopped under TCG ({e}); "
                      f"its files kept in {tmp}; running it once more", flush=True)
                for g in GUESTS:
                    if g.name in WEDGED:
                        rerun(f"libvirt.{name}", f"guest {g.name}: its kernel stopped (no heartbeat, vCPU halted "
                              f"with interrupts enabled); then: {e}", getattr(g, "evidence", None) or tmp)
                result(f"libvirt.{name}.guest_wedged", 1)
                for daemon in DAEMONS:
                    if daemon.alive():
                        daemon.proc.kill()
                        daemon.proc.wait()
                tmp = tempfile.mkdtemp(prefix=f"pvgpu-libvirt-{name}-")
                os.chmod(tmp, 0o755)
                DAEMONS.clear()
                GUESTS.clear()
                WEDGED.clear()
                CASES[name](paths, tmp)
            print(f"PASS {name} ({time.monotonic() - start:.1f} s)", flush=True)
        except TestFailure as e:
            print(f"FAIL {name}: {e}", flush=True)
            status = 1
        except Exception:
            traceback.print_exc()
            status = 1
        finally:
            for daemon in DAEMONS:
                if status:
                    print("# pvgpud log:")
                    daemon.dump_log()
                if daemon.alive():
                    daemon.proc.kill()
                    daemon.proc.wait()
            if status:
                log(f"files kept in {tmp}")
            else:
                shutil.rmtree(tmp, ignore_errors=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
