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

The files are rewritten in place (truncate + write; they are bind mounts, a rename would not be seen), shared by the
pods of a namespace on a node (see DnsWriter), and rewrites are debounced: a burst of pod changes costs one pass.
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


def _hosts_head(own_lines: list[str]) -> list[str]:
    return [
        "# written by the ftjob node agent; rewritten when Services or Pods change",
        "127.0.0.1\tlocalhost",
        "::1\tlocalhost ip6-localhost ip6-loopback",
        *own_lines,
    ]


def hosts_file_text(pod: dict, ip: str, table: HostsTable, domain: str, others: list[str] | None = None) -> str:
    """A pod's hosts file: its own name first, then (`others`) the own names of pods sharing the file."""
    ns = pod["metadata"].get("namespace", "")
    parts = [
        *_hosts_head([own_hosts_line(pod, ip, domain), *(others or [])]),
        table.per_namespace.get(ns, ""),
        table.common,
    ]
    return "\n".join(p for p in parts if p) + "\n"


def shared_hosts_text(namespace: str, own_lines: list[str], table: HostsTable) -> str:
    parts = [*_hosts_head(own_lines), table.per_namespace.get(namespace, ""), table.common]
    return "\n".join(p for p in parts if p) + "\n"


def pod_hostname(pod: dict) -> str:
    return pod.get("spec", {}).get("hostname") or pod["metadata"]["name"]


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
    """Keeps the hosts/resolv.conf files of this node's pods current.

    The names are the same for every pod of a namespace except each pod's own hostname, so the pods of one
    namespace on this node share one hosts file (`<shared_dir>/<ns>.hosts`, which `/etc/netns/<netns>/hosts`
    symlinks to; the bind mount follows the link) holding all their own names. A change then costs one write per
    namespace instead of one per pod. A pod whose bare hostname is already taken by a sharing pod of its namespace
    gets a private file instead, so its own name never resolves to another pod.
    """

    def __init__(
        self,
        domain: str,
        services: Callable[[], Iterable[dict]],
        pods: Callable[[], Iterable[dict]],
        shared_dir: Path,
        min_delay_s: float = 0.1,
    ) -> None:
        self.domain = domain
        self._services = services
        self._pods = pods
        self.shared_dir = shared_dir
        self._min_delay_s = min_delay_s
        self._delay_s = min_delay_s
        self._dirty = asyncio.Event()
        self._private: dict[str, tuple[dict, str]] = {}  # netns -> (pod, ip): pods with their own hosts file
        self._shared: dict[str, dict[str, tuple[dict, str]]] = {}  # namespace -> netns -> (pod, ip)
        self._written: dict[Path, str] = {}  # file -> text last written
        self.table = HostsTable("", {})
        self.rewrites = 0

    def mark_dirty(self) -> None:
        self._dirty.set()

    def _shared_path(self, namespace: str) -> Path:
        return self.shared_dir / f"{namespace}.hosts"

    def add_pod(self, netns: str, pod: dict, ip: str) -> None:
        """Writes the files for a new pod now (they must exist before its first container starts)."""
        ns = pod["metadata"].get("namespace", "")
        folder = NETNS_ETC_DIR / netns
        folder.mkdir(parents=True, exist_ok=True)
        write_in_place(folder / "resolv.conf", resolv_conf_text(ns, self.domain))
        hosts = folder / "hosts"
        members = self._shared.setdefault(ns, {})
        if hosts.is_symlink():
            shared = True  # an adopted pod keeps the file its containers have bind-mounted
        elif hosts.exists():
            shared = False
        else:
            shared = pod_hostname(pod) not in {pod_hostname(p) for p, _ in members.values()}
        if not shared:
            self._private[netns] = (pod, ip)
            self._write(hosts, self._private_text(netns))  # in place: an adopted pod has it bind-mounted
            return
        members[netns] = (pod, ip)
        self.shared_dir.mkdir(parents=True, exist_ok=True)
        self._write_shared(ns)
        if not hosts.is_symlink():
            hosts.symlink_to(self._shared_path(ns))

    def remove_pod(self, netns: str) -> None:
        if self._private.pop(netns, None) is None:
            for members in self._shared.values():
                if members.pop(netns, None) is not None:
                    self.mark_dirty()  # its own name leaves the shared file
        self._written.pop(NETNS_ETC_DIR / netns / "hosts", None)

    def _private_text(self, netns: str) -> str:
        pod, ip = self._private[netns]
        return hosts_file_text(pod, ip, self.table, self.domain)

    def _write_shared(self, namespace: str) -> None:
        members = self._shared.get(namespace) or {}
        own = sorted(own_hosts_line(pod, ip, self.domain) for pod, ip in members.values())
        self._write(self._shared_path(namespace), shared_hosts_text(namespace, own, self.table))

    def _write(self, path: Path, text: str) -> None:
        if self._written.get(path) == text:
            return
        try:
            write_in_place(path, text)
            self._written[path] = text
        except FileNotFoundError:
            pass  # the pod is being torn down

    def refresh(self) -> None:
        self.table = build_hosts_table(self._services(), self._pods(), self.domain)
        for namespace in list(self._shared):
            self._write_shared(namespace)
        for netns in list(self._private):
            self._write(NETNS_ETC_DIR / netns / "hosts", self._private_text(netns))
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
