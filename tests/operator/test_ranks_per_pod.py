"""spec.ranksPerPod: several rank processes per pod (one per GPU). The operator sets the pod's place in its group and
the group's world size, and runs the first container's command under `ftjob-trainer supervise`; with one rank per
pod the pods stay as they were."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from ftjob import contract
from ftjob.operator.kubectl import status_view
from ftjob.operator.resources import manifests as builders
from ftjob.operator.state.job_spec import JobSpec
from ftjob.operator.state.job_state import GroupState

from tests.support.paths import REPO
from tests.support.podfactory import JOB, spec

TRAINER = {"name": "trainer", "image": "img", "command": ["python", "train.py"], "args": ["--steps", "10"]}


def template(*containers: dict[str, Any]) -> dict[str, Any]:
    return {"spec": {"containers": list(containers or [TRAINER])}}


def env_list(pod: dict[str, Any], container: int = 0) -> list[dict[str, Any]]:
    return pod["spec"]["containers"][container]["env"]


def env_of(pod: dict[str, Any], container: int = 0) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in env_list(pod, container)}


def test_one_rank_per_pod_keeps_the_env_it_had_and_adds_the_pod_rank_names():
    trainer = {**TRAINER, "resources": {"limits": {"cpu": "4"}}}
    pod = builders.worker_pod(JOB, "ns", spec(template=template(trainer)), GroupState(index=1, generation=2), rank=1)
    assert env_list(pod) == [
        {"name": "GLOO_SOCKET_IFNAME", "value": "eth0"},
        {"name": "NCCL_SOCKET_IFNAME", "value": "eth0"},
        {"name": "TORCH_NCCL_ASYNC_ERROR_HANDLING", "value": "2"},
        {"name": "OMP_NUM_THREADS", "value": "4"},
        {"name": "FTJOB_JOB_NAME", "value": "demo"},
        {"name": "FTJOB_NAMESPACE", "value": "ns"},
        {"name": "FTJOB_LIGHTHOUSE_URL", "value": "https://demo-lighthouse.ns.svc.cluster.local:29510"},
        {"name": "FTJOB_TOKEN", "valueFrom": {"secretKeyRef": {"name": "demo-ftjob-token", "key": "token"}}},
        {"name": "FTJOB_REPLICA_GROUP", "value": "1"},
        {"name": "FTJOB_REPLICAS", "value": "3"},
        {"name": "FTJOB_MIN_REPLICAS", "value": "2"},
        {"name": "FTJOB_ADVERTISE_ADDR", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "FTJOB_RECOVERY_PORT", "value": "29520"},
        {"name": "FTJOB_STORE_PORT", "value": "29530"},
        {"name": "FTJOB_METRICS_PORT", "value": "29540"},
        {"name": "RANK", "value": "1"},
        {"name": "WORLD_SIZE", "value": "2"},
        {"name": "LOCAL_RANK", "value": "0"},
        {"name": "LOCAL_WORLD_SIZE", "value": "1"},
        {"name": "FTJOB_RANKS_PER_POD", "value": "1"},
        {"name": "FTJOB_POD_RANK", "value": "1"},
        {"name": "MASTER_ADDR", "value": "demo-g1-2-r0.demo-g1.ns.svc.cluster.local"},
        {"name": "MASTER_PORT", "value": "29500"},
        {"name": "FTJOB_GRADIENT_GUARD", "value": "1"},
        {"name": "FTJOB_GUARD_NORM_RATIO", "value": "100"},
        {"name": "FTJOB_DIGEST_EVERY", "value": "100"},
        {"name": "FTJOB_GENERATION", "value": "2"},
        {"name": "FTJOB_TLS_CA_FILE", "value": "/etc/ftjob/tls/ca.crt"},
        {"name": "FTJOB_TLS_CERT_FILE", "value": "/etc/ftjob/tls/worker.crt"},
        {"name": "FTJOB_TLS_KEY_FILE", "value": "/etc/ftjob/tls/worker.key"},
    ]
    container = pod["spec"]["containers"][0]
    assert container["command"] == TRAINER["command"] and container["args"] == TRAINER["args"], "not wrapped"
    assert container["ports"] == [{"name": "metrics", "containerPort": contract.TRAINER_METRICS_PORT}]


def test_several_ranks_per_pod_get_the_pod_rank_and_run_under_the_supervisor():
    trainer = {
        **TRAINER,
        "env": [{"name": "RANK", "value": "7"}, {"name": "LOCAL_RANK", "value": "3"}, {"name": "MINE", "value": "x"}],
        "resources": {"limits": {"cpu": "9", "nvidia.com/gpu": 2}},
    }
    side = {"name": "side", "image": "img", "command": ["sleep", "inf"], "resources": {"requests": {"cpu": "2"}}}
    s = spec(podsPerReplica=2, ranksPerPod=2, template=template(trainer, side))
    assert s.ranks_per_group == 4
    pod = builders.worker_pod(JOB, "ns", s, GroupState(index=0, generation=0), rank=1)
    env = env_of(pod)
    assert env[contract.ENV_WORLD_SIZE] == "4" and env[contract.ENV_LOCAL_WORLD_SIZE] == "2"
    assert env[contract.ENV_RANKS_PER_POD] == "2" and env[contract.ENV_POD_RANK] == "1"
    # the supervisor sets RANK and LOCAL_RANK per rank: neither the operator's nor the template's is on the pod
    assert contract.ENV_RANK not in env and contract.ENV_LOCAL_RANK not in env and env["MINE"] == "x"
    assert env[contract.ENV_MASTER_ADDR] == "demo-g0-0-r0.demo-g0.ns.svc.cluster.local"
    # the pod-level bases: the supervisor gives local rank k rank_port(base, k)
    assert env[contract.ENV_RECOVERY_PORT] == str(contract.RECOVERY_PORT)
    assert env[contract.ENV_METRICS_PORT] == str(contract.TRAINER_METRICS_PORT)
    assert env["OMP_NUM_THREADS"] == "4", "the container's cores are shared out between its ranks"
    trainer_out, side_out = pod["spec"]["containers"]
    assert trainer_out["command"] == ["ftjob-trainer", "supervise", "--", "python", "train.py"]
    assert trainer_out["args"] == ["--steps", "10"], "Kubernetes appends args after the wrapped command"
    assert side_out["command"] == ["sleep", "inf"], "only the first container runs the ranks"
    assert env_of(pod, 1)["OMP_NUM_THREADS"] == "2" and env_of(pod, 1)[contract.ENV_POD_RANK] == "1"
    assert trainer_out["ports"] == [
        {"name": "metrics", "containerPort": contract.TRAINER_METRICS_PORT},
        {"name": "metrics-1", "containerPort": contract.rank_port(contract.TRAINER_METRICS_PORT, 1)},
    ]
    assert "ports" not in side_out
    assert s.template["spec"]["containers"][0]["command"] == ["python", "train.py"], "the job's template was mutated"


def test_one_pod_of_several_ranks_meets_on_its_own_ip():
    pod = builders.worker_pod(JOB, "ns", spec(podsPerReplica=1, ranksPerPod=8, template=template()), GroupState(0), 0)
    master = next(e for e in env_list(pod) if e["name"] == contract.ENV_MASTER_ADDR)
    assert master["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert env_of(pod)[contract.ENV_WORLD_SIZE] == "8" and env_of(pod)[contract.ENV_POD_RANK] == "0"


def test_a_command_that_already_starts_the_supervisor_is_not_wrapped_twice():
    own = {**TRAINER, "command": ["ftjob-trainer", "supervise", "--", "python", "train.py"]}
    pod = builders.worker_pod(JOB, "ns", spec(ranksPerPod=2, template=template(own)), GroupState(0), 0)
    assert pod["spec"]["containers"][0]["command"] == own["command"]


def test_every_local_rank_gets_a_named_metrics_port_and_declared_ones_are_kept():
    s = spec(ranksPerPod=contract.MAX_RANKS_PER_POD, template=template())
    ports = builders.worker_pod(JOB, "ns", s, GroupState(0), 0)["spec"]["containers"][0]["ports"]
    assert [p["containerPort"] for p in ports] == [
        contract.rank_port(contract.TRAINER_METRICS_PORT, k) for k in range(contract.MAX_RANKS_PER_POD)
    ]
    names = [p["name"] for p in ports]
    assert names[:2] == ["metrics", "metrics-1"] and len(set(names)) == len(names)
    assert all(len(n) <= 15 for n in names), "Kubernetes refuses port names over 15 characters"
    mine = {**TRAINER, "ports": [{"name": "metrics-1", "containerPort": 29640}]}
    ports = builders.worker_pod(JOB, "ns", spec(ranksPerPod=3, template=template(mine)), GroupState(0), 0)["spec"][
        "containers"
    ][0]["ports"]
    assert ports == [
        {"name": "metrics-1", "containerPort": 29640},
        {"name": "metrics", "containerPort": 29540},
        {"name": "metrics-2", "containerPort": 29740},
    ]


@pytest.mark.parametrize("value", [0, 17, -1, "2", 2.0, True, None])
def test_ranks_per_pod_out_of_range_is_refused_naming_the_field(value):
    with pytest.raises(ValueError, match=r"spec\.ranksPerPod must be an integer in 1\.\.16"):
        spec(ranksPerPod=value, template=template())


def test_several_ranks_per_pod_need_the_first_containers_command():
    no_command = {"name": "trainer", "image": "img", "args": ["--steps", "10"]}
    with pytest.raises(ValueError, match=r"containers\[0\]\.command.*ENTRYPOINT"):
        spec(ranksPerPod=2, template=template(no_command))
    assert spec(ranksPerPod=1, template=template(no_command)).ranks_per_pod == 1  # one rank: nothing to wrap


def test_defaults_and_the_group_world_size():
    s = JobSpec.from_dict({"template": template()})
    assert (s.ranks_per_pod, s.ranks_per_group) == (1, 1)
    assert spec(podsPerReplica=3, ranksPerPod=8, template=template()).ranks_per_group == 24


def test_the_crd_bounds_ranks_per_pod_like_the_contract():
    crd = yaml.safe_load((REPO / "crds" / "ftjob.dev_faulttoleranttrainingjobs.yaml").read_text())
    (version,) = crd["spec"]["versions"]
    job_spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    field = job_spec["properties"]["ranksPerPod"]
    assert (field["minimum"], field["maximum"], field["default"]) == (1, contract.MAX_RANKS_PER_POD, 1)
    assert field["x-kubernetes-validations"][0]["rule"] == "self == oldSelf"
    rules = " ".join(r["rule"] for r in job_spec["x-kubernetes-validations"])
    assert "containers[0].command" in rules and "nvidia__dot__com__slash__gpu" in rules


def test_the_gpu_example_is_the_hsdp_shape():
    raw = yaml.safe_load((REPO / "crds" / "examples" / "gpu-llm.yaml").read_text())
    s = JobSpec.from_dict(raw["spec"])
    assert (s.pods_per_replica, s.ranks_per_pod, s.ranks_per_group) == (2, 8, 16)
    pod = builders.worker_pod(raw["metadata"]["name"], "ns", s, GroupState(0), 1)
    trainer = pod["spec"]["containers"][0]
    assert trainer["command"][:3] == ["ftjob-trainer", "supervise", "--"]
    assert int(trainer["resources"]["limits"]["nvidia.com/gpu"]) % s.ranks_per_pod == 0
    args = trainer["args"]
    assert int(args[args.index("--batch-size") + 1]) % s.ranks_per_group == 0, "the trainer splits it over the group"
    assert env_of(pod)[contract.ENV_WORLD_SIZE] == "16"


def test_kubectl_status_shows_the_shape_in_ranks():
    job = {"metadata": {"name": "j"}, "spec": {"replicas": 2, "podsPerReplica": 1, "ranksPerPod": 2}}
    assert "Shape:     2 groups x 1 pod x 2 ranks   (2 ranks per group)" in status_view.render(job, [], 0.0)
    job["spec"] = {"replicas": 8, "spareReplicas": 1, "podsPerReplica": 2, "ranksPerPod": 8}
    assert "Shape:     9 groups x 2 pods x 8 ranks   (16 ranks per group)" in status_view.render(job, [], 0.0)
