"""The operator process itself failing: killed mid-reconcile (no duplicate or lost pods) and two replicas under
leader election (exactly one acts; the standby takes over when the leader dies)."""

from __future__ import annotations

import collections
import threading

import pytest
from ftjob import contract
from kubernetes import client, watch

from tests.support.operator_cluster import create_job, get_job, job_manifest, running_groups, worker_pods
from tests.support.polling import wait_for

pytestmark = pytest.mark.cluster

SLEEP = ["sleep", "100000"]  # cheap pods: this is about the operator, not the workload


def live_by_rank(core: client.CoreV1Api, ns: str, job: str) -> dict[tuple[int, int], list[str]]:
    out: dict[tuple[int, int], list[str]] = collections.defaultdict(list)
    for p in worker_pods(core, ns, job):
        labels = p.metadata.labels
        out[(int(labels[contract.LABEL_GROUP]), int(labels[contract.LABEL_RANK]))].append(p.metadata.name)
    return out


def all_seen_recorded(kube, namespace: str, job: str) -> bool:
    """The operator's durable memory says every group's pods were created and observed: a successor will treat a
    pod missing from now on as deleted (a group failure), not as one still to create."""
    groups = get_job(kube.custom, namespace, job)["status"]["replicaGroups"]
    return all(g.get("allPodsSeen") for g in groups)


def kill_on_first_pod(kube, namespace: str, op) -> threading.Thread:
    """SIGKILL the operator the moment its first pod appears: other creates are still in flight."""

    def run() -> None:
        w = watch.Watch()
        for ev in w.stream(kube.core.list_namespaced_pod, namespace, timeout_seconds=120):
            if ev["type"] == "ADDED" and ev["object"].metadata.labels.get(contract.LABEL_ROLE) == "worker":
                op.kill()
                w.stop()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_operator_killed_mid_reconcile_creates_no_duplicates_and_loses_nothing(kube, namespace, operators):
    groups, ranks = 12, 4
    first = operators()
    killer = kill_on_first_pod(kube, namespace, first)
    create_job(kube.custom, namespace, job_manifest("mid", command=SLEEP, replicas=groups, podsPerReplica=ranks))
    killer.join(timeout=120)
    assert first.proc.poll() is not None, "the operator was not killed"
    partial = sum(len(v) for v in live_by_rank(kube.core, namespace, "mid").values())
    second = operators()
    wait_for(lambda: len(running_groups(kube.core, namespace, "mid", ranks)) == groups, 240, "every group running")
    by_rank = live_by_rank(kube.core, namespace, "mid")
    assert set(by_rank) == {(g, r) for g in range(groups) for r in range(ranks)}
    dupes = {k: v for k, v in by_rank.items() if len(v) != 1}
    assert not dupes, f"duplicate pods: {dupes}"
    every = kube.core.list_namespaced_pod(namespace, label_selector=f"{contract.LABEL_JOB}=mid").items
    assert {p.metadata.labels[contract.LABEL_GENERATION] for p in every} == {"0"}, "a group was restarted"
    print(f"operator killed with {partial} of {groups * ranks} pods created")

    # Now kill it between a failure and its handling: a pod dies while no operator runs.
    wait_for(lambda: all_seen_recorded(kube, namespace, "mid"), 30, "the operator to record every pod as seen")
    second.kill()
    victim = by_rank[(3, 1)][0]
    kube.core.delete_namespaced_pod(victim, namespace, grace_period_seconds=0)
    operators()

    def settled() -> dict | None:
        live = live_by_rank(kube.core, namespace, "mid")
        whole = len(running_groups(kube.core, namespace, "mid", ranks)) == groups
        single = len(live) == groups * ranks and all(len(v) == 1 for v in live.values())
        names = {n for v in live.values() for n in v}
        return live if whole and single and victim not in names else None

    live = wait_for(settled, 240, "group 3 whole again, no duplicates")
    generations = {
        p.metadata.labels[contract.LABEL_GENERATION]
        for p in worker_pods(kube.core, namespace, "mid")
        if p.metadata.labels[contract.LABEL_GROUP] == "3"
    }
    assert len(generations) == 1, f"group 3 mixes generations {generations}: {live}"
    status = get_job(kube.custom, namespace, "mid")["status"]
    assert status["totalRestarts"] <= 1


def test_two_replicas_exactly_one_acts_and_the_standby_takes_over(kube, namespace, operators):
    lease = ["--lease-duration", "4", "--lease-name", "ftjob-test-leader"]
    a = operators(*lease, "--identity", "replica-a", leader_election=True)
    wait_for(lambda: a.health()["leader"], 60, "replica a to lead")
    b = operators(*lease, "--identity", "replica-b", leader_election=True)
    wait_for(lambda: "standing by" in b.logs(), 60, "replica b standing by")
    assert b.health() == {"ok": True, "leader": False}
    holder = client.CoordinationV1Api(kube.api).read_namespaced_lease("ftjob-test-leader", namespace)
    assert holder.spec.holder_identity == "replica-a"

    create_job(kube.custom, namespace, job_manifest("ha", command=SLEEP, replicas=2))
    before = wait_for(lambda: (g := running_groups(kube.core, namespace, "ha")) and len(g) == 2 and g, 120,
                      "2 groups running")  # fmt: skip
    assert "watching job" in a.logs() and "watching job" not in b.logs(), "the standby acted"
    assert "ftjob_operator_leader 1.0" in a.metrics() and "ftjob_operator_leader 0.0" in b.metrics()

    wait_for(lambda: all_seen_recorded(kube, namespace, "ha"), 30, "the leader to record every pod as seen")
    a.kill()  # no release: b must wait for the lease to expire, then act
    wait_for(lambda: b.health()["leader"], 60, "replica b to take over")
    assert (
        client.CoordinationV1Api(kube.api).read_namespaced_lease("ftjob-test-leader", namespace).spec.holder_identity
        == "replica-b"
    )
    victim = before[0][0].metadata.name
    kube.core.delete_namespaced_pod(victim, namespace, grace_period_seconds=0)
    after = wait_for(lambda: (g := running_groups(kube.core, namespace, "ha")) and len(g) == 2
                     and g[0][0].metadata.name != victim and g, 120, "group 0 replaced by replica b")  # fmt: skip
    assert after[1][0].metadata.uid == before[1][0].metadata.uid
    assert "watching job" in b.logs()
