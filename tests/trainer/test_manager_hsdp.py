"""HSDP through the Manager: 2 replica groups x 2 ranks, each group FSDP2-sharding a tiny model over gloo, the
cross-group all-reduce on each rank's local shard (rank i with rank i), and a late group healing shard by shard."""

from __future__ import annotations

from pathlib import Path

from ftjob import contract

from tests.support.local_job import Lighthouse, Worker
from tests.support.polling import wait_for
from tests.support.ports import free_port

TIMEOUT = 180  # four torch processes on two shared cores


def start_group(procs: list, tmp_path: Path, url: str, group: str, *args: str) -> list[Worker]:
    port = str(free_port())
    ranks = [
        Worker(tmp_path, url, group, "--rank", str(r), "--world-size", "2", "--master-port", port, *args)
        for r in (0, 1)
    ]
    procs.extend(ranks)
    return ranks


def test_hsdp_late_group_heals_each_rank_from_its_peer_rank_and_all_shards_match(tmp_path: Path, procs: list):
    lh = Lighthouse(tmp_path, "--min-replicas", "1", "--join-timeout", "0.2").start()
    procs.append(lh)
    resume = tmp_path / "resume"
    args = ("--steps", "30", "--step-delay", "0.1")
    first = start_group(procs, tmp_path, lh.url, "0", *args, "--pause-at-step", "3", "--resume-file", str(resume))
    wait_for(lambda: all(w.events("paused") for w in first), TIMEOUT, "group 0 to train alone to step 3")
    late = start_group(procs, tmp_path, lh.url, "1", *args)
    wait_for(lambda: all(w.events("ready") for w in late), TIMEOUT, "group 1 to start")
    resume.touch()
    done = {
        (w.group, r): wait_for(w.done, TIMEOUT, f"group {w.group} rank {r}")
        for ws in (first, late)
        for r, w in enumerate(ws)
    }
    for rank in (0, 1):  # rank i's shard is bitwise equal across groups; the shards differ between ranks
        assert done[("0", rank)]["digest"] == done[("1", rank)]["digest"]
        assert done[("1", rank)]["metrics"]["heals"] == 1 and done[("0", rank)]["step"] == 30
    assert done[("0", 0)]["digest"] != done[("0", 1)]["digest"]
    healed = [e for e in late[1].events("step") if e["healed"]]
    assert len(healed) == 1 and healed[0]["step"] >= 3


def test_sigterm_to_one_rank_makes_its_whole_group_leave_after_the_same_step(tmp_path: Path, procs: list):
    """Only rank 1 of group 1 gets SIGTERM, in the middle of step 4 (its pod is evicted; rank 0's pod is elsewhere).
    The group's commit vote carries it: both ranks commit the step in flight, leave the job after it and exit 143,
    while group 0 trains on alone to the end, every step committed once."""
    lh = Lighthouse(tmp_path, "--min-replicas", "1", "--join-timeout", "60").start()
    procs.append(lh)
    code, _ = lh.request("POST", contract.PATH_STARTING, {"groups": ["0", "1"]})  # the first quorum has both
    assert code == 200
    args = ("--steps", "12", "--step-delay", "0.05")
    survivors = start_group(procs, tmp_path, lh.url, "0", *args)
    common = ("--world-size", "2", "--master-port", str(free_port()), *args)
    leaving = [
        Worker(tmp_path, lh.url, "1", "--rank", "0", *common),
        Worker(tmp_path, lh.url, "1", "--rank", "1", *common, "--sigterm-at-step", "4"),
    ]
    procs.extend(leaving)
    assert [w.proc.wait(TIMEOUT) for w in leaving] == [contract.EXIT_TERMINATED] * 2
    assert leaving[1].events("sigterm") and not leaving[0].events("sigterm")
    for w in leaving:
        assert [e["step"] for e in w.events("step") if e["committed"]] == [1, 2, 3, 4, 5]
        assert w.events("terminated")[0]["step"] == 5  # both ranks left after the same step
    done = [wait_for(w.done, TIMEOUT, f"group 0 rank {r}") for r, w in enumerate(survivors)]
    assert all(d["step"] == 12 and d["metrics"]["failed_commits"] == 0 for d in done)
    assert [e["step"] for e in survivors[0].events("step") if e["participants"] == 2] == [1, 2, 3, 4, 5]
    assert [e["step"] for e in survivors[0].events("step") if e["committed"]] == list(range(1, 13))
    assert lh.status().abort_below == 0
