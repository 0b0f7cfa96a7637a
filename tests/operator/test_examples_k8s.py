"""The example manifests (crds/examples/*.yaml, examples/k8s/*.yaml) as a user applies them, unchanged, to the local
cluster: every one passes the apiserver's validation of the CRD; every one that needs no GPU pulls nothing (the nodes
carry the images it names), starts, and trains until every group is in the quorum (or the job Succeeded), and is
deleted again; and the MLP example's loop runs to Succeeded with one group killed, every group ending at the same
step with the same parameters."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.cluster import Kube, kubectl
from tests.support.operator_cluster import (
    condition,
    create_job,
    get_job,
    kill_pod_processes,
    lighthouse_status,
    pod_log,
    running_groups,
    worker_pods,
)
from tests.support.paths import REPO
from tests.support.polling import StopWaiting, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

EXAMPLES = sorted((REPO / "crds" / "examples").glob("*.yaml")) + sorted((REPO / "examples" / "k8s").glob("*.yaml"))
RUNNABLE = [p for p in EXAMPLES if "nvidia.com/gpu" not in p.read_text()]  # the local cluster has no GPUs
PULL_FAILURES = ("ErrImagePull", "ImagePullBackOff", "ErrImageNeverPull", "InvalidImageName")
DONE = re.compile(r"FTJOB_DONE group=(\S+) step=(\d+) digest=(\S+)")


def _name(path: Path) -> str:
    return str(path.relative_to(REPO))


def test_every_example_manifest_is_valid(kube: Kube, namespace: str) -> None:
    assert {p.stem for p in EXAMPLES} >= {"tiny-cpu", "gpu-llm", "mlp", "fsdp", "gpt", "ddp"}
    assert {p.stem for p in EXAMPLES} - {p.stem for p in RUNNABLE} == {"gpu-llm"}
    for path in EXAMPLES:
        kubectl(kube.kubeconfig, "apply", "--dry-run=server", "-n", namespace, "-f", str(path))


def _pods_state(kube: Kube, namespace: str) -> list[str]:
    """Each pod's phase and, for a container not running, why: what a timed-out wait shows."""
    out = []
    for pod in kube.core.list_namespaced_pod(namespace).items:
        waiting = [f"{s.name}: {s.state.waiting.reason}" for s in pod.status.container_statuses or []
                   if s.state and s.state.waiting]  # fmt: skip
        out.append(f"{pod.metadata.name} {pod.status.phase} {'; '.join(waiting)}".strip())
    return out


def _trained_or_done(kube: Kube, namespace: str, name: str, replicas: int) -> dict[str, Any] | None:
    """The job once it finished, or once every group is in a quorum that committed a step; a pod whose image cannot
    be pulled stops the wait at once (the node lacks the image the manifest names)."""
    stuck = [state for state in _pods_state(kube, namespace) if any(r in state for r in PULL_FAILURES)]
    if stuck:
        raise StopWaiting(f"image not on the node: {stuck}")
    job = get_job(kube.custom, namespace, name)
    if condition(job, "Succeeded") or condition(job, "Failed"):
        return job
    quorum = (job.get("status") or {}).get("quorum") or {}
    return job if (quorum.get("size") or 0) >= replicas and (quorum.get("step") or 0) >= 1 else None


@pytest.mark.parametrize("path", RUNNABLE, ids=_name)
def test_example_runs_as_written(kube: Kube, namespace: str, operators: Callable[..., Any], path: Path) -> None:
    operators()
    manifest = yaml.safe_load(path.read_text())
    name, replicas = manifest["metadata"]["name"], int(manifest["spec"]["replicas"])
    kubectl(kube.kubeconfig, "apply", "-n", namespace, "-f", str(path))
    job = wait_for(lambda: _trained_or_done(kube, namespace, name, replicas), 300,
                   f"every group of {name} in a quorum that committed a step, or the job to finish",
                   describe=lambda: _pods_state(kube, namespace))  # fmt: skip
    assert not condition(job, "Failed"), job["status"]
    pulls = kube.core.list_namespaced_event(namespace, field_selector="reason=Pulling").items
    assert not pulls, f"the kubelet went to a registry: {[e.message for e in pulls]}"
    kubectl(kube.kubeconfig, "delete", "-n", namespace, "-f", str(path), "--wait=true", "--timeout=120s")
    wait_for(lambda: not worker_pods(kube.core, namespace, name, live_only=False), 120, f"{name}'s pods to be gone",
             describe=lambda: _pods_state(kube, namespace))  # fmt: skip


def test_mlp_example_runs_under_the_operator(kube: Kube, namespace: str, operators: Callable[..., Any]) -> None:
    operators()
    job = yaml.safe_load((REPO / "examples" / "k8s" / "mlp.yaml").read_text())
    name = job["metadata"]["name"]
    create_job(kube.custom, namespace, job)
    groups = wait_for(lambda: (g := running_groups(kube.core, namespace, name)) and len(g) == 3 and g, 240,
                      "3 groups running")  # fmt: skip
    wait_for(lambda: (lighthouse_status(kube.core, namespace, name).max_step) >= 5, 300, "5 commits")
    assert kill_pod_processes(groups[1][0]) >= 1
    done = wait_for(lambda: (j := get_job(kube.custom, namespace, name)) and (condition(j, "Succeeded")
                    or condition(j, "Failed")) and j, 600, "the job to finish")  # fmt: skip
    assert condition(done, "Succeeded"), done["status"]
    assert done["status"]["totalRestarts"] == 1, done["status"]
    finals = {}
    for g in done["status"]["replicaGroups"]:
        match = DONE.search(pod_log(kube.core, namespace, g["pods"][0]))
        assert match, f"no FTJOB_DONE line in {g['pods'][0]}'s log"
        finals[match.group(1)] = (int(match.group(2)), match.group(3))
    assert set(finals) == {"0", "1", "2"} and {s for s, _ in finals.values()} == {300}, finals
    assert len({d for _, d in finals.values()}) == 1, f"groups diverged: {finals}"
