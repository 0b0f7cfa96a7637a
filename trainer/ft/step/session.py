"""This process's part in a fault-tolerant job: the state it shares with its peers and the step protocol the wrappers
(DistributedDataParallel, Optimizer, LRScheduler, GradScaler, DataLoader) drive from an unchanged training loop.

One step, whichever wrapper moves it on:
  begin      the first batch of a step (DataLoader) or the model's forward: join the quorum; a group behind the job,
             or a fresh one at step 0, first copies every registered state from a peer (it "heals")
  backward   the gradient buckets' all-reduce starts during the backward pass and is complete when it returns, so
             gradient clipping and GradScaler.unscale_ see the job-wide average
  commit     optimizer.step(): the group votes; only on a commit does the wrapped optimizer step, the data cursor
             move on, the LR scheduler and GradScaler update, a checkpoint get written. A step that does not commit
             is trained again from the same data. A step nobody stepped (GradScaler skipped it) closes without an
             update when the next one begins.
A spare or healing group runs the same loop on a batch it is lent; its gradients are replaced by zeros, so it
applies exactly the update everyone applies and never counts towards the samples.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from ftjob.ft.integrity.digest import model_digest, replica_tensors
from ftjob.ft.rank_metrics import TrainerMetrics, trainer_metrics
from ftjob.ft.records import CommitRecord, FinishedRecord, GroupLog, StartRecord, group_log_path
from ftjob.ft.recovery.job_checkpoint import JobCheckpoints
from ftjob.ft.recovery.state_check import StateDictError, check_state_dict
from ftjob.ft.step.manager import Manager, ManagerConfig, QuorumInfo
from ftjob.ft.wrappers.sharding import StepShard
from torch import nn

log = logging.getLogger("ftjob.session")


class Stateful(Protocol):
    """Anything with torch's ``state_dict`` / ``load_state_dict`` pair: what ``register_state`` takes."""

    def state_dict(self) -> Any:
        """The object's state."""
        ...

    def load_state_dict(self, state: Any) -> Any:
        """Loads a state ``state_dict`` returned."""
        ...


@dataclass(frozen=True)
class SessionConfig:
    """What ``ftjob.ft.init`` reads from the operator's environment (or the local launcher's)."""

    manager: ManagerConfig
    replicas: int = 1  # contributing groups wanted: sizes the fixed global batch
    checkpoint_dir: Path | None = None
    checkpoint_every: int = 0  # committed steps between durable checkpoints; 0: never
    keep_checkpoints: int = 2
    run_dir: Path | None = None  # run records for the local launcher's report
    min_step_seconds: float = 0.0  # pad each step (a stand-in for a bigger model in demos and tests)


@dataclass(frozen=True)
class StepSamples:
    """The samples of the step in progress, as the DataLoader handed them out."""

    cursor: int
    global_batch: int
    shard: StepShard


class Session:
    """Owns the Manager, the registered state and the step in progress. Get it from ``ftjob.ft.init()``."""

    def __init__(self, cfg: SessionConfig) -> None:
        self.cfg = cfg
        self.manager: Manager | None = None
        self.total_steps: int | None = None  # known once a DataLoader is attached
        self.last_committed: bool | None = None
        self._entries: dict[str, tuple[Callable[[], Any], Callable[[Any], Any]]] = {}
        self._model: nn.Module | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._params: list[nn.Parameter] = []
        self._on_commit: list[Callable[[QuorumInfo], None]] = []
        self._info: QuorumInfo | None = None
        self._reduced = False
        self._samples: StepSamples | None = None
        self._step_started = 0.0
        self._checked_after_first_commit = False
        self._finished = False
        self.loss_scaling = (
            False  # an enabled ft.GradScaler: it handles non-finite gradients (ftjob.ft.integrity.guard)
        )
        self._final_step = 0
        self._checkpoints = JobCheckpoints.from_config(cfg) if cfg.checkpoint_dir else None
        rank0 = cfg.manager.rank == 0
        self._log = GroupLog(group_log_path(cfg.run_dir, cfg.manager.group)) if cfg.run_dir and rank0 else None

    @property
    def step(self) -> int:
        """The job's committed step as this group knows it (0 before the first quorum or resume)."""
        return self.manager.step if self.manager is not None else self._final_step

    @property
    def model(self) -> nn.Module | None:
        """The wrapped model's module (registered by DistributedDataParallel)."""
        return self._model

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The optimizer ftjob.ft.Optimizer wraps."""
        return self._optimizer

    @property
    def entries(self) -> dict[str, tuple[Callable[[], Any], Callable[[Any], Any]]]:
        """Every registered state: name -> (state_dict, load_state_dict)."""
        return dict(self._entries)

    @property
    def metrics(self) -> TrainerMetrics:
        """This process's Prometheus metrics (add tokens and phases of your own loop here)."""
        return self.manager.trainer_metrics if self.manager is not None else trainer_metrics()

    @property
    def ranks(self) -> int:
        """Ranks in this replica group."""
        return self.cfg.manager.world_size

    @property
    def rank(self) -> int:
        """This process's rank in its replica group."""
        return self.cfg.manager.rank

    # --- registration ----------------------------------------------------------------------------------------
    def register_model(self, model: nn.Module) -> None:
        """The model whose gradients are averaged and whose state travels with healing and checkpoints."""
        self._model = model
        self._params = [p for p in model.parameters() if p.requires_grad]
        self._register("model", model.state_dict, model.load_state_dict)

    def register_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """The inner optimizer whose state travels with healing and checkpoints."""
        self._optimizer = optimizer
        self._register("optim", optimizer.state_dict, optimizer.load_state_dict)

    def register_state(
        self,
        name: str,
        obj: Stateful | None = None,
        *,
        state_dict: Callable[[], Any] | None = None,
        load_state_dict: Callable[[Any], Any] | None = None,
    ) -> None:
        """Adds your own state (an object with ``state_dict``/``load_state_dict``, or the two callables) to what a
        healing peer copies and a checkpoint holds. Checked now: StateDictError says what cannot travel."""
        get = state_dict or (obj.state_dict if obj is not None else None)
        put = load_state_dict or (obj.load_state_dict if obj is not None else None)
        if get is None or put is None:
            raise TypeError(f"register_state({name!r}) needs an object with state_dict/load_state_dict, or both")
        if name in ("model", "optim"):
            raise ValueError(f"state name {name!r} is taken by the wrapped model/optimizer")
        self._register(name, get, put)

    def _register(self, name: str, get: Callable[[], Any], put: Callable[[Any], Any]) -> None:
        check_state_dict({name: get()}, self._who)
        self._entries[name] = (get, put)

    def on_commit(self, hook: Callable[[QuorumInfo], None]) -> None:
        """``hook(info)`` runs after every committed step (before its record and checkpoint)."""
        self._on_commit.append(hook)

    @property
    def _who(self) -> str:
        return f"group {self.cfg.manager.group} rank {self.cfg.manager.rank}"

    def _replica_state(self) -> list[torch.Tensor]:
        """What the state digests cover: the model's parameters and the optimizer's state (registered entries of
        your own may legitimately differ between groups)."""
        assert self._model is not None
        return replica_tensors(self._model, self._optimizer)

    def state_dict(self) -> dict[str, Any]:
        """Everything registered: what a healing peer copies."""
        return {name: get() for name, (get, _put) in self._entries.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Loads a peer's or a checkpoint's state into everything registered; StateDictError when a registered
        entry is missing from it."""
        missing = sorted(set(self._entries) - set(state))
        if missing:
            raise StateDictError(f"{self._who}: the peer's state lacks {missing}: every group must register the same")
        for name, (_get, put) in self._entries.items():
            put(state[name])

    # --- the step protocol -----------------------------------------------------------------------------------
    def start(self) -> None:
        """Resumes from the newest checkpoint (if any) and joins the job; idempotent. The first step calls it."""
        if self.manager is not None:
            return
        if self._finished:
            raise RuntimeError("this session has finished (its DataLoader ran out); start a new process to train more")
        if self._model is None or self._optimizer is None:
            raise RuntimeError(
                "wrap the model with ftjob.ft.DistributedDataParallel and the optimizer with ftjob.ft.Optimizer "
                "before the first step"
            )
        step = self._checkpoints.resume(self) if self._checkpoints else 0
        self.manager = Manager(  # checks the state
            self.cfg.manager, self.state_dict, self.load_state_dict, replica_state=self._replica_state
        )
        self.manager.register_params(self._params)
        self.manager.set_loss_scaling(self.loss_scaling)
        self.manager.step = step
        if self._log:
            self._log.write(StartRecord(group=self.cfg.manager.group, incarnation=self.manager.incarnation, step=step,
                                        pid=os.getpid()))  # fmt: skip

    def begin_step(self) -> QuorumInfo:
        """Joins this step's quorum (idempotent within a step)."""
        if self._info is not None:
            return self._info
        self.start()
        assert self.manager is not None
        pad = self.cfg.min_step_seconds - (time.monotonic() - self._step_started)
        if pad > 0:
            time.sleep(pad)  # --min-step-seconds: simulated compute of a bigger model, not synchronisation
        self._step_started = time.monotonic()
        self._info = self.manager.start_quorum()
        self._reduced = False
        self._samples = None
        return self._info

    def note_samples(self, samples: StepSamples, contributing: bool) -> None:
        """The DataLoader says which samples this step trains: their weight in the average, and the records."""
        self._samples = samples
        if self.manager is not None:
            self.manager.set_gradient_weight(samples.shard.weight if contributing else 1.0)

    def end_backward(self) -> None:
        """The step's backward pass is over: average the gradients across the quorum now."""
        if self._info is None or self._reduced or self.manager is None:
            return
        self._reduced = True
        self.manager.allreduce_gradients(self._params)

    def hold_gradient_sync(self, held: bool) -> None:
        """While held, backward passes only accumulate gradients (gradient accumulation)."""
        if self.manager is not None:
            self.manager.hold_gradient_sync(held)

    def commit(self, apply: Callable[[], Any] | None) -> bool:
        """Ends the step: the group votes; on a commit ``apply`` (the wrapped optimizer's step) runs."""
        info = self._info
        if info is None or self.manager is None:
            raise RuntimeError(
                "optimizer.step() outside a step: take the step's batch from ftjob.ft.DataLoader, or call the wrapped "
                "model, before stepping"
            )
        self.end_backward()
        ok = self.manager.should_commit()
        self._info = None
        self.last_committed = ok
        if not ok:
            log.warning(
                "%s: step %d did not commit (%s); training it again", self._who, info.step, self.manager.last_error
            )
            return False
        if self.total_steps is None or self.manager.step < self.total_steps:
            self.manager.prefetch_quorum()  # the next quorum's round-trip overlaps the optimizer step
        if apply is not None:
            apply()
        for hook in self._on_commit:
            hook(info)
        self._record_commit(info)
        self._check_after_commit()
        if self._checkpoints:
            self._checkpoints.poll()
            if self.cfg.checkpoint_every and self.manager.step % self.cfg.checkpoint_every == 0:
                self._checkpoints.save(self, self.manager.step)
        return True

    def close_open_step(self) -> None:
        """A step whose optimizer.step() never came (GradScaler skipped it: every group saw the same inf/NaN
        average) commits without an update, as plain PyTorch moves on to the next batch."""
        if self._info is not None:
            self.commit(None)

    def _record_commit(self, info: QuorumInfo) -> None:
        if self._log is None or self.manager is None:
            return
        s = self._samples
        shard = s.shard if s is not None and info.contributing else None
        self._log.write(
            CommitRecord(
                group=self.cfg.manager.group,
                incarnation=self.manager.incarnation,
                step=self.manager.step,
                cursor=s.cursor if s else 0,
                step_samples=s.global_batch if s else 0,
                num_contributors=info.num_contributors,
                participants=info.participants,
                contributing=info.contributing,
                shard=info.contributor_rank,
                shard_start=shard.group_start if shard else -1,
                shard_count=shard.group_count if shard else 0,
                healed=info.healed,
            )
        )

    def _check_after_commit(self) -> None:
        """The optimizer's state appears with its first step: check everything once then; the small entries (your
        own, the data cursor, the scheduler) after every commit, since they may change shape any time."""
        assert self.manager is not None
        if not self._checked_after_first_commit:
            self._checked_after_first_commit = True
            self.manager.check_state()
            return
        check_state_dict({n: get() for n, (get, _) in self._entries.items() if n not in ("model", "optim")}, self._who)

    def finish(self) -> None:
        """The last step is done: report the parameters' digest and leave the job (the DataLoader calls this)."""
        if self._finished:
            return
        self.close_open_step()
        self.start()  # a group that finds the job already done still reports
        assert self.manager is not None and self._model is not None
        if self._checkpoints:
            self._checkpoints.wait()
        digest = model_digest(self._model)  # a collective for sharded models: every rank of the group is here
        if self._log:
            self._log.write(FinishedRecord(group=self.cfg.manager.group, incarnation=self.manager.incarnation,
                                           step=self.manager.step, param_digest=digest))  # fmt: skip
        if self.rank == 0:
            print(f"FTJOB_DONE group={self.cfg.manager.group} step={self.manager.step} digest={digest}", flush=True)
        self.manager.report_finished(digest)
        self._final_step = self.manager.step
        self.shutdown()
        self._finished = True

    def shutdown(self) -> None:
        """Leaves the job (idempotent; also at interpreter exit)."""
        if self.manager is not None:
            self.manager.shutdown()
            self.manager = None
        if self._log is not None:
            self._log.close()
            self._log = None
