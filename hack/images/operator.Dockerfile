# The ftjob operator image: `ftjob` without torch (the operator never imports it), run as a non-root user.
# Build from the repository root:  docker build -f hack/images/operator.Dockerfile -t ftjob-operator:0.1.0 .
# (hack/cluster builds it with buildah on a Debian base it makes itself: PYTHON_IMAGE=ftjob.local/debian-python.)
#
# Pin the base for releases by version AND digest, e.g.
#   python:3.11.11-slim-bookworm@sha256:<digest>   (resolve with `docker buildx imagetools inspect python:3.11.11-slim-bookworm`)
ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm
FROM ${PYTHON_IMAGE}
# Optional: where pip finds packages, and the CA bundle that reaches it (never stored in a layer).
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ARG PIP_CERT
WORKDIR /src
# The dependencies first, in a layer that changes only with pyproject.toml: a code change rebuilds seconds, not minutes.
COPY pyproject.toml ./
RUN --mount=type=cache,target=/root/.cache/pip \
    [ -n "${PIP_CERT:-}" ] || unset PIP_CERT; \
    python -m venv /opt/ftjob \
 && /opt/ftjob/bin/pip install --upgrade pip setuptools wheel \
 && python -c 'import tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]; print("\n".join(p["dependencies"]))' >/tmp/requirements.txt \
 && /opt/ftjob/bin/pip install -r /tmp/requirements.txt
COPY README.md ./
COPY operator/ operator/
COPY trainer/ trainer/
RUN [ -n "${PIP_CERT:-}" ] || unset PIP_CERT; \
    /opt/ftjob/bin/pip install --no-cache-dir --no-deps --no-build-isolation . && rm -rf /src /tmp/requirements.txt
WORKDIR /
ENV PATH=/opt/ftjob/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
# Numeric so `runAsNonRoot` can verify it without a passwd lookup; matches the chart's runAsUser default.
USER 65532:65532
EXPOSE 8080 8081
ENTRYPOINT ["ftjob-operator"]
