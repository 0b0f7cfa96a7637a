"""Progress-based stall detection: a member of the quorum in flight that stopped making progress while every other
member waits for it in the step's collective is evicted long before its heartbeat timeout.

A frozen group (SIGSTOP, a hung kernel, a wedged NIC) often keeps its sockets open, so nothing resets and the
survivors would wait for the whole heartbeat timeout. But the lighthouse knows more than liveness: every rank-0
heartbeat carries the group's progress counter (bumped at each protocol point of the step) and whether the group is
blocked in the step's cross-group collective; every quorum request carries the counter too (it stands in for a
heartbeat: a group whose steps are shorter than the heartbeat period sends no other). The rule, checked every tick:

  * a quorum is in flight with at least two of its members still live;
  * every other live member of it reports ``waiting`` (all of them reached the collective) and heart-beats;
  * the candidate is not waiting, not asking for a quorum, not healing, not finished, and has reported progress
    before (an older client that never does is left to the heartbeat timeout);
  * its progress counter has not moved for ``max(floor_s, factor x median step time)``, the median taken over the
    last quorum intervals (no rule until ``MIN_INTERVALS`` were seen: the first steps compile, load, sync).

A member that froze between two steps is simply left out of the next quorum (the join timeout); one that froze
inside the collective, after reporting ``waiting`` itself, looks like every other waiter. Either is evicted as
stalled once it sent no heartbeat at all for the same limit while at least half of the other members were heard
within half of it (heartbeats come from their own thread every 0.1 s: a live process does not miss ten
of them; and a lighthouse whose own loop stalled, which hears nobody, judges nobody).

A straggler that is merely slow keeps well inside ``factor`` times a median step that already includes its own
slowness (everyone waits for it every step); a sudden slowdown of more than that is treated as a hang. Pure logic:
no I/O, no clock.
"""

from __future__ import annotations

import collections
import statistics
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Protocol

DEFAULT_FACTOR = 3.0
DEFAULT_FLOOR_S = 1.0
MIN_INTERVALS = 5
HEARTBEATS_JUDGED = 3
INTERVALS_KEPT = 32


class Progressing(Protocol):
    group: str
    incarnation: str
    last_seen: float
    asking: bool
    healing: bool
    finished: bool
    progress: int
    progress_at: float
    waiting: bool


@dataclass
class StallRule:
    """The rule's parameters (``factor`` 0: off) and the quorum intervals it measures the step time from."""

    factor: float = DEFAULT_FACTOR
    floor_s: float = DEFAULT_FLOOR_S
    heartbeat_interval_s: float = 0.1  # the period the lighthouse tells the groups (it grows with their number)
    _last_formed: float | None = None
    _intervals: collections.deque[float] = field(default_factory=lambda: collections.deque(maxlen=INTERVALS_KEPT))

    def __post_init__(self) -> None:
        if self.factor < 0 or self.floor_s <= 0:
            raise ValueError(f"stall factor must be >= 0 and floor > 0, got {self.factor} and {self.floor_s}")

    def formed(self, now: float) -> None:
        """A quorum was issued now: one more step-time sample."""
        if self._last_formed is not None:
            self._intervals.append(now - self._last_formed)
        self._last_formed = now

    def median_step_s(self) -> float | None:
        return statistics.median(self._intervals) if len(self._intervals) >= MIN_INTERVALS else None

    def limit_s(self) -> float | None:
        """How long a member may show no progress while the others wait; None while the rule is off or learning."""
        median = self.median_step_s()
        if self.factor == 0 or median is None:
            return None
        # never judge on fewer than HEARTBEATS_JUDGED missed beats: at 12,500 groups a beat comes every 1.25 s
        return max(self.floor_s, self.factor * median, HEARTBEATS_JUDGED * self.heartbeat_interval_s)

    @staticmethod
    def beat(member: Progressing, progress: int, waiting: bool, now: float) -> None:
        """Records a heartbeat's progress fields."""
        if progress != member.progress:
            member.progress, member.progress_at = progress, now
        member.waiting = waiting

    def stalled(self, members: Mapping[str, Progressing], in_flight: Mapping[str, str], now: float,
                quiet: Collection[str] = ()) -> list[tuple[str, str]]:  # fmt: skip
        """(group, why) for each member the rule finds stalled; ``quiet``: members not expected to speak yet."""
        limit = self.limit_s()
        if limit is None:
            return []
        blocking = self._blocking(members, in_flight, now, limit)
        silent = self._silent(members, now, limit, quiet)
        return blocking + [s for s in silent if s[0] not in {g for g, _ in blocking}]

    def _silent(self, members: Mapping[str, Progressing], now: float, limit: float, quiet: Collection[str]
                ) -> list[tuple[str, str]]:  # fmt: skip
        """Members that stopped heart-beating while the others go on: left out of the next quorum, or frozen inside
        the one in flight (after it reported waiting in the collective itself, which the progress rule cannot tell
        from the others' waiting)."""
        heard = [now - m.last_seen for m in members.values() if not m.finished]
        if len(heard) < 2 or 2 * sum(1 for age in heard if age <= limit / 2) < len(heard) - 1:
            return []  # most members unheard: the lighthouse itself (or the whole network) stalled
        found = []
        for m in members.values():
            if m.group in quiet or m.finished or m.asking or m.progress == 0:
                continue
            if now - m.last_seen > limit:
                found.append((m.group, f"no heartbeat for {now - m.last_seen:.2f}s (limit {limit:.2f}s: "
                              f"{self._limit_words()}) while the other groups train on without it"))  # fmt: skip
        return found

    def _limit_words(self) -> str:
        return (f"max({self.floor_s:g}s, {self.factor:g} x median step {self.median_step_s():.3f}s, "
                f"{HEARTBEATS_JUDGED} x heartbeat {self.heartbeat_interval_s:g}s)")  # fmt: skip

    def _blocking(self, members: Mapping[str, Progressing], in_flight: Mapping[str, str], now: float, limit: float
                  ) -> list[tuple[str, str]]:  # fmt: skip
        """The member of the quorum in flight that every other member waits for, if it stopped progressing."""
        if len(in_flight) < 2:
            return []
        live = [m for g, inc in in_flight.items() if (m := members.get(g)) is not None and m.incarnation == inc]
        if len(live) < 2:
            return []
        behind = [m for m in live if not m.waiting]
        if len(behind) != 1:
            return []
        (suspect,) = behind
        others = [m for m in live if m is not suspect]
        if suspect.asking or suspect.healing or suspect.finished or suspect.progress == 0:
            return []
        if any(now - m.last_seen > limit for m in others):  # they must be alive and telling us they wait
            return []
        quiet = now - suspect.progress_at
        if quiet <= limit:
            return []
        heard = now - suspect.last_seen
        why = (
            f"no progress for {quiet:.2f}s (limit {limit:.2f}s: {self._limit_words()}) while {len(others)} other "
            f"group(s) wait in the step's collective; last heartbeat {heard:.2f}s ago"
        )
        return [(suspect.group, why)]
