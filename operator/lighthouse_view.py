"""What the operator reads from a lighthouse's GET /v1/status (ftjob.contract.lighthouse_api.StatusResponse).

Kept apart from the HTTP client so status aggregation and the planner can use it in unit tests.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ftjob.contract.lighthouse_api import DroppedEvent, MemberStatus, StatusResponse


@dataclass(frozen=True)
class LighthouseView:
    """The operator's digest of one status answer."""

    quorum_id: int | None = None
    quorum_size: int | None = None
    step: int | None = None  # the committed step of the current quorum
    groups: dict[str, MemberStatus] = field(default_factory=dict)
    evicted: dict[str, str] = field(default_factory=dict)  # group -> reason of its latest drop (recent history)

    @property
    def finished_groups(self) -> set[int]:
        return {int(g) for g, v in self.groups.items() if v.finished and g.isdigit()}

    @classmethod
    def from_status(cls, status: StatusResponse) -> LighthouseView:
        return cls(
            quorum_id=status.quorum_id,
            quorum_size=len(status.quorum_groups),
            step=status.max_step,
            groups={m.group: m for m in status.members},
            evicted={e.group: e.reason for e in status.history if isinstance(e, DroppedEvent)},
        )
