"""Helpers shared by the Python end-to-end tests (tests/daemon, tests/qemu,
tests/vm, tests/libvirt)."""

import os
import shlex
import signal
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
