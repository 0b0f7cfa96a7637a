"""Integrity on the real cluster: the reference trainer under the operator, three replica groups, one made faulty
by the trainer's test-only fault injection (FTJOB_FAULT_INJECTION; it applies to generation 0 only, so the
replacement trains cleanly). The lighthouse evicts the faulty group (gradient guard: NaN gradients; digest check: a
flipped bit); the operator replaces it with that reason (condition, Event, status, metric) on another node, mirrors
the lighthouse's audit records as Events exactly once (also across an operator restart), and the job Succeeds with
equal final parameters. Also: the apiserver refuses bad spec.integrity values and applies its defaults."""

from __future__ import annotations

import datetime
import json
import re
import threading
from typing import Any

import pytest
from ftjob import contract
from ftjob.contract.lighthouse_api import AuditRecord
from kubernetes import client, watch

from tests.support.operator_cluster import (
    condition,
    create_job,
    dropped_reasons,
    get_job,
    job_manifest,
    lighthouse_status,
    running_groups,
)
from tests.support.polling import wait_for
from tests.support.trainer_runs import check_run, training_job

pytestmark = pytest.mark.cluster

STEPS = 200
AUDIT_REASONS = {
    "GradientGuardRefused",
    "ReplicaDivergent",
    "LighthouseRefused",
    "OutdatedIncarnationRefused",
    "LighthouseEvictedGroup",
}


class JobObserver:
    """What is gone once the job ends: every True condition the job showed (a watch: Recovering is True only while
    the replacement starts) and the lighthouse's audit records and drops (it is stopped when the job Succeeds)."""

    def __init__(self, kube: Any, namespace: str, job: str) -> None:
        self.kube, self.namespace, self.job = kube, namespace, job
        self.conditions: list[tuple[str, str, str]] = []
        self.audit: dict[int, AuditRecord] = {}
        self.drops: dict[str, str] = {}
        self._watch = watch.Watch()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._conditions, daemon=True)
        self._thread.start()

    def _conditions(self) -> None:
        while not self._stopped.is_set():  # the apiserver ends a watch now and then: watch again
            try:
                args = (contract.API_GROUP, contract.API_VERSION, self.namespace, contract.PLURAL)
                only = f"metadata.name={self.job}"
                stream = self._watch.stream(self.kube.custom.list_namespaced_custom_object, *args,
                                            field_selector=only, timeout_seconds=300)  # fmt: skip
                for ev in stream:
                    for c in (ev["object"].get("status") or {}).get("conditions") or []:
                        seen = (c["type"], c.get("reason", ""), c.get("message", ""))
                        if c.get("status") == "True" and seen not in self.conditions:
                            self.conditions.append(seen)
            except Exception:
                self._stopped.wait(0.2)  # (the interval before watching again, not synchronisation)

    def poll(self) -> None:
        """Reads the lighthouse (while it runs) into audit / drops; errors are 'not now'."""
        try:
            status = lighthouse_status(self.kube.core, self.namespace, self.job)
        except Exception:
            return
        self.audit.update({r.seq: r for r in status.audit})
        self.drops.update(dropped_reasons(status))

    def finished(self) -> dict[str, Any] | None:
        self.poll()
        job = get_job(self.kube.custom, self.namespace, self.job)
        return job if condition(job, "Succeeded") or condition(job, "Failed") else None

    def stop(self) -> None:
        self._stopped.set()
        self._watch.stop()


def faulty_job(name: str, records: Any, fault: str, digest_every: int = 100) -> dict[str, Any]:
    """Three groups, one faulty. The norm rule is set far out (normRatio 1000): the tiny model's per-shard gradient
    norms are heavy-tailed (with the default 10, a healthy step 27 was refused with norms ~100x the median in two
    groups in turn, and both were evicted), and these tests are about NaNs and flipped bits."""
    integrity = {"gradientGuard": {"normRatio": 1000}, "digestEverySteps": digest_every}
    m = training_job(name, STEPS, records, replicas=3, minReplicas=2, integrity=integrity)
    m["spec"]["template"]["spec"]["containers"][0]["env"] = [{"name": contract.ENV_FAULT_INJECTION, "value": fault}]
    return m


def job_events(core: client.CoreV1Api, namespace: str, job: str) -> list[client.CoreV1Event]:
    return core.list_namespaced_event(namespace, field_selector=f"involvedObject.name={job}").items


def group_pods(core: client.CoreV1Api, namespace: str, job: str, group: int) -> dict[int, client.V1Pod]:
    """generation -> the group's rank-0 pod (finished pods are kept for their logs)."""
    sel = f"{contract.LABEL_JOB}={job},{contract.LABEL_GROUP}={group}"
    return {int(p.metadata.labels[contract.LABEL_GENERATION]): p
            for p in core.list_namespaced_pod(namespace, label_selector=sel).items}  # fmt: skip


def metric(text: str, name: str, **labels: str) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    line = next((ln for ln in text.splitlines() if ln.startswith(f"{name}{{{want}}} ")), None)
    return float(line.split()[-1]) if line else 0.0


def check_replaced(kube: Any, namespace: str, job: str, group: int, reason: str, words: str, old_node: str,
                   obs: JobObserver) -> dict[str, Any]:  # fmt: skip
    """The operator replaced `group` once, for `reason` (not ExitCode), said what was seen, and avoided the node."""
    status = get_job(kube.custom, namespace, job)["status"]
    assert status["restartsByReason"] == {reason: 1} and status["totalRestarts"] == 1, status
    g = next(x for x in status["replicaGroups"] if x["index"] == group)
    assert g["generation"] == 1 and g["lastFailureReason"] == reason and words in g["lastFailure"], g
    assert (g["avoidNode"], g["avoidNodeRequired"]) == (old_node, True), g
    pods = group_pods(kube.core, namespace, job, group)
    assert pods[1].spec.node_name != old_node, f"the replacement ran on {old_node}, the node avoided"
    recovering = [c for c in obs.conditions if c[0] == "Recovering" and c[1] == reason]
    assert recovering and words in recovering[0][2], obs.conditions
    restarts = [e for e in job_events(kube.core, namespace, job) if e.reason == "GroupRestart"]
    assert len(restarts) == 1 and words in restarts[0].message, [e.message for e in restarts]
    assert obs.drops.get(str(group), "").startswith(f"evicted: {words}"), obs.drops
    return status


def check_audit_events(kube: Any, namespace: str, job: str, obs: JobObserver) -> list[client.CoreV1Event]:
    """Every job-level audit record the lighthouse listed is exactly one Event, and no Event is not a record."""
    mirrored = [e for e in job_events(kube.core, namespace, job) if e.reason in AUDIT_REASONS]
    by_seq: dict[int, list[client.CoreV1Event]] = {}
    for e in mirrored:
        seq = int(re.search(r"lighthouse audit #(\d+)\)", e.message).group(1))
        by_seq.setdefault(seq, []).append(e)
        assert (e.count or 1) == 1, f"an Event was posted again: {e.message}"
    assert set(by_seq) == set(obs.audit), (sorted(by_seq), sorted(obs.audit))
    assert all(len(es) == 1 for es in by_seq.values()), {s: [e.metadata.name for e in es] for s, es in by_seq.items()}
    for seq, [e] in by_seq.items():
        record = obs.audit[seq]
        assert record.reason in e.message and record.outcome in e.message, (record, e.message)
    return mirrored


# --- the gradient guard -------------------------------------------------------------------------------------------
def test_nan_gradients_evict_and_replace_the_group_on_another_node(kube, namespace, operators, records):
    first = operators()
    fault = "group=1,kind=nan,step=30,count=3"
    create_job(kube.custom, namespace, faulty_job("guard", records, fault))
    obs = JobObserver(kube, namespace, "guard")
    try:
        groups = wait_for(lambda: (g := running_groups(kube.core, namespace, "guard")) and len(g) == 3 and g, 240,
                          "3 training groups running")  # fmt: skip
        old_node = groups[1][0].spec.node_name

        def replaced_and_mirrored() -> bool:
            obs.poll()
            status = get_job(kube.custom, namespace, "guard").get("status") or {}
            guard = [r.seq for r in obs.audit.values() if r.kind == "guard"]
            mirrored = (status.get("integrity") or {}).get("auditSeq", 0)
            # the GroupRestart Event goes out beside the status patch, not before it: killed earlier, it is lost
            posted = any(e.reason == "GroupRestart" for e in job_events(kube.core, namespace, "guard"))
            restarted = bool(status.get("restartsByReason", {}).get("GradientGuard"))
            return restarted and posted and bool(guard) and mirrored >= max(guard)

        wait_for(replaced_and_mirrored, 300, "group 1 replaced for GradientGuard, its Event and the records mirrored")
        assert metric(first.metrics(), "ftjob_integrity_evictions_total", reason="GradientGuard") == 1
        first.kill()  # a new operator must not mirror the same records again
        mark = get_job(kube.custom, namespace, "guard")["status"]["integrity"]["auditSeq"]  # what it recorded
        second = operators()
        job = wait_for(obs.finished, 600, "the job to finish")
    finally:
        obs.stop()
    assert condition(job, "Succeeded"), job["status"]
    status = check_replaced(kube, namespace, "guard", 1, "GradientGuard", "gradient_guard", old_node, obs)
    integrity = status["integrity"]
    assert integrity["guardOffences"] >= 3 and integrity["guardEvictions"] == 1, integrity
    mirrored = check_audit_events(kube, namespace, "guard", obs)
    guard = [e for e in mirrored if e.reason == "GradientGuardRefused"]
    assert guard and all(e.type == "Warning" and "replica group 1" in e.message for e in guard), guard
    after_kill = [r for r in obs.audit.values() if r.kind == "guard" and r.seq > mark]  # late reports, if any
    assert metric(second.metrics(), "ftjob_audit_events_total", kind="guard") == len(after_kill), (
        f"the restarted operator mirrored guard records again (status had auditSeq {mark})"
    )
    check_run(records, {"0", "1", "2"}, STEPS, {"1"})  # the others' parameters untouched: equal final digests
    print(f"\n[guard] {len(guard)} guard records -> {len(guard)} Events; status.integrity {integrity}")


# --- the digest check ---------------------------------------------------------------------------------------------
def test_a_flipped_bit_is_caught_within_n_steps_and_the_group_heals(kube, namespace, operators, records):
    operators()
    flip, every = 30, 5
    create_job(kube.custom, namespace, faulty_job("flip", records, f"group=2,kind=bitflip,step={flip}", every))
    obs = JobObserver(kube, namespace, "flip")
    try:
        groups = wait_for(lambda: (g := running_groups(kube.core, namespace, "flip")) and len(g) == 3 and g, 240,
                          "3 training groups running")  # fmt: skip
        old_node = groups[2][0].spec.node_name
        job = wait_for(obs.finished, 600, "the job to finish")
    finally:
        obs.stop()
    assert condition(job, "Succeeded"), job["status"]
    status = check_replaced(kube, namespace, "flip", 2, "ReplicaDivergence", "divergent", old_node, obs)
    check_audit_events(kube, namespace, "flip", obs)
    [verdict] = [r for r in obs.audit.values() if r.kind == "divergence" and r.group == "2"]
    caught = int(re.search(r"step (\d+)", verdict.reason).group(1))
    assert 0 <= caught - flip <= every, f"flipped at step {flip}, caught at step {caught} (digest every {every})"
    commits = check_run(records, {"0", "1", "2"}, STEPS, {"2"})
    flipped_at = next(c.t for c in commits["0"] if c.step == flip)  # every group commits a step at about one time
    g2 = next(g for g in status["replicaGroups"] if g["index"] == 2)
    replaced_t = datetime.datetime.fromisoformat(g2["restartTimes"][-1].replace("Z", "+00:00")).timestamp()
    print(f"\n[divergence] bit flipped in group 2 at step {flip}, caught at step {caught} ({caught - flip} steps, "
          f"{verdict.wall_time - flipped_at:.2f}s after step {flip} committed; digest every {every} steps); the "
          f"operator replaced the group {replaced_t - verdict.wall_time:.2f}s after the verdict; "
          f"status.integrity {status['integrity']}")  # fmt: skip
    assert status["integrity"]["divergences"] >= 1


# --- the CRD ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("integrity", "words"),
    [
        ({"gradientGuard": {"normRatio": 1}}, ["spec.integrity.gradientGuard.normRatio", "greater than 1"]),
        ({"gradientGuard": {"maxOffences": 0}}, ["spec.integrity.gradientGuard.maxOffences", "equal to 1"]),
        ({"gradientGuard": {"windowSeconds": 0}}, ["spec.integrity.gradientGuard.windowSeconds"]),
        ({"gradientGuard": {"enabled": "yes"}}, ["spec.integrity.gradientGuard.enabled", "boolean"]),
        ({"digestEverySteps": -5}, ["spec.integrity.digestEverySteps", "greater than or equal to 0"]),
    ],
    ids=["ratio-1", "offences-0", "window-0", "enabled-string", "digest-negative"],
)
def test_bad_integrity_settings_are_refused_by_the_apiserver(kube, crd, namespace, integrity, words):
    with pytest.raises(client.ApiException) as err:
        create_job(kube.custom, namespace, job_manifest("bad", integrity=integrity))
    assert err.value.status == 422, err.value.body
    message = json.loads(err.value.body)["message"]
    for text in words:
        assert text in message, f"{text!r} not in the apiserver's answer: {message}"


def test_integrity_defaults_are_applied(kube, crd, namespace):
    spec = create_job(kube.custom, namespace, job_manifest("ok"))["spec"]
    assert spec["integrity"] == {
        "gradientGuard": {"enabled": True, "normRatio": 100, "maxOffences": 3, "windowSeconds": 600},
        "digestEverySteps": 100,
    }
