# Trainer node (GPU): Megatron-core with Transformer Engine and the IsoExec trainer side, in the
# shared base environment (docker/base.Dockerfile), so its torch and Triton are the engine's.
#   docker build -f docker/base.Dockerfile -t isoexec-base .
#   docker build -f docker/trainer.Dockerfile -t isoexec-trainer .
ARG BASE=isoexec-base
FROM ${BASE}

# The one switch: build_model() reads it when `isoexec` is not passed (README, Options).
ENV ISOEXEC=1
CMD ["python", "-c", "import isoexec.megatron; print('isoexec-megatron trainer image ready')"]
