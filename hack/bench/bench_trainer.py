#!/usr/bin/env python3
"""Step time of the fault-tolerant trainer ÷ plain torch DDP (gloo), same model, data and group count, one run.

Both sides train the `small` preset (~3.2M parameters) on the same stdlib corpus with 3 groups (ours: 3 one-rank
replica groups through the lighthouse and Manager; DDP: 3 ranks). Each is measured `--rounds` times, interleaved
(ours, DDP, ours, DDP, ...) so background load on a shared machine hits both alike; the step time of a run is the
median gap between consecutive committed steps after `--warmup` steps. Prints each round and the ratio of medians
(target <= 1.02, and ours ÷ torchft <= 1.0). If torchft is importable (the optional `bench` extra) it is measured the
same way in the same rounds (ours, DDP, torchft, ours, ...: 3 one-rank replica groups through torchft's lighthouse,
Manager and gloo process group; see torchft_runner.py) and ours ÷ torchft and torchft ÷ DDP are printed too. Every
round checks that ours' groups end with equal parameters, and where DDP ends (to float rounding), and that
torchft's groups end equal; with torchft it prints torchft's distance from DDP next to ours: what rounding alone does
in the same run.

``--metrics`` says whether ours records its Prometheus metrics (ftjob.ft.rank_metrics; ``on``, as shipped) or not
(``off``: FTJOB_METRICS_DISABLED=1); ``both`` runs ours both ways in every round (on, off, DDP, ...) and prints the
ratio of medians on ÷ off: the metrics hooks' cost on the step time (no scrapes: each rank's server idles unless
scraped). ``--guard`` does the same for the gradient guard (ftjob.ft.integrity.guard; ``on`` as shipped, ``off``:
FTJOB_GRADIENT_GUARD=0): ``both`` runs ours both ways in every round and prints the guard's cost on ÷ off, and also runs
ours with the guard's sketch check (FTJOB_GUARD_SKETCH) the other way than ``--sketch`` sets it for ours (default: as
shipped, off), and prints that check's cost, sketch on ÷ off, beside it. Every run also times one state digest
(ftjob.ft.integrity.duties: the model's parameters and AdamW state, sha256) of the same model in this process, and
prints it as a share of the step time at the default interval (every 100 committed steps).

For every side and round it prints the median time of each step phase and the CPU per step of a rank: the whole
process and each thread by name (MainThread trains; ours' lighthouse-client-* thread sends the heartbeats and quorum
requests; gloo's and torch's own threads carry their kernel names), measured from the end of the first step on,
plus the CPU of the run's other processes (the lighthouse), start-up included.

  $(hack/lib/python-env.sh)/bin/python -m hack.bench.bench_trainer [--steps 40] [--rounds 3] [--model small]
      [--metrics on|off|both] [--guard on|off|both] [--sketch on|off] [--skip-torchft]
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import itertools
import json
import os
import re
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

from ftjob import cli, contract
from ftjob.ft.integrity.digest import local_digest, replica_tensors
from ftjob.ft.integrity.duties import DEFAULT_DIGEST_EVERY
from ftjob.ft.integrity.guard import DEFAULT_SKETCH
from ftjob.ft.records import CommitRecord, read_run_dir
from ftjob.gpt.config import TrainConfig

from hack.bench.ddp_baseline import run_ddp

HAVE_TORCHFT = importlib.util.find_spec("torchft") is not None
# Ours vs DDP, max |parameter difference|. Rounding alone reaches this far: DDP itself with 4 MiB instead of 25 MiB
# buckets ends 4.2e-3 away from DDP after 20 steps of the small preset with 3 ranks (AdamW magnifies the rounding of
# tiny gradients); ours was seen at 2.2e-3.
DDP_TOLERANCE = 1e-2


@dataclasses.dataclass
class Run:
    """One side's figures in one round: the step time, the phase medians and the CPU per step of its ranks."""

    step_s: float
    phases: dict[str, float]  # phase -> median seconds over the steps after warm-up, all groups/ranks
    cpu: dict[str, float]  # "process" and each thread name -> CPU seconds per step, median over the groups/ranks
    others_cpu_s: float  # CPU seconds of the run's other processes (the lighthouse), start-up included


def phase_medians(per_rank: list[list[dict[str, float]]], warmup: int) -> dict[str, float]:
    steps = [ph for phases in per_rank for ph in phases[warmup:]]
    return {k: statistics.median(ph.get(k, 0.0) for ph in steps) for k in (steps[0] if steps else {})}


def cpu_medians(per_rank: list[dict[str, float]]) -> dict[str, float]:
    # One name per role: "lighthouse-client-2" is group 2's lighthouse client thread.
    per_rank = [{re.sub(r"-\d+$", "", k): v for k, v in cpu.items()} for cpu in per_rank]
    names = {k for cpu in per_rank for k in cpu} - {"process_life"}
    medians = {k: statistics.median(cpu.get(k, 0.0) for cpu in per_rank) for k in names}
    return dict(sorted(medians.items(), key=lambda kv: -kv[1]))


def children_cpu_s() -> float:
    """CPU seconds of this process's reaped children so far (every process a run started, and their threads)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def show(name: str, run: Run) -> None:
    ms = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in run.phases.items())
    cpu = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in run.cpu.items() if v >= 0.00005)
    print(f"[bench] {name}: {run.step_s * 1e3:.1f} ms/step; phases (median ms): {ms}", flush=True)
    print(f"[bench] {name}: CPU ms per step per rank: {cpu}; other processes {run.others_cpu_s:.2f} s", flush=True)


def max_difference(params: dict, ddp: dict, side: str) -> float:
    if set(params) != set(ddp):
        raise RuntimeError(f"{side} and DDP trained different parameters: {sorted(set(params) ^ set(ddp))}")
    diff = max(float((params[n] - t).abs().max()) for n, t in ddp.items())
    if not diff < 1.0:  # NaN, or a different model: not rounding
        raise RuntimeError(f"{side} does not end where DDP ends: max |difference| {diff:.2e}")
    return diff


def compare_params(tmp: Path, i: int) -> str:
    """Ours' final parameters against DDP's of the same round, and torchft's when it ran: each sums the 3 groups'
    gradients in another order than DDP's buckets and AdamW magnifies that rounding on tiny gradients, so they agree
    to a tolerance (DDP_TOLERANCE after 20 steps; it grows with the steps), not bitwise. torchft's difference, same
    run, same steps, is the yardstick for what rounding alone does."""
    import torch

    ddp = torch.load(tmp / f"DDP-{i}" / "final-params-rank-0.pt")
    diff = max_difference(torch.load(tmp / f"ftjob-{i}" / "run" / "final-params-group-0.pt"), ddp, "ftjob")
    torchft = tmp / f"torchft-{i}" / "final-params-group-0.pt"
    if torchft.exists():
        return f"max |difference| {diff:.2e}; torchft's {max_difference(torch.load(torchft), ddp, 'torchft'):.2e}"
    if diff > DDP_TOLERANCE:
        return f"max |difference| {diff:.2e}, above the {DDP_TOLERANCE} that rounding reaches in 20 steps"
    return f"yes (max |difference| {diff:.2e} <= {DDP_TOLERANCE})"


def round_line(step_s: dict[str, float]) -> str:
    ours, ddp, tft = step_s["ftjob"], step_s["DDP"], step_s.get("torchft")
    line = f"ftjob {ours * 1e3:.1f} ms/step, DDP {ddp * 1e3:.1f} ms/step, ftjob ÷ DDP {ours / ddp:.3f}"
    if tft is not None:
        line += f"; torchft {tft * 1e3:.1f} ms/step, ftjob ÷ torchft {ours / tft:.3f}, torchft ÷ DDP {tft / ddp:.3f}"
    if (off := step_s.get("ftjob metrics off")) is not None:
        line += f"; metrics on ÷ off {ours / off:.3f}"
    if (off := step_s.get("ftjob guard off")) is not None:
        line += f"; guard on ÷ off {ours / off:.3f}"
    if (ratio := sketch_ratio(step_s)) is not None:
        line += f"; sketch on ÷ off {ratio:.3f}"
    return line


def sketch_ratio(step_s: dict[str, float]) -> float | None:
    """The sketch check's cost, on ÷ off, when a round ran ours both ways (ours runs it as ``--sketch`` says)."""
    if (off := step_s.get("ftjob sketch off")) is not None:
        return step_s["ftjob"] / off
    if (on := step_s.get("ftjob sketch on")) is not None:
        return on / step_s["ftjob"]
    return None


def median_gap(times: list[float], warmup: int) -> float:
    ts = sorted(times)[warmup:]
    if len(ts) < 3:
        raise ValueError(f"too few steps after warm-up ({len(ts)}): raise --steps")
    return statistics.median(b - a for a, b in itertools.pairwise(ts))


def run_ours(work: Path, a: argparse.Namespace, metrics: bool = True, guard: bool = True, sketch: bool = False) -> Run:
    run_dir = work / "run"
    # The launcher passes no FTJOB_* variable of its own environment on, so the switch rides on the command: the
    # reference trainer's command with the launcher's flags, behind `env` for both settings alike.
    trainer = [sys.executable, "-m", "ftjob.gpt", f"--model={a.model}", f"--steps={a.steps}"]
    trainer += [f"--batch-size={a.batch_size}", f"--run-dir={run_dir}", "--log-every=10", "--min-step-seconds=0.0"]
    switches = [f"{contract.ENV_METRICS_DISABLED}={0 if metrics else 1}", f"{contract.ENV_GUARD}={1 if guard else 0}"]
    switches.append(f"{contract.ENV_GUARD_SKETCH}={1 if sketch else 0}")
    cpu_before = children_cpu_s()
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
    report = json.loads((work / "report.json").read_text())
    if not report["digests_equal"]:  # would mean our groups did not train the same replica
        raise RuntimeError(f"ftjob groups ended with different parameters; see {run_dir}")
    records = read_run_dir(run_dir)
    per_group = [median_gap([r.t for r in recs if isinstance(r, CommitRecord)], a.warmup) for recs in records.values()]
    phases = [[r.phases or {} for r in recs if isinstance(r, CommitRecord)] for recs in records.values()]
    cpu = [json.loads(f.read_text()) for f in sorted(run_dir.glob("thread-cpu-group-*.json"))]
    return Run(
        step_s=statistics.median(per_group),
        phases=phase_medians(phases, a.warmup),
        cpu=cpu_medians(cpu),
        others_cpu_s=children_cpu_s() - cpu_before - sum(c["process_life"] for c in cpu),
    )


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


def run_plain_ddp(work: Path, a: argparse.Namespace) -> Run:
    cfg = TrainConfig(model=a.model, steps=a.steps, batch_size=a.batch_size, log_every=max(a.steps // 4, 1))
    cpu_before = children_cpu_s()
    result = run_ddp(cfg, a.groups, work)
    return Run(
        step_s=statistics.median(median_gap(times, a.warmup) for times in result.step_times),
        phases=phase_medians(result.phases, a.warmup),
        cpu=cpu_medians(result.cpu),
        others_cpu_s=children_cpu_s() - cpu_before - sum(c["process_life"] for c in result.cpu),
    )


def run_torchft(work: Path, a: argparse.Namespace) -> Run:
    from hack.bench import torchft_runner  # only imported when torchft is

    cfg = TrainConfig(model=a.model, steps=a.steps, batch_size=a.batch_size, log_every=max(a.steps // 4, 1))
    cpu_before = children_cpu_s()
    result = torchft_runner.run_torchft(cfg, a.groups, work)
    if len(set(result.digests)) != 1:  # would mean torchft's groups did not train the same replica
        raise RuntimeError(f"torchft groups ended with different parameters: {result.digests}")
    return Run(
        step_s=statistics.median(median_gap(times, a.warmup) for times in result.step_times),
        phases=phase_medians(result.phases, a.warmup),
        cpu=cpu_medians(result.cpu),
        others_cpu_s=children_cpu_s() - cpu_before - sum(c["process_life"] for c in result.cpu),
    )


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
    p.add_argument(
        "--sketch",
        choices=("on", "off"),
        default="on" if DEFAULT_SKETCH else "off",
        help="ours with the guard's sketch check on/off (--guard both also runs ours the other way)",
    )
    p.add_argument("--skip-torchft", action="store_true", help="leave torchft out even if it is installed")
    p.add_argument("--json", type=Path, help="also write the figures here")
    a = p.parse_args(argv)
    # Every side's workers start with one OpenMP thread, as our launcher starts its ranks: the DDP ranks set it
    # only after importing torch, too late, and the idle OpenMP thread that then stays costs time on a busy host.
    os.environ["OMP_NUM_THREADS"] = "1"
    other_sketch = f"ftjob sketch {'off' if a.sketch == 'on' else 'on'}"
    sides = ["ftjob"] + ["ftjob metrics off"] * (a.metrics == "both")
    sides += ["ftjob guard off", other_sketch] * (a.guard == "both")
    sides += ["DDP"] + ["torchft"] * (HAVE_TORCHFT and not a.skip_torchft)
    runs: dict[str, list[Run]] = {side: [] for side in sides}
    with tempfile.TemporaryDirectory(prefix="bench-trainer-") as tmp:
        for i in range(a.rounds):
            for side in sides:  # interleaved: background load hits every side alike
                work = Path(tmp) / f"{side.replace(' ', '-')}-{i}"
                if side == "DDP":
                    run = run_plain_ddp(work, a)
                elif side == "torchft":
                    run = run_torchft(work, a)
                else:
                    metrics = a.metrics != "off" and side != "ftjob metrics off"
                    guard = a.guard != "off" and side != "ftjob guard off"
                    sketch = (a.sketch == "on") != (side == other_sketch)
                    run = run_ours(work, a, metrics=metrics, guard=guard, sketch=sketch)
                runs[side].append(run)
                show(side, run)
            print(f"[bench] round {i + 1}/{a.rounds}: " + round_line({s: r[-1].step_s for s, r in runs.items()}))
            print(f"[bench] round {i + 1}: ftjob ends where DDP ends: " + compare_params(Path(tmp), i), flush=True)
    step = {side: [r.step_s for r in rs] for side, rs in runs.items()}
    ours, ddp, tft = step["ftjob"], step["DDP"], step.get("torchft", [])
    ours_off, guard_off = step.get("ftjob metrics off", []), step.get("ftjob guard off", [])
    sketch_other = step.get(other_sketch, [])
    medians = {side: statistics.median(s) for side, s in step.items()}
    for side, rs in runs.items():  # the phases and CPU of every side, medians over the rounds
        show(
            f"{side} (medians of {a.rounds} rounds)",
            Run(
                step_s=statistics.median(step[side]),
                phases={k: statistics.median(r.phases.get(k, 0.0) for r in rs) for k in rs[0].phases},
                cpu=cpu_medians([r.cpu for r in rs]),
                others_cpu_s=statistics.median(r.others_cpu_s for r in rs),
            ),
        )
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
        "target": 1.02,
        "target_ftjob_over_torchft": 1.0,
        "torchft_step_s": tft or None,  # None: torchft not installed, not measured
        "ratio_ftjob_over_torchft": statistics.median(ours) / statistics.median(tft) if tft else None,
        "ratio_torchft_over_ddp": statistics.median(tft) / statistics.median(ddp) if tft else None,
        "metrics": a.metrics,
        "ftjob_metrics_off_step_s": ours_off or None,  # None: not measured (--metrics on|off)
        "ratio_metrics_on_over_off": statistics.median(ours) / statistics.median(ours_off) if ours_off else None,
        "guard": a.guard,
        "ftjob_guard_off_step_s": guard_off or None,  # None: not measured (--guard on|off)
        "ratio_guard_on_over_off": statistics.median(ours) / statistics.median(guard_off) if guard_off else None,
        "sketch": a.sketch,  # ours' setting of the guard's sketch check
        "ftjob_sketch_other_step_s": sketch_other or None,  # ours with the sketch check the other way (--guard both)
        "ratio_sketch_on_over_off": sketch_ratio(medians),
        "digest_s": digest_s,
        "digest_share_of_step_time": digest_share,  # at the default interval, DEFAULT_DIGEST_EVERY steps
        "runs": {side: [dataclasses.asdict(r) for r in rs] for side, rs in runs.items()},  # phases, CPU per round
    }
    print(f"[bench] ftjob ÷ DDP step time: {ratio:.3f} (target <= 1.02; medians of {a.rounds} interleaved rounds)")
    if tft:
        from hack.bench.torchft_rejoin import torchft_label

        figures["torchft"] = torchft_label()
        print(
            f"[bench] ftjob ÷ torchft ({figures['torchft']}) step time: {figures['ratio_ftjob_over_torchft']:.3f} "
            "(target <= 1.0); "
            f"torchft ÷ DDP: {figures['ratio_torchft_over_ddp']:.3f} (medians of {a.rounds} interleaved rounds)"
        )
    elif not a.skip_torchft:
        print("[bench] torchft is not installed (the `bench` extra: see README.md): ours ÷ torchft not measured")
    if ours_off:
        print(
            f"[bench] metrics on ÷ off step time: {figures['ratio_metrics_on_over_off']:.3f} (medians of {a.rounds} "
            "interleaved rounds)"
        )
    if guard_off:
        print(
            f"[bench] gradient guard on ÷ off step time: {figures['ratio_guard_on_over_off']:.3f}; its sketch check "
            f"on ÷ off: {figures['ratio_sketch_on_over_off']:.3f} (medians of {a.rounds} interleaved rounds; ours "
            f"runs with the sketch check {a.sketch})"
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
