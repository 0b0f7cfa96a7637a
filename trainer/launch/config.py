"""``ftjob-trainer launch`` flags: a whole job as local processes, running any training command.

    ftjob-trainer launch [flags]                        the reference GPT trainer (ftjob.gpt)
    ftjob-trainer launch [flags] -- python train.py ... any command; every rank gets the operator's env contract

Bad values fail before any process starts, with a message naming the flag.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from ftjob.ft.integrity.fault_injection import FaultInjection
from ftjob.gpt.model import PRESETS

DEFAULT_STEPS = 200  # the reference trainer's, when --steps is not given
DEFAULT_BATCH = 128


@dataclass(frozen=True)
class LaunchConfig:
    replicas: int
    pods_per_replica: int
    min_replicas: int
    steps: int | None  # None: the command decides (the launcher then only knows the lighthouse's step)
    kill_at: list[int]
    kill_every: float | None
    restart_delay: float
    run_dir: Path
    report: Path | None
    timeline: Path | None
    spares: int
    seed: int
    timeout: float
    checkpoint_every: int
    max_crashes: int
    min_step_seconds: float
    command: list[str] = field(default_factory=list)  # empty: the reference GPT trainer with the flags below
    model: str = "tiny"
    batch_size: int = DEFAULT_BATCH
    extra_train_args: list[str] = field(default_factory=list)
    tls: bool = False  # a throwaway CA in <run-dir>/tls; the lighthouse and recovery servers serve TLS only
    inject_fault: str = ""  # FTJOB_FAULT_INJECTION for every group (the named group's first incarnation acts on it)
    digest_every: int | None = None  # FTJOB_DIGEST_EVERY (None: the trainer's default)

    @property
    def title(self) -> str:
        what = " ".join(self.command) if self.command else f"model {self.model}"
        return f"{self.replicas} groups x {self.pods_per_replica} ranks, {what}"


def add_launch_flags(p: argparse.ArgumentParser) -> None:
    a = p.add_argument
    a("--replicas", type=int, default=3, help="replica groups that contribute (default 3)")
    a("--pods-per-replica", type=int, default=1, help="ranks per group; >1 shards the model with FSDP2 (default 1)")
    a("--min-replicas", type=int, default=None, help="groups needed to commit (default replicas-1, at least 1)")
    a("--steps", type=int, default=None, help=f"steps the reference trainer trains (default {DEFAULT_STEPS})")
    a("--kill-at", default="", help="SIGKILL a random group when the committed step reaches each STEP[,STEP...]")
    a("--kill-every", type=float, default=None, help="SIGKILL a random group every SECONDS")
    a("--restart-delay", type=float, default=1.0, help="seconds before a dead group is restarted (default 1)")
    a("--run-dir", type=Path, default=None, help="records, logs, checkpoints (default: a fresh ./ftjob-run-<time>)")
    a("--report", type=Path, default=None, help="write the JSON report here")
    a("--timeline", type=Path, default=None, help="write the timeline PNG here")
    a("--spares", type=int, default=0, help="extra live groups beyond --replicas that stand by (default 0)")
    a("--seed", type=int, default=0, help="seed of the victim choice (default 0)")
    a("--timeout", type=float, default=1800.0, help="give up after SECONDS (default 1800)")
    a("--checkpoint-every", type=int, default=0, help="durable checkpoint every N steps into <run-dir>/checkpoints")
    a("--min-step-seconds", type=float, default=0.0, help="pad each step to this long (stand-in for a bigger model)")
    a("--max-crashes", type=int, default=10, help="give up when one group exits unexpectedly this often (default 10)")
    a("--tls", action="store_true", help="TLS as in a cluster: a throwaway CA in <run-dir>/tls, the lighthouse and "
      "every recovery server serve TLS only (default: plain HTTP on loopback, for local development)")  # fmt: skip
    a("--inject-fault", default="", metavar="SPEC", help="tests: a faulty group, e.g. group=1,kind=nan,step=20,count=3 "
      "or group=2,kind=bitflip,step=30 (FTJOB_FAULT_INJECTION; only the group's first incarnation)")  # fmt: skip
    a("--digest-every", type=int, default=None, help="state digests every N committed steps (FTJOB_DIGEST_EVERY)")
    g = p.add_argument_group("the reference GPT trainer (only without a command after --)")
    g.add_argument("--model", default=None, choices=sorted(PRESETS), help="model preset (default tiny)")
    g.add_argument("--batch-size", type=int, default=None, help=f"samples per group per step (default {DEFAULT_BATCH})")
    g.add_argument("--train-arg", action="append", default=[], help="extra flag passed to every `train` (repeatable)")


def split_command(argv: list[str]) -> tuple[list[str], list[str]]:
    """(launcher flags, the training command after ``--``)."""
    if "--" not in argv:
        return argv, []
    i = argv.index("--")
    return argv[:i], argv[i + 1 :]


def config_from_args(a: argparse.Namespace, command: list[str] | None = None) -> LaunchConfig:
    command = list(command or [])
    problems = []
    try:
        kill_at = sorted(int(s) for s in a.kill_at.split(",") if s.strip())
    except ValueError:
        kill_at = []
        problems.append(f"--kill-at {a.kill_at!r} must be comma-separated step numbers, e.g. 50,120")
    steps = a.steps if a.steps is not None or command else DEFAULT_STEPS
    min_replicas = a.min_replicas if a.min_replicas is not None else max(1, a.replicas - 1)
    if a.replicas < 1 or a.pods_per_replica < 1 or (steps is not None and steps < 1):
        problems.append("--replicas, --pods-per-replica and --steps must be >= 1")
    if not 1 <= min_replicas <= a.replicas:
        problems.append(f"--min-replicas {min_replicas} must be between 1 and --replicas {a.replicas}")
    if steps is not None and any(not 0 < s < steps for s in kill_at):
        problems.append(f"every --kill-at step must be between 1 and --steps-1 ({steps - 1}); got {kill_at}")
    if any(s < 1 for s in kill_at):
        problems.append(f"every --kill-at step must be >= 1; got {kill_at}")
    if kill_at and min_replicas >= a.replicas + a.spares:
        problems.append(
            f"--kill-at needs --min-replicas ({min_replicas}) below the live groups "
            f"({a.replicas + a.spares}), or nothing could commit while a group is down"
        )
    if a.kill_every is not None and a.kill_every <= 0:
        problems.append("--kill-every must be a positive number of seconds")
    if command and (a.model is not None or a.batch_size is not None or a.train_arg):
        problems.append("--model, --batch-size and --train-arg configure the reference trainer: pass your own "
                        "command's flags after -- instead")  # fmt: skip
    batch_size = DEFAULT_BATCH if a.batch_size is None else a.batch_size
    if not command and batch_size % a.pods_per_replica:
        problems.append(f"--batch-size {batch_size} must be a multiple of --pods-per-replica {a.pods_per_replica}")
    if a.spares < 0 or a.restart_delay < 0:
        problems.append("--spares and --restart-delay must be >= 0")
    if a.digest_every is not None and a.digest_every < 0:
        problems.append(f"--digest-every must be >= 0 (got {a.digest_every})")
    if a.inject_fault:
        try:
            fault = FaultInjection.parse(a.inject_fault)
            if not 0 <= int(fault.group) < a.replicas + a.spares:
                problems.append(f"--inject-fault names group {fault.group}, not one of this run's groups")
        except ValueError as e:
            problems.append(f"--inject-fault: {e}")
    if problems:
        raise ValueError("invalid launch flags: " + "; ".join(problems))
    run_dir = a.run_dir or Path(f"ftjob-run-{time.strftime('%Y%m%d-%H%M%S')}")
    return LaunchConfig(
        replicas=a.replicas,
        pods_per_replica=a.pods_per_replica,
        min_replicas=min_replicas,
        steps=steps,
        kill_at=kill_at,
        kill_every=a.kill_every,
        restart_delay=a.restart_delay,
        run_dir=run_dir.resolve(),
        report=a.report,
        timeline=a.timeline,
        spares=a.spares,
        seed=a.seed,
        timeout=a.timeout,
        checkpoint_every=a.checkpoint_every,
        max_crashes=a.max_crashes,
        min_step_seconds=a.min_step_seconds,
        command=command,
        model=a.model or "tiny",
        batch_size=batch_size,
        extra_train_args=list(a.train_arg),
        tls=a.tls,
        inject_fault=a.inject_fault,
        digest_every=a.digest_every,
    )


def reference_trainer_command(cfg: LaunchConfig) -> list[str]:
    """The command every rank runs when none was given: the reference GPT trainer with the launcher's flags."""
    args = [
        f"--model={cfg.model}",
        f"--steps={cfg.steps}",
        f"--batch-size={cfg.batch_size}",
        f"--run-dir={cfg.run_dir}",
        "--log-every=10",
        f"--min-step-seconds={cfg.min_step_seconds}",
    ]
    if cfg.checkpoint_every:
        args += [f"--checkpoint-dir={cfg.run_dir / 'checkpoints'}", f"--checkpoint-every={cfg.checkpoint_every}"]
    return [sys.executable, "-m", "ftjob.gpt", *args, *cfg.extra_train_args]
