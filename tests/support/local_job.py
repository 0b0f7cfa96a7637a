"""A real lighthouse and replica groups running tests/support/manager_worker.py, as local processes on loopback."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from ftjob.contract.lighthouse_api import StatusResponse

from tests.support.paths import importable_env
from tests.support.polling import StopWaiting, wait_for

TOKEN = "test-token"
OPERATOR_TOKEN = (
    "test-operator-token"  # the lighthouse's membership API takes only this one (ftjob.lighthouse.api.auth)
)
WORKER = "tests.support.manager_worker"  # run as a module: it imports tests.support


class Lighthouse:
    """A real `python -m ftjob.lighthouse` process on loopback; ``port=0`` picks a free port. ``request`` sends the
    operator's token on the membership API and the job's (worker) token elsewhere, unless given another."""

    def __init__(
        self, workdir: Path, *args: str, port: int = 0, token: str = TOKEN, operator_token: str = OPERATOR_TOKEN
    ) -> None:
        self.workdir, self.args, self.token, self.operator_token = workdir, list(args), token, operator_token
        self.port = port
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self) -> Lighthouse:
        self.starts += 1
        log = self.workdir / f"lighthouse-{self.starts}.log"
        env = {**os.environ, "FTJOB_TOKEN": self.token, "FTJOB_OPERATOR_TOKEN": self.operator_token}
        cmd = [sys.executable, "-m", "ftjob.lighthouse", "--bind", f"127.0.0.1:{self.port}", *self.args]
        self.proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env)

        def listening() -> int | None:
            if self.proc is not None and self.proc.poll() is not None:
                raise StopWaiting(f"lighthouse exited {self.proc.returncode}: {log.read_text()}")
            m = re.search(r"listening on 127\.0\.0\.1:(\d+)", log.read_text())
            return int(m.group(1)) if m else None

        self.port = wait_for(listening, 60, "the lighthouse to listen", interval=0.05)
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def request(
        self, method: str, path: str, body: Any = None, token: str | None = None, raw: bytes | None = None
    ) -> tuple[int, Any]:
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        req = urllib.request.Request(self.url + path, data=data, method=method)
        if data is not None:
            req.add_header("Content-Type", "application/json")
        membership = path.startswith("/v1/membership/")
        tok = (self.operator_token if membership else self.token) if token is None else token
        if tok:
            req.add_header("Authorization", f"Bearer {tok}")
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                payload = resp.read()
                status = resp.status
        except urllib.error.HTTPError as e:
            payload, status = e.read(), e.code
        try:
            return status, json.loads(payload)
        except ValueError:
            return status, payload.decode()

    def status(self) -> StatusResponse:
        code, body = self.request("GET", "/v1/status")
        assert code == 200, body
        return StatusResponse.model_validate(body)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)


class Worker:
    """One replica group (one rank) running manager_worker's training loop."""

    def __init__(
        self,
        workdir: Path,
        lighthouse_url: str,
        group: str,
        *args: str,
        env: dict[str, str] | None = None,
        command: list[str] | None = None,
    ) -> None:
        """``command``: another program with this one's CLI and events (the benches' torchft worker)."""
        self.group = group
        self.log = workdir / f"worker-{group}-{time.monotonic_ns()}.log"
        program = command or [sys.executable, "-m", WORKER]
        cmd = [*program, "--group", group, "--lighthouse", lighthouse_url, *args]
        # One OpenMP thread, as ftjob's launcher gives its ranks (ftjob.launch.procs) and the benches torchft's groups:
        # left to torch's default, each of these tiny-model ranks spun a second OpenMP thread and took 0.53 of a core
        # instead of 0.17 -- on a 2-core machine, CPU that a restarting group's imports (bench_failover) wait for.
        env = importable_env({**os.environ, "FTJOB_TOKEN": TOKEN, "OMP_NUM_THREADS": "1", **(env or {})})
        self.proc = subprocess.Popen(cmd, stdout=self.log.open("wb"), stderr=subprocess.STDOUT, env=env)
        self._events: list[dict[str, Any]] = []
        self._read = 0  # bytes of the log parsed so far: a poll parses only what is new (benches poll long logs)

    def events(self, kind: str | None = None) -> list[dict[str, Any]]:
        with self.log.open("rb") as f:
            f.seek(self._read)
            new = f.read()
        complete = new[: new.rfind(b"\n") + 1]  # a line still being written is parsed on a later call
        self._read += len(complete)
        for line in complete.decode(errors="replace").splitlines():
            if line.startswith("{"):
                self._events.append(json.loads(line))
        return [e for e in self._events if kind is None or e["event"] == kind]

    def last_step(self) -> int:
        steps = self.events("step")
        return steps[-1]["step"] if steps else 0

    def done(self) -> dict[str, Any] | None:
        if self.proc.poll() not in (None, 0):
            raise StopWaiting(f"worker {self.group} exited {self.proc.returncode}: {self.log.read_text()[-3000:]}")
        found = self.events("done")
        return found[0] if found else None

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(30)
