"""Pod networking: one network namespace per pod, a veth pair to the node bridge, and a pod IP from the node's CIDR.

Pod netns are named `<prefix><10 hex chars of the pod UID>` (15 chars at most) and the host end of the veth is
`ftjv<same 10 chars>`, so names are stable across agent restarts and can be found again from the pod UID alone.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("nodeagent.network")

NETNS_RUN_DIR = Path("/run/netns")
NETNS_ETC_DIR = Path("/etc/netns")


class CommandError(RuntimeError):
    pass


async def run_cmd(*argv: str, stdin: str | None = None, check: bool = True) -> str:
    """Runs a helper command (ip, mount ...) and returns its stdout; raises CommandError with its stderr."""
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await proc.communicate(stdin.encode() if stdin is not None else None)
    if check and proc.returncode != 0:
        raise CommandError(f"{' '.join(argv)} failed ({proc.returncode}): {err.decode(errors='replace').strip()}")
    return out.decode(errors="replace")


def short_id(uid: str) -> str:
    return uid.replace("-", "")[:10]


def netns_name(prefix: str, uid: str) -> str:
    return f"{prefix}{short_id(uid)}"


def host_veth_name(uid: str) -> str:
    return f"ftjv{short_id(uid)}"


class IpAllocator:
    """Hands out pod IPs round-robin from the CIDR (skipping the gateway) so a freed IP is not reused at once,
    which keeps stale hosts entries and ARP caches from pointing at a new pod."""

    def __init__(self, cidr: str, gateway: str) -> None:
        net = ipaddress.ip_network(cidr)
        self.prefixlen = net.prefixlen
        self._pool = [str(ip) for ip in net.hosts() if str(ip) != gateway]
        self._used: set[str] = set()
        self._next = 0

    def reserve(self, ip: str) -> None:
        self._used.add(ip)

    def allocate(self) -> str:
        for offset in range(len(self._pool)):
            candidate = self._pool[(self._next + offset) % len(self._pool)]
            if candidate not in self._used:
                self._used.add(candidate)
                self._next = (self._next + offset + 1) % len(self._pool)
                return candidate
        raise RuntimeError(f"pod CIDR exhausted: all {len(self._pool)} addresses are in use")

    def release(self, ip: str) -> None:
        self._used.discard(ip)

    @property
    def in_use(self) -> int:
        return len(self._used)


@dataclass(frozen=True)
class PodNet:
    netns: str
    host_veth: str
    ip: str


async def setup_pod_network(net: PodNet, prefixlen: int, gateway: str, bridge: str) -> None:
    """Creates the netns and veth pair; idempotent enough to rerun after a half-finished attempt."""
    if (NETNS_RUN_DIR / net.netns).exists():
        await teardown_pod_network(net)
    # Two `ip -batch` runs (node side, pod side) instead of seven processes per pod.
    await run_cmd(
        "ip",
        "-batch",
        "-",
        stdin=(
            f"netns add {net.netns}\n"
            f"link add {net.host_veth} type veth peer name eth0 netns {net.netns}\n"
            f"link set {net.host_veth} master {bridge} up\n"
        ),
    )
    await run_cmd(
        "ip",
        "-n",
        net.netns,
        "-batch",
        "-",
        stdin=(
            "link set lo up\n"
            f"addr add {net.ip}/{prefixlen} dev eth0\n"
            "link set eth0 up\n"
            f"route add default via {gateway}\n"
        ),
    )


async def teardown_pod_network(net: PodNet) -> None:
    """Removes the veth and the netns (and its /etc/netns files); missing pieces are fine."""
    await run_cmd("ip", "link", "del", net.host_veth, check=False)
    await run_cmd("ip", "netns", "del", net.netns, check=False)
    shutil.rmtree(NETNS_ETC_DIR / net.netns, ignore_errors=True)
