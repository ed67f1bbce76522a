#!/bin/sh
# Line coverage of the pvgpu device (qemu-patches/hw/misc/pvgpu.c) under the
# device fuzzer, on demand (not part of CI).  Next to the sanitizer QEMU
# (qemu-patches/build-qemu.sh --asan) it links a copy whose pvgpu.c object
# alone is compiled with --coverage (QEMU's meson has no per-file flags, and
# a gcov build of all of QEMU would be a third full build), runs
# tests/qemu/fuzz_device.py against that copy and prints gcov's summary.
#   usage: tests/qemu/fuzz-coverage.sh [SECONDS [SEED]]
# Output: build/qemu-asan/coverage/ (the binary, pvgpu.gcno/.gcda, and
# pvgpu.c.gcov with per-line counts).
set -eu
cd "$(dirname "$0")/../.."
repo=$(pwd)
seconds=${1:-60}
seed=${2:-1}
asan=${PVGPU_QEMU_ASAN_DIR:-$repo/build/qemu-asan}
if [ ! -f "$asan/build/build.ninja" ]; then
    echo "fuzz-coverage: no sanitizer build in $asan (run qemu-patches/build-qemu.sh --asan)" >&2
    exit 1
fi
mkdir -p "$asan/coverage"
cov=$(cd "$asan/coverage" && pwd)
obj=libcommon.fa.p/hw_misc_pvgpu.c.o
PATH=/usr/bin:/bin:$PATH        # the build's own tools, as build-qemu.sh uses them
cd "$asan/build"
ninja qemu-system-x86_64 >/dev/null
cc_cmd=$(ninja -t commands "$obj" | tail -n 1)
ld_cmd=$(ninja -t commands qemu-system-x86_64 | tail -n 1)
rm -f "$cov"/*.gcda "$cov"/*.gcov
# The same compile and link, with the object elsewhere and gcov's flags.
eval "$(printf '%s' "$cc_cmd" |
    sed "s# -o $obj # -o $cov/pvgpu.o #; s# -MD##; s# -MQ [^ ]*##; s# -MF [^ ]*##") --coverage"
eval "$(printf '%s' "$ld_cmd" |
    sed "s# -o qemu-system-x86_64 # -o $cov/qemu-system-x86_64 #; s# $obj # $cov/pvgpu.o #") --coverage"
cd "$repo"
status=0
tests/qemu/fuzz_device.py --qemu "$cov/qemu-system-x86_64" --seconds "$seconds" --seed "$seed" \
    --stats "$cov/fuzz.json" || status=$?
# QEMU wrote pvgpu.gcda when it exited.
cd "$cov"
gcov -o "$cov" "$cov/pvgpu.o" 2>/dev/null | grep -A1 "hw/misc/pvgpu.c'" || {
    echo "fuzz-coverage: no coverage data (did QEMU exit cleanly?)" >&2
    exit 1
}
ls "$cov"/*pvgpu.c.gcov >/dev/null 2>&1 && echo "per-line counts: $(ls "$cov"/*pvgpu.c.gcov)"
exit $status
