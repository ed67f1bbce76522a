#!/usr/bin/env python3
"""Turn one of pvgpu's Markdown manual pages (docs/NAME.SECTION.md) into roff.

usage: md2man.py --md2man GO_MD2MAN --version V [--path OLD=NEW]... PAGE.md OUT

The pages are written to read well as Markdown; go-md2man renders them
(headings, definition lists, tables, code blocks).  This script only does
what go-md2man cannot know or does not do:
  - the title line "# NAME(SECTION)" becomes the .TH line
    NAME SECTION DATE "pvgpu V" "pvgpu Manual"; DATE is $SOURCE_DATE_EPOCH
    if set (reproducible builds), else the page's modification time;
  - --path OLD=NEW rewrites the default paths the pages give for a /usr
    install (/etc/pvgpu, /var/lib/pvgpu, /run/pvgpu) to the configured ones,
    so an installed page names the paths its pvgpud really uses;
  - every table cell becomes a text block, so tables wrap to the terminal.
Exit status: 0 written, 1 conversion failed, 2 bad usage or bad page.
"""

import argparse
import datetime
import os
import re
import subprocess
import sys


def fail(message, status=2):
    print(f"md2man.py: {message}", file=sys.stderr)
    sys.exit(status)


def page_date(path):
    epoch = os.environ.get("SOURCE_DATE_EPOCH")
    try:
        seconds = int(epoch) if epoch else os.stat(path).st_mtime
    except ValueError:
        fail(f"SOURCE_DATE_EPOCH is not an integer: '{epoch}'")
    return datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc).strftime("%Y-%m-%d")


def rewrite_paths(text, pairs):
    # A default path is a whole path or its leading part: /run/pvgpu matches
    # in "/run/pvgpu/admin.sock" and "`/run/pvgpu`", but /etc/pvgpu does not
    # match inside /usr/local/etc/pvgpu nor /var/lib/pvgpu in /var/lib/pvgpu-old.
    for old, new in pairs:
        text = re.sub(r"(?<![\w./-])" + re.escape(old) + r"(?![\w.-])", lambda _m, new=new: new, text)
    return text


def wrap_table_cells(roff):
    """Makes every cell of go-md2man's tbl tables a text block (T{ ... T}).

    go-md2man makes only long cells text blocks, so a table of several
    short-celled columns keeps every cell on one line and comes out far wider
    than the terminal.  As text blocks tbl can wrap every cell; .na and .nh
    keep it from hyphenating keys and paths (a path cut at a hyphen reads as
    a different path)."""
    out = []
    state = "text"  # text, format (the .TS header up to the line ending in '.'), rows, block
    for line in roff.split("\n"):
        if state == "text":
            out.append(line)
            if line == ".TS":
                state = "format"
        elif state == "format":
            out.append(line)
            if line.endswith("."):
                state = "rows"
        elif state == "block":  # inside a T{ ... T} go-md2man already made
            out.append(line)
            if line.startswith("T}"):
                state = "rows" if not line.endswith("T{") else "block"
        elif line == ".TE":
            out.append(line)
            state = "text"
        elif line.startswith("."):  # a request between rows
            out.append(line)
        else:
            cells = line.split("\t")
            wrapped = []
            for cell in cells:
                if cell == "T{":  # its text follows on the next lines
                    wrapped.append("T{\n.na\n.nh")
                    state = "block"
                else:
                    wrapped.append("T{\n.na\n.nh\n" + cell + "\nT}")
            out.append("\t".join(wrapped))
        if state == "block" and out[-1].startswith("T}") and out[-1].endswith("T{"):
            out[-1] += "\n.na\n.nh"
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--md2man", required=True, help="the go-md2man program")
    ap.add_argument("--version", required=True, help="pvgpu version for the page footer")
    ap.add_argument("--path", action="append", default=[], metavar="OLD=NEW",
                    help="rewrite the default path OLD to NEW (repeatable)")
    ap.add_argument("page", help="NAME.SECTION.md")
    ap.add_argument("out", help="roff output file")
    args = ap.parse_args()

    pairs = []
    for p in args.path:
        old, sep, new = p.partition("=")
        if not sep or not old.startswith("/") or not new.startswith("/"):
            fail(f"--path wants OLD=NEW with absolute paths, got '{p}'")
        pairs.append((old.rstrip("/"), new.rstrip("/")))

    m = re.fullmatch(r"([\w.-]+)\.(\d)\.md", os.path.basename(args.page))
    if not m:
        fail(f"{args.page}: a manual page is named NAME.SECTION.md")
    name, section = m.group(1), m.group(2)
    try:
        with open(args.page, encoding="utf-8") as f:
            lines = f.read().split("\n")
    except OSError as e:
        fail(f"{args.page}: {e.strerror}")

    title = f"# {name}({section})"
    if lines[0].strip().lower() != title.lower():
        fail(f"{args.page}:1: the first line must be the title '{title}', got '{lines[0]}'")
    # go-md2man turns the first level-1 heading into .TH followed by its text.
    lines[0] = f'# {name.upper()} {section} "{page_date(args.page)}" "pvgpu {args.version}" "pvgpu Manual"'
    text = rewrite_paths("\n".join(lines), pairs)

    try:
        p = subprocess.run([args.md2man], input=text, text=True, capture_output=True)
    except OSError as e:
        fail(f"cannot run {args.md2man}: {e.strerror}", 1)
    if p.returncode != 0:
        fail(f"{args.md2man} failed on {args.page} (exit {p.returncode}): {p.stderr.strip()}", 1)
    try:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(wrap_table_cells(p.stdout))
    except OSError as e:
        fail(f"{args.out}: {e.strerror}", 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
