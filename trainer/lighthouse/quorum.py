"""The lighthouse's quorum algorithm as pure logic: no I/O, no clock (callers pass ``now``), no asyncio.

Every replica group asks for a quorum once per step. A quorum forms when:
  * every member of the previous quorum is alive and asking (new joiners ride along) -- issued at once, or
  * otherwise at least ``min_replicas`` groups ask, they are a strict majority of the live groups (split-brain
    guard), and either no live/starting group is still missing or the join timeout since that became true passed.
A new incarnation of a known group replaces the old one and bans it; that loses the old one (the quorum in flight
aborts) unless the operator marked the group for a handover (make-before-break, ftjob.lighthouse.handover): then the
quorum in flight completes, the old incarnation is no missing member of the previous quorum, and the new one is
neither waited for nor counted as live until it first asks.
The quorum id changes only when the membership (group + incarnation) changes, a member reports a failed commit, or a
member of the last quorum was dropped (evicted, heartbeat timeout, disconnected): the managers then rebuild their
cross-group process group. Each request is O(1); forming is O(n log n) over the askers.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

from ftjob.contract.lighthouse_api import (
    DroppedEvent,
    HistoryEvent,
    MemberStatus,
    QuorumEvent,
    QuorumMember,
    QuorumRequest,
    RecoverySource,
    StatusResponse,
)
from ftjob.lighthouse.answers import Answers, Own
from ftjob.lighthouse.handover import Handovers
from ftjob.lighthouse.stall import StallRule

log = logging.getLogger("ftjob.lighthouse")
# The stall rule scans every member (O(n)): checked at most this often, a small fraction of its >= 1 s limit
STALL_CHECK_S = 0.1


class QuorumError(Exception):
    """A request the lighthouse refuses; ``status`` is the HTTP status the server answers with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class BadRequest(QuorumError):
    def __init__(self, message: str) -> None:
        super().__init__(400, message)


@dataclass
class Member:
    """One live replica group as the lighthouse knows it."""

    group: str
    incarnation: str
    last_seen: float
    step: int = 0
    address: str = ""
    store_address: str = ""
    addresses: list[str] = field(default_factory=list)  # per rank: recovery servers
    store_addresses: list[str] = field(default_factory=list)  # per rank: TCPStore hosts
    world_size: int = 1
    asking: bool = False
    commit_failures: int = 0
    finished: bool = False
    param_digest: str | None = None
    healing: bool = False
    contributing: bool = False
    fresh: bool = False  # started from scratch, state not yet synced with the job's
    progress: int = 0  # the group's progress counter, and since when it holds this value (ftjob.lighthouse.stall)
    progress_at: float = 0.0
    waiting: bool = False  # blocked in the step's cross-group collective


@dataclass(frozen=True)
class Formed:
    """A quorum just issued: ``responses`` maps each member group to its answer."""

    quorum_id: int
    max_step: int
    groups: tuple[str, ...]
    changed: bool
    heals: int
    responses: Answers  # group -> QuorumResponse; .encoded(group): its JSON, the shared part encoded once


def group_sort_key(group: str) -> tuple[int, int, str]:
    """Numeric group ids sort as numbers ("2" < "10"), anything else after them by text."""
    return (0, int(group), "") if group.isdigit() else (1, 0, group)


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
        self._starting: dict[str, float] = {}  # group -> until when the quorum may wait for it
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

    def _touch(self, group: str, incarnation: str, now: float) -> Member:
        """Registers a heartbeat; a new incarnation of a known group replaces the old one, which counts as lost
        unless the group was marked for a handover (then the old one's quorum goes on: see the module docstring)."""
        self.check_group(group)
        self._check_banned(group, incarnation)
        member = self.members.get(group)
        handed_over = False
        if member is None or member.incarnation != incarnation:
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
            member = Member(group=group, incarnation=incarnation, last_seen=now)
            self.members[group] = member
            self._incarnations[group] = incarnation
            self._starting.pop(group, None)
            if handed_over:
                self._handovers.quiet[group] = incarnation
        member.last_seen = now
        self._by_seen[group] = None
        self._by_seen.move_to_end(group)
        return member

    def heartbeat(
        self, group: str, incarnation: str, step: int, now: float, finished: bool = False, digest: str | None = None,
        progress: int = 0, waiting: bool = False,
    ) -> None:  # fmt: skip
        member = self._touch(group, incarnation, now)
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
        if now >= self._next_stall_check:  # O(members): a few times a second, not at every request
            self._next_stall_check = now + STALL_CHECK_S
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
        self.history.append(DroppedEvent(time=now, group=group, reason=reason))

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

    def handover(self, groups: Iterable[str], reason: str, now: float) -> list[str]:
        """Marks the groups' current incarnation for a make-before-break handover: their next incarnation replaces it
        without aborting the quorum in flight (ftjob.lighthouse.handover). 403 for a group id outside the job's, 404
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
        member = self._touch(req.group, req.incarnation, now)
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
        self._handovers.quiet.pop(req.group, None)  # a handed-over group's new incarnation asks: no longer quiet
        self._reported_id = max(self._reported_id, req.quorum_id)
        self._set_asking(member, True)

    def _live(self) -> int:
        """Live groups the rule counts: not finished, and not a handed-over group's new incarnation yet to ask."""
        return len(self.members) - self._n_finished - len(self._handovers.quiet)

    def _waiting_for(self, now: float) -> int:
        alive = self._live()
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
        askers = sorted((m for m in self.members.values() if m.asking), key=lambda m: group_sort_key(m.group))
        max_step = max(m.step for m in askers)
        if max_step < self.committed_step:
            if self.step_floor_until is None or now < self.step_floor_until:
                self.blocked_reason = (
                    f"no asking group holds committed step {self.committed_step} (best: {max_step}); waiting for one"
                )
                return None
            log.warning(
                "no group came back holding the restored committed step %d; going on from step %d",
                self.committed_step,
                max_step,
            )
            self.committed_step = max_step
        self.step_floor_until = None  # confirmed (or given up): from now on the floor is this lighthouse's own
        keys = {m.group: m.incarnation for m in askers}
        changed = keys != self._prev or self._prev_lost or any(m.commit_failures for m in askers)
        if changed or self.abort_below > self.quorum_id:
            self.quorum_id = max(self.quorum_id, self._reported_id, self.abort_below - 1) + 1
            changed = True
        up_to_date = [m for m in askers if m.step == max_step]
        reference, sync_healers = self._initial_sync(askers, up_to_date, max_step)
        # Contributors: keep last quorum's contributors first (stable sharding), spares fill in for lost ones.
        ranked = sorted(up_to_date, key=lambda m: (m.group not in self._prev_contributors, group_sort_key(m.group)))
        wanted = len(ranked) if self.desired is None else min(self.desired, len(ranked))
        contributors = sorted((m.group for m in ranked[:wanted]), key=group_sort_key)
        contributor_rank = {g: i for i, g in enumerate(contributors)}
        sources: dict[str, Member | None] = {}
        heals = 0
        for member in askers:
            source = None
            if member.step < max_step:  # behind: copy from an up-to-date group, spread over them
                source = up_to_date[heals % len(up_to_date)]
            elif member.group in sync_healers:  # fresh at step 0: copy the reference's state first
                source = reference
            heals += source is not None
            sources[member.group] = source
            member.healing = source is not None
            member.contributing = member.group in contributor_rank
        serving = {s.group for s in sources.values() if s is not None}
        first = askers[0]
        own: dict[str, Own] = {}  # each member's own fields; the rest is shared (ftjob.lighthouse.answers)
        for replica_rank, member in enumerate(askers):
            source = sources[member.group]
            recover_from = None
            if source is not None:
                recover_from = RecoverySource(
                    group=source.group, address=source.address, addresses=source.addresses, step=source.step
                )
            own[member.group] = Own(replica_rank, member.contributing, contributor_rank.get(member.group, -1),
                                    recover_from, member.group in serving)  # fmt: skip
            self._set_asking(member, False)
            member.commit_failures = 0
            member.waiting, member.progress_at = False, now  # a new step starts now (ftjob.lighthouse.stall)
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
            "store_address": first.store_address,
            "store_addresses": first.store_addresses,
            "store_prefix": f"ftjob/q{self.quorum_id}",
            "abort_below": self.abort_below,
        }
        return Formed(self.quorum_id, max_step, tuple(keys), changed, heals, Answers(shared, own))

    @staticmethod
    def _initial_sync(askers: list[Member], up_to_date: list[Member], max_step: int) -> tuple[Member | None, set[str]]:
        """At step 0, groups that started from scratch copy one reference group's state before training together, so
        no group trains from weights of its own. The reference is a group synced earlier, else the first asker."""
        if max_step != 0 or not any(m.fresh for m in askers):
            return None, set()
        synced = [m for m in up_to_date if not m.fresh]
        reference = synced[0] if synced else up_to_date[0]
        return reference, {m.group for m in askers if m.fresh and m is not reference}

    def members_view(self) -> list[QuorumMember]:
        """The last quorum's member list (for requests that ask for it)."""
        out = []
        for group in self._prev:
            m = self.members.get(group)
            if m is not None:
                out.append(
                    QuorumMember(
                        group=m.group,
                        step=m.step,
                        address=m.address,
                        store_address=m.store_address,
                        contributing=m.contributing,
                    )
                )
        return out

    def status(self, now: float) -> StatusResponse:
        members = [
            MemberStatus(
                group=m.group,
                incarnation=m.incarnation,
                step=m.step,
                address=m.address,
                last_heartbeat_age_s=round(now - m.last_seen, 3),
                in_quorum=self._prev.get(m.group) == m.incarnation,
                asking=m.asking,
                healing=m.healing,
                contributing=m.contributing,
                finished=m.finished,
                param_digest=m.param_digest,
            )
            for m in sorted(self.members.values(), key=lambda m: group_sort_key(m.group))
        ]
        return StatusResponse(
            quorum_id=self.quorum_id,
            max_step=self.committed_step,
            abort_below=self.abort_below,
            min_replicas=self.min_replicas,
            desired_replicas=self.desired,
            quorum_groups=list(self._prev),
            members=members,
            starting=sorted(g for g, until in self._starting.items() if until > now),
            handing_over=sorted(self._handovers.pending(now), key=group_sort_key),
            blocked_reason=self.blocked_reason,
            history=list(self.history)[-50:],
            clock=now,
        )
