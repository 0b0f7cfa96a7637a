"""Local processes for the launcher: one replica group = M rank processes started, watched and killed together."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from ftjob import contract


def free_port() -> int:
    """A TCP port free on loopback right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class GroupProcs:
    """The rank processes of one incarnation of a replica group."""

    group: str
    generation: int
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    logs: list[IO[bytes]] = field(default_factory=list)
    log_paths: list[Path] = field(default_factory=list)

    def exit_codes(self) -> list[int | None]:
        return [p.poll() for p in self.procs]

    def all_exited(self) -> bool:
        return all(c is not None for c in self.exit_codes())

    def failed(self) -> bool:
        """A rank died with a non-zero code (a SIGKILL reads as -9): the group must go as a whole."""
        return any(c not in (None, 0) for c in self.exit_codes())

    def error_tail(self, lines: int = 12) -> list[str]:
        """The last non-empty lines of the first rank that exited non-zero (what it said before dying)."""
        for code, path in zip(self.exit_codes(), self.log_paths, strict=True):
            if code not in (None, 0):
                try:
                    text = path.read_text(errors="replace")
                except OSError:
                    return []
                return [line for line in text.splitlines() if line.strip()][-lines:]
        return []

    def kill(self) -> None:
        """SIGKILL every rank's whole process group (ranks may have children) and reap them."""
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for p in self.procs:
            p.wait()
        self.close_logs()

    def close_logs(self) -> None:
        for f in self.logs:
            f.close()
        self.logs.clear()


def start_group(
    group: str,
    generation: int,
    pods_per_replica: int,
    command: list[str],
    env: dict[str, str],
    log_dir: Path,
) -> GroupProcs:
    """Start the group's ranks with the same environment the operator gives pods (contract.ENV_*).

    Each rank is the leader of its own process group so a kill reaches everything it started. Output goes to
    ``<log_dir>/group-<g>-gen<k>-rank<r>.log`` (rank 0's output is also what the progress line summarises).
    """
    log_dir.mkdir(parents=True, exist_ok=True)
    master_port = free_port()
    gp = GroupProcs(group=group, generation=generation)
    for rank in range(pods_per_replica):
        rank_env = {
            **env,
            contract.ENV_REPLICA_GROUP: group,
            contract.ENV_GENERATION: str(generation),  # 0 first, then one more per restart (the pod label's)
            contract.ENV_RANK: str(rank),
            contract.ENV_LOCAL_RANK: str(rank),
            contract.ENV_WORLD_SIZE: str(pods_per_replica),
            contract.ENV_MASTER_ADDR: "127.0.0.1",
            contract.ENV_MASTER_PORT: str(master_port),
            contract.ENV_ADVERTISE_ADDR: "127.0.0.1",
            "OMP_NUM_THREADS": "1",
        }
        path = log_dir / f"group-{group}-gen{generation}-rank{rank}.log"
        log = open(path, "ab")  # noqa: SIM115 -- kept by gp
        gp.logs.append(log)
        gp.log_paths.append(path)
        gp.procs.append(
            subprocess.Popen(
                command,
                env=rank_env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )
    return gp


def start_lighthouse(args: list[str], env: dict[str, str], log_path: Path) -> tuple[subprocess.Popen[bytes], IO[bytes]]:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log = open(log_path, "ab")  # noqa: SIM115 -- closed by the launcher at the end
    proc = subprocess.Popen(
        [sys.executable, "-m", "ftjob.lighthouse", *args],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    return proc, log
