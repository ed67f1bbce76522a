#!/usr/bin/env python3
"""Checks what `meson install` puts on a host, and that applications can use it.

Cases:
  tree    installs the build into a temporary DESTDIR and checks the tree
          against the build's configured directories (meson introspect):
          binaries, libpvgpu.so with its soname and exported symbols, the
          header and pvgpu.pc, the systemd unit (ExecStart is the installed
          pvgpud, its directories are the configured ones; systemd-analyze
          verify accepts it in the DESTDIR tree), the
          configuration file, the manual pages (rendered by man -l without
          warnings but layout ones); then starts the installed pvgpud with the installed
          configuration, runs the installed pvgpu-load against it, and
          compiles a small C++ program with `pkg-config --cflags --libs
          pvgpu` against the DESTDIR tree that prints the library version,
          allocates a channel, runs a kernel and catches a ClientError.
  prefix  configures (without compiling) the source with --prefix=/usr and
          with --prefix=/opt/pvgpu -Drunstatedir=/var/run, and checks the
          generated default paths, unit and configuration file of each.

usage: install_test.py --build-dir DIR --source-dir DIR --meson MESON --cxx 'CXX [ARGS]' CASE
Exit status: 0 pass, 1 fail, 77 skipped (meson's convention).
"""

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", "daemon"))
from testlib import Skip, TestFailure, check, log  # noqa: E402
from daemon_test import DAEMONS, Daemon  # noqa: E402

SKIP = 77

APP = r"""
// A host application of libpvgpu, built only from the installed tree.
#include <pvgpu.h>

#include <chrono>
#include <cstdio>

int main(int argc, char** argv) {
    std::printf("version=%s\n", pvgpu::version());
    std::printf("default_socket=%s\n", pvgpu::kDefaultSocketPath);
    if (argc != 3) return 2;
    try {
        pvgpu::Client client(argv[1], "install-app");
        pvgpu::Channel ch = client.alloc_channel();
        std::uint64_t fence = ch.submit(200'000);  // one 200 us kernel
        if (!ch.wait(fence, std::chrono::seconds(10))) {
            std::printf("wait timed out\n");
            return 1;
        }
        std::printf("channel=%u completed=%llu\n", ch.id(),
                    static_cast<unsigned long long>(ch.completed()));
    } catch (const pvgpu::ClientError& e) {
        std::printf("unexpected error=%s\n", e.what());
        return 1;
    }
    // An error thrown inside the shared library must be catchable here as
    // the type the header declares (the version script exports its typeinfo).
    try {
        pvgpu::Client gone(argv[2], "install-app");
    } catch (const pvgpu::ClientError& e) {
        std::printf("caught=ClientError\n");
        return 0;
    }
    std::printf("no error from a missing socket\n");
    return 1;
}
"""


def run(cmd, env=None, timeout=120, check_rc=True, **kw):
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, **kw)
    if check_rc and p.returncode != 0:
        raise TestFailure(f"{' '.join(cmd)}: exit {p.returncode}\n{p.stdout}{p.stderr}")
    return p


def configured_dirs(meson, build_dir):
    """The build's directories, absolute, as meson installs to them."""
    opts = {o["name"]: o["value"] for o in json.loads(run([meson, "introspect", "--buildoptions", build_dir]).stdout)}
    prefix = opts["prefix"]

    def under_prefix(name):  # an absolute option value stays as it is
        return os.path.join(prefix, opts[name])

    d = {name: under_prefix(name) for name in
         ("bindir", "sbindir", "libdir", "includedir", "mandir", "sysconfdir", "localstatedir")}
    d["unitdir"] = opts["systemdsystemunitdir"] or os.path.join(prefix, "lib/systemd/system")
    d["confdir"] = os.path.join(d["sysconfdir"], "pvgpu")
    d["statedir"] = os.path.join(d["localstatedir"], "lib", "pvgpu")
    d["rundir"] = os.path.join(opts["runstatedir"], "pvgpu")
    d["man"] = opts["man"]
    version = json.loads(run([meson, "introspect", "--projectinfo", build_dir]).stdout)["version"]
    return d, version


def unit_settings(text):
    """[Service]/[Unit] key -> list of values of a systemd unit."""
    settings = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line[0] in "#;[":
            continue
        key, sep, value = line.partition("=")
        check(sep, f"pvgpud.service: not a setting: '{line}'")
        settings.setdefault(key, []).append(value)
    return settings


def check_unit(text, dirs):
    """ExecStart, RuntimeDirectory/StateDirectory or ReadWritePaths follow dirs."""
    check("@" not in text.replace("@system-service", ""), "pvgpud.service: unsubstituted @VAR@")
    s = unit_settings(text)
    exec_start = s.get("ExecStart", [""])[0].split()
    pvgpud = os.path.join(dirs["sbindir"], "pvgpud")
    check(exec_start[:1] == [pvgpud], f"ExecStart runs {exec_start[:1]}, pvgpud is installed as {pvgpud}")
    rw = " ".join(s.get("ReadWritePaths", [])).split()
    if dirs["rundir"] == "/run/pvgpu":
        check(s.get("RuntimeDirectory") == ["pvgpu"], f"RuntimeDirectory {s.get('RuntimeDirectory')}, want pvgpu")
    else:
        check("RuntimeDirectory" not in s, "RuntimeDirectory= for sockets outside /run")
        check(os.path.dirname(dirs["rundir"]) in rw,
              f"sockets in {dirs['rundir']}, but ReadWritePaths= is {rw}")
    if dirs["statedir"] == "/var/lib/pvgpu":
        check(s.get("StateDirectory") == ["pvgpu"], f"StateDirectory {s.get('StateDirectory')}, want pvgpu")
    else:
        check("StateDirectory" not in s, f"StateDirectory= although the state is in {dirs['statedir']}")
        check(dirs["statedir"] in rw, f"state in {dirs['statedir']}, but ReadWritePaths= is {rw}")
    if dirs["confdir"] == "/etc/pvgpu":
        check(s.get("ConfigurationDirectory") == ["pvgpu"], "no ConfigurationDirectory=pvgpu")
    else:
        check("ConfigurationDirectory" not in s, f"ConfigurationDirectory= although config is in {dirs['confdir']}")
    return pvgpud


def check_conf(text, dirs):
    check("@" not in text, "pvgpud.conf: unsubstituted @VAR@")
    for line in (f"#socket = {dirs['rundir']}/pvgpud.sock", f"#admin_socket = {dirs['rundir']}/admin.sock",
                 f"#state_dir = {dirs['statedir']}"):
        check(line in text.splitlines(), f"pvgpud.conf does not document the default '{line}'")
    check(text.startswith(f"# {dirs['confdir']}/pvgpud.conf:"), "pvgpud.conf does not name its own path")


def check_exported_symbols(lib):
    syms = run(["nm", "-D", "-C", "--defined-only", lib]).stdout.splitlines()
    # "T pvgpu::version()@@PVGPU_0": the name without its version node.
    names = [re.sub(r"@@?PVGPU_0$", "", line.split(" ", 2)[2]) for line in syms if len(line.split(" ", 2)) == 3]
    check("pvgpu::version()" in names, f"{lib} does not export pvgpu::version(): {names[:10]}")
    check(any(n.startswith("pvgpu::Client::Client(") for n in names), f"{lib} does not export pvgpu::Client")
    public = re.compile(r"^(PVGPU_0|pvgpu::(version|transport_name|parse_gpu|kDefaultSocketPath|Client::(?!Impl::)|Channel::)"
                        r"|(typeinfo|typeinfo name|vtable) for pvgpu::ClientError$)")
    private = [n for n in names if not public.match(n)]
    check(not private, f"{lib} exports internals: {private[:10]}")
    log(f"{lib}: {len(names)} exported symbols, all of pvgpu.h")


def elf_dynamic(path):
    return run(["readelf", "-d", path]).stdout


def check_man(page, dirs, name, section):
    check(os.path.isfile(page), f"no manual page {page}")
    env = dict(os.environ, MANWIDTH="80", LC_ALL="C.UTF-8")
    p = run(["man", "--warnings", "-P", "cat", "-l", page], env=env)
    # Layout warnings are about fitting 80 columns (pvgpud(8)'s configuration
    # table is wider); anything else (a bad request or escape) is a broken page.
    layout = re.compile(r"can't break line|cannot adjust line|table wider than line width|^warning: file '<standard input>'")
    errors = [line for line in p.stderr.splitlines() if line.strip() and not layout.search(line.strip())]
    check(not errors, f"man -l {page} warns: {errors[:5]}")
    text = p.stdout
    check(f"{name.upper()}({section})" in text.splitlines()[0], f"{page}: title line is '{text.splitlines()[0]}'")
    check(re.search(rf"^NAME\n\s+{re.escape(name)}\s+- ", text, re.M), f"{page}: no NAME section naming {name}")
    return text


def case_tree(ns, tmp):
    dirs, version = configured_dirs(ns.meson, ns.build_dir)
    dest = os.path.join(tmp, "destdir")
    run([ns.meson, "install", "-C", ns.build_dir, "--no-rebuild", "--quiet", "--destdir", dest], timeout=300)

    def at(path):
        return os.path.join(dest, path.lstrip("/"))

    # Binaries.
    # pvgpu-device-plugin: built with the kubernetes feature only.
    plugin_built = os.path.exists(os.path.join(ns.build_dir, "scheduler", "kubernetes", "pvgpu-device-plugin"))
    for d, exe in (("sbindir", "pvgpud"), ("sbindir", "pvgpuctl"), ("bindir", "pvgpu-load"), ("bindir", "pvgpu-sim")) + \
            ((("sbindir", "pvgpu-device-plugin"),) if plugin_built else ()):
        check(os.access(at(os.path.join(dirs[d], exe)), os.X_OK), f"{exe} not installed in {dirs[d]}")
    libdir = at(dirs["libdir"])
    env = dict(os.environ, LD_LIBRARY_PATH=libdir)
    if ns.kubevirt_hook:
        # KubeVirt's sidecar-shim runs "onDefineDomain" from PATH: the link is that name.
        hook = at(os.path.join(dirs["bindir"], "pvgpu-kubevirt-hook"))
        check(os.access(hook, os.X_OK), f"pvgpu-kubevirt-hook not installed in {dirs['bindir']}")
        link = at(os.path.join(dirs["bindir"], "onDefineDomain"))
        check(os.path.islink(link) and os.readlink(link) == "pvgpu-kubevirt-hook",
              f"{link} is not a link to pvgpu-kubevirt-hook")
        check(f"{dirs['rundir']}/pvgpud.sock" in run([link, "--help"]).stdout,
              "pvgpu-kubevirt-hook --help does not give the configured socket")

    # libpvgpu: soname, links, exports; the tool that uses it.
    real = os.path.join(libdir, f"libpvgpu.so.{version}")
    check(os.path.isfile(real), f"{real} not installed")
    check(os.readlink(os.path.join(libdir, "libpvgpu.so.0")) == f"libpvgpu.so.{version}", "libpvgpu.so.0 link")
    check(os.path.realpath(os.path.join(libdir, "libpvgpu.so")) == os.path.realpath(real), "libpvgpu.so link")
    check("Library soname: [libpvgpu.so.0]" in elf_dynamic(real), "libpvgpu's soname is not libpvgpu.so.0")
    check_exported_symbols(real)
    load = at(os.path.join(dirs["bindir"], "pvgpu-load"))
    dyn = elf_dynamic(load)
    check("Shared library: [libpvgpu.so.0]" in dyn, "the installed pvgpu-load does not use libpvgpu.so.0")
    check(os.path.abspath(ns.build_dir) not in dyn, "the installed pvgpu-load has a run path into the build")

    # Header and pkg-config file.
    for h in ("pvgpu.h", "pvgpu/abi.h", "pvgpu/protocol.h", "pvgpu/guest_ioctl.h", "pvgpu/regs.h",
              "pvgpu/backend.h"):
        check(os.path.isfile(at(os.path.join(dirs["includedir"], h))), f"{h} not installed in {dirs['includedir']}")
    pc = os.path.join(libdir, "pkgconfig", "pvgpu.pc")
    check(os.path.isfile(pc), f"{pc} not installed")

    # Configuration file and unit.
    conf = at(os.path.join(dirs["confdir"], "pvgpud.conf"))
    check(os.path.isfile(conf), f"pvgpud.conf not installed in {dirs['confdir']}")
    check_conf(open(conf).read(), dirs)
    unit = at(os.path.join(dirs["unitdir"], "pvgpud.service"))
    check(os.path.isfile(unit), f"pvgpud.service not installed in {dirs['unitdir']}")
    pvgpud = check_unit(open(unit).read(), dirs)
    check(os.access(at(pvgpud), os.X_OK), f"ExecStart's {pvgpud} is not installed")
    # systemd's own check, against the DESTDIR tree: syntax, unknown keys, ExecStart.
    if shutil.which("systemd-analyze"):
        p = run(["systemd-analyze", "verify", f"--root={dest}", "--man=no", "--recursive-errors=no", unit],
                check_rc=False)
        check(p.returncode == 0 and not p.stderr.strip(),
              f"systemd-analyze verify pvgpud.service: exit {p.returncode}: {p.stderr.strip()}")
    else:
        log("no systemd-analyze: pvgpud.service checked by this test only")
    if dirs["statedir"] != "/var/lib/pvgpu":  # not made by systemd: installed
        check(os.path.isdir(at(dirs["statedir"])), f"state directory {dirs['statedir']} not installed")

    # The installed programs know the configured paths.
    help_text = run([at(pvgpud), "--help"], env=env).stdout
    for path in (f"{dirs['confdir']}/pvgpud.conf", f"{dirs['rundir']}/pvgpud.sock", f"{dirs['rundir']}/admin.sock",
                 dirs["statedir"]):
        check(path in help_text, f"pvgpud --help does not give the default {path}:\n{help_text}")
    check(f"{dirs['rundir']}/admin.sock" in run([at(os.path.join(dirs["sbindir"], "pvgpuctl")), "--help"]).stdout,
          "pvgpuctl --help does not give the configured admin socket")
    check(f"{dirs['rundir']}/pvgpud.sock" in run([load, "--help"], env=env).stdout,
          "pvgpu-load --help does not give the configured socket")
    if plugin_built:
        plugin_help = run([at(os.path.join(dirs["sbindir"], "pvgpu-device-plugin")), "--help"]).stdout
        for path in (f"{dirs['rundir']}/admin.sock", f"{dirs['rundir']}/pvgpud.sock"):
            check(path in plugin_help, f"pvgpu-device-plugin --help does not give the default {path}")

    # Manual pages.
    if dirs["man"] == "disabled":
        log("manual pages disabled (-Dman=disabled): not checked")
    else:
        pages = [("pvgpud", 8), ("pvgpuctl", 8), ("pvgpu-load", 1), ("pvgpu-sim", 1)]
        pages += [("pvgpu-kubevirt-hook", 8)] if ns.kubevirt_hook else []
        pages += [("pvgpu-device-plugin", 8)] if plugin_built else []
        for name, section in pages:
            text = check_man(at(os.path.join(dirs["mandir"], f"man{section}", f"{name}.{section}")),
                             dirs, name, section)
            if name == "pvgpud":
                flat = " ".join(text.split())
                for path in (f"{dirs['confdir']}/pvgpud.conf", dirs["statedir"], f"{dirs['rundir']}/admin.sock"):
                    check(path in flat, f"pvgpud(8) does not give the configured path {path}")
        log("manual pages render (layout warnings at most)")

    # The installed daemon with the installed configuration, and its clients.
    daemon = Daemon(argparse.Namespace(pvgpud=at(pvgpud)), tmp)
    shutil.copy(conf, daemon.config)
    daemon.start()
    p = run([load, "bench", "--socket", daemon.socket, "--kernel-us", "100", "--kernels", "20"], env=env)
    check("runtime_ms=" in p.stdout, f"installed pvgpu-load bench printed no runtime:\n{p.stdout}")

    # An application built against the DESTDIR tree with pkg-config.
    pc_env = dict(os.environ, PKG_CONFIG_PATH=os.path.dirname(pc), PKG_CONFIG_SYSROOT_DIR=dest,
                  PKG_CONFIG_ALLOW_SYSTEM_CFLAGS="1", PKG_CONFIG_ALLOW_SYSTEM_LIBS="1")
    flags = run(["pkg-config", "--cflags", "--libs", "pvgpu"], env=pc_env).stdout.split()
    check(f"-I{at(dirs['includedir'])}" in flags and f"-L{libdir}" in flags and "-lpvgpu" in flags,
          f"pkg-config --cflags --libs pvgpu gives {flags}")
    check(run(["pkg-config", "--modversion", "pvgpu"], env=pc_env).stdout.strip() == version,
          "pvgpu.pc has the wrong version")
    src = os.path.join(tmp, "app.cpp")
    with open(src, "w") as f:
        f.write(APP)
    app = os.path.join(tmp, "app")
    run(shlex.split(ns.cxx) + ["-std=c++20", "-Wall", "-Werror", src, "-o", app] + flags, timeout=300)
    p = run([app, daemon.socket, os.path.join(tmp, "no-such.sock")], env=env, check_rc=False)
    out = p.stdout.splitlines()
    check(p.returncode == 0, f"app exit {p.returncode}:\n{p.stdout}{p.stderr}")
    check(f"version={version}" in out, f"app printed {out}, want version={version}")
    check(f"default_socket={dirs['rundir']}/pvgpud.sock" in out, f"app printed {out}")
    check(any(re.fullmatch(r"channel=\d+ completed=1", line) for line in out), f"app's kernel did not run: {out}")
    check("caught=ClientError" in out, f"app did not catch the library's ClientError: {out}")
    ldd = run(["ldd", app], env=env).stdout
    check(f"libpvgpu.so.0 => {libdir}/libpvgpu.so.0" in ldd, f"app did not load the installed libpvgpu:\n{ldd}")
    rc = daemon.stop()
    check(rc == 0, f"installed pvgpud exited {rc} on SIGTERM")
    log(f"installed tree under {dest} checked; app: {' '.join(out)}")


def configure_only(ns, tmp, name, options):
    """meson setup (no compile) of the source with OPTIONS; the generated files."""
    build = os.path.join(tmp, name)
    run([ns.meson, "setup", build, ns.source_dir, "-Dtests=false", "-Dbenchmarks=false", "-Dguest_kdir=none",
         "-Dman=disabled"] + options, timeout=300)
    files = {}
    for rel in ("scheduler/pvgpu_paths.h", "scheduler/daemon/pvgpud.service", "scheduler/daemon/pvgpud.conf"):
        with open(os.path.join(build, rel)) as f:
            files[os.path.basename(rel)] = f.read()
    return build, files


def check_paths_header(text, want):
    got = dict(re.findall(r'#define (PVGPU_\w+) "([^"]*)"', text))
    for key, value in want.items():
        check(got.get(key) == value, f"pvgpu_paths.h: {key} is {got.get(key)!r}, want {value!r}")


def case_prefix(ns, tmp):
    # The distribution layout: everything where systemd's directives put it.
    build, files = configure_only(ns, tmp, "usr", ["--prefix=/usr"])
    dirs, _ = configured_dirs(ns.meson, build)
    check(dirs["confdir"] == "/etc/pvgpu" and dirs["statedir"] == "/var/lib/pvgpu", f"prefix /usr gives {dirs}")
    check_paths_header(files["pvgpu_paths.h"], {
        "PVGPU_CONFIG_FILE": "/etc/pvgpu/pvgpud.conf", "PVGPU_STATE_DIR": "/var/lib/pvgpu",
        "PVGPU_SOCKET_PATH": "/run/pvgpu/pvgpud.sock", "PVGPU_ADMIN_SOCKET_PATH": "/run/pvgpu/admin.sock"})
    check(check_unit(files["pvgpud.service"], dirs) == "/usr/sbin/pvgpud", "prefix /usr: ExecStart")
    check_conf(files["pvgpud.conf"], dirs)

    # A private prefix with sockets outside /run: ReadWritePaths= instead.
    build, files = configure_only(ns, tmp, "opt", ["--prefix=/opt/pvgpu", "-Drunstatedir=/var/run"])
    dirs, _ = configured_dirs(ns.meson, build)
    check_paths_header(files["pvgpu_paths.h"], {
        "PVGPU_CONFIG_FILE": "/opt/pvgpu/etc/pvgpu/pvgpud.conf", "PVGPU_STATE_DIR": "/opt/pvgpu/var/lib/pvgpu",
        "PVGPU_SOCKET_PATH": "/var/run/pvgpu/pvgpud.sock"})
    check(check_unit(files["pvgpud.service"], dirs) == "/opt/pvgpu/sbin/pvgpud", "prefix /opt/pvgpu: ExecStart")
    check_conf(files["pvgpud.conf"], dirs)

    # A relative runstatedir is refused with a message naming the option.
    p = run([ns.meson, "setup", os.path.join(tmp, "bad"), ns.source_dir, "-Dtests=false", "-Dguest_kdir=none",
             "-Dman=disabled", "-Drunstatedir=run"], check_rc=False, timeout=300)
    check(p.returncode != 0 and "runstatedir must be an absolute path" in p.stdout + p.stderr,
          f"relative runstatedir accepted (exit {p.returncode})")


CASES = {"tree": case_tree, "prefix": case_prefix}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build-dir", required=True)
    ap.add_argument("--source-dir", required=True)
    ap.add_argument("--meson", required=True)
    ap.add_argument("--cxx", required=True, help="the C++ compiler command (shell words)")
    ap.add_argument("--kubevirt-hook", action="store_true",
                    help="the build has pvgpu-kubevirt-hook (libvirt found): check it is installed")
    ap.add_argument("case", choices=sorted(CASES))
    ns = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix=f"pvgpu-install-{ns.case}-")
    try:
        CASES[ns.case](ns, tmp)
        print(f"PASS {ns.case}", flush=True)
        return 0
    except Skip as e:
        print(f"SKIP {ns.case}: {e}", flush=True)
        return SKIP
    except TestFailure as e:
        print(f"FAIL {ns.case}: {e}", flush=True)
        for daemon in DAEMONS:
            print("# pvgpud log:")
            daemon.dump_log()
        return 1
    finally:
        for daemon in DAEMONS:
            if daemon.alive():
                daemon.proc.kill()
                daemon.proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
