"""The torchft side of hack/bench/bench_trainer.py: the same training as ours and plain DDP, through torchft's API.

One replica group per process (N groups, one rank each) on loopback, a torchft lighthouse in its own process, and
per group: a TCPStore, torchft's reconfigurable gloo process group, a torchft ``Manager`` and torchft's DDP wrapper.
Model, data shards, optimizer, learning-rate schedule and gradient clipping come from ftjob.gpt, exactly as in
hack/bench/ddp_baseline.py, so the three sides do identical work per step and differ only in how the step is
coordinated. Every step commits through ``Manager.should_commit`` (that coordination is the overhead compared);
the wall time of each committed step is recorded per group.

Only the torchft package's public API is called (torchft.coordination, torchft.manager, torchft.process_group,
torchft.ddp); it is imported inside the child processes, so importing this module needs no torchft.

Run alone, from the repo root: ``python -m hack.bench.torchft_runner run --groups 3 --steps 20 --model tiny --out DIR``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from ftjob.ft.integrity.digest import digest_of, full_params
from ftjob.gpt.config import TrainConfig
from ftjob.gpt.data import Corpus, SampleSource, shard_range
from ftjob.gpt.model import build_model
from ftjob.gpt.train import CpuMeter, forward_backward, lr_at, make_optimizer, set_lr
from ftjob.launch.procs import free_port

from hack.bench.ddp_baseline import add_config_flags, config_argv, config_from_flags
from tests.support.paths import importable_env
from tests.support.polling import StopWaiting, wait_for

# The bound the bench uses for our side's collectives (TrainConfig.collective_timeout_s); quorum and connect
# timeouts stay at torchft's defaults (60 s, like our quorum timeout).
TIMEOUT = timedelta(seconds=5)


# --- child processes ---------------------------------------------------------------------------------------------
def lighthouse_main(port: int, min_replicas: int) -> None:
    """torchft's own lighthouse (its Rust server), default join/tick/heartbeat settings, until SIGTERM."""
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(bind=f"127.0.0.1:{port}", min_replicas=min_replicas)
    stop = False

    def on_term(signum: int, frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    print(f"[torchft] lighthouse {server.address()} (min_replicas {min_replicas})", flush=True)
    try:
        while not stop:
            time.sleep(0.2)
    finally:
        server.shutdown()


def worker(group: int, groups: int, lighthouse: str, cfg: TrainConfig, out: Path) -> None:
    """One replica group of one rank: train ``cfg.steps`` committed steps through torchft's Manager."""
    from torch.distributed import TCPStore
    from torchft.ddp import DistributedDataParallel
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    torch.set_num_threads(cfg.threads)
    # The Manager expects the group's store to exist already (torchelastic would host it); with one rank per group
    # this process is its master.
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    model = build_model(cfg.model, cfg.seed)
    optimizer = make_optimizer(model, cfg)
    source = SampleSource(Corpus.load(cfg.corpus_root, cfg.corpus_bytes), model.cfg.block_size)
    cursor = 0

    # What a healing group would receive; never used in this failure-free run, but the Manager requires it.
    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": optimizer.state_dict(), "cursor": cursor}

    def load_state_dict(state: dict[str, Any]) -> None:
        nonlocal cursor
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])
        cursor = int(state["cursor"])

    manager = Manager(
        pg=ProcessGroupGloo(timeout=TIMEOUT),
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=groups,  # like ours with --min-replicas = groups: every group must take part to commit
        timeout=TIMEOUT,
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=store.port,
        lighthouse_addr=lighthouse,
        replica_id=f"group_{group}",
        hostname="127.0.0.1",
        # Every group builds the same seeded weights (as ours and DDP do), so torchft's step-0 weight sync, which
        # its docs say to turn off in that case, would only add a checkpoint transfer the others don't make.
        init_sync=False,
    )
    ddp = DistributedDataParallel(manager, model)  # gradients averaged through manager.allreduce in backward
    times: list[float] = []
    phases: list[dict[str, float]] = []  # per committed step: quorum, compute, commit (the vote), optimizer
    cpu = CpuMeter()
    loss = float("nan")
    try:
        while manager.current_step() < cfg.steps:
            step = manager.current_step()
            t0 = time.monotonic()
            manager.start_quorum()  # asynchronous by default: overlaps the forward pass
            t1 = time.monotonic()
            optimizer.zero_grad(set_to_none=False)
            # Fixed shard per group (as torchft's own examples shard by replica group): with no failures this is
            # the sample range ours and DDP train for the same group/rank.
            start, _ = shard_range(cursor, group, groups, cfg.batch_size)
            loss = forward_backward(ddp, source, start, cfg.batch_size)
            t2 = time.monotonic()
            if manager.should_commit():
                t3 = time.monotonic()
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
                set_lr(optimizer, lr_at(step, cfg))
                optimizer.step()
                cursor += groups * cfg.batch_size
                times.append(time.time())
                t4 = time.monotonic()
                phases.append({"quorum": t1 - t0, "compute": t2 - t1, "commit": t3 - t2, "optimizer": t4 - t3})
                cpu.step_done()
                if group == 0 and (step + 1) % cfg.log_every == 0:
                    print(f"[torchft] step {step + 1}/{cfg.steps} loss {loss:.4f}", flush=True)
        params = full_params(model)
        out.mkdir(parents=True, exist_ok=True)
        if group == 0:  # bench_trainer compares where each side ends against DDP
            torch.save(params, out / "final-params-group-0.pt")
        (out / f"torchft-group-{group}.json").write_text(
            json.dumps(
                {
                    "group": group,
                    "step_times": times,
                    "param_digest": digest_of(params),
                    "final_loss": loss,
                    "phases": phases,
                    "cpu": cpu.per_step(),
                }
            )
        )
    finally:
        manager.shutdown(wait=False)


# --- the launcher ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TorchftResult:
    digests: list[str]
    step_times: list[list[float]]  # per group: wall time when each committed step's optimizer step ended
    final_loss: float
    phases: list[list[dict[str, float]]]  # per group, per committed step: seconds per phase
    cpu: list[dict[str, float]]  # per group: CPU seconds per step, the process's and each thread's


def _script(*args: str) -> list[str]:
    """This module as a child (with `importable_env`: it imports hack.bench)."""
    return [sys.executable, "-m", "hack.bench.torchft_runner", *args]


def wait_listening(port: int, proc: subprocess.Popen[bytes], log: Path, timeout_s: float = 30.0) -> None:
    """Until the torchft lighthouse ``proc`` accepts connections on ``port``; fails at once if it exits."""

    def listening() -> bool:
        if proc.poll() is not None:
            raise StopWaiting(f"the torchft lighthouse exited ({proc.returncode}):\n{_tail(log)}")
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True

    wait_for(listening, timeout_s, f"the torchft lighthouse to listen on port {port}", interval=0.05)


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM, a short grace period, then SIGKILL; every process is reaped."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + 5.0
    for p in procs:
        try:
            p.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def run_torchft(cfg: TrainConfig, groups: int, out: Path, timeout_s: float = 600.0) -> TorchftResult:
    """A torchft lighthouse plus ``groups`` one-rank replica groups as local processes; collect their results.

    Group 0's output (its progress lines) goes to this process's stdout; every process also logs to ``out``.
    """
    out.mkdir(parents=True, exist_ok=True)
    # one OpenMP thread from the start, as our launcher's ranks
    env = importable_env({**os.environ, "OMP_NUM_THREADS": "1"})
    procs: list[subprocess.Popen[bytes]] = []
    logs = []
    try:
        port = free_port()
        lh_log = out / "lighthouse.log"
        logs.append(lh_log.open("wb"))
        lh = subprocess.Popen(
            _script("lighthouse", f"--port={port}", f"--min-replicas={groups}"),
            env=env,
            stdout=logs[-1],
            stderr=subprocess.STDOUT,
        )
        procs.append(lh)
        wait_listening(port, lh, lh_log)
        args = [
            f"--groups={groups}",
            f"--lighthouse=http://127.0.0.1:{port}",
            f"--out={out}",
            *config_argv(cfg),
        ]
        workers = []
        for g in range(groups):
            logs.append((out / f"group-{g}.log").open("wb"))
            # Group 0's stdout stays on the terminal for progress; torchft's own logging goes to stderr (the file).
            stdout = None if g == 0 else logs[-1]
            workers.append(
                subprocess.Popen(_script("worker", f"--group={g}", *args), env=env, stdout=stdout, stderr=logs[-1])
            )
        procs.extend(workers)
        pending = dict(enumerate(workers))

        def all_done() -> bool:  # polls all: one group failing makes the others block in their quorum, so fail fast
            for g, p in list(pending.items()):
                rc = p.poll()
                if rc is None:
                    continue
                if rc != 0:
                    raise StopWaiting(f"torchft group {g} exited with code {rc}:\n{_tail(out / f'group-{g}.log')}")
                del pending[g]
            return not pending

        wait_for(all_done, timeout_s, "the torchft groups to finish", 0.05, lambda: f"still running: {sorted(pending)}")
    finally:
        _stop(procs)
        for f in logs:
            f.close()
    infos = [json.loads((out / f"torchft-group-{g}.json").read_text()) for g in range(groups)]
    return TorchftResult(
        digests=[i["param_digest"] for i in infos],
        step_times=[i["step_times"] for i in infos],
        final_loss=infos[0]["final_loss"],
        phases=[i["phases"] for i in infos],
        cpu=[i["cpu"] for i in infos],
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=["run", "worker", "lighthouse"], help="run: launch all (others: internal)")
    p.add_argument("--group", type=int, default=0)
    p.add_argument("--groups", type=int, default=3)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--min-replicas", type=int, default=1)
    p.add_argument("--lighthouse", default="")
    p.add_argument("--out", type=Path)
    add_config_flags(p, steps=20)
    a = p.parse_args(argv)
    if a.mode == "lighthouse":
        lighthouse_main(a.port, a.min_replicas)
        return 0
    if a.out is None:
        p.error("--out is required")
    cfg = config_from_flags(a)
    if a.mode == "worker":
        worker(a.group, a.groups, a.lighthouse, cfg, a.out)
        return 0
    result = run_torchft(cfg, a.groups, a.out)
    print(f"[torchft] done: digests equal across groups: {len(set(result.digests)) == 1}, loss {result.final_loss}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
