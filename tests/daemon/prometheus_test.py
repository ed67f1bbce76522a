#!/usr/bin/env python3
"""pvgpud's Prometheus textfile read by the real consumers: Prometheus'
`promtool check metrics`, and Debian's prometheus-node-exporter serving it
with its textfile collector on a loopback port, scraped over HTTP.

Two VMs (VMM clients, as the QEMU device speaks for a guest) and a host task
(a host client, as libpvgpu) each run an exact number of kernels and wait
until all completed (their own fence counts), and stay connected (a host
task's entity goes when its client does).  After a rewrite of the textfile that follows, the scrape must
hold each one's pvgpu_entity_kernels_total equal to its own count, its
pvgpu_entity_gpu_seconds_total within 1% of the GPU time it asked for (the
project's accounting goal, DESIGN.md section 9), and the exporter must report
the file parsed (node_textfile_scrape_error 0).

Both tools come from Debian's packages `prometheus` (promtool) and
`prometheus-node-exporter`, installed by tests/daemon/setup-prometheus.sh
(tests/run-all.sh runs it).  Without them the test exits 77 naming the
missing one.

usage: prometheus_test.py --pvgpud P --pvgpuctl P --load P
Exit status: 0 pass, 1 fail, 77 skipped (promtool or node exporter missing).
"""

import argparse
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)
from testlib import Skip, TestFailure, check, log, result, run_case, stop_process, wait_for  # noqa: E402
from daemon_test import HOST, ROLE_VMM, Bins, Daemon, RawChannel, RawClient  # noqa: E402

PROMTOOL = "promtool"
EXPORTER = "prometheus-node-exporter"
SAMPLE = re.compile(r'^(?P<name>[a-zA-Z_:][\w:]*)(?:\{(?P<labels>[^}]*)\})? (?P<value>\S+)$')
LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
KERNEL_NS = 500_000
VMS = [("prom-vm-a", bytes(range(0x40, 0x50)), 300), ("prom-vm-b", bytes(range(0x50, 0x60)), 120)]
HOST_TASK = ("prom-host", None, 200)


def parse(text):
    """{(name, frozenset(labels)): value} of an exposition text."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = SAMPLE.match(line)
        check(m is not None, f"unparsable sample line: {line!r}")
        labels = frozenset(LABEL.findall(m.group("labels") or ""))
        out[(m.group("name"), labels)] = float(m.group("value"))
    return out


def series(samples, name, **want):
    """The samples of `name` whose labels include `want`."""
    return [v for (n, labels), v in samples.items()
            if n == name and all((k, v2) in labels for k, v2 in want.items())]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        check(r.status == 200, f"scrape: HTTP {r.status}")
        return r.read().decode()


def run(ns, tmp):
    for tool in (PROMTOOL, EXPORTER):
        if shutil.which(tool) is None:
            raise Skip(f"{tool} not installed (Debian: tests/daemon/setup-prometheus.sh, as root)")
    bins = Bins(ns)
    textdir = os.path.join(tmp, "textfile")
    os.makedirs(textdir)
    prom = os.path.join(textdir, "pvgpu.prom")
    with open(os.path.join(tmp, "pvgpud.conf"), "w") as f:
        f.write(f"[libvirt]\nuri = none\n[metrics]\ntextfile = {prom}\ninterval_s = 1\n")
    d = Daemon(bins, tmp)
    d.start()
    clients, exporter = [], None
    try:
        # Exactly so many kernels each, all completed (the channel's fence).
        for name, uuid, n in VMS + [HOST_TASK]:
            c = RawClient(d.socket)
            if uuid is None:
                c.hello(name)
            else:
                c.hello(name, role=ROLE_VMM, uuid=uuid)
            status, _, fds = c.alloc()
            check(status == 0, f"{name}: CHAN_ALLOC status {status}")
            ch = RawChannel(fds)
            clients.append((c, ch))
            ch.run(KERNEL_NS, n, timeout=60)
            check(ch.fence() == n, f"{name}: fence {ch.fence()}, want {n}")
        done = time.time()
        # A rewrite rendered after pvgpud took in every completion: written
        # more than one interval (1 s) after the clients saw their last
        # fence, so its render began after it too.  (Polling the file's
        # mtime: there is nothing to block on.)
        wait_for(lambda: os.path.exists(prom) and os.stat(prom).st_mtime > done + 1.0, 10,
                 "a textfile rewrite a full interval after the last kernel", step=0.05)
        with open(prom) as f:
            text = f.read()

        # promtool: the exposition format and Prometheus' naming lint.
        p = subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True, text=True)
        log(f"promtool check metrics: exit {p.returncode} {p.stdout.strip()} {p.stderr.strip()}")
        check(p.returncode == 0, f"promtool check metrics: exit {p.returncode}: {p.stdout} {p.stderr}")

        # node exporter: only its textfile collector, on a free loopback port.
        for attempt in range(3):  # the port was free a moment ago; another process may take it
            port = free_port()
            elog = open(os.path.join(tmp, "exporter.log"), "w")
            exporter = subprocess.Popen([EXPORTER, "--collector.disable-defaults", "--collector.textfile",
                                         f"--collector.textfile.directory={textdir}",
                                         f"--web.listen-address=127.0.0.1:{port}"],
                                        stdin=subprocess.DEVNULL, stdout=elog, stderr=subprocess.STDOUT)

            def up():
                if exporter.poll() is not None:
                    return "exited"
                try:
                    return scrape(port)
                except OSError:
                    return None
            body = wait_for(up, 15, f"{EXPORTER} to answer on 127.0.0.1:{port}", step=0.05)
            if body != "exited":
                break
            with open(os.path.join(tmp, "exporter.log")) as f:
                log(f"{EXPORTER} exited: {f.read()[-500:]}")
            exporter = None
        check(exporter is not None, f"{EXPORTER} did not start (see above)")
        samples = parse(body)
        err = series(samples, "node_textfile_scrape_error")
        check(err == [0.0], f"node_textfile_scrape_error {err}: the exporter could not read the textfile "
                            f"(exporter log: {open(os.path.join(tmp, 'exporter.log')).read()[-800:]})")
        check(series(samples, "node_textfile_mtime_seconds", file=prom) or
              series(samples, "node_textfile_mtime_seconds", file="pvgpu.prom"),
              "no node_textfile_mtime_seconds for pvgpu.prom")
        # The scrape serves the file as it is now; the counters of finished
        # clients no longer move, so it must match the clients' own counts.
        for name, _, n in VMS:
            k = series(samples, "pvgpu_entity_kernels_total", kind="vm", vm=name)
            g = series(samples, "pvgpu_entity_gpu_seconds_total", kind="vm", vm=name)
            result(f"prometheus.{name}.kernels_total", k)
            result(f"prometheus.{name}.gpu_seconds_total", g)
            check(k == [float(n)], f"{name}: pvgpu_entity_kernels_total {k} over HTTP, the VM completed {n}")
            want_s = n * KERNEL_NS / 1e9
            # The accounting goal: each tenant charged within 1% of what it ran.
            check(len(g) == 1 and abs(g[0] - want_s) <= 0.01 * want_s,
                  f"{name}: pvgpu_entity_gpu_seconds_total {g}, the VM ran {want_s:.3f} s (+-1%)")
        name, _, n = HOST_TASK
        task = f"{HOST.split('/', 1)[1]}/{name}"
        k = series(samples, "pvgpu_entity_kernels_total", kind="host", task=task)
        result("prometheus.host.kernels_total", k)
        check(k == [float(n)], f"host task {task}: pvgpu_entity_kernels_total {k}, the client completed {n}")
        # Every pvgpu family of the file reached the scrape.
        families = {n for (n, _) in parse(text)}
        served = {n for (n, _) in samples}
        check(families <= served, f"families lost by the exporter: {sorted(families - served)}")
        result("prometheus.families", len(families))
    finally:
        if exporter is not None:
            stop_process(exporter)
        for c, ch in clients:
            ch.close()
            c.close()
        d.stop()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pvgpud", required=True)
    ap.add_argument("--pvgpuctl", required=True)
    ap.add_argument("--load", required=True)
    ap.add_argument("--libtest")
    return run_case("prometheus", run, ap.parse_args())


if __name__ == "__main__":
    sys.exit(main())
