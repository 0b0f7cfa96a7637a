"""The lighthouse pod without a cluster: Pod Security Admission `restricted`, Guaranteed default resources, the
placement fields of spec.lighthouse (and which default to the worker template's), and the Running condition while no
lighthouse pod runs."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from ftjob.operator.planning.stuck import LIGHTHOUSE
from ftjob.operator.resources import manifests as builders
from ftjob.operator.state.job_spec import JobSpec
from ftjob.operator.state.job_state import PodView
from ftjob.operator.state.status import REASON_LIGHTHOUSE_NOT_RUNNING, build_status
from test_plan import NOW, run, steady

from tests.support.podfactory import JOB, healthy_job, lighthouse, spec

# Pod Security Admission's `restricted` profile (which includes `baseline`): the volume types it allows, the one
# capability a container may add, the sysctls baseline calls safe.
PSA_VOLUME_TYPES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected",
                    "secret"}  # fmt: skip
PSA_SAFE_SYSCTLS = {"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
                    "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
                    "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
                    "net.ipv4.tcp_keepalive_probes"}  # fmt: skip
SECCOMP_OK = {"RuntimeDefault", "Localhost"}


def psa_restricted_violations(pod: dict[str, Any]) -> list[str]:
    """What Pod Security Admission `restricted:latest` would refuse in `pod`, one line per broken rule:

    baseline: no hostNetwork/hostPID/hostIPC; no privileged container; no hostPath volume; no hostPort; capabilities
    added only from baseline's list (restricted narrows it to NET_BIND_SERVICE); no Unconfined seccomp or AppArmor
    profile; no custom SELinux user or role; procMount Default; only safe sysctls.
    restricted: only the listed volume types; allowPrivilegeEscalation false in every container; runAsNonRoot true
    (at pod level, or in every container) and never false in a container; runAsUser never 0; seccompProfile
    RuntimeDefault or Localhost (at pod level, or in every container); capabilities drop ALL in every container."""
    spec = pod["spec"]
    psc = spec.get("securityContext") or {}
    containers = [*(spec.get("initContainers") or []), *spec["containers"], *(spec.get("ephemeralContainers") or [])]
    out = [f"spec.{k} is true" for k in ("hostNetwork", "hostPID", "hostIPC") if spec.get(k)]
    for volume in spec.get("volumes") or []:
        kinds = set(volume) - {"name"}
        if not kinds <= PSA_VOLUME_TYPES:
            out.append(f"volume {volume['name']} is of type {sorted(kinds - PSA_VOLUME_TYPES)}")
    out += [f"sysctl {s['name']} is not safe" for s in psc.get("sysctls") or [] if s["name"] not in PSA_SAFE_SYSCTLS]

    def profile_bad(sc: dict[str, Any]) -> list[str]:
        bad = []
        if (sc.get("seccompProfile") or {}).get("type") == "Unconfined":
            bad.append("seccompProfile Unconfined")
        if (sc.get("appArmorProfile") or {}).get("type") == "Unconfined":
            bad.append("appArmorProfile Unconfined")
        se = sc.get("seLinuxOptions") or {}
        if se.get("user") or se.get("role"):
            bad.append("seLinuxOptions user/role set")
        if sc.get("runAsUser") == 0:
            bad.append("runAsUser 0")
        return bad

    out += [f"pod: {b}" for b in profile_bad(psc)]
    for c in containers:
        sc = c.get("securityContext") or {}
        name = c["name"]
        out += [f"container {name}: {b}" for b in profile_bad(sc)]
        if sc.get("privileged"):
            out.append(f"container {name} is privileged")
        if sc.get("procMount", "Default") != "Default":
            out.append(f"container {name}: procMount {sc['procMount']}")
        if any(p.get("hostPort") for p in c.get("ports") or []):
            out.append(f"container {name} has a hostPort")
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"container {name}: allowPrivilegeEscalation is not false")
        caps = sc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            out.append(f"container {name}: capabilities do not drop ALL")
        if set(caps.get("add") or []) - {"NET_BIND_SERVICE"}:
            out.append(f"container {name}: adds capabilities {caps['add']}")
        if sc.get("runAsNonRoot") is False or not (sc.get("runAsNonRoot") or psc.get("runAsNonRoot")):
            out.append(f"container {name}: runAsNonRoot is not true")
        if (sc.get("seccompProfile") or psc.get("seccompProfile") or {}).get("type") not in SECCOMP_OK:
            out.append(f"container {name}: no RuntimeDefault or Localhost seccompProfile")
    return out


def lighthouse_spec(**lh: Any) -> JobSpec:
    return spec(lighthouse=lh)


# --- Pod Security Admission -------------------------------------------------------------------------------------
@pytest.mark.parametrize("tls", [True, False])
def test_the_lighthouse_pod_passes_psa_restricted(tls):
    bare = {"spec": {"containers": [{"name": "c"}], "volumes": [{"name": "h", "hostPath": {"path": "/"}}]}}
    found = psa_restricted_violations(bare)  # the check itself sees what restricted refuses
    assert "volume h is of type ['hostPath']" in found and "container c: runAsNonRoot is not true" in found
    assert "container c: allowPrivilegeEscalation is not false" in found
    assert "container c: capabilities do not drop ALL" in found
    assert "container c: no RuntimeDefault or Localhost seccompProfile" in found
    # a root-by-default image and a template that asks for root: neither reaches the lighthouse
    template = {"spec": {"securityContext": {"runAsUser": 0}, "containers": [{"name": "t", "image": "root-image"}]}}
    pod = builders.lighthouse_pod(JOB, "ns", spec(template=template, tls={"enabled": tls}), 0)
    assert psa_restricted_violations(pod) == []


def test_the_lighthouse_runs_as_a_fixed_non_root_user_with_a_read_only_root_and_scratch_in_tmp():
    pod = builders.lighthouse_pod(JOB, "ns", spec(), 0)["spec"]
    assert pod["securityContext"] == {"runAsNonRoot": True, "runAsUser": 65532, "runAsGroup": 65532,
                                      "fsGroup": 65532, "seccompProfile": {"type": "RuntimeDefault"}}  # fmt: skip
    assert pod["automountServiceAccountToken"] is False
    (c,) = pod["containers"]
    assert c["securityContext"] == {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
                                    "readOnlyRootFilesystem": True, "runAsNonRoot": True}  # fmt: skip
    (scratch,) = [v for v in pod["volumes"] if v["name"] == builders.LIGHTHOUSE_SCRATCH_VOLUME]
    assert scratch == {"name": "tmp", "emptyDir": {}}
    assert {"name": "tmp", "mountPath": "/tmp"} in c["volumeMounts"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["HOME"] == "/tmp", "Python and libraries write under HOME; the root filesystem is read-only"


# --- resources ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("resources", [None, {}])
def test_resources_default_to_guaranteed_and_the_users_are_used_exactly(resources):
    s = lighthouse_spec() if resources is None else lighthouse_spec(resources=resources)
    c = builders.lighthouse_pod(JOB, "ns", s, 0)["spec"]["containers"][0]
    want = {"cpu": "500m", "memory": "512Mi"}
    assert c.get("resources") == {"requests": want, "limits": want}, "requests == limits: Guaranteed QoS"
    c["resources"]["limits"]["cpu"] = "9"  # the default itself is never handed out to be changed
    assert builders.LIGHTHOUSE_DEFAULT_RESOURCES["limits"]["cpu"] == "500m"
    s = lighthouse_spec(resources={"requests": {"cpu": 2, "memory": "1Gi"}})
    c = builders.lighthouse_pod(JOB, "ns", s, 0)["spec"]["containers"][0]
    assert c["resources"] == {"requests": {"cpu": "2", "memory": "1Gi"}}, "no limits added, no default mixed in"


# --- placement ---------------------------------------------------------------------------------------------------
PLACEMENT = {
    "nodeSelector": {"pool": "cpu"},
    "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "infra", "effect": "NoSchedule"}],
    "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}]}}},
    "priorityClassName": "coordinator",
    "imagePullSecrets": [{"name": "lh-registry"}],
}  # fmt: skip
WORKER_TEMPLATE = {
    "spec": {
        "nodeSelector": {"accelerator": "h100"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []}},
        "priorityClassName": "training",
        "imagePullSecrets": [{"name": "registry"}],
        "containers": [{"name": "trainer", "image": "private.example/trainer"}],
    }
}


def test_every_placement_field_is_passed_through():
    pod = builders.lighthouse_pod(JOB, "ns", spec(template=WORKER_TEMPLATE, lighthouse=PLACEMENT), 0)["spec"]
    for key, value in PLACEMENT.items():
        assert pod[key] == value, key


def test_pull_secrets_and_priority_default_to_the_templates_but_node_placement_is_never_copied():
    pod = builders.lighthouse_pod(JOB, "ns", spec(template=WORKER_TEMPLATE), 0)["spec"]
    assert pod["containers"][0]["image"] == "private.example/trainer"
    assert pod["imagePullSecrets"] == [{"name": "registry"}], "the workers' image from the workers' registry"
    assert pod["priorityClassName"] == "training", "never preempted before the job it coordinates"
    for key in ("nodeSelector", "tolerations", "affinity"):
        assert key not in pod, f"{key}: the lighthouse needs a CPU only, not the workers' GPU nodes"
    opted_out = spec(template=WORKER_TEMPLATE, lighthouse={"priorityClassName": "", "imagePullSecrets": []})
    pod = builders.lighthouse_pod(JOB, "ns", opted_out, 0)["spec"]
    assert "priorityClassName" not in pod and "imagePullSecrets" not in pod, "explicit values are used as given"
    bare = builders.lighthouse_pod(JOB, "ns", spec(), 0)["spec"]
    assert not {"priorityClassName", "imagePullSecrets", "nodeSelector", "tolerations", "affinity"} & set(bare)


@pytest.mark.parametrize(
    "field, value",
    [
        ("nodeSelector", ["pool=cpu"]),
        ("nodeSelector", {"pool": 3}),
        ("tolerations", {"key": "x"}),
        ("tolerations", ["x"]),
        ("affinity", ["x"]),
        ("priorityClassName", 5),
        ("imagePullSecrets", "registry"),
        ("imagePullSecrets", [{"secret": "registry"}]),
        ("resources", "1 CPU"),
    ],
)
def test_a_placement_field_of_the_wrong_type_is_refused_by_name(field, value):
    with pytest.raises(ValueError, match=rf"spec\.lighthouse\.{field} must "):
        lighthouse_spec(**{field: value})


def test_spec_parses_the_placement_fields():
    lh = spec(lighthouse=PLACEMENT).lighthouse
    assert lh.node_selector == {"pool": "cpu"} and lh.tolerations == tuple(PLACEMENT["tolerations"])
    assert lh.affinity == PLACEMENT["affinity"] and lh.priority_class_name == "coordinator"
    assert lh.image_pull_secrets == ({"name": "lh-registry"},)
    unset = spec().lighthouse
    assert (unset.priority_class_name, unset.image_pull_secrets) == (None, None), "unset: the template's"


# --- the Running condition --------------------------------------------------------------------------------------
REFUSED = 'pods "demo-lighthouse-0" is forbidden: violates PodSecurity "restricted:latest": runAsNonRoot != true'


def _running(pods: list[PodView], refused: dict[int, str] | None = None, generation: int = 0) -> dict[str, Any]:
    s = spec()
    r = run(s, steady(s), healthy_job(s))  # every group's pods run
    r.state.lighthouse_generation = generation
    status = build_status(job=JOB, spec=s, state=r.state, phases=r.group_phases, pods=pods, lighthouse=None,
                          previous=None, generation=1, now=NOW, create_refused=refused)  # fmt: skip
    return next(c for c in status["conditions"] if c["type"] == "Running")


def _with_lighthouse(view: PodView | None) -> list[PodView]:
    workers = [p for p in healthy_job(spec()) if p.name != lighthouse().name]
    return workers if view is None else [view, *workers]


def _pending(**kw: Any) -> PodView:
    return dataclasses.replace(lighthouse(phase="Pending"), **kw)


@pytest.mark.parametrize(
    "view, refused, said",
    [
        (None, {LIGHTHOUSE: REFUSED}, "the apiserver refused to create lighthouse pod demo-lighthouse-0: pods"),
        (None, None, "lighthouse pod demo-lighthouse-0 does not exist yet"),
        (lighthouse(phase="Pending"), None, "lighthouse pod demo-lighthouse-0 is Pending"),
        (_pending(unschedulable="0/2 nodes are available"), None,
         "is Pending (Unschedulable: pod demo-lighthouse-0: 0/2 nodes are available)"),
        (_pending(waiting_reason="ImagePullBackOff", waiting_container="lighthouse"), None,
         "is Pending (ImagePullBackOff: pod demo-lighthouse-0 container lighthouse)"),
        (lighthouse(phase="Failed", exit_code=1, exit_reason="Error"), None,
         "lighthouse pod demo-lighthouse-0 failed (exit code 1, Error)"),
        (lighthouse(deletion_time=NOW), None, "lighthouse pod demo-lighthouse-0 is terminating"),
        (lighthouse(phase="Unknown"), None, "lighthouse pod demo-lighthouse-0 is Unknown"),
    ],
)  # fmt: skip
def test_no_quorum_is_claimed_while_the_lighthouse_does_not_run(view, refused, said):
    running = _running(_with_lighthouse(view), refused)
    assert running["status"] == "False" and running["reason"] == REASON_LIGHTHOUSE_NOT_RUNNING, running
    assert said in running["message"] and "3 of 3 replica groups running" in running["message"], running


def test_a_running_lighthouse_with_enough_groups_is_quorum_possible():
    running = _running(_with_lighthouse(lighthouse()), {LIGHTHOUSE: "an old refusal, since repaired"})
    assert (running["status"], running["reason"]) == ("True", "QuorumPossible"), running
    old = _running(_with_lighthouse(lighthouse()), generation=1)  # generation 0 runs on, its successor does not
    assert old["reason"] == REASON_LIGHTHOUSE_NOT_RUNNING, "only the current generation's pod counts"
    assert "lighthouse pod demo-lighthouse-1 does not exist yet" in old["message"], old


def test_a_job_paused_while_every_group_runs_reads_degraded_not_created():
    s = spec()
    r = run(s, steady(s), healthy_job(s))
    status = build_status(job=JOB, spec=s, state=r.state, phases=r.group_phases,
                          pods=_with_lighthouse(lighthouse(phase="Pending")), lighthouse=None, previous=None,
                          generation=1, now=NOW)  # fmt: skip
    degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", REASON_LIGHTHOUSE_NOT_RUNNING), degraded
    assert status["phase"] == "Degraded", status["phase"]
