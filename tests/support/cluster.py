"""The local cluster from hack/cluster: its clients, the images it runs, `hack/cluster` and kubectl, and what a failed
cluster test leaves to read."""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
from kubernetes import client

from tests.support.paths import REPO

CLUSTER = REPO / "hack" / "cluster"
# The images hack/cluster builds and imports into every node; `:dev` always names the checkout's current build.
TRAINER_IMAGE = "ftjob.local/ftjob-trainer:dev"
OPERATOR_IMAGE = "ftjob.local/ftjob-operator:dev"
BASE_IMAGE = "ftjob.local/debian-python:bookworm"  # Debian + python3 (as `python`), runs as root


@dataclass
class Kube:
    """Clients for the cluster under test (one ApiClient shared by the typed APIs)."""

    kubeconfig: Path
    api: client.ApiClient
    core: client.CoreV1Api
    apps: client.AppsV1Api
    rbac: client.RbacAuthorizationV1Api
    custom: client.CustomObjectsApi


def state_dir() -> Path:
    return Path(os.environ.get("FTJOB_CLUSTER_DIR") or Path.home() / ".local/state/ftjob/cluster")


def node_names() -> list[str]:
    """The Node names of the cluster in state_dir(), from the settings `hack/cluster up` recorded."""
    import json

    settings = json.loads((state_dir() / "cluster.json").read_text())
    return [f"{settings['netns_prefix']}-node-{n}" for n in range(1, settings["nodes"] + 1)]


def container_pids(pod: client.V1Pod) -> list[int]:
    """The processes of a running pod's containers (not its sandbox), found by the cgroups its node's kubelet made
    (cgroupfs driver: <node>/kubepods/<qos>/pod<uid>/<container id>)."""
    ids = {s.container_id.rpartition("//")[2] for s in pod.status.container_statuses or [] if s.container_id}
    pids: list[int] = []
    for procs in Path("/sys/fs/cgroup/pids", pod.spec.node_name).glob(f"**/pod{pod.metadata.uid}/*/cgroup.procs"):
        if procs.parent.name in ids:
            pids += [int(p) for p in procs.read_text().split()]
    return pids


def cluster(*args: str, env: dict[str, str] | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run `hack/cluster ARGS`; on failure the assertion shows its output."""
    proc = subprocess.run([str(CLUSTER), *args], capture_output=True, text=True, env=env)
    if check and proc.returncode != 0:
        raise AssertionError(f"hack/cluster {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def kubectl(kubeconfig: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run the venv's kubectl against `kubeconfig`."""
    from sys import executable

    kubectl_bin = Path(executable).parent / "kubectl"
    proc = subprocess.run(
        [str(kubectl_bin), f"--kubeconfig={kubeconfig}", *args], capture_output=True, text=True, timeout=120
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"kubectl {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


FAILED = pytest.StashKey[bool]()  # set by conftest's makereport hook when a test's call phase fails


def failed(request: pytest.FixtureRequest) -> bool:
    """Whether the test using this fixture failed (meaningful at the fixture's teardown)."""
    return request.node.stash.get(FAILED, False)


def print_pod_logs(core: client.CoreV1Api, namespace: str, tail_lines: int = 60) -> None:
    """The tail of every container's log in ``namespace`` (and of its previous run, if it restarted): what a
    failed cluster test leaves to read, since the namespace is deleted after it."""
    try:
        pods = core.list_namespaced_pod(namespace).items
    except client.ApiException as e:
        print(f"\n[pod logs] cannot list the pods of {namespace}: {e.reason}")
        return
    for pod in pods:
        for status in pod.status.container_statuses or []:
            runs = [False, True] if status.restart_count else [False]
            for previous in runs:
                try:
                    text = core.read_namespaced_pod_log(pod.metadata.name, namespace, container=status.name,
                                                        tail_lines=tail_lines, previous=previous)  # fmt: skip
                except client.ApiException as e:
                    text = f"(no log: {e.reason})"
                which = " (previous run)" if previous else ""
                print(f"\n----- {pod.metadata.name}/{status.name}{which}: last {tail_lines} lines -----\n{text}")
