"""``ftjob.ft.init()``: this process's session, configured from the environment the operator (or the local launcher)
gives every worker pod (ftjob.contract); keyword arguments override it."""

from __future__ import annotations

import atexit
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from ftjob import contract
from ftjob.ft.integrity.guard import GuardConfig
from ftjob.ft.step.manager import ManagerConfig
from ftjob.ft.step.session import Session, SessionConfig

_current: Session | None = None


def _env_number(name: str, kind: type[float] | type[int], default: float) -> Any:
    raw = os.environ.get(name, "")
    try:
        return kind(raw) if raw else kind(default)
    except ValueError:
        raise ValueError(f"env {name}={raw!r} is not a number") from None


def _no_job_environment() -> str:
    """What to do when a script calls ``init()`` outside any job: one line naming the variable and the launchers."""
    return (
        f"ftjob.ft.init(): no job environment ({contract.ENV_LIGHTHOUSE_URL} is not set): run the script in a "
        "FaultTolerantTrainingJob's pods, or locally with `ftjob-trainer launch --replicas 2 -- python <script>`, "
        "or pass lighthouse_url= to ftjob.ft.init()"
    )


def init(
    *,
    device: str | None = None,
    sync_at_start: bool = True,
    checkpoint_dir: str | Path | None = None,
    checkpoint_every: int | None = None,
    **manager: Any,
) -> Session:
    """Joins this process to its job (replaces ``dist.init_process_group()`` in a DDP script).

    Initialises ``torch.distributed`` for the ranks of this replica group (FSDP2 shards over them; the groups
    replicate through ftjob), and returns the process's Session, which the wrappers use. ``device``: "cuda" (NCCL
    between groups) or "cpu" (gloo); default cuda when available. ``sync_at_start``: at step 0, every fresh group
    copies one reference group's state, so groups never train from different initial weights. Checkpoints for
    whole-job restarts go to ``checkpoint_dir`` (env FTJOB_CHECKPOINT_DIR) every ``checkpoint_every`` committed
    steps (env FTJOB_CHECKPOINT_EVERY; 0: never). Other keywords override ManagerConfig fields, e.g.
    ``gradient_guard`` (env FTJOB_GRADIENT_GUARD), ``guard_norm_ratio`` (FTJOB_GUARD_NORM_RATIO), ``guard_sketch``
    (FTJOB_GUARD_SKETCH) and ``digest_every`` (FTJOB_DIGEST_EVERY).

    Outside a job (no ``FTJOB_LIGHTHOUSE_URL`` and no ``lighthouse_url=``) it raises RuntimeError at once, naming the
    variable and the launchers, instead of waiting for a lighthouse nobody started.

    SIGTERM (the pod deleted or evicted) is handled from the first step on, by the session's Manager: the group
    leaves the job after the step in flight and the process exits 143 (ftjob.ft.step.termination) -- unless the script
    installed a SIGTERM handler of its own by then, which is left alone. Before the first step it ends the process
    at once, as without ftjob: there is nothing to finish.
    """
    global _current
    if _current is not None:
        raise RuntimeError("ftjob.ft.init() was already called in this process")
    if contract.ENV_LIGHTHOUSE_URL not in os.environ and "lighthouse_url" not in manager:
        raise RuntimeError(_no_job_environment())
    env = contract.WorkerEnv.from_environ()
    guard = GuardConfig.from_environ()
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get(contract.ENV_LOCAL_RANK, "0")))
    if not dist.is_initialized():
        dist.init_process_group(
            "cpu:gloo,cuda:nccl" if device == "cuda" else "gloo",
            init_method=f"tcp://{env.master_addr}:{env.master_port}",
            rank=env.rank,
            world_size=env.world_size,
        )
    mcfg = ManagerConfig(
        group=env.replica_group,
        lighthouse_url=env.lighthouse_url,
        token=env.token,
        advertise_addr=env.advertise_addr,
        recovery_port=env.recovery_port,
        store_port=env.store_port,
        rank=env.rank,
        world_size=env.world_size,
        min_replicas=env.min_replicas,
        collective_timeout_s=_env_number(contract.ENV_COLLECTIVE_TIMEOUT_S, float, ManagerConfig.collective_timeout_s),
        quorum_timeout_s=_env_number(contract.ENV_QUORUM_TIMEOUT_S, float, ManagerConfig.quorum_timeout_s),
        lost_timeout_s=_env_number(contract.ENV_LIGHTHOUSE_LOST_TIMEOUT_S, float, ManagerConfig.lost_timeout_s),
        device=device,
        sync_at_start=sync_at_start,
        gradient_guard=guard.enabled,
        guard_norm_ratio=guard.norm_ratio,
        guard_sketch=guard.sketch,
        digest_every=_env_number(contract.ENV_DIGEST_EVERY, int, ManagerConfig.digest_every),
    )
    ckpt = checkpoint_dir or os.environ.get(contract.ENV_CHECKPOINT_DIR) or None
    run_dir = os.environ.get(contract.ENV_RUN_DIR)
    cfg = SessionConfig(
        manager=replace(mcfg, **manager),
        replicas=env.replicas,
        checkpoint_dir=Path(ckpt) if ckpt else None,
        checkpoint_every=checkpoint_every
        if checkpoint_every is not None
        else _env_number(contract.ENV_CHECKPOINT_EVERY, int, 0),
        run_dir=Path(run_dir) if run_dir else None,
        min_step_seconds=_env_number(contract.ENV_MIN_STEP_SECONDS, float, 0.0),
    )
    _current = Session(cfg)
    atexit.register(_current.shutdown)
    return _current


def current_session() -> Session:
    """The session ``init()`` made (it is called with defaults if it was not)."""
    return _current if _current is not None else init()
