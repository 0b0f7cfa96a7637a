"""Leave the private mount namespace `ip netns exec` gave the agent.

hack/cluster starts the agent with `ip netns exec ftj-node-N`, which puts it in a new mount namespace that only
*receives* mounts from the host. Pod netns created there (`ip netns add` bind-mounts /run/netns/<name>) would be
invisible to hack/cluster and lost when the agent restarts. So, before any thread exists, the agent joins the mount
namespace of its nearest ancestor that has a different one (the host's); its network namespace stays the node's.
"""

from __future__ import annotations

import ctypes
import os

CLONE_NEWNS = 0x00020000


def _parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
        stat = f.read()
    return int(stat.rsplit(")", 1)[1].split()[1])


def join_host_mount_namespace() -> str:
    """Joins the first ancestor's mount namespace that differs from ours; returns what happened, for the log."""
    own = os.readlink("/proc/self/ns/mnt")
    pid = os.getppid()
    while pid > 1:
        try:
            theirs = os.readlink(f"/proc/{pid}/ns/mnt")
        except OSError:
            break
        if theirs != own:
            fd = os.open(f"/proc/{pid}/ns/mnt", os.O_RDONLY)
            try:
                libc = ctypes.CDLL(None, use_errno=True)
                if libc.setns(fd, CLONE_NEWNS) != 0:
                    err = ctypes.get_errno()
                    return f"could not join mount namespace of pid {pid}: {os.strerror(err)}"
            finally:
                os.close(fd)
            os.chdir("/")
            return f"joined the mount namespace of pid {pid} ({theirs})"
        try:
            pid = _parent_of(pid)
        except OSError:
            break
    return f"kept own mount namespace {own}"
