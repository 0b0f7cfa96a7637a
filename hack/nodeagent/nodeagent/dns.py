"""Cluster DNS without a DNS server: per-pod /etc/hosts and resolv.conf files under /etc/netns/<pod netns>/.

`ip netns exec` bind-mounts those files over /etc/hosts and /etc/resolv.conf, so every container sees them. The
names are computed from Services and Pods directly (the same selection the EndpointSlice controller makes), so the
node identity needs no EndpointSlice access:

- headless Service: `<svc>.<ns>.svc.<domain>`, `<svc>.<ns>.svc`, `<svc>.<ns>` (and `<svc>` in its own namespace)
  map to every selected pod that is Ready, or that merely has an IP when `publishNotReadyAddresses` is true;
- a selected pod with `spec.hostname` and `spec.subdomain == <svc>` also gets `<hostname>.<svc>.<ns>.svc.<domain>`
  and the same short forms;
- ClusterIP Service: the same names map to one Ready backing pod IP. There is no kube-proxy, so clients connect to
  the pod directly: such a Service works only when its `port` equals its `targetPort`.

The files are rewritten in place (truncate + write; they are bind mounts, a rename would not be seen), and rewrites
are debounced: a burst of pod changes costs one pass over this node's pods.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from .network import NETNS_ETC_DIR

log = logging.getLogger("nodeagent.dns")


def pod_is_ready(pod: dict) -> bool:
    for cond in pod.get("status", {}).get("conditions") or []:
        if cond.get("type") == "Ready":
            return cond.get("status") == "True"
    return False


def selector_matches(selector: dict | None, labels: dict | None) -> bool:
    if not selector:
        return False  # a Service without selector has manually managed endpoints: not ours to compute
    labels = labels or {}
    return all(labels.get(k) == v for k, v in selector.items())


def dns_signature(pod: dict) -> tuple:
    """What of a pod matters for names; status churn that leaves this unchanged triggers no rewrite."""
    meta, spec, status = pod["metadata"], pod.get("spec", {}), pod.get("status", {})
    return (
        status.get("podIP"),
        pod_is_ready(pod),
        tuple(sorted((meta.get("labels") or {}).items())),
        spec.get("hostname"),
        spec.get("subdomain"),
        status.get("phase"),
        bool(meta.get("deletionTimestamp")),
    )


def service_signature(svc: dict) -> tuple:
    spec = svc.get("spec", {})
    return (
        spec.get("clusterIP"),
        tuple(sorted((spec.get("selector") or {}).items())),
        bool(spec.get("publishNotReadyAddresses")),
    )


@dataclass(frozen=True)
class HostsTable:
    """Hosts lines shared by all pods, and extra short-name lines per namespace."""

    common: str
    per_namespace: dict[str, str]


def _serves(pod: dict, publish_not_ready: bool) -> bool:
    status = pod.get("status", {})
    if not status.get("podIP") or status.get("phase") in ("Succeeded", "Failed"):
        return False
    if pod["metadata"].get("deletionTimestamp"):
        return False
    return publish_not_ready or pod_is_ready(pod)


def build_hosts_table(services: Iterable[dict], pods: Iterable[dict], domain: str) -> HostsTable:
    pods_by_ns: dict[str, list[dict]] = {}
    for pod in pods:
        pods_by_ns.setdefault(pod["metadata"].get("namespace", ""), []).append(pod)
    common: list[str] = []
    per_ns: dict[str, list[str]] = {}
    for svc in sorted(services, key=lambda s: (s["metadata"].get("namespace", ""), s["metadata"]["name"])):
        ns, name = svc["metadata"].get("namespace", ""), svc["metadata"]["name"]
        spec = svc.get("spec", {})
        headless = spec.get("clusterIP") == "None"
        publish = bool(spec.get("publishNotReadyAddresses"))
        selected = [
            p
            for p in pods_by_ns.get(ns, [])
            if selector_matches(spec.get("selector"), p["metadata"].get("labels")) and _serves(p, publish)
        ]
        selected.sort(key=lambda p: p["metadata"]["name"])
        base = f"{name}.{ns}"
        ips = [p["status"]["podIP"] for p in selected]
        if not headless:
            ips = ips[:1]
        for ip in ips:
            common.append(f"{ip}\t{base}.svc.{domain} {base}.svc {base}")
            per_ns.setdefault(ns, []).append(f"{ip}\t{name}")
        if not headless:
            continue
        for pod in selected:
            pspec = pod.get("spec", {})
            if pspec.get("subdomain") != name or not pspec.get("hostname"):
                continue
            ip, host = pod["status"]["podIP"], pspec["hostname"]
            common.append(f"{ip}\t{host}.{base}.svc.{domain} {host}.{base}.svc {host}.{base}")
            per_ns.setdefault(ns, []).append(f"{ip}\t{host}.{name}")
    return HostsTable("\n".join(common), {ns: "\n".join(lines) for ns, lines in per_ns.items()})


def own_hosts_line(pod: dict, ip: str, domain: str) -> str:
    meta, spec = pod["metadata"], pod.get("spec", {})
    host = spec.get("hostname") or meta["name"]
    if spec.get("subdomain"):
        return f"{ip}\t{host}.{spec['subdomain']}.{meta.get('namespace', '')}.svc.{domain} {host}"
    return f"{ip}\t{host}"


def hosts_file_text(pod: dict, ip: str, table: HostsTable, domain: str) -> str:
    ns = pod["metadata"].get("namespace", "")
    parts = [
        "# written by the ftjob node agent; rewritten when Services or Pods change",
        "127.0.0.1\tlocalhost",
        "::1\tlocalhost ip6-localhost ip6-loopback",
        own_hosts_line(pod, ip, domain),
        table.per_namespace.get(ns, ""),
        table.common,
    ]
    return "\n".join(p for p in parts if p) + "\n"


def resolv_conf_text(namespace: str, domain: str) -> str:
    # Nothing listens on 127.0.0.1:53 in a pod netns: names missing from /etc/hosts fail fast instead of hanging.
    return (
        f"search {namespace}.svc.{domain} svc.{domain} {domain}\n"
        "nameserver 127.0.0.1\n"
        "options ndots:5 timeout:1 attempts:1\n"
    )


def write_in_place(path: Path, text: str) -> None:
    """Truncate + write: the path is bind-mounted into running pods, which would keep seeing a renamed-away file."""
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


class DnsWriter:
    """Keeps the hosts/resolv.conf files of this node's pods current."""

    def __init__(
        self,
        domain: str,
        services: Callable[[], Iterable[dict]],
        pods: Callable[[], Iterable[dict]],
        min_delay_s: float = 0.1,
    ) -> None:
        self.domain = domain
        self._services = services
        self._pods = pods
        self._min_delay_s = min_delay_s
        self._delay_s = min_delay_s
        self._dirty = asyncio.Event()
        self._local: dict[str, tuple[dict, str]] = {}  # netns -> (pod, ip) for pods running on this node
        self._written: dict[str, str] = {}  # netns -> hosts text last written
        self.table = HostsTable("", {})
        self.rewrites = 0

    def mark_dirty(self) -> None:
        self._dirty.set()

    def add_pod(self, netns: str, pod: dict, ip: str) -> None:
        """Writes the files for a new pod now (they must exist before its first container starts)."""
        self._local[netns] = (pod, ip)
        folder = NETNS_ETC_DIR / netns
        folder.mkdir(parents=True, exist_ok=True)
        write_in_place(folder / "resolv.conf", resolv_conf_text(pod["metadata"].get("namespace", ""), self.domain))
        self._write_hosts(netns)

    def remove_pod(self, netns: str) -> None:
        self._local.pop(netns, None)
        self._written.pop(netns, None)

    def _write_hosts(self, netns: str) -> None:
        pod, ip = self._local[netns]
        text = hosts_file_text(pod, ip, self.table, self.domain)
        if self._written.get(netns) == text:
            return
        try:
            write_in_place(NETNS_ETC_DIR / netns / "hosts", text)
            self._written[netns] = text
        except FileNotFoundError:
            pass  # the pod is being torn down

    def refresh(self) -> None:
        self.table = build_hosts_table(self._services(), self._pods(), self.domain)
        for netns in list(self._local):
            self._write_hosts(netns)
        self.rewrites += 1

    async def run(self) -> None:
        while True:
            await self._dirty.wait()
            # Debounce: collect the rest of a burst. The delay grows with the cost of a pass (many pods, long files)
            # so a storm of endpoint changes cannot keep the agent busy rewriting files.
            await asyncio.sleep(self._delay_s)
            self._dirty.clear()
            started = time.monotonic()
            try:
                self.refresh()
            except Exception:
                log.exception("rewriting hosts files failed")
            cost = time.monotonic() - started
            self._delay_s = min(2.0, max(self._min_delay_s, 3 * cost))
