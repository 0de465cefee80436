#!/usr/bin/env bash
# Fill integration/gpu/wheels/ (git-ignored) with what device_check.py carries to the lent GPU
# machine, which has its own Python 3.12, torch and triton but no Megatron-core and no network.
# Only Megatron-core is missing there (its requirements, torch, numpy and packaging, are in the
# image); the pin is this project's. Needs a package registry and a Python 3.12 with pip (the
# pyenv one here). The folder must stay under the device tool's 64 MiB carry limit.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
py=""
for cand in "${PYTHON312:-}" "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12 python3.12; do
  if [ -n "$cand" ] && "$cand" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
    py="$cand"; break
  fi
done
[ -n "$py" ] || { echo "fetch_wheels: needs a Python 3.12 with pip (set PYTHON312)" >&2; exit 2; }
mkdir -p "$here/wheels"
"$py" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux_2_28_x86_64 --dest "$here/wheels" "megatron-core==0.16.1"
du -sh "$here/wheels"
