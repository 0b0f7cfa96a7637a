"""The lighthouse's quorum algorithm as pure logic: no I/O, no clock (callers pass ``now``), no asyncio.

Every replica group asks for a quorum once per step. A quorum forms when:
  * every member of the previous quorum is alive and asking (new joiners ride along) -- issued at once, or
  * otherwise at least ``min_replicas`` groups ask, they are a strict majority of the live groups (split-brain
    guard), and either no live/starting group is still missing or the join timeout since that became true passed.
A new incarnation of a known group replaces the old one and bans it; that loses the old one (the quorum in flight
aborts) unless the operator marked the group for a handover (make-before-break, ftjob.lighthouse.core.handover): then
the quorum in flight completes, the old incarnation is no missing member of the previous quorum, and the new one is
neither waited for nor counted as live until it first asks.
Generations: a process that says which generation of its group it belongs to (FTJOB_GENERATION) is refused (410) when
that is older than the group's newest generation the lighthouse knows of -- one the operator declared (it replaced the
older one's pods) or one that registered -- so a process that outlived its pod's deletion never joins a (replacement)
lighthouse, let alone replaces its group's newer incarnation; each drop records the generation it concerned.
The quorum id changes only when the membership (group + incarnation) changes, a member reports a failed commit, or a
member of the last quorum was dropped (evicted, heartbeat timeout, disconnected): the managers then rebuild their
cross-group process group. Each request is O(1); forming is O(n log n) over the askers.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Iterable, Mapping

from ftjob.contract.lighthouse_api import (
    DroppedEvent,
    HistoryEvent,
    QuorumEvent,
    QuorumMember,
    QuorumRequest,
    RestoredEvent,
    StatusResponse,
)
from ftjob.lighthouse.core import quorum_view
from ftjob.lighthouse.core.answers import Answers
from ftjob.lighthouse.core.formation import assign
from ftjob.lighthouse.core.handover import Handovers
from ftjob.lighthouse.core.members import BadRequest, Formed, Member, Outdated, QuorumError, group_sort_key
from ftjob.lighthouse.core.stall import StallRule

# members.py's re-exported
__all__ = ["BadRequest", "Formed", "Member", "Outdated", "QuorumCore", "QuorumError", "group_sort_key"]
log = logging.getLogger("ftjob.lighthouse")
# The stall rule scans every member (O(n)): checked every STALL_CHECK_FRACTION of its limit (>= 1 s), never more
# often than STALL_CHECK_S. Detection is late by at most that fraction; at 12,500 groups the limit is >= 3.75 s
# (3 heartbeats of 1.25 s), and scanning every STALL_CHECK_S at that size would cost the lighthouse's one core a
# noticeable share, in rounds and between them.
STALL_CHECK_S = 0.1
STALL_CHECK_FRACTION = 0.1


class QuorumCore:
    """Membership, liveness and quorum formation. Not thread-safe: the server calls it from one event loop."""

    def __init__(
        self,
        min_replicas: int,
        join_timeout_s: float,
        heartbeat_timeout_s: float,
        quorum_id: int = 0,
        committed_step: int = 0,
        history_len: int = 200,
        step_floor_until: float | None = None,
        stall: StallRule | None = None,
    ) -> None:
        if min_replicas < 1:
            raise ValueError(f"min_replicas must be >= 1, got {min_replicas}")
        self.min_replicas = min_replicas
        self.join_timeout_s = join_timeout_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.quorum_id = quorum_id  # id of the last quorum issued (or restored from the state file)
        self.committed_step = committed_step  # highest step any quorum started from: never go below it
        # A floor restored from the operator's records (a new lighthouse pod) holds only until this time, unless a
        # quorum confirms it first: when no surviving group holds that step any more, training goes on from the best.
        self.step_floor_until = step_floor_until
        self.stall = stall if stall is not None else StallRule()  # progress-based eviction of a frozen member
        self._next_stall_check = -float("inf")
        self.abort_below = 0  # in-flight quorums with an id below this must abort their collectives
        self.desired: int | None = None  # contributing groups wanted; None = every up-to-date member
        self.group_limit: int | None = None  # group ids the operator created are below this; None = unbounded
        self.members: dict[str, Member] = {}
        self._by_seen: collections.OrderedDict[str, None] = collections.OrderedDict()  # oldest heartbeat first
        self._incarnations: dict[str, str] = {}  # every group ever seen -> its latest incarnation
        self._banned: set[tuple[str, str]] = set()  # evicted (group, incarnation): may never come back
        self._generations: dict[str, int] = {}  # group -> its newest generation known: older ones may not register
        self._starting: dict[str, float] = {}  # group -> until when the quorum may wait for it
        self._expected_back: list[str] = []  # a replacement lighthouse's groups, until the first one is back
        self._handovers = Handovers()  # make-before-break replacements (marks, quiet new incarnations)
        self._prev: dict[str, str] = {}  # last quorum: group -> incarnation
        self._prev_contributors: set[str] = set()
        self._prev_asking = 0
        self._prev_lost = False
        self._n_asking = 0
        self._n_finished = 0
        self._join_deadline: float | None = None
        self._reported_id = quorum_id  # highest quorum id any manager says it saw (lighthouse restarts)
        self.blocked_reason = ""  # why the pending quorum has not formed (status API)
        self.history: collections.deque[HistoryEvent] = collections.deque(maxlen=history_len)
        self.dropped_events: list[tuple[str, str]] = []  # (group, reason) since the caller last drained it
        self.last_restore: RestoredEvent | None = None  # the newest time the job went on below its committed step

    # --- liveness ------------------------------------------------------------------------------------------------
    def _check_banned(self, group: str, incarnation: str) -> None:
        if (group, incarnation) in self._banned:
            raise QuorumError(
                410, f"group {group!r} incarnation {incarnation!r} was evicted; restart the group's process to rejoin"
            )

    def check_group(self, group: str) -> None:
        """403 for a group id the operator did not create: a quorum never contains a made-up group."""
        if self.group_limit is not None and int(group) >= self.group_limit:
            raise QuorumError(
                403, f"replica group {group!r} is not one of this job's groups (0..{self.group_limit - 1})"
            )

    def _check_generation(self, group: str, incarnation: str, generation: int | None) -> None:
        newest = self._generations.get(group)
        if generation is not None and newest is not None and generation < newest:
            raise Outdated(
                f"group {group!r} incarnation {incarnation!r} is of generation {generation}, which was replaced: "
                f"generation {newest} of the group runs now; this process's pod is gone or going, it may not rejoin"
            )

    def _touch(self, group: str, incarnation: str, now: float, generation: int | None = None) -> Member:
        """Registers a heartbeat; a new incarnation of a known group replaces the old one, which counts as lost
        unless the group was marked for a handover (then the old one's quorum goes on: see the module docstring).
        A new incarnation of a replaced generation is refused (410) before any change."""
        self.check_group(group)
        self._check_banned(group, incarnation)
        member = self.members.get(group)
        handed_over = False
        if member is None or member.incarnation != incarnation:
            self._check_generation(group, incarnation, generation)  # (a registered one is dropped when declared)
            if generation is not None:
                self._generations[group] = max(generation, self._generations.get(group, generation))
            mark = self._handovers.take(group, incarnation, now)  # the first new incarnation consumes the mark
            if member is not None:
                # The newest process of a group wins; the old one is banned so two live copies cannot take turns.
                self._banned.add((group, member.incarnation))
                handed_over = mark is not None and mark.incarnation == member.incarnation
                reason = "restarted"
                if mark is not None and handed_over:
                    reason = f"handed_over: {mark.reason}" if mark.reason else "handed_over"
                self._drop(group, reason, now, lost=not handed_over)
                member = None
        if member is None:
            member = Member(group=group, incarnation=incarnation, last_seen=now, generation=generation)
            self.members[group] = member
            self._incarnations[group] = incarnation
            self._starting.pop(group, None)
            if self._expected_back:  # the first group back: the others get the join timeout to come back too
                self.mark_starting(self._expected_back, now)
                self._expected_back = []
            if handed_over:
                self._handovers.quiet[group] = incarnation
        member.last_seen = now
        self._by_seen[group] = None
        self._by_seen.move_to_end(group)
        return member

    def heartbeat(
        self, group: str, incarnation: str, step: int, now: float, finished: bool = False, digest: str | None = None,
        progress: int = 0, waiting: bool = False, generation: int | None = None,
    ) -> None:  # fmt: skip
        member = self._touch(group, incarnation, now, generation)
        member.step = max(member.step, step)
        self.stall.beat(member, progress, waiting, now)
        if finished and not member.finished:
            member.finished = True
            self._handovers.quiet.pop(group, None)
            self._n_finished += 1
            if member.asking:
                self._set_asking(member, False)
        if digest is not None:
            member.param_digest = digest

    def sweep(self, now: float) -> list[str]:
        """Drops groups whose last heartbeat is older than the heartbeat timeout (oldest first: O(expired))."""
        dropped = []
        limit = now - self.heartbeat_timeout_s
        while self._by_seen:
            group = next(iter(self._by_seen))
            if self.members[group].last_seen > limit:
                break
            if self.members[group].finished:  # done training: keep it (and its digest) for the status API
                del self._by_seen[group]
                continue
            self._drop(group, "heartbeat_timeout", now)
            dropped.append(group)
        for group, until in list(self._starting.items()):
            if until <= now:
                del self._starting[group]
        self._handovers.expire(now)
        if now >= self._next_stall_check:  # O(members): a few times per limit, not at every request
            limit = self.stall.limit_s() or 0.0
            self._next_stall_check = now + max(STALL_CHECK_S, STALL_CHECK_FRACTION * limit)
            for group, why in self.stall.stalled(self.members, self._prev, now, self._handovers.quiet):
                dropped += self.evict([group], f"stalled: {why}", now)
        return dropped

    def disconnected(self, group: str, incarnation: str, now: float) -> bool:
        """A group's live connection closed (its process died): drop it without waiting for the heartbeat timeout."""
        member = self.members.get(group)
        if member is None or member.incarnation != incarnation or member.finished:
            return False
        self._drop(group, "disconnected", now)
        return True

    def leave(self, group: str, incarnation: str, step: int, now: float) -> bool:
        """The group's process leaves the job for good at a step boundary (it was asked to terminate): dropped now,
        its incarnation banned (its last heartbeats must not register it again). ``step`` is its committed step. If it
        committed the last quorum's step, it is no missing member of that quorum, as a handed-over one is: the
        survivors' next quorum forms at once on their asks and nothing aborts (a survivor may still be finishing the
        step's collective with it). If it is still in that step (its step no later than the quorum's), the step in
        flight is lost, as on a disconnect. Returns whether it was a member (a repeated leave changes nothing)."""
        self.check_group(group)
        self._banned.add((group, incarnation))
        member = self.members.get(group)
        if member is None or member.incarnation != incarnation:
            return False
        in_step = self._prev.get(group) == incarnation and step <= self.committed_step
        self._drop(group, "left", now, lost=in_step)
        return True

    def _drop(self, group: str, reason: str, now: float, lost: bool = True) -> None:
        """Forgets the group's member; ``lost=False`` (a handover) lets the last quorum, if it was in it, go on."""
        member = self.members.pop(group)
        self._by_seen.pop(group, None)
        if member.asking:
            self._set_asking(member, False)
        if member.finished:
            self._n_finished -= 1
        if self._handovers.is_quiet(group, member.incarnation):
            del self._handovers.quiet[group]
        if self._prev.get(group) == member.incarnation:
            if lost:
                self._prev_lost = True
                # The last quorum is dead: its members' pending collectives must abort now, not at their timeout.
                self.abort_below = max(self.abort_below, self.quorum_id + 1)
            else:  # it still completes the step in flight; the next quorum does not wait for it
                self._handovers.prev_handed.add(group)
        self.dropped_events.append((group, reason))
        self.history.append(DroppedEvent(time=now, group=group, reason=reason, generation=member.generation))

    def _set_asking(self, member: Member, asking: bool) -> None:
        if member.asking == asking:
            return
        member.asking = asking
        delta = 1 if asking else -1
        self._n_asking += delta
        if self._prev.get(member.group) == member.incarnation:
            self._prev_asking += delta

    # --- operator membership API ---------------------------------------------------------------------------------
    def _check_known(self, groups: list[str]) -> None:
        unknown = [g for g in groups if g not in self._incarnations]
        if unknown:
            raise QuorumError(404, f"unknown replica group(s) {unknown}: known groups are {sorted(self._incarnations)}")

    def evict(self, groups: Iterable[str], reason: str, now: float) -> list[str]:
        """Drops the groups at once and bans their current incarnation; 404 (no change) if any was never seen."""
        groups = list(groups)
        self._check_known(groups)
        evicted = []
        for group in groups:
            self._banned.add((group, self._incarnations[group]))
            if group in self.members:
                self._drop(group, f"evicted: {reason}" if reason else "evicted", now)
                evicted.append(group)
        return evicted

    def declare_generations(self, generations: Mapping[str, int], now: float) -> list[str]:
        """The operator's word on each group's oldest generation that still runs: older ones may not register any
        more, and a member of one (it registered before the operator could say so, e.g. with a replacement
        lighthouse) is evicted now. 403 for a group id outside the job's, before any change. Returns the evicted."""
        for group in generations:
            self.check_group(group)
        evicted = []
        for group, generation in generations.items():
            self._generations[group] = max(generation, self._generations.get(group, generation))
            member = self.members.get(group)
            if member is not None and member.generation is not None and member.generation < generation:
                why = f"outdated: generation {member.generation} was replaced by generation {generation}"
                evicted += self.evict([group], why, now)
        return evicted

    @property
    def generations(self) -> dict[str, int]:
        """Each group's newest generation known (declared or registered)."""
        return dict(self._generations)

    def handover(self, groups: Iterable[str], reason: str, now: float) -> list[str]:
        """Marks the groups' current incarnation for a make-before-break handover: their next incarnation replaces it
        without aborting the quorum in flight (ftjob.lighthouse.core.handover). 403 for a group id outside the job's,
        404
        if any was never seen; either way nothing changes. Returns the groups marked."""
        groups = list(dict.fromkeys(groups))
        for group in groups:
            self.check_group(group)
        self._check_known(groups)
        for group in groups:
            self._handovers.mark(group, self._incarnations[group], reason, now)
        return groups

    @property
    def handover_timeout_s(self) -> float:
        return self._handovers.timeout_s

    def expect_back(self, groups: Iterable[str]) -> None:
        """A replacement lighthouse: the first group to reconnect must not train alone while the others are still
        reconnecting. (A group whose step in flight committed under the lost lighthouse and one whose step failed
        would both reach the next step, through different updates, and never heal.) From the first contact, every
        group in ``groups`` is starting: the first quorum waits up to the join timeout for it."""
        self._expected_back = list(groups)

    def mark_starting(self, groups: Iterable[str], now: float) -> None:
        groups = list(groups)
        for group in groups:
            self.check_group(group)  # all or nothing: a refused request changes nothing
        for group in groups:
            if group not in self.members:
                self._starting[group] = now + self.join_timeout_s

    def set_desired(self, replicas: int, groups: int | None = None) -> None:
        """Contributors wanted, and (from the operator) how many group ids exist. Lowering the bound refuses the
        removed groups' next requests; the operator evicts them itself when it scales down."""
        if replicas < 1:
            raise QuorumError(400, f"replicas must be >= 1, got {replicas}")
        if groups is not None and groups < replicas:
            raise QuorumError(400, f"groups ({groups}) must be >= replicas ({replicas})")
        self.desired = replicas
        if groups is not None:
            self.group_limit = groups

    # --- quorum --------------------------------------------------------------------------------------------------
    def withdraw(self, group: str, incarnation: str) -> None:
        """The group's long-poll ended without an answer (timeout or disconnect): stop counting it as asking."""
        member = self.members.get(group)
        if member is not None and member.incarnation == incarnation:
            self._set_asking(member, False)

    def request(self, req: QuorumRequest, now: float) -> None:
        """Registers a validated quorum request (also a heartbeat)."""
        member = self._touch(req.group, req.incarnation, now, req.generation)
        if member.finished:  # a finished group asking again has been restarted for more work
            member.finished = False
            self._n_finished -= 1
        member.step = req.step
        member.address = req.address
        member.store_address = req.store_address
        member.world_size = req.world_size
        member.addresses = req.rank_addresses()
        member.store_addresses = req.rank_store_addresses()
        member.commit_failures = req.commit_failures
        member.fresh = req.fresh
        if req.progress:  # it stands in for a heartbeat: the only news of progress from a group with short steps
            self.stall.beat(member, req.progress, False, now)
        self._handovers.quiet.pop(req.group, None)  # a handed-over group's new incarnation asks: no longer quiet
        self._reported_id = max(self._reported_id, req.quorum_id)
        self._set_asking(member, True)

    def _live(self) -> int:
        """Live groups the rule counts: not finished, and not a handed-over group's new incarnation yet to ask."""
        return len(self.members) - self._n_finished - len(self._handovers.quiet)

    def _waiting_for(self, now: float) -> int:
        alive = self._live()
        if not self._starting:  # the common case, checked at every request
            return alive - self._n_asking
        starting = sum(1 for g, until in self._starting.items() if until > now and g not in self.members)
        return alive - self._n_asking + starting

    def poll(self, now: float) -> Formed | None:
        """Issues the quorum if the rule allows it now; O(1) unless it forms."""
        asking = self._n_asking
        alive = self._live()
        if asking < self.min_replicas:
            self._join_deadline = None
            self.blocked_reason = f"waiting for min_replicas: {asking} of {self.min_replicas} groups asking"
            return None
        if 2 * asking <= alive:
            self.blocked_reason = f"split-brain guard: {asking} asking is not a majority of {alive} live groups"
            return None
        # handed-over members of the last quorum count as present: their new incarnation rides along when it asks
        present = self._prev_asking + len(self._handovers.prev_handed)
        prev_all_here = (
            bool(self._prev) and not self._prev_lost and self._prev_asking > 0 and present == len(self._prev)
        )
        if not prev_all_here and self._waiting_for(now) > 0:
            if self._join_deadline is None:
                self._join_deadline = now + self.join_timeout_s
            if now < self._join_deadline:
                self.blocked_reason = f"join timeout: waiting up to {self._join_deadline - now:.2f}s for live groups"
                return None
        return self._form(now)

    def _form(self, now: float) -> Formed | None:
        askers = sorted((m for m in self.members.values() if m.asking), key=lambda m: m.sort_key)
        max_step = max(m.step for m in askers)
        if max_step < self.committed_step:
            restored_floor = self.step_floor_until is not None
            # a floor this lighthouse did not see committed (restored, or from its state file) may be held by a
            # group that has not reconnected yet: only a floor it confirmed itself has holders it can count
            if restored_floor:  # ... unless every group of the job is back without it: then nobody can bring it
                wait = now < self.step_floor_until and not self._every_group_back(askers)
            else:
                wait = not self._prev or self._holder_alive()
            if wait:
                self.blocked_reason = (
                    f"no asking group holds committed step {self.committed_step} (best: {max_step}); waiting for one"
                )
                return None
            restored_from = self._restore(max_step, restored_floor)
        else:
            restored_from = None
        self.step_floor_until = None  # confirmed (or given up): from now on the floor is this lighthouse's own
        keys = {m.group: m.incarnation for m in askers}
        changed = keys != self._prev or self._prev_lost or any(m.commit_failures for m in askers)
        if changed or self.abort_below > self.quorum_id:
            self.quorum_id = max(self.quorum_id, self._reported_id, self.abort_below - 1) + 1
            changed = True
        contributors, own, heals = assign(askers, max_step, self._prev_contributors, self.desired)
        for member in askers:
            self._set_asking(member, False)
            member.commit_failures = 0
            member.waiting, member.progress_at = False, now  # a new step starts now (ftjob.lighthouse.core.stall)
        if restored_from is not None:
            self.last_restore = RestoredEvent(
                time=now, quorum_id=self.quorum_id, from_step=restored_from, to_step=max_step
            )
            self.history.append(self.last_restore)
        if changed:
            self.history.append(QuorumEvent(time=now, quorum_id=self.quorum_id, groups=list(keys), step=max_step))
        self._prev = keys
        self._prev_contributors = set(contributors)
        self._prev_asking = 0
        self._prev_lost = False
        self._handovers.prev_handed.clear()
        self._join_deadline = None
        self.committed_step = max(self.committed_step, max_step)
        self.blocked_reason = ""
        self.stall.formed(now)
        shared = {
            "quorum_id": self.quorum_id,
            "max_step": max_step,
            "replica_world_size": len(askers),
            "num_contributors": len(contributors),
            "store_address": askers[0].store_address,
            "store_addresses": askers[0].store_addresses,
            "store_prefix": f"ftjob/q{self.quorum_id}",
            "abort_below": self.abort_below,
        }
        return Formed(self.quorum_id, max_step, tuple(keys), changed, heals, Answers(shared, own))

    def _holder_alive(self) -> bool:
        """Whether a live member may still hold the committed step: one that reported it, or one of the last
        quorum's incarnations (a member that healed into it, or is computing the next step, asks with it soon)."""
        return any(m.step >= self.committed_step or self._prev.get(g) == m.incarnation for g, m in self.members.items())

    def _every_group_back(self, askers: list[Member]) -> bool:
        """Every group id of the job asks (each has one live incarnation): none of them holds the floor."""
        return self.group_limit is not None and len(askers) >= self.group_limit

    def _restore(self, step: int, restored_floor: bool) -> int:
        """Every incarnation that held the committed step is gone (the whole job was lost, or suspended and resumed):
        the job goes on from the best step the groups brought back (a checkpoint's, else 0). Waiting would wait
        forever. Returns the step given up; the quorum's history and ``last_restore`` say so (the operator's Restored
        Event and goodput read them)."""
        if restored_floor:
            log.warning("no group came back holding the restored committed step %d; going on from step %d",
                        self.committed_step, step)  # fmt: skip
        else:
            log.warning("every group holding committed step %d is gone; the job goes on from step %d (%d steps lost)",
                        self.committed_step, step, self.committed_step - step)  # fmt: skip
        lost, self.committed_step = self.committed_step, step
        return lost

    def members_view(self) -> list[QuorumMember]:
        """The last quorum's member list (for requests that ask for it)."""
        return quorum_view.members_view(self)

    def status(self, now: float) -> StatusResponse:
        return quorum_view.status(self, now)

    # read by ftjob.lighthouse.core.quorum_view
    @property
    def prev(self) -> dict[str, str]:
        return self._prev

    @property
    def starting(self) -> dict[str, float]:
        return self._starting

    @property
    def handovers(self) -> Handovers:
        return self._handovers
