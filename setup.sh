#!/bin/sh
# Install what pvgpu needs on Debian 12 (bookworm), configure and build it.
# Idempotent: packages already present are not fetched again, an existing
# build directory is reused.  Usage: ./setup.sh [BUILD_DIR]
set -eu
cd "$(dirname "$0")"
build=${1:-build}

# Build tools and libraries; python3 and gnuplot serve the experiment scripts
# and plots in docs/, go-md2man renders the manual pages, man-db checks them;
# libvirt-dev and libxml2-dev serve the libvirt integration; gRPC and protobuf
# (libraries and code generators) the Kubernetes device plugin and its test.
packages="meson ninja-build pkg-config g++ catch2 nlohmann-json3-dev libglib2.0-dev python3 gnuplot-nox clang libclang-rt-14-dev go-md2man man-db libvirt-dev libxml2-dev libgrpc++-dev libprotobuf-dev protobuf-compiler protobuf-compiler-grpc"

missing=""
for p in $packages; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
if [ -n "$missing" ]; then
    if [ "$(id -u)" -ne 0 ]; then
        echo "setup.sh: missing packages:$missing; run as root (or: sudo apt-get install$missing)" >&2
        exit 1
    fi
    echo "setup.sh: installing$missing"
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $missing
fi

if [ ! -f "$build/build.ninja" ]; then
    meson setup "$build" -Dwerror=true
elif grep -q 'pvgpu.ko not built: no kernel headers' "$build/meson-logs/meson-log.txt" 2>/dev/null &&
     ls -d /usr/src/linux-headers-*-amd64 >/dev/null 2>&1; then
    # Configured before the guest kernel headers were installed (./setup.sh
    # first, then tests/run-all.sh fetched them): build pvgpu.ko now.
    meson setup --reconfigure "$build"
elif grep -q 'Run-time dependency grpc++ found: NO' "$build/meson-logs/meson-log.txt" 2>/dev/null &&
     pkg-config --exists grpc++; then
    # Configured before gRPC was installed (the 'kubernetes' feature is
    # auto): build pvgpu-device-plugin and its test now.
    meson setup --reconfigure "$build"
elif guest_hdr=/usr/src/linux-headers-$(cat "$build/guest-kernel/version" 2>/dev/null) &&
     [ -f "$guest_hdr/Makefile" ] &&
     grep -q '"name": "guest_kdir", "value": "auto"' "$build/meson-info/intro-buildoptions.json" 2>/dev/null &&
     ! grep -qx "Message: pvgpu.ko: building against $guest_hdr" "$build/meson-logs/meson-log.txt" 2>/dev/null; then
    # The test guests' kernel changed (tests/vm/setup-guest.sh): pvgpu.ko
    # follows it (guest_kdir=auto).
    meson setup --reconfigure "$build"
fi
meson compile -C "$build"
