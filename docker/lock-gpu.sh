#!/usr/bin/env bash
# Regenerate docker/gpu-requirements.txt, the GPU environment's lock, from uv.lock and
# docker/gpu-requirements.in. Run from anywhere, with network access to PyPI:
#     bash docker/lock-gpu.sh
#
# Why a second lock: uv.lock resolves one torch for every fork, 2.13.0+cpu from /opt/wheels
# (find-links), so `uv sync --extra cuda` would install vllm 0.32.0 beside a CPU torch. vllm
# 0.32.0 pins torch==2.13.0, whose PyPI build for linux x86_64 is CUDA 13.0 and pins
# triton==3.7.1 and the CUDA 13.0 runtime wheels, which uv.lock cannot hold beside the CPU pins
# without re-resolving them. So: every package uv.lock pins for the cuda/te extras keeps its
# uv.lock version (constraints); torch, triton and the two CUDA runtime wheels torch pins are
# resolved here (they are the only deviations; tests/foundation/test_docker_gpu.py checks it).
set -euo pipefail
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# uv.lock's cuda fork, as pins. The CPU fork's setuptools (an older second pin) is dropped:
# keep the last pin of each name.
uv export --frozen --all-packages --no-hashes --no-emit-workspace --no-annotate --no-header \
    --extra cuda --extra te --extra triton --extra report --group dev -o "$tmp/all.txt" >/dev/null
grep -v -E '^(torch|triton|nvidia-cuda-nvrtc|nvidia-cuda-runtime)==' "$tmp/all.txt" \
    | awk -F'==' '{last[$1] = $0; order[$1] = NR} END {for (n in last) print order[n], last[n]}' \
    | sort -n | cut -d' ' -f2- > "$tmp/constraints.txt"
# The same overrides as pyproject.toml's (no torchvision/torchaudio/torchcodec).
printf '%s\n' 'torchvision; sys_platform == "never"' 'torchaudio; sys_platform == "never"' \
    'torchcodec; sys_platform == "never"' > "$tmp/overrides.txt"

# --no-config: pyproject's find-links (/opt/wheels) would put torch 2.13.0+cpu back.
uv pip compile --no-config docker/gpu-requirements.in \
    -c "$tmp/constraints.txt" --override "$tmp/overrides.txt" \
    --python-version 3.11 --python-platform x86_64-manylinux_2_28 \
    --generate-hashes --no-emit-package isoexec-contract --no-emit-package isoexec-megatron \
    --no-emit-package isoexec-vllm --no-annotate --custom-compile-command "bash docker/lock-gpu.sh" \
    -o docker/gpu-requirements.txt
