#!/usr/bin/env python3
"""Fuzz the QEMU pvgpu device through qtest: a seeded generator of guest and
daemon actions against qemu-system-x86_64 (best against the sanitizer build,
qemu-patches/build-qemu.sh --asan).

Each step is one random action of the guest or of a hostile daemon:
  guest   mailbox commands with plausible and random arguments, TASK_NAME
          bytes, named registers, accesses of every size and alignment
          anywhere in BAR0, BAR2 (control and doorbell pages of every slot)
          and BAR4, submissions (ring entries, IB_PUT, doorbell), MSI-X
          enable/mask and table writes, machine resets, hot-unplug and
          re-plug (`pc` machine, QMP device_del + ACPI eject, device_add);
  daemon  (a fake pvgpud in this script) MODE pushes with valid and invalid
          modes and channel ids, NOTICEs, replies with stray sequence
          numbers or the wrong type, malformed headers, garbage bytes, ERROR,
          fds on a MODE, refused, bad-version or version-1 HELLO_REPLYs, dropped
          connections, stopping reading for a while (under a storm of
          IB_PUT stores: the device's queue of unsent messages fills and
          coalesces, or overflows), refused or malformed CHAN_REPLYs (no fds,
          unsealed memory, wrong size), and what the GPU (FENCE, STATUS,
          IB_GET, ERROR) or a stale vCPU store (IB_PUT) puts into the
          channel memory.
After every step QEMU must answer (a crash or hang ends the run); after
every mailbox command CMD_STATUS must leave BUSY within 2 s; a sanitizer
report in QEMU's stderr fails the run.  The same seed replays the same
actions (the daemon's thread and QEMU's timers can still interleave
differently).

Coverage is reported as the device behaviours reached: mailbox
(command, status) pairs, the daemon-input checks that dropped the link
(QEMU's warnings name them), slot states and modes, fence-wait outcomes and
interrupt causes seen.

usage: fuzz_device.py --qemu PATH [--asan] [--seed N] [--steps N | --seconds S]
                      [--stats FILE.json]
Exit status: 0 clean, 1 a finding (the seed and step are printed), 77 no QEMU.
"""

import argparse
import json
import os
import random
import re
import shutil
import struct
import sys
import tempfile
import time
import uuid as uuidlib

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import qemu_test as qt  # noqa: E402
from qemu_test import (BAR0_GPA, BAR1_GPA, BAR2_GPA, BAR4_GPA, HDR, MAGIC, PAGE,  # noqa: E402
                       REG_CMD, REG_IRQ_STATUS, REG_LINK, REG_MAGIC, REG_SLOT_BASE,
                       REG_WAIT_BASE, BAR2_STRIDE, Device, FakeDaemon, Qemu, TestFailure,
                       check, log)

SLOTS = 4
MSG_RAM_GPA = qt.MSG_RAM_GPA
CMDS = (qt.CMD_CHAN_ALLOC, qt.CMD_CHAN_FREE, qt.CMD_FENCE_WAIT, qt.CMD_TASK_WEIGHT)


class HostileDaemon(FakeDaemon):
    """The fake pvgpud, answering CHAN_ALLOC in random ways."""

    def __init__(self, path, rng):
        self.rng = rng
        super().__init__(path)

    def handle(self, conn, mtype, seq, body):
        try:
            self.handle_hostile(conn, mtype, seq, body)
        except OSError:
            pass             # QEMU dropped the connection first

    def handle_hostile(self, conn, mtype, seq, body):
        if mtype == qt.MSG_HELLO and self.rng.random() < 0.1:
            # refused, versions never offered, and a version-1 daemon
            status, version = self.rng.choice(((qt.E_STATE, 2), (0, 0), (0, 99), (0, 1)))
            self.send(qt.MSG_HELLO_REPLY, seq, struct.pack("<IIII", status, version, 1, 16), conn=conn)
            return
        if mtype == qt.MSG_CHAN_ALLOC:
            r = self.rng.random()
            if r < 0.01:
                self.send(qt.MSG_PONG, seq, b"", conn=conn)
                return
            if r < 0.02:     # OK without its fds
                self.send(qt.MSG_CHAN_REPLY, seq, struct.pack("<IIII", 0, 999, qt.CHAN_MEM_SIZE, 0),
                          conn=conn)
                return
            if r < 0.03:     # a size the device does not map
                self.send(qt.MSG_CHAN_REPLY, seq, struct.pack("<IIII", 0, 998, PAGE, 0), conn=conn)
                return
            self.refuse_alloc = r < 0.10
            self.seal = not (0.10 <= r < 0.12)
        super().handle(conn, mtype, seq, body)
        for chan, fd in self.memfds.items():
            os.ftruncate(fd, 0)      # unsealed memory is shrunk at once
            os.close(fd)
            del self.channels[chan]  # (our own mapping of it would fault now)
        self.memfds.clear()


class Fuzzer:
    def __init__(self, args, tmp):
        self.args = args
        self.rng = random.Random(args.seed)
        self.tmp = tmp
        sock = os.path.join(tmp, "fake.sock")
        self.fake = HostileDaemon(sock, random.Random(args.seed + 1))
        # `pc`: its bus 0 is hotpluggable, so unplug and re-plug are actions too.
        self.q = Qemu(args.qemu, tmp, sock, uuidlib.uuid4(), name="vm-fuzz", slots=SLOTS,
                      machine="pc", qmp=True)
        self.dev = Device(self.q)
        self.qmp = qt.Qmp(self.q.qmp_path)
        self.dev.wait_link()
        self.replugs = 0
        self.pause_steps = 0       # the daemon reads nothing for this many steps
        self.pauses = 0
        self.steps = 0
        self.reconnects = 0
        self.outcomes = set()      # (command, status)
        self.states = set()        # ("slot", state) ("mode", m) ("wait", w) ("irq", bit)

    # ---- guest actions
    def rand32(self):
        return self.rng.choice([0, 1, 2, 3, SLOTS, 0xFFFFFFFF, 0x80000000,
                                self.rng.getrandbits(32), self.rng.getrandbits(8)])

    def access(self, base, size_of_region):
        q, rng = self.q, self.rng
        off = rng.randrange(size_of_region + 64)      # a little past the end too
        size = rng.choice((1, 2, 4, 4, 4, 8))
        off -= off % size if rng.random() < 0.8 else 0
        addr = base + off
        if rng.random() < 0.5:
            q.cmd(f"read{'bwlq'[(1, 2, 4, 8).index(size)]} 0x{addr:x}")
        else:
            val = rng.getrandbits(8 * size)
            q.cmd(f"write{'bwlq'[(1, 2, 4, 8).index(size)]} 0x{addr:x} 0x{val:x}")

    def mailbox(self):
        dev, rng = self.dev, self.rng
        cmd = rng.choice(CMDS + (0, rng.getrandbits(32)))
        if rng.random() < 0.2:
            raw = bytes(rng.getrandbits(8) for _ in range(rng.randrange(40)))
            dev.set_task_name(raw[:qt.TASK_NAME_LEN])
        dev.start(cmd, self.rand32(), self.rand32(), self.rand32())
        st = dev.wait_command(cmd, 2)
        self.outcomes.add((cmd if cmd in CMDS else "other", st))

    def msix(self):
        dev, rng = self.dev, self.rng
        v = rng.randrange(3)
        if rng.random() < 0.5:
            dev.msix_enable(rng.random() < 0.7)
        else:
            self.q.writel(BAR1_GPA + 16 * v, MSG_RAM_GPA)
            self.q.writel(BAR1_GPA + 16 * v + 8, rng.getrandbits(32))
            self.q.writel(BAR1_GPA + 16 * v + 12, rng.getrandbits(1))   # mask bit

    def submit(self):
        """What a driver does: ring entries, IB_PUT, doorbell (any slot)."""
        dev, rng = self.dev, self.rng
        slot = rng.randrange(SLOTS)
        put = rng.getrandbits(8)
        if rng.random() < 0.7:
            dev.q.write(dev.ring(slot, put), struct.pack("<QII", rng.getrandbits(16), put + 1, 0))
        dev.q.writel(dev.ctrl(slot, qt.CTRL_IB_PUT), put + 1)
        if rng.random() < 0.8:
            dev.q.writel(dev.doorbell(slot), 1)
        if rng.random() < 0.3:
            dev.q.readl(dev.ctrl(slot, rng.choice((0, 4, 8, 12, 16, 20))))

    def register(self):
        """A read or write of a named register (random offsets rarely hit them)."""
        dev, rng = self.dev, self.rng
        off = rng.choice([qt.REG_MAGIC, qt.REG_VERSION, qt.REG_NUM_SLOTS, qt.REG_LINK,
                          qt.REG_CMD_STATUS, qt.REG_ARG0, qt.REG_ARG1, qt.REG_RESULT0,
                          qt.REG_RESULT1, qt.REG_IRQ_STATUS, qt.REG_IRQ_ACK, qt.REG_IRQ_MASK,
                          qt.REG_BAD_ACCESS, qt.REG_LINK_GEN, qt.REG_ARG2, qt.REG_FENCE_DONE_LO,
                          qt.REG_FENCE_DONE_HI, qt.REG_TASK_NAME + 4 * rng.randrange(8),
                          REG_SLOT_BASE + qt.REG_SLOT_STRIDE * rng.randrange(SLOTS) + 4 * rng.randrange(4),
                          REG_WAIT_BASE + qt.REG_WAIT_STRIDE * rng.randrange(SLOTS) + 4 * rng.randrange(4)])
        if rng.random() < 0.7:
            dev.reg(off)
        else:
            dev.set_reg(off, self.rand32())

    def replug(self):
        qt.unplug(self.q, self.qmp)
        self.qmp.execute("device_add", driver="pvgpu", chardev="pv", addr=f"{qt.PCI_DEV:02x}.0",
                         slots=SLOTS, id="pvgpu0")
        self.dev = Device(self.q)
        self.replugs += 1

    def reset(self):
        self.q.outb(0xCF9, 0x06)
        self.dev = Device(self.q)          # the reset cleared the BARs

    # ---- daemon actions
    def daemon(self):
        fake, rng = self.fake, self.rng
        freed = set(fake.frees)
        chans = [c for c in fake.channels if c not in freed]   # mostly live ones
        chan = rng.choice(chans) if chans and rng.random() < 0.9 else rng.getrandbits(32)
        try:
            if rng.random() < 0.01:
                self.daemon_stops_reading()
            elif rng.random() < 0.015:
                self.daemon_breaks_link(chan)
            elif rng.random() < 0.5:
                fake.send(qt.MSG_MODE, 0, struct.pack("<IIII", chan, rng.randrange(3),
                                                      rng.getrandbits(32), 0))
            elif rng.random() < 0.3:
                fake.send(qt.MSG_NOTICE, 0, struct.pack("<IIQ", rng.randrange(6), chan,
                                                        rng.getrandbits(64)))
            elif chan in fake.channels:
                # IB_PUT too: what a vCPU with a stale TLB stores behind a shadow
                off = rng.choice((qt.CTRL_IB_PUT, qt.CTRL_IB_GET, qt.CTRL_FENCE, qt.CTRL_STATUS,
                                  qt.CTRL_ERROR))
                fake.set_page(chan, off, self.rand32())
        except (TestFailure, OSError):
            pass              # no connection right now: the device is reconnecting

    def daemon_stops_reading(self):
        """The daemon reads nothing for a while, under a storm of stores
        (trapped ones are reported; the device's send queue fills)."""
        rng, fake = self.rng, self.fake
        if rng.random() < 0.7:            # mostly trapped channels: their stores are reported
            for chan in [c for c in fake.channels if c not in set(fake.frees)]:
                fake.send(qt.MSG_MODE, 0, struct.pack("<IIII", chan, qt.MODE_TRAPPED,
                                                      rng.getrandbits(32), 0))
        fake.paused = True
        self.pause_steps = rng.randrange(10, 200)
        self.pauses += 1
        stores = [(self.dev.ctrl(rng.randrange(SLOTS), qt.CTRL_IB_PUT), rng.getrandbits(8))
                  for _ in range(rng.randrange(100, 2000))]
        self.q.writel_many(stores)

    def daemon_breaks_link(self, chan):
        """What the device must answer by dropping the connection."""
        fake, rng = self.fake, self.rng
        r = rng.random()
        if r < 0.3:
            fake.send(qt.MSG_MODE, 0, struct.pack("<IIII", chan, rng.choice((3, rng.getrandbits(32))),
                                                  0, rng.getrandbits(1)))
        elif r < 0.55:
            mtype = rng.choice((qt.MSG_HELLO_REPLY, qt.MSG_CHAN_REPLY, qt.MSG_FREE_REPLY,
                                qt.MSG_PONG, qt.MSG_TASK_WEIGHT_REPLY))
            size = {qt.MSG_PONG: 0, qt.MSG_FREE_REPLY: 8, qt.MSG_TASK_WEIGHT_REPLY: 8}.get(mtype, 16)
            fake.send(mtype, rng.getrandbits(6), bytes(rng.getrandbits(8) for _ in range(size)))
        elif r < 0.8:
            hdr = HDR.pack(rng.choice((MAGIC, rng.getrandbits(32))), rng.getrandbits(16),
                           rng.getrandbits(1), rng.choice((0, 16, 4096, rng.getrandbits(32))),
                           rng.getrandbits(32))
            with fake.lock:
                if fake.conn:
                    fake.conn.sendall(hdr[:rng.randrange(1, len(hdr) + 1)])
        elif r < 0.85:
            with fake.lock:
                if fake.conn:
                    fake.conn.sendall(bytes(rng.getrandbits(8) for _ in range(rng.randrange(1, 64))))
        elif r < 0.9:
            fake.send(qt.MSG_ERROR, 0, struct.pack("<II", qt.E_INVALID, 0) + b"fuzz".ljust(120, b"\0"))
        elif r < 0.95:           # fds on a message that carries none
            efd = os.eventfd(0)
            try:
                fake.send(qt.MSG_MODE, 0, struct.pack("<IIII", chan, 0, 0, 0), fds=[efd])
            finally:
                os.close(efd)
        else:
            fake.drop()

    # ---- one step
    def step(self):
        r = self.rng.random()
        if self.pause_steps:
            self.pause_steps -= 1
            if not self.pause_steps:
                self.fake.paused = False
        if r < 0.25:
            if self.fake.paused:          # no reply can come: a store instead
                self.submit()
            else:
                self.mailbox()
        elif r < 0.30:
            self.access(BAR0_GPA, PAGE)
        elif r < 0.38:
            self.access(BAR2_GPA, SLOTS * BAR2_STRIDE)
        elif r < 0.42:
            self.access(BAR4_GPA, SLOTS * PAGE)
        elif r < 0.52:
            self.submit()
        elif r < 0.57:
            self.register()
        elif r < 0.60:
            self.msix()
        elif r < 0.604:
            self.reset()
        elif r < 0.606:
            self.replug()
        else:
            self.daemon()
        self.steps += 1
        if self.steps % 25 == 0:
            self.sample()
        # Most of the device is behind a ready link: mostly wait out the
        # chardev's reconnect (1 s) rather than fuzz a disconnected device.
        if self.dev.reg(REG_LINK) != qt.LINK_READY and self.rng.random() < 0.9:
            self.pause_steps = 0
            self.fake.paused = False
            self.reconnects += 1
            qt.wait_for(lambda: self.dev.reg(REG_LINK) == qt.LINK_READY, 5,
                        "the daemon link to come back", step=0.01)

    def sample(self):
        dev = self.dev
        check(dev.reg(REG_MAGIC) == qt.DEV_MAGIC, "MAGIC reads wrong")
        for i in range(SLOTS):
            self.states.add(("slot", dev.reg(REG_SLOT_BASE + qt.REG_SLOT_STRIDE * i + qt.SLOT_REG_STATE)))
            self.states.add(("mode", dev.reg(REG_SLOT_BASE + qt.REG_SLOT_STRIDE * i + qt.SLOT_REG_MODE)))
            self.states.add(("wait", dev.reg(REG_WAIT_BASE + qt.REG_WAIT_STRIDE * i + qt.WAIT_REG_STATUS)))
        irq = dev.reg(REG_IRQ_STATUS)
        for b in range(4):
            if irq >> b & 1:
                self.states.add(("irq", b))
        self.states.add(("link", dev.reg(REG_LINK)))
        dev.reg(REG_CMD)         # write-only: reads 0


def link_loss_reasons(stderr):
    return sorted(set(re.findall(r"connection to pvgpud lost \(([^)]*)\)", stderr)) |
                  set(re.findall(r"warning: pvgpu: (pvgpud sent [^;]*);", stderr)))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--qemu", required=True, help="qemu-system-x86_64 with the pvgpu device")
    ap.add_argument("--asan", action="store_true", help="PATH is the sanitizer build")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--steps", type=int, default=0, help="stop after N actions")
    ap.add_argument("--seconds", type=float, default=0, help="stop after S seconds")
    ap.add_argument("--stats", help="write executions and coverage as JSON here")
    args = ap.parse_args()
    if not args.steps and not args.seconds:
        args.steps = 2000
    cache_env = "PVGPU_QEMU_ASAN_DIR" if args.asan else "PVGPU_QEMU_DIR"
    if os.environ.get(cache_env):
        args.qemu = os.path.join(os.environ[cache_env], "qemu-system-x86_64")
    if not os.access(args.qemu, os.X_OK):
        print(f"SKIP: no QEMU build at {args.qemu} (run qemu-patches/build-qemu.sh"
              f"{' --asan' if args.asan else ''})")
        return 77
    os.environ.setdefault("ASAN_OPTIONS", "detect_leaks=0:abort_on_error=0:exitcode=99")
    os.environ.setdefault("UBSAN_OPTIONS", "halt_on_error=1:print_stacktrace=1")
    tmp = tempfile.mkdtemp(prefix="pvgpu-fuzz-")
    fz = None
    failure = None
    t0 = time.monotonic()
    try:
        fz = Fuzzer(args, tmp)
        while True:
            if args.steps and fz.steps >= args.steps:
                break
            if args.seconds and time.monotonic() - t0 >= args.seconds:
                break
            fz.step()
        fz.sample()
        for prop in ("tx-queued-max", "tx-coalesced"):     # of the device plugged now
            fz.states.add((prop, qt.qom(fz.qmp, prop)))
    except TestFailure as e:
        failure = str(e)
    finally:
        if fz:
            fz.qmp.close()
        rc = fz.q.close() if fz else None
        if fz:
            fz.fake.close()
    took = time.monotonic() - t0
    stderr = fz.q.read_stderr() if fz else ""
    try:
        qt.check_sanitizers(tmp)
    except TestFailure as e:
        failure = failure or str(e)
    if failure is None and rc not in (0, None):
        failure = f"QEMU exit status {rc}"
    steps = fz.steps if fz else 0
    stats = {
        "seed": args.seed, "steps": steps, "seconds": round(took, 1),
        "steps_per_s": round(steps / took, 1) if took else 0,
        "mailbox_outcomes": sorted(f"{c}:{s}" for c, s in fz.outcomes) if fz else [],
        "link_drops_and_refusals": link_loss_reasons(stderr),
        "states": sorted(f"{k}={v}" for k, v in fz.states) if fz else [],
        "daemon_connections": fz.fake.connections if fz else 0,
        "finding": failure,
    }
    print("RESULT fuzz.steps=%d" % steps)
    print("RESULT fuzz.steps_per_s=%s" % stats["steps_per_s"])
    print("RESULT fuzz.mailbox_outcomes=%d %s" % (len(stats["mailbox_outcomes"]),
                                                 " ".join(stats["mailbox_outcomes"])))
    print("RESULT fuzz.link_checks_hit=%d: %s" % (len(stats["link_drops_and_refusals"]),
                                                 "; ".join(stats["link_drops_and_refusals"])))
    print("RESULT fuzz.states=%s" % " ".join(stats["states"]))
    print("RESULT fuzz.daemon_connections=%d" % stats["daemon_connections"])
    stats["replugs"] = fz.replugs if fz else 0
    print("RESULT fuzz.replugs=%d" % stats["replugs"])
    stats["daemon_pauses"] = fz.pauses if fz else 0
    print("RESULT fuzz.daemon_pauses=%d" % stats["daemon_pauses"])
    if args.stats:
        with open(args.stats, "w") as f:
            json.dump(stats, f, indent=1)
    if failure:
        print(f"FAIL seed {args.seed} step {steps}: {failure}")
        print(f"# files kept in {tmp}")
        return 1
    shutil.rmtree(tmp, ignore_errors=True)
    log(f"{steps} steps in {took:.1f} s, no finding")
    print("PASS fuzz")
    return 0


if __name__ == "__main__":
    sys.exit(main())
