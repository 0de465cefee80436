# syntax=docker/dockerfile:1
# The one GPU environment both sides run in (docs/gpu.md, "Images"). Build it first, from the
# repository root; the trainer, engine and CI images are FROM it:
#   docker build -f docker/base.Dockerfile -t isoexec-base .
#
# Why one base: a contract records each site's impl and the torch/Triton it ran under, so a
# trainer and an engine can only MATCH when they run the same torch and Triton builds. Both
# sides therefore get this one environment, byte for byte, from one lock.
#
# CUDA 13.0: vllm 0.32.0 pins torch==2.13.0, whose PyPI linux x86_64 wheel is the CUDA 13.0
# build (cuda-toolkit 13.0.x, nvidia-cuda-runtime 13.0.96, cudnn-cu13, nccl-cu13 in its
# metadata), matching vllm's own cu13 wheels (humming-kernels[cu13], nvidia-cutlass-dsl[cu13],
# transformer-engine-cu13). torch and vllm load the CUDA libraries from those wheels; the
# image's toolkit (devel: nvcc, cuDNN headers) builds transformer-engine-torch, an sdist.
ARG CUDA_IMAGE=nvidia/cuda:13.0.1-cudnn-devel-ubuntu24.04
FROM ghcr.io/astral-sh/uv:0.13.9 AS uv
FROM ${CUDA_IMAGE}

# The README's uv, as a static binary; no apt or system Python.
COPY --from=uv /uv /uvx /usr/local/bin/
ENV DEBIAN_FRONTEND=noninteractive PYTHONUNBUFFERED=1 \
    UV_PYTHON_INSTALL_DIR=/opt/python UV_PYTHON_PREFERENCE=only-managed \
    UV_LINK_MODE=copy UV_COMPILE_BYTECODE=1 UV_NO_CACHE=1 \
    VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH
# A C++ toolchain for transformer-engine-torch; git for megatron-core's version lookups.
RUN apt-get update && apt-get install -y --no-install-recommends build-essential git ca-certificates \
    && rm -rf /var/lib/apt/lists/*
# Python 3.11 (the workspace's requires-python, the CPU CI's 3.11.7), installed by uv.
RUN uv python install 3.11.7 && uv venv --python 3.11.7 /opt/venv

WORKDIR /src
COPY docker/gpu-requirements.txt docker/gpu-requirements.txt
# Fail loudly rather than install an unpinned or CPU torch: the lock must pin the CUDA build.
RUN grep -q '^torch==2\.13\.0 ' docker/gpu-requirements.txt \
    && ! grep -q '^torch==.*+cpu' docker/gpu-requirements.txt \
    && grep -q '^triton==' docker/gpu-requirements.txt \
    || { echo "docker/gpu-requirements.txt does not pin the CUDA torch and triton; run docker/lock-gpu.sh" >&2; exit 1; }
# Transformer Engine is optional (WITH_TE=1): no IsoExec check needs it, since an IsoExec model
# never reaches TE and native Megatron runs its local (TE-less) specs. Only users who want
# Megatron's TE layers, or Megatron's batch_invariant_mode patching TE, build it.
#   WITH_TE=0 (default): the lock less every transformer-engine* entry, hash-checked, no
#     resolution (--no-deps): no sdist, no nvcc build.
#   WITH_TE=1: 1) everything but transformer-engine-torch, as above; 2) transformer-engine-torch,
#     built without isolation against the torch just installed, so its extension is compiled
#     for exactly that torch; `uv pip sync` then checks the whole set equals the lock.
ARG WITH_TE=0
ENV NVTE_FRAMEWORK=pytorch NVTE_CUDA_ARCHS=90 MAX_JOBS=8 CUDA_HOME=/usr/local/cuda
RUN if [ "$WITH_TE" = 1 ]; then te='^transformer-engine-torch=='; else te='^transformer-engine'; fi \
    && awk -v te="$te" '$0 ~ te {skip = 1} !skip {print} skip && !/\\$/ {skip = 0}' \
        docker/gpu-requirements.txt > /tmp/stage1.txt \
    && uv pip install --no-deps --require-hashes -r /tmp/stage1.txt \
    && if [ "$WITH_TE" = 1 ]; then uv pip sync --require-hashes --no-build-isolation \
        docker/gpu-requirements.txt; fi \
    && rm /tmp/stage1.txt

# The three workspace packages, without dependencies: everything they need is locked above.
COPY packages packages
RUN uv pip install --no-deps ./packages/isoexec-contract ./packages/isoexec-megatron \
        ./packages/isoexec-vllm

# What the contract will record, checked at build time against the lock.
RUN python - <<'PY'
import re, torch, triton
lock = open("docker/gpu-requirements.txt").read()
want = {n: re.search(rf"^{n}==(\S+)", lock, re.M).group(1) for n in ("torch", "triton")}
assert torch.__version__ == want["torch"], (torch.__version__, want)
assert triton.__version__ == want["triton"], (triton.__version__, want)
assert (torch.version.cuda or "").startswith("13."), torch.version.cuda
print(f"isoexec-base: torch {torch.__version__} (CUDA {torch.version.cuda}), triton {triton.__version__}")
PY
