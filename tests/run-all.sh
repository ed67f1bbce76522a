#!/bin/sh
# Every test suite pvgpu has: installs what is needed (setup.sh, and
# qemu-patches/build-qemu.sh for QEMU with the pvgpu device), builds, then
# runs all meson test suites and the benchmark smoke run, and ends with a
# summary: targets not met, benchmarks run, and one line counting the tests
# that passed (and how many after a rerun), failed or were skipped.
# Usage: tests/run-all.sh [BUILD_DIR]
set -eu
cd "$(dirname "$0")/.."
build=${1:-build}
# The test guests' kernel, the headers pvgpu.ko is built against (before the
# build is configured), busybox and firmware.
tests/vm/setup-guest.sh "$build"
# The Debian 12 disk image of the vm-dkms test (debootstrap; the packages
# install.sh needs fetched into an offline repository in the image): a few
# minutes the first time, nothing to do after (build/dkms-image/stamp).  Its
# host packages are installed here; the image itself (downloads and dpkg
# under the image's own root, no host apt lock) is made in the background
# while QEMU and the KVM modules build, and waited for before the tests.
tests/install-packages.sh setup-dkms-image debootstrap e2fsprogs dpkg-dev qemu-utils
tests/vm/setup-dkms-image.sh "$build" > "$build/dkms-image.log" 2>&1 &
dkms_image=$!
# libvirtd, virtlogd and virsh for the 'libvirt' suite (nothing is started
# system-wide: each test runs its own session libvirtd).
tests/libvirt/setup-libvirt.sh
# promtool and prometheus-node-exporter, the real consumers of pvgpud's
# metrics textfile, for the daemon-prometheus test.
tests/daemon/setup-prometheus.sh
./setup.sh "$build"
# QEMU 7.2 with the pvgpu device, for the 'qemu' and 'vm' suites (first build
# ~5 min; later runs reuse build/qemu-src), and the same QEMU with ASan and
# UBSan for the qemu suite's qemu-asan-* tests (build/qemu-asan, from the same
# source).  PVGPU_SKIP_QEMU=1 skips both knowingly: those suites then report
# their tests as skipped.
if [ "${PVGPU_SKIP_QEMU:-0}" != 1 ]; then
    qemu-patches/build-qemu.sh
    qemu-patches/build-qemu.sh --no-deps --asan
fi
# kvm.ko, kvm-amd.ko and kvm-intel.ko with the pvgpu write-notify patches,
# for the 'kvm' suite's nested run (first build ~3 min on 2 cores; later runs
# reuse build/kvm-hooks).  PVGPU_SKIP_KVM=1 skips it: kvm-nested is skipped.
if [ "${PVGPU_SKIP_KVM:-0}" != 1 ]; then
    kvm-hooks/build.sh --kernel "$(cat "$build/guest-kernel/version")" "$build/kvm-hooks"
fi
if ! wait "$dkms_image"; then
    cat "$build/dkms-image.log" >&2
    echo "run-all: making the vm-dkms image failed (log above, $build/dkms-image.log)" >&2
    exit 1
fi
cat "$build/dkms-image.log" >&2
status=0
meson test -C "$build" --print-errorlogs || status=1
cp "$build/meson-logs/testlog.json" "$build/meson-logs/testlog-tests.json"
# Benchmarks print numbers (RESULT lines) and assert nothing; run them so they
# keep working: one that crashes or prints no figure counts as failed.
meson test -C "$build" --benchmark --print-errorlogs || status=1
# The closing summary (tests/summary.py): passed and failed count tests only;
# targets not met (tests/unmet-targets.txt, pinned) and benchmarks have their
# own lines, every rerun a line with its case and cause.
python3 tests/summary.py summarize --tests "$build/meson-logs/testlog-tests.json" \
    --benchmarks "$build/meson-logs/testlog.json" || status=1
exit $status
