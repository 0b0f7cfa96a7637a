"""The cluster network, built with iproute2 only (no iptables here): a host bridge, one netns per node, routes.

    host: bridge <bridge> <prefix>.0.1/24, route <prefix>.N.0/24 via <prefix>.0.(10+N)
      └─ veth <netns_prefix>u<N>  ==  eth0 in netns <netns_prefix>-node-N: <prefix>.0.(10+N)/24, default via host
                                      bridge <bridge> <prefix>.N.1/24 in that netns holds the node's pods
Every step checks first, so running it again on a built network changes nothing.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

from clusterlib.settings import Settings

NETNS_DIR = Path("/run/netns")
ETC_NETNS_DIR = Path("/etc/netns")


def ip(*args: str, netns: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    argv = ["ip", *(["-n", netns] if netns else []), *args]
    proc = subprocess.run(argv, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise SystemExit(f"error: `{' '.join(argv)}` failed: {proc.stderr.strip()}")
    return proc


def link_exists(name: str, netns: str | None = None) -> bool:
    return ip("link", "show", "dev", name, netns=netns, check=False).returncode == 0


def link_info(name: str, netns: str | None = None) -> dict | None:
    proc = ip("-j", "addr", "show", "dev", name, netns=netns, check=False)
    if proc.returncode != 0:
        return None
    found = json.loads(proc.stdout or "[]")
    return found[0] if found else None


def _ensure_addr(dev: str, cidr: str, netns: str | None = None) -> None:
    info = link_info(dev, netns) or {}
    have = {f"{a['local']}/{a['prefixlen']}" for a in info.get("addr_info", []) if a.get("family") == "inet"}
    if cidr not in have:
        ip("addr", "add", cidr, "dev", dev, netns=netns)


def bridge_mac(index: int) -> str:
    """A fixed, locally administered MAC for bridge `index` (0: the host's, N: node N's). Left to itself a Linux
    bridge takes the lowest MAC among its ports, so deleting one pod could change the gateway MAC under every other
    pod of the node, whose ARP caches then send off-node traffic nowhere for several seconds."""
    return f"02:66:74:6a:{index >> 8 & 0xFF:02x}:{index & 0xFF:02x}"


def _ensure_bridge(name: str, cidr: str, mac: str, netns: str | None = None) -> None:
    if not link_exists(name, netns):
        ip("link", "add", name, "type", "bridge", netns=netns)
    ip("link", "set", name, "address", mac, netns=netns)
    _ensure_addr(name, cidr, netns)
    ip("link", "set", name, "up", netns=netns)


def _set_forwarding(netns: str | None) -> None:
    if netns is None:
        Path("/proc/sys/net/ipv4/ip_forward").write_text("1\n")
        return
    subprocess.run(["ip", "netns", "exec", netns, "sh", "-c", "echo 1 > /proc/sys/net/ipv4/ip_forward"], check=True)


def netns_exists(name: str) -> bool:
    return (NETNS_DIR / name).exists()


def ensure_host(s: Settings) -> None:
    _set_forwarding(None)
    _ensure_bridge(s.bridge, f"{s.host_ip}/24", bridge_mac(0))


def ensure_node(s: Settings, n: int) -> None:
    ns, veth = s.node_netns(n), s.uplink_veth(n)
    if not netns_exists(ns):
        ip("netns", "add", ns)
    ip("link", "set", "lo", "up", netns=ns)
    if not link_exists(veth):
        if link_exists("eth0", ns):  # half of an old pair: its peer went away with the host side
            ip("link", "del", "eth0", netns=ns)
        ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
    ip("link", "set", veth, "master", s.bridge)
    ip("link", "set", veth, "up")
    _ensure_addr("eth0", f"{s.node_ip(n)}/24", ns)
    ip("link", "set", "eth0", "up", netns=ns)
    ip("route", "replace", "default", "via", s.host_ip, netns=ns)
    _set_forwarding(ns)
    _ensure_bridge(s.bridge, f"{s.pod_gateway(n)}/24", bridge_mac(n), ns)
    ip("route", "replace", s.pod_cidr(n), "via", s.node_ip(n))


def check_node(s: Settings, n: int) -> list[str]:
    """What is wrong with node N's network (empty when nothing is)."""
    ns = s.node_netns(n)
    if not netns_exists(ns):
        return [f"netns {ns} missing"]
    problems = []
    for dev in ("lo", "eth0", s.bridge):
        info = link_info(dev, ns)
        if info is None or "UP" not in info.get("flags", []):
            problems.append(f"{dev} not up in {ns}")
    bridge = link_info(s.bridge, ns)
    if bridge is not None and bridge.get("address") != bridge_mac(n):
        problems.append(f"{s.bridge} in {ns} has MAC {bridge.get('address')}, not the fixed {bridge_mac(n)}")
    return problems


def cluster_netns(s: Settings) -> list[str]:
    """Every netns of this cluster: its nodes' and its pods' (found by name prefix, so leftovers count too)."""
    if not NETNS_DIR.exists():
        return []
    prefixes = (f"{s.netns_prefix}-node-", s.pod_netns_prefix)
    return sorted(p.name for p in NETNS_DIR.iterdir() if p.name.startswith(prefixes))


def netns_pids(name: str) -> list[int]:
    proc = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True)
    return [int(x) for x in proc.stdout.split()] if proc.returncode == 0 else []


def cluster_links(s: Settings) -> list[str]:
    """Host-side links of this cluster: its bridge and uplink veths (any number, leftovers included)."""
    proc = ip("-j", "link", "show", check=False)
    names = [link["ifname"] for link in json.loads(proc.stdout or "[]")]
    uplink = f"{s.netns_prefix}u"
    return [x for x in names if x == s.bridge or (x.startswith(uplink) and x[len(uplink) :].isdigit())]


def teardown(s: Settings) -> None:
    """Delete every netns, veth and the bridge of this cluster. Processes inside must be gone already."""
    for ns in cluster_netns(s):
        ip("netns", "del", ns, check=False)
    if ETC_NETNS_DIR.exists():  # per-netns hosts/resolv.conf the agent may have left
        for d in ETC_NETNS_DIR.iterdir():
            if d.name.startswith((f"{s.netns_prefix}-node-", s.pod_netns_prefix)):
                shutil.rmtree(d, ignore_errors=True)
    for link in cluster_links(s):
        ip("link", "del", link, check=False)


def set_link(dev: str, up: bool, netns: str | None = None) -> None:
    ip("link", "set", dev, "up" if up else "down", netns=netns)
