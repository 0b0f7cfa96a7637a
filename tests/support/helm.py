"""Running helm and kubectl on the chart for the chart tests (real binaries against the real local apiserver)."""

from __future__ import annotations

import subprocess
import uuid
from functools import cache
from pathlib import Path

import yaml

from tests.support.cluster import CLUSTER
from tests.support.paths import REPO

CHART = REPO / "charts" / "ftjob-operator"


@cache
def tool_path() -> str:
    """PATH with the cluster's helm and the venv's kubectl first, as `hack/cluster env` prints it."""
    out = subprocess.run([str(CLUSTER), "env"], capture_output=True, text=True, check=True).stdout
    for line in out.splitlines():
        if line.startswith("export PATH="):
            return line.removeprefix("export PATH=").replace("$PATH", "/usr/local/bin:/usr/bin:/bin")
    raise AssertionError(f"`hack/cluster env` printed no PATH line:\n{out}")


def run(args: list[str], kubeconfig: Path | None = None, stdin: str | None = None, timeout: float = 300):
    """Run helm/kubectl with the cluster's tools on PATH; returns the CompletedProcess (never raises on rc)."""
    env = {"PATH": tool_path(), "HOME": str(Path.home())}
    if kubeconfig is not None:
        env["KUBECONFIG"] = str(kubeconfig)
    return subprocess.run(args, capture_output=True, text=True, input=stdin, env=env, timeout=timeout)


def ok(args: list[str], kubeconfig: Path | None = None, stdin: str | None = None, timeout: float = 300) -> str:
    """Run and require exit 0; the failure message carries the command's output."""
    proc = run(args, kubeconfig, stdin, timeout)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc.stdout


def set_args(values: dict[str, str] | None) -> list[str]:
    return [a for k, v in (values or {}).items() for a in ("--set", f"{k}={v}")]


def render(release: str, namespace: str, values: dict[str, str] | None = None) -> list[dict]:
    """`helm template` the chart (CRDs included) into a list of objects."""
    out = ok(["helm", "template", release, str(CHART), "-n", namespace, "--include-crds", *set_args(values)])
    return [d for d in yaml.safe_load_all(out) if d]


def release_name() -> str:
    return f"ftjt-{uuid.uuid4().hex[:6]}"


def service_account(release: str) -> str:
    """The ServiceAccount the chart creates (its fullname) for a release name without 'ftjob-operator' in it."""
    return f"{release}-ftjob-operator"
