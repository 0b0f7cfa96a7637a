"""Builders of PodViews and specs for the planner's unit tests (pure data, no cluster)."""

from __future__ import annotations

from typing import Any

from ftjob import contract
from ftjob.operator.state import names
from ftjob.operator.state.job_spec import JobSpec
from ftjob.operator.state.job_state import PodView

JOB = "demo"


def spec(**overrides: Any) -> JobSpec:
    raw: dict[str, Any] = {
        "replicas": 3,
        "minReplicas": 2,
        "podsPerReplica": 2,
        "template": {"spec": {"containers": [{"name": "trainer", "image": "ftjob-trainer"}]}},
        "failurePolicy": {"maxRestartsPerGroup": 2, "maxTotalRestarts": 5, "backoff": {"baseSeconds": 4}},
    }
    raw.update(overrides)
    return JobSpec.from_dict(raw)


def pod(
    name: str,
    *,
    role: str = contract.ROLE_WORKER,
    group: int | None = None,
    rank: int | None = None,
    generation: int = 0,
    phase: str = "Running",
    node: str | None = "node-1",
    ip: str | None = "10.0.0.5",
    deletion_time: float | None = None,
    reason: str = "",
    exit_code: int | None = None,
    exit_reason: str = "",
) -> PodView:
    return PodView(
        name=name,
        uid=f"uid-{name}",
        role=role,
        group=group,
        rank=rank,
        generation=generation,
        phase=phase,
        ready=phase == "Running",
        node=node,
        ip=ip,
        deletion_time=deletion_time,
        reason=reason,
        exit_code=exit_code,
        exit_container="trainer" if exit_code is not None else None,
        exit_reason=exit_reason,
    )


def worker(group: int, rank: int, generation: int = 0, **kw: Any) -> PodView:
    return pod(names.pod_name(JOB, group, generation, rank), group=group, rank=rank, generation=generation, **kw)


def lighthouse(generation: int = 0, **kw: Any) -> PodView:
    return pod(names.lighthouse_pod(JOB, generation), role=contract.ROLE_LIGHTHOUSE, generation=generation, **kw)


def healthy_job(s: JobSpec, generations: dict[int, int] | None = None) -> list[PodView]:
    generations = generations or {}
    pods = [lighthouse()]
    for g in range(s.total_groups):
        pods += [worker(g, r, generations.get(g, 0)) for r in range(s.pods_per_replica)]
    return pods
