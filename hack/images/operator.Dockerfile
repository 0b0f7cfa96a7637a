# The ftjob operator image: `ftjob` without torch (the operator never imports it), run as a non-root user.
# Build from the repository root:  docker build -f hack/images/operator.Dockerfile -t ftjob-operator:0.1.0 .
#
# Pin the base for releases by version AND digest, e.g.
#   python:3.11.11-slim-bookworm@sha256:<digest>   (resolve with `docker buildx imagetools inspect python:3.11.11-slim-bookworm`)
ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY operator/ operator/
COPY trainer/ trainer/
# ftjob and its runtime dependencies (no extras: no torch) into a venv the final stage copies whole.
RUN python -m venv /opt/ftjob \
 && /opt/ftjob/bin/pip install --no-cache-dir --upgrade pip \
 && /opt/ftjob/bin/pip install --no-cache-dir .

FROM ${PYTHON_IMAGE}
COPY --from=build /opt/ftjob /opt/ftjob
ENV PATH=/opt/ftjob/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
# Numeric so `runAsNonRoot` can verify it without a passwd lookup; matches the chart's runAsUser default.
USER 65532:65532
EXPOSE 8080 8081
ENTRYPOINT ["ftjob-operator"]
