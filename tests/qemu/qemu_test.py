#!/usr/bin/env python3
"""Tests of the QEMU pvgpu device (qemu-patches/hw/misc/pvgpu.c) through qtest.

QEMU runs with `-accel qtest -qtest stdio`: no guest CPU executes, this
script plays the guest driver by reading and writing guest-physical memory
and I/O ports with the qtest protocol (readl/writel/outl/inl/write).  It
finds the device on PCI (config mechanism #1, ports 0xcf8/0xcfc), assigns
its BARs, and drives the mailbox, the control pages and the rings.

Cases:
  fake      a fake pvgpud in this script (full control of MODE pushes and of
            the connection): fd handoff, direct/trapped/shadowed mappings,
            ioeventfd doorbells, unshadowing, trap reports, daemon restart,
            malformed daemon messages, task names and task weights (device
            version 2), and the trapped vs direct cost.
  daemon    the real pvgpud: allocation, submission, fences, bad guest input,
            a BAD_ENTRY notice, channel limits, guest task weights and names
            in `pvgpuctl list`.
  modes     the real pvgpud with a competing host load so the scheduler
            switches the guest channel's mode while it submits: every
            submitted entry completes exactly once.
  restart   the real pvgpud restarted under the VM: channels are marked lost
            and re-allocated when the device reconnects.

  unplug    the real pvgpud: hot-unplug (pc machine, ACPI eject) gives the
            channels, the VM and the connection back; re-plug is a new VM.
  hardening a fake pvgpud: another device's DMA into BAR2 outliving CHAN_FREE
            (run against the ASan build it catches a use-after-free), an
            IB_PUT store behind the shadow's back, a PONG answering CHAN_ALLOC, channel memory not sealed against
            shrinking, a doorbell fd that is not an eventfd, a send failing while a daemon message is processed,
            a daemon that clears O_NONBLOCK on the doorbell eventfd and fills its counter.

usage: qemu_test.py --qemu PATH [--asan] --pvgpud PATH --pvgpuctl PATH [--load PATH] CASE|all
--asan: PATH is the sanitizer build (qemu-patches/build-qemu.sh --asan); a
sanitizer report in QEMU's stderr fails the case.  PVGPU_QEMU_DIR (or, with
--asan, PVGPU_QEMU_ASAN_DIR) overrides the directory of PATH.
Exit status 77 (skip) when the QEMU binary does not exist.
"""

import argparse
import contextlib
import fcntl
import json
import mmap
import os
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import uuid as uuidlib

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from testlib import (Qmp, Skip, TestFailure, c_defines, check, log, result, stop_process,  # noqa: E402
                     wait_for)

# ---- ABI (include/pvgpu/abi.h, protocol.h) and the device (docs/pvgpu-device.md)

PAGE = 4096
RING_ENTRIES = 256
CHAN_MEM_SIZE = 2 * PAGE
CTRL_IB_PUT, CTRL_IB_GET, CTRL_FENCE, CTRL_STATUS, CTRL_ERROR = 0x0, 0x4, 0x8, 0xC, 0x10
MODE_DIRECT, MODE_TRAPPED, MODE_SHADOWED = 0, 1, 2
MODE_NAMES = {0: "direct", 1: "trapped", 2: "shadowed"}

MAGIC = 0x55504750
HDR = struct.Struct("<IHHII")
MSG_HELLO, MSG_CHAN_ALLOC, MSG_CHAN_FREE, MSG_MODE_ACK, MSG_TRAP_REPORT, MSG_PING = 1, 2, 3, 4, 5, 6
MSG_TASK_WEIGHT = 7
MSG_HELLO_REPLY, MSG_CHAN_REPLY, MSG_FREE_REPLY, MSG_MODE, MSG_NOTICE, MSG_ERROR, MSG_PONG = (
    64, 65, 66, 67, 68, 69, 70)
MSG_TASK_WEIGHT_REPLY = 71
PROTO_VERSION = 5  # the device's PVGPU_DEVICE_PROTO_VERSION (5: migration)
E_OK, E_VERSION, E_INVALID, E_STATE, E_LIMIT = 0, 1, 2, 3, 4
E_INTERNAL = 6
WEIGHT_MAX = 10000

# The device's registers, fields, commands and states: every integer #define
# of include/pvgpu/regs.h, without its PVGPU_ prefix (REG_MAGIC,
# SLOT_REG_STATE, CMDST_OK, IRQ_ALL, WAITST_OK, BAR2_STRIDE, ...).
REPO = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
globals().update(c_defines(os.path.join(REPO, "include", "pvgpu", "regs.h")))

CHAN_ERR_WATCHDOG, CHAN_ERR_BAD_ENTRY = 1, 2
PCI_CAP_ID_MSI, PCI_CAP_ID_MSIX = 0x05, 0x11
MSG_RAM_GPA = 0x100000  # MSI-X messages are pointed at guest RAM and read back
CHAN_ERR_LOST = 0x80

BAR0_GPA, BAR1_GPA, BAR2_GPA, BAR4_GPA = 0xE0000000, 0xE0001000, 0xE0100000, 0xE0400000
PCI_DEV = 4  # -device pvgpu,addr=04.0


# ---- QEMU under qtest ------------------------------------------------------------


class Qemu:
    def __init__(self, binary, workdir, chardev_path, vm_uuid, name="vm-qt", slots=16,
                 machine="q35", extra_args=(), qmp=False, device_props=""):
        self.workdir = workdir
        bios = os.path.join(workdir, "bios.bin")
        if not os.path.exists(bios):
            # qtest never executes guest code; the machine only needs a ROM image.
            with open(bios, "wb") as f:
                f.write(b"\xf4" * 65536)
        self.stderr_path = os.path.join(workdir, f"qemu-{name}.log")
        self.stderr = open(self.stderr_path, "w")
        args = [binary, "-machine", machine, "-accel", "qtest", "-qtest", "stdio",
                "-qtest-log", "/dev/null", "-display", "none", "-nodefaults", "-m", "64",
                "-bios", bios, "-uuid", str(vm_uuid), "-name", name,
                "-chardev", f"socket,id=pv,path={chardev_path},reconnect=1",
                "-device", pvgpu_device_arg(slots) + device_props] + list(extra_args)
        self.qmp_path = os.path.join(workdir, f"qmp-{name}.sock") if qmp else None
        if qmp:
            args += ["-qmp", f"unix:{self.qmp_path},server=on,wait=off"]
        log("qemu: " + " ".join(args))
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.stderr, bufsize=0)
        self.buf = b""

    def cmd(self, line, timeout=10.0):
        self.proc.stdin.write(line.encode() + b"\n")
        return self.reply(f"qtest '{line}'", timeout)

    def reply(self, what, timeout):
        """The next reply that is not an IRQ line, without its "OK"."""
        while True:
            nl = self.buf.find(b"\n")
            if nl >= 0:
                reply, self.buf = self.buf[:nl].decode(), self.buf[nl + 1:]
                if reply.startswith("IRQ"):
                    continue
                if not reply.startswith("OK"):
                    raise TestFailure(f"{what}: {reply}")
                return reply[3:]
            r, _, _ = select.select([self.proc.stdout], [], [], timeout)
            if not r:
                raise TestFailure(f"{what}: no reply within {timeout} s (QEMU hung?)")
            chunk = os.read(self.proc.stdout.fileno(), 65536)
            if not chunk:
                raise TestFailure(f"{what}: QEMU exited ({self.proc.poll()}); "
                                  f"stderr: {self.read_stderr()[-2000:]}")
            self.buf += chunk

    def readl(self, addr):
        return int(self.cmd(f"readl 0x{addr:x}"), 16)

    def writel_many(self, writes, chunk=256, timeout=10.0):
        """Pipelined writel of (addr, val) pairs, `chunk` lines in flight
        (well under the stdin pipe's 64 KiB: a QEMU that stops answering
        fails the reply wait, it cannot block the write)."""
        for i in range(0, len(writes), chunk):
            part = writes[i:i + chunk]
            self.proc.stdin.write(b"".join(f"writel 0x{a:x} 0x{v & 0xffffffff:x}\n".encode()
                                           for a, v in part))
            for k in range(len(part)):
                self.reply(f"qtest: write {i + k} of {len(writes)} (pipelined)", timeout)

    def writel(self, addr, val):
        self.cmd(f"writel 0x{addr:x} 0x{val & 0xffffffff:x}")

    def readb(self, addr):
        return int(self.cmd(f"readb 0x{addr:x}"), 16)

    def writeb(self, addr, val):
        self.cmd(f"writeb 0x{addr:x} 0x{val:x}")

    def writew(self, addr, val):
        self.cmd(f"writew 0x{addr:x} 0x{val:x}")

    def writeq(self, addr, val):
        self.cmd(f"writeq 0x{addr:x} 0x{val:x}")

    def write(self, addr, data):
        self.cmd(f"write 0x{addr:x} {len(data)} 0x{data.hex()}")

    def outl(self, port, val):
        self.cmd(f"outl 0x{port:x} 0x{val:x}")

    def outb(self, port, val):
        self.cmd(f"outb 0x{port:x} 0x{val:x}")

    def inl(self, port):
        return int(self.cmd(f"inl 0x{port:x}"), 16)

    def alive(self):
        return self.proc.poll() is None

    def read_stderr(self):
        if not self.stderr.closed:
            self.stderr.flush()
        with open(self.stderr_path) as f:
            return f.read()

    def close(self):
        # qtest does not end QEMU on EOF; SIGTERM is a clean shutdown (exit 0).
        stop_process(self.proc)
        self.stderr.close()
        return self.proc.returncode

    def shut_down(self, qmp, stop_peer, tail=20):
        """A case's end: its QMP, QEMU, then what QEMU talked to (stop_peer);
        the last `tail` lines QEMU wrote to stderr are logged.  QEMU's exit
        status."""
        if qmp:
            qmp.close()
        rc = self.close()
        stop_peer()
        err = self.read_stderr() if os.path.exists(self.stderr_path) else ""
        if err.strip():
            log("qemu stderr:\n" + "\n".join("#   " + l for l in err.splitlines()[-tail:]))
        return rc


def pvgpu_device_arg(slots):
    return f"pvgpu,chardev=pv,addr={PCI_DEV:02x}.0,slots={slots},id=pvgpu0"


class Device:
    """The guest driver's view: PCI discovery, BARs, mailbox, slots."""

    def __init__(self, q):
        self.q = q
        self.bdf = None
        for dev in range(32):
            if self.cfg_read(dev, 0) == (PCI_DEVICE_ID << 16 | PCI_VENDOR_ID):
                self.bdf = dev
                break
        check(self.bdf == PCI_DEV, f"pvgpu not found on bus 0 (found at {self.bdf})")
        self.sizes = {}
        for bar, gpa in ((0, BAR0_GPA), (1, BAR1_GPA), (2, BAR2_GPA), (4, BAR4_GPA)):
            off = 0x10 + 4 * bar
            self.cfg_write(off, 0xFFFFFFFF)
            mask = self.cfg_read(self.bdf, off)
            self.sizes[bar] = (~(mask & ~0xF) & 0xFFFFFFFF) + 1
            self.cfg_write(off, gpa)
        self.cfg_write(0x04, 0x0006)  # memory space + bus master
        self.slots = self.reg(REG_NUM_SLOTS)

    def cfg_addr(self, dev, off):
        return 0x80000000 | (dev << 11) | (off & 0xFC)

    def cfg_read(self, dev, off):
        self.q.outl(0xCF8, self.cfg_addr(dev, off))
        return self.q.inl(0xCFC)

    def cfg_write(self, off, val):
        self.q.outl(0xCF8, self.cfg_addr(self.bdf, off))
        self.q.outl(0xCFC, val)

    def find_cap(self, cap_id):
        if not (self.cfg_read(self.bdf, 0x04) >> 16) & 0x10:   # status: capability list
            return None
        ptr, seen = self.cfg_read(self.bdf, 0x34) & 0xFC, 0
        while ptr and seen < 48:
            v = self.cfg_read(self.bdf, ptr)
            if v & 0xFF == cap_id:
                return ptr
            ptr, seen = (v >> 8) & 0xFC, seen + 1
        return None

    def msix_info(self):
        cap = self.find_cap(PCI_CAP_ID_MSIX)
        check(cap, "no MSI-X capability")
        ctrl = self.cfg_read(self.bdf, cap) >> 16
        table, pba = self.cfg_read(self.bdf, cap + 4), self.cfg_read(self.bdf, cap + 8)
        return {"cap": cap, "vectors": (ctrl & 0x7FF) + 1, "table_bir": table & 7,
                "table_off": table & ~7, "pba_bir": pba & 7, "pba_off": pba & ~7}

    def msix_enable(self, on):
        cap = self.find_cap(PCI_CAP_ID_MSIX)
        v = self.cfg_read(self.bdf, cap) & ~(3 << 30)   # enable off, function mask off
        self.cfg_write(cap, v | ((1 << 31) if on else 0))

    def msix_entry(self, vector, off=0):
        return BAR1_GPA + self.msix_info()["table_off"] + 16 * vector + off

    def msix_pba(self):
        return self.q.readl(BAR1_GPA + self.msix_info()["pba_off"])

    def intx(self):
        """The PCI status register's interrupt bit: INTx asserted by the device."""
        return bool((self.cfg_read(self.bdf, 0x04) >> 16) & 0x08)

    def wait_reg(self, slot, off):
        return self.reg(REG_WAIT_BASE + REG_WAIT_STRIDE * slot + off)

    def fence_wait(self, slot, fence):
        """FENCE_WAIT: returns (CMD_STATUS, WAIT_STATUS as RESULT1)."""
        st, r0, r1 = self.command(CMD_FENCE_WAIT, slot, fence & 0xFFFFFFFF)
        if st == CMDST_OK:
            check(r0 == slot, f"FENCE_WAIT RESULT0 {r0} != slot {slot}")
            check(r1 == self.wait_reg(slot, WAIT_REG_STATUS), "RESULT1 is not WAIT_STATUS")
        return st, r1

    def fence_done(self):
        return self.reg(REG_FENCE_DONE_LO) | self.reg(REG_FENCE_DONE_HI) << 32

    def wait_ended(self, slot, timeout, what):
        wait_for(lambda: self.wait_reg(slot, WAIT_REG_STATUS) != WAITST_ARMED, timeout, what, step=0.001)
        return self.wait_reg(slot, WAIT_REG_STATUS)

    def reg(self, off):
        return self.q.readl(BAR0_GPA + off)

    def set_reg(self, off, val):
        self.q.writel(BAR0_GPA + off, val)

    def slot_reg(self, slot, off):
        return self.reg(REG_SLOT_BASE + REG_SLOT_STRIDE * slot + off)

    def ctrl(self, slot, off=0):
        return BAR2_GPA + slot * BAR2_STRIDE + off

    def doorbell(self, slot):
        return BAR2_GPA + slot * BAR2_STRIDE + BAR2_DOORBELL

    def ring(self, slot, index=0):
        return BAR4_GPA + slot * BAR4_STRIDE + (index % RING_ENTRIES) * 16

    def wait_link(self, timeout=10):
        wait_for(lambda: self.reg(REG_LINK) == LINK_READY, timeout, "the device's daemon link")

    def start(self, cmd, arg0=0, arg1=0, arg2=None):
        """Writes the arguments and CMD; returns CMD_STATUS right after."""
        self.set_reg(REG_ARG0, arg0)
        self.set_reg(REG_ARG1, arg1)
        if arg2 is not None:
            self.set_reg(REG_ARG2, arg2)
        self.set_reg(REG_IRQ_ACK, IRQ_CMD_DONE)
        self.set_reg(REG_CMD, cmd)
        return self.reg(REG_CMD_STATUS)

    def wait_command(self, cmd, timeout):
        """CMD_STATUS once it leaves BUSY (`cmd` names the command in errors)."""
        deadline = time.monotonic() + timeout
        while True:
            st = self.reg(REG_CMD_STATUS)
            if st != CMDST_BUSY:
                return st
            if time.monotonic() > deadline:
                raise TestFailure(f"mailbox command {cmd:#x} still busy after {timeout} s")
            time.sleep(0.0005)

    def command(self, cmd, arg0=0, arg1=0, timeout=10, arg2=None):
        self.start(cmd, arg0, arg1, arg2)
        st = self.wait_command(cmd, timeout)
        if st == CMDST_OK:
            check(self.reg(REG_IRQ_STATUS) & IRQ_CMD_DONE, "CMD_DONE interrupt status not set")
        return st, self.reg(REG_RESULT0), self.reg(REG_RESULT1)

    def set_task_name(self, raw):
        """TASK_NAME as the driver writes it: 32 bytes, eight 32-bit stores."""
        raw = raw.ljust(TASK_NAME_LEN, b"\0")
        for k in range(TASK_NAME_LEN // 4):
            self.set_reg(REG_TASK_NAME + 4 * k, struct.unpack_from("<I", raw, 4 * k)[0])

    def task_name(self):
        return b"".join(struct.pack("<I", self.reg(REG_TASK_NAME + 4 * k))
                        for k in range(TASK_NAME_LEN // 4))

    def task_weight(self, pid_hint, weight):
        """TASK_WEIGHT: returns (CMD_STATUS, RESULT0, RESULT1)."""
        return self.command(CMD_TASK_WEIGHT, pid_hint & 0xFFFFFFFF, pid_hint >> 32, arg2=weight)

    def alloc(self, pid_hint=0):
        st, slot, chan = self.command(CMD_CHAN_ALLOC, pid_hint & 0xFFFFFFFF, pid_hint >> 32)
        check(st == CMDST_OK, f"CHAN_ALLOC failed: status {st} result1 {chan}")
        check(self.slot_reg(slot, SLOT_REG_STATE) == SLOT_LIVE, f"slot {slot} not live after alloc")
        check(self.slot_reg(slot, SLOT_REG_CHAN_ID) == chan, "slot chan id differs from RESULT1")
        return slot, chan

    def free(self, slot):
        st, _, _ = self.command(CMD_CHAN_FREE, slot)
        check(st == CMDST_OK, f"CHAN_FREE({slot}) failed: status {st}")

    def submit(self, slot, put, count, kernel_ns, fence_base=None):
        """Write `count` entries starting at ring index `put`, then IB_PUT and the doorbell.
        Entry i carries fence put+i+1.  Returns the new put."""
        data = b""
        for i in range(count):
            data += struct.pack("<QII", kernel_ns, put + i + 1, 0)
        # The ring may wrap inside the batch: split at the end of the page.
        first = min(count, RING_ENTRIES - (put % RING_ENTRIES))
        self.q.write(self.ring(slot, put), data[:16 * first])
        if first < count:
            self.q.write(self.ring(slot, 0), data[16 * first:])
        put = (put + count) & 0xFFFFFFFF
        self.q.writel(self.ctrl(slot, CTRL_IB_PUT), put)
        self.q.writel(self.doorbell(slot), 1)
        return put


# ---- a fake pvgpud -------------------------------------------------------------------


class FakeDaemon:
    """Speaks the daemon side of the client protocol to one VMM at a time."""

    def __init__(self, path):
        self.path = path
        self.lsock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.lsock.bind(path)
        self.lsock.listen(4)
        self.lock = threading.Lock()
        self.conn = None
        self.hellos = []
        self.channels = {}   # chan_id -> {"mem": mmap, "bell": fd, "reports": [], "acks": []}
        self.acks = []
        self.reports = []
        self.frees = []
        self.next_chan = 100
        self.stop = False
        self.connections = 0
        self.refuse_alloc = False
        self.version = PROTO_VERSION   # what HELLO_REPLY agrees on at most
        self.hold_hello = False        # leave HELLOs unanswered (LINK stays HELLO)
        self.held_hellos = []          # (conn, seq, version) of unanswered HELLOs
        self.refuse_hello = None       # a message: ERROR (seq 0) with it, HELLO_REPLY E_INVALID
        self.task_weights = []         # (seq, pid_hint, weight, reserved) received
        self.task_weight_status = E_OK
        self.hold_task_weight = False  # never answer TASK_WEIGHT
        self.seal = True               # seal channel memfds like pvgpud (F_SEAL_SHRINK)
        self.bell_pipe = False         # send a pipe, not an eventfd, as the doorbell
        self.pong_alloc = False        # answer CHAN_ALLOC with a PONG of its seq
        self.eofs = 0                  # connections the VMM closed
        self.memfds = {}               # chan -> memfd kept open (when not sealed)
        self.paused = False   # stop reading (timing runs: keep Python off the CPU)
        self.not_reading = threading.Event()   # set by serve() once paused takes hold
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def serve(self):
        while not self.stop:
            with self.lock:
                conn = self.conn
            socks = [self.lsock] + ([conn] if conn and not self.paused else [])
            if self.paused:
                self.not_reading.set()
            r, _, _ = select.select(socks, [], [], 0.05)
            if self.lsock in r:
                c, _ = self.lsock.accept()
                with self.lock:
                    if self.conn:
                        self.conn.close()
                    self.conn = c
                    self.buf = b""
                    self.connections += 1
                continue
            if conn and conn in r:
                try:
                    data = conn.recv(65536)
                except OSError:
                    data = b""
                if not data:
                    with self.lock:
                        mine = self.conn is conn   # else a test took it over
                        if mine:
                            self.conn = None
                            self.eofs += 1
                    if mine:
                        conn.close()
                    continue
                self.buf += data
                while len(self.buf) >= 16:
                    magic, mtype, flags, ln, seq = HDR.unpack_from(self.buf)
                    if len(self.buf) < 16 + ln:
                        break
                    body, self.buf = self.buf[16:16 + ln], self.buf[16 + ln:]
                    self.handle(conn, mtype, seq, body)

    def send(self, mtype, seq, body, fds=None, conn=None):
        msg = HDR.pack(MAGIC, mtype, 0, len(body), seq) + body
        with self.lock:
            c = conn or self.conn
            if c is None:
                raise TestFailure("fake daemon: no connection")
            if fds:
                socket.send_fds(c, [msg], fds)
            else:
                c.sendall(msg)

    def handle(self, conn, mtype, seq, body):
        if mtype == MSG_HELLO:
            version, role = struct.unpack_from("<II", body)
            uuid = bytes(body[8:24])
            name = body[24:88].split(b"\0")[0].decode()
            gpu = struct.unpack_from("<I", body, 92)[0]
            self.hellos.append((version, role, uuid, name, gpu))
            if self.refuse_hello:
                # As pvgpud refuses a GPU it lacks: why, then the reply, then
                # the end of what it sends (a half-close: a full close would
                # hang up before QEMU's socket chardev read the ERROR, which
                # it drops on G_IO_HUP), and the VMM closes.
                self.send(MSG_ERROR, 0, struct.pack("<II120s", E_INVALID, 0, self.refuse_hello.encode()),
                          conn=conn)
                with contextlib.suppress(OSError):   # the device may have hung up already
                    self.send(MSG_HELLO_REPLY, seq, struct.pack("<IIII", E_INVALID, PROTO_VERSION, 1, 16),
                              conn=conn)
                    conn.shutdown(socket.SHUT_WR)
                return
            if self.hold_hello:
                self.held_hellos.append((conn, seq, version))
                return
            self.answer_hello(conn, seq, version)
        elif mtype == MSG_TASK_WEIGHT:
            hint, weight, reserved = struct.unpack("<QII", body)
            self.task_weights.append((seq, hint, weight, reserved))
            if not self.hold_task_weight:
                self.send(MSG_TASK_WEIGHT_REPLY, seq, struct.pack("<II", self.task_weight_status, 0),
                          conn=conn)
        elif mtype == MSG_CHAN_ALLOC:
            pid_hint = struct.unpack_from("<Q", body)[0]
            task_name = bytes(body[8:40])
            if self.pong_alloc:
                self.send(MSG_PONG, seq, b"", conn=conn)
                return
            if self.refuse_alloc:
                self.send(MSG_CHAN_REPLY, seq, struct.pack("<IIII", E_LIMIT, 0, 0, 0), conn=conn)
                return
            chan = self.next_chan
            self.next_chan += 1
            mfd = os.memfd_create(f"fake-chan{chan}", os.MFD_ALLOW_SEALING)
            os.ftruncate(mfd, CHAN_MEM_SIZE)
            if self.seal:
                fcntl.fcntl(mfd, fcntl.F_ADD_SEALS,
                            fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            else:
                self.memfds[chan] = os.dup(mfd)
            if self.bell_pipe:
                efd, wfd = os.pipe()
                os.close(wfd)
            else:
                efd = os.eventfd(0, os.EFD_NONBLOCK)
            mem = mmap.mmap(mfd, CHAN_MEM_SIZE)
            self.channels[chan] = {"mem": mem, "bell": efd, "pid_hint": pid_hint,
                                   "task_name": task_name}
            self.send(MSG_CHAN_REPLY, seq, struct.pack("<IIII", 0, chan, CHAN_MEM_SIZE, 0),
                      fds=[mfd, efd], conn=conn)
            os.close(mfd)
        elif mtype == MSG_CHAN_FREE:
            chan = struct.unpack_from("<I", body)[0]
            self.frees.append(chan)
            st = 0 if chan in self.channels else 5
            self.send(MSG_FREE_REPLY, seq, struct.pack("<II", st, chan), conn=conn)
        elif mtype == MSG_MODE_ACK:
            self.acks.append(struct.unpack("<IIII", body))
        elif mtype == MSG_TRAP_REPORT:
            self.reports.append(struct.unpack("<II", body))
        elif mtype == MSG_PING:
            self.send(MSG_PONG, seq, b"", conn=conn)

    def answer_hello(self, conn, seq, version):
        self.send(MSG_HELLO_REPLY, seq, struct.pack("<IIII", 0, min(version, self.version), 1, 16),
                  conn=conn)

    def release_hellos(self):
        held, self.held_hellos = self.held_hellos, []
        for conn, seq, version in held:
            self.answer_hello(conn, seq, version)

    def page(self, chan, off):
        return struct.unpack_from("<I", self.channels[chan]["mem"], off)[0]

    def set_page(self, chan, off, val):
        struct.pack_into("<I", self.channels[chan]["mem"], off, val)

    def bells(self, chan):
        fd = self.channels[chan]["bell"]
        if not select.select([fd], [], [], 0)[0]:
            return 0
        try:
            return struct.unpack("<Q", os.read(fd, 8))[0]
        except BlockingIOError:
            return 0

    def wait_bells(self, chan, at_least=1, timeout=5):
        """Doorbells of `chan` read until there are `at_least` (the device
        rings from its relay thread, asynchronously); returns how many."""
        got = [0]

        def enough():
            got[0] += self.bells(chan)
            return got[0] >= at_least
        wait_for(enough, timeout, f"{at_least} doorbell(s) of channel {chan}")
        return got[0]

    def push_mode(self, chan, mode, seq):
        n = len(self.acks)
        self.send(MSG_MODE, 0, struct.pack("<IIII", chan, mode, seq, 0))
        return n

    def pause(self):
        """Stop reading the VMM's socket; returns once serve() no longer reads."""
        self.not_reading.clear()
        self.paused = True
        if not self.not_reading.wait(5):
            raise TestFailure("fake daemon: did not pause")

    def drop(self):
        with self.lock:
            if self.conn:
                self.conn.shutdown(socket.SHUT_RDWR)
                self.conn.close()
                self.conn = None

    def close(self):
        self.stop = True
        self.thread.join()
        self.drop()
        self.lsock.close()


# ---- real pvgpud ------------------------------------------------------------------------


class Pvgpud:
    def __init__(self, bins, workdir, config_text=""):
        self.bins = bins
        self.socket = os.path.join(workdir, "pvgpud.sock")
        self.admin = os.path.join(workdir, "admin.sock")
        self.state = os.path.join(workdir, "state")
        self.config = os.path.join(workdir, "pvgpud.conf")
        with open(self.config, "w") as f:
            # Hermetic: the host's libvirt (if any) is not followed.
            f.write((config_text or "# defaults\n") + "\n[libvirt]\nuri = none\n")
        self.proc = None
        self.lines = []

    def start(self, timeout=10):
        self.proc = subprocess.Popen(
            [self.bins.pvgpud, "--config", self.config, "--socket", self.socket,
             "--admin-socket", self.admin, "--state-dir", self.state, "--admin-group", ""],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        ready = threading.Event()
        proc, lines = self.proc, self.lines

        def reader():
            for line in proc.stderr:
                lines.append(line.rstrip())
                if "pvgpud: ready" in line:
                    ready.set()
            ready.set()

        threading.Thread(target=reader, daemon=True).start()
        if not ready.wait(timeout) or proc.poll() is not None:
            raise TestFailure("pvgpud did not start: " + "\n".join(self.lines[-20:]))

    def ctl(self, *args):
        p = subprocess.run([self.bins.pvgpuctl, "--admin-socket", self.admin, "--json"] + list(args),
                           capture_output=True, text=True, timeout=10)
        if p.returncode != 0:
            raise TestFailure(f"pvgpuctl {args}: {p.returncode} {p.stderr}")
        return json.loads(p.stdout)

    def alive(self):
        return self.proc and self.proc.poll() is None

    def stop(self, sig=signal.SIGTERM):
        return stop_process(self.proc, sig) if self.proc else None


# ---- cases ---------------------------------------------------------------------------------


def probe(dev, slots):
    q = dev.q
    check(dev.reg(REG_MAGIC) == DEV_MAGIC, f"MAGIC {dev.reg(REG_MAGIC):#x}")
    check(dev.reg(REG_VERSION) == DEV_VERSION, f"VERSION {dev.reg(REG_VERSION)}")
    check((dev.cfg_read(dev.bdf, 0x08) & 0xFF) == DEV_VERSION, "PCI revision is not VERSION")
    check(dev.reg(REG_ARG2) == 0, "ARG2 not 0 at reset")
    check(dev.task_name() == bytes(TASK_NAME_LEN), "TASK_NAME not 0 at reset")
    check(dev.slots == slots, f"NUM_SLOTS {dev.slots}")
    # qtest has no KVM: trapped mode is the MMIO path (kernel-wn=auto).
    check(dev.reg(REG_FEATURES) == 0, f"FEATURES {dev.reg(REG_FEATURES):#x} without KVM")
    bad = dev.reg(REG_BAD_ACCESS)
    dev.set_reg(REG_FEATURES, FEATURE_KERNEL_WN)
    check(dev.reg(REG_FEATURES) == 0 and dev.reg(REG_BAD_ACCESS) == bad + 1,
          "FEATURES is read-only: a store must be dropped and counted")
    check(dev.sizes[0] == BAR0_SIZE, f"BAR0 size {dev.sizes[0]:#x}")
    check(dev.sizes[2] == slots * BAR2_STRIDE, f"BAR2 size {dev.sizes[2]:#x}")
    check(dev.sizes[4] == slots * BAR4_STRIDE, f"BAR4 size {dev.sizes[4]:#x}")
    check(dev.sizes[1] == PAGE, f"BAR1 (MSI-X) size {dev.sizes[1]:#x}")
    check((dev.cfg_read(dev.bdf, 0x3C) >> 8) & 0xFF == 1, "interrupt pin is not INTA")
    mx = dev.msix_info()
    check(mx == {"cap": mx["cap"], "vectors": MSIX_VECTORS, "table_bir": BAR_MSIX, "table_off": 0,
                 "pba_bir": BAR_MSIX, "pba_off": 0x800}, f"MSI-X capability {mx}")
    check(dev.find_cap(PCI_CAP_ID_MSI) is None, "plain MSI capability still present")
    result("msix.capability", json.dumps(mx))
    log(f"device at 00:{dev.bdf:02x}.0, {slots} slots, BAR sizes "
        f"{dev.sizes[0]:#x}/{dev.sizes[2]:#x}/{dev.sizes[4]:#x}")


def time_writes(q, addr, n, value_of):
    t0 = time.perf_counter()
    for i in range(n):
        q.writel(addr, value_of(i))
    return (time.perf_counter() - t0) / n * 1e6


def case_fake(bins, tmp):
    sock = os.path.join(tmp, "fake.sock")
    fake = FakeDaemon(sock)
    vm_uuid = uuidlib.uuid4()
    q = Qemu(bins.qemu, tmp, sock, vm_uuid, name="vm-fake", slots=4, qmp=True)
    qmp = None
    try:
        dev = Device(q)
        qmp = Qmp(q.qmp_path)
        probe(dev, 4)
        dev.wait_link()
        check(fake.hellos and fake.hellos[0][1] == 1, f"HELLO {fake.hellos}")
        check(fake.hellos[0][0] == PROTO_VERSION, f"HELLO offers version {fake.hellos[0][0]}")
        check(fake.hellos[0][2] == vm_uuid.bytes, "HELLO carries a different UUID")
        check(fake.hellos[0][3] == "vm-fake", f"HELLO name {fake.hellos[0][3]!r}")
        check(fake.hellos[0][4] == 0, f"HELLO gpu {fake.hellos[0][4]} without the property (want 0: any)")

        check_slots_limit(bins, tmp, sock, vm_uuid)
        check_gpu_property(bins, tmp, vm_uuid)

        slot, chan = dev.alloc(pid_hint=0x1_0000_0042)
        check(fake.channels[chan]["pid_hint"] == 0x1_0000_0042, "pid hint lost on the way")
        log(f"slot {slot} = channel {chan}")

        # DIRECT: the control page and the ring are the daemon's memfd.
        fake.set_page(chan, CTRL_FENCE, 77)
        check(q.readl(dev.ctrl(slot, CTRL_FENCE)) == 77, "direct: FENCE not the daemon's page")
        kicks = qom(qmp, "doorbell-kicks")
        dev.submit(slot, 0, 3, 1000)
        check(fake.page(chan, CTRL_IB_PUT) == 3, "direct: IB_PUT did not reach the page")
        entry = struct.unpack_from("<QII", fake.channels[chan]["mem"], PAGE + 16)
        check(entry == (1000, 2, 0), f"ring entry 1 in the memfd: {entry}")
        # Without KVM the device's handler takes the doorbell store (no
        # ioeventfd) and its relay thread rings the eventfd.
        check(qom(qmp, "doorbell-kicks") == kicks + 1, "direct: the doorbell store asked no ring")
        check(fake.wait_bells(chan) == 1, "direct: the doorbell write did not signal the eventfd")
        check(not fake.reports, "direct: a TRAP_REPORT was sent")

        # TRAPPED: every IB_PUT store is forwarded, reported and rung.
        n = fake.push_mode(chan, MODE_TRAPPED, 1)
        wait_for(lambda: len(fake.acks) > n, 5, "the TRAPPED ack")
        check(fake.acks[-1] == (chan, MODE_TRAPPED, 1, 3), f"TRAPPED ack {fake.acks[-1]}")
        check(dev.slot_reg(slot, SLOT_REG_MODE) == MODE_TRAPPED, "SLOT_MODE not trapped")
        fake.bells(chan)
        kicks = qom(qmp, "doorbell-kicks")
        for put in (4, 5, 6):
            q.writel(dev.ctrl(slot, CTRL_IB_PUT), put)
        wait_for(lambda: len(fake.reports) >= 3, 5, "three TRAP_REPORTs")
        check(fake.reports == [(chan, 4), (chan, 5), (chan, 6)], f"reports {fake.reports}")
        check(fake.page(chan, CTRL_IB_PUT) == 6, "trapped: IB_PUT not forwarded")
        check(qom(qmp, "doorbell-kicks") == kicks + 3, "trapped: each forwarded write must ring once")
        # Rings queued for one channel may reach the eventfd as one.
        check(1 <= fake.wait_bells(chan) <= 3, "trapped: the forwarded writes did not ring")
        check(q.readl(dev.ctrl(slot, CTRL_FENCE)) == 77, "trapped: reads must show the real page")
        bad = dev.reg(REG_BAD_ACCESS)
        q.writel(dev.ctrl(slot, CTRL_FENCE), 5)        # GPU-owned field
        q.writeb(dev.ctrl(slot, CTRL_IB_PUT), 9)       # wrong size
        check(fake.page(chan, CTRL_FENCE) == 77 and fake.page(chan, CTRL_IB_PUT) == 6,
              "trapped: a bad store reached the page")
        check(dev.reg(REG_BAD_ACCESS) == bad + 2, "trapped: bad stores not counted")

        # SHADOWED: stores are held in a private page; the GPU sees nothing,
        # the daemon is told what is held (a TRAP_REPORT of the shadow's IB_PUT).
        n = fake.push_mode(chan, MODE_SHADOWED, 2)
        wait_for(lambda: len(fake.acks) > n, 5, "the SHADOWED ack")
        check(fake.acks[-1] == (chan, MODE_SHADOWED, 2, 6), f"SHADOWED ack {fake.acks[-1]}")
        reports = len(fake.reports)
        kicks = qom(qmp, "doorbell-kicks")
        dev.submit(slot, 6, 4, 1000)
        check(q.readl(dev.ctrl(slot, CTRL_IB_PUT)) == 10, "shadowed: guest cannot read back IB_PUT")
        # The doorbell store is what reports it.
        wait_for(lambda: len(fake.reports) > reports, 5, "the held-work report of the doorbell")
        check(fake.reports[reports:] == [(chan, 10)], f"shadowed: held reports {fake.reports[reports:]}")
        # A guest that never rings is seen too (the refresh tick reads the shadow).
        q.writel(dev.ctrl(slot, CTRL_IB_PUT), 11)
        wait_for(lambda: len(fake.reports) > reports + 1, 5, "the held-work report of the refresh tick")
        check(fake.reports[reports + 1:] == [(chan, 11)], f"shadowed: held reports {fake.reports[reports:]}")
        q.writel(dev.ctrl(slot, CTRL_IB_PUT), 10)
        wait_for(lambda: len(fake.reports) > reports + 2, 5, "the report of the rewound IB_PUT")
        check(fake.page(chan, CTRL_IB_PUT) == 6, "shadowed: IB_PUT reached the real page")
        check(qom(qmp, "doorbell-kicks") == kicks, "shadowed: the doorbell rang")
        fake.set_page(chan, CTRL_FENCE, 88)
        wait_for(lambda: q.readl(dev.ctrl(slot, CTRL_FENCE)) == 88, 2,
                 "the shadow page's FENCE to follow the real page")

        # Unshadow: TRAPPED first (held IB_PUT copied, doorbell), then DIRECT.
        n = fake.push_mode(chan, MODE_TRAPPED, 3)
        wait_for(lambda: len(fake.acks) > n, 5, "the unshadow ack")
        check(fake.acks[-1] == (chan, MODE_TRAPPED, 3, 10), f"unshadow ack {fake.acks[-1]}")
        check(fake.page(chan, CTRL_IB_PUT) == 10, "unshadow: held IB_PUT not released")
        check(fake.wait_bells(chan) >= 1, "unshadow: no doorbell")
        n = fake.push_mode(chan, MODE_DIRECT, 4)
        wait_for(lambda: len(fake.acks) > n, 5, "the DIRECT ack")
        check(fake.acks[-1] == (chan, MODE_DIRECT, 4, 10), f"DIRECT ack {fake.acks[-1]}")
        # A (buggy) SHADOWED -> DIRECT push is done as two steps internally.
        fake.push_mode(chan, MODE_SHADOWED, 5)
        wait_for(lambda: len(fake.acks) >= n + 2, 5, "ack 5")
        dev.submit(slot, 10, 2, 1000)
        n = fake.push_mode(chan, MODE_DIRECT, 6)
        wait_for(lambda: len(fake.acks) > n, 5, "ack 6")
        check(fake.acks[-1] == (chan, MODE_DIRECT, 6, 12), f"SHADOWED->DIRECT ack {fake.acks[-1]}")
        check(fake.page(chan, CTRL_IB_PUT) == 12, "SHADOWED->DIRECT lost the held IB_PUT")
        # Mode messages for channels this VM does not own are ignored.
        n = fake.push_mode(9999, MODE_SHADOWED, 1)
        time.sleep(0.05)
        check(len(fake.acks) == n, "acked a MODE for a foreign channel")

        # MSI-X vectors and the INTx fallback; fence waits.
        check_interrupts(dev, fake, slot, chan)
        check_fence_waits_fake(dev, fake, qmp)

        # Cost of a doorbell store: direct (RAM device page) vs trapped (MMIO exit,
        # TRAP_REPORT, eventfd).  Each qtest write is a round trip through QEMU's
        # main loop, which is included in both numbers; the ring write is the
        # baseline of that round trip.
        # Blocks of the three kinds alternate so drift of the (shared) machine
        # hits them alike; medians of the per-block means are reported.
        ROUNDS, N = 12, 150
        base, direct, trapped = [], [], []
        seq = 7
        for _ in range(ROUNDS):
            base.append(time_writes(q, dev.ring(slot, 200), N, lambda i: i))
            direct.append(time_writes(q, dev.ctrl(slot, CTRL_IB_PUT), N, lambda i: 12))
            n = fake.push_mode(chan, MODE_TRAPPED, seq)
            wait_for(lambda: len(fake.acks) > n, 5, f"ack {seq}")
            before = len(fake.reports) + qom(qmp, "tx-coalesced")
            fake.pause()            # N reports fit in the socket buffer
            trapped.append(time_writes(q, dev.ctrl(slot, CTRL_IB_PUT), N, lambda i: 12))
            fake.paused = False
            wait_for(lambda: len(fake.reports) + qom(qmp, "tx-coalesced") >= before + N, 10,
                     "the trap reports of a timing block")
            n = fake.push_mode(chan, MODE_DIRECT, seq + 1)
            wait_for(lambda: len(fake.acks) > n, 5, f"ack {seq + 1}")
            seq += 2
        base_us, direct_us, trapped_us = (sorted(v)[len(v) // 2] for v in (base, direct, trapped))
        result("doorbell.baseline_ring_write_us", f"{base_us:.2f}")
        result("doorbell.direct_us", f"{direct_us:.2f}")
        result("doorbell.trapped_us", f"{trapped_us:.2f}")
        result("doorbell.trapped_over_direct", f"{trapped_us / direct_us:.2f}")
        result("doorbell.trapped_extra_us", f"{trapped_us - direct_us:.2f}")
        log(f"doorbell store (median of {ROUNDS} blocks of {N}): direct {direct_us:.2f} us, "
            f"trapped {trapped_us:.2f} us, ring-write baseline {base_us:.2f} us; the qtest round "
            f"trip dominates both, trapped costs {trapped_us - direct_us:.2f} us more per store")
        reports = len(fake.reports)
        fake.bells(chan)

        # Bad mailbox input.
        bad_mailbox(dev)

        # Daemon refuses: status reported, slot stays free.
        fake.refuse_alloc = True
        st, _, daemon_status = dev.command(CMD_CHAN_ALLOC)
        check(st == CMDST_E_DAEMON and daemon_status == E_LIMIT, f"refused alloc: {st} {daemon_status}")
        fake.refuse_alloc = False

        # Slots run out: 4 slots, one used.
        extra = [dev.alloc(i)[0] for i in range(3)]
        st, _, _ = dev.command(CMD_CHAN_ALLOC)
        check(st == CMDST_E_NOSLOT, f"alloc with every slot used: {st}")
        for s in extra:
            dev.free(s)
        check(all(dev.slot_reg(s, SLOT_REG_STATE) == SLOT_FREE for s in extra), "freed slots not free")

        # Batched switches: MODE pushes for several channels arriving in one
        # read are applied together (one flat-view update), and every
        # unshadow still releases exactly what its shadow held.
        group = [dev.alloc(0x50 + i) for i in range(3)]
        def burst(mode, seq):
            n = len(fake.acks)
            msg = b"".join(HDR.pack(MAGIC, MSG_MODE, 0, 16, 0) + struct.pack("<IIII", c, mode, seq, 0)
                           for _, c in group)
            with fake.lock:
                fake.conn.sendall(msg)
            wait_for(lambda: len(fake.acks) >= n + len(group), 5, f"acks of a burst of {len(group)}")
            return fake.acks[n:]
        acks = burst(MODE_SHADOWED, 100)
        check(sorted(acks) == sorted((c, MODE_SHADOWED, 100, 0) for _, c in group), f"burst acks {acks}")
        for sl2, _ in group:
            dev.submit(sl2, 0, 2, 1000)
        check(all(fake.page(c, CTRL_IB_PUT) == 0 for _, c in group), "burst: shadowed work leaked")
        acks = burst(MODE_TRAPPED, 101)
        check(sorted(acks) == sorted((c, MODE_TRAPPED, 101, 2) for _, c in group), f"burst acks {acks}")
        check(all(fake.page(c, CTRL_IB_PUT) == 2 for _, c in group), "burst unshadow: held IB_PUT not released")
        burst(MODE_DIRECT, 102)
        check(all(dev.slot_reg(sl2, SLOT_REG_MODE) == MODE_DIRECT for sl2, _ in group), "burst: not direct")
        dev.submit(group[0][0], 2, 1, 1000)
        check(fake.page(group[0][1], CTRL_IB_PUT) == 3, "burst: direct page not mapped")
        for sl2, _ in group:
            dev.free(sl2)
        check(q.readl(dev.ctrl(extra[0], CTRL_FENCE)) == 0xFFFFFFFF, "freed slot still mapped")

        # Daemon restart: the connection drops, channels are lost; the chardev
        # reconnects, the device says HELLO again and re-allocates them.
        gen = dev.reg(REG_LINK_GEN)
        dev.set_reg(REG_IRQ_ACK, 0xFFFFFFFF)
        st, ws = dev.fence_wait(slot, fake.page(chan, CTRL_FENCE) + 1000)
        check(ws == WAITST_ARMED, f"FENCE_WAIT before the drop: {st}/{ws}")
        fake.drop()
        wait_for(lambda: dev.slot_reg(slot, SLOT_REG_STATE) in (SLOT_LOST, SLOT_LIVE) and
                 dev.reg(REG_LINK_GEN) > gen or dev.slot_reg(slot, SLOT_REG_STATE) == SLOT_LOST,
                 5, "the slot to be marked lost")
        check(dev.reg(REG_IRQ_STATUS) & IRQ_LINK, "no LINK interrupt on disconnect")
        check(dev.wait_reg(slot, WAIT_REG_STATUS) == WAITST_E_DEAD and
              dev.wait_reg(slot, WAIT_REG_ERROR) == CHAN_ERR_LOST,
              f"wait on a lost channel: {dev.wait_reg(slot, WAIT_REG_STATUS)}/"
              f"{dev.wait_reg(slot, WAIT_REG_ERROR):#x}")
        check(dev.reg(REG_IRQ_STATUS) & IRQ_FENCE and dev.fence_done() & (1 << slot),
              "lost wait not signalled")
        wait_for(lambda: dev.reg(REG_LINK_GEN) > gen and dev.slot_reg(slot, SLOT_REG_STATE) == SLOT_LIVE,
                 10, "reconnect and re-allocation")
        new_chan = dev.slot_reg(slot, SLOT_REG_CHAN_ID)
        check(new_chan != chan and new_chan in fake.channels, f"re-allocated channel {new_chan}")
        check(fake.channels[new_chan]["pid_hint"] == 0x1_0000_0042, "re-allocation lost the pid hint")
        check(len(fake.hellos) == 2, f"HELLOs: {len(fake.hellos)}")
        dev.submit(slot, 0, 1, 1000)
        check(fake.page(new_chan, CTRL_IB_PUT) == 1, "the re-allocated channel is not mapped")
        result("fake.reconnects", fake.connections - 1)

        # Malformed daemon messages end the connection, never QEMU.
        gen = dev.reg(REG_LINK_GEN)
        fake.send(MSG_MODE, 0, b"\x01" * 16)         # mode 0x01010101 out of range
        wait_for(lambda: dev.reg(REG_LINK_GEN) > gen, 10, "reconnect after a bad MODE")
        gen = dev.reg(REG_LINK_GEN)
        with fake.lock:
            fake.conn.sendall(struct.pack("<IHHII", 0xDEADBEEF, 65, 0, 5000, 1))
        wait_for(lambda: dev.reg(REG_LINK_GEN) > gen, 10, "reconnect after a bad header")
        gen = dev.reg(REG_LINK_GEN)
        fake.send(MSG_FREE_REPLY, 4242, struct.pack("<II", 0, 1))  # answers nothing
        wait_for(lambda: dev.reg(REG_LINK_GEN) > gen, 10, "reconnect after a stray reply")
        wait_for(lambda: dev.slot_reg(slot, SLOT_REG_STATE) == SLOT_LIVE, 10, "slot live again")
        dev.free(slot)
        check_task_names_fake(dev, fake)
        check_task_weights_fake(dev, fake)
        check(q.alive(), "QEMU died")
    finally:
        rc = q.shut_down(qmp, fake.close)
    check(rc == 0, f"QEMU exit status {rc}")


def check_interrupts(dev, fake, slot, chan):
    """INTx fallback without MSI-X; with MSI-X, each cause on its vector:
    masked vectors collect the PBA bit, unmasked ones write their message
    into guest RAM (the bus master address space), where the test reads it."""
    q = dev.q
    dev.set_reg(REG_IRQ_ACK, 0xFFFFFFFF)
    check(not dev.intx(), "INTx asserted with IRQ_STATUS clear")
    # --- INTx: level while IRQ_STATUS & IRQ_MASK
    dev.command(99)                                   # E_INVALID, still CMD_DONE
    check(dev.intx(), "INTx not asserted for CMD_DONE (MSI-X disabled)")
    dev.set_reg(REG_IRQ_MASK, IRQ_ALL & ~IRQ_CMD_DONE)
    check(not dev.intx(), "INTx asserted for a masked cause")
    dev.set_reg(REG_IRQ_MASK, IRQ_ALL)
    check(dev.intx(), "INTx not asserted again after unmasking")
    dev.set_reg(REG_IRQ_ACK, IRQ_CMD_DONE)
    check(not dev.intx(), "INTx still asserted after IRQ_ACK")
    # --- MSI-X enabled: INTx goes quiet; vectors start masked (PBA)
    dev.command(99)
    check(dev.intx(), "INTx for the next check")
    dev.msix_enable(True)
    check(not dev.intx(), "INTx still asserted with MSI-X enabled")
    check(dev.msix_pba() == 0, f"PBA {dev.msix_pba():#x} right after enabling MSI-X")
    dev.command(99)                                   # the ack inside makes CMD_DONE new
    check(dev.msix_pba() == 1 << VEC_CMD_DONE, f"CMD_DONE: PBA {dev.msix_pba():#x}")
    check(not dev.intx(), "INTx asserted with MSI-X enabled")
    # NOTICE (vector 1): a DEGRADED notice changes nothing else.
    fake.send(MSG_NOTICE, 0, struct.pack("<IIQ", 3, chan, 0))
    wait_for(lambda: dev.msix_pba() & (1 << VEC_NOTICE), 5, "the NOTICE vector's pending bit")
    check(dev.slot_reg(slot, SLOT_REG_NOTICE) == 3, "SLOT_NOTICE after DEGRADED")
    # FENCE (vector 2): a wait that ends at once.
    fake.set_page(chan, CTRL_FENCE, 3)
    st, ws = dev.fence_wait(slot, 3)
    check(st == CMDST_OK and ws == WAITST_OK, f"FENCE_WAIT(3) with FENCE 3: {st}/{ws}")
    check(dev.msix_pba() == 0b111, f"every vector pending: PBA {dev.msix_pba():#x}")
    # Program the vectors at guest RAM and unmask: each pending message is sent.
    for v in range(3):
        q.writel(MSG_RAM_GPA + 4 * v, 0)
        q.writel(dev.msix_entry(v, 0), MSG_RAM_GPA + 4 * v)
        q.writel(dev.msix_entry(v, 4), 0)
        q.writel(dev.msix_entry(v, 8), 0xC0DE0 + v)
    for v in range(3):
        q.writel(dev.msix_entry(v, 12), 0)            # unmask
        check(q.readl(MSG_RAM_GPA + 4 * v) == 0xC0DE0 + v,
              f"vector {v}: pending message not delivered on unmask")
    check(dev.msix_pba() == 0, f"PBA {dev.msix_pba():#x} after delivery")
    # Unmasked: a newly set cause sends its vector's message at once.
    def fired(v):
        return q.readl(MSG_RAM_GPA + 4 * v) == 0xC0DE0 + v
    for v in range(3):
        q.writel(MSG_RAM_GPA + 4 * v, 0)
    dev.set_reg(REG_IRQ_ACK, 0xFFFFFFFF)
    dev.command(99)
    check(fired(VEC_CMD_DONE) and not fired(VEC_NOTICE) and not fired(VEC_FENCE),
          "CMD_DONE must fire vector 0 only")
    q.writel(MSG_RAM_GPA, 0)
    st, ws = dev.fence_wait(slot, 4)
    check(ws == WAITST_ARMED, f"FENCE_WAIT(4) with FENCE 3: {ws}")
    check(fired(VEC_CMD_DONE) and not fired(VEC_FENCE), "armed wait: vector 0 only")
    fake.set_page(chan, CTRL_FENCE, 4)
    wait_for(lambda: fired(VEC_FENCE), 2, "the fence vector's message")
    check(dev.wait_reg(slot, WAIT_REG_STATUS) == WAITST_OK, "wait status after the fence vector")
    check(not fired(VEC_NOTICE), "fence completion fired the notice vector")
    fake.send(MSG_NOTICE, 0, struct.pack("<IIQ", 3, chan, 0))
    wait_for(lambda: fired(VEC_NOTICE), 5, "the NOTICE vector's message")
    # A cause already pending (not acked) sends nothing new.
    q.writel(MSG_RAM_GPA + 4 * VEC_NOTICE, 0)
    fake.send(MSG_NOTICE, 0, struct.pack("<IIQ", 3, chan, 0))
    time.sleep(0.05)
    check(not fired(VEC_NOTICE), "an un-acked cause sent a second message")
    # IRQ_MASK gates MSI-X too.
    dev.set_reg(REG_IRQ_ACK, 0xFFFFFFFF)
    dev.set_reg(REG_IRQ_MASK, IRQ_ALL & ~IRQ_CMD_DONE)
    q.writel(MSG_RAM_GPA, 0)
    dev.command(99)
    check(not fired(VEC_CMD_DONE), "a cause masked in IRQ_MASK fired its vector")
    dev.set_reg(REG_IRQ_MASK, IRQ_ALL)
    # Disabling MSI-X with a cause pending falls back to INTx at once.
    dev.msix_enable(False)
    check(dev.intx(), "INTx not asserted after disabling MSI-X with IRQ_STATUS set")
    dev.set_reg(REG_IRQ_ACK, 0xFFFFFFFF)
    check(not dev.intx(), "INTx after ack")
    for v in range(3):
        q.writel(dev.msix_entry(v, 12), 1)            # masked again
    result("msix.vectors_checked", 3)


def qom(qmp, prop, dev_id="pvgpu0"):
    """A read-only counter of the device (qom-get)."""
    return qmp.execute("qom-get", path=f"/machine/peripheral/{dev_id}", property=prop)


def check_fence_waits_fake(dev, fake, qmp):
    """FENCE_WAIT against a fake daemon that sets FENCE/STATUS by hand."""
    q = dev.q
    slot, chan = dev.alloc(pid_hint=0x77)
    bit = 1 << slot
    fake.set_page(chan, CTRL_FENCE, 5)
    dev.set_reg(REG_FENCE_DONE_LO, 0xFFFFFFFF)
    dev.set_reg(REG_FENCE_DONE_HI, 0xFFFFFFFF)
    dev.set_reg(REG_IRQ_ACK, 0xFFFFFFFF)
    # Already reached: ends at once, FENCE_DONE and IRQ_FENCE set.
    st, ws = dev.fence_wait(slot, 5)
    check(st == CMDST_OK and ws == WAITST_OK, f"FENCE_WAIT(5) at FENCE 5: {st}/{ws}")
    check(dev.wait_reg(slot, WAIT_REG_FENCE) == 5, "WAIT_FENCE")
    check(dev.fence_done() == bit, f"FENCE_DONE {dev.fence_done():#x}")
    check(dev.reg(REG_IRQ_STATUS) & IRQ_FENCE, "no IRQ_FENCE for an immediate completion")
    dev.set_reg(REG_FENCE_DONE_LO, bit)
    check(dev.fence_done() == 0, "FENCE_DONE write-1-to-clear")
    dev.set_reg(REG_IRQ_ACK, IRQ_FENCE)
    # Wrap-safe: 0xFFFFFF00 is 261 behind 5.
    st, ws = dev.fence_wait(slot, 0xFFFFFF00)
    check(ws == WAITST_OK, f"FENCE_WAIT(0xFFFFFF00) at FENCE 5: {ws}")
    dev.set_reg(REG_IRQ_ACK, IRQ_FENCE)
    # Not reached: armed; only the command completes.
    st, ws = dev.fence_wait(slot, 9)
    check(st == CMDST_OK and ws == WAITST_ARMED, f"FENCE_WAIT(9) at FENCE 5: {st}/{ws}")
    check(dev.fence_done() & bit == 0, "FENCE_DONE set by an armed wait")
    check(not dev.reg(REG_IRQ_STATUS) & IRQ_FENCE, "IRQ_FENCE set by an armed wait")
    st, _ = dev.fence_wait(slot, 7)
    check(st == CMDST_E_INVALID, f"second FENCE_WAIT on an armed slot: {st}")
    check(dev.wait_reg(slot, WAIT_REG_FENCE) == 9, "the refused wait replaced the armed one")
    fake.set_page(chan, CTRL_FENCE, 8)
    time.sleep(0.02)
    check(dev.wait_reg(slot, WAIT_REG_STATUS) == WAITST_ARMED, "wait ended before FENCE got there")
    # The wait is older than 16 ms: checked at most once a millisecond
    # (a fixed 200 us poll ran 5 times as often).
    p0, w0 = qom(qmp, "fence-polls"), time.monotonic()
    time.sleep(0.5)
    p1, w1 = qom(qmp, "fence-polls"), time.monotonic()
    result("fence_wait.polls_per_s_armed_idle", f"{(p1 - p0) / (w1 - w0):.0f}")
    check(0 < p1 - p0 <= (w1 - w0) * 1000 + 2,
          f"{p1 - p0} checks of an armed wait in {(w1 - w0) * 1e3:.0f} ms")
    t0 = time.monotonic()
    fake.set_page(chan, CTRL_FENCE, 9)
    ws = dev.wait_ended(slot, 2, "the wait for fence 9")
    took = time.monotonic() - t0
    check(ws == WAITST_OK, f"wait for 9 ended with {ws}")
    check(dev.fence_done() & bit and dev.reg(REG_IRQ_STATUS) & IRQ_FENCE, "completion not signalled")
    result("fence_wait.fake_latency_ms", f"{took * 1e3:.2f}")
    # Across the 32-bit wrap.
    fake.set_page(chan, CTRL_FENCE, 0xFFFFFFF0)
    st, ws = dev.fence_wait(slot, 0x10)
    check(ws == WAITST_ARMED, f"FENCE_WAIT(0x10) at 0xFFFFFFF0: {ws}")
    fake.set_page(chan, CTRL_FENCE, 0xFFFFFFFF)
    time.sleep(0.01)
    check(dev.wait_reg(slot, WAIT_REG_STATUS) == WAITST_ARMED, "wrap: ended at 0xFFFFFFFF")
    fake.set_page(chan, CTRL_FENCE, 0x10)
    check(dev.wait_ended(slot, 2, "the wait across the wrap") == WAITST_OK, "wrap: wait not OK")
    # The channel dies (watchdog) before FENCE gets there: E_DEAD + its ERROR.
    st, ws = dev.fence_wait(slot, 0x20)
    check(ws == WAITST_ARMED, f"FENCE_WAIT(0x20): {ws}")
    dev.set_reg(REG_FENCE_DONE_LO, 0xFFFFFFFF)
    fake.set_page(chan, CTRL_ERROR, CHAN_ERR_WATCHDOG)
    fake.set_page(chan, CTRL_STATUS, 1)
    ws = dev.wait_ended(slot, 2, "the wait on a dying channel")
    check(ws == WAITST_E_DEAD and dev.wait_reg(slot, WAIT_REG_ERROR) == CHAN_ERR_WATCHDOG,
          f"dead channel: wait {ws}, error {dev.wait_reg(slot, WAIT_REG_ERROR)}")
    check(dev.fence_done() & bit, "dead channel: FENCE_DONE not set")
    # Arming on a dead channel ends at once with the error; a reached fence is still OK.
    st, ws = dev.fence_wait(slot, 0x30)
    check(st == CMDST_OK and ws == WAITST_E_DEAD, f"FENCE_WAIT on a dead channel: {st}/{ws}")
    st, ws = dev.fence_wait(slot, 0x10)
    check(ws == WAITST_OK, f"FENCE_WAIT for a reached fence on a dead channel: {ws}")
    # CHAN_FREE cancels an armed wait (no completion); the slot refuses waits after.
    fake.set_page(chan, CTRL_STATUS, 0)
    fake.set_page(chan, CTRL_ERROR, 0)
    st, ws = dev.fence_wait(slot, 0x40)
    check(ws == WAITST_ARMED, f"FENCE_WAIT(0x40): {ws}")
    dev.set_reg(REG_FENCE_DONE_LO, 0xFFFFFFFF)
    dev.free(slot)
    check(dev.wait_reg(slot, WAIT_REG_STATUS) == WAITST_NONE, "CHAN_FREE left the wait armed")
    check(dev.fence_done() & bit == 0, "CHAN_FREE completed the wait")
    st, _ = dev.fence_wait(slot, 1)
    check(st == CMDST_E_INVALID, f"FENCE_WAIT on a freed slot: {st}")


def realize_fails(bins, tmp, sock, vm_uuid, props, message):
    """QEMU with `-device pvgpu,<props>` must exit non-zero saying `message`."""
    p = subprocess.run([bins.qemu, "-machine", "q35", "-accel", "qtest", "-display", "none",
                        "-nodefaults", "-bios", os.path.join(tmp, "bios.bin"), "-uuid", str(vm_uuid),
                        # nothing listens there: this QEMU must not take the fake's connection
                        "-chardev", f"socket,id=pv2,path={sock}.none,reconnect=1",
                        "-device", f"pvgpu,chardev=pv2,{props}"],
                       stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=30)
    check(p.returncode != 0 and message in p.stderr,
          f"{props}: exit {p.returncode}, stderr {p.stderr.strip()!r}")


def check_slots_limit(bins, tmp, sock, vm_uuid):
    """A device has at most 64 slots (the wait registers end where TASK_NAME begins);
    kernel-wn=on needs KVM's write notify, which qtest never has."""
    realize_fails(bins, tmp, sock, vm_uuid, "slots=128",
                  "'slots' must be a power of two in 1..64 (got 128)")
    realize_fails(bins, tmp, sock, vm_uuid, "kernel-wn=on",
                  "kernel-wn=on needs KVM with the pvgpu write notify extension "
                  "(KVM_CAP_PVGPU_WRITE_NOTIFY): this VM does not run under KVM")
    realize_fails(bins, tmp, sock, vm_uuid, "kernel-wn=yes",
                  "Parameter 'kernel-wn' does not accept value 'yes'")
    realize_fails(bins, tmp, sock, vm_uuid, "gpu=16",
                  "pvgpu: 'gpu' must be a GPU index in 0..15, or unset to let pvgpud place the device "
                  "(got 16)")


def check_gpu_property(bins, tmp, vm_uuid):
    """gpu=1 goes out in HELLO as 2 (PVGPU_GPU_INDEX); a refusal's ERROR is
    what QEMU logs; a pvgpud agreeing on a version before 4 is refused while
    a GPU is named, and the link comes up again with one that can."""
    sock = os.path.join(tmp, "fake-gpu.sock")
    fake = FakeDaemon(sock)
    q = Qemu(bins.qemu, tmp, sock, vm_uuid, name="vm-gpu", slots=4, device_props=",gpu=1")
    try:
        dev = Device(q)
        dev.wait_link()
        check(fake.hellos and fake.hellos[-1][4] == 2, f"HELLO gpu with gpu=1: {fake.hellos}")
        gen = dev.reg(REG_LINK_GEN)
        fake.refuse_hello = "no GPU 1 on this host (1 GPUs)"
        fake.drop()
        wait_for(lambda: "pvgpu: pvgpud refused HELLO: no GPU 1 on this host (1 GPUs)" in q.read_stderr(), 10,
                 "QEMU to log pvgpud's refusal")
        check(dev.reg(REG_LINK) != LINK_READY and dev.reg(REG_LINK_GEN) == gen, "a refused HELLO made the link READY")
        fake.refuse_hello = None
        fake.version = 3
        fake.drop()
        wait_for(lambda: "pvgpud speaks protocol version 3, which cannot place a device on a GPU (gpu=1 needs "
                 "version 4)" in q.read_stderr(), 10, "QEMU to refuse a version-3 session with gpu=1")
        check(dev.reg(REG_LINK_GEN) == gen, "a version-3 session with gpu=1 became READY")
        fake.version = PROTO_VERSION
        fake.drop()
        wait_for(lambda: dev.reg(REG_LINK) == LINK_READY and dev.reg(REG_LINK_GEN) > gen, 10,
                 "the link with a version-4 pvgpud again")
        check(fake.hellos[-1][4] == 2, f"HELLO gpu after reconnects: {fake.hellos[-1]}")
        result("gpu.fake_cases", "ok")
    finally:
        rc = q.close()
        fake.close()
    check(rc == 0, f"QEMU (gpu=1) exit status {rc}")


def check_task_names_fake(dev, fake):
    """TASK_NAME goes out with CHAN_ALLOC, sanitised; re-allocations keep it."""
    dev.set_task_name(b"bench")
    check(dev.task_name() == b"bench".ljust(TASK_NAME_LEN, b"\0"), f"TASK_NAME reads {dev.task_name()!r}")
    slot, chan = dev.alloc(pid_hint=0x61)
    check(fake.channels[chan]["task_name"] == b"bench".ljust(TASK_NAME_LEN, b"\0"),
          f"task_name {fake.channels[chan]['task_name']!r}")
    # Non-printable bytes become '?'; the name ends at the first NUL and
    # whatever follows it is not sent; the register reads back unchanged.
    raw = b"a\x01b\xffc\x7f\0junk"
    dev.set_task_name(raw)
    check(dev.task_name() == raw.ljust(TASK_NAME_LEN, b"\0"), "TASK_NAME does not read back as written")
    s2, c2 = dev.alloc(pid_hint=0x62)
    check(fake.channels[c2]["task_name"] == b"a?b?c?".ljust(TASK_NAME_LEN, b"\0"),
          f"sanitised task_name {fake.channels[c2]['task_name']!r}")
    # 32 bytes without a NUL: the last byte is forced to NUL.
    dev.set_task_name(b"x" * TASK_NAME_LEN)
    s3, c3 = dev.alloc(pid_hint=0x63)
    check(fake.channels[c3]["task_name"] == b"x" * 31 + b"\0", f"full task_name {fake.channels[c3]['task_name']!r}")
    # The register keeps its value for the next CHAN_ALLOC (the driver
    # rewrites it before each one); 0 sends no name.
    dev.set_task_name(b"")
    s4, c4 = dev.alloc(pid_hint=0x64)
    check(fake.channels[c4]["task_name"] == bytes(TASK_NAME_LEN), "empty TASK_NAME sent a name")
    # A reconnect re-allocates lost slots with their own names.
    gen = dev.reg(REG_LINK_GEN)
    fake.drop()
    wait_for(lambda: dev.reg(REG_LINK_GEN) > gen and dev.slot_reg(s2, SLOT_REG_STATE) == SLOT_LIVE, 10,
             "re-allocation after a drop")
    again = dev.slot_reg(s2, SLOT_REG_CHAN_ID)
    check(fake.channels[again]["task_name"] == b"a?b?c?".ljust(TASK_NAME_LEN, b"\0"),
          f"re-allocation task_name {fake.channels[again]['task_name']!r}")
    for sl in (slot, s2, s3, s4):
        wait_for(lambda: dev.slot_reg(sl, SLOT_REG_STATE) == SLOT_LIVE, 10, f"slot {sl} live again")
        dev.free(sl)
    result("task_name.sanitised", "ok")


def check_task_weights_fake(dev, fake):
    """CMD_TASK_WEIGHT: checked at once, else BUSY until the daemon answers."""
    bad = dev.reg(REG_BAD_ACCESS)
    # OK: the daemon gets hint and weight, the command completes with RESULT0/1 = 0.
    n = len(fake.task_weights)
    st, r0, r1 = dev.task_weight(0x2_0000_0042, 700)
    check((st, r0, r1) == (CMDST_OK, 0, 0), f"TASK_WEIGHT: {st}/{r0}/{r1}")
    check(fake.task_weights[n:] and fake.task_weights[-1][1:] == (0x2_0000_0042, 700, 0),
          f"TASK_WEIGHT on the wire: {fake.task_weights[n:]}")
    check(dev.reg(REG_ARG2) == 700, "ARG2 does not read back")
    st, _, _ = dev.task_weight(0x42, 0)                # 0 forgets: valid, sent
    check(st == CMDST_OK and fake.task_weights[-1][1:] == (0x42, 0, 0), f"weight 0: {st}")
    st, _, _ = dev.task_weight(0x42, WEIGHT_MAX)
    check(st == CMDST_OK, f"weight {WEIGHT_MAX}: {st}")
    # Invalid arguments: E_INVALID before the CMD write returns, nothing sent.
    n = len(fake.task_weights)
    for hint, weight in ((0, 100), (0x42, WEIGHT_MAX + 1), (0x42, 0xFFFFFFFF)):
        st = dev.start(CMD_TASK_WEIGHT, hint & 0xFFFFFFFF, hint >> 32, weight)
        check(st == CMDST_E_INVALID, f"TASK_WEIGHT({hint:#x}, {weight}): {st}, want E_INVALID at once")
    time.sleep(0.05)
    check(len(fake.task_weights) == n, f"invalid TASK_WEIGHTs reached the daemon: {fake.task_weights[n:]}")
    # The daemon refuses: E_DAEMON, RESULT1 = its status.
    fake.task_weight_status = E_LIMIT
    st, r0, r1 = dev.task_weight(0x43, 200)
    check((st, r0, r1) == (CMDST_E_DAEMON, 0, E_LIMIT), f"refused TASK_WEIGHT: {st}/{r0}/{r1}")
    fake.task_weight_status = E_OK
    # A daemon that does not answer keeps the mailbox BUSY (other commands
    # are refused and counted) until the link drops: then E_LINK.
    fake.hold_task_weight = True
    n = len(fake.task_weights)
    st = dev.start(CMD_TASK_WEIGHT, 0x44, 0, 300)
    check(st == CMDST_BUSY, f"TASK_WEIGHT without a reply: {st}")
    wait_for(lambda: len(fake.task_weights) > n, 5, "the unanswered TASK_WEIGHT")
    time.sleep(0.05)
    check(dev.reg(REG_CMD_STATUS) == CMDST_BUSY, "TASK_WEIGHT completed without a reply")
    before = dev.reg(REG_BAD_ACCESS)
    dev.set_reg(REG_CMD, CMD_CHAN_ALLOC)
    check(dev.reg(REG_BAD_ACCESS) == before + 1 and dev.reg(REG_CMD_STATUS) == CMDST_BUSY,
          "a command while BUSY was not refused")
    # FENCE_WAIT state and the slot registers stay readable meanwhile.
    check(dev.slot_reg(0, SLOT_REG_STATE) == SLOT_FREE, "slot registers while BUSY")
    gen = dev.reg(REG_LINK_GEN)
    dev.set_reg(REG_IRQ_ACK, IRQ_CMD_DONE)
    fake.hold_hello = True      # the reconnect stays in LINK_HELLO for the next check
    fake.hold_task_weight = False
    fake.drop()
    wait_for(lambda: dev.reg(REG_CMD_STATUS) != CMDST_BUSY, 5, "the link loss to end the command")
    check(dev.reg(REG_CMD_STATUS) == CMDST_E_LINK, f"unanswered TASK_WEIGHT ended {dev.reg(REG_CMD_STATUS)}")
    check(dev.reg(REG_IRQ_STATUS) & IRQ_CMD_DONE, "no CMD_DONE for the E_LINK completion")
    # No READY link (connected, HELLO unanswered): E_LINK at once.
    wait_for(lambda: fake.held_hellos, 10, "the reconnect's HELLO")
    check(dev.reg(REG_LINK) == LINK_HELLO, f"LINK {dev.reg(REG_LINK)} with HELLO unanswered")
    n = len(fake.task_weights)
    st = dev.start(CMD_TASK_WEIGHT, 0x45, 0, 300)
    check(st == CMDST_E_LINK, f"TASK_WEIGHT without a READY link: {st}")
    fake.hold_hello = False
    fake.release_hellos()
    wait_for(lambda: dev.reg(REG_LINK) == LINK_READY and dev.reg(REG_LINK_GEN) > gen, 10, "LINK READY")
    check(len(fake.task_weights) == n, "TASK_WEIGHT sent without a READY link")
    st, _, _ = dev.task_weight(0x45, 300)
    check(st == CMDST_OK, f"TASK_WEIGHT after the reconnect: {st}")
    # A version-1 pvgpud never gets TASK_WEIGHT: E_DAEMON / E_VERSION at once.
    fake.version = 1
    gen = dev.reg(REG_LINK_GEN)
    fake.drop()
    wait_for(lambda: dev.reg(REG_LINK) == LINK_READY and dev.reg(REG_LINK_GEN) > gen, 10,
             "LINK READY with a version-1 daemon")
    n = len(fake.task_weights)
    st = dev.start(CMD_TASK_WEIGHT, 0x46, 0, 300)
    check(st == CMDST_E_DAEMON and dev.reg(REG_RESULT1) == E_VERSION,
          f"TASK_WEIGHT with a version-1 daemon: {st}/{dev.reg(REG_RESULT1)}")
    slot, chan = dev.alloc(pid_hint=0x47)     # version 1 still allocates channels
    dev.free(slot)
    check(len(fake.task_weights) == n, "TASK_WEIGHT sent to a version-1 daemon")
    # A reply that answers nothing ends the connection like any stray reply.
    fake.version = PROTO_VERSION
    gen = dev.reg(REG_LINK_GEN)
    fake.drop()
    wait_for(lambda: dev.reg(REG_LINK) == LINK_READY and dev.reg(REG_LINK_GEN) > gen, 10, "LINK READY (v2)")
    gen = dev.reg(REG_LINK_GEN)
    fake.send(MSG_TASK_WEIGHT_REPLY, 4243, struct.pack("<II", 0, 0))
    wait_for(lambda: dev.reg(REG_LINK_GEN) > gen, 10, "reconnect after a stray TASK_WEIGHT_REPLY")
    st, _, _ = dev.task_weight(0x48, 1)
    check(st == CMDST_OK, f"TASK_WEIGHT after the stray reply: {st}")
    check(dev.reg(REG_BAD_ACCESS) == bad + 1, f"BAD_ACCESS {dev.reg(REG_BAD_ACCESS) - bad}, want 1")
    result("task_weight.fake_cases", "ok")


def bad_mailbox(dev):
    q = dev.q
    bad = dev.reg(REG_BAD_ACCESS)
    st, _, _ = dev.command(99)
    check(st == CMDST_E_INVALID, f"unknown command: status {st}")
    st, _, _ = dev.command(0)
    check(st == CMDST_E_INVALID, f"command 0: status {st}")
    st, _, _ = dev.command(CMD_CHAN_FREE, 9999)
    check(st == CMDST_E_INVALID, f"free of slot 9999: status {st}")
    st, _, _ = dev.command(CMD_CHAN_FREE, 0xFFFFFFFF)
    check(st == CMDST_E_INVALID, f"free of slot -1: status {st}")
    free_slot = dev.slots - 1
    check(dev.slot_reg(free_slot, SLOT_REG_STATE) == SLOT_FREE, "last slot unexpectedly used")
    st, _, _ = dev.command(CMD_CHAN_FREE, free_slot)
    check(st == CMDST_E_INVALID, f"free of a free slot: status {st}")
    for bad_slot in (dev.slots, 9999, 0xFFFFFFFF, free_slot):
        st, _ = dev.fence_wait(bad_slot, 1)
        check(st == CMDST_E_INVALID, f"FENCE_WAIT on slot {bad_slot:#x}: status {st}")
    check(dev.wait_reg(free_slot, WAIT_REG_STATUS) == WAITST_NONE, "a refused FENCE_WAIT armed a wait")
    after_cmds = dev.reg(REG_BAD_ACCESS)
    # Wrong sizes and alignment on the mailbox.
    q.writeb(BAR0_GPA + REG_CMD, CMD_CHAN_ALLOC)
    q.writew(BAR0_GPA + REG_CMD, CMD_CHAN_ALLOC)
    q.writeq(BAR0_GPA + REG_CMD, CMD_CHAN_ALLOC)
    q.writel(BAR0_GPA + REG_CMD + 2, CMD_CHAN_ALLOC)
    check(q.readb(BAR0_GPA + REG_MAGIC) == 0xFF, "byte read of a register not rejected")
    q.writel(BAR0_GPA + REG_MAGIC, 0)       # read-only
    q.writel(BAR0_GPA + REG_RESULT0, 5)     # read-only
    q.writel(BAR0_GPA + 0xFFC, 5)           # unknown
    check(dev.reg(REG_MAGIC) == DEV_MAGIC and dev.reg(REG_RESULT0) != 5, "a read-only register changed")
    check(dev.reg(REG_CMD_STATUS) != CMDST_BUSY, "a bad-size CMD write started a command")
    # Empty slots: all ones, stores dropped; beyond the BARs nothing of ours.
    check(q.readl(dev.ctrl(free_slot, CTRL_FENCE)) == 0xFFFFFFFF, "empty control slot readable")
    check(q.readl(dev.ring(free_slot)) == 0xFFFFFFFF, "empty ring slot readable")
    q.writel(dev.ctrl(free_slot, CTRL_IB_PUT), 1)
    q.writel(dev.ring(free_slot), 1)
    q.writel(dev.doorbell(free_slot), 1)    # free slot doorbell: ignored, not an error
    q.writeb(dev.doorbell(free_slot), 1)    # wrong size: counted
    q.writel(BAR4_GPA + dev.sizes[4] + 0x100, 1)  # outside BAR4: not the device's
    n_bad = dev.reg(REG_BAD_ACCESS) - after_cmds
    # 5 size/alignment + 1 read + 3 ro/unknown + 2 empty-slot stores + 1 doorbell size
    check(n_bad == 12, f"BAD_ACCESS counted {n_bad} of 12 bad accesses")
    # Interrupt mask/ack registers.
    dev.set_reg(REG_IRQ_MASK, 0xFFFFFFFF)
    check(dev.reg(REG_IRQ_MASK) == IRQ_ALL, f"IRQ_MASK {dev.reg(REG_IRQ_MASK):#x}: unknown bits kept")
    dev.set_reg(REG_IRQ_ACK, 0xFFFFFFFF)
    check(dev.reg(REG_IRQ_STATUS) == 0, "IRQ_ACK did not clear")
    result("mailbox.bad_accesses_counted", dev.reg(REG_BAD_ACCESS) - bad)


class Ahci:
    """Just enough of q35's ICH9 AHCI (00:1f.2, port 0: an ide-hd on a null-co
    drive with a completion latency) to have a disk write into any guest-physical
    address -- another device's DMA -- while the test does something else."""

    ABAR = 0xE0800000                      # BAR5, clear of pvgpu's BARs
    CLB, FIS, CTBA = 0x200000, 0x201000, 0x202000   # guest RAM
    PORT = ABAR + 0x100
    PX_CMD, PX_TFD, PX_SERR, PX_IS, PX_CI = 0x18, 0x20, 0x30, 0x10, 0x38

    def __init__(self, q):
        self.q = q
        check(self.cfg(0, None) == 0x29228086, f"no ICH9 AHCI at 00:1f.2 ({self.cfg(0, None):#x})")
        self.cfg(0x24, self.ABAR)
        self.cfg(0x04, 0x0006)             # memory space + bus master
        q.writel(self.ABAR + 0x04, 1 << 31)   # GHC.AE: AHCI mode
        for off, val in ((0x00, self.CLB), (0x04, 0), (0x08, self.FIS), (0x0C, 0),
                         (self.PX_SERR, 0xFFFFFFFF), (self.PX_IS, 0xFFFFFFFF),
                         (self.PX_CMD, 1 << 4), (self.PX_CMD, 1 << 4 | 1)):   # FRE, then ST
            q.writel(self.PORT + off, val)

    def cfg(self, off, val):
        self.q.outl(0xCF8, 0x80000000 | (0x1F << 11) | (2 << 8) | off)
        if val is None:
            return self.q.inl(0xCFC)
        self.q.outl(0xCFC, val)

    def read_sector_into(self, gpa):
        """READ DMA EXT of sector 0 into `gpa`; returns at once, the DMA in flight."""
        q = self.q
        q.write(self.CLB, struct.pack("<IIII", 5 | 1 << 16, 0, self.CTBA, 0))  # CFL 5, 1 PRD
        fis = bytes([0x27, 0x80, 0x25, 0, 0, 0, 0, 0x40, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0])
        q.write(self.CTBA, fis.ljust(0x80, b"\0") + struct.pack("<IIII", gpa, 0, 0, 511))
        q.writel(self.PORT + self.PX_CI, 1)

    def busy(self):
        return self.q.readl(self.PORT + self.PX_CI) & 1

    def status(self):
        return self.q.readl(self.PORT + self.PX_TFD) & 0xFF


DMA_LATENCY_NS = 1_000_000_000


def check_dma_after_free(dev, fake):
    """Item 5: another device's DMA into BAR2 outlives the channel.  The DMA
    maps the control page (a bounce buffer that holds the region) and writes
    it back when the disk completes, after CHAN_FREE.  The region must still
    exist then (the ASan build reports a use-after-free otherwise) and the
    write must land in the empty slot, not in the freed channel's memory."""
    q = dev.q
    slot, chan = dev.alloc(0x5A)
    fake.set_page(chan, CTRL_FENCE, 0x5A5A)
    ahci = Ahci(q)
    bad = dev.reg(REG_BAD_ACCESS)
    t0 = time.monotonic()
    ahci.read_sector_into(dev.ctrl(slot))
    check(ahci.busy(), "the disk finished before the channel could be freed")
    dev.free(slot)
    check(time.monotonic() - t0 < DMA_LATENCY_NS / 1e9 / 2, "CHAN_FREE was not inside the DMA")
    wait_for(lambda: not ahci.busy(), 10, "the disk DMA to complete")
    check(ahci.status() & 0x01 == 0, f"the disk read failed: TFD {ahci.status():#x}")
    check(fake.page(chan, CTRL_FENCE) == 0x5A5A, "the late DMA wrote into the freed channel")
    check(dev.reg(REG_BAD_ACCESS) > bad, "the late DMA write-back did not reach the empty slot")
    check(q.readl(dev.ctrl(slot, CTRL_FENCE)) == 0xFFFFFFFF, "freed slot still mapped")
    result("hardening.dma_after_free", f"bad accesses {dev.reg(REG_BAD_ACCESS) - bad}")


def check_store_behind_shadow(dev, fake):
    """Item 9: a guest IB_PUT store that reaches the real page after the
    shadow was seeded (inside the switch's memory transaction, or from a TCG
    vCPU whose TLB still maps the real page) may already be seen by the GPU:
    the shadow takes it over and the unshadow must not rewind it.  qtest
    cannot store inside the transaction (it waits for the BQL), so the store
    is made into the shared page directly, as that vCPU would, after the
    switch."""
    q = dev.q
    slot, chan = dev.alloc(0x64)
    put = dev.submit(slot, 0, 2, 1000)
    n = fake.push_mode(chan, MODE_SHADOWED, 1)
    wait_for(lambda: len(fake.acks) > n, 5, "the SHADOWED ack")
    check(fake.acks[-1] == (chan, MODE_SHADOWED, 1, put), f"SHADOWED ack {fake.acks[-1]}")
    fake.set_page(chan, CTRL_IB_PUT, put + 3)         # the late store
    wait_for(lambda: q.readl(dev.ctrl(slot, CTRL_IB_PUT)) == put + 3, 2,
             "the shadow to take over the store that reached the real page")
    q.writel(dev.ctrl(slot, CTRL_IB_PUT), put + 5)     # the guest goes on in the shadow
    fake.set_page(chan, CTRL_IB_PUT, put + 4)         # an older late store loses
    time.sleep(0.02)
    check(q.readl(dev.ctrl(slot, CTRL_IB_PUT)) == put + 5, "a late store overwrote a newer shadow store")
    n = fake.push_mode(chan, MODE_TRAPPED, 2)
    wait_for(lambda: len(fake.acks) > n, 5, "the unshadow ack")
    check(fake.page(chan, CTRL_IB_PUT) == put + 5 and fake.acks[-1] == (chan, MODE_TRAPPED, 2, put + 5),
          f"unshadow: real IB_PUT {fake.page(chan, CTRL_IB_PUT)}, ack {fake.acks[-1]}")
    dev.free(slot)


def check_pong_for_alloc(dev, fake):
    """Item 8: a PONG carrying a pending CHAN_ALLOC's seq must not leave the
    mailbox BUSY: a reply of the wrong type drops the link (E_LINK)."""
    gen = dev.reg(REG_LINK_GEN)
    fake.pong_alloc = True
    try:
        st, _, _ = dev.command(CMD_CHAN_ALLOC, 0x60, timeout=5)
    finally:
        fake.pong_alloc = False
    check(st == CMDST_E_LINK, f"CHAN_ALLOC answered by a PONG: status {st}")
    check(all(dev.slot_reg(i, SLOT_REG_STATE) == SLOT_FREE for i in range(dev.slots)), "a slot leaked")
    wait_for(lambda: dev.reg(REG_LINK_GEN) > gen and dev.reg(REG_LINK) == LINK_READY, 10,
             "the reconnect after the PONG")


def alloc_with_fake(dev, fake, knob, value, pid_hint):
    """CHAN_ALLOC while the fake daemon's `knob` is `value` (then restored):
    returns (CMD_STATUS, RESULT0, RESULT1)."""
    saved = getattr(fake, knob)
    setattr(fake, knob, value)
    try:
        return dev.command(CMD_CHAN_ALLOC, pid_hint)
    finally:
        setattr(fake, knob, saved)


def check_unsealed_memfd(dev, fake):
    """Item 8: channel memory the daemon could shrink is refused (and given
    back); shrinking it afterwards cannot hurt QEMU (SIGBUS if mapped)."""
    q = dev.q
    st, slot, r1 = alloc_with_fake(dev, fake, "seal", False, 0x61)
    chan = max(fake.memfds)
    os.ftruncate(fake.memfds.pop(chan), 0)
    check(q.readl(dev.ctrl(slot, CTRL_FENCE)) == 0xFFFFFFFF, "the unsealed memory is mapped")
    check((st, r1) == (CMDST_E_DAEMON, E_INTERNAL), f"CHAN_ALLOC with an unsealed memfd: {st}/{r1}")
    wait_for(lambda: chan in fake.frees, 5, "the refused channel to be given back")
    check(q.alive(), "QEMU died")


def check_bell_not_eventfd(dev, fake):
    """A doorbell fd that is not an eventfd is refused at CHAN_ALLOC (and
    the channel given back): under KVM, registering it as an ioeventfd
    would abort QEMU."""
    q = dev.q
    st, slot, r1 = alloc_with_fake(dev, fake, "bell_pipe", True, 0x64)
    chan = fake.next_chan - 1
    check((st, r1) == (CMDST_E_DAEMON, E_INTERNAL), f"CHAN_ALLOC with a pipe for a doorbell: {st}/{r1}")
    wait_for(lambda: chan in fake.frees, 5, "the refused channel to be given back")
    check(all(dev.slot_reg(i, SLOT_REG_STATE) == SLOT_FREE for i in range(dev.slots)), "a slot leaked")
    check(q.alive(), "QEMU died")
    slot, _ = dev.alloc(0x65)              # the next channel (an eventfd) works
    check(dev.slot_reg(slot, SLOT_REG_STATE) == SLOT_LIVE, "no channel after the refused one")
    dev.free(slot)


def check_send_failure_mid_message(dev, fake, qmp):
    """Item 6: the daemon answers HELLO and stops reading at once, so the
    device's re-allocation of a lost channel is written while the HELLO_REPLY
    is processed, and fails (EPIPE); the chardev drops the link from inside
    that write.
    The request queue must stay sane: a reset afterwards takes no time."""
    q = dev.q
    slot, _ = dev.alloc(0x62)
    fake.hold_hello = True
    held = len(fake.held_hellos)
    fake.drop()
    wait_for(lambda: len(fake.held_hellos) > held, 10, "the HELLO of the reconnect")
    check(dev.slot_reg(slot, SLOT_REG_STATE) == SLOT_LOST, "the slot is not lost")
    gen = dev.reg(REG_LINK_GEN)
    conn, seq, version = fake.held_hellos.pop()
    fake.hold_hello = False
    with fake.lock:
        fake.conn = None                   # the test owns this connection now
    # QEMU stopped: it finds the reply and a peer that reads no more together
    # (a full close would also raise HUP, which may be handled first).
    q.proc.send_signal(signal.SIGSTOP)
    try:
        fake.answer_hello(conn, seq, version)
        conn.shutdown(socket.SHUT_RD)
    finally:
        q.proc.send_signal(signal.SIGCONT)
    # The link was READY (LINK_GEN counts it) and is down again; the chardev
    # reconnects 1 s later, so the reset below comes first.
    wait_for(lambda: dev.reg(REG_LINK_GEN) > gen and dev.reg(REG_LINK) == LINK_DOWN, 0.8,
             "the link to drop while the HELLO_REPLY is processed")
    conn.close()
    qmp.events.clear()
    t0 = time.monotonic()
    q.outb(0xCF9, 0x06)                    # ICH9 reset control: hard reset
    qmp.wait_event("RESET", 30)
    took = time.monotonic() - t0
    result("hardening.reset_after_failed_send_s", f"{took:.3f}")
    check(took < 2, f"the reset took {took:.1f} s")
    dev = Device(q)                        # the reset cleared the BARs
    dev.wait_link()
    slot, _ = dev.alloc(0x63)
    check(dev.slot_reg(slot, SLOT_REG_STATE) == SLOT_LIVE, "no channel after the reset")
    dev.free(slot)
    return dev


def check_daemon_stops_reading(dev, fake, qmp):
    """A daemon that stops reading must not freeze the VM: before, each
    trapped store's report was written with qemu_chr_fe_write_all under the
    BQL, and a full socket (a few hundred small messages) stopped the vCPU
    and the main loop until the daemon read again.  Reports now wait in the
    device, one per channel (the daemon needs only the latest IB_PUT), and
    reach the daemon when it reads again; the link stays up."""
    q = dev.q
    slot, chan = dev.alloc(0x66)
    n = fake.push_mode(chan, MODE_TRAPPED, 1)
    wait_for(lambda: len(fake.acks) > n, 5, "the TRAPPED ack")
    gen = dev.reg(REG_LINK_GEN)
    reports = len(fake.reports)
    stores = 5000
    fake.pause()
    try:
        t0 = time.monotonic()
        q.writel_many([(dev.ctrl(slot, CTRL_IB_PUT), put) for put in range(1, stores + 1)])
        took = time.monotonic() - t0
        check(fake.page(chan, CTRL_IB_PUT) == stores, "the stores were not forwarded to the GPU")
        queued = qom(qmp, "tx-queued-max")
        coalesced = qom(qmp, "tx-coalesced")
    finally:
        fake.paused = False
    result("hardening.unread_daemon_stores", f"{stores} in {took:.2f} s, reports coalesced {coalesced}, "
           f"most bytes queued {queued}")
    check(coalesced > 0, "the socket never filled: the case tests nothing")
    check(queued < 64 * 1024, f"{queued} bytes queued for one trapped channel")
    wait_for(lambda: fake.reports and fake.reports[-1] == (chan, stores), 5, "the latest IB_PUT to reach the daemon")
    got = len(fake.reports) - reports
    check(got + coalesced == stores, f"{got} reports and {coalesced} coalesced for {stores} stores")
    check(dev.reg(REG_LINK_GEN) == gen and dev.reg(REG_LINK) == LINK_READY, "the link dropped")
    dev.free(slot)


def check_daemon_never_reads(dev, fake, qmp):
    """A daemon that sends and never reads costs the device bounded memory:
    past 1 MiB queued the link is dropped (and comes back on reconnect),
    the VM keeps running.  Here each MODE push needs a MODE_ACK."""
    q = dev.q
    slot, chan = dev.alloc(0x67)
    gen = dev.reg(REG_LINK_GEN)
    pushes = 50000                      # 1.6 MB of acks
    fake.pause()
    try:
        with fake.lock:
            conn = fake.conn
        msg = HDR.pack(MAGIC, MSG_MODE, 0, 16, 0)
        data = b"".join(msg + struct.pack("<IIII", chan, MODE_DIRECT, k, 0) for k in range(pushes))
        try:
            conn.sendall(data)
        except OSError:
            pass                        # the device dropped the link first
        wait_for(lambda: dev.reg(REG_LINK) == LINK_DOWN or dev.reg(REG_LINK_GEN) > gen, 20,
                 "the link to drop")
        check(q.alive(), "QEMU died")
    finally:
        fake.paused = False
    wait_for(lambda: dev.reg(REG_LINK_GEN) > gen and dev.reg(REG_LINK) == LINK_READY, 10,
             "the reconnect")
    queued = qom(qmp, "tx-queued-max")
    result("hardening.never_reading_daemon_queued_max", queued)
    check(queued <= 1024 * 1024, f"{queued} bytes queued")
    check("pvgpud does not read" in q.read_stderr(), "no warning says why the link dropped")
    wait_for(lambda: dev.slot_reg(slot, SLOT_REG_STATE) == SLOT_LIVE, 10, "the lost channel's re-allocation")
    dev.free(slot)


# An eventfd's counter is at most 2^64 - 2: a write of 1 then blocks unless
# the file is O_NONBLOCK (eventfd(2)).
EVENTFD_MAX = 0xFFFFFFFFFFFFFFFE
# How long the device may take to answer while pvgpud blocks its doorbell:
# a qtest store or a QMP command is answered in one main-loop turn, well
# under 10 ms here (case fake times a doorbell store at ~0.1 ms; ASan is a few
# times slower), so 2 s is margin for a loaded host.  Blocked, the answer
# never comes: QEMU waits in write() until the daemon reads.
HOSTILE_BELL_BOUND_S = 2.0


def check_daemon_blocks_doorbell(dev, fake, qmp):
    """Issue 51 item 3: the doorbell eventfd is one open file shared with
    pvgpud, which can clear its O_NONBLOCK and fill its counter; a write of
    1 then blocks.  Before, QEMU wrote it from the vCPU (a trapped IB_PUT
    store, a doorbell store without KVM's ioeventfd) and from the main loop
    (the unshadow release): QEMU hung until pvgpud read.  Now a relay
    thread of the device writes it: every store and QMP command is answered
    within the bound, and the doorbell rings once pvgpud reads again."""
    q = dev.q
    slot, chan = dev.alloc(0x68)
    efd = fake.channels[chan]["bell"]
    n = fake.push_mode(chan, MODE_TRAPPED, 1)
    wait_for(lambda: len(fake.acks) > n, 5, "the TRAPPED ack")
    flags = fcntl.fcntl(efd, fcntl.F_GETFL)
    fcntl.fcntl(efd, fcntl.F_SETFL, flags & ~os.O_NONBLOCK)
    fake.bells(chan)                           # drained: now fill it
    os.eventfd_write(efd, EVENTFD_MAX)
    times = {}

    def timed(what, fn):
        t0 = time.monotonic()
        fn()
        times[what] = time.monotonic() - t0
        check(times[what] < HOSTILE_BELL_BOUND_S, f"{what} took {times[what]:.2f} s")

    full = True
    try:
        # A trapped IB_PUT store: forwarded, reported, rung (vCPU context).
        timed("trapped store", lambda: q.cmd(f"writel 0x{dev.ctrl(slot, CTRL_IB_PUT):x} 0x7",
                                             timeout=HOSTILE_BELL_BOUND_S))
        timed("query-status", lambda: qmp.execute("query-status", timeout=HOSTILE_BELL_BOUND_S))
        check(fake.page(chan, CTRL_IB_PUT) == 7, "the trapped store was not forwarded")
        wait_for(lambda: (chan, 7) in fake.reports, 5, "the trapped store's report")
        # Shadowed, then back: the unshadow releases the held IB_PUT and rings
        # (main loop); the DIRECT ack comes after it.
        n = fake.push_mode(chan, MODE_SHADOWED, 2)
        wait_for(lambda: len(fake.acks) > n, HOSTILE_BELL_BOUND_S, "the SHADOWED ack")
        timed("shadowed store", lambda: q.cmd(f"writel 0x{dev.ctrl(slot, CTRL_IB_PUT):x} 0x9",
                                              timeout=HOSTILE_BELL_BOUND_S))
        t0 = time.monotonic()
        n = fake.push_mode(chan, MODE_DIRECT, 3)
        wait_for(lambda: len(fake.acks) > n, HOSTILE_BELL_BOUND_S, "the unshadow's DIRECT ack")
        times["unshadow"] = time.monotonic() - t0
        check(fake.acks[-1] == (chan, MODE_DIRECT, 3, 9), f"unshadow ack {fake.acks[-1]}")
        check(fake.page(chan, CTRL_IB_PUT) == 9, "the held IB_PUT was not released")
        # A direct-mode doorbell store (without KVM: the device's handler).
        timed("doorbell store", lambda: q.cmd(f"writel 0x{dev.doorbell(slot):x} 0x1",
                                              timeout=HOSTILE_BELL_BOUND_S))
        timed("query-status again", lambda: qmp.execute("query-status",
                                                        timeout=HOSTILE_BELL_BOUND_S))
        check(q.alive(), "QEMU died")
        # pvgpud reads again: the doorbell QEMU could not ring rings now.
        check(struct.unpack("<Q", os.read(efd, 8))[0] == EVENTFD_MAX,
              "the counter changed while full")
        full = False
        wait_for(lambda: select.select([efd], [], [], 0)[0], 5,
                 "the doorbell to ring once pvgpud reads")
        check(fake.bells(chan) >= 1, "no doorbell after pvgpud read")
    finally:
        if full:                               # let a blocked QEMU go on
            with contextlib.suppress(OSError):
                os.read(efd, 8)
        fcntl.fcntl(efd, fcntl.F_SETFL, flags)
    result("hardening.blocked_doorbell_ms",
           ", ".join(f"{k} {v * 1000:.1f}" for k, v in times.items()))
    dev.free(slot)


def case_hardening(bins, tmp):
    sock = os.path.join(tmp, "fake.sock")
    fake = FakeDaemon(sock)
    disk = ["-drive", f"if=none,id=d0,driver=null-co,size=1M,read-zeroes=on,latency-ns={DMA_LATENCY_NS}",
            "-device", "ide-hd,drive=d0,bus=ide.0"]
    q = Qemu(bins.qemu, tmp, sock, uuidlib.uuid4(), name="vm-hard", slots=4, extra_args=disk,
             qmp=True)
    qmp = None
    try:
        dev = Device(q)
        qmp = Qmp(q.qmp_path)
        dev.wait_link()
        check_dma_after_free(dev, fake)
        check_store_behind_shadow(dev, fake)
        check_pong_for_alloc(dev, fake)
        check_unsealed_memfd(dev, fake)
        check_bell_not_eventfd(dev, fake)
        check_daemon_stops_reading(dev, fake, qmp)
        check_daemon_never_reads(dev, fake, qmp)
        check_daemon_blocks_doorbell(dev, fake, qmp)
        check_send_failure_mid_message(dev, fake, qmp)
        check(q.alive(), "QEMU died")
    finally:
        rc = q.shut_down(qmp, fake.close, tail=40)
    check(rc == 0, f"QEMU exit status {rc}")


def start_vm(bins, tmp, daemon, name, slots=16):
    vm_uuid = uuidlib.uuid4()
    q = Qemu(bins.qemu, tmp, daemon.socket, vm_uuid, name=name, slots=slots)
    dev = Device(q)
    dev.wait_link()
    return q, dev, vm_uuid


def wait_fence(dev, slot, target, timeout, what):
    def done():
        f = dev.q.readl(dev.ctrl(slot, CTRL_FENCE))
        return (f - target) & 0xFFFFFFFF < 0x80000000
    wait_for(done, timeout, what, step=0.005)


def case_daemon(bins, tmp):
    d = Pvgpud(bins, tmp)
    d.start()
    q = None
    try:
        q, dev, vm_uuid = start_vm(bins, tmp, d, "vm-qt")
        probe(dev, 16)
        # A weight set before the task has a channel waits for its entity.
        st, _, _ = dev.task_weight(1235, 50)
        check(st == CMDST_OK, f"TASK_WEIGHT before the task's channel: {st}")
        dev.set_task_name(b"qt-bench")
        slot, chan = dev.alloc(pid_hint=1234)
        ents = {e["path"]: e for e in d.ctl("list")["entities"]}
        check("vm-qt" in ents and ents["vm-qt"].get("uuid") == str(vm_uuid), f"list: {list(ents)}")
        task = ents.get("vm-qt/task-1234", {})
        check(task.get("channels") == 1, f"task entity: {ents}")
        check(task.get("task_name") == "qt-bench" and task.get("weight") == 100, f"task entity: {task}")
        # The guest sets its task's weight; the VM's own weight stays the admin's.
        st, r0, r1 = dev.task_weight(1234, 700)
        check((st, r0, r1) == (CMDST_OK, 0, 0), f"TASK_WEIGHT(1234, 700): {st}/{r0}/{r1}")
        ents = {e["path"]: e for e in d.ctl("list")["entities"]}
        task = ents.get("vm-qt/task-1234", {})
        check(task.get("weight") == 700 and task.get("task_name") == "qt-bench",
              f"pvgpuctl list after TASK_WEIGHT: {task}")
        check(ents["vm-qt"]["weight"] == 100, f"the VM's weight changed: {ents['vm-qt']}")
        result("daemon.task_weight_entity", json.dumps(task, sort_keys=True))
        # 64 kernels of 200 us: the simulated GPU runs them, FENCE reaches 64.
        put = 0
        t0 = time.monotonic()
        for _ in range(8):
            put = dev.submit(slot, put, 8, 200_000)
        wait_fence(dev, slot, 64, 10, "64 kernels to complete")
        took = time.monotonic() - t0
        check(q.readl(dev.ctrl(slot, CTRL_IB_GET)) == 64, "IB_GET after 64 entries")
        check(q.readl(dev.ctrl(slot, CTRL_STATUS)) == 0, "channel status not OK")
        result("daemon.64x200us_ms", f"{took * 1e3:.1f}")
        # FENCE_WAIT with the real GPU: 4 kernels of 20 ms; the wait ends
        # when FENCE reaches the last one, not before.
        dev.set_reg(REG_IRQ_ACK, 0xFFFFFFFF)
        start = put
        t0 = time.monotonic()
        put = dev.submit(slot, put, 4, 20_000_000)
        st, ws = dev.fence_wait(slot, put)
        check(st == CMDST_OK and ws == WAITST_ARMED, f"FENCE_WAIT({put}) right after submit: {st}/{ws}")
        ws = dev.wait_ended(slot, 10, "the fence wait on 4 x 20 ms")
        took = time.monotonic() - t0
        fence = q.readl(dev.ctrl(slot, CTRL_FENCE))
        check(ws == WAITST_OK and fence == put, f"wait ended {ws} at FENCE {fence} (want {put})")
        # 4 x 20 ms of work: the wait cannot end before 80 ms (5 ms of
        # slack for the clock reads around it).
        check(took >= 0.075, f"wait ended after {took * 1e3:.1f} ms, before the work could finish")
        check(dev.reg(REG_IRQ_STATUS) & IRQ_FENCE and dev.fence_done() & (1 << slot),
              "fence completion not signalled")
        result("daemon.fence_wait_4x20ms_ms", f"{took * 1e3:.1f}")
        st, ws = dev.fence_wait(slot, put)
        check(st == CMDST_OK and ws == WAITST_OK, f"FENCE_WAIT on a reached fence: {st}/{ws}")
        st, ws = dev.fence_wait(slot, start + 1)
        check(ws == WAITST_OK, f"FENCE_WAIT on an older fence: {ws}")
        # Past the end of the ring: more than 256 entries ahead of IB_GET is a
        # bad entry; the daemon kills the channel and the device says so.
        dev.set_task_name(b"qt-bad")
        slot2, chan2 = dev.alloc(pid_hint=1235)
        task = {e["path"]: e for e in d.ctl("list")["entities"]}.get("vm-qt/task-1235", {})
        check(task.get("weight") == 50 and task.get("task_name") == "qt-bad",
              f"the weight set before the channel: {task}")
        dev.set_reg(REG_IRQ_ACK, 0xFFFFFFFF)
        st, ws = dev.fence_wait(slot2, 1)
        check(ws == WAITST_ARMED, f"FENCE_WAIT on an idle channel: {st}/{ws}")
        q.writel(dev.ctrl(slot2, CTRL_IB_PUT), 1000)
        q.writel(dev.doorbell(slot2), 1)
        wait_for(lambda: dev.slot_reg(slot2, SLOT_REG_NOTICE) == 2, 5, "the BAD_ENTRY notice")
        check(dev.reg(REG_IRQ_STATUS) & IRQ_NOTICE, "no NOTICE interrupt")
        check(q.readl(dev.ctrl(slot2, CTRL_STATUS)) == 1, "dead channel's STATUS not ERROR")
        ws = dev.wait_ended(slot2, 2, "the wait on the dead channel")
        check(ws == WAITST_E_DEAD and dev.wait_reg(slot2, WAIT_REG_ERROR) == CHAN_ERR_BAD_ENTRY,
              f"wait on a BAD_ENTRY channel: {ws}/{dev.wait_reg(slot2, WAIT_REG_ERROR)}")
        st, ws = dev.fence_wait(slot2, 1)
        check(st == CMDST_OK and ws == WAITST_E_DEAD, f"FENCE_WAIT on a dead channel: {st}/{ws}")
        dev.free(slot2)
        # The first channel is unaffected.
        put = dev.submit(slot, put, 4, 100_000)
        wait_fence(dev, slot, put, 5, "the first channel after the other died")
        bad_mailbox(dev)
        # Channel limits: slots or the daemon's per-client limit, whichever is lower.
        got, st = [], CMDST_OK
        while st == CMDST_OK and len(got) < 64:
            st, s, _ = dev.command(CMD_CHAN_ALLOC, 7)
            if st == CMDST_OK:
                got.append(s)
        check(st in (CMDST_E_NOSLOT, CMDST_E_DAEMON), f"alloc flood ended with status {st}")
        result("daemon.channels_granted", len(got) + 1)
        for s in got:
            dev.free(s)
        dev.free(slot)
        check(d.ctl("stats")["channels"] == 0, "channels left in the daemon after freeing")
        # Guest reset (q35 reset control register): every channel goes back
        # to the daemon and mailbox/interrupt state starts afresh.
        for i in range(3):
            dev.alloc(pid_hint=2000 + i)
        dev.set_reg(REG_IRQ_MASK, IRQ_NOTICE)
        check(d.ctl("stats")["channels"] == 3, "three channels before the reset")
        q.cmd("outb 0xcf9 0x6")
        wait_for(lambda: d.ctl("stats")["channels"] == 0, 5, "the channels to be freed on reset")
        dev = Device(q)  # the reset cleared the BARs: map them again
        check(dev.reg(REG_IRQ_MASK) == IRQ_ALL and dev.reg(REG_IRQ_STATUS) == 0,
              f"after reset: IRQ_MASK {dev.reg(REG_IRQ_MASK):#x} IRQ_STATUS {dev.reg(REG_IRQ_STATUS):#x}")
        check(dev.reg(REG_ARG2) == 0 and dev.task_name() == bytes(TASK_NAME_LEN),
              "ARG2 / TASK_NAME not cleared by the reset")
        check(all(dev.slot_reg(i, SLOT_REG_STATE) == SLOT_FREE for i in range(dev.slots)),
              "slots not free after reset")
        slot, chan = dev.alloc(pid_hint=1234)
        put = dev.submit(slot, 0, 2, 100_000)
        wait_fence(dev, slot, put, 5, "work after the reset")
        dev.free(slot)
        check(q.alive() and d.alive(), "QEMU or pvgpud died")
    finally:
        rc = q.close() if q else 0
        d.stop()
    check(rc == 0, f"QEMU exit status {rc}")


def case_modes(bins, tmp):
    """A guest channel submits while a host throttle competes; the scheduler
    shadows / traps the guest channel.  Every entry must complete once."""
    d = Pvgpud(bins, tmp)
    d.start()
    q = load = None
    try:
        q, dev, _ = start_vm(bins, tmp, d, "vm-modes")
        slot, chan = dev.alloc(pid_hint=77)
        # A light VM against a heavy host task: the VM over-uses and gets
        # shadowed and unshadowed while it keeps submitting.
        d.ctl("set-weight", "vm-modes", "20")
        load = subprocess.Popen([bins.load, "throttle", "--socket", d.socket, "--name", "thr",
                                 "--kernel-us", "2000", "--channels", "2", "--duration-s", "30"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        kernel_ns = 500_000
        put = 0
        modes_seen = {}
        t_end = time.monotonic() + 4.0
        while time.monotonic() < t_end:
            get = q.readl(dev.ctrl(slot, CTRL_IB_GET))
            mode = dev.slot_reg(slot, SLOT_REG_MODE)
            modes_seen[mode] = modes_seen.get(mode, 0) + 1
            if (put - get) & 0xFFFFFFFF < 64:
                put = dev.submit(slot, put, 8, kernel_ns)
            else:
                time.sleep(0.002)
        stats_mid = d.ctl("stats")
        load.terminate()
        load.wait(10)
        load = None
        submitted = put
        wait_fence(dev, slot, submitted, 60, f"all {submitted} entries to complete")
        time.sleep(0.2)
        fence = q.readl(dev.ctrl(slot, CTRL_FENCE))
        get = q.readl(dev.ctrl(slot, CTRL_IB_GET))
        ents = {e["path"]: e for e in d.ctl("list")["entities"]}
        gpu_ms = ents["vm-modes"]["gpu_time_ms"]
        expect_ms = submitted * kernel_ns / 1e6
        counters = d.ctl("stats")["counters"]
        result("modes.submitted", submitted)
        result("modes.fence", fence)
        result("modes.modes_seen", json.dumps({MODE_NAMES[m]: c for m, c in modes_seen.items()}))
        result("modes.mode_switches", counters.get("mode_switches"))
        result("modes.traps", counters.get("traps"))
        result("modes.gpu_time_ms", f"{gpu_ms:.1f}")
        result("modes.expected_gpu_time_ms", f"{expect_ms:.1f}")
        log(f"stats mid-run: {json.dumps(stats_mid.get('counters'))}")
        check(fence == submitted and get == submitted,
              f"completed {fence} (IB_GET {get}) of {submitted} submitted")
        # pvgpud charges from the simulated GPU's context-switch trace, exactly
        # once every kernel completed (measured 668.0 ms for 668.0): a kernel
        # lost or run twice moves it by one kernel, so half a kernel is the bound.
        check(abs(gpu_ms - expect_ms) <= kernel_ns / 2e6,
              f"GPU time {gpu_ms:.1f} ms for {submitted} x {kernel_ns / 1e6} ms: "
              "lost or doubled submissions")
        check(counters.get("mode_switches", 0) > 0, "the scheduler never switched a mode")
        check(len(modes_seen) > 1 or counters.get("mode_switches", 0) > 0,
              "the guest channel was never switched")
        dev.free(slot)
        check(q.alive() and d.alive(), "QEMU or pvgpud died")
    finally:
        if load:
            load.kill()
            load.wait()
        rc = q.close() if q else 0
        d.stop()
    check(rc == 0, f"QEMU exit status {rc}")


def case_restart(bins, tmp):
    d = Pvgpud(bins, tmp)
    d.start()
    q = None
    try:
        q, dev, vm_uuid = start_vm(bins, tmp, d, "vm-restart")
        slot, chan = dev.alloc(pid_hint=5)
        put = dev.submit(slot, 0, 4, 100_000)
        wait_fence(dev, slot, put, 5, "work before the restart")
        gen = dev.reg(REG_LINK_GEN)
        st, ws = dev.fence_wait(slot, put + 1)
        check(ws == WAITST_ARMED, f"FENCE_WAIT for work never submitted: {st}/{ws}")
        d.stop(signal.SIGKILL)
        wait_for(lambda: dev.slot_reg(slot, SLOT_REG_STATE) == SLOT_LOST, 5, "the slot to be lost")
        check(dev.wait_reg(slot, WAIT_REG_STATUS) == WAITST_E_DEAD and
              dev.wait_reg(slot, WAIT_REG_ERROR) == CHAN_ERR_LOST, "wait not ended by the lost link")
        st, ws = dev.fence_wait(slot, put + 1)
        check(st == CMDST_OK and ws == WAITST_E_DEAD, f"FENCE_WAIT on a lost slot: {st}/{ws}")
        st, ws = dev.fence_wait(slot, put)
        check(ws == WAITST_OK, f"FENCE_WAIT for completed work on a lost slot: {ws}")
        check(q.readl(dev.ctrl(slot, CTRL_STATUS)) == 1 and
              q.readl(dev.ctrl(slot, CTRL_ERROR)) == CHAN_ERR_LOST, "lost channel's page")
        st, _, _ = dev.command(CMD_CHAN_ALLOC)
        check(st == CMDST_E_LINK, f"alloc without a daemon: {st}")
        q.writel(dev.ctrl(slot, CTRL_IB_PUT), 99)       # dropped, no crash
        d.start()
        wait_for(lambda: dev.reg(REG_LINK_GEN) > gen and dev.slot_reg(slot, SLOT_REG_STATE) == SLOT_LIVE,
                 15, "reconnect and re-allocation")
        check(q.readl(dev.ctrl(slot, CTRL_IB_PUT)) == 0, "re-allocated channel not fresh")
        put = dev.submit(slot, 0, 4, 100_000)
        wait_fence(dev, slot, put, 5, "work after the restart")
        ents = {e["path"]: e for e in d.ctl("list")["entities"]}
        check("vm-restart/task-5" in ents, f"entities after restart: {list(ents)}")
        dev.free(slot)
        check(q.alive(), "QEMU died")
    finally:
        rc = q.close() if q else 0
        d.stop()
    check(rc == 0, f"QEMU exit status {rc}")


ACPI_PCIHP_EJECT = 0xAE08   # PIIX4 ACPI PCI hotplug: the guest's eject register


def unplug(q, qmp):
    """Hot-unplug pvgpu0 as a guest would on `pc`: device_del raises the ACPI
    eject request, the guest's ACPI code ejects the slot."""
    qmp.events.clear()
    qmp.execute("device_del", id="pvgpu0")
    q.outl(ACPI_PCIHP_EJECT, 1 << PCI_DEV)
    ev = qmp.wait_event("DEVICE_DELETED", 10)
    check(ev["data"].get("device") in ("pvgpu0", None), f"DEVICE_DELETED {ev}")


def case_unplug(bins, tmp):
    """Item 10: unplug gives everything back to pvgpud (its channels, the VM
    entity, the connection) and a re-plugged device is a new VM for the
    daemon, all without a protocol error."""
    d = Pvgpud(bins, tmp)
    d.start()
    vm_uuid = uuidlib.uuid4()
    q = Qemu(bins.qemu, tmp, d.socket, vm_uuid, name="vm-plug", slots=4, machine="pc", qmp=True)
    qmp = None

    def entities():
        return {e["path"]: e for e in d.ctl("list")["entities"]}
    try:
        dev = Device(q)
        qmp = Qmp(q.qmp_path)
        dev.wait_link()
        for rnd in range(2):
            slot, _ = dev.alloc(pid_hint=0x70 + rnd)
            put = dev.submit(slot, 0, 4, 100_000)
            wait_fence(dev, slot, put, 10, "4 kernels before the unplug")
            ents = entities()
            check(ents.get(f"vm-plug/task-{0x70 + rnd}", {}).get("channels") == 1,
                  f"round {rnd}: task entity before the unplug: {list(ents)}")
            unplug(q, qmp)
            wait_for(lambda: not any(p.startswith("vm-plug") for p in entities()), 5,
                     "pvgpud to drop the unplugged VM and its channels")
            check(q.readl(BAR0_GPA + REG_MAGIC) != DEV_MAGIC, "the unplugged device still answers")
            qmp.execute("device_add", driver="pvgpu", chardev="pv", addr=f"{PCI_DEV:02x}.0",
                        slots=4, id="pvgpu0")
            dev = Device(q)
            dev.wait_link()
            check(dev.slot_reg(0, SLOT_REG_STATE) == SLOT_FREE, "a re-plugged device starts with a used slot")
        check(not [l for l in d.lines if "HELLO" in l and ("second" in l or "already" in l)],
              "pvgpud refused a HELLO: " + "; ".join(d.lines[-10:]))
        result("unplug.rounds", 2)
        check(q.alive() and d.alive(), "QEMU or pvgpud died")
    finally:
        rc = q.shut_down(qmp, d.stop)
    check(rc == 0, f"QEMU exit status {rc}")


# ---- migration (docs/pvgpu-device.md section 9) ------------------------------------------


class MigVm:
    """A QEMU under qtest with QMP, as a migration's source or (incoming=URI)
    its destination."""

    def __init__(self, bins, tmp, daemon, name, vm_uuid, incoming=None, slots=16):
        extra = ["-incoming", incoming] if incoming else []
        self.q = Qemu(bins.qemu, tmp, daemon.socket, vm_uuid, name=name, slots=slots, qmp=True,
                      extra_args=extra)
        # The socket file appears at bind(), a moment before QEMU listens.
        deadline = time.monotonic() + 10
        while True:
            try:
                self.qmp = Qmp(self.q.qmp_path)
                break
            except ConnectionRefusedError:
                if time.monotonic() > deadline or not self.q.alive():
                    raise TestFailure(f"{name}: QMP refused: {self.q.read_stderr()[-1000:]}")
                time.sleep(0.01)

    def migrate(self, uri, timeout=30):
        """Migrates with the return path (so a destination's refusal fails
        the migration here) and returns the final status, by QMP events."""
        # (A file has no way back: the return path only with a socket.)
        self.qmp.execute("migrate-set-capabilities", capabilities=[
            {"capability": "return-path", "state": uri.startswith("unix:")},
            {"capability": "events", "state": True}])
        self.qmp.execute("migrate", uri=uri)
        deadline = time.monotonic() + timeout
        while True:
            e = self.qmp.wait_event("MIGRATION", max(0.0, deadline - time.monotonic()))
            st = e["data"]["status"]
            if st in ("completed", "failed", "cancelled"):
                return st

    def status(self):
        return self.qmp.execute("query-status")["status"]

    def cont(self):
        """`cont` once QEMU takes it: a migration's end (finish-migrate) is
        over a moment after its MIGRATION event."""
        def done():
            try:
                self.qmp.execute("cont")
                return True
            except TestFailure as e:
                if "not finalized" not in str(e):
                    raise
                return False
        wait_for(done, 10, "QEMU to accept cont", step=0.01)

    def exit_status(self, timeout):
        """A destination that refused the stream exits by itself."""
        try:
            return self.q.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise TestFailure(f"QEMU did not exit within {timeout} s: {self.q.read_stderr()[-1500:]}")

    def close(self):
        with contextlib.suppress(Exception):
            self.qmp.close()
        return self.q.close()


def refused_stream(bins, tmp, daemon, name, vm_uuid, uri, message, source=None, slots=16):
    """A destination fed a stream that does not fit: it exits non-zero (not
    a crash) saying `message`; the source, if any, runs on."""
    b = MigVm(bins, tmp, daemon, name, vm_uuid, incoming=uri, slots=slots)
    try:
        if source:
            st = source.migrate(uri.replace("unix:", "unix:", 1))
            check(st == "failed", f"{name}: migration {st}, want failed")
        rc = b.exit_status(30)
        err = b.q.read_stderr()
        check(rc == 1, f"{name}: the destination exited {rc} (want 1, a clean refusal): {err[-1500:]}")
        check(message in err, f"{name}: the destination does not say {message!r}: {err[-1500:]}")
        result(f"migrate.refused.{name}", next(l for l in err.splitlines() if message in l)[:200])
    finally:
        b.q.stderr.close()
    if source:
        wait_for(lambda: source.status() == "running", 10, f"{name}: the source to run on")


def work_completes(dev, slot, put, what, n=2):
    put = dev.submit(slot, put, n, 100_000)
    wait_fence(dev, slot, put, 10, what)
    return put


def case_migrate(bins, tmp):
    dirs = {k: os.path.join(tmp, k) for k in ("a", "b", "c")}
    for d in dirs.values():
        os.mkdir(d)
    da, db = Pvgpud(bins, dirs["a"]), Pvgpud(bins, dirs["b"])
    # Host C's pvgpud takes no VMM but `nobody`: it refuses the VM's HELLO.
    dc = Pvgpud(bins, dirs["c"], "[daemon]\nvmm_users = nobody\n")
    for d in (da, db, dc):
        d.start()
    vm_uuid = uuidlib.uuid4()
    a = b = None
    try:
        a = MigVm(bins, tmp, da, "vm-a", vm_uuid)
        dev = Device(a.q)
        dev.wait_link()
        dev.set_task_name(b"qt-mig")
        slot, chan = dev.alloc(pid_hint=4242)
        st, _, _ = dev.task_weight(4242, 300)
        check(st == CMDST_OK, f"TASK_WEIGHT: {st}")
        put = work_completes(dev, slot, 0, "work before any migration")
        sock = os.path.join(tmp, "mig.sock")

        # 1. The destination's device has other slots: refused on load.
        refused_stream(bins, tmp, db, "slots", vm_uuid, f"unix:{sock}",
                       "the destination's 'slots' differs", source=a, slots=8)
        put = work_completes(dev, slot, put, "work at A after the refused migration")
        # 2. The destination's pvgpud refuses the VM: the load fails after A
        # quiesced its channels; A resumes them.
        refused_stream(bins, tmp, dc, "hello", vm_uuid, f"unix:{sock}",
                       "this host's pvgpud did not accept the VM (HELLO)", source=a)
        put = work_completes(dev, slot, put, "work at A after the refused HELLO")
        stats = da.ctl("stats")["counters"]
        check(stats.get("quiesces", 0) >= 1 and stats.get("resumes", 0) >= 1,
              f"pvgpud A quiesced and resumed the VM: {stats}")

        # 3. A real migration.  Work the GPU was given (a direct channel's
        # submissions) completes at A; work the guest stored but the GPU was
        # not given (here: stored while A is stopped, without a doorbell,
        # as a guest whose doorbell never came) travels in the ring and
        # runs at B, each entry once and in order.
        put = dev.submit(slot, put, 10, 2_000_000)
        wait_fence(dev, slot, put, 10, "10 kernels at A")
        a.qmp.execute("stop")
        start = put
        data = b"".join(struct.pack("<QII", 2_000_000, put + i + 1, 0) for i in range(6))
        a.q.write(dev.ring(slot, put), data[:16 * min(6, RING_ENTRIES - put % RING_ENTRIES)])
        if put % RING_ENTRIES + 6 > RING_ENTRIES:
            a.q.write(dev.ring(slot, 0), data[16 * (RING_ENTRIES - put % RING_ENTRIES):])
        put = (put + 6) & 0xFFFFFFFF
        a.q.writel(dev.ctrl(slot, CTRL_IB_PUT), put)
        st, ws = dev.fence_wait(slot, put)
        check(st == CMDST_OK and ws == WAITST_ARMED, f"FENCE_WAIT before the migration: {st}/{ws}")
        b = MigVm(bins, tmp, db, "vm-b", vm_uuid, incoming=f"unix:{sock}")
        t0 = time.monotonic()
        st = a.migrate(f"unix:{sock}")
        check(st == "completed", f"migration A -> B: {st}: {b.q.read_stderr()[-1500:]}")
        result("migrate.total_ms", f"{(time.monotonic() - t0) * 1e3:.0f}")
        wait_for(lambda: a.status() == "postmigrate", 10, "A to end in postmigrate")
        fence_at_a = a.q.readl(dev.ctrl(slot, CTRL_FENCE))
        check(fence_at_a == start, f"FENCE at A's end {fence_at_a}, want {start} (nothing of the held work)")
        wait_for(lambda: b.status() == "paused", 10, "B to have loaded the stream (paused, as A was)")
        devb = Device(b.q)
        check(devb.slot_reg(slot, SLOT_REG_STATE) == SLOT_LIVE, "the slot is not live at B")
        check(devb.task_name() == b"qt-mig".ljust(TASK_NAME_LEN, b"\0"), "TASK_NAME at B")
        check(devb.slot_reg(slot, SLOT_REG_CHAN_ID) != 0, "no channel id at B")
        b.cont()
        try:
            ws = devb.wait_ended(slot, 10, "the fence wait at B")
        except TestFailure as e:
            raise TestFailure(f"{e}: FENCE {b.q.readl(devb.ctrl(slot, CTRL_FENCE))} IB_GET "
                              f"{b.q.readl(devb.ctrl(slot, CTRL_IB_GET))} IB_PUT "
                              f"{b.q.readl(devb.ctrl(slot, CTRL_IB_PUT))} want {put}, status {b.status()}, "
                              f"fence-polls {qom(b.qmp, 'fence-polls')}; mode {devb.slot_reg(slot, SLOT_REG_MODE)}; pvgpud B: {db.ctl('list')['entities']} " + "\n".join(db.lines[-15:]))
        check(ws == WAITST_OK, f"the fence wait at B ended {ws}")
        check(b.q.readl(devb.ctrl(slot, CTRL_FENCE)) == put and
              b.q.readl(devb.ctrl(slot, CTRL_IB_GET)) == put,
              f"at B FENCE {b.q.readl(devb.ctrl(slot, CTRL_FENCE))} IB_GET "
              f"{b.q.readl(devb.ctrl(slot, CTRL_IB_GET))}, want {put}")
        ents = {e["path"]: e for e in db.ctl("list")["entities"]}
        task = ents.get("vm-b/task-4242", {})
        check(task.get("weight") == 300 and task.get("task_name") == "qt-mig" and task.get("channels") == 1,
              f"pvgpud B's task after the migration: {task} ({list(ents)})")
        check(db.ctl("stats")["counters"].get("restored_channels") == 1, f"pvgpud B: {db.ctl('stats')}")
        put = work_completes(devb, slot, put, "new work at B")
        a.qmp.execute("quit")
        a.q.proc.wait(10)
        a.q.stderr.close()
        a = None
        wait_for(lambda: not [e for e in da.ctl("list")["entities"] if e.get("uuid") == str(vm_uuid)],
                 10, "pvgpud A to drop the VM")

        # 4. Streams that do not fit: saved to a file (B quiesces and, its
        # VM running again, resumes), then altered.
        path = os.path.join(tmp, "stream")
        st = b.migrate(f"exec:cat > {path}")
        check(st == "completed", f"migration to a file: {st}")
        b.cont()
        wait_for(lambda: b.status() == "running", 10, "B to run again")
        put = work_completes(devb, slot, put, "work at B after saving to a file")
        data = open(path, "rb").read()
        ident = b"0000:00:04.0/pvgpu"
        at = data.find(bytes([len(ident)]) + ident)
        check(at > 0, "no pvgpu section in the stream")
        ver = at + 1 + len(ident) + 4
        check(struct.unpack_from(">I", data, ver)[0] == 1, "the pvgpu section's version is not 1")
        name = b"qt-mig".ljust(TASK_NAME_LEN, b"\0")
        slot_at = data.rfind(name)
        check(struct.unpack_from(">II", data, slot_at + TASK_NAME_LEN) == (SLOT_LIVE, 0),
              "slot 0's state and mode not found after its task name")

        def variant(label, edit):
            f = os.path.join(tmp, f"stream-{label}")
            with open(f, "wb") as out:
                out.write(edit(bytearray(data)))
            return f"exec:cat {f}"

        def put32(buf, off, val):
            struct.pack_into(">I", buf, off, val)
            return buf

        refused_stream(bins, tmp, da, "version", vm_uuid, variant("version", lambda d: put32(d, ver, 7)),
                       "unsupported version 7 for '0000:00:04.0/pvgpu' v1")
        refused_stream(bins, tmp, da, "mode", vm_uuid,
                       variant("mode", lambda d: put32(d, slot_at + TASK_NAME_LEN + 4, 9)),
                       "does not fit this device: slot 0: mode 9")
        refused_stream(bins, tmp, da, "state", vm_uuid,
                       variant("state", lambda d: put32(d, slot_at + TASK_NAME_LEN, 0x41414141)),
                       "does not fit this device: slot 0: state")
        refused_stream(bins, tmp, da, "truncated", vm_uuid, variant("truncated", lambda d: d[:slot_at + 100]),
                       "load of migration failed")
        # The unaltered stream loads, and the channel runs at A's pvgpud.
        b.close()
        b = None
        c = MigVm(bins, tmp, da, "vm-file", vm_uuid, incoming=f"exec:cat {path}")
        try:
            wait_for(lambda: c.status() == "running", 20, "the saved stream to load")
            devc = Device(c.q)
            work_completes(devc, slot, put, "work after loading the saved stream")
        finally:
            c.close()
        check(da.alive() and db.alive() and dc.alive(), "a pvgpud died")
    finally:
        for vm in (a, b):
            if vm:
                vm.close()
        for d in (da, db, dc):
            d.stop()


CASES = {"fake": case_fake, "daemon": case_daemon, "modes": case_modes, "restart": case_restart,
         "hardening": case_hardening, "unplug": case_unplug, "migrate": case_migrate}


SANITIZER_REPORTS = ("ERROR: AddressSanitizer", "ERROR: LeakSanitizer", "runtime error:")


def check_sanitizers(tmp):
    """A QEMU built with --enable-sanitizers (build-qemu.sh --asan) reports to
    its stderr; a report fails the case even when QEMU lived on (UBSan)."""
    for f in sorted(os.listdir(tmp)):
        if f.startswith("qemu-") and f.endswith(".log"):
            text = open(os.path.join(tmp, f), errors="replace").read()
            hit = next((r for r in SANITIZER_REPORTS if r in text), None)
            if hit:
                at = text.index(hit)
                raise TestFailure(f"sanitizer report in {f}:\n" + text[max(0, at - 200):at + 3000])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--qemu", required=True)
    ap.add_argument("--pvgpud")
    ap.add_argument("--pvgpuctl")
    ap.add_argument("--load")
    ap.add_argument("--asan", action="store_true",
                    help="--qemu is the sanitizer build (qemu-patches/build-qemu.sh --asan)")
    ap.add_argument("case", choices=list(CASES) + ["all"])
    bins = ap.parse_args()
    cache_env = "PVGPU_QEMU_ASAN_DIR" if bins.asan else "PVGPU_QEMU_DIR"
    if os.environ.get(cache_env):
        bins.qemu = os.path.join(os.environ[cache_env], "qemu-system-x86_64")
    # Sanitizer builds: QEMU's own exit-time leaks are not ours to judge;
    # any other report stops QEMU (UBSan too) and fails the case.
    os.environ.setdefault("ASAN_OPTIONS", "detect_leaks=0:abort_on_error=0:exitcode=99")
    os.environ.setdefault("UBSAN_OPTIONS", "halt_on_error=1:print_stacktrace=1")
    for tool in ("pvgpud", "pvgpuctl", "load"):
        if bins.case not in ("fake", "hardening") and not getattr(bins, tool):
            ap.error(f"--{tool} is needed for case {bins.case}")
    if not os.access(bins.qemu, os.X_OK):
        print(f"SKIP: no QEMU build at {bins.qemu} (run qemu-patches/build-qemu.sh"
              f"{' --asan' if bins.asan else ''})")
        return 77
    cases = list(CASES) if bins.case == "all" else [bins.case]
    for name in cases:
        tmp = tempfile.mkdtemp(prefix=f"pvgpu-qemu-{name}-")
        log(f"case {name} in {tmp}")
        try:
            CASES[name](bins, tmp)
            check_sanitizers(tmp)
        except TestFailure as e:
            print(f"FAIL {name}: {e}", flush=True)
            print(f"# files kept in {tmp}")
            return 1
        shutil.rmtree(tmp, ignore_errors=True)
        print(f"PASS {name}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
