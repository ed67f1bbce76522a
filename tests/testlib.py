"""Helpers shared by the Python end-to-end tests (tests/daemon, tests/qemu)."""


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


def log(message):
    print(f"# {message}", flush=True)
