"""What the operator reads from a lighthouse's GET /v1/status (ftjob.contract.lighthouse_api.StatusResponse).

Kept apart from the HTTP client so status aggregation and the planner can use it in unit tests.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ftjob.contract.lighthouse_api import (
    AuditRecord,
    DroppedEvent,
    IntegrityStatus,
    MemberStatus,
    QuorumEvent,
    RestoredEvent,
    StatusResponse,
)
from ftjob.operator.planning.integrity_evictions import Drop, integrity_reason
from ftjob.operator.state.job_state import JobState

SILENCE_MIN_S = 10.0


@dataclass(frozen=True)
class LighthouseView:
    """The operator's digest of one status answer."""

    quorum_id: int | None = None
    quorum_size: int | None = None
    step: int | None = None  # the committed step of the current quorum
    groups: dict[str, MemberStatus] = field(default_factory=dict)
    evicted: dict[str, str] = field(default_factory=dict)  # group -> reason of its latest drop (recent history)
    quorum_groups: tuple[str, ...] = ()
    blocked_reason: str = ""  # why the pending quorum has not formed ("waiting for min_replicas: ...")
    # (seconds before the answer, step) of the earliest quorum the answer's history lists: when training began
    first_quorum: tuple[float, int] | None = None
    # group -> its latest eviction for integrity or a stall ("evicted: gradient_guard: ...", at: seconds before the
    # answer) and the generation it dropped
    integrity_drops: dict[str, Drop] = field(default_factory=dict)
    integrity: IntegrityStatus | None = None  # the guard's and the digest check's counters
    audit: tuple[AuditRecord, ...] = ()  # the newest job-level audit records, oldest first
    last_restore: RestoredEvent | None = None  # the newest time the job went on below its committed step

    @property
    def replaying(self) -> bool:
        """Training again the steps a whole-job loss took back (up to the step committed before it)."""
        return self.last_restore is not None and (self.step or 0) < self.last_restore.from_step

    @property
    def finished_groups(self) -> set[int]:
        return {int(g) for g, v in self.groups.items() if v.finished and g.isdigit()}

    @classmethod
    def from_status(cls, status: StatusResponse) -> LighthouseView:
        return cls(
            quorum_id=status.quorum_id,
            quorum_size=len(status.quorum_groups),
            # a group that finished committed its last step, which no quorum starts from
            step=max([status.max_step, *(m.step for m in status.members if m.finished)]),
            groups={m.group: m for m in status.members},
            evicted={e.group: e.reason for e in status.history if isinstance(e, DroppedEvent)},
            quorum_groups=tuple(status.quorum_groups),
            blocked_reason=status.blocked_reason,
            first_quorum=_first_quorum(status),
            integrity_drops=_integrity_drops(status),
            integrity=status.integrity,
            audit=tuple(status.audit),
            last_restore=status.last_restore,
        )


def _integrity_drops(status: StatusResponse) -> dict[str, Drop]:
    clock = status.clock
    return {
        e.group: Drop(max(0.0, clock - e.time) if clock is not None else 0.0, e.reason, e.generation)
        for e in status.history
        if isinstance(e, DroppedEvent) and integrity_reason(e.reason)
    }


def _first_quorum(status: StatusResponse) -> tuple[float, int] | None:
    quorums = [e for e in status.history if isinstance(e, QuorumEvent)]
    if status.clock is None or not quorums:
        return None
    first = min(quorums, key=lambda e: e.quorum_id)
    return max(0.0, status.clock - first.time), first.step


class SilenceWatch:
    """Groups that joined the lighthouse in their current generation and then vanished from it for longer than
    twice its heartbeat timeout while their pods kept running: hung or cut off, so replaced. Memory only: after
    an operator restart, or with a new lighthouse, a group must be seen joining again first. A member that says it
    is of another generation (a replaced process that outlived its pod, or the old one of a migrating group) is not
    the current generation joining, and its leaving is no silence of the current one."""

    def __init__(self) -> None:
        self.joined: dict[int, int] = {}  # group -> generation in which the lighthouse last listed it
        self.absent_since: dict[int, float] = {}
        # group -> (generation, when this operator first saw it): a lighthouse view older than that may still list
        # the previous incarnation, so it proves nothing about the current one having joined
        self.generation_since: dict[int, tuple[int, float]] = {}

    def new_lighthouse(self) -> None:
        """Every group must be seen joining a new lighthouse again."""
        self.joined.clear()
        self.absent_since.clear()

    def silent(self, view: LighthouseView, view_at: float, state: JobState, heartbeat_timeout_s: float, now: float
               ) -> dict[int, str]:  # fmt: skip
        limit = max(2 * heartbeat_timeout_s, SILENCE_MIN_S)
        silent: dict[int, str] = {}
        for idx, g in state.groups.items():
            seen = self.generation_since.get(idx)
            if seen is None or seen[0] != g.generation:
                seen = self.generation_since[idx] = (g.generation, now)
            member = view.groups.get(str(idx))
            if member is not None and member.generation not in (None, g.generation):
                member = None  # another generation's process: the current one has not joined (yet)
            if member is not None:
                if view_at <= seen[1]:
                    continue  # fetched before this generation existed: may list the group's previous incarnation
                self.joined[idx] = g.generation
                self.absent_since.pop(idx, None)
                continue
            if self.joined.get(idx) != g.generation:
                continue
            since = self.absent_since.setdefault(idx, now)
            if now - since > limit:
                why = view.evicted.get(str(idx), "no longer a member")
                silent[idx] = f"replica group {idx} left the lighthouse ({why}) {now - since:.0f}s ago but its pods run"
        return silent

    def gone(self, state: JobState) -> set[int]:
        """Groups whose current generation joined the lighthouse and is, as of the last ``silent`` call, no longer
        listed by it, however briefly: not enough to replace a group on its own (a group may be mid-reconnect), but
        together with its node no longer answering, the group is lost with that node."""
        return {
            idx
            for idx in self.absent_since
            if idx in state.groups and self.joined.get(idx) == state.groups[idx].generation
        }
