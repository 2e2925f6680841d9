#!/bin/bash
# shellcheck disable=SC2054  # the commas are QEMU's, inside option values
# run-arm64.sh - build bladed and run commands on aarch64 (arm64) under
# emulation, on an x86-64 Debian 12 host.  docs/arm64.md says what it
# exercises, what it cannot, and the times measured.
#
# usage: tools/vm/arm64/run-arm64.sh --setup       make (or find) the cached arm64 root, then exit
#        tools/vm/arm64/run-arm64.sh [options] -- CMD [ARGS...]
#        tools/vm/arm64/run-arm64.sh [options] --suites [-- PYTEST-ARGS...]
#   --setup        also make the root first if needed (with CMD; alone: only that)
#   --user         run CMD in a chroot of the root under qemu-user (the host's
#                  kernel; io_uring_setup fails there with ENOSYS) instead of
#                  in the VM
#   --kernel K     (VM) the guest kernel: default (the root's: Debian 12's
#                  linux-image-arm64, 6.1, 4 KiB pages) or 16k (Debian 13's
#                  linux-image-arm64-16k, 6.12, 16 KiB pages: fetched once with a
#                  private apt configuration, cached beside the root)
#   --nvme SIZE    (VM) add QEMU's NVMe controller with one namespace of SIZE
#                  (as for truncate(1), 4096-byte LBAs): /dev/nvme0n1, /dev/ng0n1
#   --mem MiB      (VM) guest memory (3072)
#   --smp N        (VM) guest vCPUs (the host's CPU count, at most 4)
#   --timeout SEC  (VM) power the guest off after SEC seconds (3000; with
#                  --suites 10800: a run of 50 min was cut by the 3000)
#   --keep         (VM) keep the run's directory (console log, scratch disk)
#   --verbose      (VM) show the guest's console on stderr
#   --print-root   print the cached root's path and exit
#   --suites       CMD is pytest on the suites that need no torch (SUITES
#                  below, docs/arm64.md); ARGS after -- go to pytest
#
# The arm64 root: Debian 12 made by debootstrap --arch arm64 (first stage on
# the host, second stage in a chroot under qemu-user through binfmt_misc),
# with the Debian packages of ROOT_PKGS below (python3, python3-venv,
# python3-dev, gcc, liburing-dev, pkg-config, ...), Debian's arm64 kernel
# (linux-image-arm64 unpacked into /boot and /lib/modules, not installed) and
# a virtual environment /opt/bladed-venv with pyproject.toml's base
# dependencies and its "test" extra (no torch, no transformers).  It lives in
#   ${BLADED_ARM64_HOME:-${XDG_CACHE_HOME:-$HOME/.cache}/bladed-arm64}/root-<signature>
# where the signature covers all it installs (suite, mirror, packages, pip
# requirements as read from the checkout); when one changes, --setup builds
# a new root and removes the old one.  --setup also installs the host
# packages it needs (qemu-user-static, binfmt-support, debootstrap,
# qemu-system-arm, e2fsprogs, kmod, xz-utils), mounts binfmt_misc and enables
# the qemu-aarch64 handler.
#
# Every run first brings the root's copy of the checkout up to date, in a
# chroot under qemu-user, in a private mount namespace (nothing stays mounted):
# the checkout (the one this script is in) is bind-mounted read-only at /src
# and copied (rsync) to /build/bladed, where bladed is installed editable
# into /opt/bladed-venv; the C shim is compiled there for aarch64 when
# cffi_build/, setup.py or pyproject.toml changed.  The host's x86-64
# extensions (bladed/_*.so) and .venv are never touched.  Then CMD runs:
#   * by default in a VM: qemu-system-aarch64 (TCG) boots the root's Debian
#     arm64 kernel with the root over virtio-9p (read-only, a RAM overlay on
#     top: what CMD writes in the root is gone afterwards) and a fresh ext4
#     scratch disk on /tmp; a real arm64 kernel: real io_uring, real syscall
#     ABI, its own loop devices and cgroup v2.  CMD's stdout and stderr come
#     back over virtio-serial.
#   * with --user, in the chroot, with the host's /proc, /sys, /dev and /tmp
#     (loop devices, cgroups and Unix sockets under /tmp are the host's).
# CMD runs as root with /opt/bladed-venv/bin first on PATH and the caller's
# environment otherwise (less PYTHONPATH, PYTHONHOME, VIRTUAL_ENV), in
# /build/bladed, or in the same directory of the copy when called from inside
# the checkout; with --user, in the caller's directory when that is under /tmp.
# With --user every step execs the next: CMD has this script's pid.
#
# Exit status: CMD's; 2 on a usage error; 1 if the setup or the build failed;
# (VM) 124 on timeout, 125 if the VM ended without CMD's exit status.
# Needs root (chroot, mounts, binfmt_misc); uses sudo when not root.
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../../.." && pwd)  # the checkout this script belongs to
# shellcheck source=tools/vm/lib.sh
. "$HERE/../lib.sh"
SUITE=bookworm
MIRROR=${BLADED_ARM64_MIRROR:-http://deb.debian.org/debian}
if [ -z "${BLADED_ARM64_HOME:-}" ]; then
    # CI may run as root without $HOME: ask passwd
    HOME_DIR=${HOME:-$(getent passwd "$(id -u)" | cut -d: -f6)}
    BLADED_ARM64_HOME=${XDG_CACHE_HOME:-${HOME_DIR:-/root}/.cache}/bladed-arm64
fi
CACHE=$BLADED_ARM64_HOME
VENV=/opt/bladed-venv
COPY=/build/bladed
# bump when the way the root is made changes (its contents are covered by the lists below)
LAYOUT=2
HOST_PKGS=(qemu-user-static binfmt-support debootstrap qemu-system-arm e2fsprogs kmod xz-utils)
# the build (gcc, libc6-dev, python3-dev, liburing-dev, pkg-config), the venv, the copy (rsync), the
# loop-device tests (mount: losetup), the VM (kmod: modprobe; busybox-static: the initramfs), pip's TLS
ROOT_PKGS=(python3 python3-venv python3-dev gcc libc6-dev liburing-dev liburing2 pkg-config rsync
           ca-certificates mount util-linux e2fsprogs kmod procps iproute2 busybox-static)
KERNEL_META=linux-image-arm64
# --kernel 16k: Debian 13's kernel of 16 KiB pages (Debian ships none of 64 KiB)
KERNEL_16K=(trixie linux-image-arm64-16k)
# what the initramfs loads before it can mount the root (the rest comes from the root's /lib/modules)
GUEST_MODULES="virtio_pci virtio_blk virtio_console 9pnet_virtio 9p overlay crc32c_generic ext4"
# (crc32c_generic: ext4's metadata checksums; without it the mount fails with ENOENT)

# --suites: the test modules that need no torch (nor a Redis server, an x86 VM, systemd or the host's DAMON),
# by area; docs/arm64.md lists what is left out and why, and the counts measured
SUITES=(
    # engine
    tests/test_engine.py tests/test_engines.py tests/test_features.py tests/test_chunking.py
    tests/test_read_window.py
    # backends
    tests/test_extent_store.py tests/test_pagecache.py tests/test_discovery.py
    # extents, plan, budget
    tests/test_extents.py tests/test_planner.py tests/test_budget.py
    # protocol, configuration
    tests/test_protocol.py tests/test_fuzz_protocol.py tests/test_config.py tests/test_fuzz_config.py
    # daemon, bladectl
    tests/test_daemon.py tests/test_daemon_startup.py tests/test_daemon_access.py tests/test_daemon_metrics.py
    tests/test_datapath.py tests/test_lane.py tests/test_logs.py tests/test_bladectl.py
    # client (less its two torch tests), prefix store
    tests/test_client.py tests/test_prefix.py
    # the KV formats' C codec (q8 / q4 rows against a numpy reference; its arm64 build of the loops)
    tests/test_kvformat_codec_numpy.py
    # reliability
    tests/test_faults.py tests/test_integrity.py tests/test_isolation.py tests/test_soak.py
    tests/test_stateful_daemon.py tests/test_replan_live.py tests/test_demotion_isolation.py
    --deselect tests/test_client.py::test_one_dtype_table_for_names_and_torch_dtypes
    --deselect tests/test_client.py::test_torch_tensors_over_the_shared_slot_on_cpu
    # what the emulated machine is not: its root is 9p (no root block device), it has no systemd
    --deselect tests/test_bladectl.py::test_the_mounted_root_disk_is_in_use
    --deselect tests/test_bladectl.py::test_ns_setup_prints_the_shipped_device_dropin_for_its_device
)
# Debian 12's arm64 kernel (6.1) has no cachestat(2), which these assert the build machine has (6.5+)
SUITES_NO_CACHESTAT=(
    --deselect tests/test_pagecache.py::test_cachestat_agrees_with_mincore
    --deselect tests/test_pagecache.py::test_drop_evicts_dirty_and_mapped_pages
)
# the long reliability runs, shortened for emulation (their CI defaults: 1000 kills, 100,000 cases)
SUITES_ENV=(BLADED_FAULT_KILLS=200 BLADED_FUZZ_CASES=20000)

say() { echo "run-arm64: [$SECONDS s] $*" >&2; }
die() { echo "run-arm64: $*" >&2; exit 1; }
VM_SAY=say
usage() { sed -n '/^# usage:/,/^#                  below, docs/p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }

if [ "$(id -u)" != 0 ]; then
    command -v sudo >/dev/null || die "needs root (chroot, mounts, binfmt_misc), and sudo is not installed"
    exec sudo --preserve-env "$0" "$@"
fi

SETUP=0 PRINT=0 SUITES_MODE=0 USER_MODE=0 KSEL=default NVME='' MEM=3072 TIMEOUT='' KEEP=0 VERBOSE=0
SMP=$(nproc); [ "$SMP" -le 4 ] || SMP=4
while [ $# -gt 0 ]; do
    case $1 in
        --setup) SETUP=1; shift ;;
        --print-root) PRINT=1; shift ;;
        --user) USER_MODE=1; shift ;;
        --suites) SUITES_MODE=1; shift ;;
        --nvme) NVME=${2:?--nvme needs a size}; shift 2 ;;
        --kernel) KSEL=${2:?--kernel needs default or 16k}; shift 2 ;;
        --mem) MEM=${2:?--mem needs MiB}; shift 2 ;;
        --smp) SMP=${2:?--smp needs a count}; shift 2 ;;
        --timeout) TIMEOUT=${2:?--timeout needs seconds}; shift 2 ;;
        --keep) KEEP=1; shift ;;
        --verbose|-v) VERBOSE=1; shift ;;
        --) shift; break ;;
        -h|--help) usage ;;
        *) echo "run-arm64: unknown option '$1' (did you forget '--' before the command?)" >&2; usage ;;
    esac
done
# the VM's power-off: 3000 s, or for --suites (87 min measured, loaded) 3 hours
[ -n "$TIMEOUT" ] || { [ $SUITES_MODE = 1 ] && TIMEOUT=10800 || TIMEOUT=3000; }
if [ $SUITES_MODE = 1 ]; then
    # --timeout: emulated, a test runs 5-10x longer than the suite's 600 s per test allow for natively
    extra=(); [ "$KSEL" != default ] || [ $USER_MODE = 1 ] || extra=("${SUITES_NO_CACHESTAT[@]}")
    set -- env "${SUITES_ENV[@]}" python -m pytest -p no:cacheprovider --timeout=3000 "${SUITES[@]}" \
        ${extra[@]+"${extra[@]}"} "$@"
fi
[ $# -gt 0 ] || [ $SETUP = 1 ] || [ $PRINT = 1 ] || usage
case $KSEL in default|16k) ;; *) echo "run-arm64: --kernel must be default or 16k (got '$KSEL')" >&2; exit 2 ;; esac
[ -f "$REPO/pyproject.toml" ] && [ -d "$REPO/cffi_build" ] || die "not in a bladed checkout (no pyproject.toml/cffi_build in $REPO)"

# -- the pip requirements and the signature -------------------------------------------------------------
pip_requirements() {
    # pyproject.toml's base dependencies and its test extra; no torch, no transformers
    python3 - "$REPO/pyproject.toml" <<'EOF'
import sys, tomllib
with open(sys.argv[1], "rb") as f:
    project = tomllib.load(f)["project"]
reqs = project["dependencies"] + project["optional-dependencies"]["test"]
print("\n".join(r for r in reqs if not r.lower().startswith(("torch", "transformers"))))
EOF
}
PIP_REQS=$(pip_requirements)
# setuptools, wheel: the extension's build requirements, there so that the build needs no network
PIP_REQS+=$'\nsetuptools>=64\nwheel'
SIG=$(printf '%s\n' "layout=$LAYOUT" "$SUITE" "$MIRROR" "${ROOT_PKGS[*]}" "$KERNEL_META" "$PIP_REQS" |
      sha256sum | cut -c1-16)
ROOTFS=$CACHE/root-$SIG

if [ $PRINT = 1 ] && [ $SETUP = 0 ]; then
    [ -f "$ROOTFS/.bladed-ready" ] || die "no root for signature $SIG yet: run $0 --setup"
    echo "$ROOTFS"
    exit 0
fi

# -- host side: packages, binfmt_misc -------------------------------------------------------------------
host_packages() {
    local missing=() p
    for p in "${HOST_PKGS[@]}"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
    done
    if [ ${#missing[@]} -gt 0 ]; then
        say "installing host packages: ${missing[*]}"
        vm_apt_install "${missing[@]}"
    fi
}

binfmt() {
    local bm=/proc/sys/fs/binfmt_misc
    if [ ! -e $bm/status ]; then
        mount -t binfmt_misc binfmt_misc $bm || die "cannot mount binfmt_misc on $bm (a container without it?)"
    fi
    if [ ! -e $bm/qemu-aarch64 ]; then
        update-binfmts --enable qemu-aarch64 >&2 || die "update-binfmts --enable qemu-aarch64 failed"
    fi
    grep -qx enabled $bm/qemu-aarch64 || echo 1 > $bm/qemu-aarch64
    grep -qx enabled $bm/qemu-aarch64 || die "the qemu-aarch64 binfmt handler is not enabled"
}

# the interpreter that binfmt_misc names, inside the root too: needed when the handler lacks the F flag
# (with F the kernel opened it at registration and a chroot needs nothing)
install_interpreter() {
    local root=$1 interp
    interp=$(sed -n 's/^interpreter //p' /proc/sys/fs/binfmt_misc/qemu-aarch64)
    mkdir -p "$root$(dirname "$interp")" "$root/usr/bin"
    cp -f /usr/bin/qemu-aarch64-static "$root/usr/bin/qemu-aarch64-static"
    [ "$interp" = /usr/bin/qemu-aarch64-static ] || cp -f /usr/bin/qemu-aarch64-static "$root$interp"
}

# in a private mount namespace: mount what the root needs, then run "$@" chrooted (every step execs;
# with IN_ROOT_EXEC=exec, this shell too)
IN_ROOT_EXEC=
in_root() {
    local root=$1
    shift
    $IN_ROOT_EXEC unshare --mount --propagation private -- /bin/bash -c '
        set -e
        root=$1 repo=$2; shift 2
        mount -t proc proc "$root/proc"
        mount --rbind /sys "$root/sys"
        mount --rbind /dev "$root/dev"
        mount --bind /tmp "$root/tmp"
        mkdir -p "$root/src"
        mount --bind "$repo" "$root/src"
        mount -o remount,bind,ro "$root/src"
        exec chroot "$root" "$@"' in-root "$root" "$REPO" "$@"
}

build_root() {
    local tmp=$CACHE/root-$SIG.tmp include kpkg kver
    rm -rf "$tmp"
    mkdir -p "$tmp"
    include=$(IFS=,; echo "${ROOT_PKGS[*]}")
    say "debootstrap --arch arm64 $SUITE, first stage, into $tmp"
    debootstrap --arch=arm64 --foreign --variant=minbase --include="$include" "$SUITE" "$tmp" "$MIRROR" >&2
    install_interpreter "$tmp"
    # no fsync per unpacked file: the root is rebuilt from nothing if this fails midway
    mkdir -p "$tmp/etc/dpkg/dpkg.cfg.d"
    echo force-unsafe-io > "$tmp/etc/dpkg/dpkg.cfg.d/bladed-unsafe-io"
    say "debootstrap second stage (emulated)"
    unshare --mount --propagation private -- chroot "$tmp" /debootstrap/debootstrap --second-stage >&2
    # the root reaches the network through the host's: its resolver, and its CA bundle (which holds any CA
    # of a TLS-inspecting proxy the host trusts; on a plain host it is Debian's bundle, as in the root)
    cp -L /etc/resolv.conf "$tmp/etc/resolv.conf"
    cp -L /etc/ssl/certs/ca-certificates.crt "$tmp/etc/ssl/certs/ca-certificates.crt"
    say "Debian's arm64 kernel ($KERNEL_META), unpacked into the root"
    in_root "$tmp" /bin/sh -c "apt-get update -q >/dev/null" >&2
    kpkg=$(in_root "$tmp" apt-cache depends "$KERNEL_META" | vm_kernel_of)
    [ -n "$kpkg" ] || die "cannot resolve $KERNEL_META to a kernel package"
    mkdir -p "$tmp/opt/kernel-deb"
    in_root "$tmp" /bin/sh -c "cd /opt/kernel-deb && apt-get download -q $kpkg" >&2
    # unpacked beside the root, then copied in: extracting into the root would replace its /lib symlink
    # (merged /usr) with a directory
    dpkg-deb -x "$tmp"/opt/kernel-deb/*.deb "$tmp/opt/kernel-deb/x"
    mkdir -p "$tmp/boot" "$tmp/usr/lib/modules"
    cp -a "$tmp"/opt/kernel-deb/x/boot/. "$tmp/boot/"
    local m
    for m in lib/modules usr/lib/modules; do  # Debian 12's kernels ship lib/modules, later ones usr/lib/modules
        [ ! -d "$tmp/opt/kernel-deb/x/$m" ] || cp -a "$tmp/opt/kernel-deb/x/$m/." "$tmp/usr/lib/modules/"
    done
    rm -rf "$tmp/opt/kernel-deb"
    kver=$(basename "$(ls -d "$tmp"/usr/lib/modules/* | head -n1)")
    in_root "$tmp" /sbin/depmod "$kver" >&2
    say "python venv $VENV and pip packages (emulated): $(echo "$PIP_REQS" | tr '\n' ' ')"
    printf '%s\n' "$PIP_REQS" > "$tmp/opt/bladed-requirements.txt"
    # PIP_FIND_LINKS would name host directories, not there in the root
    in_root "$tmp" /usr/bin/env -u PIP_FIND_LINKS PIP_CERT=/etc/ssl/certs/ca-certificates.crt /bin/sh -c \
        "python3 -m venv $VENV && $VENV/bin/pip install -q --no-cache-dir --disable-pip-version-check -r /opt/bladed-requirements.txt" >&2
    mkdir -p "$tmp$COPY"
    # apt's lists and debs are not needed again
    rm -rf "$tmp"/var/cache/apt/archives/*.deb "$tmp"/var/lib/apt/lists/*
    echo "$SIG" > "$tmp/.bladed-ready"
    mv "$tmp" "$ROOTFS"
}

# a kernel of another Debian release, beside the root: read through a private apt configuration (its own
# sources, lists and archive cache; the host's sources.list never names it), unpacked into $CACHE/kernel-NAME
foreign_kernel() {  # foreign_kernel NAME SUITE META: sets KDIR
    local name=$1 suite=$2 meta=$3 d pkg
    KDIR=$CACHE/kernel-$name
    [ -f "$KDIR/.ready" ] && return 0
    say "fetching $meta from Debian $suite (private apt configuration) into $KDIR"
    d=$CACHE/apt-$suite
    rm -rf "$d" "$KDIR.tmp"
    mkdir -p "$KDIR.tmp"
    vm_private_apt "$d" arm64 "$MIRROR $suite"
    local fapt=("${VM_APT[@]}" -o APT::Sandbox::User=root)
    apt-get "${fapt[@]}" update -q >&2 || die "apt-get update of $suite failed"
    pkg=$(apt-cache "${fapt[@]}" depends "$meta" | vm_kernel_of)
    [ -n "$pkg" ] || die "cannot resolve $meta in $suite"
    (cd "$d" && apt-get "${fapt[@]}" download -q "$pkg" >&2) || die "apt-get download $pkg failed"
    dpkg-deb -x "$d"/*.deb "$KDIR.tmp"
    # Debian 13 ships the modules in /usr/lib/modules: here in lib/modules either way (depmod -b looks there)
    [ -d "$KDIR.tmp/lib/modules" ] || { mkdir -p "$KDIR.tmp/lib" && mv "$KDIR.tmp/usr/lib/modules" "$KDIR.tmp/lib/"; }
    local kver
    kver=$(basename "$(ls -d "$KDIR.tmp"/lib/modules/* | head -n1)")
    depmod -b "$KDIR.tmp" "$kver"
    rm -rf "$d" "$KDIR"
    touch "$KDIR.tmp/.ready"
    mv "$KDIR.tmp" "$KDIR"
}

# the VM's kernel, its modules and the initramfs (rebuilt, from the root, when the guest init (guest-init.sh
# with lib.sh's parts in place) or the module list changes); MODSHARE: the kernel's module directory when it is not the root's (shared with the guest)
KVER='' KERNEL='' INITRD='' MODSHARE=''
vm_boot_files() {
    local moddir sig d m init
    if [ "$KSEL" = 16k ]; then
        foreign_kernel 16k "${KERNEL_16K[@]}"
        moddir=$(ls -d "$KDIR"/lib/modules/* | head -n1)
        MODSHARE=$moddir
        KERNEL=$KDIR/boot/vmlinuz-$(basename "$moddir")
    else
        moddir=$(ls -d "$ROOTFS"/usr/lib/modules/* | head -n1)
        KERNEL=$ROOTFS/boot/vmlinuz-$(basename "$moddir")
    fi
    KVER=$(basename "$moddir")
    [ -f "$KERNEL" ] || die "no kernel $KERNEL"
    init=$(vm_init_expand < "$HERE/guest-init.sh")
    sig=$(printf '%s\n' "$init" | cat - <(echo "$GUEST_MODULES $KVER") | sha256sum | cut -c1-12)
    INITRD=$CACHE/initramfs-$SIG-$KVER-$sig.cpio
    [ -s "$INITRD" ] && return 0
    say "building the initramfs $INITRD"
    d=$ROOTFS/opt/initramfs.tmp
    rm -rf "$d"
    mkdir -p "$d/bin" "$d/modules"
    cp "$ROOTFS/bin/busybox" "$d/bin/busybox"
    ln -s busybox "$d/bin/sh"
    # shellcheck disable=SC2046  # the modules' paths, one word each
    vm_initramfs_modules "$moddir" "$d" "xz -dc" "" $(vm_resolve_modules "$moddir" "$GUEST_MODULES")
    printf '%s\n' "$init" > "$d/init"
    chmod 755 "$d/init"
    # busybox's applets as links, and the archive, made by the root's busybox (emulated)
    in_root "$ROOTFS" /bin/sh -c 'cd /opt/initramfs.tmp &&
        for a in $(/bin/busybox --list); do [ -e bin/$a ] || ln -s busybox bin/$a; done &&
        find . | LC_ALL=C sort | /bin/busybox cpio -o -H newc 2>/dev/null' > "$INITRD.tmp"
    rm -rf "$d"
    mv "$INITRD.tmp" "$INITRD"
    for m in "$CACHE"/initramfs-*.cpio; do
        [ "$m" != "$INITRD" ] || continue
        case $m in
            "$CACHE/initramfs-$SIG-$KVER-"*) rm -f "$m" ;;  # an older one of this kernel
            "$CACHE/initramfs-$SIG-"*) ;;                   # another kernel's
            *) rm -f "$m" ;;                                # another root's
        esac
    done
}

setup() {
    host_packages
    binfmt
    mkdir -p "$CACHE"
    # one setup at a time (a second waits, then finds the root made)
    exec 9>"$CACHE/lock"
    flock 9
    if [ ! -f "$ROOTFS/.bladed-ready" ]; then
        local t0=$SECONDS old
        build_root
        say "root $ROOTFS made in $((SECONDS - t0)) s"
        for old in "$CACHE"/root-*; do
            [ "$old" = "$ROOTFS" ] || { say "removing the outdated $old"; rm -rf "$old"; }
        done
    fi
    install_interpreter "$ROOTFS"  # the host's qemu may have been upgraded since
    vm_boot_files
    flock -u 9
    exec 9>&-
}

if [ $SETUP = 1 ]; then
    setup
    [ $PRINT = 1 ] && echo "$ROOTFS"
    [ $# -gt 0 ] || exit 0
else
    [ -f "$ROOTFS/.bladed-ready" ] || die "no arm64 root for signature $SIG in $CACHE: run $0 --setup first"
    binfmt
fi

# -- the copy: synced and built in the chroot -----------------------------------------------------------
case $PWD/ in
    "$REPO"/*) WORKDIR=$COPY${PWD#"$REPO"} ;;
    /tmp/*) if [ $USER_MODE = 1 ]; then WORKDIR=$PWD; else WORKDIR=$COPY; fi ;;
    *) WORKDIR=$COPY ;;
esac
unset PYTHONPATH PYTHONHOME VIRTUAL_ENV
export PATH=$VENV/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
# shellcheck disable=SC2016  # expanded in the chroot
SYNC='
    set -e
    copy=$1 venv=$2
    {
        flock 8
        # the checkout, less what is built or local to the host (its x86-64 extension, .venv, var/, caches);
        # the caches are perishable ("-p"): a folder the checkout no longer has goes with its __pycache__
        # (a kept cache made rsync print "cannot delete non-empty directory" and leave the folder). Its
        # messages go to stderr: stdout belongs to the command run
        rsync -a --delete --exclude=/.git --exclude=/.venv --exclude=/var --exclude="*.so" \
            --exclude="/bladed/_*.c" --exclude=/build --exclude="/.arm64-*" \
            --filter="-p __pycache__/" --filter="-p *.egg-info/" --filter="-p .pytest_cache/" \
            --filter="-p .mypy_cache/" --filter="-p .ruff_cache/" --filter="-p .hypothesis/" \
            /src/ "$copy/" >&2
        sig=$(cat "$copy"/pyproject.toml "$copy"/setup.py "$copy"/cffi_build/* | sha256sum | cut -c1-16)
        if [ "$(cat "$copy/.arm64-built" 2>/dev/null)" != "$sig" ] ||
                ! (cd "$copy" && "$venv/bin/python" -c "import bladed._uring, bladed.protocol" 2>/dev/null); then
            echo "run-arm64: building bladed (aarch64) in $copy" >&2
            # the extensions and the C files cffi generates for them (bladed/_uring.c, ...)
            rm -f "$copy"/bladed/_*.so "$copy"/bladed/_*.c "$copy/.arm64-built"
            (cd "$copy" && "$venv/bin/pip" install -q --no-deps --no-build-isolation --no-cache-dir \
                --disable-pip-version-check -e . >&2)
            echo "$sig" > "$copy/.arm64-built"
        fi
        # byte-compiled once here: the VM sees the root read-only (its writes go to a RAM overlay)
        "$venv/bin/python" -m compileall -q -j 0 "$copy/bladed" "$copy/tests" "$copy/bench" "$copy/tools" >/dev/null || true
    } 8>"$copy/.arm64-lock"'

if [ $USER_MODE = 1 ]; then
    export BLADED_ARM64=user
    exec 9>&-  # no lock fd leaks into CMD
    IN_ROOT_EXEC="exec" in_root "$ROOTFS" /bin/bash -c "$SYNC"'
        workdir=$3; shift 3
        mkdir -p "$workdir" 2>/dev/null || true
        cd "$workdir"
        exec "$@"' run-arm64 "$COPY" "$VENV" "$WORKDIR" "$@"
fi

in_root "$ROOTFS" /bin/bash -c "$SYNC" run-arm64 "$COPY" "$VENV" || die "syncing or building the copy failed"
exec 9>"$CACHE/lock"
flock 9
vm_boot_files
flock -u 9
exec 9>&-

# -- the VM ----------------------------------------------------------------------------------------------
T0=$SECONDS
vm_run_dir "$CACHE/runs"
trap vm_cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# /tmp of the guest: a fresh sparse ext4 disk
truncate -s 16G "$RUN/scratch.img"
mkfs.ext4 -q -F -E nodiscard -O ^has_journal "$RUN/scratch.img"
QEMU_NVME=()
if [ -n "$NVME" ]; then
    truncate -s "$NVME" "$RUN/nvme.img"
    QEMU_NVME=(-drive "file=$(qe "$RUN/nvme.img"),if=none,id=nvm1,format=raw,discard=unmap"
               -device nvme,id=nvme0,serial=arm64nvme0
               -device nvme-ns,drive=nvm1,bus=nvme0,nsid=1,logical_block_size=4096,physical_block_size=4096)
fi
{
    echo "NVME=$([ -n "$NVME" ] && echo 1 || echo 0)"
    echo "KVER=$KVER"
    echo "MODSHARE=$([ -n "$MODSHARE" ] && echo 1 || echo 0)"
} > "$CTL/config.sh"
QEMU_MODS=()
[ -z "$MODSHARE" ] || QEMU_MODS=(-fsdev "local,id=fsmods,path=$(qe "$MODSHARE"),security_model=none,readonly=on"
                                 -device virtio-9p-pci,fsdev=fsmods,mount_tag=modules)
{
    echo '#!/bin/bash'
    # the caller's environment, less what is the host's alone
    export -p | grep -vE '^declare -x (PWD|OLDPWD|SHLVL|_|TMPDIR|HOME|SSH_[A-Z_]*|DISPLAY|XAUTHORITY|DBUS_SESSION_BUS_ADDRESS|XDG_RUNTIME_DIR|TERM)(=|$)' || true
    echo 'export HOME=/root TERM=dumb BLADED_ARM64=vm'
    echo "cd $(printf %q "$WORKDIR") 2>/dev/null || cd $COPY || exit 125"
    printf 'set --'; printf ' %q' "$@"; echo
    echo 'exec "$@"'
} > "$CTL/cmd.sh"

vm_serial_start

# pauth-impdef: the cheap pointer-authentication algorithm (QARMA costs much under TCG; the kernel uses it)
QEMU=(qemu-system-aarch64 -name bladed-arm64 -machine virt -cpu max,pauth-impdef=on -accel tcg,thread=multi
      -smp "$SMP" -m "$MEM" -nodefaults -no-user-config -display none -no-reboot -monitor none
      -serial "file:$CONSOLE"
      -kernel "$KERNEL" -initrd "$INITRD" -append "console=ttyAMA0 quiet loglevel=3 panic=-1 rdinit=/init"
      -fsdev "local,id=fsroot,path=$(qe "$ROOTFS"),security_model=none,readonly=on,multidevs=remap"
      -device virtio-9p-pci,fsdev=fsroot,mount_tag=root
      -fsdev "local,id=fsctl,path=$(qe "$CTL"),security_model=none"
      -device virtio-9p-pci,fsdev=fsctl,mount_tag=ctl
      -drive "file=$(qe "$RUN/scratch.img"),if=none,id=scratch,format=raw,cache=unsafe,discard=unmap"
      -device virtio-blk-pci,drive=scratch
      -device virtio-serial-pci,id=vser0
      -chardev "file,id=cout,path=$(qe "$RUN/out")" -device virtserialport,bus=vser0.0,chardev=cout,name=arm64.out
      -chardev "file,id=cerr,path=$(qe "$RUN/err")" -device virtserialport,bus=vser0.0,chardev=cerr,name=arm64.err
      ${QEMU_NVME[@]+"${QEMU_NVME[@]}"} ${QEMU_MODS[@]+"${QEMU_MODS[@]}"})
[ $VERBOSE = 0 ] || say "${QEMU[*]}"

vm_qemu_wait "$TIMEOUT" "${QEMU[@]}"
vm_done() { say "VM done in $((SECONDS - T0)) s (guest uptime at exit $(cat "$CTL/uptime") s)"; }
vm_finish "timeout after ${TIMEOUT} s" "the VM ended without the command's exit status (qemu rc=$QRC)"
