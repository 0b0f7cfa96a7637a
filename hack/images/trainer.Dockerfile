# The ftjob trainer image: `ftjob[trainer]` (torch, the lighthouse, the gradient manager, the reference trainer),
# run as a non-root user. Build from the repository root:
#   docker build -f hack/images/trainer.Dockerfile -t ftjob-trainer:0.1.0 .
# (hack/cluster builds it with buildah on a Debian base it makes itself: PYTHON_IMAGE=ftjob.local/debian-python.)
# For GPUs build FROM a CUDA runtime base with Python 3.11 and point pip at the torch wheel flavour that matches its
# CUDA version (PIP_INDEX_URL / PIP_EXTRA_INDEX_URL build args); the default is whatever torch the index serves.
#
# Pin the base for releases by version AND digest, e.g.
#   python:3.11.11-slim-bookworm@sha256:<digest>   (resolve with `docker buildx imagetools inspect python:3.11.11-slim-bookworm`)
ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm
FROM ${PYTHON_IMAGE}
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ARG PIP_CERT
WORKDIR /src
# The dependencies (torch is GBs) first, in a layer that changes only with pyproject.toml.
COPY pyproject.toml ./
RUN --mount=type=cache,target=/root/.cache/pip \
    [ -n "${PIP_CERT:-}" ] || unset PIP_CERT; \
    python -m venv /opt/ftjob \
 && /opt/ftjob/bin/pip install --upgrade pip setuptools wheel \
 && python -c 'import tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]; print("\n".join(p["dependencies"] + p["optional-dependencies"]["trainer"]))' >/tmp/requirements.txt \
 && /opt/ftjob/bin/pip install -r /tmp/requirements.txt
COPY README.md ./
COPY operator/ operator/
COPY trainer/ trainer/
RUN [ -n "${PIP_CERT:-}" ] || unset PIP_CERT; \
    /opt/ftjob/bin/pip install --no-cache-dir --no-deps --no-build-isolation . && rm -rf /src /tmp/requirements.txt
# The example loops, for examples/k8s/*.yaml (your own image copies your own script instead)
COPY examples/ /opt/ftjob/examples/
WORKDIR /
ENV PATH=/opt/ftjob/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    MPLCONFIGDIR=/tmp/matplotlib
USER 65532:65532
# lighthouse API, group rendezvous, recovery server, cross-group store (the contract's ports)
EXPOSE 29510 29500 29520 29530
ENTRYPOINT ["ftjob-trainer"]
