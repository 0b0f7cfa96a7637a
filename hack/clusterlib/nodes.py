"""The nodes: each a netns running one node agent (hack/nodeagent, our kubelet) with its own identity and config."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path

from clusterlib import controlplane, netsetup, pki, procs
from clusterlib.settings import Settings

AGENT = Path("hack/nodeagent/main.py")


def agent_config_path(s: Settings, n: int) -> Path:
    return s.node_dir(n) / "agent.json"


def agent_pid_file(s: Settings, n: int) -> Path:
    return s.node_dir(n) / "agent.pid"


def agent_log(s: Settings, n: int) -> Path:
    return s.root / "logs" / f"{s.node_name(n)}.log"


def agent_config(s: Settings, n: int) -> dict:
    node, d = s.node_name(n), s.node_dir(n)
    return {
        "node_name": node,
        "node_ip": s.node_ip(n),
        "netns": s.node_netns(n),
        "pod_cidr": s.pod_cidr(n),
        "pod_gateway": s.pod_gateway(n),
        "pod_bridge": s.bridge,
        "api_server": s.api_url,
        "kubeconfig": str(pki.node_kubeconfig(s, n)),
        "ca_file": str(s.pki / "ca.crt"),
        "serving_cert": str(s.pki / f"{node}-serving.crt"),
        "serving_key": str(s.pki / f"{node}-serving.key"),
        "client_ca_file": str(s.pki / "ca.crt"),
        "kubelet_port": 10250,
        "state_dir": str(d / "state"),
        "venv": s.venv,
        "repo": s.repo,
        "cpu": s.node_cpu,
        "memory": s.node_memory,
        "gpus": s.gpus_per_node,
        "max_pods": 250,  # a /24 pod range holds 253 addresses
        "cluster_domain": "cluster.local",
        "service_account_issuer": "https://kubernetes.default.svc.cluster.local",
        "pod_netns_prefix": s.pod_netns_prefix,
        # optional fields the agent reads: where pods reach the API (no kube-proxy, so not the service IP)
        "kubernetes_service_host": s.host_ip,
        "kubernetes_service_port": 6443,
        "pvc_root": str(s.root / "pvcs"),  # shared by all nodes, like a network file system
    }


def ensure(s: Settings, t0: float) -> None:
    """Build each node's network and start its agent unless that agent already runs."""
    agent = Path(s.repo) / AGENT
    if not agent.exists():
        raise SystemExit(f"error: the node agent {agent} does not exist yet; the control plane is up without nodes")
    env = controlplane.child_env(s)
    for n in range(1, s.nodes + 1):
        netsetup.ensure_node(s, n)
        problems = netsetup.check_node(s, n)
        if problems:
            raise SystemExit(f"error: network of {s.node_name(n)} is broken: {'; '.join(problems)}")
        if procs.read(agent_pid_file(s, n)) is not None:
            continue
        cfg = agent_config(s, n)
        Path(cfg["state_dir"]).mkdir(parents=True, exist_ok=True)
        agent_config_path(s, n).write_text(json.dumps(cfg, indent=2) + "\n")
        # nsenter switches only the network namespace. `ip netns exec` would also give the agent a private mount
        # namespace, hiding the pod netns it creates (`ip netns add` mounts) from the host's `ip netns`/down/faults.
        netns_path = netsetup.NETNS_DIR / s.node_netns(n)
        argv = ["nsenter", f"--net={netns_path}", "--", f"{s.venv}/bin/python", str(agent)]
        argv += ["--config", str(agent_config_path(s, n))]
        procs.start(f"agent {s.node_name(n)}", argv, agent_log(s, n), agent_pid_file(s, n), env)
        print(f"[cluster {time.monotonic() - t0:5.1f}s] started node agent {s.node_name(n)}", flush=True)


def api_get(s: Settings, path: str) -> dict:
    with urllib.request.urlopen(s.api_url + path, timeout=5, context=controlplane.admin_ssl(s)) as resp:
        return json.loads(resp.read())


def node_ready(s: Settings) -> dict[str, str]:
    """Each Node object's Ready condition status ("True"/"False"/"Unknown"); {} if the API cannot be read."""
    try:
        items = api_get(s, "/api/v1/nodes")["items"]
    except (urllib.error.URLError, OSError, ValueError, KeyError):
        return {}
    ready = {}
    for node in items:
        conditions = {c["type"]: c["status"] for c in node.get("status", {}).get("conditions", [])}
        ready[node["metadata"]["name"]] = conditions.get("Ready", "Unknown")
    return ready


def default_service_account_exists(s: Settings) -> bool:
    """Pods can only be created once the serviceaccount controller has made `default` in their namespace."""
    try:
        api_get(s, "/api/v1/namespaces/default/serviceaccounts/default")
        return True
    except (urllib.error.URLError, OSError, ValueError):
        return False


def wait_ready(s: Settings, t0: float, timeout_s: float = 120) -> None:
    """Wait until every node is Ready and the `default` namespace can take pods."""
    want = [s.node_name(n) for n in range(1, s.nodes + 1)]
    deadline, last_note = time.monotonic() + timeout_s, 0.0
    while True:
        ready = node_ready(s)
        missing = [x for x in want if ready.get(x) != "True"]
        if not missing and default_service_account_exists(s):
            print(f"[cluster {time.monotonic() - t0:5.1f}s] all {len(want)} nodes Ready", flush=True)
            return
        for n in range(1, s.nodes + 1):
            if procs.read(agent_pid_file(s, n)) is None:
                tail = procs.log_tail(agent_log(s, n))
                raise SystemExit(f"error: node agent {s.node_name(n)} exited; last log lines:\n{tail}")
        if time.monotonic() > deadline:
            raise SystemExit(f"error: nodes not Ready after {timeout_s:.0f}s: {missing}; see {s.root / 'logs'}")
        if time.monotonic() - last_note > 5:
            last_note = time.monotonic()
            state = ", ".join(f"{x}={ready.get(x, 'absent')}" for x in want)
            print(f"[cluster {time.monotonic() - t0:5.1f}s] waiting for nodes: {state}", flush=True)
        time.sleep(0.3)


def running_agents(s: Settings) -> list[procs.Tracked]:
    return [t for n in range(1, s.nodes + 1) if (t := procs.read(agent_pid_file(s, n))) is not None]
