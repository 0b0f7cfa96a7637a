"""Not tests: the small training program the manager tests (and hack/bench/bench_failover.py) run in subprocesses,
and the helpers that start it and a real lighthouse as local processes.

    python tests/trainer/test_manager_worker.py --group 0 --lighthouse URL --steps 20 [...]

One replica group of one rank trains a tiny nn.Linear through the real Manager (gloo, loopback). Every step it prints
one JSON line {"event": "step", ...}; at the end {"event": "done", "digest", "step", "metrics"}. Its data is a pure
function of (step, contributor_rank), so groups at the same step hold bitwise-equal parameters.
"""

from __future__ import annotations

import argparse
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

BOOT = time.time()  # interpreter up: what the imports below cost is measured from here ("boot" event)

import torch  # noqa: E402
from ftjob.contract.lighthouse_api import StatusResponse  # noqa: E402
from ftjob.ft.integrity.digest import local_digest as param_digest  # noqa: E402
from ftjob.ft.integrity.digest import replica_tensors  # noqa: E402
from ftjob.ft.step.manager import Manager, ManagerConfig, Terminated  # noqa: E402

IMPORTED = time.time()


def emit(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--group", required=True)
    p.add_argument("--lighthouse", required=True)
    p.add_argument("--token", default=os.environ.get("FTJOB_TOKEN", ""))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--min-replicas", type=int, default=1)
    p.add_argument("--collective-timeout", type=float, default=5.0)
    p.add_argument("--quorum-timeout", type=float, default=60.0)
    p.add_argument("--lost-timeout", type=float, default=600.0)
    p.add_argument("--width", type=int, default=16)
    p.add_argument("--step-delay", type=float, default=0.0, help="pacing: keeps a run long enough to act on")
    p.add_argument("--hang-at-step", type=int, default=-1, help="after joining this step's quorum, hang forever")
    p.add_argument("--pause-at-step", type=int, default=-1, help="before this step, wait until --resume-file exists")
    p.add_argument("--resume-file", default="")
    p.add_argument("--join-file", default="", help="start up, then join the job only once this file exists")
    p.add_argument("--rank", type=int, default=0, help="rank inside the group (HSDP: the model is FSDP2-sharded)")
    p.add_argument("--world-size", type=int, default=1)
    p.add_argument("--master-port", type=int, default=0, help="the group's own rendezvous port (world size > 1)")
    p.add_argument("--digest-every", type=int, default=0, help="state digests every N committed steps (0: none)")
    p.add_argument("--sigterm-at-step", type=int, default=-1, help="SIGTERM to itself in the middle of this step")
    p.add_argument("--own-sigterm-handler", action="store_true", help="a SIGTERM handler of its own (only reports)")
    args = p.parse_args(argv)
    if args.own_sigterm_handler:  # a script's own handler: the Manager must leave it alone
        signal.signal(signal.SIGTERM, lambda *_: emit(event="own_sigterm_handler"))
    # startup timeline (hack/bench/bench_failover.py's rejoin breakdown): interpreter up, imports done
    emit(event="boot", group=args.group, time=BOOT, imported=IMPORTED)

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(args.width, args.width), torch.nn.Linear(args.width, args.width))
    if args.world_size > 1:  # HSDP: shard inside the group, replicate fault-tolerantly across groups
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{args.master_port}", rank=args.rank, world_size=args.world_size
        )
        mesh = init_device_mesh("cpu", (args.world_size,))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)  # torch.optim's first use imports torch._dynamo
    built = time.time()
    data = {"cursor": 0}

    def state_dict() -> dict:
        return {"model": model.state_dict(), "optim": opt.state_dict(), "data": dict(data)}

    def load_state_dict(state: dict) -> None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        data.update(state["data"])

    cfg = ManagerConfig(
        group=args.group,
        rank=args.rank,
        world_size=args.world_size,
        lighthouse_url=args.lighthouse,
        token=args.token,
        min_replicas=args.min_replicas,
        collective_timeout_s=args.collective_timeout,
        quorum_timeout_s=args.quorum_timeout,
        lost_timeout_s=args.lost_timeout,
        digest_every=args.digest_every,
    )
    if args.join_file:  # lets a test start a replacement process ahead and pick the moment it registers
        emit(event="started", group=args.group)
        _wait(lambda: os.path.exists(args.join_file), 600, f"{args.join_file} to exist")
    mgr = Manager(cfg, state_dict, load_state_dict, replica_state=lambda: replica_tensors(model, opt))
    mgr.register_params(model.parameters())  # buckets all-reduced during the backward (one rank per group)
    emit(event="ready", group=args.group, pid=os.getpid(), time=time.time(), built=built,
         handles_sigterm=mgr.handles_sigterm)  # fmt: skip
    try:
        train(args, mgr, model, opt, data)
    except Terminated as e:  # SIGTERM: the group left after its last step event; the process exits 143
        emit(event="terminated", step=mgr.step, why=str(e))
        mgr.shutdown()
        raise
    digest = param_digest(model.parameters())
    mgr.report_finished(digest)  # with HSDP: rank 0's shard digest (each rank prints its own below)
    emit(event="done", step=mgr.step, digest=digest, cursor=data["cursor"], metrics=mgr.metrics)
    mgr.shutdown()
    return 0


def train(args: argparse.Namespace, mgr: Manager, model: torch.nn.Module, opt: torch.optim.Optimizer,
          data: dict[str, int]) -> None:  # fmt: skip
    """The training loop: one "step" event per attempt."""
    while mgr.step < args.steps:
        if mgr.step == args.pause_at_step:  # lets a test start another group while this one is mid-run
            emit(event="paused", step=mgr.step)
            _wait(lambda: os.path.exists(args.resume_file), 600, f"{args.resume_file} to exist")
        started = time.monotonic()
        q = mgr.start_quorum()
        t_quorum = time.time()  # the quorum answered and, if behind, this group healed
        if mgr.step == args.hang_at_step:
            emit(event="hanging", step=mgr.step)
            while True:
                time.sleep(3600)
        if q.contributing:
            gen = torch.Generator().manual_seed(1000 * data["cursor"] + 10 * q.contributor_rank + args.rank)
            x = torch.randn(8, args.width, generator=gen)
            loss = (model(x) - x.flip(1)).pow(2).mean()
            loss.backward()
        mgr.allreduce_gradients(model.parameters())
        if mgr.step == args.sigterm_at_step:
            emit(event="sigterm", step=mgr.step)
            os.kill(os.getpid(), signal.SIGTERM)  # as the kubelet's: the step in flight must still commit
        committed = mgr.should_commit()
        if committed:
            opt.step()
            data["cursor"] += q.num_contributors
        opt.zero_grad()
        emit(
            event="step",
            step=mgr.step,
            committed=committed,
            quorum_id=q.quorum_id,
            contributing=q.contributing,
            participants=q.participants,
            healed=q.healed,
            heal_seconds=round(mgr.metrics["heal_seconds"], 4),  # cumulative; the rejoin breakdown uses the first
            quorum_time=t_quorum,
            seconds=round(time.monotonic() - started, 4),
            time=time.time(),
            error=None if committed else mgr.last_error,
            digest=param_digest(model.parameters()),  # after this attempt (a failed one must change nothing)
        )
        if args.step_delay:
            time.sleep(args.step_delay)


TOKEN = "test-token"
OPERATOR_TOKEN = (
    "test-operator-token"  # the lighthouse's membership API takes only this one (ftjob.lighthouse.api.auth)
)
WORKER = Path(__file__).resolve()


def _wait(predicate: Any, timeout: float, what: str) -> Any:
    """Polls with a deadline (the tests' own helpers module is not importable from a bench script)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.05)  # poll interval of a deadline loop


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
                raise AssertionError(f"lighthouse exited {self.proc.returncode}: {log.read_text()}")
            m = re.search(r"listening on 127\.0\.0\.1:(\d+)", log.read_text())
            return int(m.group(1)) if m else None

        self.port = _wait(listening, 60, "the lighthouse to listen")
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
    """One replica group (one rank) running this file's training loop."""

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
        program = command or [sys.executable, str(WORKER)]
        cmd = [*program, "--group", group, "--lighthouse", lighthouse_url, *args]
        # One OpenMP thread, as ftjob's launcher gives its ranks (ftjob.launch.procs) and the benches torchft's groups:
        # left to torch's default, each of these tiny-model ranks spun a second OpenMP thread and took 0.53 of a core
        # instead of 0.17 -- on a 2-core machine, CPU that a restarting group's imports (bench_failover) wait for.
        env = {**os.environ, "FTJOB_TOKEN": TOKEN, "OMP_NUM_THREADS": "1", **(env or {})}
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
            raise AssertionError(f"worker {self.group} exited {self.proc.returncode}: {self.log.read_text()[-3000:]}")
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


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
