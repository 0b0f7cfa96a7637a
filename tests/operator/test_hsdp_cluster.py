"""HSDP under the operator on the local cluster: examples/k8s/fsdp.yaml (FSDP2 shards the model over a group's two
ranks, the groups replicate it fault-tolerantly) as a user applies it, with the group's two ranks as two pods, and as
one pod running two ranks (spec.ranksPerPod, the production shape of a rank per GPU). A group is killed mid-run —
its pod's processes, or one rank process inside the two-rank pod — and only that group restarts while the other
keeps committing; the job Succeeds with equal digests and every sample trained exactly once."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from ftjob.ft.records import read_run_dir
from ftjob.launch.run_records import group_timeline, rejoin_seconds
from kubernetes import client

from tests.support.cluster import TRAINER_IMAGE, container_pids
from tests.support.operator_cluster import (
    condition,
    create_job,
    get_job,
    kill_pod_processes,
    lighthouse_status,
    running_groups,
)
from tests.support.paths import REPO
from tests.support.polling import wait_for
from tests.support.trainer_runs import check_run

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

STEPS = 150


def fsdp_job(records: Path, **spec: Any) -> dict[str, Any]:
    """The example as written, in the local cluster's image, writing run records to a shared host folder."""
    job = yaml.safe_load((REPO / "examples" / "k8s" / "fsdp.yaml").read_text())
    job["spec"].update(spec)
    pod = job["spec"]["template"]["spec"]
    trainer = pod["containers"][0]
    trainer["image"] = TRAINER_IMAGE
    trainer["command"] = [*trainer["command"][:2], "--steps", str(STEPS)]
    trainer["env"].append({"name": "FTJOB_RUN_DIR", "value": "/records"})
    trainer["volumeMounts"] = [{"name": "records", "mountPath": "/records"}]
    pod["volumes"] = [{"name": "records", "hostPath": {"path": str(records), "type": "Directory"}}]
    return job


def rank_pids(pod: client.V1Pod, local_rank: int) -> list[int]:
    """The processes of one rank inside a pod that runs several (their environment names the local rank)."""
    found = []
    for pid in container_pids(pod):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"LOCAL_RANK={local_rank}".encode() in env:
            found.append(pid)
    return found


def run_to_the_end(kube, namespace: str, name: str, pods: int, kill: Any) -> tuple[dict[str, Any], float]:
    """Waits for both groups, kills group 1 once training is under way, waits for the end; returns the job and
    when the kill happened."""
    groups = wait_for(lambda: (g := running_groups(kube.core, namespace, name, pods)) and len(g) == 2 and g, 300,
                      "2 groups running")  # fmt: skip
    wait_for(lambda: lighthouse_status(kube.core, namespace, name).max_step >= 15, 300, "15 committed steps")
    killed_at = time.time()
    kill(groups[1][0])
    job = wait_for(lambda: (j := get_job(kube.custom, namespace, name)) and (condition(j, "Succeeded")
                   or condition(j, "Failed")) and j, 600, "the job to finish")  # fmt: skip
    assert condition(job, "Succeeded"), job["status"]
    return job, killed_at


def check_only_group_1_restarted(job: dict[str, Any], records: Path, killed_at: float) -> float:
    """Only the victim restarted, the survivor committed alone while it was away, the victim healed and contributed
    again; returns kill -> contributing again (seconds, the run records' clock)."""
    status = job["status"]
    assert status["totalRestarts"] == 1 and status["restartsByReason"] == {"ExitCode": 1}, status
    gens = {g["index"]: g["generation"] for g in status["replicaGroups"]}
    assert gens == {0: 0, 1: 1}, gens
    commits = check_run(records, {"0", "1"}, STEPS, restarted={"1"})
    assert any(r.num_contributors == 1 and r.t > killed_at for r in commits["0"]), "the survivor never went on alone"
    assert any(r.healed for r in commits["1"]), "the replacement never healed from its peer"
    back = rejoin_seconds(group_timeline("1", read_run_dir(records)["1"]), killed_at)
    assert back is not None, "group 1 never contributed again"
    return back


def test_fsdp_example_with_two_pods_per_group_survives_a_group_kill(kube, namespace, operators, records):
    operators()
    job = fsdp_job(records)
    assert job["spec"]["podsPerReplica"] == 2 and "ranksPerPod" not in job["spec"]
    create_job(kube.custom, namespace, job)
    done, killed_at = run_to_the_end(kube, namespace, "example-fsdp", 2, kill_pod_processes)
    back = check_only_group_1_restarted(done, records, killed_at)
    print(f"\nFSDP, 2 pods x 1 rank per group: group kill -> contributing again {back:.1f} s")


def test_fsdp_example_as_one_pod_of_two_ranks_survives_one_rank_sigkilled(kube, namespace, operators, records):
    operators()
    create_job(kube.custom, namespace, fsdp_job(records, podsPerReplica=1, ranksPerPod=2))

    def kill_rank_1(pod: client.V1Pod) -> None:
        pids = rank_pids(pod, 1)
        assert pids, "no process of local rank 1 in the pod"
        for pid in pids:
            os.kill(pid, signal.SIGKILL)

    done, killed_at = run_to_the_end(kube, namespace, "example-fsdp", 1, kill_rank_1)
    back = check_only_group_1_restarted(done, records, killed_at)
    victim = next(g for g in done["status"]["replicaGroups"] if g["index"] == 1)
    assert victim["lastFailureReason"] == "ExitCode" and "137" in victim["lastFailure"], victim
    print(f"\nFSDP, 1 pod x 2 ranks per group: one rank SIGKILLed -> group contributing again {back:.1f} s")
