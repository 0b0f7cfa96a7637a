"""The chart's operator, running in-cluster under its own ServiceAccount, trains the sample job of crds/examples/ to
Succeeded (the real reference trainer, no stand-in)."""

from __future__ import annotations

import pytest
import yaml
from ftjob import contract

from tests.support.chart_releases import helm_release
from tests.support.cluster import TRAINER_IMAGE
from tests.support.helm import ok
from tests.support.paths import REPO
from tests.support.polling import wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

SAMPLE = REPO / "crds" / "examples" / "tiny-cpu.yaml"


def test_sample_job_trains_to_succeeded_under_the_chart_operator(kube, namespace: str) -> None:
    job = yaml.safe_load(SAMPLE.read_text())
    name = job["metadata"]["name"]
    # the manifest as a user applies it, with the trainer image this checkout built (the sample names a registry's)
    job["spec"]["template"]["spec"]["containers"][0]["image"] = TRAINER_IMAGE
    with helm_release(kube, namespace, {"watchNamespaces": f"{{{namespace}}}"}, wait=True) as rel:
        ok(["kubectl", "apply", "-n", namespace, "-f", "-"], kube.kubeconfig, stdin=yaml.safe_dump(job))

        def finished() -> dict | None:
            obj = kube.custom.get_namespaced_custom_object(
                contract.API_GROUP, contract.API_VERSION, namespace, contract.PLURAL, name
            )
            conds = {c["type"]: c["status"] for c in (obj.get("status") or {}).get("conditions") or []}
            return obj if "True" in (conds.get("Succeeded"), conds.get("Failed")) else None

        obj = wait_for(finished, 900, f"job {name} to finish")
        conds = {c["type"]: c for c in obj["status"]["conditions"]}
        assert conds["Succeeded"]["status"] == "True", conds
        args = job["spec"]["template"]["spec"]["containers"][0]["args"]
        steps = int(args[args.index("--steps") + 1])
        assert obj["status"]["quorum"]["step"] >= steps - 1, obj["status"]["quorum"]
        # Every pod of the job was made by the in-cluster operator of this release, not by anyone else.
        operator_pods = kube.core.list_namespaced_pod(
            namespace, label_selector=f"app.kubernetes.io/instance={rel.name}"
        )
        assert [p.spec.service_account_name for p in operator_pods.items] == [rel.service_account]
