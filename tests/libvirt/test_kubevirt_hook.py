#!/usr/bin/env python3
"""pvgpu-kubevirt-hook run as KubeVirt's sidecar-shim runs onDefineDomain
(`--vmi VMI_JSON --domain DOMAIN_XML`, optionally after `--version V`) on
virt-launcher-shaped domain XML (tests/libvirt/kubevirt/): the edits, the
byte-for-byte pass-through, and each refusal with its exit code and its one
line on stderr.

usage: test_kubevirt_hook.py HOOK DEFAULT_SOCKET
Exit status: 0 pass, 1 fail.
"""

import copy
import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET

HERE = os.path.dirname(os.path.abspath(__file__))
FIX = os.path.join(HERE, "kubevirt")
QEMU = "http://libvirt.org/schemas/domain/qemu/1.0"
PVGPU = "http://pvgpu.org/xmlns/domain/1.0"
KUBEVIRT = "http://kubevirt.io"
PROG = "pvgpu-kubevirt-hook"

HOOK = ""
DEFAULT_SOCKET = ""
FAILURES = []


def fixture(name):
    with open(os.path.join(FIX, name), encoding="utf-8") as f:
        return f.read()


def vmi_with(annotations=None, drop=()):
    """The fixture VMI (pvgpu.org/weight "300") with annotations changed."""
    vmi = json.loads(fixture("vmi.json"))
    ann = vmi["metadata"]["annotations"]
    for k in drop:
        ann.pop(k, None)
    ann.update(annotations or {})
    return json.dumps(vmi)


def run(*args, env=None, version=None):
    """The hook as the shim runs it: a clean environment plus `env`."""
    e = {k: v for k, v in os.environ.items() if not k.startswith("PVGPU_")}
    e.update(env or {})
    argv = [HOOK] + (["--version", version] if version else []) + list(args)
    return subprocess.run(argv, capture_output=True, env=e, timeout=30)


def check(cond, what):
    if not cond:
        FAILURES.append(what)
        print(f"FAIL: {what}", flush=True)
    return cond


def one_line(p, want_rc, *words):
    """Exit want_rc, nothing on stdout, one stderr line naming the hook and the words."""
    err = p.stderr.decode()
    ok = check(p.returncode == want_rc, f"exit {p.returncode}, want {want_rc} ({err.strip()})")
    ok &= check(p.stdout == b"", f"stdout not empty on a refusal: {p.stdout[:200]!r}")
    ok &= check(err.count("\n") == 1 and err.startswith(PROG + ": "), f"not one line: {err!r}")
    for w in words:
        ok &= check(w in err, f"{w!r} not in {err.strip()!r}")
    return err.strip()


def args_of(root):
    cmd = root.find(f"{{{QEMU}}}commandline")
    return [a.get("value") for a in cmd.findall(f"{{{QEMU}}}arg")] if cmd is not None else []


def pvgpu_args(socket, gpu=None):
    dev = "pvgpu,chardev=pvgpu0" + (f",gpu={gpu}" if gpu is not None else "")
    return ["-chardev", f"socket,id=pvgpu0,path={socket},reconnect=1", "-device", dev]


def without_pvgpu(root):
    """The tree less what the hook adds (for comparing the rest with the input)."""
    root = copy.deepcopy(root)
    md = root.find("metadata")
    if md is not None:
        for g in md.findall(f"{{{PVGPU}}}gpu"):
            md.remove(g)
    cmd = root.find(f"{{{QEMU}}}commandline")
    if cmd is not None:
        args = cmd.findall(f"{{{QEMU}}}arg")
        for i, a in enumerate(args):
            if a.get("value") == "-chardev" and args[i + 1].get("value").startswith("socket,id=pvgpu0,"):
                cmd.remove(a), cmd.remove(args[i + 1])
            if a.get("value") == "-device" and args[i + 1].get("value").startswith("pvgpu,"):
                cmd.remove(a), cmd.remove(args[i + 1])
    return root


def canonical(root):
    return ET.canonicalize(ET.tostring(root, encoding="unicode"), strip_text=True)


def attached(p, domain_xml, weight, socket, gpu=None):
    """The hook's output: the input plus <pvgpu:gpu weight device> in
    <metadata> and the chardev and device after the domain's own arguments."""
    err = p.stderr.decode()
    if not check(p.returncode == 0, f"exit {p.returncode}: {err.strip()}"):
        return None
    try:
        out = ET.fromstring(p.stdout)
    except ET.ParseError as e:
        check(False, f"output is not XML: {e}")
        return None
    gpus = out.findall(f"metadata/{{{PVGPU}}}gpu")
    if check(len(gpus) == 1, f"{len(gpus)} <pvgpu:gpu> elements in <metadata>"):
        want = {"weight": str(weight)} | ({"device": str(gpu)} if gpu is not None else {})
        check(gpus[0].attrib == want, f"<pvgpu:gpu> {gpus[0].attrib}, want {want}")
    inp = ET.fromstring(domain_xml)
    check(args_of(out) == args_of(inp) + pvgpu_args(socket, gpu),
          f"command line {args_of(out)}, want {args_of(inp) + pvgpu_args(socket, gpu)}")
    rest = without_pvgpu(out)
    # What the hook made (<metadata>, <qemu:commandline>) is empty without ours.
    for tag in ("metadata", f"{{{QEMU}}}commandline"):
        made = rest.find(tag)
        if inp.find(tag) is None and made is not None and len(made) == 0:
            rest.remove(made)
    rest_in, rest_out = canonical(inp), canonical(rest)
    check(rest_in == rest_out, "the rest of the domain changed: first difference at character "
          f"{next((i for i, (a, b) in enumerate(zip(rest_in, rest_out)) if a != b), min(len(rest_in), len(rest_out)))}"
          f": {rest_in[-300:]!r} / {rest_out[-300:]!r}")
    check(f"weight {weight}" in err and err.count("\n") >= 1, f"no summary line on stderr: {err!r}")
    return out


# ---- cases ------------------------------------------------------------------------------------


def test_pass_through():
    for name in ("domain.xml", "domain-no-metadata.xml", "domain-commandline.xml"):
        dom = fixture(name)
        for version in (None, "v1alpha2", "v1alpha3"):
            p = run("--vmi", fixture("vmi-no-pvgpu.json"), "--domain", dom, version=version)
            check(p.returncode == 0 and p.stdout == dom.encode() and p.stderr == b"",
                  f"{name} (--version {version}): not passed through byte for byte (exit {p.returncode}, "
                  f"{len(p.stdout)} bytes of {len(dom.encode())}, stderr {p.stderr!r})")
    # A VMI without metadata or annotations at all, and a domain with no newline at the end.
    for vmi in ('{"kind": "VirtualMachineInstance"}', '{"metadata": {"name": "x"}}',
                '{"metadata": {"annotations": null}}'):
        p = run("--vmi", vmi, "--domain", "<domain><name>x</name></domain>")
        check(p.returncode == 0 and p.stdout == b"<domain><name>x</name></domain>", f"{vmi}: not passed through")


def test_weight():
    for name in ("domain.xml", "domain-no-metadata.xml", "domain-commandline.xml"):
        dom = fixture(name)
        for version in (None, "v1alpha3"):
            out = attached(run("--vmi", fixture("vmi.json"), "--domain", dom, version=version), dom, 300,
                           DEFAULT_SOCKET)
            if out is not None and name != "domain-no-metadata.xml":
                kv = out.find(f"metadata/{{{KUBEVIRT}}}kubevirt/{{{KUBEVIRT}}}uid")
                check(kv is not None and kv.text == "3f0b6a52-9d1e-4c7a-8f25-6b8e1d0c9a47",
                      f"{name}: kubevirt's metadata lost")
    # A bare --version first (no API version given) changes nothing either.
    dom = fixture("domain.xml")
    attached(run("--version", "--vmi", fixture("vmi.json"), "--domain", dom), dom, 300, DEFAULT_SOCKET)
    # libvirt's order in <qemu:commandline>: arguments, then <qemu:env>.
    p = run("--vmi", fixture("vmi.json"), "--domain", fixture("domain-commandline.xml"))
    cmd = ET.fromstring(p.stdout).find(f"{{{QEMU}}}commandline")
    tags = [c.tag.split("}")[1] for c in cmd]
    check(tags == ["arg"] * 6 + ["env"], f"commandline children {tags}")
    # Defaults and bounds.
    dom = fixture("domain.xml")
    attached(run("--vmi", vmi_with(drop=["pvgpu.org/weight"], annotations={"pvgpu.org/gpu": "any"}),
                 "--domain", dom), dom, 100, DEFAULT_SOCKET)
    for w in ("1", "10000", "0300"):
        attached(run("--vmi", vmi_with({"pvgpu.org/weight": w}), "--domain", dom), dom, int(w), DEFAULT_SOCKET)


def test_gpu_and_socket():
    dom = fixture("domain-commandline.xml")
    attached(run("--vmi", vmi_with({"pvgpu.org/gpu": "1"}), "--domain", dom), dom, 300, DEFAULT_SOCKET, gpu=1)
    attached(run("--vmi", vmi_with({"pvgpu.org/gpu": "15"}), "--domain", dom), dom, 300, DEFAULT_SOCKET, gpu=15)
    attached(run("--vmi", vmi_with({"pvgpu.org/gpu": "any"}), "--domain", dom), dom, 300, DEFAULT_SOCKET)
    attached(run("--vmi", fixture("vmi.json"), "--domain", dom, env={"PVGPU_SOCKET": "/pvgpu/env.sock"}),
             dom, 300, "/pvgpu/env.sock")
    attached(run("--vmi", fixture("vmi.json"), "--domain", dom, "--socket", "/pvgpu/opt.sock",
                 env={"PVGPU_SOCKET": "/pvgpu/env.sock"}), dom, 300, "/pvgpu/opt.sock")
    attached(run("--socket=/pvgpu/eq.sock", "--vmi", fixture("vmi.json"), "--domain", dom), dom, 300,
             "/pvgpu/eq.sock")
    # Run again on its own output: one device, the new values.
    first = run("--vmi", vmi_with({"pvgpu.org/gpu": "1"}), "--domain", dom).stdout.decode()
    p = run("--vmi", vmi_with({"pvgpu.org/weight": "50", "pvgpu.org/gpu": "2"}), "--domain", first)
    out = ET.fromstring(p.stdout)
    check(args_of(out) == args_of(ET.fromstring(dom)) + pvgpu_args(DEFAULT_SOCKET, 2), f"rerun: {args_of(out)}")
    check([g.attrib for g in out.findall(f"metadata/{{{PVGPU}}}gpu")] == [{"weight": "50", "device": "2"}],
          "rerun: metadata not replaced")


def test_device_plugin_env():
    dom = fixture("domain.xml")
    # PVGPU_GPU alone makes a pvgpu VM (the cluster reserved it a share) at the default weight.
    attached(run("--vmi", fixture("vmi-no-pvgpu.json"), "--domain", dom, env={"PVGPU_GPU": "2"}), dom, 100,
             DEFAULT_SOCKET, gpu=2)
    attached(run("--vmi", fixture("vmi.json"), "--domain", dom, env={"PVGPU_GPU": "3"}), dom, 300,
             DEFAULT_SOCKET, gpu=3)
    for same in ("3", "any"):
        attached(run("--vmi", vmi_with({"pvgpu.org/gpu": same}), "--domain", dom, env={"PVGPU_GPU": "3"}), dom,
                 300, DEFAULT_SOCKET, gpu=3)
    p = run("--vmi", fixture("vmi.json"), "--domain", dom, env={"PVGPU_GPU": "0", "PVGPU_GPU_SHARE": "25"})
    attached(p, dom, 300, DEFAULT_SOCKET, gpu=0)
    notes = [line for line in p.stderr.decode().splitlines() if "PVGPU_GPU_SHARE" in line]
    check(len(notes) == 1 and "25%" in notes[0] and "not applied" in notes[0], f"share note: {notes}")
    one_line(run("--vmi", vmi_with({"pvgpu.org/gpu": "1"}), "--domain", dom, env={"PVGPU_GPU": "0"}), 1,
             "pvgpu.org/gpu", '"1"', "GPU 0", "PVGPU_GPU")
    for bad in ("16", "x", "-1", " 1"):
        one_line(run("--vmi", fixture("vmi.json"), "--domain", dom, env={"PVGPU_GPU": bad}), 1, "PVGPU_GPU",
                 json.dumps(bad))
    for bad in ("0", "101", "ten"):
        one_line(run("--vmi", fixture("vmi.json"), "--domain", dom, env={"PVGPU_GPU": "0", "PVGPU_GPU_SHARE": bad}),
                 1, "PVGPU_GPU_SHARE", json.dumps(bad))
    one_line(run("--vmi", fixture("vmi.json"), "--domain", dom, env={"PVGPU_GPU_SHARE": "25"}), 1,
             "PVGPU_GPU_SHARE", "PVGPU_GPU ")


def test_refusals():
    dom = fixture("domain.xml")
    err = one_line(run("--vmi", vmi_with({"pvgpu.org/weight": "abc"}), "--domain", dom), 1)
    check(err == f'{PROG}: annotation pvgpu.org/weight: "abc" is not a whole number from 1 to 10000', err)
    for bad in ("0", "10001", "-5", " 300", "3e2", "", "99999999999999999999", "300\nx"):
        one_line(run("--vmi", vmi_with({"pvgpu.org/weight": bad}), "--domain", dom), 1, "pvgpu.org/weight",
                 json.dumps(bad))
    for bad in ("16", "-1", "gpu0", "", "ANY"):
        one_line(run("--vmi", vmi_with({"pvgpu.org/gpu": bad}), "--domain", dom), 1, "pvgpu.org/gpu",
                 json.dumps(bad))
    for key in ("pvgpu.org/max", "pvgpu.org/min"):
        one_line(run("--vmi", vmi_with({key: "50"}), "--domain", dom), 1, key, "Share controls")
        one_line(run("--vmi", vmi_with({key: "50"}, drop=["pvgpu.org/weight"]), "--domain", dom), 1, key)
    one_line(run("--vmi", vmi_with({"pvgpu.org/wieght": "300"}), "--domain", dom), 1, "pvgpu.org/wieght")
    one_line(run("--vmi", vmi_with({"pvgpu.org/weight": 300}), "--domain", dom), 1, "pvgpu.org/weight")
    one_line(run("--vmi", fixture("vmi.json"), "--domain", dom, "--socket", "/a,b"), 1, "--socket", '"/a,b"')
    one_line(run("--vmi", fixture("vmi.json"), "--domain", dom, env={"PVGPU_SOCKET": "/a,b"}), 1, "PVGPU_SOCKET")
    # Malformed input.
    for vmi in ("{", "", "[]", '{"metadata": []}', '{"metadata": {"annotations": ["pvgpu.org/weight"]}}'):
        one_line(run("--vmi", vmi, "--domain", dom), 1, "--vmi")
    for bad in ("<domain>", "", "<notadomain/>", "not xml"):
        one_line(run("--vmi", fixture("vmi.json"), "--domain", bad), 1, "--domain")


def test_usage():
    dom, vmi = fixture("domain.xml"), fixture("vmi.json")
    for args in ((), ("--vmi", vmi), ("--domain", dom), ("--vmi",), ("--bogus", "--vmi", vmi, "--domain", dom),
                 ("--socket", "", "--vmi", vmi, "--domain", dom), ("--version", "v9", "--vmi", vmi, "--domain", dom),
                 ("extra", "--vmi", vmi, "--domain", dom)):
        one_line(run(*args), 2)
    p = run("--version")
    check(p.returncode == 0 and all(v in p.stdout.decode() for v in ("v1alpha1", "v1alpha2", "v1alpha3"))
          and p.stdout.decode().startswith(PROG + " "), f"--version: {p.stdout!r}")
    p = run("--help")
    check(p.returncode == 0 and b"--vmi" in p.stdout and b"pvgpu.org/weight" in p.stdout
          and DEFAULT_SOCKET.encode() in p.stdout, "--help")


def main():
    global HOOK, DEFAULT_SOCKET
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    HOOK, DEFAULT_SOCKET = sys.argv[1], sys.argv[2]
    tests = [v for k, v in sorted(globals().items()) if k.startswith("test_")]
    failed = 0
    for t in tests:
        before = len(FAILURES)
        t()
        failed += len(FAILURES) > before
        print(f"{'ok' if len(FAILURES) == before else 'FAILED'} {t.__name__}", flush=True)
    print(f"{len(tests) - failed} of {len(tests)} tests passed, {len(FAILURES)} failed checks")
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
