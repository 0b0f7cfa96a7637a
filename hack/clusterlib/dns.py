"""Cluster DNS: CoreDNS (its `kubernetes` plugin implements the Kubernetes DNS spec: Services, headless Services,
pod hostnames and subdomains) runs beside the control plane on the host bridge, and the `kube-dns` Service in
kube-system (the clusterDNS every kubelet hands its pods) sends pods there through kube-proxy.

It answers only names of the cluster: every other query gets NXDOMAIN, so nothing a pod looks up leaves the machine.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

from clusterlib import pki, procs
from clusterlib.settings import Settings

USER = "ftjob:coredns"  # the client certificate's CN, bound to a read-only ClusterRole below


def corefile(s: Settings) -> str:
    return f"""cluster.local:53 in-addr.arpa:53 ip6.arpa:53 {{
    bind {s.host_ip}
    errors
    ready 127.0.0.1:{s.coredns_ready_port}
    kubernetes cluster.local in-addr.arpa ip6.arpa {{
        kubeconfig {s.root / "coredns.kubeconfig"} ftjob
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
        ttl 0
    }}
}}
.:53 {{
    bind {s.host_ip}
    errors
    template ANY ANY {{
        rcode NXDOMAIN
    }}
}}
"""


def manifests(s: Settings) -> list[dict]:
    """RBAC for CoreDNS, and the selector-less kube-dns Service whose EndpointSlice names the host bridge."""
    ports = [{"name": "dns", "port": 53, "protocol": "UDP"}, {"name": "dns-tcp", "port": 53, "protocol": "TCP"}]
    return [
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": {"name": "ftjob:coredns"},
         "rules": [{"apiGroups": [""], "resources": ["services", "endpoints", "pods", "namespaces"],
                    "verbs": ["list", "watch"]},
                   {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["list", "watch"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
         "metadata": {"name": "ftjob:coredns"},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "ftjob:coredns"},
         "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": USER}]},
        {"apiVersion": "v1", "kind": "Service",
         "metadata": {"name": "kube-dns", "namespace": "kube-system", "labels": {"k8s-app": "kube-dns"}},
         "spec": {"clusterIP": s.dns_service_ip, "ports": [{**p, "targetPort": 53} for p in ports]}},
        {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
         "metadata": {"name": "kube-dns-coredns", "namespace": "kube-system",
                      "labels": {"kubernetes.io/service-name": "kube-dns",
                                 "endpointslice.kubernetes.io/managed-by": "hack-cluster.ftjob.dev"}},
         "addressType": "IPv4", "ports": ports,
         "endpoints": [{"addresses": [s.host_ip], "conditions": {"ready": True}}]},
    ]  # fmt: skip


def argv(s: Settings) -> list[str]:
    return [f"{s.bin_dir}/coredns", "-conf", str(s.root / "Corefile")]


def pid_file(s: Settings) -> Path:
    return s.root / "run" / "coredns.pid"


def log_file(s: Settings) -> Path:
    return s.root / "logs" / "coredns.log"


def ready(s: Settings) -> bool:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{s.coredns_ready_port}/ready", timeout=2) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def ensure(s: Settings, env: dict[str, str], t0: float) -> None:
    """Apply the RBAC and Service, then start CoreDNS unless it runs, and wait until it serves."""
    subprocess.run([f"{s.venv}/bin/kubectl", f"--kubeconfig={s.kubeconfig}", "apply", "--server-side",
                    "--force-conflicts", "-f", "-"], input=json.dumps({"apiVersion": "v1", "kind": "List",
                   "items": manifests(s)}), text=True, check=True, capture_output=True)  # fmt: skip
    pki.write_kubeconfig(s, s.root / "coredns.kubeconfig", "coredns", "coredns")
    (s.root / "Corefile").write_text(corefile(s))
    if procs.read(pid_file(s)) is None:
        procs.start("coredns", argv(s), log_file(s), pid_file(s), env)
        print(f"[cluster {time.monotonic() - t0:5.1f}s] started coredns on {s.host_ip}:53", flush=True)
    deadline = time.monotonic() + 60
    while not ready(s):
        if procs.read(pid_file(s)) is None:
            raise SystemExit(f"error: coredns exited; last log lines:\n{procs.log_tail(log_file(s))}")
        if time.monotonic() > deadline:
            raise SystemExit(f"error: coredns not ready after 60s; see {log_file(s)}")
        time.sleep(0.2)
