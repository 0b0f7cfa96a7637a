"""Unit tests of the progress-based stall rule (ftjob.lighthouse.core.stall) inside the quorum logic, with an explicit
clock: a member that stops making progress while every other member waits in the step's collective is evicted long
before the heartbeat timeout; a slow but progressing member, a member asking for a quorum, or a job still learning
its step time never is."""

from __future__ import annotations

import pytest
from ftjob.lighthouse.core.quorum import QuorumCore, QuorumError
from ftjob.lighthouse.core.stall import MIN_INTERVALS, StallRule
from test_lighthouse_quorum import ask

STEP_S = 0.1
HEARTBEAT_TIMEOUT_S = 30.0


def trained(groups: tuple[str, ...] = ("0", "1", "2"), steps: int = MIN_INTERVALS + 2, stall: StallRule | None = None,
            **rule: float) -> tuple[QuorumCore, float]:  # fmt: skip
    """A core whose groups trained ``steps`` healthy steps of STEP_S under ``stall`` (else a rule with ``rule``'s
    parameters); returns it and the time the last quorum formed (every member then has the quorum answer and bumped
    its progress once)."""
    c = QuorumCore(min_replicas=1, join_timeout_s=1.0, heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S,
                   stall=stall if stall is not None else StallRule(**rule))  # fmt: skip
    now = 0.0
    for step in range(steps):
        now = step * STEP_S
        for g in groups:
            ask(c, g, step=step, now=now)
        assert c.poll(now) is not None
        for g in groups:
            beat(c, g, step + 1, waiting=False, now=now)
    return c, now


def beat(c: QuorumCore, group: str, progress: int, waiting: bool, now: float) -> None:
    c.heartbeat(group, f"inc-{group}", 0, now, progress=progress, waiting=waiting)


def run_until(c: QuorumCore, start: float, end: float, waiters: tuple[str, ...], suspect_progress: bool = False,
              busy: tuple[str, ...] = ()) -> list[str]:  # fmt: skip
    """Heartbeats every 0.1 s from ``start`` to ``end``: ``waiters`` wait in the collective, ``busy`` still compute
    (they beat, not waiting); group "2" beats with (or, by default, does not beat: frozen) progress. Returns the
    groups the sweeps dropped."""
    dropped: list[str] = []
    now, n = start, 1000
    while now < end and not dropped:
        now += 0.1
        n += 1
        for g in waiters:
            beat(c, g, 500, waiting=True, now=now)
        for g in busy:
            beat(c, g, 500, waiting=False, now=now)
        if suspect_progress:
            beat(c, "2", n, waiting=False, now=now)
        dropped = c.sweep(now)
    return dropped


def test_a_frozen_member_is_evicted_as_stalled_once_the_others_wait_for_it():
    c, t = trained()
    abort_below = c.abort_below
    dropped = run_until(c, t, t + 5.0, waiters=("0", "1"))  # "2" sends nothing at all (SIGSTOP)
    assert dropped == ["2"]
    reason = c.history[-1].reason
    assert reason.startswith("evicted: stalled: no progress for"), reason
    assert "2 other group(s) wait" in reason
    assert c.abort_below > abort_below, "the survivors' collective must be aborted at once"
    stalled_at = c.history[-1].time
    assert t + 1.0 < stalled_at <= t + 1.3, "the floor (1 s) bounds it: the median step is 0.1 s"
    with pytest.raises(QuorumError) as e:  # a stalled incarnation never comes back
        ask(c, "2", now=stalled_at + 0.1)
    assert e.value.status == 410, e.value


def test_a_member_frozen_inside_the_collective_is_evicted_for_its_silence():
    """Frozen after it reported waiting itself: every member waits, so progress blames nobody; its silence does
    (else the others' collective times out and, as 1 of 2 live groups, they cannot form a quorum for a long time)."""
    c, t = trained(groups=("0", "1"))
    beat(c, "1", 500, waiting=True, now=t + 0.05)  # its last heartbeat: in the collective
    dropped: list[str] = []
    now = t + 0.05
    while not dropped and now < t + 10:
        now += 0.1
        beat(c, "0", 500, waiting=True, now=now)
        dropped = c.sweep(now)
    assert dropped == ["1"] and now <= t + 1.3, now
    assert c.history[-1].reason.startswith("evicted: stalled: no heartbeat for"), c.history[-1].reason


def test_hung_member_that_still_heartbeats_without_progress_is_evicted_too():
    c, t = trained()
    now = t
    dropped: list[str] = []
    while not dropped and now < t + 5:
        now += 0.1
        beat(c, "0", 500, waiting=True, now=now)
        beat(c, "1", 500, waiting=True, now=now)
        beat(c, "2", 7, waiting=False, now=now)  # alive (its heartbeat thread runs) but stuck: progress never moves
        dropped = c.sweep(now)
    assert dropped == ["2"]


def test_a_member_that_makes_progress_is_never_evicted():
    c, t = trained()
    assert run_until(c, t, t + 10.0, waiters=("0", "1"), suspect_progress=True) == []


def test_nobody_is_evicted_while_not_every_other_member_waits():
    c, t = trained()
    # group 2 hangs (it beats, no progress), group 1 still computes: nobody waits for group 2 alone
    assert run_until(c, t, t + 10.0, waiters=("0",), busy=("1", "2")) == []


def test_the_limit_follows_the_median_step_time():
    c, t = trained(factor=3.0, floor_s=0.2)  # 3 x 0.1 s median -> 0.3 s
    dropped = run_until(c, t, t + 5.0, waiters=("0", "1"))
    assert dropped == ["2"] and c.history[-1].time <= t + 0.5


def test_no_rule_while_the_step_time_is_still_being_learnt():
    c, t = trained(steps=MIN_INTERVALS - 1)
    assert run_until(c, t, t + 10.0, waiters=("0", "1")) == []


def test_factor_zero_turns_the_rule_off():
    c, t = trained(factor=0.0)
    assert run_until(c, t, t + 10.0, waiters=("0", "1")) == []


def test_a_member_asking_for_the_next_quorum_is_not_stalled():
    c, t = trained()
    ask(c, "2", step=MIN_INTERVALS + 2, now=t + 0.05)  # it left the step (e.g. its step failed) and asks again
    assert run_until(c, t, t + 10.0, waiters=("0", "1")) == []


def test_a_group_with_steps_shorter_than_the_heartbeat_period_is_judged_by_the_progress_its_requests_carry():
    """Its quorum requests stand in for its heartbeats (the client beats only after a period with nothing sent), so
    they carry its progress: frozen right after its quorum formed, it is evicted, not left to the heartbeat timeout."""
    c = QuorumCore(min_replicas=1, join_timeout_s=1.0, heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S)
    now = 0.0
    for step in range(MIN_INTERVALS + 2):  # a quorum every 0.05 s: nobody heart-beats
        now = step * 0.05
        for g in ("0", "1", "2"):
            ask(c, g, step=step, now=now, progress=2 * step + 1)
        assert c.poll(now) is not None
    t = now
    dropped = run_until(c, t, t + 10.0, waiters=("0", "1"))  # then "2" freezes; the others wait and beat
    assert dropped == ["2"] and c.history[-1].time <= t + 1.3, c.history[-1]


def test_an_old_client_without_progress_is_left_to_the_heartbeat_timeout():
    c, t = trained(groups=("0", "1"))
    c.heartbeat("2", "inc-2", 0, t)  # joins with no progress field at all
    for g in ("0", "1", "2"):
        ask(c, g, step=MIN_INTERVALS + 2, now=t + 0.1)
    assert c.poll(t + 0.1) is not None
    assert run_until(c, t + 0.1, t + 10.0, waiters=("0", "1")) == []


def test_others_that_stopped_heartbeating_do_not_count_as_waiting():
    c, t = trained()
    beat(c, "0", 500, waiting=True, now=t + 0.1)
    beat(c, "1", 500, waiting=True, now=t + 0.1)
    # then nobody heart-beats (e.g. the lighthouse's own event loop was stalled): no verdict from stale news
    assert c.sweep(t + 3.0) == []


def test_bad_parameters_are_refused():
    with pytest.raises(ValueError, match="stall factor"):
        StallRule(factor=-1)
    with pytest.raises(ValueError, match="stall factor"):
        StallRule(floor_s=0)


def test_a_member_frozen_between_steps_is_left_out_then_evicted_for_its_silence():
    c, t = trained()
    now = t
    for g in ("0", "1"):  # the next step: group 2 never asks (frozen after its commit) and never beats again
        ask(c, g, step=MIN_INTERVALS + 2, now=t + 0.05)
    formed = None
    while formed is None:
        now += 0.1
        formed = c.poll(now)
    assert formed.groups == ("0", "1"), "the join timeout leaves it out"
    dropped: list[str] = []
    while not dropped and now < t + 10:
        now += 0.1
        beat(c, "0", 900, waiting=False, now=now)
        beat(c, "1", 900, waiting=False, now=now)
        dropped = c.sweep(now)
    assert dropped == ["2"] and now <= t + 1.3
    assert c.history[-1].reason.startswith("evicted: stalled: no heartbeat for"), c.history[-1].reason


def test_a_silent_member_is_not_judged_while_the_lighthouse_hears_nobody():
    c, t = trained()
    for g in ("0", "1"):
        ask(c, g, step=MIN_INTERVALS + 2, now=t + 0.05)
    assert c.poll(t + 0.1) is None and c.poll(t + 1.2) is not None  # the join timeout (1 s) leaves group 2 out
    assert c.sweep(t + 5.0) == [], "nobody heard for seconds: the lighthouse's own loop stalled, not group 2"


def test_the_limit_covers_several_heartbeat_periods_when_the_lighthouse_slows_the_beats_down():
    c, t = trained()
    c.stall.heartbeat_interval_s = 1.25  # what the lighthouse tells 12,500 groups
    assert c.stall.limit_s() == pytest.approx(3.75)
    assert run_until(c, t, t + 3.5, waiters=("0", "1")) == [], "three periods without a beat are no evidence yet"


class CountingRule(StallRule):
    """The rule, counting its O(members) scans."""

    scans = 0

    def stalled(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        self.scans += 1
        return super().stalled(*args, **kwargs)


def test_the_scan_runs_a_few_times_per_limit_and_detection_stays_within_a_tenth_of_it():
    """A long limit (a large job beats every 1.25 s: >= 3.75 s) is checked every tenth of it, not every 0.1 s tick:
    each check visits every member."""
    rule = CountingRule(floor_s=4.0)
    c, now = trained(stall=rule)
    rule.scans = 0
    dropped = run_until(c, now, now + 10.0, waiters=("0", "1"))
    assert dropped == ["2"]
    stalled_at = c.history[-1].time
    assert now + 4.0 < stalled_at <= now + 4.0 + 0.4 + 0.1, "late by at most a tenth of the limit (and a tick)"
    assert rule.scans <= 12, f"{rule.scans} scans in ~4.4 s of 0.1 s sweeps: one per 0.4 s expected"
