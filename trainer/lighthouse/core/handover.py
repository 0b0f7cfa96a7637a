"""Make-before-break handovers of replica groups: the bookkeeping QuorumCore keeps for them (pure logic, no clock).

The operator moves a group off a degrading node by starting the group's new incarnation elsewhere while the old one
goes on training, after marking the group (``POST /v1/membership/handover``). When a new incarnation of a marked group
first registers, QuorumCore bans the old one as on any restart, but:
  * the quorum in flight is not aborted (``abort_below`` stays, the last quorum is not lost): the old incarnation is
    still in it and completes its step, and the survivors commit it;
  * the old incarnation no longer counts as a missing member of the last quorum (``prev_handed``), so the survivors'
    next quorum still forms at once on their asks;
  * the new incarnation is "quiet" until it first asks: it is neither waited for (join timeout) nor counted as a live
    group by the split-brain guard, like a group that is still starting. When it asks it rides along, healing from an
    up-to-date group as any group behind does.
The mark is consumed by the first new incarnation that registers; one that never comes lapses after
``HANDOVER_TIMEOUT_S`` (a later restart then aborts the quorum in flight as usual). Marks only ever name groups the
lighthouse has seen: the group-id bounds QuorumCore checks on every request stay in force.
"""

from __future__ import annotations

from dataclasses import dataclass, field

HANDOVER_TIMEOUT_S = 600.0  # generous: a new pod may need an image pull and a node's warm-up before it registers


@dataclass(frozen=True)
class HandoverMark:
    incarnation: str  # the incarnation being handed over (the group's latest one when the mark was set)
    until: float  # the mark lapses at this time
    reason: str


@dataclass
class Handovers:
    """Marked groups, quiet new incarnations and the last quorum's handed-over members. Every set stays small (the
    groups being migrated right now), so scanning one is cheap."""

    timeout_s: float = HANDOVER_TIMEOUT_S
    marks: dict[str, HandoverMark] = field(default_factory=dict)  # group -> pending handover
    quiet: dict[str, str] = field(default_factory=dict)  # group -> its new incarnation: live, has not asked yet
    prev_handed: set[str] = field(default_factory=set)  # last quorum's members whose incarnation was handed over

    def mark(self, group: str, incarnation: str, reason: str, now: float) -> None:
        """Marks (or re-marks, with a fresh time limit) the group's current incarnation for a handover."""
        self.marks[group] = HandoverMark(incarnation=incarnation, until=now + self.timeout_s, reason=reason)

    def take(self, group: str, incarnation: str, now: float) -> HandoverMark | None:
        """A new ``incarnation`` of ``group`` registers: consumes the group's mark, returning it if it still holds
        (None: no handover, or it lapsed). The marked incarnation itself consumes nothing."""
        mark = self.marks.get(group)
        if mark is None or mark.incarnation == incarnation:
            return None
        del self.marks[group]
        return mark if mark.until > now else None

    def expire(self, now: float) -> None:
        for group in [g for g, mark in self.marks.items() if mark.until <= now]:
            del self.marks[group]

    def is_quiet(self, group: str, incarnation: str) -> bool:
        return self.quiet.get(group) == incarnation

    def pending(self, now: float) -> list[str]:
        """Marked groups whose new incarnation has not registered yet."""
        return [g for g, mark in self.marks.items() if mark.until > now]
