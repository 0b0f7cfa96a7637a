"""The operator against the real cluster: create, group failure, budgets, scaling, suspend/resume, deletion."""

from __future__ import annotations

import pytest
from ftjob import contract
from kubernetes import client

from tests.support.cluster import cluster, kubectl
from tests.support.operator_cluster import (
    condition,
    create_job,
    dropped_reasons,
    get_job,
    job_manifest,
    lighthouse_pod,
    lighthouse_status,
    patch_job,
    running_groups,
    worker_pods,
)
from tests.support.polling import wait_for

pytestmark = pytest.mark.cluster


def uids(groups: dict[int, list]) -> dict[int, set[str]]:
    return {g: {p.metadata.uid for p in ps} for g, ps in groups.items()}


def test_create_makes_lighthouse_services_secret_and_every_rank(kube, namespace, operators):
    operators()
    manifest = job_manifest("mk", replicas=2, podsPerReplica=2, spareReplicas=1)
    # a CPU limit and no thread count of its own: the operator gives the ranks one thread per core of the limit
    manifest["spec"]["template"]["spec"]["containers"][0]["resources"] = {
        "limits": {"cpu": "2"},
        "requests": {"cpu": "10m"},
    }
    create_job(kube.custom, namespace, manifest)
    groups = wait_for(lambda: (g := running_groups(kube.core, namespace, "mk", 2)) and len(g) == 3 and g, 120,
                      "3 groups x 2 ranks running")  # fmt: skip
    for g, pods in groups.items():
        names = sorted(p.metadata.name for p in pods)
        assert names == [f"mk-g{g}-0-r0", f"mk-g{g}-0-r1"]
        for p in pods:
            env = {e.name: e for e in p.spec.containers[0].env}
            assert env[contract.ENV_REPLICA_GROUP].value == str(g)
            assert env[contract.ENV_WORLD_SIZE].value == "2"
            assert env[contract.ENV_MASTER_ADDR].value == f"mk-g{g}-0-r0.mk-g{g}.{namespace}.svc.cluster.local"
            assert env[contract.ENV_TOKEN].value_from.secret_key_ref.name == "mk-ftjob-token"
            assert contract.ENV_OPERATOR_TOKEN not in env  # the membership API's token is the lighthouse pod's only
            assert env[contract.ENV_ADVERTISE_ADDR].value_from.field_ref.field_path == "status.podIP"
            assert env["OMP_NUM_THREADS"].value == "2"
            assert p.spec.hostname == p.metadata.name and p.spec.subdomain == f"mk-g{g}"
            assert p.metadata.owner_references[0].kind == contract.KIND
    services = {s.metadata.name: s for s in kube.core.list_namespaced_service(namespace).items}
    assert set(services) == {"mk-lighthouse", "mk-g0", "mk-g1", "mk-g2"}
    assert all(s.spec.cluster_ip == "None" and s.spec.publish_not_ready_addresses for s in services.values())
    kube.core.read_namespaced_secret("mk-ftjob-token", namespace)
    kube.core.read_namespaced_secret("mk-ftjob-operator-token", namespace)
    # every group heartbeats to the lighthouse through its Service DNS name with the Secret's token
    wait_for(lambda: len(lighthouse_status(kube.core, namespace, "mk").members) == 3, 60, "3 lighthouse members")
    # 2 contribute, the third is a warm spare: the lighthouse was told desired = replicas
    wait_for(lambda: lighthouse_status(kube.core, namespace, "mk").desired_replicas == 2, 30, "desired = 2")
    # Running turns True at minReplicas groups; the status may say so before it has seen every group's pods Running
    job = wait_for(lambda: (j := get_job(kube.custom, namespace, "mk")) and condition(j, "Running")
                   and j["status"].get("ready") == "3/3" and j, 60, "condition Running, ready 3/3")  # fmt: skip
    assert job["status"]["selector"] == f"{contract.LABEL_JOB}=mk,ftjob.dev/role=worker"
    printed = kubectl(kube.kubeconfig, "get", "ftj", "mk", "-n", namespace).stdout
    assert "READY" in printed and "3/3" in printed and "CONDITION" in printed
    annotations = job["metadata"].get("annotations") or {}
    assert not any(k.startswith("kopf.zalando.org") for k in annotations)
    assert not job["metadata"].get("finalizers")


def test_killed_pod_restarts_only_its_group_and_lighthouse_sees_the_eviction(kube, namespace, operators):
    op = operators()
    create_job(kube.custom, namespace, job_manifest("kp", replicas=3))
    before = wait_for(lambda: (g := running_groups(kube.core, namespace, "kp")) and len(g) == 3 and g, 120,
                      "3 groups running")  # fmt: skip
    wait_for(lambda: len(lighthouse_status(kube.core, namespace, "kp").members) == 3, 60, "3 lighthouse members")
    victim = before[1][0]
    kube.core.delete_namespaced_pod(victim.metadata.name, namespace, grace_period_seconds=0)

    def replaced() -> dict[int, list] | None:
        g = running_groups(kube.core, namespace, "kp")
        return g if len(g) == 3 and uids(g)[1] != uids(before)[1] else None

    after = wait_for(replaced, 120, "group 1 replaced")
    assert uids(after)[0] == uids(before)[0] and uids(after)[2] == uids(before)[2], "other groups were touched"
    assert after[1][0].metadata.name == "kp-g1-1-r0"
    # The lighthouse's heartbeat timeout is 600 s: only the operator's POST evict can have dropped the group.
    status = lighthouse_status(kube.core, namespace, "kp")
    assert dropped_reasons(status).get("1", "").startswith("evicted"), status.history
    job = wait_for(lambda: (j := get_job(kube.custom, namespace, "kp"))["status"].get("totalRestarts") == 1 and j,
                   30, "the restart in status")  # fmt: skip
    assert job["status"]["restartsByReason"] == {"PodDeleted": 1}
    g1 = next(g for g in job["status"]["replicaGroups"] if g["index"] == 1)
    assert g1["generation"] == 1 and g1["restarts"] == 1
    # the Event and the counter follow the replacement's creation and the lighthouse call, in the same reconcile
    wait_for(lambda: any(e.reason == "GroupRestart" for e in kube.core.list_namespaced_event(
        namespace, field_selector="involvedObject.name=kp").items), 30, "the GroupRestart Event")  # fmt: skip
    wait_for(lambda: 'ftjob_group_restarts_total{reason="PodDeleted"} 1.0' in op.metrics(), 30,
             "the restart counted in the operator's metrics")  # fmt: skip


def test_budget_exhausted_fails_the_job_with_a_clear_reason(kube, namespace, operators):
    operators()
    crash = ["python", "-c", "import sys; print('crashing'); sys.exit(7)"]
    create_job(kube.custom, namespace,
               job_manifest("bx", command=crash, replicas=1, failurePolicy={"maxRestartsPerGroup": 2}))  # fmt: skip
    job = wait_for(lambda: (j := get_job(kube.custom, namespace, "bx")) and condition(j, "Failed") and j, 180,
                   "condition Failed")  # fmt: skip
    failed = condition(job, "Failed")
    assert failed["reason"] == "RestartBudgetExhausted"
    assert "maxRestartsPerGroup=2" in failed["message"] and "exited 7" in failed["message"]
    assert job["status"]["totalRestarts"] == 2 and job["status"]["phase"] == "Failed"
    # terminal: nothing runs, nothing is recreated
    wait_for(lambda: not worker_pods(kube.core, namespace, "bx"), 60, "no live worker pods")
    kubectl(kube.kubeconfig, "wait", "--for=condition=Failed", "ftj/bx", "-n", namespace, "--timeout=5s")


def test_container_over_its_memory_limit_is_reported_as_oomkilled(kube, namespace, operators):
    """The real kernel OOM killer under the node's memory cgroup: the operator names it in status and an Event."""
    operators()
    hog = ["python", "-c", "import time; b = bytearray(400 * 2**20); time.sleep(60)"]
    manifest = job_manifest("oom", command=hog, replicas=1, failurePolicy={"maxRestartsPerGroup": 1})
    container = manifest["spec"]["template"]["spec"]["containers"][0]
    container["resources"] = {"limits": {"memory": "128Mi"}, "requests": {"memory": "128Mi"}}
    create_job(kube.custom, namespace, manifest)
    job = wait_for(lambda: (j := get_job(kube.custom, namespace, "oom")) and condition(j, "Failed") and j, 180,
                   "condition Failed after the OOM kills")  # fmt: skip
    assert job["status"]["restartsByReason"] == {"OOMKilled": 1}, job["status"]
    assert "OOMKilled" in condition(job, "Failed")["message"], condition(job, "Failed")
    events = kube.core.list_namespaced_event(namespace, field_selector="reason=GroupRestart").items
    assert any("OOMKilled" in e.message and "memory limit" in e.message for e in events), [e.message for e in events]


def test_scale_up_and_down_keeps_surviving_groups(kube, namespace, operators):
    operators()
    create_job(kube.custom, namespace, job_manifest("sc", replicas=2))
    before = wait_for(lambda: (g := running_groups(kube.core, namespace, "sc")) and len(g) == 2 and g, 120,
                      "2 groups running")  # fmt: skip
    kubectl(kube.kubeconfig, "scale", "ftj/sc", "-n", namespace, "--replicas=4")
    up = wait_for(lambda: (g := running_groups(kube.core, namespace, "sc")) and len(g) == 4 and g, 120,
                  "4 groups running")  # fmt: skip
    assert uids(up)[0] == uids(before)[0] and uids(up)[1] == uids(before)[1]
    wait_for(lambda: len(lighthouse_status(kube.core, namespace, "sc").members) == 4, 60, "4 lighthouse members")
    kubectl(kube.kubeconfig, "scale", "ftj/sc", "-n", namespace, "--replicas=1")
    down = wait_for(lambda: (g := running_groups(kube.core, namespace, "sc")) and set(g) == {0} and
                    len(worker_pods(kube.core, namespace, "sc")) == 1 and g, 120, "only group 0 left")  # fmt: skip
    assert uids(down)[0] == uids(before)[0]
    status = wait_for(lambda: (s := lighthouse_status(kube.core, namespace, "sc")).desired_replicas == 1 and s,
                      30, "the lighthouse told desired=1")  # fmt: skip
    drops = dropped_reasons(status)
    assert drops.get("3", "").startswith("evicted") and drops.get("1", "").startswith("evicted"), status.history
    services = {s.metadata.name for s in kube.core.list_namespaced_service(namespace).items}
    assert services == {"sc-lighthouse", "sc-g0"}
    scale = kube.custom.get_namespaced_custom_object_scale(contract.API_GROUP, contract.API_VERSION, namespace,
                                                           contract.PLURAL, "sc")  # fmt: skip
    assert scale["spec"]["replicas"] == 1


def test_suspend_deletes_workers_and_resume_recreates_them(kube, namespace, operators):
    operators()
    create_job(kube.custom, namespace, job_manifest("su", replicas=2))
    wait_for(lambda: len(running_groups(kube.core, namespace, "su")) == 2, 120, "2 groups running")
    wait_for(lambda: len(lighthouse_status(kube.core, namespace, "su").members) == 2, 60, "2 lighthouse members")
    lighthouse_uid = lighthouse_pod(kube.core, namespace, "su").metadata.uid
    patch_job(kube.custom, namespace, "su", {"spec": {"suspend": True}})
    wait_for(lambda: not worker_pods(kube.core, namespace, "su", live_only=False), 60, "worker pods gone")
    job = wait_for(lambda: (j := get_job(kube.custom, namespace, "su")) and condition(j, "Suspended") and j, 30,
                   "condition Suspended")  # fmt: skip
    assert not condition(job, "Running")
    assert lighthouse_pod(kube.core, namespace, "su").metadata.uid == lighthouse_uid  # the lighthouse stays
    patch_job(kube.custom, namespace, "su", {"spec": {"suspend": False}})
    groups = wait_for(lambda: (g := running_groups(kube.core, namespace, "su")) and len(g) == 2 and g, 120,
                      "2 groups running again")  # fmt: skip
    assert sorted(p.metadata.name for ps in groups.values() for p in ps) == ["su-g0-1-r0", "su-g1-1-r0"]
    job = wait_for(lambda: (j := get_job(kube.custom, namespace, "su")) and condition(j, "Running") and j, 30,
                   "condition Running")  # fmt: skip
    assert job["status"]["totalRestarts"] == 0  # suspend/resume spends no budget


def test_delete_removes_everything(kube, namespace, operators):
    operators()
    create_job(kube.custom, namespace, job_manifest("dl", replicas=2))
    wait_for(lambda: len(running_groups(kube.core, namespace, "dl")) == 2, 120, "2 groups running")
    kube.custom.delete_namespaced_custom_object(contract.API_GROUP, contract.API_VERSION, namespace, contract.PLURAL,
                                                "dl")  # fmt: skip

    def gone() -> bool:
        pods = kube.core.list_namespaced_pod(namespace).items
        svcs = kube.core.list_namespaced_service(namespace).items
        secrets = [s for s in kube.core.list_namespaced_secret(namespace).items if s.metadata.name.startswith("dl-")]
        return not pods and not svcs and not secrets

    wait_for(gone, 120, "pods, Services and the Secret garbage-collected")
    with pytest.raises(client.ApiException) as e:
        kube.custom.get_namespaced_custom_object(contract.API_GROUP, contract.API_VERSION, namespace,
                                                 contract.PLURAL, "dl")  # fmt: skip
    assert e.value.status == 404


def test_success_then_ttl_deletes_the_job(kube, namespace, operators):
    operators()
    done = ["python", "-c", "print('FTJOB_DONE group=x step=0 digest=none')"]
    create_job(kube.custom, namespace, job_manifest("ok", command=done, replicas=2, ttlSecondsAfterFinished=3))
    job = wait_for(lambda: (j := get_job(kube.custom, namespace, "ok")) and condition(j, "Succeeded") and j, 120,
                   "condition Succeeded")  # fmt: skip
    assert job["status"]["completionTime"] and job["status"]["totalRestarts"] == 0
    assert {g["phase"] for g in job["status"]["replicaGroups"]} == {"Succeeded"}

    def deleted() -> bool:
        try:
            get_job(kube.custom, namespace, "ok")
            return False
        except client.ApiException as e:
            return e.status == 404

    wait_for(deleted, 60, "the job deleted by ttlSecondsAfterFinished")


def test_lighthouse_loss_is_repaired_without_touching_workers(kube, namespace, operators):
    operators()
    create_job(kube.custom, namespace, job_manifest("lh", replicas=2))
    before = wait_for(lambda: (g := running_groups(kube.core, namespace, "lh")) and len(g) == 2 and g, 120,
                      "2 groups running")  # fmt: skip
    old = wait_for(lambda: lighthouse_pod(kube.core, namespace, "lh"), 60, "the lighthouse running")
    # Only a lighthouse the operator has seen can be lost (one it never saw is simply created, under the same name).
    wait_for(lambda: get_job(kube.custom, namespace, "lh").get("status", {}).get("lighthouse", {}).get("seen"), 60,
             "the operator to record the lighthouse as seen")  # fmt: skip
    kube.core.delete_namespaced_pod(old.metadata.name, namespace, grace_period_seconds=0)
    new = wait_for(lambda: (p := lighthouse_pod(kube.core, namespace, "lh")).metadata.name == "lh-lighthouse-1" and p,
                   120, "a new lighthouse generation")  # fmt: skip
    assert new.metadata.uid != old.metadata.uid
    # the new lighthouse is told the desired count, and the untouched groups heartbeat to it through the Service
    wait_for(lambda: (s := lighthouse_status(kube.core, namespace, "lh")).desired_replicas == 2
             and len(s.members) == 2, 60, "the new lighthouse knows both groups")  # fmt: skip
    assert uids(running_groups(kube.core, namespace, "lh")) == uids(before)
    job = get_job(kube.custom, namespace, "lh")
    assert job["status"]["restartsByReason"] == {"LighthouseFailed": 1}


def test_group_cut_off_from_the_lighthouse_is_replaced(kube, namespace, operators):
    """A partitioned (or hung) group whose pods keep running: the lighthouse drops it on heartbeat timeout (5 s) and
    the operator replaces it once it stayed away twice that long, leaving the other group alone."""
    operators()
    create_job(kube.custom, namespace, job_manifest("cut", replicas=2, lighthouse={"heartbeatTimeoutSeconds": 5}))
    before = wait_for(lambda: (g := running_groups(kube.core, namespace, "cut")) and len(g) == 2 and g, 120,
                      "2 groups running")  # fmt: skip
    wait_for(lambda: len(lighthouse_status(kube.core, namespace, "cut").members) == 2, 60, "2 lighthouse members")
    # The operator only calls a group silent after it saw that group join (its status then shows the group's step).
    wait_for(lambda: all("step" in g for g in get_job(kube.custom, namespace, "cut")["status"]["replicaGroups"]), 60,
             "the operator to see both groups in the lighthouse")  # fmt: skip
    victim = before[1][0].metadata.name
    cluster("cut-pod", f"{namespace}/{victim}")
    after = wait_for(lambda: (g := running_groups(kube.core, namespace, "cut")) and len(g) == 2
                     and g[1][0].metadata.name != victim and g, 120, "group 1 replaced")  # fmt: skip
    assert uids(after)[0] == uids(before)[0]
    job = get_job(kube.custom, namespace, "cut")
    assert job["status"]["restartsByReason"] == {"HeartbeatLost": 1}, job["status"]
