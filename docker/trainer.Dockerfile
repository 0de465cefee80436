# Trainer node (GPU): Megatron-core with Transformer Engine and the IsoExec trainer side.
#   docker build -f docker/trainer.Dockerfile -t isoexec-trainer .
FROM nvcr.io/nvidia/pytorch:25.09-py3

ENV PYTHONUNBUFFERED=1
WORKDIR /src
COPY packages/isoexec-contract packages/isoexec-contract
COPY packages/isoexec-megatron packages/isoexec-megatron
# The `te` extra adds transformer-engine[pytorch] and triton; never vLLM.
RUN pip install --no-cache-dir ./packages/isoexec-contract "./packages/isoexec-megatron[te]"

# The one switch: build_model() reads it when `isoexec` is not passed (README, Options).
ENV ISOEXEC=1
CMD ["python", "-c", "import isoexec.megatron; print('isoexec-megatron trainer image ready')"]
