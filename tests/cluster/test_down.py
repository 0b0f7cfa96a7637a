"""`hack/cluster down` leaves nothing behind: no process, netns, link, state or port.

Runs a second, throw-away one-node cluster beside the shared one (own state dir, bridge, subnet, netns prefix and
loopback ports), so the shared cluster other tests use is never touched.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest
from helpers import cluster, kubectl, wait_for

pytestmark = pytest.mark.cluster

PREFIX = "ftx"
PORT_OFFSET = 1000  # etcd 3379/3380, controller-manager 11257, scheduler 11259


def _env(state: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        FTJOB_CLUSTER_DIR=str(state),
        FTJOB_BRIDGE=f"{PREFIX}br0",
        FTJOB_SUBNET_PREFIX="10.215",
        FTJOB_SERVICE_CIDR="10.216.0.0/24",
        FTJOB_NETNS_PREFIX=PREFIX,
        FTJOB_PORT_OFFSET=str(PORT_OFFSET),
        FTJOB_NODES="1",
        FTJOB_GPUS_PER_NODE="2",
    )
    return env


def _netns() -> list[str]:
    run = Path("/run/netns")
    return sorted(p.name for p in run.iterdir() if p.name.startswith(f"{PREFIX}-")) if run.exists() else []


def _links() -> list[str]:
    return [line.split(":")[1].strip().split("@")[0] for line in os.popen("ip -o link").read().splitlines()
            if line.split(":")[1].strip().startswith(PREFIX)]  # fmt: skip


def _start_ticks(pid: int) -> int | None:
    """The process's start time (so a reused PID is not mistaken for it), None once it has gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    return None if fields[0] == "Z" else int(fields[19])


def _port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


@pytest.mark.slow
def test_down_leaves_no_process_netns_link_or_state(tmp_path: Path) -> None:
    state = tmp_path / "cluster"
    env = _env(state)
    try:
        cluster("up", env=env)
        kubeconfig = state / "kubeconfig"
        # a running pod, so down must also clean a pod netns and the pod's processes
        kubectl(kubeconfig, "run", "sleeper", "--image=python:3.11", "--restart=Never", "--command", "--",
                "python", "-c", "import time; time.sleep(3600)")  # fmt: skip
        wait_for(
            lambda: kubectl(kubeconfig, "get", "pod", "sleeper", "-o", "jsonpath={.status.phase}").stdout == "Running",
            60,
            "the pod on the throw-away cluster to run",
        )
        pid_files = list((state / "run").glob("*.pid")) + list((state / "nodes").glob("*/agent.pid"))
        assert len(pid_files) == 5, f"expected 4 control-plane processes and 1 agent, found {pid_files}"
        assert f"{PREFIX}-node-1" in _netns() and any(n.startswith(f"{PREFIX}-p") for n in _netns())
        assert f"{PREFIX}br0" in _links()
        pids = [json.loads(p.read_text())["pid"] for p in pid_files]
        pids += [int(p) for ns in _netns() for p in os.popen(f"ip netns pids {ns}").read().split()]
        assert len(pids) > 5, "the agent and the pod must run inside the cluster's netns"
        started = {pid: _start_ticks(pid) for pid in pids}
    finally:
        cluster("down", env=env)

    survivors = [pid for pid, ticks in started.items() if ticks is not None and _start_ticks(pid) == ticks]
    assert not survivors, f"processes of the cluster survive down: {survivors}"
    assert _netns() == [], f"down left netns {_netns()}"
    assert _links() == [], f"down left links {_links()}"
    assert not state.exists(), "down left the state dir"
    assert not _port_open(2379 + PORT_OFFSET), "etcd's port still answers"
    assert not list(Path("/etc/netns").glob(f"{PREFIX}-*")), "down left /etc/netns entries"
