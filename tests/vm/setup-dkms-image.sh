#!/bin/sh
# The Debian 12 guest of the 'vm-dkms' test (tests/vm/dkms_test.py): a real
# bookworm userland made with debootstrap (variant minbase, plus systemd,
# udev and Debian's kernel of the test guests' ABI, BUILD_DIR/guest-kernel/
# version), as an ext4 disk image, with what guest-driver/install.sh needs
# (dkms, linux-headers-<ABI>, gcc, make and their dependencies) NOT
# installed but fetched here and put in the image as an offline apt
# repository (/srv/pvgpu-debs, the image's only apt source): the guest has
# no network and installs them through install.sh's own apt-get.
#
# Writes BUILD_DIR/dkms-image/:
#   rootfs.img              the ext4 root file system (label pvgpu-root); the
#                           test boots a qcow2 overlay of it, it stays pristine
#   vmlinuz, initrd.img     the image's own kernel and initramfs (direct boot)
#   kernel                  its ABI (uname -r)
#   stamp                   what the image was made from (ABI, this script)
#   cache/                  every .deb fetched (debootstrap's and apt's): a
#                           rebuild downloads no package again
# Idempotent: with an up-to-date stamp it does nothing.  Needs root (chroot,
# debootstrap) and Debian's mirrors (PVGPU_DEBIAN_MIRROR, default
# http://deb.debian.org/debian; the security suite from
# PVGPU_DEBIAN_SECURITY, default http://deb.debian.org/debian-security).
#   usage: tests/vm/setup-dkms-image.sh [BUILD_DIR]
set -eu
cd "$(dirname "$0")/../.."
build=${1:-build}
out="$build/dkms-image"
mirror=${PVGPU_DEBIAN_MIRROR:-http://deb.debian.org/debian}
security=${PVGPU_DEBIAN_SECURITY:-http://deb.debian.org/debian-security}
suite=bookworm

log() { printf 'setup-dkms-image: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

[ -f "$build/guest-kernel/version" ] ||
    die "$build/guest-kernel/version missing: run tests/vm/setup-guest.sh $build first"
kver=$(cat "$build/guest-kernel/version")
# What the image is made of: a change to this script or the ABI remakes it.
want="kernel=$kver script=$(sha256sum "$0" | cut -c1-16)"
if [ -f "$out/stamp" ] && [ "$(cat "$out/stamp")" = "$want" ] &&
   [ -s "$out/rootfs.img" ] && [ -s "$out/vmlinuz" ] && [ -s "$out/initrd.img" ] && [ -s "$out/kernel" ]; then
    log "up to date: $out ($kver)"
    exit 0
fi

# debootstrap; mke2fs -d; dpkg-scanpackages (dpkg-dev); qemu-img (qemu-utils)
# for the test's copy-on-write overlay.
tests/install-packages.sh setup-dkms-image debootstrap e2fsprogs dpkg-dev qemu-utils
[ "$(id -u)" = 0 ] || die "making the image needs root (debootstrap, chroot)"

mkdir -p "$out/cache/debootstrap" "$out/cache/apt"
out=$(cd "$out" && pwd)
cache="$out/cache"
root="$out/root"
mounted=""
cleanup() {
    for m in $mounted; do umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || true; done
    rm -rf "$root" "$out/rootfs.img.new"
}
trap cleanup EXIT
trap 'exit 1' INT TERM
rm -rf "$root"
mkdir -p "$root"
t0=$(date +%s)

# Documentation, translations and the kernel's drivers for hardware the test
# guest does not have (graphics, wireless, media, sound, InfiniBand,
# staging...) are not unpacked: the image stays a few hundred MB.  dpkg's own
# mechanism (path-exclude), in place before the first package is installed.
mkdir -p "$root/etc/dpkg/dpkg.cfg.d"
cat > "$root/etc/dpkg/dpkg.cfg.d/pvgpu-small" <<'EOF'
path-exclude=/usr/share/doc/*
path-include=/usr/share/doc/*/copyright
path-exclude=/usr/share/man/*
path-exclude=/usr/share/info/*
path-exclude=/usr/share/locale/*
path-include=/usr/share/locale/locale.alias
path-exclude=/lib/modules/*/kernel/drivers/gpu/*
path-exclude=/lib/modules/*/kernel/drivers/net/wireless/*
path-exclude=/lib/modules/*/kernel/drivers/net/ethernet/*
path-exclude=/lib/modules/*/kernel/drivers/media/*
path-exclude=/lib/modules/*/kernel/drivers/infiniband/*
path-exclude=/lib/modules/*/kernel/drivers/staging/*
path-exclude=/lib/modules/*/kernel/drivers/bluetooth/*
path-exclude=/lib/modules/*/kernel/drivers/iio/*
path-exclude=/lib/modules/*/kernel/drivers/hid/*
path-exclude=/lib/modules/*/kernel/drivers/usb/*
path-exclude=/lib/modules/*/kernel/drivers/input/*
path-exclude=/lib/modules/*/kernel/drivers/isdn/*
path-exclude=/lib/modules/*/kernel/drivers/mtd/*
path-exclude=/lib/modules/*/kernel/sound/*
path-exclude=/lib/modules/*/kernel/net/wireless/*
path-exclude=/lib/modules/*/kernel/net/mac80211/*
path-exclude=/lib/modules/*/kernel/net/bluetooth/*
path-exclude=/usr/lib/firmware/*
EOF

log "debootstrap $suite (minbase) into $root"
debootstrap --variant=minbase --cache-dir="$cache/debootstrap" \
    --include=systemd-sysv,udev,dbus,kmod,util-linux \
    "$suite" "$root" "$mirror" > "$out/debootstrap.log" 2>&1 ||
    { tail -n 30 "$out/debootstrap.log" >&2; die "debootstrap failed (log: $out/debootstrap.log)"; }

# apt in the chroot, with the cached .debs: hard links in and out (same file
# system), so no package is fetched twice.
cat > "$root/etc/apt/sources.list" <<EOF
deb $mirror $suite main
deb $mirror $suite-updates main
deb $security $suite-security main
EOF
printf '#!/bin/sh\nexit 101\n' > "$root/usr/sbin/policy-rc.d"
chmod 755 "$root/usr/sbin/policy-rc.d"
in_root() { chroot "$root" env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin DEBIAN_FRONTEND=noninteractive LC_ALL=C "$@"; }
cache_in() { find "$cache/apt" -name '*.deb' -exec ln -f {} "$root/var/cache/apt/archives/" \; ; }
cache_out() { find "$root/var/cache/apt/archives" -maxdepth 1 -name '*.deb' -exec ln -f {} "$cache/apt/" \; ; }
mount -t proc proc "$root/proc" && mounted="$root/proc"
log "apt-get update (in the image)"
in_root apt-get update -qq || die "apt-get update in the image failed"
cache_in
# Up to date with bookworm's point release and security updates, as a
# tenant's VM would be: the offline repository is resolved against it.
# A C toolchain is there too, as on most tenants' VMs that build anything
# (and it is most of the packages: unpacking them under TCG took 2-4 minutes
# of the test); install.sh brings dkms, the headers and the rest.
log "upgrading to $suite-updates and $suite-security, installing linux-image-$kver, gcc, make (in the image)"
{ in_root apt-get dist-upgrade -y -qq --no-install-recommends &&
  in_root apt-get install -y -qq --no-install-recommends "linux-image-$kver" gcc make libc6-dev; } > "$out/apt.log" 2>&1 ||
    { tail -n 30 "$out/apt.log" >&2; die "upgrading or installing linux-image-$kver failed (log: $out/apt.log)"; }
cache_out

# The offline repository: exactly what `apt-get install dkms
# linux-headers-$kver` (install.sh's command) would install in this image.
pkgs="dkms linux-headers-$kver"
list=$(in_root apt-get install -s -y --no-install-recommends $pkgs |
       sed -n 's/^Inst \([^ ]*\) \(\[[^]]*\] \)\{0,1\}(\([^ ]*\) .*\[\([^]]*\)\])$/\1 \3 \4/p')
[ -n "$list" ] || die "apt-get -s install $pkgs: no package to install?"
log "fetching $(echo "$list" | wc -l) packages for the offline repository ($pkgs and dependencies)"
in_root apt-get install -y -qq --download-only --no-install-recommends $pkgs > "$out/apt.log" 2>&1 ||
    { tail -n 30 "$out/apt.log" >&2; die "downloading $pkgs failed (log: $out/apt.log)"; }
cache_out
repo="$root/srv/pvgpu-debs"
mkdir -p "$repo"
while read -r p v a; do
    f="${p}_$(echo "$v" | sed 's/:/%3a/')_$a.deb"
    [ -f "$cache/apt/$f" ] || die "$f not fetched"
    cp "$cache/apt/$f" "$repo/"
done <<EOF
$list
EOF
(cd "$repo" && dpkg-scanpackages -m . > Packages 2>/dev/null) || die "dpkg-scanpackages failed"
[ "$(grep -c '^Package:' "$repo/Packages")" = "$(echo "$list" | wc -l)" ] ||
    die "the offline repository's index does not list every package"

# dpkg without an fsync per unpacked file, as in Debian's official container
# images (docker-apt-speedup): under TCG the fsyncs of linux-headers'
# 17,000 files took minutes.  The guest's disk is a throw-away overlay.
echo force-unsafe-io > "$root/etc/dpkg/dpkg.cfg.d/pvgpu-unsafe-io"

# The guest's apt knows only the offline repository (no network in the guest).
echo "deb [trusted=yes] file:/srv/pvgpu-debs ./" > "$root/etc/apt/sources.list"
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/archives/*.deb "$root"/var/cache/apt/*.bin
rm -f "$root/usr/sbin/policy-rc.d"

# A guest that boots to a root console without questions: fixed hostname,
# root file system by label, no first-boot prompts (machine-id set), root
# without password on the serial console.
echo pvgpu-guest > "$root/etc/hostname"
printf '127.0.0.1 localhost\n127.0.1.1 pvgpu-guest\n' > "$root/etc/hosts"
echo "LABEL=pvgpu-root / ext4 defaults,errors=remount-ro 0 1" > "$root/etc/fstab"
[ -s "$root/etc/machine-id" ] || in_root systemd-machine-id-setup >/dev/null
in_root passwd -d root >/dev/null

# The test's entry point: a disk labelled PVGPUTEST carries a boot.sh,
# run at every boot with its output on the second serial port.  Without that
# disk (a guest booted by hand) nothing happens.
mkdir -p "$root/usr/local/sbin"
cat > "$root/usr/local/sbin/pvgpu-test-hook" <<'EOF'
#!/bin/sh
# Runs boot.sh from the disk labelled PVGPUTEST (the vm-dkms test's), if any.
dev=$(blkid -L PVGPUTEST) || exit 0
mkdir -p /mnt/pvgpu-test
mount -o ro "$dev" /mnt/pvgpu-test || exit 1
exec sh /mnt/pvgpu-test/boot.sh > /dev/ttyS1 2>&1 < /dev/null
EOF
chmod 755 "$root/usr/local/sbin/pvgpu-test-hook"
cat > "$root/etc/systemd/system/pvgpu-test-hook.service" <<'EOF'
[Unit]
Description=pvgpu VM test hook (boot.sh of the disk labelled PVGPUTEST)
After=multi-user.target
[Service]
Type=oneshot
ExecStart=/usr/local/sbin/pvgpu-test-hook
[Install]
WantedBy=multi-user.target
EOF
in_root systemctl enable pvgpu-test-hook.service >/dev/null 2>&1 ||
    die "systemctl enable pvgpu-test-hook.service failed"

umount "$root/proc"
mounted=""
[ -s "$root/boot/vmlinuz-$kver" ] && [ -s "$root/boot/initrd.img-$kver" ] ||
    die "no /boot/vmlinuz-$kver and initrd.img-$kver in the image"
cp "$root/boot/vmlinuz-$kver" "$out/vmlinuz"
cp "$root/boot/initrd.img-$kver" "$out/initrd.img"
echo "$kver" > "$out/kernel"

# The disk: used size plus room for the guest's packages, the DKMS build and
# the journal.
used=$(du -sm "$root" | cut -f1)
size=$((used + 900))
log "making rootfs.img (${size} MiB; ${used} MiB used)"
rm -f "$out/rootfs.img.new"
mke2fs -q -t ext4 -L pvgpu-root -d "$root" "$out/rootfs.img.new" "${size}M" ||
    die "mke2fs -d failed"
mv "$out/rootfs.img.new" "$out/rootfs.img"
echo "$want" > "$out/stamp"
log "done in $(( $(date +%s) - t0 )) s: $out/rootfs.img ($kver, offline repository of $(echo "$list" | wc -l) packages)"
