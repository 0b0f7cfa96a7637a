"""A real node: containerd + runc + the CNI bridge, a kubelet, kube-proxy and a fake-GPU device plugin, all inside the
node's network namespace (and, but for kube-proxy's iptables which need only the netns, its mount namespace).

Per node N everything lives in <state>/nodes/<node>/: containerd's root, state, socket and runc root, the CNI
config and IPAM state, the kubelet's root dir, its log folders, and the config files written here.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

from clusterlib import cgroups, mounts, pki, procs
from clusterlib.settings import Settings

CNI_BIN = "/usr/lib/cni"
KUBELET_PORT = 10250
# Registries a node might try to pull from: all pointed at a closed loopback port, so an image that was not imported
# fails at once with a real ErrImagePull instead of reaching out of the machine.
REGISTRY_HOSTS = ("ftjob.local", "docker.io", "registry.k8s.io", "quay.io", "ghcr.io", "gcr.io", "nvcr.io")
COMPONENTS = ("containerd", "kubelet", "kube-proxy", "gpu-plugin")


def node_dir(s: Settings, n: int) -> Path:
    return s.node_dir(n)


def sock(s: Settings, n: int) -> Path:
    return node_dir(s, n) / "containerd" / "containerd.sock"


def pid_file(s: Settings, n: int, component: str) -> Path:
    return node_dir(s, n) / f"{component}.pid"


def log_file(s: Settings, n: int, component: str) -> Path:
    return s.root / "logs" / f"{s.node_name(n)}-{component}.log"


def cgroup_root(s: Settings, n: int) -> str:
    return s.node_name(n)


def host_resources() -> tuple[int, int]:
    """(CPUs, memory bytes) of this machine."""
    with open("/proc/meminfo") as meminfo:
        mem_kb = next(int(line.split()[1]) for line in meminfo if line.startswith("MemTotal:"))
    return os.cpu_count() or 1, mem_kb * 1024


def reserved(s: Settings) -> dict[str, str]:
    """systemReserved that leaves each node its share of this machine's CPUs and memory (after 2 GiB for the control
    plane and the host), so the scheduler's view matches what the nodes really share."""
    cpus, mem = host_resources()
    share_mem = max(1 << 30, (mem - (2 << 30)) // s.nodes)
    share_cpu_m = max(250, cpus * 1000 // s.nodes)
    return {"cpu": f"{max(0, cpus * 1000 - share_cpu_m)}m", "memory": f"{max(0, mem - share_mem) >> 20}Mi"}


def containerd_config(s: Settings, n: int, pause_ref: str) -> str:
    d = node_dir(s, n)
    section = '[plugins."io.containerd.grpc.v1.cri".registry.mirrors'
    mirrors = "".join(f'\n  {section}."{h}"]\n    endpoint = ["http://127.0.0.1:1"]' for h in REGISTRY_HOSTS)
    return f"""version = 2
root = "{d}/containerd/root"
state = "{d}/containerd/state"
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper",
  "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing"]
[grpc]
  address = "{sock(s, n)}"
[ttrpc]
  address = "{sock(s, n)}.ttrpc"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{pause_ref}"
  # this VM withholds CAP_SYS_RESOURCE: runc may only raise a container's oom_score_adj, never lower it
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  enable_cdi = false
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
        Root = "{d}/runc"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{CNI_BIN}"
    conf_dir = "{d}/cni/net.d"
  [plugins."io.containerd.grpc.v1.cri".registry]{mirrors}
"""


def cni_config(s: Settings, n: int) -> dict:
    return {
        "cniVersion": "1.0.0",
        "name": f"{s.node_name(n)}-pods",
        "plugins": [
            {
                "type": "bridge",
                "bridge": s.bridge,  # made by netsetup with a fixed MAC; the plugin adopts it
                "isGateway": True,
                "ipMasq": False,  # pods are routed, never NATed: their IPs are the cluster's own
                "hairpinMode": True,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": s.pod_cidr(n), "gateway": s.pod_gateway(n)}]],
                    "routes": [{"dst": "0.0.0.0/0"}],
                    "dataDir": str(node_dir(s, n) / "cni" / "ipam"),
                },
            },
            {"type": "portmap", "capabilities": {"portMappings": True}},
        ],
    }


def kubelet_config(s: Settings, n: int) -> dict:
    d, node = node_dir(s, n), s.node_name(n)
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "failCgroupV1": False,  # this VM runs cgroup v1 (hybrid)
        "cgroupDriver": "cgroupfs",
        "cgroupRoot": f"/{cgroup_root(s, n)}",
        "cgroupsPerQOS": True,
        "failSwapOn": False,
        "address": s.node_ip(n),
        "port": KUBELET_PORT,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": 10248,
        "tlsCertFile": str(s.pki / f"{node}-serving.crt"),
        "tlsPrivateKeyFile": str(s.pki / f"{node}-serving.key"),
        "authentication": {
            "anonymous": {"enabled": False},
            "webhook": {"enabled": True},
            "x509": {"clientCAFile": str(s.pki / "ca.crt")},
        },
        "authorization": {"mode": "Webhook"},
        "clusterDomain": "cluster.local",
        "clusterDNS": [s.dns_service_ip],
        "resolvConf": str(d / "resolv.conf"),
        "containerRuntimeEndpoint": f"unix://{sock(s, n)}",
        "maxPods": 110,
        "podCIDR": s.pod_cidr(n),
        # the controller-manager's node-monitor grace period is 6 s: renew the lease every second
        "nodeLeaseDurationSeconds": 4,
        "nodeStatusUpdateFrequency": "2s",
        "nodeStatusReportFrequency": "10s",
        "syncFrequency": "10s",
        "evictionHard": {
            "memory.available": "100Mi",
            "nodefs.available": "1%",
            "imagefs.available": "1%",
            "nodefs.inodesFree": "1%",
        },
        # images were imported, not pulled: nothing could bring them back, so never garbage-collect them
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "serializeImagePulls": False,
        "systemReserved": reserved(s),
        "enforceNodeAllocatable": ["pods"],
        "volumePluginDir": str(d / "volume-plugins"),
        "containerLogMaxSize": "10Mi",
        "shutdownGracePeriod": "0s",
        "registerNode": True,
    }


def kube_proxy_config(s: Settings, n: int) -> dict:
    return {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "kind": "KubeProxyConfiguration",
        "mode": "iptables",
        "clusterCIDR": f"{s.subnet_prefix}.0.0/16",
        "hostnameOverride": s.node_name(n),
        "bindAddress": s.node_ip(n),
        "metricsBindAddress": "127.0.0.1:10249",
        "healthzBindAddress": "127.0.0.1:10256",
        "clientConnection": {"kubeconfig": str(node_dir(s, n) / "kube-proxy.kubeconfig")},
        # masquerade Service traffic, so replies always come back through the node that translated it
        "iptables": {"masqueradeAll": True, "minSyncPeriod": "0s", "syncPeriod": "30s"},
        # leave the (machine-wide) conntrack sysctls alone
        "conntrack": {"maxPerCore": 0, "min": 0, "tcpEstablishedTimeout": "0s", "tcpCloseWaitTimeout": "0s"},
    }


def write_configs(s: Settings, n: int, pause_ref: str) -> None:
    d = node_dir(s, n)
    for sub in ("containerd", "cni/net.d", "cni/ipam", "kubelet", "volume-plugins", "runc"):
        (d / sub).mkdir(parents=True, exist_ok=True)
    (d / "containerd" / "config.toml").write_text(containerd_config(s, n, pause_ref))
    (d / "cni" / "net.d" / "10-ftjob.conflist").write_text(json.dumps(cni_config(s, n), indent=2) + "\n")
    (d / "kubelet-config.json").write_text(json.dumps(kubelet_config(s, n), indent=2) + "\n")
    (d / "kube-proxy-config.json").write_text(json.dumps(kube_proxy_config(s, n), indent=2) + "\n")
    (d / "resolv.conf").write_text(f"nameserver {s.host_ip}\n")  # dnsPolicy Default: our DNS, never the host's
    pki.write_kubeconfig(s, d / "kube-proxy.kubeconfig", "kube-proxy", "kube-proxy")


def argv(s: Settings, n: int, component: str) -> list[str]:
    d, b = node_dir(s, n), s.bin_dir
    prefix = mounts.node_prefix(s, n)
    if component == "containerd":
        return [*prefix, "containerd", "--config", str(d / "containerd" / "config.toml")]
    if component == "kubelet":
        return [
            *prefix, f"{b}/kubelet", f"--config={d / 'kubelet-config.json'}",
            f"--kubeconfig={pki.node_kubeconfig(s, n)}", f"--hostname-override={s.node_name(n)}",
            f"--node-ip={s.node_ip(n)}", f"--root-dir={d / 'kubelet'}", f"--cert-dir={d / 'kubelet' / 'pki'}",
            "--v=1",
        ]  # fmt: skip
    if component == "kube-proxy":
        return [*prefix, f"{b}/kube-proxy", f"--config={d / 'kube-proxy-config.json'}", "--v=1"]
    if component == "gpu-plugin":
        return [*prefix, f"{b}/fake-gpu-plugin", f"--count={s.gpus_per_node}", "--resource=nvidia.com/gpu"]
    raise ValueError(component)


def start_missing(s: Settings, n: int, env: dict[str, str], say, components: tuple[str, ...]) -> None:
    """Start whichever of node N's `components` is not running (containerd: and wait for its socket)."""
    cgroups.ensure(cgroup_root(s, n))
    mounts.ensure_node_ns(s, n)
    for component in components:
        if component == "gpu-plugin" and s.gpus_per_node == 0:
            continue
        if procs.read(pid_file(s, n, component)) is None:
            procs.start(f"{component} {s.node_name(n)}", argv(s, n, component), log_file(s, n, component),
                        pid_file(s, n, component), env)  # fmt: skip
            say(f"started {component} on {s.node_name(n)}")
        if component == "containerd":
            wait_socket(s, n)


def _answers(path: Path) -> bool:
    """True if something accepts connections on the unix socket (a killed containerd leaves its file behind)."""
    try:
        with socket.socket(socket.AF_UNIX) as conn:
            conn.settimeout(1)
            conn.connect(str(path))
        return True
    except OSError:
        return False


def wait_socket(s: Settings, n: int, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not _answers(sock(s, n)):
        if procs.read(pid_file(s, n, "containerd")) is None:
            tail = procs.log_tail(log_file(s, n, "containerd"))
            raise SystemExit(f"error: containerd of {s.node_name(n)} exited; last log lines:\n{tail}")
        if time.monotonic() > deadline:
            raise SystemExit(f"error: containerd of {s.node_name(n)} has no socket after {timeout_s:.0f}s")
        time.sleep(0.1)


def running(s: Settings, n: int) -> list[procs.Tracked]:
    return [t for c in COMPONENTS if (t := procs.read(pid_file(s, n, c))) is not None]


def ctr(s: Settings, n: int, *args: str) -> list[str]:
    return ["ctr", f"--address={sock(s, n)}", "--namespace=k8s.io", *args]
