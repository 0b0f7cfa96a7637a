"""Unit tests of the pure parts around the planner: manifests, status round-trip, lighthouse parsing, settings."""

from __future__ import annotations

import json

import pytest
from ftjob import contract
from ftjob.contract.lighthouse_api import DroppedEvent, MemberStatus, RestoredEvent, StatusResponse
from ftjob.operator.lighthouse.view import LighthouseView
from ftjob.operator.planning.plan import Observed, plan
from ftjob.operator.resources import manifests as builders
from ftjob.operator.runtime.settings import parse
from ftjob.operator.state.job_spec import JobSpec
from ftjob.operator.state.job_state import GroupState, PodView
from ftjob.operator.state.status import build_status, state_from_status, status_events

from tests.support.podfactory import JOB, healthy_job, spec, worker

NOW = 2_000_000.0


def env_of(pod: dict) -> dict[str, dict]:
    return {e["name"]: e for e in pod["spec"]["containers"][0]["env"]}


def test_worker_pod_carries_identity_dns_contract_env_and_user_template():
    s = spec(
        template={
            "metadata": {"labels": {"team": "x"}},
            "spec": {
                "containers": [
                    {
                        "name": "trainer",
                        "image": "img",
                        "env": [{"name": "RANK", "value": "99"}, {"name": "MINE", "value": "1"}],
                        "resources": {"limits": {"nvidia.com/gpu": 8, "cpu": 1.5}},
                    }
                ],
                "nodeSelector": {"pool": "gpu"},
            },
        }
    )
    pod = builders.worker_pod(JOB, "ns", s, GroupState(index=2, generation=3), rank=1)
    assert pod["metadata"]["name"] == "demo-g2-3-r1"
    labels = pod["metadata"]["labels"]
    assert labels["team"] == "x" and labels[contract.LABEL_GROUP] == "2" and labels[contract.LABEL_GENERATION] == "3"
    assert pod["spec"]["hostname"] == "demo-g2-3-r1" and pod["spec"]["subdomain"] == "demo-g2"
    assert pod["spec"]["restartPolicy"] == "Never" and pod["spec"]["nodeSelector"] == {"pool": "gpu"}
    env = env_of(pod)
    assert env["RANK"]["value"] == "1", "the contract must win over the template"
    assert env["MINE"]["value"] == "1" and env["WORLD_SIZE"]["value"] == "2"
    assert env[contract.ENV_MASTER_ADDR]["value"] == "demo-g2-3-r0.demo-g2.ns.svc.cluster.local"
    assert env[contract.ENV_LIGHTHOUSE_URL]["value"] == "https://demo-lighthouse.ns.svc.cluster.local:29510"
    assert env[contract.ENV_TOKEN]["valueFrom"]["secretKeyRef"] == {"name": "demo-ftjob-token", "key": "token"}
    assert (
        pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "8"
        and pod["spec"]["containers"][0]["resources"]["limits"]["cpu"] == "1.5"
    )
    assert "affinity" not in pod["spec"]
    assert s.template["spec"]["containers"][0]["env"][0]["value"] == "99", "the job's template was mutated"


@pytest.mark.parametrize(
    ("container", "threads"),
    [
        ({"resources": {"limits": {"cpu": "2"}, "requests": {"cpu": "500m"}}}, "2"),  # the limit, not the request
        ({"resources": {"requests": {"cpu": "32"}}}, "32"),
        ({"resources": {"limits": {"cpu": 1.5}}}, "1"),  # whole cores
        ({"resources": {"requests": {"cpu": "250m"}}}, "1"),  # at least one
        ({"resources": {"limits": {"cpu": "4"}}, "env": [{"name": "OMP_NUM_THREADS", "value": "3"}]}, "3"),
        ({"resources": {"limits": {"memory": "1Gi"}}}, None),  # no CPU asked: torch's own default
        ({"resources": {"limits": {"cpu": "4"}}, "envFrom": [{"configMapRef": {"name": "x"}}]}, None),
        ({"resources": {"limits": {"cpu": "four"}}}, None),  # the API server refuses the pod and says why
    ],
)
def test_worker_threads_default_to_the_containers_cpu(container, threads):
    s = spec(template={"spec": {"containers": [{"name": "trainer", "image": "img", **container}]}})
    entries = builders.worker_pod(JOB, "ns", s, GroupState(index=0, generation=0), rank=0)["spec"]["containers"][0]
    values = [e["value"] for e in entries["env"] if e["name"] == "OMP_NUM_THREADS"]
    assert values == ([] if threads is None else [threads])


def test_single_rank_group_meets_itself_on_its_pod_ip():
    pod = builders.worker_pod(JOB, "ns", spec(podsPerReplica=1), GroupState(index=0), rank=0)
    assert env_of(pod)[contract.ENV_MASTER_ADDR]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"


@pytest.mark.parametrize("required", [True, False])
def test_replacement_avoids_the_failed_node_and_keeps_template_affinity(required):
    term = {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["gpu"]}]}
    template = {
        "spec": {
            "containers": [{"name": "t", "image": "i"}],
            "affinity": {
                "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [term]}}
            },
        }
    }
    g = GroupState(index=0, generation=1, avoid_node="node-7", avoid_required=required)
    affinity = builders.worker_pod(JOB, "ns", spec(template=template), g, 0)["spec"]["affinity"]["nodeAffinity"]
    avoid = {"key": "kubernetes.io/hostname", "operator": "NotIn", "values": ["node-7"]}
    terms = affinity["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert terms[0]["matchExpressions"][0]["key"] == "pool"
    if required:
        assert avoid in terms[0]["matchExpressions"]
    else:
        assert affinity["preferredDuringSchedulingIgnoredDuringExecution"][0]["preference"]["matchExpressions"] == [
            avoid
        ]


def test_lighthouse_pod_and_services():
    s = spec(lighthouse={"heartbeatTimeoutSeconds": 7, "resources": {"requests": {"cpu": "1"}}})
    pod = builders.lighthouse_pod(JOB, "ns", s, 2)
    c = pod["spec"]["containers"][0]
    assert pod["metadata"]["name"] == "demo-lighthouse-2" and c["command"] == ["ftjob-trainer", "lighthouse"]
    assert c["image"] == "ftjob-trainer" and c["resources"] == {"requests": {"cpu": "1"}}
    env = {e["name"]: e for e in c["env"]}
    assert env[contract.ENV_HEARTBEAT_TIMEOUT_S]["value"] == "7"
    assert env[contract.ENV_LIGHTHOUSE_BIND]["value"] == "0.0.0.0:29510"
    assert contract.ENV_RESTORE_STEP not in env  # a job's first lighthouse starts blank
    replacement = builders.lighthouse_pod(JOB, "ns", s, 3, restore_quorum_id=9, restore_step=170)
    env = {e["name"]: e.get("value") for e in replacement["spec"]["containers"][0]["env"]}
    assert env[contract.ENV_RESTORE_QUORUM_ID] == "9" and env[contract.ENV_RESTORE_STEP] == "170"
    svc = builders.group_service(JOB, "ns", 4)
    assert svc["metadata"]["name"] == "demo-g4" and svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["publishNotReadyAddresses"] and svc["spec"]["ports"][0]["targetPort"] == 29500
    secret = builders.token_secret(JOB, "ns")
    assert len(secret["stringData"]["token"]) >= 32
    assert secret["stringData"]["token"] != builders.token_secret(JOB, "ns")["stringData"]["token"]


@pytest.mark.parametrize("tls", [True, False])
def test_only_the_lighthouse_pod_gets_the_operators_token(tls: bool):
    """The membership API takes only the operator's token: its Secret is the lighthouse pod's alone, so no code in a
    worker pod can act as the operator; the workers' token goes to every pod."""
    template = {"spec": {"containers": [{"name": "trainer", "image": "img", "command": ["python", "train.py"]}]}}
    s = spec(tls={"enabled": tls}, ranksPerPod=2, template=template)  # several ranks: the supervisor's env too
    operator = builders.operator_token_secret(JOB, "ns")
    workers = builders.token_secret(JOB, "ns")
    assert operator["metadata"]["name"] == "demo-ftjob-operator-token" != workers["metadata"]["name"]
    assert operator["metadata"]["labels"][contract.LABEL_JOB] == JOB
    token = operator["stringData"][contract.TOKEN_SECRET_KEY]
    assert len(token) >= 32 and token != workers["stringData"][contract.TOKEN_SECRET_KEY]
    assert token != builders.operator_token_secret(JOB, "ns")["stringData"][contract.TOKEN_SECRET_KEY]  # random

    env = env_of(builders.lighthouse_pod(JOB, "ns", s, 0))
    ref = {"name": "demo-ftjob-operator-token", "key": contract.TOKEN_SECRET_KEY}
    assert env[contract.ENV_OPERATOR_TOKEN]["valueFrom"]["secretKeyRef"] == ref
    assert env[contract.ENV_TOKEN]["valueFrom"]["secretKeyRef"]["name"] == "demo-ftjob-token"
    for rank in range(s.pods_per_replica):
        pod = builders.worker_pod(JOB, "ns", s, GroupState(index=1, generation=0), rank)
        assert env_of(pod)[contract.ENV_TOKEN]["valueFrom"]["secretKeyRef"]["name"] == "demo-ftjob-token"
        text = json.dumps(pod)
        assert "demo-ftjob-operator-token" not in text and contract.ENV_OPERATOR_TOKEN not in text, rank


def test_pod_view_reads_exit_codes_and_termination():
    view = PodView.from_pod(
        {"name": "p", "deletionTimestamp": "2026-01-01T00:00:00Z",
         "labels": {contract.LABEL_GROUP: "1", contract.LABEL_GENERATION: "2", contract.LABEL_ROLE: "worker"}},
        {"nodeName": "n1"},
        {"phase": "Failed", "containerStatuses": [
            {"name": "side", "state": {"terminated": {"exitCode": 0}}},
            {"name": "trainer", "state": {"terminated": {"exitCode": 137}}}]},
    )  # fmt: skip
    assert (view.group, view.generation, view.exit_code, view.exit_container) == (1, 2, 137, "trainer")
    assert view.deletion_time is not None and view.node == "n1" and view.terminal


def test_status_round_trips_the_operator_memory_and_shows_progress():
    s = spec()
    r = plan(JOB, s, state_from_status(None), Observed(healthy_job(s), None, set(), NOW))
    pods = healthy_job(s)
    pods[pods.index(worker(0, 0))] = worker(0, 0, phase="Failed", exit_code=1)
    r = plan(JOB, s, r.state, Observed(pods, None, set(), NOW + 1))

    def member(group: str, finished: bool = False, digest: str | None = None) -> MemberStatus:
        return MemberStatus(group=group, incarnation=f"i{group}", step=42, address="", last_heartbeat_age_s=0.1,
                            in_quorum=True, asking=False, healing=False, contributing=True, finished=finished,
                            param_digest=digest)  # fmt: skip

    lh = LighthouseView.from_status(
        StatusResponse(quorum_id=7, max_step=42, abort_below=0, min_replicas=1, quorum_groups=["1", "2"],
                       members=[member("1"), member("2", finished=True, digest="abc")], starting=[], blocked_reason="",
                       history=[DroppedEvent(time=1.0, group="0", reason="evicted: pod died")])
    )  # fmt: skip
    status = build_status(job=JOB, spec=s, state=r.state, phases=r.group_phases, pods=pods, lighthouse=lh,
                          previous=None, generation=3, now=NOW + 1)  # fmt: skip
    assert status["quorum"] == {"id": 7, "size": 2, "step": 42}
    assert status["totalRestarts"] == 1 and status["restartsByReason"] == {"ExitCode": 1}
    conds = {c["type"]: c for c in status["conditions"]}
    assert conds["Recovering"]["status"] == "True" and conds["Degraded"]["status"] == "True"
    assert conds["Running"]["status"] == "True" and status["phase"] == "Recovering"
    assert all(c["observedGeneration"] == 3 for c in conds.values())
    g2 = next(g for g in status["replicaGroups"] if g["index"] == 2)
    assert g2["paramDigest"] == "abc" and g2["finished"] and g2["step"] == 42
    assert lh.evicted == {"0": "evicted: pod died"} and lh.finished_groups == {2}
    back = state_from_status(status)
    assert back.groups == r.state.groups and back.total_restarts == 1 and back.start_time == pytest.approx(NOW, abs=1)
    # a replacement lighthouse reports lower figures until the groups catch it up: status never goes back
    blank = LighthouseView.from_status(
        StatusResponse(quorum_id=0, max_step=0, abort_below=0, min_replicas=1, quorum_groups=[], members=[],
                       starting=[], blocked_reason="", history=[])
    )  # fmt: skip
    later = build_status(job=JOB, spec=s, state=r.state, phases=r.group_phases, pods=pods, lighthouse=blank,
                         previous=status, generation=3, now=NOW + 2)  # fmt: skip
    assert later["quorum"] == {"id": 7, "size": 0, "step": 42}
    # an unchanged condition keeps its transition time
    again = build_status(job=JOB, spec=s, state=r.state, phases=r.group_phases, pods=pods, lighthouse=lh,
                         previous=status, generation=3, now=NOW + 500)  # fmt: skip
    assert {c["type"]: c["lastTransitionTime"] for c in again["conditions"]} == {
        c["type"]: c["lastTransitionTime"] for c in status["conditions"]
    }


def test_conditions_of_a_finished_job_say_it_ended_not_that_groups_are_down():
    s = spec()
    state = plan(JOB, s, state_from_status(None), Observed(healthy_job(s), None, set(), NOW)).state
    state.outcome, state.outcome_reason, state.outcome_message = "Succeeded", "AllGroupsFinished", "done"
    phases = dict.fromkeys(state.groups, "Succeeded")
    status = build_status(job=JOB, spec=s, state=state, phases=phases, pods=[], lighthouse=None, previous=None,
                          generation=1, now=NOW)  # fmt: skip
    conds = {c["type"]: c for c in status["conditions"]}
    assert status["phase"] == "Succeeded" and conds["Succeeded"]["status"] == "True"
    for ctype in ("Running", "Degraded"):
        assert conds[ctype]["status"] == "False" and conds[ctype]["reason"] == "JobEndedSucceeded", conds[ctype]
        assert "not running" not in conds[ctype]["message"], conds[ctype]


def test_spec_defaults_match_the_crd():
    s = JobSpec.from_dict({"template": {"spec": {"containers": [{"name": "t", "image": "i"}]}}})
    assert (s.replicas, s.min_replicas, s.pods_per_replica, s.spare_replicas) == (1, 1, 1, 0)
    fp = s.failure_policy
    assert (fp.max_restarts_per_group, fp.restart_window_s, fp.max_total_restarts) == (3, 600, 20)
    assert (fp.backoff_base_s, fp.backoff_max_s) == (1, 60)
    assert (s.lighthouse.join_timeout_s, s.lighthouse.heartbeat_timeout_s) == (1, 5)


def test_cli_settings_and_clear_errors(capsys):
    st = parse(["--namespace", "a", "--namespace", "b", "--no-leader-election", "--metrics-port", "0"])
    assert st.namespaces == ("a", "b") and not st.all_namespaces and not st.leader_election
    assert st.lease_namespace == "a" and st.metrics_port == 0
    assert parse([]).all_namespaces
    with pytest.raises(SystemExit):
        parse(["--lease-duration", "1"])
    assert "--lease-duration must be at least 2 seconds" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse(["--health-port", "70000"])
    assert "--health-port must be between 0 and 65535" in capsys.readouterr().err


def test_a_restore_lowers_the_reported_step_once_and_says_so_in_an_event():
    s = spec()
    r = plan(JOB, s, state_from_status(None), Observed(healthy_job(s), None, set(), NOW))
    pods = healthy_job(s)

    def view(quorum_id: int, step: int, restore: RestoredEvent | None = None) -> LighthouseView:
        return LighthouseView.from_status(
            StatusResponse(quorum_id=quorum_id, max_step=step, abort_below=0, min_replicas=1, quorum_groups=["0"],
                           members=[], starting=[], blocked_reason="", history=[], last_restore=restore)
        )  # fmt: skip

    def build(lh: LighthouseView, previous: dict | None) -> dict:
        return build_status(job=JOB, spec=s, state=r.state, phases=r.group_phases, pods=pods, lighthouse=lh,
                            previous=previous, generation=1, now=NOW)  # fmt: skip

    before = build(view(7, 183), None)
    assert before["quorum"]["step"] == 183 and "restored" not in before
    restore = RestoredEvent(time=5.0, quorum_id=8, from_step=183, to_step=150)
    after = build(view(8, 150, restore), before)
    assert after["quorum"]["step"] == 150 and after["restored"]["fromStep"] == 183
    events = status_events(before, after)
    assert [(t, reason) for t, reason, _ in events] == [("Warning", "Restored")]
    assert "checkpoint of step 150" in events[0][2] and "33 committed steps" in events[0][2]
    # from then on the floor holds again: a replacement lighthouse catching up does not lower it, nor re-announce
    blank = build(view(8, 0), after)
    assert blank["quorum"]["step"] == 150 and blank["restored"] == after["restored"]
    assert status_events(after, blank) == []
    assert view(8, 150, restore).replaying and not view(9, 183, restore).replaying
    lost = build(view(12, 0, RestoredEvent(time=9.0, quorum_id=12, from_step=150, to_step=0)), after)
    assert "from step 0: no group brought back a checkpoint" in status_events(after, lost)[0][2]


def test_a_replacement_lighthouse_without_survivors_learns_the_step_but_does_not_wait_for_it():
    def env(pod: dict) -> dict:
        return {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}

    waits = env(builders.lighthouse_pod(JOB, "ns", spec(), 2, 7, 183))
    assert waits[contract.ENV_RESTORE_STEP] == "183" and contract.ENV_RESTORE_WINDOW_S not in waits
    no_wait = env(builders.lighthouse_pod(JOB, "ns", spec(), 2, 7, 183, restore_window_s=0.0))
    assert no_wait[contract.ENV_RESTORE_STEP] == "183" and no_wait[contract.ENV_RESTORE_WINDOW_S] == "0"
