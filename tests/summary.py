#!/usr/bin/env python3
"""The suite's closing summary, and the pinned targets not met yet.

A target the code does not meet yet (tests/unmet-targets.txt) runs as a test
that prints its measured figures on a line

    UNMET NAME measured=X target=Y [KEY=VALUE ...]

Every figure is "lower is better"; the file records, per target, the figure
measured when it was pinned.  Such a test is *pinned*: it counts as failed
when it crashed (killed by a signal, timed out), printed no UNMET line, or
printed a figure above the recorded one; and as failed too once it no longer
prints one (the target is met: take it out of the file).

    summary.py run-pinned [--pins FILE] NAME -- COMMAND...
        Runs COMMAND (its output passed through) and judges it as above:
        exit 0 for a target not met but no worse than pinned, 1 otherwise.
        meson runs the pinned targets through this, so a crash or a worse
        figure is a FAIL in meson's own summary as well (under meson 1.0 a
        should_fail test turns any non-zero exit, a segfault included,
        into EXPECTEDFAIL).

    summary.py summarize [--pins FILE] [--tests TESTLOG] [--benchmarks TESTLOG]
        The closing summary of tests/run-all.sh from meson's testlog.json
        files.  Prints one line per rerun (RERUN lines in a test's output:
        case and cause), a line for the targets not met, a line for the
        benchmarks, and last

            N passed (M after a rerun), N failed, N skipped

        where "passed" and "failed" count tests only: an unmet target is
        neither (unless it fails its pin), a benchmark neither.  A benchmark
        counts as failed when it crashed or printed no RESULT line.  Exit 1
        if anything failed.

A rerun is announced by the test with a line

    RERUN case=CASE cause="WHAT THE HARNESS SAW" [evidence=PATH]

(tests/testlib.py: rerun()).  tests/test_summary.py tests this file.
"""

import argparse
import json
import os
import re
import shlex
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_PINS = os.path.join(HERE, "unmet-targets.txt")
UNMET = re.compile(r"^UNMET (?P<name>[\w.-]+) (?P<rest>.*)$", re.M)
RERUN = re.compile(r"^RERUN (?P<rest>.*)$", re.M)
RESULT = re.compile(r"^RESULT \S", re.M)
FAIL_REASON = re.compile(r"^FAIL: (.*)$", re.M)
# meson results that mean the process did not end by itself.
CRASHED = {"TIMEOUT", "INTERRUPT", "ERROR"}


def parse_kv(text):
    """KEY=VALUE words (values may be shell-quoted) as a dict."""
    out = {}
    try:
        words = shlex.split(text)
    except ValueError:
        words = text.split()
    for w in words:
        if "=" in w:
            k, v = w.split("=", 1)
            out[k] = v
    return out


def load_pins(path=DEFAULT_PINS):
    """NAME -> {figure: recorded value, 'target': ...} from the pins file:
    one target per line, `NAME measured=X target=Y [KEY=VALUE ...]`,
    '#' comments (the command and the spread each figure came from)."""
    pins = {}
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            name, _, rest = line.partition(" ")
            kv = parse_kv(rest)
            if "measured" not in kv or "target" not in kv:
                raise ValueError(f"{path}:{n}: want 'NAME measured=X target=Y ...', got {line!r}")
            for k, v in kv.items():
                float(v)  # every figure is a number
            pins[name] = kv
    return pins


def unmet_line(stdout, name):
    """The figures of the last UNMET line naming `name`, or None."""
    found = None
    for m in UNMET.finditer(stdout or ""):
        if m.group("name") == name:
            found = parse_kv(m.group("rest"))
    return found


def judge_pinned(name, pin, returncode, stdout, result=None):
    """('unmet', text) for a target not met but no worse than pinned;
    ('failed', why) otherwise.  returncode < 0: killed by that signal."""
    if result in CRASHED:
        return "failed", f"{name}: {result.lower()}, no trustworthy figure"
    if returncode is not None and returncode < 0:
        return "failed", f"{name}: crashed (signal {-returncode})"
    figs = unmet_line(stdout, name)
    if figs is None:
        if returncode == 0:
            return "failed", (f"{name}: printed no UNMET line and passed: the target is met; "
                              f"take it out of tests/unmet-targets.txt and make it a plain test")
        return "failed", f"{name}: exit status {returncode} without its UNMET line (crash or broken test)"
    worse = []
    for key, recorded in pin.items():
        if key == "target":
            continue
        if key not in figs:
            worse.append(f"{key} not printed")
            continue
        try:
            value = float(figs[key])
        except ValueError:
            worse.append(f"{key}={figs[key]} is not a number")
            continue
        if value > float(recorded):
            worse.append(f"{key} {figs[key]} worse than the recorded {recorded}")
    if worse:
        return "failed", f"{name}: " + "; ".join(worse)
    extra = ", ".join(f"{k} {v}" for k, v in figs.items() if k not in ("measured", "target"))
    return "unmet", (f"{name} measured {figs['measured']} target {figs.get('target', pin['target'])}"
                     + (f" ({extra})" if extra else ""))


def reruns(stdout):
    """Each RERUN line's fields (case, cause, evidence)."""
    return [parse_kv(m.group("rest")) for m in RERUN.finditer(stdout or "")]


def failure_reason(stdout, limit=300):
    """The test's own last 'FAIL: why' line (testlib's check), so the summary
    says why and not only that it failed; empty if it printed none."""
    found = FAIL_REASON.findall(stdout)
    if not found:
        return ""
    why = found[-1].strip()
    return f" ({why[:limit]}{'...' if len(why) > limit else ''})"


def short(name):
    """'pvgpu:suite / name' -> 'name'."""
    return name.rsplit(" / ", 1)[-1]


def read_log(path):
    if not path or not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def summarize(tests, benchmarks, pins):
    """The summary's lines and whether anything failed, from testlog
    entries (dicts with name, result, returncode, stdout)."""
    passed = failed = skipped = after_rerun = 0
    failures, unmet, rerun_lines = [], [], []
    seen_pins = set()
    for t in tests:
        name, res, out = short(t["name"]), t["result"], t.get("stdout") or ""
        rc = t.get("returncode")
        for r in reruns(out):
            rerun_lines.append(f"rerun: {name}: case {r.get('case', '?')}, cause: {r.get('cause', '?')}"
                               + (f"; evidence in {r['evidence']}" if r.get("evidence") else ""))
        if name in pins:
            seen_pins.add(name)
            if res == "SKIP":
                skipped += 1
                continue
            verdict, text = judge_pinned(name, pins[name], rc, out, res)
            if verdict == "unmet" and res in ("OK", "EXPECTEDFAIL"):
                unmet.append(text)
            else:
                failed += 1
                failures.append(text if verdict == "failed" else f"{name}: {res}")
            continue
        if res == "OK":
            passed += 1
            if reruns(out):
                after_rerun += 1
        elif res == "SKIP":
            skipped += 1
        elif res == "EXPECTEDFAIL":
            failed += 1
            failures.append(f"{name}: an expected failure that is not pinned in tests/unmet-targets.txt "
                            f"(its crash or any regression would pass unseen)")
        else:
            failed += 1
            failures.append(f"{name}: {res}" + failure_reason(out))
    bench_run = 0
    for t in benchmarks:
        name, res, out = short(t["name"]), t["result"], t.get("stdout") or ""
        for r in reruns(out):
            rerun_lines.append(f"rerun: {name}: case {r.get('case', '?')}, cause: {r.get('cause', '?')}")
        if res == "SKIP":
            skipped += 1
        elif res in CRASHED or (t.get("returncode") or 0) < 0:
            failed += 1
            failures.append(f"benchmark {name}: {res} (exit status {t.get('returncode')})")
        elif not RESULT.search(out):
            failed += 1
            failures.append(f"benchmark {name}: printed no RESULT line ({res})")
        elif res != "OK":
            failed += 1
            failures.append(f"benchmark {name}: {res}")
        else:
            bench_run += 1
    lines = [f"failed: {f}" for f in failures] + rerun_lines
    if tests:
        missing = sorted(set(pins) - seen_pins)
        if missing:
            lines.append("pinned targets not run: " + ", ".join(missing))
    if unmet:
        lines.append("targets not met: " + ", ".join(unmet))
    if benchmarks:
        lines.append(f"{bench_run} benchmarks run")
    lines.append(f"{passed} passed" + (f" ({after_rerun} after a rerun)" if after_rerun else "")
                 + f", {failed} failed, {skipped} skipped")
    return lines, failed > 0


def run_pinned(pins_path, name, cmd):
    pins = load_pins(pins_path)
    if name not in pins:
        print(f"summary.py: {name} is not in {pins_path}", flush=True)
        return 1
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, errors="replace")
    out = []
    for line in proc.stdout:
        sys.stdout.write(line)
        out.append(line)
    rc = proc.wait()
    sys.stdout.flush()
    verdict, text = judge_pinned(name, pins[name], rc, "".join(out))
    if verdict == "unmet":
        rec = " ".join(f"{k}={v}" for k, v in pins[name].items())
        print(f"PINNED target not met, no worse than recorded ({rec}): {text}", flush=True)
        return 0
    print(f"FAIL pinned target: {text}", flush=True)
    return 1


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    rp = sub.add_parser("run-pinned")
    rp.add_argument("--pins", default=DEFAULT_PINS)
    rp.add_argument("name")
    rp.add_argument("command", nargs=argparse.REMAINDER)
    sp = sub.add_parser("summarize")
    sp.add_argument("--pins", default=DEFAULT_PINS)
    sp.add_argument("--tests")
    sp.add_argument("--benchmarks")
    ns = ap.parse_args(argv)
    if ns.cmd == "run-pinned":
        cmd = ns.command[1:] if ns.command[:1] == ["--"] else ns.command
        if not cmd:
            ap.error("run-pinned needs a command after --")
        return run_pinned(ns.pins, ns.name, cmd)
    lines, bad = summarize(read_log(ns.tests), read_log(ns.benchmarks), load_pins(ns.pins))
    print("\n".join(lines))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
