#!/usr/bin/env python3
"""The register map include/pvgpu/regs.h as the Python tests read it
(testlib.c_defines), and docs/pvgpu-device.md's register table against it:
the header is the one definition, the table must describe it."""

import os
import re
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from testlib import c_defines  # noqa: E402

REPO = os.path.dirname(HERE)
REGS = c_defines(os.path.join(REPO, "include", "pvgpu", "regs.h"))


class Parser(unittest.TestCase):
    def parse(self, text, name="t.h"):
        with tempfile.TemporaryDirectory() as d:
            with open(os.path.join(d, "base.h"), "w") as f:
                f.write("#define PVGPU_BASE 0x100u /* a comment */\n")
            with open(os.path.join(d, name), "w") as f:
                f.write(text)
            return c_defines(os.path.join(d, name))

    def test_integer_expressions(self):
        got = self.parse('#include "base.h"\n'
                         "#define PVGPU_A (PVGPU_BASE + 2 * 0x10)\n"
                         "#define PVGPU_B (1u << 3) | (PVGPU_A >> 8) /* x */\n"
                         "#define PVGPU_C ~0 & 0xff\n"
                         "#define OTHER -(4 - 6)\n")
        self.assertEqual(got, {"A": 0x120, "B": 9, "C": 0xff, "OTHER": 2})

    def test_what_is_not_an_integer_is_skipped(self):
        got = self.parse("#define PVGPU_H\n"
                         "#define PVGPU_F(i) (0x100 + (i))\n"
                         "#define PVGPU_S ((unsigned)sizeof(struct x))\n"
                         '#define PVGPU_T "text"\n'
                         "#define PVGPU_U PVGPU_UNKNOWN\n"
                         "#define PVGPU_O 010\n"
                         "#define PVGPU_P (1 + 2\n"
                         "/* #define PVGPU_Q 1 */\n"
                         "#define PVGPU_OK 1\n")
        self.assertEqual(got, {"OK": 1})


class Header(unittest.TestCase):
    def test_register_offsets_do_not_overlap(self):
        regs = {k: v for k, v in REGS.items()
                if k.startswith("REG_") and not k.endswith(("_STRIDE", "_BASE"))}
        self.assertEqual(len(set(regs.values())), len(regs), regs)
        self.assertLessEqual(REGS["REG_SLOT_BASE"] + REGS["MAX_SLOTS"] * REGS["REG_SLOT_STRIDE"],
                             REGS["REG_WAIT_BASE"])
        self.assertLessEqual(REGS["REG_WAIT_BASE"] + REGS["MAX_SLOTS"] * REGS["REG_WAIT_STRIDE"],
                             REGS["REG_TASK_NAME"])
        self.assertLessEqual(REGS["REG_TASK_NAME"] + REGS["TASK_NAME_LEN"], REGS["BAR0_SIZE"])


class Document(unittest.TestCase):
    def test_register_table_matches_the_header(self):
        with open(os.path.join(REPO, "docs", "pvgpu-device.md")) as f:
            doc = f.read()
        rows = re.findall(r"^\| (0x[0-9a-f]+)(?: \+ (\d+)\*[ik][^|]*)? \| `([A-Z0-9_]+)(?:\([ik]\))?` \|",
                          doc, re.M)
        self.assertGreater(len(rows), 20)
        seen = set()
        for off, stride, name in rows:
            if name.startswith("SLOT_"):
                want = REGS["REG_SLOT_BASE"] + REGS["SLOT_REG_" + name[5:]]
                want_stride = REGS["REG_SLOT_STRIDE"]
            elif name.startswith("WAIT_"):
                want = REGS["REG_WAIT_BASE"] + REGS["WAIT_REG_" + name[5:]]
                want_stride = REGS["REG_WAIT_STRIDE"]
            else:
                want = REGS["REG_" + name]
                want_stride = 4 if stride else None
            self.assertEqual(int(off, 16), want, name)
            self.assertEqual(int(stride) if stride else None, want_stride, name)
            seen.add(name)
        named = {k[4:] for k in REGS if k.startswith("REG_") and not k.endswith(("_STRIDE", "_BASE"))}
        named |= {"SLOT_" + k[9:] for k in REGS if k.startswith("SLOT_REG_")}
        named |= {"WAIT_" + k[9:] for k in REGS if k.startswith("WAIT_REG_")}
        self.assertEqual(seen, named)


if __name__ == "__main__":
    unittest.main()
