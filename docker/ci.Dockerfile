# The GPU CI image: both sides plus the test tools, for the H100 integration pipeline.
#   docker build -f docker/ci.Dockerfile -t isoexec-ci .
FROM nvcr.io/nvidia/pytorch:25.09-py3

ENV PYTHONUNBUFFERED=1
WORKDIR /src
COPY . .
RUN pip install --no-cache-dir ./packages/isoexec-contract "./packages/isoexec-vllm[cuda]" \
    "./packages/isoexec-megatron[te]" pytest pytest-timeout hypothesis transformers safetensors
CMD ["python", "-m", "pytest", "-m", "gpu", "tests", "integration"]
