"""Manifests and small helpers shared by the node agent's pod-behaviour tests."""

from __future__ import annotations

import sys
from pathlib import Path

from helpers import kubectl, wait_for
from kubernetes import client

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "hack" / "nodeagent"))

IMAGE = "python:3.11"  # never pulled: the node agent runs `command` with the venv's python


def pod(name: str, script: str, *, restart: str = "Never", labels: dict | None = None, **spec: object) -> dict:
    container = {"name": "main", "image": IMAGE, "command": ["python", "-c", script]}
    container.update(spec.pop("container", {}))  # type: ignore[arg-type]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels or {"app": name}},
        "spec": {"restartPolicy": restart, "terminationGracePeriodSeconds": 5, "containers": [container], **spec},
    }


def phase(core: client.CoreV1Api, ns: str, name: str) -> str:
    return core.read_namespaced_pod(name, ns).status.phase


def wait_phase(core: client.CoreV1Api, ns: str, name: str, want: str, timeout: float = 60) -> client.V1Pod:
    def check() -> client.V1Pod | None:
        p = core.read_namespaced_pod(name, ns)
        if p.status.phase in ("Succeeded", "Failed") and p.status.phase != want:
            raise AssertionError(f"pod {name} ended {p.status.phase}, wanted {want}: {p.status}")
        return p if p.status.phase == want else None

    return wait_for(check, timeout, f"pod {ns}/{name} to be {want}")


def logs(kubeconfig: Path, ns: str, name: str, *extra: str) -> str:
    return kubectl(kubeconfig, "-n", ns, "logs", name, *extra).stdout


def wait_log(kubeconfig: Path, ns: str, name: str, text: str, timeout: float = 60) -> str:
    return wait_for(
        lambda: (out := kubectl(kubeconfig, "-n", ns, "logs", name, check=False).stdout) and text in out and out,
        timeout,
        f"{text!r} in the logs of {ns}/{name}",
    )
