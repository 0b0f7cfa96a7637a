"""The part of a job's worker that talks to the job's lighthouse: which pod serves it, polling its status view (and
judging from it which groups fell silent), evictions and hand-overs, and announcing starting groups, the desired
contributor count and each group's running generation. A mixin of JobWorker (worker.py), whose reconcile calls these
in its order of effects."""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from typing import Any

from ftjob.operator.lighthouse.audit_mirror import AuditMirror
from ftjob.operator.lighthouse.client import LighthouseClient, LighthouseEndpoint, endpoint
from ftjob.operator.lighthouse.view import LighthouseView, SilenceWatch
from ftjob.operator.planning.integrity_evictions import failed_pods
from ftjob.operator.planning.plan import PHASE_RESTARTING, PHASE_STARTING, Actions, Result
from ftjob.operator.runtime import operator_metrics as metrics
from ftjob.operator.state import names
from ftjob.operator.state.job_spec import JobSpec
from ftjob.operator.state.job_state import JobState, PodView

log = logging.getLogger("ftjob.operator.reconcile.job_reconciler")

LIGHTHOUSE_POLL_S = 2.0
RETRY_S = 0.5


def declared_generations(state: JobState) -> dict[int, int]:
    """Each group's oldest generation that still runs, for the lighthouse to refuse older ones (their pods are gone or
    going): the current one, or while a group migrates the one handing over (it trains on until its successor
    registers)."""
    return {i: g.generation if g.migrating_from is None else g.migrating_from for i, g in state.groups.items()}


class JobLighthouse:
    """The lighthouse side of JobWorker: its state here, the rest (job, operator token, CA, Events) the worker's."""

    namespace: str
    name: str
    body: dict[str, Any]
    lighthouse: LighthouseClient
    state: JobState | None
    operator_token: str | None  # the operator's own token for the lighthouse (never the workers')
    lh_tls: ssl.SSLContext | None
    audit: AuditMirror

    def _init_lighthouse(self) -> None:
        self.pending_starting: set[int] = set()
        # what the lighthouse last acknowledged: (its address, its generation, replicas, groups, group generations)
        self.desired_acked: tuple[LighthouseEndpoint, int, int, int, tuple[tuple[int, int], ...]] | None = None
        self.lh_view: LighthouseView | None = None
        self.lh_polled = 0.0
        self.lh_retry_at = 0.0
        self.lh_polled_base: LighthouseEndpoint | None = None
        self.lh_view_at = 0.0
        self.lh_view_generation: int | None = None  # the lighthouse generation that answered lh_view
        self.failure_polls: set[str] = set()  # failed pods a lighthouse poll was forced for (the eviction's reason)
        self.silence = SilenceWatch()  # groups that left the lighthouse while their pods run

    def _event(self, type_: str, reason: str, message: str) -> None:
        raise NotImplementedError  # JobWorker posts Events

    def _lighthouse_base(self, pods: list[PodView], state: JobState) -> LighthouseEndpoint | None:
        name = names.lighthouse_pod(self.name, state.lighthouse_generation)
        for p in pods:
            if p.name == name and p.ip and p.phase == "Running" and p.deletion_time is None:
                return endpoint(p.ip, self.lh_tls, names.lighthouse_dns_names(self.name, self.namespace)[0])
        return None

    def _fresh_failure(self, pods: list[PodView]) -> bool:
        """A pod of a group's current generation just failed: read the lighthouse now, not up to a poll later, so a
        trainer that exited because the lighthouse evicted it (gradient guard, divergence) is replaced for that."""
        failed = failed_pods(pods, self.state) if self.state else set()
        fresh, self.failure_polls = failed - self.failure_polls, failed
        return bool(fresh)

    def _silent_groups(self, spec: JobSpec, now: float) -> dict[int, str]:
        if self.lh_view is None or self.state is None or now - self.lh_view_at > 3 * LIGHTHOUSE_POLL_S:
            return {}  # no fresh view of the lighthouse: absence cannot be judged (and is not counted)
        return self.silence.silent(self.lh_view, self.lh_view_at, self.state, spec.lighthouse.heartbeat_timeout_s, now)

    async def _poll_lighthouse(self, pods: list[PodView], now: float, force: bool = False) -> None:
        if self.state is None or self.operator_token is None:
            return
        if not force and now - self.lh_polled < LIGHTHOUSE_POLL_S:
            return
        base = self._lighthouse_base(pods, self.state)
        if base is None:
            return
        self.lh_polled = now
        view = await self.lighthouse.status(base, self.operator_token)
        metrics.LIGHTHOUSE_CALLS.labels("status", "ok" if view else "error").inc()
        if view is not None:
            # a new lighthouse (a replacement may even get its predecessor's IP): every group must be seen joining it
            # again, and no group's absence from it counts from before that
            if base != self.lh_polled_base or self.lh_view_generation != self.state.lighthouse_generation:
                self.silence.new_lighthouse()
                self.lh_polled_base = base
            self.lh_view = view
            self.lh_view_at = now
            self.lh_view_generation = self.state.lighthouse_generation
            await self.audit.mirror(self.body, view.audit, self.state.lighthouse_generation)

    async def _evict(self, base: LighthouseEndpoint | None, a: Actions) -> None:
        if base is None or self.operator_token is None:
            log.info("%s/%s: lighthouse not reachable for eviction of %s", self.namespace, self.name, a.evict)
            return
        # One call per group: the lighthouse rejects a whole request naming a group it never saw (404).
        results = await asyncio.gather(
            *(self.lighthouse.evict(base, self.operator_token, [group], reason) for group, reason in a.evict)
        )
        for (group, reason), ok in zip(a.evict, results, strict=True):
            metrics.LIGHTHOUSE_CALLS.labels("evict", "ok" if ok else "error").inc()
            if ok:
                log.info("%s/%s: lighthouse evicted group %s (%s)", self.namespace, self.name, group, reason)
                self._event("Normal", "LighthouseEvicted", f"the lighthouse dropped replica group {group}: {reason}")

    async def _handover(self, base: LighthouseEndpoint | None, handover: list[tuple[int, str]]) -> None:
        """Before a migrating group's replacement starts: its old generation is to leave at a step boundary."""
        for group, reason in handover:
            ok = base is not None and self.operator_token is not None
            ok = ok and await self.lighthouse.handover(base, self.operator_token, [group], reason[:500])
            metrics.LIGHTHOUSE_CALLS.labels("handover", "ok" if ok else "error").inc()
            if not ok:  # the replacement still takes over, only less smoothly (the lighthouse drops the old one)
                log.warning("%s/%s: lighthouse not told of group %s's hand-over", self.namespace, self.name, group)

    async def _tell_lighthouse(self, base: LighthouseEndpoint | None, spec: JobSpec, result: Result) -> bool:
        """Starting groups, the desired contributor count and the groups' generations (again whenever one changes);
        True when something must be retried."""
        state = result.state
        if state.outcome is not None:
            self.pending_starting.clear()
            return False
        if base is None or self.operator_token is None:
            return bool(self.pending_starting) or self.desired_acked is None
        if time.monotonic() < self.lh_retry_at:
            return True  # a pod event woke us; do not hammer a lighthouse that is still starting
        self.lh_retry_at = time.monotonic() + RETRY_S
        retry = False
        generations = declared_generations(state)
        # a replacement lighthouse may reuse its predecessor's IP: its generation says it is another one
        key = (base, state.lighthouse_generation, spec.replicas, spec.total_groups, tuple(sorted(generations.items())))
        if self.desired_acked != key:
            ok = await self.lighthouse.desired(base, self.operator_token, spec.replicas, spec.total_groups,
                                               generations)  # fmt: skip
            metrics.LIGHTHOUSE_CALLS.labels("desired", "ok" if ok else "error").inc()
            if ok:
                new_lighthouse = self.desired_acked is None or self.desired_acked[:2] != key[:2]
                self.desired_acked = key
                if new_lighthouse:  # a new lighthouse (or a new operator) re-learns which groups are on their way
                    starting = (PHASE_STARTING, PHASE_RESTARTING)
                    self.pending_starting.update(i for i, p in result.group_phases.items() if p in starting)
            retry = retry or not ok
        pending = sorted(g for g in self.pending_starting if g in state.groups)
        if pending:
            ok = await self.lighthouse.starting(base, self.operator_token, pending)
            metrics.LIGHTHOUSE_CALLS.labels("starting", "ok" if ok else "error").inc()
            if ok:
                self.pending_starting.difference_update(pending)
            retry = retry or not ok
        return retry
