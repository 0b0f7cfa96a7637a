# The ftjob trainer image: `ftjob[trainer]` (torch, the lighthouse, the gradient manager, the reference trainer),
# run as a non-root user. Build from the repository root:
#   docker build -f hack/images/trainer.Dockerfile -t ftjob-trainer:0.1.0 .
# For GPUs build FROM a CUDA runtime base with Python 3.11 and point pip at the torch wheel flavour that matches its
# CUDA version (PIP_INDEX_URL / PIP_EXTRA_INDEX_URL build args); the default is whatever torch the index serves.
#
# Pin the base for releases by version AND digest, e.g.
#   python:3.11.11-slim-bookworm@sha256:<digest>   (resolve with `docker buildx imagetools inspect python:3.11.11-slim-bookworm`)
ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
WORKDIR /src
COPY pyproject.toml README.md ./
COPY operator/ operator/
COPY trainer/ trainer/
RUN python -m venv /opt/ftjob \
 && /opt/ftjob/bin/pip install --no-cache-dir --upgrade pip \
 && /opt/ftjob/bin/pip install --no-cache-dir ".[trainer]"

FROM ${PYTHON_IMAGE}
COPY --from=build /opt/ftjob /opt/ftjob
ENV PATH=/opt/ftjob/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    MPLCONFIGDIR=/tmp/matplotlib
USER 65532:65532
# lighthouse API, group rendezvous, recovery server, cross-group store (trainer/contract.py)
EXPOSE 29510 29500 29520 29530
ENTRYPOINT ["ftjob-trainer"]
