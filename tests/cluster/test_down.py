"""`hack/cluster down` leaves nothing behind: no process, mount, cgroup, netns, link, state or port.

Runs a second, throw-away one-node cluster beside the shared one (own state dir, bridge, subnet, netns prefix and
loopback ports), so the shared cluster other tests use is never touched.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.cluster import BASE_IMAGE, cluster, kubectl
from tests.support.polling import wait_for

pytestmark = pytest.mark.cluster

PREFIX = "ftx"
PORT_OFFSET = 1000  # etcd 3379/3380, controller-manager 11257, scheduler 11259, CoreDNS ready 9181


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
        FTJOB_CLUSTER_IMAGES="pause,base",  # the trainer's GBs of torch are not needed to test down
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


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def _cgroups() -> list[str]:
    """This cluster's cgroup folders, in any hierarchy."""
    root = Path("/sys/fs/cgroup")
    return sorted(str(p) for h in root.iterdir() if h.is_dir() for p in h.glob(f"{PREFIX}-*"))


def _mounts(state: Path) -> list[str]:
    with open("/proc/self/mounts") as f:
        return [line.split()[1] for line in f if str(state) in line.split()[1]]


def _tracked_pids(state: Path) -> list[int]:
    """Every process of the throw-away cluster: its PID files, its netns and its nodes' cgroup trees."""
    pid_files = list((state / "run").glob("*.pid")) + list((state / "nodes").glob("*/*.pid"))
    pids = [json.loads(p.read_text())["pid"] for p in pid_files]
    pids += [int(p) for ns in _netns() for p in os.popen(f"ip netns pids {ns}").read().split()]
    for procs in Path("/sys/fs/cgroup/pids").glob(f"{PREFIX}-*/**/cgroup.procs"):
        pids += [int(p) for p in procs.read_text().split()]
    return sorted(set(pids))


def test_up_refuses_a_state_dir_too_deep_for_the_nodes_unix_sockets(tmp_path: Path) -> None:
    """A unix socket path must fit 104 bytes (containerd): a deep FTJOB_CLUSTER_DIR is refused before anything is
    built or started, with the limit in the message."""
    state = tmp_path / ("deep-" * 12) / "cluster"
    proc = cluster("up", env=_env(state), check=False)
    assert proc.returncode != 0 and "is too deep" in proc.stderr and "104 bytes" in proc.stderr, proc.stderr
    assert not state.exists() and _netns() == []


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A state dir as short as a user's ~/.cache/ftjob/cluster: pytest's tmp_path is too deep for unix sockets."""
    d = Path(tempfile.mkdtemp(prefix="ftx-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.mark.slow
def test_down_leaves_no_process_mount_cgroup_netns_link_or_state(short_dir: Path) -> None:
    state = short_dir / "cluster"
    env = _env(state)
    try:
        cluster("up", env=env)
        kubeconfig = state / "kubeconfig"
        # a running pod, so down must also stop a container, its shim, its cgroup, its netns and its mounts
        kubectl(kubeconfig, "run", "sleeper", f"--image={BASE_IMAGE}", "--restart=Never", "--command", "--",
                "python", "-c", "import time; time.sleep(3600)")  # fmt: skip
        wait_for(
            lambda: kubectl(kubeconfig, "get", "pod", "sleeper", "-o", "jsonpath={.status.phase}").stdout == "Running",
            60,
            "the pod on the throw-away cluster to run",
        )
        pid_files = sorted(p.name for p in (state / "run").glob("*.pid")) + sorted(
            p.name for p in (state / "nodes").glob("*/*.pid")
        )
        assert pid_files == [
            "coredns.pid", "etcd.pid", "kube-apiserver.pid", "kube-controller-manager.pid", "kube-scheduler.pid",
            "containerd.pid", "gpu-plugin.pid", "kube-proxy.pid", "kubelet.pid",
        ], pid_files  # fmt: skip
        assert f"{PREFIX}-node-1" in _netns() and f"{PREFIX}br0" in _links()
        assert _cgroups(), "the node's kubelet must put its pods under the node's cgroup root"
        assert _mounts(state), "the node's mount namespace is pinned below the state dir"
        pids = _tracked_pids(state)
        cmdlines = {pid: _cmdline(pid) for pid in pids}
        # beyond the PID files: the pod's own process and its containerd shim, so down must find and stop those too
        assert any("time.sleep(3600)" in c for c in cmdlines.values()), f"the pod's process is not tracked: {cmdlines}"
        assert any("containerd-shim" in c for c in cmdlines.values()), f"the pod's shim is not tracked: {cmdlines}"
        started = {pid: _start_ticks(pid) for pid in pids}
    finally:
        cluster("down", env=env)

    survivors = [pid for pid, ticks in started.items() if ticks is not None and _start_ticks(pid) == ticks]
    assert not survivors, f"processes of the cluster survive down: {survivors}"
    assert _netns() == [], f"down left netns {_netns()}"
    assert _links() == [], f"down left links {_links()}"
    assert _cgroups() == [], f"down left cgroups {_cgroups()}"
    assert _mounts(state) == [], f"down left mounts {_mounts(state)}"
    assert not state.exists(), "down left the state dir"
    assert not _port_open(2379 + PORT_OFFSET), "etcd's port still answers"
    registry = Path("/run/ftjob-cluster-hostpaths.json")
    users = json.loads(registry.read_text())["users"] if registry.exists() else []
    assert str(state) not in users, "down must release the kubelet host paths it shared"


@pytest.mark.slow
def test_up_takes_down_an_abandoned_cluster_with_the_same_names(short_dir: Path) -> None:
    """A session that ends has its processes killed, but its netns, bridge, mounts and state stay. The next `up`
    with the same names (CI's own cluster, say) takes that dead cluster down instead of refusing to start."""
    abandoned, fresh = short_dir / "abandoned", short_dir / "fresh"
    try:
        cluster("up", env=_env(abandoned))
        for pid in _tracked_pids(abandoned):
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        gone = lambda: not any(_start_ticks(p) for p in _tracked_pids(abandoned))  # noqa: E731
        wait_for(gone, 30, "the cluster's processes to die")
        assert f"{PREFIX}-node-1" in _netns() and abandoned.exists(), "a killed cluster leaves its netns and state"
        proc = cluster("up", env=_env(fresh), check=False)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "was abandoned" in proc.stdout, proc.stdout
        assert not abandoned.exists(), "the abandoned cluster's state must be gone"
        nodes = kubectl(fresh / "kubeconfig", "get", "nodes", "-o", "jsonpath={.items[*].metadata.name}").stdout
        assert nodes.strip(), "the new cluster must have its node"
    finally:
        for state in (fresh, abandoned):
            if state.exists():
                cluster("down", env=_env(state), check=False)
    assert _netns() == [] and _links() == [], f"left behind: {_netns()} {_links()}"
