"""Prometheus metrics of one lighthouse, in its own registry (so tests and several lighthouses never collide)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest


class LighthouseMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.quorum_size = Gauge("ftjob_lighthouse_quorum_size", "Groups in the last quorum", registry=r)
        self.quorum_id = Gauge("ftjob_lighthouse_quorum_id", "Id of the last quorum", registry=r)
        self.max_step = Gauge("ftjob_lighthouse_max_step", "Highest committed step a quorum started from", registry=r)
        self.live_groups = Gauge("ftjob_lighthouse_live_groups", "Groups with a recent heartbeat", registry=r)
        self.quorums = Counter("ftjob_lighthouse_quorums", "Quorums issued (one per step)", registry=r)
        self.heartbeats = Counter(
            "ftjob_lighthouse_heartbeats", "Rank-0 heartbeats received on watch sockets", registry=r
        )
        self.quorum_changes = Counter(
            "ftjob_lighthouse_quorum_changes", "Quorums whose id changed (process groups rebuilt)", registry=r
        )
        self.evictions = Counter(
            "ftjob_lighthouse_evictions", "Groups dropped from the membership", ["reason"], registry=r
        )
        self.heals = Counter("ftjob_lighthouse_heals", "Groups told to recover from a peer", registry=r)
        self.heal_seconds = Histogram(
            "ftjob_lighthouse_heal_seconds",
            "Live-recovery duration reported by the healed groups",
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
            registry=r,
        )
        # integrity (ftjob.lighthouse.core.integrity_checks) and the audit trail (ftjob.lighthouse.audit_trail)
        self.guard_offences = Counter(
            "ftjob_lighthouse_guard_offences",
            "Steps a group's gradient was refused by the guard (counted once half of that quorum reported it)",
            registry=r,
        )
        self.guard_evictions = Counter(
            "ftjob_lighthouse_guard_evictions", "Groups evicted for repeated gradient guard offences", registry=r
        )
        self.divergences = Counter(
            "ftjob_lighthouse_divergences", "Groups whose state digest differed from the majority's", registry=r
        )
        self.digest_checks = Counter(
            "ftjob_lighthouse_digest_checks", "Steps whose state digests were compared across groups", registry=r
        )
        self.audit_records = Counter(
            "ftjob_lighthouse_audit_records",
            "Audited events by kind (join, leave, evict, refused, guard, divergence); folded refusals each count",
            ["kind"],
            registry=r,
        )
        self.request_seconds = Histogram(
            "ftjob_lighthouse_request_seconds",
            "Time to answer an API request (quorum requests include the wait for the quorum)",
            ["path"],
            buckets=(0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30),
            registry=r,
        )

        # the lighthouse process's garbage collector (ftjob.lighthouse.gc_pacing): observed by its CLI only
        self.gc_ticks = Counter(
            "ftjob_lighthouse_gc_ticks", "Times the lighthouse froze its heap (or collected it fully)", registry=r
        )
        self.gc_full_seconds = Histogram(
            "ftjob_lighthouse_gc_full_seconds",
            "CPU seconds of each full garbage collection (a pause of the lighthouse)",
            buckets=(0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
            registry=r,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
