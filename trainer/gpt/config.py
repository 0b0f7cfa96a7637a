"""``ftjob-trainer train`` configuration: command-line flags over the operator's environment (ftjob.contract).

Every flag defaults to None so that "not given" is distinguishable: a given flag wins, else the env var, else the
built-in default. Bad values fail at start-up with a message naming the flag.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

from ftjob import contract
from ftjob.ft.integrity.duties import DEFAULT_DIGEST_EVERY
from ftjob.ft.integrity.guard import DEFAULT_NORM_RATIO, DEFAULT_SKETCH, GuardConfig
from ftjob.gpt.data import DEFAULT_MAX_BYTES
from ftjob.gpt.model import PRESETS


@dataclass(frozen=True)
class TrainConfig:
    # model, data, optimisation
    model: str = "tiny"
    steps: int = 100
    batch_size: int = 8  # samples per group per step (split across the group's ranks)
    lr: float = 3e-3
    warmup_steps: int = 10
    grad_clip: float = 1.0
    seed: int = 1234
    corpus_bytes: int = DEFAULT_MAX_BYTES
    corpus_root: Path | None = None
    threads: int = 1  # torch intra-op threads per process; 1 avoids oversubscribing shared cores
    min_step_seconds: float = 0.0  # pad each step to this wall time: stands in for a heavier model (demos, tests)
    # where this process sits
    group: str = "0"
    rank: int = 0
    world_size: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = contract.GROUP_MASTER_PORT
    advertise_addr: str = "127.0.0.1"
    recovery_port: int = 0  # 0: ephemeral; pods get the contract's fixed ports through the env
    store_port: int = 0
    device: str = "cpu"
    # fault tolerance
    lighthouse_url: str = f"http://127.0.0.1:{contract.LIGHTHOUSE_PORT}"
    token: str = ""
    min_replicas: int = 1
    collective_timeout_s: float = 5.0
    quorum_timeout_s: float = 60.0
    lighthouse_lost_timeout_s: float = 600.0
    # integrity (ftjob.ft.integrity.duties): the gradient guard and the state digests
    gradient_guard: bool = True
    guard_norm_ratio: float = DEFAULT_NORM_RATIO
    guard_sketch: bool = DEFAULT_SKETCH
    digest_every: int = DEFAULT_DIGEST_EVERY
    # outputs
    run_dir: Path | None = None
    log_every: int = 10
    checkpoint_dir: Path | None = None
    checkpoint_every: int = 0  # steps; 0 = never
    keep_checkpoints: int = 2

    def validate(self) -> TrainConfig:
        problems = []
        if self.model not in PRESETS:
            problems.append(f"--model {self.model!r} is not one of {', '.join(PRESETS)}")
        for name in ("steps", "batch_size", "world_size", "threads", "log_every", "keep_checkpoints", "corpus_bytes"):
            if getattr(self, name) < 1:
                problems.append(f"--{name.replace('_', '-')} must be >= 1 (got {getattr(self, name)})")
        if self.world_size >= 1 and self.batch_size % self.world_size:
            problems.append(
                f"--batch-size {self.batch_size} must be a multiple of the group's ranks "
                f"({self.world_size}) so every rank gets an equal slice"
            )
        if not 0 <= self.rank < max(self.world_size, 1):
            problems.append(f"rank {self.rank} is outside the group's world size {self.world_size}")
        if self.lighthouse_lost_timeout_s <= 0:
            problems.append(f"--lighthouse-lost-timeout must be > 0 (got {self.lighthouse_lost_timeout_s})")
        if self.min_replicas < 1:
            problems.append(f"--min-replicas must be >= 1 (got {self.min_replicas})")
        if self.checkpoint_every < 0:
            problems.append(f"--checkpoint-every must be >= 0 (got {self.checkpoint_every})")
        if self.checkpoint_every and self.checkpoint_dir is None:
            problems.append(f"--checkpoint-every needs --checkpoint-dir (or {contract.ENV_CHECKPOINT_DIR})")
        if self.min_step_seconds < 0:
            problems.append(f"--min-step-seconds must be >= 0 (got {self.min_step_seconds})")
        if self.lr <= 0:
            problems.append(f"--lr must be positive (got {self.lr})")
        if not self.guard_norm_ratio > 1:
            problems.append(f"--guard-norm-ratio must be > 1 (got {self.guard_norm_ratio})")
        if self.digest_every < 0:
            problems.append(f"--digest-every must be >= 0 (got {self.digest_every})")
        if problems:
            raise ValueError("invalid trainer configuration: " + "; ".join(problems))
        return self


def add_train_flags(p: argparse.ArgumentParser) -> None:
    a = p.add_argument
    a("--model", choices=sorted(PRESETS), help="model preset (default tiny)")
    a("--steps", type=int, help="train until this many steps are committed (default 100)")
    a("--batch-size", type=int, help="samples per group per step (default 8)")
    a("--lr", type=float, help="peak AdamW learning rate (default 3e-3)")
    a("--warmup-steps", type=int, help="linear learning-rate warm-up (default 10)")
    a("--seed", type=int, help="initial weights seed; must match across groups (default 1234)")
    a("--corpus-bytes", type=int, help="bytes of the stdlib corpus to use (default 16 MiB)")
    a("--corpus-root", type=Path, help="directory of .py files to train on (default: the standard library)")
    a("--threads", type=int, help="torch threads per process (default 1)")
    a("--min-step-seconds", type=float, help="pad every step to at least this long, like a bigger model (default 0)")
    a("--group", help=f"replica group id (env {contract.ENV_REPLICA_GROUP})")
    a("--lighthouse-url", help=f"lighthouse base URL (env {contract.ENV_LIGHTHOUSE_URL})")
    a("--token", help=f"lighthouse bearer token (env {contract.ENV_TOKEN} or {contract.ENV_TOKEN_FILE})")
    a("--min-replicas", type=int, help=f"groups needed to commit (env {contract.ENV_MIN_REPLICAS})")
    a("--advertise-addr", help=f"IP peers reach this process on (env {contract.ENV_ADVERTISE_ADDR})")
    a("--device", choices=["cpu", "cuda"], help="compute device (default cpu)")
    a("--collective-timeout", type=float, help=f"seconds (env {contract.ENV_COLLECTIVE_TIMEOUT_S}, default 5)")
    a("--quorum-timeout", type=float, help=f"seconds (env {contract.ENV_QUORUM_TIMEOUT_S}, default 60)")
    a(
        "--lighthouse-lost-timeout",
        type=float,
        help=f"seconds to keep retrying an unreachable lighthouse (env {contract.ENV_LIGHTHOUSE_LOST_TIMEOUT_S}, "
        "default 600)",
    )
    a("--gradient-guard", choices=["on", "off"], help=f"refuse steps with a non-finite or outlying gradient norm "
      f"(env {contract.ENV_GUARD}; default on)")  # fmt: skip
    a("--guard-norm-ratio", type=float, help=f"a group's gradient norm above this x the others' median is refused "
      f"(env {contract.ENV_GUARD_NORM_RATIO}; default {DEFAULT_NORM_RATIO:g})")  # fmt: skip
    a("--guard-sketch", choices=["on", "off"], help="judge gradient norms every group checks against the sum "
      f"(random-projection sketches; env {contract.ENV_GUARD_SKETCH}; default "
      f"{'on' if DEFAULT_SKETCH else 'off'})")  # fmt: skip
    a("--digest-every", type=int, help=f"report a state digest every N committed steps (env "
      f"{contract.ENV_DIGEST_EVERY}; default {DEFAULT_DIGEST_EVERY}; 0: never)")  # fmt: skip
    a("--run-dir", type=Path, help="write this group's progress/commit records here (group-<g>.jsonl)")
    a("--log-every", type=int, help="progress line every N steps (default 10)")
    a("--checkpoint-dir", type=Path, help=f"durable checkpoints (env {contract.ENV_CHECKPOINT_DIR})")
    a("--checkpoint-every", type=int, help="checkpoint every N committed steps (default 0: never)")
    a("--keep-checkpoints", type=int, help="checkpoints kept per group (default 2)")


def _env_float(env: dict[str, str], name: str) -> float | None:
    raw = env.get(name)
    if raw is None or raw == "":
        return None
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"env {name}={raw!r} is not a number of seconds") from None


def from_args(args: argparse.Namespace, environ: dict[str, str] | None = None) -> TrainConfig:
    env = dict(os.environ if environ is None else environ)
    try:
        w = contract.WorkerEnv.from_environ(env)
    except ValueError as e:
        raise ValueError(
            f"invalid worker environment: {e} (RANK, WORLD_SIZE, MASTER_PORT, FTJOB_REPLICAS and "
            f"FTJOB_MIN_REPLICAS must be integers)"
        ) from None
    d = TrainConfig()

    def pick(flag: object, env_value: object, default: object) -> object:
        return flag if flag is not None else (env_value if env_value is not None else default)

    ckpt_env = env.get(contract.ENV_CHECKPOINT_DIR)
    guard_env = GuardConfig.from_environ(env)
    digest_env = env.get(contract.ENV_DIGEST_EVERY, "").strip()
    if digest_env and not digest_env.isdigit():
        raise ValueError(f"env {contract.ENV_DIGEST_EVERY}={digest_env!r} is not a number of steps")
    has_env = {
        k: k in env
        for k in (
            contract.ENV_REPLICA_GROUP,
            contract.ENV_LIGHTHOUSE_URL,
            contract.ENV_MIN_REPLICAS,
            contract.ENV_ADVERTISE_ADDR,
        )
    }
    cfg = TrainConfig(
        model=pick(args.model, None, d.model),
        steps=pick(args.steps, None, d.steps),
        batch_size=pick(args.batch_size, None, d.batch_size),
        lr=pick(args.lr, None, d.lr),
        warmup_steps=pick(args.warmup_steps, None, d.warmup_steps),
        seed=pick(args.seed, None, d.seed),
        corpus_bytes=pick(args.corpus_bytes, None, d.corpus_bytes),
        corpus_root=args.corpus_root,
        threads=pick(args.threads, None, d.threads),
        min_step_seconds=pick(args.min_step_seconds, None, d.min_step_seconds),
        group=pick(args.group, w.replica_group if has_env[contract.ENV_REPLICA_GROUP] else None, d.group),
        rank=w.rank,
        world_size=w.world_size,
        master_addr=w.master_addr,
        master_port=w.master_port,
        advertise_addr=pick(
            args.advertise_addr, w.advertise_addr if has_env[contract.ENV_ADVERTISE_ADDR] else None, d.advertise_addr
        ),
        recovery_port=w.recovery_port,
        store_port=w.store_port,
        device=pick(args.device, None, d.device),
        lighthouse_url=pick(args.lighthouse_url, w.lighthouse_url, d.lighthouse_url),
        token=pick(args.token, w.token or None, d.token),
        min_replicas=pick(
            args.min_replicas, w.min_replicas if has_env[contract.ENV_MIN_REPLICAS] else None, d.min_replicas
        ),
        collective_timeout_s=pick(
            args.collective_timeout, _env_float(env, contract.ENV_COLLECTIVE_TIMEOUT_S), d.collective_timeout_s
        ),
        quorum_timeout_s=pick(args.quorum_timeout, _env_float(env, contract.ENV_QUORUM_TIMEOUT_S), d.quorum_timeout_s),
        lighthouse_lost_timeout_s=pick(
            args.lighthouse_lost_timeout,
            _env_float(env, contract.ENV_LIGHTHOUSE_LOST_TIMEOUT_S),
            d.lighthouse_lost_timeout_s,
        ),
        gradient_guard=args.gradient_guard == "on" if args.gradient_guard else guard_env.enabled,
        guard_norm_ratio=pick(args.guard_norm_ratio, guard_env.norm_ratio, d.guard_norm_ratio),
        guard_sketch=args.guard_sketch == "on" if args.guard_sketch else guard_env.sketch,
        digest_every=pick(args.digest_every, int(digest_env) if digest_env else None, d.digest_every),
        run_dir=args.run_dir,
        log_every=pick(args.log_every, None, d.log_every),
        checkpoint_dir=pick(args.checkpoint_dir, Path(ckpt_env) if ckpt_env else None, None),
        checkpoint_every=pick(args.checkpoint_every, None, d.checkpoint_every),
        keep_checkpoints=pick(args.keep_checkpoints, None, d.keep_checkpoints),
    )
    return cfg.validate()
