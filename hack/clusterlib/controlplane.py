"""The control-plane components: their command lines, how to start the missing ones, and their health.

Flags follow the brief: short node-monitor and toleration periods so a dead node's pods go within seconds.
"""

from __future__ import annotations

import os
import ssl
import time
import urllib.error
import urllib.request
from pathlib import Path

from clusterlib import procs
from clusterlib.settings import Settings

COMPONENTS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler")


def child_env(s: Settings) -> dict[str, str]:
    """The environment of every process the cluster starts: binaries and the venv first on PATH."""
    env = dict(os.environ)
    env["PATH"] = f"{s.bin_dir}:{s.venv}/bin:{env.get('PATH', '/usr/bin:/bin')}"
    env["KUBECONFIG"] = str(s.kubeconfig)
    env.pop("PYTHONPATH", None)  # pods and agents import the venv's packages, never whatever the caller had
    return env


def argv(s: Settings, component: str) -> list[str]:
    pki, root = s.pki, s.root
    b = f"{s.bin_dir}/{component}"
    etcd_url = f"http://127.0.0.1:{s.etcd_client_port}"
    if component == "etcd":
        peer = f"http://127.0.0.1:{s.etcd_peer_port}"
        return [
            b, "--name=ftjob", f"--data-dir={root / 'etcd'}", "--unsafe-no-fsync",
            f"--listen-client-urls={etcd_url}", f"--advertise-client-urls={etcd_url}",
            f"--listen-peer-urls={peer}", f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=ftjob={peer}", "--log-level=warn",
        ]  # fmt: skip
    if component == "kube-apiserver":
        return [
            b, f"--etcd-servers={etcd_url}",
            f"--bind-address={s.host_ip}", f"--advertise-address={s.host_ip}", "--secure-port=6443",
            f"--tls-cert-file={pki / 'apiserver.crt'}", f"--tls-private-key-file={pki / 'apiserver.key'}",
            f"--client-ca-file={pki / 'ca.crt'}",
            f"--service-cluster-ip-range={s.service_cidr}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={pki / 'sa.pub'}", f"--service-account-signing-key-file={pki / 'sa.key'}",
            "--authorization-mode=Node,RBAC",
            "--enable-admission-plugins=NamespaceLifecycle,LimitRanger,ServiceAccount,DefaultTolerationSeconds,"
            "NodeRestriction,Priority,TaintNodesByCondition,ResourceQuota,MutatingAdmissionWebhook,"
            "ValidatingAdmissionWebhook,ValidatingAdmissionPolicy",
            f"--kubelet-client-certificate={pki / 'apiserver-kubelet-client.crt'}",
            f"--kubelet-client-key={pki / 'apiserver-kubelet-client.key'}",
            f"--kubelet-certificate-authority={pki / 'ca.crt'}",
            "--kubelet-preferred-address-types=InternalIP",
            "--default-not-ready-toleration-seconds=5", "--default-unreachable-toleration-seconds=5",
            # front-proxy trust only for CN=front-proxy-client: without it every component logs a missing-CA error
            f"--requestheader-client-ca-file={pki / 'ca.crt'}", "--requestheader-allowed-names=front-proxy-client",
            "--requestheader-username-headers=X-Remote-User", "--requestheader-group-headers=X-Remote-Group",
            "--requestheader-extra-headers-prefix=X-Remote-Extra-",
            "--allow-privileged=true", "--profiling=false", "--event-ttl=1h",
        ]  # fmt: skip
    if component == "kube-controller-manager":
        kc = str(root / "controller-manager.kubeconfig")
        return [
            b, f"--kubeconfig={kc}", f"--authentication-kubeconfig={kc}", f"--authorization-kubeconfig={kc}",
            f"--root-ca-file={pki / 'ca.crt'}", f"--service-account-private-key-file={pki / 'sa.key'}",
            "--use-service-account-credentials", "--leader-elect=false", "--controllers=*",
            "--node-monitor-period=1s", f"--node-monitor-grace-period={node_monitor_grace(s)}",
            f"--service-cluster-ip-range={s.service_cidr}",
            f"--cluster-signing-cert-file={pki / 'ca.crt'}", f"--cluster-signing-key-file={pki / 'ca.key'}",
            "--bind-address=127.0.0.1", f"--secure-port={s.controller_manager_port}",
            f"--tls-cert-file={pki / 'controller-manager-serving.crt'}",
            f"--tls-private-key-file={pki / 'controller-manager-serving.key'}",
            "--profiling=false",
        ]  # fmt: skip
    if component == "kube-scheduler":
        kc = str(root / "scheduler.kubeconfig")
        return [
            b, f"--kubeconfig={kc}", f"--authentication-kubeconfig={kc}", f"--authorization-kubeconfig={kc}",
            "--leader-elect=false", "--bind-address=127.0.0.1", f"--secure-port={s.scheduler_port}",
            f"--tls-cert-file={pki / 'scheduler-serving.crt'}",
            f"--tls-private-key-file={pki / 'scheduler-serving.key'}",
            "--profiling=false",
        ]  # fmt: skip
    raise ValueError(component)


DEFAULT_NODE_MONITOR_GRACE = "6s"  # short, so a dead node's pods go within seconds in tests of node loss


def node_grace_file(s: Settings) -> Path:
    return s.root / "node-monitor-grace-period"


def node_monitor_grace(s: Settings) -> str:
    """The controller-manager's node-monitor grace period: the cluster's short default, or what `hack/cluster
    node-grace` set (a test that needs Kubernetes' stock 40s, where a dead node stays Ready that long)."""
    path = node_grace_file(s)
    return path.read_text().strip() if path.exists() else DEFAULT_NODE_MONITOR_GRACE


def set_node_monitor_grace(s: Settings, value: str | None, t0: float) -> None:
    """Restarts the controller-manager with another node-monitor grace period (None: the cluster's default)."""
    path = node_grace_file(s)
    if value is None:
        path.unlink(missing_ok=True)
    else:
        path.write_text(value)
    tracked = procs.read(pid_file(s, "kube-controller-manager"))
    if tracked is not None:
        procs.stop([tracked])
    ensure(s, t0)


def pid_file(s: Settings, component: str) -> Path:
    return s.root / "run" / f"{component}.pid"


def log_file(s: Settings, component: str) -> Path:
    return s.root / "logs" / f"{component}.log"


def admin_ssl(s: Settings) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(s.pki / "ca.crt"))
    ctx.load_cert_chain(str(s.pki / "admin.crt"), str(s.pki / "admin.key"))
    return ctx


def _loopback_ssl() -> ssl.SSLContext:
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE  # only a liveness probe of our own process on loopback
    return ctx


def probe(url: str, ctx: ssl.SSLContext | None = None) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2, context=ctx) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def health_url(s: Settings, component: str) -> str:
    return {
        "etcd": f"http://127.0.0.1:{s.etcd_client_port}/health",
        "kube-apiserver": f"{s.api_url}/readyz",
        "kube-controller-manager": f"https://127.0.0.1:{s.controller_manager_port}/healthz",
        "kube-scheduler": f"https://127.0.0.1:{s.scheduler_port}/healthz",
    }[component]


def healthy(s: Settings, component: str) -> bool:
    ctx = None if component == "etcd" else (admin_ssl(s) if component == "kube-apiserver" else _loopback_ssl())
    return procs.read(pid_file(s, component)) is not None and probe(health_url(s, component), ctx)


def wait_healthy(s: Settings, component: str, timeout_s: float, t0: float) -> None:
    deadline, last_note = time.monotonic() + timeout_s, 0.0
    while not healthy(s, component):
        if procs.read(pid_file(s, component)) is None:
            tail = procs.log_tail(log_file(s, component))
            raise SystemExit(f"error: {component} exited during start-up; last log lines:\n{tail}")
        if time.monotonic() > deadline:
            raise SystemExit(f"error: {component} not healthy after {timeout_s:.0f}s; see {log_file(s, component)}")
        if time.monotonic() - last_note > 5:
            last_note = time.monotonic()
            print(f"[cluster {time.monotonic() - t0:5.1f}s] waiting for {component} ...", flush=True)
        time.sleep(0.2)


def ensure(s: Settings, t0: float) -> None:
    """Start every component that is not running, in dependency order, each healthy before the next."""
    (s.root / "run").mkdir(parents=True, exist_ok=True)
    env = child_env(s)
    for component in COMPONENTS:
        if procs.read(pid_file(s, component)) is None:
            procs.start(component, argv(s, component), log_file(s, component), pid_file(s, component), env)
            print(f"[cluster {time.monotonic() - t0:5.1f}s] started {component}", flush=True)
        wait_healthy(s, component, timeout_s=120, t0=t0)


def running(s: Settings) -> list[procs.Tracked]:
    return [t for c in COMPONENTS if (t := procs.read(pid_file(s, c))) is not None]
