"""The agent's configuration (agent.json written by hack/cluster), validated with errors that say what to fix."""

from __future__ import annotations

import ipaddress
import json
from dataclasses import dataclass, field
from pathlib import Path


class ConfigError(ValueError):
    """agent.json is missing a field or holds a bad value."""


@dataclass(frozen=True)
class AgentConfig:
    node_name: str
    node_ip: str
    netns: str
    pod_cidr: str
    pod_gateway: str
    pod_bridge: str
    api_server: str
    kubeconfig: str
    ca_file: str
    serving_cert: str
    serving_key: str
    client_ca_file: str
    kubelet_port: int
    state_dir: Path
    venv: Path
    repo: Path
    cpu: str = "16"
    memory: str = "64Gi"
    gpus: int = 0
    max_pods: int = 110
    cluster_domain: str = "cluster.local"
    service_account_issuer: str = ""
    pod_netns_prefix: str = "ftj-p"
    # Optional: a credential that may list Services cluster-wide when the node identity may not.
    dns_kubeconfig: str = ""
    kubernetes_service_host: str = "10.213.0.1"
    kubernetes_service_port: int = 6443
    # Restart back-off of crashing containers: base doubles per restart up to the cap (kubelet: 10 s / 300 s).
    restart_backoff_base_s: float = 1.0
    restart_backoff_max_s: float = 60.0
    # Where persistentVolumeClaim volumes live: <pvc_root>/<namespace>/<claim> (shared by all nodes, like NFS).
    pvc_root: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def pods_dir(self) -> Path:
        return self.state_dir / "pods"

    @property
    def dns_kubeconfig_path(self) -> str:
        """The credential for listing all pods and services: dns_kubeconfig, else the cluster's admin kubeconfig
        next to the node dirs (<cluster>/nodes/<node>/state -> <cluster>/kubeconfig) when it exists."""
        if self.dns_kubeconfig:
            return self.dns_kubeconfig
        guess = self.state_dir.parent.parent.parent / "kubeconfig"
        return str(guess) if guess.is_file() else ""

    @property
    def pvc_dir(self) -> Path:
        return Path(self.pvc_root) if self.pvc_root else self.state_dir.parent.parent / "pvcs"


_REQUIRED = (
    "node_name",
    "node_ip",
    "pod_cidr",
    "pod_gateway",
    "pod_bridge",
    "api_server",
    "kubeconfig",
    "state_dir",
    "venv",
    "repo",
)


def parse_config(raw: dict, source: str = "agent.json") -> AgentConfig:
    """Builds the config from the decoded JSON; raises ConfigError naming the field to fix."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a JSON object, got {type(raw).__name__}")
    missing = [k for k in _REQUIRED if not raw.get(k)]
    if missing:
        raise ConfigError(f"{source}: missing required field(s) {', '.join(missing)}")
    known = set(AgentConfig.__dataclass_fields__) - {"extra"}
    values = {k: v for k, v in raw.items() if k in known}
    values["extra"] = {k: v for k, v in raw.items() if k not in known}
    for key in ("state_dir", "venv", "repo"):
        values[key] = Path(values[key])
    try:
        net = ipaddress.ip_network(values["pod_cidr"], strict=True)
        gateway = ipaddress.ip_address(values["pod_gateway"])
        ipaddress.ip_address(values["node_ip"])
    except ValueError as e:
        raise ConfigError(f"{source}: bad address: {e}") from e
    if gateway not in net:
        raise ConfigError(f"{source}: pod_gateway {gateway} is outside pod_cidr {net}")
    for key in ("kubelet_port", "gpus", "max_pods", "kubernetes_service_port"):
        if key in values:
            try:
                values[key] = int(values[key])
            except (TypeError, ValueError) as e:
                raise ConfigError(f"{source}: {key} must be an integer, got {values[key]!r}") from e
    values.setdefault("kubelet_port", 10250)
    for key in ("ca_file", "serving_cert", "serving_key", "client_ca_file"):
        values.setdefault(key, "")
    values.setdefault("netns", "")
    if len(values.get("pod_netns_prefix", "ftj-p")) > 5:
        raise ConfigError(f"{source}: pod_netns_prefix must be at most 5 characters (netns names stay <= 15)")
    return AgentConfig(**values)


def load_config(path: str | Path) -> AgentConfig:
    path = Path(path)
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as e:
        raise ConfigError(f"config file {path} does not exist; pass --config <agent.json>") from e
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from e
    return parse_config(raw, str(path))
