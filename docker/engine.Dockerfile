# Engine node (GPU): vLLM with the IsoExec plugin, in the shared base environment
# (docker/base.Dockerfile), so its torch and Triton are the trainer's.
#   docker build -f docker/base.Dockerfile -t isoexec-base .
#   docker build -f docker/engine.Dockerfile -t isoexec-engine .
ARG BASE=isoexec-base
FROM ${BASE}

# IsoExec is on in this image; unset it (ISOEXEC=0) to run stock vLLM.
ENV ISOEXEC=1
CMD ["python", "-c", "import isoexec.vllm.plugin; print('isoexec-vllm engine image ready')"]
