"""Whole-job restarts on the local cluster: every replica group lost at once (all worker pods force-deleted, as a
rack outage or a spot reclaim does; the lighthouse lost with them; a suspend and resume) goes on from the newest
intact checkpoint on a shared volume, or from step 0 without one, instead of waiting for a step nobody holds. The
job Succeeds with equal digests, every sample trained exactly once in the surviving history, and status and Events
say what was lost."""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from ftjob.ft.records import CommitRecord, FinishedRecord, StartRecord, read_run_dir
from ftjob.launch.run_records import sample_coverage

from tests.support.operator_cluster import condition, create_job, get_job, lighthouse_status, patch_job, worker_pods
from tests.support.polling import wait_for
from tests.support.trainer_runs import training_job

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

EVERY = 20  # checkpoint interval, in committed steps
CHECKPOINTS_ROOT = Path("/var/tmp/ftjob-test-checkpoints")


@pytest.fixture
def checkpoints(namespace: str) -> Iterator[Path]:
    """A host folder every node of the local cluster shares (hostPath), standing in for a shared volume."""
    path = CHECKPOINTS_ROOT / namespace
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(0o777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def checkpointed_job(name: str, steps: int, records: Path, checkpoints: Path | None, **spec: Any) -> dict[str, Any]:
    m = training_job(name, steps, records, **spec)
    pod = m["spec"]["template"]["spec"]
    if checkpoints is not None:
        pod["containers"][0]["command"] += ["--checkpoint-dir", "/checkpoints", "--checkpoint-every", str(EVERY)]
        pod["containers"][0]["volumeMounts"].append({"name": "checkpoints", "mountPath": "/checkpoints"})
        pod["volumes"].append({"name": "checkpoints", "hostPath": {"path": str(checkpoints), "type": "Directory"}})
    return m


def lose_every_pod(kube, namespace: str, job: str, lighthouse_too: bool = False) -> float:
    """Force-delete every worker pod (and the lighthouse's) in one go; returns when it happened."""
    selector = f"ftjob.dev/job={job}" if lighthouse_too else f"ftjob.dev/job={job},ftjob.dev/role=worker"
    pods = kube.core.list_namespaced_pod(namespace, label_selector=selector).items
    assert pods, "no pods to lose"
    lost_at = time.time()
    for pod in pods:
        kube.core.delete_namespaced_pod(pod.metadata.name, namespace, grace_period_seconds=0)
    return lost_at


def restored_after(kube, namespace: str, job: str, quorum_id: int, timeout: float = 240) -> dict[str, Any]:
    """The job's `.status.restored` once it names a quorum after ``quorum_id``."""
    return wait_for(
        lambda: (r := (get_job(kube.custom, namespace, job).get("status") or {}).get("restored"))
        and r["quorumId"] > quorum_id and r,
        timeout, f"status.restored after quorum {quorum_id}",
    )  # fmt: skip


def first_commit_after(records: Path, t: float) -> float:
    """When the first commit of a process started after ``t`` landed, in any group (the run records' wall clock;
    the processes being replaced may still commit a step or two while they are killed)."""
    firsts = []
    for recs in read_run_dir(records).values():
        started = min((r.t for r in recs if isinstance(r, StartRecord) and r.t > t), default=None)
        if started is not None:
            firsts += [r.t for r in recs if isinstance(r, CommitRecord) and r.t > started][:1]
    return min(firsts)


def check_restored_run(records: Path, groups: set[str], steps: int, restores: list[tuple[float, int]],
                       starts: int) -> None:  # fmt: skip
    """Exactly-once samples over the history that survived: the commits a restore gave up (made by the processes it
    replaced, above the step it went on from) are dropped, and what is left must cover the sample stream once. (A
    step trained again may split its samples otherwise: a group that heals at the restore does not contribute.)
    Within each process a group's steps only go up (a jump is a heal); every group ends at the last step with one
    digest."""
    by_group = read_run_dir(records)
    assert set(by_group) == groups, sorted(by_group)
    kept: dict[str, list[Any]] = {}
    given_up = 0
    for group, recs in by_group.items():
        assert sum(isinstance(r, StartRecord) for r in recs) == starts, f"group {group}: {starts} starts expected"
        # each restore replaced the processes running at the loss: their commits end at the group's next start
        ends = [
            (min(r.t for r in recs if isinstance(r, StartRecord) and r.t > lost_at), step) for lost_at, step in restores
        ]
        out = []
        for r in recs:
            if isinstance(r, CommitRecord) and any(r.t < end and r.step > step for end, step in ends):
                given_up += 1
                continue
            out.append(r)
        kept[group] = out
        segment: list[int] = []
        for r in recs:
            if isinstance(r, StartRecord):
                segment = []
            elif isinstance(r, CommitRecord):
                assert not segment or r.step > segment[-1], f"group {group} went back within one process: {r.step}"
                assert not segment or r.step == segment[-1] + 1 or r.healed, f"group {group} skipped to {r.step}"
                segment.append(r.step)
    assert given_up, "no commit was given up: the restores lost nothing, so this run proves nothing"
    cov = sample_coverage(kept)
    assert (cov.dropped, cov.duplicated, cov.inconsistent_steps, cov.shard_errors) == (0, 0, [], []), cov
    finals = {}
    for group, recs in by_group.items():
        done = [r for r in recs if isinstance(r, FinishedRecord)]
        assert done and done[-1].step == steps, f"group {group} did not finish"
        finals[group] = done[-1].param_digest
    assert len(set(finals.values())) == 1, f"groups diverged: {finals}"


def events(kube, namespace: str, reason: str) -> list[str]:
    return [e.message for e in kube.core.list_namespaced_event(namespace, field_selector=f"reason={reason}").items]


def test_every_worker_lost_at_once_then_a_suspend_resume_go_on_from_the_newest_checkpoint(
    kube, namespace, operators, records, checkpoints
):
    steps = 200
    operators()
    create_job(kube.custom, namespace, checkpointed_job("wj", steps, records, checkpoints, replicas=2))
    wait_for(lambda: lighthouse_status(kube.core, namespace, "wj").max_step >= 2 * EVERY + 5, 300, "45 steps")

    # 1. every worker pod force-deleted at once: the lighthouse survives and remembers the committed step
    lost_at = lose_every_pod(kube, namespace, "wj")
    first = restored_after(kube, namespace, "wj", 0)
    lost = first["fromStep"] - first["toStep"]
    assert first["toStep"] > 0 and first["toStep"] % EVERY == 0, first  # a checkpoint's step, not step 0
    assert 0 < lost <= 2 * EVERY, first  # the newest intact checkpoint: at most one interval and the one in flight
    back = wait_for(lambda: first_commit_after(records, lost_at), 240, "a commit after the loss")
    print(f"\nall workers lost at step {first['fromStep']}: resumed from checkpoint {first['toStep']} "
          f"({lost} steps lost); loss -> first commit {back - lost_at:.1f} s")  # fmt: skip

    # 2. suspend once the lost steps are trained again, then resume
    wait_for(lambda: lighthouse_status(kube.core, namespace, "wj").max_step >= first["fromStep"] + EVERY + 5, 300,
             "training past the lost steps and a new checkpoint")  # fmt: skip
    patch_job(kube.custom, namespace, "wj", {"spec": {"suspend": True}})
    suspended_at = time.time()
    wait_for(lambda: not worker_pods(kube.core, namespace, "wj", live_only=False), 120, "no worker pods")
    resumed_at = time.time()
    patch_job(kube.custom, namespace, "wj", {"spec": {"suspend": False}})
    second = restored_after(kube, namespace, "wj", first["quorumId"])
    assert second["toStep"] % EVERY == 0 and second["toStep"] > first["fromStep"], second
    again = wait_for(lambda: first_commit_after(records, resumed_at), 240, "a commit after the resume")
    print(
        f"suspended at step {second['fromStep']}: resumed from checkpoint {second['toStep']} "
        f"({second['fromStep'] - second['toStep']} steps lost); resume -> first commit {again - resumed_at:.1f} s"
    )

    job = wait_for(lambda: (j := get_job(kube.custom, namespace, "wj")) and (condition(j, "Succeeded")
                   or condition(j, "Failed")) and j, 600, "the job to finish")  # fmt: skip
    assert condition(job, "Succeeded"), job["status"]
    status = job["status"]
    assert status["quorum"]["step"] == steps and status["restored"] == second
    # (the re-trained steps are badput `lostWork` only where a poll sees them: a replay shorter than the 2 s poll falls
    # into the loss's interval; tests/operator/test_goodput.py checks the accounting itself)
    # each group replaced once for the loss (and recreated once by the resume): no generation failed for a quorum
    assert all(g["generation"] <= 2 for g in status["replicaGroups"]), status["replicaGroups"]
    restored_events = events(kube, namespace, "Restored")
    assert len(restored_events) == 2 and all("checkpoint of step" in m for m in restored_events), restored_events
    check_restored_run(records, {"0", "1"}, steps, [(lost_at, first["toStep"]), (suspended_at, second["toStep"])],
                       starts=3)  # fmt: skip


def test_the_lighthouse_and_every_worker_lost_together_without_checkpoints_restart_from_step_0(
    kube, namespace, operators, records
):
    steps = 80
    operators()
    create_job(kube.custom, namespace, checkpointed_job("wl", steps, records, None, replicas=2))
    # the new lighthouse learns the job's committed step from the operator's status (the old one is gone with its
    # memory), so the loss comes once the operator has seen step 15, however far its poll trails the lighthouse
    wait_for(lambda: (get_job(kube.custom, namespace, "wl").get("status", {}).get("quorum") or {}).get("step", 0) >= 15,
             300, "the operator to see 15 committed steps")  # fmt: skip
    lost_at = lose_every_pod(kube, namespace, "wl", lighthouse_too=True)
    restored = restored_after(kube, namespace, "wl", 0)
    assert restored["toStep"] == 0 and restored["fromStep"] >= 15, restored
    back = wait_for(lambda: first_commit_after(records, lost_at), 240, "a commit after the loss")
    print(f"\nlighthouse and all workers lost at step {restored['fromStep']}, no checkpoints: restarted from step 0; "
          f"loss -> first commit {back - lost_at:.1f} s")  # fmt: skip
    job = wait_for(lambda: (j := get_job(kube.custom, namespace, "wl")) and (condition(j, "Succeeded")
                   or condition(j, "Failed")) and j, 600, "the job to finish")  # fmt: skip
    assert condition(job, "Succeeded"), job["status"]
    assert any("from step 0: no group brought back a checkpoint" in m for m in events(kube, namespace, "Restored"))
    check_restored_run(records, {"0", "1"}, steps, [(lost_at, 0)], starts=2)
