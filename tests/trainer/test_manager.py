"""The Manager end to end: real lighthouse process, 2 replica groups of a tiny nn.Linear in subprocesses, gloo over
loopback. Commit, rebuild-only-on-change, heal to bitwise-equal params, spare promotion, min_replicas, evict aborting
a hung collective, and a lighthouse restart mid-run."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

from ftjob import contract
from ftjob.contract.lighthouse_api import DroppedEvent

from tests.support.local_job import Lighthouse, Worker
from tests.support.polling import wait_for

TIMEOUT = 120  # generous: 2 shared cores, and every process imports torch


def start(procs: list, proc: Worker | Lighthouse) -> Worker | Lighthouse:
    procs.append(proc)
    return proc


def committed_steps(worker: Worker) -> list[int]:
    return [e["step"] for e in worker.events("step") if e["committed"]]


def assert_steps_only_move_forward(worker: Worker) -> None:
    """Every commit moves the step by exactly one (after a heal: from the healed step); it never goes back."""
    last = 0
    for e in worker.events("step"):
        if e["committed"]:
            assert e["step"] == last + 1 or e["healed"], (worker.group, e, last)
            assert e["step"] > last
        else:
            assert e["step"] >= last
        last = e["step"]


def test_two_groups_commit_every_step_build_one_process_group_and_stay_identical(tmp_path: Path, procs: list):
    lh = start(procs, Lighthouse(tmp_path, "--min-replicas", "2").start())
    workers = [start(procs, Worker(tmp_path, lh.url, g, "--steps", "12", "--min-replicas", "2")) for g in "01"]
    done = [wait_for(w.done, TIMEOUT, f"group {w.group} to finish") for w in workers]
    assert done[0]["digest"] == done[1]["digest"]  # bitwise-identical params
    for d, w in zip(done, workers, strict=True):
        assert d["step"] == 12 and d["metrics"]["commits"] == 12 and d["metrics"]["failed_commits"] == 0
        assert d["metrics"]["pg_rebuilds"] == 1  # one membership for the whole run: one process group
        assert {e["quorum_id"] for e in w.events("step")} == {1}
        assert all(e["contributing"] and e["participants"] == 2 for e in w.events("step"))
    assert done[0]["cursor"] == 24  # 2 contributors x 12 steps: every sample position consumed once
    status = lh.status()
    assert all(m.finished and m.param_digest == done[0]["digest"] for m in status.members)


def test_late_joiner_heals_to_identical_params_and_groups_rebuild_only_on_membership_change(
    tmp_path: Path, procs: list
):
    lh = start(procs, Lighthouse(tmp_path, "--min-replicas", "1", "--join-timeout", "0.2").start())
    resume = tmp_path / "resume"
    pause = ("--pause-at-step", "5", "--resume-file", str(resume))
    first = start(procs, Worker(tmp_path, lh.url, "0", "--steps", "40", "--step-delay", "0.1", *pause))
    wait_for(lambda: first.events("paused"), TIMEOUT, "group 0 to train alone to step 5")
    late = start(procs, Worker(tmp_path, lh.url, "1", "--steps", "40", "--step-delay", "0.1"))
    wait_for(lambda: late.events("ready"), TIMEOUT, "group 1 to start")
    resume.touch()
    done = [wait_for(w.done, TIMEOUT, f"group {w.group} to finish") for w in (first, late)]
    assert done[0]["digest"] == done[1]["digest"] and done[0]["cursor"] == done[1]["cursor"]
    healed = [e for e in late.events("step") if e["healed"]]
    assert len(healed) == 1 and healed[0]["step"] >= 5 and not healed[0]["contributing"]
    assert done[1]["metrics"]["heals"] == 1
    for d, w in zip(done, (first, late), strict=True):
        assert d["metrics"]["pg_rebuilds"] == len({e["quorum_id"] for e in w.events("step")})
        assert_steps_only_move_forward(w)
    assert len({e["quorum_id"] for e in first.events("step")}) == 2  # alone, then with the joiner


def test_spare_receives_gradients_and_is_promoted_when_the_contributor_dies(tmp_path: Path, procs: list):
    lh = start(procs, Lighthouse(tmp_path, "--min-replicas", "1", "--replicas", "1").start())
    workers = {g: start(procs, Worker(tmp_path, lh.url, g, "--steps", "400", "--step-delay", "0.05")) for g in "01"}

    def both_in_quorum() -> bool:
        return all(any(e["participants"] == 2 for e in w.events("step")) for w in workers.values())

    wait_for(both_in_quorum, TIMEOUT, "both groups in one quorum")
    steps = {g: [e for e in w.events("step") if e["participants"] == 2] for g, w in workers.items()}
    contributor = "0" if steps["0"][-1]["contributing"] else "1"
    spare = "1" if contributor == "0" else "0"
    assert not steps[spare][-1]["contributing"]  # exactly one contributes, the other is a hot spare
    workers[contributor].signal(signal.SIGKILL)
    mark = len(workers[spare].events("step"))

    def spare_promoted() -> bool:
        return any(e["contributing"] and e["committed"] for e in workers[spare].events("step")[mark:])

    wait_for(spare_promoted, TIMEOUT, "the spare to become a contributor")
    assert_steps_only_move_forward(workers[spare])


def test_below_min_replicas_nothing_commits_and_training_resumes_when_groups_return(tmp_path: Path, procs: list):
    lh = start(procs, Lighthouse(tmp_path, "--min-replicas", "2", "--join-timeout", "0.2").start())
    args = ("--steps", "40", "--min-replicas", "2", "--step-delay", "0.1")
    g0 = start(procs, Worker(tmp_path, lh.url, "0", *args))

    def blocked_on_min_replicas() -> bool:
        s = lh.status()
        return "min_replicas" in s.blocked_reason and any(m.asking for m in s.members)

    wait_for(blocked_on_min_replicas, TIMEOUT, "group 0 waiting for a second group")
    assert g0.events("step") == []  # alone: not a single step committed
    g1 = start(procs, Worker(tmp_path, lh.url, "1", *args))
    wait_for(lambda: g0.last_step() >= 5, TIMEOUT, "training with two groups")
    g1.signal(signal.SIGKILL)
    # (no step count compared here: group 0 may still commit the step it shared with group 1 as the kill lands;
    # that nothing commits below min_replicas is checked on every committed step below)
    wait_for(blocked_on_min_replicas, TIMEOUT, "group 0 blocked again after group 1 died")
    g1b = start(procs, Worker(tmp_path, lh.url, "1", *args))
    done = [wait_for(w.done, TIMEOUT, f"group {w.group} to finish") for w in (g0, g1b)]
    assert done[0]["digest"] == done[1]["digest"] and done[0]["step"] == 40
    assert all(e["participants"] == 2 for e in g0.events("step") if e["committed"])  # never below min_replicas
    assert_steps_only_move_forward(g0)
    assert any(e["healed"] for e in g1b.events("step"))


def test_evict_aborts_a_hung_collective_long_before_any_timeout(tmp_path: Path, procs: list):
    # Heartbeats and collectives would take 300 s to notice, and the stall rule (which would evict the hung group
    # ~1 s in, racing the test's call) is off: only the evict call can unblock group 0 in time.
    lh = start(
        procs,
        Lighthouse(
            tmp_path, "--min-replicas", "1", "--heartbeat-timeout", "300", "--join-timeout", "60", "--stall-factor", "0"
        ).start(),
    )
    code, _ = lh.request("POST", contract.PATH_STARTING, {"groups": ["0", "1"]})  # first quorum waits for both
    assert code == 200
    common = ("--steps", "15", "--collective-timeout", "300", "--quorum-timeout", "300")
    g0 = start(procs, Worker(tmp_path, lh.url, "0", *common))
    g1 = start(procs, Worker(tmp_path, lh.url, "1", *common, "--hang-at-step", "5"))
    wait_for(lambda: g1.events("hanging"), TIMEOUT, "group 1 to hang inside step 5")
    code, body = lh.request("POST", contract.PATH_EVICT, {"groups": ["1"], "reason": "node unreachable"})
    assert code == 200 and body["evicted"] == ["1"]
    done = wait_for(g0.done, 60, "group 0 to finish without group 1")
    assert done["step"] == 15 and done["metrics"]["aborted_collectives"] >= 1
    failed = [e for e in g0.events("step") if not e["committed"]]
    assert failed and "aborted" in failed[0]["error"] and failed[0]["step"] == 5
    assert_steps_only_move_forward(g0)
    dropped = [h for h in lh.status().history if isinstance(h, DroppedEvent)]
    assert any(h.reason == "evicted: node unreachable" for h in dropped)


def test_lighthouse_killed_and_restarted_mid_run_loses_no_committed_step(tmp_path: Path, procs: list):
    state = tmp_path / "lighthouse.json"
    lh = start(
        procs, Lighthouse(tmp_path, "--min-replicas", "2", "--join-timeout", "0.3", "--state-file", str(state)).start()
    )
    args = ("--steps", "50", "--min-replicas", "2", "--step-delay", "0.05")
    workers = [start(procs, Worker(tmp_path, lh.url, g, *args)) for g in "01"]
    wait_for(lambda: all(w.last_step() >= 10 for w in workers), TIMEOUT, "training to reach step 10")
    lh.kill()
    before = {w.group: w.last_step() for w in workers}
    id_before = max(e["quorum_id"] for w in workers for e in w.events("step"))
    lh.start()  # same port and state file; the managers keep retrying meanwhile
    done = [wait_for(w.done, TIMEOUT, f"group {w.group} to finish") for w in workers]
    assert done[0]["digest"] == done[1]["digest"] and done[0]["step"] == done[1]["step"] == 50
    for w in workers:
        assert_steps_only_move_forward(w)
        after = [e["quorum_id"] for e in w.events("step") if e["step"] > before[w.group] + 1]
        assert after and min(after) > id_before  # ids never reused after the restart
        ids = [e["quorum_id"] for e in w.events("step")]
        assert ids == sorted(ids)


def test_a_blank_replacement_lighthouse_after_a_long_outage_resumes_training_where_it_stopped(
    tmp_path: Path, procs: list
):
    """No state file (a new pod): the replacement starts from the floors the operator passes, and the groups, which
    kept their state through an outage longer than the quorum timeout, go on with no step trained twice."""
    lh = start(procs, Lighthouse(tmp_path, "--min-replicas", "2", "--join-timeout", "0.3").start())
    args = ("--steps", "40", "--min-replicas", "2", "--step-delay", "0.05", "--quorum-timeout", "2")
    workers = [start(procs, Worker(tmp_path, lh.url, g, *args)) for g in "01"]
    wait_for(lambda: all(w.last_step() >= 10 for w in workers), TIMEOUT, "training to reach step 10")
    lh.kill()
    id_before = max(e["quorum_id"] for w in workers for e in w.events("step"))
    step_before = max(w.last_step() for w in workers)
    time.sleep(5)  # the outage itself (2.5x the quorum timeout), not a synchronisation
    assert all(w.proc.poll() is None for w in workers), "a trainer exited while the lighthouse was away"
    floors = ("--restore-quorum-id", str(id_before), "--restore-step", str(step_before))
    lh.args = [*lh.args, *floors]
    lh.start()  # same port, blank but for the floors
    done = [wait_for(w.done, TIMEOUT, f"group {w.group} to finish") for w in workers]
    assert done[0]["digest"] == done[1]["digest"] and done[0]["step"] == done[1]["step"] == 40
    for w in workers:
        assert_steps_only_move_forward(w)
        steps = committed_steps(w)
        assert steps == list(range(1, 41)), f"group {w.group} committed {steps}"  # each step once, none lost
        after = [e["quorum_id"] for e in w.events("step") if e["step"] > step_before + 1]
        assert after and min(after) > id_before
    assert lh.status().quorum_id > id_before


def test_handover_replaces_a_group_make_before_break_without_a_failed_step_or_an_abort(tmp_path: Path, procs: list):
    """The operator's migration off a degrading node: it marks group 1 for a handover and starts the group's new
    incarnation elsewhere while the old one trains on. When the new one registers, the old one finishes the step in
    flight and is then refused (it exits); group 0 never fails a step and no abort is ever signalled. While the new
    incarnation is still getting ready, group 0 trains on alone at once (a join timeout of 60 s would show); when the
    new one asks it heals from group 0, and both finish bitwise-equal."""
    lh = start(
        procs,
        Lighthouse(tmp_path, "--min-replicas", "1", "--join-timeout", "60", "--heartbeat-timeout", "30").start(),
    )
    code, _ = lh.request("POST", contract.PATH_STARTING, {"groups": ["0", "1"]})  # the first quorum has both
    assert code == 200
    args = ("--steps", "40", "--step-delay", "0.2")
    g0 = start(procs, Worker(tmp_path, lh.url, "0", *args))
    old = start(procs, Worker(tmp_path, lh.url, "1", *args))
    join, ready = tmp_path / "join", tmp_path / "ready"
    # the replacement pods: started ahead, they register when `join` appears and ask once `ready` does
    new_args = ("--join-file", str(join), "--pause-at-step", "0", "--resume-file", str(ready))
    new = start(procs, Worker(tmp_path, lh.url, "1", *args, *new_args))
    wait_for(lambda: new.events("started"), TIMEOUT, "the new incarnation of group 1 to start up")
    wait_for(lambda: g0.last_step() >= 3 and old.last_step() >= 3, TIMEOUT, "both groups training together")
    code, body = lh.request("POST", contract.PATH_HANDOVER, {"groups": ["1"], "reason": "node degrading"})
    assert code == 200 and body["handing_over"] == ["1"]
    handed_at = g0.last_step()
    join.touch()  # the new incarnation registers now, while the old one is still in the quorum
    wait_for(lambda: new.events("paused"), TIMEOUT, "the new incarnation to register")
    assert old.proc.wait(TIMEOUT) != 0 and "evicted" in old.log.read_text()  # banned: exits after its step

    def alone() -> list:
        return [e for e in g0.events("step") if e["participants"] == 1]

    wait_for(lambda: len(alone()) >= 3, TIMEOUT, "group 0 to train on without either incarnation of group 1")
    ready.touch()
    done = [wait_for(w.done, TIMEOUT, f"group {w.group} to finish") for w in (g0, new)]
    assert done[0]["step"] == done[1]["step"] == 40 and done[0]["digest"] == done[1]["digest"]
    assert handed_at < 30, "the handover came too late in the run to show anything"

    steps = g0.events("step")
    assert committed_steps(g0) == list(range(1, 41))  # not one failed step
    assert done[0]["metrics"]["failed_commits"] == 0 and done[0]["metrics"]["aborted_collectives"] == 0
    ids = [e["quorum_id"] for e in steps]
    assert ids == sorted(ids) and len(set(ids)) == 3  # with old 1, alone, with new 1: each a new id, never reused
    assert max(e["seconds"] for e in steps) < 30  # never the 60 s join timeout
    assert old.last_step() >= handed_at  # the old incarnation completed the steps it was in
    healed = [e for e in new.events("step") if e["healed"]]
    assert len(healed) == 1 and healed[0]["step"] > alone()[-1]["step"]
    assert_steps_only_move_forward(new)
    status = lh.status()
    assert status.abort_below == 0  # it only ever grows: no abort was signalled during the whole run
    assert any(isinstance(h, DroppedEvent) and h.reason == "handed_over: node degrading" for h in status.history)


def test_sigterm_leaves_after_the_step_in_flight_and_the_survivor_goes_on_without_it_at_once(
    tmp_path: Path, procs: list
):
    """A pod deleted or evicted: SIGTERM lands in the middle of group 1's step 5. That step still commits, in both
    groups; group 1 tells the lighthouse it leaves and exits 143 (never 0, which reads as finished), and group 0's
    next quorum forms without it: no abort (a plain exit or disconnect would signal one), and join and heartbeat
    timeouts of 300 s never matter. Each step is committed once and every sample position is consumed once. Group 0
    has a SIGTERM handler of its own, which the Manager leaves alone: a SIGTERM to it stops nothing."""
    patient = ("--join-timeout", "300", "--heartbeat-timeout", "300", "--stall-factor", "0")
    lh = start(procs, Lighthouse(tmp_path, "--min-replicas", "1", *patient).start())
    code, _ = lh.request("POST", contract.PATH_STARTING, {"groups": ["0", "1"]})  # the first quorum has both
    assert code == 200
    args = ("--steps", "25", "--step-delay", "0.05")
    g0 = start(procs, Worker(tmp_path, lh.url, "0", *args, "--own-sigterm-handler"))
    g1 = start(procs, Worker(tmp_path, lh.url, "1", *args, "--sigterm-at-step", "5"))
    ready = {w.group: wait_for(lambda w=w: w.events("ready"), TIMEOUT, f"group {w.group} up")[0] for w in (g0, g1)}
    assert not ready["0"]["handles_sigterm"] and ready["1"]["handles_sigterm"]
    g0.signal(signal.SIGTERM)
    wait_for(lambda: g0.events("own_sigterm_handler"), TIMEOUT, "group 0's own handler to see its SIGTERM")

    assert g1.proc.wait(TIMEOUT) == contract.EXIT_TERMINATED
    assert [e["step"] for e in g1.events("sigterm")] == [5]
    g1_steps = g1.events("step")
    assert [e["step"] for e in g1_steps] == list(range(1, 7)) and all(e["committed"] for e in g1_steps)
    assert g1.events("terminated")[0]["step"] == 6  # left right after committing the step in flight

    done = wait_for(g0.done, TIMEOUT, "group 0 to finish alone")
    steps = g0.events("step")
    assert committed_steps(g0) == list(range(1, 26)) and done["metrics"]["failed_commits"] == 0
    assert [e["step"] for e in steps if e["participants"] == 2] == list(range(1, 7))  # step 5 -> 6 with group 1
    assert g1_steps[-1]["digest"] == steps[5]["digest"]  # both applied the same update to step 6
    assert done["cursor"] == 2 * 6 + 1 * (25 - 6)  # every sample position once: none lost, none twice
    assert done["metrics"]["aborted_collectives"] == 0
    ids = [e["quorum_id"] for e in steps]
    assert ids == sorted(ids) and len(set(ids)) == 2  # with group 1, then alone
    status = lh.status()
    assert status.abort_below == 0  # it only ever grows: nothing was aborted
    dropped = [h for h in status.history if isinstance(h, DroppedEvent)]
    assert [(h.group, h.reason) for h in dropped] == [("1", "left")]
    audit = [json.loads(line) for line in (tmp_path / "lighthouse-1.log").read_text().splitlines() if line[:1] == "{"]
    leave = [a for a in audit if a.get("kind") == "leave" and a.get("group") == "1" and a.get("reason") == "left"]
    assert leave and "group 1" in leave[0]["actor"] and "asked to terminate" in leave[0]["outcome"]  # its own doing
