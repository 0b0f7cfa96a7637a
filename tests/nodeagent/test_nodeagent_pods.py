"""Pods really run on the node agent: phases, exit codes, logs, deletion with SIGTERM, restarts, init containers."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import Kube, wait_for
from kubernetes import client
from nodeagent_pods import logs, pod, wait_log, wait_phase

pytestmark = pytest.mark.cluster


def test_pod_runs_to_succeeded_and_kubectl_logs_returns_its_output(kube: Kube, namespace: str) -> None:
    script = "import os\nfor i in range(5): print('line', i)\nprint('host', os.environ['HOSTNAME'])"
    kube.core.create_namespaced_pod(namespace, pod("hello", script))

    done = wait_phase(kube.core, namespace, "hello", "Succeeded")

    state = done.status.container_statuses[0].state.terminated
    assert (state.exit_code, state.reason) == (0, "Completed")
    assert done.status.pod_ip and done.status.host_ip and done.status.start_time
    out = logs(kube.kubeconfig, namespace, "hello")
    assert "line 0" in out and "line 4" in out and "host hello" in out
    assert logs(kube.kubeconfig, namespace, "hello", "--tail=1").strip() == "host hello"


def test_failing_pod_reports_its_exit_code(kube: Kube, namespace: str) -> None:
    kube.core.create_namespaced_pod(namespace, pod("fails", "import sys; print('bye'); sys.exit(3)"))

    done = wait_phase(kube.core, namespace, "fails", "Failed")

    state = done.status.container_statuses[0].state.terminated
    assert (state.exit_code, state.reason) == (3, "Error")
    assert done.status.container_statuses[0].restart_count == 0


def test_container_without_command_fails_with_reason_nocommand(kube: Kube, namespace: str) -> None:
    manifest = pod("nocmd", "unused")
    del manifest["spec"]["containers"][0]["command"]

    kube.core.create_namespaced_pod(namespace, manifest)

    done = wait_phase(kube.core, namespace, "nocmd", "Failed")

    assert done.status.container_statuses[0].state.terminated.reason == "NoCommand"


SIGTERM_SCRIPT = """
import signal, sys, time
import os
def on_term(*_):
    after = ' after preStop' if os.path.exists('/marker/prestop') else ''
    open('/marker/got-sigterm', 'w').write('SIGTERM' + after)
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
print('handler installed', flush=True)
while True:
    time.sleep(1)
"""


PRESTOP = "open('/marker/prestop', 'w').write('ran')"


def test_delete_runs_prestop_then_sends_sigterm_and_the_pod_disappears(kube: Kube, namespace: str, tmp_path) -> None:
    marker_dir = tmp_path / "marker"
    marker_dir.mkdir()
    manifest = pod(
        "term",
        SIGTERM_SCRIPT,
        container={
            "volumeMounts": [{"name": "marker", "mountPath": "/marker"}],
            "lifecycle": {"preStop": {"exec": {"command": ["python", "-c", PRESTOP]}}},
        },
        volumes=[{"name": "marker", "hostPath": {"path": str(marker_dir), "type": "Directory"}}],
        terminationGracePeriodSeconds=60,
    )
    kube.core.create_namespaced_pod(namespace, manifest)
    uid = wait_phase(kube.core, namespace, "term", "Running").metadata.uid
    wait_log(kube.kubeconfig, namespace, "term", "handler installed")

    kube.core.delete_namespaced_pod("term", namespace)

    wait_for(lambda: (marker_dir / "got-sigterm").exists(), 30, "the pod's SIGTERM handler to write its marker")

    def gone() -> bool:
        try:
            return kube.core.read_namespaced_pod("term", namespace).metadata.uid != uid
        except client.ApiException as e:
            return e.status == 404

    # The handler exits at once, so the pod must go long before its 60 s grace period would force it.
    wait_for(gone, 30, "the deleted pod object to disappear")
    assert (marker_dir / "got-sigterm").read_text() == "SIGTERM after preStop"


RESTARTS_UNTIL_THIRD = """
import pathlib, sys
counter = pathlib.Path('/scratch/attempts')
n = int(counter.read_text()) + 1 if counter.exists() else 1
counter.write_text(str(n))
print('attempt', n, flush=True)
sys.exit(0 if n >= 3 else 1)
"""


def test_restart_policy_onfailure_restarts_with_restart_count(kube: Kube, namespace: str) -> None:
    manifest = pod(
        "retry",
        RESTARTS_UNTIL_THIRD,
        restart="OnFailure",
        container={"volumeMounts": [{"name": "scratch", "mountPath": "/scratch"}]},
        volumes=[{"name": "scratch", "emptyDir": {}}],
    )
    kube.core.create_namespaced_pod(namespace, manifest)

    done = wait_phase(kube.core, namespace, "retry", "Succeeded", timeout=90)

    status = done.status.container_statuses[0]
    assert status.restart_count == 2
    assert status.state.terminated.exit_code == 0
    assert status.last_state.terminated.exit_code == 1
    assert logs(kube.kubeconfig, namespace, "retry").strip() == "attempt 3"
    assert logs(kube.kubeconfig, namespace, "retry", "--previous").strip() == "attempt 2"


def test_init_containers_run_first_and_in_order(kube: Kube, namespace: str) -> None:
    def init(name: str) -> dict:
        script = f"open('/shared/order', 'a').write('{name} ')"
        return {
            "name": name,
            "image": "python",
            "command": ["python", "-c", script],
            "volumeMounts": [{"name": "shared", "mountPath": "/shared"}],
        }

    manifest = pod(
        "inits",
        "print(open('/shared/order').read() + 'main')",
        container={"volumeMounts": [{"name": "shared", "mountPath": "/shared"}]},
        initContainers=[init("first"), init("second")],
        volumes=[{"name": "shared", "emptyDir": {}}],
    )
    kube.core.create_namespaced_pod(namespace, manifest)

    done = wait_phase(kube.core, namespace, "inits", "Succeeded")

    assert [s.state.terminated.exit_code for s in done.status.init_container_statuses] == [0, 0]
    assert logs(kube.kubeconfig, namespace, "inits").strip() == "first second main"
    conditions = {c.type: c.status for c in done.status.conditions}
    assert conditions["Initialized"] == "True"


def test_failing_init_container_fails_the_pod_and_main_never_runs(kube: Kube, namespace: str) -> None:
    manifest = pod(
        "badinit",
        "print('main ran')",
        initContainers=[{"name": "setup", "image": "python", "command": ["python", "-c", "raise SystemExit(7)"]}],
    )
    kube.core.create_namespaced_pod(namespace, manifest)

    done = wait_phase(kube.core, namespace, "badinit", "Failed")

    assert done.status.init_container_statuses[0].state.terminated.exit_code == 7
    assert done.status.container_statuses[0].state.waiting is not None
    assert done.status.container_statuses[0].state.running is None


def test_failing_liveness_probe_restarts_the_container(kube: Kube, namespace: str) -> None:
    # Nothing listens on 8080, so the tcpSocket liveness probe fails and the agent must kill and restart the container.
    manifest = pod(
        "unhealthy",
        "import time\nprint('up', flush=True)\ntime.sleep(3600)",
        restart="Always",
        container={"livenessProbe": {"tcpSocket": {"port": 8080}, "periodSeconds": 1, "failureThreshold": 2}},
    )
    kube.core.create_namespaced_pod(namespace, manifest)

    def restarted() -> client.V1ContainerStatus | None:
        statuses = kube.core.read_namespaced_pod("unhealthy", namespace).status.container_statuses or []
        return statuses[0] if statuses and statuses[0].restart_count >= 1 else None

    status = wait_for(restarted, 90, "the liveness probe to restart the container")
    assert status.last_state.terminated.exit_code == 143  # SIGTERM: python's default action
    assert "liveness" in status.last_state.terminated.message


def test_host_network_pod_fails_with_a_message_saying_what_to_change(kube: Kube, namespace: str) -> None:
    kube.core.create_namespaced_pod(namespace, pod("hostnet", "print('no')", hostNetwork=True))

    done = wait_phase(kube.core, namespace, "hostnet", "Failed")

    assert "drop hostNetwork" in done.status.message


def test_volume_mounted_over_the_checkout_keeps_the_pods_own_code_visible(kube: Kube, namespace: str) -> None:
    # Pods share the host filesystem; a chart that mounts an emptyDir at /tmp must not hide a checkout in /tmp/x.
    repo = Path(__file__).resolve().parents[2]
    cover = repo.parent if repo.parent != Path("/") else repo
    probe = cover / f"volume-probe-{namespace}"
    script = (
        "import ftjob.trainer.contract, os\n"
        f"if {str(cover) != str(repo)}: open({str(probe)!r}, 'w').write('in the volume')\n"
        "print('imported', ftjob.trainer.contract.API_GROUP)"
    )
    kube.core.create_namespaced_pod(
        namespace,
        pod(
            "covered",
            script,
            container={"volumeMounts": [{"name": "scratch", "mountPath": str(cover)}]},
            volumes=[{"name": "scratch", "emptyDir": {}}],
        ),
    )

    wait_phase(kube.core, namespace, "covered", "Succeeded")

    assert "imported ftjob.dev" in logs(kube.kubeconfig, namespace, "covered")
    assert not probe.exists()  # the pod wrote into its volume, not onto the host
