"""Fault injection on real nodes: kill a node outright, cut a node's or a pod's network link and heal it, freeze a
pod (SIGSTOP every process: a silent failure, no socket is reset) and thaw it.

A node's processes are its components (tracked by PID files), whatever runs in its network namespace (containerd's
shims) and everything in its cgroup tree (every container of every pod). A pod's processes are those in its pod
cgroup (`pod<uid>`, the kubelet's cgroupfs naming).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.error

from clusterlib import cgroups, netsetup, nodes, procs, runtime
from clusterlib.settings import Settings


def pod_pids(s: Settings, n: int, uid: str = "") -> list[int]:
    """Every container process on node N (of one pod, if `uid` is given)."""
    return cgroups.pids(runtime.cgroup_root(s, n), contains=f"pod{uid}" if uid else "")


def node_pids(s: Settings, n: int) -> list[int]:
    pids = {t.pid for t in runtime.running(s, n)}
    pids.update(netsetup.netns_pids(s.node_netns(n)))
    pids.update(pod_pids(s, n))
    return sorted(pids)


def kill_all(pids: list[int]) -> None:
    procs.kill_now(pids)


def kill_node(s: Settings, node: str) -> None:
    n = s.node_index(node)
    deadline = time.monotonic() + 10
    killed: set[int] = set()
    while pids := [p for p in node_pids(s, n) if procs.start_ticks(p) is not None]:
        procs.kill_now(pids)  # repeat: a process may have forked between the listing and the kill
        killed.update(pids)
        if time.monotonic() > deadline:
            raise SystemExit(f"error: processes of {s.node_name(n)} survive SIGKILL: {pids}")
        time.sleep(0.05)
    print(
        f"killed {s.node_name(n)}: {len(killed)} processes (kubelet, containerd, shims, containers); "
        "the Node object stays (heal with `hack/cluster up`)"
    )


def cut_node(s: Settings, node: str, up: bool) -> None:
    n = s.node_index(node)
    netsetup.set_link(s.uplink_veth(n), up)
    print(f"{'healed' if up else 'cut'} {s.node_name(n)} (uplink {s.uplink_veth(n)} {'up' if up else 'down'})")


def find_pod(s: Settings, ref: str) -> tuple[int, dict]:
    """(node index, pod object) of NAMESPACE/NAME, with a clear error for anything that is not a running pod."""
    if ref.count("/") != 1 or not all(ref.split("/")):
        raise SystemExit(f"error: pod {ref!r}: write it as NAMESPACE/NAME, e.g. default/my-pod")
    ns, name = ref.split("/")
    try:
        pod = nodes.api_get(s, f"/api/v1/namespaces/{ns}/pods/{name}")
    except urllib.error.HTTPError as e:
        raise SystemExit(f"error: pod {ref}: the API answered {e.code} {e.reason}") from None
    except (urllib.error.URLError, OSError) as e:
        raise SystemExit(f"error: cannot reach the API server to look up {ref}: {e}") from None
    node = pod.get("spec", {}).get("nodeName")
    if not node:
        raise SystemExit(f"error: pod {ref} is not scheduled to a node yet")
    return s.node_index(node), pod


def _pod_processes(s: Settings, ref: str) -> tuple[int, list[int]]:
    n, pod = find_pod(s, ref)
    pids = pod_pids(s, n, pod["metadata"]["uid"])
    if not pids:
        phase = pod["status"].get("phase")
        raise SystemExit(f"error: pod {ref} has no running process on {s.node_name(n)} (phase {phase})")
    return n, pids


def host_veth(s: Settings, n: int, pid: int) -> str:
    """The node-side end of the veth whose other end is eth0 in the network namespace of process `pid`."""
    # `ip` inside the pod's netns (sysfs would still show the host's devices)
    proc = subprocess.run(["nsenter", "-t", str(pid), "-n", "ip", "-j", "link", "show", "dev", "eth0"],
                          capture_output=True, text=True)  # fmt: skip
    if proc.returncode != 0:
        raise SystemExit(f"error: cannot read eth0 of process {pid}: {proc.stderr.strip()}")
    peer = json.loads(proc.stdout)[0].get("link_index")
    links = json.loads(netsetup.ip("-j", "link", "show", netns=s.node_netns(n)).stdout or "[]")
    for link in links:
        if link["ifindex"] == peer:
            return link["ifname"]
    raise SystemExit(f"error: no link with index {peer} in {s.node_netns(n)}")


def cut_pod(s: Settings, ref: str, up: bool) -> None:
    n, pids = _pod_processes(s, ref)
    veth = host_veth(s, n, pids[0])
    netsetup.set_link(veth, up, netns=s.node_netns(n))
    verb, state = ("healed", "up") if up else ("cut", "down")
    print(f"{verb} pod {ref}: {veth} in {s.node_netns(n)} {state}")


def freeze_pod(s: Settings, ref: str, freeze: bool) -> None:
    """SIGSTOP (or SIGCONT) every process of the pod, its sandbox included."""
    _, pids = _pod_processes(s, ref)
    sig = signal.SIGSTOP if freeze else signal.SIGCONT
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    print(f"{'froze' if freeze else 'thawed'} pod {ref}: {len(pids)} processes")
