"""ftjob's fault-tolerance library: what a training loop imports to survive replica-group failures.

A plain DDP script becomes fault tolerant by changing its setup lines only::

    import ftjob.ft as ft

    ft.init()                                                    # was: dist.init_process_group()
    model = ft.DistributedDataParallel(Net())                    # was: DistributedDataParallel(Net())
    optimizer = ft.Optimizer(torch.optim.AdamW(model.parameters()))
    scheduler = ft.LRScheduler(StepLR(optimizer, step_size=100))
    loader = ft.DataLoader(dataset, batch_size=32)               # was: DataLoader(..., sampler=DistributedSampler)

    for x, y in loader:                                          # the loop itself is unchanged
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()

Spares and healing groups need no code of their own; ``register_state`` adds your own state to what healing copies
and checkpoints hold. ``Manager`` is the lower-level step protocol the wrappers drive (see ftjob.gpt for a loop
written on it).

SIGTERM (a pod deleted or evicted, e.g. by ``kubectl drain``) needs no code either: the group finishes the step in
flight, leaves the job at that step boundary and the process exits with 143 (``Terminated``, a SystemExit) -- unless
the script installed a SIGTERM handler of its own, which is then left alone (ftjob.ft.step.termination).

Every rank's Prometheus metrics (``ftjob_trainer_*``, served on FTJOB_METRICS_PORT) are fed by the Manager; a loop adds
its own tokens and phases: ``ft.trainer_metrics().add_tokens(n)``, ``with ft.trainer_metrics().phase("wrappers.data"):
...``.

Importing this package costs nothing by itself: each name below loads its module on first use (PEP 562), so a
process that only needs the Manager (or ``ftjob.ft.integrity.digest``) does not pay for the wrappers, data loading and
checkpointing modules before it can rejoin its job.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ftjob.ft.gc_freeze import freeze_loaded

freeze_loaded()  # torch and what else the script loaded: out of the collector's full scans (gc_freeze.py)

if TYPE_CHECKING:  # the same names, for type checkers and IDEs
    from ftjob.ft.links.lighthouse_client import EvictedError, LighthouseError
    from ftjob.ft.rank_metrics import TrainerMetrics, trainer_metrics
    from ftjob.ft.recovery.state_check import StateDictError
    from ftjob.ft.setup import current_session, init
    from ftjob.ft.step.manager import InitialSyncError, Manager, ManagerConfig, QuorumInfo, QuorumUnavailable
    from ftjob.ft.step.manager_types import StateLostError, Terminated
    from ftjob.ft.step.session import Session, SessionConfig
    from ftjob.ft.wrappers.data import DataLoader
    from ftjob.ft.wrappers.ddp import DistributedDataParallel
    from ftjob.ft.wrappers.optim import GradScaler, LRScheduler, Optimizer
    from ftjob.ft.wrappers.sharding import MicroBatch, StepShard, step_shard

_LAZY = {  # public name -> the module defining it
    **dict.fromkeys(("DataLoader",), "wrappers.data"),
    **dict.fromkeys(("DistributedDataParallel",), "wrappers.ddp"),
    **dict.fromkeys(("EvictedError", "LighthouseError"), "links.lighthouse_client"),
    **dict.fromkeys(
        ("InitialSyncError", "Manager", "ManagerConfig", "QuorumInfo", "QuorumUnavailable"), "step.manager"
    ),
    **dict.fromkeys(("TrainerMetrics", "trainer_metrics"), "rank_metrics"),
    **dict.fromkeys(("GradScaler", "LRScheduler", "Optimizer"), "wrappers.optim"),
    **dict.fromkeys(("Session", "SessionConfig"), "step.session"),
    **dict.fromkeys(("current_session", "init"), "setup"),
    **dict.fromkeys(("MicroBatch", "StepShard", "step_shard"), "wrappers.sharding"),
    **dict.fromkeys(("StateDictError",), "recovery.state_check"),
    **dict.fromkeys(("StateLostError", "Terminated"), "step.manager_types"),
}


def __getattr__(name: str) -> Any:
    """Loads a public name's module on first use; other names (submodules) fall through to the import system."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


def register_state(name: str, obj: object = None, **callables: object) -> None:
    """Adds your own state to what healing copies and checkpoints hold (see Session.register_state)."""
    from ftjob.ft.setup import current_session

    current_session().register_state(name, obj, **callables)  # type: ignore[arg-type]


__all__ = [
    "DataLoader",
    "DistributedDataParallel",
    "EvictedError",
    "GradScaler",
    "InitialSyncError",
    "LRScheduler",
    "LighthouseError",
    "Manager",
    "ManagerConfig",
    "MicroBatch",
    "Optimizer",
    "QuorumInfo",
    "QuorumUnavailable",
    "Session",
    "SessionConfig",
    "StateDictError",
    "StateLostError",
    "StepShard",
    "Terminated",
    "TrainerMetrics",
    "current_session",
    "init",
    "register_state",
    "step_shard",
    "trainer_metrics",
]
