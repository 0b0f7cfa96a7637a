"""Each node's private mount namespace, and the host paths it needs.

A kubelet hard-codes a few host paths (`/var/lib/kubelet/device-plugins`, `/var/log/pods`, `/var/log/containers`)
that would collide between two nodes on one machine. Every node's containerd and kubelet therefore run in a mount
namespace of their own (kept alive by a bind mount of its nsfs file, as `ip netns` does for network namespaces) in
which the node's own folders are bind-mounted over those paths. Mounts the kubelet and containerd make (volumes,
container root filesystems) stay inside it and vanish with it.

The host paths themselves (empty folders) are created when missing and removed again by the last cluster's `down`;
`<REGISTRY>` records who created them and which clusters use them.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from clusterlib.settings import Settings

KUBELET_HOST_PATHS = ("/var/lib/kubelet/device-plugins", "/var/log/pods", "/var/log/containers")
REGISTRY = Path("/run/ftjob-cluster-hostpaths.json")


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(list(argv), capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise SystemExit(f"error: `{' '.join(argv)}` failed: {proc.stderr.strip()}")
    return proc


def is_mountpoint(path: Path) -> bool:
    return _run("mountpoint", "-q", str(path), check=False).returncode == 0


def ns_dir(s: Settings) -> Path:
    return s.root / "mntns"


def ns_file(s: Settings, n: int) -> Path:
    return ns_dir(s) / s.node_name(n)


def node_binds(s: Settings, n: int) -> list[tuple[Path, str]]:
    """(node's own folder, host path it replaces inside the node's mount namespace)."""
    d = s.node_dir(n)
    return [(d / "device-plugins", KUBELET_HOST_PATHS[0]), (d / "log" / "pods", KUBELET_HOST_PATHS[1]),
            (d / "log" / "containers", KUBELET_HOST_PATHS[2])]  # fmt: skip


def ensure_node_ns(s: Settings, n: int) -> None:
    """Create node N's mount namespace (once) and its bind mounts (each checked, so re-running repairs)."""
    d = ns_dir(s)
    d.mkdir(parents=True, exist_ok=True)
    if not is_mountpoint(d):  # nsfs bind mounts need a parent mount with private propagation
        _run("mount", "--bind", str(d), str(d))
        _run("mount", "--make-private", str(d))
    f = ns_file(s, n)
    if not is_mountpoint(f):
        f.touch()
        _run("unshare", f"--mount={f}", "--propagation", "private", "true")
        # the new namespace copied the other nodes' nsfs mounts: drop them so it never keeps those alive
        _run("nsenter", f"--mount={f}", "--", "umount", "-l", str(d))
    for src, dst in node_binds(s, n):
        src.mkdir(parents=True, exist_ok=True)
        if in_node(s, n, "mountpoint", "-q", dst, check=False).returncode != 0:
            in_node(s, n, "mount", "--bind", str(src), dst)


def in_node(s: Settings, n: int, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run a command inside node N's mount and network namespaces."""
    return _run(*node_prefix(s, n), *argv, check=check)


def node_prefix(s: Settings, n: int) -> list[str]:
    """The nsenter prefix that starts a process inside node N (its mount and network namespaces)."""
    return ["nsenter", f"--mount={ns_file(s, n)}", f"--net=/run/netns/{s.node_netns(n)}", "--"]


def remove_node_ns(s: Settings, n: int) -> None:
    """Drop node N's mount namespace: with no process left in it, every mount inside goes with it."""
    f = ns_file(s, n)
    if is_mountpoint(f):
        _run("umount", "-l", str(f), check=False)
    f.unlink(missing_ok=True)


def remove_ns_dir(s: Settings) -> None:
    d = ns_dir(s)
    if d.exists():
        for f in d.iterdir():
            if is_mountpoint(f):
                _run("umount", "-l", str(f), check=False)
        if is_mountpoint(d):
            _run("umount", "-l", str(d), check=False)
        for f in d.iterdir():
            f.unlink(missing_ok=True)
        d.rmdir()


@contextmanager
def _registry() -> Iterator[dict]:
    with open(REGISTRY.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        data = json.loads(REGISTRY.read_text()) if REGISTRY.exists() else {"created": [], "users": []}
        yield data
        if data["users"] or data["created"]:
            REGISTRY.write_text(json.dumps(data, indent=2) + "\n")
        else:
            REGISTRY.unlink(missing_ok=True)
            REGISTRY.with_suffix(".lock").unlink(missing_ok=True)


def clashing_clusters(s: Settings) -> list[Path]:
    """Other clusters on this machine that share a host-wide name (bridge or netns prefix) with `s`."""
    found = []
    with _registry() as reg:
        for root in reg["users"]:
            other = Path(root) / "cluster.json"
            if root == str(s.root) or not other.exists():
                continue
            theirs = json.loads(other.read_text())
            if theirs.get("bridge") == s.bridge or theirs.get("netns_prefix") == s.netns_prefix:
                found.append(Path(root))
    return found


def refuse_clashing_cluster(s: Settings) -> None:
    """Two clusters on one machine must differ in every name they share the host with (bridge, netns prefix)."""
    for root in clashing_clusters(s):
        raise SystemExit(
            f"error: the cluster in {root} uses the same bridge/netns names ({s.bridge}, {s.netns_prefix}); "
            "run `hack/cluster down` there first (FTJOB_CLUSTER_DIR selects it), or set FTJOB_BRIDGE, "
            "FTJOB_NETNS_PREFIX, FTJOB_SUBNET_PREFIX and FTJOB_PORT_OFFSET for a second cluster"
        )


def acquire_host_paths(s: Settings) -> None:
    with _registry() as reg:
        for path in KUBELET_HOST_PATHS:
            p = Path(path)
            chain = [q for q in [p, *p.parents] if not q.exists()]
            for q in reversed(chain):
                q.mkdir()
                reg["created"].append(str(q))
        if str(s.root) not in reg["users"]:
            reg["users"].append(str(s.root))


def release_host_paths(s: Settings) -> list[str]:
    """Forget this cluster; the last one out removes the (empty) host folders clusters created. Returns those kept."""
    kept = []
    with _registry() as reg:
        reg["users"] = [u for u in reg["users"] if u != str(s.root)]
        if reg["users"]:
            return []
        for path in sorted(reg["created"], key=lambda p: -p.count("/")):
            try:
                os.rmdir(path)
            except FileNotFoundError:
                pass
            except OSError:
                kept.append(path)  # someone put something there: not ours to delete
        reg["created"] = []
    return kept
