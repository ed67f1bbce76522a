#!/bin/sh
# What the daemon-prometheus test needs on a Debian 12 host (as root): the
# real consumers of pvgpud's metrics textfile, promtool (package prometheus)
# and prometheus-node-exporter.  The test starts its own node exporter on a
# free loopback port; nothing here is configured.  (On a host with systemd,
# Debian's packages enable and start their own services, prometheus on :9090
# and the node exporter on :9100; the test does not use them.)
# Idempotent.  usage: tests/daemon/setup-prometheus.sh
set -eu
log() { printf 'setup-prometheus: %s\n' "$*" >&2; }
installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q 'install ok installed'; }
missing=""
for p in prometheus prometheus-node-exporter; do
    installed "$p" || missing="$missing $p"
done
[ -n "$missing" ] || exit 0
if [ "$(id -u)" != 0 ]; then
    log "missing packages:$missing; run as root (or: sudo apt-get install$missing)"
    exit 1
fi
log "apt-get update"
apt-get update -qq
log "installing$missing"
# No recommends: the node exporter's collector scripts and smartmontools
# are not needed.
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $missing
