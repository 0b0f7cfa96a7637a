"""The lighthouse's integrity checks as pure logic (no I/O, no clock: callers pass ``now``): it tallies the gradient
guard's verdicts and compares the replicas' state digests, both riding on quorum requests.

Guard verdicts. A group whose gradient the guard refused in a step is an *offence* of (offender, quorum id), counted
once, when at least ceil(n/2) of that quorum's n member groups reported it (every member computes the same verdict, so
one lying group cannot get another evicted, and a retried request counts once). ``max_offences`` offences of the same
incarnation within ``window_s`` seconds evict it ("gradient_guard: ..."); its replacement (a new incarnation) starts
with a clean tally. An offender that is no longer a member is only counted.

State digests. The groups that commit step S are the members of the last quorum that formed at step S-1; each sends
its digest for S in a later quorum request. The digests for S are compared as soon as every one of those groups that
is still a member has sent one; otherwise (a committer sent none, or this lighthouse started later and does not know
who committed S) at the first quorum formed past S once two groups sent one; and at the latest when S drops out of
the last ``keep_steps`` digest steps. A strict majority (>= 2 groups alike, more than half of those that sent one)
wins and every other group is evicted ("divergent: ..."); without one nobody is evicted (a "no majority" finding). A
digest that arrives after its step was compared is checked against that step's majority.

Reports that do not fit what this lighthouse remembers (a quorum it does not know, a reporter or an offender that was
not in that quorum) are ignored and returned as a "refused" finding; they never fail the quorum request that carries
them: a lighthouse restarted since forgets every quorum, and an honest trainer's next step must not depend on that.
Only what no honest trainer can send is refused (``validate``: 400, before anything changes). Memory is bounded:
the last ``remember_quorums`` quorums and ``keep_steps`` digest steps.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Literal

from ftjob.contract.lighthouse_api import GuardOffence, IntegrityStatus, QuorumRequest
from ftjob.lighthouse.core.quorum import QuorumError, group_sort_key

DEFAULT_MAX_OFFENCES = 3
DEFAULT_WINDOW_S = 600.0
REMEMBER_QUORUMS = 16  # a verdict is reported in the request right after the refused step: its quorum is recent
KEEP_DIGEST_STEPS = 4

# group -> the incarnation that is a member now (None: not a member)
CurrentIncarnation = Callable[[str], str | None]


@dataclass(frozen=True)
class Finding:
    """A conclusion of the checks, for the server to audit, count and act on."""

    kind: Literal["guard", "divergence", "refused"]
    group: str | None
    reason: str
    outcome: str
    evict: str | None = None  # the server evicts this group (its current incarnation is the one at fault) ...
    evict_reason: str = ""  # ... with this reason


@dataclass
class _Report:
    offence: GuardOffence
    step: int
    reporters: set[str] = field(default_factory=set)


@dataclass
class _Quorum:
    members: dict[str, str]  # group -> incarnation
    reports: dict[str, _Report] = field(default_factory=dict)  # offender -> reports not yet enough to count
    counted: set[str] = field(default_factory=set)  # offenders whose offence in this quorum was counted


@dataclass
class _Offence:
    time: float
    step: int
    offence: GuardOffence


@dataclass
class _Step:
    digests: dict[str, tuple[str, str]] = field(default_factory=dict)  # group -> (incarnation, digest)
    counts: collections.Counter[str] = field(default_factory=collections.Counter)  # digest -> groups that sent it
    waiting: set[str] | None = None  # committers that are still members and sent none yet (None: not known)
    majority: str | None = None  # the digest that won the last judgement
    ready: bool = False  # compared; later digests are judged one by one
    judged: set[str] = field(default_factory=set)  # groups already found divergent
    no_majority_found: bool = False


class IntegrityChecks:
    def __init__(
        self,
        max_offences: int = DEFAULT_MAX_OFFENCES,
        window_s: float = DEFAULT_WINDOW_S,
        remember_quorums: int = REMEMBER_QUORUMS,
        keep_steps: int = KEEP_DIGEST_STEPS,
    ) -> None:
        if max_offences < 1 or window_s <= 0:
            raise ValueError(f"max_offences must be >= 1 and window_s > 0, got {max_offences} and {window_s}")
        self.max_offences = max_offences
        self.window_s = window_s
        self._remember = remember_quorums
        self._keep_steps = keep_steps
        self._quorums: collections.OrderedDict[int, _Quorum] = collections.OrderedDict()
        self._committers: collections.OrderedDict[int, int] = collections.OrderedDict()  # step S -> quorum id at S-1
        self._offences: dict[tuple[str, str], collections.deque[_Offence]] = {}  # (group, incarnation) -> in window
        self._steps: dict[int, _Step] = {}
        self.guard_offences: collections.Counter[str] = collections.Counter()
        self.guard_evictions: collections.Counter[str] = collections.Counter()
        self.divergences: collections.Counter[str] = collections.Counter()
        self.digests_compared = 0
        self.last_compared_step: int | None = None

    def status(self) -> IntegrityStatus:
        return IntegrityStatus(
            guard_offences=dict(self.guard_offences),
            guard_evictions=dict(self.guard_evictions),
            divergences=dict(self.divergences),
            digests_compared=self.digests_compared,
            last_compared_step=self.last_compared_step,
        )

    @property
    def steps_kept(self) -> int:
        """How many digest steps are remembered now: never more than ``keep_steps``."""
        return len(self._steps)

    # --- requests ------------------------------------------------------------------------------------------------
    @staticmethod
    def validate(req: QuorumRequest) -> None:
        """400 for what no honest trainer sends, whatever the lighthouse remembers (the schema checked the rest)."""
        verdict, digest = req.guard_verdict, req.state_digest
        if verdict is not None:
            if verdict.quorum_id > req.quorum_id:
                raise QuorumError(
                    400,
                    f"guard_verdict.quorum_id ({verdict.quorum_id}) is newer than quorum_id ({req.quorum_id}), the "
                    "last quorum this group saw: a verdict is about a step this group trained",
                )
            seen: set[str] = set()
            for offence in verdict.offenders:
                if offence.group in seen:
                    raise QuorumError(400, f"guard_verdict.offenders names group {offence.group!r} twice")
                seen.add(offence.group)
        if digest is not None and digest.step > req.step:
            raise QuorumError(
                400, f"state_digest.step ({digest.step}) is ahead of step ({req.step}), the group's committed step"
            )

    def report(self, req: QuorumRequest, now: float, current: CurrentIncarnation) -> list[Finding]:
        """Takes a validated, registered quorum request's verdict and digest."""
        found: list[Finding] = []
        if req.guard_verdict is not None:
            found += self._guard(req, now, current)
        if req.state_digest is not None:
            found += self._digest(req.group, req.incarnation, req.state_digest.step, req.state_digest.digest, current)
        return found

    def quorum_formed(
        self, quorum_id: int, max_step: int, groups: Iterable[str], now: float, current: CurrentIncarnation
    ) -> list[Finding]:
        """Remembers a quorum just issued (its members are those asking: ``current``) and compares the digests
        whose committers have all sent theirs by now. O(members) only for a new quorum id or a pending digest step."""
        if quorum_id not in self._quorums:
            members = {g: inc for g in groups if (inc := current(g)) is not None}
            self._quorums[quorum_id] = _Quorum(members=members)
            while len(self._quorums) > self._remember:
                self._quorums.popitem(last=False)
        self._committers[max_step + 1] = quorum_id
        self._committers.move_to_end(max_step + 1)
        while len(self._committers) > self._remember:
            self._committers.popitem(last=False)
        found: list[Finding] = []
        for step in sorted(self._steps):
            record = self._steps[step]
            if record.ready:
                continue
            self._await_committers(step, record, current)  # members may have left since: wait for no one gone
            # past S, every group that committed S and goes on has asked since (its digest rides on the next request
            # or the one after): one that sent none by now is not waited for (its digest is judged if it comes)
            if record.waiting == set() or (max_step > step and len(record.digests) >= 2):
                found += self._compare(step, record, current)
        return found

    # --- guard verdicts ------------------------------------------------------------------------------------------
    def _guard(self, req: QuorumRequest, now: float, current: CurrentIncarnation) -> list[Finding]:
        verdict = req.guard_verdict
        assert verdict is not None
        quorum = self._quorums.get(verdict.quorum_id)
        if quorum is None:
            why = f"this lighthouse does not know quorum {verdict.quorum_id} (formed before it started, or too old)"
            return [self._ignored(verdict.offenders[0].group, why)]
        if quorum.members.get(req.group) != req.incarnation:
            why = f"the reporter (group {req.group}, this incarnation) was not a member of quorum {verdict.quorum_id}"
            return [self._ignored(verdict.offenders[0].group, why)]
        found: list[Finding] = []
        strangers = [o.group for o in verdict.offenders if o.group not in quorum.members]
        if strangers:
            why = f"offender group(s) {strangers[:8]} were not members of quorum {verdict.quorum_id}"
            found.append(self._ignored(strangers[0], why))
        needed = (len(quorum.members) + 1) // 2
        for offence in verdict.offenders:
            group = offence.group
            if group not in quorum.members or group in quorum.counted:
                continue
            report = quorum.reports.setdefault(group, _Report(offence=offence, step=verdict.step))
            report.reporters.add(req.group)
            if len(report.reporters) >= needed:
                del quorum.reports[group]
                quorum.counted.add(group)
                incarnation = quorum.members[group]
                found.append(
                    self._count(group, incarnation, verdict.quorum_id, report, len(quorum.members), now, current)
                )
        return found

    def _count(
        self,
        group: str,
        incarnation: str,
        quorum_id: int,
        report: _Report,
        n: int,
        now: float,
        current: CurrentIncarnation,
    ) -> Finding:
        self.guard_offences[group] += 1
        for key in [k for k, q in self._offences.items() if q and q[-1].time <= now - self.window_s]:
            del self._offences[key]  # nothing left in the window
        window = self._offences.setdefault((group, incarnation), collections.deque())
        window.append(_Offence(time=now, step=report.step, offence=report.offence))
        while window[0].time <= now - self.window_s:
            window.popleft()
        what = f"{describe_offence(report.offence)} at step {report.step} in quorum {quorum_id}"
        reason = f"{what}; counted once {len(report.reporters)} of its {n} groups reported it"
        tally = f"{len(window)} offence(s) within {self.window_s:g}s (evicted at {self.max_offences})"
        if len(window) < self.max_offences:
            return Finding("guard", group, reason, f"offence counted: {tally}")
        evict_reason = "gradient_guard: " + summarize(list(window), self.window_s)
        if current(group) != incarnation:
            return Finding("guard", group, reason, f"{tally}; that incarnation is no longer a member: nobody to evict")
        del self._offences[(group, incarnation)]
        self.guard_evictions[group] += 1
        return Finding("guard", group, reason, f"evicted: {tally}", evict=group, evict_reason=evict_reason)

    @staticmethod
    def _ignored(group: str | None, why: str) -> Finding:
        return Finding("refused", group, f"guard verdict ignored: {why}", "ignored (the quorum request was served)")

    # --- state digests -------------------------------------------------------------------------------------------
    def _await_committers(self, step: int, record: _Step, current: CurrentIncarnation) -> None:
        """The groups that committed ``step``, are still the same members and sent no digest yet (O(members))."""
        quorum = self._quorums.get(self._committers.get(step, -1))
        if quorum is None:
            record.waiting = None  # this lighthouse does not know who committed it
            return
        record.waiting = {g for g, inc in quorum.members.items() if current(g) == inc and g not in record.digests}

    def _digest(
        self, group: str, incarnation: str, step: int, digest: str, current: CurrentIncarnation
    ) -> list[Finding]:
        record = self._steps.get(step)
        if record is None:
            if len(self._steps) >= self._keep_steps and step < min(self._steps):
                return []  # older than every step kept: too late to compare
            record = self._steps[step] = _Step()
            self._await_committers(step, record, current)
        if group in record.digests:
            return []  # a retried request, or a second digest for the same step: the first one stands
        record.digests[group] = (incarnation, digest)
        record.counts[digest] += 1
        found: list[Finding] = []
        if record.ready:
            found += self._judge(step, record, current, late=group)
        elif record.waiting is not None:
            record.waiting.discard(group)
            if not record.waiting:  # O(1) per digest: the last committer's completes the step
                found += self._compare(step, record, current)
        while len(self._steps) > self._keep_steps:  # the oldest step is compared now with what it has
            oldest = min(self._steps)
            dropped = self._steps.pop(oldest)
            if not dropped.ready:
                found += self._compare(oldest, dropped, current)
        return found

    def _compare(self, step: int, record: _Step, current: CurrentIncarnation) -> list[Finding]:
        if len(record.digests) < 2:
            return []  # one group: nothing to compare with (later digests for the step still come in)
        record.ready = True
        self.digests_compared += 1
        self.last_compared_step = step if self.last_compared_step is None else max(self.last_compared_step, step)
        return self._judge(step, record, current)

    def _judge(self, step: int, record: _Step, current: CurrentIncarnation, late: str | None = None) -> list[Finding]:
        """Every group against the majority; a ``late`` digest alone when the majority stands (O(1) each)."""
        n = len(record.digests)
        counts = record.counts
        majority, k = counts.most_common(1)[0]
        if k < 2 or 2 * k <= n:
            record.majority = None
            if record.no_majority_found:
                return []
            record.no_majority_found = True
            groups = ", ".join(
                f"{g}: {d[:12]}"
                for g, (_inc, d) in sorted(record.digests.items(), key=lambda kv: group_sort_key(kv[0]))[:16]
            )
            reason = f"digests at step {step} differ, no strict majority ({len(counts)} distinct of {n}: {groups})"
            return [Finding("divergence", None, reason, "no majority: nobody evicted")]
        found = []
        groups = [late] if late is not None and record.majority == majority else sorted(record.digests)
        record.majority = majority
        for group in groups:
            incarnation, digest = record.digests[group]
            if digest == majority or group in record.judged:
                continue
            record.judged.add(group)
            self.divergences[group] += 1
            reason = f"divergent: digest at step {step} differs from the majority ({k} of {n} groups)"
            if current(group) != incarnation:
                found.append(Finding("divergence", group, reason, "no longer a member: nobody to evict"))
                continue
            found.append(Finding("divergence", group, reason, "evicted", evict=group, evict_reason=reason))
        return found


def describe_offence(offence: GuardOffence) -> str:
    if offence.kind == "nonfinite" or offence.norm is None:
        return f"{offence.kind}: gradient not finite"
    median = "no median" if offence.median is None else f"median {offence.median:.3g} of the others"
    return f"{offence.kind}: gradient norm {offence.norm:.3g} vs {median}"


def summarize(window: list[_Offence], window_s: float) -> str:
    """E.g. ``norm_outlier in 3 steps within 600s (steps 20, 21, 22); last: gradient norm 1.2e+03 vs median 1.1``."""
    by_kind: dict[str, list[int]] = {}
    for o in window:
        by_kind.setdefault(o.offence.kind, []).append(o.step)
    kinds = " and ".join(f"{kind} in {len(steps)}" for kind, steps in by_kind.items())
    steps = ", ".join(str(o.step) for o in window[-8:])
    last = describe_offence(window[-1].offence).split(": ", 1)[1]
    return f"{kinds} step(s) within {window_s:g}s (steps {steps}); last: {last}"
