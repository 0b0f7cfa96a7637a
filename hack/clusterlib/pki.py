"""Certificates and kubeconfigs for the cluster, made with the `openssl` CLI (EC P-256: fast to generate).

Everything is created once and reused by later `up`s; a missing file is recreated on its own.
"""

from __future__ import annotations

import base64
import json
import secrets
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from clusterlib.settings import Settings

DAYS = "3650"


def _openssl(*args: str) -> None:
    proc = subprocess.run(["openssl", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"error: openssl {' '.join(args[:2])} failed: {proc.stderr.strip()}")


def _key(path: Path) -> None:
    if not path.exists():
        _openssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", str(path))
        path.chmod(0o600)


@dataclass(frozen=True)
class Leaf:
    """One certificate to sign with the cluster CA."""

    name: str  # file stem under pki/
    subject: str  # e.g. /O=system:masters/CN=ftjob-admin
    server: bool = False
    client: bool = False
    sans: tuple[str, ...] = ()  # "DNS:x" / "IP:y"


def _ensure_ca(pki: Path) -> None:
    _key(pki / "ca.key")
    if not (pki / "ca.crt").exists():
        _openssl(
            "req", "-x509", "-new", "-key", str(pki / "ca.key"), "-subj", "/CN=ftjob-cluster-ca", "-days", DAYS,
            "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign,digitalSignature",
            "-out", str(pki / "ca.crt"),
        )  # fmt: skip


def _ensure_leaf(pki: Path, leaf: Leaf) -> None:
    crt = pki / f"{leaf.name}.crt"
    key = pki / f"{leaf.name}.key"
    _key(key)
    if crt.exists():
        return
    usages = [u for u, on in (("serverAuth", leaf.server), ("clientAuth", leaf.client)) if on]
    ext = [
        "basicConstraints=critical,CA:FALSE",
        "keyUsage=critical,digitalSignature,keyEncipherment",
        f"extendedKeyUsage={','.join(usages)}",
    ]
    if leaf.sans:
        ext.append("subjectAltName=" + ",".join(leaf.sans))
    with tempfile.TemporaryDirectory() as tmp:
        csr, extfile = Path(tmp) / "req.csr", Path(tmp) / "ext.cnf"
        extfile.write_text("\n".join(ext) + "\n")
        _openssl("req", "-new", "-key", str(key), "-subj", leaf.subject, "-out", str(csr))
        _openssl(
            "x509", "-req", "-in", str(csr), "-CA", str(pki / "ca.crt"), "-CAkey", str(pki / "ca.key"),
            "-set_serial", str(secrets.randbits(63)), "-days", DAYS, "-extfile", str(extfile), "-out", str(crt),
        )  # fmt: skip


def control_plane_leaves(s: Settings) -> list[Leaf]:
    api_sans = (
        f"IP:{s.host_ip}", "IP:127.0.0.1", f"IP:{s.service_ip}", "DNS:kubernetes", "DNS:kubernetes.default",
        "DNS:kubernetes.default.svc", "DNS:kubernetes.default.svc.cluster.local", "DNS:localhost",
    )  # fmt: skip
    return [
        Leaf("apiserver", "/CN=kube-apiserver", server=True, sans=api_sans),
        Leaf("admin", "/O=system:masters/CN=ftjob-admin", client=True),
        Leaf("controller-manager", "/CN=system:kube-controller-manager", client=True),
        Leaf("scheduler", "/CN=system:kube-scheduler", client=True),
        Leaf("apiserver-kubelet-client", "/O=system:masters/CN=kube-apiserver-kubelet-client", client=True),
        Leaf("controller-manager-serving", "/CN=kube-controller-manager", server=True, sans=("IP:127.0.0.1",)),
        Leaf("scheduler-serving", "/CN=kube-scheduler", server=True, sans=("IP:127.0.0.1",)),
        Leaf("kube-proxy", "/CN=system:kube-proxy", client=True),  # bound to system:node-proxier by default
        Leaf("coredns", "/CN=ftjob:coredns", client=True),
    ]


def node_leaves(s: Settings, n: int) -> list[Leaf]:
    node = s.node_name(n)
    return [
        Leaf(
            f"{node}-serving",
            f"/O=system:nodes/CN=system:node:{node}",
            server=True,
            sans=(f"IP:{s.node_ip(n)}", f"DNS:{node}"),
        ),
        Leaf(f"{node}-client", f"/O=system:nodes/CN=system:node:{node}", client=True),
    ]


def ensure(s: Settings) -> None:
    """Create whatever certificate, key or kubeconfig is missing."""
    s.pki.mkdir(parents=True, exist_ok=True)
    s.pki.chmod(0o700)
    _ensure_ca(s.pki)
    for leaf in control_plane_leaves(s) + [leaf for n in range(1, s.nodes + 1) for leaf in node_leaves(s, n)]:
        _ensure_leaf(s.pki, leaf)
    _key(s.pki / "sa.key")
    if not (s.pki / "sa.pub").exists():
        _openssl("pkey", "-in", str(s.pki / "sa.key"), "-pubout", "-out", str(s.pki / "sa.pub"))
    write_kubeconfig(s, s.kubeconfig, "admin", "ftjob-admin")
    write_kubeconfig(s, s.root / "controller-manager.kubeconfig", "controller-manager", "controller-manager")
    write_kubeconfig(s, s.root / "scheduler.kubeconfig", "scheduler", "scheduler")
    for n in range(1, s.nodes + 1):
        s.node_dir(n).mkdir(parents=True, exist_ok=True)
        write_kubeconfig(s, node_kubeconfig(s, n), f"{s.node_name(n)}-client", s.node_name(n))


def node_kubeconfig(s: Settings, n: int) -> Path:
    return s.node_dir(n) / "kubeconfig"


def _b64(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


def write_kubeconfig(s: Settings, path: Path, cert_stem: str, user: str) -> None:
    """A self-contained kubeconfig (certs embedded) for the client cert `cert_stem`; JSON is valid YAML."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {"name": "ftjob", "cluster": {"server": s.api_url, "certificate-authority-data": _b64(s.pki / "ca.crt")}}
        ],
        "users": [
            {
                "name": user,
                "user": {
                    "client-certificate-data": _b64(s.pki / f"{cert_stem}.crt"),
                    "client-key-data": _b64(s.pki / f"{cert_stem}.key"),
                },
            }
        ],
        "contexts": [{"name": "ftjob", "context": {"cluster": "ftjob", "user": user}}],
        "current-context": "ftjob",
    }
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(config, indent=2) + "\n")
    tmp.chmod(0o600)
    tmp.replace(path)
