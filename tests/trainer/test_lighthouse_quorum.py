"""Unit tests of the lighthouse's quorum rule (pure logic: QuorumCore with an explicit clock)."""

from __future__ import annotations

from typing import Any

import pytest
from ftjob.contract.lighthouse_api import QuorumRequest
from ftjob.lighthouse.core.quorum import QuorumCore, QuorumError


def ask(core: QuorumCore, group: str, step: int = 0, now: float = 0.0, inc: str | None = None, **extra: Any) -> None:
    req = QuorumRequest(
        group=group,
        incarnation=inc or f"inc-{group}",
        step=step,
        quorum_id=extra.pop("quorum_id", -1),
        address=f"10.0.0.{group}:1",
        store_address=f"10.0.0.{group}:2",
        **extra,
    )
    core.request(req, now)


def core(min_replicas: int = 1, join: float = 1.0, hb: float = 5.0, **kw: int) -> QuorumCore:
    return QuorumCore(min_replicas=min_replicas, join_timeout_s=join, heartbeat_timeout_s=hb, **kw)


def test_first_quorum_waits_for_min_replicas_then_forms():
    c = core(min_replicas=2)
    ask(c, "0")
    assert c.poll(0.0) is None
    assert "min_replicas" in c.blocked_reason
    ask(c, "1")
    formed = c.poll(0.0)
    assert formed is not None and formed.groups == ("0", "1") and formed.quorum_id == 1
    assert formed.responses["1"].replica_rank == 1 and formed.responses["0"].replica_world_size == 2


def test_join_timeout_waits_for_live_groups_that_have_not_asked():
    c = core(min_replicas=1, join=2.0)
    c.heartbeat("2", "inc-2", 0, now=0.0)  # alive, not asking yet
    ask(c, "0")
    ask(c, "1")
    assert c.poll(0.5) is None and "join timeout" in c.blocked_reason
    assert c.poll(1.9) is None
    formed = c.poll(2.6)
    assert formed is not None and formed.groups == ("0", "1")


def test_previous_members_all_asking_issue_at_once_with_new_joiner():
    c = core(min_replicas=1, join=10.0)
    ask(c, "0")
    ask(c, "1")
    first = c.poll(0.0)
    assert first is not None
    c.heartbeat("2", "inc-2", 0, now=0.1)  # alive but not asking: must not delay the previous members
    ask(c, "0", step=1, now=0.2)
    ask(c, "1", step=1, now=0.2)
    second = c.poll(0.2)
    assert second is not None and second.groups == ("0", "1")
    assert second.quorum_id == first.quorum_id and not second.changed  # same members: same id, no rebuild
    ask(c, "2", step=0, now=0.3)
    ask(c, "0", step=2, now=0.3)
    ask(c, "1", step=2, now=0.3)
    third = c.poll(0.3)
    assert third is not None and third.groups == ("0", "1", "2") and third.quorum_id == first.quorum_id + 1


def test_split_brain_guard_needs_a_majority_of_live_groups():
    c = core(min_replicas=1, join=0.0)
    for g in ("0", "1", "2"):
        c.heartbeat(g, f"inc-{g}", 0, now=0.0)
    ask(c, "0")
    assert c.poll(5.0) is None and "split-brain" in c.blocked_reason  # 1 of 3 is no majority, even after timeout
    ask(c, "1")
    formed = c.poll(5.0)
    assert formed is not None and formed.groups == ("0", "1")


def test_heartbeat_timeout_drops_group_and_aborts_its_quorum():
    c = core(min_replicas=1, hb=2.0)
    ask(c, "0")
    ask(c, "1")
    formed = c.poll(0.0)
    assert formed is not None and c.abort_below == 0
    c.heartbeat("0", "inc-0", 1, now=1.5)
    assert c.sweep(2.5) == ["1"]
    assert c.abort_below == formed.quorum_id + 1  # the in-flight quorum must abort
    ask(c, "0", step=1, now=2.6)
    nxt = c.poll(2.6)
    assert nxt is not None and nxt.groups == ("0",) and nxt.quorum_id >= c.abort_below


def test_commit_failure_changes_quorum_id_even_with_same_members():
    c = core()
    ask(c, "0")
    ask(c, "1")
    q1 = c.poll(0.0)
    ask(c, "0", commit_failures=1)
    ask(c, "1", commit_failures=1)
    q2 = c.poll(0.0)
    assert q1 is not None and q2 is not None and q2.quorum_id == q1.quorum_id + 1 and q2.changed


def test_evict_bans_incarnation_aborts_quorum_and_unknown_group_is_404_without_change():
    c = core()
    ask(c, "0")
    ask(c, "1")
    q = c.poll(0.0)
    assert q is not None
    with pytest.raises(QuorumError) as e:
        c.evict(["1", "7"], "pod failed", 0.1)
    assert e.value.status == 404 and "1" in c.members  # nothing changed
    assert c.evict(["1"], "pod failed", 0.1) == ["1"]
    assert "1" not in c.members and c.abort_below == q.quorum_id + 1
    with pytest.raises(QuorumError) as e:
        ask(c, "1", now=0.2)  # the evicted process may not come back
    assert e.value.status == 410
    ask(c, "1", now=0.2, inc="inc-1-restarted")  # a restarted process may
    assert c.members["1"].incarnation == "inc-1-restarted"


def test_behind_groups_heal_from_up_to_date_members_round_robin():
    c = core()
    ask(c, "0", step=5)
    ask(c, "1", step=5)
    ask(c, "2", step=0)
    ask(c, "3", step=3)
    q = c.poll(0.0)
    assert q is not None and q.max_step == 5 and q.heals == 2
    r = q.responses
    assert not r["0"].heal and r["2"].heal and r["3"].heal
    assert {r["2"].recover_from.group, r["3"].recover_from.group} == {"0", "1"}
    assert r["0"].serve_recovery and r["1"].serve_recovery
    assert not r["2"].contributing and r["0"].num_contributors == 2  # healers contribute nothing this step


def test_spares_do_not_contribute_and_one_is_promoted_when_a_contributor_goes():
    c = core()
    c.set_desired(2)
    for g in ("0", "1", "2"):
        ask(c, g, step=4)
    q = c.poll(0.0)
    assert q is not None
    assert [q.responses[g].contributing for g in ("0", "1", "2")] == [True, True, False]
    assert q.responses["2"].contributor_rank == -1 and q.responses["1"].num_contributors == 2
    c.evict(["0"], "node lost", 0.1)
    ask(c, "1", step=4, now=0.2)
    ask(c, "2", step=4, now=0.2)
    q2 = c.poll(0.2)
    assert q2 is not None and q2.responses["2"].contributing and q2.responses["1"].contributing
    assert q2.responses["1"].contributor_rank == 0 and q2.responses["2"].contributor_rank == 1


def test_restored_ids_keep_increasing_and_committed_step_is_a_floor():
    c = core(quorum_id=40, committed_step=10)
    ask(c, "0", step=7, quorum_id=42)
    assert c.poll(0.0) is None and "committed step 10" in c.blocked_reason  # never train from below step 10
    ask(c, "1", step=10, quorum_id=42)
    q = c.poll(0.0)
    assert q is not None and q.quorum_id == 43 and q.responses["0"].heal


def test_a_floor_restored_from_the_operator_holds_for_its_window_then_gives_way():
    c = QuorumCore(
        min_replicas=1, join_timeout_s=0.0, heartbeat_timeout_s=100.0, committed_step=10, step_floor_until=5.0
    )
    ask(c, "0", step=3)
    assert c.poll(4.9) is None and "committed step 10" in c.blocked_reason  # a survivor may still come back
    q = c.poll(5.0)  # none did: the best asker's state is all there is
    assert q is not None and q.max_step == 3 and c.committed_step == 3


def test_a_restored_floor_gives_way_at_once_when_every_group_is_back_without_it():
    c = QuorumCore(
        min_replicas=1, join_timeout_s=0.0, heartbeat_timeout_s=100.0, committed_step=10, step_floor_until=120.0
    )
    c.group_limit = 2
    ask(c, "0", step=4)
    assert c.poll(1.0) is None  # group 1 may still come back holding step 10
    ask(c, "1", step=6)
    q = c.poll(1.5)  # the job has no other group: nobody can
    assert q is not None and q.max_step == 6 and c.last_restore is not None and c.last_restore.from_step == 10


def test_a_confirmed_restored_floor_holds_while_a_group_holding_it_lives():
    c = QuorumCore(
        min_replicas=1, join_timeout_s=0.0, heartbeat_timeout_s=100.0, committed_step=10, step_floor_until=5.0
    )
    ask(c, "0", step=10)
    assert c.poll(1.0) is not None and c.step_floor_until is None
    ask(c, "1", step=2, inc="new")
    ask(c, "2", step=2, inc="new")
    assert c.poll(50.0) is None and "committed step 10" in c.blocked_reason  # group 0 holds it: no window ends this
    c.evict(["0"], "test", 51.0)
    q = c.poll(51.0)  # nobody holds step 10 any more: waiting would wait for ever
    assert q is not None and q.max_step == 2 and c.last_restore is not None
    assert (c.last_restore.from_step, c.last_restore.to_step, c.last_restore.quorum_id) == (10, 2, q.quorum_id)


def test_a_whole_job_loss_goes_on_from_the_best_checkpoint_the_groups_bring_back():
    c = core(min_replicas=2)
    for step in range(1, 8):  # both groups train to step 7
        ask(c, "0", step=step, now=step)
        ask(c, "1", step=step, now=step)
        assert c.poll(step) is not None
    ask(c, "0", step=5, now=8.0, inc="0-new")  # every group replaced: group 0 resumed a checkpoint of step 5 ...
    assert c.poll(8.0) is None  # ... while the old group 1, which holds step 7, is still a member
    ask(c, "1", step=3, now=8.5, inc="1-new")  # group 1's newest intact checkpoint is older
    q = c.poll(8.5)
    assert q is not None and q.max_step == 5 and q.responses["1"].heal and not q.responses["0"].heal
    assert c.committed_step == 5 and c.status(8.5).max_step == 5
    restored = c.status(8.5).last_restore
    assert restored is not None and (restored.from_step, restored.to_step) == (7, 5)
    assert restored in c.status(8.5).history


def test_a_member_of_the_last_quorum_holds_the_committed_step_even_before_it_reports_it():
    c = core(min_replicas=1, join=0.0)
    ask(c, "0", step=4)
    ask(c, "1", step=0)  # behind: heals into step 4 during the quorum
    ask(c, "2", step=4)
    assert c.poll(0.0) is not None
    ask(c, "0", step=2, now=1.0, inc="0-new")  # groups 0 and 2 lost; group 1 (healed, not asking yet) holds step 4
    ask(c, "2", step=2, now=1.0, inc="2-new")
    assert c.poll(1.0) is None and c.last_restore is None and "committed step 4" in c.blocked_reason
    ask(c, "1", step=4, now=1.5)
    q = c.poll(1.5)
    assert q is not None and q.max_step == 4 and c.last_restore is None


def test_a_replacement_lighthouse_waits_for_every_group_from_the_first_contact():
    # The lost lighthouse's step in flight may have committed in group 0 and failed in group 1: if group 1 came back
    # first and trained that step alone, both would hold the next step through different updates and never heal.
    c = core(min_replicas=1, join=1.0, quorum_id=40, committed_step=30)
    c.group_limit = 2
    c.expect_back(["0", "1"])
    assert c.poll(50.0) is None  # nobody back yet
    ask(c, "1", step=31, now=100.0)  # long after start-up: the wait counts from the first contact
    assert c.poll(100.5) is None and "join timeout" in c.blocked_reason
    ask(c, "0", step=32, now=100.6)
    q = c.poll(100.6)
    assert q is not None and q.groups == ("0", "1") and q.max_step == 32 and q.responses["1"].heal


def test_a_replacement_lighthouse_goes_on_without_a_group_that_does_not_come_back():
    c = core(min_replicas=1, join=1.0, quorum_id=40, committed_step=30)
    c.group_limit = 2
    c.expect_back(["0", "1"])
    ask(c, "0", step=31, now=10.0)
    assert c.poll(10.9) is None
    q = c.poll(11.1)  # group 1 died with the lighthouse: the survivor trains on after the join timeout
    assert q is not None and q.groups == ("0",)
    ask(c, "1", step=0, inc="replacement", now=12.0)  # its replacement is a normal late joiner: no wait for others
    ask(c, "0", step=32, now=12.0, quorum_id=41)
    q = c.poll(12.0)
    assert q is not None and q.groups == ("0", "1") and q.responses["1"].heal


def test_new_incarnation_replaces_and_bans_the_old_one():
    c = core()
    c.heartbeat("0", "old", 0, now=0.0)
    c.heartbeat("0", "new", 0, now=0.1)
    with pytest.raises(QuorumError) as e:
        c.heartbeat("0", "old", 0, now=0.2)
    assert e.value.status == 410 and c.members["0"].incarnation == "new"


def test_finished_groups_are_kept_for_status_and_not_waited_for():
    c = core(join=100.0, hb=1.0)
    ask(c, "0")
    ask(c, "1")
    assert c.poll(0.0) is not None
    c.heartbeat("1", "inc-1", 3, now=0.5, finished=True, digest="abc")
    ask(c, "0", step=3, now=0.6)
    assert c.poll(0.6) is not None  # a finished group is not a live group to wait for
    c.sweep(10.0)
    status = c.status(10.0)
    assert [m.group for m in status.members] == ["1"] and status.members[0].param_digest == "abc"


def test_forming_12500_groups_is_linear_enough():
    """Correctness at scale (speed is measured in hack/bench/bench_lighthouse.py)."""
    c = core(min_replicas=1)
    n = 12_500
    for g in range(n):
        ask(c, str(g), step=1 if g % 2 else 0)
    q = c.poll(0.0)
    assert q is not None and len(q.groups) == n and q.heals == n // 2
    assert q.responses["12499"].replica_rank == n - 1 and q.responses["2"].replica_rank == 2


def test_fresh_groups_copy_one_reference_at_step_0_and_still_contribute():
    c = core()
    for g in ("0", "1", "2"):
        ask(c, g, fresh=True)
    q = c.poll(0.0)
    assert q is not None and q.heals == 2
    r = q.responses
    assert not r["0"].heal and r["0"].serve_recovery  # the first asker is the reference
    assert r["1"].heal and r["2"].heal and r["1"].recover_from and r["1"].recover_from.group == "0"
    assert all(r[g].contributing for g in "012") and r["0"].num_contributors == 3  # they heal before training
    # the first step failed; a fresh group joins the retry: it copies a group already synced, nobody else heals
    ask(c, "0", commit_failures=1, now=0.1)
    ask(c, "1", commit_failures=1, now=0.1)
    ask(c, "2", commit_failures=1, now=0.1)
    ask(c, "3", fresh=True, now=0.1)
    q2 = c.poll(0.1)
    assert q2 is not None and q2.heals == 1 and q2.responses["3"].recover_from is not None
    assert q2.responses["3"].recover_from.group == "0" and not q2.responses["1"].heal


def test_no_step_0_sync_past_step_0_or_without_fresh_groups():
    c = core()
    ask(c, "0")
    ask(c, "1")
    q = c.poll(0.0)
    assert q is not None and q.heals == 0
    ask(c, "0", step=1, now=0.1)
    ask(c, "1", step=1, now=0.1, fresh=True)  # past step 0 "fresh" means nothing
    q = c.poll(0.1)
    assert q is not None and q.heals == 0


def test_handover_replaces_a_group_without_aborting_and_the_survivors_go_on_at_once():
    c = core(join=30.0)  # a long join timeout: forming "at once" below cannot be the timeout passing
    for g in "012":
        ask(c, g, step=7)
    q = c.poll(0.0)
    assert q is not None and q.groups == ("0", "1", "2") and c.abort_below == 0
    assert c.handover(["1"], "node degrading", 0.1) == ["1"]
    assert c.status(0.1).handing_over == ["1"] and c.abort_below == 0  # marking alone changes nothing else
    c.heartbeat("1", "inc-1-new", 0, now=0.2)  # the new incarnation's pods come up elsewhere, at step 0
    assert c.abort_below == 0  # the quorum in flight, old incarnation included, completes and commits
    assert c.status(0.2).handing_over == [] and c.members["1"].incarnation == "inc-1-new"
    assert c.history[-1].reason == "handed_over: node degrading"
    with pytest.raises(QuorumError) as e:
        ask(c, "1", step=8, now=0.3)  # the old incarnation, done with its step: banned
    assert e.value.status == 410
    ask(c, "0", step=8, now=0.3)
    assert c.poll(0.3) is None  # group 2 of the last quorum is still to ask (fast path: wait for it, no timeout)
    ask(c, "2", step=8, now=0.3)
    q2 = c.poll(0.3)  # at once: neither the old incarnation nor the new one (still starting) is waited for
    assert q2 is not None and q2.groups == ("0", "2") and q2.changed and q2.quorum_id == q.quorum_id + 1
    assert c.abort_below == 0 and q2.responses["0"].abort_below == 0
    ask(c, "1", step=0, now=0.4, inc="inc-1-new", fresh=True)  # the new incarnation asks: it rides along, healing
    ask(c, "0", step=9, now=0.5)
    ask(c, "2", step=9, now=0.5)
    q3 = c.poll(0.5)
    assert q3 is not None and q3.groups == ("0", "1", "2") and q3.max_step == 9
    heal = q3.responses["1"]
    assert heal.heal and heal.recover_from is not None and heal.recover_from.group in ("0", "2")
    assert heal.recover_from.step == 9 and not heal.contributing and q3.responses["0"].num_contributors == 2
    assert c.abort_below == 0


def test_handover_of_two_groups_forms_from_the_last_survivor_alone_and_passes_the_split_brain_guard():
    c = core(join=30.0)
    ask(c, "0", step=3)
    ask(c, "1", step=3)
    q = c.poll(0.0)
    assert q is not None
    c.handover(["1"], "", 0.1)
    c.heartbeat("1", "new", 0, now=0.2)  # alive but not asking: not counted against group 0's majority
    ask(c, "0", step=4, now=0.3)
    q2 = c.poll(0.3)
    assert q2 is not None and q2.groups == ("0",) and c.abort_below == 0
    assert c.history[-2].reason == "handed_over"


def test_the_new_incarnation_is_not_waited_for_even_when_the_last_quorum_lost_another_member():
    c = core(join=5.0, hb=2.0)
    for g in "012":
        ask(c, g, step=3)
    q = c.poll(0.0)
    assert q is not None
    c.handover(["1"], "migrate", 0.1)
    c.heartbeat("1", "new", 0, now=0.2)
    c.heartbeat("0", "inc-0", 3, now=1.5)
    c.heartbeat("1", "new", 0, now=1.5)
    assert c.sweep(2.5) == ["2"] and c.abort_below == q.quorum_id + 1  # group 2 died: that aborts, as always
    ask(c, "0", step=3, now=2.6)
    q2 = c.poll(2.6)  # no live group but the quiet new incarnation is missing: no join-timeout wait
    assert q2 is not None and q2.groups == ("0",)


def test_without_a_handover_a_new_incarnation_aborts_the_quorum_in_flight_and_is_waited_for():
    c = core(join=2.0)
    ask(c, "0", step=3)
    ask(c, "1", step=3)
    q = c.poll(0.0)
    assert q is not None
    c.heartbeat("1", "new", 0, now=0.1)
    assert c.abort_below == q.quorum_id + 1 and c.history[-1].reason == "restarted"
    ask(c, "0", step=3, now=0.2)
    assert c.poll(0.2) is None  # split-brain guard / join timeout: the new incarnation counts as live and missing
    ask(c, "1", step=0, now=0.3, inc="new")
    q2 = c.poll(0.3)
    assert q2 is not None and q2.groups == ("0", "1") and q2.responses["1"].heal


def test_handover_of_an_unknown_or_foreign_group_is_refused_and_changes_nothing():
    c = core()
    c.set_desired(2, groups=3)
    ask(c, "0")
    ask(c, "1")
    q = c.poll(0.0)
    assert q is not None
    with pytest.raises(QuorumError) as e:
        c.handover(["1", "2"], "x", 0.1)  # "2" is a valid id the lighthouse never saw
    assert e.value.status == 404 and "unknown replica group" in str(e.value)
    with pytest.raises(QuorumError) as e:
        c.handover(["1", "5"], "x", 0.1)  # outside the job's groups
    assert e.value.status == 403
    assert c.status(0.1).handing_over == []
    c.heartbeat("1", "new", 0, now=0.2)  # no mark was left behind: a plain restart, which aborts
    assert c.abort_below == q.quorum_id + 1
    with pytest.raises(QuorumError) as e:
        c.heartbeat("5", "x", 0, now=0.3)
    assert e.value.status == 403


def test_a_handover_mark_lapses_if_no_new_incarnation_comes_and_only_the_first_one_consumes_it():
    c = core()
    ask(c, "0")
    ask(c, "1")
    assert c.poll(0.0) is not None
    c.handover(["1"], "x", 1.0)
    assert c.status(500.0).handing_over == ["1"]
    c.sweep(1.0 + c.handover_timeout_s)
    assert c.status(1.0 + c.handover_timeout_s).handing_over == []
    c.heartbeat("1", "new", 0, now=602.0)  # too late: a plain restart again
    assert c.abort_below > 0
    c2 = core()
    ask(c2, "0")
    ask(c2, "1")
    q = c2.poll(0.0)
    assert q is not None
    c2.handover(["1"], "x", 0.1)
    c2.heartbeat("1", "inc-1", 0, now=0.2)  # the marked incarnation itself keeps beating: the mark stays
    assert c2.status(0.2).handing_over == ["1"]
    c2.heartbeat("1", "new", 0, now=0.3)
    assert c2.abort_below == 0 and c2.status(0.3).handing_over == []
    c2.heartbeat("1", "newer", 0, now=0.4)  # the mark was used up: another restart is an ordinary one
    assert "1" in c2.members and c2.members["1"].incarnation == "newer"


def test_a_group_that_leaves_after_committing_lets_the_survivors_go_on_at_once_without_an_abort():
    c = core(join=30.0)  # a long join timeout: forming "at once" below cannot be the timeout passing
    for g in "012":
        ask(c, g, step=7)
    q = c.poll(0.0)
    assert q is not None and q.groups == ("0", "1", "2")
    assert c.leave("1", "inc-1", 8, now=0.1)  # SIGTERM: it committed step 7 -> 8 with the others, then left
    assert "1" not in c.members and c.history[-1].reason == "left" and c.abort_below == 0
    ask(c, "0", step=8, now=0.2)
    assert c.poll(0.2) is None  # group 2 of the last quorum is still to ask: it is waited for, group 1 is not
    ask(c, "2", step=8, now=0.2)
    q2 = c.poll(0.2)
    assert q2 is not None and q2.groups == ("0", "2") and q2.changed and q2.quorum_id == q.quorum_id + 1
    assert c.abort_below == 0 and q2.responses["0"].num_contributors == 2
    with pytest.raises(QuorumError) as e:
        c.heartbeat("1", "inc-1", 8, now=0.3)  # a last heartbeat of the process that left must not re-register it
    assert e.value.status == 410 and "1" not in c.members
    assert not c.leave("1", "inc-1", 8, now=0.4)  # a repeated leave changes nothing
    c.heartbeat("1", "inc-1-new", 0, now=0.5)  # its replacement joins as any new incarnation
    assert c.members["1"].incarnation == "inc-1-new"


def test_a_group_that_leaves_inside_the_step_in_flight_aborts_it_as_a_disconnect_would():
    c = core(join=30.0)
    for g in "01":
        ask(c, g, step=4)
    q = c.poll(0.0)
    assert q is not None
    assert c.leave("1", "inc-1", 4, now=0.1)  # still at step 4: the quorum's step 4 was never committed by it
    assert c.abort_below == q.quorum_id + 1 and c.history[-1].reason == "left"
    ask(c, "0", step=4, now=0.2)
    q2 = c.poll(0.2)  # no live group missing: at once
    assert q2 is not None and q2.groups == ("0",) and q2.quorum_id > q.quorum_id
