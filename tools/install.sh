#!/usr/bin/env bash
# tools/install.sh - install bladed on an edge box (Debian >= 12, Ubuntu >= 24.04) from this checkout, as root.
# docs/operations.md, "Install", says what goes where; tools/vm/install/test-install.sh tests this in a fresh
# Debian 12 root.
#
#   1. Debian packages: liburing2, python3, python3-venv, libudev1 (pyudev), procps (the unit's /bin/kill),
#      systemd (systemd-sysusers, systemctl; present on any Debian/Ubuntu box), and what pip needs to compile
#      the cffi extension: gcc, libc6-dev, python3-dev, liburing-dev
#   2. the system user and group bladed: systemd/bladed.sysusers as /usr/local/lib/sysusers.d/bladed.conf,
#      applied with systemd-sysusers
#   3. the virtual environment /opt/bladed with bladed and its runtime dependencies, from PyPI (pip);
#      --with-runner adds torch==2.13.0 (CPU build) and the hf extra, for bladed-runner
#   4. /etc/bladed/bladed.toml from etc/bladed.toml and /etc/udev/rules.d/60-bladed.rules from
#      udev/60-bladed.rules: installed when absent; an existing file is the admin's and is never touched
#   5. /usr/local/lib/systemd/system/bladed.service from systemd/bladed.service (replaced by an upgrade;
#      local changes go in drop-ins under /etc/systemd/system/bladed.service.d/)
#   6. /usr/local/bin/bladed, bladectl (and bladed-runner) -> /opt/bladed/bin/
# /var/lib/bladed and /run/bladed are the unit's StateDirectory= and RuntimeDirectory=: systemd makes them.
# Each step is skipped when already done, so a second run changes nothing and says so. Re-running from a newer
# checkout upgrades: bladed is reinstalled when its sources differ from the installed ones, the unit replaced.
# bladed is neither enabled nor started without --enable. systemctl daemon-reload and udevadm run only where
# systemd runs (not in a chroot or a container).
#
# usage: tools/install.sh [--with-runner] [--torch-index URL] [--enable] [--dry-run]
#        tools/install.sh --uninstall [--purge] [--dry-run]
#   --with-runner       also torch==2.13.0 and the hf extra (later runs without the flag keep them)
#   --torch-index URL   where torch comes from (default https://download.pytorch.org/whl/cpu, the CPU builds;
#                       "" = pip's configured indexes)
#   --enable            systemctl enable --now bladed (only enable where systemd does not run)
#   --dry-run           print what would change and change nothing (needs no root)
#   --uninstall         stop and disable bladed; remove the unit, the venv, the symlinks, the sysusers.d file
#                       and the udev rule (unless edited); keep /etc/bladed, /var/lib/bladed, the user and
#                       group, and the Debian packages
#   --purge             with --uninstall: also remove /etc/bladed, /var/lib/bladed, the udev rule, the user
#                       and the group
# exit codes:
#   0  done, or nothing to do
#   1  a step failed unexpectedly (its output is above)
#   2  bad usage
#   3  not run as root
#   4  unsupported distribution
#   5  apt could not download or install the packages (network, proxy, sources.list)
#   6  pip could not install bladed (PyPI not reachable, or the build failed; its output is above)
#   7  this is not a bladed checkout, or /opt/bladed holds something install.sh did not make
set -euo pipefail

PREFIX=/opt/bladed                    # systemd/bladed.service's ExecStart= names $PREFIX/bin/bladed
TORCH_PIN="torch==2.13.0"
CONF_DIR=/etc/bladed
STATE_DIR=/var/lib/bladed
UNIT=/usr/local/lib/systemd/system/bladed.service
SYSUSERS=/usr/local/lib/sysusers.d/bladed.conf
UDEV_RULE=/etc/udev/rules.d/60-bladed.rules
BIN_DIR=/usr/local/bin
STAMP=$PREFIX/.bladed-install
# run time, then what pip needs to build the cffi extension (setup.py, cffi_build/build_uring.py)
APT_RUNTIME=(liburing2 python3 python3-venv libudev1 procps systemd)
APT_BUILD=(gcc libc6-dev python3-dev liburing-dev)

SRC=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
ARGS=$*
WITH_RUNNER=0
TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENABLE=0
DRY=0
UNINSTALL=0
PURGE=0

say() { echo "install.sh: $*"; }
die() {  # die CODE MESSAGE: the one-line error
    echo "install.sh: error: $2" >&2
    exit "$1"
}
usage() { sed -n '/^# usage:/,/^# exit codes:/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//' >&2; }

while [ $# -gt 0 ]; do
    case $1 in
        --with-runner) WITH_RUNNER=1 ;;
        --torch-index) [ $# -ge 2 ] || die 2 "--torch-index needs a URL (or \"\")"; TORCH_INDEX=$2; shift ;;
        --torch-index=*) TORCH_INDEX=${1#*=} ;;
        --enable) ENABLE=1 ;;
        --dry-run) DRY=1 ;;
        --uninstall) UNINSTALL=1 ;;
        --purge) PURGE=1 ;;
        -h | --help) usage; exit 0 ;;
        *) usage; die 2 "unknown argument '$1' (see the usage above)" ;;
    esac
    shift
done
[ $PURGE = 0 ] || [ $UNINSTALL = 1 ] || die 2 "--purge only goes with --uninstall"
[ $UNINSTALL = 0 ] || { [ $WITH_RUNNER = 0 ] && [ $ENABLE = 0 ]; } ||
    die 2 "--uninstall does not take --with-runner or --enable"

# -- preconditions: checked before anything is written ------------------------------------------------------
[ $DRY = 1 ] || [ "$(id -u)" = 0 ] || die 3 "must run as root (uid $(id -u)); run: sudo $0 $ARGS"

OS_ID=unknown OS_VER=
if [ -r /etc/os-release ]; then
    # shellcheck disable=SC1091
    OS_ID=$(. /etc/os-release && echo "${ID:-unknown}") OS_VER=$(. /etc/os-release && echo "${VERSION_ID:-}")
fi
supported() {  # Debian testing and unstable have no VERSION_ID
    case $OS_ID in
        debian) [ -z "$OS_VER" ] || [ "${OS_VER%%.*}" -ge 12 ] ;;
        ubuntu) [ "${OS_VER%%.*}" -ge 24 ] ;;
        *) false ;;
    esac
}
supported 2>/dev/null || die 4 "unsupported distribution '$OS_ID ${OS_VER:-?}' (/etc/os-release): bladed needs\
 Debian >= 12 or Ubuntu >= 24.04 (Python >= 3.11 and liburing from the distribution)"

for f in pyproject.toml cffi_build/build_uring.py systemd/bladed.service systemd/bladed.sysusers etc/bladed.toml \
    udev/60-bladed.rules; do
    [ -f "$SRC/$f" ] || die 7 "$SRC is not a bladed checkout (no $f); run the tools/install.sh of one"
done
if [ -e "$PREFIX" ] && [ ! -f "$STAMP" ] && [ -n "$(ls -A "$PREFIX" 2>/dev/null)" ]; then
    die 7 "$PREFIX exists and was not made by install.sh (no $STAMP): move it away and run install.sh again"
fi

CHANGED=0
# act DESCRIPTION COMMAND...: the one way anything is changed; --dry-run only prints
act() {
    local what=$1
    shift
    CHANGED=$((CHANGED + 1))
    if [ $DRY = 1 ]; then
        say "would $what"
    else
        say "$what"
        "$@"
    fi
}
ok() { say "ok: $*"; }
systemd_running() { [ -d /run/systemd/system ]; }  # sd_booted(3); false in a chroot
TMP=
cleanup() { [ -z "$TMP" ] || rm -rf "$TMP"; }
trap cleanup EXIT

# -- install steps ------------------------------------------------------------------------------------------
apt_packages() {
    local p missing=()
    for p in "${APT_RUNTIME[@]}" "${APT_BUILD[@]}"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
    done
    if [ ${#missing[@]} = 0 ]; then
        ok "Debian packages installed: ${APT_RUNTIME[*]} ${APT_BUILD[*]}"
    else
        act "install Debian packages: ${missing[*]}" apt_install "${missing[@]}"
    fi
}

apt_install() {
    local log
    log=$(mktemp)
    export DEBIAN_FRONTEND=noninteractive
    # apt-get update exits 0 when it could fetch nothing but has old lists: its Err:/W: lines tell
    if ! apt-get update -q >"$log" 2>&1 || grep -qE '^(Err:|E:|W: Failed to fetch|W: Some index files)' "$log"; then
        grep -E '^(Err|E|W):' "$log" | head -n 5 >&2
        rm -f "$log"
        die 5 "apt-get update could not download the package lists (no network to the archive?): check the\
 network, a proxy and /etc/apt/sources.list, then run install.sh again"
    fi
    if ! apt-get install -y -q --no-install-recommends "$@" >"$log" 2>&1; then
        grep -E '^(E|W):' "$log" | head -n 5 >&2
        rm -f "$log"
        local hint=
        # python3-venv is in universe there
        [ "$OS_ID" != ubuntu ] || hint=" (Ubuntu: the universe component must be enabled)"
        die 5 "apt-get install $* failed (the apt errors are above): check /etc/apt/sources.list$hint and the\
 network, then run install.sh again"
    fi
    rm -f "$log"
}

system_user() {
    install_file "$SRC/systemd/bladed.sysusers" "$SYSUSERS" replace
    if getent passwd bladed >/dev/null && getent group bladed >/dev/null; then
        ok "user and group bladed exist"
    else
        act "create the system user and group bladed (systemd-sysusers $SYSUSERS)" systemd-sysusers "$SYSUSERS"
    fi
}

# the files pip builds from, copied out so that the checkout gets no build/ or *.egg-info (and may be read-only)
stage_sources() {
    TMP=$(mktemp -d)
    mkdir "$TMP/src"
    tar -C "$SRC" -cf - --exclude=__pycache__ --exclude='*.so' --exclude='*.pyc' --exclude=bladed/_uring.c \
        pyproject.toml setup.py README.md cffi_build bladed | tar -C "$TMP/src" -xf -
}

# what the stamp records: a digest of the sources, and whether the runner extras are in
wanted_stamp() {
    local sum
    sum=$(cd "$TMP/src" && find . -type f -print0 | LC_ALL=C sort -z | xargs -0 sha256sum | sha256sum | cut -c1-64)
    printf 'sources=%s\nrunner=%s\n' "$sum" "$1"
}

venv_usable() { [ -x "$PREFIX/bin/python" ] && "$PREFIX/bin/python" -c '' 2>/dev/null; }
runner_installed() { grep -qx 'runner=1' "$STAMP" 2>/dev/null; }

python_venv() {
    local runner=$WITH_RUNNER have='' want
    [ ! -f "$STAMP" ] || have=$(cat "$STAMP")
    # once in, the runner extras stay: a later run without --with-runner does not take them out
    ! runner_installed || runner=1
    stage_sources
    want=$(wanted_stamp $runner)
    if [ "$have" = "$want" ] && venv_usable && "$PREFIX/bin/bladed" --version >/dev/null 2>&1; then
        ok "$("$PREFIX/bin/bladed" --version) in $PREFIX, the same sources as $SRC"
        return
    fi
    if ! venv_usable; then
        # absent, or its python is gone (a distribution upgrade): make it (again)
        act "create the virtual environment $PREFIX" make_venv
    fi
    local pip=("$PREFIX/bin/python" -m pip install --no-input --disable-pip-version-check -q --use-pep517)
    if [ $runner = 1 ]; then
        local idx=()
        [ -z "$TORCH_INDEX" ] || idx=(--index-url "$TORCH_INDEX")
        act "install $TORCH_PIN into $PREFIX${TORCH_INDEX:+ from $TORCH_INDEX}" \
            pip_or_die "${pip[@]}" "${idx[@]}" "$TORCH_PIN"
        act "install bladed with the torch and hf extras into $PREFIX (builds the cffi extension)" \
            pip_or_die "${pip[@]}" "$TMP/src[torch,hf]"
    else
        act "install bladed into $PREFIX (builds the cffi extension)" pip_or_die "${pip[@]}" "$TMP/src"
    fi
    act "record the installed sources in $STAMP" write_file "$STAMP" "$want"
}

# the stamp marks the venv as install.sh's from the start, so that a run after a failed pip retries in it
make_venv() { python3 -m venv --clear "$PREFIX" && write_file "$STAMP" "sources=none"; }

pip_or_die() {
    "$@" || die 6 "pip could not install into $PREFIX (its output is above; PyPI must be reachable, or an index\
 configured in /etc/pip.conf), then run install.sh again"
}

write_file() { printf '%s\n' "$2" >"$1"; }

# install_file SRC DST keep|replace: keep = an existing DST is the admin's and is never touched
install_file() {
    local src=$1 dst=$2 policy=$3
    if [ ! -e "$dst" ]; then
        act "install $dst" install -D -m 0644 "$src" "$dst"
    elif cmp -s "$src" "$dst"; then
        ok "$dst is up to date"
    elif [ "$policy" = keep ]; then
        ok "$dst differs from ${src#"$SRC"/}: kept (yours)"
    else
        act "replace $dst with ${src#"$SRC"/}" install -m 0644 "$src" "$dst"
    fi
}

unit_file() {
    install_file "$SRC/systemd/bladed.service" "$UNIT" replace
    # a unit in /etc (the manual install of earlier docs) would hide this one
    [ ! -f /etc/systemd/system/bladed.service ] ||
        say "warning: /etc/systemd/system/bladed.service overrides $UNIT; remove it unless you mean it"
}

symlinks() {
    local c link target cmds=(bladectl bladed)
    if runner_installed || { [ $DRY = 1 ] && [ $WITH_RUNNER = 1 ]; }; then
        cmds+=(bladed-runner)
    fi
    for c in "${cmds[@]}"; do
        link=$BIN_DIR/$c target=$PREFIX/bin/$c
        if [ "$(readlink "$link" 2>/dev/null)" = "$target" ]; then
            ok "$link -> $target"
        elif [ -e "$link" ] || [ -L "$link" ]; then
            act "replace $link (an earlier install's) with a symlink to $target" ln -sfn "$target" "$link"
        else
            act "link $link -> $target" ln -s "$target" "$link"
        fi
    done
}

systemd_reload() {
    if systemd_running; then
        act "systemctl daemon-reload" systemctl daemon-reload
        act "udevadm control --reload" udevadm control --reload
    fi
}

enable_service() {
    if systemd_running; then
        if systemctl is-enabled --quiet bladed.service && systemctl is-active --quiet bladed.service; then
            ok "bladed.service is enabled and running"
        else
            act "systemctl enable --now bladed.service" systemctl enable --now bladed.service
        fi
    elif systemctl is-enabled --quiet bladed.service 2>/dev/null; then
        ok "bladed.service is enabled (systemd is not running here: not started)"
    else
        act "systemctl enable bladed.service (systemd is not running here: not started)" \
            systemctl --quiet enable bladed.service
    fi
}

next_steps() {
    cat <<EOF

Next steps (docs/operations.md):
  1. choose the storage: as shipped, $CONF_DIR/bladed.toml keeps a 1 GiB store file in $STATE_DIR;
     for an NVMe namespace: bladectl ns list; bladectl ns setup /dev/ngXnY -o $CONF_DIR/bladed.toml --force,
     its serial in $UDEV_RULE, and systemd/dropins/nvme-device.conf in /etc/systemd/system/bladed.service.d/
  2. start bladed now and at boot: systemctl enable --now bladed (or run install.sh --enable);
     systemctl status bladed shows the result of its configuration check (ExecStartPre)
EOF
}

summary() {
    if [ $CHANGED = 0 ]; then
        say "nothing to do: $1"
    elif [ $DRY = 1 ]; then
        say "dry run: the $CHANGED change(s) above were not made"
    else
        say "done: $CHANGED change(s)"
    fi
}

do_install() {
    apt_packages
    system_user
    python_venv
    install_file "$SRC/etc/bladed.toml" "$CONF_DIR/bladed.toml" keep
    install_file "$SRC/udev/60-bladed.rules" "$UDEV_RULE" keep
    unit_file
    symlinks
    [ $CHANGED = 0 ] || systemd_reload
    [ $ENABLE = 0 ] || enable_service
    if [ $CHANGED != 0 ] && [ $DRY = 0 ] && [ $ENABLE = 0 ] && systemd_running &&
        systemctl is-active --quiet bladed.service; then
        say "note: bladed.service runs what was installed before; restart it: systemctl restart bladed"
    fi
    summary "bladed is installed and up to date"
    [ $ENABLE = 1 ] || [ $DRY = 1 ] || [ $CHANGED = 0 ] || next_steps
}

# -- uninstall ----------------------------------------------------------------------------------------------
remove() {  # remove PATH [WHAT]: a file, symlink or directory, if there
    if [ -e "$1" ] || [ -L "$1" ]; then
        act "remove $1${2:+ ($2)}" rm -rf -- "$1"
    fi
}

do_uninstall() {
    if systemd_running && systemctl is-active --quiet bladed.service; then
        act "systemctl stop bladed.service" systemctl stop bladed.service
    fi
    if systemctl is-enabled --quiet bladed.service 2>/dev/null; then
        act "systemctl disable bladed.service" systemctl --quiet disable bladed.service
    fi
    local c
    for c in bladectl bladed bladed-runner; do
        [ "$(readlink "$BIN_DIR/$c" 2>/dev/null)" != "$PREFIX/bin/$c" ] || remove "$BIN_DIR/$c"
    done
    remove "$UNIT"
    remove "$SYSUSERS"
    if [ $PURGE = 1 ] || cmp -s "$SRC/udev/60-bladed.rules" "$UDEV_RULE"; then
        remove "$UDEV_RULE"
    elif [ -e "$UDEV_RULE" ]; then
        ok "$UDEV_RULE differs from udev/60-bladed.rules: kept (yours; --purge removes it)"
    fi
    [ ! -f "$STAMP" ] || remove "$PREFIX" "the virtual environment"
    if [ $PURGE = 1 ]; then
        remove "$CONF_DIR" "the configuration"
        remove "$STATE_DIR" "the state: journal, store file, page-cache files"
        if getent passwd bladed >/dev/null; then
            act "delete the user bladed" userdel bladed
        fi
        # userdel takes the group along where USERGROUPS_ENAB is on (Debian's default)
        if getent group bladed >/dev/null; then
            act "delete the group bladed" groupdel bladed
        fi
    fi
    [ $CHANGED = 0 ] || systemd_reload
    summary "bladed is not installed"
    [ $PURGE = 1 ] || say "kept: $CONF_DIR, $STATE_DIR, the user and group bladed (--purge removes them)"
    say "kept: the Debian packages (${APT_RUNTIME[*]} ${APT_BUILD[*]}): apt-get remove what nothing else uses"
}

if [ $UNINSTALL = 1 ]; then
    do_uninstall
else
    do_install
fi
