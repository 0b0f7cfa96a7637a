"""Where a cluster lives and how it is addressed: names, subnets and ports, overridable by environment.

Every name and range a second cluster could collide on (bridge, subnet, netns prefix, loopback ports) has an env
override, so a throw-away cluster (the `down` test) can run beside the shared one without touching it.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

SETTINGS_FILE = "cluster.json"


def default_cache_dir() -> Path:
    xdg = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return Path(os.environ.get("FTJOB_CACHE") or xdg / "ftjob")


def default_state_dir() -> Path:
    return Path(os.environ.get("FTJOB_CLUSTER_DIR") or Path.home() / ".local/state/ftjob/cluster")


@dataclass(frozen=True)
class Settings:
    repo: str
    venv: str
    state_dir: str
    bin_dir: str
    cache_dir: str  # the ftjob cache (binaries, images): FTJOB_CACHE or ~/.cache/ftjob
    bridge: str = "ftjbr0"
    subnet_prefix: str = "10.213"  # host bridge <prefix>.0.1/24, node N <prefix>.0.(10+N), its pods <prefix>.N.0/24
    service_cidr: str = "10.214.0.0/24"
    netns_prefix: str = "ftj"  # node netns <prefix>-node-N, pod netns <prefix>-p*, uplink veths <prefix>u<N>
    port_offset: int = 0  # shifts the loopback ports (etcd, controller-manager, scheduler)
    nodes: int = 2
    gpus_per_node: int = 8
    images: str = "pause,base,operator,trainer"  # which images the nodes get (FTJOB_CLUSTER_IMAGES); pause+base always

    # --- derived addresses ---------------------------------------------------------------------------------------
    @property
    def host_ip(self) -> str:
        return f"{self.subnet_prefix}.0.1"

    @property
    def api_url(self) -> str:
        return f"https://{self.host_ip}:6443"

    @property
    def service_ip(self) -> str:
        return str(next(ipaddress.ip_network(self.service_cidr).hosts()))

    @property
    def dns_service_ip(self) -> str:
        """kube-dns's ClusterIP, the 10th address of the Service range (kubeadm's convention)."""
        return str(ipaddress.ip_network(self.service_cidr)[10])

    @property
    def coredns_ready_port(self) -> int:
        return 8181 + self.port_offset

    @property
    def etcd_client_port(self) -> int:
        return 2379 + self.port_offset

    @property
    def etcd_peer_port(self) -> int:
        return 2380 + self.port_offset

    @property
    def controller_manager_port(self) -> int:
        return 10257 + self.port_offset

    @property
    def scheduler_port(self) -> int:
        return 10259 + self.port_offset

    @property
    def pod_netns_prefix(self) -> str:
        return f"{self.netns_prefix}-p"

    def node_name(self, n: int) -> str:
        return f"{self.netns_prefix}-node-{n}"

    def node_netns(self, n: int) -> str:
        return self.node_name(n)

    def node_ip(self, n: int) -> str:
        return f"{self.subnet_prefix}.0.{10 + n}"

    def pod_cidr(self, n: int) -> str:
        return f"{self.subnet_prefix}.{n}.0/24"

    def pod_gateway(self, n: int) -> str:
        return f"{self.subnet_prefix}.{n}.1"

    def uplink_veth(self, n: int) -> str:
        return f"{self.netns_prefix}u{n}"

    def node_index(self, node: str) -> int:
        """The N of a node name; a clear error for names this cluster does not have."""
        for n in range(1, self.nodes + 1):
            if node in (self.node_name(n), str(n)):
                return n
        known = ", ".join(self.node_name(n) for n in range(1, self.nodes + 1))
        raise SystemExit(f"error: no node {node!r} in this cluster; nodes are: {known}")

    # --- paths -----------------------------------------------------------------------------------------------------
    @property
    def root(self) -> Path:
        return Path(self.state_dir)

    @property
    def pki(self) -> Path:
        return self.root / "pki"

    @property
    def kubeconfig(self) -> Path:
        return self.root / "kubeconfig"

    def node_dir(self, n: int) -> Path:
        return self.root / "nodes" / self.node_name(n)

    def save(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / (SETTINGS_FILE + ".tmp")
        tmp.write_text(json.dumps(dataclasses.asdict(self), indent=2) + "\n")
        tmp.replace(self.root / SETTINGS_FILE)


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise SystemExit(f"error: {name}={raw!r} is not a whole number; set it to e.g. {default}") from None
    if value < 0:
        raise SystemExit(f"error: {name}={raw!r} must not be negative")
    return value


MAX_SOCKET_PATH = 104  # containerd's limit on a unix socket path (the kernel's is 108 with the NUL)


def validate(s: Settings) -> None:
    """Reject settings that would produce broken names or overlapping ranges, saying which variable to fix."""
    if not 1 <= s.nodes <= 200:
        raise SystemExit(f"error: --nodes/FTJOB_NODES={s.nodes}: use 1..200 (node IPs are <prefix>.0.(10+N))")
    if not 0 <= s.gpus_per_node <= 64:
        raise SystemExit(f"error: --gpus/FTJOB_GPUS_PER_NODE={s.gpus_per_node}: use 0..64")
    parts = s.subnet_prefix.split(".")
    if len(parts) != 2 or not all(p.isdigit() and 0 <= int(p) <= 255 for p in parts):
        raise SystemExit(f"error: FTJOB_SUBNET_PREFIX={s.subnet_prefix!r}: give the first two octets, e.g. 10.213")
    try:
        service = ipaddress.ip_network(s.service_cidr)
    except ValueError as e:
        raise SystemExit(f"error: FTJOB_SERVICE_CIDR={s.service_cidr!r}: {e}") from None
    if service.overlaps(ipaddress.ip_network(f"{s.subnet_prefix}.0.0/16")):
        raise SystemExit(f"error: FTJOB_SERVICE_CIDR {s.service_cidr} overlaps the pod range {s.subnet_prefix}.0.0/16")
    if len(s.bridge) > 15 or len(s.uplink_veth(s.nodes)) > 15:
        raise SystemExit("error: FTJOB_BRIDGE / FTJOB_NETNS_PREFIX too long: interface names must fit 15 characters")
    unknown = set(s.images.split(",")) - {"pause", "base", "operator", "trainer"}
    if unknown:
        raise SystemExit(
            f"error: FTJOB_CLUSTER_IMAGES={s.images!r}: unknown {sorted(unknown)}; use pause,base,operator,trainer"
        )
    if not s.netns_prefix.isalnum():
        raise SystemExit(f"error: FTJOB_NETNS_PREFIX={s.netns_prefix!r}: use letters and digits only, e.g. ftj")


def check_socket_paths(s: Settings) -> None:
    """Refuse a state dir too deep for the nodes' unix sockets (checked by `up` only: `down` must clean up anyway).
    The kubelet's and containerd's sockets live below it; a socket path must fit 108 bytes (containerd refuses more
    than 104), which a deep FTJOB_CLUSTER_DIR would otherwise break at start-up with a message about containerd."""
    longest = s.node_dir(s.nodes) / "kubelet" / "pod-resources" / "kubelet.sock"
    if len(str(longest).encode()) > MAX_SOCKET_PATH:
        raise SystemExit(
            f"error: FTJOB_CLUSTER_DIR={str(s.root)!r} is too deep: the nodes' unix sockets below it (e.g. {longest}) "
            f"would exceed {MAX_SOCKET_PATH} bytes; use a path of at most "
            f"{MAX_SOCKET_PATH - len(str(longest).encode()) + len(str(s.root).encode())} bytes"
        )


def from_env(repo: Path, venv: Path, nodes: int | None = None, gpus: int | None = None) -> Settings:
    bin_dir = subprocess.run(
        [str(repo / "hack/lib/build-binaries.sh"), "dir"], check=True, capture_output=True, text=True
    ).stdout.strip()
    s = Settings(
        repo=str(repo),
        venv=str(venv),
        state_dir=str(default_state_dir()),
        bin_dir=bin_dir,
        cache_dir=str(default_cache_dir()),
        bridge=os.environ.get("FTJOB_BRIDGE") or Settings.bridge,
        subnet_prefix=os.environ.get("FTJOB_SUBNET_PREFIX") or Settings.subnet_prefix,
        service_cidr=os.environ.get("FTJOB_SERVICE_CIDR") or Settings.service_cidr,
        netns_prefix=os.environ.get("FTJOB_NETNS_PREFIX") or Settings.netns_prefix,
        port_offset=_env_int("FTJOB_PORT_OFFSET", 0),
        nodes=nodes if nodes is not None else _env_int("FTJOB_NODES", Settings.nodes),
        gpus_per_node=gpus if gpus is not None else _env_int("FTJOB_GPUS_PER_NODE", Settings.gpus_per_node),
        images=os.environ.get("FTJOB_CLUSTER_IMAGES") or Settings.images,
    )
    validate(s)
    return s


def load(state_dir: Path | None = None) -> Settings | None:
    """The settings a previous `up` recorded, or None when no cluster state exists there."""
    path = (state_dir or default_state_dir()) / SETTINGS_FILE
    if not path.exists():
        return None
    return Settings(**json.loads(path.read_text()))
