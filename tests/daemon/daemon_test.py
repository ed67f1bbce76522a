#!/usr/bin/env python3
"""End-to-end tests of pvgpud with pvgpuctl, pvgpu-load and raw protocol clients.

Every case starts its own pvgpud on private sockets in a temporary directory
and waits for "pvgpud: ready" on its stderr (read from the pipe; no sleeps
as synchronisation).  Measured numbers are printed as "RESULT key=value"
lines so they can go into docs/results.md.

usage: daemon_test.py --pvgpud PATH --pvgpuctl PATH --load PATH [--libtest PATH] CASE
CASE: client | library | fairness | weights | admin | restart | protocol |
      permissions | monitoring | ctl-compat | ctl-gpus | metrics | identity | migrate |
      limits | queue-fds | admin-slots | completion | cheat | all
Exit status: 0 pass, 1 fail, 77 skipped (meson's convention).
"""

import argparse
import contextlib
import fcntl
import json
import mmap
import os
import pwd
import random
import resource
import select
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import termios
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from testlib import Skip, TestFailure, check, log, recv_lines, rerun, result  # noqa: E402

SKIP = 77

# ---- protocol constants (include/pvgpu/protocol.h) ---------------------------
MAGIC = 0x55504750
HDR = struct.Struct("<IHHII")  # magic, type, flags, len, seq
MSG_HELLO, MSG_CHAN_ALLOC, MSG_CHAN_FREE, MSG_MODE_ACK, MSG_TRAP_REPORT, MSG_PING = 1, 2, 3, 4, 5, 6
MSG_HELLO_REPLY, MSG_CHAN_REPLY, MSG_FREE_REPLY, MSG_MODE, MSG_NOTICE, MSG_ERROR, MSG_PONG = (
    64, 65, 66, 67, 68, 69, 70)
ROLE_VMM, ROLE_HOST = 1, 2
E_OK, E_VERSION, E_INVALID, E_STATE, E_LIMIT = 0, 1, 2, 3, 4
PROTO_VERSION = 5  # PVGPU_PROTO_VERSION
PROTO_VERSION_COMPLETION = 3  # PVGPU_PROTO_VERSION_COMPLETION
CTRL_NOTIFY_FENCE = 0x14  # PVGPU_CTRL_NOTIFY_FENCE
PAGE = 4096
RING_ENTRIES = 256
CHAN_MEM_SIZE = PAGE + RING_ENTRIES * 16
ENTRY_IRQ = 1

# Host clients are grouped per user (SO_PEERCRED): host/<user>/<name>.
USER = pwd.getpwuid(os.getuid()).pw_name
HOST = f"host/{USER}"


# ---- processes -----------------------------------------------------------------


DAEMONS = []  # of the running case, for logs on failure


class Daemon:
    """A pvgpud on private sockets; restartable on the same state directory."""

    def __init__(self, bins, workdir, extra_args=()):
        DAEMONS.append(self)
        self.bins = bins
        self.workdir = workdir
        self.socket = os.path.join(workdir, "pvgpud.sock")
        self.admin = os.path.join(workdir, "admin.sock")
        self.state_dir = os.path.join(workdir, "state")
        self.config = os.path.join(workdir, "pvgpud.conf")
        if not os.path.exists(self.config):
            with open(self.config, "w") as f:
                # Built-in defaults, except that a test daemon does not
                # follow the host's libvirt (tests/libvirt does, privately).
                f.write("[libvirt]\nuri = none\n")
        self.extra_args = list(extra_args)
        self.prefix = []  # a command pvgpud runs under (it execs pvgpud)
        self.proc = None
        self.reader = None
        self.lines = []
        self.lines_cv = threading.Condition()
        self.starts = 0

    def start(self, timeout=10.0):
        args = self.prefix + [self.bins.pvgpud, "--socket", self.socket, "--admin-socket", self.admin,
                "--state-dir", self.state_dir, "--config", self.config,
                "--admin-group", ""] + self.extra_args
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True)
        self.starts += 1
        ready = threading.Event()
        lines = self.lines
        lines_cv = self.lines_cv
        proc = self.proc
        start_no = self.starts

        def reader():
            for line in proc.stderr:
                with lines_cv:
                    lines.append(f"[pvgpud#{start_no}] {line.rstrip()}")
                    lines_cv.notify_all()
                if "pvgpud: ready" in line:
                    ready.set()
            ready.set()  # EOF: let the waiter see the exit
            with lines_cv:
                lines_cv.notify_all()

        self.reader = threading.Thread(target=reader, daemon=True)
        self.reader.start()
        if not ready.wait(timeout) or proc.poll() is not None:
            self.dump_log()
            raise TestFailure(f"pvgpud did not become ready within {timeout} s "
                              f"(exit status {proc.poll()})")

    def alive(self):
        return self.proc is not None and self.proc.poll() is None

    def wait_log(self, text, timeout=5.0):
        """True once a line containing text has come from pvgpud's stderr.

        pvgpud writes its log before or after answering the peer, and the
        reader thread copies lines as they arrive: a check right after a
        reply can run before the line is in."""
        with self.lines_cv:
            return self.lines_cv.wait_for(
                lambda: any(text in line for line in self.lines)
                or (self.proc is not None and self.proc.poll() is not None
                    and not (self.reader and self.reader.is_alive())),
                timeout) and any(text in line for line in self.lines)

    def stop(self, sig=signal.SIGTERM, timeout=10.0):
        if not self.proc:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise TestFailure(f"pvgpud did not exit within {timeout} s of signal {sig}")
        return rc

    def check_healthy(self):
        check(self.alive() and not self.internal_errors(), f"pvgpud: {self.internal_errors()}")

    def internal_errors(self):
        """Lines where pvgpud caught an exception of its own: a bug, whatever the case measured."""
        if self.reader and not self.alive():
            self.reader.join(5.0)  # the exit's EOF ends it: all lines are in
        return [line for line in self.lines if "internal error" in line]

    def dump_log(self, last=60):
        for line in self.lines[-last:]:
            print(f"#   {line}")


class Bins:
    def __init__(self, ns):
        self.pvgpud = ns.pvgpud
        self.pvgpuctl = ns.pvgpuctl
        self.load = ns.load
        self.libtest = ns.libtest


def ctl(bins, daemon, *args, check_rc=True, timeout=15, prefix=()):
    cmd = list(prefix) + [bins.pvgpuctl, "--admin-socket", daemon.admin] + list(args)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if check_rc and p.returncode != 0:
        raise TestFailure(f"{' '.join(args)}: exit {p.returncode}: {p.stderr.strip()}")
    return p


def ctl_json(bins, daemon, *args):
    return json.loads(ctl(bins, daemon, "--json", *args).stdout)


class Load:
    """A pvgpu-load process; collects its periodic reports from stderr."""

    def __init__(self, bins, daemon, mode, *args, name, prefix=(), cmd=None):
        """cmd: another program reporting as pvgpu-load does (the cheater)."""
        self.name = name
        if cmd is None:
            cmd = list(prefix) + [bins.load, mode, "--socket", daemon.socket, "--name", name] + [str(a) for a in args]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        self.reports = []  # (CLOCK_MONOTONIC seconds, completed kernels)
        self.stderr_lines = []
        self.cond = threading.Condition()
        self.stderr_thread = threading.Thread(target=self._read_stderr, daemon=True)
        self.stderr_thread.start()

    def _read_stderr(self):
        for line in self.proc.stderr:
            line = line.rstrip()
            with self.cond:
                self.stderr_lines.append(line)
                fields = dict(f.split("=", 1) for f in line.split()[1:] if "=" in f)
                if "completed" in fields and "t" in fields:
                    self.reports.append((float(fields["t"]), int(fields["completed"])))
                self.cond.notify_all()
        with self.cond:
            self.cond.notify_all()

    def wait_until(self, pred, timeout, what):
        deadline = time.monotonic() + timeout
        with self.cond:
            while not pred(self):
                left = deadline - time.monotonic()
                if left <= 0 or (self.proc.poll() is not None and not pred(self)):
                    self.dump()
                    raise TestFailure(f"{self.name}: timed out waiting for {what} "
                                      f"(exit status {self.proc.poll()})")
                self.cond.wait(min(left, 0.5))

    def completed_at(self, t):
        """Completed kernels at CLOCK_MONOTONIC time t, interpolated between reports."""
        with self.cond:
            pts = list(self.reports)
        check(pts and pts[0][0] <= t <= pts[-1][0], f"{self.name}: no reports around t={t}")
        for (t0, c0), (t1, c1) in zip(pts, pts[1:]):
            if t0 <= t <= t1:
                return c0 if t1 == t0 else c0 + (c1 - c0) * (t - t0) / (t1 - t0)
        return pts[-1][1]

    def finish(self, timeout=30.0, sig=None):
        if sig is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
        # Not communicate(): it would read stderr too, racing the reader
        # thread.  stdout is a few summary lines, so waiting first is safe.
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            self.dump()
            raise TestFailure(f"{self.name}: did not finish within {timeout} s")
        out = self.proc.stdout.read()
        self.stderr_thread.join(5)  # every line it wrote is in stderr_lines
        values = {}
        for line in out.splitlines():
            if "=" in line:
                k, v = line.split("=", 1)
                values[k.strip()] = v.strip()
        return self.proc.returncode, values

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def dump(self):
        with self.cond:
            for line in self.stderr_lines[-20:]:
                print(f"#   [{self.name}] {line}")


def measure_shares(loads, kernel_us, t0, t1):
    """GPU time per load in [t0, t1] from its own completed-kernel counts."""
    gpu = []
    for load, k in zip(loads, kernel_us):
        n = load.completed_at(t1) - load.completed_at(t0)
        gpu.append(n * k / 1e6)
    total = sum(gpu)
    check(total > 0, "no kernel completed in the measurement window")
    shares = [g / total for g in gpu]
    return shares, total / (t1 - t0)


def measure_window(loads, kernel_us, warmup, window):
    """Waits for every load to report, skips `warmup` s, measures `window` s."""
    for load in loads:
        load.wait_until(lambda l: len(l.reports) >= 1, 10, "its first report")
    t0 = max(l.reports[0][0] for l in loads) + warmup
    return measure_between(loads, kernel_us, t0, t0 + window, window + warmup + 10)


def measure_between(loads, kernel_us, t0, t1, timeout):
    """Waits until every load has reported past t1, then measures [t0, t1]."""
    for load in loads:
        load.wait_until(lambda l, t1=t1: l.reports and l.reports[-1][0] >= t1, timeout,
                        f"reports past t={t1:.3f}")
    return measure_shares(loads, kernel_us, t0, t1)


def throttle(bins, daemon, name, kernel_us, duration=30, batch=4, depth=2, prefix=()):
    # Batches of 4, two in flight: every throttle keeps 4..8 kernels queued at
    # all times, so both stay backlogged and the split is the scheduler's,
    # not the clients' wake-up latency; one doorbell per batch keeps the
    # clients' CPU use (which competes with the daemon) low.
    return Load(bins, daemon, "throttle", "--kernel-us", kernel_us, "--batch", batch, "--depth", depth,
                "--duration-s", duration, "--report-interval-s", "0.1", name=name, prefix=prefix)


def good_client_throughput(bins, daemon, label, min_fraction=0.7, kernels=200, kernel_us=1000):
    """A well-behaved bench: must finish and get `min_fraction` of the GPU.

    Its 200 ms run read 0.916..0.999 in 84 runs here, and 0.581 once in a
    clean clone's CI run (a 144 ms stall), which passed when run again
    right after: a miss is run again once, never silently."""
    check(daemon.alive(), f"{label}: pvgpud died (exit status {daemon.proc.poll()})")
    for attempt in (1, 2):
        suffix = "" if attempt == 1 else "-rerun"
        bench = Load(bins, daemon, "bench", "--kernel-us", kernel_us, "--kernels", kernels,
                     "--depth", 4, name=f"good-{label}{suffix}")
        rc, values = bench.finish(timeout=30)
        if rc != 0:
            bench.dump()
        check(rc == 0, f"{label}: good client exit status {rc}")
        runtime = float(values["runtime_ms"])
        fraction = kernels * kernel_us / 1000 / runtime
        result(f"protocol.{label}.good_client_gpu_fraction{suffix.replace('-', '.')}", f"{fraction:.3f}")
        if fraction >= min_fraction:
            break
        if attempt == 1:
            rerun(f"protocol {label}", f"good client got {fraction:.3f} of the GPU, below {min_fraction} "
                  f"(load average {os.getloadavg()[0]:.1f})")
    check(fraction >= min_fraction,
          f"{label}: good client got {fraction:.3f} of the GPU, expected >= {min_fraction}")
    check(daemon.alive(), f"{label}: pvgpud died")


# ---- raw protocol client ----------------------------------------------------------


class RawClient:
    def __init__(self, path, timeout=5.0):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.sock.connect(path)
        self.buf = b""
        self.fds = []
        self.closed = False
        self.seq = 0

    def close(self):
        for fd in self.fds:
            os.close(fd)
        self.fds = []
        self.sock.close()

    def send_raw(self, data):
        self.sock.sendall(data)

    def send(self, mtype, payload=b"", seq=None):
        if seq is None:
            self.seq += 1
            seq = self.seq
        self.sock.sendall(HDR.pack(MAGIC, mtype, 0, len(payload), seq) + payload)
        return seq

    def _fill(self, timeout):
        r, _, _ = select.select([self.sock], [], [], timeout)
        if not r:
            return False
        try:
            data, anc, _, _ = self.sock.recvmsg(65536, socket.CMSG_SPACE(4 * 8))
        except (ConnectionResetError, BrokenPipeError):
            data, anc = b"", []
        for level, ctype, cdata in anc:
            if level == socket.SOL_SOCKET and ctype == socket.SCM_RIGHTS:
                n = len(cdata) // 4
                self.fds.extend(struct.unpack(f"<{n}i", cdata[:4 * n]))
        if not data:
            self.closed = True
        self.buf += data
        return True

    def recv(self, timeout=5.0):
        """Next message (type, seq, payload), or None on EOF / timeout."""
        deadline = time.monotonic() + timeout
        while True:
            if len(self.buf) >= HDR.size:
                magic, mtype, _, length, seq = HDR.unpack_from(self.buf)
                check(magic == MAGIC, "daemon sent a bad magic")
                if len(self.buf) >= HDR.size + length:
                    payload = self.buf[HDR.size:HDR.size + length]
                    self.buf = self.buf[HDR.size + length:]
                    return mtype, seq, payload
            if self.closed:
                return None
            left = deadline - time.monotonic()
            if left <= 0 or not self._fill(left):
                return None

    def wait_closed(self, timeout=5.0):
        """True if the daemon closes the connection within `timeout` (messages skipped)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.recv(deadline - time.monotonic()) is None and self.closed:
                return True
        return self.closed

    def hello(self, name, role=ROLE_HOST, uuid=b"\0" * 16, expect_status=E_OK, version=1, gpu=None):
        """gpu: None lets pvgpud place the client; n asks for GPU n (version 4)."""
        payload = struct.pack("<II16s64sII", version, role, uuid, name.encode(), os.getpid(),
                              0 if gpu is None else gpu + 1)
        seq = self.send(MSG_HELLO, payload)
        msg = self.expect(seq)
        check(msg[0] == MSG_HELLO_REPLY, f"HELLO answered with type {msg[0]}")
        status, self.version, client_id, max_channels = struct.unpack("<IIII", msg[2])
        check(status == expect_status, f"HELLO of {name}: status {status}, expected {expect_status}")
        return client_id, max_channels

    def expect(self, seq, timeout=5.0):
        """The reply with `seq`, skipping pushes."""
        deadline = time.monotonic() + timeout
        while True:
            msg = self.recv(max(0.0, deadline - time.monotonic()))
            check(msg is not None, f"no reply to seq {seq}")
            if msg[1] == seq:
                return msg

    def alloc(self, nfds=2):
        seq = self.send(MSG_CHAN_ALLOC, struct.pack("<Q32s", 0, b""))
        msg = self.expect(seq)
        return self.parse_chan_reply(msg, nfds)

    def parse_chan_reply(self, msg, nfds=2):
        if msg[0] == MSG_ERROR:
            status = struct.unpack_from("<I", msg[2])[0]
            return status, None, []
        check(msg[0] == MSG_CHAN_REPLY, f"CHAN_ALLOC answered with type {msg[0]}")
        status, chan_id, _, _ = struct.unpack("<IIII", msg[2])
        fds = []
        if status == E_OK:
            check(len(self.fds) >= nfds, f"CHAN_REPLY OK without {nfds} fds")
            fds, self.fds = self.fds[:nfds], self.fds[nfds:]
        return status, chan_id, fds


class RawChannel:
    """Submits kernels on a channel mapped by a raw client (fences = sequence)."""

    def __init__(self, fds):
        self.memfd, self.doorbell = fds[:2]
        self.mem = mmap.mmap(self.memfd, CHAN_MEM_SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.put = 0

    def fence(self):
        return struct.unpack_from("<I", self.mem, 8)[0]

    def fill(self, kernel_ns, outstanding):
        n = 0
        while self.put - self.fence() < outstanding:
            struct.pack_into("<QII", self.mem, PAGE + (self.put % RING_ENTRIES) * 16,
                             kernel_ns, self.put + 1, ENTRY_IRQ)
            self.put += 1
            n += 1
        if n:
            struct.pack_into("<I", self.mem, 0, self.put)
            os.write(self.doorbell, struct.pack("<Q", 1))

    def run(self, kernel_ns, kernels, timeout=10.0):
        """Submits exactly `kernels` entries (as the ring allows) and waits until they completed."""
        target = self.put + kernels
        deadline = time.monotonic() + timeout
        while self.fence() != target:
            check(time.monotonic() < deadline, f"channel stuck at fence {self.fence()}, want {target}")
            room = min(target - self.put, RING_ENTRIES - (self.put - self.fence()))
            for _ in range(room):
                struct.pack_into("<QII", self.mem, PAGE + (self.put % RING_ENTRIES) * 16,
                                 kernel_ns, self.put + 1, ENTRY_IRQ)
                self.put += 1
            if room > 0:
                struct.pack_into("<I", self.mem, 0, self.put)
                os.write(self.doorbell, struct.pack("<Q", 1))
            time.sleep(0.002)  # polling FENCE, as a client without a notifier does

    def close(self):
        self.mem.close()
        os.close(self.memfd)
        os.close(self.doorbell)


# ---- cases ---------------------------------------------------------------------------


def case_fairness(bins, tmp):
    """(a) 2000 us vs 200 us kernels: 50/50 under hfq, long one > 80% under none."""
    d = Daemon(bins, tmp)
    d.start()
    try:
        check(ctl_json(bins, d, "policy")["policy"] == "hfq", "default policy is not hfq")
        long_k, short_k = 2000, 200
        loads = [throttle(bins, d, "long", long_k), throttle(bins, d, "short", short_k)]
        try:
            # hfq: both backlogged with equal weights -> 50/50.  Tolerance 0.08:
            # real-time jitter on a 2-core machine (daemon, two clients and the
            # test share two cores, so timer wake-ups and the daemon's
            # accounting polls are late by up to a few hundred us, of the order
            # of the short kernel) plus the 2 ms granularity of the long kernel
            # at the window edges; the simulator reaches < 1% without jitter.
            # Not a measured spread: 5 runs on the shared 2-core machine at a
            # load average of 12-13 (other users' work) gave 0.500, 0.500,
            # 0.500, 0.543 and 0.746 (pvgpud's own view 0.758: the short
            # client, starved of CPU, left the GPU to the long one), so under
            # such load the spread exceeds 0.08; it is not widened for that.
            shares, util = measure_window(loads, [long_k, short_k], warmup=1.0, window=4.0)
            result("fairness.hfq.long_share", f"{shares[0]:.3f}")
            result("fairness.hfq.short_share", f"{shares[1]:.3f}")
            result("fairness.hfq.gpu_utilisation", f"{util:.3f}")
            daemon_view = ctl_json(bins, d, "list")
            for e in daemon_view["entities"]:
                result(f"fairness.hfq.daemon_achieved.{e['path']}", e.get("achieved_share"))
            check(abs(shares[0] - 0.5) <= 0.08,
                  f"hfq: long kernels got {shares[0]:.3f}, expected 0.5 +- 0.08")

            # The GPU's own round-robin: one kernel each in turn, so the long
            # one gets about 2000 / 2200 = 0.91.
            ctl(bins, d, "set-policy", "none")
            check(ctl_json(bins, d, "policy")["policy"] == "none", "set-policy none did not stick")
            now = time.monotonic()
            shares_none, util_none = measure_between(loads, [long_k, short_k], now + 0.5, now + 4.0, 15)
            result("fairness.none.long_share", f"{shares_none[0]:.3f}")
            result("fairness.none.short_share", f"{shares_none[1]:.3f}")
            result("fairness.none.gpu_utilisation", f"{util_none:.3f}")
            # The GPU's own round-robin: 2000 / 2200 = 0.91 to the long
            # kernels; 0.8 only tells it from hfq's half.
            check(shares_none[0] > 0.8, f"none: long kernels got {shares_none[0]:.3f}, expected > 0.8")
        finally:
            for load in loads:
                rc, values = load.finish(sig=signal.SIGTERM)
                result(f"fairness.client_cpu_ms.{load.name}", values.get("cpu_ms"))
                check(rc == 0, f"{load.name}: exit status {rc}")
        check(d.alive(), "pvgpud died")
    finally:
        d.stop()


def case_fairness_notrace(bins, tmp):
    """A GPU without a context-switch trace ([gpu] ctxsw_trace = false):
    pvgpud guesses GPU time from interrupts and engine reads, and hfq still
    splits 2000 us against 200 us kernels 50/50 (round-robin and timeslice
    engines), by the clients' own counts."""
    for arbitration in ("round-robin", "timeslice"):
        sub = os.path.join(tmp, arbitration)
        os.makedirs(sub)
        with open(os.path.join(sub, "pvgpud.conf"), "w") as f:
            f.write(f"[libvirt]\nuri = none\n[gpu]\narbitration = {arbitration}\nctxsw_trace = false\n")
        d = Daemon(bins, sub)
        d.start()
        try:
            check(d.wait_log("no context-switch trace"), "pvgpud did not say its GPU keeps no trace")
            long_k, short_k = 2000, 200
            loads = [throttle(bins, d, "long", long_k), throttle(bins, d, "short", short_k)]
            try:
                # The fairness case's tolerance (0.08) and reasoning.
                shares, util = measure_window(loads, [long_k, short_k], warmup=1.0, window=4.0)
                result(f"fairness_notrace.{arbitration}.long_share", f"{shares[0]:.3f}")
                result(f"fairness_notrace.{arbitration}.gpu_utilisation", f"{util:.3f}")
                check(abs(shares[0] - 0.5) <= 0.08,
                      f"{arbitration}, no trace: long kernels got {shares[0]:.3f}, expected 0.5 +- 0.08")
            finally:
                for load in loads:
                    rc, _ = load.finish(sig=signal.SIGTERM)
                    check(rc == 0, f"{load.name}: exit status {rc}")
            d.check_healthy()
        finally:
            d.stop()


def closed_loop_busy_bound(kernels_us, turnaround_us, others):
    """The GPU's busy fraction under a fair schedule, on a non-preemptive GPU,
    of greedy clients that each keep one kernel in flight: during a client's
    turn the GPU idles for its turnaround after each of its kernels, which
    is what fairness costs (another client's kernel in that gap would run
    past the turn).  `others`: the busy fraction of the rest (a client
    that gets its demand).  The clients split the rest of the time equally
    in GPU time."""
    each = (1 - others) / sum(1 + turnaround_us / k for k in kernels_us)
    return others + each * len(kernels_us)


def monitor_bound(demand, long_us, think_us):
    """The most a client of `demand` that thinks `think_us` between kernels
    can get on a non-preemptive GPU beside a closed-loop client of
    `long_us` kernels that gets its max-min share, half of what the monitor
    leaves (the other client takes the rest).  A long kernel started the
    moment the monitor's ends stalls it long_us - think_us; the long client
    runs share / long_us kernels per second, so the monitor gets
    demand * (1 - c * (1 - m)) with c = (long_us - think_us) / (2 long_us):
    m = demand * (1 - c) / (1 - demand * c)."""
    c = (long_us - think_us) / (2 * long_us)
    return demand * (1 - c) / (1 - demand * c)


def case_closed_loop(bins, tmp):
    """(a2) Clients with one kernel in flight: a 6 ms one does not starve a 250 us one.

    A bursty third client (150 us kernels, 850 us of CPU between them) falls
    behind its share, so hfq keeps the two greedy ones blocked and feeds the
    engine from their shadow pages.  Each submits its next kernel only after
    the last one completed, so at every completion only the other has work
    held: fed at once, they alternated kernel for kernel and the 6 ms one got
    0.96 of the two's GPU time, as under none.  hfq now gives the less-ahead
    one its learned turnaround to submit (Feeder::resubmit_wait,
    scheduler/core/policies/hfq/feeder.cpp).
    """
    d = Daemon(bins, tmp)
    d.start()
    try:
        # The clients' turnaround, completion to the next doorbell: the short
        # client alone, one kernel in flight, keeps the GPU busy k / (k + it).
        alone = throttle(bins, d, "alone", 250, batch=1, depth=1, duration=10)
        try:
            _, busy_alone = measure_window([alone], [250], warmup=0.5, window=2.0)
        finally:
            alone.finish(sig=signal.SIGTERM)
        turnaround = 250 * (1 / busy_alone - 1)
        result("closed_loop.turnaround_us", f"{turnaround:.0f}")
        monitor_demand = 150 / (150 + 850 + turnaround)
        bound = closed_loop_busy_bound([6000, 250], turnaround, monitor_demand)
        result("closed_loop.monitor_demand", f"{monitor_demand:.3f}")
        result("closed_loop.hfq.gpu_utilisation_bound", f"{bound:.3f}")
        result("closed_loop.hfq.monitor_bound", f"{monitor_bound(monitor_demand, 6000, 850):.3f}")
        kernels = [6000, 250, 150]
        loads = [throttle(bins, d, "long", 6000, batch=1, depth=1),
                 throttle(bins, d, "short", 250, batch=1, depth=1),
                 Load(bins, d, "throttle", "--kernel-us", 150, "--gap-us", 850, "--duration-s", 30,
                      "--report-interval-s", "0.1", name="monitor")]
        try:
            # Tolerance as in case_fairness (real-time jitter and the 6 ms
            # kernel's granularity at the window edges).  Measured: 0.500
            # in four runs in a row, 0.49..0.57 while a jittery turnaround
            # above half the short client's burst skipped the wait.  In the
            # README's full run, right after the builds and the fuzzers, the
            # first window read 0.591 and 0.690 on one slow day (0.497..0.537
            # alone, the same day): a second window, right after, is
            # measured when the first misses, and one of the two must hit.
            # The starvation this case was written for (0.96, as under
            # none) fails both.  Never silently: the miss is a RERUN line,
            # and the summary counts the test as passed after a rerun.
            start = None
            for attempt in (1, 2):
                if start is None:
                    shares, util = measure_window(loads, kernels, warmup=1.0, window=6.0)
                    start = max(l.reports[-1][0] for l in loads)
                else:
                    shares, util = measure_between(loads, kernels, start, start + 6.0, 16)
                split = shares[0] / (shares[0] + shares[1])
                suffix = "" if attempt == 1 else ".second_window"
                result(f"closed_loop.hfq.long_part{suffix}", f"{split:.3f}")
                result(f"closed_loop.hfq.monitor_share{suffix}", f"{shares[2]:.3f}")
                # Its GPU time per second, to hold against its demand.
                result(f"closed_loop.hfq.monitor_busy{suffix}", f"{shares[2] * util:.3f}")
                result(f"closed_loop.hfq.gpu_utilisation{suffix}", f"{util:.3f}")
                if abs(split - 0.5) <= 0.08:
                    break
                if attempt == 1:
                    rerun("closed-loop", f"hfq window 1: the 6 ms client got {split:.3f} of the two, "
                          f"beyond 0.5 +- 0.08 (load average {os.getloadavg()[0]:.1f})")
            check(abs(split - 0.5) <= 0.08, f"hfq: the 6 ms client got {split:.3f} of the two "
                                            f"(window {attempt}), expected 0.5 +- 0.08")

            ctl(bins, d, "set-policy", "none")
            now = time.monotonic()
            shares_none, util_none = measure_between(loads, kernels, now + 0.5, now + 4.0, 15)
            split_none = shares_none[0] / (shares_none[0] + shares_none[1])
            result("closed_loop.none.long_part", f"{split_none:.3f}")
            result("closed_loop.none.gpu_utilisation", f"{util_none:.3f}")
            # The GPU's own round-robin, kernel for kernel: 6 / 6.25 = 0.96
            # of the two; 0.8 only tells it from hfq's half.
            check(split_none > 0.8, f"none: the 6 ms client got {split_none:.3f} of the two, expected > 0.8")
        finally:
            for load in loads:
                rc, values = load.finish(sig=signal.SIGTERM)
                check(rc == 0, f"{load.name}: exit status {rc}")
        check(d.alive(), "pvgpud died")
    finally:
        d.stop()


def case_weights(bins, tmp):
    """(b) pvgpuctl set-weight changes the split live (3:1)."""
    d = Daemon(bins, tmp)
    d.start()
    try:
        k = 500
        loads = [throttle(bins, d, "w-a", k), throttle(bins, d, "w-b", k)]
        try:
            shares, _ = measure_window(loads, [k, k], warmup=0.5, window=2.0)
            result("weights.1to1.a_share", f"{shares[0]:.3f}")
            check(abs(shares[0] - 0.5) <= 0.08, f"1:1: w-a got {shares[0]:.3f}, expected 0.5 +- 0.08")

            out = ctl(bins, d, "set-weight", f"{HOST}/w-a", "300").stdout
            log(f"set-weight: {out.strip()}")
            now = time.monotonic()
            shares, _ = measure_between(loads, [k, k], now + 0.5, now + 3.5, 15)
            result("weights.3to1.a_share", f"{shares[0]:.3f}")
            result("weights.3to1.b_share", f"{shares[1]:.3f}")
            # Same tolerance and reasoning as the fairness case.  5 runs at a
            # load average of 12-13: 1:1 0.478..0.501, 3:1 0.710..0.750.
            check(abs(shares[0] - 0.75) <= 0.08, f"3:1: w-a got {shares[0]:.3f}, expected 0.75 +- 0.08")
        finally:
            for load in loads:
                load.finish(sig=signal.SIGTERM)
    finally:
        d.stop()


def entities_by_path(listing):
    return {e["path"]: e for e in listing["entities"]}


def check_top_keys(bins, daemon):
    """top on a terminal quits on 'q' and on Ctrl-C (SIGINT), exit status 0."""
    import pty
    for how in ("q", "sigint"):
        master, slave = pty.openpty()
        p = subprocess.Popen([bins.pvgpuctl, "--admin-socket", daemon.admin, "top", "--interval", "0.2"],
                             stdin=slave, stdout=slave, stderr=slave, start_new_session=True)
        os.close(slave)
        seen = b""
        deadline = time.monotonic() + 5
        while b"ENTITY" not in seen:  # the first frame is drawn: keys are read now
            check(time.monotonic() < deadline and p.poll() is None, f"top drew no frame: {seen[-300:]!r}")
            if select.select([master], [], [], 0.1)[0]:
                seen += os.read(master, 4096)
        check(b"\033[2J" in seen, "top on a terminal does not clear the screen")
        if how == "q":
            os.write(master, b"q")
        else:
            p.send_signal(signal.SIGINT)
        try:
            rc = p.wait(5)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            raise TestFailure(f"top did not quit on {how}")
        os.close(master)
        check(rc == 0, f"top quit on {how} with exit status {rc}")


def case_admin(bins, tmp):
    """(c) list --json shows entities and weights; (d) weights persist across a restart."""
    d = Daemon(bins, tmp)
    d.start()
    loads = []
    try:
        loads = [throttle(bins, d, "adm-a", 300, duration=60),
                 throttle(bins, d, "adm-b", 300, duration=60)]
        for load in loads:
            load.wait_until(lambda l: len(l.reports) >= 2, 10, "its first reports")
        ctl(bins, d, "set-weight", f"{HOST}/adm-a", "250")
        ents = entities_by_path(ctl_json(bins, d, "list"))
        log(f"list: {json.dumps(ents)}")
        for path, weight in ((f"{HOST}/adm-a", 250), (f"{HOST}/adm-b", 100)):
            check(path in ents, f"list has no {path}")
            e = ents[path]
            check(e["kind"] == "host", f"{path}: kind {e['kind']}")
            check(e["weight"] == weight, f"{path}: weight {e['weight']}, expected {weight}")
            check(e["channels"] == 1, f"{path}: channels {e['channels']}")
            for field in ("target_share", "achieved_share", "gpu_time_ms"):
                check(isinstance(e.get(field), (int, float)), f"{path}: {field} missing")
        table = ctl(bins, d, "list").stdout
        check("adm-a" in table and "250" in table, f"table output lacks the entity:\n{table}")
        ctl(bins, d, "set-policy", "hfq", "threshold_ms=3")

        # Invalid requests: exit status 1 with the daemon's message, or 2 for usage.
        p = ctl(bins, d, "set-weight", "host/nonexistent", "5", check_rc=False)
        check(p.returncode == 1 and "no such entity" in p.stderr, f"unknown target: {p.returncode} {p.stderr}")
        p = ctl(bins, d, "set-weight", f"{HOST}/adm-a", "10001", check_rc=False)
        check(p.returncode == 2, f"weight 10001: exit status {p.returncode}")
        p = ctl(bins, d, "set-policy", "frobnicate", check_rc=False)
        check(p.returncode == 1 and "unknown policy" in p.stderr, f"bad policy: {p.returncode} {p.stderr}")

        # Restart: the throttles reconnect on their own (libpvgpu), the
        # weight and the policy come back from the state directory.
        rc = d.stop()
        check(rc == 0, f"pvgpud exit status {rc} after SIGTERM")
        d.start()
        deadline = time.monotonic() + 15
        while True:
            ents = entities_by_path(ctl_json(bins, d, "list"))
            if f"{HOST}/adm-a" in ents and f"{HOST}/adm-b" in ents:
                break
            check(time.monotonic() < deadline, f"clients did not reconnect: {sorted(ents)}")
            time.sleep(0.1)  # polling the daemon's view, not synchronisation on a pipe
        for name, weight in (("adm-a", 250), ("adm-b", 100)):
            got = ents[f"{HOST}/{name}"]["weight"]
            check(got == weight, f"{name}: weight after restart {got}, expected {weight}")
        pol = ctl_json(bins, d, "policy")
        check(pol["policy"] == "hfq" and pol["params"].get("threshold_ms") == 3,
              f"policy after restart: {pol}")
        result("admin.weight_after_restart", ents[f"{HOST}/adm-a"]["weight"])
        top = ctl(bins, d, "top", "--count", "2", "--interval", "0.2").stdout
        check(top.count("ENTITY") == 2 and "adm-a" in top, f"top output:\n{top}")
        check_top_keys(bins, d)
        check(ctl(bins, d, "version").stdout.count("pvgpu") == 2, "version output")
        stats = ctl_json(bins, d, "stats")
        result("admin.stats.busy_fraction", stats.get("gpu", {}).get("busy_fraction"))
        # gpu.busy_s is a counter: over a window of two stats, with both
        # throttles backlogged, it grows by about the window and never more.
        time.sleep(0.3)  # a measurement window, not synchronisation
        later = ctl_json(bins, d, "stats")
        window = later["uptime_s"] - stats["uptime_s"]
        busy = later["gpu"]["busy_s"] - stats["gpu"]["busy_s"]
        # (uptime_s and busy_s are read microseconds apart: 1 ms of slack.
        # The floor, half the window, only tells a counter that grows from
        # one that does not: backlogged, the GPU is busy ~0.99 of the time.)
        check(0.5 * window < busy <= window + 1e-3,
              f"gpu.busy_s grew {busy:.4f} s over {window:.4f} s of uptime with two backlogged clients")
        result("admin.stats.busy_over_window", busy / window)
        # scheduler_cpu_s is a counter of pvgpud's own CPU inside the
        # scheduler: it grows while clients run, and by no more than the
        # process's CPU (getrusage: a tick of slack).
        sched = later["scheduler_cpu_s"] - stats["scheduler_cpu_s"]
        proc = later["process_cpu_s"] - stats["process_cpu_s"]
        check(0 < sched <= proc + 0.01,
              f"scheduler_cpu_s grew {sched:.6f} s against process_cpu_s {proc:.6f} s over {window:.3f} s")
        result("admin.stats.scheduler_over_process_cpu", sched / proc if proc > 0 else None)
    finally:
        for load in loads:
            rc, values = load.finish(sig=signal.SIGTERM)
            result(f"admin.{load.name}.reconnects", values.get("reconnects"))
        d.stop()


def run_bench_with_restart(bins, d, sig, label):
    kernels, k = 3000, 500
    bench = Load(bins, d, "bench", "--kernel-us", k, "--kernels", kernels, "--batch", 4, "--depth", 8,
                 "--report-interval-s", "0.05", name=f"restart-{label}")
    bench.wait_until(lambda l: l.reports and l.reports[-1][1] >= 600, 20, "600 completed kernels")
    before = bench.reports[-1][1]
    t_stop = time.monotonic()
    d.stop(sig)
    d.start()
    result(f"restart.{label}.daemon_down_ms", f"{(time.monotonic() - t_stop) * 1000:.1f}")
    rc, values = bench.finish(timeout=60)
    if rc != 0:
        bench.dump()
    check(rc == 0, f"{label}: bench exit status {rc}")
    check("runtime_ms" in values, f"{label}: no runtime printed: {values}")
    runtime = float(values["runtime_ms"])
    done = int(values["kernels"])
    for key in ("runtime_ms", "kernels", "reconnects", "resubmitted"):
        result(f"restart.{label}.{key}", values.get(key))
    result(f"restart.{label}.completed_before_restart", before)
    check(done == kernels, f"{label}: {done} kernels completed, expected {kernels}")
    check(int(values["reconnects"]) >= 1, f"{label}: the bench never reconnected")
    check(int(values["resubmitted"]) >= 1, f"{label}: nothing was outstanding at the restart")
    # Every kernel ran on a GPU: the runtime cannot be shorter than their sum.
    check(runtime >= kernels * k / 1000, f"{label}: runtime {runtime} ms < the work it ran")


def case_restart(bins, tmp):
    """(e) a daemon restart while a bench runs loses no work (SIGTERM, then SIGKILL)."""
    d = Daemon(bins, tmp)
    d.start()
    try:
        run_bench_with_restart(bins, d, signal.SIGTERM, "sigterm")
        # A crash leaves the socket files behind; the new daemon must cope.
        run_bench_with_restart(bins, d, signal.SIGKILL, "sigkill")

        # A daemon that stays away: the client gives up after its reconnect
        # timeout with a clear message (exit status 1), it does not hang.
        load = Load(bins, d, "throttle", "--kernel-us", 500, "--reconnect-timeout-s", "1",
                    "--report-interval-s", "0.05", name="orphan")
        load.wait_until(lambda l: len(l.reports) >= 2, 10, "its first reports")
        d.stop(signal.SIGKILL)
        t0 = time.monotonic()
        rc, _ = load.finish(timeout=10)
        result("restart.gave_up_after_s", f"{time.monotonic() - t0:.2f}")
        check(rc == 1, f"orphaned throttle: exit status {rc}, expected 1")
        check(any("could not reconnect within 1000 ms" in line for line in load.stderr_lines),
              f"no reconnect-timeout message: {load.stderr_lines[-3:]}")
    finally:
        d.stop()


def case_protocol(bins, tmp):
    """(f) malformed and hostile clients; the daemon keeps serving a good client."""
    d = Daemon(bins, tmp)
    d.start()
    rng = random.Random(1)
    try:
        good_client_throughput(bins, d, "baseline")

        c = RawClient(d.socket)
        c.send_raw(bytes(rng.randrange(256) for _ in range(4096)))
        check(c.wait_closed(), "garbage: connection not closed")
        c.close()
        good_client_throughput(bins, d, "garbage")

        c = RawClient(d.socket)
        c.send_raw(HDR.pack(MAGIC, MSG_HELLO, 0, 0xFFFFFFF0, 1))
        check(c.wait_closed(), "huge length: connection not closed")
        c.close()
        good_client_throughput(bins, d, "huge_length")

        c = RawClient(d.socket)
        c.send_raw(HDR.pack(MAGIC, MSG_HELLO, 0, 96, 1)[:10])
        c.close()
        c = RawClient(d.socket)
        c.send_raw(HDR.pack(MAGIC, MSG_HELLO, 0, 96, 1) + b"\0" * 40)
        c.close()
        good_client_throughput(bins, d, "disconnect_mid_message")

        c = RawClient(d.socket)
        seq = c.send(MSG_CHAN_ALLOC, struct.pack("<Q32s", 0, b""))
        msg = c.recv()
        check(msg is not None, "no answer to CHAN_ALLOC before HELLO")
        if msg[0] == MSG_CHAN_REPLY:
            check(struct.unpack_from("<I", msg[2])[0] != E_OK, "CHAN_ALLOC before HELLO succeeded")
        else:
            check(msg[0] == MSG_ERROR, f"CHAN_ALLOC before HELLO answered with type {msg[0]}")
        check(not c.fds, "CHAN_ALLOC before HELLO got fds")
        log(f"no HELLO: answered with type {msg[0]} seq {msg[1]} (request seq {seq})")
        c.close()
        good_client_throughput(bins, d, "hello_missing")

        c = RawClient(d.socket)
        _, max_channels = c.hello("flood")
        seqs = [c.send(MSG_CHAN_ALLOC, struct.pack("<Q32s", 0, b"")) for _ in range(max_channels + 5)]
        statuses = [c.parse_chan_reply(c.expect(s))[0] for s in seqs]
        ok = statuses.count(E_OK)
        result("protocol.flood.max_channels", max_channels)
        result("protocol.flood.granted", ok)
        check(ok == max_channels, f"flood: {ok} channels granted, limit {max_channels}")
        check(all(s == E_LIMIT for s in statuses[max_channels:]), f"flood: statuses {statuses[max_channels:]}")
        good_client_throughput(bins, d, "alloc_flood")
        c.close()

        # Never reads: pings pile up replies the daemon cannot deliver; its
        # per-client queue limit must cut us off, not block or grow.
        c = RawClient(d.socket)
        c.hello("deaf")
        c.sock.setblocking(False)
        ping = HDR.pack(MAGIC, MSG_PING, 0, 0, 0)
        sent = 0
        deadline = time.monotonic() + 5
        cut_off = False
        while time.monotonic() < deadline:
            try:
                sent += c.sock.send(ping * 256)
            except BlockingIOError:
                select.select([], [c.sock], [], 0.05)
            except (BrokenPipeError, ConnectionResetError):
                cut_off = True
                break
        result("protocol.never_reads.bytes_sent", sent)
        result("protocol.never_reads.cut_off", cut_off)
        good_client_throughput(bins, d, "never_reads")
        c.close()

        # Never answers MODE: a VMM (host clients get no MODE pushes) that
        # keeps its ring full but ignores every MODE.  The daemon enforces
        # host-side, so the good client still gets about half.
        c = RawClient(d.socket)
        c.hello("stubborn-vm", role=ROLE_VMM, uuid=bytes(range(1, 17)))
        status, _, fds = c.alloc()
        check(status == E_OK, f"stubborn: alloc status {status}")
        ch = RawChannel(fds)
        stop = threading.Event()
        modes = [0]

        def stubborn():
            while not stop.is_set():
                ch.fill(1_000_000, 32)
                while True:
                    msg = c.recv(0.002)
                    if msg is None:
                        break
                    if msg[0] == MSG_MODE:
                        modes[0] += 1

        th = threading.Thread(target=stubborn, daemon=True)
        th.start()
        try:
            time.sleep(0.3)  # let the stubborn client's backlog build (load, not synchronisation)
            good_client_throughput(bins, d, "never_acks_mode", min_fraction=0.35, kernels=400)
        finally:
            stop.set()
            th.join()
        result("protocol.never_acks_mode.mode_messages", modes[0])
        ch.close()
        c.close()

        stats = ctl_json(bins, d, "stats")
        result("protocol.protocol_errors", stats.get("counters", {}).get("protocol_errors"))
        check(d.alive(), "pvgpud died")
    finally:
        rc = d.stop()
        check(rc == 0, f"pvgpud exit status {rc} after SIGTERM")


def case_permissions(bins, tmp):
    """(g) mutating admin commands are refused for a non-admin peer."""
    if os.geteuid() != 0:
        raise Skip("needs root to run pvgpuctl as another uid")
    setpriv = shutil.which("setpriv")
    if not setpriv:
        raise Skip("setpriv (util-linux) not found")
    prefix = [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups", "--"]
    os.chmod(tmp, 0o755)  # let uid 65534 reach the admin socket (mode 0666 by default)
    probe = subprocess.run(prefix + [bins.pvgpuctl, "--help"], capture_output=True, text=True)
    if probe.returncode != 0:
        raise Skip(f"uid 65534 cannot run {bins.pvgpuctl}: {probe.stderr.strip()}")
    d = Daemon(bins, tmp)
    d.start()
    load = None
    try:
        load = throttle(bins, d, "perm", 300, duration=30)
        load.wait_until(lambda l: len(l.reports) >= 1, 10, "its first report")
        os.chmod(d.admin, 0o666)
        p = ctl(bins, d, "list", check_rc=False, prefix=prefix)
        check(p.returncode == 0, f"read-only list as uid 65534: exit {p.returncode}: {p.stderr}")
        p = ctl(bins, d, "set-weight", f"{HOST}/perm", "5", check_rc=False, prefix=prefix)
        log(f"set-weight as uid 65534: exit {p.returncode}: {p.stderr.strip()}")
        check(p.returncode == 1, f"set-weight as uid 65534: exit {p.returncode}")
        check("permission denied" in p.stderr.lower(), f"no 'permission denied' in: {p.stderr}")
        p = ctl(bins, d, "set-policy", "none", check_rc=False, prefix=prefix)
        check(p.returncode == 1 and "permission denied" in p.stderr.lower(),
              f"set-policy as uid 65534: exit {p.returncode}: {p.stderr}")
        ents = entities_by_path(ctl_json(bins, d, "list"))
        check(ents[f"{HOST}/perm"]["weight"] == 100, "the refused set-weight changed the weight")
        check(ctl_json(bins, d, "policy")["policy"] == "hfq", "the refused set-policy changed the policy")
        ctl(bins, d, "set-weight", f"{HOST}/perm", "5")  # root may
    finally:
        if load:
            load.finish(sig=signal.SIGTERM)
        d.stop()


# ---- a fake daemon, to drive libpvgpu through what pvgpud does not do today -----


class FakeDaemon:
    """Speaks the daemon side of the protocol to one client at a time and
    runs a toy GPU: every doorbell, it executes the entries up to the page's
    IB_PUT in real time (payload ns each) and writes FENCE / IB_GET."""

    def __init__(self, path):
        self.socket = path
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        self.listener.listen(4)
        self.conn = None
        self.buf = b""
        self.channels = {}  # chan_id -> dict(mem, bell, gpu_put, doorbells)
        self.next_chan = 1
        self.acks = []
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.hello_gpus = []        # pvgpu_hello.gpu of every HELLO
        self.hello_version = 1      # what HELLO_REPLY agrees on at most
        self.refuse_hello = None    # (message, with_seq): ERROR, then (seq 0) HELLO_REPLY, and close
        # The channel memory it sends: "sealed" as pvgpud's (F_SEAL_SHRINK |
        # F_SEAL_GROW | F_SEAL_SEAL), "unsealed", "small" (sealed, one page
        # short, the reply claiming the full size) or "pipe" (not a file).
        self.memory = "sealed"

    def accept(self, timeout=10):
        self.listener.settimeout(timeout)
        self.conn, _ = self.listener.accept()
        self.conn.settimeout(0.05)

    def send(self, mtype, payload, seq=0, fds=()):
        data = HDR.pack(MAGIC, mtype, 0, len(payload), seq) + payload
        if fds:
            socket.send_fds(self.conn, [data], list(fds))
        else:
            self.conn.sendall(data)

    def serve_once(self):
        """Handles what the client sent; returns False on EOF."""
        try:
            data = self.conn.recv(65536)
        except socket.timeout:
            return True
        if not data:
            return False
        self.buf += data
        while len(self.buf) >= HDR.size:
            magic, mtype, _, length, seq = HDR.unpack_from(self.buf)
            check(magic == MAGIC and length <= 1024, "libpvgpu sent a bad header")
            if len(self.buf) < HDR.size + length:
                break
            payload = self.buf[HDR.size:HDR.size + length]
            self.buf = self.buf[HDR.size + length:]
            self.handle(mtype, seq, payload)
        return True

    def handle(self, mtype, seq, payload):
        if mtype == MSG_HELLO:
            version, role, _, _, _, gpu = struct.unpack("<II16s64sII", payload)
            check(version == PROTO_VERSION and role == ROLE_HOST, f"HELLO version {version} role {role}")
            self.hello_gpus.append(gpu)
            if self.refuse_hello:
                # As pvgpud refuses a GPU it lacks: the reason in an ERROR,
                # then the HELLO_REPLY; or (with_seq) the ERROR as the reply.
                message, with_seq = self.refuse_hello
                self.send(MSG_ERROR, struct.pack("<II120s", E_INVALID, 0, message.encode()), seq if with_seq else 0)
                if not with_seq:
                    self.send(MSG_HELLO_REPLY, struct.pack("<IIII", E_INVALID, PROTO_VERSION, 7, 4), seq)
                self.conn.shutdown(socket.SHUT_WR)
                return
            # Answered as a version-1 daemon would by default: libpvgpu needs nothing newer.
            self.send(MSG_HELLO_REPLY, struct.pack("<IIII", E_OK, min(version, self.hello_version), 7, 4), seq)
        elif mtype == MSG_CHAN_ALLOC:
            if self.memory == "pipe":
                rd, wr = os.pipe()
                os.close(wr)
                bell = os.eventfd(0, os.EFD_NONBLOCK)
                self.send(MSG_CHAN_REPLY, struct.pack("<IIII", E_OK, self.next_chan, CHAN_MEM_SIZE, 0), seq,
                          fds=(rd, bell))
                os.close(rd)
                self.next_chan += 1
                return
            memfd = os.memfd_create("fake-chan", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
            os.ftruncate(memfd, CHAN_MEM_SIZE - (PAGE if self.memory == "small" else 0))
            if self.memory != "unsealed":
                fcntl.fcntl(memfd, fcntl.F_ADD_SEALS,
                            fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            bell = os.eventfd(0, os.EFD_NONBLOCK)
            mem = mmap.mmap(memfd, os.fstat(memfd).st_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            chan_id = self.next_chan
            self.next_chan += 1
            with self.lock:
                self.channels[chan_id] = {"mem": mem, "bell": bell, "gpu_put": 0, "doorbells": 0}
            self.send(MSG_CHAN_REPLY, struct.pack("<IIII", E_OK, chan_id, CHAN_MEM_SIZE, 0), seq,
                      fds=(memfd, bell))
            os.close(memfd)
        elif mtype == MSG_CHAN_FREE:
            chan_id, _ = struct.unpack("<II", payload)
            self.send(MSG_FREE_REPLY, struct.pack("<II", E_OK, chan_id), seq)
        elif mtype == MSG_MODE_ACK:
            with self.lock:
                self.acks.append(struct.unpack("<IIII", payload))
        else:
            raise TestFailure(f"libpvgpu sent unexpected type {mtype}")

    def run_gpu(self):
        """The toy GPU thread: serves doorbells of every channel."""
        while not self.stop.is_set():
            with self.lock:
                chans = list(self.channels.values())
            bells = [c["bell"] for c in chans]
            ready, _, _ = select.select(bells, [], [], 0.01) if bells else ([], [], [])
            for c in chans:
                if c["bell"] not in ready:
                    continue
                try:
                    os.eventfd_read(c["bell"])
                except BlockingIOError:
                    continue
                c["doorbells"] += 1
                mem = c["mem"]
                put = struct.unpack_from("<I", mem, 0)[0]
                while c["gpu_put"] != put and not self.stop.is_set():
                    slot = PAGE + (c["gpu_put"] % RING_ENTRIES) * 16
                    payload, fence, _ = struct.unpack_from("<QII", mem, slot)
                    struct.pack_into("<I", mem, 4, c["gpu_put"] + 1)  # IB_GET
                    time.sleep(payload / 1e9)
                    struct.pack_into("<I", mem, 8, fence)  # FENCE
                    c["gpu_put"] += 1

    def page_put(self, chan_id):
        return struct.unpack_from("<I", self.channels[chan_id]["mem"], 0)[0]

    def close(self):
        self.stop.set()
        if self.conn:
            self.conn.close()
        self.listener.close()


def case_library(bins, tmp):
    """libpvgpu's API (tests/daemon/libpvgpu_test.cpp, Catch2) against pvgpud, and
    pvgpu-load's transport choice and info."""
    check(bins.libtest, "--libtest not given")
    d = Daemon(bins, tmp)
    d.start()
    try:
        env = dict(os.environ, PVGPU_TEST_SOCKET=d.socket)
        p = subprocess.run([bins.libtest], env=env, capture_output=True, text=True, timeout=60)
        for line in p.stdout.splitlines():
            print(line if line.startswith("RESULT") else f"#   {line}")
        print(p.stderr, end="")
        check(p.returncode == 0, f"libpvgpu tests: exit status {p.returncode}")
        check_load_info(bins, d, tmp)
        check(d.alive(), "pvgpud died")
    finally:
        d.stop()


def check_load_info(bins, d, tmp):
    """pvgpu-load info and the transport choice: the socket by default on a
    host, the device node whenever it exists ($PVGPU_DEVICE), --weight refused
    on the socket."""
    def load(*args, **env_extra):
        env = {k: v for k, v in os.environ.items() if k not in ("PVGPU_DEVICE", "PVGPU_SOCKET", "PVGPU_GPU")}
        env.update(env_extra)
        return subprocess.run([bins.load, *args], env=env, capture_output=True, text=True, timeout=15)

    p = load("info", PVGPU_SOCKET=d.socket, PVGPU_DEVICE=os.path.join(tmp, "no-such-device"))
    check(p.returncode == 0, f"info: exit {p.returncode}: {p.stderr}")
    info = dict(line.split("=", 1) for line in p.stdout.splitlines())
    log(f"pvgpu-load info: {info}")
    check(list(info) == ["transport", "socket", "protocol_version", "client_id", "max_channels", "gpu"],
          f"info keys: {list(info)}")
    check(info["transport"] == "socket" and info["socket"] == d.socket and info["gpu"] == "any", f"info: {info}")
    check(int(info["protocol_version"]) >= 1 and int(info["client_id"]) >= 1 and int(info["max_channels"]) >= 1,
          f"info values: {info}")
    # Every host has a GPU 0.
    p = load("info", "--gpu", "0", PVGPU_SOCKET=d.socket, PVGPU_DEVICE=os.path.join(tmp, "no-such-device"))
    check(p.returncode == 0 and "gpu=0" in p.stdout.splitlines(), f"info --gpu 0: exit {p.returncode}: {p.stderr}")

    # A device node that exists wins over the socket (here a regular file, so
    # the first ioctl fails and says so); --socket forces the socket.
    fake_node = os.path.join(tmp, "not-a-device")
    with open(fake_node, "w"):
        pass
    p = load("info", PVGPU_SOCKET=d.socket, PVGPU_DEVICE=fake_node)
    check(p.returncode == 1 and f"PVGPU_IOC_INFO on {fake_node} failed" in p.stderr,
          f"auto with a device node: exit {p.returncode}: {p.stderr}")
    p = load("info", "--socket", d.socket, PVGPU_DEVICE=fake_node)
    check(p.returncode == 0 and "transport=socket" in p.stdout, f"--socket: exit {p.returncode}: {p.stderr}")

    p = load("bench", "--socket", d.socket, "--kernel-us", "10", "--kernels", "1", "--weight", "50")
    check(p.returncode == 1 and "only inside a VM" in p.stderr and p.stdout == "",
          f"--weight on the socket: exit {p.returncode}: {p.stderr}")
    p = load("info", "--weight", "10001")
    check(p.returncode == 2 and "out of range 1..10000" in p.stderr, f"--weight 10001: exit {p.returncode}")


def check_hello_gpu(bins, tmp):
    """The GPU a host client names in HELLO (pvgpu_hello.gpu): none by default,
    $PVGPU_GPU, `pvgpu-load --gpu` over it, bad values refused before
    connecting, and pvgpud's reason reaching the user when it refuses one."""
    fake = FakeDaemon(os.path.join(tmp, "gpu.sock"))

    def info(*args, serve=True, **env_extra):
        env = {k: v for k, v in os.environ.items() if k not in ("PVGPU_DEVICE", "PVGPU_SOCKET", "PVGPU_GPU")}
        env["PVGPU_DEVICE"] = os.path.join(tmp, "no-such-device")
        env.update(env_extra)
        proc = subprocess.Popen([bins.load, "info", "--socket", fake.socket, *args], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        if serve:
            fake.accept()
            deadline = time.monotonic() + 10
            while fake.serve_once():
                check(time.monotonic() < deadline, "pvgpu-load info did not finish")
            fake.conn.close()
            fake.buf = b""
        out, err = proc.communicate(timeout=15)
        return proc.returncode, dict(line.split("=", 1) for line in out.splitlines()), err.strip()

    try:
        fake.hello_version = PROTO_VERSION
        rc, out, err = info()
        check(rc == 0 and fake.hello_gpus[-1] == 0 and out.get("gpu") == "any",
              f"no GPU named: exit {rc}, HELLO gpu {fake.hello_gpus}, info {out}, {err}")
        rc, out, err = info(PVGPU_GPU="1")
        check(rc == 0 and fake.hello_gpus[-1] == 2 and out.get("gpu") == "1",
              f"PVGPU_GPU=1: exit {rc}, HELLO gpu {fake.hello_gpus[-1]} (want 2), info {out}, {err}")
        rc, out, err = info("--gpu", "3", PVGPU_GPU="1")
        check(rc == 0 and fake.hello_gpus[-1] == 4 and out.get("gpu") == "3",
              f"--gpu 3 over PVGPU_GPU=1: exit {rc}, HELLO gpu {fake.hello_gpus[-1]} (want 4), {err}")
        rc, out, err = info(PVGPU_GPU="")
        check(rc == 0 and fake.hello_gpus[-1] == 0, f"PVGPU_GPU empty: exit {rc}, HELLO gpu {fake.hello_gpus[-1]}")
        n = len(fake.hello_gpus)
        rc, _, err = info(serve=False, PVGPU_GPU="16")
        check(rc == 1 and err == "pvgpu-load: PVGPU_GPU: '16' is not a GPU index (an integer in 0..15)",
              f"PVGPU_GPU=16: exit {rc}, {err!r}")
        rc, _, err = info("--gpu", "16", serve=False)
        check(rc == 2 and "--gpu: 16 is out of range 0..15" in err, f"--gpu 16: exit {rc}, {err!r}")
        check(len(fake.hello_gpus) == n, "a bad GPU index reached the daemon")
        # pvgpud's refusal: its ERROR message is what the user reads, whether
        # the ERROR comes before the HELLO_REPLY (seq 0) or is the reply.
        for with_seq in (False, True):
            fake.refuse_hello = ("no GPU 5 on this host (2 GPUs)", with_seq)
            rc, out, err = info("--gpu", "5")
            check(rc == 1 and fake.hello_gpus[-1] == 6 and not out and
                  "pvgpud refused HELLO: no GPU 5 on this host (2 GPUs)" in err,
                  f"refused GPU 5 (ERROR {'as the reply' if with_seq else 'first'}): exit {rc}, {err!r}")
        # A pvgpud before version 4 cannot place clients: it takes the field
        # for its reserved one (a protocol error), or agrees on an old version.
        fake.refuse_hello = ("protocol error: HELLO: reserved field is not zero", False)
        rc, _, err = info("--gpu", "1")
        check(rc == 1 and "reserved field is not zero; this pvgpud predates protocol version 4" in err,
              f"GPU named to a version-3 pvgpud: exit {rc}, {err!r}")
        fake.refuse_hello = None
        fake.hello_version = 3
        rc, _, err = info(PVGPU_GPU="1")
        check(rc == 1 and "speaks protocol version 3, which cannot place a client on a GPU" in err,
              f"GPU named, version 3 agreed: exit {rc}, {err!r}")
        rc, out, err = info()
        check(rc == 0 and out.get("protocol_version") == "3", f"no GPU, version 3: exit {rc}, {err!r}")
        result("client.hello_gpu_cases", "ok")
    finally:
        fake.close()


def case_client(bins, tmp):
    """libpvgpu against a fake daemon: MODE shadow/unshadow handling and acks,
    a watchdog NOTICE killing a channel; the GPU named in HELLO."""
    if not hasattr(os, "eventfd") or not hasattr(os, "memfd_create"):
        raise Skip("needs Python >= 3.10 (os.eventfd, os.memfd_create)")
    check_hello_gpu(bins, tmp)
    fake = FakeDaemon(os.path.join(tmp, "fake.sock"))
    gpu = threading.Thread(target=fake.run_gpu, daemon=True)
    gpu.start()
    try:
        bench = Load(bins, fake, "bench", "--kernel-us", 1000, "--kernels", 400, "--batch", 4, "--depth", 2,
                     "--report-interval-s", "0.02", name="modes")
        fake.accept()

        def serve_until(pred, timeout, what, eof_ok=False):
            deadline = time.monotonic() + timeout
            while not pred():
                check(time.monotonic() < deadline, f"timed out waiting for {what}")
                if not fake.serve_once():
                    check(eof_ok, f"libpvgpu closed the connection while waiting for {what}")
                    return

        serve_until(lambda: bench.reports and bench.reports[-1][1] >= 40, 10, "40 completions")
        chan = 1
        sent_put = fake.page_put(chan)
        fake.send(MSG_MODE, struct.pack("<IIII", chan, 2, 1, 0))  # SHADOWED, seq 1
        serve_until(lambda: len(fake.acks) >= 1, 5, "the SHADOWED ack")
        ack = fake.acks[0]
        check(ack[:3] == (chan, 2, 1), f"SHADOWED ack {ack}")
        held_put = fake.page_put(chan)
        # The ack carries IB_PUT as of the ack: at or past the page when the
        # MODE was sent, and the page now is at or past it (a shadowed
        # submitter keeps writing, docs/protocol.md).
        check((ack[3] - sent_put) % 2**32 < 2**31 and (held_put - ack[3]) % 2**32 < 2**31,
              f"SHADOWED ack guest_put {ack[3]}, page IB_PUT {sent_put} at the MODE and {held_put} now")
        # What the client published before the MODE arrived but had not rung
        # yet is held work now: pvgpud releases held work itself, and so does
        # the fake (a host-side doorbell; the toy GPU runs up to the page's
        # IB_PUT, which may already be past held_put: the client keeps
        # queueing while shadowed).  The test used to race the client's
        # store and ring both ways.
        os.eventfd_write(fake.channels[chan]["bell"], 1)
        serve_until(lambda: (fake.channels[chan]["gpu_put"] - held_put) % 2**32 < 2**31, 5,
                    "the GPU to run what was rung for")
        bells = fake.channels[chan]["doorbells"]
        # Shadowed for 0.3 s: the client keeps queueing and publishes IB_PUT
        # (pvgpud reads it to see the held backlog) but must not ring; the toy
        # GPU only runs what a doorbell announced.  (One doorbell may still be
        # in flight: the toy GPU can read IB_PUT between a store and its ring.)
        t_end = time.monotonic() + 0.3
        serve_until(lambda: time.monotonic() >= t_end, 2, "the shadowed period")
        check(fake.channels[chan]["doorbells"] <= bells + 1, "the doorbell rang while shadowed")
        held = fake.page_put(chan) - held_put
        check(held > 0, "no work was queued while shadowed (or IB_PUT was not published)")
        result("client.entries_held_while_shadowed", held)
        fake.send(MSG_MODE, struct.pack("<IIII", chan, 1, 2, 0))  # TRAPPED, seq 2
        serve_until(lambda: len(fake.acks) >= 2, 5, "the TRAPPED ack")
        ack = fake.acks[1]
        check(ack[:3] == (chan, 1, 2), f"TRAPPED ack {ack}")
        page_put = fake.page_put(chan)
        check((page_put - ack[3]) % 2**32 < 2**31 and (ack[3] - held_put) % 2**32 - 1 < 2**31 - 1,
              f"unshadow: ack guest_put {ack[3]}, page IB_PUT {page_put}, before {held_put}")
        serve_until(lambda: fake.channels[chan]["doorbells"] > bells + 1 or fake.channels[chan]["gpu_put"] > held_put,
                    5, "the doorbell after unshadowing")
        fake.send(MSG_MODE, struct.pack("<IIII", chan, 0, 3, 0))  # DIRECT, seq 3
        serve_until(lambda: len(fake.acks) >= 3, 5, "the DIRECT ack")
        check(fake.acks[2][:3] == (chan, 0, 3), f"DIRECT ack {fake.acks[2]}")
        serve_until(lambda: bench.proc.poll() is not None, 20, "the bench to finish", eof_ok=True)
        rc, values = bench.finish()
        check(rc == 0 and values.get("kernels") == "400", f"bench after mode switches: exit {rc}, {values}")

        # A watchdog kill: STATUS/ERROR in the page plus NOTICE; the client
        # must fail with a clear message instead of waiting forever.
        fake.conn.close()
        bench = Load(bins, fake, "bench", "--kernel-us", 1000, "--kernels", 100000, "--report-interval-s",
                     "0.02", name="victim")
        fake.accept()
        serve_until(lambda: bench.reports and bench.reports[-1][1] >= 10, 10, "10 completions")
        victim = max(fake.channels)
        fake.stop.set()  # the GPU stops: the channel is dead
        gpu.join()
        mem = fake.channels[victim]["mem"]
        struct.pack_into("<II", mem, 12, 1, 1)  # STATUS error, ERROR watchdog
        fake.send(MSG_NOTICE, struct.pack("<IIQ", 1, victim, 0))
        serve_until(lambda: bench.proc.poll() is not None, 10, "the client to give up", eof_ok=True)
        rc, _ = bench.finish()
        check(rc == 1, f"watchdog: exit status {rc}, expected 1")
        check(any("watchdog" in line for line in bench.stderr_lines), f"no watchdog message: {bench.stderr_lines}")
    finally:
        fake.close()


def case_channel_memory(bins, tmp):
    """libpvgpu checks the channel memory a daemon sends before mapping it
    (issue 51 item 10), as QEMU does: a memfd not sealed against shrinking,
    one smaller than a channel, or no file at all is refused with a clear
    error, never mapped (a store past its end would be SIGBUS); pvgpud's own
    memfd is taken (case library, and "sealed" here)."""
    if not hasattr(os, "eventfd") or not hasattr(os, "memfd_create"):
        raise Skip("needs Python >= 3.10 (os.eventfd, os.memfd_create)")
    expected = {
        "sealed": None,
        "unsealed": "not sealed against shrinking (F_SEAL_SHRINK); channel refused",
        "small": f"sent channel memory of {CHAN_MEM_SIZE - PAGE} bytes, smaller than a channel's {CHAN_MEM_SIZE}",
        "pipe": "sent channel memory that is not a memory file; channel refused",
    }
    for kind, message in expected.items():
        path = os.path.join(tmp, f"fake-{kind}.sock")
        fake = FakeDaemon(path)
        fake.memory = kind
        gpu = threading.Thread(target=fake.run_gpu, daemon=True)
        gpu.start()
        try:
            bench = Load(bins, fake, "bench", "--kernel-us", 100, "--kernels", 20, name=f"memory-{kind}")
            fake.accept()
            deadline = time.monotonic() + 20
            while bench.proc.poll() is None:
                check(time.monotonic() < deadline, f"{kind}: the client neither finished nor gave up")
                if not fake.serve_once():
                    break
            rc, values = bench.finish()
            text = "\n".join(bench.stderr_lines)
            log(f"{kind}: exit {rc}: {text[-300:]}")
            if message is None:
                check(rc == 0 and values.get("kernels") == "20", f"{kind}: exit {rc}, {values}: {text}")
            else:
                # Exit 1 with the reason; not a signal (SIGBUS is -7).
                check(rc == 1, f"{kind}: exit status {rc}, expected 1 (refused): {text}")
                check(message in text, f"{kind}: no '{message}' in: {text}")
        finally:
            fake.close()


# ---- monitoring: pvgpuctl's numbers against the clients' own counts -------------


def fairness_of(achieved, target):
    """Jain's index and unfairness U over achieved/target (DESIGN section 7)."""
    x = [a / t for a, t in zip(achieved, target)]
    jain = sum(x) ** 2 / (len(x) * sum(v * v for v in x))
    return jain, (max(x) / min(x) if min(x) > 0 else float("inf"))


def list_at(bins, daemon):
    """`pvgpuctl list --json` (by path), the CLOCK_MONOTONIC time it
    describes and the length of the window its achieved shares cover."""
    t0 = time.monotonic()
    listing = ctl_json(bins, daemon, "list")
    return (t0 + time.monotonic()) / 2, entities_by_path(listing), listing["window_s"]


# Largest |pvgpuctl - clients| allowed: three times the worst of 8 runs on
# the 2-core machine (5 alone, 3 beside two busy loops), rounded up.  With
# the GPU's context-switch trace pvgpud charges every stint exactly; what is
# left is the clients' side: they report every 0.1 s and are interpolated
# between reports.  Worst measured: GPU time per entity 0.0097 of the
# interval's GPU time (dfq; 9.6 GPU-ms per second; hfq 0.0023, none
# 0.0015), the window's achieved share 0.0169 (dfq), Jain's index 0.0014.
# To measure again: run this case several times and compare its RESULT
# lines client_* against daemon_* per policy.
MONITOR_GPU_TIME_TOL = 0.03
MONITOR_SHARE_TOL = 0.05
MONITOR_JAIN_TOL = 0.005


def case_monitoring(bins, tmp):
    """pvgpuctl list/stats against the clients' own counts under none,
    timeslice, dfq and hfq: GPU time, achieved shares and fairness metrics."""
    d = Daemon(bins, tmp)
    d.start()
    kernel_us = [4000, 200]
    loads = []
    try:
        loads = [throttle(bins, d, "mon-long", kernel_us[0], duration=60),
                 throttle(bins, d, "mon-short", kernel_us[1], duration=60)]
        paths = [f"{HOST}/mon-long", f"{HOST}/mon-short"]
        for load in loads:
            load.wait_until(lambda l: len(l.reports) >= 1, 10, "its first report")
        for policy in ("none", "timeslice", "dfq", "hfq"):
            ctl(bins, d, "set-policy", policy)
            # Let the daemon's window (2 s) fill with this policy only.
            settle_until = time.monotonic() + 2.3
            for load in loads:
                load.wait_until(lambda l, t=settle_until: l.reports and l.reports[-1][0] >= t, 12,
                                "the window to fill")
            ta, before, _ = list_at(bins, d)
            tb_due = ta + 3.0
            for load in loads:
                load.wait_until(lambda l, t=tb_due: l.reports and l.reports[-1][0] >= t, 15, "3 s of reports")
            tb, after, window = list_at(bins, d)
            stats = ctl_json(bins, d, "stats")
            for load in loads:  # reports past tb, to interpolate at tb
                load.wait_until(lambda l, t=tb: l.reports and l.reports[-1][0] >= t + 0.05, 10, "a report past tb")

            # GPU time: the daemon's delta against the clients' kernels x length.
            client_gpu = [(l.completed_at(tb) - l.completed_at(ta)) * k / 1e6 for l, k in zip(loads, kernel_us)]
            daemon_gpu = [(after[p]["gpu_time_ms"] - before[p]["gpu_time_ms"]) / 1e3 for p in paths]
            total = sum(client_gpu)
            check(total > 0, f"{policy}: no kernel completed")
            # Achieved shares (of wall time) over the daemon's window ending at tb.
            shares, util = measure_shares(loads, kernel_us, tb - window, tb)
            client_share = [x * util for x in shares]
            daemon_share = [after[p]["achieved_share"] for p in paths]
            target = [after[p]["target_share"] for p in paths]
            jain, unfair = fairness_of(client_share, [0.5, 0.5])
            for i, p in enumerate(paths):
                name = p.split("/")[1]
                result(f"monitoring.{policy}.{name}.client_gpu_s", f"{client_gpu[i]:.4f}")
                result(f"monitoring.{policy}.{name}.daemon_gpu_s", f"{daemon_gpu[i]:.4f}")
                result(f"monitoring.{policy}.{name}.client_share", f"{client_share[i]:.4f}")
                result(f"monitoring.{policy}.{name}.daemon_share", f"{daemon_share[i]:.4f}")
                result(f"monitoring.{policy}.{name}.kernels_delta",
                       after[p]["kernels"] - before[p]["kernels"])
            m = stats["metrics"]
            result(f"monitoring.{policy}.client_jain", f"{jain:.4f}")
            result(f"monitoring.{policy}.daemon_jain", f"{m['jain_index']:.4f}")
            result(f"monitoring.{policy}.client_unfairness", f"{unfair:.3f}")
            result(f"monitoring.{policy}.daemon_unfairness", f"{m['unfairness']:.3f}")
            result(f"monitoring.{policy}.gpu_utilisation", f"{total / (tb - ta):.3f}")
            for i, p in enumerate(paths):
                err = abs(daemon_gpu[i] - client_gpu[i]) / total
                check(err <= MONITOR_GPU_TIME_TOL,
                      f"{policy}: {p} GPU time {daemon_gpu[i]:.3f} s by pvgpuctl, {client_gpu[i]:.3f} s by "
                      f"its own count (error {err:.3f} of the interval's GPU time > {MONITOR_GPU_TIME_TOL})")
                check(abs(target[i] - 0.5) <= 1e-6, f"{policy}: {p} target {target[i]}, both are backlogged")
                check(abs(daemon_share[i] - client_share[i]) <= MONITOR_SHARE_TOL,
                      f"{policy}: {p} achieved {daemon_share[i]:.3f} by pvgpuctl, "
                      f"{client_share[i]:.3f} by its own count")
                kernels = (l := loads[i]).completed_at(tb) - l.completed_at(ta)
                # The count is the GPU time over the kernel's length, so its
                # bound is the GPU time's (MONITOR_GPU_TIME_TOL) in kernels.
                check(abs(after[p]["kernels"] - before[p]["kernels"] - kernels) * kernel_us[i] / 1e6
                      <= MONITOR_GPU_TIME_TOL * total,
                      f"{policy}: {p} kernels {after[p]['kernels'] - before[p]['kernels']} by pvgpuctl, "
                      f"{kernels:.0f} by its own count")
            check(abs(m["jain_index"] - jain) <= MONITOR_JAIN_TOL,
                  f"{policy}: Jain {m['jain_index']:.4f} by pvgpuctl stats, {jain:.4f} by the clients")
            if policy == "none":
                # The GPU's own round-robin: 4000 / 4200 to the long kernels,
                # x = 1.90 and 0.095 of the targets: U = 20, far above 5.
                check(unfair > 5 and m["unfairness"] > 5,
                      f"none: unfairness {m['unfairness']:.2f} by pvgpuctl, {unfair:.2f} by the clients")
        check(d.alive(), "pvgpud died")
    finally:
        for load in loads:
            load.finish(sig=signal.SIGTERM)
        d.stop()


# ---- a host client forging its control page (issue 12 item 3) ----------------------

CTRL_IB_GET, CTRL_FENCE, CTRL_STATUS = 0x04, 0x08, 0x0C  # PVGPU_CTRL_*
CHAN_STATUS_ERROR = 1
FORGE_PERIOD_S = float(os.environ.get("PVGPU_FORGE_PERIOD_S", "0.0005"))


def cheat_client(socket_path, name, kernel_us, depth):
    """Runs as its own process (daemon_test.py --cheat-client ...): a raw
    host client whose ring is always full of long kernels and whose control
    page always says the GPU fetched nothing (IB_GET 0) and completed
    everything (FENCE at its newest submission), as Workload::forge_progress
    does in the simulator (tests/unit/test_forged_progress.cpp).  A pvgpud
    that took GPU progress from that page would charge it nothing.

    It cannot trust FENCE, which it overwrites itself, yet must know how far
    the GPU got: to stay backlogged and never to have more than the ring's
    PVGPU_RING_ENTRIES outstanding (the GPU fails such a channel).  So, every
    ~0.5 ms: read FENCE; a value other than the one it last forged was stored
    by the GPU at a completion since then (the true FENCE, monotonic and
    never past IB_PUT); top the ring up to `depth` entries past the newest
    true FENCE seen; then forge IB_GET and FENCE again.  A completion stored
    between its read and its forge is lost to it, so its count lags the GPU's
    by at most a kernel or two: it over-estimates what is outstanding, which
    keeps it below the ring's size, and with `depth` (64 x 2 ms = 128 ms of
    work) far above a loop's lag it never runs dry.  The true FENCE it reads
    is what the GPU ran; it reports it like pvgpu-load's reports on stderr
    ("t=... completed=..."), the test's ground truth for its GPU time.
    PVGPU_CHEAT_NO_FORGE=1 makes it an honest twin (for comparisons);
    PVGPU_FORGE_PERIOD_S sets its loop period (default 0.5 ms; forging every
    20 us changed nothing either way)."""
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    c = RawClient(socket_path)
    # Version 2: no completion notifier, which it would not use.
    c.hello(name, version=2)
    status, _, fds = c.alloc()
    check(status == E_OK, f"cheater: CHAN_ALLOC status {status}")
    ch = RawChannel(fds)
    mem = ch.mem
    kernel_ns = kernel_us * 1000
    real = 0  # newest true FENCE seen
    forged = 0  # the FENCE it last stored
    forges = 0
    last_report = 0.0
    while not stop:
        f = struct.unpack_from("<I", mem, CTRL_FENCE)[0]
        if f != forged and 0 < (f - real) % 2**32 < 2**31:
            real = f
        if struct.unpack_from("<I", mem, CTRL_STATUS)[0] == CHAN_STATUS_ERROR:
            err = struct.unpack_from("<I", mem, 0x10)[0]
            print(f"cheat t={time.monotonic():.6f} channel failed: error {err}", file=sys.stderr, flush=True)
            return 3
        added = 0
        while (ch.put - real) % 2**32 < depth:
            struct.pack_into("<QII", mem, PAGE + (ch.put % RING_ENTRIES) * 16, kernel_ns,
                             (ch.put + 1) % 2**32, ENTRY_IRQ)
            ch.put = (ch.put + 1) % 2**32
            added += 1
        if added:
            struct.pack_into("<I", mem, 0, ch.put)
            os.write(ch.doorbell, struct.pack("<Q", 1))
        # The forgery: nothing fetched, everything completed.
        if not os.environ.get("PVGPU_CHEAT_NO_FORGE"):
            struct.pack_into("<II", mem, CTRL_IB_GET, 0, ch.put)
            forged = ch.put
        forges += 1
        now = time.monotonic()
        if now - last_report >= 0.1:
            print(f"cheat t={now:.6f} completed={real} submitted={ch.put}", file=sys.stderr, flush=True)
            last_report = now
        time.sleep(FORGE_PERIOD_S)
    print(f"completed={real}\nsubmitted={ch.put}\nforges={forges}", flush=True)
    ch.close()
    c.close()
    return 0


def cheater(bins, daemon, name, kernel_us, depth=64):
    cmd = [sys.executable, os.path.abspath(__file__), "--cheat-client", daemon.socket, name,
           str(kernel_us), str(depth)]
    return Load(bins, daemon, "cheat", name=name, cmd=cmd)


# GPU time error allowed per client, as a fraction of the interval's GPU
# time, and the cheater's share allowed over 0.5 under the fair policies.
# Measured in 5 runs on the shared 2-core machine: |pvgpuctl - ran| at most
# 0.0004 (hfq), 0.0010 (none), 0.0055 (timeslice), 0.0096 (dfq) of the GPU
# time; cheater share 0.7999..0.8001 (none), 0.495..0.497 (timeslice),
# 0.528..0.532 (dfq), 0.4999..0.5002 (hfq).  The GPU time tolerance is three
# times the worst error; the share's is case_fairness's (real-time jitter).
CHEAT_GPU_TIME_TOL = 0.03
CHEAT_SHARE_TOL = 0.08


def case_cheat(bins, tmp):
    """Issue 12 item 3: a host client that pins IB_GET at 0 and FENCE at its
    newest submission in its control page (2 ms kernels, ring kept full)
    against an honest throttle (500 us kernels, same weight), under none,
    timeslice, dfq and hfq in one daemon.  pvgpud must read progress from the
    GPU: `pvgpuctl list` shows the cheater's GPU time as what the GPU ran for
    it (its true FENCE x 2 ms) and the honest one's as its own count; the fair
    policies hold the cheater to half.  Under none the GPU's round-robin
    gives the long kernels about 2000 / 2500 = 0.8; only the accounting is
    checked there.  Reverting the fix (SimGpu::read_ib_get/read_fence
    returning the control page's values) fails it under hfq: the cheater
    is starved (0 s of GPU) and pvgpuctl shows 0 for it."""
    d = Daemon(bins, tmp)
    d.start()
    kernel_us = [2000, 500]
    loads = []
    try:
        # The honest throttle keeps up to 64 entries queued (batches of 16,
        # four in flight), as many as the cheater: dfq lets a denied leaf in
        # for the rest of a freerun whenever the allowed ones leave the GPU
        # idle, and with the default 4 x 2 throttle the honest client's
        # wake-up gaps gave the long-kernel client 0.68 under dfq, forging
        # or not (0.681 forged, 0.678 with PVGPU_CHEAT_NO_FORGE=1): dfq's
        # work conservation, not the forgery.  8 x 4 gave 0.61, 16 x 4 0.53.
        loads = [cheater(bins, d, "cheater", kernel_us[0]),
                 throttle(bins, d, "honest", kernel_us[1], duration=60, batch=16, depth=4)]
        paths = [f"{HOST}/cheater", f"{HOST}/honest"]
        for load in loads:
            load.wait_until(lambda l: len(l.reports) >= 1, 10, "its first report")
        for policy in ("none", "timeslice", "dfq", "hfq"):
            ctl(bins, d, "set-policy", policy)
            check(ctl_json(bins, d, "policy")["policy"] == policy, f"set-policy {policy} did not stick")
            # Let the daemon's window (2 s) fill with this policy only.
            settle_until = time.monotonic() + 2.3
            for load in loads:
                load.wait_until(lambda l, t=settle_until: l.reports and l.reports[-1][0] >= t, 12,
                                "the window to fill")
            ta, before, _ = list_at(bins, d)
            for load in loads:
                load.wait_until(lambda l, t=ta + 3.0: l.reports and l.reports[-1][0] >= t, 15, "3 s of reports")
            tb, after, _ = list_at(bins, d)
            for load in loads:  # reports past tb, to interpolate at tb
                load.wait_until(lambda l, t=tb: l.reports and l.reports[-1][0] >= t + 0.05, 10, "a report past tb")
            for load in loads:
                check(load.proc.poll() is None, f"{policy}: {load.name} exited ({load.proc.poll()})")
                load_gone = [p for p in paths if p not in after]
                check(not load_gone, f"{policy}: {load_gone} missing from pvgpuctl list")

            span = tb - ta
            real = [(l.completed_at(tb) - l.completed_at(ta)) * k / 1e6 for l, k in zip(loads, kernel_us)]
            daemon_gpu = [(after[p]["gpu_time_ms"] - before[p]["gpu_time_ms"]) / 1e3 for p in paths]
            total = sum(real)
            check(total > 0, f"{policy}: no kernel completed")
            share = real[0] / total
            kernels = [l.completed_at(tb) - l.completed_at(ta) for l in loads]
            result(f"cheat.{policy}.cheater_share", f"{share:.4f}")
            result(f"cheat.{policy}.cheater_daemon_share", f"{daemon_gpu[0] / max(sum(daemon_gpu), 1e-9):.4f}")
            result(f"cheat.{policy}.gpu_utilisation", f"{total / span:.3f}")
            for i, p in enumerate(paths):
                name = p.split("/")[-1]
                result(f"cheat.{policy}.{name}.real_gpu_s", f"{real[i]:.4f}")
                result(f"cheat.{policy}.{name}.daemon_gpu_s", f"{daemon_gpu[i]:.4f}")
                result(f"cheat.{policy}.{name}.gpu_time_error", f"{(daemon_gpu[i] - real[i]) / total:+.4f}")
                result(f"cheat.{policy}.{name}.kernels_delta", after[p]["kernels"] - before[p]["kernels"])
            # The cheater's true count is bounded by what the GPU had left
            # after the honest client (window x busy - honest, busy <= 1).
            check(real[0] <= span - real[1] + CHEAT_GPU_TIME_TOL * span,
                  f"{policy}: the cheater counted {real[0]:.3f} s, more than the {span - real[1]:.3f} s "
                  f"the honest client left of the {span:.3f} s window")
            # 0.1 of the span tells a starved cheater from one that runs
            # (it gets 0.5 or more under every policy, measured above).
            check(real[0] > 0.1 * span, f"{policy}: the cheater ran only {real[0]:.3f} s of {span:.3f} s: "
                                        f"starved (a daemon that believes its forged FENCE sees no backlog)")
            check(daemon_gpu[0] > 0.1 * span, f"{policy}: pvgpuctl list shows the cheater's GPU time as "
                                              f"{daemon_gpu[0]:.3f} s, it ran {real[0]:.3f} s")
            for i, p in enumerate(paths):
                err = abs(daemon_gpu[i] - real[i]) / total
                check(err <= CHEAT_GPU_TIME_TOL,
                      f"{policy}: {p} GPU time {daemon_gpu[i]:.3f} s by pvgpuctl, {real[i]:.3f} s ran "
                      f"(error {err:.3f} of the interval's GPU time > {CHEAT_GPU_TIME_TOL})")
                dk = after[p]["kernels"] - before[p]["kernels"]
                # The count is the GPU time over the kernel's length: the GPU
                # time's bound (CHEAT_GPU_TIME_TOL) in kernels.
                check(abs(dk - kernels[i]) * kernel_us[i] / 1e6 <= CHEAT_GPU_TIME_TOL * total,
                      f"{policy}: {p} kernels {dk} by pvgpuctl, {kernels[i]:.0f} ran")
            if policy != "none":
                check(share <= 0.5 + CHEAT_SHARE_TOL,
                      f"{policy}: the cheater got {share:.3f} of the GPU, expected <= 0.5 + {CHEAT_SHARE_TOL}")
        check(d.alive(), "pvgpud died")
    finally:
        for load in loads:
            rc, values = load.finish(sig=signal.SIGTERM)
            if rc != 0:
                load.dump()
            check(rc == 0, f"{load.name}: exit status {rc}")
        d.stop()


class FakeAdmin:
    """An admin socket answering `version`, `list` and `stats` with canned
    replies, one connection at a time: an older (or newer) pvgpud.  A reply
    may be a function of the request (a dict); every request is kept in
    `bodies`."""

    def __init__(self, path, replies):
        self.path = path
        self.replies = replies
        self.bodies = []
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        self.listener.listen(4)
        self.listener.settimeout(0.1)
        self.stop = threading.Event()
        self.requests = []
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def serve(self):
        while not self.stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except socket.timeout:
                continue
            with conn:
                conn.settimeout(5)
                try:
                    for line in recv_lines(conn, self.stop):
                        req = json.loads(line)
                        cmd = req.get("cmd")
                        self.requests.append(cmd)
                        self.bodies.append(req)
                        reply = self.replies.get(cmd, {"ok": False, "error": f"unknown command: {cmd}"})
                        if callable(reply):
                            reply = reply(req)
                        conn.sendall((json.dumps(reply) + "\n").encode())
                except (socket.timeout, ConnectionError):
                    pass

    def close(self):
        self.stop.set()
        self.thread.join(5)
        self.listener.close()


class FakeAdminDaemon:
    def __init__(self, admin):
        self.admin = admin


def case_ctl_compat(bins, tmp):
    """pvgpuctl list, stats and top against an admin-protocol-1 pvgpud (no
    kernels, accounting false under none) and a newer one with unknown fields."""
    v1_entities = [
        {"path": "host/a", "kind": "host", "weight": 100, "target_share": 0.0, "achieved_share": 0.0,
         "gpu_time_ms": 0.0, "channels": 1},
        {"path": "host/b", "kind": "host", "weight": 100, "target_share": 1.0, "achieved_share": 0.0,
         "gpu_time_ms": 0.0, "channels": 1}]
    v1_stats = {"ok": True, "uptime_s": 5.0, "policy": "none", "clients": 2, "channels": 2,
                "gpu": {"busy_fraction": 1.0, "idle_with_demand_fraction": 0.0},
                "metrics": {"max_share_error": 0, "jain_index": 1, "unfairness": 1,
                            "scheduler_cpu_us_per_s": 0.0},
                "counters": {"traps": 0, "mode_switches": 0, "watchdog_kills": 0, "protocol_errors": 0}}
    v1 = {"version": {"ok": True, "version": "0.1.0", "protocol": 1, "admin_protocol": 1},
          "list": {"ok": True, "policy": "none", "accounting": False, "window_s": 2.0, "entities": v1_entities},
          "stats": v1_stats}
    fake = FakeAdmin(os.path.join(tmp, "admin-v1.sock"), v1)
    d = FakeAdminDaemon(fake.path)
    try:
        out = ctl(bins, d, "list").stdout
        log(f"list from a v1 daemon:\n{out}")
        check("does not measure" in out, f"list: no note that nothing is measured:\n{out}")
        check("KERNELS" not in out, "list: KERNELS column without kernel counts")
        row = [l for l in out.splitlines() if "host/a" in l or l.lstrip().startswith("a ")]
        check(row and "0.0%" in row[0].split()[3] and row[0].split()[4] == "-",
              f"list: ACHIEVED of an unmeasured entity must be '-': {row}")
        out = ctl(bins, d, "stats").stdout
        log(f"stats from a v1 daemon:\n{out}")
        check("metrics.jain_index: n/a" in out and "metrics.unfairness: n/a" in out,
              f"stats: placeholder metrics shown as measurements:\n{out}")
        out = ctl(bins, d, "top", "--count", "2", "--interval", "0.1").stdout
        check(out.count("ENTITY") == 2 and "does not measure" in out and "Jain" not in out,
              f"top against a v1 daemon:\n{out}")
        # --json passes the daemon's reply through untouched, for scripts.
        check(ctl_json(bins, d, "list")["accounting"] is False, "list --json changed the reply")
    finally:
        fake.close()

    # A newer daemon: unknown fields are ignored, kernels are shown.
    v3_entities = [dict(e, kernels=42, achieved_share=0.5, gpu_time_ms=1000.0, future_field={"x": 1})
                   for e in v1_entities]
    v3 = {"version": {"ok": True, "version": "9.9", "protocol": 1, "admin_protocol": 3},
          "list": {"ok": True, "policy": "hfq", "accounting": True, "window_s": 2.0, "entities": v3_entities,
                   "new_top_level": [1, 2]},
          "stats": dict(v1_stats, metrics={"max_share_error": 0.01, "jain_index": 0.99, "unfairness": 1.1},
                        process_cpu_s=1.5, extra={"k": 1})}
    fake = FakeAdmin(os.path.join(tmp, "admin-v3.sock"), v3)
    d = FakeAdminDaemon(fake.path)
    try:
        out = ctl(bins, d, "list").stdout
        check("KERNELS" in out and "42" in out and "does not measure" not in out, f"list from v3:\n{out}")
        fake.requests.clear()
        out = ctl(bins, d, "stats").stdout
        check("metrics.jain_index: 0.99" in out, f"stats from v3:\n{out}")
        check("list" not in fake.requests, "stats of a protocol-3 daemon asked for its list too")
        out = ctl(bins, d, "top", "--count", "2", "--interval", "0.1").stdout
        check(out.count("ENTITY") == 2 and "Jain 0.9900" in out and "KERNELS" in out, f"top from v3:\n{out}")
    finally:
        fake.close()


def gpu_fixture():
    """An admin-protocol-4 pvgpud with two GPUs: vm1 on both (a task on
    gpu0), vm2 on gpu0, vm3 on gpu1."""
    def ent(path, kind, gpu, weight, target, achieved, ms, kernels, **extra):
        return dict({"path": path, "kind": kind, "weight": weight, "target_share": target,
                     "achieved_share": achieved, "gpu_time_ms": ms, "kernels": kernels, "channels": 1,
                     "gpu": gpu}, **extra)
    gpu0 = [ent("vm1", "vm", 0, 200, 0.667, 0.66, 2000.0, 200, uuid="u1"),
            ent("vm1/task-7", "task", 0, 100, 0.667, 0.66, 2000.0, 200, pid_hint=7),
            ent("vm2", "vm", 0, 100, 0.333, 0.34, 1000.0, 100, uuid="u2")]
    gpu1 = [ent("vm1", "vm", 1, 200, 0.5, 0.5, 700.0, 70, uuid="u1"),
            ent("vm3", "vm", 1, 200, 0.5, 0.5, 700.0, 70, uuid="u3")]
    gpus = [{"index": 0, "name": "gpu0", "policy": "hfq", "arbitration": "round-robin", "busy_fraction": 0.998,
             "vms": 2, "entities": gpu0},
            {"index": 1, "name": "gpu1", "policy": "timeslice", "arbitration": "timeslice", "busy_fraction": 0.5,
             "vms": 2, "entities": gpu1}]
    listing = {"ok": True, "policy": "hfq", "accounting": True, "window_s": 2.0, "entities": gpu0 + gpu1,
               "gpus": gpus}
    metrics = {"max_share_error": 0.01, "jain_index": 0.99, "unfairness": 1.1, "scheduler_cpu_us_per_s": 5.0,
               "process_cpu_us_per_s": 50.0}
    stats = {"ok": True, "uptime_s": 5.0, "policy": "hfq", "clients": 3, "channels": 5, "window_s": 2.0,
             "gpu": {"busy_fraction": 0.998, "busy_s": 4.9, "idle_with_demand_fraction": 0.0,
                     "arbitration": "round-robin", "context_switches": 10},
             "metrics": metrics, "process_cpu_s": 1.0, "scheduler_cpu_s": 0.1,
             "counters": {"traps": 0, "mode_switches": 0, "watchdog_kills": 0, "protocol_errors": 0},
             "gpus": [{"index": 0, "name": "gpu0", "policy": "hfq", "arbitration": "round-robin",
                       "busy_fraction": 0.998, "busy_s": 4.9, "idle_with_demand_fraction": 0.0,
                       "context_switches": 10, "channels": 3, "vms": 2, "scheduler_cpu_s": 0.06,
                       "metrics": {"max_share_error": 0.01, "jain_index": 0.99, "unfairness": 1.1,
                                   "scheduler_cpu_us_per_s": 3.0}},
                      {"index": 1, "name": "gpu1", "policy": "timeslice", "arbitration": "timeslice",
                       "busy_fraction": 0.5, "busy_s": 2.5, "idle_with_demand_fraction": 0.125,
                       "context_switches": 20, "channels": 2, "vms": 2, "scheduler_cpu_s": 0.04,
                       "metrics": {"max_share_error": 0.02, "jain_index": 0.97, "unfairness": 1.2,
                                   "scheduler_cpu_us_per_s": 2.0}}]}
    params = {"hfq": {"threshold_ms": 2}, "timeslice": {"slice_ms": 10}}

    def set_policy(req):
        if req.get("policy") not in params:
            return {"ok": False, "error": f"unknown policy '{req.get('policy')}'"}
        changed = [req["gpu"]] if "gpu" in req else [0, 1]
        return {"ok": True, "policy": req["policy"], "params": params[req["policy"]], "gpus": changed}

    def move(req):
        if req.get("target") == "vm9":
            return {"ok": False, "error": "no such VM: vm9"}
        if req.get("gpu") == 7:
            return {"ok": False, "error": "no GPU 7 (this host has 2)"}
        if req.get("target") == "slow":
            time.sleep(11)  # longer than pvgpuctl waits for any other reply
        return {"ok": True, "path": req["target"], "uuid": "u2", "from": req.get("from", 0), "to": req["gpu"],
                "channels": [{"chan_id": 3, "pause_ms": 12.5}, {"chan_id": 4, "pause_ms": 3.24}]}

    return {"version": {"ok": True, "version": "9.9", "protocol": 4, "admin_protocol": 4},
            "list": listing, "stats": stats,
            "get-policy": {"ok": True, "policy": "hfq", "params": params["hfq"],
                           "gpus": [{"index": 0, "name": "gpu0", "policy": "hfq", "params": params["hfq"]},
                                    {"index": 1, "name": "gpu1", "policy": "timeslice",
                                     "params": params["timeslice"]}]},
            "set-policy": set_policy, "move": move}


def sections(out):
    """pvgpuctl's output split at its GPU header lines: {header: lines below}."""
    found, current = {}, None
    for line in out.splitlines():
        if line.startswith("GPU "):
            current = line
            found[current] = []
        elif current is not None:
            found[current].append(line)
    return found


def case_ctl_gpus(bins, tmp):
    """pvgpuctl's per-GPU views against an admin-protocol-4 pvgpud with two
    GPUs (a fake): header lines, --gpu, --json list, stats sections, policy,
    set-policy --gpu, move (output, errors, a slow move); and against one GPU
    and an older pvgpud, only the header line differs."""
    fixture = gpu_fixture()
    fake = FakeAdmin(os.path.join(tmp, "admin-v4.sock"), fixture)
    d = FakeAdminDaemon(fake.path)
    h0 = "GPU 0 gpu0  policy hfq  busy 99.8%  VMs 2"
    h1 = "GPU 1 gpu1  policy timeslice  busy 50.0%  VMs 2"
    try:
        out = ctl(bins, d, "list").stdout
        log(f"list of two GPUs:\n{out}")
        secs = sections(out)
        check(list(secs) == [h0, h1], f"list: GPU header lines {list(secs)}, expected {[h0, h1]}")
        check(out.startswith("policy: per GPU\n"), f"list: the policy line of two policies:\n{out}")
        for header, paths in ((h0, ["vm1", "task-7", "vm2"]), (h1, ["vm1", "vm3"])):
            rows = [l.split()[0] for l in secs[header] if l.strip() and not l.startswith("ENTITY")]
            check(secs[header][0].startswith("ENTITY") and rows == paths,
                  f"list: {header}: rows {rows}, expected {paths}:\n{out}")
        out = ctl(bins, d, "list", "--gpu", "1").stdout
        check(list(sections(out)) == [h1] and "vm2" not in out and out.startswith("policy: timeslice\n"),
              f"list --gpu 1:\n{out}")
        p = ctl(bins, d, "list", "--gpu", "5", check_rc=False)
        check(p.returncode == 2 and "no GPU 5" in p.stderr and "0 (gpu0), 1 (gpu1)" in p.stderr,
              f"list --gpu 5: exit {p.returncode}: {p.stderr}")
        p = ctl(bins, d, "top", "--gpu", "2", "--count", "1", check_rc=False)
        check(p.returncode == 2 and "no GPU 2" in p.stderr, f"top --gpu 2: exit {p.returncode}: {p.stderr}")
        p = ctl(bins, d, "list", "--gpu", "one", check_rc=False)
        check(p.returncode == 2 and "--gpu" in p.stderr, f"list --gpu one: exit {p.returncode}: {p.stderr}")

        # --json list: the daemon's reply, "gpus" kept; --gpu narrows it.
        j = ctl_json(bins, d, "list")
        check([g["index"] for g in j["gpus"]] == [0, 1] and j["gpus"][1]["name"] == "gpu1"
              and len(j["gpus"][0]["entities"]) == 3 and len(j["entities"]) == 5,
              f"--json list: {json.dumps(j)[:500]}")
        j = ctl_json(bins, d, "list", "--gpu", "1")
        check([g["index"] for g in j["gpus"]] == [1] and {e["gpu"] for e in j["entities"]} == {1}
              and len(j["entities"]) == 2, f"--json list --gpu 1: {json.dumps(j)[:500]}")

        # top: a first line for the host, then per GPU its header, fairness, table.
        out = ctl(bins, d, "top", "--count", "2", "--interval", "0.1").stdout
        log(f"top of two GPUs:\n{out}")
        frames = [f for f in out.split("pvgpu top") if f.strip()]
        check(len(frames) == 2, f"top: {len(frames)} frames:\n{out}")
        for frame in frames:
            check("GPUs 2" in frame.splitlines()[0] and "clients 3" in frame.splitlines()[0],
                  f"top: first line {frame.splitlines()[0]!r}")
            secs = sections(frame)
            check(list(secs) == [h0, h1], f"top: GPU headers {list(secs)}")
            check(secs[h1][0].startswith("max share error 2.0%  Jain 0.9700") and secs[h1][1].startswith("ENTITY"),
                  f"top: gpu1's fairness line and table: {secs[h1][:2]}")
        check("NOW" in frames[1], "top: no NOW column in the second frame")
        out = ctl(bins, d, "top", "--gpu", "1", "--count", "2", "--interval", "0.1").stdout
        check(out.count(h1) == 2 and "GPU 0 " not in out and "vm2" not in out and out.count("vm3") == 2,
              f"top --gpu 1:\n{out}")
        j = json.loads(ctl(bins, d, "--json", "top", "--gpu", "1", "--count", "1").stdout)
        check([g["index"] for g in j["list"]["gpus"]] == [1] and [g["index"] for g in j["stats"]["gpus"]] == [1],
              f"--json top --gpu 1: {json.dumps(j)[:300]}")

        # stats: today's lines, then a section per GPU.
        out = ctl(bins, d, "stats").stdout
        log(f"stats of two GPUs:\n{out}")
        check("gpu.busy_fraction: 0.998" in out and "metrics.jain_index: 0.99" in out, f"stats:\n{out}")
        secs = sections(out)
        check(list(secs) == [h0, h1], f"stats: GPU headers {list(secs)}")
        check("  metrics.jain_index: 0.97" in secs[h1] and "  context_switches: 20" in secs[h1]
              and "  arbitration: timeslice" in secs[h1], f"stats: gpu1's section {secs[h1]}")
        out = ctl(bins, d, "stats", "--gpu", "0").stdout
        check(list(sections(out)) == [h0], f"stats --gpu 0:\n{out}")

        # policy per GPU, set-policy --gpu.
        out = ctl(bins, d, "policy").stdout
        check("GPU 1 gpu1  policy timeslice\n  slice_ms = 10" in out and "GPU 0 gpu0  policy hfq" in out,
              f"policy of two GPUs:\n{out}")
        fake.bodies.clear()
        out = ctl(bins, d, "set-policy", "timeslice", "--gpu", "1").stdout
        sent = [b for b in fake.bodies if b["cmd"] == "set-policy"]
        check(len(sent) == 1 and sent[0].get("gpu") == 1, f"set-policy --gpu 1 sent {sent}")
        check("policy: timeslice" in out and "on GPU 1\n" in out, f"set-policy --gpu 1:\n{out}")
        fake.bodies.clear()
        out = ctl(bins, d, "set-policy", "hfq", "threshold_ms=2").stdout
        sent = [b for b in fake.bodies if b["cmd"] == "set-policy"]
        check(len(sent) == 1 and "gpu" not in sent[0], f"set-policy without --gpu sent {sent}")
        check("on GPUs 0, 1" in out, f"set-policy of every GPU:\n{out}")
        p = ctl(bins, d, "set-policy", "hfq", "--gpu", "3", check_rc=False)
        check(p.returncode == 2 and "no GPU 3" in p.stderr, f"set-policy --gpu 3: exit {p.returncode}: {p.stderr}")

        # move: a line per channel and a summary; the daemon's errors.
        fake.bodies.clear()
        out = ctl(bins, d, "move", "vm2", "--gpu", "1").stdout
        check(out == "channel 3: paused 12.5 ms\nchannel 4: paused 3.2 ms\n"
                     "vm2 moved from gpu0 to gpu1 (2 channels, longest pause 12.5 ms)\n", f"move:\n{out}")
        sent = [b for b in fake.bodies if b["cmd"] == "move"]
        check(sent == [{"cmd": "move", "target": "vm2", "gpu": 1}], f"move sent {sent}")
        fake.bodies.clear()
        ctl(bins, d, "move", "vm1", "--gpu", "0", "--from", "1")
        sent = [b for b in fake.bodies if b["cmd"] == "move"]
        check(sent == [{"cmd": "move", "target": "vm1", "gpu": 0, "from": 1}], f"move --from 1 sent {sent}")
        j = ctl_json(bins, d, "move", "vm2", "--gpu", "1")
        check(j["channels"][0]["pause_ms"] == 12.5 and j["to"] == 1, f"--json move: {j}")
        p = ctl(bins, d, "move", "vm9", "--gpu", "1", check_rc=False)
        check(p.returncode == 1 and p.stderr.strip() == "pvgpuctl: no such VM: vm9" and not p.stdout,
              f"move of an unknown VM: exit {p.returncode}: {p.stdout} {p.stderr}")
        p = ctl(bins, d, "move", "vm2", "--gpu", "7", check_rc=False)
        check(p.returncode == 1 and "no GPU 7" in p.stderr, f"move to GPU 7: exit {p.returncode}: {p.stderr}")
        for args, what in ((("move", "vm2"), "--gpu"), (("move", "--gpu", "1"), "missing"),
                           (("move", "vm2", "--gpu", "1", "--from", "1"), "same GPU"),
                           (("list", "--from", "1"), "--from"), (("version", "--gpu", "1"), "--gpu")):
            p = ctl(bins, d, *args, check_rc=False)
            check(p.returncode == 2 and what in p.stderr, f"{' '.join(args)}: exit {p.returncode}: {p.stderr}")
        check("move VM --gpu N" in ctl(bins, d, "--help").stdout, "move is not in pvgpuctl --help")
        check("--from M" in ctl(bins, d, "move", "--help").stdout, "move --help")
        # A move takes as long as the drain: pvgpuctl waits past its usual 10 s.
        t0 = time.monotonic()
        out = ctl(bins, d, "move", "slow", "--gpu", "1", timeout=60).stdout
        check("slow moved from gpu0 to gpu1" in out and time.monotonic() - t0 >= 10, f"slow move:\n{out}")
    finally:
        fake.close()

    # One GPU: the output of an admin-protocol-3 pvgpud with the header line.
    one = gpu_fixture()
    one["list"] = dict(one["list"], gpus=one["list"]["gpus"][:1], entities=one["list"]["gpus"][0]["entities"])
    one["stats"] = dict(one["stats"], gpus=one["stats"]["gpus"][:1])
    one["get-policy"] = dict(one["get-policy"], gpus=one["get-policy"]["gpus"][:1])
    copy = json.loads(json.dumps({"list": one["list"], "stats": one["stats"]}))
    old = {"version": {"ok": True, "version": "0.3", "protocol": 3, "admin_protocol": 3},
           "list": {k: v for k, v in copy["list"].items() if k != "gpus"},
           "stats": {k: v for k, v in copy["stats"].items() if k != "gpus"},
           "get-policy": {"ok": True, "policy": "hfq", "params": {"threshold_ms": 2}},
           "set-policy": lambda req: {"ok": True, "policy": req["policy"], "params": {}}}
    for e in old["list"]["entities"]:
        e.pop("gpu", None)
    outputs = {}
    for name, replies in (("v4", one), ("v3", old)):
        fake = FakeAdmin(os.path.join(tmp, f"admin-one-{name}.sock"), replies)
        d = FakeAdminDaemon(fake.path)
        try:
            outputs[name] = {cmd: ctl(bins, d, cmd).stdout for cmd in ("list", "policy")}
            outputs[name]["top"] = ctl(bins, d, "top", "--count", "1").stdout.split("\n", 1)[1]  # past the clock
            if name == "v3":
                j = ctl_json(bins, d, "list")
                check(j["gpus"][0]["index"] == 0 and j["gpus"][0]["name"] == "gpu0"
                      and j["gpus"][0]["vms"] == 2 and len(j["gpus"][0]["entities"]) == 3
                      and all(e["gpu"] == 0 for e in j["entities"]), f"--json list of a v3 daemon: {j}")
                check(ctl(bins, d, "list", "--gpu", "0").stdout == outputs[name]["list"], "list --gpu 0 of a v3")
                p = ctl(bins, d, "list", "--gpu", "1", check_rc=False)
                check(p.returncode == 2 and "one GPU, 0 (gpu0)" in p.stderr, f"list --gpu 1 of a v3: {p.stderr}")
                p = ctl(bins, d, "move", "vm2", "--gpu", "1", check_rc=False)
                check(p.returncode == 1 and "admin protocol 3" in p.stderr and "unknown command" in p.stderr,
                      f"move on a v3 daemon: exit {p.returncode}: {p.stderr}")
                fake.bodies.clear()
                ctl(bins, d, "set-policy", "hfq", "--gpu", "0")
                sent = [b for b in fake.bodies if b["cmd"] == "set-policy"]
                check(len(sent) == 1 and "gpu" not in sent[0], f"set-policy --gpu 0 to a v3 daemon sent {sent}")
        finally:
            fake.close()
    log(f"list of one GPU:\n{outputs['v4']['list']}")
    for cmd in ("list", "top"):
        v4, v3 = outputs["v4"][cmd].splitlines(), outputs["v3"][cmd].splitlines()
        check(h0 in v4 and h0 in v3, f"{cmd}: no GPU 0 header line:\n{outputs['v4'][cmd]}\n{outputs['v3'][cmd]}")
        check(v4 == v3, f"{cmd}: one GPU of a v4 daemon differs from a v3 daemon:\n{v4}\n{v3}")
        without = [l for l in v4 if l != h0]
        check(len(without) == len(v4) - 1, f"{cmd}: header line not once")
    check(outputs["v4"]["policy"] == outputs["v3"]["policy"] == "policy: hfq\n  threshold_ms = 2\n",
          f"policy of one GPU: {outputs['v4']['policy']!r} {outputs['v3']['policy']!r}")


def case_metrics(bins, tmp):
    """The Prometheus textfile: written at start and every interval, atomically,
    with per-entity counters that follow the load; removed at exit."""
    prom = os.path.join(tmp, "textfile", "pvgpu.prom")
    os.makedirs(os.path.dirname(prom))
    with open(os.path.join(tmp, "pvgpud.conf"), "w") as f:
        f.write(f"[scheduler]\npolicy = none\n[metrics]\ntextfile = {prom}\ninterval_s = 1\n")
    d = Daemon(bins, tmp)
    d.start()
    load = None
    try:
        check(os.path.exists(prom), "no textfile after start")
        load = throttle(bins, d, "prom", 500, duration=30)
        load.wait_until(lambda l: len(l.reports) >= 1, 10, "its first report")

        def sample(text, name, labels):
            for line in text.splitlines():
                if line.startswith(f"{name}{{{labels}}} "):
                    return float(line.rsplit(" ", 1)[1])
            return None

        labels = f'kind="host",vm="",task="{USER}/prom",gpu="0"'
        first = None
        deadline = time.monotonic() + 10
        mtime = os.stat(prom).st_mtime_ns
        values = []
        while len(values) < 2:  # two rewrites with the entity in them
            check(time.monotonic() < deadline, f"textfile not rewritten with the entity: {values}")
            st = os.stat(prom)
            if st.st_mtime_ns != mtime:
                mtime = st.st_mtime_ns
                with open(prom) as f:
                    text = f.read()
                check(text.endswith("\n") and "# TYPE pvgpu_entity_gpu_seconds_total counter" in text,
                      f"half-written or malformed textfile:\n{text[-300:]}")
                v = sample(text, "pvgpu_entity_gpu_seconds_total", labels)
                if v is not None:
                    values.append((v, sample(text, "pvgpu_entity_kernels_total", labels)))
                    first = first or text
            time.sleep(0.05)  # watching a file's mtime: there is nothing to block on
        check(values[1][0] > values[0][0] and values[1][1] > values[0][1],
              f"counters did not grow under load: {values}")
        for name in ("pvgpu_policy_info{policy=\"none\",gpu=\"0\"} 1", "pvgpu_gpu_info{gpu=\"0\",name=\"gpu0\"",
                     "pvgpu_gpu_busy_ratio{gpu=\"0\"}", "pvgpu_jain_index{gpu=\"0\"}", "pvgpu_daemon_cpu_seconds_total",
                     "pvgpu_watchdog_kills_total", "pvgpu_protocol_errors_total", "pvgpu_mode_switches_total",
                     "pvgpu_traps_total", "pvgpu_entity_weight{" + labels + "} 100"):
            check(name in first, f"textfile lacks {name}")
        result("metrics.gpu_seconds_per_s", f"{values[1][0] - values[0][0]:.3f}")
    finally:
        if load:
            load.finish(sig=signal.SIGTERM)
        d.stop()
    check(not os.path.exists(prom), "textfile left behind after pvgpud exited")
    # Nor any of its temporary files (each write has its own name).
    left = os.listdir(os.path.dirname(prom))
    check(not left, f"files left behind in the textfile directory: {left}")


# ---- issue 8: identity, per-uid limits, queued fds, admin slots ------------------

NOBODY = 65534  # the unprivileged peer; tests run as root and switch euid to it
VM_UUID = bytes(range(0x10, 0x20))
VM_UUID_TEXT = "10111213-1415-1617-1819-1a1b1c1d1e1f"


def need_root(tmp):
    if os.geteuid() != 0:
        raise Skip("needs root to play other uids")
    os.chmod(tmp, 0o755)  # let other uids reach the sockets


@contextlib.contextmanager
def as_uid(uid):
    """SO_PEERCRED records the connecting thread's effective ids: connect in here."""
    os.setegid(uid)
    os.seteuid(uid)
    try:
        yield
    finally:
        os.seteuid(0)
        os.setegid(0)


def connect_as(uid, path):
    with as_uid(uid):
        return RawClient(path)


def unprivileged_daemon(bins, tmp, limits=""):
    """A daemon whose client socket any uid may reach (the test is about SO_PEERCRED)."""
    with open(os.path.join(tmp, "pvgpud.conf"), "w") as f:
        f.write("[daemon]\nsocket_mode = 0666\n[limits]\n" + limits)
    d = Daemon(bins, tmp)
    d.start()
    return d


def user_of(uid):
    return pwd.getpwuid(uid).pw_name


def case_long_user(bins, tmp):
    """Issue 51 item 7: a user whose name is 60 characters or more ("host:" +
    name is more than the tree's 64 bytes) is a host client like any other,
    shown whole as host/<name>; and a HELLO that fails leaves nothing behind
    (the half-made user entry used to make every later HELLO fail with
    `internal`).  Debian's useradd refuses such names (LDAP and sssd give
    them), so pvgpud runs in a private mount namespace whose /etc/passwd has
    the user: the host's is not touched."""
    need_root(tmp)
    if not shutil.which("unshare"):
        raise Skip("no unshare")
    name = "pvgpu-long-" + "u" * 50  # 61 characters
    uid = 54321
    check(len(name) == 61, "name length")
    passwd = os.path.join(tmp, "passwd")
    with open("/etc/passwd") as src, open(passwd, "w") as dst:
        dst.write(src.read() + f"{name}:x:{uid}:{uid}::/nonexistent:/usr/sbin/nologin\n")
    os.chmod(passwd, 0o644)
    probe = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                            'mount --bind "$0" /etc/passwd && exec getent passwd "$1"', passwd, str(uid)],
                           capture_output=True, text=True)
    if probe.returncode != 0 or not probe.stdout.startswith(name + ":"):
        raise Skip(f"cannot give pvgpud a private /etc/passwd: {probe.stderr.strip()}")
    conns = []
    with open(os.path.join(tmp, "pvgpud.conf"), "w") as f:
        f.write("[daemon]\nsocket_mode = 0666\n[libvirt]\nuri = none\n")
    d = Daemon(bins, tmp)
    d.prefix = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                'mount --bind "$0" /etc/passwd && exec "$@"', passwd]
    d.start()
    try:
        for i in range(3):
            c = connect_as(uid, d.socket)
            conns.append(c)
            c.hello(f"long{i}")
            check(c.alloc()[0] == E_OK, f"client {i} of {name}: no channel")
        listing = ctl_json(bins, d, "list")
        paths = sorted(e["path"] for e in listing["entities"])
        log(f"entities: {paths}")
        check(f"host/{name}" in paths and f"host/{name}/long0" in paths and f"host/{name}/long2" in paths,
              f"host/{name} and its tasks not listed: {paths}")
        # Its weight by its whole name, through pvgpuctl.
        ctl(bins, d, "set-weight", f"host/{name}", "300")
        listing = ctl_json(bins, d, "list")
        w = [e["weight"] for e in listing["entities"] if e["path"] == f"host/{name}"]
        check(w == [300], f"host/{name} weight {w}")
        # All gone with the clients (pvgpud tears a client down when it
        # sees the close: polled, with a deadline); a new one starts afresh.
        for c in conns:
            c.close()
        conns = []
        deadline = time.monotonic() + 5
        while any(e["path"].startswith(f"host/{name}") for e in ctl_json(bins, d, "list")["entities"]):
            check(time.monotonic() < deadline, "the user's entities outlived its clients")
            time.sleep(0.05)
        c = connect_as(uid, d.socket)
        conns.append(c)
        c.hello("again")
        check(c.alloc()[0] == E_OK, "a later client of the user got no channel")
        check(d.alive(), "pvgpud died")
    finally:
        for c in conns:
            c.close()
        d.stop()


def case_identity(bins, tmp):
    """Issue 8.1: only vmm_users may be a VMM; host tasks are per user and share its weight."""
    need_root(tmp)
    d = unprivileged_daemon(bins, tmp)
    nobody = f"host/{user_of(NOBODY)}"
    loads = []
    try:
        # A VMM HELLO from an unprivileged uid is refused, before and after
        # the real VM set up its weight: nobody can take it over.
        c = connect_as(NOBODY, d.socket)
        c.hello("thief", role=ROLE_VMM, uuid=VM_UUID, expect_status=E_STATE)
        check(c.wait_closed(), "refused VMM: connection not closed")
        c.close()
        vm = RawClient(d.socket)
        vm.hello("vm-real", role=ROLE_VMM, uuid=VM_UUID)
        ctl(bins, d, "set-weight", VM_UUID_TEXT, "300")
        vm.close()
        c = connect_as(NOBODY, d.socket)
        c.hello("vm-real", role=ROLE_VMM, uuid=VM_UUID, expect_status=E_STATE)
        c.close()
        check(d.wait_log("may not act as a VMM"), "no log line for the refused VMM")

        # The same task name under two users: two entities, and a weight set
        # on root's is not nobody's.
        mine = RawClient(d.socket)
        mine.hello("same")
        theirs = connect_as(NOBODY, d.socket)
        theirs.hello("same")
        ctl(bins, d, "set-weight", f"{HOST}/same", "500")
        ents = entities_by_path(ctl_json(bins, d, "list"))
        check(ents.get(f"{HOST}/same", {}).get("weight") == 500, f"root's task: {ents.get(f'{HOST}/same')}")
        check(ents.get(f"{nobody}/same", {}).get("weight") == 100, f"nobody's task: {ents.get(f'{nobody}/same')}")
        check(ents.get(nobody, {}).get("kind") == "user", f"no user entity {nobody}: {sorted(ents)}")
        mine.close()
        theirs.close()

        # One user's connections share that user's weight: root's three
        # throttles and nobody's one split the GPU 1:1 between the users.
        k = 500
        prefix = [shutil.which("setpriv") or "setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}",
                  "--clear-groups", "--"]
        loads = [throttle(bins, d, f"r{i}", k) for i in range(3)]
        loads.append(throttle(bins, d, "n0", k, prefix=prefix))
        shares, _ = measure_window(loads, [k] * 4, warmup=0.5, window=3.0)
        for name, share in zip(("r0", "r1", "r2", "n0"), shares):
            result(f"identity.per_user.{name}_share", f"{share:.3f}")
        # Same tolerance as the fairness case (+-0.08 of the whole GPU).
        check(abs(shares[3] - 0.5) <= 0.08, f"nobody's one task got {shares[3]:.3f}, expected 0.5 +- 0.08")
        check(abs(sum(shares[:3]) - 0.5) <= 0.08, f"root's three tasks got {sum(shares[:3]):.3f}")
        check(d.alive(), "pvgpud died")
    finally:
        for load in loads:
            load.finish(sig=signal.SIGTERM)
        d.stop()


def case_migrate(bins, tmp):
    """A host weight saved as host/NAME (before per-user paths) goes to host/USER/NAME."""
    state_dir = os.path.join(tmp, "state")
    os.makedirs(state_dir)
    with open(os.path.join(state_dir, "state.json"), "w") as f:
        json.dump({"version": 1, "host_tasks": {"host/legacy": 300}}, f)
    d = Daemon(bins, tmp)
    d.start()
    try:
        c = RawClient(d.socket)
        c.hello("legacy")
        ents = entities_by_path(ctl_json(bins, d, "list"))
        check(ents.get(f"{HOST}/legacy", {}).get("weight") == 300, f"legacy weight not applied: {ents}")
        with open(os.path.join(state_dir, "state.json")) as f:
            saved = json.load(f)["host_tasks"]
        check(saved == {f"{HOST}/legacy": 300}, f"state.json host_tasks after migration: {saved}")
        c.close()
        # A restart keeps it under the new key.
        d.stop()
        d.start()
        c = RawClient(d.socket)
        c.hello("legacy")
        ents = entities_by_path(ctl_json(bins, d, "list"))
        check(ents.get(f"{HOST}/legacy", {}).get("weight") == 300, f"after restart: {ents}")
        c.close()
    finally:
        d.stop()


def drain_to(client, n, timeout=5.0):
    """Reads until `n` messages came; returns them (fds stay in client.fds)."""
    got = []
    deadline = time.monotonic() + timeout
    while len(got) < n:
        msg = client.recv(max(0.0, deadline - time.monotonic()))
        check(msg is not None, f"{len(got)} of {n} messages, then nothing")
        got.append(msg)
    return got


def case_limits(bins, tmp):
    """Issue 8.2: per-uid client and channel budgets; host users cannot lock out VMs."""
    need_root(tmp)
    d = unprivileged_daemon(bins, tmp, "host_clients_per_uid = 3\nhost_channels_per_uid = 4\nhost_clients = 5\n"
                                       "host_channels = 6\n")
    conns = []
    try:
        for i in range(3):
            conns.append(connect_as(NOBODY, d.socket))
        # A fourth connection is refused at once, HELLO or not.
        extra = connect_as(NOBODY, d.socket)
        msg = extra.recv()
        check(msg is not None and msg[0] == MSG_ERROR and struct.unpack_from("<I", msg[2])[0] == E_LIMIT,
              f"4th connection of one uid: {msg}")
        check(extra.wait_closed(), "4th connection not closed")
        extra.close()
        for i, c in enumerate(conns):
            c.hello(f"n{i}")
        statuses = [conns[0].alloc()[0] for _ in range(5)]
        result("limits.nobody_channels", statuses.count(E_OK))
        check(statuses == [E_OK] * 4 + [E_LIMIT], f"per-uid channels: {statuses}")
        check(conns[1].alloc()[0] == E_LIMIT, "another connection of the same uid got a 5th channel")

        # Root's host clients: the host total (5) is reached at its 3rd.
        mine = [RawClient(d.socket) for _ in range(3)]
        mine[0].hello("r0")
        mine[1].hello("r1")
        mine[2].hello("r2", expect_status=E_LIMIT)
        check(mine[0].alloc()[0] == E_OK and mine[0].alloc()[0] == E_OK, "root's host channels")
        check(mine[1].alloc()[0] == E_LIMIT, "host channel total (6) not enforced")

        # VMs have their own budget: a VMM connects and gets channels.
        vm = RawClient(d.socket)
        vm.hello("vm1", role=ROLE_VMM, uuid=VM_UUID)
        check(all(vm.alloc()[0] == E_OK for _ in range(4)), "a VMM was refused channels")
        vm.close()
        for c in conns + mine:
            c.close()
        check(d.alive(), "pvgpud died")
    finally:
        d.stop()


def fd_census(pid):
    fds = memfds = 0
    for name in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{name}")
        except FileNotFoundError:
            continue
        fds += 1
        memfds += target.startswith("/memfd:")
    return fds, memfds


def free_channel(client, chan_id):
    seq = client.send(MSG_CHAN_FREE, struct.pack("<II", chan_id, 0))
    msg = client.expect(seq)
    check(msg[0] == MSG_FREE_REPLY and struct.unpack("<II", msg[2]) == (E_OK, chan_id),
          f"CHAN_FREE of {chan_id}: {msg}")


def case_freed_pages(bins, tmp):
    """Issue 51 item 6: a client that keeps a channel's memfd after CHAN_FREE
    must not keep its pages alive: pvgpud writes the control page (and so is
    charged for it), and a client cycling alloc/free while keeping the fds
    grew pvgpud's Shmem by 60 MB in 15,000 cycles.  pvgpud releases the
    memory of a channel it frees (the memfd's st_blocks, the pages the file
    holds, is 0 after FREE_REPLY), so what a client holds stays within its
    per-uid channel budget.  Numbers: the kept memfds' pages after N cycles."""
    d = Daemon(bins, tmp)
    d.start()
    c = RawClient(d.socket)
    kept = []
    try:
        c.hello("keeper", version=PROTO_VERSION)
        status, chan_id, fds = c.alloc(nfds=3)
        check(status == E_OK, f"alloc: {status}")
        ch = RawChannel(fds)
        ch.run(10_000, 20)
        # Pages in use while the channel lives (the test can fail: they exist).
        check(os.fstat(ch.memfd).st_blocks > 0, "a live channel's memfd holds no pages")
        ch.mem.close()
        os.close(ch.doorbell)
        for fd in fds[2:]:
            os.close(fd)
        free_channel(c, chan_id)
        blocks = os.fstat(ch.memfd).st_blocks
        kept.append(ch.memfd)
        check(blocks == 0, f"the freed channel's memfd still holds {blocks * 512} bytes")

        # Cycles keeping every memfd, as the reproducer did (fd limit raised).
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        cycles = 3000
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, cycles + 256)), hard))
        cycles = min(cycles, resource.getrlimit(resource.RLIMIT_NOFILE)[0] - 256)
        for _ in range(cycles):
            status, chan_id, fds = c.alloc(nfds=3)
            check(status == E_OK, f"alloc: {status}")
            for fd in fds[1:]:
                os.close(fd)
            free_channel(c, chan_id)
            kept.append(fds[0])
        held = sum(os.fstat(fd).st_blocks * 512 for fd in kept)
        result("freed_pages.cycles", cycles + 1)
        result("freed_pages.bytes_held_by_kept_memfds", held)
        check(held == 0, f"{cycles + 1} freed channels' memfds still hold {held} bytes")
        check(d.alive(), "pvgpud died")
    finally:
        for fd in kept:
            os.close(fd)
        c.close()
        d.stop()


MSG_TASK_WEIGHT, MSG_TASK_WEIGHT_REPLY = 7, 71


def task_weight(client, hint, weight):
    """TASK_WEIGHT for `hint` (0 forgets it); the reply's status."""
    seq = client.send(MSG_TASK_WEIGHT, struct.pack("<QII", hint, weight, 0))
    msg = client.expect(seq)
    check(msg[0] == MSG_TASK_WEIGHT_REPLY, f"TASK_WEIGHT answered with type {msg[0]}")
    return struct.unpack("<II", msg[2])[0]


def alloc_hinted(client, hint, nfds=2):
    seq = client.send(MSG_CHAN_ALLOC, struct.pack("<Q32s", hint, b"t"))
    return client.parse_chan_reply(client.expect(seq), nfds)


def case_guest_weights(bins, tmp):
    """Issue 51 item 4, the daemon's side: a guest's task weights are bounded
    per VM (4 x max_channels_per_client = 256 by default) but never lock the
    guest out.  A guest driver that never says its processes ended (weight 0)
    used to get E_LIMIT for every new process after 256; now the weight set
    longest ago of a task without channels makes room, and the weights of
    tasks with channels are kept.  Weight 0 (what the driver sends when a
    weighted process exits) forgets at once: a reused pid starts at the
    default.  The guest's own side is vm-weights."""
    d = Daemon(bins, tmp)
    d.start()
    c = RawClient(d.socket)
    chans = []
    try:
        c.hello("weights-vm", role=ROLE_VMM, uuid=VM_UUID, version=PROTO_VERSION)
        # A task with a channel and its weight, set first (the oldest).
        check(task_weight(c, 7, 700) == E_OK, "weight of hint 7")
        status, chan_id, fds = alloc_hinted(c, 7)
        check(status == E_OK, f"alloc for hint 7: {status}")
        chans.append(fds)
        # 10,000 short-lived processes that set a weight and never say they
        # ended (an old guest driver): every one is answered OK.
        n = 10_000
        statuses = {}
        t0 = time.monotonic()
        for pid in range(1000, 1000 + n):
            st = task_weight(c, pid, 50 + pid % 100)
            statuses[st] = statuses.get(st, 0) + 1
        result("guest_weights.never_forgotten_ok", statuses.get(E_OK, 0))
        result("guest_weights.seconds", round(time.monotonic() - t0, 2))
        check(statuses == {E_OK: n}, f"TASK_WEIGHT of {n} processes: statuses {statuses}")
        listing = ctl_json(bins, d, "list")
        tasks = {e["path"].split("/", 1)[1]: e for e in listing["entities"] if e["kind"] == "task"}
        check(tasks.get("task-7", {}).get("weight") == 700 and tasks["task-7"].get("guest_weight") == 700,
              f"the task with a channel lost its weight: {tasks.get('task-7')}")
        # The newest are remembered: a channel for the last pid gets its weight.
        last = 1000 + n - 1
        status, _, fds = alloc_hinted(c, last)
        check(status == E_OK, f"alloc for hint {last}: {status}")
        chans.append(fds)
        listing = ctl_json(bins, d, "list")
        w = [e["weight"] for e in listing["entities"] if e["path"].endswith(f"/task-{last}")]
        check(w == [50 + last % 100], f"task-{last}: weights {w}, expected {50 + last % 100}")

        # What the guest driver does: weight 0 when the process exits; a new
        # process with the same pid starts at the default.
        check(task_weight(c, 4242, 3000) == E_OK, "weight of hint 4242")
        check(task_weight(c, 4242, 0) == E_OK, "forgetting hint 4242")
        status, _, fds = alloc_hinted(c, 4242)
        check(status == E_OK, f"alloc for hint 4242: {status}")
        chans.append(fds)
        listing = ctl_json(bins, d, "list")
        w = [e["weight"] for e in listing["entities"] if e["path"].endswith("/task-4242")]
        check(w == [100], f"reused pid 4242: weights {w}, expected the default 100")
        check(d.alive(), "pvgpud died")
    finally:
        for fds in chans:
            for fd in fds:
                os.close(fd)
        c.close()
        d.stop()


def case_queue_fds(bins, tmp):
    """Issue 8.3: CHAN_ALLOC + CHAN_FREE pipelined without reading replies pins few fds."""
    d = Daemon(bins, tmp)
    d.start()
    try:
        base_fds, base_memfds = fd_census(d.proc.pid)
        c = RawClient(d.socket)
        c.hello("pipeliner")
        status, first, fds = c.alloc()
        check(status == E_OK, f"alloc status {status}")
        for fd in fds:
            os.close(fd)
        c.sock.setblocking(False)
        pairs = 0
        blocked_since = None
        alloc = HDR.pack(MAGIC, MSG_CHAN_ALLOC, 0, 40, 0) + struct.pack("<Q32s", 0, b"")
        while pairs < 1200:
            # Channel ids are sequential: free the one this ALLOC will get.
            free = HDR.pack(MAGIC, MSG_CHAN_FREE, 0, 8, 0) + struct.pack("<II", first + pairs, 0)
            try:
                sent = c.sock.send(alloc + free)
            except BlockingIOError:
                sent = 0
            if sent == len(alloc + free):
                pairs += 1
                blocked_since = None
                continue
            check(sent == 0, "partial send: cannot keep the stream framed (raise the socket buffer)")
            # The daemon stopped reading us: that is the point.
            blocked_since = blocked_since or time.monotonic()
            if time.monotonic() - blocked_since > 1.0:
                break
            select.select([], [c.sock], [], 0.05)
        fds, memfds = fd_census(d.proc.pid)
        # What the daemon wrote that we have not read: its fds are in flight.
        unread = struct.unpack("i", fcntl.ioctl(c.sock.fileno(), termios.FIONREAD, b"\0" * 4))[0]
        c.sock.setblocking(True)
        before = len(c.fds)
        while unread > 0:
            data, anc, _, _ = c.sock.recvmsg(unread, socket.CMSG_SPACE(4 * 8))
            for level, ctype, cdata in anc:
                if level == socket.SOL_SOCKET and ctype == socket.SCM_RIGHTS:
                    c.fds.extend(struct.unpack(f"<{len(cdata) // 4}i", cdata[:len(cdata) // 4 * 4]))
            c.buf += data
            unread -= len(data)
        in_flight = len(c.fds) - before
        result("queue_fds.pairs_sent_before_blocking", pairs)
        result("queue_fds.daemon_extra_fds", fds - base_fds)
        result("queue_fds.daemon_extra_memfds", memfds - base_memfds)
        result("queue_fds.in_flight_fds", in_flight)
        # Held by the daemon: the listening and client sockets, at most
        # max_queue_fds (8) queued plus one reply's 2, and the channels the
        # flood left open (none: every one was freed).
        check(fds - base_fds <= 16, f"pvgpud holds {fds - base_fds} more fds than at start")
        check(memfds - base_memfds <= 6, f"pvgpud holds {memfds - base_memfds} more memfds than at start")
        # The 16 KiB send buffer (doubled by the kernel) holds ~30 messages.
        check(in_flight <= 96, f"{in_flight} fds in flight to one client")
        # Everything asked for is answered once we read.
        c.sock.settimeout(5)
        replies = drain_to(c, 2 * pairs, timeout=20)
        allocs = [m for m in replies if m[0] == MSG_CHAN_REPLY]
        frees = [m for m in replies if m[0] == MSG_FREE_REPLY]
        check(len(allocs) == pairs and len(frees) == pairs, f"{len(allocs)} CHAN_REPLY, {len(frees)} FREE_REPLY "
                                                            f"for {pairs} pairs")
        check(all(struct.unpack_from("<I", m[2])[0] == E_OK for m in frees), "a pipelined CHAN_FREE failed")
        seq = c.send(MSG_PING)
        check(c.expect(seq)[0] == MSG_PONG, "no PONG after the flood")
        c.close()
        check(d.alive(), "pvgpud died")
    finally:
        d.stop()


def admin_connect(path):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(path)
    return s


def refused_line(sock):
    """The error line of a refused admin connection, or None if it stays open."""
    r, _, _ = select.select([sock], [], [], 0.5)
    if not r:
        return None
    data = sock.recv(4096)
    return json.loads(data.decode().splitlines()[0]) if data else None


def case_admin_slots(bins, tmp):
    """Issue 8.4: per-uid admin connections, a slot kept for root, one response queued at a time."""
    need_root(tmp)
    with open(os.path.join(tmp, "pvgpud.conf"), "w") as f:
        f.write("[limits]\nadmin_max_clients = 4\nadmin_max_clients_per_uid = 2\nadmin_reserved_clients = 1\n"
                "admin_requests_per_s = 1000000\n")
    d = Daemon(bins, tmp)
    d.start()
    held = []
    try:
        for uid in (NOBODY, NOBODY):
            with as_uid(uid):
                held.append(admin_connect(d.admin))
        with as_uid(NOBODY):
            third = admin_connect(d.admin)
        line = refused_line(third)
        check(line and "from uid" in line.get("error", ""), f"3rd connection of one uid: {line}")
        third.close()
        for uid in (1, 2):  # daemon, bin: two more unprivileged users fill the cap (4)
            with as_uid(uid):
                held.append(admin_connect(d.admin))
        with as_uid(3):
            fifth = admin_connect(d.admin)
        line = refused_line(fifth)
        check(line and "too many admin connections" in line.get("error", ""), f"5th connection: {line}")
        fifth.close()
        for s in held:
            check(refused_line(s) is None, "a held connection was closed")
        # Root still gets in (the reserved slot) and may change weights.
        p = ctl(bins, d, "stats")
        check("uptime" in p.stdout, f"root's stats: {p.stdout}")
        for s in held:
            s.close()

        # 64 KiB of requests, never reading a response: pvgpud answers only
        # while the socket takes the answers, then stops reading us.
        flood = admin_connect(d.admin)
        req = b'{"cmd":"stats"}\n'
        flood.sendall(req * (65536 // len(req)))
        # Barrier: requests on another connection, each a loop iteration.
        for _ in range(8):
            ctl(bins, d, "version")
        unread_by_daemon = struct.unpack("i", fcntl.ioctl(flood.fileno(), termios.TIOCOUTQ, b"\0" * 4))[0]
        with open(f"/proc/{d.proc.pid}/status") as f:
            rss_kib = int(next(l for l in f if l.startswith("VmRSS:")).split()[1])
        result("admin_slots.flood_bytes_unread_by_pvgpud", unread_by_daemon)
        result("admin_slots.pvgpud_rss_kib", rss_kib)
        # One read is 16 KiB: the rest waits in the socket, not in pvgpud.
        check(unread_by_daemon >= 65536 - 2 * 16384,
              f"pvgpud read {65536 - unread_by_daemon} bytes of requests it could not answer")
        # Reading, every request gets its response.
        flood.settimeout(10)
        answered = 0
        buf = b""
        while answered < 65536 // len(req):
            data = flood.recv(1 << 20)
            check(data, f"admin flood: EOF after {answered} responses")
            buf += data
            answered += data.count(b"\n")
        flood.close()
        result("admin_slots.flood_responses", answered)
        check(d.alive(), "pvgpud died")
    finally:
        for s in held:
            s.close()
        d.stop()



# ---- read-only admin flood (issue 51 item 1) -------------------------------------

FLOOD_UIDS = range(40001, 40009)  # 8 uids without passwd entries: SO_PEERCRED is all pvgpud sees
FLOOD_CONNS_PER_UID = 4           # admin_max_clients_per_uid's default
FLOOD_IN_FLIGHT = 8               # requests queued per connection, so pvgpud never waits for us


def flood_admin(admin_path, uid, seconds, ready_fd, count_fd):
    """Child process: as `uid`, floods list/stats on 4 connections for `seconds`,
    then writes how many responses it read to count_fd."""
    try:
        # The flooders' own CPU is not pvgpud's to control: on a 2-core host
        # eight busy clients at the VMM's priority delay the pinging VMM
        # itself (a run under meson measured p99 6.7 ms with pvgpud at 0.08
        # of a core).  Below it, the PING latency is pvgpud's.
        os.nice(19)
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
        socks = [admin_connect(admin_path) for _ in range(FLOOD_CONNS_PER_UID)]
        reqs = [b'{"cmd":"list"}\n', b'{"cmd":"stats"}\n']
        for i, s in enumerate(socks):
            s.setblocking(False)
            s.sendall(reqs[i % 2] * FLOOD_IN_FLIGHT)
        answered = 0
        told = False
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            r, _, _ = select.select(socks, [], [], 0.1)
            for s in r:
                data = s.recv(1 << 20)
                if not data:
                    os._exit(3)  # pvgpud closed a flood connection: the parent sees a short count
                n = data.count(b"\n")
                answered += n
                if n:
                    s.send(reqs[answered % 2] * n)
            if answered and not told:
                os.write(ready_fd, b"r")
                told = True
        os.write(count_fd, struct.pack("<Q", answered))
        os._exit(0)
    except BaseException:
        os._exit(2)


def proc_cpu_s(pid):
    """utime + stime of a process, in seconds (/proc/PID/stat fields 14 and 15)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def ping_latencies(client, seconds):
    """PING round trips (ms) for `seconds`, one at a time."""
    out = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        t0 = time.perf_counter()
        seq = client.send(MSG_PING)
        msg = client.expect(seq)
        out.append((time.perf_counter() - t0) * 1000)
        check(msg[0] == MSG_PONG, f"PING answered with type {msg[0]}")
    out.sort()
    return out


def percentile(sorted_values, p):
    return sorted_values[min(len(sorted_values) - 1, int(len(sorted_values) * p))]


def case_admin_flood(bins, tmp):
    """Issue 51.1: 8 uids x 4 admin connections flooding list/stats against
    4 VMs x 64 tasks: a VMM's PING p99 <= 2 ms and pvgpud <= 30% of a core."""
    need_root(tmp)
    d = Daemon(bins, tmp)
    d.start()
    vms, children = [], []
    try:
        for v in range(4):
            vm = RawClient(d.socket)
            vm.hello(f"flood-vm{v}", role=ROLE_VMM, uuid=bytes([0x60 + v]) * 16)
            for hint in range(1, 65):
                seq = vm.send(MSG_CHAN_ALLOC, struct.pack("<Q32s", hint, f"task{hint}".encode()))
                status, _, fds = vm.parse_chan_reply(vm.expect(seq))
                check(status == E_OK, f"VM {v}: CHAN_ALLOC for task {hint}: status {status}")
                for fd in fds:
                    os.close(fd)
            vms.append(vm)
        listing = admin_request(d, {"cmd": "list"})
        check(len(listing["entities"]) == 4 * 65, f"{len(listing['entities'])} entities, expected 4 x 65")
        ping = vms[0]
        quiet = ping_latencies(ping, 2.0)
        result("admin_flood.quiet_ping_p50_ms", f"{percentile(quiet, 0.5):.3f}")
        result("admin_flood.quiet_ping_p99_ms", f"{percentile(quiet, 0.99):.3f}")

        seconds = 8.0  # the flood outlasts the windows below (2 s each, after its start)
        ready_r, ready_w = os.pipe()
        count_r, count_w = os.pipe()
        for uid in FLOOD_UIDS:
            pid = os.fork()
            if pid == 0:
                flood_admin(d.admin, uid, seconds, ready_w, count_w)
            children.append(pid)
        os.close(ready_w)
        os.close(count_w)
        # Every flooder has its answers coming before anything is measured.
        got = b""
        while len(got) < len(children):
            r, _, _ = select.select([ready_r], [], [], 5.0)
            check(r, f"{len(got)} of {len(children)} flooders got answers within 5 s")
            chunk = os.read(ready_r, 64)
            check(chunk, f"a flooder died before its first answer ({len(got)} ready)")
            got += chunk
        # pvgpud's CPU under the flood alone (a VMM pinging back to back
        # would add a loop wake-up per PING), then the VMM's latency.
        # The bound is the issue's goal (issue 51 item 1).  Process CPU on
        # this shared 2-core VM is not pvgpud's alone to decide: CI once
        # read 0.70 where 12 runs here read 0.11..0.16.  A second window,
        # right after, is measured when the first misses, never silently
        # (a RERUN line); a pvgpud that spins misses both.
        for attempt in (1, 2):
            cpu0, t0 = proc_cpu_s(d.proc.pid), time.monotonic()
            select.select([], [], [], 2.0)  # a measurement window, not synchronisation
            cpu = (proc_cpu_s(d.proc.pid) - cpu0) / (time.monotonic() - t0)
            result("admin_flood.pvgpud_cpu_fraction" + ("" if attempt == 1 else ".second_window"), f"{cpu:.3f}")
            if cpu <= 0.30:
                break
            if attempt == 1:
                rerun("admin-flood", f"window 1: pvgpud used {cpu:.2f} of a core under the flood, beyond 0.30 "
                      f"(load average {os.getloadavg()[0]:.1f})")
        flooded = ping_latencies(ping, 2.0)
        answered = 0
        for pid in children:
            _, status = os.waitpid(pid, 0)
            check(os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0,
                  f"flooder {pid} ended with status {status}")
        children = []
        while chunk := os.read(count_r, 8 * len(FLOOD_UIDS)):
            answered += sum(struct.unpack(f"<{len(chunk) // 8}Q", chunk))
        os.close(ready_r)
        os.close(count_r)
        p50, p99 = percentile(flooded, 0.5), percentile(flooded, 0.99)
        result("admin_flood.responses_per_s", f"{answered / seconds:.0f}")
        result("admin_flood.ping_p50_ms", f"{p50:.3f}")
        result("admin_flood.ping_p99_ms", f"{p99:.3f}")
        result("admin_flood.ping_samples", len(flooded))
        # The bounds are the issue's goals (issue 51 item 1).
        check(cpu <= 0.30, f"pvgpud used {cpu:.2f} of a core under the flood, expected <= 0.30")
        check(p99 <= 2.0, f"PING p99 {p99:.2f} ms under the flood, expected <= 2 ms")
        check(d.alive(), "pvgpud died")
    finally:
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
        for vm in vms:
            vm.close()
        d.stop()


# ---- a silent libvirtd (issue 51 item 2) -------------------------------------------

class SilentLibvirtd:
    """A unix socket that accepts connections and never answers: a wedged libvirtd."""

    def __init__(self, path):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(path)
        self.sock.listen(16)
        self.conns = []
        self.accepted = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:  # shut down: the test is over
                return
            self.conns.append(c)
            self.accepted.set()

    def close(self):
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self.thread.join(5)
        for c in self.conns:
            c.close()


def libvirt_daemon(bins, tmp, sock_path):
    """A pvgpud following "libvirt" at sock_path (a root client is a VMM)."""
    with open(os.path.join(tmp, "pvgpud.conf"), "w") as f:
        f.write(f"[libvirt]\nuri = qemu+unix:///system?socket={sock_path}\npid_dir = {tmp}\n")
    return Daemon(bins, tmp)


def timed(fn):
    t0 = time.monotonic()
    value = fn()
    return value, time.monotonic() - t0


# The goal (issue 51 item 2): ready, and serving clients and admins, within
# 1 s whatever libvirtd does.  A VMM's HELLO may wait for libvirt's answer
# up to kLibvirtCallTimeout (1 s, libvirt_watch.hpp); the second second is
# room for a loaded 2-core machine (quiet runs answer such a HELLO in 1.0 s).
STALL_SERVE_S = 1.0
STALL_VMM_HELLO_S = 2.0


def check_serving(d, label):
    """Admins, host clients and a VMM (unknown to libvirt) are answered in time."""
    try:
        serving(d, label)
    except (socket.timeout, TimeoutError) as e:
        raise TestFailure(f"{label}: pvgpud did not answer within 10 s ({e})")


def serving(d, label):
    listing, t = timed(lambda: admin_request(d, {"cmd": "list"}, timeout=10))
    result(f"libvirt_stall.{label}.admin_list_s", f"{t:.3f}")
    check(listing.get("ok") and t <= STALL_SERVE_S, f"{label}: admin list took {t:.2f} s: {listing}")
    host = RawClient(d.socket, timeout=10)
    _, t = timed(lambda: host.hello("stall-host"))
    result(f"libvirt_stall.{label}.host_hello_s", f"{t:.3f}")
    check(t <= STALL_SERVE_S, f"{label}: a host HELLO took {t:.2f} s")
    vm = RawClient(d.socket, timeout=10)
    _, t = timed(lambda: vm.hello("stall-vm", role=ROLE_VMM, uuid=VM_UUID))
    result(f"libvirt_stall.{label}.vmm_hello_s", f"{t:.3f}")
    check(t <= STALL_VMM_HELLO_S, f"{label}: a VMM HELLO took {t:.2f} s")
    check(d.wait_log("taken without libvirt's word"), f"{label}: no log line for the unverified VMM")
    seq = host.send(MSG_PING)
    check(host.expect(seq)[0] == MSG_PONG, f"{label}: no PONG")
    host.close()
    vm.close()


def case_libvirt_stall(bins, tmp):
    """Issue 51.2: a libvirtd that accepts and never answers, from the start or
    after pvgpud found none, stalls neither pvgpud's start nor its clients."""
    silent = None
    try:
        # Silent from the start.
        first = os.path.join(tmp, "silent")
        os.mkdir(first)
        sock = os.path.join(first, "libvirt-sock")
        silent = SilentLibvirtd(sock)
        d = libvirt_daemon(bins, first, sock)
        _, t = timed(lambda: d.start(timeout=10))
        result("libvirt_stall.silent.ready_s", f"{t:.3f}")
        if any("built without libvirt" in line for line in d.lines):
            raise Skip("pvgpud was built without libvirt")
        check(t <= STALL_SERVE_S, f"pvgpud took {t:.2f} s to be ready beside a silent libvirtd")
        check(silent.accepted.wait(5), "pvgpud never connected to the fake libvirtd")
        check_serving(d, "silent")
        rc, t = timed(lambda: d.stop(timeout=10))
        result("libvirt_stall.silent.stop_s", f"{t:.3f}")
        check(rc == 0, f"pvgpud exited with {rc} beside a silent libvirtd")
        silent.close()
        silent = None

        # Absent at the start, then silent: the retry must not stall either.
        second = os.path.join(tmp, "absent")
        os.mkdir(second)
        sock = os.path.join(second, "libvirt-sock")
        d = libvirt_daemon(bins, second, sock)
        d.start(timeout=10)
        check(d.wait_log("cannot connect to libvirt"), "pvgpud did not say libvirt is absent")
        silent = SilentLibvirtd(sock)
        # The first retry comes 0.5 s after the failure (kBackoffFirstMs).
        check(silent.accepted.wait(5), "pvgpud did not retry libvirt within 5 s")
        check_serving(d, "absent_then_silent")
        check(d.alive(), "pvgpud died")
        check(d.stop(timeout=10) == 0, "pvgpud did not exit cleanly")
    finally:
        if silent:
            silent.close()


# ---- completion notifiers (protocol version 3) ----------------------------------


def pipe_bytes(fd):
    return struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0" * 4))[0]


def case_completion(bins, tmp):
    """Issue 12: host clients' completion notifiers.  libpvgpu sleeps on them:
    at most one wake-up per kernel, one per batch, with two clients contending
    (the timed re-checks it falls back to without them miss whenever the
    other client's kernel runs).  The notifier is a one-page pipe only pvgpud
    writes, when FENCE reaches the page's NOTIFY_FENCE; version-2 clients get
    two fds as before; one that never reads its notifier, blocks it or
    closes it costs the daemon nothing."""
    d = Daemon(bins, tmp)
    d.start()
    try:
        # Batches of 1 and of 4, two in flight each, 1 ms kernels: each
        # client's kernels wait behind the other's.  polls counts every
        # sleep of the library; the ideal is one per awaited fence.
        kernels = 600
        loads = {b: Load(bins, d, "bench", "--kernel-us", 1000, "--kernels", kernels, "--batch", b,
                         "--depth", 2, name=f"wake-batch{b}") for b in (1, 4)}
        for b, load in loads.items():
            rc, v = load.finish(timeout=60)
            check(rc == 0, f"batch {b}: exit status {rc}")
            per_kernel = int(v["polls"]) / kernels
            result(f"completion.batch{b}.wakeups_per_kernel", f"{per_kernel:.3f}")
            # One per awaited fence (1/b per kernel); a look that finds the
            # fence already reached does not sleep.  5%: wake-ups for the
            # socket (none are expected for a host client).
            check(per_kernel <= 1.05 / b, f"batch {b}: {per_kernel:.3f} wake-ups per kernel, "
                                          f"expected <= {1.05 / b:.3f} (one per awaited fence)")

        # A version-2 client (the QEMU device, an old libpvgpu): as before.
        old = RawClient(d.socket)
        old.hello("v2", version=2)
        check(old.version == 2, f"HELLO version 2 answered with version {old.version}")
        status, _, fds = old.alloc()
        check(status == E_OK and len(fds) == 2 and not old.fds,
              f"version 2: CHAN_REPLY status {status} with {len(fds) + len(old.fds)} fds, expected 2")
        old.close()

        # A version-3 host client gets the read end of a one-page pipe.
        c = RawClient(d.socket)
        c.hello("v3", version=PROTO_VERSION_COMPLETION)
        check(c.version == PROTO_VERSION_COMPLETION, f"HELLO version 3 answered with version {c.version}")
        status, _, fds = c.alloc(nfds=3)
        check(status == E_OK and not c.fds, f"version 3: CHAN_REPLY status {status}, {len(c.fds)} extra fds")
        notifier = fds[2]
        check(stat.S_ISFIFO(os.fstat(notifier).st_mode), "the notifier is not a pipe")
        check(fcntl.fcntl(notifier, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY,
              "the notifier is not the read end")
        check(fcntl.fcntl(notifier, fcntl.F_GETPIPE_SZ) <= PAGE, "the notifier pipe is larger than a page")
        ch = RawChannel(fds)

        def run(kernels):
            ch.run(10_000, kernels)

        def drain():
            os.set_blocking(notifier, False)
            try:
                while os.read(notifier, 4096):
                    pass
            except BlockingIOError:
                pass

        # NOTIFY_FENCE: nothing before it is reached, a byte once it is.
        run(10)
        struct.pack_into("<I", ch.mem, CTRL_NOTIFY_FENCE, ch.put + 50)
        drain()
        run(40)
        check(pipe_bytes(notifier) == 0, f"woken {pipe_bytes(notifier)} times before NOTIFY_FENCE")
        run(20)
        check(pipe_bytes(notifier) > 0, "not woken when FENCE passed NOTIFY_FENCE")

        # Hostile: blocking mode on our end (pvgpud's end is its own), never
        # read, far more completions than the pipe holds.
        os.set_blocking(notifier, True)
        struct.pack_into("<I", ch.mem, CTRL_NOTIFY_FENCE, 0)
        run(6000)
        check(pipe_bytes(notifier) <= PAGE, f"{pipe_bytes(notifier)} bytes in a one-page notifier")
        good_client_throughput(bins, d, "notifier-full")
        # Closed: pvgpud's writes fail with EPIPE, which must not kill it.
        os.close(notifier)
        run(300)
        good_client_throughput(bins, d, "notifier-closed")
        ch.close()
        c.close()
        check(d.alive(), "pvgpud died")
    finally:
        d.stop()


# ---- several GPUs: placement, per-GPU shares, moving a VM ------------------------

def admin_request(daemon, req, timeout=15.0):
    """One admin request on its own connection; the decoded reply."""
    s = admin_connect(daemon.admin)
    s.settimeout(timeout)
    try:
        s.sendall((json.dumps(req) + "\n").encode())
        data = b""
        while not data.endswith(b"\n"):
            chunk = s.recv(65536)
            check(chunk, f"admin connection closed before the reply to {req}")
            data += chunk
        return json.loads(data.decode().splitlines()[0])
    finally:
        s.close()


def gpu_of(listing, path):
    return [e["gpu"] for e in listing["entities"] if e["path"] == path]


def case_gpus(bins, tmp):
    """Two GPUs (round-robin, timeslice): each splits by its own weights,
    clients name their GPU (pvgpu-load --gpu) and the Prometheus textfile
    agrees with the clients' own counts."""
    prom = os.path.join(tmp, "textfile", "pvgpu.prom")
    os.makedirs(os.path.dirname(prom))
    with open(os.path.join(tmp, "pvgpud.conf"), "w") as f:
        f.write("[libvirt]\nuri = none\n[metrics]\ntextfile = " + prom + "\ninterval_s = 1\n"
                "[gpu.0]\narbitration = round-robin\n[gpu.1]\nname = slices\narbitration = timeslice\n")
    d = Daemon(bins, tmp)
    d.start()
    loads = []
    try:
        listing = ctl_json(bins, d, "list")
        gpus = listing.get("gpus", [])
        check([(g["index"], g["name"], g["arbitration"]) for g in gpus] ==
              [(0, "gpu0", "round-robin"), (1, "slices", "timeslice")], f"GPUs as listed: {gpus}")
        # Weights 100:300 on gpu0, 100:100 on gpu1; kernels of four lengths.
        spec = [("a0", 0, 1000, 100), ("b0", 0, 400, 300), ("a1", 1, 1500, 100), ("b1", 1, 300, 100)]
        for name, gpu, kernel_us, weight in spec:
            loads.append(Load(bins, d, "throttle", "--kernel-us", kernel_us, "--batch", 4, "--depth", 2,
                              "--duration-s", 30, "--report-interval-s", "0.1", "--gpu", gpu, name=name))
        for load in loads:
            load.wait_until(lambda l: len(l.reports) >= 1, 10, "its first report")
        for name, gpu, kernel_us, weight in spec:
            ctl(bins, d, "set-weight", f"{HOST}/{name}", str(weight))
        now = time.monotonic()

        def scrape():
            """pvgpu_entity_gpu_seconds_total of each task, from a fresh textfile."""
            mtime = os.stat(prom).st_mtime_ns
            deadline = time.monotonic() + 5
            while os.stat(prom).st_mtime_ns == mtime:
                check(time.monotonic() < deadline, "textfile not rewritten within 5 s")
                time.sleep(0.05)  # watching a file's mtime: there is nothing to block on
            with open(prom) as f:
                text = f.read()
            out = {}
            for name, gpu, _, _ in spec:
                labels = f'kind="host",vm="",task="{USER}/{name}",gpu="{gpu}"'
                for line in text.splitlines():
                    if line.startswith(f"pvgpu_entity_gpu_seconds_total{{{labels}}} "):
                        out[name] = float(line.rsplit(" ", 1)[1])
                check(name in out, f"no pvgpu_entity_gpu_seconds_total{{{labels}}} in the textfile")
            return out

        time.sleep(max(0.0, now + 1.5 - time.monotonic()))
        first = scrape()
        shares, _ = measure_between(loads, [k for _, _, k, _ in spec], now + 1.5, now + 6.5, 20)
        last = scrape()
        listing = ctl_json(bins, d, "list")
        for (name, gpu, kernel_us, weight) in spec:
            check(gpu_of(listing, f"{HOST}/{name}") == [gpu], f"{name} is on {gpu_of(listing, f'{HOST}/{name}')}")
        # Per GPU: each task's part of its GPU's work, by its own counts.
        for gpu, want in ((0, [0.25, 0.75]), (1, [0.5, 0.5])):
            idx = [i for i, s_ in enumerate(spec) if s_[1] == gpu]
            total = sum(shares[i] for i in idx)
            got = [shares[i] / total for i in idx]
            for i, g, w in zip(idx, got, want):
                result(f"gpus.gpu{gpu}.{spec[i][0]}.share", f"{g:.3f}")
            # 0.02: the issue's bound; each GPU's split is its own scheduler's.
            check(all(abs(g - w) <= 0.02 for g, w in zip(got, want)),
                  f"GPU {gpu}: shares {[round(x, 3) for x in got]}, expected {want} +- 0.02")
            # pvgpud's own accounts, as Prometheus scrapes them, over about
            # the same window (the textfile is rewritten every second, so its
            # window is off by up to a second at each end): the same split.
            used = [last[spec[i][0]] - first[spec[i][0]] for i in idx]
            scraped = [u / sum(used) for u in used]
            for i, g in zip(idx, scraped):
                result(f"gpus.gpu{gpu}.{spec[i][0]}.scraped_share", f"{g:.3f}")
            check(all(abs(g - w) <= 0.02 for g, w in zip(scraped, want)),
                  f"GPU {gpu}: the textfile's split {[round(x, 3) for x in scraped]}, expected {want} +- 0.02")
    finally:
        for load in loads:
            load.finish(sig=signal.SIGTERM)
        d.stop()


def case_placement(bins, tmp):
    """Spread and pack place VMs as configured; a GPU a client names is
    honoured or refused with a reason; placements survive a restart."""
    uuids = [bytes([i]) * 16 for i in range(1, 6)]
    text = ["-".join([u.hex()[:8], u.hex()[8:12], u.hex()[12:16], u.hex()[16:20], u.hex()[20:]]) for u in uuids]
    with open(os.path.join(tmp, "pvgpud.conf"), "w") as f:
        f.write("[libvirt]\nuri = none\n[gpu.0]\n[gpu.1]\n[gpu.2]\n")
    d = Daemon(bins, tmp)
    d.start()
    clients = []

    def vm(i, gpu=None, status=E_OK):
        c = RawClient(d.socket)
        c.hello(f"vm{i}", role=ROLE_VMM, uuid=uuids[i], version=PROTO_VERSION, gpu=gpu, expect_status=status)
        clients.append(c)
        return c

    def placed():
        listing = ctl_json(bins, d, "list")
        out = {}
        for e in listing["entities"]:
            if e["kind"] == "vm":
                out[e["path"]] = e["gpu"] if e["path"] not in out else sorted([out[e["path"]], e["gpu"]])
        return out

    try:
        # spread: the GPU with the least weight placed; ties to the lowest.
        ctl(bins, d, "set-weight", text[0], "300")
        vm(0)
        vm(1)
        vm(2)
        vm(3)
        check(placed() == {"vm0": 0, "vm1": 1, "vm2": 2, "vm3": 1}, f"spread placed {placed()}")
        # Named: honoured, even where spread would not go.
        vm(4, gpu=0)
        check(placed()["vm4"] == 0, f"vm4 asked for GPU 0: {placed()}")
        # Out of range: an ERROR saying why, then the refusal.
        bad = RawClient(d.socket)
        payload = struct.pack("<II16s64sII", PROTO_VERSION, ROLE_VMM, bytes([9]) * 16, b"bad", os.getpid(), 4)
        seq = bad.send(MSG_HELLO, payload)
        msg = bad.recv()
        check(msg and msg[0] == MSG_ERROR, f"no ERROR before the refusal: {msg}")
        check(b"no GPU 3 on this host (3 GPUs)" in msg[2], f"ERROR says {msg[2]!r}")
        msg = bad.expect(seq)
        check(msg[0] == MSG_HELLO_REPLY and struct.unpack_from("<I", msg[2])[0] == E_INVALID,
              f"HELLO for GPU 3 answered {msg}")
        check(bad.wait_closed(), "refused client not closed")
        bad.close()
        check(d.wait_log("no GPU 3 on this host"), "refusal not logged")
        # A second device of vm1 on another GPU; the same GPU again is refused.
        vm(1, gpu=2)
        vm(1, gpu=2, status=E_STATE)
        listing = ctl_json(bins, d, "list")
        check(sorted(gpu_of(listing, "vm1")) == [1, 2], f"vm1's devices: {gpu_of(listing, 'vm1')}")
        # A policy for one GPU, kept across the restart beside the others'.
        ctl(bins, d, "set-policy", "none", "--gpu", "1")
        pols = [g["policy"] for g in ctl_json(bins, d, "policy")["gpus"]]
        check(pols == ["hfq", "none", "hfq"], f"policies after set-policy none --gpu 1: {pols}")
        # Restart: every VM comes back where it was without naming a GPU.
        before = placed()
        for c in clients:
            c.close()
        clients.clear()
        d.stop()
        d.start()
        for i in (3, 2, 1, 0, 4, 1):  # another order than before; vm1's two devices
            vm(i)
        check(placed() == before, f"after a restart {placed()}, before {before}")
        pols = [g["policy"] for g in ctl_json(bins, d, "policy")["gpus"]]
        check(pols == ["hfq", "none", "hfq"], f"policies after a restart: {pols}")
    finally:
        for c in clients:
            c.close()
        d.stop()
    # pack: fill GPU 0 up to pack_limit before GPU 1.
    tmp2 = os.path.join(tmp, "pack")
    os.makedirs(tmp2)
    with open(os.path.join(tmp2, "pvgpud.conf"), "w") as f:
        f.write("[libvirt]\nuri = none\n[daemon]\nplacement = pack\npack_limit = 2\n[gpu.0]\n[gpu.1]\n")
    d = Daemon(bins, tmp2)
    d.start()
    try:
        for i in range(4):
            vm(i)
        check(placed() == {"vm0": 0, "vm1": 0, "vm2": 1, "vm3": 1}, f"pack placed {placed()}")
    finally:
        for c in clients:
            c.close()
        d.stop()


def case_move(bins, tmp):
    """pvgpuctl's move: a VM's channel goes to another GPU while it runs,
    without a lost, repeated or reordered kernel; bad moves change nothing."""
    with open(os.path.join(tmp, "pvgpud.conf"), "w") as f:
        f.write("[libvirt]\nuri = none\n[gpu.0]\n[gpu.1]\narbitration = timeslice\n")
    d = Daemon(bins, tmp)
    d.start()
    c = RawClient(d.socket)
    try:
        c.hello("mover", role=ROLE_VMM, uuid=VM_UUID, version=PROTO_VERSION, gpu=0)
        status, chan_id, fds = c.alloc()
        check(status == E_OK, f"CHAN_ALLOC status {status}")
        ch = RawChannel(fds)
        kernels, seen, errors = 3000, [], []

        def run():
            try:
                ch.run(500_000, kernels, timeout=60)
            except TestFailure as e:
                errors.append(str(e))

        def watch():
            last = 0
            while not done.is_set():
                f = ch.fence()
                if f < last:
                    seen.append((last, f))
                last = f
                time.sleep(0.0005)

        done = threading.Event()
        threads = [threading.Thread(target=run), threading.Thread(target=watch)]
        for t in threads:
            t.start()
        try:
            while ch.fence() < 200:
                time.sleep(0.01)
            for bad, why in ((dict(target="mover", gpu=5), "no such GPU"),
                             (dict(target="nobody", gpu=1), "no such VM connected"),
                             (dict(target="mover", gpu=0), "is on GPU 0 already")):
                r = admin_request(d, dict(cmd="move", **bad))
                check(not r["ok"] and why in r["error"], f"move {bad}: {r}")
            moves = []
            for to in (1, 0, 1):
                r = admin_request(d, {"cmd": "move", "target": "mover", "gpu": to})
                check(r.get("ok"), f"move to GPU {to}: {r}")
                check([x["chan_id"] for x in r["channels"]] == [chan_id], f"moved channels {r['channels']}")
                moves.append(r["channels"][0]["pause_ms"])
                check(gpu_of(ctl_json(bins, d, "list"), "mover") == [to], "the VM is not where it moved")
                time.sleep(0.2)
            for i, p in enumerate(moves):
                result(f"move.pause_ms.{i}", f"{p:.2f}")
        finally:
            threads[0].join(90)
            done.set()
            threads[1].join(5)
        check(not errors, f"the channel's work did not complete: {errors}")
        check(ch.fence() == kernels, f"fence {ch.fence()} after {kernels} kernels")
        check(not seen, f"FENCE went backwards: {seen[:3]}")
        # Every kernel ran once: the GPUs' accounts add up to the work.
        stats = ctl_json(bins, d, "stats")
        check(stats["counters"]["moves"] == 3, f"moves counted: {stats['counters']['moves']}")
        busy = sum(g["busy_s"] for g in stats["gpus"])
        result("move.busy_s", f"{busy:.6f}")
        # The simulated GPUs' busy time is the sum of the kernels they ran
        # (measured 1.500000 s): a kernel lost or run twice moves it by 0.5 ms,
        # so half a kernel is the bound.
        check(abs(busy - kernels * 0.0005) <= 0.00025,
              f"the GPUs were busy {busy:.6f} s for {kernels * 0.0005:.6f} s of kernels")
        # A VM that disconnects while its long kernel drains: the move fails
        # and says so; pvgpud goes on.
        ch.fill(400_000_000, 1)
        time.sleep(0.05)
        reply = {}
        t = threading.Thread(target=lambda: reply.update(admin_request(d, {"cmd": "move", "target": "mover", "gpu": 0})))
        t.start()
        time.sleep(0.1)
        ch.close()
        c.close()
        t.join(10)
        check(not reply.get("ok") and "disconnected" in reply.get("error", ""), f"move of a leaving VM: {reply}")
        check(d.alive(), "pvgpud died")
        check(admin_request(d, {"cmd": "list"})["ok"], "pvgpud does not answer after the failed move")
    finally:
        d.stop()


# ---- a Kubernetes pod's reserved GPU (issue 55) -------------------------------


def admission_says(d, vm, text):
    """Whether pvgpud's line admitting VM `vm` contains `text`."""
    head = f": VM {vm} ("
    return d.wait_log(head) and any(head in line and text in line for line in d.lines)


def refused_hello(d, uuid, name, gpu=None):
    """A VMM HELLO that pvgpud refuses with E_INVALID: the ERROR's text."""
    c = RawClient(d.socket)
    try:
        payload = struct.pack("<II16s64sII", PROTO_VERSION, ROLE_VMM, uuid, name.encode(), os.getpid(),
                              0 if gpu is None else gpu + 1)
        seq = c.send(MSG_HELLO, payload)
        msg = c.recv()
        check(msg and msg[0] == MSG_ERROR, f"{name}: no ERROR before the refusal: {msg}")
        text = msg[2][8:].split(b"\0", 1)[0].decode()
        reply = c.expect(seq)
        check(reply[0] == MSG_HELLO_REPLY and struct.unpack_from("<I", reply[2])[0] == E_INVALID,
              f"{name}: HELLO answered {reply}")
        check(c.wait_closed(), f"{name}: refused client not closed")
        return text
    finally:
        c.close()


def vmm_hello_child(socket_path, uuid_hex, name):
    """Runs as its own process (daemon_test.py --vmm-hello ...), maybe in a
    mount namespace of its own: a VMM HELLO naming no GPU; prints its status,
    then stays connected until its stdin closes."""
    c = RawClient(socket_path)
    payload = struct.pack("<II16s64sII", PROTO_VERSION, ROLE_VMM, bytes.fromhex(uuid_hex), name.encode(),
                          os.getpid(), 0)
    seq = c.send(MSG_HELLO, payload)
    reply = c.expect(seq)
    print(f"status {struct.unpack_from('<I', reply[2])[0] if reply[0] == MSG_HELLO_REPLY else -1}", flush=True)
    sys.stdin.read()
    c.close()
    return 0


def check_own_namespace(bins, d, alloc, placed):
    """A VMM in a mount namespace of its own, where another file is mounted
    over allocation_file: pvgpud reads the VMM's file, not its own."""
    if os.geteuid() != 0:
        log("mount namespace part skipped: not root")
        return
    probe = subprocess.run(["unshare", "--mount", "--propagation", "private", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        log(f"mount namespace part skipped: unshare --mount fails ({probe.stderr.strip()})")
        return
    own = os.path.join(os.path.dirname(alloc), "own-namespace.json")
    with open(own, "w") as f:
        f.write('{"gpu": 0}\n')
    with open(alloc, "w") as f:
        f.write('{"gpu": 1}\n')
    uuid = bytes([0x46]) * 16
    # --propagation private: the bind mount stays in the child's namespace.
    cmd = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
           'mount --bind "$1" "$2" && exec "$3" "$4" --vmm-hello "$5" "$6" ns-vm', "sh", own, alloc,
           sys.executable, os.path.abspath(__file__), d.socket, uuid.hex()]
    child = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = child.stdout.readline().strip()
        if line != f"status {E_OK}":
            child.stdin.close()
            raise TestFailure(f"the VMM in its own mount namespace: '{line}', {child.stderr.read().strip()}")
        check(placed().get("ns-vm") == 0, f"the VMM whose own file says GPU 0 is on {placed().get('ns-vm')}")
        check(admission_says(d, "ns-vm", f"on GPU 0 gpu0 (reserved by its pod: {alloc})"),
              "no log line of ns-vm reserved by its pod")
    finally:
        child.stdin.close()
        child.wait(10)
    log("a VMM in its own mount namespace placed by its own allocation file (GPU 0, pvgpud's says 1)")


def case_kubernetes_allocation(bins, tmp):
    """Issue 55: a VMM that names no GPU lands on the GPU of its pod's
    allocation file ([kubernetes] allocation_file, read through the VMM's
    /proc/PID/root); a GPU the device names wins; no file, the placement;
    a wrong file refuses the HELLO naming the file."""
    alloc = os.path.join(tmp, "alloc.json")
    with open(os.path.join(tmp, "pvgpud.conf"), "w") as f:
        f.write(f"[libvirt]\nuri = none\n[gpu.0]\n[gpu.1]\n[kubernetes]\nallocation_file = {alloc}\n")
    d = Daemon(bins, tmp)
    d.start()
    clients = []
    uuids = [bytes([0x40 + i]) * 16 for i in range(6)]

    def vm(i, gpu=None):
        c = RawClient(d.socket)
        c.hello(f"vm{i}", role=ROLE_VMM, uuid=uuids[i], version=PROTO_VERSION, gpu=gpu)
        clients.append(c)

    def placed():
        return {e["path"]: e["gpu"] for e in ctl_json(bins, d, "list")["entities"] if e["kind"] == "vm"}

    try:
        with open(alloc, "w") as f:
            json.dump({"gpu": 1, "units": 25, "devices": [f"gpu1-u{u:03d}" for u in range(25)]}, f)
        vm(0)
        check(placed() == {"vm0": 1}, f"vm0, reserved GPU 1 by its file, placed {placed()}")
        check(admission_says(d, "vm0", f"on GPU 1 gpu1 (reserved by its pod: {alloc})"),
              "no log line of vm0 reserved by its pod")
        os.unlink(alloc)
        vm(1)  # spread: GPU 0 has no weight yet
        check(placed() == {"vm0": 1, "vm1": 0}, f"vm1, without a file, placed {placed()}")
        check(admission_says(d, "vm1", "on GPU 0 gpu0 (placed)"), "no log line of vm1 placed")
        with open(alloc, "w") as f:
            f.write('{"gpu": 1}')
        vm(2, gpu=0)
        check(placed()["vm2"] == 0, f"vm2's device asks for GPU 0 despite the file: {placed()}")
        log("file says GPU 1: vm0 there; no file: vm1 placed (GPU 0); the device's gpu=0 wins over the file")
        for name, text, want in (("bad-json", '{"gpu": 1', "malformed JSON"),
                                 ("no-gpu", '{"units": 25}', 'no "gpu" field'),
                                 ("gpu-7", '{"gpu": 7}', '"gpu" is 7; this host has 2 GPUs')):
            with open(alloc, "w") as f:
                f.write(text)
            error = refused_hello(d, uuids[3], name)
            check(error.startswith(alloc) and want in error, f"{name}: the ERROR says '{error}'")
            vm3 = "-".join(uuids[3].hex()[a:b] for a, b in ((0, 8), (8, 12), (12, 16), (16, 20), (20, 32)))
            check(d.wait_log(f"refused as VMM of {vm3}: {alloc}: {want}"), f"{name}: refusal not logged")
            log(f"{name}: refused: {error}")
        check(d.alive() and "vm3" not in placed(), f"after the refusals: alive {d.alive()}, {placed()}")
        check_own_namespace(bins, d, alloc, placed)
        check(d.alive(), "pvgpud died")
    finally:
        for c in clients:
            c.close()
        d.stop()


CASES = {
    "identity": case_identity,
    "migrate": case_migrate,
    "limits": case_limits,
    "queue-fds": case_queue_fds,
    "admin-slots": case_admin_slots,
    "admin-flood": case_admin_flood,
    "libvirt-stall": case_libvirt_stall,
    "client": case_client,
    "long-user": case_long_user,
    "guest-weights": case_guest_weights,
    "freed-pages": case_freed_pages,
    "channel-memory": case_channel_memory,
    "fairness": case_fairness,
    "fairness-notrace": case_fairness_notrace,
    "closed-loop": case_closed_loop,
    "library": case_library,
    "weights": case_weights,
    "admin": case_admin,
    "restart": case_restart,
    "protocol": case_protocol,
    "permissions": case_permissions,
    "monitoring": case_monitoring,
    "ctl-compat": case_ctl_compat,
    "ctl-gpus": case_ctl_gpus,
    "metrics": case_metrics,
    "completion": case_completion,
    "cheat": case_cheat,
    "gpus": case_gpus,
    "placement": case_placement,
    "move": case_move,
    "kubernetes-allocation": case_kubernetes_allocation,
}


def main():
    if len(sys.argv) == 6 and sys.argv[1] == "--cheat-client":
        return cheat_client(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
    if len(sys.argv) == 5 and sys.argv[1] == "--vmm-hello":
        return vmm_hello_child(sys.argv[2], sys.argv[3], sys.argv[4])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pvgpud", required=True)
    ap.add_argument("--pvgpuctl", required=True)
    ap.add_argument("--load", required=True)
    ap.add_argument("--libtest", help="the libpvgpu Catch2 test program (case library)")
    ap.add_argument("case", choices=sorted(CASES) + ["all"])
    ns = ap.parse_args()
    bins = Bins(ns)
    # The cases measure the GPU policy in real time, not the host's CPU
    # scheduler: a client left unscheduled for a millisecond or two on a
    # loaded machine submits late, and hfq rightly gives its turn away
    # (closed-loop measured 0.59 and 0.77 beside four and eight busy loops,
    # 0.500 and 0.511 at nice -10; CI failed it twice at 0.62 and 0.66).  As
    # root, this process, and so every daemon and client it starts, runs
    # ahead of other work.
    if os.geteuid() == 0:
        try:
            os.nice(-10)
        except OSError as e:  # root without CAP_SYS_NICE (a container)
            log(f"running at the default priority: {e}")
    names = sorted(CASES) if ns.case == "all" else [ns.case]
    status = 0
    for name in names:
        tmp = tempfile.mkdtemp(prefix=f"pvgpu-{name}-")
        start = time.monotonic()
        DAEMONS.clear()
        try:
            CASES[name](bins, tmp)
            # Caught and logged, an exception still left the daemon's state
            # half-changed (a channel closed on the engine under hfq once
            # left the accounting on it, and later freed memory twice).
            for daemon in DAEMONS:
                errors = daemon.internal_errors()
                check(not errors, f"pvgpud logged {len(errors)} internal error(s), first: {errors[:1]}")
            print(f"PASS {name} ({time.monotonic() - start:.1f} s)", flush=True)
        except Skip as e:
            print(f"SKIP {name}: {e}", flush=True)
            if len(names) == 1:
                status = SKIP
        except TestFailure as e:
            print(f"FAIL {name}: {e}", flush=True)
            status = 1
        except Exception:  # a crash of the test itself is a failure too
            import traceback
            traceback.print_exc()
            status = 1
        finally:
            if status not in (0, SKIP):
                for daemon in DAEMONS:
                    print("# pvgpud log:")
                    daemon.dump_log()
            for daemon in DAEMONS:
                if daemon.alive():
                    daemon.proc.kill()
                    daemon.proc.wait()
            shutil.rmtree(tmp, ignore_errors=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
