"""Helpers every test may use: polling with a deadline (never bare sleeps) and calling the cluster tools."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import pytest
from kubernetes import client

REPO = Path(__file__).resolve().parents[1]
CLUSTER = REPO / "hack" / "cluster"
# The images hack/cluster builds and imports into every node; `:dev` always names the checkout's current build.
TRAINER_IMAGE = "ftjob.local/ftjob-trainer:dev"
OPERATOR_IMAGE = "ftjob.local/ftjob-operator:dev"
BASE_IMAGE = "ftjob.local/debian-python:bookworm"  # Debian + python3 (as `python`), runs as root

T = TypeVar("T")


@dataclass
class Kube:
    """Clients for the cluster under test (one ApiClient shared by the typed APIs)."""

    kubeconfig: Path
    api: client.ApiClient
    core: client.CoreV1Api
    apps: client.AppsV1Api
    rbac: client.RbacAuthorizationV1Api
    custom: client.CustomObjectsApi


def free_port() -> int:
    """A free loopback port for a process to bind later, chosen below the kernel's ephemeral range (32768 up), so the
    many connections a test opens meanwhile cannot take it (binding port 0 would pick from that range)."""
    for _ in range(1000):
        port = random.randint(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port between 20000 and 32000")


def wait_for(
    predicate: Callable[[], T],
    timeout: float,
    what: str,
    interval: float = 0.2,
    describe: Callable[[], object] | None = None,
) -> T:
    """Poll `predicate` until it returns something truthy and return that; fail after `timeout` seconds.

    An exception inside the predicate counts as "not yet" (the API may be briefly unavailable); the last value or
    exception is reported in the failure so it says what was seen instead of what was wanted; `describe`, if
    given, adds more of the state (e.g. pod phases and events) to that message.
    """
    deadline = time.monotonic() + timeout
    last: object = None
    while True:
        try:
            value = predicate()
            if value:
                return value
            last = value
        except Exception as e:  # a transient API error is a "not yet", never a pass
            last = e
        if time.monotonic() >= deadline:
            context = ""
            if describe is not None:
                try:
                    context = f"; state: {describe()}"
                except Exception as e:
                    context = f"; describing the state failed: {e!r}"
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}; last seen: {last!r}{context}")
        time.sleep(interval)  # the poll interval of a deadline loop, not synchronisation


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
