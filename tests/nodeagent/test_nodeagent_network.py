"""Pod networking and DNS on the node agent: pod IPs, headless-Service names, readiness gating."""

from __future__ import annotations

import pytest
from helpers import Kube, wait_for
from nodeagent_pods import logs, pod, wait_phase

pytestmark = pytest.mark.cluster

ECHO_SERVER = """
import socket
srv = socket.create_server(("0.0.0.0", 8080))
print("listening", flush=True)
while True:
    conn, _ = srv.accept()
    conn.sendall(b"pong\\n")
    conn.close()
"""

# Connects to each target until it answers "pong" (names may take a moment to appear in /etc/hosts); exits 1 after
# a 30 s deadline. Prints one line per target so the test can tell which one failed.
CLIENT = """
import socket, sys, time
targets = sys.argv[1:]
deadline = time.monotonic() + 30
for target in targets:
    while True:
        try:
            with socket.create_connection((target, 8080), timeout=2) as s:
                assert s.recv(16) == b"pong\\n"
            print("ok", target, flush=True)
            break
        except (OSError, AssertionError) as e:
            if time.monotonic() > deadline:
                print("FAILED", target, e, flush=True)
                sys.exit(1)
            time.sleep(0.2)
"""


def test_two_pods_talk_by_pod_ip_and_headless_service_dns(kube: Kube, namespace: str) -> None:
    kube.core.create_namespaced_service(
        namespace,
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "peers"},
            "spec": {
                "clusterIP": "None",
                "selector": {"app": "server"},
                "publishNotReadyAddresses": True,
                "ports": [{"port": 8080}],
            },
        },
    )
    # With two or more nodes the pods are pinned apart, so the traffic crosses node bridges and each node's agent
    # must know the other node's pod for the names to resolve.
    nodes = sorted(n.metadata.name for n in kube.core.list_node().items)
    server = pod("server", ECHO_SERVER, restart="Always", labels={"app": "server"}, hostname="srv", subdomain="peers")
    server["spec"]["nodeName"] = nodes[0]
    kube.core.create_namespaced_pod(namespace, server)
    server_ip = wait_phase(kube.core, namespace, "server", "Running").status.pod_ip

    targets = [server_ip, f"srv.peers.{namespace}.svc.cluster.local", f"peers.{namespace}.svc", "srv.peers", "peers"]
    client_pod = pod("client", CLIENT)
    client_pod["spec"]["containers"][0]["args"] = targets
    client_pod["spec"]["nodeName"] = nodes[-1]
    kube.core.create_namespaced_pod(namespace, client_pod)

    wait_phase(kube.core, namespace, "client", "Succeeded", timeout=90)
    out = logs(kube.kubeconfig, namespace, "client")
    for target in targets:
        assert f"ok {target}" in out, out


READY_AFTER_GO = """
import pathlib, time
while not pathlib.Path('/ctl/go').exists():
    time.sleep(0.1)
pathlib.Path('/ctl/ready').write_text('yes')
time.sleep(3600)
"""

# The readiness probe counts its own runs in /ctl/probes so the test knows the probe really ran while not ready.
PROBE = (
    "import pathlib, sys; pathlib.Path('/ctl/probes').open('a').write('x'); "
    "sys.exit(0 if pathlib.Path('/ctl/ready').exists() else 1)"
)


def test_readiness_probe_gates_ready(kube: Kube, namespace: str, tmp_path) -> None:
    ctl = tmp_path / "ctl"
    ctl.mkdir()
    manifest = pod(
        "gated",
        READY_AFTER_GO,
        restart="Always",
        container={
            "volumeMounts": [{"name": "ctl", "mountPath": "/ctl"}],
            "readinessProbe": {"exec": {"command": ["python", "-c", PROBE]}, "periodSeconds": 1},
        },
        volumes=[{"name": "ctl", "hostPath": {"path": str(ctl), "type": "Directory"}}],
    )
    kube.core.create_namespaced_pod(namespace, manifest)
    wait_phase(kube.core, namespace, "gated", "Running")

    wait_for(
        lambda: (ctl / "probes").exists() and len((ctl / "probes").read_text()) >= 3, 60, "three readiness probe runs"
    )
    p = kube.core.read_namespaced_pod("gated", namespace)
    conditions = {c.type: c.status for c in p.status.conditions}
    assert conditions["Ready"] == "False" and conditions["ContainersReady"] == "False"
    assert p.status.container_statuses[0].ready is False

    (ctl / "go").write_text("go")

    def ready() -> bool:
        p = kube.core.read_namespaced_pod("gated", namespace)
        return {c.type: c.status for c in p.status.conditions}.get("Ready") == "True"

    wait_for(ready, 60, "the pod to become Ready once its probe passes")
    assert kube.core.read_namespaced_pod("gated", namespace).status.container_statuses[0].ready is True
