"""Each node's cgroup root (`/<node name>` in every hierarchy): its kubelet puts every pod below it, so memory limits
are enforced, a node's pods can be found (and killed or frozen) by cgroup, and `down` can remove all of it.

This machine runs cgroup v1 in hybrid mode; kubelet's cgroupfs driver needs the root to exist first in every v1
hierarchy, and cpuset's copy of the parent's cpus and mems.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

CGROUP_FS = Path("/sys/fs/cgroup")


def hierarchies() -> list[Path]:
    """Every mounted cgroup hierarchy (v1 controllers, the named systemd one, and the unified v2 one)."""
    found = []
    with open("/proc/self/mounts") as mounts:
        for line in mounts:
            _, target, fstype, *_ = line.split()
            if fstype in ("cgroup", "cgroup2") and target.startswith(str(CGROUP_FS) + "/"):
                found.append(Path(target))
    return sorted(set(found))


def ensure(root_name: str) -> None:
    for h in hierarchies():
        d = h / root_name
        d.mkdir(exist_ok=True)
        if (h / "cpuset.cpus").exists():
            for f in ("cpuset.cpus", "cpuset.mems"):
                if not (d / f).read_text().strip():
                    (d / f).write_text((h / f).read_text())


def pids(root_name: str, contains: str = "") -> list[int]:
    """Every process in the tree below `root_name` (in cgroup paths containing `contains`, if given)."""
    found: set[int] = set()
    for h in hierarchies():
        top = h / root_name
        if not top.is_dir():
            continue
        for dirpath, _, files in os.walk(top):
            if contains and contains not in dirpath:
                continue
            if "cgroup.procs" in files:
                try:
                    found.update(int(x) for x in Path(dirpath, "cgroup.procs").read_text().split())
                except OSError:
                    continue  # removed while we walked
        if found:
            break  # every process is in every hierarchy: the first populated one lists them all
    return sorted(found)


def remove(root_name: str, timeout_s: float = 10) -> list[str]:
    """rmdir the tree below `root_name` in every hierarchy, deepest first; returns what could not be removed."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = []
        for h in hierarchies():
            top = h / root_name
            if not top.is_dir():
                continue
            for dirpath, _, _ in sorted(os.walk(top), key=lambda w: -w[0].count("/")):
                try:
                    os.rmdir(dirpath)
                except OSError:
                    left.append(dirpath)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)  # a cgroup is busy until the kernel finishes reaping its last process


def leftover_roots(prefix: str) -> list[str]:
    """Node cgroup roots of a cluster (by name prefix) that exist in any hierarchy."""
    return sorted({p.name for h in hierarchies() if h.is_dir() for p in h.iterdir() if p.name.startswith(prefix)})
