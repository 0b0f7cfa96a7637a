"""Shared fixtures: the real local cluster from hack/cluster (brought up here if it is not running), a fresh
namespace per test, and the kubernetes clients for it (`Kube` lives in tests/support/cluster.py;
re-exported here)."""

from __future__ import annotations

import re
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes import client, config

from tests.support.cluster import CLUSTER, FAILED, Kube, failed, print_pod_logs, state_dir
from tests.support.polling import wait_for

__all__ = ["Kube", "ensure_cluster"]


def ensure_cluster() -> Path:
    """The kubeconfig of a healthy cluster; runs `hack/cluster up` (which repairs a partial one) if needed."""
    if subprocess.run([str(CLUSTER), "status"], capture_output=True).returncode != 0:
        print("\n[conftest] no healthy cluster: running hack/cluster up", flush=True)
        proc = subprocess.run([str(CLUSTER), "up"], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"hack/cluster up failed:\n{proc.stdout}\n{proc.stderr}")
    return state_dir() / "kubeconfig"


@pytest.fixture(scope="session")
def kube() -> Iterator[Kube]:
    kubeconfig = ensure_cluster()
    api = config.new_client_from_config(config_file=str(kubeconfig))
    try:
        yield Kube(
            kubeconfig=kubeconfig,
            api=api,
            core=client.CoreV1Api(api),
            apps=client.AppsV1Api(api),
            rbac=client.RbacAuthorizationV1Api(api),
            custom=client.CustomObjectsApi(api),
        )
    finally:
        api.close()


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """Marks the test failed (item.stash[FAILED]) for fixtures that keep evidence of a failure at teardown."""
    report = yield
    if report.when == "call" and report.failed:
        item.stash[FAILED] = True
    return report


@pytest.fixture
def namespace(kube: Kube, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace named after the test, deleted (with everything in it) afterwards; if the test failed, the
    tail of every pod's log is printed first."""
    stem = re.sub(r"[^a-z0-9-]+", "-", request.node.name.lower()).strip("-")[:40].strip("-")
    name = f"{stem}-{uuid.uuid4().hex[:5]}"
    kube.core.create_namespace(
        client.V1Namespace(metadata=client.V1ObjectMeta(name=name, labels={"ftjob.dev/test": "1"}))
    )
    try:
        # the API refuses pods until the serviceaccount controller has made `default` (its admission retries ~1 s)
        wait_for(lambda: kube.core.read_namespaced_service_account("default", name), 30,
                 f"the `default` ServiceAccount in {name}")  # fmt: skip
        yield name
    finally:
        if failed(request):
            print_pod_logs(kube.core, name)
        try:
            kube.core.delete_namespace(name, propagation_policy="Background")
        except client.ApiException as e:
            if e.status != 404:
                raise
