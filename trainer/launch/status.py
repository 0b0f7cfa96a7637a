"""What the launcher watches: the lighthouse's status API and the groups' record files in the run dir."""

from __future__ import annotations

import ssl
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from ftjob import contract
from ftjob.contract.lighthouse_api import DroppedEvent, StatusResponse
from ftjob.ft.records import CommitRecord, parse_record
from pydantic import ValidationError


class LighthouseStatus:
    """The launcher's view of its lighthouse: health and the job's committed step."""

    def __init__(self, url: str, token: str, tls: ssl.SSLContext | None = None) -> None:
        self.url, self.token, self.tls = url.rstrip("/"), token, tls

    def _get(self, path: str, timeout: float = 2.0) -> bytes:
        req = urllib.request.Request(self.url + path, headers={"Authorization": f"Bearer {self.token}"})
        with urllib.request.urlopen(req, timeout=timeout, context=self.tls) as resp:
            return resp.read()

    def wait_healthy(self, deadline: float, proc: subprocess.Popen[bytes] | None = None) -> None:
        """Poll /healthz until it answers (or the deadline passes / the process dies: a clear error)."""
        last = ""
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"the lighthouse exited with code {proc.returncode} before serving")
            try:
                self._get(contract.PATH_HEALTH, timeout=1.0)
                return
            except (urllib.error.URLError, OSError) as e:
                last = str(e)
            time.sleep(0.1)  # poll interval
        raise TimeoutError(f"the lighthouse at {self.url} did not become healthy ({last})")

    def status(self) -> StatusResponse | None:
        try:
            return StatusResponse.model_validate_json(self._get(contract.PATH_STATUS))
        except (urllib.error.URLError, OSError, ValidationError):
            return None

    def eviction_since(self, group: str, since: float) -> str | None:
        """Why the lighthouse evicted ``group`` at or after wall time ``since`` (the newest such drop), or None."""
        status = self.status()
        if status is None or status.clock is None:
            return None
        now = time.time()
        for event in reversed(status.history):
            at = now - (status.clock - event.time)
            if isinstance(event, DroppedEvent) and event.group == group and event.reason.startswith("evicted"):
                return event.reason.removeprefix("evicted: ") if at >= since - 1.0 else None  # 1 s: clock skew
        return None

    def committed_step(self, fallback: int) -> int:
        """The job's committed step per the lighthouse (``fallback`` when it cannot be read)."""
        status = self.status()
        return fallback if status is None else status.max_step


class LiveProgress:
    """Tails every ``group-*.jsonl`` in the run dir; prints a progress line every few seconds."""

    def __init__(self, run_dir: Path, every_s: float = 3.0) -> None:
        self.run_dir, self.every_s = run_dir, every_s
        self._offsets: dict[Path, int] = {}
        self.last_commit: dict[str, CommitRecord] = {}
        self.last_start: dict[str, float] = {}
        self.contributed_after_start: dict[str, bool] = {}
        self._window: list[tuple[float, int]] = []  # (t, tokens) of commits seen
        self._next_print = time.monotonic() + every_s

    def _poll(self) -> None:
        for path in sorted(self.run_dir.glob("group-*.jsonl")):
            group = path.stem.removeprefix("group-")
            with open(path, "rb") as f:
                f.seek(self._offsets.get(path, 0))
                chunk = f.read()
            end = chunk.rfind(b"\n") + 1  # only whole lines; a partial one is read next time
            self._offsets[path] = self._offsets.get(path, 0) + end
            for line in chunk[:end].splitlines():
                r = parse_record(line)
                if isinstance(r, CommitRecord):
                    self._take(group, r)

    def mark_started(self, group: str) -> None:
        """The launcher (re)started ``group``: it is not healthy again until it contributes after this moment."""
        self.last_start[group] = time.time()
        self.contributed_after_start[group] = False

    def _take(self, group: str, r: CommitRecord) -> None:
        self.last_commit[group] = r
        if r.contributing:
            if r.t >= self.last_start.get(group, 0.0):
                self.contributed_after_start[group] = True
            self._window.append((r.t, r.tokens))

    def max_step(self) -> int:
        self._poll()
        return max((r.step for r in self.last_commit.values()), default=0)

    def contributing_since_start(self, group: str) -> bool:
        self._poll()
        return self.contributed_after_start.get(group, False)

    def maybe_print(self, steps: int | None) -> None:
        if time.monotonic() < self._next_print:
            return
        self._next_print = time.monotonic() + self.every_s
        self._poll()
        if not self.last_commit:
            print("[launch] waiting for the first commit...", flush=True)
            return
        newest = max(self.last_commit.values(), key=lambda r: r.step)
        now = time.time()
        recent = [n for t, n in self._window if t > now - 10.0]
        self._window = [(t, n) for t, n in self._window if t > now - 10.0]
        losses = [r.loss for r in self.last_commit.values() if r.loss is not None]
        loss = f" loss {sum(losses) / len(losses):.4f}" if losses else ""  # own loops may not report one
        of = f"/{steps}" if steps else ""
        tokens = f" tokens/s {sum(recent) / 10.0:,.0f}" if recent and sum(recent) else ""
        print(
            f"[launch] step {newest.step}{of}{loss} groups {newest.num_contributors}/{newest.participants}{tokens}",
            flush=True,
        )
