"""What the operator relies on from real nodes (kubelet + containerd + runc): exit codes and restart policies,
OOMKilled under a memory limit, security contexts enforced, `kubectl logs` / `kubectl exec`, and GPUs from the
device plugin."""

from __future__ import annotations

import pytest
from kubernetes import client

from tests.support.cluster import OPERATOR_IMAGE, TRAINER_IMAGE, Kube, kubectl, node_names
from tests.support.podspecs import SLEEPER, describe_pods, python_pod, running_ip, wait_exit_code
from tests.support.polling import wait_for

pytestmark = pytest.mark.cluster


def _state(kube: Kube, ns: str, name: str) -> client.V1ContainerState | None:
    statuses = kube.core.read_namespaced_pod(name, ns).status.container_statuses or []
    return statuses[0].state if statuses else None


def test_exit_code_reaches_the_pod_status(kube: Kube, namespace: str) -> None:
    kube.core.create_namespaced_pod(namespace, python_pod("exit3", "import sys; sys.exit(3)"))
    assert wait_exit_code(kube.core, namespace, "exit3", timeout=60) == 3
    assert kube.core.read_namespaced_pod("exit3", namespace).status.phase == "Failed"


def test_restart_policy_onfailure_restarts_the_container(kube: Kube, namespace: str) -> None:
    kube.core.create_namespaced_pod(namespace, python_pod("flaky", "import sys; sys.exit(1)", restart="OnFailure"))

    def restarted() -> int:
        statuses = kube.core.read_namespaced_pod("flaky", namespace).status.container_statuses or []
        return statuses[0].restart_count if statuses and statuses[0].restart_count >= 2 else 0

    wait_for(restarted, 90, "the kubelet to restart the failing container twice")
    assert kube.core.read_namespaced_pod("flaky", namespace).status.phase != "Failed"


def test_memory_limit_is_enforced_as_oomkilled(kube: Kube, namespace: str) -> None:
    pod = python_pod("hog", "x = bytearray(400 * 2**20); print('not killed')")
    pod.spec.containers[0].resources = client.V1ResourceRequirements(limits={"memory": "64Mi"})
    kube.core.create_namespaced_pod(namespace, pod)
    assert wait_exit_code(kube.core, namespace, "hog", timeout=60) == 137
    terminated = _state(kube, namespace, "hog").terminated
    assert terminated.reason == "OOMKilled", terminated


def test_security_context_runs_non_root_with_a_read_only_root(kube: Kube, namespace: str) -> None:
    script = "import os, sys\nprint(os.getuid(), os.getgid())\ntry:\n    open('/probe', 'w')\nexcept OSError as e:\n"
    script += "    print('write refused:', e.strerror)\n    sys.exit(0)\nsys.exit(1)"
    pod = python_pod("locked", script)
    pod.spec.security_context = client.V1PodSecurityContext(run_as_non_root=True, run_as_user=65532, run_as_group=65532)
    pod.spec.containers[0].security_context = client.V1SecurityContext(
        read_only_root_filesystem=True,
        allow_privilege_escalation=False,
        capabilities=client.V1Capabilities(drop=["ALL"]),
    )
    kube.core.create_namespaced_pod(namespace, pod)
    assert wait_exit_code(kube.core, namespace, "locked", timeout=60) == 0
    logs = kube.core.read_namespaced_pod_log("locked", namespace)
    assert logs.splitlines()[0] == "65532 65532", logs
    assert "write refused: Read-only file system" in logs


def test_run_as_non_root_refuses_an_image_that_runs_as_root(kube: Kube, namespace: str) -> None:
    pod = python_pod("rooted", SLEEPER)  # the base image's user is root
    pod.spec.security_context = client.V1PodSecurityContext(run_as_non_root=True)
    kube.core.create_namespaced_pod(namespace, pod)

    def refused() -> str:
        state = _state(kube, namespace, "rooted")
        reason = state.waiting.reason if state and state.waiting else ""
        return reason if reason not in ("", "ContainerCreating") else ""

    assert wait_for(refused, 60, "the kubelet to refuse a root container") == "CreateContainerConfigError"


def test_kubectl_logs_and_exec_reach_the_container(kube: Kube, namespace: str) -> None:
    kube.core.create_namespaced_pod(
        namespace, python_pod("talker", f"print('hello from the pod', flush=True)\n{SLEEPER}")
    )
    wait_for(lambda: running_ip(kube.core, namespace, "talker"), 60, "the pod to run",
             describe=lambda: describe_pods(kube.core, namespace))  # fmt: skip
    wait_for(
        lambda: "hello from the pod" in kubectl(kube.kubeconfig, "logs", "-n", namespace, "talker").stdout,
        30,
        "kubectl logs to show the pod's output",
    )
    out = kubectl(kube.kubeconfig, "exec", "-n", namespace, "talker", "--", "python", "-c",
                  "import os; print('exec in', os.environ['HOSTNAME'])").stdout  # fmt: skip
    assert out.strip() == "exec in talker"
    failing = kubectl(kube.kubeconfig, "exec", "-n", namespace, "talker", "--", "sh", "-c", "exit 7", check=False)
    assert failing.returncode == 7, "kubectl exec must pass the command's exit code through"


def test_device_plugin_advertises_gpus_and_hands_them_to_a_pod(kube: Kube, namespace: str) -> None:
    nodes = {n.metadata.name: n for n in kube.core.list_node().items}
    for name in node_names():
        assert int(nodes[name].status.allocatable.get("nvidia.com/gpu", "0")) > 0, f"{name} advertises no GPUs"
    pod = python_pod("gpu", "import os; print(os.environ.get('NVIDIA_VISIBLE_DEVICES', 'none'))")
    pod.spec.containers[0].resources = client.V1ResourceRequirements(limits={"nvidia.com/gpu": "2"})
    kube.core.create_namespaced_pod(namespace, pod)
    assert wait_exit_code(kube.core, namespace, "gpu", timeout=60) == 0
    devices = kube.core.read_namespaced_pod_log("gpu", namespace).strip().split(",")
    assert len(devices) == 2 and all(d.startswith("fake-gpu-") for d in devices), devices


def test_a_pod_asking_for_more_gpus_than_any_node_has_stays_unschedulable(kube: Kube, namespace: str) -> None:
    pod = python_pod("greedy", SLEEPER)
    pod.spec.containers[0].resources = client.V1ResourceRequirements(limits={"nvidia.com/gpu": "99"})
    kube.core.create_namespaced_pod(namespace, pod)

    def unschedulable() -> str:
        conditions = kube.core.read_namespaced_pod("greedy", namespace).status.conditions or []
        cond = next((c for c in conditions if c.type == "PodScheduled" and c.status == "False"), None)
        return cond.message if cond is not None and cond.reason == "Unschedulable" else ""

    message = wait_for(unschedulable, 60, "the scheduler to report the pod Unschedulable")
    assert "nvidia.com/gpu" in message, message


def test_images_keep_their_promises(kube: Kube, namespace: str) -> None:
    """The operator image: non-root, ftjob-operator, no torch; the trainer image: non-root, torch importable."""
    probe = "import importlib.util, os, shutil; print(os.getuid(), bool(importlib.util.find_spec('torch')), "
    probe += "bool(shutil.which('ftjob-operator')), bool(shutil.which('ftjob-trainer')))"
    for name, image in (("op", OPERATOR_IMAGE), ("tr", TRAINER_IMAGE)):
        pod = python_pod(name, probe)
        pod.spec.containers[0].image = image
        kube.core.create_namespaced_pod(namespace, pod)
    assert wait_exit_code(kube.core, namespace, "op", timeout=90) == 0
    assert wait_exit_code(kube.core, namespace, "tr", timeout=90) == 0
    assert kube.core.read_namespaced_pod_log("op", namespace).split() == ["65532", "False", "True", "True"]
    assert kube.core.read_namespaced_pod_log("tr", namespace).split() == ["65532", "True", "True", "True"]
    # no command: the image's ENTRYPOINT runs
    entry = client.V1Pod(
        metadata=client.V1ObjectMeta(name="entry"),
        spec=client.V1PodSpec(restart_policy="Never",
                              containers=[client.V1Container(name="main", image=OPERATOR_IMAGE, args=["--help"])]),
    )  # fmt: skip
    kube.core.create_namespaced_pod(namespace, entry)
    assert wait_exit_code(kube.core, namespace, "entry", timeout=60) == 0
    assert "--leader-election" in kube.core.read_namespaced_pod_log("entry", namespace)
