"""Goodput accounting on a synthetic timeline with exactly computable figures (no cluster)."""

from __future__ import annotations

import json

import pytest
from ftjob.operator.lighthouse.view import LighthouseView
from ftjob.operator.planning import goodput as G
from ftjob.operator.reconcile import progress
from ftjob.operator.runtime import operator_metrics as metrics
from prometheus_client import REGISTRY

C, S, H, F = G.CONTRIBUTING, G.SPARE, G.HEALING, G.FAILED
T0 = 1_000.0


def _timeline() -> list[G.Sample]:
    """2 contributors + 1 spare, polls every 2 s, a step every 0.5 s while healthy."""
    out = []
    t, step = T0, 0
    ok = {0: C, 1: C, 2: S}
    # start-up: 10 s before the first quorum, then the first quorum at step 0
    for _ in range(5):
        t += 2
        out.append(G.Sample(t=t, step=None, groups={0: G.STARTING, 1: G.STARTING, 2: G.STARTING}))
    t += 2
    out.append(G.Sample(t=t, step=0, quorum=["0", "1", "2"], groups=ok))
    for _ in range(10):  # 20 s healthy: 4 steps per poll
        t += 2
        step += 4
        out.append(G.Sample(t=t, step=step, quorum=["0", "1", "2"], groups=ok))
    # group 1 fails: 4 s stall (restart counted), the spare is promoted; group 1 is replaced and heals 4 s
    t += 2
    out.append(G.Sample(t=t, step=step, quorum=["0", "2"], groups={0: C, 1: F, 2: C}, restarts=1))
    t += 2
    out.append(G.Sample(t=t, step=step, quorum=["0", "2"], groups={0: C, 1: F, 2: C}, restarts=1))
    for _ in range(2):
        t += 2
        out.append(G.Sample(t=t, step=step, quorum=["0", "1", "2"], groups={0: C, 1: H, 2: C}, restarts=1))
    healed = {0: C, 1: S, 2: C}
    for _ in range(5):  # 10 s healthy again
        t += 2
        step += 4
        out.append(G.Sample(t=t, step=step, quorum=["0", "1", "2"], groups=healed, restarts=1))
    # below minimum: 6 s paused
    for _ in range(3):
        t += 2
        out.append(G.Sample(t=t, step=step, quorum=[], groups={0: C, 1: S, 2: C}, restarts=1, below_minimum=True))
    return out


def _run(samples: list[G.Sample], restart_at: int | None = None) -> dict:
    g = None
    for i, s in enumerate(samples):
        if i == restart_at:
            g = json.loads(json.dumps(g))  # what status round-trips through the apiserver
        g = G.advance(g, s, T0)
    return g


def test_synthetic_timeline_gives_exact_goodput_and_badput():
    g = _run(_timeline())
    # 12 s start-up (5 polls without a lighthouse + the first quorum's baseline poll); 60 s in all
    assert g["elapsedSeconds"] == pytest.approx(12 + 20 + 8 + 10 + 6)
    assert g["stepSeconds"] == pytest.approx(0.5)
    assert g["productiveSeconds"] == pytest.approx(30)
    b = g["badputSeconds"]
    assert b["startup"] == pytest.approx(12)
    assert b["failureStall"] == pytest.approx(4)
    assert b["rejoin"] == pytest.approx(4)
    assert b["belowMinimum"] == pytest.approx(6)
    assert b["other"] == pytest.approx(0)
    assert g["productiveSeconds"] + sum(b.values()) == pytest.approx(g["elapsedSeconds"])
    assert g["ratio"] == pytest.approx(30 / 56) and g["percent"] == f"{100 * 30 / 56:.1f}%"
    gs = g["badputGroupSeconds"]
    assert g["groupSeconds"] == pytest.approx(3 * 56)
    assert g["productiveGroupSeconds"] == pytest.approx(2 * 30)
    assert gs["startup"] == pytest.approx(3 * 12)
    # the spare before its promotion (half the poll it happened in: the moment is unknown), the replaced group after
    assert gs["spareIdle"] == pytest.approx(20 + 1 + 10)
    assert gs["failureStall"] == pytest.approx(2 * 4 + 4 - 1)  # the contributors stall, the failed group is down
    assert gs["rejoin"] == pytest.approx(2 * 4 + 4)  # the contributors wait on the healer, which heals
    assert gs["belowMinimum"] == pytest.approx(3 * 6)
    assert g["productiveGroupSeconds"] + sum(gs.values()) == pytest.approx(g["groupSeconds"])
    assert g["groupRatio"] == pytest.approx(60 / 168)


def test_an_operator_restart_mid_run_gives_the_same_result_and_never_double_counts():
    samples = _timeline()
    assert _run(samples, restart_at=17) == _run(samples)
    g = _run(samples)
    assert G.advance(g, samples[-1], T0) == g  # the same poll again adds nothing


def test_slow_steps_are_not_badput_and_an_outage_gap_goes_to_other():
    g = G.advance(None, G.Sample(t=T0, step=0, quorum=["0"], groups={0: C}), T0)
    for k in range(1, 6):  # one step per 10 s, polls every 2 s
        for j in range(1, 6):
            g = G.advance(g, G.Sample(t=T0 + 10 * (k - 1) + 2 * j, step=k if j == 5 else k - 1,
                                      quorum=["0"], groups={0: C}), T0)  # fmt: skip
    assert g["stepSeconds"] == pytest.approx(10)
    assert g["productiveSeconds"] == pytest.approx(2 + 40)  # the first commit's poll interval, then 4 steps
    # operator down 100 s while nothing commits: 10 s (the cap) is the observed cause, the rest "other"
    g = G.advance(g, G.Sample(t=T0 + 150, step=5, quorum=[], groups={0: F}, restarts=1), T0)
    assert g["badputSeconds"]["failureStall"] == pytest.approx(10)
    assert g["badputSeconds"]["other"] == pytest.approx(90)


def test_elapsed_freezes_when_the_job_ends():
    g = _run(_timeline())
    done = G.advance(g, None, T0, end=T0 + 60)
    assert done["elapsedSeconds"] == pytest.approx(60) and done["badputSeconds"]["other"] == pytest.approx(4)
    assert G.advance(done, G.Sample(t=T0 + 99, step=999, quorum=["0"], groups={0: C}), T0, end=T0 + 60) == done


def test_history_is_bounded_and_thinned_keeping_first_and_last():
    view = LighthouseView(quorum_id=1, quorum_size=1, step=0)
    h: list = []
    for i in range(1000):
        h = progress.record(h, T0 + 2 * i, i, view)
        assert len(h) <= progress.HISTORY_MAX
    assert h[0]["t"] == T0 and h[-1]["t"] == T0 + 2 * 999 and h[-1]["step"] == 999
    assert progress.record(h, T0 + 2 * 999 + 0.5, 1000, view) == h  # too soon, same membership
    assert len(progress.record(h, T0 + 2 * 999 + 0.5, 1000, LighthouseView(quorum_id=2, quorum_size=2))) == len(h) + 1


def test_build_status_carries_goodput_and_history():
    from ftjob.operator.state.job_spec import JobSpec
    from ftjob.operator.state.job_state import JobState
    from ftjob.operator.state.status import build_status

    spec = JobSpec.from_dict({"replicas": 1, "template": {"spec": {"containers": [{"name": "t", "image": "x"}]}}})
    kw = dict(job="j", spec=spec, state=JobState(), phases={}, pods=[], lighthouse=None, generation=1, now=T0)
    g = _run(_timeline())
    s = build_status(previous=None, goodput=g, history=[{"t": T0, "step": 0, "quorum": 0, "groups": {}}], **kw)
    assert s["goodput"]["percent"] == g["percent"] and len(s["history"]) == 1
    assert build_status(previous=s, **kw)["goodput"] == g  # kept when nothing new


def test_metrics_are_set_and_removed():
    g = _run(_timeline())
    metrics.set_job_progress("ns", "jj", g, {"contributing": 2, "spare": 1}, 60, 2)
    got = lambda name, **lab: REGISTRY.get_sample_value(name, {"namespace": "ns", "job": "jj", **lab})  # noqa: E731
    assert got("ftjob_job_goodput_ratio", basis="wall") == pytest.approx(g["ratio"])
    assert got("ftjob_job_badput_seconds", cause="failureStall") == pytest.approx(4)
    assert got("ftjob_job_badput_group_seconds", cause="spareIdle") == pytest.approx(31)
    assert got("ftjob_job_committed_step") == 60 and got("ftjob_job_quorum_size") == 2
    assert got("ftjob_job_groups", state="spare") == 1
    metrics.forget_job("ns", "jj")
    assert got("ftjob_job_goodput_ratio", basis="wall") is None and got("ftjob_job_committed_step") is None


def test_below_minimum_means_a_group_is_held_back_not_the_lighthouse_idling_between_quorums():
    from ftjob.contract.lighthouse_api import MemberStatus
    from ftjob.operator.state.job_spec import JobSpec
    from ftjob.operator.state.job_state import JobState

    spec = JobSpec.from_dict({"replicas": 2, "minReplicas": 2,
                              "template": {"spec": {"containers": [{"name": "t", "image": "x"}]}}})  # fmt: skip

    def view(asking: bool, reason: str) -> LighthouseView:
        members = {
            g: MemberStatus(group=g, incarnation=g, step=9, address="", last_heartbeat_age_s=0.1, in_quorum=True,
                            asking=asking and g == "0", healing=False, contributing=True, finished=False)
            for g in ("0", "1")
        }  # fmt: skip
        return LighthouseView(quorum_id=3, quorum_size=2, step=9, groups=members, blocked_reason=reason)

    running = {0: "Running", 1: "Running"}
    # every group computing: the lighthouse's pending quorum has nobody asking, which is no pause
    idle = progress.sample(view(False, "waiting for min_replicas: 0 of 2 groups asking"), T0, spec, JobState(), running)
    assert not idle.below_minimum
    held = progress.sample(view(True, "waiting for min_replicas: 1 of 2 groups asking"), T0, spec, JobState(), running)
    assert held.below_minimum
    assert progress.sample(None, T0, spec, JobState(), {0: "Running", 1: "Restarting"}).below_minimum
    # the job ending (groups finished training, pods completed) is not a pause below the minimum
    ending = JobState(completing_since=T0 - 1)
    assert not progress.sample(None, T0, spec, ending, {0: "Succeeded", 1: "Succeeded"}).below_minimum


def test_training_before_the_first_poll_that_sees_a_quorum_counts_from_the_lighthouse_history():
    from ftjob.contract.lighthouse_api import QuorumEvent, StatusResponse

    # the lighthouse formed its first quorum at step 0 1.5 s before answering; 6 steps of 0.25 s landed since
    status = StatusResponse(quorum_id=1, max_step=6, abort_below=0, min_replicas=1, quorum_groups=["0", "1"],
                            members=[], starting=[], blocked_reason="", clock=500.0,
                            history=[QuorumEvent(time=498.5, quorum_id=1, groups=["0", "1"], step=0)])  # fmt: skip
    view = LighthouseView.from_status(status)
    assert view.first_quorum == (1.5, 0)
    two = {0: C, 1: C}
    first = progress._first_quorum_at(view, T0 + 10)
    s = G.Sample(t=T0 + 10, step=6, quorum=["0", "1"], groups=two, first_quorum=first)
    g = G.advance(G.advance(None, s, T0), G.Sample(t=T0 + 12, step=14, quorum=["0", "1"], groups=two), T0)
    assert g["badputSeconds"]["startup"] == pytest.approx(8.5)  # up to the first quorum, not to the first poll
    assert g["productiveSeconds"] == pytest.approx(3.5) and g["productiveGroupSeconds"] == pytest.approx(7)
    # a lighthouse that does not say its clock: the first poll's step is the baseline, as before
    old = LighthouseView.from_status(status.model_copy(update={"clock": None}))
    assert old.first_quorum is None
    g = G.advance(G.advance(None, G.Sample(t=T0 + 10, step=6, quorum=["0", "1"], groups=two), T0),
                  G.Sample(t=T0 + 12, step=14, quorum=["0", "1"], groups=two), T0)  # fmt: skip
    assert g["badputSeconds"]["startup"] == pytest.approx(10) and g["productiveSeconds"] == pytest.approx(2)


def test_a_group_that_fails_or_finishes_between_polls_is_credited_its_share_of_the_interval():
    q = ["0", "1"]
    samples = [
        G.Sample(t=T0 + 2, step=0, quorum=q, groups={0: C, 1: C}),
        G.Sample(t=T0 + 4, step=8, quorum=q, groups={0: C, 1: C}),
        G.Sample(t=T0 + 6, step=16, quorum=["0"], groups={0: C, 1: F}, restarts=1),  # group 1 died in there
        G.Sample(t=T0 + 8, step=24, quorum=["0"], groups={0: C, 1: F}, restarts=1),
        G.Sample(t=T0 + 10, step=32, quorum=["0"], groups={0: G.FINISHED, 1: F}, restarts=1),  # 0 trained to the end
    ]
    g = _run(samples)
    assert g["productiveSeconds"] == pytest.approx(8)
    # both groups 2 s, then group 1 half of the poll it died in, then group 0 alone up to its last step
    assert g["productiveGroupSeconds"] == pytest.approx(2 * 2 + 1.5 * 2 + 2 + 2)
    assert g["badputGroupSeconds"]["failureStall"] == pytest.approx(1 + 2 + 2)
    assert g["productiveGroupSeconds"] + sum(g["badputGroupSeconds"].values()) == pytest.approx(g["groupSeconds"])


def test_steps_trained_again_after_a_restore_are_lost_work_not_progress():
    ok = {0: C, 1: C}
    samples = [G.Sample(t=T0 + 2, step=0, quorum=["0", "1"], groups=ok)]
    samples += [G.Sample(t=T0 + 2 + 2 * i, step=4 * i, quorum=["0", "1"], groups=ok) for i in range(1, 6)]  # to 20
    # every group lost at once, back from a checkpoint of step 8: steps 9..20 are trained again (3 polls)
    samples += [G.Sample(t=T0 + 14 + 2 * i, step=8 + 4 * i, quorum=["0", "1"], groups=ok, replaying=True)
                for i in range(3)]  # fmt: skip
    samples += [G.Sample(t=T0 + 20 + 2 * i, step=20 + 4 * i, quorum=["0", "1"], groups=ok) for i in range(1, 3)]
    g = _run(samples)
    assert g["badputSeconds"]["lostWork"] == pytest.approx(6)
    assert g["badputGroupSeconds"]["lostWork"] == pytest.approx(12)
    assert g["productiveSeconds"] == pytest.approx(10 + 4)  # steps 0..20 once, then 20..28
