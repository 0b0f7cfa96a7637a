"""The lighthouse's job-level audit records (StatusResponse.audit) mirrored as Events on the job, each exactly once.

Records carry `seq`, increasing from 1 in one lighthouse's life; a replacement lighthouse starts again at 1. The
operator remembers the newest seq it mirrored per lighthouse generation (`.status.integrity.auditSeq` with
`lighthouseGeneration`), so repeated polls and a restarted operator skip what was mirrored; and every Event's name
is derived from (job uid, lighthouse generation, seq), so a crash between posting and remembering re-posts nothing
(the apiserver answers 409). `AuditMirror` posts them; the rest is pure.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ftjob.contract.lighthouse_api import AuditRecord
from ftjob.operator.resources.kubeapi import KubeApi
from ftjob.operator.runtime import operator_metrics as metrics

# kind -> (Event type, reason). An eviction for integrity is a Warning; one the operator asked for is routine.
EVENTS = {
    "guard": ("Warning", "GradientGuardRefused"),
    "divergence": ("Warning", "ReplicaDivergent"),
    "refused": ("Warning", "LighthouseRefused"),
    "evict": ("Normal", "LighthouseEvictedGroup"),
    "join": ("Normal", "LighthouseGroupJoined"),
    "leave": ("Normal", "LighthouseGroupLeft"),
}
INTEGRITY_WORDS = ("gradient_guard", "divergent", "stalled")  # evictions worth a Warning
GONE = "refused 410"  # the lighthouse's answer to an incarnation it dropped (evicted, handed over, left)


@dataclass(frozen=True)
class AuditMark:
    """The newest audit record mirrored: (lighthouse generation, seq)."""

    lighthouse_generation: int = 0
    seq: int = 0

    @classmethod
    def from_status(cls, status: Mapping[str, Any] | None) -> AuditMark:
        integrity = (status or {}).get("integrity") or {}
        return cls(int(integrity.get("lighthouseGeneration") or 0), int(integrity.get("auditSeq") or 0))


@dataclass(frozen=True)
class AuditEvent:
    generation: int  # of the lighthouse that wrote the record
    seq: int
    type: str
    reason: str
    message: str
    kind: str


def unmirrored(records: Iterable[AuditRecord], generation: int, mark: AuditMark) -> tuple[list[AuditEvent], AuditMark]:
    """The Events for the records of lighthouse `generation` newer than `mark`, and the mark after them."""
    floor = mark.seq if mark.lighthouse_generation == generation else 0
    fresh = sorted((r for r in records if r.seq > floor), key=lambda r: r.seq)
    events = [event_for(r, generation) for r in fresh]
    newest = fresh[-1].seq if fresh else floor
    return events, AuditMark(generation, newest)


def event_for(record: AuditRecord, generation: int) -> AuditEvent:
    type_, reason = EVENTS.get(record.kind, ("Normal", "LighthouseAudit"))
    if record.kind == "evict" and any(word in record.reason for word in INTEGRITY_WORDS):
        type_ = "Warning"
    if record.kind == "refused" and record.outcome.startswith(GONE):
        # an incarnation already evicted or handed over, knocking once more: the consequence of a drop that has its
        # own Event (a Warning where it was one), not a new problem
        type_, reason = "Normal", "OutdatedIncarnationRefused"
    who = f"replica group {record.group}: " if record.group is not None else ""
    message = f"{who}{record.reason} -> {record.outcome} (by {record.actor}; lighthouse audit #{record.seq})"
    return AuditEvent(generation, record.seq, type_, reason, message, record.kind)


def event_name(job: str, uid: str | None, event: AuditEvent) -> str:
    """A deterministic Event name (a DNS subdomain): a re-post of the same record is refused with 409."""
    return f"{job}.audit.{(uid or 'nouid')[:8].lower()}.{event.generation}-{event.seq}"


class AuditMirror:
    """Posts a job's new audit records as Events; the mark advances only over records whose Event exists."""

    def __init__(self, kube: KubeApi, mark: AuditMark) -> None:
        self.kube = kube
        self.mark = mark

    async def mirror(self, job: dict[str, Any], records: Iterable[AuditRecord], generation: int) -> None:
        events, _ = unmirrored(records, generation, self.mark)
        if self.mark.lighthouse_generation != generation:
            self.mark = AuditMark(generation, 0)
        meta = job["metadata"]
        posted = await asyncio.gather(
            *(self.kube.post_event(job, e.type, e.reason, e.message, event_name(meta["name"], meta.get("uid"), e))
              for e in events)
        )  # fmt: skip
        for e, ok in zip(events, posted, strict=True):
            if not ok:
                break  # tried again at the next poll (a named Event is never posted twice)
            self.mark = AuditMark(generation, e.seq)
            metrics.AUDIT_EVENTS.labels(e.kind).inc()
