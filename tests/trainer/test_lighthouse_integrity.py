"""Unit tests of the lighthouse's integrity checks (pure logic, explicit clock): the guard verdict tally and the state
digest comparison (ftjob.lighthouse.core.integrity_checks)."""

from __future__ import annotations

import re
from typing import Any

import pytest
from ftjob.contract.lighthouse_api import QuorumRequest
from ftjob.lighthouse.core.integrity_checks import IntegrityChecks
from ftjob.lighthouse.core.quorum import QuorumError


class Members:
    """The live membership the checks ask about: group -> incarnation."""

    def __init__(self, *groups: str) -> None:
        self.live = {g: f"inc-{g}" for g in groups}

    def __call__(self, group: str) -> str | None:
        return self.live.get(group)


def request(group: str, quorum_id: int = 1, step: int = 10, **extra: Any) -> QuorumRequest:
    return QuorumRequest(
        group=group,
        incarnation=extra.pop("inc", f"inc-{group}"),
        step=step,
        quorum_id=quorum_id,
        address="10.0.0.1:1",
        store_address="10.0.0.1:2",
        **extra,
    )


def verdict(quorum_id: int, *offenders: str, kind: str = "norm_outlier", step: int = 9) -> dict:
    norm = None if kind == "nonfinite" else 1000.0
    return {
        "quorum_id": quorum_id,
        "step": step,
        "offenders": [{"group": g, "kind": kind, "norm": norm, "median": 1.0} for g in offenders],
    }


def form(checks: IntegrityChecks, members: Members, quorum_id: int, max_step: int, now: float = 0.0) -> list:
    return checks.quorum_formed(quorum_id, max_step, sorted(members.live), now, members)


def report(checks: IntegrityChecks, members: Members, group: str, now: float = 0.0, **extra: Any) -> list:
    req = request(group, **extra)
    checks.validate(req)
    return checks.report(req, now, members)


def guard_round(checks: IntegrityChecks, members: Members, quorum_id: int, reporters: str, now: float) -> list:
    """The quorum forms, then the reporters say ``2`` offended in its step."""
    form(checks, members, quorum_id, max_step=quorum_id, now=now)
    found = []
    for g in reporters:
        body = verdict(quorum_id, "2", step=10 * quorum_id)
        found += report(checks, members, g, now, quorum_id=quorum_id, guard_verdict=body)
    return found


# --- guard verdicts ----------------------------------------------------------------------------------------------
def test_an_offence_counts_once_when_half_of_its_quorum_reported_it():
    checks, members = IntegrityChecks(max_offences=3), Members("0", "1", "2", "3")
    form(checks, members, 1, max_step=9)
    body = verdict(1, "2")
    assert report(checks, members, "0", quorum_id=1, guard_verdict=body) == []  # 1 of 4: not yet
    assert report(checks, members, "0", quorum_id=1, guard_verdict=body) == []  # the same reporter again: still 1
    assert checks.guard_offences == {}
    [found] = report(checks, members, "1", quorum_id=1, guard_verdict=body)  # 2 of 4 = half: counted
    assert (found.kind, found.group, found.evict) == ("guard", "2", None)
    assert "norm_outlier: gradient norm 1e+03 vs median 1 of the others at step 9 in quorum 1" in found.reason
    assert "counted once 2 of its 4 groups reported it" in found.reason and found.outcome.startswith(
        "offence counted: 1 offence"
    )
    assert report(checks, members, "3", quorum_id=1, guard_verdict=body) == []  # counted once per quorum
    assert report(checks, members, "2", quorum_id=1, guard_verdict=body) == []
    assert checks.status().guard_offences == {"2": 1}


@pytest.mark.parametrize(("n", "needed"), [(1, 1), (2, 1), (3, 2), (4, 2), (5, 3)])
def test_reporters_needed_is_half_of_the_quorum_rounded_up(n: int, needed: int):
    groups = [str(i) for i in range(n)]
    checks, members = IntegrityChecks(), Members(*groups)
    form(checks, members, 1, max_step=0)
    counted = []
    for i, g in enumerate(groups):
        if report(checks, members, g, quorum_id=1, guard_verdict=verdict(1, "0")):
            counted.append(i + 1)
    assert counted == [needed]


def test_k_offences_within_the_window_evict_with_what_was_seen():
    checks, members = IntegrityChecks(max_offences=3, window_s=600), Members("0", "1", "2")
    outcomes = []
    for i, now in enumerate((0.0, 100.0, 200.0), start=1):
        found = guard_round(checks, members, i, "01", now)
        assert [f.group for f in found] == ["2"]
        outcomes.append(found[0])
    assert outcomes[0].evict is None and outcomes[1].evict is None
    last = outcomes[2]
    assert last.evict == "2" and last.outcome.startswith("evicted: 3 offence(s) within 600s")
    assert last.evict_reason == (
        "gradient_guard: norm_outlier in 3 step(s) within 600s (steps 10, 20, 30); last: gradient norm 1e+03 vs "
        "median 1 of the others"
    )
    status = checks.status()
    assert status.guard_offences == {"2": 3} and status.guard_evictions == {"2": 1}


def test_offences_older_than_the_window_do_not_count():
    checks, members = IntegrityChecks(max_offences=3, window_s=60), Members("0", "1", "2")
    assert guard_round(checks, members, 1, "01", now=0.0)[0].evict is None
    assert guard_round(checks, members, 2, "01", now=50.0)[0].evict is None
    found = guard_round(checks, members, 3, "01", now=100.0)  # the first one expired: 2 within the window
    assert found[0].evict is None and "2 offence(s) within 60s" in found[0].outcome
    found = guard_round(checks, members, 4, "01", now=105.0)
    assert found[0].evict == "2" and "3 offence(s) within 60s" in found[0].outcome
    assert "(steps 20, 30, 40)" in found[0].evict_reason


def test_a_new_incarnation_starts_with_a_clean_tally_and_a_gone_offender_is_only_counted():
    checks, members = IntegrityChecks(max_offences=2), Members("0", "1", "2")
    guard_round(checks, members, 1, "01", now=0.0)
    members.live["2"] = "inc-2-new"  # the group restarted: the old incarnation's offence is not the new one's
    found = guard_round(checks, members, 2, "01", now=1.0)
    assert found[0].evict is None and "1 offence(s)" in found[0].outcome
    form(checks, members, 3, max_step=3)
    del members.live["2"]  # its second offence is reported after it left: counted, nobody to evict
    report(checks, members, "0", quorum_id=3, guard_verdict=verdict(3, "2"))
    found = report(checks, members, "1", quorum_id=3, guard_verdict=verdict(3, "2"))
    assert found[0].evict is None and "no longer a member: nobody to evict" in found[0].outcome
    assert checks.status().guard_offences == {"2": 3} and checks.status().guard_evictions == {}


def test_reports_that_do_not_fit_are_ignored_not_refused():
    """An honest trainer can report a quorum this lighthouse forgot (it restarted): the report is dropped, the
    request is served, and a 'refused' finding says why."""
    checks, members = IntegrityChecks(max_offences=1), Members("0", "1", "2")
    [unknown] = report(checks, members, "0", quorum_id=7, guard_verdict=verdict(7, "2"))
    assert unknown.kind == "refused" and "does not know quorum 7" in unknown.reason and unknown.evict is None
    form(checks, members, 1, max_step=0)
    [stranger] = report(checks, members, "0", quorum_id=1, guard_verdict=verdict(1, "5"))
    assert stranger.kind == "refused" and "offender group(s) ['5'] were not members of quorum 1" in stranger.reason
    members.live["1"] = "inc-1-new"  # not the incarnation that was in quorum 1
    [reporter] = report(checks, members, "1", inc="inc-1-new", quorum_id=1, guard_verdict=verdict(1, "2"))
    assert reporter.kind == "refused" and "was not a member of quorum 1" in reporter.reason
    assert checks.status().guard_offences == {}


def test_verdicts_and_digests_no_honest_group_sends_are_refused():
    checks = IntegrityChecks()
    for req, message in (
        (request("0", quorum_id=3, guard_verdict=verdict(4, "1")), "guard_verdict.quorum_id (4) is newer than"),
        (request("0", quorum_id=3, guard_verdict=verdict(3, "1", "1")), "names group '1' twice"),
        (request("0", step=10, state_digest={"step": 11, "digest": "a"}), "state_digest.step (11) is ahead of step"),
    ):
        with pytest.raises(QuorumError, match=re.escape(message)) as e:
            checks.validate(req)
        assert e.value.status == 400


def test_only_recent_quorums_are_remembered():
    checks, members = IntegrityChecks(remember_quorums=2), Members("0")
    for qid in (1, 2, 3):
        form(checks, members, qid, max_step=qid)
    [found] = report(checks, members, "0", quorum_id=3, guard_verdict=verdict(1, "0"))
    assert found.kind == "refused" and "does not know quorum 1" in found.reason
    [found] = report(checks, members, "0", quorum_id=3, guard_verdict=verdict(3, "0"))
    assert found.kind == "guard"


# --- state digests -----------------------------------------------------------------------------------------------
def digest(checks: IntegrityChecks, members: Members, group: str, step: int, value: str) -> list:
    return report(checks, members, group, step=step, state_digest={"step": step, "digest": value})


def test_digests_are_compared_once_every_committer_sent_one_and_the_minority_is_evicted():
    checks, members = IntegrityChecks(), Members("0", "1", "2")
    form(checks, members, 1, max_step=19)  # these three commit step 20
    assert digest(checks, members, "0", 20, "aaa") == []
    assert digest(checks, members, "2", 20, "bbb") == []
    assert checks.digests_compared == 0
    [found] = digest(checks, members, "1", 20, "aaa")
    assert (found.kind, found.group, found.evict) == ("divergence", "2", "2")
    assert found.evict_reason == "divergent: digest at step 20 differs from the majority (2 of 3 groups)"
    status = checks.status()
    assert status.digests_compared == 1 and status.last_compared_step == 20 and status.divergences == {"2": 1}


def test_agreeing_digests_find_nothing_and_a_late_one_is_judged_against_the_majority():
    checks, members = IntegrityChecks(), Members("0", "1", "2", "3")
    form(checks, members, 1, max_step=9)
    for g in ("0", "1", "2"):
        assert digest(checks, members, g, 10, "same") == []
    del members.live["3"]  # it left before sending its digest: the others need not wait for it
    assert form(checks, members, 1, max_step=10) == [] and checks.digests_compared == 1
    members.live["3"] = "inc-3"  # (it came back with the same incarnation: its late digest is judged)
    [found] = digest(checks, members, "3", 10, "other")
    assert found.evict == "3" and "(3 of 4 groups)" in found.reason


def test_no_strict_majority_evicts_nobody():
    checks, members = IntegrityChecks(), Members("0", "1")
    form(checks, members, 1, max_step=4)
    digest(checks, members, "0", 5, "aaa")
    [found] = digest(checks, members, "1", 5, "bbb")
    assert (found.kind, found.group, found.evict, found.outcome) == (
        "divergence",
        None,
        None,
        "no majority: nobody evicted",
    )
    assert "2 distinct of 2" in found.reason and checks.status().divergences == {}


def test_without_a_record_of_the_committers_digests_are_compared_at_the_next_quorum():
    """A lighthouse that started after the step was committed does not know who committed it."""
    checks, members = IntegrityChecks(), Members("0", "1", "2")
    assert digest(checks, members, "0", 30, "x") == []
    assert digest(checks, members, "1", 30, "x") == []
    assert digest(checks, members, "2", 30, "y") == []
    assert form(checks, members, 5, max_step=30) == []  # (a digest may ride on the request after the next)
    [found] = form(checks, members, 5, max_step=31)
    assert found.evict == "2" and checks.digests_compared == 1


def test_a_committer_that_sends_no_digest_is_not_waited_for_past_its_step():
    checks, members = IntegrityChecks(), Members("0", "1", "2")
    form(checks, members, 1, max_step=19)  # all three commit step 20; group 2 never sends its digest
    digest(checks, members, "0", 20, "aaa")
    digest(checks, members, "1", 20, "aaa")
    assert form(checks, members, 1, max_step=20) == [] and checks.digests_compared == 0
    assert form(checks, members, 1, max_step=21) == [] and checks.digests_compared == 1
    [found] = digest(checks, members, "2", 20, "bbb")  # it comes after all: judged against the majority
    assert found.evict == "2" and "(2 of 3 groups)" in found.reason


def test_one_digest_alone_is_not_compared_and_old_steps_are_let_go():
    checks, members = IntegrityChecks(keep_steps=2), Members("0", "1")
    form(checks, members, 1, max_step=0)
    assert digest(checks, members, "0", 1, "a") == []
    assert form(checks, members, 1, max_step=1) == [] and checks.digests_compared == 0  # one reporter: wait
    digest(checks, members, "0", 2, "a")
    digest(checks, members, "1", 1, "a")  # step 1 is complete now
    assert checks.digests_compared == 1
    for step in (3, 4, 5):
        digest(checks, members, "0", step, "a")
    assert checks.steps_kept == 2  # bounded
    assert digest(checks, members, "1", 1, "zzz") == []  # too old: not kept any more
