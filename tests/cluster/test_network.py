"""The network the operator relies on: pod IPs across nodes, cluster DNS (Services, headless Services, pod
hostname.subdomain names) from CoreDNS, ClusterIP Services through kube-proxy with port != targetPort, and no name
outside the cluster resolving."""

from __future__ import annotations

import pytest
from kubernetes import client

from tests.support.cluster import Kube, node_names
from tests.support.podspecs import ECHO_SERVER, describe_pods, python_pod, running_ip, tcp_probe_script, wait_exit_code
from tests.support.polling import wait_for

pytestmark = pytest.mark.cluster


def _run_probe(kube: Kube, ns: str, name: str, script: str, node: str) -> tuple[int, str]:
    kube.core.create_namespaced_pod(ns, python_pod(name, script, node=node))
    code = wait_exit_code(kube.core, ns, name, timeout=60)
    return code, kube.core.read_namespaced_pod_log(name, ns)


@pytest.fixture
def echo(kube: Kube, namespace: str) -> str:
    """An echo server on the first node as `echo-0.peers.<ns>` behind a headless and a ClusterIP Service."""
    pod = python_pod("echo-0", ECHO_SERVER, node=node_names()[0])
    pod.metadata.labels = {"app": "echo"}
    pod.spec.hostname, pod.spec.subdomain = "echo-0", "peers"
    kube.core.create_namespaced_pod(namespace, pod)
    selector = {"app": "echo"}
    headless = client.V1ServiceSpec(cluster_ip="None", selector=selector, ports=[client.V1ServicePort(port=8080)])
    cluster_ip = client.V1ServiceSpec(selector=selector, ports=[client.V1ServicePort(port=80, target_port=8080)])
    for name, spec in (("peers", headless), ("echo", cluster_ip)):
        kube.core.create_namespaced_service(
            namespace, client.V1Service(metadata=client.V1ObjectMeta(name=name), spec=spec)
        )
    return wait_for(lambda: running_ip(kube.core, namespace, "echo-0"), 60, "the echo server to run",
                    describe=lambda: describe_pods(kube.core, namespace))  # fmt: skip


def test_pod_reaches_a_pod_on_another_node_by_ip(kube: Kube, namespace: str, echo: str) -> None:
    code, out = _run_probe(kube, namespace, "by-ip", tcp_probe_script(echo), node_names()[1])
    assert code == 0, out


def test_dns_names_of_services_headless_services_and_pods(kube: Kube, namespace: str, echo: str) -> None:
    names = ["peers", f"peers.{namespace}.svc.cluster.local", f"echo-0.peers.{namespace}.svc.cluster.local",
             "echo-0.peers", "echo"]  # fmt: skip
    script = f"import socket, time\nfor name in {names!r}:\n"
    script += "    for _ in range(50):\n        try:\n            print(name, socket.gethostbyname(name)); break\n"
    script += "        except OSError:\n            time.sleep(0.2)  # endpoints can lag the pod by a moment\n"
    script += "    else:\n        print(name, 'unresolved')\n"
    code, out = _run_probe(kube, namespace, "resolver", script, node_names()[1])
    assert code == 0, out
    resolved = dict(line.split() for line in out.splitlines())
    service_ip = kube.core.read_namespaced_service("echo", namespace).spec.cluster_ip
    want = {"peers": echo, f"peers.{namespace}.svc.cluster.local": echo,
            f"echo-0.peers.{namespace}.svc.cluster.local": echo, "echo-0.peers": echo, "echo": service_ip}  # fmt: skip
    assert resolved == want


def test_cluster_ip_service_forwards_port_80_to_target_port_8080(kube: Kube, namespace: str, echo: str) -> None:
    script = tcp_probe_script(f"echo.{namespace}.svc.cluster.local", 80)
    for n, node in enumerate(node_names()):  # from the echo server's own node (hairpin) and from the other
        code, out = _run_probe(kube, namespace, f"via-service-{n}", script, node)
        assert code == 0, f"from {node}: {out}"


def test_names_outside_the_cluster_do_not_resolve(kube: Kube, namespace: str) -> None:
    script = "import socket, sys\ntry:\n    socket.gethostbyname('example.com')\nexcept OSError:\n    sys.exit(0)\n"
    script += "sys.exit(1)"
    code, out = _run_probe(kube, namespace, "outside", script, node_names()[0])
    assert code == 0, f"a name outside the cluster resolved: {out}"
