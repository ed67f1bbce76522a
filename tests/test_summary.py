#!/usr/bin/env python3
"""Tests of tests/summary.py on synthetic meson test logs: the closing
summary must not count as passed what did not pass."""

import json
import os
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import summary  # noqa: E402

PINS = {"sweep-a": {"measured": "3", "target": "0", "worst_pct": "21.48"}}
UNMET_OK = "seed 1 ...\nUNMET sweep-a measured=3 target=0 worst_pct=21.48\n"


def t(name, result, stdout="", rc=None, suite="unit"):
    if rc is None:
        rc = {"OK": 0, "SKIP": 77, "FAIL": 1, "EXPECTEDFAIL": 1}.get(result, 1)
    return {"name": f"pvgpu:{suite} / {name}", "result": result, "returncode": rc, "stdout": stdout}


def run(tests, benchmarks=(), pins=PINS):
    lines, bad = summary.summarize(list(tests), list(benchmarks), pins)
    return lines, bad, lines[-1]


class Pinned(unittest.TestCase):
    def test_unmet_within_pin_is_neither_passed_nor_failed(self):
        lines, bad, last = run([t("sweep-a", "OK", UNMET_OK), t("u", "OK")])
        self.assertEqual(last, "1 passed, 0 failed, 0 skipped")
        self.assertIn("targets not met: sweep-a measured 3 target 0 (worst_pct 21.48)", lines)
        self.assertFalse(bad)

    def test_crash_of_a_pinned_target_fails(self):
        # A segfault after the figures were printed: under should_fail this
        # was an EXPECTEDFAIL, counted as passed.
        for res, rc in (("EXPECTEDFAIL", -11), ("FAIL", -6), ("TIMEOUT", -15)):
            lines, bad, last = run([t("sweep-a", res, UNMET_OK, rc=rc)])
            self.assertEqual(last, "0 passed, 1 failed, 0 skipped", (res, rc))
            self.assertTrue(bad)
            self.assertFalse(any(l.startswith("targets not met") for l in lines))

    def test_no_figure_fails(self):
        lines, bad, last = run([t("sweep-a", "EXPECTEDFAIL", "Segmentation fault\n", rc=1)])
        self.assertEqual(last, "0 passed, 1 failed, 0 skipped")
        self.assertTrue(any("without its UNMET line" in l for l in lines))

    def test_worse_figure_fails(self):
        for out in ("UNMET sweep-a measured=4 target=0 worst_pct=21.48\n",
                    "UNMET sweep-a measured=3 target=0 worst_pct=30.1\n",
                    "UNMET sweep-a measured=3 target=0\n"):  # a figure no longer printed
            lines, bad, last = run([t("sweep-a", "OK", out)])
            self.assertEqual(last, "0 passed, 1 failed, 0 skipped", out)
            self.assertTrue(bad)

    def test_better_figure_is_unmet_not_failed(self):
        lines, bad, last = run([t("sweep-a", "OK", "UNMET sweep-a measured=1 target=0 worst_pct=2\n")])
        self.assertEqual(last, "0 passed, 0 failed, 0 skipped")
        self.assertIn("targets not met: sweep-a measured 1 target 0 (worst_pct 2)", lines)

    def test_met_target_fails_until_unpinned(self):
        lines, bad, last = run([t("sweep-a", "OK", "0 of 400 beyond\n")])
        self.assertEqual(last, "0 passed, 1 failed, 0 skipped")
        self.assertTrue(any("the target is met" in l for l in lines))

    def test_unpinned_expected_failure_fails(self):
        lines, bad, last = run([t("vm-x", "EXPECTEDFAIL", "FAIL x\n")])
        self.assertEqual(last, "0 passed, 1 failed, 0 skipped")

    def test_pinned_target_missing_from_the_run_is_said(self):
        lines, bad, last = run([t("u", "OK")])
        self.assertIn("pinned targets not run: sweep-a", lines)


class Reruns(unittest.TestCase):
    def test_rerun_is_counted_and_shown(self):
        out = ('# case thesis2\nRERUN case=vm.thesis2 cause="guest kernel stopped: vCPU halted, IF=1" '
               'evidence=build/meson-logs/evidence/vm-thesis2-1\nPASS thesis2\n')
        lines, bad, last = run([t("vm-thesis2", "OK", out), t("u", "OK"), t("s", "SKIP")])
        self.assertEqual(last, "2 passed (1 after a rerun), 0 failed, 1 skipped")
        self.assertIn("rerun: vm-thesis2: case vm.thesis2, cause: guest kernel stopped: vCPU halted, IF=1; "
                      "evidence in build/meson-logs/evidence/vm-thesis2-1", lines)
        self.assertFalse(bad)

    def test_failed_after_rerun_is_failed_and_shown(self):
        out = 'RERUN case=closed-loop cause="window 1: 0.62 beyond 0.5 +- 0.08"\nFAIL closed-loop\n'
        lines, bad, last = run([t("daemon-closed-loop", "FAIL", out)])
        self.assertEqual(last, "0 passed, 1 failed, 0 skipped")
        self.assertTrue(any(l.startswith("rerun: daemon-closed-loop") for l in lines))


class Reasons(unittest.TestCase):
    def test_failed_line_carries_the_last_reason(self):
        out = ("FAIL: L2 (off): the L2 command failed\nRESULT x=1\n"
               "FAIL: L1 command exit status 125\nFAIL kvm-qemu\n")
        lines, bad, last = run([t("kvm-qemu", "FAIL", out), t("vm-overhead", "FAIL", "# no reason\n")])
        self.assertIn("failed: kvm-qemu: FAIL (L1 command exit status 125)", lines)
        self.assertIn("failed: vm-overhead: FAIL", lines)
        self.assertTrue(bad)

    def test_long_reason_is_cut(self):
        lines, _, _ = run([t("x", "FAIL", "FAIL: " + "a" * 400 + "\n")])
        self.assertIn("failed: x: FAIL (" + "a" * 300 + "...)", lines)


class Benchmarks(unittest.TestCase):
    def test_benchmarks_have_their_own_line(self):
        lines, bad, last = run([t("u", "OK")], [t("decision", "OK", "RESULT decision.x=1\n", suite="b"),
                                                 t("wakeup", "OK", "RESULT w=2\n", suite="b")])
        self.assertIn("2 benchmarks run", lines)
        self.assertEqual(last, "1 passed, 0 failed, 0 skipped")

    def test_benchmark_without_figure_or_crashed_fails(self):
        lines, bad, last = run([], [t("quiet", "OK", "table\n"), t("segv", "FAIL", "RESULT a=1\n", rc=-11),
                                    t("good", "OK", "RESULT a=1\n")])
        self.assertIn("1 benchmarks run", lines)
        self.assertEqual(last, "0 passed, 2 failed, 0 skipped")
        self.assertTrue(bad)


class Plain(unittest.TestCase):
    def test_results(self):
        lines, bad, last = run([t("a", "OK"), t("b", "FAIL"), t("c", "TIMEOUT"), t("d", "SKIP"),
                                t("e", "UNEXPECTEDPASS", rc=0)])
        self.assertEqual(last, "1 passed, 3 failed, 1 skipped")
        self.assertTrue(bad)


class Files(unittest.TestCase):
    """The command lines tests/run-all.sh and meson use."""

    def test_repository_pins_parse(self):
        pins = summary.load_pins()
        self.assertIn("accounting-sweep-batches", pins)
        self.assertIn("accounting-sweep-varied", pins)

    def test_summarize_from_testlogs(self):
        with tempfile.TemporaryDirectory() as tmp:
            pins = os.path.join(tmp, "pins.txt")
            with open(pins, "w") as f:
                f.write("# c\nsweep-a measured=3 target=0 worst_pct=21.48  # from x\n")
            tl, bl = os.path.join(tmp, "tests.json"), os.path.join(tmp, "bench.json")
            with open(tl, "w") as f:
                for e in (t("sweep-a", "OK", UNMET_OK), t("u", "OK")):
                    f.write(json.dumps(e) + "\n")
            with open(bl, "w") as f:
                f.write(json.dumps(t("bench", "OK", "RESULT x=1\n")) + "\n")
            p = subprocess.run([sys.executable, os.path.join(HERE, "summary.py"), "summarize", "--pins", pins,
                                "--tests", tl, "--benchmarks", bl], capture_output=True, text=True)
            self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
            self.assertEqual(p.stdout.splitlines()[-3:], [
                "targets not met: sweep-a measured 3 target 0 (worst_pct 21.48)",
                "1 benchmarks run", "1 passed, 0 failed, 0 skipped"])

    def run_pinned(self, script):
        with tempfile.TemporaryDirectory() as tmp:
            pins = os.path.join(tmp, "pins.txt")
            with open(pins, "w") as f:
                f.write("sweep-a measured=3 target=0 worst_pct=21.48\n")
            return subprocess.run([sys.executable, os.path.join(HERE, "summary.py"), "run-pinned", "--pins", pins,
                                   "sweep-a", "--", sys.executable, "-c", script], capture_output=True, text=True)

    def test_run_pinned(self):
        ok = self.run_pinned("print('UNMET sweep-a measured=3 target=0 worst_pct=20'); raise SystemExit(1)")
        self.assertEqual(ok.returncode, 0, ok.stdout)
        self.assertIn("PINNED target not met", ok.stdout)
        segv = self.run_pinned("import os, signal\nprint('UNMET sweep-a measured=3 target=0 worst_pct=20', "
                               "flush=True)\nos.kill(os.getpid(), signal.SIGSEGV)")
        self.assertEqual(segv.returncode, 1, segv.stdout)
        self.assertIn("crashed (signal 11)", segv.stdout)
        worse = self.run_pinned("print('UNMET sweep-a measured=5 target=0 worst_pct=20'); raise SystemExit(1)")
        self.assertEqual(worse.returncode, 1, worse.stdout)
        met = self.run_pinned("print('0 beyond')")
        self.assertEqual(met.returncode, 1, met.stdout)


if __name__ == "__main__":
    unittest.main(verbosity=2)
