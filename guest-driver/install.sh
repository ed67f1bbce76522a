#!/bin/sh
# Install the pvgpu guest driver with DKMS (rebuilt for every new kernel),
# its udev rule and the group `pvgpu`, and load it.  Run as root inside the
# guest, from the project tree.
# usage: install.sh [--uninstall]
set -eu
here=$(cd "$(dirname "$0")" && pwd)
version=$(sed -n 's/^PACKAGE_VERSION="\(.*\)"/\1/p' "$here/dkms.conf")
src=/usr/src/pvgpu-$version
rules=/etc/udev/rules.d/60-pvgpu.rules

if [ "$(id -u)" -ne 0 ]; then
    echo "install.sh: run as root" >&2
    exit 1
fi

if [ "${1:-}" = "--uninstall" ]; then
    modprobe -r pvgpu 2>/dev/null || true
    if dkms status -m pvgpu -v "$version" 2>/dev/null | grep -q pvgpu; then
        dkms remove -m pvgpu -v "$version" --all
    fi
    rm -rf "$src" "$rules"
    udevadm control --reload-rules 2>/dev/null || true
    echo "pvgpu $version removed (group pvgpu kept)"
    exit 0
elif [ $# -ne 0 ]; then
    echo "usage: install.sh [--uninstall]" >&2
    exit 2
fi

missing=""
command -v dkms >/dev/null || missing=" dkms"
[ -d "/lib/modules/$(uname -r)/build" ] || missing="$missing linux-headers-$(uname -r)"
if [ -n "$missing" ]; then
    echo "install.sh: installing$missing"
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $missing
fi

# A clean copy: DKMS builds from /usr/src/pvgpu-VERSION only.
if dkms status -m pvgpu -v "$version" 2>/dev/null | grep -q pvgpu; then
    dkms remove -m pvgpu -v "$version" --all
fi
rm -rf "$src"
make -s -C "$here" dkms-source DESTDIR="$src"
dkms add -m pvgpu -v "$version"
dkms build -m pvgpu -v "$version"
dkms install -m pvgpu -v "$version"

getent group pvgpu >/dev/null || groupadd --system pvgpu
install -m 0644 "$here/60-pvgpu.rules" "$rules"
udevadm control --reload-rules 2>/dev/null || true
modprobe -r pvgpu 2>/dev/null || true
modprobe pvgpu
udevadm trigger --subsystem-match=misc --sysname-match=pvgpu 2>/dev/null || true
echo "pvgpu $version installed; add users with: adduser USER pvgpu"
