"""examples/k8s/*.yaml as a user applies them: every manifest passes the apiserver's validation of the CRD, and the
MLP example's loop (the library's high-level API in a real trainer image) runs to Succeeded under the operator with
one group killed, every group ending at the same step with the same parameters."""

from __future__ import annotations

import re

import pytest
import yaml
from helpers import REPO, TRAINER_IMAGE, kubectl, wait_for
from opkit import condition, create_job, get_job, kill_pod_processes, lighthouse_status, pod_log, running_groups

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

EXAMPLES = sorted((REPO / "examples" / "k8s").glob("*.yaml"))
DONE = re.compile(r"FTJOB_DONE group=(\S+) step=(\d+) digest=(\S+)")


def _manifest(path) -> dict:
    job = yaml.safe_load(path.read_text())
    job["spec"]["template"]["spec"]["containers"][0]["image"] = TRAINER_IMAGE
    return job


def test_every_example_manifest_is_valid(kube, namespace, tmp_path):
    assert {p.stem for p in EXAMPLES} >= {"mlp", "fsdp", "gpt", "ddp"}
    for path in EXAMPLES:
        kubectl(kube.kubeconfig, "apply", "--dry-run=server", "-n", namespace, "-f", str(path))


def test_mlp_example_runs_under_the_operator(kube, namespace, operators):
    operators()
    job = _manifest(REPO / "examples" / "k8s" / "mlp.yaml")
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
