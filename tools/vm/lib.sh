# shellcheck shell=bash
# shellcheck disable=SC2034  # APT_UPDATED, VM_APT, QRC, CONSOLE, ...: read by the harnesses that source this
# tools/vm/lib.sh - what the two VM harnesses share, sourced by both (never run):
#   tools/vm/arm64/run-arm64.sh     bladed on aarch64 under emulation (docs/arm64.md)
#   tools/vm/nvme/run-in-nvme-vm.sh a throw-away x86-64 VM with QEMU's NVMe controller (docs/nvme-vm.md)
# Each sources it as  . "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/../lib.sh"  and sets VM_SAY (the name of
# its function that writes one message line on stderr) before it calls vm_cleanup or vm_initramfs_modules.
# Nothing here names a cache path or enters a cache signature: each harness keeps its own cache layout, and
# what its signatures hash is the same whichever file the code lives in.

VM_DEBIAN_KEYRING=/usr/share/keyrings/debian-archive-keyring.gpg

qe() { printf %s "${1//,/,,}"; }  # commas in QEMU option values

# -- host packages ----------------------------------------------------------------------------------------
APT_UPDATED=0
vm_apt_install() {  # vm_apt_install PKG...: apt-get install, after an update if the first try fails
    export DEBIAN_FRONTEND=noninteractive
    if ! apt-get install -y -q --no-install-recommends "$@" >&2; then
        apt-get update -q >&2 && APT_UPDATED=1
        apt-get install -y -q --no-install-recommends "$@" >&2
    fi
}

# -- kernels ----------------------------------------------------------------------------------------------
# a Debian kernel meta package's versioned linux-image package, from `apt-cache depends META` on stdin
vm_kernel_of() { awk '/Depends: linux-image-[0-9]/{print $2; exit}'; }

# a private apt configuration in DIR, for a Debian release the host's sources.list never names: its own
# sources (one line per "MIRROR SUITE", Signed-By the host's debian-archive-keyring), lists and archive
# cache; sets VM_APT, the options that make apt-get / apt-cache use it
vm_private_apt() {  # vm_private_apt DIR ARCH "MIRROR SUITE"...
    local d=$1 arch=$2 src
    shift 2
    mkdir -p "$d/lists/partial" "$d/archives/partial" "$d/parts"
    : > "$d/sources.list"
    for src in "$@"; do
        printf 'deb [signed-by=%s] %s %s main\n' "$VM_DEBIAN_KEYRING" "${src% *}" "${src##* }" >> "$d/sources.list"
    done
    VM_APT=(-o "Dir::Etc::SourceList=$d/sources.list" -o "Dir::Etc::SourceParts=$d/parts"
            -o "Dir::State::Lists=$d/lists" -o "Dir::Cache=$d" -o "Dir::Cache::archives=$d/archives"
            -o Acquire::Languages=none -o APT::Architecture="$arch" -o APT::Architectures="$arch")
}

# -- the initramfs's modules ------------------------------------------------------------------------------
# the modules WANT names (a list of module names) with their dependencies, in load order: the module paths
# relative to MODDIR, from its modules.dep (builtin ones, in modules.builtin, are left out)
vm_resolve_modules() {  # vm_resolve_modules MODDIR WANT
    local moddir=$1
    awk -v want="$2" '
        FNR == NR { n=split($1, a, "/"); name=a[n]; sub(/\.ko.*$/, "", name)
                    gsub("-", "_", name); builtin[name]=1; next }
        { sub(":", "", $1); path[$1]=$0; n=split($1, a, "/"); name=a[n];
          sub(/\.ko(\.[a-z]+)?$/, "", name); gsub("-", "_", name); byname[name]=$1 }
        function load(p,   f, i, n) {
            if (p in done) return; done[p]=1
            n=split(path[p], f, " ")
            for (i=n; i>=2; i--) load(f[i])   # deps listed nearest-first
            print p
        }
        END { n=split(want, w, " ")
              for (i=1; i<=n; i++) { m=w[i]; gsub("-", "_", m)
                  if (m in builtin) continue
                  if (!(m in byname)) { print "missing module " m > "/dev/stderr"; exit 1 }
                  load(byname[m]) } }' "$moddir/modules.builtin" "$moddir/modules.dep"
}

# the modules MODS (paths relative to MODDIR) into DIR/modules, uncompressed (busybox insmod takes them so),
# and their names in load order into DIR/modules.list (the guest init's list); XZCAT and ZCAT are the
# commands that decompress (words; ZCAT empty: a .ko.gz is copied as it is), zstd does .ko.zst
vm_initramfs_modules() {  # vm_initramfs_modules MODDIR DIR XZCAT ZCAT MODS...
    local moddir=$1 d=$2 xzcat=$3 zcat=$4 m b
    shift 4
    : > "$d/modules.list"
    for m in "$@"; do
        b=${m##*/}
        case $b in
            *.ko.xz) $xzcat "$moddir/$m" > "$d/modules/${b%.xz}"; b=${b%.xz} ;;
            *.ko.gz) if [ -n "$zcat" ]; then $zcat "$moddir/$m" > "$d/modules/${b%.gz}"; b=${b%.gz}
                     else cp "$moddir/$m" "$d/modules/"; fi ;;
            *.ko.zst) zstd -dcq "$moddir/$m" > "$d/modules/${b%.zst}"; b=${b%.zst} ;;
            *) cp "$moddir/$m" "$d/modules/" ;;
        esac
        echo "$b" >> "$d/modules.list"
    done
}

# -- the guest init's core --------------------------------------------------------------------------------
# The guest inits (busybox sh, PID 1 of the initramfs) are templates: a line "#@ vm_init_PART ARGS" stands
# for the part below of that name. vm_init_expand writes the init with its parts in place.
vm_init_expand() {  # stdin: the template; stdout: the init
    local line part
    while IFS= read -r line || [ -n "$line" ]; do
        case $line in
            '#@ vm_init_'*)
                read -r -a part <<< "${line#'#@ '}"
                case ${part[0]} in
                    vm_init_start|vm_init_newroot|vm_init_ports|vm_init_run) "${part[@]}" ;;
                    *) echo "vm_init_expand: no part ${part[0]}" >&2; return 1 ;;
                esac ;;
            *) printf '%s\n' "$line" ;;
        esac
    done
}
# its log (on the console, each line NAME-init[uptime]), halt_now, the initramfs's modules, the 9p options
vm_init_start() {  # vm_init_start NAME
    # shellcheck disable=SC2016  # the guest's expansions
    printf 'log() { echo "%s-init[$(cut -d'"' '"' -f1 /proc/uptime)]: $*" > /dev/console; }\n' "$1"
    cat <<'EOF'
halt_now() { sync; poweroff -f; echo o > /proc/sysrq-trigger; sleep 5; }
log "init started"
for m in $(cat /modules.list); do
    insmod "/modules/$m" 2>/dev/null || log "insmod $m failed"
done
P9="trans=virtio,version=9p2000.L,msize=512000"
EOF
}
# the new root's (the overlay on /newroot) kernel filesystems
vm_init_newroot() {
    cat <<'EOF'
R=/newroot
mount -t proc proc $R/proc
mount -t sysfs sysfs $R/sys
mount --bind /dev $R/dev
mkdir -p $R/dev/pts $R/dev/shm
mount -t devpts -o newinstance,ptmxmode=0666 devpts $R/dev/pts
mount -t tmpfs -o mode=1777 tmpfs $R/dev/shm
mount -t tmpfs -o mode=755 tmpfs $R/run
EOF
}
# OUT / ERR: the virtio-serial ports PREFIX.out / PREFIX.err (the command's stdout / stderr on the host)
vm_init_ports() {  # vm_init_ports PREFIX
    cat <<'EOF'
OUT=/dev/console; ERR=/dev/console
for d in /sys/class/virtio-ports/*; do
    case "$(cat $d/name 2>/dev/null)" in
EOF
    # shellcheck disable=SC2016  # the guest's expansions
    printf '        %s.out) OUT=/dev/${d##*/} ;;\n        %s.err) ERR=/dev/${d##*/} ;;\n' "$1" "$1"
    cat <<'EOF'
    esac
done
EOF
}
# the command (CTLDIR/cmd.sh, CTLDIR: the ctl share in the new root) in a chroot of the new root, its exit
# status and the guest's uptime into the ctl share, then power off
vm_init_run() {  # vm_init_run HOSTNAME CTLDIR
    printf 'hostname %s\n' "$1"
    cat <<'EOF'
ip link set lo up 2>/dev/null
log "starting command"
EOF
    # shellcheck disable=SC2016  # the guest's expansions
    printf 'chroot $R /bin/bash %s/cmd.sh < /dev/null > $OUT 2> $ERR\n' "$2"
    cat <<'EOF'
rc=$?
log "command exited with $rc"
echo $rc > /ctl/rc
cut -d' ' -f1 /proc/uptime > /ctl/uptime
halt_now
EOF
}

# -- a run: its directory, the serial ports, QEMU --------------------------------------------------------
# RUN (a fresh directory below BASE) and CTL (RUN/ctl, the guest's ctl share); on exit QEMU is killed and
# RUN removed (kept, and said, with KEEP=1)
vm_run_dir() {  # vm_run_dir BASE
    mkdir -p "$1"
    RUN=$(mktemp -d "$1/run.XXXXXX")
    CTL=$RUN/ctl
    mkdir -p "$CTL"
    QEMU_PID=
}
vm_cleanup() {
    local rc=$?
    if [ -n "$QEMU_PID" ]; then kill "$QEMU_PID" 2>/dev/null || true; fi
    if [ "$KEEP" = 1 ]; then "$VM_SAY" "kept $RUN"; else rm -rf "$RUN"; fi
    exit $rc
}

# the command's stdout and stderr: FIFOs RUN/out and RUN/err, which QEMU's virtio-serial ports write, copied
# to this script's; CONSOLE, the guest console's log (followed on stderr with VERBOSE=1)
vm_serial_start() {
    mkfifo "$RUN/out" "$RUN/err"
    cat "$RUN/out" &
    CAT1=$!
    cat "$RUN/err" >&2 &
    CAT2=$!
    CONSOLE=$RUN/console.log
    : > "$CONSOLE"
    TAILPID=
    if [ "$VERBOSE" = 1 ]; then tail -n +1 -f "$CONSOLE" >&2 & TAILPID=$!; fi
}
# QEMU... under timeout(1) (TIMEOUT seconds), to its end: QRC, its exit status; then the FIFOs' readers end
# (VM_TAIL_GRACE: seconds the console's follower is given before it is stopped)
vm_qemu_wait() {  # vm_qemu_wait TIMEOUT QEMU...
    local t=$1
    shift
    set +e
    timeout -k 10 "$t" "$@" < /dev/null > "$RUN/qemu.log" 2>&1 &
    QEMU_PID=$!
    wait $QEMU_PID
    QRC=$?
    QEMU_PID=
    # QEMU never opened a FIFO if it died early: unblock the readers
    [ -e "/proc/$CAT1" ] && { exec 7<>"$RUN/out"; exec 7>&-; } 2>/dev/null
    [ -e "/proc/$CAT2" ] && { exec 7<>"$RUN/err"; exec 7>&-; } 2>/dev/null
    wait "$CAT1" "$CAT2" 2>/dev/null
    [ -n "$TAILPID" ] && { [ -z "${VM_TAIL_GRACE:-}" ] || sleep "$VM_TAIL_GRACE"; kill "$TAILPID" 2>/dev/null
                           wait "$TAILPID" 2>/dev/null; }
    set -e
}
# the end: exit with the command's exit status (with VERBOSE=1, the harness's vm_done says how long it took
# first); without one, with 124 after a timeout, else 125, saying TIMEOUT-MESSAGE or ENDED-MESSAGE, with QEMU's
# messages and the console's tail on stderr
vm_finish() {  # vm_finish TIMEOUT-MESSAGE ENDED-MESSAGE
    if [ -s "$CTL/rc" ]; then
        RC=$(cat "$CTL/rc")
        [ "$VERBOSE" = 0 ] || vm_done
        exit "$RC"
    fi
    if [ "$QRC" = 124 ] || [ "$QRC" = 137 ]; then
        "$VM_SAY" "$1"; RC=124
    else
        "$VM_SAY" "$2"; RC=125
    fi
    cat "$RUN/qemu.log" >&2
    [ "$VERBOSE" = 1 ] || { "$VM_SAY" "guest console (tail):"; tail -n 40 "$CONSOLE" >&2; }
    exit $RC
}
