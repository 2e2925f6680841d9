#!/usr/bin/env bash
# tools/vm/install/test-install.sh - test tools/install.sh in a fresh Debian 12 root, as root
# (tests/test_install.py runs it).
#
# The root is a copy of a cached `debootstrap --variant=minbase --include=systemd bookworm` root (systemd is
# installed, as on any Debian box, but it does not run: this is a chroot). A clean export of the checkout
# (the files git tracks or would track, as in the working tree; nothing ignored) goes to /usr/src/bladed in
# it, and the checks below run inside it with chroot, in a private mount namespace with /proc, /sys and /dev
# mounted, so nothing stays mounted when it ends, however it ends. Inside the root, in order:
#   * with no network, install.sh fails with exit 5 and one line, and has written nothing
#   * not root: exit 3; an unsupported /etc/os-release: exit 4
#   * with PyPI unreachable, exit 6 and one line (after apt, the user and the venv); the next run goes on in
#     that venv
#   * install.sh installs; bladed --version, bladectl --version; the installed config, unit, sysusers.d file
#     and udev rule are the shipped ones; the unit's ExecStart/ExecStartPre binaries exist; systemd-analyze
#     verify passes; the user and group bladed; /var/lib/bladed; the /usr/local/bin symlinks; not enabled
#   * bladed --check-config against a test config (a 64 MiB file-backed store); then that bladed runs as user
#     bladed, bladectl status talks to it over its socket, SIGTERM stops it with exit 0
#   * a second install.sh run says "nothing to do" and changes no file (the test config is kept);
#     --uninstall --dry-run changes nothing either
#   * an upgrade (a changed module and unit in the checkout) reinstalls bladed into the same venv, replaces
#     the unit, keeps the config and an edited udev rule
#   * --enable enables bladed.service (does not start it: systemd does not run in the root)
#   * --uninstall removes the venv, symlinks, unit (and its enablement) and sysusers.d file, keeps the edited
#     udev rule, the config, the state directory and the user; a second --uninstall has nothing to do;
#     --purge removes the rest
#
# Cache: ${XDG_CACHE_HOME:-~/.cache}/bladed-install-test/ (rebuilt weekly: the root is keyed by ISO week)
#   root-DISTRO-YYYY-Www/   the debootstrap root; each run copies it
#   apt-DISTRO/             .deb files apt downloads inside the root (bind-mounted at /var/cache/apt/archives)
#   wheels-DISTRO/          wheels of bladed's dependencies (bind-mounted at /root/.cache/bladed-wheels, pip's
#                           PIP_FIND_LINKS)
# A cold run (no cache) needs deb.debian.org and pypi.org; a warm one still runs apt-get update and pip
# against them.
#
# usage: tools/vm/install/test-install.sh [--distro bookworm|noble] [--keep]
#   --distro noble   an Ubuntu 24.04 root from archive.ubuntu.com, components main and universe (python3-venv
#                    is in universe) as in Ubuntu's default sources; this host's debootstrap has no Ubuntu
#                    keyring, so it does not check the Release file's signature (apt inside the root does)
#   --keep           keep the root (printed) for a look
# exit codes: 0 every check passed; 1 a check failed; 2 bad usage; 3 not root; 4 a host tool is missing;
#             5 the network to the archive or to PyPI is not reachable
set -euo pipefail

say() { echo "test-install: $*"; }
# inside the root: wheels of bladed's dependencies and build requirements, offered to pip with
# PIP_FIND_LINKS (pip still asks PyPI what is there); pip's own HTTP cache is no help through proxies that
# strip the cache headers
WHEELS=/root/.cache/bladed-wheels
die() { echo "test-install: error: $2" >&2; exit "$1"; }

# -- inside the root (chroot) ---------------------------------------------------------------------------------
if [ "${1:-}" = __in_root ]; then
    SRC=/usr/src/bladed
    INSTALL=$SRC/tools/install.sh
    UNIT=/usr/local/lib/systemd/system/bladed.service
    RULE=/etc/udev/rules.d/60-bladed.rules
    OUT=/tmp/install-out
    phase_start=$SECONDS
    phase() { say "  ($((SECONDS - phase_start)) s) $*"; phase_start=$SECONDS; }
    fail() { echo "test-install: FAIL: $*" >&2; exit 1; }
    check() {  # check DESCRIPTION COMMAND...: passes when COMMAND succeeds
        local what=$1
        shift
        "$@" || fail "$what"
        say "ok: $what"
    }
    # run_install EXPECTED_RC COMMAND...: its stdout+stderr in $OUT, shown on a surprise
    run_install() {
        local want=$1 rc=0
        shift
        "$@" >"$OUT" 2>&1 || rc=$?
        if [ "$rc" != "$want" ]; then
            cat "$OUT" >&2
            fail "$* exited $rc, expected $want"
        fi
    }
    # on a mismatch these show what install.sh said
    last_line_has() { tail -n 1 "$OUT" | grep -qF -- "$1" || { cat "$OUT" >&2; false; }; }
    out_has() { grep -qF -- "$1" "$OUT" || { cat "$OUT" >&2; false; }; }
    out_lacks() { ! grep -qF -- "$1" "$OUT" || { cat "$OUT" >&2; false; }; }
    untouched() {  # nothing install.sh makes exists
        [ ! -e /opt/bladed ] && [ ! -e /etc/bladed ] && [ ! -e $UNIT ] && ! getent passwd bladed >/dev/null
    }
    # every file outside the pseudo filesystems and caches: path, type, size, mtime, mode, owner, link target
    snapshot() {
        find / -xdev \( -path /proc -o -path /sys -o -path /dev -o -path /run -o -path /tmp \
            -o -path /var/cache/apt/archives -o -path /root/.cache \) -prune \
            -o -printf '%p %y %s %T@ %m %U:%G %l\n' | LC_ALL=C sort
    }
    exec_of() {  # the binary of the unit's first KEY= line
        grep -m1 "^$1=" $UNIT | cut -d= -f2- | cut -d' ' -f1
    }

    check "with no network, install.sh exits 5" run_install 5 unshare --net "$INSTALL"
    check "... with one line naming apt-get update" \
        last_line_has "error: apt-get update could not download the package lists"
    check "... and has written nothing" untouched
    check "not root: exit 3" run_install 3 setpriv --reuid=65534 --regid=65534 --clear-groups "$INSTALL"
    check "... with one line" last_line_has "error: must run as root (uid 65534)"
    cp -P /etc/os-release /tmp/os-release.real
    rm /etc/os-release && printf 'ID=ubuntu\nVERSION_ID="22.04"\n' >/etc/os-release
    check "an unsupported distribution (Ubuntu 22.04): exit 4" run_install 4 "$INSTALL"
    rm /etc/os-release && cp -P /tmp/os-release.real /etc/os-release
    check "... with one line" last_line_has "error: unsupported distribution 'ubuntu 22.04'"
    check "... and nothing was written" untouched
    phase "error paths"

    # PyPI refused (a closed port): apt, the user and the venv are done before pip fails
    check "with PyPI unreachable, install.sh exits 6" run_install 6 env PIP_INDEX_URL=http://127.0.0.1:9/simple \
        PIP_FIND_LINKS= PIP_RETRIES=0 "$INSTALL"
    check "... with one line naming pip" last_line_has "error: pip could not install into /opt/bladed"
    phase "first install, PyPI unreachable"

    run_install 0 "$INSTALL"
    cat "$OUT"
    check "the next run installs into the venv the failed one made" out_lacks "create the virtual environment"
    phase "first install"
    # the wheelhouse for the next runs (a no-op when it has them)
    /opt/bladed/bin/python -m pip freeze --exclude bladed >/tmp/requirements.txt
    if ! cmp -s /tmp/requirements.txt $WHEELS/requirements.txt; then
        /opt/bladed/bin/python -m pip wheel -q --no-deps -w $WHEELS setuptools wheel -r /tmp/requirements.txt
        cp /tmp/requirements.txt $WHEELS/requirements.txt
        phase "wheelhouse filled"
    fi
    check "it prints the next steps" out_has "systemctl enable --now bladed"
    check "bladed.service is not enabled" \
        test "$(systemctl is-enabled bladed.service 2>/dev/null || true)" = disabled
    check "bladed --version" /opt/bladed/bin/bladed --version
    check "bladectl --version (on PATH)" bladectl --version
    check "/usr/local/bin/bladed, bladectl -> /opt/bladed/bin/" \
        test "$(readlink /usr/local/bin/bladed) $(readlink /usr/local/bin/bladectl)" = \
        "/opt/bladed/bin/bladed /opt/bladed/bin/bladectl"
    check "the config is etc/bladed.toml" cmp $SRC/etc/bladed.toml /etc/bladed/bladed.toml
    check "the unit is systemd/bladed.service" cmp $SRC/systemd/bladed.service $UNIT
    check "the udev rule is udev/60-bladed.rules" cmp $SRC/udev/60-bladed.rules $RULE
    check "the sysusers.d file is systemd/bladed.sysusers" \
        cmp $SRC/systemd/bladed.sysusers /usr/local/lib/sysusers.d/bladed.conf
    check "the unit's ExecStart binary $(exec_of ExecStart) is executable" test -x "$(exec_of ExecStart)"
    check "the unit's ExecStartPre binary $(exec_of ExecStartPre) is executable" test -x "$(exec_of ExecStartPre)"
    check "systemd-analyze verify bladed.service" systemd-analyze verify bladed.service
    check "the system user bladed, no login, home /var/lib/bladed" \
        test "$(getent passwd bladed | cut -d: -f6,7)" = /var/lib/bladed:/usr/sbin/nologin
    check "... its primary group is bladed" test "$(id -gn bladed)" = bladed
    check "/var/lib/bladed is left to the unit's StateDirectory=" test ! -e /var/lib/bladed

    printf '%s\n' '# test config (tools/vm/install/test-install.sh): a small file-backed store' \
        '[daemon]' 'state_dir = "/var/lib/bladed"' \
        '[device]' 'backend = "file"' 'path = "test-store.img"' 'size = "64M"' \
        '[socket]' 'path = "/run/bladed/bladed.sock"' >/etc/bladed/bladed.toml
    # as the unit runs them (ExecStartPre=, ExecStart=): as user bladed, in the directories systemd makes for
    # StateDirectory= and RuntimeDirectory=
    install -d -o bladed -g bladed -m 0750 /var/lib/bladed
    install -d -o bladed -g bladed -m 0755 /run/bladed
    as_bladed=(setpriv --reuid=bladed --regid=bladed --init-groups)
    check "bladed --config /etc/bladed/bladed.toml --check-config" \
        run_install 0 "${as_bladed[@]}" /opt/bladed/bin/bladed --config /etc/bladed/bladed.toml --check-config
    check "... finds the store" out_has "configuration OK: file /var/lib/bladed/test-store.img"
    "${as_bladed[@]}" /opt/bladed/bin/bladed --config /etc/bladed/bladed.toml >/tmp/bladed.log 2>&1 &
    pid=$!
    deadline=$((SECONDS + 60))
    until [ -S /run/bladed/bladed.sock ]; do
        kill -0 $pid 2>/dev/null || { cat /tmp/bladed.log; fail "bladed exited before listening"; }
        [ $SECONDS -lt $deadline ] || { cat /tmp/bladed.log; kill $pid; fail "no socket after 60 s"; }
        sleep 0.1  # a poll with a deadline: the socket file appearing is the event
    done
    check "bladectl status talks to the installed bladed (running as user bladed)" run_install 0 bladectl status
    check "... which serves the test store" out_has "file /var/lib/bladed/test-store.img"
    kill -TERM $pid
    rc=0
    wait $pid || rc=$?
    check "SIGTERM stops it with exit 0" test $rc = 0
    phase "the installed bladed runs"

    snapshot >/tmp/before
    run_install 0 "$INSTALL"
    check "a second run says nothing to do" last_line_has "nothing to do: bladed is installed and up to date"
    snapshot >/tmp/after
    check "... and changed no file (the test config included)" diff /tmp/before /tmp/after
    run_install 0 "$INSTALL" --uninstall --dry-run
    check "--uninstall --dry-run lists the venv" out_has "would remove /opt/bladed"
    snapshot >/tmp/after
    check "... and changed no file" diff /tmp/before /tmp/after
    phase "second run"

    # an upgrade: a newer checkout (a changed module and unit), an admin's edit of the udev rule
    echo "# upgraded" >>$SRC/bladed/__init__.py
    echo "# upgraded" >>$SRC/systemd/bladed.service
    sed -i 's/"SERIAL"/"S123"/' $RULE
    run_install 0 "$INSTALL"
    check "an upgrade reinstalls bladed into the venv" out_has "install bladed into /opt/bladed"
    check "... without making it anew" out_lacks "create the virtual environment"
    check "... replaces the unit" out_has "replace $UNIT with systemd/bladed.service"
    check "... keeps the edited udev rule" out_has "$RULE differs from udev/60-bladed.rules: kept (yours)"
    check "... keeps the config" grep -q "test-store.img" /etc/bladed/bladed.toml
    check "... and the new bladed runs" /opt/bladed/bin/bladed --version
    run_install 0 "$INSTALL"
    check "... after which there is nothing to do" last_line_has "nothing to do"
    phase "upgrade"

    run_install 0 "$INSTALL" --enable
    check "--enable enables bladed.service" test "$(systemctl is-enabled bladed.service)" = enabled
    check "... and says it is not started (systemd does not run here)" \
        out_has "systemd is not running here: not started"

    run_install 0 "$INSTALL" --uninstall
    cat "$OUT"
    check "--uninstall removed the venv" test ! -e /opt/bladed
    check "... the symlinks" test ! -L /usr/local/bin/bladed -a ! -L /usr/local/bin/bladectl
    check "... the unit and its enablement" \
        test ! -e $UNIT -a ! -L /etc/systemd/system/multi-user.target.wants/bladed.service
    check "... the sysusers.d file" test ! -e /usr/local/lib/sysusers.d/bladed.conf
    check "... and kept the edited udev rule, the config, the state directory and the user" \
        test -f $RULE -a -f /etc/bladed/bladed.toml -a -f /var/lib/bladed/test-store.img -a -n "$(getent passwd bladed)"
    run_install 0 "$INSTALL" --uninstall
    check "a second --uninstall has nothing to do" out_has "nothing to do: bladed is not installed"
    run_install 0 "$INSTALL" --uninstall --purge
    check "--purge removed the udev rule, the config, the state directory, the user and the group" \
        test ! -e $RULE -a ! -e /etc/bladed -a ! -e /var/lib/bladed -a -z "$(getent passwd bladed)" \
        -a -z "$(getent group bladed)"
    phase "enable, uninstall, purge"
    exit 0
fi

# -- in a private mount namespace, on the host --------------------------------------------------------------
if [ "${1:-}" = __in_namespace ]; then
    root=$2 cache=$3 distro=$4
    mount -t proc proc "$root/proc"
    mount --rbind /sys "$root/sys"
    mount --rbind /dev "$root/dev"
    mkdir -p "$cache/apt-$distro/partial" "$cache/wheels-$distro" "$root$WHEELS"
    mount --bind "$cache/apt-$distro" "$root/var/cache/apt/archives"
    mount --bind "$cache/wheels-$distro" "$root$WHEELS"
    cp -L /etc/resolv.conf "$root/etc/resolv.conf"
    # pip in the root trusts what this host trusts (a site's TLS-intercepting proxy CA, say), as an admin
    # would configure pip on such a site; otherwise it has only its own certifi bundle
    cert=()
    if [ -f /etc/ssl/certs/ca-certificates.crt ]; then
        cp /etc/ssl/certs/ca-certificates.crt "$root/etc/host-ca-certificates.crt"
        cert=(PIP_CERT=/etc/host-ca-certificates.crt)
    fi
    # a clean environment: nothing else of the host's (PIP_* settings, local indexes) leaks in
    exec env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 \
        TERM=dumb PIP_FIND_LINKS=$WHEELS "${cert[@]}" \
        chroot "$root" /bin/bash /usr/src/bladed/tools/vm/install/test-install.sh __in_root
fi

# -- on the host ----------------------------------------------------------------------------------------------
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)  # the checkout: this is tools/vm/install/
DISTRO=bookworm
KEEP=0
while [ $# -gt 0 ]; do
    case $1 in
        --distro) [ $# -ge 2 ] || die 2 "--distro needs bookworm or noble"; DISTRO=$2; shift ;;
        --keep) KEEP=1 ;;
        -h | --help) sed -n '/^# usage:/,/^# exit codes:/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) die 2 "unknown argument '$1'; usage: tools/vm/install/test-install.sh [--distro bookworm|noble] [--keep]" ;;
    esac
    shift
done
case $DISTRO in
    bookworm) MIRROR=http://deb.debian.org/debian DEBOOTSTRAP_ARGS=() SCRIPT=() ;;
    # this host's debootstrap (Debian 12) has no noble script nor the Ubuntu keyring; noble bootstraps
    # like every Ubuntu release since gutsy
    noble) MIRROR=http://archive.ubuntu.com/ubuntu
        DEBOOTSTRAP_ARGS=(--no-check-gpg "--components=main,universe") SCRIPT=(/usr/share/debootstrap/scripts/gutsy) ;;
    *) die 2 "--distro '$DISTRO' is not bookworm or noble" ;;
esac

[ "$(id -u)" = 0 ] || die 3 "must run as root (debootstrap, chroot and mounts need it); run: sudo $0"
for tool in debootstrap unshare chroot flock git python3; do
    command -v $tool >/dev/null || die 4 "$tool not found; install it (tools/setup.sh installs debootstrap)"
done
git -C "$HERE" rev-parse --git-dir >/dev/null 2>&1 ||
    die 4 "$HERE is not a git checkout: the test installs what git tracks there"
reachable() {
    python3 -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=20).read(1)' "$1" \
        2>/dev/null
}
T0=$SECONDS
reachable "$MIRROR/dists/$DISTRO/Release" ||
    die 5 "cannot reach $MIRROR (debootstrap and apt in the test root need it): check the network or proxy"
reachable https://pypi.org/simple/pip/ ||
    die 5 "cannot reach https://pypi.org (pip in the test root needs it): check the network or proxy"

CACHE=${XDG_CACHE_HOME:-$HOME/.cache}/bladed-install-test
mkdir -p "$CACHE"
BASE=$CACHE/root-$DISTRO-$(date +%G-W%V)
exec 9>"$CACHE/lock"
flock 9  # one debootstrap at a time; others wait for it and use its root
if [ ! -f "$BASE/.complete" ]; then
    say "no cached $DISTRO root for this week: debootstrap into $BASE"
    # last week's root and what was downloaded for it go
    rm -rf --one-file-system "$CACHE/root-$DISTRO-"* "$CACHE/apt-$DISTRO" "$CACHE/wheels-$DISTRO"
    debootstrap --variant=minbase --include=systemd "${DEBOOTSTRAP_ARGS[@]}" "$DISTRO" "$BASE" "$MIRROR" \
        "${SCRIPT[@]}" >"$CACHE/debootstrap-$DISTRO.log" 2>&1 ||
        { tail -n 20 "$CACHE/debootstrap-$DISTRO.log" >&2; die 1 "debootstrap $DISTRO failed (log above)"; }
    rm -f "$BASE"/var/cache/apt/archives/*.deb
    # no fsync per file in dpkg (as in Debian's build chroots): the root is thrown away anyway
    echo force-unsafe-io >"$BASE/etc/dpkg/dpkg.cfg.d/bladed-test-unsafe-io"
    touch "$BASE/.complete"
fi
flock -s 9  # shared while copying: next week's first run waits before it removes this root
T_BASE=$((SECONDS - T0))

# roots of runs killed outright (SIGKILL: no EXIT trap); their mounts died with their namespaces
find "$CACHE" -maxdepth 1 -name 'work.*' -mmin +120 -exec rm -rf --one-file-system {} +
WORK=$(mktemp -d "$CACHE/work.XXXXXX")
cleanup() {
    if [ $KEEP = 1 ]; then
        say "kept the root: $WORK/root"
    else
        # the mounts were in the namespace that is gone; --one-file-system guards against anything left
        rm -rf --one-file-system "$WORK"
    fi
}
trap cleanup EXIT
cp -a "$BASE" "$WORK/root"
rm -f "$WORK/root/.complete"
flock -u 9
mkdir -p "$WORK/root/usr/src/bladed"
# a clean export: what git tracks or would track (new files not yet added included), as in the working tree
git -C "$HERE" ls-files -z --cached --others --exclude-standard |
    (cd "$HERE" && while IFS= read -r -d '' f; do [ -e "$f" ] && printf '%s\0' "$f"; done) |
    tar -C "$HERE" --null -T - -cf - | tar -C "$WORK/root/usr/src/bladed" -xf -
T_COPY=$((SECONDS - T0 - T_BASE))
say "root ready: $WORK/root ($DISTRO; cached root ${T_BASE} s, copy ${T_COPY} s)"

rc=0
unshare --mount --propagation private "$HERE/tools/vm/install/test-install.sh" __in_namespace "$WORK/root" "$CACHE" \
    "$DISTRO" || rc=$?
if [ $rc = 0 ]; then
    say "PASS ($DISTRO) in $((SECONDS - T0)) s"
else
    say "FAILED ($DISTRO, exit $rc) after $((SECONDS - T0)) s"
    [ $rc -lt 128 ] || rc=1
fi
exit $rc
