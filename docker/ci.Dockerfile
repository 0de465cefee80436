# The GPU CI image: the shared base (both sides and the test tools, docker/base.Dockerfile)
# plus the tests, for the H100/H200 pipeline (ci/gpu-pipeline.yml).
#   docker build -f docker/base.Dockerfile -t isoexec-base .
#   docker build -f docker/ci.Dockerfile -t isoexec-ci .
ARG BASE=isoexec-base
FROM ${BASE}

WORKDIR /src
# .dockerignore keeps .venv, .git, caches and run outputs out.
COPY . .
CMD ["python", "-m", "pytest", "-m", "gpu", "tests", "integration"]
