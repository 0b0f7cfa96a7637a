"""The Manager's integrity duties, kept out of the step protocol: the gradient guard's verdict on each step, the
replicas' state digests every ``digest_every`` committed steps, what rank 0 reports to the lighthouse about both in
its next quorum request, and the fault injection tests use (ftjob.ft.integrity.fault_injection).

Guard. The group's unanimous commit vote carries every rank's row of the guard's table (the all-reduce across the
groups brought rank i the sums of squares of shard i of every group; with the sketch check, the all-gather brought
rank i every group's sketches of shard i) and sums them, so every rank of every group judges every group's whole
gradient from the same numbers (ftjob.ft.integrity.guard) and reaches the same verdict: a refused step fails in every
group alike and no group commits it. Rank 0 reports the offenders, once, in the next QuorumRequest.guard_verdict (a
sketch mismatch names nobody: nothing to report).

Digests. At the step boundary after the commit that made ``step`` a multiple of ``digest_every`` (the start of the
next step: the optimizer has applied that commit by then), the group hashes its parameters and optimizer state (not
buffers, the data position or user state, which may legitimately differ); a sharded group combines its ranks' digests
in rank order. Rank 0 sends it in the next QuorumRequest.state_digest (a prefetched request included): the step
travels with it, so arriving a step late is fine.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from ftjob.contract.lighthouse_api import GuardOffence, GuardVerdict, StateDigest
from ftjob.ft.integrity import guard
from ftjob.ft.integrity.digest import combine, local_digest
from ftjob.ft.integrity.fault_injection import FaultInjection, GradientFault, flip_lowest_bit
from ftjob.ft.rank_metrics import TrainerMetrics
from ftjob.ft.step.manager_group import InGroup

log = logging.getLogger("ftjob.integrity")

DEFAULT_DIGEST_EVERY = 100  # committed steps: rare enough that the digests cost a negligible share of the step time


class Integrity:
    """One rank's integrity duties each step: the gradient guard's verdict, the state digests, and the fault
    injection of tests."""

    def __init__(
        self,
        group: str,
        in_group: InGroup,
        metrics: TrainerMetrics,
        guard_cfg: guard.GuardConfig,
        digest_every: int,
        replica_state: Callable[[], Sequence[torch.Tensor]] | None,
    ) -> None:
        """``replica_state``: the tensors replicas must hold bitwise equal (ftjob.ft.integrity.digest.replica_tensors);
        None: no digests (the Manager does not know which part of its state they are)."""
        if digest_every < 0:
            raise ValueError(f"digest_every must be >= 0 (0: no digests), got {digest_every}")
        self.group, self._in_group, self._metrics = group, in_group, metrics
        self.guard = guard_cfg
        self.digest_every = digest_every if replica_state is not None else 0
        self._replica_state = replica_state
        self.loss_scaling = False  # a dynamic loss scaler handles non-finite gradients (ftjob.ft.integrity.guard)
        self.fault = FaultInjection.from_environ(group)
        self._offences: list[GuardOffence] = []  # this rank's verdict on the step in progress
        self._digested_step = -1
        self._verdict: GuardVerdict | None = None  # rank 0: for the next quorum request
        self._digest: StateDigest | None = None

    # --- step boundary -------------------------------------------------------------------------------------------
    def at_step_boundary(self, step: int) -> None:
        """Before this step's quorum request: the state is the one committed at ``step``."""
        fault = self.fault
        if fault is not None and self._replica_state is not None and fault.flip_due(step) and self._in_group.rank == 0:
            what = flip_lowest_bit(self._replica_state())
            log.warning("fault injection: group %s flipped a bit after step %d: %s", self.group, step, what)
        every = self.digest_every
        if every and step > 0 and step % every == 0 and step != self._digested_step:
            self._digested_step = step
            assert self._replica_state is not None
            digest = local_digest(self._replica_state())
            if self._in_group.world_size > 1:  # every rank of the group is here: the step boundary is common
                digest = combine(self._in_group.all_gather_json(digest))
            self._metrics.digested()
            if self._in_group.rank == 0:
                self._digest = StateDigest(step=step, digest=digest)

    def corruption(self, step: int, contributing: bool) -> GradientFault | None:
        """The gradient fault to inject into this step attempt (FTJOB_FAULT_INJECTION), or None."""
        return self.fault.corruption(step, contributing) if self.fault is not None else None

    # --- the guard -----------------------------------------------------------------------------------------------
    def vote(
        self,
        ok: bool,
        table: list[list[float]] | None,
        rows: int,
        roundoff: float = guard.FLOAT32_ROUNDOFF,
        leaving: bool = False,
    ) -> tuple[bool, str | None, bool]:
        """The group's unanimous vote on the step, and the guard's verdict on it when every rank says yes: whether
        the step commits, why the guard refused it (None: it did not), and whether any rank of the group is leaving
        the job (``leaving``: this rank got SIGTERM; carried in the same all-reduce). ``table``: this rank's
        all-reduced guard table, or its gathered sketch rows (ftjob.ft.allreduce.grad_sync), ``rows`` the quorum's
        groups (the same on every rank, so every vote matches), ``roundoff`` the gradient buckets' unit roundoff (the
        sketch check)."""
        self._offences = []
        if not self.guard.enabled:
            ok, leave = self._in_group.vote(ok, leaving)
            return ok, None, leave
        columns = guard.SKETCH_COLUMNS if self.guard.sketch else guard.COLUMNS
        ok, summed, leave = self._in_group.all_true_summing(ok, table, rows, columns, leaving)
        if not ok:
            return False, None, leave
        shards = self._in_group.world_size
        if self.guard.sketch:
            rows_ = guard.sketch_rows(summed, shards)
            verdict = guard.judge_sketches(rows_, self.guard.norm_ratio, self.loss_scaling, roundoff)
        else:
            offences = guard.judge(
                guard.contributions(guard.whole_groups(summed, shards)), self.guard.norm_ratio, self.loss_scaling
            )
            verdict = guard.Verdict(offences, guard.describe(offences, self.guard.norm_ratio) if offences else None)
        self._offences = verdict.offences
        for o in self._offences:
            self._metrics.guard_offence(o.kind)
        if verdict.unattributed:
            self._metrics.guard_offence("sketch_mismatch")
        return (False, verdict.refused, leave) if verdict.refused is not None else (True, None, leave)

    def after_vote(self, committed: bool, quorum_id: int, step: int) -> None:
        """After the vote: rank 0 keeps a refused step's verdict for the next request."""
        offences, self._offences = self._offences, []
        if not committed and offences and self._in_group.rank == 0:
            self._verdict = GuardVerdict(quorum_id=quorum_id, step=step, offenders=offences)

    # --- reporting -----------------------------------------------------------------------------------------------
    def report_fields(self) -> dict[str, Any]:
        """The verdict and digest not yet reported, for the quorum request being built (each is sent once)."""
        fields = {"guard_verdict": self._verdict, "state_digest": self._digest}
        self._verdict = self._digest = None
        return fields
