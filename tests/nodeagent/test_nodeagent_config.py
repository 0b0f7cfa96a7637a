"""Env vars (value, valueFrom, envFrom) and Secret/ConfigMap/downwardAPI volumes inside a node-agent container."""

from __future__ import annotations

import json

import pytest
from helpers import Kube, wait_for
from nodeagent_pods import logs, pod, wait_phase

pytestmark = pytest.mark.cluster

DUMP = """
import json, os, pathlib, stat
def files(root):
    out = {}
    for p in sorted(pathlib.Path(root).rglob('*')):
        if p.is_file() and not any(part.startswith('..') for part in p.parts):
            out[str(p.relative_to(root))] = [p.read_text(), oct(stat.S_IMODE(p.stat().st_mode))]
    return out
keys = ['PLAIN', 'EXPANDED', 'POD_NAME', 'POD_NS', 'POD_IP', 'NODE', 'TEAM', 'FROM_SECRET', 'FROM_CM', 'CM_color',
        'SEC_password', 'KUBERNETES_SERVICE_HOST']
print(json.dumps({
    'env': {k: os.environ.get(k) for k in keys},
    'secret': files('/etc/sec'), 'config': files('/etc/cfg'), 'downward': files('/etc/info'),
    'sa': sorted(os.listdir('/var/run/secrets/kubernetes.io/serviceaccount')),
    'cwd': os.getcwd(),
}))
"""


def test_env_and_secret_configmap_downward_volumes_appear_in_the_container(kube: Kube, namespace: str) -> None:
    kube.core.create_namespaced_secret(
        namespace, {"metadata": {"name": "creds"}, "stringData": {"password": "s3cret", "user": "alice"}}
    )
    kube.core.create_namespaced_config_map(namespace, {"metadata": {"name": "settings"}, "data": {"color": "blue"}})
    env = [
        {"name": "PLAIN", "value": "hello"},
        {"name": "EXPANDED", "value": "$(PLAIN)-world"},
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_NS", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
        {"name": "TEAM", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['team']"}}},
        {"name": "FROM_SECRET", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "user"}}},
        {"name": "FROM_CM", "valueFrom": {"configMapKeyRef": {"name": "settings", "key": "color"}}},
    ]
    mounts = [
        {"name": "sec", "mountPath": "/etc/sec", "readOnly": True},
        {"name": "cfg", "mountPath": "/etc/cfg"},
        {"name": "info", "mountPath": "/etc/info"},
    ]
    volumes = [
        {"name": "sec", "secret": {"secretName": "creds", "items": [{"key": "password", "path": "pw", "mode": 0o400}]}},
        {"name": "cfg", "configMap": {"name": "settings", "defaultMode": 0o640}},
        {"name": "info", "downwardAPI": {"items": [{"path": "labels", "fieldRef": {"fieldPath": "metadata.labels"}}]}},
    ]
    manifest = pod(
        "dump",
        DUMP,
        labels={"app": "dump", "team": "ml"},
        container={
            "env": env,
            "envFrom": [
                {"configMapRef": {"name": "settings"}, "prefix": "CM_"},
                {"secretRef": {"name": "creds"}, "prefix": "SEC_"},
            ],
            "volumeMounts": mounts,
            "workingDir": "/etc/cfg",
        },
        volumes=volumes,
    )
    kube.core.create_namespaced_pod(namespace, manifest)

    done = wait_phase(kube.core, namespace, "dump", "Succeeded")
    seen = json.loads(logs(kube.kubeconfig, namespace, "dump"))

    assert seen["env"] == {
        "PLAIN": "hello",
        "EXPANDED": "hello-world",
        "POD_NAME": "dump",
        "POD_NS": namespace,
        "POD_IP": done.status.pod_ip,
        "NODE": done.spec.node_name,
        "TEAM": "ml",
        "FROM_SECRET": "alice",
        "FROM_CM": "blue",
        "CM_color": "blue",
        "SEC_password": "s3cret",
        "KUBERNETES_SERVICE_HOST": seen["env"]["KUBERNETES_SERVICE_HOST"],
    }
    assert seen["env"]["KUBERNETES_SERVICE_HOST"]
    assert seen["secret"] == {"pw": ["s3cret", "0o400"]}
    assert seen["config"] == {"color": ["blue", "0o640"]}
    assert 'team="ml"' in seen["downward"]["labels"][0]
    assert seen["sa"] == ["ca.crt", "namespace", "token"]
    assert seen["cwd"] == "/etc/cfg"


def test_missing_secret_keeps_the_container_waiting_with_a_clear_reason(kube: Kube, namespace: str) -> None:
    manifest = pod(
        "nosecret",
        "print('should not run')",
        container={"env": [{"name": "X", "valueFrom": {"secretKeyRef": {"name": "absent", "key": "k"}}}]},
    )
    kube.core.create_namespaced_pod(namespace, manifest)

    def waiting_reason() -> str | None:
        statuses = kube.core.read_namespaced_pod("nosecret", namespace).status.container_statuses or []
        waiting = statuses[0].state.waiting if statuses else None
        return waiting.reason if waiting and waiting.reason == "CreateContainerConfigError" else None

    wait_for(waiting_reason, 60, "the container to wait with CreateContainerConfigError")
    statuses = kube.core.read_namespaced_pod("nosecret", namespace).status.container_statuses
    assert "absent" in statuses[0].state.waiting.message

    # Creating the Secret lets the pod start: nothing was lost while it waited.
    kube.core.create_namespaced_secret(namespace, {"metadata": {"name": "absent"}, "stringData": {"k": "v"}})
    wait_phase(kube.core, namespace, "nosecret", "Succeeded")
