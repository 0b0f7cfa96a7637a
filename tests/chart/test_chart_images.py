"""The Dockerfiles (no engine here to build them) keep their promises: non-root numeric USER, the right entrypoint,
the operator image without torch, the trainer image with the trainer extra, a base pinned by version."""

from __future__ import annotations

import re

import pytest
from helpers import REPO

IMAGES = REPO / "hack" / "images"


def instructions(name: str) -> list[tuple[str, str]]:
    text = (IMAGES / name).read_text().replace("\\\n", " ")
    return [(m.group(1).upper(), m.group(2).strip()) for m in re.finditer(r"^(\w+)\s+(.*)$", text, re.M)]


@pytest.mark.parametrize(
    ("name", "entrypoint", "install"),
    [("operator.Dockerfile", "ftjob-operator", r"pip install --no-cache-dir \.$"),
     ("trainer.Dockerfile", "ftjob-trainer", r'pip install --no-cache-dir "\.\[trainer\]"$')],
)  # fmt: skip
def test_dockerfile(name: str, entrypoint: str, install: str) -> None:
    ins = instructions(name)
    users = [v for k, v in ins if k == "USER"]
    assert users and re.fullmatch(r"[1-9]\d*:[1-9]\d*", users[-1]), (
        f"the final USER must be a non-root uid:gid: {users}"
    )
    assert ("ENTRYPOINT", f'["{entrypoint}"]') in ins
    runs = " ".join(v for k, v in ins if k == "RUN")
    assert re.search(install, runs.split("&&")[-1].strip()), runs
    assert "torch" not in runs, "torch comes only through the trainer extra"
    base = next(v for k, v in ins if k == "ARG" and v.startswith("PYTHON_IMAGE="))
    assert re.fullmatch(r"PYTHON_IMAGE=python:3\.11\.\d+-slim-\w+", base), base
    assert "@sha256:<digest>" in (IMAGES / name).read_text(), "the digest pin must be documented next to the base"
    # The chart's default runAsUser is the image's user, so runAsNonRoot holds without an override.
    values = (REPO / "charts/ftjob-operator/values.yaml").read_text()
    if entrypoint == "ftjob-operator":
        assert f"runAsUser: {users[-1].split(':')[0]}" in values
