"""Restarting a node agent neither duplicates nor orphans its pods: running processes are adopted."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
from helpers import Kube, cluster, state_dir, wait_for
from kubernetes import client
from nodeagent_pods import pod, wait_log, wait_phase

pytestmark = pytest.mark.cluster

SCRIPT = """
import os, signal, sys, time
def on_term(*_):
    open('/marker/got-sigterm', 'w').write(str(os.getpid()))
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
print('pid', os.getpid(), flush=True)
while True:
    time.sleep(1)
"""


def _restart_agent(node: str) -> None:
    """Stops the node's agent (its pods keep running) and lets `hack/cluster up` start a fresh one."""
    node_dir = state_dir() / "nodes" / node
    pid = json.loads((node_dir / "agent.pid").read_text())["pid"]
    os.kill(pid, signal.SIGTERM)
    wait_for(lambda: not Path(f"/proc/{pid}").exists(), 30, f"agent {pid} of {node} to exit")
    cluster("up")
    new_pid = json.loads((node_dir / "agent.pid").read_text())["pid"]
    assert new_pid != pid

    def reconciled() -> bool:
        ready = node_dir / "state" / "agent-ready.json"
        return ready.exists() and json.loads(ready.read_text())["pid"] == new_pid

    wait_for(reconciled, 60, f"the new agent {new_pid} to reconcile its pods")


def _netns_pids(netns: str) -> list[str]:
    return subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True).stdout.split()


def test_agent_restart_adopts_running_pods_without_duplicates(kube: Kube, namespace: str, tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    marker.mkdir()
    manifest = pod(
        "survivor",
        SCRIPT,
        restart="Always",
        container={"volumeMounts": [{"name": "marker", "mountPath": "/marker"}]},
        volumes=[{"name": "marker", "hostPath": {"path": str(marker), "type": "Directory"}}],
    )
    kube.core.create_namespaced_pod(namespace, manifest)
    before = wait_phase(kube.core, namespace, "survivor", "Running")
    wait_log(kube.kubeconfig, namespace, "survivor", "pid ")
    record = json.loads(
        (
            state_dir() / "nodes" / before.spec.node_name / "state" / "pods" / before.metadata.uid / "pod.json"
        ).read_text()
    )
    assert _netns_pids(record["netns"]) == [str(p) for p in record["pids"]]

    _restart_agent(before.spec.node_name)

    def adopted() -> client.V1Pod | None:
        p = kube.core.read_namespaced_pod("survivor", namespace)
        status = p.status.container_statuses[0]
        return p if p.status.phase == "Running" and status.state.running else None

    after = wait_for(adopted, 60, "the pod to be reported Running by the new agent")
    assert after.status.container_statuses[0].restart_count == 0
    assert after.status.container_statuses[0].container_id == before.status.container_statuses[0].container_id
    assert after.status.pod_ip == before.status.pod_ip
    assert _netns_pids(record["netns"]) == [str(p) for p in record["pids"]], "no second copy of the container"

    kube.core.delete_namespaced_pod("survivor", namespace)
    wait_for(lambda: (marker / "got-sigterm").exists(), 30, "the adopted process to receive SIGTERM")
    assert (marker / "got-sigterm").read_text() == str(record["pids"][0])


def test_pod_deleted_while_its_agent_is_down_is_stopped_by_the_next_agent(
    kube: Kube, namespace: str, tmp_path: Path
) -> None:
    marker = tmp_path / "marker"
    marker.mkdir()
    manifest = pod(
        "orphan",
        SCRIPT,
        restart="Always",
        container={"volumeMounts": [{"name": "marker", "mountPath": "/marker"}]},
        volumes=[{"name": "marker", "hostPath": {"path": str(marker), "type": "Directory"}}],
    )
    kube.core.create_namespaced_pod(namespace, manifest)
    running = wait_phase(kube.core, namespace, "orphan", "Running")
    wait_log(kube.kubeconfig, namespace, "orphan", "pid ")
    node_dir = state_dir() / "nodes" / running.spec.node_name
    record = json.loads((node_dir / "state" / "pods" / running.metadata.uid / "pod.json").read_text())
    agent_pid = json.loads((node_dir / "agent.pid").read_text())["pid"]

    os.kill(agent_pid, signal.SIGTERM)
    wait_for(lambda: not Path(f"/proc/{agent_pid}").exists(), 30, "the agent to exit")
    kube.core.delete_namespaced_pod("orphan", namespace)  # stays Terminating: no agent to stop it
    assert not (marker / "got-sigterm").exists()
    cluster("up")

    wait_for(lambda: (marker / "got-sigterm").exists(), 60, "the new agent to SIGTERM the deleted pod's process")
    assert (marker / "got-sigterm").read_text() == str(record["pids"][0])

    def gone() -> bool:
        try:
            kube.core.read_namespaced_pod("orphan", namespace)
            return False
        except client.ApiException as e:
            return e.status == 404

    wait_for(gone, 30, "the pod object to be deleted")
    wait_for(lambda: not _netns_pids(record["netns"]), 30, "no process left in the pod's netns")


def test_never_pod_whose_process_died_while_the_agent_was_down_fails_and_is_not_rerun(
    kube: Kube, namespace: str
) -> None:
    kube.core.create_namespaced_pod(
        namespace, pod("once", "import time\nprint('started', flush=True)\ntime.sleep(3600)")
    )
    running = wait_phase(kube.core, namespace, "once", "Running")
    wait_log(kube.kubeconfig, namespace, "once", "started")
    node_dir = state_dir() / "nodes" / running.spec.node_name
    record = json.loads((node_dir / "state" / "pods" / running.metadata.uid / "pod.json").read_text())
    agent_pid = json.loads((node_dir / "agent.pid").read_text())["pid"]

    os.kill(agent_pid, signal.SIGTERM)
    wait_for(lambda: not Path(f"/proc/{agent_pid}").exists(), 30, "the agent to exit")
    os.kill(record["pids"][0], signal.SIGKILL)
    wait_for(lambda: not Path(f"/proc/{record['pids'][0]}").exists(), 30, "the pod's process to die")
    cluster("up")

    failed = wait_phase(kube.core, namespace, "once", "Failed")
    state = failed.status.container_statuses[0]
    assert state.state.terminated.reason == "ContainerStatusUnknown"
    assert state.restart_count == 0
    assert _netns_pids(record["netns"]) == [], "restartPolicy Never: the container must not run a second time"
