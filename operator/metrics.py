"""Prometheus metrics of the operator (kopf has none of its own), served on --metrics-port."""

from __future__ import annotations

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
IS_LEADER = Gauge("ftjob_operator_leader", "1 while this replica holds the leader Lease.")


def serve(port: int, registry: CollectorRegistry = REGISTRY) -> None:
    """Start the /metrics HTTP server in a daemon thread; port 0 disables it."""
    if port:
        start_http_server(port, registry=registry)
