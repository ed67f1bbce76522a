#!/bin/sh
# Build QEMU 7.2 (Debian bookworm source) with the pvgpu PCI device.
#
#   qemu-patches/build-qemu.sh [--deps-only|--no-deps] [--asan]
#
# Idempotent: every stage leaves a stamp file in the cache directory and is
# skipped when its stamp is newer than its inputs.  The cache directory is
# $PVGPU_QEMU_DIR (default: <repo>/build/qemu-src).  Result:
#   $PVGPU_QEMU_DIR/qemu-system-x86_64
# --asan builds, instead, a second QEMU from the same source tree with
# AddressSanitizer and UBSan (configure --enable-sanitizers) and without TCG
# (qtest needs no CPU emulation; leaving it out halves the build) and
# without the firmware path (qtest boots no BIOS), for the
# qemu test suite's use-after-free checks.  Its build directory is
# $PVGPU_QEMU_ASAN_DIR (default: <repo>/build/qemu-asan).  Result:
#   $PVGPU_QEMU_ASAN_DIR/qemu-system-x86_64
# Installing packages and adding the deb-src entry needs root (apt); when
# not root those steps are skipped and missing tools make the build fail
# with a message.
set -eu

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/.." && pwd)
cache=${PVGPU_QEMU_DIR:-$repo/build/qemu-src}
jobs=${PVGPU_QEMU_JOBS:-$(nproc 2>/dev/null || echo 2)}
mode=all
asan=0
for arg in "$@"; do
    case $arg in
    --deps-only|--no-deps) mode=$arg ;;
    --asan) asan=1 ;;
    -h|--help) sed -n '2,/^set -eu/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) printf 'build-qemu: unknown option %s (see --help)\n' "$arg" >&2; exit 2 ;;
    esac
done

log() { printf 'build-qemu: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

mkdir -p "$cache"
cache=$(cd "$cache" && pwd)

# --- 1. deb-src entry and the packages the minimal configure needs -------
deps="dpkg-dev ninja-build meson pkg-config libglib2.0-dev libpixman-1-dev \
python3 flex bison gcc make libfdt-dev patch"
if [ "$mode" != "--no-deps" ]; then
    if [ "$(id -u)" = 0 ]; then
        need_update=0
        if ! grep -rqs '^Types:.*deb-src' /etc/apt/sources.list.d/ &&
           ! grep -qs '^deb-src ' /etc/apt/sources.list; then
            log "adding deb-src entry for bookworm"
            cat > /etc/apt/sources.list.d/pvgpu-deb-src.sources <<'SRC'
Types: deb-src
URIs: http://deb.debian.org/debian
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
            need_update=1
        fi
        missing=""
        for p in $deps; do
            dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'ok installed' ||
                missing="$missing $p"
        done
        if [ -n "$missing" ] || [ $need_update = 1 ]; then
            log "apt-get update"
            apt-get update -qq
        fi
        if [ -n "$missing" ]; then
            log "installing:$missing"
            DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $missing
        fi
    else
        log "not root: skipping deb-src/apt steps"
    fi
fi
[ "$mode" = "--deps-only" ] && exit 0

# --- 2. source --------------------------------------------------------------
src=""
if [ -f "$cache/.stamp-source" ]; then
    src=$(cat "$cache/.stamp-source")
fi
if [ -z "$src" ] || [ ! -d "$src" ]; then
    src=$(ls -d "$cache"/qemu-*/ 2>/dev/null | head -n1)
    src=${src%/}
fi
if [ -z "$src" ] || [ ! -f "$src/configure" ]; then
    log "fetching QEMU source (apt-get source qemu) into $cache"
    (cd "$cache" && apt-get source -qq qemu) || die "apt-get source qemu failed (deb-src entry? network?)"
    src=$(ls -d "$cache"/qemu-*/ 2>/dev/null | head -n1)
    [ -n "$src" ] && [ -f "$src/configure" ] || die "no QEMU source tree under $cache"
    src=${src%/}
    printf '%s\n' "$src" > "$cache/.stamp-source"
fi
# a stable name for the tree
ln -sfn "$src" "$cache/qemu"

# --- 3. device source and registration patches ------------------------------
# The device file is copied every run (cheap; ninja rebuilds only if changed).
if ! cmp -s "$here/hw/misc/pvgpu.c" "$src/hw/misc/pvgpu.c"; then
    cp "$here/hw/misc/pvgpu.c" "$src/hw/misc/pvgpu.c"
fi
for p in "$here"/*.patch; do
    [ -f "$p" ] || continue
    stamp="$cache/.stamp-patch-$(basename "$p")"
    if [ -f "$stamp" ] && [ "$stamp" -nt "$p" ]; then continue; fi
    if (cd "$src" && patch -p1 -R --dry-run -s -f < "$p" >/dev/null 2>&1); then
        log "$(basename "$p") already applied"
    else
        log "applying $(basename "$p")"
        (cd "$src" && patch -p1 -s -f < "$p") || die "patch $(basename "$p") failed"
    fi
    touch "$stamp"
done
# Copy the shared ABI headers so the device builds against the same layout,
# and, beside pvgpu.c, the uapi of kvm-hooks/ (the in-kernel write notify
# the device probes; found next to the file that includes it).
mkdir -p "$src/include/hw/misc/pvgpu"
for h in abi.h protocol.h regs.h; do
    cmp -s "$repo/include/pvgpu/$h" "$src/include/hw/misc/pvgpu/$h" ||
        cp "$repo/include/pvgpu/$h" "$src/include/hw/misc/pvgpu/$h"
done
cmp -s "$repo/kvm-hooks/uapi/linux/kvm_pvgpu.h" "$src/hw/misc/kvm_pvgpu.h" ||
    cp "$repo/kvm-hooks/uapi/linux/kvm_pvgpu.h" "$src/hw/misc/kvm_pvgpu.h"

# --- 4. configure ------------------------------------------------------------
conf_base="--target-list=x86_64-softmmu --without-default-features \
--without-default-devices --enable-kvm"
if [ $asan = 1 ]; then
    out=${PVGPU_QEMU_ASAN_DIR:-$repo/build/qemu-asan}
    mkdir -p "$out"
    out=$(cd "$out" && pwd)
    bdir="$out/build"
    conf_args="$conf_base --disable-tcg --disable-docs --disable-install-blobs \
--enable-sanitizers"
    stamp="$out/.stamp-configure"
else
    out=$cache
    bdir="$src/build"
    # Debian's own firmware path (debian/rules FIRMWAREPATH): SeaBIOS and
    # the option ROMs from seabios and qemu-system-data, so neither libvirt
    # domains nor pvgpu-vm pass -L.
    conf_args="$conf_base --enable-tcg --disable-docs --disable-install-blobs \
--firmwarepath=/usr/share/qemu:/usr/share/seabios:/usr/lib/ipxe/qemu"
    stamp="$cache/.stamp-configure"
fi
# Debian's source has no embedded meson: use the system one, and the system
# python (a pyenv shim first in PATH would lack meson's modules).
PATH=/usr/bin:/bin:$PATH
export PATH
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$conf_args" ] ||
   [ ! -f "$bdir/build.ninja" ]; then
    log "configuring $bdir"
    mkdir -p "$bdir"
    # shellcheck disable=SC2086
    (cd "$bdir" && "$src/configure" --meson=/usr/bin/meson $conf_args) || die "configure failed"
    printf '%s\n' "$conf_args" > "$stamp"
fi

# --- 5. build ----------------------------------------------------------------
log "building $bdir/qemu-system-x86_64 (-j$jobs)"
(cd "$bdir" && ninja -j"$jobs" qemu-system-x86_64) || die "build failed"
if [ $asan = 1 ]; then
    ln -sfn "$bdir/qemu-system-x86_64" "$out/qemu-system-x86_64"
else
    # A copy, not a link: QEMU run from its build tree looks for its data in
    # the tree's qemu-bundle only, never in the firmware path.
    if [ -L "$out/qemu-system-x86_64" ] || ! cmp -s "$bdir/qemu-system-x86_64" "$out/qemu-system-x86_64"; then
        cp "$bdir/qemu-system-x86_64" "$out/qemu-system-x86_64.new"
        mv -f "$out/qemu-system-x86_64.new" "$out/qemu-system-x86_64"
    fi
fi
log "done: $out/qemu-system-x86_64"
