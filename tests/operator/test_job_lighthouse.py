"""The job worker's side of its lighthouse (operator/lighthouse/link.py), no cluster: what it announces, when it
retries, and the Event an eviction leaves -- through JobWorker, whose reconcile calls it."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

from ftjob.operator.lighthouse.client import endpoint
from ftjob.operator.planning.plan import Observed, Result, plan
from ftjob.operator.reconcile.job_reconciler import JobWorker
from ftjob.operator.state.job_state import JobState

from tests.support.podfactory import JOB, spec

BASE = endpoint("10.0.0.9")


class FakeLighthouse:
    def __init__(self, ok: bool = True) -> None:
        self.ok = ok
        self.calls: list[tuple[Any, ...]] = []
        self.generations: list[dict[int, int]] = []  # declared with each desired call

    async def desired(self, base: Any, token: str, replicas: int, groups: int,
                      generations: Mapping[int, int] | None = None) -> bool:  # fmt: skip
        self.calls.append(("desired", replicas, groups))
        self.generations.append(dict(generations or {}))
        return self.ok

    async def starting(self, base: Any, token: str, groups: list[int]) -> bool:
        self.calls.append(("starting", *groups))
        return self.ok

    async def evict(self, base: Any, token: str, groups: list[int], reason: str) -> bool:
        self.calls.append(("evict", *groups, reason))
        return self.ok


class FakeKube:
    def __init__(self) -> None:
        self.events: list[tuple[str, str, str]] = []

    async def post_event(self, body: dict[str, Any], type_: str, reason: str, message: str) -> None:
        self.events.append((type_, reason, message))


def job_worker(lighthouse: FakeLighthouse, kube: FakeKube | None = None) -> JobWorker:
    body = {"metadata": {"name": JOB, "namespace": "ns", "uid": "u1"}, "spec": {}}
    w = JobWorker("ns", JOB, body, kube or FakeKube(), lighthouse, {}, None, lambda *_: None, node_policy=object())  # type: ignore[arg-type]
    w.operator_token = "t"
    return w


def first_reconcile() -> tuple[Any, Result]:
    s = spec()
    return s, plan(JOB, s, JobState(), Observed([], {"node-1": True}, set(), 1_000_000.0, set()))


def test_starting_groups_and_the_desired_count_are_announced_once():
    s, r = first_reconcile()
    lh = FakeLighthouse()
    w = job_worker(lh)
    w.pending_starting.update(r.actions.starting)
    assert asyncio.run(w._tell_lighthouse(BASE, s, r)) is False
    assert lh.calls == [("desired", s.replicas, s.total_groups), ("starting", 0, 1, 2)]
    w.lh_retry_at = 0.0  # past the throttle: nothing new to say
    assert asyncio.run(w._tell_lighthouse(BASE, s, r)) is False
    assert len(lh.calls) == 2


def test_a_refusing_or_unreachable_lighthouse_is_retried_with_nothing_forgotten():
    s, r = first_reconcile()
    lh = FakeLighthouse(ok=False)
    w = job_worker(lh)
    w.pending_starting.update(r.actions.starting)
    assert asyncio.run(w._tell_lighthouse(BASE, s, r)) is True
    assert w.pending_starting == {0, 1, 2} and w.desired_acked is None
    assert asyncio.run(w._tell_lighthouse(None, s, r)) is True  # no lighthouse pod running yet
    assert asyncio.run(w._tell_lighthouse(BASE, s, r)) is True  # throttled: a wake-up does not hammer it
    assert len(lh.calls) == 2


def test_an_eviction_is_one_call_per_group_and_leaves_an_event():
    lh, kube = FakeLighthouse(), FakeKube()
    w = job_worker(lh, kube)

    async def evict() -> None:
        await w._evict(BASE, SimpleNamespace(evict=[(1, "pod x exited 1"), (2, "node lost")]))  # type: ignore[arg-type]
        await asyncio.gather(*w.background)  # the Events go out in the background

    asyncio.run(evict())
    assert lh.calls == [("evict", 1, "pod x exited 1"), ("evict", 2, "node lost")]
    assert [e[1] for e in kube.events] == ["LighthouseEvicted", "LighthouseEvicted"]
    assert "replica group 1: pod x exited 1" in kube.events[0][2]
