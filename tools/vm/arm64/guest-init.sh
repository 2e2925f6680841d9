#!/bin/sh
# guest-init.sh - /init (PID 1) of the arm64 VM's initramfs, run by the root's
# static busybox.  tools/vm/arm64/run-arm64.sh builds the initramfs around it
# (modules.list and modules/ hold the modules it loads, in order) and boots it
# with the shares and ports it mounts:
#   9p "root"  the arm64 root (read-only), with a RAM overlay on top: what the
#              guest writes there is gone when it powers off
#   9p "ctl"   the run's control directory: config.sh, cmd.sh (the command),
#              rc (its exit status, written here)
#   9p "modules" (--kernel 16k) the kernel's modules, on /lib/modules/$KVER
#   /dev/vda   a fresh ext4 scratch disk, mounted on /tmp (O_DIRECT works there,
#              unlike on tmpfs or 9p)
#   /dev/nvme0n1 (with --nvme) an NVMe namespace of QEMU's NVMe controller
#   virtio-serial ports arm64.out / arm64.err: the command's stdout / stderr
# A template: run-arm64.sh writes it with the parts of its "#@ vm_init_..." lines
# in place (tools/vm/lib.sh's guest init core, shared with the NVMe VM's init).
export PATH=/bin:/sbin
mkdir -p /proc /sys /dev /ctl /lower /ovl /newroot
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
#@ vm_init_start arm64
mount -t 9p -o "$P9,cache=none" ctl /ctl || { log "cannot mount the ctl share"; halt_now; }
. /ctl/config.sh
mount -t 9p -o "$P9,ro,cache=loose" root /lower || { log "cannot mount the root share"; halt_now; }
mount -t tmpfs -o mode=755 tmpfs /ovl
mkdir -p /ovl/upper /ovl/work
mount -t overlay overlay -o lowerdir=/lower,upperdir=/ovl/upper,workdir=/ovl/work /newroot ||
    { log "overlayfs failed"; halt_now; }
#@ vm_init_newroot
mount -t tmpfs -o mode=1777 tmpfs $R/var/tmp
# cgroup v2, with the memory controller enabled for child cgroups (the budget and the cgroup tests)
mount -t cgroup2 cgroup2 $R/sys/fs/cgroup 2>/dev/null &&
    echo "+memory +pids +io" > $R/sys/fs/cgroup/cgroup.subtree_control 2>/dev/null
n=0
while [ ! -b /dev/vda ] && [ $n -lt 300 ]; do sleep 0.1; n=$((n+1)); done
mount -t ext4 -o noatime /dev/vda $R/tmp ||
    { log "cannot mount the scratch disk on /tmp: $(ls -l /dev/vda $R/tmp 2>&1; grep ext4 /proc/filesystems)"; halt_now; }
chmod 1777 $R/tmp
mkdir -p $R/run/arm64
mount --bind /ctl $R/run/arm64
# a kernel not the root's (--kernel 16k): its modules come over 9p
if [ "$MODSHARE" = 1 ]; then
    mkdir -p "$R/usr/lib/modules/$KVER"
    mount -t 9p -o "$P9,ro,cache=loose" modules "$R/usr/lib/modules/$KVER" || log "cannot mount the modules share"
fi
# the loop driver (loop-device tests) and, with --nvme, the NVMe driver, from the root's /lib/modules
chroot $R /sbin/modprobe loop 2>/dev/null || log "modprobe loop failed"
if [ "$NVME" = 1 ]; then
    chroot $R /sbin/modprobe nvme 2>/dev/null || log "modprobe nvme failed"
    n=0
    while { [ ! -b /dev/nvme0n1 ] || [ ! -c /dev/ng0n1 ]; } && [ $n -lt 300 ]; do sleep 0.1; n=$((n+1)); done
    [ -b /dev/nvme0n1 ] || log "no /dev/nvme0n1"
fi
#@ vm_init_ports arm64
#@ vm_init_run arm64vm /run/arm64
