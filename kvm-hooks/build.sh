#!/bin/sh
# Build kvm.ko, kvm-amd.ko and kvm-intel.ko with the pvgpu patches, out of
# tree against the Debian headers of the kernel they are to load into, so
# that vermagic and the symbol versions (modversions) match it.
#
# Usage: kvm-hooks/build.sh [--kernel ABI] [OUT_DIR]   (default: build/kvm-hooks)
#   --kernel ABI  the Debian kernel ABI to build for, e.g. 6.1.0-57-amd64
#                 (default: $PVGPU_GUEST_KERNEL, else the test guests' kernel
#                 that tests/vm/setup-guest.sh recorded beside OUT_DIR, in
#                 OUT_DIR/../guest-kernel/version, else 6.1.0-56-amd64)
# Needs linux-headers-ABI and linux-source-6.1 of the Debian version that
# built them (any revision of the same upstream release is taken; the
# patches are for 6.1.192); as root it installs what is missing with apt.
# Idempotent: the source is unpacked and patched again only when the
# kernel, a patch or a copied source file changed, and make rebuilds only
# what changed.  The modules end up in OUT_DIR/src/arch/x86/kvm/*.ko,
# Debian's irqbypass.ko and ccp.ko of the same kernel (which they need in a
# test guest) in OUT_DIR/guest-modules.  See docs/kvm-hooks.md.
set -eu

here=$(cd "$(dirname "$0")" && pwd)
src_pkg=linux-source-6.1
tarball=/usr/src/linux-source-6.1.tar.xz

die() { echo "kvm-hooks/build.sh: $*" >&2; exit 1; }

krel=${PVGPU_GUEST_KERNEL:-}
while [ $# -gt 0 ]; do
	case $1 in
	-h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
	--kernel) [ $# -ge 2 ] || die "--kernel needs an ABI (e.g. 6.1.0-57-amd64)"; krel=$2; shift 2 ;;
	--kernel=*) krel=${1#--kernel=}; shift ;;
	--) shift; break ;;
	-*) die "unknown option $1 (see --help)" ;;
	*) break ;;
	esac
done
[ $# -le 1 ] || die "one OUT_DIR at most (see --help)"
out=${1:-$here/../build/kvm-hooks}
# setup-guest.sh records the test guests' kernel in BUILD/guest-kernel.
if [ -z "$krel" ] && [ -s "$(dirname "$out")/guest-kernel/version" ]; then
	krel=$(cat "$(dirname "$out")/guest-kernel/version")
fi
krel=${krel:-6.1.0-56-amd64}
case $krel in
*[!A-Za-z0-9.+_-]*|"") die "bad kernel ABI '$krel' (e.g. 6.1.0-57-amd64)" ;;
esac
hdr=/usr/src/linux-headers-$krel

installed_version() { dpkg-query -W -f='${Status} ${Version}' "$1" 2>/dev/null |
	sed -n 's/^install ok installed //p'; }

need_pkg() {  # PACKAGE VERSION
	v=$(installed_version "$1")
	[ "$v" = "$2" ] && return 0
	[ "$(id -u)" -eq 0 ] || die "$1 $2 is needed (have: ${v:-none}); run as root or: apt-get install $1=$2"
	echo "kvm-hooks/build.sh: installing $1=$2"
	DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -q \
		--no-install-recommends "$1=$2" || die "apt-get install $1=$2 failed"
}

# The Debian version that built this kernel's headers (6.1.192-3 for
# 6.1.0-57-amd64): the source must be of the same upstream release.
src_ver=$(installed_version "linux-headers-$krel")
if [ -z "$src_ver" ]; then
	src_ver=$(apt-cache show --no-all-versions "linux-headers-$krel" 2>/dev/null |
		sed -n 's/^Version: //p' | head -n1)
	[ -n "$src_ver" ] || die "no package linux-headers-$krel (a Debian 12 kernel ABI?" \
		"as root, apt-get update first)"
fi
need_pkg "linux-headers-$krel" "$src_ver"
# Any Debian revision of that release will do: the KVM sources take the
# same patches, and the modules load by symbol CRCs (modversions), not by
# the release string.  Asking for an older revision than the installed one
# would be a downgrade apt refuses.
case "$(installed_version "$src_pkg")" in
"${src_ver%-*}"-*) ;;
*) need_pkg "$src_pkg" "$src_ver" ;;
esac
have_src=$(installed_version "$src_pkg")
[ -f "$tarball" ] || die "$tarball missing although $src_pkg is installed"
# Tools of the build and its checks (a minimal Debian has neither xz nor modinfo).
missing=""
for tp in make:make gcc:gcc patch:patch xz:xz-utils modinfo:kmod; do
	command -v "${tp%%:*}" >/dev/null || missing="$missing ${tp#*:}"
done
if [ -n "$missing" ]; then
	[ "$(id -u)" -eq 0 ] || die "missing:$missing; run as root or: apt-get install$missing"
	echo "kvm-hooks/build.sh: installing$missing"
	# shellcheck disable=SC2086
	DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -q \
		--no-install-recommends $missing || die "apt-get install$missing failed"
fi

mkdir -p "$out"
out=$(cd "$out" && pwd)
tree=$out/src
kdir=$tree/arch/x86/kvm

# What decides the patched tree; a change re-creates it.  Bump tree_recipe
# when the unpack/patch steps below change.  The copied sources are not in
# it: they are refreshed below, and make rebuilds what depends on them.
tree_recipe=3
stamp=$( (echo "$have_src $krel $tree_recipe"; cat "$here"/patches/*.patch) | sha256sum | cut -d' ' -f1)
if [ "$(cat "$out/tree.stamp" 2>/dev/null)" != "$stamp" ]; then
	echo "kvm-hooks/build.sh: unpacking arch/x86/kvm and virt/kvm from $tarball"
	rm -rf "$tree" "$out/tree.stamp"
	mkdir -p "$tree"
	tar -C "$tree" --strip-components=1 -xJf "$tarball" \
		linux-source-6.1/arch/x86/kvm linux-source-6.1/virt/kvm \
		linux-source-6.1/include/uapi/linux/kvm.h ||
		die "unpacking $tarball failed"
	for p in "$here"/patches/*.patch; do
		patch -d "$tree" -p1 --forward --batch --quiet < "$p" ||
			die "patch $(basename "$p") does not apply to $src_pkg $have_src (made for 6.1.192)"
	done
	# Out of tree, $(srctree) is the headers directory: point the KVM
	# paths at the unpacked tree instead.  The patched uapi headers go
	# first on the include path, before the unpatched installed ones.
	sed -i -e 's|\$(srctree)/arch/x86/kvm|$(src)|' \
		-e 's|include \$(srctree)/virt/kvm/Makefile.kvm|include $(src)/../../../virt/kvm/Makefile.kvm|' \
		"$kdir/Makefile"
	printf '%s\n' '' '# kvm-hooks/build.sh: patched uapi before the installed one' \
		'LINUXINCLUDE := -I$(src)/../../../include/uapi $(LINUXINCLUDE)' >> "$kdir/Makefile"
	echo "$stamp" > "$out/tree.stamp"
fi
# One source for the state machine, the KVM glue and the uapi header: copied
# in, not patched in; only when changed, so that make rebuilds only then.
for f in core/pvgpu_wt.c core/pvgpu_wt.h kernel/pvgpu_wt_kvm.c kernel/pvgpu_wt_kvm.h \
	uapi/linux/kvm_pvgpu.h; do
	case $f in uapi/*) dst=$tree/include/$f ;; *) dst=$kdir/$(basename "$f") ;; esac
	cmp -s "$here/$f" "$dst" || cp "$here/$f" "$dst"
done

jobs=${JOBS:-2}
echo "kvm-hooks/build.sh: make -C $hdr M=$kdir -j$jobs modules"
make -C "$hdr" M="$kdir" -j"$jobs" modules > "$out/make.log" 2>&1 ||
	{ tail -40 "$out/make.log" >&2; die "module build failed (full log: $out/make.log)"; }

# The Debian kernel refuses modules whose vermagic or symbol CRCs differ.
want_magic="$krel SMP preempt mod_unload modversions "
layout_crc=$(awk '$2 == "module_layout" { print $1 }' "$hdr/Module.symvers")
for m in kvm kvm-amd kvm-intel; do
	ko=$kdir/$m.ko
	[ -f "$ko" ] || die "$ko was not built"
	magic=$(modinfo -F vermagic "$ko")
	[ "$magic" = "$want_magic" ] || die "$m.ko vermagic '$magic', kernel wants '$want_magic'"
	crc=$(modprobe --dump-modversions "$ko" | awk '$2 == "module_layout" { print $1 }')
	[ "$crc" = "$layout_crc" ] || die "$m.ko module_layout CRC $crc, kernel has $layout_crc"
done
# The patches change no KVM structure, so kvm.ko's exports keep Debian's
# CRCs and Debian modules that import them (kvmgt, vfio) still load.
awk '$3 == "arch/x86/kvm/kvm" { print $2, $1 }' "$hdr/Module.symvers" | sort > "$out/debian-kvm.crcs"
awk '$3 ~ /\/kvm$/ { print $2, $1 }' "$kdir/Module.symvers" | sort > "$out/kvm.crcs"
changed=$(comm -23 "$out/debian-kvm.crcs" "$out/kvm.crcs" | wc -l)
if [ "$changed" -eq 0 ]; then
	echo "kvm-hooks/build.sh: kvm.ko keeps the CRCs of Debian's $(wc -l < "$out/debian-kvm.crcs") exports" \
		"and adds $(comm -13 "$out/debian-kvm.crcs" "$out/kvm.crcs" | wc -l)"
else
	echo "kvm-hooks/build.sh: warning: $changed of Debian's kvm.ko exports are missing or changed:" \
		"Debian modules importing them will not load with this kvm.ko" >&2
fi

# A guest loading these needs irqbypass.ko (for kvm.ko) and ccp.ko (for
# kvm-amd.ko), unchanged from Debian: take them from linux-image-$krel.
deps=$out/guest-modules
if [ ! -f "$deps/irqbypass.ko" ] || [ ! -f "$deps/ccp.ko" ] ||
	[ "$(cat "$deps/version" 2>/dev/null)" != "$krel $src_ver" ]; then
	echo "kvm-hooks/build.sh: fetching irqbypass.ko and ccp.ko from linux-image-$krel"
	tmp=$(mktemp -d)
	trap 'rm -rf "$tmp"' EXIT
	(cd "$tmp" && apt-get download -qq "linux-image-$krel=$src_ver" 2>/dev/null) ||
		die "apt-get download linux-image-$krel=$src_ver failed (apt-get update?)"
	dpkg-deb --fsys-tarfile "$tmp"/linux-image-*.deb | tar -C "$tmp" -x \
		"./lib/modules/$krel/kernel/virt/lib/irqbypass.ko" \
		"./lib/modules/$krel/kernel/drivers/crypto/ccp/ccp.ko" ||
		die "linux-image-$krel lacks irqbypass.ko or ccp.ko"
	mkdir -p "$deps"
	cp "$tmp/lib/modules/$krel/kernel/virt/lib/irqbypass.ko" \
		"$tmp/lib/modules/$krel/kernel/drivers/crypto/ccp/ccp.ko" "$deps/"
	echo "$krel $src_ver" > "$deps/version"
fi
echo "kvm-hooks/build.sh: built $kdir/kvm.ko kvm-amd.ko kvm-intel.ko for $krel"
