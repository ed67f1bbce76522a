#!/bin/sh
# Installs the Debian packages named that are not installed yet, without
# their recommends (as root; apt-get update first).  Nothing to do: exit 0
# at once.  Not root and something missing: says what to install, exit 1.
# usage: tests/install-packages.sh TAG PACKAGE...   (TAG prefixes the log lines)
set -eu
tag=$1
shift
log() { printf '%s: %s\n' "$tag" "$*" >&2; }
installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q 'install ok installed'; }
missing=""
for p in "$@"; do
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
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $missing
