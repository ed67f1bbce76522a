"""Helpers shared by the Python end-to-end tests (tests/daemon, tests/qemu,
tests/vm, tests/libvirt)."""

import json
import os
import re
import select
import shlex
import signal
import socket
import subprocess
import tempfile
import time


class TestFailure(Exception):
    """A check failed: the test exits 1 with the message."""


class Skip(Exception):
    """The test cannot run here: it exits 77 (meson's 'skipped')."""


def check(cond, message):
    if not cond:
        raise TestFailure(message)


def result(key, value):
    """A measurement, grep-able from meson's test log as RESULT key=value."""
    print(f"RESULT {key}={value}", flush=True)


def rerun(case, cause, evidence=None):
    """A case run again after a failure the harness attributes to `cause`:
    never silent.  tests/summary.py counts the test as passed after a rerun
    and lists the case, the cause and where the evidence is."""
    line = f"RERUN case={shlex.quote(case)} cause={shlex.quote(cause)}"
    if evidence:
        line += f" evidence={shlex.quote(evidence)}"
    print(line, flush=True)


def evidence_dir(name):
    """A fresh directory path (not yet made) for what a failure leaves behind:
    under $PVGPU_EVIDENCE_DIR, else the build's meson-logs/evidence
    ($PVGPU_BUILD_DIR), else the system's temporary directory."""
    base = os.environ.get("PVGPU_EVIDENCE_DIR") or os.path.join(
        os.environ.get("PVGPU_BUILD_DIR") or tempfile.gettempdir(), "meson-logs", "evidence")
    n = 1
    while os.path.exists(os.path.join(base, f"{name}-{n}")):
        n += 1
    return os.path.join(base, f"{name}-{n}")


def log(message):
    print(f"# {message}", flush=True)


def monotonic_from_wall(wall):
    """A wall-clock time (seconds since the epoch, as QEMU stamps its events)
    on this host's monotonic clock, which the tests' measurements use."""
    return wall - (time.time() - time.monotonic())


def recv_lines(conn, stop=None):
    """The newline-ended lines a stream socket sends (bytes, without the
    newline) until it closes or `stop` (an Event) is set."""
    buf = b""
    while stop is None or not stop.is_set():
        data = conn.recv(65536)
        if not data:
            return
        buf += data
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            yield line


def wait_for(pred, timeout, what, step=0.002):
    """Polls an observable condition (a register, a file, a listing) until it
    holds; returns its value."""
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise TestFailure(f"timed out after {timeout} s waiting for {what}")
        time.sleep(step)


def stop_process(proc, sig=signal.SIGTERM, timeout=10):
    """Asks a child to end with `sig`, kills it after `timeout` s; returns its status."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def run_case(name, run, args):
    """Run `run(args, tmp)` in a fresh temporary directory and map the outcome
    to the exit status meson expects: 0 pass, 1 fail, 77 skipped."""
    with tempfile.TemporaryDirectory(prefix=f"pvgpu-{name}-") as tmp:
        try:
            run(args, tmp)
        except Skip as e:
            print(f"SKIP: {e}")
            return 77
        except TestFailure as e:
            print(f"FAIL: {e}")
            return 1
    log(f"PASS {name}")
    return 0


# ---- C headers (include/pvgpu/) ----------------------------------------------

_C_TOKEN = re.compile(r"\s*(?:(0[xX][0-9a-fA-F]+|\d+)[uUlL]*|([A-Za-z_]\w*)|(<<|>>|[-+*|&^~()]))")


def _c_int_expr(text, names):
    """The value of a C integer constant expression made of numbers, names in
    `names`, unary - ~, binary * + - << >> & ^ | and parentheses; None for
    anything else (a cast, sizeof, a string, an unknown name)."""
    toks, pos = [], 0
    text = text.strip()
    while pos < len(text):
        m = _C_TOKEN.match(text, pos)
        if not m:
            return None
        pos = m.end()
        if m.group(1):
            if re.match(r"0\d", m.group(1)):
                return None                     # octal: not used in these headers
            toks.append(int(m.group(1), 0))
        elif m.group(2):
            if m.group(2) not in names:
                return None
            toks.append(names[m.group(2)])
        else:
            toks.append(m.group(3))
    levels = [("|",), ("^",), ("&",), ("<<", ">>"), ("+", "-"), ("*",)]
    ops = {"|": int.__or__, "^": int.__xor__, "&": int.__and__, "<<": int.__lshift__,
           ">>": int.__rshift__, "+": int.__add__, "-": int.__sub__, "*": int.__mul__}
    i = 0

    def binary(level):
        nonlocal i
        if level == len(levels):
            return unary()
        v = binary(level + 1)
        while i < len(toks) and toks[i] in levels[level]:
            op = toks[i]
            i += 1
            v = ops[op](v, binary(level + 1))
        return v

    def unary():
        nonlocal i
        if i == len(toks):
            raise ValueError("expression ends early")
        t = toks[i]
        i += 1
        if isinstance(t, int):
            return t
        if t == "-":
            return -unary()
        if t == "~":
            return ~unary()
        if t == "(":
            v = binary(0)
            if i == len(toks) or toks[i] != ")":
                raise ValueError("unbalanced parentheses")
            i += 1
            return v
        raise ValueError(f"unexpected {t!r}")

    try:
        v = binary(0)
    except ValueError:
        return None
    return v if i == len(toks) else None


def c_defines(path, prefix="PVGPU_", _names=None):
    """The integer #defines of the C header `path` as {name less `prefix`: value},
    e.g. c_defines(".../include/pvgpu/regs.h")["REG_MAGIC"].  Headers it
    #includes "like this" (beside it) are read first, for the names its
    values use, but only the header's own names are returned.  Lines whose
    value is not an integer expression (_c_int_expr), and function-like
    macros, are skipped."""
    names = {} if _names is None else _names
    with open(path) as f:
        text = f.read()
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    text = re.sub(r"//[^\n]*", "", text).replace("\\\n", " ")
    own = {}
    for line in text.splitlines():
        m = re.match(r'\s*#\s*include\s+"([^"]+)"', line)
        if m:
            c_defines(os.path.join(os.path.dirname(path), m.group(1)), prefix, names)
            continue
        m = re.match(r"\s*#\s*define\s+([A-Za-z_]\w*)(?!\()\s+(.+)", line)
        if not m:
            continue
        v = _c_int_expr(m.group(2), names)
        if v is not None:
            names[m.group(1)] = own[m.group(1)] = v
    return {k[len(prefix):] if k.startswith(prefix) else k: v for k, v in own.items()}


class Qmp:
    """A minimal QMP client on QEMU's -qmp socket (tests/qemu, and pvgpu-vm
    --qmp PATH in tests/vm); events are kept in order."""

    def __init__(self, path, timeout=30):
        self.sock = None

        def connected():  # QEMU creates and listens on the socket as it starts
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.connect(path)
            except OSError:
                s.close()
                return False
            self.sock = s
            return True

        wait_for(connected, timeout, f"QMP socket {path}", step=0.01)
        self.buf = b""
        self.events = []
        self.read(timeout)  # the greeting
        self.execute("qmp_capabilities")

    def read(self, timeout):
        """The next message, or None after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.sock], [], [], left)[0]:
                return None
            chunk = self.sock.recv(65536)
            if not chunk:
                raise TestFailure("QMP connection closed")
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)

    def execute(self, command, timeout=30, **arguments):
        msg = {"execute": command}
        if arguments:
            msg["arguments"] = arguments
        self.sock.sendall(json.dumps(msg).encode() + b"\n")
        while True:
            reply = self.read(timeout)
            if reply is None:
                raise TestFailure(f"QMP {command}: no reply within {timeout} s")
            if "event" in reply:
                self.events.append(reply)
            elif "error" in reply:
                raise TestFailure(f"QMP {command}: {reply['error']}")
            elif "return" in reply:
                return reply["return"]

    def wait_event(self, name, timeout):
        """The first event called `name`, kept or still to come."""
        deadline = time.monotonic() + timeout
        while True:
            for i, e in enumerate(self.events):
                if e["event"] == name:
                    return self.events.pop(i)
            msg = self.read(max(0.0, deadline - time.monotonic()))
            if msg is None:
                raise TestFailure(f"no QMP event {name} within {timeout} s")
            if "event" in msg:
                self.events.append(msg)

    def migrate(self, uri, timeout=120):
        """A migration with the return path; the final status, by MIGRATION events."""
        self.execute("migrate-set-capabilities", capabilities=[
            {"capability": "return-path", "state": True}, {"capability": "events", "state": True}])
        self.execute("migrate", uri=uri)
        return self.wait_migration(("completed", "failed", "cancelled"), timeout)

    def wait_migration(self, statuses, timeout):
        """The next MIGRATION event whose status is one of `statuses`."""
        deadline = time.monotonic() + timeout
        while True:
            for i, e in enumerate(self.events):
                if e["event"] == "MIGRATION":
                    self.events.pop(i)
                    if e["data"]["status"] in statuses:
                        return e["data"]["status"]
                    break
            else:
                msg = self.read(max(0.0, deadline - time.monotonic()))
                if msg is None:
                    raise TestFailure(f"no MIGRATION event {statuses} within {timeout} s")
                if "event" in msg:
                    self.events.append(msg)

    def close(self):
        self.sock.close()
