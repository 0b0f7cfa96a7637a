"""Fixtures of the operator's cluster tests: the CRD installed, and `ftjob-operator` subprocesses per test."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.support.cluster import Kube, cluster, failed, kubectl, node_names
from tests.support.operator_cluster import CRD, OperatorProc, node_ready, set_unschedulable, start_operator
from tests.support.polling import wait_for
from tests.support.trainer_runs import RECORDS_ROOT, run_summary


@pytest.fixture(scope="session")
def crd(kube) -> str:
    """The CRD applied (kept up to date with the checkout) and Established."""
    kubectl(kube.kubeconfig, "apply", "-f", str(CRD))
    name = "faulttoleranttrainingjobs.ftjob.dev"

    def established() -> bool:
        out = kubectl(kube.kubeconfig, "get", "crd", name, "-o",
                      "jsonpath={.status.conditions[?(@.type=='Established')].status}")  # fmt: skip
        return out.stdout.strip() == "True"

    wait_for(established, 60, "the CRD to be Established")
    return name


@pytest.fixture
def operators(kube, crd, namespace, tmp_path) -> Iterator[Callable[..., OperatorProc]]:
    """start(*extra_args) -> a running operator watching the test namespace; all are stopped afterwards.
    On failure their logs are printed (the captured output pytest shows)."""
    started: list[OperatorProc] = []

    def start(*args: str, leader_election: bool = False) -> OperatorProc:
        flags = ["--namespace", namespace]
        if not leader_election:
            flags.append("--no-leader-election")
        log = tmp_path / f"operator-{len(started)}.log"
        op = start_operator(kube.kubeconfig, log, *flags, *args)
        started.append(op)
        return op

    try:
        yield start
    finally:
        for op in started:
            op.stop()
        for i, op in enumerate(started):
            print(f"\n----- operator {i} log (tail) -----\n{op.logs()[-6000:]}")


@pytest.fixture
def two_nodes(kube: Kube) -> Iterator[tuple[str, str]]:
    """Two nodes, given back healed, schedulable and Ready whatever the test did to them."""
    names = node_names()
    assert len(names) >= 2, f"this test needs a cluster of at least 2 nodes, this one has {names}"
    yield names[0], names[1]
    for node in names:
        cluster("heal-node", node)
        set_unschedulable(kube.core, node, False)
    cluster("up")
    for node in names:
        wait_for(lambda n=node: node_ready(kube.core, n), 60, f"{node} to be Ready again")


@pytest.fixture
def records(namespace: str, request: pytest.FixtureRequest) -> Iterator[Path]:
    """A host folder for the trainers' run records (hostPath: every node of the local cluster shares the host's
    /var/tmp). World-writable: the trainer image runs as a non-root user."""
    path = RECORDS_ROOT / namespace
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(0o777)
    yield path
    if failed(request):  # kept, with a summary in the test's output: the evidence of what went wrong
        print(f"\n----- run records (kept in {path}) -----\n{run_summary(path)}")
    else:
        shutil.rmtree(path, ignore_errors=True)
