"""Starting and stopping the cluster's processes, tracked by PID files that also record each process's start time.

The start time (field 22 of /proc/PID/stat) guards against PID reuse: `down` never signals a process it did not
start, even if the PID now belongs to something else.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path


def start_ticks(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name (field 2) may contain spaces and parentheses: split after its closing ")"
    fields = stat[stat.rindex(")") + 2 :].split()
    if fields[0] == "Z":  # a zombie has exited; it only waits to be reaped
        return None
    return int(fields[19])


def parent_pid(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat[stat.rindex(")") + 2 :].split()[1])


@dataclass(frozen=True)
class Tracked:
    """A process this cluster started."""

    name: str
    pid: int
    ticks: int

    def alive(self) -> bool:
        return start_ticks(self.pid) == self.ticks


def read(pid_file: Path) -> Tracked | None:
    """The process a PID file names, if that very process still runs."""
    try:
        data = json.loads(pid_file.read_text())
    except (OSError, ValueError):
        return None
    tracked = Tracked(data["name"], int(data["pid"]), int(data["ticks"]))
    return tracked if tracked.alive() else None


def start(name: str, argv: list[str], log: Path, pid_file: Path, env: dict[str, str]) -> Tracked:
    """Start `argv` detached (own session, stdin from /dev/null, output appended to `log`) and record it."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out, open(os.devnull, "rb") as devnull:
        out.write(f"\n==== {time.strftime('%H:%M:%S')} starting {name}: {' '.join(argv)}\n".encode())
        out.flush()
        proc = subprocess.Popen(argv, stdin=devnull, stdout=out, stderr=out, env=env, start_new_session=True)
    ticks = start_ticks(proc.pid)
    if ticks is None:
        raise SystemExit(f"error: {name} exited at once; see {log}")
    tracked = Tracked(name, proc.pid, ticks)
    tmp = pid_file.with_suffix(".tmp")
    tmp.write_text(json.dumps({"name": name, "pid": proc.pid, "ticks": ticks, "argv": argv}) + "\n")
    tmp.replace(pid_file)
    return tracked


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` in the process tree (read before killing: orphans get reparented)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            ppid = parent_pid(int(entry))
            if ppid is not None:
                children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_now(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def stop(procs: list[Tracked], grace_s: float = 10.0) -> None:
    """SIGTERM each process, wait up to `grace_s` for all of them, then SIGKILL the rest."""
    live = [p for p in procs if p.alive()]
    for p in live:
        try:
            os.kill(p.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(p.alive() for p in live):
        time.sleep(0.1)
    for p in live:
        if p.alive():
            print(f"  {p.name} (pid {p.pid}) ignored SIGTERM for {grace_s:.0f}s: SIGKILL", flush=True)
            kill_now([p.pid])


def log_tail(path: Path, lines: int = 15) -> str:
    """The last lines of a component's log, for an error message that says why it died."""
    return "".join(path.read_text(errors="replace").splitlines(True)[-lines:])
