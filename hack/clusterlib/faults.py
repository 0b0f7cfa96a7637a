"""Fault injection: kill a node outright, or cut a node's or a pod's network link and heal it again."""

from __future__ import annotations

import json
import time
import urllib.error

from clusterlib import netsetup, nodes, procs
from clusterlib.settings import Settings


def _pod_records(s: Settings, n: int) -> list[dict]:
    """What node N's agent recorded about its pods (<state_dir>/pods/<uid>/pod.json)."""
    records = []
    for path in sorted((s.node_dir(n) / "state" / "pods").glob("*/pod.json")):
        try:
            records.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue  # a record being written right now; its pod's processes still die with the agent's tree
    return records


def node_pids(s: Settings, n: int) -> list[int]:
    """Every process of node N: its agent and the agent's descendants, and all in its node and pod netns."""
    pids: set[int] = set()
    agent = procs.read(nodes.agent_pid_file(s, n))
    if agent is not None:
        pids.add(agent.pid)
        pids.update(procs.descendants(agent.pid))
    pids.update(netsetup.netns_pids(s.node_netns(n)))
    pod_netns = {r["netns"] for r in _pod_records(s, n) if r.get("netns")}
    # a pod whose record is not written yet still has a netns named after its UID (the agent's naming rule)
    for pod_dir in (s.node_dir(n) / "state" / "pods").glob("*"):
        pod_netns.add(s.pod_netns_prefix + pod_dir.name.replace("-", "")[:10])
    for ns in pod_netns:
        if netsetup.netns_exists(ns):
            pids.update(netsetup.netns_pids(ns))
    return sorted(pids)


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
    print(f"killed {s.node_name(n)}: {len(killed)} processes; the Node object stays (heal with `hack/cluster up`)")


def cut_node(s: Settings, node: str, up: bool) -> None:
    n = s.node_index(node)
    netsetup.set_link(s.uplink_veth(n), up)
    print(f"{'healed' if up else 'cut'} {s.node_name(n)} (uplink {s.uplink_veth(n)} {'up' if up else 'down'})")


def _find_pod(s: Settings, ref: str) -> tuple[int, dict]:
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
        raise SystemExit(f"error: pod {ref} is not scheduled to a node yet; nothing to cut")
    n = s.node_index(node)
    uid = pod["metadata"]["uid"]
    record_path = s.node_dir(n) / "state" / "pods" / uid / "pod.json"
    try:
        record = json.loads(record_path.read_text())
    except (OSError, ValueError):
        raise SystemExit(
            f"error: pod {ref} has no network record at {record_path}; it has not started on {node} yet"
        ) from None
    if not record.get("host_veth"):
        raise SystemExit(f"error: {record_path} names no host_veth; cannot cut pod {ref}")
    return n, record


def cut_pod(s: Settings, ref: str, up: bool) -> None:
    n, record = _find_pod(s, ref)
    netsetup.set_link(record["host_veth"], up, netns=s.node_netns(n))
    verb, state = ("healed", "up") if up else ("cut", "down")
    print(f"{verb} pod {ref} ({record.get('ip', '?')}): {record['host_veth']} in {s.node_netns(n)} {state}")
