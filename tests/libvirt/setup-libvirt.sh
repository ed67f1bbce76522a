#!/bin/sh
# What the libvirt tests need on a Debian 12 host (as root): libvirtd and
# virtlogd (libvirt-daemon, with its QEMU driver), virsh, and pkill (procps,
# not in a minimal Debian) to stop QEMUs a stopped libvirtd left behind.  Nothing is
# configured or started system-wide: each test runs its own session-mode
# libvirtd as the user nobody, with its state in a temporary directory.  No
# recommends: neither dnsmasq nor a system libvirtd service are wanted.
# Idempotent.  usage: tests/libvirt/setup-libvirt.sh
set -eu
exec "$(dirname "$0")/../install-packages.sh" setup-libvirt \
    libvirt-daemon libvirt-daemon-driver-qemu libvirt-clients procps
