#!/bin/sh
# Build pvgpu.ko out of tree for meson: copy the module sources and the ABI
# headers into a private kbuild directory (kbuild writes next to its
# sources), run kbuild against KDIR there, and copy the module to OUTPUT.
# usage: build-module.sh KDIR OUTPUT SRCDIR INCLUDEDIR
set -eu
kdir=$1 output=$2 srcdir=$3 incdir=$4
work=$(dirname "$output")/kbuild
mkdir -p "$work/include/pvgpu"
for f in pvgpu.c Kbuild; do
    cmp -s "$srcdir/$f" "$work/$f" || cp "$srcdir/$f" "$work/$f"
done
for f in abi.h protocol.h guest_ioctl.h regs.h; do
    cmp -s "$incdir/pvgpu/$f" "$work/include/pvgpu/$f" || cp "$incdir/pvgpu/$f" "$work/include/pvgpu/$f"
done
work=$(cd "$work" && pwd)
make -s -C "$kdir" M="$work" modules
cp "$work/pvgpu.ko" "$output"
