"""Values that break values.schema.json (or a rule the schema cannot express) are refused by helm, naming the value."""

from __future__ import annotations

import pytest
import yaml

from tests.support.helm import CHART, run

# (values, a fragment the error must contain so the user knows what to fix)
BAD_VALUES = {
    "replicaCount-negative": ({"replicaCount": -1}, "replicaCount"),
    "replicaCount-too-many": ({"replicaCount": 50}, "replicaCount"),
    "replicaCount-string": ({"replicaCount": "two"}, "replicaCount"),
    "unknown-top-level-key": ({"replicas": 2}, "replicas"),
    "typo-in-nested-key": ({"leaderElection": {"enable": True}}, "enable"),
    "pullPolicy-enum": ({"image": {"pullPolicy": "Sometimes"}}, "pullPolicy"),
    "bad-digest": ({"image": {"digest": "sha256:abc"}}, "digest"),
    "namespace-not-dns-label": ({"watchNamespaces": ["Team_A"]}, "watchNamespaces"),
    "duplicate-namespaces": ({"watchNamespaces": ["a", "a"]}, "watchNamespaces"),
    "root-user": ({"runAsUser": 0}, "runAsUser"),
    "port-out-of-range": ({"metrics": {"port": 70000}}, "port"),
    "logLevel-enum": ({"logLevel": "trace"}, "logLevel"),
    "bad-quantity": ({"resources": {"limits": {"cpu": "lots"}}}, "cpu"),
    "probe-path-not-absolute": ({"health": {"livenessPath": "healthz"}}, "livenessPath"),
    "extraArgs-not-a-flag": ({"extraArgs": ["rm -rf"]}, "extraArgs"),
    "serviceMonitor-interval": ({"metrics": {"serviceMonitor": {"interval": "often"}}}, "interval"),
}

# Cross-field rules the templates enforce with `fail`. `helm lint` reports a template `fail` only as [INFO] (by
# design), so these are checked where they bite: `helm template` and `helm install`.
BAD_COMBINATIONS = {
    "two-replicas-without-lease": ({"replicaCount": 2, "leaderElection": {"enabled": False}}, "leaderElection.enabled"),
    "metrics-and-health-same-port": ({"metrics": {"port": 9000}, "health": {"port": 9000}}, "different ports"),
    "serviceMonitor-without-service": (
        {"metrics": {"service": {"enabled": False}, "serviceMonitor": {"enabled": True}}},
        "metrics.service.enabled",
    ),
    "existing-sa-without-name": ({"serviceAccount": {"create": False}}, "serviceAccount.name"),
}


@pytest.mark.parametrize("command", ["template", "lint"])
@pytest.mark.parametrize("case", BAD_VALUES, ids=list(BAD_VALUES))
def test_bad_values_are_rejected(case: str, command: str, tmp_path) -> None:
    _assert_rejected(BAD_VALUES[case], command, tmp_path)


@pytest.mark.parametrize("case", BAD_COMBINATIONS, ids=list(BAD_COMBINATIONS))
def test_bad_combinations_are_rejected(case: str, tmp_path) -> None:
    _assert_rejected(BAD_COMBINATIONS[case], "template", tmp_path)


def _assert_rejected(case: tuple[dict, str], command: str, tmp_path) -> None:
    values, must_mention = case
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    args = ["helm", command, *(["bad"] if command == "template" else []), str(CHART), "-f", str(path)]
    proc = run(args)
    assert proc.returncode != 0, f"helm {command} accepted {values}:\n{proc.stdout}"
    assert must_mention in proc.stderr + proc.stdout, f"the error does not name {must_mention!r}:\n{proc.stderr}"


def test_good_values_file_is_accepted(tmp_path) -> None:
    """The same mechanism accepts a valid override (so the rejections above are about the values, not the file)."""
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump({"replicaCount": 2, "watchNamespaces": ["a"], "runAsUser": 1000}))
    proc = run(["helm", "template", "good", str(CHART), "-f", str(path)])
    assert proc.returncode == 0, proc.stderr
