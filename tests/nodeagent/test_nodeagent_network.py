"""Pod networking and DNS on the node agent: pod IPs, headless-Service names, readiness gating."""

from __future__ import annotations

import pytest
from helpers import Kube, wait_for
from nodeagent_pods import logs, phase, pod, wait_phase

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


# Talks to the server until /ctl/stop appears; every exchange must succeed. Counts successes in /ctl/ok and prints
# the gateway's MAC from its ARP cache whenever it changes, so a gateway whose MAC moves shows up even when ARP
# re-resolves before a connection times out.
STEADY_CLIENT = """
import pathlib, socket, sys
target, ctl = sys.argv[1], pathlib.Path("/ctl")
routes = [line.split() for line in open("/proc/net/route").read().splitlines()[1:]]
gateway = socket.inet_ntoa(bytes.fromhex(next(r[2] for r in routes if r[1] == "00000000"))[::-1])
ok, last_mac = 0, None
while not (ctl / "stop").exists():
    try:
        with socket.create_connection((target, 8080), timeout=5) as s:
            assert s.recv(16) == b"pong\\n"
    except (OSError, AssertionError) as e:
        print("FAILED", ok, repr(e), flush=True)
        sys.exit(1)
    ok += 1
    (ctl / "ok").write_text(str(ok))
    for line in open("/proc/net/arp").read().splitlines()[1:]:
        if line.split()[0] == gateway and line.split()[3] != last_mac:
            last_mac = line.split()[3]
            print("gateway", gateway, "mac", last_mac, flush=True)
"""


def test_off_node_traffic_survives_other_pods_of_the_node_coming_and_going(
    kube: Kube, namespace: str, tmp_path
) -> None:
    """A Linux bridge left to pick its own MAC takes its lowest port's, so deleting a pod used to change the gateway
    MAC under every other pod of that node and black-hole their off-node traffic for seconds (lost heartbeats)."""
    nodes = sorted(n.metadata.name for n in kube.core.list_node().items)
    server = pod("server", ECHO_SERVER, restart="Always", nodeName=nodes[-1])
    kube.core.create_namespaced_pod(namespace, server)
    server_ip = wait_phase(kube.core, namespace, "server", "Running").status.pod_ip

    # The churn pods join the node's bridge first, so the steady client most likely learns a gateway MAC that one
    # of them lent the bridge; then they all leave.
    churn = [f"churn-{i}" for i in range(6)]
    for name in churn:
        kube.core.create_namespaced_pod(namespace, pod(name, "import time; time.sleep(3600)", nodeName=nodes[0]))
    for name in churn:
        wait_phase(kube.core, namespace, name, "Running")

    ctl = tmp_path / "ctl"
    ctl.mkdir()
    steady = pod(
        "steady",
        STEADY_CLIENT,
        nodeName=nodes[0],
        container={"args": [server_ip], "volumeMounts": [{"name": "ctl", "mountPath": "/ctl"}]},
        volumes=[{"name": "ctl", "hostPath": {"path": str(ctl), "type": "Directory"}}],
    )
    kube.core.create_namespaced_pod(namespace, steady)

    def exchanges() -> int:
        if phase(kube.core, namespace, "steady") == "Failed":
            raise AssertionError(logs(kube.kubeconfig, namespace, "steady"))
        return int((ctl / "ok").read_text() or 0) if (ctl / "ok").exists() else 0

    wait_for(lambda: exchanges() > 0, 60, "the steady client's first exchange")
    for name in churn:
        kube.core.delete_namespaced_pod(name, namespace, grace_period_seconds=0)
    wait_for(lambda: not {p.metadata.name for p in kube.core.list_namespaced_pod(namespace).items} & set(churn), 60,
             "the churn pods to be gone")  # fmt: skip
    seen = exchanges()
    wait_for(lambda: exchanges() >= seen + 50, 60, "50 more exchanges after the churn pods left")
    (ctl / "stop").write_text("stop")
    wait_phase(kube.core, namespace, "steady", "Succeeded")
    out = logs(kube.kubeconfig, namespace, "steady")
    assert "FAILED" not in out, out
    assert len({line for line in out.splitlines() if line.startswith("gateway")}) == 1, out
