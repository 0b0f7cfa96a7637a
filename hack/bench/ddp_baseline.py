"""The baseline: plain torch DDP (gloo) on the same model, data, seeds and optimizer as the fault-tolerant trainer.

Rank r of N plays the part of contributing group r: it trains samples ``[cursor + r*b, cursor + (r+1)*b)`` and the
cursor advances by ``N*b`` per step, exactly like N groups that never fail. Tests compare final parameters with the
fault-tolerant run; the benchmark compares step times.

Run: ``python hack/bench/ddp_baseline.py --world 3 --steps 50 --out DIR`` (spawns the ranks itself).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from ftjob.ft.integrity.digest import digest_of, full_params
from ftjob.gpt.config import TrainConfig
from ftjob.gpt.data import Corpus, SampleSource, shard_range
from ftjob.gpt.model import build_model
from ftjob.gpt.train import CpuMeter, forward_backward, lr_at, make_optimizer, set_lr
from ftjob.launch.procs import free_port
from torch.nn.parallel import DistributedDataParallel


def worker(rank: int, world: int, port: int, cfg: TrainConfig, out: Path) -> None:
    torch.set_num_threads(cfg.threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    model = build_model(cfg.model, cfg.seed)
    ddp = DistributedDataParallel(model)
    optimizer = make_optimizer(model, cfg)
    source = SampleSource(Corpus.load(cfg.corpus_root, cfg.corpus_bytes), model.cfg.block_size)
    cursor, times, loss = 0, [], float("nan")
    phases: list[dict[str, float]] = []  # per step: compute (forward, backward and DDP's all-reduces), optimizer
    cpu = CpuMeter()
    for step in range(cfg.steps):
        t0 = time.monotonic()
        start, _ = shard_range(cursor, rank, world, cfg.batch_size)
        optimizer.zero_grad(set_to_none=False)
        loss = forward_backward(ddp, source, start, cfg.batch_size)
        t1 = time.monotonic()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        set_lr(optimizer, lr_at(step, cfg))
        optimizer.step()
        cursor += world * cfg.batch_size
        times.append(time.time())
        phases.append({"compute": t1 - t0, "optimizer": time.monotonic() - t1})
        cpu.step_done()
        if rank == 0 and (step + 1) % cfg.log_every == 0:
            print(f"[ddp] step {step + 1}/{cfg.steps} loss {loss:.4f}", flush=True)
    params = full_params(model)
    out.mkdir(parents=True, exist_ok=True)
    torch.save(params, out / f"final-params-rank-{rank}.pt")
    (out / f"ddp-rank-{rank}.json").write_text(
        json.dumps(
            {
                "rank": rank,
                "step_times": times,
                "param_digest": digest_of(params),
                "final_loss": loss,
                "phases": phases,
                "cpu": cpu.per_step(),
            }
        )
    )
    dist.destroy_process_group()


# The training settings a baseline's child processes get on their command line (here and in hack/bench's torchft
# runner), so every side of a comparison trains exactly the same thing.
def add_config_flags(p: argparse.ArgumentParser, steps: int) -> None:
    p.add_argument("--model", default="tiny")
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seed", type=int, default=TrainConfig.seed)
    p.add_argument("--threads", type=int, default=TrainConfig.threads)
    p.add_argument("--corpus-bytes", type=int, default=TrainConfig.corpus_bytes)
    p.add_argument("--lr", type=float, default=TrainConfig.lr)
    p.add_argument("--log-every", type=int, default=10)


def config_from_flags(a: argparse.Namespace) -> TrainConfig:
    fields = ("model", "steps", "batch_size", "seed", "threads", "corpus_bytes", "lr", "log_every")
    return TrainConfig(**{f: getattr(a, f) for f in fields}).validate()


def config_argv(cfg: TrainConfig) -> list[str]:
    return [
        f"--model={cfg.model}",
        f"--steps={cfg.steps}",
        f"--batch-size={cfg.batch_size}",
        f"--seed={cfg.seed}",
        f"--threads={cfg.threads}",
        f"--corpus-bytes={cfg.corpus_bytes}",
        f"--lr={cfg.lr}",
        f"--log-every={cfg.log_every}",
    ]


@dataclass(frozen=True)
class DDPResult:
    params: dict[str, torch.Tensor]  # rank 0's final parameters
    digests: list[str]
    step_times: list[list[float]]  # per rank: wall time at the end of each step
    final_loss: float
    phases: list[list[dict[str, float]]]  # per rank, per step: seconds in compute / optimizer
    cpu: list[dict[str, float]]  # per rank: CPU seconds per step, the process's and each thread's


def run_ddp(cfg: TrainConfig, world: int, out: Path, timeout_s: float = 600.0) -> DDPResult:
    """Run ``world`` DDP ranks as local processes and collect their results."""
    port = free_port()
    args = [f"--world={world}", f"--port={port}", f"--out={out}", *config_argv(cfg)]
    procs = [subprocess.Popen([sys.executable, __file__, f"--rank={r}", *args]) for r in range(world)]
    deadline = time.monotonic() + timeout_s
    try:
        for p in procs:
            rc = p.wait(timeout=max(deadline - time.monotonic(), 0.1))
            if rc != 0:
                raise RuntimeError(f"DDP rank exited with code {rc} (see its output above)")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    infos = [json.loads((out / f"ddp-rank-{r}.json").read_text()) for r in range(world)]
    return DDPResult(
        params=torch.load(out / "final-params-rank-0.pt"),
        digests=[i["param_digest"] for i in infos],
        step_times=[i["step_times"] for i in infos],
        final_loss=infos[0]["final_loss"],
        phases=[i["phases"] for i in infos],
        cpu=[i["cpu"] for i in infos],
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python hack/bench/ddp_baseline.py", description=__doc__)
    p.add_argument("--rank", type=int, help="internal: run one rank (the launcher passes it)")
    p.add_argument("--world", type=int, default=3)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--out", type=Path, required=True)
    add_config_flags(p, steps=50)
    a = p.parse_args(argv)
    cfg = config_from_flags(a)
    if a.rank is not None:
        worker(a.rank, a.world, a.port, cfg, a.out)
        return 0
    result = run_ddp(cfg, a.world, a.out)
    print(f"[ddp] done: digests equal across ranks: {len(set(result.digests)) == 1}, final loss {result.final_loss}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
