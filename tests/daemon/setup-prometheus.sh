#!/bin/sh
# What the daemon-prometheus test needs on a Debian 12 host (as root): the
# real consumers of pvgpud's metrics textfile, promtool (package prometheus)
# and prometheus-node-exporter.  The test starts its own node exporter on a
# free loopback port; nothing here is configured.  (On a host with systemd,
# Debian's packages enable and start their own services, prometheus on :9090
# and the node exporter on :9100; the test does not use them.)  No
# recommends: the node exporter's collector scripts and smartmontools are
# not needed.
# Idempotent.  usage: tests/daemon/setup-prometheus.sh
set -eu
exec "$(dirname "$0")/../install-packages.sh" setup-prometheus prometheus prometheus-node-exporter
