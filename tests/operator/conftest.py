"""Fixtures of the operator's cluster tests: the CRD installed, and `ftjob-operator` subprocesses per test."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # podfactory / opkit importable from any directory

from helpers import kubectl, wait_for
from opkit import CRD, OperatorProc, start_operator


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
