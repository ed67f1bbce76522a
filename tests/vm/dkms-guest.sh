#!/bin/sh
# The guest side of the vm-dkms test (tests/vm/dkms_test.py), run as root at
# every boot of the Debian 12 test image (tests/vm/setup-dkms-image.sh) by
# its pvgpu-test-hook, from the test's read-only disk (/mnt/pvgpu-test), with
# its output on the second serial port.  It reports facts as
# "pvgpu-dkms: key=value" lines and commands' output as "[tag] line", ending
# with "[tag] rc=N"; the host checks them.
#   boot 1: install the driver as a tenant would (the project tree copied to
#           /root/pvgpu, then ./guest-driver/install.sh: apt-get installs
#           dkms and the headers from the image's offline repository, DKMS
#           builds and installs pvgpu.ko), add user tenant to group pvgpu,
#           reboot;
#   boot 2: the module udev loaded at boot, DKMS's view, /dev/pvgpu,
#           pvgpu-load info and a bench as user tenant, then
#           ./guest-driver/install.sh --uninstall and what is left; power off.
set -u
T=/mnt/pvgpu-test
state=/var/lib/pvgpu-dkms-test
say() { echo "pvgpu-dkms: $*"; }
run() {
    tag=$1
    shift
    { "$@" 2>&1; echo "rc=$?"; } | sed -u "s/^/[$tag] /"
}
present() { if [ -e "$1" ]; then echo present; else echo absent; fi; }

mkdir -p "$state"
boot=$(( $(cat "$state/boots" 2>/dev/null || echo 0) + 1 ))
echo "$boot" > "$state/boots"
sync
say "boot=$boot"
say "kernel=$(uname -r)"

case $boot in
1)
    say "dkms_before=$(command -v dkms >/dev/null && echo present || echo absent)"
    say "headers_before=$(present "/lib/modules/$(uname -r)/build")"
    say "network_links=$(ls /sys/class/net | grep -vc '^lo$')"
    # The tenant's copy of the project tree and the guest tool.
    cp -a "$T/pvgpu" /root/pvgpu
    install -m 0755 "$T/bin/pvgpu-load" /usr/local/bin/pvgpu-load
    cd /root/pvgpu || exit 1
    run install ./guest-driver/install.sh
    run dkms dkms status -m pvgpu
    useradd --create-home --shell /bin/sh tenant && usermod -a -G pvgpu tenant
    say "tenant_groups=$(id -nG tenant 2>&1)"
    sync
    say "rebooting"
    systemctl reboot || say "reboot_failed=$?"
    ;;
2)
    # Coldplug is over (this runs after multi-user.target); udev loaded the
    # module by its PCI alias, as at any boot of a tenant's VM.
    udevadm settle --timeout=60
    say "loaded=$(if [ -d /sys/module/pvgpu ]; then echo yes; else echo no; fi)"
    say "module_path=$(modinfo -n pvgpu 2>&1)"
    say "srcversion_loaded=$(cat /sys/module/pvgpu/srcversion 2>&1)"
    say "srcversion_file=$(modinfo -F srcversion pvgpu 2>&1)"
    say "dev=$(stat -c '%F %A %G' /dev/pvgpu 2>&1)"
    run dkms dkms status -m pvgpu
    run info runuser -u tenant -- pvgpu-load info
    run bench runuser -u tenant -- pvgpu-load bench --kernel-us 500 --kernels 200
    run nogroup runuser -u nobody -- pvgpu-load info
    cd /root/pvgpu || exit 1
    run uninstall ./guest-driver/install.sh --uninstall
    say "after_loaded=$(if [ -d /sys/module/pvgpu ]; then echo yes; else echo no; fi)"
    say "after_modinfo=$(modinfo -n pvgpu >/dev/null 2>&1 && echo found || echo none)"
    say "after_files=$(find /lib/modules -name 'pvgpu.ko*' | tr '\n' ' ')"
    say "after_dkms_tree=$(present /var/lib/dkms/pvgpu)"
    say "after_src=$(ls -d /usr/src/pvgpu-* 2>/dev/null | tr '\n' ' ')"
    say "after_rules=$(present /etc/udev/rules.d/60-pvgpu.rules)"
    # (dkms 3.0.10 prints "echo: write error: Broken pipe" on stderr here.)
    say "after_dkms_status=$(dkms status -m pvgpu 2>/dev/null | tr '\n' ' ')"
    sync
    say "done"
    systemctl poweroff || say "poweroff_failed=$?"
    ;;
*)
    say "unexpected boot $boot"
    systemctl poweroff
    ;;
esac
