"""Container processes: started in the pod's netns and a private mount namespace, watched through pidfds.

`ip netns exec <netns>` switches the network namespace, unshares a mount namespace (slave of the agent's, so the
bind mounts below never leak out) and bind-mounts /etc/netns/<netns>/{hosts,resolv.conf}; a tiny `sh` then bind-mounts
the pod's volumes and execs the command, so the recorded PID is the container's main process. Every container runs
in its own session (setsid): signalling the process group reaches everything it started.
"""

from __future__ import annotations

import asyncio
import os
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from .volumes import Mount

IP = shutil.which("ip") or "/usr/sbin/ip"
SH = shutil.which("sh") or "/bin/sh"

# Pods share the host's filesystem: they run the project's checkout (an editable install) with its Python env. A
# volume mounted over one of these (say an emptyDir at /tmp while the checkout lives in /tmp/x) would hide the pod's
# own code, so such paths are stashed before the volumes are mounted and bound back on top afterwards.
OWN_PATHS = sorted({str(Path(__file__).resolve().parents[3]), sys.prefix, sys.base_prefix})
STASH = "/run/ftjob-nodeagent/keep"


class StartError(RuntimeError):
    """The container could not be started (executable missing, bad workingDir ...)."""


def process_start_time(pid: int) -> int | None:
    """The kernel's start time of a PID (clock ticks since boot), to tell a live process from a reused PID."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def _covers(target: str, path: str) -> bool:
    target = target.rstrip("/") or "/"
    return path == target or path.startswith(target if target == "/" else target + "/")


def wrapper_script(mounts: list[Mount], working_dir: str) -> str:
    lines = ["set -e"]
    hidden = [p for p in OWN_PATHS if any(_covers(m.target, p) for m in mounts)]
    for i, path in enumerate(hidden):
        lines.append(f"mkdir -p {STASH}/{i} && mount --bind {shlex.quote(path)} {STASH}/{i}")
    for m in mounts:
        lines.append(f"mount --bind {shlex.quote(str(m.source))} {shlex.quote(m.target)}")
        if m.read_only:
            lines.append(f"mount -o remount,bind,ro {shlex.quote(m.target)}")
    for i, path in enumerate(hidden):
        lines.append(f"mkdir -p {shlex.quote(path)} && mount --bind {STASH}/{i} {shlex.quote(path)}")
    lines.append(f"cd {shlex.quote(working_dir)}")
    lines.append('exec "$@"')
    return "\n".join(lines)


def prepare_mount_points(mounts: list[Mount]) -> None:
    """Mount points must exist on the (shared) host filesystem; a file is mounted over a file."""
    for m in mounts:
        target = Path(m.target)
        if m.source.is_dir():
            target.mkdir(parents=True, exist_ok=True)
        elif not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            target.touch()


def resolve_executable(argv0: str, env: dict[str, str], working_dir: str) -> None:
    if "/" in argv0:
        path = Path(working_dir, argv0)
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise StartError(f"executable {argv0!r} not found or not executable")
    elif shutil.which(argv0, path=env.get("PATH", "")) is None:
        raise StartError(f"executable {argv0!r} not found in PATH ({env.get('PATH', '')})")


class ContainerProcess:
    """One started (or adopted) container process; `exit_code` resolves when it ends."""

    def __init__(self, pid: int, start_time: int | None, popen: subprocess.Popen | None = None) -> None:
        self.pid = pid
        self.start_time = start_time
        self.popen = popen  # None for a process adopted after an agent restart
        self.exit_code: asyncio.Future[int | None] = asyncio.get_running_loop().create_future()
        self._watch()

    def alive(self) -> bool:
        return self.start_time is not None and process_start_time(self.pid) == self.start_time

    def signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def _finish(self) -> None:
        if self.exit_code.done():
            return
        if self.popen is None:
            self.exit_code.set_result(None)  # not our child: the exit code is unknowable
            return
        rc = self.popen.wait()  # already exited: returns at once and reaps the zombie
        self.exit_code.set_result(128 - rc if rc < 0 else rc)

    def _watch(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            fd = os.pidfd_open(self.pid)
        except ProcessLookupError:
            loop.call_soon(self._finish)
            return
        if self.popen is None and not self.alive():
            os.close(fd)  # the PID now belongs to an unrelated process: ours is gone
            loop.call_soon(self._finish)
            return

        def on_exit() -> None:
            loop.remove_reader(fd)
            os.close(fd)
            self._finish()

        loop.add_reader(fd, on_exit)


def spawn(
    argv: list[str],
    *,
    netns: str,
    env: dict[str, str],
    mounts: list[Mount],
    working_dir: str,
    log_path: Path,
) -> ContainerProcess:
    resolve_executable(argv[0], env, working_dir)
    if not Path(working_dir).is_dir():
        Path(working_dir).mkdir(parents=True, exist_ok=True)
    prepare_mount_points(mounts)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    full = [IP, "netns", "exec", netns, SH, "-c", wrapper_script(mounts, working_dir), "sh", *argv]
    with open(log_path, "ab") as logf:
        popen = subprocess.Popen(
            full,
            stdin=subprocess.DEVNULL,
            stdout=logf,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            close_fds=True,
        )
    return ContainerProcess(popen.pid, process_start_time(popen.pid), popen)


async def stop_group(proc: ContainerProcess, grace_s: float) -> None:
    """SIGTERM the group, wait up to grace_s for the main process, then SIGKILL whatever is left of the group."""
    if not proc.exit_code.done():
        proc.signal_group(signal.SIGTERM)
        try:
            await asyncio.wait_for(asyncio.shield(proc.exit_code), timeout=max(grace_s, 0.0))
        except TimeoutError:
            pass
    proc.signal_group(signal.SIGKILL)  # also reaps leftovers of a main process that already exited
    await proc.exit_code
