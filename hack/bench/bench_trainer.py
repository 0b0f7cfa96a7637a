#!/usr/bin/env python3
"""Step time of the fault-tolerant trainer ÷ plain torch DDP (gloo), same model, data and group count, one run.

Both sides train the `small` preset (~3.2M parameters) on the same stdlib corpus with 3 groups (ours: 3 one-rank
replica groups through the lighthouse and Manager; DDP: 3 ranks). Each is measured `--rounds` times, interleaved
(ours, DDP, ours, DDP, ...) so background load on a shared machine hits both alike; the step time of a run is the
median gap between consecutive committed steps after `--warmup` steps. Prints each round and the ratio of medians
(target <= 1.03). If torchft is importable (the optional `bench` extra) it is measured the same way in the same
rounds (ours, DDP, torchft, ours, ...: 3 one-rank replica groups through torchft's lighthouse, Manager and gloo
process group; see torchft_runner.py) and ours ÷ torchft and torchft ÷ DDP are printed too.

``--metrics`` says whether ours records its Prometheus metrics (ftjob.ft.metrics; ``on``, as shipped) or not (``off``:
FTJOB_METRICS_DISABLED=1); ``both`` runs ours both ways in every round (on, off, DDP, ...) and prints the ratio of
medians on ÷ off: the metrics hooks' cost on the step time (no scrapes: each rank's server idles unless scraped).
``--guard`` does the same for the gradient guard (ftjob.ft.guard; ``on`` as shipped, ``off``: FTJOB_GRADIENT_GUARD=0):
``both`` runs ours both ways in every round and prints the guard's cost on ÷ off. Every run also times one state digest
(ftjob.ft.integrity: the model's parameters and AdamW state, sha256) of the same model in this process, and prints it
as a share of the step time at the default interval (every 100 committed steps).

  $(hack/lib/python-env.sh)/bin/python hack/bench/bench_trainer.py [--steps 40] [--rounds 3] [--model small]
      [--metrics on|off|both] [--guard on|off|both]
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from ddp_baseline import run_ddp
from ftjob import cli, contract
from ftjob.ft.digest import local_digest, replica_tensors
from ftjob.ft.integrity import DEFAULT_DIGEST_EVERY
from ftjob.ft.records import CommitRecord, read_run_dir
from ftjob.gpt.config import TrainConfig

HAVE_TORCHFT = importlib.util.find_spec("torchft") is not None


def median_gap(times: list[float], warmup: int) -> float:
    ts = sorted(times)[warmup:]
    if len(ts) < 3:
        raise ValueError(f"too few steps after warm-up ({len(ts)}): raise --steps")
    return statistics.median(b - a for a, b in itertools.pairwise(ts))


def run_ours(work: Path, a: argparse.Namespace, metrics: bool = True, guard: bool = True) -> float:
    run_dir = work / "run"
    # The launcher passes no FTJOB_* variable of its own environment on, so the switch rides on the command: the
    # reference trainer's command with the launcher's flags, behind `env` for both settings alike.
    trainer = [sys.executable, "-m", "ftjob.gpt", f"--model={a.model}", f"--steps={a.steps}"]
    trainer += [f"--batch-size={a.batch_size}", f"--run-dir={run_dir}", "--log-every=10", "--min-step-seconds=0.0"]
    switches = [f"{contract.ENV_METRICS_DISABLED}={0 if metrics else 1}", f"{contract.ENV_GUARD}={1 if guard else 0}"]
    rc = cli.main(
        [
            "launch",
            f"--run-dir={run_dir}",
            f"--replicas={a.groups}",
            f"--min-replicas={a.groups}",
            f"--steps={a.steps}",
            f"--report={work / 'report.json'}",
            "--",
            "env",
            *switches,
            *trainer,
        ]
    )
    if rc != 0:
        raise RuntimeError(f"the fault-tolerant run failed (exit {rc}); see {run_dir}/logs")
    records = read_run_dir(run_dir)
    per_group = [median_gap([r.t for r in recs if isinstance(r, CommitRecord)], a.warmup) for recs in records.values()]
    commits = [r for recs in records.values() for r in recs if isinstance(r, CommitRecord) and r.step > a.warmup]
    split = {k: statistics.median((r.phases or {})[k] for r in commits) * 1e3 for k in commits[0].phases or {}}
    print(
        f"[bench] ftjob (metrics {'on' if metrics else 'off'}, guard {'on' if guard else 'off'}) step phases "
        "(median ms): " + ", ".join(f"{k} {v:.1f}" for k, v in split.items()),
        flush=True,
    )
    return statistics.median(per_group)


def digest_seconds(a: argparse.Namespace, repeats: int = 5) -> float:
    """One state digest of the bench model after an AdamW step (what every group hashes every N steps): the median
    of ``repeats``, in this process, one thread (as a rank runs)."""
    import torch
    from ftjob.gpt.model import build_model
    from ftjob.gpt.train import make_optimizer

    torch.set_num_threads(1)
    cfg = TrainConfig(model=a.model)
    model = build_model(cfg.model, cfg.seed)
    optimizer = make_optimizer(model, cfg)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()  # AdamW's state exists from here on
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        local_digest(replica_tensors(model, optimizer))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run_plain_ddp(work: Path, a: argparse.Namespace) -> float:
    cfg = TrainConfig(model=a.model, steps=a.steps, batch_size=a.batch_size, log_every=max(a.steps // 4, 1))
    result = run_ddp(cfg, a.groups, work)
    return statistics.median(median_gap(times, a.warmup) for times in result.step_times)


def run_torchft(work: Path, a: argparse.Namespace) -> float:
    here = str(Path(__file__).resolve().parent)
    if here not in sys.path:  # run other than as a script (runpy, an import): torchft_runner is next to this file
        sys.path.insert(0, here)
    import torchft_runner  # only imported when torchft is

    cfg = TrainConfig(model=a.model, steps=a.steps, batch_size=a.batch_size, log_every=max(a.steps // 4, 1))
    result = torchft_runner.run_torchft(cfg, a.groups, work)
    if len(set(result.digests)) != 1:  # would mean torchft's groups did not train the same replica
        raise RuntimeError(f"torchft groups ended with different parameters: {result.digests}")
    return statistics.median(median_gap(times, a.warmup) for times in result.step_times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="small")
    p.add_argument("--groups", type=int, default=3)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--metrics", choices=("on", "off", "both"), default="on", help="ours with metrics on/off/both")
    p.add_argument(
        "--guard", choices=("on", "off", "both"), default="on", help="ours with the gradient guard on/off/both"
    )
    p.add_argument("--json", type=Path, help="also write the figures here")
    a = p.parse_args(argv)
    # Every side's workers start with one OpenMP thread, as our launcher starts its ranks: the DDP ranks set it
    # only after importing torch, too late, and the idle OpenMP thread that then stays costs time on a busy host.
    os.environ["OMP_NUM_THREADS"] = "1"
    ours: list[float] = []
    ddp: list[float] = []
    tft: list[float] = []
    ours_off: list[float] = []  # --metrics both: ours without metrics, in the same rounds
    guard_off: list[float] = []  # --guard both: ours without the gradient guard, in the same rounds
    with tempfile.TemporaryDirectory(prefix="bench-trainer-") as tmp:
        for i in range(a.rounds):
            ours.append(run_ours(Path(tmp) / f"ours-{i}", a, metrics=a.metrics != "off", guard=a.guard != "off"))
            if a.metrics == "both":
                ours_off.append(run_ours(Path(tmp) / f"ours-off-{i}", a, metrics=False, guard=a.guard != "off"))
            if a.guard == "both":
                guard_off.append(run_ours(Path(tmp) / f"ours-noguard-{i}", a, metrics=a.metrics != "off", guard=False))
            ddp.append(run_plain_ddp(Path(tmp) / f"ddp-{i}", a))
            line = (
                f"[bench] round {i + 1}/{a.rounds}: ftjob {ours[-1] * 1e3:.1f} ms/step, DDP {ddp[-1] * 1e3:.1f} "
                f"ms/step, ratio {ours[-1] / ddp[-1]:.3f}"
            )
            if HAVE_TORCHFT:
                tft.append(run_torchft(Path(tmp) / f"torchft-{i}", a))
                line += (
                    f"; torchft {tft[-1] * 1e3:.1f} ms/step, ftjob ÷ torchft {ours[-1] / tft[-1]:.3f}, "
                    f"torchft ÷ DDP {tft[-1] / ddp[-1]:.3f}"
                )
            if ours_off:
                line += f"; metrics on ÷ off {ours[-1] / ours_off[-1]:.3f} (off {ours_off[-1] * 1e3:.1f} ms/step)"
            if guard_off:
                line += f"; guard on ÷ off {ours[-1] / guard_off[-1]:.3f} (off {guard_off[-1] * 1e3:.1f} ms/step)"
            print(line, flush=True)
    digest_s = digest_seconds(a)
    digest_share = digest_s / DEFAULT_DIGEST_EVERY / statistics.median(ours)
    ratio = statistics.median(ours) / statistics.median(ddp)
    figures = {
        "model": a.model,
        "groups": a.groups,
        "steps": a.steps,
        "ftjob_step_s": ours,
        "ddp_step_s": ddp,
        "ratio_ftjob_over_ddp": ratio,
        "target": 1.03,
        "torchft_step_s": tft or None,  # None: torchft not installed, not measured
        "ratio_ftjob_over_torchft": statistics.median(ours) / statistics.median(tft) if tft else None,
        "ratio_torchft_over_ddp": statistics.median(tft) / statistics.median(ddp) if tft else None,
        "metrics": a.metrics,
        "ftjob_metrics_off_step_s": ours_off or None,  # None: not measured (--metrics on|off)
        "ratio_metrics_on_over_off": statistics.median(ours) / statistics.median(ours_off) if ours_off else None,
        "guard": a.guard,
        "ftjob_guard_off_step_s": guard_off or None,  # None: not measured (--guard on|off)
        "ratio_guard_on_over_off": statistics.median(ours) / statistics.median(guard_off) if guard_off else None,
        "digest_s": digest_s,
        "digest_share_of_step_time": digest_share,  # at the default interval, DEFAULT_DIGEST_EVERY steps
    }
    print(f"[bench] ftjob ÷ DDP step time: {ratio:.3f} (target <= 1.03; medians of {a.rounds} interleaved rounds)")
    if tft:
        print(
            f"[bench] ftjob ÷ torchft step time: {figures['ratio_ftjob_over_torchft']:.3f}; torchft ÷ DDP: "
            f"{figures['ratio_torchft_over_ddp']:.3f} (medians of {a.rounds} interleaved rounds)"
        )
    else:
        print("[bench] torchft is not installed (optional `bench` extra): ours ÷ torchft not measured")
    if ours_off:
        print(
            f"[bench] metrics on ÷ off step time: {figures['ratio_metrics_on_over_off']:.3f} (medians of {a.rounds} "
            "interleaved rounds)"
        )
    if guard_off:
        print(
            f"[bench] gradient guard on ÷ off step time: {figures['ratio_guard_on_over_off']:.3f} (medians of "
            f"{a.rounds} interleaved rounds)"
        )
    print(
        f"[bench] one state digest of the {a.model} model + AdamW state: {digest_s * 1e3:.1f} ms = "
        f"{digest_s / statistics.median(ours):.2f} steps; every {DEFAULT_DIGEST_EVERY} steps: "
        f"{digest_share * 100:.3f}% of the step time"
    )
    if a.json:
        a.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
