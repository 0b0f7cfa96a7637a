"""Small pod manifests the cluster tests run (Debian + python3, the base of the project's images)."""

from __future__ import annotations

from kubernetes import client

from tests.support.cluster import BASE_IMAGE
from tests.support.polling import wait_for

IMAGE = BASE_IMAGE


def python_pod(name: str, script: str, node: str | None = None, restart: str = "Never", **spec: object) -> client.V1Pod:
    """A one-container pod running `python -c script`, optionally pinned to `node`."""
    return client.V1Pod(
        metadata=client.V1ObjectMeta(name=name, labels={"app": name}),
        spec=client.V1PodSpec(
            node_name=node,
            restart_policy=restart,
            termination_grace_period_seconds=2,
            containers=[client.V1Container(name="main", image=IMAGE, command=["python", "-c", script])],
            **spec,
        ),
    )


# Serves one line over TCP on 8080 to anyone who connects, forever.
ECHO_SERVER = """
import socket
srv = socket.create_server(("0.0.0.0", 8080))
while True:
    conn, _ = srv.accept()
    conn.sendall(b"pong\\n")
    conn.close()
"""

SLEEPER = "import time\nwhile True: time.sleep(60)"


def tcp_probe_script(ip: str, port: int = 8080, within_s: float = 10.0) -> str:
    """Exits 0 if `ip:port` answers "pong" within `within_s`, 1 if not (a pod-to-pod reachability check). It tries
    again until then: a Service's endpoints and kube-proxy's rules can lag a Running server by a moment."""
    return f"""
import socket, sys, time
deadline = time.monotonic() + {within_s}
while True:
    try:
        with socket.create_connection(({ip!r}, {port}), timeout=2) as c:
            c.settimeout(2)
            sys.exit(0 if c.recv(16).startswith(b"pong") else 1)
    except OSError as e:
        if time.monotonic() >= deadline:
            print("unreachable:", e)
            sys.exit(1)
        time.sleep(0.2)
"""


def pod_phase(core: client.CoreV1Api, ns: str, name: str) -> str:
    return core.read_namespaced_pod(name, ns).status.phase or ""


def wait_exit_code(core: client.CoreV1Api, ns: str, name: str, timeout: float) -> int:
    """Wait for the pod to finish (Succeeded/Failed) and return its container's exit code."""

    def finished() -> client.V1Pod | None:
        pod = core.read_namespaced_pod(name, ns)
        return pod if pod.status.phase in ("Succeeded", "Failed") else None

    pod = wait_for(finished, timeout, f"pod {ns}/{name} to finish", describe=lambda: describe_pods(core, ns))
    terminated = pod.status.container_statuses[0].state.terminated
    assert terminated is not None, f"pod {name} finished ({pod.status.phase}) without a terminated container state"
    return terminated.exit_code


def describe_pods(core: client.CoreV1Api, ns: str) -> str:
    """Phases, nodes and container states of a namespace's pods, plus its latest events: for failure messages."""
    lines = []
    for pod in core.list_namespaced_pod(ns).items:
        states = [str(s.state.to_dict()) for s in pod.status.container_statuses or []]
        lines.append(f"{pod.metadata.name} {pod.status.phase} node={pod.spec.node_name} {states}")
    events = core.list_namespaced_event(ns).items[-5:]
    lines += [f"event {e.involved_object.name}: {e.reason} {e.message}" for e in events]
    return "\n".join(lines) or "no pods"


def running_ip(core: client.CoreV1Api, ns: str, name: str) -> str | None:
    pod = core.read_namespaced_pod(name, ns)
    return pod.status.pod_ip if pod.status.phase == "Running" else None
