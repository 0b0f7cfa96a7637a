"""Prometheus metrics of the operator (kopf has none of its own), served on --metrics-port."""

from __future__ import annotations

import contextlib
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, start_http_server

JOBS = Gauge("ftjob_jobs", "Jobs by their summary condition (status.phase).", ["condition"])
GROUP_RESTARTS = Counter("ftjob_group_restarts_total", "Replica-group (and lighthouse) restarts by reason.", ["reason"])
RECOVERY_SECONDS = Histogram(
    "ftjob_recovery_seconds",
    "Time from detecting a group failure to every pod of its replacement Running.",
    buckets=(0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300),
)
RECONCILE_SECONDS = Histogram(
    "ftjob_reconcile_seconds",
    "Duration of one reconcile of one job.",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
RECONCILE_ERRORS = Counter("ftjob_reconcile_errors_total", "Reconciles that raised an error.", ["kind"])
LIGHTHOUSE_CALLS = Counter("ftjob_lighthouse_calls_total", "Calls to job lighthouses.", ["call", "outcome"])
INTEGRITY_EVICTIONS = Counter(
    "ftjob_integrity_evictions_total",
    "Replica groups the lighthouse evicted for integrity and the operator replaced (GradientGuard, ReplicaDivergence).",
    ["reason"],
)
AUDIT_EVENTS = Counter("ftjob_audit_events_total", "Lighthouse audit records mirrored as Events on jobs.", ["kind"])
IS_LEADER = Gauge("ftjob_operator_leader", "1 while this replica holds the leader Lease.")

# per job (label sets removed when the job's worker stops); the definition: docs/operations/observability.md, "Goodput"
JOB = ["namespace", "job"]
GOODPUT = Gauge("ftjob_job_goodput_ratio", "Share of the job's wall time or group-seconds that produced committed "
                "steps.", [*JOB, "basis"])  # fmt: skip
BADPUT_SECONDS = Gauge("ftjob_job_badput_seconds", "Cumulative unproductive wall seconds by cause.", [*JOB, "cause"])
BADPUT_GROUP_SECONDS = Gauge(
    "ftjob_job_badput_group_seconds", "Cumulative unproductive group-seconds by cause.", [*JOB, "cause"]
)
COMMITTED_STEP = Gauge("ftjob_job_committed_step", "The job's highest committed step.", JOB)
QUORUM_SIZE = Gauge("ftjob_job_quorum_size", "Replica groups in the job's current quorum.", JOB)
GROUPS = Gauge("ftjob_job_groups", "The job's replica groups by state.", [*JOB, "state"])
WALL_CAUSES = ("startup", "failureStall", "rejoin", "belowMinimum", "lostWork", "other")
GROUP_CAUSES = (*WALL_CAUSES[:4], "spareIdle", "lostWork", "other")
GROUP_STATES = ("contributing", "spare", "healing", "starting", "failed", "finished")


def set_job_progress(namespace: str, job: str, goodput: dict[str, Any], groups: dict[str, int],
                     step: int | None, quorum: int | None) -> None:  # fmt: skip
    """`groups`: state -> count in the latest sample ({} keeps the last counts)."""
    GOODPUT.labels(namespace, job, "wall").set(goodput.get("ratio") or 0.0)
    GOODPUT.labels(namespace, job, "group").set(goodput.get("groupRatio") or 0.0)
    for cause, seconds in (goodput.get("badputSeconds") or {}).items():
        BADPUT_SECONDS.labels(namespace, job, cause).set(seconds)
    for cause, seconds in (goodput.get("badputGroupSeconds") or {}).items():
        BADPUT_GROUP_SECONDS.labels(namespace, job, cause).set(seconds)
    if step is not None:
        COMMITTED_STEP.labels(namespace, job).set(step)
    if quorum is not None:
        QUORUM_SIZE.labels(namespace, job).set(quorum)
    for state, count in groups.items():
        GROUPS.labels(namespace, job, state).set(count)


def forget_job(namespace: str, job: str) -> None:
    """Drops every per-job label set of a job that is gone (or no longer this replica's)."""
    labelled = [(GOODPUT, ("wall", "group")), (BADPUT_SECONDS, WALL_CAUSES), (BADPUT_GROUP_SECONDS, GROUP_CAUSES),
                (GROUPS, GROUP_STATES), (COMMITTED_STEP, (None,)), (QUORUM_SIZE, (None,))]  # fmt: skip
    for gauge, extra in labelled:
        for value in extra:
            with contextlib.suppress(KeyError):
                gauge.remove(namespace, job, *(() if value is None else (value,)))


def serve(port: int, registry: CollectorRegistry = REGISTRY) -> None:
    """Start the /metrics HTTP server in a daemon thread; port 0 disables it."""
    if port:
        start_http_server(port, registry=registry)
