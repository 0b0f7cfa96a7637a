"""Who did what, for the audit trail: the sender of each request, the membership changes QuorumCore makes (joins,
leaves, evictions) with who caused them, refused requests, and the integrity checks' findings carried out (evictions
through QuorumCore's evict path) and counted. Kept apart from the server so its handlers only say who is asking.

Actors, by the token a request carried (ftjob.lighthouse.api.auth): "operator from <addr>" for the operator's token;
for the job's worker token "group G (incarnation I) from <addr>" once the request's body (or watch query) named them,
else "worker from <addr>" (e.g. a worker's token refused on the membership API); "unauthenticated client from <addr>"
for a 401, "client from <addr>" for a request that needs no token; and "lighthouse" for its own decisions (heartbeat
timeout, closed watch socket, guard and divergence verdicts).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from aiohttp import web
from ftjob.lighthouse.api.auth import OPERATOR, Role
from ftjob.lighthouse.audit_trail import AuditTrail
from ftjob.lighthouse.core.integrity_checks import Finding, IntegrityChecks
from ftjob.lighthouse.core.quorum import QuorumCore
from ftjob.lighthouse.server_metrics import LighthouseMetrics

LIGHTHOUSE = "lighthouse"  # the actor of the lighthouse's own decisions
# request[SENDER] = (group, "group G (incarnation I)") once the request's body or query named them
SENDER = web.RequestKey("ftjob_sender", tuple[str, str])
ROLE = web.RequestKey("ftjob_role", str)  # whose token the request carried (Role), once authenticated
_LIVENESS = ("heartbeat_timeout", "disconnected")  # drops the lighthouse decides, whoever's request ran it
_OUTCOMES = {
    "heartbeat_timeout": "dropped: no heartbeat within the heartbeat timeout",
    "disconnected": "dropped: its watch socket closed",
    "restarted": "replaced by a new incarnation of the group (this one is banned)",
    "left": "left the job at a step boundary: its process was asked to terminate (this incarnation is banned)",
}
T = TypeVar("T")


def name_sender(request: web.Request, group: str | None, incarnation: str | None) -> None:
    if group is not None and incarnation is not None:
        request[SENDER] = (group, f"group {group} (incarnation {incarnation})")


def peer_of(request: web.Request) -> str:
    return request.remote or "unknown"


def actor_of(request: web.Request, status: int = 200) -> str:
    """Who sent the request, by its token: the operator, a group's process (named or not yet), or an unnamed client."""
    peer = peer_of(request)
    role: Role | None = request.get(ROLE)  # type: ignore[assignment]
    if status == 401 or role is None:
        return f"{'unauthenticated client' if status == 401 else 'client'} from {peer}"
    if role == OPERATOR:
        return f"operator from {peer}"
    if SENDER in request:
        return f"{request[SENDER][1]} from {peer}"
    return f"worker from {peer}"


class Auditor:
    def __init__(
        self, core: QuorumCore, trail: AuditTrail, metrics: LighthouseMetrics, checks: IntegrityChecks
    ) -> None:
        self.core = core
        self.trail = trail
        self.metrics = metrics
        self.checks = checks
        self._audited = 0  # core.dropped_events[:_audited] are audited (the server clears the list after use)
        self._digests_counted = 0

    # --- membership ----------------------------------------------------------------------------------------------
    def touch(self, group: str, incarnation: str, actor: str, how: str, now: float, call: Callable[[], T]) -> T:
        """Runs ``call`` (a core method that registers ``group``'s ``incarnation``: it raises before any change) and
        audits what it changed: the old incarnation it replaced, the join, the group finishing."""
        before = self.core.members.get(group)
        new = before is None or before.incarnation != incarnation
        was_finished = before is not None and not new and before.finished
        result = call()
        self.drops(actor, now)
        if new:
            self.trail.record(now, "join", actor, f"a new incarnation registered ({how})", "joined", group)
        after = self.core.members.get(group)
        if after is not None and after.finished and not was_finished:
            self.trail.record(now, "leave", actor, "finished training", "kept in the status as finished", group)
        return result

    def drops(self, actor: str, now: float) -> None:
        """Audits the groups the core dropped since the last call; ``actor`` caused those that are not liveness
        decisions (an operator's evict, a new incarnation replacing the old one, the integrity checks)."""
        events = self.core.dropped_events
        if self._audited > len(events):  # cleared without drained(): all of it is new
            self._audited = 0
        for group, reason in events[self._audited :]:
            who = LIGHTHOUSE if reason in _LIVENESS else actor
            if reason.startswith("evicted"):
                self.trail.record(now, "evict", who, reason, "evicted: its incarnation is banned", group)
            elif reason.startswith("handed_over"):
                self.trail.record(now, "leave", who, reason, "handed over to a new incarnation", group)
            else:
                self.trail.record(now, "leave", who, reason, _OUTCOMES.get(reason, "dropped"), group)
        self._audited = len(events)

    def drained(self) -> None:
        """The server cleared ``core.dropped_events``."""
        self._audited = 0

    # --- refusals ------------------------------------------------------------------------------------------------
    def refused(self, request: web.Request, status: int, message: str, now: float) -> None:
        """A request answered with a 4xx (5xx: the lighthouse's own trouble, retried, is not audited). Folded."""
        if status >= 500:
            return
        group = request[SENDER][0] if SENDER in request else None
        reason = f"{request.method} {request.path}: {message}"
        self.trail.refused(now, peer_of(request), f"refused {status}", actor_of(request, status), reason, group)

    # --- integrity -----------------------------------------------------------------------------------------------
    def enforce(self, found: list[Finding], actor: str, peer: str, now: float) -> None:
        """Audits, counts and carries out the integrity checks' findings; an ignored report is a (folded) refusal of
        ``actor`` at ``peer``; evictions go through QuorumCore's evict path, as the operator's do."""
        for f in found:
            if f.kind == "refused":
                self.trail.refused(now, peer, f.outcome, actor, f.reason, f.group)
                continue
            self.trail.record(now, f.kind, LIGHTHOUSE, f.reason, f.outcome, f.group)
            if f.kind == "guard":
                self.metrics.guard_offences.inc()
            elif f.group is not None:
                self.metrics.divergences.inc()
            if f.evict is not None:
                if f.kind == "guard":
                    self.metrics.guard_evictions.inc()
                self.core.evict([f.evict], f.evict_reason, now)
                self.drops(LIGHTHOUSE, now)
        self.metrics.digest_checks.inc(self.checks.digests_compared - self._digests_counted)
        self._digests_counted = self.checks.digests_compared
